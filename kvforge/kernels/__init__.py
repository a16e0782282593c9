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

__all__ = ["device_capability", "export_tuned", "interpreting", "kernel_device", "num_sms"]
