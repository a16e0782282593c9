"""Token-budget scheduler: step order, budgets, chunked prefill, reuse, commits, preemption, deadlock, misuse.

Every test drives a real KVCacheManager with a small pool and asserts what ran (ids, starts, token counts, in
order) and what the cache holds afterwards. Helpers here are imported by the other test_scheduler_* files.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import pytest

from kvforge.errors import CacheStateError, SchedulerDeadlockError
from kvforge.kvcache import CacheStatus, KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.scheduling import (
    Request,
    RequestState,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
)

TPB = 4


def make_mgr(pages: int = 64, tpb: int = TPB) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)))


def make_sched(pages: int = 64, *, tpb: int = TPB, clock=None, hooks=None, **cfg) -> tuple[Scheduler, KVCacheManager]:
    mgr = make_mgr(pages, tpb)
    return Scheduler(mgr, SchedulerConfig(**cfg), clock=clock, hooks=hooks), mgr


def toks(rid: object, n: int, prefix: Sequence[int] = ()) -> list[int]:
    """A prompt of ``n`` tokens: ``prefix`` then tokens unique to ``rid``."""
    base = zlib.crc32(repr(rid).encode()) % 4_000_000 * 1000  # token ids stay below 2**32
    return [*prefix, *range(base, base + n - len(prefix))]


def mk(rid, n: int, out: int = 1, prefix: Sequence[int] = (), **kw) -> Request:
    return Request(rid, tokens=toks(rid, n, prefix), max_new_tokens=out, **kw)


def ctx(batch: ScheduledBatch) -> list[tuple]:
    return [(s.request.request_id, s.start, s.num_tokens) for s in batch.context]


def gen(batch: ScheduledBatch) -> list[tuple]:
    return [(s.request.request_id, s.num_tokens) for s in batch.generation]


def step(s: Scheduler, **kw) -> tuple[ScheduledBatch, tuple[Request, ...]]:
    b = s.schedule()
    return b, s.on_step_done(b, **kw)


def drain(s: Scheduler, mgr: KVCacheManager | None = None, max_steps: int = 2000) -> list[ScheduledBatch]:
    out = []
    while s.has_unfinished:
        assert len(out) < max_steps, "requests did not finish"
        b, _ = step(s)
        out.append(b)
        if mgr is not None:
            mgr.check_invariants()
    return out


def assert_nothing_held(mgr: KVCacheManager) -> None:
    """No cache is left and every GPU page is free or an unlocked tree page (nothing leaked)."""
    mgr.check_invariants()
    assert mgr.caches == ()
    for g in range(mgr.num_groups):
        pool = mgr.pool(g)
        assert all(p.ref_count == 0 for p in pool.pages)
        assert mgr.num_available_pages(g) == pool.capacity


# --- one step --------------------------------------------------------------------------------------------------


def test_generation_first_then_context_within_token_budget():
    s, _ = make_sched(max_num_tokens=10)
    s.add_request(mk("a", 3, out=5))
    s.add_request(mk("b", 3, out=5))
    b1, _ = step(s)
    assert ctx(b1) == [("a", 0, 3), ("b", 0, 3)]
    s.add_request(mk("c", 30))
    b2 = s.schedule()
    # Both generation requests take one token each, oldest first; the context chunk gets the rest of the budget.
    assert gen(b2) == [("a", 1), ("b", 1)]
    assert ctx(b2) == [("c", 0, 8)]
    assert [x.request.request_id for x in b2] == ["a", "b", "c"]
    assert b2.num_tokens == 10


def test_request_budget_admits_oldest_first():
    s, _ = make_sched(max_num_requests=2)
    for rid in "xyz":
        s.add_request(mk(rid, 5))
    b = s.schedule()
    assert ctx(b) == [("x", 0, 5), ("y", 0, 5)]
    assert [r.request_id for r in s.waiting] == ["z"]


def test_chunked_prefill_then_generation():
    s, mgr = make_sched(max_num_tokens=8)
    s.add_request(mk("r", 25, out=3))
    chunks = []
    for _ in range(4):
        b, fin = step(s)
        chunks.append((ctx(b), [x.is_last_chunk for x in b.context]))
        assert fin == ()
    assert chunks == [
        ([("r", 0, 8)], [False]),
        ([("r", 8, 8)], [False]),
        ([("r", 16, 8)], [False]),
        ([("r", 24, 1)], [True]),
    ]
    r = s.get("r")
    assert r.state is RequestState.GENERATION and r.num_generated == 1 and r.cache.num_committed_tokens == 25
    b, _ = step(s)
    assert gen(b) == [("r", 1)] and r.cache.history == 26
    b, fin = step(s)
    assert fin == (r,) and r.state is RequestState.DONE and r.num_generated == 3
    assert_nothing_held(mgr)


def test_chunks_in_flight_go_before_new_requests():
    s, _ = make_sched(max_num_tokens=8)
    s.add_request(mk("long", 20))
    step(s)
    s.add_request(mk("new", 4))
    b = s.schedule()
    assert ctx(b) == [("long", 8, 8)]
    s.on_step_done(b)
    b = s.schedule()
    assert ctx(b) == [("long", 16, 4), ("new", 0, 4)]


def test_reused_prefix_is_not_recomputed():
    s, _mgr = make_sched()
    shared = list(range(9000, 9012))  # three blocks
    s.add_request(mk(1, 15, prefix=shared))
    drain(s)
    s.add_request(mk(2, 18, prefix=shared))
    b = s.schedule()
    # 12 tokens come from the tree; only the 6 new ones are computed.
    assert ctx(b) == [(2, 12, 6)]
    assert s.get(2).cache.num_reused_tokens == 12


def test_generated_tokens_are_committed_and_reused_by_the_next_turn():
    s, _mgr = make_sched()
    r = mk(1, 6, out=4)
    s.add_request(r)
    outs = iter(range(500, 600))
    while s.has_unfinished:
        b = s.schedule()
        new = {x.request.request_id: [next(outs) for _ in range(1)] for x in b.generation}
        new.update({x.request.request_id: [next(outs)] for x in b.context if x.is_last_chunk})
        s.on_step_done(b, new_tokens=new)
    assert r.output_tokens == [500, 501, 502, 503]
    # The KV of the prompt and of the first three outputs exists (the last output was never fed back).
    follow = Request(2, tokens=[*r.tokens, *r.output_tokens[:3], 7, 7, 7], max_new_tokens=1)
    s.add_request(follow)
    b = s.schedule()
    # Prompt and the three outputs fed back (9 tokens: two blocks and a partial one) are reused.
    assert ctx(b) == [(2, 9, 3)]


def test_key_mode_requests_commit_with_keys_and_are_reused():
    s, mgr = make_sched()
    keys = [11, 12, 13]
    s.add_request(Request("k1", block_keys=keys, prompt_len=14, max_new_tokens=2))
    drain(s, mgr)
    s.add_request(Request("k2", block_keys=[11, 12, 99], prompt_len=13, max_new_tokens=1))
    b = s.schedule()
    assert ctx(b) == [("k2", 8, 5)]


def test_draft_tokens_take_budget_and_accepted_counts_advance():
    s, _mgr = make_sched(max_num_tokens=16)
    r = mk("d", 4, out=10, draft_len=3)
    s.add_request(r)
    step(s)
    b = s.schedule()
    assert gen(b) == [("d", 4)]
    assert r.cache.capacity == 8
    s.on_step_done(b, accepted_tokens={"d": 2})
    # Two tokens produced: history grows by 2, the rejected drafts' capacity is given back.
    assert r.num_generated == 3 and r.cache.history == 6 and r.cache.capacity == 6
    # Near the end, a step never schedules more tokens than the request may still produce.
    r.num_generated = 9
    b = s.schedule()
    assert gen(b) == [("d", 1)]


@pytest.mark.parametrize("reserve", [False, True])
def test_last_step_reserves_the_verify_width_when_asked(reserve):
    """With ``reserve_verify_width`` a request with fewer tokens left than ``1 + draft_len`` is scheduled for what
    it has left (the budget and acceptance bound unchanged) while its cache holds room for the full width, which
    the step's commit gives back; without it the room is what is scheduled."""
    s, _mgr = make_sched(max_num_tokens=16, reserve_verify_width=reserve)
    r = mk("d", 4, out=6, draft_len=3)
    s.add_request(r)
    step(s)  # prefill: history 4, one token emitted
    step(s, accepted_tokens={"d": 4})  # 5 generated: 1 left
    assert r.cache.history == 8
    b = s.schedule()
    assert gen(b) == [("d", 1)]
    assert r.cache.capacity == (12 if reserve else 9)
    with pytest.raises(ValueError, match="exceeds the 1 tokens scheduled"):
        s.on_step_done(b, accepted_tokens={"d": 2})
    assert s.on_step_done(b, accepted_tokens={"d": 1}) == (r,)
    assert r.num_generated == 6


def test_reserve_verify_width_must_be_a_bool():
    with pytest.raises(TypeError, match="reserve_verify_width"):
        SchedulerConfig(reserve_verify_width=1)  # type: ignore[arg-type]


def test_injected_clock_stamps_requests():
    now = [100.0]
    s, _ = make_sched(clock=lambda: now[0], max_num_tokens=4)
    r = mk("t", 6, out=2)
    s.add_request(r)
    b = s.schedule()
    now[0] = 101.0
    s.on_step_done(b)
    assert r.first_scheduled_time == 100.0 and r.first_token_time is None
    b = s.schedule()
    now[0] = 102.5
    s.on_step_done(b)
    assert r.first_token_time == 102.5
    step(s)
    assert r.finish_time == 102.5


# --- pages: preemption and deadlock ----------------------------------------------------------------------------


def test_running_request_preempts_newest_and_nothing_leaks():
    # 6 pages of 4 tokens. a (oldest) and b each hold 3 pages after an 11-token prompt; when a needs a 4th page,
    # b (the newest, not yet scheduled this step) is suspended.
    s, mgr = make_sched(pages=6)
    a, b_ = mk("a", 11, out=6), mk("b", 11, out=6)
    s.add_request(a)
    s.add_request(b_)
    b1, _ = step(s)
    assert ctx(b1) == [("a", 0, 11), ("b", 0, 11)]
    b2, _ = step(s)  # a: 11 -> 12 (fits page 3), b likewise
    assert gen(b2) == [("a", 1), ("b", 1)]
    b3 = s.schedule()  # a needs page 4: b is preempted
    assert gen(b3) == [("a", 1)]
    assert b3.preempted == (b_,)
    assert b_.state is RequestState.WAITING and b_.cache.status is CacheStatus.SUSPENDED
    assert b_.num_preemptions == 1
    s.on_step_done(b3)
    mgr.check_invariants()
    drain(s, mgr)
    assert a.num_generated == 6 and b_.num_generated == 6
    assert_nothing_held(mgr)


def test_older_request_is_never_preempted_for_a_newer_one():
    # a (older) has room for its next token, b (newer) needs a 4th page and the pool is full: b waits, a runs.
    s, mgr = make_sched(pages=6)
    a, b_ = mk("a", 11, out=6), mk("b", 12, out=6)
    s.add_request(a)
    s.add_request(b_)
    step(s)
    b2 = s.schedule()
    assert gen(b2) == [("a", 1)]
    assert b2.preempted == () and a.state is RequestState.GENERATION and b_.state is RequestState.GENERATION
    s.on_step_done(b2)
    # Now a needs the page: b, newer and not in the batch, is the one suspended.
    b3 = s.schedule()
    assert gen(b3) == [("a", 1)] and b3.preempted == (b_,)
    s.on_step_done(b3)
    drain(s, mgr)
    assert_nothing_held(mgr)


def test_new_admission_does_not_preempt_running_requests():
    s, mgr = make_sched(pages=4)
    s.add_request(mk("run", 12, out=3))
    step(s)  # holds 3 pages
    s.add_request(mk("big", 12))
    b = s.schedule()
    # run takes the last page for its 13th token; big finds none and is not allowed to preempt run.
    assert gen(b) == [("run", 1)]
    assert ctx(b) == [] and b.preempted == ()
    assert s.get("big").cache is None  # its claim on the reused prefix (none here) was released
    s.on_step_done(b)
    drain(s, mgr)
    assert_nothing_held(mgr)


def test_new_admission_is_cut_to_the_pages_left():
    s, mgr = make_sched(pages=5)
    s.add_request(mk("run", 8, out=2))
    step(s)  # 2 pages
    s.add_request(mk("big", 16))
    b = s.schedule()
    assert gen(b) == [("run", 1)]  # takes a 3rd page
    assert ctx(b) == [("big", 0, 8)]  # 2 pages left: 8 tokens
    s.on_step_done(b)
    drain(s, mgr)
    assert_nothing_held(mgr)


def test_deadlock_is_reported_not_spun():
    s, mgr = make_sched(pages=3)
    huge = mk("huge", 20)  # needs 5 pages, the pool has 3
    s.add_request(huge)
    step(s)  # 12 tokens fit
    s.add_request(mk("small", 4, out=2))
    b = s.schedule()
    # huge cannot grow and small finds no page: the stalled pass frees huge's pages and lets small run.
    assert ctx(b) == [("small", 0, 4)] and b.preempted == (huge,) and s.stats.stall_preemptions == 1
    s.on_step_done(b)
    with pytest.raises(SchedulerDeadlockError, match="cannot get pages"):
        drain(s, mgr)
    # small finished; huge alone can never fit. The manager is consistent, nothing is pending or held.
    assert s.num_unfinished == 1 and huge.cache.status is CacheStatus.SUSPENDED
    assert s.pending_batch is None
    mgr.check_invariants()
    assert all(p.ref_count == 0 for p in mgr.pool(0).pages)


# --- misuse and bad input --------------------------------------------------------------------------------------


def test_schedule_twice_and_foreign_batch_are_refused():
    s, _ = make_sched()
    s.add_request(mk(1, 4))
    b = s.schedule()
    with pytest.raises(SchedulerStateError):
        s.schedule()
    with pytest.raises(SchedulerStateError):
        s.on_step_done(ScheduledBatch(b.step, (), ()))
    s.on_step_done(b)
    with pytest.raises(SchedulerStateError):
        s.on_step_done(b)


def test_bad_step_results_change_nothing():
    s, mgr = make_sched()
    s.add_request(mk(1, 4, out=5, draft_len=2))
    step(s)
    b = s.schedule()
    before = mgr.state_snapshot()
    for kw, exc in [
        ({"accepted_tokens": {1: 4}}, ValueError),
        ({"accepted_tokens": {1: 0}}, ValueError),
        ({"accepted_tokens": {2: 1}}, ValueError),
        ({"accepted_tokens": {1: 1.0}}, TypeError),
        ({"new_tokens": {1: [1, 2]}}, ValueError),
        ({"new_tokens": {1: "a"}}, TypeError),
        ({"accepted_tokens": [1]}, TypeError),
    ]:
        with pytest.raises(exc):
            s.on_step_done(b, **kw)
        assert mgr.state_snapshot() == before and s.pending_batch is b
    s.on_step_done(b, accepted_tokens={1: 3})
    assert s.get(1).num_generated == 4


def test_add_request_validates():
    s, _ = make_sched(max_num_tokens=4)
    r = mk(1, 4)
    s.add_request(r)
    with pytest.raises(ValueError, match="request"):
        s.add_request(r)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(mk(1, 4))
    with pytest.raises(ValueError, match="block_keys"):
        s.add_request(Request(2, block_keys=[1, 2, 3], prompt_len=8))
    with pytest.raises(ValueError, match="draft_len"):
        s.add_request(mk(3, 4, draft_len=4))
    with pytest.raises(TypeError, match="request"):
        s.add_request("r")  # type: ignore[arg-type]


def test_config_and_constructor_validation():
    with pytest.raises(ValueError, match="max_num_tokens"):
        SchedulerConfig(max_num_tokens=0)
    with pytest.raises(TypeError, match="max_num_requests"):
        SchedulerConfig(max_num_requests=True)
    with pytest.raises(ValueError, match="demote_uncached_tokens"):
        SchedulerConfig(demote_uncached_tokens=-1)
    with pytest.raises(TypeError, match="exact_context_demotion"):
        SchedulerConfig(exact_context_demotion=1)
    with pytest.raises(TypeError, match="manager"):
        Scheduler(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        Scheduler(make_mgr(), {"max_num_tokens": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clock"):
        Scheduler(make_mgr(), clock=3)  # type: ignore[arg-type]


def test_request_validation():
    with pytest.raises(ValueError, match="request_id"):
        Request(None, tokens=[1])
    with pytest.raises(TypeError, match="request_id"):
        Request([1], tokens=[1])
    with pytest.raises(ValueError, match="prompt_len"):
        Request(1, block_keys=[1])
    with pytest.raises(ValueError, match="prompt_len"):
        Request(1, tokens=[1, 2], prompt_len=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(1, tokens=[1], max_new_tokens=0)
    with pytest.raises(TypeError, match="tokens"):
        Request(1, tokens="abc")
    with pytest.raises(TypeError, match="tokens\\[1\\]"):
        Request(1, tokens=[1, 2.0])
    r = Request(1, tokens=[1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="points"):
        r.set_snapshot_marks([4, 4])
    with pytest.raises(ValueError, match="pass_point"):
        r.set_snapshot_marks([2, 4], pass_point=2)
    with pytest.raises(ValueError, match="pass_point"):
        r.set_snapshot_marks([2, 4], alignment=2, pass_point=4)  # the last point is not a pass point
    with pytest.raises(ValueError, match="alignment"):
        r.set_snapshot_marks([2, 4], alignment=0)
    assert r.snapshot_points == () and r.midchunk_snapshot_alignment is None


def test_reset_for_recompute_clears_every_attempt_mark():
    s, _mgr = make_sched()
    r = mk(1, 10, out=3)
    s.add_request(r)
    step(s)
    r.set_snapshot_marks([4, 8], alignment=4, pass_point=4)
    r.request_snapshot_point(8)
    r.uncached_prefill_probed, r.probed_uncached_tokens = True, 7
    r.prefix_wait_iters, r.waiting_for_prefix_of = 2, "owner"
    r.demote_iters = 3
    with pytest.raises(CacheStateError):
        r.reset_for_recompute()  # its cache is still active
    r.cache.close()
    r.reset_for_recompute()
    assert r.cache is None and r.state is RequestState.WAITING and r.num_computed_tokens == 0
    assert r.snapshot_points == () and r.midchunk_snapshot_alignment is None and r.midchunk_pass_point is None
    assert r.requested_snapshot_points == set()
    assert not r.uncached_prefill_probed and r.probed_uncached_tokens is None
    assert r.prefix_wait_iters == 0 and r.waiting_for_prefix_of is None
    # Results and age stay: the recompute covers the prompt and the token already generated.
    assert r.num_generated == 1 and r.context_len == 11 and r.demote_iters == 3


def test_abort_releases_pages():
    s, mgr = make_sched()
    s.add_request(mk(1, 10, out=5))
    s.add_request(mk(2, 10, out=5))
    b = s.schedule()
    with pytest.raises(SchedulerStateError):
        s.abort(1)
    s.on_step_done(b)
    r = s.abort(1)
    assert r.aborted and r.state is RequestState.DONE and r.cache.status is CacheStatus.CLOSED
    with pytest.raises(ValueError, match="request_id"):
        s.abort(1)
    drain(s, mgr)
    assert_nothing_held(mgr)
