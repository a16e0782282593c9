"""MLA context attention over a cached prefix: bf16/fp16 or caller-quantised FP8 (e4m3) inputs.

Request r has ``q_len[r]`` new query rows and ``kv_len[r] = cached[r] + q_len[r]`` key/value rows
(``cu_seqlens_q`` / ``cu_seqlens_kv``); query row i sees keys ``0 .. kv_len[r] - q_len[r] + i`` (causal, aligned
to the end of the KV). d_qk a power of two or a sum of two (192 = 128 + 64), d_v a power of two; H_kv divides H.

FP8 (NOTES §1): an FP8 tensor holds ``e4m3(x * kv_scale_orig_quant)``; the kernel dequantises with
``s = kv_scale_quant_orig``: ``O = softmax(q·kᵀ · s_q · s_k · softmax_scale) · v · s_v`` (``s_k = s_v = s`` for FP8
K/V; ``s_q = q_scale``, by default ``s``, for FP8 Q). Op-quantised inputs: 16-bit q/k/v with
``kv_scale_orig_quant`` are quantised on the device to exactly that form, then run as FP8. A 16-bit Q with FP8
K/V is quantised on chip (``Q_QUANT``, see ``_quantise_q``) or its K is widened to Q's type, whichever the per-GPU
table chose. V is token-major ``[T, H_kv, d_v]`` or dim-major ``[H_kv, d_v, T]`` (``v_layout``; any token stride:
one tensor descriptors cannot read is copied aligned first, see ``_v_path``). ``return_lse``: fp32 natural-log
LSE of the scaled scores, so partial results merge exactly with ``merge_attention_states``.

Entry points: ``MLAContextPlan.plan`` (host work table, once per step: one read of the lengths) + ``run`` (per
layer, graph-capturable), or one call ``mla_context_attention``, which with device ``cu_seqlens`` never reads the
lengths back: it builds the work table on the device, bounded by the row counts (or ``max_seqlen_*``), checks the
lengths there (NaN rows and ``error_flag``; ``strict=True`` checks on the host and raises). ``mla_context_paths``
says which paths a GPU has; inputs a device cannot run raise ``ValueError`` before any launch. On sm_90 the
per-GPU table may route a key to the warp-specialised Gluon kernel (``mla_context_gluon``, knob ``GLUON``); else
the same config runs this module's portable kernel; a key the table lacks times its first candidates once per
process on its own data (a synchronising first call). Calls repeating an earlier call's tensors (address, shape,
strides, dtype, device) and scalars replay its checked launches (docs/kernels.md, "Context host cost").
Notes: docs/mla_context.md, bench/results/mla_context.md.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import (
    FP8,
    check_int,
    check_launch_device,
    check_no_overlap,
    check_tensor,
    same_device,
)
from kvforge.kernels._chip_share import _chip_share
from kvforge.kernels._fp8 import e4m3_ref, fp32_to_e4m3, native_fp8_cast
from kvforge.kernels._runtime import (
    ConfigTable,
    PlanCache,
    RecordedLaunch,
    TunedKernel,
    interpreting,
    launch_jit,
    num_sms,
    tensor_key,
)
from kvforge.kernels._selfcheck import CheckRow, timed_check
from kvforge.kernels.capability import capability_for, gpu_capability

__all__ = [
    "MLAContextPlan",
    "context_kv_splits",
    "mla_context_attention",
    "mla_context_attention_ref",
    "mla_context_paths",
    "quantize_kv_e4m3",
    "quantize_v_dim_major",
    "selfcheck",
    "v_to_dim_major",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
V_LAYOUTS = ("token_major", "dim_major")
# Running-max offset (log2 units) on the FP8 P·V path: P = 2**(x - m + 8) lies in [0, 256] ⊂ e4m3's range and
# probabilities down to 2**-14 stay normal numbers. The row sum uses the same offset, so it cancels in O = acc / l.
_FP8_P_OFFSET = 8.0
# Score product modes (QK_MODE): 16-bit operands (FP8 K widened to Q's type), native e4m3 x e4m3, or FP8 bytes
# decoded to fp16 on chip (GPUs without FP8 matrix instructions: sm_80/86).
_QK_16, _QK_FP8, _QK_BYTES = 0, 1, 2
# P·V modes (PV_MODE): 16-bit V; native FP8 P·V (e4m3 P); FP8 V widened to fp16 on chip with an fp16 P (no
# transposed FP8 operand for token-major V); FP8 bytes decoded to fp16 (sm_80/86).
_PV_16, _PV_FP8, _PV_WIDEN, _PV_BYTES = 0, 1, 2, 3
# Decoded FP8 bytes are the true value times 2**-8 (see _e4m3_bytes_to_f16); the kernel folds 2**8 back into
# its scales.
_BYTES_SCALE = 256.0


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
def _e4m3_bytes_to_f16(b):
    """e4m3fn bytes (uint8) -> fp16 equal to the value times 2**-8, exactly (subnormals included).

    e4m3's 4 exponent and 3 mantissa bits placed in fp16's exponent and top mantissa bits give the same number
    with fp16's bias (15) instead of e4m3's (7); integer ops only, so it compiles for GPUs without FP8 types and
    is exact in the interpreter. 0x7F (NaN) decodes as 480 * 2**-8, like the interpreter's own decode."""
    x = b.to(tl.uint16)
    bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _quantise_q(qa, qb, NATIVE_FP8: tl.constexpr, D_B: tl.constexpr):
    """A 16-bit Q tile as e4m3 with one scale per row: ``s_q = amax(|q_row|) / 448`` over the whole head dim
    (both parts), ``q8 = RNE(q · (1 / s_q))``; returns (q8_a, q8_b, s_q), and ``s_q`` joins the score multiplier.

    The row's largest element is exact; every other element carries e4m3's relative rounding (at most 2**-4,
    3 mantissa bits), the same error a caller-quantised FP8 Q has. Against fp32 attention with the unquantised
    Q it costs an output rel-RMSE of 0.020 (tests/test_mla_context.py, d_qk 192) to 0.022-0.027 (the H200 grid,
    bench/results/mla_context_grid.csv); widening K to Q's type instead is exact but measured 2-2.8x slower."""
    amax = tl.max(tl.abs(qa.to(tl.float32)), 1)
    if D_B > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(qb.to(tl.float32)), 1))
    s_q = tl.where(amax > 0, amax / 448.0, 1.0)
    inv = 1.0 / s_q
    qa8 = fp32_to_e4m3(qa.to(tl.float32) * inv[:, None], NATIVE_FP8)
    qb8 = qa8
    if D_B > 0:
        qb8 = fp32_to_e4m3(qb.to(tl.float32) * inv[:, None], NATIVE_FP8)
    return qa8, qb8, s_q


@triton.jit
def _qk_dot(q, k, acc, QK_MODE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + q @ kᵀ for one block; k is [BLOCK_N, d] (FP8 bytes for ``_QK_BYTES``, decoded here)."""
    if QK_MODE == 1:
        return tl.dot(q, tl.trans(k), acc)  # e4m3 x e4m3 -> fp32 (exact in the interpreter too)
    if QK_MODE == 2:
        kk = _e4m3_bytes_to_f16(k).to(q.dtype)  # exact in bf16 too (4 significant bits)
    else:
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
def _block_scores(qa, qb, k_ptrs_a, k_ptrs_b, kd_a, kd_b, kv_tok0, shift, k_col, start_n, key_limit, n_end, offs_n,
                  stride_kt, CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
                  QK_MODE: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """Raw scores q·kᵀ of one key block, masked to -inf where a row may not see a key.

    Block positions count from ``kv_tok0`` (the request's first KV row rounded down to the alignment), so key
    index = position - ``shift``. ``CAUSAL`` blocks (the diagonal) mask scores past each row's last visible
    key; ``BOUNDS`` blocks reach outside the request's keys ``[0, n_end)`` and mask those too. K rows are never
    zeroed: a masked score is replaced by -inf whatever the K row held, so the K tiles stay in shared memory."""
    pos = start_n + offs_n
    toks = pos - shift
    ok = (toks >= 0) & (toks < n_end)
    row = kv_tok0 + start_n
    ka = _load_kv(k_ptrs_a, kd_a, row, k_col, pos, ok, stride_kt, BOUNDS and not USE_TMA, USE_TMA)
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = _qk_dot(qa, ka, s, QK_MODE, UPCAST)
    if D_B > 0:
        kb = _load_kv(k_ptrs_b, kd_b, row, k_col + D_A, pos, ok, stride_kt, BOUNDS and not USE_TMA, USE_TMA)
        s = _qk_dot(qb, kb, s, QK_MODE, UPCAST)
    # Keys outside the request are excluded too, so rows of the tile past the request (never stored) stay
    # finite whatever those keys hold.
    if CAUSAL and BOUNDS:
        s = tl.where((toks[None, :] <= key_limit[:, None]) & ok[None, :], s, float("-inf"))
    elif CAUSAL:
        s = _causal_mask(s, toks, key_limit)
    elif BOUNDS:
        s = tl.where(ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _early_scores(qa, kd_a, k_ptrs_a, kv_tok0, k_col, start_n, offs_n, stride_kt, D_B: tl.constexpr,
                  QK_MODE: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The first head-dim part (q_a·k_aᵀ) of a block's unmasked scores; nothing when the head dim has one part."""
    s_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if D_B > 0:
        pos = start_n + offs_n
        ka = _load_kv(k_ptrs_a, kd_a, kv_tok0 + start_n, k_col, pos, None, stride_kt, False, USE_TMA)
        s_a = _qk_dot(qa, ka, s_a, QK_MODE, UPCAST)
    return s_a


@triton.jit
def _late_scores(s_a, qa, qb, kd_a, kd_b, k_ptrs_a, k_ptrs_b, kv_tok0, k_col, start_n, offs_n, stride_kt,
                 D_A: tl.constexpr, D_B: tl.constexpr, QK_MODE: tl.constexpr, UPCAST: tl.constexpr,
                 USE_TMA: tl.constexpr):  # fmt: skip
    """The rest of a block's unmasked scores on top of ``_early_scores``' part (q_b·k_bᵀ accumulated into
    ``s_a``, chained by the matrix unit without a wait), or the whole q·kᵀ for one part."""
    pos = start_n + offs_n
    row = kv_tok0 + start_n
    if D_B > 0:
        kb = _load_kv(k_ptrs_b, kd_b, row, k_col + D_A, pos, None, stride_kt, False, USE_TMA)
        s = _qk_dot(qb, kb, s_a, QK_MODE, UPCAST)
    else:
        ka = _load_kv(k_ptrs_a, kd_a, row, k_col, pos, None, stride_kt, False, USE_TMA)
        s = _qk_dot(qa, ka, s_a, QK_MODE, UPCAST)
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
def _softmax_step(s, m_i, l_i, qk_scale, EXP_POLY: tl.constexpr, ROW_SCALE: tl.constexpr, P_OFFSET: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Online softmax of one block of masked raw scores: (P in fp32, alpha, new max, new sum). The caller
    rescales the accumulator by alpha before adding P·V. ``ROW_SCALE``: ``qk_scale`` is one value per row (the
    on-chip Q quantisation's scale folded in), else one scalar."""
    # Scores stay raw; the single multiplier (softmax scale, dequant scales, log2 e) goes into one FMA per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    if ROW_SCALE:
        p = _exp2_tile(s * qk_scale[:, None] - (m_new[:, None] - P_OFFSET), EXP_POLY, BLOCK_M, BLOCK_N)
    else:
        p = _exp2_tile(s * qk_scale - (m_new[:, None] - P_OFFSET), EXP_POLY, BLOCK_M, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _pv_dot(acc, p, v, PV_MODE: tl.constexpr, NATIVE_FP8: tl.constexpr, UPCAST: tl.constexpr):
    """acc + P·V with P converted to the product's operand type (see ``_PV_*``)."""
    if PV_MODE == 1:  # e4m3 P x e4m3 V; p is in [0, 2**P_OFFSET], so the saturating cast needs no clamp
        if NATIVE_FP8:
            pc = p.to(tl.float8e4nv)
        else:
            pc = fp32_to_e4m3(p.to(tl.float32), False)  # the interpreter's own fp32->fp8 cast is wrong (NOTES §1)
        acc = tl.dot(pc, v, acc)
    elif PV_MODE == 2:  # FP8 V widened on chip: fp16 holds e4m3 exactly and P in [0, 256] with 11 bits
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    elif PV_MODE == 3:  # FP8 bytes: decoded values are V * 2**-8 (the output scale takes the 2**8 back)
        acc = tl.dot(p.to(tl.float16), _e4m3_bytes_to_f16(v), acc)
    elif UPCAST:  # the interpreter's bf16 dot multiplies bit patterns; fp32 there is exact
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc


@triton.jit
def _block_update(acc, m_i, l_i, s, v_ptrs, vd, kv_tok0, shift, v_col, start_n, n_end, offs_n, stride_vt, qk_scale,
                  BOUNDS: tl.constexpr, PV_MODE: tl.constexpr, V_DIM_MAJOR: tl.constexpr, UPCAST: tl.constexpr,
                  NATIVE_FP8: tl.constexpr, EXP_POLY: tl.constexpr, ROW_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
                  P_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The online-softmax step of one key block from its masked scores ``s``: rescale, P, P·V."""
    pos = start_n + offs_n
    toks = pos - shift
    ok = (toks >= 0) & (toks < n_end)
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, qk_scale, EXP_POLY, ROW_SCALE, P_OFFSET, BLOCK_M, BLOCK_N)
    acc = acc * alpha[:, None]
    v = _load_v(v_ptrs, vd, kv_tok0 + start_n, v_col, pos, ok, stride_vt, BOUNDS, V_DIM_MAJOR, USE_TMA)
    return _pv_dot(acc, p, v, PV_MODE, NATIVE_FP8, UPCAST), m_new, l_i


@triton.jit
def _carried_step(acc, m_i, l_i, s_a, start_n, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift,
                  k_col, v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL: tl.constexpr,
                  D_A: tl.constexpr, D_B: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr,
                  V_DIM_MAJOR: tl.constexpr, UPCAST: tl.constexpr, NATIVE_FP8: tl.constexpr, EXP_POLY: tl.constexpr,
                  ROW_SCALE: tl.constexpr, USE_TMA: tl.constexpr, P_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """One block of ``_carried_sweep``: the rest of its scores onto the carried part ``s_a``, then the update."""
    s = _late_scores(
        s_a, qa, qb, kd_a, kd_b, k_ptrs_a, k_ptrs_b, kv_tok0, k_col, start_n, offs_n, stride_kt, D_A, D_B, QK_MODE,
        UPCAST, USE_TMA,
    )  # fmt: skip
    if CAUSAL:
        s = _causal_mask(s, start_n + offs_n - shift, key_limit)
    return _block_update(
        acc, m_i, l_i, s, v_ptrs, vd, kv_tok0, shift, v_col, start_n, n_end, offs_n, stride_vt, qk_scale,
        False, PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, ROW_SCALE, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _sweep(acc, m_i, l_i, lo, hi, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift, k_col, v_col,
           key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL: tl.constexpr, BOUNDS: tl.constexpr,
           CARRIED: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, QK_MODE: tl.constexpr,
           PV_MODE: tl.constexpr, V_DIM_MAJOR: tl.constexpr, UPCAST: tl.constexpr, NATIVE_FP8: tl.constexpr,
           EXP_POLY: tl.constexpr, ROW_SCALE: tl.constexpr, USE_TMA: tl.constexpr, P_OFFSET: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Key blocks [lo, hi) of the online softmax; ``CAUSAL``: score mask on the diagonal; ``BOUNDS``: blocks that
    reach outside the request's keys (masked scores, zeroed V rows).

    ``CARRIED`` (``PIPE_QK = 2``, blocks inside the request): the first head-dim part of each block's scores
    (q_a·k_aᵀ) is issued right after the previous block's P·V and carried into the next iteration, where the
    second part accumulates onto it. Triton makes a product used in its own iteration synchronous (it waits for
    every product in flight), so the plain loop waits twice per key block and this one once: the matrix unit
    runs P·V, q_a·k_aᵀ and q_b·k_bᵀ back to back. Every in-request sweep of a kernel takes this form or none
    does: ptxas otherwise serialises all of the kernel's matrix instructions (C7515)."""
    if CARRIED:
        if hi > lo:
            last = hi - BLOCK_N
            s_a = _early_scores(
                qa, kd_a, k_ptrs_a, kv_tok0, k_col, lo, offs_n, stride_kt, D_B, QK_MODE, UPCAST, USE_TMA, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
            for start_n in tl.range(lo, last, BLOCK_N):
                acc, m_i, l_i = _carried_step(
                    acc, m_i, l_i, s_a, start_n, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift,
                    k_col, v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL, D_A, D_B,
                    QK_MODE, PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, ROW_SCALE, USE_TMA, P_OFFSET,
                    BLOCK_M, BLOCK_N,
                )  # fmt: skip
                s_a = _early_scores(
                    qa, kd_a, k_ptrs_a, kv_tok0, k_col, start_n + BLOCK_N, offs_n, stride_kt, D_B, QK_MODE, UPCAST,
                    USE_TMA, BLOCK_M, BLOCK_N,
                )  # fmt: skip
            acc, m_i, l_i = _carried_step(
                acc, m_i, l_i, s_a, last, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, kd_a, kd_b, vd, kv_tok0, shift, k_col,
                v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, CAUSAL, D_A, D_B, QK_MODE, PV_MODE,
                V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, ROW_SCALE, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    else:
        for start_n in tl.range(lo, hi, BLOCK_N):
            s = _block_scores(
                qa, qb, k_ptrs_a, k_ptrs_b, kd_a, kd_b, kv_tok0, shift, k_col, start_n, key_limit, n_end, offs_n,
                stride_kt, CAUSAL, BOUNDS, D_A, D_B, QK_MODE, UPCAST, USE_TMA, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            acc, m_i, l_i = _block_update(
                acc, m_i, l_i, s, v_ptrs, vd, kv_tok0, shift, v_col, start_n, n_end, offs_n, stride_vt, qk_scale,
                BOUNDS, PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, ROW_SCALE, USE_TMA, P_OFFSET, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_items", "share_rows"])
def _mla_context_fwd_kernel(
    Q, K, V, O, LSE, Qd_a, Qd_b, Kd_a, Kd_b, Vd, Work, n_items, share_rows, scale_ptr, softmax_scale, kv_scale,
    q_scale_ptr,
    q_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_lt, stride_lh,
    H: tl.constexpr, GROUP: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DV: tl.constexpr,
    Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, Q_QUANT: tl.constexpr,
    V_DIM_MAJOR: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, Q_SCALE_FROM_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr, P_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EXP_POLY: tl.constexpr, USE_TMA: tl.constexpr, KV_ALIGN: tl.constexpr, PIPE_QK: tl.constexpr,
    HEADS_OUTER: tl.constexpr, SPLIT_KV: tl.constexpr = False, CHIP_SHARES: tl.constexpr = False,
):  # fmt: skip
    """One (query tile, head) per program. With ``USE_TMA`` the ``*d_*`` arguments are 2-D tensor descriptors
    (rows = tokens, columns = head x dim; V dim-major: rows = head x dim) and ``Q``/``K``/``V`` are unused.
    ``QK_MODE`` / ``PV_MODE``: the products' operand types (``_QK_*`` / ``_PV_*``); with the byte modes FP8
    tensors arrive as uint8 and are decoded on chip. A work item is (first query row, rows, first KV row of the
    request, keys every row sees - 1): 0 rows is an empty item; rows with no keys to sweep (an invalid request of
    a device-built table: ``diag0 = -rows``) come out as NaN (0 / 0), never as another request's data.

    ``SPLIT_KV``: items of 8 ints, (the four above, output row, key cap, 0, 0): a key share, rebased so that its
    first key block is the item's (``_share_items``); it sweeps keys below ``min(cap, diag0 + rows)`` only and
    writes its partial output and lse to row ``output row`` of ``O`` / ``LSE`` (fp32 scratch); rows with no keys
    write 0 and lse -inf, so that ``merge_attention_states`` drops them.

    ``CHIP_SHARES`` (with ``SPLIT_KV``): 4-int items of a device-built table, each split into the grid's
    ``num_programs / (n_items x H)`` shares on chip (``_chip_share``); share c writes partial rows from
    ``c x share_rows + q_row0``, and an invalid request's item (no keys at all) writes lse NaN, so that the merge
    makes its rows NaN as the one-share kernel does."""
    pid = tl.program_id(0)
    if CHIP_SHARES:
        per_share = n_items * H
        c = pid // per_share
        n_shares = tl.num_programs(0) // per_share
        pid = pid % per_share
    if HEADS_OUTER:
        # Consecutive programs are tiles of one head: the programs resident at once read the same few heads'
        # K/V, which then stay in L2. Heaviest first still holds within each head.
        item = pid % n_items
        head = pid // n_items
    else:
        item = pid // H
        head = pid % H
    if SPLIT_KV and not CHIP_SHARES:
        w = Work + item.to(tl.int64) * 8
        out_row0 = tl.load(w + 4)
        cap = tl.load(w + 5)
    else:
        w = Work + item.to(tl.int64) * 4
    q_row0 = tl.load(w)
    n_rows = tl.load(w + 1)
    kv_row0 = tl.load(w + 2)
    diag0 = tl.load(w + 3)
    if CHIP_SHARES:
        invalid = (n_rows > 0) & (diag0 + n_rows <= 0)
        kv_row0, diag0, cap = _chip_share(n_rows, kv_row0, diag0, c, n_shares, KV_ALIGN, BLOCK_N)
        out_row0 = c * share_rows + q_row0
    kvh = head // GROUP

    if SCALE_FROM_PTR:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    qk_scale = softmax_scale * LOG2E
    out_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * kv_scale
        out_scale = kv_scale
        if Q_FP8:  # an FP8 q's own dequantisation scale (the host passes kv_scale's when it has none)
            if Q_SCALE_FROM_PTR:
                q_scale = tl.load(q_scale_ptr).to(tl.float32)
            qk_scale = qk_scale * q_scale
    if PV_MODE == 3:  # decoded bytes are the value * 2**-8 (K, V, and Q when FP8)
        qk_scale = qk_scale * 256.0
        out_scale = out_scale * 256.0
        if Q_FP8:
            qk_scale = qk_scale * 256.0

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
    if QK_MODE == 2 and Q_FP8:
        qa = _e4m3_bytes_to_f16(qa)
        qb = _e4m3_bytes_to_f16(qb)
    if Q_QUANT:
        qa, qb, s_q = _quantise_q(qa, qb, NATIVE_FP8, D_B)
        qk_scale = qk_scale * s_q
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
    if SPLIT_KV:
        n_end = tl.minimum(n_end, cap)
    # In block positions (key + shift), four sweeps, each a multiple of BLOCK_N long:
    #   [0, head_end)        the aligned head (dim-major V, shift > 0): keys < 0 belong to the previous request;
    #   [head_end, n_full)   keys every row of the tile sees: no masks at all (almost every block);
    #   [diag_lo, in_end)    the causal diagonal inside the request's keys: score mask only;
    #   [tail_lo, pos_end)   at most one block reaching past n_end: score mask and zeroed V rows.
    head_end = tl.where(shift > 0, BLOCK_N, 0)
    n_full = tl.maximum(((diag0 + shift + 1) // BLOCK_N) * BLOCK_N, 0)
    pos_end = n_end + shift
    in_end = ((n_end + shift) // BLOCK_N) * BLOCK_N
    if SPLIT_KV:  # a capped share ends before keys every row sees can: no unmasked block past its end
        n_full = tl.minimum(n_full, in_end)
    diag_lo = tl.maximum(n_full, head_end)
    tail_lo = tl.maximum(diag_lo, in_end)
    CARRIED: tl.constexpr = PIPE_QK == 2
    # The four sweeps, as (lo, hi, CAUSAL, BOUNDS, CARRIED); the rest of the arguments are the same.
    acc, m_i, l_i = _sweep(
        acc, m_i, l_i, 0, head_end, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col,
        v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, True, True, False, D_A, D_B, QK_MODE,
        PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, Q_QUANT, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _sweep(
        acc, m_i, l_i, head_end, n_full, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col,
        v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, False, False, CARRIED, D_A, D_B, QK_MODE,
        PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, Q_QUANT, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _sweep(
        acc, m_i, l_i, diag_lo, in_end, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col,
        v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, True, False, CARRIED, D_A, D_B, QK_MODE,
        PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, Q_QUANT, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _sweep(
        acc, m_i, l_i, tail_lo, pos_end, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, Kd_a, Kd_b, Vd, kv_tok0, shift, k_col,
        v_col, key_limit, n_end, offs_n, stride_kt, stride_vt, qk_scale, True, True, False, D_A, D_B, QK_MODE,
        PV_MODE, V_DIM_MAJOR, UPCAST, NATIVE_FP8, EXP_POLY, Q_QUANT, USE_TMA, P_OFFSET, BLOCK_M, BLOCK_N,
    )  # fmt: skip

    if SPLIT_KV:  # a share may hold no keys for some rows: 0 with lse -inf, which the merge drops
        o = acc * (out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        o_rows = (out_row0 + offs_m).to(tl.int64)
        if CHIP_SHARES:  # an invalid request: NaN, which the merge keeps
            empty = tl.where(invalid, float("nan"), float("-inf"))
        else:
            empty = float("-inf")
    else:
        o = acc * (out_scale / l_i)[:, None]  # 0 / 0 = NaN for rows with no keys (invalid requests)
        o_rows = q_rows
        empty = float("nan")
    o_ptrs = O + o_rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0, (m_i - P_OFFSET + tl.math.log2(l_i)) * LN2, empty)
        tl.store(LSE + o_rows * stride_lt + head.to(tl.int64) * stride_lh, lse, mask=row_ok)


@triton.jit
def _request_bounds(CuQ, CuKV, r, live, total_q, kv_rows, max_q, max_kv):
    """(q0, ql, k0, kl, rows_ok, ok) of request r: its first query and key row, its lengths, whether its query rows
    lie within q (``rows_ok``) and whether it keeps the whole contract (``ok``). Both passes of the device-built
    table read a request through this, so the tile count and the items agree on what is bad."""
    q0 = tl.load(CuQ + r, mask=live, other=0)
    q1 = tl.load(CuQ + r + 1, mask=live, other=0)
    k0 = tl.load(CuKV + r, mask=live, other=0)
    k1 = tl.load(CuKV + r + 1, mask=live, other=0)
    ql = q1 - q0
    kl = k1 - k0
    rows_ok = (q0 >= 0) & (ql >= 0) & (q1 <= total_q)
    ok = rows_ok & (k0 >= 0) & (kl >= 0) & (k1 <= kv_rows) & (ql <= kl) & (ql <= max_q) & (kl <= max_kv)
    return q0, ql, k0, kl, rows_ok, ok


@triton.jit
def _work_item(CuQ, CuKV, r, t, live, total_q, kv_rows, max_q, max_kv, BLOCK_M: tl.constexpr):
    """(q_row0, n_rows, kv_row0, diag0) of tile t of request r (see ``_mla_work_items_kernel``)."""
    q0, ql, k0, kl, rows_ok, ok = _request_bounds(CuQ, CuKV, r, live, total_q, kv_rows, max_q, max_kv)
    m0 = t * BLOCK_M
    n_rows = tl.where(live & rows_ok, tl.minimum(tl.maximum(ql - m0, 0), BLOCK_M), 0)
    q_row0 = tl.where(n_rows > 0, q0 + m0, 0)
    kv_row0 = tl.where(ok & (n_rows > 0), k0, 0)
    diag0 = tl.where(n_rows > 0, tl.where(ok, kl - ql + m0, -n_rows), 0)
    return q_row0, n_rows, kv_row0, diag0


@triton.jit
def _tile_starts(CuQ, CuKV, Starts, Flag, n_req, total_q, kv_rows, max_q, max_kv, BLOCK_M: tl.constexpr,
                 R_BLOCK: tl.constexpr, SET_FLAG: tl.constexpr):  # fmt: skip
    """First pass of the device-built work table (one program): ``Starts[r]`` = index of request r's first
    (request, query-tile) item, ``Starts[n_req]`` = the number of items, and with ``SET_FLAG`` ``Flag[0]`` = 1 when
    any request breaks the contract (``cu_seqlens_q[0] != 0``, decreasing entries, q_len > kv_len, past
    ``max_seqlen_*``, more rows than q or k/v hold), else 0. Requests of any count, ``R_BLOCK`` at a time."""
    carry = tl.zeros((), dtype=tl.int32)
    bad_any = (tl.load(CuQ) != 0).to(tl.int32)
    for c in tl.range(0, n_req, R_BLOCK):
        r = c + tl.arange(0, R_BLOCK)
        live = r < n_req
        _, ql, _, _, rows_ok, ok = _request_bounds(CuQ, CuKV, r, live, total_q, kv_rows, max_q, max_kv)
        # A request past max_seqlen_q keeps the tiles of max_seqlen_q rows (NaN): the host's slot bound holds.
        tiles = tl.where(live & rows_ok, (tl.minimum(ql, max_q) + BLOCK_M - 1) // BLOCK_M, 0)
        incl = tl.cumsum(tiles, 0) + carry
        tl.store(Starts + r, incl - tiles, mask=live)
        carry = carry + tl.sum(tiles, 0)
        bad_any = tl.maximum(bad_any, tl.max((live & ~ok).to(tl.int32), 0))
    tl.store(Starts + n_req, carry)
    if SET_FLAG:
        tl.store(Flag, bad_any)


@triton.jit(do_not_specialize=["n_req", "total_q", "kv_rows", "max_q", "max_kv"])
def _mla_tile_starts_kernel(CuQ, CuKV, Starts, Flag, n_req, total_q, kv_rows, max_q, max_kv, BLOCK_M: tl.constexpr,
                            R_BLOCK: tl.constexpr, SET_FLAG: tl.constexpr):  # fmt: skip
    """The first pass (``_tile_starts``) alone, before a table too large for one sorting program."""
    _tile_starts(CuQ, CuKV, Starts, Flag, n_req, total_q, kv_rows, max_q, max_kv, BLOCK_M, R_BLOCK, SET_FLAG)


@triton.jit
def _locate(Starts, i, n_req, n_iter, live):
    """(request, tile) of item ``i``: the last request whose first item is <= i (binary search over ``Starts``,
    ``n_iter`` >= log2(n_req) steps); requests with no items share their successor's start and lose the search."""
    lo = tl.zeros_like(i)
    hi = tl.zeros_like(i) + n_req
    for _ in tl.range(0, n_iter):
        mid = (lo + hi) // 2
        more = (hi - lo) > 1
        s = tl.load(Starts + mid, mask=live & more, other=0)
        up = more & (s <= i)
        lo = tl.where(up, mid, lo)
        hi = tl.where(more & ~up, mid, hi)
    t = i - tl.load(Starts + lo, mask=live, other=0)
    return lo, t


@triton.jit
def _work_items(CuQ, CuKV, Starts, Work, n_req, n_slots, n_iter, total_q, kv_rows, max_q, max_kv, pid,
                BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, SORT: tl.constexpr):  # fmt: skip
    """Second pass: the ``n_slots`` rows of the work table (``n_slots`` >= the item count, a bound the host knows
    without reading the lengths; slots past the last item are empty). Item i is tile i - Starts[r] of the request
    r that ``_locate`` finds. ``SORT`` (one program, ``N_PAD`` >= n_slots): heaviest first by keys swept, ties in
    item order, empty items last, as the host plan orders them; else (one program per ``N_PAD`` slots) each
    request's last tile first. A request whose lengths break the contract gets items with no keys to sweep (NaN
    rows, see ``_work_item``) where its query rows exist, else none."""
    i = pid * N_PAD + tl.arange(0, N_PAD)
    total = tl.load(Starts + n_req)
    live = i < tl.minimum(total, n_slots)
    if SORT:
        r, t = _locate(Starts, i, n_req, n_iter, live)
        _, n_rows, _, diag0 = _work_item(CuQ, CuKV, r, t, live, total_q, kv_rows, max_q, max_kv, BLOCK_M)
        cost = tl.where(live & (n_rows > 0), diag0 + n_rows, -1).to(tl.int64)
        key = tl.sort((cost << 32) | (N_PAD - 1 - i).to(tl.int64), descending=True)
        j = N_PAD - 1 - (key & 0xFFFFFFFF).to(tl.int32)
        live_j = j < tl.minimum(total, n_slots)
        r, t = _locate(Starts, j, n_req, n_iter, live_j)
    else:  # last tile of each request first
        live_j = live
        r, t = _locate(Starts, i, n_req, n_iter, live)
        nxt = tl.load(Starts + r + 1, mask=live, other=0)
        t = nxt - tl.load(Starts + r, mask=live, other=0) - 1 - t
    q_row0, n_rows, kv_row0, diag0 = _work_item(CuQ, CuKV, r, t, live_j, total_q, kv_rows, max_q, max_kv, BLOCK_M)
    w = Work + i.to(tl.int64) * 4
    st = i < n_slots
    tl.store(w, q_row0, mask=st)
    tl.store(w + 1, n_rows, mask=st)
    tl.store(w + 2, kv_row0, mask=st)
    tl.store(w + 3, diag0, mask=st)


@triton.jit(do_not_specialize=["n_req", "n_slots", "n_iter", "total_q", "kv_rows", "max_q", "max_kv"])
def _mla_work_items_kernel(CuQ, CuKV, Starts, Work, n_req, n_slots, n_iter, total_q, kv_rows, max_q, max_kv,
                           BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, SORT: tl.constexpr):  # fmt: skip
    """The second pass (``_work_items``), one program per ``N_PAD`` slots (after ``_mla_tile_starts_kernel``)."""
    _work_items(CuQ, CuKV, Starts, Work, n_req, n_slots, n_iter, total_q, kv_rows, max_q, max_kv, tl.program_id(0),
                BLOCK_M, N_PAD, SORT)  # fmt: skip


@triton.jit(do_not_specialize=["n_req", "n_slots", "n_iter", "total_q", "kv_rows", "max_q", "max_kv"])
def _mla_work_table_kernel(CuQ, CuKV, Starts, Flag, Work, n_req, n_slots, n_iter, total_q, kv_rows, max_q, max_kv,
                           BLOCK_M: tl.constexpr, R_BLOCK: tl.constexpr, SET_FLAG: tl.constexpr,
                           N_PAD: tl.constexpr):  # fmt: skip
    """Both passes in one program (a table that one sorting program orders): one launch, not two, on the one
    call's path. The barrier makes the first pass's ``Starts`` visible to every thread of the second."""
    _tile_starts(CuQ, CuKV, Starts, Flag, n_req, total_q, kv_rows, max_q, max_kv, BLOCK_M, R_BLOCK, SET_FLAG)
    tl.debug_barrier()
    _work_items(CuQ, CuKV, Starts, Work, n_req, n_slots, n_iter, total_q, kv_rows, max_q, max_kv, 0, BLOCK_M, N_PAD,
                True)  # fmt: skip


# ----------------------------------------------------------------------------------------------------- configs


def _cfg(
    *,
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    tma: bool = False,
    pipe_qk: int = 0,
    heads_outer: bool = False,
    exp_poly: bool = False,
    q_quant: bool = False,
    v_widen: bool = False,
    fp8_bytes: bool = False,
    gluon: bool = False,
    pingpong: bool = False,
    key_perm: bool = False,
) -> triton.Config:
    """A launch configuration. ``pipe_qk``: 0 (plain loops) or 2 (carried score part; 1 named a variant that
    lost and was removed). ``q_quant``: quantise a 16-bit Q on chip when K/V are FP8. ``v_widen``: FP8 token-major
    V widened to fp16 for P·V. ``fp8_bytes``: FP8 inputs decoded on chip (forced on GPUs without FP8 MMA).
    ``gluon``: the warp-specialised sm_90 kernel, with ``pingpong`` (consumers take turns) and ``key_perm`` (keys
    reordered within each 32 so P needs no shuffles on its way to the FP8 A operand; see mla_context_gluon)."""
    if pipe_qk not in (0, 2):
        raise ValueError(f"pipe_qk: expected 0 or 2, got {pipe_qk}")
    kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "EXP_POLY": int(exp_poly), "USE_TMA": int(tma)}
    # Absent means 0, so committed tuning entries from before a knob stay valid.
    for name, val in (("PIPE_QK", pipe_qk), ("HEADS_OUTER", heads_outer), ("Q_QUANT", q_quant),
                      ("V_WIDEN", v_widen), ("FP8_BYTES", fp8_bytes), ("GLUON", gluon),
                      ("GLUON_PP", pingpong), ("GLUON_KP", key_perm)):  # fmt: skip
        if val:
            kwargs[name] = int(val)
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def _smem_estimate(cfg: triton.Config, key: tuple) -> int:
    """Q tile + num_stages (K, V) tiles, and with ``PIPE_QK = 2`` one more tile of K's first head-dim part (its
    loads run a block ahead of the rest); matches the compiler's report (Triton 3.6, sm_90) to within 1 KB.
    Widened FP8 operands (``V_WIDEN``, ``Q_QUANT``'s scratch) live in registers and are not counted."""
    d_qk, d_v, q_kind, kv_kind = key[:4]
    qb, kvb = (1 if q_kind == "e4m3" else 2), (1 if kv_kind == "e4m3" else 2)
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    d_a, d_b = _split_head_dim(d_qk) or (d_qk, 0)
    if cfg.kwargs.get("GLUON"):  # K and V ring slots, plus the V warpgroup's operand slot (FP8 token-major V)
        widen = bool(cfg.kwargs.get("V_WIDEN")) and kvb == 1
        op_slot = 0 if (key[4] == "dim_major" or kvb == 2) else (2 * bn * d_v if widen else bn * d_v)
        ring = max(1, cfg.num_stages) * (bn * (d_qk + d_v) * kvb + op_slot)
        if kvb == 2 or widen:  # Q waits in shared memory (K's type) for the score products
            return ring + 128 * d_qk * kvb
        # + layout-conversion scratch: 16 KB for Q and P (measured 98,396 B at 2 stages, dim-major, Triton 3.6)
        return ring + 16 * 1024
    extra = bn * d_a * kvb if cfg.kwargs.get("PIPE_QK") == 2 and d_b else 0
    return bm * d_qk * qb + max(1, cfg.num_stages) * bn * (d_qk + d_v) * kvb + extra


# A batch whose longest query has at most this many rows plans with the short-query key (key + ("short_q",)):
# 128-row tiles would leave half their rows idle (64 new rows over a long cached prefix, e.g. decode-like
# extends), so that key keeps only 64-row tiles that leave room for two programs per SM.
SHORT_Q_ROWS = 64
# Key shares (split-KV) of a host-planned batch whose (item, head) programs are too few to fill the GPU: a few
# short query tiles over a long cached prefix (a chunk of a long prompt, a new turn of a long conversation) would
# otherwise run one program per SM, each sweeping every key alone. Each share writes an fp32 partial output and
# lse; ``merge_attention_states`` merges them (both kernels have the share form).
KV_SPLIT_MAX_PROGRAMS = 2  # split only below this many programs per resident slot
KV_SPLIT_PROGRAM_COST = 2  # a program's fixed cost (Q load, pipeline fill, partial store) in key blocks
KV_SPLIT_MIN_GAIN = 0.9  # shares only when the modelled time drops below this fraction of one share's
KV_SPLIT_RESIDENT_PORTABLE = 2  # programs of the portable kernel resident per SM (an estimate; the Gluon kernel: 1)
KV_SPLIT_MIN_BLOCKS = 8  # key blocks a share sweeps at least
KV_SPLIT_MAX = 16
KV_SPLIT_SCRATCH_BYTES = 1 << 29  # the partials' scratch stays under this


def context_kv_splits(
    n_items: int,
    num_heads: int,
    longest_blocks: int,
    sms: int,
    scratch_bytes_per_split: int = 0,
    resident: int = 1,
) -> int:
    """Key shares per work item for a host-planned batch, from a wave model: ``P = n_items x num_heads`` programs
    times ``s`` shares run in ``ceil(P s / (sms x resident))`` waves of ``longest_blocks / s +
    KV_SPLIT_PROGRAM_COST`` block times each; the ``s`` with the fewest modelled block times, if that is under
    ``KV_SPLIT_MIN_GAIN`` of one share's (else 1). Only below ``KV_SPLIT_MAX_PROGRAMS`` programs per resident slot;
    each share at least ``KV_SPLIT_MIN_BLOCKS`` key blocks, at most ``KV_SPLIT_MAX`` shares, and the fp32
    partials (``scratch_bytes_per_split`` each) under ``KV_SPLIT_SCRATCH_BYTES``. Waves matter: on the H200 one
    16-head 422-row tile run over 20k keys (64 programs) took 157 us in 2 shares (one wave) but 207 us in 3."""
    for name, v, lo in (("n_items", n_items, 0), ("num_heads", num_heads, 1), ("longest_blocks", longest_blocks, 0),
                        ("sms", sms, 1), ("scratch_bytes_per_split", scratch_bytes_per_split, 0),
                        ("resident", resident, 1)):  # fmt: skip
        check_int(name, v, lo)
    programs, slots = n_items * num_heads, sms * resident
    if programs == 0 or programs >= KV_SPLIT_MAX_PROGRAMS * slots:
        return 1
    by_scratch = KV_SPLIT_SCRATCH_BYTES // scratch_bytes_per_split if scratch_bytes_per_split else KV_SPLIT_MAX
    most = min(longest_blocks // KV_SPLIT_MIN_BLOCKS, by_scratch, KV_SPLIT_MAX)

    def cost(s: int) -> float:
        return -(-programs * s // slots) * (longest_blocks / s + KV_SPLIT_PROGRAM_COST)

    best = min(range(1, max(1, most) + 1), key=cost)  # the first (fewest shares) of equal costs
    return best if cost(best) < KV_SPLIT_MIN_GAIN * cost(1) else 1


_SHORT_Q = "short_q"


def _applies(cfg: triton.Config, key: tuple) -> bool:
    """Whether a config's knobs mean anything for a key (a knob that does not is a duplicate candidate)."""
    k = cfg.kwargs
    q_kind, kv_kind, layout = key[2], key[3], key[4]
    if k.get("Q_QUANT") and not (q_kind != "e4m3" and kv_kind == "e4m3"):
        return False
    if k.get("V_WIDEN") and not (kv_kind == "e4m3" and layout == "token_major"):
        return False
    if k.get("GLUON_KP") and not (kv_kind == "e4m3" and not k.get("V_WIDEN")):
        return False  # the key reorder only concerns an e4m3 P
    # The Gluon kernel's modes (mla_context_gluon.gluon_supports): a 16-bit Q with FP8 K/V only with V widened
    # (its e4m3 P on top of the quantised Q measured rel-RMSE 0.036 on the H200 grid, past the bench's 0.035).
    if k.get("GLUON"):
        if k.get("FP8_BYTES") or k["BLOCK_M"] != 128:
            return False
        if kv_kind == "e4m3" and q_kind != "e4m3" and not k.get("V_WIDEN"):
            return False
        if kv_kind != "e4m3" and (q_kind != kv_kind or layout != "token_major"):
            return False
    return not (k.get("FP8_BYTES") and kv_kind != "e4m3")


def _keep(cfg: triton.Config, key: tuple, arch: tuple[int, int] | None) -> bool:
    if not _applies(cfg, key):
        return False
    # The polynomial split halves BLOCK_N; below 32 columns it only adds reshapes.
    if cfg.kwargs["EXP_POLY"] and cfg.kwargs["BLOCK_N"] < 32:
        return False
    cap = capability_for(arch)
    if key[3] == "e4m3" and not cap.fp8_mma and not cfg.kwargs.get("FP8_BYTES"):
        return False  # no e4m3 matrix instructions: FP8 is decoded on chip
    if cfg.kwargs["USE_TMA"] and not cap.tma:
        return False
    if cfg.kwargs.get("GLUON") and not cap.warp_specialized:
        return False
    smem = cap.smem_per_block
    if _SHORT_Q in key[5:]:
        return cfg.kwargs["BLOCK_M"] <= SHORT_Q_ROWS and 2 * _smem_estimate(cfg, key) <= smem
    return _smem_estimate(cfg, key) <= smem


_T128 = dict(block_m=128, warps=8, tma=True)
_T64 = dict(block_m=64, block_n=64, warps=4, tma=True)
_LONG = dict(_T128, block_n=128, stages=3, pipe_qk=2, heads_outer=True)  # the long-query FP8 shape
# Key: (d_qk, d_v, q dtype, kv dtype, v_layout[, "short_q"]); the first candidate a key keeps is what an untuned
# key gets, the rest are what tuning at first use (or bench/bench_mla_context.py --tune) times. sm_90's order
# follows the H200 sweeps recorded in bench/results/mla_context.md; committed choices live in tuned/sm90.json.
_GLUON = dict(block_m=128, block_n=128, warps=8, gluon=True, heads_outer=True)
_SM90 = [
    _cfg(**_LONG, q_quant=True, v_widen=True),  # 16-bit Q, FP8 K/V, token-major V
    _cfg(**_LONG, q_quant=True),
    _cfg(**_LONG, v_widen=True),  # FP8 Q/K/V, token-major V
    _cfg(**_LONG),
    _cfg(**dict(_LONG, block_n=64)),  # bf16 (before the Gluon candidates, which also apply to 16-bit keys)
    _cfg(**_GLUON, stages=2),  # warp-specialised (mla_context_gluon)
    _cfg(**_GLUON, stages=3),
    _cfg(**_GLUON, stages=2, pingpong=True),
    _cfg(**_GLUON, stages=2, key_perm=True),
    _cfg(**_GLUON, stages=2, pingpong=True, key_perm=True),
    _cfg(**_GLUON, stages=2, v_widen=True),  # also the 16-bit Q + FP8 K/V mode of the Gluon kernel
    _cfg(**_GLUON, stages=2, v_widen=True, pingpong=True),
    _cfg(**_T128, block_n=128, stages=4, heads_outer=True),
    _cfg(**_T64, stages=3, q_quant=True, v_widen=True),
    _cfg(**_T64, stages=3, v_widen=True),
    _cfg(**_T64, stages=3),
    _cfg(**_T64, stages=2),
    _cfg(**_T128, block_n=128, stages=4),
    _cfg(**_T128, block_n=64, stages=4),
    _cfg(block_m=64, block_n=128, warps=4, stages=2, tma=True),
    _cfg(**_T64, stages=4),
    _cfg(block_m=128, block_n=64, warps=8, stages=3),
    _cfg(**_T128, block_n=128, stages=2),
    _cfg(block_m=64, block_n=64, warps=4, stages=2),
]
# Without tensor descriptors (sm_80/86/89) and, on sm_80/86, with FP8 decoded on chip (no FP8 MMA).
_POINTER = [
    _cfg(block_m=128, block_n=64, warps=8, stages=2),
    _cfg(block_m=64, block_n=64, warps=4, stages=2),
    _cfg(block_m=64, block_n=64, warps=4, stages=3),
    _cfg(block_m=128, block_n=32, warps=4, stages=2),
    _cfg(block_m=64, block_n=32, warps=4, stages=2),
]
_AMPERE = [
    _cfg(block_m=128, block_n=64, warps=8, stages=2, fp8_bytes=True),
    _cfg(block_m=64, block_n=64, warps=4, stages=2, fp8_bytes=True),
    _cfg(block_m=64, block_n=64, warps=4, stages=3, fp8_bytes=True),
    _cfg(block_m=128, block_n=32, warps=4, stages=2, fp8_bytes=True),
    _cfg(block_m=64, block_n=32, warps=4, stages=2, fp8_bytes=True),
    *_POINTER,
]
_CONFIGS = ConfigTable(
    fallback=[_cfg(block_m=64, block_n=64, warps=4, stages=2)],
    interpreter=_cfg(block_m=16, block_n=16, warps=1, stages=1),
    by_arch={(9, 0): _SM90, (8, 0): _AMPERE, (8, 6): _AMPERE, (8, 7): _AMPERE, 8: _POINTER, 10: _SM90, 12: _SM90},
    keep_arch=_keep,
)
# Untuned keys time at most this many candidates at first use (each compiles once, ~10-30 s on an H200).
_TUNE_FIRST = 6
_KERNEL = TunedKernel("mla_context_fwd", _mla_context_fwd_kernel, _CONFIGS, tune_first=_TUNE_FIRST)


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


def _check_cu(name: str, cu: object, device: torch.device, n: int | None, host_ok: bool) -> torch.Tensor:
    check_tensor(name, cu, dtype=torch.int32, ndim=1)
    assert isinstance(cu, torch.Tensor)
    if cu.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with storage (on {device} or the host), got a meta tensor")
    if not same_device(cu.device, device) and not (host_ok and cu.device.type == "cpu"):
        raise ValueError(f"{name}: expected a tensor on {device} (or the host), got one on {cu.device}")
    if cu.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (batch size + 1), got 0")
    if n is not None and cu.numel() != n:
        raise ValueError(f"{name}: expected {n} entries (batch size + 1, like cu_seqlens_q), got {cu.numel()}")
    return cu


def _host_lengths(name: str, cu: object, device: torch.device, n: int | None) -> list[int]:
    vals = _check_cu(name, cu, device, n, host_ok=True).tolist()  # one host read per plan
    if vals[0] < 0:
        raise ValueError(f"{name}: entries must be >= 0, got {vals[0]} first")
    for i in range(len(vals) - 1):
        if vals[i + 1] < vals[i]:
            raise ValueError(f"{name}: must be non-decreasing, got {vals[i]} then {vals[i + 1]} at index {i}")
    return vals


def _check_max_seqlen(name: str, val: object) -> int | None:
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int) or val < 0:
        raise ValueError(f"{name}: expected a non-negative int or None, got {val!r}")
    return val


@dataclass(frozen=True)
class _Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    v_layout: str


def mla_context_paths(device: torch.device | str | None = None) -> dict[str, str]:
    """Which input combinations a device runs, and how: path name -> "native ..." / "... on chip" /
    "unsupported: why". ``device`` defaults to the current CUDA device (the interpreter runs every path)."""
    cap = gpu_capability(torch.device(device) if device is not None else None)
    where = "tensor descriptors (TMA)" if cap.tma else "pointer loads"
    if cap.arch is not None and not cap.bf16:
        no = f"unsupported: {cap.name} has no bf16 arithmetic and no FP8 path (sm_80 or newer needed)"
        return {"fp16": f"fp16 MMA, {where}", "bf16": no, "fp8 q/k/v": no, "bf16 q + fp8 k/v": no}
    ws = ""
    if cap.warp_specialized:
        from kvforge.kernels.mla_context_gluon import gluon_unavailable_reason

        why = gluon_unavailable_reason(torch.device(device) if device is not None else None)
        ws = (
            "; the warp-specialised Gluon kernel where the per-GPU table chose it"
            if why is None
            else f"; no warp-specialised Gluon kernel ({why})"
        )
    if cap.fp8_mma:
        fp8 = f"e4m3 MMA, {where}" + ws
        mixed = f"Q quantised on chip to e4m3 or K widened to bf16 (per-GPU table), {where}" + ws
    else:
        fp8 = f"FP8 decoded on chip to fp16 MMA ({cap.name} has no e4m3 MMA), {where}"
        mixed = f"K/V decoded on chip to bf16/fp16 MMA, {where}"
    if cap.tma:
        unaligned = (
            "copied per call into a kept 16-byte-aligned buffer (one read and write of the batch's V rows; repeat "
            "calls replay the copy and the launch), then the "
            f"paths above; over {_REPACK_MAX_BYTES >> 30} GiB: pointer loads (about 3x slower, warns once; build V "
            "with v_to_dim_major)"
        )
    else:
        unaligned = f"{where}, like every layout here"
    return {"fp16": f"fp16 MMA, {where}" + ws, "bf16": f"bf16 MMA, {where}" + ws, "fp8 q/k/v": fp8,
            "bf16 q + fp8 k/v": mixed, "op-quantised 16-bit q/k/v": "quantised on the device to FP8 (dim-major "
            "V), then the fp8 q/k/v path", "dim-major v, token stride not 16-byte aligned": unaligned}  # fmt: skip


# A dim-major V that tensor descriptors cannot read is copied into an aligned buffer up to this size (the copy
# reads and writes the batch's V rows once, ~1 ms per 2 GiB on an H200); larger ones take pointer loads and warn.
_REPACK_MAX_BYTES = 8 << 30
_WARNED: set[str] = set()


def _v_path(v: torch.Tensor, sh: _Shapes, tma: bool, rows: int) -> str:
    """How V reaches the kernel: "direct" (token-major, a dim-major V descriptors can read, or a device without
    TMA, where every layout takes pointer loads); "repack" (a dim-major V whose token stride or base is not
    16-byte aligned, or whose heads are not packed: its ``rows`` token rows are copied into a
    ``v_to_dim_major`` buffer, then the descriptor kernels run); "pointer" (such a V over ``_REPACK_MAX_BYTES``:
    pointer loads, the slow path; the call warns once)."""
    if sh.v_layout != "dim_major" or not tma:
        return "direct"
    es = v.element_size()
    if v.data_ptr() % 16 == 0 and (v.stride(1) * es) % 16 == 0 and v.stride(0) == sh.head_dim_v * v.stride(1):
        return "direct"
    return "repack" if rows * sh.num_kv_heads * sh.head_dim_v * es <= _REPACK_MAX_BYTES else "pointer"


# Aligned buffers a "repack" V is copied into, reused by later calls with the same shape on the same stream, so
# those calls replay (a new buffer per call would change the launch's arguments every time). Up to
# _REPACK_KEEP_BYTES each, a few shapes; one per stream, as a buffer is rewritten by the next call that uses it
# and only the stream orders that call after the last one's kernel. A buffer a CUDA graph captured is never
# freed: the graph writes and reads it on every replay, long after the shape left the dict, so an evicted one
# moves to _REPACK_CAPTURED (bounded by the shapes ever captured).
_REPACK_KEEP_BYTES = 256 << 20
_REPACK_BUFFERS: dict[tuple, torch.Tensor] = {}
_REPACK_SHAPES = 8
_REPACK_CAPTURED: dict[int, torch.Tensor] = {}


def _padded_tokens(t: int, element_size: int, align_bytes: int = 16) -> int:
    """A dim-major row's token count padded so its stride is a multiple of ``align_bytes``."""
    per = max(1, align_bytes // element_size)
    return -(-t // per) * per


def _dim_major_empty(h: int, d: int, t: int, dtype: torch.dtype, device, align_bytes: int = 16) -> torch.Tensor:
    """An uninitialised dim-major ``[h, d, t]`` view whose token stride is padded to ``align_bytes``."""
    cap = _padded_tokens(t, dtype.itemsize, align_bytes)
    return torch.empty((h, d, cap), dtype=dtype, device=device)[:, :, :t]


@triton.jit(do_not_specialize=["n_rows", "d", "cols", "s_h", "s_d", "s_mis"])
def _rows_copy_kernel(src, dst, n_rows, d, cols, s_h, s_d, s_mis, t_h, t_d,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """Bytes ``[h, dd, :cols]`` of one ``[H, d, *]`` tensor to the same place in another (rows ``h * d + dd``,
    byte strides ``s_*`` / ``t_*``; ``dst`` and ``t_*`` 4-byte aligned, ``s_mis`` = ``src``'s address mod 4). The
    source rows are not 4-byte aligned (why they are copied), so each output word is two aligned source words
    funnel-shifted: the loads read whole words around the row's bytes (never past the 4-byte words that hold
    them). The row's last ``cols % 4`` bytes go byte by byte in the last column block."""
    sb = src.to(tl.pointer_type(tl.uint8), bitcast=True)
    db = dst.to(tl.pointer_type(tl.uint8), bitcast=True)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    h = (r // d).to(tl.int64)
    dd = (r % d).to(tl.int64)
    rs = h * s_h + dd * s_d  # the row's byte offset from src
    rd = h * t_h + dd * t_d
    mis = (s_mis + rs) % 4
    sh = mis.to(tl.uint64) * 8
    live = r < n_rows
    m = live[:, None] & (j * 4 + 4 <= cols)[None, :]
    w = (sb + (rs - mis)[:, None] + 4 * j[None, :]).to(tl.pointer_type(tl.int32), bitcast=True)
    lo = tl.load(w, mask=m, other=0).to(tl.uint32, bitcast=True)
    # The next word only where the row is shifted (there it holds bytes of this one).
    hi = tl.load(w + 1, mask=m & (sh > 0)[:, None], other=0).to(tl.uint32, bitcast=True)
    # Shifted as one 64-bit value: a 32-bit shift by 32 (an aligned row) is undefined in LLVM.
    x = (((hi.to(tl.uint64) << 32) | lo.to(tl.uint64)) >> sh[:, None]).to(tl.uint32)
    dw = (db + rd[:, None] + 4 * j[None, :]).to(tl.pointer_type(tl.int32), bitcast=True)
    tl.store(dw, x.to(tl.int32, bitcast=True), mask=m)
    if tl.program_id(1) == tl.num_programs(1) - 1:
        b = (cols // 4) * 4 + tl.arange(0, 4)
        mt = live[:, None] & (b < cols)[None, :]
        y = tl.load(sb + rs[:, None] + b[None, :], mask=mt)
        tl.store(db + rd[:, None] + b[None, :], y, mask=mt)


_COPY_ROWS, _COPY_WORDS = 1, 512  # the best of seven tiles on the H200 (bench/probe_repack_copy.py)


def copy_dim_major_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for two ``[H, d, T]`` views whose last dimension is contiguous (a dim-major V and its
    aligned buffer), as one word-copy launch when ``dst``'s rows are 4-byte aligned (else, and on the CPU without
    the interpreter, plain ``copy_``). Refused before anything is written: non-tensors, meta tensors, other than
    3 dimensions, a token dimension not contiguous, shapes, dtypes or devices that differ, ``dst`` overlapping
    itself or ``src``."""
    for name, t in (("dst", dst), ("src", src)):
        check_tensor(name, t, ndim=3)
        if t.device.type == "meta":
            raise ValueError(f"{name}: expected a tensor with storage, got a meta tensor")
        if t.stride(2) != 1:
            raise ValueError(f"{name}: expected the token dimension contiguous (stride 1), got strides {t.stride()}")
    if dst.shape != src.shape or dst.dtype != src.dtype or not same_device(dst.device, src.device):
        raise ValueError(f"dst/src: expected equal [H, d, T] shapes, dtypes and devices, got {tuple(dst.shape)} "
                         f"{dst.dtype} {dst.device} and {tuple(src.shape)} {src.dtype} {src.device}")  # fmt: skip
    check_no_overlap({"dst": dst}, {"src": src})
    launch = _copy_launch(dst, src)
    if launch is None:
        return dst.copy_(src)
    launch_jit(_rows_copy_kernel, launch[0], launch[1], _COPY_CONSTS)
    return dst


_COPY_CONSTS = {"BLOCK_R": _COPY_ROWS, "BLOCK_W": _COPY_WORDS}


def _copy_launch(dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[int, int], tuple] | None:
    """(grid, arguments) of ``_rows_copy_kernel`` for two checked ``[H, d, T]`` views, or None where plain
    ``copy_`` does it (nothing to copy, the CPU without the interpreter, ``dst`` rows not 4-byte aligned)."""
    h, d, t = src.shape
    es = src.element_size()
    t_h, t_d = dst.stride(0) * es, dst.stride(1) * es
    if h * d * t == 0 or (src.device.type != "cuda" and not interpreting()) or dst.data_ptr() % 4 or t_h % 4 or t_d % 4:
        return None
    grid = (_rt.cdiv(h * d, _COPY_ROWS), max(1, _rt.cdiv(t * es // 4, _COPY_WORDS)))
    if es == 1:  # an e4m3 pointer does not compile before sm_89; the kernel reads bytes anyway
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    return grid, (src, dst, h * d, d, t * es, src.stride(0) * es, src.stride(1) * es, src.data_ptr() % 4, t_h, t_d)


@triton.jit(do_not_specialize=["n_tok"])
def _tokens_to_dims_kernel(src, dst, n_tok, n_dblk, s_t, s_h, t_h, t_d, D: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """``dst[h, dd, t] = src[t, h, dd]`` (element strides: ``s_*`` of src's token and head dims, its last dim
    contiguous; ``t_*`` of dst's head and dim rows, its tokens contiguous). One program: head ``h``, ``BLOCK_D``
    of its dims and ``BLOCK_T`` tokens, loaded along the dims (contiguous in src), transposed on chip and stored
    along the tokens (contiguous in dst), so both sides move whole rows rather than one element per row."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = (tl.program_id(1) // n_dblk).to(tl.int64)
    dd = (tl.program_id(1) % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)
    mt = t < n_tok
    md = dd < D
    x = tl.load(src + h * s_h + t[:, None] * s_t + dd[None, :], mask=mt[:, None] & md[None, :])
    y = tl.trans(x)
    out = dst + h * t_h + (dd * t_d)[:, None] + t[None, :]
    # A mask that varies along the tokens (n_tok is a per-call int of unknown alignment) makes every store a
    # single element: full tiles store without it (16-byte vectors), only the last one masks each token.
    if (tl.program_id(0) + 1) * BLOCK_T <= n_tok:
        tl.store(out, y, mask=md[:, None])
    else:
        tl.store(out, y, mask=md[:, None] & mt[None, :])


# Tokens x dims per program of the transpose (not yet timed against other tiles on the H200:
# bench/probe_repack_copy.py --transpose sweeps them).
_TRANSPOSE_T, _TRANSPOSE_D, _TRANSPOSE_WARPS = 128, 64, 4


def _transpose_launch(
    dst: torch.Tensor, src: torch.Tensor, block_t: int = _TRANSPOSE_T, block_d: int = _TRANSPOSE_D
) -> tuple[tuple[int, int], tuple, dict] | None:
    """(grid, arguments, constants) of ``_tokens_to_dims_kernel`` for a token-major ``src`` ``[T, H, d]`` (last
    dim contiguous) into a dim-major ``dst`` ``[H, d, T]`` (tokens contiguous), tiles of ``block_t`` tokens x at
    most ``block_d`` dims, or None where ``copy_`` does it (nothing to copy, the CPU without the interpreter, more
    head x dim blocks than one grid axis holds)."""
    t, h, d = src.shape
    if t * h * d == 0 or (src.device.type != "cuda" and not interpreting()):
        return None
    bd = min(block_d, _rt.next_pow2(d))
    n_dblk = _rt.cdiv(d, bd)
    if h * n_dblk > 65535:
        return None
    if src.element_size() == 1:  # an e4m3 pointer does not compile before sm_89; the kernel only moves bytes
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    grid = (_rt.cdiv(t, block_t), h * n_dblk)
    args = (src, dst, t, n_dblk, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    return grid, args, {"D": d, "BLOCK_T": block_t, "BLOCK_D": bd}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and _rt._stream_capturing()


# A repeat copy (same V tensor metadata, rows and stream) replays its recorded launch into the kept buffer:
# (buffer, the buffer as the kernel takes it, RecordedLaunch). Cleared when a buffer is evicted.
_REPACK_FAST: dict[tuple, tuple] = {}


def _repack_v(v: torch.Tensor, rows: int) -> torch.Tensor:
    """``v[:, :, :rows]`` (dim-major ``[H_kv, d_v, T]``) in a 16-byte-aligned buffer: a kept one when small."""
    stream = _rt.current_stream_handle(v.device)
    fk = (tensor_key(v), rows, stream)
    hit = _REPACK_FAST.get(fk)
    if hit is not None:
        buf, dst_arg, launch = hit
        if _capturing(v.device):
            _REPACK_CAPTURED[id(buf)] = buf
        launch.launch((v.view(torch.uint8) if v.element_size() == 1 else v, dst_arg))
        return buf
    h, d = v.shape[0], v.shape[1]
    if h * d * _padded_tokens(rows, v.element_size()) * v.element_size() > _REPACK_KEEP_BYTES:
        return v_to_dim_major(v[:, :, :rows].permute(2, 0, 1))
    key = (v.device, stream, v.dtype, h, d, rows)
    buf = _REPACK_BUFFERS.get(key)
    if buf is None:
        if len(_REPACK_BUFFERS) >= _REPACK_SHAPES:
            _REPACK_BUFFERS.pop(next(iter(_REPACK_BUFFERS)))
            _REPACK_FAST.clear()
        buf = _dim_major_empty(h, d, rows, v.dtype, v.device)
        _REPACK_BUFFERS[key] = buf
    if _capturing(v.device):
        _REPACK_CAPTURED[id(buf)] = buf
    src = v[:, :, :rows]
    launch = _copy_launch(buf, src)
    if launch is None:
        buf.copy_(src)
        return buf
    grid, args = launch
    launch_jit(_rows_copy_kernel, grid, args, _COPY_CONSTS)
    rec = RecordedLaunch.record(_rows_copy_kernel, grid, args, _COPY_CONSTS, {}, (args[0], args[1]))
    if rec is not None:
        if len(_REPACK_FAST) >= 4 * _REPACK_SHAPES:
            _REPACK_FAST.clear()
        _REPACK_FAST[fk] = (buf, args[1], rec)
    return buf


def _is_repack_buffer(v: torch.Tensor) -> bool:
    return any(b is v for b in _REPACK_BUFFERS.values())


def _warn_unaligned_v(v: torch.Tensor) -> None:
    if "v" in _WARNED:
        return
    _WARNED.add("v")
    warnings.warn(
        f"mla_context: dim-major v with strides {tuple(v.stride())} cannot be read with tensor descriptors (token "
        f"stride not a multiple of 16 bytes) and is too large to copy (> {_REPACK_MAX_BYTES >> 30} GiB): it runs "
        "the pointer-load kernel, about 3x slower. Build v with v_to_dim_major (16-byte-aligned token stride).",
        RuntimeWarning,
        stacklevel=4,
    )


def _check_capability(sh: _Shapes, device: torch.device) -> None:
    """ValueError before launch for inputs the device cannot run."""
    cap = gpu_capability(device) if device.type == "cuda" else gpu_capability(None)
    if cap.arch is None or cap.bf16:
        return
    if sh.q_dtype == torch.bfloat16 or sh.kv_dtype == FP8:
        raise ValueError(
            f"q/k: {sh.q_dtype} q with {sh.kv_dtype} k/v needs sm_80 or newer, {device} is {cap.name} "
            "(see mla_context_paths)"
        )


class _RunFast(NamedTuple):
    """A checked ``MLAContextPlan.run``'s launch and outputs, replayed by calls with the same tensor metadata."""

    env: tuple  # ``_env()`` when recorded: the replay is stale once a kernel or hook is swapped (tests)
    launch: RecordedLaunch | None  # None: an empty batch, nothing launched
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    want_lse: bool
    v_rows: int | None = None  # a "repack" V: the token rows copied into an aligned buffer first (_repack_v)
    merge: RecordedLaunch | None = None  # key shares: the merge of the plan-owned partials, after ``launch``


_RUNS_PER_PLAN = 64  # distinct (q, k, v, out, ...) layouts replayed per plan; more start the set afresh
_UNSEEN = object()  # a replay key no checked call has had yet


def _arg_key(x: object) -> tuple:
    """A call argument in a replay key: a tensor's metadata (``tensor_key``), else its type and value."""
    return tensor_key(x) if isinstance(x, torch.Tensor) else (type(x), x)


def _env() -> tuple:
    """What a recorded launch assumed besides its arguments: the module's kernels and helpers (tests and the host
    cost probe swap them) and the chosen configs."""
    mg = sys.modules.get("kvforge.kernels.mla_context_gluon")
    return (interpreting, gpu_capability, check_launch_device, native_fp8_cast, _mla_context_fwd_kernel,
            _mla_tile_starts_kernel, _mla_work_items_kernel, _mla_work_table_kernel, MLAContextPlan._launch,
            MLAContextPlan._launch_gluon, _descriptors, _v_path, _WARNED, _DEVICE_TABLE_SLOTS, _KERNEL._chosen,
            _KERNEL.__dict__.get("config_for"), _rt.device_capability, mg and mg._mla_context_gluon_kernel,
            mg and mg.gluon_unavailable_reason, mg and mg.gluon_available)  # fmt: skip


def _replay_run(fast: _RunFast, device, work, q, k, v, out, lse_out, kv_scale_quant_orig, q_scale, partials=()):
    """``MLAContextPlan.run``'s launch, recorded by a checked call with the same tensor metadata and scalars
    (``partials``: the plan's ``_share_tensors``, which a key-share recording's launches read and write)."""
    if out is None:
        out = torch.empty(fast.out_shape, dtype=fast.out_dtype, device=device)
    if lse_out is None and fast.want_lse:
        lse_out = torch.empty(fast.out_shape[:2], dtype=torch.float32, device=device)
    if fast.launch is not None:
        if fast.v_rows is not None:  # the recorded call's copy, into this stream's kept buffer of that shape
            v = _repack_v(v, fast.v_rows)
        scale_t = kv_scale_quant_orig if isinstance(kv_scale_quant_orig, torch.Tensor) else None
        q_scale_t = q_scale if isinstance(q_scale, torch.Tensor) else (scale_t if q_scale is None else None)
        tensors = (q, k, v, out, out if lse_out is None else lse_out, work, scale_t, q_scale_t, *partials)
        fast.launch.launch(tensors)
        if fast.merge is not None:
            fast.merge.launch(tensors)
    return (out, lse_out) if fast.want_lse else out


class _OneCall(NamedTuple):
    """A checked ``mla_context_attention`` call with device lengths, replayed by calls with the same metadata:
    the work-table buffer's size, the table launches (``RecordedLaunch`` over ``(cu_q, cu_kv, starts, flag,
    work)``) and ``run``'s launch; ``kept``: per CUDA stream, the table buffer and its two views, so a replay
    allocates and slices nothing (calls on one stream run in order: a call's table launch writes the buffer after
    the previous call's attention launch has read it)."""

    buf_len: int
    n_work: int  # int32 entries of the table at the buffer's start; the per-request starts follow
    tables: tuple[RecordedLaunch, ...]
    zero_flag: bool  # an empty batch: the flag is cleared on the host side of the stream, nothing launched
    run: _RunFast
    kept: dict[int, tuple[torch.Tensor, ...]]
    shares: tuple[int, int, int, int] | None = None  # key shares on chip: (shares, total_q, H, d_v) of the scratch


def _fresh_table(one: _OneCall, device: torch.device, stream: int | None = None) -> tuple[torch.Tensor, ...] | None:
    """(buffer, work view, starts view, share scratch...) for one replay: None when the buffer is not 16-byte
    aligned as the recording's was (the table launches were specialised on it). ``stream``: the scratch is the
    one this stream's calls of that shape share (``_shared_scratch``); None (a capture): fresh scratch."""
    buf = torch.empty((one.buf_len,), dtype=torch.int32, device=device)
    if buf.data_ptr() % 16 != 0:
        return None
    scratch: tuple[torch.Tensor, ...] = ()
    if one.shares is not None:
        scratch = _share_tensors(*one.shares, device) if stream is None else _shared_scratch(one.shares, device, stream)
    return (buf, buf[: one.n_work].view(-1, 4), buf[one.n_work :], *scratch)


# Share scratch of one-call replays, per (stream, device, shares, rows, heads, d_v): the calls of an engine step
# (one per layer, each its own recording) share one set instead of each keeping its own. Calls on one stream run
# in order, so they never use it at once; a recording that kept a set keeps it alive past eviction.
_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}
_SCRATCH_SETS = 8


def _shared_scratch(shares: tuple[int, int, int, int], device: torch.device, stream: int) -> tuple[torch.Tensor, ...]:
    key = (stream, str(device), *shares)
    got = _SCRATCH.get(key)
    if got is None:
        if len(_SCRATCH) >= _SCRATCH_SETS:
            _SCRATCH.clear()
        got = _SCRATCH.setdefault(key, _share_tensors(*shares, device))
    return got


_KEPT_STREAMS = 8  # streams a one-call recording keeps a table buffer for; more start the set afresh


def _kept_table(one: _OneCall, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(buffer, work view, starts view) of ``one``'s table for the current stream, made on first use; None while
    a CUDA graph is being captured (a buffer from the graph's pool is not kept past it) or when the fresh buffer
    is not 16-byte aligned as the recording's was."""
    if _capturing(device):
        return None
    # The table launch's own stream query (Triton's driver: an int, no torch Stream object), as _counters in
    # mla_decode does.
    f = one.tables[0].fast if one.tables and device.type == "cuda" else None
    stream = f[4](f[2]) if f is not None else _rt.current_stream_handle(device)
    kept = one.kept.get(stream)
    if kept is None:
        fresh = _fresh_table(one, device, stream)
        if fresh is None:
            return None
        if len(one.kept) >= _KEPT_STREAMS:
            one.kept.clear()
        kept = one.kept.setdefault(stream, fresh)
    return kept


def _share_tensors(splits: int, total_q: int, heads: int, dv: int, device) -> tuple[torch.Tensor, ...]:
    """A share plan's scratch: fp32 partial outputs ``[splits x total_q, H, dv]`` and lse ``[splits x total_q,
    H]``, the merged lse's sink ``[total_q, H]``, and the merge's ``[splits, total_q, ...]`` views of the two."""
    rows = splits * total_q
    part_o = torch.empty((rows, heads, dv), dtype=torch.float32, device=device)
    part_lse = torch.empty((rows, heads), dtype=torch.float32, device=device)
    sink = torch.empty((total_q, heads), dtype=torch.float32, device=device)
    return part_o, part_lse, sink, part_o.view(splits, total_q, heads, dv), part_lse.view(splits, total_q, heads)


def _share_items(items: list[tuple[int, ...]], splits: int, bn: int, align: int, total_q: int) -> list[tuple[int, ...]]:
    """``splits`` key shares of every (cost, q_row0, n_rows, kv_row0, diag0) item, as (keys swept, q_row0, n_rows,
    kv_row0', diag0', output row, key cap, 0, 0). The item's ``blocks`` key blocks (block positions: keys plus
    dim-major V's ``shift``) go ``per = ceil(blocks / splits)`` to a share; share c writes partial rows from
    ``c * total_q + q_row0``. Share 0 is the item with its keys capped at the end of its blocks; a later share is
    rebased to its first block (``kv_row0'`` that block's first token, aligned, so no head block; ``diag0'``
    shifted by as many keys), its cap the length of its blocks. The last share has no cap; shares past an item
    shorter than ``splits`` blocks sweep nothing (cap 0)."""
    out: list[tuple[int, ...]] = []
    for _cost, q0, n, k0, d0 in items:
        shift = k0 % align
        blocks = -(-(d0 + n + shift) // bn)
        per = max(1, -(-blocks // splits))
        for c in range(splits):
            b0, b1 = min(c * per, blocks), min((c + 1) * per, blocks)
            last = c == splits - 1
            if c == 0:
                k, d, cap = k0, d0, (1 << 30) if last else b1 * bn - shift
            else:
                base = b0 * bn - shift  # keys before the share's first block
                k, d = k0 + base, d0 - base
                cap = (1 << 30) if last else (b1 - b0) * bn
            out.append(((b1 - b0) * bn, q0, n, k, d, c * total_q + q0, cap, 0, 0))
    return out


_CALLS = PlanCache(maxsize=256)  # an engine step calls once per layer, each with its own q/k/v buffers


class MLAContextPlan:
    """Work partition of one batch, computed once and reused by every layer of a step.

    ``MLAContextPlan.plan(cu_seqlens_q, cu_seqlens_kv, num_heads=..., ...)`` validates the lengths (one host read
    of the two ``cu_seqlens``), picks the launch configuration for this GPU and uploads a table of
    (request, query-tile) items ordered heaviest first. ``run(q, k, v, out=..., lse_out=...)`` checks shapes,
    dtypes and devices (host metadata only: no device sync, no allocation when the buffers are given) and
    launches once, so it can be captured in a CUDA graph. A plan with key shares (``kv_splits > 1``) launches
    twice (the shares, then their merge) through fp32 partials it owns: its runs on different streams must not
    overlap, and a graph that captured a run needs the plan kept alive (as it needs its work table).
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
        cu_seqlens_q: list[int] | None = None,
        cu_seqlens_kv: list[int] | None = None,
        kv_splits: int = 1,
        chip_shares: bool = False,
    ) -> None:
        self.shapes = shapes
        self.device = device
        self.config = config
        self.work = work
        self.n_items = n_items
        self.total_q = total_q
        self.total_kv = total_kv
        # Host copies of the lengths; None when the table was built on the device (nothing read back).
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_kv = cu_seqlens_kv
        self._runs: dict[tuple, _RunFast | None] = {}  # checked calls' launches (None: seen once), for ``run``
        # Key shares per item (``context_kv_splits``); with more than one, ``work`` has 8-int share items and the
        # shares' fp32 partials (output, lse) and the merged lse's sink live as long as the plan (graph-safe).
        # ``chip_shares``: a device-built table's 4-int items, split into the shares on chip (``_chip_share``).
        check_int("kv_splits", kv_splits, 1, KV_SPLIT_MAX)
        width = 8 if kv_splits > 1 and not chip_shares else 4
        if work.dim() != 2 or work.shape[1] != width:
            raise ValueError(f"work: expected {width}-int items for kv_splits={kv_splits}, got "
                             f"shape {tuple(work.shape)}")  # fmt: skip
        self.kv_splits = kv_splits
        self.chip_shares = bool(chip_shares) and kv_splits > 1
        # The partials, the sink, and the merge's [S, T, ...] views of the partials (``_share_tensors``; none
        # without shares): fixed objects, so that a recorded run's launches name them as slots of the replay's
        # tensor tuple.
        self._share_tensors: tuple[torch.Tensor, ...] = ()
        if kv_splits > 1:
            self._share_tensors = _share_tensors(kv_splits, total_q, shapes.num_heads, shapes.head_dim_v, device)

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
        kv_splits: int | None = None,
    ) -> MLAContextPlan:
        """Validate one batch's lengths and build its work table (heaviest (request, q-tile) first).

        ``device`` defaults to that of ``cu_seqlens_q``; ``config`` overrides the per-SM table (tests, sweeps).
        ``kv_splits``: key shares per item (None: ``context_kv_splits`` decides, one program resident per SM for
        the Gluon kernel, ``KV_SPLIT_RESIDENT_PORTABLE`` for the portable one; more than 1 merges the shares' fp32
        partials, so the output may differ from the one-share plan's by rounding; 1: never split).
        """
        dev = torch.device(device) if device is not None else _tensor_device("cu_seqlens_q", cu_seqlens_q)
        if dev.type == "meta":
            raise ValueError("device: expected a CUDA device (or the CPU under the interpreter), got meta")
        shapes = _check_shapes(num_heads, num_kv_heads, head_dim_qk, head_dim_v, q_dtype, kv_dtype, v_layout)
        _check_capability(shapes, dev)
        max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_kv = _check_max_seqlen("max_seqlen_kv", max_seqlen_kv)
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
        if kv_splits is not None:
            check_int("kv_splits", kv_splits, 1, KV_SPLIT_MAX)
        if config is None:
            config = _choose_config(shapes, dev, bool(q_lens) and 0 < max(q_lens) <= SHORT_Q_ROWS)
        bm = int(config.kwargs["BLOCK_M"])
        items: list[tuple[int, int, int, int, int]] = []  # (cost, q_row0, n_rows, kv_row0, diag0)
        for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            prefix = kl - ql
            for m0 in range(0, ql, bm):
                n_rows = min(bm, ql - m0)
                items.append((prefix + m0 + n_rows, cu_q[r] + m0, n_rows, cu_kv[r], prefix + m0))
        bn = int(config.kwargs["BLOCK_N"])
        align = _kv_align(shapes)
        per_split = _share_bytes(shapes, cu_q[-1])
        if kv_splits is None:
            longest = max((-(-(it[0] + it[3] % align) // bn) for it in items), default=0)
            kv_splits = _auto_kv_splits(shapes, dev, config, len(items), cu_q[-1], longest)
        elif kv_splits > 1 and kv_splits * per_split > KV_SPLIT_SCRATCH_BYTES:
            raise ValueError(f"kv_splits: {kv_splits} shares of {cu_q[-1]} rows x {num_heads} heads need more fp32 "
                             f"partials than KV_SPLIT_SCRATCH_BYTES ({KV_SPLIT_SCRATCH_BYTES} bytes)")  # fmt: skip
        if kv_splits > 1:
            items = _share_items(items, kv_splits, bn, align, cu_q[-1])
        # Heaviest first (cost = keys swept); the stable sort keeps request order among equals.
        items.sort(key=lambda it: -it[0])
        width = 8 if kv_splits > 1 else 4
        table = torch.tensor([it[1:] for it in items] or [[0] * width], dtype=torch.int32)
        # Pageable memory is staged before the copy call returns, so the host need not wait for the device's queue.
        work = table.to(dev, non_blocking=True)
        return cls(shapes, dev, config, work, len(items), cu_q[-1], cu_kv[-1], cu_q, cu_kv, kv_splits)

    @classmethod
    def _plan_on_device(
        cls,
        shapes: _Shapes,
        cu_q: torch.Tensor,
        cu_kv: torch.Tensor,
        max_seqlen_q: int | None,
        max_seqlen_kv: int | None,
        total_q: int,
        kv_rows: int,
        config: triton.Config | None = None,
        error_flag: torch.Tensor | None = None,
        record: list | None = None,
    ) -> MLAContextPlan:
        """The plan with its table built on the device (``_mla_work_table_kernel``, or for a table past one sorting
        program ``_mla_tile_starts_kernel`` + ``_mla_work_items_kernel``):
        no host read. The table has a slot for every item a valid batch can have, a bound known from shapes alone
        (``total_q`` rows split at ``n_req`` request boundaries, and ``n_req`` times the tiles of ``max_seqlen_q``
        when given); missing ``max_seqlen_*`` default to ``total_q`` / ``kv_rows``, which no valid request
        exceeds. The short-query key (``SHORT_Q_ROWS``) is chosen from ``max_seqlen_q``, or without it from the
        mean query length. ``record``: a list that gets each launch's ``(kernel, grid, args, consts, options)``."""
        dev = cu_q.device
        n_req = cu_q.numel() - 1
        if config is None:
            config = _device_config(shapes, dev, n_req, total_q, max_seqlen_q)
        bm = int(config.kwargs["BLOCK_M"])
        max_q = total_q if max_seqlen_q is None else max_seqlen_q
        max_kv = kv_rows if max_seqlen_kv is None else max_seqlen_kv
        n_slots = _device_slots(n_req, total_q, max_q, bm)
        # One allocation: the table's rows, then the per-request first items (and the item count).
        buf = torch.empty((max(n_slots, 1) * 4 + n_req + 1,), dtype=torch.int32, device=dev)
        work, starts = buf[: max(n_slots, 1) * 4].view(-1, 4), buf[max(n_slots, 1) * 4 :]
        flag = error_flag if error_flag is not None else buf
        launches = []
        starts_consts = {"BLOCK_M": bm, "R_BLOCK": 256, "SET_FLAG": error_flag is not None}
        sort = 0 < n_slots <= _DEVICE_TABLE_SLOTS
        n_pad = 1024
        if sort:  # powers of 4: at most six compiled variants of the sorting program
            n_pad = 16
            while n_pad < n_slots:
                n_pad *= 4
        options = {"num_warps": 4 if n_pad <= 1024 else 16}
        table_ints = (n_req, n_slots, n_req.bit_length(), total_q, kv_rows, max_q, max_kv)
        if n_req > 0 and sort:  # both passes in one program
            launches.append((_mla_work_table_kernel, (1,), (cu_q, cu_kv, starts, flag, work, *table_ints),
                             {**starts_consts, "N_PAD": n_pad}, options))  # fmt: skip
        elif n_req > 0:
            launches.append((_mla_tile_starts_kernel, (1,), (cu_q, cu_kv, starts, flag, n_req, total_q, kv_rows,
                             max_q, max_kv), starts_consts, {"num_warps": 4}))  # fmt: skip
            if n_slots > 0:
                launches.append((_mla_work_items_kernel, (_rt.cdiv(n_slots, n_pad),),
                                 (cu_q, cu_kv, starts, work, *table_ints),
                                 {"BLOCK_M": bm, "N_PAD": n_pad, "SORT": False}, options))  # fmt: skip
        elif error_flag is not None:
            error_flag.zero_()
        for fn, grid, args, consts, options in launches:
            launch_jit(fn, grid, args, consts, **options)
        if record is not None:
            record += launches
        splits = _device_kv_splits(shapes, dev, config, n_slots, total_q, min(max_kv, kv_rows))
        return cls(shapes, dev, config, work, n_slots, total_q, 0, kv_splits=splits, chip_shares=splits > 1)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv_scale_quant_orig: float | torch.Tensor = 1.0,
        q_scale: float | torch.Tensor | None = None,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch. Returns ``out`` (and the fp32 natural-log LSE if asked).

        ``q_scale``: dequantisation scale of an FP8 q (float or 1-element fp32 device tensor); None: q shares
        ``kv_scale_quant_orig``. A dim-major V whose token stride tensor descriptors cannot read (not a multiple
        of 16 bytes) is copied into an aligned buffer first where ``_v_path`` says that is cheap.

        From the third call with the same tensors (address, shape, strides, dtype, device) and scalars on, a call
        replays the launch the second one recorded: the checks, which read only that metadata, passed then (the
        first call only notes the key, so a plan run once per layer on new buffers pays nothing for recording)."""
        try:
            key = (tensor_key(q), tensor_key(k), tensor_key(v), _arg_key(out), _arg_key(lse_out),
                   _arg_key(kv_scale_quant_orig), _arg_key(q_scale), _arg_key(softmax_scale),
                   _arg_key(return_lse))  # fmt: skip
            fast = self._runs.get(key, _UNSEEN)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable: the checked path says which
            key, fast = None, None
        if isinstance(fast, _RunFast) and fast.env == _env():
            return self._replay(fast, q, k, v, out, lse_out, kv_scale_quant_orig, q_scale)
        if fast is _UNSEEN:
            res = self._run_checked(q, k, v, kv_scale_quant_orig, q_scale, softmax_scale, out, lse_out, return_lse,
                                    None)  # fmt: skip
            self._note(key, None)
            return res
        return self._run_checked(q, k, v, kv_scale_quant_orig, q_scale, softmax_scale, out, lse_out, return_lse, key)

    def _note(self, key: tuple, fast: _RunFast | None) -> None:
        if len(self._runs) >= _RUNS_PER_PLAN:
            self._runs.clear()
        self._runs[key] = fast

    def _replay(self, fast: _RunFast, q, k, v, out, lse_out, kv_scale_quant_orig, q_scale):
        return _replay_run(fast, self.device, self.work, q, k, v, out, lse_out, kv_scale_quant_orig, q_scale,
                           self._share_tensors)  # fmt: skip

    def _run_checked(self, q, k, v, kv_scale_quant_orig, q_scale, softmax_scale, out, lse_out, return_lse, key):
        """``run`` with every check; records the launch for replay under ``key`` (None: not recorded)."""
        sh = self.shapes
        _check_inputs(q, k, v, sh, self.device, self.total_q, self.total_kv)
        scale_val, scale_ptr = _check_kv_scale(kv_scale_quant_orig, sh, self.device)
        if q_scale is None:
            q_scale_val, q_scale_ptr = scale_val, scale_ptr
        elif sh.q_dtype != FP8:
            raise ValueError(f"q_scale: dequantises an FP8 q; q is {sh.q_dtype}, leave q_scale None")
        else:
            q_scale_val, q_scale_ptr = _check_kv_scale(q_scale, sh, self.device, name="q_scale")
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(sh.head_dim_qk)
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale}")
        out_dtype = torch.float16 if sh.q_dtype == torch.float16 else torch.bfloat16
        out_given = out is not None
        if out is None:
            out = torch.empty((self.total_q, sh.num_heads, sh.head_dim_v), dtype=out_dtype, device=self.device)
        else:
            check_tensor("out", out, dtype=(torch.bfloat16, torch.float16), device=self.device, ndim=3)
            check_launch_device("out", out)
            _check_shape_exact("out", out, (self.total_q, sh.num_heads, sh.head_dim_v))
            if out.stride(-1) != 1:
                raise ValueError(f"out: expected the last dimension contiguous (stride 1), got strides {out.stride()}")
        want_lse = return_lse or lse_out is not None
        if lse_out is not None:
            check_tensor("lse_out", lse_out, dtype=torch.float32, device=self.device, ndim=2)
            check_launch_device("lse_out", lse_out)
            _check_shape_exact("lse_out", lse_out, (self.total_q, sh.num_heads))
        if out_given or lse_out is not None:
            # Host metadata only (byte ranges): an output over an input or another output would race.
            check_no_overlap({"out": out if out_given else None, "lse_out": lse_out}, {"q": q, "k": k, "v": v})
        if lse_out is None and want_lse:
            lse_out = torch.empty((self.total_q, sh.num_heads), dtype=torch.float32, device=self.device)
        recorded: list | None = [] if key is not None and type(self)._launch is _LAUNCH else None
        env = _env() if recorded is not None else None
        launch = merge = None
        v_rows = None
        if self.n_items > 0:
            v_in = v
            v = self._v_for_launch(v)
            if v is not v_in:  # a copy of V: replayed only when it went into a reused buffer
                v_rows = v.shape[2] if _is_repack_buffer(v) else None
                if v_rows is None:
                    recorded = None
            args = (q, k, v, out, lse_out, float(softmax_scale), scale_val, scale_ptr, q_scale_val, q_scale_ptr)
            if recorded is None:
                self._launch(*args)
            else:
                self._launch(*args, record=recorded)
                # One launch, or with key shares the share kernel's and the merge's (the merge reads the
                # partials and writes ``out`` and ``lse_out`` or the plan's sink, all tensors of the tuple).
                if len(recorded) == (2 if self.kv_splits > 1 else 1):
                    tensors = (q, k, v, out, out if lse_out is None else lse_out, self.work, scale_ptr, q_scale_ptr,
                               *self._share_tensors)  # fmt: skip
                    launch = RecordedLaunch.record(*recorded[0], tensors)
                    if launch is not None and len(recorded) == 2:
                        merge = RecordedLaunch.record(*recorded[1], tensors)
                        launch = None if merge is None else launch
                if launch is None:
                    recorded = None
        if recorded is not None:
            self._note(key, _RunFast(env, launch, out.shape, out.dtype, want_lse, v_rows, merge))
        if want_lse:
            return out, lse_out
        return out

    def _v_for_launch(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` itself, or for ``_v_path`` = "repack" an aligned copy of the token rows the batch reads (all of
        ``v``'s rows when the lengths never reached the host); "pointer" warns once."""
        if self.shapes.v_layout != "dim_major":
            return v
        cap = gpu_capability(self.device) if self.device.type == "cuda" else gpu_capability(None)
        rows = self.total_kv if self.cu_seqlens_kv is not None else v.shape[2]
        path = _v_path(v, self.shapes, cap.tma and not interpreting(), rows)
        if path == "repack":
            return _repack_v(v, rows)
        if path == "pointer":
            _warn_unaligned_v(v)
        return v

    def _launch(self, q, k, v, out, lse, softmax_scale, scale_val, scale_ptr, q_scale_val=None, q_scale_ptr=None,
                record=None):  # fmt: skip
        """One launch; returns Triton's compiled-kernel handle (registers, spills, shared memory for reports).
        ``record``: a list that gets the launch's ``(kernel, grid, args, consts, options)``."""
        if q_scale_val is None and q_scale_ptr is None:
            q_scale_val, q_scale_ptr = scale_val, scale_ptr
        if self.kv_splits > 1:  # key shares: the kernel writes fp32 partials, then one merge launch
            part_o, part_lse, sink, o_s, lse_s = self._share_tensors
            sub: list | None = [] if record is not None else None
            handle = self._launch_kernel(q, k, v, part_o, part_lse, softmax_scale, scale_val, scale_ptr, q_scale_val,
                                         q_scale_ptr, sub)  # fmt: skip
            from kvforge.kernels.merge_states import _merge_launch_args

            merge = _merge_launch_args(o_s, lse_s, out, lse if lse is not None else sink)
            launch_jit(*merge[:4], **merge[4])
            if record is not None and sub:  # both or neither: a replay of the share kernel alone skips the merge
                record.extend((sub[0], merge))
            return handle
        return self._launch_kernel(q, k, v, out, lse, softmax_scale, scale_val, scale_ptr, q_scale_val, q_scale_ptr,
                                   record)  # fmt: skip

    def _launch_kernel(self, q, k, v, out, lse, softmax_scale, scale_val, scale_ptr, q_scale_val, q_scale_ptr,
                       record):  # fmt: skip
        sh = self.shapes
        d_a, d_b = _split_head_dim(sh.head_dim_qk)
        if sh.v_layout == "dim_major":
            svt, svh, svd = v.stride(2), v.stride(0), v.stride(1)
        else:
            svt, svh, svd = v.stride(0), v.stride(1), 1
        lse_t = lse if lse is not None else out  # any pointer: WRITE_LSE=False never touches it
        slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        cap = gpu_capability(self.device) if self.device.type == "cuda" else gpu_capability(None)
        kw = dict(self.config.kwargs)
        q_fp8, kv_fp8 = sh.q_dtype == FP8, sh.kv_dtype == FP8
        # An e4m3 x e4m3 tl.dot needs K >= 32 on the GPU (Hopper's FP8 MMA): a head-dim part under 32 (the tiny
        # model's 32 + 16) takes the byte path, which widens FP8 to 16 bits on chip (any part >= 16).
        narrow = min(d_a, d_b or d_a) < 32
        fp8_bytes = kv_fp8 and (bool(kw.pop("FP8_BYTES", 0)) or not cap.fp8_mma or narrow)
        if kw.pop("GLUON", 0):
            gl_launch = self._launch_gluon(
                q, k, v, out, lse, softmax_scale, scale_val, scale_ptr, q_scale_val, q_scale_ptr, kw, fp8_bytes
            )
            if gl_launch is not None:
                if record is not None:
                    record.append(gl_launch)
                fn, grid, args, consts, options = gl_launch
                return launch_jit(fn, grid, args, consts, **options)
        if self.config.kwargs.get("GLUON", 0):
            # The Gluon path cannot run here (no Gluon, not sm_90, a 16-bit Q, a layout TMA cannot read): the
            # portable kernel with the same tiles (and share items), a 16-bit Q quantised on chip and token-major V
            # widened.
            kw.pop("GLUON_PP", None)
            kw.pop("GLUON_KP", None)
            kw.setdefault("Q_QUANT", 1)
            kw.setdefault("V_WIDEN", 1)
        q_quant = bool(kw.pop("Q_QUANT", 0)) and kv_fp8 and not q_fp8 and not fp8_bytes
        v_widen = bool(kw.pop("V_WIDEN", 0)) and kv_fp8 and not fp8_bytes
        if fp8_bytes:  # no FP8 types reach the kernel: FP8 tensors as their bytes
            k, v = k.view(torch.uint8), v.view(torch.uint8)
            if q_fp8:
                q = q.view(torch.uint8)
        use_tma = bool(kw.get("USE_TMA")) and cap.tma
        descs = _descriptors(q, k, v, sh, kw["BLOCK_M"], kw["BLOCK_N"], d_a, d_b) if use_tma else None
        kw["USE_TMA"] = descs is not None
        kw.setdefault("PIPE_QK", 0)
        kw.setdefault("HEADS_OUTER", 0)
        if descs is None:
            descs = (q, q, k, k, v)  # placeholders: the pointer path never reads them
        if fp8_bytes:
            qk_mode, pv_mode = _QK_BYTES, _PV_BYTES
        else:
            qk_mode = _QK_FP8 if (q_fp8 or q_quant) else _QK_16
            pv_mode = (_PV_WIDEN if v_widen else _PV_FP8) if kv_fp8 else _PV_16
        meta = dict(
            H=sh.num_heads,
            GROUP=sh.num_heads // sh.num_kv_heads,
            D_A=d_a,
            D_B=d_b,
            DV=sh.head_dim_v,
            Q_FP8=q_fp8,
            KV_FP8=kv_fp8,
            QK_MODE=qk_mode,
            PV_MODE=pv_mode,
            Q_QUANT=q_quant,
            V_DIM_MAJOR=sh.v_layout == "dim_major",
            SCALE_FROM_PTR=scale_ptr is not None,
            Q_SCALE_FROM_PTR=q_scale_ptr is not None,
            WRITE_LSE=lse is not None,
            UPCAST=interpreting() and sh.q_dtype in (torch.bfloat16, torch.float16),
            NATIVE_FP8=native_fp8_cast(),
            P_OFFSET=_FP8_P_OFFSET if kv_fp8 else 0.0,
            KV_ALIGN=_kv_align(sh),
            SPLIT_KV=self.kv_splits > 1,
            CHIP_SHARES=self.chip_shares,
            **kw,
        )
        grid = (self.n_items * sh.num_heads * (self.kv_splits if self.chip_shares else 1),)
        args = (q, k, v, out, lse_t, *descs, self.work, self.n_items, self.total_q if self.chip_shares else 0,
                scale_ptr if scale_ptr is not None else self.work, softmax_scale, scale_val,
                q_scale_ptr if q_scale_ptr is not None else self.work, q_scale_val,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), svt, svh, svd,
                out.stride(0), out.stride(1), slt, slh)  # fmt: skip
        options = {"num_warps": self.config.num_warps, "num_stages": self.config.num_stages}
        if record is not None:
            record.append((_mla_context_fwd_kernel, grid, args, meta, options))
        return launch_jit(_mla_context_fwd_kernel, grid, args, meta, **options)

    def _launch_gluon(self, q, k, v, out, lse, softmax_scale, scale_val, scale_ptr, q_scale_val, q_scale_ptr, kw,
                      fp8_bytes):  # fmt: skip
        """The warp-specialised sm_90 kernel's launch (``mla_context_gluon.gluon_launch_args``), or None when it
        cannot run here."""
        from kvforge.kernels import mla_context_gluon as mg

        sh = self.shapes
        dim_major = sh.v_layout == "dim_major"
        v_widen = bool(kw.get("V_WIDEN", 0)) and sh.kv_dtype == FP8
        if fp8_bytes or kw["BLOCK_M"] != mg.BLOCK_M or not mg.gluon_available(self.device):
            return None
        if not mg.gluon_supports(sh.q_dtype, sh.kv_dtype, dim_major, v_widen):
            return None
        d_a, d_b = _split_head_dim(sh.head_dim_qk)
        if not _tma_layouts_ok(q, k, v, sh):
            return None
        return mg.gluon_launch_args(
            q, k, v, out, lse, self.work, self.n_items, num_heads=sh.num_heads,
            group=sh.num_heads // sh.num_kv_heads, d_a=d_a, d_b=d_b, dv=sh.head_dim_v,
            dim_major=dim_major, softmax_scale=softmax_scale, scale_val=scale_val,
            scale_ptr=scale_ptr, q_scale_val=q_scale_val, q_scale_ptr=q_scale_ptr,
            block_n=kw["BLOCK_N"], num_stages=self.config.num_stages,
            heads_outer=bool(kw.get("HEADS_OUTER", 0)), pingpong=bool(kw.get("GLUON_PP", 0)),
            key_perm=bool(kw.get("GLUON_KP", 0)), v_widen=v_widen, split_kv=self.kv_splits > 1,
            chip_shares=self.kv_splits if self.chip_shares else 0, share_rows=self.total_q if self.chip_shares else 0,
        )  # fmt: skip


def _device_config(sh: _Shapes, dev: torch.device, n_req: int, total_q: int, max_seqlen_q: int | None):
    """A device-built table's config: the short-query key from ``max_seqlen_q``, or without it the mean length."""
    if max_seqlen_q is not None:
        short = 0 < max_seqlen_q <= SHORT_Q_ROWS
    else:
        short = 0 < total_q <= SHORT_Q_ROWS * max(n_req, 1)
    return _choose_config(sh, dev, short)


def _device_slots(n_req: int, total_q: int, max_q: int, bm: int) -> int:
    """Items a valid batch can have, from shapes alone: ``total_q`` rows split at ``n_req`` request boundaries,
    and ``n_req`` times the tiles of ``max_q`` rows."""
    return min(n_req * -(-min(max_q, total_q) // bm), (total_q + n_req * (bm - 1)) // bm) if n_req else 0


def _kv_align(sh: _Shapes) -> int:
    """Keys a dim-major V's blocks may start before the request (the kernel's ``shift`` < KV_ALIGN); 1 else."""
    return max(1, 16 // sh.kv_dtype.itemsize) if sh.v_layout == "dim_major" else 1


def _share_bytes(sh: _Shapes, total_q: int) -> int:
    """One key share's fp32 scratch: partial output and lse rows for every query row and head."""
    return total_q * sh.num_heads * (sh.head_dim_v + 1) * 4


def _auto_kv_splits(sh: _Shapes, dev: torch.device, config, n_items: int, total_q: int, longest: int) -> int:
    """``context_kv_splits`` for ``n_items`` items whose longest spans ``longest`` key blocks, on ``dev``'s SMs
    with the config's kernel resident once per SM (Gluon) or ``KV_SPLIT_RESIDENT_PORTABLE`` times."""
    sms = num_sms(dev) if dev.type == "cuda" else 132
    resident = 1 if config.kwargs.get("GLUON", 0) else KV_SPLIT_RESIDENT_PORTABLE
    return context_kv_splits(n_items, sh.num_heads, longest, sms, _share_bytes(sh, total_q), resident)


def _device_kv_splits(sh: _Shapes, dev: torch.device, config, n_slots: int, total_q: int, max_kv: int) -> int:
    """``context_kv_splits`` for a device-built table, from bounds alone: ``n_slots`` items, each of at most
    ``max_kv`` keys (``max_seqlen_kv``, else all the key rows). An item shorter than the bound leaves some of its
    shares empty (each a program's fixed cost)."""
    blocks = -(-(max_kv + _kv_align(sh) - 1) // int(config.kwargs["BLOCK_N"]))
    return _auto_kv_splits(sh, dev, config, n_slots, total_q, blocks)


# Table slots one sorting program of ``_mla_work_items_kernel`` orders (heaviest first); larger tables (over 2M
# query rows in 128-row tiles) are built by many programs, each request's last tile first.
_DEVICE_TABLE_SLOTS = 16384


def _choose_config(sh: _Shapes, device: torch.device, short_q: bool) -> triton.Config:
    """The per-GPU config for a key; an untuned key on a GPU times its first candidates once (``_tune_runner``)."""
    key = _config_key(sh, short_q)
    run = _tune_runner(sh, device, short_q) if device.type == "cuda" and not interpreting() else None
    return _KERNEL.config_for(key, run)


def _tune_runner(sh: _Shapes, device: torch.device, short_q: bool):
    """A ``run(config)`` for ``TunedKernel`` tuning: one representative batch of this key's class (16 requests
    of 64 rows over 4k cached keys for short queries, else 2 requests of 2k rows over 2k), random data, built on
    first use. Lengths only pick the tile class; the key holds no lengths."""
    state: dict[str, object] = {}

    def run(cfg: triton.Config) -> None:
        if not state:
            q_lens, cached = ([64] * 16, [4096] * 16) if short_q else ([2048] * 2, [2048] * 2)
            cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
            cu_kv = torch.tensor([0, *itertools.accumulate(a + b for a, b in zip(q_lens, cached))], dtype=torch.int32)
            g = torch.Generator(device=device).manual_seed(0)

            def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
                x = torch.randn(*shape, generator=g, device=device)
                return x.clamp(-448, 448).to(dtype)

            tq, tkv = int(cu_q[-1]), int(cu_kv[-1])
            q = rand(tq, sh.num_heads, sh.head_dim_qk, dtype=sh.q_dtype)
            k = rand(tkv, sh.num_kv_heads, sh.head_dim_qk, dtype=sh.kv_dtype)
            v = rand(tkv, sh.num_kv_heads, sh.head_dim_v, dtype=sh.kv_dtype)
            if sh.v_layout == "dim_major":
                v = v_to_dim_major(v)
            state.update(q=q, k=k, v=v, cu_q=cu_q.to(device), cu_kv=cu_kv.to(device))
        plan = MLAContextPlan.plan(
            state["cu_q"], state["cu_kv"], num_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads,
            head_dim_qk=sh.head_dim_qk, head_dim_v=sh.head_dim_v, q_dtype=sh.q_dtype, kv_dtype=sh.kv_dtype,
            v_layout=sh.v_layout, device=device, config=cfg, kv_splits=1,  # the config's own kernel, no merge
        )  # fmt: skip
        plan.run(state["q"], state["k"], state["v"])

    return run


def _tma_layouts_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sh: _Shapes) -> bool:
    """Whether ``_descriptors`` can build its descriptors (heads packed, 16-byte alignment, rows present), read
    from the metadata without building them."""
    if q.stride(1) != sh.head_dim_qk or k.stride(1) != sh.head_dim_qk:
        return False
    es_q, es_kv = q.element_size(), k.element_size()
    if any(t.data_ptr() % 16 for t in (q, k, v)) or (q.stride(0) * es_q) % 16 or (k.stride(0) * es_kv) % 16:
        return False
    if min(q.shape[0], k.shape[0]) == 0:
        return False
    if sh.v_layout == "dim_major":
        return v.stride(0) == sh.head_dim_v * v.stride(1) and (v.stride(1) * es_kv) % 16 == 0
    return v.stride(1) == sh.head_dim_v and (v.stride(0) * es_kv) % 16 == 0


def _descriptors(q, k, v, sh: _Shapes, bm: int, bn: int, d_a: int, d_b: int) -> tuple | None:
    """2-D tensor descriptors (tokens x (heads * dim)) for the TMA path, or None when a layout does not allow
    one (heads not packed, 16-byte alignment); the kernel then takes the pointer path."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton without host-side descriptors
        return None
    if not _tma_layouts_ok(q, k, v, sh):
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
        descs.append(
            TensorDescriptor(v, [sh.num_kv_heads * sh.head_dim_v, v.shape[2]], [v.stride(1), 1], [sh.head_dim_v, bn])
        )
    else:
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_launch_device(name, t)


def _check_kv_scale(
    s: object, sh: _Shapes, device: torch.device, name: str = "kv_scale_quant_orig"
) -> tuple[float, torch.Tensor | None]:
    """A Python float (checked here) or a 1-element fp32 tensor on the device (read by the kernel: no sync)."""
    if isinstance(s, torch.Tensor):
        check_tensor(name, s, dtype=torch.float32, device=device)
        check_launch_device(name, s)
        if s.numel() != 1:
            raise ValueError(f"{name}: expected a 1-element tensor, got shape {tuple(s.shape)}")
        return 1.0, s
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"{name}: expected a float or a 1-element tensor, got {type(s).__name__}")
    s = float(s)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{name}: expected a positive finite float, got {s}")
    if sh.kv_dtype != FP8 and s != 1.0:
        raise ValueError(f"{name}: dequantises FP8 k/v; with {sh.kv_dtype} k/v it must be 1.0, got {s}")
    return s, None


def _check_error_flag(flag: object, device: torch.device) -> torch.Tensor | None:
    if flag is None:
        return None
    check_tensor("error_flag", flag, dtype=torch.int32, device=device)
    assert isinstance(flag, torch.Tensor)
    check_launch_device("error_flag", flag)
    if flag.numel() != 1:
        raise ValueError(f"error_flag: expected a 1-element int32 tensor, got shape {tuple(flag.shape)}")
    return flag


def _op_quantise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_layout: str, kv_scale_orig_quant: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor]:
    """16-bit q/k/v -> e4m3(x * kv_scale_orig_quant) copies on the device (``quantize_fp8``; V written dim-major
    with a 16-byte-aligned token stride, the FP8 layout the kernel reads fastest) and the dequantisation scale
    ``1 / kv_scale_orig_quant`` (a device tensor stays one: no host read)."""
    from kvforge.kernels.quantize_fp8 import quantize_fp8

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(
                f"{name}: kv_scale_orig_quant quantises 16-bit inputs on chip; expected bf16/fp16, got {t.dtype} "
                "(pass caller-quantised FP8 with kv_scale_quant_orig instead)"
            )
    s = kv_scale_orig_quant
    if isinstance(s, torch.Tensor):
        check_tensor("kv_scale_orig_quant", s, dtype=torch.float32, device=q.device)
        check_launch_device("kv_scale_orig_quant", s)
        if s.numel() != 1:
            raise ValueError(f"kv_scale_orig_quant: expected a 1-element tensor, got shape {tuple(s.shape)}")
        deq: float | torch.Tensor = torch.reciprocal(s.reshape(1))
    elif isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"kv_scale_orig_quant: expected a float or a 1-element tensor, got {type(s).__name__}")
    else:
        s = float(s)
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"kv_scale_orig_quant: expected a positive finite float, got {s}")
        deq = 1.0 / s
    q8 = quantize_fp8(q, s)
    k8 = quantize_fp8(k, s)
    if v_layout == "dim_major":  # tokens contiguous already: quantise row by row into an aligned buffer
        h, d, t = v.shape
        v8 = quantize_fp8(v, s, out=_dim_major_empty(h, d, t, FP8, v.device))
    else:
        v8 = quantize_v_dim_major(v, s)
    return q8, k8, v8, deq


def quantize_v_dim_major(v: torch.Tensor, kv_scale_orig_quant: float | torch.Tensor) -> torch.Tensor:
    """A token-major 16-bit/fp32 V ``[T, H_kv, d_v]`` (last dim contiguous, other strides free) quantised to
    ``e4m3(v * kv_scale_orig_quant)`` straight into the dim-major layout ``[H_kv, d_v, T]`` with a 16-byte-aligned
    token stride (``quantize_fp8(..., transpose_tokens=True)``: tiles transposed on chip, one pass over V). The FP8
    context kernels read this layout without transposing V themselves (``v_layout="dim_major"``). The scale may be
    a 1-element fp32 device tensor (read on the device). Bad input raises before any launch."""
    from kvforge.kernels.quantize_fp8 import quantize_fp8

    check_tensor("v", v, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    check_launch_device("v", v)
    t, h, d = v.shape
    return quantize_fp8(v, kv_scale_orig_quant, out=_dim_major_empty(h, d, t, FP8, v.device), transpose_tokens=True)


def mla_context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    *,
    kv_scale_quant_orig: float | torch.Tensor = 1.0,
    q_scale: float | torch.Tensor | None = None,
    kv_scale_orig_quant: float | torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    v_layout: str = "token_major",
    error_flag: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA context attention over cached prefixes in one call (see the module docstring for the contract).

    Args:
        q: ``[total_q, H, d_qk]`` bf16/fp16, or FP8 e4m3 (then k and v are FP8 too).
        k: ``[>= total_kv, H_kv, d_qk]``, q's dtype or FP8 e4m3; H_kv divides H. Rows past ``cu_seqlens_kv[-1]``
            are ignored.
        v: ``[>= total_kv, H_kv, d_v]`` (``v_layout="token_major"``) or ``[H_kv, d_v, >= total_kv]`` with tokens
            contiguous (``v_layout="dim_major"``, any token stride); k's dtype.
        cu_seqlens_q / cu_seqlens_kv: int32 ``[B + 1]`` on q's device or the host; ``cu_seqlens_q[0] == 0``,
            ``cu_seqlens_q[-1] == total_q``; both non-decreasing and ``q_len <= kv_len`` per request.
        kv_scale_quant_orig: dequantisation scale of FP8 k/v; a float or a 1-element fp32 tensor on the device.
            Must be 1.0 for 16-bit k/v.
        q_scale: dequantisation scale of an FP8 q (float or 1-element fp32 device tensor); None: q shares
            ``kv_scale_quant_orig``. Only with an FP8 q.
        kv_scale_orig_quant: op-quantised inputs: with 16-bit q/k/v, quantise all three on the device to
            ``e4m3(x * kv_scale_orig_quant)`` (exactly ``quantize_kv_e4m3``) and run the FP8 path with the
            reciprocal as dequantisation scale. Excludes ``kv_scale_quant_orig`` and ``q_scale``.
        softmax_scale: defaults to ``1 / sqrt(d_qk)``.
        out: optional ``[total_q, H, d_v]`` bf16 (or fp16) output buffer.
        return_lse: also return the fp32 ``[total_q, H]`` natural-log LSE of the scaled scores.
        max_seqlen_q / max_seqlen_kv: optional upper bounds of the lengths (smaller work tables, the short-query
            tiles when ``max_seqlen_q <= 64``).
        error_flag: optional 1-element int32 device tensor; the call writes 1 into it when a request breaks the
            length contract, else 0 (no host read).
        strict: read the lengths on the host and raise ValueError for a bad batch (one device sync).
    Lengths. With ``cu_seqlens`` on q's device the call never reads them back: the work table is built on the
    device, bounded by ``total_q`` and the k/v rows (or ``max_seqlen_*``). A request that breaks the contract then
    gets NaN output and LSE rows (and sets ``error_flag``); nothing outside the given tensors is read or written.
    Host ``cu_seqlens`` (or ``strict=True``) are checked on the host and raise.
    Returns:
        ``out`` (bf16; fp16 for fp16 inputs), or ``(out, lse)``.
    """
    try:
        key = (tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(cu_seqlens_q), tensor_key(cu_seqlens_kv),
               _arg_key(kv_scale_quant_orig), _arg_key(q_scale), _arg_key(kv_scale_orig_quant),
               _arg_key(softmax_scale), _arg_key(out), _arg_key(return_lse), _arg_key(max_seqlen_q),
               _arg_key(max_seqlen_kv), _arg_key(v_layout), _arg_key(error_flag), _arg_key(strict))  # fmt: skip
        hit = _CALLS.get(key, _UNSEEN)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable: the checked path says which
        key, hit = None, None
    if isinstance(hit, tuple) and hit[0] == _env():
        # The same tensors (address, shape, strides, dtype, device) and scalars as an earlier checked call: its
        # checks read only that metadata. The lengths' values are never read on the host, so nothing else differs.
        one: _OneCall = hit[1]
        kept = _kept_table(one, q.device)
        if kept is None:
            kept = _fresh_table(one, q.device)
        if kept is not None:  # aligned as recorded (the table launches were specialised on it)
            buf, work, starts = kept[:3]
            tensors = (cu_seqlens_q, cu_seqlens_kv, starts, buf if error_flag is None else error_flag, work)
            for table in one.tables:
                table.launch(tensors)
            if one.zero_flag:
                error_flag.zero_()
            return _replay_run(one.run, q.device, work, q, k, v, out, None, kv_scale_quant_orig, q_scale, kept[3:])
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor_device(name, t)
        check_launch_device(name, t)
    dev = q.device
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout: expected one of {V_LAYOUTS}, got {v_layout!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    num_kv_heads = v.shape[0] if v_layout == "dim_major" else k.shape[1]
    head_dim_v = v.shape[1] if v_layout == "dim_major" else v.shape[2]
    if k.shape[1] != num_kv_heads:
        raise ValueError(f"v: has {num_kv_heads} KV heads, k has {k.shape[1]}")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_kv = _check_max_seqlen("max_seqlen_kv", max_seqlen_kv)
    flag = _check_error_flag(error_flag, dev)
    if flag is not None:  # the flag is written before run's checks: refuse an aliased one first
        check_no_overlap({"error_flag": flag, "out": out if isinstance(out, torch.Tensor) else None},
                         {"q": q, "k": k, "v": v})  # fmt: skip
    if kv_scale_orig_quant is not None:
        if not (isinstance(kv_scale_quant_orig, (int, float)) and kv_scale_quant_orig == 1.0) or q_scale is not None:
            raise ValueError(
                "kv_scale_orig_quant: op-quantised inputs take their dequantisation scale from it; leave "
                "kv_scale_quant_orig (1.0) and q_scale (None) unset"
            )
        _check_shapes(q.shape[1], k.shape[1], q.shape[2], head_dim_v, q.dtype, k.dtype, v_layout)
        q, k, v, kv_scale_quant_orig = _op_quantise(q, k, v, v_layout, kv_scale_orig_quant)
        v_layout = "dim_major"
    on_device = isinstance(cu_seqlens_q, torch.Tensor) and same_device(cu_seqlens_q.device, dev)
    if on_device and not strict:
        sh = _check_shapes(q.shape[1], k.shape[1], q.shape[2], head_dim_v, q.dtype, k.dtype, v_layout)
        _check_capability(sh, dev)
        cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, dev, None, host_ok=False)
        cu_kv = _check_cu("cu_seqlens_kv", cu_seqlens_kv, dev, cu_q.numel(), host_ok=False)
        kv_rows = min(k.shape[0], v.shape[2] if v_layout == "dim_major" else v.shape[0])
        if key is None or kv_scale_orig_quant is not None or hit is _UNSEEN:
            # Op-quantised inputs are new tensors every call; a first sight only notes the key (recording costs a
            # few µs, wasted on buffers that never come back).
            plan = MLAContextPlan._plan_on_device(sh, cu_q, cu_kv, max_q, max_kv, q.shape[0], kv_rows, error_flag=flag)
            if key is not None and kv_scale_orig_quant is None:
                res = plan._run_checked(q, k, v, kv_scale_quant_orig, q_scale, softmax_scale, out, None, return_lse,
                                        None)  # fmt: skip
                _CALLS.put(key, None)
                return res
        else:
            env = _env()
            tables: list = []
            plan = MLAContextPlan._plan_on_device(sh, cu_q, cu_kv, max_q, max_kv, q.shape[0], kv_rows, error_flag=flag,
                                                  record=tables)  # fmt: skip
            res = plan._run_checked(q, k, v, kv_scale_quant_orig, q_scale, softmax_scale, out, None, return_lse, ())
            run = plan._runs.get(())
            # The tile-starts launch's arguments begin (cu_q, cu_kv, starts, flag); without requests nothing launches.
            starts, flag_t = (tables[0][2][2], tables[0][2][3]) if tables else (None, None)
            tensors = (cu_q, cu_kv, starts, flag_t, plan.work)
            recs = [RecordedLaunch.record(*t, tensors) for t in tables]
            buf = plan.work if plan.work._base is None else plan.work._base
            if run is not None and all(r is not None for r in recs) and buf.data_ptr() % 16 == 0:
                n_work = plan.work.numel()
                shares = (plan.kv_splits, plan.total_q, sh.num_heads, sh.head_dim_v) if plan.kv_splits > 1 else None
                one = _OneCall(buf.numel(), n_work, tuple(recs), flag is not None and not tables, run, {}, shares)
                _CALLS.put(key, (env, one))
            return res
    else:
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
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv,
            # strict=True only adds host checks: it computes what the device-table call computes (its config,
            # its share count from the same bounds; the shares themselves are the same, built on the host)
            **(_strict_plan_args(q, k, v, v_layout, cu_seqlens_q, max_q, max_kv) if on_device else {}),
        )
        if flag is not None:
            flag.zero_()  # the host checks raised for anything the flag would report
    return plan.run(
        q, k, v, kv_scale_quant_orig=kv_scale_quant_orig, q_scale=q_scale, softmax_scale=softmax_scale, out=out,
        return_lse=return_lse,
    )  # fmt: skip


def _strict_plan_args(q, k, v, v_layout: str, cu_q: torch.Tensor, max_q: int | None, max_kv: int | None) -> dict:
    """``config`` and ``kv_splits`` of the device-table call on these shapes, for ``strict=True``'s host plan."""
    head_dim_v = v.shape[1] if v_layout == "dim_major" else v.shape[2]
    sh = _check_shapes(q.shape[1], k.shape[1], q.shape[2], head_dim_v, q.dtype, k.dtype, v_layout)
    n_req, total_q = cu_q.numel() - 1, q.shape[0]
    kv_rows = min(k.shape[0], v.shape[2] if v_layout == "dim_major" else v.shape[0])
    config = _device_config(sh, q.device, n_req, total_q, max_q)
    slots = _device_slots(n_req, total_q, total_q if max_q is None else max_q, int(config.kwargs["BLOCK_M"]))
    kv = kv_rows if max_kv is None else min(max_kv, kv_rows)
    return {"config": config, "kv_splits": _device_kv_splits(sh, q.device, config, slots, total_q, kv)}


_LAUNCH = MLAContextPlan._launch  # the unpatched launch: only its launches are recorded for replay


# ----------------------------------------------------------------------------------------------------- reference


def v_to_dim_major(v: torch.Tensor, align_bytes: int = 16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, H_kv, d_v]`` -> ``[H_kv, d_v, T]`` (``v_layout="dim_major"``), tokens contiguous, each row's stride
    padded to ``align_bytes`` so the kernel can read it with tensor descriptors (TMA) at any T.

    ``out``: a dim-major buffer to write instead (``[H_kv, d_v, T]``, tokens contiguous, V's dtype and device, not
    overlapping ``v``; its strides are the caller's, ``align_bytes`` is not used), so repeat calls keep one
    address (a plan's run then replays, a CUDA graph can capture the copy). On a GPU (and the interpreter) a V
    whose last dim is contiguous is transposed by one tiled launch (``_tokens_to_dims_kernel``), a V already
    dim-major (``v.permute(1, 2, 0)`` of one) is re-aligned by the word copy (``copy_dim_major_rows``); anything
    else, and the CPU, takes torch's ``copy_``. Bad input raises TypeError/ValueError before anything is written."""
    check_tensor("v", v, ndim=3)
    if v.device.type == "meta":
        raise ValueError("v: expected a tensor with storage, got a meta tensor")
    check_int("align_bytes", align_bytes, 1, 1 << 12)
    if align_bytes % v.element_size():
        raise ValueError(f"align_bytes: expected a multiple of v's element size ({v.element_size()}), "
                         f"got {align_bytes}")  # fmt: skip
    t, h, d = v.shape
    if out is None:
        out = _dim_major_empty(h, d, t, v.dtype, v.device, align_bytes)
    else:
        check_tensor("out", out, dtype=v.dtype, ndim=3)
        if tuple(out.shape) != (h, d, t) or not same_device(out.device, v.device):
            raise ValueError(f"out: expected shape {[h, d, t]} on {v.device}, got {list(out.shape)} on {out.device}")
        if out.stride(2) != 1 and t > 1:
            raise ValueError(f"out: expected the token dimension contiguous (stride 1), got strides {out.stride()}")
        check_no_overlap({"out": out}, {"v": v})
    src = v.permute(1, 2, 0)
    if src.stride(2) == 1 and t > 1:  # already dim-major (a re-alignment): the word-copy kernel
        return copy_dim_major_rows(out, src)
    launch = _transpose_launch(out, v) if v.stride(2) == 1 or d == 1 else None
    if launch is None:
        return out.copy_(src)
    launch_jit(_tokens_to_dims_kernel, *launch, num_warps=_TRANSPOSE_WARPS)
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
    q_scale: float | None = None,
    kv_scale_orig_quant: float | None = None,
    softmax_scale: float | None = None,
    v_layout: str = "token_major",
    dtype: torch.dtype = torch.float32,
    head_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference, per request with an explicit mask: returns (out, natural-log lse) in ``dtype``.

    FP8 k/v are dequantised by ``kv_scale_quant_orig``, an FP8 q by ``q_scale`` (default: the same scale).
    ``kv_scale_orig_quant`` (16-bit q/k/v): the op-quantised branch, each input first rounded to
    ``e4m3(x * kv_scale_orig_quant)`` and dequantised by its reciprocal. ``head_chunk`` bounds the score matrix
    held at once (heads per step) for long requests on a GPU.
    """
    cu_q = cu_seqlens_q.tolist() if isinstance(cu_seqlens_q, torch.Tensor) else list(cu_seqlens_q)
    cu_kv = cu_seqlens_kv.tolist() if isinstance(cu_seqlens_kv, torch.Tensor) else list(cu_seqlens_kv)
    if kv_scale_orig_quant is not None:
        sq = float(kv_scale_orig_quant)
        q, k, v = (e4m3_ref(t.float() * sq) for t in (q, k, v))  # the contract: one fp32 product
        kv_scale_quant_orig = 1.0 / sq
    s = float(kv_scale_quant_orig)
    s_q = s if q_scale is None else float(q_scale)

    def deq(t: torch.Tensor, scale: float = s) -> torch.Tensor:
        return t.to(dtype) * scale if t.dtype == FP8 else t.to(dtype)

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
            qh = deq(q[q0:q1, h0:h1], s_q).transpose(0, 1)
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
