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


def block_hashes(
    tokens: Sequence[int], tokens_per_block: int, scope: Hashable | None = None, *, parent: int | None = None
) -> list[int]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block has none)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block: expected a positive int, got {tokens_per_block}")
    h = scope_root(scope) if parent is None else parent
    out: list[int] = []
    n_full = len(tokens) // tokens_per_block
    for i in range(n_full):
        h = hash((h, tuple(tokens[i * tokens_per_block : (i + 1) * tokens_per_block])))
        out.append(h)
    return out
