"""Where the small kernels' time goes against the empty launch (H200 diagnostics, not a benchmark of record).

Every call is timed interleaved with the others (``time_interleaved``: sample by sample in turn, each behind its
own L2 flush). Probe kernels written here bound what the library kernels could reach: the scatter with its
layout as compile-time constants at several row blocks, a one-load-one-store scatter, a store-only kernel, an
empty kernel with 24 arguments; for block offsets, constant-layout variants, the same stores alone, the same
loads alone, and torch's memset and copy of the same bytes. Library kernels are called as users call them.

Usage (H200): ``PYTHONPATH=. python bench/probe_launch_floor.py`` (prints two rounds per section).
"""

import torch
import triton
import triton.language as tl

from bench._common import time_graph, time_interleaved
from kvforge.kernels import block_offsets as bo
from kvforge.kernels import slot_ops as so


@triton.jit
def nop(x):
    pass


@triton.jit
def nop_many(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, c0, c1, c2, c3):
    pass


@triton.jit(do_not_specialize=["n_rows"])
def scat_c(
    slot_ptr,
    n_rows,
    new_ptr,
    next_ptr,
    count_ptr,
    draft_ptr,
    st_new_ptr,
    st_next_ptr,
    st_count_ptr,
    st_draft_ptr,
    NSLOT: tl.constexpr,
    W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WIDE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_step = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=in_step, other=-1)
    if WIDE:
        slot = slot.to(tl.int64)
    ok = in_step & (slot >= 0) & (slot < NSLOT)
    w = tl.arange(0, W)[None, :]
    r2 = rows[:, None] * W + w
    m2 = in_step[:, None]
    count = tl.load(count_ptr + rows, mask=in_step, other=0)
    vn = tl.load(new_ptr + r2, mask=m2, other=0)
    vx = tl.load(next_ptr + r2, mask=m2, other=0)
    vd = tl.load(draft_ptr + r2, mask=m2, other=0)
    s2 = slot[:, None]
    ok2 = ok[:, None]
    tl.store(st_count_ptr + slot, count, mask=ok)
    tl.store(st_new_ptr + w * NSLOT + s2, tl.where(w < count[:, None], vn, 0), mask=ok2)
    tl.store(st_next_ptr + w * NSLOT + s2, vx, mask=ok2)
    tl.store(st_draft_ptr + s2 * W + w, vd, mask=ok2)


@triton.jit
def scat_min(slot_ptr, n_rows, st_count_ptr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=m, other=0)
    tl.store(st_count_ptr + slot, rows, mask=m)


@triton.jit
def store_only(st_count_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(st_count_ptr + i, i, mask=i < n)


@triton.jit
def off_write_only(out_ptr, so_pool, so_row, so_plane, BLOCK: tl.constexpr):
    pool = tl.program_id(2)
    seq = tl.program_id(1)
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = out_ptr + pool * so_pool + seq * so_row + blocks
    tl.store(dst, blocks)
    tl.store(dst + so_plane, blocks)


@triton.jit
def off_read_only(page_ptr, index_ptr, out_ptr, sp_pool, sp_row, BLOCK: tl.constexpr):
    pool = tl.program_id(2)
    seq = tl.program_id(1)
    row = tl.load(index_ptr + seq)
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(page_ptr + pool * sp_pool + row * sp_row + blocks)
    tl.store(out_ptr + blocks, page, mask=page == -12345)  # never true: the loads stay, nothing is written


@triton.jit(do_not_specialize=["n_seq"])
def off_c(
    page_ptr,
    index_ptr,
    scale_ptr,
    kvo_ptr,
    out_ptr,
    n_seq,
    SP_POOL: tl.constexpr,
    SP_ROW: tl.constexpr,
    SO_POOL: tl.constexpr,
    SO_ROW: tl.constexpr,
    SO_PLANE: tl.constexpr,
    BLOCK: tl.constexpr,
    CM: tl.constexpr,
):
    pool = tl.program_id(2)
    seq = tl.program_id(1)
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(index_ptr + seq)
    scale = tl.load(scale_ptr + pool)
    kvo = tl.load(kvo_ptr + pool)
    page = tl.load(page_ptr + pool * SP_POOL + row * SP_ROW + blocks)
    bad = page < 0
    p0 = tl.where(bad, 0, page * scale)
    p1 = tl.where(bad, 0, p0 + kvo)
    dst = out_ptr + pool * SO_POOL + seq * SO_ROW + blocks
    tl.store(dst, p0, cache_modifier=CM)
    tl.store(dst + SO_PLANE, p1, cache_modifier=CM)


def report(title, res, floor="empty"):
    f = res[floor]["ms_mean"]
    print(f"\n== {title}")
    for k, v in res.items():
        print(
            f"{k:42s} mean {v['ms_mean'] * 1e3:7.2f} us  median {v['ms'] * 1e3:6.2f}  p20 {v['ms_p20'] * 1e3:6.2f}"
            f"  p80 {v['ms_p80'] * 1e3:6.2f}  ratio {v['ms_mean'] / f:5.3f}",
            flush=True,
        )


def scatter_probe(dev):
    slots, n, w = 1024, 256, 8
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randint(1, 32000, shape, generator=g, dtype=torch.int32).to(dev)
    new, nxt, drafts = r(n, w), r(n, w), r(n, w)
    counts = torch.randint(1, w + 1, (n,), generator=g, dtype=torch.int32).to(dev)
    ids = torch.randperm(slots, generator=g)[:n].to(dev).int()
    stores = so.SlotStores.zeros(slots, w, w, w, dev)
    want = so.slot_scatter_ref(stores, ids, new, nxt, counts, drafts)
    x = torch.empty(16, device=dev)
    fns = {
        "empty": lambda: nop[(1,)](x),
        "empty 24 args": lambda: nop_many[(1,)](*([x] * 10), *([7] * 10), x, x, x, x),
        "library": lambda: so.slot_scatter(stores, ids, new, nxt, counts, drafts),
    }
    fns["library"]()
    torch.cuda.synchronize()
    assert all(torch.equal(a, e) for a, e in zip(stores.tensors(), want.tensors()))
    st = stores
    for br, nw, wide in [(16, 1, 0), (16, 1, 1), (32, 1, 0), (64, 2, 0), (128, 4, 0), (256, 4, 0), (256, 8, 0)]:
        grid = (triton.cdiv(n, br),)

        def f(grid=grid, br=br, nw=nw, wide=wide):
            scat_c[grid](
                ids, n, new, nxt, counts, drafts, *st.tensors(), NSLOT=slots, W=w, BLOCK_R=br, WIDE=wide, num_warps=nw
            )

        for t in st.tensors():
            t.zero_()
        f()
        torch.cuda.synchronize()
        assert all(torch.equal(a, e) for a, e in zip(st.tensors(), want.tensors())), (br, nw)
        fns[f"const R{br} w{nw} wide{wide}"] = f
    fns["min scatter R256 w4"] = lambda: scat_min[(1,)](ids, n, st.new_token_counts, BLOCK_R=256, num_warps=4)
    fns["min scatter R16 w1"] = lambda: scat_min[(16,)](ids, n, st.new_token_counts, BLOCK_R=16, num_warps=1)
    fns["store only 256"] = lambda: store_only[(1,)](st.new_token_counts, n, BLOCK=256, num_warps=4)
    for rnd in range(2):
        report(f"scatter round {rnd}", time_interleaved(fns, samples=800))


def offsets_probe(dev):
    g = torch.Generator().manual_seed(2)
    pools, capacity, blocks, n = 2, 1024, 2048, 256
    table = torch.randint(-1, 1 << 20, (pools, capacity, blocks), generator=g, dtype=torch.int32).to(dev)
    idx = torch.randperm(capacity, generator=g)[:n].to(dev)
    idx32 = idx.int()
    scales = torch.tensor([2, 4], dtype=torch.int32, device=dev)
    kv_off = torch.tensor([0, 1 << 20], dtype=torch.int32, device=dev)
    out = torch.zeros(pools, n, 2, blocks, dtype=torch.int32, device=dev)
    want = bo.copy_block_offsets_ref(table, idx, scales, kv_off, out.clone())
    x = torch.empty(16, device=dev)
    nbytes = pools * n * blocks * 4 * 3
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    src_r = torch.empty(nbytes // 3, dtype=torch.uint8, device=dev)
    dst_r = torch.empty_like(src_r)
    fns = {"empty": lambda: nop[(1,)](x), "library": lambda: bo.copy_block_offsets(table, idx, scales, kv_off, out)}
    fns["library"]()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for bl, nw, cm in [(2048, 4, ""), (2048, 4, ".cg"), (1024, 4, ""), (1024, 4, ".cg"), (512, 4, ""), (2048, 8, "")]:
        grid = (blocks // bl, n, pools)

        def f(grid=grid, bl=bl, nw=nw, cm=cm):
            off_c[grid](
                table,
                idx32,
                scales,
                kv_off,
                out,
                n,
                SP_POOL=table.stride(0),
                SP_ROW=table.stride(1),
                SO_POOL=out.stride(0),
                SO_ROW=out.stride(1),
                SO_PLANE=out.stride(2),
                BLOCK=bl,
                CM=cm,
                num_warps=nw,
            )

        out.zero_()
        f()
        torch.cuda.synchronize()
        assert torch.equal(out, want), (bl, nw, cm)
        fns[f"const B{bl} w{nw} {cm or '-'}"] = f
    fns["write only (same stores)"] = lambda: off_write_only[(1, n, pools)](
        out, out.stride(0), out.stride(1), out.stride(2), BLOCK=2048, num_warps=4
    )
    fns["read only (same loads)"] = lambda: off_read_only[(1, n, pools)](
        table, idx32, out, table.stride(0), table.stride(1), BLOCK=2048, num_warps=4
    )
    fns["torch zero_ of out (8.4 MB)"] = lambda: out.zero_()
    fns["torch copy 6.3 MB (same bytes)"] = lambda: dst.copy_(src)
    fns["torch copy 4.2 MB"] = lambda: dst_r.copy_(src_r)
    for rnd in range(2):
        report(f"offsets round {rnd}", time_interleaved(fns, samples=600))
    # Graph replays (warm L2): the same calls without the flush.
    for k in ("empty", "library", "write only (same stores)", "torch copy 6.3 MB (same bytes)"):
        print(f"graph {k:40s} {time_graph(fns[k], rep=100)['ms'] * 1e3:7.2f} us")


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    scatter_probe(dev)
    offsets_probe(dev)


if __name__ == "__main__":
    main()
