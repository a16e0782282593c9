"""Property: whatever the sequence of route / finish / fail / expire / cache events, no server's load ever goes
negative, the router's books stay consistent, and every load returns to zero once all requests are finished or
reclaimed."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvforge.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvforge.kvcache.hashing import block_keys  # noqa: E402
from kvforge.routing import (  # noqa: E402
    CacheAwareRouter,
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    LeastLoadRouter,
    RoundRobinRouter,
    RouteRequest,
)

TPB = 4
TTL = 50.0
SERVERS = ("s0", "s1", "s2")


def prompt(family: int, blocks: int, tail: int) -> list[int]:
    # Families share their leading blocks, so prompts of one family match each other at every length.
    return [family * 10_000 + i for i in range(blocks * TPB + tail)]


class RouterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.in_flight: list[str] = []
        self.next_id = 0
        self.late_finishes = 0

    def clock(self) -> float:
        return self.now

    @initialize(
        kind=st.sampled_from(["conversation", "round_robin", "least_load", "cache_aware"]),
        mode=st.sampled_from(["specific", "always"]),
        events=st.booleans(),
        guard=st.sampled_from(
            [None, ImbalanceGuard(), ImbalanceGuard(rel_slack=0.0, abs_slack_tokens=0), CostGuard(), CostGuard(1.0)]
        ),
        max_sessions=st.integers(1, 6),
        min_match=st.integers(0, 2),
        prefill_rate=st.sampled_from([None, 0.5, 1e6]),
    )
    def make(self, kind, mode, events, guard, max_sessions, min_match, prefill_rate):
        self.kind = kind
        common = dict(tokens_per_block=TPB, request_ttl_s=TTL, clock=self.clock)
        if kind == "conversation":
            self.router = ConversationRouter(
                list(SERVERS),
                new_conversation_follow=mode,
                use_cache_events=events,
                imbalance_guard=guard,
                max_sessions=max_sessions,
                new_conversation_min_match_blocks=min_match,
                specific_max_conversations=2,
                prefill_tokens_per_s=prefill_rate,
                **common,
            )
        elif kind == "round_robin":
            self.router = RoundRobinRouter(list(SERVERS), **common)
        elif kind == "least_load":
            self.router = LeastLoadRouter(list(SERVERS), **common)
        else:
            self.router = CacheAwareRouter(
                list(SERVERS), balance_abs_threshold=1, tree_capacity_blocks=8, cache_threshold=0.2, **common
            )

    @rule(
        conv=st.sampled_from([None, "c0", "c1", "c2", "c3"]),
        family=st.integers(0, 2),
        blocks=st.integers(0, 6),
        tail=st.integers(0, TPB - 1),
        by_key=st.booleans(),
    )
    def route(self, conv, family, blocks, tail, by_key):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = RouteRequest(rid, token_ids=prompt(family, blocks, tail), conversation_id=conv)
        if by_key and self.kind == "conversation":
            server = self.router.route_by_key(rid, self.router.routing_key(req))
        else:
            server = self.router.route(req)
        assert server in SERVERS
        self.in_flight.append(rid)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), success=st.booleans())
    def finish(self, data, success):
        rid = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        if not self.router.finish(rid, success):
            self.late_finishes += 1  # only a request reclaimed by the time-to-live may be unknown

    @rule(dt=st.floats(0.0, 1.5 * TTL))
    def advance(self, dt):
        self.now += dt

    @rule()
    def finish_unknown(self):
        assert not self.router.finish("never-routed", False)

    @precondition(lambda self: self.kind == "conversation")
    @rule(
        server=st.sampled_from(SERVERS),
        family=st.integers(0, 2),
        blocks=st.integers(1, 6),
        op=st.sampled_from(["store", "remove", "clear"]),
    )
    def cache_event(self, server, family, blocks, op):
        hashes = tuple(block_keys(prompt(family, blocks, 0), TPB))
        if op == "store":
            ev = BlockStored(hashes, None, TPB)
        elif op == "remove":
            ev = BlockRemoved(hashes[blocks // 2 :])
        else:
            ev = AllBlocksCleared()
        self.router.on_event(server, ev)

    @invariant()
    def books_balance(self):
        loads = self.router.loads()
        assert min(loads.values()) >= 0, loads
        if self.kind == "conversation":
            self.router.sanity_check()
            assert self.late_finishes <= self.router.stats.expired
            # The decision view only ever discounts work actually reserved on that server.
            backlogs = self.router.backlogs()
            assert all(0 <= backlogs[s] <= loads[s] for s in loads), (backlogs, loads)

    def teardown(self):
        for rid in self.in_flight:
            self.router.finish(rid, True)
        assert set(self.router.loads().values()) == {0}, self.router.loads()


class ExpireOnlyMachine(RouterMachine):
    """Same operations, but at the end nothing is finished: the time-to-live must reclaim everything."""

    def teardown(self):
        self.now += TTL + 1
        if self.kind == "conversation":
            self.router.reclaim_expired()
        else:
            self.router.finish("poke")  # baselines reclaim on their next call
        assert set(self.router.loads().values()) == {0}, self.router.loads()


def test_loads_return_to_zero_when_everything_finishes():
    run_state_machine_as_test(RouterMachine, settings=hypothesis.settings(stateful_step_count=30))


def test_loads_return_to_zero_when_everything_expires():
    run_state_machine_as_test(ExpireOnlyMachine, settings=hypothesis.settings(stateful_step_count=30))
