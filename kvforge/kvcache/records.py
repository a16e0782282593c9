"""Small value types of the cache manager: what callers pass in and get back.

* :class:`CacheStatus`: a request cache's state (active, suspended, closed).
* :class:`PageCopy`: one page copy the runtime must execute (tier moves, partial reuse, snapshot restores).
* :class:`SwaPriorities`: eviction priorities of sliding-window pages by position.
* :class:`ReuseMatch`: the reusable prefix a prompt matched in the tree.
* :class:`AdmissionPlan`: the read-only answer of ``plan_admission``.
* :class:`ManagerStats`: running totals.

No logic beyond validation lives here; every type is importable without the manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from kvforge.kvcache.config import Tier
from kvforge.kvcache.eviction import DEFAULT_PRIORITY, PRIORITY_MIN, check_priority
from kvforge.kvcache.pools import Block

__all__ = [
    "AdmissionPlan",
    "CacheStatus",
    "ManagerStats",
    "PageCopy",
    "PriorityCallback",
    "ReuseMatch",
    "SwaPriorities",
]

PriorityCallback = Callable[[int, int], int]
"""``(block ordinal, pool group id) -> priority`` in 0..100, asked when a cache commits or releases a page."""

NEVER = 1 << 62
"""A committed length no cache reaches (the next sliding-window staleness point of a cache without one)."""


class CacheStatus(Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy page ``src_index`` of tier ``src_tier`` to ``dst_index`` of ``dst_tier`` in pool group ``group``.

    ``num_tokens`` None copies the whole page; else only the first ``num_tokens`` tokens' rows (partial reuse).
    """

    group: int
    src_tier: Tier
    src_index: int
    dst_tier: Tier
    dst_index: int
    num_tokens: int | None = None


@dataclass(frozen=True)
class SwaPriorities:
    """Eviction priorities of sliding-window pages by position when their cache releases them.

    ``endpoint``: pages a continuation from the cache's committed end needs (the last window and the sink
    blocks); ``interior``: every other sliding-window page (useful only to a prompt that ends inside it).
    Where these apply they decide sliding-window pages and the cache's callback decides the rest.
    """

    endpoint: int = DEFAULT_PRIORITY
    interior: int = PRIORITY_MIN

    def __post_init__(self) -> None:
        check_priority(self.endpoint, "endpoint")
        check_priority(self.interior, "interior")


class ReuseMatch(NamedTuple):
    """What a prompt can reuse: ``blocks`` (full, in order) then ``partial_tokens`` tokens of ``partial``.

    A named tuple (immutable, typed fields), not a frozen dataclass: one is built per admission, and a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    root: Block
    blocks: tuple[Block, ...]
    partial: Block | None
    partial_tokens: int
    tokens_per_block: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.tokens_per_block + self.partial_tokens


@dataclass(frozen=True)
class AdmissionPlan:
    """The answer of :meth:`KVCacheManager.plan_admission`: tokens the new cache would reuse, GPU pages per
    group it would take (reuse and capacity together), and whether they can be found now."""

    reused_tokens: int
    pages_needed: tuple[int, ...]
    fits: bool


@dataclass
class ManagerStats:
    """Running totals since the manager was built."""

    caches_created: int = 0
    reused_tokens: int = 0
    inserted_blocks: int = 0
    offloaded_pages: int = 0
    onboarded_pages: int = 0
    dropped_pages: int = 0
    removed_blocks: int = 0


def check_count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {v}")
    return v


def int_sequence(name: str, v: object) -> Sequence[int]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(v).__name__}")
    return v
