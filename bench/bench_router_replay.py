"""Replay the Mooncake conversation trace over simulated servers and compare routing policies.

Each simulated server has its own LRU prefix cache (a hit needs the whole leading run of blocks present; hits
and inserts refresh recency) and drains its backlog of uncached prompt tokens at a fixed rate over trace time,
so a policy that piles conversations onto one server shows up as backlog imbalance, and one that scatters
them shows up as lost prefix hits. The caches publish ``BlockStored`` / ``BlockRemoved`` events, which only the
event-consuming policy reads. The ceiling is one LRU cache holding all servers' capacity, computed in the same
run (and quoted from the data README).

    python bench/bench_router_replay.py [--servers 4 8] [--utilisation 0.8] [--trace PATH]

Service model: every server drains its backlog of uncached prompt tokens at one fixed rate, chosen so that the
fleet would run at ``--utilisation`` if every policy reached the ceiling's hit rate (a policy that loses hits
overloads it). A request finishes (``router.finish``) when its prefill drains; caches change when a request is
placed, and events are delivered then.

Metrics, per policy:
- ``hit``: prompt tokens served from the chosen server's cache over all prompt tokens; ``/ceil`` divides by the
  same-run ceiling (one LRU cache of all servers' capacity).
- ``inst avg`` / ``inst p99``: every second of trace time at which the fleet's mean backlog is at least one
  block, the ratio max over servers / mean over servers of the backlog; its mean and 99th percentile. With
  one or two requests queued per server this ratio stays far above 1 whatever the policy (a single 20k-token
  prompt is most of a server's backlog), so it measures granularity as much as routing.
- ``srv avg`` / ``srv p99``: the same ratio taken over each server's time-averaged (99th-percentile) backlog:
  whether some server carries more than the others over the run (a death spiral shows up here).
- ``wait``: queueing delay before a request's prefill starts (backlog ahead of it over the drain rate).

The trace is read from ``$KVFORGE_TRACE`` or ``<repo>/../shared/data/mooncake_conversation_trace.jsonl``; it is
never copied into the repository. Rows go to ``bench/results/router_replay.csv``, the figure to
``bench/results/router_replay.png``.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, append_csv
from kvforge.kvcache.events import BlockRemoved, BlockStored, KVEvent
from kvforge.kvcache.replay import TRACE_TOKENS_PER_BLOCK, TraceRequest, default_trace_path, load_trace
from kvforge.routing import (
    CacheAwareRouter,
    ConversationRouter,
    ImbalanceGuard,
    LeastLoadRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
)

TOKENS_PER_BLOCK = TRACE_TOKENS_PER_BLOCK  # the trace's hash_ids block size
README_CEILINGS = {40_000: 0.358, 80_000: 0.369}  # one LRU of the fleet's capacity (shared/data/README.md)


class LruBlockCache:
    """A server's prefix cache: ``capacity`` blocks, LRU, publishing stored/removed block events."""

    def __init__(self, capacity: int, sink: Callable[[KVEvent], None] | None = None) -> None:
        self.capacity = capacity
        self.sink = sink
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def access(self, hashes: Sequence[int]) -> int:
        """Serve a prompt: return its leading cached run (blocks), then insert/refresh all its blocks."""
        blocks = self._blocks
        hit = 0
        for h in hashes:
            if h not in blocks:
                break
            hit += 1
        stored: list[int] = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        removed = []
        while len(blocks) > self.capacity:
            removed.append(blocks.popitem(last=False)[0])
        if self.sink is not None:
            if stored:
                first = hashes.index(stored[0])
                parent = hashes[first - 1] if first else None
                self.sink(BlockStored(tuple(stored), parent, TOKENS_PER_BLOCK))
            if removed:
                self.sink(BlockRemoved(tuple(removed)))
        return hit


def ceiling_hit_rate(trace: Sequence[TraceRequest], capacity: int) -> float:
    cache = LruBlockCache(capacity)
    hit = total = 0
    for r in trace:
        hit += min(cache.access(r.hash_ids) * TOKENS_PER_BLOCK, r.input_length)
        total += r.input_length
    return hit / total


@dataclass
class ReplayResult:
    hit_rate: float
    imbalance_mean: float
    imbalance_p99: float
    imbalance_of_means: float
    server_imbalance_mean: float
    server_imbalance_p99: float
    busy_fraction: float
    wait_mean_s: float
    wait_p99_s: float
    seconds: float


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def replay(
    trace: Sequence[TraceRequest],
    make_router: Callable[[list[int], Callable[[], float]], Router],
    n_servers: int,
    blocks_per_server: int,
    rate_tokens_per_s: float,
    feed_events: bool,
    sample_every_s: float = 1.0,
) -> ReplayResult:
    """Route every request, serve it on the chosen server's cache and queue; sample backlogs on a time grid."""
    t0 = time.perf_counter()
    now = [0.0]
    servers = list(range(n_servers))
    router = make_router(servers, lambda: now[0])
    caches = [
        LruBlockCache(blocks_per_server, (lambda ev, s=s: router.on_event(s, ev)) if feed_events else None)
        for s in servers
    ]
    backlog = [0.0] * n_servers
    last = [0.0] * n_servers
    done: list[tuple[float, int]] = []
    ratios: list[float] = []
    per_server: list[list[float]] = [[] for _ in servers]
    max_sum = mean_sum = 0.0
    samples = busy = 0
    next_sample = 0.0
    waits: list[float] = []
    hit = total = 0
    busy_floor = TOKENS_PER_BLOCK  # a fleet with less than one block queued on average counts as idle

    def drained(s: int, t: float) -> float:
        return max(0.0, backlog[s] - rate_tokens_per_s * (t - last[s]))

    for rid, r in enumerate(trace):
        t_s = r.timestamp / 1000.0
        while next_sample <= t_s:
            b = [drained(s, next_sample) for s in servers]
            for s, v in zip(servers, b):
                per_server[s].append(v)
            mean = sum(b) / n_servers
            samples += 1
            max_sum += max(b)
            mean_sum += mean
            if mean >= busy_floor:
                busy += 1
                ratios.append(max(b) / mean)
            next_sample += sample_every_s
        while done and done[0][0] <= t_s:
            t_done, done_id = heapq.heappop(done)
            now[0] = t_done
            router.finish(done_id)
        now[0] = t_s
        s = router.route(RouteRequest(request_id=rid, block_hashes=r.hash_ids, num_tokens=r.input_length))
        cached = min(caches[s].access(r.hash_ids) * TOKENS_PER_BLOCK, r.input_length)
        hit += cached
        total += r.input_length
        b = drained(s, t_s)
        waits.append(b / rate_tokens_per_s)
        backlog[s] = b + (r.input_length - cached)
        last[s] = t_s
        heapq.heappush(done, (t_s + backlog[s] / rate_tokens_per_s, rid))
    while done:
        t_done, done_id = heapq.heappop(done)
        now[0] = t_done
        router.finish(done_id)
    server_means = [sum(v) / len(v) for v in per_server]
    server_p99 = [_p99(v) for v in per_server]
    leaked = sum(router.loads().values())
    if leaked:
        raise RuntimeError(f"router leaked load after every request finished: {router.loads()}")
    return ReplayResult(
        hit_rate=hit / total,
        imbalance_mean=sum(ratios) / len(ratios) if ratios else float("nan"),
        imbalance_p99=_p99(ratios),
        imbalance_of_means=max_sum / mean_sum if mean_sum else float("nan"),
        server_imbalance_mean=max(server_means) / (sum(server_means) / n_servers),
        server_imbalance_p99=max(server_p99) / (sum(server_p99) / n_servers),
        busy_fraction=busy / max(1, samples),
        wait_mean_s=sum(waits) / len(waits),
        wait_p99_s=_p99(waits),
        seconds=time.perf_counter() - t0,
    )


def policies(blocks_per_server: int, guard: ImbalanceGuard) -> dict[str, tuple[Callable, bool]]:
    """name -> (factory(servers, clock), consumes cache events).

    The "(min 1)" rows let a new conversation follow a one-block match: on this trace every prompt starts
    with the same block, so "always" then sends every new conversation after the previous one (the death
    spiral the imbalance guard exists for).
    """
    common = dict(tokens_per_block=TOKENS_PER_BLOCK, request_ttl_s=3600.0)
    out: dict[str, tuple[Callable, bool]] = {
        "round-robin": (lambda s, c: RoundRobinRouter(s, clock=c, **common), False),
        "least-load": (lambda s, c: LeastLoadRouter(s, clock=c, **common), False),
        "sglang-like": (
            lambda s, c: CacheAwareRouter(s, clock=c, tree_capacity_blocks=blocks_per_server, **common),
            False,
        ),
    }
    for min_blocks, suffix in ((2, ""), (1, " (min 1)")):
        conv = dict(common, new_conversation_min_match_blocks=min_blocks)
        if not suffix:
            out["specific"] = (lambda s, c, kw=conv: ConversationRouter(s, clock=c, **kw), False)
        out["always" + suffix] = (
            lambda s, c, kw=conv: ConversationRouter(s, clock=c, new_conversation_follow="always", **kw),
            False,
        )
        out["always+events+guard" + suffix] = (
            lambda s, c, kw=conv: ConversationRouter(
                s, clock=c, new_conversation_follow="always", use_cache_events=True, imbalance_guard=guard, **kw
            ),
            True,
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--servers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--blocks-per-server", type=int, default=10_000)
    ap.add_argument(
        "--utilisation",
        type=float,
        default=0.8,
        help="offered uncached load (at the ceiling's hit rate) over the fleet's drain capacity",
    )
    ap.add_argument("--guard-rel", type=float, default=ImbalanceGuard.rel_slack)
    ap.add_argument("--guard-abs", type=int, default=ImbalanceGuard.abs_slack_tokens)
    ap.add_argument("--policies", nargs="*", default=None, help="subset of policy names")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)

    path = args.trace or default_trace_path()
    if path is None or not path.exists():
        print(f"SKIP: trace not found at {path or '../shared/data/'} (set KVFORGE_TRACE); nothing to replay")
        return 0
    trace = load_trace(path)
    duration = (trace[-1].timestamp - trace[0].timestamp) / 1000.0
    prompt_tokens = sum(r.input_length for r in trace)
    guard = ImbalanceGuard(rel_slack=args.guard_rel, abs_slack_tokens=args.guard_abs)
    print(f"trace: {len(trace)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens over {duration:.0f} s")

    rows = []
    table = []
    for n in args.servers:
        capacity = n * args.blocks_per_server
        t = time.perf_counter()
        ceiling = ceiling_hit_rate(trace, capacity)
        print(f"\n{n} servers, {capacity} blocks in all: ceiling {ceiling:.1%} ({time.perf_counter() - t:.1f} s)")
        rate = prompt_tokens * (1.0 - ceiling) / duration / (n * args.utilisation)
        print(f"drain rate {rate:.0f} tokens/s per server (utilisation {args.utilisation} at the ceiling)")
        header = (
            f"{'policy':<29}{'hit':>7}{'/ceil':>7}{'inst avg':>9}{'inst p99':>9}{'srv avg':>8}{'srv p99':>8}"
            f"{'wait s':>10}{'wait p99':>10}{'sec':>6}"
        )
        print(header)
        for name, (factory, events) in policies(args.blocks_per_server, guard).items():
            if args.policies and name not in args.policies:
                continue
            res = replay(trace, factory, n, args.blocks_per_server, rate, events)
            frac = res.hit_rate / ceiling
            print(
                f"{name:<29}{res.hit_rate:>7.1%}{frac:>7.1%}{res.imbalance_mean:>9.2f}{res.imbalance_p99:>9.2f}"
                f"{res.server_imbalance_mean:>8.2f}{res.server_imbalance_p99:>8.2f}"
                f"{res.wait_mean_s:>10.2f}{res.wait_p99_s:>10.2f}{res.seconds:>6.1f}"
            )
            table.append((n, name, res, ceiling))
            rows.append(
                {
                    "bench": "router_replay",
                    "servers": n,
                    "blocks_per_server": args.blocks_per_server,
                    "utilisation": args.utilisation,
                    "policy": name,
                    "guard_rel": args.guard_rel if events else "",
                    "guard_abs_tokens": args.guard_abs if events else "",
                    "hit_rate": round(res.hit_rate, 5),
                    "ceiling_same_run": round(ceiling, 5),
                    "ceiling_readme": README_CEILINGS.get(capacity, ""),
                    "hit_over_ceiling": round(frac, 4),
                    "imbalance_mean": round(res.imbalance_mean, 4),
                    "imbalance_p99": round(res.imbalance_p99, 4),
                    "imbalance_of_means": round(res.imbalance_of_means, 4),
                    "server_imbalance_mean": round(res.server_imbalance_mean, 4),
                    "server_imbalance_p99": round(res.server_imbalance_p99, 4),
                    "busy_fraction": round(res.busy_fraction, 4),
                    "wait_mean_s": round(res.wait_mean_s, 4),
                    "wait_p99_s": round(res.wait_p99_s, 4),
                    "replay_s": round(res.seconds, 2),
                }
            )
    if not args.no_csv and rows:
        print(f"\nrows appended to {append_csv('router_replay', rows)}")
        print(f"figure: {plot(table, RESULTS / 'router_replay.png')}")
    return 0


def plot(table: list, path: Path) -> Path:
    """Three panels of grouped bars (one group per policy, one bar per fleet size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row[0] for row in table})
    names = list(dict.fromkeys(row[1] for row in table))
    by = {(row[0], row[1]): (row[2], row[3]) for row in table}
    panels = [
        ("prefix-hit rate / same-capacity ceiling", lambda res, ceil: res.hit_rate / ceil, False, 0.9),
        (
            "backlog imbalance (max/mean of per-server mean backlog)",
            lambda res, ceil: res.server_imbalance_mean,
            True,
            1.3,
        ),
        ("mean queueing delay before prefill (s)", lambda res, ceil: res.wait_mean_s, True, None),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(sizes)
    for ax, (label, value, log, target) in zip(axes, panels):
        for i, n in enumerate(sizes):
            xs = [k + (i - (len(sizes) - 1) / 2) * width for k in range(len(names))]
            ys = [value(*by[(n, name)]) if (n, name) in by else float("nan") for name in names]
            ax.bar(xs, ys, width, label=f"{n} servers")
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_title(label, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle("Mooncake conversation trace replay, 10,000 blocks of 512 tokens per server", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
