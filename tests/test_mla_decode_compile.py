"""The decode kernel's launch variants compile offline for every target architecture (no GPU).

tests/test_compile_targets.py compiles the kernel once per architecture with its default variant; this file adds the
SPLIT_DV variant (two programs per head tile, each with half the value columns; with the fused merge, ``MERGE``) at
narrow widths (64 + 16, bf16) on every architecture and at DeepSeek's real widths (512 + 64) on sm_90, where it is
launched, and the portable TMA kernel a 32-token, 4-stage Gluon config falls back to on sm_90 (within the SM's
shared memory), so a variant that stops compiling on one architecture fails here rather than at a user's first
launch. The compiles run in a subprocess with the interpreter off (this file is also the script: ``python
tests/test_mla_decode_compile.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = [80, 89, 90, 100, 120]
# (D_V, D_R, BLOCK_H, BLOCK_N, num_warps, num_stages, SPLIT_DV)
VARIANTS = [(64, 16, 16, 32, 4, 2, True)]
REAL_WIDTH_SM90 = [(512, 64, 64, 64, 4, 2, True)]
# What a Gluon config runs where the Gluon kernel cannot (the portable kernel with its tiles, TMA): the sm_90
# table's deepest 32-token ring, (D_V, D_R, BLOCK_H, BLOCK_N, num_warps, num_stages).
GLUON_FALLBACK_SM90 = [(512, 64, 64, 32, 8, 4)]
# An e4m3 latent cache (bf16 q, fp16 products), on every architecture: the configs an e4m3 key runs.
FP8_VARIANTS = [(512, 64, 16, 64, 4, 2, False), (512, 64, 64, 64, 8, 2, False)]


def _compile_all() -> list[dict[str, object]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvforge.kernels.mla_decode import _mla_decode_split_kernel as fn
    from kvforge.kernels.mla_decode import _split_kernel_signature

    sig = _split_kernel_signature()
    records = []
    jobs = [(arch, v, False) for arch in ARCHS for v in VARIANTS] + [(90, v, False) for v in REAL_WIDTH_SM90]
    jobs += [(90, (*v, False), True) for v in GLUON_FALLBACK_SM90]
    jobs += [(arch, v, "fp8") for arch in ARCHS for v in FP8_VARIANTS]
    for arch, (dv, dr, bh, bn, warps, stages, split_dv), tma in jobs:
        fp8 = tma == "fp8"
        tma = tma is True
        consts = {"PAGE_SIZE": 64, "D_V": dv, "D_R": dr, "UPCAST": False, "BLOCK_H": bh, "BLOCK_N": bn,
                  "SPLIT_DV": split_dv, "USE_TMA": tma, "PRECISION": "tf32", "CHECK": True, "BALANCE": 2,
                  "SCALE_MODE": 2 if fp8 else 0, "FP8_BYTES": fp8 and arch < 89, "ORDER": True,
                  "MERGE": split_dv}  # fmt: skip
        name = f"sm_{arch} {dv}+{dr} BH{bh} BN{bn} w{warps} s{stages} split_dv={split_dv} tma={tma} fp8={fp8}"
        tsig = sig
        if fp8:  # an e4m3 cache: the e4m3 type from sm_89, its bytes before
            tsig = _split_kernel_signature("fp8e4nv" if arch >= 89 else "u8")
        if tma:  # host descriptors of one key tile's latent half and rope part
            tsig = {**sig, "desc_h": f"tensordesc<bf16[{bn}, {dv // 2}]>", "desc_r": f"tensordesc<bf16[{bn}, {dr}]>"}
        try:
            k = triton.compile(
                ASTSource(fn, tsig, constexprs=consts),
                target=GPUTarget("cuda", arch, 128 if tma else 32),
                options={"num_warps": warps, "num_stages": stages},
            )
            if tma and not 0 < k.metadata.shared <= 232448:  # sm_90's opt-in shared memory per block
                raise ValueError(f"{k.metadata.shared} B of shared memory")
            records.append({"name": name, "ok": True})
        except Exception as e:  # reported with the variant's name; the test fails on any
            records.append({"name": name, "ok": False, "error": f"{e}"[:400]})
    return records


def test_decode_variants_compile_offline():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [f"{r['name']}: {r['error']}" for r in records if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(records) == len(ARCHS) * (len(VARIANTS) + len(FP8_VARIANTS)) + len(REAL_WIDTH_SM90) + len(
        GLUON_FALLBACK_SM90
    )


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before kvforge.kernels decides (no driver here)
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_compile_all()))
