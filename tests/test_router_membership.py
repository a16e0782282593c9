"""Membership changes in place: add_server / remove_server / set_server_available on every router.

A server out of rotation gets no new request; its conversations move on their next request and stick there;
requests in flight on it finish exactly; its event index is dropped on removal and kept while unavailable; a
server added again starts empty. Bad calls are in tests/test_hostile_router.py (with random sequences).
"""

from __future__ import annotations

import pytest

from kvforge.kvcache.events import BlockStored
from kvforge.routing import (
    CacheAwareRouter,
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    LeastLoadRouter,
    RoundRobinRouter,
    RouteRequest,
)

TPB = 4


def req(rid, conv, n_blocks, first=100):
    return RouteRequest(
        rid, block_keys=list(range(first, first + n_blocks)), num_tokens=TPB * n_blocks, conversation_id=conv
    )


def conv_router(**kw) -> ConversationRouter:
    kw.setdefault("tokens_per_block", TPB)
    return ConversationRouter(["a", "b", "c"], **kw)


def stuck(r: ConversationRouter, conv: str = "x") -> str:
    s = r.route(req(f"{conv}0", conv, 2))
    r.finish(f"{conv}0")
    return s


@pytest.mark.parametrize("guard", [None, ImbalanceGuard(), CostGuard()])
@pytest.mark.parametrize("mode", ["specific", "always"])
def test_removing_and_adding_an_unrelated_server_keeps_the_conversation(guard, mode):
    r = conv_router(imbalance_guard=guard, new_conversation_follow=mode)
    home = stuck(r)
    other = next(s for s in r.servers if s != home)
    sessions = r.num_sessions()
    r.remove_server(other)
    assert r.route(req(1, "x", 3)) == home
    r.finish(1)
    r.add_server(other)
    assert r.servers[-1] == other and r.load(other) == 0
    assert r.route(req(2, "x", 4)) == home
    r.finish(2)
    assert r.num_sessions() == sessions  # nothing started over
    r.sanity_check()


@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("mode", ["specific", "always"])
def test_a_conversation_moves_once_when_its_server_leaves_and_then_sticks(mode, events):
    r = conv_router(new_conversation_follow=mode, use_cache_events=events)
    home = stuck(r)
    r.set_server_available(home, False)
    assert home not in r.available_servers() and home in r.servers
    moved = r.route(req(1, "x", 3))
    assert moved != home and r.session_server("x") == moved
    r.finish(1)
    # Its new server now holds the whole prompt: "always" weighs the next turn by its growth (one block).
    r.set_server_available(home, True)
    for i, n in enumerate((4, 5, 6), 2):
        assert r.route(req(i, "x", n)) == moved
        if mode == "always":
            assert r.load(moved) == TPB
        r.finish(i)
    r.sanity_check()


def test_a_moved_conversation_is_weighed_by_its_whole_prompt_on_the_new_server():
    r = conv_router(new_conversation_follow="always")
    home = stuck(r)
    assert r.route(req(1, "x", 3)) == home and r.load(home) == TPB  # growth only
    r.finish(1)
    r.remove_server(home)
    moved = r.route(req(2, "x", 4))
    assert moved != home and r.load(moved) == 4 * TPB  # nothing cached there
    r.finish(2, success=False)  # the failure restores the baseline on its new server: the whole prompt again
    assert r.route(req(3, "x", 4)) == moved and r.load(moved) == 4 * TPB
    r.finish(3)
    r.sanity_check()


@pytest.mark.parametrize("how", ["remove", "unavailable"])
def test_requests_in_flight_on_a_leaving_server_finish_exactly(how):
    r = conv_router(new_conversation_follow="always")
    home = stuck(r)
    assert r.route(req(1, "x", 3)) == home
    r.route(req(2, "y", 5, first=500))
    if how == "remove":
        r.remove_server(home)
    else:
        r.set_server_available(home, False)
    assert r.in_flight() == 2
    moved = r.route(req(3, "x", 4))
    assert moved != home
    assert r.finish(1, success=False)  # superseded by request 3: leaves the baseline alone
    assert r.finish(3) and r.finish(2)
    assert r.in_flight() == 0 and set(r._ledger.loads) == {0}
    r.sanity_check()


def test_a_server_added_again_starts_empty_and_late_finishes_do_not_touch_it():
    r = conv_router(use_cache_events=True)
    r.on_event("a", BlockStored((1, 2, 3), None, TPB))
    r.on_event("b", BlockStored((1, 2), None, TPB))
    r.set_server_available("a", False)
    assert r.cached_blocks("a") == 3  # kept while merely out of rotation
    r.set_server_available("a", True)
    # A new conversation over that prefix follows the events to "a".
    assert r.route(RouteRequest("old", block_keys=[1, 2, 3, 4], num_tokens=16)) == "a"
    r.remove_server("a")
    with pytest.raises(ValueError, match="server"):
        r.cached_blocks("a")
    with pytest.raises(ValueError, match="server"):
        r.on_event("a", BlockStored((9,), None, TPB))
    r.add_server("a")
    assert r.cached_blocks("a") == 0 and r.load("a") == 0 and r.servers == ("b", "c", "a")
    assert r.cached_blocks("b") == 2  # the others' indexes survive
    assert r.finish("old")  # the earlier membership's request: its load was never the newcomer's
    assert r.load("a") == 0 and set(r._ledger.loads) == {0}
    # Now "b" holds the longest prefix.
    assert r.route(RouteRequest("new", block_keys=[1, 2, 3, 4], num_tokens=16)) == "b"
    r.sanity_check()


def test_no_new_request_goes_to_a_server_out_of_rotation():
    r = conv_router(new_conversation_follow="always", use_cache_events=True, imbalance_guard=CostGuard())
    r.on_event("c", BlockStored(tuple(range(100, 110)), None, TPB))
    r.set_server_available("c", False)
    got = {r.route(req(i, None if i % 2 else f"k{i}", 1 + i % 9)) for i in range(60)}
    assert got == {"a", "b"}
    r.set_server_available("c", True)
    assert r.route(req("back", None, 8)) == "c"  # it kept its index: the prefix follows it again
    r.sanity_check()


@pytest.mark.parametrize("cls", [RoundRobinRouter, LeastLoadRouter, CacheAwareRouter])
def test_baseline_routers_skip_servers_out_of_rotation(cls):
    r = cls(["a", "b", "c"], tokens_per_block=TPB)
    r.set_server_available("b", False)
    got = [r.route(req(i, None, 2, first=10 * i)) for i in range(12)]
    assert set(got) == {"a", "c"}
    r.remove_server("a")
    r.add_server("d")
    got = [r.route(req(100 + i, None, 2, first=10 * i)) for i in range(12)]
    assert set(got) == {"c", "d"} and r.servers == ("b", "c", "d")
    for rid in [*range(12), *range(100, 112)]:
        assert r.finish(rid)
    assert set(r._ledger.loads) == {0} and r.loads() == {"b": 0, "c": 0, "d": 0}


def test_round_robin_takes_turns_over_the_servers_in_rotation():
    r = RoundRobinRouter(["a", "b", "c", "d"], tokens_per_block=TPB)
    r.set_server_available("b", False)
    assert [r.route(req(i, None, 1)) for i in range(6)] == ["a", "c", "d", "a", "c", "d"]


def test_membership_round_trip_leaves_decisions_unchanged():
    # Taking a server out and back with nothing in between changes no later decision.
    def trace(toggle: bool) -> list:
        r = conv_router(new_conversation_follow="always", imbalance_guard=ImbalanceGuard())
        if toggle:
            r.set_server_available("b", False)
            r.set_server_available("b", True)
        out = []
        for i in range(40):
            out.append(r.route(req(i, f"c{i % 7}" if i % 3 else None, 1 + i % 5, first=(i % 4) * 10)))
            if i % 2:
                r.finish(i - 1)
        return out

    assert trace(True) == trace(False)
