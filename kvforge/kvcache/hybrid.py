"""The hybrid cache manager: attention pages plus recurrent-state (linear attention) snapshots.

A recurrent state is reusable only at the exact token where it was saved. On top of
:class:`~kvforge.kvcache.manager.KVCacheManager` (whose matches are cut back to the last block holding a snapshot
of every recurrent group), :class:`HybridCacheManager` decides where snapshots are taken and its
:class:`HybridKVCache` caches hold one live state page per recurrent group. A runtime may pass a snapshot point
inside a step through the cache's pending snapshot slot (``acquire_snapshot_slot``, then
``commit(..., snapshot_from_pending=True)``); a scheduler gets the points through ``mark_context_request``.

Contract: the base manager's (check-then-act, ``CacheStateError`` on misuse changing nothing); a hybrid config
needs a recurrent layer (``ValueError``); mid-chunk snapshots need exactly one recurrent pool group. Which
snapshots survive pressure is the eviction policy's business (:mod:`kvforge.kvcache.snapshot_policy`). The
snapshot rules are listed on :class:`HybridCacheManager`. Pure Python except :class:`StateIndexUpload`
(re-exported from :mod:`kvforge.kvcache.state_upload`), which imports torch when built. Not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvforge.errors import CacheStateError
from kvforge.kvcache.cache import CacheHost, KVCache
from kvforge.kvcache.config import KVCacheConfig, Tier
from kvforge.kvcache.eviction import PRIORITY_MIN
from kvforge.kvcache.hashing import check_tokens
from kvforge.kvcache.hooks import HybridCachePolicy
from kvforge.kvcache.manager import KVCacheManager
from kvforge.kvcache.pools import Block, Page
from kvforge.kvcache.records import PageCopy, PriorityCallback
from kvforge.kvcache.state_upload import StateIndexUpload, UploadPath

__all__ = [
    "HybridCacheManager",
    "HybridCounters",
    "HybridKVCache",
    "StateIndexUpload",
    "UploadPath",
]

logger = logging.getLogger("kvforge.kvcache.hybrid")

_DEFAULT = object()


@dataclass
class HybridCounters:
    """Running totals of a hybrid manager (logged at most once a minute).

    ``snapshots``: snapshots that entered the tree (all kinds); ``branch_snapshots``: those at a branch point;
    ``pending_committed`` / ``pending_released``: pending (mid-chunk) pages moved into the tree / given back;
    ``prefix_waits``: requests that waited for a prefix another request was computing; ``points_requested``:
    distinct snapshot points asked of prefix owners; ``points_requested_committed``: those that got their
    snapshot; ``pruned_tokens``: prompt tokens whose attention blocks were cached but could not be reused because
    no snapshot lay at or after them (the match was cut back).
    """

    snapshots: int = 0
    branch_snapshots: int = 0
    pending_committed: int = 0
    pending_released: int = 0
    prefix_waits: int = 0
    points_requested: int = 0
    points_requested_committed: int = 0
    pruned_tokens: int = 0


def _align_down(x: int, a: int) -> int:
    return x - x % a


class HybridKVCache(KVCache):
    """A request's cache in a :class:`HybridCacheManager`: the base cache plus snapshot points and the pending
    snapshot slot. Created only by the manager."""

    __slots__ = (
        "_branch_point",
        "_commit_end",
        "_context_len",
        "_ending",
        "_from_pending",
        "_hybrid",
        "_pending",
        "_points",
        "_prompt_len",
        "_requested",
        "_short_rule_done",
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
        if not isinstance(manager, HybridCacheManager):
            raise TypeError(f"manager: expected a HybridCacheManager, got {type(manager).__name__}")
        super().__init__(manager, cache_id, scope, root, key_mode, priority_callback)
        self._hybrid: HybridCacheManager = manager
        self._pending: Page | None = None
        self._from_pending = False
        self._commit_end = -1
        self._ending = False
        self._prompt_len = 0
        self._context_len = 0
        self._branch_point: int | None = None
        self._requested: set[int] = set()
        self._points: frozenset[int] | None = None
        self._short_rule_done = False

    # --- views ---------------------------------------------------------------------------------------------------

    @property
    def pending_snapshot_slot(self) -> int | None:
        """The GPU page index of the pending snapshot page (None when the cache holds none)."""
        return None if self._pending is None else self._pending.index

    @property
    def pending_ssm_snapshot_slot(self) -> int | None:
        """Old name of :attr:`pending_snapshot_slot` (kept for existing callers)."""
        return None if self._pending is None else self._pending.index

    @property
    def pending_snapshot_page(self) -> Page | None:
        """The pending snapshot page itself (None when the cache holds none)."""
        return self._pending

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def context_len(self) -> int:
        return self._context_len

    @property
    def branch_point(self) -> int | None:
        """Where this prompt diverges from cached history (a block boundary), when a snapshot is wanted there."""
        return self._branch_point

    @property
    def snapshot_points(self) -> tuple[int, ...]:
        """Every explicit snapshot point of this cache (periodic ones up to its context length included). Its
        size grows with the context; the scheduler hook reads only the next few (:meth:`_points_between`)."""
        interval = self._hybrid.snapshot_interval
        out = set(self._points_of())
        if interval:
            out.update(range(interval, max(self._context_len, self._prompt_len) + 1, interval))
        return tuple(sorted(out))

    def _points_between(self, start: int, end: int, limit: int) -> list[int]:
        """The first ``limit`` snapshot points strictly inside ``(start, end)``, in order, without materialising
        the periodic ones beyond them (a 2e7-token prompt at a small interval has millions)."""
        out = sorted(p for p in self._points_of() if start < p < end)[:limit]
        interval = self._hybrid.snapshot_interval
        if interval:
            first = (start // interval + 1) * interval
            out = sorted(set(out).union(range(first, end, interval)[:limit]))[:limit]
        return out

    # --- snapshot points -----------------------------------------------------------------------------------------

    def request_snapshot_point(self, position: int) -> bool:
        """Ask for a snapshot at ``position`` (rounded down to a block boundary); True when the point is new."""
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position: expected an int, got {type(position).__name__}")
        if position < 1:
            raise ValueError(f"position: expected an int >= 1, got {position}")
        self._require_active("request_snapshot_point")
        p = _align_down(position, self.manager.tokens_per_block)
        if p == 0 or p in self._requested:
            return False
        self._requested.add(p)
        self._points = None
        mgr = self._hybrid
        mgr.counters.points_requested += 1
        mgr._record()
        return True

    def _require_active(self, op: str) -> None:
        if not self.is_active:
            raise CacheStateError(f"{op}: cache {self.id!r} is {self.status.value}, expected active")

    def _set_lengths(self, prompt_len: int, context_len: int) -> None:
        """The request's prompt and context lengths (they decide the prompt-end and periodic points)."""
        if self._prompt_len != prompt_len or self._context_len != context_len:
            self._prompt_len = prompt_len
            self._context_len = context_len
            self._points = None

    def _points_of(self) -> frozenset[int]:
        """The points that are not periodic (prompt ends, branch point, requested ones): a handful."""
        pts = self._points
        if pts is not None:
            return pts
        mgr = self._hybrid
        tpb = mgr.tokens_per_block
        out: set[int] = set()
        for d in mgr.prompt_end_offsets:
            p = _align_down(self._prompt_len - d, tpb)
            if p > 0:
                out.add(p)
        if self._branch_point is not None:
            out.add(self._branch_point)
        out.update(self._requested)
        pts = self._points = frozenset(out)
        return pts

    def _is_point(self, end: int) -> bool:
        interval = self._hybrid.snapshot_interval
        if interval and end % interval == 0:
            return True
        return end in self._points_of()

    def _apply_short_prompt_rule(self, prompt_len: int) -> None:
        if self._short_rule_done:
            return
        self._short_rule_done = True
        mgr = self._hybrid
        threshold = mgr.policy.low_priority_snapshot_prompt_len
        if not threshold or prompt_len >= threshold:
            return
        rec = frozenset(mgr.recurrent_groups)
        inner = self._priority_cb
        default = mgr.default_priority

        def short_prompt_priority(ordinal: int, group: int) -> int:
            if group in rec:
                return PRIORITY_MIN
            return default if inner is None else inner(ordinal, group)

        self._priority_cb = short_prompt_priority

    def _start(
        self,
        tokens: Sequence[int] | None,
        keys: Sequence[int] | None,
        prompt_len: int,
        exact: bool,
        reuse_limit: int | None,
    ) -> None:
        """Right after creation: record the prompt length, apply the short-prompt rule when the length is
        ``exact``, and (``reuse_limit`` not None) find the branch point and count the pruned tokens."""
        mgr = self._hybrid
        self._prompt_len = self._context_len = prompt_len
        if exact:
            self._apply_short_prompt_rule(prompt_len)
        if reuse_limit is None:
            return
        cached = self._attention_prefix_tokens(tokens, keys, reuse_limit)
        reused = self.num_reused_tokens
        if cached > reused:
            mgr.counters.pruned_tokens += cached - reused
            # Only a point this request will pass is useful (the end of the prompt is a point anyway).
            if cached < prompt_len:
                self._branch_point = cached
            mgr._record()

    def _attention_prefix_tokens(self, tokens: Sequence[int] | None, keys: Sequence[int] | None, limit: int) -> int:
        """Tokens of the prompt's leading full blocks present in the tree (ignoring the snapshot cut), capped to
        ``limit`` rounded down to a block. Continues from the blocks the cache reused: read-only."""
        tpb = self.manager.tokens_per_block
        max_full = limit // tpb
        blocks = self._blocks
        n = len(blocks)
        node = blocks[-1] if blocks else self._root
        while n < max_full:
            if keys is None or n >= len(keys):
                break
            child = node.children.get(keys[n])
            if child is None or child.num_tokens != tpb:
                break
            node = child
            n += 1
        return n * tpb

    # --- pending snapshot slot -----------------------------------------------------------------------------------

    def acquire_snapshot_slot(self) -> int | None:
        """Reserve a GPU page of the recurrent group for a mid-step snapshot; returns its index, or None when
        committing has stopped or no page is free even after eviction.

        Raises CacheStateError unless the manager has exactly one recurrent pool group (with several, the
        others would snapshot the live state at the end of the step, a different point), when the cache is not
        active, or when it already holds a pending page.
        """
        mgr = self._hybrid
        g = mgr._pending_group()
        self._require_active("acquire_snapshot_slot")
        if self._pending is not None:
            raise CacheStateError(
                f"acquire_snapshot_slot: cache {self.id!r} already holds pending slot {self._pending.index}"
            )
        if not self.committing:
            return None
        bp = mgr.block_pool
        page = bp.alloc_page(g)
        bp.flush_events()
        if page is None:
            return None
        self._pending = page
        return page.index

    def release_snapshot_slot(self) -> bool:
        """Give the pending page back; False when the cache holds none."""
        if self._pending is None:
            return False
        self._release_pending()
        return True

    # Old names (kept for existing callers): the project's vocabulary is "snapshot" and "recurrent".
    acquire_ssm_snapshot_slot = acquire_snapshot_slot
    release_ssm_snapshot_slot = release_snapshot_slot

    def _release_pending(self) -> None:
        page = self._pending
        if page is None:
            return
        self._pending = None
        mgr = self._hybrid
        mgr.block_pool.free_page(page)
        mgr.counters.pending_released += 1

    # --- commit --------------------------------------------------------------------------------------------------

    def commit(
        self,
        tokens: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        block_keys: Sequence[int] | None = None,
        snapshot_from_pending: bool = False,
        is_end: bool = False,
        ssm_from_pending: bool = False,
    ) -> None:
        """:meth:`KVCache.commit`, plus:

        ``snapshot_from_pending`` (old name ``ssm_from_pending``, still accepted): the snapshot at this commit's
        end comes from the pending page (written mid-step),
        not from the live state. Raises CacheStateError, changing nothing, without a pending page or with
        ``is_end``; otherwise the pending page ends up in the tree or released, whatever happens (an error in
        the commit itself releases it and propagates).

        ``is_end``: this is the sequence's last commit: its partial tail is inserted into the tree now (with
        the live state as its snapshot when the state is exactly there) and the cache stops committing.
        """
        if snapshot_from_pending or ssm_from_pending:
            if is_end:
                raise CacheStateError(
                    f"commit: cache {self.id!r}: snapshot_from_pending cannot end the sequence (is_end); the state "
                    "at the end is the live one"
                )
            if self._pending is None:
                raise CacheStateError(f"commit: cache {self.id!r} has no pending snapshot slot (snapshot_from_pending)")
            try:
                n = len(tokens) if tokens is not None else num_tokens
                self._commit_end = self.num_committed_tokens + (n if isinstance(n, int) else 0)
                self._from_pending = True
                super().commit(tokens, num_tokens=num_tokens, block_keys=block_keys)
            finally:
                self._from_pending = False
                self._commit_end = -1
                if self._pending is not None:
                    self._release_pending()
            return
        if not is_end or not self.committing or not self.is_active:
            super().commit(tokens, num_tokens=num_tokens, block_keys=block_keys)
            if is_end:
                self._end_sequence()
            return
        # Every priority the end of the sequence needs is asked for first: a failing callback then leaves the
        # cache exactly as it was (nothing committed, still committing).
        n = len(tokens) if tokens is not None and hasattr(tokens, "__len__") else num_tokens
        release = snap = None
        if type(n) is int and n >= 0:
            end = self.num_committed_tokens + n
            release = self._release_priorities(end)
            snap = self._end_snapshot_priorities(end)
        super().commit(tokens, num_tokens=num_tokens, block_keys=block_keys)
        self._end_sequence(release, snap)

    # --- snapshots (base-cache hooks) ----------------------------------------------------------------------------

    def _snapshot_pages(self, block: Block, ordinal: int) -> dict[int, Page]:
        mgr = self._hybrid
        end = ordinal * mgr.tokens_per_block + block.num_tokens
        if self._from_pending:
            if end != self._commit_end:
                return {}
            g = mgr.recurrent_groups[0]
            page = self._pending
            if page is None or block.pages[g] is not None or not self._is_point(end):
                return {}
            self._pending = None
            mgr.counters.pending_committed += 1
            self._count_snapshot(end)
            return {g: page}
        if end != self._history:
            return {}
        partial = block.num_tokens < mgr.tokens_per_block
        # A partial tail is inserted only when a sequence ends: its state is what the next turn reuses.
        if not partial and not self._is_point(end):
            return {}
        if all(block.pages[g] is not None for g in mgr.recurrent_groups):
            return {}
        out = self._take_live(block) if self._ending else self._copy_live(block)
        if out:
            self._count_snapshot(end)
        return out

    def _copy_live(self, block: Block) -> dict[int, Page]:
        bp = self._hybrid.block_pool
        out: dict[int, Page] = {}
        for g in self._hybrid.recurrent_groups:
            if block.pages[g] is not None:
                continue
            page = bp.alloc_page(g)
            if page is None:
                continue
            live = self._live[g]
            assert live is not None
            bp.record_copy(PageCopy(g, Tier.GPU, live.index, Tier.GPU, page.index))
            out[g] = page
        return out

    def _take_live(self, block: Block) -> dict[int, Page]:
        """The ending cache's live pages become the snapshots themselves (no copy, no allocation)."""
        out: dict[int, Page] = {}
        for g in self._hybrid.recurrent_groups:
            live = self._live[g]
            if live is not None and block.pages[g] is None:
                self._live[g] = None
                out[g] = live
        return out

    def _count_snapshot(self, end: int) -> None:
        mgr = self._hybrid
        c = mgr.counters
        c.snapshots += 1
        if end == self._branch_point:
            c.branch_snapshots += 1
            mgr._record()
        if end in self._requested:
            c.points_requested_committed += 1
            mgr._record()

    def _end_snapshot_priorities(self, committed: int) -> dict[int, int] | None:
        """The recurrent priorities ``_end_snapshot`` would ask for at ``committed`` tokens (None: default)."""
        mgr = self._hybrid
        tpb = mgr.tokens_per_block
        if self._constant_priority() or not committed or committed % tpb:
            return None
        return {g: self._priority(committed // tpb - 1, g, committed) for g in mgr.recurrent_groups}

    def _end_snapshot(self, given: dict[int, int] | None = None) -> None:
        """Snapshot the live state at the committed end when that is a full-block boundary without one (the
        partial-tail case goes through ``_insert_partial``); ``given``: priorities asked for beforehand."""
        mgr = self._hybrid
        tpb = mgr.tokens_per_block
        committed = self._committed
        if not committed or committed % tpb or self._history != committed:
            return
        block = self._blocks[-1]
        rec = mgr.recurrent_groups
        if all(block.pages[g] is not None for g in rec):
            return
        ordinal = committed // tpb - 1
        prios = given if given is not None else {g: self._priority(ordinal, g, committed) for g in rec}
        snaps = self._take_live(block) if self._ending else self._copy_live(block)
        if not snaps:
            return
        self._count_snapshot(committed)
        bp = mgr.block_pool
        bp.tick()
        for g, page in snaps.items():
            bp.attach(page, block, prios[g])

    def _end_sequence(
        self,
        release: dict[tuple[int, int], int] | None = None,
        snap: dict[int, int] | None = None,
    ) -> None:
        """``commit(..., is_end=True)``: insert the tail now (snapshots copied from the live state) and stop.
        ``release`` / ``snap``: the priorities, asked for before the commit (asked here when not given)."""
        if not self._committing:
            return
        prios = release if release is not None else self._release_priorities()
        self._end_snapshot(snap)
        self._insert_partial(prios)
        self._hybrid.block_pool.flush_events()
        self.stop_committing()

    # --- life-cycle hooks ----------------------------------------------------------------------------------------

    def _on_suspend(self) -> None:
        self._release_pending()
        self._ending = True
        self._end_snapshot()

    def _on_close(self) -> None:
        self._release_pending()
        self._ending = True
        self._end_snapshot()

    def _on_stop_committing(self) -> None:
        self._release_pending()

    def _suspend(self) -> None:
        try:
            super()._suspend()
        finally:
            self._ending = False

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._ending = False


class HybridCacheManager(KVCacheManager):
    """KV cache manager for hybrid attention + recurrent models (see the module docstring).

    * **Live state**: every active cache holds one live state page per recurrent group (the base manager's
      ``live_page``); a cache that reuses a prefix starts from a copy of the snapshot there.
    * **Snapshot points** (block boundaries, tokens from the start): multiples of ``snapshot_interval``; for each
      ``d`` in ``prompt_end_offsets`` the last block boundary at or before ``prompt_len - d`` (the default ``(0,)``
      keeps the furthest point a longer next-turn prompt can reuse); the **branch point** (the end of the longest
      prefix of the prompt whose attention blocks are cached, when no snapshot lies there: where this prompt
      diverges from cached history, so the next prompt sharing that prefix reuses it); and points that requests
      waiting for this request's prefix asked for (``request_snapshot_point``). A commit snapshots the live state
      at a block end that is a point when the cache's history is exactly there (a step ends at it). When a cache
      closes or is suspended with its live state at its committed end, that state becomes the snapshot there
      (the page itself moves into the tree: no copy).
    * **Marks for the scheduler**: :meth:`HybridCacheManager.mark_context_request` (the scheduler's optional
      hook) sets ``request.set_snapshot_marks(points, alignment=..., pass_point=...)``: the future points, the
      manager's mid-chunk alignment (``MIDCHUNK_SNAPSHOT_ALIGNMENT``, a constant of the class, None when the
      manager cannot take mid-chunk snapshots) and, when at least two points remain, the next one as the pass
      point.
    * **Pending snapshot slot** (mid-chunk snapshots): before a step that passes point ``P`` inside it, the runtime
      calls ``slot = cache.acquire_snapshot_slot()`` and the recurrent kernel writes the state at ``P`` into
      that page; after the step it commits up to ``P`` with ``cache.commit(..., snapshot_from_pending=True)`` (the
      pending page moves into the tree block ending at ``P``, with the cache's priority) and then the rest. If that
      commit records no snapshot at its end (the block is already covered, it ends inside a block or at no
      snapshot point, committing stopped, or the commit raised) the pending page is released. Suspend,
      stop committing and close release it too.
    * **Short prompts**: with ``HybridCachePolicy.low_priority_snapshot_prompt_len = L > 0`` a context request
      whose prompt is shorter than ``L`` gets its recurrent pages (live state and snapshots) at priority 0;
      attention pages keep the default (or the caller's callback).
    * **Counters** (:class:`HybridCounters`), logged at INFO at most once per ``log_interval_s`` (a minute) on the
      injected clock.
    * **State-index upload** (:class:`StateIndexUpload`): the per-step live-state indices and dummy-request mask
      reach the device through ``kernels.copy_small_pinned_pair`` when ``HybridCachePolicy.state_index_upload_kernel``
      is on, through ordinary copies otherwise, and not at all when neither changed.

    ``policy``: the model's :class:`~kvforge.kvcache.hooks.HybridCachePolicy` (short-prompt priority, upload
    path). ``snapshot_interval``: periodic snapshot points every that many tokens (a multiple of
    ``tokens_per_block``; 0 = off). ``prompt_end_offsets``: points at ``align_down(prompt_len - d)``.
    ``midchunk_snapshot_alignment``: defaults to the class constant ``MIDCHUNK_SNAPSHOT_ALIGNMENT``; None never
    marks requests for mid-chunk snapshots. ``clock`` (seconds) and ``log_interval_s`` rate-limit the counter
    log line. Other keyword arguments go to :class:`~kvforge.kvcache.manager.KVCacheManager`.
    """

    cache_class = HybridKVCache
    # The recurrent prefill kernel's chunk (KDA processes 64-token chunks): the state can be stored at any
    # multiple of it counted from a step's first token.
    MIDCHUNK_SNAPSHOT_ALIGNMENT: int | None = 64

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        policy: HybridCachePolicy | None = None,
        snapshot_interval: int = 0,
        prompt_end_offsets: Sequence[int] = (0,),
        midchunk_snapshot_alignment: Any = _DEFAULT,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        if policy is None:
            policy = HybridCachePolicy()
        if not isinstance(policy, HybridCachePolicy):
            raise TypeError(f"policy: expected a HybridCachePolicy, got {type(policy).__name__}")
        if isinstance(snapshot_interval, bool) or not isinstance(snapshot_interval, int):
            raise TypeError(f"snapshot_interval: expected an int, got {type(snapshot_interval).__name__}")
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        tpb = config.tokens_per_block
        if snapshot_interval < 0 or snapshot_interval % tpb:
            raise ValueError(
                f"snapshot_interval: expected 0 or a positive multiple of tokens_per_block ({tpb}), got "
                f"{snapshot_interval}"
            )
        offsets = tuple(prompt_end_offsets)
        for i, d in enumerate(offsets):
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"prompt_end_offsets[{i}]: expected an int >= 0, got {d!r}")
        if midchunk_snapshot_alignment is _DEFAULT:
            midchunk_snapshot_alignment = self.MIDCHUNK_SNAPSHOT_ALIGNMENT
        a = midchunk_snapshot_alignment
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1):
            raise ValueError(f"midchunk_snapshot_alignment: expected an int >= 1 or None, got {a!r}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable, got {type(clock).__name__}")
        if log_interval_s < 0:
            raise ValueError(f"log_interval_s: expected >= 0, got {log_interval_s}")
        super().__init__(config, **kwargs)
        if not self.recurrent_groups:
            raise ValueError("config: a hybrid cache manager needs at least one recurrent layer")
        self.policy = policy
        self.snapshot_interval = snapshot_interval
        self.prompt_end_offsets = offsets
        self.midchunk_snapshot_alignment: int | None = a if len(self.recurrent_groups) == 1 else None
        self.counters = HybridCounters()
        self._clock_fn = clock
        self.log_interval_s = float(log_interval_s)
        self._last_log: float | None = None
        if policy.low_priority_snapshot_prompt_len:
            logger.info(
                "hybrid cache: recurrent pages of prompts shorter than %d tokens (low_priority_snapshot_prompt_len) "
                "are evicted first (priority %d)",
                policy.low_priority_snapshot_prompt_len,
                PRIORITY_MIN,
            )

    # --- creation ------------------------------------------------------------------------------------------------

    def create_cache(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        scope: Hashable | None = None,
        capacity: int | None = None,
        reuse: bool = True,
        max_reuse_tokens: int | None = None,
        priority_callback: PriorityCallback | None = None,
        cache_id: Hashable | None = None,
        prompt_len: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> HybridKVCache:
        """:meth:`KVCacheManager.create_cache`, plus ``prompt_len`` (the prompt's length in tokens, for key-mode
        prompts whose keys cover full blocks only; default ``len(tokens)`` or ``len(block_keys) *
        tokens_per_block``). Finds the branch point and counts the tokens the snapshot cut pruned."""
        if prompt_len is not None and (isinstance(prompt_len, bool) or not isinstance(prompt_len, int)):
            raise TypeError(f"prompt_len: expected an int or None, got {type(prompt_len).__name__}")
        if prompt_len is not None and prompt_len < 0:
            raise ValueError(f"prompt_len: expected an int >= 0, got {prompt_len}")
        if tokens is not None and block_keys is None and reuse:
            # Keyed once here: the base class and the branch-point search below both use these keys.
            tokens = check_tokens(tokens, vocab_size=self.hasher.vocab_size)
            block_keys = self.prompt_keys(tokens, scope, cache_salt)
        cache = super().create_cache(
            tokens,
            block_keys=block_keys,
            scope=scope,
            capacity=capacity,
            reuse=reuse,
            max_reuse_tokens=max_reuse_tokens,
            priority_callback=priority_callback,
            cache_id=cache_id,
            cache_salt=cache_salt,
        )
        assert isinstance(cache, HybridKVCache)
        # Keys cover full blocks only: without prompt_len a key-mode prompt's length is known only up to its
        # last full block, so the short-prompt rule waits for mark_context_request (which knows it exactly).
        exact = prompt_len is not None or tokens is not None
        if prompt_len is None:
            prompt_len = len(tokens) if tokens is not None else len(block_keys or ()) * self.tokens_per_block
        limit = None
        if reuse and (tokens is not None or block_keys is not None):
            limit = prompt_len if max_reuse_tokens is None else min(prompt_len, max_reuse_tokens)
        cache._start(tokens, block_keys, prompt_len, exact, limit)
        return cache

    # --- snapshot points -----------------------------------------------------------------------------------------

    def snapshot_points(self, cache: HybridKVCache, after: int = 0) -> tuple[int, ...]:
        """The cache's snapshot points past ``after``, in order (for runtimes and replays without a scheduler)."""
        return tuple(p for p in cache.snapshot_points if p > after)

    def mark_context_request(self, request: Any) -> None:
        """Scheduler hook, before each context chunk is sized: set the request's snapshot points (those still
        ahead of it, before its context end), the mid-chunk alignment and a pass point (the next point when at
        least two remain). Reads ``prompt_len``, ``context_len``, ``num_computed_tokens`` and
        ``requested_snapshot_points`` of the request; a request without an active cache of this manager is left
        unmarked."""
        cache = getattr(request, "cache", None)
        if not isinstance(cache, HybridKVCache) or cache.manager is not self or not cache.is_active:
            return
        cache._set_lengths(request.prompt_len, request.context_len)
        cache._apply_short_prompt_rule(request.prompt_len)
        for p in request.requested_snapshot_points:
            cache.request_snapshot_point(p)
        start = request.num_computed_tokens
        end = request.context_len
        # The scheduler passes at most one point inside a step and stops at the next, so the first few points
        # decide every step exactly (more than two, so the last one listed is never taken for the last one).
        pts = cache._points_between(start, end, 8)
        if not pts:
            request.clear_snapshot_marks()
            return
        alignment = self.midchunk_snapshot_alignment
        pass_point = pts[0] if alignment is not None and len(pts) >= 2 else None
        request.set_snapshot_marks(pts, alignment=alignment, pass_point=pass_point)

    def count_prefix_waits(self, requests: Sequence[Any]) -> None:
        """Scheduler hook: these requests started waiting for a prefix another request is computing."""
        if requests:
            self.counters.prefix_waits += len(requests)
            self._record()

    # --- pending pages -------------------------------------------------------------------------------------------

    def _extra_page_refs(self) -> Iterable[Page]:
        for cache in self._caches.values():
            page = cache.pending_snapshot_page if isinstance(cache, HybridKVCache) else None
            if page is not None:
                yield page

    def _pending_group(self) -> int:
        rec = self.recurrent_groups
        if len(rec) != 1:
            raise CacheStateError(
                f"acquire_snapshot_slot: mid-chunk snapshots need exactly one shared recurrent pool group, this "
                f"manager has {len(rec)} ({list(rec)})"
            )
        return rec[0]

    # --- counters ------------------------------------------------------------------------------------------------

    def _record(self) -> None:
        """A counter changed: log them all at INFO unless a line was logged less than ``log_interval_s`` ago."""
        now = self._clock_fn()
        last = self._last_log
        if last is not None and now - last < self.log_interval_s:
            return
        self._last_log = now
        logger.info("hybrid cache counters: %s", ", ".join(f"{k} {v}" for k, v in asdict(self.counters).items()))

    # --- verification --------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The base invariants, plus: a pending page is held only by an active cache, is a locked GPU page of the
        recurrent group in no tree block, and is nobody's live page nor another cache's pending page."""
        super().check_invariants()
        seen: set[int] = set()
        rec = self.recurrent_groups
        caches = self.caches
        live = {id(p) for c in caches for g in rec if (p := c.live_page(g)) is not None}
        for cache in caches:
            page = cache.pending_snapshot_page if isinstance(cache, HybridKVCache) else None
            if page is None:
                continue
            assert cache.is_active, f"{cache!r} is not active but holds pending {page!r}"
            assert len(rec) == 1 and page.pool is self.block_pool.gpu[rec[0]], f"pending {page!r} of a wrong pool"
            assert page.ref_count == 1 and page.block is None, f"pending {page!r} is not a locked uncommitted page"
            assert id(page) not in live, f"pending {page!r} is also a live page"
            assert id(page) not in seen, f"pending {page!r} is held twice"
            seen.add(id(page))

    # --- state-index upload --------------------------------------------------------------------------------------

    def step_state_indices(
        self, caches: Sequence[KVCache], num_dummy: int = 0, *, group: int | None = None, pad_index: int = 0
    ) -> tuple[list[int], list[bool]]:
        """Per step row: the live state page index of ``group`` (default: the first recurrent group) for each
        cache, then ``num_dummy`` padding rows (``pad_index``) flagged in the dummy-request mask."""
        rec = self.recurrent_groups
        g = rec[0] if group is None else group
        if g not in rec:
            raise ValueError(f"group: {g} is not a recurrent pool group (those are {list(rec)})")
        idx = []
        for c in caches:
            # The live page list itself (``live_page`` would check the group id once per cache; it is checked above).
            page = c._live[g]
            if page is None:
                raise CacheStateError(f"step_state_indices: cache {c.id!r} is {c.status.value}, expected active")
            idx.append(page.index)
        return idx + [pad_index] * num_dummy, [False] * len(caches) + [True] * num_dummy

    def state_index_upload(self, max_requests: int, **kwargs: Any) -> StateIndexUpload:
        """A :class:`StateIndexUpload` whose path follows ``policy.state_index_upload_kernel``."""
        return StateIndexUpload(max_requests, use_kernel=self.policy.state_index_upload_kernel, **kwargs)
