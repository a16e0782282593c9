"""``kvforge simulate --profile``: the step-time fit, the profile file's checks, and a simulation on measured
step times (kvforge.sim.profile)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvforge.__main__ import main as kvforge_main
from kvforge.kvcache import hashing
from kvforge.sim.model import ModelSpec
from kvforge.sim.profile import (
    FEATURES,
    FORMAT,
    ProfiledStepTime,
    fit_step_times,
    load_profile,
    step_features,
)
from kvforge.sim.server import plan_cache_layout
from kvforge.sim.simulator import SimConfig, simulate
from kvforge.sim.workload import SimRequest

TINY = ModelSpec(
    name="kvforge-tiny", mla_layers=1, mla_heads=2, mla_qk_dim=48, mla_v_dim=32, mla_latent_dim=80,
    kv_dtype="float32", recurrent_layers=3, recurrent_state_bytes=2048, recurrent_flops_per_token=2048.0,
    total_params=1e6, active_params=1e6, dense_params=1e6, experts=1, top_k=1, weight_bytes=4.0,
    draft_layers=0, draft_params=0.0, draft_len=0, draft_acceptance=0.0,
)  # fmt: skip
ENGINE = {"tokens_per_block": 16, "attention_pages": 96, "state_pages": 20, "max_num_tokens": 128,
          "max_num_requests": 8}  # fmt: skip
TRUE = {"intercept": 0.05, "prefill_tokens": 2e-4, "prefill_chunks": 0.01, "prefill_attention": 1e-3,
        "decode_requests": 0.004, "decode_context": 1e-5, "prefill_steps": 0.03}  # fmt: skip


def _samples(rng: random.Random, n: int = 200, noise: float = 0.0):
    rows, secs = [], []
    for _ in range(n):
        prefill = [(rng.randrange(0, 300), rng.randrange(1, 200)) for _ in range(rng.randrange(0, 3))]
        dreq = rng.randrange(0, 17)
        dctx = sum(rng.randrange(1, 400) for _ in range(dreq))
        f = step_features(prefill, dreq, dctx)
        rows.append(f)
        secs.append(sum(TRUE[k] * v for k, v in zip(FEATURES, f)) * (1 + rng.uniform(-noise, noise)))
    return rows, secs


def test_fit_recovers_known_coefficients():
    rows, secs = _samples(random.Random(3))
    coef = fit_step_times(rows, secs)
    for k in FEATURES:
        assert coef[k] == pytest.approx(TRUE[k], rel=1e-6, abs=1e-12), k


def test_fit_is_non_negative_and_close_under_noise():
    rows, secs = _samples(random.Random(4), 400, noise=0.1)
    coef = fit_step_times(rows, secs)
    assert all(v >= 0 for v in coef.values())
    pred = [sum(coef[k] * v for k, v in zip(FEATURES, f)) for f in rows]
    errs = sorted(abs(p - s) / s for p, s in zip(pred, secs))
    assert errs[len(errs) // 2] < 0.08


def test_fit_refuses_too_few_rows():
    with pytest.raises(ValueError, match="rows"):
        fit_step_times([[1.0] * len(FEATURES)], [0.1])


def _profile(tmp_path: Path, **over) -> Path:
    data = {"format": FORMAT, "coefficients": dict(TRUE), "model": asdict(TINY), "engine": dict(ENGINE)}
    data.update(over)
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(data))
    return p


def test_profiled_step_time_evaluates_the_fit(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    st = ProfiledStepTime(prof)
    f = step_features([(32, 64)], 3, 300)
    assert st.step_time([(32, 64)], 300, 3) == pytest.approx(sum(TRUE[k] * v for k, v in zip(FEATURES, f)))
    # Two real steps: intercept, decode terms and the prefill step's fixed cost twice, the chunk once.
    two = st.step_time([(32, 64)], 300, 3, real_steps=2)
    per_step = TRUE["intercept"] + 3 * 0.004 + 300 * 1e-5 + TRUE["prefill_steps"]
    assert two - st.step_time([(32, 64)], 300, 3) == pytest.approx(per_step)
    # A decode-only step pays no prefill fixed cost.
    assert st.step_time([], 300, 3) == pytest.approx(TRUE["intercept"] + 3 * 0.004 + 300 * 1e-5)
    assert st.step_time([], 0, 0) == 0.0


def test_profile_without_prefill_steps_reads_it_as_zero(tmp_path: Path):
    """A profile written before ``prefill_steps`` existed loads, with that coefficient 0."""
    old = {k: v for k, v in TRUE.items() if k != "prefill_steps"}
    prof = load_profile(_profile(tmp_path, coefficients=old))
    assert prof.coefficients["prefill_steps"] == 0.0
    st = ProfiledStepTime(prof)
    f = step_features([(0, 64)], 0, 0)
    assert st.step_time([(0, 64)], 0, 0) == pytest.approx(sum(old.get(k, 0.0) * v for k, v in zip(FEATURES, f)))


def test_cache_size_reproduces_the_engine_pages(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    gib, frac = prof.cache_size()
    layout = plan_cache_layout(TINY, int(gib * 2**30), 16, frac)
    assert layout.state_pages == ENGINE["state_pages"]
    assert layout.attention_tokens == ENGINE["attention_pages"] * 16


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"format": "x"}, "format"),
        ({"coefficients": {**TRUE, "intercept": -1}}, "coefficients.intercept"),
        ({"coefficients": {**TRUE, "decode_context": float("nan")}}, "decode_context"),
        ({"coefficients": {k: 0.0 for k in TRUE}}, "all zero"),
        ({"coefficients": {"intercept": 1.0}}, "prefill_tokens"),
        ({"coefficients": [1]}, "objects"),
        ({"engine": {**ENGINE, "state_pages": 0}}, "engine.state_pages"),
        ({"engine": {**ENGINE, "tokens_per_block": True}}, "engine.tokens_per_block"),
        ({"model": {**asdict(TINY), "bogus": 1}}, "unknown fields"),
        ({"model": {**asdict(TINY), "mla_layers": 0}}, "mla_layers"),
        ({"model": 3}, "model"),
    ],
)
def test_bad_profiles_name_the_field(tmp_path: Path, over, needle):
    with pytest.raises(ValueError, match=needle):
        load_profile(_profile(tmp_path, **over))


def test_simulation_on_a_profile_matches_its_step_times(tmp_path: Path):
    prof = load_profile(_profile(tmp_path))
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(64)]
    reqs = []
    for i in range(12):
        toks = shared + [rng.randrange(256) for _ in range(rng.randrange(8, 60))]
        reqs.append(SimRequest(i, 0.5 * i, len(toks), 4, tuple(hashing.block_keys(toks, 16))))
    gib, frac = prof.cache_size()
    cfg = SimConfig(servers=2, model=TINY, cache_gib=gib, state_fraction=frac, tokens_per_block=16,
                    snapshot_policy="lru", max_num_tokens=128, max_num_requests=8, decode_quantum=1,
                    step_profile=prof)  # fmt: skip
    res = simulate(reqs, cfg, "conversation-kv")
    # A lone request's first token comes after at least one step with its whole prompt.
    floor = TRUE["intercept"] + TRUE["prefill_chunks"] + TRUE["prefill_tokens"] * len(shared)
    assert res.ttft_p50 >= floor
    assert 0 < res.hit_rate < 1  # the shared 64-token prefix is reused after the first request on each server
    slow = replace(prof, coefficients={**TRUE, "intercept": 10 * TRUE["intercept"]})
    res2 = simulate(reqs, replace(cfg, step_profile=slow), "conversation-kv")
    assert res2.ttft_p50 > res.ttft_p50


def test_profile_must_match_the_model(tmp_path: Path):
    from kvforge.sim.simulator import SimulationError

    prof = load_profile(_profile(tmp_path))
    with pytest.raises(SimulationError, match="--profile"):
        SimConfig(step_profile=prof)


def test_cli_with_a_profile(tmp_path: Path, capsys):
    path = _profile(tmp_path)
    rc = kvforge_main(["simulate", "--profile", str(path), "--conversations", "6", "--servers", "2",
                       "--no-progress", "--router", "conversation", "--cache-gib", "0.05"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "measured profile" in out
    rc = kvforge_main(["simulate", "--profile", str(path), "--model", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "argument --profile" in err
