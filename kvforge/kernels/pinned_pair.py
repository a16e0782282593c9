"""Paired small upload: one SM kernel writes two device buffers from two small pinned host buffers.

``copy_small_pinned_pair`` snapshots both host buffers into a pinned staging slot of its own and launches one
kernel that reads the snapshot, so callers may refill their host buffers as soon as it returns. It returns
False and launches nothing when the kernel path does not apply, and the caller then copies as usual: no CUDA
device, a host buffer that is not a pinned contiguous CPU tensor or holds more than 4 KiB, a destination that
is not a contiguous CUDA tensor, or a stream being captured into a CUDA graph. Mismatched pairs (dtype,
element count), meta tensors and (on the kernel path) overlapping destinations are errors, not fallbacks.
With 64 uploads in flight on a device, the next call waits for the oldest.

Why a kernel, the staging ring and the hot path: ``docs/kernels.md``.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_tensor, tensors_overlap
from kvforge.kernels._runtime import (
    ConfigTable,
    DirectLaunch,
    PlanCache,
    TunedKernel,
    hooks_active,
    interpreting,
    tensor_key,
)
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = ["MAX_PAIR_BYTES", "StagingRing", "copy_small_pinned_pair", "copy_small_pinned_pair_ref", "selfcheck"]

MAX_PAIR_BYTES = 4096
_RING_SLOTS = 64
_SLOT_BYTES = 2 * MAX_PAIR_BYTES  # snapshot a at offset 0, b at MAX_PAIR_BYTES


@triton.jit(do_not_specialize=["off_a", "n_a", "off_b", "n_b"])
def _pinned_pair_kernel(src_a, off_a, dst_a, n_a, src_b, off_b, dst_b, n_b, BLOCK: tl.constexpr):
    # Program 0 copies the first buffer, program 1 the second, so both PCIe reads are in flight together.
    # off_a / off_b: where the snapshot starts in src (elements), so one staging slab serves every slot.
    if tl.program_id(0) == 0:
        for start in range(0, n_a, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_a
            tl.store(dst_a + offs, tl.load(src_a + off_a + offs, mask=m), mask=m)
    else:
        for start in range(0, n_b, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_b
            tl.store(dst_b + offs, tl.load(src_b + off_b + offs, mask=m), mask=m)


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
    # The offsets and n_a / n_b are do_not_specialize; the spec holds the rest the compiled kernel depends on.
    spec = tuple((t.dtype, t.device, t.data_ptr() % 16 == 0) for t in (sa, da, sb, db))
    _KERNEL.launch_fast(_GRID2, (), spec, (sa, 0, da, sa.numel(), sb, 0, db, sb.numel()))


def _grid2(meta: object) -> tuple[int]:
    return (2,)


_GRID2 = _grid2


@dataclass
class _Slot:
    buffer: Any  # staging: (pinned uint8 tensor, its int32 view, byte offset of the slot in it)
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


def _pinned_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class _Staging:
    """One device's staging: a pinned slab of ``_RING_SLOTS`` slots, the ring handing them out, and the torch
    stream objects that slot events are recorded on (cached per raw stream handle)."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.slab = _pinned_bytes(_RING_SLOTS * _SLOT_BYTES)
        self.words = self.slab.view(torch.int32)
        self._made = 0
        self.ring = StagingRing(_RING_SLOTS, self._new_slot)
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _new_slot(self) -> _Slot:
        # Called under the ring's lock. Past the slab (only when concurrent callers hold every slot) a slot
        # gets a pinned buffer of its own.
        i, self._made = self._made, self._made + 1
        if i < _RING_SLOTS:
            buffer = (self.slab, self.words, i * _SLOT_BYTES)
        else:
            own = _pinned_bytes(_SLOT_BYTES)
            buffer = (own, own.view(torch.int32), 0)
        return _Slot(buffer, torch.cuda.Event())

    def stream(self, raw: int) -> torch.cuda.Stream:
        """The torch stream object of the current stream, whose raw handle is ``raw``."""
        s = self._streams.get(raw)
        if s is None:
            s = torch.cuda.current_stream(self.device_index)
            if s.cuda_stream == raw:
                self._streams[raw] = s
        return s


_STAGING: dict[int, _Staging] = {}
_STAGING_LOCK = threading.Lock()


def _staging(device_index: int) -> _Staging:
    with _STAGING_LOCK:
        st = _STAGING.get(device_index)
        if st is None:
            st = _STAGING[device_index] = _Staging(device_index)
        return st


def _check_pair(name_h: str, host: object, name_d: str, dev: object) -> tuple[torch.Tensor, torch.Tensor]:
    h = check_tensor(name_h, host)
    d = check_tensor(name_d, dev)
    for name, t in ((name_h, h), (name_d, d)):
        if t.device.type == "meta":  # no storage: neither the kernel nor the caller's fallback copy can use it
            raise ValueError(f"{name}: expected a tensor with storage, got a meta tensor")
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


class _PairPlan:
    """A checked (host_a, host_b, dev_a, dev_b) set whose upload takes the kernel path; addresses only."""

    __slots__ = ("dev_a", "dev_b", "device", "direct", "host_a", "host_b", "n_a", "n_b", "nbytes_a", "nbytes_b")
    __slots__ += ("spec", "staging", "word_a", "word_b")

    def __init__(self, host_a: torch.Tensor, host_b: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor) -> None:
        index = dev_a.device.index
        self.device = index if index is not None else torch.cuda.current_device()
        self.host_a, self.host_b = host_a.data_ptr(), host_b.data_ptr()
        self.dev_a, self.dev_b = dev_a.data_ptr(), dev_b.data_ptr()
        self.nbytes_a = host_a.numel() * host_a.element_size()
        self.nbytes_b = host_b.numel() * host_b.element_size()
        # int32 words when the size and the destination allow (staging slots are always word-aligned).
        self.word_a = self.nbytes_a % 4 == 0 and self.dev_a % 4 == 0
        self.word_b = self.nbytes_b % 4 == 0 and self.dev_b % 4 == 0
        self.n_a = self.nbytes_a // 4 if self.word_a else self.nbytes_a
        self.n_b = self.nbytes_b // 4 if self.word_b else self.nbytes_b
        self.spec = ("staged", self.device, self.word_a, self.word_b, self.dev_a % 16 == 0, self.dev_b % 16 == 0)
        self.staging: _Staging | None = None
        self.direct: DirectLaunch | None = None


_PLANS = PlanCache()


def copy_small_pinned_pair(
    host_a: torch.Tensor, host_b: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor
) -> bool:
    """Upload ``host_a -> dev_a`` and ``host_b -> dev_b`` with one kernel on the current stream; True if done.

    Pairs must match in dtype and element count (shapes may differ). Returns False, launching nothing, when
    the kernel path does not apply (module docstring); the caller then copies as usual. The host buffers may
    be rewritten as soon as this returns: the kernel reads a snapshot.
    """
    try:
        plan = _PLANS.get((tensor_key(host_a), tensor_key(host_b), tensor_key(dev_a), tensor_key(dev_b)))
    except (AttributeError, TypeError):  # not tensors: the checked path names the argument
        plan = None
    if plan is None:
        plan = _pair_plan(host_a, host_b, dev_a, dev_b)
        if plan is None:
            return False
    if torch.cuda.current_device() != plan.device:
        with torch.cuda.device(plan.device):
            return _upload(plan, dev_a, dev_b)
    return _upload(plan, dev_a, dev_b)


def _pair_plan(
    host_a: torch.Tensor, host_b: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor
) -> _PairPlan | None:
    """Every check of ``copy_small_pinned_pair``: the plan (cached) when the kernel path applies, else None."""
    host_a, dev_a = _check_pair("host_a", host_a, "dev_a", dev_a)
    host_b, dev_b = _check_pair("host_b", host_b, "dev_b", dev_b)
    if interpreting() or not torch.cuda.is_available():
        return None
    if not (_kernel_path_applies(host_a, dev_a) and _kernel_path_applies(host_b, dev_b)):
        return None
    if dev_a.device != dev_b.device:
        raise ValueError(f"dev_b: expected a tensor on {dev_a.device} (as dev_a), got one on {dev_b.device}")
    if tensors_overlap(dev_a, dev_b):  # the two programs would write the same bytes, in either order
        raise ValueError("dev_b: overlaps dev_a in memory; expected two separate device buffers")
    plan = _PairPlan(host_a, host_b, dev_a, dev_b)
    return _PLANS.put((tensor_key(host_a), tensor_key(host_b), tensor_key(dev_a), tensor_key(dev_b)), plan)


_memmove = ctypes.memmove


def _upload(plan: _PairPlan, dev_a: torch.Tensor, dev_b: torch.Tensor) -> bool:
    """Snapshot and launch on ``plan.device`` (the current device here)."""
    if torch.cuda.is_current_stream_capturing():
        return False  # a graph would bake one staging slot in
    if plan.nbytes_a + plan.nbytes_b == 0:
        return True
    staging = plan.staging
    if staging is None:
        staging = plan.staging = _staging(plan.device)
    ring = staging.ring
    slot = ring.acquire()
    try:
        slab, words, off = slot.buffer
        base = slab.data_ptr() + off
        # Plain host memory copies (no torch dispatch): the snapshot the kernel reads.
        if plan.nbytes_a:
            _memmove(base, plan.host_a, plan.nbytes_a)
        if plan.nbytes_b:
            _memmove(base + MAX_PAIR_BYTES, plan.host_b, plan.nbytes_b)
        src_a = words if plan.word_a else slab
        off_a = off >> 2 if plan.word_a else off
        src_b = words if plan.word_b else slab
        off_b = (off + MAX_PAIR_BYTES) >> 2 if plan.word_b else off + MAX_PAIR_BYTES
        d = plan.direct
        if d is not None and not hooks_active():
            raw = d.current_stream(plan.device)
            # The staging slab is passed as a tensor (the launcher translates a pinned host address); the
            # destinations, device memory, as their addresses.
            d.run(
                2, 1, 1, raw, d.function, d.packed_metadata, None, None, None,
                src_a, off_a, plan.dev_a, plan.n_a, src_b, off_b, plan.dev_b, plan.n_b, *d.consts,
            )  # fmt: skip
        else:
            dst_a = dev_a.reshape(-1).view(torch.uint8)
            dst_b = dev_b.reshape(-1).view(torch.uint8)
            args = (
                src_a,
                off_a,
                dst_a.view(torch.int32) if plan.word_a else dst_a,
                plan.n_a,
                src_b,
                off_b,
                dst_b.view(torch.int32) if plan.word_b else dst_b,
                plan.n_b,
            )
            _KERNEL.launch_fast(_GRID2, (), plan.spec, args)
            if plan.direct is None:
                plan.direct = _KERNEL.direct(plan.spec)
            raw = torch.cuda.current_stream(plan.device).cuda_stream
        # Recorded behind the kernel on the stream that launched it: the slot is reused only once it completed.
        slot.event.record(staging.stream(raw))
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

        return [
            timed_check(
                "copy_small_pinned_pair", device, "512 int32 + 509 bool (pinned)", run, unit="mismatched entries"
            )
        ]

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
        timed_check(
            "copy_small_pinned_pair",
            device,
            "512 int32 + 509 bool",
            fallback,
            note="no pinned memory: False",
            unit="failed comparisons",
        ),
        timed_check(
            "copy_small_pinned_pair (kernel)", device, "512 int32 + 509 bool", kernel, unit="mismatched entries"
        ),
    ]
