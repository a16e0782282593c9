"""The block pool's reuse of tree blocks and its eviction shortcut change nothing a caller can observe.

* Random key-mode requests over a small full-attention pool give the same state snapshot, events and copies with
  the default policy as with a policy that lacks ``add_unless_next`` (the block pool then evicts one
  ``pop_victim`` at a time), after every request, and the invariant check holds.
* A removed block the caller still holds keeps its key and parent (it is never reused while referenced); one
  nobody holds is reused, so a pool's block objects stay bounded by its pages.
* After ``freeze_gc``, caching many blocks creates no GC-tracked objects per block.
"""

from __future__ import annotations

import gc
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, PrioritizedLRU, TierConfig
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
    fast = _manager(pages, events=ev_fast)
    plain = _manager(pages, policy=_PlainLRU, events=ev_plain)
    stems = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    for _ in range(40):
        ids = list(rng.choice(stems)) + [rng.randrange(1000) for _ in range(rng.randint(0, pages))]
        ids = ids[:pages]
        assert _serve(fast, ids) == _serve(plain, ids)
        fast.check_invariants()
        assert fast.state_snapshot() == plain.state_snapshot()
        assert fast.take_pending_copies() == plain.take_pending_copies()
    assert ev_fast == ev_plain and any(isinstance(e, BlockRemoved) for e in ev_fast)
    assert fast.stats == plain.stats


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
