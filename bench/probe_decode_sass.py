"""Offline sm_90 compile of the portable decode kernel's 16-head configs (and its 64-head tile on 8 warps), bf16
against e4m3 cache: SASS instruction counts and resource usage, no GPU (what the e4m3 form adds per kernel:
shared-memory loads of the staged e4m3 tile, the widening, the widened tile's stores).

Compiled as the launcher specialises it (pointers and the fixed strides 16-divisible; the per-call ints not), with
the Triton found first on ``PYTHONPATH`` (the H200 runs 3.6.0: install that wheel into a folder and put it first).

    PYTHONPATH=/tmp/t36site:. TRITON_INTERPRET=0 python3 bench/probe_decode_sass.py
"""

from __future__ import annotations

import collections
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

from kvforge.kernels.mla_decode import _mla_decode_split_kernel as fn
from kvforge.kernels.mla_decode import _split_kernel_signature

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PER_CALL = {"B", "S", "max_len", "min_tiles", "slots", "num_pages", "s_plb", "s_plh", "s_ob", "s_oh", "s_lb", "s_lh"}
INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)")  # an instruction's opcode
OPS = ["LDG", "LDGSTS", "LDS", "STS", "LDSM", "F2FP", "HMMA", "HGMMA", "BAR", "LDL", "STL"]
# (e4m3 cache, BLOCK_N, stages[, BLOCK_H, warps]): the committed 16-head e4m3 config, the bf16 ones at both tile
# sizes, and the table's portable 64-head tile on 8 warps (warpgroup products).
VARIANTS = [(True, 32, 3), (False, 32, 3), (False, 64, 2), (False, 64, 2, 64, 8)]


def compile_one(fp8: bool, block_n: int, stages: int, block_h: int = 16, warps: int = 4) -> str:
    sig = _split_kernel_signature("fp8e4nv" if fp8 else "bf16")
    fixed = [i for i, p in enumerate(fn.params) if not p.is_constexpr and (sig[p.name].startswith("*") or p.name == "H"
             or (p.name.startswith("s_") and p.name not in PER_CALL))]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in fixed}
    consts = {"PAGE_SIZE": 64, "D_V": 512, "D_R": 64, "UPCAST": False, "BLOCK_H": block_h, "BLOCK_N": block_n,
              "SPLIT_DV": False, "USE_TMA": False, "PRECISION": "tf32", "CHECK": True, "BALANCE": 2,
              "SCALE_MODE": 2 if fp8 else 0, "FP8_BYTES": False, "FP8_PIN": fp8, "ORDER": True,
              "MERGE": True}  # fmt: skip
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([TOOLS / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in INSTR.finditer(sass))
    usage = " ".join(re.findall(r"(?:REG|STACK):\d+", res))
    cache = "e4m3" if fp8 else "bf16"
    counts = ", ".join(f"{op} {ops.get(op, 0)}" for op in OPS)
    head = f"{cache} cache BH{block_h} BN{block_n} w{warps} s{stages}"
    return f"{head}: {usage}, shared {k.metadata.shared} B | {counts}"


def main() -> None:
    print(
        f"# triton {triton.__version__}, sm_90 offline compile of _mla_decode_split_kernel (D 512 + 64, CHECK, MERGE)"
    )
    for v in VARIANTS:
        print(compile_one(*v))


if __name__ == "__main__":
    main()
