"""Greedy choice and draft acceptance in one launch: per request, the argmax of each verified position's
logits and the number of tokens accepted.

``greedy_accept(logits, tokens)``: ``logits [B, T, V]`` fp32/fp16/bf16 (last dimension contiguous), ``tokens
[B, T]`` int32/int64, the step's input tokens (the last emitted token, then the ``T - 1`` drafts). Returns
``best [B, T]`` int32 (``argmax`` over V; the first index of the maximum; a NaN counts as the maximum, as in
``torch.argmax``) and ``accepted [B]`` int32: ``1 +`` the length of the leading run of ``t >= 1`` with
``tokens[b, t] == best[b, t - 1]`` (the drafts the target agrees with), so ``1 <= accepted <= T``.
``limits [B]`` int32 (optional): at most that many accepted per request (a request's last step may have fewer
tokens left than ``T``; values in 1 .. T). ``out`` buffers are written when given. ``greedy_accept_ref`` is the
plain-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_no_overlap, check_operand

__all__ = ["greedy_accept", "greedy_accept_ref"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_V = 2048
MAX_T = 16


@triton.jit(do_not_specialize=["V", "sl_b", "sl_t", "st_b"])
def _greedy_accept_kernel(logits_ptr, tok_ptr, best_ptr, acc_ptr, lim_ptr, V, sl_b, sl_t, st_b,
                          T: tl.constexpr, BLOCK_V: tl.constexpr, LIMITS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    acc = 1
    alive = 1
    prev = 0
    for t in tl.static_range(T):
        best_v = -float("inf")
        best_i = 0
        found = 0
        base = logits_ptr + b * sl_b + t * sl_t
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
            m = tl.max(x, 0)
            i = tl.min(tl.where(x == m, offs, V), 0)  # the first index of this block's maximum
            # Strictly greater: an equal maximum in a later block keeps the earlier index. The first block is
            # always taken, so an all -inf row still names index 0's block.
            take = (m > best_v) | (found == 0)
            best_i = tl.where(take, i, best_i)
            best_v = tl.where(take, m, best_v)
            found = 1
        tl.store(best_ptr + b * T + t, best_i.to(tl.int32))
        if t > 0:
            tok = tl.load(tok_ptr + b * st_b + t).to(tl.int64)
            alive = alive & (tok == prev).to(tl.int32)
            acc += alive
        prev = best_i.to(tl.int64)
    if LIMITS:
        acc = tl.minimum(acc, tl.load(lim_ptr + b))
    tl.store(acc_ptr + b, acc.to(tl.int32))


def greedy_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    best: torch.Tensor | None = None,
    accepted: torch.Tensor | None = None,
    limits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_operand("logits", logits, dtype=_FLOAT, ndim=3, last_dim_contiguous=True)
    b, t, v = logits.shape
    if not 1 <= t <= MAX_T:
        raise ValueError(f"logits: expected 1 .. {MAX_T} positions per request, got {t}")
    if v < 1 or v >= 2**31:
        raise ValueError(f"logits: expected a vocabulary of 1 .. 2^31 - 1 entries, got {v}")
    ints = (torch.int32, torch.int64)
    check_operand("tokens", tokens, dtype=ints, ndim=2, last_dim_contiguous=True, shape=(b, t), device=logits.device)
    if limits is not None:  # values are the caller's (1 .. T); reading them back would sync
        check_operand("limits", limits, dtype=torch.int32, ndim=1, contiguous=True, shape=(b,), device=logits.device)
    outs = {}
    for name, buf, shape in (("best", best, (b, t)), ("accepted", accepted, (b,))):
        if buf is None:
            buf = torch.empty(shape, dtype=torch.int32, device=logits.device)
        else:
            check_operand(name, buf, dtype=torch.int32, ndim=len(shape), contiguous=True, shape=shape,
                          device=logits.device)  # fmt: skip
        outs[name] = buf
    check_no_overlap(outs, {"logits": logits, "tokens": tokens, "limits": limits})
    if b:
        lim = limits if limits is not None else outs["accepted"]  # a placeholder pointer when there are none
        _greedy_accept_kernel[(b,)](
            logits, tokens, outs["best"], outs["accepted"], lim, v, logits.stride(0), logits.stride(1),
            tokens.stride(0), T=t, BLOCK_V=min(BLOCK_V, _rt.next_pow2(v)), LIMITS=limits is not None,
            num_warps=4,
        )  # fmt: skip
    return outs["best"], outs["accepted"]


def greedy_accept_ref(
    logits: torch.Tensor, tokens: torch.Tensor, limits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``torch.argmax`` per position on the host, acceptance by a Python loop."""
    lg = logits.detach().double().cpu()
    best = lg.argmax(-1)
    acc = []
    for bi in range(lg.shape[0]):
        a = 1
        while a < lg.shape[1] and int(tokens[bi, a]) == int(best[bi, a - 1]):
            a += 1
        acc.append(a if limits is None else min(a, int(limits[bi])))
    return best.to(torch.int32), torch.tensor(acc, dtype=torch.int32)
