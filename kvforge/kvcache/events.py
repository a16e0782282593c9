"""Block events a KV cache manager publishes and a router consumes (data only, no calls back).

``BlockStored``: blocks became reusable (inserted in the radix tree), in prefix order; ``block_keys`` are their
block keys (:mod:`kvforge.kvcache.hashing`) and ``parent_key`` the key of the block before the first one (None at
the root). ``BlockRemoved``: blocks can no longer be reused from this server (dropped from the last tier).
``AllBlocksCleared``: the server's cache was reset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_keys: tuple[int, ...]
    parent_key: int | None
    tokens_per_block: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], None]
