"""Where a routing decision's rare multi-millisecond stalls come from, at 100,000 sessions (gc on).

    python bench/probe_router_stalls.py [--config specific] [--sessions 100000] [--new 200000] [--slow-ms 2] [--freeze]

Fills a router as ``bench_router_latency.py`` does (``--sessions`` conversations with ids, 8 blocks each), runs
its ``known`` and ``known-no-id`` paths (20,000 decisions each), then ``--new`` new anonymous conversations (so
several rebuild points of the big dicts are crossed), each ``route`` followed by its ``finish``. Reported per
path: max, p99.9, p99 and median wall µs of ``route`` and of ``finish``; then every call slower than
``--slow-ms`` with its likely cause: the garbage-collector generations that ran inside it (a ``gc.callbacks``
hook) and the router's dicts whose allocation changed during it (``sys.getsizeof``: a rebuild of the hash
table). ``--freeze`` calls ``gc.freeze()`` after the fill, as a server would after warm-up. A call slow with
neither is the machine (another process on the cores) or an unlisted cause.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_router_latency import _KEY_SPACE, BLOCKS, CONFIGS, TPB, conv_keys, fill
from kvforge.routing import ConversationRouter, RouteRequest


def _tables(r: ConversationRouter) -> dict[str, object]:
    """The router's dicts that grow with the session table or the trie (read-only access for the probe)."""
    ci = r._cache_index
    out: dict[str, object] = {
        "sessions": r._sessions,
        "key_of": r._key_of,
        "trie.nodes": r._trie._nodes,
        "trie.recent": r._trie._recent,
        "ledger.live": r._ledger._live,
        "events.mask": ci._mask,
    }
    for i, b in enumerate(ci._blocks):
        out[f"events.blocks[{i}]"] = b
    return out


def _q(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="specific", choices=list(CONFIGS))
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--known", type=int, default=20_000)
    ap.add_argument("--new", type=int, default=200_000)
    ap.add_argument("--slow-ms", type=float, default=2.0)
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after filling the table")
    args = ap.parse_args(argv)
    if min(args.sessions, args.new) < 1 or args.known < 0 or not args.slow_ms > 0:
        ap.error("positive counts and threshold expected")
    gc.enable()
    print(
        f"python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}, freeze={args.freeze}, "
        f"config {args.config}, {args.sessions} sessions, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    router, keys = fill(args.config, args.sessions, seed=1)
    if args.freeze:
        gc.freeze()
    rng = random.Random(2)
    n = args.sessions

    def known(k: int, with_id: bool) -> RouteRequest:
        i = rng.randrange(n)
        keys[i] = (*keys[i], rng.randrange(_KEY_SPACE))
        cid = f"c{i}" if with_id else None
        return RouteRequest(("k", with_id, k), block_keys=keys[i], num_tokens=len(keys[i]) * TPB, conversation_id=cid)

    def new(k: int) -> RouteRequest:
        return RouteRequest(("n", k), block_keys=conv_keys(k, rng), num_tokens=BLOCKS * TPB)

    collected: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collected.append(info["generation"])

    gc.callbacks.append(on_gc)
    tables = _tables(router)
    size = sys.getsizeof
    clock = time.perf_counter_ns
    slow_ns = args.slow_ms * 1e6
    paths: list[tuple[str, Callable[[int], RouteRequest], int]] = [
        ("known", lambda k: known(k, True), args.known),
        ("known-no-id", lambda k: known(k, False), args.known),
        ("new", new, args.new),
    ]
    try:
        for path, make, count in paths:
            route_us: list[float] = []
            finish_us: list[float] = []
            slow: list[str] = []
            for k in range(count):
                req = make(k)
                collected.clear()
                s0 = [size(t) for t in tables.values()]
                t0 = clock()
                router.route(req)
                t1 = clock()
                g1 = list(collected)
                s1 = [size(t) for t in tables.values()]
                t2 = clock()
                router.finish(req.request_id)
                t3 = clock()
                g2 = collected[len(g1) :]
                s2 = [size(t) for t in tables.values()]
                route_us.append((t1 - t0) / 1e3)
                finish_us.append((t3 - t2) / 1e3)
                for what, dt, g, a, b in (("route", t1 - t0, g1, s0, s1), ("finish", t3 - t2, g2, s1, s2)):
                    if dt > slow_ns:
                        grown = [name for name, x, y in zip(tables, a, b) if x != y]
                        cause = ", ".join([f"gc gen{x}" for x in g] + [f"rebuilt {x}" for x in grown]) or "-"
                        slow.append(f"  #{k:<7} {what:<6} {dt / 1e6:7.1f} ms   {cause}")
            r = sorted(route_us)
            f = sorted(finish_us)
            print(
                f"{path:<12} {count} decisions  route µs: max {r[-1]:.0f}  p99.9 {_q(r, 0.999):.1f}  "
                f"p99 {_q(r, 0.99):.1f}  median {_q(r, 0.5):.1f}   finish µs: max {f[-1]:.0f}  "
                f"p99.9 {_q(f, 0.999):.1f}  p99 {_q(f, 0.99):.1f}  median {_q(f, 0.5):.1f}"
            )
            for line in slow:
                print(line)
    finally:
        gc.callbacks.remove(on_gc)
    if args.freeze:
        gc.unfreeze()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
