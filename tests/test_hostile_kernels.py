"""Hostile input to every public kernel entry point kvforge's kernels own: each bad call must raise TypeError or
ValueError naming the argument *before* any launch (the outputs it was given stay untouched), never crash the
process, write through an alias, or silently truncate.

Classes (the ``cls`` column of CASES): type, dtype, shape, device (meta tensors), value (NaN/inf where it
means something, out-of-range ids and counts, loosely typed numbers), alias (overlapping, stride-0 or shared
outputs). ``test_case_counts`` prints the count per class; the regression tests for issue 17 (2.2, 2.4, 2.9)
follow the table. Everything runs on the CPU interpreter at tiny sizes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvforge.kernels._checks import has_internal_overlap, tensors_overlap
from kvforge.kernels._runtime import interpreting
from kvforge.kernels.block_offsets import copy_block_offsets
from kvforge.kernels.greedy_accept import greedy_accept
from kvforge.kernels.kv_pack import KVPackLayout, KVPackPlan, pack_kv_blocks, unpack_kv_blocks
from kvforge.kernels.merge_states import merge_attention_states, merge_attention_states_ref
from kvforge.kernels.mla_decode import mla_decode_attention
from kvforge.kernels.pinned_pair import copy_small_pinned_pair
from kvforge.kernels.quantize_fp8 import quantize_fp8
from kvforge.kernels.rms_norm import rms_norm
from kvforge.kernels.rotary import rotary
from kvforge.kernels.slot_ops import SlotStores, StepInputs, slot_scatter, step_gather, step_gather_ref
from kvforge.kernels.state_select import select_accepted_states
from kvforge.kernels.swiglu import swiglu

# The cases build CPU tensors, which only the interpreter accepts: on a GPU machine every case would be refused
# by the device check before the check it is about (the device class is covered there by the meta cases).
pytestmark = pytest.mark.skipif(not interpreting(), reason="the cases build CPU tensors (interpreter only)")

META = torch.device("meta")


@dataclass
class Case:
    op: str
    cls: str
    what: str
    call: Callable[[], object]  # builds its inputs and makes the bad call
    exc: type[Exception]
    match: str = ""


def _merge(o=None, lse=None, **kw):
    o = torch.randn(2, 3, 2, 8) if o is None else o
    lse = torch.randn(2, 3, 2) if lse is None else lse
    return merge_attention_states(o, lse, **kw)


def _offsets(table=None, index=None, scales=(1, 1), kv=(0, 0), out=None):
    table = torch.randint(-1, 50, (2, 5, 4), dtype=torch.int32) if table is None else table
    index = torch.tensor([0, 3], dtype=torch.int32) if index is None else index
    out = torch.zeros(2, 3, 2, 4, dtype=torch.int32) if out is None else out
    return copy_block_offsets(table, index, scales, kv, out)


def _stores(dtype=torch.int32):
    return SlotStores.zeros(6, 3, 3, 2, "cpu", dtype)


def _step_outputs(n=3):
    return (torch.ones(n, 3, dtype=torch.int32), torch.ones(n, 3, dtype=torch.int32),
            torch.ones(n, dtype=torch.int32), torch.ones(n, 2, dtype=torch.int32))  # fmt: skip


def _scatter(stores=None, slot_ids=None, outs=None, **kw):
    stores = _stores() if stores is None else stores
    slot_ids = torch.tensor([0, 2, 5]) if slot_ids is None else slot_ids
    outs = _step_outputs() if outs is None else outs
    return slot_scatter(stores, slot_ids, *outs, **kw)


def _gather(stores=None, slot_ids=None, t=2, **kw):
    stores = _stores() if stores is None else stores
    slot_ids = torch.tensor([0, 2, 5]) if slot_ids is None else slot_ids
    return step_gather(stores, slot_ids, t, **kw)


def _pools(n=2, pages=6, tpb=2, elems=8, dtype=torch.bfloat16):
    return [torch.randn(pages, tpb, elems).to(dtype) for _ in range(n)]


def _decode(**over):
    a = dict(q=torch.randn(2, 3, 48), kv_cache=torch.randn(6, 4, 48),
             block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
             seq_lens=torch.tensor([5, 12], dtype=torch.int32), softmax_scale=0.1, v_head_dim=32)  # fmt: skip
    a.update(over)
    return mla_decode_attention(a.pop("q"), a.pop("kv_cache"), a.pop("block_table"), a.pop("seq_lens"), **a)


def _ctx_plan(**over):
    """MLAContextPlan.plan for a valid tiny batch (2 requests, 2 heads), with ``over`` replacing arguments."""
    from kvforge.kernels.mla_context import MLAContextPlan

    a = dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
             cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32), num_heads=2, num_kv_heads=2, head_dim_qk=32,
             head_dim_v=16)  # fmt: skip
    a.update(over)
    return MLAContextPlan.plan(a.pop("cu_seqlens_q"), a.pop("cu_seqlens_kv"), **a)


def _kv_splits(*args):
    from kvforge.kernels.mla_context import context_kv_splits

    return context_kv_splits(*args)


def _ctx(**over):
    """mla_context_attention on a valid tiny FP8 batch (2 requests, 2 heads), with ``over`` replacing arguments."""
    from kvforge.kernels.mla_context import mla_context_attention

    f8 = torch.float8_e4m3fn
    a = dict(q=torch.randn(5, 2, 32).to(f8), k=torch.randn(9, 2, 32).to(f8), v=torch.randn(9, 2, 16).to(f8),
             cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
             cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32))  # fmt: skip
    a.update(over)
    return mla_context_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_kv"), **a)


def _shared_stores():
    buf = torch.zeros(3, 6, dtype=torch.int32)
    return SlotStores(buf, buf, torch.zeros(6, dtype=torch.int32), torch.zeros(6, 2, dtype=torch.int32))


_QBUF = torch.zeros(64, dtype=torch.uint8)


def _select(pool=None, live=None, scratch=None, accepted=None):
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    pool = torch.randn(6, 4) if pool is None else pool
    live = i32([0, 1]) if live is None else live
    scratch = i32([[2], [3]]) if scratch is None else scratch
    accepted = i32([2, 1]) if accepted is None else accepted
    return select_accepted_states(pool, live, scratch, accepted)


_POS = torch.zeros(3, dtype=torch.long)

# fmt: off
CASES = [
    # ---- the engine's accepted-state select and fused ops
    Case("state_select", "type", "pool as a list", lambda: _select(pool=[[1.0]]), TypeError, "pool"),
    Case("state_select", "dtype", "int64 live", lambda: _select(live=torch.tensor([0, 1])), TypeError, "live"),
    Case("state_select", "shape", "scratch of another N", lambda: _select(scratch=torch.zeros(3, 1, dtype=torch.int32)),
         ValueError, "scratch"),
    Case("state_select", "value", "accepted 0", lambda: _select(accepted=torch.tensor([0, 1], dtype=torch.int32)),
         ValueError, "accepted"),
    Case("state_select", "value", "live past the pool", lambda: _select(live=torch.tensor([0, 6], dtype=torch.int32)),
         ValueError, "live"),
    Case("state_select", "device", "meta pool", lambda: _select(pool=torch.empty(6, 4, device=META)), ValueError,
         "meta"),
    Case("state_select", "alias", "indices inside the pool",
         lambda: (lambda p: _select(pool=p, live=p[0, :2]))(torch.zeros(6, 4, dtype=torch.int32)), ValueError,
         "overlap"),
    Case("rms_norm", "type", "x as a list", lambda: rms_norm([[1.0]], torch.ones(1)), TypeError, "x"),
    Case("rms_norm", "shape", "weight of another D", lambda: rms_norm(torch.randn(3, 4), torch.ones(5)), ValueError,
         "weight"),
    Case("rms_norm", "value", "NaN eps", lambda: rms_norm(torch.randn(3, 4), torch.ones(4), float("nan")),
         ValueError, "eps"),
    Case("rms_norm", "device", "meta x", lambda: rms_norm(torch.empty(3, 4, device=META), torch.ones(4)),
         ValueError, "meta"),
    Case("rms_norm", "alias", "out is x", lambda: (lambda x: rms_norm(x, torch.ones(4), out=x))(torch.randn(3, 4)),
         ValueError, "overlap"),
    Case("swiglu", "type", "gate as a float", lambda: swiglu(1.0, torch.randn(3, 4)), TypeError, "gate"),
    Case("swiglu", "dtype", "up of another dtype", lambda: swiglu(torch.randn(3, 4), torch.randn(3, 4).half()),
         TypeError, "up"),
    Case("swiglu", "device", "meta gate", lambda: swiglu(torch.empty(3, 4, device=META), torch.randn(3, 4)),
         ValueError, "meta"),
    Case("swiglu", "alias", "out is up", lambda: (lambda u: swiglu(torch.randn(3, 4), u, out=u))(torch.randn(3, 4)),
         ValueError, "overlap"),
    Case("rotary", "type", "positions as a list", lambda: rotary(torch.randn(3, 4), [0, 1, 2], torch.zeros(9, 4)),
         TypeError, "positions"),
    Case("rotary", "shape", "odd width", lambda: rotary(torch.randn(3, 5), _POS, torch.zeros(9, 5)), ValueError,
         "even"),
    Case("rotary", "value", "position past the table",
         lambda: rotary(torch.randn(3, 4), torch.tensor([0, 9, 1]), torch.zeros(9, 4), check_values=True),
         ValueError, "positions"),
    Case("rotary", "device", "meta x", lambda: rotary(torch.empty(3, 4, device=META), _POS, torch.zeros(9, 4)),
         ValueError, "meta"),
    Case("rotary", "alias", "out inside the table",
         lambda: (lambda cs: rotary(torch.randn(3, 4), _POS, cs, out=cs[:3]))(torch.zeros(9, 4)), ValueError,
         "overlap"),
    Case("greedy_accept", "type", "tokens as a list",
         lambda: greedy_accept(torch.randn(2, 2, 5), [[0, 0], [0, 0]]), TypeError, "tokens"),
    Case("greedy_accept", "shape", "T over the limit",
         lambda: greedy_accept(torch.randn(1, 17, 5), torch.zeros(1, 17, dtype=torch.long)), ValueError, "logits"),
    Case("greedy_accept", "device", "meta logits",
         lambda: greedy_accept(torch.empty(2, 2, 5, device=META), torch.zeros(2, 2, dtype=torch.long)), ValueError,
         "meta"),
    Case("greedy_accept", "alias", "best inside the tokens",
         lambda: (lambda tk: greedy_accept(torch.randn(2, 2, 5), tk, best=tk))(torch.zeros(2, 2, dtype=torch.int32)),
         ValueError, "overlap"),
    # ---- merge_attention_states
    Case("merge", "type", "outputs as a list of lists", lambda: _merge(o=[[1.0]]), TypeError, "outputs"),
    Case("merge", "type", "outputs as a str", lambda: _merge(o="abc"), TypeError, "outputs"),
    Case("merge", "dtype", "int outputs", lambda: _merge(o=torch.ones(2, 3, 2, 8, dtype=torch.int32)), TypeError),
    Case("merge", "dtype", "fp16 lses", lambda: _merge(lse=torch.randn(2, 3, 2).half()), TypeError, "lses"),
    Case("merge", "shape", "lses of another T", lambda: _merge(lse=torch.randn(2, 4, 2)), ValueError, "lses"),
    Case("merge", "shape", "S = 0", lambda: _merge(o=torch.randn(0, 3, 2, 8), lse=torch.randn(0, 3, 2)), ValueError),
    Case("merge", "shape", "out of another D", lambda: _merge(out=torch.empty(3, 2, 4)), ValueError, "out"),
    Case(
        "merge",
        "device",
        "meta outputs",
        lambda: _merge(o=torch.empty(2, 3, 2, 8, device=META), lse=torch.empty(2, 3, 2, device=META)),
        ValueError,
        "meta",
    ),
    Case("merge", "device", "meta out", lambda: _merge(out=torch.empty(3, 2, 8, device=META)), ValueError),
    Case(
        "merge",
        "alias",
        "out is outputs[0]",
        lambda: (lambda o: _merge(o=o, out=o[0]))(torch.randn(2, 3, 2, 8)),
        ValueError,
        "overlaps",
    ),
    Case(
        "merge",
        "alias",
        "out_lse inside lses",
        lambda: (lambda lse: _merge(lse=lse, out_lse=lse[1]))(torch.randn(2, 3, 2)),
        ValueError,
        "overlaps",
    ),
    Case("merge", "alias", "stride-0 out", lambda: _merge(out=torch.empty(1, 2, 8).expand(3, 2, 8)), ValueError),
    # ---- copy_block_offsets
    Case("offsets", "type", "out as a list", lambda: _offsets(out=[[0]]), TypeError, "out"),
    Case("offsets", "type", "scales of floats", lambda: _offsets(scales=(1.5, 2.0)), TypeError, "index_scales"),
    Case(
        "offsets", "dtype", "int64 table", lambda: _offsets(table=torch.zeros(2, 5, 4, dtype=torch.int64)), TypeError
    ),
    Case("offsets", "dtype", "float copy_index", lambda: _offsets(index=torch.tensor([0.0, 1.0])), TypeError),
    Case(
        "offsets",
        "shape",
        "out with too few rows",
        lambda: _offsets(out=torch.zeros(2, 1, 2, 4, dtype=torch.int32)),
        ValueError,
        "out",
    ),
    Case("offsets", "shape", "3 scales for 2 pools", lambda: _offsets(scales=(1, 1, 1)), ValueError),
    Case(
        "offsets",
        "value",
        "row index out of range",
        lambda: _offsets(index=torch.tensor([0, 5], dtype=torch.int32)),
        ValueError,
        "copy_index",
    ),
    Case(
        "offsets",
        "value",
        "negative row index",
        lambda: _offsets(index=torch.tensor([-1], dtype=torch.int32)),
        ValueError,
        "copy_index",
    ),
    Case("offsets", "value", "scale past int32", lambda: _offsets(scales=(2**31, 1)), ValueError),
    Case(
        "offsets",
        "device",
        "meta out",
        lambda: _offsets(out=torch.zeros(2, 3, 2, 4, dtype=torch.int32, device=META)),
        ValueError,
        "meta",
    ),
    Case(
        "offsets",
        "alias",
        "out overlapping the table",
        lambda: (lambda b: _offsets(table=b[:40].view(2, 5, 4), out=b[16:64].view(2, 3, 2, 4)))(
            torch.zeros(64, dtype=torch.int32)
        ),
        ValueError,
        "overlaps",
    ),
    Case(
        "offsets",
        "alias",
        "stride-0 out rows",
        lambda: _offsets(out=torch.zeros(2, 1, 2, 4, dtype=torch.int32).expand(2, 3, 2, 4)),
        ValueError,
    ),
    # ---- SlotStores / slot_scatter / step_gather
    Case("scatter", "type", "stores as a tuple", lambda: _scatter(stores=tuple(_stores().tensors())), TypeError),
    Case("scatter", "type", "row_begin 1.0", lambda: _scatter(row_begin=1.0), TypeError, "row_begin"),
    Case("scatter", "type", "row_begin True", lambda: _scatter(row_begin=True), TypeError, "row_begin"),
    Case("scatter", "dtype", "float slot ids", lambda: _scatter(slot_ids=torch.tensor([0.0, 1.0, 2.0])), TypeError),
    Case(
        "scatter",
        "dtype",
        "float step outputs",
        lambda: _scatter(outs=(torch.ones(3, 3), *_step_outputs()[1:])),
        TypeError,
        "new_tokens",
    ),
    Case("scatter", "shape", "too few output rows", lambda: _scatter(row_begin=1), ValueError, "rows"),
    Case("scatter", "value", "slot id out of range", lambda: _scatter(slot_ids=torch.tensor([0, 6, 1])), ValueError),
    Case(
        "scatter", "value", "slot id 2**32 + 2", lambda: _scatter(slot_ids=torch.tensor([0, 2**32 + 2, 1])), ValueError
    ),
    Case("scatter", "value", "duplicate slot ids", lambda: _scatter(slot_ids=torch.tensor([1, 1, 2])), ValueError),
    Case("scatter", "value", "negative row_begin", lambda: _scatter(row_begin=-1), ValueError, "row_begin"),
    Case(
        "scatter", "device", "meta stores", lambda: _scatter(stores=SlotStores.zeros(6, 3, 3, 2, "meta")), ValueError
    ),
    Case("scatter", "alias", "two stores sharing memory", _shared_stores, ValueError, "overlaps"),
    Case(
        "scatter",
        "alias",
        "stride-0 counts store",
        lambda: SlotStores(
            torch.zeros(3, 6, dtype=torch.int32),
            torch.zeros(3, 6, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32).expand(6),
            torch.zeros(6, 2, dtype=torch.int32),
        ),
        ValueError,
        "stride-0",
    ),
    Case(
        "scatter",
        "alias",
        "step output is a store",
        lambda: (
            lambda st: _scatter(stores=st, outs=(*_step_outputs()[:2], st.new_token_counts[:3], _step_outputs()[3]))
        )(_stores()),
        ValueError,
        "overlaps",
    ),
    Case("gather", "type", "tokens_per_row 2.0", lambda: _gather(t=2.0), TypeError, "tokens_per_row"),
    Case("gather", "type", "draft_len '1'", lambda: _gather(draft_len="1"), TypeError, "draft_len"),
    Case("gather", "type", "out as a tuple", lambda: _gather(out=(1, 2, 3, 4)), TypeError, "out"),
    Case("gather", "device", "meta slot ids", lambda: _gather(slot_ids=torch.tensor([1], device=META)), ValueError,
         "slot_ids"),
    Case("gather", "dtype", "bool slot ids", lambda: _gather(slot_ids=torch.tensor([True])), TypeError, "slot_ids"),
    Case("gather", "value", "tokens_per_row 0", lambda: _gather(t=0), ValueError, "tokens_per_row"),
    Case("gather", "value", "draft_len past the store", lambda: _gather(draft_len=3), ValueError, "draft_len"),
    Case("gather", "value", "slot id -1", lambda: _gather(slot_ids=torch.tensor([-1])), ValueError, "slot_ids"),
    Case(
        "gather",
        "value",
        "int32 offsets for int64 counts",
        lambda: _gather(
            stores=_stores(torch.int64),
            slot_ids=torch.tensor([1]),
            t=2,
            out=StepInputs(
                torch.zeros(2, dtype=torch.int64),
                torch.zeros(2, dtype=torch.int32),
                torch.zeros(1, 1, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int32),
            ),
        ),
        ValueError,
        "position_offsets",
    ),
    Case(
        "gather",
        "alias",
        "outputs sharing one buffer",
        lambda: (
            lambda b: _gather(slot_ids=torch.tensor([1]), t=2, out=StepInputs(b[:2], b[:2], b[2:3].view(1, 1), b[3:4]))
        )(torch.zeros(8, dtype=torch.int32)),
        ValueError,
        "overlaps",
    ),
    Case(
        "gather",
        "alias",
        "output inside a store",
        lambda: (
            lambda st: _gather(
                stores=st,
                slot_ids=torch.tensor([1]),
                t=2,
                out=StepInputs(
                    st.new_tokens[0, :2],
                    torch.zeros(2, dtype=torch.int32),
                    torch.zeros(1, 1, dtype=torch.int32),
                    st.next_new_tokens[0, :1],
                ),
            )
        )(_stores()),
        ValueError,
        "overlaps",
    ),
    # ---- quantize_fp8
    Case("quantize", "type", "x as a list", lambda: quantize_fp8([1.0, 2.0], 1.0), TypeError, "x"),
    Case("quantize", "type", "scale as a str", lambda: quantize_fp8(torch.randn(4, 8), "1"), TypeError),
    Case("quantize", "type", "scale True", lambda: quantize_fp8(torch.randn(4, 8), True), TypeError),
    Case("quantize", "dtype", "int x", lambda: quantize_fp8(torch.ones(4, 8, dtype=torch.int32), 1.0), TypeError),
    Case(
        "quantize",
        "dtype",
        "bf16 out",
        lambda: quantize_fp8(torch.randn(4, 8), 1.0, torch.empty(4, 8).bfloat16()),
        TypeError,
        "out",
    ),
    Case("quantize", "shape", "0-d x", lambda: quantize_fp8(torch.tensor(1.0), 1.0), ValueError, "x"),
    Case(
        "quantize",
        "shape",
        "out of another shape",
        lambda: quantize_fp8(torch.randn(4, 8), 1.0, torch.empty(4, 9, dtype=torch.float8_e4m3fn)),
        ValueError,
    ),
    Case("quantize", "value", "NaN scale", lambda: quantize_fp8(torch.randn(4, 8), float("nan")), ValueError),
    Case("quantize", "value", "inf scale", lambda: quantize_fp8(torch.randn(4, 8), float("inf")), ValueError),
    Case(
        "quantize",
        "value",
        "2-element scale tensor",
        lambda: quantize_fp8(torch.randn(4, 8), torch.ones(2)),
        ValueError,
    ),
    Case("quantize", "device", "meta x", lambda: quantize_fp8(torch.empty(4, 8, device=META), 1.0), ValueError),
    Case(
        "quantize",
        "device",
        "meta out",
        lambda: quantize_fp8(torch.randn(4, 8), 1.0, torch.empty(4, 8, dtype=torch.float8_e4m3fn, device=META)),
        ValueError,
    ),
    Case(
        "quantize",
        "alias",
        "out over x's bytes",
        lambda: quantize_fp8(
            _QBUF.view(torch.bfloat16).view(4, 8), 1.0, _QBUF[:32].view(torch.float8_e4m3fn).view(4, 8)
        ),
        ValueError,
        "overlaps",
    ),
    Case(
        "quantize",
        "alias",
        "stride-0 out",
        lambda: quantize_fp8(torch.randn(4, 8), 1.0, torch.empty(1, 8, dtype=torch.float8_e4m3fn).expand(4, 8)),
        ValueError,
        "out",
    ),
    Case(
        "quantize",
        "alias",
        "rows overlapping in out",
        lambda: quantize_fp8(
            torch.randn(4, 8), 1.0, torch.empty(16, dtype=torch.float8_e4m3fn).as_strided((4, 8), (2, 1))
        ),
        ValueError,
        "out",
    ),
    # ---- pack / unpack
    Case("kv_pack", "type", "pools as a tensor", lambda: pack_kv_blocks(torch.zeros(2, 2, 2), [[0]]), TypeError),
    Case(
        "kv_pack",
        "type",
        "col_ranges (1.9, 20.7)",
        lambda: pack_kv_blocks(_pools(1, elems=24), [[0]], col_ranges=[(1.9, 20.7)]),
        TypeError,
        "col_ranges",
    ),
    Case(
        "kv_pack",
        "type",
        "col_ranges (True, 4)",
        lambda: pack_kv_blocks(_pools(1), [[0]], col_ranges=[(True, 4)]),
        TypeError,
        "col_ranges",
    ),
    Case("kv_pack", "type", "col_ranges a str", lambda: pack_kv_blocks(_pools(1), [[0]], col_ranges=["04"]), TypeError),
    Case("kv_pack", "type", "float page ids", lambda: pack_kv_blocks(_pools(1), [[0.0]]), TypeError),
    Case("kv_pack", "type", "bool page ids", lambda: pack_kv_blocks(_pools(1), [[True]]), TypeError),
    Case(
        "kv_pack",
        "dtype",
        "bool pool",
        lambda: pack_kv_blocks([torch.zeros(2, 2, 2, dtype=torch.bool)], [[0]]),
        TypeError,
    ),
    Case("kv_pack", "shape", "2-D pool", lambda: pack_kv_blocks([torch.zeros(2, 2)], [[0]]), ValueError),
    Case("kv_pack", "shape", "page lists for 1 of 2 pools", lambda: pack_kv_blocks(_pools(2), [[0]]), ValueError),
    Case(
        "kv_pack",
        "shape",
        "buffer too small",
        lambda: unpack_kv_blocks(torch.zeros(3, dtype=torch.uint8), _pools(1), [[0]]),
        ValueError,
        "buf",
    ),
    Case("kv_pack", "value", "page id past the pool", lambda: pack_kv_blocks(_pools(1), [[6]]), ValueError),
    Case("kv_pack", "value", "negative page id", lambda: pack_kv_blocks(_pools(1), [[-1]]), ValueError),
    Case(
        "kv_pack", "value", "empty col range", lambda: pack_kv_blocks(_pools(1), [[0]], col_ranges=[(3, 3)]), ValueError
    ),
    Case(
        "kv_pack",
        "device",
        "meta pool",
        lambda: pack_kv_blocks([torch.empty(2, 2, 8, device=META)], [[0]]),
        ValueError,
        "meta",
    ),
    Case(
        "kv_pack",
        "alias",
        "same page listed twice (unpack)",
        lambda: unpack_kv_blocks(torch.zeros(128, dtype=torch.uint8), _pools(1), [[1, 1]]),
        ValueError,
    ),
    Case(
        "kv_pack",
        "alias",
        "one pool listed for two layers, same page (unpack)",
        lambda: (lambda p: unpack_kv_blocks(torch.zeros(128, dtype=torch.uint8), [p, p], [[2], [2]]))(_pools(1)[0]),
        ValueError,
        "share memory",
    ),
    Case(
        "kv_pack",
        "alias",
        "interleaved views of one allocation, same page (unpack)",
        lambda: (
            lambda big: unpack_kv_blocks(
                torch.zeros(128, dtype=torch.uint8),
                [big[:, 0], big[:, 0, :, 4:]],
                [[3], [3]],
                col_ranges=[None, (0, 4)],
            )
        )(torch.zeros(6, 2, 2, 8)),
        ValueError,
        "share memory",
    ),
    Case(
        "kv_pack",
        "alias",
        "stride-0 page axis (unpack)",
        lambda: unpack_kv_blocks(torch.zeros(128, dtype=torch.uint8), [torch.zeros(1, 2, 8).expand(6, 2, 8)], [[0, 1]]),
        ValueError,
        "stride-0",
    ),
    Case(
        "kv_pack",
        "alias",
        "pack out overlapping a pool",
        lambda: (lambda p: pack_kv_blocks([p], [[0]], out=p.view(torch.uint8).reshape(-1)))(_pools(1)[0]),
        ValueError,
        "overlaps",
    ),
    # ---- copy_small_pinned_pair
    Case(
        "pinned_pair",
        "type",
        "host_a a list",
        lambda: copy_small_pinned_pair([1], torch.zeros(1), torch.zeros(1), torch.zeros(1)),
        TypeError,
        "host_a",
    ),
    Case(
        "pinned_pair",
        "dtype",
        "pair dtypes differ",
        lambda: copy_small_pinned_pair(
            torch.zeros(4), torch.zeros(2), torch.zeros(4, dtype=torch.int32), torch.zeros(2)
        ),
        TypeError,
        "dev_a",
    ),
    Case(
        "pinned_pair",
        "shape",
        "pair sizes differ",
        lambda: copy_small_pinned_pair(torch.zeros(4), torch.zeros(2), torch.zeros(3), torch.zeros(2)),
        ValueError,
        "dev_a",
    ),
    Case(
        "pinned_pair",
        "device",
        "meta destination",
        lambda: copy_small_pinned_pair(torch.zeros(4), torch.zeros(2), torch.zeros(4, device=META), torch.zeros(2)),
        ValueError,
        "meta",
    ),
    # ---- mla_decode_attention
    Case("mla_decode", "type", "q a list", lambda: _decode(q=[[0.0]]), TypeError, "q"),
    Case("mla_decode", "type", "softmax_scale a str", lambda: _decode(softmax_scale="0.1"), TypeError),
    Case(
        "mla_decode",
        "dtype",
        "int64 block table",
        lambda: _decode(block_table=torch.zeros(2, 3, dtype=torch.int64)),
        TypeError,
        "block_table",
    ),
    Case(
        "mla_decode",
        "dtype",
        "q and cache dtypes differ",
        lambda: _decode(kv_cache=torch.randn(6, 4, 48).half()),
        TypeError,
        "kv_cache",
    ),
    Case(
        "mla_decode",
        "shape",
        "cache rows narrower than q",
        lambda: _decode(kv_cache=torch.randn(6, 4, 40)),
        ValueError,
        "kv_cache",
    ),
    Case(
        "mla_decode",
        "shape",
        "one seq_len for two requests",
        lambda: _decode(seq_lens=torch.tensor([5], dtype=torch.int32)),
        ValueError,
        "seq_lens",
    ),
    Case(
        "mla_decode",
        "value",
        "seq_len past the table",
        lambda: _decode(seq_lens=torch.tensor([5, 13], dtype=torch.int32), check_values="strict"),
        ValueError,
        "seq_lens",
    ),
    Case(
        "mla_decode",
        "value",
        "page id past the cache",
        lambda: _decode(block_table=torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=torch.int32), check_values="strict"),
        ValueError,
    ),
    Case("mla_decode", "value", "NaN softmax_scale", lambda: _decode(softmax_scale=float("nan")), ValueError),
    Case(
        "mla_decode",
        "device",
        "meta cache",
        lambda: _decode(kv_cache=torch.empty(6, 4, 48, device=META)),
        ValueError,
        "meta",
    ),
    Case(
        "mla_decode",
        "alias",
        "out inside the cache",
        lambda: (lambda kv: _decode(kv_cache=kv, out=kv.view(-1)[:192].view(2, 3, 32)))(torch.randn(6, 4, 48)),
        ValueError,
        "overlaps",
    ),
    # ---- kv_pack: page indices on a device would be read back (a sync) by the host plan (issue 28 item 2)
    Case("kv_pack", "device", "page indices on a device",
         lambda: pack_kv_blocks([torch.zeros(4, 2, 8)], [torch.zeros(2, dtype=torch.int32, device=META)]),
         TypeError, "host data"),
    # ---- mla_context_attention: q_scale, op-quantised inputs, error flag, strict (issues 28 and 32)
    Case("mla_context", "type", "q_scale a str", lambda: _ctx(q_scale="2"), TypeError, "q_scale"),
    Case("mla_context", "type", "strict an int", lambda: _ctx(strict=1), TypeError, "strict"),
    Case("mla_context", "type", "error_flag a list", lambda: _ctx(error_flag=[0]), TypeError, "error_flag"),
    Case("mla_context", "dtype", "error_flag int64", lambda: _ctx(error_flag=torch.zeros(1, dtype=torch.int64)),
         TypeError, "error_flag"),
    Case("mla_context", "dtype", "op-quantised FP8 input", lambda: _ctx(kv_scale_orig_quant=2.0), TypeError,
         "16-bit"),
    Case("mla_context", "dtype", "q_scale float64 tensor", lambda: _ctx(q_scale=torch.ones(1, dtype=torch.float64)),
         TypeError, "q_scale"),
    Case("mla_context", "shape", "error_flag of 2", lambda: _ctx(error_flag=torch.zeros(2, dtype=torch.int32)),
         ValueError, "error_flag"),
    Case("mla_context", "value", "q_scale NaN", lambda: _ctx(q_scale=float("nan")), ValueError, "q_scale"),
    Case("mla_context", "value", "q_scale with a bf16 q",
         lambda: _ctx(q=torch.randn(5, 2, 32).bfloat16(), q_scale=2.0), ValueError, "q_scale"),
    Case("mla_context", "value", "kv_scale_orig_quant inf",
         lambda: _ctx(q=torch.randn(5, 2, 32).bfloat16(), k=torch.randn(9, 2, 32).bfloat16(),
                      v=torch.randn(9, 2, 16).bfloat16(), kv_scale_orig_quant=float("inf")),
         ValueError, "kv_scale_orig_quant"),
    Case("mla_context", "value", "strict: q_len > kv_len",
         lambda: _ctx(cu_seqlens_kv=torch.tensor([0, 1, 9], dtype=torch.int32), strict=True), ValueError, "q_len"),
    Case("mla_context", "device", "meta error_flag",
         lambda: _ctx(error_flag=torch.zeros(1, dtype=torch.int32, device=META)), ValueError, "meta"),
    Case("mla_context", "device", "meta q_scale", lambda: _ctx(q_scale=torch.ones(1, device=META)), ValueError,
         "meta"),
    Case("mla_context", "alias", "out inside q",
         lambda: (lambda q: _ctx(q=q, out=q.view(torch.uint8).view(-1).view(torch.bfloat16).view(5, 2, 16)))(
             torch.randn(5, 2, 32).to(torch.float8_e4m3fn)),
         ValueError, "overlaps"),
    Case("mla_context", "alias", "error_flag inside out",
         lambda: (lambda o: _ctx(out=o, error_flag=o.view(torch.int32).view(-1)[:1]))(
             torch.zeros(5, 2, 16, dtype=torch.bfloat16)),
         ValueError, "overlaps"),
    # ---- key shares (split-KV): the plan's kv_splits and the rule's arguments
    Case("mla_context", "type", "kv_splits a float", lambda: _ctx_plan(kv_splits=2.0), TypeError, "kv_splits"),
    Case("mla_context", "type", "kv_splits a bool", lambda: _ctx_plan(kv_splits=True), TypeError, "kv_splits"),
    Case("mla_context", "value", "kv_splits 0", lambda: _ctx_plan(kv_splits=0), ValueError, "kv_splits"),
    Case("mla_context", "value", "kv_splits over the maximum", lambda: _ctx_plan(kv_splits=1 << 20), ValueError,
         "kv_splits"),
    Case("mla_context", "type", "context_kv_splits sms a str", lambda: _kv_splits(1, 2, 3, "132"), TypeError, "sms"),
    Case("mla_context", "value", "context_kv_splits negative items", lambda: _kv_splits(-1, 2, 3, 132), ValueError,
         "n_items"),
    Case("mla_context", "value", "context_kv_splits resident 0", lambda: _kv_splits(1, 2, 3, 132, 0, 0), ValueError,
         "resident"),
    Case("mla_decode", "type", "kv scale a str", lambda: _decode(kv_cache=torch.randn(6, 4, 48).to(torch.float8_e4m3fn),
                                                               q=torch.randn(2, 3, 48).bfloat16(),
                                                               kv_scale_quant_orig="2"), TypeError, "kv_scale"),
    Case("mla_decode", "dtype", "error flag int64", lambda: _decode(error_flag=torch.zeros(2, dtype=torch.int64)),
         TypeError, "error_flag"),
    Case("mla_decode", "alias", "error flag inside seq_lens",
         lambda: (lambda sl: _decode(seq_lens=sl[:2], error_flag=sl))(torch.tensor([5, 12], dtype=torch.int32)),
         ValueError, "overlaps"),
    Case("store_latent", "type", "rows a list", lambda: _store(rows=[[0.0]]), TypeError, "rows"),
    Case("store_latent", "dtype", "slots float", lambda: _store(slots=torch.zeros(3)), TypeError, "slots"),
    Case("store_latent", "shape", "rows too narrow", lambda: _store(rows=torch.randn(3, 40)), ValueError, "rows"),
    Case("store_latent", "value", "NaN scale", lambda: _store(kv_scale_orig_quant=float("nan")), ValueError,
         "kv_scale_orig_quant"),
    Case("store_latent", "device", "meta cache",
         lambda: _store(kv_cache=torch.empty(4, 4, 48, device=META, dtype=torch.float8_e4m3fn)), ValueError, "meta"),
    Case("store_latent", "alias", "rows inside the cache",
         lambda: (lambda c: _store(kv_cache=c, rows=c.view(-1, 48)[:3]))(torch.zeros(4, 4, 48)), ValueError,
         "overlaps"),
    # ---- V layout helpers of context attention (v_to_dim_major, quantize_v_dim_major)
    Case("v_layout", "type", "v a list", lambda: _vdim(v=[[[0.0]]]), TypeError, "v"),
    Case("v_layout", "type", "align_bytes a float", lambda: _vdim(align_bytes=16.0), TypeError, "align_bytes"),
    Case("v_layout", "dtype", "out of another dtype", lambda: _vdim(out=torch.zeros(2, 8, 5, dtype=torch.float64)),
         TypeError, "out"),
    Case("v_layout", "shape", "v of 2 dims", lambda: _vdim(v=torch.randn(5, 8)), ValueError, "v"),
    Case("v_layout", "shape", "out of another shape", lambda: _vdim(out=torch.zeros(2, 8, 6)), ValueError, "out"),
    Case("v_layout", "value", "align_bytes 0", lambda: _vdim(align_bytes=0), ValueError, "align_bytes"),
    Case("v_layout", "value", "align_bytes not a multiple of the element size", lambda: _vdim(align_bytes=6),
         ValueError, "align_bytes"),
    Case("v_layout", "device", "meta v", lambda: _vdim(v=torch.randn(5, 2, 8, device=META)), ValueError, "meta"),
    Case("v_layout", "alias", "out over v",
         lambda: (lambda v: _vdim(v=v, out=v.permute(1, 2, 0)))(torch.randn(5, 2, 8)), ValueError, "out"),
    Case("v_layout", "alias", "out with overlapping tokens",
         lambda: _vdim(out=torch.zeros(2, 8, 1).expand(2, 8, 5)), ValueError, "out"),
    Case("quantize_v", "type", "v a list", lambda: _qvdim(v=[[[0.0]]]), TypeError, "v"),
    Case("quantize_v", "dtype", "v int32", lambda: _qvdim(v=torch.zeros(5, 2, 8, dtype=torch.int32)), TypeError, "v"),
    Case("quantize_v", "shape", "v of 4 dims", lambda: _qvdim(v=torch.randn(5, 2, 8, 1)), ValueError, "v"),
    Case("quantize_v", "value", "NaN scale", lambda: _qvdim(kv_scale_orig_quant=float("nan")), ValueError,
         "kv_scale_orig_quant"),
    Case("quantize_v", "device", "meta v", lambda: _qvdim(v=torch.randn(5, 2, 8, device=META)), ValueError, "v"),
]
# fmt: on


def _vdim(**over):
    from kvforge.kernels.mla_context import v_to_dim_major

    a = dict(v=torch.randn(5, 2, 8), align_bytes=16)
    a.update(over)
    return v_to_dim_major(a.pop("v"), **a)


def _qvdim(**over):
    from kvforge.kernels.mla_context import quantize_v_dim_major

    a = dict(v=torch.randn(5, 2, 8).bfloat16(), kv_scale_orig_quant=2.0)
    a.update(over)
    return quantize_v_dim_major(a.pop("v"), a.pop("kv_scale_orig_quant"))


def _store(**over):
    from kvforge.kernels.mla_decode import store_latent_rows

    a = dict(kv_cache=torch.zeros(4, 4, 48, dtype=torch.float8_e4m3fn), slots=torch.tensor([0, 5, 9]),
             rows=torch.randn(3, 48), kv_scale_orig_quant=1.0)  # fmt: skip
    a.update(over)
    if a["kv_cache"].dtype != torch.float8_e4m3fn:
        a.pop("kv_scale_orig_quant")
    return store_latent_rows(a.pop("kv_cache"), a.pop("slots"), a.pop("rows"), **a)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{c.cls}-{c.what}" for c in CASES])
def test_refused(case):
    with pytest.raises(case.exc, match=case.match or None):
        case.call()


def test_case_counts():
    """Every class is covered for the ops where it applies; the counts go into the closing note."""
    by_class = Counter(c.cls for c in CASES)
    by_op = Counter(c.op for c in CASES)
    print("\nhostile kernel cases by class:", dict(sorted(by_class.items())), "total", len(CASES))
    print("by op:", dict(sorted(by_op.items())))
    assert set(by_class) == {"type", "dtype", "shape", "value", "device", "alias"}
    for op in by_op:
        assert {"type", "device"} <= {c.cls for c in CASES if c.op == op}, op


# ---- regressions for issue 17 ----------------------------------------------------------------------------------


def test_refused_calls_leave_outputs_untouched():
    out = torch.full((3, 2, 8), 7.0)
    o = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError):
        merge_attention_states(o, torch.randn(2, 3, 2), out=out, out_lse=out[:, :, 0])
    assert (out == 7.0).all()
    st = _stores()
    before = [t.clone() for t in st.tensors()]
    with pytest.raises(ValueError):
        _scatter(stores=st, slot_ids=torch.tensor([0, 1, 1]))
    assert all(torch.equal(a, b) for a, b in zip(before, st.tensors()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_merge_invalid_lse_gives_nan_not_minus_inf(bad):
    """2.4: NaN or +inf in any share's lse makes the row NaN (out and lse); −inf would read as "no keys"."""
    o = torch.randn(3, 4, 2, 8)
    lse = torch.randn(3, 4, 2)
    lse[1, 2, 0] = bad
    lse[:, 3, 1] = float("-inf")  # an all-empty row stays 0 / −inf
    out, out_lse = merge_attention_states(o, lse)
    assert torch.isnan(out_lse[2, 0]) and torch.isnan(out[2, 0]).all()
    assert torch.isneginf(out_lse[3, 1]) and (out[3, 1] == 0).all()
    ok = torch.ones(4, 2, dtype=torch.bool)
    ok[2, 0] = ok[3, 1] = False
    assert torch.isfinite(out_lse[ok]).all()
    ref, ref_lse = merge_attention_states_ref(o, lse)
    assert torch.isnan(ref_lse[2, 0]) and torch.isnan(ref[2, 0]).all()
    torch.testing.assert_close(out[ok], ref[ok], atol=1e-5, rtol=1e-5)


def test_step_gather_int64_counts_are_not_truncated():
    """2.9: a count of 2**40 + 3 in an int64 store comes back exactly (it came back as -1)."""
    st = _stores(torch.int64)
    st.new_token_counts[2] = 2**40 + 3
    got = step_gather(st, torch.tensor([2, 0]), 2)
    assert got.kv_offsets.dtype == torch.int64
    assert got.kv_offsets.tolist() == [2**40 + 1, -2]
    assert got.position_offsets.tolist() == [2**40 + 1] * 2 + [-2] * 2
    want = step_gather_ref(st, torch.tensor([2, 0]), 2)
    assert torch.equal(got.kv_offsets, want.kv_offsets)


def test_overlap_helpers():
    a = torch.zeros(10, 4)
    assert not tensors_overlap(a[::2], a[1::2])  # interleaved but disjoint: exact check
    assert tensors_overlap(a[:6], a[5:])
    assert not tensors_overlap(a[:, :2], a[:, 2:])
    assert has_internal_overlap(a[:1].expand(3, 4))
    assert not has_internal_overlap(a.t())
    assert has_internal_overlap(torch.zeros(8).as_strided((3, 4), (2, 1)))


def test_unpack_into_disjoint_views_of_one_allocation_still_works():
    """The alias check is exact: two layers stored interleaved in one allocation, different pages, is fine."""
    big = torch.zeros(6, 2, 2, 8)  # [pages, layers, tpb, elems]
    pools = [big[:, 0], big[:, 1]]
    src = [torch.randn(6, 2, 8) for _ in range(2)]
    buf = pack_kv_blocks(src, [[1, 4], [1, 4]])
    unpack_kv_blocks(buf, pools, [[1, 4], [1, 4]])
    assert torch.equal(big[[1, 4], 0], src[0][[1, 4]]) and torch.equal(big[[1, 4], 1], src[1][[1, 4]])
    layout = KVPackLayout(pools)
    assert layout.plan([[0], [0]], unpack=True).nbytes == 2 * 2 * 8 * 4
    assert KVPackPlan(pools, [[2], [3]], unpack=True).nbytes > 0
