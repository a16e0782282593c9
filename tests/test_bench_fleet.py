"""bench/bench_fleet.py's step analysis: the fleet's logged steps set against the profile and the contention
curve (synthetic step logs, no fleet)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.bench_fleet import step_analysis
from kvforge.sim.contention import Contention
from kvforge.sim.profile import FEATURES, StepProfile
from tests.test_sim_profile import ENGINE, TINY

# Every step is fitted at 0.1 s (intercept only).
PROFILE = StepProfile({k: (0.1 if k == "intercept" else 0.0) for k in FEATURES}, TINY, dict(ENGINE))


def _log(folder: Path, name: str, steps: list[tuple[float, float]]) -> None:
    rows = [{"t0": a, "t1": b, "prefill": [[0, 8]], "decode_requests": 0, "decode_context": 0} for a, b in steps]
    (folder / f"steps_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_alone_and_overlapped_steps(tmp_path: Path):
    # engine0: a step alone (0.15 s), then one fully overlapped by engine1's (0.2 s each); a step outside the window.
    _log(tmp_path, "engine0", [(10.0, 10.15), (11.0, 11.2), (50.0, 50.1)])
    _log(tmp_path, "engine1", [(11.0, 11.2)])
    out = step_analysis(tmp_path, PROFILE, Contention((1.0, 2.0)), (0.0, 20.0))
    assert out["steps_logged"] == 3 and out["steps_alone"] == 1
    assert out["steps_alone_measured_over_fit"] == pytest.approx(1.5)
    assert out["steps_measured_over_fit"] == pytest.approx((0.15 + 0.2 + 0.2) / 0.3)
    # The alone step at slowdown 1, the two overlapped ones at slowdown(2) = 2.
    assert out["steps_contention_over_fit"] == pytest.approx((0.1 + 0.2 + 0.2) / 0.3)
    no_curve = step_analysis(tmp_path, PROFILE, None, (0.0, 20.0))
    assert no_curve["steps_contention_over_fit"] == pytest.approx(1.0)


def test_half_overlap_interpolates_the_curve(tmp_path: Path):
    _log(tmp_path, "engine0", [(0.0, 1.0)])
    _log(tmp_path, "engine1", [(0.5, 1.5)])
    out = step_analysis(tmp_path, PROFILE, Contention((1.0, 3.0)), (0.0, 2.0))
    assert out["steps_alone"] == 0
    assert out["steps_contention_over_fit"] == pytest.approx(2.0)  # 1 + 0.5 others: halfway from 1 to 3


def test_no_steps_in_the_window(tmp_path: Path):
    _log(tmp_path, "engine0", [(0.0, 1.0)])
    assert step_analysis(tmp_path, PROFILE, None, (5.0, 6.0)) == {}


def test_overlaps_match_the_pairwise_sum(tmp_path: Path):
    # Three engines, each stepping one step after another with random gaps: the bisected overlaps must give what
    # summing every pair of steps gives.
    rng = random.Random(7)
    logs = {}
    for name in ("engine0", "engine1", "engine2"):
        t, steps = 0.0, []
        for _ in range(60):
            t += rng.choice((0.0, rng.uniform(0, 0.3)))
            d = rng.uniform(0.01, 0.4)
            steps.append((t, t + d))
            t += d
        logs[name] = steps
        _log(tmp_path, name, steps)
    window = (1.0, 9.0)
    curve = Contention((1.0, 1.7, 2.9))
    out = step_analysis(tmp_path, PROFILE, curve, window)
    flat = [(e, a, b) for e, st in enumerate(logs.values()) for a, b in st if window[0] <= a and b <= window[1]]
    pred = alone = 0.0
    for e, a, b in flat:
        others = sum(max(0.0, min(b, b1) - max(a, a0)) for f, a0, b1 in flat if f != e) / (b - a)
        lo = max(1, int(others + 1))
        pred += 0.1 * (curve.factor(lo) + (others + 1 - lo) * (curve.factor(lo + 1) - curve.factor(lo)))
        alone += others < 0.05
    assert out["steps_logged"] == len(flat) and out["steps_alone"] == alone
    assert out["steps_contention_over_fit"] == pytest.approx(pred / (0.1 * len(flat)))
