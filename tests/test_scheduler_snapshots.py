"""Snapshot-aware context chunks: forced ends at snapshot points, mid-chunk passes, the unaligned point 193.

Requests are marked by hand (as the hybrid manager will mark them) or by a manager subclass implementing the
``mark_context_request`` hook, and the chunks the scheduler picks are asserted.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, LifeCycle, TierConfig
from kvforge.scheduling import Request, Scheduler, SchedulerConfig, snapshot_chunk_end
from tests.test_scheduler import ctx, drain, mk, step

# --- the rule ----------------------------------------------------------------------------------------------------


def test_no_points_or_no_point_in_range_leaves_the_budget_end():
    assert snapshot_chunk_end(0, 100, ()) == 100
    assert snapshot_chunk_end(50, 100, (10, 50, 100, 120)) == 100  # points at/before start or at/after the end


def test_unmarked_request_ends_every_step_at_the_next_point():
    assert snapshot_chunk_end(0, 300, (128, 256)) == 128
    assert snapshot_chunk_end(128, 300, (128, 256)) == 256
    assert snapshot_chunk_end(256, 300, (128, 256)) == 300


def test_last_point_may_fall_inside_the_final_chunk():
    # From 128 the last point 256 is 128 tokens in, a multiple of 64: the final chunk runs through it.
    assert snapshot_chunk_end(128, 300, (128, 256), alignment=64) == 300
    # An earlier point that is not the pass point still ends the step.
    assert snapshot_chunk_end(0, 300, (128, 256), alignment=64) == 128


def test_pass_point_is_passed_and_the_step_ends_at_the_following_point():
    assert snapshot_chunk_end(0, 300, (128, 256), alignment=64, pass_point=128) == 256
    # One snapshot per step: after passing 64, the step stops at 128 even though 128 is aligned.
    assert snapshot_chunk_end(0, 256, (64, 128, 192), alignment=64, pass_point=64) == 128


def test_unaligned_point_193_is_never_crossed():
    # 193 is the last point, but 193 tokens into the step is no multiple of 64: the chunk must stop there.
    assert snapshot_chunk_end(0, 256, (193,), alignment=64) == 193
    assert snapshot_chunk_end(0, 256, (64, 193), alignment=64, pass_point=64) == 193
    # Alignment counts from the step's first token: from 129, 193 is 64 tokens in and can be passed.
    assert snapshot_chunk_end(129, 256, (193,), alignment=64) == 256


@given(
    start=st.integers(0, 300),
    span=st.integers(1, 300),
    points=st.lists(st.integers(1, 700), max_size=6, unique=True).map(sorted),
    alignment=st.none() | st.sampled_from([1, 16, 64]),
    pick=st.integers(0, 5),
)
def test_chunk_end_properties(start, span, points, alignment, pick):
    limit = start + span
    pass_point = points[pick] if alignment is not None and pick < len(points) - 1 else None
    end = snapshot_chunk_end(start, limit, points, alignment, pass_point)
    assert start < end <= limit
    inside = [p for p in points if start < p < end]
    if alignment is None:
        assert inside == []
    else:
        # At most one point is passed per step, and only an aligned last or pass point.
        assert len(inside) <= 1
        for p in inside:
            assert (p - start) % alignment == 0 and p in (points[-1], pass_point)
    # The step is as long as allowed: it stops early only at a snapshot point.
    assert end == limit or end in points


# --- through the scheduler ---------------------------------------------------------------------------------------


class MarkingManager(KVCacheManager):
    """Stands in for the hybrid manager: marks every context request it is asked about, and records the calls."""

    def __init__(self, *a, marks: dict, **kw) -> None:
        super().__init__(*a, **kw)
        self.marks = marks
        self.calls: list[tuple] = []

    def mark_context_request(self, request: Request) -> None:
        self.calls.append((request.request_id, request.num_computed_tokens))
        m = self.marks.get(request.request_id)
        if m is not None:
            request.set_snapshot_marks(m[0], alignment=m[1], pass_point=m[2])


def marking_sched(marks: dict, budget: int, tpb: int = 16) -> tuple[Scheduler, MarkingManager]:
    cfg = KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=256),))
    mgr = MarkingManager(cfg, marks=marks)
    return Scheduler(mgr, SchedulerConfig(max_num_tokens=budget)), mgr


def chunk_ends(s: Scheduler, rid) -> list[int]:
    ends = []
    while s.has_unfinished:
        b, _ = step(s)
        ends += [x.start + x.num_tokens for x in b.context if x.request.request_id == rid]
    return ends


def test_scheduler_stops_before_unaligned_point_193():
    s, _ = marking_sched({"r": ((193,), 64, None)}, budget=256)
    s.add_request(mk("r", 300))
    b = s.schedule()
    # The budget could cross 193, but the manager cannot save a state there mid-step.
    assert ctx(b) == [("r", 0, 193)]
    s.on_step_done(b)
    assert ctx(s.schedule()) == [("r", 193, 107)]


def test_marked_requests_save_steps_and_unmarked_chunk_as_before():
    # Same 300-token prompt, snapshot points 128 (a branch point) and 256 (before the prompt end), budget 512.
    cases = {
        "plain": (None, [128, 256, 300]),  # no marks at all: budget-only chunks
        "ends": (((128, 256), None, None), [128, 256, 300]),  # each point ends a step
        "last": (((128, 256), 64, None), [128, 300]),  # the last point falls inside the final chunk
        "pass": (((128, 256), 64, 128), [256, 300]),  # 128 is passed, the step ends at 256 at the latest
    }
    for rid, (mark, want) in cases.items():
        s, _ = marking_sched({} if mark is None else {rid: mark}, budget=512)
        s.add_request(mk(rid, 300))
        got = chunk_ends(s, rid)
        if mark is None:
            assert got == [300]
        else:
            assert got == want, rid


def test_hook_is_asked_before_every_chunk_is_sized():
    s, mgr = marking_sched({"r": ((40, 80), None, None)}, budget=64)
    s.add_request(mk("r", 100))
    assert chunk_ends(s, "r") == [40, 80, 100]
    assert mgr.calls == [("r", 0), ("r", 40), ("r", 80)]


def test_hand_marked_request_on_a_plain_manager():
    s, mgr = marking_sched({}, budget=1000)
    r = mk("h", 300)
    s.add_request(r)
    # Marks set before the first step (as a manager would at admission) are honoured.
    r.set_snapshot_marks((100, 200), alignment=100, pass_point=100)
    b, _ = step(s)
    assert ctx(b) == [("h", 0, 200)]
    drain(s, mgr)


# --- with the hybrid manager -------------------------------------------------------------------------------------


def hybrid_sched(rec_pages: int = 64):
    hybrid = pytest.importorskip("kvforge.kvcache.hybrid")
    layers = (LayerSpec(0, bytes_per_token=2), LayerSpec(1, LifeCycle.recurrent(), state_bytes=64))
    mgr = hybrid.HybridCacheManager(
        KVCacheConfig(16, layers, (TierConfig(pages=(64, rec_pages)),)), snapshot_interval=64
    )
    return Scheduler(mgr, SchedulerConfig(max_num_tokens=512)), mgr


def test_hybrid_manager_marks_drive_mid_chunk_snapshots_end_to_end():
    s, mgr = hybrid_sched()
    prompt = list(range(1000, 1300))
    r = Request("r", tokens=prompt, max_new_tokens=2)
    s.add_request(r)
    plan = []
    while s.has_unfinished:
        b = s.schedule()
        for x in b.context:
            # The scheduler claimed the pending slot for a step that passes a point.
            assert (x.snapshot_point is not None) == (r.cache.pending_snapshot_slot is not None)
            plan.append((x.start, x.num_tokens, x.snapshot_point))
        s.on_step_done(b)
        mgr.check_invariants()
    # Points every 64 tokens and at 288 (the last block boundary of the prompt), alignment 64: each step passes
    # one point mid-chunk and ends at the next; 288 is 32 tokens past 256, so it ends a step.
    assert plan == [(0, 128, 64), (128, 128, 192), (256, 32, None), (288, 12, None)]
    # The mid-chunk states reached the tree: a prompt sharing 100 tokens reuses up to the snapshot at 64.
    assert mgr.probe_reuse([*prompt[:100], 7, 7, 7]) == 64
    assert mgr.probe_reuse([*prompt[:200], 7, 7, 7]) == 192


def test_without_a_page_for_the_pending_slot_the_step_ends_at_the_point():
    s, mgr = hybrid_sched(rec_pages=1)  # the one recurrent page is the live state
    r = Request("r", tokens=list(range(1000, 1300)), max_new_tokens=1)
    s.add_request(r)
    b = s.schedule()
    assert [(x.start, x.num_tokens, x.snapshot_point) for x in b.context] == [(0, 64, None)]
    assert r.cache.capacity == 64
    s.on_step_done(b)
    mgr.check_invariants()
