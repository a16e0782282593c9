"""Chained block hashes: the identity of a block of tokens everywhere in kvforge (cache tree, router, events).

A block's hash covers its tokens and, through its parent's hash, every token before it, under a reuse scope
(LoRA id, salt, ...). Python's hash of a tuple of ints is deterministic across processes (only str/bytes
hashing is randomised), so hashes computed by a router and by a server agree; the scope, which may hold
strings, is folded in through a stable digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

_ROOT_TAG = 0x6B76_666F_7267_6500  # "kvforge\0"


def scope_root(scope: Hashable | None = None) -> int:
    """The hash every chain under ``scope`` starts from (stable across processes and runs)."""
    if scope is None:
        return _ROOT_TAG
    digest = hashlib.blake2b(repr(scope).encode(), digest_size=8).digest()
    return _ROOT_TAG ^ int.from_bytes(digest, "little", signed=True)


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    return hash((parent, tuple(block_tokens)))


def chain_hashes(parent: int, tokens: Sequence[int], start: int, n_blocks: int, tokens_per_block: int) -> list[int]:
    """Hashes of the ``n_blocks`` full blocks of ``tokens`` from ``start``, chained from ``parent``.

    The hot path of hashing a long prompt: the cost is Python's hash of each block's tuple, so the loop around
    it stays minimal (a comprehension, no per-block ``tuple()`` call when ``tokens`` already is a tuple).
    Converting a list to one tuple first was measured slower than building each block's tuple from a slice:
    it writes every token's reference count once more.
    """
    h = parent
    stops = range(start + tokens_per_block, start + (n_blocks + 1) * tokens_per_block, tokens_per_block)
    if isinstance(tokens, tuple):
        return [h := hash((h, tokens[i - tokens_per_block : i])) for i in stops]
    return [h := hash((h, tuple(tokens[i - tokens_per_block : i]))) for i in stops]


def block_hashes(
    tokens: Sequence[int], tokens_per_block: int, scope: Hashable | None = None, *, parent: int | None = None
) -> list[int]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block has none)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block: expected a positive int, got {tokens_per_block}")
    h = scope_root(scope) if parent is None else parent
    return chain_hashes(h, tokens, 0, len(tokens) // tokens_per_block, tokens_per_block)
