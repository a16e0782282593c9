"""The radix tree of reusable blocks, keyed by block keys (:mod:`kvforge.kvcache.hashing`).

Each reuse scope (LoRA id, ...) and per-request ``cache_salt`` has its own root, whose key is the hasher's
``root_key(scope, cache_salt)``; a node's children are keyed by their block key, so a prompt's path is found by one
dict lookup per block. Full blocks are reused on a key match alone, which the keys' 128 salted bits make safe (see
:mod:`kvforge.kvcache.hashing`). A node (:class:`Block`) holds one page slot per pool group (None where that life
cycle keeps nothing for the block, e.g. a sliding-window page already dropped, or a recurrent state that was never
snapshotted there).

A *partial* block holds fewer than ``tokens_per_block`` tokens (what a request had committed past its last full
block when it ended); it is always a leaf, and is found by comparing tokens, not by hash, through the token index
each node's :class:`~kvforge.kvcache.pools.Children` keeps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from kvforge.kvcache.hashing import BlockKeyHasher
from kvforge.kvcache.pools import Block

__all__ = ["Block", "RadixTree"]


class RadixTree:
    """Roots per (scope, cache_salt) and a count of the blocks below them."""

    __slots__ = ("hasher", "num_blocks", "num_groups", "roots")

    def __init__(self, num_groups: int, hasher: BlockKeyHasher) -> None:
        self.num_groups = num_groups
        self.hasher = hasher
        self.roots: dict[int, Block] = {}
        self.num_blocks = 0

    def root(self, scope: Hashable | None, cache_salt: str | bytes | None = None) -> Block:
        """The root of ``scope`` and ``cache_salt``, created on first use (roots hold no pages, never removed)."""
        key = self.hasher.root_key(scope, cache_salt)
        root = self.roots.get(key)
        if root is None:
            root = Block(key, None, -1, 0, None, self.num_groups)
            self.roots[key] = root
        return root

    def make_root(self, scope: Hashable | None, cache_salt: str | bytes | None = None) -> Block:
        """A root that is not registered (the caller registers it in ``roots`` if it keeps it)."""
        return Block(self.hasher.root_key(scope, cache_salt), None, -1, 0, None, self.num_groups)

    def find_root(self, scope: Hashable | None, cache_salt: str | bytes | None = None) -> Block | None:
        """The root of ``scope`` and ``cache_salt`` if it exists (read-only)."""
        return self.roots.get(self.hasher.root_key(scope, cache_salt))

    def blocks(self) -> Iterator[Block]:
        """Every non-root block, parents before children."""
        stack = list(self.roots.values())
        while stack:
            b = stack.pop()
            if b.parent is not None:
                yield b
            stack.extend(b.children.values())
