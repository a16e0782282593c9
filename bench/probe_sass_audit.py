"""Offline sm_90 audit of every portable Triton kernel's global memory instructions (no GPU): how many loads and
stores each thread issues per width, and the spills, from ``cuobjdump -sass`` of an offline compile.

Each kernel of ``tests/test_compile_targets.SPECS`` is compiled as its launcher would specialise it on typical
serving shapes: every pointer 16-byte aligned and every integer argument that is not ``do_not_specialize`` a
multiple of 16 (an approximation: a kernel whose stride is odd in practice compiles narrower there). A kernel
whose stores are all single elements (``STG.E.U8``/``.U16``/``.32`` only) where its data is contiguous is the
pattern this looks for: a mask or an offset whose alignment the compiler cannot prove, which turns one 16-byte
store into sixteen. The Triton found first on ``PYTHONPATH`` compiles (the H200 runs 3.6.0).

    PYTHONPATH=/tmp/t36site:. python3 bench/probe_sass_audit.py [--only REGEX] > bench/results/sass_audit_<rev>.log
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.test_compile_targets import SPECS

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MEM = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?((?:LDG|STG|LDL|STL|ATOMG|RED)[A-Z0-9_.]*)")


def audit(name: str, module: str, types: dict[str, str], consts: dict[str, object], warps: int) -> str:
    fn = getattr(importlib.import_module(f"kvforge.kernels.{module}"), name)
    sig = {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}
    per_call = set(getattr(fn, "do_not_specialize", ()) or ())
    per_call |= {fn.params[i].name for i in per_call if isinstance(i, int)}
    aligned = [i for i, p in enumerate(fn.params) if not p.is_constexpr and p.name not in per_call
               and (sig[p.name].startswith("*") or sig[p.name] in ("i32", "i64"))]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn, sig, constexprs=dict(consts), attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in MEM.finditer(sass))
    stores = [o for o in ops if o.startswith("STG")]
    narrow = stores and all(not o.endswith((".64", ".128")) for o in stores)
    flag = "  <- every store one element" if narrow else ""
    return f"{name}: " + ", ".join(f"{o} {c}" for o, c in sorted(ops.items())) + flag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="regular expression on kernel names")
    args = ap.parse_args()
    print(f"# triton {triton.__version__}, sm_90 offline compile, per-thread global memory instructions")
    for name, (module, types, consts, warps) in SPECS.items():
        if not consts or (args.only and not re.search(args.only, name)):
            continue  # the context kernel's variants are compiled by the offline compile test
        try:
            print(audit(name, module, types, consts, warps), flush=True)
        except Exception as e:  # a kernel that does not compile here is reported, not fatal
            print(f"{name}: did not compile ({type(e).__name__}: {str(e)[:160]})", flush=True)


if __name__ == "__main__":
    main()
