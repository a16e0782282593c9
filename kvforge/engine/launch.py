"""The launcher decisions an engine makes once at setup (the reference's executor-creation steps, in order).

:func:`plan_launch` returns a :class:`LaunchPlan`:

* **memory cap**: on CUDA, PyTorch's allocations are capped at what it holds plus the free device memory less
  the model's safety margin (``RuntimeHooks.torch_mem_safety_margin``, default 1 GiB, clamped to half the free
  memory): :func:`kvforge.kvcache.sizing.torch_memory_fraction` -> :func:`kvforge.disagg.launch.apply_memory_cap`.
  On a CPU model nothing is capped (``memory_fraction`` None).
* **server role**: :func:`kvforge.disagg.launch.current_role` (``KVFORGE_DISAGG_ROLE``, forwarded to every
  worker). A context-only worker keeps the context-only layout: no verify scratch state rows and no decode
  graphs (it never runs a generation step; its requests leave after their first token).
* **shared draft KV**: the drafter's latent pages live in the target's cache manager (a DRAFT layer) when a
  speculative config exists (``draft_len > 0``) or the worker is context-only with a drafter (it computes the
  draft KV that travels with the request): setting ``"auto"``, else ``"0"``, resolved by
  :func:`kvforge.disagg.launch.resolve_shared_draft_kv` (``KVFORGE_SHARED_DRAFT_KV`` overrides; INFO line).
  Without it the manager has no draft layer and no draft pages; a drafter then has nowhere to write, so
  ``draft_len > 0`` with the share turned off is refused.
* **manager class**: :func:`kvforge.disagg.launch.log_manager_class` (the model's declared class or the
  library's default; INFO line). Both INFO lines come once per engine, i.e. once per manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.disagg.launch import (
    ServerRole,
    apply_memory_cap,
    current_role,
    log_manager_class,
    resolve_shared_draft_kv,
)
from kvforge.kvcache.hooks import RuntimeHooks
from kvforge.kvcache.sizing import torch_memory_fraction

__all__ = ["LaunchPlan", "plan_launch"]


@dataclass(frozen=True)
class LaunchPlan:
    role: ServerRole | None
    shared_draft_kv: bool
    manager_cls: type
    memory_fraction: float | None

    @property
    def context_only(self) -> bool:
        return self.role is ServerRole.CONTEXT


def plan_launch(
    default_manager_cls: type,
    hooks: RuntimeHooks,
    *,
    device: torch.device,
    draft_len: int,
    has_drafter: bool,
    tokens_per_block: int,
    environ: Any = None,
) -> LaunchPlan:
    """The engine's setup decisions (see the module docstring); applies the memory cap on CUDA."""
    role = current_role(environ)
    fraction = None
    if device.type == "cuda":
        if device.index is None:  # the allocator's cap is per device: name it
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        fraction = torch_memory_fraction(
            total, free, torch.cuda.memory_reserved(device), declared_margin=hooks.torch_mem_safety_margin
        )
        apply_memory_cap(fraction, device)
    spec = draft_len > 0 or (role is ServerRole.CONTEXT and has_drafter)
    shared = has_drafter and resolve_shared_draft_kv(
        "auto" if spec else "0", manages_context_pages=True, tokens_per_block=tokens_per_block, environ=environ
    )
    if draft_len and not shared:
        raise ValueError(
            "draft_len: the drafter's KV lives in the target's cache manager in this engine, but the shared draft "
            "KV pool is turned off (KVFORGE_SHARED_DRAFT_KV=0): use draft_len=0 or allow the share"
        )
    manager_cls = log_manager_class(default_manager_cls, hooks.kv_cache_manager_cls)
    return LaunchPlan(role, shared, manager_cls, fraction)
