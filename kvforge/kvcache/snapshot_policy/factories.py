"""Eviction-policy factories for a hybrid manager's pools (pass them as ``eviction_policy=``).

:func:`cost_aware_eviction` builds, per pool, a cost-aware snapshot policy for recurrent pools
(``aging="greedy-dual"``: :class:`~kvforge.kvcache.snapshot_policy.CostAwareSnapshotPolicy`; ``"hit-density"``:
:class:`~kvforge.kvcache.snapshot_policy.HitDensitySnapshotPolicy`) valuing a snapshot by the prefill FLOPs per
byte its prefix saves under a :class:`~kvforge.kvcache.snapshot_policy.ModelCostSpec`, and ``attention_policy``
(default prioritised LRU; with hit-density, :class:`~kvforge.kvcache.snapshot_policy.SnapshotAwareLRU`) for the
others. :func:`snapshot_aware_eviction` pairs any heap-based snapshot policy with ``SnapshotAwareLRU``. Bad
arguments raise ``TypeError`` / ``ValueError`` when the factory is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvforge.kvcache.config import LifeCycleKind
from kvforge.kvcache.eviction import EvictionPolicy, EvictionPolicyFactory, PrioritizedLRU
from kvforge.kvcache.snapshot_policy.attention import SnapshotAwareLRU
from kvforge.kvcache.snapshot_policy.cost import ModelCostSpec
from kvforge.kvcache.snapshot_policy.greedy_dual import CostAwareSnapshotPolicy
from kvforge.kvcache.snapshot_policy.hit_density import HitDensitySnapshotPolicy

if TYPE_CHECKING:
    from kvforge.kvcache.config import PoolGroupSpec, Tier
    from kvforge.kvcache.pools import Page

__all__ = ["AGING_MODES", "cost_aware_eviction", "snapshot_aware_eviction"]

AGING_MODES = ("greedy-dual", "hit-density")


def cost_aware_eviction(
    model: ModelCostSpec,
    tokens_per_block: int,
    *,
    aging: str = "greedy-dual",
    cost_exponent: float = 1.0,
    frequency: bool = True,
    marginal: bool = True,
    supersede: bool = True,
    max_walk: int = 256,
    attention_policy: EvictionPolicyFactory | None = None,
) -> EvictionPolicyFactory:
    """An ``eviction_policy`` factory: a cost-aware policy for recurrent pools, whose value of a snapshot is the
    prefix's prefill FLOPs per byte of one page of that pool, to the power ``cost_exponent``, taken over the
    nearest snapshot below when ``marginal``; and ``attention_policy`` (default prioritised LRU) for every other
    pool. ``max_walk`` bounds the walks up the tree.

    ``aging`` says how that value is weighed against time:

    * ``"greedy-dual"`` (:class:`CostAwareSnapshotPolicy`): GreedyDual aging; ``frequency`` multiplies the value
      by the snapshot's use count, ``supersede`` hands a replaced snapshot's count to its successor.
    * ``"hit-density"`` (:class:`HitDensitySnapshotPolicy`): the value times the expected reuses per slot-time,
      learned online per class and age; ``frequency`` makes the use count a class (else one class),
      ``supersede`` gives superseded snapshots a class of their own and their count to the successor. It suits
      traces where a conversation's next turn comes hundreds of requests later, which recency-based aging does
      not wait for (bench/bench_snapshot_policy.py; figures in docs/history.md).

    The default stays ``"greedy-dual"`` for existing callers."""
    if not isinstance(model, ModelCostSpec):
        raise TypeError(f"model: expected a ModelCostSpec, got {type(model).__name__}")
    if aging not in AGING_MODES:
        raise ValueError(f"aging: expected one of {', '.join(AGING_MODES)}, got {aging!r}")
    if cost_exponent < 0:
        raise ValueError(f"cost_exponent: expected >= 0, got {cost_exponent}")

    def factory(group: PoolGroupSpec, tier: Tier) -> EvictionPolicy:
        if group.life_cycle.kind is not LifeCycleKind.RECURRENT:
            return (attention_policy or PrioritizedLRU)(group, tier)
        size = max(1, group.bytes_per_page)

        def value(prefix_tokens: int) -> float:
            return (model.prefill_flops(prefix_tokens) / size) ** cost_exponent

        if aging == "hit-density":
            return HitDensitySnapshotPolicy(
                value,
                tokens_per_block,
                reuse_classes=4 if frequency else 1,
                marginal=marginal,
                supersede=supersede,
                max_walk=max_walk,
            )
        return CostAwareSnapshotPolicy(
            value, tokens_per_block, frequency=frequency, marginal=marginal, supersede=supersede, max_walk=max_walk
        )

    if attention_policy is None and aging == "hit-density":
        return snapshot_aware_eviction(factory)
    return factory


def snapshot_aware_eviction(snapshot_policy: EvictionPolicyFactory = PrioritizedLRU) -> EvictionPolicyFactory:
    """An ``eviction_policy`` factory for a hybrid manager: ``snapshot_policy`` for recurrent pools (a policy with
    an ``on_victim`` hook, whose victims it watches) and :class:`SnapshotAwareLRU`
    for the others, so attention blocks that no request can reuse (past the last snapshot of their path) are
    evicted first. Works with any snapshot policy: ``snapshot_aware_eviction()`` is plain LRU plus that rule."""
    recurrent: set[int] = set()  # shared by the policies of one manager's pools
    aware: list[SnapshotAwareLRU] = []

    def snapshot_evicted(page: Page) -> None:
        for policy in aware:
            policy.snapshot_evicted(page)

    def factory(group: PoolGroupSpec, tier: Tier) -> EvictionPolicy:
        if group.life_cycle.kind is not LifeCycleKind.RECURRENT:
            policy = SnapshotAwareLRU(recurrent)
            aware.append(policy)
            return policy
        snap = snapshot_policy(group, tier)
        if not hasattr(snap, "on_victim"):
            raise TypeError(
                "snapshot_policy: expected a factory of policies with an on_victim hook (LazyHeapPolicy-based or "
                f"PrioritizedLRU), got {type(snap).__name__}"
            )
        recurrent.add(group.group_id)
        snap.on_victim = snapshot_evicted
        return snap

    return factory
