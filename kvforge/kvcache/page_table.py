"""The device page table: the seam between the cache manager and the kernels.

:class:`DevicePageTable` keeps a host table ``host [pools, rows, blocks]`` int32 of GPU page indices (-1: no
page), one row per cache and one pool per pool group it covers (by default every attention group, in group-id
order). The table is pinned when CUDA is present (the kernel reads it in place) and a plain CPU tensor
otherwise (CPU torch has no pinned memory).

Rows are updated incrementally: the table is a listener of the manager
(:meth:`~kvforge.kvcache.manager.KVCacheManager.add_listener`), which tells it which (cache, group, first block)
changed, and :meth:`DevicePageTable.sync` rewrites only those ranges through a numpy view of the same memory
(a decode step touches a handful of entries, not the whole table). :meth:`DevicePageTable.materialize` then calls
``kvforge.kernels.block_offsets.copy_block_offsets`` for the given caches' rows, which writes
``out [pools, n_seq, 2, blocks]``: plane 0 = ``index_scales[p] * page``, plane 1 = plane 0 + ``kv_offsets[p]``
(0 in both for a missing page). On a machine without a GPU the same call runs in the Triton interpreter.

On a GPU the kernel reads the pinned table and index after the host has moved on, so the table records an
event after each launch and :meth:`sync` waits for it before writing again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvforge.kvcache.manager import KVCache, KVCacheManager

__all__ = ["DevicePageTable"]


def _int_list(name: str, v: Sequence[int] | None, n: int, default: int) -> tuple[int, ...]:
    if v is None:
        return (default,) * n
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(v).__name__}")
    out = tuple(v)
    if len(out) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in out):
        raise ValueError(f"{name}: expected {n} ints (one per pool), got {v!r}")
    return out


class DevicePageTable:
    """Host page-index table for up to ``max_rows`` caches of up to ``max_blocks`` blocks each.

    ``groups``: the pool groups it covers (pool ``p`` of the table is ``groups[p]``); default every attention
    group. ``index_scales`` / ``kv_offsets``: per pool, how a page index becomes a buffer offset (defaults 1
    and 0). ``pin_memory``: default ``torch.cuda.is_available()``.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        max_rows: int,
        max_blocks: int,
        *,
        groups: Sequence[int] | None = None,
        index_scales: Sequence[int] | None = None,
        kv_offsets: Sequence[int] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        import torch

        for name, v in (("max_rows", max_rows), ("max_blocks", max_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        attn = [g.group_id for g in manager.groups if g.life_cycle.is_attention]
        if groups is None:
            groups = attn
        groups = tuple(groups)
        if not groups:
            raise ValueError("groups: expected at least one attention pool group")
        for g in groups:
            if g not in attn:
                raise ValueError(f"groups: {g} is not an attention pool group of this manager (those are {attn})")
        self.manager = manager
        self.groups = groups
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        n = len(groups)
        self.index_scales = _int_list("index_scales", index_scales, n, 1)
        self.kv_offsets = _int_list("kv_offsets", kv_offsets, n, 0)
        pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.host = torch.full((n, max_rows, max_blocks), -1, dtype=torch.int32, pin_memory=pin)
        self._np = self.host.numpy()
        self._index = torch.zeros(max_rows, dtype=torch.int32, pin_memory=pin)
        self._index_np = self._index.numpy()
        self._pos = {g: i for i, g in enumerate(groups)}
        self._rows: dict[KVCache, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._dirty: dict[KVCache, list[int | None]] = {}
        self._written: dict[KVCache, list[int]] = {}
        self._event: Any = None
        manager.add_listener(self)

    # --- rows ----------------------------------------------------------------------------------------------

    def row(self, cache: KVCache) -> int:
        """The cache's row, assigned on first use (its whole content is written at the next sync)."""
        r = self._rows.get(cache)
        if r is not None:
            return r
        if cache.manager is not self.manager:
            raise ValueError("cache: belongs to another manager")
        if not self._free_rows:
            raise ValueError(f"max_rows: all {self.max_rows} rows are in use")
        r = self._free_rows.pop()
        self._rows[cache] = r
        self._written[cache] = [0] * len(self.groups)
        self._dirty[cache] = [0] * len(self.groups)
        return r

    def detach(self) -> None:
        """Stop following the manager (a table that is no longer used should not slow its updates down)."""
        self.manager.remove_listener(self)

    def release(self, cache: KVCache) -> None:
        """Give the cache's row back (done automatically when the cache closes)."""
        self.cache_closed(cache)

    def cache_closed(self, cache: KVCache) -> None:
        """Listener callback: the cache closed; its row is given back."""
        r = self._rows.pop(cache, None)
        if r is None:
            return
        self._wait()
        for pos, n in enumerate(self._written.pop(cache)):
            if n:
                self._np[pos, r, :n] = -1
        self._dirty.pop(cache, None)
        self._free_rows.append(r)

    def cache_changed(self, cache: KVCache, group: int | None, lo: int) -> None:
        """Listener callback: ``cache``'s pages of ``group`` (None: every group) changed from block ``lo`` on."""
        if cache not in self._rows:
            return
        d = self._dirty.get(cache)
        if d is None:
            d = self._dirty[cache] = [None] * len(self.groups)
        if group is None:
            for i, old in enumerate(d):
                d[i] = lo if old is None or lo < old else old
            return
        pos = self._pos.get(group)
        if pos is not None:
            old = d[pos]
            d[pos] = lo if old is None or lo < old else old

    # --- host and device -------------------------------------------------------------------------------------

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def sync(self) -> None:
        """Bring the host table up to date with every assigned cache's pages."""
        if not self._dirty:
            return
        self._wait()
        table = self._np
        for cache, d in self._dirty.items():
            r = self._rows[cache]
            written = self._written[cache]
            for pos, lo in enumerate(d):
                if lo is None:
                    continue
                n = cache.num_blocks
                if n > self.max_blocks:
                    raise ValueError(
                        f"max_blocks: cache {cache.id!r} holds {n} blocks, the table has {self.max_blocks}"
                    )
                if lo < n:
                    table[pos, r, lo:n] = cache.page_indices(self.groups[pos], lo)
                old = written[pos]
                if old > n:
                    table[pos, r, n:old] = -1
                written[pos] = n
        self._dirty.clear()

    def materialize(self, caches: Sequence[KVCache], out: torch.Tensor | None = None) -> torch.Tensor:
        """Block offsets of ``caches`` (in that order) on the kernel device: ``out [pools, >= n, 2, max_blocks]``."""
        import torch

        from kvforge.kernels._runtime import kernel_device
        from kvforge.kernels.block_offsets import copy_block_offsets

        known = self._rows
        rows = [known.get(c) for c in caches]
        if None in rows:  # a cache seen for the first time gets its row here
            rows = [self.row(c) for c in caches]
        self.sync()
        n = len(rows)
        if out is None:
            out = torch.empty((len(self.groups), n, 2, self.max_blocks), dtype=torch.int32, device=kernel_device())
        self._wait()  # the last launch may not have read the pinned index yet (sync() waits only when dirty)
        self._index_np[:n] = rows
        copy_block_offsets(self.host, self._index[:n], self.index_scales, self.kv_offsets, out)
        if out.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        return out
