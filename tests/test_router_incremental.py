"""State the router keeps up to date instead of recomputing per decision, checked against a recomputation.

- Each server's oldest in-flight request (its weight and when it started), kept by every placement, finish and
  expiry so that a decision reads the backlogs without walking the queues: after random sequences of routes,
  finishes (some failed), clock steps, expiries and membership changes, :meth:`backlogs` equals the estimate
  computed from scratch from what the test itself placed and released.
- :class:`CostGuard`'s choice for a known conversation, which now skips the per-server scores when no other
  server caches any of the prompt, against the documented rule on those float backlogs (fractional weights).
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvforge.kvcache.events import BlockStored  # noqa: E402
from kvforge.routing import ConversationRouter, CostGuard, RouteRequest  # noqa: E402

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
