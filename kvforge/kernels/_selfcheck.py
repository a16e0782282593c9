"""Run every kernel against its reference on whatever is present and report a table.

Each kernel module may define ``selfcheck(device) -> list[CheckRow]``; modules are discovered, not listed, so
adding an op adds its rows. Each row's error is in its own unit, which the table prints beside it
(``timed_check(..., unit=...)``): ``abs`` (the largest absolute difference from the reference), ``x tol``
(the largest error in multiples of the tolerance; 1 is the pass line), ``rel RMSE`` (the output's RMS error
over the reference's RMS), or a count (``mismatched entries``,
``mismatched bytes``, ``failed comparisons``) where the op must be exact.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class CheckRow:
    op: str
    device: str
    shapes: str
    max_err: float
    passed: bool
    ms: float
    note: str = ""
    unit: str = "abs"


def timed_check(
    op: str,
    device: torch.device,
    shapes: str,
    fn: Callable[[], tuple[float, bool]],
    note: str = "",
    *,
    unit: str = "abs",
) -> CheckRow:
    """Run ``fn`` (returns (max_err, passed), the error in ``unit``) and time it; an exception is a failed row,
    not a crash."""
    t0 = time.perf_counter()
    try:
        err, ok = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # the table must show every op even when one breaks
        return CheckRow(op, str(device), shapes, float("nan"), False, 0.0, f"{type(exc).__name__}: {exc}", unit)
    return CheckRow(op, str(device), shapes, err, ok, (time.perf_counter() - t0) * 1e3, note, unit)


def run_all(device: torch.device | None = None) -> list[CheckRow]:
    import kvforge.kernels as pkg
    from kvforge.kernels._runtime import kernel_device

    device = device or kernel_device()
    rows: list[CheckRow] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"kvforge.kernels.{info.name}")
        check = getattr(mod, "selfcheck", None)
        if check is None:
            continue
        try:
            rows.extend(check(device))
        except Exception as exc:
            traceback.print_exc()
            rows.append(CheckRow(info.name, str(device), "-", float("nan"), False, 0.0, repr(exc), "-"))
    return rows


def format_table(rows: list[CheckRow]) -> str:
    head = ("op", "device", "shapes", "max err", "err unit", "result", "ms", "note")
    body = [
        (r.op, r.device, r.shapes, f"{r.max_err:.3g}", r.unit, "PASS" if r.passed else "FAIL", f"{r.ms:.1f}", r.note)
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])
