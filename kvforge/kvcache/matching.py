"""Prefix matching and page needs: read-only questions a manager and its caches ask of the radix tree.

:class:`PrefixMatcher` serves one manager's pool-group layout. ``match`` finds the longest reusable prefix of a
prompt (its block keys, plus its tokens for a partial tail) under a scope's root, cut back to where every recurrent
group has a snapshot and every sliding-window group its window (``usable``), with an optional partial tail matched
by comparing tokens. ``reuse_needs`` says what adopting a match would lock, copy, onboard and allocate;
``block_needs`` what growing a cache by whole blocks takes. Nothing here changes the tree, the pools, the LRU order
or any count, so the manager's ``probe_reuse`` and ``plan_admission`` are exact and free of side effects.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.config import LifeCycleKind, PoolGroupSpec, Tier
from kvforge.kvcache.hashing import token_ints
from kvforge.kvcache.pools import Block, Page
from kvforge.kvcache.records import ReuseMatch

__all__ = ["PrefixMatcher"]

_ref_count = attrgetter("ref_count")


class PrefixMatcher:
    """Read-only tree queries for one pool-group layout.

    ``full_groups``, ``sliding_groups``, ``recurrent_groups`` and ``attention_groups`` (full plus sliding) are
    the group ids of each life cycle, in group-id order.
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self.tokens_per_block = block_pool.tokens_per_block
        self.groups: tuple[PoolGroupSpec, ...] = block_pool.groups
        self.num_groups = len(self.groups)
        kinds = [g.life_cycle.kind for g in self.groups]
        self.full_groups = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.FULL)
        self.sliding_groups = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.SLIDING)
        self.recurrent_groups = tuple(i for i, k in enumerate(kinds) if k is LifeCycleKind.RECURRENT)
        self.attention_groups = tuple(i for i, k in enumerate(kinds) if k is not LifeCycleKind.RECURRENT)
        self._gpu = block_pool.gpu
        self._gpu_only = len(block_pool.tiers) == 1
        # One full-attention group in one tier (the plain layout): reuse_needs has nothing but a count to do.
        self.one_full_group = self._gpu_only and self.full_groups == (0,) and self.num_groups == 1
        self.hasher = block_pool.tree.hasher

    # --- matching ------------------------------------------------------------------------------------------------

    def match(
        self, root: Block, keys: Sequence[int] | None, tokens: Sequence[int] | None, limit: int | None
    ) -> ReuseMatch:
        """Longest reusable prefix under ``root``; reads the tree only."""
        tpb = self.tokens_per_block
        if tokens is not None:
            n_avail = len(tokens)
        elif keys is not None:
            n_avail = len(keys) * tpb
        else:
            n_avail = 0
        if limit is not None and limit < n_avail:
            n_avail = limit
        max_full = n_avail // tpb
        blocks: list[Block] = []
        node = root
        if keys is not None:
            append = blocks.append
            for key in keys[:max_full] if max_full < len(keys) else keys:
                child = node.children.get(key)
                if child is None or child.num_tokens != tpb:
                    break
                append(child)
                node = child
        n = len(blocks)
        partial, ptoks = None, 0
        if tokens is not None and n_avail > n * tpb:
            # Tried before the cut: a usable partial tail (e.g. a recurrent snapshot saved where a sequence ended)
            # makes the full blocks before it usable whether or not a snapshot lies at their end.
            partial, ptoks = self.match_partial(blocks, node, tokens, n * tpb, n_avail)
        if partial is None and (self.sliding_groups or self.recurrent_groups):
            while n and not self.usable(blocks, n, None, 0):
                n -= 1
        return ReuseMatch(root, tuple(blocks if n == len(blocks) else blocks[:n]), partial, ptoks, tpb)

    def usable(self, blocks: Sequence[Block], n: int, partial: Block | None, ptoks: int) -> bool:
        """Whether the first ``n`` full blocks (then ``ptoks`` tokens of ``partial``) can resume a request:
        every recurrent group has a snapshot exactly at the end, every sliding-window group its window."""
        tpb = self.tokens_per_block
        end = partial if partial is not None else (blocks[n - 1] if n else None)
        if end is None:
            return True
        for g in self.recurrent_groups:
            if end.pages[g] is None or (partial is not None and ptoks != partial.num_tokens):
                return False
        total = n * tpb + ptoks
        for g in self.sliding_groups:
            lc = self.groups[g].life_cycle
            sinks = min(lc.sink_blocks(tpb), n)
            for b in range(sinks):
                if blocks[b].pages[g] is None:
                    return False
            for b in range(max(lc.first_needed_block(total, tpb), sinks), n):
                if blocks[b].pages[g] is None:
                    return False
            if partial is not None and partial.pages[g] is None:
                return False
        return True

    def match_partial(
        self, blocks: list[Block], node: Block, tokens: Sequence[int], start: int, end: int
    ) -> tuple[Block | None, int]:
        """The child of ``node`` sharing the longest token prefix with ``tokens[start:end]`` (at most one block;
        among equals the first in ``node.children``' order), found through the children's token index."""
        rem = tuple(token_ints(tokens[start : min(end, start + self.tokens_per_block)]))
        best, best_len = node.children.longest_prefix(rem)
        if best is None or not self.usable(blocks, len(blocks), best, best_len):
            return None, 0
        return best, best_len

    def chain_keys(self, parent_key: int, partial: Sequence[int], tokens: Sequence[int], n_full: int) -> list[int]:
        """Block keys of the ``n_full`` blocks that ``partial`` followed by ``tokens`` completes."""
        if not n_full:
            return []
        tpb = self.tokens_per_block
        seq = tokens[: n_full * tpb] if not partial else [*partial, *token_ints(tokens[: n_full * tpb - len(partial)])]
        return self.hasher.block_keys(seq, tpb, parent=parent_key)

    # --- page needs ---------------------------------------------------------------------------------------------

    def stale_lo_at(self, num_tokens: int) -> list[int]:
        """First non-stale non-sink block per group for a cache at ``num_tokens`` committed tokens."""
        tpb = self.tokens_per_block
        out = [0] * self.num_groups
        for g in self.sliding_groups:
            lc = self.groups[g].life_cycle
            out[g] = max(lc.first_needed_block(num_tokens, tpb), lc.sink_blocks(tpb))
        return out

    def reuse_needs(
        self, match: ReuseMatch, nblocks: int
    ) -> tuple[list[tuple[int, Sequence[int], list[Page]]], list[Page], list[int], list[int], list[int]]:
        """What adopting ``match`` (then growing to ``nblocks`` blocks) takes, without changing anything.

        Returns the per-group lock plan ``(group, ordinals, tree pages)``, the copy sources to pin, the GPU pages
        needed per group, the unlocked GPU pages per group the adoption would lock (no longer available), and
        the host pages per group to onboard.
        """
        blocks = match.blocks
        n = len(blocks)
        partial = match.partial
        if self.one_full_group and partial is None:
            # What the general path below computes for this layout, without its per-group loops.
            matched: list[Page] = [b.pages[0] for b in blocks]  # type: ignore[misc]  # full attention: never None
            taken = [list(map(_ref_count, matched)).count(0)]
            return [(0, range(n), matched)], [], [nblocks - n if nblocks > n else 0], taken, [0]
        tpb = self.tokens_per_block
        gpu = self._gpu
        total = match.num_tokens
        plan: list[tuple[int, Sequence[int], list[Page]]] = []
        for g in self.full_groups:
            plan.append((g, range(n), [b.pages[g] for b in blocks]))  # type: ignore[misc]
        for g in self.sliding_groups:
            lc = self.groups[g].life_cycle
            sinks = min(lc.sink_blocks(tpb), n)
            ords = [*range(sinks), *range(max(lc.first_needed_block(total, tpb), sinks), n)]
            plan.append((g, ords, [blocks[i].pages[g] for i in ords]))
        # Sources of copies are locked while the copies are recorded, so no allocation can reuse them first.
        sources: list[Page] = []
        if partial is not None:
            sources.extend(partial.pages[g] for g in self.attention_groups if partial.pages[g] is not None)  # type: ignore[misc]
        if total and self.recurrent_groups:
            end = partial if partial is not None else blocks[-1]
            sources.extend(end.pages[g] for g in self.recurrent_groups)  # type: ignore[misc]
        onboard = [0] * self.num_groups
        taken = [0] * self.num_groups
        for g, _, lst in plan:
            if self._gpu_only:
                # One tier: nothing to onboard; the unlocked pages are counted in C.
                taken[g] = list(map(_ref_count, lst)).count(0)
                continue
            gpu_pool = gpu[g]
            nd = tk = 0
            for p in lst:
                if p.ref_count == 0:
                    if p.pool is gpu_pool:
                        tk += 1
                    else:
                        nd += 1
                elif p.pool is not gpu_pool:
                    nd += 1
            onboard[g] = nd
            taken[g] = tk
        for p in sources:
            if p.pool.tier is Tier.GPU and p.ref_count == 0:
                taken[p.pool.group] += 1
        need = list(onboard)
        if partial is not None:
            for g in self.attention_groups:
                need[g] += 1
        for g in self.recurrent_groups:
            need[g] += 1
        width = n + (partial is not None)
        if nblocks > width:
            for g, x in enumerate(self.block_needs(width, nblocks, self.stale_lo_at(total))):
                need[g] += x
        return plan, sources, need, taken, onboard

    def block_needs(self, old: int, new: int, stale_lo: Sequence[int]) -> list[int]:
        """GPU pages per group for growing from ``old`` to ``new`` blocks (stale sliding-window blocks take none)."""
        need = [0] * self.num_groups
        if new <= old:
            return need
        for g in self.full_groups:
            need[g] = new - old
        tpb = self.tokens_per_block
        for g in self.sliding_groups:
            sinks = self.groups[g].life_cycle.sink_blocks(tpb)
            need[g] = max(0, new - max(old, stale_lo[g])) + max(0, min(new, sinks) - old)
        return need
