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
the live-state copy, not the other snapshots on the matched path (SGLang's finding, NOTES §2). Plug the policy
in with :func:`cost_aware_eviction`, which keeps :class:`~kvforge.kvcache.eviction.PrioritizedLRU` for
attention pools.
"""

from __future__ import annotations

import heapq
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
    "KIMI_K3_LIKE",
    "CostAwareSnapshotPolicy",
    "ModelCostSpec",
    "cost_aware_eviction",
]


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
        return 0 if block is None or block.depth < 0 else block.depth * self._tpb + block.num_tokens

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


def cost_aware_eviction(
    model: ModelCostSpec,
    tokens_per_block: int,
    *,
    cost_exponent: float = 1.0,
    frequency: bool = True,
    marginal: bool = True,
    supersede: bool = True,
    max_walk: int = 256,
    attention_policy: EvictionPolicyFactory = PrioritizedLRU,
) -> EvictionPolicyFactory:
    """An ``eviction_policy`` factory: :class:`CostAwareSnapshotPolicy` for recurrent pools (value = the
    prefix's prefill FLOPs per byte of one page of that pool, to the power ``cost_exponent``, taken over the
    nearest snapshot below when ``marginal``; times the times the snapshot was used when ``frequency``, with
    ``supersede`` handing a replaced snapshot's count to its successor), and ``attention_policy`` (default
    prioritised LRU) for every other pool. ``marginal`` and ``supersede`` follow from what a snapshot's eviction
    costs; ``frequency`` defaults on because the Mooncake replay (bench/bench_snapshot_policy.py) saved more
    compute with it. ``max_walk`` bounds the walk up the tree for the snapshot below."""
    if not isinstance(model, ModelCostSpec):
        raise TypeError(f"model: expected a ModelCostSpec, got {type(model).__name__}")
    if cost_exponent < 0:
        raise ValueError(f"cost_exponent: expected >= 0, got {cost_exponent}")

    def factory(group: PoolGroupSpec, tier: Tier) -> EvictionPolicy:
        if group.life_cycle.kind is not LifeCycleKind.RECURRENT:
            return attention_policy(group, tier)
        size = max(1, group.bytes_per_page)

        def value(prefix_tokens: int) -> float:
            return (model.prefill_flops(prefix_tokens) / size) ** cost_exponent

        return CostAwareSnapshotPolicy(
            value, tokens_per_block, frequency=frequency, marginal=marginal, supersede=supersede, max_walk=max_walk
        )

    return factory
