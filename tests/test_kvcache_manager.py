"""KV cache manager behaviours: reuse, partial blocks, eviction order and tiers, events, states and misuse."""

from __future__ import annotations

import pytest

from kvforge.errors import CacheStateError, OutOfPagesError
from kvforge.kvcache import (
    CacheStatus,
    KVCache,
    KVCacheConfig,
    KVCacheManager,
    LayerSpec,
    LifeCycle,
    PageCopy,
    PageState,
    PrioritizedLRU,
    SwaPriorities,
    Tier,
    TierConfig,
)
from kvforge.kvcache.events import BlockRemoved, BlockStored
from kvforge.kvcache.hashing import block_keys, root_key

TPB = 4
FULL = LayerSpec(0, bytes_per_token=2)


def make(pages=8, host=None, layers=(FULL,), **kw) -> tuple[KVCacheManager, list]:
    tiers = (TierConfig(pages=pages),) + (() if host is None else (TierConfig(Tier.HOST, pages=host),))
    events: list = []
    mgr = KVCacheManager(KVCacheConfig(TPB, layers, tiers), event_sink=events.append, **kw)
    return mgr, events


def serve(mgr, tokens, *, scope=None, close=True, cb=None, cap=True):
    """One request: create with reuse, compute and commit the whole prompt, close."""
    cache = mgr.create_cache(
        tokens, scope=scope, priority_callback=cb, max_reuse_tokens=len(tokens) - 1 if cap else None
    )
    assert cache.resize(capacity=len(tokens), history=len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    if close:
        cache.close()
    mgr.check_invariants()
    return cache


def seq(start, n):
    return list(range(start, start + n))


# --- reuse ---------------------------------------------------------------------------------------------------


def test_commit_inserts_blocks_and_a_later_prompt_reuses_them():
    mgr, events = make()
    prompt = seq(100, 10)
    cache = mgr.create_cache(prompt)
    assert cache.num_committed_tokens == 0 and cache.capacity == 0
    assert cache.resize(capacity=10, history=10)
    assert cache.num_blocks == 3 and len(set(cache.page_indices(0))) == 3
    cache.commit(prompt)
    keys = block_keys(prompt, TPB)
    assert events == [BlockStored(tuple(keys), None, TPB)]
    assert cache.block_keys == tuple(keys)
    pages = cache.page_indices(0)
    cache.close()
    mgr.check_invariants()

    assert mgr.probe_reuse([*prompt, 1, 2]) == 10  # two full blocks, then 2 tokens of the partial tail
    other = mgr.create_cache([*prompt, 1, 2])
    assert other.num_committed_tokens == other.history == other.capacity == 10
    assert other.page_indices(0)[:2] == pages[:2]  # full blocks are shared, not copied
    copies = mgr.take_pending_copies()
    assert copies == [PageCopy(0, Tier.GPU, pages[2], Tier.GPU, other.page_indices(0)[2], 2)]
    assert mgr.take_pending_copies() == []
    assert mgr.pool(0).pages[pages[0]].ref_count == 1
    mgr.check_invariants()


def test_reuse_scopes_are_isolated_and_match_router_hashes():
    mgr, events = make()
    prompt = seq(0, 8)
    serve(mgr, prompt, scope=("lora", 3))
    assert events[0].block_keys == tuple(block_keys(prompt, TPB, ("lora", 3)))
    assert mgr.probe_reuse(prompt, ("lora", 3)) == 8
    assert mgr.probe_reuse(prompt) == 0
    assert mgr.probe_reuse(prompt, "salt") == 0
    assert root_key(("lora", 3)) in mgr.tree.roots


def test_max_reuse_leaves_the_last_prompt_token_to_compute():
    mgr, _ = make()
    prompt = seq(0, 8)
    serve(mgr, prompt)
    cache = mgr.create_cache(prompt, max_reuse_tokens=7)
    # The last full block is reused partially (copied): 7 tokens.
    assert cache.num_committed_tokens == 7
    copy = mgr.take_pending_copies()
    assert len(copy) == 1 and copy[0].num_tokens == 3


def test_partial_match_inside_a_full_block_and_divergence():
    mgr, _ = make()
    serve(mgr, seq(0, 8))
    # Diverges at token 6: block 0 shared, 2 tokens of block 1 (the commit's last block keeps its tokens).
    assert mgr.probe_reuse([0, 1, 2, 3, 4, 5, 99, 98]) == 6
    # Block 0 was completed inside a longer commit: it keeps only its hash (see the manager's docstring).
    assert mgr.probe_reuse([0, 1, 2, 99]) == 0
    assert mgr.probe_reuse([99]) == 0
    assert mgr.probe_reuse([]) == 0
    # Blocks completed token by token (decode) keep their tokens.
    cache = mgr.create_cache()
    for t in seq(50, 8):
        cache.resize(cache.history + 1, cache.history + 1)
        cache.commit([t])
    assert cache.block_keys == tuple(block_keys(seq(50, 8), TPB))  # the router's hashes, token by token too
    cache.close()
    assert mgr.probe_reuse([50, 51, 52, 99]) == 3


def test_key_mode_caches_commit_and_match_by_precomputed_keys():
    mgr, events = make()
    cache = mgr.create_cache(block_keys=[11, 12, 13])
    assert cache.key_mode and cache.num_committed_tokens == 0
    assert cache.resize(12, 12)
    with pytest.raises(ValueError, match="block_keys"):
        cache.commit(num_tokens=12, block_keys=[11, 12])
    with pytest.raises(ValueError, match="tokens"):
        cache.commit(seq(0, 12))
    cache.commit(num_tokens=12, block_keys=[11, 12, 13])
    assert events[-1] == BlockStored((11, 12, 13), None, TPB)
    cache.close()
    assert mgr.probe_reuse(block_keys=[11, 12, 99]) == 8
    assert mgr.create_cache(block_keys=[11, 12, 13, 14]).num_committed_tokens == 12
    mgr.check_invariants()


def test_tokens_with_precomputed_keys_skip_hashing_but_agree():
    mgr, _ = make()
    prompt = seq(0, 12)
    keys = block_keys(prompt, TPB)
    cache = mgr.create_cache(prompt, block_keys=keys)
    cache.resize(12, 12)
    cache.commit(prompt, block_keys=keys)
    cache.close()
    assert mgr.probe_reuse(prompt) == 12
    with pytest.raises(ValueError, match="block_keys"):
        mgr.create_cache(prompt, block_keys=keys[:2])


def test_concurrent_duplicate_blocks_are_shared_not_duplicated():
    mgr, events = make()
    prompt = seq(0, 8)
    a = mgr.create_cache(prompt)
    b = mgr.create_cache(prompt)
    a.resize(8, 8)
    b.resize(8, 8)
    assert mgr.pool(0).num_free == 4
    a.commit(prompt)
    b.commit(prompt)  # the tree already has both blocks: b takes a's pages and frees its own
    assert len(events) == 1
    assert a.page_indices(0) == b.page_indices(0)
    assert mgr.pool(0).num_free == 6
    assert all(mgr.pool(0).pages[i].ref_count == 2 for i in a.page_indices(0))
    mgr.check_invariants()
    a.close()
    b.close()
    mgr.check_invariants()


def test_probe_is_read_only_even_for_recency():
    """probe_reuse changes nothing: the full state is equal before and after, and eviction order is unaffected
    (a probed old prompt is still evicted before a newer one, unlike a real reuse)."""
    mgr, _ = make(pages=4)
    old, new = seq(0, 8), seq(50, 8)
    serve(mgr, old)
    serve(mgr, new)
    before = mgr.state_snapshot()
    for _ in range(3):
        assert mgr.probe_reuse(old) == 8
        assert mgr.probe_reuse(old, "other-scope") == 0
    assert mgr.state_snapshot() == before
    assert mgr.evict(0, 2) == 2
    assert mgr.probe_reuse(old) == 0 and mgr.probe_reuse(new) == 8

    mgr, _ = make(pages=4)
    serve(mgr, old)
    serve(mgr, new)
    mgr.create_cache(old).close()  # a real reuse refreshes recency
    mgr.evict(0, 2)
    assert mgr.probe_reuse(old) == 8 and mgr.probe_reuse(new) == 0


# --- eviction --------------------------------------------------------------------------------------------------


def test_lru_evicts_leaves_first_and_publishes_removals():
    mgr, events = make(pages=6)
    a, b = seq(0, 12), seq(100, 12)
    serve(mgr, a)
    serve(mgr, b)
    events.clear()
    cache = mgr.create_cache(seq(200, 4))
    assert cache.resize(4, 4)  # takes one page: a's leaf goes (least recently used, deepest first)
    assert events == [BlockRemoved((block_keys(a, TPB)[2],))]
    assert mgr.probe_reuse(a) == 8 and mgr.probe_reuse(b) == 12
    assert cache.resize(16, 16)  # three more: the rest of a, then b's leaf
    assert mgr.probe_reuse(a) == 0 and mgr.probe_reuse(b) == 8
    mgr.check_invariants()


def test_lower_priority_goes_first_and_reuse_only_raises_priority():
    mgr, _ = make(pages=6)
    low, high = seq(0, 4), seq(100, 4)
    serve(mgr, high, cb=lambda ordinal, group: 80)
    serve(mgr, low, cb=lambda ordinal, group: 10)  # more recent but lower priority
    filler = mgr.create_cache()
    assert filler.resize(20, 20)  # 5 pages: one of the two cached blocks must go
    assert mgr.probe_reuse(high) == 4 and mgr.probe_reuse(low) == 0
    filler.close()

    mgr, _ = make(pages=4)
    serve(mgr, high, cb=lambda o, g: 80)
    serve(mgr, high, cb=lambda o, g: 5)  # a reuse at a lower priority does not lower it
    block = mgr.tree.root(None).children[block_keys(high, TPB)[0]]
    assert block.pages[0].priority == 80


def test_priority_callback_is_checked_before_anything_changes():
    mgr, _ = make()
    prompt = seq(0, 8)
    cache = mgr.create_cache(prompt, priority_callback=lambda o, g: 101)
    cache.resize(8, 8)
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="priority_callback"):
        cache.commit(prompt)
    assert mgr.state_snapshot() == before
    cache.priority_callback = lambda o, g: 50 + o
    cache.commit(prompt)
    assert [p.priority for p in cache.pages(0)] == [50, 51]


def test_host_tier_offload_onboard_and_drop():
    mgr, events = make(pages=3, host=2)
    a, b = seq(0, 8), seq(100, 8)
    serve(mgr, a)
    a_pages = [mgr.tree.root(None).children[block_keys(a, TPB)[0]]]
    assert mgr.pool(0).num_free == 1
    serve(mgr, b)  # needs 2 pages: one free, one evicted from a (its leaf) to the host
    offload = mgr.take_pending_copies()
    assert [(c.src_tier, c.dst_tier) for c in offload] == [(Tier.GPU, Tier.HOST)]
    assert mgr.pool(0, Tier.HOST).n_unlocked == 1
    assert not any(isinstance(e, BlockRemoved) for e in events)  # moved, not dropped
    assert mgr.probe_reuse(a) == 8  # a host block is still reusable
    cache = mgr.create_cache(a)
    onboard = mgr.take_pending_copies()
    assert (onboard[-1].src_tier, onboard[-1].dst_tier) == (Tier.HOST, Tier.GPU)
    assert all(p.tier is Tier.GPU for p in cache.pages(0))
    assert cache.pages(0)[0].block is a_pages[0]
    mgr.check_invariants()
    cache.close()
    # Fill everything: the host drops its least recently used droppable block, which is announced.
    events.clear()
    big = mgr.create_cache()
    assert big.resize(12, 12)
    assert any(isinstance(e, BlockRemoved) for e in events)
    mgr.check_invariants()


def test_resize_returns_false_and_changes_nothing_when_pages_run_out():
    mgr, _ = make(pages=4)
    a = mgr.create_cache()
    assert a.resize(12, 12)
    b = mgr.create_cache()
    before = mgr.state_snapshot()
    assert b.pages_needed(8) == (2,)
    assert not b.can_resize(8)
    assert b.resize(capacity=8) is False
    assert mgr.state_snapshot() == before
    assert b.can_resize(4) and b.resize(capacity=4)
    assert not mgr.can_allocate([1])


def test_shrinking_frees_uncommitted_pages():
    mgr, _ = make(pages=4)
    cache = mgr.create_cache()
    cache.resize(16, 6)
    cache.commit(seq(0, 4))
    assert mgr.pool(0).num_free == 0
    assert cache.resize(capacity=6)
    assert mgr.pool(0).num_free == 2 and cache.num_blocks == 2
    mgr.check_invariants()


def test_custom_eviction_policy_is_used():
    made = []

    class MostRecentFirst(PrioritizedLRU):
        def add(self, page):
            page.last_used = -page.last_used  # invert recency: newest first
            super().add(page)

    def factory(group, tier):
        made.append((group.group_id, tier))
        return MostRecentFirst()

    mgr, _ = make(pages=4, eviction_policy=factory)
    assert made == [(0, Tier.GPU)]
    old, new = seq(0, 8), seq(100, 8)
    serve(mgr, old)
    serve(mgr, new)
    mgr.evict(0, 2)
    assert mgr.probe_reuse(old) == 8 and mgr.probe_reuse(new) == 0


def test_page_states():
    mgr, _ = make(pages=4)
    cache = mgr.create_cache(seq(0, 8))
    cache.resize(8, 8)
    p0, p1 = cache.pages(0)
    assert p0.state is PageState.LOCKED
    cache.commit(seq(0, 8))
    cache.close()
    assert p0.state is PageState.HELD  # its child still needs it
    assert p1.state is PageState.DROPPABLE
    assert mgr.pool(0).pages[3].state is PageState.FREE


def test_out_of_pages_on_create_changes_nothing():
    rec = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
    mgr, _ = make(pages=(4, 1), layers=(FULL, rec))
    first = mgr.create_cache()
    assert first.live_page(1) is not None
    before = mgr.state_snapshot()
    with pytest.raises(OutOfPagesError, match="create_cache"):
        mgr.create_cache()
    assert mgr.state_snapshot() == before
    first.close()
    assert mgr.create_cache().live_page(1) is not None


# --- sliding windows and recurrent states ---------------------------------------------------------------------


def _swa_mgr(**kw):
    swa = LayerSpec(1, LifeCycle.sliding(window=6, sink_tokens=2), bytes_per_token=2)
    return make(pages=(16, 16), layers=(FULL, swa), **kw)


def test_sliding_window_pages_are_released_as_they_go_stale():
    mgr, _ = _swa_mgr()
    cache = mgr.create_cache()
    for t in range(20):
        assert cache.resize(t + 1, t + 1)
        cache.commit([t])
    # 20 committed: the next token attends to 15..19 plus sinks (block 0): blocks 0, 3, 4 hold pages.
    swa = cache.page_indices(1)
    assert [i for i, p in enumerate(swa) if p >= 0] == [0, 3, 4]
    assert all(p >= 0 for p in cache.page_indices(0))
    mgr.check_invariants()
    cache.close()
    mgr.check_invariants()


def test_sliding_window_match_is_pruned_to_what_the_window_needs():
    mgr, _ = _swa_mgr()
    prompt = seq(0, 24)
    serve(mgr, prompt, cap=False)
    assert mgr.probe_reuse(prompt) == 24
    root = mgr.tree.root(None)
    blocks = [root]
    for k in block_keys(prompt, TPB):
        blocks.append(blocks[-1].children[k])
    blocks = blocks[1:]
    # Drop an interior sliding-window page (block 2): a match of all 24 tokens needs only sinks + blocks 4-5.
    mgr.block_pool.drop(blocks[2].pages[1])
    assert mgr.probe_reuse(prompt) == 24
    # Drop a page the full match needs (block 5): the match falls back to where the window is complete.
    mgr.block_pool.drop(blocks[5].pages[1])
    assert mgr.probe_reuse(prompt) == 20  # resuming at token 20 reads tokens 15..19 (blocks 3-4) and the sink
    mgr.block_pool.drop(blocks[3].pages[1])
    assert mgr.probe_reuse(prompt) == 8  # 16 and 12 would need block 2; 8 needs blocks 0-1 only
    mgr.check_invariants()
    cache = mgr.create_cache(prompt)
    assert cache.num_committed_tokens == 8
    assert cache.page_indices(1) == [blocks[0].pages[1].index, blocks[1].pages[1].index]
    assert len(cache.page_indices(0)) == 2
    mgr.check_invariants()


def test_swa_endpoint_priorities_decide_sliding_pages_and_the_callback_the_rest():
    mgr, _ = _swa_mgr(swa_priorities=SwaPriorities(endpoint=90, interior=3))
    prompt = seq(0, 24)
    serve(mgr, prompt, cb=lambda o, g: 60, cap=False)
    node, blocks = mgr.tree.root(None), []
    for k in block_keys(prompt, TPB):
        node = node.children[k]
        blocks.append(node)
    assert [b.pages[0].priority for b in blocks] == [60] * 6
    # Sinks (block 0) and the last window (blocks 4-5) are endpoints; the rest are interior.
    assert [b.pages[1].priority for b in blocks] == [90, 3, 3, 3, 90, 90]


class _SnapshotsCache(KVCache):
    """Snapshots the recurrent state at every block whose end the cache has reached exactly."""

    __slots__ = ()

    def _snapshot_pages(self, block, ordinal):
        mgr = self.manager
        if self.history != ordinal * mgr.tokens_per_block + block.num_tokens:
            return {}
        out = {}
        for g in mgr.recurrent_groups:
            page = mgr.block_pool.alloc_page(g)
            mgr.block_pool.record_copy(PageCopy(g, Tier.GPU, self.live_page(g).index, Tier.GPU, page.index))
            out[g] = page
        return out


class _Snapshots(KVCacheManager):
    cache_class = _SnapshotsCache


def test_recurrent_match_is_cut_back_to_the_last_snapshot():
    rec = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
    mgr = _Snapshots(KVCacheConfig(TPB, (FULL, rec), (TierConfig(pages=(16, 16)),)))
    prompt = seq(0, 10)
    cache = mgr.create_cache(prompt)
    cache.resize(10, 10)
    cache.commit(prompt[:9])  # history 10, so no block end coincides: no snapshot
    cache.resize(10, 10)
    cache.close()
    assert mgr.probe_reuse(prompt) == 0  # attention pages alone cannot resume a recurrent state
    cache = mgr.create_cache(prompt)
    for t in prompt:
        cache.resize(cache.history + 1, cache.history + 1)
        cache.commit([t])  # token by token: a snapshot at every block end
    cache.close()
    assert mgr.probe_reuse(prompt) == 10  # the partial tail has its snapshot too
    assert mgr.probe_reuse([*prompt[:9], 77]) == 8  # diverges inside the tail: back to the block-8 snapshot
    reused = mgr.create_cache([*prompt[:9], 77])
    copies = mgr.take_pending_copies()
    assert copies[-1].group == 1 and copies[-1].dst_index == reused.live_page(1).index
    mgr.check_invariants()


# --- states and misuse ------------------------------------------------------------------------------------------


def test_suspend_releases_pages_and_resume_reacquires_the_committed_prefix():
    mgr, _ = make(pages=4)
    prompt = seq(0, 10)
    cache = mgr.create_cache(prompt)
    cache.resize(12, 12)
    cache.commit(prompt)
    pages = cache.page_indices(0)
    cache.suspend()
    assert cache.status is CacheStatus.SUSPENDED
    assert cache.history == cache.capacity == cache.num_committed_tokens == 10
    assert mgr.pool(0).num_locked == 0
    assert mgr.probe_reuse(prompt) == 10
    mgr.check_invariants()
    assert cache.resume()
    assert cache.page_indices(0)[:2] == pages[:2] and cache.num_committed_tokens == 10
    assert cache.resize(11, 11)
    cache.commit([10])
    mgr.check_invariants()


def test_resume_fails_without_changes_when_the_prefix_was_evicted():
    mgr, _ = make(pages=3)
    cache = mgr.create_cache(seq(0, 8))
    cache.resize(8, 8)
    cache.commit(seq(0, 8))
    cache.suspend()
    other = mgr.create_cache()
    assert other.resize(12, 12)  # evicts the suspended cache's blocks
    before = mgr.state_snapshot()
    assert cache.resume() is False
    assert cache.status is CacheStatus.SUSPENDED
    assert mgr.state_snapshot() == before
    cache.close()
    assert cache.status is CacheStatus.CLOSED and cache not in mgr.caches


@pytest.mark.parametrize(
    "op",
    [
        lambda c: c.commit([1, 2, 3]),  # past history
        lambda c: c.resize(history=1),  # below committed
        lambda c: c.resize(capacity=2, history=3),  # history past capacity
        lambda c: c.resume(),  # not suspended
    ],
)
def test_misuse_raises_cache_state_error_and_changes_nothing(op):
    mgr, _ = make()
    cache = mgr.create_cache()
    cache.resize(4, 2)
    cache.commit([7, 8])
    before = mgr.state_snapshot()
    with pytest.raises(CacheStateError):
        op(cache)
    assert mgr.state_snapshot() == before


def test_operations_after_close_or_suspend_raise():
    mgr, _ = make()
    cache = mgr.create_cache()
    cache.suspend()
    before = mgr.state_snapshot()
    for op in (lambda: cache.commit([1]), lambda: cache.resize(4), cache.suspend, lambda: cache.can_resize(4)):
        with pytest.raises(CacheStateError):
            op()
    assert mgr.state_snapshot() == before
    cache.close()
    before = mgr.state_snapshot()
    for op in (cache.close, cache.resume, cache.stop_committing, cache.suspend):
        with pytest.raises(CacheStateError):
            op()
    assert mgr.state_snapshot() == before


def test_stop_committing_blocks_commits_but_not_growth():
    mgr, events = make()
    cache = mgr.create_cache()
    cache.resize(8, 8)
    cache.stop_committing()
    cache.stop_committing()  # idempotent
    with pytest.raises(CacheStateError, match="stopped committing"):
        cache.commit([1])
    assert cache.resize(12, 12)
    cache.close()
    assert events == [] and mgr.num_tree_blocks == 0


def test_bad_arguments_name_the_argument():
    mgr, _ = make()
    cache = mgr.create_cache()
    with pytest.raises(TypeError, match="capacity"):
        cache.resize(capacity=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity"):
        cache.resize(capacity=-1)
    with pytest.raises(TypeError, match="tokens"):
        mgr.create_cache("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority_callback"):
        mgr.create_cache(priority_callback=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_id"):
        mgr.create_cache(cache_id=cache.id)
    with pytest.raises(TypeError, match="config"):
        KVCacheManager({})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default_priority"):
        make(default_priority=101)
    with pytest.raises(ValueError, match="pages_per_group"):
        mgr.can_allocate([1, 2])
    with pytest.raises(ValueError, match="endpoint"):
        SwaPriorities(endpoint=-1)


def test_all_pages_return_when_every_cache_closes():
    mgr, _ = make(pages=16, host=4)
    caches = [serve(mgr, seq(i * 3, 9 + i), close=False) for i in range(4)]
    caches[1].suspend()
    for c in caches:
        c.close()
    mgr.check_invariants()
    pool = mgr.pool(0)
    assert all(p.ref_count == 0 for p in pool.pages)
    assert pool.num_free + pool.n_unlocked == pool.capacity
    assert mgr.caches == ()


# --- check-then-act for new requests ----------------------------------------------------------------------------


def test_plan_admission_is_exact_and_read_only():
    mgr, _ = make(pages=6)
    prompt = seq(0, 12)
    serve(mgr, prompt)  # 3 unlocked pages in the tree, 3 free
    hog = mgr.create_cache()
    assert hog.resize(4, 4)  # 2 free left
    before = mgr.state_snapshot()
    plan = mgr.plan_admission(prompt + seq(50, 12), capacity=20)
    assert mgr.state_snapshot() == before
    assert plan.reused_tokens == 12 and plan.pages_needed == (2,) and plan.fits
    assert not mgr.plan_admission(prompt + seq(50, 12), capacity=24).fits
    cache = mgr.create_cache(prompt + seq(50, 12), capacity=20)
    assert cache.capacity == 20 and cache.history == 12 and cache.num_blocks == 5
    mgr.check_invariants()
    # Everything is locked now: a further admission cannot fit, and creating raises without changes.
    plan = mgr.plan_admission(seq(900, 4), capacity=4)
    assert plan.reused_tokens == 0 and plan.pages_needed == (1,) and not plan.fits
    before = mgr.state_snapshot()
    with pytest.raises(OutOfPagesError):
        mgr.create_cache(seq(900, 4), capacity=4, scope="fresh-scope")
    assert mgr.state_snapshot() == before  # not even the new scope's root was registered


def test_plan_admission_counts_the_pages_the_reuse_locks():
    mgr, _ = make(pages=4)
    serve(mgr, seq(0, 8))  # 2 unlocked pages in the tree, 2 free
    # Reusing both blocks locks them: only the 2 free pages remain for new blocks.
    assert mgr.plan_admission(seq(0, 8), capacity=16).fits
    assert not mgr.plan_admission(seq(0, 8), capacity=20).fits
    # Without reuse the tree's pages are evictable: 4 pages are available.
    assert mgr.plan_admission(seq(0, 8), capacity=16, reuse=False).fits
    assert not mgr.plan_admission(seq(0, 8), capacity=20, reuse=False).fits


def test_layer_queries_on_the_manager():
    cfg = KVCacheConfig.from_head_counts([4, 4], head_dim=8, dtype="bfloat16", tokens_per_block=TPB, num_draft_layers=1)
    mgr = KVCacheManager(cfg)
    assert mgr.layer_owner(1).value == "draft" and mgr.layer_dtype(1) == "bfloat16"
    assert mgr.partition_key(0) != mgr.partition_key(1)
    assert mgr.group_of_layer(0) == 0 and mgr.group_of_layer(1) == 1


def test_a_failing_callback_at_close_or_in_a_sliding_commit_changes_nothing():
    mgr, _ = _swa_mgr()
    cache = mgr.create_cache(priority_callback=lambda o, g: 200 if o == 1 else 30)
    cache.resize(6, 6)
    cache.commit(seq(0, 3))
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="priority_callback"):
        cache.close()
    assert mgr.state_snapshot() == before and cache.status is CacheStatus.ACTIVE
    with pytest.raises(ValueError, match="priority_callback"):
        cache.suspend()
    assert mgr.state_snapshot() == before
    cache.resize(16, 16)
    cache.priority_callback = None
    cache.commit(seq(3, 9))  # 12 committed: the window still reads block 1 (tokens 7..11)
    cache.priority_callback = lambda o, g: 200 if (o, g) == (1, 1) else 30
    # One more token completes no block but makes block 1 stale for the sliding window: its priority is asked
    # first, and refused.
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="priority_callback"):
        cache.commit([12])
    assert mgr.state_snapshot() == before and cache.num_committed_tokens == 12
    cache.priority_callback = None
    cache.commit([12])
    assert cache.page_indices(1)[1] == -1
    cache.close()
    mgr.check_invariants()


# --- listeners ----------------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.changed: list = []
        self.closed: list = []

    def cache_changed(self, cache, group, first_block):
        self.changed.append((cache.id, group, first_block))

    def cache_closed(self, cache):
        self.closed.append(cache.id)


def test_listeners_follow_page_changes_and_closes_until_removed():
    mgr, _ = make(pages=16)
    rec = _Recorder()
    mgr.add_listener(rec)
    mgr.add_listener(rec)  # registered once
    cache = mgr.create_cache(seq(0, 6), cache_id="a")
    assert cache.resize(capacity=6, history=6)  # 0 -> 2 blocks of group 0
    assert (("a", 0, 0) in rec.changed) and cache.page_indices(0, 1) == cache.page_indices(0)[1:]
    rec.changed.clear()
    assert cache.resize(capacity=9)  # a third block
    assert rec.changed == [("a", 0, 2)]
    cache.close()
    assert rec.closed == ["a"]
    mgr.remove_listener(rec)
    mgr.remove_listener(rec)  # a no-op
    serve(mgr, seq(50, 9))
    assert rec.closed == ["a"]
    with pytest.raises(TypeError, match="listener"):
        mgr.add_listener(object())


def test_block_pool_owns_pages_and_the_manager_delegates():
    mgr, _ = make(pages=8, host=4)
    bp = mgr.block_pool
    assert mgr.tree is bp.tree and mgr.tiers == bp.tiers == (Tier.GPU, Tier.HOST)
    assert mgr.pool(0, Tier.HOST) is bp.pool(0, Tier.HOST)
    serve(mgr, seq(0, 8))
    assert mgr.evict(0, 2) == bp.num_pending_copies == 2  # two blocks offloaded to the host tier
    assert len(mgr.take_pending_copies()) == 2 and bp.num_pending_copies == 0
    assert mgr.stats is bp.stats and mgr.stats.offloaded_pages == 2
    mgr.check_invariants()
