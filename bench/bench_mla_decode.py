"""Absorbed-MLA decode attention over a paged latent cache: kvforge's Triton kernel vs FlashInfer's
``BatchMLAPagedAttentionWrapper`` (backend fa3), in the same run.

Workloads (issue 20): 16 heads x 64 requests x 8k tokens and 128 heads x 32 requests x 32k tokens, bf16,
576-wide rows (512 latent + 64 rope), page size 64, pages shuffled. Throughput is the latent cache read once,
``B * L * 576 * 2`` bytes, per second. Both providers are checked against ``mla_decode_attention_ref`` (fp32)
on a few requests (and every output element for being written and finite) before any time is reported; a
provider or launch configuration that fails the check is not timed and cannot be chosen. kvforge's launch
configurations, including every Gluon variant (``md.TRIAL_ENV`` is set here), are swept (each
is timed) and the fastest correct one is reported next to FlashInfer and written by ``--tuned-out``.

    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode.py [--quick]
    python3 bench/bench_mla_decode.py --page 32 --all-heads [--tuned-out FILE]   # bf16, 32-token pages, 4 head classes
    python3 bench/bench_mla_decode.py --fp8 [--page 32] [--tuned-out FILE]   # e4m3 cache vs kvforge's bf16 call

Appends rows to bench/results/mla_decode.csv (GPU name, versions, git revision, date). The seeded grid of any
shape against FlashInfer (``--grid``, ``--random N --seed S``) is bench/bench_mla_decode_grid.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, append_csv, bar_plot, git_revision, host_time, time_gpu, time_graph, time_interleaved
from kvforge.kernels import mla_decode as md
from kvforge.kernels import mla_decode_gluon as mdg
from kvforge.kernels._runtime import arch_name, device_capability

os.environ.setdefault(md.TRIAL_ENV, "1")  # sweep every Gluon variant (each must pass check())
WORKLOADS = [(16, 64, 8192), (128, 32, 32768)]
# --fp8: the e4m3 latent cache (issue 28's target: >= 1.6x kvforge's bf16 call at >= 8k keys), one workload per
# head-count class of the config key, timed against kvforge's own bf16 default call on the same keys.
FP8_WORKLOADS = [(16, 64, 8192), (32, 16, 16384), (64, 16, 16384), (128, 32, 32768)]
FP8_SCALE = 0.5  # dequantisation scale: the cache holds e4m3(x / 0.5)
PAGE = 64
DV, DR = 512, 64


def build(H: int, B: int, L: int, seed: int = 0, page: int = PAGE):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = L // page
    num_pages = B * pages_per
    q = torch.randn(B, H, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(num_pages, page, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32)
    bt = perm.view(B, pages_per).contiguous()
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, kv, bt, sl


def check(name: str, got: torch.Tensor, q, kv, bt, sl, scale: float, rows: int = 3, **kw) -> float:
    """Relative RMSE of the first ``rows`` requests against the fp32 reference (``kw``: its dequantisation
    scale); raises when it is not below 1e-2 or when any element of ``got`` (NaN-filled by the caller before
    the call) is not finite."""
    if not bool(torch.isfinite(got).all()):
        raise RuntimeError(f"{name}: {int((~torch.isfinite(got)).sum())} output elements not written or not finite")
    ref, _ = md.mla_decode_attention_ref(q[:rows], kv, bt[:rows], sl[:rows], softmax_scale=scale, **kw)
    err = (got[:rows].float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    err = float(err)
    if not err < 1e-2:
        raise RuntimeError(f"{name}: relative RMSE {err:.3g} against the fp32 reference")
    return err


def flashinfer_runner(q, kv, bt, sl, H, scale):
    # The grid bench's FlashInfer runner over this bench's dense table (every request bt.shape[1] pages).
    from bench.bench_mla_decode_grid import flashinfer_runner as paged_runner

    kv_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device="cuda") * bt.shape[1]
    return paged_runner(q, kv, sl, kv_indptr, bt.reshape(-1), H, kv.shape[1], scale)


def kvforge_runner(q, kv, bt, sl, scale, out, splits=None, **kw):
    # check_values=False: the table was built valid here (the default call's device-side check is timed by the
    # grid bench); ``kw``: the e4m3 cache's kv_scale_quant_orig.
    return lambda: md.mla_decode_attention(
        q, kv, bt, sl, softmax_scale=scale, out=out, check_values=False, num_splits=splits, **kw
    )


def cfg_label(cfg) -> str:
    kw = cfg.kwargs
    gl = kw.get("GLUON")
    named = (("tma", kw["USE_TMA"]), ("split_dv", kw["SPLIT_DV"]), ("gluon", gl), ("early", gl == 2))
    flags = "".join(f" {name}" for name, on in named if on)
    return f"kvforge BH{kw['BLOCK_H']} BN{kw['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}{flags}"


def default_splits(cfg, B: int, H: int, L: int) -> int:
    """The share grid mla_decode_attention launches for this config and workload (printed with each row; the
    shares themselves are sized on the device from the lengths)."""
    kw = cfg.kwargs
    per_request = -(-H // kw["BLOCK_H"]) * (2 if kw["SPLIT_DV"] else 1)
    max_tiles = -(-L // kw["BLOCK_N"])
    return md.share_grid(B, per_request, max_tiles, md.num_sms(), int(kw.get("PER_SM", 2)), kw["BLOCK_N"])


GLUON_LAUNCHES = [0]


def count_gluon_launches() -> None:
    """Count launches of the Gluon kernel, so each timed row can say which kernel ran."""
    real = mdg.mla_decode_gluon_split

    def counted(*args, **kwargs):
        GLUON_LAUNCHES[0] += 1
        return real(*args, **kwargs)

    mdg.mla_decode_gluon_split = counted


def try_config(
    fn, out: torch.Tensor, q, kv, bt, sl, scale: float, label: str | None = None, **kw
) -> tuple[str, dict, float]:
    """One call of ``fn`` into a NaN-filled ``out``: which kernel ran ("gluon" or "portable"; printed after
    ``label`` before the check when given), then ``check`` against the fp32 reference (``kw``: the e4m3 cache's
    dequantisation scale; raises on a mismatch) and ``time_gpu(fn)``. Returns (kernel, timing, rmse)."""
    out.fill_(float("nan"))
    before = GLUON_LAUNCHES[0]
    fn()
    kernel = "gluon" if GLUON_LAUNCHES[0] > before else "portable"
    if label is not None:
        print(f"{label} runs the {kernel} kernel")
    err = check("kvforge e4m3" if kw else "kvforge", out, q, kv, bt, sl, scale, **kw)
    return kernel, time_gpu(fn), err


def host_us(fn, calls: int = 200) -> float:
    """Host time per call (``bench._common.host_time``); the GPU may still be running when the clock stops."""
    return host_time(fn, calls=calls)[0]


def warm(which: str) -> None:
    """Compile one kvforge config (index into the candidates, per workload) or FlashInfer's kernel, untimed:
    run in parallel before the timed run so that its compiles come from the caches."""
    for H, B, L in WORKLOADS:
        q, kv, bt, sl = build(H, B, L)
        scale = 1.0 / math.sqrt(DV + DR)
        out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        if which == "flashinfer":
            run_fi, _ = flashinfer_runner(q, kv, bt, sl, H, scale)
            run_fi()
        else:
            key = md.config_key(q, kv, DV)
            cands = md._CONFIGS.candidates(device_capability(), key)
            i = int(which)
            if i < len(cands):
                md._SPLIT._chosen[(arch_name(device_capability()), key)] = cands[i]
                try:
                    kvforge_runner(q, kv, bt, sl, scale, out)()
                except Exception as exc:
                    print(f"warm {cfg_label(cands[i])}: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.synchronize()
        del q, kv, bt, sl
        torch.cuda.empty_cache()


def select_heads(workloads: list, heads: str | None) -> list:
    """The workloads whose head count is in ``heads`` (comma-separated), or all of them."""
    return workloads if not heads else [w for w in workloads if str(w[0]) in heads.split(",")]


def sweep_fp8(page: int, tuned_out: str | None, heads: str | None = None) -> None:
    """Every launch configuration ``_keep`` admits for the e4m3 cache (Gluon trial variants included), per
    FP8_WORKLOADS entry, each checked against the fp32 reference over the dequantised cache first; the fastest
    is timed interleaved against kvforge's bf16 default call on the same keys (ratio: bf16 time / e4m3 time)."""
    from kvforge.kernels._fp8 import e4m3_ref

    cap = device_capability()
    arch = arch_name(cap)
    rows = []
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"SMs {md.num_sms()}; e4m3 cache, page {page}")  # fmt: skip
    for H, B, L in select_heads(FP8_WORKLOADS, heads):
        q, kv, bt, sl = build(H, B, L, page=page)
        kv8 = e4m3_ref(kv.float() / FP8_SCALE)
        del kv
        kv16 = (kv8.float() * FP8_SCALE).to(torch.bfloat16)  # the same keys in bf16 (e4m3 values are exact in bf16)
        scale = 1.0 / math.sqrt(DV + DR)
        wl = f"H{H} B{B} L{L} p{page}"
        out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        key = md.config_key(q, kv8, DV)
        cands = md._CONFIGS.candidates(cap, key)
        print(f"{wl:>22} key {key}: {len(cands)} candidates")
        best = None
        for cfg in cands:
            md._SPLIT._chosen[(arch, key)] = cfg
            fn = kvforge_runner(q, kv8, bt, sl, scale, out, kv_scale_quant_orig=FP8_SCALE)
            try:
                kernel, t, err = try_config(fn, out, q, kv8, bt, sl, scale, kv_scale_quant_orig=FP8_SCALE)
            except Exception as exc:  # a config that does not compile, fit or match is reported and skipped
                print(f"{wl:>22} {cfg_label(cfg):>48} failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            print(f"{wl:>22} {cfg_label(cfg):>48} {kernel:>8} {t['ms']:8.3f} ms rmse {err:.2e}")
            if best is None or t["ms"] < best[1]["ms"]:
                best = (cfg, t, err)
        if best is None:
            md._SPLIT._chosen.pop((arch, key), None)
            continue
        md._SPLIT._chosen[(arch, key)] = best[0]
        out16 = torch.empty_like(out)
        fns = {
            "e4m3": kvforge_runner(q, kv8, bt, sl, scale, out, kv_scale_quant_orig=FP8_SCALE),
            "bf16": kvforge_runner(q, kv16, bt, sl, scale, out16),
        }
        fns["bf16"]()
        check("kvforge bf16", out16, q, kv16, bt, sl, scale)
        paired = time_interleaved(fns, samples=300)
        check("kvforge e4m3 (timed)", out, q, kv8, bt, sl, scale, kv_scale_quant_orig=FP8_SCALE)
        ratio = paired["bf16"]["ms"] / paired["e4m3"]["ms"]
        print(f"{wl:>22} best {cfg_label(best[0])}: e4m3 {paired['e4m3']['ms']:.4f} ms, bf16 "
              f"{paired['bf16']['ms']:.4f} ms: {ratio:.3f}x the bf16 call")  # fmt: skip
        for name, t in paired.items():
            rows.append({"workload": wl, "provider": f"kvforge {name}" + (f" {cfg_label(best[0])}" if name == "e4m3"
                         else " default config"), "ms": t["ms"], "ms_p20": t["ms_p20"], "ms_p80": t["ms_p80"],
                         "tb_s": B * L * (DV + DR) * (1 if name == "e4m3" else 2) / (t["ms"] * 1e-3) / 1e12,
                         "rel_rmse": best[2] if name == "e4m3" else float("nan"), "fp8_speedup": ratio,
                         "timing": "interleaved"})  # fmt: skip
        del q, kv8, kv16, bt, sl, out, out16
        torch.cuda.empty_cache()
    chosen = {k: v for k, v in md._SPLIT.chosen().items() if "e4m3" in k}
    print("chosen configs (for kvforge/kernels/tuned):", json.dumps(chosen))
    if tuned_out:
        write_tuned(Path(tuned_out), arch, chosen)
    if rows:
        print("wrote", append_csv("mla_decode", rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick",
        action="store_true",
        help="time only the config the library launches (its committed tuned one)",
    )
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--warm", help="compile only: 'flashinfer' or a candidate index")
    ap.add_argument("--tuned-out", help="write the sm<XY>.json tuned table with the winners merged in here")
    ap.add_argument("--fp8", action="store_true", help="sweep the e4m3-cache configs instead (FP8_WORKLOADS)")
    ap.add_argument("--page", type=int, choices=(32, 64), default=PAGE, help="page size of the caches")
    ap.add_argument(
        "--all-heads",
        action="store_true",
        help="sweep one workload per head-count class of the config key (FP8_WORKLOADS' shapes), not WORKLOADS",
    )
    ap.add_argument("--heads", help="comma-separated head counts: only the workloads with these")
    args = ap.parse_args()
    if args.fp8:
        count_gluon_launches()
        sweep_fp8(args.page, args.tuned_out, args.heads)
        return
    if args.warm is not None:
        warm(args.warm)
        return
    torch.manual_seed(0)
    count_gluon_launches()
    print("Gluon decode path:", mdg._mcg.gluon_unavailable_reason() or "available")
    cap = device_capability()
    arch = arch_name(cap)
    rows = []
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}, SMs {md.num_sms()}")
    print(f"{'workload':>18} {'provider':>48} {'splits':>6} {'ms':>8} {'TB/s':>6} {'TFLOP/s':>7}  check")
    workloads = select_heads(FP8_WORKLOADS if args.all_heads else WORKLOADS, args.heads)
    suffix = "" if args.page == PAGE else f" p{args.page}"
    for H, B, L in workloads:
        q, kv, bt, sl = build(H, B, L, page=args.page)
        scale = 1.0 / math.sqrt(DV + DR)
        nbytes = B * L * (DV + DR) * 2
        flops = 2 * B * H * L * (DV + DR + DV)
        wl = f"H{H} B{B} L{L}{suffix}"
        out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        key = md.config_key(q, kv, DV)
        cands = md._CONFIGS.candidates(cap, key)
        print(f"{wl:>18} key {key}: {len(cands)} candidates kept by _keep")

        def line(label, splits, t, err, wl=wl, nbytes=nbytes, flops=flops):
            ms = t["ms"]
            print(
                f"{wl:>18} {label:>48} {splits:>6} {ms:8.3f} {nbytes / (ms * 1e-3) / 1e12:6.2f} "
                f"{flops / (ms * 1e-3) / 1e12:7.0f}  rmse {err:.2e} (p20 {t['ms_p20']:.3f} p80 {t['ms_p80']:.3f})"
            )

        if args.quick:
            # What a user's call launches: the committed tuned config for this key, else the first candidate
            # (the candidate list above follows the table's order, not the tuned choice).
            md._SPLIT._chosen.pop((arch, key), None)
            cands = [md._SPLIT.config_for(key)]
        best = None  # (label, t, err, cfg, splits)
        for cfg in cands:
            md._SPLIT._chosen[(arch, key)] = cfg
            fn = kvforge_runner(q, kv, bt, sl, scale, out)
            splits = default_splits(cfg, B, H, L)
            try:
                _, t, err = try_config(fn, out, q, kv, bt, sl, scale, label=f"{wl:>18} {cfg_label(cfg):>48}")
            except Exception as exc:  # a config that does not compile, fit or match is reported and skipped
                print(f"{wl:>18} {cfg_label(cfg):>48} failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            line(cfg_label(cfg), splits, t, err)
            if best is None or t["ms"] < best[1]["ms"]:
                best = (cfg_label(cfg), t, err, cfg, None)
        if best is not None and not args.quick:
            # The best config with other split counts (a runtime argument: no new compile).
            md._SPLIT._chosen[(arch, key)] = best[3]
            for splits in (1, 2, 3, 4, 6, 8, 16):
                fn = kvforge_runner(q, kv, bt, sl, scale, out, splits)
                try:
                    out.fill_(float("nan"))
                    fn()
                    err = check("kvforge", out, q, kv, bt, sl, scale)
                    t = time_gpu(fn)
                except Exception as exc:  # reported; this split count is not a candidate
                    print(f"{wl:>18} {best[0]:>48} {splits:>6} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                line(best[0], splits, t, err)
                if t["ms"] < best[1]["ms"]:
                    best = (best[0], t, err, best[3], splits)
        if best is None:  # no config passed its check: none may be written as this key's tuned config
            md._SPLIT._chosen.pop((arch, key), None)
            continue
        md._SPLIT._chosen[(arch, key)] = best[3]
        label, _, err, cfg, splits = best
        fn = kvforge_runner(q, kv, bt, sl, scale, out, splits)
        fns = {"kvforge": fn}
        errs = {"kvforge": err}
        labels = {"kvforge": label + (f" splits={splits}" if splits else " default splits")}
        if not args.no_flashinfer:
            try:
                run_fi, fi_out = flashinfer_runner(q, kv, bt, sl, H, scale)
                run_fi()
                errs["flashinfer"] = check("flashinfer", fi_out, q, kv, bt, sl, scale)
                fns["flashinfer"] = run_fi
                labels["flashinfer"] = "flashinfer fa3"
            except Exception as exc:
                print(f"{wl:>18} {'flashinfer fa3':>48} not run: {type(exc).__name__}: {str(exc)[:300]}")
        # Same-run comparison, sample by sample in turn (each call behind its own L2 flush).
        paired = time_interleaved(fns, samples=600)
        for name, t in paired.items():
            extra = {}
            try:
                extra["graph_ms"] = time_graph(fns[name])["ms"]
            except Exception as exc:  # a provider that cannot be captured still has its eager time
                print(f"{wl:>18} {labels[name]}: no CUDA-graph time ({type(exc).__name__}: {str(exc)[:120]})")
            extra["host_us"] = host_us(fns[name])
            ratio = paired["flashinfer"]["ms"] / t["ms"] if "flashinfer" in paired else float("nan")
            line(labels[name] + " (paired)", (splits or "") if name == "kvforge" else "", t, errs[name])
            print(
                f"{wl:>18} {labels[name]:>48}: {ratio:.3f} x FlashInfer's throughput (paired medians); graph "
                f"{extra.get('graph_ms', float('nan')):.3f} ms, host {extra['host_us']:.1f} us/call"
            )
            rows.append(
                {
                    "workload": wl,
                    "provider": labels[name],
                    "ms": t["ms"],
                    "ms_p20": t["ms_p20"],
                    "ms_p80": t["ms_p80"],
                    "tb_s": nbytes / (t["ms"] * 1e-3) / 1e12,
                    "tflop_s": flops / (t["ms"] * 1e-3) / 1e12,
                    "rel_rmse": errs[name],
                    "ratio_vs_flashinfer": ratio,
                    "timing": "interleaved",
                    **extra,
                }
            )
        del q, kv, bt, sl, out
        torch.cuda.empty_cache()
    chosen = md._SPLIT.chosen()
    print("chosen configs (for kvforge/kernels/tuned):", json.dumps(chosen))
    if args.tuned_out:
        write_tuned(Path(args.tuned_out), arch, chosen)
    if rows:
        print("wrote", append_csv("mla_decode", rows))
        groups = sorted({r["workload"] for r in rows}, key=[f"H{h} B{b} L{n}{suffix}" for h, b, n in workloads].index)
        series = {
            prov: [next((r["tb_s"] for r in rows if r["workload"] == g and r["provider"].startswith(prov)), 0.0)
                   for g in groups]
            for prov in ("kvforge", "flashinfer")
        }  # fmt: skip
        png = bar_plot(
            RESULTS / f"mla_decode{suffix.replace(' ', '_')}{'_heads' if args.all_heads else ''}.png",
            f"MLA decode, bf16, 576/512, page {args.page} ({torch.cuda.get_device_name()}, rev {git_revision()})",
            groups,
            series,
            "latent cache read, TB/s (higher is better)",
        )
        print("wrote", png)


def write_tuned(path: Path, arch: str, chosen: dict) -> None:
    """The committed table (kvforge/kernels/tuned/<arch>.json) with this run's decode winners merged in."""
    table = json.loads(path.read_text()) if path.exists() else {}
    entries = table.setdefault(md._SPLIT.name, {})
    for k, cfg in chosen.items():
        a, key = k.split("|", 1)
        if a == arch:
            entries[key] = cfg
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
