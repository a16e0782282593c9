"""The transport a transceiver moves bytes with: a small interface and its torch.distributed implementation.

A transport sends and receives uint8 tensors point to point, asynchronously, and all-gathers small int64
vectors inside a group. Completion is polled (``Handle.done()``), never waited on without a bound: the
transceiver owns the deadlines, so a dead or silent peer costs a timeout, not a hang. Another engine (NIXL, UCX)
fits behind the same interface.

``TorchDistTransport`` wraps the default torch.distributed process group (gloo on CPU, NCCL on GPU; building it
is collective over the world). A peer found dead, or a pair left with a timed-out NCCL receive posted
(``mark_broken``), is marked broken: later operations with it raise ``TransferError`` at once. Over NCCL, sends
and receives of a pair are matched in posting order, so both sides must start transfers in the same order;
initialise the default group with ``device_id``, choose the process group's timeout longer than any transfer
timeout, and never synchronise the whole device while a receive is posted.

Backend details (gloo's waiting threads and dead-peer probe, NCCL streams and the gloo control group):
``docs/disagg.md``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from kvforge.errors import TransferError

PROBE_TAG = 2**31 - 2  # above every transfer id and registration tag of the transceiver; never sent
PROBE_AFTER_S = 0.5
PROBE_EVERY_S = 0.5


class Handle(ABC):
    """An asynchronous operation in flight."""

    @abstractmethod
    def done(self) -> bool:
        """True once finished; raises ``TransferError`` if it failed."""


class Group:
    """A set of transport ranks that run collectives together (created on every rank, in the same order)."""

    def __init__(self, ranks: Sequence[int], handle: Any = None) -> None:
        self.ranks = tuple(ranks)
        self.handle = handle

    @property
    def size(self) -> int:
        return len(self.ranks)


class Transport(ABC):
    rank: int
    world_size: int
    device: torch.device
    supports_tags: bool

    @abstractmethod
    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle: ...

    @abstractmethod
    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Handle: ...

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group:
        """Collective over the whole world: every rank calls it with the same ranks, in the same order."""

    @abstractmethod
    def all_gather_int64(self, values: torch.Tensor, group: Group) -> torch.Tensor:
        """``values`` (1-D int64, the same length on every member) -> ``[group.size, len]`` int64 on the CPU."""

    def mark_broken(self, peer: int, reason: str) -> None:  # noqa: B027 (optional hook)
        """Record that a peer can no longer be used (optional)."""

    def check_peer(self, peer: int) -> None:  # noqa: B027 (optional hook)
        """Raise ``TransferError`` if the peer was marked broken (optional)."""


class _WorkHandle(Handle):
    """NCCL: ``is_completed()`` queries the op's CUDA event without blocking."""

    def __init__(self, work: Any, what: str) -> None:
        self.work = work
        self.what = what
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        try:
            if not self.work.is_completed():
                return False
            # On a finished op wait() returns at once (gloo) or only orders the current CUDA stream after it
            # (NCCL); it raises the op's error if there was one.
            self.work.wait()
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"{self.what} failed: {type(exc).__name__}: {exc}") from exc
        self._done = True
        return True


class _WaitThreadHandle(Handle):
    """gloo: a daemon thread runs the blocking ``wait()``; ``done()`` reads its outcome without blocking and,
    while it is pending, probes the peer now and then (``probe`` raises when the peer's connection is closed)."""

    def __init__(self, work: Any, what: str, probe: Any = None) -> None:
        self.work = work
        self.what = what
        self._probe = probe
        self._next_probe = time.monotonic() + PROBE_AFTER_S
        self._finished = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name=f"kvforge-wait {what}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # reported through done(), never raised in this thread
            self._error = exc
        finally:
            self._finished.set()

    def done(self) -> bool:
        if not self._finished.is_set():
            if self._probe is not None and time.monotonic() >= self._next_probe:
                self._next_probe = time.monotonic() + PROBE_EVERY_S
                try:
                    self._probe()
                except TransferError as exc:
                    raise TransferError(f"{self.what} failed: the peer is gone ({exc})") from exc
            return False
        if self._error is not None:
            raise TransferError(f"{self.what} failed: {type(self._error).__name__}: {self._error}")
        return True


class _HostGroup:
    """A transport subgroup under NCCL: no torch.distributed group, only an id and a call counter for tags."""

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.calls = 0


class TorchDistTransport(Transport):
    """torch.distributed point-to-point and all-gather over the default process group (initialised by the caller).

    ``control_group``: NCCL only, a gloo group over the whole world for host-side control (created here, a
    collective over the world, when not given).
    """

    def __init__(self, control_group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed: initialise the default process group before building the transport")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend()).lower()
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.supports_tags = False
            # Every rank builds its transport at the same point, so the group is created in the same order.
            self.control = control_group if control_group is not None else dist.new_group(backend="gloo")
        else:
            self.device = torch.device("cpu")
            self.supports_tags = True
            self.control = None  # the default (gloo) group
        self._broken: dict[int, str] = {}
        self._lock = threading.Lock()
        self._groups = 0

    def _check_buf(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"buf: expected a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if buf.device != self.device:
            raise ValueError(f"buf: the {self.backend} transport sends tensors on {self.device}, got {buf.device}")

    def _check_rank(self, name: str, peer: object) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"{name}: expected another rank in [0, {self.world_size}), got {peer!r}")
        return peer

    def _check_tag(self, tag: object) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < PROBE_TAG:
            raise ValueError(f"tag: expected an int in [0, {PROBE_TAG}), got {tag!r}")
        return tag

    def _post(self, op: Any, buf: torch.Tensor, peer: int, tag: int, what: str) -> Handle:
        kw = {"tag": tag} if self.supports_tags else {}
        try:
            work = op(buf, peer, **kw)
        except Exception as exc:  # gloo raises at once on a closed connection: the peer is gone
            reason = f"{what} failed: {type(exc).__name__}: {exc}"
            self._mark_dead(peer, reason)
            raise TransferError(reason) from exc
        if self.backend == "nccl":
            return _WorkHandle(work, what)
        return _WaitThreadHandle(work, what, lambda: self._probe(peer))

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:
        self._check_buf(buf)
        dst, tag = self._check_rank("dst", dst), self._check_tag(tag)
        self.check_peer(dst)
        return self._post(self._dist.isend, buf, dst, tag, f"send of {buf.numel()} bytes to rank {dst}")

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Handle:
        self._check_buf(buf)
        src, tag = self._check_rank("src", src), self._check_tag(tag)
        self.check_peer(src)
        return self._post(self._dist.irecv, buf, src, tag, f"receive of {buf.numel()} bytes from rank {src}")

    def _probe(self, peer: int) -> None:
        """gloo: raise ``TransferError`` if the connection to ``peer`` is closed (module docstring)."""
        self.check_peer(peer)
        try:
            self._dist.irecv(torch.empty(1, dtype=torch.uint8), src=peer, tag=PROBE_TAG)
        except Exception as exc:
            reason = f"connection to rank {peer} closed: {type(exc).__name__}: {str(exc)[:200]}"
            self._mark_dead(peer, reason)
            raise TransferError(reason) from exc

    def _mark_dead(self, peer: int, reason: str) -> None:
        with self._lock:
            self._broken.setdefault(peer, reason)

    def new_group(self, ranks: Sequence[int]) -> Group:
        ranks = sorted(int(r) for r in ranks)
        if self.backend == "nccl":
            # No torch.distributed group: a gloo subgroup with non-members would make those non-members call
            # ncclCommSplit on an eagerly initialised default group that the members never match.
            self._groups += 1
            return Group(ranks, _HostGroup(self._groups))
        handle = self._dist.new_group(ranks=ranks) if len(ranks) < self.world_size else None
        return Group(ranks, handle)

    def all_gather_int64(self, values: torch.Tensor, group: Group) -> torch.Tensor:
        if values.dtype != torch.int64 or values.dim() != 1:
            raise ValueError(f"values: expected a 1-D int64 tensor, got {values.dtype} {tuple(values.shape)}")
        if self.rank not in group.ranks:
            raise ValueError(f"group: rank {self.rank} is not a member of {group.ranks}")
        if self.backend == "nccl":
            return self._host_all_gather(values.cpu().contiguous(), group)
        x = values.to(self.device)
        out = torch.empty((group.size, x.numel()), dtype=torch.int64, device=self.device)
        self._dist.all_gather(list(out.unbind(0)), x, group=group.handle)
        return out.cpu()

    def _host_all_gather(self, x: torch.Tensor, group: Group) -> torch.Tensor:
        """NCCL transport: the all-gather over gloo, on the host (never queued behind a posted NCCL receive)."""
        out = torch.empty((group.size, x.numel()), dtype=torch.int64)
        if group.size == self.world_size:
            self._dist.all_gather(list(out.unbind(0)), x, group=self.control)
            return out
        hg = group.handle
        if not isinstance(hg, _HostGroup):
            raise ValueError("group: expected a group from this transport's new_group")
        hg.calls += 1
        # Unique per (group, call) on the control group; gloo's own collective tags are small counters.
        tag = (1 << 30) | ((hg.gid % 1024) << 20) | (hg.calls % (1 << 20))
        works = []
        for i, r in enumerate(group.ranks):
            if r == self.rank:
                out[i].copy_(x)
                continue
            works.append(self._dist.isend(x, r, group=self.control, tag=tag))
            works.append(self._dist.irecv(out[i], r, group=self.control, tag=tag))
        for w in works:
            w.wait()
        return out

    def mark_broken(self, peer: int, reason: str) -> None:
        # gloo matches by tag, so a receive left posted cannot swallow a later message: only NCCL needs this.
        if not self.supports_tags:
            self._broken.setdefault(peer, reason)

    def check_peer(self, peer: int) -> None:
        if peer in self._broken:
            raise TransferError(f"rank {peer} is unusable after an earlier failure ({self._broken[peer]})")
