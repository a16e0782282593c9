"""What a recurrent-state snapshot is worth, and eviction policies that keep the valuable ones.

A snapshot (every recurrent layer's state at one block boundary) takes the same bytes whatever prefix it stands
for, but reusing one after ``L`` tokens skips a prefill whose cost grows with ``L``. This package values
snapshots by that cost and evicts accordingly:

* :mod:`.cost`: :class:`ModelCostSpec` (layout and prefill FLOPs) and :data:`KIMI_K3_LIKE`, the default model.
* :mod:`.greedy_dual`: :class:`CostAwareSnapshotPolicy` (GreedyDual-Size-Frequency aging).
* :mod:`.hit_density`: :class:`HitDensitySnapshotPolicy` (value times learned reuses per slot-time).
* :mod:`.attention`: :class:`SnapshotAwareLRU` (attention pages: unreusable leaves first).
* :mod:`.factories`: :func:`cost_aware_eviction` and :func:`snapshot_aware_eviction`, the ``eviction_policy``
  factories a hybrid manager takes.

Every policy satisfies :class:`~kvforge.kvcache.eviction.EvictionPolicy`; only the snapshot a match starts from
is refreshed (the manager locks just the source of the live-state copy). How the policies compare on the
Mooncake replay is in ``bench/results/README.md`` and ``docs/history.md``.
"""

from kvforge.kvcache.snapshot_policy.attention import SnapshotAwareLRU
from kvforge.kvcache.snapshot_policy.cost import KIMI_K3_LIKE, ModelCostSpec
from kvforge.kvcache.snapshot_policy.factories import AGING_MODES, cost_aware_eviction, snapshot_aware_eviction
from kvforge.kvcache.snapshot_policy.greedy_dual import CostAwareSnapshotPolicy
from kvforge.kvcache.snapshot_policy.hit_density import HitDensitySnapshotPolicy

__all__ = [
    "AGING_MODES",
    "KIMI_K3_LIKE",
    "CostAwareSnapshotPolicy",
    "HitDensitySnapshotPolicy",
    "ModelCostSpec",
    "SnapshotAwareLRU",
    "cost_aware_eviction",
    "snapshot_aware_eviction",
]
