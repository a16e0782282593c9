"""Long-context demotion with aging, exact demotion with the read-only probe, DEFER and its retry.

Includes the two review findings on the reference system: an underestimated long request must not starve
while short requests keep arriving (the aging bound holds for every request), and a deferred request's claim
is really released (checked on a real manager: the retry creates a new cache).
"""

from __future__ import annotations

import pytest

from kvforge.kvcache import CacheStatus, KVCacheConfig, KVCacheManager, LayerSpec, RuntimeHooks, TierConfig
from kvforge.scheduling import (
    ENV_DEMOTE_MAX_ITERS,
    ENV_DEMOTE_UNCACHED_TOKENS,
    Request,
    Scheduler,
    SchedulerConfig,
    resolve_demotion,
)
from tests.test_scheduler import assert_nothing_held, ctx, drain, make_sched, mk, step

EXACT = RuntimeHooks(exact_context_demotion=True)


class CountingManager(KVCacheManager):
    """A real manager that records probes and created caches per request id (by its first prompt token)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.probes: list = []
        self.created: list = []

    def probe_reuse(self, tokens=None, scope=None, **kw):
        self.probes.append(tokens[0] if tokens is not None else None)
        return super().probe_reuse(tokens, scope, **kw)

    def create_cache(self, tokens=None, **kw):
        cache = super().create_cache(tokens, **kw)
        self.created.append(cache)
        return cache


def counting_sched(pages: int = 512, tpb: int = 4, hooks=None, **cfg) -> tuple[Scheduler, CountingManager]:
    mgr = CountingManager(KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)))
    return Scheduler(mgr, SchedulerConfig(**cfg), hooks=hooks), mgr


def order(b) -> list:
    return [x.request.request_id for x in b.context]


# --- thresholds --------------------------------------------------------------------------------------------------


def test_thresholds_from_environment_and_config_wins(monkeypatch):
    monkeypatch.delenv(ENV_DEMOTE_UNCACHED_TOKENS, raising=False)
    monkeypatch.delenv(ENV_DEMOTE_MAX_ITERS, raising=False)
    assert resolve_demotion(SchedulerConfig()) == (0, 8)  # off by default
    monkeypatch.setenv(ENV_DEMOTE_UNCACHED_TOKENS, "4096")
    monkeypatch.setenv(ENV_DEMOTE_MAX_ITERS, "3")
    assert resolve_demotion(SchedulerConfig()) == (4096, 3)
    assert resolve_demotion(SchedulerConfig(demote_uncached_tokens=100, demote_max_iters=0)) == (100, 0)
    s, _ = make_sched()
    assert (s.demote_uncached_tokens, s.demote_max_iters) == (4096, 3)
    monkeypatch.setenv(ENV_DEMOTE_MAX_ITERS, "many")
    with pytest.raises(ValueError, match=ENV_DEMOTE_MAX_ITERS):
        resolve_demotion(SchedulerConfig())
    monkeypatch.setenv(ENV_DEMOTE_UNCACHED_TOKENS, "-5")
    with pytest.raises(ValueError, match=ENV_DEMOTE_UNCACHED_TOKENS):
        resolve_demotion(SchedulerConfig(demote_max_iters=1))


def test_exact_mode_follows_the_model_hooks_unless_configured():
    assert not make_sched()[0].exact_context_demotion
    assert make_sched(hooks=EXACT)[0].exact_context_demotion
    assert not make_sched(hooks=EXACT, exact_context_demotion=False)[0].exact_context_demotion


# --- estimate-only demotion and aging ----------------------------------------------------------------------------


def test_long_request_moves_behind_short_ones():
    for thr, want in [(0, [("L", 0, 32)]), (16, [("s1", 0, 8), ("s2", 0, 8), ("L", 0, 16)])]:
        s, _ = make_sched(max_num_tokens=32, demote_uncached_tokens=thr, demote_max_iters=8)
        for r in (mk("L", 100), mk("s1", 8), mk("s2", 8)):
            s.add_request(r)
        assert ctx(s.schedule()) == want, thr


def test_aging_bound_puts_a_demoted_request_back_in_its_place():
    s, _ = make_sched(pages=512, max_num_tokens=16, demote_uncached_tokens=16, demote_max_iters=2)
    L = mk("L", 100)
    s.add_request(L)
    seen = []
    for i in range(6):
        s.add_request(mk(f"a{i}", 8))
        s.add_request(mk(f"b{i}", 8))
        b, _ = step(s)
        seen.append(order(b))
    # Two iterations behind the short ones, then L keeps its (oldest) place and takes the budget first.
    assert seen[0] == ["a0", "b0"] and seen[1] == ["a1", "b1"]
    assert seen[2][0] == "L" and L.demote_iters == 2
    assert all(o[0] == "L" for o in seen[2:])


def test_router_estimate_is_what_estimate_only_demotion_sees():
    # A fork over a cached 96-token prefix: the router does not know it (estimate = whole prompt), so
    # estimate-only demotion moves it behind a short request although only 8 tokens are left to compute.
    s, _ = make_sched(max_num_tokens=64, demote_uncached_tokens=32)
    shared = list(range(7000, 7096))
    s.add_request(mk("first", 100, prefix=shared))
    drain(s)
    s.add_request(mk("fork", 104, prefix=shared, estimated_uncached_tokens=104))
    s.add_request(mk("short", 16))
    assert order(s.schedule()) == ["short", "fork"]


# --- exact demotion ----------------------------------------------------------------------------------------------


def test_exact_mode_judges_a_cached_prefix_by_its_remainder_with_one_probe():
    s, mgr = counting_sched(max_num_tokens=64, demote_uncached_tokens=32, hooks=EXACT)
    shared = list(range(7000, 7096))
    s.add_request(mk("first", 100, prefix=shared))
    drain(s)
    mgr.probes.clear()
    probes_before = s.stats.probes
    fork = mk("fork", 104, prefix=shared, estimated_uncached_tokens=104)
    s.add_request(fork)
    s.add_request(mk("short", 16))
    b = s.schedule()
    # Probed once: 96 tokens are cached, 8 remain, so the fork keeps its place in front.
    assert order(b) == ["fork", "short"]
    assert ctx(b)[0] == ("fork", 96, 8)
    assert fork.uncached_prefill_probed and fork.probed_uncached_tokens == 8
    assert mgr.probes == [7000] and s.stats.probes == probes_before + 1


def test_probe_walks_once_per_request_while_it_stays_demoted():
    s, mgr = counting_sched(max_num_tokens=8, demote_uncached_tokens=16, demote_max_iters=50, hooks=EXACT)
    s.add_request(mk("L", 100))
    for i in range(5):
        s.add_request(mk(f"s{i}", 8))
        step(s)
    assert len(mgr.probes) == 1 and s.get("L").demote_iters == 5
    # A request the estimate already calls short is never probed.
    assert s.stats.probes == 1


def test_underestimated_request_is_deferred_and_retried_after_the_rest_of_the_pass():
    s, mgr = counting_sched(max_num_tokens=64, demote_uncached_tokens=32, hooks=EXACT)
    u = mk("u", 100, estimated_uncached_tokens=4)  # the router thinks its prefix is cached; it is not
    s.add_request(u)
    s.add_request(mk("s1", 16))
    s.add_request(mk("s2", 16))
    b = s.schedule()
    assert b.deferred == (u,)
    # Retried after the short ones, on the budget they left; the exact remainder is kept for later iterations.
    assert ctx(b) == [("s1", 0, 16), ("s2", 0, 16), ("u", 0, 32)]
    assert u.num_deferrals == 1 and u.demote_iters == 1 and u.probed_uncached_tokens == 100
    # The claim of the first prepare was really released: the retry created a new cache.
    u_caches = [c for c in mgr.created if c.user_data is u]
    assert len(u_caches) == 2 and u_caches[0].status is CacheStatus.CLOSED and u.cache is u_caches[1]
    assert u_caches[0] not in mgr.caches
    s.on_step_done(b)
    mgr.check_invariants()


def test_deferred_request_without_budget_left_holds_nothing():
    s, mgr = counting_sched(max_num_tokens=32, demote_uncached_tokens=16, hooks=EXACT)
    u = mk("u", 100, estimated_uncached_tokens=4)
    s.add_request(u)
    s.add_request(mk("s1", 16))
    s.add_request(mk("s2", 16))
    b = s.schedule()
    assert b.deferred == (u,) and order(b) == ["s1", "s2"]
    assert u.cache is None and all(c.user_data is not u for c in mgr.caches)
    s.on_step_done(b)
    drain(s, mgr)
    assert_nothing_held(mgr)


def test_estimate_only_keeps_an_underestimated_request_in_front_for_every_chunk():
    # The behaviour exact demotion fixes: with the router's estimate alone, u takes the budget at every chunk.
    s, _ = make_sched(max_num_tokens=32, demote_uncached_tokens=16)
    s.add_request(mk("u", 100, estimated_uncached_tokens=4))
    for i in range(3):
        s.add_request(mk(f"s{i}", 8))
        b, _ = step(s)
        assert order(b)[0] == "u" and ctx(b)[0][2] == 32


def test_starved_request_is_never_deferred():
    s, _ = counting_sched(max_num_tokens=32, demote_uncached_tokens=16, demote_max_iters=1, hooks=EXACT)
    u = mk("u", 100, estimated_uncached_tokens=4)
    s.add_request(u)
    s.add_request(mk("s0", 16))
    s.add_request(mk("s1", 16))
    b, _ = step(s)
    assert b.deferred == (u,) and order(b) == ["s0", "s1"]
    s.add_request(mk("s2", 16))
    s.add_request(mk("s3", 16))
    b, _ = step(s)
    # One demoted iteration is the bound: u keeps its place now, first in the order, not deferred again.
    assert b.deferred == () and order(b)[0] == "u" and u.num_deferrals == 1


@pytest.mark.parametrize("max_iters", [0, 2, 5])
def test_underestimated_request_runs_within_the_aging_bound_under_endless_short_arrivals(max_iters):
    # The reference system's starvation: FCFS, a 1,024-token budget, an oldest request estimated at 256 tokens
    # whose prepared remainder is 10,000, and short requests that fill the budget every iteration.
    s, mgr = counting_sched(
        pages=1024, tpb=64, max_num_tokens=1024, demote_uncached_tokens=512, demote_max_iters=max_iters, hooks=EXACT
    )
    u = Request("u", tokens=list(range(10_000)), max_new_tokens=1, estimated_uncached_tokens=256)
    s.add_request(u)
    first_run = None
    for it in range(1, 30):
        for k in range(4):
            s.add_request(Request(f"s{it}.{k}", tokens=[it, k, *range(1_000_000, 1_000_254)], max_new_tokens=1))
        b, _ = step(s)
        if first_run is None and "u" in order(b):
            first_run = it
            # Starved: it runs in its own (oldest) place, first in the step, taking the budget.
            assert order(b)[0] == "u"
    assert first_run is not None and first_run <= max_iters + 1
    assert u.demote_iters == max_iters
    # Once started it is not pushed back again: its 10 budget-sized chunks finish while short requests keep coming.
    assert u.is_done
    mgr.check_invariants()
