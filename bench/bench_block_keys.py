"""Cost of a prompt's block keys (:mod:`kvforge.kvcache.hashing`) at 16 and 512 tokens per block, 32k and 131k tokens.

Times :func:`~kvforge.kvcache.hashing.block_keys` (thread CPU time) with the garbage collector on, for prompts
given as a Python list (what a tokenizer returns), a tuple and a numpy int64 array, with both algorithms
(xxh3_128, the default, and sha256), next to the builtin-hash chain kvforge used before
(``hash((parent, tuple(block)))``: 64-bit, unkeyed, collides on ``-1``/``-2``), shown for reference only.
Two rows time the scheduler's own path (:mod:`kvforge.scheduling`): ``Request(tokens=list)`` plus
``Scheduler.add_request`` (validation, the kept token array and the prompt's keys), and one decode step
(``on_step_done`` + ``schedule``) of a request in generation behind the prompt (a new block keyed every
``tokens_per_block`` steps).
Target: 131,072 tokens at 512 tokens per block in <= 1 ms (list and numpy input). Each row records the 1-minute
load average: on a shared machine, contention inflates thread CPU time. Rows go to
``bench/results/block_keys.csv``. Host only. Run::

    python bench/bench_block_keys.py [--reps 200] [--no-save] [--scheduler-only]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.kvcache.hashing import BlockKeyHasher
from kvforge.scheduling import Request, RequestState, Scheduler, SchedulerConfig

TARGET_MS = 1.0  # 131,072 tokens at 512 tokens per block


def _legacy_chain(tokens: list[int], tpb: int) -> list[int]:
    h = 0x6B76_666F_7267_6500
    return [h := hash((h, tuple(tokens[i : i + tpb]))) for i in range(0, len(tokens) - tpb + 1, tpb)]


def _time(fn: Callable[[], object], reps: int) -> dict[str, float]:
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn()
        samples.append(time.thread_time_ns() - t0)
    return _stats(samples)


def _scheduler(n_tokens: int, tpb: int) -> Scheduler:
    pages = n_tokens // tpb + 64
    mgr = KVCacheManager(KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)))
    return Scheduler(mgr, SchedulerConfig(max_num_tokens=16_384))


def _time_add_request(tokens: list[int], tpb: int, reps: int) -> dict[str, float]:
    sched = _scheduler(len(tokens), tpb)
    samples = []
    for i in range(reps + 1):
        t0 = time.thread_time_ns()
        req = Request(i, tokens=tokens, max_new_tokens=4)
        sched.add_request(req)
        dt = time.thread_time_ns() - t0
        sched.abort(i)
        if i:  # the first is a warm-up
            samples.append(dt)
    return _stats(samples)


def _time_decode_steps(tokens: list[int], tpb: int, reps: int) -> dict[str, float]:
    """Per decode step (``on_step_done`` with the new token id, then ``schedule``) of one request whose prompt
    is ``tokens``, after its prefill (untimed)."""
    sched = _scheduler(len(tokens), tpb)
    sched.add_request(Request("r", tokens=tokens, max_new_tokens=reps + 2))
    rng = random.Random(1)
    batch = sched.schedule()
    while True:
        emits = len(batch.generation) + sum(s.is_last_chunk for s in batch.context)
        sched.on_step_done(batch, new_tokens={"r": [rng.randrange(200_000) for _ in range(emits)]})
        batch = sched.schedule()
        if sched.get("r").state is RequestState.GENERATION:  # type: ignore[union-attr]
            break
    samples = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        sched.on_step_done(batch, new_tokens={"r": [rng.randrange(200_000)]})
        batch = sched.schedule()
        samples.append(time.thread_time_ns() - t0)
    return _stats(samples)


def _stats(samples: list[int]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "median_ms": samples[len(samples) // 2] / 1e6,
        "mean_ms": sum(samples) / len(samples) / 1e6,
        "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--scheduler-only", action="store_true", help="only the scheduler's rows")
    args = ap.parse_args(argv)
    if not gc.isenabled():
        raise SystemExit("the garbage collector must be on")
    rng = random.Random(0)
    rows = []
    print(f"{'tokens':>8} {'tpb':>4} {'algorithm':>9} {'input':>11} {'median ms':>10} {'mean ms':>8} {'p99 ms':>8}")
    hashers = {alg: BlockKeyHasher(algorithm=alg) for alg in ("xxh3_128", "sha256")}
    for n in (32_768, 131_072):
        lst = [rng.randrange(200_000) for _ in range(n)]
        tup = tuple(lst)
        arr = np.array(lst, dtype=np.int64)
        for tpb in (16, 512):
            cases: list[tuple[str, str, Callable[[], object]]] = []
            for alg, h in hashers.items():
                cases.append((alg, "list", lambda h=h, t=lst, b=tpb: h.block_keys(t, b)))
                cases.append((alg, "tuple", lambda h=h, t=tup, b=tpb: h.block_keys(t, b)))
                cases.append((alg, "numpy", lambda h=h, t=arr, b=tpb: h.block_keys(t, b)))
            cases.append(("builtin hash (old, unsafe)", "list", lambda t=lst, b=tpb: _legacy_chain(t, b)))
            cases.append(("scheduler", "add_request", lambda t=lst, b=tpb: _time_add_request(t, b, args.reps)))
            cases.append(("scheduler", "decode_step", lambda t=lst, b=tpb: _time_decode_steps(t, b, args.reps)))
            if args.scheduler_only:
                cases = [c for c in cases if c[0] == "scheduler"]
            for alg, kind, fn in cases:
                st = fn() if alg == "scheduler" else _time(fn, args.reps)  # type: ignore[assignment]
                flag = ""
                if n == 131_072 and tpb == 512 and alg == "xxh3_128" and kind != "tuple":
                    flag = "  <= 1 ms" if st["median_ms"] <= TARGET_MS else "  > 1 ms target"
                print(
                    f"{n:>8} {tpb:>4} {alg[:9]:>9} {kind:>11} {st['median_ms']:10.3f} {st['mean_ms']:8.3f} "
                    f"{st['p99_ms']:8.3f}{flag}"
                )
                rows.append(
                    {
                        "tokens": n,
                        "tokens_per_block": tpb,
                        "algorithm": alg,
                        "input": kind,
                        "reps": args.reps,
                        "gc": "on",
                        "cpu": platform.processor() or platform.machine(),
                        "python": platform.python_version(),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                        **{k: round(v, 4) for k, v in st.items()},
                    }
                )
    if not args.no_save:
        from bench._common import append_csv

        print(f"appended to {append_csv('block_keys', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
