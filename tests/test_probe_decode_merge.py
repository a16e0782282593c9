"""bench/probe_decode_merge.py on the CPU interpreter: every candidate it would time is checked against the
float64 merge first, and a wrong output fails that check (so a wrong candidate is never timed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import probe_decode_merge as pm

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_run_checks_every_candidate():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "bench" / "probe_decode_merge.py"), "--cpu", "--hb", "1,4", "--block-d",
           "16,32", "--warps", "2", "--ch", "2,8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checked 8 of 8 candidates" in proc.stdout


def test_check_fails_on_a_wrong_output():
    args = pm.make_inputs(2, 3, 4, 3, 16, "cpu")
    ref = pm.merge_ref(args[0], args[1], 3)
    assert pm.checked(args, ref, 4, (1, 16, 1, 8))
    wrong = (ref[0] * 1.05, ref[1])
    assert not pm.checked(args, wrong, 4, (1, 16, 1, 8))
    assert not pm.checked(args, (ref[0], ref[1] + 1e-2), 4, (1, 16, 1, 8))
    assert torch.isfinite(args[3].float()).all()


def test_bad_arguments_refused():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    for extra, msg in ((["--shares", "1"], "--shares"), (["--hb", "3"], "--hb"), (["--batch", "0"], "--batch")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "probe_decode_merge.py"), *extra],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
        assert proc.returncode != 0 and msg in proc.stderr + proc.stdout, (extra, proc.stderr[-500:])
