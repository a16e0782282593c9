"""Hit-density eviction of recurrent snapshots: value times expected reuses per slot-time.

:class:`HitDensitySnapshotPolicy` orders one recurrent pool's candidates by priority, then by
``value * index(class, age)``, then by age. ``index`` is a Gittins index (LHD's hit density) of the reuse
process learned online from this pool: per class (use count so far, or superseded) and age bin, the rates at
which snapshots are reused and at which their block leaves the tree. Evicted snapshots stay as ghosts while
their block is in the tree, so re-creating one there counts as a reuse and the estimates do not depend on what
the policy kept. O(log n) per operation plus ``max_walk``-bounded walks, O(n + classes * bins^2) per refresh.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvforge.kvcache.eviction import HeapEntry, LazyHeapPolicy, heap_field
from kvforge.kvcache.snapshot_policy.cost import prefix_tokens

if TYPE_CHECKING:
    from kvforge.kvcache.pools import Block, Page

__all__ = ["HitDensitySnapshotPolicy"]


class _Life:
    """The current lifetime of a snapshot position (a tree block): since its snapshot was created or last
    reused. It outlives an evicted snapshot (a *ghost*) as long as the block stays in the tree, so that a request
    that would have reused it still counts as a reuse."""

    __slots__ = ("block", "born", "cls", "page", "uses", "value")

    def __init__(self, block: Block, born: int, cls: int, uses: int) -> None:
        self.block = block
        self.born = born
        self.cls = cls
        self.uses = uses
        self.page: Page | None = None
        self.value = 0.0


class _Entry(HeapEntry):
    """``(priority, score, born, seq, page, life)``: ordered by the first four."""

    __slots__ = ()

    priority = heap_field(0, "The page's eviction priority (lowest first).")
    score = heap_field(1, "Value times the index at the entry's age bin when keyed.")
    born = heap_field(2, "Start of the lifetime (older first at equal score).")
    life = heap_field(5, "The snapshot position's lifetime record.")


def _attached(block: Block) -> bool:
    """Whether ``block`` is still in its tree (a removed block is deleted from its parent's children)."""
    parent = block.parent
    return parent is not None and parent.children.get(block.key) is block


class HitDensitySnapshotPolicy(LazyHeapPolicy):
    """Evicts the snapshot with the lowest expected prefill FLOPs saved per unit of slot-time (module docstring).

    Order: lowest ``priority`` first, then lowest score ``value * index(class, age)``, then the oldest lifetime.
    ``value`` is :class:`CostAwareSnapshotPolicy`'s (per reuse, ``value_fn`` of the prefix, taken over the nearest
    snapshot below when ``marginal``), except that a superseded snapshot below is not a fallback (it is about to
    go). ``index`` is the best ratio, over every horizon, of the expected reuses to the expected slot-time the
    snapshot holds from its age on (a Gittins index of its reuse process; LHD's hit density), from the reuse and
    removal rates this pool has observed for snapshots of the same class at each age:

    * Age: candidate insertions into this pool since the snapshot was created or last reused.
    * Class: the number of times the position was used, capped at ``reuse_classes`` (a conversation's turn
      count: later turns are likelier to be followed), and one class for snapshots superseded by a deeper one on
      an unbranched path (``supersede``: the successor takes over the use count).
    * Reuses are counted for evicted snapshots too: the lifetime stays as a ghost while its block is in the tree,
      and a snapshot re-created there (a later prompt's branch point: it would have matched) is a reuse. So the
      statistics do not depend on what this policy chose to keep.
    * Removal: a lifetime ends without reuse when its block leaves the tree (its attention pages were evicted),
      which also frees a kept snapshot: a competing risk that shortens the expected holding time.
    * Rates are occurrences over exposure per age bin (``bins_per_octave`` log-spaced bins), recomputed every
      ``refresh_every`` insertions; an age bin with little exposure leans on the rate of the bin before it
      (``prior_lifetimes`` pseudo-lifetimes), and until the first reuse is seen every index is 1 (order by value).

    Scores change when an age crosses a bin edge (processed before each eviction) and when the rates are
    recomputed (every entry is re-keyed); a value that grew since it was keyed (an ancestor snapshot went) is
    re-scored when the entry comes up as a victim. O(log n) per operation plus ``max_walk``-bounded tree walks,
    and O(n + classes * bins^2) per refresh.
    """

    __slots__ = (
        "_discarded",
        "_due",
        "_ended",
        "_ended_part",
        "_events",
        "_hits",
        "_index",
        "_lives",
        "_now",
        "_oldest",
        "_removals",
        "_tpb",
        "_value_fn",
        "_widths",
        "edges",
        "marginal",
        "max_walk",
        "prior_lifetimes",
        "refresh_every",
        "reuse_classes",
        "supersede",
    )

    def __init__(
        self,
        value_fn: Callable[[int], float],
        tokens_per_block: int,
        *,
        reuse_classes: int = 4,
        marginal: bool = True,
        supersede: bool = True,
        bins_per_octave: int = 4,
        max_age: int = 1 << 20,
        refresh_every: int = 256,
        prior_lifetimes: float = 10.0,
        max_walk: int = 256,
    ) -> None:
        if not callable(value_fn):
            raise TypeError(f"value_fn: expected a callable, got {type(value_fn).__name__}")
        for name, v, lo in (
            ("tokens_per_block", tokens_per_block, 1),
            ("reuse_classes", reuse_classes, 1),
            ("bins_per_octave", bins_per_octave, 1),
            ("max_age", max_age, 2),
            ("refresh_every", refresh_every, 1),
            ("max_walk", max_walk, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < lo:
                raise ValueError(f"{name}: expected >= {lo}, got {v}")
        if isinstance(prior_lifetimes, bool) or not isinstance(prior_lifetimes, (int, float)):
            raise TypeError(f"prior_lifetimes: expected a number, got {type(prior_lifetimes).__name__}")
        if not prior_lifetimes >= 0:  # NaN too
            raise ValueError(f"prior_lifetimes: expected >= 0, got {prior_lifetimes}")
        super().__init__()
        self._value_fn = value_fn
        self._tpb = tokens_per_block
        self.reuse_classes = reuse_classes
        self.marginal = marginal
        self.supersede = supersede
        self.refresh_every = refresh_every
        self.prior_lifetimes = float(prior_lifetimes)
        self.max_walk = max_walk
        top = int(math.log2(max_age) * bins_per_octave)
        # Bin b covers ages [edges[b], edges[b + 1]); the last bin is open.
        self.edges = (0, *sorted({int(2 ** (k / bins_per_octave)) for k in range(top + 1)}))
        nb = len(self.edges)
        self._widths = [float(self.edges[b + 1] - self.edges[b]) for b in range(nb - 1)] + [math.inf]
        ncls = reuse_classes + 1  # the last class: superseded snapshots
        self._hits = [[0.0] * nb for _ in range(ncls)]
        self._removals = [[0.0] * nb for _ in range(ncls)]
        self._ended = [[0.0] * nb for _ in range(ncls)]  # lifetimes that ended with their age in bin b
        self._ended_part = [[0.0] * nb for _ in range(ncls)]  # ... and their ages past the bin's start, summed
        self._index = [[1.0] * nb for _ in range(ncls)]
        self._events = 0
        self._lives: dict[int, _Life] = {}
        self._due: list[tuple[int, int, _Entry]] = []  # (time the entry's age crosses a bin edge, seq, entry)
        self._oldest: deque[tuple[int, int]] = deque()  # (born, block key) in birth order, for _reap
        self._discarded: list[_Life] = []  # lifetimes whose page was discarded since the last _reap
        self._now = 0

    # --- introspection ---------------------------------------------------------------------------------------

    @property
    def superseded_class(self) -> int:
        return self.reuse_classes

    def age_bin(self, age: int) -> int:
        return bisect_right(self.edges, age) - 1

    def index(self, cls: int, age: int) -> float:
        """The current index of a snapshot of class ``cls`` at ``age`` (expected reuses per insertion held)."""
        return self._index[cls][self.age_bin(age)]

    def life(self, page: Page) -> tuple[int, int, int] | None:
        """``(class, age, uses)`` of the lifetime at ``page``'s block, or None."""
        block = page.block
        life = None if block is None else self._lives.get(block.key)
        if life is None or life.block is not block:
            return None
        return life.cls, self._now - life.born, life.uses

    def observed(self) -> list[tuple[float, float, float]]:
        """Per class (the superseded class last): reuses, removals and lifetimes ended, seen so far."""
        return [(sum(h), sum(r), sum(e)) for h, r, e in zip(self._hits, self._removals, self._ended, strict=True)]

    def score(self, page: Page) -> float:
        """``value * index`` of a candidate ``page`` now (0 when it is not one)."""
        entry = page.policy_data
        if not isinstance(entry, _Entry) or entry.page is not page:
            return 0.0
        life: _Life = entry.life
        return life.value * self.index(life.cls, self._now - life.born)

    def ordered(self) -> list[Page]:
        """Candidates in eviction order at the current scores (read-only)."""
        live: list[_Entry] = [e for e in self._heap if e.page is not None]
        live.sort(key=lambda e: (e.priority, self.score(e.page), e.life.born, e.seq))
        return [e.page for e in live]

    # --- values --------------------------------------------------------------------------------------------

    def _prefix(self, block: Block | None) -> int:
        return prefix_tokens(block, self._tpb)

    def value(self, page: Page) -> float:
        """What one reuse of ``page`` saves over the nearest snapshot below that is not superseded."""
        block = page.block
        v = self._value_fn(self._prefix(block))
        if self.marginal and block is not None:
            g = page.pool.group
            sup = self.reuse_classes
            node = block.parent
            for _ in range(self.max_walk):
                if node is None or node.depth < 0:
                    break
                if node.pages[g] is not None:
                    # A superseded snapshot will not be there for the next turn: it is no fallback.
                    below = self._lives.get(node.key)
                    if below is None or below.block is not node or below.cls != sup:
                        v -= self._value_fn(self._prefix(node))
                        break
                node = node.parent
        return max(v, 0.0)

    def _class(self, uses: int) -> int:
        return min(uses, self.reuse_classes) - 1

    # --- statistics ------------------------------------------------------------------------------------------

    def _end(self, life: _Life, reused: bool, removed: bool = False) -> None:
        age = self._now - life.born
        b = self.age_bin(age)
        c = life.cls
        self._ended[c][b] += 1.0
        self._ended_part[c][b] += age - self.edges[b]
        if reused:
            self._hits[c][b] += 1.0
            self._events += 1
        elif removed:
            self._removals[c][b] += 1.0

    def _reap(self) -> None:
        """End, now rather than at the next refresh, the lifetimes whose block has left the tree: those whose page
        was just discarded (freed with its block, unless it was only locked for a reuse) and the oldest ones
        (attention pages go in LRU order, so the oldest positions are the ones that lose their blocks)."""
        if self._discarded:
            for dead in self._discarded:
                if dead.page is None and self._lives.get(dead.block.key) is dead and not _attached(dead.block):
                    self._end(dead, False, removed=True)
                    del self._lives[dead.block.key]
            self._discarded.clear()
        oldest = self._oldest
        for _ in range(8):
            if not oldest:
                break
            born, key = oldest[0]
            life = self._lives.get(key)
            if life is None or life.born != born:
                oldest.popleft()  # reborn or gone since: a stale entry
            elif life.page is None and not _attached(life.block):
                self._end(life, False, removed=True)
                del self._lives[key]
                oldest.popleft()
            else:
                # Still there (a block kept by its descendants can outlive many younger ones): look again later
                # rather than let it hold the queue up.
                oldest.rotate(-1)
                break

    def _refresh(self) -> None:
        """End the lifetimes whose block left the tree, re-estimate the rates and indexes, re-key every entry."""
        nb = len(self.edges)
        ncls = len(self._hits)
        open_n = [[0.0] * nb for _ in range(ncls)]
        open_part = [[0.0] * nb for _ in range(ncls)]
        gone = []
        for key, life in self._lives.items():
            if life.page is None and not _attached(life.block):
                self._end(life, False, removed=True)
                gone.append(key)
                continue
            age = self._now - life.born
            b = self.age_bin(age)
            open_n[life.cls][b] += 1.0
            open_part[life.cls][b] += age - self.edges[b]
        for key in gone:
            del self._lives[key]
        if self._events:
            self._estimate(open_n, open_part)
        self._rekey_all()

    def _estimate(self, open_n: list[list[float]], open_part: list[list[float]]) -> None:
        nb = len(self.edges)
        w = self._widths
        exposure = []
        for c in range(len(self._hits)):
            ex = [0.0] * nb
            beyond = 0.0
            for b in range(nb - 1, -1, -1):
                # Every lifetime that got past bin b spent its whole width there; the others part of it.
                ex[b] = (w[b] * beyond if beyond else 0.0) + self._ended_part[c][b] + open_part[c][b]
                beyond += self._ended[c][b] + open_n[c][b]
            exposure.append(ex)
        total = sum(map(sum, exposure))
        pooled_r = sum(map(sum, self._hits)) / total if total else 0.0
        pooled_d = sum(map(sum, self._removals)) / total if total else 0.0
        k = self.prior_lifetimes
        for c in range(len(self._hits)):
            ex, hits, rem = exposure[c], self._hits[c], self._removals[c]
            rate, death = [0.0] * nb, [0.0] * nb
            prev_r, prev_d = pooled_r, pooled_d
            for b in range(nb):
                # A sparse bin leans on the bin before it: hazards change smoothly with age, and an age nobody
                # has reached yet is assumed to continue the last one seen.
                kb = k * (w[b] if b < nb - 1 else w[b - 1])
                den = ex[b] + kb
                if den > 0:
                    prev_r = (hits[b] + kb * prev_r) / den
                    prev_d = (rem[b] + kb * prev_d) / den
                rate[b], death[b] = prev_r, prev_d
            self._index[c] = self._gittins(rate, death)

    def _gittins(self, rate: list[float], death: list[float]) -> list[float]:
        """For each start bin ``a``: the best over horizons ``T`` of expected reuses in ``[a, T]`` per expected
        slot-time held there, with constant rates inside each bin; the holding ends at a reuse or a removal."""
        nb = len(rate)
        w = self._widths
        out = [0.0] * nb
        for a in range(nb):
            surv = 1.0
            reuses = held = best = 0.0
            for x in range(a, nb):
                lam = rate[x] + death[x]
                if lam > 0.0:
                    stay = math.exp(-lam * w[x]) if w[x] != math.inf else 0.0
                    reuses += surv * rate[x] / lam * (1.0 - stay)
                    held += surv * (1.0 - stay) / lam
                    surv *= stay
                elif w[x] == math.inf:
                    break
                else:
                    held += surv * w[x]
                if held > 0.0 and reuses > best * held:
                    best = reuses / held
                if surv < 1e-9:
                    break
            out[a] = best
        return out

    # --- heap entries ----------------------------------------------------------------------------------------

    def _key(self, page: Page, life: _Life) -> _Entry:
        """A heap entry for ``page`` at its current score, with its next bin crossing scheduled."""
        age = self._now - life.born
        b = self.age_bin(age)
        self._seq += 1
        entry = _Entry((page.priority, life.value * self._index[life.cls][b], life.born, self._seq, page, life))
        if b + 1 < len(self.edges):
            heapq.heappush(self._due, (life.born + self.edges[b + 1], self._seq, entry))
        return entry

    def _rekey(self, entry: _Entry) -> None:
        page, life = entry.page, entry.life
        entry.page = None
        new = self._key(page, life)
        page.policy_data = new
        heapq.heappush(self._heap, new)

    def _rekey_all(self) -> None:
        live = [e for e in self._heap if e.page is not None]
        self._due = []
        fresh = []
        for e in live:
            new = self._key(e.page, e.life)
            e.page.policy_data = new
            fresh.append(new)
        heapq.heapify(fresh)
        self._heap = fresh

    def _advance(self) -> None:
        """Re-key the entries whose age crossed a bin edge since they were keyed."""
        due = self._due
        while due and due[0][0] <= self._now:
            _, _, entry = heapq.heappop(due)
            if entry.page is not None and entry.page.policy_data is entry:
                self._rekey(entry)

    # --- EvictionPolicy --------------------------------------------------------------------------------------

    def add(self, page: Page) -> None:
        self._require_new(page)
        self._reap()
        self._now += 1
        block = page.block
        if block is None:
            # Not a tree snapshot (no position to learn about): valued 0, evicted first.
            life = _Life(None, self._now, 0, 1)  # type: ignore[arg-type]
        else:
            found = self._lives.get(block.key)
            if found is not None and found.block is not block:
                # The block was removed and re-created since: that lifetime ended without a reuse.
                self._end(found, False, removed=True)
                found = None
            if found is not None:
                # Reused (unlocked after serving as a match's source) or re-created where a ghost lies.
                life = found
                self._end(life, True)
                life.uses += 1
                life.born = self._now
                life.cls = self._class(life.uses)
            else:
                uses = self._inherit(page) if self.supersede else 1
                life = _Life(block, self._now, self._class(uses), uses)
                self._lives[block.key] = life
            life.value = self.value(page)
            self._oldest.append((life.born, block.key))
        life.page = page
        self._push(page, self._key(page, life))
        if self._now % self.refresh_every == 0:
            self._refresh()

    def _inherit(self, page: Page) -> int:
        """``supersede``: a new snapshot whose nearest snapshot position below (a kept snapshot or a ghost: making
        room for this one may just have evicted it) lies on an unbranched path continues that stream; it takes over
        the use count, and the one below moves to the superseded class."""
        block = page.block
        node = block.parent if block is not None else None
        below = None
        for _ in range(self.max_walk):
            if node is None or node.depth < 0:
                return 1
            below = self._lives.get(node.key)
            if below is not None and below.block is node:
                break
            node = node.parent
        else:
            return 1
        if below is None or len(node.children) != 1 or below.cls == self.reuse_classes:
            return 1
        # Not a death nor a reuse: the lifetime leaves its class (censored) and restarts as superseded.
        age = self._now - below.born
        b = self.age_bin(age)
        self._ended[below.cls][b] += 1.0
        self._ended_part[below.cls][b] += age - self.edges[b]
        below.cls = self.reuse_classes
        below.born = self._now
        self._oldest.append((below.born, node.key))
        entry = below.page.policy_data if below.page is not None else None
        if isinstance(entry, _Entry) and entry.page is below.page:
            self._rekey(entry)
        return max(1, below.uses)

    def discard(self, page: Page) -> None:
        entry = page.policy_data
        if entry is not None and entry.page is page:
            life = entry.life
            life.page = None
            if life.block is not None:
                self._discarded.append(life)
        super().discard(page)

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        self._reap()
        self._advance()
        victim = super().pop_victim(accept)
        if victim is not None and victim.block is not None:
            life = self._lives.get(victim.block.key)
            if life is not None and life.page is victim:
                life.page = None  # a ghost from now on
        return victim

    def _settle(self, entry: _Entry, settled: set[int]) -> bool:
        page, life = entry.page, entry.life
        if self.marginal and id(page) not in settled and page.block is not None:
            settled.add(id(page))
            # A snapshot below may have gone since this one was valued: its value can only have grown.
            v = self.value(page)
            if v > life.value * (1.0 + 1e-12) + 1e-300:
                life.value = v
                entry.score = v * self._index[life.cls][self.age_bin(self._now - life.born)]
                heapq.heappush(self._heap, entry)
                return False
        return True
