"""Machine instructions per routing decision, counted by valgrind (callgrind): a figure load does not move.

    python bench/bench_router_instructions.py [--sessions 3000] [--decisions 500] [--configs ...] [--no-csv]

On a shared machine a decision's time moves by tens of percent between runs of the same code; the number of
instructions it executes does not. Per configuration of ``bench_router_latency.py``, this script runs itself
under ``valgrind --tool=callgrind`` (collection off), fills a router with ``--sessions`` conversations of 8 blocks
(with their ``BlockStored`` events where the configuration consumes them), places 20 new conversations as a
warm-up (the first anonymous session makes the session dict's keys general: a one-off resize), then times the
same three paths (``known``, ``known-no-id``, ``new``), ``--decisions`` each, each followed by its ``finish``.
Only ``route`` is counted: each call runs inside ``sorted(map(...))``, and callgrind collects inside
``builtin_sorted`` only (the router never sorts); ``math.lcm`` between paths dumps the counts. Reported per path:
instructions (Ir) per ``route``, and a digest of the decisions (equal digests: the same decisions). Skips when
valgrind is not installed. Rows go to ``bench/results/router_instructions.csv``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_router_latency import _KEY_SPACE, BLOCKS, CONFIGS, SERVERS, TPB
from kvforge.kvcache.events import BlockStored
from kvforge.routing import ConversationRouter, RouteRequest

PATHS = ("known", "known-no-id", "new")


def child(name: str, sessions: int, decisions: int) -> None:
    """The measured process (under valgrind): prints the decisions' digest."""
    cfg = CONFIGS[name]
    router = ConversationRouter(SERVERS, tokens_per_block=TPB, max_sessions=sessions, **cfg)
    rng = random.Random(1)
    keys = []
    for i in range(sessions):
        k = tuple(rng.randrange(_KEY_SPACE) for _ in range(BLOCKS))
        keys.append(k)
        s = router.route(RouteRequest(("fill", i), block_keys=k, num_tokens=BLOCKS * TPB, conversation_id=f"c{i}"))
        if cfg.get("use_cache_events"):
            router.on_event(s, BlockStored(k, None, TPB))
        router.finish(("fill", i))
    rng = random.Random(2)

    def make(path: str, k: int) -> RouteRequest:
        if path == "new":
            fresh = tuple(rng.randrange(_KEY_SPACE) for _ in range(BLOCKS))
            return RouteRequest(("n", k), block_keys=fresh, num_tokens=BLOCKS * TPB)
        i = rng.randrange(sessions)
        keys[i] = (*keys[i], rng.randrange(_KEY_SPACE))
        cid = f"c{i}" if path == "known" else None
        return RouteRequest((path, k), block_keys=keys[i], num_tokens=len(keys[i]) * TPB, conversation_id=cid)

    route, finish = router.route, router.finish
    for k in range(20):
        req = make("new", -1 - k)
        route(req)
        finish(req.request_id)
    out: list[object] = []
    math.lcm(1, 1)
    for path in PATHS:
        for k in range(decisions):
            req = make(path, k)
            out += sorted(map(route, (req,)))  # counted: the only sorted() call
            finish(req.request_id)
        math.lcm(1, 1)  # dump
    router.sanity_check()
    print("digest", hashlib.sha1(repr(out).encode()).hexdigest()[:12])


def measure(name: str, sessions: int, decisions: int) -> tuple[dict[str, float], str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=builtin_sorted",
            "--dump-after=math_lcm", f"--callgrind-out-file={out}",
            sys.executable, str(Path(__file__).resolve()), "--child", name,
            "--sessions", str(sessions), "--decisions", str(decisions),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        digest = re.search(r"digest (\w+)", proc.stdout)
        assert digest is not None, proc.stdout + proc.stderr
        # Dump 1 is the marker before the paths; dumps 2-4 are the three paths.
        per_path = {}
        for i, path in enumerate(PATHS, start=2):
            text = Path(f"{out}.{i}").read_text()
            total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            assert total is not None
            per_path[path] = int(total.group(1)) / decisions
    return per_path, digest.group(1)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--decisions", type=int, default=500)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.decisions < 1:
        ap.error("--sessions and --decisions: expected positive counts")
    if args.child:
        child(args.child, args.sessions, args.decisions)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind not found: skipped")
        return 0
    print(f"instructions per route, {args.sessions} sessions, {args.decisions} decisions per path")
    print(f"{'config':<26}" + "".join(f"{p:>13}" for p in PATHS) + "   digest")
    rows = []
    for name in args.configs:
        per_path, digest = measure(name, args.sessions, args.decisions)
        print(f"{name:<26}" + "".join(f"{per_path[p]:>13.0f}" for p in PATHS) + f"   {digest}")
        for path in PATHS:
            rows.append(
                {
                    "bench": "router_instructions",
                    "config": name,
                    "path": path,
                    "sessions": args.sessions,
                    "decisions": args.decisions,
                    "instructions_per_route": round(per_path[path]),
                    "decisions_digest": digest,
                    "python": sys.version.split()[0],
                }
            )
    if not args.no_csv:
        from bench._common import append_csv  # (imports torch, which valgrind's child need not load)

        print(f"rows appended to {append_csv('router_instructions', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
