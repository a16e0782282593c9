"""Triton kernels with plain-torch references.

On a machine where torch sees no CUDA device, importing this package turns on Triton's interpreter
(``TRITON_INTERPRET=1``, unless the variable is already set) before any kernel is defined, so every op runs
on CPU tensors. The variable is read when a kernel is decorated, hence here and not per call.
"""

import os as _os

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from kvforge.kernels._runtime import (
    device_capability,
    export_tuned,
    interpreting,
    kernel_device,
    num_sms,
)

# Public ops, imported from their modules on first access: `import kvforge.kernels` stays cheap (no kernel is
# compiled or decorated until an op is used), and the interpreter flag above is set before any kernel module loads.
# quantize_fp8 is not re-exported: its module has the same name, so `kvforge.kernels.quantize_fp8` would be the
# function or the module depending on import order (and `import kvforge.kernels.quantize_fp8 as m` would bind the
# function); import it from `kvforge.kernels.quantize_fp8`.
_LAZY = {
    "MLAContextPlan": "mla_context",
    "mla_context_attention": "mla_context",
    "mla_context_attention_ref": "mla_context",
    "copy_block_offsets": "block_offsets",
    "copy_block_offsets_ref": "block_offsets",
    "SlotStores": "slot_ops",
    "slot_scatter": "slot_ops",
    "slot_scatter_ref": "slot_ops",
    "step_gather": "slot_ops",
    "step_gather_ref": "slot_ops",
    "copy_small_pinned_pair": "pinned_pair",
    "copy_small_pinned_pair_ref": "pinned_pair",
    "pack_kv_blocks": "kv_pack",
    "pack_kv_blocks_ref": "kv_pack",
    "unpack_kv_blocks": "kv_pack",
    "unpack_kv_blocks_ref": "kv_pack",
    "merge_attention_states": "merge_states",
    "merge_attention_states_ref": "merge_states",
    "MLADecodePlan": "mla_decode",
    "mla_decode_attention": "mla_decode",
    "mla_decode_attention_ref": "mla_decode",
}

__all__ = ["device_capability", "export_tuned", "interpreting", "kernel_device", "num_sms", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
