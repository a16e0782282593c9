"""The light install: the pure-Python layers import and the simulator runs with torch and Triton absent.

A child interpreter refuses every import of ``torch`` / ``triton`` (a meta-path hook), as a machine with only
``pip install kvforge`` (no ``kernels`` extra) would; the package metadata keeps both out of the core dependencies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BLOCK = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ImportError(f"{name} is not installed (light install)")
            return None

    sys.meta_path.insert(0, _NoTorch())
    for m in [m for m in list(sys.modules) if m.split(".")[0] in ("torch", "triton")]:
        del sys.modules[m]
    """
)


def _child(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


def test_pure_python_layers_import_and_simulate_without_torch():
    proc = _child(
        """
        import kvforge.kvcache, kvforge.scheduling, kvforge.routing, kvforge.sim, kvforge.disagg.rank_info
        from kvforge.__main__ import main
        assert "torch" not in sys.modules and "triton" not in sys.modules
        rc = main(["--conversations", "8", "--servers", "2", "--router", "conversation", "--no-progress"])
        assert rc == 0, rc
        assert "torch" not in sys.modules
        print("LIGHT-OK")
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LIGHT-OK" in proc.stdout


def test_the_hook_really_blocks_torch_and_selfcheck_says_what_to_install():
    proc = _child(
        """
        from kvforge.__main__ import main
        try:
            import torch  # noqa: F401
        except ImportError:
            print("BLOCKED")
        sys.exit(main(["selfcheck"]))
        """
    )
    assert "BLOCKED" in proc.stdout
    assert proc.returncode == 2 and "kvforge[kernels]" in proc.stderr and "Traceback" not in proc.stderr


def test_core_dependencies_leave_out_torch_and_triton():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in meta["dependencies"]}
    assert not names & {"torch", "triton", "einops"}
    assert {d.split(">")[0] for d in meta["optional-dependencies"]["kernels"]} == {"torch", "triton"}
    assert meta["license"] == "Apache-2.0"
