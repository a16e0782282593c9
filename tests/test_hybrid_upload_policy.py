"""The state-index upload paths, the cost-aware snapshot policy and the policy bench's replay, on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvforge.kvcache import KVCacheConfig, LayerSpec, LifeCycle, TierConfig
from kvforge.kvcache.hashing import default_hasher
from kvforge.kvcache.hybrid import HybridCacheManager, StateIndexUpload, UploadPath
from kvforge.kvcache.snapshot_policy import KIMI_K3_LIKE, CostAwareSnapshotPolicy, ModelCostSpec, cost_aware_eviction
from kvforge.sim.workload import SimRequest


def _key(parent: int, block) -> int:
    """The block key of one full block under ``parent`` (the managers' default hasher)."""
    return default_hasher().block_keys(list(block), len(block), parent=parent)[0]


TPB = 4
FULL = LayerSpec(0, bytes_per_token=2)
REC = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)


def make(pages=(64, 4), **kw) -> HybridCacheManager:
    return HybridCacheManager(KVCacheConfig(TPB, (FULL, REC), (TierConfig(pages=pages),)), **kw)


def seq(start: int, n: int) -> list[int]:
    return [(start * 7919 + i * 31) % 1009 for i in range(n)]


# --- state-index upload -------------------------------------------------------------------------------------------


class SpyPairCopy:
    """Stands in for copy_small_pinned_pair where CPU torch has no pinned memory: records and performs the copy."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, host_a, host_b, dev_a, dev_b) -> bool:
        self.calls += 1
        dev_a.copy_(host_a)
        dev_b.copy_(host_b)
        return True


def test_upload_through_the_pair_kernel_only_when_something_changed():
    mgr = make()
    caches = [mgr.create_cache(seq(i, 5)) for i in range(2)]
    spy = SpyPairCopy()
    up = StateIndexUpload(8, use_kernel=True, device="cpu", pair_copy=spy)
    idx, mask = mgr.step_state_indices(caches, num_dummy=1, pad_index=7)
    assert idx == [caches[0].live_page(1).index, caches[1].live_page(1).index, 7] and mask == [False, False, True]
    up.dev_indices.fill_(-5)
    assert up.upload(idx, mask) is UploadPath.KERNEL and spy.calls == 1
    assert up.dev_indices[:3].tolist() == idx and up.dev_mask[:3].tolist() == mask
    assert up.upload(idx, mask) is UploadPath.NONE and spy.calls == 1  # nothing changed: nothing written
    mask2 = [False, True, True]
    assert up.upload(idx, mask2) is UploadPath.KERNEL and spy.calls == 2  # one changed: both go in one launch
    assert up.dev_mask[:3].tolist() == mask2


def test_upload_by_copies_when_the_kernel_is_off_or_declines():
    mgr = make()
    caches = [mgr.create_cache(seq(i, 5)) for i in range(3)]
    idx, mask = mgr.step_state_indices(caches)
    spy = SpyPairCopy()
    off = StateIndexUpload(4, use_kernel=False, device="cpu", pair_copy=spy)
    assert off.upload(idx, mask) is UploadPath.COPIES and spy.calls == 0
    assert off.dev_indices[:3].tolist() == idx
    assert off.upload(idx, mask) is UploadPath.NONE
    # The real kernel wrapper declines on a CPU-only machine (no pinned memory): the copies run instead.
    on = StateIndexUpload(4, use_kernel=True, device="cpu")
    assert on.upload(idx, mask) is UploadPath.COPIES
    assert on.dev_indices[:3].tolist() == idx and on.dev_mask[:3].tolist() == [False] * 3
    idx2 = idx[::-1]
    on.dev_mask.fill_(True)  # only the changed buffer is copied: the mask, unchanged, is not rewritten
    assert on.upload(idx2, mask) is UploadPath.COPIES
    assert on.dev_indices[:3].tolist() == idx2 and on.dev_mask[:3].tolist() == [True] * 3


def test_manager_upload_follows_the_policy_and_rejects_bad_rows():
    from kvforge.kvcache import HybridCachePolicy

    mgr = make(policy=HybridCachePolicy(state_index_upload_kernel=True))
    up = mgr.state_index_upload(2, device="cpu")
    assert up.use_kernel and up.dev_indices.dtype == torch.int32
    with pytest.raises(ValueError, match="max_requests"):
        up.upload([1, 2, 3], [False] * 3)
    with pytest.raises(ValueError, match="dummy_mask"):
        up.upload([1], [])
    c = mgr.create_cache(seq(1, 3))
    c.suspend()
    with pytest.raises(Exception, match="suspended"):
        mgr.step_state_indices([c])


# --- cost-aware policy --------------------------------------------------------------------------------------------


def test_model_cost_spec_default_layout():
    m = KIMI_K3_LIKE
    assert m.num_layers == 61 and len(m.attention_layers) == 16 and len(m.recurrent_layers) == 45
    assert m.kv_bytes_per_token == 16 * 576 * 2
    assert m.snapshot_bytes == 45 * (64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2)
    # Superlinear in the prefix: the attention term.
    assert m.prefill_flops(2000) > 2 * m.prefill_flops(1000) > 0
    cfg = KVCacheConfig(512, m.layer_specs())
    assert sorted(g.bytes_per_page for g in cfg.groups) == [m.kv_bytes_per_token * 512, m.snapshot_bytes]
    with pytest.raises(ValueError, match="recurrent"):
        ModelCostSpec(**{**m.__dict__, "attention_layers": tuple(range(61))})


def snapshot_ends(mgr, tokens):
    node, out = mgr.tree.root(None), []
    for i in range(len(tokens) // TPB):
        node = node.children.get(_key(node.key, tokens[i * TPB : (i + 1) * TPB]))
        if node is None:
            break
        if node.pages[1] is not None:
            out.append((i + 1) * TPB)
    return out


def serve(mgr, p):
    c = mgr.create_cache(p)
    assert c.resize(len(p), len(p))
    c.commit(p)
    c.close()


def test_cost_aware_keeps_the_long_prefix_snapshot_that_lru_evicts():
    long_, short, newest = seq(1, 40), seq(2, 8), seq(3, 8)
    kept = {}
    for name, factory in (("lru", None), ("cost", cost_aware_eviction(KIMI_K3_LIKE, TPB))):
        mgr = make(pages=(64, 3), eviction_policy=factory)
        serve(mgr, long_)
        serve(mgr, short)
        serve(mgr, newest)  # the third snapshot needs a page: one of the first two goes
        mgr.check_invariants()
        kept[name] = (snapshot_ends(mgr, long_), snapshot_ends(mgr, short))
    assert kept["lru"] == ([], [8])
    assert kept["cost"] == ([40], [])


def test_greedy_dual_aging_lets_fresh_cheap_pages_outlive_an_idle_expensive_one():
    mgr = make(pages=(256, 3), eviction_policy=cost_aware_eviction(KIMI_K3_LIKE, TPB, frequency=False))
    pol = mgr.pool(1).policy
    assert isinstance(pol, CostAwareSnapshotPolicy)
    serve(mgr, seq(100, 16))  # worth about 2x a 8-token prefix
    for i in range(6):
        serve(mgr, seq(200 + i, 8))
        mgr.check_invariants()
    assert pol.clock > 0
    # Each eviction raised the clock by a cheap page's value: the idle 16-token snapshot has been evicted.
    assert snapshot_ends(mgr, seq(100, 16)) == []


def test_cost_exponent_zero_is_lru_order():
    mgr = make(pages=(64, 3), eviction_policy=cost_aware_eviction(KIMI_K3_LIKE, TPB, cost_exponent=0, frequency=False))
    long_, short = seq(1, 40), seq(2, 8)
    serve(mgr, long_)
    serve(mgr, short)
    serve(mgr, seq(3, 8))
    assert snapshot_ends(mgr, long_) == [] and snapshot_ends(mgr, short) == [8]
    with pytest.raises(ValueError, match="cost_exponent"):
        cost_aware_eviction(KIMI_K3_LIKE, TPB, cost_exponent=-1)


# --- the bench's replay -------------------------------------------------------------------------------------------


def test_policy_replay_runs_on_a_tiny_synthetic_workload():
    from bench.bench_snapshot_policy import replay

    # Three conversations of growing turns over 512-token blocks: turn k repeats turn k-1's blocks and adds two.
    reqs = []
    for turn in range(4):
        for conv in range(3):
            keys = tuple(default_hasher().keys_from_ids([conv * 100 + b for b in range(2 * turn + 2)]))
            reqs.append(SimRequest(len(reqs), float(len(reqs)), len(keys) * 512 + 100, 10, keys))
    out = {p: replay(reqs, KIMI_K3_LIKE, 40.0, 0.5, p) for p in ("lru", "cost")}
    for o in out.values():
        # Each later turn can reuse at most its predecessor's prompt: 3 conversations x (2 + 4 + 6) blocks.
        assert 0 < o.hit_tokens <= 3 * 12 * 512
        assert 0 < o.flops_saved_frac < 1
