"""Pages and pools: the memory side of the cache, one pool per (tier, pool group).

A :class:`Page` is one slot of a pool. Its life:

* **free**: on its pool's free list (``block is None``, ``ref_count == 0``).
* **locked**: ``ref_count > 0``; held by that many caches. A page a cache wrote but has not committed yet is
  locked by that cache alone and belongs to no tree block (``block is None``).
* committed and unlocked: it belongs to a radix-tree block and no cache uses it. It is **droppable** when the
  tree loses nothing else by dropping it (a full-attention page whose block has no children; any other page),
  else **held**. In a tier below which there is another one (the GPU tier when a host tier exists) any
  unlocked page may be *evicted* (moved down); in the last tier only droppable pages may leave.

The manager keeps the counts below exact; :meth:`kvforge.kvcache.manager.KVCacheManager.check_invariants`
verifies them.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from kvforge.kvcache.config import LifeCycle, LifeCycleKind, Tier

if TYPE_CHECKING:
    from kvforge.kvcache.eviction import EvictionPolicy
    from kvforge.kvcache.radix import Block

__all__ = ["Page", "PagePool", "PageState"]


class PageState(Enum):
    FREE = "free"
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"


class Page:
    """One page of one pool. ``index`` is its slot in the pool (what page tables hold).

    ``priority`` and ``last_used`` order eviction; ``policy_data`` is private to the pool's eviction policy
    (None when the page is not in the policy).
    """

    __slots__ = ("block", "index", "last_used", "policy_data", "pool", "priority", "ref_count")

    def __init__(self, pool: PagePool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.ref_count = 0
        self.block: Block | None = None
        self.priority = 0
        self.last_used = 0
        self.policy_data: Any = None

    @property
    def group(self) -> int:
        return self.pool.group

    @property
    def tier(self) -> Tier:
        return self.pool.tier

    @property
    def droppable(self) -> bool:
        """Unlocked, committed, and dropping it orphans nothing in the tree."""
        block = self.block
        if self.ref_count or block is None:
            return False
        return not (self.pool.full_attention and block.children)

    @property
    def state(self) -> PageState:
        if self.ref_count:
            return PageState.LOCKED
        if self.block is None:
            return PageState.FREE
        return PageState.DROPPABLE if self.droppable else PageState.HELD

    def __repr__(self) -> str:
        return f"Page(g{self.pool.group} {self.pool.tier.name}#{self.index} ref={self.ref_count} prio={self.priority})"


class PagePool:
    """The pages of one pool group in one tier, with their free list and eviction policy.

    ``n_unlocked``: committed pages with ``ref_count == 0`` (every one of them can be reclaimed, by eviction
    or by dropping its descendants first). ``last``: no tier below this one holds this group.
    """

    __slots__ = (
        "capacity",
        "free",
        "full_attention",
        "group",
        "last",
        "life_cycle",
        "n_unlocked",
        "pages",
        "policy",
        "tier",
    )

    def __init__(self, group: int, tier: Tier, capacity: int, life_cycle: LifeCycle, policy: EvictionPolicy) -> None:
        self.group = group
        self.tier = tier
        self.capacity = capacity
        self.life_cycle = life_cycle
        self.full_attention = life_cycle.kind is LifeCycleKind.FULL
        self.pages = [Page(self, i) for i in range(capacity)]
        # Popped from the end: low indices first, which keeps small tests readable.
        self.free = self.pages[::-1]
        self.n_unlocked = 0
        self.policy = policy
        self.last = True

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_available(self) -> int:
        """Pages a caller can obtain now: free ones plus every unlocked committed one."""
        return len(self.free) + self.n_unlocked

    @property
    def num_locked(self) -> int:
        return self.capacity - len(self.free) - self.n_unlocked
