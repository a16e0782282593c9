"""The device page table: per-request block offsets for every pool, from a host or device page-index table.

``copy_block_offsets(page_indices, copy_index, index_scales, kv_offset, out)`` writes, for each selected row
``i < len(copy_index)``, pool ``p`` and block ``b`` (``page = page_indices[p, copy_index[i], b]``)::

    out[p, i, 0, b] = index_scales[p] * page            (0 when page < 0; -1 is the bad-page marker)
    out[p, i, 1, b] = out[p, i, 0, b] + kv_offset[p]    (0 when page < 0)

in wrapping int32; other rows of ``out`` are untouched. ``page_indices`` is ``[pools, row_capacity, blocks]``
int32 (any strides) or the reference ``[pools, rows, 2, blocks]`` table (plane 0 read). ``out`` decides the
device; on a GPU the inputs may be device tensors or *pinned* host tensors (a pageable host tensor: ``ValueError``);
``index_scales`` / ``kv_offset`` may be int sequences. A host ``copy_index`` is range-checked; an out-of-range
device row yields zeros. Input placement and grid details: ``docs/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_tensor, same_device
from kvforge.kernels._runtime import (
    ConfigTable,
    DirectLaunch,
    PlanCache,
    TunedKernel,
    cdiv,
    hooks_active,
    interpreting,
    tensor_key,
)
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = ["copy_block_offsets", "copy_block_offsets_ref", "selfcheck"]

_MAX_GRID_YZ = 65535
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _offsets_row(
    page_ptr, index_ptr, scale_ptr, kv_offset_ptr, out_ptr, i, pool, blocks, in_row, row_capacity, sp_pool, sp_row,
    sp_block, s_index, s_scale, s_kv_offset, so_pool, so_row, so_plane, so_block,
):  # fmt: skip
    """Both planes of one selected row ``i`` for one pool and one chunk of blocks."""
    seq = tl.cast(i, tl.int64)
    row = tl.load(index_ptr + seq * s_index).to(tl.int64)
    # The per-pool constants load here, after the row index and in the same memory round trip. Loaded before
    # the row index they went to uniform registers, and that move waited for them before the row index load
    # could issue: three dependent round trips (constants, index, table) instead of two.
    scale = tl.load(scale_ptr + pool * s_scale).to(tl.int32)
    kv_offset = tl.load(kv_offset_ptr + pool * s_kv_offset).to(tl.int32)
    # A device index cannot be checked on the host: an out-of-range row reads as bad pages, never past the table.
    row_ok = (row >= 0) & (row < row_capacity)
    # Clamp-then-select instead of folding row_ok into the load mask: the interpreter (Triton 3.9) gives a
    # scalar comparison the wrong dtype when it is broadcast into a mask.
    src = page_ptr + pool * sp_pool + tl.where(row_ok, row, 0) * sp_row + blocks * sp_block
    page = tl.where(row_ok, tl.load(src, mask=in_row, other=-1), -1)
    bad = page < 0
    plane0 = tl.where(bad, 0, page * scale)
    plane1 = tl.where(bad, 0, plane0 + kv_offset)
    dst = out_ptr + pool * so_pool + seq * so_row + blocks * so_block
    tl.store(dst, plane0, mask=in_row)
    tl.store(dst + so_plane, plane1, mask=in_row)


@triton.jit(do_not_specialize=["n_seq", "row_capacity"])
def _block_offsets_kernel(
    page_ptr,
    index_ptr,
    scale_ptr,
    kv_offset_ptr,
    out_ptr,
    n_seq,
    n_blocks,
    row_capacity,
    sp_pool,
    sp_row,
    sp_block,
    s_index,
    s_scale,
    s_kv_offset,
    so_pool,
    so_row,
    so_plane,
    so_block,
    BLOCK: tl.constexpr,
    FOLD: tl.constexpr,
):
    pool = tl.program_id(2).to(tl.int64)
    blocks = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = blocks < n_blocks
    if FOLD:  # more rows than a grid axis holds: each program walks rows with the grid's stride
        for i in range(tl.program_id(1), n_seq, tl.num_programs(1)):
            _offsets_row(
                page_ptr, index_ptr, scale_ptr, kv_offset_ptr, out_ptr, i, pool, blocks, in_row, row_capacity,
                sp_pool, sp_row, sp_block, s_index, s_scale, s_kv_offset, so_pool, so_row, so_plane, so_block,
            )  # fmt: skip
    else:
        # One row per program: no loop, so the row index load is the kernel's first instruction that waits on
        # memory (the loop's bounds and branch cost ~0.3 us of a ~8 us call on the H200 probe).
        _offsets_row(
            page_ptr, index_ptr, scale_ptr, kv_offset_ptr, out_ptr, tl.program_id(1), pool, blocks, in_row,
            row_capacity, sp_pool, sp_row, sp_block, s_index, s_scale, s_kv_offset, so_pool, so_row, so_plane,
            so_block,
        )  # fmt: skip


_SM90 = [
    triton.Config({"BLOCK": b}, num_warps=w)
    for b, w in [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]
]
_TABLE = ConfigTable(
    fallback=[triton.Config({"BLOCK": 1024}, num_warps=4)],
    interpreter=triton.Config({"BLOCK": 64}, num_warps=1),
    by_arch={(9, 0): _SM90},
    # A block wider than the row only masks lanes off.
    keep=lambda cfg, key: cfg.kwargs["BLOCK"] <= max(512, key[0]),
)
_KERNEL = TunedKernel("copy_block_offsets", _block_offsets_kernel, _TABLE)


def _readable(name: str, t: torch.Tensor, device: torch.device) -> None:
    """A tensor the kernel can read: on ``device``, or pinned host memory when ``device`` is a GPU."""
    if same_device(t.device, device):
        return
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            raise ValueError(
                f"{name}: a pageable host tensor cannot be read by the kernel; pin it (tensor.pin_memory()) "
                f"or move it to {device}"
            )
        return
    raise ValueError(f"{name}: expected a tensor on {device} (or pinned host memory), got one on {t.device}")


@lru_cache(maxsize=64)
def _pool_constants(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _per_pool(
    name: str, v: object, pools: int, device: torch.device, *, resolved: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        check_tensor(name, v, dtype=torch.int32, ndim=1)
        _readable(name, v, device)
        t = v
    elif resolved is not None:  # a valid int sequence whose device copy the caller already looked up
        t = resolved
    elif isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise TypeError(f"{name}: expected a sequence of ints")
        if any(not -(2**31) <= x < 2**31 for x in v):
            raise ValueError(f"{name}: values must fit in int32, got {list(v)}")
        t = _pool_constants(tuple(v), device)
    else:
        raise TypeError(f"{name}: expected an int32 tensor or a sequence of ints, got {type(v).__name__}")
    if t.shape[0] != pools:
        raise ValueError(f"{name}: expected {pools} values (one per pool), got {t.shape[0]}")
    return t


def _plane0(page_indices: torch.Tensor) -> torch.Tensor:
    check_tensor("page_indices", page_indices, dtype=torch.int32)
    if page_indices.dim() == 4:
        if page_indices.shape[2] != 2:
            raise ValueError(
                f"page_indices: a 4-D table must be [pools, rows, 2, blocks], got {list(page_indices.shape)}"
            )
        return page_indices[:, :, 0, :]
    if page_indices.dim() != 3:
        raise ValueError(
            f"page_indices: expected [pools, row_capacity, blocks] or [pools, rows, 2, blocks], "
            f"got shape {list(page_indices.shape)}"
        )
    return page_indices


class _OffsetsPlan:
    """What a validated ``copy_block_offsets`` argument set launches with; holds no tensors.

    ``ptr_args`` are the kernel arguments with each device tensor replaced by its address; a pinned host tensor
    stays a position in ``host_args`` (filled from the call's own tensors, so the launcher translates it).
    """

    __slots__ = (
        "direct",
        "fold",
        "grid",
        "host_args",
        "host_index",
        "key",
        "n_seq",
        "out_cpu",
        "ptr_args",
        "row_capacity",
        "spec",
    )

    def __init__(self, n_seq: int, row_capacity: int, host_index: bool, out_cpu: bool) -> None:
        self.n_seq = n_seq
        self.row_capacity = row_capacity
        self.host_index = host_index
        self.out_cpu = out_cpu
        # More selected rows than a grid axis holds: the kernel's FOLD path (part of the compiled spec).
        self.fold = n_seq > _MAX_GRID_YZ
        self.spec: tuple = ()
        self.key: tuple = ()
        self.grid: tuple[int, int, int] = (0, 0, 0)
        self.direct: DirectLaunch | None = None
        self.ptr_args: tuple = ()
        self.host_args: tuple[int, ...] = ()


_PLANS = PlanCache()


def _plan_key(
    page_indices: torch.Tensor, copy_index: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
) -> tuple:
    return (
        tensor_key(page_indices),
        tensor_key(copy_index),
        tensor_key(scales),
        tensor_key(offsets),
        tensor_key(out),
        _MAX_GRID_YZ,
    )


def _seq_constants(v: object, device: torch.device) -> torch.Tensor | None:
    """The cached device copy of a per-pool int sequence, or None when ``v`` is not a valid one."""
    if isinstance(v, torch.Tensor) or not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        return None
    vt = tuple(v)
    for x in vt:
        if type(x) is not int or not -(2**31) <= x < 2**31:
            return None
    return _pool_constants(vt, device)


def copy_block_offsets(
    page_indices: torch.Tensor,
    copy_index: torch.Tensor,
    index_scales: torch.Tensor | Sequence[int],
    kv_offset: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> None:
    """Write the block offsets of rows ``copy_index`` into ``out[:, :n_seq]`` (see the module docstring).

    Shapes: ``page_indices [pools, row_capacity, blocks]`` (or ``[pools, rows, 2, blocks]``) int32,
    ``copy_index [n_seq]`` int32/int64, ``index_scales`` / ``kv_offset`` ``[pools]`` int32 (or int
    sequences), ``out [pools, >= n_seq, 2, blocks]`` int32. Every check runs before the launch; a call whose
    tensors have the same addresses, shapes, strides, dtypes and devices as an earlier valid call reuses that
    call's checked launch plan (host ``copy_index`` values are still range-checked each time).
    """
    plan = None
    try:
        dev = out.device
        # A per-pool int sequence is looked up in its device-copy cache once per call, on either path.
        scales = index_scales if isinstance(index_scales, torch.Tensor) else _seq_constants(index_scales, dev)
        offsets = kv_offset if isinstance(kv_offset, torch.Tensor) else _seq_constants(kv_offset, dev)
        if scales is not None and offsets is not None:
            plan = _PLANS.get(_plan_key(page_indices, copy_index, scales, offsets, out))
    except (AttributeError, TypeError):  # not tensors: the checked path names the argument
        scales = offsets = plan = None
    if plan is None:
        plan, scales, offsets = _offsets_plan(page_indices, copy_index, index_scales, kv_offset, out, scales, offsets)
    elif plan.host_index:
        _check_host_rows(copy_index, plan.row_capacity)
    if plan.n_seq == 0:
        return
    if plan.out_cpu and not interpreting():
        _host_path(_plane0(page_indices), copy_index, scales, offsets, out)
        return
    _launch(plan, page_indices, copy_index, scales, offsets, out)


def _check_host_rows(copy_index: torch.Tensor, row_capacity: int) -> None:
    """Host memory: checking costs no device synchronisation."""
    if copy_index.shape[0] > 0:
        lo, hi = int(copy_index.min()), int(copy_index.max())
        if lo < 0 or hi >= row_capacity:
            raise ValueError(f"copy_index: values must lie in [0, {row_capacity}), got min {lo}, max {hi}")


def _offsets_plan(
    page_indices: torch.Tensor,
    copy_index: torch.Tensor,
    index_scales: torch.Tensor | Sequence[int],
    kv_offset: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    scales: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[_OffsetsPlan, torch.Tensor, torch.Tensor]:
    """Every check of ``copy_block_offsets``; returns (and caches) the plan of this argument set, with the
    per-pool tensors. ``scales`` / ``offsets``: sequences already resolved to their cached device copies."""
    check_tensor("out", out, dtype=torch.int32, ndim=4)
    device = out.device
    if device.type != "cpu":  # a CPU out outside the interpreter takes the host path (module docstring)
        check_launch_device("out", out)
    pages = _plane0(page_indices)
    _readable("page_indices", page_indices, device)
    check_tensor("copy_index", copy_index, dtype=_INDEX_DTYPES, ndim=1)
    _readable("copy_index", copy_index, device)
    pools, row_capacity, n_blocks = pages.shape
    n_seq = copy_index.shape[0]
    if out.shape[0] != pools or out.shape[2] != 2 or out.shape[3] != n_blocks:
        raise ValueError(
            f"out: expected [pools={pools}, >= n_seq, 2, blocks={n_blocks}] to match page_indices, "
            f"got {list(out.shape)}"
        )
    if out.shape[1] < n_seq:
        raise ValueError(f"out: has {out.shape[1]} rows, fewer than n_seq = len(copy_index) = {n_seq}")
    scales = _per_pool("index_scales", index_scales, pools, device, resolved=scales)
    offsets = _per_pool("kv_offset", kv_offset, pools, device, resolved=offsets)
    if pools > _MAX_GRID_YZ:
        raise ValueError(f"page_indices: {pools} pools exceed the grid limit of {_MAX_GRID_YZ}")
    if n_seq > 0 and row_capacity == 0:
        raise ValueError("page_indices: the table has no rows, so no copy_index value is valid")
    # Only rows < n_seq are written; those must not alias one another nor any input.
    check_no_overlap(
        {"out": out[:, :n_seq]},
        {"page_indices": page_indices, "copy_index": copy_index, "index_scales": scales, "kv_offset": offsets},
    )
    host_index = copy_index.device.type == "cpu"
    if host_index:
        _check_host_rows(copy_index, row_capacity)
    if n_blocks == 0 or pools == 0:
        n_seq = 0  # nothing to write: no launch
    plan = _OffsetsPlan(n_seq, row_capacity, host_index, device.type == "cpu")
    tensors = (pages, copy_index, scales, offsets, out)
    if n_seq:
        key = (min(1 << max(n_blocks - 1, 0).bit_length(), 1 << 16), pages.device.type)
        ints = (*pages.stride(), copy_index.stride(0), scales.stride(0), offsets.stride(0), *out.stride())
        plan.key = key
        # n_seq and row_capacity are do_not_specialize; everything else Triton specialises on is in the spec.
        aligned = tuple((t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)
        plan.spec = (key, n_blocks, ints, aligned, plan.fold)
        args = (*tensors, n_seq, n_blocks, row_capacity, *ints)
        # A device tensor's address is its kernel pointer; a pinned host tensor is passed as itself so that the
        # launcher translates (and re-checks) it.
        plan.host_args = tuple(i for i, t in enumerate(tensors) if t.device.type != "cuda")
        plan.ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    _PLANS.put(_plan_key(page_indices, copy_index, scales, offsets, out), plan)
    return plan, scales, offsets


def _launch(
    plan: _OffsetsPlan,
    page_indices: torch.Tensor,
    copy_index: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    d = plan.direct
    if d is not None and not hooks_active() and d.current_device() == d.device:
        args = plan.ptr_args
        if plan.host_args:
            args = list(args)
            tensors = (page_indices, copy_index, scales, offsets, out)
            for i in plan.host_args:
                args[i] = tensors[i]
        g = plan.grid
        d.run(g[0], g[1], g[2], d.current_stream(d.device), d.function, d.packed_metadata, None, None, None, *args)
        return
    pages = _plane0(page_indices)
    n_seq, n_blocks, pools = plan.n_seq, pages.shape[2], pages.shape[0]
    tensors = (pages, copy_index, scales, offsets, out)

    def grid_fn(m: object) -> tuple[int, int, int]:
        return (cdiv(n_blocks, m["BLOCK"]), min(n_seq, _MAX_GRID_YZ), pools)  # type: ignore[index]

    _KERNEL.launch_fast(
        grid_fn,
        plan.key,
        plan.spec,
        (*tensors, n_seq, n_blocks, plan.row_capacity, *plan.ptr_args[8:]),
        FOLD=plan.fold,
    )
    if plan.direct is None:
        d = _KERNEL.direct(plan.spec)
        if d is not None:
            plan.grid = grid_fn(d.meta)
            plan.ptr_args = (*plan.ptr_args, *d.consts)
            plan.direct = d


def _host_path(
    pages: torch.Tensor, copy_index: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
) -> None:
    """CPU ``out`` on a machine whose kernels are compiled for a GPU: the kernel's arithmetic in torch ops."""
    rows = pages.index_select(1, copy_index.long())
    bad = rows < 0
    plane0 = torch.where(bad, 0, rows * scales.cpu().view(-1, 1, 1))
    n = copy_index.shape[0]
    out[:, :n, 0] = plane0
    out[:, :n, 1] = torch.where(bad, 0, plane0 + offsets.cpu().view(-1, 1, 1))


def copy_block_offsets_ref(
    page_indices: torch.Tensor,
    copy_index: torch.Tensor,
    index_scales: torch.Tensor | Sequence[int],
    kv_offset: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Plain torch, int64 arithmetic wrapped to int32: returns what ``out`` should hold afterwards (a copy)."""
    pages = page_indices[:, :, 0, :] if page_indices.dim() == 4 else page_indices
    dev = out.device
    rows = pages.to(dev, torch.int64)[:, copy_index.to(dev, torch.int64)]  # [pools, n_seq, blocks]
    scale = torch.as_tensor(index_scales).to(dev, torch.int64).view(-1, 1, 1)
    offset = torch.as_tensor(kv_offset).to(dev, torch.int64).view(-1, 1, 1)
    bad = rows < 0
    plane0 = torch.where(bad, 0, rows * scale)
    plane1 = torch.where(bad, 0, plane0 + offset)
    expected = out.clone()
    n = rows.shape[1]
    expected[:, :n, 0] = plane0.to(torch.int32)  # int64 -> int32 keeps the low 32 bits, as the kernel's wrap
    expected[:, :n, 1] = plane1.to(torch.int32)
    return expected


def selfcheck(device: torch.device) -> list[CheckRow]:
    g = torch.Generator().manual_seed(3)
    pools, rows, blocks, n_seq = 2, 19, 150, 7
    table = torch.randint(-1, 5000, (pools, rows, 2, blocks), generator=g, dtype=torch.int32)
    if device.type == "cuda":
        table = table.pin_memory()
    index = torch.randperm(rows, generator=g)[:n_seq].to(device)
    out = torch.full((pools, n_seq + 2, 2, blocks), -7, dtype=torch.int32, device=device)

    def run() -> tuple[float, bool]:
        expected = copy_block_offsets_ref(table, index, [2, 3], [0, 11], out)
        copy_block_offsets(table, index, [2, 3], [0, 11], out)
        diff = (out != expected).sum()
        return float(diff), bool(diff == 0)

    where = "pinned host" if device.type == "cuda" else "host"
    shapes = f"table[{pools},{rows},2,{blocks}] ({where}) -> out[{pools},{n_seq}+2,2,{blocks}]"
    return [timed_check("copy_block_offsets", device, shapes, run, unit="mismatched entries")]
