"""Cost of a prompt's block keys (:mod:`kvforge.kvcache.hashing`) at 16 and 512 tokens per block, 32k and 131k tokens.

Times :func:`~kvforge.kvcache.hashing.block_keys` (thread CPU time) with the garbage collector on, for prompts
given as a Python list (what a tokenizer returns), a tuple and a numpy int64 array, with both algorithms
(xxh3_128, the default, and sha256), next to the builtin-hash chain kvforge used before
(``hash((parent, tuple(block)))``: 64-bit, unkeyed, collides on ``-1``/``-2``), shown for reference only.
Target: 131,072 tokens at 512 tokens per block in <= 1 ms (list and numpy input). Each row records the 1-minute
load average: on a shared machine, contention inflates thread CPU time. Rows go to
``bench/results/block_keys.csv``. Host only. Run::

    python bench/bench_block_keys.py [--reps 200] [--no-save]
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

from kvforge.kvcache.hashing import BlockKeyHasher

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
    samples.sort()
    return {
        "median_ms": samples[len(samples) // 2] / 1e6,
        "mean_ms": sum(samples) / len(samples) / 1e6,
        "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if not gc.isenabled():
        raise SystemExit("the garbage collector must be on")
    rng = random.Random(0)
    rows = []
    print(f"{'tokens':>8} {'tpb':>4} {'algorithm':>9} {'input':>6} {'median ms':>10} {'mean ms':>8} {'p99 ms':>8}")
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
            for alg, kind, fn in cases:
                st = _time(fn, args.reps)
                flag = ""
                if n == 131_072 and tpb == 512 and alg == "xxh3_128" and kind != "tuple":
                    flag = "  <= 1 ms" if st["median_ms"] <= TARGET_MS else "  > 1 ms target"
                print(
                    f"{n:>8} {tpb:>4} {alg[:9]:>9} {kind:>6} {st['median_ms']:10.3f} {st['mean_ms']:8.3f} "
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
