"""``kvforge simulate``: replay a workload through the real router, schedulers and cache managers.

With no arguments it runs the embedded default: a seeded synthetic multi-turn workload on a small fleet,
comparing four router policies. Every option is checked before anything is simulated (ranges in
:data:`LIMITS`; ``--out`` must be a folder where a file can be created, tried by creating one); bad input ends with one
``kvforge simulate: error: argument --x: ...`` line on stderr and exit status 2, never a traceback. Progress
bars show only when stderr is a terminal (``--no-progress`` turns them off there too). A trace out of time
order is sorted (stable) with a one-line warning.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from kvforge.sim.contention import Contention
from kvforge.sim.model import (
    FALLBACK_ATTENTION_TFLOPS,
    FALLBACK_HBM_GBPS,
    FALLBACK_MATMUL_TFLOPS,
    KIMI_K3_LIKE,
    Throughputs,
    load_model,
)
from kvforge.sim.profile import load_profile
from kvforge.sim.report import PlotUnavailableError, format_summary, write_csv, write_load_csv, write_plots
from kvforge.sim.server import SNAPSHOT_POLICIES, snapshot_policies
from kvforge.sim.simulator import ROUTER_POLICIES, SimConfig, SimulationError, simulate
from kvforge.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    SyntheticWorkload,
    TraceFormatError,
    TraceOrderWarning,
    default_trace_path,
    describe,
    load_mooncake_trace,
)

__all__ = ["DEFAULT_POLICIES", "LIMITS", "OUT_FILES", "add_arguments", "main", "run", "run_safely"]

DEFAULT_POLICIES = "conversation,conversation-events,cache-aware,round-robin"
OUT_FILES = ("summary.csv", "load.csv", "policies.png", "load.png")
STATE_FRACTION_DEFAULT = 0.5
MAX_NUM_TOKENS_DEFAULT = 8192

# Inclusive ranges of the numeric options, checked when the command line is parsed (before any allocation):
# each upper bound keeps a typo from turning into minutes of work or a MemoryError.
LIMITS: dict[str, tuple[float, float]] = {
    "--limit": (1, 10**9),
    "--conversations": (1, 100_000),
    "--seed": (0, 2**63 - 1),
    "--speedup": (1e-3, 1e6),
    "--servers": (1, 1024),
    "--cache-gib": (1e-3, 16384),
    "--state-fraction": (1e-3, 0.999),
    "--demote": (0, 2**31 - 1),
    "--max-num-tokens": (1, 1 << 20),
    "--decode-quantum": (1, 1024),
    "--gpus-per-server": (1, 1024),
    "--matmul-tflops": (1e-3, 1e6),
    "--attention-tflops": (1e-3, 1e6),
    "--hbm-gbps": (1e-3, 1e7),
    "--efficiency": (1e-3, 1.0),
    "--servers-per-device": (1, 1024),
    "--shared-device-capacity": (1.0, 1024.0),
}

LEGEND = """
  hit        prompt tokens reused from the server's cache when the request was first admitted
  computed   prefill tokens computed (recomputation after preemption included); saved: tokens reused, all admissions
  snapshots  recurrent-state snapshots taken / held when the run ended / prompt tokens whose attention KV was
             cached but could not be reused for want of a snapshot there (hybrid manager only)
  TTFT, ITL  simulated time: roofline step times at measured single-kernel H200 peaks, so optimistic; ITL is per
             token at the drafter's expected acceptance; out tok/s is bounded by the arrival rate when not loaded
  imbalance  max / mean of the servers' busy time"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) with exit status 2, and no prefix matching
    (``--server 8`` is an error, not ``--servers 8``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"kvforge simulate: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _bounded(flag: str, integer: bool) -> Callable[[str], float]:
    """An argparse type: a number (an integer when ``integer``) within ``LIMITS[flag]``; argparse names the flag."""
    lo, hi = LIMITS[flag]
    what = "an integer" if integer else "a number"
    # Integer bounds print as integers (2**63 - 1, not 9.22337e+18).
    bounds = f"[{int(lo)}, {int(hi)}]" if integer else f"[{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            v: float = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} in {bounds}, got {text!r}") from None
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"expected {what} in {bounds}, got {text!r}")
        return v

    parse.__name__ = "integer" if integer else "number"
    return parse


def _policies(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        if text.strip() == "all":
            return list(allowed)
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected at least one policy of {', '.join(allowed)}")
        for n in names:
            if n not in allowed:
                raise argparse.ArgumentTypeError(f"unknown policy {n!r}; expected one of {', '.join(allowed)}")
        return list(dict.fromkeys(names))

    parse.__name__ = "policy list"
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvforge simulate`` (shared by ``python -m kvforge`` and :func:`main`)."""
    i, f = (lambda flag: _bounded(flag, True)), (lambda flag: _bounded(flag, False))
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        metavar="PATH",
        help="Mooncake-format JSONL trace, or 'mooncake' for $KVFORGE_TRACE / shared/data "
        "(default: the synthetic workload)",
    )
    w.add_argument("--limit", type=i("--limit"), metavar="N", help="replay only the first N requests")
    w.add_argument(
        "--conversations", type=i("--conversations"), default=None, metavar="N", help="synthetic conversations (400)"
    )
    w.add_argument("--seed", type=i("--seed"), default=0, help="synthetic workload seed (0)")
    w.add_argument(
        "--speedup",
        type=f("--speedup"),
        default=1.0,
        metavar="X",
        help="divide every arrival time by X to load the fleet harder (1)",
    )
    g = p.add_argument_group("fleet")
    g.add_argument("--servers", type=i("--servers"), default=None, metavar="N", help="servers (4; 8 with --trace)")
    g.add_argument(
        "--router",
        type=_policies(list(ROUTER_POLICIES)),
        default=DEFAULT_POLICIES.split(","),
        metavar="POLICY[,POLICY...]",
        help=f"router policies to compare, or 'all' ({DEFAULT_POLICIES}); one of: {', '.join(ROUTER_POLICIES)}",
    )
    g.add_argument("--cache-gib", type=f("--cache-gib"), default=None, metavar="GIB", help="KV cache per server (64)")
    g.add_argument(
        "--state-fraction",
        type=f("--state-fraction"),
        default=STATE_FRACTION_DEFAULT,
        metavar="F",
        help="share of the cache for recurrent states: live + snapshots (0.5)",
    )
    g.add_argument(
        "--model", default=KIMI_K3_LIKE.name, help="'kimi-k3-like' (the default) or a JSON file of model fields"
    )
    g.add_argument(
        "--snapshot-policy",
        type=_policies(list(SNAPSHOT_POLICIES)),
        default=None,
        metavar="POLICY[,POLICY...]",
        help=f"recurrent snapshot eviction policies to compare, or 'all': {', '.join(SNAPSHOT_POLICIES)} "
        "(cost-aware; none for an attention-only model)",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--demote", type=i("--demote"), default=0, metavar="TOKENS", help="long-context demotion threshold (0: off)"
    )
    s.add_argument("--exact-demotion", action="store_true", help="judge demotion by the exact prefix probe")
    s.add_argument(
        "--max-num-tokens",
        type=i("--max-num-tokens"),
        default=MAX_NUM_TOKENS_DEFAULT,
        metavar="N",
        help="token budget per real step (8192); at least 1 + the drafter's draft tokens",
    )
    s.add_argument(
        "--decode-quantum",
        type=i("--decode-quantum"),
        default=None,
        metavar="N",
        help="at most N real decode steps per simulated step (8); 1 = unaggregated",
    )
    t = p.add_argument_group("step-time model (defaults: the H200 figures in bench/results)")
    t.add_argument(
        "--gpus-per-server",
        type=i("--gpus-per-server"),
        default=8,
        metavar="N",
        help="GPUs per server; a step's work is divided over them (8)",
    )
    t.add_argument(
        "--matmul-tflops",
        type=f("--matmul-tflops"),
        default=None,
        metavar="X",
        help=f"per-GPU matmul TFLOP/s (bench/results/mla_context.csv's FP8 matmul; {FALLBACK_MATMUL_TFLOPS:g} "
        "without the file)",
    )
    t.add_argument(
        "--attention-tflops",
        type=f("--attention-tflops"),
        default=None,
        metavar="X",
        help="per-GPU MLA attention TFLOP/s (median of mla_context.csv's kvforge fp8 rows; "
        f"{FALLBACK_ATTENTION_TFLOPS:g} without the file)",
    )
    t.add_argument(
        "--hbm-gbps",
        type=f("--hbm-gbps"),
        default=None,
        metavar="X",
        help=f"per-GPU memory GB/s (small_copies.csv's device copy; {FALLBACK_HBM_GBPS:g} without the file)",
    )
    t.add_argument(
        "--efficiency", type=f("--efficiency"), default=1.0, metavar="F", help="fraction of those peaks reached (1)"
    )
    t.add_argument(
        "--profile",
        metavar="FILE",
        help="step times measured on the engine (a kvforge-step-profile/1 JSON that bench/profile_step_time.py "
        "writes) instead of the roofline; it sets the model, and the cache pages, token and request budgets "
        "the profiled engine ran with (--cache-gib / --state-fraction / --max-num-tokens still override), and "
        "--decode-quantum defaults to 1",
    )
    t.add_argument(
        "--servers-per-device",
        type=i("--servers-per-device"),
        default=1,
        metavar="N",
        help="servers 0..N-1, N..2N-1, ... share one device each (engines on one GPU or one CPU); their steps slow "
        "each other down by --shared-device-capacity or the --profile's measured contention curve (1: none)",
    )
    t.add_argument(
        "--shared-device-capacity",
        type=f("--shared-device-capacity"),
        default=None,
        metavar="C",
        help="a shared device runs k concurrent steps each max(1, k / C) times slower (processor sharing of C "
        "servers' worth of compute); default with --servers-per-device: the --profile's measured curve",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, metavar="DIR", help=f"write {', '.join(OUT_FILES)} into DIR")
    o.add_argument(
        "--no-progress", action="store_true", help="no progress bar (they show only when stderr is a terminal)"
    )


def _arg(flag: str, message: str) -> SimulationError:
    return SimulationError(f"argument {flag}: {message}")


def check_out_dir(out: Path) -> None:
    """Raise :class:`SimulationError` unless ``out`` is (or can become) a writable folder whose output files
    can be written: not a file, not under a file, no output name taken by a folder.

    Checked by doing, not by permission bits (root passes every ``os.access`` test, and ``/proc`` lies): the
    missing folders are made, a file is created and removed in ``out``, each existing output file is opened
    for appending, and the folders made here are removed again."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise _arg("--out", f"{p} exists and is not a folder")
    probe, missing = p, []
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise _arg("--out", f"{p}: {probe} is a file, not a folder")
    for name in OUT_FILES:
        q = p / name
        if q.is_dir():
            raise _arg("--out", f"{q} exists and cannot be overwritten (a folder)")
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        fd, name = tempfile.mkstemp(prefix=".kvforge-probe-", dir=p)
        os.close(fd)
        os.unlink(name)
        for out_name in OUT_FILES:
            if (p / out_name).exists():
                with (p / out_name).open("ab"):  # opening to append changes nothing in the file
                    pass
    except OSError as exc:
        where = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        raise _arg("--out", f"{p}: cannot create a file there ({where})") from None
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):  # not empty: someone else wrote there meanwhile
                d.rmdir()


def _workload(args: argparse.Namespace) -> tuple[list[SimRequest], str, int]:
    if args.trace:
        path = default_trace_path() if args.trace == "mooncake" else Path(args.trace)
        if path is None:
            raise _arg(
                "--trace",
                "'mooncake': no trace found; set KVFORGE_TRACE to a Mooncake-format JSONL file (see the README)",
            )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TraceOrderWarning)
                reqs = load_mooncake_trace(path, limit=args.limit)
        except (OSError, TraceFormatError) as exc:
            raise _arg("--trace", str(exc).removeprefix("trace: ")) from None
        for wrn in caught:
            print(f"kvforge simulate: warning: {wrn.message}", file=sys.stderr)
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
    """Run ``kvforge simulate`` on parsed arguments; every check that needs no simulation runs first."""
    t_start = time.perf_counter()
    if args.out is not None:
        check_out_dir(args.out)
    policies = args.router
    profile = None
    if getattr(args, "profile", None):
        if args.model != KIMI_K3_LIKE.name:
            raise _arg("--profile", "it sets the model; drop --model")
        try:
            profile = load_profile(args.profile)
        except (OSError, ValueError) as exc:
            raise _arg("--profile", str(exc)) from None
    try:
        model = load_model(args.model) if profile is None else profile.model
    except ValueError as exc:
        raise _arg("--model", str(exc).removeprefix("--model").lstrip(": ")) from None
    except RecursionError:
        raise _arg("--model", f"{args.model}: JSON nested too deeply") from None
    usable = snapshot_policies(model)
    if args.snapshot_policy:
        snaps = args.snapshot_policy
        bad = [n for n in snaps if n not in usable]
        if bad:
            why = "an attention-only model" if not model.is_hybrid else "this installation (no hybrid manager)"
            raise _arg("--snapshot-policy", f"{', '.join(bad)} not available for {why}; use {', '.join(usable)}")
    else:
        snaps = [usable[0]]
    snap = ",".join(snaps)
    if args.exact_demotion and not args.demote:
        raise _arg("--exact-demotion", "needs a demotion threshold (--demote TOKENS)")
    tp = Throughputs.from_bench_results(
        matmul_tflops=args.matmul_tflops,
        attention_tflops=args.attention_tflops,
        hbm_gbps=args.hbm_gbps,
        gpus=args.gpus_per_server,
        efficiency=args.efficiency,
    )
    trace = bool(args.trace)
    tpb = MOONCAKE_BLOCK_TOKENS if trace else SyntheticWorkload.tokens_per_block
    extra_cfg: dict[str, object] = {}
    cache_gib, state_fraction, max_num_tokens = args.cache_gib or 64.0, args.state_fraction, args.max_num_tokens
    if profile is not None:
        gib, frac = profile.cache_size()
        cache_gib = args.cache_gib or gib
        if args.state_fraction == STATE_FRACTION_DEFAULT:
            state_fraction = frac
        if args.max_num_tokens == MAX_NUM_TOKENS_DEFAULT:
            max_num_tokens = profile.engine["max_num_tokens"]
        extra_cfg = {"step_profile": profile, "max_num_requests": profile.engine["max_num_requests"]}
    if args.shared_device_capacity is not None:
        if args.servers_per_device == 1:
            raise _arg("--shared-device-capacity", "needs --servers-per-device N > 1 (servers sharing a device)")
        extra_cfg["contention"] = Contention.from_capacity(args.shared_device_capacity)
    n_servers = args.servers or (8 if trace else 4)
    if args.servers_per_device > n_servers:
        raise _arg("--servers-per-device", f"{args.servers_per_device} is more than --servers {n_servers}")
    if args.servers_per_device > 1 and "contention" not in extra_cfg and (profile is None or not profile.contention):
        raise _arg(
            "--servers-per-device",
            "servers sharing a device need a slowdown curve: give --shared-device-capacity, or a --profile "
            "measured with --contention",
        )
    cfg = SimConfig(
        servers=n_servers,
        servers_per_device=args.servers_per_device,
        model=model,
        throughputs=tp,
        cache_gib=cache_gib,
        state_fraction=state_fraction,
        tokens_per_block=tpb,
        snapshot_policy=snaps[0],
        max_num_tokens=max_num_tokens,
        decode_quantum=args.decode_quantum or (8 if profile is None else 1),
        demote_uncached_tokens=args.demote,
        exact_demotion=args.exact_demotion,
        **extra_cfg,  # type: ignore[arg-type]
    )
    reqs, label, tpb = _workload(args)
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
    if profile is not None:
        print(
            f"  step time measured profile {args.profile} (engine {dict(profile.engine)}); "
            f"up to {cfg.decode_quantum} real decode steps per simulated step"
        )
    if cfg.contention is not None and cfg.servers_per_device > 1:
        curve = ", ".join(f"{cfg.contention.factor(k):.3g}" for k in range(1, cfg.servers_per_device + 1))
        print(
            f"  sharing   {cfg.servers_per_device} servers per device, step slowdown with k = 1.. busy: {curve} "
            f"({cfg.contention.source})"
        )
    else:
        print(
            f"  step time roofline at {tp.matmul_tflops:.0f} TFLOP/s matmul, {tp.attention_tflops:.0f} TFLOP/s "
            f"MLA, {tp.hbm_gbps:.0f} GB/s per GPU x efficiency {tp.efficiency:g} [{tp.source}]; "
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
            progress=not args.no_progress and sys.stderr.isatty(),
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
            "demote_uncached_tokens": cfg.demote_uncached_tokens,
            "exact_demotion": cfg.exact_demotion,
            "decode_quantum": cfg.decode_quantum,
        }
        try:
            written = [write_csv(results, out / "summary.csv", extra), write_load_csv(results, out / "load.csv")]
        except OSError as exc:  # checked before the run, so only a change since then (or a full disk) lands here
            raise _arg("--out", str(exc)) from None
        try:
            written += write_plots(results, out, f"kvforge simulate: {label}, {cfg.servers} servers")
        except PlotUnavailableError as exc:
            print(f"kvforge simulate: warning: {exc}", file=sys.stderr)
        print(f"\n  wrote {', '.join(str(p) for p in written)}")
    print(f"\n  total wall time {time.perf_counter() - t_start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvforge simulate`` on its own (``python -m kvforge.sim.cli``); :mod:`kvforge.__main__` is the usual door."""
    p = _Parser(prog="kvforge simulate", description=DESCRIPTION)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_safely(args)


DESCRIPTION = (
    "Replay a workload through the real router, schedulers and cache managers in simulated time and compare "
    "policies. With no options: the embedded seeded synthetic workload on 4 servers, four router policies."
)


def run_safely(args: argparse.Namespace) -> int:
    """:func:`run`, with every input error reported as one line and exit status 2."""
    try:
        return run(args)
    except (SimulationError, TraceFormatError, PlotUnavailableError, OSError, ValueError) as exc:
        print(f"kvforge simulate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge simulate: interrupted", file=sys.stderr)
        return 130
