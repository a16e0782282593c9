"""The decode step's bookkeeping kernels (kvforge.kernels.decode_step) against their plain-torch forms.

Fresh random slots, starts, page tables and stores per test; awkward sizes (a page table wider than one block of
the copy loop); outputs poisoned with -7 (every element the kernel owns must be written, none other); padding
rows that share the trash slot; the interpreter on CPU, the GPU at full sizes (``full_sizes``).
"""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels._runtime import interpreting
from kvforge.kernels.decode_step import decode_finish, decode_finish_ref, decode_inputs, decode_inputs_ref
from kvforge.kernels.slot_ops import SlotStores

POISON = -7


def _stores(num_slots: int, t: int, device, dtype=torch.int32) -> SlotStores:
    return SlotStores(
        torch.full((t + 1, num_slots), POISON, dtype=dtype, device=device),
        torch.full((t + 1, num_slots), POISON, dtype=dtype, device=device),
        torch.full((num_slots,), POISON, dtype=dtype, device=device),
        torch.full((num_slots, 2), POISON, dtype=dtype, device=device),
    )


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_decode_inputs(gen, device, full_sizes, t, table_dtype) -> None:
    b, mb, tpb, slots_n = (64, 1500, 64, 300) if full_sizes else (5, 1100, 16, 9)  # mb > one copy block (1024)
    slots = torch.randperm(slots_n, generator=gen)[:b].int().to(device)
    starts = torch.randint(0, (mb - 1) * tpb, (b,), generator=gen).to(device)
    big = torch.randint(0, 10_000, (b, mb + 3), generator=gen).to(device, table_dtype)
    table = big[:, :mb]  # a row stride wider than the row, as the engine's offsets planes
    nnt = torch.randint(0, 32768, (t + 1, slots_n), generator=gen, dtype=torch.int32).to(device)
    got = decode_inputs(slots, starts, table, nnt, t, tpb)
    want = decode_inputs_ref(slots, starts, table, nnt, t, tpb)
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert got.table_rows.dtype == torch.int32 and got.ids.dtype == torch.int64


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("with_draft", [False, True])
def test_decode_finish(gen, device, full_sizes, t, with_draft) -> None:
    b, slots_n, v = (256, 300, 32768) if full_sizes else (7, 11, 1000)
    trash = slots_n - 1
    slots = torch.randperm(slots_n - 1, generator=gen)[:b].int()
    slots[-2:] = trash  # two padding rows on the trash slot
    slots = slots.to(device)
    best = torch.randint(0, v, (b, t), generator=gen, dtype=torch.int32).to(device)
    acc = torch.randint(1, t + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    drafts = torch.randint(0, v, (b,), generator=gen).to(device) if with_draft else None
    got_st, want_st = _stores(slots_n, t, device), _stores(slots_n, t, device)
    got_out = torch.full((b, t + 2), POISON, dtype=torch.int32, device=device)
    want_out = got_out.clone()
    decode_finish(best, acc, drafts, slots, got_st, got_out)
    decode_finish_ref(best, acc, drafts, slots, want_st, want_out)
    assert torch.equal(got_out, want_out)
    assert not bool((got_out == POISON).any())
    real = torch.ones(slots_n, dtype=torch.bool, device=device)
    real[trash] = False  # the padding rows race there
    for name, g, w in zip(
        ("new_tokens", "next_new_tokens", "new_token_counts", "next_draft_tokens"), got_st.tensors(), want_st.tensors()
    ):
        if name == "next_draft_tokens":
            assert torch.equal(g[real], w[real]), name
        else:
            assert torch.equal(g[..., real], w[..., real]), name
    # Untouched beyond the step's width: new_tokens row t, next_draft_tokens column 1, slots no row names.
    assert bool((got_st.new_tokens[t] == POISON).all()) and bool((got_st.next_draft_tokens[:, 1] == POISON).all())
    named = torch.zeros(slots_n, dtype=torch.bool, device=device)
    named[slots.long()] = True
    assert bool((got_st.new_token_counts[~named] == POISON).all())
    assert torch.equal(got_st.new_token_counts[slots[:-2].long()], acc[:-2])


def _finish_args(**kw):
    b, t = 3, 2
    args = dict(
        best=torch.zeros(b, t, dtype=torch.int32),
        accepted=torch.ones(b, dtype=torch.int32),
        drafts=None,
        slots=torch.arange(b, dtype=torch.int32),
        stores=_stores(4, t, "cpu"),
        out=torch.zeros(b, t + 2, dtype=torch.int32),
    )
    args.update(kw)
    return args


def _inputs_args(**kw):
    args = dict(
        slots=torch.zeros(2, dtype=torch.int32),
        starts=torch.zeros(2, dtype=torch.long),
        table=torch.zeros(2, 4, dtype=torch.int32),
        next_new_tokens=torch.zeros(2, 5, dtype=torch.int32),
        width=1,
        tokens_per_block=4,
    )
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: decode_finish(**_finish_args(best=torch.zeros(3, 3, dtype=torch.int32))), ValueError, "best"),
        (lambda: decode_finish(**_finish_args(best=torch.zeros(3, 2))), TypeError, "best"),
        (lambda: decode_finish(**_finish_args(accepted=torch.ones(2, dtype=torch.int32))), ValueError, "accepted"),
        (lambda: decode_finish(**_finish_args(drafts=torch.zeros(3))), TypeError, "drafts"),
        (lambda: decode_finish(**_finish_args(slots=torch.zeros(4, dtype=torch.int32))), ValueError, "slots"),
        (lambda: decode_finish(**_finish_args(stores=object())), TypeError, "stores"),
        (lambda: decode_finish(**_finish_args(stores=_stores(4, 0, "cpu"))), ValueError, "stores"),
        (lambda: decode_finish(**_finish_args(out=torch.zeros(3, 3, dtype=torch.int32))), ValueError, "out"),
        (
            lambda: (lambda o: decode_finish(**_finish_args(out=o, slots=o.view(-1)[:3])))(
                torch.zeros(3, 4, dtype=torch.int32)
            ),
            ValueError,
            "overlaps slots",
        ),
        (lambda: decode_inputs(**_inputs_args(starts=torch.zeros(2))), TypeError, "starts"),
        (lambda: decode_inputs(**_inputs_args(table=torch.zeros(3, 4, dtype=torch.int32))), ValueError, "table"),
        (
            lambda: decode_inputs(**_inputs_args(next_new_tokens=torch.zeros(1, 5, dtype=torch.int32), width=2)),
            ValueError,
            "next_new_tokens",
        ),
        (lambda: decode_inputs(**_inputs_args(width=0)), ValueError, "width"),
        (lambda: decode_inputs(**_inputs_args(tokens_per_block=0)), ValueError, "tokens_per_block"),
    ],
)
@pytest.mark.skipif(not interpreting(), reason="the cases build CPU tensors (interpreter only)")
def test_bad_input_is_refused(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()
