"""Import hygiene: the pure-Python layers load without torch, triton or the kernels, and `kvforge.kernels`
re-exports its public ops lazily (the same objects as in their modules)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kvforge", "kvforge.kvcache", "kvforge.routing", "kvforge.scheduling"])
def test_pure_layers_do_not_import_torch_or_kernels(module: str):
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m in ('torch', 'triton') or m.startswith('kvforge.kernels'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_kernels_package_loads_no_op_module_until_used():
    code = (
        "import sys, kvforge.kernels as k\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('kvforge.kernels.') and m != "
        "'kvforge.kernels._runtime')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_kernels_reexports_are_the_module_objects():
    import kvforge.kernels as k

    for name, module in k._LAZY.items():
        assert getattr(k, name) is getattr(importlib.import_module(f"kvforge.kernels.{module}"), name)
    assert set(k._LAZY) <= set(k.__all__) and set(k._LAZY) <= set(dir(k))
    with pytest.raises(AttributeError):
        k.no_such_op  # noqa: B018
