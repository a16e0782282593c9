"""Routing-decision time with a full session table (100,000 conversations), the garbage collector on.

    python bench/bench_router_latency.py [--sessions 100000] [--decisions 20000] [--freeze] [--no-csv]

The table is filled with ``--sessions`` conversations of 8 blocks (explicit ids; with cache events, each
server's ``BlockStored`` events for its conversations too). Then, per configuration, three paths are timed one
decision at a time around ``route`` (its ``finish`` follows, timed apart), in wall time (``perf_counter_ns``)
and in this thread's CPU time (``thread_time_ns``, which a busy machine's preemptions do not inflate):

- ``known``: a conversation's next turn with its id (one block more than before);
- ``known-no-id``: the same without the id (the implicit match through the trie);
- ``new``: a new anonymous conversation with fresh keys (each one evicts the least recent session).

With cache events, a fourth row, ``on_event``, times the event path itself: per step, one ``BlockStored``
of a new block continuing a random conversation on its server, and one ``BlockRemoved`` of the block stored
1,000 steps before (the index keeps its size); each call is one sample.

Reported per path: median, mean, p99 and max in µs, mean / median, how many full (generation 2) and young
collections ran during the timed decisions, and the median / p99 CPU µs of the ``finish`` after each decision
(where the router takes an evicted session's blocks out of its trie). Targets (issue 18): mean <= 1.5 x
median and p99 <= 50 µs on every path. ``--freeze`` calls ``gc.freeze()`` after filling the table, as a server
would after warm-up; the default measures without it. Rows go to ``bench/results/router_latency.csv``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvforge.kvcache.events import BlockRemoved, BlockStored
from kvforge.routing import ConversationRouter, CostGuard, ImbalanceGuard, RouteRequest

BLOCKS = 8
TPB = 128
SERVERS = [f"s{i}" for i in range(8)]
CONFIGS: dict[str, dict] = {
    "specific": {},
    "always": {"new_conversation_follow": "always"},
    "always+events+guard": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": ImbalanceGuard(),
    },
    "always+events+cost+drain": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": CostGuard(),
        "prefill_tokens_per_s": 10_000.0,
    },
}
_KEY_SPACE = 1 << 64  # keys as the salted hashing gives them: non-negative, 64 bits and more


def conv_keys(i: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(_KEY_SPACE) for _ in range(BLOCKS))


class _GcCounter:
    def __init__(self) -> None:
        self.full = 0
        self.young = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            if info["generation"] == 2:
                self.full += 1
            else:
                self.young += 1


def fill(name: str, sessions: int, seed: int) -> tuple[ConversationRouter, list[tuple[int, ...]]]:
    cfg = CONFIGS[name]
    r = ConversationRouter(SERVERS, tokens_per_block=TPB, max_sessions=sessions, **cfg)
    rng = random.Random(seed)
    keys = []
    for i in range(sessions):
        k = conv_keys(i, rng)
        keys.append(k)
        s = r.route(RouteRequest(("fill", i), block_keys=k, num_tokens=BLOCKS * TPB, conversation_id=f"c{i}"))
        if cfg.get("use_cache_events"):
            r.on_event(s, BlockStored(k, None, TPB))
        r.finish(("fill", i))
    assert r.num_sessions() == sessions
    return r, keys


def time_path(
    router: ConversationRouter, make: Callable[[int], RouteRequest], decisions: int
) -> tuple[list[float], list[float], list[float], list[float], _GcCounter]:
    """Per decision: wall µs of ``route``, this thread's CPU µs of ``route``, wall and CPU µs of ``finish``."""
    counter = _GcCounter()
    gc.callbacks.append(counter)
    wall: list[float] = []
    cpu: list[float] = []
    finish: list[float] = []
    finish_cpu: list[float] = []
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    try:
        for k in range(decisions):
            req = make(k)
            c0 = cpu_clock()
            t0 = clock()
            router.route(req)
            t1 = clock()
            c1 = cpu_clock()
            router.finish(req.request_id)
            t2 = clock()
            c2 = cpu_clock()
            wall.append((t1 - t0) / 1000.0)
            cpu.append((c1 - c0) / 1000.0)
            finish.append((t2 - t1) / 1000.0)
            finish_cpu.append((c2 - c1) / 1000.0)
    finally:
        gc.callbacks.remove(counter)
    return wall, cpu, finish, finish_cpu, counter


def time_events(
    router: ConversationRouter, keys: list[tuple[int, ...]], steps: int, rng: random.Random
) -> tuple[list[float], list[float], list[float], list[float], _GcCounter]:
    """Per ``on_event`` call: wall µs, this thread's CPU µs (and no finish: empty lists)."""
    counter = _GcCounter()
    gc.callbacks.append(counter)
    wall: list[float] = []
    cpu: list[float] = []
    stored: deque[tuple[str, int]] = deque()
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    try:
        for _ in range(steps):
            i = rng.randrange(len(keys))
            # (Its session may have been evicted by the "new" path; its server still caches it.)
            server = router.session_server(f"c{i}") or SERVERS[i % len(SERVERS)]
            key = rng.randrange(_KEY_SPACE)
            events: list[tuple[str, object]] = [(server, BlockStored((key,), keys[i][-1], TPB))]
            stored.append((server, key))
            if len(stored) > 1000:
                old_server, old_key = stored.popleft()
                events.append((old_server, BlockRemoved((old_key,))))
            for srv, ev in events:
                c0 = cpu_clock()
                t0 = clock()
                router.on_event(srv, ev)  # type: ignore[arg-type]
                t1 = clock()
                c1 = cpu_clock()
                wall.append((t1 - t0) / 1000.0)
                cpu.append((c1 - c0) / 1000.0)
    finally:
        gc.callbacks.remove(counter)
    return wall, cpu, [], [], counter


def summarise(us: Sequence[float]) -> dict[str, float]:
    a = np.asarray(us)
    med = float(np.median(a))
    return {
        "median_us": med,
        "mean_us": float(a.mean()),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
        "mean_over_median": float(a.mean()) / med,
    }


def run_config(name: str, sessions: int, decisions: int, freeze: bool) -> list[dict]:
    """Fill a router of configuration ``name``, then time the three paths; returns the CSV rows."""
    router, keys = fill(name, sessions, seed=1)
    if freeze:
        gc.freeze()
    rng = random.Random(2)

    def known(k: int, with_id: bool) -> RouteRequest:
        i = rng.randrange(sessions)
        keys[i] = (*keys[i], rng.randrange(_KEY_SPACE))
        cid = f"c{i}" if with_id else None
        return RouteRequest(("k", with_id, k), block_keys=keys[i], num_tokens=len(keys[i]) * TPB, conversation_id=cid)

    def new(k: int) -> RouteRequest:
        return RouteRequest(("n", k), block_keys=conv_keys(k, rng), num_tokens=BLOCKS * TPB)

    paths: list[tuple[str, Callable[[int], RouteRequest]]] = [
        ("known", lambda k: known(k, True)),
        ("known-no-id", lambda k: known(k, False)),
        ("new", new),
    ]
    timed: list[tuple[str, Callable[[], tuple[list[float], list[float], list[float], list[float], _GcCounter]]]] = [
        (path, lambda make=make: time_path(router, make, decisions)) for path, make in paths
    ]
    if CONFIGS[name].get("use_cache_events"):
        timed.append(("on_event", lambda: time_events(router, keys, decisions, rng)))
    rows = []
    load = os.getloadavg()[0]  # other work inflates wall time (and, through the caches, CPU time too)
    for path, run in timed:
        route_us, cpu_us, finish_us, finish_cpu_us, gcs = run()
        st = summarise(route_us)
        cp = summarise(cpu_us)
        none = {"median_us": math.nan, "mean_us": math.nan, "p99_us": math.nan}
        fin = summarise(finish_us) if finish_us else none
        fin_cpu = summarise(finish_cpu_us) if finish_cpu_us else none
        print(
            f"{name:<26}{path:<13}{st['median_us']:>8.1f}{st['mean_us']:>8.1f}{st['p99_us']:>8.1f}"
            f"{st['max_us']:>9.0f}{st['mean_over_median']:>9.2f}   |{cp['median_us']:>8.1f}{cp['mean_us']:>8.1f}"
            f"{cp['p99_us']:>8.1f}{cp['max_us']:>9.0f}{cp['mean_over_median']:>9.2f}{gcs.full:>6}{gcs.young:>7}"
            f"   |{fin_cpu['median_us']:>7.1f}{fin_cpu['p99_us']:>7.1f}"
        )
        rows.append(
            {
                "bench": "router_latency",
                "config": name,
                "path": path,
                "sessions": sessions,
                "decisions": decisions,
                "gc": "on",
                "gc_freeze": freeze,
                **{k: round(v, 3) for k, v in st.items()},
                **{f"cpu_{k}": round(v, 3) for k, v in cp.items()},
                "finish_median_us": round(fin["median_us"], 3),
                "finish_mean_us": round(fin["mean_us"], 3),
                "finish_p99_us": round(fin["p99_us"], 3),
                "cpu_finish_median_us": round(fin_cpu["median_us"], 3),
                "cpu_finish_mean_us": round(fin_cpu["mean_us"], 3),
                "cpu_finish_p99_us": round(fin_cpu["p99_us"], 3),
                "gen2_collections": gcs.full,
                "young_collections": gcs.young,
                "python": sys.version.split()[0],
                "load_avg_1m": round(load, 2),
            }
        )
    router.sanity_check()
    if freeze:
        gc.unfreeze()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after filling the table")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.decisions < 1:
        ap.error("--sessions and --decisions: expected positive counts")
    gc.enable()
    print(f"python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}, freeze={args.freeze}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall time includes preemption)")
    stats = f"{'median':>8}{'mean':>8}{'p99':>8}{'max':>9}{'mean/med':>9}"
    print(
        f"{'':<39}{'wall µs of route':<49}|{'thread CPU µs of route':<49}{'collections':>13}   |{'CPU µs finish':>14}"
    )
    print(f"{'config':<26}{'path':<13}{stats}   |{stats}{'gen2':>6}{'young':>7}   |{'median':>7}{'p99':>7}")
    rows = []
    for name in args.configs:
        rows += run_config(name, args.sessions, args.decisions, args.freeze)
        gc.collect()
    if not args.no_csv:
        from bench._common import append_csv  # (imports torch: kept out of bench_router_instructions' child)

        print(f"rows appended to {append_csv('router_latency', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
