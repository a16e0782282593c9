"""SwiGLU's activation in one pass: ``out = silu(gate) * up``, computed in fp32, rounded once.

``swiglu(gate, up, out=None)``: ``gate``, ``up`` ``[rows, I]`` (any row stride, last dimension contiguous; e.g.
the two halves of one ``[rows, 2I]`` projection) in fp32/fp16/bf16, same dtype; returns ``out [rows, I]`` in
that dtype (written when given; not overlapping an input). The unfused torch form ``F.silu(g) * u`` rounds twice
in 16-bit dtypes; this rounds once. ``swiglu_ref`` is the plain-torch reference in fp64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_no_overlap, check_operand

__all__ = ["swiglu", "swiglu_ref"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


# Row strides and sizes are specialised (fixed per model): a multiple of 16 is what lets the loads and
# stores be 16-byte vectors; per-call strides would make every access a single element.
@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n_cols, sg, su, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    g = tl.load(g_ptr + row * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + offs, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * so + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    check_operand("gate", gate, dtype=_FLOAT, ndim=2, last_dim_contiguous=True)
    like = dict(dtype=gate.dtype, ndim=2, last_dim_contiguous=True, shape=tuple(gate.shape), device=gate.device)
    check_operand("up", up, **like)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    else:
        check_operand("out", out, **like)
    check_no_overlap({"out": out}, {"gate": gate, "up": up})
    n, cols = gate.shape
    if n and cols:
        grid = (n, _rt.cdiv(cols, BLOCK))
        _swiglu_kernel[grid](gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference: fp64 ``silu(gate) * up``, rounded to gate's dtype."""
    g = gate.double()
    return (g * torch.sigmoid(g) * up.double()).to(gate.dtype)
