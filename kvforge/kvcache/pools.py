"""Pages and pools: the memory side of the cache, one pool per (tier, pool group).

A :class:`Page` is one slot of a pool. Its life:

* **free**: on its pool's free list (``block is None``, ``ref_count == 0``).
* **locked**: ``ref_count > 0``; held by that many caches. A page a cache wrote but has not committed yet is
  locked by that cache alone and belongs to no tree block (``block is None``).
* committed and unlocked: it belongs to a radix-tree block and no cache uses it. It is **droppable** when the
  tree loses nothing else by dropping it (a full-attention page whose block has no children; any other page),
  else **held**. In a tier below which there is another one (the GPU tier when a host tier exists) any
  unlocked page may be *evicted* (moved down); in the last tier only droppable pages may leave.

A :class:`Block` (a radix-tree node, see :mod:`~kvforge.kvcache.radix`) holds one page slot per pool group and
each page points back at its block, so both live here; so does :class:`EvictionPolicy`, the protocol a pool's
policy satisfies (implementations in :mod:`~kvforge.kvcache.eviction`). Pages, and most blocks, are built once
by the block pool and reused (see ``docs/kvcache.md``, host cost), so a frozen server allocates none per block.

The block pool keeps the counts below exact; :meth:`kvforge.kvcache.manager.KVCacheManager.check_invariants`
verifies them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from enum import Enum
from itertools import count
from operator import itemgetter
from typing import Any, Protocol, runtime_checkable

from kvforge.kvcache.config import LifeCycle, LifeCycleKind, PoolGroupSpec, Tier

__all__ = ["Block", "Children", "EvictionPolicy", "EvictionPolicyFactory", "Page", "PagePool", "PageState"]


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


# Insertion stamps of tree children: one counter for every tree, so a later insertion has a larger stamp.
next_seq = count().__next__
_tokens_of = itemgetter(0)
_Entry = tuple[tuple[int, ...], int, "Block"]
_seq_of = itemgetter(1)


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slices compared in C, halving the range)."""
    n = min(len(a), len(b))
    if not n or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Children(dict[int, "Block"]):
    """A block's children by block key, with an index of those that hold tokens.

    A dict subclass so that CPython's collector never stops tracking it: a plain dict with no tracked values is
    untracked at a full collection and tracked again (into the youngest generation) by its next insertion, so
    the children of blocks frozen at start-up would re-enter the collector's view one by one (see
    :mod:`~kvforge.kvcache.host`).

    ``by_tokens`` indexes the children whose ``tokens`` is set: None for none, the block itself for one (no
    allocation: most nodes have at most one), else ``(tokens, seq, block)`` for each, sorted. ``seq`` is the
    stamp a child took when its key entered the dict (a replaced key's new block keeps it), so stamps rise in the
    dict's iteration order. Every mutation goes through the methods below and :attr:`Block.tokens`' setter,
    which keep the index exact; :meth:`longest_prefix` answers from it in O(log n) comparisons, whatever the
    number of children, except that a best prefix shared by k children (not all) costs a C-level minimum over
    their k stamps.
    """

    __slots__ = ("by_tokens", "oldest")

    def __init__(self) -> None:
        self.by_tokens: Block | list[_Entry] | None = None
        # The indexed child with the smallest stamp while the index is a list, computed when a query ties every
        # entry (e.g. children sharing a system prompt's tail) and dropped when it leaves the index.
        self.oldest: Block | None = None

    def token_entries(self) -> list[_Entry]:
        """The index as a sorted list of ``(tokens, seq, block)`` (a copy; for checks)."""
        cur = self.by_tokens
        if cur is None:
            return []
        if type(cur) is list:
            return list(cur)
        return [(cur._tokens, cur.seq, cur)]  # type: ignore[union-attr,list-item]

    def _index(self, block: Block) -> None:
        cur = self.by_tokens
        if cur is None:
            self.by_tokens = block
            return
        entry: _Entry = (block._tokens, block.seq, block)  # type: ignore[assignment]
        if type(cur) is list:
            insort(cur, entry)  # (tokens, seq) is unique: blocks are never compared
            oldest = self.oldest
            if oldest is not None and block.seq < oldest.seq:  # a replaced key's block keeps its stamp
                self.oldest = block
        else:
            self.by_tokens = sorted([(cur._tokens, cur.seq, cur), entry])  # type: ignore[union-attr,list-item]

    def _unindex(self, block: Block) -> None:
        if self.oldest is block:
            self.oldest = None
        cur = self.by_tokens
        if cur is block:
            self.by_tokens = None
            return
        if type(cur) is not list:
            raise AssertionError(f"Children: {block!r} missing from the token index")
        i = bisect_left(cur, (block._tokens, block.seq))
        if i == len(cur) or cur[i][2] is not block:
            raise AssertionError(f"Children: {block!r} missing from the token index")
        del cur[i]
        if len(cur) == 1:
            self.by_tokens = cur[0][2]
            self.oldest = None

    def __setitem__(self, key: int, block: Block) -> None:
        old = dict.get(self, key)
        if old is block:
            return
        if old is None:
            block.seq = next_seq()
        else:
            block.seq = old.seq  # the dict keeps the key's position
            if old._tokens is not None:
                self._unindex(old)
        dict.__setitem__(self, key, block)
        if block._tokens is not None:
            self._index(block)

    def __delitem__(self, key: int) -> None:
        block = dict.pop(self, key)
        if block._tokens is not None:
            self._unindex(block)

    def pop(self, key: int, *default: Any) -> Any:
        if key not in self:
            return dict.pop(self, key, *default)
        block = dict.pop(self, key)
        if block._tokens is not None:
            self._unindex(block)
        return block

    def popitem(self) -> tuple[int, Block]:
        key, block = dict.popitem(self)
        if block._tokens is not None:
            self._unindex(block)
        return key, block

    def clear(self) -> None:
        dict.clear(self)
        self.by_tokens = self.oldest = None

    def setdefault(self, key: int, default: Block) -> Block:
        block = dict.get(self, key)
        if block is None:
            self[key] = block = default
        return block

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, block in dict(*args, **kwargs).items():
            self[key] = block

    def __ior__(self, other: Any) -> Children:  # type: ignore[override,misc]
        self.update(other)
        return self

    def longest_prefix(self, tokens: tuple[int, ...]) -> tuple[Block | None, int]:
        """The child (with tokens) sharing the longest prefix with ``tokens``, and that length; among equals the
        first in the dict's order; ``(None, 0)`` when no child starts with ``tokens[0]``. In sorted order the
        longest prefix is shared with a neighbour of ``tokens``' position, and the children sharing it form one
        run (whose smallest stamp is the first in dict order)."""
        lst = self.by_tokens
        if lst is None or not tokens:
            return None, 0
        if type(lst) is not list:
            n = common_prefix_len(lst._tokens, tokens)  # type: ignore[union-attr,arg-type]
            return (lst, n) if n else (None, 0)  # type: ignore[return-value]
        i = bisect_left(lst, tokens, key=_tokens_of)
        after = common_prefix_len(lst[i][0], tokens) if i < len(lst) else 0
        before = common_prefix_len(lst[i - 1][0], tokens) if i else 0
        best = after if after > before else before
        if not best:
            return None, 0
        # The run of entries sharing tokens[:best] holds i - 1 and/or i; most often nothing beyond them.
        lo = i - 1 if before == best else i
        hi = i + 1 if after == best else i
        prefix = tokens[:best]
        if (lo and lst[lo - 1][0][:best] == prefix) or (hi < len(lst) and lst[hi][0][:best] == prefix):

            def cut(e: _Entry) -> tuple[int, ...]:
                return e[0][:best]

            lo = bisect_left(lst, prefix, 0, lo, key=cut)
            hi = bisect_right(lst, prefix, hi, key=cut)
        if hi - lo == 1:
            return lst[lo][2], best
        if hi - lo == len(lst):
            oldest = self.oldest
            if oldest is None:
                oldest = self.oldest = min(lst, key=_seq_of)[2]
            return oldest, best
        return min(lst[lo:hi], key=_seq_of)[2], best


class Block:
    """A radix-tree node: one block of tokens under a chained-hash ``key``.

    ``depth`` is the block's ordinal in its sequence (0 for the first block; -1 for a root). ``tokens`` is the
    block's token tuple when known (None for blocks committed from precomputed hashes without tokens); setting
    it keeps the parent's token index (:class:`Children`) exact. ``seq`` is the stamp the block took when it
    entered its parent's children. Full blocks are announced by :class:`~kvforge.kvcache.events.BlockStored`;
    partial ones never are.
    """

    __slots__ = ("_tokens", "children", "depth", "key", "num_tokens", "pages", "parent", "seq")

    def __init__(
        self,
        key: int,
        parent: Block | None,
        depth: int,
        num_tokens: int,
        tokens: tuple[int, ...] | None,
        num_groups: int,
    ) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.num_tokens = num_tokens
        self._tokens = tokens  # not in a tree yet: no index to update
        self.seq = -1  # set by Children when the block enters a tree
        self.children = Children()
        self.pages: list[Page | None] = [None] * num_groups

    @property
    def tokens(self) -> tuple[int, ...] | None:
        return self._tokens

    @tokens.setter
    def tokens(self, value: tuple[int, ...] | None) -> None:
        old = self._tokens
        if value is old:
            return
        parent = self.parent
        # In a tree: its parent's token index follows (a removed block is no longer its parent's child).
        if parent is not None and dict.get(parent.children, self.key) is self:
            if old is not None:
                parent.children._unindex(self)
            self._tokens = value
            if value is not None:
                parent.children._index(self)
        else:
            self._tokens = value

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def prefix_tokens(self) -> int:
        """Tokens from the start of the sequence to the end of this block (a walk: off the hot path)."""
        n, b = 0, self
        while b.parent is not None:
            n += b.num_tokens
            b = b.parent
        return n

    def path(self) -> list[Block]:
        """Blocks from the first one to this one (roots excluded)."""
        out = []
        b: Block | None = self
        while b is not None and b.parent is not None:
            out.append(b)
            b = b.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return f"Block(depth={self.depth}, tokens={self.num_tokens}, key={self.key:#x})"


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders one pool's eviction candidates. Every method is O(log n) or better in the default policy."""

    def add(self, page: Page) -> None:
        """``page`` became a candidate (it is not one already)."""

    def discard(self, page: Page) -> None:
        """``page`` stops being a candidate (locked again, freed, moved); a no-op if it is not one."""

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        """Remove and return the first candidate (for which ``accept`` holds, when given), or None."""

    def __len__(self) -> int:
        """Number of candidates."""

    def __contains__(self, page: object) -> bool: ...


EvictionPolicyFactory = Callable[[PoolGroupSpec, Tier], EvictionPolicy]


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
