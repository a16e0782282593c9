"""Memory sizing: the KV budget, the drafter's scratch reserve, and the PyTorch memory cap.

All functions are pure arithmetic on byte counts (the caller measures free memory), so they are tested
without a GPU.

* :func:`kv_budget_bytes`: ``fraction x free``, minus, for a *context-only* drafter (one that only computes
  the prompt's draft KV), ``(1 - fraction)`` of its resident weights that the target does not also hold: the
  weights are charged to the KV budget instead of the PyTorch headroom.
* :func:`draft_scratch_tokens` / :func:`scratch_reserve_bytes`: room for a drafter's next block beyond every
  request's history, ``max_batch_size x (max_draft_len + 1)`` tokens (plus the same per request of
  preemption headroom) in every attention layer and every draft layer; recurrent layers need none.
* :func:`plan_kv_memory`: budget - reserve, split into pages per pool group by the config's pool ratios.
* :func:`torch_mem_safety_margin` / :func:`torch_memory_cap`: PyTorch may grow to what it holds plus the free
  memory minus a margin kept for allocations outside it (driver, streams, IPC). The margin is 1 GiB by
  default, or the model's declared one, and never more than half the free memory: the reference system's
  ``min(1 GiB, free)`` consumed *all* free memory when 1 GiB or less was free, leaving PyTorch unable to grow
  its reservation although memory was free (a review finding).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.kvcache.config import KVCacheConfig, Tier, TierConfig

__all__ = [
    "DEFAULT_TORCH_MEM_SAFETY_MARGIN",
    "GiB",
    "KVMemoryPlan",
    "draft_scratch_tokens",
    "kv_budget_bytes",
    "plan_kv_memory",
    "scratch_reserve_bytes",
    "torch_mem_safety_margin",
    "torch_memory_cap",
    "torch_memory_fraction",
]

GiB = 1 << 30
DEFAULT_TORCH_MEM_SAFETY_MARGIN = GiB


def _nonneg_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {v}")
    return v


def _fraction(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float in (0, 1], got {type(v).__name__}")
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name}: expected a float in (0, 1], got {v}")
    return float(v)


def torch_mem_safety_margin(free_bytes: int, declared: int | None = None) -> int:
    """Bytes kept outside PyTorch's cap: ``declared`` (a model's ``RuntimeHooks.torch_mem_safety_margin``) or
    1 GiB, clamped to half of ``free_bytes`` so that PyTorch always keeps room to grow."""
    _nonneg_int("free_bytes", free_bytes)
    margin = DEFAULT_TORCH_MEM_SAFETY_MARGIN if declared is None else _nonneg_int("declared", declared)
    return min(margin, free_bytes // 2)


def torch_memory_cap(free_bytes: int, reserved_bytes: int, *, declared_margin: int | None = None) -> int:
    """Bytes PyTorch may hold: what it has reserved plus the free memory minus the safety margin."""
    _nonneg_int("reserved_bytes", reserved_bytes)
    return reserved_bytes + free_bytes - torch_mem_safety_margin(free_bytes, declared_margin)


def torch_memory_fraction(
    total_bytes: int, free_bytes: int, reserved_bytes: int, *, declared_margin: int | None = None
) -> float:
    """:func:`torch_memory_cap` as a fraction of the device memory (for ``set_per_process_memory_fraction``)."""
    if _nonneg_int("total_bytes", total_bytes) == 0:
        raise ValueError("total_bytes: expected a positive device memory size, got 0")
    return min(1.0, torch_memory_cap(free_bytes, reserved_bytes, declared_margin=declared_margin) / total_bytes)


def draft_scratch_tokens(max_batch_size: int, max_draft_len: int, preemption_headroom: int = 0) -> int:
    """Tokens reserved per attention/draft layer for a drafter's next block: one ``max_draft_len + 1`` run per
    request the step may hold, the preemption headroom's requests included."""
    _nonneg_int("max_batch_size", max_batch_size)
    _nonneg_int("max_draft_len", max_draft_len)
    _nonneg_int("preemption_headroom", preemption_headroom)
    return (max_batch_size + preemption_headroom) * (max_draft_len + 1)


def scratch_reserve_bytes(config: KVCacheConfig, scratch_tokens: int) -> int:
    """Bytes of ``scratch_tokens`` tokens in every attention layer (target) and every draft layer."""
    _nonneg_int("scratch_tokens", scratch_tokens)
    # Draft layers are attention layers too; recurrent layers (bytes_per_token == 0) take no scratch.
    per_token = sum(s.bytes_per_token for s in config.layers if s.life_cycle.is_attention)
    return scratch_tokens * per_token


def kv_budget_bytes(
    free_bytes: int,
    fraction: float,
    *,
    context_only_drafter_bytes: int = 0,
    drafter_bytes_shared_with_target: int = 0,
) -> int:
    """The KV cache budget: ``fraction`` of the free memory, less a context-only drafter's share (see module)."""
    _nonneg_int("free_bytes", free_bytes)
    f = _fraction("fraction", fraction)
    drafter = _nonneg_int("context_only_drafter_bytes", context_only_drafter_bytes)
    shared = _nonneg_int("drafter_bytes_shared_with_target", drafter_bytes_shared_with_target)
    if shared > drafter:
        raise ValueError(f"drafter_bytes_shared_with_target: {shared} exceeds the drafter's resident bytes {drafter}")
    charge = int((1.0 - f) * (drafter - shared))
    return max(0, int(free_bytes * f) - charge)


@dataclass(frozen=True)
class KVMemoryPlan:
    """The outcome of :func:`plan_kv_memory`: bytes and pages per pool group for the GPU tier."""

    budget_bytes: int
    reserve_bytes: int
    scratch_tokens: int
    pool_bytes: int
    pages_per_group: tuple[int, ...]

    def gpu_tier(self) -> TierConfig:
        """The GPU tier with these page counts, for a :class:`~kvforge.kvcache.config.KVCacheConfig`."""
        return TierConfig(Tier.GPU, pages=self.pages_per_group)


def plan_kv_memory(
    config: KVCacheConfig,
    free_bytes: int,
    fraction: float,
    *,
    max_batch_size: int = 0,
    max_draft_len: int | None = None,
    preemption_headroom: int = 0,
    context_only_drafter_bytes: int = 0,
    drafter_bytes_shared_with_target: int = 0,
) -> KVMemoryPlan:
    """Size the GPU pools: the budget, minus the drafter's scratch reserve (when ``max_draft_len`` is given),
    split by ``config.resolved_pool_ratios`` into whole pages of each group."""
    budget = kv_budget_bytes(
        free_bytes,
        fraction,
        context_only_drafter_bytes=context_only_drafter_bytes,
        drafter_bytes_shared_with_target=drafter_bytes_shared_with_target,
    )
    scratch = 0
    if max_draft_len is not None:
        scratch = draft_scratch_tokens(max_batch_size, max_draft_len, preemption_headroom)
    reserve = scratch_reserve_bytes(config, scratch)
    pool_bytes = max(0, budget - reserve)
    pages = tuple(int(pool_bytes * r) // g.bytes_per_page for g, r in zip(config.groups, config.resolved_pool_ratios))
    return KVMemoryPlan(budget, reserve, scratch, pool_bytes, pages)
