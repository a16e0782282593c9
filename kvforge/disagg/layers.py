"""What disaggregation needs from the KV cache: the layer list and a request's pages (the disagg -> cache seam).

The cache manager (``kvforge.kvcache``) provides these; disaggregation never calls the manager itself.

* ``KVLayer``: one layer's page pool on this rank (``owner`` ``"target"`` or ``"draft"``, ``layer_id``, ``group``,
  ``pool [num_pages, tokens_per_block, elems_per_token]`` in ``dtype``, ``heads``; ``kind="state"`` for a
  recurrent state pool ``[num_state_pages, rows, elems]``).
* ``RequestKV``: a request's pages on this rank, ``page_indices[group][k]`` = the page holding the k-th block
  this rank holds, in block order, and ``state_pages[group]`` (the recurrent-state pages that travel whole;
  both sides must list the same number, or the transfer fails on the message size).

:func:`kv_layers_from_manager` and :func:`request_kv_from_cache` build both from a ``KVCacheManager``'s config
and a cache's pages, given the tensors that the runtime allocated for each layer. Field meanings in detail:
``docs/disagg.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

OWNERS = ("target", "draft")
KINDS = ("kv", "state")


@dataclass(frozen=True, eq=False)
class KVLayer:
    owner: str
    layer_id: int
    group: int
    dtype: torch.dtype
    elems_per_token: int
    pool: torch.Tensor
    heads: int = 1
    kind: str = "kv"

    def __post_init__(self) -> None:
        if self.owner not in OWNERS:
            raise ValueError(f"owner: expected one of {OWNERS}, got {self.owner!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        for name in ("layer_id", "group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if not isinstance(self.pool, torch.Tensor):
            raise TypeError(f"pool: expected a torch.Tensor, got {type(self.pool).__name__}")
        if self.pool.dim() != 3:
            raise ValueError(
                f"pool: expected [num_pages, tokens_per_block, elems_per_token], got {tuple(self.pool.shape)}"
            )
        if self.pool.dtype != self.dtype:
            raise TypeError(f"pool: expected dtype {self.dtype} (the layer's dtype), got {self.pool.dtype}")
        if self.pool.shape[2] != self.elems_per_token:
            raise ValueError(f"pool: expected {self.elems_per_token} elements per token, got {self.pool.shape[2]}")
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"heads: expected an int >= 1, got {self.heads!r}")
        if self.elems_per_token % self.heads:
            raise ValueError(f"heads: {self.elems_per_token} elements per token do not split into {self.heads} heads")

    @property
    def tokens_per_block(self) -> int:
        return int(self.pool.shape[1])

    @property
    def num_pages(self) -> int:
        return int(self.pool.shape[0])

    @property
    def head_elems(self) -> int:
        return self.elems_per_token // self.heads

    @property
    def key(self) -> tuple[str, int]:
        return (self.owner, self.layer_id)


@dataclass(frozen=True)
class RequestKV:
    request_id: int
    num_tokens: int
    page_indices: tuple[tuple[int, ...], ...]
    state_pages: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"num_tokens: expected an int >= 0, got {self.num_tokens!r}")
        object.__setattr__(self, "page_indices", tuple(tuple(int(p) for p in g) for g in self.page_indices))
        object.__setattr__(self, "state_pages", tuple(tuple(int(p) for p in g) for g in self.state_pages))

    def num_blocks(self, tokens_per_block: int) -> int:
        return -(-self.num_tokens // tokens_per_block)


def check_layers(layers: Sequence[KVLayer]) -> int:
    """Check a rank's layers (one tokens_per_block over its KV layers, one device, unique (owner, layer_id));
    returns tokens_per_block. State layers have no tokens per block."""
    if not layers:
        raise ValueError("layers: expected at least one KVLayer")
    for i, ly in enumerate(layers):
        if not isinstance(ly, KVLayer):
            raise TypeError(f"layers[{i}]: expected a KVLayer, got {type(ly).__name__}")
    kv = [ly for ly in layers if ly.kind == "kv"]
    if not kv:
        raise ValueError("layers: expected at least one KV (attention) layer")
    tpb = kv[0].tokens_per_block
    dev = layers[0].pool.device
    seen: set[tuple[str, int]] = set()
    for i, ly in enumerate(layers):
        if ly.kind == "kv" and ly.tokens_per_block != tpb:
            raise ValueError(f"layers[{i}]: expected tokens_per_block {tpb} like layers[0], got {ly.tokens_per_block}")
        if ly.pool.device != dev:
            raise ValueError(f"layers[{i}]: expected its pool on {dev} like layers[0], got {ly.pool.device}")
        if ly.key in seen:
            raise ValueError(f"layers[{i}]: {ly.owner} layer {ly.layer_id} is listed twice")
        seen.add(ly.key)
    return tpb


def kv_layers_from_manager(manager: Any, pools: Mapping[int, torch.Tensor]) -> list[KVLayer]:
    """One ``KVLayer`` per layer of a ``KVCacheManager``'s config, over the runtime's tensors ``pools[layer_id]``.

    Attention layers: ``[num_pages, tokens_per_block, elems_per_token]`` pools (one head per token row, as MLA
    latents are); recurrent layers: state pools ``[num_pages, ...]`` (viewed ``[num_pages, 1, elems]``), kind
    ``"state"``. Target layers keep their config layer id; draft layers are numbered from 0 in config order.
    The group is ``manager.group_of_layer``; the dtype is the pool's, which must match the config's.
    """
    from kvforge.kvcache.config import LayerOwner

    out: list[KVLayer] = []
    n_draft = 0
    for spec in manager.config.layers:
        pool = pools.get(spec.layer_id)
        if pool is None:
            raise ValueError(f"pools: no tensor for layer {spec.layer_id}")
        if str(pool.dtype)[6:] != spec.dtype:
            raise TypeError(f"pools[{spec.layer_id}]: expected dtype {spec.dtype} (the config's), got {pool.dtype}")
        draft = spec.owner is LayerOwner.DRAFT
        layer_id = n_draft if draft else spec.layer_id
        n_draft += draft
        group = manager.group_of_layer(spec.layer_id)
        if spec.life_cycle.is_attention:
            out.append(KVLayer("draft" if draft else "target", layer_id, group, pool.dtype, pool.shape[-1], pool))
        else:
            view = pool.reshape(pool.shape[0], 1, -1)
            out.append(
                KVLayer("draft" if draft else "target", layer_id, group, pool.dtype, view.shape[2], view, kind="state")
            )
    return out


def request_kv_from_cache(
    cache: Any,
    request_id: int,
    num_tokens: int,
    *,
    state_pages: Mapping[int, Sequence[int]] | None = None,
) -> RequestKV:
    """A request's ``RequestKV`` from its ``KVCache``: the first ``ceil(num_tokens / tokens_per_block)`` pages of
    every attention group, and per recurrent group ``state_pages[g]`` (default: the live state page alone)."""
    mgr = cache.manager
    tpb = mgr.tokens_per_block
    nb = -(-num_tokens // tpb)
    pages: list[tuple[int, ...]] = []
    states: list[tuple[int, ...]] = []
    for g in mgr.groups:
        gid = g.group_id
        if g.life_cycle.is_attention:
            idx = cache.page_indices(gid)
            if len(idx) < nb or any(p < 0 for p in idx[:nb]):
                raise ValueError(f"cache: group {gid} holds {len(idx)} pages, {nb} valid ones needed for {num_tokens}")
            pages.append(tuple(idx[:nb]))
            states.append(())
        else:
            pages.append(())
            if state_pages is not None and gid in state_pages:
                states.append(tuple(state_pages[gid]))
            else:
                live = cache.live_page(gid)
                if live is None:
                    raise ValueError(f"cache: no live state page in recurrent group {gid} (is the cache active?)")
                states.append((live.index,))
    return RequestKV(request_id, num_tokens, tuple(pages), tuple(states))
