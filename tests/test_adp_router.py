"""Attention-DP router: the default min-heap placement, a requested rank, KV-balanced admission with the
library's planner and an injected one (window, plan, candidate groups), forced admission after skipped
rounds, the idle-rank fallback, and plan validation."""

from __future__ import annotations

import pytest

from kvforge.kvcache import RuntimeHooks
from kvforge.scheduling import (
    AttentionDPRouter,
    DefaultKvBalancedPlanner,
    KvBalancedAdmissionPlanner,
    RankState,
    Request,
)


def req(rid, n, rank=None) -> Request:
    return Request(rid, prompt_len=n, attention_dp_rank=rank)


def ranks(*loads, free=None) -> list[RankState]:
    return [RankState(r, t, n, None if free is None else free[r]) for r, (t, n) in enumerate(loads)]


def placed(rnd) -> list[tuple]:
    return [(r.request_id, rank) for r, rank in rnd.assignments]


# --- default: min-heap over (tokens, requests) -----------------------------------------------------------------


def test_min_heap_places_each_request_on_the_least_loaded_rank():
    router = AttentionDPRouter(3)
    for rid, n in [("a", 100), ("b", 50), ("c", 10), ("d", 10)]:
        router.enqueue(req(rid, n))
    rnd = router.route(ranks((30, 1), (0, 0), (20, 1)))
    # a -> rank 1 (0 tokens); b -> rank 2 (20); c -> rank 0 (30); d -> rank 0 (40 < 70 and 100)
    assert placed(rnd) == [("a", 1), ("b", 2), ("c", 0), ("d", 0)]
    assert len(router) == 0


def test_ties_in_tokens_break_on_requests_then_rank():
    router = AttentionDPRouter(3)
    router.enqueue(req("a", 5))
    router.enqueue(req("b", 5))
    assert placed(router.route(ranks((10, 3), (10, 1), (10, 1)))) == [("a", 1), ("b", 2)]


def test_requested_rank_is_honoured_even_when_loaded():
    router = AttentionDPRouter(2)
    router.enqueue(req("x", 10, rank=0))
    router.enqueue(req("y", 10))
    # Rank 0 is far busier, x goes there anyway; y still sees x's load on rank 0.
    assert placed(router.route(ranks((1000, 5), (0, 0)))) == [("x", 0), ("y", 1)]


def test_full_rank_keeps_its_requests_queued():
    router = AttentionDPRouter(2, max_requests_per_rank=2)
    for rid, rank in [("p", 0), ("q", None), ("r", None), ("s", None)]:
        router.enqueue(req(rid, 1, rank))
    rnd = router.route(ranks((0, 2), (0, 0)))
    assert placed(rnd) == [("q", 1), ("r", 1)]
    assert router.queued_ids == ("p", "s")


# --- KV-balanced admission ----------------------------------------------------------------------------------------


def test_default_planner_admits_in_order_to_the_rank_with_most_free_kv():
    router = AttentionDPRouter(2, kv_balanced_admission=True)
    for rid, n in [("a", 600), ("b", 500), ("c", 300), ("d", 10), ("e", 10)]:
        router.enqueue(req(rid, n))
    rnd = router.route(ranks((0, 1), (0, 1), free=[1000, 800]))
    # Window = 2 per rank = 4 candidates. a -> 0 (1000 free, 400 left); b -> 1 (800, 300 left);
    # c (300) -> 0 (400 left beats 300); d -> 1. e is outside the window and untouched.
    assert placed(rnd) == [("a", 0), ("b", 1), ("c", 0), ("d", 1)]
    assert rnd.skipped == () and router.queued_ids == ("e",)
    assert router.skipped_rounds("e") == 0


def test_candidates_that_do_not_fit_are_skipped_and_counted():
    router = AttentionDPRouter(2, kv_balanced_admission=True, max_skipped_rounds=5)
    router.enqueue(req("big", 5000))
    router.enqueue(req("small", 100))
    rnd = router.route(ranks((0, 1), (0, 1), free=[1000, 1000]))
    assert placed(rnd) == [("small", 0)] and rnd.skipped == ("big",)
    assert router.skipped_rounds("big") == 1


def test_forced_admission_after_max_skipped_rounds():
    router = AttentionDPRouter(2, kv_balanced_admission=True, max_skipped_rounds=2)
    router.enqueue(req("big", 5000))
    busy = ranks((500, 3), (100, 2), free=[1000, 1000])
    for expected_skips in (1, 2):
        rnd = router.route(busy)
        assert rnd.assignments == () and router.skipped_rounds("big") == expected_skips
    rnd = router.route(busy)
    # Skipped twice: admitted now, to the least-loaded rank, whatever the plan says.
    assert placed(rnd) == [("big", 1)] and rnd.forced == ("big",)
    assert router.num_forced == 1 and len(router) == 0


def test_idle_rank_gets_the_head_when_nothing_fits():
    router = AttentionDPRouter(2, kv_balanced_admission=True, max_skipped_rounds=10)
    router.enqueue(req("big", 5000))
    rnd = router.route(ranks((500, 3), (0, 0), free=[100, 100]))
    assert placed(rnd) == [("big", 1)] and rnd.forced == ("big",)


def test_kv_balanced_needs_free_kv_tokens():
    router = AttentionDPRouter(2, kv_balanced_admission=True)
    router.enqueue(req("a", 1))
    with pytest.raises(ValueError, match="free_kv_tokens"):
        router.route(ranks((0, 0), (0, 0)))


# --- an injected planner ------------------------------------------------------------------------------------------


class RecordingPlanner:
    """Admits only the candidates it is told to, on the ranks it is told to, and records what it saw."""

    def __init__(self, window: int, decide) -> None:
        self._window = window
        self.decide = decide
        self.calls: list[dict] = []

    def window(self, *, num_ranks: int, queue_len: int) -> int:
        self.calls.append({"window": (num_ranks, queue_len)})
        return self._window

    def plan(self, *, candidates, candidate_groups, ranks):
        self.calls.append({"candidates": [c.request_id for c in candidates], "groups": list(candidate_groups)})
        return self.decide(candidates, ranks)


def test_model_declared_planner_replaces_window_and_plan():
    planner = RecordingPlanner(2, lambda cands, ranks: [(1, 0)])  # admit only the second candidate
    assert isinstance(planner, KvBalancedAdmissionPlanner)
    hooks = RuntimeHooks(kv_balanced_admission_planner=planner)
    router = AttentionDPRouter(2, kv_balanced_admission=True, hooks=hooks)
    assert router.planner is planner
    for rid in "abc":
        router.enqueue(req(rid, 10))
    rnd = router.route(ranks((0, 1), (0, 1), free=[100, 100]))
    assert placed(rnd) == [("b", 0)]
    # The window came from the planner (2 of 3 queued); FCFS puts every candidate in one admission group.
    assert planner.calls[0] == {"window": (2, 3)}
    assert planner.calls[1] == {"candidates": ["a", "b"], "groups": [0, 0]}
    # Queue bookkeeping stays the library's: a was considered and skipped, c was not considered.
    assert router.queued_ids == ("a", "c")
    assert router.skipped_rounds("a") == 1 and router.skipped_rounds("c") == 0
    assert rnd.skipped == ("a",)


def test_forced_admission_still_applies_with_an_injected_planner():
    planner = RecordingPlanner(1, lambda cands, ranks: [])  # never admits anything
    router = AttentionDPRouter(2, kv_balanced_admission=True, planner=planner, max_skipped_rounds=1)
    router.enqueue(req("a", 10, rank=1))
    busy = ranks((10, 1), (10, 1), free=[100, 100])
    assert router.route(busy).assignments == ()
    rnd = router.route(busy)
    assert placed(rnd) == [("a", 1)] and rnd.forced == ("a",)  # its requested rank


def test_explicit_planner_wins_over_hooks_and_default_is_used_otherwise():
    mine = RecordingPlanner(1, lambda c, r: [])
    hooks = RuntimeHooks(kv_balanced_admission_planner=RecordingPlanner(1, lambda c, r: []))
    assert AttentionDPRouter(1, planner=mine, hooks=hooks).planner is mine
    assert isinstance(AttentionDPRouter(1).planner, DefaultKvBalancedPlanner)


@pytest.mark.parametrize(
    ("plan", "exc", "match"),
    [
        ([(0, 1)], ValueError, "asked for rank 0"),  # the requested rank must be honoured
        ([(5, 0)], ValueError, "candidate index 5"),
        ([(0, 0), (0, 0)], ValueError, "repeated"),
        ([(1, 7)], ValueError, "rank 7"),
        ([(0.0, 0)], TypeError, "candidate index"),
        ([0], TypeError, "pair"),
        (None, TypeError, "pairs"),
    ],
)
def test_bad_plans_are_rejected_and_change_nothing(plan, exc, match):
    router = AttentionDPRouter(2, kv_balanced_admission=True, planner=RecordingPlanner(2, lambda c, r: plan))
    router.enqueue(req("a", 10, rank=0))
    router.enqueue(req("b", 10))
    with pytest.raises(exc, match=match):
        router.route(ranks((0, 1), (0, 1), free=[100, 100]))
    assert router.queued_ids == ("a", "b") and router.skipped_rounds("a") == 0


def test_bad_window_is_rejected():
    router = AttentionDPRouter(1, kv_balanced_admission=True, planner=RecordingPlanner(0, lambda c, r: []))
    router.enqueue(req("a", 1))
    with pytest.raises(ValueError, match="window"):
        router.route(ranks((0, 0), free=[10]))


# --- input validation ---------------------------------------------------------------------------------------------


def test_constructor_and_enqueue_validate():
    with pytest.raises(ValueError, match="num_ranks"):
        AttentionDPRouter(0)
    with pytest.raises(TypeError, match="planner"):
        AttentionDPRouter(2, planner=object())
    with pytest.raises(TypeError, match="kv_balanced_admission"):
        AttentionDPRouter(2, kv_balanced_admission=1)
    with pytest.raises(ValueError, match="max_skipped_rounds"):
        AttentionDPRouter(2, max_skipped_rounds=-1)
    router = AttentionDPRouter(2)
    with pytest.raises(ValueError, match="requested_rank"):
        router.enqueue(req("a", 1, rank=2))
    router.enqueue(req("a", 1))
    with pytest.raises(ValueError, match="already queued"):
        router.enqueue(req("a", 1))
    with pytest.raises(ValueError, match="num_tokens"):
        router.enqueue(object(), request_id="x")
    with pytest.raises(ValueError, match="rank 0"):
        router.route([RankState(0), RankState(0)])
    with pytest.raises(ValueError, match="one RankState per rank"):
        router.route([RankState(0)])
    with pytest.raises(TypeError, match="ranks\\[0\\]"):
        router.route([(0, 0), (1, 0)])
    with pytest.raises(ValueError, match="num_tokens"):
        RankState(0, num_tokens=-1)
