"""The children's token index (``Children.longest_prefix``) answers exactly as the scan it replaced.

The reference is the scan ``PrefixMatcher.match_partial`` did before the index: every child of the node in the
dict's order, the longest common token prefix wins, the first one among equals. Two random drivers compare them:
raw ``Children`` operations (insert, replace a key, delete, pop, set or clear a child's tokens after insertion)
over a three-token alphabet, so shared prefixes and ties are the rule; and a ``KVCacheManager`` serving random
prompts (create, commit part, close or keep open, evict), where every match's partial tail is checked against the
scan at the deepest matched block. ``check_children_index`` runs after every operation.
"""

from __future__ import annotations

import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bench.bench_partial_match import scan as scan_reference  # noqa: E402  (the former scan, kept there once)
from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, LifeCycle, Tier, TierConfig  # noqa: E402
from kvforge.kvcache.invariants import check_children_index  # noqa: E402
from kvforge.kvcache.pools import Block, common_prefix_len  # noqa: E402

TPB = 4


def _tokens(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(3) for _ in range(rng.randint(1, 6)))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120))
def test_children_index_matches_scan(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    root = Block(1, None, -1, 0, None, 1)
    children = root.children
    next_key = 2
    for _ in range(steps):
        op = rng.randrange(8)
        keys = list(children)
        if op <= 1 or not keys:  # insert a new key, with tokens (or none, set later)
            toks = _tokens(rng) if rng.random() < 0.8 else None
            child = Block(next_key, root, 0, len(toks) if toks else TPB, toks, 1)
            children[next_key] = child
            next_key += 1
        elif op == 2:  # a key's block replaced by another (keeps the key's position in the dict)
            k = rng.choice(keys)
            toks = _tokens(rng) if rng.random() < 0.8 else None
            children[k] = Block(k, root, 0, TPB, toks, 1)
        elif op == 3:
            del children[rng.choice(keys)]
        elif op == 4:
            assert children.pop(rng.choice(keys)).key in keys
        elif op == 5:  # tokens set or changed after insertion (the commit path does this)
            children[rng.choice(keys)].tokens = _tokens(rng)
        elif op == 6:
            children[rng.choice(keys)].tokens = None
        else:  # a detached block's tokens change: no index to touch
            k = rng.choice(keys)
            gone = children[k]
            del children[k]
            gone.tokens = _tokens(rng)
            assert gone.key not in children
        check_children_index(root)
        for _ in range(3):
            rem = _tokens(rng)
            got = children.longest_prefix(rem)
            want = scan_reference(root, rem)
            assert got[0] is want[0] and got[1] == want[1], (rem, got, want)


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 2), max_size=40), b=st.lists(st.integers(0, 2), max_size=40))
def test_common_prefix_len(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(tuple(a), tuple(b)) == n


def _config(variant: str) -> KVCacheConfig:
    full = LayerSpec(0, bytes_per_token=2)
    if variant == "full":
        return KVCacheConfig(TPB, (full,), (TierConfig(pages=24),))
    if variant == "full+host":
        return KVCacheConfig(TPB, (full,), (TierConfig(pages=16), TierConfig(Tier.HOST, pages=10)))
    swa = LayerSpec(1, LifeCycle.sliding(window=6, sink_tokens=2), bytes_per_token=2)
    return KVCacheConfig(TPB, (full, swa), (TierConfig(pages=(24, 20)),))


def _check_match(mgr: KVCacheManager, tokens: list[int]) -> None:
    """The partial tail after the deepest full block a prompt matches: index and scan agree (raw and usable)."""
    root = mgr.block_pool.tree.find_root(None)
    if root is None:
        return
    keys = mgr.hasher.block_keys(tokens, TPB, parent=root.key)
    blocks: list[Block] = []
    node = root
    for k in keys:
        child = node.children.get(k)
        if child is None or child.num_tokens != TPB:
            break
        blocks.append(child)
        node = child
    start = len(blocks) * TPB
    if start >= len(tokens):
        return
    rem = tuple(tokens[start : start + TPB])
    want = scan_reference(node, rem)
    got = node.children.longest_prefix(rem)
    assert got[0] is want[0] and got[1] == want[1], (rem, got, want)
    usable = want[0] is not None and mgr.matcher.usable(blocks, len(blocks), want[0], want[1])
    assert mgr.matcher.match_partial(blocks, node, tokens, start, len(tokens)) == (want if usable else (None, 0))


@settings(max_examples=60, deadline=None)
@given(variant=st.sampled_from(["full", "full+host", "full+swa"]), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60))
def test_manager_partial_matches_scan(variant: str, seed: int, n: int) -> None:
    rng = random.Random(seed)
    mgr = KVCacheManager(_config(variant))
    stems = [[rng.randrange(3) for _ in range(rng.randint(0, 3 * TPB))] for _ in range(3)]
    open_caches = []
    for _ in range(n):
        tokens = list(rng.choice(stems)) + [rng.randrange(3) for _ in range(rng.randint(1, 2 * TPB))]
        _check_match(mgr, tokens)
        op = rng.randrange(10)
        if op == 0:
            mgr.evict(0, rng.randint(1, 4))
        elif op == 1 and open_caches:
            open_caches.pop(rng.randrange(len(open_caches))).close()
        else:
            upto = rng.randint(0, len(tokens))
            if not mgr.plan_admission(tokens, capacity=len(tokens), max_reuse_tokens=upto).fits:
                while open_caches:
                    open_caches.pop().close()
                continue
            cache = mgr.create_cache(tokens, capacity=len(tokens), max_reuse_tokens=upto)
            done = cache.num_committed_tokens
            cache.resize(history=len(tokens))
            if upto > done:
                cache.commit(tokens[done:upto])
            if rng.random() < 0.3 and len(open_caches) < 3:
                open_caches.append(cache)
            else:
                cache.close()
        mgr.check_invariants()
        _check_match(mgr, tokens)
