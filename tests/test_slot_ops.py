"""slot_scatter / step_gather against their references, bit for bit; padding, truncation, bad input, graphs."""

from __future__ import annotations

import pytest
import torch
import triton

import kvforge.kernels.slot_ops as smod
from kvforge.kernels.slot_ops import (
    SlotStores,
    StepInputs,
    slot_scatter,
    slot_scatter_ref,
    step_gather,
    step_gather_ref,
)
from tests.helpers import INT_POISON, assert_all_written, poison, poisoned

VOCAB = 32000


def _stores(slots, w_new, w_next, w_draft, device, dtype=torch.int32) -> SlotStores:
    st = SlotStores.zeros(slots, w_new, w_next, w_draft, device, dtype)
    for t in st.tensors():
        poison(t)  # untouched slots must keep this
    return st


def _step(m, a, b, c, gen, device, dtype=torch.int32, max_count=None):
    r = lambda *shape: torch.randint(1, VOCAB, shape, generator=gen, dtype=dtype).to(device)
    hi = (max_count if max_count is not None else max(a, 1)) + 1
    counts = torch.randint(0, hi, (m,), generator=gen, dtype=dtype).to(device)
    return r(m, a), r(m, b), counts, r(m, c)


def _assert_stores_equal(got: SlotStores, want: SlotStores) -> None:
    for name, g, w in zip(
        ["new_tokens", "next_new_tokens", "new_token_counts", "next_draft_tokens"], got.tensors(), want.tensors()
    ):
        assert torch.equal(g.long(), w.long()), f"stores.{name}: {int((g.long() != w.long()).sum())} entries differ"


def _assert_inputs_equal(got: StepInputs, want: StepInputs) -> None:
    for name, g, w in zip(StepInputs._fields, got, want):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g.long(), w.long()), f"{name}: {int((g.long() != w.long()).sum())} entries differ"


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_scatter_then_gather_match_references(rows, tokens, device, gen):
    slots = 29
    st = _stores(slots, 8, 8, 8, device)
    slot_ids = torch.randperm(slots, generator=gen)[:rows].to(device)
    row_begin = 2
    outs = _step(rows + row_begin + 1, tokens, tokens, tokens - 1, gen, device)
    want = slot_scatter_ref(st, slot_ids, *outs, row_begin=row_begin)
    slot_scatter(st, slot_ids, *outs, row_begin=row_begin)
    _assert_stores_equal(st, want)

    out = _gather_out(rows, tokens, tokens - 1, device)
    got = step_gather(st, slot_ids, tokens, out=out)
    assert got is out
    for t in got:
        assert_all_written(t)
    _assert_inputs_equal(got, step_gather_ref(st, slot_ids, tokens))


def test_round_trip_meaning(device, gen):
    # Independent of the references: what the next step must see after this step's scatter.
    st = _stores(10, 4, 4, 3, device)
    slot_ids = torch.tensor([7, 2], device=device)
    new = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]], device=device)
    nxt = torch.tensor([[31, 32, 33, 34], [41, 42, 43, 44]], device=device)
    counts = torch.tensor([2, 4], device=device)
    drafts = torch.tensor([[51, 52, 53], [61, 62, 63]], device=device)
    slot_scatter(st, slot_ids, new, nxt, counts, drafts)
    assert st.new_tokens[:, 7].tolist() == [11, 12, 0, 0]  # zero past the count
    assert st.new_tokens[:, 2].tolist() == [21, 22, 23, 24]
    inp = step_gather(st, torch.tensor([2, 7], device=device), 4)
    assert inp.input_ids.tolist() == [41, 42, 43, 44, 31, 32, 33, 34]
    assert inp.draft_tokens.tolist() == [[61, 62, 63], [51, 52, 53]]
    assert inp.kv_offsets.tolist() == [0, -2]
    assert inp.position_offsets.tolist() == [0] * 4 + [-2] * 4


@pytest.mark.parametrize(
    ("widths", "store_widths"),
    [((8, 8, 7), (6, 5, 4)), ((2, 3, 1), (8, 8, 8)), ((0, 4, 0), (3, 4, 2))],
    ids=["truncate", "pad", "empty-outputs"],
)
def test_rows_are_padded_or_truncated(widths, store_widths, device, gen):
    st = _stores(40, *store_widths, device)
    slot_ids = torch.randperm(40, generator=gen)[:13].to(device)
    outs = _step(13, *widths, gen, device, max_count=8)
    want = slot_scatter_ref(st, slot_ids, *outs)
    slot_scatter(st, slot_ids, *outs)
    _assert_stores_equal(st, want)


@pytest.mark.parametrize(("out_dtype", "store_dtype"), [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_mixed_integer_dtypes(out_dtype, store_dtype, device, gen):
    st = _stores(50, 5, 5, 4, device, store_dtype)
    slot_ids = torch.randperm(50, generator=gen)[:9].to(device, out_dtype)
    outs = _step(9, 5, 5, 4, gen, device, dtype=out_dtype)
    want = slot_scatter_ref(st, slot_ids, *outs)
    slot_scatter(st, slot_ids, *outs)
    _assert_stores_equal(st, want)
    got = step_gather(st, slot_ids, 5, draft_len=2)
    assert got.input_ids.dtype == store_dtype and got.kv_offsets.dtype == store_dtype
    _assert_inputs_equal(got, step_gather_ref(st, slot_ids, 5, draft_len=2))


def test_a_few_hundred_rows_with_strided_outputs(device, gen):
    slots, n, t = 1024, 300, 4
    st = _stores(slots, 8, 8, 8, device)
    slot_ids = torch.randperm(slots, generator=gen)[:n].to(device)
    # Outputs as views of wider step buffers: row strides differ from the widths.
    wide = torch.randint(1, VOCAB, (n + 5, 3, 8), generator=gen, dtype=torch.int32).to(device)
    counts = torch.randint(1, t + 1, (2 * (n + 5),), generator=gen, dtype=torch.int32).to(device)[::2]
    outs = (wide[:, 0, :t], wide[:, 1, :t], counts, wide[:, 2, : t - 1])
    want = slot_scatter_ref(st, slot_ids, *outs, row_begin=5)
    slot_scatter(st, slot_ids, *outs, row_begin=5)
    _assert_stores_equal(st, want)
    _assert_inputs_equal(step_gather(st, slot_ids, t), step_gather_ref(st, slot_ids, t))


def test_gather_may_read_one_slot_twice(device, gen):
    st = _stores(5, 3, 3, 2, device)
    slot_scatter(st, torch.tensor([1, 3], device=device), *_step(2, 3, 3, 2, gen, device))
    ids = torch.tensor([3, 1, 3], device=device)
    _assert_inputs_equal(step_gather(st, ids, 3), step_gather_ref(st, ids, 3))


def test_empty_step_launches_nothing(device, gen, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched for zero rows")

    monkeypatch.setattr(smod._SCATTER, "launch", no_launch)
    monkeypatch.setattr(smod._GATHER, "launch", no_launch)
    st = _stores(8, 4, 4, 3, device)
    before = st.clone()
    none = torch.empty(0, dtype=torch.int32, device=device)
    slot_scatter(st, none, *_step(0, 4, 4, 3, gen, device))
    _assert_stores_equal(st, before)
    got = step_gather(st, none, 4)
    assert [tuple(x.shape) for x in got] == [(0,), (0,), (0, 3), (0,)]


def test_kernels_mask_out_of_range_device_slots(device, gen):
    # Device slot ids cannot be checked on the host; the kernels skip (scatter) or zero (gather) such rows.
    # Launched directly with the library's own argument builders, bypassing the host check that catches them on
    # CPU. 2**32 + 2 is out of range as an int64 but would wrap to slot 2 if narrowed before the range check.
    st = _stores(6, 4, 4, 3, device)
    before = st.clone()
    slot_ids = torch.tensor([1, 6, -1, 4, 2**32 + 2], device=device)
    new, nxt, counts, drafts = _step(5, 4, 4, 3, gen, device)
    good = torch.tensor([0, 3], device=device)
    want = slot_scatter_ref(before, slot_ids[good], new[good], nxt[good], counts[good], drafts[good])
    cfg = smod._SCATTER_TABLE.interpreter if device.type == "cpu" else None
    block_r = cfg.kwargs["BLOCK_R"] if cfg else 32
    args, layout, _ = smod._scatter_args(st, slot_ids, new, nxt, counts, drafts, 5, 0)
    smod._slot_scatter_kernel[(triton.cdiv(5, block_r),)](*args, **layout, BLOCK_R=block_r)
    _assert_stores_equal(st, want)

    out = _gather_out(5, 4, 3, device)
    layout = smod._gather_layout(st, slot_ids, 4, 3, out)
    smod._step_gather_kernel[(triton.cdiv(5, block_r),)](
        slot_ids, 5, *st.tensors()[1:], *out, **layout, BLOCK_R=block_r
    )
    bad = torch.tensor([1, 2, 4], device=device)
    assert out.input_ids.view(5, 4)[bad].eq(0).all() and out.kv_offsets[bad].eq(0).all()
    assert out.draft_tokens[bad].eq(0).all() and out.position_offsets.view(5, 4)[bad].eq(0).all()
    ref = step_gather_ref(st, slot_ids[good], 4)
    assert torch.equal(out.input_ids.view(5, 4)[good].reshape(-1).long(), ref.input_ids)
    assert torch.equal(out.kv_offsets[good].long(), ref.kv_offsets)


def _scatter_args(device, gen):
    st = _stores(8, 4, 4, 3, device)
    outs = _step(5, 4, 4, 3, gen, device)
    return st, torch.tensor([0, 3], device=device), outs


SCATTER_BAD = [
    ("stores-type", "stores", TypeError, lambda st, ids, o: slot_scatter(st.tensors(), ids, *o)),
    ("ids-float", "slot_ids", TypeError, lambda st, ids, o: slot_scatter(st, ids.float(), *o)),
    ("ids-2d", "slot_ids", ValueError, lambda st, ids, o: slot_scatter(st, ids.view(1, 2), *o)),
    ("ids-high", "slot_ids", ValueError, lambda st, ids, o: slot_scatter(st, ids + 5, *o)),
    ("ids-negative", "slot_ids", ValueError, lambda st, ids, o: slot_scatter(st, ids - 1, *o)),
    ("ids-duplicate", "slot_ids", ValueError, lambda st, ids, o: slot_scatter(st, ids * 0, *o)),
    ("row-begin-neg", "row_begin", ValueError, lambda st, ids, o: slot_scatter(st, ids, *o, row_begin=-1)),
    ("row-begin-type", "row_begin", TypeError, lambda st, ids, o: slot_scatter(st, ids, *o, row_begin=1.0)),
    ("rows-short", "new_tokens", ValueError, lambda st, ids, o: slot_scatter(st, ids, *o, row_begin=4)),
    ("new-float", "new_tokens", TypeError, lambda st, ids, o: slot_scatter(st, ids, o[0].float(), *o[1:])),
    ("next-1d", "next_new_tokens", ValueError, lambda st, ids, o: slot_scatter(st, ids, o[0], o[2], o[2], o[3])),
    ("counts-2d", "new_token_counts", ValueError, lambda st, ids, o: slot_scatter(st, ids, o[0], o[1], o[0], o[3])),
    ("draft-short", "next_draft_tokens", ValueError, lambda st, ids, o: slot_scatter(st, ids, *o[:3], o[3][:1])),
]


# Slot ids are range/duplicate-checked only in host memory; on a GPU they live on the device, unchecked, and
# the kernels mask them instead (test_kernels_mask_out_of_range_device_slots).
HOST_CHECKED = {"ids-high", "ids-negative", "ids-duplicate"}


@pytest.mark.parametrize("case", SCATTER_BAD, ids=[c[0] for c in SCATTER_BAD])
def test_scatter_bad_input_raises_before_writing(case, device, gen):
    _, name, exc, call = case
    if device.type == "cuda" and case[0] in HOST_CHECKED:
        pytest.skip("device slot ids are not checked on the host (no sync); the kernel masks them")
    st, ids, outs = _scatter_args(device, gen)
    before = st.clone()
    with pytest.raises(exc, match=name):
        call(st, ids, outs)
    _assert_stores_equal(st, before)


def test_stores_validate_themselves(device):
    z = lambda *s, dtype=torch.int32: torch.zeros(s, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=r"stores\.next_new_tokens: expected 8 slots"):
        SlotStores(z(4, 8), z(4, 7), z(8), z(8, 3))
    with pytest.raises(ValueError, match=r"stores\.new_token_counts: expected 8 slots"):
        SlotStores(z(4, 8), z(4, 8), z(9), z(8, 3))
    with pytest.raises(ValueError, match=r"stores\.next_draft_tokens: expected 8 slots"):
        SlotStores(z(4, 8), z(4, 8), z(8), z(3, 8))
    with pytest.raises(TypeError, match=r"stores\.new_tokens"):
        SlotStores(z(4, 8, dtype=torch.float32), z(4, 8), z(8), z(8, 3))
    with pytest.raises(ValueError, match=r"stores\.new_token_counts"):
        SlotStores(z(4, 8), z(4, 8), z(8, 1), z(8, 3))


def _gather_out(n, t, k, device, dtype=torch.int32):
    """Poisoned ``out=`` buffers of a gather of n rows, t tokens and k draft tokens each."""
    return StepInputs(*(poisoned(s, dtype, device) for s in [(n * t,), (n * t,), (n, k), (n,)]))


GATHER_BAD = [
    ("t-zero", "tokens_per_row", ValueError, lambda st, ids, out: step_gather(st, ids, 0)),
    ("t-wide", "tokens_per_row", ValueError, lambda st, ids, out: step_gather(st, ids, 5)),
    ("t-type", "tokens_per_row", TypeError, lambda st, ids, out: step_gather(st, ids, 2.0)),
    ("k-wide", "draft_len", ValueError, lambda st, ids, out: step_gather(st, ids, 2, draft_len=4)),
    ("k-neg", "draft_len", ValueError, lambda st, ids, out: step_gather(st, ids, 2, draft_len=-1)),
    ("k-and-out", "draft_len", ValueError, lambda st, ids, out: step_gather(st, ids, 4, draft_len=3, out=out)),
    ("out-type", "out", TypeError, lambda st, ids, out: step_gather(st, ids, 4, out=tuple(out))),
    ("out-ids-shape", "out.input_ids", ValueError, lambda st, ids, out: step_gather(st, ids, 3, out=out)),
    (
        "out-draft-rows",
        "out.draft_tokens",
        ValueError,
        lambda st, ids, out: step_gather(st, ids, 4, out=out._replace(draft_tokens=out.draft_tokens[:1])),
    ),
    (
        "out-kv-dtype",
        "out.kv_offsets",
        TypeError,
        lambda st, ids, out: step_gather(st, ids, 4, out=out._replace(kv_offsets=out.kv_offsets.float())),
    ),
    (
        "out-draft-wide",
        "draft_len",
        ValueError,
        lambda st, ids, out: step_gather(
            st, ids, 4, out=out._replace(draft_tokens=torch.zeros(2, 4, dtype=torch.int32, device=ids.device))
        ),
    ),
    ("ids-high", "slot_ids", ValueError, lambda st, ids, out: step_gather(st, ids + 5, 4, out=out)),
]


@pytest.mark.parametrize("case", GATHER_BAD, ids=[c[0] for c in GATHER_BAD])
def test_gather_bad_input_raises_before_writing(case, device, gen):
    _, name, exc, call = case
    if device.type == "cuda" and case[0] in HOST_CHECKED:
        pytest.skip("device slot ids are not checked on the host (no sync); the kernel masks them")
    st, ids, _ = _scatter_args(device, gen)
    out = _gather_out(2, 4, 3, device)
    with pytest.raises(exc, match=name):
        call(st, ids, out)
    for t in out:
        assert bool((t == INT_POISON).all()), "a rejected call wrote into out"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_full_size_gpu(tokens, device, gen):
    # The anchor workload: 256 rows of a step into 1,024 slots.
    st = _stores(1024, 8, 8, 8, device)
    slot_ids = torch.randperm(1024, generator=gen)[:256].to(device)
    outs = _step(256, tokens, tokens, tokens - 1, gen, device)
    want = slot_scatter_ref(st, slot_ids, *outs)
    slot_scatter(st, slot_ids, *outs)
    _assert_stores_equal(st, want)
    _assert_inputs_equal(step_gather(st, slot_ids, tokens), step_gather_ref(st, slot_ids, tokens))


@pytest.mark.gpu
def test_scatter_and_gather_replay_from_a_cuda_graph(device, gen):
    slots, n, t = 1024, 256, 4
    st = _stores(slots, 8, 8, 8, device)
    slot_ids = torch.randperm(slots, generator=gen)[:n].to(device)
    new, nxt, counts, drafts = _step(n, t, t, t - 1, gen, device)
    next_ids = torch.randperm(slots, generator=gen)[:n].to(device)
    out = _gather_out(n, t, t - 1, device)
    # Compile (and tune) outside capture, then capture scatter + gather as one step.
    slot_scatter(st, slot_ids, new, nxt, counts, drafts)
    step_gather(st, next_ids, t, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        slot_scatter(st, slot_ids, new, nxt, counts, drafts)
        step_gather(st, next_ids, t, out=out)
    for _ in range(3):
        # A new step: rewrite the inputs in place, replay, compare with the references on the same data.
        before = st.clone()
        slot_ids.copy_(torch.randperm(slots, generator=gen)[:n].to(device))
        next_ids.copy_(torch.randperm(slots, generator=gen)[:n].to(device))
        for dst, src in zip((new, nxt, counts, drafts), _step(n, t, t, t - 1, gen, device)):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        want = slot_scatter_ref(before, slot_ids, new, nxt, counts, drafts)
        _assert_stores_equal(st, want)
        _assert_inputs_equal(out, step_gather_ref(want, next_ids, t))


@pytest.mark.gpu
def test_host_stores_are_rejected_on_a_gpu_machine(device, gen):
    st = _stores(8, 4, 4, 3, "cpu")
    with pytest.raises(ValueError, match="stores: expected tensors on cuda"):
        slot_scatter(st, torch.tensor([1]), *_step(1, 4, 4, 3, gen, "cpu"))
    with pytest.raises(ValueError, match="stores: expected tensors on cuda"):
        step_gather(st, torch.tensor([1]), 2)
    gpu = _stores(8, 4, 4, 3, device)
    with pytest.raises(ValueError, match="slot_ids: expected a tensor on cuda"):
        slot_scatter(gpu, torch.tensor([1]), *_step(1, 4, 4, 3, gen, device))


def test_repeated_calls_reuse_the_checked_plan_and_still_check_what_varies(device, gen):
    # A second call with the same buffers skips re-validation of their metadata, but row_begin, host slot id
    # values and any tensor whose shape/strides/dtype changed are checked again, with the same errors.
    st, ids, outs = _scatter_args(device, gen)
    for row_begin in (0, 2, 1):
        want = slot_scatter_ref(st, ids, *outs, row_begin=row_begin)
        slot_scatter(st, ids, *outs, row_begin=row_begin)
        _assert_stores_equal(st, want)
    before = st.clone()
    with pytest.raises(ValueError, match="new_tokens: has 5 rows"):
        slot_scatter(st, ids, *outs, row_begin=4)
    with pytest.raises(TypeError, match="row_begin"):
        slot_scatter(st, ids, *outs, row_begin=True)
    with pytest.raises(ValueError, match="row_begin"):
        slot_scatter(st, ids, *outs, row_begin=-1)
    if device.type == "cpu":
        ids[1] = ids[0]  # same tensor, same metadata, new values: still duplicate-checked
        with pytest.raises(ValueError, match="duplicate"):
            slot_scatter(st, ids, *outs)
        ids[1] = 99
        with pytest.raises(ValueError, match="slot_ids: values must lie"):
            slot_scatter(st, ids, *outs)
        ids[1] = 3
    # The same tensor object resized in place (same address, fewer rows) takes the checked path again.
    counts = outs[2]
    counts.resize_(1)
    with pytest.raises(ValueError, match="new_token_counts: has 1 rows"):
        slot_scatter(st, ids, *outs)
    # Same address and shape, other dtype.
    with pytest.raises(TypeError, match="new_tokens"):
        slot_scatter(st, ids, outs[0].view(torch.float32), *outs[1:])
    _assert_stores_equal(st, before)


def test_plan_cache_is_bounded_and_holds_no_tensors(device, gen):
    st = _stores(16, 4, 4, 3, device)
    for i in range(smod._SCATTER_PLANS.maxsize + 5):
        ids = torch.tensor([i % 16], device=device)
        outs = _step(1 + i % 3, 4, 4, 3, gen, device)
        slot_scatter(st, ids, *outs)
    assert len(smod._SCATTER_PLANS) <= smod._SCATTER_PLANS.maxsize
    for plan in smod._SCATTER_PLANS._plans.values():
        assert not any(isinstance(v, torch.Tensor) for v in plan.ptr_args)


def test_needs_i64_reads_extents_not_sizes():
    meta = lambda shape, stride: torch.empty(0, device="meta").as_strided(shape, stride)
    assert not smod._needs_i64((meta((1024, 8), (8, 1)),))
    assert not smod._needs_i64((meta((2, 3), (2**30, 1)), meta((5,), (0,))))  # extent 2**30 + 2
    assert smod._needs_i64((meta((8,), (1,)), meta((3, 2), (2**30, 1))))  # extent 2**31 + 1
    assert not smod._needs_i64((meta((0, 4), (2**40, 1)),))  # empty: no element to address


def test_int64_offsets_give_the_same_results(device, gen, monkeypatch):
    # Tensors past 2**31 elements cannot be allocated here; lowering the limit sends ordinary sizes through the
    # kernels' int64 branch, which must agree with the int32 one and the references.
    monkeypatch.setattr(smod, "_I32_LIMIT", 16)
    smod._SCATTER_PLANS.clear()
    smod._GATHER_PLANS.clear()
    st = _stores(37, 8, 8, 7, device)
    slot_ids = torch.randperm(37, generator=gen)[:11].to(device)
    outs = _step(13, 6, 8, 7, gen, device)
    assert smod._scatter_args(st, slot_ids, *outs, 11, 0)[1]["I64"] == 1
    want = slot_scatter_ref(st, slot_ids, *outs, row_begin=2)
    slot_scatter(st, slot_ids, *outs, row_begin=2)
    _assert_stores_equal(st, want)
    _assert_inputs_equal(step_gather(st, slot_ids, 5, draft_len=3), step_gather_ref(st, slot_ids, 5, draft_len=3))
    smod._SCATTER_PLANS.clear()
    smod._GATHER_PLANS.clear()


def test_gather_reuses_its_plan_and_allocates_fresh_outputs(device, gen):
    st = _stores(20, 4, 4, 3, device)
    ids = torch.randperm(20, generator=gen)[:6].to(device)
    slot_scatter(st, ids, *_step(6, 4, 4, 3, gen, device))
    first = step_gather(st, ids, 4)
    n_plans = len(smod._GATHER_PLANS)
    slot_scatter(st, ids, *_step(6, 4, 4, 3, gen, device))
    second = step_gather(st, ids, 4)
    assert len(smod._GATHER_PLANS) == n_plans  # the same plan served the second call
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))  # no result overwritten
    _assert_inputs_equal(second, step_gather_ref(st, ids, 4))
    # What varies per call is still checked on the cached path: T, draft_len and the outputs' metadata.
    with pytest.raises(TypeError, match="tokens_per_row"):
        step_gather(st, ids, True)
    with pytest.raises(ValueError, match="draft_len"):
        step_gather(st, ids, 4, draft_len=9)
    out = step_gather(st, ids, 4)
    with pytest.raises(ValueError, match=r"out\.input_ids"):
        step_gather(st, ids, 4, out=out._replace(input_ids=out.input_ids[:-1]))
    assert step_gather(st, ids, 4, out=out) is out
    _assert_inputs_equal(out, step_gather_ref(st, ids, 4))


def _wide_values(shape, sign: int, gen: torch.Generator) -> torch.Tensor:
    """int64 values whose magnitude lies in [2**32, 2**62): none survives a narrowing to 32 bits."""
    mag = torch.randint(2**32, 2**62, shape, generator=gen, dtype=torch.int64)
    return sign * mag


@pytest.mark.parametrize("sign", [1, -1], ids=["above+2^32", "below-2^32"])
def test_int64_values_beyond_32_bits_survive_scatter_and_gather(sign, device, gen):
    # Token ids, counts and the offsets derived from them as int64 values beyond 32 bits in both directions
    # (the other tests keep values within a vocabulary): any narrowing to int32 in a kernel shows up here.
    rows, t, slots = 7, 4, 13
    st = _stores(slots, 5, 4, 3, device, dtype=torch.int64)
    slot_ids = torch.randperm(slots, generator=gen)[:rows].to(device)
    m = rows + 2
    new, nxt, drafts = (_wide_values(s, sign, gen).to(device) for s in [(m, 6), (m, 4), (m, 2)])
    # Counts beyond 32 bits too: positive ones keep every new-token column, negative ones none.
    counts = _wide_values((m,), sign, gen).to(device)
    want = slot_scatter_ref(st, slot_ids, new, nxt, counts, drafts, row_begin=1)
    slot_scatter(st, slot_ids, new, nxt, counts, drafts, row_begin=1)
    _assert_stores_equal(st, want)
    written = st.new_token_counts[slot_ids.long()]
    assert bool(((written.abs() >= 2**32) & (written.sign() == sign)).all()), "counts were narrowed"
    if sign > 0:
        assert bool((st.new_tokens[:, slot_ids.long()].abs() >= 2**32).all()), "token ids were narrowed"

    out = _gather_out(rows, t, t - 1, device, torch.int64)
    got = step_gather(st, slot_ids, t, out=out)
    for x in got:
        assert_all_written(x)
    _assert_inputs_equal(got, step_gather_ref(st, slot_ids, t))
    assert bool((got.kv_offsets.abs() >= 2**32 - t).all()), "offsets were narrowed"
