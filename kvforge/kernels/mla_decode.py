"""Absorbed-MLA decode attention over a paged latent cache, split over the keys (flash-decoding) and merged.

Each request b has one query token with H heads, ``q [B, H, D_qk]`` (DeepSeek: 576 = 512 latent + 64 rope, the
up-projections absorbed into q and the output). All heads share one latent cache row per token, stored in pages:
``kv_cache [num_pages, page_size, D_qk]``. Token t of request b lives in page ``block_table[b, t // page_size]``
at row ``t % page_size``; the request has ``seq_lens[b]`` tokens. Keys are whole rows, values are the first
``v_head_dim`` (512) columns of the same rows:

    s = softmax_scale · q · kᵀ        out = softmax(s) · v        lse = log Σ exp(s)   (natural log, fp32)

A request with ``seq_lens[b] == 0`` gets ``out = 0`` and ``lse = −inf`` (the empty-share convention of
``merge_attention_states``). q and kv_cache are bf16 (fp16/fp32 also accepted, both the same dtype); out takes
q's dtype. The keys are cut into ``num_splits`` contiguous shares per request (chosen from the shapes only, so
no device→host sync and the call is graph-capturable); each share writes an fp32 partial output and lse, and
``merge_attention_states`` combines them exactly. Checks, before any launch: types, dtypes, shapes, devices
(meta and non-interpreter CPU refused), ``out``/``lse`` not overlapping any input or each other, and, unless
``check_values=False``, seq_lens within ``[0, max_pages · page_size]`` and every page id a request reads within
``[0, num_pages)`` (one device→host read; callers whose tables come from a checked page table may skip it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_shape, check_tensor
from kvforge.kernels._runtime import ConfigTable, TunedKernel, interpreting, num_sms

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_ptr,
    po_ptr,
    plse_ptr,
    H,
    tiles_per_split,
    s_qb,
    s_qh,
    s_kp,
    s_kr,
    s_btb,
    s_pob,
    s_poh,
    s_pos,
    s_plb,
    s_plh,
    sm_scale_log2,
    PAGE_SIZE: tl.constexpr,
    D_V: tl.constexpr,
    D_R: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dv = tl.arange(0, D_V)
    dr = tl.arange(0, D_R)
    q_rows = q_ptr + b * s_qb + heads.to(tl.int64)[:, None] * s_qh
    q_nope = tl.load(q_rows + dv[None, :], mask=hmask[:, None], other=0.0)
    q_rope = tl.load(q_rows + D_V + dr[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot multiplies bit patterns; fp32 there is exact
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    seq_len = tl.load(seq_ptr + b)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_V), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b * s_btb
    for n0 in tl.range(start, end, BLOCK_N):
        tok = n0 + offs_n
        nmask = tok < end
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
        row = page * s_kp + (tok % PAGE_SIZE).to(tl.int64) * s_kr
        kv = tl.load(kv_ptr + row[:, None] + dv[None, :], mask=nmask[:, None], other=0.0)
        k_rope = tl.load(kv_ptr + row[:, None] + D_V + dr[None, :], mask=nmask[:, None], other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(kv))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
        s = tl.where(nmask[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc)
        m = m_new
    # Empty share (no keys): lse = -inf and a zero partial; the merge gives it weight 0.
    has = l_sum > 0.0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, (m + tl.log2(tl.where(has, l_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    po = po_ptr + b * s_pob + split.to(tl.int64) * s_pos + heads.to(tl.int64)[:, None] * s_poh + dv[None, :]
    tl.store(po, out, mask=hmask[:, None])
    tl.store(plse_ptr + b * s_plb + heads.to(tl.int64) * s_plh + split, lse, mask=hmask)


def _cfg(bh: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _keep(cfg: triton.Config, key: tuple) -> bool:
    # key = (D_V, D_R, dtype, heads rounded to a power of two >= 16): no head tile wider than the heads.
    return cfg.kwargs["BLOCK_H"] <= max(16, key[3])


_CONFIGS = ConfigTable(
    fallback=[_cfg(16, 32, 4, 2)],
    interpreter=_cfg(16, 16, 1, 1),
    by_arch={
        9: [
            _cfg(16, 64, 4, 2),
            _cfg(16, 32, 4, 3),
            _cfg(32, 32, 4, 2),
            _cfg(64, 32, 8, 2),
            _cfg(64, 32, 8, 3),
            _cfg(64, 64, 8, 1),
        ]
    },
    keep=_keep,
)
_SPLIT = TunedKernel("mla_decode_split", _mla_decode_split_kernel, _CONFIGS)


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
    kv_cache = check_tensor("kv_cache", kv_cache, dtype=q.dtype, ndim=3, device=dev, last_dim_contiguous=True)
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
    if not (0 < v_head_dim < D) or v_head_dim & (v_head_dim - 1) or d_rope & (d_rope - 1):
        raise ValueError(
            f"v_head_dim: expected a power of two below q's width {D} leaving a power-of-two rope part, "
            f"got {v_head_dim} (576 = 512 + 64 for DeepSeek MLA)"
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


def default_num_splits(batch: int, head_tiles: int, max_tiles: int, sms: int) -> int:
    """Key shares per request: up to about two programs per SM, choosing the count whose programs fill the last
    wave best (a wave of 2 x SMs programs; 300 programs on 132 SMs leave most of a third wave idle)."""
    base = max(1, batch * head_tiles)
    slots = 2 * sms
    best, best_eff = 1, 0.0
    for s in range(1, max(1, min(max_tiles, triton.cdiv(slots, base))) + 1):
        progs = base * s
        eff = progs / (triton.cdiv(progs, slots) * slots)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


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
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q [B, H, D_qk]`` over the paged latent cache; returns ``out [B, H, v_head_dim]``
    (q's dtype) and, with ``return_lse``, ``lse [B, H]`` fp32. ``out``/``lse`` buffers are written when given."""
    B, H, D, num_pages, page_size, max_pages = _check_args(
        q, kv_cache, block_table, seq_lens, softmax_scale, v_head_dim
    )
    dev = q.device
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values: expected a bool, got {type(check_values).__name__}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if num_splits is not None and not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits: expected a value in [1, 65535], got {num_splits}")
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
    check_no_overlap(
        {"out": out, "lse": lse},
        {"q": q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens},
    )
    if B > 65535:
        raise ValueError(f"q: expected at most 65535 requests per call, got {B}")
    if check_values:
        _check_values(block_table, seq_lens, num_pages, page_size)
    if B == 0:
        return (out, lse) if return_lse else out
    key = (v_head_dim, D - v_head_dim, str(q.dtype).split(".")[-1], max(16, triton.next_power_of_2(H)))
    upcast = interpreting() and q.dtype == torch.bfloat16
    sms = num_sms(dev)

    def run(cfg: triton.Config) -> tuple[torch.Tensor, torch.Tensor]:
        block_n, block_h = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_H"]
        head_tiles = triton.cdiv(H, block_h)
        max_tiles = max(1, triton.cdiv(max_pages * page_size, block_n))
        splits = num_splits if num_splits is not None else default_num_splits(B, head_tiles, max_tiles, sms)
        splits = min(splits, max_tiles)
        tiles_per_split = triton.cdiv(max_tiles, splits)
        partial = torch.empty((B, H, splits, v_head_dim), dtype=torch.float32, device=dev)
        partial_lse = torch.empty((B, H, splits), dtype=torch.float32, device=dev)
        _mla_decode_split_kernel[(B, head_tiles, splits)](
            q, kv_cache, block_table, seq_lens, partial, partial_lse, H, tiles_per_split,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            partial.stride(0), partial.stride(1), partial.stride(2), partial_lse.stride(0), partial_lse.stride(1),
            float(softmax_scale) * 1.4426950408889634,
            PAGE_SIZE=page_size, D_V=v_head_dim, D_R=D - v_head_dim, UPCAST=upcast,
            BLOCK_H=block_h, BLOCK_N=block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return partial, partial_lse

    # Tuned once per key on a GPU without a committed config (idempotent: it writes only the partials).
    partial, partial_lse = run(_SPLIT.config_for(key, run))
    from kvforge.kernels.merge_states import merge_attention_states

    # [B, H, S, D] viewed as [S, B, H, D]: the merge reads any strides with D contiguous.
    merge_attention_states(partial.permute(2, 0, 1, 3), partial_lse.permute(2, 0, 1), out=out, out_lse=lse)
    # An empty request merges to 0 with lse -inf already (every share reported -inf).
    return (out, lse) if return_lse else out


def mla_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    v_head_dim: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch fp32 reference, one request at a time: gathers the request's rows page by page, then
    ``softmax(scale · q kᵀ) v``. Returns ``(out [B, H, v_head_dim] fp32, lse [B, H] fp32)``."""
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
        rows = torch.cat([kv_cache[p] for p in pages])[:n].float()
        s = (q[b].float() @ rows.T) * softmax_scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :v_head_dim]
    return out, lse
