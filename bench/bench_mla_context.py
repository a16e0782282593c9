"""MLA context attention over cached prefixes: kvforge FP8 / bf16 against its peers, same run, on one GPU.

Workloads (32 heads, d_qk 192, d_v 128): (batch, cached prefix, new rows) = (4, 8192, 2048), (1, 0, 16384),
(16, 4096, 512), (64, 16384, 64), and a mixed batch (one 16k prefill among 32 extends of 256 rows over 4k
prefixes). Providers: kvforge FP8 (Q/K/V e4m3, V dim-major), kvforge FP8 with token-major V, kvforge bf16,
FlexAttention bf16 (prefix-causal block mask), SDPA cuDNN (lower-right causal), FlashInfer FA3 bf16 (ragged),
FlashInfer FP8 (ragged) where it builds. Every provider's output is checked against the fp32 reference first;
a provider that fails the check is not reported. FLOPs = Σ_r 2·H·(d_qk + d_v)·q_len·(kv_len − (q_len − 1)/2).

    python bench/bench_mla_context.py [--out DIR] [--quick] [--tune] [--warm-peers] [--precompile N]
        [--only REGEX] [--max-tune-seconds S] [--jobs N] [--no-warm] [--deadline-s S] [--workloads A,B]

``--tune`` (one command, time-boxed): starts the peers' JIT warm-up (FlashInfer's FA3 build, FlexAttention's
compiles) in a niced background process, compiles the sweep's kvforge kernels in ``--jobs`` processes, times
the sweep candidates per key (each row with its seconds), keeps the fastest correct one per key, writes
``DIR/sm90.json`` in the committed-file layout (the committed file with this kernel's keys replaced: copy it
over ``kvforge/kernels/tuned/sm90.json``), waits for the warm-up and benchmarks every provider with the chosen
configs: the target pairs first, so ``--deadline-s`` (skip whatever is left after S seconds) drops only the
least important ones. ``--warm-peers`` only JIT-compiles the peers; ``--precompile N`` only compiles the sweep.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import kvforge.kernels  # noqa: F401  (before triton: turns on the interpreter on CPU-only machines)
from bench._common import RESULTS, ReferenceMismatch, append_csv, bar_plot, env_stamp, time_gpu
from kvforge.kernels import mla_context as mc
from kvforge.kernels._runtime import arch_name, config_to_json, device_capability

H, DQK, DV = 32, 192, 128
FP8 = torch.float8_e4m3fn
KV_SCALE = 1.0  # kv_scale_quant_orig of the FP8 inputs (the value does not change the speed)

WORKLOADS: dict[str, tuple[list[int], list[int]]] = {
    "4x(8192+2048)": ([2048] * 4, [8192] * 4),
    "1x(0+16384)": ([16384], [0]),
    "16x(4096+512)": ([512] * 16, [4096] * 16),
    "64x(16384+64)": ([64] * 64, [16384] * 64),
    "mixed 16k+32x(4096+256)": ([16384] + [256] * 32, [0] + [4096] * 32),
}
ANCHORS = ["4x(8192+2048)", "1x(0+16384)", "16x(4096+512)"]

# Sweep candidates (BLOCK_M, BLOCK_N, warps, stages, EXP_POLY, USE_TMA, PIPE_QK, HEADS_OUTER) per kernel key; the
# table in kvforge.kernels.mla_context holds the safe defaults, this list what the H200 is asked. A "/short" key is
# the short-query class (batches whose longest query has <= mc.SHORT_Q_ROWS rows), timed on such workloads only. The
# first candidate of each key is the current choice (always measured); the rest are what is still open after the
# carried sweep stopped serialising bf16's matrix instructions (ptxas C7515, see _carried_sweep). Measured so far
# (TFLOP/s geomean, H200): heads outer ("+ho") +1-9% on long queries (13b5cd8), -8% on short ones; +pipe2 +10-12% FP8
# (a55e342, 1ba09ff), -18% bf16 while serialised and +4-6% once not (a01c531); "+pipe" -5-16% (scores two blocks
# ahead, 7ba5161); 256x32 w16 -18% (1ba09ff). Every one compiles for sm_90 with Triton 3.6 without spills and without
# C7515 (.gpu_out/cc.py).
_C = mc._cfg
SWEEP: dict[str, list] = {
    "fp8_dim": [_C(128, 128, 8, 4, 0, 1, 2, 1), _C(128, 128, 8, 3, 0, 1, 2, 1)],
    "bf16": [_C(128, 64, 8, 4, 0, 1, 2, 1), _C(128, 64, 8, 3, 0, 1, 2, 1), _C(128, 64, 8, 3, 0, 1, 0, 1)],
    "fp8_dim/short": [_C(64, 64, 4, 3, 0, 1, 2), _C(64, 64, 4, 3, 0, 1)],
    "bf16/short": [_C(64, 64, 4, 2, 0, 1), _C(64, 64, 4, 2, 0, 1, 2)],
    "fp8_tok": [_C(128, 128, 8, 3, 0, 1, 2, 1)],
    "fp8_tok/short": [_C(64, 64, 4, 3, 0, 1)],
}  # fmt: skip


def sweep_order() -> list[tuple[str, object]]:
    """(key, config) in measuring order: round r takes every key's r-th candidate, so a time box that stops
    the sweep early still has each key's current choice and its most likely challengers measured."""
    out = []
    for r in range(max(len(c) for c in SWEEP.values())):
        out += [(key, cands[r]) for key, cands in SWEEP.items() if r < len(cands)]
    return out


def base_mode(key: str) -> str:
    return key.split("/")[0]


def is_short(inp: Inputs) -> bool:
    return bool(inp.q_lens) and 0 < max(inp.q_lens) <= mc.SHORT_Q_ROWS


def cfg_str(cfg) -> str:
    k = cfg.kwargs
    extra = ("+poly" if k.get("EXP_POLY") else "") + ("+tma" if k.get("USE_TMA") else "")
    pipe = k.get("PIPE_QK", 0)
    extra += ("+pipe" if pipe == 1 else f"+pipe{pipe}" if pipe else "") + ("+ho" if k.get("HEADS_OUTER") else "")
    return f"{k['BLOCK_M']}x{k['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}{extra}"


def flops(q_lens: list[int], cached: list[int], heads: int = H) -> float:
    return sum(2 * heads * (DQK + DV) * q * (c + q - (q - 1) / 2) for q, c in zip(q_lens, cached))


def cu(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


class Inputs:
    """One workload's tensors in every layout the providers want (built once, outside the timings)."""

    def __init__(self, name: str, device: torch.device, seed: int = 0, heads: int = H) -> None:
        self.name = name
        self.q_lens, self.cached = WORKLOADS[name]
        self.kv_lens = [a + b for a, b in zip(self.q_lens, self.cached)]
        self.heads = heads
        self.cu_q, self.cu_kv = cu(self.q_lens, device), cu(self.kv_lens, device)
        tq, tkv = sum(self.q_lens), sum(self.kv_lens)
        g = torch.Generator(device=device).manual_seed(seed)
        self.q16 = torch.randn(tq, heads, DQK, generator=g, device=device, dtype=torch.bfloat16)
        self.k16 = torch.randn(tkv, heads, DQK, generator=g, device=device, dtype=torch.bfloat16)
        self.v16 = torch.randn(tkv, heads, DV, generator=g, device=device, dtype=torch.bfloat16)
        # Caller-side quantisation e4m3(x * kv_scale_orig_quant), with kv_scale_orig_quant = 1 / KV_SCALE.
        q8 = lambda x: (x * (1.0 / KV_SCALE)).clamp(-448, 448).to(FP8)
        self.q8, self.k8, self.v8 = q8(self.q16), q8(self.k16), q8(self.v16)
        self.v8_dim = mc.v_to_dim_major(self.v8)
        self.flops = flops(self.q_lens, self.cached, heads)
        self.uniform = len(set(self.q_lens)) == 1 and len(set(self.cached)) == 1

    def reference(self, fp8: bool) -> torch.Tensor:
        q, k, v = (self.q8, self.k8, self.v8) if fp8 else (self.q16, self.k16, self.v16)
        out, _ = mc.mla_context_attention_ref(
            q, k, v, self.cu_q.cpu(), self.cu_kv.cpu(), kv_scale_quant_orig=KV_SCALE if fp8 else 1.0, head_chunk=8
        )
        return out

    def batched(self):
        """[B, H, N, D] copies for FlexAttention / SDPA (uniform workloads)."""
        b, n, p = len(self.q_lens), self.q_lens[0], self.cached[0]
        q = self.q16.view(b, n, self.heads, DQK).transpose(1, 2).contiguous()
        k = self.k16.view(b, n + p, self.heads, DQK).transpose(1, 2).contiguous()
        v = self.v16.view(b, n + p, self.heads, DV).transpose(1, 2).contiguous()
        return q, k, v


def check(name: str, out: torch.Tensor, ref: torch.Tensor, fp8: bool) -> float:
    """rel-RMSE and max error against the reference; raises ReferenceMismatch (the provider is not reported)."""
    a, e = out.float(), ref.float()
    if not torch.isfinite(a).all():
        raise ReferenceMismatch(f"{name}: non-finite output")
    rel = float((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30))
    err = float((a - e).abs().max())
    lim_rel, lim_abs = (0.035, 0.25) if fp8 else (0.01, 0.06)
    if rel > lim_rel or err > lim_abs:
        raise ReferenceMismatch(f"{name}: rel-RMSE {rel:.3g} (limit {lim_rel}), max err {err:.3g} (limit {lim_abs})")
    return rel


# ----------------------------------------------------------------------------------------------------- providers


def kvforge_provider(inp: Inputs, mode: str, config=None):
    """mode: 'fp8_dim' | 'fp8_tok' | 'bf16'. Returns (fn, plan); the plan is made once, like a serving step."""
    fp8 = mode.startswith("fp8")
    layout = "dim_major" if mode == "fp8_dim" else "token_major"
    q, k = (inp.q8, inp.k8) if fp8 else (inp.q16, inp.k16)
    v = inp.v8_dim if mode == "fp8_dim" else (inp.v8 if fp8 else inp.v16)
    plan = mc.MLAContextPlan.plan(
        inp.cu_q, inp.cu_kv, num_heads=inp.heads, num_kv_heads=inp.heads, head_dim_qk=DQK, head_dim_v=DV,
        q_dtype=q.dtype, kv_dtype=k.dtype, v_layout=layout, config=config,
    )  # fmt: skip
    out = torch.empty(q.shape[0], inp.heads, DV, device=q.device, dtype=torch.bfloat16)
    scale = KV_SCALE if fp8 else 1.0
    return (lambda: plan.run(q, k, v, kv_scale_quant_orig=scale, out=out)), plan


def flex_provider(inp: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fa = torch.compile(flex_attention, dynamic=False)
    dev = inp.q16.device
    if inp.uniform and inp.q_lens[0] >= 128:  # shorter query blocks fail to compile in Inductor (192/128, H200)
        q, k, v = inp.batched()
        p = inp.cached[0]
        bm = create_block_mask(lambda b, h, qi, ki: qi + p >= ki, None, None, q.shape[2], k.shape[2], device=dev)
        b, n = len(inp.q_lens), inp.q_lens[0]
        return (lambda: fa(q, k, v, block_mask=bm)), lambda o: o.transpose(1, 2).reshape(b * n, inp.heads, DV)
    # Ragged batch packed into one sequence: a key is visible when it belongs to the query's request and lies
    # at or before the query's diagonal.
    q_doc = torch.repeat_interleave(torch.arange(len(inp.q_lens), device=dev), torch.tensor(inp.q_lens, device=dev))
    kv_doc = torch.repeat_interleave(torch.arange(len(inp.kv_lens), device=dev), torch.tensor(inp.kv_lens, device=dev))
    q_pos = torch.arange(q_doc.numel(), device=dev) - inp.cu_q[:-1].long()[q_doc]
    kv_pos = torch.arange(kv_doc.numel(), device=dev) - inp.cu_kv[:-1].long()[kv_doc]
    prefix = torch.tensor(inp.cached, device=dev)

    def mask(b, h, qi, ki):
        return (q_doc[qi] == kv_doc[ki]) & (kv_pos[ki] <= prefix[q_doc[qi]] + q_pos[qi])

    bm = create_block_mask(mask, None, None, q_doc.numel(), kv_doc.numel(), device=dev, _compile=True)
    q = inp.q16.transpose(0, 1).unsqueeze(0).contiguous()
    k = inp.k16.transpose(0, 1).unsqueeze(0).contiguous()
    v = inp.v16.transpose(0, 1).unsqueeze(0).contiguous()
    return (lambda: fa(q, k, v, block_mask=bm)), lambda o: o[0].transpose(0, 1)


def sdpa_cudnn_provider(inp: Inputs):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    if inp.uniform:
        q, k, v = inp.batched()
        mask = causal_lower_right(q.shape[2], k.shape[2])
        b, n = len(inp.q_lens), inp.q_lens[0]

        def fn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return fn, lambda o: o.transpose(1, 2).reshape(b * n, inp.heads, DV)
    # Ragged batch: one call per request (SDPA has no varlen form with a lower-right mask).
    cq, ckv = inp.cu_q.tolist(), inp.cu_kv.tolist()
    parts = []
    for r in range(len(inp.q_lens)):
        q = inp.q16[cq[r] : cq[r + 1]].transpose(0, 1)[None].contiguous()
        k = inp.k16[ckv[r] : ckv[r + 1]].transpose(0, 1)[None].contiguous()
        v = inp.v16[ckv[r] : ckv[r + 1]].transpose(0, 1)[None].contiguous()
        parts.append((q, k, v, causal_lower_right(q.shape[2], k.shape[2])))

    def fn_loop():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=m) for q, k, v, m in parts]

    return fn_loop, lambda outs: torch.cat([o[0].transpose(0, 1) for o in outs])


_FI_WS: dict[str, torch.Tensor] = {}


def flashinfer_provider(inp: Inputs, fp8: bool):
    import flashinfer

    dev = inp.q16.device
    ws = _FI_WS.setdefault("ws", torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    dt = FP8 if fp8 else torch.bfloat16
    w.plan(inp.cu_q, inp.cu_kv, inp.heads, inp.heads, DQK, head_dim_vo=DV, causal=True, q_data_type=dt, kv_data_type=dt)
    q, k, v = (inp.q8, inp.k8, inp.v8) if fp8 else (inp.q16, inp.k16, inp.v16)
    return (lambda: w.run(q, k, v)), lambda o: o.float() * (KV_SCALE if fp8 else 1.0)


PEERS: dict[str, Callable] = {
    "FlexAttention bf16": flex_provider,
    "SDPA cuDNN bf16": sdpa_cudnn_provider,
    "FlashInfer FA3 bf16": lambda inp: flashinfer_provider(inp, False),
}
# FlashInfer 0.2.14's ragged FA3 prefill does not build for e4m3 Q/K/V at 192/128 on the H200 (its JIT ninja build
# fails; seen 2026-11-29, as the anchors recorded): tried only on request, as each failed build costs ~20 s.
FLASHINFER_FP8 = "FlashInfer FA3 fp8"
KVFORGE = {"kvforge fp8": "fp8_dim", "kvforge fp8 (token-major V)": "fp8_tok", "kvforge bf16": "bf16"}


# ----------------------------------------------------------------------------------------------------- phases


def fp8_matmul_tflops(device) -> float:
    m = 8192
    a = torch.randn(m, m, device=device).to(FP8)
    b = torch.randn(m, m, device=device).to(FP8).t().contiguous().t()
    one = torch.ones((), device=device)
    ms = time_gpu(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))["ms"]
    return 2 * m**3 / ms / 1e9


def resources(handle) -> dict[str, int]:
    """Registers per thread, spills and shared memory of a compiled kernel (Triton's handle)."""
    try:
        meta = handle.metadata
        shared = meta.shared if hasattr(meta, "shared") else meta["shared"]
        return {"regs": int(handle.n_regs), "spills": int(handle.n_spills), "smem": int(shared)}
    except Exception:  # the interpreter returns no compiled handle
        return {}


def tune(
    inputs: dict[str, Inputs],
    refs: dict[tuple[str, bool], torch.Tensor],
    log,
    *,
    only: str | None = None,
    max_seconds: float = float("inf"),
) -> dict[str, object]:
    """Time the sweep candidates per key; keep the fastest whose output passes the reference check.

    Normal keys are timed on every workload with longer queries, "/short" keys on the short-query workloads.
    ``only``: a regular expression on "KEY CONFIG" (e.g. ``fp8_dim.*s4``) limiting the candidates, besides each
    key's first (current) one. After ``max_seconds`` only the first candidate of each untimed key is measured.
    """
    import re

    t0 = time.time()
    rows: dict[str, list] = {}
    for key, cfg in sweep_order():
        mode, short = base_mode(key), key.endswith("/short")
        fp8 = mode.startswith("fp8")
        first = cfg is SWEEP[key][0]
        label = f"{key:14s} {cfg_str(cfg):20s}"
        if not first and only and not re.search(only, f"{key} {cfg_str(cfg)}"):
            continue
        if not first and time.time() - t0 > max_seconds:
            log(f"  {label} not measured (--max-tune-seconds {max_seconds:.0f} reached)")
            continue
        names = [n for n in inputs if is_short(inputs[n]) == short]
        if not names:
            continue
        t_cand = time.time()
        try:
            tf = []
            for n in names:
                fn, plan = kvforge_provider(inputs[n], mode, cfg)
                out = fn()
                check(f"{key} {cfg_str(cfg)} {n}", out, refs[(n, fp8)], fp8)
                # Best of two: the peers' JIT warm-up runs beside the sweep and can take the GPU for a moment
                # (one candidate read 303 against 527 TFLOP/s on its first workload at a01c531).
                ms = min(time_gpu(fn, warmup=10, rep=40)["ms"] for _ in range(2))
                tf.append(inputs[n].flops / ms / 1e9)
            res = resources(plan._launch(*_launch_args(plan, inputs[names[-1]], mode)))
            geo = math.exp(sum(math.log(x) for x in tf) / len(tf))
            rows.setdefault(key, []).append((geo, cfg, tf, names))
            log(f"  {label} geo {geo:7.1f} TFLOP/s  " + " ".join(f"{x:6.1f}" for x in tf)
                + f"  {res}  [{time.time() - t_cand:.1f}s, at {time.time() - t0:.0f}s]")  # fmt: skip
        except ReferenceMismatch as e:
            log(f"  {label} WRONG: {e}")
        except Exception as e:  # a config that does not compile or fit is skipped
            log(f"  {label} FAILED: {type(e).__name__}: {str(e)[:200]}")
    chosen = {}
    for key, rs in rows.items():
        best = max(rs, key=lambda r: r[0])
        chosen[key] = best[1]
        log(f"  -> {key}: {cfg_str(best[1])} ({best[0]:.1f} TFLOP/s geomean over {best[3]})")
    log(f"  sweep: {time.time() - t0:.0f}s")
    return chosen


def _launch_args(plan, inp: Inputs, mode: str):
    fp8 = mode.startswith("fp8")
    q, k = (inp.q8, inp.k8) if fp8 else (inp.q16, inp.k16)
    v = inp.v8_dim if mode == "fp8_dim" else (inp.v8 if fp8 else inp.v16)
    out = torch.empty(q.shape[0], inp.heads, DV, device=q.device, dtype=torch.bfloat16)
    return q, k, v, out, None, 1.0 / math.sqrt(DQK), KV_SCALE if fp8 else 1.0, None


_KEYS = {
    "bf16": (DQK, DV, "bf16", "bf16", "token_major"),
    "fp8_dim": (DQK, DV, "e4m3", "e4m3", "dim_major"),
    "fp8_tok": (DQK, DV, "e4m3", "e4m3", "token_major"),
}


def kernel_key(key: str) -> tuple:
    return _KEYS[base_mode(key)] + (("short_q",) if key.endswith("/short") else ())


def record_chosen(chosen: dict[str, object]) -> None:
    """Make the tuned configs this process's choice for their keys (what ``plan()`` without a config uses)."""
    arch = arch_name(device_capability())
    for key, cfg in chosen.items():
        mc._KERNEL._chosen[(arch, kernel_key(key))] = cfg


def write_tuned(out_dir: Path, chosen: dict[str, object]) -> Path:
    """``<out_dir>/sm90.json`` in the committed-file layout: the committed file (every kernel's section) with this
    kernel's tuned keys replaced, so it can be copied over ``kvforge/kernels/tuned/sm90.json`` as it is."""
    arch = arch_name(device_capability())
    committed = Path(mc.__file__).with_name("tuned") / f"{arch}.json"
    data = json.loads(committed.read_text()) if committed.exists() else {}
    section = data.setdefault(mc._KERNEL.name, {})
    for key, cfg in chosen.items():
        section[",".join(str(x) for x in kernel_key(key))] = config_to_json(cfg)
    path = out_dir / f"{arch}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def warm_peers(names: list[str], device) -> None:
    """JIT-compile FlashInfer and FlexAttention for every workload (no timing). FlashInfer first: one module
    serves every workload, and its build is the longest."""
    peers = [p for p in PEERS if not p.startswith("SDPA")]
    peers.sort(key=lambda p: not p.startswith("FlashInfer"))
    for peer in peers:
        for n in names if not peer.startswith("FlashInfer") else names[:1]:
            inp = Inputs(n, device)
            t0 = time.time()
            try:
                fn, _ = PEERS[peer](inp)
                fn()
                torch.cuda.synchronize()
                print(f"warm {peer} {n}: {time.time() - t0:.1f}s", flush=True)
            except Exception as e:
                print(f"warm {peer} {n}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            del inp
            torch.cuda.empty_cache()


def _compile_one(args) -> str:
    mode, kw, warps, stages = args
    import triton

    import kvforge.kernels.mla_context as m

    cfg = triton.Config(kw, num_warps=warps, num_stages=stages)
    dev = torch.device("cuda")
    WORKLOADS["_tiny"] = ([144, 16], [208, 16])  # multiples of 16, like the workloads: same specialisation
    t0 = time.time()
    try:
        inp = Inputs("_tiny", dev)
        fn, _ = kvforge_provider(inp, mode, cfg)
        fn()
        torch.cuda.synchronize()
        del m
        return f"compiled {mode} {cfg_str(cfg)} in {time.time() - t0:.1f}s"
    except Exception as e:
        return f"compile {mode} {cfg_str(cfg)} FAILED: {type(e).__name__}: {str(e)[:300]}"


def precompile(n_proc: int, log=print, timeout: float | None = None) -> None:
    """Compile every distinct sweep kernel in ``n_proc`` processes; Triton's disk cache then serves the timing.
    After ``timeout`` seconds the unfinished compiles are abandoned (the sweep compiles those inline)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = {}
    for key, cs in SWEEP.items():
        for c in cs:
            job = (base_mode(key), dict(c.kwargs), c.num_warps, c.num_stages)
            jobs[repr(job)] = job
    ex = cf.ProcessPoolExecutor(max_workers=n_proc, mp_context=mp.get_context("spawn"))
    futures = [ex.submit(_compile_one, job) for job in jobs.values()]
    done, pending = cf.wait(futures, timeout=timeout)
    for f in futures:
        if f in done:
            log(f.result() if f.exception() is None else f"compile FAILED: {f.exception()!r}")
    if pending:
        log(f"precompile: {len(pending)} of {len(futures)} unfinished after {timeout:.0f}s, left to the sweep")
        workers = list(getattr(ex, "_processes", {}).values())  # the pool's own worker processes
        ex.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            proc.kill()
    else:
        ex.shutdown(wait=True)


def start_peer_warmup(names: list[str], log_path: Path):
    """``--warm-peers`` in a niced background process (CPU-bound JIT builds overlap the kvforge sweep)."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-peers", "--workloads", ",".join(names)]
    f = log_path.open("w")
    # Own session: stopping it (time box) ends its JIT workers too, and nothing else.
    return subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10), start_new_session=True
    )


# ----------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="also write this run's CSV, PNG and logs here")
    ap.add_argument("--quick", action="store_true", help="the three anchor workloads, fewer repetitions")
    ap.add_argument("--tune", action="store_true", help="sweep the sm_90 candidates first and use the best")
    ap.add_argument("--warm-peers", action="store_true", help="only JIT-compile FlashInfer / FlexAttention")
    ap.add_argument("--precompile", type=int, default=0, help="compile the sweep variants in N processes")
    ap.add_argument("--no-peers", action="store_true", help="kvforge providers only")
    ap.add_argument("--try-flashinfer-fp8", action="store_true", help="also try FlashInfer's FP8 ragged prefill")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--only", default=None, help="--tune: regex on 'KEY CONFIG' limiting the challengers")
    ap.add_argument("--max-tune-seconds", type=float, default=75.0, help="--tune: stop adding challengers after this")
    ap.add_argument("--jobs", type=int, default=8, help="--tune: processes compiling the sweep kernels first")
    ap.add_argument("--no-warm", action="store_true", help="--tune: no background JIT warm-up of the peers")
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="skip remaining measurements after this many seconds (time box)"
    )
    args = ap.parse_args(argv)
    t_start = time.time()

    if not torch.cuda.is_available():
        print("bench_mla_context: needs a CUDA GPU (the H200); nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    names = ANCHORS if args.quick else list(WORKLOADS)
    if args.workloads:
        names = [n for n in args.workloads.split(",") if n in WORKLOADS]
    if args.try_flashinfer_fp8:
        PEERS[FLASHINFER_FP8] = lambda inp: flashinfer_provider(inp, True)
    if args.precompile:
        precompile(args.precompile)
        return 0
    if args.warm_peers:
        warm_peers(names, dev)
        return 0

    out_dir = args.out
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []
    log_file = (out_dir / "bench_mla_context.log").open("w") if out_dir is not None else None

    def log(msg: str) -> None:
        # Written as it goes: a run stopped by an outer time limit still leaves its log.
        print(msg, flush=True)
        log_lines.append(msg)
        if log_file is not None:
            log_file.write(msg + "\n")
            log_file.flush()

    def elapsed() -> float:
        return time.time() - t_start

    warm = None
    if args.tune and not args.no_peers and not args.no_warm:
        # Peers in comparison order: the anchors first (they carry the targets).
        warm_log = (out_dir or Path("/tmp")) / "warm_peers.log"
        warm = start_peer_warmup(names, warm_log)
    stamp = env_stamp()
    log(f"# {stamp['gpu']} torch {stamp['torch']} triton {stamp['triton']} cuda {stamp['cuda']} rev {stamp['git_rev']}")
    mm = fp8_matmul_tflops(dev)
    log(f"fp8 e4m3 matmul 8192^3 (torch._scaled_mm): {mm:.0f} TFLOP/s")

    chosen = {}
    if args.tune and args.jobs > 0:
        t0 = time.time()
        try:
            precompile(args.jobs, log=lambda m: log("  " + m), timeout=args.max_tune_seconds)
        except Exception as e:  # the sweep then compiles inline
            log(f"precompile FAILED: {type(e).__name__}: {str(e)[:200]}")
        log(f"precompile ({args.jobs} processes): {time.time() - t0:.1f}s, at {elapsed():.0f}s")

    t0 = time.time()
    inputs = {n: Inputs(n, dev, seed=i) for i, n in enumerate(names)}
    refs = {(n, fp8): inputs[n].reference(fp8) for n in names for fp8 in (False, True)}
    log(f"inputs + references: {time.time() - t0:.1f}s")

    if args.tune:
        log("== sweep (TFLOP/s per workload, geomean; regs/spills/smem of the compiled kernel; seconds)")
        chosen = tune(inputs, refs, log, only=args.only, max_seconds=args.max_tune_seconds)
        record_chosen(chosen)
        if out_dir is not None and chosen:
            log(f"tuned configs: {write_tuned(out_dir, chosen)} (at {elapsed():.0f}s)")
    if warm is not None:
        budget = None if args.deadline_s is None else max(5.0, 0.6 * args.deadline_s - elapsed())
        try:
            warm.wait(timeout=budget)
            log(f"peer warm-up finished (rc {warm.returncode}) at {elapsed():.0f}s")
        except Exception:  # still compiling: stop it; the rest compiles inline (or is skipped by the deadline)
            import signal

            os.killpg(warm.pid, signal.SIGKILL)
            warm.wait()
            log(f"peer warm-up stopped at {elapsed():.0f}s (time box)")

    results: dict[tuple[str, str], dict] = {}
    providers = list(KVFORGE) + ([] if args.no_peers else list(PEERS))
    rep = 40 if args.quick else 100
    # Targets first (anchor workloads x kvforge fp8/bf16, FlashInfer FA3, FlexAttention), then the rest, so a
    # time box drops the least important measurements.
    target_provs = ["kvforge fp8", "kvforge bf16", "FlashInfer FA3 bf16", "FlexAttention bf16"]
    pairs = [(n, p) for n in names if n in ANCHORS for p in providers if p in target_provs]
    pairs += [(n, p) for n in names for p in providers if (n, p) not in pairs]
    for n, prov in pairs:
        inp = inputs[n]
        fp8 = "fp8" in prov
        if args.deadline_s is not None and elapsed() > args.deadline_s:
            log(f"{n:26s} {prov:28s} SKIP (deadline {args.deadline_s:.0f}s reached)")
            continue
        try:
            if prov in KVFORGE:
                mode = KVFORGE[prov]
                key = mode + ("/short" if is_short(inp) else "")
                fn, plan = kvforge_provider(inp, mode, chosen.get(key))
                to_ragged = lambda o: o
                note = cfg_str(plan.config)
                res = resources(plan._launch(*_launch_args(plan, inp, mode)))
                if res:
                    note += f" regs {res['regs']} spills {res['spills']} smem {res['smem']}"
            else:
                fn, to_ragged = PEERS[prov](inp)
                note = "per-request loop" if (prov.startswith("SDPA") and not inp.uniform) else ""
            out = to_ragged(fn())
            rel = check(f"{prov} {n}", out, refs[(n, fp8)], fp8)
            t = time_gpu(fn, warmup=25, rep=rep)
            results[(n, prov)] = {**t, "tflops": inp.flops / t["ms"] / 1e9, "rel_rmse": rel, "note": note}
            log(f"{n:26s} {prov:28s} {t['ms']:8.3f} ms {inp.flops / t['ms'] / 1e9:7.1f} TFLOP/s  {note}")
        except ReferenceMismatch as e:
            log(f"{n:26s} {prov:28s} NOT REPORTED (reference mismatch): {e}")
        except Exception as e:
            log(f"{n:26s} {prov:28s} SKIP {type(e).__name__}: {str(e)[:240]}")
            if os.environ.get("KVFORGE_BENCH_TRACE"):
                traceback.print_exc()
        torch.cuda.synchronize()
    del inputs, refs
    torch.cuda.empty_cache()

    # Ratios, same run.
    rows = []
    log("")
    log(f"| workload | provider | ms | TFLOP/s | kvforge fp8 / this | kvforge bf16 / this | of fp8 mm ({mm:.0f}) |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        f8 = results.get((n, "kvforge fp8"))
        b16 = results.get((n, "kvforge bf16"))
        for prov in providers:
            r = results.get((n, prov))
            if r is None:
                continue
            rf8 = f8["tflops"] / r["tflops"] if f8 else float("nan")
            rb16 = b16["tflops"] / r["tflops"] if b16 else float("nan")
            frac = r["tflops"] / mm
            log(f"| {n} | {prov} | {r['ms']:.3f} | {r['tflops']:.1f} | {rf8:.2f} | {rb16:.2f} | {frac:.1%} |")
            rows.append({
                "workload": n, "provider": prov, "ms": f"{r['ms']:.4f}", "ms_p20": f"{r['ms_p20']:.4f}",
                "ms_p80": f"{r['ms_p80']:.4f}", "tflops": f"{r['tflops']:.2f}", "rel_rmse": f"{r['rel_rmse']:.3g}",
                "kvforge_fp8_ratio": f"{rf8:.3f}", "kvforge_bf16_ratio": f"{rb16:.3f}",
                "fp8_mm_tflops": f"{mm:.1f}", "frac_fp8_mm": f"{r['tflops'] / mm:.4f}", "note": r["note"],
            })  # fmt: skip
    log("")
    for n in ANCHORS:
        f8, b16 = results.get((n, "kvforge fp8")), results.get((n, "kvforge bf16"))
        fi, fx = results.get((n, "FlashInfer FA3 bf16")), results.get((n, "FlexAttention bf16"))
        if f8 and fi:
            r = f8["tflops"] / fi["tflops"]
            log(f"target {n}: kvforge fp8 / FlashInfer FA3 bf16 = {r:.2f} (>= 1.0: {'met' if r >= 1 else 'MISSED'})")
        if b16 and fx:
            r = b16["tflops"] / fx["tflops"]
            log(f"target {n}: kvforge bf16 / FlexAttention = {r:.2f} (>= 1.5: {'met' if r >= 1.5 else 'MISSED'})")
    f8 = results.get(("1x(0+16384)", "kvforge fp8"))
    if f8:
        r = f8["tflops"] / mm
        log(f"target 1x(0+16384): kvforge fp8 = {r:.1%} of fp8 matmul (>= 55%: {'met' if r >= 0.55 else 'MISSED'})")

    if rows:
        path = append_csv("mla_context", rows)
        log(f"appended {len(rows)} rows to {path}")
        groups = names
        provs = [p for p in providers if any((n, p) in results for n in names)]
        series = {p: [results[(n, p)]["tflops"] if (n, p) in results else 0.0 for n in groups] for p in provs}
        png = bar_plot(
            (out_dir or RESULTS) / "mla_context.png",
            f"MLA context attention, 32 heads 192/128 ({stamp['gpu']}, fp8 mm {mm:.0f} TFLOP/s)",
            groups, series, "TFLOP/s",
        )  # fmt: skip
        log(f"plot: {png}")
        if out_dir is not None:
            with (out_dir / "mla_context.csv").open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list({**stamp, **rows[0]}))
                w.writeheader()
                w.writerows({**stamp, **r} for r in rows)
            (out_dir / "bench.json").write_text(
                json.dumps({"stamp": stamp, "fp8_mm": mm, "chosen": {k: cfg_str(v) for k, v in chosen.items()}})
            )
    if log_file is not None:
        log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
