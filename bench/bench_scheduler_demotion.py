"""Long-context demotion on one server: FCFS vs estimate-only demotion vs exact demotion, in one run.

Many short prompts mixed with a few very long ones go through the real :class:`~kvforge.scheduling.Scheduler`
over a real cache manager (``--cache hybrid``, the default: :class:`~kvforge.kvcache.hybrid.HybridCacheManager`
with one attention group and one recurrent-state group, so reuse needs a snapshot at the match end; or
``--cache attention``: a plain :class:`~kvforge.kvcache.KVCacheManager`), with prefix reuse and eviction, and
time advanced by a simple step-time model. Two workloads:

- ``synthetic``: the package's seeded multi-turn generator (:class:`kvforge.sim.workload.SyntheticWorkload`):
  growing conversations over shared system prompts, sub-agent forks, a few 24k-64k-token documents.
- ``mooncake``: the arrival pattern, lengths and prefix structure of windows of ``--requests`` consecutive
  requests of ``mooncake_conversation_trace.jsonl`` (read from ``$KVFORGE_TRACE`` or ``<repo>/../shared/data/``;
  skipped with a message when absent; never copied), the clock stretched by each of ``--time-scales``.

Each load setting is run on several samples (synthetic seeds, trace windows); the table and the figure give the
mean of each figure over the samples, the CSV one row per sample and policy.

The router's estimate of a request's uncached prefill (what estimate-only demotion sees) is what a
conversation-aware router knows: the prompt's growth since the conversation's previous prompt on this server,
or the whole prompt for a new conversation (forks and new conversations over a cached shared prefix are
over-estimated; turns whose prefix was evicted are under-estimated). The trace has no conversation ids: a
request continues the earlier request whose whole prompt is the longest prefix of its own.

Step-time model (per step, H200-like magnitudes for a large MLA model; the point is the ordering, not the
absolute numbers): ``base + prefill_per_token * context tokens + decode_per_request * generation requests +
kv_read_per_token * KV tokens the generation requests attend to``.

Figures per policy: short-request time to first token p50 / p99 (prompts <= ``--short-tokens``) and long-request
completion (arrival to last token, mean and p90, prompts >= ``--long-tokens``). Rows go to
``bench/results/scheduler_demotion.csv``, the figure to ``bench/results/scheduler_demotion.png``.

    python bench/bench_scheduler_demotion.py [--workloads synthetic mooncake] [--cache hybrid|attention]
        [--conversation-rates 0.8 1.2 1.6] [--seeds 0 1 2] [--time-scales 1.6 2.0 2.5] [--windows 0 4000 8000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, append_csv
from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, LifeCycle, RuntimeHooks, TierConfig
from kvforge.scheduling import Request, ScheduledBatch, Scheduler, SchedulerConfig
from kvforge.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    SyntheticWorkload,
    default_trace_path,
    load_mooncake_trace,
)

POLICIES = ("fcfs", "estimate", "exact")


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step from the batch's shape (see the module docstring)."""

    base_s: float = 0.004
    prefill_s_per_token: float = 40e-6  # 25k prefill tokens/s
    decode_s_per_request: float = 40e-6
    kv_read_s_per_token: float = 2e-9

    def __call__(self, batch: ScheduledBatch) -> float:
        ctx_tokens = 0
        for s in batch.context:
            ctx_tokens += s.num_tokens
        kv = 0
        for s in batch.generation:
            kv += s.start
        return (
            self.base_s
            + self.prefill_s_per_token * ctx_tokens
            + self.decode_s_per_request * len(batch.generation)
            + self.kv_read_s_per_token * kv
        )


def router_estimates(reqs: Sequence[SimRequest], tokens_per_block: int) -> list[int]:
    """Per request, the uncached prefill a conversation-aware router would estimate (module docstring)."""
    prev_by_conv: dict[str, int] = {}
    prompt_end: dict[int, int] = {}  # last full-block key of an earlier prompt -> its length
    out = []
    for r in reqs:
        if r.conversation_id is not None:
            prev = prev_by_conv.get(r.conversation_id, 0)
            prev_by_conv[r.conversation_id] = r.prompt_tokens
        else:
            prev = 0
            for k in reversed(r.block_keys):
                if k in prompt_end:
                    prev = prompt_end[k]
                    break
            if r.block_keys:
                prompt_end[r.block_keys[-1]] = r.prompt_tokens
        out.append(max(1, r.prompt_tokens - min(prev, r.prompt_tokens)))
    return out


def simulate(
    reqs: Sequence[SimRequest],
    estimates: Sequence[int],
    policy: str,
    *,
    tokens_per_block: int,
    gpu_pages: int,
    cfg: dict,
    model: StepTimeModel,
) -> tuple[list[Request], Scheduler, float]:
    mgr = make_manager(cfg["cache"], tokens_per_block, gpu_pages, cfg["state_pages"])
    now = [0.0]
    thr = 0 if policy == "fcfs" else cfg["threshold"]
    sched = Scheduler(
        mgr,
        SchedulerConfig(
            max_num_tokens=cfg["budget"],
            max_num_requests=cfg["max_requests"],
            demote_uncached_tokens=thr,
            demote_max_iters=cfg["max_iters"],
        ),
        hooks=RuntimeHooks(exact_context_demotion=policy == "exact"),
        clock=lambda: now[0],
    )
    out: list[Request] = []
    i, n = 0, len(reqs)
    while i < n or sched.has_unfinished:
        while i < n and reqs[i].arrival_s <= now[0]:
            r = reqs[i]
            req = Request(
                r.request_id,
                block_keys=r.block_keys,
                prompt_len=r.prompt_tokens,
                max_new_tokens=r.output_tokens,
                arrival_time=r.arrival_s,
                conversation_id=r.conversation_id,
                estimated_uncached_tokens=estimates[i],
            )
            sched.add_request(req)
            out.append(req)
            i += 1
        if not sched.has_unfinished:
            now[0] = reqs[i].arrival_s
            continue
        batch = sched.schedule()
        now[0] += model(batch)
        sched.on_step_done(batch)
    return out, sched, now[0]


def make_manager(kind: str, tokens_per_block: int, gpu_pages: int, state_pages: int) -> KVCacheManager:
    """``attention``: one attention pool group (the MLA latent); ``hybrid``: the hybrid manager with that group
    plus one recurrent-state group of ``state_pages`` states (snapshots at the prompt end and branch points,
    mid-chunk snapshots at the manager's alignment)."""
    if kind == "attention":
        cfg = KVCacheConfig(tokens_per_block, (LayerSpec(0, bytes_per_token=1),), (TierConfig(pages=gpu_pages),))
        return KVCacheManager(cfg)
    from kvforge.kvcache.hybrid import HybridCacheManager

    layers = (LayerSpec(0, bytes_per_token=1), LayerSpec(1, LifeCycle.recurrent(), state_bytes=1))
    cfg = KVCacheConfig(tokens_per_block, layers, (TierConfig(pages=(gpu_pages, state_pages)),))
    return HybridCacheManager(cfg)


def figures(done: Sequence[Request], short_tokens: int, long_tokens: int) -> dict[str, float]:
    short = [r.first_token_time - r.arrival_time for r in done if r.prompt_len <= short_tokens]
    long = [r.finish_time - r.arrival_time for r in done if r.prompt_len >= long_tokens]
    long_ttft = [r.first_token_time - r.arrival_time for r in done if r.prompt_len >= long_tokens]
    every = [r.first_token_time - r.arrival_time for r in done]
    return {
        "n_short": len(short),
        "n_long": len(long),
        "short_ttft_p50_s": float(np.percentile(short, 50)),
        "short_ttft_p99_s": float(np.percentile(short, 99)),
        "long_completion_mean_s": float(np.mean(long)),
        "long_completion_p90_s": float(np.percentile(long, 90)),
        "long_ttft_p50_s": float(np.percentile(long_ttft, 50)),
        "all_ttft_p50_s": float(np.percentile(every, 50)),
        "all_ttft_p99_s": float(np.percentile(every, 99)),
    }


FIGURES = ("short_ttft_p50_s", "short_ttft_p99_s", "long_completion_mean_s", "long_completion_p90_s")


def plot(path: Path, table: dict[str, dict[str, dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, axes = plt.subplots(len(names), len(FIGURES), figsize=(4 * len(FIGURES), 3.0 * len(names)))
    axes = np.atleast_2d(axes)
    for wi, w in enumerate(names):
        for fi, f in enumerate(FIGURES):
            ax = axes[wi, fi]
            vals = [table[w][p][f] for p in POLICIES]
            ax.bar(POLICIES, vals, color=["#999999", "#4c72b0", "#dd8452"])
            ax.set_title(f"{w}: {f}", fontsize=9)
            ax.set_ylabel("s")
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    fig.suptitle("Long-context demotion: FCFS vs estimate-only vs exact (lower is better)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workloads(args: argparse.Namespace) -> list[tuple[str, str, list[SimRequest], int, int, dict]]:
    """(setting, sample, requests, tokens per block, GPU pages, parameters): per load setting, one sample per
    synthetic seed or trace window. The trace is skipped with a message when it is absent."""
    out = []
    if "synthetic" in args.workloads:
        for rate in args.conversation_rates:
            for seed in args.seeds:
                w = SyntheticWorkload(
                    conversations=args.conversations,
                    seed=seed,
                    tokens_per_block=128,
                    conversation_rate_per_s=rate,
                    document_probability=0.05,
                )
                params = {"rate": rate, "seed": seed}
                out.append((f"synthetic@{rate:g}/s", f"seed {seed}", w.requests(), 128, args.kv_tokens // 128, params))
    if "mooncake" in args.workloads:
        path = default_trace_path()
        if path is None or not path.is_file():
            print(f"mooncake: trace not found ({path or 'set KVFORGE_TRACE or place it in ../shared/data/'}); skipped")
        else:
            full = load_mooncake_trace(path, limit=max(args.windows) + args.requests)
            pages = args.kv_tokens // MOONCAKE_BLOCK_TOKENS
            for scale in args.time_scales:
                for offset in args.windows:
                    window = full[offset : offset + args.requests]
                    if not window:
                        continue
                    t0 = window[0].arrival_s
                    reqs = [
                        SimRequest(i, (r.arrival_s - t0) * scale, r.prompt_tokens, r.output_tokens, r.block_keys)
                        for i, r in enumerate(window)
                    ]
                    params = {"time_scale": scale, "window": offset}
                    label = f"mooncake@x{scale:g}"
                    out.append((label, f"requests {offset}+", reqs, MOONCAKE_BLOCK_TOKENS, pages, params))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["synthetic", "mooncake"], choices=["synthetic", "mooncake"])
    ap.add_argument("--requests", type=int, default=2000, help="mooncake: requests per trace window")
    ap.add_argument(
        "--windows", type=int, nargs="+", default=[0, 4000, 8000], help="mooncake: first request of each window"
    )
    ap.add_argument(
        "--time-scales", type=float, nargs="+", default=[1.6, 2.0, 2.5], help="mooncake: stretch arrival times"
    )
    ap.add_argument("--conversations", type=int, default=400, help="synthetic: conversations")
    ap.add_argument(
        "--conversation-rates", type=float, nargs="+", default=[0.8, 1.2, 1.6], help="synthetic: conversations/s"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="synthetic: workload seeds")
    ap.add_argument("--kv-tokens", type=int, default=3_000_000, help="GPU KV capacity in tokens")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_tokens per step")
    ap.add_argument("--max-requests", type=int, default=128)
    ap.add_argument("--threshold", type=int, default=4096, help="demotion threshold (uncached tokens)")
    ap.add_argument("--max-iters", type=int, default=8, help="demoted iterations before a request keeps its place")
    ap.add_argument("--short-tokens", type=int, default=8192)
    ap.add_argument("--long-tokens", type=int, default=24_576)
    ap.add_argument("--cache", choices=["hybrid", "attention"], default="hybrid", help="cache manager")
    ap.add_argument("--state-pages", type=int, default=4096, help="hybrid: recurrent-state pages (live + snapshots)")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    cfg = {
        "budget": args.budget,
        "max_requests": args.max_requests,
        "threshold": args.threshold,
        "max_iters": args.max_iters,
        "cache": args.cache,
        "state_pages": args.state_pages,
    }
    model = StepTimeModel()
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    rows = []
    for name, sample, reqs, tpb, pages, params in workloads(args):
        est = router_estimates(reqs, tpb)
        per = samples.setdefault(name, {p: [] for p in POLICIES})
        for policy in POLICIES:
            t0 = time.perf_counter()
            done, sched, end_s = simulate(
                reqs, est, policy, tokens_per_block=tpb, gpu_pages=pages, cfg=cfg, model=model
            )
            wall = time.perf_counter() - t0
            fig = figures(done, args.short_tokens, args.long_tokens)
            st = sched.stats
            pw = sched.prefix_wait_stats
            extra = {
                "makespan_s": round(end_s, 2),
                "preemptions": st.preemptions,
                "deferrals": st.deferrals,
                "demotions": st.demotions,
                "probes": st.probes,
                "prefix_waits": pw.requests_waited,
                "prefill_tokens_computed": st.context_tokens,
                "sim_wall_s": round(wall, 2),
            }
            per[policy].append(fig)
            rows.append(
                {
                    "bench": "scheduler_demotion",
                    "workload": name,
                    "sample": sample,
                    "requests": len(reqs),
                    "policy": policy,
                    **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in fig.items()},
                    **extra,
                    **{f"cfg_{k}": v for k, v in cfg.items()},
                    "kv_tokens": args.kv_tokens,
                    **params,
                }
            )
            print(
                f"{name:14s} {sample:15s} {policy:8s} short ttft p50 {fig['short_ttft_p50_s']:7.3f}s"
                f" p99 {fig['short_ttft_p99_s']:7.3f}s | long completion mean {fig['long_completion_mean_s']:7.2f}s"
                f" p90 {fig['long_completion_p90_s']:7.2f}s | n_short {fig['n_short']} n_long {fig['n_long']}"
                f" | defer {st.deferrals} demote {st.demotions} probes {st.probes} preempt {st.preemptions}"
                f" waits {pw.requests_waited} | {wall:.1f}s wall"
            )
    # Each figure averaged over the samples of a setting: one trajectory moves a tail percentile by several
    # percent when two equivalent requests swap places, the mean over samples much less.
    table = {
        name: {p: {k: float(np.mean([f[k] for f in figs])) for k in figs[0]} for p, figs in per.items()}
        for name, per in samples.items()
    }
    if not table:
        print("nothing to report")
        return 0
    print()
    print("Means over the samples of each setting:")
    print(
        "| workload | policy | short TTFT p50 (s) | short TTFT p99 (s) | long completion mean (s) | long p90 (s) "
        "| all TTFT p50 (s) | all TTFT p99 (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for w, pol in table.items():
        for p, f in pol.items():
            print(
                f"| {w} | {p} | {f['short_ttft_p50_s']:.3f} | {f['short_ttft_p99_s']:.3f} | "
                f"{f['long_completion_mean_s']:.2f} | {f['long_completion_p90_s']:.2f} | "
                f"{f['all_ttft_p50_s']:.3f} | {f['all_ttft_p99_s']:.3f} |"
            )
    for w, pol in table.items():
        # Equal within 0.5% counts as a tie: a different but equivalent order of two same-size requests moves a
        # percentile by that much.
        worse = [f for f in FIGURES if pol["exact"][f] > pol["estimate"][f] * 1.005]
        better = pol["exact"]["short_ttft_p99_s"] < pol["fcfs"]["short_ttft_p99_s"]
        verdict = "not worse on any figure" if not worse else "worse on " + ", ".join(worse)
        print(
            f"{w}: exact vs estimate-only: {verdict};"
            f" exact short p99 {'improves on' if better else 'does NOT improve on'} FCFS"
        )
    if not args.no_csv:
        path = append_csv("scheduler_demotion", rows)
        png = RESULTS / "scheduler_demotion.png"
        plot(png, table)
        print(f"rows appended to {path}; figure {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
