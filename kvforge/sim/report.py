"""Reporting a simulation: the summary table, the CSV rows and the PNG plots.

matplotlib is optional (the ``bench``/``notebooks`` extras): :func:`write_plots` imports it lazily and raises
:class:`PlotUnavailableError` with an install hint when it is missing. It draws on ``matplotlib.figure.Figure``
objects, never through pyplot, so calling it from a notebook leaves the notebook's inline backend alone.

CSV columns carry their units (``ttft_p50_s``, ``itl_p99_ms``, ``hit_rate_fraction``, ...); ``load.csv`` names
each run by the same two columns as ``summary.csv`` (``policy``, ``snapshot_policy``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvforge.sim.simulator import RunResult

__all__ = ["PlotUnavailableError", "format_summary", "label", "write_csv", "write_load_csv", "write_plots"]


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def _m(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e5 else f"{x:,.0f}"


SNAPSHOT_COLUMNS = ("snapshots", "held_at_end", "pruned_tokens")


def _snap(res: RunResult) -> str:
    s = res.snapshots
    if not s:
        return "-"
    return " / ".join(_m(s.get(k, 0)) for k in SNAPSHOT_COLUMNS)


def label(res: RunResult, results: Sequence[RunResult]) -> str:
    """The run's name in tables and plots: the router policy, and the snapshot policy when runs differ in it."""
    if len({r.snapshot_policy for r in results}) > 1:
        return f"{res.policy} / {res.snapshot_policy}"
    return res.policy


def _fmt(x: float, scale: float = 1.0, digits: int = 2) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{digits}f}"


def format_summary(results: Sequence[RunResult]) -> str:
    """A fixed-width table, one row per run."""
    head = [
        "policy",
        "hit",
        "prefill computed",
        "saved",
        "snapshots taken / held / pruned tok",
        "TTFT p50",
        "p99 (s)",
        "ITL p50",
        "p99 (ms)",
        "out tok/s",
        "imbalance",
        "preempt",
        "wall s",
    ]
    rows = [
        [
            label(r, results),
            f"{r.hit_rate:.1%}",
            _m(r.prefill_computed),
            _m(r.prefill_saved),
            _snap(r),
            _fmt(r.ttft_p50),
            _fmt(r.ttft_p99),
            _fmt(r.itl_p50, 1e3, 1),
            _fmt(r.itl_p99, 1e3, 1),
            f"{r.throughput_tok_s:,.0f}",
            _fmt(r.imbalance),
            str(r.preemptions),
            f"{r.wall_s:.1f}",
        ]
        for r in results
    ]
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def write_csv(results: Sequence[RunResult], path: Path, extra: dict[str, Any] | None = None) -> Path:
    """One row per run: every figure of :meth:`RunResult.row` plus ``extra`` (the run's settings)."""
    rows = [{**(extra or {}), **r.row()} for r in results]
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def write_load_csv(results: Sequence[RunResult], path: Path) -> Path:
    """Unfinished requests per server over simulated time, long format
    (policy, snapshot_policy, t_s, server, unfinished_requests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "snapshot_policy", "t_s", "server", "unfinished_requests"])
        for r in results:
            for t, loads in zip(r.load_times, r.load_series):
                for s, v in enumerate(loads):
                    w.writerow([r.policy, r.snapshot_policy, f"{t:.6g}", s, v])
    return path


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "matplotlib is not installed: pip install 'kvforge[bench]' (or matplotlib) to write the PNG plots"
        ) from None
    return Figure


def write_plots(results: Sequence[RunResult], out_dir: Path, title: str) -> list[Path]:
    """``policies.png`` (hit rate, TTFT and ITL per policy) and ``load.png`` (per-server load over time)."""
    Figure = _figure_class()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [label(r, results) for r in results]
    xs = range(len(results))
    fig = Figure(figsize=(14, 4.2))
    axes = fig.subplots(1, 3)
    axes[0].bar(xs, [100 * r.hit_rate for r in results], color="tab:green")
    axes[0].set_title("prefix-hit rate (% of prompt tokens)", fontsize=9)
    w = 0.38
    for ax, (what, p50, p99, scale) in zip(
        axes[1:],
        (("TTFT (s)", "ttft_p50", "ttft_p99", 1.0), ("inter-token latency (ms)", "itl_p50", "itl_p99", 1e3)),
    ):
        ax.bar([x - w / 2 for x in xs], [getattr(r, p50) * scale for r in results], w, label="p50")
        ax.bar([x + w / 2 for x in xs], [getattr(r, p99) * scale for r in results], w, label="p99")
        ax.set_title(what, fontsize=9)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p1 = out_dir / "policies.png"
    fig.savefig(p1, dpi=110)

    fig = Figure(figsize=(10, 2.2 * len(results) + 0.6))
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        if r.load_series:
            n = len(r.load_series[0])
            for s in range(n):
                ax.plot(r.load_times, [v[s] for v in r.load_series], linewidth=0.8, label=f"server {s}")
        ax.set_title(f"{label(r, results)}: unfinished requests per server (imbalance {r.imbalance:.2f})", fontsize=9)
        ax.set_ylabel("requests", fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    if results and results[0].load_series and len(results[0].load_series[0]) <= 8:
        axes[0, 0].legend(fontsize=7, ncol=4)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p2 = out_dir / "load.png"
    fig.savefig(p2, dpi=110)
    return [p1, p2]
