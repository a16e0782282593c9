"""Configuration of a paged KV cache: life cycles, layers, storage tiers and pool shares.

Every object here is a frozen dataclass that validates itself in ``__post_init__``; a bad value raises
``ValueError`` / ``TypeError`` naming the field.

Layers whose life cycle and owner are equal share one *pool group*; the group id (its position in
:attr:`KVCacheConfig.groups`, in order of first appearance in ``layers``) is the index used everywhere: page
tables, priority callbacks, pool ratios, tier page counts. Life cycles: ``FULL``, ``SLIDING`` (window plus
``sink_tokens``) and ``RECURRENT`` (one live state page per request, snapshots in the tree). Owners: ``TARGET``
or ``DRAFT``; target and draft layers never share a pool group or a partition key.

Vocabulary and life cycles in full: ``docs/kvcache.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "FULL_ATTENTION",
    "RECURRENT_STATE",
    "KVCacheConfig",
    "LayerOwner",
    "LayerSpec",
    "LifeCycle",
    "LifeCycleKind",
    "PoolGroupSpec",
    "Tier",
    "TierConfig",
    "dtype_name",
    "insert_draft_pool_ratios",
]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_name(dtype: Any, *, arg: str = "dtype") -> str:
    """Canonical name of a KV dtype given as a name (``"bfloat16"``) or a ``torch.dtype``.

    torch is not imported: a ``torch.dtype`` prints as ``torch.<name>``, which is all that is needed.
    """
    if isinstance(dtype, str):
        name = dtype[6:] if dtype.startswith("torch.") else dtype
    elif type(dtype).__name__ == "dtype" and str(dtype).startswith("torch."):
        name = str(dtype)[6:]
    else:
        raise TypeError(f"{arg}: expected a torch.dtype or a dtype name, got {type(dtype).__name__} {dtype!r}")
    if name not in DTYPE_BYTES:
        raise ValueError(f"{arg}: unsupported KV dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return name


def _check_int(name: str, v: object, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return v


class LifeCycleKind(Enum):
    FULL = "full"
    SLIDING = "sliding"
    RECURRENT = "recurrent"


class LayerOwner(Enum):
    TARGET = "target"
    DRAFT = "draft"


class Tier(IntEnum):
    """Storage tiers, fastest first. Caches only ever hold GPU pages; the host tier keeps evicted blocks."""

    GPU = 0
    HOST = 1


@dataclass(frozen=True)
class LifeCycle:
    """How long a layer's per-block pages stay useful (see the module docstring)."""

    kind: LifeCycleKind = LifeCycleKind.FULL
    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LifeCycleKind):
            raise TypeError(f"kind: expected a LifeCycleKind, got {type(self.kind).__name__}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        if self.kind is LifeCycleKind.SLIDING:
            if self.window is None:
                raise ValueError("window: a sliding-window life cycle needs a window (tokens), got None")
            _check_int("window", self.window, 1)
        else:
            if self.window is not None:
                raise ValueError(f"window: only a sliding-window life cycle has a window, got {self.window}")
            if self.sink_tokens:
                raise ValueError(
                    f"sink_tokens: only a sliding-window life cycle has sink tokens, got {self.sink_tokens}"
                )

    @staticmethod
    def full() -> LifeCycle:
        return FULL_ATTENTION

    @staticmethod
    def sliding(window: int, sink_tokens: int = 0) -> LifeCycle:
        return LifeCycle(LifeCycleKind.SLIDING, window, sink_tokens)

    @staticmethod
    def recurrent() -> LifeCycle:
        return RECURRENT_STATE

    @property
    def is_attention(self) -> bool:
        return self.kind is not LifeCycleKind.RECURRENT

    def sink_blocks(self, tokens_per_block: int) -> int:
        """Leading blocks that hold sink tokens (never stale)."""
        return -(-self.sink_tokens // tokens_per_block)

    def first_needed_block(self, num_tokens: int, tokens_per_block: int) -> int:
        """First non-sink block the next token (at position ``num_tokens``) still attends to."""
        if self.kind is not LifeCycleKind.SLIDING:
            return 0
        return max(0, num_tokens - self.window + 1) // tokens_per_block  # type: ignore[operator]

    def stale_range(self, num_tokens: int, tokens_per_block: int) -> range:
        """Blocks whose pages no token at or after ``num_tokens`` reads (empty except for sliding windows)."""
        if self.kind is not LifeCycleKind.SLIDING:
            return range(0)
        return range(self.sink_blocks(tokens_per_block), self.first_needed_block(num_tokens, tokens_per_block))


FULL_ATTENTION = LifeCycle(LifeCycleKind.FULL)
RECURRENT_STATE = LifeCycle(LifeCycleKind.RECURRENT)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache needs.

    ``bytes_per_token``: bytes one token takes in this layer's attention cache (K and V together, or the MLA
    latent); ``state_bytes``: bytes of one recurrent state (recurrent layers only). ``dtype`` is stored as its
    canonical name (a ``torch.dtype`` is accepted). ``num_kv_heads`` is part of the disaggregation partition
    key ``(owner, num_kv_heads)``.
    """

    layer_id: int
    life_cycle: LifeCycle = FULL_ATTENTION
    bytes_per_token: int = 0
    state_bytes: int = 0
    dtype: Any = "bfloat16"
    owner: LayerOwner = LayerOwner.TARGET
    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        _check_int("layer_id", self.layer_id, 0)
        if not isinstance(self.life_cycle, LifeCycle):
            raise TypeError(f"life_cycle: expected a LifeCycle, got {type(self.life_cycle).__name__}")
        if not isinstance(self.owner, LayerOwner):
            raise TypeError(f"owner: expected a LayerOwner, got {type(self.owner).__name__}")
        _check_int("num_kv_heads", self.num_kv_heads, 1)
        _check_int("bytes_per_token", self.bytes_per_token, 0)
        _check_int("state_bytes", self.state_bytes, 0)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.life_cycle.is_attention:
            if self.bytes_per_token <= 0:
                raise ValueError(
                    f"bytes_per_token: an attention layer needs a positive size, got {self.bytes_per_token}"
                )
            if self.state_bytes:
                raise ValueError(f"state_bytes: only a recurrent layer has a state, got {self.state_bytes}")
        else:
            if self.state_bytes <= 0:
                raise ValueError(f"state_bytes: a recurrent layer needs a positive state size, got {self.state_bytes}")
            if self.bytes_per_token:
                raise ValueError(
                    f"bytes_per_token: a recurrent layer has no per-token cache, got {self.bytes_per_token}"
                )

    def bytes_per_block(self, tokens_per_block: int) -> int:
        """Bytes of this layer in one page of its group."""
        return self.bytes_per_token * tokens_per_block if self.life_cycle.is_attention else self.state_bytes

    @property
    def partition_key(self) -> tuple[str, int]:
        """Disaggregation transfer partition: owner and head count, so target and draft never share one."""
        return (self.owner.value, self.num_kv_heads)


@dataclass(frozen=True)
class PoolGroupSpec:
    """A pool group: the layers that share one life cycle and owner, and one page index space."""

    group_id: int
    owner: LayerOwner
    life_cycle: LifeCycle
    layer_ids: tuple[int, ...]
    bytes_per_page: int


@dataclass(frozen=True)
class TierConfig:
    """One storage tier: a byte quota split by the pool ratios, or explicit page counts.

    ``pages`` is one count for every group or one count per group (in group-id order). Exactly one of
    ``quota_bytes`` and ``pages`` is given.
    """

    tier: Tier = Tier.GPU
    quota_bytes: int | None = None
    pages: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tier, Tier):
            raise TypeError(f"tier: expected a Tier, got {type(self.tier).__name__}")
        if (self.quota_bytes is None) == (self.pages is None):
            raise ValueError("TierConfig: give exactly one of quota_bytes and pages")
        if self.quota_bytes is not None:
            _check_int("quota_bytes", self.quota_bytes, 0)
        if self.pages is not None:
            if isinstance(self.pages, int) and not isinstance(self.pages, bool):
                _check_int("pages", self.pages, 0)
            elif isinstance(self.pages, Sequence) and not isinstance(self.pages, (str, bytes)):
                pages = tuple(self.pages)
                for i, p in enumerate(pages):
                    _check_int(f"pages[{i}]", p, 0)
                object.__setattr__(self, "pages", pages)
            else:
                raise TypeError(f"pages: expected an int or a sequence of ints, got {type(self.pages).__name__}")


@dataclass(frozen=True)
class KVCacheConfig:
    """Everything a :class:`~kvforge.kvcache.manager.KVCacheManager` needs to lay out its pools.

    ``pool_ratios``: the byte share of each tier's quota per pool group. Give one share per group, or one per
    *target* group when draft layers are present: the draft groups' shares are then inserted so that each draft
    group holds as many pages as the target's full-attention group (see
    :func:`kvforge.kvcache.draft.insert_draft_pool_ratios`). None: shares proportional to the page sizes, so
    every group holds the same number of pages. Ratios only matter for tiers given as ``quota_bytes``.
    """

    tokens_per_block: int
    layers: tuple[LayerSpec, ...]
    tiers: tuple[TierConfig, ...] = (TierConfig(Tier.GPU, pages=1024),)
    pool_ratios: tuple[float, ...] | None = None
    groups: tuple[PoolGroupSpec, ...] = field(init=False, repr=False, compare=False)
    resolved_pool_ratios: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("tokens_per_block", self.tokens_per_block, 1)
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
            raise TypeError(f"layers: expected a sequence of LayerSpec, got {type(self.layers).__name__}")
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("layers: expected at least one layer")
        seen: set[int] = set()
        for i, spec in enumerate(layers):
            if not isinstance(spec, LayerSpec):
                raise TypeError(f"layers[{i}]: expected a LayerSpec, got {type(spec).__name__}")
            if spec.layer_id in seen:
                raise ValueError(f"layers[{i}]: duplicate layer_id {spec.layer_id}")
            seen.add(spec.layer_id)
        object.__setattr__(self, "layers", layers)
        tiers = tuple(self.tiers)
        if not tiers or not all(isinstance(t, TierConfig) for t in tiers):
            raise TypeError("tiers: expected a non-empty sequence of TierConfig")
        if [t.tier for t in tiers] not in ([Tier.GPU], [Tier.GPU, Tier.HOST]):
            raise ValueError(f"tiers: expected (GPU,) or (GPU, HOST), got {tuple(t.tier.name for t in tiers)}")
        object.__setattr__(self, "tiers", tiers)

        keyed: dict[tuple[LayerOwner, LifeCycle], list[LayerSpec]] = {}
        for spec in layers:
            keyed.setdefault((spec.owner, spec.life_cycle), []).append(spec)
        groups = tuple(
            PoolGroupSpec(
                group_id=g,
                owner=owner,
                life_cycle=lc,
                layer_ids=tuple(s.layer_id for s in specs),
                bytes_per_page=sum(s.bytes_per_block(self.tokens_per_block) for s in specs),
            )
            for g, ((owner, lc), specs) in enumerate(keyed.items())
        )
        object.__setattr__(self, "groups", groups)
        for t in tiers:
            if isinstance(t.pages, tuple) and len(t.pages) != len(groups):
                raise ValueError(
                    f"tiers[{t.tier.name}].pages: expected one count per pool group ({len(groups)}), got {len(t.pages)}"
                )
        object.__setattr__(self, "resolved_pool_ratios", self._resolve_ratios(groups))

    def _resolve_ratios(self, groups: tuple[PoolGroupSpec, ...]) -> tuple[float, ...]:
        if self.pool_ratios is None:
            total = sum(g.bytes_per_page for g in groups)
            return tuple(g.bytes_per_page / total for g in groups)
        if isinstance(self.pool_ratios, (str, bytes)) or not isinstance(self.pool_ratios, Sequence):
            raise TypeError(f"pool_ratios: expected a sequence of floats, got {type(self.pool_ratios).__name__}")
        ratios = tuple(self.pool_ratios)
        for i, r in enumerate(ratios):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
                raise ValueError(f"pool_ratios[{i}]: expected a positive finite number, got {r!r}")
        object.__setattr__(self, "pool_ratios", ratios)
        n_target = sum(1 for g in groups if g.owner is LayerOwner.TARGET)
        if len(ratios) == len(groups):
            ratio_sum = sum(ratios)
            return tuple(r / ratio_sum for r in ratios)
        if len(ratios) == n_target and n_target < len(groups):
            return insert_draft_pool_ratios(ratios, groups)
        raise ValueError(
            f"pool_ratios: expected one share per pool group ({len(groups)}) or per target group ({n_target}), "
            f"got {len(ratios)}"
        )

    # --- derived views -------------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def tier_config(self, tier: Tier) -> TierConfig | None:
        for t in self.tiers:
            if t.tier is tier:
                return t
        return None

    def pages_per_group(self, tier: Tier = Tier.GPU) -> tuple[int, ...]:
        """Page count of every pool group in ``tier`` (zeros for an absent tier)."""
        t = self.tier_config(tier)
        if t is None:
            return (0,) * len(self.groups)
        if t.pages is not None:
            return t.pages if isinstance(t.pages, tuple) else (t.pages,) * len(self.groups)
        assert t.quota_bytes is not None
        return tuple(int(t.quota_bytes * r) // g.bytes_per_page for g, r in zip(self.groups, self.resolved_pool_ratios))

    def layer(self, layer_id: int) -> LayerSpec:
        for spec in self.layers:
            if spec.layer_id == layer_id:
                return spec
        raise ValueError(f"layer_id: no layer {layer_id} in this config")

    def layer_owner(self, layer_id: int) -> LayerOwner:
        return self.layer(layer_id).owner

    def layer_dtype(self, layer_id: int) -> str:
        return self.layer(layer_id).dtype

    def partition_key(self, layer_id: int) -> tuple[str, int]:
        """The disaggregation partition of a layer: ``(owner, num_kv_heads)`` (same source as :meth:`layer_owner`)."""
        return self.layer(layer_id).partition_key

    def group_of_layer(self, layer_id: int) -> int:
        spec = self.layer(layer_id)
        for g in self.groups:
            if spec.layer_id in g.layer_ids:
                return g.group_id
        raise AssertionError("unreachable: every layer belongs to a group")

    @classmethod
    def from_head_counts(
        cls,
        num_kv_heads_per_layer: Sequence[int],
        *,
        head_dim: int,
        dtype: Any,
        tokens_per_block: int,
        num_draft_layers: int = 0,
        draft_dtype: Any = None,
        kv_factor: int = 2,
        tiers: tuple[TierConfig, ...] = (TierConfig(Tier.GPU, pages=1024),),
        pool_ratios: tuple[float, ...] | None = None,
    ) -> KVCacheConfig:
        """The legacy layout without explicit layer specs: full-attention layers from head counts.

        ``num_kv_heads_per_layer`` covers every local layer, the drafter's appended ones included: its last
        ``num_draft_layers`` entries are DRAFT layers (dtype ``draft_dtype``, default ``dtype``). Each layer
        stores ``kv_factor`` (2: K and V; 1: MLA latent) x heads x ``head_dim`` elements per token.
        """
        _check_int("head_dim", head_dim, 1)
        _check_int("num_draft_layers", num_draft_layers, 0)
        _check_int("kv_factor", kv_factor, 1)
        heads = list(num_kv_heads_per_layer)
        if num_draft_layers > len(heads):
            raise ValueError(
                f"num_draft_layers: {num_draft_layers} exceeds the {len(heads)} entries of num_kv_heads_per_layer"
            )
        target_dtype = dtype_name(dtype)
        d_dtype = target_dtype if draft_dtype is None else dtype_name(draft_dtype, arg="draft_dtype")
        n_target = len(heads) - num_draft_layers
        layers = []
        for i, h in enumerate(heads):
            _check_int(f"num_kv_heads_per_layer[{i}]", h, 1)
            draft = i >= n_target
            dt = d_dtype if draft else target_dtype
            layers.append(
                LayerSpec(
                    layer_id=i,
                    bytes_per_token=kv_factor * h * head_dim * DTYPE_BYTES[dt],
                    dtype=dt,
                    owner=LayerOwner.DRAFT if draft else LayerOwner.TARGET,
                    num_kv_heads=h,
                )
            )
        return cls(tokens_per_block=tokens_per_block, layers=tuple(layers), tiers=tiers, pool_ratios=pool_ratios)


def _reference_group(groups: Sequence[PoolGroupSpec]) -> PoolGroupSpec | None:
    """The target group a draft group mirrors: full attention first, else the first attention group."""
    targets = [g for g in groups if g.owner is LayerOwner.TARGET]
    for g in targets:
        if g.life_cycle.kind is LifeCycleKind.FULL:
            return g
    for g in targets:
        if g.life_cycle.is_attention:
            return g
    return None


def insert_draft_pool_ratios(target_ratios: Sequence[float], groups: Sequence[PoolGroupSpec]) -> tuple[float, ...]:
    """Pool ratios for every group (group-id order) from ratios given for the target groups only.

    With target shares ``r`` (normalised) scaled by ``s`` and draft group ``d`` given share ``x_d``, a tier
    of ``Q`` bytes gives the reference target group ``Q * s * r_ref / B_ref`` pages and the draft group
    ``Q * x_d / B_d``. Equal page counts need ``x_d = s * k_d`` with ``k_d = r_ref * B_d / B_ref``, and
    ``s + sum(x_d) = 1`` gives ``s = 1 / (1 + sum(k_d))``.
    """
    targets = [g for g in groups if g.owner is LayerOwner.TARGET]
    drafts = [g for g in groups if g.owner is LayerOwner.DRAFT]
    if len(target_ratios) != len(targets):
        raise ValueError(f"target_ratios: expected {len(targets)} shares, got {len(target_ratios)}")
    total = float(sum(target_ratios))
    r = {g.group_id: float(x) / total for g, x in zip(targets, target_ratios)}
    ref = _reference_group(groups)
    if ref is None:
        # No target attention group to mirror: split evenly among the draft groups and the target as a whole.
        k = dict.fromkeys((g.group_id for g in drafts), 1.0)
    else:
        k = {g.group_id: r[ref.group_id] * g.bytes_per_page / ref.bytes_per_page for g in drafts}
    scale = 1.0 / (1.0 + sum(k.values()))
    return tuple(scale * (r[g.group_id] if g.owner is LayerOwner.TARGET else k[g.group_id]) for g in groups)
