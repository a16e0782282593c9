"""GreedyDual eviction of recurrent snapshots by the prefill FLOPs they save per byte.

:class:`CostAwareSnapshotPolicy` orders one recurrent pool's candidates by priority, then by the score
``H = clock + weight * value`` (``clock``: the score of the last victim, which ages every entry), then by depth.
``value`` is what evicting the snapshot costs a request (optionally over the nearest snapshot below it,
``marginal``), ``weight`` its use count (``frequency``); ``supersede`` hands a replaced snapshot's count to the
snapshot continuing its unbranched path. Every operation is O(log n) plus a walk of at most ``max_walk`` blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvforge.kvcache.eviction import HeapEntry, LazyHeapPolicy, heap_field
from kvforge.kvcache.snapshot_policy.cost import prefix_tokens

if TYPE_CHECKING:
    from kvforge.kvcache.pools import Block, Page

__all__ = ["CostAwareSnapshotPolicy"]


class _Entry(HeapEntry):
    """``(priority, score, -depth, seq, page, clock)``: ordered by the first four."""

    __slots__ = ()

    priority = heap_field(0, "The page's eviction priority (lowest first).")
    score = heap_field(1, "GreedyDual score: the clock at the last use plus weight times value.")
    neg_depth = heap_field(2, "Minus the block's depth: at equal score the deepest block goes first.")
    clock = heap_field(5, "The policy's clock when the entry was scored.")


class CostAwareSnapshotPolicy(LazyHeapPolicy):
    """GreedyDual eviction of recurrent snapshots by the prefill FLOPs they save per byte (module docstring).

    Order: lowest ``priority`` first (so the manager's priorities, e.g. the short-prompt rule, still apply),
    then lowest score ``H = clock_at_last_use + weight * value``, then the deepest block. One heap with lazy
    deletion (:class:`~kvforge.kvcache.eviction.LazyHeapPolicy`). ``value_fn(prefix_tokens) -> float`` is the
    (non-decreasing) value of a snapshot after ``prefix_tokens`` tokens when nothing below it is cached; the
    page's prefix is read from its tree block.

    * ``marginal``: the value is ``value_fn(L) - value_fn(L')``, where ``L'`` is the end of the nearest ancestor
      block holding a snapshot of the same group (0 when none within ``max_walk`` blocks): what evicting the
      snapshot actually costs a request that would have used it, which falls back to ``L'``. A snapshot close
      to the one below it saves little. Values only grow when an ancestor goes, so a victim whose value has
      grown since it was scored is re-scored and pushed back (lazily, in :meth:`pop_victim`).
    * ``frequency``: ``weight`` is the number of times the page became a candidate in the same block (every
      reuse unlocks it once more), i.e. GreedyDual-Size-Frequency; otherwise 1.
    * ``supersede`` (with ``frequency``): a new snapshot whose nearest ancestor snapshot ``A`` lies on an
      unbranched path (``A``'s block has one child) continues ``A``'s stream: the next request extending that
      path will match the new snapshot, not ``A``. The new snapshot inherits ``A``'s reuse count and ``A``'s
      weight drops to 0 (evicted first unless a request reuses it again); a snapshot at a branch point keeps its
      count. This protects the deepest snapshot of a live conversation rather than the turns it replaces.

    Each operation is O(log n) plus, with ``marginal`` or ``supersede``, a walk of at most ``max_walk`` blocks up
    the tree.
    """

    __slots__ = (
        "_clock",
        "_freq",
        "_tpb",
        "_value_fn",
        "frequency",
        "marginal",
        "max_walk",
        "supersede",
    )

    def __init__(
        self,
        value_fn: Callable[[int], float],
        tokens_per_block: int,
        *,
        frequency: bool = False,
        marginal: bool = False,
        supersede: bool = False,
        max_walk: int = 256,
    ) -> None:
        if not callable(value_fn):
            raise TypeError(f"value_fn: expected a callable, got {type(value_fn).__name__}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: expected >= 1, got {tokens_per_block}")
        if max_walk < 1:
            raise ValueError(f"max_walk: expected >= 1, got {max_walk}")
        super().__init__()
        self._value_fn = value_fn
        self._tpb = tokens_per_block
        self._clock = 0.0
        self.frequency = frequency
        self.marginal = marginal
        self.supersede = supersede
        self.max_walk = max_walk
        # id(page) -> (block, reuse weight while in that block): GreedyDual-Size-Frequency.
        self._freq: dict[int, tuple[object, int]] = {}

    @property
    def clock(self) -> float:
        """The GreedyDual clock: the score of the last victim (new candidates start above it)."""
        return self._clock

    # --- values ------------------------------------------------------------------------------------------------

    def _prefix(self, block: Block | None) -> int:
        return prefix_tokens(block, self._tpb)

    def _ancestor(self, page: Page) -> tuple[Block | None, Page | None]:
        """The nearest ancestor block holding a snapshot of ``page``'s group, and that snapshot (bounded walk)."""
        block = page.block
        g = page.pool.group
        node = None if block is None else block.parent
        for _ in range(self.max_walk):
            if node is None or node.depth < 0:
                return None, None
            other = node.pages[g]
            if other is not None:
                return node, other
            node = node.parent
        return None, None

    def value(self, page: Page) -> float:
        """What evicting ``page`` costs one request that would have used it (before the reuse weight)."""
        v = self._value_fn(self._prefix(page.block))
        if self.marginal:
            anc, _ = self._ancestor(page)
            if anc is not None:
                v -= self._value_fn(self._prefix(anc))
        return max(v, 0.0)

    def weight(self, page: Page) -> int:
        """The reuse weight ``page`` has now (1 without ``frequency``)."""
        if not self.frequency:
            return 1
        seen = self._freq.get(id(page))
        return seen[1] if seen is not None and seen[0] is page.block else 1

    def score(self, page: Page) -> float:
        """The score ``page`` would get if it became a candidate now."""
        w = 1
        if self.frequency:
            seen = self._freq.get(id(page))
            w = seen[1] + 1 if seen is not None and seen[0] is page.block else 1
        return self._clock + w * self.value(page)

    # --- EvictionPolicy ------------------------------------------------------------------------------------------

    def add(self, page: Page) -> None:
        self._require_new(page)
        block = page.block
        self._seq += 1
        w = 1
        if self.frequency:
            seen = self._freq.get(id(page))
            if seen is not None and seen[0] is block:
                w = seen[1] + 1
            elif self.supersede:
                w = self._inherit(page)
            self._freq[id(page)] = (block, w)
        score = self._clock + w * self.value(page)
        depth = block.depth if block is not None else 0
        self._push(page, _Entry((page.priority, score, -depth, self._seq, page, self._clock)))

    def _inherit(self, page: Page) -> int:
        """A new snapshot's weight under ``supersede``: 1 plus the reuses of the ancestor snapshot it replaces."""
        anc, other = self._ancestor(page)
        if anc is None or other is None or len(anc.children) != 1:
            return 1
        seen = self._freq.get(id(other))
        if seen is None or seen[0] is not anc:
            return 1
        self._freq[id(other)] = (anc, 0)
        entry = other.policy_data
        if isinstance(entry, _Entry) and entry.page is other and entry.score > entry.clock:
            # Re-score the superseded snapshot at its own last-use clock with weight 0.
            entry.page = None
            self._seq += 1
            new = _Entry((entry.priority, entry.clock, entry.neg_depth, self._seq, other, entry.clock))
            other.policy_data = new
            heapq.heappush(self._heap, new)
        return max(1, seen[1])

    def _settle(self, entry: _Entry, settled: set[int]) -> bool:
        page = entry.page
        if self.marginal and id(page) not in settled:
            # An ancestor snapshot may have gone since this one was scored: its value can only have grown.
            fresh = entry.clock + self.weight(page) * self.value(page)
            if fresh > entry.score * (1.0 + 1e-12) + 1e-300:
                settled.add(id(page))
                entry.score = fresh
                heapq.heappush(self._heap, entry)
                return False
        # Aging: whatever enters from now on starts at the victim's score (scores never go backwards, so a
        # victim of a lower priority class, scored earlier, cannot pull the clock down).
        if entry.score > self._clock:
            self._clock = entry.score
        return True
