"""MLA context attention over a cached prefix: bf16/fp16 or caller-quantised FP8 (e4m3) inputs.

Each request r brings ``q_len[r]`` new query rows and ``kv_len[r] = cached[r] + q_len[r]`` key/value rows
(``cu_seqlens_q`` / ``cu_seqlens_kv``). Query row i of r sees keys ``0 .. kv_len[r] - q_len[r] + i``: causal,
aligned to the end of the request's KV. DeepSeek-style MLA in context form: d_qk = 192 (128 nope + 64 rope),
d_v = 128, but any d_qk that is a power of two or a sum of two (128 + 64) and any power-of-two d_v work.

FP8 scale contract (NOTES §1): an FP8 tensor holds ``e4m3(x * kv_scale_orig_quant)`` and the kernel dequantises
with ``s = kv_scale_quant_orig = 1 / kv_scale_orig_quant``::

    O = softmax(q·kᵀ · s_q · s_k · softmax_scale) · v · s_v

with ``s_k = s_v = s`` for FP8 K/V (else 1) and ``s_q = s`` for FP8 Q (else 1).

Log-sum-exp (``return_lse=True``): fp32 ``[total_q, H]`` in NATURAL-log units of the scaled scores,
``lse = log Σ_j exp(softmax_scale · s_q · s_k · q·k_j)``, so partial attentions over disjoint key sets merge
exactly as ``O = Σ_i exp(lse_i − lse) · O_i`` with ``lse = log Σ_i exp(lse_i)``.

Layout of the work: the host plans (request, query-tile) items once per batch, heaviest first, so a batch that
mixes one long prefill with many short extends does not end on a tail of idle SMs; the grid is ``items × heads``,
heads outermost for long queries (``HEADS_OUTER``, below) and innermost for short ones. Per tile, keys that every
row of the tile sees are swept without any mask; only the last ``≈ BLOCK_M / BLOCK_N + 1`` key blocks (the causal
diagonal) pay for a score mask, and only a block that reaches outside the request's keys (at most the aligned head
and the block holding the tile's last key) also zeroes its V rows. A batch whose longest query has at most
``SHORT_Q_ROWS`` (64) rows plans with its own config key (64-row tiles), so 64-row extends over long prefixes do
not leave half of every tile idle.

Speed-relevant choices (why; measured on the H200, see bench/results/mla_context_h200*.log):
* ``HEADS_OUTER``: consecutive programs are tiles of one head, so the ~130 programs resident at once read a
  few heads' K/V and share it in L2; heads innermost, they streamed ~130 different heads from DRAM. bf16 +6%,
  FP8 +1% (3 stages) to +9% (4 stages) on the long-query workloads (13b5cd8); with one tile per request (short
  queries) there is nothing to share and heads innermost, which reads neighbouring rows of token-major K, was
  8% faster.
* ``PIPE_QK = 2``: the first head-dim part of the next block's scores (q_a·k_aᵀ, 128 of 192) is issued right
  after this block's P·V and carried into the next iteration, where q_b·k_bᵀ accumulates onto it. Triton makes a
  product that is used in its own iteration synchronous (it waits for every product in flight), so the plain
  loop waits twice per key block; this one waits once, and the matrix unit runs P·V, q_a·k_aᵀ and q_b·k_bᵀ back
  to back: +10-12% FP8 (a55e342, 1ba09ff), +4-6% bf16 (a01c531) once every sweep took this form (see
  ``_carried_sweep``: with one plain loop left, ptxas serialised all of bf16's matrix instructions and the same
  loop lost 18%). Issuing P·V of block j and q_a·k_aᵀ of block j + 2 before block j + 1's softmax (FA3's
  intra-warpgroup overlap) compiled to that schedule but lost 5-16% (7ba5161) and was removed.
* scores are kept in log2 units (``log2(e)`` folded into the one score multiplier) so each probability is one
  ``exp2``. ``EXP_POLY`` sends half of the exponentials to a cubic polynomial on the FMA units (FA4's trick);
  with Triton 3.6 it was 7-13% slower on every tile shape tried, so it is only a tuning knob.
* FP8 P·V: P is in [0, 256] (the running max is offset by 8 in log2 units, so small probabilities stay in
  e4m3's normal range instead of its subnormals) and is cast once per tile; ``v_layout="dim_major"`` stores V
  as ``[H_kv, d_v, tokens]`` so the FP8 matrix instruction reads its reduction dimension (tokens) contiguously:
  2.1-2.3x faster than token-major FP8 V.
* ``USE_TMA``: K, V and Q tiles come through 2-D tensor descriptors (Hopper's bulk copy engine) instead of
  per-thread pointer loads: bf16 169 instead of 202 registers and +3.5% at 3 stages; FP8 within ±2%. For
  dim-major V every key block starts at a 16-byte-aligned token (the request's first block is shifted back and
  masked), which legal descriptor offsets and 16-byte vector loads both need.
* 3 software-pipeline stages instead of 2: +26-45% (FP8) / +28% (bf16); the FP8 kernel then holds 255 registers
  per thread (no spills) and 147.5 KB of shared memory, one 8-warp program per SM.
* Masked blocks never zero K: a masked score is replaced by -inf whatever its K row held, so K stays in shared
  memory for the matrix unit. Zeroing a descriptor-loaded tile forces it through registers and back (an sm_90
  compile showed 1,474 instructions per diagonal iteration against 577 unmasked); the causal-only diagonal
  body is 766 (FP8 128x128, Triton 3.9), and only bounds blocks still zero V.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import FP8, check_tensor, same_device
from kvforge.kernels._fp8 import e4m3_ref, fp32_to_e4m3, native_fp8_cast
from kvforge.kernels._runtime import ConfigTable, TunedKernel, interpreting
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = [
    "MLAContextPlan",
    "mla_context_attention",
    "mla_context_attention_ref",
    "quantize_kv_e4m3",
    "selfcheck",
    "v_to_dim_major",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
V_LAYOUTS = ("token_major", "dim_major")
# Running-max offset (log2 units) on the FP8 P·V path: P = 2**(x - m + 8) lies in [0, 256] ⊂ e4m3's range and
# probabilities down to 2**-14 stay normal numbers. The row sum uses the same offset, so it cancels in O = acc / l.
_FP8_P_OFFSET = 8.0


# ----------------------------------------------------------------------------------------------------- kernel


@triton.jit
def _exp2_poly(x):
    """2**x on the FMA units (x <= 8): 2**floor(x) from the exponent bits times a cubic fit of 2**f on [0, 1).

    Relative error <= 9e-5, far below the bf16/e4m3 rounding that P gets next. Used for half the tile so the
    special-function unit (16 exp2 per clock per SM on Hopper) is not the only producer of probabilities.
    """
    x = tl.maximum(x, -127.0)
    j = tl.floor(x)
    f = x - j
    p = 1.0 + f * (0.69511679 + f * (0.22764499 + f * 0.07706704))
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_tile(x, EXP_POLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if EXP_POLY:
        # Adjacent columns live in the same thread in the matrix-accumulator layout, so this split is
        # register-local: even columns take the hardware exp2, odd columns the polynomial.
        a, b = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        return tl.reshape(tl.join(tl.math.exp2(a), _exp2_poly(b)), (BLOCK_M, BLOCK_N))
    return tl.math.exp2(x)


@triton.jit
def _qk_dot(q, k, acc, Q_FP8: tl.constexpr, UPCAST: tl.constexpr):
    """acc + q @ kᵀ for one block; k is [BLOCK_N, d]."""
    if Q_FP8:
        return tl.dot(q, tl.trans(k), acc)  # e4m3 x e4m3 -> fp32 (exact in the interpreter too)
    kk = k.to(q.dtype)  # FP8 K with a 16-bit Q: e4m3 widens exactly
    if UPCAST:  # the interpreter's bf16 dot multiplies bit patterns; fp32 there is exact
        return tl.dot(q.to(tl.float32), tl.trans(kk.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(q, tl.trans(kk), acc)


@triton.jit
def _load_kv(ptrs, desc, row, col, pos, ok, stride_t, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """A [BLOCK_N, d] block of token-major K or V (rows = tokens, ``pos`` relative to ``ptrs``). Masked blocks
    zero the rows outside the request (``ok`` false): a descriptor reads whatever lies there (another request,
    or rows never written that may hold NaN, which 0-weighted would still poison the sum)."""
    if USE_TMA:
        x = desc.load([row, col])
        if MASKED:
            x = tl.where(ok[:, None], x, tl.zeros_like(x))
    elif MASKED:
        x = tl.load(ptrs + pos[:, None].to(tl.int64) * stride_t, mask=ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs + pos[:, None].to(tl.int64) * stride_t)
    return x


@triton.jit
def _causal_mask(s, toks, key_limit):
    """Scores past each row's last visible key (``key_limit[i]`` = prefix + i) replaced by -inf."""
    return tl.where(toks[None, :] <= key_limit[:, None], s, float("-inf"))


@triton.jit
def _block_scores(
    qa,
    qb,
    k_ptrs_a,
    k_ptrs_b,
    kd_a,
    kd_b,
    kv_tok0,
    shift,
    k_col,
    start_n,
    key_limit,
    n_end,
    offs_n,
    stride_kt,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    Q_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Raw scores q·kᵀ of one key block, masked to -inf where a row may not see a key.

    Block positions count from ``kv_tok0`` (the request's first KV row rounded down to the alignment), so key
    index = position - ``shift``. ``CAUSAL`` blocks (the diagonal) mask scores past each row's last visible
    key; ``BOUNDS`` blocks reach outside the request's keys ``[0, n_end)`` and mask those too. K rows are never
    zeroed: a masked score is replaced by -inf whatever the K row held, so the K tiles stay in shared memory
    (no register round trip)."""
    pos = start_n + offs_n
    toks = pos - shift
    ok = (toks >= 0) & (toks < n_end)
    row = kv_tok0 + start_n
    ka = _load_kv(k_ptrs_a, kd_a, row, k_col, pos, ok, stride_kt, BOUNDS and not USE_TMA, USE_TMA)
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = _qk_dot(qa, ka, s, Q_FP8, UPCAST)
    if D_B > 0:
        kb = _load_kv(k_ptrs_b, kd_b, row, k_col + D_A, pos, ok, stride_kt, BOUNDS and not USE_TMA, USE_TMA)
        s = _qk_dot(qb, kb, s, Q_FP8, UPCAST)
    # key_limit[i]: last key row i may see (prefix + i). Keys outside the request are excluded too, so rows of
    # the tile past the request (never stored) stay finite whatever those keys hold.
    if CAUSAL and BOUNDS:
        s = tl.where((toks[None, :] <= key_limit[:, None]) & ok[None, :], s, float("-inf"))
    elif CAUSAL:
        s = _causal_mask(s, toks, key_limit)
    elif BOUNDS:
        s = tl.where(ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _early_scores(qa, kd_a, k_ptrs_a, kv_tok0, k_col, start_n, offs_n, stride_kt, D_B: tl.constexpr,
                  Q_FP8: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The first head-dim part (q_a·k_aᵀ) of a block's unmasked scores; nothing when the head dim has one part.
    Unmasked blocks lie inside the request: no validity mask (``None``) for the loads."""
    s_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if D_B > 0:
        pos = start_n + offs_n
        ka = _load_kv(k_ptrs_a, kd_a, kv_tok0 + start_n, k_col, pos, None, stride_kt, False, USE_TMA)
        s_a = _qk_dot(qa, ka, s_a, Q_FP8, UPCAST)
    return s_a


@triton.jit
def _late_scores(s_a, qa, qb, kd_a, kd_b, k_ptrs_a, k_ptrs_b, kv_tok0, k_col, start_n, offs_n, stride_kt,
                 D_A: tl.constexpr, D_B: tl.constexpr, Q_FP8: tl.constexpr, UPCAST: tl.constexpr,
                 USE_TMA: tl.constexpr):  # fmt: skip
    """The rest of a block's unmasked scores on top of ``_early_scores``' part: q_b·k_bᵀ accumulated into
    ``s_a`` (the matrix unit chains the two products without a wait), or the whole q·kᵀ for one part."""
    pos = start_n + offs_n
    row = kv_tok0 + start_n
    if D_B > 0:
        kb = _load_kv(k_ptrs_b, kd_b, row, k_col + D_A, pos, None, stride_kt, False, USE_TMA)
        s = _qk_dot(qb, kb, s_a, Q_FP8, UPCAST)
    else:
        ka = _load_kv(k_ptrs_a, kd_a, row, k_col, pos, None, stride_kt, False, USE_TMA)
        s = _qk_dot(qa, ka, s_a, Q_FP8, UPCAST)
    return s


@triton.jit
def _load_v(v_ptrs, vd, row, v_col, pos, ok, stride_vt, BOUNDS: tl.constexpr, V_DIM_MAJOR: tl.constexpr,
            USE_TMA: tl.constexpr):  # fmt: skip
    """A [BLOCK_N, d_v] block of V; ``BOUNDS`` blocks zero their rows outside the request, because a
    0-weighted row that holds NaN (memory no request owns) would still poison the sum."""
    if V_DIM_MAJOR:  # V stored [d_v, tokens]: the block is read as [d_v, BLOCK_N] and used transposed
        if USE_TMA:
            vt = vd.load([v_col, row])
            if BOUNDS:
                vt = tl.where(ok[None, :], vt, tl.zeros_like(vt))
        elif BOUNDS:
            vt = tl.load(v_ptrs + pos[None, :].to(tl.int64) * stride_vt, mask=ok[None, :], other=0.0)
        else:
            vt = tl.load(v_ptrs + pos[None, :].to(tl.int64) * stride_vt)
        v = tl.trans(vt)
    else:
        v = _load_kv(v_ptrs, vd, row, v_col, pos, ok, stride_vt, BOUNDS, USE_TMA)
    return v


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale, EXP_POLY: tl.constexpr, P_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """Online softmax of one block of masked raw scores: (P in fp32, alpha, new max, new sum). The caller
    rescales the accumulator by alpha before adding P·V."""
    # Scores stay raw; the single multiplier (softmax scale, dequant scales, log2 e) goes into one FMA per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = _exp2_tile(s * qk_scale - (m_new[:, None] - P_OFFSET), EXP_POLY, BLOCK_M, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _p_operand(p, P_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """P as the P·V product's left operand: V's 16-bit type, or e4m3 for FP8 V."""
    if KV_FP8:
        if NATIVE_FP8:
            # p is in [0, 2**P_OFFSET] by construction, so the hardware's saturating cast needs no clamp.
            pc = p.to(tl.float8e4nv)
        else:
            pc = fp32_to_e4m3(p.to(tl.float32), False)  # the interpreter's own fp32->fp8 cast is wrong (NOTES §1)
    else:
        pc = p.to(P_DTYPE)
    return pc


@triton.jit
def _pv_dot(acc, pc, v, KV_FP8: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST and not KV_FP8:  # the interpreter's bf16 dot multiplies bit patterns; fp32 there is exact
        acc = tl.dot(pc.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(pc, v, acc)
    return acc


@triton.jit
def _block_update(
    acc,
    m_i,
    l_i,
    s,
    v_ptrs,
    vd,
    kv_tok0,
    shift,
    v_col,
    start_n,
    n_end,
    offs_n,
    stride_vt,
    qk_scale,
    BOUNDS: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_DIM_MAJOR: tl.constexpr,
    UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    EXP_POLY: tl.constexpr,
    USE_TMA: tl.constexpr,
    P_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online-softmax step of one key block from its masked scores ``s``: rescale, P, P·V."""
    pos = start_n + offs_n
    toks = pos - shift
    ok = (toks >= 0) & (toks < n_end)
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, qk_scale, EXP_POLY, P_OFFSET, BLOCK_M, BLOCK_N)
    acc = acc * alpha[:, None]
    v = _load_v(v_ptrs, vd, kv_tok0 + start_n, v_col, pos, ok, stride_vt, BOUNDS, V_DIM_MAJOR, USE_TMA)
    return _pv_dot(acc, _p_operand(p, v.dtype, KV_FP8, NATIVE_FP8), v, KV_FP8, UPCAST), m_new, l_i


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    qa,
    qb,
    k_ptrs_a,
    k_ptrs_b,
    v_ptrs,
    kd_a,
    kd_b,
    vd,
    kv_tok0,
    shift,
    k_col,
    v_col,
    start_n,
    key_limit,
    n_end,
    offs_n,
    stride_kt,
    stride_vt,
    qk_scale,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_DIM_MAJOR: tl.constexpr,
    UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    EXP_POLY: tl.constexpr,
    USE_TMA: tl.constexpr,
    P_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax: its scores, then the update."""
    s = _block_scores(
        qa, qb, k_ptrs_a, k_ptrs_b, kd_a, kd_b, kv_tok0, shift, k_col, start_n, key_limit, n_end, offs_n,
        stride_kt, CAUSAL, BOUNDS, D_A, D_B, Q_FP8, UPCAST, USE_TMA, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    return _block_update(
        acc, m_i, l_i, s, v_ptrs, vd, kv_tok0, shift, v_col, start_n, n_end, offs_n, stride_vt, qk_scale,
        BOUNDS, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _carried_step(
    acc, m_i, l_i, s_a, start_n, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift, k_col, v_col,
    key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL: tl.constexpr, D_A: tl.constexpr,
    D_B: tl.constexpr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, V_DIM_MAJOR: tl.constexpr, UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr, EXP_POLY: tl.constexpr, USE_TMA: tl.constexpr, P_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One block of ``_carried_sweep``: the rest of its scores onto the carried part ``s_a``, then the update."""
    s = _late_scores(
        s_a, qa, qb, kd_a, kd_b, k_ptrs_a, k_ptrs_b, kv_tok0, k_col, start_n, offs_n, stride_kt, D_A, D_B, Q_FP8,
        UPCAST, USE_TMA,
    )  # fmt: skip
    if CAUSAL:
        s = _causal_mask(s, start_n + offs_n - shift, key_limit)
    return _block_update(
        acc, m_i, l_i, s, v_ptrs, vd, kv_tok0, shift, v_col, start_n, n_end, offs_n, stride_vt, qk_scale,
        False, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _carried_sweep(
    acc, m_i, l_i, lo, hi, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift, k_col, v_col,
    key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL: tl.constexpr, D_A: tl.constexpr,
    D_B: tl.constexpr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, V_DIM_MAJOR: tl.constexpr, UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr, EXP_POLY: tl.constexpr, USE_TMA: tl.constexpr, P_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key blocks [lo, hi) inside the request (``CAUSAL``: the diagonal) with the first head-dim part of each
    block's scores (q_a·k_aᵀ) issued right after the previous block's P·V and carried into the next iteration,
    where the second part accumulates onto it without a wait.

    Triton makes a product that is used in its own iteration synchronous (it waits for every product in flight),
    so the plain loop waits twice per key block; this one waits once, and the matrix unit runs P·V, q_a·k_aᵀ and
    q_b·k_bᵀ back to back. Every sweep of a kernel takes this form or none does: a plain loop's wait between the
    two parts threads shared-memory descriptors whose registers the compiler may set between the product and
    the wait, and ptxas then serialises every matrix instruction of the kernel (C7515)."""
    if hi > lo:
        last = hi - BLOCK_N
        s_a = _early_scores(
            qa, kd_a, k_ptrs_a, kv_tok0, k_col, lo, offs_n, stride_kt, D_B, Q_FP8, UPCAST, USE_TMA, BLOCK_M, BLOCK_N
        )
        for start_n in tl.range(lo, last, BLOCK_N):
            acc, m_i, l_i = _carried_step(
                acc, m_i, l_i, s_a, start_n, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift,
                k_col, v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL, D_A, D_B, Q_FP8,
                KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            s_a = _early_scores(
                qa, kd_a, k_ptrs_a, kv_tok0, k_col, start_n + BLOCK_N, offs_n, stride_kt, D_B, Q_FP8, UPCAST,
                USE_TMA, BLOCK_M, BLOCK_N,
            )  # fmt: skip
        acc, m_i, l_i = _carried_step(
            acc, m_i, l_i, s_a, last, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift, k_col,
            v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL, D_A, D_B, Q_FP8, KV_FP8,
            V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_items"])
def _mla_context_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    Qd_a,
    Qd_b,
    Kd_a,
    Kd_b,
    Vd,
    Work,
    n_items,
    scale_ptr,
    softmax_scale,
    kv_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    DV: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_DIM_MAJOR: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    P_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXP_POLY: tl.constexpr,
    USE_TMA: tl.constexpr,
    KV_ALIGN: tl.constexpr,
    PIPE_QK: tl.constexpr,
    HEADS_OUTER: tl.constexpr,
):
    """One (query tile, head) per program. With ``USE_TMA`` the ``*d_*`` arguments are 2-D tensor descriptors
    (rows = tokens, columns = head x dim; V dim-major: rows = head x dim) and ``Q``/``K``/``V`` are unused."""
    pid = tl.program_id(0)
    if HEADS_OUTER:
        # Consecutive programs are tiles of one head: the programs resident at once read the same few heads'
        # K/V, which then stay in L2 (heads innermost, ~130 resident programs stream ~130 different K/V heads
        # from DRAM). Heaviest first still holds within each head, and the grid ends on the lightest tiles.
        item = pid % n_items
        head = pid // n_items
    else:
        item = pid // H
        head = pid % H
    # Work item (planned on the host, heaviest first): first query row of the tile (global), rows in the tile,
    # first KV row of the request (global), and prefix + tile offset = keys every row of the tile sees minus 1.
    w = Work + item.to(tl.int64) * 4
    q_row0 = tl.load(w)
    n_rows = tl.load(w + 1)
    kv_row0 = tl.load(w + 2)
    diag0 = tl.load(w + 3)
    kvh = head // GROUP

    if SCALE_FROM_PTR:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    qk_scale = softmax_scale * LOG2E
    if KV_FP8:
        qk_scale = qk_scale * kv_scale
        if Q_FP8:
            qk_scale = qk_scale * kv_scale

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, D_A)
    offs_v = tl.arange(0, DV)
    row_ok = offs_m < n_rows
    q_rows = (q_row0 + offs_m).to(tl.int64)
    q_base = Q + q_rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh
    if USE_TMA:
        qa = Qd_a.load([q_row0, head * (D_A + D_B)])
    else:
        qa = tl.load(q_base + offs_a[None, :], mask=row_ok[:, None], other=0.0)
    # Dim-major V has tokens innermost: blocks start at a multiple of KV_ALIGN tokens (16 bytes for FP8) so its
    # loads are 16-byte vectors (and legal descriptor offsets); the first block then starts up to KV_ALIGN - 1
    # keys before the request and is masked. Token-major layouts use KV_ALIGN = 1 (no shift).
    shift = kv_row0 % KV_ALIGN
    kv_tok0 = tl.multiple_of(kv_row0 - shift, KV_ALIGN)
    k_base = K + kv_tok0.to(tl.int64) * stride_kt + kvh.to(tl.int64) * stride_kh
    k_ptrs_a = k_base + offs_a[None, :]
    if D_B > 0:
        offs_b = tl.arange(0, D_B)
        if USE_TMA:
            qb = Qd_b.load([q_row0, head * (D_A + D_B) + D_A])
        else:
            qb = tl.load(q_base + D_A + offs_b[None, :], mask=row_ok[:, None], other=0.0)
        k_ptrs_b = k_base + D_A + offs_b[None, :]
    else:
        qb = qa
        k_ptrs_b = k_ptrs_a
    if V_DIM_MAJOR:
        v_ptrs = V + kvh.to(tl.int64) * stride_vh + kv_tok0.to(tl.int64) * stride_vt + offs_v[:, None] * stride_vd
    else:
        v_ptrs = V + kvh.to(tl.int64) * stride_vh + kv_tok0.to(tl.int64) * stride_vt + offs_v[None, :]
    k_col = kvh * (D_A + D_B)
    v_col = kvh * DV

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    key_limit = diag0 + offs_m
    n_end = diag0 + n_rows  # one past the last key the tile's last real row sees (<= kv_len)
    # In block positions (key + shift), four sweeps, each a multiple of BLOCK_N long:
    #   [0, head_end)        the aligned head (dim-major V, shift > 0): keys < 0 belong to the previous request;
    #   [head_end, n_full)   keys every row of the tile sees: no masks at all (almost every block);
    #   [diag_lo, in_end)    the causal diagonal inside the request's keys: score mask only;
    #   [tail_lo, pos_end)   at most one block reaching past n_end: score mask and zeroed V rows.
    head_end = tl.where(shift > 0, BLOCK_N, 0)
    n_full = ((diag0 + shift + 1) // BLOCK_N) * BLOCK_N
    pos_end = n_end + shift
    diag_lo = tl.maximum(n_full, head_end)
    in_end = ((n_end + shift) // BLOCK_N) * BLOCK_N
    tail_lo = tl.maximum(diag_lo, in_end)

    for start_n in tl.range(0, head_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col, v_col,
            start_n, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale,
            True, True, D_A, D_B, Q_FP8, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
    if PIPE_QK == 2:  # unmasked keys, then the causal diagonal
        acc, m_i, l_i = _carried_sweep(
            acc, m_i, l_i, head_end, n_full, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift,
            k_col, v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, False, D_A, D_B, Q_FP8, KV_FP8,
            V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = _carried_sweep(
            acc, m_i, l_i, diag_lo, in_end, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift,
            k_col, v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, True, D_A, D_B, Q_FP8, KV_FP8,
            V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        for start_n in tl.range(head_end, n_full, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col, v_col,
                start_n, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale,
                False, False, D_A, D_B, Q_FP8, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA,
                P_OFFSET, BLOCK_M, BLOCK_N,
            )  # fmt: skip
        for start_n in tl.range(diag_lo, in_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col, v_col,
                start_n, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale,
                True, False, D_A, D_B, Q_FP8, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA,
                P_OFFSET, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    for start_n in tl.range(tail_lo, pos_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col, v_col,
            start_n, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale,
            True, True, D_A, D_B, Q_FP8, KV_FP8, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, USE_TMA, P_OFFSET,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip

    out_scale = kv_scale if KV_FP8 else 1.0
    o = acc * (out_scale / l_i)[:, None]
    o_ptrs = O + q_rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = (m_i - P_OFFSET + tl.math.log2(l_i)) * LN2
        tl.store(LSE + q_rows * stride_lt + head.to(tl.int64) * stride_lh, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------- configs


def _cfg(
    bm: int, bn: int, warps: int, stages: int, poly: int = 0, tma: int = 0, pipe: int = 0, heads_outer: int = 0
) -> triton.Config:
    """A launch configuration. ``pipe``: ``PIPE_QK``, 0 (plain loops) or 2 (carried score part; 1 named a
    variant that lost and was removed, so results recorded as "pipe2" keep their name)."""
    if pipe not in (0, 2):
        raise ValueError(f"pipe: expected 0 or 2, got {pipe}")
    kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "EXP_POLY": poly, "USE_TMA": tma}
    # Absent means 0, so committed tuning entries from before a knob stay valid.
    if pipe:
        kwargs["PIPE_QK"] = pipe
    if heads_outer:
        kwargs["HEADS_OUTER"] = heads_outer
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


_SMEM_BYTES = 232448  # per block on sm_90 (227 KiB)


def _smem_estimate(cfg: triton.Config, key: tuple) -> int:
    """Q tile + num_stages (K, V) tiles, and with ``PIPE_QK = 2`` one more tile of K's first head-dim part (its
    loads run a block ahead of the rest); matches the compiler's report (Triton 3.6, sm_90) to within 1 KB."""
    d_qk, d_v, q_kind, kv_kind = key[:4]
    qb, kvb = (1 if q_kind == "e4m3" else 2), (1 if kv_kind == "e4m3" else 2)
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    d_a, d_b = _split_head_dim(d_qk) or (d_qk, 0)
    extra = bn * d_a * kvb if cfg.kwargs.get("PIPE_QK") == 2 and d_b else 0
    return bm * d_qk * qb + max(1, cfg.num_stages) * bn * (d_qk + d_v) * kvb + extra


# A batch whose longest query has at most this many rows plans with the short-query key (key + ("short_q",)):
# 128-row tiles would leave half their rows idle (64 new rows over a long cached prefix, e.g. decode-like
# extends), so that key keeps only 64-row, one-warpgroup tiles that leave room for two programs per SM.
SHORT_Q_ROWS = 64
_SHORT_Q = "short_q"


def _keep(cfg: triton.Config, key: tuple) -> bool:
    # The polynomial split halves BLOCK_N; below 32 columns it only adds reshapes.
    if cfg.kwargs["EXP_POLY"] and cfg.kwargs["BLOCK_N"] < 32:
        return False
    if _SHORT_Q in key[5:]:
        return cfg.kwargs["BLOCK_M"] <= SHORT_Q_ROWS and 2 * _smem_estimate(cfg, key) <= _SMEM_BYTES
    return _smem_estimate(cfg, key) <= _SMEM_BYTES


# Key: (d_qk, d_v, q dtype, kv dtype, v_layout[, "short_q"]). The sm_90 list is ordered by what the H200 sweeps
# measured (bench/bench_mla_context.py --tune, 2026-11-29, Triton 3.6): the first candidate that fits a key's shared
# memory is what an untuned key gets: 128x128, 8 warps, 3 stages, TMA, carried score part, heads outer for FP8 K/V
# (784-800 TFLOP/s geomean at 192/128 at 1ba09ff and a01c531, 255 registers, 161 KB shared); 128x64, 8 warps, 3
# stages, TMA, carried score part, heads outer for 16-bit K/V (527 / 470 / 497 TFLOP/s on three workloads at a01c531
# against 501 / 443 / 476 without the carried part; 172 registers, 185 KB). Two stages instead of three lost 20-25%
# everywhere; the exp2 polynomial split, BLOCK_M = 64 and 256-row 16-warp tiles (128 registers a thread) lost on long
# queries; four stages were within noise. Short-query keys default to 64x64, 4 warps (fp8: 3 stages, 74 KB; 16-bit: 2
# stages, 107 KB). Committed per-key choices live in tuned/sm90.json.
_CONFIGS = ConfigTable(
    fallback=[_cfg(64, 64, 4, 2)],
    interpreter=_cfg(16, 16, 1, 1),
    by_arch={
        (9, 0): [
            _cfg(128, 128, 8, 3, 0, 1, 2, 1),
            _cfg(128, 64, 8, 3, 0, 1, 2, 1),
            _cfg(128, 128, 8, 4, 0, 1, 0, 1),
            _cfg(64, 64, 4, 3, 0, 1),
            _cfg(64, 64, 4, 2, 0, 1),
            _cfg(128, 128, 8, 4, 0, 1),
            _cfg(128, 64, 8, 4, 0, 1),
            _cfg(64, 128, 4, 2, 0, 1),
            _cfg(64, 64, 4, 4, 0, 1),
            _cfg(128, 64, 8, 3),
            _cfg(128, 128, 8, 2, 0, 1),
            _cfg(64, 64, 4, 2),
        ],
        8: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2)],
    },
    keep=_keep,
)
_KERNEL = TunedKernel("mla_context_fwd", _mla_context_fwd_kernel, _CONFIGS)


# ----------------------------------------------------------------------------------------------------- host side


def _split_head_dim(d: int) -> tuple[int, int] | None:
    """d = D_A + D_B with D_A the largest power of two <= d and D_B a power of two or 0 (tl.arange sizes)."""
    if d < 16:
        return None
    a = 1 << (d.bit_length() - 1)
    b = d - a
    if b != 0 and (b < 16 or b & (b - 1)):
        return None
    return a, b


def _dtype_kind(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", FP8: "e4m3"}[dt]


def _host_lengths(name: str, cu: object, device: torch.device, n: int | None) -> list[int]:
    check_tensor(name, cu, dtype=torch.int32, ndim=1)
    assert isinstance(cu, torch.Tensor)
    if cu.device.type != "cpu" and not same_device(cu.device, device):
        raise ValueError(f"{name}: expected a tensor on {device} (or the host), got one on {cu.device}")
    if cu.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (batch size + 1), got 0")
    if n is not None and cu.numel() != n:
        raise ValueError(f"{name}: expected {n} entries (batch size + 1, like cu_seqlens_q), got {cu.numel()}")
    vals = cu.tolist()  # one host read per plan (the plan is reused by every layer of the step)
    if vals[0] < 0:
        raise ValueError(f"{name}: entries must be >= 0, got {vals[0]} first")
    for i in range(len(vals) - 1):
        if vals[i + 1] < vals[i]:
            raise ValueError(f"{name}: must be non-decreasing, got {vals[i]} then {vals[i + 1]} at index {i}")
    return vals


@dataclass(frozen=True)
class _Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    v_layout: str


class MLAContextPlan:
    """Work partition of one batch, computed once on the host and reused by every layer of a step.

    ``MLAContextPlan.plan(cu_seqlens_q, cu_seqlens_kv, num_heads=..., ...)`` validates the lengths (one host read
    of the two ``cu_seqlens``), picks the launch configuration for this GPU and uploads a table of
    (request, query-tile) items ordered heaviest first. ``run(q, k, v, out=..., lse_out=...)`` checks shapes,
    dtypes and devices (host metadata only: no device sync, no allocation when the buffers are given) and
    launches once, so it can be captured in a CUDA graph.
    """

    def __init__(
        self,
        shapes: _Shapes,
        device: torch.device,
        config: triton.Config,
        work: torch.Tensor,
        n_items: int,
        total_q: int,
        total_kv: int,
        q_lens: list[int],
        kv_lens: list[int],
        cu_seqlens_q: list[int],
        cu_seqlens_kv: list[int],
    ) -> None:
        self.shapes = shapes
        self.device = device
        self.config = config
        self.work = work
        self.n_items = n_items
        self.total_q = total_q
        self.total_kv = total_kv
        self.q_lens = q_lens
        self.kv_lens = kv_lens
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_kv = cu_seqlens_kv

    @classmethod
    def plan(
        cls,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_v: int,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype = torch.bfloat16,
        v_layout: str = "token_major",
        device: torch.device | str | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        config: triton.Config | None = None,
    ) -> MLAContextPlan:
        """Validate one batch's lengths and build its work table (heaviest (request, q-tile) first).

        ``device`` defaults to that of ``cu_seqlens_q``; ``config`` overrides the per-SM table (tests, sweeps).
        """
        dev = torch.device(device) if device is not None else _tensor_device("cu_seqlens_q", cu_seqlens_q)
        shapes = _check_shapes(num_heads, num_kv_heads, head_dim_qk, head_dim_v, q_dtype, kv_dtype, v_layout)
        cu_q = _host_lengths("cu_seqlens_q", cu_seqlens_q, dev, None)
        cu_kv = _host_lengths("cu_seqlens_kv", cu_seqlens_kv, dev, len(cu_q))
        if cu_q[0] != 0:
            raise ValueError(f"cu_seqlens_q: must start at 0 (output rows are the query rows), got {cu_q[0]}")
        q_lens = [b - a for a, b in itertools.pairwise(cu_q)]
        kv_lens = [b - a for a, b in itertools.pairwise(cu_kv)]
        for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            if ql > kl:
                raise ValueError(
                    f"cu_seqlens_q / cu_seqlens_kv: request {r} has q_len {ql} > kv_len {kl} "
                    "(the keys must include the cached prefix and the new rows)"
                )
        if max_seqlen_q is not None and q_lens and max(q_lens) > max_seqlen_q:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is below the longest query length {max(q_lens)}")
        if max_seqlen_kv is not None and kv_lens and max(kv_lens) > max_seqlen_kv:
            raise ValueError(f"max_seqlen_kv: {max_seqlen_kv} is below the longest KV length {max(kv_lens)}")
        if config is None:
            short_q = bool(q_lens) and 0 < max(q_lens) <= SHORT_Q_ROWS
            config = _KERNEL.config_for(_config_key(shapes, short_q))
        bm = int(config.kwargs["BLOCK_M"])
        items: list[tuple[int, int, int, int, int]] = []  # (cost, q_row0, n_rows, kv_row0, diag0)
        for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            prefix = kl - ql
            for m0 in range(0, ql, bm):
                n_rows = min(bm, ql - m0)
                items.append((prefix + m0 + n_rows, cu_q[r] + m0, n_rows, cu_kv[r], prefix + m0))
        # Heaviest first (cost = keys swept); the stable sort keeps request order among equals.
        items.sort(key=lambda it: -it[0])
        table = torch.tensor([it[1:] for it in items] or [[0, 0, 0, 0]], dtype=torch.int32)
        work = table.to(dev, non_blocking=False)
        return cls(shapes, dev, config, work, len(items), cu_q[-1], cu_kv[-1], q_lens, kv_lens, cu_q, cu_kv)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv_scale_quant_orig: float | torch.Tensor = 1.0,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch. Returns ``out`` (and the fp32 natural-log LSE if asked)."""
        sh = self.shapes
        _check_inputs(q, k, v, sh, self.device, self.total_q, self.total_kv)
        scale_val, scale_ptr = _check_kv_scale(kv_scale_quant_orig, sh, self.device)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(sh.head_dim_qk)
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale}")
        out_dtype = torch.float16 if sh.q_dtype == torch.float16 else torch.bfloat16
        if out is None:
            out = torch.empty((self.total_q, sh.num_heads, sh.head_dim_v), dtype=out_dtype, device=self.device)
        else:
            check_tensor("out", out, dtype=(torch.bfloat16, torch.float16), device=self.device, ndim=3)
            _check_shape_exact("out", out, (self.total_q, sh.num_heads, sh.head_dim_v))
            if out.stride(-1) != 1:
                raise ValueError(f"out: expected the last dimension contiguous (stride 1), got strides {out.stride()}")
        want_lse = return_lse or lse_out is not None
        if lse_out is not None:
            check_tensor("lse_out", lse_out, dtype=torch.float32, device=self.device, ndim=2)
            _check_shape_exact("lse_out", lse_out, (self.total_q, sh.num_heads))
        elif want_lse:
            lse_out = torch.empty((self.total_q, sh.num_heads), dtype=torch.float32, device=self.device)
        if self.n_items > 0:
            self._launch(q, k, v, out, lse_out, float(softmax_scale), scale_val, scale_ptr)
        if want_lse:
            return out, lse_out
        return out

    def _launch(self, q, k, v, out, lse, softmax_scale, scale_val, scale_ptr):
        """One launch; returns Triton's compiled-kernel handle (registers, spills, shared memory for reports)."""
        sh = self.shapes
        d_a, d_b = _split_head_dim(sh.head_dim_qk)
        if sh.v_layout == "dim_major":
            svt, svh, svd = v.stride(2), v.stride(0), v.stride(1)
        else:
            svt, svh, svd = v.stride(0), v.stride(1), 1
        lse_t = lse if lse is not None else out  # any pointer: WRITE_LSE=False never touches it
        slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        is16 = sh.q_dtype in (torch.bfloat16, torch.float16)
        cfg = self.config
        kw = dict(cfg.kwargs)
        descs = _descriptors(q, k, v, sh, kw["BLOCK_M"], kw["BLOCK_N"], d_a, d_b) if kw.get("USE_TMA") else None
        kw["USE_TMA"] = descs is not None
        kw.setdefault("PIPE_QK", 0)
        kw.setdefault("HEADS_OUTER", 0)
        if descs is None:
            descs = (q, q, k, k, v)  # placeholders: the pointer path never reads them
        meta = dict(
            H=sh.num_heads,
            GROUP=sh.num_heads // sh.num_kv_heads,
            D_A=d_a,
            D_B=d_b,
            DV=sh.head_dim_v,
            Q_FP8=sh.q_dtype == FP8,
            KV_FP8=sh.kv_dtype == FP8,
            V_DIM_MAJOR=sh.v_layout == "dim_major",
            SCALE_FROM_PTR=scale_ptr is not None,
            WRITE_LSE=lse is not None,
            UPCAST=interpreting() and is16,
            NATIVE_FP8=native_fp8_cast(),
            P_OFFSET=_FP8_P_OFFSET if sh.kv_dtype == FP8 else 0.0,
            KV_ALIGN=max(1, 16 // k.element_size()) if sh.v_layout == "dim_major" else 1,
            **kw,
        )
        grid = (self.n_items * sh.num_heads,)
        return _mla_context_fwd_kernel[grid](
            q, k, v, out, lse_t, *descs, self.work, self.n_items,
            scale_ptr if scale_ptr is not None else self.work, softmax_scale, scale_val,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), svt, svh, svd,
            out.stride(0), out.stride(1), slt, slh,
            **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def _descriptors(q, k, v, sh: _Shapes, bm: int, bn: int, d_a: int, d_b: int) -> tuple | None:
    """2-D tensor descriptors (tokens x (heads * dim)) for the TMA path, or None when a layout does not allow
    one (heads not packed, 16-byte alignment); the kernel then takes the pointer path."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton without host-side descriptors
        return None
    if q.stride(1) != sh.head_dim_qk or k.stride(1) != sh.head_dim_qk:
        return None
    es_q, es_kv = q.element_size(), k.element_size()
    if any(t.data_ptr() % 16 for t in (q, k, v)) or (q.stride(0) * es_q) % 16 or (k.stride(0) * es_kv) % 16:
        return None
    if min(q.shape[0], k.shape[0]) == 0:
        return None
    d_b_blk = d_b or d_a
    q2 = [q.shape[0], sh.num_heads * sh.head_dim_qk]
    k2 = [k.shape[0], sh.num_kv_heads * sh.head_dim_qk]
    descs = [
        TensorDescriptor(q, q2, [q.stride(0), 1], [bm, d_a]),
        TensorDescriptor(q, q2, [q.stride(0), 1], [bm, d_b_blk]),
        TensorDescriptor(k, k2, [k.stride(0), 1], [bn, d_a]),
        TensorDescriptor(k, k2, [k.stride(0), 1], [bn, d_b_blk]),
    ]
    if sh.v_layout == "dim_major":
        if v.stride(0) != sh.head_dim_v * v.stride(1) or (v.stride(1) * es_kv) % 16:
            return None
        descs.append(
            TensorDescriptor(v, [sh.num_kv_heads * sh.head_dim_v, v.shape[2]], [v.stride(1), 1], [sh.head_dim_v, bn])
        )
    else:
        if v.stride(1) != sh.head_dim_v or (v.stride(0) * es_kv) % 16:
            return None
        descs.append(
            TensorDescriptor(v, [v.shape[0], sh.num_kv_heads * sh.head_dim_v], [v.stride(0), 1], [bn, sh.head_dim_v])
        )
    return tuple(descs)


def _tensor_device(name: str, t: object) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t.device


def _config_key(sh: _Shapes, short_q: bool = False) -> tuple:
    """Per-SM config key: head dims, dtypes and V layout, plus ``"short_q"`` for batches of short queries (a
    two-valued class decided once per plan, so serving never retunes on lengths)."""
    key = (sh.head_dim_qk, sh.head_dim_v, _dtype_kind(sh.q_dtype), _dtype_kind(sh.kv_dtype), sh.v_layout)
    return (*key, _SHORT_Q) if short_q else key


def _check_shape_exact(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name}: expected shape {list(expected)}, got {list(t.shape)}")


def _check_shapes(
    num_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    v_layout: str,
) -> _Shapes:
    for name, val in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim_qk", head_dim_qk),
        ("head_dim_v", head_dim_v),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name}: expected a positive int, got {val!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: {num_kv_heads} must divide num_heads {num_heads} (H_kv | H)")
    if _split_head_dim(head_dim_qk) is None:
        raise ValueError(
            f"head_dim_qk: {head_dim_qk} is not supported (a power of two >= 16, or one plus a smaller power "
            "of two >= 16, e.g. 128 or 192 = 128 + 64)"
        )
    if head_dim_v < 16 or head_dim_v & (head_dim_v - 1) or head_dim_v > 256:
        raise ValueError(f"head_dim_v: expected a power of two in [16, 256], got {head_dim_v}")
    if q_dtype not in (torch.bfloat16, torch.float16, FP8):
        raise TypeError(f"q: expected dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn, got {q_dtype}")
    if q_dtype == FP8 and kv_dtype != FP8:
        raise TypeError(f"k/v: an FP8 q needs FP8 (torch.float8_e4m3fn) k and v, got {kv_dtype}")
    if q_dtype != FP8 and kv_dtype not in (q_dtype, FP8):
        raise TypeError(f"k/v: expected dtype {q_dtype} (like q) or torch.float8_e4m3fn, got {kv_dtype}")
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout: expected one of {V_LAYOUTS}, got {v_layout!r}")
    return _Shapes(num_heads, num_kv_heads, head_dim_qk, head_dim_v, q_dtype, kv_dtype, v_layout)


def _check_inputs(
    q: object, k: object, v: object, sh: _Shapes, device: torch.device, total_q: int, total_kv: int
) -> None:
    check_tensor("q", q, dtype=sh.q_dtype, device=device, ndim=3, last_dim_contiguous=True)
    check_tensor("k", k, dtype=sh.kv_dtype, device=device, ndim=3, last_dim_contiguous=True)
    check_tensor("v", v, dtype=sh.kv_dtype, device=device, ndim=3, last_dim_contiguous=True)
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    _check_shape_exact("q", q, (total_q, sh.num_heads, sh.head_dim_qk))
    if tuple(k.shape[1:]) != (sh.num_kv_heads, sh.head_dim_qk):
        raise ValueError(f"k: expected shape [>= {total_kv}, {sh.num_kv_heads}, {sh.head_dim_qk}], got {list(k.shape)}")
    if k.shape[0] < total_kv:
        raise ValueError(f"k: has {k.shape[0]} rows, fewer than total_kv = cu_seqlens_kv[-1] = {total_kv}")
    if sh.v_layout == "dim_major":
        if tuple(v.shape[:2]) != (sh.num_kv_heads, sh.head_dim_v):
            raise ValueError(
                f"v: expected shape [{sh.num_kv_heads}, {sh.head_dim_v}, >= {total_kv}] (v_layout='dim_major'), "
                f"got {list(v.shape)}"
            )
        v_rows = v.shape[2]
    else:
        if tuple(v.shape[1:]) != (sh.num_kv_heads, sh.head_dim_v):
            raise ValueError(
                f"v: expected shape [>= {total_kv}, {sh.num_kv_heads}, {sh.head_dim_v}], got {list(v.shape)}"
            )
        v_rows = v.shape[0]
    if v_rows < total_kv:
        raise ValueError(f"v: has {v_rows} token rows, fewer than total_kv = cu_seqlens_kv[-1] = {total_kv}")
    if device.type == "cpu" and not interpreting():
        raise ValueError("q: expected a CUDA tensor (CPU tensors run only under the Triton interpreter)")


def _check_kv_scale(s: object, sh: _Shapes, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """A Python float (checked here) or a 1-element fp32 tensor on the device (read by the kernel: no sync)."""
    if isinstance(s, torch.Tensor):
        check_tensor("kv_scale_quant_orig", s, dtype=torch.float32, device=device)
        if s.numel() != 1:
            raise ValueError(f"kv_scale_quant_orig: expected a 1-element tensor, got shape {tuple(s.shape)}")
        return 1.0, s
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"kv_scale_quant_orig: expected a float or a 1-element tensor, got {type(s).__name__}")
    s = float(s)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"kv_scale_quant_orig: expected a positive finite float, got {s}")
    if sh.kv_dtype != FP8 and s != 1.0:
        raise ValueError(f"kv_scale_quant_orig: dequantises FP8 k/v; with {sh.kv_dtype} k/v it must be 1.0, got {s}")
    return s, None


def mla_context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    *,
    kv_scale_quant_orig: float | torch.Tensor = 1.0,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    v_layout: str = "token_major",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA context attention over cached prefixes (see the module docstring for the contract).

    Args:
        q: ``[total_q, H, d_qk]`` bf16/fp16, or FP8 e4m3 (then k and v are FP8 too).
        k: ``[>= total_kv, H_kv, d_qk]``, q's dtype or FP8 e4m3; H_kv divides H. Rows past ``cu_seqlens_kv[-1]``
            are ignored.
        v: ``[>= total_kv, H_kv, d_v]`` (``v_layout="token_major"``) or ``[H_kv, d_v, >= total_kv]`` with tokens
            contiguous (``v_layout="dim_major"``, the layout FP8 P·V wants); k's dtype.
        cu_seqlens_q / cu_seqlens_kv: int32 ``[B + 1]`` on q's device or the host; ``cu_seqlens_q[0] == 0``,
            ``cu_seqlens_q[-1] == total_q``; both non-decreasing and ``q_len <= kv_len`` per request.
        kv_scale_quant_orig: dequantisation scale of FP8 k/v (and of q when q is FP8); a float or a 1-element
            fp32 tensor on the device. Must be 1.0 for 16-bit k/v.
        softmax_scale: defaults to ``1 / sqrt(d_qk)``.
        out: optional ``[total_q, H, d_v]`` bf16 (or fp16) output buffer.
        return_lse: also return the fp32 ``[total_q, H]`` natural-log LSE of the scaled scores.
        max_seqlen_q / max_seqlen_kv: optional upper bounds, checked against the lengths.
    Returns:
        ``out`` (bf16; fp16 for fp16 inputs), or ``(out, lse)``.

    This convenience call plans and runs in one go (one host read of the cu_seqlens); serving code plans once
    per step with ``MLAContextPlan.plan`` and calls ``run`` per layer.
    """
    dev = _tensor_device("q", q)
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    num_kv_heads = v.shape[0] if v_layout == "dim_major" else k.shape[1]
    head_dim_v = v.shape[1] if v_layout == "dim_major" else v.shape[2]
    if k.shape[1] != num_kv_heads:
        raise ValueError(f"v: has {num_kv_heads} KV heads, k has {k.shape[1]}")
    plan = MLAContextPlan.plan(
        cu_seqlens_q,
        cu_seqlens_kv,
        num_heads=q.shape[1],
        num_kv_heads=k.shape[1],
        head_dim_qk=q.shape[2],
        head_dim_v=head_dim_v,
        q_dtype=q.dtype,
        kv_dtype=k.dtype,
        v_layout=v_layout,
        device=dev,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
    )
    return plan.run(
        q, k, v, kv_scale_quant_orig=kv_scale_quant_orig, softmax_scale=softmax_scale, out=out, return_lse=return_lse
    )


# ----------------------------------------------------------------------------------------------------- reference


def v_to_dim_major(v: torch.Tensor, align_bytes: int = 16) -> torch.Tensor:
    """``[T, H_kv, d_v]`` -> ``[H_kv, d_v, T]`` (``v_layout="dim_major"``), tokens contiguous, each row's stride
    padded to ``align_bytes`` so the kernel can read it with tensor descriptors (TMA) at any T."""
    t, h, d = v.shape
    per = max(1, align_bytes // v.element_size())
    cap = -(-t // per) * per
    buf = torch.empty((h, d, cap), dtype=v.dtype, device=v.device)
    out = buf[:, :, :t]
    out.copy_(v.permute(1, 2, 0))
    return out


def quantize_kv_e4m3(x: torch.Tensor, kv_scale_orig_quant: float) -> torch.Tensor:
    """Caller-side quantisation of the contract: ``e4m3(x * kv_scale_orig_quant)`` (saturating, RNE)."""
    return e4m3_ref(x.float() * kv_scale_orig_quant)


def mla_context_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_kv: torch.Tensor | Sequence[int],
    *,
    kv_scale_quant_orig: float = 1.0,
    softmax_scale: float | None = None,
    v_layout: str = "token_major",
    dtype: torch.dtype = torch.float32,
    head_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference, per request with an explicit mask: returns (out, natural-log lse) in ``dtype``.

    FP8 tensors are dequantised by ``kv_scale_quant_orig`` (q too when q is FP8). ``head_chunk`` bounds the
    score matrix held at once (heads per step) for long requests on a GPU.
    """
    cu_q = cu_seqlens_q.tolist() if isinstance(cu_seqlens_q, torch.Tensor) else list(cu_seqlens_q)
    cu_kv = cu_seqlens_kv.tolist() if isinstance(cu_seqlens_kv, torch.Tensor) else list(cu_seqlens_kv)
    s = float(kv_scale_quant_orig)

    def deq(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) * s if t.dtype == FP8 else t.to(dtype)

    if v_layout == "dim_major":
        v = v.permute(2, 0, 1)
    n_heads, d_qk = q.shape[1], q.shape[2]
    group = n_heads // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d_qk)
    out = torch.zeros((q.shape[0], n_heads, v.shape[2]), dtype=dtype, device=q.device)
    lse = torch.zeros((q.shape[0], n_heads), dtype=dtype, device=q.device)
    step = head_chunk or n_heads
    for r in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[r], cu_q[r + 1], cu_kv[r], cu_kv[r + 1]
        ql, kl = q1 - q0, k1 - k0
        if ql == 0:
            continue
        rows = torch.arange(ql, device=q.device)[:, None] + (kl - ql)
        mask = torch.arange(kl, device=q.device)[None, :] <= rows  # causal, aligned to the end of the KV
        for h0 in range(0, n_heads, step):
            h1 = min(n_heads, h0 + step)
            heads = torch.arange(h0, h1, device=q.device)
            qh = deq(q[q0:q1, h0:h1]).transpose(0, 1)
            kh = deq(k[k0:k1][:, heads // group]).transpose(0, 1)
            vh = deq(v[k0:k1][:, heads // group]).transpose(0, 1)
            sc = (qh @ kh.transpose(1, 2)) * scale
            sc = sc.masked_fill(~mask, float("-inf"))
            lse_h = torch.logsumexp(sc, dim=-1)
            out[q0:q1, h0:h1] = (torch.exp(sc - lse_h[..., None]) @ vh).transpose(0, 1)
            lse[q0:q1, h0:h1] = lse_h.transpose(0, 1)
    return out, lse


# ----------------------------------------------------------------------------------------------------- self-check


def selfcheck(device: torch.device) -> list[CheckRow]:
    """bf16 and FP8 (s = 1.5, FP8 Q) against the reference on a batch with a cached prefix and an empty request."""
    g = torch.Generator().manual_seed(0)
    small = device.type == "cpu"
    h, dqk, dv = (2, 192, 128) if small else (16, 192, 128)
    q_lens, cached = ([5, 0, 19], [17, 3, 0]) if small else ([300, 0, 1000], [1000, 7, 0])
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_lens = [a + b for a, b in zip(q_lens, cached)]
    cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    tq, tkv = int(cu_q[-1]), int(cu_kv[-1])
    q = torch.randn(tq, h, dqk, generator=g)
    k = torch.randn(tkv + 3, h, dqk, generator=g)
    v = torch.randn(tkv + 3, h, dv, generator=g)
    rows: list[CheckRow] = []
    shape = f"B=3 H={h} {dqk}/{dv} q={q_lens} cached={cached}"

    def bf16() -> tuple[float, bool]:
        qb, kb, vb = (t.to(device, torch.bfloat16) for t in (q, k, v))
        o, lse = mla_context_attention(qb, kb, vb, cu_q.to(device), cu_kv.to(device), return_lse=True)
        ro, rl = mla_context_attention_ref(qb, kb, vb, cu_q, cu_kv)
        err = max((o.float() - ro).abs().max().item(), (lse - rl).abs().max().item())
        return err, err < 3e-2

    def fp8() -> tuple[float, bool]:
        s = 1.5
        q8, k8, v8 = (quantize_kv_e4m3(t, 1.0 / s).to(device) for t in (q, k, v))
        o, lse = mla_context_attention(
            q8, k8, v8, cu_q.to(device), cu_kv.to(device), kv_scale_quant_orig=s, return_lse=True
        )
        ro, rl = mla_context_attention_ref(q8, k8, v8, cu_q, cu_kv, kv_scale_quant_orig=s)
        err = max((o.float() - ro).abs().max().item(), (lse - rl).abs().max().item())
        return err, err < 1e-1

    rows.append(timed_check("mla_context_attention bf16", device, shape, bf16))
    rows.append(timed_check("mla_context_attention fp8", device, shape + " s=1.5", fp8))
    return rows
