"""MLA's latent cache rows straight into their pages, one pass: RMSNorm of ``c_kv``, rotary of ``k_rope``, store.

``mla_latent_store(kv, weight, positions, cos_sin, pool, rows, eps=1e-6)``: ``kv [T, r + R]`` (any row stride,
the last dimension contiguous; e.g. the ``kv_a`` columns of a fused projection) in fp32/fp16/bf16, ``weight [r]``
the norm weight, ``positions [T]`` int32/int64, ``cos_sin [P, R]`` fp32 (:func:`kvforge.kernels.rotary.rotary_table`),
``pool [pages, tokens_per_block, r + R]`` contiguous in kv's dtype, ``rows [T]`` int32/int64 flat row indices
(``page * tokens_per_block + offset``). Row ``rows[t]`` of the pool becomes ``[rms(kv[t, :r]) * weight,
rope(kv[t, r:], positions[t])]``, both computed in fp32 and rounded once: the values ``rms_norm`` and ``rotary``
write, without the ``[T, r + R]`` temporary and its scatter. Positions must lie in ``[0, P)`` and rows in the
pool, checked on the host only with ``check_values`` (a device read); duplicate rows are the caller's bug.
``mla_latent_store_ref`` is the plain-torch reference (fp32; returns the rows instead of storing them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_no_overlap, check_operand

__all__ = ["mla_latent_store", "mla_latent_store_ref"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)
MAX_R = 4096


# Row strides and sizes are specialised (fixed per model): a multiple of 16 is what lets the loads and
# stores be 16-byte vectors; per-call strides would make every access a single element.
@triton.jit
def _mla_latent_kernel(
    kv_ptr, w_ptr, pos_ptr, cs_ptr, pool_ptr, rows_ptr, sk, eps,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    width = R + 2 * HALF
    dst = pool_ptr + tl.load(rows_ptr + t).to(tl.int64) * width
    src = kv_ptr + t * sk
    offs = tl.arange(0, BLOCK_R)
    m = offs < R
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / R + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + offs, (x * inv * w).to(pool_ptr.dtype.element_ty), mask=m)
    oh = tl.arange(0, BLOCK_H)
    mh = oh < HALF
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cs_ptr + p * 2 * HALF + oh, mask=mh, other=0.0)
    s = tl.load(cs_ptr + p * 2 * HALF + HALF + oh, mask=mh, other=0.0)
    x1 = tl.load(src + R + oh, mask=mh, other=0.0).to(tl.float32)
    x2 = tl.load(src + R + HALF + oh, mask=mh, other=0.0).to(tl.float32)
    tl.store(dst + R + oh, (x1 * c - x2 * s).to(pool_ptr.dtype.element_ty), mask=mh)
    tl.store(dst + R + HALF + oh, (x1 * s + x2 * c).to(pool_ptr.dtype.element_ty), mask=mh)


def mla_latent_store(
    kv: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    eps: float = 1e-6,
    *,
    check_values: bool = False,
) -> None:
    """See the module docstring."""
    check_operand("kv", kv, dtype=_FLOAT, ndim=2, last_dim_contiguous=True)
    t = kv.shape[0]
    check_operand("weight", weight, dtype=_FLOAT, ndim=1, contiguous=True, device=kv.device)
    r = weight.shape[0]
    rope = kv.shape[1] - r
    if r < 1 or r > MAX_R:
        raise ValueError(f"weight: expected 1 .. {MAX_R} norm weights, got {r}")
    if rope < 2 or rope % 2 or rope > MAX_R:
        raise ValueError(f"kv: expected {r} norm columns then an even rotary width 2 .. {MAX_R}, got {kv.shape[1]}")
    check_operand("positions", positions, dtype=_INTS, ndim=1, contiguous=True, shape=(t,), device=kv.device)
    check_operand(
        "cos_sin", cos_sin, dtype=torch.float32, ndim=2, contiguous=True, shape=(None, rope), device=kv.device
    )
    check_operand("pool", pool, dtype=kv.dtype, ndim=3, contiguous=True, shape=(None, None, r + rope), device=kv.device)
    check_operand("rows", rows, dtype=_INTS, ndim=1, contiguous=True, shape=(t,), device=kv.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values: expected a bool, got {type(check_values).__name__}")
    inputs = {"kv": kv, "weight": weight, "positions": positions, "cos_sin": cos_sin, "rows": rows}
    check_no_overlap({"pool": pool}, inputs)
    if check_values and t:
        n_rows = pool.shape[0] * pool.shape[1]
        for name, v, hi in (("positions", positions, cos_sin.shape[0]), ("rows", rows, n_rows)):
            lo_v, hi_v = int(v.min()), int(v.max())
            if lo_v < 0 or hi_v >= hi:
                raise ValueError(f"{name}: expected values in [0, {hi}), got {lo_v} .. {hi_v}")
    if t:
        half = rope // 2
        _mla_latent_kernel[(t,)](
            kv, weight, positions, cos_sin, pool, rows, kv.stride(0), float(eps), R=r, HALF=half,
            BLOCK_R=_rt.next_pow2(r), BLOCK_H=_rt.next_pow2(half), num_warps=4 if r > 1024 else 2,
        )  # fmt: skip


def mla_latent_store_ref(
    kv: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The rows the kernel stores ``[T, r + R]`` in kv's dtype: fp32 norm, fp32 rotation by angles
    ``p * inv_freq`` (computed in fp32, as the table is)."""
    r = weight.shape[0]
    x = kv[:, :r].float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    ang = positions.float()[:, None] * inv_freq.float()[None, :]
    c, s = ang.cos(), ang.sin()
    x1, x2 = kv[:, r:].float().chunk(2, dim=-1)
    return torch.cat([y, x1 * c - x2 * s, x1 * s + x2 * c], -1).to(kv.dtype)
