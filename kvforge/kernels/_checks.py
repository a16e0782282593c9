"""Host-side argument checks shared by the launchers: each raises before any launch and names the argument."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

FP8 = torch.float8_e4m3fn


def check_int(name: str, v: object, lo: int, hi: int | None = None) -> int:
    """``v`` as an int in ``[lo, hi]`` (no upper bound when ``hi`` is None); a bool is not an int here."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: expected an int in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    ndim: int | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {t.stride()})")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected the last dimension contiguous (stride 1), got strides {t.stride()}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def check_shape(name: str, t: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    """``expected`` may hold None for a free dimension."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def check_launch_device(name: str, t: torch.Tensor) -> None:
    """Refuse tensors a kernel cannot read: meta tensors always (a launch on one reads a null pointer and
    poisons the CUDA context for the whole process), CPU tensors unless Triton's interpreter is on."""
    from kvforge.kernels._runtime import interpreting

    kind = t.device.type
    if kind == "meta":
        raise ValueError(f"{name}: expected a tensor with storage on a CUDA device, got a meta tensor")
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return
    want = "a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1)"
    raise ValueError(f"{name}: expected {want}, got one on {t.device}")


def check_operand(
    name: str,
    t: object,
    *,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
    **tensor_checks: Any,
) -> torch.Tensor:
    """A kernel operand: :func:`check_tensor` (``tensor_checks``), :func:`check_launch_device`, then with ``shape``
    :func:`check_shape` and with ``device`` the device of the operand it goes with (``shape``/``device`` of the
    leading tensor, checked after the launch device so a meta tensor is reported as such)."""
    t = check_tensor(name, t, **tensor_checks)
    check_launch_device(name, t)
    if shape is not None:
        check_shape(name, t, shape)
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


# ---- Overlapping outputs ---------------------------------------------------------------------------------------
# A kernel that writes through two aliases of one element (a stride-0 dimension, an output that is also an input,
# two outputs sharing memory) races or reads its own half-written results. These checks work on the byte ranges
# tensors cover: cheap, and exact except for strided views interleaved inside one another's range, which are
# enumerated when small and otherwise refused (the safe answer).

_EXACT_LIMIT = 1 << 20  # elements per tensor below which interleaved views are compared element by element


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[lo, hi)``: the bytes ``t`` may touch (None for an empty tensor). Strides are non-negative in torch."""
    n = t.numel()
    if n == 0:
        return None
    lo = t.data_ptr()
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return lo, lo + n * t.element_size()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (extent + 1) * t.element_size()


def has_internal_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (a stride-0 dimension of size > 1, or strides too small
    for the sizes below them). A False answer is exact; a True answer is conservative for exotic layouts."""
    if t.is_contiguous():
        return False
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # elements spanned by the dimensions of smaller stride, minus one
    for s, n in dims:
        if s == 0 or s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    off = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return off.reshape(-1)


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` may share a byte (same device and intersecting ranges, confirmed element by element
    when both are small views of the same element size; larger interleaved views count as overlapping)."""
    if a.device != b.device or a.device.type == "meta":
        return False
    sa, sb = byte_span(a), byte_span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    es = a.element_size()
    if b.element_size() != es or (a.data_ptr() - b.data_ptr()) % es or max(a.numel(), b.numel()) > _EXACT_LIMIT:
        return True
    shift = (a.data_ptr() - b.data_ptr()) // es
    return bool(torch.isin(_element_offsets(a) + shift, _element_offsets(b)).any())


def check_no_overlap(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Refuse (ValueError) an output with internally overlapping elements, two outputs sharing memory, or an
    output sharing memory with an input. ``None`` entries are skipped. Each tensor's byte range is computed once;
    the element-wise comparison runs only for ranges that intersect (rare), so the common call costs a few
    microseconds per tensor."""
    outs = [(n, t, byte_span(t)) for n, t in outputs.items() if t is not None]
    ins = [(n, t, byte_span(t)) for n, t in inputs.items() if t is not None]
    for i, (name, t, span) in enumerate(outs):
        if has_internal_overlap(t):
            raise ValueError(
                f"{name}: expected an output whose elements do not share memory, got shape {list(t.shape)} "
                f"with strides {t.stride()} (a stride-0 or overlapping view)"
            )
        if span is None:
            continue
        for other, u, uspan in outs[i + 1 :] + ins:
            if uspan is None or span[1] <= uspan[0] or uspan[1] <= span[0]:
                continue
            if tensors_overlap(t, u):
                raise ValueError(f"{name}: overlaps {other} in memory; expected a separate output buffer")
