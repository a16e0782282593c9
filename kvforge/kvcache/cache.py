"""One request's cache: its pages per pool group, its lengths and its state machine.

A :class:`KVCache` is created by a manager (:meth:`~kvforge.kvcache.manager.KVCacheManager.create_cache`) and
owns its state: pages per attention group, live recurrent pages, tree blocks, committed partial tokens and the
sliding-window staleness marks. It keeps ``num_committed_tokens <= history <= capacity`` and moves ACTIVE →
SUSPENDED → ACTIVE and any → CLOSED; a misuse raises :class:`~kvforge.errors.CacheStateError` changing nothing,
a bad argument ``TypeError`` / ``ValueError``. ``resize`` and ``resume`` return False (changing nothing) when
pages cannot be found even after eviction.

It reaches pages only through its manager's :class:`~kvforge.kvcache.block_pool.BlockPool` and the tree only
through its :class:`~kvforge.kvcache.matching.PrefixMatcher`; the manager is seen through :class:`CacheHost`.
Subclasses (the hybrid cache) hook in with ``_snapshot_pages``, ``_on_suspend``, ``_on_close`` and
``_on_stop_committing``. Not thread-safe.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice
from typing import Any, Protocol

from kvforge.errors import CacheStateError
from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.config import LifeCycle, PoolGroupSpec, Tier
from kvforge.kvcache.eviction import check_priority
from kvforge.kvcache.hashing import check_block_keys, check_tokens, token_ints
from kvforge.kvcache.matching import PrefixMatcher
from kvforge.kvcache.pools import Block, Page
from kvforge.kvcache.records import (
    NEVER,
    CacheStatus,
    ManagerStats,
    PageCopy,
    PriorityCallback,
    ReuseMatch,
    SwaPriorities,
    check_count,
)

__all__ = ["CacheHost", "KVCache"]

_NO_ROWS: tuple = ()
_NO_SHARED: frozenset[int] = frozenset()

_ACTIVE = CacheStatus.ACTIVE
_SUSPENDED = CacheStatus.SUSPENDED
_CLOSED = CacheStatus.CLOSED


class CacheHost(Protocol):
    """What a cache needs of the manager that created it (:class:`~kvforge.kvcache.manager.KVCacheManager`)."""

    tokens_per_block: int
    num_groups: int
    groups: tuple[PoolGroupSpec, ...]
    default_priority: int
    swa_priorities: SwaPriorities | None
    stats: ManagerStats
    block_pool: BlockPool
    matcher: PrefixMatcher
    full_groups: tuple[int, ...]
    sliding_groups: tuple[int, ...]
    recurrent_groups: tuple[int, ...]
    attention_groups: tuple[int, ...]

    def can_allocate(self, pages_per_group: Sequence[int]) -> bool: ...

    _listeners: list  # the manager's CacheListeners: a cache tells them only when there are some

    def _notify_changed(self, cache: KVCache, group: int | None, lo: int) -> None: ...

    def _forget(self, cache: KVCache) -> None: ...


def _next_stale_point(lc: LifeCycle, stale_lo: int, tokens_per_block: int) -> int:
    """Committed length at which block ``stale_lo`` becomes stale: ``first_needed_block`` passes it."""
    assert lc.window is not None  # a sliding-window life cycle
    return (stale_lo + 1) * tokens_per_block + lc.window - 1


class KVCache:
    """One request's view of the cache: its pages per pool group, lengths and state.

    Created only by :meth:`KVCacheManager.create_cache`. Attribute reads are cheap; every method that changes
    state checks it first and raises :class:`~kvforge.errors.CacheStateError` without changing anything.
    ``user_data`` is free for the caller (e.g. a scheduler's request).
    """

    __slots__ = (
        "_blocks",
        "_capacity",
        "_committed",
        "_committing",
        "_history",
        "_keys",
        "_live",
        "_nblocks",
        "_next_stale_at",
        "_pages",
        "_partial",
        "_priority_cb",
        "_prompt_keys",
        "_root",
        "_shared",
        "_stale_lo",
        "_status",
        "id",
        "key_mode",
        "manager",
        "num_reused_blocks",
        "num_reused_tokens",
        "scope",
        "user_data",
    )

    def __init__(
        self,
        manager: CacheHost,
        cache_id: Hashable,
        scope: Hashable | None,
        root: Block,
        key_mode: bool,
        priority_callback: PriorityCallback | None,
    ) -> None:
        self.manager = manager
        self.id = cache_id
        self.scope = scope
        self.key_mode = key_mode
        self.user_data: Any = None
        self.num_reused_blocks = 0
        self.num_reused_tokens = 0
        self._root = root
        self._status = _ACTIVE
        self._committing = True
        self._capacity = 0
        self._history = 0
        self._committed = 0
        self._nblocks = 0
        g = manager.num_groups
        # Set by _adopt, which every cache goes through before any other use (no list built here to be dropped).
        self._pages: list[list[Page | None]] = _NO_ROWS  # type: ignore[assignment]
        self._blocks: list[Block] = _NO_ROWS  # type: ignore[assignment]
        self._partial: list[int] = _NO_ROWS  # type: ignore[assignment]
        # Rows a layout without that life cycle never writes: shared read-only tuples instead of fresh lists.
        self._live: list[Page | None] = [None] * g if manager.recurrent_groups else (None,) * g  # type: ignore[assignment]
        self._stale_lo: list[int] = [0] * g if manager.sliding_groups else (0,) * g  # type: ignore[assignment]
        self._keys: list[int] = _NO_ROWS  # type: ignore[assignment]  # replaced (never changed in place) on suspend
        # The prompt's block keys as the manager validated them (key mode): a commit passing the same keys is not
        # validated again.
        self._prompt_keys: tuple[int, ...] = ()
        self._priority_cb = priority_callback
        # Ordinals of blocks this cache completed but found already in the tree (shared like reused ones): an
        # empty frozenset until _commit_blocks meets the first one.
        self._shared: AbstractSet[int] = _NO_SHARED
        self._next_stale_at = NEVER

    # --- read-only views -----------------------------------------------------------------------------------

    @property
    def status(self) -> CacheStatus:
        return self._status

    @property
    def is_active(self) -> bool:
        return self._status is _ACTIVE

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return self._committed

    @property
    def committing(self) -> bool:
        return self._committing

    @property
    def num_blocks(self) -> int:
        """Blocks pages are held for: ``ceil(capacity / tokens_per_block)`` while active."""
        return self._nblocks

    @property
    def priority_callback(self) -> PriorityCallback | None:
        return self._priority_cb

    @priority_callback.setter
    def priority_callback(self, cb: PriorityCallback | None) -> None:
        if cb is not None and not callable(cb):
            raise TypeError(f"priority_callback: expected a callable or None, got {type(cb).__name__}")
        self._priority_cb = cb

    @property
    def block_keys(self) -> tuple[int, ...]:
        """Chained hashes of the committed full blocks, in order."""
        if self._status is _ACTIVE:
            return tuple(b.key for b in self._blocks)
        return tuple(self._keys)

    @property
    def tree_blocks(self) -> tuple[Block, ...]:
        """The tree blocks of the committed full blocks while active (empty otherwise)."""
        return tuple(self._blocks)

    @property
    def root(self) -> Block:
        """The root of this cache's reuse scope."""
        return self._root

    @property
    def partial_tokens(self) -> tuple[int, ...]:
        """Committed tokens past the last full block (empty in key mode or once committing stopped)."""
        return tuple(self._partial)

    def _group(self, group: object) -> int:
        n = self.manager.num_groups
        if type(group) is not int:
            raise TypeError(f"group: expected an int pool group id, got {type(group).__name__}")
        if not 0 <= group < n:
            raise ValueError(f"group: expected a pool group id in [0, {n}), got {group}")
        return group

    def pages(self, group: int) -> tuple[Page | None, ...]:
        """This cache's page per block of an attention group (None: a stale sliding-window block)."""
        return tuple(self._pages[self._group(group)])

    def page_indices(self, group: int, start: int = 0) -> list[int]:
        """GPU page index per block of an attention group from block ``start`` (>= 0) on, -1 where the cache
        holds none."""
        check_count("start", start)
        return [-1 if p is None else p.index for p in self._pages[self._group(group)][start:]]

    def live_page(self, group: int) -> Page | None:
        """The live recurrent-state page of a recurrent group (None for attention groups or when not active)."""
        return self._live[self._group(group)]

    def pages_needed(self, capacity: int) -> tuple[int, ...]:
        """GPU pages per group that growing to ``capacity`` tokens would take (zeros when shrinking)."""
        check_count("capacity", capacity)
        return self._pages_needed(-(-capacity // self.manager.tokens_per_block))

    def can_resize(self, capacity: int) -> bool:
        """Whether :meth:`resize` to ``capacity`` would find its pages now (read-only)."""
        self._require(_ACTIVE, "can_resize")
        return self.manager.can_allocate(self.pages_needed(capacity))

    def __repr__(self) -> str:
        return (
            f"KVCache(id={self.id!r}, {self._status.value}, committed={self._committed}, history={self._history}, "
            f"capacity={self._capacity})"
        )

    # --- state changes ---------------------------------------------------------------------------------------

    def _require(self, status: CacheStatus, op: str) -> None:
        if self._status is not status:
            raise CacheStateError(f"{op}: cache {self.id!r} is {self._status.value}, expected {status.value}")

    def resize(self, capacity: int | None = None, history: int | None = None) -> bool:
        """Set capacity and/or history (tokens). Returns False, changing nothing, when pages run out.

        Requires ``committed <= history <= capacity`` afterwards (CacheStateError otherwise). Growing takes
        pages for the new blocks, evicting unlocked pages if needed; shrinking frees the uncommitted pages past
        the new capacity.
        """
        if self._status is not _ACTIVE:
            raise CacheStateError(f"resize: cache {self.id!r} is {self._status.value}, expected active")
        if capacity is None:
            capacity = self._capacity
        elif type(capacity) is not int:
            check_count("capacity", capacity)
        if history is None:
            history = self._history
        elif type(history) is not int:
            check_count("history", history)
        if capacity < 0 or history < 0:
            raise ValueError(f"resize: capacity and history must be >= 0, got {capacity}, {history}")
        if history < self._committed or history > capacity:
            raise CacheStateError(
                f"resize: cache {self.id!r} needs committed ({self._committed}) <= history ({history}) <= "
                f"capacity ({capacity})"
            )
        nblocks = -(-capacity // self.manager.tokens_per_block)
        if nblocks != self._nblocks and not self._set_num_blocks(nblocks):
            return False
        self._capacity = capacity
        self._history = history
        return True

    def commit(
        self,
        tokens: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        block_keys: Sequence[int] | None = None,
    ) -> None:
        """Mark the next tokens final: every block they complete is inserted in the radix tree.

        Token mode (a cache created without ``block_keys`` only): pass ``tokens``; ``block_keys`` may give the
        chained hashes of the blocks this call completes, to skip hashing. Key mode (a cache created from
        ``block_keys`` alone, e.g. a trace): pass ``num_tokens`` and the keys of every block this call
        completes. The tokens must already be in history (CacheStateError otherwise).
        """
        if self._status is not _ACTIVE:
            raise CacheStateError(f"commit: cache {self.id!r} is {self._status.value}, expected active")
        if not self._committing:
            raise CacheStateError(f"commit: cache {self.id!r} has stopped committing")
        if tokens is not None:
            if self.key_mode:
                raise ValueError(
                    "tokens: this cache was created from block keys; commit with num_tokens and block_keys"
                )
            if num_tokens is not None:
                raise ValueError("num_tokens: give tokens or num_tokens, not both")
            tokens = check_tokens(tokens, vocab_size=self.manager.block_pool.tree.hasher.vocab_size)
            n = len(tokens)
        else:
            if not self.key_mode:
                raise ValueError("tokens: expected the committed tokens (this cache is in token mode)")
            if num_tokens is None:
                raise ValueError("num_tokens: required with block_keys in key mode")
            n = num_tokens if type(num_tokens) is int and num_tokens >= 0 else check_count("num_tokens", num_tokens)
        committed = self._committed
        if committed + n > self._history:
            raise CacheStateError(
                f"commit: cache {self.id!r} would commit {committed + n} tokens past its history {self._history}"
            )
        tpb = self.manager.tokens_per_block
        if (block_keys is None or not len(block_keys)) and (committed % tpb) + n < tpb:
            # Fast path (a decode step): no block completes, so the keys of the completed blocks are none.
            if committed + n >= self._next_stale_at:
                self._commit_in_block(tokens, committed + n)
                return
            if tokens is not None:
                self._partial.extend(token_ints(tokens))
            self._committed = committed + n
            return
        self._commit_blocks(tokens, n, block_keys)

    def stop_committing(self) -> None:
        """No further commits: later tokens are never inserted in the tree. Idempotent; not on a closed cache."""
        if self._status is _CLOSED:
            raise CacheStateError(f"stop_committing: cache {self.id!r} is closed")
        if self._committing:
            self._on_stop_committing()
        self._committing = False

    def suspend(self) -> None:
        """Release every GPU page (preemption). Committed blocks stay reusable in the tree; uncommitted KV is lost,
        so history and capacity fall back to the committed length."""
        self._require(_ACTIVE, "suspend")
        self._suspend()

    def resume(self) -> bool:
        """Re-acquire the committed prefix from the tree. False (still suspended, nothing changed) when part of
        it was evicted or pages cannot be found; the caller may then close and recreate the cache. A cache that
        had stopped committing left no partial tail in the tree, so it resumes only at a block boundary."""
        self._require(_SUSPENDED, "resume")
        return self._resume()

    def close(self) -> None:
        """Release everything; committed blocks (and the partial last block) stay reusable in the tree."""
        if self._status is _CLOSED:
            raise CacheStateError(f"close: cache {self.id!r} is already closed")
        self._close()

    # --- hooks for subclasses ----------------------------------------------------------------------------------

    def _snapshot_pages(self, block: Block, ordinal: int) -> dict[int, Page]:
        """Recurrent snapshots to store at the end of ``block`` (full or partial) as this cache inserts it.

        Return ``{group: page}`` with fresh pages from the block pool's ``alloc_page`` whose data copy the
        subclass has arranged; they are attached to the block and unlocked. The base cache takes none.
        """
        return {}

    def _on_suspend(self) -> None:
        """Called before the cache's pages are released by :meth:`suspend`."""

    def _on_close(self) -> None:
        """Called before an active cache's pages are released by :meth:`close`."""

    def _on_stop_committing(self) -> None:
        """Called once when the cache stops committing (before the flag changes)."""

    # --- priorities --------------------------------------------------------------------------------------------

    def _priority(self, ordinal: int, group: int, end_tokens: int) -> int:
        mgr = self.manager
        swa = mgr.swa_priorities
        if swa is not None and group in mgr.sliding_groups:
            lc = mgr.groups[group].life_cycle
            tpb = mgr.tokens_per_block
            if ordinal < lc.sink_blocks(tpb) or ordinal >= lc.first_needed_block(end_tokens, tpb):
                return swa.endpoint
            return swa.interior
        cb = self._priority_cb
        if cb is None:
            return mgr.default_priority
        return check_priority(cb(ordinal, group), f"priority_callback({ordinal}, {group})")

    def _constant_priority(self) -> bool:
        mgr = self.manager
        return self._priority_cb is None and (mgr.swa_priorities is None or not mgr.sliding_groups)

    def _note_changed(self, group: int | None = None, lo: int = 0) -> None:
        mgr = self.manager
        if mgr._listeners:
            mgr._notify_changed(self, group, lo)

    # --- adoption (create, resume) -----------------------------------------------------------------------------

    def _admit(
        self,
        match: ReuseMatch,
        tokens: Sequence[int] | None,
        nblocks: int,
        capacity: int,
        keys: tuple[int, ...] | None = None,
    ) -> bool:
        """A new cache takes ``match`` and grows to ``nblocks`` blocks; False (nothing changed) without pages.
        ``keys``: the prompt's validated block keys (kept in key mode)."""
        if not self._adopt(match, tokens, nblocks):
            return False
        if self.key_mode and keys is not None:
            self._prompt_keys = keys
        self._capacity = capacity
        self.num_reused_blocks = len(match.blocks)
        self.num_reused_tokens = self._committed
        return True

    def _adopt(self, match: ReuseMatch, tokens: Sequence[int] | None, nblocks: int = 0) -> bool:
        """Lock the matched pages into this cache, take the GPU pages the reuse needs and grow to ``nblocks``
        blocks; False (nothing changed) when those pages cannot be found."""
        mgr = self.manager
        bp = mgr.block_pool
        tpb = mgr.tokens_per_block
        blocks = match.blocks
        n = len(blocks)
        partial = match.partial
        matcher = mgr.matcher
        if matcher.one_full_group and partial is None:
            # One full-attention group in one tier, no partial tail: what reuse_needs, fits and the general path
            # below do for this layout (every admission of a plain model passes here). Lock the matched pages
            # (their unlocked ones stop being available), nothing to copy, no live state, no window.
            grow = nblocks - n
            if grow > 0:
                pool = bp.gpu[0]
                room = len(pool.free) + pool.n_unlocked
                # Locking the match takes its unlocked pages out of the room: counted only when it could matter.
                if grow > room - n and grow > room - [b.pages[0].ref_count for b in blocks].count(0):  # type: ignore[union-attr]
                    return False
            self._pages = [bp.lock_block_pages(blocks, 0)]  # type: ignore[list-item]
            bp.tick()
            self._blocks = list(blocks)
            self._nblocks = n
            self._committed = self._history = self._capacity = n * tpb
            self._partial = []
            self._next_stale_at = NEVER
            if mgr._listeners:
                mgr._notify_changed(self, None, 0)
            if grow > 0 and not self._set_num_blocks(nblocks):
                raise AssertionError("the availability check promised the capacity's pages")
            return True
        total = match.num_tokens
        plan, sources, need, taken, onboard = matcher.reuse_needs(match, nblocks)
        if not bp.fits(need, taken):
            return False

        width = n + (partial is not None)
        pages: list[list[Page | None]] = [[] for _ in range(mgr.num_groups)]
        for _, _, lst in plan:
            bp.lock_pages(lst)
        if sources:
            bp.lock_pages(sources)
        full = mgr.full_groups
        for g, ords, lst in plan:
            if onboard[g]:
                gpu_pool = bp.gpu[g]
                lst = [p if p.pool is gpu_pool else bp.onboard(p) for p in lst]
            if g in full:
                row: list[Page | None] = lst  # type: ignore[assignment]
                if partial is not None:
                    row.append(None)
            else:
                row = [None] * width
                for i, p in zip(ords, lst):
                    row[i] = p
            pages[g] = row
        if partial is not None:
            for g in mgr.attention_groups:
                src = partial.pages[g]
                assert src is not None
                dst = bp.must_alloc(g)
                bp.record_copy(PageCopy(g, src.pool.tier, src.index, Tier.GPU, dst.index, match.partial_tokens))
                pages[g][n] = dst
        for g in mgr.recurrent_groups:
            live = bp.must_alloc(g)
            if total:
                src = (partial if partial is not None else blocks[-1]).pages[g]
                assert src is not None
                bp.record_copy(PageCopy(g, src.pool.tier, src.index, Tier.GPU, live.index))
            self._live[g] = live
        bp.tick()
        for p in sources:
            bp.unlock(p)

        self._pages = pages
        self._blocks = list(blocks)
        self._nblocks = n + (partial is not None)
        self._committed = self._history = self._capacity = total
        if partial is not None and tokens is not None:
            self._partial = list(token_ints(tokens[n * tpb : total]))
        elif partial is not None:
            self._partial = list(partial.tokens[: match.partial_tokens])  # type: ignore[index]
        else:
            self._partial = []
        if mgr.sliding_groups:
            self._reset_stale()
        else:
            self._next_stale_at = NEVER
        if mgr._listeners:
            mgr._notify_changed(self, None, 0)
        if nblocks > self._nblocks and not self._set_num_blocks(nblocks):
            raise AssertionError("the availability check promised the capacity's pages")
        return True

    # --- sliding-window staleness ------------------------------------------------------------------------------

    def _reset_stale(self) -> None:
        """Recompute the sliding-window stale bookkeeping after the cache's pages were (re)built."""
        mgr = self.manager
        tpb = mgr.tokens_per_block
        nxt = NEVER
        for g in mgr.sliding_groups:
            lc = mgr.groups[g].life_cycle
            self._stale_lo[g] = max(lc.first_needed_block(self._committed, tpb), lc.sink_blocks(tpb))
            nxt = min(nxt, _next_stale_point(lc, self._stale_lo[g], tpb))
        self._next_stale_at = nxt

    def _stale_priorities(self, committed: int) -> dict[tuple[int, int], int] | None:
        """Priorities of the sliding-window pages that committing up to ``committed`` makes stale, asked before
        anything changes so that a failing callback leaves the cache as it was (None: all the default)."""
        if self._constant_priority():
            return None
        mgr = self.manager
        tpb = mgr.tokens_per_block
        out = {}
        for g in mgr.sliding_groups:
            hi = mgr.groups[g].life_cycle.first_needed_block(committed, tpb)
            for b in range(self._stale_lo[g], hi):
                if self._pages[g][b] is not None:
                    out[(g, b)] = self._priority(b, g, committed)
        return out

    def _commit_in_block(self, tokens: Sequence[int] | None, committed: int) -> None:
        """A commit that completes no block but moves a sliding window past some pages."""
        prios = self._stale_priorities(committed)
        if tokens is not None:
            self._partial.extend(token_ints(tokens))
        self._committed = committed
        self._release_stale(prios)

    def _release_stale(self, prios: dict[tuple[int, int], int] | None) -> None:
        """Give back sliding-window pages no later token reads (committed blocks go to the tree as candidates)."""
        mgr = self.manager
        tpb = mgr.tokens_per_block
        committed = self._committed
        default = mgr.default_priority
        nxt = NEVER
        mgr.block_pool.tick()
        for g in mgr.sliding_groups:
            lc = mgr.groups[g].life_cycle
            lo = self._stale_lo[g]
            hi = lc.first_needed_block(committed, tpb)
            lst = self._pages[g]
            for b in range(lo, hi):
                p = lst[b]
                if p is not None:
                    self._release(p, b, default if prios is None else prios[(g, b)])
                    lst[b] = None
                    self._note_changed(g, b)
            self._stale_lo[g] = max(lo, hi)
            nxt = min(nxt, _next_stale_point(lc, max(lo, hi), tpb))
        self._next_stale_at = nxt

    def _release(self, page: Page, ordinal: int, priority: int) -> None:
        """Give one of the cache's pages back: free it if uncommitted, else unlock it with its new priority
        (a reused block's priority only rises; the cache that committed it sets it)."""
        bp = self.manager.block_pool
        if page.block is None:
            bp.free_page(page)
            return
        if ordinal < self.num_reused_blocks or ordinal in self._shared:
            if priority > page.priority:
                page.priority = priority
        else:
            page.priority = priority
        bp.unlock(page)

    # --- capacity ----------------------------------------------------------------------------------------------

    def _pages_needed(self, nblocks: int) -> tuple[int, ...]:
        return tuple(self.manager.matcher.block_needs(self._nblocks, nblocks, self._stale_lo))

    def _set_num_blocks(self, nblocks: int) -> bool:
        mgr = self.manager
        bp = mgr.block_pool
        old = self._nblocks
        if nblocks > old and mgr.matcher.one_full_group:
            # One full-attention group in one tier: what the general path below does, without its per-group lists.
            pool = bp.gpu[0]
            if nblocks - old > len(pool.free) + pool.n_unlocked:
                return False
            self._pages[0].extend(bp.alloc_pages(0, nblocks - old))
            if mgr._listeners:
                mgr._notify_changed(self, 0, old)
            bp.flush_events()
        elif nblocks > old:
            need = mgr.matcher.block_needs(old, nblocks, self._stale_lo)
            if not bp.has_pages(need):
                return False
            tpb = mgr.tokens_per_block
            swa = mgr.sliding_groups
            for g in mgr.attention_groups:
                lst = self._pages[g]
                if g in swa:
                    lc = mgr.groups[g].life_cycle
                    sinks = lc.sink_blocks(tpb)
                    lo = self._stale_lo[g]
                    for b in range(old, nblocks):
                        lst.append(bp.must_alloc(g) if b < sinks or b >= lo else None)
                else:
                    lst.extend(bp.alloc_pages(g, nblocks - old))
                if mgr._listeners:
                    mgr._notify_changed(self, g, old)
            bp.flush_events()
        else:
            for g in mgr.attention_groups:
                lst = self._pages[g]
                for b in range(nblocks, old):
                    p = lst[b]
                    if p is not None:
                        bp.free_page(p)
                del lst[nblocks:]
                self._note_changed(g, nblocks)
        self._nblocks = nblocks
        return True

    # --- commit ------------------------------------------------------------------------------------------------

    def _commit_blocks(self, tokens: Sequence[int] | None, n: int, keys: Sequence[int] | None) -> None:
        """Commit ``n`` tokens that complete at least one block (or come with keys)."""
        mgr = self.manager
        bp = mgr.block_pool
        tpb = mgr.tokens_per_block
        start = self._committed
        first = start // tpb
        n_full = (start + n) // tpb - first
        if keys is not None:
            # The very key objects the manager validated with the prompt are valid already.
            pk = self._prompt_keys
            if not (
                type(keys) in (list, tuple)
                and len(keys) == n_full <= len(pk) - first
                and all(map(operator.is_, keys, islice(pk, first, None)))
            ):
                keys = check_block_keys(keys)
            if len(keys) != n_full:
                raise ValueError(f"block_keys: this commit completes {n_full} blocks, got {len(keys)} keys")
        elif tokens is None:
            raise ValueError(f"block_keys: a key-mode commit completing {n_full} blocks needs their keys")
        end = start + n
        prios: list[list[int]] | None = None
        stale_prios = None
        if self._priority_cb is not None or (mgr.swa_priorities is not None and mgr.sliding_groups):
            # Not _constant_priority() (inlined). Asked before any change, so a failing callback leaves the cache
            # as it was.
            prios = [[self._priority(first + i, g, end) for g in range(mgr.num_groups)] for i in range(n_full)]
            if end >= self._next_stale_at:
                stale_prios = self._stale_priorities(end)
        default = mgr.default_priority
        blocks = self._blocks
        root = self._root
        parent = blocks[-1] if blocks else root
        rec = mgr.recurrent_groups
        partial = self._partial
        fill = len(partial) if tokens is not None else 0
        if tokens is not None and keys is None:
            keys = mgr.matcher.chain_keys(parent.key, partial, tokens, n_full)
        assert keys is not None
        if n_full and parent is not root and not parent.children:
            bp.gain_child(parent)
        # Blocks the tree already has (another request committed them): share them.
        i = 0
        while i < n_full:
            child = parent.children.get(keys[i])
            if child is None:
                break
            if child.num_tokens != tpb:
                # A partial block under a full block's key: the keys of the two kinds hash inputs of different
                # lengths, so only a 128-bit collision could do this; the full one wins.
                bp.remove_block(child)
                break
            ordinal = first + i
            if type(self._shared) is frozenset:
                self._shared = set()
            self._shared.add(ordinal)  # type: ignore[attr-defined]
            self._merge_into(child, ordinal, default if prios is None else prios[i])
            if rec:
                self._attach_snapshots(child, ordinal, default if prios is None else prios[i])
            blocks.append(child)
            parent = child
            i += 1
        # The rest are new. Each is the first child of a block created just before it, so no lookup can find
        # anything: this loop, the cost of inserting a long prompt, only creates blocks and hands them pages.
        first_new = i
        new_keys = list(keys[first_new:]) if first_new else keys
        new_parent_key = None if parent is root else parent.key
        attn = mgr.attention_groups
        # Not a comprehension for the common single group (a comprehension is a function call in CPython 3.11).
        attn_pages = [(attn[0], self._pages[attn[0]])] if len(attn) == 1 else [(g, self._pages[g]) for g in attn]
        if prios is None and not rec:
            blocks.extend(bp.new_chain(parent, new_keys, first + i, attn_pages, default))
            i = n_full
        new_block = bp.new_block
        for h in new_keys[i - first_new :] if i < n_full else ():
            ordinal = first + i
            child = new_block(h, parent, ordinal, tpb, None)
            parent.children[h] = child
            cpages = child.pages
            for g, lst in attn_pages:
                p = lst[ordinal]
                if p is not None:
                    cpages[g] = p
                    p.block = child
                    p.priority = default if prios is None else prios[i][g]
            if rec:
                self._attach_snapshots(child, ordinal, default if prios is None else prios[i])
            blocks.append(child)
            parent = child
            i += 1
        if tokens is not None:
            # Only some new blocks keep their tokens (see the module docstring): copying every block's tuple
            # would double the cost of a long insert. Block j > 0 starts at j * tpb - fill in ``tokens``.
            base = len(blocks) - n_full
            if fill and first_new == 0:
                blocks[base].tokens = (*partial, *token_ints(tokens[: tpb - fill]))
            last = n_full - 1
            if last >= first_new and (last or not fill):
                blocks[base + last].tokens = tuple(token_ints(tokens[last * tpb - fill : n_full * tpb - fill]))
            if n_full:
                self._partial = list(token_ints(tokens[n_full * tpb - fill :]))
            else:
                partial.extend(token_ints(tokens))
        self._committed = end
        bp.tree.num_blocks += len(new_keys)
        mgr.stats.inserted_blocks += len(new_keys)
        bp.publish_stored(new_keys, new_parent_key)
        if end >= self._next_stale_at:
            self._release_stale(stale_prios)

    def _merge_into(self, block: Block, ordinal: int, prios: Sequence[int] | int) -> None:
        """The tree already has the block this cache just completed: share the tree's GPU pages (freeing the
        cache's copies), or give the tree the cache's pages where it has none on the GPU."""
        bp = self.manager.block_pool
        for g in self.manager.attention_groups:
            mine = self._pages[g][ordinal]
            if mine is None:
                continue
            prio = prios if isinstance(prios, int) else prios[g]
            theirs = block.pages[g]
            if theirs is not None and theirs.pool.tier is Tier.GPU:
                bp.lock(theirs)
                if prio > theirs.priority:
                    theirs.priority = prio
                bp.free_page(mine)
                self._pages[g][ordinal] = theirs
                self._note_changed(g, ordinal)
                continue
            if theirs is not None:
                block.pages[g] = None
                bp.free_committed(theirs)
            block.pages[g] = mine
            mine.block = block
            mine.priority = prio

    def _attach_snapshots(self, block: Block, ordinal: int, prios: Sequence[int] | int) -> None:
        """Put the recurrent snapshots the subclass took at the end of ``block`` into the tree, unlocked."""
        snaps = self._snapshot_pages(block, ordinal)
        if not snaps:
            return
        bp = self.manager.block_pool
        rec = self.manager.recurrent_groups
        bp.tick()
        for g, page in snaps.items():
            if page.block is not None or page.ref_count != 1 or g not in rec:
                raise AssertionError(f"_snapshot_pages: {page!r} for group {g} is not a fresh recurrent page")
            if block.pages[g] is not None:
                bp.free_page(page)
                continue
            bp.attach(page, block, prios if isinstance(prios, int) else prios[g])

    # --- release (suspend, close) ------------------------------------------------------------------------------

    def _release_priorities(self, committed: int | None = None) -> dict[tuple[int, int], int] | None:
        """The priority of every page the cache will give back (and of the partial tail's snapshots), asked
        before anything changes so that a failing callback leaves the cache as it was (None: the default).
        ``committed``: the committed length to ask for (default: the current one; a commit that ends the
        sequence asks for its end before it commits anything)."""
        if self._constant_priority():
            return None
        mgr = self.manager
        committed = self._committed if committed is None else committed
        out = {}
        for g in mgr.attention_groups:
            for b, p in enumerate(self._pages[g]):
                if p is not None:
                    out[(g, b)] = self._priority(b, g, committed)
        for g in mgr.recurrent_groups:
            out[(g, committed // mgr.tokens_per_block)] = self._priority(
                committed // mgr.tokens_per_block, g, committed
            )
        return out

    def _insert_partial(self, release_prios: dict[tuple[int, int], int] | None) -> None:
        """At the end of the cache's life (or suspension), its committed tokens past the last full block become a
        partial tree block, so a later prompt (or the resumed cache) can reuse them by copy."""
        tokens = self._partial
        if not tokens or self.key_mode or not self._committing:
            return
        mgr = self.manager
        bp = mgr.block_pool
        tpb = mgr.tokens_per_block
        ordinal = self._committed // tpb
        parent = self._blocks[-1] if self._blocks else self._root
        blk = tuple(tokens)
        key = mgr.block_pool.tree.hasher.partial_key(parent.key, blk)
        if key in parent.children:
            return
        default = mgr.default_priority
        given = release_prios or {}
        prios = [given.get((g, ordinal), default) for g in range(mgr.num_groups)]
        child = bp.new_block(key, parent, ordinal, len(blk), blk)
        for g in mgr.attention_groups:
            # An active cache holds a page for every full-attention block below its capacity, and the window
            # (which contains this block) of every sliding-window group.
            p = self._pages[g][ordinal]
            if p is not None:
                child.pages[g] = p
                p.block = child
                p.priority = prios[g]
        if not parent.children and parent is not self._root:
            bp.gain_child(parent)
        parent.children[key] = child
        bp.tree.num_blocks += 1
        if mgr.recurrent_groups:
            self._attach_snapshots(child, ordinal, prios)
            if all(p is None for p in child.pages):
                del parent.children[key]
                bp.tree.num_blocks -= 1

    def _release_all(self, prios: dict[tuple[int, int], int] | None) -> None:
        """Give back every page the cache holds (committed ones to the tree as candidates, others freed)."""
        mgr = self.manager
        bp = mgr.block_pool
        default = mgr.default_priority
        const = prios is None
        bp.tick()
        reused = self.num_reused_blocks
        shared = self._shared
        for g in mgr.attention_groups:
            lst = self._pages[g]
            if const:
                bp.release_row(g, lst, default, reused, shared)
                self._pages[g] = []
                continue
            # What ``_release`` does per page, in one pass per group: uncommitted pages go back to the free list,
            # committed ones take their priority (a reused block's only rises) and are unlocked together.
            committed: list[Page] = []
            append = committed.append
            # Deepest first so that, at equal recency, policies see leaves before their ancestors.
            for b in range(len(lst) - 1, -1, -1):
                p = lst[b]
                if p is None:
                    continue
                if p.block is None:
                    bp.free_page(p)
                    continue
                priority = prios.get((g, b), default)  # type: ignore[union-attr]
                if priority > p.priority or (b >= reused and b not in shared):
                    p.priority = priority
                append(p)
            bp.unlock_pages(committed)
            self._pages[g] = []
        for g in mgr.recurrent_groups:
            live = self._live[g]
            if live is not None:
                bp.free_page(live)
                self._live[g] = None
        self._nblocks = 0
        if mgr._listeners:
            mgr._notify_changed(self, None, 0)

    def _suspend(self) -> None:
        prios = self._release_priorities()
        self._on_suspend()
        self._insert_partial(prios)
        self._keys = [b.key for b in self._blocks]
        self._release_all(prios)
        self._blocks = []
        self._history = self._capacity = self._committed
        self._status = _SUSPENDED
        self.manager.block_pool.flush_events()

    def _resume(self) -> bool:
        mgr = self.manager
        bp = mgr.block_pool
        tpb = mgr.tokens_per_block
        node = self._root
        blocks: list[Block] = []
        for k in self._keys:
            child = node.children.get(k)
            if child is None or child.num_tokens != tpb:
                return False
            blocks.append(child)
            node = child
        partial, ptoks = None, 0
        if self._committed % tpb:
            if self.key_mode or not self._partial:
                return False
            partial = node.children.get(mgr.block_pool.tree.hasher.partial_key(node.key, self._partial))
            ptoks = len(self._partial)
            if partial is None or partial.num_tokens != ptoks:
                return False
        if (mgr.sliding_groups or mgr.recurrent_groups) and not mgr.matcher.usable(blocks, len(blocks), partial, ptoks):
            return False
        match = ReuseMatch(self._root, tuple(blocks), partial, ptoks, tpb)
        partial_tokens = list(self._partial)
        if not self._adopt(match, None):
            bp.flush_events()
            return False
        self._partial = partial_tokens
        self._keys = []
        self._status = _ACTIVE
        bp.flush_events()
        return True

    def _close(self) -> None:
        if self._status is _ACTIVE:
            mgr = self.manager
            # _release_priorities answers None for constant priorities (_constant_priority, inlined).
            if self._priority_cb is None and (mgr.swa_priorities is None or not mgr.sliding_groups):
                prios = None
            else:
                prios = self._release_priorities()
            self._on_close()
            if self._partial:
                self._insert_partial(prios)
            self._release_all(prios)
            self._blocks = _NO_ROWS  # type: ignore[assignment]
        self._status = _CLOSED
        self.manager._forget(self)
        self.manager.block_pool.flush_events()

    # --- verification ------------------------------------------------------------------------------------------

    def _held_pages(self) -> Iterable[Page]:
        """Every page reference this cache holds (one entry per reference), checking its own invariants."""
        mgr = self.manager
        tpb = mgr.tokens_per_block
        assert self._status is not _CLOSED, f"{self!r} closed but registered"
        if self._status is not _ACTIVE:
            assert all(not lst for lst in self._pages), f"suspended {self!r} holds pages"
            assert all(p is None for p in self._live), f"suspended {self!r} holds a live page"
            return []
        assert self._committed <= self._history <= self._capacity, f"{self!r} lengths out of order"
        assert self._nblocks == -(-self._capacity // tpb), f"{self!r} holds {self._nblocks} blocks"
        assert len(self._blocks) == self._committed // tpb, f"{self!r} has {len(self._blocks)} tree blocks"
        if not self.key_mode and self._committing:
            assert len(self._partial) == self._committed % tpb, f"{self!r} partial tokens"
        out: list[Page] = []
        for g in mgr.attention_groups:
            lst = self._pages[g]
            assert len(lst) == self._nblocks, f"{self!r} group {g}: {len(lst)} pages"
            for b, p in enumerate(lst):
                if p is None:
                    assert g in mgr.sliding_groups, f"{self!r} group {g} block {b} has no page"
                    continue
                assert p.pool.tier is Tier.GPU and p.pool.group == g, f"{self!r} holds {p!r}"
                if b < len(self._blocks):
                    assert self._blocks[b].pages[g] is p, f"{self!r} block {b} page differs from tree"
                out.append(p)
        for g in mgr.recurrent_groups:
            live = self._live[g]
            assert live is not None and live.block is None, f"{self!r} group {g} live page {live!r}"
            out.append(live)
        return out

    def _state(self) -> tuple:
        """Everything observable about this cache, as a comparable value."""
        return (
            repr(self.id),
            self._status.value,
            self._committed,
            self._history,
            self._capacity,
            self._committing,
            tuple(tuple(-1 if p is None else p.index for p in lst) for lst in self._pages),
            tuple(-1 if p is None else p.index for p in self._live),
            tuple(self._partial),
            tuple(b.key for b in self._blocks),
            tuple(self._keys),
            tuple(self._stale_lo),
            self._next_stale_at,
            tuple(sorted(self._shared)),
            self._nblocks,
        )
