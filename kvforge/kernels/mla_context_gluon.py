"""Warp-specialised sm_90 path of MLA context attention (Gluon), same contract as ``mla_context``.

``mla_context_gluon_fwd`` computes what ``kvforge.kernels.mla_context`` computes, d_qk = D_A + D_B (192 = 128 +
64), over the same (request, 128-row query tile) work table, for the input modes ``gluon_supports`` lists: FP8
Q/K/V (token-major or dim-major V); a bf16/fp16 Q with FP8 K/V (Q quantised here to e4m3, one scale per row =
amax / 448, folded into the row's score multiplier; V widened to fp16, fp16 P); 16-bit Q/K/V of one type with
token-major V (bf16/fp16 P). The caller (``MLAContextPlan.run``) has checked every input. One program per (tile,
head), four partitions that talk through mbarriers:

* a loader warp: TMA copies of each key block's K (both head-dim parts) and V into an ``NUM_STAGES`` ring;
* a V warpgroup: turns a token-major FP8 V tile into a tokens-contiguous one in its own ring (Hopper's FP8
  ``wgmma`` reads its B operand K-major only), or widens it to fp16 (``v_widen``), and zeroes the V rows of
  blocks that reach outside the request (a 0-weighted NaN row would still poison the sum); with dim-major or
  16-bit V it only zeroes (and reorders with ``key_perm``);
* two consumer warpgroups, each its own partition with 64 query rows: q·kᵀ, the online softmax in log2 units
  (an e4m3 P in [0, 256], offset 8, as the portable kernel), P·V; block i's scores are issued with block i - 1's
  P·V. ``pingpong``: they take turns issuing their products. ``key_perm``: keys reordered within every 32
  (``_key_perm``) so an e4m3 P's accumulator registers are already the A operand (no shuffles).

Used only where ``gluon_available()`` (Gluon importable with the Hopper API, an sm_90 device, no interpreter,
``KVFORGE_DISABLE_GLUON`` unset) and the config chose it (knob ``GLUON``; ``GLUON_PP``, ``GLUON_KP``, ``V_WIDEN``);
everything else takes the portable ``@triton.jit`` kernel. Written against Triton 3.6 and 3.9 (``_tma_load`` and
``_barrier`` bridge the renamed calls). Design notes and measurements: bench/results/mla_context.md."""

from __future__ import annotations

import functools
import os

import torch

from kvforge.kernels._chip_share import _chip_share  # a @triton.jit helper of integer arithmetic: Gluon calls it too
from kvforge.kernels._runtime import clone_descriptor, launch_jit

try:  # Gluon ships with Triton >= 3.5; its API moves between releases, so every name is checked here
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # Triton 3.6 names the TMA load async_copy_global_to_shared; later releases call it async_load (same
    # leading arguments: descriptor, coordinates, barrier, destination).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # A barrier over the calling partition's warps: thread_barrier in Triton 3.6, barrier from 3.7 on.
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _GLUON_IMPORT_ERROR: str | None = None
    for _name in ("warp_specialize", "NVMMADistributedLayout", "NVMMASharedLayout", "DotOperandLayout",
                  "BlockedLayout", "allocate_shared_memory", "SliceLayout", "permute", "convert_layout"):  # fmt: skip
        if not hasattr(gl, _name):
            raise ImportError(f"triton.experimental.gluon.language has no {_name}")
except Exception as e:  # any failure means "no Gluon path", reported by gluon_unavailable_reason()
    _GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"
    gluon = None

__all__ = ["gluon_available", "gluon_unavailable_reason", "mla_context_gluon_fwd"]

BLOCK_M = 128
# Registers per thread (setmaxnreg, per warpgroup; 16 warps x 128 = the SM's 64k): the second consumer
# warpgroup 216 (the first gets the rest, 208), the loader 24, the V warpgroup 64. No spills (ptxas, sm_90a).
_MAXNREG, _C_REGS, _V_REGS = 128, 216, 64
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def gluon_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the Gluon path can run on ``device``, else why not (import error, architecture, interpreter)."""
    from kvforge.kernels._runtime import device_capability, interpreting

    if os.environ.get("KVFORGE_DISABLE_GLUON", "") not in ("", "0"):
        return "disabled by KVFORGE_DISABLE_GLUON"
    if _GLUON_IMPORT_ERROR is not None:
        return f"Gluon not importable ({_GLUON_IMPORT_ERROR})"
    if interpreting():
        return "the Triton interpreter does not run Gluon"
    cap = device_capability(device)
    if cap is None or tuple(cap) != (9, 0):
        return f"the Gluon path is written for sm_90 (wgmma), device is {cap}"
    return None


def gluon_available(device: torch.device | None = None) -> bool:
    return gluon_unavailable_reason(device) is None


if gluon is not None:

    @gluon.constexpr_function
    def _v_tile_layout(dim_major, dv, block_n, num_warps):
        """Register layout of the V partition's tiles: dim-major [DV, BLOCK_N] with 16 consecutive tokens per
        thread; token-major [BLOCK_N, DV] with 16 consecutive dims x 8 tokens per thread (written transposed)."""
        if dim_major:
            return gl.BlockedLayout([1, 16], [32 // (block_n // 16), block_n // 16], [num_warps, 1], [1, 0])
        return gl.BlockedLayout([8, 16], [32 // (dv // 16), dv // 16], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _v_perm_layout(dim_major, dv, block_n, num_warps):
        """Register layout of the V partition's tiles when keys are reordered (``KEY_PERM``). Dim-major
        [DV, BLOCK_N]: 32 consecutive tokens per thread (the reorder stays inside a thread). Token-major
        [BLOCK_N, DV], chosen for the shared-memory banks on both sides of the transpose (128-byte swizzles):
        per thread 16 consecutive dims (16-byte loads) x 2 dim blocks x tokens {0, 1, 8, 9} + base, which the
        reorder maps to 4 consecutive positions; lanes take tokens 2, 4, 16, 32 and dims 16. The loads keep the
        lanes of a quarter warp on 8 different 16-byte chunks; the transposed store compiles to 8 ``stmatrix``
        x4 per thread and key block (Triton 3.6 and 3.9), where the default layout's takes 16 8-byte stores
        whose lanes 0-7 share their banks (8-way)."""
        if dim_major:
            return gl.BlockedLayout([1, 32], [32 // (block_n // 32), block_n // 32], [num_warps, 1], [1, 0])
        reg = [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [0, 32]]
        lane = [[2, 0], [4, 0], [0, 16], [16, 0], [32, 0]]
        warp = [[0, 64], [64, 0]]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, dv])

    @gluon.jit
    def _key_perm(x, AXIS: gl.constexpr):
        """Reorder the keys (axis AXIS of a 2-D tile) within every 32: position j = 16h + 4q + 2a + b takes key
        16h + 8a + 2q + b. P in that order is already the FP8 ``wgmma`` A-operand register layout (the
        conversion from the accumulator layout moves no data); V's rows take the same order, so P·V is unchanged."""
        if AXIS == 1:
            m: gl.constexpr = x.shape[0]
            n: gl.constexpr = x.shape[1]
            x = x.reshape([m, n // 32, 2, 2, 4, 2]).permute(0, 1, 2, 4, 3, 5).reshape([m, n])
        else:
            n: gl.constexpr = x.shape[0]
            d: gl.constexpr = x.shape[1]
            x = x.reshape([n // 32, 2, 2, 4, 2, d]).permute(0, 1, 3, 2, 4, 5).reshape([n, d])
        return x

    @gluon.jit
    def _gl_loader(k_desc_a, k_desc_b, v_desc, ka_bufs, kb_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, kv_tok0,
                   k_col, v_col, n_blocks, vt_bufs, vt_ready, vt_empty, shift, n_end, D_B: gl.constexpr,
                   DV: gl.constexpr, V_DIM_MAJOR: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                   KEY_PERM: gl.constexpr):  # fmt: skip
        """One warp: TMA copies of K (then V) of key block i into ring slot i % NUM_STAGES, once it is free."""
        for i in range(n_blocks):
            s = i % NUM_STAGES
            ph = (i // NUM_STAGES) & 1
            row = kv_tok0 + i * BLOCK_N
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            if D_B > 0:
                mbarrier.expect(k_ready.index(s), k_desc_a.block_type.nbytes + k_desc_b.block_type.nbytes)
            else:
                mbarrier.expect(k_ready.index(s), k_desc_a.block_type.nbytes)
            _tma_load(k_desc_a, [row, k_col], k_ready.index(s), ka_bufs.index(s))
            if D_B > 0:
                _tma_load(k_desc_b, [row, k_col + k_desc_a.block_type.shape[1]],
                                                k_ready.index(s), kb_bufs.index(s))  # fmt: skip
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            if V_DIM_MAJOR:
                _tma_load(v_desc, [v_col, row], v_ready.index(s), v_bufs.index(s))
            else:
                _tma_load(v_desc, [row, v_col], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _gl_v_fixer(k_desc_a, k_desc_b, v_desc, ka_bufs, kb_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                    kv_tok0, k_col, v_col, n_blocks, vt_bufs, vt_ready, vt_empty, shift, n_end, D_B: gl.constexpr,
                    DV: gl.constexpr, V_DIM_MAJOR: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr, KEY_PERM: gl.constexpr, KV16: gl.constexpr,
                    V_WIDEN: gl.constexpr):  # fmt: skip
        """One warpgroup: the P·V operand of block i, rows outside the request zeroed. FP8 token-major V: in
        ``vt_bufs`` slot i % NUM_STAGES as [DV, BLOCK_N] (tokens contiguous; in ``_key_perm`` order with
        ``KEY_PERM``), or with ``V_WIDEN`` as fp16 [BLOCK_N, DV]; the raw slot is freed (``v_empty``) as soon as it
        is in registers, so the loader refills it while the consumers still read the previous tile. Dim-major
        FP8 V and 16-bit V arrive as the operand and are rewritten in place only for blocks that reach outside
        the request (every block with ``KEY_PERM``)."""
        if KEY_PERM:
            lay: gl.constexpr = _v_perm_layout(V_DIM_MAJOR, DV, BLOCK_N, 4)
        else:
            lay: gl.constexpr = _v_tile_layout(V_DIM_MAJOR, DV, BLOCK_N, 4)  # the partition's 4 warps
        # 16-bit tiles, 64 token rows at a time (64 registers per thread in this partition)
        lay16: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DV // 8), DV // 8], [4, 1], [1, 0])
        for i in range(n_blocks):
            s = i % NUM_STAGES
            ph = (i // NUM_STAGES) & 1
            lo = i * BLOCK_N - shift  # key index of the block's first position
            bounds = (lo < 0) | (lo + BLOCK_N > n_end)
            mbarrier.wait(v_ready.index(s), ph)
            if KV16:
                if bounds:
                    for h in gl.static_range(BLOCK_N // 64):
                        part = v_bufs.index(s).slice(h * 64, 64, dim=0)
                        v = part.load(lay16)
                        toks = lo + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, lay16))
                        ok = (toks >= 0) & (toks < n_end)
                        part.store(gl.where(ok[:, None], v, gl.zeros_like(v)))
                fence_async_shared()
                mbarrier.arrive(vt_ready.index(s), count=1)
            elif V_WIDEN:
                mbarrier.wait(vt_empty.index(s), ph ^ 1)  # both consumers finished P·V on the slot's last tile
                for h in gl.static_range(BLOCK_N // 64):
                    v = v_bufs.index(s).slice(h * 64, 64, dim=0).load(lay16)
                    if bounds:
                        toks = lo + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, lay16))
                        ok = (toks >= 0) & (toks < n_end)
                        v = gl.where(ok[:, None], v, gl.zeros_like(v))
                    vt_bufs.index(s).slice(h * 64, 64, dim=0).store(v.to(gl.float16))  # e4m3 -> fp16 is exact
                mbarrier.arrive(v_empty.index(s), count=1)
                fence_async_shared()
                mbarrier.arrive(vt_ready.index(s), count=1)
            elif V_DIM_MAJOR:
                if KEY_PERM:
                    vt = v_bufs.index(s).load(lay)
                    if bounds:
                        toks = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
                        ok = (toks >= 0) & (toks < n_end)
                        vt = gl.where(ok[None, :], vt, gl.zeros_like(vt))
                    v_bufs.index(s).store(_key_perm(vt, 1))  # each thread rewrites only the bytes it read
                elif bounds:
                    vt = v_bufs.index(s).load(lay)
                    toks = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
                    ok = (toks >= 0) & (toks < n_end)
                    vt = gl.where(ok[None, :], vt, gl.zeros_like(vt))
                    v_bufs.index(s).store(vt)
                fence_async_shared()
                mbarrier.arrive(vt_ready.index(s), count=1)
            elif KEY_PERM:
                v = v_bufs.index(s).load(lay)
                mbarrier.arrive(v_empty.index(s), count=1)  # in registers: the loader may refill the raw slot
                if bounds:
                    toks = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
                    ok = (toks >= 0) & (toks < n_end)
                    v = gl.where(ok[:, None], v, gl.zeros_like(v))
                v = _key_perm(v, 0)
                mbarrier.wait(vt_empty.index(s), ph ^ 1)  # both consumers finished P·V on the slot's last tile
                vt_bufs.index(s).store(gl.permute(v, [1, 0]))
                fence_async_shared()
                mbarrier.arrive(vt_ready.index(s), count=1)
            else:
                v = v_bufs.index(s).load(lay)
                if bounds:
                    toks = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
                    ok = (toks >= 0) & (toks < n_end)
                    v = gl.where(ok[:, None], v, gl.zeros_like(v))
                # the consumers finished P·V on this slot's previous tile before they freed the slot (v_empty),
                # and the loader refilled it only after that, so vt slot s is free once v_ready fired
                vt_bufs.index(s).store(gl.permute(v, [1, 0]))
                fence_async_shared()
                mbarrier.arrive(vt_ready.index(s), count=1)

    @gluon.jit
    def _gl_scores(qa8, qb8, ka_bufs, kb_bufs, s, mma_layout: gl.constexpr, ROWS: gl.constexpr,
                   D_B: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Issue q·kᵀ of ring slot s (both head-dim parts chained on the matrix unit, no wait). Q is a register
        tile (FP8) or a shared-memory tile (16-bit)."""
        sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout)
        sc = warpgroup_mma(qa8, ka_bufs.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
        if D_B > 0:
            sc = warpgroup_mma(qb8, kb_bufs.index(s).permute((1, 0)), sc, is_async=True)
        return sc

    @gluon.jit
    def _gl_mask(sc, i, shift, n_full, n_end, key_limit, offs_n, BLOCK_N: gl.constexpr):
        """-inf where a row may not see a key: only blocks on the causal diagonal or reaching outside the
        request's keys pay for it (a masked score is replaced whatever the K row held)."""
        start = i * BLOCK_N
        if ((start < BLOCK_N) & (shift > 0)) | (start + BLOCK_N > n_full):
            toks = start - shift + offs_n
            ok = (toks[None, :] <= key_limit[:, None]) & (toks[None, :] >= 0) & (toks[None, :] < n_end)
            sc = gl.where(ok, sc, float("-inf"))
        return sc

    @gluon.jit
    def _gl_softmax(sc, m_i, l_i, scale, P_OFFSET: gl.constexpr, ROW_SCALE: gl.constexpr):
        """Online softmax of one block in log2 units: (P in [0, 2**P_OFFSET], alpha, new max, new sum).
        ``ROW_SCALE``: ``scale`` holds one multiplier per row (a Q quantised on chip)."""
        if ROW_SCALE:
            m_new = gl.maximum(m_i, gl.max(sc, 1) * scale)
            p = gl.exp2(sc * scale[:, None] - (m_new[:, None] - P_OFFSET))
        else:
            m_new = gl.maximum(m_i, gl.max(sc, 1) * scale)
            p = gl.exp2(sc * scale - (m_new[:, None] - P_OFFSET))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _gl_pv(acc, p, v_bufs, vt_bufs, vt_ready, s, ph, p_layout: gl.constexpr, V_DIM_MAJOR: gl.constexpr,
               KEY_PERM: gl.constexpr, KV16: gl.constexpr, V_WIDEN: gl.constexpr):  # fmt: skip
        """Issue acc + P·V of ring slot s once its V operand is ready (no wait). FP8: P in e4m3 against the
        tokens-contiguous V tile. 16-bit: P in V's type (bf16/fp16, fp16 for widened V) against the token-major
        tile, which 16-bit ``wgmma`` reads as it is; P's accumulator registers are that A operand already."""
        # assert_trivial: the compile fails if the conversion would move data between threads
        if KV16:
            pk = gl.convert_layout(p.to(v_bufs.dtype), p_layout, assert_trivial=True)
        elif V_WIDEN:
            pk = gl.convert_layout(p.to(gl.float16), p_layout, assert_trivial=True)
        else:
            pk = p.to(gl.float8e4nv)
            if KEY_PERM:
                pk = _key_perm(pk, 1)
            pk = gl.convert_layout(pk, p_layout, assert_trivial=KEY_PERM)
        mbarrier.wait(vt_ready.index(s), ph)
        if KV16:
            vb = v_bufs.index(s)
        elif V_WIDEN:
            vb = vt_bufs.index(s)
        elif V_DIM_MAJOR:
            vb = v_bufs.index(s).permute((1, 0))
        else:
            vb = vt_bufs.index(s).permute((1, 0))
        return warpgroup_mma(pk, vb, acc, is_async=True)

    @gluon.jit
    def _gl_consumer(qa8, qb8, ka_bufs, kb_bufs, v_bufs, vt_bufs, k_ready, k_empty, vt_ready, v_empty, n_blocks,
                     shift, diag0, n_end, scale, turn_mine, turn_other, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, ROWS: gl.constexpr, D_B: gl.constexpr, DV: gl.constexpr,
                     V_DIM_MAJOR: gl.constexpr, P_OFFSET: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, KEY_PERM: gl.constexpr, KV16: gl.constexpr,
                     V_WIDEN: gl.constexpr, ROW_SCALE: gl.constexpr):  # fmt: skip
        """The key loop of one consumer warpgroup; returns (acc, m, l). Block i's scores are issued together
        with block i - 1's P·V, and block i's softmax runs while that P·V is still on the matrix unit (acc is
        rescaled once it has landed). ``PINGPONG``: the two warpgroups take turns issuing their products
        (``turn_mine`` / ``turn_other`` mbarriers), so one's softmax lines up with the other's products."""
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        if KV16 or V_WIDEN:
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        else:
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_l)
        acc = gl.zeros([ROWS, DV], gl.float32, layout=o_layout)
        key_limit = diag0 + gl.arange(0, ROWS, layout=row_l)
        offs_n = gl.arange(0, BLOCK_N, layout=col_l)
        n_full = gl.maximum(((diag0 + shift + 1) // BLOCK_N) * BLOCK_N, 0)
        p = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        if n_blocks > 0:
            mbarrier.wait(k_ready.index(0), 0)
            sc = _gl_scores(qa8, qb8, ka_bufs, kb_bufs, 0, s_layout, ROWS, D_B, BLOCK_N)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            mbarrier.arrive(k_empty.index(0), count=1)
            sc = _gl_mask(sc, 0, shift, n_full, n_end, key_limit, offs_n, BLOCK_N)
            p, alpha, m_i, l_i = _gl_softmax(sc, m_i, l_i, scale, P_OFFSET, ROW_SCALE)
        for i in range(1, n_blocks):
            s = i % NUM_STAGES
            ph = (i // NUM_STAGES) & 1
            sp = (i - 1) % NUM_STAGES
            php = ((i - 1) // NUM_STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            if PINGPONG:
                mbarrier.wait(turn_mine, (i - 1) & 1)
            sc = _gl_scores(qa8, qb8, ka_bufs, kb_bufs, s, s_layout, ROWS, D_B, BLOCK_N)
            acc = _gl_pv(acc, p, v_bufs, vt_bufs, vt_ready, sp, php, p_layout, V_DIM_MAJOR, KEY_PERM, KV16, V_WIDEN)
            if PINGPONG:
                mbarrier.arrive(turn_other, count=1)
            sc = warpgroup_mma_wait(1, deps=(sc,))  # the scores landed; P·V may still run
            mbarrier.arrive(k_empty.index(s), count=1)
            sc = _gl_mask(sc, i, shift, n_full, n_end, key_limit, offs_n, BLOCK_N)
            p, alpha, m_i, l_i = _gl_softmax(sc, m_i, l_i, scale, P_OFFSET, ROW_SCALE)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        if n_blocks > 0:
            last = n_blocks - 1
            acc = _gl_pv(acc, p, v_bufs, vt_bufs, vt_ready, last % NUM_STAGES, (last // NUM_STAGES) & 1, p_layout,
                         V_DIM_MAJOR, KEY_PERM, KV16, V_WIDEN)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _gl_rows(Q, O, LSE, q_row0, out_row0, n_rows, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                 stride_lh, ka_bufs, kb_bufs, v_bufs, vt_bufs, qa_smem, qb_smem, k_ready, k_empty, vt_ready, v_empty,
                 n_blocks, shift, diag0, n_end, invalid, qk_scale, kv_scale, turn_mine, turn_other,
                 PINGPONG: gl.constexpr,
                 KEY_PERM: gl.constexpr, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, D_A: gl.constexpr,
                 D_B: gl.constexpr, DV: gl.constexpr, V_DIM_MAJOR: gl.constexpr, WRITE_LSE: gl.constexpr,
                 P_OFFSET: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, KV16: gl.constexpr,
                 V_WIDEN: gl.constexpr, Q_QUANT: gl.constexpr, SPLIT_KV: gl.constexpr):  # fmt: skip
        """One consumer warpgroup as its own partition: query rows [ROW_OFF, ROW_OFF + ROWS) of the tile, from
        the Q load to the output store. Two of these run side by side without synchronising with each other
        (each frees a ring slot by its own arrival; the slot barriers count two), so one warpgroup's softmax
        overlaps the other's matrix work. Q: FP8 in registers; a 16-bit Q with FP8 K (``Q_QUANT``) quantised
        here to e4m3 with one scale per row (amax / 448, folded into the row's score multiplier); with a 16-bit
        P (``KV16``, ``V_WIDEN``) kept in shared memory as the A operand. Output rows from ``out_row0`` (a key
        share's fp32 partial rows with ``SPLIT_KV``, where rows with no keys write 0 and lse -inf)."""
        if KV16:
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        else:
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 32])  # fmt: skip
        if KV16 or V_WIDEN:
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, DV, 16])  # fmt: skip
        else:
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, DV, 32])  # fmt: skip
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        offs_m = ROW_OFF + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        row_ok = offs_m < n_rows
        q_base = Q + (q_row0 + offs_m).to(gl.int64)[:, None] * stride_qt + head.to(gl.int64) * stride_qh
        qa = gl.load(q_base + gl.arange(0, D_A, layout=gl.SliceLayout(0, ld))[None, :], mask=row_ok[:, None],
                     other=0.0)  # fmt: skip
        if D_B > 0:
            qb = gl.load(q_base + D_A + gl.arange(0, D_B, layout=gl.SliceLayout(0, ld))[None, :],
                         mask=row_ok[:, None], other=0.0)  # fmt: skip
        else:
            qb = qa
        scale = qk_scale
        if Q_QUANT:
            qaf = qa.to(gl.float32)
            qbf = qb.to(gl.float32)
            amax = gl.maximum(gl.max(gl.abs(qaf), 1), gl.max(gl.abs(qbf), 1))
            s_q = gl.where(amax > 0, amax / 448.0, 1.0)
            inv = 1.0 / s_q
            qa = (qaf * inv[:, None]).to(gl.float8e4nv)
            qb = (qbf * inv[:, None]).to(gl.float8e4nv)
            scale = gl.convert_layout(s_q, gl.SliceLayout(1, s_layout)) * qk_scale
        if KV16 or V_WIDEN:  # a 16-bit P takes twice the registers: Q waits in shared memory instead
            qa_smem.store(qa)
            qb_smem.store(qb)
            fence_async_shared()
            _barrier()  # every warp's part of the tile is in shared memory before wgmma reads it
            qa8 = qa_smem
            qb8 = qb_smem
        else:
            qa8 = gl.convert_layout(qa, q_layout)
            qb8 = gl.convert_layout(qb, q_layout)
        acc, m_i, l_i = _gl_consumer(
            qa8, qb8, ka_bufs, kb_bufs, v_bufs, vt_bufs, k_ready, k_empty, vt_ready, v_empty, n_blocks, shift,
            diag0 + ROW_OFF, n_end, scale, turn_mine, turn_other, s_layout, o_layout, ROWS, D_B, DV, V_DIM_MAJOR,
            P_OFFSET, BLOCK_N, NUM_STAGES, PINGPONG, KEY_PERM, KV16, V_WIDEN, Q_QUANT,
        )  # fmt: skip
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        if SPLIT_KV:  # a share may hold no keys for some rows: 0 with lse -inf, which the merge drops
            o = acc * (kv_scale / gl.where(l_o > 0, l_o, 1.0))[:, None]
            empty = gl.where(invalid, float("nan"), float("-inf"))  # an invalid request: NaN, which the merge keeps
        else:
            o = acc * (kv_scale / l_o)[:, None]  # 0 / 0 = NaN for rows with no keys (invalid requests)
            empty = float("nan")
        o_rows = ROW_OFF + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O + (out_row0 + o_rows).to(gl.int64)[:, None] * stride_ot + head.to(gl.int64) * stride_oh
        gl.store(o_ptrs + o_cols[None, :], o.to(O.dtype.element_ty), mask=(o_rows < n_rows)[:, None])
        if WRITE_LSE:
            l_rows = ROW_OFF + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            lse = gl.where(l_i > 0, (m_i - P_OFFSET + gl.log2(l_i)) * 0.6931471805599453, empty)
            gl.store(LSE + (out_row0 + l_rows).to(gl.int64) * stride_lt + head.to(gl.int64) * stride_lh, lse,
                     mask=l_rows < n_rows)  # fmt: skip

    @gluon.jit(do_not_specialize=["n_items", "share_rows"])
    def _mla_context_gluon_kernel(
        Q, O, LSE, k_desc_a, k_desc_b, v_desc, Work, n_items, share_rows, scale_ptr, softmax_scale, kv_scale,
        q_scale_ptr,
        q_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
        H: gl.constexpr, GROUP: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, DV: gl.constexpr,
        V_DIM_MAJOR: gl.constexpr, SCALE_FROM_PTR: gl.constexpr, Q_SCALE_FROM_PTR: gl.constexpr,
        WRITE_LSE: gl.constexpr, P_OFFSET: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, KV_ALIGN: gl.constexpr, HEADS_OUTER: gl.constexpr,
        C_REGS: gl.constexpr, V_REGS: gl.constexpr, PINGPONG: gl.constexpr, KEY_PERM: gl.constexpr,
        KV16: gl.constexpr, Q_QUANT: gl.constexpr, V_WIDEN: gl.constexpr, SPLIT_KV: gl.constexpr = False,
        CHIP_SHARES: gl.constexpr = False,
    ):  # fmt: skip
        """One (128-row query tile, head) per program; Work items as in ``_mla_context_fwd_kernel`` (``SPLIT_KV``:
        its 8-int key shares, keys capped, fp32 partial rows). Launched
        with 4 warps (the first consumer warpgroup); the partitions add 4 + 1 + 4 warps. ``KV16``: 16-bit Q, K
        and V; ``Q_QUANT``: 16-bit Q, FP8 K/V; ``V_WIDEN``: FP8 token-major V widened to fp16 for P·V."""
        BM: gl.constexpr = 128
        pid = gl.program_id(0)
        if CHIP_SHARES:  # 4-int items split into the grid's shares on chip (``mla_context._chip_share``)
            per_share = n_items * H
            c = pid // per_share
            n_shares = gl.num_programs(0) // per_share
            pid = pid % per_share
        if HEADS_OUTER:
            item = pid % n_items
            head = pid // n_items
        else:
            item = pid // H
            head = pid % H
        w = Work + item.to(gl.int64) * (8 if SPLIT_KV and not CHIP_SHARES else 4)
        q_row0 = gl.load(w)
        n_rows = gl.load(w + 1)
        kv_row0 = gl.load(w + 2)
        diag0 = gl.load(w + 3)
        if CHIP_SHARES:
            # An invalid request's item (no keys at all; device tables only): its shares write lse NaN.
            invalid = (n_rows > 0) & (diag0 + n_rows <= 0)
            kv_row0, diag0, cap = _chip_share(n_rows, kv_row0, diag0, c, n_shares, KV_ALIGN, BLOCK_N)
            out_row0 = c * share_rows + q_row0
            n_end = gl.minimum(diag0 + n_rows, cap)
        elif SPLIT_KV:
            out_row0 = gl.load(w + 4)
            n_end = gl.minimum(diag0 + n_rows, gl.load(w + 5))
        else:
            out_row0 = q_row0
            n_end = diag0 + n_rows
        if not CHIP_SHARES:
            invalid = n_rows < 0  # never: host-built items are valid
        kvh = head // GROUP
        if SCALE_FROM_PTR:
            kv_scale = gl.load(scale_ptr).to(gl.float32)
        if KV16:
            kv_scale = 1.0
            qk_scale = softmax_scale * 1.4426950408889634
        elif Q_QUANT:
            qk_scale = softmax_scale * 1.4426950408889634 * kv_scale  # log2 e, s_k (s_q is per row, on chip)
        else:
            if Q_SCALE_FROM_PTR:
                q_scale = gl.load(q_scale_ptr).to(gl.float32)
            qk_scale = softmax_scale * 1.4426950408889634 * kv_scale * q_scale  # log2 e, s_k, s_q
        shift = kv_row0 % KV_ALIGN
        kv_tok0 = kv_row0 - shift
        pos_end = gl.maximum(n_end + shift, 0)
        n_blocks = (pos_end + BLOCK_N - 1) // BLOCK_N

        ka_bufs = gl.allocate_shared_memory(
            k_desc_a.dtype, [NUM_STAGES, BLOCK_N, k_desc_a.block_type.shape[1]], k_desc_a.layout
        )
        kb_bufs = gl.allocate_shared_memory(
            k_desc_b.dtype, [NUM_STAGES, BLOCK_N, k_desc_b.block_type.shape[1]], k_desc_b.layout
        )
        v_bufs = gl.allocate_shared_memory(
            v_desc.dtype, [NUM_STAGES, v_desc.block_type.shape[0], v_desc.block_type.shape[1]], v_desc.layout
        )
        # A separate ring for the operand the V warpgroup builds (FP8 token-major V: transposed or widened).
        # EARLY_FREE: the V warpgroup frees a raw V slot once it is in registers and both consumers free an
        # operand slot; otherwise both consumers free the raw slot after P·V (which also frees the operand slot).
        V_RING: gl.constexpr = (not V_DIM_MAJOR) and (not KV16)
        EARLY_FREE: gl.constexpr = V_RING and (KEY_PERM or V_WIDEN)
        if V_WIDEN:
            vw_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.float16)
            vt_bufs = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, BLOCK_N, DV], vw_layout)
        elif V_RING:
            vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DV, BLOCK_N], gl.float8e4nv)
            vt_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, DV, BLOCK_N], vt_layout)
        else:
            vt_bufs = v_bufs
        if KV16 or V_WIDEN:  # each consumer warpgroup's Q rows (K's type), the A operand of its score products
            qa_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, D_A], k_desc_a.dtype)
            qb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, k_desc_b.block_type.shape[1]],
                                                                           k_desc_b.dtype)  # fmt: skip
            qa_bufs = gl.allocate_shared_memory(k_desc_a.dtype, [2, BM // 2, D_A], qa_layout)
            qb_bufs = gl.allocate_shared_memory(k_desc_b.dtype, [2, BM // 2, k_desc_b.block_type.shape[1]],
                                                qb_layout)  # fmt: skip
            qa0 = qa_bufs.index(0)
            qa1 = qa_bufs.index(1)
            qb0 = qb_bufs.index(0)
            qb1 = qb_bufs.index(1)
        else:  # unused placeholders
            qa0 = ka_bufs
            qa1 = ka_bufs
            qb0 = kb_bufs
            qb1 = kb_bufs
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        vt_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        vt_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(vt_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # each consumer warpgroup frees a slot by its own arrival
            mbarrier.init(v_empty.index(i), count=1 if EARLY_FREE else 2)
            mbarrier.init(vt_empty.index(i), count=2)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        if PINGPONG:
            mbarrier.arrive(turn.index(0), count=1)  # the first consumer warpgroup goes first

        if EARLY_FREE:
            pv_free = vt_empty  # what a consumer arrives on once its P·V of a slot has landed
        else:
            pv_free = v_empty
        k_col = kvh * (D_A + D_B)
        v_col = kvh * DV
        # The argument tuples are written out in the call: a tuple held in a variable turns its constexprs
        # into tensors (Triton 3.6 and 3.9).
        gl.warp_specialize(
            [
                (_gl_rows, (Q, O, LSE, q_row0, out_row0, n_rows, head, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_lt, stride_lh, ka_bufs, kb_bufs, v_bufs, vt_bufs, qa0, qb0, k_ready, k_empty,
                            vt_ready, pv_free, n_blocks, shift, diag0, n_end, invalid, qk_scale, kv_scale,
                            turn.index(0), turn.index(1), PINGPONG, KEY_PERM, 0, BM // 2, D_A, D_B, DV,
                            V_DIM_MAJOR, WRITE_LSE, P_OFFSET, BLOCK_N, NUM_STAGES, KV16, V_WIDEN, Q_QUANT,
                            SPLIT_KV)),
                (_gl_rows, (Q, O, LSE, q_row0, out_row0, n_rows, head, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_lt, stride_lh, ka_bufs, kb_bufs, v_bufs, vt_bufs, qa1, qb1, k_ready, k_empty,
                            vt_ready, pv_free, n_blocks, shift, diag0, n_end, invalid, qk_scale, kv_scale,
                            turn.index(1), turn.index(0), PINGPONG, KEY_PERM, BM // 2, BM // 2, D_A,
                            D_B, DV, V_DIM_MAJOR, WRITE_LSE, P_OFFSET, BLOCK_N, NUM_STAGES, KV16, V_WIDEN, Q_QUANT,
                            SPLIT_KV)),
                (_gl_loader, (k_desc_a, k_desc_b, v_desc, ka_bufs, kb_bufs, v_bufs, k_ready, k_empty, v_ready,
                              v_empty, kv_tok0, k_col, v_col, n_blocks, vt_bufs, vt_ready, vt_empty, shift, n_end,
                              D_B, DV, V_DIM_MAJOR, BLOCK_N, NUM_STAGES, KEY_PERM)),
                (_gl_v_fixer, (k_desc_a, k_desc_b, v_desc, ka_bufs, kb_bufs, v_bufs, k_ready, k_empty, v_ready,
                               v_empty, kv_tok0, k_col, v_col, n_blocks, vt_bufs, vt_ready, vt_empty, shift, n_end,
                               D_B, DV, V_DIM_MAJOR, BLOCK_N, NUM_STAGES, KEY_PERM, KV16, V_WIDEN)),
            ],
            [4, 1, 4],
            [C_REGS, 24, V_REGS],
        )  # fmt: skip
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))
            mbarrier.invalidate(vt_ready.index(i))
            mbarrier.invalidate(vt_empty.index(i))
        mbarrier.invalidate(turn.index(0))
        mbarrier.invalidate(turn.index(1))


def _nvmma(block: list[int], dtype) -> object:
    return _nvmma_cached(tuple(block), dtype)


@functools.lru_cache(maxsize=256)  # Gluon's layout helper costs tens of µs of host time per call
def _nvmma_cached(block: tuple[int, ...], dtype) -> object:
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _gl_dtype(dt: torch.dtype) -> object:
    return {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dt]


def gluon_descriptors(k: torch.Tensor, v: torch.Tensor, d_a: int, d_b: int, dv: int, num_kv_heads: int,
                      dim_major: bool, block_n: int) -> tuple:  # fmt: skip
    """Host-side Gluon tensor descriptors of K (two head-dim parts) and V (rows = tokens; dim-major:
    rows = head x dim). The caller has checked that the layouts allow them (``_descriptors`` in mla_context)."""
    key = (k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride(), k.data_ptr() % 16, v.data_ptr() % 16, d_a, d_b,
           dv, num_kv_heads, dim_major, block_n)  # fmt: skip
    fields = _DESC_FIELDS.get(key)
    if fields is not None:  # descriptors over tensors laid out alike: their fields were checked when first built
        return tuple(_clone_desc(f, base) for f, base in zip(fields, (k, k, v)))
    descs = _build_descriptors(k, v, d_a, d_b, dv, num_kv_heads, dim_major, block_n)
    if all(hasattr(d, "__dict__") for d in descs):
        if len(_DESC_FIELDS) >= 256:
            _DESC_FIELDS.clear()
        _DESC_FIELDS[key] = tuple({n: x for n, x in vars(d).items() if n != "base"} for d in descs)
    return descs


_DESC_FIELDS: dict = {}  # layout key -> each descriptor's fields without its base tensor (no tensor kept)


def _clone_desc(fields: dict, base: torch.Tensor) -> object:
    return clone_descriptor(GluonTensorDescriptor, fields, base)


def _build_descriptors(k: torch.Tensor, v: torch.Tensor, d_a: int, d_b: int, dv: int, num_kv_heads: int,
                       dim_major: bool, block_n: int) -> tuple:  # fmt: skip
    d_qk = d_a + d_b
    kt, vt = _gl_dtype(k.dtype), _gl_dtype(v.dtype)
    k2 = [k.shape[0], num_kv_heads * d_qk]
    kd_a = GluonTensorDescriptor(k, k2, [k.stride(0), 1], [block_n, d_a], _nvmma([block_n, d_a], kt))
    d_bb = d_b or d_a
    kd_b = GluonTensorDescriptor(k, k2, [k.stride(0), 1], [block_n, d_bb], _nvmma([block_n, d_bb], kt))
    if dim_major:
        vd = GluonTensorDescriptor(v, [num_kv_heads * dv, v.shape[2]], [v.stride(1), 1], [dv, block_n],
                                   _nvmma([dv, block_n], vt))  # fmt: skip
    else:
        vd = GluonTensorDescriptor(v, [v.shape[0], num_kv_heads * dv], [v.stride(0), 1], [block_n, dv],
                                   _nvmma([block_n, dv], vt))  # fmt: skip
    return kd_a, kd_b, vd


def gluon_supports(q_dtype: torch.dtype, kv_dtype: torch.dtype, dim_major: bool, v_widen: bool) -> bool:
    """Which input combinations the kernel has a mode for: FP8 Q/K/V (either V layout, V optionally widened
    when token-major); a 16-bit Q with FP8 K/V, token-major V widened (``Q_QUANT``; an e4m3 P on top of the
    quantised Q measured past the accuracy bound, so the widened V is required); 16-bit Q/K/V of one type,
    token-major (``KV16``)."""
    fp8 = torch.float8_e4m3fn
    wide = (torch.bfloat16, torch.float16)
    if kv_dtype == fp8:
        if q_dtype == fp8:
            return not (dim_major and v_widen)
        return q_dtype in wide and not dim_major and v_widen
    return kv_dtype in wide and q_dtype == kv_dtype and not dim_major and not v_widen


def mla_context_gluon_fwd(q, k, v, out, lse, work, n_items, **kw):
    """One launch of the Gluon kernel over a planned work table (inputs already checked by the caller, and
    ``gluon_supports`` true for them); keyword arguments as ``gluon_launch_args``."""
    fn, grid, args, consts, options = gluon_launch_args(q, k, v, out, lse, work, n_items, **kw)
    # Repeat launches go to the compiled kernel's launcher (Triton's own launch path costs tens of µs a call).
    return launch_jit(fn, grid, args, consts, **options)


def gluon_launch_args(q, k, v, out, lse, work, n_items, *, num_heads, group, d_a, d_b, dv, dim_major,
                      softmax_scale, scale_val, scale_ptr, q_scale_val=None, q_scale_ptr=None,
                      block_n=128, num_stages=2, heads_outer=True,
                      pingpong=False, key_perm=False, v_widen=False, split_kv=False, chip_shares=0,
                      share_rows=0):  # fmt: skip
    """``(kernel, grid, args, consts, options)`` of ``mla_context_gluon_fwd``'s launch, for ``launch_jit``.
    ``chip_shares`` > 1: ``work`` holds 4-int items, each split into that many key shares on chip, share c
    writing partial rows from ``c x share_rows`` (with ``split_kv``)."""
    kv16 = k.dtype != torch.float8_e4m3fn
    q_quant = not kv16 and q.dtype != torch.float8_e4m3fn
    fp8_p = not kv16 and not v_widen
    if q_scale_val is None and q_scale_ptr is None:  # an FP8 q shares the K/V scale
        q_scale_val, q_scale_ptr = scale_val, scale_ptr
    kd_a, kd_b, vd = gluon_descriptors(k, v, d_a, d_b, dv, k.shape[1], dim_major, block_n)
    lse_t = lse if lse is not None else out
    slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    grid = (n_items * num_heads * max(1, chip_shares),)
    args = (q, out, lse_t, kd_a, kd_b, vd, work, n_items, share_rows, scale_ptr if scale_ptr is not None else work,
            float(softmax_scale), float(scale_val), q_scale_ptr if q_scale_ptr is not None else work,
            float(q_scale_val if q_scale_val is not None else 1.0), q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), slt, slh)  # fmt: skip
    consts = dict(
        H=num_heads, GROUP=group, D_A=d_a, D_B=d_b, DV=dv,
        V_DIM_MAJOR=dim_major, SCALE_FROM_PTR=scale_ptr is not None, Q_SCALE_FROM_PTR=q_scale_ptr is not None,
        WRITE_LSE=lse is not None,
        P_OFFSET=8.0 if fp8_p else 0.0, BLOCK_N=block_n, NUM_STAGES=num_stages, KV_ALIGN=16 if dim_major else 1,
        HEADS_OUTER=heads_outer, C_REGS=_C_REGS, V_REGS=_V_REGS, PINGPONG=pingpong, KEY_PERM=key_perm and fp8_p,
        KV16=kv16, Q_QUANT=q_quant, V_WIDEN=bool(v_widen) and not kv16, SPLIT_KV=bool(split_kv),
        CHIP_SHARES=chip_shares > 1,
    )  # fmt: skip
    return _mla_context_gluon_kernel, grid, args, consts, {"num_warps": 4, "maxnreg": _MAXNREG}
