"""Accepted-state selection after draft verification: one masked row copy per request, on the device.

A verifying request of ``T`` tokens writes the recurrent state after token 0 into its live row and the state
after token ``t >= 1`` into ``scratch[n, t - 1]`` (:func:`kvforge.engine.ops.kda_recurrent_inplace`). Once the
accepted count ``a = accepted[n]`` (1 .. T) is known on the device, the live row must hold the state after token
``a - 1``: ``select_accepted_states`` copies ``pool[scratch[n, a - 2]]`` into ``pool[live[n]]`` for every row with
``a >= 2`` and touches nothing for ``a == 1`` (the usual rejected draft), so no host read of ``accepted`` and
no copy of rows that need none. ``pool [rows, ...]`` is any contiguous tensor (fp32 states in the engine);
``live [N]``, ``scratch [N, T - 1]`` and ``accepted [N]`` are int32 on the pool's device. Rows with ``a`` outside
``1 .. T`` are a caller error the kernel cannot see (values stay on the device); the checked entry
(``check_values=True``) reads them back and refuses them. Two rows must not name one live row.
``select_accepted_states_ref`` is the plain-torch reference (out of place: returns the new pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_tensor

__all__ = ["select_accepted_states", "select_accepted_states_ref"]

BLOCK = 2048


@triton.jit(do_not_specialize=["row_elems", "n_scratch"])
def _state_select_kernel(pool_ptr, live_ptr, scratch_ptr, accepted_ptr, row_elems, n_scratch, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    a = tl.load(accepted_ptr + n).to(tl.int64)
    take = a >= 2
    # a < 2 reads slot 0 (a valid address) and copies nothing: the mask is false.
    src_slot = tl.where(take, a - 2, 0)
    src = tl.load(scratch_ptr + n * n_scratch + src_slot).to(tl.int64)
    dst = tl.load(live_ptr + n).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = offs < tl.where(take, row_elems, 0)  # nothing to copy: an empty range
    vals = tl.load(pool_ptr + src * row_elems + offs, mask=m)
    tl.store(pool_ptr + dst * row_elems + offs, vals, mask=m)


def _check(pool: object, live: object, scratch: object, accepted: object) -> tuple[int, int, int]:
    check_tensor("pool", pool, contiguous=True)
    assert isinstance(pool, torch.Tensor)
    if pool.dim() < 1 or pool.shape[0] < 1:
        raise ValueError(f"pool: expected at least one row, got shape {list(pool.shape)}")
    check_launch_device("pool", pool)
    check_tensor("live", live, dtype=torch.int32, ndim=1, device=pool.device, contiguous=True)
    check_tensor("scratch", scratch, dtype=torch.int32, ndim=2, device=pool.device, contiguous=True)
    check_tensor("accepted", accepted, dtype=torch.int32, ndim=1, device=pool.device, contiguous=True)
    assert isinstance(live, torch.Tensor) and isinstance(scratch, torch.Tensor) and isinstance(accepted, torch.Tensor)
    n = live.shape[0]
    if scratch.shape[0] != n or accepted.shape[0] != n:
        raise ValueError(
            f"scratch, accepted: expected {n} rows (as live), got {scratch.shape[0]} and {accepted.shape[0]}"
        )
    for name, t in (("live", live), ("scratch", scratch), ("accepted", accepted)):
        check_launch_device(name, t)  # (their device is pool's: check_tensor above)
    check_no_overlap({"pool": pool}, {"live": live, "scratch": scratch, "accepted": accepted})
    return n, max(1, scratch.shape[1]), pool[0].numel()


def _check_values(pool: torch.Tensor, live: torch.Tensor, scratch: torch.Tensor, accepted: torch.Tensor) -> None:
    rows, t = pool.shape[0], scratch.shape[1] + 1
    if live.numel():
        lo, hi = int(live.min()), int(live.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"live: row indices must lie in [0, {rows}), got min {lo}, max {hi}")
        if torch.unique(live).numel() != live.numel():
            raise ValueError("live: two requests name one live row (their copies would race)")
        a_lo, a_hi = int(accepted.min()), int(accepted.max())
        if a_lo < 1 or a_hi > t:
            raise ValueError(f"accepted: counts must lie in [1, {t}] (scratch has {t - 1} columns), got {a_lo}..{a_hi}")
    if scratch.numel():
        lo, hi = int(scratch.min()), int(scratch.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"scratch: row indices must lie in [0, {rows}), got min {lo}, max {hi}")


def select_accepted_states(
    pool: torch.Tensor, live: torch.Tensor, scratch: torch.Tensor, accepted: torch.Tensor, *, check_values: bool = True
) -> None:
    """In place: ``pool[live[n]] = pool[scratch[n, accepted[n] - 2]]`` where ``accepted[n] >= 2`` (see the module
    docstring). ``check_values=False`` skips the device-to-host read of the indices (the engine's hot path and
    CUDA-graph capture)."""
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values: expected a bool, got {type(check_values).__name__}")
    n, n_scratch, row_elems = _check(pool, live, scratch, accepted)
    if check_values:
        _check_values(pool, live, scratch, accepted)
    if n == 0 or scratch.shape[1] == 0 or row_elems == 0:
        return
    grid = (n, _rt.cdiv(row_elems, BLOCK))
    _state_select_kernel[grid](pool, live, scratch, accepted, row_elems, n_scratch, BLOCK=BLOCK, num_warps=4)


def select_accepted_states_ref(
    pool: torch.Tensor, live: torch.Tensor, scratch: torch.Tensor, accepted: torch.Tensor
) -> torch.Tensor:
    """The reference: a new pool with the accepted states copied, row by row on the host."""
    out = pool.detach().cpu().clone()
    src = pool.detach().cpu()
    for n, (dst, a) in enumerate(zip(live.tolist(), accepted.tolist())):
        if a >= 2:
            out[dst] = src[int(scratch[n, a - 2])]
    return out
