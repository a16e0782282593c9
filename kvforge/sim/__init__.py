"""Trace-driven serving simulation: workloads, a step-time model and the simulator that composes the real
router, schedulers and cache managers (``kvforge simulate``).

Entry points: :func:`simulate` (one run: a workload, a :class:`SimConfig`, a router policy) returning a
:class:`RunResult`; workloads from :class:`SyntheticWorkload` or :func:`load_mooncake_trace`; the model layout
and step-time model in :mod:`kvforge.sim.model`; servers sharing a device in :mod:`kvforge.sim.contention`;
tables, CSV and PNG in :mod:`kvforge.sim.report`.
"""

from kvforge.sim.contention import Contention, SharedDevice
from kvforge.sim.model import KIMI_K3_LIKE, ModelSpec, StepTimeModel, Throughputs, load_model
from kvforge.sim.simulator import ROUTER_POLICIES, RunResult, SimConfig, SimulationError, percentile, simulate
from kvforge.sim.workload import (
    SimRequest,
    SyntheticWorkload,
    TraceFormatError,
    TraceOrderWarning,
    default_trace_path,
    load_mooncake_trace,
)

__all__ = [
    "KIMI_K3_LIKE",
    "ROUTER_POLICIES",
    "Contention",
    "ModelSpec",
    "RunResult",
    "SharedDevice",
    "SimConfig",
    "SimRequest",
    "SimulationError",
    "StepTimeModel",
    "SyntheticWorkload",
    "Throughputs",
    "TraceFormatError",
    "TraceOrderWarning",
    "default_trace_path",
    "load_model",
    "load_mooncake_trace",
    "percentile",
    "simulate",
]
