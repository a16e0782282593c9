"""Regressions of issue 17 (block identity, cache and scheduler defects): each test failed on the code at 0475e71."""

from __future__ import annotations

import pytest

from kvforge.kvcache import HybridCacheManager, KVCacheConfig, KVCacheManager, LayerSpec, LifeCycle, TierConfig
from kvforge.kvcache.hashing import BlockKeyHasher
from kvforge.scheduling import Request, RequestState
from tests.test_scheduler import assert_nothing_held, drain, make_sched


def test_prompt_len_alone_is_accepted_and_runs() -> None:
    # Documented as valid ("prompt_len alone"), but add_request refused it: 0 keys for 25 full blocks.
    s, mgr = make_sched(pages=64)
    req = Request("anon", prompt_len=100, max_new_tokens=3)
    assert req.keyless and req.known_tokens() == 0
    s.add_request(req)
    drain(s, mgr)
    assert req.state is RequestState.DONE and req.num_generated == 3
    assert mgr.tree.num_blocks == 0  # nothing to key, nothing committed
    assert_nothing_held(mgr)


# --- block identity (issue 17, section 1) ------------------------------------------------------------------------

TPB = 4


def _mgr(pages: int = 64) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)))


def _fill(mgr: KVCacheManager, tokens, **kw) -> None:
    cache = mgr.create_cache(tokens, **kw)
    n = len(tokens)
    assert cache.resize(capacity=n, history=n)
    cache.commit(list(tokens[cache.num_committed_tokens :]))
    cache.close()


@pytest.mark.parametrize(
    "first, second, exc",
    [
        ([-1] * 8, [-2] * 8, ValueError),  # hash(-1) == hash(-2): the -2 prompt reused the -1 prompt's KV
        ([5] * 8, [5 + (2**61 - 1)] * 8, ValueError),  # ids congruent mod 2**61 - 1 hashed alike
        ([1] * 8, [True] * 8, TypeError),  # True matched 1
        ([1] * 8, [1.0] * 8, TypeError),  # 1.0 matched 1
        ([1] * 8, ["1"] * 8, TypeError),
        ([1] * 8, [None] * 8, TypeError),
    ],
)
def test_lookalike_tokens_never_reuse_another_prompts_blocks(first, second, exc) -> None:
    mgr = _mgr()
    if exc is ValueError and min(first) < 0:
        with pytest.raises(ValueError, match="tokens"):
            _fill(mgr, first)
        first = [1] * 8
    _fill(mgr, first)
    before = mgr.state_snapshot()
    for call in (
        lambda: mgr.probe_reuse(second),
        lambda: mgr.plan_admission(second),
        lambda: mgr.create_cache(second),
    ):
        with pytest.raises(exc, match="tokens"):
            call()
    assert mgr.state_snapshot() == before


def test_commit_refuses_lookalike_tokens() -> None:
    mgr = _mgr()
    cache = mgr.create_cache([1, 2])
    assert cache.resize(capacity=8, history=8)
    before = mgr.state_snapshot()
    for bad, exc in (([True, 2], TypeError), ([1.0], TypeError), ([-1], ValueError), ([2**32], ValueError)):
        with pytest.raises(exc, match="tokens"):
            cache.commit(bad)
    assert mgr.state_snapshot() == before


@pytest.mark.parametrize(
    "keys, exc",
    [([-1], ValueError), (["a"], TypeError), ([True], TypeError), ([1.5], TypeError), ([1 << 128], ValueError)],
)
def test_key_mode_keys_are_validated(keys, exc) -> None:
    mgr = _mgr()
    with pytest.raises(exc, match="block_keys"):
        mgr.create_cache(block_keys=keys)
    with pytest.raises(exc, match="block_keys"):
        mgr.probe_reuse(block_keys=keys)


def test_keys_are_128_bit_salted_and_from_the_one_path() -> None:
    mgr = _mgr()
    prompt = list(range(100, 112))
    keys = mgr.prompt_keys(prompt)
    assert keys == mgr.hasher.block_keys(prompt, TPB)
    assert all(0 <= k < 1 << 128 for k in keys) and max(keys) >= 1 << 64  # 128-bit, not Python's 64-bit hash
    events = []
    mgr2 = KVCacheManager(mgr.config, event_sink=events.append)
    _fill(mgr2, prompt)
    assert events[0].block_keys == tuple(keys)
    other = KVCacheManager(mgr.config, hasher=BlockKeyHasher(bytes(16)))
    assert other.prompt_keys(prompt) != keys  # another salt, other keys


def test_cache_salt_isolates_tenants() -> None:
    mgr = _mgr()
    prompt = list(range(200, 210))  # two full blocks and a 2-token partial tail
    _fill(mgr, prompt, cache_salt="tenant-a")
    assert mgr.probe_reuse(prompt, cache_salt="tenant-a") == 10  # full blocks and the partial tail
    assert mgr.probe_reuse(prompt) == 0
    assert mgr.probe_reuse(prompt, cache_salt="tenant-b") == 0
    assert mgr.probe_reuse(prompt[:3], cache_salt="tenant-b") == 0  # not even a partial block
    cache = mgr.create_cache(prompt, cache_salt="tenant-b")
    assert cache.num_committed_tokens == 0
    cache.close()
    with pytest.raises(TypeError, match="cache_salt"):
        mgr.probe_reuse(prompt, cache_salt=3)
    with pytest.raises(ValueError, match="cache_salt"):
        mgr.create_cache(prompt, cache_salt="")


def test_scheduler_keeps_tenants_apart_and_keys_once() -> None:
    s, mgr = make_sched(pages=64)
    prompt = list(range(300, 317))
    a = Request("a", tokens=prompt, max_new_tokens=1, cache_salt="t1")
    s.add_request(a)
    assert a.block_keys == tuple(mgr.prompt_keys(prompt, None, "t1"))  # keyed once, on the request
    drain(s, mgr)
    b = Request("b", tokens=prompt, max_new_tokens=1, cache_salt="t2")
    c = Request("c", tokens=prompt, max_new_tokens=1, cache_salt="t1")
    s.add_request(b)
    s.add_request(c)
    drain(s, mgr)
    assert b.first_scheduled_time is not None
    assert mgr.stats.reused_tokens == 16  # only c (same tenant) reused a's blocks
    with pytest.raises(TypeError, match="cache_salt"):
        Request("d", tokens=prompt, cache_salt=5)
    with pytest.raises(TypeError, match="tokens"):
        Request("e", tokens=[1, True, 3])


# --- defects (issue 17, section 2) --------------------------------------------------------------------------------


def test_group_arguments_are_range_checked() -> None:
    # 2.9: num_available_pages(-1) and page_indices(-1) indexed from the end; group 3 raised IndexError.
    mgr = _mgr()
    cache = mgr.create_cache([1, 2, 3, 4, 5])
    for bad, exc in ((-1, ValueError), (3, ValueError), (True, TypeError), (0.0, TypeError)):
        with pytest.raises(exc, match="group"):
            mgr.num_available_pages(bad)
        with pytest.raises(exc, match="group"):
            cache.page_indices(bad)
        with pytest.raises(exc, match="group"):
            cache.pages(bad)
        with pytest.raises(exc, match="group"):
            cache.live_page(bad)
        with pytest.raises(exc, match="group"):
            mgr.num_free_pages(bad)
    with pytest.raises(ValueError, match="start"):
        cache.page_indices(0, -1)


def test_hybrid_commit_is_end_with_a_failing_callback_changes_nothing() -> None:
    # 2.6: the tokens and blocks were inserted, then the callback raised, and the cache stayed committing.
    full = LayerSpec(0, bytes_per_token=2)
    rec = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
    mgr = HybridCacheManager(KVCacheConfig(TPB, (full, rec), (TierConfig(pages=(32, 8)),)))
    for n, done in ((10, 8), (11, 8), (8, 4)):  # tails inside a block, and an end on a block boundary
        prompt = list(range(400 + n, 400 + 2 * n))
        cache = mgr.create_cache(prompt[:2])
        assert cache.resize(capacity=n, history=n)
        cache.commit(prompt[:done])

        def boom(ordinal: int, group: int) -> int:
            raise RuntimeError("callback failed")

        cache.priority_callback = boom
        before = mgr.state_snapshot()
        with pytest.raises(RuntimeError, match="callback failed"):
            cache.commit(prompt[done:], is_end=True)
        assert mgr.state_snapshot() == before
        assert cache.committing and cache.num_committed_tokens == done
        cache.priority_callback = None
        cache.commit(prompt[done:], is_end=True)  # the same call succeeds once the callback does
        assert not cache.committing and cache.num_committed_tokens == n
        cache.close()
        mgr.check_invariants()


def test_snapshot_marks_do_not_grow_with_the_prompt() -> None:
    # 2.9: snapshot_interval=4 marked every point up to the context end (a 2e7-token prompt: 5M points, ~1 GB).
    full = LayerSpec(0, bytes_per_token=2)
    rec = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
    mgr = HybridCacheManager(KVCacheConfig(TPB, (full, rec), (TierConfig(pages=(32, 8)),)), snapshot_interval=4)
    req = Request("long", prompt_len=2_000_000)
    req.cache = mgr.create_cache(block_keys=[], prompt_len=req.prompt_len)
    mgr.mark_context_request(req)
    assert req.snapshot_points == (4, 8, 12, 16, 20, 24, 28, 32)
    req.num_computed_tokens = 1_000_000
    mgr.mark_context_request(req)
    assert req.snapshot_points[:2] == (1_000_004, 1_000_008) and len(req.snapshot_points) == 8
    req.cache.close()
