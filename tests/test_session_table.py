"""The sharded session-table candidate of ``bench/bench_session_table.py`` against the router's OrderedDict LRU.

Random get / touch / in-place update / insert-and-evict sequences, capacities from 1, any number of shards: the
same reads, the same keys evicted in the same order, and the same final recency order.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_session_table import (
    GET,
    INSERT,
    TOUCH,
    UPDATE,
    drive_od,
    drive_sharded,
    drive_sharded_heads,
    make_ops,
)


def _sequence(fill_n: int, steps: list[tuple[int, int]]) -> tuple[list[object], list[tuple[int, object]]]:
    # Keys as the router has them: str ids and int handles (negative ones too: hash(-1) is -2 in CPython).
    fill: list[object] = [f"c{i}" if i % 2 else -i for i in range(fill_n)]
    seen = list(fill)
    fresh = 0
    ops: list[tuple[int, object]] = []
    for code, pick in steps:
        if code == INSERT or not seen:
            key: object = fresh if fresh % 3 else f"n{fresh}"
            fresh += 1
            seen.append(key)
            ops.append((INSERT, key))
        else:
            ops.append((code, seen[pick % len(seen)]))  # evicted keys too: they read None
    return fill, ops


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 6),
    fill_n=st.integers(0, 10),
    shards=st.sampled_from([1, 2, 4, 8]),
    steps=st.lists(st.tuples(st.sampled_from([GET, TOUCH, INSERT, UPDATE]), st.integers(0, 63)), max_size=80),
)
def test_sharded_table_is_the_ordered_dict_lru(
    capacity: int, fill_n: int, shards: int, steps: list[tuple[int, int]]
) -> None:
    fill, ops = _sequence(fill_n, steps)
    ref = drive_od(capacity, fill, ops)[0]
    assert drive_sharded(capacity, fill, ops, shards)[0] == ref
    assert drive_sharded_heads(capacity, fill, ops, shards)[0] == ref


def test_sharded_table_at_size() -> None:
    # The bench's own workload at a small size: many shards' heads go stale and are refreshed.
    fill, ops = make_ops(500, 4000, seed=3)
    ref = drive_od(500, fill, ops)[0]
    assert len(ref) > 1000  # (reads None for evicted keys, evicted keys, final order): the log is not trivial
    for shards in (1, 4, 16, 64):
        assert drive_sharded(500, fill, ops, shards)[0] == ref
        assert drive_sharded_heads(500, fill, ops, shards)[0] == ref


def test_sharded_table_rejects_a_shard_count_that_is_not_a_power_of_two() -> None:
    import pytest

    for drive in (drive_sharded, drive_sharded_heads):
        with pytest.raises(ValueError, match="shards"):
            drive(4, [], [], 3)
