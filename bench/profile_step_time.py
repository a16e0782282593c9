"""Profile the engine's step time for ``kvforge simulate --profile`` (as Vidur profiles before it simulates).

Builds one :class:`~kvforge.engine.Engine` as ``kvforge serve`` builds it (same budgets; decode graphs captured
and the grid's prompt shapes run once before timing, so compilation stays out of the samples), times every
``Engine.step`` over a grid of workloads (wall time: the step reads its emitted tokens back), records what the
scheduler put in each step (context chunks as ``(start, tokens)``, generation rows and their contexts), fits
:mod:`kvforge.sim.profile`'s linear step-time model and writes the profile JSON (coefficients, the model's
layout, the engine's budgets, every sample with its fitted value, the fit's relative errors, what was skipped,
the time each stage took, machine and versions). The grid, cheapest first: single prompts {16 .. 500} tokens (x8
on a GPU), continued prompts (a cached prefix), two prompts in one step, then decode batches {1, 2, 4, 8} (CPU) or
{1, 4, 8, 16, 32, 64} (GPU) at contexts {32, 128, 256, 512} (x8), each batch's prompts at most two full steps of
tokens (``2 * max_num_tokens``), all within ``--max-len``. ``--budget-s`` bounds the whole run's wall time: a
workload the fit so far predicts will not finish in what is left (contention reserved) is skipped and named.

``--contention K`` then measures how steps slow down when engines share the device: the profiled engine and K - 1
worker processes (built at the start, alongside it; idle during the grid) repeat the same cycle of requests (a
fresh prompt of 32, 96, 160 tokens in turn, x8 on a GPU, ``--contention-tokens`` new tokens): one engine alone,
then 2 at once, one alone, 3 at once, ..., one alone, ``--contention-seconds`` each (shortened to fit the budget,
or skipped when under three cycles would fit). A step counts for k only when it ended before the phase's stop
time; ``slowdown(k)`` is the mean complete-cycle time with k engines over the mean of the two alone phases beside
it, and ``alone_drift`` (slowest alone phase over fastest; a warning past 1.25) says whether the load held still.
The profile is written as soon as the fit exists and again with the ``contention`` object
(:mod:`kvforge.sim.contention`); ``--contention-only`` adds a curve to an existing profile, and ``--refit`` fits
an existing profile's samples again (after the step features change; no engine).

    python3 bench/profile_step_time.py --size tiny --max-len 256 --contention 3 \
        --out bench/results/step_profile_cpu_tiny.json                                           # CPU
    python3 bench/profile_step_time.py --size real --attention-pages 16384 --state-pages 256 --max-num-tokens \
        8192 --max-num-requests 64 --max-blocks-per-request 512 --contention 2 --budget-s 150 --out P.json  # GPU
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here (before the heavy imports)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import env_stamp  # noqa: E402
from kvforge.sim.model import ModelSpec  # noqa: E402
from kvforge.sim.profile import FEATURES, FORMAT, fit_step_times, step_features  # noqa: E402

CYCLE = (32, 96, 160)  # the contention cycle's prompt lengths (x8 on a GPU)
SAFETY = 1.5  # a workload's predicted seconds are multiplied by this before the budget check


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
    """The engine ``kvforge serve`` would build from ``sa`` (random weights, no drafter), warmed up and with every
    decode graph captured (a bucket's first use would otherwise capture it inside a timed step)."""
    from kvforge.engine import Engine, HybridModel, real, tiny
    from kvforge.serve.cli import engine_config

    mc = (real if size == "real" else tiny)(draft_layers=0, seed=sa.seed)
    model = HybridModel(mc, device=device)
    eng = Engine(model, engine_config(sa, device))
    eng.generate({"warm": [1, 2, 3]}, 2)
    eng.generate({"warm2": [4] * 200}, 2)
    if eng.graphs is not None:
        eng.graphs.capture_all()
    _clear(eng)
    return eng


def _clear(eng) -> None:
    eng.outputs.clear()
    eng.finished.clear()


class Cycle:
    """The contention cycle on one engine (see the module docstring); ``idx`` seeds its prompts."""

    def __init__(self, idx: int, eng, new_tokens: int, scale: int) -> None:
        self.idx, self.eng, self.new_tokens, self.scale = idx, eng, new_tokens, scale
        self.vocab = eng.model.config.vocab_size
        self.n = 0

    def warm(self) -> float:
        """The cycle's shapes once, so first-use costs stay out of the phases; returns the longest one's seconds."""
        longest = 0.0
        for length in CYCLE:
            prompt = [1 + (self.idx + i) % (self.vocab - 1) for i in range(length * self.scale)]
            t = time.monotonic()
            self.eng.generate({f"w{self.idx}-{length}": prompt}, self.new_tokens)
            longest = max(longest, time.monotonic() - t)
        _clear(self.eng)
        return longest

    def run(self, start: float, stop: float, phase: int) -> list[tuple[float, float, int]]:
        """Cycles from ``start`` until ``stop`` (``time.monotonic``, one clock for all processes); the steps as
        ``(start, end, cycle)``. The cycle in progress at ``stop`` runs to its end."""
        # Fresh tokens in every phase: a prompt seen in an earlier phase would be a prefix-cache hit and make that
        # phase's cycles cheaper.
        rng = random.Random(f"contention/{self.idx}/{phase}")
        steps: list[tuple[float, float, int]] = []
        while time.monotonic() < start:
            time.sleep(max(0.0, min(0.01, start - time.monotonic())))
        cycle = 0
        while time.monotonic() < stop:
            self.n += 1
            length = CYCLE[cycle % len(CYCLE)] * self.scale
            prompt = [rng.randrange(1, self.vocab) for _ in range(length)]
            self.eng.add_request(f"c{self.idx}-{self.n}", prompt, self.new_tokens)
            while self.eng.scheduler.has_unfinished:
                t0 = time.monotonic()
                self.eng.step()
                steps.append((t0, time.monotonic(), cycle))
            _clear(self.eng)
            cycle += 1
        return steps


def _contention_worker(idx: int, size: str, sa: argparse.Namespace, device: str, new_tokens: int, conn) -> None:
    """One extra engine of the contention measurement. Builds and says ``built`` (then stays idle: the grid is
    being timed), warms the cycle on ``warm``, runs each ``("run", start, stop, phase)`` and sends back its steps."""
    import kvforge.kernels  # noqa: F401  (the Triton interpreter without a GPU)

    try:
        cycle = Cycle(idx, build_engine(size, sa, device), new_tokens, 8 if device == "cuda" else 1)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("built",))
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            return
        if msg[0] == "warm":
            cycle.warm()
            conn.send(("warmed",))
        else:
            _, start, stop, phase = msg
            conn.send(cycle.run(start, stop, phase))


class Workers:
    """The K - 1 extra engine processes of ``--contention K``, started at once so they build alongside the
    profiled engine. Every wait is bounded; a worker that fails or does not answer is an error naming it."""

    def __init__(self, k: int, size: str, sa: argparse.Namespace, device: str, new_tokens: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for i in range(1, k):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_contention_worker, args=(i, size, sa, device, new_tokens, child))
            p.start()
            self.procs.append(p)
            self.conns.append(parent)

    def expect(self, what: str, timeout: float, n: int | None = None) -> list:
        """The next message of the first ``n`` workers (all by default), each within ``timeout`` seconds."""
        out = []
        deadline = time.monotonic() + timeout
        for i, conn in enumerate(self.conns[:n]):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"contention worker {i + 1}: no {what!r} within {timeout:.0f} s")
            try:
                msg = conn.recv()
            except EOFError:
                raise RuntimeError(f"contention worker {i + 1} exited (status {self.procs[i].exitcode})") from None
            if isinstance(msg, tuple) and msg and msg[0] == "error":
                raise RuntimeError(f"contention worker {i + 1} failed to build its engine: {msg[1]}")
            out.append(msg)
        return out

    def send(self, msg: tuple, n: int | None = None) -> None:
        for conn in self.conns[:n]:
            conn.send(msg)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("quit",))
        for p in self.procs:
            p.join(5)  # a worker inside a phase reads "quit" only at its end: a timeout's grace is short
            if p.is_alive():
                p.kill()
                p.join(5)


def measure_contention(args, own: Cycle, workers: Workers, seconds: float, device: str) -> dict:
    """The ``contention`` object of the profile (see the module docstring); ``own`` is engine 0."""
    from kvforge.sim.contention import Contention

    phases = []
    # Each k between two alone phases (1, 2, 1, 3, 1, ...): its slowdown is against the mean of its neighbours,
    # so a load that drifts slowly (other processes on the machine) cancels out.
    for phase, k in enumerate(phase_order(args.contention)):
        load = os.getloadavg()[0]
        start = time.monotonic() + 0.5
        stop = start + seconds
        workers.send(("run", start, stop, phase), k - 1)
        per_engine = [own.run(start, stop, phase)]
        per_engine += workers.expect(f"phase {phase} steps", seconds + 120, k - 1)
        cycles, steps = [], []
        for w in per_engine:
            by_cycle: dict[int, list[float]] = {}
            for t0, t1, c in w:
                if t1 <= stop:  # every engine was still stepping when it ended
                    by_cycle.setdefault(c, []).append(t1 - t0)
                    steps.append(t1 - t0)
            last = max((c for _, _, c in w), default=-1)
            cycles += [sum(v) for c, v in by_cycle.items() if c < last]  # the last cycle ran past stop
        if not cycles:
            raise RuntimeError(f"contention k={k}: no complete cycle in {seconds:.1f} s; raise --contention-seconds")
        ph = {"k": k, "cycles": len(cycles), "cycle_mean_s": statistics.fmean(cycles), "steps": len(steps),
              "step_mean_s": statistics.fmean(steps), "step_median_s": statistics.median(steps),
              "load_avg_1m": load}  # fmt: skip
        phases.append(ph)
        print(f"contention k={k}: {len(cycles):3d} cycles, mean {ph['cycle_mean_s'] * 1e3:7.1f} ms/cycle, "
              f"{len(steps):4d} steps, mean {ph['step_mean_s'] * 1e3:6.1f} ms/step (load {load:.2f})",
              flush=True)  # fmt: skip
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
        "seconds_per_phase": seconds,
        "cycle": f"prompts of {{{', '.join(map(str, CYCLE))}}} x{own.scale} fresh tokens in turn, "
        f"{args.contention_tokens} new tokens each, one request at a time per engine",
    }


def phase_order(k: int) -> list[int]:
    """Engines stepping in each contention phase: 1, 2, 1, 3, 1, ..., k, 1."""
    return [1] + [x for j in range(2, k + 1) for x in (j, 1)]


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


def workloads(rng: random.Random, vocab: int, big: bool, max_len: int, max_tokens: int):
    """The grid, cheapest first (the order ``--budget-s`` trims from the end of): (name, {request id: prompt},
    new tokens). A continued prompt extends an earlier one. Prompts stay within ``max_len`` tokens (the operating
    range of the fleet bench being modelled); a decode batch's prompts within ``2 * max_tokens`` tokens, at most
    two full steps (the decode contexts a step sees, without prefilling 100k-token batches to reach them)."""
    s = 8 if big else 1

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    out = []
    for length in [n for n in (16 * s, 64 * s, 160 * s, 256 * s, 500 * s) if n <= max_len]:
        out.append((f"prefill len={length}", {f"p{length}": prompt(length)}, 2))
    base = prompt(min(max_len, 300 * s) * 2 // 3)
    out.append(("base", {"base": base}, 2))
    for extra in (16 * s, 64 * s):
        if len(base) + extra <= max_len:
            out.append((f"continued +{extra}", {f"c{extra}": base + prompt(extra)}, 2))
    # Two prompts in one step (chunk rows), as concurrent arrivals give.
    half = min(max_len, 256 * s) // 2
    out.append(("two prompts", {f"two{i}": prompt(half) for i in range(2)}, 2))
    lens = [n for n in (32 * s, 128 * s, 256 * s, 512 * s) if n <= max_len]
    sizes = (1, 4, 8, 16, 32, 64) if big else (1, 2, 4, 8)
    batches = [(b, n) for b in sizes for n in lens if b * n <= 2 * max_tokens]
    for b, n in sorted(batches, key=lambda x: (x[0] * x[1], x[0])):
        out.append((f"decode b={b} len={n}", {f"d{b}-{n}-{i}": prompt(n) for i in range(b)}, 8 if big else 6))
    return out


def planned_steps(prompts: list[int], new: int, max_tokens: int, max_requests: int) -> list[list[float]]:
    """The feature rows a workload's steps will roughly have (prompts chunked in order into steps of
    ``max_tokens`` tokens and ``max_requests`` rows; prefix hits ignored, so an over-estimate): for the budget."""
    rows, left, pos = [], list(prompts), [0] * len(prompts)
    i = 0
    while i < len(left):
        chunks, budget = [], max_tokens
        while i < len(left) and budget > 0 and len(chunks) < max_requests:
            n = min(budget, left[i] - pos[i])
            chunks.append((pos[i], n))
            budget -= n
            pos[i] += n
            if pos[i] == left[i]:
                i += 1
        rows.append(step_features(chunks, 0, 0))
    b = min(len(prompts), max_requests)
    ctx = sum(sorted(prompts)[-b:])
    rows += [step_features([], b, ctx + b * j) for j in range(1, new)]
    return rows


def predict(coef: dict[str, float] | None, rows: list[list[float]]) -> float | None:
    if coef is None:
        return None
    return sum(sum(coef[n] * f for n, f in zip(FEATURES, r)) for r in rows)


def medians(samples: list[dict]) -> str:
    """Prefill steps (any context row) and decode-only steps, apart: one median over both mixes them."""
    pre = [s["seconds"] for s in samples if s["prefill"]]
    dec = [s["seconds"] for s in samples if not s["prefill"]]
    part = [
        f"{len(pre):2d} prefill median {statistics.median(pre) * 1e3:7.1f} ms" if pre else " 0 prefill",
        f"{len(dec):2d} decode-only median {statistics.median(dec) * 1e3:7.1f} ms" if dec else " 0 decode-only",
    ]
    return ", ".join(part)


def fit(samples: list[dict]) -> dict[str, float] | None:
    rows = [step_features(s["prefill"], s["decode_requests"], s["decode_context"]) for s in samples]
    try:
        return fit_step_times(rows, [s["seconds"] for s in samples])
    except ValueError:
        return None


def fit_samples(samples: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """The fit over timed steps: coefficients and its relative errors; each sample gets its ``fitted`` value."""
    rows = [step_features(s["prefill"], s["decode_requests"], s["decode_context"]) for s in samples]
    coef = fit_step_times(rows, [s["seconds"] for s in samples])
    errs = []
    for s, r in zip(samples, rows):
        pred = sum(coef[n] * f for n, f in zip(FEATURES, r))
        s["fitted"] = pred
        errs.append(abs(pred - s["seconds"]) / s["seconds"])
    errs.sort()
    return coef, {
        "samples": len(errs),
        "median_abs_rel_err": errs[len(errs) // 2],
        "p90_abs_rel_err": errs[int(0.9 * (len(errs) - 1))],
        "max_abs_rel_err": errs[-1],
    }


def refit(path: Path) -> None:
    """``--refit``: the fit of an existing profile again, over its own timed samples, with today's features (no
    engine, no timing); the old coefficients and fit are kept under ``meta.refit``."""
    data = json.loads(path.read_text())
    samples = data.get("samples")
    if not isinstance(samples, list) or len(samples) < 2 * len(FEATURES):
        raise SystemExit(f"--refit: {path} has {len(samples or [])} samples, need {2 * len(FEATURES)}")
    old_coef, old_fit = data.get("coefficients"), data.get("fit")
    coef, fit_stats = fit_samples(samples)
    data["coefficients"], data["fit"] = coef, fit_stats
    data.setdefault("meta", {})["refit"] = {
        **{k: v for k, v in env_stamp().items() if k in ("git_rev", "date")},
        "features": list(FEATURES),
        "previous_coefficients": old_coef,
        "previous_fit": old_fit,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    print("coefficients (s per unit):", {k: f"{v:.3g}" for k, v in coef.items()})
    print(f"refit over {fit_stats['samples']} steps: median |rel err| {fit_stats['median_abs_rel_err']:.1%}, p90 "
          f"{fit_stats['p90_abs_rel_err']:.1%}, max {fit_stats['max_abs_rel_err']:.1%} (was "
          f"{(old_fit or {}).get('median_abs_rel_err', float('nan')):.1%} / "
          f"{(old_fit or {}).get('p90_abs_rel_err', float('nan')):.1%}); wrote {path}")  # fmt: skip


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
        "--budget-s",
        type=float,
        default=None,
        help="wall-time budget of the whole run in seconds: grid workloads that would not fit (the contention "
        "phases reserved) are skipped and named, and the phases are shortened to fit (default: no budget)",
    )
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
        help="timed window per contention phase (2K - 1 phases; default 24 on CPU, 8 on a GPU)",
    )
    ap.add_argument("--contention-tokens", type=int, default=6, help="new tokens per request of the cycle")
    ap.add_argument(
        "--contention-only",
        action="store_true",
        help="measure only the contention curve and add it to the existing --out profile",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="no engine: fit the existing --out profile's samples again (today's step features) and rewrite it",
    )
    args = ap.parse_args()
    if args.refit:
        if not args.out.is_file():
            ap.error(f"--out: {args.out} does not exist (--refit rewrites an existing profile)")
        refit(args.out)
        return
    if args.contention < 0 or (args.contention_only and args.contention < 2) or args.contention == 1:
        ap.error("--contention: expected K >= 2 (0: no contention measurement)")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        ap.error(f"--budget-s: expected a number of seconds > 0, got {args.budget_s}")
    if args.contention_seconds is not None and not (
        math.isfinite(args.contention_seconds) and args.contention_seconds > 0
    ):
        ap.error(f"--contention-seconds: expected a number of seconds > 0, got {args.contention_seconds}")
    if args.contention_tokens < 1:
        ap.error(f"--contention-tokens: expected an int >= 1, got {args.contention_tokens}")
    if args.max_len is not None and args.max_len < 16:
        ap.error(f"--max-len: expected an int >= 16, got {args.max_len}")
    if args.contention_only and not args.out.is_file():
        ap.error(f"--out: {args.out} does not exist (--contention-only adds to an existing profile)")

    import kvforge.kernels  # noqa: F401  (the Triton interpreter without a GPU)

    names = ("tokens_per_block", "attention_pages", "state_pages", "max_num_tokens", "max_num_requests",
             "max_blocks_per_request")  # fmt: skip
    sa = serve_args(args.size, **{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    big = device == "cuda"
    if args.contention_seconds is None:
        args.contention_seconds = 8.0 if big else 24.0
    deadline = T0 + args.budget_s if args.budget_s is not None else math.inf
    # A timeout's SIGTERM unwinds like Ctrl-C, so the worker engines are stopped (they hold device memory).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stage_s: dict[str, float] = {}
    # The extra engines build now, alongside this one; they stay idle until the grid is done.
    workers = Workers(args.contention, args.size, sa, device, args.contention_tokens) if args.contention else None
    try:
        status = run(args, sa, device, big, deadline, stage_s, workers)
    finally:
        if workers is not None:
            workers.close()
    sys.exit(status)


def run(args, sa, device: str, big: bool, deadline: float, stage_s: dict[str, float], workers) -> int:
    """Everything after the argument checks; returns the exit status: 0, or 3 when ``--contention`` was asked
    for and not measured (the profile is written without it)."""
    t = time.monotonic()
    eng = build_engine(args.size, sa, device)
    mc, ec = eng.model.config, eng.config
    rng = random.Random(args.seed)
    max_len = args.max_len or (4096 if big else 512)
    grid = workloads(rng, mc.vocab_size, big, max_len, ec.max_num_tokens)
    # The grid's shapes once, untimed (kernel compilation and autotuning on first use; nothing compiles on the CPU):
    # its longest prompt, two prompts in one step, a continued one, and a short batch.
    warm_rng = random.Random(f"warm/{args.seed}")
    shapes = ({"wl": [warm_rng.randrange(mc.vocab_size) for _ in range(max_len)]},
              {"w2a": [5] * (max_len // 2), "w2b": [6] * (max_len // 3)},
              {"wc": [5] * (max_len // 2) + [7] * 9},
              {f"wb{i}": [8 + i] * 24 for i in range(4)})  # fmt: skip
    for prompts in shapes if big and not args.contention_only else ():
        eng.generate(prompts, 3)
    _clear(eng)
    stage_s["build_and_warm"] = time.monotonic() - t
    print(f"engine built and warmed up in {stage_s['build_and_warm']:.1f} s", flush=True)
    n_phases = len(phase_order(args.contention)) if args.contention else 0
    if workers is not None:
        t = time.monotonic()
        try:
            workers.expect("built", max(30.0, min(600.0, deadline - time.monotonic())))
        except RuntimeError as exc:
            print(f"!! {exc}: no contention measurement", flush=True)
            workers.close()
            workers = None
            n_phases = 0
        stage_s["wait_for_workers"] = time.monotonic() - t
    if args.contention_only:
        if workers is None:
            return 3
        out = json.loads(args.out.read_text())
    else:
        out = profile_grid(args, eng, grid, deadline, n_phases, stage_s, max_len, device)
    if workers is None:
        return 3 if args.contention else 0
    t = time.monotonic()
    del grid

    def phase_seconds(cycle_s: float) -> float:
        # Each phase overruns its window by the cycle in progress at its stop (k engines sharing the device).
        left = deadline - time.monotonic() - 10.0
        return min(args.contention_seconds, left / n_phases - 0.5 - args.contention * cycle_s)

    # Not even 1 s per phase left: no warm-up either. (The cycle's length is timed by the warm-up: the fit would
    # extrapolate past the grid's prompts on a CPU, where the cycle's are longer than --max-len.)
    if phase_seconds(0.0) < 1.0:
        print(f"!! contention skipped: {max(0.0, deadline - time.monotonic()):.0f} s left of the budget, not enough "
              f"for {n_phases} phases", flush=True)  # fmt: skip
        return 3
    own = Cycle(0, eng, args.contention_tokens, 8 if big else 1)
    workers.send(("warm",))
    cycle_s = own.warm()
    workers.expect("warmed", 600.0)
    seconds = phase_seconds(cycle_s)
    if seconds < max(1.0, 3 * cycle_s):  # at least three cycles per phase
        print(f"!! contention skipped: {seconds:.1f} s per phase would fit in the budget, under three cycles of "
              f"{cycle_s:.1f} s", flush=True)  # fmt: skip
        return 3
    if seconds < args.contention_seconds:
        print(f"contention phases shortened to {seconds:.1f} s (budget)", flush=True)
    try:
        out["contention"] = measure_contention(args, own, workers, seconds, device)
    except RuntimeError as exc:
        print(f"!! contention failed: {exc}", flush=True)
        return 3
    stage_s["contention"] = time.monotonic() - t
    out["contention"]["meta"] = {**env_stamp(), "device": device, "stage_s": stage_s["contention"]}
    if "meta" in out and not args.contention_only:
        out["meta"]["stage_s"] = stage_s
        out["meta"]["profile_s"] = time.monotonic() - T0
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"slowdown by k: {[round(x, 3) for x in out['contention']['slowdown']]}; wrote {args.out} "
          f"({time.monotonic() - T0:.0f} s in all)", flush=True)  # fmt: skip
    return 0


def profile_grid(
    args, eng, grid, deadline: float, n_phases: int, stage_s: dict[str, float], max_len: int, device: str
) -> dict:
    """Times the grid within the budget, fits, writes the profile (without contention) and returns it."""
    ec = eng.config
    rec = Recorder(eng)
    load0 = os.getloadavg()
    t = time.monotonic()
    # Kept for the contention phases: their windows, one cycle of overrun each, and the write at the end; but the
    # fit comes first, so at most half of what is left (the phases are shortened, or skipped, to fit the rest).
    reserve = n_phases * (args.contention_seconds + 1.5) + (15.0 if n_phases else 3.0)
    reserve = min(reserve, max(3.0, (deadline - t) / 2))
    skipped: list[str] = []
    coef = None
    for name, prompts, new in grid:
        rows = planned_steps([len(p) for p in prompts.values()], new, ec.max_num_tokens, ec.max_num_requests)
        guess = predict(coef, rows)
        left = deadline - reserve - time.monotonic()
        if left <= 0 or (guess is not None and SAFETY * guess > left):
            skipped.append(name)
            why = f"predicted {guess:.2f} s, " if guess is not None else ""
            print(f"{name:24s} skipped: {why}{max(0.0, left):.1f} s left of the budget", flush=True)
            continue
        n0 = len(rec.samples)
        w0 = time.monotonic()
        for rid, p in prompts.items():
            eng.add_request(rid, p, new)
        rec.run()
        took = time.monotonic() - w0
        print(f"{name:24s} {len(rec.samples) - n0:3d} steps in {took:6.2f} s ("
              + (f"predicted {guess:.2f} s; " if guess is not None else "")
              + f"{medians(rec.samples[n0:])})", flush=True)  # fmt: skip
        coef = fit(rec.samples) or coef
    stage_s["grid"] = time.monotonic() - t
    if skipped:
        print(f"!! budget: skipped {len(skipped)} of {len(grid)} workloads: {', '.join(skipped)}", flush=True)
    if len(rec.samples) < 2 * len(FEATURES):
        raise SystemExit(f"!! {len(rec.samples)} steps timed: too few to fit; raise --budget-s")
    coef, fit_stats = fit_samples(rec.samples)
    stamp = {**env_stamp(), "device": device, "size": args.size, "load_avg_start": load0,
             "load_avg_end": os.getloadavg(), "profile_s": time.monotonic() - T0, "max_len": max_len,
             "budget_s": args.budget_s, "workloads": len(grid) - len(skipped), "skipped": skipped,
             "stage_s": stage_s}  # fmt: skip
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
        "fit": fit_stats,
        "meta": stamp,
        "samples": rec.samples,
    }
    # On disk now: a contention measurement that fails or runs out of time leaves the fit.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("coefficients (s per unit):", {k: f"{v:.3g}" for k, v in coef.items()})
    print(f"fit over {fit_stats['samples']} steps: median |rel err| {fit_stats['median_abs_rel_err']:.1%}, "
          f"p90 {fit_stats['p90_abs_rel_err']:.1%}, max {fit_stats['max_abs_rel_err']:.1%}")  # fmt: skip
    print(
        f"wrote {args.out} ({stamp['gpu']}, torch {stamp['torch']}, triton {stamp['triton']}, rev "
        f"{stamp['git_rev']}; grid {stage_s['grid']:.1f} s, {time.monotonic() - T0:.0f} s so far)",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
