"""Per-phase host time of :meth:`Engine.step <kvforge.engine.engine.Engine.step>` (off unless asked for).

``EngineConfig(profile_phases=True)`` (or ``Engine(sync=True)``) gives the engine a :class:`PhaseTimer`; without
one the step takes no clock readings at all. The step calls :meth:`PhaseTimer.start` once and
:meth:`PhaseTimer.mark` at the end of each phase, so every host second of the step lands in exactly one phase
(:data:`STEP_PHASES`, in step order; a step adds only the phases it runs). With ``sync=True`` each mark first
waits for the device (``torch.cuda.synchronize``), so device work launched in a phase is charged to it: the
split of a step's wall time between host phases and the forward / replay, at the price of the host no longer
running ahead of the device. :meth:`PhaseTimer.nested` wraps a callable that runs inside some phase (the block
pool's KV event emission inside ``commit``): its time goes to its own name and is taken out of the enclosing
phase, so the phases still add up to the step.

``clock`` is wall time (``time.perf_counter``) unless given (``time.thread_time``: this thread's CPU seconds, which
a loaded machine's other processes disturb far less; it does not count time waiting for the device).
``totals`` maps phase -> seconds summed over ``steps`` steps; :meth:`per_step_ms` gives ms per step. Phases
outside :data:`STEP_PHASES` do not occur.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["STEP_PHASES", "PhaseTimer"]

# schedule: Scheduler.schedule. cache_copies: the manager's page copies and fresh states zeroed. page_table:
# DevicePageTable.materialize. state_index: the rows' live state pages (and, eager, their upload). inputs: slot
# ids, the graph's persistent inputs (or, eager, the input ids and rows). capture: a bucket's first use (warm-up +
# capture). replay: the graph replay call (eager: the padded static step). forward: the eager Runner.step (its own
# host reads included). read: the one host read of a graph step (waits for the device unless synced). accept:
# emitted tokens and drafts out of the result. store: the slot stores (eager) / last drafts. commit:
# Scheduler.on_step_done less kv_events. kv_events: the block pool's event emission. finish: finished requests'
# outputs and slots, counters.
STEP_PHASES = (
    "schedule",
    "cache_copies",
    "page_table",
    "state_index",
    "inputs",
    "capture",
    "replay",
    "forward",
    "read",
    "accept",
    "store",
    "commit",
    "kv_events",
    "finish",
)


class PhaseTimer:
    """Host seconds per step phase (see the module docstring). ``sync``: wait for the CUDA device at every mark."""

    __slots__ = ("_clock", "_depth", "_t", "steps", "sync", "totals")

    def __init__(self, sync: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(sync, bool):
            raise TypeError(f"sync: expected a bool, got {type(sync).__name__}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(clock).__name__}")
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.steps = 0
        self.sync = sync
        self._clock = clock
        self._t = 0.0
        self._depth = 0

    def _now(self) -> float:
        if self.sync:
            import torch

            torch.cuda.synchronize()
        return self._clock()

    def start(self) -> None:
        """A step begins."""
        self.steps += 1
        self._t = self._now()

    def mark(self, phase: str) -> None:
        """The time since the last mark (or :meth:`start`) belongs to ``phase``."""
        t = self._now()
        self.totals[phase] += t - self._t
        self._t = t

    def nested(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as ``phase`` and taken out of whatever phase it runs in (an inner call of another nested
        callable counts once, in the outermost)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    dt = self._clock() - t0
                    self.totals[phase] += dt
                    self._t += dt

        return timed

    def clear(self) -> None:
        """Forget every total and the step count."""
        self.totals.clear()
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase that occurred, in :data:`STEP_PHASES` order."""
        n = max(self.steps, 1)
        return {p: 1e3 * self.totals[p] / n for p in STEP_PHASES if p in self.totals}
