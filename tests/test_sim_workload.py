"""Workloads: the seeded synthetic generator's sharing structure and the Mooncake loader's errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvforge.kvcache.hashing import default_hasher
from kvforge.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SyntheticWorkload,
    TraceFormatError,
    default_trace_path,
    describe,
    keys_from_runs,
    load_mooncake_trace,
)


def test_synthetic_is_seeded_sorted_and_consistent():
    a = SyntheticWorkload(conversations=40, seed=3).requests()
    assert a == SyntheticWorkload(conversations=40, seed=3).requests()
    assert a != SyntheticWorkload(conversations=40, seed=4).requests()
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert [r.request_id for r in a] == list(range(len(a)))
    for r in a:
        assert len(r.block_keys) == r.prompt_tokens // 128  # full blocks only
    kinds = describe(a).kinds
    assert kinds.get("turn", 0) > 0 and kinds.get("fork", 0) > 0


def test_conversation_turns_extend_the_previous_prompt():
    reqs = SyntheticWorkload(conversations=30, seed=1, fork_probability=0.0).requests()
    by_conv: dict[str, list] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation_id, []).append(r)
    multi = [turns for turns in by_conv.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            # The next prompt is the previous prompt + its answer + a new user message: a strict key prefix.
            assert nxt.block_keys[: len(prev.block_keys)] == prev.block_keys
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens - 1


def test_forks_share_their_parents_prefix_and_system_prompts_are_shared():
    reqs = SyntheticWorkload(conversations=40, seed=2, fork_probability=1.0, forks=(2, 2)).requests()
    forks = [r for r in reqs if r.kind == "fork"]
    assert forks
    parents = {r.conversation_id: r for r in reqs if r.kind != "fork"}
    f = forks[0]
    parent_conv = f.conversation_id.split(".f")[0]
    parent = [r for r in reqs if r.conversation_id == parent_conv]
    assert any(f.block_keys[: len(p.block_keys)] == p.block_keys for p in parent)
    # Six system prompts over 40 conversations: some first blocks must repeat.
    firsts = [r.block_keys[0] for r in parents.values() if r.block_keys]
    assert len(set(firsts)) < len(firsts)


def test_keys_depend_on_content_and_position():
    a = keys_from_runs([(1, 256)], 128, 0)
    assert len(a) == 2 and a[0] != a[1]
    assert keys_from_runs([(1, 128), (2, 128)], 128, 0)[0] == a[0]
    assert keys_from_runs([(1, 128), (2, 128)], 128, 0)[1] != a[1]
    assert keys_from_runs([(1, 256)], 128, 7) != a  # another root (seed) never shares blocks


@pytest.mark.parametrize("bad", [{"conversations": 0}, {"turns": (3, 2)}, {"fork_probability": 1.5}])
def test_synthetic_validates(bad):
    with pytest.raises(ValueError):
        SyntheticWorkload(**bad)


def _trace(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_mooncake_loader_maps_full_blocks(tmp_path: Path):
    good = json.dumps({"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]})
    reqs = load_mooncake_trace(_trace(tmp_path, [good, "", good]))
    assert len(reqs) == 2
    r = reqs[0]
    assert (r.arrival_s, r.prompt_tokens, r.output_tokens) == (1.5, 1100, 7)
    # 1100 // 512 full blocks (the partial third is not a block), keyed through the one key path
    assert r.block_keys == tuple(default_hasher().keys_from_ids([4, 5]))
    assert load_mooncake_trace(_trace(tmp_path, [good] * 5), limit=3)[-1].request_id == 2
    assert MOONCAKE_BLOCK_TOKENS == 512


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": []}', "positive integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": []}', "positive integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "integer hash_ids"),
    ],
)
def test_mooncake_loader_names_the_bad_line(tmp_path: Path, line: str, match: str):
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
    p = _trace(tmp_path, [good, line])
    with pytest.raises(TraceFormatError, match=match) as info:
        load_mooncake_trace(p)
    assert f"{p}:2:" in str(info.value)


def test_mooncake_loader_missing_and_empty(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_mooncake_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_mooncake_trace(_trace(tmp_path, [""]))


def test_default_trace_path_honours_the_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("KVFORGE_TRACE", str(tmp_path / "x.jsonl"))
    assert default_trace_path() == tmp_path / "x.jsonl"
