"""ConversationRouter: defaults, validation, every routing rule, both follow modes, load accounting on the
direct and coordinator paths, failure and time-to-live handling, the INFO counter, cache events and the
imbalance guard."""

from __future__ import annotations

import itertools
import logging

import pytest

from kvforge.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvforge.kvcache.hashing import block_keys
from kvforge.routing import (
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    RequestInFlightError,
    RouterConfig,
    RouteRequest,
    RoutingKey,
)

TPB = 32  # small blocks keep prompts short; the defaults are checked separately


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int) -> list[int]:
    """``n`` token ids unique to ``seed`` (distinct seeds share no block)."""
    assert n <= 65536
    return [seed % 65_521 * 65536 + i for i in range(n)]  # token ids stay below 2**32 (block keys)


def make(servers=("a", "b", "c"), **kw) -> ConversationRouter:
    kw.setdefault("tokens_per_block", TPB)
    kw.setdefault("clock", FakeClock())
    return ConversationRouter(list(servers), **kw)


_fillers = itertools.count(1_000_000)


def occupy(router: ConversationRouter, server: str, tokens: int, rid: str) -> None:
    """Put ``tokens`` of load on ``server`` with an unmatched request that stays in flight (as ``rid``).

    Unmatched requests go to the least-loaded server, so fillers parked on the other servers make ``server``
    the least loaded eventually; they are finished afterwards, leaving only ``rid``.
    """
    before = router.loads()
    parked = []
    for _ in range(1000):
        req = RouteRequest(f"{rid}-{len(parked)}", token_ids=toks(next(_fillers), tokens))
        if router.route(req) == server:
            break
        parked.append(req.request_id)
    else:
        raise AssertionError(f"could not place a filler on {server}")
    for p in parked:
        assert router.finish(p)
    assert router.load(server) == before[server] + tokens
    assert all(router.load(s) == before[s] for s in router.servers if s != server)


# ----------------------------------------------------------------------------- construction


def test_defaults_are_the_reference_systems():
    r = ConversationRouter(["a", "b"])
    c = r.config
    assert (c.tokens_per_block, c.match_threshold, c.max_sessions, c.new_conversation_follow) == (
        128,
        0.75,
        100_000,
        "specific",
    )
    assert RouterConfig() == c


@pytest.mark.parametrize("mode", ["sometimes", "Always", "", None, 1])
def test_bad_follow_mode_is_rejected_at_construction(mode):
    with pytest.raises(ValueError, match="new_conversation_follow"):
        ConversationRouter(["a"], new_conversation_follow=mode)


@pytest.mark.parametrize("threshold", [0, 0.0, -0.1, 1.01, 2, True, "0.5", float("nan")])
def test_bad_threshold_is_rejected_at_construction(threshold):
    with pytest.raises(ValueError, match="match_threshold"):
        ConversationRouter(["a"], match_threshold=threshold)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"tokens_per_block": 0}, ValueError, "tokens_per_block"),
        ({"max_sessions": 0}, ValueError, "max_sessions"),
        ({"new_conversation_min_match_blocks": -1}, ValueError, "new_conversation_min_match_blocks"),
        ({"chars_per_token": 0}, ValueError, "chars_per_token"),
        ({"request_ttl_s": 0}, ValueError, "request_ttl_s"),
        ({"imbalance_guard": 0.5}, TypeError, "imbalance_guard"),
        ({"use_cache_events": 1}, TypeError, "use_cache_events"),
        ({"clock": 3.0}, TypeError, "clock"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        ConversationRouter(["a", "b"], **kwargs)


@pytest.mark.parametrize(("servers", "exc"), [([], ValueError), (["a", "a"], ValueError), ("ab", TypeError)])
def test_bad_server_lists(servers, exc):
    with pytest.raises(exc, match="servers"):
        ConversationRouter(servers)


def test_guard_validates_itself():
    with pytest.raises(ValueError, match="rel_slack"):
        ImbalanceGuard(rel_slack=-1)
    with pytest.raises(ValueError, match="abs_slack_tokens"):
        ImbalanceGuard(abs_slack_tokens=-5)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({}, ValueError, "token_ids, text or block_keys"),
        ({"block_keys": [1, 2]}, ValueError, "num_tokens"),
        ({"token_ids": [1], "text": "x"}, ValueError, "not both"),
        ({"token_ids": [1], "conversation_id": 7}, TypeError, "conversation_id"),
        ({"token_ids": [1], "conversation_id": ""}, ValueError, "conversation_id"),
        ({"text": b"bytes"}, TypeError, "text"),
        ({"block_keys": [1], "num_tokens": -1}, ValueError, "num_tokens"),
    ],
)
def test_request_validation(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        RouteRequest("r", **kwargs)


# ----------------------------------------------------------------------------- routing rules


def test_explicit_conversation_sticks_even_when_its_server_is_busiest():
    r = make()
    first = r.route(RouteRequest("r1", token_ids=toks(1, 100), conversation_id="conv"))
    occupy(r, first, 10_000, "fill")
    assert max(r.loads(), key=r.loads().get) == first
    again = r.route(RouteRequest("r2", token_ids=toks(1, 150), conversation_id="conv"))
    assert again == first
    assert r.stats.sticky == 1


def test_session_table_is_a_bounded_lru():
    r = make(max_sessions=2)
    r.route(RouteRequest("1", token_ids=toks(1, 64), conversation_id="c1"))
    r.route(RouteRequest("2", token_ids=toks(2, 64), conversation_id="c2"))
    r.route(RouteRequest("3", token_ids=toks(1, 96), conversation_id="c1"))  # refreshes c1
    r.route(RouteRequest("4", token_ids=toks(3, 64), conversation_id="c3"))  # evicts c2, the oldest
    assert r.session_server("c2") is None
    assert r.session_server("c1") is not None and r.session_server("c3") is not None
    assert r.num_sessions() == 2
    assert r.stats.evicted_sessions == 1
    r.sanity_check()  # the evicted conversation's blocks left the trie


def test_implicit_match_continues_a_conversation_without_id():
    r = make(new_conversation_min_match_blocks=0)  # only the threshold rule may place it
    prompt = toks(5, 4 * TPB)
    home = r.route(RouteRequest("t1", token_ids=prompt))
    r.finish("t1")
    occupy(r, home, 5_000, "fill")
    # 4 of 5 blocks match (0.8 >= 0.75): the continuation goes home although home is the busiest.
    assert r.route(RouteRequest("t2", token_ids=prompt + toks(6, TPB))) == home
    assert r.stats.implicit == 1
    # 4 of 6 blocks (0.67 < 0.75) is not a continuation, and following is off: least loaded instead.
    assert r.route(RouteRequest("t3", token_ids=prompt + toks(7, 2 * TPB))) != home
    assert r.stats.implicit == 1


def test_no_match_goes_to_the_least_loaded_server():
    r = make()
    occupy(r, "a", 3_000, "fa")
    occupy(r, "b", 1_000, "fb")
    occupy(r, "c", 2_000, "fc")
    assert r.route(RouteRequest("new", token_ids=toks(9, 40))) == "b"


def _shared_preamble_router(mode: str, holders: int, others: int = 0) -> tuple[ConversationRouter, list[int], str]:
    """``holders`` conversations share a 4-block preamble (after ``others`` unrelated ones); returns the router,
    the preamble and the server of the latest holder (which is then made the busiest)."""
    r = make(new_conversation_follow=mode, specific_max_conversations=4)
    for i in range(others):
        r.route(RouteRequest(f"o{i}", token_ids=toks(500 + i, 2 * TPB), conversation_id=f"o{i}"))
        r.finish(f"o{i}")
    pre = toks(100, 4 * TPB)
    last = None
    for i in range(holders):
        last = r.route(RouteRequest(f"h{i}", token_ids=pre + toks(200 + i, TPB), conversation_id=f"h{i}"))
        r.finish(f"h{i}")
    occupy(r, last, 2_000, "busy")
    return r, pre, last


@pytest.mark.parametrize("mode", ["specific", "always"])
def test_prefix_specific_to_few_conversations_is_followed_in_both_modes(mode):
    r, pre, last = _shared_preamble_router(mode, holders=1)
    followed = r.stats.followed
    got = r.route(RouteRequest("n", token_ids=pre + toks(300, TPB), conversation_id="new"))
    assert got == last
    assert r.stats.followed == followed + 1


def test_shared_preamble_spreads_in_specific_mode_and_is_followed_in_always_mode_unless_common():
    # 5 holders among 20 sessions: more than specific_max_conversations, less than one server's share (1/3).
    r, pre, last = _shared_preamble_router("specific", holders=5, others=15)
    followed = r.stats.followed
    assert r.route(RouteRequest("n", token_ids=pre + toks(300, TPB), conversation_id="new")) != last
    assert r.stats.followed == followed
    r, pre, last = _shared_preamble_router("always", holders=5, others=15)
    followed = r.stats.followed
    assert r.route(RouteRequest("n", token_ids=pre + toks(300, TPB), conversation_id="new")) == last
    assert r.stats.followed == followed + 1


@pytest.mark.parametrize("mode", ["specific", "always"])
def test_preamble_in_every_session_is_common_and_spreads_in_both_modes(mode):
    # Every session holds the preamble (and more than specific_max_conversations do): following it would
    # send every new conversation after the latest one, the load collapse of issue 17 section 3.
    r, pre, last = _shared_preamble_router(mode, holders=6)
    followed = r.stats.followed
    assert r.route(RouteRequest("n", token_ids=pre + toks(300, TPB), conversation_id="new")) != last
    assert r.stats.followed == followed


def test_min_match_blocks_gates_following():
    r = make(new_conversation_follow="always", new_conversation_min_match_blocks=3)
    pre = toks(1, 2 * TPB)
    home = r.route(RouteRequest("a", token_ids=pre + toks(2, TPB), conversation_id="a"))
    r.finish("a")
    occupy(r, home, 1_000, "f")
    assert r.route(RouteRequest("b", token_ids=pre + toks(3, TPB), conversation_id="b")) != home


# ----------------------------------------------------------------------------- load accounting


def test_specific_mode_weighs_the_whole_prompt():
    r = make()
    s = r.route(RouteRequest("1", token_ids=toks(1, 300), conversation_id="c"))
    r.route(RouteRequest("2", token_ids=toks(1, 400), conversation_id="c"))
    assert r.load(s) == 700


def test_always_mode_token_backlog_rules():
    r = make(new_conversation_follow="always")
    # Any other request: its whole prompt.
    s = r.route(RouteRequest("1", token_ids=toks(1, 296), conversation_id="c"))
    assert r.load(s) == 296
    # A known conversation: the growth since its previous request...
    r.route(RouteRequest("2", token_ids=toks(1, 396), conversation_id="c"))
    assert r.load(s) == 296 + 100
    # ... and at least one block.
    r.route(RouteRequest("3", token_ids=toks(1, 400), conversation_id="c"))
    assert r.load(s) == 296 + 100 + TPB
    # A followed new conversation: its prompt past the matched prefix (12 full blocks = 384 tokens).
    got = r.route(RouteRequest("4", token_ids=toks(1, 400) + toks(2, 50), conversation_id="fork"))
    assert got == s
    assert r.load(s) == 296 + 100 + TPB + (450 - 12 * TPB)
    for rid in ("1", "2", "3", "4"):
        assert r.finish(rid)
    assert r.loads() == {"a": 0, "b": 0, "c": 0}


def test_known_conversation_with_edited_history_is_charged_past_the_fork():
    r = make(new_conversation_follow="always")
    s = r.route(RouteRequest("1", token_ids=toks(1, 10 * TPB), conversation_id="c"))
    r.finish("1")
    edited = toks(1, 4 * TPB) + toks(2, 7 * TPB)  # same first 4 blocks, then different
    r.route(RouteRequest("2", token_ids=edited, conversation_id="c"))
    assert r.load(s) == 11 * TPB - 4 * TPB


def test_text_requests_weigh_the_same_with_and_without_conversation_id():
    # Review finding: an anonymous text prompt must not be weighed in a different unit than an explicit one.
    r = make(new_conversation_follow="always", chars_per_token=4.0)
    text_a = "".join(chr(0x4E00 + i % 500) for i in range(4000))
    text_b = "".join(chr(0x3040 + i % 90) for i in range(4000))
    sa = r.route(RouteRequest("anon", text=text_a))
    sb = r.route(RouteRequest("named", text=text_b, conversation_id="conv"))
    assert sa != sb  # the second one went to a less-loaded server
    assert r.load(sa) == r.load(sb) == 1000
    assert r.routing_key(RouteRequest("k", text=text_a)).num_tokens == 1000
    # A third, unrelated request is placed on the remaining idle server; then loads drain exactly.
    third = r.route(RouteRequest("x", text="z" * 40))
    assert third not in (sa, sb)
    for rid in ("anon", "named", "x"):
        r.finish(rid)
    assert set(r.loads().values()) == {0}


def test_text_continuation_is_matched_over_code_points():
    r = make(new_conversation_min_match_blocks=0)
    base = "".join(chr(65 + i % 26) for i in range(20 * TPB * 4))
    home = r.route(RouteRequest("1", text=base))
    r.finish("1")
    occupy(r, home, 5_000, "f")
    assert r.route(RouteRequest("2", text=base + "more words")) == home


# ----------------------------------------------------------------------------- coordinator path


def test_routing_key_carries_conversation_and_tokens():
    r = make(new_conversation_follow="always")
    key = r.routing_key(RouteRequest("q", token_ids=toks(1, 296), conversation_id="t::sa:a"))
    assert key.conversation_id == "t::sa:a"
    assert key.num_tokens == 296
    assert key.block_keys == tuple(block_keys(toks(1, 296), TPB))
    assert RoutingKey.from_mapping(key.as_dict()) == key


def test_coordinator_known_conversation_adds_only_its_growth():
    # Review finding: the known-conversation path through routing keys must charge the growth, not the prompt.
    r = make(new_conversation_follow="always")
    first = r.route_by_key("1", r.routing_key(RouteRequest("1", token_ids=toks(1, 296), conversation_id="t::sa:a")))
    occupy(r, first, 20_000, "f")  # the conversation must stick although its server is busiest
    before = r.load(first)
    key = r.routing_key(RouteRequest("2", token_ids=toks(1, 396), conversation_id="t::sa:a"))
    assert r.route_by_key("2", key.as_dict()) == first  # a plain dict, as a coordinator sends it
    assert r.load(first) == before + 100
    assert r.finish_request_by_id("2", success=True)
    assert r.load(first) == before


def test_direct_and_coordinator_paths_agree():
    seq = [("c1", 300), ("c2", 200), ("c1", 500), (None, 700), ("c2", 260), ("c3", 90)]
    direct = make(new_conversation_follow="always")
    coord = make(new_conversation_follow="always")
    for i, (conv, n) in enumerate(seq):
        req = RouteRequest(str(i), token_ids=toks(hash(conv) % 1000 if conv else 99, n), conversation_id=conv)
        assert direct.route(req) == coord.route_by_key(str(i), coord.routing_key(req))
        assert direct.loads() == coord.loads()


@pytest.mark.parametrize("path", ["direct", "coordinator"])
def test_failed_first_request_retry_reserves_the_full_prompt(path):
    # Review finding: a failure left the baseline at 30,000 tokens, so the retry reserved one block.
    r = make(new_conversation_follow="always")
    req = RouteRequest("first", token_ids=toks(1, 30_000), conversation_id="c")

    def place(rid: str) -> str:
        if path == "direct":
            return r.route(RouteRequest(rid, token_ids=req.token_ids, conversation_id="c"))
        return r.route_by_key(rid, r.routing_key(req))

    s = place("first")
    assert r.load(s) == 30_000
    assert r.finish_request_by_id("first", success=False)
    assert r.load(s) == 0
    assert place("retry") == s
    assert r.load(s) == 30_000
    assert r.stats.failed == 1


@pytest.mark.parametrize("path", ["direct", "coordinator"])
def test_failure_does_not_overwrite_a_newer_baseline(path):
    r = make(new_conversation_follow="always")

    def place(rid: str, n: int) -> str:
        req = RouteRequest(rid, token_ids=toks(1, n), conversation_id="c")
        return r.route(req) if path == "direct" else r.route_by_key(rid, r.routing_key(req))

    s = place("A", 1000)
    place("B", 1500)  # +500
    assert r.load(s) == 1500
    r.finish_request_by_id("A", success=False)  # older than B: B's baseline (1500) must survive
    assert r.load(s) == 500
    place("C", 1600)
    assert r.load(s) == 500 + 100  # growth over B's 1500, not over nothing
    # C then B fail: the baseline unwinds past B and past A (failed earlier) to nothing.
    r.finish_request_by_id("C", success=False)
    r.finish_request_by_id("B", success=False)
    assert r.load(s) == 0
    place("D", 1600)
    assert r.load(s) == 1600


def test_failure_chain_unwinds_to_the_full_prompt():
    r = make(new_conversation_follow="always")
    s = r.route(RouteRequest("A", token_ids=toks(1, 1000), conversation_id="c"))
    r.route(RouteRequest("B", token_ids=toks(1, 1500), conversation_id="c"))
    r.finish("B", success=False)  # newest fails first: baseline back to A's 1000
    r.finish("A", success=False)  # then A: back to nothing
    r.route(RouteRequest("R", token_ids=toks(1, 1500), conversation_id="c"))
    assert r.load(s) == 1500


def test_success_keeps_the_baseline():
    r = make(new_conversation_follow="always")
    s = r.route(RouteRequest("A", token_ids=toks(1, 1000), conversation_id="c"))
    r.finish("A", success=True)
    r.route(RouteRequest("B", token_ids=toks(1, 1100), conversation_id="c"))
    assert r.load(s) == 100


# ----------------------------------------------------------------------------- life cycle of a request


def test_duplicate_in_flight_id_is_rejected_without_side_effects():
    r = make()
    r.route(RouteRequest("x", token_ids=toks(1, 100)))
    loads = r.loads()
    with pytest.raises(RequestInFlightError):
        r.route(RouteRequest("x", token_ids=toks(2, 100)))
    with pytest.raises(RequestInFlightError):
        r.route_by_key("x", RoutingKey(None, 5))
    assert r.loads() == loads
    assert r.finish("x") and not r.finish("x")
    assert not r.finish_request_by_id("never-routed")


def test_never_finished_requests_are_reclaimed_after_the_ttl():
    clock = FakeClock()
    r = make(clock=clock, request_ttl_s=30.0)
    s = r.route(RouteRequest("leak", token_ids=toks(1, 500)))
    clock.t += 20
    s2 = r.route(RouteRequest("young", token_ids=toks(2, 300)))
    assert s2 != s  # least loaded
    clock.t += 10.5  # "leak" is 30.5 s old, "young" 10.5 s
    assert r.reclaim_expired() == 1
    assert (r.load(s), r.load(s2)) == (0, 300)
    assert not r.finish("leak")  # a late finish of a reclaimed request changes nothing
    assert (r.load(s), r.load(s2)) == (0, 300)
    clock.t += 25  # "young" is now 35.5 s old: the next routing call reclaims it before placing
    r.route(RouteRequest("other", token_ids=toks(3, 10)))
    assert r.stats.expired == 2
    assert sum(r.loads().values()) == 10


def test_no_ttl_keeps_requests():
    clock = FakeClock()
    r = make(clock=clock, request_ttl_s=None)
    r.route(RouteRequest("x", token_ids=toks(1, 500)))
    clock.t += 1e9
    assert r.reclaim_expired() == 0
    assert sum(r.loads().values()) == 500


def test_info_line_every_256_new_conversations(caplog):
    r = make(new_conversation_follow="always")
    shared = toks(1, 2 * TPB)
    with caplog.at_level(logging.INFO, logger="kvforge.routing"):
        for i in range(512):
            # Every 4th conversation starts with the same 2 blocks; all but the first of them follow a match.
            prompt = (shared if i % 4 == 0 else toks(10 + i, 2 * TPB)) + toks(5000 + i, 8)
            r.route(RouteRequest(i, token_ids=prompt, conversation_id=f"c{i}"))
            r.finish(i)
    lines = [rec for rec in caplog.records if rec.name == "kvforge.routing" and rec.levelno == logging.INFO]
    assert len(lines) == 2
    assert "256 new conversations" in lines[0].getMessage()
    assert "512 new conversations" in lines[1].getMessage()
    assert r.stats.new_conversations == 512
    assert r.stats.followed == 127  # i = 4, 8, ..., 508 (i = 0 created the shared prefix)
    assert f"{r.stats.followed} in total" in lines[1].getMessage()


def test_no_info_line_with_matching_off(caplog):
    r = make(new_conversation_min_match_blocks=0)
    with caplog.at_level(logging.INFO, logger="kvforge.routing"):
        for i in range(300):
            r.route(RouteRequest(i, token_ids=toks(i, 40), conversation_id=f"c{i}"))
    assert not [rec for rec in caplog.records if rec.name == "kvforge.routing"]


# ----------------------------------------------------------------------------- cache events and guard


def test_cache_events_place_a_new_conversation_where_its_prefix_is_cached():
    r = make(new_conversation_follow="always", use_cache_events=True)
    prompt = toks(1, 10 * TPB)
    hashes = block_keys(prompt, TPB)
    # The router never routed this prefix; only server c's cache says it holds the first 8 blocks.
    r.on_event("c", BlockStored(tuple(hashes[:8]), None, TPB))
    occupy(r, "c", 100, "f")
    assert r.cached_blocks("c") == 8
    assert r.route(RouteRequest("1", token_ids=prompt, conversation_id="x")) == "c"
    assert r.load("c") == 100 + 2 * TPB  # charged past the cached 8 blocks
    r.finish("1")
    # Removing blocks 4.. cuts the cached run to 4 blocks; clearing forgets the server entirely.
    r.on_event("c", BlockRemoved(tuple(hashes[4:])))
    assert r.cached_blocks("c") == 4
    r.on_event("c", AllBlocksCleared())
    assert r.cached_blocks("c") == 0
    assert r.route(RouteRequest("2", token_ids=toks(2, 10 * TPB), conversation_id="y")) != "c"


def test_cache_events_break_ties_by_load():
    r = make(new_conversation_follow="always", use_cache_events=True, new_conversation_min_match_blocks=1)
    pre = toks(1, TPB)
    for s in r.servers:
        r.on_event(s, BlockStored(tuple(block_keys(pre, TPB)), None, TPB))
    occupy(r, "a", 900, "fa")
    occupy(r, "b", 100, "fb")
    occupy(r, "c", 500, "fc")
    assert r.route(RouteRequest("1", token_ids=pre + toks(2, TPB), conversation_id="x")) == "b"


def test_events_are_ignored_unless_enabled():
    r = make(new_conversation_follow="always")
    prompt = toks(1, 10 * TPB)
    r.on_event("c", BlockStored(tuple(block_keys(prompt, TPB)), None, TPB))
    assert r.cached_blocks("c") == 0
    occupy(r, "c", 100, "f")
    assert r.route(RouteRequest("1", token_ids=prompt, conversation_id="x")) != "c"


def test_bad_events_are_rejected():
    r = make()
    with pytest.raises(ValueError, match="tokens_per_block"):
        r.on_event("a", BlockStored((1,), None, TPB * 2))
    with pytest.raises(ValueError, match="server"):
        r.on_event("zz", AllBlocksCleared())
    with pytest.raises(TypeError, match="event"):
        r.on_event("a", "stored")


def _guarded(guard: ImbalanceGuard | None, events: bool) -> tuple[ConversationRouter, str, list[int]]:
    r = make(new_conversation_follow="always", use_cache_events=events, imbalance_guard=guard)
    prompt = toks(1, 20 * TPB)
    home = r.route(RouteRequest("t1", token_ids=prompt, conversation_id="conv"))
    r.finish("t1")
    occupy(r, home, 10_000, "busy")
    return r, home, prompt


def test_without_guard_affinity_beats_any_backlog():
    r, home, prompt = _guarded(None, events=False)
    assert r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv")) == home


def test_guard_keeps_affinity_within_the_slack():
    # home: 10,000 + 32 after placing; an idle server: 0 + 672 (whole prompt); limit 672 * 1 + 10,000.
    r, home, prompt = _guarded(ImbalanceGuard(rel_slack=0.0, abs_slack_tokens=10_000), events=False)
    assert r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv")) == home
    assert r.stats.guard_moves == 0


def test_guard_moves_a_conversation_off_an_overloaded_server():
    r, home, prompt = _guarded(ImbalanceGuard(rel_slack=0.5, abs_slack_tokens=1000), events=False)
    moved = r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv"))
    assert moved != home
    assert r.stats.guard_moves == 1
    assert r.load(moved) == 21 * TPB  # the new server has nothing cached: the whole prompt
    assert r.session_server("conv") == moved  # the conversation now lives there
    r.finish("t2")
    r.route(RouteRequest("t3", token_ids=prompt + toks(2, 2 * TPB), conversation_id="conv"))
    assert r.load(moved) == TPB  # and grows there


def test_guard_with_events_prefers_the_near_minimum_server_caching_most():
    r, home, prompt = _guarded(ImbalanceGuard(rel_slack=0.5, abs_slack_tokens=1000), events=True)
    others = [s for s in r.servers if s != home]
    hashes = block_keys(prompt, TPB)
    r.on_event(others[1], BlockStored(tuple(hashes[:12]), None, TPB))
    occupy(r, others[1], 500, "warm")
    # Backlogs after placing: home 10,032; others[0] 0 + 672; others[1] 500 + 288 = 788 (busier, but it
    # caches 12 blocks). Limit 672 * 1.5 + 1000: both others are near the minimum, and the cache decides.
    moved = r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv"))
    assert moved == others[1]
    assert r.load(others[1]) == 500 + 21 * TPB - 12 * TPB


# ----------------------------------------------------------------------------- cost guard and prefill progress


@pytest.mark.parametrize("weight", [0.5, 0, -1, True, "8", float("nan")])
def test_cost_guard_validates_itself(weight):
    with pytest.raises(ValueError, match="recompute_weight"):
        CostGuard(recompute_weight=weight)


@pytest.mark.parametrize("rate", [0, -1.0, True, "100", float("inf"), float("nan")])
def test_bad_prefill_rate_is_rejected(rate):
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        make(prefill_tokens_per_s=rate)


def test_cost_guard_is_accepted_by_the_config():
    assert RouterConfig(imbalance_guard=CostGuard()).imbalance_guard == CostGuard(recompute_weight=16.0)


def test_cost_guard_keeps_affinity_when_the_backlog_gap_is_below_the_recompute_cost():
    # home: 10,000 queued + 32 to compute (one new block); an idle server would compute all 672 tokens.
    # Move iff 10,000 > weight * (672 - 32): at 16 the 10,240 tokens of weighted recomputation outweigh it.
    r, home, prompt = _guarded(CostGuard(recompute_weight=16), events=False)
    assert r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv")) == home
    assert r.stats.guard_moves == 0
    assert r.load(home) == 10_000 + TPB


def test_cost_guard_moves_when_the_gap_exceeds_the_recompute_cost():
    r, home, prompt = _guarded(CostGuard(recompute_weight=8), events=False)  # 8 * 640 = 5,120 < 10,000
    moved = r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv"))
    assert moved != home
    assert r.stats.guard_moves == 1
    assert r.load(moved) == 21 * TPB  # nothing cached there: the whole prompt
    assert r.session_server("conv") == moved


def test_cost_guard_with_events_weighs_what_each_server_caches():
    r, home, prompt = _guarded(CostGuard(recompute_weight=8), events=True)
    others = [s for s in r.servers if s != home]
    r.on_event(others[1], BlockStored(tuple(block_keys(prompt, TPB)[:12]), None, TPB))
    occupy(r, others[1], 500, "warm")
    # Scores: home 10,000 + 8 * 32; others[0] 0 + 8 * 672 = 5,376; others[1] 500 + 8 * 288 = 2,804.
    assert r.route(RouteRequest("t2", token_ids=prompt + toks(2, TPB), conversation_id="conv")) == others[1]
    assert r.load(others[1]) == 500 + 9 * TPB


def test_cost_guard_sends_a_new_conversation_towards_its_cached_prefix():
    r = make(new_conversation_follow="always", use_cache_events=True, imbalance_guard=CostGuard(recompute_weight=2))
    prompt = toks(1, 10 * TPB)
    r.on_event("c", BlockStored(tuple(block_keys(prompt, TPB)[:1]), None, TPB))  # one block: too few to follow
    occupy(r, "c", 400, "busy")
    # Scores load + 2 * uncached: c 400 + 2 * 288 = 976 against an idle server's 2 * 320 = 640: the idle one.
    assert r.route(RouteRequest("1", token_ids=prompt, conversation_id="x")) != "c"
    r2 = make(new_conversation_follow="always", use_cache_events=True, imbalance_guard=CostGuard(recompute_weight=2))
    r2.on_event("c", BlockStored(tuple(block_keys(prompt, TPB)[:1]), None, TPB))
    occupy(r2, "c", 20, "busy")  # c: 20 + 576 = 596 < 640, so the one cached block now decides
    assert r2.route(RouteRequest("1", token_ids=prompt, conversation_id="x")) == "c"


def test_prefill_rate_discounts_the_oldest_request_of_each_server():
    clock = FakeClock()
    r = make(servers=("a", "b"), clock=clock, prefill_tokens_per_s=100.0)
    a = r.route(RouteRequest("1", token_ids=toks(1, 640)))
    b = r.route(RouteRequest("2", token_ids=toks(2, 64)))
    assert {a, b} == {"a", "b"}
    clock.t += 3.0  # 300 tokens of the 640 computed; the 64-token request is done but not yet finished
    assert r.backlogs() == {a: 340.0, b: 0.0}
    assert r.loads() == {a: 640, b: 64}  # the accounting does not guess
    r.route(RouteRequest("3", token_ids=toks(3, 96)))  # joins b (0 + 96 < 340 + 96) though its load says a
    assert r.load(b) == 64 + 96
    assert r.finish("2")  # "3" is b's oldest now, computed since this finish
    clock.t += 0.5
    assert r.backlogs()[b] == 96 - 50.0
    assert r.finish("1") and r.finish("3")
    assert r.backlogs() == r.loads() == {a: 0, b: 0}


def test_prefill_estimate_never_discounts_more_than_the_oldest_request():
    clock = FakeClock()
    r = make(servers=("a",), clock=clock, prefill_tokens_per_s=1e9)  # a wildly high rate
    for i in range(3):
        r.route(RouteRequest(str(i), token_ids=toks(i, 64)))
    clock.t += 10.0
    assert r.backlogs() == {"a": 128.0}  # only the oldest request counts as computed


def test_prefill_queue_stays_bounded_behind_a_stuck_request():
    r = make(servers=("a",), request_ttl_s=None, prefill_tokens_per_s=10.0)
    r.route(RouteRequest("stuck", token_ids=toks(0, 64)))
    for i in range(1, 1000):
        r.route(RouteRequest(i, token_ids=toks(i, 64)))
        r.finish(i)
    assert len(r._queues[0]) <= 2 * r.in_flight() + 65
    assert r.backlogs()["a"] <= 64
