"""The device page-table seam: incremental host table updates and block offsets through the kernel."""

from __future__ import annotations

import pytest
import torch

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, LifeCycle, TierConfig
from kvforge.kvcache.page_table import DevicePageTable

TPB = 4


def _mgr() -> KVCacheManager:
    layers = (
        LayerSpec(0, bytes_per_token=2),
        LayerSpec(1, LifeCycle.sliding(window=6, sink_tokens=2), bytes_per_token=2),
        LayerSpec(2, LifeCycle.recurrent(), state_bytes=64),
    )
    return KVCacheManager(KVCacheConfig(TPB, layers, (TierConfig(pages=(40, 40, 8)),)))


def _expected_rows(table: DevicePageTable, caches) -> torch.Tensor:
    rows = torch.full((len(table.groups), len(caches), table.max_blocks), -1, dtype=torch.int32)
    for pos, g in enumerate(table.groups):
        for i, c in enumerate(caches):
            idx = c.page_indices(g)
            rows[pos, i, : len(idx)] = torch.tensor(idx, dtype=torch.int32)
    return rows


def test_host_table_tracks_pages_incrementally():
    mgr = _mgr()
    table = DevicePageTable(mgr, max_rows=4, max_blocks=8)
    assert table.groups == (0, 1)  # attention groups only
    a, b = mgr.create_cache(), mgr.create_cache()
    rows = [table.row(a), table.row(b)]
    assert rows == [0, 1] and table.row(a) == 0
    for t in range(22):
        for c in (a, b):
            if c is b and t >= 9:
                continue
            c.resize(t + 1, t + 1)
            c.commit([t])
        table.sync()
        expect = _expected_rows(table, [a, b])
        assert torch.equal(table.host[:, rows], expect), f"after step {t}"
    # Sliding-window pages released as stale show as -1 in the table.
    assert (table.host[1, 0, 1:3] == -1).all() and (table.host[0, 0, :6] >= 0).all()
    assert b.resize(capacity=9)  # shrink
    a.suspend()
    table.sync()
    assert torch.equal(table.host[:, rows], _expected_rows(table, [a, b]))
    assert (table.host[:, 0] == -1).all()
    b.close()  # the row is released and cleared
    assert (table.host[:, 1] == -1).all()
    assert table.row(mgr.create_cache()) == 1


def test_table_rejects_bad_arguments_and_overflow():
    mgr = _mgr()
    with pytest.raises(ValueError, match="groups"):
        DevicePageTable(mgr, 2, 4, groups=[2])  # the recurrent group has no per-block pages
    with pytest.raises(ValueError, match="index_scales"):
        DevicePageTable(mgr, 2, 4, index_scales=[1])
    with pytest.raises(ValueError, match="max_rows"):
        DevicePageTable(mgr, 0, 4)
    table = DevicePageTable(mgr, 1, 2)
    table.row(mgr.create_cache())
    with pytest.raises(ValueError, match="max_rows"):
        table.row(mgr.create_cache())
    cache = next(iter(table._rows))
    cache.resize(12, 12)
    with pytest.raises(ValueError, match="max_blocks"):
        table.sync()


def test_materialize_block_offsets_through_the_kernel():
    mgr = _mgr()
    table = DevicePageTable(mgr, max_rows=5, max_blocks=7, index_scales=[3, 2], kv_offsets=[1, 100])
    caches = [mgr.create_cache() for _ in range(3)]
    for i, c in enumerate(caches):
        n = 5 + 7 * i
        c.resize(n, n)
        c.commit(list(range(n)))
    order = [caches[2], caches[0]]  # any subset, any order
    out = table.materialize(order)
    assert out.shape == (2, 2, 2, 7) and out.dtype == torch.int32
    pages = _expected_rows(table, order).to(torch.int64)
    scale = torch.tensor([3, 2]).view(2, 1, 1)
    offset = torch.tensor([1, 100]).view(2, 1, 1)
    plane0 = torch.where(pages < 0, 0, pages * scale)
    plane1 = torch.where(pages < 0, 0, plane0 + offset)
    assert torch.equal(out[:, :, 0].cpu().to(torch.int64), plane0)
    assert torch.equal(out[:, :, 1].cpu().to(torch.int64), plane1)
    assert (pages >= 0).sum() > 10 and (pages < 0).sum() > 0  # both real pages and holes were exercised


def test_materialize_waits_for_the_last_launch_before_rewriting_the_index():
    """The pinned row index is read by the kernel after the host moves on: a second materialize with nothing
    dirty must still wait for the previous launch's event before it rewrites the index."""
    mgr = _mgr()
    table = DevicePageTable(mgr, max_rows=4, max_blocks=8)
    caches = [mgr.create_cache() for _ in range(2)]
    for c in caches:
        c.resize(5, 5)
        c.commit(list(range(5)))
    table.materialize(caches)
    log = []

    class PendingEvent:  # stands in for the CUDA event a GPU launch records
        def synchronize(self) -> None:
            log.append(list(table._index_np[:2]))

    table._event = PendingEvent()
    assert not table._dirty
    table.materialize(caches[::-1])
    assert log == [[0, 1]]  # waited once, before the index was rewritten to [1, 0]
    assert list(table._index_np[:2]) == [1, 0]
