"""bench_engine_speed's prefill profiler on the CPU (tiny model, Triton interpreter): it times fresh prompts after a
warm-up and reports wall time, summed kernel time (none on the CPU), the top host ops and a table file per case,
and puts the module's recurrent-prefill limit back after its chunk_kda-only case. The GPU numbers come from the
H200 run (docs/engine_speed.md); this checks the code path and its report."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import bench.bench_engine_speed as bes
import kvforge.engine.ops as ops
from bench.bench_engine_speed import prefill_profile
from kvforge.engine import HybridModel, tiny


def test_prefill_profile_reports_each_case(tmp_path: Path) -> None:
    before = ops.RECURRENT_PREFILL_MAX_TOKENS
    res = prefill_profile(HybridModel(tiny()), SimpleNamespace(quick=True, tokens_per_block=16, prefill_requests=2),
                          tmp_path)  # fmt: skip
    assert list(res) == ["prefill 1x30", "prefill 1x30 chunk_kda only", "prefill 2x64"]
    assert before == ops.RECURRENT_PREFILL_MAX_TOKENS
    for label, r in res.items():
        assert r["wall_ms"] > 0 and r["kernels"] == 0 and r["device_ms"] == 0, label  # no device kernels on a CPU
        assert r["top_host"] and all(calls > 0 for _, calls, _ in r["top_host"]), label
        name = label.removeprefix("prefill ").replace(" ", "_")
        assert (tmp_path / f"profile_prefill_{name}.txt").read_text().strip()


def test_prefill_profile_restores_the_limit_when_a_case_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk_kda-only case sets the module's limit to 0; a failure inside it must not leave it there."""
    before = ops.RECURRENT_PREFILL_MAX_TOKENS
    seen = []

    def case(*a, **k):
        seen.append(ops.RECURRENT_PREFILL_MAX_TOKENS)
        if ops.RECURRENT_PREFILL_MAX_TOKENS == 0:
            raise RuntimeError("boom")
        return {}

    monkeypatch.setattr(bes, "_prefill_profile_case", case)
    with pytest.raises(RuntimeError, match="boom"):
        prefill_profile(None, SimpleNamespace(quick=True, tokens_per_block=16, prefill_requests=2), None)
    assert seen == [before, 0]
    assert before == ops.RECURRENT_PREFILL_MAX_TOKENS
