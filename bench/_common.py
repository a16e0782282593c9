"""Shared benchmark plumbing: environment stamp, timing with percentiles, CSV rows and PNG plots.

Every benchmark compares kvforge with its peers in the same run, refuses to report a provider whose output
failed the reference check, and appends one row per (workload, provider) to ``bench/results/<name>.csv``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


class ReferenceMismatch(RuntimeError):
    """A provider's output disagreed with the reference: its timing must not be reported."""


def load_source_copy(name: str, text: str, filename: str) -> Any:
    """Import ``text`` (a patched copy of library module ``name``'s source) as ``name`` for every later import:
    written to ``$TMPDIR/filename`` (tracebacks point at it), registered in ``sys.modules`` and on the parent
    package, so both ``import a.b.c`` and ``from a.b import c`` find the copy."""
    import importlib
    import importlib.util
    import sys

    path = Path(os.environ.get("TMPDIR", "/tmp")) / filename
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path} as {name}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(importlib.import_module(parent), leaf, mod)
    return mod


def git_revision() -> str:
    rev = os.environ.get("KVFORGE_GIT_REV")
    if rev:
        return rev
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def env_stamp() -> dict[str, str]:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "git_rev": git_revision(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def time_gpu(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100) -> dict[str, float]:
    """Median, p20/p80 and the 5%-trimmed mean in ms (triton.testing.do_bench on prebuilt inputs, L2 flushed
    before each call, after warm-up).

    CUDA events resolve about 0.5 us, so for a call of a few microseconds every sample sits on that grid and
    the median jumps between grid points from run to run; the mean of the ~2,000 samples a run takes does not
    (the grid's rounding averages out), and trimming 5% at each end keeps a stray slow sample out of it.
    """
    from triton.testing import do_bench

    try:
        raw = do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
    except AssertionError:  # a Triton whose do_bench has no "all": its quantiles stand in for the samples
        raw = do_bench(fn, warmup=warmup, rep=rep, quantiles=[i / 20 for i in range(1, 20)])
    return _stats(list(raw))


def host_time(fn: Callable[[], Any], *, calls: int = 200, warm: int = 1) -> tuple[float, float]:
    """(host µs per call, µs per call until the GPU finished): ``calls`` back-to-back calls without a sync (the
    launch queue holds them) after ``warm`` untimed ones and a sync; the first clock stops when the host is done,
    the second after a final sync. The garbage collector stays on."""
    import time

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def _stats(samples_ms: list[float]) -> dict[str, float]:
    samples = torch.tensor(samples_ms, dtype=torch.float64)
    p20, p50, p80 = torch.quantile(samples, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    ordered = samples.sort().values
    cut = len(ordered) // 20
    trimmed = ordered[cut : len(ordered) - cut] if len(ordered) > 2 * cut else ordered
    return {"ms": p50, "ms_p20": p20, "ms_p80": p80, "ms_mean": float(trimmed.mean()), "n": len(samples)}


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, samples: int = 1000, warmup: int = 10, flush_mb: int = 256
) -> dict[str, dict[str, float]]:
    """Time several calls sample by sample in turn, each behind its own L2 flush (as do_bench flushes), so
    that every call sees the same machine state: same clocks, same moment of the run.

    A ratio of two few-microsecond calls timed in separate do_bench runs moves with whatever changed between
    the runs (the empty kernel read 3.33 and 4.06 us on two machine starts while the ops it divides moved by
    0.2 us). Interleaving pairs the samples; the order alternates so no call always follows the same one.
    Returns, per name, the statistics of ``time_gpu`` (median, p20/p80, 5%-trimmed mean in ms, count).
    """
    names = list(fns)
    flush = torch.empty(flush_mb << 18, dtype=torch.int32, device="cuda")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = {
        k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
        for k in names
    }
    for i in range(samples):
        for k in names if i % 2 == 0 else reversed(names):
            flush.zero_()
            start, end = events[k][i]
            start.record()
            fns[k]()
            end.record()
    torch.cuda.synchronize()
    return {k: _stats([s.elapsed_time(e) for s, e in events[k]]) for k in names}


def time_graph(fn: Callable[[], Any], *, rep: int = 100) -> dict[str, float]:
    """Time ``fn`` replayed from a CUDA graph (launch overhead as a serving step sees it)."""
    from triton.testing import do_bench_cudagraph

    p50, p20, p80 = do_bench_cudagraph(fn, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "ms_p20": p20, "ms_p80": p80}


def append_csv(name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Append rows (each stamped with GPU, versions, git revision, date) to bench/results/<name>.csv."""
    rows = list(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    stamp = env_stamp()
    rows = [{**stamp, **r} for r in rows]
    fields: list[str] = []
    if path.exists():
        with path.open() as f:
            fields = next(csv.reader(f), [])
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    if path.exists() and fields != next(csv.reader(path.open()), []):
        # A new column: rewrite the file with the widened header so older rows stay readable.
        old = list(csv.DictReader(path.open()))
        rows = old + rows
        mode = "w"
    else:
        mode = "a" if path.exists() else "w"
    with path.open(mode, newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if mode == "w":
            w.writeheader()
        w.writerows(rows)
    return path


def bar_plot(
    path: Path,
    title: str,
    groups: list[str],
    series: Mapping[str, list[float]],
    ylabel: str,
    log: bool = False,
) -> Path:
    """Grouped bars (one group per workload, one bar per provider) as a PNG via matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Wide enough for the bars, capped so that a many-series plot stays readable when shown at page width.
    fig, ax = plt.subplots(figsize=(min(16, max(6, 1.6 * len(groups) * max(1, len(series)) / 3)), 5))
    n = max(1, len(series))
    width = 0.8 / n
    colors = plt.get_cmap("tab10" if n <= 10 else "tab20")  # the default cycle repeats after ten series
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, vals, width, label=label, color=colors(i % colors.N))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the axes: never over a bar
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legend beside the axes and a long title fit
    plt.close(fig)
    return path
