"""``kvforge simulate``: replay a workload through the real router, schedulers and cache managers.

With no arguments it runs the embedded default: a seeded synthetic multi-turn workload on a small fleet,
comparing three router policies. Bad input ends with one ``kvforge simulate: error: ...`` line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvforge.sim.model import KIMI_K3_LIKE, Throughputs, load_model
from kvforge.sim.report import PlotUnavailableError, format_summary, write_csv, write_load_csv, write_plots
from kvforge.sim.server import SNAPSHOT_POLICIES, snapshot_policies
from kvforge.sim.simulator import ROUTER_POLICIES, SimConfig, SimulationError, simulate
from kvforge.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    SyntheticWorkload,
    TraceFormatError,
    default_trace_path,
    describe,
    load_mooncake_trace,
)

__all__ = ["DEFAULT_POLICIES", "add_arguments", "main", "run"]

DEFAULT_POLICIES = "conversation,conversation-events,cache-aware,round-robin"


LEGEND = """
  hit        prompt tokens reused from the server's cache when the request was first admitted
  computed   prefill tokens computed (recomputation after preemption included); saved: tokens reused, all admissions
  snapshots  recurrent-state snapshots taken / held when the run ended / prompt tokens whose attention KV was
             cached but could not be reused for want of a snapshot there (hybrid manager only)
  TTFT, ITL  simulated time: roofline step times at measured single-kernel H200 peaks, so optimistic; ITL is per
             token at the drafter's expected acceptance; out tok/s is bounded by the arrival rate when not loaded
  imbalance  max / mean of the servers' busy time"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"kvforge simulate: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        metavar="PATH",
        help="Mooncake-format JSONL trace ('mooncake': the shared conversation trace); default: synthetic",
    )
    w.add_argument("--limit", type=_positive_int, metavar="N", help="replay only the first N requests")
    w.add_argument("--conversations", type=_positive_int, default=None, help="synthetic conversations (default 400)")
    w.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    w.add_argument(
        "--speedup",
        type=_positive_float,
        default=1.0,
        help="divide every arrival time by this (load the fleet harder; default 1)",
    )
    f = p.add_argument_group("fleet")
    f.add_argument("--servers", type=_positive_int, default=None, help="servers (default 4; 8 with --trace)")
    f.add_argument(
        "--router",
        default=DEFAULT_POLICIES,
        metavar="POLICY[,POLICY...]",
        help=f"router policies to compare, or 'all' (default {DEFAULT_POLICIES}); one of: {', '.join(ROUTER_POLICIES)}",
    )
    f.add_argument("--cache-gib", type=_positive_float, default=None, help="KV cache GiB per server (default 64)")
    f.add_argument(
        "--state-fraction",
        type=float,
        default=0.5,
        help="share of the cache for recurrent states: live + snapshots (default 0.5)",
    )
    f.add_argument("--model", default=KIMI_K3_LIKE.name, help="'kimi-k3-like' (default) or a JSON file of fields")
    f.add_argument(
        "--snapshot-policy",
        default=None,
        metavar="POLICY[,POLICY...]",
        help=f"recurrent snapshot eviction policies to compare, or 'all': {', '.join(SNAPSHOT_POLICIES)} "
        "(default cost-aware; none for an attention-only model)",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--demote", type=_count, default=0, metavar="TOKENS", help="long-context demotion threshold (0: off)"
    )
    s.add_argument("--exact-demotion", action="store_true", help="judge demotion by the exact prefix probe")
    s.add_argument("--max-num-tokens", type=_positive_int, default=8192, help="token budget per real step (8192)")
    s.add_argument(
        "--decode-quantum",
        type=_positive_int,
        default=None,
        help="at most this many real decode steps per simulated step (default 8); 1 = unaggregated",
    )
    t = p.add_argument_group("step-time model (defaults: H200 figures from bench/results)")
    t.add_argument("--gpus-per-server", type=_positive_int, default=8)
    t.add_argument("--matmul-tflops", type=_positive_float, default=None)
    t.add_argument("--attention-tflops", type=_positive_float, default=None)
    t.add_argument("--hbm-gbps", type=_positive_float, default=None)
    t.add_argument("--efficiency", type=_positive_float, default=1.0, help="fraction of the peaks reached (1.0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, metavar="DIR", help="write summary.csv, load.csv, policies.png, load.png")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _names(option: str, text: str, allowed: Sequence[str]) -> list[str]:
    if text.strip() == "all":
        return list(allowed)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise SimulationError(f"{option}: expected at least one policy")
    for n in names:
        if n not in allowed:
            raise SimulationError(f"{option}: unknown policy {n!r}; expected one of {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def _workload(args: argparse.Namespace) -> tuple[list[SimRequest], str, int]:
    if args.trace:
        path = default_trace_path() if args.trace == "mooncake" else Path(args.trace)
        if path is None:
            raise FileNotFoundError("--trace mooncake: the shared trace was not found (set KVFORGE_TRACE)")
        reqs = load_mooncake_trace(path, limit=args.limit)
        label = f"trace {path.name}"
        tpb = MOONCAKE_BLOCK_TOKENS
    else:
        wl = SyntheticWorkload(seed=args.seed, **({"conversations": args.conversations} if args.conversations else {}))
        reqs = wl.requests()
        if args.limit:
            reqs = reqs[: args.limit]
        label = f"synthetic (seed {args.seed}, {wl.conversations} conversations)"
        tpb = wl.tokens_per_block
    if args.speedup != 1.0:
        reqs = [replace(r, arrival_s=r.arrival_s / args.speedup) for r in reqs]
        label += f", arrivals x{args.speedup:g}"
    return reqs, label, tpb


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    policies = _names("--router", args.router, list(ROUTER_POLICIES))
    model = load_model(args.model)
    usable = snapshot_policies(model)
    if args.snapshot_policy:
        snaps = _names("--snapshot-policy", args.snapshot_policy, list(SNAPSHOT_POLICIES))
        bad = [n for n in snaps if n not in usable]
        if bad:
            why = "an attention-only model" if not model.is_hybrid else "this installation (no hybrid manager)"
            raise SimulationError(
                f"--snapshot-policy: {', '.join(bad)} not available for {why}; use {', '.join(usable)}"
            )
    else:
        snaps = [usable[0]]
    snap = ",".join(snaps)
    reqs, label, tpb = _workload(args)
    tp = Throughputs.from_bench_results(
        matmul_tflops=args.matmul_tflops,
        attention_tflops=args.attention_tflops,
        hbm_gbps=args.hbm_gbps,
        gpus=args.gpus_per_server,
        efficiency=args.efficiency,
    )
    trace = bool(args.trace)
    cfg = SimConfig(
        servers=args.servers or (8 if trace else 4),
        model=model,
        throughputs=tp,
        cache_gib=args.cache_gib or 64.0,
        state_fraction=args.state_fraction,
        tokens_per_block=tpb,
        snapshot_policy=snaps[0],
        max_num_tokens=args.max_num_tokens,
        decode_quantum=args.decode_quantum or 8,
        demote_uncached_tokens=args.demote,
        exact_demotion=args.exact_demotion,
    )
    st = describe(reqs)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(st.kinds.items()))
    print(f"kvforge simulate: {label}")
    print(
        f"  workload  {st.requests:,} requests ({kinds}), {st.prompt_tokens / 1e6:.1f}M prompt / "
        f"{st.output_tokens / 1e6:.2f}M output tokens, arrivals over {span:,.0f} s"
    )
    rec = f", {model.recurrent_layers} recurrent ({model.state_bytes / 1e6:.0f} MB/snapshot)" if model.is_hybrid else ""
    print(
        f"  model     {model.name}: {model.mla_layers} MLA layers{rec}, drafter {model.draft_layers} layer "
        f"x {model.draft_len} tokens (E {model.tokens_per_step:.2f} tokens/step)"
    )
    print(
        f"  fleet     {cfg.servers} servers x {tp.gpus} GPUs, {cfg.cache_gib:g} GiB KV each "
        f"({cfg.state_fraction:.0%} recurrent states), {tpb} tokens/block, snapshot policy {snap}, "
        f"demotion {cfg.demote_uncached_tokens or 'off'}{' (exact)' if cfg.exact_demotion else ''}"
    )
    print(
        f"  step time roofline at {tp.matmul_tflops:.0f} TFLOP/s matmul, {tp.attention_tflops:.0f} TFLOP/s MLA, "
        f"{tp.hbm_gbps:.0f} GB/s per GPU x efficiency {tp.efficiency:g} [{tp.source}]; "
        f"up to {cfg.decode_quantum} real decode steps per simulated step"
    )
    results = []
    runs = [(pol, sp) for sp in snaps for pol in policies]
    for i, (pol, sp) in enumerate(runs):
        name = pol if len(snaps) == 1 else f"{pol} / {sp}"
        res = simulate(
            reqs,
            replace(cfg, snapshot_policy=sp),
            pol,
            progress=not args.no_progress,
            desc=f"[{i + 1}/{len(runs)}] {name}",
        )
        results.append(res)
    print()
    print(format_summary(results))
    print(LEGEND)
    if args.out:
        out: Path = args.out
        extra = {
            "workload": label,
            "model": model.name,
            "servers": cfg.servers,
            "cache_gib": cfg.cache_gib,
            "snapshot_policy": snap,
            "demote_uncached_tokens": cfg.demote_uncached_tokens,
            "exact_demotion": cfg.exact_demotion,
            "decode_quantum": cfg.decode_quantum,
        }
        written = [write_csv(results, out / "summary.csv", extra), write_load_csv(results, out / "load.csv")]
        try:
            written += write_plots(results, out, f"kvforge simulate: {label}, {cfg.servers} servers")
        except PlotUnavailableError as exc:
            print(f"kvforge simulate: warning: {exc}", file=sys.stderr)
        print(f"\n  wrote {', '.join(str(p) for p in written)}")
    print(f"\n  total wall time {time.perf_counter() - t_start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="kvforge simulate", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run_safely(args)


def run_safely(args: argparse.Namespace) -> int:
    """:func:`run`, with every input error reported as one line and exit status 2."""
    try:
        return run(args)
    except (SimulationError, TraceFormatError, FileNotFoundError, ValueError, PlotUnavailableError) as exc:
        print(f"kvforge simulate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge simulate: interrupted", file=sys.stderr)
        return 130
