"""The cost-aware snapshot eviction policy's value functions, on hand-built tree blocks (4-token blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvforge.kvcache.pools import Page
from kvforge.kvcache.radix import Block
from kvforge.kvcache.snapshot_policy import KIMI_K3_LIKE, CostAwareSnapshotPolicy, cost_aware_eviction

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
