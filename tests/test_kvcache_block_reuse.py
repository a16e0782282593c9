"""The block pool's reuse of tree blocks and its eviction shortcut change nothing a caller can observe.

* Random key-mode requests over a small full-attention pool give the same state snapshot, events and copies with
  the default policy as with a policy that lacks ``add_unless_next`` (the block pool then evicts one
  ``pop_victim`` at a time) and with a subclass of it (the pool then calls its ``add_unless_next`` rather than
  inlining it) and through the general admission path (not the one-group short path), after every request,
  and the invariant check holds.
* A removed block the caller still holds keeps its key and parent (it is never reused while referenced); one
  nobody holds is reused, so a pool's block objects stay bounded by its pages.
* After ``freeze_gc``, caching many blocks creates no GC-tracked objects per block.
* Hits, the order of removed blocks and the cached set equal those of an independent model of the policy (one
  full-attention pool: evict the unlocked leaf with the least ``(last_used, -depth, candidacy order)``).
* A close's one-pass row release (``BlockPool.release_row``) leaves the same state as the per-page unlock path,
  with partial tails, uncommitted pages and a host tier.
"""

from __future__ import annotations

import gc
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, PrioritizedLRU, Tier, TierConfig
from kvforge.kvcache.events import BlockRemoved
from kvforge.kvcache.hashing import keys_from_ids
from kvforge.kvcache.host import freeze_gc

TPB = 4


class _PlainLRU:
    """PrioritizedLRU behind the bare EvictionPolicy protocol (no ``add_unless_next``)."""

    def __init__(self, group=None, tier=None) -> None:
        self._p = PrioritizedLRU()

    def add(self, page) -> None:
        self._p.add(page)

    def discard(self, page) -> None:
        self._p.discard(page)

    def pop_victim(self, accept=None):
        return self._p.pop_victim(accept)

    def ordered(self):
        return self._p.ordered()

    @property
    def _heap(self):  # what the manager's state snapshot reads of a policy
        return self._p._heap

    @property
    def _run(self):
        return self._p._run

    def __len__(self) -> int:
        return len(self._p)

    def __contains__(self, page) -> bool:
        return page in self._p


class _SubLRU(PrioritizedLRU):
    """A subclass: the block pool calls its ``add_unless_next`` instead of inlining the default policy's."""


def _manager(pages: int, policy=None, events: list | None = None) -> KVCacheManager:
    config = KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=1),), (TierConfig(pages=pages),))
    sink = None if events is None else events.append
    return KVCacheManager(config, eviction_policy=policy, event_sink=sink)


def _serve(mgr: KVCacheManager, ids: list[int]) -> int:
    keys = keys_from_ids(ids)
    cache = mgr.create_cache(block_keys=keys)
    reused = cache.num_committed_tokens
    n = len(keys) * TPB
    if cache.resize(capacity=n, history=n):
        cache.commit(num_tokens=n - reused, block_keys=keys[reused // TPB :])
    cache.close()
    return reused // TPB


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(6, 20))
def test_eviction_shortcut_matches_one_pop_at_a_time(seed: int, pages: int) -> None:
    rng = random.Random(seed)
    ev_fast: list = []
    ev_plain: list = []
    ev_sub: list = []
    fast = _manager(pages, events=ev_fast)
    plain = _manager(pages, policy=_PlainLRU, events=ev_plain)
    sub = _manager(pages, policy=_SubLRU, events=ev_sub)
    general = _manager(pages)
    general.matcher.one_full_group = False  # admission through the general per-group path
    stems = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    for _ in range(40):
        ids = list(rng.choice(stems)) + [rng.randrange(1000) for _ in range(rng.randint(0, pages))]
        ids = ids[:pages]
        assert _serve(fast, ids) == _serve(plain, ids) == _serve(sub, ids) == _serve(general, ids)
        fast.check_invariants()
        assert fast.state_snapshot() == plain.state_snapshot() == sub.state_snapshot() == general.state_snapshot()
        assert fast.take_pending_copies() == plain.take_pending_copies() == sub.take_pending_copies()
    assert ev_fast == ev_plain == ev_sub and any(isinstance(e, BlockRemoved) for e in ev_fast)
    assert fast.stats == plain.stats == sub.stats


def test_removed_block_is_reused_only_when_nobody_holds_it() -> None:
    pages = 6
    mgr = _manager(pages)
    _serve(mgr, [1, 2, 3])
    held = mgr.tree.root(None).children[keys_from_ids([1])[0]]
    held_key, held_parent = held.key, held.parent
    seen: set[int] = set()
    for i in range(20):  # every block of [1, 2, 3] is evicted, then 120 more come and go
        _serve(mgr, [100 + 10 * i + j for j in range(pages)])
        mgr.check_invariants()
        seen.update(id(b) for b in mgr.tree.blocks())
    assert held.key == held_key and held.parent is held_parent
    assert all(b is not held for b in mgr.tree.blocks())
    # The pool built 6 blocks; one more replaces the held one; every other block was reused.
    assert len(seen) <= pages + 1


def test_no_gc_tracked_objects_per_cached_block() -> None:
    mgr = _manager(4000)
    rng = random.Random(0)
    _serve(mgr, [rng.randrange(1 << 40) for _ in range(8)])  # warm-up
    try:
        freeze_gc()
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(200):
            _serve(mgr, [rng.randrange(1 << 40) for _ in range(16)])  # 3,200 new blocks
        gc.collect()
        grown = len(gc.get_objects()) - before
    finally:
        gc.unfreeze()
    assert mgr.num_tree_blocks == 3208
    assert grown < 100, f"{grown} GC-tracked objects more after caching 3,200 blocks"


class _ReferenceCache:
    """The default policy on key-mode requests, written as a plain model: a cached block is a prefix of ids with
    a lock count; the candidates are unlocked cached prefixes without a cached child, and the victim is the one
    with the least ``(last unlocked, -depth, order it became a candidate)``. Priorities are all the default."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.last_used: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.since: dict[tuple[int, ...], int] = {}  # candidates -> when they became one
        self.order = 0
        self.clock = 0
        self.removed: list[tuple[int, ...]] = []

    def _leaf(self, prefix: tuple[int, ...]) -> bool:
        return not any(b[:-1] == prefix for b in self.last_used)

    def _lock(self, prefix: tuple[int, ...]) -> None:
        self.locks[prefix] = self.locks.get(prefix, 0) + 1
        self.since.pop(prefix, None)

    def create(self, ids: list[int]) -> list:
        self.clock += 1
        hit = 0
        while hit < len(ids) and tuple(ids[: hit + 1]) in self.last_used:
            hit += 1
        held = [tuple(ids[: i + 1]) for i in range(hit)]
        for prefix in held:
            self._lock(prefix)
        return [ids, hit, held]

    def grow(self, req: list) -> None:
        """resize to the whole prompt (False without pages: nothing changes), then commit it."""
        ids, hit, held = req
        need = len(ids) - hit
        if need > self.pages - sum(1 for n in self.locks.values() if n):
            return
        for _ in range(need - (self.pages - len(self.last_used))):
            victim = min(self.since, key=lambda b: (self.last_used[b], -len(b), self.since[b]))
            del self.since[victim], self.last_used[victim], self.locks[victim]
            self.removed.append(victim)
            parent = victim[:-1]
            if parent in self.last_used and not self.locks[parent] and self._leaf(parent):
                self.order += 1
                self.since[parent] = self.order
        for prefix in (tuple(ids[: i + 1]) for i in range(hit, len(ids))):
            if prefix in self.last_used:  # another open request committed it meanwhile: shared, this page freed
                self._lock(prefix)
            else:
                self.last_used[prefix] = 0
                self.locks[prefix] = 1
            held.append(prefix)

    def close(self, req: list) -> None:
        self.clock += 1
        for prefix in reversed(req[2]):  # deepest first
            self.locks[prefix] -= 1
            if not self.locks[prefix]:
                self.last_used[prefix] = self.clock
                if self._leaf(prefix):
                    self.order += 1
                    self.since[prefix] = self.order


def _open(mgr: KVCacheManager, ids: list[int]) -> list:
    keys = keys_from_ids(ids)
    cache = mgr.create_cache(block_keys=keys)
    return [cache, keys, cache.num_committed_tokens]


def _grow(req: list) -> None:
    cache, keys, reused = req
    n = len(keys) * TPB
    if cache.resize(capacity=n, history=n):
        cache.commit(num_tokens=n - reused, block_keys=keys[reused // TPB :])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**16), st.integers(4, 16))
def test_eviction_matches_an_independent_model(seed: int, pages: int) -> None:
    # Requests one at a time, and in pairs (both created, then both grown, then both closed: one evicts while the
    # other holds its prefix, and commits a block the other committed first). The clock ticks at every create and
    # every close, as the manager's does.
    rng = random.Random(seed)
    events: list = []
    mgr = _manager(pages, events=events)
    ref = _ReferenceCache(pages)
    stems = [[rng.randrange(40) for _ in range(rng.randint(1, 5))] for _ in range(4)]

    def prompt(longest: int) -> list[int]:
        ids = list(rng.choice(stems))[: rng.randint(1, 5)]
        return ids + [rng.randrange(400) for _ in range(rng.randint(0, longest))]

    for _ in range(40):
        batch = [prompt(pages)] if rng.random() < 0.5 else [prompt(pages // 2), prompt(pages // 2)]
        ours = [_open(mgr, ids) for ids in batch]
        theirs = [ref.create(ids) for ids in batch]
        assert [r[2] // TPB for r in ours] == [r[1] for r in theirs]
        for a, b in zip(ours, theirs):
            _grow(a)
            ref.grow(b)
        for a, b in zip(ours, theirs):
            a[0].close()
            ref.close(b)
        mgr.check_invariants()
    removed = [k for e in events if isinstance(e, BlockRemoved) for k in e.block_keys]
    assert removed == [keys_from_ids(list(prefix))[-1] for prefix in ref.removed]
    assert {b.key for b in mgr.tree.blocks()} == {keys_from_ids(list(p))[-1] for p in ref.last_used}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(6, 24), st.booleans())
def test_row_release_matches_the_per_page_unlock_path(seed: int, pages: int, host_tier: bool) -> None:
    # A cache's close with constant priorities releases each row in one BlockPool.release_row pass (uncommitted
    # tail first, only the deepest committed block tested for children); a priority callback (here returning the
    # default, so every decision is the same) takes the per-page path through unlock_pages. Token-mode requests
    # leave partial tails (inserted as partial blocks at close) and uncommitted pages past the committed length.
    rng = random.Random(seed)
    gpu = TierConfig(pages=pages)
    tiers = (gpu, TierConfig(tier=Tier.HOST, pages=pages)) if host_tier else (gpu,)
    config = KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=1),), tiers)
    row, per_page = KVCacheManager(config), KVCacheManager(config)
    stems = [[rng.randrange(30) for _ in range(rng.randint(1, 3 * TPB))] for _ in range(3)]
    for _ in range(30):
        tokens = list(rng.choice(stems)) + [rng.randrange(30) for _ in range(rng.randint(0, 2 * TPB))]
        extra = rng.randint(0, 2 * TPB)
        commit_upto = rng.randint(0, len(tokens))
        outcomes = []
        for mgr, cb in ((row, None), (per_page, lambda ordinal, group: 35)):
            if not mgr.plan_admission(tokens, capacity=len(tokens) + extra, max_reuse_tokens=commit_upto).fits:
                outcomes.append(None)
                continue
            cache = mgr.create_cache(
                tokens, capacity=len(tokens) + extra, max_reuse_tokens=commit_upto, priority_callback=cb
            )
            done = cache.num_committed_tokens
            cache.resize(history=len(tokens))
            if commit_upto > done:
                cache.commit(tokens[done:commit_upto])
            cache.close()
            outcomes.append(done)
        assert outcomes[0] == outcomes[1]
        row.check_invariants()
        assert row.state_snapshot() == per_page.state_snapshot()
        assert row.take_pending_copies() == per_page.take_pending_copies()
