"""Engine numbers: prefill and decode tokens/s, the host share of a decode step, the prefix-reuse speedup.

    python3 -m bench.bench_engine --size real            # the H200 run (~2.9 B parameters, bf16)
    python3 -m bench.bench_engine --size tiny --quick    # a CPU smoke run (interpreter)

Phases (one process, same model):
1. warm-up: one small prefill and decode (compiles the kernels; fla-core's first calls autotune unless its
   configs for this GPU are committed, see :mod:`kvforge.engine.fla_configs`), then, with FP8 and with 16-bit
   context attention, one prompt's logits against the plain forward pass (:func:`kvforge.engine.numerics.
   compare_logits`, the bounds of tests/test_engine_gpu.py) and the per-layer, per-component errors of one
   request (:func:`kvforge.engine.numerics.component_errors`);
2. prefill: ``--prefill-requests`` prompts of ``--prefill-len`` tokens, one output token each: prompt tokens / s,
   with FP8 and with 16-bit context attention interleaved (median of ``--prefill-reps``);
3. decode at batch ``--batch``: that many requests decoding together after their prefill; generated tokens / s
   over the decode steps only, and the share of each step spent in kvforge's host code (scheduler, cache
   manager, page table, slot stores, state-index upload: every phase of :mod:`kvforge.engine.phases` but the
   capture, replay, forward and read) against the whole step, timed with the device synchronised at phase ends
   (``Engine(sync=True)``), garbage collector on;
4. prefix reuse: the conversation trace's first ``--trace-requests`` requests (prompts built from their block
   hash ids, 512 tokens per id, capped at ``--trace-max-len``; ``--trace-out`` tokens each) with reuse on and
   off, interleaved ``--trace-reps`` times: the fastest wall time and prompt tokens computed; speedup = off / on.

Rows go to ``bench/results/engine.csv`` (GPU, versions, git revision) and, with ``--out``, a JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench._common import append_csv, env_stamp
from kvforge.engine import Engine, EngineConfig, HybridModel, real, reference_logits, tiny
from kvforge.engine.numerics import compare_logits, component_errors
from kvforge.engine.phases import STEP_PHASES
from kvforge.kvcache.replay import find_trace

T_START = time.perf_counter()
# The correctness bound of tests/test_engine_gpu.py (a fraction of the reference's logit std).
BOUND = 0.25


def _engine(
    model: HybridModel,
    args,
    *,
    reuse: bool = True,
    sync: bool = False,
    context_fp8: bool = True,
    context_v_layout: str = "dim_major",
) -> Engine:
    cfg = EngineConfig(
        tokens_per_block=args.tokens_per_block,
        attention_pages=args.pages,
        draft_pages=args.pages,
        state_pages=args.state_pages,
        max_num_tokens=args.max_num_tokens,
        max_num_requests=max(args.batch, 8),
        max_blocks_per_request=args.max_blocks,
        snapshot_interval=args.snapshot_interval,
        reuse=reuse,
        context_fp8=context_fp8,
        context_v_layout=context_v_layout,
    )
    return Engine(model, cfg, sync=sync)


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> dict[int, list[int]]:
    return {i: [rng.randrange(vocab) for _ in range(length)] for i in range(n)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Engine(sync=True) times the step's phases (kvforge.engine.phases); these run the model, the rest is host code.
DEVICE_PHASES = ("capture", "replay", "forward", "read")
HOST_PHASES = tuple(p for p in STEP_PHASES if p not in DEVICE_PHASES)


def run(args) -> dict:
    cfg = real() if args.size == "real" else tiny()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = HybridModel(cfg, device=dev)
    rng = random.Random(0)
    vocab = cfg.vocab_size
    out: dict = {"params": cfg.num_params(), "size": args.size, **env_stamp()}
    t0 = time.perf_counter()
    warm = _engine(model, args)
    warm.generate(_prompts(rng, min(args.batch, 4), 200, vocab), 3)
    warm.generate(_prompts(rng, args.batch, 64, vocab), 2)
    _sync()
    out["warmup_s"] = time.perf_counter() - t0
    print(f"warm-up {out['warmup_s']:.1f} s", flush=True)
    del warm

    if args.export_fla_configs is not None:
        from kvforge.engine.fla_configs import export_fla_configs

        print(f"fla-core configs exported: {export_fla_configs(args.export_fla_configs)} kernels", flush=True)

    # Correctness at this size, FP8 and 16-bit context attention: logits against the plain forward pass (same
    # weights), the near-tie-aware greedy check, and the per-layer, per-component errors of one request.
    prompt = [rng.randrange(vocab) for _ in range(args.check_len)]
    for fp8 in (True, False):
        tag = "fp8" if fp8 else "bf16"
        cfg_c = replace(_engine(model, args).config, context_fp8=fp8)
        chk_eng = Engine(model, cfg_c, record_logits=True)
        got = chk_eng.generate({0: prompt}, args.check_tokens)[0]
        ref, _ = reference_logits(model, prompt + got)
        rows = torch.cat(chk_eng.logits[0])
        ref_rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(got)]
        chk = compare_logits(rows, ref_rows, got, BOUND * float(ref_rows.std()))
        out[f"check_{tag}"] = {
            "max_abs_logit_err": chk.max_abs_err,
            "logit_std": chk.logit_std,
            "bound": chk.bound,
            "rows": chk.rows,
            "greedy_mismatches": chk.mismatches,
            "near_ties_excused": chk.excused,
            "unexcused": len(chk.unexcused),
            "decisive_rows": chk.decisive,
            "ok": chk.ok,
        }
        print(f"check vs reference ({tag} context attention): {chk.summary()}", flush=True)
        del chk_eng
        comp = component_errors(model, cfg_c, prompt[: args.probe_len], args.probe_tokens)
        out[f"components_{tag}"] = [dataclasses.asdict(c) for c in comp]
        print(f"per-layer errors ({tag}): layer kind phase tokens mixer_rel hidden_rel", flush=True)
        for c in comp:
            hid = "-" if c.hidden_rel is None else f"{c.hidden_rel:.2e}"
            print(f"  {c.layer:3d} {c.kind:5s} {c.phase:7s} {c.tokens:4d} {c.mixer_rel:.2e} {hid}", flush=True)

    # The context paths (FP8 with V dim-major, the default; FP8 with V token-major; 16-bit attention) in this
    # run, interleaved, so their ratios are not comparisons across runs; the engine's default is the headline.
    prompts = _prompts(rng, args.prefill_requests, args.prefill_len, vocab)
    variants = {"": (True, "dim_major"), "_fp8_token_major": (True, "token_major"), "_bf16": (False, "dim_major")}
    times: dict[str, list[float]] = {tag: [] for tag in variants}
    for _ in range(args.prefill_reps):
        for tag, (fp8, layout) in variants.items():
            eng = _engine(model, args, context_fp8=fp8, context_v_layout=layout)
            _sync()
            t0 = time.perf_counter()
            eng.generate(prompts, 1)
            _sync()
            times[tag].append(time.perf_counter() - t0)
            del eng
    n_tok = args.prefill_requests * args.prefill_len
    names = {"": "FP8, V dim-major", "_fp8_token_major": "FP8, V token-major", "_bf16": "16-bit"}
    for tag in variants:
        dt = sorted(times[tag])[len(times[tag]) // 2]
        out[f"prefill_tokens_per_s{tag}"] = n_tok / dt
        runs = ", ".join(f"{t:.3f}" for t in times[tag])
        print(f"prefill ({names[tag]} context) {n_tok / dt:.0f} tok/s (median of {runs} s)", flush=True)
    out["prefill_fp8_speedup"] = out["prefill_tokens_per_s"] / out["prefill_tokens_per_s_bf16"]
    out["prefill_v_dim_major_speedup"] = out["prefill_tokens_per_s"] / out["prefill_tokens_per_s_fp8_token_major"]
    print(f"prefill FP8 / 16-bit context: {out['prefill_fp8_speedup']:.2f}x", flush=True)
    print(f"prefill FP8 V dim-major / token-major: {out['prefill_v_dim_major_speedup']:.2f}x", flush=True)

    if args.budget_s and time.perf_counter() - T_START > args.budget_s:
        print("out of time budget: decode phase skipped", flush=True)
        return out
    eng = _engine(model, args, sync=True)
    for rid, p in _prompts(rng, args.batch, args.decode_prompt_len, vocab).items():
        eng.add_request(rid, p, args.decode_tokens)
    while any(r.state.value != "generation" for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.timings.clear()
    gen0 = eng.tokens["generation"]
    _sync()
    t0 = time.perf_counter()
    steps = 0
    while eng.scheduler.has_unfinished:
        eng.step()
        steps += 1
    _sync()
    dt = time.perf_counter() - t0
    host = sum(eng.timings.get(k, 0.0) for k in HOST_PHASES)
    total = sum(eng.timings.values())
    out["decode_batch"] = args.batch
    out["decode_tokens_per_s"] = (eng.tokens["generation"] - gen0) / dt
    out["decode_step_ms"] = 1e3 * dt / max(steps, 1)
    out["host_share"] = host / total
    out["host_phases_ms_per_step"] = {
        k: 1e3 * eng.timings[k] / max(steps, 1) for k in (*HOST_PHASES, *DEVICE_PHASES) if k in eng.timings
    }
    print(
        f"decode batch {args.batch}: {out['decode_tokens_per_s']:.0f} tok/s, {out['decode_step_ms']:.2f} ms/step, "
        f"host share {100 * out['host_share']:.1f}% {out['host_phases_ms_per_step']}",
        flush=True,
    )
    del eng

    if args.budget_s and time.perf_counter() - T_START > args.budget_s:
        print("out of time budget: prefix-reuse phase skipped", flush=True)
        return out
    trace = args.trace if args.trace is not None else find_trace()
    if trace is None or not trace.is_file():
        print(f"trace not found ({trace}; set --trace or $KVFORGE_TRACE): prefix-reuse phase skipped", flush=True)
        return out
    reqs = []
    with trace.open() as f:
        for line in f:
            reqs.append(json.loads(line))
            if len(reqs) == args.trace_requests:
                break

    def block(h: int) -> list[int]:
        r = random.Random(h)
        return [r.randrange(vocab) for _ in range(512)]

    trace_prompts = {}
    for i, r in enumerate(reqs):
        n = min(r["input_length"], args.trace_max_len)
        toks: list[int] = []
        for h in r["hash_ids"]:
            toks.extend(block(h))
            if len(toks) >= n:
                break
        trace_prompts[i] = toks[:n]
    trace_s: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.trace_reps):
        for reuse in (True, False):
            eng = _engine(model, args, reuse=reuse)
            _sync()
            t0 = time.perf_counter()
            eng.generate(trace_prompts, args.trace_out)
            _sync()
            dt = time.perf_counter() - t0
            trace_s[reuse].append(dt)
            key = "on" if reuse else "off"
            out[f"trace_context_tokens_reuse_{key}"] = eng.tokens["context"]
            print(f"trace reuse {key}: {dt:.2f} s, {eng.tokens['context']} prompt tokens computed", flush=True)
            del eng
    for reuse, key in ((True, "on"), (False, "off")):
        # The fastest repetition: the first one may still compile kernels for new prompt lengths.
        out[f"trace_s_reuse_{key}"] = min(trace_s[reuse])
    out["trace_prompt_tokens"] = sum(len(p) for p in trace_prompts.values())
    out["reuse_speedup"] = out["trace_s_reuse_off"] / out["trace_s_reuse_on"]
    print(f"prefix-reuse speedup {out['reuse_speedup']:.2f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("tiny", "real"), default="real")
    ap.add_argument("--quick", action="store_true", help="small workloads (CPU smoke run)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--state-pages", type=int, default=400)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-blocks", type=int, default=128)
    ap.add_argument("--snapshot-interval", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill-requests", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--prefill-reps", type=int, default=3, help="repetitions per context path (median)")
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--trace-requests", type=int, default=200)
    ap.add_argument("--trace-max-len", type=int, default=2048)
    ap.add_argument("--trace-out", type=int, default=2)
    ap.add_argument("--trace-reps", type=int, default=2, help="repetitions of reuse on / off (fastest)")
    ap.add_argument("--trace", type=Path, default=None, help="default: $KVFORGE_TRACE or shared/data/")
    ap.add_argument("--check-len", type=int, default=300)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--probe-len", type=int, default=200, help="prompt tokens of the per-layer error probe")
    ap.add_argument("--probe-tokens", type=int, default=6)
    ap.add_argument("--export-fla-configs", type=Path, default=None, help="write fla-core's tuned configs here")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip later phases past this many seconds")
    args = ap.parse_args()
    if args.quick:
        args.tokens_per_block, args.pages, args.state_pages, args.max_blocks = 16, 256, 64, 64
        args.snapshot_interval, args.batch, args.prefill_requests, args.prefill_len = 64, 4, 2, 48
        args.decode_prompt_len, args.decode_tokens, args.trace_requests = 24, 3, 4
        args.trace_max_len, args.trace_out, args.max_num_tokens, args.check_len = 96, 1, 256, 30
        args.check_tokens, args.probe_len, args.probe_tokens = 4, 24, 3
        args.prefill_reps, args.trace_reps = 1, 1
    out = run(args)
    row = {k: v for k, v in out.items() if not isinstance(v, (dict, list))}
    for tag in ("fp8", "bf16"):
        for k, v in out.get(f"check_{tag}", {}).items():
            row[f"check_{tag}_{k}"] = v
    row["host_phases_ms_per_step"] = json.dumps(out.get("host_phases_ms_per_step"))
    append_csv("engine", [row])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
