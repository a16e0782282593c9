"""Hostile inputs to the cache and scheduler: every public entry point fed bad types and out-of-range values, and
random operation sequences (tenants, lookalike tokens, misuse mixed in) on the manager and the hybrid manager.

Every refused call must raise ``TypeError``/``ValueError``/``CacheStateError`` naming what was wrong and leave
the whole state (``state_snapshot``) unchanged; after every operation the invariants hold (no leak, no double
free); closing everything leaves every page free or reclaimable. Example counts are small so this runs in seconds
in CI; ``KVFORGE_FUZZ_EXAMPLES=2000`` (and ``KVFORGE_FUZZ_OPS``) make the random part heavier.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvforge.errors import CacheStateError, OutOfPagesError  # noqa: E402
from kvforge.kvcache import (  # noqa: E402
    HybridCacheManager,
    KVCacheConfig,
    KVCacheManager,
    LayerSpec,
    LifeCycle,
    TierConfig,
)
from kvforge.scheduling import Request, Scheduler, SchedulerConfig  # noqa: E402

TPB = 4
EXAMPLES = int(os.environ.get("KVFORGE_FUZZ_EXAMPLES", "30"))
OPS = int(os.environ.get("KVFORGE_FUZZ_OPS", "40"))
REFUSED = (TypeError, ValueError, CacheStateError)


def _plain(pages: int = 24) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)))


def _hybrid(pages: tuple[int, int] = (24, 8)) -> HybridCacheManager:
    layers = (LayerSpec(0, bytes_per_token=2), LayerSpec(1, LifeCycle.recurrent(), state_bytes=64))
    return HybridCacheManager(KVCacheConfig(TPB, layers, (TierConfig(pages=pages),)))


# --- bad types and ranges on every public entry point ------------------------------------------------------------

BAD_TOKENS = [
    ([1, True], TypeError),
    ([1.0, 2], TypeError),
    ([np.float64(1)], TypeError),
    (["1"], TypeError),
    ([None], TypeError),
    ([object()], TypeError),
    ([-1], ValueError),
    ([2**32], ValueError),
    ([2**64 + 5], ValueError),
    ("abcd", TypeError),
    (b"abcd", TypeError),
    (5, TypeError),
    ({1, 2}, TypeError),
    (np.array([1.5]), TypeError),
    (np.array([[1, 2]]), ValueError),
    (np.array([-4, 2]), ValueError),
]
BAD_KEYS = [
    ([-1], ValueError),
    ([1 << 128], ValueError),
    ([True], TypeError),
    ([1.0], TypeError),
    (["k"], TypeError),
    ([None], TypeError),
    ([np.int64(3)], TypeError),
    ("keys", TypeError),
    (7, TypeError),
]
BAD_COUNTS = [(-1, ValueError), (True, TypeError), (1.5, TypeError), ("3", TypeError), (None, TypeError)]
BAD_GROUPS = [
    (-1, ValueError),
    (2, ValueError),
    (99, ValueError),
    (True, TypeError),
    (0.0, TypeError),
    ("0", TypeError),
]
BAD_SALTS = [(3, TypeError), ("", ValueError), (b"", ValueError), ([1], TypeError)]
BAD_SCOPES = [(1.5, TypeError), ([1], TypeError), (object(), TypeError), ({"a": 1}, TypeError)]


def _manager_cases() -> list[tuple[str, str, Callable[[KVCacheManager, Any], Any], Any, type]]:
    """(class, name, call(mgr, cache), bad value, expected exception) for every public manager/cache entry."""
    cases: list[tuple[str, str, Callable[[KVCacheManager, Any], Any], Any, type]] = []
    for bad, exc in BAD_TOKENS:
        for name, call in (
            ("probe_reuse", lambda m, c, b=bad: m.probe_reuse(b)),
            ("plan_admission", lambda m, c, b=bad: m.plan_admission(b)),
            ("create_cache", lambda m, c, b=bad: m.create_cache(b)),
            ("prompt_keys", lambda m, c, b=bad: m.prompt_keys(b)),
            ("commit", lambda m, c, b=bad: c.commit(b)),
        ):
            cases.append(("tokens", name, call, bad, exc))
    for bad, exc in BAD_KEYS:
        for name, call in (
            ("probe_reuse", lambda m, c, b=bad: m.probe_reuse(block_keys=b)),
            ("plan_admission", lambda m, c, b=bad: m.plan_admission(block_keys=b)),
            ("create_cache", lambda m, c, b=bad: m.create_cache(block_keys=b)),
            ("create_cache+tokens", lambda m, c, b=bad: m.create_cache([1, 2, 3, 4], block_keys=b)),
        ):
            cases.append(("block keys", name, call, bad, exc))
    for bad, exc in BAD_COUNTS:
        for name, call in (
            ("probe_reuse max_reuse_tokens", lambda m, c, b=bad: m.probe_reuse([1, 2], max_reuse_tokens=b)),
            ("create_cache capacity", lambda m, c, b=bad: m.create_cache([1, 2], capacity=b)),
            ("resize capacity", lambda m, c, b=bad: c.resize(capacity=b)),
            ("resize history", lambda m, c, b=bad: c.resize(history=b)),
            ("commit num_tokens", lambda m, c, b=bad: c.commit(num_tokens=b)),
            ("pages_needed", lambda m, c, b=bad: c.pages_needed(b)),
            ("page_indices start", lambda m, c, b=bad: c.page_indices(0, b)),
        ):
            if bad is None and name.startswith(("resize", "probe", "create")):
                continue  # None means "unchanged" / "no cap" there
            # A token-mode cache refuses num_tokens itself (ValueError) before looking at its value.
            cases.append(("counts", name, call, bad, (TypeError, ValueError) if name == "commit num_tokens" else exc))
    for bad, exc in BAD_GROUPS:
        for name, call in (
            ("num_available_pages", lambda m, c, b=bad: m.num_available_pages(b)),
            ("num_free_pages", lambda m, c, b=bad: m.num_free_pages(b)),
            ("pool", lambda m, c, b=bad: m.pool(b)),
            ("page_indices", lambda m, c, b=bad: c.page_indices(b)),
            ("pages", lambda m, c, b=bad: c.pages(b)),
            ("live_page", lambda m, c, b=bad: c.live_page(b)),
        ):
            cases.append(("groups", name, call, bad, exc))
    for bad, exc in BAD_SALTS:
        for name, call in (
            ("probe_reuse cache_salt", lambda m, c, b=bad: m.probe_reuse([1, 2, 3, 4], cache_salt=b)),
            ("create_cache cache_salt", lambda m, c, b=bad: m.create_cache([1, 2, 3, 4], cache_salt=b)),
            ("prompt_keys cache_salt", lambda m, c, b=bad: m.prompt_keys([1, 2, 3, 4], None, b)),
        ):
            cases.append(("salts and scopes", name, call, bad, exc))
    for bad, exc in BAD_SCOPES:
        for name, call in (
            ("probe_reuse scope", lambda m, c, b=bad: m.probe_reuse([1, 2, 3, 4], b)),
            ("create_cache scope", lambda m, c, b=bad: m.create_cache([1, 2, 3, 4], scope=b)),
        ):
            cases.append(("salts and scopes", name, call, bad, exc))
    cases += [
        (
            "other",
            "create_cache priority_callback",
            lambda m, c: m.create_cache([1], priority_callback=3),
            None,
            TypeError,
        ),
        ("other", "priority_callback setter", lambda m, c: setattr(c, "priority_callback", "x"), None, TypeError),
        ("other", "create_cache duplicate id", lambda m, c: m.create_cache([1], cache_id=c.id), None, ValueError),
        ("other", "keys/tokens count mismatch", lambda m, c: m.create_cache([1] * 8, block_keys=[1]), None, ValueError),
        ("other", "commit past history", lambda m, c: c.commit([1] * 9), None, CacheStateError),
        ("other", "commit tokens and num_tokens", lambda m, c: c.commit([1], num_tokens=1), None, ValueError),
        ("other", "resize below committed", lambda m, c: c.resize(capacity=0, history=0), None, CacheStateError),
        ("other", "resize history past capacity", lambda m, c: c.resize(capacity=4, history=5), None, CacheStateError),
        ("other", "can_allocate str", lambda m, c: m.can_allocate("ab"), None, TypeError),
        ("other", "can_allocate negative", lambda m, c: m.can_allocate([-1] * m.num_groups), None, ValueError),
        ("other", "can_allocate float", lambda m, c: m.can_allocate([1.5] * m.num_groups), None, TypeError),
        ("other", "can_allocate length", lambda m, c: m.can_allocate([1] * 5), None, ValueError),
        ("other", "evict group", lambda m, c: m.evict(-1, 1), None, ValueError),
        ("other", "evict count", lambda m, c: m.evict(0, -1), None, ValueError),
    ]
    return cases


MANAGER_CASES = _manager_cases()


@pytest.mark.parametrize("make", [_plain, _hybrid], ids=["manager", "hybrid"])
@pytest.mark.parametrize(
    "kind, name, call, bad, exc",
    MANAGER_CASES,
    ids=[f"{k}:{n}:{i}" for i, (k, n, _, _, _) in enumerate(MANAGER_CASES)],  # stable ids for xdist
)
def test_manager_entry_points_refuse_bad_input_and_change_nothing(make, kind, name, call, bad, exc) -> None:
    mgr = make()
    cache = mgr.create_cache([5, 6, 7, 8, 9, 10])
    assert cache.resize(capacity=8, history=8)
    cache.commit([5, 6, 7, 8, 9, 10])
    before = mgr.state_snapshot()
    with pytest.raises(exc):
        call(mgr, cache)
    assert mgr.state_snapshot() == before
    mgr.check_invariants()


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"tokens": [1, True]}, TypeError),
        ({"tokens": [1.0]}, TypeError),
        ({"tokens": [-3]}, ValueError),
        ({"tokens": "abc"}, TypeError),
        ({"block_keys": [True], "prompt_len": 8}, TypeError),
        ({"block_keys": [-1], "prompt_len": 8}, ValueError),
        ({"block_keys": [1 << 128], "prompt_len": 8}, ValueError),
        ({"tokens": [1, 2], "cache_salt": 5}, TypeError),
        ({"tokens": [1, 2], "cache_salt": ""}, TypeError),
        ({"tokens": [1, 2], "max_new_tokens": 0}, ValueError),
        ({"tokens": [1, 2], "max_new_tokens": True}, TypeError),
        ({"tokens": [1, 2], "draft_len": -1}, ValueError),
        ({"tokens": [1, 2], "arrival_time": "now"}, TypeError),
        ({"tokens": [1, 2], "conversation_id": 3}, TypeError),
        ({"tokens": [1, 2], "prompt_len": 3}, ValueError),
        ({"prompt_len": 0}, ValueError),
        ({}, ValueError),
    ],
)
def test_request_refuses_bad_fields(kwargs, exc) -> None:
    with pytest.raises(exc):
        Request("r", **kwargs)


def test_scheduler_entry_points_refuse_bad_input() -> None:
    mgr = _plain(64)
    s = Scheduler(mgr, SchedulerConfig())
    ok = Request("ok", tokens=list(range(10)), max_new_tokens=2)
    s.add_request(ok)
    before = mgr.state_snapshot()
    for bad, exc in (
        ("not a request", TypeError),
        (ok, ValueError),  # already added
        (Request("ok", tokens=[1]), ValueError),  # id in use
        (Request("k", block_keys=[1, 2], prompt_len=4), ValueError),  # 2 keys for 1 full block
        (Request("big", tokens=[2**31] * 4), None),  # valid: a large but in-range id
    ):
        if exc is None:
            s.add_request(bad)
            continue
        with pytest.raises(exc):
            s.add_request(bad)
    with pytest.raises(ValueError, match="request_id"):
        s.abort("nobody")
    batch = s.schedule()
    with pytest.raises(REFUSED):
        s.on_step_done(batch, new_tokens={"ok": [True]})
    with pytest.raises(REFUSED):
        s.on_step_done(batch, accepted_tokens={"ok": -1})
    s.on_step_done(batch)
    assert mgr.state_snapshot() != before  # the good step did run
    mgr.check_invariants()


# --- random operation sequences -----------------------------------------------------------------------------------

_TOKEN = st.integers(0, 6)  # a tiny alphabet: prompts share prefixes and partial blocks often
_BAD_TOKEN = st.sampled_from([True, False, 1.0, -1, 2**32, "1", None])
_SALT = st.sampled_from([None, "a", "b"])


def _ops(data: st.DataObject, mgr: KVCacheManager) -> None:
    caches: list[Any] = []
    for _ in range(OPS):
        op = data.draw(st.sampled_from(["create", "step", "commit_end", "suspend", "resume", "close", "bad", "probe"]))
        live = [c for c in caches if c.status.value != "closed"]
        before = mgr.state_snapshot()
        try:
            if op == "create" or not live:
                toks = data.draw(st.lists(_TOKEN, min_size=0, max_size=14))
                salt = data.draw(_SALT)
                try:
                    c = mgr.create_cache(toks, cache_salt=salt, max_reuse_tokens=max(0, len(toks) - 1))
                except OutOfPagesError:
                    assert mgr.state_snapshot() == before
                    continue
                c.user_data = (toks, salt)
                caches.append(c)
                continue
            c = data.draw(st.sampled_from(live))
            toks = c.user_data[0]
            if op == "step" and c.is_active:
                end = min(len(toks), c.num_committed_tokens + data.draw(st.integers(1, 6)))
                extra = data.draw(st.lists(_TOKEN, max_size=3)) if end == len(toks) else []
                if c.resize(capacity=max(c.capacity, end + len(extra)), history=end + len(extra)):
                    before = mgr.state_snapshot()  # the resize succeeded; what follows is the commit alone
                    c.commit([*toks, *extra][c.num_committed_tokens : end + len(extra)])
                    c.user_data = ([*toks, *extra][: end + len(extra)], c.user_data[1])
            elif op == "commit_end" and c.is_active and isinstance(mgr, HybridCacheManager):
                n = len(toks) - c.num_committed_tokens
                if c.committing and n >= 0 and c.resize(capacity=max(c.capacity, len(toks)), history=len(toks)):
                    before = mgr.state_snapshot()
                    c.commit(toks[c.num_committed_tokens :], is_end=True)
            elif op == "suspend" and c.is_active:
                c.suspend()
            elif op == "resume" and not c.is_active:
                c.resume()
            elif op == "close":
                c.close()
            elif op == "probe":
                q = data.draw(st.lists(_TOKEN, max_size=14))
                mgr.probe_reuse(q, cache_salt=data.draw(_SALT))
                mgr.plan_admission(q, cache_salt=data.draw(_SALT), capacity=len(q))
                assert mgr.state_snapshot() == before, "a read-only call changed the state"
            elif op == "bad":
                bad = data.draw(st.lists(_TOKEN, max_size=3))
                bad.insert(data.draw(st.integers(0, len(bad))), data.draw(_BAD_TOKEN))
                target = data.draw(st.sampled_from(["create", "probe", "commit"]))
                with pytest.raises((TypeError, ValueError)):
                    if target == "create":
                        mgr.create_cache(bad)
                    elif target == "probe":
                        mgr.probe_reuse(bad)
                    else:
                        c.commit(bad)
                assert mgr.state_snapshot() == before, "a refused call changed the state"
        except CacheStateError:
            assert mgr.state_snapshot() == before, "a CacheStateError changed the state"
        mgr.check_invariants()
    for c in caches:
        if c.status.value != "closed":
            c.close()
    mgr.check_invariants()
    assert not mgr.caches
    for g in range(mgr.num_groups):
        pool = mgr.pool(g)
        assert pool.num_available == pool.capacity, f"group {g}: pages leaked after every cache closed"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operations_on_the_manager(data: st.DataObject) -> None:
    _ops(data, _plain(data.draw(st.integers(6, 24))))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operations_on_the_hybrid_manager(data: st.DataObject) -> None:
    _ops(data, _hybrid((data.draw(st.integers(8, 24)), data.draw(st.integers(3, 8)))))


@settings(max_examples=EXAMPLES, deadline=None)
@given(prompt=st.lists(_TOKEN, min_size=4, max_size=16), a=_SALT, b=_SALT)
def test_no_block_crosses_tenants(prompt: list[int], a: str | None, b: str | None) -> None:
    mgr = _plain(32)
    c = mgr.create_cache(prompt, cache_salt=a)
    assert c.resize(capacity=len(prompt), history=len(prompt))
    c.commit(prompt)
    c.close()
    reused = mgr.probe_reuse(prompt, cache_salt=b)
    assert reused == (len(prompt) if a == b else 0)
