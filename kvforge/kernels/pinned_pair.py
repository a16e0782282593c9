"""Paired small upload: one SM kernel writes two device buffers from two small pinned host buffers.

Why a kernel: two ``copy_(non_blocking=True)`` are two copy-engine hand-offs that delay the execution stream in
front of the next step's inputs; one kernel reading pinned memory through unified addressing is one launch.

Why a snapshot: the kernel runs later than the call returns, and callers refill their host buffers for the
next step at once (admission, scheduling). So the call first copies both host buffers (on the CPU) into a
pinned staging buffer of its own and the kernel reads that snapshot. torch's pinned allocator keeps a block
alive for a ``copy_`` it saw, but it does not see a kernel's reads, so the staging buffers are not handed back
to it: they live in a ring (``StagingRing``) and a buffer is reused only after the event recorded behind its
kernel has completed. With the ring full (64 uploads in flight) the next call waits for the oldest.

``copy_small_pinned_pair`` returns False and launches nothing when the kernel path does not apply, and the
caller then copies as usual: no CUDA device (CPU torch has no pinned memory), a host buffer that is not a
pinned contiguous CPU tensor or holds more than 4 KiB, a destination that is not a contiguous CUDA tensor, or
a stream that is being captured into a CUDA graph (a graph would bake one staging buffer in). Mismatched
pairs (dtype, element count) are errors, not fallbacks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_tensor
from kvforge.kernels._runtime import ConfigTable, TunedKernel, interpreting
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = ["MAX_PAIR_BYTES", "StagingRing", "copy_small_pinned_pair", "copy_small_pinned_pair_ref", "selfcheck"]

MAX_PAIR_BYTES = 4096
_RING_SLOTS = 64


@triton.jit(do_not_specialize=["n_a", "n_b"])
def _pinned_pair_kernel(src_a, dst_a, n_a, src_b, dst_b, n_b, BLOCK: tl.constexpr):
    # Program 0 copies the first buffer, program 1 the second, so both PCIe reads are in flight together.
    if tl.program_id(0) == 0:
        for start in range(0, n_a, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_a
            tl.store(dst_a + offs, tl.load(src_a + offs, mask=m), mask=m)
    else:
        for start in range(0, n_b, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_b
            tl.store(dst_b + offs, tl.load(src_b + offs, mask=m), mask=m)


# 4 KiB is at most 1,024 words: one pass of a 1,024-wide block, nothing to tune.
_TABLE = ConfigTable(
    fallback=[triton.Config({"BLOCK": 1024}, num_warps=4)],
    interpreter=triton.Config({"BLOCK": 256}, num_warps=1),
)
_KERNEL = TunedKernel("copy_small_pinned_pair", _pinned_pair_kernel, _TABLE)


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views of a (src, dst) pair, widened to int32 words when sizes and addresses allow."""
    sb, db = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
    if sb.numel() % 4 == 0 and sb.data_ptr() % 4 == 0 and db.data_ptr() % 4 == 0:
        return sb.view(torch.int32), db.view(torch.int32)
    return sb, db


def _launch_pair(src_a: torch.Tensor, dst_a: torch.Tensor, src_b: torch.Tensor, dst_b: torch.Tensor) -> None:
    """Copy src_a -> dst_a and src_b -> dst_b (contiguous, equal byte sizes) in one launch. No checks."""
    sa, da = _words(src_a, dst_a)
    sb, db = _words(src_b, dst_b)
    # n_a / n_b are do_not_specialize; the spec holds the rest of what the compiled kernel depends on.
    spec = tuple((t.dtype, t.device, t.data_ptr() % 16 == 0) for t in (sa, da, sb, db))
    _KERNEL.launch_fast(_GRID2, (), spec, (sa, da, sa.numel(), sb, db, sb.numel()))


def _grid2(meta: object) -> tuple[int]:
    return (2,)


_GRID2 = _grid2


@dataclass
class _Slot:
    buffer: Any  # pinned uint8 staging, 2 * MAX_PAIR_BYTES
    event: Any  # recorded after the kernel that reads ``buffer``


class StagingRing:
    """Staging buffers reused only once the event recorded behind their last reader has completed.

    ``acquire()`` hands out a slot nobody reads any more: a free one, else the oldest in flight if its event has
    completed, else a new one (up to ``max_slots``, or past it only when every slot is held by a caller), else
    the oldest in flight after waiting for its event.
    ``release(slot)`` takes it back after the caller recorded the slot's event behind its kernel;
    ``give_back(slot)`` takes back a slot that was never used (a failed launch). Thread-safe.
    """

    def __init__(self, max_slots: int, new_slot: Callable[[], _Slot]) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots: expected >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._new_slot = new_slot
        self._free: list[_Slot] = []
        self._busy: deque[_Slot] = deque()
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self) -> _Slot:
        # O(1) driver queries per call: only the oldest slot in flight is asked. Uploads on one stream complete
        # in order, so the oldest is the first to finish; with several streams a slot that finished out of
        # order waits its turn, which costs a slot, never a premature reuse.
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._busy and self._busy[0].event.query():
                return self._busy.popleft()
            # With nothing in flight to wait for, every slot is held by a concurrent caller: make one more
            # rather than fail (bounded by the number of threads uploading at once).
            if self._created < self.max_slots or not self._busy:
                self._created += 1
                return self._new_slot()
            oldest = self._busy.popleft()
            oldest.event.synchronize()
            return oldest

    def release(self, slot: _Slot) -> None:
        with self._lock:
            self._busy.append(slot)

    def give_back(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def created(self) -> int:
        return self._created

    def counts(self) -> tuple[int, int]:
        """(free, in flight)."""
        with self._lock:
            return len(self._free), len(self._busy)


_RINGS: dict[int, StagingRing] = {}
_RINGS_LOCK = threading.Lock()


def _ring(device_index: int) -> StagingRing:
    with _RINGS_LOCK:
        ring = _RINGS.get(device_index)
        if ring is None:

            def new_slot() -> _Slot:
                buf = torch.empty(2 * MAX_PAIR_BYTES, dtype=torch.uint8, pin_memory=True)
                return _Slot(buf, torch.cuda.Event())

            ring = _RINGS[device_index] = StagingRing(_RING_SLOTS, new_slot)
        return ring


def _check_pair(name_h: str, host: object, name_d: str, dev: object) -> tuple[torch.Tensor, torch.Tensor]:
    h = check_tensor(name_h, host)
    d = check_tensor(name_d, dev)
    if h.dtype != d.dtype:
        raise TypeError(f"{name_d}: expected dtype {h.dtype} (as {name_h}), got {d.dtype}")
    if h.numel() != d.numel():
        raise ValueError(f"{name_d}: expected {h.numel()} elements (as {name_h}), got {d.numel()}")
    return h, d


def _kernel_path_applies(host: torch.Tensor, dev: torch.Tensor) -> bool:
    return (
        host.device.type == "cpu"
        and host.is_pinned()
        and host.is_contiguous()
        and host.numel() * host.element_size() <= MAX_PAIR_BYTES
        and dev.device.type == "cuda"
        and dev.is_contiguous()
    )


def copy_small_pinned_pair(
    host_a: torch.Tensor, host_b: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor
) -> bool:
    """Upload ``host_a -> dev_a`` and ``host_b -> dev_b`` with one kernel on the current stream; True if done.

    Pairs must match in dtype and element count (shapes may differ). Returns False, launching nothing, when
    the kernel path does not apply (module docstring); the caller then copies as usual. The host buffers may
    be rewritten as soon as this returns: the kernel reads a snapshot.
    """
    host_a, dev_a = _check_pair("host_a", host_a, "dev_a", dev_a)
    host_b, dev_b = _check_pair("host_b", host_b, "dev_b", dev_b)
    if interpreting() or not torch.cuda.is_available():
        return False
    if not (_kernel_path_applies(host_a, dev_a) and _kernel_path_applies(host_b, dev_b)):
        return False
    if dev_a.device != dev_b.device:
        raise ValueError(f"dev_b: expected a tensor on {dev_a.device} (as dev_a), got one on {dev_b.device}")
    with torch.cuda.device(dev_a.device):
        if torch.cuda.is_current_stream_capturing():
            return False
        na = host_a.numel() * host_a.element_size()
        nb = host_b.numel() * host_b.element_size()
        if na + nb == 0:
            return True
        ring = _ring(dev_a.device.index if dev_a.device.index is not None else torch.cuda.current_device())
        slot = ring.acquire()
        try:
            snap_a = slot.buffer[:na]
            snap_b = slot.buffer[MAX_PAIR_BYTES : MAX_PAIR_BYTES + nb]
            snap_a.copy_(host_a.reshape(-1).view(torch.uint8))
            snap_b.copy_(host_b.reshape(-1).view(torch.uint8))
            _launch_pair(snap_a, dev_a, snap_b, dev_b)
            slot.event.record()
        except BaseException:
            ring.give_back(slot)
            raise
        ring.release(slot)
    return True


def copy_small_pinned_pair_ref(
    host_a: torch.Tensor, host_b: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the device buffers hold after an upload: the host values, shaped like the device buffers."""
    return (host_a.reshape(dev_a.shape).to(dev_a.device).clone(), host_b.reshape(dev_b.shape).to(dev_b.device).clone())


def selfcheck(device: torch.device) -> list[CheckRow]:
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 1 << 20, (512,), generator=g, dtype=torch.int32)
    b = torch.randint(0, 2, (509,), generator=g).bool()
    if device.type == "cuda":

        def run() -> tuple[float, bool]:
            ha, hb = a.pin_memory(), b.pin_memory()
            da = torch.empty(512, dtype=torch.int32, device=device)
            db = torch.empty(509, dtype=torch.bool, device=device)
            if not copy_small_pinned_pair(ha, hb, da, db):
                return float("nan"), False
            ra, rb = copy_small_pinned_pair_ref(ha, hb, da, db)
            bad = int((da != ra).sum()) + int((db != rb).sum())
            return float(bad), bad == 0

        return [timed_check("copy_small_pinned_pair", device, "512 int32 + 509 bool (pinned)", run, note="bad")]

    def fallback() -> tuple[float, bool]:
        da = torch.full((512,), -1, dtype=torch.int32)
        db = torch.zeros(509, dtype=torch.bool)
        took = copy_small_pinned_pair(a, b, da, db)
        return 0.0, (not took) and bool((da == -1).all()) and not bool(db.any())

    def kernel() -> tuple[float, bool]:
        da = torch.full((512,), -1, dtype=torch.int32)
        db = torch.zeros(509, dtype=torch.bool)
        _launch_pair(a, da, b, db)
        bad = int((da != a).sum()) + int((db != b).sum())
        return float(bad), bad == 0

    return [
        timed_check("copy_small_pinned_pair", device, "512 int32 + 509 bool", fallback, note="no pinned memory: False"),
        timed_check("copy_small_pinned_pair (kernel)", device, "512 int32 + 509 bool", kernel, note="bad elements"),
    ]
