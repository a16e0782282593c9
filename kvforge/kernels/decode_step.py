"""The generation-only step's bookkeeping in one kernel each way: its inputs from the slot stores and the page
table, its results into the slot stores and the output buffer (the CUDA-graph decode step of
:meth:`kvforge.engine.runner.Runner.decode_static`, where each would otherwise be a dozen small torch ops).

``decode_inputs(slots, starts, table, next_new_tokens, width, tokens_per_block)``: ``b`` rows of ``t = width``
tokens, token ``j`` of row ``i`` at flat index ``i * t + j``. ``slots [b]``, ``starts [b]``, ``table [b,
max_blocks]`` (any row stride, page ids) and ``next_new_tokens [>= t, slots]`` are int32/int64. Returns
:class:`DecodeInputs`: ``ids`` int64 ``next_new_tokens[j, slots[i]]``, ``positions`` int64 ``starts[i] + j``,
``write_rows`` int64 ``table[i, p // tpb] * tpb + p % tpb`` (the token's flat latent-pool row), ``table_rows
[b * t, max_blocks]`` int32 (row ``i`` of the table per token: the decode kernel's block table) and ``lens`` int32
``p + 1``.

``decode_finish(best, accepted, drafts, slots, stores, out)``: ``best [b, t]`` int32 greedy tokens, ``accepted
[b]`` int32 counts in ``1 .. t``, ``drafts [b]`` int (None: 0), ``t <= 2`` (one draft token at most). Per row
``i`` at slot ``s = slots[i]``: ``stores.new_tokens[j, s] = best[i, j]`` for ``j < accepted[i]``, else 0
(``j < t``); ``stores.next_new_tokens[0, s]`` = the last accepted token, ``[1, s]`` = the draft (``t == 2``);
``stores.new_token_counts[s] = accepted[i]``; ``stores.next_draft_tokens[s, 0]`` = the draft; ``out [b, t + 2]``
int32 = ``[best[i], accepted[i], draft]``. Rows sharing a slot (padding rows all name the trash slot) race only
among themselves. Values (slots, pages, positions, counts) are not checked: the engine builds them on the device.
``decode_inputs_ref`` / ``decode_finish_ref`` are the plain-torch forms (the engine's path without kernels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvforge.kernels import _runtime as _rt
from kvforge.kernels._checks import check_int, check_no_overlap, check_operand, same_device
from kvforge.kernels.slot_ops import SlotStores

__all__ = ["DecodeInputs", "decode_finish", "decode_finish_ref", "decode_inputs", "decode_inputs_ref"]

_INTS = (torch.int32, torch.int64)


class DecodeInputs(NamedTuple):
    ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    table_rows: torch.Tensor
    lens: torch.Tensor


@triton.jit(do_not_specialize=["st", "sn"])
def _decode_inputs_kernel(
    slots_ptr, starts_ptr, table_ptr, nnt_ptr, ids_ptr, pos_ptr, rows_ptr, trows_ptr, lens_ptr, st, sn, n_blocks,
    T: tl.constexpr, TPB: tl.constexpr, BLOCK_MB: tl.constexpr,
):  # fmt: skip
    f = tl.program_id(0).to(tl.int64)
    i = f // T
    j = f % T
    slot = tl.load(slots_ptr + i).to(tl.int64)
    p = tl.load(starts_ptr + i).to(tl.int64) + j
    tl.store(ids_ptr + f, tl.load(nnt_ptr + j * sn + slot).to(tl.int64))
    tl.store(pos_ptr + f, p)
    page = tl.load(table_ptr + i * st + p // TPB).to(tl.int64)
    tl.store(rows_ptr + f, page * TPB + p % TPB)
    tl.store(lens_ptr + f, (p + 1).to(tl.int32))
    for c in range(0, n_blocks, BLOCK_MB):
        offs = c + tl.arange(0, BLOCK_MB)
        m = offs < n_blocks
        tl.store(trows_ptr + f * n_blocks + offs, tl.load(table_ptr + i * st + offs, mask=m).to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["s_new", "s_next", "s_draft"])
def _decode_finish_kernel(
    best_ptr, acc_ptr, draft_ptr, slots_ptr, new_ptr, next_ptr, cnt_ptr, dft_ptr, out_ptr, s_new, s_next, s_draft,
    T: tl.constexpr, BLOCK_T: tl.constexpr, HAS_DRAFT: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    acc = tl.load(acc_ptr + i)
    j = tl.arange(0, BLOCK_T)
    m = j < T
    best = tl.load(best_ptr + i * T + j, mask=m, other=0)
    draft = tl.load(draft_ptr + i).to(tl.int32)
    if not HAS_DRAFT:  # draft_ptr is a stand-in: no draft, 0 stored
        draft = draft * 0
    last = tl.sum(tl.where(j == acc - 1, best, 0), 0)
    tl.store(new_ptr + j * s_new + slot, tl.where(j < acc, best, 0).to(new_ptr.dtype.element_ty), mask=m)
    tl.store(next_ptr + slot, last.to(next_ptr.dtype.element_ty))
    if T > 1:
        tl.store(next_ptr + s_next + slot, draft.to(next_ptr.dtype.element_ty))
    tl.store(cnt_ptr + slot, acc.to(cnt_ptr.dtype.element_ty))
    tl.store(dft_ptr + slot * s_draft, draft.to(dft_ptr.dtype.element_ty))
    tl.store(out_ptr + i * (T + 2) + j, best, mask=m)
    tl.store(out_ptr + i * (T + 2) + T, acc)
    tl.store(out_ptr + i * (T + 2) + T + 1, draft)


def decode_inputs(
    slots: torch.Tensor,
    starts: torch.Tensor,
    table: torch.Tensor,
    next_new_tokens: torch.Tensor,
    width: int,
    tokens_per_block: int,
) -> DecodeInputs:
    """See the module docstring."""
    check_operand("slots", slots, dtype=_INTS, ndim=1, contiguous=True)
    b, dev = slots.shape[0], slots.device
    t = check_int("width", width, 1)
    tpb = check_int("tokens_per_block", tokens_per_block, 1)
    check_operand("starts", starts, dtype=_INTS, ndim=1, contiguous=True, shape=(b,), device=dev)
    check_operand("table", table, dtype=_INTS, ndim=2, last_dim_contiguous=True, shape=(b, None), device=dev)
    check_operand("next_new_tokens", next_new_tokens, dtype=_INTS, ndim=2, last_dim_contiguous=True, device=dev)
    if next_new_tokens.shape[0] < t:
        raise ValueError(f"next_new_tokens: expected >= {t} rows (width), got {next_new_tokens.shape[0]}")
    n, mb = b * t, table.shape[1]
    out = DecodeInputs(
        *(torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3)),
        torch.empty(n, mb, dtype=torch.int32, device=dev),
        torch.empty(n, dtype=torch.int32, device=dev),
    )
    if n:
        _decode_inputs_kernel[(n,)](
            slots, starts, table, next_new_tokens, *out, table.stride(0), next_new_tokens.stride(0), mb,
            T=t, TPB=tpb, BLOCK_MB=min(1024, _rt.next_pow2(max(mb, 1))), num_warps=1,
        )  # fmt: skip
    return out


def decode_inputs_ref(
    slots: torch.Tensor,
    starts: torch.Tensor,
    table: torch.Tensor,
    next_new_tokens: torch.Tensor,
    width: int,
    tokens_per_block: int,
) -> DecodeInputs:
    """The plain-torch form."""
    b, t, tpb, dev = slots.shape[0], width, tokens_per_block, slots.device
    row_of = torch.arange(b, device=dev).repeat_interleave(t)
    tok = torch.arange(t, device=dev).repeat(b)
    ids = next_new_tokens[:t, slots.long()].t().reshape(-1).long()
    pos = starts[row_of].long() + tok
    rows = table[row_of, pos // tpb].long() * tpb + pos % tpb
    return DecodeInputs(ids, pos, rows, table[row_of].to(torch.int32), (pos + 1).to(torch.int32))


def _check_finish(best, accepted, drafts, slots, stores, out) -> None:
    check_operand("best", best, dtype=torch.int32, ndim=2, contiguous=True)
    (b, t), dev = best.shape, best.device
    if t > 2:
        raise ValueError(f"best: expected t <= 2 tokens per row (one draft token at most), got {t}")
    check_operand("accepted", accepted, dtype=torch.int32, ndim=1, contiguous=True, shape=(b,), device=dev)
    if drafts is not None:
        check_operand("drafts", drafts, dtype=_INTS, ndim=1, contiguous=True, shape=(b,), device=dev)
    check_operand("slots", slots, dtype=_INTS, ndim=1, contiguous=True, shape=(b,), device=dev)
    if not isinstance(stores, SlotStores):
        raise TypeError(f"stores: expected a SlotStores, got {type(stores).__name__}")
    if not same_device(stores.device, dev):
        raise ValueError(f"stores: expected stores on {dev}, got {stores.device}")
    if stores.new_tokens.shape[0] < t or stores.next_new_tokens.shape[0] < t:
        raise ValueError(f"stores: expected new_tokens and next_new_tokens with >= {t} rows")
    check_operand("out", out, dtype=torch.int32, ndim=2, contiguous=True, shape=(b, t + 2), device=dev)
    names = ("stores.new_tokens", "stores.next_new_tokens", "stores.new_token_counts", "stores.next_draft_tokens")
    outputs = {"out": out, **dict(zip(names, stores.tensors()))}
    check_no_overlap(outputs, {"best": best, "accepted": accepted, "drafts": drafts, "slots": slots})


def decode_finish(
    best: torch.Tensor,
    accepted: torch.Tensor,
    drafts: torch.Tensor | None,
    slots: torch.Tensor,
    stores: SlotStores,
    out: torch.Tensor,
) -> None:
    """See the module docstring."""
    _check_finish(best, accepted, drafts, slots, stores, out)
    b, t = best.shape
    if b:
        st = stores
        _decode_finish_kernel[(b,)](
            best, accepted, drafts if drafts is not None else accepted, slots, st.new_tokens, st.next_new_tokens,
            st.new_token_counts, st.next_draft_tokens, out, st.new_tokens.stride(0), st.next_new_tokens.stride(0),
            st.next_draft_tokens.stride(0), T=t, BLOCK_T=_rt.next_pow2(t), HAS_DRAFT=drafts is not None,
            num_warps=1,
        )  # fmt: skip


def decode_finish_ref(
    best: torch.Tensor,
    accepted: torch.Tensor,
    drafts: torch.Tensor | None,
    slots: torch.Tensor,
    stores: SlotStores,
    out: torch.Tensor,
) -> None:
    """The plain-torch form (index writes)."""
    b, t = best.shape
    dev = best.device
    if drafts is None:
        drafts = torch.zeros(b, dtype=torch.long, device=dev)
    sl = slots.long()
    last = best.long().gather(1, (accepted - 1).long()[:, None])[:, 0]
    new = torch.where(torch.arange(t, device=dev)[None, :] < accepted[:, None], best, 0)
    nxt = torch.stack([last, drafts.long()], 1)[:, :t]
    st = stores
    st.new_tokens[:t, sl] = new.t().to(st.new_tokens.dtype)
    st.next_new_tokens[:t, sl] = nxt.t().to(st.next_new_tokens.dtype)
    st.new_token_counts[sl] = accepted.to(st.new_token_counts.dtype)
    st.next_draft_tokens[sl, :1] = drafts[:, None].to(st.next_draft_tokens.dtype)
    out[:, :t] = best
    out[:, t] = accepted
    out[:, t + 1] = drafts.to(torch.int32)
