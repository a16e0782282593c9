"""bench/probe_decode_timeline.py: its stamps still find their places in the Gluon decode kernel's source.

The probe inserts ``%globaltimer`` stamps into a copy of ``mla_decode_gluon``'s source at fixed anchors; a change
to the kernel that moves an anchor must fail here on the CPU, not on the H200. The stamped copy compiles for
sm_90 offline (``--compile-only``) where Gluon is importable.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.probe_decode_timeline import POINTS, patched_source
from kvforge.kernels import mla_decode_gluon as mdg

ROOT = Path(__file__).resolve().parents[1]


def test_every_stamp_finds_its_place():
    text = patched_source(1 << 40)
    ast.parse(text)
    assert text.count("_tl_stamp(") == len(POINTS) + 1  # the definition and one call per point
    assert "gl.constexpr(1099511627776)" in text


@pytest.mark.skipif(mdg._mcg._GLUON_IMPORT_ERROR is not None, reason="Gluon is not importable here")
def test_stamped_kernel_compiles_offline():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "probe_decode_timeline.py"), "--compile-only"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.split() == ["BN32", "s4", "ok", "BN64", "s2", "ok"]
