"""The simulator's model layout and step-time model: validation, JSON configs, bench-result parsing, costs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvforge.kvcache.config import KVCacheConfig, LayerOwner, LifeCycleKind
from kvforge.sim.model import (
    FALLBACK_ATTENTION_TFLOPS,
    FALLBACK_HBM_GBPS,
    FALLBACK_MATMUL_TFLOPS,
    KIMI_K3_LIKE,
    ModelSpec,
    StepTimeModel,
    Throughputs,
    load_model,
)


def test_default_model_is_the_hybrid_managers_description():
    # The simulator must size caches exactly as the hybrid manager's own model description does.
    sp = pytest.importorskip("kvforge.kvcache.snapshot_policy")
    cost = sp.KIMI_K3_LIKE
    assert KIMI_K3_LIKE.mla_layers == len(cost.attention_layers)
    assert KIMI_K3_LIKE.recurrent_layers == len(cost.recurrent_layers)
    assert KIMI_K3_LIKE.state_bytes == cost.snapshot_bytes
    assert KIMI_K3_LIKE.mla_layers * KIMI_K3_LIKE.kv_bytes_per_token_layer == cost.kv_bytes_per_token
    # The round trip through the cost spec keeps what the cost-aware policy values snapshots by.
    back = KIMI_K3_LIKE.to_cost_spec()
    assert back.snapshot_bytes == cost.snapshot_bytes
    assert back.prefill_flops(10_000) == pytest.approx(cost.prefill_flops(10_000))
    # One description: the simulator's default is derived from the cost spec, and so are ModelSpec's defaults.
    assert ModelSpec.from_cost_spec(cost) == KIMI_K3_LIKE
    assert replace(KIMI_K3_LIKE, name="x") == ModelSpec(name="x")
    with pytest.raises(TypeError, match="spec"):
        ModelSpec.from_cost_spec(KIMI_K3_LIKE)


def test_kv_layers_build_a_valid_config_with_a_draft_group():
    cfg = KVCacheConfig(tokens_per_block=128, layers=KIMI_K3_LIKE.kv_layers())
    kinds = [(g.owner, g.life_cycle.kind, len(g.layer_ids)) for g in cfg.groups]
    assert (LayerOwner.TARGET, LifeCycleKind.FULL, 16) in kinds
    assert (LayerOwner.TARGET, LifeCycleKind.RECURRENT, 45) in kinds
    assert (LayerOwner.DRAFT, LifeCycleKind.FULL, 1) in kinds
    only = KIMI_K3_LIKE.attention_only()
    assert not only.is_hybrid
    assert all(g.life_cycle.kind is LifeCycleKind.FULL for g in KVCacheConfig(128, only.kv_layers()).groups)


@pytest.mark.parametrize(
    "bad",
    [
        {"mla_layers": 0},
        {"recurrent_layers": 4, "recurrent_state_bytes": 0},
        {"active_params": 2e12},
        {"top_k": 500},
        {"draft_acceptance": 1.5},
        {"kv_dtype": "int4"},
        {"draft_layers": 0, "draft_len": 2},
    ],
)
def test_model_spec_rejects_bad_fields(bad):
    with pytest.raises((ValueError, TypeError)):
        replace(KIMI_K3_LIKE, **bad)


def test_tokens_per_step_is_the_expected_accepted_run():
    m = replace(KIMI_K3_LIKE, draft_len=3, draft_acceptance=0.5)
    assert m.tokens_per_step == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert replace(KIMI_K3_LIKE, draft_len=0, draft_layers=0).tokens_per_step == 1.0


def test_load_model_json_overrides_the_default(tmp_path: Path):
    p = tmp_path / "small.json"
    p.write_text(json.dumps({"mla_layers": 4, "recurrent_layers": 0, "recurrent_state_bytes": 0}))
    m = load_model(p)
    assert (m.name, m.mla_layers, m.is_hybrid, m.active_params) == ("small", 4, False, KIMI_K3_LIKE.active_params)
    assert load_model(None) is KIMI_K3_LIKE and load_model("kimi-k3-like") is KIMI_K3_LIKE


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"layers": 3}', "unknown field"),
        ('{"top_k": 0}', "top_k"),
    ],
)
def test_load_model_errors_name_the_file_and_problem(tmp_path: Path, text: str, match: str):
    p = tmp_path / "m.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_model(p)
    assert str(p) in str(info.value)
    with pytest.raises(ValueError, match="no such file"):
        load_model(tmp_path / "absent.json")


def _write(path: Path, header: list[str], rows: list[list[object]]) -> None:
    path.write_text("\n".join([",".join(header), *(",".join(map(str, r)) for r in rows)]) + "\n")


def test_throughputs_read_bench_results_and_fall_back_per_figure(tmp_path: Path):
    _write(
        tmp_path / "mla_context.csv",
        ["workload", "provider", "tflops", "fp8_mm_tflops"],
        [
            ["a", "kvforge fp8", 100, 900],
            ["b", "kvforge fp8", 300, 900],
            ["c", "kvforge fp8", 200, 900],
            ["a", "other", 999, 900],
        ],
    )
    tp = Throughputs.from_bench_results(tmp_path)
    assert (tp.matmul_tflops, tp.attention_tflops) == (900.0, 200.0)  # the median of the kvforge fp8 rows
    assert tp.hbm_gbps == FALLBACK_HBM_GBPS  # small_copies.csv absent
    assert "matmul" in tp.source and "bandwidth" not in tp.source
    _write(tmp_path / "small_copies.csv", ["provider", "gbps"], [["d2d copy (same bytes)", 3000.5], ["x", 1]])
    assert Throughputs.from_bench_results(tmp_path).hbm_gbps == 3000.5
    assert Throughputs.from_bench_results(tmp_path, hbm_gbps=10.0).hbm_gbps == 10.0  # overrides win
    empty = Throughputs.from_bench_results(tmp_path / "none")
    assert (empty.matmul_tflops, empty.attention_tflops, empty.hbm_gbps) == (
        FALLBACK_MATMUL_TFLOPS,
        FALLBACK_ATTENTION_TFLOPS,
        FALLBACK_HBM_GBPS,
    )
    assert empty.source.startswith("fallback")


def test_throughputs_validate():
    for bad in ({"efficiency": 0.0}, {"efficiency": 1.5}, {"gpus": 0}, {"hbm_gbps": -1.0}):
        with pytest.raises((ValueError, TypeError)):
            Throughputs(**bad)


def _model(**kw: object) -> StepTimeModel:
    return StepTimeModel(KIMI_K3_LIKE, Throughputs(step_overhead_s=0.0, **kw))  # type: ignore[arg-type]


def test_prefill_cost_grows_with_the_cached_prefix_it_attends_to():
    m = _model()
    assert m.step_time([], 0, 0) == 0.0
    fresh = m.step_time([(0, 32768)], 0, 0)
    late = m.step_time([(200_000, 32768)], 0, 0)
    assert late > 1.5 * fresh > 0  # quadratic attention: the same chunk costs more far into a long prompt
    two = m.step_time([(0, 32768), (0, 32768)], 0, 0)
    assert two == pytest.approx(2 * fresh, rel=1e-9)  # compute-bound: twice the tokens, twice the time
    # A short chunk is bound by reading the weights (every expert is touched by a few thousand tokens).
    assert m.step_time([(0, 4096)], 0, 0) == pytest.approx(m.weight_bytes(4096) / (8 * FALLBACK_HBM_GBPS * 1e9))


def test_decode_cost_is_bandwidth_bound_and_grows_with_context_bytes():
    m = _model()
    small = m.step_time([], 1_000, 1)
    big = m.step_time([], 2_000_000, 1)
    kv_bytes = (2_000_000 - 1_000) * KIMI_K3_LIKE.kv_bytes_per_token
    assert big - small == pytest.approx(kv_bytes / (8 * FALLBACK_HBM_GBPS * 1e9), rel=1e-6)
    # Aggregating Q real steps costs Q steps.
    assert m.step_time([], 1_000, 1, real_steps=4) == pytest.approx(4 * small)
    # Half the efficiency, twice the time (no fixed overhead here).
    assert _model(efficiency=0.5).step_time([], 1_000, 1) == pytest.approx(2 * small)


def test_weight_bytes_count_touched_experts():
    m = _model()
    one = m.weight_bytes(1)
    many = m.weight_bytes(100_000)
    assert one < many <= KIMI_K3_LIKE.total_params * KIMI_K3_LIKE.weight_bytes * (1 + 1e-9)
    assert many == pytest.approx(KIMI_K3_LIKE.total_params * KIMI_K3_LIKE.weight_bytes)
    assert m.weight_bytes(0) == 0.0
