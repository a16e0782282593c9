"""Host-side argument checks shared by the launchers: each raises before any launch and names the argument."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FP8 = torch.float8_e4m3fn


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
