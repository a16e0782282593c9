"""Paged KV cache management: pool groups per life cycle, radix-tree prefix reuse, prioritised eviction.

Pure Python; torch and the kernels appear only at the device page-table seam (:mod:`kvforge.kvcache.page_table`),
which is not imported here.

Main entry points: :class:`KVCacheConfig` (layers, tiers, pool ratios), :class:`KVCacheManager` (matching and
admission over a :class:`~kvforge.kvcache.block_pool.BlockPool` of pages, tree, eviction and events) and its
per-request :class:`KVCache`; :mod:`~kvforge.kvcache.sizing` (memory budget),
:mod:`~kvforge.kvcache.draft` (shared draft layers), :mod:`~kvforge.kvcache.hooks` (model-declared
``RuntimeHooks``), :mod:`~kvforge.kvcache.eviction` (pluggable policies).
"""

from kvforge.kvcache.config import (
    FULL_ATTENTION,
    RECURRENT_STATE,
    KVCacheConfig,
    LayerOwner,
    LayerSpec,
    LifeCycle,
    LifeCycleKind,
    PoolGroupSpec,
    Tier,
    TierConfig,
)
from kvforge.kvcache.eviction import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN, EvictionPolicy, PrioritizedLRU
from kvforge.kvcache.hooks import HybridCachePolicy, RuntimeHooks, resolve_kv_cache_manager_cls, runtime_hooks_of
from kvforge.kvcache.hybrid import HybridCacheManager, HybridCounters, HybridKVCache, StateIndexUpload, UploadPath
from kvforge.kvcache.manager import (
    AdmissionPlan,
    CacheStatus,
    KVCache,
    KVCacheManager,
    PageCopy,
    PriorityCallback,
    ReuseMatch,
    SwaPriorities,
)
from kvforge.kvcache.pools import Page, PageState
from kvforge.kvcache.snapshot_policy import KIMI_K3_LIKE, CostAwareSnapshotPolicy, ModelCostSpec, cost_aware_eviction

__all__ = [
    "DEFAULT_PRIORITY",
    "FULL_ATTENTION",
    "KIMI_K3_LIKE",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RECURRENT_STATE",
    "AdmissionPlan",
    "CacheStatus",
    "CostAwareSnapshotPolicy",
    "EvictionPolicy",
    "HybridCacheManager",
    "HybridCachePolicy",
    "HybridCounters",
    "HybridKVCache",
    "KVCache",
    "KVCacheConfig",
    "KVCacheManager",
    "LayerOwner",
    "LayerSpec",
    "LifeCycle",
    "LifeCycleKind",
    "ModelCostSpec",
    "Page",
    "PageCopy",
    "PageState",
    "PoolGroupSpec",
    "PrioritizedLRU",
    "PriorityCallback",
    "ReuseMatch",
    "RuntimeHooks",
    "StateIndexUpload",
    "SwaPriorities",
    "Tier",
    "TierConfig",
    "UploadPath",
    "cost_aware_eviction",
    "resolve_kv_cache_manager_cls",
    "runtime_hooks_of",
]
