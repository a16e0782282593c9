"""Runtime hooks a model class declares, and the resolution of its KV cache manager class.

A model opts into behaviour by declaring ``runtime_hooks = RuntimeHooks(...)`` on its class; each layer of the
library reads only the fields that concern it, and every default keeps the behaviour of a model that declares
nothing:

* ``torch_mem_safety_margin``: bytes kept outside PyTorch's memory cap (None: the library's 1 GiB default,
  see :func:`kvforge.kvcache.sizing.torch_mem_safety_margin`; either way clamped to keep PyTorch room).
* ``kv_cache_manager_cls``: a subclass of the manager class the library resolves for this model; None keeps
  the resolved class. Anything else raises ``ValueError`` naming both classes.
* ``kv_balanced_admission_planner``: an object with ``window()`` and ``plan()`` replacing the attention-DP
  router's head window and admission plan (the scheduler's concern); None keeps the library's planner.
* ``exact_context_demotion``: judge long-context demotion by the read-only prefix probe (scheduler).
* ``hybrid_cache``: :class:`HybridCachePolicy` for the hybrid (recurrent-state) manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "HybridCachePolicy",
    "RuntimeHooks",
    "resolve_kv_cache_manager_cls",
    "runtime_hooks_of",
    "torch_mem_safety_margin_for",
]


@dataclass(frozen=True)
class HybridCachePolicy:
    """Hybrid-cache choices a model declares.

    ``low_priority_snapshot_prompt_len``: a context request whose prompt is shorter than this gets its
    recurrent pages (live state and snapshots) at the lowest eviction priority; 0 turns it off.
    ``state_index_upload_kernel``: upload the per-step recurrent state indices and dummy-request mask with one
    kernel (``kernels.copy_small_pinned_pair``) instead of two copies.
    """

    low_priority_snapshot_prompt_len: int = 0
    state_index_upload_kernel: bool = False

    def __post_init__(self) -> None:
        v = self.low_priority_snapshot_prompt_len
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"low_priority_snapshot_prompt_len: expected an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"low_priority_snapshot_prompt_len: expected an int >= 0 (0 = off), got {v}")
        if not isinstance(self.state_index_upload_kernel, bool):
            raise TypeError(
                f"state_index_upload_kernel: expected a bool, got {type(self.state_index_upload_kernel).__name__}"
            )


@dataclass(frozen=True)
class RuntimeHooks:
    """What a model class declares about how the runtime serves it (see the module docstring)."""

    torch_mem_safety_margin: int | None = None
    kv_cache_manager_cls: type | None = None
    kv_balanced_admission_planner: Any = None
    exact_context_demotion: bool = False
    hybrid_cache: HybridCachePolicy = field(default_factory=HybridCachePolicy)

    def __post_init__(self) -> None:
        m = self.torch_mem_safety_margin
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int):
                raise TypeError(f"torch_mem_safety_margin: expected an int (bytes) or None, got {type(m).__name__}")
            if m < 0:
                raise ValueError(f"torch_mem_safety_margin: expected bytes >= 0, got {m}")
        cls = self.kv_cache_manager_cls
        if cls is not None and not isinstance(cls, type):
            raise TypeError(f"kv_cache_manager_cls: expected a class or None, got {type(cls).__name__}")
        planner = self.kv_balanced_admission_planner
        if planner is not None:
            missing = [name for name in ("window", "plan") if not callable(getattr(planner, name, None))]
            if missing:
                raise TypeError(
                    f"kv_balanced_admission_planner: expected an object with window() and plan(), "
                    f"{type(planner).__name__} lacks {', '.join(missing)}"
                )
        if not isinstance(self.exact_context_demotion, bool):
            raise TypeError(
                f"exact_context_demotion: expected a bool, got {type(self.exact_context_demotion).__name__}"
            )
        if not isinstance(self.hybrid_cache, HybridCachePolicy):
            raise TypeError(f"hybrid_cache: expected a HybridCachePolicy, got {type(self.hybrid_cache).__name__}")


_DEFAULT_HOOKS = RuntimeHooks()


def runtime_hooks_of(model: Any) -> RuntimeHooks:
    """The hooks a model class (or instance) declares as ``runtime_hooks``; the defaults when it declares none."""
    hooks = getattr(model, "runtime_hooks", None)
    if hooks is None:
        return _DEFAULT_HOOKS
    if not isinstance(hooks, RuntimeHooks):
        raise TypeError(f"runtime_hooks: expected a RuntimeHooks, got {type(hooks).__name__}")
    return hooks


def resolve_kv_cache_manager_cls(resolved: type, hooks: RuntimeHooks | None = None) -> type:
    """The manager class to build: the model's declared class when it subclasses ``resolved``, else ``resolved``.

    Raises ValueError naming both classes when the declared class is not a subclass of ``resolved``.
    """
    if not isinstance(resolved, type):
        raise TypeError(f"resolved: expected a class, got {type(resolved).__name__}")
    declared = None if hooks is None else hooks.kv_cache_manager_cls
    if declared is None:
        return resolved
    if not issubclass(declared, resolved):
        raise ValueError(
            f"kv_cache_manager_cls: the model declares {declared.__module__}.{declared.__qualname__}, which is not "
            f"a subclass of the resolved manager class {resolved.__module__}.{resolved.__qualname__}"
        )
    return declared


def torch_mem_safety_margin_for(hooks: RuntimeHooks | None, free_bytes: int) -> int:
    """The safety margin for a model: its declared one or the default, clamped (see ``sizing``)."""
    from kvforge.kvcache.sizing import torch_mem_safety_margin

    return torch_mem_safety_margin(free_bytes, None if hooks is None else hooks.torch_mem_safety_margin)
