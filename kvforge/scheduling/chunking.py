"""Where a context step may end, given the snapshot points a hybrid cache manager marked on the request.

A recurrent state is reusable only at the exact token where it was saved, and a plain prefill can save it
only at the end of a step, so every snapshot point must end a step. A prefill that can also store the state
at one aligned point *inside* a step (``midchunk_snapshot_alignment``, into the cache's one pending snapshot
slot) removes one of those splits per step. See :mod:`kvforge.scheduling.request` for the marks.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["passed_snapshot_point", "snapshot_chunk_end"]


def snapshot_chunk_end(
    start: int,
    limit: int,
    points: Sequence[int],
    alignment: int | None = None,
    pass_point: int | None = None,
) -> int:
    """End (exclusive token position) of a context step that starts at ``start`` and may run to ``limit``.

    ``limit`` is what the budget and the context allow. Without ``alignment`` the step ends at the first
    snapshot point inside ``(start, limit)``. With it, one point may be passed inside the step when it is the
    last point or ``pass_point`` *and* ``(point - start) % alignment == 0`` (the recurrent kernel's chunks are
    counted from the step's first token, so only those positions can be saved mid-step); the step then ends at
    the next point at the latest. Any other point, e.g. an unaligned one, ends the step.
    """
    if not points:
        return limit
    i = bisect_right(points, start)
    n = len(points)
    if i == n or points[i] >= limit:
        return limit
    if alignment is None:
        return points[i]
    last = points[-1]
    passed = False
    while i < n:
        p = points[i]
        if p >= limit:
            break
        if not passed and p in (last, pass_point) and (p - start) % alignment == 0:
            passed = True
            i += 1
            continue
        return p
    return limit


def passed_snapshot_point(start: int, end: int, points: Sequence[int]) -> int | None:
    """The snapshot point strictly inside the step ``(start, end)`` (at most one for an end chosen by
    :func:`snapshot_chunk_end`), or None."""
    i = bisect_right(points, start)
    if i < len(points) and points[i] < end:
        return points[i]
    return None
