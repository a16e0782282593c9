"""RMSNorm with an optional residual add, one pass per row: ``s = x + residual``; ``y = s / rms(s) * weight``.

``rms_norm(x, weight, eps=1e-6, residual=None, out=None, sum_out=None)``: ``x [rows, D]`` (any row stride, last
dimension contiguous) in fp32/fp16/bf16, ``weight [D]``. Without ``residual`` it returns ``y`` (x's dtype).
With ``residual`` (x's shape and dtype) it returns ``(y, s)``: the sum is rounded to x's dtype before the norm
reads it, so ``y`` equals the unfused ``rms(x + residual)`` of a model whose residual stream is kept in that
dtype (the engine's). The norm is computed in fp32: ``s * rsqrt(mean(s^2) + eps) * weight``. ``out`` /
``sum_out`` are written when given (same shape and dtype, not overlapping any input). ``rms_norm_ref`` is the
plain-torch reference (fp64 arithmetic, the sum rounded to x's dtype the same way).
Rows up to 16,384 wide (one program per row, the whole row in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_no_overlap, check_operand

__all__ = ["rms_norm", "rms_norm_ref"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
MAX_D = 16384


# Row strides and sizes are specialised (fixed per model): a multiple of 16 is what lets the loads and
# stores be 16-byte vectors; per-call strides would make every access a single element.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_rows, D, sx, sr, so, ss, eps,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * sr + offs, mask=m, other=0.0).to(tl.float32)
        s = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * ss + offs, s, mask=m)
        x = s.to(tl.float32)  # the norm reads the rounded sum, as the unfused model does
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=m)


def _check_2d(name: str, t: object, like: torch.Tensor | None, dtype=_FLOAT) -> torch.Tensor:
    if like is None:
        return check_operand(name, t, dtype=dtype, ndim=2, last_dim_contiguous=True)
    return check_operand(
        name, t, dtype=like.dtype, ndim=2, last_dim_contiguous=True, shape=tuple(like.shape), device=like.device
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    _check_2d("x", x, None)
    n, d = x.shape
    if d < 1 or d > MAX_D:
        raise ValueError(f"x: expected rows of 1 .. {MAX_D} elements, got {d}")
    check_operand("weight", weight, dtype=_FLOAT, ndim=1, contiguous=True, shape=(d,), device=x.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if residual is not None:
        _check_2d("residual", residual, x)
    if sum_out is not None and residual is None:
        raise ValueError("sum_out: given without a residual (there is no sum to write)")
    out = torch.empty_like(x) if out is None else _check_2d("out", out, x)
    if residual is not None:
        sum_out = torch.empty_like(x) if sum_out is None else _check_2d("sum_out", sum_out, x)
    check_no_overlap({"out": out, "sum_out": sum_out}, {"x": x, "residual": residual, "weight": weight})
    if n:
        r = residual if residual is not None else x
        s = sum_out if sum_out is not None else out
        _rms_norm_kernel[(n,)](
            x, r, weight, out, s, n, d, x.stride(0), r.stride(0), out.stride(0), s.stride(0), float(eps),
            HAS_RES=residual is not None, BLOCK_D=_rt.next_pow2(d), num_warps=8 if d > 2048 else 4,
        )  # fmt: skip
    return out if residual is None else (out, sum_out)  # type: ignore[return-value]


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference (fp64 arithmetic; the sum rounded to x's dtype before the norm)."""
    s = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    sd = s.double()
    y = (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)
    return y if residual is None else (y, s)
