"""bench_engine_speed's prefill profiler on the CPU (tiny model, Triton interpreter): it times fresh prompts after a
warm-up and reports wall time, summed kernel time (none on the CPU), the top host ops and a table file per case.
The GPU numbers come from the H200 run (docs/engine_speed.md); this checks the code path and its report."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bench.bench_engine_speed import prefill_profile
from kvforge.engine import HybridModel, tiny


def test_prefill_profile_reports_each_case(tmp_path: Path) -> None:
    res = prefill_profile(HybridModel(tiny()), SimpleNamespace(quick=True, tokens_per_block=16, prefill_requests=2),
                          tmp_path)  # fmt: skip
    assert list(res) == ["prefill 1x30", "prefill 2x64"]
    for label, r in res.items():
        assert r["wall_ms"] > 0 and r["kernels"] == 0 and r["device_ms"] == 0, label  # no device kernels on a CPU
        assert r["top_host"] and all(calls > 0 for _, calls, _ in r["top_host"]), label
        n_req, n_tok = label.split()[1].split("x")
        assert (tmp_path / f"profile_prefill_{n_req}x{n_tok}.txt").read_text().strip()
