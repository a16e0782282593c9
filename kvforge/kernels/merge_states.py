"""Exact log-sum-exp merge of partial attention outputs (helix context parallelism, chunked-prefix attention).

Each of S partial results attended over a disjoint share of the keys and returned its output ``O_i`` and the
log-sum-exp ``lse_i`` of its scaled scores (fp32, natural log, ``[tokens, H]``: the convention of
``mla_context_attention(..., return_lse=True)``). Attention over the union of the keys is

    lse = log Σ_i exp(lse_i)          O = Σ_i exp(lse_i − lse) · O_i

A share with no keys reports ``lse_i = −inf``; it contributes nothing even when its ``O_i`` holds NaN (an empty
softmax is 0/0 in many kernels). When every share is empty the merged row is 0 with ``lse = −inf``. An lse of
+inf or NaN is not a valid input and yields NaN.

Accepted layouts: ``outputs`` ``[S, T, H, D]`` (or a list of S ``[T, H, D]`` tensors, stacked on the host) in
fp32/fp16/bf16 with D contiguous; ``lses`` ``[S, T, H]`` (or a list) in fp32. The kernel works in fp32 and
writes ``out`` ``[T, H, D]`` (the outputs' dtype unless ``out`` is given) and ``out_lse`` ``[T, H]`` fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_shape, check_tensor
from kvforge.kernels._runtime import ConfigTable, TunedKernel, cdiv, launch_jit, next_pow2

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _merge_states_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    out_lse_ptr,
    S,
    R,
    H,
    D,
    s_os,
    s_ot,
    s_oh,
    s_ls,
    s_lt,
    s_lh,
    s_out_t,
    s_out_h,
    s_olse_t,
    s_olse_h,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_r = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < R
    t = rows // H
    h = rows % H
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    cmask = cols < D
    lse_row = t * s_lt + h * s_lh
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    # A NaN or +inf lse is invalid input; the row must come out NaN. max() may drop a NaN and exp(inf - inf) is
    # NaN only by accident of order, so the row is flagged explicitly (−inf would mean "no keys" to a later merge).
    bad = tl.zeros((BLOCK_R,), tl.int1)
    # `while` rather than `range(0, S)`: Triton 3.6's interpreter cannot turn a runtime int argument (a shape-(1,)
    # array) into a `range` bound under NumPy >= 2.4. Compiled, both lower to the same counted loop.
    s = 0
    while s < S:
        lse_s = tl.load(lse_ptr + s * s_ls + lse_row, mask=rmask, other=float("-inf"))
        m = tl.maximum(m, lse_s)
        bad = bad | (lse_s != lse_s) | (lse_s == float("inf"))
        s += 1
    # All shares empty: shift by 0 so every weight is exp(-inf) = 0 instead of exp(nan).
    m_safe = tl.where((m == float("-inf")) | bad, 0.0, m)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    denom = tl.zeros((BLOCK_R,), tl.float32)
    o_row = t * s_ot + h * s_oh
    mask2 = rmask[:, None] & cmask[None, :]
    s = 0
    while s < S:
        lse_s = tl.load(lse_ptr + s * s_ls + lse_row, mask=rmask, other=float("-inf"))
        w = tl.exp(lse_s - m_safe)
        o = tl.load(o_ptr + s * s_os + o_row[:, None] + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
        # An empty share's output may be NaN (0/0); weight 0 must drop it, not turn it into 0 * NaN.
        acc += tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0)
        denom += w
        s += 1
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    out = tl.where(bad[:, None], float("nan"), out)
    out_row = t * s_out_t + h * s_out_h
    tl.store(out_ptr + out_row[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask2)
    if pid_d == 0:
        lse = tl.where(denom > 0.0, m_safe + tl.log(tl.where(denom > 0.0, denom, 1.0)), float("-inf"))
        lse = tl.where(bad, float("nan"), lse)
        tl.store(out_lse_ptr + t * s_olse_t + h * s_olse_h, lse, mask=rmask)


def _cfg(br: int, bd: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_R": br, "BLOCK_D": bd}, num_warps=warps, num_stages=1)


def _keep(cfg: triton.Config, key: tuple) -> bool:
    # A D tile much wider than D only wastes lanes; key[0] is D rounded up to a power of two.
    return cfg.kwargs["BLOCK_D"] <= max(16, key[0])


_CONFIGS = ConfigTable(
    fallback=[_cfg(16, 128, 4), _cfg(8, 256, 4), _cfg(32, 64, 4)],
    interpreter=_cfg(16, 64, 1),
    by_arch={9: [_cfg(16, 128, 4), _cfg(8, 256, 4), _cfg(32, 128, 8), _cfg(4, 512, 4), _cfg(32, 64, 4)]},
    keep=_keep,
)
_MERGE = TunedKernel("merge_attention_states", _merge_states_kernel, _CONFIGS)


def _stack(name: str, xs: torch.Tensor | Sequence[torch.Tensor], ndim: int) -> torch.Tensor:
    if isinstance(xs, torch.Tensor):
        return check_tensor(name, xs, ndim=ndim + 1)
    if isinstance(xs, (str, bytes)):
        raise TypeError(f"{name}: expected a tensor or a list of tensors, got {type(xs).__name__}")
    if not isinstance(xs, Sequence) or len(xs) == 0:
        raise ValueError(f"{name}: expected a tensor or a non-empty list of tensors, got {xs!r:.80}")
    first = check_tensor(f"{name}[0]", xs[0], ndim=ndim)
    for i, x in enumerate(xs):
        check_tensor(f"{name}[{i}]", x, ndim=ndim, dtype=first.dtype, device=first.device)
        check_shape(f"{name}[{i}]", x, tuple(first.shape))
    return torch.stack(list(xs))


def merge_attention_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attention results; returns ``(out [T, H, D], out_lse [T, H] fp32)``."""
    o = _stack("outputs", outputs, 3)
    lse = _stack("lses", lses, 2)
    check_tensor("outputs", o, dtype=_FLOATS, last_dim_contiguous=True)
    check_tensor("lses", lse, dtype=torch.float32, device=o.device)
    check_launch_device("outputs", o)
    check_launch_device("lses", lse)
    S, T, H, D = o.shape
    check_shape("lses", lse, (S, T, H))
    if S == 0:
        raise ValueError("outputs: expected at least one partial result, got S = 0")
    if D == 0:
        raise ValueError("outputs: expected a head dimension D >= 1, got 0")
    if out is None:
        out = torch.empty((T, H, D), dtype=o.dtype, device=o.device)
    else:
        check_tensor("out", out, dtype=_FLOATS, ndim=3, device=o.device, last_dim_contiguous=True)
        check_shape("out", out, (T, H, D))
    if out_lse is None:
        out_lse = torch.empty((T, H), dtype=torch.float32, device=o.device)
    else:
        check_tensor("out_lse", out_lse, dtype=torch.float32, ndim=2, device=o.device)
        check_shape("out_lse", out_lse, (T, H))
    check_launch_device("out", out)
    check_launch_device("out_lse", out_lse)
    check_no_overlap({"out": out, "out_lse": out_lse}, {"outputs": o, "lses": lse})
    if T * H == 0:
        return out, out_lse
    fn, grid, args, consts, options = _merge_launch_args(o, lse, out, out_lse)
    launch_jit(fn, grid, args, consts, **options)
    return out, out_lse


def _merge_launch_args(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> tuple:
    """The merge's launch ``(kernel, grid, args, constexprs, options)`` for ``launch_jit`` on checked tensors
    (``o [S, T, H, D]`` with T * H > 0): callers that record launches for replay (``MLAContextPlan``'s key
    shares) take it without ``merge_attention_states``' per-call checks. Picks (and on a GPU, first tunes) the
    config for the key."""
    S, T, H, D = o.shape
    R = T * H
    args = (o, lse, out, out_lse, S, R, H, D, *o.stride()[:3], *lse.stride(), *out.stride()[:2], *out_lse.stride())

    def grid(meta) -> tuple[int, int]:
        return (cdiv(R, meta["BLOCK_R"]), cdiv(D, meta["BLOCK_D"]))

    def run(cfg: triton.Config) -> None:
        launch_jit(_merge_states_kernel, grid(cfg.kwargs), args, cfg.kwargs, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages)  # fmt: skip

    cfg = _MERGE.config_for((next_pow2(D),), run)
    return (
        _merge_states_kernel,
        grid(cfg.kwargs),
        args,
        dict(cfg.kwargs),
        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )


def merge_attention_states_ref(
    outputs: torch.Tensor | Sequence[torch.Tensor], lses: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch fp64 reference: ``torch.logsumexp`` over shares, weights ``exp(lse_i − lse)``."""
    o = (torch.stack(list(outputs)) if not isinstance(outputs, torch.Tensor) else outputs).double()
    lse = (torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses).double()
    bad = (torch.isnan(lse) | torch.isposinf(lse)).any(0)  # invalid input: the row is NaN (module docstring)
    clean = torch.where(bad[None], torch.zeros_like(lse), lse)
    merged = torch.logsumexp(clean, dim=0)
    w = torch.exp(clean - merged)
    w = torch.where(torch.isneginf(clean), torch.zeros_like(w), w)
    contrib = torch.where(w[..., None] > 0, w[..., None] * o, torch.zeros_like(o)).sum(0)
    contrib = torch.where(bad[..., None], torch.full_like(contrib, float("nan")), contrib)
    merged = torch.where(bad, torch.full_like(merged, float("nan")), merged)
    dtype = outputs.dtype if isinstance(outputs, torch.Tensor) else outputs[0].dtype
    return contrib.to(dtype), merged.float()


def attention_with_lse_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of every query row over all keys with its lse, fp64: q [T,H,Dk], k [N,H,Dk], v [N,H,Dv].

    With N = 0 the output is 0 and the lse −inf (the empty-share convention above).
    """
    s = torch.einsum("thd,nhd->htn", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1) if k.shape[0] else torch.full(s.shape[:2], float("-inf"), dtype=torch.float64)
    p = torch.exp(s - lse[..., None]) if k.shape[0] else s
    o = torch.einsum("htn,nhd->thd", p, v.double())
    return o, lse.transpose(0, 1).contiguous()


def selfcheck(device: torch.device) -> list:
    """Merge against the fp64 reference, including an empty share (lse = -inf, output NaN)."""
    from kvforge.kernels._selfcheck import timed_check

    def case(S: int, T: int, H: int, D: int, dtype: torch.dtype):
        def run() -> tuple[float, bool]:
            g = torch.Generator().manual_seed(7 + S * T)
            o = torch.randn(S, T, H, D, generator=g).to(dtype).to(device)
            lse = (torch.randn(S, T, H, generator=g) * 4).to(device)
            lse[0, 0] = float("-inf")
            o[0, 0] = float("nan")
            got, got_lse = merge_attention_states(o, lse)
            ref, ref_lse = merge_attention_states_ref(o, lse)
            # Error in units of the output dtype's tolerance (atol + rtol·|ref|), so 1.0 is the pass line.
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            err = float(((got.double() - ref.double()).abs() / (tol + tol * ref.double().abs())).max())
            finite = torch.isfinite(ref_lse)
            lse_ok = torch.equal(finite, torch.isfinite(got_lse))
            err_lse = float((got_lse.double() - ref_lse.double())[finite].abs().max())
            # Both errors in multiples of their tolerance (the LSE's is 1e-4 absolute), so the row has one unit.
            return max(err, err_lse / 1e-4), lse_ok and err <= 1.0 and err_lse <= 1e-4

        return timed_check("merge_attention_states", device, f"S={S} T={T} H={H} D={D} {dtype}", run, unit="x tol")

    if device.type != "cuda":
        return [case(3, 5, 3, 40, torch.float32), case(2, 4, 2, 24, torch.bfloat16)]
    return [case(4, 64, 128, 512, torch.bfloat16), case(2, 1000, 16, 128, torch.float32)]
