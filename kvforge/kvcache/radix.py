"""The radix tree of reusable blocks, keyed by chained block hashes.

Each reuse scope (LoRA id, salt, ...) has its own root, whose key is :func:`kvforge.kvcache.hashing.scope_root`
of the scope; a node's children are keyed by their chained hash, so a prompt's path is found by one dict
lookup per block. A node (:class:`Block`) holds one page slot per pool group (None where that life cycle
keeps nothing for the block, e.g. a sliding-window page already dropped, or a recurrent state that was never
snapshotted there).

A *partial* block holds fewer than ``tokens_per_block`` tokens (what a request had committed past its last
full block when it ended); it is always a leaf, and is found by comparing tokens, not by hash.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from kvforge.kvcache.hashing import scope_root
from kvforge.kvcache.pools import Block

__all__ = ["Block", "RadixTree"]


class RadixTree:
    """Roots per reuse scope and a count of the blocks below them."""

    __slots__ = ("num_blocks", "num_groups", "roots")

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.roots: dict[int, Block] = {}
        self.num_blocks = 0

    def root(self, scope: Hashable | None) -> Block:
        """The root of ``scope``, created on first use (roots hold no pages and are never removed)."""
        key = scope_root(scope)
        root = self.roots.get(key)
        if root is None:
            root = Block(key, None, -1, 0, None, self.num_groups)
            self.roots[key] = root
        return root

    def make_root(self, scope: Hashable | None) -> Block:
        """A root for ``scope`` that is not registered (the caller registers it in ``roots`` if it keeps it)."""
        return Block(scope_root(scope), None, -1, 0, None, self.num_groups)

    def find_root(self, scope: Hashable | None) -> Block | None:
        """The root of ``scope`` if it exists (read-only)."""
        return self.roots.get(scope_root(scope))

    def blocks(self) -> Iterator[Block]:
        """Every non-root block, parents before children."""
        stack = list(self.roots.values())
        while stack:
            b = stack.pop()
            if b.parent is not None:
                yield b
            stack.extend(b.children.values())
