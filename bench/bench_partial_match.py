"""Partial-block match against the number of siblings: the children's token index vs the former scan.

``PrefixMatcher.match_partial`` asks a node's children for the one sharing the longest token prefix with a
prompt's tail (``Children.longest_prefix``, a sorted token index). Before the index it scanned every child of the
node in the dict's order, comparing tokens in Python; that scan is kept here as the reference. For each grid
point (``--siblings`` children of one node, 512-token blocks, half full blocks and half partial ones of random
length) and each shared-prefix length (``--shared``: 0 = random tokens; 1 = every child starts with the same
token; 256 = every child and query share their first 256 tokens, as conversations under one system prompt
would), random queries (half are a child's tokens cut and then diverging, half random after the shared prefix)
are answered by both; every answer must agree (block and length) or nothing is reported. CPU µs per query (GC
on, ``time.process_time``), each side timed over the same queries for at least ``--budget`` s (the scan runs
only as many queries as the budget allows at large sizes). The token values come from a fresh seed each run
(printed; ``--seed`` to repeat one). Rows go to ``bench/results/partial_match.csv``. Run::

    python bench/bench_partial_match.py [--siblings 1,10,100,1000,10000] [--shared 0,1,256] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvforge.kvcache.pools import Block

TPB = 512


def scan(node: Block, rem: tuple[int, ...]) -> tuple[Block | None, int]:
    """The former ``match_partial`` loop: every child in the dict's order, the first longest prefix wins."""
    first = rem[0]
    best, best_len = None, 0
    for child in node.children.values():
        ct = child.tokens
        if ct is None or ct[0] != first:
            continue
        n = min(len(ct), len(rem))
        i = 1
        while i < n and ct[i] == rem[i]:
            i += 1
        if i > best_len:
            best, best_len = child, i
    return best, best_len


def build(n: int, shared: int, rng: random.Random) -> tuple[Block, list[tuple[int, ...]]]:
    """A root with ``n`` children (every other one partial) sharing ``shared`` leading tokens, and 64 queries."""
    root = Block(1, None, -1, 0, None, 1)
    head = tuple(rng.randrange(50_000) for _ in range(shared))
    toks = []
    for k in range(n):
        length = TPB if k % 2 == 0 else rng.randint(max(shared, 1), TPB - 1)
        t = head + tuple(rng.randrange(50_000) for _ in range(length - shared))
        root.children[k + 2] = Block(k + 2, root, 0, length, t, 1)
        toks.append(t)
    queries = []
    for q in range(64):
        if q % 2 == 0:  # a child's tokens, cut, then diverging
            t = rng.choice(toks)
            cut = rng.randint(max(shared, 1), len(t))
            queries.append(t[:cut] + tuple(rng.randrange(50_000) for _ in range(rng.randint(0, TPB - cut))))
        else:
            queries.append(head + tuple(rng.randrange(50_000) for _ in range(rng.randint(1, TPB - shared))))
    return root, queries


def timed(fn, root: Block, queries: list[tuple[int, ...]], budget: float) -> tuple[float, list]:
    """CPU µs per query over whole passes of ``queries`` (or a prefix of one pass) for at least ``budget`` s."""
    answers: list = []
    done = 0
    t0 = time.process_time()
    while True:
        for q in queries:
            r = fn(root, q)
            if len(answers) < len(queries):
                answers.append(r)
            done += 1
            if time.process_time() - t0 >= budget and done >= 1:
                return (time.process_time() - t0) * 1e6 / done, answers
        if time.process_time() - t0 >= budget:
            return (time.process_time() - t0) * 1e6 / done, answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--siblings", default="1,10,100,1000,10000")
    ap.add_argument("--shared", default="0,1,256")
    ap.add_argument("--seed", type=int, default=None, help="token values' seed (default: a fresh one)")
    ap.add_argument("--budget", type=float, default=0.3, help="CPU seconds per side and grid point (> 0)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.siblings.split(",")]
        shares = [int(x) for x in args.shared.split(",")]
    except ValueError:
        ap.error("--siblings/--shared: expected comma-separated integers")
    if any(n < 1 for n in sizes) or any(not 0 <= s < TPB - 1 for s in shares) or not args.budget > 0:
        ap.error(f"--siblings >= 1, --shared in [0, {TPB - 2}], --budget > 0")
    seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
    load0 = os.getloadavg()
    print(f"# seed {seed}; {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, GC on")
    print(f"load average at start (1/5/15 min): {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}")
    print(f"{'siblings':>9} {'shared':>6} {'index us':>9} {'scan us':>10} {'scan/index':>10}  queries checked")
    rows = []
    for shared in shares:
        for n in sizes:
            rng = random.Random(f"{seed}/{n}/{shared}")
            root, queries = build(n, shared, rng)
            idx_us, idx_ans = timed(lambda r, q: r.children.longest_prefix(q), root, queries, args.budget)
            scan_us, scan_ans = timed(scan, root, queries, args.budget)
            for q, a, b in zip(queries, idx_ans, scan_ans):
                if a[0] is not b[0] or a[1] != b[1]:
                    print(f"REFERENCE MISMATCH at siblings={n} shared={shared}: {q[:8]}... index {a}, scan {b}")
                    return 1
            checked = min(len(idx_ans), len(scan_ans))
            print(f"{n:>9} {shared:>6} {idx_us:>9.2f} {scan_us:>10.1f} {scan_us / idx_us:>10.1f}  {checked}")
            rows.append(
                {
                    "siblings": n,
                    "shared_prefix": shared,
                    "tokens_per_block": TPB,
                    "index_us": round(idx_us, 3),
                    "scan_us": round(scan_us, 2),
                    "scan_over_index": round(scan_us / idx_us, 2),
                    "queries_checked": checked,
                    "seed": seed,
                    "gc": "on",
                    "cpu": platform.machine(),
                    "python": platform.python_version(),
                }
            )
    load1 = os.getloadavg()
    print(f"load average at end (1/5/15 min): {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    if not args.no_save:
        from bench._common import append_csv

        for r in rows:
            r["loadavg_start"], r["loadavg_end"] = round(load0[0], 2), round(load1[0], 2)
        print(f"appended to {append_csv('partial_match', rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
