"""Device sharing: simulated servers whose steps run on one device, slowed down by each other.

A step profile times one engine alone. When several engines share a device (engine processes on the same CPU
cores, or two engines time-slicing one GPU), a step that overlaps other instances' steps takes longer.
:class:`Contention` is that slowdown as a curve: ``slowdown(k)`` is how many times longer a step takes while
``k`` instances of its device are stepping, with ``slowdown(1) == 1`` (the profile is the single-instance time).
The curve is either measured (``bench/profile_step_time.py --contention K`` runs k = 1..K engines stepping at
once and stores it in the profile's ``contention`` object, which :mod:`kvforge.sim.profile` reads) or given as a
capacity ``C >= 1`` (:meth:`Contention.from_capacity`: ``slowdown(k) = max(1, k / C)``, processor sharing of C
instances' worth of compute). Past the last point of a measured curve, the device's throughput stays that of the
last point: ``slowdown(k) = slowdown(K) * k / K``.

:class:`SharedDevice` advances one device's steps in simulated time (processor sharing): each step holds its
remaining *work* (seconds at the profile's single-instance speed); while ``k`` steps are in progress each one
progresses at rate ``1 / slowdown(k)``, so every step's end moves when another step starts or ends on the
device. A device holding one step runs it at rate 1: a server alone on its device is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Contention", "SharedDevice"]


@dataclass(frozen=True)
class Contention:
    """``slowdown[k - 1]``: how many times longer a step takes while ``k`` steps run on its device (see the
    module docstring). ``source`` says where the curve came from (kept for reports)."""

    slowdown: tuple[float, ...] = (1.0,)
    source: str = ""

    def __post_init__(self) -> None:
        s = self.slowdown
        if not isinstance(s, tuple) or not s:
            raise TypeError(f"slowdown: expected a non-empty tuple of numbers, got {s!r}")
        for i, v in enumerate(s):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
                raise ValueError(f"slowdown[{i}] (k={i + 1}): expected a finite number >= 1, got {v!r}")
        if s[0] != 1:
            raise ValueError(f"slowdown[0] (k=1): must be 1 (a profile times one instance alone), got {s[0]!r}")

    @classmethod
    def from_capacity(cls, capacity: float) -> Contention:
        """Processor sharing of ``capacity`` instances' worth of compute: ``slowdown(k) = max(1, k / capacity)``."""
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not math.isfinite(capacity):
            raise TypeError(f"capacity: expected a finite number, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity: expected a number >= 1 (one instance runs at full speed), got {capacity!r}")
        # The table reaches the capacity, so its processor-sharing extension is k / capacity exactly.
        n = math.ceil(capacity)
        return cls(tuple(max(1.0, k / capacity) for k in range(1, n + 1)), f"capacity {capacity:g}")

    @classmethod
    def from_samples(cls, seconds_by_k: Sequence[float], source: str = "") -> Contention:
        """The curve from mean step seconds measured with k = 1, 2, ... instances stepping at once (the same
        steps each time): ``seconds[k] / seconds[1]``, held at >= 1 (a ratio under 1 is noise: sharing a device
        cannot speed a step up)."""
        if not seconds_by_k or any(not (math.isfinite(x) and x > 0) for x in seconds_by_k):
            raise ValueError(f"seconds_by_k: expected positive finite step times, got {list(seconds_by_k)!r}")
        base = seconds_by_k[0]
        return cls(tuple([1.0] + [max(1.0, x / base) for x in seconds_by_k[1:]]), source)

    def factor(self, k: int) -> float:
        """The slowdown of a step while ``k >= 1`` steps run on its device."""
        if k < 1:
            raise ValueError(f"k: expected an int >= 1, got {k!r}")
        n = len(self.slowdown)
        return self.slowdown[k - 1] if k <= n else self.slowdown[-1] * k / n

    @property
    def capacity(self) -> float:
        """The device's throughput at the last point of the curve, in single instances: ``K / slowdown(K)``."""
        return len(self.slowdown) / self.slowdown[-1]


class SharedDevice:
    """One device's steps under processor sharing (see the module docstring). Keys name the steps (the
    simulator uses the server index: one step per server at a time)."""

    def __init__(self, contention: Contention) -> None:
        self.contention = contention
        self._work: dict[Hashable, float] = {}
        self._t = 0.0

    @property
    def busy(self) -> int:
        """Steps in progress."""
        return len(self._work)

    def _advance(self, now: float) -> None:
        if now < self._t:
            raise ValueError(f"now: time goes back ({now!r} < {self._t!r})")
        if self._work and now > self._t:
            done = (now - self._t) / self.contention.factor(len(self._work))
            for key, left in self._work.items():
                self._work[key] = max(0.0, left - done)
        self._t = now

    def start(self, key: Hashable, work: float, now: float) -> None:
        """A step of ``work`` seconds (single-instance time) starts at ``now``."""
        if not (math.isfinite(work) and work >= 0):
            raise ValueError(f"work: expected a finite number of seconds >= 0, got {work!r}")
        if key in self._work:
            raise ValueError(f"key: step {key!r} is already running on this device")
        self._advance(now)
        self._work[key] = work

    def finish(self, key: Hashable, now: float) -> float:
        """Take step ``key`` off the device at ``now`` (its end); returns the work it had left (0 but for
        rounding, when ``now`` is the end :meth:`ends` gave)."""
        if key not in self._work:
            raise ValueError(f"key: no step {key!r} is running on this device")
        self._advance(now)
        return self._work.pop(key)

    def ends(self) -> dict[Hashable, float]:
        """When each step in progress ends if no step starts or ends before it."""
        if not self._work:
            return {}
        f = self.contention.factor(len(self._work))
        return {key: self._t + left * f for key, left in self._work.items()}

    def remaining(self, key: Hashable) -> float:
        """The work step ``key`` had left at the device's last event."""
        return self._work[key]
