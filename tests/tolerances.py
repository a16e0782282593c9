"""One tolerance table, per dtype, for every numerics test (atol, rtol)."""

from __future__ import annotations

import torch

TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float8_e4m3fn: (7e-2, 7e-2),
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOL[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=msg or None)


def rel_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """sqrt(mean((a-e)^2)) / sqrt(mean(e^2)): fla's whole-tensor accuracy measure."""
    a, e = actual.double(), expected.double()
    denom = e.pow(2).mean().sqrt().clamp_min(1e-30)
    return float((a - e).pow(2).mean().sqrt() / denom)
