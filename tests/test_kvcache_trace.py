"""Replaying the Mooncake conversation trace reproduces the independently measured prefix-hit rates.

``shared/data/README.md`` measured 37.4% of prompt tokens as hits with an unlimited cache and 29.3% with one
LRU cache of 20,000 blocks (a hit needs the whole leading run of blocks present; hits and inserts refresh
recency). The trace is not part of the repository: the test reads it from ``$KVFORGE_TRACE`` or
``<repo>/../shared/data/`` and skips when it is absent.
"""

from __future__ import annotations

import pytest

from kvforge.kvcache.replay import TRACE_ENV, find_trace, load_trace, replay_prefix_hits


@pytest.fixture(scope="module")
def trace():
    path = find_trace()
    if path is None:
        pytest.skip(f"Mooncake trace not found: set {TRACE_ENV} or put it in <repo>/../shared/data/")
    return load_trace(path)


def test_trace_is_the_documented_one(trace):
    assert len(trace) == 12_031
    assert all(len(r.hash_ids) * 512 >= r.input_length for r in trace)


def test_unlimited_cache_hit_rate(trace):
    result = replay_prefix_hits(trace, capacity_blocks=None)
    assert result.hit_rate == pytest.approx(0.374, abs=0.005)


def test_lru_20000_blocks_hit_rate(trace):
    result = replay_prefix_hits(trace, capacity_blocks=20_000)
    assert result.hit_rate == pytest.approx(0.293, abs=0.01)
    # Capacity binds: the bounded cache loses hits the unlimited one keeps.
    assert result.hit_rate < 0.374 - 0.05
