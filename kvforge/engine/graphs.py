"""CUDA-graph decode: the generation-only step captured once per batch bucket and replayed.

A step whose rows are all generation rows (the usual decode step, draft verification included) runs
:meth:`Runner.decode_static <kvforge.engine.runner.Runner.decode_static>` padded to the next bucket of
:data:`BUCKETS` (capped at ``max_num_requests``, itself a bucket) at the verify width ``1 + draft_len``; a row
with fewer tokens left (its last step) computes the full width in room the scheduler reserved
(``reserve_verify_width``), and its accepted count is capped on the device at what it has left. What changes
between steps lives in persistent device buffers filled before replay: the rows' slots, live state rows and
token limits (uploaded only when they changed), their start positions, and the page table rows the engine's
``DevicePageTable`` already writes in place; padding rows point at the cache's trash page, trash state row and
trash slot. The one host read of a step is its ``[rows, t + 2]`` int32 result (greedy tokens, accepted count,
draft token). Mixed steps (any context row), ``record_logits`` and a ``draft_fn`` run eagerly. A bucket's graph
is captured on its first use (or all at once by :meth:`DecodeGraphs.capture_all`), after one eager warm-up run
that compiles the kernels; capture and warm-up run on trash inputs only.

With ``capture=False`` (the CPU: no CUDA graphs there) the same padded static step runs eagerly, so the CPU
tests exercise the path a graph replays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.engine.cache import EngineCache
from kvforge.engine.phases import PhaseTimer
from kvforge.engine.runner import Runner
from kvforge.kernels.slot_ops import SlotStores

__all__ = ["BUCKETS", "DecodeGraphs"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """The captured decode steps of one engine (see the module docstring). ``offsets`` is the engine's device
    page-table buffer ``[pools, max_rows, 2, max_blocks]`` (plane 0: page ids); ``trash_slot`` a slot of
    ``stores`` that no request holds."""

    def __init__(
        self,
        runner: Runner,
        cache: EngineCache,
        stores: SlotStores,
        offsets: torch.Tensor,
        *,
        max_rows: int,
        trash_slot: int,
        draft: bool,
        capture: bool,
    ) -> None:
        if capture and runner.model.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, the model is on {runner.model.device}")
        self.runner, self.cache, self.stores, self.offsets = runner, cache, stores, offsets
        self.draft, self.capture = draft, capture
        self.buckets = tuple(sorted({b for b in BUCKETS if b < max_rows} | {max_rows}))
        m = self.buckets[-1]
        dev = runner.model.device
        pin = dev.type == "cuda"
        self.trash_slot = trash_slot
        t = runner.verify_width
        self.width = t
        # [slots; live state rows; token limits] change only when the batch does (or a row reaches its last
        # step); starts change every step.
        self._host_ids = torch.zeros(3, m, dtype=torch.int32, pin_memory=pin)
        self._host_starts = torch.zeros(m, dtype=torch.int64, pin_memory=pin)
        self._ids_np, self._starts_np = self._host_ids.numpy(), self._host_starts.numpy()
        self.ids = torch.zeros(3, m, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(m, dtype=torch.int64, device=dev)
        self.out = torch.zeros(m, t + 2, dtype=torch.int32, device=dev)
        self._last_ids: tuple[int, ...] | None = None  # (bucket, *slots, *state rows, *limits) last uploaded
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.replays = 0
        self.uploads_skipped = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows (None: more rows than the largest bucket)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _body(self, b: int) -> None:
        self.runner.decode_static(
            self.ids[0, :b], self.ids[1, :b], self.starts[:b], self.offsets[:, :b, 0], self.stores, self.out[:b],
            draft=self.draft, limits=self.ids[2, :b],
        )  # fmt: skip

    def _pad_tables(self, lo: int, hi: int) -> None:
        if hi > lo:
            self.offsets[0, lo:hi, 0].fill_(self.cache.latent_trash)
            if self.offsets.shape[0] > 1:
                self.offsets[1, lo:hi, 0].fill_(self.cache.draft_trash)

    def _trash_inputs(self, b: int) -> None:
        self.ids[0, :b].fill_(self.trash_slot)
        self.ids[1, :b].fill_(self.cache.state_trash)
        self.ids[2, :b].fill_(self.width)
        self.starts[:b].zero_()
        self._last_ids = None

    def _capture(self, b: int) -> None:
        """Warm up and capture bucket ``b`` on trash inputs (the caller's page-table rows are kept)."""
        saved = self.offsets[:, :b].clone()
        self._trash_inputs(b)
        self._pad_tables(0, b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(b)  # compiles / tunes every kernel outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._body(b)
        self._pool = graph.pool()
        self._graphs[b] = graph
        self.offsets[:, :b].copy_(saved)

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (they share one memory pool)."""
        if self.capture:
            for b in reversed(self.buckets):
                if b not in self._graphs:
                    self._capture(b)

    def run(
        self,
        slots: Sequence[int],
        state_rows: Sequence[int],
        starts: Sequence[int],
        *,
        limits: Sequence[int] | None = None,
        phases: PhaseTimer | None = None,
    ) -> torch.Tensor:
        """One generation-only step of ``len(slots)`` rows; returns the host ``[rows, t + 2]`` int32 result.
        ``limits``: per row, the most tokens it may accept (1 .. t: its tokens left; default t). ``phases``: the
        engine's phase timer (inputs, capture, replay, read are marked)."""
        n = len(slots)
        b = self.bucket(n)
        if b is None or n == 0:
            raise ValueError(f"slots: expected 1 .. {self.buckets[-1]} rows, got {n}")
        t = self.width
        if limits is None:
            limits = (t,) * n
        key = (b, *slots, *state_rows, *limits)
        # Checked when they change, before anything runs: a step with the last one's batch skips the check.
        if key != self._last_ids and (len(limits) != n or not all(type(x) is int and 1 <= x <= t for x in limits)):
            raise ValueError(f"limits: expected {n} ints in 1 .. {t}, got {limits!r}")
        if self.capture and b not in self._graphs:
            if phases is not None:
                phases.mark("inputs")
            self._capture(b)
            if phases is not None:
                phases.mark("capture")
        if key != self._last_ids:
            # numpy views of the pinned buffers: a list goes in without a temporary tensor.
            ids = self._ids_np
            ids[0, :n] = slots
            ids[1, :n] = state_rows
            ids[2, :n] = limits
            ids[0, n:b] = self.trash_slot
            ids[1, n:b] = self.cache.state_trash
            ids[2, n:b] = t
            self.ids[:, :b].copy_(self._host_ids[:, :b], non_blocking=True)
            self._last_ids = key
        else:
            self.uploads_skipped += 1
        st = self._starts_np
        st[:n] = starts
        st[n:b] = 0
        self.starts[:b].copy_(self._host_starts[:b], non_blocking=True)
        self._pad_tables(n, b)
        if phases is not None:
            phases.mark("inputs")
        if self.capture:
            self._graphs[b].replay()
        else:
            self._body(b)
        self.replays += 1
        if phases is not None:
            phases.mark("replay")
        # The one host read of the step (it also orders the pinned buffers' reuse after this step's copies).
        out = self.out[:n].cpu()
        if phases is not None:
            phases.mark("read")
        return out
