"""Engine speed against the same run's hardware ceilings: decode ms/step over its HBM floor, prefill over matmul.

    python3 -m bench.bench_engine_speed --out $OUT          # the H200 run (real size, ~2.9 B parameters, bf16)
    python3 -m bench.bench_engine_speed --size tiny --quick  # a smoke run of the code path (no GPU numbers)

Same process, same model, in this order:

1. ceilings: device copy bandwidth (a 4 GiB device-to-device copy, bytes read + written, median) and the bf16
   matmul rate (8192^3, random inputs, median), both with ``triton.testing.do_bench``;
2. decode step grid, batch {1, 8, 64, 256} x context {512, 8192} x latent cache {bf16, FP8 e4m3}
   (``--latent``: ``EngineConfig.latent_cache_dtype`` "auto" / "fp8_e4m3"), no drafter: the generation-only step
   (:meth:`Runner.decode_static <kvforge.engine.runner.Runner.decode_static>`) on rows placed directly in the
   engine's cache (random latent pages and states, no prefill), as a CUDA-graph replay through
   :meth:`DecodeGraphs.run <kvforge.engine.graphs.DecodeGraphs.run>` (host upload + replay + the one host read)
   and as the same step run eagerly. Its floor: weights (every weight but the embedding, read once) + recurrent
   state (read once, written once per verified token) + latent rows read (2 or 1 bytes per value), over the
   measured copy bandwidth. FP8 rows also carry ``x_vs_bf16_graph`` / ``x_vs_bf16_eager``: the bf16-cache
   step's time over the FP8 one at the same point of the same run (issue 28's target: >= 1.6 at context >= 8k),
   reported only after one prompt on the FP8 cache passes its logits check against the plain forward pass;
3. engine steps, batch {1, 64} x context 512 (real prefill first): wall ms per decode step of ``Engine.step``
   (scheduler, cache manager, page table included) with ``cuda_graphs`` on and off, at batch 64 with the
   one-token drafter (verify steps) graphs on, and at batch 64 graphs on with ``Engine(sync=True)``: the
   step's split into host phases and the forward (``Engine.timings``, ms per step);
4. prefill: 8 prompts x 4096 tokens, one output token each (FP8 context attention, the default): prompt tok/s
   and the FLOP rate it implies (2 x non-embedding parameters per token + MLA context attention FLOPs; the KDA
   recurrence's own FLOPs are not counted) as a share of the matmul rate;
5. ``torch.profiler`` top kernels of 5 decode steps at batch 64, context 512, graphs on and eager;
6. (``--phases prefill_profile``, not in the default list) wall time against summed device time of one prefill
   of 1 x 300 (KDA prefill as the engine runs it, and ``chunk_kda`` only) and of ``--prefill-requests`` x 1024
   tokens, with the top kernels and host ops;
7. (``--phases prefill_syncs``, not in the default list) where one ``--prefill-requests`` x 1024 prefill reads
   the device back: the step runs under ``torch.cuda.set_sync_debug_mode("warn")`` and each synchronizing
   call's Python stack, cut to its innermost kvforge / fla-core frames, is counted.

Rows go to ``bench/results/engine_speed.csv`` (GPU, versions, git revision, date); ``--out`` also gets
``engine_speed.json``, the profiler tables and ``engine_speed.png`` (ms/step and floor per grid point).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from bench._common import RESULTS, append_csv, bar_plot, env_stamp
from kvforge.engine import Engine, EngineConfig, HybridModel, real, tiny


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ceilings(quick: bool) -> dict[str, float]:
    from triton.testing import do_bench

    n = (64 << 20) if quick else (1 << 30)  # fp32 elements: 4 GiB
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bw = 2 * src.numel() * 4 / (ms * 1e-3)

    m = 2048 if quick else 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * m**3 / (ms * 1e-3)}


def weight_bytes(model: HybridModel, draft: bool) -> int:
    """Bytes of every weight a decode step reads (all but the embedding table, whose rows are gathered)."""

    # The dataclass fields: the fused projection weights (HybridModel._fuse_projections) hold the same bytes as
    # the field views of them, so they are not counted again.
    def mixer(m) -> list[torch.Tensor]:
        return [getattr(m, f.name) for f in fields(m)]

    ts = [model.lm_head, model.final_norm]
    for blk in model.blocks:
        ts += [blk.norm1, blk.norm2, blk.gate, blk.up, blk.down, *mixer(blk.mixer)]
    if draft and model.draft_block is not None:
        blk = model.draft_block
        ts += [blk.norm1, blk.norm2, blk.gate, blk.up, blk.down, *mixer(blk.mixer), model.draft_fc]
        ts += [*model.draft_norms, model.draft_final_norm]  # type: ignore[misc]
    return sum(t.numel() * t.element_size() for t in ts)


def floor_bytes(
    model: HybridModel, batch: int, ctx: int, t: int, draft: bool, latent_esize: int | None = None
) -> dict[str, int]:
    mc = model.config
    esize = latent_esize or torch.empty(0, dtype=model.dtype).element_size()
    state = 4 * mc.linear_heads * mc.linear_head_dim**2 * len(mc.linear_layers)
    mla = len(mc.mla_layers) + (1 if draft else 0)
    return {
        "weights": weight_bytes(model, draft),
        "state": batch * state * (1 + t),
        "latent": batch * (ctx + t) * mc.latent_dim * esize * mla,
    }


def _grid_engine(model: HybridModel, batch: int, ctx: int, tpb: int, latent: str = "auto") -> Engine:
    blocks = ctx // tpb + 2
    cfg = EngineConfig(
        tokens_per_block=tpb,
        attention_pages=batch * blocks,
        draft_pages=8,
        state_pages=batch + 8,
        max_num_requests=batch,
        max_blocks_per_request=blocks,
        max_num_tokens=max(256, batch),
        latent_cache_dtype=latent,
    )
    return Engine(model, cfg)


def check_fp8_latent(model: HybridModel, args) -> dict:
    """Before the FP8-latent rows are reported: one prompt's logits on an e4m3 latent cache against the plain
    forward pass, held to twice tests/test_engine_gpu.py's bound (tests/test_engine_fp8_latent.py says why)."""
    from kvforge.engine import reference_logits
    from kvforge.engine.numerics import compare_logits

    rng = random.Random(17)
    n, t = (48, 4) if args.quick else (300, 12)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(n)]
    cfg = EngineConfig(tokens_per_block=args.tokens_per_block, latent_cache_dtype="fp8_e4m3", max_num_tokens=2048)
    eng = Engine(model, cfg, record_logits=True)
    got = eng.generate({0: prompt}, t)[0]
    ref, _ = reference_logits(model, prompt + got)
    ref_rows = ref[n - 1 : n - 1 + len(got)]
    chk = compare_logits(torch.cat(eng.logits[0]).to(ref_rows.device), ref_rows, got, 0.5 * float(ref_rows.std()))
    print(f"check vs reference (FP8 latent cache): {chk.summary()}", flush=True)
    if not chk.ok:
        raise SystemExit(
            f"bench_engine_speed: the FP8 latent cache failed its reference check, no rows: {chk.summary()}"
        )
    return {"max_abs_logit_err": chk.max_abs_err, "logit_std": chk.logit_std, "bound": chk.bound, "ok": chk.ok}


def decode_grid(model: HybridModel, args, bw: float) -> list[dict]:
    rows = []
    if "fp8_e4m3" in args.latent:
        check_fp8_latent(model, args)
    for ctx, batch, latent in [(c, b, lt) for c in args.contexts for b in args.batches for lt in args.latent]:
        eng = _grid_engine(model, batch, ctx, args.tokens_per_block, latent)
        gen = torch.Generator(device=model.device).manual_seed(batch * 7919 + ctx)
        for pool in eng.cache.state.values():
            pool.normal_(0.0, 0.5, generator=gen)  # never time on zeros
        for pool in eng.cache.latent.values():  # the same draws for both caches; e4m3 holds them x scale
            vals = torch.empty(pool.shape, device=pool.device).normal_(0.0, 0.5, generator=gen)
            pool.copy_(vals * (eng.cache.latent_scale or 1.0))
        blocks = ctx // args.tokens_per_block + 1
        pages = torch.randperm(batch * (blocks + 1), device=model.device)[: batch * blocks].view(batch, blocks)
        eng._offsets[0, :batch, 0, :blocks] = pages.to(torch.int32)
        slots, state_rows, starts = list(range(batch)), list(range(batch)), [ctx] * batch
        fb = floor_bytes(model, batch, ctx, 1, False, eng.cache.latent[model.config.mla_layers[0]].element_size())
        floor_ms = 1e3 * sum(fb.values()) / bw
        res: dict[str, float] = {}
        for mode in ("graph", "eager"):
            g = eng.decode_graphs(capture=mode == "graph")
            g.run(slots, state_rows, starts)  # capture / compile
            _sync()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    g.run(slots, state_rows, starts)  # ends with the step's host read: synchronous
                times.append(1e3 * (time.perf_counter() - t0) / args.steps)
            res[mode] = sorted(times)[len(times) // 2]
        row = {
            "phase": "decode_step", "batch": batch, "context": ctx, "draft_len": 0, "latent": latent,
            "ms_graph": res["graph"], "ms_eager": res["eager"], "floor_ms": floor_ms,
            "x_floor_graph": res["graph"] / floor_ms, "x_floor_eager": res["eager"] / floor_ms,
            "tok_per_s_graph": batch / (res["graph"] * 1e-3),
            "floor_weights_gb": fb["weights"] / 1e9, "floor_state_gb": fb["state"] / 1e9,
            "floor_latent_gb": fb["latent"] / 1e9,
        }  # fmt: skip
        peer = [r for r in rows if (r["batch"], r["context"], r["latent"]) == (batch, ctx, "auto")]
        if latent != "auto" and peer:
            row["x_vs_bf16_graph"] = peer[0]["ms_graph"] / res["graph"]
            row["x_vs_bf16_eager"] = peer[0]["ms_eager"] / res["eager"]
        print(
            f"decode {latent:8s} batch {batch:3d} ctx {ctx:5d}: graph {res['graph']:7.2f} ms "
            f"({row['x_floor_graph']:.2f}x floor {floor_ms:.2f} ms), eager {res['eager']:7.2f} ms "
            f"({row['x_floor_eager']:.2f}x)"
            + (f", bf16/fp8 {row['x_vs_bf16_graph']:.2f}" if "x_vs_bf16_graph" in row else ""),
            flush=True,
        )
        rows.append(row)
        del eng
        torch.cuda.empty_cache()
    return rows


def _engine_cfg(args, batch: int, graphs: bool) -> EngineConfig:
    return EngineConfig(
        tokens_per_block=args.tokens_per_block,
        attention_pages=max(512, batch * 16),
        draft_pages=max(512, batch * 16),
        state_pages=batch + 16,
        max_num_tokens=8192,
        max_num_requests=max(batch, 8),
        max_blocks_per_request=64,
        cuda_graphs=graphs,
    )


def engine_steps(model: HybridModel, args, bw: float) -> list[dict]:
    rows = []
    rng = random.Random(3)
    vocab = model.config.vocab_size
    # (batch, draft_len, [(graphs, sync)]): sync=True waits for the device at every phase end, so the step's
    # wall time splits into host phases and the forward (slower in total: the host no longer runs ahead).
    plan = ((1, 0, ((True, False), (False, False))), (64, 0, ((True, False), (False, False), (True, True))),
            (64, 1, ((True, False),)))  # fmt: skip
    for batch, draft_len, modes in plan:
        for graphs, sync in modes:
            eng = Engine(model, _engine_cfg(args, batch, graphs), draft_len=draft_len, sync=sync)
            for rid in range(batch):
                eng.add_request(rid, [rng.randrange(vocab) for _ in range(args.step_ctx)], args.step_tokens)
            while any(r.state.value != "generation" for r in eng.scheduler.running) or eng.scheduler.waiting:
                eng.step()
            for _ in range(3):  # the first replays capture the bucket
                eng.step()
            # Requests entered generation in prefill waves, so they finish in waves and the batch shrinks into
            # smaller buckets inside the timed loop: capture those now, not there (a capture is a warm-up run
            # plus the capture, far longer than a step).
            if eng.graphs is not None:
                eng.graphs.capture_all()
            captured = len(eng.graphs._graphs) if eng.graphs is not None else 0
            _sync()
            eng.timings.clear()
            gen0, steps = eng.tokens["generation"], 0
            t0 = time.perf_counter()
            while eng.scheduler.has_unfinished:
                eng.step()
                steps += 1
            _sync()
            dt = time.perf_counter() - t0
            ms = 1e3 * dt / max(steps, 1)
            if eng.graphs is not None and len(eng.graphs._graphs) != captured:
                raise SystemExit("bench_engine_speed: a bucket was captured inside the timed loop")
            t = 1 + draft_len
            floor_ms = 1e3 * sum(floor_bytes(model, batch, args.step_ctx, t, draft_len > 0).values()) / bw
            row = {
                "phase": "engine_step", "batch": batch, "context": args.step_ctx, "draft_len": draft_len,
                "cuda_graphs": graphs, "ms_step": ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                "gen_tok_per_s": (eng.tokens["generation"] - gen0) / dt, "steps": steps, "sync": sync,
                "phases_ms": json.dumps({k: round(1e3 * v / max(steps, 1), 3) for k, v in eng.timings.items()}),
            }  # fmt: skip
            print(
                f"engine batch {batch:3d} draft {draft_len} graphs {graphs!s:5} sync {sync!s:5}: {ms:7.2f} ms/step "
                f"({row['x_floor']:.2f}x floor {floor_ms:.2f} ms), {row['gen_tok_per_s']:.0f} generated tok/s"
                + (f"; phases ms/step {row['phases_ms']}" if sync else ""),
                flush=True,
            )
            rows.append(row)
            del eng
            torch.cuda.empty_cache()
    return rows


def _prefill_config(tpb: int, n_req: int, n_tok: int, rounds: int = 1) -> EngineConfig:
    """An engine for ``rounds`` generations of ``n_req`` fresh prompts of ``n_tok`` tokens (pages for all of them:
    earlier rounds' prefixes stay cached), 8192 tokens per step, a snapshot every 1024 tokens."""
    pages = rounds * n_req * (n_tok // tpb + 2)
    return EngineConfig(
        tokens_per_block=tpb,
        attention_pages=pages,
        draft_pages=pages,
        state_pages=rounds * n_req * 8 + 16,
        max_num_tokens=8192,
        max_num_requests=max(8, n_req),
        max_blocks_per_request=n_tok // tpb + 2,
        snapshot_interval=1024,
    )


def _device_us(e) -> float:
    """A profiler event's own device time in µs (the attribute's name differs between torch versions)."""
    return float(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0))


def prefill(model: HybridModel, args, mm: float) -> dict:
    rng = random.Random(5)
    vocab = model.config.vocab_size
    mc = model.config
    prompts = {i: [rng.randrange(vocab) for _ in range(args.prefill_len)] for i in range(args.prefill_requests)}
    cfg = _prefill_config(args.tokens_per_block, args.prefill_requests, args.prefill_len)
    times = []
    for _ in range(args.prefill_reps):
        eng = Engine(model, cfg)
        _sync()
        t0 = time.perf_counter()
        eng.generate(prompts, 1)
        _sync()
        times.append(time.perf_counter() - t0)
        del eng
    dt = sorted(times)[len(times) // 2]
    n_tok = args.prefill_requests * args.prefill_len
    # Every target weight but the embedding table (a gather) takes part in one multiply-add per token; the
    # drafter does not run (draft_len 0).
    dense = 2 * (replace(mc, draft_layers=0).num_params() - vocab * mc.hidden_size)
    q = args.prefill_len
    attn = len(mc.mla_layers) * 2 * mc.num_heads * (mc.qk_head_dim + mc.v_head_dim) * (q + 1) / 2
    flops = n_tok * (dense + attn)
    rate = flops / dt
    out = {
        "phase": "prefill", "batch": args.prefill_requests, "context": q, "prefill_tok_per_s": n_tok / dt,
        "prefill_flops_per_s": rate, "matmul_share": rate / mm, "runs_s": json.dumps([round(t, 4) for t in times]),
    }  # fmt: skip
    print(
        f"prefill {args.prefill_requests}x{q}: {n_tok / dt:.0f} tok/s, {rate / 1e12:.0f} TFLOP/s = "
        f"{100 * rate / mm:.0f}% of the matmul rate {mm / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    return out


def profile(model: HybridModel, args, out_dir: Path | None) -> dict[str, list]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    res = {}
    batch, ctx = (64, 512) if not args.quick else (4, 64)
    for mode in ("graph", "eager"):
        eng = _grid_engine(model, batch, ctx, args.tokens_per_block)
        for pool in [*eng.cache.latent.values(), *eng.cache.state.values()]:
            pool.normal_(0.0, 0.5)
        blocks = ctx // args.tokens_per_block + 1
        eng._offsets[0, :batch, 0, :blocks] = torch.arange(batch * blocks, device=model.device, dtype=torch.int32).view(
            batch, blocks
        )
        g = eng.decode_graphs(capture=mode == "graph")
        ids = (list(range(batch)), list(range(batch)), [ctx] * batch)
        for _ in range(3):
            g.run(*ids)
        _sync()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.run(*ids)
            _sync()

        ka = sorted((e for e in prof.key_averages() if _device_us(e) > 0), key=lambda e: -_device_us(e))
        top = [[e.key[:90], e.count // 5, round(_device_us(e) / 5 / 1e3, 4)] for e in ka[:15]]
        total = sum(_device_us(e) for e in ka) / 5 / 1e3
        res[mode] = top
        print(f"profiler, decode batch {batch} ctx {ctx}, {mode}: {total:.2f} device ms/step (sum over kernels), "
              f"{sum(e.count for e in ka) / 5:.0f} kernels/step")  # fmt: skip
        print("  kernel | calls/step | ms/step")
        for name, calls, ms in top:
            print(f"  {name} | {calls} | {ms}")
        if out_dir is not None:
            (out_dir / f"profile_{mode}.txt").write_text(
                prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
            )
        del eng
    return res


def prefill_profile(model: HybridModel, args, out_dir: Path | None) -> dict[str, dict]:
    """Where a prefill step's wall time goes: one request of a few hundred tokens (the fleet's common step), twice
    (KDA prefill as the engine runs it, then ``chunk_kda`` only: the same run's A/B of the short-segment recurrent
    path, :data:`kvforge.engine.ops.RECURRENT_PREFILL_MAX_TOKENS`), and ``--prefill-requests`` x 1024, each a fresh
    prompt after a warm-up; wall time, the kernels' summed device time, the top kernels and the top host ops (a
    host-bound step shows wall >> device)."""
    import kvforge.engine.ops as ops

    rng = random.Random(9)
    short = ops.RECURRENT_PREFILL_MAX_TOKENS
    cases = [(1, 300, short), (1, 300, 0), (args.prefill_requests, 1024, short)]
    if args.quick:
        cases = [(1, 30, short), (1, 30, 0), (2, 64, short)]
    res: dict[str, dict] = {}
    for n_req, n_tok, recurrent_max in cases:
        ops.RECURRENT_PREFILL_MAX_TOKENS = recurrent_max
        try:
            label = f"prefill {n_req}x{n_tok}" + (" chunk_kda only" if recurrent_max == 0 else "")
            res[label] = _prefill_profile_case(model, args, out_dir, rng, n_req, n_tok, label)
        finally:
            ops.RECURRENT_PREFILL_MAX_TOKENS = short
    return res


def _prefill_profile_case(model: HybridModel, args, out_dir: Path | None, rng: random.Random, n_req: int,
                          n_tok: int, label: str) -> dict:  # fmt: skip
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    vocab = model.config.vocab_size
    eng = Engine(model, _prefill_config(args.tokens_per_block, n_req, n_tok, rounds=4))

    def prompts(k: int) -> dict[int, list[int]]:
        return {100 * k + i: [rng.randrange(vocab) for _ in range(n_tok)] for i in range(n_req)}

    for k in range(2):  # warm-up: first-call compiles and plans
        eng.generate(prompts(k), 1)
    _sync()
    walls = []
    for k in range(2, 5):
        t0 = time.perf_counter()
        eng.generate(prompts(k), 1)
        _sync()
        walls.append(time.perf_counter() - t0)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts(9), 1)
        _sync()
    ka = prof.key_averages()

    dev = sorted((e for e in ka if _device_us(e) > 0), key=lambda e: -_device_us(e))
    host = sorted(ka, key=lambda e: -float(e.self_cpu_time_total))
    wall = sorted(walls)[1] * 1e3
    total = sum(_device_us(e) for e in dev) / 1e3
    reads = ("aten::item", "aten::_local_scalar_dense")
    syncs = sum(e.count for e in ka if "Synchronize" in e.key or e.key in reads)
    out = {
        "wall_ms": round(wall, 3), "device_ms": round(total, 3), "kernels": sum(e.count for e in dev),
        "host_syncs": syncs,
        "top_device": [[e.key[:90], e.count, round(_device_us(e) / 1e3, 3)] for e in dev[:15]],
        "top_host": [[e.key[:90], e.count, round(float(e.self_cpu_time_total) / 1e3, 3)] for e in host[:12]],
    }  # fmt: skip
    print(f"profiler, {label}: wall {wall:.1f} ms (median of 3), device {total:.1f} ms summed over "
          f"{out['kernels']} kernels, {syncs} host syncs / item reads")  # fmt: skip
    print("  kernel | calls | ms")
    for name, calls, ms in out["top_device"]:
        print(f"  {name} | {calls} | {ms}")
    print("  host op | calls | self CPU ms")
    for name, calls, ms in out["top_host"]:
        print(f"  {name} | {calls} | {ms}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        name = label.removeprefix("prefill ").replace(" ", "_")
        (out_dir / f"profile_prefill_{name}.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=40))
    del eng
    return out


def prefill_syncs(model: HybridModel, args) -> dict[str, int]:
    """Phase 7 (see the module docstring): synchronizing call sites of one prefill, by count."""
    import traceback
    import warnings
    from collections import Counter

    rng = random.Random(11)
    n_req, n_tok = args.prefill_requests, (64 if args.quick else 1024)
    vocab = model.config.vocab_size
    eng = Engine(model, _prefill_config(args.tokens_per_block, n_req, n_tok, rounds=2))

    def prompts(k: int) -> dict[int, list[int]]:
        return {100 * k + i: [rng.randrange(vocab) for _ in range(n_tok)] for i in range(n_req)}

    eng.generate(prompts(0), 1)  # warm-up: compiles, plans, fla-core's config choice
    _sync()
    sites: Counter[str] = Counter()

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        ours = [f for f in traceback.extract_stack()[:-1] if "/kvforge/" in f.filename or "/fla/" in f.filename]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[-3:][::-1]) or "?"] += 1

    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.generate(prompts(1), 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    print(f"prefill {n_req}x{n_tok} synchronizing calls: {sum(sites.values())} at {len(sites)} sites", flush=True)
    for site, n in sites.most_common(25):
        print(f"  {n:5d}  {site}")
    del eng
    return dict(sites)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--size", choices=("tiny", "real"), default="real")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timed repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--step-ctx", type=int, default=512)
    ap.add_argument("--step-tokens", type=int, default=24)
    ap.add_argument("--prefill-requests", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--phases", nargs="+", default=["grid", "engine", "prefill", "profile"])
    ap.add_argument("--latent", nargs="+", choices=("auto", "fp8_e4m3"), default=["auto", "fp8_e4m3"],
                    help="latent cache dtypes of the decode grid (auto: the model's bf16)")  # fmt: skip
    args = ap.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)  # every phase that writes a file writes it here
    if not torch.cuda.is_available():
        raise SystemExit("bench_engine_speed: needs a CUDA device (the decode graphs and the ceilings)")
    if args.quick:
        args.batches, args.contexts, args.steps, args.reps = [1, 4], [64], 2, 2
        args.step_ctx, args.step_tokens, args.prefill_requests, args.prefill_len = 64, 6, 2, 256
        args.prefill_reps, args.tokens_per_block = 1, 16
    model = HybridModel(real() if args.size == "real" else tiny(), device="cuda")
    out: dict = {"params": model.config.num_params(), **env_stamp()}
    out.update(ceilings(args.quick))
    bw, mm = out["copy_bytes_per_s"], out["matmul_flops_per_s"]
    print(f"ceilings: device copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    if "grid" in args.phases:
        rows += decode_grid(model, args, bw)
    if "engine" in args.phases:
        rows += engine_steps(model, args, bw)
    if "prefill" in args.phases:
        rows.append(prefill(model, args, mm))
    if "profile" in args.phases:
        out["profile"] = profile(model, args, args.out)
    if "prefill_profile" in args.phases:
        out["prefill_profile"] = prefill_profile(model, args, args.out)
    if "prefill_syncs" in args.phases:
        out["prefill_syncs"] = prefill_syncs(model, args)
    out["rows"] = rows
    stamp = {"copy_tb_per_s": bw / 1e12, "matmul_tflops": mm / 1e12, "size": args.size}
    append_csv("engine_speed", [{**stamp, **r} for r in rows])
    grid = [r for r in rows if r["phase"] == "decode_step"]
    if grid:
        labels = [f"b{r['batch']} ctx{r['context']}{' fp8' if r['latent'] != 'auto' else ''}" for r in grid]
        png = (args.out or RESULTS) / "engine_speed.png"
        bar_plot(
            png,
            f"decode ms/step, real model bf16, {out['gpu']} (git {out['git_rev']}); floor = bytes / measured copy BW",
            labels,
            {
                "CUDA graph": [r["ms_graph"] for r in grid],
                "eager": [r["ms_eager"] for r in grid],
                "HBM floor": [r["floor_ms"] for r in grid],
            },
            "ms per step (log)",
            log=True,
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_speed.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
