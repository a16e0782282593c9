"""The paged KV cache manager and its per-request caches.

Typical use (one request)::

    mgr = KVCacheManager(config, event_sink=router_feed)
    keys = block_hashes(prompt, config.tokens_per_block, scope)      # once per request; optional
    n = mgr.probe_reuse(prompt, scope, block_keys=keys)               # read-only: how much is cached
    if mgr.plan_admission(prompt, block_keys=keys, scope=scope, capacity=chunk_end).fits:   # check ...
        cache = mgr.create_cache(prompt, block_keys=keys, scope=scope, capacity=chunk_end,  # ... then act
                                 max_reuse_tokens=len(prompt) - 1)
    cache.resize(history=chunk_end)                 # the forward step writes KV into cache.page_indices(g)
    cache.commit(prompt[cache.num_committed_tokens:chunk_end])      # full blocks become reusable (BlockStored)
    cache.resize(capacity=cache.history + 1, history=cache.history + 1)   # each decode step (False: no pages)
    cache.commit([token])
    cache.close()                                   # committed blocks stay in the tree, evictable

**Per-cache invariant**: ``num_committed_tokens <= history <= capacity``. ``capacity`` is what pages are held
for (``ceil(capacity / tokens_per_block)`` blocks in every attention group), ``history`` is how many tokens'
KV the cache holds, ``committed`` how many of those are final and reusable (inserted in the radix tree).
Sliding-window pages that no token after the committed ones can read are given back as commits advance.

**States**: ACTIVE (holds GPU pages) → SUSPENDED (holds none; its committed blocks stay reusable in the tree,
``resume`` re-acquires them) → ACTIVE, and any → CLOSED. Every misuse (an operation not valid in the state,
breaking the invariant) raises :class:`~kvforge.errors.CacheStateError` and changes nothing; bad argument types
or values raise ``TypeError`` / ``ValueError``. ``resize`` and ``resume`` return False (changing nothing) when
pages cannot be found even after eviction; ``create_cache`` raises :class:`~kvforge.errors.OutOfPagesError`.

**Copies**: the manager never touches device memory. Moving a page between tiers (eviction to host,
onboarding back to the GPU), reusing a partial block (copy-on-write) and starting a recurrent state from a
snapshot are recorded as :class:`PageCopy` items in order. The runtime takes them with
:meth:`KVCacheManager.take_pending_copies` and must execute them, in order, before the next forward step;
that ordering is what makes it safe to reassign a source page right after its copy was recorded. A cache
that reuses nothing (``num_committed_tokens == 0`` after create/resume) gets no copy for its recurrent live
state: the runtime zeroes it.

**Partial-block reuse**: a prompt may reuse the first tokens of a block (copied into a fresh page), matched
by comparing tokens. The tree keeps the tokens of every partial block (a request's committed tail, inserted
when it closes or is suspended), of every block completed token by token (decode) and of the last full block
of every commit; other full blocks keep only their hash, because copying every block's tokens would double
the cost of inserting a long prompt. A prompt that diverges inside such a block reuses up to its start.

**Extension points** (for the hybrid manager and schedulers): ``eviction_policy`` (a factory per pool),
``priority_callback`` per cache (block ordinal, group id) → 0..100, ``swa_priorities`` for sliding-window
endpoints, ``cache_class`` (a :class:`KVCache` subclass), the hooks ``_snapshot_pages``, ``_on_suspend``,
``_on_close``, ``_on_stop_committing``, ``_extra_page_refs``, and the page helpers ``_alloc_page`` /
``_free_page`` and the ``_copies`` list. ``check_invariants`` and ``state_snapshot`` serve tests.

Not thread-safe: one scheduler thread drives a manager.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import count
from typing import Any

from kvforge.errors import CacheStateError, OutOfPagesError
from kvforge.kvcache.config import KVCacheConfig, LayerOwner, LifeCycleKind, PoolGroupSpec, Tier
from kvforge.kvcache.events import BlockRemoved, BlockStored, EventSink
from kvforge.kvcache.eviction import (
    DEFAULT_PRIORITY,
    PRIORITY_MIN,
    EvictionPolicyFactory,
    PrioritizedLRU,
    check_priority,
)
from kvforge.kvcache.hashing import chain_hashes
from kvforge.kvcache.pools import Page, PagePool
from kvforge.kvcache.radix import Block, RadixTree

__all__ = [
    "AdmissionPlan",
    "CacheStatus",
    "KVCache",
    "KVCacheManager",
    "ManagerStats",
    "PageCopy",
    "PriorityCallback",
    "ReuseMatch",
    "SwaPriorities",
]

PriorityCallback = Callable[[int, int], int]
"""``(block ordinal, pool group id) -> priority`` in 0..100, asked when a cache commits or releases a page."""


class CacheStatus(Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


_ACTIVE = CacheStatus.ACTIVE
_SUSPENDED = CacheStatus.SUSPENDED
_CLOSED = CacheStatus.CLOSED


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


@dataclass(frozen=True)
class ReuseMatch:
    """What a prompt can reuse: ``blocks`` (full, in order) then ``partial_tokens`` tokens of ``partial``."""

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


def _check_count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {v}")
    return v


def _int_sequence(name: str, v: object) -> Sequence[int]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(v).__name__}")
    return v


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
        manager: KVCacheManager,
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
        self._pages: list[list[Page | None]] = [[] for _ in range(g)]
        self._live: list[Page | None] = [None] * g
        self._blocks: list[Block] = []
        self._keys: list[int] = []
        self._partial: list[int] = []
        self._priority_cb = priority_callback
        # Ordinals of blocks this cache completed but found already in the tree (shared like reused ones).
        self._shared: set[int] = set()
        self._stale_lo = [0] * g
        self._next_stale_at = manager._never

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

    def pages(self, group: int) -> tuple[Page | None, ...]:
        """This cache's page per block of an attention group (None: a stale sliding-window block)."""
        return tuple(self._pages[group])

    def page_indices(self, group: int) -> list[int]:
        """GPU page index per block of an attention group, -1 where the cache holds none."""
        return [-1 if p is None else p.index for p in self._pages[group]]

    def live_page(self, group: int) -> Page | None:
        """The live recurrent-state page of a recurrent group (None for attention groups or when not active)."""
        return self._live[group]

    def pages_needed(self, capacity: int) -> tuple[int, ...]:
        """GPU pages per group that growing to ``capacity`` tokens would take (zeros when shrinking)."""
        _check_count("capacity", capacity)
        return self.manager._pages_needed(self, -(-capacity // self.manager.tokens_per_block))

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
            _check_count("capacity", capacity)
        if history is None:
            history = self._history
        elif type(history) is not int:
            _check_count("history", history)
        if capacity < 0 or history < 0:
            raise ValueError(f"resize: capacity and history must be >= 0, got {capacity}, {history}")
        if history < self._committed or history > capacity:
            raise CacheStateError(
                f"resize: cache {self.id!r} needs committed ({self._committed}) <= history ({history}) <= "
                f"capacity ({capacity})"
            )
        nblocks = -(-capacity // self.manager.tokens_per_block)
        if nblocks != self._nblocks and not self.manager._set_num_blocks(self, nblocks):
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
            n = len(_int_sequence("tokens", tokens))
        else:
            if not self.key_mode:
                raise ValueError("tokens: expected the committed tokens (this cache is in token mode)")
            if num_tokens is None:
                raise ValueError("num_tokens: required with block_keys in key mode")
            n = _check_count("num_tokens", num_tokens)
        committed = self._committed
        if committed + n > self._history:
            raise CacheStateError(
                f"commit: cache {self.id!r} would commit {committed + n} tokens past its history {self._history}"
            )
        tpb = self.manager.tokens_per_block
        if block_keys is None and (committed % tpb) + n < tpb:
            # Fast path (a decode step): no block completes.
            if committed + n >= self._next_stale_at:
                self.manager._commit_in_block(self, tokens, committed + n)
                return
            if tokens is not None:
                self._partial.extend(tokens)
            self._committed = committed + n
            return
        self.manager._commit(self, tokens, n, block_keys)

    def stop_committing(self) -> None:
        """No further commits: later tokens are never inserted in the tree. Idempotent; not on a closed cache."""
        if self._status is _CLOSED:
            raise CacheStateError(f"stop_committing: cache {self.id!r} is closed")
        if self._committing:
            self.manager._on_stop_committing(self)
        self._committing = False

    def suspend(self) -> None:
        """Release every GPU page (preemption). Committed blocks stay reusable in the tree; uncommitted KV is lost,
        so history and capacity fall back to the committed length."""
        self._require(_ACTIVE, "suspend")
        self.manager._suspend(self)

    def resume(self) -> bool:
        """Re-acquire the committed prefix from the tree. False (still suspended, nothing changed) when part of
        it was evicted or pages cannot be found; the caller may then close and recreate the cache. A cache that
        had stopped committing left no partial tail in the tree, so it resumes only at a block boundary."""
        self._require(_SUSPENDED, "resume")
        return self.manager._resume(self)

    def close(self) -> None:
        """Release everything; committed blocks (and the partial last block) stay reusable in the tree."""
        if self._status is _CLOSED:
            raise CacheStateError(f"close: cache {self.id!r} is already closed")
        self.manager._close(self)


class KVCacheManager:
    """Pools per (tier, group), the radix tree, eviction and the per-request caches.

    ``event_sink`` receives :class:`~kvforge.kvcache.events.BlockStored` when blocks enter the tree and
    :class:`~kvforge.kvcache.events.BlockRemoved` when they leave it (dropped from the last tier).
    ``eviction_policy`` is a factory ``(group_spec, tier) -> EvictionPolicy`` (default
    :class:`~kvforge.kvcache.eviction.PrioritizedLRU`); ``default_priority`` applies where a cache has no
    callback; ``swa_priorities`` (optional) decides sliding-window pages by position.
    """

    cache_class: type[KVCache] = KVCache

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        event_sink: EventSink | None = None,
        eviction_policy: EvictionPolicyFactory | None = None,
        default_priority: int = DEFAULT_PRIORITY,
        swa_priorities: SwaPriorities | None = None,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        if event_sink is not None and not callable(event_sink):
            raise TypeError(f"event_sink: expected a callable or None, got {type(event_sink).__name__}")
        if eviction_policy is not None and not callable(eviction_policy):
            raise TypeError(f"eviction_policy: expected a factory callable, got {type(eviction_policy).__name__}")
        if swa_priorities is not None and not isinstance(swa_priorities, SwaPriorities):
            raise TypeError(f"swa_priorities: expected SwaPriorities or None, got {type(swa_priorities).__name__}")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.groups: tuple[PoolGroupSpec, ...] = config.groups
        self.num_groups = len(self.groups)
        self.default_priority = check_priority(default_priority, "default_priority")
        self.swa_priorities = swa_priorities
        self.stats = ManagerStats()
        self._sink = event_sink
        factory = eviction_policy or PrioritizedLRU
        self._pools: list[list[PagePool]] = []
        for tier_cfg in config.tiers:
            counts = config.pages_per_group(tier_cfg.tier)
            self._pools.append(
                [
                    PagePool(g.group_id, tier_cfg.tier, counts[g.group_id], g.life_cycle, factory(g, tier_cfg.tier))
                    for g in self.groups
                ]
            )
        for tier_pools in self._pools[:-1]:
            for pool in tier_pools:
                below = self._pools[pool.tier + 1][pool.group]
                pool.last = below.capacity == 0
        self._gpu = self._pools[0]
        kinds = [g.life_cycle.kind for g in self.groups]
        self._full = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.FULL)
        self._swa = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.SLIDING)
        self._rec = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.RECURRENT)
        self._attn = tuple(i for i, k in enumerate(kinds) if k is not LifeCycleKind.RECURRENT)
        self._never = 1 << 62
        self._tree = RadixTree(self.num_groups)
        self._clock = 0
        self._copies: list[PageCopy] = []
        self._removed: list[int] = []
        self._caches: dict[Hashable, KVCache] = {}
        self._ids = count()
        self._tables: list[Any] = []

    # --- introspection -----------------------------------------------------------------------------------------

    def pool(self, group: int, tier: Tier = Tier.GPU) -> PagePool:
        """The pages of one pool group in one tier."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group: expected a pool group id in [0, {self.num_groups}), got {group}")
        if tier >= len(self._pools):
            raise ValueError(f"tier: this manager has no {Tier(tier).name} tier")
        return self._pools[tier][group]

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(Tier(i) for i in range(len(self._pools)))

    @property
    def caches(self) -> tuple[KVCache, ...]:
        """Every cache not closed yet (active or suspended)."""
        return tuple(self._caches.values())

    @property
    def num_tree_blocks(self) -> int:
        return self._tree.num_blocks

    @property
    def tree(self) -> RadixTree:
        return self._tree

    def layer_owner(self, layer_id: int) -> LayerOwner:
        """TARGET or DRAFT (a drafter's appended layer)."""
        return self.config.layer_owner(layer_id)

    def layer_dtype(self, layer_id: int) -> str:
        return self.config.layer_dtype(layer_id)

    def partition_key(self, layer_id: int) -> tuple[str, int]:
        """Disaggregation transfer partition ``(owner, num_kv_heads)``; target and draft never share one."""
        return self.config.partition_key(layer_id)

    def group_of_layer(self, layer_id: int) -> int:
        """The pool group whose pages (``KVCache.page_indices(group)``) address this layer's buffer."""
        return self.config.group_of_layer(layer_id)

    def num_free_pages(self, group: int, tier: Tier = Tier.GPU) -> int:
        return len(self.pool(group, tier).free)

    def num_available_pages(self, group: int) -> int:
        """GPU pages of ``group`` obtainable now: free plus every unlocked one (reclaimable by eviction)."""
        return self._gpu[group].num_available

    def can_allocate(self, pages_per_group: Sequence[int]) -> bool:
        """Whether that many GPU pages per group (group-id order) can be obtained now (read-only)."""
        if len(pages_per_group) != self.num_groups:
            raise ValueError(f"pages_per_group: expected {self.num_groups} counts, got {len(pages_per_group)}")
        return all(n <= pool.num_available for n, pool in zip(pages_per_group, self._gpu))

    def take_pending_copies(self) -> list[PageCopy]:
        """The copies recorded since the last call, in the order the runtime must execute them."""
        out, self._copies = self._copies, []
        return out

    # --- reuse ---------------------------------------------------------------------------------------------------

    def probe_reuse(
        self,
        tokens: Sequence[int] | None = None,
        scope: Hashable | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        max_reuse_tokens: int | None = None,
    ) -> int:
        """Tokens a cache created now for this prompt (same arguments) would reuse. Read-only: no LRU touch, no
        ref count, no allocation (not even the scope's root)."""
        keys, tokens = self._check_prompt(tokens, block_keys)
        if max_reuse_tokens is not None:
            _check_count("max_reuse_tokens", max_reuse_tokens)
        root = self._tree.find_root(scope)
        if root is None:
            return 0
        return self._match(root, keys, tokens, max_reuse_tokens).num_tokens

    def plan_admission(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        scope: Hashable | None = None,
        capacity: int | None = None,
        reuse: bool = True,
        max_reuse_tokens: int | None = None,
    ) -> AdmissionPlan:
        """Whether :meth:`create_cache` with the same arguments would succeed now, and what it would take.

        Read-only, like :meth:`probe_reuse`. ``capacity`` is the tokens the new cache must hold (at least the
        reused ones), e.g. the end of a scheduler's first chunk. The page counts are exact: they include
        onboarding reused blocks from the host tier, partial-block copies and recurrent live states, and discount
        the unlocked pages the reuse itself would lock.
        """
        keys, tokens = self._check_prompt(tokens, block_keys)
        if max_reuse_tokens is not None:
            _check_count("max_reuse_tokens", max_reuse_tokens)
        if capacity is not None:
            _check_count("capacity", capacity)
        root = self._tree.find_root(scope)
        match = self._match_for(root, keys, tokens, reuse, max_reuse_tokens)
        nblocks = -(-max(capacity or 0, match.num_tokens) // self.tokens_per_block)
        _, _, need, taken, _ = self._reuse_needs(match, nblocks)
        return AdmissionPlan(match.num_tokens, tuple(need), self._fits(need, taken))

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
    ) -> KVCache:
        """A new active cache holding the longest reusable prefix of the prompt (committed and history equal to
        the reused length; capacity too, or ``max(capacity, reused)`` when ``capacity`` is given).

        The prompt is ``tokens`` (hashed here, lazily up to the first miss) or ``block_keys`` (one chained hash
        per full block, computed elsewhere: the cache is then in key mode) or both (keys for the tokens' full
        blocks, skipping the hashing). ``max_reuse_tokens`` caps the reuse; a scheduler passes
        ``len(prompt) - 1`` so the last prompt token is computed. Raises OutOfPagesError (nothing changed) when
        the pages cannot be found even after eviction; :meth:`plan_admission` answers the same question first.
        """
        keys, tokens = self._check_prompt(tokens, block_keys)
        if max_reuse_tokens is not None:
            _check_count("max_reuse_tokens", max_reuse_tokens)
        if capacity is not None:
            _check_count("capacity", capacity)
        if priority_callback is not None and not callable(priority_callback):
            raise TypeError(f"priority_callback: expected a callable or None, got {type(priority_callback).__name__}")
        if cache_id is None:
            cache_id = next(self._ids)
            while cache_id in self._caches:
                cache_id = next(self._ids)
        elif cache_id in self._caches:
            raise ValueError(f"cache_id: {cache_id!r} is already in use by a live cache")
        # A new scope's root is registered only once the cache exists, so a failed call leaves no trace.
        root = self._tree.find_root(scope) or self._tree.make_root(scope)
        match = self._match_for(root, keys, tokens, reuse, max_reuse_tokens)
        cap = max(capacity or 0, match.num_tokens)
        cache = self.cache_class(self, cache_id, scope, root, tokens is None and keys is not None, priority_callback)
        if not self._adopt(cache, match, tokens, -(-cap // self.tokens_per_block)):
            self._flush_events()
            raise OutOfPagesError(
                f"create_cache: no GPU pages for {match.num_tokens} reused tokens and a capacity of {cap} even "
                f"after eviction (available per group: {[p.num_available for p in self._gpu]})"
            )
        cache._capacity = cap
        self._tree.roots.setdefault(root.key, root)
        cache.num_reused_blocks = len(match.blocks)
        cache.num_reused_tokens = match.num_tokens
        self._caches[cache_id] = cache
        self.stats.caches_created += 1
        self.stats.reused_tokens += match.num_tokens
        self._flush_events()
        return cache

    def _match_for(
        self,
        root: Block | None,
        keys: Sequence[int] | None,
        tokens: Sequence[int] | None,
        reuse: bool,
        limit: int | None,
    ) -> ReuseMatch:
        if root is None:
            return ReuseMatch(self._tree.make_root(None), (), None, 0, self.tokens_per_block)
        if reuse and (keys is not None or tokens is not None):
            return self._match(root, keys, tokens, limit)
        return ReuseMatch(root, (), None, 0, self.tokens_per_block)

    def _check_prompt(
        self, tokens: Sequence[int] | None, keys: Sequence[int] | None
    ) -> tuple[Sequence[int] | None, Sequence[int] | None]:
        if tokens is not None:
            _int_sequence("tokens", tokens)
        if keys is not None:
            _int_sequence("block_keys", keys)
            if tokens is not None and len(keys) != len(tokens) // self.tokens_per_block:
                raise ValueError(
                    f"block_keys: expected one key per full block of tokens ({len(tokens) // self.tokens_per_block}), "
                    f"got {len(keys)}"
                )
        return keys, tokens

    def _match(
        self, root: Block, keys: Sequence[int] | None, tokens: Sequence[int] | None, limit: int | None
    ) -> ReuseMatch:
        """Longest reusable prefix under ``root``; reads the tree only."""
        tpb = self.tokens_per_block
        if tokens is not None:
            n_avail = len(tokens)
        elif keys is not None:
            n_avail = len(keys) * tpb
        else:
            n_avail = 0
        if limit is not None and limit < n_avail:
            n_avail = limit
        max_full = n_avail // tpb
        blocks: list[Block] = []
        node = root
        if keys is not None:
            for i in range(max_full):
                child = node.children.get(keys[i])
                if child is None or child.num_tokens != tpb:
                    break
                blocks.append(child)
                node = child
        elif tokens is not None:
            h = root.key
            for i in range(max_full):
                h = hash((h, tuple(tokens[i * tpb : (i + 1) * tpb])))
                child = node.children.get(h)
                if child is None or child.num_tokens != tpb:
                    break
                blocks.append(child)
                node = child
        n = len(blocks)
        partial, ptoks = None, 0
        if tokens is not None and n_avail > n * tpb:
            # Tried before the cut: a usable partial tail (e.g. a recurrent snapshot saved where a sequence ended)
            # makes the full blocks before it usable whether or not a snapshot lies at their end.
            partial, ptoks = self._match_partial(blocks, node, tokens, n * tpb, n_avail)
        if partial is None and (self._swa or self._rec):
            while n and not self._usable(blocks, n, None, 0):
                n -= 1
        return ReuseMatch(root, tuple(blocks[:n]), partial, ptoks, tpb)

    def _usable(self, blocks: Sequence[Block], n: int, partial: Block | None, ptoks: int) -> bool:
        """Whether the first ``n`` full blocks (then ``ptoks`` tokens of ``partial``) can resume a request:
        every recurrent group has a snapshot exactly at the end, every sliding-window group its window."""
        tpb = self.tokens_per_block
        end = partial if partial is not None else (blocks[n - 1] if n else None)
        if end is None:
            return True
        for g in self._rec:
            if end.pages[g] is None or (partial is not None and ptoks != partial.num_tokens):
                return False
        total = n * tpb + ptoks
        for g in self._swa:
            lc = self.groups[g].life_cycle
            sinks = min(lc.sink_blocks(tpb), n)
            for b in range(sinks):
                if blocks[b].pages[g] is None:
                    return False
            for b in range(max(lc.first_needed_block(total, tpb), sinks), n):
                if blocks[b].pages[g] is None:
                    return False
            if partial is not None and partial.pages[g] is None:
                return False
        return True

    def _match_partial(
        self, blocks: list[Block], node: Block, tokens: Sequence[int], start: int, end: int
    ) -> tuple[Block | None, int]:
        """The child of ``node`` sharing the longest token prefix with ``tokens[start:end]`` (at most one block)."""
        rem = tuple(tokens[start : min(end, start + self.tokens_per_block)])
        first = rem[0]
        best, best_len = None, 0
        for child in node.children.values():
            ct = child.tokens
            if ct is None or ct[0] != first:
                continue
            n = min(len(ct), len(rem))
            i = 1
            while i < n and ct[i] == rem[i]:
                i += 1
            if i > best_len:
                best, best_len = child, i
        if best is None or not self._usable(blocks, len(blocks), best, best_len):
            return None, 0
        return best, best_len

    # --- page bookkeeping -------------------------------------------------------------------------------------------

    def _eligible(self, page: Page) -> bool:
        """An unlocked committed page is an eviction candidate: anywhere above the last tier, else if droppable."""
        return not page.pool.last or not (page.pool.full_attention and page.block.children)  # type: ignore[union-attr]

    def _lock(self, page: Page) -> None:
        if page.ref_count == 0:
            pool = page.pool
            pool.n_unlocked -= 1
            if page.policy_data is not None:
                pool.policy.discard(page)
        page.ref_count += 1

    def _unlock(self, page: Page) -> None:
        """Drop one reference to a committed page; at zero it becomes an eviction candidate."""
        page.ref_count -= 1
        if page.ref_count == 0:
            pool = page.pool
            pool.n_unlocked += 1
            page.last_used = self._clock
            if self._eligible(page):
                pool.policy.add(page)

    def _free_page(self, page: Page) -> None:
        """Return a locked page that belongs to no tree block (ref_count 1) to its free list."""
        if page.block is not None or page.ref_count != 1:
            raise AssertionError(f"_free_page: {page!r} is committed or shared")
        page.ref_count = 0
        page.pool.free.append(page)

    def _free_committed(self, page: Page) -> None:
        """Free an unlocked committed page (its block slot is cleared by the caller)."""
        pool = page.pool
        if page.ref_count:
            raise AssertionError(f"_free_committed: {page!r} is locked")
        pool.n_unlocked -= 1
        if page.policy_data is not None:
            pool.policy.discard(page)
        page.block = None
        pool.free.append(page)

    def _alloc_page(self, group: int) -> Page | None:
        """One GPU page of ``group`` (locked, ref_count 1, in no block), evicting if needed; None if impossible."""
        pool = self._gpu[group]
        if not pool.free and not self._evict_one(pool):
            return None
        page = pool.free.pop()
        page.ref_count = 1
        return page

    def _evict_one(self, pool: PagePool) -> bool:
        """Turn one unlocked page of ``pool`` into a free one: move it a tier down, else drop it."""
        victim = pool.policy.pop_victim()
        if victim is None:
            return False
        if not pool.last:
            below = self._pools[pool.tier + 1][pool.group]
            room = bool(below.free)
            if not room:
                # Pinned while the tier below makes room: dropping a block there may make this victim's block
                # a leaf again, and that cascade must not put the victim back into the policy.
                victim.ref_count += 1
                room = self._evict_one(below)
                victim.ref_count -= 1
            if room:
                self._move(victim, below.free.pop())
                return True
            if pool.full_attention and victim.block.children:  # type: ignore[union-attr]
                # No room below and the victim holds descendants up: drop a leaf instead (one always exists
                # among the unlocked pages, since a locked leaf would lock its whole path).
                pool.policy.add(victim)
                victim = pool.policy.pop_victim(lambda p: not p.block.children)  # type: ignore[union-attr]
                if victim is None:
                    return False
        self._drop(victim)
        return True

    def _move(self, src: Page, dst: Page) -> None:
        block = src.block
        assert block is not None
        g = src.pool.group
        block.pages[g] = dst
        dst.block = block
        dst.priority = src.priority
        dst.last_used = src.last_used
        self._copies.append(PageCopy(g, src.pool.tier, src.index, dst.pool.tier, dst.index))
        src.pool.n_unlocked -= 1
        src.block = None
        src.pool.free.append(src)
        dst.pool.n_unlocked += 1
        if self._eligible(dst):
            dst.pool.policy.add(dst)
        if dst.pool.tier > src.pool.tier:
            self.stats.offloaded_pages += 1
        else:
            self.stats.onboarded_pages += 1

    def _drop(self, page: Page) -> None:
        """Drop an unlocked page from the last tier it lives in; a full-attention page takes its block along."""
        block = page.block
        assert block is not None
        self.stats.dropped_pages += 1
        if page.pool.full_attention:
            self._remove_block(block)
            return
        block.pages[page.pool.group] = None
        self._free_committed(page)
        if not block.children and all(p is None for p in block.pages):
            self._remove_block(block)

    def _remove_block(self, block: Block) -> None:
        """Take a block (and then every ancestor left without pages or children) out of the tree."""
        while True:
            for g, p in enumerate(block.pages):
                if p is not None:
                    block.pages[g] = None
                    self._free_committed(p)
            parent = block.parent
            assert parent is not None
            del parent.children[block.key]
            self._tree.num_blocks -= 1
            self.stats.removed_blocks += 1
            if block.num_tokens == self.tokens_per_block:
                self._removed.append(block.key)
            if parent.parent is None or parent.children:
                return
            if any(p is not None for p in parent.pages):
                break
            block = parent
        for p in parent.pages:
            # The last child is gone: the parent's full-attention pages in their last tier may now be dropped.
            if p is not None and p.ref_count == 0 and p.policy_data is None and self._eligible(p):
                p.pool.policy.add(p)

    def _gain_child(self, parent: Block) -> None:
        """``parent`` (not a root) gets its first child: its last-tier full-attention pages stop being droppable."""
        for p in parent.pages:
            if p is not None and p.policy_data is not None and p.pool.last and p.pool.full_attention:
                p.pool.policy.discard(p)

    def _flush_events(self) -> None:
        if self._removed:
            removed, self._removed = tuple(self._removed), []
            if self._sink is not None:
                self._sink(BlockRemoved(removed))

    def evict(self, group: int, num_pages: int, tier: Tier = Tier.GPU) -> int:
        """Reclaim up to ``num_pages`` unlocked pages of ``group`` in ``tier`` (moved down or dropped) into the
        free list. Returns how many were reclaimed. Locked pages are never touched."""
        _check_count("num_pages", num_pages)
        pool = self.pool(group, tier)
        done = 0
        while done < num_pages and pool.n_unlocked and self._evict_one(pool):
            done += 1
        self._flush_events()
        return done

    # --- priorities ---------------------------------------------------------------------------------------------------

    def _priority(self, cache: KVCache, ordinal: int, group: int, end_tokens: int) -> int:
        swa = self.swa_priorities
        if swa is not None and group in self._swa:
            lc = self.groups[group].life_cycle
            tpb = self.tokens_per_block
            if ordinal < lc.sink_blocks(tpb) or ordinal >= lc.first_needed_block(end_tokens, tpb):
                return swa.endpoint
            return swa.interior
        cb = cache._priority_cb
        if cb is None:
            return self.default_priority
        return check_priority(cb(ordinal, group), f"priority_callback({ordinal}, {group})")

    def _constant_priority(self, cache: KVCache) -> bool:
        return cache._priority_cb is None and (self.swa_priorities is None or not self._swa)

    # --- cache operations -------------------------------------------------------------------------------------------

    def _stale_lo_at(self, num_tokens: int) -> list[int]:
        """First non-stale non-sink block per group for a cache at ``num_tokens`` committed tokens."""
        tpb = self.tokens_per_block
        out = [0] * self.num_groups
        for g in self._swa:
            lc = self.groups[g].life_cycle
            out[g] = max(lc.first_needed_block(num_tokens, tpb), lc.sink_blocks(tpb))
        return out

    def _reuse_needs(
        self, match: ReuseMatch, nblocks: int
    ) -> tuple[list[tuple[int, Sequence[int], list[Page]]], list[Page], list[int], list[int], list[int]]:
        """What adopting ``match`` (then growing to ``nblocks`` blocks) takes, without changing anything.

        Returns the per-group lock plan ``(group, ordinals, tree pages)``, the copy sources to pin, the GPU pages
        needed per group, the unlocked GPU pages per group the adoption would lock (no longer available), and
        the host pages per group to onboard.
        """
        tpb = self.tokens_per_block
        blocks = match.blocks
        n = len(blocks)
        total = match.num_tokens
        partial = match.partial
        plan: list[tuple[int, Sequence[int], list[Page]]] = []
        for g in self._full:
            plan.append((g, range(n), [b.pages[g] for b in blocks]))  # type: ignore[misc]
        for g in self._swa:
            lc = self.groups[g].life_cycle
            sinks = min(lc.sink_blocks(tpb), n)
            ords = [*range(sinks), *range(max(lc.first_needed_block(total, tpb), sinks), n)]
            plan.append((g, ords, [blocks[i].pages[g] for i in ords]))  # type: ignore[misc]
        # Sources of copies are locked while the copies are recorded, so no allocation can reuse them first.
        sources: list[Page] = []
        if partial is not None:
            sources.extend(partial.pages[g] for g in self._attn if partial.pages[g] is not None)  # type: ignore[misc]
        if total and self._rec:
            end = partial if partial is not None else blocks[-1]
            sources.extend(end.pages[g] for g in self._rec)  # type: ignore[misc]
        onboard = [0] * self.num_groups
        taken = [0] * self.num_groups
        for g, _, lst in plan:
            gpu_pool = self._gpu[g]
            nd = tk = 0
            for p in lst:
                if p.pool is not gpu_pool:
                    nd += 1
                elif p.ref_count == 0:
                    tk += 1
            onboard[g] = nd
            taken[g] = tk
        for p in sources:
            if p.pool.tier is Tier.GPU and p.ref_count == 0:
                taken[p.pool.group] += 1
        need = list(onboard)
        if partial is not None:
            for g in self._attn:
                need[g] += 1
        for g in self._rec:
            need[g] += 1
        width = n + (partial is not None)
        if nblocks > width:
            for g, x in enumerate(self._block_needs(width, nblocks, self._stale_lo_at(total))):
                need[g] += x
        return plan, sources, need, taken, onboard

    def _fits(self, need: Sequence[int], taken: Sequence[int]) -> bool:
        return all(not nd or nd <= pool.num_available - tk for nd, tk, pool in zip(need, taken, self._gpu))

    def _adopt(self, cache: KVCache, match: ReuseMatch, tokens: Sequence[int] | None, nblocks: int = 0) -> bool:
        """Lock the matched pages into ``cache``, take the GPU pages the reuse needs and grow to ``nblocks``
        blocks; False (nothing changed) when those pages cannot be found."""
        tpb = self.tokens_per_block
        blocks = match.blocks
        n = len(blocks)
        total = match.num_tokens
        partial = match.partial
        plan, sources, need, taken, onboard = self._reuse_needs(match, nblocks)
        if not self._fits(need, taken):
            return False

        width = n + (partial is not None)
        pages: list[list[Page | None]] = [[] for _ in range(self.num_groups)]
        for _, _, lst in plan:
            for p in lst:
                if p.ref_count == 0:
                    pool = p.pool
                    pool.n_unlocked -= 1
                    if p.policy_data is not None:
                        pool.policy.discard(p)
                p.ref_count += 1
        for p in sources:
            self._lock(p)
        for g, ords, lst in plan:
            if onboard[g]:
                gpu_pool = self._gpu[g]
                lst = [p if p.pool is gpu_pool else self._onboard(p) for p in lst]
            if g in self._full:
                row: list[Page | None] = lst  # type: ignore[assignment]
                if partial is not None:
                    row.append(None)
            else:
                row = [None] * width
                for i, p in zip(ords, lst):
                    row[i] = p
            pages[g] = row
        if partial is not None:
            for g in self._attn:
                src = partial.pages[g]
                dst = self._must_alloc(g)
                self._copies.append(PageCopy(g, src.pool.tier, src.index, Tier.GPU, dst.index, match.partial_tokens))  # type: ignore[union-attr]
                pages[g][n] = dst
        for g in self._rec:
            live = self._must_alloc(g)
            if total:
                src = (partial if partial is not None else blocks[-1]).pages[g]
                assert src is not None
                self._copies.append(PageCopy(g, src.pool.tier, src.index, Tier.GPU, live.index))
            cache._live[g] = live
        self._clock += 1
        for p in sources:
            self._unlock(p)

        cache._pages = pages
        cache._blocks = list(blocks)
        cache._nblocks = n + (partial is not None)
        cache._committed = cache._history = cache._capacity = total
        if partial is not None and tokens is not None:
            cache._partial = list(tokens[n * tpb : total])
        elif partial is not None:
            cache._partial = list(partial.tokens[: match.partial_tokens])  # type: ignore[index]
        else:
            cache._partial = []
        self._reset_stale(cache)
        self._note_changed(cache)
        if nblocks > cache._nblocks and not self._set_num_blocks(cache, nblocks):
            raise AssertionError("the availability check promised the capacity's pages")
        return True

    def _must_alloc(self, group: int) -> Page:
        page = self._alloc_page(group)
        if page is None:
            raise AssertionError(f"group {group}: the availability check promised a page")
        return page

    def _onboard(self, host_page: Page) -> Page:
        """Replace a locked host page of a tree block by a fresh GPU page holding a copy of it."""
        gpu = self._must_alloc(host_page.pool.group)
        block = host_page.block
        assert block is not None
        g = host_page.pool.group
        block.pages[g] = gpu
        gpu.block = block
        gpu.priority = host_page.priority
        gpu.ref_count = host_page.ref_count
        self._copies.append(PageCopy(g, host_page.pool.tier, host_page.index, Tier.GPU, gpu.index))
        host_page.ref_count = 0
        host_page.block = None
        host_page.pool.free.append(host_page)
        self.stats.onboarded_pages += 1
        return gpu

    def _reset_stale(self, cache: KVCache) -> None:
        """Recompute the sliding-window stale bookkeeping after the cache's pages were (re)built."""
        tpb = self.tokens_per_block
        nxt = self._never
        for g in self._swa:
            lc = self.groups[g].life_cycle
            cache._stale_lo[g] = max(lc.first_needed_block(cache._committed, tpb), lc.sink_blocks(tpb))
            nxt = min(nxt, self._next_stale_point(lc, cache._stale_lo[g]))
        cache._next_stale_at = nxt

    def _next_stale_point(self, lc: Any, stale_lo: int) -> int:
        """Committed length at which block ``stale_lo`` becomes stale: ``first_needed_block`` passes it."""
        return (stale_lo + 1) * self.tokens_per_block + lc.window - 1

    def _stale_priorities(self, cache: KVCache, committed: int) -> dict[tuple[int, int], int] | None:
        """Priorities of the sliding-window pages that committing up to ``committed`` makes stale, asked before
        anything changes so that a failing callback leaves the cache as it was (None: all the default)."""
        if self._constant_priority(cache):
            return None
        tpb = self.tokens_per_block
        out = {}
        for g in self._swa:
            hi = self.groups[g].life_cycle.first_needed_block(committed, tpb)
            for b in range(cache._stale_lo[g], hi):
                if cache._pages[g][b] is not None:
                    out[(g, b)] = self._priority(cache, b, g, committed)
        return out

    def _commit_in_block(self, cache: KVCache, tokens: Sequence[int] | None, committed: int) -> None:
        """A commit that completes no block but moves a sliding window past some pages."""
        prios = self._stale_priorities(cache, committed)
        if tokens is not None:
            cache._partial.extend(tokens)
        cache._committed = committed
        self._release_stale(cache, prios)

    def _release_stale(self, cache: KVCache, prios: dict[tuple[int, int], int] | None) -> None:
        """Give back sliding-window pages no later token reads (committed blocks go to the tree as candidates)."""
        tpb = self.tokens_per_block
        committed = cache._committed
        default = self.default_priority
        nxt = self._never
        self._clock += 1
        for g in self._swa:
            lc = self.groups[g].life_cycle
            lo = cache._stale_lo[g]
            hi = lc.first_needed_block(committed, tpb)
            lst = cache._pages[g]
            for b in range(lo, hi):
                p = lst[b]
                if p is not None:
                    self._release(cache, p, b, default if prios is None else prios[(g, b)])
                    lst[b] = None
                    self._note_changed(cache, g, b)
            cache._stale_lo[g] = max(lo, hi)
            nxt = min(nxt, self._next_stale_point(lc, max(lo, hi)))
        cache._next_stale_at = nxt

    def _release(self, cache: KVCache, page: Page, ordinal: int, priority: int) -> None:
        """Give one of the cache's pages back: free it if uncommitted, else unlock it with its new priority
        (a reused block's priority only rises; the cache that committed it sets it)."""
        if page.block is None:
            self._free_page(page)
            return
        if ordinal < cache.num_reused_blocks or ordinal in cache._shared:
            if priority > page.priority:
                page.priority = priority
        else:
            page.priority = priority
        self._unlock(page)

    def _pages_needed(self, cache: KVCache, nblocks: int) -> tuple[int, ...]:
        return tuple(self._block_needs(cache._nblocks, nblocks, cache._stale_lo))

    def _block_needs(self, old: int, new: int, stale_lo: Sequence[int]) -> list[int]:
        """GPU pages per group for growing from ``old`` to ``new`` blocks (stale sliding-window blocks take none)."""
        need = [0] * self.num_groups
        if new <= old:
            return need
        for g in self._full:
            need[g] = new - old
        tpb = self.tokens_per_block
        for g in self._swa:
            sinks = self.groups[g].life_cycle.sink_blocks(tpb)
            need[g] = max(0, new - max(old, stale_lo[g])) + max(0, min(new, sinks) - old)
        return need

    def _set_num_blocks(self, cache: KVCache, nblocks: int) -> bool:
        old = cache._nblocks
        if nblocks > old:
            need = self._pages_needed(cache, nblocks)
            if not self.can_allocate(need):
                return False
            tpb = self.tokens_per_block
            for g in self._attn:
                lst = cache._pages[g]
                if g in self._swa:
                    lc = self.groups[g].life_cycle
                    sinks = lc.sink_blocks(tpb)
                    lo = cache._stale_lo[g]
                    for b in range(old, nblocks):
                        lst.append(self._must_alloc(g) if b < sinks or b >= lo else None)
                else:
                    for _ in range(old, nblocks):
                        lst.append(self._must_alloc(g))
                self._note_changed(cache, g, old)
            self._flush_events()
        else:
            for g in self._attn:
                lst = cache._pages[g]
                for b in range(nblocks, old):
                    p = lst[b]
                    if p is not None:
                        self._free_page(p)
                del lst[nblocks:]
                self._note_changed(cache, g, nblocks)
        cache._nblocks = nblocks
        return True

    def _commit(self, cache: KVCache, tokens: Sequence[int] | None, n: int, keys: Sequence[int] | None) -> None:
        """Commit ``n`` tokens that complete at least one block (or come with keys)."""
        tpb = self.tokens_per_block
        start = cache._committed
        first = start // tpb
        n_full = (start + n) // tpb - first
        if keys is not None:
            _int_sequence("block_keys", keys)
            if len(keys) != n_full:
                raise ValueError(f"block_keys: this commit completes {n_full} blocks, got {len(keys)} keys")
        elif tokens is None:
            raise ValueError(f"block_keys: a key-mode commit completing {n_full} blocks needs their keys")
        end = start + n
        prios: list[list[int]] | None = None
        stale_prios = None
        if not self._constant_priority(cache):
            # Asked before any change, so a failing callback leaves the cache as it was.
            prios = [[self._priority(cache, first + i, g, end) for g in range(self.num_groups)] for i in range(n_full)]
            if end >= cache._next_stale_at:
                stale_prios = self._stale_priorities(cache, end)
        default = self.default_priority
        blocks = cache._blocks
        root = cache._root
        parent = blocks[-1] if blocks else root
        rec = self._rec
        partial = cache._partial
        fill = len(partial) if tokens is not None else 0
        if tokens is not None and keys is None:
            keys = self._chain_keys(parent.key, partial, tokens, n_full)
        assert keys is not None
        if n_full and parent is not root and not parent.children:
            self._gain_child(parent)
        # Blocks the tree already has (another request committed them): share them.
        i = 0
        while i < n_full:
            child = parent.children.get(keys[i])
            if child is None:
                break
            if child.num_tokens != tpb:
                # A partial block under the same key (only a hash collision can do that): the full one wins.
                self._remove_block(child)
                break
            ordinal = first + i
            cache._shared.add(ordinal)
            self._merge_into(cache, child, ordinal, default if prios is None else prios[i])
            if rec:
                self._attach_snapshots(cache, child, ordinal, default if prios is None else prios[i])
            blocks.append(child)
            parent = child
            i += 1
        # The rest are new. Each is the first child of a block created just before it, so no lookup can find
        # anything: this loop, the cost of inserting a long prompt, only creates blocks and hands them pages.
        first_new = i
        new_keys = list(keys[first_new:])
        new_parent_key = None if parent is root else parent.key
        attn_pages = [(g, cache._pages[g]) for g in self._attn]
        num_groups = self.num_groups
        for h in new_keys:
            ordinal = first + i
            child = Block(h, parent, ordinal, tpb, None, num_groups)
            parent.children[h] = child
            cpages = child.pages
            for g, lst in attn_pages:
                p = lst[ordinal]
                if p is not None:
                    cpages[g] = p
                    p.block = child
                    p.priority = default if prios is None else prios[i][g]
            if rec:
                self._attach_snapshots(cache, child, ordinal, default if prios is None else prios[i])
            blocks.append(child)
            parent = child
            i += 1
        if tokens is not None:
            # Only some new blocks keep their tokens (see the module docstring): copying every block's tuple
            # would double the cost of a long insert. Block j > 0 starts at j * tpb - fill in ``tokens``.
            base = len(blocks) - n_full
            if fill and first_new == 0:
                blocks[base].tokens = (*partial, *tokens[: tpb - fill])
            last = n_full - 1
            if last >= first_new and (last or not fill):
                blocks[base + last].tokens = tuple(tokens[last * tpb - fill : n_full * tpb - fill])
            if n_full:
                cache._partial = list(tokens[n_full * tpb - fill :])
            else:
                partial.extend(tokens)
        cache._committed = end
        self._tree.num_blocks += len(new_keys)
        self.stats.inserted_blocks += len(new_keys)
        self._flush_events()
        if new_keys and self._sink is not None:
            self._sink(BlockStored(tuple(new_keys), new_parent_key, tpb))
        if end >= cache._next_stale_at:
            self._release_stale(cache, stale_prios)

    def _chain_keys(self, parent_key: int, partial: Sequence[int], tokens: Sequence[int], n_full: int) -> list[int]:
        """Chained hashes of the ``n_full`` blocks that ``partial`` followed by ``tokens`` completes."""
        if not n_full:
            return []
        if not partial:
            return chain_hashes(parent_key, tokens, 0, n_full, self.tokens_per_block)
        pos = self.tokens_per_block - len(partial)
        h = hash((parent_key, (*partial, *tokens[:pos])))
        return [h, *chain_hashes(h, tokens, pos, n_full - 1, self.tokens_per_block)]

    def _merge_into(self, cache: KVCache, block: Block, ordinal: int, prios: Sequence[int] | int) -> None:
        """The tree already has the block this cache just completed: share the tree's GPU pages (freeing the
        cache's copies), or give the tree the cache's pages where it has none on the GPU."""
        for g in self._attn:
            mine = cache._pages[g][ordinal]
            if mine is None:
                continue
            prio = prios if isinstance(prios, int) else prios[g]
            theirs = block.pages[g]
            if theirs is not None and theirs.pool.tier is Tier.GPU:
                self._lock(theirs)
                if prio > theirs.priority:
                    theirs.priority = prio
                self._free_page(mine)
                cache._pages[g][ordinal] = theirs
                self._note_changed(cache, g, ordinal)
                continue
            if theirs is not None:
                block.pages[g] = None
                self._free_committed(theirs)
            block.pages[g] = mine
            mine.block = block
            mine.priority = prio

    def _attach_snapshots(self, cache: KVCache, block: Block, ordinal: int, prios: Sequence[int] | int) -> None:
        """Put the recurrent snapshots the subclass took at the end of ``block`` into the tree, unlocked."""
        snaps = self._snapshot_pages(cache, block, ordinal)
        if not snaps:
            return
        self._clock += 1
        for g, page in snaps.items():
            if page.block is not None or page.ref_count != 1 or g not in self._rec:
                raise AssertionError(f"_snapshot_pages: {page!r} for group {g} is not a fresh recurrent page")
            if block.pages[g] is not None:
                self._free_page(page)
                continue
            block.pages[g] = page
            page.block = block
            page.priority = prios if isinstance(prios, int) else prios[g]
            self._unlock(page)

    def _release_priorities(self, cache: KVCache) -> dict[tuple[int, int], int] | None:
        """The priority of every page the cache will give back (and of the partial tail's snapshots), asked
        before anything changes so that a failing callback leaves the cache as it was (None: the default)."""
        if self._constant_priority(cache):
            return None
        committed = cache._committed
        out = {}
        for g in self._attn:
            for b, p in enumerate(cache._pages[g]):
                if p is not None:
                    out[(g, b)] = self._priority(cache, b, g, committed)
        for g in self._rec:
            out[(g, committed // self.tokens_per_block)] = self._priority(
                cache, committed // self.tokens_per_block, g, committed
            )
        return out

    def _insert_partial(self, cache: KVCache, release_prios: dict[tuple[int, int], int] | None) -> None:
        """At the end of a cache's life (or suspension), its committed tokens past the last full block become a
        partial tree block, so a later prompt (or the resumed cache) can reuse them by copy."""
        tokens = cache._partial
        if not tokens or cache.key_mode or not cache._committing:
            return
        tpb = self.tokens_per_block
        ordinal = cache._committed // tpb
        parent = cache._blocks[-1] if cache._blocks else cache._root
        blk = tuple(tokens)
        key = hash((parent.key, blk))
        if key in parent.children:
            return
        default = self.default_priority
        given = release_prios or {}
        prios = [given.get((g, ordinal), default) for g in range(self.num_groups)]
        child = Block(key, parent, ordinal, len(blk), blk, self.num_groups)
        for g in self._attn:
            # An active cache holds a page for every full-attention block below its capacity, and the window
            # (which contains this block) of every sliding-window group.
            p = cache._pages[g][ordinal]
            if p is not None:
                child.pages[g] = p
                p.block = child
                p.priority = prios[g]
        if not parent.children and parent is not cache._root:
            self._gain_child(parent)
        parent.children[key] = child
        self._tree.num_blocks += 1
        if self._rec:
            self._attach_snapshots(cache, child, ordinal, prios)
            if all(p is None for p in child.pages):
                del parent.children[key]
                self._tree.num_blocks -= 1

    def _release_all(self, cache: KVCache, prios: dict[tuple[int, int], int] | None) -> None:
        """Give back every page the cache holds (committed ones to the tree as candidates, others freed)."""
        default = self.default_priority
        const = prios is None
        self._clock += 1
        for g in self._attn:
            lst = cache._pages[g]
            # Deepest first so that, at equal recency, policies see leaves before their ancestors.
            for b in range(len(lst) - 1, -1, -1):
                p = lst[b]
                if p is not None:
                    self._release(cache, p, b, default if const else prios.get((g, b), default))  # type: ignore[union-attr]
            cache._pages[g] = []
        for g in self._rec:
            live = cache._live[g]
            if live is not None:
                self._free_page(live)
                cache._live[g] = None
        cache._nblocks = 0
        self._note_changed(cache)

    def _suspend(self, cache: KVCache) -> None:
        prios = self._release_priorities(cache)
        self._on_suspend(cache)
        self._insert_partial(cache, prios)
        cache._keys = [b.key for b in cache._blocks]
        self._release_all(cache, prios)
        cache._blocks = []
        cache._history = cache._capacity = cache._committed
        cache._status = _SUSPENDED
        self._flush_events()

    def _resume(self, cache: KVCache) -> bool:
        tpb = self.tokens_per_block
        node = cache._root
        blocks: list[Block] = []
        for k in cache._keys:
            child = node.children.get(k)
            if child is None or child.num_tokens != tpb:
                return False
            blocks.append(child)
            node = child
        partial, ptoks = None, 0
        if cache._committed % tpb:
            if cache.key_mode or not cache._partial:
                return False
            partial = node.children.get(hash((node.key, tuple(cache._partial))))
            ptoks = len(cache._partial)
            if partial is None or partial.num_tokens != ptoks:
                return False
        if (self._swa or self._rec) and not self._usable(blocks, len(blocks), partial, ptoks):
            return False
        match = ReuseMatch(cache._root, tuple(blocks), partial, ptoks, tpb)
        partial_tokens = list(cache._partial)
        if not self._adopt(cache, match, None):
            self._flush_events()
            return False
        cache._partial = partial_tokens
        cache._keys = []
        cache._status = _ACTIVE
        self._flush_events()
        return True

    def _close(self, cache: KVCache) -> None:
        if cache._status is _ACTIVE:
            prios = self._release_priorities(cache)
            self._on_close(cache)
            self._insert_partial(cache, prios)
            self._release_all(cache, prios)
            cache._blocks = []
        cache._status = _CLOSED
        self._caches.pop(cache.id, None)
        for table in self._tables:
            table._forget(cache)
        self._flush_events()

    # --- hooks for subclasses ----------------------------------------------------------------------------------------

    def _snapshot_pages(self, cache: KVCache, block: Block, ordinal: int) -> dict[int, Page]:
        """Recurrent snapshots to store at the end of ``block`` (full or partial) as ``cache`` inserts it.

        Return ``{group: page}`` with fresh pages from :meth:`_alloc_page` whose data copy the subclass has
        arranged; the manager attaches them to the block and unlocks them. The base manager takes none.
        """
        return {}

    def _on_suspend(self, cache: KVCache) -> None:
        """Called before a cache's pages are released by :meth:`KVCache.suspend`."""

    def _on_close(self, cache: KVCache) -> None:
        """Called before an active cache's pages are released by :meth:`KVCache.close`."""

    def _on_stop_committing(self, cache: KVCache) -> None:
        """Called once when a cache stops committing (before the flag changes)."""

    def _extra_page_refs(self) -> Iterable[Page]:
        """Pages a subclass holds locked outside every cache's page lists (one entry per reference)."""
        return ()

    # --- device page-table listeners ---------------------------------------------------------------------------------

    def _note_changed(self, cache: KVCache, group: int | None = None, lo: int = 0) -> None:
        for table in self._tables:
            table._mark(cache, group, lo)

    # --- verification ----------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify every structural invariant; raises AssertionError naming the first broken one."""
        tpb = self.tokens_per_block
        expected_refs: dict[int, int] = {}
        pages_by_id: dict[int, Page] = {}

        def ref(p: Page) -> None:
            expected_refs[id(p)] = expected_refs.get(id(p), 0) + 1
            pages_by_id[id(p)] = p

        for cache in self._caches.values():
            assert cache._status is not _CLOSED, f"{cache!r} closed but registered"
            if cache._status is _ACTIVE:
                assert cache._committed <= cache._history <= cache._capacity, f"{cache!r} lengths out of order"
                assert cache._nblocks == -(-cache._capacity // tpb), f"{cache!r} holds {cache._nblocks} blocks"
                assert len(cache._blocks) == cache._committed // tpb, f"{cache!r} has {len(cache._blocks)} tree blocks"
                if not cache.key_mode and cache._committing:
                    assert len(cache._partial) == cache._committed % tpb, f"{cache!r} partial tokens"
                for g in self._attn:
                    lst = cache._pages[g]
                    assert len(lst) == cache._nblocks, f"{cache!r} group {g}: {len(lst)} pages"
                    for b, p in enumerate(lst):
                        if p is None:
                            assert g in self._swa, f"{cache!r} group {g} block {b} has no page"
                            continue
                        assert p.pool.tier is Tier.GPU and p.pool.group == g, f"{cache!r} holds {p!r}"
                        if b < len(cache._blocks):
                            assert cache._blocks[b].pages[g] is p, f"{cache!r} block {b} page differs from tree"
                        ref(p)
                for g in self._rec:
                    live = cache._live[g]
                    assert live is not None and live.block is None, f"{cache!r} group {g} live page {live!r}"
                    ref(live)
            else:
                assert all(not lst for lst in cache._pages), f"suspended {cache!r} holds pages"
                assert all(p is None for p in cache._live), f"suspended {cache!r} holds a live page"
        for p in self._extra_page_refs():
            ref(p)

        for tier_pools in self._pools:
            for pool in tier_pools:
                free_ids = {id(p) for p in pool.free}
                assert len(free_ids) == len(pool.free), f"{pool.tier.name} g{pool.group}: a page is free twice"
                n_unlocked = 0
                in_policy = 0
                for p in pool.pages:
                    want = expected_refs.get(id(p), 0)
                    assert p.ref_count == want, f"{p!r}: ref_count {p.ref_count}, referenced {want} times"
                    if id(p) in free_ids:
                        assert p.ref_count == 0 and p.block is None and p.policy_data is None, f"free {p!r} in use"
                        continue
                    if p.block is None:
                        assert p.ref_count > 0, f"{p!r} leaked: neither free, referenced nor in the tree"
                        continue
                    assert p.block.pages[pool.group] is p, f"{p!r} not in its block"
                    if p.ref_count == 0:
                        n_unlocked += 1
                        eligible = self._eligible(p)
                        assert (p in pool.policy) == eligible, f"{p!r} policy membership {p in pool.policy}"
                        in_policy += eligible
                    else:
                        assert p not in pool.policy, f"locked {p!r} is an eviction candidate"
                assert n_unlocked == pool.n_unlocked, f"{pool.tier.name} g{pool.group}: n_unlocked {pool.n_unlocked}"
                assert len(pool.policy) == in_policy, f"{pool.tier.name} g{pool.group}: policy size {len(pool.policy)}"

        count_blocks = 0
        for block in self._tree.blocks():
            count_blocks += 1
            parent = block.parent
            assert parent is not None and parent.children.get(block.key) is block, f"{block!r} detached"
            assert block.depth == parent.depth + 1, f"{block!r} depth"
            assert 0 < block.num_tokens <= tpb, f"{block!r} size"
            if block.num_tokens < tpb:
                assert not block.children, f"partial {block!r} has children"
            if block.tokens is not None:
                assert len(block.tokens) == block.num_tokens, f"{block!r} tokens"
            for g in self._full:
                assert block.pages[g] is not None, f"{block!r} lost its full-attention page"
            if not block.children:
                assert any(p is not None for p in block.pages), f"empty leaf {block!r}"
            for g, p in enumerate(block.pages):
                if p is not None:
                    assert p.block is block and p.pool.group == g, f"{block!r} group {g} holds {p!r}"
        assert count_blocks == self._tree.num_blocks, f"tree counts {self._tree.num_blocks}, found {count_blocks}"

    def state_snapshot(self) -> tuple:
        """Everything observable about pools, policies, tree and caches, as a comparable value (tests use it to
        show that read-only calls change nothing)."""

        def page_state(p: Page) -> tuple:
            return (p.index, p.ref_count, None if p.block is None else p.block.key, p.priority, p.last_used)

        def policy_state(pol: Any) -> tuple:
            ordered = getattr(pol, "ordered", None)
            heap = getattr(pol, "_heap", None)
            return (
                len(pol),
                None if ordered is None else tuple(p.index for p in ordered()),
                None if heap is None else len(heap),
            )

        pools = tuple(
            (
                pool.n_unlocked,
                tuple(p.index for p in pool.free),
                tuple(map(page_state, pool.pages)),
                policy_state(pool.policy),
            )
            for tier_pools in self._pools
            for pool in tier_pools
        )
        tree = tuple(
            sorted(
                (
                    b.depth,
                    b.key,
                    b.num_tokens,
                    b.tokens,
                    tuple(None if p is None else (p.pool.tier, p.index) for p in b.pages),
                    tuple(sorted(b.children)),
                )
                for b in self._tree.blocks()
            )
        )
        caches = tuple(
            (
                repr(c.id),
                c._status.value,
                c._committed,
                c._history,
                c._capacity,
                c._committing,
                tuple(tuple(-1 if p is None else p.index for p in lst) for lst in c._pages),
                tuple(-1 if p is None else p.index for p in c._live),
                tuple(c._partial),
                tuple(b.key for b in c._blocks),
                tuple(c._keys),
                tuple(c._stale_lo),
                c._next_stale_at,
                tuple(sorted(c._shared)),
                c._nblocks,
            )
            for c in self._caches.values()
        )
        return (
            pools,
            tree,
            tuple(sorted(self._tree.roots)),
            caches,
            self._clock,
            len(self._copies),
            tuple(self._removed),
            self._tree.num_blocks,
        )
