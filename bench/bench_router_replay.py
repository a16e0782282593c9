"""Replay the Mooncake conversation trace over simulated servers and compare routing policies.

Each simulated server has its own LRU prefix cache (a hit needs the whole leading run of blocks present; hits
and inserts refresh recency) and computes its queue of uncached prompt tokens first come, first served at a
fixed rate over trace time, so a policy that piles conversations onto one server shows up as backlog imbalance,
and one that scatters them shows up as lost prefix hits. The caches publish ``BlockStored`` / ``BlockRemoved``
events, which only the event-consuming policies read. The ceiling is one LRU cache holding all servers'
capacity, computed in the same run (and quoted from the data README).

    python bench/bench_router_replay.py [--servers 4 8] [--utilisation 0.8 [0.9 ...]] [--calibrate policy]
        [--preamble-blocks 0 2 [1 4 8 ...]]

``--preamble-blocks P`` puts one shared preamble of ``P`` blocks (512 tokens each, new keys) in front of every
request of the trace (a system prompt): a router that follows a prefix everyone shares piles all new
conversations onto one server. The default replays the plain trace and a 2-block preamble.

Service model: every server drains its backlog at one rate. ``--calibrate ceiling`` (the default) picks the
rate so that the fleet runs at ``--utilisation`` at the ceiling's hit rate: the same servers for every policy,
so a policy that loses hits overloads them (``rho`` > 1). ``--calibrate policy`` replays each policy a second
time at the rate that puts its own post-hit load at ``--utilisation``: equal queueing, to compare balance
alone. A request finishes (``router.finish``) when its prefill is computed; caches change when a request is
placed, and events are delivered then. Decode is not modelled.

Metrics, per policy (backlogs sampled every second of trace time):
- ``hit``: prompt tokens served from the chosen server's cache over all prompt tokens; ``/ceil`` divides by the
  same-run ceiling (one LRU cache of all servers' capacity). ``rho``: uncached tokens over the fleet's capacity.
- ``inst`` / ``p99``: at every sample where the fleet's mean backlog is at least one block, max over servers /
  mean over servers of the backlog; its time-mean and 99th percentile.
- ``wtd``: the same ratio weighted by the fleet's backlog, i.e. sum over samples of the max / sum of the mean
  (idle moments weigh nothing).
- ``floor``: the backlog-weighted mean of max(largest single request's remaining work, mean backlog) / mean:
  no placement of the requests queued at that moment could do better than this, because a request is computed
  on one server.
- ``LWL`` (after ``floor``): ``wtd`` for the oracle that places the same per-request work (this policy's hits
  kept) on the server with the least true backlog; after ``wait``, that oracle's mean wait.
- ``srv`` / ``p99``: max / mean over servers of each server's time-averaged (99th-percentile) backlog: whether
  some server carries more than the others over the run (a death spiral shows up here).
- ``wait``: queueing delay before a request's prefill starts (mean; p99).

At the default load the queues are short (about two requests per server on 8 servers), so the instantaneous
ratios are set by single long prompts: ``floor`` and the oracle's ``LWL`` stay far above 1.3, and a policy
that overloads the fleet (losing hits) lowers them by lengthening every queue. ``--utilisation 0.8 0.9 0.95
0.99`` shows the ratio falling with load for every policy alike.

The trace is read from ``$KVFORGE_TRACE`` or ``<repo>/../shared/data/mooncake_conversation_trace.jsonl``; it is
never copied into the repository. Rows go to ``bench/results/router_replay.csv``, the figure to
``bench/results/router_replay.png``.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import OrderedDict, deque
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
    CostGuard,
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


def with_preamble(trace: Sequence[TraceRequest], blocks: int) -> list[TraceRequest]:
    """The trace with ``blocks`` shared blocks in front of every request (keys above every key of the trace)."""
    if blocks == 0:
        return list(trace)
    base = 1 + max((h for r in trace for h in r.hash_ids), default=-1)
    pre = tuple(range(base, base + blocks))
    return [
        TraceRequest(r.timestamp, r.input_length + blocks * TOKENS_PER_BLOCK, r.output_length, pre + tuple(r.hash_ids))
        for r in trace
    ]


def ceiling_hit_rate(trace: Sequence[TraceRequest], capacity: int) -> float:
    cache = LruBlockCache(capacity)
    hit = total = 0
    for r in trace:
        hit += min(cache.access(r.hash_ids) * TOKENS_PER_BLOCK, r.input_length)
        total += r.input_length
    return hit / total


class Fleet:
    """``n`` servers, each computing its queue of prompt work first come, first served at ``rate`` tokens/s.

    Every ``sample_every_s`` of trace time it records each server's backlog (tokens still to compute) and the
    largest piece of work any one request still has, for the imbalance metrics of :meth:`summary`.
    """

    def __init__(self, n: int, rate: float, sample_every_s: float = 1.0) -> None:
        self.n = n
        self.rate = rate
        self.sample_every_s = sample_every_s
        self._drained_at = [0.0] * n  # when each server's queue empties
        self._jobs: list[deque[tuple[float, float]]] = [deque() for _ in range(n)]  # (finish time, work)
        self._next_sample = 0.0
        self._ratios: list[float] = []
        self._per_server: list[list[float]] = [[] for _ in range(n)]
        self._max_sum = self._mean_sum = self._floor_sum = 0.0
        self._samples = self._busy = 0
        self.waits: list[float] = []
        self.work = 0.0

    def backlog(self, s: int, t: float) -> float:
        return max(0.0, self._drained_at[s] - t) * self.rate

    def backlogs(self, t: float) -> list[float]:
        return [self.backlog(s, t) for s in range(self.n)]

    def add(self, s: int, t: float, work: float) -> float:
        """Queue ``work`` tokens on server ``s`` at time ``t``; returns when that prefill finishes."""
        self.sample_until(t)
        start = max(self._drained_at[s], t)
        self.waits.append(start - t)
        self._drained_at[s] = done = start + work / self.rate
        self._jobs[s].append((done, work))
        self.work += work
        return done

    def sample_until(self, t: float) -> None:
        while self._next_sample <= t:
            self._sample(self._next_sample)
            self._next_sample += self.sample_every_s

    def _sample(self, tau: float) -> None:
        b = self.backlogs(tau)
        largest = 0.0
        for jobs in self._jobs:
            while jobs and jobs[0][0] <= tau:
                jobs.popleft()
            for done, work in jobs:
                largest = max(largest, min(work, (done - tau) * self.rate))
        for v, series in zip(b, self._per_server):
            series.append(v)
        mean = sum(b) / self.n
        self._samples += 1
        self._max_sum += max(b)
        self._mean_sum += mean
        # No placement of the requests queued now can put less than the largest of them on one server.
        self._floor_sum += max(largest, mean)
        if mean >= TOKENS_PER_BLOCK:  # a fleet with less than one block queued on average counts as idle
            self._busy += 1
            self._ratios.append(max(b) / mean)

    def summary(self) -> dict[str, float]:
        means = [sum(v) / len(v) for v in self._per_server]
        p99s = [_p99(v) for v in self._per_server]
        weighted = self._mean_sum > 0
        return {
            "imbalance_mean": sum(self._ratios) / len(self._ratios) if self._ratios else float("nan"),
            "imbalance_p99": _p99(self._ratios),
            "imbalance_of_means": self._max_sum / self._mean_sum if weighted else float("nan"),
            "granularity_floor": self._floor_sum / self._mean_sum if weighted else float("nan"),
            "server_imbalance_mean": max(means) / (sum(means) / self.n),
            "server_imbalance_p99": max(p99s) / (sum(p99s) / self.n),
            "busy_fraction": self._busy / max(1, self._samples),
            "wait_mean_s": sum(self.waits) / len(self.waits),
            "wait_p99_s": _p99(self.waits),
        }


@dataclass
class ReplayResult:
    hit_rate: float
    rho: float  # uncached prompt tokens over the fleet's drain capacity during the trace
    imbalance_mean: float
    imbalance_p99: float
    imbalance_of_means: float
    granularity_floor: float
    server_imbalance_mean: float
    server_imbalance_p99: float
    busy_fraction: float
    wait_mean_s: float
    wait_p99_s: float
    lwl_imbalance_mean: float
    lwl_imbalance_of_means: float
    lwl_wait_mean_s: float
    seconds: float
    work: list[float]


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def least_work_left(trace: Sequence[TraceRequest], work: Sequence[float], n: int, rate: float) -> dict[str, float]:
    """The oracle: the same per-request work (a policy's own hits kept), each request on the server with the
    least true backlog (what a router with perfect knowledge of every queue would do, were hits free to keep)."""
    fleet = Fleet(n, rate)
    for r, w in zip(trace, work):
        t = r.timestamp / 1000.0
        b = fleet.backlogs(t)
        fleet.add(b.index(min(b)), t, w)
    return fleet.summary()


def replay(
    trace: Sequence[TraceRequest],
    make_router: Callable[[list[int], Callable[[], float]], Router],
    n_servers: int,
    blocks_per_server: int,
    rate_tokens_per_s: float,
    feed_events: bool,
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
    fleet = Fleet(n_servers, rate_tokens_per_s)
    done: list[tuple[float, int]] = []
    work: list[float] = []
    hit = total = 0
    for rid, r in enumerate(trace):
        t_s = r.timestamp / 1000.0
        fleet.sample_until(t_s)
        while done and done[0][0] <= t_s:
            t_done, done_id = heapq.heappop(done)
            now[0] = t_done
            router.finish(done_id)
        now[0] = t_s
        s = router.route(RouteRequest(request_id=rid, block_keys=r.hash_ids, num_tokens=r.input_length))
        cached = min(caches[s].access(r.hash_ids) * TOKENS_PER_BLOCK, r.input_length)
        hit += cached
        total += r.input_length
        work.append(r.input_length - cached)
        heapq.heappush(done, (fleet.add(s, t_s, r.input_length - cached), rid))
    while done:
        t_done, done_id = heapq.heappop(done)
        now[0] = t_done
        router.finish(done_id)
    leaked = sum(router.loads().values())
    if leaked:
        raise RuntimeError(f"router leaked load after every request finished: {router.loads()}")
    seconds = time.perf_counter() - t0
    duration = (trace[-1].timestamp - trace[0].timestamp) / 1000.0
    lwl = least_work_left(trace, work, n_servers, rate_tokens_per_s)
    return ReplayResult(
        hit_rate=hit / total,
        rho=fleet.work / (n_servers * rate_tokens_per_s * duration),
        **fleet.summary(),
        lwl_imbalance_mean=lwl["imbalance_mean"],
        lwl_imbalance_of_means=lwl["imbalance_of_means"],
        lwl_wait_mean_s=lwl["wait_mean_s"],
        seconds=seconds,
        work=work,
    )


def policies(
    blocks_per_server: int, guard: ImbalanceGuard, cost: CostGuard, router_rate: float
) -> dict[str, tuple[Callable, bool]]:
    """name -> (factory(servers, clock), consumes cache events).

    The "(min 1)" rows let a new conversation follow a one-block match: on this trace every prompt starts
    with the same block, so "always" then sends every new conversation after the previous one (the death
    spiral the imbalance guard exists for). The "+drain" rows are told the servers' prefill rate
    (``router_rate``: the simulated one times ``--router-rate-scale``).
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
    always = dict(common, new_conversation_follow="always")
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
    out["always+events+guard+drain"] = (
        lambda s, c: ConversationRouter(
            s, clock=c, use_cache_events=True, imbalance_guard=guard, prefill_tokens_per_s=router_rate, **always
        ),
        True,
    )
    out["always+events+cost"] = (
        lambda s, c: ConversationRouter(s, clock=c, use_cache_events=True, imbalance_guard=cost, **always),
        True,
    )
    out["always+events+cost+drain"] = (
        lambda s, c: ConversationRouter(
            s, clock=c, use_cache_events=True, imbalance_guard=cost, prefill_tokens_per_s=router_rate, **always
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
        nargs="+",
        default=[0.8],
        help="offered uncached load over the fleet's drain capacity (several values: a sweep)",
    )
    ap.add_argument(
        "--calibrate",
        choices=("ceiling", "policy"),
        default="ceiling",
        help="drain rate from the ceiling's hit rate (one rate for all policies) or from each policy's own hits",
    )
    ap.add_argument("--guard-rel", type=float, default=ImbalanceGuard.rel_slack)
    ap.add_argument("--guard-abs", type=int, default=ImbalanceGuard.abs_slack_tokens)
    ap.add_argument("--recompute-weight", type=float, default=CostGuard.recompute_weight)
    ap.add_argument(
        "--router-rate-scale",
        type=float,
        default=1.0,
        help="the +drain policy is told the simulated prefill rate times this (its error)",
    )
    ap.add_argument("--policies", nargs="*", default=None, help="subset of policy names")
    ap.add_argument(
        "--preamble-blocks",
        type=int,
        nargs="+",
        default=[0, 2],
        help="shared preamble in front of every request, in blocks (0: the trace as it is; several: one table each)",
    )
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    for u in args.utilisation:
        if not u > 0:
            ap.error(f"--utilisation: expected positive numbers, got {u}")
    if not args.router_rate_scale > 0:
        ap.error(f"--router-rate-scale: expected a positive number, got {args.router_rate_scale}")
    for p in args.preamble_blocks:
        if not 0 <= p <= 1024:
            ap.error(f"--preamble-blocks: expected block counts in [0, 1024], got {p}")

    path = args.trace or default_trace_path()
    if path is None or not path.exists():
        print(f"SKIP: trace not found at {path or '../shared/data/'} (set KVFORGE_TRACE); nothing to replay")
        return 0
    plain = load_trace(path)
    for pre in args.preamble_blocks:
        run_tables(args, with_preamble(plain, pre), pre)
    return 0


def run_tables(args: argparse.Namespace, trace: list[TraceRequest], preamble: int) -> None:
    """One table per utilisation and fleet size on ``trace`` (``preamble`` shared blocks in front of each)."""
    duration = (trace[-1].timestamp - trace[0].timestamp) / 1000.0
    prompt_tokens = sum(r.input_length for r in trace)
    guard = ImbalanceGuard(rel_slack=args.guard_rel, abs_slack_tokens=args.guard_abs)
    cost = CostGuard(recompute_weight=args.recompute_weight)
    print(
        f"\ntrace: {len(trace)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens over {duration:.0f} s; "
        f"shared preamble: {preamble} blocks"
    )

    rows = []
    table = []
    ceilings: dict[int, float] = {}
    for util in args.utilisation:
        for n in args.servers:
            capacity = n * args.blocks_per_server
            if n not in ceilings:
                ceilings[n] = ceiling_hit_rate(trace, capacity)
            ceiling = ceilings[n]
            rate = prompt_tokens * (1.0 - ceiling) / duration / (n * util)
            print(
                f"\n{n} servers, {capacity} blocks in all: ceiling {ceiling:.1%}; utilisation {util} "
                f"({args.calibrate}): drain rate {rate:.0f} tokens/s per server at the ceiling's hits"
            )
            header = (
                f"{'policy':<27}{'hit':>6}{'/ceil':>7}{'rho':>6}{'inst':>6}{'p99':>6}{'wtd':>6}{'floor':>6}"
                f"{'LWL':>6}{'srv':>6}{'p99':>6}{'wait':>9}{'LWL':>8}{'p99':>9}{'sec':>5}"
            )
            print(header)
            names = list(policies(args.blocks_per_server, guard, cost, rate))
            for name in names:
                if args.policies and name not in args.policies:
                    continue
                factory, events = policies(args.blocks_per_server, guard, cost, rate * args.router_rate_scale)[name]
                res = replay(trace, factory, n, args.blocks_per_server, rate, events)
                policy_rate = rate
                if args.calibrate == "policy":
                    # Same post-hit utilisation for every policy: a second pass at the rate its own hits call for.
                    policy_rate = sum(res.work) / duration / (n * util)
                    factory, events = policies(
                        args.blocks_per_server, guard, cost, policy_rate * args.router_rate_scale
                    )[name]
                    res = replay(trace, factory, n, args.blocks_per_server, policy_rate, events)
                frac = res.hit_rate / ceiling
                print(
                    f"{name:<27}{res.hit_rate:>6.1%}{frac:>7.1%}{res.rho:>6.2f}{res.imbalance_mean:>6.2f}"
                    f"{res.imbalance_p99:>6.2f}{res.imbalance_of_means:>6.2f}{res.granularity_floor:>6.2f}"
                    f"{res.lwl_imbalance_of_means:>6.2f}{res.server_imbalance_mean:>6.2f}"
                    f"{res.server_imbalance_p99:>6.2f}{res.wait_mean_s:>9.2f}{res.lwl_wait_mean_s:>8.2f}"
                    f"{res.wait_p99_s:>9.1f}{res.seconds:>5.1f}"
                )
                table.append((util, n, name, res, ceiling))
                rows.append(
                    {
                        "bench": "router_replay",
                        "servers": n,
                        "blocks_per_server": args.blocks_per_server,
                        "utilisation": util,
                        "calibrate": args.calibrate,
                        "preamble_blocks": preamble,
                        "drain_tokens_per_s": round(policy_rate, 1),
                        "policy": name,
                        "guard_rel": args.guard_rel if "guard" in name else "",
                        "guard_abs_tokens": args.guard_abs if "guard" in name else "",
                        "recompute_weight": args.recompute_weight if "cost" in name else "",
                        "router_rate_scale": args.router_rate_scale if "drain" in name else "",
                        "hit_rate": round(res.hit_rate, 5),
                        "ceiling_same_run": round(ceiling, 5),
                        "ceiling_readme": README_CEILINGS.get(capacity, "") if preamble == 0 else "",
                        "hit_over_ceiling": round(frac, 4),
                        "rho": round(res.rho, 4),
                        "imbalance_mean": round(res.imbalance_mean, 4),
                        "imbalance_p99": round(res.imbalance_p99, 4),
                        "imbalance_of_means": round(res.imbalance_of_means, 4),
                        "granularity_floor": round(res.granularity_floor, 4),
                        "lwl_imbalance_mean": round(res.lwl_imbalance_mean, 4),
                        "lwl_imbalance_of_means": round(res.lwl_imbalance_of_means, 4),
                        "server_imbalance_mean": round(res.server_imbalance_mean, 4),
                        "server_imbalance_p99": round(res.server_imbalance_p99, 4),
                        "busy_fraction": round(res.busy_fraction, 4),
                        "wait_mean_s": round(res.wait_mean_s, 4),
                        "wait_p99_s": round(res.wait_p99_s, 4),
                        "lwl_wait_mean_s": round(res.lwl_wait_mean_s, 4),
                        "replay_s": round(res.seconds, 2),
                    }
                )
    if not args.no_csv and rows:
        print(f"\nrows appended to {append_csv('router_replay', rows)}")
        name = "router_replay.png" if preamble == 0 else f"router_replay_preamble{preamble}.png"
        print(f"figure: {plot(table, RESULTS / name, preamble)}")


def plot(table: list, path: Path, preamble: int = 0) -> Path:
    """Grouped bars (one group per policy, one bar per fleet size) at the first utilisation, and, for a sweep,
    the backlog-weighted instantaneous imbalance against utilisation on the largest fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    utils = list(dict.fromkeys(row[0] for row in table))
    sizes = sorted({row[1] for row in table})
    names = list(dict.fromkeys(row[2] for row in table))
    by = {(row[0], row[1], row[2]): (row[3], row[4]) for row in table}
    u0 = utils[0]
    panels = [
        ("prefix-hit rate / same-capacity ceiling", lambda res, ceil: res.hit_rate / ceil, None, False, 0.9),
        ("max/mean of per-server time-mean backlog", lambda res, ceil: res.server_imbalance_mean, None, True, 1.3),
        (
            "instantaneous max/mean backlog, backlog-weighted\n(x: least-work-left oracle of the same work, "
            "-: granularity floor)",
            lambda res, ceil: res.imbalance_of_means,
            (lambda res: res.lwl_imbalance_of_means, lambda res: res.granularity_floor),
            True,
            1.3,
        ),
        (
            "mean queueing delay before prefill (s; x: oracle)",
            lambda res, ceil: res.wait_mean_s,
            (lambda res: res.lwl_wait_mean_s, None),
            True,
            None,
        ),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    axes = axes.ravel()
    width = 0.8 / len(sizes)
    for ax, (label, value, marks, log, target) in zip(axes, panels):
        for i, n in enumerate(sizes):
            xs = [k + (i - (len(sizes) - 1) / 2) * width for k in range(len(names))]
            cells = [by.get((u0, n, name)) for name in names]
            ys = [value(*c) if c else float("nan") for c in cells]
            ax.bar(xs, ys, width, label=f"{n} servers")
            if marks:
                oracle, floor = marks
                ax.scatter(xs, [oracle(c[0]) if c else float("nan") for c in cells], marker="x", color="k", s=14)
                if floor is not None:
                    ax.scatter(xs, [floor(c[0]) if c else float("nan") for c in cells], marker="_", color="r", s=60)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{label} (utilisation {u0})", fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    sweep = axes[4]
    if len(utils) > 1:
        n = sizes[-1]
        for name in names:
            pts = [(u, by[(u, n, name)][0]) for u in utils if (u, n, name) in by]
            if pts and pts[0][1].hit_rate / by[(pts[0][0], n, name)][1] > 0.8:
                sweep.plot([p.rho for _, p in pts], [p.imbalance_of_means for _, p in pts], "o-", label=name)
        spec = [by[(u, n, "specific")][0] for u in utils if (u, n, "specific") in by]
        if spec:
            sweep.plot(
                [p.rho for p in spec], [p.lwl_imbalance_of_means for p in spec], "k--", label="oracle (specific)"
            )
        sweep.axhline(1.3, color="grey", linestyle="--", linewidth=0.8)
        sweep.set_xlabel("post-hit utilisation", fontsize=8)
        sweep.set_title(f"backlog-weighted instantaneous max/mean vs load, {n} servers", fontsize=9)
        sweep.legend(fontsize=7)
    else:
        sweep.axis("off")
    axes[5].axis("off")
    title = "Mooncake conversation trace replay, 10,000 blocks of 512 tokens per server"
    if preamble:
        title += f", {preamble}-block shared preamble in front of every request"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
