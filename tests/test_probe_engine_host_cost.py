"""bench/probe_engine_host_cost.py on the CPU (device stubbed), small: it runs, reports every phase it timed, the
phases add up to the timed step, and no timed step left the graph path (the probe refuses to report then)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvforge.engine.phases import STEP_PHASES

ROOT = Path(__file__).resolve().parents[1]


def test_probe_reports_phases_that_add_up(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench.probe_engine_host_cost", "--batches", "1", "3", "--ctx", "40",
           "--tokens-per-block", "16", "--warmup", "2", "--steps", "20", "--reps", "2", "--out", str(tmp_path),
           "--log", str(tmp_path / "cost.log"), "--label", "test"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "engine_host_cost.json").read_text())
    assert out["stub"] and out["gc"] and out["clock"] == "cpu" and out["label"] == "test"
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        ph = r["phases_ms"]
        assert set(ph) <= set(STEP_PHASES)
        assert {"schedule", "page_table", "state_index", "inputs", "replay", "read", "accept", "commit"} <= set(ph)
        assert "forward" not in ph and "capture" not in ph  # steady decode: graph steps only, nothing captured
        # Medians per phase need not add up exactly to the median step; on a shared machine allow a wide margin.
        assert 0.5 * r["ms_step_timer_on"] <= r["phase_sum_ms"] <= 2.0 * r["ms_step_timer_on"], r
        assert r["ms_graph_run_alone"] is not None and r["ms_graph_run_alone"] > 0
    assert "# test:" in (tmp_path / "cost.log").read_text()
