"""Eviction policies: which unlocked page of a pool leaves first.

A policy instance serves one pool (one tier of one pool group). The manager decides *which* pages are
candidates (unlocked committed pages; in the last tier only droppable ones) and tells the policy through
:meth:`EvictionPolicy.add` / :meth:`EvictionPolicy.discard`; the policy only orders them. A page's
``priority`` (0..100) and ``last_used`` (the manager's clock when it was last unlocked) are set before
``add``; the page's tree block (``page.block``: ``depth``, ``num_tokens``, ...) is available for policies
that value pages by what they stand for (the cost-aware snapshot policy of the hybrid manager).

:class:`PrioritizedLRU` (the default): lowest priority first, least recently used within a priority, and at
equal recency the deepest block first (a request unlocks its whole path at once; its leaf must go before its
ancestors, which full attention needs to keep its descendants reachable).

To plug a policy in, pass ``eviction_policy=factory`` to the manager; the factory is called once per pool as
``factory(group_spec, tier)`` and returns an object satisfying :class:`EvictionPolicy` (defined next to the
pool that holds it, in :mod:`~kvforge.kvcache.pools`, and re-exported here).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from kvforge.kvcache.pools import EvictionPolicy, EvictionPolicyFactory

if TYPE_CHECKING:
    from kvforge.kvcache.config import PoolGroupSpec, Tier
    from kvforge.kvcache.pools import Page

__all__ = [
    "DEFAULT_PRIORITY",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "EvictionPolicy",
    "EvictionPolicyFactory",
    "HeapEntry",
    "LazyHeapPolicy",
    "PrioritizedLRU",
    "check_priority",
]

PRIORITY_MIN = 0
PRIORITY_MAX = 100
DEFAULT_PRIORITY = 35


def check_priority(value: object, what: str = "priority") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: expected an int in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {type(value).__name__}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"{what}: expected an int in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value}")
    return value


def heap_field(index: int, doc: str) -> Any:
    """A named, writable view of item ``index`` of a :class:`HeapEntry` (read through ``itemgetter``, in C)."""

    def setter(entry: list, value: Any) -> None:
        entry[index] = value

    return property(itemgetter(index), setter, doc=doc)


class HeapEntry(list):
    """A heap entry of a :class:`LazyHeapPolicy` with named fields.

    It stays a list so that the heap compares entries in C, item by item: a subclass names its leading (ordering)
    items with :func:`heap_field`. Item 3 is a sequence number unique within the heap, so item 4, the page, is
    never compared; items past 4 are free for the policy.
    """

    __slots__ = ()

    seq = heap_field(3, "Unique per push: breaks ties, so the page is never compared.")
    page = heap_field(4, "The candidate page; None once discarded (lazy deletion).")


class LazyHeapPolicy:
    """The mechanics every heap-ordered policy shares: one heap of list entries with lazy deletion.

    An entry is a list ordered by its leading items, with the page at index 4 (:class:`HeapEntry` names the
    items; the default policy pushes plain lists); ``page.policy_data`` holds the page's entry, and discarding
    blanks the entry's page slot so the heap never needs a search. Subclasses build entries in ``add`` (via
    :meth:`_push`) and may veto or re-key a popped candidate in :meth:`_settle`.
    """

    __slots__ = ("_heap", "_live", "_seq", "on_victim")

    def __init__(self) -> None:
        self._heap: list[Any] = []
        self._live = 0
        self._seq = 0
        # Called with each victim ``pop_victim`` returns: lets policies of several pools coordinate (the hybrid
        # manager's attention policy learns which blocks lost their snapshot).
        self.on_victim: Callable[[Page], None] | None = None

    def __len__(self) -> int:
        return self._live

    def __contains__(self, page: object) -> bool:
        entry = getattr(page, "policy_data", None)
        return entry is not None and entry[4] is page

    @staticmethod
    def _require_new(page: Page) -> None:
        if page.policy_data is not None:
            raise AssertionError(f"{page!r} is already an eviction candidate")

    def _push(self, page: Page, entry: list) -> None:
        page.policy_data = entry
        heapq.heappush(self._heap, entry)
        self._live += 1

    def discard(self, page: Page) -> None:
        entry = page.policy_data
        if entry is None:
            return
        entry[4] = None
        page.policy_data = None
        self._live -= 1
        # Lazy deletion leaves dead entries behind; rebuild once they outnumber the live ones.
        if len(self._heap) > 2 * self._live + 1024:
            self._heap = [e for e in self._heap if e[4] is not None]
            heapq.heapify(self._heap)

    def _settle(self, entry: Any, settled: set[int]) -> bool:
        """Whether the popped, accepted ``entry`` is the victim. A subclass whose keys can go stale re-keys the
        entry, pushes it back, records ``id(page)`` in ``settled`` (once per page and call) and returns False."""
        return True

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        heap = self._heap
        rejected = []
        settled: set[int] = set()
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            page = entry[4]
            if page is None:
                continue
            if accept is not None and not accept(page):
                rejected.append(entry)
                continue
            if not self._settle(entry, settled):
                continue
            page.policy_data = None
            self._live -= 1
            victim = page
            break
        for entry in rejected:
            heapq.heappush(heap, entry)
        if victim is not None and self.on_victim is not None:
            self.on_victim(victim)
        return victim

    def ordered(self) -> list[Page]:
        """Candidates in eviction order (for tests and introspection; O(n log n))."""
        return [e[4] for e in sorted(e for e in self._heap if e[4] is not None)]


class PrioritizedLRU:
    """Lowest priority first, then least recently used, then deepest block.

    Entries hold only ints ``(priority, last_used, -depth, seq, page index)`` and ``page.policy_data`` holds
    the live entry's ``seq`` (lazy deletion): tuples of ints leave the cyclic garbage collector's view at their
    first collection, so a cache of many candidate pages does not make every full collection longer (the page
    is found again through its pool). Entries live in a sorted run (a deque) when they sort after its last or
    before its first entry, which is the common case (pages unlocked with a rising clock; a parent freed by
    its leaf's eviction, never more recent than that leaf), and in a heap otherwise; the victim is the smaller
    head of the two, so the order is the same as one heap's at O(1) for most adds and pops. The block pool's
    one-group eviction loop inlines :meth:`add_unless_next` for this class exactly (it reads ``_run``, ``_heap``
    and ``_seq``): a change to the entry layout or to that method changes ``BlockPool._drop_leaves_one_group``.
    """

    __slots__ = ("_heap", "_live", "_pages", "_run", "_seq", "on_victim")

    def __init__(self, group: PoolGroupSpec | None = None, tier: Tier | None = None) -> None:
        self._heap: list[tuple[int, int, int, int, int]] = []
        self._run: deque[tuple[int, int, int, int, int]] = deque()  # sorted ascending
        self._live = 0
        self._seq = 0
        self._pages: list[Page] | None = None  # the pool's pages, by index (bound at the first add)
        self.on_victim: Callable[[Page], None] | None = None

    def __len__(self) -> int:
        return self._live

    def __contains__(self, page: object) -> bool:
        pages = self._pages
        if pages is None or getattr(page, "policy_data", None) is None:
            return False
        idx = page.index  # type: ignore[attr-defined]
        return 0 <= idx < len(pages) and pages[idx] is page

    def _insert(self, entry: tuple[int, int, int, int, int]) -> None:
        run = self._run
        if not run or entry > run[-1]:
            run.append(entry)
        elif entry < run[0]:
            run.appendleft(entry)
        else:
            heapq.heappush(self._heap, entry)

    def add(self, page: Page) -> None:
        if page.policy_data is not None:
            raise AssertionError(f"{page!r} is already an eviction candidate")
        if self._pages is None:
            self._pages = page.pool.pages
        block = page.block
        self._seq = seq = self._seq + 1
        page.policy_data = seq
        entry = (page.priority, page.last_used, -block.depth if block is not None else 0, seq, page.index)
        # ``_insert`` inlined (every unlocked page passes here).
        run = self._run
        if not run or entry > run[-1]:
            run.append(entry)
        elif entry < run[0]:
            run.appendleft(entry)
        else:
            heapq.heappush(self._heap, entry)
        self._live += 1

    def add_unless_next(self, page: Page) -> bool:
        """:meth:`add`, for a caller that calls :meth:`pop_victim` next: True (``page`` is that victim, taken now
        and not a candidate) when nothing, not even a lazily deleted entry, sorts before it; else False after
        adding it. Either way the order and every count end as ``add`` then ``pop_victim`` leave them. A subclass
        that overrides ``add`` must override this too."""
        if page.policy_data is not None:
            raise AssertionError(f"{page!r} is already an eviction candidate")
        if self._pages is None:
            self._pages = page.pool.pages
        block = page.block
        seq = self._seq + 1
        entry = (page.priority, page.last_used, -block.depth if block is not None else 0, seq, page.index)
        run, heap = self._run, self._heap
        # Before both heads, so before every entry: popping now would pop nothing else first.
        if (run and not entry < run[0]) or (heap and not entry < heap[0]):
            self.add(page)
            return False
        self._seq = seq
        if self.on_victim is not None:
            self.on_victim(page)
        return True

    def discard(self, page: Page) -> None:
        if page.policy_data is None:
            return
        page.policy_data = None
        self._live -= 1
        if len(self._heap) + len(self._run) > 2 * self._live + 1024:
            pages = self._pages
            assert pages is not None
            self._heap = [e for e in self._heap if pages[e[4]].policy_data == e[3]]
            heapq.heapify(self._heap)
            self._run = deque(e for e in self._run if pages[e[4]].policy_data == e[3])

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        heap = self._heap
        run = self._run
        pages = self._pages
        if accept is None:
            # The common call (every eviction): no veto, so nothing to push back.
            while run or heap:
                if run and (not heap or run[0] < heap[0]):
                    entry = run.popleft()
                else:
                    entry = heapq.heappop(heap)
                page = pages[entry[4]]  # type: ignore[index]
                if page.policy_data == entry[3]:
                    page.policy_data = None
                    self._live -= 1
                    if self.on_victim is not None:
                        self.on_victim(page)
                    return page
            return None
        rejected = []
        victim = None
        while heap or run:
            if run and (not heap or run[0] < heap[0]):
                entry = run.popleft()
            else:
                entry = heapq.heappop(heap)
            page = pages[entry[4]]  # type: ignore[index]
            if page.policy_data != entry[3]:
                continue  # discarded (or re-added since) entry
            if not accept(page):  # (None returned above)
                rejected.append(entry)
                continue
            page.policy_data = None
            self._live -= 1
            victim = page
            break
        for entry in rejected:
            self._insert(entry)
        if victim is not None and self.on_victim is not None:
            self.on_victim(victim)
        return victim

    def ordered(self) -> list[Page]:
        """Candidates in eviction order (for tests and introspection; O(n log n))."""
        pages = self._pages
        if pages is None:
            return []
        return [pages[e[4]] for e in sorted([*self._heap, *self._run]) if pages[e[4]].policy_data == e[3]]
