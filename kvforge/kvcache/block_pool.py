"""The block pool: every page of every (tier, pool group), the radix tree they belong to, and eviction.

:class:`BlockPool` owns the page-side state of a manager: the pools (free lists, unlocked counts, eviction
policies), the tree of committed blocks, the LRU clock, the copies the runtime must execute and the block
events for the router. It knows nothing of requests: a request cache locks and unlocks pages through it.

Page life (see :mod:`~kvforge.kvcache.pools`): ``alloc_page`` hands out a locked page in no block (evicting if
needed), ``free_page`` takes it back; committed pages are shared with ``lock`` / ``unlock`` (at ref count 0
an eligible page becomes an eviction candidate); ``evict_one`` moves a candidate a tier down, or drops it from
its last tier, taking its block out of the tree when the block loses its full-attention page. Every move is
recorded as a :class:`~kvforge.kvcache.records.PageCopy` (``take_pending_copies``) and every block that leaves
the tree is announced as :class:`~kvforge.kvcache.events.BlockRemoved` at the next ``flush_events``. Tree
blocks come from ``new_block`` / ``new_chain``: built at construction and reused once out of the tree and
unreferenced, so a frozen server allocates no GC-tracked object per block (``docs/kvcache.md``, host cost).

Methods without a leading underscore are the interface of the manager and its caches; none validates its
arguments (callers are internal). Not thread-safe.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import count

from kvforge.kvcache.config import KVCacheConfig, LifeCycleKind, PoolGroupSpec, Tier
from kvforge.kvcache.events import BlockRemoved, BlockStored, EventSink
from kvforge.kvcache.eviction import PrioritizedLRU
from kvforge.kvcache.hashing import BlockKeyHasher, default_hasher
from kvforge.kvcache.pools import Block, EvictionPolicyFactory, Page, PagePool, next_seq
from kvforge.kvcache.radix import RadixTree
from kvforge.kvcache.records import ManagerStats, PageCopy, check_count

__all__ = ["MAX_PREALLOCATED_BLOCKS", "BlockPool"]

MAX_PREALLOCATED_BLOCKS = 1 << 22
"""At most this many tree blocks are built at construction (about 225 bytes each on CPython 3.11)."""

_getrefcount = sys.getrefcount
# Children's own insertion and deletion, for the hot paths below that do the token index's part inline (a new key
# whose block holds no tokens takes only a stamp; deleting a block without tokens touches no index).
_dict_setitem = dict.__setitem__
_dict_delitem = dict.__delitem__


def _unheld_refs() -> int:
    """What ``sys.getrefcount`` reports for a block just taken off the spare queue that nothing else refers to,
    measured the way ``new_block`` and ``new_chain`` measure it (the local name and the call's argument: 2 on
    CPython 3.11; measured, not assumed, for interpreters that borrow references to locals)."""
    spare = deque([Block(0, None, 0, 0, None, 0)])
    b = spare.popleft()
    return _getrefcount(b)


_UNHELD = _unheld_refs()


class BlockPool:
    """Pools per (tier, group), the radix tree, the LRU clock, pending copies and block events.

    ``gpu``: the GPU tier's pools in group-id order; ``tree``: the radix tree; ``clock``: the LRU clock (a page
    unlocked now gets ``last_used = clock``; callers advance it with :meth:`tick`); ``stats``: shared running
    totals (the page-side counters are kept here).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        policy_factory: EvictionPolicyFactory,
        *,
        event_sink: EventSink | None = None,
        stats: ManagerStats | None = None,
        hasher: BlockKeyHasher | None = None,
    ) -> None:
        self.tokens_per_block = config.tokens_per_block
        self.groups: tuple[PoolGroupSpec, ...] = config.groups
        self.num_groups = len(self.groups)
        self.stats = stats if stats is not None else ManagerStats()
        self._sink = event_sink
        self._pools: list[list[PagePool]] = []
        for tier_cfg in config.tiers:
            t = tier_cfg.tier
            counts = config.pages_per_group(t)
            self._pools.append(
                [
                    PagePool(
                        g.group_id, tier_cfg.tier, counts[g.group_id], g.life_cycle, policy_factory(g, tier_cfg.tier)
                    )
                    for g in self.groups
                ]
            )
        for tier_pools in self._pools[:-1]:
            for pool in tier_pools:
                below = self._pools[pool.tier + 1][pool.group]
                pool.last = below.capacity == 0
        self.gpu: list[PagePool] = self._pools[0]
        self.tree = RadixTree(self.num_groups, default_hasher() if hasher is None else hasher)
        self.clock = 0
        self._copies: list[PageCopy] = []
        self._removed: list[int] = []
        # Tree blocks built once, here, and reused after they leave the tree (``new_block``), so a server that
        # freezes the collector after start-up creates no GC-tracked object per block it caches. Every block
        # holds a page of each full-attention group, so the first one's pages over all tiers bound the tree;
        # without full attention, the largest group's pages are a guess. More are made on demand.
        full = [g.group_id for g in self.groups if g.life_cycle.kind is LifeCycleKind.FULL]
        per_group = [sum(tier_pools[g].capacity for tier_pools in self._pools) for g in range(self.num_groups)]
        n_blocks = per_group[full[0]] if full else max(per_group, default=0)
        self._no_pages: list[None] = [None] * self.num_groups
        self._spare: deque[Block] = deque(
            Block(0, None, 0, 0, None, self.num_groups) for _ in range(min(n_blocks, MAX_PREALLOCATED_BLOCKS))
        )

    # --- introspection -----------------------------------------------------------------------------------------

    def pool(self, group: int, tier: Tier = Tier.GPU) -> PagePool:
        """The pages of one pool group in one tier."""
        if type(group) is not int:
            raise TypeError(f"group: expected an int pool group id, got {type(group).__name__}")
        if not isinstance(tier, int) or isinstance(tier, bool):
            raise TypeError(f"tier: expected a Tier, got {type(tier).__name__}")
        if tier < 0:
            raise ValueError(f"tier: expected a Tier, got {tier}")
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group: expected a pool group id in [0, {self.num_groups}), got {group}")
        if tier >= len(self._pools):
            raise ValueError(f"tier: this manager has no {Tier(tier).name} tier")
        return self._pools[tier][group]

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(Tier(i) for i in range(len(self._pools)))

    def all_pools(self) -> Iterator[PagePool]:
        """Every pool, tier by tier, in group-id order."""
        for tier_pools in self._pools:
            yield from tier_pools

    def can_allocate(self, pages_per_group: Sequence[int]) -> bool:
        """Whether that many GPU pages per group (group-id order) can be obtained now (read-only)."""
        if isinstance(pages_per_group, (str, bytes)) or not isinstance(pages_per_group, Sequence):
            raise TypeError(f"pages_per_group: expected a sequence of ints, got {type(pages_per_group).__name__}")
        for i, n in enumerate(pages_per_group):
            check_count(f"pages_per_group[{i}]", n)
        if len(pages_per_group) != self.num_groups:
            raise ValueError(f"pages_per_group: expected {self.num_groups} counts, got {len(pages_per_group)}")
        return self.has_pages(pages_per_group)

    def has_pages(self, need: Sequence[int]) -> bool:
        """:meth:`can_allocate` for counts the caller computed itself (no validation: the cache's growth path)."""
        # A loop, not all() over a generator: this runs on every cache growth.
        for nd, pool in zip(need, self.gpu):  # noqa: SIM110
            if nd and nd > len(pool.free) + pool.n_unlocked:
                return False
        return True

    def fits(self, need: Sequence[int], taken: Sequence[int]) -> bool:
        """Whether ``need`` GPU pages per group can be found after ``taken`` unlocked ones per group get locked."""
        for nd, tk, pool in zip(need, taken, self.gpu):
            if nd and nd > len(pool.free) + pool.n_unlocked - tk:
                return False
        return True

    # --- copies and events -------------------------------------------------------------------------------------

    def record_copy(self, copy: PageCopy) -> None:
        """Append a copy the runtime must execute before the next forward step."""
        self._copies.append(copy)

    def take_pending_copies(self) -> list[PageCopy]:
        """The copies recorded since the last call, in the order the runtime must execute them."""
        out, self._copies = self._copies, []
        return out

    @property
    def num_pending_copies(self) -> int:
        return len(self._copies)

    @property
    def pending_removals(self) -> tuple[int, ...]:
        """Keys of full blocks removed since the last :meth:`flush_events` (not announced yet)."""
        return tuple(self._removed)

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Send later block events to ``sink`` (None: drop them); a server attaches its publisher after setup."""
        if sink is not None and not callable(sink):
            raise TypeError(f"sink: expected a callable or None, got {type(sink).__name__}")
        self._sink = sink

    def flush_events(self) -> None:
        """Announce the blocks removed since the last call (one BlockRemoved)."""
        if self._removed:
            removed, self._removed = tuple(self._removed), []
            if self._sink is not None:
                self._sink(BlockRemoved(removed))

    def publish_stored(self, keys: Sequence[int], parent_key: int | None) -> None:
        """Announce full blocks that entered the tree (one BlockStored), after pending removals."""
        self.flush_events()
        if keys and self._sink is not None:
            self._sink(BlockStored(tuple(keys), parent_key, self.tokens_per_block))

    # --- page bookkeeping ----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Advance the LRU clock (pages unlocked after this are more recent than those before)."""
        self.clock += 1

    def eligible(self, page: Page) -> bool:
        """An unlocked committed page is an eviction candidate: anywhere above the last tier, else if droppable."""
        return not page.pool.last or not (page.pool.full_attention and page.block.children)  # type: ignore[union-attr]

    def lock(self, page: Page) -> None:
        if page.ref_count == 0:
            pool = page.pool
            pool.n_unlocked -= 1
            if page.policy_data is not None:
                pool.policy.discard(page)
        page.ref_count += 1

    def lock_block_pages(self, blocks: Sequence[Block], group: int) -> list[Page]:
        """:meth:`lock` the page of ``group`` of each of ``blocks`` (which all have one, a GPU page: a reused prefix
        of a full-attention group in a manager with one tier) and return those pages, in one pass."""
        pool = self.gpu[group]
        discard = pool.policy.discard
        out: list[Page] = []
        append = out.append
        taken = 0
        for b in blocks:
            page: Page = b.pages[group]  # type: ignore[assignment]
            if not page.ref_count:
                taken += 1
                if page.policy_data is not None:
                    discard(page)
            page.ref_count += 1
            append(page)
        pool.n_unlocked -= taken
        return out

    def lock_pages(self, pages: Sequence[Page]) -> None:
        """:meth:`lock` each of ``pages`` (a reused prefix: one call per request instead of one per block)."""
        for page in pages:
            if page.ref_count == 0:
                pool = page.pool
                pool.n_unlocked -= 1
                if page.policy_data is not None:
                    pool.policy.discard(page)
            page.ref_count += 1

    def unlock(self, page: Page) -> None:
        """Drop one reference to a committed page; at zero it becomes an eviction candidate."""
        page.ref_count -= 1
        if page.ref_count == 0:
            pool = page.pool
            pool.n_unlocked += 1
            page.last_used = self.clock
            # ``eligible`` inlined: this runs once per page of every cache that closes.
            if not pool.last or not (pool.full_attention and page.block.children):  # type: ignore[union-attr]
                pool.policy.add(page)

    def unlock_pages(self, pages: Sequence[Page]) -> None:
        """:meth:`unlock` each of ``pages``, in order (one call per cache release instead of one per page)."""
        clock = self.clock
        for page in pages:
            page.ref_count -= 1
            if page.ref_count == 0:
                pool = page.pool
                pool.n_unlocked += 1
                page.last_used = clock
                if not pool.last or not (pool.full_attention and page.block.children):  # type: ignore[union-attr]
                    pool.policy.add(page)

    def release_row(
        self, group: int, row: Sequence[Page | None], priority: int, own_from: int, shared: AbstractSet[int]
    ) -> None:
        """Give back a cache's pages of ``group`` (GPU pages, as every page a cache holds), deepest first (so that,
        at equal recency, policies see leaves before their ancestors): uncommitted ones to the free list,
        committed ones unlocked at ``priority`` (a block below ordinal ``own_from`` or in ``shared`` was reused:
        its priority only rises). What setting each priority then :meth:`unlock_pages` does, in one pass (every
        cache's close runs it)."""
        pool = self.gpu[group]
        clock = self.clock
        add = pool.policy.add
        any_leaf = not pool.last or not pool.full_attention  # else only childless blocks' pages are candidates
        # Uncommitted pages are the row's last ones (past its committed blocks).
        end = len(row)
        while end:
            p = row[end - 1]
            if p is not None:
                if p.block is not None:
                    break
                self.free_page(p)
            end -= 1
        # The committed pages' blocks form a path (each the parent of the next), so only the deepest can be
        # childless: the others' blocks (and their children dicts) are not read, which keeps a long row's
        # release from walking its blocks' memory.
        deepest = end - 1
        unlocked = 0
        for b in range(deepest, -1, -1):
            p = row[b]
            if p is None:  # a stale sliding-window block
                continue
            # Only a different priority can change anything (the common case is equal: skip both tests).
            if priority != p.priority and (priority > p.priority or (b >= own_from and b not in shared)):
                p.priority = priority
            p.ref_count -= 1
            if p.ref_count == 0:
                unlocked += 1
                p.last_used = clock
                if any_leaf or (b == deepest and not p.block.children):  # type: ignore[union-attr]
                    # n_unlocked counts this page before the policy sees it, as unlock() does.
                    pool.n_unlocked += unlocked
                    unlocked = 0
                    add(p)
        pool.n_unlocked += unlocked

    def attach(self, page: Page, block: Block, priority: int) -> None:
        """Put a fresh locked page (a snapshot) into ``block`` at ``priority`` and unlock it."""
        block.pages[page.pool.group] = page
        page.block = block
        page.priority = priority
        self.unlock(page)

    def free_page(self, page: Page) -> None:
        """Return a locked page that belongs to no tree block (ref_count 1) to its free list."""
        if page.block is not None or page.ref_count != 1:
            raise AssertionError(f"free_page: {page!r} is committed or shared")
        page.ref_count = 0
        page.pool.free.append(page)

    def free_committed(self, page: Page) -> None:
        """Free an unlocked committed page (its block slot is cleared by the caller)."""
        pool = page.pool
        if page.ref_count:
            raise AssertionError(f"free_committed: {page!r} is locked")
        pool.n_unlocked -= 1
        if page.policy_data is not None:
            pool.policy.discard(page)
        page.block = None
        pool.free.append(page)

    def alloc_page(self, group: int) -> Page | None:
        """One GPU page of ``group`` (locked, ref_count 1, in no block), evicting if needed; None if impossible."""
        pool = self.gpu[group]
        if not pool.free and not self.evict_one(pool):
            return None
        page = pool.free.pop()
        page.ref_count = 1
        return page

    def alloc_pages(self, group: int, n: int) -> list[Page]:
        """``n`` GPU pages of ``group`` where an availability check already promised them: the same pages, in the
        same order and after the same evictions, as ``n`` calls of :meth:`must_alloc` (in one call per request)."""
        pool = self.gpu[group]
        free = pool.free
        # What the free list holds now comes off its end without evicting anything.
        take = min(n, len(free))
        out = free[len(free) - take :]
        out.reverse()
        del free[len(free) - take :]
        for page in out:
            page.ref_count = 1
        if n > take and pool.last and pool.full_attention:
            self._drop_leaves(pool, n - take, out)  # its pages come locked (ref_count 1)
        else:
            for _ in range(n - take):
                if not free and not self.evict_one(pool):
                    raise AssertionError(f"group {group}: the availability check promised a page")
                page = free.pop()
                page.ref_count = 1
                out.append(page)
        return out

    def must_alloc(self, group: int) -> Page:
        """:meth:`alloc_page` where an availability check already promised the page."""
        page = self.alloc_page(group)
        if page is None:
            raise AssertionError(f"group {group}: the availability check promised a page")
        return page

    def onboard(self, host_page: Page) -> Page:
        """Replace a locked host page of a tree block by a fresh GPU page holding a copy of it."""
        gpu = self.must_alloc(host_page.pool.group)
        block = host_page.block
        assert block is not None
        g = host_page.pool.group
        block.pages[g] = gpu
        gpu.block = block
        gpu.priority = host_page.priority
        gpu.ref_count = host_page.ref_count
        self._copies.append(PageCopy(g, host_page.pool.tier, host_page.index, Tier.GPU, gpu.index))
        host_page.ref_count = 0
        host_page.block = None
        host_page.pool.free.append(host_page)
        self.stats.onboarded_pages += 1
        return gpu

    # --- tree blocks ---------------------------------------------------------------------------------------------

    def new_block(self, key: int, parent: Block, depth: int, num_tokens: int, tokens: tuple[int, ...] | None) -> Block:
        """A block in no tree yet (no pages, no children): a spare one when one is free, else a new one."""
        spare = self._spare
        while spare:
            b = spare.popleft()
            # Reused only when nothing but this frame refers to it (``_UNHELD``): no holder of a removed block (a
            # match, a policy, a test) can see it come back as another block.
            if _getrefcount(b) == _UNHELD and not b.children:
                b.key = key
                b.parent = parent
                b.depth = depth
                b.num_tokens = num_tokens
                b._tokens = tokens  # in no tree: no token index to update
                return b
        return Block(key, parent, depth, num_tokens, tokens, self.num_groups)

    def new_chain(
        self,
        parent: Block,
        keys: Sequence[int],
        first: int,
        rows: Sequence[tuple[int, Sequence[Page | None]]],
        priority: int,
    ) -> list[Block]:
        """New full blocks, each the child of the one before (the first of ``parent``), one per key in ``keys``;
        block ``i`` is ordinal ``first + i`` and takes page ``row[first + i]`` (where not None) of each
        ``(group, row)`` in ``rows`` at ``priority``. The caller counts them into the tree and announces them."""
        # :meth:`new_block` inlined for one group: that loop is the cost of every block a plain cache inserts.
        spare = self._spare
        tpb, num_groups = self.tokens_per_block, self.num_groups
        getrefcount, unheld = _getrefcount, _UNHELD
        out: list[Block] = []
        append = out.append
        if len(rows) == 1:
            # One attention group (the common layout): the row's pages walked beside the keys, no inner loop.
            g, row = rows[0]
            if first + len(keys) > len(row):
                raise IndexError(f"new_chain: the row holds {len(row)} page slots, not {first + len(keys)}")
            fresh = False
            for ordinal, h, p in zip(count(first), keys, row[first : first + len(keys)]):
                while spare:
                    child = spare.popleft()
                    if getrefcount(child) == unheld and not child.children:  # see new_block
                        child.key = h
                        child.parent = parent
                        child.depth = ordinal
                        child.num_tokens = tpb
                        child._tokens = None  # in no tree: no token index to update
                        break
                else:
                    child = Block(h, parent, ordinal, tpb, None, num_groups)
                if fresh:
                    # The parent was made just above (no children): a new key for a block without tokens, so
                    # Children.__setitem__ would only stamp it.
                    child.seq = next_seq()
                    _dict_setitem(parent.children, h, child)
                else:
                    parent.children[h] = child
                    fresh = True
                if p is not None:
                    child.pages[g] = p
                    p.block = child
                    p.priority = priority
                append(child)
                parent = child
            return out
        new_block = self.new_block  # (several groups: not the inlined path)
        for ordinal, h in zip(count(first), keys):
            child = new_block(h, parent, ordinal, tpb, None)
            parent.children[h] = child
            cpages = child.pages
            for g, row in rows:
                p = row[ordinal]
                if p is not None:
                    cpages[g] = p
                    p.block = child
                    p.priority = priority
            append(child)
            parent = child
        return out

    # --- eviction ------------------------------------------------------------------------------------------------

    def evict(self, group: int, num_pages: int, tier: Tier = Tier.GPU) -> int:
        """Reclaim up to ``num_pages`` unlocked pages of ``group`` in ``tier`` (moved down or dropped) into the
        free list. Returns how many were reclaimed. Locked pages are never touched."""
        check_count("num_pages", num_pages)
        pool = self.pool(group, tier)
        done = 0
        while done < num_pages and pool.n_unlocked and self.evict_one(pool):
            done += 1
        self.flush_events()
        return done

    def evict_one(self, pool: PagePool) -> bool:
        """Turn one unlocked page of ``pool`` into a free one: move it a tier down, else drop it."""
        victim = pool.policy.pop_victim()
        if victim is None:
            return False
        if not pool.last:
            below = self._pools[pool.tier + 1][pool.group]
            room = bool(below.free)
            if not room:
                # Pinned while the tier below makes room: dropping a block there may make this victim's block
                # a leaf again, and that cascade must not put the victim back into the policy.
                victim.ref_count += 1
                room = self.evict_one(below)
                victim.ref_count -= 1
            if room:
                self._move(victim, below.free.pop())
                return True
            if pool.full_attention and victim.block.children:  # type: ignore[union-attr]
                # No room below and the victim holds descendants up: drop a leaf instead (one always exists
                # among the unlocked pages, since a locked leaf would lock its whole path).
                pool.policy.add(victim)
                victim = pool.policy.pop_victim(lambda p: not p.block.children)  # type: ignore[union-attr]
                if victim is None:
                    return False
        self.drop(victim)
        return True

    def _move(self, src: Page, dst: Page) -> None:
        block = src.block
        assert block is not None
        g = src.pool.group
        block.pages[g] = dst
        dst.block = block
        dst.priority = src.priority
        dst.last_used = src.last_used
        self._copies.append(PageCopy(g, src.pool.tier, src.index, dst.pool.tier, dst.index))
        src.pool.n_unlocked -= 1
        src.block = None
        src.pool.free.append(src)
        dst.pool.n_unlocked += 1
        if self.eligible(dst):
            dst.pool.policy.add(dst)
        if dst.pool.tier > src.pool.tier:
            self.stats.offloaded_pages += 1
        else:
            self.stats.onboarded_pages += 1

    def drop(self, page: Page) -> None:
        """Drop an unlocked page from the last tier it lives in; a full-attention page takes its block along."""
        block = page.block
        assert block is not None
        self.stats.dropped_pages += 1
        if page.pool.full_attention:
            self.remove_block(block)
            return
        block.pages[page.pool.group] = None
        self.free_committed(page)
        if not block.children and block.pages.count(None) == len(block.pages):
            self.remove_block(block)

    def remove_block(self, block: Block, take_from: PagePool | None = None) -> Page | None:
        """Take a block (and then every ancestor left without pages or children) out of the tree. An ancestor that
        keeps pages but loses its last child has its unlocked pages become eviction candidates; with ``take_from``
        (a pool whose policy has ``add_unless_next``, for a caller about to pop that pool's next victim), such a
        page of ``take_from`` is offered through ``add_unless_next`` and returned when it is that victim (not
        queued). Returns None otherwise."""
        # free_committed and eligible inlined: this runs for every block dropped from the tree.
        spare, removed, tpb = self._spare, self._removed, self.tokens_per_block
        no_pages = self._no_pages
        taken: Page | None = None
        n = 0
        while True:
            pages = block.pages
            for p in pages:
                if p is not None:
                    if p.ref_count:
                        raise AssertionError(f"remove_block: {p!r} is locked")
                    pool = p.pool
                    pool.n_unlocked -= 1
                    if p.policy_data is not None:
                        pool.policy.discard(p)
                    p.block = None
                    pool.free.append(p)
            pages[:] = no_pages
            parent = block.parent
            assert parent is not None
            if block._tokens is None:  # Children.__delitem__ inlined: no token index entry to drop
                _dict_delitem(parent.children, block.key)
            else:
                del parent.children[block.key]
            spare.append(block)
            n += 1
            if block.num_tokens == tpb:
                removed.append(block.key)
            if parent.parent is None or parent.children:
                break
            if parent.pages != no_pages:  # the parent still holds a page
                # Its last child is gone: its full-attention pages in their last tier may now be dropped (any
                # unlocked committed page of a childless block is a candidate).
                for p in parent.pages:
                    if p is not None and p.ref_count == 0 and p.policy_data is None:
                        if taken is None and p.pool is take_from:
                            if take_from.policy.add_unless_next(p):  # type: ignore[attr-defined]
                                taken = p
                        else:
                            p.pool.policy.add(p)
                break
            block = parent
        self.tree.num_blocks -= n
        self.stats.removed_blocks += n
        return taken

    def _drop_leaves(self, pool: PagePool, k: int, out: list[Page]) -> None:
        """Evict ``k`` victims from ``pool`` (last tier, full attention, empty free list), each dropping its block
        (:meth:`remove_block`), their pages appended to ``out`` in eviction order and locked (ref_count 1, as
        :meth:`alloc_pages` hands them out): what ``k`` calls of :meth:`evict_one` then ``free.pop()`` do, in one
        loop, since it is the cost of every block a full cache admits. A victim's parent that becomes a leaf is
        often the next victim: the policy hands it back at once (``add_unless_next``, when it has it) instead of
        queueing it for the next pop."""
        policy = pool.policy
        pop_victim = policy.pop_victim
        take_next = getattr(policy, "add_unless_next", None) is not None
        if self.num_groups == 1 and take_next:
            self._drop_leaves_one_group(pool, k, out)
            return
        free = pool.free
        remove_block = self.remove_block
        victim: Page | None = None
        for left in range(k, 0, -1):
            if victim is None:
                victim = pop_victim()
                if victim is None:
                    raise AssertionError(f"group {pool.group}: the availability check promised a page")
            block = victim.block
            assert block is not None
            # The last victim takes no successor: nothing pops after it.
            victim = remove_block(block, pool if take_next and left > 1 else None)
            page = free.pop()
            page.ref_count = 1
            out.append(page)
        self.stats.dropped_pages += k

    def gain_child(self, parent: Block) -> None:
        """``parent`` (not a root) gets its first child: its last-tier full-attention pages stop being droppable."""
        for p in parent.pages:
            if p is not None and p.policy_data is not None and p.pool.last and p.pool.full_attention:
                p.pool.policy.discard(p)

    def _drop_leaves_one_group(self, pool: PagePool, k: int, out: list[Page]) -> None:
        """:meth:`_drop_leaves` for a layout of one pool group whose policy has ``add_unless_next``: a block
        holds one page, so a victim's block frees the victim alone (appended to ``out`` directly, not through
        the free list, which is empty here) and the pool's unlocked count drops by ``k`` at the end (nothing in
        this loop reads it). A victim is popped, then its parent follows it at once while the parent is the next
        victim (a request's path leaves leaf first), without a pop. With the default policy itself (not a
        subclass, no ``on_victim``), its ``add_unless_next`` is inlined: the test against the heads of its sorted
        run and heap, with its sequence number kept in a local and written back before any ``add``."""
        policy = pool.policy
        pop_victim, take_next = policy.pop_victim, policy.add_unless_next  # type: ignore[attr-defined]
        inline = type(policy) is PrioritizedLRU and policy.on_victim is None
        run, heap = (policy._run, policy._heap) if inline else ((), ())  # type: ignore[attr-defined]
        seq: int = policy._seq if inline else 0  # type: ignore[attr-defined]
        spare_append, removed_append, out_append = self._spare.append, self._removed.append, out.append
        tpb = self.tokens_per_block
        n = k  # blocks removed: each victim's, plus ancestors left with no page (counted below)
        left = k
        while left:
            victim: Page | None = pop_victim()
            if victim is None:
                raise AssertionError(f"group {pool.group}: the availability check promised a page")
            while True:  # the victim, then each parent that becomes the next victim
                if victim.ref_count:
                    raise AssertionError(f"_drop_leaves: {victim!r} is locked")
                block: Block = victim.block  # type: ignore[assignment]
                block.pages[0] = None
                victim.block = None
                victim.ref_count = 1  # handed out locked
                out_append(victim)
                left -= 1
                while True:  # the block, then each ancestor left with no page and no child, leaves the tree
                    parent: Block = block.parent  # type: ignore[assignment]
                    key = block.key
                    if block._tokens is None:  # as in remove_block
                        _dict_delitem(parent.children, key)
                    else:
                        del parent.children[key]
                    spare_append(block)
                    if block.num_tokens == tpb:
                        removed_append(key)
                    if parent.parent is None or parent.children:
                        p = None
                        break
                    p = parent.pages[0]
                    if p is not None:
                        break
                    block = parent
                    n += 1
                # The parent, now a leaf, holds ``p``: if unlocked it becomes a candidate, and is taken at once when
                # it is the next victim (add_unless_next added it otherwise).
                if p is None or p.ref_count or p.policy_data is not None:
                    break
                if not left or p.pool is not pool:
                    if inline:
                        policy._seq = seq  # type: ignore[attr-defined]
                        p.pool.policy.add(p)
                        seq = policy._seq  # type: ignore[attr-defined]
                    else:
                        p.pool.policy.add(p)
                    break
                if inline:
                    # PrioritizedLRU.add_unless_next: taken when it sorts before both heads.
                    entry = (p.priority, p.last_used, -parent.depth, seq + 1, p.index)
                    if (run and not entry < run[0]) or (heap and not entry < heap[0]):
                        policy._seq = seq  # type: ignore[attr-defined]
                        policy.add(p)
                        seq = policy._seq  # type: ignore[attr-defined]
                        break
                    seq += 1
                elif not take_next(p):
                    break
                victim = p
        if inline:
            policy._seq = seq  # type: ignore[attr-defined]
        pool.n_unlocked -= k
        self.stats.dropped_pages += k
        self.tree.num_blocks -= n
        self.stats.removed_blocks += n
