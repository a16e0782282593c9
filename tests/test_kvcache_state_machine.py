"""Random sequences of cache operations over small pools, against a simulated device memory.

The machine drives create (with reuse) / forward steps / commit / resize / suspend / resume / stop committing /
close / explicit eviction / probes, with misuse mixed in. After every step the manager's own invariant check
runs (no page leaked or free twice, exact ref counts, policy membership, tree shape). Beyond bookkeeping, a
fake device executes the manager's page copies and the forward steps' writes, so every reuse is checked by
content: a cache that reuses a prefix must find exactly that prefix's tokens in its pages (and the exact
recurrent state in its live page). Failed operations and probes must leave the full state snapshot unchanged.
"""

from __future__ import annotations

import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvforge.errors import CacheStateError, OutOfPagesError  # noqa: E402
from kvforge.kvcache import (  # noqa: E402
    CacheStatus,
    KVCache,
    KVCacheConfig,
    KVCacheManager,
    LayerSpec,
    LifeCycle,
    PageCopy,
    Tier,
    TierConfig,
)
from kvforge.kvcache.events import BlockRemoved, BlockStored  # noqa: E402

TPB = 4
BASES = [[(7 * i + j) % 11 for j in range(40)] for i in range(3)]


class SnapshottingCache(KVCache):
    """Takes a recurrent snapshot whenever a block is inserted exactly at the cache's history (the state the
    live page holds then), the way the hybrid manager's caches do through this hook."""

    __slots__ = ()

    def _snapshot_pages(self, block, ordinal):
        mgr = self.manager
        end = ordinal * mgr.tokens_per_block + block.num_tokens
        if self.history != end:
            return {}
        out = {}
        for g in mgr.recurrent_groups:
            page = mgr.block_pool.alloc_page(g)
            if page is None:
                continue
            live = self.live_page(g)
            mgr.block_pool.record_copy(PageCopy(g, Tier.GPU, live.index, Tier.GPU, page.index))
            out[g] = page
        return out


class SnapshottingManager(KVCacheManager):
    cache_class = SnapshottingCache


def _config(variant: str) -> tuple[KVCacheConfig, type[KVCacheManager]]:
    full = LayerSpec(0, bytes_per_token=2)
    if variant == "full":
        return KVCacheConfig(TPB, (full,), (TierConfig(pages=10),)), KVCacheManager
    if variant == "full+host":
        return KVCacheConfig(TPB, (full,), (TierConfig(pages=8), TierConfig(Tier.HOST, pages=5))), KVCacheManager
    if variant == "swa+host":
        swa = LayerSpec(1, LifeCycle.sliding(window=6, sink_tokens=2), bytes_per_token=2)
        tiers = (TierConfig(pages=(10, 8)), TierConfig(Tier.HOST, pages=(4, 3)))
        return KVCacheConfig(TPB, (full, swa), tiers), KVCacheManager
    if variant == "recurrent":
        rec = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)
        return KVCacheConfig(TPB, (full, rec), (TierConfig(pages=(10, 7)),)), SnapshottingManager
    raise AssertionError(variant)


class Model:
    """What the test knows about one cache: its whole token stream."""

    def __init__(self, cache, stream: list[int]) -> None:
        self.cache = cache
        self.stream = stream


class CacheMachine(RuleBasedStateMachine):
    caches = Bundle("caches")

    @initialize(variant=st.sampled_from(["full", "full+host", "swa+host", "recurrent"]), seed=st.integers(0, 2**16))
    def setup(self, variant: str, seed: int) -> None:
        config, cls = _config(variant)
        self.live_keys: set[int] = set()
        self.mgr = cls(config, event_sink=self.on_event)
        self.rng = random.Random(seed)
        self.mem: dict[tuple, object] = {}
        self.models: list[Model] = []

    def on_event(self, event) -> None:
        if isinstance(event, BlockStored):
            assert self.live_keys.isdisjoint(event.block_keys), "a block was announced twice"
            self.live_keys.update(event.block_keys)
        elif isinstance(event, BlockRemoved):
            assert self.live_keys.issuperset(event.block_keys), "a block was removed without being stored"
            self.live_keys.difference_update(event.block_keys)

    # --- the simulated device -------------------------------------------------------------------------------

    def run_copies(self) -> None:
        for c in self.mgr.take_pending_copies():
            event(f"copy {c.src_tier.name}->{c.dst_tier.name}")
            src = self.mem.get((c.src_tier, c.group, c.src_index))
            key = (c.dst_tier, c.group, c.dst_index)
            if self.mgr.groups[c.group].life_cycle.is_attention:
                dst = list(self.mem.get(key) or [None] * TPB)
                n = TPB if c.num_tokens is None else c.num_tokens
                dst[:n] = (src or [None] * TPB)[:n]
                self.mem[key] = dst
            else:
                self.mem[key] = src

    def write(self, m: Model, lo: int, hi: int) -> None:
        """The forward step: KV of positions lo..hi-1, and the recurrent state after hi tokens."""
        cache = self.mgr
        for g in cache.attention_groups:
            pages = m.cache.pages(g)
            for pos in range(lo, hi):
                p = pages[pos // TPB]
                if p is None:
                    continue
                key = (Tier.GPU, g, p.index)
                row = list(self.mem.get(key) or [None] * TPB)
                row[pos % TPB] = m.stream[pos]
                self.mem[key] = row
        for g in cache.recurrent_groups:
            self.mem[(Tier.GPU, g, m.cache.live_page(g).index)] = tuple(m.stream[:hi])

    def clean(self, op) -> bool:
        """Run an operation that a faulty priority callback may make fail; a failure must change nothing."""
        before = self.mgr.state_snapshot()
        try:
            op()
        except ValueError as e:
            assert "priority_callback" in str(e)
            assert self.mgr.state_snapshot() == before
            event("faulty callback refused cleanly")
            return False
        return True

    def zero_state_if_fresh(self, m: Model) -> None:
        """A cache that starts from nothing gets a zero recurrent state (the runtime's job, not the manager's)."""
        if m.cache.num_committed_tokens == 0:
            self.run_copies()
            for g in self.mgr.recurrent_groups:
                self.mem[(Tier.GPU, g, m.cache.live_page(g).index)] = ()

    def check_content(self, m: Model, upto: int) -> None:
        """Every page the cache holds has the right tokens for positions < upto (and the exact live state)."""
        self.run_copies()
        for g in self.mgr.attention_groups:
            for b, p in enumerate(m.cache.pages(g)):
                if p is None:
                    continue
                row = self.mem.get((Tier.GPU, g, p.index)) or [None] * TPB
                for pos in range(b * TPB, min(upto, (b + 1) * TPB)):
                    assert row[pos % TPB] == m.stream[pos], f"group {g} position {pos}: stale data in {p!r}"
        for g in self.mgr.recurrent_groups:
            assert self.mem.get((Tier.GPU, g, m.cache.live_page(g).index), ()) == tuple(m.stream[:upto])

    def prompt(self) -> list[int]:
        base = self.rng.choice(BASES)
        cut = self.rng.randrange(0, 30)
        tail = [self.rng.randrange(11) for _ in range(self.rng.randrange(0, 12))]
        return base[:cut] + tail

    # --- rules -------------------------------------------------------------------------------------------------

    @rule(
        target=caches,
        scope=st.sampled_from([None, "lora-1", "new-scope"]),
        reuse=st.booleans(),
        cap=st.booleans(),
        with_cb=st.sampled_from(["none", "good", "faulty"]),
        room=st.integers(0, 12),
    )
    def create(self, scope, reuse, cap, with_cb, room):
        stream = self.prompt() + [self.rng.randrange(11) for _ in range(30)]
        prompt_len = self.rng.randrange(0, 30)
        prompt = stream[:prompt_len]
        limit = max(0, prompt_len - 1) if cap else None
        probed = self.mgr.probe_reuse(prompt, scope, max_reuse_tokens=limit) if reuse else 0
        before = self.mgr.state_snapshot()
        plan = self.mgr.plan_admission(prompt, scope=scope, capacity=room, reuse=reuse, max_reuse_tokens=limit)
        assert self.mgr.state_snapshot() == before
        assert plan.reused_tokens == probed
        cb = None
        if with_cb == "good":
            cb = lambda ordinal, group: (ordinal * 13 + group * 7) % 101
        elif with_cb == "faulty":
            # Out of range for block 2: every commit, suspend or close that asks about it must fail cleanly.
            cb = lambda ordinal, group: 150 if ordinal == 2 else 40
        try:
            cache = self.mgr.create_cache(
                prompt, scope=scope, reuse=reuse, max_reuse_tokens=limit, priority_callback=cb, capacity=room
            )
        except OutOfPagesError:
            assert not plan.fits
            assert self.mgr.state_snapshot() == before
            return multiple()
        assert plan.fits
        assert cache.capacity == max(room, probed) and cache.history == probed
        assert cache.num_committed_tokens == probed
        event(
            "create: reused a partial block"
            if probed % TPB
            else "create: reused whole blocks"
            if probed
            else "create: no reuse"
        )
        m = Model(cache, stream)
        self.models.append(m)
        self.zero_state_if_fresh(m)
        self.check_content(m, probed)
        return m

    @rule(target=caches, scope=st.sampled_from([None, "lora-1"]), keep=st.booleans())
    def serve(self, scope, keep):
        """A whole request: create with reuse, compute and commit its prompt, then close (or keep it running)."""
        stream = self.prompt() + [self.rng.randrange(11) for _ in range(30)]
        prompt = stream[: self.rng.randrange(1, 30)]
        try:
            cache = self.mgr.create_cache(prompt, scope=scope, max_reuse_tokens=len(prompt) - 1)
        except OutOfPagesError:
            return multiple()
        m = Model(cache, stream)
        self.models.append(m)
        self.zero_state_if_fresh(m)
        self.check_content(m, cache.num_committed_tokens)
        event("serve: reused" if cache.num_committed_tokens else "serve: no reuse")
        start = cache.history
        if cache.resize(capacity=len(prompt), history=len(prompt)):
            self.run_copies()
            self.write(m, start, len(prompt))
            cache.commit(prompt[cache.num_committed_tokens :])
        if keep:
            return m
        cache.close()
        self.models.remove(m)
        return multiple()

    @rule(m=caches, k=st.integers(1, 9))
    def step(self, m, k):
        cache = m.cache
        if cache.status is not CacheStatus.ACTIVE:
            return
        h = cache.history
        k = min(k, len(m.stream) - h)
        if k <= 0:
            return
        before = self.mgr.state_snapshot()
        if not cache.resize(capacity=max(cache.capacity, h + k), history=h + k):
            assert self.mgr.state_snapshot() == before
            return
        self.run_copies()
        self.write(m, h, h + k)

    @rule(m=caches, k=st.integers(0, 9))
    def commit(self, m, k):
        cache = m.cache
        if cache.status is not CacheStatus.ACTIVE or not cache.committing:
            return
        c = cache.num_committed_tokens
        k = min(k, cache.history - c)
        if not self.clean(lambda: cache.commit(m.stream[c : c + k])):
            return
        assert cache.num_committed_tokens == c + k

    @rule(m=caches, delta=st.integers(-6, 6))
    def resize_capacity(self, m, delta):
        cache = m.cache
        if cache.status is not CacheStatus.ACTIVE:
            return
        new = cache.capacity + delta
        before = self.mgr.state_snapshot()
        if new < cache.history:
            with pytest.raises((CacheStateError, ValueError)):
                cache.resize(capacity=new)
            assert self.mgr.state_snapshot() == before
            return
        if not cache.resize(capacity=new):
            assert self.mgr.state_snapshot() == before
        else:
            assert cache.capacity == new

    @rule(m=caches, back=st.integers(0, 5))
    def rewind(self, m, back):
        cache = m.cache
        if cache.status is not CacheStatus.ACTIVE:
            return
        target = cache.history - back
        before = self.mgr.state_snapshot()
        if target < cache.num_committed_tokens:
            with pytest.raises(CacheStateError if target >= 0 else ValueError):
                cache.resize(history=target)
            assert self.mgr.state_snapshot() == before
        else:
            assert cache.resize(history=target)

    @rule(m=caches)
    def suspend(self, m):
        if m.cache.status is not CacheStatus.ACTIVE:
            before = self.mgr.state_snapshot()
            with pytest.raises(CacheStateError):
                m.cache.suspend()
            assert self.mgr.state_snapshot() == before
            return
        if self.clean(m.cache.suspend):
            assert m.cache.history == m.cache.capacity == m.cache.num_committed_tokens

    @rule(m=caches)
    def resume(self, m):
        cache = m.cache
        before = self.mgr.state_snapshot()
        if cache.status is not CacheStatus.SUSPENDED:
            with pytest.raises(CacheStateError):
                cache.resume()
            assert self.mgr.state_snapshot() == before
            return
        if cache.resume():
            event("resume: succeeded")
            assert cache.status is CacheStatus.ACTIVE
            self.zero_state_if_fresh(m)
            self.check_content(m, cache.num_committed_tokens)
        else:
            assert self.mgr.state_snapshot() == before

    @rule(m=caches)
    def stop_committing(self, m):
        if m.cache.status is CacheStatus.CLOSED:
            with pytest.raises(CacheStateError):
                m.cache.stop_committing()
            return
        m.cache.stop_committing()
        if m.cache.status is CacheStatus.ACTIVE and m.cache.history > m.cache.num_committed_tokens:
            before = self.mgr.state_snapshot()
            with pytest.raises(CacheStateError):
                m.cache.commit(m.stream[m.cache.num_committed_tokens : m.cache.num_committed_tokens + 1])
            assert self.mgr.state_snapshot() == before

    @rule(m=consumes(caches))
    def close(self, m):
        if not self.clean(m.cache.close):
            m.cache.priority_callback = None
            m.cache.close()
        before = self.mgr.state_snapshot()
        with pytest.raises(CacheStateError):
            m.cache.close()
        with pytest.raises(CacheStateError):
            m.cache.resize(capacity=1)
        assert self.mgr.state_snapshot() == before
        self.models.remove(m)

    @rule(group=st.integers(0, 1), n=st.integers(0, 4), host=st.booleans())
    def evict(self, group, n, host):
        if group >= self.mgr.num_groups:
            return
        tier = Tier.HOST if host and len(self.mgr.tiers) > 1 else Tier.GPU
        locked_before = self.mgr.pool(group, tier).num_locked
        self.mgr.evict(group, n, tier)
        assert self.mgr.pool(group, tier).num_locked == locked_before

    @rule(scope=st.sampled_from([None, "lora-1"]))
    def probe(self, scope):
        before = self.mgr.state_snapshot()
        self.mgr.probe_reuse(self.prompt(), scope)
        assert self.mgr.state_snapshot() == before

    @precondition(lambda self: bool(self.models))
    @rule()
    def copies(self):
        self.run_copies()

    @invariant()
    def consistent(self):
        self.mgr.check_invariants()
        full = {b.key for b in self.mgr.tree.blocks() if b.num_tokens == TPB}
        assert full == self.live_keys, "the router's view from events differs from the tree"

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for m in list(self.models):
            m.cache.priority_callback = None
            m.cache.close()
        self.mgr.check_invariants()
        for tier in self.mgr.tiers:
            for g in range(self.mgr.num_groups):
                pool = self.mgr.pool(g, tier)
                assert all(p.ref_count == 0 for p in pool.pages), "a page is still referenced after every close"
                assert pool.num_free + pool.n_unlocked == pool.capacity


TestCacheMachine = CacheMachine.TestCase
# More examples than the profile's default: the interesting interleavings (eviction to host and back, resume after
# partial eviction) need a populated tree; this stays a few seconds on the CI machine.
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
