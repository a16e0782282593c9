"""Gather KV blocks from per-layer page pools into one contiguous buffer (pack) and scatter them back (unpack).

This is the data path of a disaggregated KV transfer: the context side packs a request's blocks of every layer
into a send buffer, the generation side unpacks the received buffer into its own pages.

Inputs: ``pools`` (per layer ``[num_pages, tokens_per_block, elems_per_token]``, own dtype, last dim contiguous),
``page_indices`` (per layer, the pages to copy in block order) and optional ``col_ranges`` (per layer, the
``(start, stop)`` element range of each token row; the whole row by default). Buffer layout (no padding): for
each layer in order, its blocks in order, each ``[tokens_per_block, stop - start]`` of the layer's dtype;
``kv_pack_nbytes`` gives its size. The copy is a byte copy (NaN payloads and FP8 bit patterns travel unchanged).
``KVPackPlan`` does the host work (checks, page tables) once per transfer; ``pack`` / ``unpack`` launch.
Details: ``docs/kernels.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import byte_span, check_launch_device, check_tensor, has_internal_overlap, same_device
from kvforge.kernels._runtime import ConfigTable, TunedKernel

# Per-layer metadata row (int64): one row per layer, read by the kernel.
_M_POOL_OFF = 0  # words from the buffer's first word to the pool's element 0 (may be negative)
_M_PAGE_STRIDE = 1  # words between pages
_M_ROW_STRIDE = 2  # words between token rows of a page
_M_COL_OFF = 3  # first word copied within a row
_M_COLS = 4  # words copied per row
_M_ROWS = 5  # rows per block (1 when whole blocks are contiguous and copied as one row)
_M_BUF_OFF = 6  # words from the buffer's first word to the layer's segment
_M_PAGE_START = 7  # index of the layer's first page in the flat page table
_M_NBLOCKS = 8  # blocks of the layer
_NMETA = 9
_WORD_COLS = [_M_POOL_OFF, _M_PAGE_STRIDE, _M_ROW_STRIDE, _M_COL_OFF, _M_COLS, _M_BUF_OFF]  # bytes -> words

# Triton caps grid axes 1 and 2 at 65,535.
MAX_LAYERS = 65535


@triton.jit
def _kv_block_copy_kernel(
    base_ptr,
    meta_ptr,
    page_ptr,
    UNPACK: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
    NMETA: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    meta = meta_ptr + layer * NMETA
    pool_off = tl.load(meta + 0)
    page_stride = tl.load(meta + 1)
    row_stride = tl.load(meta + 2)
    col_off = tl.load(meta + 3)
    cols = tl.multiple_of(tl.load(meta + 4), ALIGN)
    rows = tl.load(meta + 5)
    buf_off = tl.load(meta + 6)
    page_start = tl.load(meta + 7)
    n_blocks = tl.load(meta + 8)
    valid = j < n_blocks
    # Layers with fewer blocks than the grid's first axis leave their extra programs idle (zero rows).
    page = tl.load(page_ptr + page_start + j, mask=valid, other=0).to(tl.int64)
    rows = tl.where(valid, rows, 0)
    pool_block = pool_off + page * page_stride + col_off
    buf_block = buf_off + j * rows * cols
    offs = tl.arange(0, BLOCK)
    # The trip counts come from memory, so the loops are `while` loops: Triton 3.6's interpreter cannot use a loaded
    # value (a shape-(1,) array) as a `range` bound under NumPy >= 2.4. Compiled, they lower to the same loops; the
    # hint on `c` restores the divisibility a `range(0, cols, BLOCK)` induction variable would carry.
    r = tl.zeros_like(rows)
    while r < rows:
        src = tl.multiple_of(pool_block + r * row_stride, ALIGN)
        dst = tl.multiple_of(buf_block + r * cols, ALIGN)
        c = tl.zeros_like(cols)
        while c < cols:
            c = tl.multiple_of(c, BLOCK)
            idx = c + offs
            m = idx < cols
            if UNPACK:
                x = tl.load(base_ptr + dst + idx, mask=m)
                tl.store(base_ptr + src + idx, x, mask=m)
            else:
                x = tl.load(base_ptr + src + idx, mask=m)
                tl.store(base_ptr + dst + idx, x, mask=m)
            c += BLOCK
        r += 1


def _cfg(block: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK": block}, num_warps=warps, num_stages=1)


_CONFIGS = ConfigTable(
    fallback=[_cfg(2048, 4), _cfg(4096, 8), _cfg(1024, 4)],
    interpreter=_cfg(1024, 1),
    by_arch={9: [_cfg(2048, 4), _cfg(4096, 4), _cfg(4096, 8), _cfg(8192, 8), _cfg(1024, 4)]},
)
_COPY = TunedKernel("kv_block_copy", _kv_block_copy_kernel, _CONFIGS)

_WORD_DTYPE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _as_index_list(name: str, idx: object, num_pages: int, *, unique: bool) -> list[int]:
    # The common case, a list of plain ints, checked without building a new list.
    if type(idx) is list and all(type(v) is int for v in idx):
        if idx and not (min(idx) >= 0 and max(idx) < num_pages):
            bad = [v for v in idx if not 0 <= v < num_pages]
            raise ValueError(f"{name}: page indices must lie in [0, {num_pages}), got {bad[:4]}")
        if unique and len(set(idx)) != len(idx):
            dup = sorted({v for v in idx if idx.count(v) > 1})[:4]
            raise ValueError(f"{name}: a destination page appears more than once ({dup}); unpack would race")
        return idx
    if isinstance(idx, torch.Tensor):
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise TypeError(
                f"{name}: expected a 1-D integer tensor or a list of ints, got {idx.dtype} {tuple(idx.shape)}"
            )
        if idx.device.type != "cpu":  # the plan is built on the host: a device tensor would be a silent sync
            raise TypeError(
                f"{name}: page indices are host data (the plan is built on the host); pass a list or a CPU tensor, "
                f"not a tensor on {idx.device} (reading it back would wait for the device)"
            )
        values = [int(v) for v in idx.tolist()]
    elif isinstance(idx, Sequence) and not isinstance(idx, (str, bytes)):
        values = []
        for v in idx:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected ints, got {type(v).__name__}")
            values.append(int(v))
    else:
        raise TypeError(f"{name}: expected a 1-D integer tensor or a list of ints, got {type(idx).__name__}")
    bad = [v for v in values if not 0 <= v < num_pages]
    if bad:
        raise ValueError(f"{name}: page indices must lie in [0, {num_pages}), got {bad[:4]}")
    if unique and len(set(values)) != len(values):
        dup = sorted({v for v in values if values.count(v) > 1})[:4]
        raise ValueError(f"{name}: a destination page appears more than once ({dup}); unpack would race")
    return values


@dataclass(frozen=True)
class _Layer:
    """One layer of a layout with its byte quantities, read once from the pool (the plan path is pure integers)."""

    pool: torch.Tensor
    col_start: int
    col_stop: int
    table: int  # which page list the layer reads (layers of one group share one)
    ptr: int
    page_stride: int
    row_stride: int
    col_off: int
    row_bytes: int  # bytes copied per row
    rows: int  # rows per block


def _layout_layer(i: int, pool: object, cr: object, table: int, device: torch.device | None) -> _Layer:
    check_tensor(f"pools[{i}]", pool, ndim=3)
    assert isinstance(pool, torch.Tensor)
    if pool.is_complex() or pool.dtype == torch.bool:
        raise TypeError(f"pools[{i}]: expected a real KV dtype, got {pool.dtype}")
    if device is not None and not same_device(pool.device, device):
        raise ValueError(f"pools[{i}]: expected every pool on {device}, got one on {pool.device}")
    if pool.shape[2] > 1 and pool.stride(2) != 1:
        raise ValueError(f"pools[{i}]: expected the last dimension contiguous (stride 1), got {pool.stride()}")
    if pool.stride(0) < 0 or pool.stride(1) < 0:
        raise ValueError(f"pools[{i}]: negative strides are not supported ({pool.stride()})")
    check_launch_device(f"pools[{i}]", pool)
    tpb, elems, es = pool.shape[1], pool.shape[2], pool.element_size()
    if cr is None:
        start, stop = 0, elems
    else:
        # Ints only: int(1.9) would silently copy other columns than the caller meant.
        if isinstance(cr, (str, bytes, torch.Tensor)) or not isinstance(cr, Sequence) or len(cr) != 2:
            raise TypeError(f"col_ranges[{i}]: expected a (start, stop) pair of ints or None, got {cr!r:.60}")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in cr):
            raise TypeError(f"col_ranges[{i}]: expected ints, got ({type(cr[0]).__name__}, {type(cr[1]).__name__})")
        start, stop = cr
    if not 0 <= start < stop <= elems:
        raise ValueError(f"col_ranges[{i}]: expected 0 <= start < stop <= {elems}, got ({start}, {stop})")
    row_bytes, rows, row_stride = (stop - start) * es, tpb, pool.stride(1) * es
    # Whole rows stored back to back: one row per block lets the kernel stream the block in one loop.
    if start == 0 and stop == elems and (tpb == 1 or pool.stride(1) == elems):
        row_bytes, rows, row_stride = row_bytes * tpb, 1, row_bytes * tpb
    return _Layer(
        pool, start, stop, table, pool.data_ptr(), pool.stride(0) * es, row_stride, start * es, row_bytes, rows
    )


class KVPackLayout:
    """The static half of a transfer: the pools, their column ranges and which page list each layer reads.

    Checked and reduced to integers once (a transceiver keeps one per peer and piece), so that planning a
    request's transfer (``plan``) touches only its page lists: the per-layer work of a 61-layer model was most
    of the host time of a transfer when it was redone per request.

    ``tables``: per layer, the index of the page list it reads in ``plan(pages)``; by default every layer reads
    its own (``tables = range(len(pools))``). The layout keeps references to the pools; their storage must not
    move while it is used.
    """

    def __init__(
        self,
        pools: Sequence[torch.Tensor],
        col_ranges: Sequence[tuple[int, int] | None] | None = None,
        tables: Sequence[int] | None = None,
    ) -> None:
        if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence):
            raise TypeError(f"pools: expected a sequence of tensors, got {type(pools).__name__}")
        if col_ranges is not None and len(col_ranges) != len(pools):
            raise ValueError(f"col_ranges: expected {len(pools)} entries (one per pool), got {len(col_ranges)}")
        if len(pools) > MAX_LAYERS:
            raise ValueError(f"pools: at most {MAX_LAYERS} layers per launch, got {len(pools)}")
        if tables is None:
            tables = range(len(pools))
        elif len(tables) != len(pools):
            raise ValueError(f"tables: expected {len(pools)} entries (one per pool), got {len(tables)}")
        elif any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tables):
            raise ValueError(f"tables: expected non-negative ints, got {list(tables)[:8]}")
        self.device = pools[0].device if len(pools) and isinstance(pools[0], torch.Tensor) else torch.device("cpu")
        self.layers = [
            _layout_layer(i, pool, None if col_ranges is None else col_ranges[i], int(t), self.device)
            for i, (pool, t) in enumerate(zip(pools, tables))
        ]
        self.num_tables = max((ly.table + 1 for ly in self.layers), default=0)
        # Every address, stride and length the kernel forms is a sum of multiples of these (segment offsets are
        # sums of whole blocks, multiples of a row): their gcd with the buffer's address, per launch, sets the
        # word width and the alignment the compiler may assume.
        # Per layer, as arrays, so that a plan's rows are a few vector operations rather than a loop over layers.
        cols = [[ly.ptr, ly.page_stride, ly.row_stride, ly.col_off, ly.row_bytes, ly.rows] for ly in self.layers]
        self._static = np.array(cols, dtype=np.int64).reshape(-1, 6)
        self._gcd = int(np.gcd.reduce(self._static[:, :5], axis=None)) if self.layers else 0
        self._block_bytes = self._static[:, 4] * self._static[:, 5]
        self._table = np.array([ly.table for ly in self.layers], dtype=np.int64)
        # A table's bound is the smallest pool reading it (pools of one table normally have the same pages).
        bounds: list[int | None] = [None] * self.num_tables
        for ly in self.layers:
            n = ly.pool.shape[0]
            bounds[ly.table] = n if bounds[ly.table] is None else min(n, bounds[ly.table])  # type: ignore[type-var]
        self._bounds = bounds
        # Aliasing, for unpack (pack only reads the pools): a layer whose written region has self-overlapping
        # elements (a stride-0 page axis, say) is refused outright; layers whose pools' byte ranges intersect are
        # checked page by page when a plan is built (two views of one allocation, interleaved or not).
        self._self_overlap = [
            i for i, ly in enumerate(self.layers) if has_internal_overlap(ly.pool[:, :, ly.col_start : ly.col_stop])
        ]
        spans = [byte_span(ly.pool) or (0, 0) for ly in self.layers]
        self._span_lo = np.array([a for a, _ in spans], dtype=np.int64)
        self._span_hi = np.array([b for _, b in spans], dtype=np.int64)
        order = np.argsort(self._span_lo, kind="stable")
        shared: set[int] = set()
        reach, owner = -1, -1
        for i in order.tolist():
            if self._span_hi[i] == self._span_lo[i]:
                continue
            if self._span_lo[i] < reach:
                shared.update((i, owner))
            if self._span_hi[i] > reach:
                reach, owner = int(self._span_hi[i]), i
        self._shared = sorted(shared)

    def check_buffer_disjoint(self, name: str, buf: torch.Tensor) -> None:
        """Refuse a pack/unpack buffer that shares memory with any pool (the copy would read its own writes)."""
        span = byte_span(buf)
        if span is None or not self.layers or not same_device(buf.device, self.device):
            return
        hit = np.nonzero((self._span_lo < span[1]) & (self._span_hi > span[0]))[0]
        if hit.size:
            raise ValueError(f"{name}: overlaps pools[{int(hit[0])}] in memory; expected a separate buffer")

    def plan(self, pages: Sequence[object], *, unpack: bool = False) -> KVPackPlan:
        """The plan of one transfer: ``pages[t]`` lists, in block order, the pages of every layer reading table t."""
        if isinstance(pages, torch.Tensor) or not isinstance(pages, Sequence):
            raise TypeError(f"pages: expected a sequence (one page list per table), got {type(pages).__name__}")
        if len(pages) != self.num_tables:
            raise ValueError(f"pages: expected {self.num_tables} page lists (one per table), got {len(pages)}")
        return KVPackPlan._from_layout(self, [f"pages[{t}]" for t in range(self.num_tables)], pages, unpack)


def kv_pack_nbytes(
    pools: Sequence[torch.Tensor],
    page_indices: Sequence[object],
    col_ranges: Sequence[tuple[int, int] | None] | None = None,
) -> int:
    """Size in bytes of the packed buffer for these pools, pages and column ranges."""
    return KVPackPlan(pools, page_indices, col_ranges).nbytes


class KVPackPlan:
    """Host metadata of one transfer (checks, page table, per-layer rows), built once; ``pack``/``unpack`` launch.

    ``KVPackPlan(pools, page_indices, ...)`` plans from scratch (layers given the same list object share one page
    table, checked once); ``KVPackLayout.plan`` reuses a layout's checked layers. ``unpack=True`` plans a scatter
    and therefore rejects a destination page listed twice in one layer. The plan keeps references to the pools;
    their storage must not move while the plan is used.
    """

    def __init__(
        self,
        pools: Sequence[torch.Tensor],
        page_indices: Sequence[object],
        col_ranges: Sequence[tuple[int, int] | None] | None = None,
        *,
        unpack: bool = False,
    ) -> None:
        if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence):
            raise TypeError(f"pools: expected a sequence of tensors, got {type(pools).__name__}")
        if isinstance(page_indices, torch.Tensor) or not isinstance(page_indices, Sequence):
            raise TypeError(
                f"page_indices: expected a sequence (one entry per layer), got {type(page_indices).__name__}"
            )
        if len(page_indices) != len(pools):
            raise ValueError(f"page_indices: expected {len(pools)} entries (one per pool), got {len(page_indices)}")
        # One table per distinct list object (alive for the whole call, so ids are not reused) and pool size.
        seen: dict[tuple[int, int], int] = {}
        tables, lists, names = [], [], []
        for i, (pool, idx) in enumerate(zip(pools, page_indices)):
            key = (id(idx), pool.shape[0] if isinstance(pool, torch.Tensor) and pool.dim() == 3 else -1)
            if key not in seen:
                seen[key] = len(lists)
                lists.append(idx)
                names.append(f"page_indices[{i}]")
            tables.append(seen[key])
        self._init(KVPackLayout(pools, col_ranges, tables), names, lists, unpack)

    @classmethod
    def _from_layout(cls, layout: KVPackLayout, names: list[str], pages: Sequence[object], unpack: bool) -> KVPackPlan:
        plan = cls.__new__(cls)
        plan._init(layout, names, pages, unpack)
        return plan

    def _init(self, layout: KVPackLayout, names: list[str], pages: Sequence[object], unpack: bool) -> None:
        self.layout = layout
        self.layers = layout.layers
        self.for_unpack = unpack
        self.device = layout.device
        tables = [
            [] if bound is None else _as_index_list(names[t], pages[t], bound, unique=unpack)
            for t, bound in enumerate(layout._bounds)
        ]
        counts = np.array([len(t) for t in tables], dtype=np.int64)
        n_blocks = counts[layout._table]
        sizes = n_blocks * layout._block_bytes
        offsets = np.cumsum(sizes) - sizes
        self.nbytes = int(sizes.sum())
        self._sizes, self._offsets = sizes, offsets
        self._max_blocks = int(n_blocks.max()) if len(n_blocks) else 0
        starts = (np.cumsum(counts) - counts)[layout._table]
        # The kernel's rows in bytes (pool address absolute); ``_device_tables`` rebases and converts to words.
        self._rows = np.concatenate(
            [layout._static, offsets[:, None], starts[:, None], n_blocks[:, None]], axis=1
        ).reshape(-1, _NMETA)
        self._flat_pages = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(counts.sum()))
        if unpack:
            self._check_disjoint_writes(layout, tables)
        self._meta: torch.Tensor | None = None
        self._pages: torch.Tensor | None = None
        self._meta_key: tuple[int, int] | None = None

    def _check_disjoint_writes(self, layout: KVPackLayout, tables: list[list[int]]) -> None:
        """Unpack writes: no layer writes one byte twice, and no two layers write the same byte."""
        if layout._self_overlap:
            i = layout._self_overlap[0]
            pool = layout.layers[i].pool
            raise ValueError(
                f"pools[{i}]: expected pages whose elements do not share memory, got shape {list(pool.shape)} with "
                f"strides {pool.stride()} (a stride-0 or overlapping view); unpack would write one place twice"
            )
        if not layout._shared:
            return
        starts, ends, who = [], [], []
        for i in layout._shared:
            ly = layout.layers[i]
            pages = np.asarray(tables[ly.table], dtype=np.int64)
            rows = np.arange(ly.rows, dtype=np.int64)
            s = (ly.ptr + ly.col_off + pages[:, None] * ly.page_stride + rows[None, :] * ly.row_stride).reshape(-1)
            starts.append(s)
            ends.append(s + ly.row_bytes)
            who.append(np.full(s.size, i, dtype=np.int64))
        st, en, wh = np.concatenate(starts), np.concatenate(ends), np.concatenate(who)
        order = np.argsort(st, kind="stable")
        st, en, wh = st[order], en[order], wh[order]
        reach = np.maximum.accumulate(en)
        bad = np.nonzero(st[1:] < reach[:-1])[0]
        if bad.size:
            j = int(bad[0]) + 1
            other = int(wh[int(np.argmax(reach[:j] > st[j]))])
            raise ValueError(
                f"pools[{other}] and pools[{int(wh[j])}]: these layers' pages share memory; unpack would write the "
                "same bytes twice (two views of one allocation listing the same page?)"
            )

    @property
    def segments(self) -> list[tuple[int, int]]:
        """(byte offset, byte length) of each layer's segment in the buffer."""
        return list(zip(self._offsets.tolist(), self._sizes.tolist()))

    def _word_bytes(self, buf_ptr: int) -> tuple[int, int]:
        """(word bytes, alignment in words): the widest word dividing every byte quantity, and 16-byte hints."""
        g = math.gcd(self.layout._gcd, buf_ptr, 16)
        word = 4 if g % 4 == 0 else (2 if g % 2 == 0 else 1)
        return word, max(1, g // word)

    def _device_tables(
        self, base: int, word: int, header: Sequence[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(header, metadata, page table) on the device, from one upload: ``[header | rows | pages]`` int64.

        One upload per transfer, written in place into pinned memory: the sender's host time per request is what
        limits a batch of transfers (NCCL moves a request's blocks faster than the host posted them when each
        table was built from Python lists and uploaded on its own). Without a header the tables are kept for the
        next launch on the same buffer.
        """
        key = (base, word)
        if not header and self._meta is not None and self._pages is not None and self._meta_key == key:
            return None, self._meta, self._pages
        h, n, p = len(header), self._rows.size, max(1, self._flat_pages.size)
        cuda = self.device.type == "cuda"
        host = torch.empty(h + n + p, dtype=torch.int64, pin_memory=cuda)
        a = host.numpy()
        a[:h] = header
        rows = a[h : h + n].reshape(-1, _NMETA)
        rows[:] = self._rows
        rows[:, 0] -= base
        rows[:, _WORD_COLS] //= word
        a[h + n :] = 0
        a[h + n : h + n + self._flat_pages.size] = self._flat_pages
        dev = host.to(self.device, non_blocking=True) if cuda else host
        self._meta, self._pages, self._meta_key = dev[h : h + n], dev[h + n :], key
        return (dev[:h] if h else None), self._meta, self._pages

    def _check_buffer(self, name: str, buf: object, nbytes: int) -> torch.Tensor:
        check_tensor(name, buf, dtype=torch.uint8, ndim=1, contiguous=True, device=self.device)
        assert isinstance(buf, torch.Tensor)
        check_launch_device(name, buf)
        self.layout.check_buffer_disjoint(name, buf)
        if buf.numel() < nbytes:
            raise ValueError(f"{name}: expected at least {nbytes} bytes, got {buf.numel()}")
        return buf

    def _launch(self, data: torch.Tensor, unpack: bool, header: Sequence[int] = (), head_out=None) -> None:
        if self.nbytes == 0 and not header:
            return
        word, align = self._word_bytes(data.data_ptr())
        head, meta, pages = self._device_tables(data.data_ptr(), word, header)
        if head is not None:
            head_out.copy_(head.view(torch.uint8))
        if self.nbytes == 0:
            return
        # Only the first word of the typed view matters: pools are reached through offsets from it.
        base = data[: (data.numel() // word) * word].view(_WORD_DTYPE[word])
        n_layers = len(self.layers)
        # The compiled kernel depends on the word, the alignment hint, the direction and each pointer's 16-byte
        # alignment (the tables are slices of one upload): with those in the spec, repeat launches skip
        # Triton's argument binding, a sizeable part of a transfer's host time per request.
        ptrs = (base.data_ptr() % 16 == 0, meta.data_ptr() % 16 == 0, pages.data_ptr() % 16 == 0)
        _COPY.launch_fast(
            lambda _: (self._max_blocks, n_layers),
            (word, align, unpack),
            (word, align, unpack, ptrs, self.device),
            (base, meta, pages),
            UNPACK=unpack,
            ALIGN=align,
            NMETA=_NMETA,
        )

    def pack(self, out: torch.Tensor | None = None, *, header: Sequence[int] = ()) -> torch.Tensor:
        """Gather into ``out`` (uint8; allocated when None) and return the packed bytes.

        ``header``: int64 values written in front of the packed bytes (a message frame), which then start at
        byte ``8 * len(header)`` of ``out``; ``out`` needs room for both.
        """
        if isinstance(header, (str, bytes, torch.Tensor)) or not isinstance(header, Sequence):
            raise TypeError(f"header: expected a sequence of ints, got {type(header).__name__}")
        if any(isinstance(v, bool) or not isinstance(v, int) or not -(2**63) <= v < 2**63 for v in header):
            raise ValueError(f"header: expected int64 values, got {list(header)[:8]}")
        hb = 8 * len(header)
        if out is None:
            out = torch.empty(hb + self.nbytes, dtype=torch.uint8, device=self.device)
        else:
            out = self._check_buffer("out", out, hb + self.nbytes)
        data = out[hb:]
        self._launch(data, False, header, out[:hb])
        return data[: self.nbytes]

    def unpack(self, buf: torch.Tensor) -> None:
        """Scatter ``buf`` (laid out as ``pack`` writes it) into the pools' pages."""
        if not self.for_unpack:
            raise ValueError("plan: built for pack; build it with unpack=True (checks destination pages are unique)")
        buf = self._check_buffer("buf", buf, self.nbytes)
        self._launch(buf, unpack=True)


def pack_kv_blocks(
    pools: Sequence[torch.Tensor],
    page_indices: Sequence[object],
    *,
    col_ranges: Sequence[tuple[int, int] | None] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the listed pages of every pool into one uint8 buffer (layout in the module docstring)."""
    return KVPackPlan(pools, page_indices, col_ranges).pack(out)


def unpack_kv_blocks(
    buf: torch.Tensor,
    pools: Sequence[torch.Tensor],
    page_indices: Sequence[object],
    *,
    col_ranges: Sequence[tuple[int, int] | None] | None = None,
) -> None:
    """Scatter a packed buffer into the listed pages of every pool (in place)."""
    KVPackPlan(pools, page_indices, col_ranges, unpack=True).unpack(buf)


def pack_kv_blocks_ref(
    pools: Sequence[torch.Tensor],
    page_indices: Sequence[object],
    *,
    col_ranges: Sequence[tuple[int, int] | None] | None = None,
) -> torch.Tensor:
    """Plain-torch reference of ``pack_kv_blocks``: index, slice, reinterpret as bytes, concatenate."""
    parts = []
    for i, pool in enumerate(pools):
        idx = torch.as_tensor(page_indices[i], dtype=torch.int64, device=pool.device).reshape(-1)
        start, stop = (0, pool.shape[2]) if col_ranges is None or col_ranges[i] is None else col_ranges[i]
        blocks = pool.index_select(0, idx)[:, :, start:stop].contiguous()
        parts.append(blocks.view(torch.uint8).reshape(-1))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def unpack_kv_blocks_ref(
    buf: torch.Tensor,
    pools: Sequence[torch.Tensor],
    page_indices: Sequence[object],
    *,
    col_ranges: Sequence[tuple[int, int] | None] | None = None,
) -> None:
    """Plain-torch reference of ``unpack_kv_blocks`` (in place)."""
    off = 0
    for i, pool in enumerate(pools):
        idx = torch.as_tensor(page_indices[i], dtype=torch.int64, device=pool.device).reshape(-1)
        start, stop = (0, pool.shape[2]) if col_ranges is None or col_ranges[i] is None else col_ranges[i]
        shape = (idx.numel(), pool.shape[1], stop - start)
        n = math.prod(shape) * pool.element_size()
        chunk = buf[off : off + n].clone().view(pool.dtype).reshape(shape)
        for k in range(idx.numel()):
            pool[int(idx[k]), :, start:stop] = chunk[k]
        off += n


def selfcheck(device: torch.device) -> list:
    """Pack and unpack against the references: bf16 target layers, an FP8 draft layer, head slices."""
    from kvforge.kernels._selfcheck import timed_check

    def build(gen: torch.Generator, pages: int, tpb: int, elems: int, n_bf16: int):
        pools = [
            torch.randint(0, 256, (pages, tpb, elems * 2), generator=gen, dtype=torch.uint8)
            .view(torch.bfloat16)
            .to(device)
            for _ in range(n_bf16)
        ]
        pools.append(
            torch.randint(0, 256, (pages, tpb, elems), generator=gen, dtype=torch.uint8)
            .to(device)
            .view(torch.float8_e4m3fn)
        )
        return pools

    def case(pages: int, tpb: int, elems: int, n_bf16: int, n_blocks: int, heads: bool):
        def run() -> tuple[float, bool]:
            gen = torch.Generator().manual_seed(1234 + pages)
            src = build(gen, pages, tpb, elems, n_bf16)
            dst = build(gen, pages, tpb, elems, n_bf16)
            idx = [torch.randperm(pages, generator=gen)[:n_blocks].tolist() for _ in src]
            cr = [(elems // 4, elems // 2) for _ in src] if heads else None
            buf = pack_kv_blocks(src, idx, col_ranges=cr)
            ok = torch.equal(buf.cpu(), pack_kv_blocks_ref(src, idx, col_ranges=cr).cpu())
            expect = [p.clone() for p in dst]
            unpack_kv_blocks_ref(buf, expect, idx, col_ranges=cr)
            unpack_kv_blocks(buf, dst, idx, col_ranges=cr)
            ok = ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst, expect))
            return (0.0 if ok else 1.0), ok

        shapes = f"L={n_bf16}+1 pages={pages} tpb={tpb} elems={elems} blocks={n_blocks}" + (" heads" if heads else "")
        return timed_check("kv_pack", device, shapes, run, note="byte-exact pack+unpack", unit="failed comparisons")

    small = device.type != "cuda"
    if small:
        return [case(13, 4, 40, 3, 7, False), case(9, 3, 24, 2, 5, True)]
    return [case(600, 64, 576, 8, 512, False), case(200, 32, 256, 4, 150, True)]
