"""The cost-aware snapshot eviction policies: the GreedyDual one's value functions on hand-built tree blocks, and the
hit-density one on small real hybrid managers (4-token blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvforge.errors import OutOfPagesError
from kvforge.kvcache import HybridCachePolicy, KVCacheConfig, LayerSpec, LifeCycle, LifeCycleKind, TierConfig
from kvforge.kvcache.eviction import PrioritizedLRU
from kvforge.kvcache.hashing import default_hasher
from kvforge.kvcache.hybrid import HybridCacheManager
from kvforge.kvcache.pools import Page
from kvforge.kvcache.radix import Block
from kvforge.kvcache.snapshot_policy import (
    KIMI_K3_LIKE,
    CostAwareSnapshotPolicy,
    HitDensitySnapshotPolicy,
    SnapshotAwareLRU,
    cost_aware_eviction,
    snapshot_aware_eviction,
)


def _key(parent: int, block) -> int:
    return default_hasher().block_keys(list(block), len(block), parent=parent)[0]


TPB = 4
G = 1  # the recurrent group's slot in Block.pages
POOL = SimpleNamespace(group=G)


def square(tokens: int) -> float:
    return float(tokens * tokens)


def chain(parent: Block, n: int, tag: int) -> list[Block]:
    """``n`` full blocks below ``parent``, each the only child of the previous one."""
    out = []
    for i in range(n):
        b = Block(hash((tag, i)), parent, parent.depth + 1, TPB, None, 2)
        parent.children[b.key] = b
        out.append(b)
        parent = b
    return out


def snapshot(block: Block, index: int, priority: int = 35) -> Page:
    page = Page(POOL, index)  # type: ignore[arg-type]
    page.block = block
    page.priority = priority
    block.pages[G] = page
    return page


def root() -> Block:
    return Block(0, None, -1, 0, None, 2)


def drain(policy: CostAwareSnapshotPolicy) -> list[Page]:
    out = []
    while (p := policy.pop_victim()) is not None:
        out.append(p)
    return out


def test_marginal_value_evicts_a_snapshot_close_to_its_parent_snapshot_first():
    r = root()
    path = chain(r, 9, tag=1)  # A ends at 32 tokens, B at 36 (one block further)
    other = chain(r, 6, tag=2)  # C ends at 24 tokens with no snapshot below it
    a, b, c = snapshot(path[7], 0), snapshot(path[8], 1), snapshot(other[5], 2)
    pol = CostAwareSnapshotPolicy(square, TPB, marginal=True)
    assert pol.value(b) == 36**2 - 32**2 and pol.value(c) == 24**2 and pol.value(a) == 32**2
    for p in (a, b, c):
        pol.add(p)
    # B saves only the 4 tokens past A: it goes first, although its whole prefix is the longest.
    assert pol.ordered() == [b, c, a]
    plain = CostAwareSnapshotPolicy(square, TPB)
    for p in (a, b, c):
        p.policy_data = None
    for p in (a, b, c):
        plain.add(p)
    assert plain.ordered() == [c, a, b]


def test_a_victim_whose_parent_snapshot_went_is_rescored_before_it_is_evicted():
    r = root()
    path = chain(r, 9, tag=1)
    other = chain(r, 6, tag=2)
    a, b, c = snapshot(path[7], 0), snapshot(path[8], 1), snapshot(other[5], 2)
    pol = CostAwareSnapshotPolicy(square, TPB, marginal=True)
    for p in (a, b, c):
        pol.add(p)
    # A leaves the tree some other way (e.g. its block is dropped): B now stands for its whole prefix.
    pol.discard(a)
    path[7].pages[G] = None
    a.block = None
    assert drain(pol) == [c, b]


def test_a_new_snapshot_supersedes_the_one_above_it_on_an_unbranched_path():
    r = root()
    path = chain(r, 6, tag=1)
    other = chain(r, 3, tag=2)
    a = snapshot(path[2], 0)  # turn 1 of a conversation: 12 tokens
    c = snapshot(other[2], 2)  # a one-off prompt of the same length
    pol = CostAwareSnapshotPolicy(square, TPB, frequency=True, marginal=True, supersede=True)
    pol.add(a)
    pol.add(c)
    pol.discard(a)  # turn 2 reuses A ...
    pol.add(a)
    assert pol.weight(a) == 2
    s = snapshot(path[5], 1)  # ... and leaves its own snapshot at 24 tokens
    pol.add(s)
    assert pol.weight(s) == 2 and pol.weight(a) == 0
    # The superseded turn goes first, the conversation's tip last.
    assert drain(pol) == [a, c, s]


def test_a_branch_point_snapshot_keeps_its_reuse_count():
    r = root()
    stem = chain(r, 2, tag=1)
    left = chain(stem[-1], 2, tag=2)
    right = chain(stem[-1], 2, tag=3)
    a = snapshot(stem[-1], 0)
    pol = CostAwareSnapshotPolicy(square, TPB, frequency=True, marginal=True, supersede=True)
    pol.add(a)
    pol.discard(a)
    pol.add(a)
    s1, s2 = snapshot(left[-1], 1), snapshot(right[-1], 2)
    pol.add(s1)
    pol.add(s2)
    assert pol.weight(a) == 2 and pol.weight(s1) == 1 and pol.weight(s2) == 1


def test_walk_is_bounded_and_arguments_are_checked():
    r = root()
    path = chain(r, 10, tag=1)
    a, b = snapshot(path[0], 0), snapshot(path[9], 1)
    pol = CostAwareSnapshotPolicy(square, TPB, marginal=True, max_walk=3)
    assert pol.value(b) == 40**2  # A is 9 blocks up, past the walk: B is valued as if nothing lay below it
    assert CostAwareSnapshotPolicy(square, TPB, marginal=True).value(b) == 40**2 - 4**2
    assert pol.value(a) == 4**2
    with pytest.raises(ValueError, match="max_walk"):
        CostAwareSnapshotPolicy(square, TPB, max_walk=0)
    with pytest.raises(TypeError, match="model"):
        cost_aware_eviction("kimi", TPB)  # type: ignore[arg-type]
    assert callable(cost_aware_eviction(KIMI_K3_LIKE, TPB, marginal=False, supersede=False))


# --- the hit-density policy on a real manager -------------------------------------------------------------------

FULL = LayerSpec(0, bytes_per_token=2)
REC = LayerSpec(1, LifeCycle.recurrent(), state_bytes=64)


def tokens(tag: int, n: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 1009 for i in range(n)]


def hit_density(dead_first: bool = False, **kw):
    """Factory: the hit-density policy (value = prefix tokens) for the recurrent pool; for attention LRU, or with
    ``dead_first`` the snapshot-aware LRU."""
    if dead_first:
        return snapshot_aware_eviction(lambda group, tier: HitDensitySnapshotPolicy(float, TPB, **kw))

    def factory(group, tier):
        if group.life_cycle.kind is LifeCycleKind.RECURRENT:
            return HitDensitySnapshotPolicy(float, TPB, **kw)
        return PrioritizedLRU(group, tier)

    return factory


def manager(snapshot_pages: int, factory, attention_pages: int = 512) -> HybridCacheManager:
    cfg = KVCacheConfig(TPB, (FULL, REC), (TierConfig(pages=(attention_pages, snapshot_pages)),))
    return HybridCacheManager(cfg, eviction_policy=factory)


def serve(mgr: HybridCacheManager, prompt: list[int]) -> int:
    """One request as the policy bench replays it: reuse, commit in steps ending at the snapshot points, close.
    Returns the reused tokens."""
    cache = mgr.create_cache(prompt, max_reuse_tokens=len(prompt) - 1)
    reused = cache.num_committed_tokens
    for end in sorted({*mgr.snapshot_points(cache, reused), len(prompt)}):
        done = cache.num_committed_tokens
        assert cache.resize(end, end)
        cache.commit(prompt[done:end])
    cache.close()
    mgr.check_invariants()
    return reused


def snapshot_page(mgr: HybridCacheManager, prompt: list[int], end: int) -> Page | None:
    node = mgr.tree.root(None)
    for i in range(end // TPB):
        node = node.children.get(_key(node.key, prompt[i * TPB : (i + 1) * TPB]))
        if node is None:
            return None
    return node.pages[G]


def conversations(mgr: HybridCacheManager, n: int, gap: int) -> list[int]:
    """Conversation ``i`` sends an 8-token turn, then ``gap`` conversations later a 16-token second turn that
    extends it: the first turn's snapshot is only ever reused ``gap`` requests after it was taken."""
    reused = []
    for i in range(n):
        reused.append(serve(mgr, tokens(1000 + i, 8)))
        if i >= gap:
            j = i - gap
            reused.append(serve(mgr, tokens(1000 + j, 8) + tokens(5000 + j, 8)))
    return reused


def test_hit_density_learns_to_keep_snapshots_until_their_late_reuse_which_lru_evicts_first():
    lru = conversations(manager(8, None), 30, gap=4)
    mgr = manager(8, hit_density(refresh_every=4))
    hd = conversations(mgr, 30, gap=4)
    # 7 slots in the tree, about 4 new snapshots per round: LRU has evicted a first turn before its second comes.
    assert sum(lru[len(lru) // 2 :]) == 0
    # Every second turn reuses its first turn's 8 tokens.
    second_turns = hd[len(hd) // 2 :][1::2]
    assert second_turns and set(second_turns) == {8}
    pol = mgr.pool(G).policy
    assert isinstance(pol, HitDensitySnapshotPolicy)
    # What it learned: a first turn's snapshot is worth more the closer it gets to the age of its reuse.
    assert pol.index(0, 1) < pol.index(0, 6) < pol.index(0, 11)
    order = pol.ordered()
    lives = [pol.life(p) for p in order]
    first_turns = [life for life in lives if life[0] == 0]
    # Among the waiting first turns (class 0), the youngest goes first: the opposite of LRU.
    assert [age for _, age, _ in first_turns] == sorted(age for _, age, _ in first_turns)
    # The served second turns (superseded first turns and never-continued second turns) go before them all.
    assert all(life[0] != 0 for life in lives[: len(lives) - len(first_turns)])
    reuses, removals, ended = pol.observed()[0]
    assert reuses >= 20 and removals == 0 and ended >= reuses


def test_a_snapshot_recreated_where_an_evicted_one_lay_counts_as_its_reuse_and_passes_on_the_count():
    mgr = manager(4, hit_density())
    pol = mgr.pool(G).policy
    turn1 = tokens(1, 8)
    serve(mgr, turn1)
    assert pol.life(snapshot_page(mgr, turn1, 8)) == (0, 0, 1)
    assert mgr.evict(G, 1) == 1 and snapshot_page(mgr, turn1, 8) is None  # a ghost now
    turn2 = turn1 + tokens(2, 8)
    assert serve(mgr, turn2) == 0  # the attention blocks are cached, the snapshot is not: the match is cut
    # The branch point put a snapshot back where the evicted one lay: that counts as the reuse it would have been.
    assert pol.observed()[0][0] == 1
    below, tip = snapshot_page(mgr, turn2, 8), snapshot_page(mgr, turn2, 16)
    assert pol.life(below) == (pol.superseded_class, 0, 2)  # superseded by the second turn's snapshot ...
    assert pol.life(tip)[0::2] == (1, 2)  # ... which took over its use count
    # A superseded snapshot is no fallback: the tip is worth its whole prefix, and the superseded one goes first.
    assert pol.value(tip) == 16.0 and pol.ordered()[0] is below


def test_hit_density_keeps_the_marginal_value_over_a_branch_point():
    mgr = manager(6, hit_density())
    pol = mgr.pool(G).policy
    stem = tokens(1, 8)
    serve(mgr, stem)
    a, b = stem + tokens(2, 8), stem + tokens(3, 12)
    serve(mgr, a)
    serve(mgr, b)
    # Two prompts continue the stem: it is a branch point, which stays a fallback for both.
    assert len(snapshot_page(mgr, stem, 8).block.children) == 2
    assert pol.value(snapshot_page(mgr, a, 16)) == 8.0 and pol.value(snapshot_page(mgr, b, 20)) == 12.0


def test_a_removed_block_ends_the_lifetime_without_a_reuse():
    mgr = manager(4, hit_density(), attention_pages=6)
    pol = mgr.pool(G).policy
    first = tokens(1, 8)
    serve(mgr, first)
    for i in range(3):
        serve(mgr, tokens(10 + i, 8))  # the attention pool holds 6 blocks: the first prompt's go
    assert snapshot_page(mgr, first, 8) is None
    assert sum(r for _, r, _ in pol.observed()) >= 1 and sum(h for h, _, _ in pol.observed()) == 0
    serve(mgr, first)  # computed again from scratch: a new lifetime, not a reuse
    assert pol.life(snapshot_page(mgr, first, 8)) == (0, 0, 1)


def test_hit_density_orders_by_value_until_a_reuse_is_seen():
    # Same setting as the GreedyDual policy's test in test_hybrid_upload_policy.py: with no reuse seen, every
    # index is 1 and the long prefix's snapshot outlives the short one's.
    mgr = manager(3, cost_aware_eviction(KIMI_K3_LIKE, TPB, aging="hit-density"), attention_pages=64)
    long_, short, newest = tokens(1, 40), tokens(2, 8), tokens(3, 8)
    for p in (long_, short, newest):
        serve(mgr, p)
    pol = mgr.pool(G).policy
    assert isinstance(pol, HitDensitySnapshotPolicy) and pol.index(0, 5) == 1.0
    assert snapshot_page(mgr, long_, 40) is not None and snapshot_page(mgr, short, 8) is None


def test_hit_density_arguments_are_checked():
    with pytest.raises(ValueError, match="aging"):
        cost_aware_eviction(KIMI_K3_LIKE, TPB, aging="lru")
    with pytest.raises(TypeError, match="value_fn"):
        HitDensitySnapshotPolicy(3, TPB)  # type: ignore[arg-type]
    for name, bad, err in (
        ("reuse_classes", 0, ValueError),
        ("bins_per_octave", 2.5, TypeError),
        ("refresh_every", 0, ValueError),
        ("max_walk", True, TypeError),
        ("prior_lifetimes", -1.0, ValueError),
        ("prior_lifetimes", "10", TypeError),
    ):
        with pytest.raises(err, match=name):
            HitDensitySnapshotPolicy(float, TPB, **{name: bad})
    with pytest.raises(ValueError, match="tokens_per_block"):
        HitDensitySnapshotPolicy(float, 0)


# --- the snapshot-aware attention rule ----------------------------------------------------------------------------

A = 0  # the attention group's slot in Block.pages


def leaf(mgr: HybridCacheManager, prompt: list[int]):
    node = mgr.tree.root(None)
    for i in range(len(prompt) // TPB):
        node = node.children[_key(node.key, prompt[i * TPB : (i + 1) * TPB])]
    return node


def test_a_leaf_whose_snapshot_was_evicted_goes_before_older_live_blocks():
    """The short-prompt rule puts the newer short prompt's snapshot first; once it is evicted, that prompt's leaf
    is dead weight and its attention page goes before the older long prompt's, which LRU would evict first."""
    cfg = KVCacheConfig(TPB, (FULL, REC), (TierConfig(pages=(64, 4)),))
    mgr = HybridCacheManager(
        cfg, policy=HybridCachePolicy(low_priority_snapshot_prompt_len=10), eviction_policy=snapshot_aware_eviction()
    )
    attn = mgr.pool(A).policy
    assert isinstance(attn, SnapshotAwareLRU)
    long_, short = tokens(1, 12), tokens(2, 8)
    serve(mgr, long_)
    serve(mgr, short)
    blocks = [pg.block for pg in attn.ordered()]
    assert blocks == [leaf(mgr, long_), leaf(mgr, short)], "both alive: least recently used first"
    assert mgr.evict(G, 1) == 1  # priority 0 first: the short prompt's snapshot
    assert leaf(mgr, short).pages[G] is None and leaf(mgr, long_).pages[G] is not None
    blocks = [pg.block for pg in attn.ordered()]
    assert blocks == [leaf(mgr, short), leaf(mgr, long_)], "the dead leaf first"
    # Evicting attention drops the dead path (the short prompt's two blocks, neither with a snapshot) before any
    # live block: the leaf first, then its parent, a dead leaf in turn.
    assert mgr.evict(A, 2) == 2
    root = mgr.tree.root(None)
    assert _key(root.key, short[:TPB]) not in root.children
    assert leaf(mgr, long_).pages[A] is not None and leaf(mgr, long_).pages[G] is not None
    mgr.check_invariants()


def test_snapshot_aware_eviction_needs_a_heap_policy_for_snapshots():
    class Plain:
        pass

    factory = snapshot_aware_eviction(lambda group, tier: Plain())
    with pytest.raises(TypeError, match=r"^snapshot_policy: expected a factory of policies with an on_victim hook"):
        manager(2, factory)


def test_cost_aware_eviction_uses_the_snapshot_aware_attention_rule_with_hit_density():
    mgr = manager(2, cost_aware_eviction(KIMI_K3_LIKE, TPB, aging="hit-density"))
    assert isinstance(mgr.pool(A).policy, SnapshotAwareLRU)
    mgr = manager(2, cost_aware_eviction(KIMI_K3_LIKE, TPB, aging="hit-density", attention_policy=PrioritizedLRU))
    assert type(mgr.pool(A).policy) is PrioritizedLRU
    assert type(manager(2, cost_aware_eviction(KIMI_K3_LIKE, TPB)).pool(A).policy) is PrioritizedLRU


# --- random operation sequences ----------------------------------------------------------------------------------


BASES = [[(5 * i + 3 * j) % 13 for j in range(40)] for i in range(3)]

try:  # hypothesis is a test extra: without it only this property test is skipped
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ImportError:  # pragma: no cover
    RuleBasedStateMachine = None

if RuleBasedStateMachine is not None:

    class HitDensityMachine(RuleBasedStateMachine):
        """Requests over small pools (evictions, removed blocks, ghosts re-created, superseding) with the hit-density
        policy re-estimating often; the manager's invariants and the policy's bookkeeping hold after every step."""

        @initialize(
            refresh=st.sampled_from([1, 2, 5]),
            prior=st.sampled_from([0.0, 10.0]),
            classes=st.integers(1, 3),
            dead_first=st.booleans(),
        )
        def setup(self, refresh, prior, classes, dead_first):
            factory = hit_density(dead_first, refresh_every=refresh, prior_lifetimes=prior, reuse_classes=classes)
            self.mgr = manager(5, factory, attention_pages=14)
            self.caches = []

        @rule(base=st.integers(0, 2), n=st.integers(1, 30))
        def create(self, base, n):
            prompt = BASES[base][:n]
            try:
                cache = self.mgr.create_cache(prompt, max_reuse_tokens=n - 1)
            except OutOfPagesError:
                return
            self.caches.append((cache, prompt))

        @precondition(lambda self: self.caches)
        @rule(i=st.integers(0, 99))
        def step(self, i):
            """Compute up to the next snapshot point (or the end) and commit it."""
            cache, prompt = self.caches[i % len(self.caches)]
            done = cache.num_committed_tokens
            ends = [p for p in self.mgr.snapshot_points(cache, done) if p <= len(prompt)] + [len(prompt)]
            end = min(ends)
            if end > done and cache.committing and cache.resize(max(cache.capacity, end), end):
                cache.commit(prompt[done:end])

        @precondition(lambda self: self.caches)
        @rule(i=st.integers(0, 99))
        def close(self, i):
            cache, _ = self.caches.pop(i % len(self.caches))
            cache.close()

        @rule(n=st.integers(1, 3))
        def evict(self, n):
            self.mgr.evict(G, n)

        @rule(n=st.integers(1, 3))
        def evict_attention(self, n):
            self.mgr.evict(A, n)

        @invariant()
        def consistent(self):
            if not hasattr(self, "mgr"):
                return
            self.mgr.check_invariants()
            pol = self.mgr.pool(G).policy
            order = pol.ordered()
            assert len(order) == len(pol) and len(set(map(id, order))) == len(order)
            for p in order:
                life = pol.life(p)
                assert life is not None and 0 <= life[0] <= pol.superseded_class and life[1] >= 0 and life[2] >= 1
                assert pol.score(p) >= 0.0
            for cls in range(pol.superseded_class + 1):
                assert all(pol.index(cls, age) >= 0.0 for age in (0, 3, 50))
            attn = self.mgr.pool(A).policy
            order = attn.ordered()
            assert len(order) == len(attn) and len(set(map(id, order))) == len(order)

    HitDensityMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    test_hit_density_machine = HitDensityMachine.TestCase
else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_hit_density_machine():
        pass
