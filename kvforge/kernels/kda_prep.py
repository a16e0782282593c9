"""KDA's per-token inputs from one fused projection row, in one pass: L2 norms, the decay gate, the beta gate.

``kda_prepare(proj, num_heads, head_dim, gate_bias=-2.0, out=None)``: ``proj [T, 4 * H * K + H]`` in
fp32/fp16/bf16 (any row stride, the last dimension contiguous), its columns ``q | k | v | g | b`` (``H * K`` each,
then ``H``): the output of one GEMM against the concatenated KDA projection weights. Returns ``(q, k, v, g,
beta)``, all contiguous: ``q, k [T, H, K]`` L2-normalised per head (``x / max(||x||, 1e-12)``, as
``F.normalize``), ``v [T, H, K]`` copied, the three in proj's dtype; ``g [T, H, K]`` fp32 log decay
``-softplus(g + gate_bias)`` (torch's softplus: ``x`` above 20); ``beta [T, H]`` fp32 ``sigmoid(b)``. Everything
is computed in fp32 from proj's values and rounded once. ``out``: the five outputs to write (shapes and dtypes
as above, not overlapping ``proj`` or one another). One program per (token, head); ``K`` up to 1,024.
``kda_prepare_ref`` is the plain-torch reference (fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_int, check_no_overlap, check_operand

__all__ = ["kda_prepare", "kda_prepare_ref"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
MAX_K = 1024
_NORM_EPS = 1e-12  # F.normalize's default
_SOFTPLUS_THRESHOLD = 20.0  # torch's softplus returns x itself above this


# Row strides and sizes are specialised (fixed per model): a multiple of 16 is what lets the loads and
# stores be 16-byte vectors; per-call strides would make every access a single element.
@triton.jit
def _kda_prepare_kernel(
    p_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, sp, gate_bias,
    H: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    m = offs < K
    row = p_ptr + t * sp + h * K + offs
    hk = H * K
    q = tl.load(row, mask=m, other=0.0).to(tl.float32)
    k = tl.load(row + hk, mask=m, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * hk, mask=m, other=0.0)
    g = tl.load(row + 3 * hk, mask=m, other=0.0).to(tl.float32) + gate_bias
    b = tl.load(p_ptr + t * sp + 4 * hk + h).to(tl.float32)
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
    k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
    # softplus(x) = log(1 + e^x); above the threshold torch returns x (e^x would overflow soon after).
    sp_g = tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(tl.minimum(g, 20.0))))
    o = (t * H + h) * K + offs
    tl.store(q_ptr + o, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(k_ptr + o, k.to(k_ptr.dtype.element_ty), mask=m)
    tl.store(v_ptr + o, v.to(v_ptr.dtype.element_ty), mask=m)
    tl.store(g_ptr + o, -sp_g, mask=m)
    tl.store(b_ptr + t * H + h, 1.0 / (1.0 + tl.exp(-b)))


def kda_prepare(
    proj: torch.Tensor,
    num_heads: int,
    head_dim: int,
    gate_bias: float = -2.0,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_operand("proj", proj, dtype=_FLOAT, ndim=2, last_dim_contiguous=True)
    h = check_int("num_heads", num_heads, 1)
    kd = check_int("head_dim", head_dim, 1, MAX_K)
    if proj.shape[1] != 4 * h * kd + h:
        raise ValueError(
            f"proj: expected {4 * h * kd + h} columns (q, k, v, g of {h} x {kd}, then {h} beta), got {proj.shape[1]}"
        )
    if isinstance(gate_bias, bool) or not isinstance(gate_bias, (int, float)) or gate_bias != gate_bias:
        raise ValueError(f"gate_bias: expected a finite number, got {gate_bias!r}")
    if abs(gate_bias) == float("inf"):
        raise ValueError(f"gate_bias: expected a finite number, got {gate_bias!r}")
    t = proj.shape[0]
    shapes = ((t, h, kd),) * 4 + ((t, h),)
    dtypes = (proj.dtype,) * 3 + (torch.float32,) * 2
    names = ("q", "k", "v", "g", "beta")
    if out is None:
        outs = tuple(torch.empty(s, dtype=d, device=proj.device) for s, d in zip(shapes, dtypes))
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 5:
            raise TypeError(f"out: expected a tuple of 5 tensors (q, k, v, g, beta), got {type(out).__name__}")
        for name, o, s, d in zip(names, out, shapes, dtypes):
            check_operand(f"out ({name})", o, dtype=d, contiguous=True, shape=s, device=proj.device)
        outs = tuple(out)
    check_no_overlap({f"out ({n})": o for n, o in zip(names, outs)}, {"proj": proj})
    if t:
        _kda_prepare_kernel[(t, h)](
            proj, *outs, proj.stride(0), float(gate_bias), H=h, K=kd, BLOCK_K=_rt.next_pow2(kd),
            num_warps=1 if kd <= 128 else 4,
        )  # fmt: skip
    return outs  # type: ignore[return-value]


def kda_prepare_ref(
    proj: torch.Tensor, num_heads: int, head_dim: int, gate_bias: float = -2.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: plain torch in fp32 on the same columns."""
    h, kd = num_heads, head_dim
    hk = h * kd
    p = proj.float()
    shape = (-1, h, kd)
    q = F.normalize(p[:, :hk].reshape(shape), dim=-1, eps=_NORM_EPS).to(proj.dtype)
    k = F.normalize(p[:, hk : 2 * hk].reshape(shape), dim=-1, eps=_NORM_EPS).to(proj.dtype)
    v = proj[:, 2 * hk : 3 * hk].reshape(shape).clone()
    g = -F.softplus(p[:, 3 * hk : 4 * hk].reshape(shape) + gate_bias, threshold=_SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(p[:, 4 * hk :])
    return q, k, v, g, beta
