"""Deferred trie updates (``BlockTrie.add`` into recent additions, ``remove_deferred``, ``drain``) answer
exactly as eager ones.

Two levels: the trie against a plain eager model under random add / remove / deferred remove / drain sequences
(keys from a small alphabet, so blocks are shared, repeated within a prompt and re-added while queued), and the
router with deferral (evictions queued, finishes draining a few blocks) against the same router draining every
queued block at once, on random workloads with requests left in flight: same servers, same stats, same books.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvforge.kvcache.events import BlockStored  # noqa: E402
from kvforge.routing import BlockTrie, ConversationRouter, CostGuard, ImbalanceGuard, RouteRequest  # noqa: E402
from kvforge.routing.load import LoadLedger  # noqa: E402
from tests.helpers import pick_min_reference  # noqa: E402

ALPHABET = range(12)


class EagerTrie:
    """The reference: per key [refs, owner, server], removed when no reference is left."""

    def __init__(self) -> None:
        self.nodes: dict[int, list[int]] = {}

    def add(self, keys: tuple[int, ...], owner: int, server: int) -> None:
        for k in keys:
            node = self.nodes.setdefault(k, [0, owner, server])
            node[0] += 1
            node[1], node[2] = owner, server

    def remove(self, keys: tuple[int, ...]) -> None:
        for k in keys:
            self.nodes[k][0] -= 1
            if self.nodes[k][0] == 0:
                del self.nodes[k]

    def can_remove(self, keys: tuple[int, ...]) -> bool:
        return all(self.refs(k) >= n for k, n in Counter(keys).items())

    def refs(self, k: int) -> int:
        return self.nodes[k][0] if k in self.nodes else 0

    def match(self, keys: tuple[int, ...]) -> int:
        m = 0
        while m < len(keys) and keys[m] in self.nodes:
            m += 1
        return m


def agree(trie: BlockTrie, ref: EagerTrie, probes: list[tuple[int, ...]]) -> None:
    trie.sanity_check()
    for k in ALPHABET:
        node = ref.nodes.get(k)
        assert trie.fields(k) == (None if node is None else tuple(node))
        assert trie.node(k) == (None if node is None else tuple(node))
        assert trie.refs(k) == ref.refs(k)
    for keys in probes:
        # match() is exact only for chained keys; on any keys it returns a boundary of held blocks.
        m = trie.match(keys)
        assert m == 0 or keys[m - 1] in ref.nodes
        assert m == len(keys) or keys[m] not in ref.nodes
        if all((keys[i] in ref.nodes) >= (keys[i + 1] in ref.nodes) for i in range(len(keys) - 1)):
            assert m == ref.match(keys)
    assert len(trie) == len(ref.nodes)  # last: it folds the recent additions in


prompts = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=6).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("remove"), prompts),
        st.tuples(st.just("defer"), st.integers(0, 1000)),
        st.tuples(st.just("drain"), st.one_of(st.none(), st.integers(0, 7))),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, probes=st.lists(prompts, min_size=1, max_size=6))
def test_deferred_removals_answer_as_eager_ones(ops: list[tuple], probes: list[tuple[int, ...]]) -> None:
    trie, ref = BlockTrie(), EagerTrie()
    added: list[tuple[int, ...]] = []  # prompts still held, each removable once
    for i, op in enumerate(ops):
        if op[0] == "add":
            trie.add(op[1], op[2], op[3])
            ref.add(op[1], op[2], op[3])
            added.append(op[1])
            if i % 3 == 0:
                # Read before anything folds the addition in (agree() below also ends with a fold).
                assert trie.fields(op[1][0]) == tuple(ref.nodes[op[1][0]]) if op[1] else True
                assert not op[1] or trie._recent
        elif op[0] == "remove":
            if ref.can_remove(op[1]):
                trie.remove(op[1])
                ref.remove(op[1])
                if op[1] in added:
                    added.remove(op[1])
            else:
                before = (dict(trie._nodes), len(trie), trie.pending_removals)
                with pytest.raises(KeyError):
                    trie.remove(op[1])
                assert (dict(trie._nodes), len(trie), trie.pending_removals) == before
        elif op[0] == "defer":
            # Only a prompt the trie still holds as a whole (what the router queues: an evicted session's).
            held = [p for p in added if ref.can_remove(p)]
            if held:
                p = held[op[1] % len(held)]
                added.remove(p)
                trie.remove_deferred(list(p))  # a list: the queue must keep its own copy
                ref.remove(p)
        else:
            pending = trie.pending_removals
            taken = trie.drain(op[1])
            assert taken == (pending if op[1] is None else min(op[1], pending))
            assert trie.pending_removals == pending - taken
        agree(trie, ref, probes)
    trie.drain()
    assert trie.pending_removals == 0
    assert {k: (v & 0xFFFFFFFF, v >> 64, (v >> 32) & 0xFFFFFFFF) for k, v in trie._nodes.items()} == {
        k: tuple(n) for k, n in ref.nodes.items()
    }


def test_drain_rejects_a_bad_budget() -> None:
    trie = BlockTrie()
    trie.add((1, 2), 0, 0)
    trie.remove_deferred((1, 2))
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="budget"):
            trie.drain(bad)  # type: ignore[arg-type]
    assert trie.pending_removals == 2 and len(trie) == 0 and trie.match((1, 2)) == 0


def test_a_partly_drained_prompt_keeps_its_place_in_the_queue() -> None:
    trie = BlockTrie()
    trie.add((1, 2, 3), 0, 0)
    trie.add((4, 5), 1, 1)
    trie.remove_deferred((1, 2, 3))
    trie.remove_deferred((4, 5))
    assert trie.drain(2) == 2  # 1 and 2 gone from the dict; 3 still queued
    assert set(trie._nodes) == {3, 4, 5} and len(trie) == 0
    trie.add((3,), 7, 2)  # re-added while its old reference is queued
    assert trie.fields(3) == (1, 7, 2) and trie.match((3, 4)) == 1
    assert trie.drain(None) == 3
    assert trie._nodes == {3: 1 | 2 << 32 | 7 << 64}
    trie.sanity_check()


def _workload(seed: int, steps: int) -> list[tuple]:
    """Routes (new, known with and without id, edited histories), finishes, failures and cache events,
    with requests left in flight so that evictions queue up between finishes."""
    rng = random.Random(seed)
    convs: dict[str, list[int]] = {}
    in_flight: list[str] = []
    out: list[tuple] = []
    for i in range(steps):
        r = rng.random()
        if r < 0.25 and in_flight:
            out.append(("finish", in_flight.pop(rng.randrange(len(in_flight))), rng.random() < 0.8))
            continue
        if r < 0.32:
            server = f"s{rng.randrange(3)}"
            keys = rng.choice(list(convs.values())) if convs else [rng.randrange(50)]
            out.append(("event", server, tuple(keys[: rng.randint(1, len(keys))])))
            continue
        rid = f"r{i}"
        if convs and r < 0.75:
            cid = rng.choice(list(convs))
            keys = convs[cid]
            if rng.random() < 0.15:
                keys = [*keys[: rng.randint(1, len(keys))], rng.randrange(10**6)]  # an edited history
            else:
                keys = keys + [rng.randrange(10**6) for _ in range(rng.randint(1, 3))]
            convs[cid] = keys
            out.append(("route", rid, cid if rng.random() < 0.6 else None, tuple(keys)))
        else:
            cid = f"c{i}"
            shared = [7, 8] if rng.random() < 0.5 else []  # a common preamble
            keys = shared + [rng.randrange(10**6) for _ in range(rng.randint(1, 12))]
            convs[cid] = keys
            out.append(("route", rid, cid if rng.random() < 0.5 else None, tuple(keys)))
        in_flight.append(rid)
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"new_conversation_follow": "always"},
        {"new_conversation_follow": "always", "use_cache_events": True, "imbalance_guard": ImbalanceGuard(0.0, 0)},
        {
            "new_conversation_follow": "always",
            "use_cache_events": True,
            "imbalance_guard": CostGuard(),
            "prefill_tokens_per_s": 50.0,
        },
    ],
    ids=["specific", "always", "events+guard", "events+cost+drain"],
)
@pytest.mark.parametrize("drain_per_finish", [0, 3, 256])
def test_router_with_deferred_eviction_decides_as_an_eager_one(cfg: dict, drain_per_finish: int) -> None:
    t = [0.0]
    routers = [
        ConversationRouter(["s0", "s1", "s2"], tokens_per_block=4, max_sessions=5, clock=lambda: t[0], **cfg)
        for _ in range(2)
    ]
    lazy, eager = routers
    lazy._drain_per_finish = drain_per_finish
    lazy._pending_cap = 20
    eager._pending_cap = 0  # every queued block taken off in the decision that queued it (and see below)
    deferred_seen = 0
    for step in _workload(seed=drain_per_finish, steps=600):
        t[0] += 0.01
        got = []
        for r in routers:
            if step[0] == "route":
                _, rid, cid, keys = step
                got.append(r.route(RouteRequest(rid, block_keys=keys, num_tokens=4 * len(keys), conversation_id=cid)))
            elif step[0] == "finish":
                got.append(r.finish(step[1], success=step[2]))
            else:
                r.on_event(step[1], BlockStored(step[2], None, 4))
        assert not got or got[0] == got[1], step
        eager._trie.drain()  # the reference applies every update before the next call
        deferred_seen = max(deferred_seen, lazy._trie.pending_removals)
        assert eager._trie.pending_removals == 0
        assert lazy.loads() == eager.loads() and lazy.backlogs() == eager.backlogs()
    assert lazy.stats == eager.stats
    assert lazy.stats.evicted_sessions > 0
    assert deferred_seen > 0  # the workload did leave evictions queued across decisions
    lazy.sanity_check()
    eager.sanity_check()
    assert lazy._trie.pending_removals <= 20
    lazy._trie.drain()
    assert lazy._trie._nodes == eager._trie._nodes


def test_finish_drains_what_an_eviction_queued() -> None:
    r = ConversationRouter(["a", "b"], tokens_per_block=4, max_sessions=1)
    r.route(RouteRequest("x", block_keys=(1, 2, 3), num_tokens=12))
    r.finish("x")
    r.route(RouteRequest("y", block_keys=(4, 5), num_tokens=8))  # evicts x's session
    assert r._trie.pending_removals == 3 and len(r._trie) == 2 and r._trie.match((1, 2, 3)) == 0
    r.sanity_check()
    r.finish("y")
    assert r._trie.pending_removals == 0 and set(r._trie._nodes) == {4, 5}


def test_ledger_heap_stays_near_the_live_set_when_requests_finish_in_order() -> None:
    ledger = LoadLedger(2, ttl_s=10.0)
    sizes = []
    for i in range(5000):
        ledger.reserve(i, i % 2, 3, float(i))
        if i >= 2:
            ledger.release(i - 2)
        sizes.append(len(ledger._deadlines))
    assert max(sizes) <= 4  # no build-up to the 1,024-entry rebuild
    assert len(ledger) == 2
    assert [r.request_id for r in ledger.expire(5000.0 + 10.0)] == [4998, 4999]
    assert ledger.loads == [0, 0]


@settings(max_examples=500, deadline=None)
@given(
    values=st.lists(st.sampled_from([0, 0.0, -0.0, 1, 1.0, 2.5, float("inf"), 1e16, 1e16 + 2]), min_size=1, max_size=9),
    rotor=st.integers(0, 40),
)
def test_pick_min_takes_the_first_minimum_from_the_rotor(values: list[float], rotor: int) -> None:
    r = ConversationRouter(["a"])
    r._rotor = rotor
    assert r._pick_min(list(values)) == pick_min_reference(values, rotor)
    assert r._rotor == pick_min_reference(values, rotor) + 1
