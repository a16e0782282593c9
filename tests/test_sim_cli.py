"""``kvforge simulate`` end to end: a short run in a subprocess (summary and --out files), and every bad-input
path ending in one error line, exit status 2 and no traceback."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.__main__ import main
from kvforge.sim.server import hybrid_available

SHORT = ["--conversations", "12", "--servers", "2", "--no-progress"]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "kvforge", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def test_simulate_subprocess_prints_the_summary_and_writes_out_files(tmp_path: Path):
    out = tmp_path / "out"
    proc = _run("simulate", *SHORT, "--router", "conversation,round-robin", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "kvforge simulate: synthetic" in text
    header = next(line for line in text.splitlines() if line.startswith("policy"))
    for col in ("hit", "prefill computed", "saved", "snapshots", "TTFT p50", "ITL p50", "out tok/s", "imbalance"):
        assert col in header
    rows = [line for line in text.splitlines() if line.startswith(("conversation ", "round-robin "))]
    assert len(rows) == 2
    with (out / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert [r["policy"] for r in summary] == ["conversation", "round-robin"]
    for r in summary:
        assert int(r["requests"]) > 0 and 0.0 <= float(r["hit_rate_fraction"]) <= 1.0
        assert float(r["ttft_p99_s"]) >= float(r["ttft_p50_s"]) > 0
    with (out / "load.csv").open() as f:
        load = list(csv.DictReader(f))
    assert {r["server"] for r in load} == {"0", "1"}
    pytest.importorskip("matplotlib")
    for png in ("policies.png", "load.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_no_subcommand_runs_simulate_and_selfcheck_is_kept(capsys):
    assert main([*SHORT, "--router", "least-load"]) == 0
    out = capsys.readouterr().out
    assert "kvforge simulate" in out and "least-load" in out
    # selfcheck still parses as its own subcommand (running it is the kernels' tests' business).
    with pytest.raises(SystemExit) as info:
        main(["selfcheck", "--help"])
    assert info.value.code == 0


@pytest.mark.skipif(not hybrid_available(), reason="the hybrid cache manager is not installed")
def test_several_snapshot_policies_compare_in_one_invocation(capsys):
    assert main([*SHORT, "--router", "conversation", "--snapshot-policy", "none,lru"]) == 0
    out = capsys.readouterr().out
    assert "conversation / none" in out and "conversation / lru" in out


def _bad_trace(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1]})
    p.write_text(good + "\n" + '{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": []}\n')
    return p


def _bad_model(tmp_path: Path) -> Path:
    p = tmp_path / "m.json"
    p.write_text('{"mla_layers": 0}')
    return p


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "{tmp}/absent.jsonl"], "no such file"),
        (["--trace", "{bad_trace}"], "bad.jsonl:2:"),
        (["--router", "nope"], "unknown policy 'nope'"),
        (["--router", "conversation,,"], None),  # empty names are dropped: a valid run
        (["--snapshot-policy", "nope"], "unknown policy 'nope'"),
        (["--cache-gib", "0.05"], "cannot hold one"),
        (["--cache-gib", "0.5", "--state-fraction", "0.9"], "longest request needs"),
        (["--model", "{bad_model}"], "mla_layers"),
        (["--model", "nope"], "no such file"),
        (["--servers", "0"], "--servers"),
        (["--state-fraction", "1.5"], "state"),
        (["--exact-demotion"], "--demote"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, args: list[str], needle: str | None):
    subs = {"{tmp}": str(tmp_path), "{bad_trace}": str(_bad_trace(tmp_path)), "{bad_model}": str(_bad_model(tmp_path))}
    argv = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        argv.append(a)
    try:
        rc = main([*SHORT, *argv])
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    if needle is None:
        assert rc == 0, err
        return
    assert rc == 2
    assert len(err.splitlines()) == 1 and "error:" in err and needle in err, err
    assert "Traceback" not in err


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path: Path):
    proc = _run("simulate", "--trace", str(_bad_trace(tmp_path)), "--no-progress")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "bad.jsonl:2:" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
