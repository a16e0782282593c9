"""What one decode program costs besides its key tiles: kvforge's default call against FlashInfer fa3 on batches
of equal lengths that fill exactly one or two waves of programs.

With ``num_splits=1`` every request is one program (one per SM at 64 heads on the Gluon kernel), so on 132
requests of L keys the call's time is one program's: a line in L whose slope is the time per key tile and whose
intercept is the fixed cost (launch, Q tile, ring fill, epilogue). FlashInfer runs the same batches (its own
split). Then the grid's mixed rows with the default call, ``num_splits=1`` and FlashInfer. Device time from CUDA
graphs (``do_bench_cudagraph``, no L2 flush); every output checked against the fp32 reference on two requests
first.

    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/probe_decode_fixed_cost.py [--heads 64] [--page 32]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import time_graph
from bench.bench_mla_decode_grid import DR, DV, build, check, draw, flashinfer_runner
from kvforge.kernels import mla_decode as md


def _time(w: dict, splits: int | None, fi: bool) -> tuple[float, float]:
    q, kv, bt, sl, indptr, indices = build(w, 0)
    scale = 1.0 / math.sqrt(DV + DR)
    out = torch.full((q.shape[0], q.shape[1], DV), float("nan"), dtype=torch.bfloat16, device="cuda")

    def call() -> None:
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=out, num_splits=splits)

    call()
    check("kvforge", out, q, kv, bt, sl, scale)
    t_kv = time_graph(call)["ms"]
    t_fi = float("nan")
    if fi:
        run_fi, fi_out = flashinfer_runner(q, kv, sl, indptr, indices, w["H"], w["page"], scale)
        run_fi()
        check("flashinfer", fi_out, q, kv, bt, sl, scale)
        t_fi = time_graph(run_fi)["ms"]
    return t_kv, t_fi


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    fi = not args.no_flashinfer
    sms = md.num_sms()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, SMs {sms}, H{args.heads} p{args.page}")
    pts = []
    for waves in (1, 2):
        for L in (32, 256, 512, 1024, 2048):
            w = {"H": args.heads, "B": sms * waves, "page": args.page, "lens": [L] * (sms * waves), "name": ""}
            t_kv, t_fi = _time(w, 1, fi)
            tiles = -(-L // 32)
            print(f"B {sms * waves:4d} L {L:5d} ({tiles:3d} tiles of 32): kvforge one share {t_kv * 1e3:8.1f} us, "
                  f"FlashInfer {t_fi * 1e3:8.1f} us", flush=True)  # fmt: skip
            if waves == 1:
                pts.append((tiles, t_kv * 1e3))
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    print(f"one wave, one share per request: {slope:.3f} us per 32-token tile, fixed {my - slope * mx:.1f} us")
    for seed, idx in ((71, 0), (71, 1), (71, 4), (71, 9)):
        w = draw(12, seed, False)[idx]
        t_def, t_fi = _time(w, None, fi)
        t_one, _ = _time(w, 1, False)
        print(f"{w['name']:>36}: default {t_def * 1e3:8.1f} us, one share {t_one * 1e3:8.1f} us, FlashInfer "
              f"{t_fi * 1e3:8.1f} us", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
