"""Rotary position embedding (halves layout) from a cos/sin table, one pass, in place or into ``out``.

``rotary(x, positions, cos_sin, out=None)``: ``x [T, R]`` or ``[T, H, R]`` in fp32/fp16/bf16 (any strides on
the leading dimensions, the last contiguous; e.g. the rope slice of a wider projection), ``positions [T]``
int32/int64, ``cos_sin [P, R]`` fp32 with ``cos(p * inv_freq)`` in its first ``R / 2`` columns and
``sin(p * inv_freq)`` in the rest (:func:`rotary_table`). Row ``(t, h)``'s pairs ``(x1, x2)`` (the two halves)
become ``(x1 cos - x2 sin, x1 sin + x2 cos)`` at ``positions[t]``, in fp32, rounded once. ``out`` (x's shape and
dtype) may be ``x`` itself (in place) or a disjoint tensor, e.g. the rope columns of a cache row. Positions must
lie in ``[0, P)``: checked on the host when ``check_values`` (a device read), not on the hot path.
``rotary_ref`` is the plain-torch reference (fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_operand, check_tensor

__all__ = ["rotary", "rotary_ref", "rotary_table"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


# Row strides and sizes are specialised (fixed per model): a multiple of 16 is what lets the loads and
# stores be 16-byte vectors; per-call strides would make every access a single element.
@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cs_ptr, out_ptr, sx_t, sx_h, so_t, so_h, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cs_ptr + p * 2 * HALF + offs, mask=m, other=0.0)
    s = tl.load(cs_ptr + p * 2 * HALF + HALF + offs, mask=m, other=0.0)
    xb = x_ptr + t * sx_t + h * sx_h
    x1 = tl.load(xb + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + offs, mask=m, other=0.0).to(tl.float32)
    ob = out_ptr + t * so_t + h * so_h
    tl.store(ob + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + HALF + offs, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=m)


def rotary_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, 2 * len(inv_freq)]`` fp32: cos then sin of ``p * inv_freq`` (fp32 angles, as a model
    computing them per call in fp32 would)."""
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions: expected an int >= 1, got {max_positions!r}")
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, ndim=1)
    ang = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).contiguous()


def rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """See the module docstring."""
    check_tensor("x", x, dtype=_FLOAT, last_dim_contiguous=True)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [T, R] or [T, H, R], got shape {list(x.shape)}")
    check_launch_device("x", x)
    r = x.shape[-1]
    if r % 2 or r < 2:
        raise ValueError(f"x: expected an even rotary width >= 2, got {r}")
    ints = (torch.int32, torch.int64)
    check_operand("positions", positions, dtype=ints, ndim=1, contiguous=True, shape=(x.shape[0],), device=x.device)
    check_operand("cos_sin", cos_sin, dtype=torch.float32, ndim=2, contiguous=True, shape=(None, r), device=x.device)
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values: expected a bool, got {type(check_values).__name__}")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_operand("out", out, dtype=x.dtype, last_dim_contiguous=True, shape=tuple(x.shape), device=x.device)
    if out is not x:  # in place is allowed (each program reads its row before writing it); any other overlap is not
        check_no_overlap({"out": out}, {"x": x, "positions": positions, "cos_sin": cos_sin})
    if check_values and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin.shape[0]:
            raise ValueError(f"positions: expected values in [0, {cos_sin.shape[0]}), got {lo} .. {hi}")
    t = x.shape[0]
    x3 = x if x.dim() == 3 else x[:, None, :]
    o3 = out if out.dim() == 3 else out[:, None, :]
    if t and x3.shape[1]:
        half = r // 2
        _rotary_kernel[(t, x3.shape[1])](
            x3, positions, cos_sin, o3, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
            HALF=half, BLOCK=_rt.next_pow2(half), num_warps=1,
        )  # fmt: skip
    return out


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The reference: fp64 rotation by angles ``p * inv_freq`` computed in fp32 (as :func:`rotary_table`)."""
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    c, s = ang.cos(), ang.sin()
    if x.dim() == 3:
        c, s = c[:, None, :], s[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)
