"""Device->host reads, host->device uploads and device allocations per ``Engine.step``, counted on the CPU.

Issue 29: a generation-only step through :class:`~kvforge.engine.graphs.DecodeGraphs` reads back only its emitted
tokens ("the one host read per step"). On a CPU model every tensor is a host tensor, so a read cannot be seen
as a copy; :class:`HostTraffic` (a ``TorchFunctionMode``) instead tracks which tensors stand for device memory:
the engine's persistent device buffers (model weights, cache pools, slot stores, page-table and state-index
device buffers, graph buffers; attributes named ``host*`` / ``_index`` are the host side), tensors made with an
explicit ``device=`` or moved by ``.to(device)``, and every op result with a device input. A *read* is a
value-reading call on such a tensor (``item``, ``tolist``, ``bool``/``int``/``float``/``index``, ``numpy``,
``cpu``, ``repr``) or an op whose result size depends on device values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``equal``, ``repeat_interleave`` without ``output_size``). An *upload* is a host
tensor or list copied into device memory; an *allocation* a device result on new storage. Work inside a Triton
interpreter launch is not counted (the interpreter's own copies stand for a kernel on the GPU). A failing count
prints where each read came from.
"""

from __future__ import annotations

import collections
import random
import traceback
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvforge.engine import Engine, EngineConfig, HybridModel
from tests.test_engine import PLANTED

VOCAB = PLANTED.vocab_size
T = torch.Tensor

_READ_METHODS = {
    T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu, T.__repr__, T.__format__,
    T.__str__,
}  # fmt: skip
_SIZE_FROM_VALUES = {
    torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select, torch.unique,
    T.unique, torch.equal, T.equal, torch.allclose, T.allclose, torch.repeat_interleave, T.repeat_interleave,
}  # fmt: skip
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.empty_like,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.randint, torch.rand, torch.randn,
}  # fmt: skip
_HOST_NAMES = ("host", "_host", "_index", "_np")


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


# Checks that run only when their tensor is in host memory (``if t.device.type == "cpu"``): on a CPU model they
# read a "device" tensor, on a GPU they never run.
_HOST_ONLY = ("_check_host_slot_values", "_check_host_rows")


def _host_only() -> bool:
    return any(f.name in _HOST_ONLY for f in traceback.extract_stack()[-8:])


def _where() -> str:
    """The innermost kvforge frames of the current stack (the call site of a counted op)."""
    frames = [f for f in traceback.extract_stack() if "/kvforge/" in f.filename and "/tests/" not in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/kvforge/', 1)[1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _number_by_tensor_index(index, value) -> bool:
    """A Python number stored through a tensor index."""
    parts = index if isinstance(index, tuple) else (index,)
    return isinstance(value, (int, float)) and any(isinstance(t, torch.Tensor) for t in parts)


class HostTraffic(TorchFunctionMode):
    """Counts reads, uploads and allocations (see the module docstring) while active."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._dev: dict[int, weakref.ref] = {}  # id -> the device tensor (tensors compare by value, not by id)
        self._host: dict[int, weakref.ref] = {}  # the engine's host buffers
        self.reads: list[str] = []
        self.uploads: list[str] = []
        self.blocking: list[str] = []  # uploads after which torch waits for the device's queue (on a GPU)
        self.allocs: list[str] = []
        self.in_graph = 0  # inside DecodeGraphs._body (what a replay runs)
        self.allocs_in_graph = 0
        self._suspended = 0
        self._seed(engine, set(), "")

    def _seed(self, obj, seen: set[int], name: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if name.startswith(_HOST_NAMES):
                self._host[id(obj)] = weakref.ref(obj)
            else:
                self._mark(obj)
        elif isinstance(obj, (list, tuple)):
            for y in obj:
                self._seed(y, seen, name)
        elif isinstance(obj, dict):
            for y in obj.values():
                self._seed(y, seen, name)
        elif type(obj).__module__.startswith("kvforge") and hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                self._seed(v, seen, k)
        elif type(obj).__module__.startswith("kvforge") and hasattr(obj, "__dataclass_fields__"):
            for k in obj.__dataclass_fields__:
                self._seed(getattr(obj, k), seen, k)

    def _mark(self, t: torch.Tensor) -> None:
        self._dev[id(t)] = weakref.ref(t)

    def is_device(self, t: torch.Tensor) -> bool:
        r = self._dev.get(id(t))
        return r is not None and r() is t

    def is_host_buffer(self, t: torch.Tensor) -> bool:
        r = self._host.get(id(t))
        return r is not None and r() is t

    def _host_value(self, v) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() > 0 and not self.is_device(v)

    def _on_device(self, x) -> bool:
        return any(self.is_device(t) for t in _tensors(x))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        src = self._on_device(args) or self._on_device(kwargs)
        out = func(*args, **kwargs)
        if src and (func in _READ_METHODS or func in _SIZE_FROM_VALUES) and _host_only():
            return out
        if func in _READ_METHODS:
            if src:
                self.reads.append(f"{func.__name__}: {_where()}")
                if func is T.cpu:  # on a CPU model .cpu() returns the tensor itself: from now on a host tensor
                    self._dev.pop(id(out), None)
            return out
        if func in _SIZE_FROM_VALUES and src:
            if func in (torch.repeat_interleave, T.repeat_interleave):
                # Only repeats held on the device make the result size wait for the device.
                reps = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
                src = isinstance(reps, torch.Tensor) and self.is_device(reps) and kwargs.get("output_size") is None
            if src:
                self.reads.append(f"{func.__name__}: {_where()}")
            src = True
        if func in (T.__getitem__, T.__setitem__) and src:
            idx = args[1] if len(args) > 1 else None
            if any(t.dtype == torch.bool for t in _tensors(idx if isinstance(idx, (tuple, list)) else [idx])):
                self.reads.append(f"boolean-mask {func.__name__}: {_where()}")
        to_device = func is T.to and any(
            isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor) and a is not args[0])
            for a in (*args[1:], kwargs.get("device"))
            if a is not None
        )
        # Only a literal "cpu" means the host: .to(model.device) is a device-to-device no-op on a GPU.
        to_host = func is T.to and any(a == "cpu" for a in (*args[1:], kwargs.get("device")) if isinstance(a, str))
        if func in _FACTORIES and kwargs.get("device") is not None:
            src = True
            if func in (torch.tensor, torch.as_tensor):
                self.uploads.append(f"{func.__name__}: {_where()}")
                self.blocking.append(f"{func.__name__}: {_where()}")  # a blocking copy inside
        elif to_host and src:
            self.reads.append(f"to(cpu): {_where()}")
            self._dev.pop(id(out), None)
            return out
        elif to_device and not src:
            src = True
            self.uploads.append(f"to(device): {_where()}")
            if not kwargs.get("non_blocking"):
                self.blocking.append(f"to(device): {_where()}")
        elif func is T.copy_ and self._on_device(args[0]) and not self._on_device(args[1]):
            self.uploads.append(f"copy_: {_where()}")
            # The engine's own host buffers are pinned on a GPU and copied non-blocking there (not on the CPU).
            pinned_there = self.is_host_buffer(args[1]) or self.is_host_buffer(args[1]._base)
            if not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]) or pinned_there):
                self.blocking.append(f"copy_: {_where()}")
        elif func is T.__setitem__ and self._on_device(args[0]) and self._host_value(args[2]):
            self.uploads.append(f"setitem: {_where()}")
            self.blocking.append(f"setitem: {_where()}")
        elif func is T.__setitem__ and self._on_device(args[0]) and _number_by_tensor_index(args[1], args[2]):
            # On the H200 (torch 2.11) ``pool[pages] = 0.0`` synced (bench_engine_speed --phases prefill_syncs);
            # a slice store is a fill kernel.
            self.blocking.append(f"setitem of a number: {_where()}")
        if src:
            ins = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.device.type != "meta"}
            for t in _tensors(out):
                self._mark(t)
                if t.untyped_storage().data_ptr() not in ins and t.numel():
                    if self.in_graph:
                        self.allocs_in_graph += 1
                    elif not _host_only():
                        self.allocs.append(f"{func.__name__ if hasattr(func, '__name__') else func}: {_where()}")
        return out


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(PLANTED)


def _steady_engine(model: HybridModel, draft_len: int, graphs: bool, n_req: int = 3) -> Engine:
    """An engine whose requests all reached generation (prompts prefilled, one step decoded)."""
    rng = random.Random(11 + draft_len)
    eng = Engine(model, EngineConfig(max_num_requests=8), draft_len=draft_len)
    if graphs:
        eng.graphs = eng.decode_graphs(capture=False)
    for i in range(n_req):
        eng.add_request(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(12, 30))], 40)
    while any(r.num_computed_tokens < len(r.tokens) for r in eng.scheduler.running) or eng.steps < 2:
        eng.step()
    eng.step()  # the first all-generation step uploads the batch's slot ids
    return eng


def _count(eng: Engine, steps: int) -> HostTraffic:
    import triton.runtime.interpreter as interp

    mode = HostTraffic(eng)
    launch = interp.GridExecutor.__call__

    def suspended(self, *a, **k):
        # A kernel handed one of the engine's (pinned) host buffers reads it over the bus (zero-copy): an upload.
        if any(mode.is_host_buffer(t) or mode.is_host_buffer(t._base) for t in _tensors((a, k))):
            mode.uploads.append(f"kernel reads host memory: {_where()}")
        mode._suspended += 1
        try:
            return launch(self, *a, **k)
        finally:
            mode._suspended -= 1

    body = eng.graphs._body if eng.graphs is not None else None

    def counted_body(b: int) -> None:
        mode.in_graph += 1
        try:
            body(b)  # type: ignore[misc]
        finally:
            mode.in_graph -= 1

    interp.GridExecutor.__call__ = suspended
    if eng.graphs is not None:
        eng.graphs._body = counted_body  # type: ignore[method-assign]
    try:
        with mode:
            for _ in range(steps):
                eng.step()
    finally:
        interp.GridExecutor.__call__ = launch
        if eng.graphs is not None:
            del eng.graphs._body
    return mode


def _summary(items: list[str]) -> str:
    return "\n".join(f"  {n} x {w}" for w, n in collections.Counter(items).most_common())


def _report(name: str, mode: HostTraffic, steps: int) -> None:
    print(f"\n{name}: per step {len(mode.reads) / steps:g} reads, {len(mode.uploads) / steps:g} uploads, "
          f"{len(mode.allocs) / steps:g} device allocations outside the graph, "
          f"{mode.allocs_in_graph / steps:g} inside")  # fmt: skip
    print("reads:\n" + _summary(mode.reads))
    print("uploads:\n" + _summary(mode.uploads))
    print("allocations outside the graph:\n" + _summary(mode.allocs))


@pytest.mark.parametrize("draft_len", [0, 1])
def test_graph_step_reads_back_only_the_emitted_tokens(model: HybridModel, draft_len: int) -> None:
    eng = _steady_engine(model, draft_len, graphs=True)
    steps = 3
    replays = eng.graphs.replays  # type: ignore[union-attr]
    mode = _count(eng, steps)
    assert eng.graphs.replays - replays == steps  # type: ignore[union-attr]  # every counted step was a graph step
    _report(f"graph step, draft_len={draft_len}", mode, steps)
    assert len(mode.reads) == steps, "reads other than the emitted tokens:\n" + _summary(mode.reads)
    assert all("graphs.py" in r and r.startswith("cpu") for r in mode.reads), _summary(mode.reads)
    # Uploads: the rows' starts, and the page-table kernel's zero-copy read of the pinned host table (the slot
    # and state-row ids did not change); no device tensor is allocated outside what a replay runs.
    assert len(mode.uploads) == 2 * steps, _summary(mode.uploads)
    assert not mode.allocs, _summary(mode.allocs)


@pytest.mark.parametrize("draft_len", [0, 1])
def test_eager_generation_step_reads(model: HybridModel, draft_len: int) -> None:
    """The eager generation step (no graphs) reads the input ids and the greedy tokens (and the drafts)."""
    eng = _steady_engine(model, draft_len, graphs=False)
    steps = 3
    mode = _count(eng, steps)
    _report(f"eager generation step, draft_len={draft_len}", mode, steps)
    assert len(mode.reads) == steps * (2 + draft_len), "unexpected reads:\n" + _summary(mode.reads)


def test_a_batch_prefilled_in_waves_shrinks_through_new_buckets(model: HybridModel) -> None:
    """Why bench_engine_speed captures every bucket before timing: requests that entered generation in prefill
    waves finish in waves, so a steady run reaches buckets it never used before (each a capture on the GPU)."""
    rng = random.Random(3)
    eng = Engine(model, EngineConfig(max_num_requests=8, max_num_tokens=48))
    g = eng.graphs = eng.decode_graphs(capture=False)
    used: list[int] = []
    run = g.run

    def spy(slots, state_rows, starts, **kw):
        used.append(g.bucket(len(slots)))  # type: ignore[arg-type]
        return run(slots, state_rows, starts, **kw)

    g.run = spy  # type: ignore[method-assign]
    for rid in range(8):
        eng.add_request(rid, [rng.randrange(VOCAB) for _ in range(20)], 9)
    # The bench's warm-up: every request generating, then three steps (the first replays capture the bucket).
    while any(r.state.value != "generation" for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    warm = len(used)
    eng.run()
    assert set(used[:warm]) == {8}, used
    assert set(used[warm:]) - set(used[:warm]) == {2, 4}, used  # new buckets inside the timed loop


def test_the_counter_sees_reads(model: HybridModel) -> None:
    """The counter itself: a read of a device buffer counts, a host tensor's does not."""
    eng = Engine(model, EngineConfig(max_num_requests=2))
    mode = HostTraffic(eng)
    host = torch.arange(3)
    with mode:
        x = eng.stores.new_tokens + 1
        int(x[0, 0])
        x.tolist()
        x[x > 0]
        host.tolist()
        int(host[1])
        torch.tensor([1, 2], device=model.device)
    assert len(mode.reads) == 3, mode.reads
    assert len(mode.uploads) == 1, mode.uploads


def test_prefill_steps_upload_without_waiting(model: HybridModel) -> None:
    """Prefill and extend steps (chunked prompts, rows split at snapshot points, beside generation rows) make no
    upload after which torch waits for the device: on the H200 each one drained the GPU's queue (111 per
    8 x 1024 prefill step before, 2 after: bench_engine_speed --phases prefill_syncs), and read back only the
    greedy tokens."""
    rng = random.Random(7)
    eng = Engine(model, EngineConfig(max_num_requests=8, max_num_tokens=40, snapshot_interval=16))
    for i in range(4):
        eng.add_request(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(40, 120))], 6)
    eng.step()  # first use: the page-table kernel's per-pool constants go up once
    steps = 5
    mode = _count(eng, steps)
    _report("prefill steps", mode, steps)
    assert any(r.num_computed_tokens < len(r.tokens) for r in eng.scheduler.running)  # still prefilling
    assert len(mode.uploads) >= steps, _summary(mode.uploads)  # the counter saw the step's uploads
    assert not mode.blocking, "blocking uploads:\n" + _summary(mode.blocking)
    # Reads: the greedy tokens, and the generation rows' input ids on this eager path.
    assert all(r.startswith("tolist") and ("runner.py" in r or "_eager_rows" in r) for r in mode.reads), _summary(
        mode.reads
    )


def test_the_counter_sees_blocking_uploads(model: HybridModel) -> None:
    eng = Engine(model, EngineConfig(max_num_requests=2))
    mode = HostTraffic(eng)
    pool = next(iter(eng.cache.state.values()))
    with mode:
        idx = torch.arange(2).to(model.device, non_blocking=True)
        torch.tensor([1, 2], device=model.device)
        torch.arange(2).to(model.device)
        pool[idx] = 0.0
        pool[:1] = 0.0
        pool.index_fill_(0, idx, 0.0)
    assert len(mode.uploads) == 3, mode.uploads
    assert len(mode.blocking) == 3, mode.blocking
