"""Absorbed-MLA decode attention over a paged latent cache: kvforge's Triton kernel vs FlashInfer's
``BatchMLAPagedAttentionWrapper`` (backend fa3), in the same run.

Workloads (issue 20): 16 heads x 64 requests x 8k tokens and 128 heads x 32 requests x 32k tokens, bf16,
576-wide rows (512 latent + 64 rope), page size 64, pages shuffled. Throughput is the latent cache read once,
``B * L * 576 * 2`` bytes, per second. Both providers are checked against ``mla_decode_attention_ref`` (fp32)
on a few requests before any time is reported; a provider that fails the check is not timed. kvforge's launch
configurations are swept (each is timed) and the best is reported next to FlashInfer.

    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/bench_mla_decode.py [--quick]

Appends rows to bench/results/mla_decode.csv (GPU name, versions, git revision, date).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import append_csv, time_gpu
from kvforge.kernels import mla_decode as md
from kvforge.kernels._runtime import arch_name, device_capability

WORKLOADS = [(16, 64, 8192), (128, 32, 32768)]
PAGE = 64
DV, DR = 512, 64


def build(H: int, B: int, L: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = L // PAGE
    num_pages = B * pages_per
    q = torch.randn(B, H, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(num_pages, PAGE, DV + DR, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32)
    bt = perm.view(B, pages_per).contiguous()
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, kv, bt, sl


def check(name: str, got: torch.Tensor, q, kv, bt, sl, scale: float, rows: int = 3) -> float:
    ref, _ = md.mla_decode_attention_ref(q[:rows], kv, bt[:rows], sl[:rows], softmax_scale=scale)
    err = (got[:rows].float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    err = float(err)
    if not err < 1e-2:
        raise RuntimeError(f"{name}: relative RMSE {err:.3g} against the fp32 reference")
    return err


def flashinfer_runner(q, kv, bt, sl, H, scale):
    import flashinfer

    B = q.shape[0]
    ckv = kv[..., :DV].contiguous()
    kpe = kv[..., DV:].contiguous()
    q_nope, q_pe = q[..., :DV].contiguous(), q[..., DV:].contiguous()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    pages_per = bt.shape[1]
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * pages_per
    w.plan(qo_indptr, kv_indptr, bt.reshape(-1), sl, H, DV, DR, PAGE, False, scale, torch.bfloat16, torch.bfloat16)
    out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
    return lambda: w.run(q_nope, q_pe, ckv, kpe, out=out), out


def kvforge_runner(q, kv, bt, sl, scale, out, splits=None):
    # check_values=False: the table was built valid here, and the check's device->host read is not kernel time.
    return lambda: md.mla_decode_attention(
        q, kv, bt, sl, softmax_scale=scale, out=out, check_values=False, num_splits=splits
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="time the best-known config only")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    arch = arch_name(device_capability())
    rows = []
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, SMs {md.num_sms()}")
    print(f"{'workload':>22} {'provider':>34} {'ms':>8} {'TB/s':>6}  check")
    for H, B, L in WORKLOADS:
        q, kv, bt, sl = build(H, B, L)
        scale = 1.0 / math.sqrt(DV + DR)
        nbytes = B * L * (DV + DR) * 2
        wl = f"H{H} B{B} L{L}"
        out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        key = md.config_key(q, kv, DV)
        cands = md._CONFIGS.candidates(device_capability(), key)
        if args.quick:
            cands = cands[:1]
        best = None
        for cfg in cands:
            md._SPLIT._chosen[(arch, key)] = cfg
            fn = kvforge_runner(q, kv, bt, sl, scale, out)
            try:
                fn()
                err = check("kvforge", out, q, kv, bt, sl, scale)
                t = time_gpu(fn)
            except Exception as exc:  # a config that does not compile or fit is reported and skipped
                print(
                    f"{wl:>22} {'kvforge ' + str(cfg.kwargs) + f' w{cfg.num_warps} s{cfg.num_stages}':>34} "
                    f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                )
                continue
            label = f"kvforge BH{cfg.kwargs['BLOCK_H']} BN{cfg.kwargs['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}"
            tbs = nbytes / (t["ms"] * 1e-3) / 1e12
            print(f"{wl:>22} {label:>34} {t['ms']:8.3f} {tbs:6.2f}  rmse {err:.2e}")
            if best is None or t["ms"] < best[1]["ms"]:
                best = (label, t, err, cfg)
        if best is not None and not args.quick:
            # The best config with other split counts (a runtime argument: no new compile).
            label = best[0]
            md._SPLIT._chosen[(arch, key)] = best[3]
            for splits in (1, 2, 3, 4, 6, 8, 12, 16):
                fn = kvforge_runner(q, kv, bt, sl, scale, out, splits)
                fn()
                err = check("kvforge", out, q, kv, bt, sl, scale)
                t = time_gpu(fn)
                print(
                    f"{wl:>22} {label + f' splits={splits}':>34} {t['ms']:8.3f} "
                    f"{nbytes / (t['ms'] * 1e-3) / 1e12:6.2f}  rmse {err:.2e}"
                )
                if t["ms"] < best[1]["ms"]:
                    best = (label + f" splits={splits}", t, err, best[3])
            md._SPLIT._chosen[(arch, key)] = best[3]
        fi = None
        if not args.no_flashinfer:
            try:
                run_fi, fi_out = flashinfer_runner(q, kv, bt, sl, H, scale)
                run_fi()
                err = check("flashinfer", fi_out, q, kv, bt, sl, scale)
                t = time_gpu(run_fi)
                fi = (t, err)
                tbs = nbytes / (t["ms"] * 1e-3) / 1e12
                print(f"{wl:>22} {'flashinfer fa3':>34} {t['ms']:8.3f} {tbs:6.2f}  rmse {err:.2e}")
            except Exception as exc:
                print(f"{wl:>22} {'flashinfer fa3':>34} not run: {type(exc).__name__}: {str(exc)[:300]}")
        if best is not None:
            label, t, err, _ = best
            ratio = (fi[0]["ms"] / t["ms"]) if fi else float("nan")
            print(
                f"{wl:>22} best kvforge {label}: {nbytes / (t['ms'] * 1e-3) / 1e12:.2f} TB/s, "
                f"{ratio:.3f} x FlashInfer's throughput"
            )
            rows.append(
                {
                    "workload": wl,
                    "provider": label,
                    "ms": t["ms"],
                    "ms_p20": t["ms_p20"],
                    "ms_p80": t["ms_p80"],
                    "tb_s": nbytes / (t["ms"] * 1e-3) / 1e12,
                    "rel_rmse": err,
                    "ratio_vs_flashinfer": ratio,
                }
            )
        if fi is not None:
            t, err = fi
            rows.append(
                {
                    "workload": wl,
                    "provider": "flashinfer fa3",
                    "ms": t["ms"],
                    "ms_p20": t["ms_p20"],
                    "ms_p80": t["ms_p80"],
                    "tb_s": nbytes / (t["ms"] * 1e-3) / 1e12,
                    "rel_rmse": err,
                    "ratio_vs_flashinfer": 1.0,
                }
            )
        torch.cuda.empty_cache()
    print("chosen configs (for kvforge/kernels/tuned):", md._SPLIT.chosen())
    if rows:
        print("wrote", append_csv("mla_decode", rows))


if __name__ == "__main__":
    main()
