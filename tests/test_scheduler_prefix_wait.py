"""Prefix waits: a request whose prefix an in-flight request is prefilling waits (bounded), asks the owner for a
snapshot point where their prompts part, is counted, and is probed again once it stops waiting."""

from __future__ import annotations

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, RuntimeHooks, TierConfig
from kvforge.scheduling import Request, Scheduler, SchedulerConfig
from tests.test_scheduler import assert_nothing_held, ctx, drain, make_sched, mk, step

SHARED = list(range(5000, 5048))  # 48 tokens: 12 blocks of 4


def slow_owner(rid, n, prefix=SHARED, every=8) -> Request:
    """An owner whose every step ends at a snapshot point ``every`` tokens on (as an unmarked hybrid request's
    would), so it leaves budget for the others and its progress is predictable."""
    r = mk(rid, n, prefix=prefix)
    r.set_snapshot_marks(range(every, n, every))
    return r


def test_request_waits_for_the_prefix_in_flight_and_then_reuses_it():
    s, mgr = make_sched(max_num_tokens=16)
    owner = slow_owner("o", 60)
    s.add_request(owner)
    step(s)  # owner computed 8 of its 48 shared tokens
    w = mk("w", 56, prefix=SHARED)
    s.add_request(w)
    waits = []
    while w.cache is None:
        computed = owner.num_computed_tokens
        b, _ = step(s)
        waits.append((computed, b.prefix_waiting == (w,), ctx(b)))
    # It waits while the owner computes tokens 8..48 (five steps), then starts after the shared prefix.
    assert [(c, waited) for c, waited, _ in waits] == [
        (8, True),
        (16, True),
        (24, True),
        (32, True),
        (40, True),
        (48, False),
    ]
    assert waits[-1][2] == [("o", 48, 8), ("w", 48, 8)]
    assert w.waiting_for_prefix_of is None and w.prefix_wait_iters == 5
    # The owner was asked for a snapshot where the prompts part; the wait is counted once per request.
    assert owner.requested_snapshot_points == {48}
    st = s.prefix_wait_stats
    assert (st.requests_waited, st.wait_iterations, st.snapshot_points_requested, st.waits_expired) == (1, 5, 1, 0)
    drain(s, mgr)
    assert_nothing_held(mgr)


def test_without_prefix_waits_both_compute_the_prefix():
    s, _ = make_sched(max_num_tokens=64, prefix_wait=False)
    s.add_request(mk("o", 60, prefix=SHARED))
    s.add_request(mk("w", 56, prefix=SHARED))
    assert ctx(s.schedule()) == [("o", 0, 60), ("w", 0, 4)]


def test_wait_is_bounded():
    s, _mgr = make_sched(max_num_tokens=16, max_prefix_wait_iters=2)
    s.add_request(slow_owner("o", 60, every=4))
    step(s)
    w = mk("w", 56, prefix=SHARED)
    s.add_request(w)
    seen = [step(s)[0].prefix_waiting for _ in range(3)]
    assert seen[:2] == [(w,), (w,)] and seen[2] == ()
    # After the bound it computes itself what the owner has not committed yet (the owner is at 12 of 48).
    assert w.cache is not None and w.cache.num_reused_tokens == 12
    assert s.prefix_wait_stats.waits_expired == 1


def test_several_waiters_ask_one_distinct_point_and_the_manager_hears_of_new_waiters():
    class Recorder(KVCacheManager):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.waits: list[tuple] = []

        def count_prefix_waits(self, requests):
            self.waits.append(tuple(r.request_id for r in requests))

    mgr = Recorder(KVCacheConfig(4, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=128),)))
    s = Scheduler(mgr, SchedulerConfig(max_num_tokens=24))
    owner = slow_owner("o", 60)
    s.add_request(owner)
    step(s)
    s.add_request(mk("w1", 52, prefix=SHARED))
    s.add_request(mk("w2", 50, prefix=SHARED))
    step(s)
    step(s)
    assert mgr.waits == [("w1", "w2")]  # reported once, when they start waiting
    assert owner.requested_snapshot_points == {48}
    assert s.prefix_wait_stats.snapshot_points_requested == 1
    assert s.prefix_wait_stats.requests_waited == 2


def test_request_is_probed_again_once_it_stops_waiting():
    hooks = RuntimeHooks(exact_context_demotion=True)
    s, _mgr = make_sched(max_num_tokens=16, demote_uncached_tokens=12, hooks=hooks)
    owner = slow_owner("o", 52, every=4)
    s.add_request(owner)
    step(s)
    w = mk("w", 52, prefix=[*SHARED[:44], 1, 2, 3, 4])
    s.add_request(w)
    # A probe taken before the owner committed anything would call w long (52 tokens to compute).
    w.uncached_prefill_probed, w.probed_uncached_tokens = True, 52
    probes = s.stats.probes
    while w.waiting_for_prefix_of is not None or w.cache is None:
        b, _ = step(s)
        if w.cache is not None:
            break
        s.add_request(Request(f"s{b.step}", tokens=[9, b.step, 9, 9], max_new_tokens=1))
    # Probed afresh when the wait ended: 44 tokens are now cached, 8 remain, so w is short and keeps its place
    # (after the owner's chunk in flight) in front of the short request that arrived after it.
    assert s.stats.probes == probes + 1 and w.probed_uncached_tokens == 8
    assert [x[0] for x in ctx(b)] == ["o", "w", f"s{b.step - 1}"]
    assert ctx(b)[1] == ("w", 44, 8)
