"""Random sequences of hybrid-cache operations: commits, pending snapshot acquire / commit / release, suspend /
resume, stop committing, close, explicit eviction and snapshot-point requests, over small pools (so eviction and
out-of-pages happen). After every step the manager's invariant check runs (the base manager's, plus the pending
slot's sanity check), and every recurrent page is owned exactly once: free, a live state, a pending slot or a
tree snapshot."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from kvforge.errors import CacheStateError, OutOfPagesError  # noqa: E402
from kvforge.kvcache import HybridCachePolicy, KVCacheConfig, LayerSpec, LifeCycle, TierConfig  # noqa: E402
from kvforge.kvcache.hybrid import HybridCacheManager  # noqa: E402
from kvforge.kvcache.snapshot_policy import KIMI_K3_LIKE, cost_aware_eviction  # noqa: E402

TPB = 4
G_REC = 1
BASES = [[(5 * i + 3 * j) % 13 for j in range(40)] for i in range(3)]


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        cost=st.booleans(),
        short=st.sampled_from([0, 12]),
        interval=st.sampled_from([0, 4, 8]),
    )
    def setup(self, cost, short, interval):
        cfg = KVCacheConfig(
            TPB,
            (LayerSpec(0, bytes_per_token=2), LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)),
            (TierConfig(pages=(14, 6)),),
        )
        self.mgr = HybridCacheManager(
            cfg,
            policy=HybridCachePolicy(low_priority_snapshot_prompt_len=short),
            snapshot_interval=interval,
            eviction_policy=cost_aware_eviction(KIMI_K3_LIKE, TPB) if cost else None,
            clock=lambda: 0.0,
        )
        self.caches = []  # (cache, tokens)

    def _pick(self, i):
        return self.caches[i % len(self.caches)]

    @rule(base=st.integers(0, 2), n=st.integers(1, 30), cap=st.booleans())
    def create(self, base, n, cap):
        tokens = BASES[base][:n]
        try:
            cache = self.mgr.create_cache(tokens, max_reuse_tokens=n - 1 if cap else None)
        except OutOfPagesError:
            return
        self.caches.append((cache, tokens))

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99), n=st.integers(1, 9), align=st.booleans())
    def forward(self, i, n, align):
        cache, tokens = self._pick(i)
        if not cache.is_active:
            return
        h = min(len(tokens), cache.history + n)
        if align and h - h % TPB > cache.history:
            h -= h % TPB  # steps that end at block boundaries are where live snapshots happen
        if h > cache.history:
            cache.resize(capacity=max(cache.capacity, h), history=h)

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99), n=st.integers(0, 9), pending=st.booleans(), end=st.booleans(), align=st.booleans())
    def commit(self, i, n, pending, end, align):
        cache, tokens = self._pick(i)
        c = cache.num_committed_tokens
        k = min(n, cache.history - c) if cache.is_active else n
        if align and cache.is_active and (c + k) % TPB and (c + k) - (c + k) % TPB > c:
            k -= (c + k) % TPB  # a commit that ends at a block boundary (a pending snapshot can land there)
        had = cache.pending_snapshot_slot is not None
        try:
            cache.commit(tokens[c : c + k], snapshot_from_pending=pending, is_end=end and not pending)
        except CacheStateError:
            # Only misuse raises here (k never passes the history): not active, stopped, or no pending page.
            assert not cache.is_active or not cache.committing or (pending and not had)
        if pending:
            assert cache.pending_snapshot_slot is None

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99), blocks=st.integers(1, 4), mid=st.integers(0, 3))
    def runtime_step(self, i, blocks, mid):
        """The runtime's protocol: a step to a block boundary that saves the state at an earlier boundary into
        the pending slot, commits up to it from the slot, then commits the rest."""
        cache, tokens = self._pick(i)
        if not cache.is_active or not cache.committing or cache.history != cache.num_committed_tokens:
            return
        c = cache.num_committed_tokens
        end = min(len(tokens), (c // TPB + blocks) * TPB)
        point = (c // TPB + 1 + mid) * TPB
        if end <= c or not cache.resize(capacity=max(cache.capacity, end), history=end):
            return
        if c < point < end and cache.pending_snapshot_slot is None and cache.acquire_snapshot_slot() is not None:
            cache.request_snapshot_point(point)
            cache.commit(tokens[c:point], snapshot_from_pending=True)
            assert cache.pending_snapshot_slot is None
        cache.commit(tokens[cache.num_committed_tokens : end])

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99))
    def acquire(self, i):
        cache, _ = self._pick(i)
        had = cache.pending_snapshot_slot
        try:
            slot = cache.acquire_snapshot_slot()
        except CacheStateError:
            assert had is not None or not cache.is_active
            assert cache.pending_snapshot_slot == had
            return
        assert had is None
        assert slot == cache.pending_snapshot_slot
        if slot is None:
            assert not cache.committing or self.mgr.num_available_pages(G_REC) == 0

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        cache, _ = self._pick(i)
        had = cache.pending_snapshot_slot is not None
        assert cache.release_snapshot_slot() is had
        assert cache.pending_snapshot_slot is None

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99), pos=st.integers(1, 40))
    def ask_point(self, i, pos):
        cache, _ = self._pick(i)
        if cache.is_active:
            cache.request_snapshot_point(pos)

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 99), op=st.sampled_from(["suspend", "resume", "stop_committing", "close"]))
    def lifecycle(self, i, op):
        cache, _ = self._pick(i)
        try:
            getattr(cache, op)()
        except CacheStateError:
            return
        if op != "resume":
            assert cache.pending_snapshot_slot is None
        if op == "close":
            self.caches = [(c, t) for c, t in self.caches if c is not cache]

    @rule(group=st.integers(0, 1), n=st.integers(1, 4))
    def evict(self, group, n):
        self.mgr.evict(group, n)

    @invariant()
    def invariants(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        pool = self.mgr.pool(G_REC)
        owners = {}
        for p in pool.free:
            owners.setdefault(id(p), []).append("free")
        for cache in self.mgr.caches:
            if cache.live_page(G_REC) is not None:
                owners.setdefault(id(cache.live_page(G_REC)), []).append("live")
            if cache.pending_snapshot_page is not None:
                owners.setdefault(id(cache.pending_snapshot_page), []).append("pending")
                assert cache.is_active
        for b in self.mgr.tree.blocks():
            if b.pages[G_REC] is not None:
                owners.setdefault(id(b.pages[G_REC]), []).append("tree")
        assert len(owners) == pool.capacity, "a recurrent page is owned by nobody (leaked)"
        assert all(len(v) == 1 for v in owners.values()), "a recurrent page is owned twice"


HybridMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_hybrid_state_machine = HybridMachine.TestCase
