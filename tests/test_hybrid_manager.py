"""The hybrid (attention + recurrent-state) cache manager: snapshot points, marks, the pending snapshot slot,
short-prompt priorities and counters, on small real managers (4-token blocks)."""

from __future__ import annotations

import logging

import pytest

from kvforge.errors import CacheStateError
from kvforge.kvcache import (
    HybridCachePolicy,
    KVCacheConfig,
    KVCacheManager,
    LayerOwner,
    LayerSpec,
    LifeCycle,
    TierConfig,
)
from kvforge.kvcache.hashing import default_hasher
from kvforge.kvcache.hybrid import HybridCacheManager, HybridKVCache
from kvforge.scheduling import Request, Scheduler, SchedulerConfig


def _key(parent: int, block) -> int:
    """The block key of one full block under ``parent`` (the managers' default hasher)."""
    return default_hasher().block_keys(list(block), len(block), parent=parent)[0]


TPB = 4
FULL = LayerSpec(0, bytes_per_token=2)
REC = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
G_REC = 1


def make(pages=(32, 8), *, layers=(FULL, REC), **kw) -> HybridCacheManager:
    return HybridCacheManager(KVCacheConfig(TPB, layers, (TierConfig(pages=pages),)), **kw)


def seq(start: int, n: int) -> list[int]:
    return [(start * 7919 + i * 31) % 1009 for i in range(n)]


def prefill(cache: HybridKVCache, tokens, ends) -> None:
    """Compute and commit ``tokens`` in steps ending at ``ends`` (each step: history = its end, then commit)."""
    for end in ends:
        done = cache.num_committed_tokens
        assert cache.resize(capacity=max(cache.capacity, end), history=end)
        cache.commit(tokens[done:end])


def snapshot_ends(mgr: HybridCacheManager, tokens) -> list[int]:
    """Token positions along ``tokens``' path in the tree whose block holds a recurrent snapshot."""
    node, out = mgr.tree.root(None), []
    for i in range(len(tokens) // TPB):
        node = node.children.get(_key(node.key, tokens[i * TPB : (i + 1) * TPB]))
        if node is None:
            break
        if node.pages[G_REC] is not None:
            out.append((i + 1) * TPB)
    return out


# --- construction -------------------------------------------------------------------------------------------------


def test_bad_construction_is_rejected():
    with pytest.raises(ValueError, match="recurrent"):
        HybridCacheManager(KVCacheConfig(TPB, (FULL,), (TierConfig(pages=4),)))
    with pytest.raises(ValueError, match="snapshot_interval"):
        make(snapshot_interval=6)
    with pytest.raises(ValueError, match="prompt_end_offsets"):
        make(prompt_end_offsets=(-1,))
    with pytest.raises(ValueError, match="midchunk_snapshot_alignment"):
        make(midchunk_snapshot_alignment=0)
    with pytest.raises(TypeError, match="policy"):
        make(policy=3)


# --- snapshot points ----------------------------------------------------------------------------------------------


def test_only_snapshot_points_get_snapshots_and_reuse_is_cut_back_to_them():
    mgr = make(snapshot_interval=8)
    prompt = seq(1, 22)
    cache = mgr.create_cache(prompt)
    # Points: every 8 tokens (8, 16) and the last block boundary of the prompt (20).
    assert cache.snapshot_points == (8, 16, 20)
    prefill(cache, prompt, [4, 8, 12, 16, 20, 22])
    assert snapshot_ends(mgr, prompt) == [8, 16, 20]  # step ends at 4 and 12 are no points: no snapshot
    mgr.check_invariants()
    cache.close()
    mgr.check_invariants()
    assert mgr.probe_reuse(prompt) == 22  # the closing cache's live state became the tail's snapshot
    assert mgr.probe_reuse([*prompt[:14], 999, 999, 999]) == 8  # diverges in block 3: back to the point at 8
    assert mgr.counters.snapshots == 4


def test_a_point_inside_a_step_gets_no_live_snapshot():
    mgr = make()
    prompt = seq(2, 12)
    cache = mgr.create_cache(prompt)
    prefill(cache, prompt, [10])  # the point at 12 lies past this step; block ends 4 and 8 are no points
    assert snapshot_ends(mgr, prompt) == []
    prefill(cache, prompt, [12])
    assert snapshot_ends(mgr, prompt) == [12]


def test_prompt_end_offsets():
    mgr = make(prompt_end_offsets=(0, 1, 9))
    cache = mgr.create_cache(seq(3, 16))
    # align_down(16) = 16, align_down(15) = 12, align_down(7) = 4.
    assert cache.snapshot_points == (4, 12, 16)


def test_branch_point_snapshot_makes_the_shared_prefix_reusable():
    mgr = make()
    first = seq(4, 20)
    c = mgr.create_cache(first)
    prefill(c, first, [20])
    c.close()
    assert snapshot_ends(mgr, first) == [20]
    # Shares 12 tokens (3 blocks) with the first prompt, whose only snapshot is at 20: nothing reusable.
    second = [*first[:12], *seq(5, 10)]
    c2 = mgr.create_cache(second, max_reuse_tokens=len(second) - 1)
    assert c2.num_committed_tokens == 0
    assert c2.branch_point == 12
    assert mgr.counters.pruned_tokens == 12
    assert 12 in c2.snapshot_points
    prefill(c2, second, [12, 20, 22])
    assert mgr.counters.branch_snapshots == 1
    c2.close()
    third = [*first[:12], *seq(6, 9)]
    assert mgr.probe_reuse(third) == 12
    mgr.check_invariants()


def test_no_branch_point_when_the_cached_prefix_has_its_snapshot():
    mgr = make()
    first = seq(7, 16)
    c = mgr.create_cache(first)
    prefill(c, first, [16])
    c.close()
    c2 = mgr.create_cache([*first, *seq(8, 6)])
    assert c2.num_committed_tokens == 16 and c2.branch_point is None
    assert mgr.counters.pruned_tokens == 0


def test_requested_points_become_snapshots_and_are_counted():
    mgr = make()
    prompt = seq(9, 20)
    cache = mgr.create_cache(prompt)
    assert cache.request_snapshot_point(10)  # rounded down to the block boundary 8
    assert not cache.request_snapshot_point(9)  # the same point
    assert cache.request_snapshot_point(3) is False  # rounds to 0: nothing to save
    assert cache.snapshot_points == (8, 20)
    prefill(cache, prompt, [8, 20])
    assert mgr.counters.points_requested == 1 and mgr.counters.points_requested_committed == 1
    with pytest.raises(ValueError, match="position"):
        cache.request_snapshot_point(0)


# --- marks for the scheduler --------------------------------------------------------------------------------------


def test_marks_points_alignment_and_pass_point():
    mgr = make(snapshot_interval=8)
    req = Request("r", tokens=seq(10, 30), max_new_tokens=1)
    req.cache = mgr.create_cache(req.tokens, max_reuse_tokens=29)
    mgr.mark_context_request(req)
    assert req.snapshot_points == (8, 16, 24, 28)
    assert req.midchunk_snapshot_alignment == HybridCacheManager.MIDCHUNK_SNAPSHOT_ALIGNMENT == 64
    assert req.midchunk_pass_point == 8
    req.num_computed_tokens = 24
    mgr.mark_context_request(req)
    assert req.snapshot_points == (28,) and req.midchunk_pass_point is None  # the last point passes by itself
    req.num_computed_tokens = 28
    mgr.mark_context_request(req)
    assert req.snapshot_points == () and req.midchunk_snapshot_alignment is None


def test_marks_take_requested_points_and_the_exact_prompt_length():
    mgr = make()
    req = Request("k", block_keys=[11, 12, 13], prompt_len=14, max_new_tokens=1)
    req.cache = mgr.create_cache(block_keys=req.block_keys, max_reuse_tokens=13)
    req.requested_snapshot_points.add(6)
    mgr.mark_context_request(req)
    assert req.snapshot_points == (4, 12)  # asked 6 -> 4; the prompt's last block boundary is 12
    assert mgr.counters.points_requested == 1


def test_no_midchunk_marks_with_two_recurrent_groups():
    draft_rec = LayerSpec(2, LifeCycle.recurrent(), state_bytes=32, owner=LayerOwner.DRAFT)
    mgr = make(pages=(32, 8, 8), layers=(FULL, REC, draft_rec))
    req = Request("r", tokens=seq(11, 30), max_new_tokens=1)
    req.cache = mgr.create_cache(req.tokens)
    req.requested_snapshot_points.add(8)
    mgr.mark_context_request(req)
    assert req.snapshot_points == (8, 28)
    assert req.midchunk_snapshot_alignment is None and req.midchunk_pass_point is None


def test_scheduler_runs_hybrid_requests_and_snapshots_land_at_the_marked_points():
    mgr = make(pages=(64, 16), snapshot_interval=8, midchunk_snapshot_alignment=4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_tokens=64))
    prompt = seq(12, 27)
    sched.add_request(Request("a", tokens=prompt, max_new_tokens=2))
    ends = []
    while sched.has_unfinished:
        batch = sched.schedule()
        ends += [s.start + s.num_tokens for s in batch.context]
        sched.on_step_done(batch)
        mgr.check_invariants()
    # Points 8, 16, 24: the first step passes 8 mid-chunk (the pass point) and ends at the next point, 16; the
    # second passes the last point, 24, and runs to the end. (Saving the passed points into the pending slot is
    # the runtime's part; the scheduler alone commits whole steps.)
    assert ends == [16, 27]
    assert 16 in snapshot_ends(mgr, prompt)


# --- pending snapshot slot ----------------------------------------------------------------------------------------


def pending_setup(**kw):
    mgr = make(**kw)
    prompt = seq(13, 24)
    cache = mgr.create_cache(prompt, priority_callback=lambda o, g: 70)
    cache.request_snapshot_point(8)
    return mgr, cache, prompt


def test_pending_page_moves_into_the_tree_with_the_cache_priority():
    mgr, cache, prompt = pending_setup()
    free = mgr.num_free_pages(G_REC)
    slot = cache.acquire_snapshot_slot()
    assert slot is not None and cache.pending_snapshot_slot == slot
    assert slot != cache.live_page(G_REC).index
    assert mgr.num_free_pages(G_REC) == free - 1
    mgr.check_invariants()
    assert cache.resize(capacity=16, history=16)  # the step ran to 16 and wrote the state at 8 into the slot
    cache.commit(prompt[:8], snapshot_from_pending=True)
    cache.commit(prompt[8:16])
    assert cache.pending_snapshot_slot is None
    block = mgr.tree.root(None).children[_key(mgr.tree.root(None).key, prompt[:4])]
    block = block.children[_key(block.key, prompt[4:8])]
    assert block.pages[G_REC].index == slot and block.pages[G_REC].priority == 70
    assert not any(c.dst_index == slot for c in mgr.take_pending_copies())  # the kernel wrote it: no copy
    assert mgr.counters.pending_committed == 1 and mgr.counters.points_requested_committed == 1
    mgr.check_invariants()
    cache.close()
    assert mgr.probe_reuse([*prompt[:9], 5, 5]) == 8


def test_old_ssm_names_still_work():
    # The vocabulary is "snapshot"; the earlier names stay for existing callers and behave the same.
    mgr, cache, prompt = pending_setup()
    slot = cache.acquire_ssm_snapshot_slot()
    assert slot is not None and cache.pending_ssm_snapshot_slot == slot == cache.pending_snapshot_slot
    assert cache.resize(capacity=16, history=16)
    cache.commit(prompt[:8], ssm_from_pending=True)
    assert cache.pending_snapshot_slot is None and mgr.counters.pending_committed == 1
    assert cache.acquire_ssm_snapshot_slot() is not None and cache.release_ssm_snapshot_slot()
    assert not cache.release_ssm_snapshot_slot()
    mgr.check_invariants()


def test_hybrid_caches_and_manager_satisfy_the_scheduler_seams():
    from kvforge.scheduling.seams import ContextMarker, PrefixWaitCounter, SnapshotSlotCache

    mgr, cache, _ = pending_setup()
    assert isinstance(mgr, ContextMarker) and isinstance(mgr, PrefixWaitCounter)
    assert isinstance(cache, SnapshotSlotCache)
    base = KVCacheManager(mgr.config)
    assert not isinstance(base, ContextMarker) and not isinstance(base.create_cache(), SnapshotSlotCache)


@pytest.mark.parametrize("case", ["covered", "no_point", "mid_block", "error"])
def test_pending_page_is_released_when_the_commit_records_no_snapshot(case):
    mgr, cache, prompt = pending_setup()
    if case == "covered":
        other = mgr.create_cache(prompt)
        prefill(other, prompt, [8])  # the same block gets its snapshot from another request first
        other.close()
        cache.close()
        cache = mgr.create_cache([*prompt[:12], 1, 2, 3], reuse=False)
        cache.request_snapshot_point(8)
    free = mgr.num_free_pages(G_REC)
    assert cache.acquire_snapshot_slot() is not None
    assert cache.resize(capacity=16, history=16)
    if case == "error":
        with pytest.raises(CacheStateError, match="past its history"):
            cache.commit(prompt[:17], snapshot_from_pending=True)
    else:
        n = {"covered": 8, "no_point": 4, "mid_block": 6}[case]
        cache.commit(prompt[:n], snapshot_from_pending=True)
    assert cache.pending_snapshot_slot is None
    assert mgr.num_free_pages(G_REC) == free
    assert mgr.counters.pending_released == 1 and mgr.counters.pending_committed == 0
    mgr.check_invariants()


def test_pending_commit_misuse_raises_and_changes_nothing():
    mgr, cache, prompt = pending_setup()
    assert cache.resize(capacity=8, history=8)
    with pytest.raises(CacheStateError, match="no pending"):
        cache.commit(prompt[:8], snapshot_from_pending=True)
    cache.acquire_snapshot_slot()
    before = mgr.state_snapshot()
    with pytest.raises(CacheStateError, match="is_end"):
        cache.commit(prompt[:8], snapshot_from_pending=True, is_end=True)
    assert mgr.state_snapshot() == before and cache.pending_snapshot_slot is not None
    with pytest.raises(CacheStateError, match="already holds"):
        cache.acquire_snapshot_slot()
    assert mgr.state_snapshot() == before


@pytest.mark.parametrize("how", ["suspend", "stop_committing", "close", "release"])
def test_suspend_stop_close_and_release_give_the_pending_page_back(how):
    mgr, cache, _ = pending_setup()
    free = mgr.num_free_pages(G_REC)
    slot = cache.acquire_snapshot_slot()
    getattr(cache, {"release": "release_snapshot_slot"}.get(how, how))()
    assert cache.pending_snapshot_slot is None
    # The cache's live page (and the slot) are back too after suspend/close.
    back = free + (1 if how in ("suspend", "close") else 0)
    assert mgr.num_free_pages(G_REC) == back
    assert slot in [p.index for p in mgr.pool(G_REC).free]
    mgr.check_invariants()
    assert cache.release_snapshot_slot() is False


def test_acquire_returns_none_when_not_committing_or_out_of_pages():
    mgr, cache, _ = pending_setup(pages=(32, 2))
    cache.stop_committing()
    assert cache.acquire_snapshot_slot() is None
    other = mgr.create_cache(seq(14, 4))  # takes the last recurrent page as its live state
    cache.close()
    c3 = mgr.create_cache(seq(16, 4))
    assert mgr.num_available_pages(G_REC) == 0  # both pages are live states: nothing to evict
    assert c3.acquire_snapshot_slot() is None
    assert other.acquire_snapshot_slot() is None
    mgr.check_invariants()


def test_acquire_raises_unless_exactly_one_recurrent_group_and_an_active_cache():
    draft_rec = LayerSpec(2, LifeCycle.recurrent(), state_bytes=32, owner=LayerOwner.DRAFT)
    mgr = make(pages=(32, 8, 8), layers=(FULL, REC, draft_rec))
    cache = mgr.create_cache(seq(17, 8))
    with pytest.raises(CacheStateError, match="exactly one"):
        cache.acquire_snapshot_slot()
    mgr2 = make()
    c2 = mgr2.create_cache(seq(18, 8))
    c2.suspend()
    with pytest.raises(CacheStateError, match="suspended"):
        c2.acquire_snapshot_slot()


def test_sanity_check_catches_a_pending_page_that_is_a_live_page():
    mgr, cache, _ = pending_setup()
    cache.acquire_snapshot_slot()
    mgr.check_invariants()
    real = cache._pending
    cache._pending = cache._live[G_REC]
    with pytest.raises(AssertionError):
        mgr.check_invariants()
    cache._pending = real
    mgr.check_invariants()


# --- sequence ends ------------------------------------------------------------------------------------------------


def test_close_turns_the_live_page_into_the_snapshot_without_a_copy():
    mgr = make()
    prompt = seq(19, 10)
    cache = mgr.create_cache(prompt)
    prefill(cache, prompt, [10])
    live = cache.live_page(G_REC).index
    mgr.take_pending_copies()
    cache.close()
    assert mgr.take_pending_copies() == []
    tail = next(b for b in mgr.tree.blocks() if b.num_tokens == 2)
    assert tail.pages[G_REC].index == live
    mgr.check_invariants()


def test_suspend_leaves_a_snapshot_so_resume_succeeds():
    mgr = make()
    prompt = seq(20, 14)
    cache = mgr.create_cache(prompt)
    prefill(cache, prompt, [6])  # 6 is no point: without the end snapshot, resume could not find a state at 6
    cache.suspend()
    mgr.check_invariants()
    assert cache.resume() and cache.num_committed_tokens == 6
    mgr.check_invariants()


def test_is_end_inserts_the_tail_now_and_stops_committing():
    mgr = make()
    prompt = seq(21, 10)
    cache = mgr.create_cache(prompt)
    assert cache.resize(10, 10)
    cache.commit(prompt, is_end=True)
    assert not cache.committing
    assert mgr.probe_reuse(prompt) == 10
    mgr.check_invariants()
    cache.suspend()
    assert cache.resume() and cache.num_committed_tokens == 10
    mgr.check_invariants()
    cache.close()
    mgr.check_invariants()


# --- short-prompt priorities --------------------------------------------------------------------------------------


def test_short_prompts_get_recurrent_pages_at_priority_zero_and_L_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="kvforge.kvcache.hybrid"):
        mgr = make(policy=HybridCachePolicy(low_priority_snapshot_prompt_len=10))
        short, long_ = seq(22, 8), seq(23, 12)
        for p in (short, long_):
            c = mgr.create_cache(p)
            prefill(c, p, [len(p)])
            c.close()
    lines = [r for r in caplog.records if "low_priority_snapshot_prompt_len" in r.getMessage()]
    assert len(lines) == 1 and "10" in lines[0].getMessage()

    def last_block(p):
        node = mgr.tree.root(None)
        for i in range(len(p) // TPB):
            node = node.children[_key(node.key, p[i * TPB : (i + 1) * TPB])]
        return node

    assert last_block(short).pages[G_REC].priority == 0
    assert last_block(short).pages[0].priority == mgr.default_priority
    assert last_block(long_).pages[G_REC].priority == mgr.default_priority


@pytest.mark.parametrize("threshold", [0, 10])
def test_eviction_order_of_short_and_long_prompt_snapshots(threshold):
    # Two recurrent pages left for snapshots once one live page is taken: a long prompt's snapshot, then a more
    # recent short prompt's. The next allocation evicts one of them.
    mgr = make(pages=(64, 3), policy=HybridCachePolicy(low_priority_snapshot_prompt_len=threshold))
    long_, short = seq(24, 12), seq(25, 8)
    for p in (long_, short):
        c = mgr.create_cache(p)
        prefill(c, p, [len(p)])
        c.close()
    assert snapshot_ends(mgr, long_) == [12] and snapshot_ends(mgr, short) == [8]
    c = mgr.create_cache(seq(26, 8))
    prefill(c, seq(26, 8), [8])  # its snapshot needs a page: one of the two is evicted
    mgr.check_invariants()
    if threshold:
        assert snapshot_ends(mgr, long_) == [12] and snapshot_ends(mgr, short) == []  # short goes first
    else:
        assert snapshot_ends(mgr, long_) == [] and snapshot_ends(mgr, short) == [8]  # plain LRU: the older one


def test_key_mode_short_rule_waits_for_the_exact_length():
    mgr = make(policy=HybridCachePolicy(low_priority_snapshot_prompt_len=10))
    # 2 full blocks (8 tokens) but a 11-token prompt: not short, although the keys alone say 8.
    req = Request("k", block_keys=[1, 2], prompt_len=11, max_new_tokens=1)
    req.cache = mgr.create_cache(block_keys=req.block_keys)
    assert req.cache.priority_callback is None
    mgr.mark_context_request(req)
    assert req.cache.priority_callback is None
    req2 = Request("s", block_keys=[3, 4], prompt_len=9, max_new_tokens=1)
    req2.cache = mgr.create_cache(block_keys=req2.block_keys)
    mgr.mark_context_request(req2)
    assert req2.cache.priority_callback(0, G_REC) == 0 and req2.cache.priority_callback(0, 0) == 35


# --- counters -----------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_counters_are_logged_at_most_once_a_minute(caplog):
    clock = FakeClock()
    mgr = make(clock=clock)
    with caplog.at_level(logging.INFO, logger="kvforge.kvcache.hybrid"):
        for t in (0.0, 10.0, 59.0):
            clock.t = 1000.0 + t
            mgr.count_prefix_waits([object()])
        lines = [r for r in caplog.records if "counters" in r.getMessage()]
        assert len(lines) == 1 and "prefix_waits 1" in lines[0].getMessage()
        clock.t = 1061.0
        mgr.count_prefix_waits([object(), object()])
        lines = [r for r in caplog.records if "counters" in r.getMessage()]
    assert len(lines) == 2 and "prefix_waits 5" in lines[1].getMessage()
    assert mgr.counters.prefix_waits == 5
