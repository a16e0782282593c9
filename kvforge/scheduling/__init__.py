"""kvforge.scheduling: which requests run each step and how many tokens each computes (pure Python).

:class:`Scheduler` (one server, over a KV cache manager) with its step API ``schedule()`` ->
:class:`ScheduledBatch` -> ``on_step_done(batch)``; the :class:`Request` model whose snapshot marks the hybrid
manager sets; :func:`snapshot_chunk_end` (snapshot-aware chunk ends); :class:`PrefixWaitPlanner` (in-flight
prefix sharing); :class:`AttentionDPRouter` (attention-DP rank placement with a pluggable KV-balanced planner).
"""

from kvforge.scheduling.adp_router import (
    AdmissionCandidate,
    AttentionDPRouter,
    DefaultKvBalancedPlanner,
    KvBalancedAdmissionPlanner,
    RankState,
    RoutingRound,
)
from kvforge.scheduling.chunking import passed_snapshot_point, snapshot_chunk_end
from kvforge.scheduling.prefix_wait import PrefixWaitPlanner, PrefixWaitStats
from kvforge.scheduling.request import Request, RequestState
from kvforge.scheduling.scheduler import (
    ENV_DEMOTE_MAX_ITERS,
    ENV_DEMOTE_UNCACHED_TOKENS,
    ScheduleAction,
    ScheduledBatch,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SchedulerStats,
    resolve_demotion,
)
from kvforge.scheduling.seams import ContextMarker, PrefixWaitCounter, SnapshotSlotCache

__all__ = [
    "ENV_DEMOTE_MAX_ITERS",
    "ENV_DEMOTE_UNCACHED_TOKENS",
    "AdmissionCandidate",
    "AttentionDPRouter",
    "ContextMarker",
    "DefaultKvBalancedPlanner",
    "KvBalancedAdmissionPlanner",
    "PrefixWaitCounter",
    "PrefixWaitPlanner",
    "PrefixWaitStats",
    "RankState",
    "Request",
    "RequestState",
    "RoutingRound",
    "ScheduleAction",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStateError",
    "SchedulerStats",
    "SnapshotSlotCache",
    "passed_snapshot_point",
    "resolve_demotion",
    "snapshot_chunk_end",
]
