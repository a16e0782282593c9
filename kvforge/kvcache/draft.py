"""Shared draft layers: a speculative drafter's layers appended to the target's KV cache manager.

* :func:`resolve_draft_kv_dtype`: the dtype a drafter's KV pages are stored in. FP8 e4m3 when the drafter
  declares it, else the drafter's weight dtype; any other declaration is rejected, and an unquantised
  declaration that differs from the weight dtype is rejected too (the pool is stored in the weight dtype, so
  accepting it would silently size and read the pool wrongly).
* :func:`with_draft_layers`: a new config with the drafter's layers appended (owner DRAFT), each checked.
* :func:`insert_draft_pool_ratios` (defined in :mod:`~kvforge.kvcache.config`, which resolves pool ratios
  with it): the draft groups' byte shares, inserted into the target's pool ratios so
  that every draft group holds as many pages as the target's full-attention group (a drafter writes one draft
  page for every target block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvforge.kvcache.config import KVCacheConfig, LayerOwner, LayerSpec, dtype_name, insert_draft_pool_ratios

__all__ = ["DRAFT_FP8_DTYPE", "insert_draft_pool_ratios", "resolve_draft_kv_dtype", "with_draft_layers"]

DRAFT_FP8_DTYPE = "float8_e4m3fn"


def resolve_draft_kv_dtype(declared: Any, weight_dtype: Any) -> str:
    """The draft layers' KV dtype from a drafter's declaration (None: not declared) and its weight dtype.

    Absent (None) keeps the weight dtype; ``float8_e4m3fn`` selects FP8 pages; the weight dtype itself is
    accepted. Anything else raises: a non-dtype value ``TypeError``, another dtype ``ValueError``.
    """
    weights = dtype_name(weight_dtype, arg="weight_dtype")
    if declared is None:
        return weights
    name = dtype_name(declared, arg="draft_kv_dtype")
    if name in (DRAFT_FP8_DTYPE, weights):
        return name
    raise ValueError(
        f"draft_kv_dtype: expected {DRAFT_FP8_DTYPE} or the drafter's weight dtype {weights}, got {name} "
        "(an unquantised draft cache is stored in the weight dtype)"
    )


def with_draft_layers(config: KVCacheConfig, draft_layers: Sequence[LayerSpec], *, weight_dtype: Any) -> KVCacheConfig:
    """``config`` with ``draft_layers`` appended as DRAFT layers.

    Each draft layer's dtype must be FP8 e4m3 or the drafter's ``weight_dtype`` (:func:`resolve_draft_kv_dtype`)
    and its layer id must be new. The target's ``pool_ratios`` (one per target group) stay as given and the
    draft shares are inserted; a config whose ratios already name every group must be rebuilt by the caller.
    """
    if isinstance(draft_layers, (str, bytes)) or not isinstance(draft_layers, Sequence):
        raise TypeError(f"draft_layers: expected a sequence of LayerSpec, got {type(draft_layers).__name__}")
    if not draft_layers:
        raise ValueError("draft_layers: expected at least one layer")
    appended = []
    for i, spec in enumerate(draft_layers):
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"draft_layers[{i}]: expected a LayerSpec, got {type(spec).__name__}")
        resolve_draft_kv_dtype(spec.dtype, weight_dtype)
        appended.append(spec if spec.owner is LayerOwner.DRAFT else replace(spec, owner=LayerOwner.DRAFT))
    n_target_groups = sum(1 for g in config.groups if g.owner is LayerOwner.TARGET)
    ratios = config.pool_ratios
    if ratios is not None and len(ratios) != n_target_groups:
        raise ValueError(
            f"config.pool_ratios: expected one share per target group ({n_target_groups}) to insert draft shares "
            f"into, got {len(ratios)}"
        )
    return KVCacheConfig(
        tokens_per_block=config.tokens_per_block,
        layers=config.layers + tuple(appended),
        tiers=config.tiers,
        pool_ratios=ratios,
    )
