"""The engine's request API (CPU interpreter, tiny model): ``add_request`` refuses bad arguments naming them and
requests that can never fit the cache, ``abort`` frees the request's slot and pages, and a hypothesis run of
add / step / abort ends with every slot and page free."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.engine import Engine, EngineConfig, HybridModel, tiny
from kvforge.scheduling import Request

_MODEL: list[HybridModel] = []


def _model() -> HybridModel:
    if not _MODEL:
        _MODEL.append(HybridModel(tiny()))
    return _MODEL[0]


def _engine(**kw) -> Engine:
    cfg = dict(attention_pages=24, draft_pages=24, state_pages=16, max_num_requests=3, max_num_tokens=64)
    cfg.update(kw)
    return Engine(_model(), EngineConfig(**cfg))


def _all_free(eng: Engine) -> None:
    assert not eng.scheduler.has_unfinished
    assert eng.num_free_slots == eng.config.max_num_requests
    for g in range(eng.manager.num_groups):
        assert eng.manager.num_available_pages(g) == eng.manager.pool(g).capacity, g
    eng.manager.check_invariants()


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        (dict(max_new_tokens="3"), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=3.0), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=-2), ValueError, "max_new_tokens"),
        (dict(tokens=None), TypeError, "tokens"),
        (dict(tokens="abc"), TypeError, "tokens"),
        (dict(tokens=b"abc"), TypeError, "tokens"),
        (dict(tokens=[]), ValueError, "tokens"),
        (dict(tokens=[1, 2, 256]), ValueError, "tokens"),
        (dict(tokens=[1, -1]), ValueError, "tokens"),
        (dict(tokens=[1, 2.0]), ValueError, "tokens"),
        (dict(tokens=[True, 2]), ValueError, "tokens"),
        (dict(tokens=[1] * 2000), ValueError, "tokens"),
        (dict(request_id=None), ValueError, "request_id"),
        (dict(request_id=[1]), TypeError, "request_id"),
    ],
)
def test_add_request_refuses_bad_arguments(kw, exc, name):
    eng = _engine()
    args = dict(request_id="r", tokens=[1, 2, 3], max_new_tokens=2)
    args.update(kw)
    with pytest.raises(exc, match=name):
        eng.add_request(**args)
    _all_free(eng)


def test_add_request_refuses_a_request_that_can_never_fit():
    # 24 attention pages of 16 tokens hold 384 tokens; max_blocks_per_request (64) would allow 1024.
    eng = _engine()
    with pytest.raises(ValueError, match="can never fit the cache"):
        eng.add_request("big", [1] * 380, 20)
    assert not eng.scheduler.has_unfinished
    eng.add_request("ok", [1] * 300, 4)  # fits: schedulable, finishes
    eng.run()
    assert len(eng.outputs["ok"]) == 4


def test_add_request_refuses_a_duplicate_id_changing_nothing():
    eng = _engine()
    eng.add_request("a", [1, 2, 3], 2)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("a", [4, 5], 2)
    eng.run()
    _all_free(eng)


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf])
def test_request_refuses_non_finite_arrival_time(t):
    with pytest.raises(ValueError, match="arrival_time"):
        Request("r", tokens=[1, 2], arrival_time=t)


def test_abort_frees_slot_and_pages_and_never_exhausts_slots():
    eng = _engine(max_num_requests=2)
    rng = random.Random(1)
    # More aborts of running requests than there are slots: each abort gives its slot back.
    for i in range(5):
        eng.add_request(i, [rng.randrange(256) for _ in range(20)], 6)
        eng.step()
        eng.step()
        assert eng.scheduler.get(i) is not None
        req = eng.abort(i)
        assert req.aborted
        assert eng.outputs[i] == list(req.output_tokens)
        _all_free(eng)
    with pytest.raises(ValueError, match="request_id"):
        eng.abort(0)
    with pytest.raises(TypeError, match="request_id"):
        eng.abort([0])
    eng.add_request("last", [3, 4, 5], 3)
    eng.run()
    assert len(eng.outputs["last"]) == 3
    _all_free(eng)


def test_abort_of_a_waiting_request():
    eng = _engine(max_num_requests=1)
    eng.add_request("a", [1] * 10, 3)
    eng.add_request("b", [2] * 10, 3)
    eng.step()
    eng.abort("b")
    eng.run()
    assert len(eng.outputs["a"]) == 3 and eng.outputs["b"] == []
    _all_free(eng)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 6), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, seed=st.integers(0, 2**16))
def test_add_step_abort_sequences_free_everything(ops, seed):
    torch.manual_seed(0)
    eng = _engine(max_num_requests=3, attention_pages=16, draft_pages=16, state_pages=12)
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    added: list[int] = []
    for op in ops:
        if op[0] == "add":
            _, n, new, share = op
            prompt = shared[: min(n, 10 * share)] + [rng.randrange(256) for _ in range(max(1, n - 10 * share))]
            rid = len(added)
            try:
                eng.add_request(rid, prompt, new)
            except ValueError as exc:  # only the never-fits refusal is expected here
                assert "never fit" in str(exc)
                continue
            added.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                if eng.scheduler.has_unfinished:
                    eng.step()
        else:
            live = [r for r in added if eng.scheduler.get(r) is not None]
            if live:
                eng.abort(live[op[1] % len(live)])
        eng.manager.check_invariants()
        assert eng.num_free_slots + len(eng._slot) == eng.config.max_num_requests
    eng.run()
    for rid in added:
        req = eng.finished.get(rid)
        if req is not None:
            assert len(eng.outputs[rid]) == req.max_new_tokens
    _all_free(eng)
