"""Attention pages of a hybrid model: blocks no request can reuse are evicted first.

A hybrid model's cached prefix is reusable only up to the last block holding a recurrent snapshot, so a leaf
block without one is dead weight. :class:`SnapshotAwareLRU` orders one attention pool's candidates dead leaves
first, then as :class:`~kvforge.kvcache.eviction.PrioritizedLRU`; it learns that a leaf lost its snapshot from
the snapshot policies' ``on_victim`` (wired by :func:`~kvforge.kvcache.snapshot_policy.snapshot_aware_eviction`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvforge.kvcache.eviction import HeapEntry, LazyHeapPolicy, heap_field

if TYPE_CHECKING:
    from kvforge.kvcache.pools import Block, Page

__all__ = ["SnapshotAwareLRU"]


class _Entry(HeapEntry):
    """``(alive, priority, last_used, seq, page)``: dead leaves (False) first, then prioritised LRU."""

    __slots__ = ()

    alive = heap_field(0, "Whether the block can still be reused (not a leaf without a snapshot).")
    priority = heap_field(1, "The page's eviction priority (lowest first).")
    last_used = heap_field(2, "The manager's clock when the page was unlocked.")


class SnapshotAwareLRU(LazyHeapPolicy):
    """Attention pages of a hybrid model: blocks no request can reuse go first, then prioritised LRU.

    A hybrid model's cached prefix is reusable only up to the last block holding a recurrent snapshot, so a leaf
    block without one is dead weight: the attention KV it holds will be recomputed by any request that reaches
    it. Plain LRU keeps such blocks as long as any other (they are as recent as the snapshot that was evicted
    from them), and evicts a conversation's newest block with its snapshot first, which turns the rest of that
    conversation's path into dead weight too. This policy evicts dead leaves first (oldest first), so the pool
    holds reusable prefixes; among live pages the order is :class:`~kvforge.kvcache.eviction.PrioritizedLRU`'s.

    ``recurrent_groups``: the recurrent pool groups whose pages are the snapshots (shared with the factory, which
    fills it as it builds their policies). A leaf loses its snapshot when a snapshot policy evicts it:
    :meth:`snapshot_evicted` (hooked to those policies' ``on_victim``) queues the block, and its attention page
    is re-keyed before the next eviction here. A candidate keyed dead that gained a snapshot meanwhile cannot
    exist (committing one locks the block), but the key is checked again when it comes up, either way.
    """

    __slots__ = ("_pending", "_recurrent")

    def __init__(self, recurrent_groups: set[int]) -> None:
        super().__init__()
        self._recurrent = recurrent_groups
        self._pending: list[Block] = []

    def _alive(self, page: Page) -> bool:
        block = page.block
        if block is None or block.children or not self._recurrent:
            return True
        pages = block.pages
        return any(g < len(pages) and pages[g] is not None for g in self._recurrent)

    def add(self, page: Page) -> None:
        self._require_new(page)
        self._seq += 1
        self._push(page, _Entry((self._alive(page), page.priority, page.last_used, self._seq, page)))
        if len(self._pending) > 1024:  # no attention eviction for a while: keep the queue short
            self._rekey_pending()

    def snapshot_evicted(self, snapshot: Page) -> None:
        if snapshot.block is not None:
            self._pending.append(snapshot.block)

    def _rekey_pending(self) -> None:
        pending, self._pending = self._pending, []
        for block in pending:
            for page in block.pages:
                entry = None if page is None else page.policy_data
                # Only this pool's entries are ours (other pools' policies key theirs differently).
                if (
                    entry is not None
                    and page is not None
                    and page.pool.policy is self
                    and entry.page is page
                    and entry.alive != self._alive(page)
                ):
                    self.discard(page)
                    self.add(page)

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        self._rekey_pending()
        return super().pop_victim(accept)

    def ordered(self) -> list[Page]:
        self._rekey_pending()
        return super().ordered()

    def _settle(self, entry: _Entry, settled: set[int]) -> bool:
        page = entry.page
        if id(page) in settled or entry.alive == self._alive(page):
            return True
        settled.add(id(page))
        entry.alive = not entry.alive
        heapq.heappush(self._heap, entry)
        return False
