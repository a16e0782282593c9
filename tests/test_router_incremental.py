"""State the router keeps up to date instead of recomputing per decision, checked against a recomputation.

- Each server's oldest in-flight request (its weight and when it started), kept by every placement, finish and
  expiry so that a decision reads the backlogs without walking the queues: after random sequences of routes,
  finishes (some failed), clock steps, expiries and membership changes, :meth:`backlogs` equals the estimate
  computed from scratch from what the test itself placed and released.
- :class:`CostGuard`'s choice for a known conversation, which now skips the per-server scores when no other
  server caches any of the prompt, against the documented rule on those float backlogs (fractional weights).
- The ledger's total load (kept by every reservation, release and expiry) against the sum of the live weights;
  ``BlockTrie.match_fields`` (one call for match + fields) and ``ServerPrefixIndex.held_lengths`` (None for all
  zeros) against the calls they stand for, after random updates, deferred ones included.
- The guards' shortcuts, against the scores computed in full at loads up to and past 2**53: a new conversation
  picked among the integer loads when every score is an exact integer (CostGuard, ImbalanceGuard), and a
  known conversation kept without min(loads) when its score is at most the others' constant term (CostGuard).
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvforge.kvcache.events import BlockStored  # noqa: E402
from kvforge.routing import (  # noqa: E402
    BlockTrie,
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    LoadLedger,
    RouteRequest,
    ServerPrefixIndex,
)
from tests.helpers import pick_min_reference  # noqa: E402

TPB = 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("known"), st.integers(0, 5), st.integers(1, 3), st.integers(0, TPB - 1)),
        st.tuples(st.just("new"), st.integers(1, 4), st.integers(0, 40)),
        st.tuples(st.just("finish"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 0.013, 0.1, 0.7, 3.0])),
        st.tuples(st.just("reclaim")),
        st.tuples(st.just("store"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("avail"), st.integers(0, 3), st.booleans()),
    ),
    max_size=60,
)


@settings(max_examples=250, deadline=None)
@given(
    ops=ops,
    rate=st.sampled_from([7.0, 100.0, 1e4]),
    ttl=st.sampled_from([None, 2.0]),
    weight=st.sampled_from([1.0, 1.5, 16.0]),
)
def test_backlogs_equal_a_recomputation_and_known_conversations_follow_the_cost_rule(
    ops: list[tuple], rate: float, ttl: float | None, weight: float
) -> None:
    servers = ["a", "b", "c", "d"]
    t = [10.0]
    r = ConversationRouter(
        servers,
        tokens_per_block=TPB,
        new_conversation_follow="always",
        use_cache_events=True,
        imbalance_guard=CostGuard(recompute_weight=weight),
        prefill_tokens_per_s=rate,
        request_ttl_s=ttl,
        clock=lambda: t[0],
    )
    placed: dict[str, tuple[int, float, int, int]] = {}  # live request -> (server, placed at, weight, order)
    released = [float("-inf")] * len(servers)  # per server, when its latest request left
    held: list[set[int]] = [set() for _ in servers]  # what each server's events say it caches
    convs: dict[str, tuple[tuple[int, ...], int]] = {}  # id -> (keys, tokens of its latest prompt)
    failed_convs: set[str] = set()  # a failure restores an older baseline: not modelled below
    order = 0

    def note_expired() -> None:
        for rid in [rid for rid in placed if r._ledger.get(rid) is None]:
            released[placed.pop(rid)[0]] = t[0]

    def model_backlogs() -> dict[str, float]:
        loads = r._ledger.loads
        out = {}
        for i, s in enumerate(servers):
            mine = [p for p in placed.values() if p[0] == i]
            load: float = loads[i]
            if mine:
                _, at, w, _ = min(mine, key=lambda p: p[3])
                load = load - min(w, rate * max(0.0, t[0] - max(at, released[i])))
            out[s] = load
        return out

    for step, op in enumerate(ops):
        rid = f"r{step}"
        if op[0] in ("known", "new"):
            if op[0] == "known" and convs:
                cid = sorted(convs)[op[1] % len(convs)]
                old, base = convs[cid]
                keys = old + tuple(step * 100 + j for j in range(op[2]))
                n = len(keys) * TPB + op[3]
            else:
                cid = f"c{step}"
                keys, base = tuple(step * 100 + j for j in range(op[1])), -1
                n = len(keys) * TPB + op[2]
            down = {i for i, s in enumerate(servers) if not r.is_available(s)}
            if len(down) == len(servers):
                continue
            r.reclaim_expired()  # (so that the backlogs read here are those the decision sees)
            note_expired()
            backlogs = r.backlogs()
            target = servers.index(r.session_server(cid)) if base >= 0 else None
            got = r.route(RouteRequest(rid, block_keys=keys, num_tokens=n, conversation_id=cid))
            if target is not None and target not in down and cid not in failed_convs:
                runs = []
                for i, h in enumerate(held):
                    m = 0
                    while m < len(keys) and keys[m] in h:
                        m += 1
                    runs.append(0 if i in down else m)
                unc = [max(n - c * TPB, 0) for c in runs]
                unc[target] = max(n - base, TPB)
                scores = [
                    (float("inf") if i in down else backlogs[s]) + weight * u
                    for i, (s, u) in enumerate(zip(servers, unc))
                ]
                best = target
                for i, v in enumerate(scores):
                    if v < scores[best]:
                        best = i
                assert got == servers[best], (step, scores, target)
            res = r._ledger.get(rid)
            assert res is not None
            placed[rid] = (servers.index(got), t[0], res.weight, order)
            order += 1
            convs[cid] = (keys, n)
        elif op[0] == "finish":
            live = sorted(placed, key=lambda k: placed[k][3])
            if not live:
                continue
            rid = live[op[1] % len(live)]
            if r.finish(rid, success=op[2]):
                released[placed.pop(rid)[0]] = t[0]
            if not op[2]:
                failed_convs.update(convs)  # (which conversation it was does not matter here)
        elif op[0] == "tick":
            t[0] += op[1]
        elif op[0] == "reclaim":
            r.reclaim_expired()
            note_expired()
        elif op[0] == "store":
            if convs:
                keys = convs[sorted(convs)[op[1] % len(convs)]][0]
                r.on_event(servers[op[2]], BlockStored(keys, None, TPB))
                held[op[2]].update(keys)
        else:
            r.set_server_available(servers[op[1]], op[2])
        note_expired()
        assert r.backlogs() == model_backlogs(), step
        note_expired()
        r.sanity_check()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("reserve"), st.integers(0, 15), st.integers(0, 3), st.integers(0, 10**6)),
            st.tuples(st.just("release"), st.integers(0, 15)),
            st.tuples(st.just("expire"), st.floats(0, 20)),
        ),
        max_size=80,
    ),
    ttl=st.sampled_from([None, 5.0]),
)
def test_ledger_total_equals_the_sum_of_live_weights(ops: list[tuple], ttl: float | None) -> None:
    ledger = LoadLedger(4, ttl)
    now = 0.0
    for op in ops:
        if op[0] == "reserve":
            now += 1.0
            if op[1] not in ledger:
                ledger.reserve(op[1], op[2], op[3], now)
        elif op[0] == "release":
            ledger.release(op[1])
        else:
            ledger.expire(now + op[1])
        live = ledger.reservations()
        assert ledger.total == sum(r.weight for r in live) == sum(ledger.loads)


trie_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 12), max_size=6), st.integers(0, 9), st.integers(0, 3)),
        st.tuples(st.just("remove"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("drain"), st.sampled_from([None, 0, 1, 3])),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(ops=trie_ops, probes=st.lists(st.lists(st.integers(0, 12), max_size=7), min_size=1, max_size=6))
def test_match_fields_equals_match_then_fields(ops: list[tuple], probes: list[list[int]]) -> None:
    trie = BlockTrie()
    added: list[tuple[int, ...]] = []

    def check() -> None:
        for p in probes:
            keys = tuple(p)
            m = trie.match(keys)
            want = (0, 0, 0, 0) if m == 0 else (m, *trie.fields(keys[m - 1]))  # type: ignore[misc]
            assert trie.match_fields(keys) == want, (keys, want)

    for op in ops:
        if op[0] == "add":
            trie.add(op[1], op[2], op[3])
            added.append(tuple(op[1]))
        elif op[0] == "remove":
            if added:
                keys = added.pop(op[1] % len(added))
                (trie.remove_deferred if op[2] else trie.remove)(keys)
        else:
            trie.drain(op[1])
        check()
        trie.sanity_check()


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("store"), st.integers(0, 3), st.lists(st.integers(0, 9), max_size=6)),
            st.tuples(st.just("remove"), st.integers(0, 3), st.lists(st.integers(0, 9), max_size=4)),
            st.tuples(st.just("clear"), st.integers(0, 3)),
        ),
        max_size=30,
    ),
    probes=st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=7), st.integers(0, 15)), min_size=1, max_size=6),
)
def test_held_lengths_is_match_lengths_or_none_when_all_zero(ops: list[tuple], probes: list[tuple]) -> None:
    index = ServerPrefixIndex(4)
    for op in ops:
        if op[0] == "store":
            index.store(op[1], op[2])
        elif op[0] == "remove":
            index.remove(op[1], op[2])
        else:
            index.clear(op[1])
        for keys, ignore in probes:
            full = index.match_lengths(keys, ignore)
            got = index.held_lengths(keys, ignore)
            assert got == (full if any(full) else None), (keys, ignore, full, got)
            # Servers outside ``ignore`` read exactly what a plain scan of their blocks gives.
            for s in range(4):
                if not ignore >> s & 1:
                    n = 0
                    while n < len(keys) and index.contains(s, keys[n]):
                        n += 1
                    assert full[s] == n


big = 2**53
load_values = st.one_of(
    st.integers(0, 40),
    st.sampled_from([big - 3, big - 2, big - 1, big, big + 1, big + 2, 3 * big + 1]),
    st.integers(0, 2**60),
)


@settings(max_examples=600, deadline=None)
@given(
    loads=st.lists(load_values, min_size=1, max_size=9),
    down=st.sets(st.integers(0, 8), max_size=3),
    weight=st.sampled_from([1.0, 2.0, 16.0, 1.5, 3]),
    num_tokens=st.one_of(st.integers(0, 5000), st.sampled_from([2**52, 2**53 - 7, 2**53 + 1])),
    rotor=st.integers(0, 30),
    target=st.one_of(st.none(), st.integers(0, 8)),
    own_uncached=st.integers(0, 3000),
)
def test_cost_shortcuts_choose_what_the_full_scores_choose(
    loads: list[int],
    down: set[int],
    weight: float,
    num_tokens: int,
    rotor: int,
    target: int | None,
    own_uncached: int,
) -> None:
    n = len(loads)
    down = {i for i in down if i < n}
    if len(down) == n:
        down.discard(0)
    if target is not None and (target >= n or target in down):
        target = None
    r = ConversationRouter([f"s{i}" for i in range(n)], imbalance_guard=CostGuard(recompute_weight=weight))
    # The ledger's total as a placement would find it (the shortcut reads it: every load is at most the total).
    r._ledger._loads = list(loads)
    r._ledger._total = sum(loads)
    values: list[float] = [math.inf if i in down else v for i, v in enumerate(loads)]  # type: ignore[misc]
    # The documented rule with every score computed (nothing cached elsewhere: each other server scores
    # load + weight * num_tokens).
    extra = weight * num_tokens
    scores = [v + extra for v in values]
    if target is None:
        want = pick_min_reference(scores, rotor)
    else:
        own = values[target] + weight * own_uncached
        scores[target] = own
        m = min(scores)
        want = target if not m < own else scores.index(m)
    r._rotor = rotor
    got = r._choose_by_cost(target, own_uncached, None, num_tokens, values, weight, True)
    assert got == want, (values, extra, target)


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(load_values, min_size=1, max_size=9),
    down=st.sets(st.integers(0, 8), max_size=3),
    num_tokens=st.one_of(st.integers(0, 5000), st.sampled_from([2**53 - 7, 2**53 + 1, 2**70])),
    rotor=st.integers(0, 30),
    always=st.booleans(),
)
def test_guard_new_conversation_shortcut_chooses_what_the_backlogs_choose(
    loads: list[int], down: set[int], num_tokens: int, rotor: int, always: bool
) -> None:
    n = len(loads)
    down = {i for i in down if i < n}
    if len(down) == n:
        down.discard(0)
    r = ConversationRouter(
        [f"s{i}" for i in range(n)],
        new_conversation_follow="always" if always else "specific",
        use_cache_events=True,
        imbalance_guard=ImbalanceGuard(),
    )
    values: list[float] = [math.inf if i in down else v for i, v in enumerate(loads)]  # type: ignore[misc]
    want = pick_min_reference([v + num_tokens for v in values], rotor)
    r._rotor = rotor
    # No affine server, nothing cached anywhere (the lengths looked up: None).
    assert r._choose(None, 0, None, True, 0, (1, 2), num_tokens, values, True) == want
