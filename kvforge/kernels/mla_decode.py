"""Absorbed-MLA decode attention over a paged latent cache, split over the keys (flash-decoding) and merged.

One query token per request, ``q [B, H, D_qk]``, over ``kv_cache [num_pages, page_size, D_qk]`` addressed by
``block_table [B, max_pages]`` and ``seq_lens [B]``; keys are whole rows, values the first ``v_head_dim``
columns: ``s = softmax_scale · q · kᵀ``, ``out = softmax(s) · v``, ``lse = log Σ exp(s)`` (natural log, fp32).
A request with ``seq_lens[b] == 0`` gets ``out = 0``, ``lse = −inf``. q and the cache share one dtype (bf16, fp16,
fp32), or a 16-bit q reads an e4m3 cache (``kv_scale_quant_orig`` dequantises; fp16 products, fp32 sums): its
output is within relative RMSE 1e-2 of fp32 attention over the dequantised cache (what the tests hold it to).
``store_latent_rows`` writes new rows into either cache (quantising on write). Host checks before any launch:
types, dtypes, shapes, devices, overlaps. Values (lengths, page ids) are checked on the device by default with
no device→host read (bad requests get NaN and set an error flag; ``check_values="strict"`` checks on the host
and raises), so the default call is graph-capturable. Key shares are sized on the device from the batch's total
work (a long request of a mixed batch gets many, a short one a single share written straight to ``out``; a batch
of more programs than run at once starts its longest requests first); a repeat call with the same tensors and
arguments reuses its checked launch plan. ``MLADecodePlan`` does the host
work once per batch and ``run(q, kv_cache)`` per layer. On sm_90 with bf16 and 32 or more heads the
warp-specialised Gluon kernel of ``mla_decode_gluon`` runs; elsewhere the portable kernel. Layout, shares,
launch variants and host cost: ``docs/kernels.md``.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import (
    FP8,
    byte_span,
    check_int,
    check_launch_device,
    check_no_overlap,
    check_shape,
    check_tensor,
    same_device,
)
from kvforge.kernels._fp8 import fp32_to_e4m3_byte, native_e4m3_store
from kvforge.kernels._runtime import (
    ConfigTable,
    DirectLaunch,
    PlanCache,
    TunedKernel,
    arch_name,
    clone_descriptor,
    current_stream_handle,
    device_capability,
    hooks_active,
    interpreting,
    num_sms,
    tensor_key,
)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _kv_tile(kv_ptr, desc_h, desc_r, n0, tok, nmask, page, s_kp, s_kr, col_mine, col_other,
             PAGE_SIZE: tl.constexpr, D_HALF: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
             USE_TMA: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """One key tile: the caller's half of the latent columns, the other half, and the rope part. ``page`` is a
    scalar when a tile lies inside one page (PAGE_SIZE % BLOCK_N == 0), else a page id per token. Masked rows
    (past the share's end) are zeroed: never-written rows may hold NaN, and a 0 weight times NaN is NaN."""
    dh = tl.arange(0, D_HALF)
    dr = tl.arange(0, D_R)
    if USE_TMA:  # rows of the 2-D [pages * PAGE_SIZE, D] view; a tile never crosses a page
        grow = (page * PAGE_SIZE + n0 % PAGE_SIZE).to(tl.int32)
        k_mine = desc_h.load([grow, col_mine])
        k_other = desc_h.load([grow, col_other])
        k_rope = desc_r.load([grow, D_V])
    else:
        if PAGE_SIZE % BLOCK_N == 0:
            row = page * s_kp + (tok % PAGE_SIZE).to(tl.int64) * s_kr
        else:
            row = page.to(tl.int64) * s_kp + (tok % PAGE_SIZE).to(tl.int64) * s_kr
        base = kv_ptr + row[:, None]
        if MASKED:
            k_mine = tl.load(base + col_mine + dh[None, :], mask=nmask[:, None], other=0.0)
            k_other = tl.load(base + col_other + dh[None, :], mask=nmask[:, None], other=0.0)
            k_rope = tl.load(base + D_V + dr[None, :], mask=nmask[:, None], other=0.0)
        else:
            k_mine = tl.load(base + col_mine + dh[None, :])
            k_other = tl.load(base + col_other + dh[None, :])
            k_rope = tl.load(base + D_V + dr[None, :])
    if USE_TMA and MASKED:
        k_mine = tl.where(nmask[:, None], k_mine, tl.zeros_like(k_mine))
        k_other = tl.where(nmask[:, None], k_other, tl.zeros_like(k_other))
        k_rope = tl.where(nmask[:, None], k_rope, tl.zeros_like(k_rope))
    return k_mine, k_other, k_rope


@triton.jit
def _e4m3_bytes_to_f16(b):
    """e4m3 bytes -> fp16 holding the value / 256, with integer ops only (sm_80 has no e4m3 type): the
    exponent bias moves from 7 to 15, so the byte's bits shifted into fp16's place read 2^-8 times the value,
    subnormals included; the caller folds the 256 into its scale."""
    b = b.to(tl.int32)
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_to_f16_pinned(x):
    """e4m3 -> fp16 (exact), four values per instruction pair, as an op the compiler does not move: a plain
    conversion is sunk past the layout change into the dot operands, which then reads the transposed (P.V)
    operand from shared memory one byte at a time (sm_90 has no 8-bit transposing ldmatrix); converted here, in
    the load's layout, the tile crosses shared memory as fp16 and reaches both products through ldmatrix."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
    )  # fmt: skip


@triton.jit
def _decode_step(acc_mine, acc_other, m, l_sum, q_mine, q_other, q_rope, k_mine, k_other, k_rope, nmask,
                 sm_scale_log2, UPCAST: tl.constexpr, SPLIT_DV: tl.constexpr, MASKED: tl.constexpr,
                 PRECISION: tl.constexpr, FP8_BYTES: tl.constexpr = False,
                 FP8_PIN: tl.constexpr = False):  # fmt: skip
    if FP8_PIN:
        k_mine = _e4m3_to_f16_pinned(k_mine)
        k_other = _e4m3_to_f16_pinned(k_other)
        k_rope = _e4m3_to_f16_pinned(k_rope)
    if FP8_BYTES:
        k_mine = _e4m3_bytes_to_f16(k_mine)
        k_other = _e4m3_bytes_to_f16(k_other)
        k_rope = _e4m3_bytes_to_f16(k_rope)
    if UPCAST:  # the interpreter's bf16 dot multiplies bit patterns; fp32 there is exact (and so is fp8 -> fp32)
        k_mine = k_mine.to(tl.float32)
        k_other = k_other.to(tl.float32)
        k_rope = k_rope.to(tl.float32)
    else:  # an e4m3 cache widens to q's 16-bit type exactly (no-op when the cache already has q's dtype)
        k_mine = k_mine.to(q_mine.dtype)
        k_other = k_other.to(q_mine.dtype)
        k_rope = k_rope.to(q_mine.dtype)
    s = tl.dot(q_mine, tl.trans(k_mine), input_precision=PRECISION)
    s = tl.dot(q_other, tl.trans(k_other), s, input_precision=PRECISION)
    s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION) * sm_scale_log2
    if MASKED:
        s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    pc = p.to(k_mine.dtype)
    acc_mine = tl.dot(pc, k_mine, acc_mine * alpha[:, None], input_precision=PRECISION)
    if not SPLIT_DV:
        acc_other = tl.dot(pc, k_other, acc_other * alpha[:, None], input_precision=PRECISION)
    return acc_mine, acc_other, m_new, l_sum


@triton.jit
def _share_even(seq_ptr, B, max_len, min_tiles, slots, head_progs, BLOCK_N: tl.constexpr):
    """(c0, longest request) in key tiles: the even share ``max(min_tiles, ceil(total * head_progs / slots))``
    of the balanced split, and the batch's longest request (one pass over the lengths, 256 at a time)."""
    offs = tl.arange(0, 256)
    total = tl.zeros((256,), tl.int32)
    top = tl.zeros((256,), tl.int32)
    i = 0
    while i < B:
        lens = tl.load(seq_ptr + i + offs, mask=i + offs < B, other=0)
        t = (tl.minimum(tl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
        total += t
        top = tl.maximum(top, t)
        i += 256
    c0 = tl.maximum((tl.sum(total, 0).to(tl.int64) * head_progs + slots - 1) // slots, min_tiles)
    return tl.minimum(c0, 1 << 20).to(tl.int32), tl.max(top, 0)


@triton.jit
def _count_tiles(seq_ptr, B, max_len, lo_t, hi_t, last, BLOCK_N: tl.constexpr):
    """Requests ``i <= last`` whose key tiles (lengths clamped to ``[0, max_len]``) lie in ``[lo_t, hi_t)``."""
    offs = tl.arange(0, 256)
    cnt = tl.zeros((256,), tl.int32)
    i = 0
    while i < B:
        idx = i + offs
        lens = tl.load(seq_ptr + idx, mask=idx < B, other=0)
        t = (tl.minimum(tl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
        cnt += ((idx < B) & (idx <= last) & (t >= lo_t) & (t < hi_t)).to(tl.int32)
        i += 256
    return tl.sum(cnt, 0)


@triton.jit
def _longest_first(seq_ptr, y, B, max_len, BLOCK_N: tl.constexpr):
    """The request at place ``y`` of the batch ordered by key tiles, most first, ties by index
    (``longest_first_ref``): every program computes the same order, so the grid's request axis is a permutation.
    A uniform batch is the identity after one pass; otherwise a bisection on the tile count, then one on the
    index among equals (about log2(longest) + log2(B) passes over the lengths)."""
    offs = tl.arange(0, 256)
    lo_v = tl.full((256,), 1 << 30, tl.int32)
    hi_v = tl.zeros((256,), tl.int32)
    i = 0
    while i < B:
        lens = tl.load(seq_ptr + i + offs, mask=i + offs < B, other=0)
        t = (tl.minimum(tl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
        lo_v = tl.minimum(lo_v, tl.where(i + offs < B, t, 1 << 30))
        hi_v = tl.maximum(hi_v, t)
        i += 256
    lo = tl.min(lo_v, 0)
    hi = tl.max(hi_v, 0) + 1
    b = y
    if hi - lo > 1:
        # count(t >= lo) > y >= count(t >= hi): the place's tile count v is lo at the end
        while hi - lo > 1:
            mid = (lo + hi) // 2
            more = _count_tiles(seq_ptr, B, max_len, mid, 1 << 30, B, BLOCK_N) > y
            lo = tl.where(more, mid, lo)
            hi = tl.where(more, hi, mid)
        r = y - _count_tiles(seq_ptr, B, max_len, lo + 1, 1 << 30, B, BLOCK_N)  # its place among t == v
        a = y * 0 - 1
        z = y * 0 + B - 1
        while z - a > 1:
            mid = (a + z) // 2
            hit = _count_tiles(seq_ptr, B, max_len, lo, lo + 1, mid, BLOCK_N) > r
            z = tl.where(hit, mid, z)
            a = tl.where(hit, a, mid)
        b = z
    return b


@triton.jit
def _share_pick(seq_ptr, B, S, max_len, min_tiles, slots, head_progs, c0, tmax, BLOCK_N: tl.constexpr):
    """(chunk, floor) of ``share_chunk_ref``: the share size whose batch-wide cost estimate is lowest among
    ``SHARE_STEPS``' candidates (a second pass over the lengths, 64 at a time; every program computes the
    same)."""
    offs = tl.arange(0, 64)
    f = tl.arange(0, 8)
    step = tl.where(f <= 3, tl.maximum(f - 1, 0), tl.where(f == 4, 4, (f - 4) * 8))  # SHARE_STEPS
    cand = tl.minimum(c0 + (c0 * step + 7) // 8, 1 << 20)
    progs = tl.zeros((8,), tl.int64)
    longest0 = tl.zeros((64,), tl.int32)
    i = 0
    while i < B:
        live = i + offs < B
        lens = tl.load(seq_ptr + i + offs, mask=live, other=0)
        t = (tl.minimum(tl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
        n0 = tl.minimum(tl.maximum(t // c0, 1), S)  # the first candidate rounds down: its longest share exactly
        longest0 = tl.maximum(longest0, tl.where(live, (t + n0 - 1) // n0, 0))
        n = tl.minimum(tl.maximum((t[:, None] + cand[None, :] - 1) // cand[None, :], 1), S)
        n = tl.where(f[None, :] == 0, n0[:, None], n)
        progs += tl.sum(tl.where(live[:, None], n, 0), 0).to(tl.int64)
        i += 64
    waves = (tl.minimum(progs * head_progs, 1 << 30).to(tl.int32) + slots - 1) // slots
    # The others round up: no share is longer than the candidate unless S caps the longest request's count.
    longest = tl.where(f == 0, tl.max(longest0, 0), tl.maximum(tl.minimum(tmax, cand), (tmax + S - 1) // S))
    cost = waves.to(tl.int64) * (longest + min_tiles)
    best = tl.min(cost * 8 + f, 0) % 8
    return tl.sum(tl.where(f == best, cand, 0), 0), best == 0


@triton.jit
def _request_share(seq_ptr, b, split, B, S, max_len, min_tiles, slots, head_progs, BLOCK_N: tl.constexpr,
                   CHECK: tl.constexpr, BALANCE: tl.constexpr):  # fmt: skip
    """This program's key share of request ``b``: (start, end, shares of the request, length out of range).

    A request of ``t`` key tiles is cut into ``n`` shares of ``ceil(t / n)`` tiles. BALANCE 0: ``n = min(S, t)``.
    Otherwise the work of the whole batch decides (``share_counts_ref``, computed alike by every program), so
    that about one wave of ``slots`` programs does the work, a long request getting many shares and a short one
    a single share: BALANCE 1 rounds the counts at the even share down (one pass over the lengths); BALANCE 2
    costs eight share sizes (``share_chunk_ref``) and takes the least critical path (the grid's S is an upper
    bound; programs past a request's ``n`` return at once). A length outside ``[0, max_len]`` counts as 0 keys
    and is reported (CHECK)."""
    seq_len = tl.load(seq_ptr + b)
    bad = seq_len * 0  # int32 0/1 (a tensor, so it can join the page check's flag)
    if CHECK:
        bad = ((seq_len < 0) | (seq_len > max_len)).to(tl.int32)
        seq_len = tl.where(bad != 0, 0, seq_len)
    tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    # Every share is at least min_tiles long (c0 >= min_tiles): a program past that bound has nothing to do and
    # leaves before any pass over the batch's lengths (a batch of short requests launches many such programs).
    if BALANCE == 2:
        n = tl.minimum(tl.maximum((tiles + min_tiles - 1) // min_tiles, 1), S)
        if split < n:
            c0, tmax = _share_even(seq_ptr, B, max_len, min_tiles, slots, head_progs, BLOCK_N)
            # Every candidate share is at least c0 long: the same bound again before the second pass.
            n = tl.minimum(tl.maximum((tiles + c0 - 1) // c0, 1), S)
            if split < n:
                chunk, floor = _share_pick(seq_ptr, B, S, max_len, min_tiles, slots, head_progs, c0, tmax, BLOCK_N)
                n = tl.minimum(tl.maximum(tl.where(floor, tiles // chunk, (tiles + chunk - 1) // chunk), 1), S)
    elif BALANCE == 1:  # the even share, counts rounded down (one pass)
        n = tl.minimum(tl.maximum(tiles // min_tiles, 1), S)
        if split < n:
            c0, _ = _share_even(seq_ptr, B, max_len, min_tiles, slots, head_progs, BLOCK_N)
            n = tl.minimum(tl.maximum(tiles // c0, 1), S)
    else:
        n = tl.minimum(tl.maximum(tiles, 1), S)
    per = (tiles + n - 1) // n
    start = split * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, seq_len)
    return start, end, n, bad


# The batch, the share bounds and the output strides change from call to call: never specialise on them (a
# recompile per value).
@triton.jit(do_not_specialize=["B", "S", "max_len", "min_tiles", "slots", "num_pages", "s_plb", "s_plh", "s_ob",
                               "s_oh", "s_lb", "s_lh", "kv_scale"])  # fmt: skip
def _mla_decode_split_kernel(
    q_ptr, kv_ptr, desc_h, desc_r, bt_ptr, seq_ptr, po_ptr, plse_ptr, out_ptr, lse_ptr, nshare_ptr, err_ptr,
    scale_ptr, H, s_qb, s_qh, s_kp, s_kr, s_btb, s_pob, s_poh, s_pos,
    B, S, max_len, min_tiles, slots, num_pages, s_plb, s_plh, s_ob, s_oh, s_lb, s_lh,
    sm_scale_log2, kv_scale,
    PAGE_SIZE: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_DV: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, CHECK: tl.constexpr, BALANCE: tl.constexpr, SCALE_MODE: tl.constexpr,
    FP8_BYTES: tl.constexpr, PER_SM: tl.constexpr = 2, GLUON: tl.constexpr = False, FP8_PIN: tl.constexpr = False,
    ORDER: tl.constexpr = False, MERGE: tl.constexpr = False,
):  # fmt: skip
    """Grid (head tiles x (2 if SPLIT_DV else 1), requests, S): the programs that read the same keys are
    neighbours in launch order, so they run together and a key tile's second read comes from L2. The latent
    columns are handled as two halves (a TMA box is at most 256 wide): with SPLIT_DV a program writes only its
    half of the output (half the accumulator registers, the scores computed by both programs of the pair).
    A request with one share writes ``out``/``lse`` itself; one with several writes fp32 partials and then, with
    MERGE, the last of its shares to finish (counted per program column on ``nshare_ptr``, ``[B, programs, 2]``
    int32 arrival counters, zero before and after) merges them (``_merge_rows``); without, its share count goes
    to ``nshare`` for ``_decode_merge_kernel``. CHECK: lengths past ``max_len`` and page ids outside
    ``[0, num_pages)`` are read as length 0 / page 0, the request's output and lse become NaN and
    ``err[0]`` / ``err[1]`` are set to 1. SCALE_MODE: 0 none, 1 ``kv_scale``, 2 ``*scale_ptr`` multiplies the
    scores and the output (an e4m3 cache's dequantisation); FP8_BYTES reads that cache as bytes (sm_80);
    FP8_PIN widens it with ``_e4m3_to_f16_pinned`` (sm_89+). ORDER: the request axis runs the batch longest
    first (``_longest_first``), so a batch of more programs than fit at once starts its long requests first.
    PER_SM and GLUON are the launcher's (programs resident per SM; the sm_90 Gluon kernel instead of this one
    where it can run), parameters so that a config's kwargs launch as they are."""
    D_HALF: tl.constexpr = D_V // 2
    pid1 = tl.program_id(0)
    b = tl.program_id(1)
    if ORDER:
        b = _longest_first(seq_ptr, b, B, max_len, BLOCK_N)
    b = b.to(tl.int64)
    split = tl.program_id(2)
    if SPLIT_DV:
        pid_h = pid1 // 2
        half = pid1 % 2
    else:
        pid_h = pid1
        half = 0
    start, end, n_share, bad = _request_share(seq_ptr, b, split, B, S, max_len, min_tiles, slots,
                                              tl.num_programs(0), BLOCK_N, CHECK, BALANCE)  # fmt: skip
    if split >= n_share:
        return
    if not MERGE and (S > 1) & (pid1 == 0) & (split == 0):
        tl.store(nshare_ptr + b, n_share)
    if SCALE_MODE == 2:
        kv_scale = tl.load(scale_ptr)
    if FP8_BYTES:  # the cache's bytes decode to value / 256 (_e4m3_bytes_to_f16)
        kv_scale = kv_scale * 256.0
    if SCALE_MODE != 0:
        sm_scale_log2 = sm_scale_log2 * kv_scale
    col_mine = half * D_HALF
    col_other = D_HALF - col_mine
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dh = tl.arange(0, D_HALF)
    dr = tl.arange(0, D_R)
    q_rows = q_ptr + b * s_qb + heads.to(tl.int64)[:, None] * s_qh
    q_mine = tl.load(q_rows + col_mine + dh[None, :], mask=hmask[:, None], other=0.0)
    q_other = tl.load(q_rows + col_other + dh[None, :], mask=hmask[:, None], other=0.0)
    q_rope = tl.load(q_rows + D_V + dr[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q_mine = q_mine.to(tl.float32)
        q_other = q_other.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    elif SCALE_MODE != 0:  # an e4m3 cache: fp16 products (e4m3 -> fp16 is one instruction per pair; -> bf16 is not)
        q_mine = q_mine.to(tl.float16)
        q_other = q_other.to(tl.float16)
        q_rope = q_rope.to(tl.float16)
    full_end = tl.maximum(start, start + ((end - start) // BLOCK_N) * BLOCK_N)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc_mine = tl.zeros((BLOCK_H, D_HALF), tl.float32)
    acc_other = tl.zeros((BLOCK_H, D_HALF), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b * s_btb
    bad_page = bad * 0
    bad_tok = tl.zeros((BLOCK_N,), tl.int32)
    for n0 in tl.range(start, full_end, BLOCK_N):
        tok = n0 + offs_n
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            if CHECK:
                wrong = (page < 0) | (page >= num_pages)
                bad_page = bad_page | wrong.to(tl.int32)
                page = tl.where(wrong, 0, page)
        else:
            page = tl.load(bt_row + tok // PAGE_SIZE).to(tl.int64)
            if CHECK:  # per token: or-ed into a vector, reduced once after the loop (no reduction per tile)
                wrong = (page < 0) | (page >= num_pages)
                bad_tok = bad_tok | wrong.to(tl.int32)
                page = tl.where(wrong, 0, page)
        k_mine, k_other, k_rope = _kv_tile(kv_ptr, desc_h, desc_r, n0, tok, None, page, s_kp, s_kr, col_mine,
                                           col_other, PAGE_SIZE, D_HALF, D_V, D_R, USE_TMA, False, BLOCK_N)  # fmt: skip
        acc_mine, acc_other, m, l_sum = _decode_step(acc_mine, acc_other, m, l_sum, q_mine, q_other, q_rope,
                                                     k_mine, k_other, k_rope, None, sm_scale_log2, UPCAST,
                                                     SPLIT_DV, False, PRECISION, FP8_BYTES, FP8_PIN)  # fmt: skip
    if full_end < end:  # the share's last, partial tile
        tok = full_end + offs_n
        nmask = tok < end
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(bt_row + full_end // PAGE_SIZE).to(tl.int64)
            if CHECK:
                wrong = (page < 0) | (page >= num_pages)
                bad_page = bad_page | wrong.to(tl.int32)
                page = tl.where(wrong, 0, page)
        else:
            page = tl.load(bt_row + tok // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
            if CHECK:
                wrong = nmask & ((page < 0) | (page >= num_pages))
                bad_tok = bad_tok | wrong.to(tl.int32)
                page = tl.where(wrong, 0, page)
        k_mine, k_other, k_rope = _kv_tile(kv_ptr, desc_h, desc_r, full_end, tok, nmask, page, s_kp, s_kr, col_mine,
                                           col_other, PAGE_SIZE, D_HALF, D_V, D_R, USE_TMA, True, BLOCK_N)  # fmt: skip
        acc_mine, acc_other, m, l_sum = _decode_step(acc_mine, acc_other, m, l_sum, q_mine, q_other, q_rope,
                                                     k_mine, k_other, k_rope, nmask, sm_scale_log2, UPCAST,
                                                     SPLIT_DV, True, PRECISION, FP8_BYTES, FP8_PIN)  # fmt: skip
    # Empty share (no keys): lse = -inf and a zero output; a merge gives it weight 0.
    has = l_sum > 0.0
    inv = 1.0 / tl.where(has, l_sum, 1.0)
    if SCALE_MODE != 0:
        inv = inv * kv_scale
    lse = tl.where(has, (m + tl.log2(tl.where(has, l_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    o_mine = acc_mine * inv[:, None]
    o_other = acc_other * inv[:, None]
    if CHECK:
        if PAGE_SIZE % BLOCK_N != 0:
            bad_page = bad_page | tl.max(bad_tok, 0)
        if (bad | bad_page) != 0:
            o_mine = tl.full((BLOCK_H, D_HALF), float("nan"), tl.float32)
            o_other = o_mine
            lse = tl.full((BLOCK_H,), float("nan"), tl.float32)
        if bad != 0:
            tl.store(err_ptr, 1)
        if bad_page != 0:
            tl.store(err_ptr + 1, 1)
    rows = heads.to(tl.int64)
    if n_share == 1:  # the request's only share: the final output, in out's dtype
        _store_share(out_ptr + b * s_ob + rows[:, None] * s_oh, lse_ptr + b * s_lb + rows * s_lh, o_mine, o_other,
                     lse, col_mine, col_other, hmask, half, D_HALF, SPLIT_DV)  # fmt: skip
    else:
        po_req = po_ptr + b * s_pob
        pl_req = plse_ptr + b * s_plb
        # With MERGE both programs of a SPLIT_DV pair write the (identical) lse: each half's merge reads it.
        lse_half = half
        if MERGE:
            lse_half = 0
        _store_share(po_req + split.to(tl.int64) * s_pos + rows[:, None] * s_poh, pl_req + rows * s_plh + split,
                     o_mine, o_other, lse, col_mine, col_other, hmask, lse_half, D_HALF, SPLIT_DV)  # fmt: skip
        if MERGE:
            tl.debug_barrier()  # every thread's stores are issued before the release (a grid barrier's pattern)
            cnt = nshare_ptr + (b * tl.num_programs(0) + pid1) * 2
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n_share - 1:
                tl.store(cnt, 0)  # zero again for the next call
                _merge_rows(po_req, pl_req, s_pos, s_poh, s_plh, n_share, out_ptr + b * s_ob, lse_ptr + b * s_lb,
                            s_oh, s_lh, rows, hmask, col_mine, half == 0, D_HALF)  # fmt: skip
                if not SPLIT_DV:
                    _merge_rows(po_req, pl_req, s_pos, s_poh, s_plh, n_share, out_ptr + b * s_ob,
                                lse_ptr + b * s_lb, s_oh, s_lh, rows, hmask, col_other, False, D_HALF)  # fmt: skip


@triton.jit
def _store_share(po, pl, o_mine, o_other, lse, col_mine, col_other, hmask, half, D_HALF: tl.constexpr,
                 SPLIT_DV: tl.constexpr):  # fmt: skip
    dh = tl.arange(0, D_HALF)
    ty = po.dtype.element_ty
    tl.store(po + col_mine + dh[None, :], o_mine.to(ty), mask=hmask[:, None])
    if not SPLIT_DV:
        tl.store(po + col_other + dh[None, :], o_other.to(ty), mask=hmask[:, None])
    if half == 0:
        tl.store(pl, lse, mask=hmask)


@triton.jit
def _merge_rows(po_req, pl_req, s_pos, s_poh, s_plh, n, ob, lb, s_oh, s_lh, rows, hmask, col0, with_lse,
                D_HALF: tl.constexpr):  # fmt: skip
    """Columns [col0, col0 + D_HALF) of a request's output rows ``rows`` (and, ``with_lse``, their lse): the
    log-sum-exp merge of its ``n`` shares' fp32 partials (``po_req`` / ``pl_req`` at share 0, share stride
    ``s_pos`` / 1), as ``_merge_head``: a share of lse -inf weighs 0 and is not read, a NaN lse makes the row
    NaN. Loads go to L2 (``.cg``): other programs wrote the partials."""
    pl = pl_req + rows * s_plh
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    bad = tl.zeros(rows.shape, tl.int32)
    for sh in range(n):
        x = tl.load(pl + sh, mask=hmask, other=float("-inf"), cache_modifier=".cg")
        bad = bad | (x != x).to(tl.int32)
        m = tl.maximum(m, tl.where(x != x, float("-inf"), x))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    cols = col0 + tl.arange(0, D_HALF)
    den = tl.zeros(rows.shape, tl.float32)
    acc = tl.zeros((rows.shape[0], D_HALF), tl.float32)
    for sh in range(n):
        x = tl.load(pl + sh, mask=hmask, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp(tl.where(x != x, float("-inf"), x) - m_safe)
        den += w
        o = tl.load(po_req + sh * s_pos + rows[:, None] * s_poh + cols[None, :], mask=(w > 0.0)[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        acc += w[:, None] * o
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    o = tl.where((bad != 0)[:, None], float("nan"), o)
    optr = ob + rows[:, None] * s_oh + cols[None, :]
    tl.store(optr, o.to(optr.dtype.element_ty), mask=hmask[:, None])
    if with_lse:
        lse = tl.where(den > 0.0, m_safe + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))
        tl.store(lb + rows * s_lh, tl.where(bad != 0, float("nan"), lse), mask=hmask)


@triton.jit(do_not_specialize=["H", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh", "s_ob", "s_oh", "s_lb", "s_lh"])
def _decode_merge_kernel(po_ptr, plse_ptr, nshare_ptr, out_ptr, lse_ptr, H, s_pob, s_poh, s_pos, s_plb, s_plh,
                         s_ob, s_oh, s_lb, s_lh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         CH: tl.constexpr, HB: tl.constexpr = 1):  # fmt: skip
    """Grid (requests, head blocks of ``HB``, column blocks): the log-sum-exp merge of a request's shares, only for
    requests with more than one share (the others wrote ``out`` themselves; their programs leave at once, so a
    large batch takes ``HB`` heads a program: an empty program still costs its launch). ``BLOCK_S`` >= the
    grid's share count: the share lses load as one vector; the outputs in chunks of ``CH`` shares, an empty
    share's (weight 0) not read. A NaN share lse (a poisoned share) makes the row NaN."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(nshare_ptr + b)
    if n <= 1:
        return
    for hh in tl.static_range(HB):
        h = tl.program_id(1).to(tl.int64) * HB + hh
        if h < H:
            _merge_head(po_ptr, plse_ptr, out_ptr, lse_ptr, b, h, n, s_pob, s_poh, s_pos, s_plb, s_plh, s_ob, s_oh,
                        s_lb, s_lh, BLOCK_S, BLOCK_D, CH)  # fmt: skip


@triton.jit
def _merge_head(po_ptr, plse_ptr, out_ptr, lse_ptr, b, h, n, s_pob, s_poh, s_pos, s_plb, s_plh, s_ob, s_oh, s_lb,
                s_lh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    """Head ``h`` of request ``b`` (``n`` shares): this program's column block of the merged output, and the lse
    from column block 0."""
    pl = plse_ptr + b * s_plb + h * s_plh
    offs_s = tl.arange(0, BLOCK_S)
    x = tl.load(pl + offs_s, mask=offs_s < n, other=float("-inf"))
    nan = x != x
    bad = tl.max(nan.to(tl.int32), 0)
    m = tl.max(tl.where(nan, float("-inf"), x), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_all = tl.exp(tl.where(nan, float("-inf"), x) - m_safe)
    den = tl.sum(w_all, 0)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    # The partials are the plan's own [B, H, S, dv] fp32 scratch with dv a power of two >= 32, so their strides are
    # multiples of 16 elements; written as such (x // 16 * 16 is x for them) the compiler sees it through the
    # per-call ints and loads 16 bytes at a time (a scalar multiple_of hint is not carried here).
    s_pob = s_pob // 16 * 16
    s_poh = s_poh // 16 * 16
    s_pos = s_pos // 16 * 16
    po = po_ptr + b * s_pob + h * s_poh + cols
    offs_c = tl.arange(0, CH)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    s0 = 0
    while s0 < n:
        ss = s0 + offs_c
        w = tl.exp(tl.load(pl + ss, mask=ss < n, other=float("-inf")) - m_safe)
        use = w > 0.0  # False for NaN too: a poisoned share's row is set below
        o = tl.load(po[None, :] + ss.to(tl.int64)[:, None] * s_pos, mask=use[:, None], other=0.0)
        acc += tl.sum(tl.where(use[:, None], w[:, None] * o, 0.0), 0)
        s0 += CH
    o = acc / tl.where(den > 0.0, den, 1.0)
    o = tl.where(bad != 0, float("nan"), o)
    optr = out_ptr + b * s_ob + h * s_oh + cols
    tl.store(optr, o.to(optr.dtype.element_ty))
    if tl.program_id(2) == 0:
        lse = tl.where(den > 0.0, m_safe + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))
        lse = tl.where(bad != 0, float("nan"), lse)
        tl.store(lse_ptr + b * s_lb + h * s_lh, lse)


def _split_kernel_signature(cache: str = "bf16") -> dict[str, str]:
    """The split kernel's argument types for an offline ``triton.compile`` (bf16 q, ``cache`` the latent cache's
    Triton type: ``bf16``, ``fp8e4nv`` or ``u8``): the one table the offline compile test and
    ``bench/probe_decode_sass.py`` build their signatures from."""
    ptrs = {"q_ptr": "bf16", "kv_ptr": cache, "desc_h": cache, "desc_r": cache, "bt_ptr": "i32", "seq_ptr": "i32",
            "po_ptr": "fp32", "plse_ptr": "fp32", "out_ptr": "bf16", "lse_ptr": "fp32", "nshare_ptr": "i32",
            "err_ptr": "i32", "scale_ptr": "fp32"}  # fmt: skip
    types = {name: "*" + t for name, t in ptrs.items()} | {"sm_scale_log2": "fp32", "kv_scale": "fp32"}
    fn = _mla_decode_split_kernel
    return {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}


def _cfg(
    bh: int,
    bn: int,
    warps: int,
    stages: int,
    split_dv: bool = False,
    tma: bool = False,
    per_sm: int = 2,
    gluon: int = 0,
) -> triton.Config:
    """``per_sm``: programs of this config resident on one SM (its shared memory), used to size the key shares.
    ``gluon``: launch ``mla_decode_gluon``'s warp-specialised kernel where ``gluon_decode_reason`` allows (64-head
    tiles, its own warps; ``bn``-token key tiles in a ring of ``stages``; 1: the score product issued after taking
    the other warpgroup's tile, 2: before it); elsewhere this config's portable kernel runs."""
    kw = {"BLOCK_H": bh, "BLOCK_N": bn, "SPLIT_DV": split_dv, "USE_TMA": tma, "PER_SM": per_sm, "GLUON": gluon}
    return triton.Config(kw, num_warps=warps, num_stages=stages)


_GLUON_DTYPES = ("bfloat16", "bfloat16,e4m3")  # config keys' dtypes the Gluon kernel takes (q, and the cache)
TRIAL_ENV = "KVFORGE_DECODE_TRIAL"  # "1": every Gluon variant of the sm_90 table is a candidate, not only the first
_GLUON_FIRST = (64, 2, False)  # the one Gluon variant an untuned key autotunes among (block_n, stages, early)
# The split kernels merge a split request themselves (its last share to finish): no merge launch. The merge
# kernel instead with KVFORGE_DECODE_FUSED_MERGE=0 (read at import; for comparisons).
FUSED_MERGE = os.environ.get("KVFORGE_DECODE_FUSED_MERGE", "1") != "0"
# Only up to this many shares a request: the merging program reads every share's partial in turn, so past a few
# the merge kernel (spread over the whole GPU) is faster; below it the merge launch and its mostly empty programs
# on a large batch cost more (H200: docs/kernels.md, "The merge inside the split kernel").
FUSED_MAX_SHARES = 2
MERGE_BLOCK_D = 256  # output columns a merge program takes (bench/probe_decode_merge.py: 1.3-1.5x against 128)
GLUON_MIN_HEADS = 32  # fewest heads (rounded up to a power of two >= 16) a key runs the Gluon kernel with


def _gluon_variant(cfg: triton.Config) -> tuple[int, int, bool]:
    """A Gluon config's (key tile, ring stages, scores issued early)."""
    return (int(cfg.kwargs["BLOCK_N"]), int(cfg.num_stages), int(cfg.kwargs.get("GLUON") or 0) == 2)


def _gluon_first(page_size: int) -> tuple[int, int, bool]:
    """The Gluon variant an untuned key autotunes among: 64-token tiles, or 32 in a 4-deep ring for 32-token pages."""
    return _GLUON_FIRST if page_size % 64 == 0 else (32, 4, False)


def _keep(cfg: triton.Config, key: tuple) -> bool:
    # key = (D_V, D_R, dtype, heads rounded to a power of two >= 16, page size, TMA-able layout)
    kw = cfg.kwargs
    if kw["BLOCK_H"] > max(16, key[3]) and not kw.get("GLUON"):  # no portable head tile wider than the heads
        return False
    if key[3] >= 64 and kw["BLOCK_H"] < 64:  # many heads: small head tiles re-read the cache per tile
        return False
    # The Gluon kernel: bf16 q and cache, GLUON_MIN_HEADS or more heads (with 32 the 64-row tile is half empty,
    # but the keys are read once, not once per 16-head tile), a TMA-able cache, key tiles inside a page.
    if kw.get("GLUON") and not (
        key[2] in _GLUON_DTYPES and key[3] >= GLUON_MIN_HEADS and key[5] and key[4] % kw["BLOCK_N"] == 0
    ):
        return False
    # Its e4m3-cache form (KV_FP8: 32-token tiles in a 2-deep ring fit shared memory beside the e4m3 ring) is a
    # trial variant until the H200 has checked and timed it: never what a key without a committed config runs.
    if (
        kw.get("GLUON")
        and key[2] == "bfloat16,e4m3"
        and (os.environ.get(TRIAL_ENV) != "1" or _gluon_variant(cfg)[:2] != (32, 2))
    ):
        return False
    # Beyond the first variant that fits the page, Gluon variants are candidates only where asked for (the bench
    # asks, and checks each against the reference): a key without a committed config autotunes by speed alone.
    if kw.get("GLUON") and _gluon_variant(cfg) != _gluon_first(key[4]) and os.environ.get(TRIAL_ENV) != "1":
        return False
    # A TMA tile must lie inside one page.
    return not (kw["USE_TMA"] and not (key[5] and key[4] % kw["BLOCK_N"] == 0))


_CONFIGS = ConfigTable(
    fallback=[_cfg(16, 32, 4, 2)],
    interpreter=_cfg(16, 16, 1, 1),
    by_arch={
        # The first kept config is the one a key without a committed config runs (no first-call tuning: a timing
        # of a few-microsecond call measures the host, not the kernel). 32 or more heads in bf16: the Gluon
        # kernel (64-token tiles, or 32 in a 4-deep ring for 32-token pages). 16 heads, or an e4m3 cache:
        # portable head tiles of 16 (two programs per SM), or 64 on 8 warps for 64 or more heads.
        9: [
            _cfg(64, 64, 8, 2, tma=True, per_sm=1, gluon=1),
            _cfg(64, 32, 8, 4, tma=True, per_sm=1, gluon=1),
            _cfg(16, 64, 4, 2),
            _cfg(64, 64, 8, 2, per_sm=1),
            _cfg(16, 32, 4, 3),
            _cfg(64, 64, 8, 2, tma=True, per_sm=1),
            _cfg(128, 32, 8, 2, split_dv=True, tma=True, per_sm=1),
            # Trial Gluon variants (TRIAL_ENV): a 3-deep ring of 32-token key tiles, scores issued early, and the
            # 2-deep ring of 32-token tiles (the only ring the e4m3-cache form fits).
            _cfg(64, 32, 8, 3, tma=True, per_sm=1, gluon=1),
            _cfg(64, 64, 8, 2, tma=True, per_sm=1, gluon=2),
            _cfg(64, 32, 8, 4, tma=True, per_sm=1, gluon=2),
            _cfg(64, 32, 8, 2, tma=True, per_sm=1, gluon=1),
            _cfg(64, 32, 8, 2, tma=True, per_sm=1, gluon=2),
        ]
    },
    keep=_keep,
)
_SPLIT = TunedKernel("mla_decode_split", _mla_decode_split_kernel, _CONFIGS, tune_first=1)


def gluon_variants(trial: bool = True) -> list[tuple[int, int, bool]]:
    """``(block_n, stages, early)`` of the sm_90 table's Gluon configs (with ``trial``, also those kept only
    under ``TRIAL_ENV``), in table order: what the tests compile and run and the bench sweeps."""
    seen: list[tuple[int, int, bool]] = []
    for cfg in _CONFIGS.by_arch[9]:
        v = _gluon_variant(cfg)
        if cfg.kwargs.get("GLUON") and v not in seen and (trial or v in (_GLUON_FIRST, _gluon_first(32))):
            seen.append(v)
    return seen


def _tma_layout_ok(kv_cache: torch.Tensor, d_v: int) -> bool:
    """Whether the cache can be read through 2-D descriptors (``mla_decode_gluon.tma_layout_ok``)."""
    from kvforge.kernels.mla_decode_gluon import tma_layout_ok

    return tma_layout_ok(kv_cache, d_v)


def _descriptors(kv_cache: torch.Tensor, block_n: int, d_v: int, d_r: int) -> tuple | None:
    """Host TMA descriptors over the cache as 2-D ``[pages * page_size, D]``, or None when the layout does not
    allow one (``_tma_layout_ok``) or Triton has no host-side descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    if not _tma_layout_ok(kv_cache, d_v):
        return None
    P, S, D = kv_cache.shape
    shape, strides = [P * S, D], [kv_cache.stride(1), 1]
    return (
        TensorDescriptor(kv_cache, shape, strides, [block_n, d_v // 2]),
        TensorDescriptor(kv_cache, shape, strides, [block_n, d_r]),
    )


def _check_args(
    q: object,
    kv_cache: object,
    block_table: object,
    seq_lens: object,
    softmax_scale: object,
    v_head_dim: object,
) -> tuple[int, int, int, int, int, int]:
    q = check_tensor("q", q, dtype=_FLOATS, ndim=3, last_dim_contiguous=True)
    check_launch_device("q", q)
    dev = q.device
    kv_dtypes = (q.dtype, FP8) if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    kv_cache = check_tensor("kv_cache", kv_cache, dtype=kv_dtypes, ndim=3, device=dev, last_dim_contiguous=True)
    block_table = check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=dev)
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        check_launch_device(name, t)
    if block_table.dim() == 2 and block_table.shape[-1] > 1 and block_table.stride(-1) != 1:
        raise ValueError(f"block_table: expected the last dimension contiguous, got strides {block_table.stride()}")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int):
        raise TypeError(f"v_head_dim: expected an int, got {type(v_head_dim).__name__}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {softmax_scale}")
    B, H, D = q.shape
    num_pages, page_size, D_kv = kv_cache.shape
    d_rope = D - v_head_dim
    if not (32 <= v_head_dim < D) or v_head_dim & (v_head_dim - 1) or d_rope < 16 or d_rope & (d_rope - 1):
        raise ValueError(
            f"v_head_dim: expected a power of two >= 32 below q's width {D} leaving a power-of-two rope part "
            f">= 16, got {v_head_dim} (576 = 512 + 64 for DeepSeek MLA)"
        )
    if D_kv != D:
        raise ValueError(f"kv_cache: expected rows as wide as q ({D}), got shape {list(kv_cache.shape)}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"kv_cache: expected a power-of-two page size, got {page_size}")
    if H < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    check_shape("block_table", block_table, (B, None))
    check_shape("seq_lens", seq_lens, (B,))
    return B, H, D, num_pages, page_size, block_table.shape[1]


def _check_values(block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int) -> None:
    max_pages = block_table.shape[1]
    cap = max_pages * page_size
    bad_len = (seq_lens < 0) | (seq_lens > cap)
    if bool(bad_len.any()):
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(
            f"seq_lens[{i}]: expected a value in [0, {cap}] (block_table width × page size), got {int(seq_lens[i])}"
        )
    if max_pages == 0:
        return
    used = torch.arange(max_pages, device=block_table.device)[None, :] * page_size < seq_lens[:, None].long()
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}]: expected a page id in [0, {num_pages}) for a page the request reads, "
            f"got {int(block_table[b, j])}"
        )


def config_key(q: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int = 512) -> tuple:
    """What the best launch configuration depends on: widths, dtypes (q's, and ``,e4m3`` for an FP8 cache), heads
    (rounded up to a power of two), page size and whether the cache layout allows TMA. Never batch size or
    lengths."""
    tma_ok = not interpreting() and _tma_layout_ok(kv_cache, v_head_dim)
    heads = max(16, 1 << max(0, q.shape[1] - 1).bit_length())  # host int math: triton.* helpers cost µs
    dtype = str(q.dtype).split(".")[-1] + (",e4m3" if kv_cache.dtype == FP8 else "")
    return (v_head_dim, q.shape[-1] - v_head_dim, dtype, heads, kv_cache.shape[1], tma_ok)


def default_num_splits(batch: int, head_tiles: int, max_tiles: int, sms: int, per_sm: int = 2) -> int:
    """Key shares per request for a batch of equal lengths: up to about one wave of programs (``per_sm``
    resident per SM), choosing the count whose programs fill the last wave best (with a wave of 264, 300
    programs leave most of a second wave idle)."""
    if isinstance(per_sm, bool) or not isinstance(per_sm, int) or per_sm < 1:
        raise ValueError(f"per_sm: expected an int >= 1, got {per_sm!r}")
    base = max(1, batch * head_tiles)
    slots = per_sm * sms
    best, best_eff = 1, 0.0
    for s in range(1, max(1, min(max_tiles, -(-slots // base))) + 1):
        progs = base * s
        eff = progs / (-(-progs // slots) * slots)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


MIN_SHARE_TOKENS = 128  # a key share shorter than this costs more in its partial and merge than it saves
# Candidate share sizes of the balanced split, in eighths added to the even share c0 (the first one rounds the
# share count down, the rest up): c0 itself, then 1/8, 1/4, 1/2, 1, 2 and 3 times larger.
SHARE_STEPS = (0, 0, 1, 2, 4, 8, 16, 24)


def _share_args(tiles: object, slots: object, head_progs: object, min_tiles: object, S: object = 1) -> list[int]:
    """Checks the share helpers' arguments (before any arithmetic): ``tiles`` a sequence of ints >= 0, the
    others ints, ``slots`` / ``head_progs`` / ``S`` >= 1, ``min_tiles`` >= 0. Returns ``tiles`` as a list."""
    for name, v, lo in (("slots", slots, 1), ("head_progs", head_progs, 1), ("min_tiles", min_tiles, 0), ("S", S, 1)):
        check_int(name, v, lo)
    if isinstance(tiles, (str, bytes)) or not hasattr(tiles, "__iter__"):
        raise TypeError(f"tiles: expected a sequence of ints, got {type(tiles).__name__}")
    return [check_int("tiles", t, 0) for t in tiles]


def _even_share_ref(tiles: list[int], slots: int, head_progs: int, min_tiles: int) -> int:
    """``_share_even``'s c0: ``max(min_tiles, ceil(sum(tiles) * head_progs / slots))``, at most 2**20."""
    return min(max(-(-sum(tiles) * head_progs // slots), min_tiles), 1 << 20)


def share_chunk_ref(tiles: list[int], S: int, slots: int, head_progs: int, min_tiles: int) -> tuple[int, bool]:
    """The balanced split's share size (host reference of ``_share_even`` + ``_share_pick``): ``(chunk, floor)``;
    request b then takes ``clamp(t_b // chunk if floor else ceil(t_b / chunk), 1, S)`` shares. ``tiles``: key
    tiles per request (lengths clamped to ``[0, max_len]``); ``slots``: programs resident at once;
    ``head_progs``: programs per (request, share). The even share ``c0 = max(min_tiles, ceil(sum(tiles) *
    head_progs / slots))`` rounded down (the split's first form) can leave a request of just under 2 c0 tiles in
    one share, twice the others' length; rounding up never does, but may spill past one wave. Each candidate
    (``SHARE_STEPS``) is costed as waves x (longest share + ``min_tiles``, a share's fixed cost in tiles): the
    rounded-down one's longest share exactly, a rounded-up one's as its bound ``max(min(longest request, c),
    ceil(longest request / S))``; the cheapest wins (ties: the earlier). Bad arguments raise ``TypeError`` /
    ``ValueError`` naming them."""
    tiles = _share_args(tiles, slots, head_progs, min_tiles, S)
    c0 = _even_share_ref(tiles, slots, head_progs, min_tiles)
    tmax = max(tiles, default=0)
    best: tuple[int, int, bool] | None = None
    for k, step in enumerate(SHARE_STEPS):
        c = min(c0 + -(-c0 * step // 8), 1 << 20)
        if k == 0:
            ns = [min(max(t // c, 1), S) for t in tiles]
            longest = max([-(-t // n) for t, n in zip(tiles, ns)], default=0)
        else:
            ns = [min(max(-(-t // c), 1), S) for t in tiles]
            longest = max(min(tmax, c), -(-tmax // S))
        cost = -(-min(sum(ns) * head_progs, 1 << 30) // slots) * (longest + min_tiles)
        if best is None or cost < best[0]:
            best = (cost, c, k == 0)
    assert best is not None
    return best[1], best[2]


PICK_MIN_BATCH = 8  # batches this large cost the share sizes (BALANCE 2); smaller ones round down (BALANCE 1)


def balance_mode(batch: int, head_progs: int, slots: int) -> int:
    """The split kernels' BALANCE for a split grid: 2 (cost the share sizes) from ``PICK_MIN_BATCH`` requests
    while the requests fill at most half a wave of ``slots`` programs, else 1 (the even share rounded down).
    Measured on the H200 (docs/kernels.md): the second pass pays on 16-64 mixed requests and costs 5-12% on
    1-4 requests and 3-9% on 256."""
    _share_args([], slots, head_progs, 0, 1)
    check_int("batch", batch, 0)
    return 2 if batch >= PICK_MIN_BATCH and 2 * batch * head_progs <= slots else 1


def share_counts_ref(tiles: list[int], S: int, slots: int, head_progs: int, min_tiles: int, mode: int) -> list[int]:
    """Key shares per request of the split kernels' ``BALANCE`` ``mode`` (host reference of ``_request_share``;
    ``tiles`` from lengths clamped to ``[0, max_len]``)."""
    tiles = _share_args(tiles, slots, head_progs, min_tiles, S)
    if isinstance(mode, bool) or mode not in (0, 1, 2):
        raise ValueError(f"mode: expected BALANCE 0, 1 or 2, got {mode!r}")
    if mode == 0:
        return [min(max(t, 1), S) for t in tiles]
    if mode == 1:
        c0 = _even_share_ref(tiles, slots, head_progs, min_tiles)
        return [min(max(t // c0, 1), S) for t in tiles]
    chunk, floor = share_chunk_ref(tiles, S, slots, head_progs, min_tiles)
    return [min(max(t // chunk if floor else -(-t // chunk), 1), S) for t in tiles]


def longest_first_ref(tiles: list[int]) -> list[int]:
    """The order ``_longest_first`` gives the split grid's request axis (ORDER): request indices by key tiles
    (lengths clamped to ``[0, max_len]``, then rounded up to tiles), most first, ties by index."""
    tiles = _share_args(tiles, 1, 1, 0)
    return sorted(range(len(tiles)), key=lambda b: (-tiles[b], b))


def order_requests(batch: int, head_progs: int, slots: int) -> bool:
    """Whether the split grid runs the batch longest first (ORDER): when its requests' first shares alone are
    more programs than ``slots`` run at once, the order the rest start in decides the critical path (a long
    request started last ends last); on fewer, every program starts at once and the ordering pass is waste."""
    _share_args([], slots, head_progs, 0, 1)
    check_int("batch", batch, 0)
    return batch * head_progs > slots


MERGE_PROGRAMS = 8192  # the merge grid's size past which a program takes several heads


def merge_heads(batch: int, heads: int, col_blocks: int) -> int:
    """Heads per program of the share merge (HB): 1 while ``batch x heads x col_blocks`` programs stay within
    ``MERGE_PROGRAMS``, else the smallest power of two that brings them there (at most the first one >= ``heads``).
    Every request has its programs, and those of a request with one share only read its count and leave, yet
    each still costs its launch: on a large batch of unsplit requests they were most of the call (the H200
    figures: docs/kernels.md, "One program's fixed cost")."""
    for name, v in (("batch", batch), ("heads", heads), ("col_blocks", col_blocks)):
        check_int(name, v, 1)
    hb = 1
    while batch * -(-heads // hb) * col_blocks > MERGE_PROGRAMS and hb < heads:
        hb *= 2
    return hb


def share_grid(batch: int, head_tiles: int, max_tiles: int, sms: int, per_sm: int, block_n: int) -> int:
    """The grid's share axis S when the shares are balanced on the device (``_request_share``): room for the
    longest request of a mixed batch to take several shares, about two waves of programs at most. 1 (every
    request one share, written straight to ``out``, no merge) when the keys are too short to split or the
    requests alone fill two waves."""
    min_tiles = max(1, MIN_SHARE_TOKENS // block_n)
    if max_tiles < 2 * min_tiles:
        return 1
    base = max(1, batch * head_tiles)
    return max(1, min(max_tiles // min_tiles, -(-2 * per_sm * sms // base), 65535))


def _cfg_id(cfg: triton.Config) -> tuple:
    return (tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages)


def _aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def _int_spec(ints: tuple[int, ...]) -> tuple[tuple[bool, bool, bool], ...]:
    """What Triton specialises an int argument on: equal to 1, a multiple of 16, wider than 32 bits."""
    return tuple((v == 1, v % 16 == 0, not -(2**31) <= v < 2**31) for v in ints)


_MERGE_CFG = triton.Config({"CH": 8}, num_warps=2, num_stages=1)
_DMERGE = TunedKernel("mla_decode_merge", _decode_merge_kernel,
                      ConfigTable(fallback=[_MERGE_CFG], interpreter=_MERGE_CFG))  # fmt: skip

# Per-device error flags of the checked default call: int32 [2], [0] a length out of range, [1] a page id out of
# range (set to 1 by the kernel; never cleared by it).
_ERROR_FLAGS: dict[tuple[str, int | None], torch.Tensor] = {}
_FLAG_NAMES = ("seq_lens: a length outside [0, block_table width x page size]",
               "block_table: a page id outside [0, num_pages) for a page a request reads")  # fmt: skip


def _dev_key(device: torch.device) -> tuple[str, int | None]:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def decode_error_flags(device: torch.device | str | None = None) -> torch.Tensor:
    """The device's error flags that ``mla_decode_attention``'s default (checked) call sets when no
    ``error_flag`` is given: int32 ``[2]``, element 0 for a length out of range, 1 for a page id out of range.
    Reading them is the caller's choice (a device->host read); ``raise_decode_errors`` reads, clears and raises.
    Created (zeroed) on first use: make one call, or call this, before capturing a CUDA graph."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    key = _dev_key(dev)
    flags = _ERROR_FLAGS.get(key)
    if flags is None:
        flags = _ERROR_FLAGS.setdefault(key, torch.zeros(2, dtype=torch.int32, device=dev))
    return flags


def raise_decode_errors(error_flag: torch.Tensor | torch.device | str | None = None) -> None:
    """Read (one device->host read) and clear an error flag tensor (or the device's ``decode_error_flags``);
    raise ValueError naming what the kernel found since the last clear, if anything."""
    flags = error_flag if isinstance(error_flag, torch.Tensor) else decode_error_flags(error_flag)
    seen = flags[:2].tolist()
    flags.zero_()
    found = [name for name, v in zip(_FLAG_NAMES, seen) if v]
    if found:
        raise ValueError("mla_decode_attention: " + "; ".join(found) + " (those requests' outputs are NaN)")


class _State:
    """A plan's launch state, filled by its first launches; holds no caller tensor: the split and merge kernels'
    direct launchers, the Gluon call's prep (``mla_decode_gluon.SplitPrep``), the fields of the portable
    kernel's TMA descriptors (checked once; a later call's cache has the plan's shape, strides and alignment),
    and views of the device buffers (``_kept``) its launches use: per stream the fused merge's arrival
    counters, and the lse sink a replayed call not asked for its lse writes into."""

    __slots__ = ("counters", "gluon", "lse_sink", "merge", "split", "tma")

    def __init__(self, gluon_prep: object | None) -> None:
        self.counters: dict[int, torch.Tensor] = {}  # per stream: the fused merge's arrival counters (zero)
        self.split: DirectLaunch | None = None
        self.merge: DirectLaunch | None = None
        self.gluon = gluon_prep
        self.tma: tuple | None = None
        self.lse_sink: torch.Tensor | None = None


# Device buffers a CUDA graph may have captured: never freed (a plan is dropped from ``_PLANS`` while a graph
# that captured its launch still writes these addresses). One per (device, stream, use), grown by replacing it
# with one twice as large; the outgrown ones stay in ``_KEPT_OLD``. Bounded by the largest batch seen.
_KEPT: dict[tuple, torch.Tensor] = {}
_KEPT_OLD: list[torch.Tensor] = []
_KEPT_LOCK = threading.Lock()


def _kept(device: torch.device, stream: int, use: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` elements of the never-freed, zero-initialised buffer for (device, stream, use)."""
    key = (device, stream, use)
    buf = _KEPT.get(key)
    if buf is None or buf.numel() < n:
        with _KEPT_LOCK:
            buf = _KEPT.get(key)
            if buf is None or buf.numel() < n:
                grown = torch.zeros(max(n, 2 * buf.numel() if buf is not None else 0), dtype=dtype, device=device)
                if buf is not None:
                    _KEPT_OLD.append(buf)
                _KEPT[key] = buf = grown
    return buf[:n]


def _lse_sink(plan: _Plan, device: torch.device) -> torch.Tensor:
    """``[B, H]`` fp32 that the plan's replayed calls without ``return_lse`` pass as ``lse``: the kernels only
    write it and nothing reads it, so every plan and stream on a device shares one (an allocation fewer per
    call)."""
    sink = plan.state.lse_sink
    if sink is None:
        sink = plan.state.lse_sink = _kept(device, 0, "lse", plan.B * plan.H, torch.float32).view(plan.B, plan.H)
    return sink


class _Plan(NamedTuple):
    """A checked call's launch, keyed by its tensors' metadata (``_PLANS``); holds no caller tensor."""

    kernel: TunedKernel  # the module's TunedKernel when planned (tests swap it)
    memo: tuple  # (arch, config key): the plan is stale once another config is chosen for it
    cfg: triton.Config
    key: tuple
    spec: tuple
    consts: tuple
    ints: tuple  # H and the specialised strides, in kernel order
    rt: tuple  # the do_not_specialize ints, in kernel order
    grid: tuple[int, int, int]
    scale_log2: float
    kv_scale: float
    B: int
    H: int
    v_head_dim: int
    d_r: int
    num_pages: int
    page_size: int
    direct: bool
    gluon: tuple | None  # mla_decode_gluon's (block_n, stages, early) instead of the portable split kernel
    merge: tuple | None  # (grid, spec, consts) of the share merge when S > 1 and the split kernel does not merge
    strict: bool
    flags: torch.Tensor  # the module's per-device error flags (not a caller tensor)
    check: bool
    balance: int  # the split kernels' BALANCE (0 none, 1 even share rounded down, 2 costed share sizes)
    order: bool  # the split kernels' ORDER (the request axis runs the batch longest first)
    fp8_bytes: bool
    scratch: tuple[int, int, int]  # fp32 elements of the one scratch buffer; offsets of partial_lse and nshare
    merge_ints: tuple  # H and the merge kernel's strides, in kernel order
    fused: bool  # S > 1 and the split kernel merges (FUSED_MERGE): the scratch's nshare is its arrival counters
    state: _State


_PLANS = PlanCache(maxsize=256)  # an engine step calls once per layer (61 in DeepSeek-V3), each its own cache


def _scratch_layout(B: int, H: int, S: int, dv: int) -> tuple[int, int, int]:
    """partial [B, H, S, dv] fp32, partial_lse [B, H, S] fp32 and nshare [B] int32 in one fp32 buffer: (elements,
    offset of partial_lse, offset of nshare), each part starting 16-byte aligned (dv is a multiple of 4)."""
    if S <= 1:
        return 0, 0, 0
    o_pl = B * H * S * dv
    o_ns = o_pl + -(-(B * H * S) // 4) * 4
    return o_ns + -(-B // 4) * 4, o_pl, o_ns


def _scratch_views(buf: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, S, dv = plan.B, plan.H, plan.grid[2], plan.v_head_dim
    _, o_pl, o_ns = plan.scratch
    return (buf[: o_pl].view(B, H, S, dv), buf[o_pl : o_pl + B * H * S].view(B, H, S),
            buf[o_ns : o_ns + B].view(torch.int32))  # fmt: skip


def _ready(plan: _Plan) -> bool:
    """Whether this plan's launches take the compiled kernels' launchers directly (so the scratch pointers may be
    raw device addresses): both launchers known, no launch hook set, their device current."""
    st = plan.state
    if plan.merge is not None and st.merge is None:
        return False
    if plan.gluon is not None:
        return st.gluon is not None and st.gluon.ready()
    d = st.split
    return d is not None and plan.direct and not hooks_active() and d.current_device() == d.device


def _tma_descs(plan: _Plan, kv_cache: torch.Tensor) -> tuple:
    st = plan.state
    if st.tma is not None:
        return tuple(clone_descriptor(cls, fields, kv_cache) for cls, fields in st.tma)
    kw = plan.cfg.kwargs
    descs = _descriptors(kv_cache, kw["BLOCK_N"], plan.v_head_dim, plan.d_r)
    if descs is None:
        raise ValueError("kv_cache: this launch configuration needs a TMA-able cache layout")
    fields = [getattr(d, "__dict__", None) for d in descs]
    if all(f is not None for f in fields):
        st.tma = tuple((type(d), {k: v for k, v in f.items() if k != "base"}) for d, f in zip(descs, fields))
    return descs


def _launch(
    plan: _Plan,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    err: torch.Tensor,
    scale_t: torch.Tensor | None,
    fast: bool = True,
    scratch: tuple | None = None,
) -> None:
    """The split kernel (requests with one share write ``out``/``lse``), then the merge of the others. The
    partials live in one fresh buffer (``scratch``: a ``MLADecodePlan``'s own, as (views, addresses)); once both
    kernels' launchers are known they are launched directly, the scratch passed as raw addresses."""
    st = plan.state
    ready = fast and _ready(plan)
    if plan.scratch[0]:
        if scratch is not None:
            partial, partial_lse, nshare = scratch[1] if ready else scratch[0]
        else:
            buf = torch.empty(plan.scratch[0], dtype=torch.float32, device=q.device)
            if ready:  # addresses instead of views: each view is a torch op on the host
                p = buf.data_ptr()
                partial, partial_lse, nshare = p, p + 4 * plan.scratch[1], p + 4 * plan.scratch[2]
            else:
                partial, partial_lse, nshare = _scratch_views(buf, plan)
            if plan.fused:
                nshare = _counters(plan, q.device)
    else:  # never written (every request has one share): placeholders of the same dtypes
        partial, partial_lse, nshare = lse, lse, seq_lens
    scale_ptr = scale_t if scale_t is not None else lse
    if plan.gluon is not None:
        from kvforge.kernels import mla_decode_gluon

        bn, stages, early = plan.gluon
        mla_decode_gluon.mla_decode_gluon_split(
            q, kv_cache, block_table, seq_lens, partial, partial_lse, out, lse, nshare, err, rt=plan.rt,
            scale_log2=plan.scale_log2 * plan.kv_scale, v_head_dim=plan.v_head_dim, block_n=bn, stages=stages,
            early=early, check=plan.check, balance=plan.balance, splits=plan.grid[2], order=plan.order,
            prep=st.gluon if fast else None, direct=ready, v_scale=plan.kv_scale, merge=plan.fused,
        )  # fmt: skip
    else:
        if plan.cfg.kwargs["USE_TMA"]:
            desc_h, desc_r = _tma_descs(plan, kv_cache)
        else:
            desc_h = desc_r = kv_cache
        grid = plan.grid
        if ready:  # an e4m3 cache read as bytes (FP8_BYTES) is the same address: the launcher takes the pointer
            d = st.split
            d.run(grid[0], grid[1], grid[2], d.current_stream(d.device), d.function, d.packed_metadata, None, None,
                  None, q, kv_cache, desc_h, desc_r, block_table, seq_lens, partial, partial_lse, out, lse, nshare,
                  err, scale_ptr, *plan.ints, *plan.rt, plan.scale_log2, plan.kv_scale, *d.consts)  # fmt: skip
        else:
            kv = kv_cache.view(torch.uint8) if plan.fp8_bytes else kv_cache
            args = (q, kv, desc_h, desc_r, block_table, seq_lens, partial, partial_lse, out, lse, nshare, err,
                    scale_ptr, *plan.ints, *plan.rt, plan.scale_log2, plan.kv_scale)  # fmt: skip
            if fast and plan.direct:
                plan.kernel.launch_fast(lambda meta: grid, plan.key, plan.spec, args, **dict(plan.consts))
                if st.split is None:
                    st.split = plan.kernel.direct(plan.spec)
            else:
                cfg = plan.cfg
                _mla_decode_split_kernel[grid](*args, **dict(plan.consts), **{"PER_SM": 2, "GLUON": 0, **cfg.kwargs},
                                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    if plan.merge is not None:
        mgrid, mspec, mconsts = plan.merge
        if ready:
            d = st.merge
            d.run(mgrid[0], mgrid[1], mgrid[2], d.current_stream(d.device), d.function, d.packed_metadata, None,
                  None, None, partial, partial_lse, nshare, out, lse, *plan.merge_ints, *d.consts)  # fmt: skip
        else:
            margs = (partial, partial_lse, nshare, out, lse, *plan.merge_ints)
            _DMERGE.launch_fast(lambda meta: mgrid, ("merge",), mspec, margs, **dict(mconsts))
            if fast and st.merge is None:
                st.merge = _DMERGE.direct(mspec)


def _new_counters(plan: _Plan, device: torch.device) -> torch.Tensor:
    """A zeroed set of the fused merge's arrival counters: the split kernels index them
    ``(request * programs per request + program column) * 2 + half``."""
    return torch.zeros(2 * plan.grid[0] * plan.B, dtype=torch.int32, device=device)


def _counters(plan: _Plan, device: torch.device) -> torch.Tensor:
    """The fused merge's arrival counters for the current stream: zero before and after each launch, so the
    plans whose launches a stream orders share one set (``_kept``); launches on different streams never do."""
    st = plan.state
    f = st.gluon.fast if st.gluon is not None else None
    if f is not None:
        stream = f[4](f[2])
    else:
        stream = current_stream_handle(device)
    c = st.counters.get(stream)
    if c is None:
        c = st.counters.setdefault(stream, _kept(device, stream, "counters", 2 * plan.grid[0] * plan.B, torch.int32))
    return c


def _check_scale(kv_scale_quant_orig: object, kv_cache: torch.Tensor) -> tuple[int, float, torch.Tensor | None]:
    """(SCALE_MODE, float scale, device scale tensor) for the cache's dequantisation."""
    sc = kv_scale_quant_orig
    if kv_cache.dtype != FP8:
        if sc is not None:
            raise ValueError(f"kv_scale_quant_orig: only an e4m3 kv_cache takes a scale, got a {kv_cache.dtype} cache")
        return 0, 1.0, None
    if sc is None:
        return 1, 1.0, None
    if isinstance(sc, torch.Tensor):
        if sc.dtype != torch.float32:
            raise TypeError(f"kv_scale_quant_orig: expected a float32 tensor, got {sc.dtype}")
        if sc.numel() != 1:
            raise ValueError(f"kv_scale_quant_orig: expected a 1-element tensor, got shape {tuple(sc.shape)}")
        if not same_device(sc.device, kv_cache.device):
            raise ValueError(f"kv_scale_quant_orig: expected a tensor on {kv_cache.device}, got one on {sc.device}")
        check_launch_device("kv_scale_quant_orig", sc)
        return 2, 1.0, sc
    if isinstance(sc, bool) or not isinstance(sc, (int, float)):
        raise TypeError(f"kv_scale_quant_orig: expected a float or a 1-element fp32 tensor, got {type(sc).__name__}")
    if not (math.isfinite(sc) and sc > 0):
        raise ValueError(f"kv_scale_quant_orig: expected a finite scale > 0, got {sc}")
    return 1, float(sc), None


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    v_head_dim: int = 512,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    check_values: bool | str = True,
    error_flag: torch.Tensor | None = None,
    kv_scale_quant_orig: float | torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q [B, H, D_qk]`` over the paged latent cache; returns ``out [B, H, v_head_dim]``
    (q's dtype) and, with ``return_lse``, ``lse [B, H]`` fp32. ``out``/``lse`` buffers are written when given.

    ``check_values``: True (default) checks lengths and page ids on the device, without a device->host read: a
    request with a length outside ``[0, block_table width x page size]`` or a page id outside ``[0, num_pages)``
    among the pages it reads gets NaN in ``out`` and ``lse``, nothing is read out of bounds, and element 0
    (length) or 1 (page id) of ``error_flag`` (int32, >= 2 elements; default ``decode_error_flags(device)``) is
    set to 1; ``raise_decode_errors`` reads, clears and raises. ``"strict"`` checks on the host first (one
    device->host read) and raises ValueError naming the argument and the first bad entry. False: no check.
    ``kv_scale_quant_orig`` (float or 1-element fp32 device tensor, default 1.0) dequantises an e4m3 cache."""
    try:
        pkey = (
            tensor_key(q), tensor_key(kv_cache), tensor_key(block_table), tensor_key(seq_lens),
            None if out is None else tensor_key(out), None if lse is None else tensor_key(lse),
            type(softmax_scale), softmax_scale, type(v_head_dim), v_head_dim, type(num_splits), num_splits,
            type(return_lse), type(check_values), check_values,
            None if error_flag is None else tensor_key(error_flag),
            tensor_key(kv_scale_quant_orig) if isinstance(kv_scale_quant_orig, torch.Tensor)
            else (type(kv_scale_quant_orig), kv_scale_quant_orig),
        )  # fmt: skip
        plan = _PLANS.get(pkey)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the checked path says which
        pkey, plan = None, None
    if plan is not None and plan.kernel is _SPLIT and _SPLIT._chosen.get(plan.memo) is plan.cfg:
        # Same tensors (address, shape, strides, dtype, device) and arguments as an earlier checked call.
        if plan.strict:
            _check_values(block_table, seq_lens, plan.num_pages, plan.page_size)
        if out is None:
            out = torch.empty((plan.B, plan.H, plan.v_head_dim), dtype=q.dtype, device=q.device)
        if lse is None:
            lse = _lse_sink(plan, q.device) if not return_lse else torch.empty(
                (plan.B, plan.H), dtype=torch.float32, device=q.device)  # fmt: skip
        scale_t = kv_scale_quant_orig if isinstance(kv_scale_quant_orig, torch.Tensor) else None
        _launch(plan, q, kv_cache, block_table, seq_lens, out, lse, plan.flags if error_flag is None else error_flag,
                scale_t)  # fmt: skip
        return (out, lse) if return_lse else out
    plan, out, lse, err, scale_t = _plan_call(q, kv_cache, block_table, seq_lens, softmax_scale, v_head_dim, out,
                                              lse, return_lse, num_splits, check_values, error_flag,
                                              kv_scale_quant_orig)  # fmt: skip
    if plan is not None:
        _launch(plan, q, kv_cache, block_table, seq_lens, out, lse, err, scale_t)
        if pkey is not None:
            _PLANS.put(pkey, plan)
    return (out, lse) if return_lse else out


def _plan_call(
    q: object,
    kv_cache: object,
    block_table: object,
    seq_lens: object,
    softmax_scale: object,
    v_head_dim: object,
    out: object,
    lse: object,
    return_lse: object,
    num_splits: object,
    check_values: object,
    error_flag: object,
    kv_scale_quant_orig: object,
) -> tuple[_Plan | None, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every host check of ``mla_decode_attention`` (raising before anything launches), ``out``/``lse`` allocated
    when not given, the launch configuration chosen: ``(plan or None when B == 0, out, lse, error flag, device
    scale tensor)``."""
    B, H, D, num_pages, page_size, max_pages = _check_args(
        q, kv_cache, block_table, seq_lens, softmax_scale, v_head_dim
    )
    dev = q.device
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if not (isinstance(check_values, bool) or check_values == "strict"):
        raise TypeError(f"check_values: expected True, False or 'strict', got {check_values!r:.40}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if num_splits is not None and not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits: expected a value in [1, 65535], got {num_splits}")
    scale_mode, kv_scale, scale_t = _check_scale(kv_scale_quant_orig, kv_cache)
    if out is None:
        out = torch.empty((B, H, v_head_dim), dtype=q.dtype, device=dev)
    else:
        check_tensor("out", out, dtype=q.dtype, ndim=3, device=dev, last_dim_contiguous=True)
        check_launch_device("out", out)
        check_shape("out", out, (B, H, v_head_dim))
    if lse is None:
        lse = torch.empty((B, H), dtype=torch.float32, device=dev)
    else:
        check_tensor("lse", lse, dtype=torch.float32, ndim=2, device=dev)
        check_launch_device("lse", lse)
        check_shape("lse", lse, (B, H))
    if error_flag is not None:
        check_tensor("error_flag", error_flag, dtype=torch.int32, device=dev, contiguous=True)
        check_launch_device("error_flag", error_flag)
        if error_flag.numel() < 2:
            raise ValueError(f"error_flag: expected at least 2 elements, got shape {tuple(error_flag.shape)}")
    check_no_overlap(
        {"out": out, "lse": lse, "error_flag": error_flag},
        {
            "q": q,
            "kv_cache": kv_cache,
            "block_table": block_table,
            "seq_lens": seq_lens,
            "kv_scale_quant_orig": scale_t,
        },
    )
    if B > 65535:
        raise ValueError(f"q: expected at most 65535 requests per call, got {B}")
    strict = check_values == "strict"
    if strict:
        _check_values(block_table, seq_lens, num_pages, page_size)
    if B == 0:
        return None, out, lse, None, scale_t
    flags = decode_error_flags(dev)
    err = flags if error_flag is None else error_flag
    d_r = D - v_head_dim
    key = config_key(q, kv_cache, v_head_dim)
    upcast = interpreting() and q.dtype == torch.bfloat16
    # fp32 inputs get fp32 products (a GPU's default for fp32 tl.dot is TF32, about 1e-3 relative error).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    sms = num_sms(dev)
    check = check_values is True
    max_len = max_pages * page_size
    # An e4m3 cache on a GPU: before sm_89 Triton has no e4m3 type, so the kernel decodes the cache's bytes itself;
    # from sm_89 the tile widens where it was loaded (_e4m3_to_f16_pinned), not inside the dot operands.
    cap = device_capability(dev)
    fp8_gpu = kv_cache.dtype == FP8 and not interpreting() and cap is not None
    fp8_bytes = fp8_gpu and cap < (8, 9)
    fp8_pin = fp8_gpu and not fp8_bytes

    def make_plan(cfg: triton.Config) -> _Plan:
        kw = cfg.kwargs
        gluon = None
        if kw.get("GLUON"):
            from kvforge.kernels.mla_decode_gluon import BLOCK_H, SplitPrep, gluon_decode_reason

            variant = _gluon_variant(cfg)
            bn, stages, _ = variant
            if gluon_decode_reason(q, kv_cache, page_size, v_head_dim, d_r, bn, stages,
                                   scale_tensor=scale_t is not None) is None:  # fmt: skip
                gluon = variant  # its own head tile and key tile, one program per SM
                kw = {**kw, "BLOCK_H": BLOCK_H, "BLOCK_N": bn, "SPLIT_DV": False, "PER_SM": 1}
        bn = kw["BLOCK_N"]
        programs_per_request = -(-H // kw["BLOCK_H"]) * (2 if kw["SPLIT_DV"] else 1)
        max_tiles = max(1, -(-max_len // bn))
        per_sm = int(kw.get("PER_SM", 2))
        if num_splits is None:
            splits = share_grid(B, programs_per_request, max_tiles, sms, per_sm, bn)
            # Costing the share sizes pays where a mixed batch can leave one request of just under two even
            # shares in one; on small and large batches its second pass measured slower than it saves.
            balance = balance_mode(B, programs_per_request, per_sm * sms) if splits > 1 else 0
        else:
            splits, balance = min(num_splits, max_tiles), 0
        order = order_requests(B, programs_per_request, per_sm * sms)
        fused = 1 < splits <= FUSED_MAX_SHARES and FUSED_MERGE
        ints = (H, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
                H * splits * v_head_dim, splits * v_head_dim, v_head_dim)  # fmt: skip
        merge_ints = (H, H * splits * v_head_dim, splits * v_head_dim, v_head_dim, H * splits, splits, out.stride(0),
                      out.stride(1), lse.stride(0), lse.stride(1))  # fmt: skip
        rt = (B, splits, max_len, max(1, MIN_SHARE_TOKENS // bn), per_sm * sms, num_pages, H * splits, splits,
              out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))  # fmt: skip
        consts = (("PAGE_SIZE", page_size), ("D_V", v_head_dim), ("D_R", d_r), ("UPCAST", upcast),
                  ("PRECISION", precision), ("CHECK", check), ("BALANCE", balance),
                  ("SCALE_MODE", scale_mode), ("FP8_BYTES", fp8_bytes), ("FP8_PIN", fp8_pin),
                  ("ORDER", order), ("MERGE", fused))  # fmt: skip
        # Everything Triton specialises the compiled kernel on (the rt ints are do_not_specialize): a repeat
        # call launches the cached kernel directly.
        ptrs = (q, kv_cache, block_table, seq_lens, out, lse, err, lse if scale_t is None else scale_t)
        spec = (key, _cfg_id(cfg), q.dtype, kv_cache.dtype, _aligned(*ptrs), _int_spec(ints), consts, splits > 1)
        merge = None
        if splits > 1 and not fused:
            bs = 1 << max(0, splits - 1).bit_length()
            bd = min(MERGE_BLOCK_D, v_head_dim)  # a power of two
            hb = merge_heads(B, H, v_head_dim // bd)
            mconsts = (("BLOCK_S", bs), ("BLOCK_D", bd), ("HB", hb))
            mgrid = (B, -(-H // hb), v_head_dim // bd)
            merge = (mgrid, (v_head_dim, out.dtype, _aligned(out, lse), bs, bd, hb), mconsts)
        return _Plan(
            _SPLIT, (arch_name(device_capability(dev)), key), cfg, key, spec, consts, ints, rt,
            (programs_per_request, B, splits), float(softmax_scale) * 1.4426950408889634, kv_scale,
            B, H, v_head_dim, d_r, num_pages, page_size,
            # a config naming every constexpr (what the direct launch passes); an older table's may not
            "PER_SM" in kw and "GLUON" in kw, gluon, merge, strict, flags, check, balance, order, fp8_bytes,
            _scratch_layout(B, H, splits, v_head_dim), merge_ints, fused, _State(SplitPrep() if gluon else None),
        )  # fmt: skip

    # Tuned once per key on a GPU without a committed config (idempotent: it writes only out, lse and partials).
    cfg = _SPLIT.config_for(
        key, lambda c: _launch(make_plan(c), q, kv_cache, block_table, seq_lens, out, lse, err, scale_t, False)
    )
    return make_plan(cfg), out, lse, err, scale_t


class MLADecodePlan:
    """``mla_decode_attention`` planned once per batch, run per layer: ``plan = MLADecodePlan(q, kv_cache,
    block_table, seq_lens, softmax_scale=...)``, then ``plan.run(q, kv_cache)`` for each layer's q and cache.

    The constructor takes the call's arguments (q and kv_cache as examples of every layer's) and does all of the
    one call's host work once: every argument check (the same errors, raised here), the launch configuration,
    the key-share grid, a scratch buffer for the partial results (``[B, H, shares, v_head_dim]`` fp32 at most)
    and an lse buffer for runs that do not ask for lse, both owned by the plan and reused by every run (so runs
    of one plan must stay on one stream). It keeps ``block_table`` and ``seq_lens`` (their contents are read on
    the device at each run, so an engine may update them in place). ``run`` takes any q and cache with the
    planned shape, strides, dtype, device and 16-byte alignment (ValueError naming the argument otherwise),
    checks ``out``/``lse`` when given (contiguous, not overlapping an input), and launches; it does not
    synchronise and is graph-capturable. ``check_values`` and ``error_flag`` as in ``mla_decode_attention``;
    ``"strict"`` checks the lengths and page ids on the host at every run.
    """

    def __init__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        softmax_scale: float,
        v_head_dim: int = 512,
        num_splits: int | None = None,
        check_values: bool | str = True,
        error_flag: torch.Tensor | None = None,
        kv_scale_quant_orig: float | torch.Tensor | None = None,
    ) -> None:
        plan, out, lse, err, scale_t = _plan_call(q, kv_cache, block_table, seq_lens, softmax_scale, v_head_dim, None,
                                                  None, False, num_splits, check_values, error_flag,
                                                  kv_scale_quant_orig)  # fmt: skip
        self._plan = plan
        self._meta = (_layout(q), _layout(kv_cache))
        self._out = (tuple(out.shape), out.stride(), out.dtype)
        self._lse = (tuple(lse.shape), lse.stride())
        # Bytes each tensor spans from its address (planned layouts; out and lse contiguous).
        self._q_bytes, self._kv_bytes = (_span_bytes(t) for t in (q, kv_cache))
        self._out_bytes, self._lse_bytes = out.numel() * out.element_size(), lse.numel() * 4
        self._lse_own = lse
        self._device = q.device
        self.block_table = block_table
        self.seq_lens = seq_lens
        self._err = err
        self._scale_t = scale_t
        self._scratch: tuple | None = None
        if plan is not None and plan.scratch[0]:
            buf = torch.empty(plan.scratch[0], dtype=torch.float32, device=q.device)
            p = buf.data_ptr()
            views = _scratch_views(buf, plan)
            addrs = (p, p + 4 * plan.scratch[1], p + 4 * plan.scratch[2])
            if plan.fused:  # the plan's own arrival counters (its runs stay on one stream)
                cnt = _new_counters(plan, q.device)
                views, addrs = (*views[:2], cnt), (*addrs[:2], cnt.data_ptr())
            self._scratch = (views, addrs)

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of this ``q`` over this ``kv_cache`` with the planned table and lengths; returns
        ``out [B, H, v_head_dim]`` (and ``lse [B, H]`` fp32 with ``return_lse``), written into ``out``/``lse``
        when given (contiguous, q's dtype / fp32)."""
        for name, t, want in (("q", q, self._meta[0]), ("kv_cache", kv_cache, self._meta[1])):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            got = _layout(t)
            if got != want:
                raise ValueError(
                    f"{name}: expected the planned shape, strides, dtype, device and 16-byte alignment "
                    f"{_show(want)}, got {_show(got)}"
                )
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
        plan = self._plan
        shape, strides, dtype = self._out
        given = out is not None or lse is not None
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self._device)
        else:
            self._check_buffer("out", out, shape, strides, dtype)
        if lse is None:
            # Not asked for: the plan's own (the kernels only write it), so a run with out given allocates nothing.
            lse = self._lse_own if not return_lse else torch.empty(self._lse[0], dtype=torch.float32,
                                                                   device=self._device)  # fmt: skip
        else:
            self._check_buffer("lse", lse, self._lse[0], self._lse[1], torch.float32)
        if plan is None:  # no requests
            return (out, lse) if return_lse else out
        o0, l0 = out.data_ptr(), lse.data_ptr()
        if o0 % 16 or l0 % 16:  # the launch spec was made for 16-byte aligned outputs
            raise ValueError("out: expected out and lse 16-byte aligned (as the planned outputs)")
        bt, sl = self.block_table, self.seq_lens
        if given:
            # Byte ranges first (q and the cache have the planned layouts, out and lse are contiguous): only when
            # two meet does check_no_overlap compare them exactly (and name them).
            outs = ((o0, o0 + self._out_bytes), (l0, l0 + self._lse_bytes))
            ins = [(q.data_ptr(), self._q_bytes), (kv_cache.data_ptr(), self._kv_bytes)]
            ins = [(p, p + n) for p, n in ins] + [s for s in (byte_span(bt), byte_span(sl), self._err_span()) if s]
            if (outs[0][0] < outs[1][1] and outs[1][0] < outs[0][1]) or any(
                lo < ihi and ilo < hi for lo, hi in outs for ilo, ihi in ins
            ):
                check_no_overlap({"out": out, "lse": lse, "error_flag": self._err},
                                 {"q": q, "kv_cache": kv_cache, "block_table": bt, "seq_lens": sl,
                                  "kv_scale_quant_orig": self._scale_t})  # fmt: skip
        if plan.strict:
            _check_values(bt, sl, plan.num_pages, plan.page_size)
        _launch(plan, q, kv_cache, bt, sl, out, lse, self._err, self._scale_t, scratch=self._scratch)
        return (out, lse) if return_lse else out

    def _err_span(self) -> tuple[int, int] | None:
        return None if self._err is None else byte_span(self._err)

    def _check_buffer(self, name: str, t: object, shape: tuple, strides: tuple, dtype: torch.dtype) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.device != self._device and not same_device(t.device, self._device):
            raise ValueError(f"{name}: expected a tensor on {self._device}, got one on {t.device}")
        if t.shape != shape or t.stride() != strides:
            raise ValueError(f"{name}: expected a contiguous tensor of shape {list(shape)}, got shape "
                             f"{list(t.shape)} with strides {t.stride()}")  # fmt: skip


def _span_bytes(t: torch.Tensor) -> int:
    span = byte_span(t)
    return 0 if span is None else span[1] - span[0]


def _layout(t: torch.Tensor) -> tuple:
    """What a planned run's tensor must share with the planned one: shape, strides, dtype, device, alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _show(layout: tuple) -> str:
    shape, strides, dtype, device, aligned = layout
    return f"{list(shape)} strides {strides} {dtype} on {device}{'' if aligned else ' (unaligned)'}"


# The rows' stride is specialised (fixed per model): a per-call stride would make every row load one element.
@triton.jit(do_not_specialize=["n_rows", "n_slots", "scale_val"])
def _store_latent_kernel(rows_ptr, slot_ptr, cache_ptr, scale_ptr, scale_val, n_rows, n_slots, s_row, s_page,
                         s_tok, PAGE_SIZE: tl.constexpr, D: tl.constexpr, FP8_OUT: tl.constexpr,
                         SCALE_IS_PTR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         NATIVE: tl.constexpr = False):  # fmt: skip
    """Row r goes to slot ``slots[r]`` (page ``slot // PAGE_SIZE``, token ``slot % PAGE_SIZE``); a slot outside
    ``[0, n_slots)`` (-1 marks padding) is skipped. FP8_OUT: ``e4m3(x * scale)`` stored as bytes
    (``fp32_to_e4m3_byte``: the hardware conversion where ``NATIVE``, else the integer encoder; the same bytes)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    slot = tl.load(slot_ptr + r, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0) & (slot < n_slots)
    dst = (slot // PAGE_SIZE) * s_page + (slot % PAGE_SIZE) * s_tok
    if SCALE_IS_PTR:
        scale_val = tl.load(scale_ptr)
    for c0 in tl.static_range(0, D, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (cols < D)[None, :]
        x = tl.load(rows_ptr + r.to(tl.int64)[:, None] * s_row + cols[None, :], mask=m, other=0.0)
        if FP8_OUT:
            y = fp32_to_e4m3_byte(x.to(tl.float32) * scale_val, NATIVE)
        else:
            y = x.to(cache_ptr.dtype.element_ty)
        tl.store(cache_ptr + dst[:, None] + cols[None, :], y, mask=m)


_STORE_CFG = triton.Config({"BLOCK_R": 8, "BLOCK_D": 128}, num_warps=4, num_stages=1)
_STORE = TunedKernel(
    "mla_store_latent", _store_latent_kernel, ConfigTable(fallback=[_STORE_CFG], interpreter=_STORE_CFG)
)


def store_latent_rows(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    *,
    kv_scale_orig_quant: float | torch.Tensor | None = None,
) -> None:
    """Write new latent rows into the paged cache: ``rows [N, D]`` (bf16/fp16/fp32) to slots ``slots [N]``
    (int32/int64, slot = page * page_size + token; a slot outside ``[0, pages * page_size)``, e.g. -1 for
    padding, is skipped). An e4m3 cache stores ``e4m3(row * kv_scale_orig_quant)`` (round to nearest even,
    saturating at ±448; the scale a float or a 1-element fp32 device tensor, default 1.0), what
    ``mla_decode_attention`` reads back with ``kv_scale_quant_orig = 1 / kv_scale_orig_quant``; a 16/32-bit
    cache stores the rows cast to its dtype (no scale allowed). No device->host read: graph-capturable."""
    kv_cache = check_tensor("kv_cache", kv_cache, dtype=(FP8, *_FLOATS), ndim=3, last_dim_contiguous=True)
    check_launch_device("kv_cache", kv_cache)
    dev = kv_cache.device
    rows = check_tensor("rows", rows, dtype=_FLOATS, ndim=2, device=dev, last_dim_contiguous=True)
    slots = check_tensor("slots", slots, dtype=(torch.int32, torch.int64), ndim=1, device=dev, contiguous=True)
    for name, t in (("rows", rows), ("slots", slots)):
        check_launch_device(name, t)
    P, S, D = kv_cache.shape
    if rows.shape[1] != D:
        raise ValueError(f"rows: expected rows as wide as the cache ({D}), got shape {list(rows.shape)}")
    check_shape("slots", slots, (rows.shape[0],))
    fp8 = kv_cache.dtype == FP8
    sc = kv_scale_orig_quant
    scale_t, scale_val = None, 1.0
    if sc is not None and not fp8:
        raise ValueError(f"kv_scale_orig_quant: only an e4m3 kv_cache takes a scale, got a {kv_cache.dtype} cache")
    if isinstance(sc, torch.Tensor):
        if sc.dtype != torch.float32 or sc.numel() != 1:
            raise TypeError(
                f"kv_scale_orig_quant: expected a 1-element float32 tensor, got {sc.dtype} {tuple(sc.shape)}"
            )
        if not same_device(sc.device, dev):
            raise ValueError(f"kv_scale_orig_quant: expected a tensor on {dev}, got one on {sc.device}")
        scale_t = sc
    elif sc is not None:
        if isinstance(sc, bool) or not isinstance(sc, (int, float)):
            raise TypeError(
                f"kv_scale_orig_quant: expected a float or a 1-element fp32 tensor, got {type(sc).__name__}"
            )
        if not (math.isfinite(sc) and sc > 0):
            raise ValueError(f"kv_scale_orig_quant: expected a finite scale > 0, got {sc}")
        scale_val = float(sc)
    check_no_overlap({"kv_cache": kv_cache}, {"rows": rows, "slots": slots, "kv_scale_orig_quant": scale_t})
    n = rows.shape[0]
    if n == 0 or P * S == 0:
        return
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    _STORE.launch(
        lambda meta: (-(-n // meta["BLOCK_R"]),),
        ("store",),
        rows, slots, cache, scale_t if scale_t is not None else rows, scale_val, n, P * S, rows.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=S, D=D, FP8_OUT=fp8, SCALE_IS_PTR=scale_t is not None,
        NATIVE=fp8 and native_e4m3_store(kv_cache.device),
    )  # fmt: skip


def store_latent_rows_ref(
    kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, *, kv_scale_orig_quant: float | None = None
) -> torch.Tensor:
    """Plain-torch reference of ``store_latent_rows``: returns the updated copy of the cache."""
    from kvforge.kernels._fp8 import e4m3_ref

    out = kv_cache.clone()
    P, S, _ = out.shape
    flat = out.view(P * S, -1)
    for r, slot in enumerate(slots.tolist()):
        if 0 <= slot < P * S:
            x = rows[r].float()
            flat[slot] = e4m3_ref(x * (kv_scale_orig_quant or 1.0)) if out.dtype == FP8 else x.to(out.dtype)
    return out


def mla_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    v_head_dim: int = 512,
    kv_scale_quant_orig: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch fp32 reference, one request at a time: gathers the request's rows page by page (an e4m3
    cache times ``kv_scale_quant_orig``), then ``softmax(scale · q kᵀ) v``. Returns ``(out [B, H, v_head_dim]
    fp32, lse [B, H] fp32)``."""
    scale = 1.0 if kv_scale_quant_orig is None else float(kv_scale_quant_orig)
    B, H, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros((B, H, v_head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q.device)
    tables = block_table.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        pages = tables[b][: (n + page_size - 1) // page_size]
        rows = torch.cat([kv_cache[p] for p in pages])[:n].float() * scale
        s = (q[b].float() @ rows.T) * softmax_scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :v_head_dim]
    return out, lse


def selfcheck(device: torch.device) -> list:
    """Decode attention against the fp32 reference: awkward lengths, an empty request, shuffled pages; and an
    e4m3 cache written by ``store_latent_rows`` against the reference over the dequantised cache."""
    from kvforge.kernels._selfcheck import timed_check

    def case(B: int, H: int, dv: int, dr: int, page_size: int, lens: list[int], dtype: torch.dtype, fp8: bool = False):
        def run() -> tuple[float, bool]:
            g = torch.Generator().manual_seed(11 + B * H)
            max_pages = max(1, max(-(-n // page_size) for n in lens))
            pages = B * max_pages + 2
            q = torch.randn(B, H, dv + dr, generator=g).to(dtype).to(device)
            kv = torch.randn(pages, page_size, dv + dr, generator=g).to(dtype).to(device)
            bt = torch.randperm(pages, generator=g)[: B * max_pages].view(B, max_pages).to(torch.int32).to(device)
            sl = torch.tensor(lens, dtype=torch.int32, device=device)
            scale = (dv + dr) ** -0.5
            s_kv = None
            if fp8:  # the write path quantises e4m3(x * 4); decode dequantises by 1/4
                rows = kv.view(-1, dv + dr)
                kv = torch.zeros(kv.shape, dtype=FP8, device=device)
                slots = torch.arange(rows.shape[0], device=device)
                store_latent_rows(kv, slots, rows, kv_scale_orig_quant=4.0)
                s_kv = 0.25
            out, lse = mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, v_head_dim=dv, return_lse=True,
                                            kv_scale_quant_orig=s_kv)  # fmt: skip
            ref, ref_lse = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=scale, v_head_dim=dv,
                                                    kv_scale_quant_orig=s_kv)  # fmt: skip
            err = float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))
            finite = torch.isfinite(ref_lse)
            lse_tol = 2e-2 if fp8 else 1e-3
            lse_ok = torch.equal(finite, torch.isfinite(lse)) and bool(((lse - ref_lse)[finite].abs() <= lse_tol).all())
            tol = 1e-2 if fp8 else {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
            return err, lse_ok and err <= tol

        shapes = f"B={B} H={H} {dv}+{dr} page={page_size} lens={lens if len(lens) <= 4 else '...'} {dtype}"
        shapes += " e4m3 cache" if fp8 else ""
        return timed_check("mla_decode_attention", device, shapes, run, unit="rel RMSE")

    if device.type != "cuda":
        return [case(3, 5, 32, 16, 4, [0, 23, 9], torch.float32), case(2, 16, 32, 16, 16, [40, 7], torch.bfloat16),
                case(2, 16, 32, 16, 16, [40, 7], torch.bfloat16, fp8=True)]  # fmt: skip
    return [case(8, 128, 512, 64, 64, [1, 63, 64, 65, 4000, 0, 8191, 300], torch.bfloat16),
            case(4, 16, 512, 64, 64, [1, 4000, 0, 8191], torch.bfloat16, fp8=True)]  # fmt: skip
