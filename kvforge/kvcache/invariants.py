"""Structural checks and comparable snapshots of a block pool (tests and debugging; off the hot path).

:func:`check_block_pool` verifies every page's reference count against the references the caches report,
the free lists, the unlocked counts and eviction-policy membership of every pool, and the shape of the radix
tree; it raises AssertionError naming the first broken invariant. :func:`block_pool_state` returns everything
observable about pools, policies and the tree as one comparable value (read-only calls must not change it).
``KVCacheManager.check_invariants`` and ``KVCacheManager.state_snapshot`` call these with the caches' parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.pools import Block, Page

__all__ = ["block_pool_state", "check_block_pool", "check_children_index"]


def check_children_index(node: Block) -> None:
    """Raise AssertionError unless ``node``'s children index is exact: stamps rise in the dict's order, and
    ``by_tokens`` indexes exactly the children with tokens, sorted by (tokens, stamp)."""
    children = node.children
    seqs = [c.seq for c in children.values()]
    assert all(a < b for a, b in pairwise(seqs)), f"{node!r}: child stamps {seqs} out of dict order"
    want = sorted(((c.tokens, c.seq, c) for c in children.values() if c.tokens is not None), key=lambda e: e[:2])
    got = children.token_entries()
    assert len(got) == len(want) and all(g[0] == w[0] and g[1] == w[1] and g[2] is w[2] for g, w in zip(got, want)), (
        f"{node!r}: token index {[(e[0], e[1]) for e in got]} != {[(e[0], e[1]) for e in want]}"
    )
    idx = children.by_tokens
    # None for no child with tokens, that child itself for one, a list only for two or more.
    assert (idx is None) == (not want) and (type(idx) is list) == (len(want) > 1), f"{node!r}: index form {idx!r}"
    oldest = children.oldest
    assert oldest is None or (len(want) > 1 and oldest is min(want, key=lambda e: e[1])[2]), f"{node!r}: oldest"


def check_block_pool(bp: BlockPool, refs: Iterable[Page], full_groups: Iterable[int]) -> None:
    """Raise AssertionError unless ``bp`` is consistent with ``refs`` (every page reference a holder owns,
    one entry per reference) and every block keeps a page of each of ``full_groups``."""
    tpb = bp.tokens_per_block
    expected_refs: dict[int, int] = {}
    for p in refs:
        expected_refs[id(p)] = expected_refs.get(id(p), 0) + 1

    for pool in bp.all_pools():
        free_ids = {id(p) for p in pool.free}
        assert len(free_ids) == len(pool.free), f"{pool.tier.name} g{pool.group}: a page is free twice"
        n_unlocked = 0
        in_policy = 0
        for p in pool.pages:
            want = expected_refs.get(id(p), 0)
            assert p.ref_count == want, f"{p!r}: ref_count {p.ref_count}, referenced {want} times"
            if id(p) in free_ids:
                assert p.ref_count == 0 and p.block is None and p.policy_data is None, f"free {p!r} in use"
                continue
            if p.block is None:
                assert p.ref_count > 0, f"{p!r} leaked: neither free, referenced nor in the tree"
                continue
            assert p.block.pages[pool.group] is p, f"{p!r} not in its block"
            if p.ref_count == 0:
                n_unlocked += 1
                eligible = bp.eligible(p)
                assert (p in pool.policy) == eligible, f"{p!r} policy membership {p in pool.policy}"
                in_policy += eligible
            else:
                assert p not in pool.policy, f"locked {p!r} is an eviction candidate"
        assert n_unlocked == pool.n_unlocked, f"{pool.tier.name} g{pool.group}: n_unlocked {pool.n_unlocked}"
        assert len(pool.policy) == in_policy, f"{pool.tier.name} g{pool.group}: policy size {len(pool.policy)}"

    full = tuple(full_groups)
    for root in bp.tree.roots.values():
        check_children_index(root)
    count_blocks = 0
    for block in bp.tree.blocks():
        count_blocks += 1
        check_children_index(block)
        parent = block.parent
        assert parent is not None and parent.children.get(block.key) is block, f"{block!r} detached"
        assert block.depth == parent.depth + 1, f"{block!r} depth"
        assert 0 < block.num_tokens <= tpb, f"{block!r} size"
        if block.num_tokens < tpb:
            assert not block.children, f"partial {block!r} has children"
        if block.tokens is not None:
            assert len(block.tokens) == block.num_tokens, f"{block!r} tokens"
        for g in full:
            assert block.pages[g] is not None, f"{block!r} lost its full-attention page"
        if not block.children:
            assert any(p is not None for p in block.pages), f"empty leaf {block!r}"
        for g, page in enumerate(block.pages):
            if page is not None:
                assert page.block is block and page.pool.group == g, f"{block!r} group {g} holds {page!r}"
    assert count_blocks == bp.tree.num_blocks, f"tree counts {bp.tree.num_blocks}, found {count_blocks}"


def _page_state(p: Page) -> tuple:
    return (p.index, p.ref_count, None if p.block is None else p.block.key, p.priority, p.last_used)


def _policy_state(pol: Any) -> tuple:
    ordered = getattr(pol, "ordered", None)
    heap = getattr(pol, "_heap", None)
    run = getattr(pol, "_run", ())  # PrioritizedLRU's sorted run: dead entries there count as state too
    return (
        len(pol),
        None if ordered is None else tuple(p.index for p in ordered()),
        None if heap is None else len(heap),
        len(run),
    )


def block_pool_state(bp: BlockPool, caches: tuple = ()) -> tuple:
    """Pools, policies, tree, roots, ``caches`` (the caller's per-cache states), clock, pending copies and
    removals, and the block count, as one comparable value."""
    pools = tuple(
        (
            pool.n_unlocked,
            tuple(p.index for p in pool.free),
            tuple(map(_page_state, pool.pages)),
            _policy_state(pool.policy),
        )
        for pool in bp.all_pools()
    )
    tree = tuple(
        sorted(
            (
                b.depth,
                b.key,
                b.num_tokens,
                b.tokens,
                tuple(None if p is None else (p.pool.tier, p.index) for p in b.pages),
                tuple(sorted(b.children)),
            )
            for b in bp.tree.blocks()
        )
    )
    return (
        pools,
        tree,
        tuple(sorted(bp.tree.roots)),
        caches,
        bp.clock,
        bp.num_pending_copies,
        bp.pending_removals,
        bp.tree.num_blocks,
    )
