"""Profile the engine's step time for ``kvforge simulate --profile`` (as Vidur profiles before it simulates).

Runs a grid of workloads through one :class:`~kvforge.engine.Engine` built as ``kvforge serve`` builds it (same
budgets), times every ``Engine.step`` (wall time: the step reads its emitted tokens back, so device work is
included), records what the scheduler put in it (context chunks as ``(start, tokens)``, generation rows and
their contexts), fits :mod:`kvforge.sim.profile`'s linear step-time model on those samples and writes the
profile JSON (coefficients, the model's layout, the engine's budgets, every sample with its fitted value, the
fit's relative errors, machine and versions). Grid: decode batches {1, 4, 8, 16} (more on a GPU) at prompt
lengths {32, 128, 256} (x8 on a GPU), single prompts {16 .. 500} (x8), continued prompts (a cached prefix) and
two prompts in one step, all within ``--max-len`` tokens.

``--contention K`` then measures how steps slow down when engines share the device: K engine processes (built
the same way) each repeat the same cycle of requests (a fresh prompt of 32..160 tokens, x8 on a GPU, and
``--contention-tokens`` new tokens, stepped to the end): one engine alone, then 2 at once, one alone, 3 at
once, ..., one alone (each k between two alone phases). A step counts for k only when it ended before the phase's
stop time, while all k engines were still stepping; ``slowdown(k)`` is the mean complete-cycle time with k engines
over the mean of the two alone phases beside it, and ``alone_drift`` (the slowest alone phase over the fastest; a
warning past 1.25) says whether the machine's load held still. The curve goes into the profile's ``contention`` object
(:mod:`kvforge.sim.contention`) with each phase's figures; ``--contention-only`` adds it to an existing profile.

    python3 bench/profile_step_time.py --size tiny --max-len 256 --contention 3 \
        --out bench/results/step_profile_cpu_tiny.json                                           # CPU
    python3 bench/profile_step_time.py --size real --attention-pages 16384 --state-pages 256 \
        --max-num-tokens 8192 --max-num-requests 64 --max-blocks-per-request 512 --out $OUT/profile.json  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import env_stamp
from kvforge.sim.model import ModelSpec
from kvforge.sim.profile import FEATURES, FORMAT, fit_step_times, step_features


def serve_args(size: str, **over: object) -> argparse.Namespace:
    """``kvforge serve``'s parsed defaults for ``--model size`` (the fleet bench passes the same flags)."""
    from kvforge.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", size, "--no-warmup"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def build_engine(size: str, sa: argparse.Namespace, device: str):
    """The engine ``kvforge serve`` would build from ``sa`` (random weights, no drafter), warmed up."""
    from kvforge.engine import Engine, HybridModel, real, tiny
    from kvforge.serve.cli import engine_config

    mc = (real if size == "real" else tiny)(draft_layers=0, seed=sa.seed)
    model = HybridModel(mc, device=device)
    ec = engine_config(sa, device)
    eng = Engine(model, ec)
    eng.generate({"warm": [1, 2, 3]}, 2)  # one-time costs out of the samples
    eng.generate({"warm2": [4] * 200}, 2)
    return eng


def _contention_worker(idx: int, size: str, sa: argparse.Namespace, device: str, new_tokens: int, conn) -> None:
    """One engine of the contention measurement: builds, says ready, then runs each ("run", start, stop, phase) order
    (``time.monotonic`` is one clock for all processes) and sends back its steps as (start, end, cycle)."""
    import kvforge.kernels  # noqa: F401  (the Triton interpreter without a GPU)

    eng = build_engine(size, sa, device)
    vocab = eng.model.config.vocab_size
    scale = 8 if device == "cuda" else 1
    for length in (32, 96, 160):  # the cycle's shapes once, so first-use costs stay out of the phases
        eng.generate({f"w{length}": [1 + i % (vocab - 1) for i in range(length * scale)]}, new_tokens)
    conn.send("ready")
    n = 0
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            return
        _, start, stop, phase = msg
        # The same cycle of prompt lengths in every phase, with fresh tokens: a prompt seen in an earlier phase
        # would be a prefix-cache hit and make that phase's cycles cheaper.
        rng = random.Random(f"contention/{idx}/{phase}")
        steps: list[tuple[float, float, int]] = []
        while time.monotonic() < start:
            time.sleep(max(0.0, min(0.01, start - time.monotonic())))
        cycle = 0
        while time.monotonic() < stop:
            n += 1
            length = (32, 96, 160)[cycle % 3] * scale
            eng.add_request(f"c{idx}-{n}", [rng.randrange(1, vocab) for _ in range(length)], new_tokens)
            while eng.scheduler.has_unfinished:
                t0 = time.monotonic()
                eng.step()
                steps.append((t0, time.monotonic(), cycle))
            eng.finished.clear()
            eng.outputs.clear()
            cycle += 1
        conn.send(steps)


def measure_contention(args, sa: argparse.Namespace, device: str) -> dict:
    """The ``contention`` object of the profile (see the module docstring)."""
    from kvforge.sim.contention import Contention

    ctx = mp.get_context("spawn")
    workers = []
    for i in range(args.contention):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_contention_worker, args=(i, args.size, sa, device, args.contention_tokens, child))
        p.start()
        workers.append((p, parent))
    try:
        for _, conn in workers:
            if conn.recv() != "ready":
                raise RuntimeError("a contention worker failed to start")
        phases = []
        # Each k between two alone phases (1, 2, 1, 3, 1, ...): its slowdown is against the mean of its neighbours,
        # so a load that drifts slowly (other processes on the machine) cancels out.
        order = [1] + [x for k in range(2, args.contention + 1) for x in (k, 1)]
        for phase, k in enumerate(order):
            load = os.getloadavg()[0]
            start = time.monotonic() + 0.5
            stop = start + args.contention_seconds
            for _, conn in workers[:k]:
                conn.send(("run", start, stop, phase))
            per_worker = [conn.recv() for _, conn in workers[:k]]
            cycles, steps = [], []
            for w in per_worker:
                by_cycle: dict[int, list[float]] = {}
                for t0, t1, c in w:
                    if t1 <= stop:  # every engine was still stepping when it ended
                        by_cycle.setdefault(c, []).append(t1 - t0)
                        steps.append(t1 - t0)
                last = max((c for _, _, c in w), default=-1)
                cycles += [sum(v) for c, v in by_cycle.items() if c < last]  # the last cycle ran past stop
            if not cycles:
                raise RuntimeError(f"contention k={k}: no complete cycle in {args.contention_seconds} s; raise "
                                   "--contention-seconds")  # fmt: skip
            ph = {"k": k, "cycles": len(cycles), "cycle_mean_s": statistics.fmean(cycles), "steps": len(steps),
                  "step_mean_s": statistics.fmean(steps), "step_median_s": statistics.median(steps),
                  "load_avg_1m": load}  # fmt: skip
            phases.append(ph)
            print(f"contention k={k}: {len(cycles):3d} cycles, mean {ph['cycle_mean_s'] * 1e3:7.1f} ms/cycle, "
                  f"{len(steps):4d} steps, mean {ph['step_mean_s'] * 1e3:6.1f} ms/step (load {load:.2f})",
                  flush=True)  # fmt: skip
    finally:
        for p, conn in workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("quit",))
            p.join(60)
            if p.is_alive():
                p.kill()
    alone = [ph["cycle_mean_s"] for ph in phases[0::2]]
    ratios = [1.0] + [ph["cycle_mean_s"] / statistics.fmean(alone[i : i + 2]) for i, ph in enumerate(phases[1::2])]
    curve = Contention.from_samples(ratios)
    drift = max(alone) / min(alone)
    if drift > 1.25:
        print(f"WARNING: the alone phases' cycle times differ by {drift:.2f}x: the machine's load changed during "
              "the measurement, and the curve is not to be trusted; measure again on a quieter machine")  # fmt: skip
    return {
        "slowdown": list(curve.slowdown),
        "capacity": curve.capacity,
        "alone_drift": drift,
        "phases": phases,
        "seconds_per_phase": args.contention_seconds,
        "cycle": f"prompts of {{32, 96, 160}} x{8 if device == 'cuda' else 1} fresh tokens in turn, "
        f"{args.contention_tokens} new tokens each, one request at a time per engine",
    }


def model_spec(engine, name: str) -> ModelSpec:
    """The simulator's view of an engine's model: its cache layout (MLA latent, recurrent state, drafter)."""
    import torch

    mc = engine.model.config
    esize = torch.empty(0, dtype=engine.model.dtype).element_size()
    kv_dtype = {4: "float32", 2: "bfloat16", 1: "float8_e4m3fn"}[esize]
    params = float(mc.num_params())
    hd = mc.linear_head_dim
    return ModelSpec(
        name=name,
        mla_layers=len(mc.mla_layers),
        mla_heads=mc.num_heads,
        mla_qk_dim=mc.qk_head_dim,
        mla_v_dim=mc.v_head_dim,
        mla_latent_dim=mc.latent_dim,
        kv_dtype=kv_dtype,
        recurrent_layers=len(mc.linear_layers),
        recurrent_state_bytes=4 * mc.linear_heads * hd * hd,
        recurrent_flops_per_token=4.0 * mc.linear_heads * hd * hd,
        total_params=params,
        active_params=params,
        dense_params=params,
        experts=1,
        top_k=1,
        weight_bytes=float(esize),
        draft_layers=mc.draft_layers,
        draft_params=0.0,
        draft_len=engine.draft_len,
        draft_acceptance=0.0,
    )


class Recorder:
    """Wraps an engine's ``scheduler.schedule`` to keep each batch's features, and times ``step``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[dict] = []
        self._batch = None
        orig = engine.scheduler.schedule

        def schedule():
            self._batch = orig()
            return self._batch

        engine.scheduler.schedule = schedule

    def step(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        b = self._batch
        prefill = [(s.start, s.num_tokens) for s in b.context]
        dec = list(b.generation)
        self.samples.append(
            {
                "prefill": prefill,
                "decode_requests": len(dec),
                "decode_context": sum(s.start for s in dec),
                "seconds": dt,
            }
        )

    def run(self) -> None:
        while self.engine.scheduler.has_unfinished:
            self.step()


def workloads(rng: random.Random, vocab: int, big: bool, max_len: int):
    """(name, {request id: prompt}, new tokens) in order; a continued prompt extends an earlier one. Prompts stay
    within ``max_len`` tokens (the operating range of the fleet bench being modelled)."""
    s = 8 if big else 1
    lens = [n for n in (32 * s, 128 * s, 256 * s) if n <= max_len]
    for b in (1, 4, 8, 16, 32, 64) if big else (1, 2, 4, 8):
        for length in lens:
            prompts = {f"d{b}-{length}-{i}": [rng.randrange(vocab) for _ in range(length)] for i in range(b)}
            yield f"decode b={b} len={length}", prompts, 6
    for length in [n for n in (16 * s, 64 * s, 160 * s, 256 * s, 500 * s) if n <= max_len]:
        yield f"prefill len={length}", {f"p{length}": [rng.randrange(vocab) for _ in range(length)]}, 2
    base = [rng.randrange(vocab) for _ in range(min(max_len, 300 * s) * 2 // 3)]
    yield "base", {"base": base}, 2
    for extra in (16 * s, 64 * s):
        if len(base) + extra <= max_len:
            yield f"continued +{extra}", {f"c{extra}": base + [rng.randrange(vocab) for _ in range(extra)]}, 2
    # Two prompts in one step (chunk rows), as concurrent arrivals give.
    pair = {f"two{i}": [rng.randrange(vocab) for _ in range(lens[-1] // 2)] for i in range(2)}
    yield "two prompts", pair, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=None, help="longest prompt profiled (default 512 CPU, 4096 GPU)")
    for flag in ("tokens-per-block", "attention-pages", "state-pages", "max-num-tokens", "max-num-requests",
                 "max-blocks-per-request"):  # fmt: skip
        ap.add_argument(f"--{flag}", type=int, default=None, help="as kvforge serve's flag (default: its default)")
    ap.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="K",
        help="also measure the slowdown of k = 1..K engines stepping at once on this device (0: no)",
    )
    ap.add_argument(
        "--contention-seconds",
        type=float,
        default=None,
        help="timed window per contention phase (default 24 on CPU, 15 on a GPU)",
    )
    ap.add_argument("--contention-tokens", type=int, default=6, help="new tokens per request of the cycle")
    ap.add_argument(
        "--contention-only",
        action="store_true",
        help="measure only the contention curve and add it to the existing --out profile",
    )
    args = ap.parse_args()
    if args.contention < 0 or (args.contention_only and args.contention < 2):
        ap.error("--contention: expected K >= 2 with --contention-only, K >= 0 otherwise")

    import kvforge.kernels  # noqa: F401  (the Triton interpreter without a GPU)

    names = ("tokens_per_block", "attention_pages", "state_pages", "max_num_tokens", "max_num_requests",
             "max_blocks_per_request")  # fmt: skip
    sa = serve_args(args.size, **{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.contention_seconds is None:
        args.contention_seconds = 15.0 if device == "cuda" else 24.0
    if args.contention_only:
        prof = json.loads(args.out.read_text())
        prof["contention"] = measure_contention(args, sa, device)
        prof["contention"]["meta"] = {**env_stamp(), "device": device}
        args.out.write_text(json.dumps(prof, indent=1) + "\n")
        print(f"slowdown by k: {[round(x, 3) for x in prof['contention']['slowdown']]}; wrote {args.out}")
        return
    eng = build_engine(args.size, sa, device)
    mc = eng.model.config
    ec = eng.config
    rec = Recorder(eng)
    load0 = os.getloadavg()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    max_len = args.max_len or (4096 if device == "cuda" else 512)
    for name, prompts, new in workloads(rng, mc.vocab_size, device == "cuda", max_len):
        n0 = len(rec.samples)
        for rid, p in prompts.items():
            eng.add_request(rid, p, new)
        rec.run()
        secs = [s["seconds"] for s in rec.samples[n0:]]
        print(f"{name:24s} {len(secs):3d} steps, median {statistics.median(secs) * 1e3:8.1f} ms", flush=True)
    rows = [step_features(s["prefill"], s["decode_requests"], s["decode_context"]) for s in rec.samples]
    secs = [s["seconds"] for s in rec.samples]
    coef = fit_step_times(rows, secs)
    errs = []
    for s, r in zip(rec.samples, rows):
        pred = sum(coef[n] * f for n, f in zip(FEATURES, r))
        s["fitted"] = pred
        errs.append(abs(pred - s["seconds"]) / s["seconds"])
    errs.sort()
    fit = {
        "samples": len(errs),
        "median_abs_rel_err": errs[len(errs) // 2],
        "p90_abs_rel_err": errs[int(0.9 * (len(errs) - 1))],
        "max_abs_rel_err": errs[-1],
    }
    stamp = env_stamp()
    stamp.update(
        {"device": device, "size": args.size, "load_avg_start": load0, "load_avg_end": os.getloadavg(),
         "profile_s": time.perf_counter() - t0, "max_len": max_len}
    )  # fmt: skip
    spec = model_spec(eng, f"kvforge-{args.size}")
    out = {
        "format": FORMAT,
        "coefficients": coef,
        "model": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
        "engine": {
            "tokens_per_block": ec.tokens_per_block,
            "attention_pages": ec.attention_pages,
            "state_pages": ec.state_pages,
            "max_num_tokens": ec.max_num_tokens,
            "max_num_requests": ec.max_num_requests,
            "max_blocks_per_request": ec.max_blocks_per_request,
        },
        "fit": fit,
        "meta": stamp,
        "samples": rec.samples,
    }
    del eng, rec  # the contention workers build their own engines on the same device
    if device == "cuda":
        torch.cuda.empty_cache()
    if args.contention:
        out["contention"] = measure_contention(args, sa, device)
        print(f"slowdown by k: {[round(x, 3) for x in out['contention']['slowdown']]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("coefficients (s per unit):", {k: f"{v:.3g}" for k, v in coef.items()})
    print(f"fit over {fit['samples']} steps: median |rel err| {fit['median_abs_rel_err']:.1%}, "
          f"p90 {fit['p90_abs_rel_err']:.1%}, max {fit['max_abs_rel_err']:.1%}")  # fmt: skip
    print(
        f"wrote {args.out} ({stamp['gpu']}, torch {stamp['torch']}, triton {stamp['triton']}, rev {stamp['git_rev']})"
    )


if __name__ == "__main__":
    main()
