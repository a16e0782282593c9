"""Servers sharing a device (kvforge.sim.contention): the slowdown curve, processor sharing on one device, and
the simulator with shared devices (one instance unchanged, two always-busy ones on capacity 1 take 2x, work
conserved)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.__main__ import main as kvforge_main
from kvforge.kvcache import hashing
from kvforge.sim.contention import Contention, SharedDevice
from kvforge.sim.profile import FEATURES, FORMAT, StepProfile, load_profile
from kvforge.sim.simulator import SimConfig, SimulationError, simulate
from kvforge.sim.workload import SimRequest
from tests.test_sim_profile import ENGINE, TINY

# A constant step time: every step (prefill or decode) takes STEP seconds alone.
STEP = 0.1
CONST = {k: (STEP if k == "intercept" else 0.0) for k in FEATURES}


# --- the curve ---------------------------------------------------------------------------------------------------


def test_capacity_curve_is_processor_sharing():
    one = Contention.from_capacity(1)
    assert [one.factor(k) for k in range(1, 6)] == [1, 2, 3, 4, 5]
    two = Contention.from_capacity(2)
    assert [two.factor(k) for k in range(1, 6)] == pytest.approx([1, 1, 1.5, 2, 2.5])
    frac = Contention.from_capacity(1.5)
    assert [frac.factor(k) for k in range(1, 5)] == pytest.approx([1, 2 / 1.5, 3 / 1.5, 4 / 1.5])
    assert frac.capacity == pytest.approx(1.5)


def test_measured_curve_extends_at_its_last_throughput():
    c = Contention((1.0, 1.6, 2.4))
    assert c.factor(2) == 1.6 and c.factor(3) == 2.4
    assert c.factor(6) == pytest.approx(4.8)  # 6 / (3 / 2.4): the throughput of k = 3
    assert c.capacity == pytest.approx(1.25)


def test_from_samples_divides_by_the_alone_time_and_clamps_noise():
    c = Contention.from_samples([2.0, 3.0, 1.9])
    assert c.slowdown == (1.0, 1.5, 1.0)
    with pytest.raises(ValueError, match="seconds_by_k"):
        Contention.from_samples([1.0, 0.0])


@pytest.mark.parametrize(
    ("slowdown", "exc", "needle"),
    [
        ((), TypeError, "non-empty"),
        ([1.0, 2.0], TypeError, "tuple"),
        ((1.2,), ValueError, "k=1"),
        ((1.0, 0.5), ValueError, "k=2"),
        ((1.0, float("inf")), ValueError, "k=2"),
        ((1.0, True), ValueError, "k=2"),
    ],
)
def test_bad_curves_are_refused(slowdown, exc, needle):
    with pytest.raises(exc, match=needle):
        Contention(slowdown)


@pytest.mark.parametrize(("cap", "exc"), [(0.5, ValueError), (float("nan"), TypeError), (True, TypeError)])
def test_bad_capacity_is_refused(cap, exc):
    with pytest.raises(exc, match="capacity"):
        Contention.from_capacity(cap)


def test_factor_refuses_k_below_one():
    with pytest.raises(ValueError, match="k"):
        Contention().factor(0)


# --- one device ----------------------------------------------------------------------------------------------------


def test_one_step_alone_is_unchanged():
    d = SharedDevice(Contention.from_capacity(1))
    d.start("a", 2.5, 1.0)
    assert d.ends() == {"a": 3.5}
    assert d.finish("a", 3.5) == 0.0 and d.busy == 0


def test_two_steps_on_capacity_one_take_twice_as_long():
    d = SharedDevice(Contention.from_capacity(1))
    d.start("a", 1.0, 0.0)
    d.start("b", 1.0, 0.0)
    assert d.ends() == {"a": 2.0, "b": 2.0}


def test_a_step_speeds_up_when_its_neighbour_ends():
    d = SharedDevice(Contention.from_capacity(1))
    d.start("a", 1.0, 0.0)
    d.start("b", 3.0, 0.0)
    assert d.ends()["a"] == pytest.approx(2.0)
    d.finish("a", 2.0)  # b did 1.0 of its 3.0 meanwhile, then runs alone
    assert d.ends()["b"] == pytest.approx(4.0)


def test_device_refuses_bad_calls():
    d = SharedDevice(Contention())
    d.start("a", 1.0, 5.0)
    with pytest.raises(ValueError, match="already running"):
        d.start("a", 1.0, 5.0)
    with pytest.raises(ValueError, match="time goes back"):
        d.start("b", 1.0, 4.0)
    with pytest.raises(ValueError, match="no step"):
        d.finish("z", 6.0)
    with pytest.raises(ValueError, match="work"):
        d.start("c", -1.0, 6.0)


curves = st.one_of(
    st.floats(1.0, 8.0).map(Contention.from_capacity),
    st.lists(st.floats(1.0, 4.0), min_size=0, max_size=4).map(lambda xs: Contention((1.0, *sorted(xs)))),
)
jobs = st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 5.0)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(curve=curves, jobs=jobs)
def test_processor_sharing_conserves_work(curve: Contention, jobs: list[tuple[float, float]]):
    """Driven event by event, the device does exactly the jobs' work: the integral of k / slowdown(k) over time
    equals the work submitted, no step ends before its work at full speed, and it is never idle while busy."""
    d = SharedDevice(curve)
    pending = sorted((t, w, i) for i, (t, w) in enumerate(jobs))
    t = done = 0.0
    started: dict[int, float] = {}
    while pending or d.busy:
        ends = d.ends()
        t_end, key = min(((e, k) for k, e in ends.items()), default=(math.inf, None))
        t_next = pending[0][0] if pending else math.inf
        now = min(t_end, t_next)
        if d.busy:
            done += (now - t) * d.busy / curve.factor(d.busy)
        t = now
        if t_end <= t_next:
            d.finish(key, t)
            assert t - started[key] >= jobs[key][1] * (1 - 1e-9) - 1e-12  # type: ignore[index]
        else:
            _, w, i = pending.pop(0)
            started[i] = t
            d.start(i, w, t)
    assert done == pytest.approx(sum(w for _, w in jobs), rel=1e-9, abs=1e-9)


# --- the simulator ---------------------------------------------------------------------------------------------------


def _profile(tmp_path: Path, coefficients=CONST, **over):
    data = {"format": FORMAT, "coefficients": dict(coefficients), "model": asdict(TINY), "engine": dict(ENGINE)}
    data.update(over)
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(data))
    return p


def _cfg(prof, **kw) -> SimConfig:
    gib, frac = prof.cache_size()
    base = dict(servers=2, model=TINY, cache_gib=gib, state_fraction=frac, tokens_per_block=16,
                snapshot_policy="lru", max_num_tokens=128, max_num_requests=8, decode_quantum=1,
                step_profile=prof)  # fmt: skip
    return SimConfig(**{**base, **kw})


def _reqs(n: int, spacing: float, out: int = 4, seed: int = 0, lengths=(8, 60)) -> list[SimRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        toks = [rng.randrange(256) for _ in range(rng.randrange(*lengths))]
        reqs.append(SimRequest(i, spacing * i, len(toks), out, tuple(hashing.block_keys(toks, 16))))
    return reqs


def test_a_server_alone_on_a_shared_device_is_unchanged(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    reqs = _reqs(5, 10.0)  # far apart: one request at a time, so only one server is ever stepping
    alone = simulate(reqs, _cfg(prof), "round-robin")
    shared = simulate(reqs, _cfg(prof, servers_per_device=2, contention=Contention.from_capacity(1)), "round-robin")
    assert shared.ttft_p50 == pytest.approx(alone.ttft_p50) and shared.itl_p50 == pytest.approx(alone.itl_p50)
    assert shared.step_s == pytest.approx(alone.step_s) == pytest.approx(alone.busy_s)


def test_two_always_busy_servers_on_capacity_one_each_take_twice_as_long(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    # Both at once, one per server, the same number of steps each (prompts under a block: one prefill step).
    reqs = _reqs(2, 0.0, out=6, lengths=(12, 13))
    alone = simulate(reqs, _cfg(prof), "round-robin")
    shared = simulate(reqs, _cfg(prof, servers_per_device=2, contention=Contention.from_capacity(1)), "round-robin")
    assert alone.ttft_p50 == pytest.approx(STEP)
    assert shared.ttft_p50 == pytest.approx(2 * alone.ttft_p50)
    assert shared.itl_p50 == pytest.approx(2 * alone.itl_p50)
    assert shared.makespan_s == pytest.approx(2 * alone.makespan_s)
    assert shared.busy_s == pytest.approx(alone.busy_s) and shared.step_s == pytest.approx(2 * alone.step_s)
    # Two devices of one server each: no sharing, whatever the curve.
    split = simulate(reqs, _cfg(prof, servers=2, servers_per_device=1, contention=Contention.from_capacity(1)),
                     "round-robin")  # fmt: skip
    assert split.makespan_s == pytest.approx(alone.makespan_s)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), spacing=st.floats(0.0, 0.5), cap=st.floats(1.0, 3.0), seed=st.integers(0, 99))
def test_a_shared_fleet_does_no_more_than_its_capacity(n: int, spacing: float, cap: float, seed: int):
    """Three servers on one device of capacity C: the work done (single-instance step seconds) never exceeds
    C x the time the device had, and sharing never makes a step shorter than alone."""
    prof = StepProfile({**CONST, "prefill_tokens": 1e-3}, TINY, dict(ENGINE))
    reqs = _reqs(n, spacing, seed=seed)
    r = simulate(reqs, _cfg(prof, servers=3, servers_per_device=3, contention=Contention.from_capacity(cap)),
                 "round-robin")  # fmt: skip
    span = r.makespan_s + reqs[0].arrival_s
    assert r.busy_s <= cap * span * (1 + 1e-9) + 1e-9
    assert r.step_s >= r.busy_s * (1 - 1e-9)


def test_profile_contention_is_read_and_used(tmp_path: Path):
    prof = load_profile(_profile(tmp_path, contention={"slowdown": [1.0, 2.0], "phases": []}))
    assert prof.contention == Contention((1.0, 2.0), prof.contention.source)  # type: ignore[union-attr]
    cfg = _cfg(prof, servers_per_device=2)
    assert cfg.contention is prof.contention
    reqs = _reqs(2, 0.0, out=6, lengths=(12, 13))
    assert simulate(reqs, cfg, "round-robin").makespan_s == pytest.approx(
        2 * simulate(reqs, _cfg(prof), "round-robin").makespan_s
    )


@pytest.mark.parametrize(
    ("contention", "needle"),
    [({"slowdown": [1.2]}, "contention.slowdown"), ({"slowdown": "x"}, "contention"), ([1.0], "contention")],
)
def test_bad_profile_contention_names_the_field(tmp_path: Path, contention, needle):
    with pytest.raises(ValueError, match=needle):
        load_profile(_profile(tmp_path, contention=contention))


def test_sharing_without_a_curve_is_refused(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    with pytest.raises(SimulationError, match="--servers-per-device"):
        _cfg(prof, servers_per_device=2)
    with pytest.raises(SimulationError, match="--servers-per-device"):
        _cfg(prof, servers_per_device=3)  # more than the servers
    with pytest.raises(TypeError, match="contention"):
        _cfg(prof, servers_per_device=2, contention=(1.0, 2.0))


def test_cli_shared_devices(tmp_path: Path, capsys):
    path = _profile(tmp_path, contention={"slowdown": [1.0, 1.7]})
    common = ["simulate", "--profile", str(path), "--conversations", "4", "--servers", "2", "--no-progress",
              "--router", "round-robin", "--cache-gib", "0.05"]  # fmt: skip
    assert kvforge_main([*common, "--servers-per-device", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 servers per device" in out and "1, 1.7" in out
    assert kvforge_main([*common, "--servers-per-device", "2", "--shared-device-capacity", "1"]) == 0
    assert "capacity 1" in capsys.readouterr().out
    rc = kvforge_main([*common, "--shared-device-capacity", "1"])
    assert rc == 2 and "argument --shared-device-capacity" in capsys.readouterr().err
    rc = kvforge_main([*common, "--servers-per-device", "3"])
    assert rc == 2 and "argument --servers-per-device" in capsys.readouterr().err
    plain = _profile(tmp_path)
    rc = kvforge_main([*common[:2], str(plain), *common[3:], "--servers-per-device", "2"])
    assert rc == 2 and "measured with --contention" in capsys.readouterr().err


def test_replace_keeps_the_resolved_curve(tmp_path: Path):
    prof = load_profile(_profile(tmp_path, contention={"slowdown": [1.0, 1.5]}))
    cfg = replace(_cfg(prof, servers_per_device=2), servers=4)
    assert cfg.contention is prof.contention and cfg.servers_per_device == 2
