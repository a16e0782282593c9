"""MLA context attention over cached prefixes: every kvforge path and call form against FlashInfer FA3 bf16, same run.

Workloads (d_qk 192, d_v 128, one KV head per query head): the fixed grid (uniform batches, heads 16-128, prefixes
0-32k, new rows 256-16k, and seeded mixed-length chat-like batches) or, with ``--random N --seed S``, N fresh
workloads drawn from the seed (heads {16, 32, 64, 128}, 1-12 requests, new rows 40-6k and prefixes 0-24k, never
multiples of 16, so dim-major V strides are unaligned too). Paths: FP8 Q/K/V token-major, FP8 Q/K/V dim-major
(16-byte-aligned V from ``v_to_dim_major``), FP8 dim-major with a packed (unaligned) V, bf16 Q + FP8 K/V
token-major, bf16, op-quantised (bf16 inputs quantised by the call, ``kv_scale_orig_quant``), and FP8
token-major transposed (``v_to_dim_major`` into a kept buffer, then the dim-major plan, both timed); call forms:
``planned`` (plan once, ``run`` timed), ``max`` (one call with ``max_seqlen_*``), ``nomax`` (one call without).
The peer is FlashInfer 0.2.14 FA3 bf16 (ragged, planned once). Every output is checked against the fp32
reference first (two heads; heads are independent); a path that fails is not reported.
FLOPs = Σ_r 2·H·(d_qk + d_v)·q_len·(kv_len − (q_len − 1)/2).

    python bench/bench_mla_context.py [--random N --seed S] [--out DIR] [--tune] [--workloads REGEX | --quick]
                                      [--paths REGEX] [--no-peer] [--deadline-s S] [--rep-ms MS]

Results: one CSV row per (workload, path) appended to bench/results/mla_context_grid.csv (``grid`` column: fixed
or random:N:S), the PNG mla_context_grid.png (or mla_context_random.png), the ratio table with geomeans and
minima in the log, and the one-call overhead (one call without max_seqlen against plan + run).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import kvforge.kernels  # noqa: F401  (before triton: turns on the interpreter on CPU-only machines)
from bench._common import RESULTS, ReferenceMismatch, append_csv, bar_plot, env_stamp, time_gpu
from kvforge.kernels import mla_context as mc
from kvforge.kernels._runtime import arch_name, config_to_json, device_capability

DQK, DV = 192, 128
FP8 = torch.float8_e4m3fn
KV_SCALE = 1.0  # kv_scale_quant_orig of the FP8 inputs (the value does not change the speed)


def _mixed(seed: int, n: int) -> tuple[list[int], list[int]]:
    """A chat-like batch: new rows 64-3k (log-uniform), cached prefixes 0-30k (a quarter with none)."""
    rng = random.Random(seed)
    q = [int(math.exp(rng.uniform(math.log(64), math.log(3072)))) for _ in range(n)]
    c = [0 if rng.random() < 0.25 else rng.randrange(0, 30720) for _ in range(n)]
    return q, c


def _uniform(batch: int, prefix: int, new: int) -> tuple[list[int], list[int]]:
    return [new] * batch, [prefix] * batch


# name -> (heads, q_lens, cached)
GRID: dict[str, tuple[int, list[int], list[int]]] = {
    "h32 1x(0+16384)": (32, *_uniform(1, 0, 16384)),
    "h32 4x(8192+2048)": (32, *_uniform(4, 8192, 2048)),
    "h32 16x(4096+512)": (32, *_uniform(16, 4096, 512)),
    "h16 32x(16384+256)": (16, *_uniform(32, 16384, 256)),
    "h16 2x(32768+1024)": (16, *_uniform(2, 32768, 1024)),
    "h16 1x(0+8192)": (16, *_uniform(1, 0, 8192)),
    "h16 1x(4096+16384)": (16, *_uniform(1, 4096, 16384)),
    "h64 8x(2048+2048)": (64, *_uniform(8, 2048, 2048)),
    "h64 2x(16384+8192)": (64, *_uniform(2, 16384, 8192)),
    "h64 8x(8192+512)": (64, *_uniform(8, 8192, 512)),
    "h128 1x(32768+4096)": (128, *_uniform(1, 32768, 4096)),
    "h128 4x(0+4096)": (128, *_uniform(4, 0, 4096)),
    "h128 16x(1024+256)": (128, *_uniform(16, 1024, 256)),
    "h16 mixed s1 x12": (16, *_mixed(1, 12)),
    "h32 mixed s2 x24": (32, *_mixed(2, 24)),
    "h64 mixed s3 x32": (64, *_mixed(3, 32)),
    "h128 mixed s4 x16": (128, *_mixed(4, 16)),
}
CEILING = "h32 1x(0+16384)"


def random_grid(n: int, seed: int) -> dict[str, tuple[int, list[int], list[int]]]:
    """N workloads from the seed: heads {16, 32, 64, 128}, 1-12 requests, new rows log-uniform in [40, 6000] and
    prefixes 0-24k (a quarter with none), each length moved off the multiples of 16; the batch is redrawn
    while it exceeds ~3 TFLOP (a few ms on an H200) or 4M head-tokens of K/V (memory), so the grid stays a few
    minutes long."""
    rng = random.Random(seed)
    out: dict[str, tuple[int, list[int], list[int]]] = {}
    while len(out) < n:
        heads = rng.choice([16, 32, 64, 128])
        b = rng.choice([1, 2, 3, 4, 6, 8, 12])
        q = [int(math.exp(rng.uniform(math.log(40), math.log(6000)))) for _ in range(b)]
        c = [0 if rng.random() < 0.25 else rng.randrange(0, 24576) for _ in range(b)]
        q = [x + (x % 16 == 0) for x in q]
        c = [x + (x % 16 == 0 and x > 0) for x in c]
        if flops(heads, q, c) > 3e12 or heads * (sum(q) + sum(c)) > 4 << 20:  # time, and memory (~6 GB)
            continue
        out[f"r{len(out):02d} h{heads} {b}x q{sum(q)} c{sum(c)}"] = (heads, q, c)
    return out


# path name -> (Q, K/V, V layout, form); layout "dim_major_packed": dim-major V with its token stride unpadded;
# Q "opq": bf16 Q/K/V quantised by the call. Forms: planned / max (one call with max_seqlen) / nomax (without).
_KINDS = {
    "fp8 token-major": ("fp8", "fp8", "token_major"),
    "fp8 dim-major": ("fp8", "fp8", "dim_major"),
    "bf16q+fp8kv token-major": ("bf16", "fp8", "token_major"),
    "bf16": ("bf16", "bf16", "token_major"),
}
PATHS: dict[str, tuple[str, str, str, str]] = {
    f"{kind} {form}": (*spec, form) for kind, spec in _KINDS.items() for form in ("planned", "max", "nomax")
}
PATHS["fp8 dim-major unaligned nomax"] = ("fp8", "fp8", "dim_major_packed", "nomax")
# Token-major FP8 V transposed by ``v_to_dim_major`` into a kept buffer on every call, then the dim-major plan's run:
# what a plan that transposes V itself would cost (the FP8 token-major kernel transposes every V tile per program).
PATHS["fp8 token-major transposed planned"] = ("fp8", "fp8", "dim_major_from_token", "planned")
PATHS["op-quantised nomax"] = ("opq", "bf16", "token_major", "nomax")
PATHS["op-quantised max"] = ("opq", "bf16", "token_major", "max")
PEER = "FlashInfer FA3 bf16"
# Issue 28: >= 1.0x FA3 on every workload for every path, bf16 >= 0.9x (floor per workload; no geomean target).
TARGETS = {p: (None, 0.9 if p.startswith("bf16 ") else 1.0) for p in PATHS}

_C = mc._cfg
_L = mc._LONG
_S = dict(block_m=64, block_n=64, warps=4, tma=True)
# Sweep candidates per kernel key ("/short": batches whose longest query has <= mc.SHORT_Q_ROWS rows; the grid
# has none, so only long keys are swept). The first candidate of each key is the current choice.
_G = mc._GLUON  # the warp-specialised sm_90 kernel (kvforge/kernels/mla_context_gluon.py)
SWEEP: dict[str, list] = {
    "fp8_tok": [_C(**_G, stages=2), _C(**_G, stages=2, key_perm=True),
                _C(**_G, stages=2, pingpong=True, key_perm=True)],
    "fp8_dim": [_C(**_L), _C(**_G, stages=2, pingpong=True), _C(**_G, stages=2, pingpong=True, key_perm=True)],
    "mixed_tok": [_C(**_L, q_quant=True, v_widen=True), _C(**_G, stages=2, v_widen=True)],
    "bf16": [_C(**dict(_L, block_n=64, stages=4)), _C(**_G, stages=2), _C(**_G, stages=2, pingpong=True)],
}  # fmt: skip
_KEYS = {
    "bf16": (DQK, DV, "bf16", "bf16", "token_major"),
    "fp8_dim": (DQK, DV, "e4m3", "e4m3", "dim_major"),
    "fp8_tok": (DQK, DV, "e4m3", "e4m3", "token_major"),
    "mixed_tok": (DQK, DV, "bf16", "e4m3", "token_major"),
}
TUNE_ON = ["h32 4x(8192+2048)", "h16 32x(16384+256)", "h32 mixed s2 x24", "h128 16x(1024+256)"]


def sweep_key(path: str) -> str:
    q, kv, layout, _ = PATHS[path]
    if kv == "bf16" and q != "opq":
        return "bf16"
    if q == "bf16":
        return "mixed_tok"
    return "fp8_dim" if layout.startswith("dim_major") or q == "opq" else "fp8_tok"


def cfg_str(cfg) -> str:
    k = cfg.kwargs
    names = ("GLUON", "GLUON_PP", "GLUON_KP", "USE_TMA", "Q_QUANT", "V_WIDEN", "HEADS_OUTER", "EXP_POLY")
    flags = [n.lower() for n in names if k.get(n)]
    if k.get("PIPE_QK"):
        flags.append(f"pipe{k['PIPE_QK']}")
    if k.get("KV_SPLITS", 1) > 1:  # the plan's key shares (a label only: not a kernel argument)
        flags.append(f"shares{k['KV_SPLITS']}")
    return f"{k['BLOCK_M']}x{k['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}" + "".join("+" + f for f in flags)


def flops(heads: int, q_lens: list[int], cached: list[int]) -> float:
    return sum(2 * heads * (DQK + DV) * q * (c + q - (q - 1) / 2) for q, c in zip(q_lens, cached))


def cu(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


class Inputs:
    """One workload's tensors in every layout the paths want (built once, outside the timings)."""

    def __init__(self, name: str, device: torch.device, seed: int = 0) -> None:
        self.name = name
        self.heads, self.q_lens, self.cached = GRID[name]
        self.device = device
        self.kv_lens = [a + b for a, b in zip(self.q_lens, self.cached)]
        self.cu_q, self.cu_kv = cu(self.q_lens, device), cu(self.kv_lens, device)
        tq, tkv, h = sum(self.q_lens), sum(self.kv_lens), self.heads
        g = torch.Generator(device=device).manual_seed(seed)
        self.q16 = torch.randn(tq, h, DQK, generator=g, device=device, dtype=torch.bfloat16)
        self.k16 = torch.randn(tkv, h, DQK, generator=g, device=device, dtype=torch.bfloat16)
        self.v16 = torch.randn(tkv, h, DV, generator=g, device=device, dtype=torch.bfloat16)
        # Caller-side quantisation e4m3(x * kv_scale_orig_quant), with kv_scale_orig_quant = 1 / KV_SCALE.
        q8 = lambda x: (x * (1.0 / KV_SCALE)).clamp(-448, 448).to(FP8)
        self.q8, self.k8, self.v8 = q8(self.q16), q8(self.k16), q8(self.v16)
        self.v8_dim = mc.v_to_dim_major(self.v8)
        self.v8_packed = self.v8.permute(1, 2, 0).contiguous()  # token stride = total_kv (unaligned if % 16)
        self.flops = flops(h, self.q_lens, self.cached)
        self.max_q, self.max_kv = max(self.q_lens), max(self.kv_lens)
        self._refs: dict[tuple[str, str], torch.Tensor] = {}

    def tensors(self, path: str):
        q, kv, layout, _ = PATHS[path]
        qt = self.q8 if q == "fp8" else self.q16
        k = self.k8 if kv == "fp8" else self.k16
        v = {"dim_major": self.v8_dim, "dim_major_packed": self.v8_packed}.get(layout, self.v8)
        return qt, k, v if kv == "fp8" else self.v16

    def ref_kinds(self, path: str) -> tuple[str, str]:
        q, kv, _, _ = PATHS[path]
        # Op-quantised inputs at kv_scale_orig_quant = 1 / KV_SCALE are exactly the caller-quantised FP8 inputs.
        return ("fp8", "fp8") if q == "opq" else (q, kv)

    def reference(self, q_kind: str, kv_kind: str, heads: list[int]) -> torch.Tensor:
        """fp32 reference on ``heads`` only (heads are independent), cached per input types."""
        key = (q_kind, kv_kind)
        if key not in self._refs:
            q = (self.q8 if q_kind == "fp8" else self.q16)[:, heads]
            k = (self.k8 if kv_kind == "fp8" else self.k16)[:, heads]
            v = (self.v8 if kv_kind == "fp8" else self.v16)[:, heads]
            s = KV_SCALE if kv_kind == "fp8" else 1.0
            self._refs[key], _ = mc.mla_context_attention_ref(
                q, k, v, self.cu_q.cpu(), self.cu_kv.cpu(), kv_scale_quant_orig=s, head_chunk=1
            )
        return self._refs[key]


def check(name: str, out: torch.Tensor, ref: torch.Tensor, fp8: bool) -> float:
    """rel-RMSE and max error against the reference; raises ReferenceMismatch (the path is not reported)."""
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


def kvforge_provider(inp: Inputs, path: str, config=None):
    """Returns (fn, config). ``planned`` plans once (like a serving step) and times ``run``; ``max`` / ``nomax``
    call ``mla_context_attention`` each time, with / without ``max_seqlen_*`` (device-built work table)."""
    q_kind, kv, layout, form = PATHS[path]
    q, k, v = inp.tensors(path)
    layout = "dim_major" if layout.startswith("dim_major") else layout
    scale = KV_SCALE if kv == "fp8" else 1.0
    out = torch.empty(q.shape[0], inp.heads, DV, device=q.device, dtype=torch.bfloat16)
    if form != "planned":
        kw = dict(max_seqlen_q=inp.max_q, max_seqlen_kv=inp.max_kv) if form == "max" else {}
        if q_kind == "opq":
            kw["kv_scale_orig_quant"] = 1.0 / KV_SCALE
        else:
            kw["kv_scale_quant_orig"] = scale
        qd, kd = (FP8, FP8) if q_kind == "opq" else (q.dtype, k.dtype)
        sh = mc._check_shapes(inp.heads, inp.heads, DQK, DV, qd, kd, "dim_major" if q_kind == "opq" else layout)
        short = 0 < (inp.max_q if form == "max" else sum(inp.q_lens) / len(inp.q_lens)) <= mc.SHORT_Q_ROWS
        cfg = config or mc._choose_config(sh, q.device, short)
        if config is not None:  # the sweep's config for this key, as one-call would choose it once recorded
            mc._KERNEL._chosen[(arch_name(device_capability()), mc._config_key(sh, False))] = config

        def fn():
            return mc.mla_context_attention(q, k, v, inp.cu_q, inp.cu_kv, out=out, v_layout=layout, **kw)

        # The note shows the shares the device-table call splits its items into on chip (from bounds alone).
        n_req, tq = len(inp.q_lens), sum(inp.q_lens)
        slots = mc._device_slots(n_req, tq, inp.max_q if form == "max" else tq, int(cfg.kwargs["BLOCK_M"]))
        kv_bound = min(inp.max_kv if form == "max" else k.shape[0], k.shape[0])
        splits = mc._device_kv_splits(sh, q.device, cfg, slots, tq, kv_bound)
        label = SimpleNamespace(kwargs={**cfg.kwargs, "KV_SPLITS": splits}, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)  # fmt: skip
        return fn, label
    plan = mc.MLAContextPlan.plan(
        inp.cu_q, inp.cu_kv, num_heads=inp.heads, num_kv_heads=inp.heads, head_dim_qk=DQK, head_dim_v=DV,
        q_dtype=q.dtype, kv_dtype=k.dtype, v_layout=layout, config=config,
    )  # fmt: skip
    # What the row's note shows: the config, and the plan's key shares.
    label = SimpleNamespace(kwargs={**plan.config.kwargs, "KV_SPLITS": plan.kv_splits},
                            num_warps=plan.config.num_warps, num_stages=plan.config.num_stages)  # fmt: skip
    if PATHS[path][2] == "dim_major_from_token":  # v is token-major: the transpose is part of every timed call
        buf = mc.v_to_dim_major(v)

        def transposed():
            return plan.run(q, k, mc.v_to_dim_major(v, out=buf), kv_scale_quant_orig=scale, out=out)

        return transposed, label
    return (lambda: plan.run(q, k, v, kv_scale_quant_orig=scale, out=out)), label


def pin_untuned_keys() -> None:
    """Keys without a committed config take their first candidate here instead of tuning at first use (each
    tuning compiles several configs; the bench must not spend its time, or time other keys' compiles)."""
    arch = arch_name(device_capability())
    for q, kv, layout in (("bf16", "e4m3", "token_major"), ("e4m3", "e4m3", "token_major"),
                          ("e4m3", "e4m3", "dim_major"), ("bf16", "bf16", "token_major")):  # fmt: skip
        dt = {"bf16": torch.bfloat16, "e4m3": FP8}
        sh = mc._check_shapes(16, 16, DQK, DV, dt[q], dt[kv], layout)
        for short in (False, True):
            key = mc._config_key(sh, short)
            committed = (
                mc._KERNEL.name in _committed_keys() and ",".join(map(str, key)) in _committed_keys()[mc._KERNEL.name]
            )
            if not committed and (arch, key) not in mc._KERNEL._chosen:
                mc._KERNEL._chosen[(arch, key)] = mc._CONFIGS.candidates(device_capability(), key)[0]


def _committed_keys() -> dict:
    arch = arch_name(device_capability())
    f = Path(mc.__file__).with_name("tuned") / f"{arch}.json"
    return json.loads(f.read_text()) if f.exists() else {}


_FI_WS: dict[str, torch.Tensor] = {}


def flashinfer_provider(inp: Inputs):
    import flashinfer

    dev = inp.q16.device
    ws = _FI_WS.setdefault("ws", torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(inp.cu_q, inp.cu_kv, inp.heads, inp.heads, DQK, head_dim_vo=DV, causal=True, q_data_type=torch.bfloat16)
    return lambda: w.run(inp.q16, inp.k16, inp.v16)


def fp8_matmul_tflops(device) -> float:
    m = 8192
    a = torch.randn(m, m, device=device).to(FP8)
    b = torch.randn(m, m, device=device).to(FP8).t().contiguous().t()
    one = torch.ones((), device=device)
    ms = time_gpu(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))["ms"]
    return 2 * m**3 / ms / 1e9


def resources(handle) -> str:
    """Registers per thread, spills and shared memory of a compiled kernel (Triton's handle)."""
    try:
        meta = handle.metadata
        shared = meta.shared if hasattr(meta, "shared") else meta["shared"]
        return f"regs {int(handle.n_regs)} spills {int(handle.n_spills)} smem {int(shared)}"
    except Exception:  # the interpreter returns no compiled handle
        return ""


def _launch_handle(inp: Inputs, path: str, cfg) -> str:
    q, k, v = inp.tensors(path)
    plan = mc.MLAContextPlan.plan(
        inp.cu_q, inp.cu_kv, num_heads=inp.heads, num_kv_heads=inp.heads, head_dim_qk=DQK, head_dim_v=DV,
        q_dtype=q.dtype, kv_dtype=k.dtype, v_layout=PATHS[path][2], config=cfg,
    )  # fmt: skip
    out = torch.empty(q.shape[0], inp.heads, DV, device=q.device, dtype=torch.bfloat16)
    return resources(plan._launch(q, k, v, out, None, 1.0 / math.sqrt(DQK), 1.0, None))


def measure(inp: Inputs, path: str, config, rep: int = 100) -> dict:
    """Check against the reference, then time; raises ReferenceMismatch."""
    q_kind, kv_kind = inp.ref_kinds(path)
    fn, cfg = kvforge_provider(inp, path, config)
    heads = [0, inp.heads - 1]
    out = fn()
    rel = check(f"{path} {inp.name}", out[:, heads], inp.reference(q_kind, kv_kind, heads), kv_kind == "fp8")
    t = time_gpu(fn, warmup=max(5, rep // 10), rep=rep)
    return {**t, "tflops": inp.flops / t["ms"] / 1e9, "rel_rmse": rel, "note": cfg_str(cfg)}


# ----------------------------------------------------------------------------------------------------- main


def _compile_one(job: tuple[str, dict, int, int]) -> str:
    """Compile one (path, config) on a tiny batch (Triton's disk cache then serves the timing process)."""
    import triton

    path, kw, warps, stages = job
    cfg = triton.Config(kw, num_warps=warps, num_stages=stages)
    GRID["_tiny"] = (2, [144, 16], [208, 16])  # multiples of 16, like the grid: same specialisation
    t0 = time.time()
    try:
        fn, _ = kvforge_provider(Inputs("_tiny", torch.device("cuda")), path, cfg)
        fn()
        torch.cuda.synchronize()
        return f"compiled {path} {cfg_str(cfg)} in {time.time() - t0:.1f}s"
    except Exception as e:
        return f"compile {path} {cfg_str(cfg)} FAILED: {type(e).__name__}: {str(e)[:300]}"


def precompile(jobs: list[tuple[str, object]], n_proc: int, log) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    todo = [(p, dict(c.kwargs), c.num_warps, c.num_stages) for p, c in jobs]
    with cf.ProcessPoolExecutor(max_workers=n_proc, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_compile_one, todo):
            log("  " + msg)


def _warm_peer() -> None:
    """FlashInfer's JIT build of the FA3 bf16 module (one per head dims), in a background process."""
    GRID["_tiny"] = (2, [144, 16], [208, 16])
    try:
        flashinfer_provider(Inputs("_tiny", torch.device("cuda")))()
        torch.cuda.synchronize()
    except Exception as e:
        print(f"peer warm-up FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


def tune(log, names: list[str], max_seconds: float) -> dict[str, object]:
    """Time each key's sweep candidates on ``TUNE_ON`` workloads; keep the fastest correct one per key."""
    t0 = time.time()
    chosen = {}
    dev = torch.device("cuda")
    inputs = {n: Inputs(n, dev, seed=i) for i, n in enumerate(names)}
    path_of = {sweep_key(p): p for p in PATHS if not PATHS[p][3] or sweep_key(p) == "mixed_tok"}
    t1 = time.time()
    precompile([(path_of[key], c) for key, cands in SWEEP.items() for c in cands], 8, log)
    log(f"  precompile: {time.time() - t1:.0f}s")
    for key, cands in SWEEP.items():
        best = None
        for cfg in cands:
            if time.time() - t0 > max_seconds and best is not None:
                log(f"  {key:10s} {cfg_str(cfg):40s} not measured (time box)")
                continue
            try:
                tf = []
                for n in names:
                    tf.append(measure(inputs[n], path_of[key], cfg, rep=40)["tflops"])
                geo = math.exp(sum(math.log(x) for x in tf) / len(tf))
                res = _launch_handle(inputs[names[0]], path_of[key], cfg)
                log(f"  {key:10s} {cfg_str(cfg):40s} geo {geo:7.1f} " + " ".join(f"{x:6.1f}" for x in tf) + f"  {res}")
                if best is None or geo > best[0]:
                    best = (geo, cfg)
            except ReferenceMismatch as e:
                log(f"  {key:10s} {cfg_str(cfg):40s} WRONG: {e}")
            except Exception as e:  # a config that does not compile or fit is skipped
                log(f"  {key:10s} {cfg_str(cfg):40s} FAILED: {type(e).__name__}: {str(e)[:200]}")
        if best is not None:
            chosen[key] = best[1]
            log(f"  -> {key}: {cfg_str(best[1])} ({best[0]:.1f} TFLOP/s geomean) at {time.time() - t0:.0f}s")
    return chosen


def write_tuned(out_dir: Path, chosen: dict[str, object]) -> Path:
    arch = arch_name(device_capability())
    committed = Path(mc.__file__).with_name("tuned") / f"{arch}.json"
    data = json.loads(committed.read_text()) if committed.exists() else {}
    section = data.setdefault(mc._KERNEL.name, {})
    for key, cfg in chosen.items():
        section[",".join(str(x) for x in _KEYS[key])] = config_to_json(cfg)
    path = out_dir / f"{arch}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def one_call_overhead(log, dev) -> None:
    """The one call without max_seqlen (table built on the device) against plan + run (the host plan reads the
    lengths back: one sync), the one call with max_seqlen, and run alone, interleaved, on a ~0.3 ms workload."""
    from bench._common import time_interleaved

    GRID["_overhead h16 8x(1024+2048)"] = (16, *_uniform(8, 1024, 2048))
    inp = Inputs("_overhead h16 8x(1024+2048)", dev)
    for kind in ("bf16q+fp8kv token-major", "bf16"):
        q, k, v = inp.tensors(f"{kind} planned")
        scale = KV_SCALE if k.dtype == FP8 else 1.0
        plan_kw = dict(num_heads=16, num_kv_heads=16, head_dim_qk=DQK, head_dim_v=DV, q_dtype=q.dtype,
                       kv_dtype=k.dtype)  # fmt: skip
        plan = mc.MLAContextPlan.plan(inp.cu_q, inp.cu_kv, **plan_kw)

        def plan_run(q=q, k=k, v=v, kw=plan_kw, scale=scale):
            return mc.MLAContextPlan.plan(inp.cu_q, inp.cu_kv, **kw).run(q, k, v, kv_scale_quant_orig=scale)

        fns = {
            "one call": kvforge_provider(inp, f"{kind} nomax")[0],
            "one call, max_seqlen": kvforge_provider(inp, f"{kind} max")[0],
            "plan + run": plan_run,
            "run": lambda plan=plan, q=q, k=k, v=v, scale=scale: plan.run(q, k, v, kv_scale_quant_orig=scale),
        }
        res = time_interleaved(fns, samples=200)
        a, b = res["one call"]["ms"], res["plan + run"]["ms"]
        ok = "met" if a <= 1.1 * b else "MISSED"
        log(f"one call without max_seqlen vs plan+run ({kind}, {inp.name}): {a:.4f} / {b:.4f} ms = {a / b:.3f} "
            f"(<= 1.1: {ok}); with max_seqlen {res['one call, max_seqlen']['ms']:.4f} ms, run alone "
            f"{res['run']['ms']:.4f} ms")  # fmt: skip
    del GRID["_overhead h16 8x(1024+2048)"]


def _warm_one(job: tuple[str, list[int], list[int]]) -> str:
    """Compile one path's kernels on a tiny batch of one tile class (Triton's disk cache then serves the timing
    process); ``job`` = (path, q_lens, cached), or ("table", [block_m], [n_slots]) for one variant of the
    device work-table kernels."""
    path, q, c = job
    t0 = time.time()
    if path == "table":  # a batch of n_slots one-row requests: the sorting program of that size
        n = c[0]
        cu = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        sh = mc._check_shapes(16, 16, DQK, DV, FP8, FP8, "token_major")
        cfg = mc._cfg(block_m=q[0], block_n=64, warps=4, stages=2)
        mc.MLAContextPlan._plan_on_device(sh, cu, cu, None, None, n, n, config=cfg)
        torch.cuda.synchronize()
        return f"compiled table kernels BLOCK_M={q[0]} slots={n} in {time.time() - t0:.1f}s"
    pin_untuned_keys()
    GRID["_warm"] = (2, q, c)
    try:
        inp = Inputs("_warm", torch.device("cuda"))
        for p in (path, path.replace(" nomax", " planned")):
            if p in PATHS:
                kvforge_provider(inp, p)[0]()
        torch.cuda.synchronize()
        return f"compiled {path} q={q} in {time.time() - t0:.1f}s"
    except Exception as e:
        return f"compile {path} q={q} FAILED: {type(e).__name__}: {str(e)[:300]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="also write this run's CSV, PNG, log and tuned file here")
    ap.add_argument("--tune", action="store_true", help="sweep the candidates per key first and use the best")
    ap.add_argument("--max-tune-seconds", type=float, default=150.0)
    ap.add_argument("--random", type=int, default=None, metavar="N", help="N fresh workloads drawn from --seed")
    ap.add_argument("--seed", type=int, default=None, help="seed of --random (default: drawn, and logged)")
    ap.add_argument("--workloads", default=None, help="regular expression on the workload names")
    ap.add_argument("--paths", default=None, help="regular expression on the path names")
    ap.add_argument("--quick", action="store_true", help="the four 32-head workloads only (bench/run_gpu_suite.sh)")
    ap.add_argument("--no-peer", action="store_true", help="kvforge paths only")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip what is left after this many seconds")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="timing budget per measurement (do_bench rep)")
    ap.add_argument("--warm-procs", type=int, default=10, help="processes compiling the paths' kernels first")
    ap.add_argument("--skip-extras", action="store_true", help="no FP8 matmul ceiling and no one-call overhead")
    args = ap.parse_args(argv)
    t_start = time.time()
    if args.random is not None and not 1 <= args.random <= 1000:
        print(f"bench_mla_context: --random: expected 1..1000 workloads, got {args.random}", file=sys.stderr)
        return 2
    if args.seed is not None and not 0 <= args.seed < 2**63:
        print(f"bench_mla_context: --seed: expected 0..{2**63 - 1}, got {args.seed}", file=sys.stderr)
        return 2
    if args.rep_ms <= 0 or args.warm_procs < 0:
        print("bench_mla_context: --rep-ms must be > 0 and --warm-procs >= 0", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_mla_context: needs a CUDA GPU (the H200); nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    grid_tag = "fixed"
    if args.random is not None:
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        GRID.clear()
        GRID.update(random_grid(args.random, seed))
        grid_tag = f"random:{args.random}:{seed}"
    pattern = args.workloads or ("^h32 " if args.quick else None)
    names = [n for n in GRID if pattern is None or re.search(pattern, n)]
    paths = [p for p in PATHS if args.paths is None or re.search(args.paths, p)]
    out_dir = args.out
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_file = (out_dir / "bench_mla_context.log").open("w") if out_dir is not None else None

    def log(msg: str) -> None:
        print(msg, flush=True)
        if log_file is not None:
            log_file.write(msg + "\n")
            log_file.flush()

    stamp = env_stamp()
    log(f"# {stamp['gpu']} torch {stamp['torch']} triton {stamp['triton']} cuda {stamp['cuda']} rev {stamp['git_rev']}")
    log(f"# grid {grid_tag}: " + "; ".join(f"{n} = q{GRID[n][1]} c{GRID[n][2]}" for n in names))
    pin_untuned_keys()
    import multiprocessing as mp

    warm = None
    if not args.no_peer:
        warm = mp.get_context("spawn").Process(target=_warm_peer, daemon=True)
        warm.start()
    if args.warm_procs > 0 and not args.tune:
        import concurrent.futures as cf

        # One job per kernel a path runs: its "nomax" form (whose "planned" twin runs the same kernel) on a long-
        # and a short-query batch (the two tile classes); the table kernels compile inline (a second or two each).
        reps = sorted({p if PATHS[p][3] == "nomax" else p.rsplit(" ", 1)[0] + " nomax" for p in paths} & set(PATHS))
        jobs = [(p, q, c) for p in reps for q, c in (([151, 17], [209, 3]), ([37, 17], [209, 3]))]
        jobs += [("table", [bm], [n]) for bm in (64, 128) for n in (16, 64, 256, 1024, 4096, 16384)]
        t1 = time.time()
        with cf.ProcessPoolExecutor(max_workers=args.warm_procs, mp_context=mp.get_context("spawn")) as ex:
            for msg in ex.map(_warm_one, jobs):
                log("  " + msg)
        log(f"compile warm-up: {time.time() - t1:.0f}s")
    mm = float("nan") if args.skip_extras else fp8_matmul_tflops(dev)
    log(f"fp8 e4m3 matmul 8192^3 (torch._scaled_mm): {mm:.0f} TFLOP/s")
    chosen: dict[str, object] = {}
    if args.tune:
        log("== sweep (TFLOP/s geomean and per workload; resources of the compiled kernel)")
        chosen = tune(log, TUNE_ON, args.max_tune_seconds)
        arch = arch_name(device_capability())
        for key, cfg in chosen.items():
            mc._KERNEL._chosen[(arch, _KEYS[key])] = cfg
        if out_dir is not None and chosen:
            log(f"tuned configs: {write_tuned(out_dir, chosen)}")
        torch.cuda.empty_cache()
    if not args.skip_extras:
        try:
            one_call_overhead(log, dev)
        except Exception as e:
            log(f"one-call overhead: FAILED {type(e).__name__}: {str(e)[:300]}")

    # The peer's JIT build saturates the CPUs: timings taken while it runs include slowed host work (the one-call
    # forms measured 1.7-1.8x their planned twins on r02 of random:24:2811 during it), so wait for it first.
    if warm is not None:
        warm.join(timeout=240)
        log(f"peer warm-up: {'done' if not warm.is_alive() else 'still running (compiles inline)'} at "
            f"{time.time() - t_start:.0f}s")  # fmt: skip
    results: dict[tuple[str, str], dict] = {}
    done = []
    providers = paths + ([] if args.no_peer else [PEER])
    for n in names:
        if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
            log(f"{n}: SKIP (deadline {args.deadline_s:.0f}s)")
            continue
        done.append(n)
        log(f"# {n}: start at {time.time() - t_start:.0f}s")
        inp = Inputs(n, dev, seed=100 + list(GRID).index(n))  # seeded by grid position: same data in any subset
        _measure_all(inp, providers, results, chosen, args.rep_ms, log)
        del inp
        torch.cuda.empty_cache()
    _report(args, log, results, done, paths, providers, mm, stamp, grid_tag, chosen, out_dir)
    if log_file is not None:
        log_file.close()
    return 0


def _measure_all(inp: Inputs, providers: list[str], results: dict, chosen: dict, rep_ms: float, log) -> None:
    n = inp.name
    for prov in providers:
        try:
            if prov == PEER:
                fn = flashinfer_provider(inp)
                heads = [0, inp.heads - 1]
                rel = check(f"{prov} {n}", fn()[:, heads], inp.reference("bf16", "bf16", heads), False)
                t = time_gpu(fn, warmup=max(5, int(rep_ms) // 10), rep=rep_ms)
                r = {**t, "tflops": inp.flops / t["ms"] / 1e9, "rel_rmse": rel, "note": ""}
            else:
                tuned = chosen.get(sweep_key(prov)) if PATHS[prov][3] == "planned" else None
                r = measure(inp, prov, tuned, rep=rep_ms)
            results[(n, prov)] = r
            log(f"{n:28s} {prov:34s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {r['note']}")
        except ReferenceMismatch as e:
            log(f"{n:28s} {prov:34s} NOT REPORTED (reference mismatch): {e}")
        except Exception as e:
            log(f"{n:28s} {prov:34s} SKIP {type(e).__name__}: {str(e)[:240]}")


def _report(args, log, results, done, paths, providers, mm, stamp, grid_tag, chosen, out_dir) -> None:
    # Ratios against the peer, per workload, and geomeans per path (one table row per path: the columns are
    # the workloads' short names, so the table stays readable with 17 paths).
    rows = []
    ratios: dict[str, list[float]] = {p: [] for p in paths}
    for n in done:
        peer = results.get((n, PEER))
        for p in providers:
            r = results.get((n, p))
            if r is None:
                continue
            if peer is not None and p != PEER:
                ratios[p].append(r["tflops"] / peer["tflops"])
            rows.append({
                "workload": n, "provider": p, "grid": grid_tag, "ms": f"{r['ms']:.4f}",
                "ms_p20": f"{r['ms_p20']:.4f}", "ms_p80": f"{r['ms_p80']:.4f}", "tflops": f"{r['tflops']:.2f}",
                "rel_rmse": f"{r['rel_rmse']:.3g}",
                "ratio_vs_fa3": f"{r['tflops'] / peer['tflops']:.4f}" if peer else "",
                "fp8_mm_tflops": f"{mm:.1f}", "note": r["note"],
            })  # fmt: skip
    log("")
    short = [n.split(" ")[0] for n in done]
    log("| path | " + " | ".join(short) + " | geomean | min |")
    log("| --- " * (len(done) + 3) + "|")
    for p in paths:
        cells = []
        for n in done:
            r, peer = results.get((n, p)), results.get((n, PEER))
            cells.append(f"{r['tflops'] / peer['tflops']:.2f}" if r and peer else "n/a")
        rs = ratios[p]
        geo = math.exp(sum(map(math.log, rs)) / len(rs)) if rs else float("nan")
        log(f"| {p} | " + " | ".join(cells) + f" | {geo:.2f} | {min(rs) if rs else float('nan'):.2f} |")
    peer_cells = [f"{results[(n, PEER)]['tflops']:.0f}" if (n, PEER) in results else "n/a" for n in done]
    log(f"| {PEER} TFLOP/s | " + " | ".join(peer_cells) + " | | |")
    for p in paths:
        _, floor = TARGETS[p]
        rs = ratios[p]
        if not rs:
            continue
        worst = min(range(len(rs)), key=rs.__getitem__)
        missed = sum(r < floor for r in rs)
        log(f"target {p}: min {rs[worst]:.3f} (>= {floor}) over {len(rs)} workloads: "
            + ("met" if not missed else f"MISSED on {missed}, worst by {floor - rs[worst]:.3f}"))  # fmt: skip
    f8 = results.get((CEILING, "fp8 dim-major planned"))
    if f8:
        r = f8["tflops"] / mm
        log(f"{CEILING}: fp8 = {r:.1%} of the same-run fp8 matmul")
    if rows:
        path = append_csv("mla_context_grid", rows)
        log(f"appended {len(rows)} rows to {path}")
        series = {p: [results[(n, p)]["tflops"] if (n, p) in results else 0.0 for n in done] for p in providers}
        png_name = "mla_context_random.png" if args.random is not None else "mla_context_grid.png"
        png = bar_plot(
            (out_dir or RESULTS) / png_name,
            f"MLA context 192/128, kvforge paths vs {PEER}, grid {grid_tag} ({stamp['gpu']}, rev {stamp['git_rev']})",
            short, series, "TFLOP/s",
        )  # fmt: skip
        log(f"plot: {png}")
        if out_dir is not None:
            (out_dir / "bench.json").write_text(
                json.dumps(
                    {
                        "stamp": stamp,
                        "fp8_mm": mm,
                        "grid": grid_tag,
                        "chosen": {k: cfg_str(v) for k, v in chosen.items()},
                    }
                )
            )


if __name__ == "__main__":
    sys.exit(main())
