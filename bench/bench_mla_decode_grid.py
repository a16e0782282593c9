"""MLA decode on any shape: kvforge's default call against FlashInfer fa3 over a seeded grid of workloads.

The grid (``--grid``, seed 0, 24 workloads) and ``--random N --seed S`` draw workloads the same way: heads
{16, 32, 64, 128}, batch {1, 4, 16, 64, 256}, page size 32 or 64, lengths 512 to 128k (log-uniform), either one
length for the batch or lengths drawn per request between 1/20 of the longest and the longest; pages scattered
at random over the cache; total keys capped at 4M (the cache stays a few GB). bf16 q and 576-wide latent rows
(512 + 64). Per workload, each provider's output is checked against ``mla_decode_attention_ref`` (fp32) on two
requests, and every element for being written and finite, before anything is timed; a failed check is reported
and the workload's ratios are not written. Timed, sample by sample in turn behind an L2 flush: kvforge's
default call (device-side value checks), kvforge with ``check_values=False``, ``MLADecodePlan.run`` (planned
outside the timing), FlashInfer's ``run`` (its ``plan`` outside the timing), and kvforge over an e4m3 copy of the
cache (``kv_scale_quant_orig``, same call); with ``--fp8-gluon``, also that call on the Gluon kernel's e4m3-cache
form (a trial variant, ``KVFORGE_DECODE_TRIAL``; workloads with 32 or more heads), checked the same way and
reported as ``fp8_gluon_speedup`` (kvforge bf16 time / this time).
Then kvforge's default call and FlashInfer replayed from CUDA graphs. Ratios are FlashInfer time / kvforge time
(above 1: kvforge faster); the FP8 ratio is kvforge bf16 time / kvforge FP8 time.

    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode_grid.py --grid
    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode_grid.py --random 24 --seed 7
    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode_grid.py --random 12 --seed 5 --fp8-gluon
    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode_grid.py --random 12 --seed 5 --variant 32,4,1

``--variant block_n,stages,early`` runs one Gluon variant of the sm_90 table (trial ones included) wherever
the Gluon kernel takes the call, instead of the committed configs; the tag names it. ``--gluon-min-heads 16``
lets bf16 keys with fewer heads than ``GLUON_MIN_HEADS`` run the Gluon kernel (a trial; the tag names it).

Appends rows to bench/results/mla_decode_grid.csv (GPU, versions, git revision, date) and draws
bench/results/mla_decode_grid_<tag>.png.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, append_csv, git_revision, time_graph, time_interleaved
from kvforge.kernels import mla_decode as md
from kvforge.kernels import mla_decode_gluon as mdg
from kvforge.kernels._fp8 import e4m3_ref
from kvforge.kernels._runtime import ConfigTable, TunedKernel

DV, DR = 512, 64
HEADS = (16, 32, 64, 128)
BATCHES = (1, 4, 16, 64, 256)
MAX_KEYS = 4 << 20


def draw(n: int, seed: int, fixed: bool) -> list[dict]:
    """``n`` workloads from ``seed``. ``fixed``: the grid's cover (every head count and batch size in turn,
    page sizes and uniform/mixed alternating); otherwise each choice is drawn at random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if fixed:
            H, B = HEADS[i % 4], BATCHES[i % 5]
            page, mixed = (64, 32)[(i // 4) % 2], (i // 2) % 2 == 1
        else:
            H, B = rng.choice(HEADS), rng.choice(BATCHES)
            page, mixed = rng.choice((32, 64)), rng.random() < 0.5
        cap = min(131072, MAX_KEYS // B * (2 if mixed else 1))
        longest = int(math.exp(rng.uniform(math.log(512), math.log(max(513, cap)))))
        longest = max(512, min(cap, longest - rng.randrange(0, 16)))  # lengths off the tile grid too
        if mixed:
            lens = [rng.randint(max(1, longest // 20), longest) for _ in range(B)]
            lens[rng.randrange(B)] = longest
        else:
            lens = [longest] * B
        kind = "mixed" if mixed else "uniform"
        out.append({"H": H, "B": B, "page": page, "lens": lens,
                    "name": f"H{H} B{B} p{page} {kind} {min(lens)}-{longest}"})  # fmt: skip
    return out


def build(w: dict, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, B, page, lens = w["H"], w["B"], w["page"], w["lens"]
    n_pages = [-(-n // page) for n in lens]
    total = sum(n_pages) + 8
    q = torch.randn(B, H, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(total, page, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    width = max(n_pages)
    bt = torch.empty(B, width, dtype=torch.int32, device="cuda")
    indptr = [0]
    flat = []
    pos = 0
    for b, n in enumerate(n_pages):
        row = perm[pos : pos + n]
        pos += n
        flat.append(row)
        indptr.append(indptr[-1] + n)
        bt[b, :n] = row
        if n < width:  # unread entries: any valid page
            bt[b, n:] = perm[-1]
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    indices = torch.cat(flat)
    return q, kv, bt, sl, torch.tensor(indptr, dtype=torch.int32, device="cuda"), indices


def check(name: str, got: torch.Tensor, q, kv, bt, sl, scale: float, **kw) -> float:
    if not bool(torch.isfinite(got).all()):
        raise RuntimeError(f"{name}: {int((~torch.isfinite(got)).sum())} output elements not written or not finite")
    rows = [0, q.shape[0] - 1] if q.shape[0] > 1 else [0]
    idx = torch.tensor(rows, device=q.device)
    ref, _ = md.mla_decode_attention_ref(q[idx], kv, bt[idx], sl[idx], softmax_scale=scale, **kw)
    err = float((got[idx].float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    if not err < 1e-2:
        raise RuntimeError(f"{name}: relative RMSE {err:.3g} against the fp32 reference")
    return err


def flashinfer_runner(q, kv, sl, indptr, indices, H, page, scale):
    import flashinfer

    B = q.shape[0]
    ckv = kv[..., :DV].contiguous()
    kpe = kv[..., DV:].contiguous()
    q_nope, q_pe = q[..., :DV].contiguous(), q[..., DV:].contiguous()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    w.plan(qo_indptr, indptr, indices, sl, H, DV, DR, page, False, scale, torch.bfloat16, torch.bfloat16)
    out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
    return lambda: w.run(q_nope, q_pe, ckv, kpe, out=out), out


def _variant_split(spec: str) -> TunedKernel:
    """The decode kernel with the Gluon variant ``spec`` ("block_n,stages,early") as the only Gluon candidate,
    ahead of the sm_90 table's portable configs (16 heads and e4m3 caches keep what they run by default)."""
    try:
        bn, st, early = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--variant: expected block_n,stages,early (e.g. 32,4,1), got {spec!r}") from None
    cfg = md._cfg(64, bn, 8, st, tma=True, per_sm=1, gluon=2 if early else 1)
    if md._gluon_variant(cfg) not in md.gluon_variants():
        raise SystemExit(f"--variant: {spec} is not one of the sm_90 table's {md.gluon_variants()}")
    table = [cfg] + [c for c in md._CONFIGS.by_arch[9] if not c.kwargs.get("GLUON")]
    return TunedKernel(f"mla_decode_split_v{bn}_{st}_{early}", md._mla_decode_split_kernel,
                       ConfigTable(fallback=[cfg], interpreter=cfg, by_arch={9: table}), tune_first=1)  # fmt: skip


def _fp8_gluon_split() -> TunedKernel:
    """The decode kernel with one candidate: the Gluon kernel's 32 x 2 variant (its e4m3-cache form here)."""
    cfg = md._cfg(64, 32, 8, 2, tma=True, per_sm=1, gluon=1)
    return TunedKernel("mla_decode_fp8_gluon_bench", md._mla_decode_split_kernel,
                       ConfigTable(fallback=[cfg], interpreter=cfg, by_arch={9: [cfg]}))  # fmt: skip


def _on_fp8_gluon(split: TunedKernel, fn):
    """``fn`` with the decode kernel limited to ``split`` (a distinct cache tensor keeps its plans apart)."""

    def call() -> None:
        saved = md._SPLIT
        md._SPLIT = split
        try:
            fn()
        finally:
            md._SPLIT = saved

    return call


def run_workload(w: dict, seed: int, fi: bool, fp8: bool, fp8_gluon: TunedKernel | None = None) -> dict:
    q, kv, bt, sl, indptr, indices = build(w, seed)
    scale = 1.0 / math.sqrt(DV + DR)
    B, H = q.shape[:2]
    out = torch.full((B, H, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_nc = torch.empty_like(out)
    flags = md.decode_error_flags(q.device)

    def kv_default():
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=out)

    def kv_nocheck():
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=out_nc, check_values=False)

    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=scale)  # planned once, as an engine step would
    out_pl = torch.full_like(out, float("nan"))

    def kv_planned():
        plan.run(q, kv, out=out_pl)

    fns = {"kvforge": kv_default, "kvforge_nocheck": kv_nocheck, "kvforge_planned": kv_planned}
    row = {"workload": w["name"], "heads": H, "batch": B, "page": w["page"], "max_len": max(w["lens"]),
           "mean_len": sum(w["lens"]) / B}  # fmt: skip
    kv_default()
    row["rmse_kvforge"] = check("kvforge", out, q, kv, bt, sl, scale)
    kv_planned()
    row["rmse_kvforge_planned"] = check("kvforge planned", out_pl, q, kv, bt, sl, scale)
    if int(flags.sum()):
        raise RuntimeError(f"kvforge: error flags {flags.tolist()} on a valid table")
    if fi:
        run_fi, fi_out = flashinfer_runner(q, kv, sl, indptr, indices, H, w["page"], scale)
        fi_out.fill_(float("nan"))
        run_fi()
        row["rmse_flashinfer"] = check("flashinfer", fi_out, q, kv, bt, sl, scale)
        fns["flashinfer"] = run_fi
    if fp8:
        s_q = 0.5  # dequant scale: the cache holds e4m3(x / 0.5)
        kv8 = e4m3_ref(kv.float() / s_q)
        out8 = torch.full_like(out, float("nan"))

        def kv_fp8():
            md.mla_decode_attention(q, kv8, bt, sl, softmax_scale=scale, out=out8, kv_scale_quant_orig=s_q)

        kv_fp8()
        row["rmse_fp8_vs_dequant"] = check("kvforge fp8", out8, q, kv8, bt, sl, scale, kv_scale_quant_orig=s_q)
        fns["kvforge_fp8"] = kv_fp8
        if fp8_gluon is not None and H >= 32:
            kv8g = kv8.clone()
            out8g = torch.full_like(out, float("nan"))
            kv_fp8_gluon = _on_fp8_gluon(fp8_gluon, lambda: md.mla_decode_attention(
                q, kv8g, bt, sl, softmax_scale=scale, out=out8g, kv_scale_quant_orig=s_q))  # fmt: skip
            launched = []
            real = mdg.mla_decode_gluon_split
            mdg.mla_decode_gluon_split = lambda *a, **k: launched.append(1) or real(*a, **k)
            try:
                kv_fp8_gluon()
            finally:
                mdg.mla_decode_gluon_split = real
            if not launched:
                raise RuntimeError("fp8 gluon: the Gluon kernel did not run (gluon_decode_reason refused it)")
            row["rmse_fp8_gluon_vs_dequant"] = check("kvforge fp8 gluon", out8g, q, kv8g, bt, sl, scale,
                                                     kv_scale_quant_orig=s_q)  # fmt: skip
            fns["kvforge_fp8_gluon"] = kv_fp8_gluon
    t = time_interleaved(fns, samples=80)
    for k, v in t.items():
        row[f"{k}_ms"] = v["ms"]
    row["check_cost"] = t["kvforge"]["ms"] / t["kvforge_nocheck"]["ms"]
    if fi:
        row["ratio_eager"] = t["flashinfer"]["ms"] / t["kvforge"]["ms"]
        row["ratio_eager_nocheck"] = t["flashinfer"]["ms"] / t["kvforge_nocheck"]["ms"]
        row["ratio_eager_planned"] = t["flashinfer"]["ms"] / t["kvforge_planned"]["ms"]
    if fp8:
        row["fp8_speedup"] = t["kvforge"]["ms"] / t["kvforge_fp8"]["ms"]
    if "kvforge_fp8_gluon" in t:
        row["fp8_gluon_speedup"] = t["kvforge"]["ms"] / t["kvforge_fp8_gluon"]["ms"]
        check("kvforge fp8 gluon (timed)", out8g, q, kv8g, bt, sl, scale, kv_scale_quant_orig=s_q)
    # The timed calls took the cached launch paths: their last outputs are checked too.
    check("kvforge (timed)", out, q, kv, bt, sl, scale)
    check("kvforge planned (timed)", out_pl, q, kv, bt, sl, scale)
    if fp8:
        check("kvforge fp8 (timed)", out8, q, kv8, bt, sl, scale, kv_scale_quant_orig=s_q)
    row["kvforge_graph_ms"] = time_graph(kv_default, rep=30)["ms"]
    if fi:
        row["flashinfer_graph_ms"] = time_graph(fns["flashinfer"], rep=30)["ms"]
        row["ratio_graph"] = row["flashinfer_graph_ms"] / row["kvforge_graph_ms"]
    if int(flags.sum()):
        raise RuntimeError(f"kvforge: error flags {flags.tolist()} on a valid table")
    return row


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--grid", action="store_true", help="the fixed grid: 24 workloads from seed 0")
    ap.add_argument("--random", type=int, default=0, help="draw this many fresh workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--fp8-gluon", action="store_true",
                    help="also time the Gluon kernel's e4m3-cache form (trial; 32 or more heads)")  # fmt: skip
    ap.add_argument("--only", type=str, default="", help="comma-separated workload indices (warm-up shards)")
    ap.add_argument("--warm", action="store_true", help="compile only: one call per workload, nothing timed")
    ap.add_argument("--variant", default="", help="block_n,stages,early: the Gluon variant 32+ bf16 heads run "
                    "(a trial variant of the sm_90 table; the tag and each row name it)")  # fmt: skip
    ap.add_argument("--no-order", action="store_true",
                    help="ablation: never run a batch longest first (ORDER off; the tag says so)")  # fmt: skip
    ap.add_argument("--gluon-min-heads", type=int, default=0, choices=[0, 16, 32, 64, 128],
                    help="trial: the fewest heads a bf16 key runs the Gluon kernel with (default: the library's "
                    "GLUON_MIN_HEADS; the tag says so)")  # fmt: skip
    args = ap.parse_args()
    if not args.grid and args.random <= 0:
        ap.error("give --grid or --random N")
    if args.random < 0 or args.random > 1000:
        ap.error(f"--random: expected 1..1000, got {args.random}")
    if args.fp8_gluon and args.no_fp8:
        ap.error("--fp8-gluon times the e4m3 cache: leave out --no-fp8")
    fp8_gluon = None
    if args.fp8_gluon:
        import os

        os.environ[md.TRIAL_ENV] = "1"  # the e4m3 form is a candidate only under the trial switch
        fp8_gluon = _fp8_gluon_split()
    tag = "grid" if args.grid else f"random{args.random}_seed{args.seed}"
    if args.variant:
        import os

        os.environ[md.TRIAL_ENV] = "1"  # a variant past the first is a candidate only under the trial switch
        md._SPLIT = _variant_split(args.variant)
        tag += "_v" + args.variant.replace(",", "-")
    if args.no_order:
        md.order_requests = lambda batch, head_progs, slots: False
        tag += "_noorder"
    if args.gluon_min_heads:
        md.GLUON_MIN_HEADS = args.gluon_min_heads
        tag += f"_gmh{args.gluon_min_heads}"
    work = draw(24, 0, True) if args.grid else draw(args.random, args.seed, False)
    picked = range(len(work)) if not args.only else [int(x) for x in args.only.split(",")]
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}, torch {torch.__version__}, SMs {md.num_sms()}, {tag}: {len(work)} workloads")
    rows = []
    for i in picked:
        w = work[i]
        t0 = time.perf_counter()
        try:
            if args.warm:
                q, kv, bt, sl, _, _ = build(w, i)
                md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05)
                if not args.no_fp8:
                    md.mla_decode_attention(q, e4m3_ref(kv), bt, sl, softmax_scale=0.05, kv_scale_quant_orig=1.0)
                torch.cuda.synchronize()
                print(f"warm {i} {w['name']} {time.perf_counter() - t0:.1f}s", flush=True)
                continue
            row = run_workload(w, i, not args.no_flashinfer, not args.no_fp8, fp8_gluon)
        except Exception as exc:  # reported; no ratio is written for a workload that failed its check
            print(f"{i:2d} {w['name']:>40}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        finally:
            torch.cuda.empty_cache()
        row["set"] = tag
        rows.append(row)
        nan = float("nan")
        print(f"{i:2d} {w['name']:>40}: kvforge {row['kvforge_ms']:.4f} ms (no check {row['kvforge_nocheck_ms']:.4f}, "
              f"check cost {row['check_cost']:.3f}x, planned {row['kvforge_planned_ms']:.4f}) fi "
              f"{row.get('flashinfer_ms', nan):.4f} ms | ratio eager {row.get('ratio_eager', nan):.3f} planned "
              f"{row.get('ratio_eager_planned', nan):.3f} graph {row.get('ratio_graph', nan):.3f} | fp8 "
              f"{row.get('kvforge_fp8_ms', nan):.4f} ms x{row.get('fp8_speedup', nan):.2f}, gluon "
              f"x{row.get('fp8_gluon_speedup', nan):.2f} ({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip
    print("chosen configs:", md._SPLIT.chosen())
    if args.warm or not rows:
        return
    for key in ("ratio_eager", "ratio_eager_nocheck", "ratio_eager_planned", "ratio_graph", "check_cost",
                "fp8_speedup", "fp8_gluon_speedup"):  # fmt: skip
        vals = [r[key] for r in rows if key in r]
        if vals:
            print(f"{key}: geomean {geomean(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f} over {len(vals)}")
    for key in ("fp8_speedup", "fp8_gluon_speedup"):
        long8 = [r[key] for r in rows if key in r and r["max_len"] >= 8192]
        if long8:
            print(f"{key} at max length >= 8k: geomean {geomean(long8):.3f}, min {min(long8):.3f} ({len(long8)})")
    print("wrote", append_csv("mla_decode_grid", rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(16, 6))
    names = [r["workload"] for r in rows]
    xs = range(len(rows))
    for j, (key, label) in enumerate((("ratio_eager", "eager, default call"), ("ratio_graph", "CUDA graph"),
                                      ("fp8_speedup", "FP8 cache vs bf16 (kvforge)"))):  # fmt: skip
        ax.bar([x + (j - 1) * 0.27 for x in xs], [r.get(key, 0.0) for r in rows], 0.27, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9, color="r", lw=0.6, ls="--")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("FlashInfer fa3 time / kvforge time")
    ax.set_title(f"MLA decode, bf16 q, 576/512, {tag} ({gpu}, rev {git_revision()})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    png = RESULTS / f"mla_decode_grid_{tag}.png"
    fig.savefig(png, dpi=110)
    print("wrote", png)


if __name__ == "__main__":
    main()
