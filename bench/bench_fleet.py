"""The fleet, measured and simulated: N ``kvforge serve`` engines behind ``kvforge router`` (KV events on),
replaying a slice of the conversation trace, for several router policies in the same run; then
``kvforge simulate``'s engine (with a measured step-time profile) on the same slice, printed side by side.

Workload: a slice of the Mooncake conversation trace (``$KVFORGE_TRACE`` or ``/work/shared/data``): the first
``--requests`` lines, or with ``--conversations N`` the first N multi-turn conversations (a request whose hash
ids extend an earlier one's continues it), up to ``--turns`` turns each, in turn-major order (all first turns,
then all second turns, ...: the trace's own turns are minutes apart, so a compressed replay keeps each turn after
the one before it). Each prompt built from its ``hash_ids`` as ``bench_engine`` does (block ``h`` is
``--block-tokens`` seeded-random token ids, the same ids wherever ``h`` appears), its length the trace's
``input_length`` scaled by ``block-tokens / 512`` and capped at ``--max-prompt``, its output
``min(output_length, --max-output)`` tokens. Arrivals are Poisson at ``--rate`` requests/s (seeded), the same
times for every policy and for the simulator. Each policy gets a fresh fleet (cold caches).

Measured per policy, at the client (streaming ``/v1/completions`` through the router, token-id prompts): TTFT
p50/p99 (send -> first chunk with a token), inter-token latency p50/p99 (gaps between token chunks, weighted by
tokens), prefix-hit rate (``usage.prompt_tokens_details.cached_tokens`` / prompt tokens, cross-checked against
the engines' ``kvforge_serve_prefix_hit_tokens_total``), throughput (output tokens / makespan). A run with a
failed request or a wrong token count is not reported. Simulated: the same figures from
:func:`kvforge.sim.simulator.simulate` with ``--profile`` (one simulated server per engine, the engine's pages
and budgets, decode quantum 1, snapshot policy ``lru``; policy ``conversation`` is the simulator's
``conversation-kv``), twice: ``simulated`` with the engines sharing one device (``--servers-per-device``, default all
of them, slowed down by the profile's measured contention curve or ``--shared-device-capacity``:
:mod:`kvforge.sim.contention`) and ``simulated-alone`` with each engine on a device of its own (the model before
the contention curve). Appends rows to ``bench/results/fleet.csv``, draws ``fleet_<tag>.png`` and writes the
slice and the measured figures to ``fleet_raw_<tag>.json`` (``--resimulate`` that file to compare another profile
with the same measurements, without running the fleet).

What the router adds to the time to first chunk, measured two ways (the engine reports its own time to first
token per request in the stream's ``: kvforge {"ttft_s": ...}`` comment: its handler entered -> first token
chunk written): ``router_gap`` = client TTFT - engine TTFT for each request of the replay (through the router,
at the slice's rate, under the fleet's load): the router's work plus the extra HTTP hop and the client's own
parsing; then, on the idle fleet after the replay, ``--probe`` pairs of one-token requests (fresh 16-token
prompts), one through the router and one sent directly to the engine that answered it, one at a time:
``router_added_p50_ms`` = p50(gap through the router) - p50(gap direct), which leaves only what the router adds.

Where the step-time model is off: every engine runs with ``--step-log``, and each real step of the replay is set
against the profile's fit for the same batch (``steps_measured_over_fit``: summed measured / summed fitted
seconds), next to what the contention curve predicts from how much the other engines' steps overlapped it
(``steps_contention_over_fit``) and the ratio for the steps that ran with no other engine stepping
(``steps_alone_measured_over_fit``: what contention between the engines cannot explain). On a GPU (``--warmup``)
each engine first runs three fresh prompts up to the slice's longest, so compilation stays out of the replay.

    python3 bench/bench_fleet.py --size tiny --profile bench/results/step_profile_cpu_tiny.json    # CPU
    python3 bench/bench_fleet.py --resimulate bench/results/fleet_raw_cpu_tiny.json --profile other.json
    STAGE=fleet PROFILE=... KVFORGE_TRACE=... bash bench/run_fleet_h200.sh $OUT     # H200 (after STAGE=profile)

``--budget-s`` bounds the run: a policy that would not finish in what is left (judged by the longest one so far)
is skipped and named. ``fleet.csv``, the PNG and ``fleet_raw_<tag>.json`` are written after every policy, so a run
stopped by a timeout keeps the policies it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import csv
import datetime as dt
import itertools
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
SIM_POLICY = {"conversation": "conversation-kv", "cache-aware": "cache-aware", "round-robin": "round-robin"}
METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "hit_rate", "throughput_tok_s")
SIM_SOURCES = ("simulated", "simulated-alone")  # engines sharing one device (contention curve); each alone
KVFORGE_COMMENT = b": kvforge "


def git_rev() -> str:
    from bench._common import git_revision

    return git_revision()


def percentile(values: list[float], q: float, weights: list[float] | None = None) -> float:
    from kvforge.sim.simulator import percentile as p

    return p(values, q, weights)


def load_slice(args) -> list[dict[str, Any]]:
    from kvforge.kvcache.replay import find_trace

    path = Path(
        os.environ.get("KVFORGE_TRACE") or find_trace() or "/work/shared/data/mooncake_conversation_trace.jsonl"
    )
    with path.open() as f:
        lines = [json.loads(line) for line in f]
    if args.conversations:
        # Conversations: a request whose hash ids extend an earlier one's (two ids or more) continues it.
        owner: dict[tuple[int, ...], int] = {}
        turns: dict[int, list[int]] = {}
        for i, r in enumerate(lines):
            ids = tuple(r["hash_ids"])
            c = next((owner[ids[:k]] for k in range(len(ids), 1, -1) if ids[:k] in owner), i)
            turns.setdefault(c, []).append(i)
            for k in range(2, len(ids) + 1):
                owner.setdefault(ids[:k], c)
        chosen = [c for c in sorted(turns) if c >= args.offset and len(turns[c]) >= 2][: args.conversations]
        # Turn-major order: every conversation's first turn, then every second turn, ...
        picked = [turns[c][t] for t in range(args.turns) for c in chosen if t < len(turns[c])]
        rows = [lines[i] for i in picked]
        args.slice_desc = (
            f"the first {len(chosen)} multi-turn conversations from line {args.offset} (up to {args.turns} turns "
            f"each, turn-major order: lines {picked[:6]}...)"
        )
    else:
        rows = lines[args.offset : args.offset + args.requests]
        args.slice_desc = f"trace lines {args.offset}..{args.offset + len(rows) - 1}"
    rng = random.Random(args.seed)
    t = 0.0
    reqs = []
    cache: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in cache:
            r = random.Random(h)
            cache[h] = [r.randrange(1, args.vocab) for _ in range(args.block_tokens)]
        return cache[h]

    for i, r in enumerate(rows):
        n = max(1, min(args.max_prompt, math.ceil(r["input_length"] * args.block_tokens / 512)))
        toks: list[int] = []
        for h in r["hash_ids"]:
            toks.extend(block(h))
            if len(toks) >= n:
                break
        while len(toks) < n:  # a trace line whose ids cover less than its length: a request-unique tail
            toks.append(random.Random(f"{i}/{len(toks)}").randrange(1, args.vocab))
        t += rng.expovariate(args.rate)
        reqs.append(
            {"id": i, "arrival_s": t, "prompt": toks[:n], "output": max(1, min(args.max_output, r["output_length"]))}
        )
    return reqs, path


def scrape(url: str) -> dict[str, float]:
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvforge_serve_") and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k] = float(v)
    return out


async def drive(router_url: str, reqs: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    import aiohttp

    results: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=3600, sock_read=600)

    async def one(s: aiohttp.ClientSession, r: dict[str, Any], t0: float) -> None:
        delay = t0 + r["arrival_s"] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = {"id": r["id"], "sent": time.perf_counter(), "first": None, "chunks": [], "tokens": 0, "cached": None,
               "error": None, "server": None, "engine_ttft": None}  # fmt: skip
        body = {"model": model, "prompt": r["prompt"], "max_tokens": r["output"], "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            async with s.post(router_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    rec["error"] = f"status {resp.status}: {(await resp.text())[:200]}"
                else:
                    async for line in resp.content:
                        now = time.perf_counter()
                        if line.startswith(KVFORGE_COMMENT):
                            rec["engine_ttft"] = json.loads(line[len(KVFORGE_COMMENT) :])["ttft_s"]
                            continue
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        msg = json.loads(line[6:])
                        rec["server"] = msg.get("system_fingerprint", rec["server"])
                        if msg.get("usage"):
                            rec["cached"] = msg["usage"]["prompt_tokens_details"]["cached_tokens"]
                        for c in msg.get("choices", []):
                            n = len(c.get("token_ids") or [])
                            if n:
                                if rec["first"] is None:
                                    rec["first"] = now
                                rec["chunks"].append((now, n))
                                rec["tokens"] += n
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["done"] = time.perf_counter()
        results.append(rec)

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter() + 0.2
        await asyncio.gather(*(one(s, r, t0) for r in reqs))
    return sorted(results, key=lambda x: x["id"])


async def probe_router(router_url: str, engines: dict[str, str], n: int, vocab: int, model: str) -> dict[str, float]:
    """``n`` pairs on the idle fleet, one request at a time: a fresh 16-token prompt through the router, then another
    directly to the engine that answered it (``max_tokens`` 1); per request, client TTFT - the engine's own TTFT
    (see the module docstring). Returns the two gaps' p50 and their difference, in ms."""
    import aiohttp

    rng = random.Random(12345)

    async def one(s: aiohttp.ClientSession, url: str) -> tuple[float, str]:
        body = {"model": model, "prompt": [rng.randrange(1, vocab) for _ in range(16)], "max_tokens": 1,
                "stream": True}  # fmt: skip
        sent = time.perf_counter()
        first = eng = None
        server = ""
        async with s.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"probe: status {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                now = time.perf_counter()
                if line.startswith(KVFORGE_COMMENT):
                    eng = json.loads(line[len(KVFORGE_COMMENT) :])["ttft_s"]
                elif line.startswith(b"data: {"):
                    msg = json.loads(line[6:])
                    server = msg.get("system_fingerprint", server)
                    if first is None and any(c.get("token_ids") for c in msg.get("choices", [])):
                        first = now
        if first is None or eng is None:
            raise RuntimeError("probe: no token or no engine timing in the stream")
        return first - sent - eng, server

    via, direct = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(n):
            gap, server = await one(s, router_url)
            via.append(gap)
            direct.append((await one(s, engines[server]))[0])
    p_via, p_direct = percentile(via, 50) * 1e3, percentile(direct, 50) * 1e3
    return {"probe_router_gap_p50_ms": p_via, "probe_direct_gap_p50_ms": p_direct,
            "router_added_p50_ms": p_via - p_direct, "probe_pairs": n}  # fmt: skip


async def warm(urls: list[str], lengths: list[int], vocab: int, model: str) -> None:
    """One-time costs out of the replay: each engine (directly, not through the router) runs one fresh prompt of
    each length (on a GPU, the first prompt of a new size compiles kernels and captures graphs)."""
    import aiohttp

    rng = random.Random(999)

    async def one_engine(s: aiohttp.ClientSession, url: str) -> None:
        for n in lengths:
            body = {"model": model, "prompt": [rng.randrange(1, vocab) for _ in range(n)], "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"warm-up: {url} answered {resp.status}: {(await resp.text())[:200]}")
                await resp.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await asyncio.gather(*(one_engine(s, u) for u in urls))


def step_analysis(log_dir: Path, profile, contention, window: tuple[float, float]) -> dict[str, float]:
    """The fleet's real steps (``kvforge serve --step-log``) set against the profile: for each step inside the
    replay's window (``time.monotonic``), measured / fitted seconds, and how much of it other engines' steps
    overlapped (``others``: overlap seconds / own seconds, 0 .. engines - 1). Returned: the ratio of summed
    measured to summed fitted seconds for the steps that ran alone (``others`` < 0.05), for all steps, and what
    the contention curve predicts for all steps (fitted x slowdown(1 + others), the curve interpolated)."""
    from kvforge.sim.profile import step_features

    steps = []
    for i, path in enumerate(sorted(log_dir.glob("steps_*.jsonl"))):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if window[0] <= r["t0"] and r["t1"] <= window[1]:
                fit = profile.seconds(step_features([tuple(c) for c in r["prefill"]], r["decode_requests"],
                                                    r["decode_context"]))  # fmt: skip
                steps.append((i, r["t0"], r["t1"], fit))
    if not steps:
        return {}

    def slowdown(k: float) -> float:
        if contention is None:
            return 1.0
        lo = max(1, math.floor(k))
        return contention.factor(lo) + (k - lo) * (contention.factor(lo + 1) - contention.factor(lo))

    # One engine's steps run one after another: sorted by start they are sorted by end too, so the steps of engine
    # e that overlap [t0, t1] are one run of its list (bisect), all inside but for the first and last.
    by_engine: dict[int, tuple[list[float], list[float], list[float]]] = {}
    for e in {x[0] for x in steps}:
        mine = sorted((b0, b1) for eng, b0, b1, _ in steps if eng == e)
        starts, ends = [b0 for b0, _ in mine], [b1 for _, b1 in mine]
        by_engine[e] = (starts, ends, [0.0, *itertools.accumulate(b1 - b0 for b0, b1 in mine)])

    def overlap(e: int, t0: float, t1: float) -> float:
        starts, ends, cum = by_engine[e]
        lo, hi = bisect.bisect_right(ends, t0), bisect.bisect_left(starts, t1)
        if lo >= hi:
            return 0.0
        return cum[hi] - cum[lo] - max(0.0, t0 - starts[lo]) - max(0.0, ends[hi - 1] - t1)

    alone_m = alone_f = all_m = all_f = pred = 0.0
    n_alone = 0
    for eng, t0, t1, fit in steps:
        dur = max(t1 - t0, 1e-9)
        others = sum(overlap(e, t0, t1) for e in by_engine if e != eng) / dur
        all_m += dur
        all_f += fit
        pred += fit * slowdown(1 + others)
        if others < 0.05:
            n_alone += 1
            alone_m += dur
            alone_f += fit
    return {"steps_logged": len(steps), "steps_alone": n_alone,
            "steps_alone_measured_over_fit": alone_m / alone_f if alone_f else float("nan"),
            "steps_measured_over_fit": all_m / all_f, "steps_contention_over_fit": pred / all_f}  # fmt: skip


def summarize(reqs, res) -> dict[str, float]:
    bad = [x for x in res if x["error"] or x["tokens"] != reqs[x["id"]]["output"] or x["cached"] is None
           or x["engine_ttft"] is None]  # fmt: skip
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed or returned the wrong token count, e.g. {bad[0]}")
    ttft = [x["first"] - x["sent"] for x in res]
    gaps, weights = [], []
    for x in res:
        prev = x["first"]
        for t, n in x["chunks"][1:]:
            gaps.append((t - prev) / n)
            weights.append(n)
            prev = t
    prompt = sum(len(r["prompt"]) for r in reqs)
    out = sum(x["tokens"] for x in res)
    span = max(x["done"] for x in res) - min(x["sent"] for x in res)
    gap = [x["first"] - x["sent"] - x["engine_ttft"] for x in res]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "engine_ttft_p50_s": percentile([x["engine_ttft"] for x in res], 50),
        "router_gap_p50_ms": percentile(gap, 50) * 1e3,
        "router_gap_p99_ms": percentile(gap, 99) * 1e3,
        "itl_p50_ms": percentile(gaps, 50, weights) * 1e3 if gaps else float("nan"),
        "itl_p99_ms": percentile(gaps, 99, weights) * 1e3 if gaps else float("nan"),
        "hit_rate": sum(x["cached"] for x in res) / prompt,
        "throughput_tok_s": out / span,
        "makespan_s": span,
    }


def contention_for(args, profile):
    """The slowdown curve of engines sharing the device: ``--shared-device-capacity``, else the profile's; None
    when there is neither (the shared-device simulation is then skipped)."""
    from kvforge.sim.contention import Contention

    if args.shared_device_capacity is not None:
        return Contention.from_capacity(args.shared_device_capacity)
    return profile.contention


def simulate_slice(reqs, args, profile, policy: str, shared: bool) -> dict[str, Any]:
    from kvforge.kvcache import hashing
    from kvforge.sim.simulator import SimConfig, simulate
    from kvforge.sim.workload import SimRequest

    tpb = profile.engine["tokens_per_block"]
    sim_reqs = [
        SimRequest(
            r["id"],
            r["arrival_s"],
            len(r["prompt"]),
            r["output"],
            tuple(hashing.block_keys(r["prompt"], tpb)),
            None,
            "trace",
        )
        for r in reqs
    ]
    gib, frac = profile.cache_size()
    cfg = SimConfig(
        servers=args.engines,
        model=profile.model,
        cache_gib=gib,
        state_fraction=frac,
        tokens_per_block=tpb,
        snapshot_policy="lru",
        max_num_tokens=profile.engine["max_num_tokens"],
        max_num_requests=profile.engine["max_num_requests"],
        decode_quantum=1,
        step_profile=profile,
        servers_per_device=min(args.servers_per_device or args.engines, args.engines) if shared else 1,
        contention=contention_for(args, profile) if shared else None,
    )
    r = simulate(sim_reqs, cfg, SIM_POLICY[policy])
    return {
        "ttft_p50_s": r.ttft_p50,
        "ttft_p99_s": r.ttft_p99,
        "itl_p50_ms": r.itl_p50 * 1e3,
        "itl_p99_ms": r.itl_p99 * 1e3,
        "hit_rate": r.hit_rate,
        "throughput_tok_s": r.throughput_tok_s,
        "makespan_s": r.makespan_s,
        "steps": r.steps,
        "step_mean_s": r.step_s / max(1, r.steps),
        "step_alone_mean_s": r.busy_s / max(1, r.steps),
        "contention": ",".join(f"{x:.3g}" for x in cfg.contention.slowdown) if cfg.contention else "",
    }


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    shown = (("ttft_p50_s", "TTFT p50 (s)"), ("hit_rate", "prefix-hit rate"), ("throughput_tok_s", "output tok/s"),
             ("itl_p50_ms", "ITL p50 (ms)"))  # fmt: skip
    sources = [src for src in ("measured", *SIM_SOURCES) if any(r["source"] == src for r in rows)]
    w = 0.8 / len(sources)
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
    for ax, (key, label) in zip(axes, shown):
        for j, src in enumerate(sources):
            vals = [
                next((r[key] for r in rows if r["policy"] == p and r["source"] == src), float("nan")) for p in policies
            ]
            ax.bar([i + w * j for i in range(len(policies))], vals, w, label=src)
        ax.set_xticks([i + w * (len(sources) - 1) / 2 for i in range(len(policies))], policies, rotation=15)
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 170)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(rows: list[dict[str, Any]], policies: list[str]) -> None:
    """Print predicted against measured, per simulated source, and the policies against round-robin."""
    for src in SIM_SOURCES:
        sims = [r for r in rows if r["source"] == src]
        if not sims or (src == "simulated" and not sims[0]["contention"]):  # a copy of the alone rows
            continue
        how = (f"engines sharing one device, slowdown by k busy {sims[0]['contention']}" if src == "simulated"
               else "each engine on a device of its own (no contention)")  # fmt: skip
        print(f"\npredicted vs measured, {src} ({how}; simulated / measured - 1):")
        print(f"  {'policy':13s} " + " ".join(f"{k:>22s}" for k in METRICS))
        for policy in policies:
            mr = next(r for r in rows if r["policy"] == policy and r["source"] == "measured")
            sr = next(r for r in sims if r["policy"] == policy)
            cells = []
            for k in METRICS:
                a, b = float(mr[k]), float(sr[k])
                rel = (b / a - 1) if a else float("nan")
                cells.append(f"{b:8.3g}/{a:<8.3g}{rel:+5.0%}")
            print(f"  {policy:13s} " + " ".join(f"{c:>22s}" for c in cells))
    base = next((r for r in rows if r["policy"] == "round-robin" and r["source"] == "measured"), None)
    if base is not None:
        for r in rows:
            if r["source"] == "measured" and r["policy"] != "round-robin":
                a, b = float(r["ttft_p50_s"]), float(base["ttft_p50_s"])
                print(f"  {r['policy']} vs round-robin (measured): hit rate {float(r['hit_rate']):.3f} vs "
                      f"{float(base['hit_rate']):.3f}, TTFT p50 {a:.3f} s vs {b:.3f} s ({b / a:.2f}x)")  # fmt: skip


def run_simulations(reqs, args, profile, policy: str, stamp: dict[str, Any], measured: dict[str, Any]) -> list[dict]:
    """The simulated rows of one policy (shared device when there is a curve, then each engine alone)."""
    rows = []
    for src in SIM_SOURCES:
        shared = src == "simulated"
        if shared and (args.engines < 2 or contention_for(args, profile) is None or args.servers_per_device == 1):
            continue  # nothing shares a device (or no curve to share it by): the alone row is the simulation
        sim = simulate_slice(reqs, args, profile, policy, shared)
        print(f"  {src:15s} {policy:13s} " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in sim.items()), flush=True)  # fmt: skip
        rows.append({"policy": policy, "source": src, **sim, **stamp, "sim_policy": SIM_POLICY[policy]})
        if "engine_step_mean_s" in measured:
            print(f"    steps ({src}): {measured['engine_steps']:.0f} measured, mean "
                  f"{measured['engine_step_mean_s'] * 1e3:.0f} ms, against {sim['steps']} simulated, mean "
                  f"{sim['step_mean_s'] * 1e3:.0f} ms ({sim['step_alone_mean_s'] * 1e3:.0f} ms alone)")  # fmt: skip
    if not any(r["source"] == "simulated" for r in rows):  # the notebook and the plot read "simulated"
        rows.append({**rows[-1], "source": "simulated"})
    return rows


def write_csv(rows: list[dict[str, Any]], out: Path) -> Path:
    """Append ``rows`` to ``out/fleet.csv`` (an older layout is rewritten under the current header)."""
    path = out / "fleet.csv"
    cols = ["date", "git_rev", "machine", "torch", "size", "engines", "policy", "source", *METRICS, "makespan_s",
            "engine_hit_rate", "requests_per_engine", "engine_ttft_mean_s", "client_ttft_mean_s",
            "engine_ttft_p50_s", "router_gap_p50_ms", "router_gap_p99_ms", "probe_router_gap_p50_ms",
            "probe_direct_gap_p50_ms", "router_added_p50_ms", "engine_step_mean_s", "engine_steps",
            "steps_measured_over_fit", "steps_contention_over_fit", "steps_alone", "steps_alone_measured_over_fit",
            "steps",
            "step_mean_s", "step_alone_mean_s", "contention", "sim_policy", "requests", "rate_req_s",
            "block_tokens", "max_prompt", "max_output", "seed", "offset", "slice", "load_avg_1m"]  # fmt: skip
    old: list[dict[str, str]] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != cols:  # an older layout: rewrite it under the new header (blank new columns)
                old = list(reader)
    with path.open("w" if old or not path.exists() else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        if old or f.tell() == 0:
            w.writeheader()
        for r in [*old, *rows]:
            w.writerow(r)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--policies", default="conversation,cache-aware,round-robin")
    ap.add_argument("--requests", type=int, default=40, help="trace lines in the slice (without --conversations)")
    ap.add_argument(
        "--conversations", type=int, default=0, help="slice = the first N multi-turn conversations (0: lines)"
    )
    ap.add_argument("--turns", type=int, default=4, help="turns kept per conversation (with --conversations)")
    ap.add_argument("--offset", type=int, default=0, help="first trace line of the slice")
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per trace hash id (the trace's is 512)")
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path, required=True, help="step profile of the same engine (profile_step_time)")
    ap.add_argument(
        "--servers-per-device",
        type=int,
        default=None,
        help="engines per shared device in the simulation (default: all of them, as in one machine)",
    )
    ap.add_argument(
        "--shared-device-capacity",
        type=float,
        default=None,
        metavar="C",
        help="simulate shared devices as processor sharing of capacity C instead of the profile's curve",
    )
    ap.add_argument("--probe", type=int, default=20, help="router-overhead probe pairs after each policy's replay")
    ap.add_argument(
        "--warmup",
        type=int,
        choices=(0, 1),
        default=None,
        help="1: before each replay, every engine runs 3 fresh prompts up to the slice's longest "
        "(default 1 on a GPU, 0 on the CPU, where nothing compiles)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-time budget in seconds: a policy that would not finish in what is left (judged by the longest "
        "one so far) is skipped and named (default: no budget)",
    )
    ap.add_argument("--serve-arg", action="append", default=[], help="extra kvforge serve flag (repeat)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for fleet.csv, the PNG and the raw JSON")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine and router logs (default: a temp folder)")
    ap.add_argument("--tag", default=None, help="file-name tag (default: cpu_tiny / gpu_real)")
    ap.add_argument(
        "--resimulate",
        type=Path,
        default=None,
        metavar="RAW",
        help="no fleet: take the slice and measurements from RAW (fleet_raw_<tag>.json) and simulate",
    )
    ap.add_argument(
        "--resimulate-csv",
        action="store_true",
        help="with --resimulate: append the comparison to --out's fleet.csv as a run of its own, and plot it",
    )
    args = ap.parse_args()
    start_time = time.monotonic()
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        ap.error(f"--budget-s: expected a number of seconds > 0, got {args.budget_s}")
    # A timeout's SIGTERM unwinds like Ctrl-C, so the fleet's engines and router are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from kvforge.sim.profile import load_profile

    profile = load_profile(args.profile)
    pdata = json.loads(args.profile.read_text())
    fit, pmeta, pcont = pdata.get("fit", {}), pdata.get("meta", {}), pdata.get("contention", {})
    curve = [round(x, 3) for x in profile.contention.slowdown] if profile.contention else None
    prof_line = (f"  profile: {args.profile} (fit over {fit.get('samples')} steps: median |rel err| "
                 f"{fit.get('median_abs_rel_err', float('nan')):.1%}; engine {dict(profile.engine)}; load avg "
                 f"{pmeta.get('load_avg_start', ['?'])[0]} -> {pmeta.get('load_avg_end', ['?'])[0]}; contention "
                 f"slowdown by k {curve}, alone drift {pcont.get('alone_drift', float('nan')):.2f}x)")  # fmt: skip
    if args.resimulate is not None:
        raw = json.loads(args.resimulate.read_text())
        for k in ("engines", "servers_per_device", "shared_device_capacity"):
            if k in raw["args"] and getattr(args, k) in (None, ap.get_default(k)):
                setattr(args, k, raw["args"][k])
        reqs, stamp = raw["requests"], raw["stamp"]
        print(f"bench_fleet --resimulate {args.resimulate}: the fleet run of {stamp['date']} (rev {stamp['git_rev']},"
              f" {stamp['machine']}, {args.engines} engines); simulator at rev {git_rev()}")  # fmt: skip
        print(prof_line)
        rows = []
        # A re-simulation is a run of its own in fleet.csv: today's date and revision, the slice's measured rows
        # copied, and the slice column saying which fleet run they are from.
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        stamp = {**stamp, "date": when, "git_rev": git_rev(),
                 "slice": f"{stamp['slice']}; re-simulated with {args.profile.name} from the fleet run of "
                          f"{raw['stamp']['date']} (rev {raw['stamp']['git_rev']})"}  # fmt: skip
        for policy, m in raw["measured"].items():
            rows.append({"policy": policy, "source": "measured", **m, **stamp})
            rows += run_simulations(reqs, args, profile, policy, stamp, m)
        compare(rows, list(raw["measured"]))
        if args.resimulate_csv:
            args.out.mkdir(parents=True, exist_ok=True)
            png = args.out / f"{args.resimulate.stem.replace('fleet_raw_', 'fleet_')}_resim.png"
            plot(rows, png, f"fleet run of {raw['stamp']['date']} (rev {raw['stamp']['git_rev']}, "
                 f"{raw['stamp']['machine']}) re-simulated at rev {git_rev()} with {args.profile.name}")  # fmt: skip
            print(f"\nwrote {write_csv(rows, args.out)} and {png}")
        return

    from kvforge.serve.fleet import LocalFleet

    args.vocab = 256 if args.size == "tiny" else 32768
    reqs, trace = load_slice(args)
    import torch

    if args.warmup is None:
        args.warmup = int(torch.cuda.is_available())

    machine = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    )
    tag = args.tag or f"{'gpu' if torch.cuda.is_available() else 'cpu'}_{args.size}"
    eng = profile.engine
    from kvforge.service.testing import build_tokenizer

    # The router takes KV events only with a tokenizer (it keys text by it); prompts here are token ids, so any
    # tokenizer of the model's vocabulary does: a word-level one of exactly that size (words + UNK + 3 roles).
    tok = build_tokenizer(Path(tempfile.mkdtemp(prefix="kvforge-fleet-tok-")) / "tokenizer.json", args.vocab - 4)
    serve = ["--model", args.size, "--tokenizer", str(tok), "--tokens-per-block", str(eng["tokens_per_block"]),
             "--attention-pages", str(eng["attention_pages"]), "--state-pages", str(eng["state_pages"]),
             "--max-num-tokens", str(eng["max_num_tokens"]), "--max-num-requests", str(eng["max_num_requests"]),
             "--draft-pages", str(eng["attention_pages"]), "--max-blocks-per-request",
             str(eng.get("max_blocks_per_request", 128)), *args.serve_arg]  # fmt: skip
    router = ["--tokenizer", str(tok), "--tokens-per-block", str(eng["tokens_per_block"]), "--health-interval-s", "1"]
    prompt_tokens = sum(len(r["prompt"]) for r in reqs)
    desc = (f"{len(reqs)} requests ({args.slice_desc} of {trace.name}), "
            f"{prompt_tokens} prompt / {sum(r['output'] for r in reqs)} output tokens, Poisson {args.rate:g} req/s "
            f"(seed {args.seed}), {args.block_tokens} tokens per hash id, prompts <= {args.max_prompt}")  # fmt: skip
    print(f"bench_fleet: {args.engines} x kvforge serve --model {args.size} on {machine}, rev {git_rev()}")
    print(f"  slice: {desc}")
    print(prof_line, flush=True)
    rows: list[dict[str, Any]] = []
    stamp = {"machine": machine, "torch": torch.__version__, "git_rev": git_rev(),
             "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "load_avg_1m": os.getloadavg()[0],
             "engines": args.engines, "size": args.size, "requests": len(reqs), "rate_req_s": args.rate,
             "block_tokens": args.block_tokens, "max_prompt": args.max_prompt, "max_output": args.max_output,
             "seed": args.seed, "offset": args.offset, "slice": args.slice_desc}  # fmt: skip
    measured: dict[str, dict[str, Any]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    raw_path = args.out / f"fleet_raw_{tag}.json"
    keep = ("engines", "servers_per_device", "shared_device_capacity", "rate", "seed", "profile")
    policies = args.policies.split(",")
    png = args.out / f"fleet_{tag}.png"
    title = f"kvforge serve x{args.engines} ({args.size}) + router on {machine}, rev {git_rev()}: {desc}"
    done: list[str] = []
    took: list[float] = []
    for policy in policies:
        if args.budget_s is not None and took:
            # The policies take about the same time (same slice, fresh fleet each): the longest so far, plus slack.
            need = 1.15 * max(took) + 15.0
            left = args.budget_s - (time.monotonic() - start_time)
            if need > left:
                skipped = policies[len(done) :]
                print(f"!! budget: skipped {', '.join(skipped)}: a policy took up to {max(took):.0f} s, "
                      f"{left:.0f} s left of --budget-s {args.budget_s:g}", flush=True)  # fmt: skip
                break
        log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="kvforge-fleet-"))) / policy
        t0 = time.perf_counter()
        load_start = os.getloadavg()[0]
        step_log = ["--step-log", str(log_dir / "steps_{instance}.jsonl")]
        with LocalFleet(args.engines, log_dir, [*serve, *step_log], router, policy=policy) as fleet:
            if args.warmup:
                top = max(len(r["prompt"]) for r in reqs)
                asyncio.run(warm([e.url for e in fleet.engines], [max(1, top // 8), max(1, top // 2), top],
                                 args.vocab, args.size))  # fmt: skip
            start = time.perf_counter() - t0
            before = [scrape(e.url) for e in fleet.engines]
            window = (time.monotonic(), 0.0)
            res = asyncio.run(drive(fleet.router_url, reqs, args.size))
            window = (window[0], time.monotonic())
            after = [scrape(e.url) for e in fleet.engines]
            probe = (asyncio.run(probe_router(fleet.router_url, {e.name: e.url for e in fleet.engines}, args.probe,
                                              args.vocab, args.size)) if args.probe else {})  # fmt: skip
        m: dict[str, Any] = summarize(reqs, res)
        m.update(probe)
        m.update(step_analysis(log_dir, profile, contention_for(args, profile), window))
        hits = sum(a["kvforge_serve_prefix_hit_tokens_total"] - b["kvforge_serve_prefix_hit_tokens_total"]
                   for a, b in zip(after, before))  # fmt: skip
        m["engine_hit_rate"] = hits / prompt_tokens

        def delta(name: str, after=after, before=before) -> float:
            return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))

        # Where the time goes: the engines' own TTFT against the client's, and the mean engine step in the fleet
        # (wall time of Engine.step in the serving loop: the profile timed one engine alone).
        m["engine_ttft_mean_s"] = delta("kvforge_serve_ttft_seconds_sum") / max(
            1.0, delta("kvforge_serve_ttft_seconds_count")
        )
        m["client_ttft_mean_s"] = sum(x["first"] - x["sent"] for x in res) / len(res)
        m["engine_step_mean_s"] = delta("kvforge_serve_step_seconds_total") / max(
            1.0, delta("kvforge_serve_steps_total")
        )
        m["engine_steps"] = delta("kvforge_serve_steps_total")
        per = {}
        for x in res:
            per[x["server"]] = per.get(x["server"], 0) + 1
        m["requests_per_engine"] = "/".join(str(per.get(f"engine{i}", 0)) for i in range(args.engines))
        m["load_avg_1m"] = f"{load_start:.2f}->{os.getloadavg()[0]:.2f}"
        print(f"  measured        {policy:13s} start-up {start:.0f} s, " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items()), flush=True)  # fmt: skip
        print(f"    router ({policy}): client TTFT - engine TTFT during the replay p50 {m['router_gap_p50_ms']:.2f} ms"
              f" (p99 {m['router_gap_p99_ms']:.2f}); idle probe ({m.get('probe_pairs', 0)} pairs): "
              f"{m.get('probe_router_gap_p50_ms', float('nan')):.2f} ms through the router, "
              f"{m.get('probe_direct_gap_p50_ms', float('nan')):.2f} ms direct: the router adds "
              f"{m.get('router_added_p50_ms', float('nan')):.2f} ms p50", flush=True)  # fmt: skip
        if "steps_logged" in m:
            print(f"    steps vs the profile ({policy}): {m['steps_logged']} steps in the replay, measured / fitted "
                  f"{m['steps_measured_over_fit']:.2f} (the contention curve predicts "
                  f"{m['steps_contention_over_fit']:.2f}); the {m['steps_alone']} that ran alone: "
                  f"{m['steps_alone_measured_over_fit']:.2f}", flush=True)  # fmt: skip
        measured[policy] = m
        # Written after every policy, so a later failure keeps the measurements (see --resimulate).
        raw = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in keep},
               "stamp": stamp, "requests": reqs, "measured": measured}  # fmt: skip
        raw_path.write_text(json.dumps(raw) + "\n")
        new = [{"policy": policy, "source": "measured", **stamp, **m}]
        new += run_simulations(reqs, args, profile, policy, stamp, m)
        rows += new
        done.append(policy)
        took.append(time.perf_counter() - t0)
        # The CSV and the figure grow policy by policy too: a run stopped by a timeout keeps what it finished.
        path = write_csv(new, args.out)
        plot(rows, png, title)
        print(f"  {policy}: {took[-1]:.0f} s in all; wrote {path}, {png} and {raw_path} ({len(done)} of "
              f"{len(policies)} policies, {time.monotonic() - start_time:.0f} s since the start)",
              flush=True)  # fmt: skip
    compare(rows, done)


if __name__ == "__main__":
    main()
