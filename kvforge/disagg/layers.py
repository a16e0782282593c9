"""What disaggregation needs from the KV cache: the layer list and a request's pages (the disagg -> cache seam).

The cache manager (``kvforge.kvcache``) provides these; disaggregation never calls the manager itself.

* ``KVLayer``: one layer's page pool on this rank. ``owner`` is ``"target"`` or ``"draft"`` (a drafter sharing
  the cache appends its layers after the target's); ``layer_id`` numbers the owner's layers over the whole model
  (target ids run over all PP stages, draft ids from 0); ``group`` is the layer group (life cycle) whose page
  list addresses the pool; ``pool`` is ``[num_pages, tokens_per_block, elems_per_token]`` in ``dtype``, each token
  row holding ``heads`` KV heads of ``elems_per_token // heads`` elements, head-major (for MLA one latent "head"
  of 576 elements). Non-MLA layers keep a head's K and V together in its slice so that a TP head split is one
  column range per row.
* ``RequestKV``: a request's pages on this rank, ``page_indices[group][k]`` = the page holding the k-th block
  this rank holds, in block order. A context rank holds every block of the prompt; a helix generation rank
  holds its round-robin share (``kvforge.disagg.mapping.helix_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

OWNERS = ("target", "draft")


@dataclass(frozen=True, eq=False)
class KVLayer:
    owner: str
    layer_id: int
    group: int
    dtype: torch.dtype
    elems_per_token: int
    pool: torch.Tensor
    heads: int = 1

    def __post_init__(self) -> None:
        if self.owner not in OWNERS:
            raise ValueError(f"owner: expected one of {OWNERS}, got {self.owner!r}")
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

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"num_tokens: expected an int >= 0, got {self.num_tokens!r}")
        object.__setattr__(self, "page_indices", tuple(tuple(int(p) for p in g) for g in self.page_indices))

    def num_blocks(self, tokens_per_block: int) -> int:
        return -(-self.num_tokens // tokens_per_block)


def check_layers(layers: Sequence[KVLayer]) -> int:
    """Check a rank's layers (one tokens_per_block and device, unique (owner, layer_id)); returns tokens_per_block."""
    if not layers:
        raise ValueError("layers: expected at least one KVLayer")
    for i, ly in enumerate(layers):
        if not isinstance(ly, KVLayer):
            raise TypeError(f"layers[{i}]: expected a KVLayer, got {type(ly).__name__}")
    tpb = layers[0].tokens_per_block
    dev = layers[0].pool.device
    seen: set[tuple[str, int]] = set()
    for i, ly in enumerate(layers):
        if ly.tokens_per_block != tpb:
            raise ValueError(f"layers[{i}]: expected tokens_per_block {tpb} like layers[0], got {ly.tokens_per_block}")
        if ly.pool.device != dev:
            raise ValueError(f"layers[{i}]: expected its pool on {dev} like layers[0], got {ly.pool.device}")
        if ly.key in seen:
            raise ValueError(f"layers[{i}]: {ly.owner} layer {ly.layer_id} is listed twice")
        seen.add(ly.key)
    return tpb
