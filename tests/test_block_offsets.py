"""copy_block_offsets against copy_block_offsets_ref: layouts, chunking, folding, untouched rows, bad input."""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

import kvforge.kernels.block_offsets as bomod
from kvforge.kernels._runtime import kernel_device
from kvforge.kernels.block_offsets import copy_block_offsets, copy_block_offsets_ref
from tests.helpers import INT_POISON, poisoned


def _table(pools, rows, blocks, gen, *, layout4=False, bad_frac=0.15, device="cpu") -> torch.Tensor:
    shape = (pools, rows, 2, blocks) if layout4 else (pools, rows, blocks)
    g = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    t = torch.randint(0, 1 << 22, shape, generator=g, dtype=torch.int32, device=device)
    t[torch.rand(shape, generator=g, device=device) < bad_frac] = -1
    return t


def _run_and_check(table, index, scales, offsets, out) -> None:
    n = index.shape[0]
    want = copy_block_offsets_ref(table, index, scales, offsets, out)
    copy_block_offsets(table, index, scales, offsets, out)
    assert torch.equal(out, want), f"{int((out != want).sum())} entries differ"
    # Rows past n_seq kept the poison; rows below were all written (the poison is not a reachable value here).
    assert bool((out[:, n:] == INT_POISON).all())
    assert not bool((out[:, :n] == INT_POISON).any())


@pytest.mark.parametrize(
    ("pools", "rows", "blocks", "n_seq"),
    [(1, 1, 1, 1), (2, 9, 37, 5), (3, 20, 150, 13), (2, 6, 64, 6), (1, 40, 257, 3)],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference(pools, rows, blocks, n_seq, index_dtype, device, gen):
    table = _table(pools, rows, blocks, gen).to(device)
    index = torch.randperm(rows, generator=gen)[:n_seq].to(index_dtype).to(device)
    scales = torch.randint(1, 9, (pools,), generator=gen, dtype=torch.int32).to(device)
    offsets = torch.randint(0, 1 << 16, (pools,), generator=gen, dtype=torch.int32).to(device)
    out = poisoned((pools, n_seq + 3, 2, blocks), torch.int32, device)
    _run_and_check(table, index, scales, offsets, out)


def test_reference_system_table_reads_plane_0(device, gen):
    table = _table(2, 11, 70, gen, layout4=True).to(device)  # plane 1 holds unrelated values
    index = torch.tensor([10, 0, 4, 4], dtype=torch.int32, device=device)  # a repeated row is fine
    out = poisoned((2, 6, 2, 70), torch.int32, device)
    _run_and_check(table, index, [3, 5], [100, 7], out)
    # plane 0 of out is scale * table[..., 0, :]: check one entry by hand, independently of the reference.
    page = int(table[1, 10, 0, 3])
    assert int(out[1, 0, 0, 3]) == (0 if page < 0 else 5 * page)
    assert int(out[1, 0, 1, 3]) == (0 if page < 0 else 5 * page + 7)


def test_strided_table_and_out(device, gen):
    big = _table(3, 30, 90, gen).to(device)
    table = big[::2, 3:25, 10:80]  # pools, rows and blocks all strided
    index = torch.tensor([0, 21, 7], device=device)
    out_big = poisoned((2, 5, 2, 100), torch.int32, device)
    out = out_big[:, 1:, :, 20:90]
    _run_and_check(table, index, [2, 4], [1, 2], out)
    assert bool((out_big[:, 0] == INT_POISON).all())


def test_bad_pages_and_wrapping(device):
    # -1 and any other negative page give 0 in both planes; int32 arithmetic wraps like the reference.
    table = torch.tensor([[[-1, 0, 5, -7, 2**30]]], dtype=torch.int32, device=device)
    out = poisoned((1, 1, 2, 5), torch.int32, device)
    copy_block_offsets(table, torch.tensor([0], device=device), [4], [3], out)
    wrap = ((2**30 * 4) + 2**31) % 2**32 - 2**31
    assert out[0, 0, 0].tolist() == [0, 0, 20, 0, wrap]
    assert out[0, 0, 1].tolist() == [0, 3, 23, 0, wrap + 3]


def test_lists_reuse_one_device_copy(device, gen):
    table = _table(2, 4, 10, gen).to(device)
    out = poisoned((2, 2, 2, 10), torch.int32, device)
    idx = torch.tensor([1, 3], device=device)
    bomod._pool_constants.cache_clear()
    for _ in range(3):
        copy_block_offsets(table, idx, (2, 3), [5, 6], out)
    info = bomod._pool_constants.cache_info()
    assert info.misses == 2 and info.hits == 4
    assert torch.equal(out, copy_block_offsets_ref(table, idx, [2, 3], [5, 6], out))


def test_cpu_out_on_a_gpu_machine_takes_the_host_path(gen, monkeypatch):
    # Where kernels are compiled for a GPU, a CPU page table (a host-side cache manager) is computed with torch.
    monkeypatch.setattr(bomod, "interpreting", lambda: False)

    def no_launch(*args, **kwargs):
        raise AssertionError("a GPU kernel cannot write a CPU out")

    monkeypatch.setattr(bomod._KERNEL, "launch", no_launch)
    table = _table(3, 10, 50, gen, layout4=True)
    index = torch.tensor([9, 2, 2, 0], dtype=torch.int32)
    out = poisoned((3, 6, 2, 50), torch.int32, "cpu")
    _run_and_check(table, index, [2, 3, 4], torch.tensor([1, 5, 9], dtype=torch.int32), out)


def test_empty_selection_launches_nothing(device, gen, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched with n_seq == 0")

    monkeypatch.setattr(bomod._KERNEL, "launch", no_launch)
    out = poisoned((2, 3, 2, 8), torch.int32, device)
    before = out.clone()
    copy_block_offsets(
        _table(2, 4, 8, gen).to(device), torch.empty(0, dtype=torch.int32, device=device), [1, 1], [0, 0], out
    )
    assert torch.equal(out, before)


def test_rows_past_the_grid_limit_are_folded(device, gen, monkeypatch):
    # The real limit is 65,535 rows per grid axis; a limit of 2 exercises the same loop at interpreter sizes.
    monkeypatch.setattr(bomod, "_MAX_GRID_YZ", 2)
    table = _table(2, 12, 45, gen).to(device)
    index = torch.randperm(12, generator=gen)[:7].to(device)
    _run_and_check(table, index, [2, 3], [9, 1], poisoned((2, 8, 2, 45), torch.int32, device))


def test_too_many_pools_is_rejected(device, gen, monkeypatch):
    monkeypatch.setattr(bomod, "_MAX_GRID_YZ", 2)
    out = poisoned((3, 1, 2, 4), torch.int32, device)
    with pytest.raises(ValueError, match="pools exceed the grid limit"):
        copy_block_offsets(_table(3, 2, 4, gen).to(device), torch.tensor([0], device=device), [1] * 3, [0] * 3, out)
    assert bool((out == INT_POISON).all())


@pytest.mark.parametrize("fold", [False, True])
def test_device_index_out_of_range_reads_as_bad_pages(device, gen, fold):
    # What the kernel does with an index the host could not check (a device copy_index): zeros, no stray read.
    # Folded: 3 programs per pool and chunk walk the 4 rows (one of them takes two).
    table = _table(2, 5, 30, gen).to(device)
    index = torch.tensor([2, 5, -1, 0], dtype=torch.int32, device=device)
    out = poisoned((2, 4, 2, 30), torch.int32, device)
    bomod._KERNEL.launch(
        lambda m: (triton.cdiv(30, m["BLOCK"]), 3 if fold else 4, 2),
        (32, table.device.type),
        table,
        index,
        torch.tensor([2, 3], dtype=torch.int32, device=device),
        torch.tensor([1, 1], dtype=torch.int32, device=device),
        out,
        4,
        30,
        5,
        *table.stride(),
        1,
        1,
        1,
        *out.stride(),
        FOLD=fold,
    )
    good = torch.tensor([0, 3], device=device)
    want = copy_block_offsets_ref(table, torch.tensor([2, 0], device=device), [2, 3], [1, 1], out[:, good])
    assert torch.equal(out[:, good], want)
    assert bool((out[:, 1:3] == 0).all())


def _bad_cases():
    def t(*shape, dtype=torch.int32):
        return torch.zeros(shape, dtype=dtype)

    idx = torch.tensor([0, 1])
    yield "out-dtype", "out", TypeError, dict(out=t(2, 2, 2, 8, dtype=torch.int64))
    yield "out-ndim", "out", ValueError, dict(out=t(2, 2, 16))
    yield "out-planes", "out", ValueError, dict(out=t(2, 2, 3, 8))
    yield "out-pools", "out", ValueError, dict(out=t(3, 2, 2, 8))
    yield "out-blocks", "out", ValueError, dict(out=t(2, 2, 2, 9))
    yield "out-rows", "out", ValueError, dict(out=t(2, 1, 2, 8))
    yield "table-dtype", "page_indices", TypeError, dict(page_indices=t(2, 4, 8, dtype=torch.int64))
    yield "table-ndim", "page_indices", ValueError, dict(page_indices=t(2, 32))
    yield "table-4d-planes", "page_indices", ValueError, dict(page_indices=t(2, 4, 3, 8))
    yield "index-dtype", "copy_index", TypeError, dict(copy_index=idx.float())
    yield "index-ndim", "copy_index", ValueError, dict(copy_index=idx.view(1, 2))
    yield "index-high", "copy_index", ValueError, dict(copy_index=torch.tensor([0, 4]))
    yield "index-negative", "copy_index", ValueError, dict(copy_index=torch.tensor([-1, 1]))
    yield "scales-dtype", "index_scales", TypeError, dict(index_scales=t(2, dtype=torch.int64))
    yield "scales-len", "index_scales", ValueError, dict(index_scales=[1, 2, 3])
    yield "scales-type", "index_scales", TypeError, dict(index_scales=2)
    yield "scales-items", "index_scales", TypeError, dict(index_scales=[1.0, 2.0])
    yield "scales-range", "index_scales", ValueError, dict(index_scales=[1, 2**31])
    yield "offset-len", "kv_offset", ValueError, dict(kv_offset=t(3))
    yield "offset-ndim", "kv_offset", ValueError, dict(kv_offset=t(2, 1))
    yield "empty-table", "page_indices", ValueError, dict(page_indices=t(2, 0, 8))


BAD = list(_bad_cases())
HOST_CHECKED = {"index-high", "index-negative"}


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_writing(case, device):
    _, name, exc, override = case
    args = dict(
        page_indices=torch.zeros(2, 4, 8, dtype=torch.int32),
        copy_index=torch.tensor([0, 1]),
        index_scales=[1, 2],
        kv_offset=[0, 1],
        out=poisoned((2, 2, 2, 8), torch.int32, device),
    )
    args.update(override)
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    if device.type == "cuda" and case[0] in HOST_CHECKED:
        # Row indices are range-checked only in host memory (a device copy_index would need a sync): pinned.
        args["copy_index"] = override["copy_index"].pin_memory()
    out = args["out"]
    before = out.clone()
    with pytest.raises(exc, match=name):
        copy_block_offsets(**args)
    assert torch.equal(out, before), "a rejected call wrote into out"


@given(
    pools=st.integers(1, 3),
    rows=st.integers(1, 12),
    blocks=st.integers(1, 140),
    data=st.data(),
)
def test_property_random_layouts(pools, rows, blocks, data):
    device = kernel_device()  # hypothesis does not take function-scoped fixtures
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    n_seq = data.draw(st.integers(0, rows))
    extra = data.draw(st.integers(0, 2))
    table = _table(pools, rows, blocks, gen, layout4=data.draw(st.booleans())).to(device)
    index = torch.randint(0, rows, (n_seq,), generator=gen).to(device)
    scales = data.draw(st.lists(st.integers(0, 64), min_size=pools, max_size=pools))
    offsets = data.draw(st.lists(st.integers(-(2**20), 2**20), min_size=pools, max_size=pools))
    out = poisoned((pools, n_seq + extra, 2, blocks), torch.int32, device)
    want = copy_block_offsets_ref(table, index, scales, offsets, out)
    copy_block_offsets(table, index, scales, offsets, out)
    assert torch.equal(out, want)


@pytest.mark.gpu
def test_pageable_host_table_is_rejected(device, gen):
    out = poisoned((2, 2, 2, 16), torch.int32, device)
    with pytest.raises(ValueError, match="page_indices: a pageable host tensor"):
        copy_block_offsets(_table(2, 4, 16, gen), torch.tensor([0, 1], device=device), [1, 1], [0, 0], out)
    with pytest.raises(ValueError, match="copy_index: a pageable host tensor"):
        copy_block_offsets(_table(2, 4, 16, gen).to(device), torch.tensor([0, 1]), [1, 1], [0, 0], out)
    assert bool((out == INT_POISON).all())


@pytest.mark.gpu
@pytest.mark.parametrize(("n_seq", "blocks", "capacity"), [(256, 2048, 1024), (64, 262144, 96), (3, 1_000_003, 4)])
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_full_size_gpu(n_seq, blocks, capacity, where, device, gen):
    # The anchor workloads (256 requests x 2,048 blocks; 64 x 262,144) and a row of a million blocks.
    table = _table(2, capacity, blocks, gen, device=device)
    table = table.cpu().pin_memory() if where == "pinned" else table
    index = torch.randperm(capacity, generator=gen)[:n_seq]
    index = index.pin_memory() if where == "pinned" else index.to(device)
    out = poisoned((2, n_seq + 2, 2, blocks), torch.int32, device)
    _run_and_check(table, index, torch.tensor([2, 4], dtype=torch.int32, device=device), [0, 1 << 20], out)


@pytest.mark.gpu
def test_device_index_out_of_range_on_gpu(device, gen):
    table = _table(2, 5, 3000, gen).to(device)
    index = torch.tensor([1, 7, 4], device=device)  # 7 is past the table: cannot be checked without a sync
    out = poisoned((2, 3, 2, 3000), torch.int32, device)
    copy_block_offsets(table, index, [1, 2], [3, 4], out)
    assert bool((out[:, 1] == 0).all())
    ok = torch.tensor([0, 2], device=device)
    want = copy_block_offsets_ref(table, torch.tensor([1, 4], device=device), [1, 2], [3, 4], out[:, ok])
    assert torch.equal(out[:, ok], want)


@pytest.mark.gpu
def test_cpu_out_on_the_gpu_machine(gen):
    table = _table(2, 7, 300, gen)
    index = torch.tensor([6, 1, 3])
    _run_and_check(table, index, [2, 3], [4, 5], poisoned((2, 4, 2, 300), torch.int32, "cpu"))


def test_repeated_calls_reuse_the_checked_plan_and_still_check_what_varies(device, gen):
    table = _table(2, 9, 40, gen).to(device)
    index = torch.tensor([8, 0, 3], device=device)
    scales, offsets = torch.tensor([2, 3], dtype=torch.int32, device=device), [7, 1]
    out = poisoned((2, 4, 2, 40), torch.int32, device)
    for _ in range(3):  # the later calls take the cached plan
        _run_and_check(table, index, scales, offsets, out)
    before = out.clone()
    if device.type == "cpu":
        index[1] = 9  # same tensor and metadata, new values: still range-checked
        with pytest.raises(ValueError, match="copy_index: values must lie"):
            copy_block_offsets(table, index, scales, offsets, out)
        index[1] = 0
    with pytest.raises(TypeError, match="kv_offset"):
        copy_block_offsets(table, index, scales, [7, 1.0], out)
    with pytest.raises(TypeError, match="kv_offset"):
        copy_block_offsets(table, index, scales, [7, True], out)
    with pytest.raises(ValueError, match="kv_offset: expected 2 values"):
        copy_block_offsets(table, index, scales, [7, 1, 0], out)
    with pytest.raises(TypeError, match="out"):
        copy_block_offsets(table, index, scales, offsets, out.view(torch.float32))
    assert torch.equal(out, before)
    out.resize_(2, 2, 2, 40)  # same address, fewer rows than n_seq: the checked path again
    with pytest.raises(ValueError, match="out: has 2 rows"):
        copy_block_offsets(table, index, scales, offsets, out)
    assert torch.equal(out.reshape(-1), before.reshape(-1)[: out.numel()])  # nothing written
    plan = next(iter(bomod._PLANS._plans.values()))
    assert not any(isinstance(v, torch.Tensor) for v in plan.ptr_args)
