"""Warp-specialised sm_90 split kernel of MLA decode attention (Gluon), same contract as ``mla_decode``'s.

``mla_decode_gluon_split`` writes, for each (request, 64-head tile, key share), the request's ``out``/``lse`` when
it has one share, else the fp32 partial output and lse that ``kvforge.kernels.mla_decode`` merges (shares sized on
the device, value checks poisoning the output, as ``mla_decode``'s portable kernel); the caller has checked every
input and ``gluon_decode_reason`` said the layout fits. bf16 q; a bf16 cache, or an e4m3 one (``KV_FP8``: the loader
fills an e4m3 ring of ``fp8_ring_slots`` slots, each tile's owner widens it exactly into a 2-slot fp16 ring before
its scores, Q rewritten as fp16 (fp16 products), and hands the e4m3 slot straight back; 32-token tiles); keys 576 =
512 latent + 64 rope (any ``D_V / 2 <= 256`` and ``D_R <= 256`` that fit shared memory), page size a multiple of the
key tile; this module does not import ``mla_decode`` (one import direction). A variant is (``block_n``, ``stages``,
``early``): key tiles of ``block_n`` (32 or 64) tokens in a ring of ``stages`` slots (``smem_bytes`` must fit the
SM: 64 x 2, 32 x 3 and 32 x 4 do), and the score product issued before (``early``) or after taking the other
warpgroup's tile. Rows of a share's last tile past the request's length are zeroed before P·V (a never-written cache
row may hold NaN). Used only where ``gluon_decode_reason`` returns None; everything else takes the portable kernel.
Built on ``mla_context_gluon``'s Gluon imports and Triton 3.6 / 3.9 bridges. The partitions (a TMA loader warp, two
consumer warpgroups taking turns) and their schedule: ``docs/kernels.md``, "The sm_90 Gluon kernel".
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from kvforge.kernels import _runtime as _rt
from kvforge.kernels import mla_context_gluon as _mcg

__all__ = [
    "BLOCK_H",
    "BLOCK_N",
    "BLOCK_NS",
    "STAGES",
    "SplitPrep",
    "fp8_ring_slots",
    "gluon_decode_reason",
    "mla_decode_gluon_split",
    "smem_bytes",
]

BLOCK_H = 64  # heads per program: one warpgroup's wgmma M
BLOCK_N = 64  # tokens per key tile by default: a page of the reference layout, wgmma N of the score product
STAGES = 2  # key-tile ring slots by default
BLOCK_NS = (32, 64)  # key tiles the kernel supports (wgmma N of the score product, K of P·V)
# Registers per thread: 9 warps are padded to 12 (three warpgroups) and 65536 / (12 * 32) = 170 -> 168 at launch;
# setmaxnreg then gives each consumer warpgroup 240 and the loader warp 24.
_MAXNREG, _C_REGS, _L_REGS = 168, 240, 24
# Which consumer warpgroup runs as the default partition: the one that spills less on this Triton (ptxas -v,
# sm_90a: warpgroup 1 there leaves 264 B of spills on Triton 3.6 against 492 B; on 3.9, 660 B against 8 B).
_FIRST_W = 1 if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7) else 0
_SMEM_LIMIT_SM90 = 232448

gluon = _mcg.gluon
if gluon is not None:
    gl = _mcg.gl
    mbarrier = _mcg.mbarrier
    warpgroup_mma = _mcg.warpgroup_mma
    warpgroup_mma_wait = _mcg.warpgroup_mma_wait
    fence_async_shared = _mcg.fence_async_shared
    _tma_load = _mcg._tma_load
    _barrier = _mcg._barrier
    # A shared-memory view's reinterpret is _reinterpret in Triton 3.6 (same arguments).
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


def tma_layout_ok(kv_cache: torch.Tensor, d_v: int) -> bool:
    """Whether the cache can be read through 2-D descriptors ``[pages * page_size, D]`` (pages evenly strided,
    16-byte aligned rows and column offsets, row count within int32)."""
    P, S, _ = kv_cache.shape
    es = kv_cache.element_size()
    return (
        P * S > 0
        and kv_cache.stride(0) == S * kv_cache.stride(1)
        and (kv_cache.stride(1) * es) % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
        and (d_v // 2 * es) % 16 == 0
        and P * S < 2**31
    )


def smem_bytes(
    d_v: int, d_r: int, block_n: int = BLOCK_N, stages: int = STAGES, kv_fp8: bool = False, stages8: int | None = None
) -> int:
    """Shared memory of one program: the Q tile, the key-tile ring (and with ``kv_fp8`` the e4m3 ring of
    ``stages8`` slots, default ``fp8_ring_slots``, that the loader fills beside it), P, the max and the two row
    sums, barriers."""
    d = d_v + d_r
    base = 2 * (BLOCK_H * d + stages * block_n * d + BLOCK_H * block_n) + 4 * 3 * BLOCK_H + 8 * (3 + 3 * stages)
    if not kv_fp8:
        return base
    s8 = fp8_ring_slots(d_v, d_r, block_n, stages) if stages8 is None else stages8
    return base + s8 * (block_n * d + 16)


def fp8_ring_slots(d_v: int, d_r: int, block_n: int = BLOCK_N, stages: int = STAGES) -> int:
    """Slots of the e4m3 ring beside a bf16 ring of ``stages`` slots: as many as fit the SM (at most 8, at least
    ``stages``; the caller checks ``smem_bytes`` with them). The e4m3 ring is what keeps copies in flight: a
    slot is free again once its tile is widened, not once both warpgroups' products are done."""
    base = smem_bytes(d_v, d_r, block_n, stages)
    fit = (_SMEM_LIMIT_SM90 - base) // (block_n * (d_v + d_r) + 16)
    return int(min(8, max(stages, fit)))


def gluon_decode_reason(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_size: int,
    v_head_dim: int,
    d_r: int,
    block_n: int = BLOCK_N,
    stages: int = STAGES,
    *,
    scale_tensor: bool = False,
) -> str | None:
    """None when the Gluon kernel variant (``block_n``-token key tiles, ``stages`` ring slots) can run this call,
    else why not (device, dtype, widths, shared memory, layouts). An e4m3 cache with a bf16 q takes the kernel's
    ``KV_FP8`` form (its scale a float: ``scale_tensor`` says the call's is a device tensor)."""
    why = _mcg.gluon_unavailable_reason(q.device)
    if why is not None:
        return why
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if q.dtype != torch.bfloat16 or kv_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return f"the Gluon decode kernel takes a bf16 q and a bf16 or e4m3 cache, got q {q.dtype} and {kv_cache.dtype}"
    half = v_head_dim // 2
    if half % 64 or half > 256 or d_r % 16 or d_r > 256:
        return f"widths {v_head_dim} + {d_r} do not split into TMA boxes of at most 256 columns"
    if kv_fp8 and (half % 128 or d_r not in (32, 64, 128, 256)):
        return f"widths {v_head_dim} + {d_r}: the e4m3 cache's widening works in 128-column slices (rope 32..256)"
    if kv_fp8 and scale_tensor:
        return "the e4m3 cache's scale is a device tensor; the Gluon kernel takes a float"
    if block_n not in BLOCK_NS or not 2 <= stages <= 8:
        return f"key tiles of {block_n} tokens in {stages} ring slots: expected {BLOCK_NS} and 2..8"
    need = smem_bytes(v_head_dim, d_r, block_n, stages, kv_fp8)
    if need > _SMEM_LIMIT_SM90:
        return f"widths {v_head_dim} + {d_r} with {stages} x {block_n}-token key tiles need {need} B of shared memory"
    if page_size % block_n:
        return f"page size {page_size} is not a multiple of the {block_n}-token key tile"
    B, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D or (B > 1 and q.stride(0) != H * D) or q.data_ptr() % 16:
        return "q is not a contiguous, 16-byte aligned [B, H, D] tensor (its Q tiles are TMA copies)"
    if not tma_layout_ok(kv_cache, v_head_dim):
        return "kv_cache's layout does not allow TMA copies of whole rows"
    return None


if gluon is not None:

    @gluon.jit
    def _gd_loader(q_desc_h, q_desc_r, k_desc_h, k_desc_r, q_a, q_b, q_r, k_a, k_b, k_r, p_smem, m_smem, l_bufs,
                   q_ready, k_ready, k_empty, p_full, l_ready, bt_row, q_row, start, end, n_tiles, H, h0,
                   po_base, plse_base, s_poh, s_plh, scale_log2, ob_base, lb_base, s_oh, s_lh, direct, bad_len,
                   num_pages, err_ptr, k8_a, k8_b, k8_r, v_scale, k8_empty, n_share, split, s_pos, cnt_base,
                   W: gl.constexpr,
                   PAGE_SIZE: gl.constexpr, D_HALF: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                   BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EARLY: gl.constexpr,
                   CHECK: gl.constexpr, KV_FP8: gl.constexpr, Q_EARLY: gl.constexpr,
                   STAGES8: gl.constexpr, OUT_VEC: gl.constexpr, MERGE: gl.constexpr):  # fmt: skip
        """One warp: key tile t into slot t % STAGES8 of the ring ``k8_*`` once it is free (the bf16 ring ``k_*``
        itself, freed by both warpgroups' arrivals on ``k_empty``; or with KV_FP8 the e4m3 ring, freed on
        ``k8_empty`` once the tile's owner has widened it), after the Q tile's copy (unless the kernel body issued
        it: Q_EARLY)."""
        if not Q_EARLY:
            mbarrier.expect(q_ready, 2 * q_desc_h.block_type.nbytes + q_desc_r.block_type.nbytes)
            _tma_load(q_desc_h, [q_row, 0], q_ready, q_a)
            _tma_load(q_desc_h, [q_row, D_HALF], q_ready, q_b)
            _tma_load(q_desc_r, [q_row, D_V], q_ready, q_r)
        for t in range(n_tiles):
            s = t % STAGES8
            tok = start + t * BLOCK_N
            page = gl.load(bt_row + tok // PAGE_SIZE)
            if CHECK:  # a page id out of range reads page 0 (the consumers poison the output)
                page = gl.where((page < 0) | (page >= num_pages), 0, page)
            row = page * PAGE_SIZE + tok % PAGE_SIZE
            if KV_FP8:
                mbarrier.wait(k8_empty.index(s), ((t // STAGES8) & 1) ^ 1)
            else:
                mbarrier.wait(k_empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(s), 2 * k_desc_h.block_type.nbytes + k_desc_r.block_type.nbytes)
            _tma_load(k_desc_h, [row, 0], k_ready.index(s), k8_a.index(s))
            _tma_load(k_desc_h, [row, D_HALF], k_ready.index(s), k8_b.index(s))
            _tma_load(k_desc_r, [row, D_V], k_ready.index(s), k8_r.index(s))

    @gluon.jit
    def _gd_widen(k8_a, k8_b, k8_r, k_a, k_b, k_r, k_ready, k_empty, k8_empty, i, slot, start, end,
                  BLOCK_N: gl.constexpr, D_HALF: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr,
                  STAGES8: gl.constexpr):  # fmt: skip
        """KV_FP8: tile i's e4m3 rows (e4m3 slot i % STAGES8) widened into fp16 slot ``slot``, exactly (e4m3 values
        are fp16 values; one conversion a pair, where bf16 takes three), once both warpgroups are done with that
        slot's last tile (i - STAGES); rows at or past ``end`` become 0 (a never-written row may hold NaN, and P·V
        multiplies every row). 128-column slices: one 128-byte swizzle row of the e4m3 tile at a time. Then the
        e4m3 slot goes back to the loader."""
        s8 = i % STAGES8
        mbarrier.wait(k_ready.index(s8), (i // STAGES8) & 1)
        mbarrier.wait(k_empty.index(slot), ((i // STAGES) & 1) ^ 1)
        wl: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        rows = start + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
        bad = (rows >= end)[:, None]
        for c in gl.static_range(D_HALF // 128):
            xa = k8_a.index(s8).slice(c * 128, 128, dim=1).load(wl).to(gl.float16)
            k_a.index(slot).slice(c * 128, 128, dim=1).store(gl.where(bad, gl.zeros_like(xa), xa))
            xb = k8_b.index(s8).slice(c * 128, 128, dim=1).load(wl).to(gl.float16)
            k_b.index(slot).slice(c * 128, 128, dim=1).store(gl.where(bad, gl.zeros_like(xb), xb))
        rl: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D_R // 16), D_R // 16], [4, 1], [1, 0])
        rrows = start + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rl))
        xr = k8_r.index(s8).load(rl).to(gl.float16)
        k_r.index(slot).store(gl.where((rrows >= end)[:, None], gl.zeros_like(xr), xr))
        fence_async_shared()
        _barrier()  # every warp's rows are in shared memory before this warpgroup's wgmma reads them
        mbarrier.arrive(k8_empty.index(s8), count=1)  # every warp has read the e4m3 slot (the barrier above)

    @gluon.jit
    def _gd_share_even(seq_ptr, B, max_len, min_tiles, slots, head_progs, BLOCK_N: gl.constexpr):
        """``mla_decode._share_even`` (the even share c0 and the longest request, in key tiles) in Gluon."""
        l1: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        offs = gl.arange(0, 256, layout=l1)
        total = gl.zeros([256], gl.int32, layout=l1)
        top = gl.zeros([256], gl.int32, layout=l1)
        for i in range(0, B, 256):
            lens = gl.load(seq_ptr + i + offs, mask=i + offs < B, other=0)
            t = (gl.minimum(gl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
            total += t
            top = gl.maximum(top, t)
        c0 = gl.maximum((gl.sum(total, 0).to(gl.int64) * head_progs + slots - 1) // slots, min_tiles)
        return gl.minimum(c0, 1 << 20).to(gl.int32), gl.max(top, 0)

    @gluon.jit
    def _gd_count_tiles(seq_ptr, B, max_len, lo_t, hi_t, last, BLOCK_N: gl.constexpr):
        """``mla_decode._count_tiles`` in Gluon: requests ``i <= last`` with key tiles in ``[lo_t, hi_t)``."""
        l1: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        offs = gl.arange(0, 256, layout=l1)
        cnt = gl.zeros([256], gl.int32, layout=l1)
        for i in range(0, B, 256):
            idx = i + offs
            lens = gl.load(seq_ptr + idx, mask=idx < B, other=0)
            t = (gl.minimum(gl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
            cnt += ((idx < B) & (idx <= last) & (t >= lo_t) & (t < hi_t)).to(gl.int32)
        return gl.sum(cnt, 0)

    @gluon.jit
    def _gd_longest_first(seq_ptr, y, B, max_len, BLOCK_N: gl.constexpr):
        """``mla_decode._longest_first`` in Gluon: the request at place ``y`` of the batch, most key tiles first."""
        l1: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        offs = gl.arange(0, 256, layout=l1)
        lo_v = gl.full([256], 1 << 30, gl.int32, layout=l1)
        hi_v = gl.zeros([256], gl.int32, layout=l1)
        for i in range(0, B, 256):
            lens = gl.load(seq_ptr + i + offs, mask=i + offs < B, other=0)
            t = (gl.minimum(gl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
            lo_v = gl.minimum(lo_v, gl.where(i + offs < B, t, 1 << 30))
            hi_v = gl.maximum(hi_v, t)
        lo = gl.min(lo_v, 0)
        hi = gl.max(hi_v, 0) + 1
        b = y
        if hi - lo > 1:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                more = _gd_count_tiles(seq_ptr, B, max_len, mid, 1 << 30, B, BLOCK_N) > y
                lo = gl.where(more, mid, lo)
                hi = gl.where(more, hi, mid)
            r = y - _gd_count_tiles(seq_ptr, B, max_len, lo + 1, 1 << 30, B, BLOCK_N)
            a = y * 0 - 1
            z = y * 0 + B - 1
            while z - a > 1:
                mid = (a + z) // 2
                hit = _gd_count_tiles(seq_ptr, B, max_len, lo, lo + 1, mid, BLOCK_N) > r
                z = gl.where(hit, mid, z)
                a = gl.where(hit, a, mid)
            b = z
        return b

    @gluon.jit
    def _gd_share_pick(seq_ptr, B, S, max_len, min_tiles, slots, head_progs, c0, tmax, BLOCK_N: gl.constexpr):
        """``mla_decode._share_pick`` (the balanced split's share size, ``share_chunk_ref``) in Gluon."""
        l2: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [64, 8]: four per thread
        rows: gl.constexpr = gl.SliceLayout(1, l2)
        cols: gl.constexpr = gl.SliceLayout(0, l2)
        offs = gl.arange(0, 64, layout=rows)
        f = gl.arange(0, 8, layout=cols)
        step = gl.where(f <= 3, gl.maximum(f - 1, 0), gl.where(f == 4, 4, (f - 4) * 8))  # SHARE_STEPS
        cand = gl.minimum(c0 + (c0 * step + 7) // 8, 1 << 20)
        progs = gl.zeros([8], gl.int64, layout=cols)
        longest0 = gl.zeros([64], gl.int32, layout=rows)
        for i in range(0, B, 64):
            live = i + offs < B
            lens = gl.load(seq_ptr + i + offs, mask=live, other=0)
            t = (gl.minimum(gl.maximum(lens, 0), max_len) + BLOCK_N - 1) // BLOCK_N
            n0 = gl.minimum(gl.maximum(t // c0, 1), S)
            longest0 = gl.maximum(longest0, gl.where(live, (t + n0 - 1) // n0, 0))
            n = gl.minimum(gl.maximum((t[:, None] + cand[None, :] - 1) // cand[None, :], 1), S)
            n = gl.where(f[None, :] == 0, n0[:, None], n)
            progs += gl.sum(gl.where(live[:, None], n, 0), 0).to(gl.int64)
        waves = (gl.minimum(progs * head_progs, 1 << 30).to(gl.int32) + slots - 1) // slots
        longest = gl.where(f == 0, gl.max(longest0, 0), gl.maximum(gl.minimum(tmax, cand), (tmax + S - 1) // S))
        cost = waves.to(gl.int64) * (longest + min_tiles)
        best = gl.min(cost * 8 + f, 0) % 8
        return gl.sum(gl.where(f == best, cand, 0), 0), best == 0

    @gluon.jit
    def _gd_zero_tail(buf, tok0, end, BLOCK_N: gl.constexpr, D_HALF: gl.constexpr):
        """Zero the rows of one latent half of a key tile whose tokens lie at or past ``end``."""
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = tok0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl))
        bad = (rows >= end)[:, None]
        for c in gl.static_range(D_HALF // 64):
            chunk = buf.slice(c * 64, 64, dim=1)
            x = chunk.load(zl)
            chunk.store(gl.where(bad, gl.zeros_like(x), x))

    @gluon.jit
    def _gd_take_other(acc, m_run, l_run, p_smem, m_smem, p_full, v_buf, j, s_layout: gl.constexpr,
                       p_layout: gl.constexpr):  # fmt: skip
        """The other warpgroup's tile j: wait for its P and max, rescale, and issue acc·α + P·V (no wait)."""
        srow: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow: gl.constexpr = gl.SliceLayout(1, p_layout.parent)
        mbarrier.wait(p_full, j & 1)
        p_o = p_smem.load(s_layout)
        m_o = m_smem.load(srow)
        alpha = gl.exp2(m_run - m_o)
        acc = acc * gl.convert_layout(alpha, orow)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p_o, p_layout), v_buf, acc, is_async=True)
        return acc, m_o, l_run * alpha

    @gluon.jit
    def _gd_scores(q_a, q_b, q_r, k_a, k_b, k_r, k_ready, i, slot, s_layout: gl.constexpr, BLOCK_H: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_FP8: gl.constexpr):  # fmt: skip
        """Issue tile i's scores from its ring slot (i % STAGES) once it is loaded (no wait); with KV_FP8 this
        warpgroup has just widened it there."""
        if not KV_FP8:
            mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
        sc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        sc = warpgroup_mma(q_a, k_a.index(slot).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_b, k_b.index(slot).permute((1, 0)), sc, is_async=True)
        return warpgroup_mma(q_r, k_r.index(slot).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _gd_softmax_publish(sc, m_run, l_run, k_a, k_b, p_smem, m_smem, p_full, i, slot, start, end, scale_log2,
                            s_layout: gl.constexpr, BLOCK_N: gl.constexpr, D_HALF: gl.constexpr,
                            KV_FP8: gl.constexpr):  # fmt: skip
        """Tile i's online softmax against the running max; P (bf16, or fp16 with KV_FP8) and the new max go to
        shared memory for the other warpgroup (and a partial tile's rows past the end are zeroed first). Returns
        (P, α, m, l)."""
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        sc = sc * scale_log2
        tok0 = start + i * BLOCK_N
        partial = tok0 + BLOCK_N > end
        if partial:
            sc = gl.where((tok0 + offs_n < end)[None, :], sc, float("-inf"))
        m_new = gl.maximum(m_run, gl.max(sc, 1))
        p = gl.exp2(sc - m_new[:, None])
        alpha = gl.exp2(m_run - m_new)
        l_run = l_run * alpha + gl.sum(p, 1)
        if partial and not KV_FP8:  # both latent halves (widening zeroed them): the other reads its half after p_full
            _gd_zero_tail(k_a.index(slot), tok0, end, BLOCK_N, D_HALF)
            _gd_zero_tail(k_b.index(slot), tok0, end, BLOCK_N, D_HALF)
        p16 = p.to(p_smem.dtype)
        p_smem.store(p16)
        m_smem.store(m_new)
        fence_async_shared()
        mbarrier.arrive(p_full, count=1)
        return p16, alpha, m_new, l_run

    @gluon.jit
    def _gd_store_half(x, ring, base, s_row, h0, H, col0, VEC: gl.constexpr, BLOCK_H: gl.constexpr,
                       D_HALF: gl.constexpr, RING_ROWS: gl.constexpr):  # fmt: skip
        """x ([BLOCK_H, D_HALF], the accumulator's layout) to rows h0 + i < H, columns col0 + j of ``base`` (row
        stride ``s_row``; with VEC > 1 a multiple of VEC, ``base`` VEC-element aligned). Staged through this
        warpgroup's own key ring, free once both warpgroups' products are done: from the accumulator layout a
        warp instruction writes 8 rows x 16 bytes (8 memory transactions for 128 bytes, the bulk of a short
        program's time on the H200); read back row-wise, a warp writes 32 x VEC contiguous elements. A ring
        smaller than the tile (a 2 x 32 ring holds a bf16 tile but not an fp32 one) stores directly."""
        bits: gl.constexpr = x.dtype.primitive_bitwidth
        if BLOCK_H * bits <= RING_ROWS * 16:  # the ring's bf16 [RING_ROWS, D_HALF] holds the tile
            UNIT: gl.constexpr = 128 // bits  # 16-byte units: the swizzle keeps both the writes and reads whole
            sl: gl.constexpr = gl.SwizzledSharedLayout(UNIT, 1, 8, order=[1, 0])
            if _NEW_REINTERPRET:
                stage = ring.reinterpret(x.dtype, [BLOCK_H, D_HALF], sl)
            else:
                stage = ring._reinterpret(x.dtype, [BLOCK_H, D_HALF], sl)
            stage.store(x)
            _barrier()  # every thread's part is in shared memory before any reads a row
            TC: gl.constexpr = D_HALF // UNIT if D_HALF // UNIT < 32 else 32
            bl: gl.constexpr = gl.BlockedLayout([1, UNIT], [32 // TC, TC], [4, 1], [1, 0])
            y = stage.load(bl)
            rows = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, bl))
            cols = col0 + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, bl))
            ptrs = base + (rows.to(gl.int64)[:, None] * s_row + cols[None, :])
            if VEC > 1:  # (a partition's pointer arguments carry no alignment: the caller vouches for it)
                ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [1, VEC * bits // 8]), [1, VEC])
            gl.store(ptrs, y, mask=(rows < H)[:, None])
        else:
            lay: gl.constexpr = x.type.layout
            rows = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, lay))
            cols = col0 + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, lay))
            gl.store(base + rows.to(gl.int64)[:, None] * s_row + cols[None, :], x, mask=(rows < H)[:, None])

    @gluon.jit
    def _gd_merge_half(po_req, pl_req, s_pos, s_poh, s_plh, n, ob_base, s_oh, lb_base, s_lh, h0, H, W: gl.constexpr,
                       OUT_VEC: gl.constexpr, BLOCK_H: gl.constexpr, D_HALF: gl.constexpr):  # fmt: skip
        """Columns [W * D_HALF, (W + 1) * D_HALF) of rows h0 + i < H of a request's output, and (W 0) its lse:
        the log-sum-exp merge of its ``n`` shares' fp32 partials (``po_req`` / ``pl_req`` at share 0, share
        stride ``s_pos`` / 1), as ``mla_decode._merge_head``: a share of lse -inf weighs 0 and is not read, a NaN
        share lse makes the row NaN. Partials are read from L2 (``.cg``): other programs wrote them."""
        UNIT: gl.constexpr = 8
        TC: gl.constexpr = D_HALF // UNIT if D_HALF // UNIT < 32 else 32
        bl: gl.constexpr = gl.BlockedLayout([1, UNIT], [32 // TC, TC], [4, 1], [1, 0])
        RB: gl.constexpr = 16
        rl: gl.constexpr = gl.SliceLayout(1, bl)
        cols = W * D_HALF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, bl))
        for r0 in range(0, BLOCK_H, RB):
            rows = h0 + r0 + gl.arange(0, RB, layout=rl)
            live = rows < H
            rows = rows.to(gl.int64)
            pl = pl_req + rows * s_plh
            m = gl.full([RB], float("-inf"), gl.float32, layout=rl)
            bad = gl.zeros([RB], gl.int32, layout=rl)
            for sh in range(n):
                x = gl.load(pl + sh, mask=live, other=float("-inf"), cache_modifier=".cg")
                bad = bad | (x != x).to(gl.int32)
                m = gl.maximum(m, gl.where(x != x, float("-inf"), x))
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            den = gl.zeros([RB], gl.float32, layout=rl)
            acc = gl.zeros([RB, D_HALF], gl.float32, layout=bl)
            for sh in range(n):
                x = gl.load(pl + sh, mask=live, other=float("-inf"), cache_modifier=".cg")
                w = gl.exp(gl.where(x != x, float("-inf"), x) - m_safe)
                den += w
                ptrs = po_req + sh * s_pos + rows[:, None] * s_poh + cols[None, :]
                ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, UNIT])  # partial rows: 16-byte aligned
                o = gl.load(ptrs, mask=(w > 0.0)[:, None], other=0.0, cache_modifier=".cg")
                acc += w[:, None] * o
            o = acc / gl.where(den > 0.0, den, 1.0)[:, None]
            o = gl.where((bad != 0)[:, None], float("nan"), o)
            optrs = ob_base + rows[:, None] * s_oh + cols[None, :]
            if OUT_VEC > 1:
                optrs = gl.max_contiguous(gl.multiple_of(optrs, [1, 16]), [1, OUT_VEC])
            gl.store(optrs, o.to(ob_base.dtype.element_ty), mask=live[:, None])
            if W == 0:
                lse = gl.where(den > 0.0, m_safe + gl.log(gl.where(den > 0.0, den, 1.0)), float("-inf"))
                gl.store(lb_base + rows * s_lh, gl.where(bad != 0, float("nan"), lse), mask=live)

    @gluon.jit
    def _gd_q_to_f16(q_a, q_b, q_r, l_ready, W: gl.constexpr, BLOCK_H: gl.constexpr, D_HALF: gl.constexpr,
                     D_R: gl.constexpr):  # fmt: skip
        """KV_FP8: the Q tile (bf16, as TMA wrote it) rewritten as fp16 in place, rows [W * BLOCK_H / 2, ...) by
        warpgroup W (each thread writes back the elements it read); returns the fp16 views once both halves
        are done. A bf16 value beyond fp16's range becomes inf (as the portable kernel's fp16 products)."""
        R: gl.constexpr = BLOCK_H // 2
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        h16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], gl.float16)
        r16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.float16)
        if _NEW_REINTERPRET:
            a16 = q_a.reinterpret(gl.float16, [BLOCK_H, D_HALF], h16)
            b16 = q_b.reinterpret(gl.float16, [BLOCK_H, D_HALF], h16)
            r16v = q_r.reinterpret(gl.float16, [BLOCK_H, D_R], r16)
        else:
            a16 = q_a._reinterpret(gl.float16, [BLOCK_H, D_HALF], h16)
            b16 = q_b._reinterpret(gl.float16, [BLOCK_H, D_HALF], h16)
            r16v = q_r._reinterpret(gl.float16, [BLOCK_H, D_R], r16)
        x = q_a.slice(W * R, R).load(ql)
        a16.slice(W * R, R).store(x.to(gl.float16))
        x = q_b.slice(W * R, R).load(ql)
        b16.slice(W * R, R).store(x.to(gl.float16))
        x = q_r.slice(W * R, R).load(ql)
        r16v.slice(W * R, R).store(x.to(gl.float16))
        fence_async_shared()
        mbarrier.arrive(l_ready, count=1)
        mbarrier.wait(l_ready, 0)
        return a16, b16, r16v

    @gluon.jit
    def _gd_consumer(q_desc_h, q_desc_r, k_desc_h, k_desc_r, q_a, q_b, q_r, k_a, k_b, k_r, p_smem, m_smem, l_bufs,
                     q_ready, k_ready, k_empty, p_full, l_ready, bt_row, q_row, start, end, n_tiles, H, h0,
                     po_base, plse_base, s_poh, s_plh, scale_log2, ob_base, lb_base, s_oh, s_lh, direct, bad_len,
                     num_pages, err_ptr, k8_a, k8_b, k8_r, v_scale, k8_empty, n_share, split, s_pos, cnt_base,
                     W: gl.constexpr,
                     PAGE_SIZE: gl.constexpr, D_HALF: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                     BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EARLY: gl.constexpr,
                     CHECK: gl.constexpr, KV_FP8: gl.constexpr, Q_EARLY: gl.constexpr,
                     STAGES8: gl.constexpr, OUT_VEC: gl.constexpr, MERGE: gl.constexpr):  # fmt: skip
        """Consumer warpgroup W: the scores and softmax of tiles W, W + 2, ...; P·V of every tile into output
        columns [W * D_HALF, (W + 1) * D_HALF). Per own tile i: the other's tile i - 1 is taken first (its
        P·V issued ahead of tile i's softmax, and its ring slot freed as soon as that product is done, so the
        loader refills it while tile i's softmax runs), then tile i's softmax and P·V. Tile i's scores are
        issued after taking tile i - 1, or before it with EARLY (they need only Q and tile i's keys). Every
        iteration ends with its products done, so nobody waits on work this warpgroup has not issued."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D_HALF, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        srow: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow: gl.constexpr = gl.SliceLayout(1, o_layout)
        if W == 0:
            v_bufs = k_a
        else:
            v_bufs = k_b
        bad_page = bad_len * 0
        if CHECK:  # the share's page ids, checked while the loader's first copies are in flight
            vl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs = gl.arange(0, 128, layout=vl)
            p1 = (end + PAGE_SIZE - 1) // PAGE_SIZE
            wrong = gl.zeros([128], gl.int32, layout=vl)
            for c in range(start // PAGE_SIZE, p1, 128):
                ids = gl.load(bt_row + c + offs, mask=c + offs < p1, other=0)
                wrong = wrong | ((ids < 0) | (ids >= num_pages)).to(gl.int32)
            bad_page = gl.max(wrong, 0)
        m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=srow)
        l_run = gl.zeros([BLOCK_H], gl.float32, layout=srow)
        acc = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
        mbarrier.wait(q_ready, 0)
        if KV_FP8:  # fp16 products: Q to fp16 in place, each warpgroup half its rows (l_ready's phase 0)
            q_a, q_b, q_r = _gd_q_to_f16(q_a, q_b, q_r, l_ready, W, BLOCK_H, D_HALF, D_R)
        if W == 0:  # noqa: SIM102 (a constexpr test, then a runtime one: Gluon does not mix them in one `and`)
            if n_tiles > 0:  # tile 0 has no predecessor
                if KV_FP8:
                    _gd_widen(k8_a, k8_b, k8_r, k_a, k_b, k_r, k_ready, k_empty, k8_empty, 0,
                              0, start, end, BLOCK_N, D_HALF, D_R, STAGES, STAGES8)  # fmt: skip
                sc = _gd_scores(q_a, q_b, q_r, k_a, k_b, k_r, k_ready, 0, 0, s_layout, BLOCK_H, BLOCK_N, STAGES, KV_FP8)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                p16, alpha, m_run, l_run = _gd_softmax_publish(sc, m_run, l_run, k_a, k_b, p_smem, m_smem, p_full,
                                                               0, 0, start, end, scale_log2, s_layout, BLOCK_N,
                                                               D_HALF, KV_FP8)  # fmt: skip
                acc = warpgroup_mma(gl.convert_layout(p16, p_layout), v_bufs.index(0), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(k_empty.index(0), count=1)
        for i in range(2 - W, n_tiles, 2):
            if STAGES == 2:  # a warpgroup's own tiles sit in slot W: constant slots (the measured kernel's code)
                own = W
                prev = 1 - W
            else:
                own = i % STAGES
                prev = (i - 1) % STAGES
            if KV_FP8:  # tile i widened before its scores (the other warpgroup's P·V of tile i - 1 may run)
                _gd_widen(k8_a, k8_b, k8_r, k_a, k_b, k_r, k_ready, k_empty, k8_empty, i,
                          own, start, end, BLOCK_N, D_HALF, D_R, STAGES, STAGES8)  # fmt: skip
            if EARLY:
                # wgmma groups in issue order: scores(i), then P·V(i - 1); wait(1) leaves the second running.
                sc = _gd_scores(
                    q_a, q_b, q_r, k_a, k_b, k_r, k_ready, i, own, s_layout, BLOCK_H, BLOCK_N, STAGES, KV_FP8
                )
                acc, m_run, l_run = _gd_take_other(acc, m_run, l_run, p_smem, m_smem, p_full, v_bufs.index(prev),
                                                   i - 1, s_layout, p_layout)  # fmt: skip
                sc = warpgroup_mma_wait(1, deps=(sc,))
            else:
                acc, m_run, l_run = _gd_take_other(acc, m_run, l_run, p_smem, m_smem, p_full, v_bufs.index(prev),
                                                   i - 1, s_layout, p_layout)  # fmt: skip
                sc = _gd_scores(
                    q_a, q_b, q_r, k_a, k_b, k_r, k_ready, i, own, s_layout, BLOCK_H, BLOCK_N, STAGES, KV_FP8
                )
                acc = warpgroup_mma_wait(1, deps=(acc,))  # tile i - 1's product is done; the scores may still run
                mbarrier.arrive(k_empty.index(prev), count=1)
                sc = warpgroup_mma_wait(0, deps=(sc,))
            p16, alpha, m_run, l_run = _gd_softmax_publish(sc, m_run, l_run, k_a, k_b, p_smem, m_smem, p_full, i,
                                                           own, start, end, scale_log2, s_layout, BLOCK_N,
                                                           D_HALF, KV_FP8)  # fmt: skip
            if EARLY:  # tile i - 1's product, still running under the softmax
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(k_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, orow)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p16, p_layout), v_bufs.index(own), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(k_empty.index(own), count=1)
        last = n_tiles - 1
        if last >= 0 and last % 2 != W:  # the other warpgroup's last tile (its slot is not refilled: no arrival)
            if STAGES == 2:
                last_slot = 1 - W
            else:
                last_slot = last % STAGES
            acc, m_run, l_run = _gd_take_other(acc, m_run, l_run, p_smem, m_smem, p_full, v_bufs.index(last_slot),
                                               last, s_layout, p_layout)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))
        # Row sums: each warpgroup summed its own tiles' P, both rescaled to the same final max.
        l_bufs.slice(W * BLOCK_H, BLOCK_H).store(l_run)
        mbarrier.arrive(l_ready, count=1)
        mbarrier.wait(l_ready, 1 if KV_FP8 else 0)  # (KV_FP8: phase 0 was Q's conversion)
        l_tot = l_run + l_bufs.slice((1 - W) * BLOCK_H, BLOCK_H).load(srow)
        has = l_tot > 0.0
        inv = v_scale / gl.where(has, l_tot, 1.0)  # v_scale: the e4m3 cache's dequantisation (1 for bf16)
        o = acc * gl.convert_layout(inv, orow)[:, None]
        lse = gl.where(has, (m_run + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        if CHECK:  # a bad length or page id: NaN output and lse, and the caller's flags
            poison = gl.where((bad_len | bad_page) != 0, float("nan"), 0.0)
            o = o + poison
            lse = lse + poison
            if W == 0:
                if bad_len != 0:
                    gl.store(err_ptr, 1)
                if bad_page != 0:
                    gl.store(err_ptr + 1, 1)
        PART_VEC: gl.constexpr = 4 if D_HALF % 4 == 0 else 1  # the partials: contiguous fp32, 16-byte aligned
        hr = (h0 + gl.arange(0, BLOCK_H, layout=srow)).to(gl.int64)
        if direct:  # the request's only share: the final output in out's dtype
            _gd_store_half(o.to(ob_base.dtype.element_ty), v_bufs, ob_base, s_oh, h0, H, W * D_HALF, OUT_VEC,
                           BLOCK_H, D_HALF, STAGES * BLOCK_N)  # fmt: skip
            if W == 0:
                gl.store(lb_base + hr * s_lh, lse, mask=hr < H)
        else:
            _gd_store_half(o, v_bufs, po_base, s_poh, h0, H, W * D_HALF, PART_VEC, BLOCK_H, D_HALF,
                           STAGES * BLOCK_N)  # fmt: skip
            if MERGE:  # both warpgroups write the (identical) lse: each half's merge reads it
                gl.store(plse_base + hr * s_plh, lse, mask=hr < H)
                # Every thread's stores are issued before one thread's release (the pattern of a grid barrier):
                # the share to arrive last for this half of the head tile merges that half.
                _barrier()
                al: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                lane = gl.arange(0, 128, layout=al)
                first = lane == 0
                old = gl.atomic_add(cnt_base + W + lane * 0, lane * 0 + 1, mask=first, sem="acq_rel", scope="gpu")
                if gl.max(gl.where(first, old, -1), 0) == n_share - 1:
                    gl.store(cnt_base + W + lane * 0, lane * 0, mask=first)  # zero again for the next call
                    _gd_merge_half(po_base - split * s_pos, plse_base - split, s_pos, s_poh, s_plh, n_share, ob_base,
                                   s_oh, lb_base, s_lh, h0, H, W, OUT_VEC, BLOCK_H, D_HALF)  # fmt: skip
            elif W == 0:
                gl.store(plse_base + hr * s_plh, lse, mask=hr < H)

    @gluon.jit(do_not_specialize=["B", "S", "max_len", "min_tiles", "slots", "num_pages", "s_plb", "s_plh",
                                  "s_ob", "s_oh", "s_lb", "s_lh"])  # fmt: skip
    def _mla_decode_gluon_kernel(
        q_desc_h, q_desc_r, k_desc_h, k_desc_r, bt_ptr, seq_ptr, po_ptr, plse_ptr, out_ptr, lse_ptr, nshare_ptr,
        err_ptr, H, s_btb, s_pob, s_poh, s_pos, B, S, max_len, min_tiles, slots, num_pages, s_plb, s_plh, s_ob,
        s_oh, s_lb, s_lh, scale_log2, v_scale,
        PAGE_SIZE: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr, C_REGS: gl.constexpr, L_REGS: gl.constexpr, FIRST_W: gl.constexpr,
        STAGES: gl.constexpr = 2, EARLY: gl.constexpr = False, CHECK: gl.constexpr = True,
        BALANCE: gl.constexpr = 0, KV_FP8: gl.constexpr = False, STAGES8: gl.constexpr = 2,
        ORDER: gl.constexpr = False, OUT_VEC: gl.constexpr = 1, MERGE: gl.constexpr = False,
    ):  # fmt: skip
        """Grid (head tiles, requests, S): a request's head tiles are neighbours in launch order, so the second
        reads the key tiles from L2. Shares, checks and outputs as ``mla_decode._mla_decode_split_kernel``'s
        (``_request_share``: a request with one share writes ``out``/``lse``, the others partials and their
        count). Launched with 4 warps (consumer warpgroup FIRST_W, the default partition); the partitions add
        4 + 1. KV_FP8: the cache is e4m3 (its descriptors e4m3 boxes): the loader fills an e4m3 ring, the owner of a
        tile widens it into the bf16 ring before its scores, ``scale_log2`` carries the dequantisation scale and
        ``v_scale`` multiplies the output. ORDER: the request axis runs the batch longest first, as the portable
        kernel's. OUT_VEC: elements of ``out`` a 16-byte store holds when its rows allow (``_out_vec``), else 1.
        MERGE: a split request's last share to finish merges it (each consumer warpgroup its column half, counted
        on its own arrival counter at ``nshare_ptr``, which must be zero and is left zero); else its share count
        goes to ``nshare_ptr`` for ``mla_decode``'s merge kernel."""
        D_HALF: gl.constexpr = D_V // 2
        Q_EARLY: gl.constexpr = BALANCE == 2
        pid_h = gl.program_id(0)
        b = gl.program_id(1)
        if ORDER:  # the request axis runs the batch longest first
            b = _gd_longest_first(seq_ptr, b, B, max_len, BLOCK_N)
        split = gl.program_id(2)
        seq_len = gl.load(seq_ptr + b)
        bad_len = seq_len * 0
        if CHECK:
            bad_len = ((seq_len < 0) | (seq_len > max_len)).to(gl.int32)
            seq_len = gl.where(bad_len != 0, 0, seq_len)
        tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
        # As mla_decode._request_share: past the min_tiles bound a program leaves before any pass over the
        # lengths, and (BALANCE 2) past the c0 bound before the second.
        if BALANCE == 2:
            if split >= gl.minimum(gl.maximum((tiles + min_tiles - 1) // min_tiles, 1), S):
                return
            hp = gl.num_programs(0)
            c0, tmax = _gd_share_even(seq_ptr, B, max_len, min_tiles, slots, hp, BLOCK_N)
            n_share = gl.minimum(gl.maximum((tiles + c0 - 1) // c0, 1), S)
        elif BALANCE == 1:  # the even share, share counts rounded down (one pass)
            if split >= gl.minimum(gl.maximum(tiles // min_tiles, 1), S):
                return
            bl: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
            offs = gl.arange(0, 1024, layout=bl)
            tot = gl.zeros([1024], gl.int32, layout=bl)
            for i in range(0, B, 1024):
                lens = gl.load(seq_ptr + i + offs, mask=i + offs < B, other=0)
                lens = gl.minimum(gl.maximum(lens, 0), max_len)
                tot += (lens + BLOCK_N - 1) // BLOCK_N
            work = gl.sum(tot, 0).to(gl.int64) * gl.num_programs(0)
            chunk = gl.minimum(gl.maximum((work + slots - 1) // slots, min_tiles), 1 << 20).to(gl.int32)
            n_share = gl.minimum(gl.maximum(tiles // chunk, 1), S)
        else:
            n_share = gl.minimum(gl.maximum(tiles, 1), S)
        if split >= n_share:
            return
        h0 = pid_h * BLOCK_H
        q_row = b * H + h0
        q_a = gl.allocate_shared_memory(q_desc_h.dtype, [BLOCK_H, D_HALF], q_desc_h.layout)
        q_b = gl.allocate_shared_memory(q_desc_h.dtype, [BLOCK_H, D_HALF], q_desc_h.layout)
        q_r = gl.allocate_shared_memory(q_desc_r.dtype, [BLOCK_H, D_R], q_desc_r.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        fence_async_shared()
        if BALANCE == 2:
            # The Q tile's copy does not depend on the share: it is issued here, under the second pass over the
            # lengths (the loader partition then starts with the key tiles).
            mbarrier.expect(q_ready, 2 * q_desc_h.block_type.nbytes + q_desc_r.block_type.nbytes)
            _tma_load(q_desc_h, [q_row, 0], q_ready, q_a)
            _tma_load(q_desc_h, [q_row, D_HALF], q_ready, q_b)
            _tma_load(q_desc_r, [q_row, D_V], q_ready, q_r)
            chunk, floor = _gd_share_pick(seq_ptr, B, S, max_len, min_tiles, slots, hp, c0, tmax, BLOCK_N)
            n_share = gl.minimum(gl.maximum(gl.where(floor, tiles // chunk, (tiles + chunk - 1) // chunk), 1), S)
            if split >= n_share:  # the bound was loose for this program: its Q copy lands before it leaves
                mbarrier.wait(q_ready, 0)
                mbarrier.invalidate(q_ready)
                return
        if MERGE:  # nshare_ptr: the arrival counters, [B, head tiles, 2] int32
            cnt_base = nshare_ptr + (b * gl.num_programs(0) + pid_h) * 2
        else:
            cnt_base = nshare_ptr
            if (S > 1) & (pid_h == 0) & (split == 0):
                gl.store(nshare_ptr + b, n_share)
        per = (tiles + n_share - 1) // n_share
        start = split * per * BLOCK_N
        end = gl.minimum(start + per * BLOCK_N, seq_len)
        n_tiles = gl.maximum(end - start, 0)
        n_tiles = (n_tiles + BLOCK_N - 1) // BLOCK_N
        bt_row = bt_ptr + b.to(gl.int64) * s_btb
        po_base = po_ptr + b.to(gl.int64) * s_pob + split.to(gl.int64) * s_pos
        plse_base = plse_ptr + b.to(gl.int64) * s_plb + split
        ob_base = out_ptr + b.to(gl.int64) * s_ob
        lb_base = lse_ptr + b.to(gl.int64) * s_lb
        direct = n_share == 1

        # The ring TMA fills, in the cache's dtype; with KV_FP8 a bf16 ring beside it that the scores and P·V read
        # (and STAGES8 e4m3 slots, so copies stay in flight while the bf16 slots wait for both warpgroups).
        k8_a = gl.allocate_shared_memory(k_desc_h.dtype, [STAGES8, BLOCK_N, D_HALF], k_desc_h.layout)
        k8_b = gl.allocate_shared_memory(k_desc_h.dtype, [STAGES8, BLOCK_N, D_HALF], k_desc_h.layout)
        k8_r = gl.allocate_shared_memory(k_desc_r.dtype, [STAGES8, BLOCK_N, D_R], k_desc_r.layout)
        if KV_FP8:
            kh16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_HALF], gl.float16)
            kr16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.float16)
            k_a = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, D_HALF], kh16)
            k_b = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, D_HALF], kh16)
            k_r = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, D_R], kr16)
        else:
            k_a = k8_a
            k_b = k8_b
            k_r = k8_r
        # P in the products' 16-bit type: bf16, or fp16 with an e4m3 cache (P <= 1: fp16 holds it more exactly)
        P_DT: gl.constexpr = gl.float16 if KV_FP8 else gl.bfloat16
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], P_DT)
        p_smem = gl.allocate_shared_memory(P_DT, [BLOCK_H, BLOCK_N], p_layout_s)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
        l_bufs = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)
        p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES8, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k8_empty = gl.allocate_shared_memory(gl.int64, [STAGES8, 1], mbarrier.MBarrierLayout())
        mbarrier.init(p_full, count=1)
        mbarrier.init(l_ready, count=2)
        for i in gl.static_range(STAGES8):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k8_empty.index(i), count=1)  # the tile's owner, once widened (unused without KV_FP8)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_empty.index(i), count=2)  # each consumer warpgroup frees a slot by its own arrival

        # The argument tuples are written out in the call (see mla_context_gluon: a tuple held in a variable
        # turns its constexprs into tensors).
        gl.warp_specialize(
            [
                (_gd_consumer, (q_desc_h, q_desc_r, k_desc_h, k_desc_r, q_a, q_b, q_r, k_a, k_b, k_r, p_smem, m_smem,
                                l_bufs, q_ready, k_ready, k_empty, p_full, l_ready, bt_row, q_row, start, end,
                                n_tiles, H, h0, po_base, plse_base, s_poh, s_plh, scale_log2, ob_base, lb_base, s_oh,
                                s_lh, direct, bad_len, num_pages, err_ptr, k8_a, k8_b, k8_r, v_scale, k8_empty, n_share,
                                split, s_pos, cnt_base,
                                FIRST_W, PAGE_SIZE, D_HALF, D_V, D_R, BLOCK_H, BLOCK_N, STAGES, EARLY, CHECK, KV_FP8,
                                Q_EARLY, STAGES8, OUT_VEC, MERGE)),
                (_gd_consumer, (q_desc_h, q_desc_r, k_desc_h, k_desc_r, q_a, q_b, q_r, k_a, k_b, k_r, p_smem, m_smem,
                                l_bufs, q_ready, k_ready, k_empty, p_full, l_ready, bt_row, q_row, start, end,
                                n_tiles, H, h0, po_base, plse_base, s_poh, s_plh, scale_log2, ob_base, lb_base, s_oh,
                                s_lh, direct, bad_len, num_pages, err_ptr, k8_a, k8_b, k8_r, v_scale, k8_empty, n_share,
                                split, s_pos, cnt_base,
                                1 - FIRST_W, PAGE_SIZE, D_HALF, D_V, D_R, BLOCK_H, BLOCK_N, STAGES, EARLY, CHECK,
                                KV_FP8, Q_EARLY, STAGES8, OUT_VEC, MERGE)),
                (_gd_loader, (q_desc_h, q_desc_r, k_desc_h, k_desc_r, q_a, q_b, q_r, k_a, k_b, k_r, p_smem, m_smem,
                              l_bufs, q_ready, k_ready, k_empty, p_full, l_ready, bt_row, q_row, start, end,
                              n_tiles, H, h0, po_base, plse_base, s_poh, s_plh, scale_log2, ob_base, lb_base, s_oh,
                              s_lh, direct, bad_len, num_pages, err_ptr, k8_a, k8_b, k8_r, v_scale, k8_empty, n_share,
                                split, s_pos, cnt_base, 0,
                              PAGE_SIZE, D_HALF, D_V, D_R, BLOCK_H, BLOCK_N, STAGES, EARLY, CHECK, KV_FP8, Q_EARLY,
                              STAGES8, OUT_VEC, MERGE)),
            ],
            [4, 1],
            [C_REGS, L_REGS],
        )  # fmt: skip
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(p_full)
        mbarrier.invalidate(l_ready)
        for i in gl.static_range(STAGES8):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k8_empty.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_empty.index(i))


@functools.lru_cache(maxsize=64)  # Gluon's layout helpers cost ~40 µs of host time per call
def descriptor_layouts(d_v: int, d_r: int, rows: int = BLOCK_N, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """The NVMMA shared layouts of ``rows``-row latent-half and rope boxes of ``dtype`` (a key tile's rows, or
    BLOCK_H for the Q tile; also what the offline compile test uses)."""
    dt = _mcg._gl_dtype(dtype)
    return (
        gl.NVMMASharedLayout.get_default_for([rows, d_v // 2], dt),
        gl.NVMMASharedLayout.get_default_for([rows, d_r], dt),
    )


class SplitPrep:
    """What a ``mla_decode_gluon_split`` call worked out that holds for every later call whose tensors have the
    same shapes, strides, dtypes, devices and 16-byte alignment (the caller's plan guarantees it): the four
    descriptors' fields (checked by the descriptor class once; no tensor kept), the grid, the integer arguments,
    the launch spec and, once compiled, the direct launcher. Filled by the first call given an empty one."""

    __slots__ = ("desc", "expanded", "fast", "grid", "ints", "raw", "spec")

    def __init__(self) -> None:
        self.desc: tuple | None = None  # per descriptor: its fields without ``base``, or None (built per call)
        self.grid: tuple[int, int, int] | None = None
        self.ints: tuple = ()
        self.spec: tuple | None = None
        self.fast: tuple | None = None  # _FAST's entry for spec once compiled
        self.raw: tuple | None = None  # _raw_launch's entry for the compiled kernel, or None
        # (q, cache) addresses -> the four descriptors as the raw launcher takes them (CUtensorMaps encoded once)
        self.expanded: dict[tuple[int, int], tuple] = {}

    def ready(self) -> bool:
        """True when a call with this prep launches the compiled kernel directly (so scratch pointers may be raw
        device addresses): compiled, no launch hook set, the kernel's device current."""
        f = self.fast
        return f is not None and not _rt.hooks_active() and f[3]() == f[2]


def _fields(desc: object) -> dict | None:
    """A descriptor's fields other than its base tensor, or None where the class keeps no ``__dict__``."""
    d = getattr(desc, "__dict__", None)
    return None if d is None else {k: v for k, v in d.items() if k != "base"}


def _clone(fields: dict, base: torch.Tensor) -> object:
    """The Gluon descriptor ``fields`` came from, over ``base`` (``_runtime.clone_descriptor``)."""
    return _rt.clone_descriptor(_mcg.GluonTensorDescriptor, fields, base)


def mla_decode_gluon_split(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    partial: torch.Tensor | int,
    partial_lse: torch.Tensor | int,
    out: torch.Tensor,
    lse: torch.Tensor,
    nshare: torch.Tensor | int,
    err: torch.Tensor,
    *,
    rt: tuple,
    scale_log2: float,
    v_head_dim: int,
    splits: int,
    block_n: int = BLOCK_N,
    stages: int = STAGES,
    early: bool = False,
    check: bool = True,
    balance: int = 0,
    order: bool = False,
    prep: SplitPrep | None = None,
    direct: bool = False,
    v_scale: float = 1.0,
    merge: bool = False,
) -> object:
    """One launch over ``(head tiles, B, splits)``: requests with one share write ``out``/``lse``, the others
    ``partial [B, H, splits, D_V]`` / ``partial_lse [B, H, splits]`` (contiguous, 16-byte aligned) and their share
    count in ``nshare``; ``rt`` is ``mla_decode``'s plan's do_not_specialize ints. Inputs checked by the caller
    and accepted by ``gluon_decode_reason`` for this ``block_n`` and ``stages``. ``prep``: an empty one is filled
    by this call; a filled one skips the per-call work for tensors laid out as that call's were. ``direct``: the
    caller has just seen ``prep.ready()``; only then may the scratch pointers (``partial``, ``partial_lse``,
    ``nshare``) be raw device addresses. An e4m3 cache runs the ``KV_FP8`` form: ``scale_log2`` must then include
    its dequantisation scale, and ``v_scale`` (the same scale) multiplies the output. ``order``: the request axis
    runs the batch longest first (``mla_decode.order_requests`` decides). ``merge``: split requests are merged
    in this launch (the ``MERGE`` form); ``nshare`` is then ``[B, head tiles, 2]`` int32 arrival counters, zero
    before the launch and zero after it (so one set serves the launches of one stream in turn)."""
    v_scale = float(v_scale)  # an int would be specialised (1 becomes a constant) and change the launch signature
    if prep is not None and prep.spec is not None:
        fast = prep.fast
        if direct or (fast is not None and not _rt.hooks_active()):
            kernel, cvals, device, current_device, current_stream = fast
            raw = prep.raw
            if raw is not None and (direct or current_device() == device):
                exp = prep.expanded.get((q.data_ptr(), kv_cache.data_ptr()))
                if exp is None:
                    exp = _expand(prep, raw, q, kv_cache, v_head_dim, block_n)
                grid = prep.grid
                raw[0](grid[0], grid[1], grid[2], current_stream(device), kernel.function, raw[1], raw[2], None, None,
                       kernel.packed_metadata, None, None, None, *exp, block_table, seq_lens, partial, partial_lse, out,
                       lse, nshare, err, *prep.ints, *rt, scale_log2, v_scale, *cvals)  # fmt: skip
                return kernel
            if direct or current_device() == device:
                desc = prep.desc
                if desc is not None:
                    descs = (_clone(desc[0], q), _clone(desc[1], q), _clone(desc[2], kv_cache),
                             _clone(desc[3], kv_cache))  # fmt: skip
                else:
                    descs = _descriptors(q, kv_cache, v_head_dim, block_n)
                grid = prep.grid
                kernel.run(grid[0], grid[1], grid[2], current_stream(device), kernel.function,
                           kernel.packed_metadata, None, None, None, *descs, block_table, seq_lens, partial,
                           partial_lse, out, lse, nshare, err, *prep.ints, *rt, scale_log2, v_scale,
                           *cvals)  # fmt: skip
                return kernel
    if not all(isinstance(t, torch.Tensor) for t in (partial, partial_lse, nshare)):
        raise RuntimeError("mla_decode_gluon_split: raw scratch addresses need a prep that is ready()")
    B, H, D = q.shape
    d_r = D - v_head_dim
    descs = _descriptors(q, kv_cache, v_head_dim, block_n)
    grid = (-(-H // BLOCK_H), B, splits)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    # rt = (B, S, max_len, min_tiles, slots, num_pages, s_plb, s_plh, s_ob, s_oh, s_lb, s_lh); partials contiguous
    ints = (H, block_table.stride(0), H * splits * v_head_dim, splits * v_head_dim, v_head_dim)
    args = (*descs, block_table, seq_lens, partial, partial_lse, out, lse, nshare, err, *ints, *rt, scale_log2, v_scale)
    consts = {"PAGE_SIZE": kv_cache.shape[1], "D_V": v_head_dim, "D_R": d_r, "BLOCK_H": BLOCK_H, "BLOCK_N": block_n,
              "C_REGS": _C_REGS, "L_REGS": _L_REGS, "FIRST_W": _FIRST_W, "STAGES": stages, "EARLY": bool(early),
              "CHECK": bool(check), "BALANCE": int(balance), "KV_FP8": fp8,
              "STAGES8": fp8_ring_slots(v_head_dim, d_r, block_n, stages) if fp8 else stages,
              "ORDER": bool(order), "OUT_VEC": _out_vec(out, v_head_dim), "MERGE": bool(merge)}  # fmt: skip
    # What Triton specialises the compiled kernel on besides the descriptors' types: the constexprs, the
    # specialised ints (1, multiple of 16, 64-bit) and the pointers' dtypes and 16-byte alignment.
    ptrs = (block_table, seq_lens, partial, partial_lse, out, lse, nshare, err)
    spec = (tuple(consts.items()), tuple((v == 1, v % 16 == 0, not -(2**31) <= v < 2**31) for v in ints),
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in ptrs), q.device.index)  # fmt: skip
    fast = _FAST.get(spec)
    if fast is not None and not _rt.hooks_active():
        kernel, cvals, device, current_device, current_stream = fast
        if current_device() == device:
            # Triton's own launch path costs ~0.1 ms of host time per call here; the compiled kernel's launcher
            # takes the same arguments directly (as _runtime.TunedKernel.launch_fast does for Triton kernels).
            kernel.run(grid[0], grid[1], grid[2], current_stream(device), kernel.function, kernel.packed_metadata,
                       None, None, None, *args, *cvals)  # fmt: skip
            if prep is not None:
                _fill(prep, descs, grid, ints, spec, fast)
            return kernel
    kernel = _mla_decode_gluon_kernel[grid](*args, **consts, num_warps=4, maxnreg=_MAXNREG)
    if hasattr(kernel, "packed_metadata"):
        from triton.runtime import driver

        names = [p.name for p in _mla_decode_gluon_kernel.params][len(args) :]
        active = driver.active
        fast = (kernel, tuple(consts[n] for n in names), active.get_current_device(), active.get_current_device,
                active.get_current_stream)  # fmt: skip
        _FAST[spec] = fast
        if prep is not None:
            _fill(prep, descs, grid, ints, spec, fast)
    return kernel


def _out_vec(out: torch.Tensor, d_v: int) -> int:
    """Elements a 16-byte store of ``out`` holds when every row of a head tile's half starts 16-byte aligned
    (the epilogue's vector stores), else 1."""
    vec = 16 // out.element_size()
    aligned = out.data_ptr() % 16 == 0 and out.stride(0) % vec == 0 and out.stride(1) % vec == 0
    return vec if aligned and (d_v // 2) % vec == 0 else 1


def _descriptors(q: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int, block_n: int) -> tuple:
    """Q's latent-half and rope descriptors over ``[B * H, D]``, the cache's over ``[pages * page_size, D]``."""
    B, H, D = q.shape
    P, S, _ = kv_cache.shape
    d_r = D - v_head_dim
    q_lay_h, q_lay_r = descriptor_layouts(v_head_dim, d_r, BLOCK_H)
    k_lay_h, k_lay_r = descriptor_layouts(v_head_dim, d_r, block_n, kv_cache.dtype)
    TD = _mcg.GluonTensorDescriptor
    q2 = [B * H, D]
    k2, ks = [P * S, D], [kv_cache.stride(1), 1]
    return (
        TD(q, q2, [D, 1], [BLOCK_H, v_head_dim // 2], q_lay_h),
        TD(q, q2, [D, 1], [BLOCK_H, d_r], q_lay_r),
        TD(kv_cache, k2, ks, [block_n, v_head_dim // 2], k_lay_h),
        TD(kv_cache, k2, ks, [block_n, d_r], k_lay_r),
    )


def _fill(prep: SplitPrep, descs: tuple, grid: tuple, ints: tuple, spec: tuple, fast: tuple) -> None:
    fields = tuple(_fields(d) for d in descs)
    prep.desc = None if any(f is None for f in fields) else fields
    prep.grid, prep.ints, prep.spec, prep.fast = grid, ints, spec, fast
    prep.raw = _raw_launch(fast[0]) if prep.desc is not None and RAW_LAUNCH else None
    prep.expanded = {}


# The launch past Triton's launcher object (_runtime.raw_launcher: Triton 3.6 only, no scratch buffers, no launch
# hooks): the four descriptors encoded once per (q, cache) address pair. KVFORGE_DECODE_RAW_LAUNCH=0 (or
# KVFORGE_RAW_LAUNCH=0) turns it off.
RAW_LAUNCH = os.environ.get("KVFORGE_DECODE_RAW_LAUNCH", "1") != "0"


def _raw_launch(kernel: object) -> tuple | None:
    """``_runtime.raw_launcher`` for a compiled Gluon split kernel (four descriptors)."""
    return _rt.raw_launcher(kernel, 4)


def _expand(
    prep: SplitPrep, raw: tuple, q: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int, block_n: int
) -> tuple:
    """The four descriptors over q and the cache, each as the raw launcher takes it (Triton's own encoder),
    kept in ``prep.expanded`` under the pair of addresses."""
    desc = prep.desc
    if desc is not None:
        descs = (_clone(desc[0], q), _clone(desc[1], q), _clone(desc[2], kv_cache), _clone(desc[3], kv_cache))
    else:
        descs = _descriptors(q, kv_cache, v_head_dim, block_n)
    exp = tuple(x for d, m in zip(descs, raw[3], strict=True) for x in raw[4](d, m))
    if len(prep.expanded) >= _rt.RAW_EXPANDED_MAX:
        prep.expanded.clear()
    prep.expanded[(q.data_ptr(), kv_cache.data_ptr())] = exp
    return exp


_FAST: dict = {}  # launch spec -> (compiled kernel, constexpr values, device, current_device, current_stream)
