"""bench/profile_step_time.py's grid and budget arithmetic (no engine): the grid's bounds and order, the steps a
workload is planned as (what --budget-s predicts from), the split medians and the contention phase order."""

from __future__ import annotations

import random

import pytest

from bench.profile_step_time import medians, phase_order, planned_steps, predict, workloads
from kvforge.sim.profile import FEATURES, step_features


@pytest.mark.parametrize("big, max_len, max_tokens", [(False, 256, 512), (True, 4096, 8192), (False, 64, 512)])
def test_grid_bounds_and_order(big, max_len, max_tokens):
    grid = workloads(random.Random(0), 1000, big, max_len, max_tokens)
    names = [n for n, _, _ in grid]
    assert len(set(names)) == len(names)
    ids = [rid for _, prompts, _ in grid for rid in prompts]
    assert len(set(ids)) == len(ids)  # request ids are never reused within a run
    for _, prompts, new in grid:
        assert all(1 <= len(p) <= max_len for p in prompts.values()) and new >= 2
    decode = [(n, sum(len(p) for p in prompts.values())) for n, prompts, _ in grid if n.startswith("decode")]
    assert decode and all(t <= 2 * max_tokens for _, t in decode)
    assert [t for _, t in decode] == sorted(t for _, t in decode)  # cheapest first: a budget trims the largest
    assert names.index(decode[0][0]) > names.index("two prompts")


def test_gpu_grid_reaches_its_contexts_with_few_tokens():
    grid = workloads(random.Random(0), 1000, True, 4096, 8192)
    total = sum(len(p) for _, prompts, _ in grid for p in prompts.values())
    assert total < 130_000  # the grid before the budget change prefilled 431k tokens
    sizes = {len(prompts) for n, prompts, _ in grid if n.startswith("decode")}
    assert sizes == {1, 4, 8, 16, 32, 64}
    assert any(n == "decode b=1 len=4096" for n, _, _ in grid)


def test_planned_steps_chunk_by_token_and_row_budgets():
    rows = planned_steps([300, 300], 3, 512, 16)
    assert rows[0] == step_features([(0, 300), (0, 212)], 0, 0)
    assert rows[1] == step_features([(212, 88)], 0, 0)
    assert rows[2:] == [step_features([], 2, 602), step_features([], 2, 604)]
    # The row budget splits a batch too.
    assert [r[2] for r in planned_steps([8] * 5, 2, 512, 2)[:3]] == [2.0, 2.0, 1.0]


def test_predict_sums_the_fit_over_the_planned_steps():
    coef = dict.fromkeys(FEATURES, 0.0) | {"intercept": 0.01, "prefill_tokens": 0.001}
    assert predict(coef, planned_steps([100], 4, 512, 16)) == pytest.approx(4 * 0.01 + 100 * 0.001)
    assert predict(None, planned_steps([100], 4, 512, 16)) is None


def test_medians_keep_prefill_and_decode_apart():
    samples = [{"prefill": [(0, 64)], "seconds": 0.06}] * 2 + [{"prefill": [], "seconds": 0.005}] * 5
    text = medians(samples)
    assert "2 prefill median    60.0 ms" in text and "5 decode-only median     5.0 ms" in text
    assert medians(samples[2:]).startswith(" 0 prefill")


def test_phase_order():
    assert phase_order(2) == [1, 2, 1]
    assert phase_order(3) == [1, 2, 1, 3, 1]
