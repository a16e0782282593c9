"""The guards' decisions for known conversations, checked against the rules written out in the tests (an
independent reference: what :class:`ImbalanceGuard` and :class:`CostGuard` document), on random fleets with
random loads and random cache events; and the event index is not read when the affine server keeps a request
within the imbalance bound.
"""

from __future__ import annotations

import random

import pytest

from kvforge.kvcache.events import BlockRemoved, BlockStored
from kvforge.routing import ConversationRouter, CostGuard, ImbalanceGuard, RouteRequest

TPB = 16
SERVERS = ["a", "b", "c", "d"]


def _held_run(held: set[int], keys: list[int]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def _expected(guard, loads: list[int], cached: list[int], target: int, n: int, base: int) -> int:
    uncached = [max(n - c * TPB, 0) for c in cached]
    uncached[target] = max(n - base, TPB)  # a known conversation: its growth, at least one block
    if isinstance(guard, CostGuard):
        scores = [load + guard.recompute_weight * u for load, u in zip(loads, uncached)]
        best = target
        for s, v in enumerate(scores):
            if v < scores[best]:
                best = s
        return best
    backlog = [load + u for load, u in zip(loads, uncached)]
    limit = min(backlog) * (1.0 + guard.rel_slack) + guard.abs_slack_tokens
    if backlog[target] <= limit:
        return target
    near = [s for s in range(len(backlog)) if backlog[s] <= limit]
    return min(near, key=lambda s: (-cached[s], backlog[s]))


@pytest.mark.parametrize(
    "guard",
    [
        ImbalanceGuard(),
        ImbalanceGuard(rel_slack=0.0, abs_slack_tokens=0),
        ImbalanceGuard(rel_slack=0.3, abs_slack_tokens=40),
        CostGuard(),
        CostGuard(recompute_weight=1.0),
        CostGuard(recompute_weight=3.5),
    ],
    ids=["imb-default", "imb-tight", "imb-mid", "cost-16", "cost-1", "cost-3.5"],
)
@pytest.mark.parametrize("seed", range(3))
def test_known_conversations_follow_the_documented_guard_rules(guard, seed: int) -> None:
    rng = random.Random(seed)
    r = ConversationRouter(
        SERVERS,
        tokens_per_block=TPB,
        new_conversation_follow="always",
        use_cache_events=True,
        imbalance_guard=guard,
        request_ttl_s=None,
    )
    held: list[set[int]] = [set() for _ in SERVERS]
    convs: dict[str, tuple[list[int], int]] = {}  # id -> (keys of the whole conversation, tokens of last prompt)
    in_flight: list[str] = []
    moves = 0
    for step in range(300):
        if in_flight and rng.random() < 0.45:
            assert r.finish(in_flight.pop(rng.randrange(len(in_flight))))
        if rng.random() < 0.3:  # a server stores or drops a random prefix of a random conversation
            cid = rng.choice(list(convs)) if convs else None
            if cid is not None:
                s = rng.randrange(len(SERVERS))
                keys = convs[cid][0][: rng.randint(1, len(convs[cid][0]))]
                if rng.random() < 0.75:
                    r.on_event(SERVERS[s], BlockStored(tuple(keys), None, TPB))
                    held[s].update(keys)
                else:
                    r.on_event(SERVERS[s], BlockRemoved(tuple(keys[-2:])))
                    held[s].difference_update(keys[-2:])
        rid = f"r{step}"
        if not convs or rng.random() < 0.25:
            cid = f"c{len(convs)}"
            keys = [rng.getrandbits(64) for _ in range(rng.randint(1, 6))]
            n = len(keys) * TPB + rng.randrange(TPB)
            r.route(RouteRequest(rid, block_keys=keys, num_tokens=n, conversation_id=cid))
            convs[cid] = (keys, n)
        else:
            cid = rng.choice(list(convs))
            old_keys, base = convs[cid]
            keys = old_keys + [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
            n = len(keys) * TPB + rng.randrange(TPB)
            loads = [r.load(s) for s in SERVERS]
            target = SERVERS.index(r.session_server(cid))
            cached = [_held_run(h, keys) for h in held]
            want = _expected(guard, loads, cached, target, n, base)
            got = r.route(RouteRequest(rid, block_keys=keys, num_tokens=n, conversation_id=cid))
            assert got == SERVERS[want], (step, loads, cached, target, n, base)
            moves += want != target
            convs[cid] = (keys, n)
        in_flight.append(rid)
    r.sanity_check()
    if guard in (ImbalanceGuard(rel_slack=0.0, abs_slack_tokens=0), CostGuard(recompute_weight=1.0)):
        assert moves > 0  # the tight guards do move conversations: both branches were compared


def test_the_event_index_is_not_read_when_the_affine_server_keeps_the_request() -> None:
    r = ConversationRouter(
        SERVERS, tokens_per_block=TPB, new_conversation_follow="always", use_cache_events=True,
        imbalance_guard=ImbalanceGuard(rel_slack=0.0, abs_slack_tokens=100),
    )  # fmt: skip
    keys = [1, 2, 3]
    home = r.route(RouteRequest("1", block_keys=keys, num_tokens=3 * TPB, conversation_id="x"))
    r.on_event(home, BlockStored(tuple(keys), None, TPB))
    r.finish("1")
    index = r._cache_index
    calls = []
    real = index.match_lengths
    index.match_lengths = lambda k, *a: calls.append(k) or real(k, *a)  # type: ignore[method-assign]
    assert r.route(RouteRequest("2", block_keys=[*keys, 4], num_tokens=4 * TPB, conversation_id="x")) == home
    assert calls == []  # within the bound (16 + 0 <= 0 + 100): no server's cache needs comparing
    r.finish("2")
    # Far past the bound: the guard compares every server, which needs what each one caches.
    other = next(s for s in SERVERS if s != home)
    r.on_event(other, BlockStored(tuple([*keys, 4]), None, TPB))
    r.route(RouteRequest("big", block_keys=[*keys, 4, 5], num_tokens=5 * TPB + 9000, conversation_id="x"))
    assert len(calls) == 1


def test_match_lengths_are_exact_except_for_ignored_servers_which_read_0() -> None:
    from kvforge.routing.trie import ServerPrefixIndex

    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 9)
        index = ServerPrefixIndex(n)
        universe = list(range(rng.randint(1, 12)))
        for s in range(n):
            index.store(s, [k for k in universe if rng.random() < 0.7])
        keys = [rng.choice([*universe, 99]) for _ in range(rng.randint(0, 10))]
        exact = []
        for s in range(n):
            m = 0
            while m < len(keys) and index.contains(s, keys[m]):
                m += 1
            exact.append(m)
        assert index.match_lengths(keys) == exact
        ignore = rng.getrandbits(n)
        got = index.match_lengths(keys, ignore)
        for s in range(n):
            if ignore >> s & 1:
                assert got[s] == 0  # not needed by the caller: not looked up
            else:
                assert got[s] == exact[s], (keys, ignore, s)
