"""What a recurrent-state snapshot is worth, and an eviction policy that keeps the valuable ones.

A snapshot is the recurrent state of every linear-attention layer saved at one block boundary. It takes the
same bytes whatever the prefix it stands for, but what it saves differs enormously: reusing a snapshot after
``L`` tokens skips the prefill of those ``L`` tokens, whose cost grows with ``L`` (linearly in the dense and
recurrent parts, quadratically in the attention layers). Plain LRU treats a 1k-token and a 100k-token snapshot
alike; the short-prompt rule (``HybridCachePolicy.low_priority_snapshot_prompt_len``) is a one-threshold
approximation of the difference.

:class:`ModelCostSpec` describes a hybrid model's cache layout and prefill cost. :data:`KIMI_K3_LIKE` is the
default, with these **assumptions** (a Kimi-K2-sized MoE with Kimi-Linear-style KDA layers; the exact K3
numbers are not public):

* 61 layers, hidden size 7168, ~32e9 active parameters per token (2 FLOPs each per token).
* 3:1 linear-attention (KDA) to MLA: layer ``i`` is MLA when ``i % 4 == 3`` and for the last layer (60), so
  16 MLA layers and 45 KDA layers.
* MLA: 576 cached elements per token per layer (512 latent + 64 rope) in bf16, so 18,432 bytes per token over
  the 16 layers; its context attention costs ``2 * 64 heads * (192 + 128) * t`` FLOPs per layer for the token
  at position ``t`` (the non-absorbed context form of NOTES §1).
* KDA: 64 heads of 128x128 fp32 state (4 MiB) plus a width-4 short-convolution state for q, k, v
  (3 * 3 * 8192 bf16 = 147,456 bytes): 4,341,760 bytes per layer, 195.4 MB per snapshot over 45 layers, about
  the MLA cache of 10,600 tokens. Its per-token compute (``~4 * heads * 128 * 128`` per layer) is small.

:class:`CostAwareSnapshotPolicy` is an :class:`~kvforge.kvcache.eviction.EvictionPolicy` for recurrent pools:
within a priority it evicts the snapshot with the lowest *GreedyDual* score ``H = clock + weight * value`` and
``clock`` is the score of the last victim. The clock is what ages entries: a page's score is fixed when it becomes
a candidate (each reuse refreshes it), and every eviction raises the bar that newer pages start from, so an
expensive snapshot that nobody touches is eventually evicted by cheap fresh ones. ``cost_exponent`` trades cost
against recency (0: pure FIFO-by-last-use, i.e. LRU; 1: classic GreedyDual-Size). What the defaults of
:func:`cost_aware_eviction` add (each can be turned off):

* ``marginal``: ``value`` is the prefill FLOPs (per byte) a snapshot saves *over the nearest snapshot below it*,
  not its whole prefix's: evicting it makes a request fall back there. Evicting a snapshot below raises it
  (re-scored lazily when it comes up as a victim).
* ``frequency``: ``weight`` counts the snapshot's uses (GreedyDual-Size-Frequency).
* ``supersede``: a new snapshot continuing an unbranched path (a conversation's next turn) takes over the use
  count of the snapshot it replaces, whose weight drops to 0: the next turn will extend the new one. So the
  deepest snapshot of a live conversation is protected and the turns it superseded go first; branch points
  (blocks with several children) keep their counts.

Only the snapshot a match actually starts from is refreshed: the manager locks and unlocks just the source of
the live-state copy, not the other snapshots on the matched path (SGLang's finding, NOTES §2).

:class:`HitDensitySnapshotPolicy` weighs the same value against *when* reuses come instead of against recency. In
the Mooncake conversation trace a conversation's next turn comes typically 140 to 1,700 requests after the previous
one (median about 430), and only about a quarter of first turns get one (about half of third turns): LRU and the
GreedyDual clock evict almost every snapshot long before that, and keep the fresh ones, whose reuse is furthest
away. The policy learns, online and per pool, how likely a snapshot of a class (its use count so far; superseded)
is to be reused at each age and how likely its block is to leave the tree first (its attention pages evicted), and
keeps the snapshots with the highest value times expected reuses per slot-time (a Gittins index; the hit density of
LHD, Beckmann et al., NSDI 2018). Evicted snapshots stay as *ghosts* while their block is in the tree, and a
snapshot re-created there (the branch point of a prompt that would have matched it) counts as their reuse, so the
estimates do not depend on what the policy chose to keep.

Keeping snapshots for hundreds of requests only pays if their attention blocks stay too. :class:`SnapshotAwareLRU`
orders a hybrid manager's attention pages: a leaf block without a snapshot cannot be reused by any request (reuse
is cut back to the last snapshot of the path), so such dead leaves go first, then prioritised LRU. Under plain LRU
a conversation loses its newest block (with its snapshot) first and the rest of its path lingers as dead weight.
:func:`snapshot_aware_eviction` pairs it with any snapshot policy; :func:`cost_aware_eviction` uses it with
``aging="hit-density"``. On the bench (KIMI_K3_LIKE, 20% of the memory for snapshots; bench/bench_snapshot_policy.py)
the pair saves 12 to 23% more prefill FLOPs than the best baseline at every size from 75 to 1200 GB; the rule
alone changes the baselines by at most 1%, and the hit-density policy alone gains only about 5% at 75 GB, where
with LRU attention a conversation's blocks last only 500 to 900 snapshot insertions.

Plug them in with :func:`cost_aware_eviction` (``aging=``) or :func:`snapshot_aware_eviction`.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvforge.kvcache.config import LayerSpec, LifeCycle, LifeCycleKind
from kvforge.kvcache.eviction import EvictionPolicy, EvictionPolicyFactory, LazyHeapPolicy, PrioritizedLRU

if TYPE_CHECKING:
    from kvforge.kvcache.config import PoolGroupSpec, Tier
    from kvforge.kvcache.pools import Page
    from kvforge.kvcache.radix import Block

__all__ = [
    "AGING_MODES",
    "KIMI_K3_LIKE",
    "CostAwareSnapshotPolicy",
    "HitDensitySnapshotPolicy",
    "ModelCostSpec",
    "SnapshotAwareLRU",
    "cost_aware_eviction",
    "snapshot_aware_eviction",
]

AGING_MODES = ("greedy-dual", "hit-density")


@dataclass(frozen=True)
class ModelCostSpec:
    """A hybrid model's cache layout and prefill cost (see the module docstring for the default's assumptions).

    ``attention_layers``: ids of the MLA (full-attention) layers among ``range(num_layers)``; every other layer
    is recurrent. ``active_params``: parameters one token passes through (2 FLOPs each). Attention cost per
    token at position ``t`` per layer: ``2 * attn_heads * (qk_head_dim + v_head_dim) * t``; recurrent cost per
    token per layer: ``recurrent_flops_per_token``.
    """

    name: str
    num_layers: int
    attention_layers: tuple[int, ...]
    hidden_size: int
    active_params: float
    kv_elements_per_token: int
    kv_dtype_bytes: int
    attn_heads: int
    qk_head_dim: int
    v_head_dim: int
    recurrent_state_bytes: int
    recurrent_flops_per_token: float

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected >= 1, got {self.num_layers}")
        attn = tuple(sorted(set(self.attention_layers)))
        if not attn or attn[0] < 0 or attn[-1] >= self.num_layers:
            raise ValueError(f"attention_layers: expected ids in [0, {self.num_layers}), got {self.attention_layers}")
        if len(attn) == self.num_layers:
            raise ValueError("attention_layers: a hybrid model needs at least one recurrent layer")
        object.__setattr__(self, "attention_layers", attn)
        for name in ("hidden_size", "kv_elements_per_token", "kv_dtype_bytes", "attn_heads", "recurrent_state_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.active_params <= 0 or self.recurrent_flops_per_token < 0:
            raise ValueError("active_params must be > 0 and recurrent_flops_per_token >= 0")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        attn = set(self.attention_layers)
        return tuple(i for i in range(self.num_layers) if i not in attn)

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention-cache bytes per token over every attention layer."""
        return len(self.attention_layers) * self.kv_elements_per_token * self.kv_dtype_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot: the state of every recurrent layer."""
        return len(self.recurrent_layers) * self.recurrent_state_bytes

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to prefill the first ``num_tokens`` tokens of a sequence from nothing."""
        n = num_tokens
        linear = n * (2.0 * self.active_params + len(self.recurrent_layers) * self.recurrent_flops_per_token)
        per_pos = 2.0 * self.attn_heads * (self.qk_head_dim + self.v_head_dim) * len(self.attention_layers)
        return linear + per_pos * n * (n + 1) / 2

    def layer_specs(self, kv_dtype: str = "bfloat16") -> tuple[LayerSpec, ...]:
        """Cache layer specs of the target model: MLA layers (one latent head) then recurrent layers."""
        attn = set(self.attention_layers)
        out = []
        for i in range(self.num_layers):
            if i in attn:
                per_token = self.kv_elements_per_token * self.kv_dtype_bytes
                out.append(LayerSpec(i, bytes_per_token=per_token, dtype=kv_dtype))
            else:
                out.append(LayerSpec(i, LifeCycle.recurrent(), state_bytes=self.recurrent_state_bytes, dtype="float32"))
        return tuple(out)


def _kimi_k3_like() -> ModelCostSpec:
    layers = 61
    heads, dk = 64, 128
    state = heads * dk * dk * 4 + 3 * 3 * heads * dk * 2
    return ModelCostSpec(
        name="kimi-k3-like",
        num_layers=layers,
        attention_layers=tuple(i for i in range(layers) if i % 4 == 3 or i == layers - 1),
        hidden_size=7168,
        active_params=32e9,
        kv_elements_per_token=576,
        kv_dtype_bytes=2,
        attn_heads=64,
        qk_head_dim=192,
        v_head_dim=128,
        recurrent_state_bytes=state,
        recurrent_flops_per_token=4.0 * heads * dk * dk,
    )


KIMI_K3_LIKE = _kimi_k3_like()


def _prefix_tokens(block: Block | None, tokens_per_block: int) -> int:
    """Tokens up to the end of ``block`` (0 for none or a root)."""
    return 0 if block is None or block.depth < 0 else block.depth * tokens_per_block + block.num_tokens


class CostAwareSnapshotPolicy(LazyHeapPolicy):
    """GreedyDual eviction of recurrent snapshots by the prefill FLOPs they save per byte (module docstring).

    Order: lowest ``priority`` first (so the manager's priorities, e.g. the short-prompt rule, still apply),
    then lowest score ``H = clock_at_last_use + weight * value``, then the deepest block. One heap with lazy
    deletion (:class:`~kvforge.kvcache.eviction.LazyHeapPolicy`). ``value_fn(prefix_tokens) -> float`` is the
    (non-decreasing) value of a snapshot after ``prefix_tokens`` tokens when nothing below it is cached; the
    page's prefix is read from its tree block.

    * ``marginal``: the value is ``value_fn(L) - value_fn(L')``, where ``L'`` is the end of the nearest ancestor
      block holding a snapshot of the same group (0 when none within ``max_walk`` blocks): what evicting the
      snapshot actually costs a request that would have used it, which falls back to ``L'``. A snapshot close
      to the one below it saves little. Values only grow when an ancestor goes, so a victim whose value has
      grown since it was scored is re-scored and pushed back (lazily, in :meth:`pop_victim`).
    * ``frequency``: ``weight`` is the number of times the page became a candidate in the same block (every
      reuse unlocks it once more), i.e. GreedyDual-Size-Frequency; otherwise 1.
    * ``supersede`` (with ``frequency``): a new snapshot whose nearest ancestor snapshot ``A`` lies on an
      unbranched path (``A``'s block has one child) continues ``A``'s stream: the next request extending that
      path will match the new snapshot, not ``A``. The new snapshot inherits ``A``'s reuse count and ``A``'s
      weight drops to 0 (evicted first unless a request reuses it again); a snapshot at a branch point keeps its
      count. This protects the deepest snapshot of a live conversation rather than the turns it replaces.

    Each operation is O(log n) plus, with ``marginal`` or ``supersede``, a walk of at most ``max_walk`` blocks up
    the tree.
    """

    __slots__ = (
        "_clock",
        "_freq",
        "_tpb",
        "_value_fn",
        "frequency",
        "marginal",
        "max_walk",
        "supersede",
    )

    def __init__(
        self,
        value_fn: Callable[[int], float],
        tokens_per_block: int,
        *,
        frequency: bool = False,
        marginal: bool = False,
        supersede: bool = False,
        max_walk: int = 256,
    ) -> None:
        if not callable(value_fn):
            raise TypeError(f"value_fn: expected a callable, got {type(value_fn).__name__}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: expected >= 1, got {tokens_per_block}")
        if max_walk < 1:
            raise ValueError(f"max_walk: expected >= 1, got {max_walk}")
        super().__init__()
        self._value_fn = value_fn
        self._tpb = tokens_per_block
        self._clock = 0.0
        self.frequency = frequency
        self.marginal = marginal
        self.supersede = supersede
        self.max_walk = max_walk
        # id(page) -> (block, reuse weight while in that block): GreedyDual-Size-Frequency.
        self._freq: dict[int, tuple[object, int]] = {}

    @property
    def clock(self) -> float:
        """The GreedyDual clock: the score of the last victim (new candidates start above it)."""
        return self._clock

    # --- values ------------------------------------------------------------------------------------------------

    def _prefix(self, block: Block | None) -> int:
        return _prefix_tokens(block, self._tpb)

    def _ancestor(self, page: Page) -> tuple[Block | None, Page | None]:
        """The nearest ancestor block holding a snapshot of ``page``'s group, and that snapshot (bounded walk)."""
        block = page.block
        g = page.pool.group
        node = None if block is None else block.parent
        for _ in range(self.max_walk):
            if node is None or node.depth < 0:
                return None, None
            other = node.pages[g]
            if other is not None:
                return node, other
            node = node.parent
        return None, None

    def value(self, page: Page) -> float:
        """What evicting ``page`` costs one request that would have used it (before the reuse weight)."""
        v = self._value_fn(self._prefix(page.block))
        if self.marginal:
            anc, _ = self._ancestor(page)
            if anc is not None:
                v -= self._value_fn(self._prefix(anc))
        return max(v, 0.0)

    def weight(self, page: Page) -> int:
        """The reuse weight ``page`` has now (1 without ``frequency``)."""
        if not self.frequency:
            return 1
        seen = self._freq.get(id(page))
        return seen[1] if seen is not None and seen[0] is page.block else 1

    def score(self, page: Page) -> float:
        """The score ``page`` would get if it became a candidate now."""
        w = 1
        if self.frequency:
            seen = self._freq.get(id(page))
            w = seen[1] + 1 if seen is not None and seen[0] is page.block else 1
        return self._clock + w * self.value(page)

    # --- EvictionPolicy ------------------------------------------------------------------------------------------

    def add(self, page: Page) -> None:
        self._require_new(page)
        block = page.block
        self._seq += 1
        w = 1
        if self.frequency:
            seen = self._freq.get(id(page))
            if seen is not None and seen[0] is block:
                w = seen[1] + 1
            elif self.supersede:
                w = self._inherit(page)
            self._freq[id(page)] = (block, w)
        score = self._clock + w * self.value(page)
        self._push(
            page, [page.priority, score, -(block.depth if block is not None else 0), self._seq, page, self._clock]
        )

    def _inherit(self, page: Page) -> int:
        """A new snapshot's weight under ``supersede``: 1 plus the reuses of the ancestor snapshot it replaces."""
        anc, other = self._ancestor(page)
        if anc is None or other is None or len(anc.children) != 1:
            return 1
        seen = self._freq.get(id(other))
        if seen is None or seen[0] is not anc:
            return 1
        self._freq[id(other)] = (anc, 0)
        entry = other.policy_data
        if entry is not None and entry[4] is other and entry[1] > entry[5]:
            # Re-score the superseded snapshot at its own last-use clock with weight 0.
            entry[4] = None
            self._seq += 1
            new = [entry[0], entry[5], entry[2], self._seq, other, entry[5]]
            other.policy_data = new
            heapq.heappush(self._heap, new)
        return max(1, seen[1])

    def _settle(self, entry: list, settled: set[int]) -> bool:
        page = entry[4]
        if self.marginal and id(page) not in settled:
            # An ancestor snapshot may have gone since this one was scored: its value can only have grown.
            fresh = entry[5] + self.weight(page) * self.value(page)
            if fresh > entry[1] * (1.0 + 1e-12) + 1e-300:
                settled.add(id(page))
                entry[1] = fresh
                heapq.heappush(self._heap, entry)
                return False
        # Aging: whatever enters from now on starts at the victim's score (scores never go backwards, so a
        # victim of a lower priority class, scored earlier, cannot pull the clock down).
        if entry[1] > self._clock:
            self._clock = entry[1]
        return True


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
        self._due: list[tuple[int, int, list]] = []  # (time the entry's age crosses a bin edge, seq, entry)
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
        if entry is None or entry[4] is not page:
            return 0.0
        life: _Life = entry[5]
        return life.value * self.index(life.cls, self._now - life.born)

    def ordered(self) -> list[Page]:
        """Candidates in eviction order at the current scores (read-only)."""
        live = [e for e in self._heap if e[4] is not None]
        keyed = [(e[0], self.score(e[4]), e[5].born, e[3], e[4]) for e in live]
        return [k[4] for k in sorted(keyed, key=lambda k: k[:4])]

    # --- values --------------------------------------------------------------------------------------------

    def _prefix(self, block: Block | None) -> int:
        return _prefix_tokens(block, self._tpb)

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
            for life in self._discarded:
                if life.page is None and self._lives.get(life.block.key) is life and not _attached(life.block):
                    self._end(life, False, removed=True)
                    del self._lives[life.block.key]
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

    def _key(self, page: Page, life: _Life) -> list:
        """A heap entry ``[priority, score, born, seq, page, life]``, with its next bin crossing scheduled."""
        age = self._now - life.born
        b = self.age_bin(age)
        self._seq += 1
        entry = [page.priority, life.value * self._index[life.cls][b], life.born, self._seq, page, life]
        if b + 1 < len(self.edges):
            heapq.heappush(self._due, (life.born + self.edges[b + 1], self._seq, entry))
        return entry

    def _rekey(self, entry: list) -> None:
        page, life = entry[4], entry[5]
        entry[4] = None
        new = self._key(page, life)
        page.policy_data = new
        heapq.heappush(self._heap, new)

    def _rekey_all(self) -> None:
        live = [e for e in self._heap if e[4] is not None]
        self._due = []
        fresh = []
        for e in live:
            new = self._key(e[4], e[5])
            e[4].policy_data = new
            fresh.append(new)
        heapq.heapify(fresh)
        self._heap = fresh

    def _advance(self) -> None:
        """Re-key the entries whose age crossed a bin edge since they were keyed."""
        due = self._due
        while due and due[0][0] <= self._now:
            _, _, entry = heapq.heappop(due)
            if entry[4] is not None and entry[4].policy_data is entry:
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
            life = self._lives.get(block.key)
            if life is not None and life.block is not block:
                # The block was removed and re-created since: that lifetime ended without a reuse.
                self._end(life, False, removed=True)
                life = None
            if life is not None:
                # Reused (unlocked after serving as a match's source) or re-created where a ghost lies.
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
        if entry is not None and entry[4] is below.page:
            self._rekey(entry)
        return max(1, below.uses)

    def discard(self, page: Page) -> None:
        entry = page.policy_data
        if entry is not None and entry[4] is page:
            life = entry[5]
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

    def _settle(self, entry: list, settled: set[int]) -> bool:
        page, life = entry[4], entry[5]
        if self.marginal and id(page) not in settled and page.block is not None:
            settled.add(id(page))
            # A snapshot below may have gone since this one was valued: its value can only have grown.
            v = self.value(page)
            if v > life.value * (1.0 + 1e-12) + 1e-300:
                life.value = v
                entry[1] = v * self._index[life.cls][self.age_bin(self._now - life.born)]
                heapq.heappush(self._heap, entry)
                return False
        return True


class SnapshotAwareLRU(LazyHeapPolicy):
    """Attention pages of a hybrid model: blocks no request can reuse go first, then prioritised LRU.

    A hybrid model's cached prefix is reusable only up to the last block holding a recurrent snapshot, so a leaf
    block without one is dead weight: the attention KV it holds will be recomputed by any request that reaches
    it. Plain LRU keeps such blocks as long as any other (they are as recent as the snapshot that was evicted
    from them), and evicts a conversation's newest block with its snapshot first, which turns the rest of that
    conversation's path into dead weight too. This policy evicts dead leaves first (oldest first), so the pool
    holds reusable prefixes; among live pages the order is :class:`~kvforge.kvcache.eviction.PrioritizedLRU`'s.

    ``recurrent_groups``: the recurrent pool groups whose pages are the snapshots (shared with the factory, which
    fills it as it builds their policies). A leaf loses its snapshot when a snapshot policy evicts it:
    :meth:`snapshot_evicted` (hooked to those policies' ``on_victim``) queues the block, and its attention page
    is re-keyed before the next eviction here. A candidate keyed dead that gained a snapshot meanwhile cannot
    exist (committing one locks the block), but the key is checked again when it comes up, either way.
    """

    __slots__ = ("_pending", "_recurrent")

    def __init__(self, recurrent_groups: set[int]) -> None:
        super().__init__()
        self._recurrent = recurrent_groups
        self._pending: list[Block] = []

    def _alive(self, page: Page) -> bool:
        block = page.block
        if block is None or block.children or not self._recurrent:
            return True
        pages = block.pages
        return any(g < len(pages) and pages[g] is not None for g in self._recurrent)

    def add(self, page: Page) -> None:
        self._require_new(page)
        self._seq += 1
        self._push(page, [self._alive(page), page.priority, page.last_used, self._seq, page])
        if len(self._pending) > 1024:  # no attention eviction for a while: keep the queue short
            self._rekey_pending()

    def snapshot_evicted(self, snapshot: Page) -> None:
        if snapshot.block is not None:
            self._pending.append(snapshot.block)

    def _rekey_pending(self) -> None:
        pending, self._pending = self._pending, []
        for block in pending:
            for page in block.pages:
                entry = None if page is None else page.policy_data
                if (
                    entry is not None
                    and entry[4] is page
                    and page.pool.policy is self
                    and entry[0] != self._alive(page)
                ):
                    self.discard(page)
                    self.add(page)

    def pop_victim(self, accept: Callable[[Page], bool] | None = None) -> Page | None:
        self._rekey_pending()
        return super().pop_victim(accept)

    def ordered(self) -> list[Page]:
        self._rekey_pending()
        return super().ordered()

    def _settle(self, entry: list, settled: set[int]) -> bool:
        page = entry[4]
        if id(page) in settled or entry[0] == self._alive(page):
            return True
        settled.add(id(page))
        entry[0] = not entry[0]
        heapq.heappush(self._heap, entry)
        return False


def cost_aware_eviction(
    model: ModelCostSpec,
    tokens_per_block: int,
    *,
    aging: str = "greedy-dual",
    cost_exponent: float = 1.0,
    frequency: bool = True,
    marginal: bool = True,
    supersede: bool = True,
    max_walk: int = 256,
    attention_policy: EvictionPolicyFactory | None = None,
) -> EvictionPolicyFactory:
    """An ``eviction_policy`` factory: a cost-aware policy for recurrent pools, whose value of a snapshot is the
    prefix's prefill FLOPs per byte of one page of that pool, to the power ``cost_exponent``, taken over the
    nearest snapshot below when ``marginal``; and ``attention_policy`` (default prioritised LRU) for every other
    pool. ``max_walk`` bounds the walks up the tree.

    ``aging`` says how that value is weighed against time:

    * ``"greedy-dual"`` (:class:`CostAwareSnapshotPolicy`): GreedyDual aging; ``frequency`` multiplies the value
      by the snapshot's use count, ``supersede`` hands a replaced snapshot's count to its successor.
    * ``"hit-density"`` (:class:`HitDensitySnapshotPolicy`): the value times the expected reuses per slot-time,
      learned online per class and age; ``frequency`` makes the use count a class (else one class),
      ``supersede`` gives superseded snapshots a class of their own and their count to the successor. On the
      Mooncake replay (bench/bench_snapshot_policy.py) it saves the most compute at every memory size: reuses of
      a conversation's snapshot come hundreds of requests later, which recency-based aging does not wait for.

    The default stays ``"greedy-dual"`` for existing callers."""
    if not isinstance(model, ModelCostSpec):
        raise TypeError(f"model: expected a ModelCostSpec, got {type(model).__name__}")
    if aging not in AGING_MODES:
        raise ValueError(f"aging: expected one of {', '.join(AGING_MODES)}, got {aging!r}")
    if cost_exponent < 0:
        raise ValueError(f"cost_exponent: expected >= 0, got {cost_exponent}")

    def factory(group: PoolGroupSpec, tier: Tier) -> EvictionPolicy:
        if group.life_cycle.kind is not LifeCycleKind.RECURRENT:
            return (attention_policy or PrioritizedLRU)(group, tier)
        size = max(1, group.bytes_per_page)

        def value(prefix_tokens: int) -> float:
            return (model.prefill_flops(prefix_tokens) / size) ** cost_exponent

        if aging == "hit-density":
            return HitDensitySnapshotPolicy(
                value,
                tokens_per_block,
                reuse_classes=4 if frequency else 1,
                marginal=marginal,
                supersede=supersede,
                max_walk=max_walk,
            )
        return CostAwareSnapshotPolicy(
            value, tokens_per_block, frequency=frequency, marginal=marginal, supersede=supersede, max_walk=max_walk
        )

    if attention_policy is None and aging == "hit-density":
        return snapshot_aware_eviction(factory)
    return factory


def snapshot_aware_eviction(snapshot_policy: EvictionPolicyFactory = PrioritizedLRU) -> EvictionPolicyFactory:
    """An ``eviction_policy`` factory for a hybrid manager: ``snapshot_policy`` for recurrent pools (a
    :class:`~kvforge.kvcache.eviction.LazyHeapPolicy`, whose victims it watches) and :class:`SnapshotAwareLRU`
    for the others, so attention blocks that no request can reuse (past the last snapshot of their path) are
    evicted first. Works with any snapshot policy: ``snapshot_aware_eviction()`` is plain LRU plus that rule."""
    recurrent: set[int] = set()  # shared by the policies of one manager's pools
    aware: list[SnapshotAwareLRU] = []

    def snapshot_evicted(page: Page) -> None:
        for policy in aware:
            policy.snapshot_evicted(page)

    def factory(group: PoolGroupSpec, tier: Tier) -> EvictionPolicy:
        if group.life_cycle.kind is not LifeCycleKind.RECURRENT:
            policy = SnapshotAwareLRU(recurrent)
            aware.append(policy)
            return policy
        snap = snapshot_policy(group, tier)
        if not isinstance(snap, LazyHeapPolicy):
            raise TypeError(
                f"snapshot_policy: expected a factory of LazyHeapPolicy-based policies, got {type(snap).__name__}"
            )
        recurrent.add(group.group_id)
        snap.on_victim = snapshot_evicted
        return snap

    return factory
