"""The router replay bench's service model and metrics (``bench/bench_router_replay.py``) on hand-sized inputs."""

from __future__ import annotations

import pytest

from kvforge.kvcache.replay import TraceRequest

bench = pytest.importorskip("bench.bench_router_replay")


def _fleet_with_three_requests():
    # Two servers computing 1,000 tokens/s: 3,000 tokens on server 0 at t=0, 1,000 more there at t=1 (waits 2 s),
    # 2,000 on server 1 at t=1.5. Samples at whole seconds.
    fleet = bench.Fleet(2, 1000.0)
    assert fleet.add(0, 0.0, 3000) == pytest.approx(3.0)
    assert fleet.add(0, 1.0, 1000) == pytest.approx(4.0)
    assert fleet.add(1, 1.5, 2000) == pytest.approx(3.5)
    fleet.sample_until(5.0)
    return fleet


def test_fleet_queues_first_come_first_served():
    fleet = _fleet_with_three_requests()
    assert fleet.waits == pytest.approx([0.0, 2.0, 0.0])
    assert fleet.backlogs(2.0) == pytest.approx([2000.0, 1500.0])
    assert fleet.work == 6000


def test_fleet_imbalance_metrics_by_hand():
    m = _fleet_with_three_requests().summary()
    # Busy samples (mean >= one block): t=1 [2000, 0], t=2 [2000, 1500], t=3 [1000, 500].
    assert m["imbalance_mean"] == pytest.approx((2.0 + 2000 / 1750 + 1000 / 750) / 3)
    assert m["imbalance_of_means"] == pytest.approx(5000 / 3500)  # sum of maxima over sum of means
    # Largest single remainder: t=1 2,000 (the first request); t=2 1,500 (server 1's); t=3 1,000.
    assert m["granularity_floor"] == pytest.approx((2000 + 1750 + 1000) / 3500)
    assert m["server_imbalance_mean"] == pytest.approx(5000 / 3500)  # per-server means 5000/6 and 2000/6
    assert m["busy_fraction"] == pytest.approx(3 / 6)
    assert m["wait_mean_s"] == pytest.approx(2 / 3)


def test_least_work_left_oracle_takes_the_shortest_true_backlog():
    trace = [TraceRequest(t, w, 1, (i,)) for i, (t, w) in enumerate([(0, 3000), (1000, 1000), (1500, 2000)])]
    m = bench.least_work_left(trace, [3000, 1000, 2000], 2, 1000.0)
    # Second request to the idle server 1; third to server 1 (500 left) rather than server 0 (1,500 left).
    assert m["wait_mean_s"] == pytest.approx(0.5 / 3)


def test_replay_of_a_small_trace_keeps_the_books():
    # Three conversations of three turns on two servers; each turn extends its prompt by one 512-token block,
    # so round-robin splits conversations and the conversation router keeps every turn where its prefix is.
    trace = []
    for turn in range(3):
        for c in range(3):
            ids = tuple(c * 100 + b for b in range(turn + 2))
            trace.append(TraceRequest(1000.0 * (3 * turn + c), 512 * len(ids), 1, ids))
    ceiling = bench.ceiling_hit_rate(trace, 200)
    hits = {}
    for name, (factory, events) in bench.policies(100, bench.ImbalanceGuard(), bench.CostGuard(), 500.0).items():
        res = bench.replay(trace, factory, 2, 100, 500.0, events)
        hits[name] = res.hit_rate
        assert res.rho == pytest.approx(sum(res.work) / (2 * 500.0 * 8.0)), name
        assert len(res.work) == len(trace)
    assert hits["round-robin"] < ceiling
    for name in ("specific", "always", "always+events+guard", "always+events+cost", "always+events+cost+drain"):
        assert hits[name] == pytest.approx(ceiling), name


def _replay_with_preamble(trace, n_servers: int, blocks_per_server: int, util: float = 0.8):
    """name -> (hit rate / same-capacity ceiling, time-averaged max/mean backlog over servers)."""
    duration = (trace[-1].timestamp - trace[0].timestamp) / 1000.0
    ceiling = bench.ceiling_hit_rate(trace, n_servers * blocks_per_server)
    rate = sum(r.input_length for r in trace) * (1.0 - ceiling) / duration / (n_servers * util)
    out = {}
    for name, (factory, events) in bench.policies(
        blocks_per_server, bench.ImbalanceGuard(), bench.CostGuard(), rate
    ).items():
        if name in ("round-robin", "least-load", "sglang-like"):
            continue
        res = bench.replay(trace, factory, n_servers, blocks_per_server, rate, events)
        out[name] = (res.hit_rate / ceiling, res.server_imbalance_mean)
    return out


def _synthetic_conversations(n_conv: int, seed: int) -> list[TraceRequest]:
    """Multi-turn conversations arriving over time; each turn extends its prompt by 1-3 blocks."""
    import random

    rng = random.Random(seed)
    events = []
    next_key = 0
    for _ in range(n_conv):
        t = rng.uniform(0, 600_000.0)
        keys: tuple[int, ...] = ()
        for _ in range(rng.randint(2, 6)):
            grow = rng.randint(1, 3)
            keys = keys + tuple(range(next_key, next_key + grow))
            next_key += grow
            events.append((t, len(keys) * 512 - rng.randint(0, 511), keys))
            t += rng.uniform(5_000.0, 60_000.0)
    events.sort()
    return [TraceRequest(t, n, 1, keys) for t, n, keys in events]


@pytest.mark.parametrize("preamble", [2, 8])
def test_a_shared_preamble_does_not_collapse_any_follow_mode_on_synthetic_conversations(preamble):
    # Issue 17 section 3: with a preamble every new conversation matched, "always" followed the latest
    # conversation and sent all traffic to one server (time-averaged imbalance = number of servers).
    trace = bench.with_preamble(_synthetic_conversations(400, seed=preamble), preamble)
    assert trace[0].hash_ids[:preamble] == trace[-1].hash_ids[:preamble]
    for name, (frac, imbalance) in _replay_with_preamble(trace, 4, 2_000).items():
        assert frac >= 0.95, (name, frac)
        assert imbalance <= 1.3, (name, imbalance)


def test_a_shared_preamble_on_a_prefix_of_the_conversation_trace():
    from kvforge.kvcache.replay import default_trace_path, load_trace

    path = default_trace_path()
    if path is None or not path.exists():
        pytest.skip("conversation trace not present (set KVFORGE_TRACE)")
    trace = bench.with_preamble(load_trace(path)[:2_000], 2)
    for name, (frac, imbalance) in _replay_with_preamble(trace, 4, 2_500).items():
        assert frac >= 0.95, (name, frac)
        assert imbalance <= 1.3, (name, imbalance)
