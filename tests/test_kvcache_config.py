"""Configuration, shared draft layers, memory sizing and runtime hooks of the KV cache (pure arithmetic)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvforge.kvcache import (
    HybridCachePolicy,
    KVCacheConfig,
    KVCacheManager,
    LayerOwner,
    LayerSpec,
    LifeCycle,
    LifeCycleKind,
    RuntimeHooks,
    Tier,
    TierConfig,
    resolve_kv_cache_manager_cls,
    runtime_hooks_of,
)
from kvforge.kvcache.draft import insert_draft_pool_ratios, resolve_draft_kv_dtype, with_draft_layers
from kvforge.kvcache.hooks import torch_mem_safety_margin_for
from kvforge.kvcache.sizing import (
    GiB,
    draft_scratch_tokens,
    kv_budget_bytes,
    plan_kv_memory,
    scratch_reserve_bytes,
    torch_mem_safety_margin,
    torch_memory_cap,
    torch_memory_fraction,
)

MiB = 1 << 20


# --- life cycles and layers ---------------------------------------------------------------------------------------


def test_life_cycle_validation_names_the_field():
    with pytest.raises(ValueError, match="window"):
        LifeCycle(LifeCycleKind.SLIDING)
    with pytest.raises(ValueError, match="window"):
        LifeCycle(LifeCycleKind.FULL, window=8)
    with pytest.raises(ValueError, match="sink_tokens"):
        LifeCycle(LifeCycleKind.RECURRENT, sink_tokens=4)
    with pytest.raises(ValueError, match="window"):
        LifeCycle.sliding(0)
    with pytest.raises(TypeError, match="window"):
        LifeCycle.sliding(8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kind"):
        LifeCycle("full")  # type: ignore[arg-type]


def test_sliding_window_stale_range():
    lc = LifeCycle.sliding(window=10, sink_tokens=5)  # 4 tokens per block: sinks fill blocks 0-1
    assert lc.sink_blocks(4) == 2
    # The token at position 30 attends to 21..30, so blocks 2..4 (tokens 8..19) are stale; block 5 holds 21.
    assert lc.first_needed_block(30, 4) == 5
    assert list(lc.stale_range(30, 4)) == [2, 3, 4]
    assert list(lc.stale_range(9, 4)) == []  # position 9 still attends to token 0
    assert list(LifeCycle.full().stale_range(10_000, 4)) == []
    assert list(LifeCycle.recurrent().stale_range(10_000, 4)) == []


def test_layer_spec_validation():
    with pytest.raises(ValueError, match="bytes_per_token"):
        LayerSpec(0)
    with pytest.raises(ValueError, match="state_bytes"):
        LayerSpec(0, LifeCycle.recurrent())
    with pytest.raises(ValueError, match="bytes_per_token"):
        LayerSpec(0, LifeCycle.recurrent(), bytes_per_token=2, state_bytes=4)
    with pytest.raises(TypeError, match="layer_id"):
        LayerSpec(True, bytes_per_token=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        LayerSpec(0, bytes_per_token=2, dtype="int4")
    with pytest.raises(TypeError, match="dtype"):
        LayerSpec(0, bytes_per_token=2, dtype=3)
    spec = LayerSpec(0, bytes_per_token=2, dtype=torch.float8_e4m3fn)
    assert spec.dtype == "float8_e4m3fn"
    assert spec.bytes_per_block(16) == 32
    assert LayerSpec(1, LifeCycle.recurrent(), state_bytes=100).bytes_per_block(16) == 100


def test_groups_by_life_cycle_and_owner_in_order_of_appearance():
    swa = LifeCycle.sliding(64)
    layers = (
        LayerSpec(0, bytes_per_token=4),
        LayerSpec(1, swa, bytes_per_token=4),
        LayerSpec(2, bytes_per_token=8),
        LayerSpec(3, LifeCycle.recurrent(), state_bytes=1000),
        LayerSpec(4, swa, bytes_per_token=4),
        LayerSpec(5, bytes_per_token=4, owner=LayerOwner.DRAFT),
    )
    cfg = KVCacheConfig(tokens_per_block=16, layers=layers)
    assert [g.layer_ids for g in cfg.groups] == [(0, 2), (1, 4), (3,), (5,)]
    assert [g.group_id for g in cfg.groups] == [0, 1, 2, 3]
    assert cfg.groups[0].bytes_per_page == (4 + 8) * 16
    assert cfg.groups[2].bytes_per_page == 1000
    # A draft layer never shares the target's group even with the same life cycle.
    assert cfg.groups[3].owner is LayerOwner.DRAFT and cfg.group_of_layer(5) == 3
    assert cfg.group_of_layer(4) == 1


def test_config_validation():
    full = LayerSpec(0, bytes_per_token=2)
    with pytest.raises(ValueError, match="layers"):
        KVCacheConfig(16, ())
    with pytest.raises(ValueError, match="duplicate layer_id"):
        KVCacheConfig(16, (full, LayerSpec(0, bytes_per_token=4)))
    with pytest.raises(ValueError, match="tokens_per_block"):
        KVCacheConfig(0, (full,))
    with pytest.raises(ValueError, match="tiers"):
        KVCacheConfig(16, (full,), (TierConfig(Tier.HOST, pages=4),))
    with pytest.raises(ValueError, match="exactly one"):
        TierConfig(Tier.GPU, quota_bytes=10, pages=4)
    with pytest.raises(ValueError, match="pages"):
        KVCacheConfig(16, (full,), (TierConfig(pages=(4, 5)),))
    with pytest.raises(ValueError, match="pool_ratios"):
        KVCacheConfig(16, (full,), pool_ratios=(0.5, 0.5))
    with pytest.raises(ValueError, match="pool_ratios"):
        KVCacheConfig(16, (full,), pool_ratios=(-1.0,))


def test_pages_from_quota_and_ratios():
    layers = (LayerSpec(0, bytes_per_token=4), LayerSpec(1, LifeCycle.sliding(32), bytes_per_token=2))
    quota = 1_000_000
    # Default ratios: every group gets the same page count.
    cfg = KVCacheConfig(16, layers, (TierConfig(quota_bytes=quota),))
    p0, p1 = cfg.pages_per_group()
    assert abs(p0 - p1) <= 1 and p0 * 64 + p1 * 32 <= quota
    cfg = KVCacheConfig(16, layers, (TierConfig(quota_bytes=quota), TierConfig(Tier.HOST, pages=7)), (3.0, 1.0))
    assert cfg.pages_per_group() == (int(quota * 0.75) // 64, int(quota * 0.25) // 32)
    assert cfg.pages_per_group(Tier.HOST) == (7, 7)


# --- shared draft layers ----------------------------------------------------------------------------------------


def test_legacy_layout_draft_layer_owner_and_partition_key():
    """Review finding: in the path without explicit layer specs, an appended draft layer with the same head count
    as a target layer must be owned by DRAFT and never share the target's partition key."""
    cfg = KVCacheConfig.from_head_counts(
        [8, 8, 8], head_dim=64, dtype="bfloat16", tokens_per_block=32, num_draft_layers=1
    )
    assert [cfg.layer_owner(i) for i in range(3)] == [LayerOwner.TARGET, LayerOwner.TARGET, LayerOwner.DRAFT]
    assert cfg.partition_key(2) == ("draft", 8)
    assert cfg.partition_key(2) != cfg.partition_key(0)
    assert cfg.partition_key(0) == cfg.partition_key(1)
    assert cfg.group_of_layer(2) != cfg.group_of_layer(0)


def test_draft_dtype_resolution():
    assert resolve_draft_kv_dtype(None, torch.bfloat16) == "bfloat16"
    assert resolve_draft_kv_dtype(torch.float8_e4m3fn, torch.bfloat16) == "float8_e4m3fn"
    assert resolve_draft_kv_dtype("bfloat16", "bfloat16") == "bfloat16"
    # Review finding: an unquantised declaration that differs from the weights is rejected, not accepted.
    with pytest.raises(ValueError, match="draft_kv_dtype"):
        resolve_draft_kv_dtype(torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="draft_kv_dtype"):
        resolve_draft_kv_dtype(torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match="draft_kv_dtype"):
        resolve_draft_kv_dtype(torch.float8_e5m2, torch.bfloat16)
    # An invalid declaration is an error, not "absent".
    with pytest.raises(TypeError, match="draft_kv_dtype"):
        resolve_draft_kv_dtype(8, torch.bfloat16)
    with pytest.raises(ValueError, match="draft_kv_dtype"):
        resolve_draft_kv_dtype("fp8", torch.bfloat16)


def test_with_draft_layers_appends_checked_draft_layers():
    target = KVCacheConfig(16, (LayerSpec(0, bytes_per_token=4),), pool_ratios=(1.0,))
    out = with_draft_layers(target, [LayerSpec(1, bytes_per_token=2, dtype="float8_e4m3fn")], weight_dtype="bfloat16")
    assert out.layer_owner(1) is LayerOwner.DRAFT and out.layer_dtype(1) == "float8_e4m3fn"
    assert out.num_groups == 2
    with pytest.raises(ValueError, match="draft_kv_dtype"):
        with_draft_layers(target, [LayerSpec(1, bytes_per_token=4, dtype="float16")], weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="duplicate layer_id"):
        with_draft_layers(target, [LayerSpec(0, bytes_per_token=4)], weight_dtype="bfloat16")


def test_draft_pool_share_gives_the_draft_group_the_full_attention_capacity():
    """Review finding: assert the draft group's capacity, not the group count. Target ratios [0.3, 0.6, 0.1]
    over (full attention, sliding window, recurrent); the inserted draft share must give the draft group as many
    pages as the full-attention target group, and leave the target groups in their 0.3 : 0.6 : 0.1 byte shares."""
    layers = (
        LayerSpec(0, bytes_per_token=1152),
        LayerSpec(1, LifeCycle.sliding(128), bytes_per_token=512),
        LayerSpec(2, LifeCycle.recurrent(), state_bytes=300_000),
        LayerSpec(3, bytes_per_token=576, dtype="float8_e4m3fn", owner=LayerOwner.DRAFT),
    )
    quota = GiB
    cfg = KVCacheConfig(64, layers, (TierConfig(quota_bytes=quota),), pool_ratios=(0.3, 0.6, 0.1))
    full, swa, rec, draft = cfg.pages_per_group()
    assert abs(draft - full) <= 1, (full, draft)
    assert full > 1000
    b = [g.bytes_per_page for g in cfg.groups]
    target_bytes = [full * b[0], swa * b[1], rec * b[2]]
    total = sum(target_bytes)
    for got, want in zip(target_bytes, (0.3, 0.6, 0.1)):
        assert abs(got / total - want) < 1e-3
    assert abs(sum(cfg.resolved_pool_ratios) - 1.0) < 1e-12
    mgr = KVCacheManager(cfg)
    assert mgr.pool(3).capacity == draft and mgr.pool(0).capacity == full


def test_insert_draft_pool_ratios_rejects_wrong_count():
    cfg = KVCacheConfig(16, (LayerSpec(0, bytes_per_token=4), LayerSpec(1, bytes_per_token=4, owner=LayerOwner.DRAFT)))
    with pytest.raises(ValueError, match="target_ratios"):
        insert_draft_pool_ratios((0.5, 0.5), cfg.groups)


# --- memory sizing ---------------------------------------------------------------------------------------------


def test_default_margin_is_one_gib_with_plenty_free():
    assert torch_mem_safety_margin(40 * GiB) == GiB
    assert torch_memory_cap(40 * GiB, 10 * GiB) == 50 * GiB - GiB


@pytest.mark.parametrize("free", [GiB, GiB // 2, 300 * MiB, 2])
def test_margin_never_takes_all_free_memory(free):
    """Review finding: min(1 GiB, free) left PyTorch no room to grow when 1 GiB or less was free."""
    margin = torch_mem_safety_margin(free)
    assert 0 <= margin < free
    assert torch_memory_cap(free, 5 * GiB) > 5 * GiB


def test_declared_margin_overrides_and_is_clamped():
    assert torch_mem_safety_margin(40 * GiB, declared=4 * GiB) == 4 * GiB
    assert torch_mem_safety_margin(2 * GiB, declared=4 * GiB) == GiB
    hooks = RuntimeHooks(torch_mem_safety_margin=3 * GiB)
    assert torch_mem_safety_margin_for(hooks, 40 * GiB) == 3 * GiB
    assert torch_mem_safety_margin_for(None, 40 * GiB) == GiB
    assert torch_memory_fraction(80 * GiB, 40 * GiB, 0) == pytest.approx(39 / 80)
    with pytest.raises(ValueError, match="free_bytes"):
        torch_mem_safety_margin(-1)


@given(free=st.integers(0, 1 << 45), reserved=st.integers(0, 1 << 40), declared=st.none() | st.integers(0, 1 << 41))
def test_cap_keeps_room_to_grow(free, reserved, declared):
    cap = torch_memory_cap(free, reserved, declared_margin=declared)
    assert reserved <= cap <= reserved + free
    if free >= 2:
        assert cap > reserved


def _drafter_config() -> KVCacheConfig:
    return KVCacheConfig(
        16,
        (
            LayerSpec(0, bytes_per_token=100),
            LayerSpec(1, LifeCycle.sliding(64), bytes_per_token=50),
            LayerSpec(2, LifeCycle.recurrent(), state_bytes=10_000),
            LayerSpec(3, bytes_per_token=30, owner=LayerOwner.DRAFT),
        ),
    )


def test_draft_scratch_reserve_counts_attention_and_draft_layers_only():
    assert draft_scratch_tokens(8, 3) == 32
    cfg = _drafter_config()
    assert scratch_reserve_bytes(cfg, 32) == 32 * (100 + 50 + 30)
    plan = plan_kv_memory(cfg, 10 * GiB, 0.5, max_batch_size=8, max_draft_len=3)
    assert plan.reserve_bytes == 32 * 180 and plan.scratch_tokens == 32
    assert plan.pool_bytes == plan.budget_bytes - plan.reserve_bytes
    no_drafter = plan_kv_memory(cfg, 10 * GiB, 0.5)
    assert no_drafter.reserve_bytes == 0 and no_drafter.pages_per_group[0] >= plan.pages_per_group[0]


def test_scratch_reserve_grows_with_preemption_headroom():
    """Review finding: the scratch request count includes the preemption headroom; the reserve grows by
    headroom x (max_draft_len + 1) x bytes per token, in the attention and the draft layers alike."""
    cfg = _drafter_config()
    base = plan_kv_memory(cfg, 10 * GiB, 0.5, max_batch_size=8, max_draft_len=3)
    more = plan_kv_memory(cfg, 10 * GiB, 0.5, max_batch_size=8, max_draft_len=3, preemption_headroom=2)
    assert more.reserve_bytes - base.reserve_bytes == 2 * 4 * (100 + 50 + 30)


def test_context_only_drafter_weights_come_from_the_kv_budget():
    free = 10 * GiB
    assert kv_budget_bytes(free, 0.75) == int(free * 0.75)
    assert kv_budget_bytes(free, 0.75, context_only_drafter_bytes=4 * GiB) == int(free * 0.75) - GiB
    assert (
        kv_budget_bytes(free, 0.75, context_only_drafter_bytes=4 * GiB, drafter_bytes_shared_with_target=2 * GiB)
        == int(free * 0.75) - GiB // 2
    )
    # Zero cases: no drafter, a fraction of 1, or storage the target holds anyway change nothing.
    assert kv_budget_bytes(free, 1.0, context_only_drafter_bytes=4 * GiB) == free
    assert kv_budget_bytes(free, 0.75, context_only_drafter_bytes=GiB, drafter_bytes_shared_with_target=GiB) == int(
        free * 0.75
    )
    with pytest.raises(ValueError, match="drafter_bytes_shared_with_target"):
        kv_budget_bytes(free, 0.75, context_only_drafter_bytes=1, drafter_bytes_shared_with_target=2)
    with pytest.raises(ValueError, match="fraction"):
        kv_budget_bytes(free, 1.5)


def test_plan_pages_fit_the_budget():
    cfg = _drafter_config()
    plan = plan_kv_memory(cfg, 64 * MiB, 0.9, max_batch_size=64, max_draft_len=2)
    used = sum(p * g.bytes_per_page for p, g in zip(plan.pages_per_group, cfg.groups))
    assert plan.pool_bytes - sum(g.bytes_per_page for g in cfg.groups) < used <= plan.pool_bytes
    sized = KVCacheConfig(cfg.tokens_per_block, cfg.layers, (plan.gpu_tier(),))
    assert KVCacheManager(sized).pool(0).capacity == plan.pages_per_group[0]


# --- runtime hooks ---------------------------------------------------------------------------------------------


class _Planner:
    def window(self):
        return 4

    def plan(self, *args):
        return []


def test_hooks_defaults_keep_behaviour():
    class Model:
        pass

    hooks = runtime_hooks_of(Model)
    assert hooks == RuntimeHooks()
    assert hooks.torch_mem_safety_margin is None and hooks.kv_cache_manager_cls is None
    assert hooks.exact_context_demotion is False and hooks.kv_balanced_admission_planner is None
    assert hooks.hybrid_cache == HybridCachePolicy(0, False)
    assert resolve_kv_cache_manager_cls(KVCacheManager, hooks) is KVCacheManager


def test_hooks_validation():
    with pytest.raises(TypeError, match="kv_balanced_admission_planner"):
        RuntimeHooks(kv_balanced_admission_planner=object())
    assert RuntimeHooks(kv_balanced_admission_planner=_Planner()).kv_balanced_admission_planner is not None
    with pytest.raises(ValueError, match="torch_mem_safety_margin"):
        RuntimeHooks(torch_mem_safety_margin=-1)
    with pytest.raises(TypeError, match="kv_cache_manager_cls"):
        RuntimeHooks(kv_cache_manager_cls=KVCacheManager(_drafter_config()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_priority_snapshot_prompt_len"):
        HybridCachePolicy(low_priority_snapshot_prompt_len=-4)
    with pytest.raises(TypeError, match="state_index_upload_kernel"):
        HybridCachePolicy(state_index_upload_kernel=1)  # type: ignore[arg-type]

    class Model:
        runtime_hooks = "no"

    with pytest.raises(TypeError, match="runtime_hooks"):
        runtime_hooks_of(Model)


def test_declared_manager_class_must_subclass_the_resolved_one():
    class MyManager(KVCacheManager):
        pass

    class Model:
        runtime_hooks = RuntimeHooks(kv_cache_manager_cls=MyManager)

    cls = resolve_kv_cache_manager_cls(KVCacheManager, runtime_hooks_of(Model))
    assert cls is MyManager
    assert isinstance(cls(_drafter_config()), KVCacheManager)

    class Unrelated:
        pass

    with pytest.raises(ValueError, match=r"Unrelated.*KVCacheManager"):
        resolve_kv_cache_manager_cls(KVCacheManager, RuntimeHooks(kv_cache_manager_cls=Unrelated))
    # A parent of the resolved class is not a subclass either.
    with pytest.raises(ValueError, match="MyManager"):
        resolve_kv_cache_manager_cls(MyManager, RuntimeHooks(kv_cache_manager_cls=KVCacheManager))
