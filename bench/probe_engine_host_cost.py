"""Host cost of ``Engine.step`` per phase in decode-only steady state (issue 29: step time beyond the replay).

    python3 -m bench.probe_engine_host_cost                                   # CPU: tiny model, device stubbed
    python3 -m bench.probe_engine_host_cost --device cuda --size real --sync  # H200: real model, synced phases

For each batch (default 1, 64, 256): ``batch`` requests with ``--ctx``-token prompts are prefilled, every one
reaches generation, ``--warmup`` decode steps run, then ``--reps`` rounds of ``--steps`` steps alternate the
phase timer on (``EngineConfig(profile_phases=True)``, :mod:`kvforge.engine.phases`) and off; no request
finishes inside them (steady state; blocks still fill and commit every ``tokens_per_block`` steps per row, with
their KV events going to a list, as ``kvforge serve`` sets up). Reported per batch: ms/step of each phase (median
over rounds), the step with the timer on and off (median), ``DecodeGraphs.run`` alone on the same rows afterwards
(the replay with its uploads and host read, no scheduler: the step's wall time minus it is what the engine adds),
the time spent in garbage collections during the timed steps (mean, with the collections per generation; a
collection's pause also lands inside whichever phase allocated), garbage collector on (``--gc-freeze``: frozen after the
warm-up, as a server would after its setup). The clock is this thread's CPU time on the CPU (``--clock cpu``: a
loaded shared machine's other processes disturb it far less than wall time) and wall time on a GPU.

On the CPU (``--device cpu``, the default) the device work is stubbed: the captured step's body writes a fixed
token per row into the graph's output buffer (``DecodeGraphs._body``), the eager prefill step
(``Runner.step``) emits a fixed token per final chunk, ``step_gather`` returns zeros and the page-table kernel
launch (``copy_block_offsets``) does nothing (the interpreter would stand for one launch with milliseconds of
Python, and the stubbed body reads no page table).
What is left is kvforge's host code around them plus the graph path's own buffers and the one host read.

On a GPU (``--device cuda``) nothing is stubbed: real prefill, every bucket captured before timing
(``DecodeGraphs.capture_all``), and with ``--sync`` each phase end waits for the device, so ``replay`` is the
device time of the step and the other phases are what the host adds to it (without ``--sync`` the host runs
ahead and ``read`` absorbs the device time). ``--log`` appends the report (machine, load average, revision).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._common import git_revision
from kvforge.engine import Engine, EngineConfig, HybridModel, real, tiny
from kvforge.engine.phases import STEP_PHASES, PhaseTimer
from kvforge.engine.runner import StepResult

STUB_TOKEN = 5


def _stub_device(eng: Engine) -> None:
    """Replace the device work of a CPU engine (see the module docstring); host code runs unchanged."""
    import kvforge.engine.engine as engine_mod
    import kvforge.kernels.block_offsets as bo

    def offsets(page_indices, copy_index, index_scales, kv_offset, out) -> None:
        pass  # on a GPU one kernel launch; the stubbed step body reads no page table

    bo.copy_block_offsets = offsets  # DevicePageTable.materialize imports it at call time

    class _Gathered:
        def __init__(self, n: int) -> None:
            self.input_ids = torch.zeros(n, dtype=torch.long)

    engine_mod.step_gather = lambda stores, slots, width: _Gathered(slots.shape[0] * width)  # type: ignore[assignment]

    def runner_step(rows, state_idx, tables, *, draft):
        res = StepResult()
        accepted = []
        for r in rows:
            emits = r.gen or r.is_last
            res.emitted.append([STUB_TOKEN] if emits else [])
            accepted.append(1 if emits else 0)
        res.logits = [None] * len(rows)
        res.drafts = [STUB_TOKEN if draft else None] * len(rows)
        res.draft_logits = [None] * len(rows)
        return res, accepted

    eng.runner.step = runner_step  # type: ignore[method-assign]
    g = eng.graphs = eng.decode_graphs(capture=False)
    t = g.width

    def body(b: int) -> None:
        g.out[:b, :t] = STUB_TOKEN
        g.out[:b, t] = 1
        g.out[:b, t + 1] = STUB_TOKEN

    g._body = body  # type: ignore[method-assign]


def _config(args, batch: int, dev: str) -> EngineConfig:
    tpb = args.tokens_per_block
    new = args.warmup + 2 * args.reps * args.steps + 2
    blocks = -(-(args.ctx + new) // tpb) + 1
    return EngineConfig(
        tokens_per_block=tpb,
        attention_pages=batch * blocks + 16,
        draft_pages=batch * blocks + 16,
        state_pages=batch + 16,
        max_num_tokens=8192,
        max_num_requests=batch,
        max_blocks_per_request=blocks + 1,
        cuda_graphs=dev == "cuda",
        device=dev,
        profile_phases=True,
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(model: HybridModel, args, batch: int) -> dict:
    dev = model.device.type
    cfg = _config(args, batch, dev)
    eng = Engine(model, cfg, draft_len=args.draft_len, sync=args.sync)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    timer = PhaseTimer(eng.sync, clock)
    eng.set_phase_timer(timer)
    if args.stub:
        _stub_device(eng)
    events: list = []
    eng.manager.block_pool.set_event_sink(events.append)
    rng = random.Random(batch)
    vocab = model.config.vocab_size
    new = args.warmup + 2 * args.reps * args.steps + 2
    for rid in range(batch):
        eng.add_request(rid, [rng.randrange(vocab) for _ in range(args.ctx)], new)
    while any(r.state.value != "generation" for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    if eng.graphs is not None:
        eng.graphs.capture_all()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # what was built so far is never scanned again (gc stays on)
    replays0 = eng.graphs.replays if eng.graphs is not None else 0
    gc_time = [0.0, 0.0]  # [start of the running collection, seconds in collections]
    gc_runs = [0, 0, 0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[0] = clock()
        else:
            gc_time[1] += clock() - gc_time[0]
            gc_runs[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    on_ms: list[float] = []
    off_ms: list[float] = []
    phase_rounds: list[dict[str, float]] = []
    n_events = 0
    for _ in range(args.reps):
        for on in (True, False):
            eng.set_phase_timer(timer if on else None)
            timer.clear()
            ev0 = len(events)
            _sync()
            t0 = clock()
            for _ in range(args.steps):
                eng.step()
            _sync()
            ms = 1e3 * (clock() - t0) / args.steps
            (on_ms if on else off_ms).append(ms)
            if on:
                phase_rounds.append(timer.per_step_ms())
                n_events += len(events) - ev0
    gc.callbacks.remove(on_gc)
    eng.set_phase_timer(timer)
    if eng.graphs is not None and eng.graphs.replays - replays0 != 2 * args.reps * args.steps:
        raise SystemExit("probe_engine_host_cost: a timed step did not take the graph path (not steady decode)")
    if eng.scheduler.has_unfinished is False or any(r.num_generated >= r.max_new_tokens for r in eng.scheduler.running):
        raise SystemExit("probe_engine_host_cost: a request finished inside the timed steps")
    run_ms = _graph_run_alone(eng, args.steps, clock)
    if args.gc_freeze:
        gc.unfreeze()
    phases = {p: statistics.median(r.get(p, 0.0) for r in phase_rounds) for p in STEP_PHASES}
    phases = {p: v for p, v in phases.items() if any(p in r for r in phase_rounds)}
    return {
        "batch": batch,
        "steps": args.steps * args.reps,
        "ms_step_timer_on": statistics.median(on_ms),
        "ms_step_timer_off": statistics.median(off_ms),
        "phase_sum_ms": sum(phases.values()),
        "phases_ms": phases,
        "kv_events_per_step": n_events / (args.steps * args.reps),
        "ms_graph_run_alone": run_ms,
        "gc_ms_per_step": 1e3 * gc_time[1] / (2 * args.steps * args.reps),
        "gc_runs_by_generation": gc_runs,
    }


def _graph_run_alone(eng: Engine, steps: int, clock) -> float | None:
    """ms per ``DecodeGraphs.run`` on the running rows as they stand (what bench_engine_speed's grid times): the
    step without the scheduler, cache manager and page table. It rewrites the rows' next position, so it runs
    after the timed steps."""
    if eng.graphs is None:
        return None
    reqs = [r for r in eng.scheduler.running if r.state.value == "generation"]
    slots = [eng._slot[r.request_id] for r in reqs]
    rows = [r.cache.live_page(eng.state_group).index for r in reqs]  # type: ignore[union-attr]
    starts = [r.cache.history for r in reqs]  # type: ignore[union-attr]
    eng.graphs.run(slots, rows, starts)
    _sync()
    t0 = clock()
    for _ in range(steps):
        eng.graphs.run(slots, rows, starts)  # ends with its host read: synchronous
    return 1e3 * (clock() - t0) / steps


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()} ({cpu}, {os.cpu_count()} CPUs)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--draft-len", type=int, choices=(0, 1), default=0)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="steps per timed round")
    ap.add_argument("--reps", type=int, default=3, help="rounds with the timer on (and as many off)")
    ap.add_argument("--sync", action="store_true", help="wait for the device at each phase end (GPU)")
    ap.add_argument("--no-stub", dest="stub", action="store_false", default=None,
                    help="run the tiny model's real device work on the CPU (interpreter: slow)")  # fmt: skip
    ap.add_argument("--clock", choices=("wall", "cpu"), default=None,
                    help="wall: perf_counter (the GPU default); cpu: this thread's CPU time (the CPU default: a "
                    "loaded machine's other processes disturb it far less)")  # fmt: skip
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after warm-up (gc stays on)")
    ap.add_argument("--label", default="", help="a note for the log (e.g. before / after)")
    ap.add_argument("--log", type=Path, default=None, help="append the report to this file")
    ap.add_argument("--out", type=Path, default=None, help="write engine_host_cost.json here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("probe_engine_host_cost: --device cuda needs a CUDA device")
    if args.stub is None:
        args.stub = args.device == "cpu"
    if args.clock is None:
        args.clock = "cpu" if args.device == "cpu" else "wall"
    if args.clock == "cpu" and args.device == "cuda":
        raise SystemExit("probe_engine_host_cost: --clock cpu does not count the device waits (use wall on a GPU)")
    if args.stub and args.device == "cuda":
        raise SystemExit("probe_engine_host_cost: the device stubs are for the CPU (drop --device cuda)")
    gc.enable()
    model = HybridModel(real() if args.size == "real" else tiny(), device=args.device)
    load0 = os.getloadavg()
    rows = []
    for b in args.batches:
        rows.append(measure(model, args, b))
        gc.collect()  # the engine, its graphs and their memory pool go before the next batch's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    load1 = os.getloadavg()
    head = {
        "label": args.label,
        "machine": _machine(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "git_rev": git_revision(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_start": [round(x, 2) for x in load0],
        "load_avg_end": [round(x, 2) for x in load1],
        "size": args.size,
        "stub": args.stub,
        "sync": args.sync,
        "gc": gc.isenabled(),
        "gc_freeze": args.gc_freeze,
        "clock": args.clock,
        "ctx": args.ctx,
        "tokens_per_block": args.tokens_per_block,
        "draft_len": args.draft_len,
    }
    lines = [
        f"# {head['label'] or 'run'}: {head['date']} git {head['git_rev']} on {head['machine']}, device "
        f"{head['device']}, torch {head['torch']}, python {head['python']}, load average {head['load_avg_start']} "
        f"-> {head['load_avg_end']}, size {args.size}, stub {args.stub}, sync {args.sync}, clock {args.clock}, gc on"
        f"{' (frozen after warm-up)' if args.gc_freeze else ''}, ctx {args.ctx}, "
        f"tokens_per_block {args.tokens_per_block}, draft_len {args.draft_len}, {args.reps} x {args.steps} steps",
        "phase (ms/step, median of rounds) | " + " | ".join(f"batch {r['batch']}" for r in rows),
    ]
    seen = [p for p in STEP_PHASES if any(p in r["phases_ms"] for r in rows)]
    for p in seen:
        lines.append(f"{p} | " + " | ".join(f"{r['phases_ms'].get(p, 0.0):.4f}" for r in rows))
    lines.append("sum of phases | " + " | ".join(f"{r['phase_sum_ms']:.4f}" for r in rows))
    lines.append("step, timer on | " + " | ".join(f"{r['ms_step_timer_on']:.4f}" for r in rows))
    lines.append("step, timer off | " + " | ".join(f"{r['ms_step_timer_off']:.4f}" for r in rows))
    lines.append("kv events / step | " + " | ".join(f"{r['kv_events_per_step']:.2f}" for r in rows))
    lines.append(
        "DecodeGraphs.run alone | "
        + " | ".join("-" if r["ms_graph_run_alone"] is None else f"{r['ms_graph_run_alone']:.4f}" for r in rows)
    )
    lines.append(
        "gc ms/step (runs gen0/1/2) | "
        + " | ".join(f"{r['gc_ms_per_step']:.4f} ({'/'.join(map(str, r['gc_runs_by_generation']))})" for r in rows)
    )
    text = "\n".join(lines)
    print(text, flush=True)
    if args.log is not None:
        with args.log.open("a") as f:
            f.write(text + "\n\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_host_cost.json").write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
