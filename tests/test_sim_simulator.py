"""The simulator composes the real router, schedulers and cache managers: conservation, reuse and failure paths."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvforge.sim.model import KIMI_K3_LIKE
from kvforge.sim.server import hybrid_available, plan_cache_layout, snapshot_policies
from kvforge.sim.simulator import ROUTER_POLICIES, SimConfig, SimulationError, simulate
from kvforge.sim.workload import SimRequest, SyntheticWorkload

needs_hybrid = pytest.mark.skipif(not hybrid_available(), reason="the hybrid cache manager is not installed")


@pytest.fixture(scope="module")
def small() -> list[SimRequest]:
    return SyntheticWorkload(conversations=40, seed=5).requests()


def _check_conservation(res, reqs):
    assert res.requests == len(reqs)
    assert sorted(res.ttfts) == [r.request_id for r in reqs] and min(res.ttfts.values()) > 0
    assert res.output_tokens == sum(r.output_tokens for r in reqs)
    assert res.throughput_tok_s * res.makespan_s == pytest.approx(res.output_tokens)
    if res.preemptions == 0:
        # Without recomputation every prompt token is either reused at admission or computed once.
        assert res.prefill_computed + res.hit_tokens == res.prompt_tokens
        assert res.prefill_saved == res.hit_tokens
    assert 0 < res.itl_p50 <= res.itl_p99
    assert 0 < res.ttft_p50 <= res.ttft_p99


@pytest.mark.parametrize("policy", list(ROUTER_POLICIES))
def test_every_router_policy_runs_to_completion(small, policy):
    res = simulate(small, SimConfig(servers=3), policy)
    _check_conservation(res, small)
    assert res.policy == policy and res.imbalance >= 1.0
    assert res.load_series and len(res.load_series[0]) == 3


def test_plain_manager_on_a_hybrid_model_reuses_nothing(small):
    res = simulate(small, SimConfig(servers=2, snapshot_policy="none"), "conversation")
    _check_conservation(res, small)
    assert res.hit_tokens == 0 and res.snapshots == {}


@needs_hybrid
def test_hybrid_manager_reuses_at_snapshots_and_attention_only_bounds_it(small):
    big = SimConfig(servers=2, cache_gib=256.0)
    hybrid = simulate(small, replace(big, snapshot_policy=snapshot_policies(KIMI_K3_LIKE)[0]), "conversation")
    _check_conservation(hybrid, small)
    assert hybrid.snapshots["snapshots"] > 0 and hybrid.hit_rate > 0.3
    attn = simulate(small, replace(big, model=KIMI_K3_LIKE.attention_only(), snapshot_policy="none"), "conversation")
    _check_conservation(attn, small)
    # A hybrid request reuses only up to a snapshot; the attention cache alone would reuse at least as much.
    assert attn.hit_tokens >= hybrid.hit_tokens
    assert attn.snapshots == {}


@needs_hybrid
@pytest.mark.parametrize("snap", ["lru", "short-prompt", "cost-aware"])
def test_snapshot_policies_under_pressure(small, snap):
    # A small state pool: live states and snapshots compete, and snapshots are evicted.
    res = simulate(
        small, SimConfig(servers=2, cache_gib=12.0, state_fraction=0.2, snapshot_policy=snap), "conversation"
    )
    _check_conservation(res, small)
    assert res.snapshots["snapshots"] > 0
    assert 0.0 < res.hit_rate < 1.0


def test_affinity_routing_beats_round_robin_on_reuse(small):
    cfg = SimConfig(servers=4, model=KIMI_K3_LIKE.attention_only(), snapshot_policy="none")
    conv = simulate(small, cfg, "conversation")
    rr = simulate(small, cfg, "round-robin")
    assert conv.hit_rate > rr.hit_rate + 0.05


def test_aggregated_decode_keeps_latency_and_token_counts(small):
    cfg = SimConfig(servers=2, model=KIMI_K3_LIKE.attention_only(), snapshot_policy="none")
    one = simulate(small, replace(cfg, decode_quantum=1), "conversation")
    eight = simulate(small, replace(cfg, decode_quantum=8), "conversation")
    _check_conservation(one, small)
    _check_conservation(eight, small)
    assert eight.itl_p50 == pytest.approx(one.itl_p50, rel=0.15)
    assert eight.ttft_p50 == pytest.approx(one.ttft_p50, rel=0.15)
    assert eight.hit_rate == pytest.approx(one.hit_rate, abs=0.05)


def test_demotion_runs_and_counts(small):
    cfg = SimConfig(servers=1, demote_uncached_tokens=2048, exact_demotion=True, snapshot_policy="none")
    res = simulate(small, replace(cfg, model=KIMI_K3_LIKE.attention_only()), "conversation")
    _check_conservation(res, small)
    assert res.demotions > 0


def test_impossible_capacities_raise_one_clear_error(small):
    with pytest.raises(SimulationError, match="cannot hold one"):
        simulate(small, SimConfig(cache_gib=0.01), "conversation")
    longest = max(r.prompt_tokens + r.output_tokens for r in small)
    layout = plan_cache_layout(KIMI_K3_LIKE, 1 << 30, 128)
    assert layout.attention_tokens < longest  # 1 GiB is too small for this workload's longest request
    with pytest.raises(SimulationError, match="longest request needs"):
        simulate(small, SimConfig(cache_gib=1.0), "conversation")


def test_bad_config_values_raise():
    with pytest.raises(SimulationError, match="unknown policy"):
        simulate(SyntheticWorkload(conversations=2).requests(), SimConfig(), "nope")
    for bad in ({"servers": 0}, {"cache_gib": -1.0}, {"state_fraction": 1.0}, {"exact_demotion": True}):
        with pytest.raises(SimulationError):
            SimConfig(**bad)
    with pytest.raises(SimulationError, match="snapshot-policy"):
        simulate(
            SyntheticWorkload(conversations=2).requests(),
            SimConfig(model=KIMI_K3_LIKE.attention_only(), snapshot_policy="lru"),
            "conversation",
        )
