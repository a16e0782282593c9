"""Baseline policies (round-robin, least-load, SGLang-like cache-aware) and the router's building blocks: the
per-server prefix index, the block trie and the load ledger."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvforge.kvcache.hashing import block_keys
from kvforge.routing import (
    BlockTrie,
    CacheAwareRouter,
    ConversationRouter,
    LeastLoadRouter,
    LoadLedger,
    RequestInFlightError,
    RoundRobinRouter,
    Router,
    RouteRequest,
    ServerPrefixIndex,
)

TPB = 16


def toks(seed: int, n: int) -> list[int]:
    assert n <= 65536
    return [seed % 65_521 * 65536 + i for i in range(n)]  # token ids stay below 2**32 (block keys)


def req(rid, seed: int, n: int) -> RouteRequest:
    return RouteRequest(rid, token_ids=toks(seed, n))


@pytest.mark.parametrize("cls", [RoundRobinRouter, LeastLoadRouter, CacheAwareRouter, ConversationRouter])
def test_every_policy_has_the_router_interface(cls):
    assert isinstance(cls(["a", "b"]), Router)


def test_round_robin_cycles_and_accounts_whole_prompts():
    r = RoundRobinRouter(["a", "b", "c"], tokens_per_block=TPB)
    assert [r.route(req(i, i, 10 * (i + 1))) for i in range(4)] == ["a", "b", "c", "a"]
    assert r.loads() == {"a": 10 + 40, "b": 20, "c": 30}
    assert r.finish(0) and r.finish(3)
    assert r.loads() == {"a": 0, "b": 20, "c": 30}


def test_least_load_picks_the_server_with_fewest_tokens_in_flight():
    r = LeastLoadRouter(["a", "b", "c"], tokens_per_block=TPB)
    placed = {r.route(req(i, i, n)): n for i, n in enumerate([500, 300, 100])}
    assert sorted(placed.values()) == [100, 300, 500]
    smallest = min(placed, key=placed.get)
    assert r.route(req("next", 9, 50)) == smallest
    with pytest.raises(RequestInFlightError):
        r.route(req("next", 10, 5))


def test_baselines_reclaim_after_the_ttl():
    now = [0.0]
    r = LeastLoadRouter(["a", "b"], request_ttl_s=10.0, clock=lambda: now[0])
    r.route(req("x", 1, 100))
    now[0] = 11.0
    assert not r.finish("x")
    assert set(r.loads().values()) == {0}


def test_cache_aware_prefers_the_longest_match_when_balanced():
    r = CacheAwareRouter(["a", "b", "c"], tokens_per_block=TPB, cache_threshold=0.3)
    home = r.route(req(1, 1, 8 * TPB))
    r.route(req(2, 2, 8 * TPB))  # another server: smallest tree
    # 8 of 10 blocks match on home (0.8 > 0.3): follow it although home has a request in flight.
    assert r.route(RouteRequest(3, token_ids=toks(1, 8 * TPB) + toks(3, 2 * TPB))) == home


def test_cache_aware_low_match_goes_to_the_smallest_tree():
    r = CacheAwareRouter(["a", "b", "c"], tokens_per_block=TPB, cache_threshold=0.5)
    first = r.route(req(1, 1, 8 * TPB))
    second = r.route(req(2, 2, 2 * TPB))
    third = r.route(req(3, 3, 4 * TPB))
    assert len({first, second, third}) == 3  # empty trees first
    # 2 of 10 blocks match ``first`` (0.2 <= 0.5): the smallest tree (``second``, 2 blocks) takes it.
    assert r.route(RouteRequest(4, token_ids=toks(1, 2 * TPB) + toks(4, 8 * TPB))) == second


def test_cache_aware_shortest_queue_when_imbalanced():
    r = CacheAwareRouter(
        ["a", "b"], tokens_per_block=TPB, balance_abs_threshold=2, balance_rel_threshold=1.5, cache_threshold=0.1
    )
    home = r.route(req(0, 1, 4 * TPB))
    for i in range(1, 3):  # the same prefix keeps following home (balanced: 2 - 0 is not above 2)
        assert r.route(RouteRequest(i, token_ids=toks(1, 4 * TPB) + toks(10 + i, TPB))) == home
    # Now 3 in flight there and 0 elsewhere: imbalanced (3 - 0 > 2 and 3 > 1.5 * 0), the shortest queue wins.
    assert r.route(RouteRequest(9, token_ids=toks(1, 4 * TPB) + toks(99, TPB))) != home


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"tree_capacity_blocks": 0}, "capacity_blocks"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
    ],
)
def test_cache_aware_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CacheAwareRouter(["a"], **kwargs)


# ----------------------------------------------------------------------------- building blocks


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2), st.integers(0, 3), st.integers(1, 6)
        ),
        max_size=25,
    ),
    query=st.tuples(st.integers(0, 3), st.integers(0, 8)),
)
def test_prefix_index_matches_a_brute_force_model(ops, query):
    def chain(family: int, n: int) -> list[int]:
        return block_keys(toks(family, n * TPB), TPB)

    index = ServerPrefixIndex(3)
    model: list[set[int]] = [set(), set(), set()]
    for op, server, family, n in ops:
        hs = chain(family, n)
        if op == "store":
            index.store(server, hs)
            model[server].update(hs)
        elif op == "remove":
            index.remove(server, hs[n // 2 :])
            model[server].difference_update(hs[n // 2 :])
        else:
            index.clear(server)
            model[server].clear()
    q = chain(*query)
    expected = []
    for held in model:
        k = 0
        while k < len(q) and q[k] in held:
            k += 1
        expected.append(k)
    assert index.match_lengths(q) == expected
    assert [index.blocks(s) for s in range(3)] == [len(m) for m in model]


def test_prefix_index_lru_capacity_evicts_the_least_recent():
    index = ServerPrefixIndex(2, capacity_blocks=3)
    index.store(0, [1, 2, 3])
    index.store(0, [1])  # refresh 1: 2 is now the oldest
    index.store(0, [4])
    assert [index.contains(0, h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert index.match_lengths([1, 2]) == [1, 0]


def test_trie_reference_counts():
    trie = BlockTrie()
    trie.add([1, 2, 3], owner=7, server=0)
    trie.add([1, 2], owner=8, server=1)
    assert trie.match([1, 2, 3, 4]) == 3
    assert trie.node(1) == (2, 8, 1) and trie.node(3) == (1, 7, 0)
    trie.remove([1, 2, 3])
    assert len(trie) == 2 and trie.node(3) is None
    trie.remove([1, 2])
    assert len(trie) == 0
    with pytest.raises(KeyError):
        trie.remove([1])
    trie.add([5, 5, 6], owner=1, server=0)  # a repeated key counts once per position
    with pytest.raises(KeyError):
        trie.remove([5, 5, 5, 6])  # checked before anything changes
    assert trie.refs(5) == 2 and trie.refs(6) == 1
    with pytest.raises(ValueError, match="owner"):
        trie.add([1], owner="x", server=0)
    with pytest.raises(ValueError, match="server"):
        trie.add([1], owner=1, server=-1)


def test_ledger_reserve_release_expire():
    ledger = LoadLedger(2, ttl_s=10.0)
    ledger.reserve("a", 0, 100, now=0.0)
    ledger.reserve("b", 1, 50, now=5.0)
    with pytest.raises(RequestInFlightError):
        ledger.reserve("a", 1, 1, now=6.0)
    with pytest.raises(ValueError, match="weight"):
        ledger.reserve("c", 1, -1, now=6.0)
    assert ledger.loads == [100, 50]
    assert [r.request_id for r in ledger.expire(10.0)] == ["a"]
    assert ledger.loads == [0, 50]
    assert ledger.release("a") is None
    assert ledger.release("b").weight == 50
    assert ledger.expire(100.0) == []
    assert ledger.loads == [0, 0] and len(ledger) == 0


def test_ledger_heap_stays_bounded_under_churn():
    ledger = LoadLedger(1, ttl_s=1e6)
    for i in range(5000):
        ledger.reserve(i, 0, 1, now=float(i))
        ledger.release(i)
    ledger.reserve("live", 0, 7, now=0.0)
    assert len(ledger._deadlines) <= 2 * len(ledger) + 1024 + 1
    assert [r.request_id for r in ledger.expire(2e6)] == ["live"]


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"num_servers": 0, "ttl_s": 1.0}, "num_servers"), ({"num_servers": 1, "ttl_s": 0}, "ttl_s")]
)
def test_ledger_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LoadLedger(**kwargs)


def test_trie_match_is_the_leading_run_for_chained_keys():
    import random

    rng = random.Random(0)
    for _ in range(300):
        trie = BlockTrie()
        held = rng.randrange(0, 12)
        keys = list(range(100, 100 + rng.randrange(0, 12)))
        trie.add(keys[:held], owner=1, server=0)
        trie.add([7, 8], owner=2, server=0)  # other blocks do not matter
        assert trie.match(keys) == min(held, len(keys))
    trie = BlockTrie()
    trie.add([1, 3], owner=1, server=0)
    assert trie.match([1, 2, 3, 4]) in (1, 3)  # unchained keys: some held block followed by an unheld one
