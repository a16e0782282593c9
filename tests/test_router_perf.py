"""Routing-decision time with a full session table (100,000 conversations), recorded by pytest-benchmark.

No time is asserted (CI machines vary); run ``python -m pytest tests/test_router_perf.py --benchmark-enable -q``
to measure. The garbage collector stays on and nothing collects in setup, so a full collection during the
rounds shows in the mean. The targets (mean <= 1.5 x median, p99 <= 50 µs, per path) are measured by
``bench/bench_router_latency.py``. Each test still checks what was decided.
"""

from __future__ import annotations

import gc
import itertools
import random

import pytest

from kvforge.routing import ConversationRouter, CostGuard, ImbalanceGuard, RouteRequest

SESSIONS = 100_000
BLOCKS = 8
TPB = 128
SERVERS = [f"s{i}" for i in range(8)]
CONFIGS = {
    "specific": {},
    "always+events+guard": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": ImbalanceGuard(),
    },
    "always+events+cost+drain": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": CostGuard(),
        "prefill_tokens_per_s": 10_000.0,
    },
}


def conv_hashes(i: int) -> tuple[int, ...]:
    return tuple(hash((i, j)) for j in range(BLOCKS))


@pytest.fixture(scope="module", params=list(CONFIGS))
def full_router(request: pytest.FixtureRequest) -> ConversationRouter:
    assert gc.isenabled()  # timings are taken with the collector on
    r = ConversationRouter(SERVERS, max_sessions=SESSIONS, **CONFIGS[request.param])
    for i in range(SESSIONS):
        r.route(RouteRequest(i, block_keys=conv_hashes(i), num_tokens=BLOCKS * TPB, conversation_id=f"c{i}"))
        r.finish(i)
    assert r.num_sessions() == SESSIONS
    return r


class _Driver:
    """pedantic() setup: finish the previous request (outside the timing), then build the next one."""

    def __init__(self, router: ConversationRouter, make) -> None:
        self.router = router
        self.make = make
        self.ids = itertools.count()
        self.last = None
        self.decided: list[tuple[RouteRequest, object]] = []

    def setup(self):
        if self.last is not None:
            self.router.finish(self.last.request_id)
        self.last = self.make(next(self.ids))
        return (self.last,), {}

    def route(self, req: RouteRequest):
        server = self.router.route(req)
        self.decided.append((req, server))
        return server


def test_route_known_conversation(benchmark, full_router):
    """A conversation's next turn (one more block), hashes given (the trace-replay path)."""
    rng = random.Random(0)

    def make(k: int) -> RouteRequest:
        i = rng.randrange(SESSIONS)
        hashes = (*conv_hashes(i), hash(("turn", i, k)))
        return RouteRequest(("known", k), block_keys=hashes, num_tokens=(BLOCKS + 1) * TPB, conversation_id=f"c{i}")

    drv = _Driver(full_router, make)
    homes = {}
    benchmark.pedantic(drv.route, setup=drv.setup, rounds=2000, iterations=1, warmup_rounds=0)
    for req, server in drv.decided:
        home = homes.setdefault(req.conversation_id, server)
        assert server == home  # a known conversation sticks (the guard has nothing to fix at this load)
    full_router.finish(drv.last.request_id)
    assert set(full_router.loads().values()) == {0}
    assert full_router.num_sessions() == SESSIONS


def test_route_new_token_request(benchmark, full_router):
    """A new anonymous 2,048-token request, block hashes computed from the token ids (16 blocks)."""
    rng = random.Random(1)
    tokens = [rng.randrange(100_000) for _ in range(2048)]

    def make(k: int) -> RouteRequest:
        return RouteRequest(("new", k), token_ids=[k, *tokens[1:]])

    drv = _Driver(full_router, make)
    benchmark.pedantic(drv.route, setup=drv.setup, rounds=2000, iterations=1, warmup_rounds=0)
    assert all(server in SERVERS for _, server in drv.decided)
    # Each new conversation displaced the least recent one: the table stays at its bound.
    assert full_router.num_sessions() == SESSIONS
    full_router.finish(drv.last.request_id)
    assert set(full_router.loads().values()) == {0}
