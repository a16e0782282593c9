"""The share merge alone (``mla_decode._decode_merge_kernel``) over its launch choices, on one batch of split
requests: each candidate's output checked against a float64 torch merge first, device time from CUDA graphs.

On H64 B64 with two shares a request the merge and the gap before it took 17 us of a 75 us decode call (the
H200 timeline, docs/kernels.md, session 18), far above the 12 MB it moves; and a merge taking all of a
program's heads as one tile was slower still (reverted). This probe sweeps the library kernel's launch
parameters (heads a program ``HB``, columns a program ``BLOCK_D``, warps, shares a chunk ``CH``) and reports
each against what the decode plan launches (``merge_heads``, ``MERGE_BLOCK_D``, 2 warps, CH 8). Every request has
``--shares`` live shares out of the grid's ``--splits`` (the rest are never read); partials and lses random.
Rows go to bench/results/mla_decode_merge.csv.

    PYTHONPATH=$PWD python3 bench/probe_decode_merge.py [--batch 64 --heads 64 --shares 2 --splits 4]
    PYTHONPATH=$PWD python3 bench/probe_decode_merge.py --hb 1,8 --block-d 128,512 --warps 2,4 --ch 8
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 bench/probe_decode_merge.py --cpu   # tiny, checked, not timed
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import append_csv, time_graph
from kvforge.kernels import mla_decode as md

PLAN_WARPS, PLAN_CH, PLAN_BLOCK_D = 2, 8, md.MERGE_BLOCK_D  # what mla_decode's plan launches (_MERGE_CFG, BLOCK_D)


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated ints, got {text!r}") from None
    if not vals or any(v < 1 or v & (v - 1) for v in vals):
        raise SystemExit(f"--{name}: expected powers of two >= 1, got {text!r}")
    return vals


def make_inputs(B: int, H: int, S: int, n: int, D: int, device: str, seed: int = 0) -> tuple:
    """Partials [B, H, S, D] fp32, share lses [B, H, S], share counts (all ``n``), out [B, H, D] bf16 and lse
    [B, H] filled with NaN (a row the merge should write and did not stays NaN)."""
    g = torch.Generator().manual_seed(seed)
    po = torch.randn(B, H, S, D, generator=g).to(device)
    plse = (torch.randn(B, H, S, generator=g) * 2).to(device)
    ns = torch.full((B,), n, dtype=torch.int32, device=device)
    out = torch.full((B, H, D), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((B, H), float("nan"), device=device)
    return po, plse, ns, out, lse


def merge_ref(po: torch.Tensor, plse: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge of the first ``n`` shares, in float64."""
    x = plse[:, :, :n].double()
    return (torch.softmax(x, -1)[..., None] * po[:, :, :n].double()).sum(2), torch.logsumexp(x, -1)


def launch(args: tuple, S: int, hb: int, bd: int, warps: int, ch: int) -> None:
    po, plse, ns, out, lse = args
    B, H, _, D = po.shape
    bs = 1 << max(0, S - 1).bit_length()
    md._decode_merge_kernel[(B, -(-H // hb), D // bd)](
        po, plse, ns, out, lse, H, H * S * D, S * D, D, H * S, S, out.stride(0), out.stride(1), lse.stride(0),
        lse.stride(1), BLOCK_S=bs, BLOCK_D=bd, CH=ch, HB=hb, num_warps=warps, num_stages=1,
    )  # fmt: skip


def checked(args: tuple, ref: tuple, S: int, cand: tuple) -> bool:
    """One launch of ``cand`` on NaN-filled outputs, against the reference (bf16 output: 1e-2 relative)."""
    out, lse = args[3], args[4]
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch(args, S, *cand)
    ro, rl = ref
    err = ((out.double().cpu() - ro).norm() / ro.norm()).item()
    return err < 1e-2 and bool(torch.allclose(lse.double().cpu(), rl, atol=1e-4, rtol=1e-4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--splits", type=int, default=4, help="the grid's share axis S")
    ap.add_argument("--shares", type=int, default=2, help="live shares a request (2..splits)")
    ap.add_argument("--d", type=int, default=512, help="value width")
    ap.add_argument("--hb", default="1,2,4,8,16")
    ap.add_argument("--block-d", default=None, help="default 128,256,512 (8,16,32 with --cpu)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--ch", default="8")
    ap.add_argument("--cpu", action="store_true", help="the interpreter at tiny sizes: check every candidate")
    a = ap.parse_args()
    if a.cpu:
        a.batch, a.heads, a.splits, a.shares, a.d = 3, 5, 4, 3, 32
    a.block_d = a.block_d or ("8,16,32" if a.cpu else "128,256,512")
    for name in ("batch", "heads", "splits", "d"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name}: expected an int >= 1, got {getattr(a, name)}")
    if not 2 <= a.shares <= a.splits:
        raise SystemExit(f"--shares: expected 2..splits ({a.splits}), got {a.shares}")
    B, H, S, n, D = a.batch, a.heads, a.splits, a.shares, a.d
    plan_hb = md.merge_heads(B, H, D // PLAN_BLOCK_D) if D % PLAN_BLOCK_D == 0 else 1
    cands = [(hb, bd, w, ch) for hb, bd, w, ch in itertools.product(
        _ints(a.hb, "hb"), _ints(a.block_d, "block-d"), _ints(a.warps, "warps"), _ints(a.ch, "ch"))
        if bd <= D and D % bd == 0 and hb <= 1 << max(0, H - 1).bit_length()]  # fmt: skip
    plan = (plan_hb, PLAN_BLOCK_D, PLAN_WARPS, PLAN_CH)
    if D % PLAN_BLOCK_D == 0 and plan not in cands:
        cands.insert(0, plan)
    if not cands:
        raise SystemExit("no candidate fits: --block-d must divide --d")
    device = "cpu" if a.cpu else "cuda"
    args = make_inputs(B, H, S, n, D, device)
    ref = merge_ref(args[0].cpu(), args[1].cpu(), n)
    what = f"B{B} H{H} S{S} shares {n} D{D}"
    moved = B * H * (n * D * 4 + D * 2) / 1e6
    print(f"{torch.cuda.get_device_name() if not a.cpu else 'CPU interpreter'}: merge {what}, {moved:.1f} MB moved")
    rows, failed = [], []
    for cand in cands:
        if not checked(args, ref, S, cand):
            failed.append(cand)
            print(f"  HB {cand[0]:3d} BLOCK_D {cand[1]:4d} warps {cand[2]} CH {cand[3]}: WRONG OUTPUT, not timed")
            continue
        if a.cpu:
            continue
        ms = time_graph(lambda c=cand: launch(args, S, *c))["ms"]  # the candidate bound by the default
        rows.append({"workload": what, "hb": cand[0], "block_d": cand[1], "warps": cand[2], "ch": cand[3],
                     "plan": cand == plan, "us": round(ms * 1e3, 2), "gb_s": round(moved / ms, 1)})  # fmt: skip
    if a.cpu:
        print(f"checked {len(cands) - len(failed)} of {len(cands)} candidates")
        raise SystemExit(1 if failed else 0)
    base = next((r["us"] for r in rows if r["plan"]), None)
    for r in sorted(rows, key=lambda r: r["us"]):
        vs = f"  x{base / r['us']:.2f} vs the plan's" if base else ""
        tag = "  <- the plan's choice" if r["plan"] else ""
        print(f"  HB {r['hb']:3d} BLOCK_D {r['block_d']:4d} warps {r['warps']} CH {r['ch']}: {r['us']:7.2f} us "
              f"{r['gb_s']:7.1f} GB/s{vs}{tag}")  # fmt: skip
    if rows:
        print(f"rows appended to {append_csv('mla_decode_merge', rows)}")
    if failed:
        raise SystemExit(f"{len(failed)} candidates failed the reference check")


if __name__ == "__main__":
    main()
