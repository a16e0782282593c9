"""The per-step upload of recurrent-state indices and the dummy-request mask to the device.

:class:`StateIndexUpload` keeps host buffers (pinned when CUDA is present) and device buffers of
``max_requests`` rows. :meth:`StateIndexUpload.upload` writes the rows and, when either the indices or the mask
changed since the last upload, sends both with one ``pair_copy`` launch (default
``kvforge.kernels.copy_small_pinned_pair``) when ``use_kernel`` is on and that function accepts the buffers,
else with ordinary copies of the changed buffers; it returns the :class:`UploadPath` taken. Bad row counts raise
``ValueError``. torch is imported when an upload object is built, never at module import; the kernel module only
when the kernel path is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

__all__ = ["StateIndexUpload", "UploadPath"]


class UploadPath(Enum):
    NONE = "none"  # neither buffer changed: nothing written
    KERNEL = "kernel"  # one copy_small_pinned_pair launch wrote both
    COPIES = "copies"  # ordinary copies of the buffers that changed


class StateIndexUpload:
    """Per-step upload of the recurrent state indices (int32) and the dummy-request mask (bool) to the device.

    The host buffers are pinned when CUDA is present. :meth:`upload` writes them and, when either changed since
    the last upload, sends them with one ``pair_copy`` launch (default ``kernels.copy_small_pinned_pair``) when
    ``use_kernel`` is on and that function accepts the buffers, else with ordinary copies of the changed
    buffers. ``pair_copy`` is injectable so the kernel path can be observed on a CPU-only machine.
    """

    def __init__(
        self,
        max_requests: int,
        *,
        use_kernel: bool,
        device: Any = None,
        pin_memory: bool | None = None,
        pair_copy: Callable[..., bool] | None = None,
    ) -> None:
        import torch

        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests: expected an int >= 1, got {max_requests!r}")
        if not isinstance(use_kernel, bool):
            raise TypeError(f"use_kernel: expected a bool, got {type(use_kernel).__name__}")
        cuda = torch.cuda.is_available()
        if device is None:
            device = "cuda" if cuda else "cpu"
        pin = cuda if pin_memory is None else bool(pin_memory)
        if pair_copy is None and use_kernel:
            from kvforge.kernels.pinned_pair import copy_small_pinned_pair

            pair_copy = copy_small_pinned_pair
        self.use_kernel = use_kernel
        self.max_requests = max_requests
        self._pair_copy = pair_copy
        self.host_indices = torch.zeros(max_requests, dtype=torch.int32, pin_memory=pin)
        self.host_mask = torch.zeros(max_requests, dtype=torch.bool, pin_memory=pin)
        self.dev_indices = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.dev_mask = torch.zeros(max_requests, dtype=torch.bool, device=device)
        self._last: tuple[tuple[int, ...], tuple[bool, ...]] = ((), ())
        self._event: Any = None
        self.last_path = UploadPath.NONE
        self.num_rows = 0

    def upload(self, indices: Sequence[int], dummy_mask: Sequence[bool]) -> UploadPath:
        """Make ``dev_indices[:n]`` / ``dev_mask[:n]`` hold these values (n rows); returns the path taken."""
        import torch

        idx = tuple(int(i) for i in indices)
        mask = tuple(bool(m) for m in dummy_mask)
        n = len(idx)
        if len(mask) != n:
            raise ValueError(f"dummy_mask: expected {n} entries (one per row of indices), got {len(mask)}")
        if n > self.max_requests:
            raise ValueError(f"indices: {n} rows exceed max_requests ({self.max_requests})")
        old_idx, old_mask = self._last
        idx_changed, mask_changed = idx != old_idx, mask != old_mask
        if not idx_changed and not mask_changed:
            self.last_path = UploadPath.NONE
            return UploadPath.NONE
        if self._event is not None:
            # An earlier ordinary copy may still read the pinned host buffers.
            self._event.synchronize()
            self._event = None
        hi, hm = self.host_indices[:n], self.host_mask[:n]
        if n:
            hi.copy_(torch.tensor(idx, dtype=torch.int32))
            hm.copy_(torch.tensor(mask, dtype=torch.bool))
        di, dm = self.dev_indices[:n], self.dev_mask[:n]
        path = UploadPath.COPIES
        if self.use_kernel and self._pair_copy is not None and self._pair_copy(hi, hm, di, dm):
            path = UploadPath.KERNEL
        else:
            non_blocking = hi.is_pinned()
            if idx_changed:
                di.copy_(hi, non_blocking=non_blocking)
            if mask_changed:
                dm.copy_(hm, non_blocking=non_blocking)
            if non_blocking and di.device.type == "cuda":
                self._event = torch.cuda.Event()
                self._event.record()
        self._last = (idx, mask)
        self.num_rows = n
        self.last_path = path
        return path
