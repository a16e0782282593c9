"""Ablations of the Gluon decode kernel's e4m3-cache form (KV_FP8): what limits it against the bf16 cache.

Each variant runs in its own process with ``kvforge.kernels.mla_decode_gluon`` replaced by a copy of its source
with one part removed (outputs are then wrong; only the time is read): ``nowiden`` skips the e4m3 -> bf16
conversion (the consumer still waits for the tile and frees the slot), ``notma`` skips the e4m3 tile copies (the
loader arrives on the ready barrier itself), ``neither`` both. ``bf16`` and ``fp8`` are the unmodified calls
(the e4m3 form forced through ``KVFORGE_DECODE_TRIAL``). One workload per ``--workload H,B,page,len``; device
time from a CUDA graph of 20 calls. The ablation texts target this revision's source: a change there that
they no longer match fails loudly.

    python3 bench/probe_decode_fp8_ablation.py [--workload 64,16,32,16384] [--workload 32,4,64,50906]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import load_source_copy  # noqa: E402

SRC = ROOT / "kvforge" / "kernels" / "mla_decode_gluon.py"
WIDEN = (
    "        for c in gl.static_range(D_HALF // 128):\n            xa = k8_a.index(s8)",
    "        for c in gl.static_range(D_HALF // 128 if ABLATE != 1 and ABLATE != 3 else 0):\n"
    "            xa = k8_a.index(s8)",
)
ROPE = (
    "        xr = k8_r.index(s8).load(rl).to(gl.bfloat16)\n"
    "        k_r.index(slot).store(gl.where((rrows >= end)[:, None], gl.zeros_like(xr), xr))\n",
    "        if ABLATE != 1 and ABLATE != 3:\n"
    "            xr = k8_r.index(s8).load(rl).to(gl.bfloat16)\n"
    "            k_r.index(slot).store(gl.where((rrows >= end)[:, None], gl.zeros_like(xr), xr))\n",
)
COPY = (
    "            mbarrier.expect(k_ready.index(s), 2 * k_desc_h.block_type.nbytes + k_desc_r.block_type.nbytes)\n"
    "            _tma_load(k_desc_h, [row, 0], k_ready.index(s), k8_a.index(s))\n"
    "            _tma_load(k_desc_h, [row, D_HALF], k_ready.index(s), k8_b.index(s))\n"
    "            _tma_load(k_desc_r, [row, D_V], k_ready.index(s), k8_r.index(s))\n",
    "            if KV_FP8 and (ABLATE == 2 or ABLATE == 3):\n"
    "                mbarrier.arrive(k_ready.index(s), count=1)\n"
    "            else:\n"
    "                mbarrier.expect(k_ready.index(s), 2 * k_desc_h.block_type.nbytes + k_desc_r.block_type.nbytes)\n"
    "                _tma_load(k_desc_h, [row, 0], k_ready.index(s), k8_a.index(s))\n"
    "                _tma_load(k_desc_h, [row, D_HALF], k_ready.index(s), k8_b.index(s))\n"
    "                _tma_load(k_desc_r, [row, D_V], k_ready.index(s), k8_r.index(s))\n",
)
VARIANTS = {"bf16": None, "fp8": 0, "nowiden": 1, "notma": 2, "neither": 3}


def _load_ablated(code: int) -> None:
    text = SRC.read_text()
    for old, new in (WIDEN, ROPE, COPY):
        if text.count(old) != 1:
            raise SystemExit(f"ablation text not found once in {SRC.name}: {old[:60]!r}")
        text = text.replace(old, new)
    anchor = "    _barrier = _mcg._barrier\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"ablation anchor not found once in {SRC.name}")
    text = text.replace(anchor, f"{anchor}    ABLATE = gl.constexpr({code})\n")
    load_source_copy("kvforge.kernels.mla_decode_gluon", text, f"mla_decode_gluon_ablate{code}.py")


def _child(variant: str, H: int, B: int, page: int, n: int) -> dict:
    import torch

    code = VARIANTS[variant]
    if code:
        _load_ablated(code)
    os.environ["KVFORGE_DECODE_TRIAL"] = "1"
    import kvforge.kernels.mla_decode as md
    import kvforge.kernels.mla_decode_gluon as mdg

    g = torch.Generator().manual_seed(0)
    pages = B * (-(-n // page))
    kv = (torch.randn(pages, page, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    perm = torch.randperm(pages, generator=g).to(torch.int32).view(B, -1).cuda()
    q = torch.randn(B, H, 576, generator=g).to("cuda", torch.bfloat16)
    sl = torch.full((B,), n, dtype=torch.int32, device="cuda")
    cache = kv if variant == "bf16" else (kv.float() / 0.5).to(torch.float8_e4m3fn)
    scale = None if variant == "bf16" else 0.5
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device="cuda")
    launched = []
    real = mdg.mla_decode_gluon_split
    mdg.mla_decode_gluon_split = lambda *a, **k: launched.append(1) or real(*a, **k)

    def call() -> None:
        md.mla_decode_attention(q, cache, perm, sl, softmax_scale=576**-0.5, out=out, check_values=False,
                                kv_scale_quant_orig=scale)  # fmt: skip

    call()
    torch.cuda.synchronize()
    mdg.mla_decode_gluon_split = real
    if not launched:
        raise SystemExit(f"{variant}: the Gluon kernel did not run")
    err = None
    if code == 0 or code is None:
        ref, _ = md.mla_decode_attention_ref(q, cache, perm, sl, softmax_scale=576**-0.5, kv_scale_quant_orig=scale)
        err = float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            call()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20)
    times.sort()
    return {"variant": variant, "ms": times[len(times) // 2], "rmse": err, "bytes": pages * page * cache.stride(1)
            * cache.element_size()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", help="H,B,page,len")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, *dims = args.child.split(",")
        print(json.dumps(_child(variant, *map(int, dims))))
        return
    import torch

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, rev {os.environ.get('KVFORGE_GIT_REV', '?')}")
    for w in args.workload or ["64,16,32,16384", "32,4,64,50906"]:
        base = None
        for v in VARIANTS:
            r = subprocess.run([sys.executable, __file__, "--child", f"{v},{w}"], capture_output=True, text=True)
            if r.returncode:
                print(f"H,B,page,len {w} {v}: failed\n{r.stderr[-1500:]}")
                continue
            rec = json.loads(r.stdout.strip().splitlines()[-1])
            base = rec["ms"] if v == "bf16" else base
            rel = f" bf16/this {base / rec['ms']:.2f}" if base else ""
            bw = rec["bytes"] / rec["ms"] / 1e9
            print(f"H,B,page,len {w} {v:8s} {rec['ms'] * 1e3:8.1f} us  {bw:6.2f} TB/s of cache{rel}"
                  f"  rmse {rec['rmse']}")  # fmt: skip


if __name__ == "__main__":
    main()
