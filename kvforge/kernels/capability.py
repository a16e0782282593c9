"""What a GPU generation can run: the facts kernels choose their paths by, queried lazily (never at import).

``gpu_capability(device)`` returns a ``GPUCapability`` for a CUDA device, or the interpreter's (``arch=None``)
under ``TRITON_INTERPRET=1``; ``capability_for((major, minor))`` gives the same for an architecture without a
device (offline compiles, tests). Fields: bf16 arithmetic (sm_80+), e4m3 matrix instructions (sm_89+), the
tensor-memory copy engine behind Triton's tensor descriptors (sm_90+), Hopper's warpgroup MMA that the
warp-specialised Gluon kernels are written for (sm_90 only: ``warp_specialized``; whether Gluon itself is
importable is checked where it is used), and the shared memory one program may take (the opt-in limit per
block). Kernels check these before launch and raise ``ValueError`` for inputs a
device cannot run; ``kvforge.kernels.mla_context.mla_context_paths`` turns them into a per-path table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvforge.kernels._runtime import device_capability

# Opt-in shared memory per block (bytes) by architecture, from the CUDA programming guide's table; used when no
# device can be asked (offline compiles and candidate lists for a named architecture).
_SMEM_OPTIN = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448,
               (12, 0): 101376}  # fmt: skip
_INTERPRETER_SMEM = 1 << 20  # no limit worth modelling in the interpreter


@dataclass(frozen=True)
class GPUCapability:
    """``arch``: (major, minor), or None for the CPU interpreter (which runs every path)."""

    arch: tuple[int, int] | None
    bf16: bool
    fp8_mma: bool
    tma: bool
    smem_per_block: int
    warp_specialized: bool = False

    @property
    def name(self) -> str:
        return "interpreter" if self.arch is None else f"sm_{self.arch[0]}{self.arch[1]}"


def capability_for(arch: tuple[int, int] | None, smem_per_block: int | None = None) -> GPUCapability:
    """The capability of an architecture (None: the interpreter); ``smem_per_block`` overrides the table."""
    if arch is None:
        return GPUCapability(None, True, True, True, smem_per_block or _INTERPRETER_SMEM, False)
    major = arch[0]
    smem = smem_per_block or _SMEM_OPTIN.get(arch) or _SMEM_OPTIN.get((major, 0)) or 101376
    return GPUCapability(arch, arch >= (8, 0), arch >= (8, 9), major >= 9, smem, tuple(arch) == (9, 0))


def gpu_capability(device: torch.device | None = None) -> GPUCapability:
    """Capability of ``device`` (default: the current CUDA device), or the interpreter's."""
    cap = device_capability(device)
    if cap is None:
        return capability_for(None)
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _device_capability(index)


@cache
def _device_capability(index: int) -> GPUCapability:
    props = torch.cuda.get_device_properties(index)
    return capability_for((props.major, props.minor), getattr(props, "shared_memory_per_block_optin", None))
