"""Per-tensor FP8 quantisation of K/V/Q: ``e4m3(x * kv_scale_orig_quant)``.

Semantics (the caller-quantised input contract of NOTES §1): each element is multiplied by
``kv_scale_orig_quant`` in fp32 (the product rounded to fp32 once), then encoded as ``torch.float8_e4m3fn``
with round-to-nearest-even, saturating at ±448 (±inf -> ±448, NaN -> NaN). The multiply is what the
quantising side does; the attention kernel dequantises with the reciprocal ``kv_scale_quant_orig``. Passing
the reciprocal here by mistake is the reference system's 4x bug, so the tests run s in {1, 1.5, 2}.

Layouts. ``x`` may be any rank >= 1 with its last dimension contiguous; the other strides are free, so V
sliced out of a wider K/V projection (``kv[..., 128:]``) is read in place. Leading dimensions are collapsed
into at most two row axes by stride arithmetic; a layout that does not collapse (rank >= 4 with unrelated
strides) is copied once with ``contiguous()``. With ``transpose_tokens=True`` the output holds the first
("token") dimension last, contiguous: ``x [T, H, d] -> out [H, d, T]``, the layout an FP8 P·V product wants
for V (reduction dimension contiguous). The kernel writes that layout directly (tiles are transposed on chip,
no second pass over memory); checked bit-exact on the H200, its speed not yet benchmarked.

The scale may be a Python float or a 1-element fp32 tensor on the kernel device; a tensor is read inside the
kernel, so a captured CUDA graph picks up a new value written into it before replay.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import FP8, check_launch_device, check_no_overlap, check_tensor, same_device
from kvforge.kernels._fp8 import e4m3_ref, fp32_to_e4m3_byte, native_e4m3_store
from kvforge.kernels._runtime import ConfigTable, TunedKernel, cdiv, kernel_device, next_pow2
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = ["quantize_fp8", "quantize_fp8_ref", "selfcheck"]

_MAX_GRID_YZ = 65535
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["n_inner", "n_outer"])
def _quantize_fp8_kernel(
    x_ptr,
    out_ptr,  # uint8 view of the e4m3 output
    scale_ptr,
    scale_val,
    n_inner,
    n_outer,
    d,
    sx_outer,
    sx_inner,
    so_outer,
    so_inner,
    so_d,
    SCALE_IS_PTR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NATIVE: tl.constexpr = False,
):
    # Axis 0 walks the inner row axis (the one with the smaller output stride), so a tile's rows are
    # contiguous in the output when the output is token-major; axis 1 is the outer row axis, folded because
    # grid axes 1/2 stop at 65,535; axis 2 splits a wide last dimension.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = (cols < d)[None, :]
    if SCALE_IS_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_val
    # A transposed output is contiguous along the rows, where a row mask varies at an unknown point (n_inner is a
    # per-call int), so a store under it goes one byte at a time. Full row tiles take a loop of their own under
    # the column mask alone (16-byte stores); only the last tile masks each row.
    if (tl.program_id(0) + 1) * BLOCK_R <= n_inner:
        _quantize_tiles(x_ptr, out_ptr, scale, rows, cols, cmask, n_outer, sx_outer, sx_inner, so_outer, so_inner,
                        so_d, NATIVE)  # fmt: skip
    else:
        _quantize_tiles(x_ptr, out_ptr, scale, rows, cols, (rows < n_inner)[:, None] & cmask, n_outer, sx_outer,
                        sx_inner, so_outer, so_inner, so_d, NATIVE)  # fmt: skip


@triton.jit
def _quantize_tiles(x_ptr, out_ptr, scale, rows, cols, mask, n_outer, sx_outer, sx_inner, so_outer, so_inner, so_d,
                    NATIVE: tl.constexpr):  # fmt: skip
    """This program's tile at every outer row it owns: load, scale, encode, store under ``mask``."""
    for outer in range(tl.program_id(1), n_outer, tl.num_programs(1)):
        o = tl.cast(outer, tl.int64)
        src = x_ptr + o * sx_outer + rows[:, None] * sx_inner + cols[None, :]
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + o * so_outer + rows[:, None] * so_inner + cols[None, :] * so_d
        tl.store(dst, fp32_to_e4m3_byte(x * scale, NATIVE), mask=mask)


def _keep(cfg: triton.Config, key: tuple) -> bool:
    # A tile wider than the padded head dim only masks lanes off.
    return cfg.kwargs["BLOCK_D"] <= max(16, next_pow2(key[1]))


_SM90 = [
    triton.Config({"BLOCK_R": r, "BLOCK_D": dd}, num_warps=w)
    for r, dd, w in [(32, 64, 4), (64, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4)]
]
_TABLE = ConfigTable(
    fallback=[triton.Config({"BLOCK_R": 32, "BLOCK_D": 64}, num_warps=4)],
    interpreter=triton.Config({"BLOCK_R": 16, "BLOCK_D": 64}, num_warps=1),
    by_arch={(9, 0): _SM90},
    keep=_keep,
)
_KERNEL = TunedKernel("quantize_fp8", _quantize_fp8_kernel, _TABLE)


def _collapse(shape: list[int], x_strides: list[int], o_strides: list[int]) -> list[tuple[int, int, int]] | None:
    """Leading dims as (size, x stride, out stride), merged where both layouts allow; None if > 2 remain."""
    dims = [(n, sx, so) for n, sx, so in zip(shape, x_strides, o_strides) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, sx, so in dims:
        if merged:
            pn, psx, pso = merged[-1]
            if psx == sx * n and pso == so * n:
                merged[-1] = (pn * n, sx, so)
                continue
        merged.append((n, sx, so))
    if len(merged) > 2:
        return None
    # The inner row axis is the one with the smaller output stride (rows contiguous in a token-major output).
    merged.sort(key=lambda t: -abs(t[2]))
    while len(merged) < 2:
        merged.insert(0, (1, 0, 0))
    return merged


def _check_scale(kv_scale_orig_quant: object, device: torch.device) -> tuple[torch.Tensor | None, float]:
    s = kv_scale_orig_quant
    if isinstance(s, torch.Tensor):
        if s.dtype != torch.float32:
            raise TypeError(f"kv_scale_orig_quant: expected a float32 tensor, got {s.dtype}")
        if s.numel() != 1:
            raise ValueError(f"kv_scale_orig_quant: expected a 1-element tensor, got shape {tuple(s.shape)}")
        if not same_device(s.device, device):
            raise ValueError(f"kv_scale_orig_quant: expected a tensor on {device}, got one on {s.device}")
        return s, 1.0
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"kv_scale_orig_quant: expected a float or a 1-element fp32 tensor, got {type(s).__name__}")
    if not math.isfinite(float(s)):
        raise ValueError(f"kv_scale_orig_quant: expected a finite scale, got {s}")
    return None, float(s)


def quantize_fp8(
    x: torch.Tensor,
    kv_scale_orig_quant: float | torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    transpose_tokens: bool = False,
) -> torch.Tensor:
    """Quantise ``x`` (bf16/fp16/fp32, rank >= 1, last dim contiguous) to e4m3(x * kv_scale_orig_quant).

    Returns ``out`` (allocated when None): ``torch.float8_e4m3fn`` of ``x.shape``, or with
    ``transpose_tokens=True`` of ``[*x.shape[1:], x.shape[0]]`` (rank <= 3). A given ``out`` must have that
    shape with its last dimension contiguous; its other strides are free (e.g. a token slice of a larger
    token-major buffer). An empty ``x`` launches nothing. Raises TypeError/ValueError before any launch.
    """
    check_tensor("x", x, dtype=_IN_DTYPES)
    if x.device.type != kernel_device().type:
        raise ValueError(f"x: expected a tensor on {kernel_device()} (where kernels run), got one on {x.device}")
    check_launch_device("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension, got a 0-d tensor")
    check_tensor("x", x, last_dim_contiguous=True)
    if transpose_tokens and x.dim() > 3:
        raise ValueError(f"x: transpose_tokens supports rank <= 3, got shape {tuple(x.shape)}")
    scale_t, scale_v = _check_scale(kv_scale_orig_quant, x.device)
    out_shape = (*x.shape[1:], x.shape[0]) if transpose_tokens else tuple(x.shape)
    if out is None:
        out = torch.empty(out_shape, dtype=FP8, device=x.device)
    else:
        check_tensor("out", out, dtype=FP8, device=x.device, last_dim_contiguous=True)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out: expected shape {list(out_shape)}, got {list(out.shape)}")
        check_launch_device("out", out)
        # A stride-0 or self-overlapping out writes several elements to one place; an out sharing x's memory
        # overwrites input the other programs have yet to read.
        check_no_overlap({"out": out}, {"x": x, "kv_scale_orig_quant": scale_t})
    if x.numel() == 0:
        return out
    # The output seen in x's index order: for token-major output the token dim is its last dim.
    out_x = out.movedim(-1, 0) if transpose_tokens else out
    d = x.shape[-1]
    lead = _collapse(list(x.shape[:-1]), list(x.stride()[:-1]), list(out_x.stride()[:-1]))
    if lead is None:
        x = x.contiguous()  # a leading layout no two row axes can express: one copy, documented above
        lead = _collapse(list(x.shape[:-1]), list(x.stride()[:-1]), list(out_x.stride()[:-1]))
        if lead is None:
            raise ValueError(f"out: strides {out.stride()} do not collapse to two row axes; pass a contiguous out")
    (n_outer, sx_outer, so_outer), (n_inner, sx_inner, so_inner) = lead
    so_d = out_x.stride(-1) if d > 1 else 1
    if cdiv(d, 16) > _MAX_GRID_YZ:
        raise ValueError(f"x: last dimension {d} is too wide for one launch (at most {_MAX_GRID_YZ * 16})")
    key = (str(x.dtype), d, bool(transpose_tokens))
    scale_arg = scale_t if scale_t is not None else x
    o8 = out.view(torch.uint8)
    ints = (d, sx_outer, sx_inner, so_outer, so_inner, so_d)
    # n_inner / n_outer are do_not_specialize; scale_val is a float (never specialised).
    spec = (
        key,
        ints,
        scale_t is not None,
        tuple((t.dtype, t.device, t.data_ptr() % 16 == 0) for t in (x, o8, scale_arg)),
    )
    _KERNEL.launch_fast(
        lambda m: (cdiv(n_inner, m["BLOCK_R"]), min(n_outer, _MAX_GRID_YZ), cdiv(d, m["BLOCK_D"])),
        key,
        spec,
        (x, o8, scale_arg, scale_v, n_inner, n_outer, *ints),
        SCALE_IS_PTR=scale_t is not None,
        NATIVE=native_e4m3_store(x.device),
    )
    return out


def quantize_fp8_ref(
    x: torch.Tensor, kv_scale_orig_quant: float | torch.Tensor, *, transpose_tokens: bool = False
) -> torch.Tensor:
    """Plain torch: fp32 product, then saturate and round-to-nearest-even with torch's own e4m3 cast."""
    s = torch.as_tensor(kv_scale_orig_quant, dtype=torch.float32).reshape(()).to(x.device)
    y = e4m3_ref(x.float() * s)
    return y.movedim(0, -1).contiguous() if transpose_tokens else y


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum()
    return float(diff), bool(diff == 0)


def selfcheck(device: torch.device) -> list[CheckRow]:
    g = torch.Generator().manual_seed(2)
    kv = (torch.randn(37, 3, 96, generator=g) * 200).to(torch.bfloat16).to(device)
    v = kv[..., 32:]  # strided rows: V sliced out of a wider projection

    def plain() -> tuple[float, bool]:
        return _bits_equal(quantize_fp8(v, 1.5), quantize_fp8_ref(v, 1.5))

    def token_major() -> tuple[float, bool]:
        s = torch.tensor([2.0], device=device)
        return _bits_equal(quantize_fp8(v, s, transpose_tokens=True), quantize_fp8_ref(v, 2.0, transpose_tokens=True))

    shapes = "x[37,3,96][...,32:] bf16"
    return [
        timed_check("quantize_fp8", device, shapes, plain, unit="mismatched bytes"),
        timed_check("quantize_fp8 (token-major)", device, shapes, token_major, unit="mismatched bytes"),
    ]
