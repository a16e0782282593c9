"""Block pack (gather) and unpack (scatter) kernels against their plain-torch references.

Byte-exact comparisons on fresh random bytes (NaN and FP8 bit patterns included: the copy must not touch them),
awkward sizes (odd row lengths force 2- and 1-byte words), strided pools, head slices, poisoned outputs and
untouched neighbours; bad arguments are rejected before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.kv_pack import (
    KVPackLayout,
    KVPackPlan,
    kv_pack_nbytes,
    pack_kv_blocks,
    pack_kv_blocks_ref,
    unpack_kv_blocks,
    unpack_kv_blocks_ref,
)
from tests.helpers import assert_all_written, poison

POISON = 0xAB


def random_pool(
    gen: torch.Generator, pages: int, tpb: int, elems: int, dtype: torch.dtype, device: torch.device, *, arena: int = 0
) -> torch.Tensor:
    """Random bytes viewed as ``dtype``; with ``arena`` > 0 the pool is a strided view into a larger buffer."""
    esize = torch.empty(0, dtype=dtype).element_size()
    if arena:
        big = torch.randint(0, 256, (pages, tpb + arena, (elems + 3) * esize), generator=gen, dtype=torch.uint8)
        return big.to(device).view(dtype)[:, 1 : tpb + 1, 2 : elems + 2]
    raw = torch.randint(0, 256, (pages, tpb, elems * esize), generator=gen, dtype=torch.uint8)
    return raw.to(device).view(dtype)


def finite_pool(gen, pages, tpb, elems, dtype, device):
    """Values without NaN (so an unwritten, NaN-poisoned element is detectable after unpack)."""
    x = torch.randn(pages, tpb, elems, generator=gen) * 3
    if dtype == torch.float8_e4m3fn:
        from kvforge.kernels._fp8 import e4m3_ref

        return e4m3_ref(x).to(device)
    return x.to(dtype).to(device)


def pick_pages(gen: torch.Generator, pages: int, n: int) -> list[int]:
    return torch.randperm(pages, generator=gen)[:n].tolist()


CASES = [
    # (layer dtypes, pages, tokens_per_block, elems_per_token, blocks per layer, head slices, strided pools)
    ([torch.bfloat16] * 3 + [torch.float8_e4m3fn], 11, 4, 24, [5, 5, 5, 5], False, False),
    ([torch.bfloat16, torch.float8_e4m3fn], 9, 3, 7, [4, 6], False, False),  # 14- and 7-byte rows
    ([torch.float32, torch.float16, torch.float8_e4m3fn], 7, 5, 9, [3, 0, 7], False, True),
    ([torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn], 10, 2, 16, [6, 6, 2], True, False),
    ([torch.float8_e4m3fn], 5, 1, 3, [5], True, True),
]


def make_case(case, gen, device, *, finite: bool = False):
    dtypes, pages, tpb, elems, counts, heads, strided = case
    if finite:
        pools = [finite_pool(gen, pages, tpb, elems, dt, device) for dt in dtypes]
    else:
        pools = [random_pool(gen, pages, tpb, elems, dt, device, arena=2 if strided else 0) for dt in dtypes]
    idx = [pick_pages(gen, pages, n) for n in counts]
    cols = None
    if heads:
        cols = []
        for i in range(len(dtypes)):
            lo = int(torch.randint(0, elems - 1, (1,), generator=gen))
            hi = int(torch.randint(lo + 1, elems + 1, (1,), generator=gen))
            cols.append((lo, hi) if i % 2 == 0 else None)
    return pools, idx, cols


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_pack_matches_reference_byte_exact(case, gen, device):
    pools, idx, cols = make_case(case, gen, device)
    n = kv_pack_nbytes(pools, idx, cols)
    out = torch.full((n + 37,), POISON, dtype=torch.uint8, device=device)
    got = pack_kv_blocks(pools, idx, col_ranges=cols, out=out)
    ref = pack_kv_blocks_ref(pools, idx, col_ranges=cols)
    assert got.numel() == n == ref.numel()
    assert torch.equal(got.cpu(), ref.cpu()), "packed bytes differ from the reference"
    assert bool((out[n:] == POISON).all()), "pack wrote past the packed size"
    # A repeated page in a gather is legal (pack reads it twice).
    dup = [list(i) + list(i[:1]) for i in idx]
    assert torch.equal(
        pack_kv_blocks(pools, dup, col_ranges=cols).cpu(), pack_kv_blocks_ref(pools, dup, col_ranges=cols).cpu()
    )


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_unpack_matches_reference_and_writes_every_listed_page(case, gen, device):
    src, idx, cols = make_case(case, gen, device, finite=True)
    buf = pack_kv_blocks_ref(src, idx, col_ranges=cols)
    dst_pages = [pick_pages(gen, p.shape[0], len(i)) for p, i in zip(src, idx)]
    dst = [finite_pool(gen, *p.shape, p.dtype, device) for p in src]
    for p, pages, cr in zip(dst, dst_pages, cols or [None] * len(dst)):
        lo, hi = cr if cr is not None else (0, p.shape[2])
        for page in pages:
            poison(p[page, :, lo:hi])
    expected = [p.clone() for p in dst]
    unpack_kv_blocks_ref(buf, expected, dst_pages, col_ranges=cols)
    unpack_kv_blocks(buf, dst, dst_pages, col_ranges=cols)
    for i, (a, b) in enumerate(zip(dst, expected)):
        assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()), f"layer {i} differs"
        if dst_pages[i]:
            lo, hi = cols[i] if cols and cols[i] else (0, a.shape[2])
            assert_all_written(a[dst_pages[i], :, lo:hi], f"layer {i} written pages")


def test_roundtrip_through_the_kernels_preserves_bit_patterns(gen, device):
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn]
    src = [random_pool(gen, 8, 4, 20, dt, device) for dt in dtypes]
    idx = [pick_pages(gen, 8, 6) for _ in dtypes]
    dst = [torch.zeros_like(p) for p in src]
    dst_idx = [pick_pages(gen, 8, 6) for _ in dtypes]
    unpack_kv_blocks(pack_kv_blocks(src, idx), dst, dst_idx)
    for s, d, si, di in zip(src, dst, idx, dst_idx):
        assert torch.equal(s[si].view(torch.uint8).cpu(), d[di].view(torch.uint8).cpu())


def test_plan_is_reusable_and_empty_transfers_launch_nothing(gen, device):
    src = [random_pool(gen, 6, 2, 8, torch.bfloat16, device)]
    plan = KVPackPlan(src, [[1, 4]])
    first = plan.pack().clone()
    src[0][1] += 1  # new contents, same pages: the plan reads them again
    assert not torch.equal(first.cpu(), plan.pack().cpu())
    assert torch.equal(plan.pack().cpu(), pack_kv_blocks_ref(src, [[1, 4]]).cpu())
    empty = KVPackPlan(src, [[]], unpack=True)
    assert empty.nbytes == 0
    empty.unpack(torch.empty(0, dtype=torch.uint8, device=device))
    assert pack_kv_blocks([], []).numel() == 0


def test_layout_plans_match_the_reference_for_any_block_counts(gen, device):
    """One layout (layers sharing page tables, a head slice, an FP8 layer) planned for several requests."""
    src = [random_pool(gen, 9, 3, 10, dt, device) for dt in (torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn)]
    cols = [None, (2, 7), None]
    layout = KVPackLayout(src, cols, tables=[0, 0, 1])
    dst = [torch.zeros_like(p) for p in src]
    dst_layout = KVPackLayout(dst, cols, tables=[0, 0, 1])
    for n_group, n_draft in ((4, 2), (0, 3), (7, 7), (1, 0)):
        pages = [pick_pages(gen, 9, n_group), pick_pages(gen, 9, n_draft)]
        per_layer = [pages[0], pages[0], pages[1]]
        buf = layout.plan(pages).pack()
        assert torch.equal(buf.cpu(), pack_kv_blocks_ref(src, per_layer, col_ranges=cols).cpu())
        dst_pages = [pick_pages(gen, 9, n_group), pick_pages(gen, 9, n_draft)]
        dst_layout.plan(dst_pages, unpack=True).unpack(buf)
        for s, d, c, si, di in zip(src, dst, cols, per_layer, [dst_pages[0], dst_pages[0], dst_pages[1]]):
            lo, hi = c or (0, s.shape[2])
            assert torch.equal(s[si][:, :, lo:hi].view(torch.uint8).cpu(), d[di][:, :, lo:hi].view(torch.uint8).cpu())


def test_pack_with_a_header_frames_the_message(gen, device):
    src = [random_pool(gen, 6, 3, 5, torch.float16, device), random_pool(gen, 6, 3, 5, torch.float8_e4m3fn, device)]
    idx = [[5, 0, 2], [1]]
    plan = KVPackPlan(src, idx)
    out = torch.full((32 + plan.nbytes + 7,), POISON, dtype=torch.uint8, device=device)
    head = [7, -(2**63), 2**63 - 1, plan.nbytes]
    got = plan.pack(out=out, header=head)
    assert got.data_ptr() == out.data_ptr() + 32 and got.numel() == plan.nbytes
    assert out[:32].cpu().view(torch.int64).tolist() == head
    assert torch.equal(out[32 : 32 + plan.nbytes].cpu(), pack_kv_blocks_ref(src, idx).cpu())
    assert (out[32 + plan.nbytes :].cpu() == POISON).all(), "wrote past the message"
    empty = KVPackPlan(src, [[], []])  # no blocks: the header alone is still written
    short = torch.zeros(16, dtype=torch.uint8, device=device)
    empty.pack(out=short, header=[3, 4])
    assert short.cpu().view(torch.int64).tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"^out: expected at least"):
        plan.pack(out=out[: 31 + plan.nbytes], header=head)
    with pytest.raises(ValueError, match=r"^header: expected int64 values"):
        plan.pack(header=[2**63])
    with pytest.raises(TypeError, match=r"^header: expected a sequence of ints"):
        plan.pack(header=torch.tensor([1]))


def test_layout_rejects_bad_tables_and_page_lists(gen, device):
    pools = [random_pool(gen, 4, 2, 8, torch.bfloat16, device) for _ in range(2)]
    with pytest.raises(ValueError, match=r"^tables: expected 2 entries"):
        KVPackLayout(pools, tables=[0])
    with pytest.raises(ValueError, match=r"^tables: expected non-negative ints"):
        KVPackLayout(pools, tables=[0, -1])
    layout = KVPackLayout(pools, tables=[0, 0])
    with pytest.raises(ValueError, match=r"^pages: expected 1 page lists"):
        layout.plan([[0], [1]])
    with pytest.raises(TypeError, match=r"^pages: expected a sequence"):
        layout.plan(torch.tensor([[0]]))
    with pytest.raises(ValueError, match=r"^pages\[0\]: page indices must lie in \[0, 4\)"):
        layout.plan([[4]])
    with pytest.raises(ValueError, match=r"^pages\[0\]: a destination page appears more than once"):
        layout.plan([[1, 1]], unpack=True)


def _bad_calls(pool, fp8, buf):
    return [
        ("pools", TypeError, lambda: pack_kv_blocks(pool, [[0]], out=buf)),
        ("pools[0]", ValueError, lambda: pack_kv_blocks([pool[0]], [[0]], out=buf)),
        ("pools[1]", ValueError, lambda: pack_kv_blocks([pool, fp8.transpose(1, 2)], [[0], [0]], out=buf)),
        ("page_indices", ValueError, lambda: pack_kv_blocks([pool, fp8], [[0]], out=buf)),
        ("page_indices[0]", ValueError, lambda: pack_kv_blocks([pool], [[0, 4]], out=buf)),
        ("page_indices[0]", ValueError, lambda: pack_kv_blocks([pool], [[-1]], out=buf)),
        ("page_indices[0]", TypeError, lambda: pack_kv_blocks([pool], [torch.tensor([0.0])], out=buf)),
        ("col_ranges[0]", ValueError, lambda: pack_kv_blocks([pool], [[0]], col_ranges=[(4, 4)], out=buf)),
        ("col_ranges[0]", ValueError, lambda: pack_kv_blocks([pool], [[0]], col_ranges=[(0, 9)], out=buf)),
        ("out", ValueError, lambda: pack_kv_blocks([pool], [[0, 1]], out=buf[:63])),
        ("out", TypeError, lambda: pack_kv_blocks([pool], [[0]], out=buf.view(torch.int8))),
        ("page_indices[1]", ValueError, lambda: unpack_kv_blocks(buf, [fp8, pool], [[0], [2, 2]])),
        ("buf", ValueError, lambda: unpack_kv_blocks(buf[:10], [pool], [[1]])),
        ("plan", ValueError, lambda: KVPackPlan([pool], [[1]]).unpack(buf)),
    ]


@pytest.mark.parametrize("k", range(14))
def test_bad_arguments_are_rejected_before_any_write(k, gen, device):
    pool = finite_pool(gen, 4, 2, 8, torch.bfloat16, device)
    fp8 = finite_pool(gen, 4, 2, 8, torch.float8_e4m3fn, device)
    buf = torch.full((64,), POISON, dtype=torch.uint8, device=device)
    snapshot = [pool.clone(), fp8.view(torch.uint8).clone(), buf.clone()]
    name, exc, call = _bad_calls(pool, fp8, buf)[k]
    escaped = name.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(exc, match=rf"^{escaped}: "):
        call()
    assert torch.equal(pool, snapshot[0]) and torch.equal(fp8.view(torch.uint8), snapshot[1])
    assert torch.equal(buf, snapshot[2]), "a rejected call wrote to its buffer"


def test_rejected_unpack_leaves_pools_untouched(gen, device):
    pool = finite_pool(gen, 4, 2, 8, torch.bfloat16, device)
    keep = pool.clone()
    buf = torch.randint(0, 256, (64,), generator=gen, dtype=torch.uint8).to(device)
    with pytest.raises(ValueError, match="appears more than once"):
        unpack_kv_blocks(buf, [pool, pool], [[0], [3, 3]])
    assert torch.equal(pool, keep)


@pytest.mark.gpu
def test_full_size_pack_unpack_on_gpu(gen, device):
    """A slice of the benchmark's workload: bf16 MLA layers of 576 elements plus an FP8 draft layer."""
    pages, tpb, n = 1200, 64, 1000
    dtypes = [torch.bfloat16] * 6 + [torch.float8_e4m3fn]
    src = [random_pool(gen, pages, tpb, 576, dt, device) for dt in dtypes]
    idx = [pick_pages(gen, pages, n)] * len(dtypes)
    buf = pack_kv_blocks(src, idx)
    assert torch.equal(buf, pack_kv_blocks_ref(src, idx))
    dst = [torch.zeros_like(p) for p in src]
    dst_idx = [pick_pages(gen, pages, n)] * len(dtypes)
    unpack_kv_blocks(buf, dst, dst_idx)
    expected = [torch.zeros_like(p) for p in src]
    unpack_kv_blocks_ref(buf, expected, dst_idx)
    for a, b in zip(dst, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
