"""The paged KV cache manager: prefix matching, admission and the per-request caches (:class:`KVCache`).

Per request: ``keys = mgr.prompt_keys(prompt, scope)`` once; ``mgr.plan_admission(...)`` (read-only), then
``mgr.create_cache(prompt, block_keys=keys, capacity=chunk_end, max_reuse_tokens=len(prompt) - 1)``; each step
``cache.resize(...)``, the forward pass writes into ``cache.page_indices(group)``, ``cache.commit(tokens)``; at the
end ``cache.close()`` (committed blocks stay in the tree, evictable).

**Contract**: ``probe_reuse`` and ``plan_admission`` change nothing (no LRU touch, no reference, no root) and are
exact: ``create_cache`` with the same arguments succeeds now iff ``plan_admission(...).fits``, else it raises
:class:`~kvforge.errors.OutOfPagesError` changing nothing. Bad argument types or values raise ``TypeError`` /
``ValueError`` before any state changes. Device memory is never touched: tier moves, partial-block copies and
recurrent restores are :class:`PageCopy` items the runtime executes, in order, before the next forward step
(:meth:`KVCacheManager.take_pending_copies`). Full blocks are reused on their 128-bit block key alone (the
manager's ``hasher``); ``cache_salt`` isolates a tenant. Not thread-safe. States, copies, partial-block reuse,
layout, extension points and host cost: ``docs/kvcache.md``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import count
from typing import Protocol

from kvforge.errors import OutOfPagesError
from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.cache import KVCache
from kvforge.kvcache.config import KVCacheConfig, LayerOwner, PoolGroupSpec, Tier
from kvforge.kvcache.events import EventSink
from kvforge.kvcache.eviction import DEFAULT_PRIORITY, EvictionPolicyFactory, PrioritizedLRU, check_priority
from kvforge.kvcache.hashing import BlockKeyHasher, check_block_keys, check_tokens, default_hasher
from kvforge.kvcache.invariants import block_pool_state, check_block_pool
from kvforge.kvcache.matching import PrefixMatcher
from kvforge.kvcache.pools import Block, Page, PagePool
from kvforge.kvcache.radix import RadixTree
from kvforge.kvcache.records import (
    AdmissionPlan,
    CacheStatus,
    ManagerStats,
    PageCopy,
    PriorityCallback,
    ReuseMatch,
    SwaPriorities,
    check_count,
    int_sequence,
)

__all__ = [
    "AdmissionPlan",
    "CacheListener",
    "CacheStatus",
    "KVCache",
    "KVCacheManager",
    "ManagerStats",
    "PageCopy",
    "PriorityCallback",
    "ReuseMatch",
    "SwaPriorities",
]

# Kept for code that imported the private helpers from here.
_check_count = check_count
_int_sequence = int_sequence


class CacheListener(Protocol):
    """Follows the GPU pages of a manager's caches (:meth:`KVCacheManager.add_listener`).

    ``cache_changed(cache, group, first_block)``: the cache's pages of ``group`` (every group when None) changed
    from block ``first_block`` on. ``cache_closed(cache)``: the cache is gone. Both are called synchronously,
    inside the operation that caused them; a listener must not call back into the manager.
    """

    def cache_changed(self, cache: KVCache, group: int | None, first_block: int) -> None: ...

    def cache_closed(self, cache: KVCache) -> None: ...


class KVCacheManager:
    """Prefix matching, admission and the per-request caches, over a :class:`BlockPool`.

    ``event_sink`` receives :class:`~kvforge.kvcache.events.BlockStored` when blocks enter the tree and
    :class:`~kvforge.kvcache.events.BlockRemoved` when they leave it (dropped from the last tier).
    ``eviction_policy`` is a factory ``(group_spec, tier) -> EvictionPolicy`` (default
    :class:`~kvforge.kvcache.eviction.PrioritizedLRU`); ``default_priority`` applies where a cache has no
    callback; ``swa_priorities`` (optional) decides sliding-window pages by position; ``hasher`` computes block
    keys (default: :func:`~kvforge.kvcache.hashing.default_hasher`; a router and its servers share one salt).
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
        hasher: BlockKeyHasher | None = None,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        if event_sink is not None and not callable(event_sink):
            raise TypeError(f"event_sink: expected a callable or None, got {type(event_sink).__name__}")
        if eviction_policy is not None and not callable(eviction_policy):
            raise TypeError(f"eviction_policy: expected a factory callable, got {type(eviction_policy).__name__}")
        if swa_priorities is not None and not isinstance(swa_priorities, SwaPriorities):
            raise TypeError(f"swa_priorities: expected SwaPriorities or None, got {type(swa_priorities).__name__}")
        if hasher is not None and not isinstance(hasher, BlockKeyHasher):
            raise TypeError(f"hasher: expected a BlockKeyHasher or None, got {type(hasher).__name__}")
        self.hasher = default_hasher() if hasher is None else hasher
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.groups: tuple[PoolGroupSpec, ...] = config.groups
        self.num_groups = len(self.groups)
        self.default_priority = check_priority(default_priority, "default_priority")
        self.swa_priorities = swa_priorities
        self.stats = ManagerStats()
        self.block_pool = BlockPool(
            config, eviction_policy or PrioritizedLRU, event_sink=event_sink, stats=self.stats, hasher=self.hasher
        )
        self.matcher = PrefixMatcher(self.block_pool)
        # Group ids by life cycle (group-id order), shared with the matcher.
        self.full_groups = self.matcher.full_groups
        self.sliding_groups = self.matcher.sliding_groups
        self.recurrent_groups = self.matcher.recurrent_groups
        self.attention_groups = self.matcher.attention_groups
        self._caches: dict[Hashable, KVCache] = {}
        self._ids = count()
        self._listeners: list[CacheListener] = []

    # --- introspection -----------------------------------------------------------------------------------------

    def pool(self, group: int, tier: Tier = Tier.GPU) -> PagePool:
        """The pages of one pool group in one tier."""
        return self.block_pool.pool(group, tier)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self.block_pool.tiers

    @property
    def caches(self) -> tuple[KVCache, ...]:
        """Every cache not closed yet (active or suspended)."""
        return tuple(self._caches.values())

    @property
    def num_tree_blocks(self) -> int:
        return self.block_pool.tree.num_blocks

    @property
    def tree(self) -> RadixTree:
        return self.block_pool.tree

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
        return self.block_pool.pool(group).num_available

    def can_allocate(self, pages_per_group: Sequence[int]) -> bool:
        """Whether that many GPU pages per group (group-id order) can be obtained now (read-only)."""
        return self.block_pool.can_allocate(pages_per_group)

    def take_pending_copies(self) -> list[PageCopy]:
        """The copies recorded since the last call, in the order the runtime must execute them."""
        return self.block_pool.take_pending_copies()

    def evict(self, group: int, num_pages: int, tier: Tier = Tier.GPU) -> int:
        """Reclaim up to ``num_pages`` unlocked pages of ``group`` in ``tier`` (moved down or dropped) into the
        free list. Returns how many were reclaimed. Locked pages are never touched."""
        return self.block_pool.evict(group, num_pages, tier)

    # --- listeners ---------------------------------------------------------------------------------------------

    def add_listener(self, listener: CacheListener) -> None:
        """Have ``listener`` told of every change to a cache's GPU pages and of every cache that closes."""
        if not callable(getattr(listener, "cache_changed", None)) or not callable(
            getattr(listener, "cache_closed", None)
        ):
            raise TypeError(
                f"listener: expected an object with cache_changed and cache_closed, got {type(listener).__name__}"
            )
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: CacheListener) -> None:
        """Stop telling ``listener``; a no-op if it is not registered."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify_changed(self, cache: KVCache, group: int | None, lo: int) -> None:
        """A cache's pages of ``group`` (None: every group) changed from block ``lo`` on."""
        for listener in self._listeners:
            listener.cache_changed(cache, group, lo)

    def _forget(self, cache: KVCache) -> None:
        """A cache closed: unregister it and tell the listeners."""
        self._caches.pop(cache.id, None)
        for listener in self._listeners:
            listener.cache_closed(cache)

    # --- reuse ---------------------------------------------------------------------------------------------------

    def prompt_keys(
        self, tokens: Sequence[int], scope: Hashable | None = None, cache_salt: str | bytes | None = None
    ) -> list[int]:
        """The block keys of the prompt's full blocks under ``scope`` and ``cache_salt``: compute them once per
        request and pass them to :meth:`probe_reuse`, :meth:`plan_admission`, :meth:`create_cache` and commits."""
        return self.hasher.block_keys(tokens, self.tokens_per_block, scope, cache_salt=cache_salt)

    def probe_reuse(
        self,
        tokens: Sequence[int] | None = None,
        scope: Hashable | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        max_reuse_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> int:
        """Tokens a cache created now for this prompt (same arguments) would reuse. Read-only: no LRU touch, no
        ref count, no allocation (not even the scope's root)."""
        keys, tokens = self._check_prompt(tokens, block_keys)
        if max_reuse_tokens is not None:
            check_count("max_reuse_tokens", max_reuse_tokens)
        root = self.block_pool.tree.find_root(scope, cache_salt)
        if root is None:
            return 0
        keys = self._keys_for(root, keys, tokens)
        return self.matcher.match(root, keys, tokens, max_reuse_tokens).num_tokens

    def plan_admission(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        scope: Hashable | None = None,
        capacity: int | None = None,
        reuse: bool = True,
        max_reuse_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> AdmissionPlan:
        """Whether :meth:`create_cache` with the same arguments would succeed now, and what it would take.

        Read-only, like :meth:`probe_reuse`. ``capacity`` is the tokens the new cache must hold (at least the
        reused ones), e.g. the end of a scheduler's first chunk. The page counts are exact: they include
        onboarding reused blocks from the host tier, partial-block copies and recurrent live states, and discount
        the unlocked pages the reuse itself would lock.
        """
        keys, tokens = self._check_prompt(tokens, block_keys)
        if max_reuse_tokens is not None:
            check_count("max_reuse_tokens", max_reuse_tokens)
        if capacity is not None:
            check_count("capacity", capacity)
        root = self.block_pool.tree.find_root(scope, cache_salt)
        if root is not None and reuse:
            keys = self._keys_for(root, keys, tokens)
        match = self._match_for(root, keys, tokens, reuse, max_reuse_tokens)
        nblocks = -(-max(capacity or 0, match.num_tokens) // self.tokens_per_block)
        _, _, need, taken, _ = self.matcher.reuse_needs(match, nblocks)
        return AdmissionPlan(match.num_tokens, tuple(need), self.block_pool.fits(need, taken))

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
        cache_salt: str | bytes | None = None,
    ) -> KVCache:
        """A new active cache holding the longest reusable prefix of the prompt (committed and history equal to
        the reused length; capacity too, or ``max(capacity, reused)`` when ``capacity`` is given).

        The prompt is ``tokens`` (keyed here when ``block_keys`` is not given) or ``block_keys`` (one key per
        full block, e.g. a trace's: the cache is then in key mode) or both (the keys of the tokens' full blocks,
        from :meth:`prompt_keys`). ``max_reuse_tokens`` caps the reuse; a scheduler passes ``len(prompt) - 1``
        so the last prompt token is computed. ``cache_salt`` isolates a tenant. Raises OutOfPagesError (nothing
        changed) when the pages cannot be found even after eviction; :meth:`plan_admission` answers first.
        """
        if tokens is None and block_keys is not None:  # key mode: _check_prompt inlined
            keys: Sequence[int] | None = check_block_keys(block_keys)
        else:
            keys, tokens = self._check_prompt(tokens, block_keys)
        key_mode = tokens is None and keys is not None
        if max_reuse_tokens is not None:
            check_count("max_reuse_tokens", max_reuse_tokens)
        if capacity is not None:
            check_count("capacity", capacity)
        if priority_callback is not None and not callable(priority_callback):
            raise TypeError(f"priority_callback: expected a callable or None, got {type(priority_callback).__name__}")
        if cache_id is None:
            cache_id = next(self._ids)
            while cache_id in self._caches:
                cache_id = next(self._ids)
        elif cache_id in self._caches:
            raise ValueError(f"cache_id: {cache_id!r} is already in use by a live cache")
        bp = self.block_pool
        tree = bp.tree
        # A new scope's root is registered only once the cache exists, so a failed call leaves no trace.
        root = tree.find_root(scope, cache_salt) or tree.make_root(scope, cache_salt)
        if reuse and keys is None and tokens is not None:  # _keys_for inlined
            keys = self.hasher.block_keys(tokens, self.tokens_per_block, parent=root.key)
        if reuse and keys is not None:  # _match_for inlined (the common call)
            match = self.matcher.match(root, keys, tokens, max_reuse_tokens)
        else:
            match = self._match_for(root, keys, tokens, reuse, max_reuse_tokens)
        reused = len(match.blocks) * self.tokens_per_block + match.partial_tokens  # match.num_tokens
        cap = reused if capacity is None or capacity < reused else capacity
        cache = self.cache_class(self, cache_id, scope, root, key_mode, priority_callback)
        if not cache._admit(match, tokens, -(-cap // self.tokens_per_block), cap, keys):  # type: ignore[arg-type]
            bp.flush_events()
            raise OutOfPagesError(
                f"create_cache: no GPU pages for {reused} reused tokens and a capacity of {cap} even "
                f"after eviction (available per group: {[p.num_available for p in bp.gpu]})"
            )
        tree.roots.setdefault(root.key, root)
        self._caches[cache_id] = cache
        self.stats.caches_created += 1
        self.stats.reused_tokens += reused
        bp.flush_events()
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
            return ReuseMatch(self.block_pool.tree.make_root(None), (), None, 0, self.tokens_per_block)
        if reuse and (keys is not None or tokens is not None):
            return self.matcher.match(root, keys, tokens, limit)
        return ReuseMatch(root, (), None, 0, self.tokens_per_block)

    def _keys_for(self, root: Block, keys: Sequence[int] | None, tokens: Sequence[int] | None) -> Sequence[int] | None:
        """The prompt's keys: as given, or computed from its tokens under ``root`` (the one key path)."""
        if keys is None and tokens is not None:
            return self.hasher.block_keys(tokens, self.tokens_per_block, parent=root.key)
        return keys

    def _check_prompt(
        self, tokens: Sequence[int] | None, keys: Sequence[int] | None
    ) -> tuple[Sequence[int] | None, Sequence[int] | None]:
        """Validated keys and tokens (token ids in range, keys 128-bit ints; numpy tokens become a list)."""
        if tokens is not None:
            tokens = check_tokens(tokens, vocab_size=self.hasher.vocab_size)
        if keys is not None:
            keys = check_block_keys(keys)
            if tokens is not None and len(keys) != len(tokens) // self.tokens_per_block:
                raise ValueError(
                    f"block_keys: expected one key per full block of tokens ({len(tokens) // self.tokens_per_block}), "
                    f"got {len(keys)}"
                )
        return keys, tokens

    # --- hooks for subclasses ----------------------------------------------------------------------------------------

    def _extra_page_refs(self) -> Iterable[Page]:
        """Pages a subclass holds locked outside every cache's page lists (one entry per reference)."""
        return ()

    # --- verification ----------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify every structural invariant; raises AssertionError naming the first broken one."""
        refs: list[Page] = []
        for cache in self._caches.values():
            refs.extend(cache._held_pages())
        refs.extend(self._extra_page_refs())
        check_block_pool(self.block_pool, refs, self.full_groups)

    def state_snapshot(self) -> tuple:
        """Everything observable about pools, policies, tree and caches, as a comparable value (tests use it to
        show that read-only calls change nothing)."""
        return block_pool_state(self.block_pool, tuple(c._state() for c in self._caches.values()))
