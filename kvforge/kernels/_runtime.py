"""Where kernels run and with which launch configuration.

* ``interpreting()``: True under ``TRITON_INTERPRET=1`` (set by ``kvforge.kernels`` when torch sees no CUDA
  device). ``device_capability()`` / ``num_sms()``: queried lazily and cached, never at import.
* ``TunedKernel``: per-SM launch configuration, from the committed ``tuned/sm<XY>.json`` when present, else
  measured once on a GPU; the interpreter uses the table's interpreter config. ``launch_fast`` and
  ``direct(spec)`` / ``DirectLaunch`` skip the per-call binder work after the first call per ``spec``;
  ``launch_jit`` does the same for a kernel launched as ``fn[grid]``, keyed on what Triton specialises on;
  ``RecordedLaunch`` replays one such launch on other tensors laid out alike (on Triton 3.6, with tensor
  descriptors, past the launcher object: ``raw_launcher``, descriptors encoded once per base address).
* ``tensor_key`` / ``PlanCache``: a cache of per-call launch plans keyed by each tensor's address, shape,
  strides, dtype and device, so a changed buffer takes the fully checked path again.

How tuning and the fast launch paths work: ``docs/kernels.md``.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton

_TUNED_DIR = Path(__file__).with_name("tuned")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        try:
            return bool(knobs.runtime.interpret)
        except AttributeError:
            pass
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints on the host: ``triton.cdiv`` is a ConstexprFunction whose wrapper costs about 6 us a
    call on the host (this CPU, Triton 3.6 and 3.9), paid on every launch path that sizes a grid with it."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``), ``triton.next_power_of_2`` without its wrapper cost."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kernel_device() -> torch.device:
    """The device kernels take their tensors on: CUDA when present, else the CPU (interpreter)."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None in the interpreter / on CPU."""
    if interpreting() or not torch.cuda.is_available():
        return None
    if device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    return _capability(index)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of the device; a small stand-in in the interpreter."""
    if device_capability(device) is None:
        return 4
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _sm_count(index)


def arch_name(cap: tuple[int, int] | None) -> str:
    return "interpreter" if cap is None else f"sm{cap[0]}{cap[1]}"


ConfigKey = tuple[Any, ...]


@dataclass(frozen=True)
class ConfigTable:
    """Launch-config candidates per architecture.

    ``by_arch`` maps ``(major, minor)`` or ``major`` to a candidate list; the most specific match wins, then
    ``fallback``. ``interpreter`` is the single config used under TRITON_INTERPRET (small tiles keep it fast).
    ``keep`` filters candidates for a given key (e.g. tiles too large for a head dim), like tutorial 06's keep();
    ``keep_arch`` does the same with the architecture too (``None`` in the interpreter), e.g. for shared memory.
    """

    fallback: Sequence[triton.Config]
    interpreter: triton.Config
    by_arch: Mapping[Any, Sequence[triton.Config]] = field(default_factory=dict)
    keep: Callable[[triton.Config, ConfigKey], bool] | None = None
    keep_arch: Callable[[triton.Config, ConfigKey, tuple[int, int] | None], bool] | None = None

    def candidates(self, cap: tuple[int, int] | None, key: ConfigKey) -> list[triton.Config]:
        if cap is None:
            return [self.interpreter]
        configs = self.by_arch.get(cap) or self.by_arch.get(cap[0]) or self.fallback
        kept = [
            c
            for c in configs
            if (self.keep is None or self.keep(c, key)) and (self.keep_arch is None or self.keep_arch(c, key, cap))
        ]
        return kept or list(self.fallback[:1])


def config_to_json(cfg: triton.Config) -> dict[str, Any]:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def config_from_json(d: Mapping[str, Any]) -> triton.Config:
    return triton.Config(dict(d["kwargs"]), num_warps=int(d["num_warps"]), num_stages=int(d["num_stages"]))


def _key_str(key: ConfigKey) -> str:
    return ",".join(str(k) for k in key)


@cache
def _committed(arch: str) -> dict[str, dict[str, Any]]:
    path = _TUNED_DIR / f"{arch}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


_REGISTRY: dict[str, TunedKernel] = {}

# Escape hatch: KVFORGE_FAST_LAUNCH=0 sends every launch through Triton's own path (e.g. to rule the direct
# launcher out when debugging, or on a Triton whose CompiledKernel.run signature differs).
_FAST_LAUNCH = os.environ.get("KVFORGE_FAST_LAUNCH", "1") != "0"


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a cached launch plan depends on for one tensor: address, shape, strides, dtype, device."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class PlanCache:
    """A bounded map from argument keys (built from ``tensor_key``) to launch plans; oldest entry evicted first.

    A plan must hold no caller tensor (only addresses and sizes), so the cache keeps no caller buffer alive. Lookups
    take no lock (a dict read is atomic); inserts do.
    """

    def __init__(self, maxsize: int = 32) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize: expected >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._plans: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.get = self._plans.get

    def put(self, key: Any, plan: Any) -> Any:
        with self._lock:
            if key not in self._plans and len(self._plans) >= self.maxsize:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class DirectLaunch(NamedTuple):
    """A compiled kernel's launcher as ``launch_fast`` calls it; see ``TunedKernel.direct``.

    Launch with ``run(gx, gy, gz, current_stream(device), function, packed_metadata, None, None, None, *args,
    *consts)`` when ``current_device() == device`` and ``hooks_active()`` is False.
    """

    run: Callable[..., Any]
    function: Any
    packed_metadata: Any
    consts: tuple[Any, ...]
    device: int
    current_device: Callable[[], int]
    current_stream: Callable[[int], int]
    meta: Mapping[str, Any]  # the chosen config's kwargs and the constexpr kwargs (what ``grid`` is given)


def hooks_active() -> bool:
    """True when a launch enter/exit hook (e.g. a profiler) is set: launches must then take Triton's full path."""
    return _hooks_active()


def _hooks_active() -> bool:
    """True when a launch enter/exit hook (e.g. a profiler) is set: such launches take Triton's full path."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TunedKernel:
    """A Triton kernel launched with a per-SM, per-key configuration.

    ``launch(grid, key, *args, **kwargs)``: ``grid`` is a callable of the chosen config's kwargs (``META``).
    Tuning runs only on a GPU, only for keys without a committed config, and only when the kernel's
    launches are idempotent (every kernel here writes outputs it does not read).
    """

    def __init__(self, name: str, fn: Any, table: ConfigTable, tune_first: int | None = None) -> None:
        self.name = name
        self.fn = fn
        self.table = table
        self.tune_first = tune_first  # tune over at most this many candidates (each one compiles)
        self._chosen: dict[tuple[str, ConfigKey], triton.Config] = {}
        self._fast: dict[Any, tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        _REGISTRY[name] = self

    def config_for(self, key: ConfigKey, run: Callable[[triton.Config], None] | None = None) -> triton.Config:
        cap = device_capability()
        arch = arch_name(cap)
        memo = (arch, key)
        cfg = self._chosen.get(memo)
        if cfg is not None:
            return cfg
        committed = _committed(arch).get(self.name, {}).get(_key_str(key))
        if committed is not None and os.environ.get("KVFORGE_RETUNE", "0") != "1":
            cfg = config_from_json(committed)
        else:
            candidates = self.table.candidates(cap, key)[: self.tune_first]
            if len(candidates) == 1 or run is None:
                cfg = candidates[0]
            elif _stream_capturing():  # timing synchronises, which breaks a CUDA graph capture: not remembered
                return candidates[0]
            else:
                cfg = self._tune(candidates, run)
        with self._lock:
            self._chosen[memo] = cfg
        return cfg

    @staticmethod
    def _tune(candidates: Sequence[triton.Config], run: Callable[[triton.Config], None]) -> triton.Config:
        from triton.testing import do_bench

        best, best_ms = candidates[0], float("inf")
        for cfg in candidates:
            try:
                ms = do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20)
            except Exception:  # a config that does not compile or fit (shared memory) is skipped
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        return best

    def launch(self, grid: Callable[[Mapping[str, Any]], tuple[int, ...]], key: ConfigKey, *args: Any, **kwargs: Any):
        def run(cfg: triton.Config) -> Any:
            meta = {**kwargs, **cfg.kwargs}
            return self.fn[grid(meta)](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        cfg = self.config_for(key, run)
        return run(cfg)

    def launch_fast(
        self,
        grid: Callable[[Mapping[str, Any]], tuple[int, ...]],
        key: ConfigKey,
        spec: Any,
        args: Sequence[Any],
        **kwargs: Any,
    ) -> None:
        """``launch(grid, key, *args, **kwargs)`` with a cached compiled kernel per ``spec``.

        ``spec`` must be hashable and must determine everything Triton specialises the compiled kernel on:
        the tensor dtypes and devices, each pointer's 16-byte alignment, the values of integer arguments not
        marked ``do_not_specialize`` (1, multiples of 16, int32 vs int64) and the constexpr kwargs. Arguments
        that change per call without being in ``spec`` must be ``do_not_specialize`` ints or tensors (pointers).
        ``args`` are the kernel's runtime arguments in signature order, followed in the signature by the
        constexpr ``kwargs`` only. The direct path runs on a GPU only, when no launch hook (profiler) is set and
        the current device is the one the kernel was loaded on; otherwise the full path runs.
        """
        fast = self._fast.get(spec) if _FAST_LAUNCH else None
        if fast is not None and not _hooks_active():
            kernel, meta, device, current_device, current_stream, consts = fast
            if current_device() == device:
                g = grid(meta)
                kernel.run(
                    g[0],
                    g[1] if len(g) > 1 else 1,
                    g[2] if len(g) > 2 else 1,
                    current_stream(device),
                    kernel.function,
                    kernel.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                    *consts,
                )
                return
        cfg_box: list[triton.Config] = []

        def run(cfg: triton.Config) -> Any:
            meta = {**kwargs, **cfg.kwargs}
            cfg_box.append(cfg)
            return self.fn[grid(meta)](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        cfg = self.config_for(key, run)
        kernel = run(cfg)
        if interpreting() or not hasattr(kernel, "packed_metadata"):
            return
        if self._chosen.get((arch_name(device_capability()), key)) is not cfg:  # a capture's untimed stand-in
            return
        from triton.runtime import driver

        meta = {**kwargs, **cfg.kwargs}
        # The constexprs in signature order; a parameter neither the call nor the config names takes its default
        # (a config committed before the parameter existed does not name it).
        values = [meta.get(p.name, getattr(p, "default", inspect.Parameter.empty)) for p in self.fn.params[len(args) :]]
        if any(v is inspect.Parameter.empty for v in values):
            return
        consts = tuple(values)
        active = driver.active
        device = active.get_current_device()
        with self._lock:
            self._fast[spec] = (kernel, meta, device, active.get_current_device, active.get_current_stream, consts)

    def direct(self, spec: Any) -> DirectLaunch | None:
        """The launcher ``launch_fast`` uses for ``spec`` once a call has compiled it, else None (also when fast
        launch is off). Pointer arguments may then be given as raw device addresses (ints) instead of tensors;
        a host (pinned) tensor must still be passed as the tensor, whose address the launcher translates."""
        fast = self._fast.get(spec) if _FAST_LAUNCH else None
        if fast is None:
            return None
        kernel, meta, device, current_device, current_stream, consts = fast
        return DirectLaunch(
            kernel.run, kernel.function, kernel.packed_metadata, consts, device, current_device, current_stream, meta
        )

    def chosen(self) -> dict[str, dict[str, Any]]:
        return {f"{arch}|{_key_str(key)}": config_to_json(cfg) for (arch, key), cfg in self._chosen.items()}


def _arg_spec(a: Any) -> Any:
    """What Triton may specialise a kernel on for one argument (a superset: a finer key only compiles more)."""
    t = type(a)
    if t is int:
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if t is float or t is bool or a is None:
        return t
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, int):  # an int subclass (numpy ints are not: they raise below)
        return (t, a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # a host tensor descriptor
        return (t, base.dtype, tuple(a.block_shape), getattr(a, "layout", None), getattr(a, "padding", None),
                getattr(a, "round_f32_to_tf32", None), len(a.shape))  # fmt: skip
    raise TypeError(t.__name__)


_JIT_FAST: dict[Any, tuple[Any, ...]] = {}


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (Triton's driver query: no torch Stream object); 0 for
    a non-CUDA device."""
    if device.type != "cuda":
        return 0
    from triton.runtime import driver

    active = driver.active
    return active.get_current_stream(device.index if device.index is not None else active.get_current_device())


def launch_jit(fn: Any, grid: tuple[int, ...], args: Sequence[Any], consts: Mapping[str, Any], **options: Any) -> Any:
    """``fn[grid](*args, **consts, **options)``; once that has compiled, later calls whose arguments Triton would
    specialise alike (tensor dtypes and 16-byte alignment, ints equal to 1 / multiples of 16 / 32 or 64 bits,
    descriptor types and blocks; the same constexprs, options and device) hand them to the compiled kernel's
    launcher directly, skipping Triton's per-call launch path. ``args`` are the kernel's runtime arguments in
    signature order; every later parameter must be in ``consts``. Falls back to ``fn[grid]`` for arguments it
    cannot key (its spec raises TypeError), with a launch hook set, or under KVFORGE_FAST_LAUNCH=0."""
    spec = None
    if _FAST_LAUNCH:
        try:
            spec = (id(fn), tuple(map(_arg_spec, args)), tuple(consts.items()), tuple(options.items()))
        except TypeError:
            spec = None
    if spec is not None:
        try:
            fast = _JIT_FAST.get(spec)
        except TypeError:  # an unhashable constexpr or layout: Triton's own path every time
            fast, spec = None, None
        if fast is not None and not _hooks_active():
            kernel, cvals, device, current_device, current_stream = fast
            if current_device() == device:
                g = grid
                kernel.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, current_stream(device),
                           kernel.function, kernel.packed_metadata, None, None, None, *args, *cvals)  # fmt: skip
                return kernel
    kernel = fn[grid](*args, **consts, **options)
    if spec is not None and not interpreting() and hasattr(kernel, "packed_metadata"):
        from triton.runtime import driver

        cvals = []
        for p in fn.params[len(args) :]:  # the constexprs in signature order, defaults for those not given
            value = consts.get(p.name, getattr(p, "default", inspect.Parameter.empty))
            if value is inspect.Parameter.empty:
                return kernel
            cvals.append(value)
        active = driver.active
        _JIT_FAST[spec] = (kernel, tuple(cvals), active.get_current_device(), active.get_current_device,
                           active.get_current_stream)  # fmt: skip
    return kernel


def jit_direct(fn: Any, args: Sequence[Any], consts: Mapping[str, Any], **options: Any) -> tuple[Any, ...] | None:
    """The compiled kernel's launcher entry ``launch_jit`` registered for these arguments (after a call with
    them has compiled), else None (interpreter, fast launch off, arguments it cannot key)."""
    if not _FAST_LAUNCH:
        return None
    try:
        return _JIT_FAST.get((id(fn), tuple(map(_arg_spec, args)), tuple(consts.items()), tuple(options.items())))
    except TypeError:
        return None


# Triton 3.6's launcher, called past its Python layers: the compiled kernel's launcher object wraps a C function in
# a closure that turns each tensor-descriptor argument into a CUtensorMap plus its shape and strides, at every
# launch (about 5 us of host time each on the H200's host; docs/kernels.md, session 20). A replay that keeps the
# encoded descriptors per base address calls the C function with the arguments the closure would pass. Only on the
# Triton this was checked on (3.6, the H200's), with no scratch buffers and no launch hooks; KVFORGE_RAW_LAUNCH=0
# turns it off. Anything else takes the launcher object.
RAW_LAUNCH = os.environ.get("KVFORGE_RAW_LAUNCH", "1") != "0"
RAW_VERSIONS = ("3.6.",)
RAW_EXPANDED_MAX = 64  # base-address tuples a replay keeps encoded (an engine step's layers each have their own)


def raw_launcher(kernel: object, n_desc: int) -> tuple | None:
    """(the C launch function, cooperative flag, PDL flag, the descriptors' metadata, Triton's encoder) for a
    compiled kernel with ``n_desc`` tensor-descriptor arguments whose launcher has the checked shape, else None."""
    if not RAW_LAUNCH or not triton.__version__.startswith(RAW_VERSIONS):
        return None
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:
        return None
    launcher = getattr(kernel, "run", None)
    wrapper = getattr(launcher, "launch", None)
    metas = getattr(getattr(kernel, "metadata", None), "tensordesc_meta", None)
    if launcher is None or wrapper is None or not metas or len(metas) != n_desc or any(m is None for m in metas):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    cells = [c.cell_contents for c in (getattr(wrapper, "__closure__", None) or ())]
    fns = [c for c in cells if callable(c) and getattr(c, "__name__", "") == "launch"]
    if len(fns) != 1:
        return None
    coop, pdl = getattr(launcher, "launch_cooperative_grid", None), getattr(launcher, "launch_pdl", None)
    if coop is None or pdl is None:
        return None
    return fns[0], coop, pdl, tuple(metas), make_tensordesc_arg


def clone_descriptor(kind: type, fields: Mapping[str, Any], base: torch.Tensor) -> Any:
    """A host tensor descriptor of class ``kind`` with ``fields`` (another one's, without ``base``) over ``base``,
    laid out as that one's base was: the fields were checked when it was built, and the check costs ~10 us of host
    time a call."""
    d = kind.__new__(kind)
    d.__dict__.update(fields)
    d.base = base
    return d


class RecordedLaunch:
    """A ``launch_jit(fn, grid, args, consts, **options)`` replayed on other tensors laid out alike.

    ``record`` takes a checked call's launch and the tuple of its per-call tensors (``tensors``); each tensor
    argument, and each host tensor descriptor over one, becomes a slot of that tuple, so the recording holds no
    caller tensor (a descriptor keeps its fields and gets the new base). It returns None when an argument is a
    tensor outside ``tensors``. ``launch(tensors)`` hands the arguments to the compiled kernel's launcher when
    ``launch_jit`` registered one, else calls ``launch_jit``. The caller keys recordings on everything Triton
    specialises on (``tensor_key`` of each tensor, the scalar arguments), so a replay compiles nothing new.
    """

    __slots__ = ("base", "consts", "descs", "expanded", "fast", "fn", "grid", "options", "raw", "slots")

    def __init__(self, fn: Any, grid: tuple[int, ...], base: list, slots: tuple, descs: tuple,
                 consts: Mapping[str, Any], options: Mapping[str, Any], fast: tuple | None) -> None:  # fmt: skip
        self.fn, self.grid, self.base, self.slots, self.descs = fn, (*grid, 1, 1)[:3], base, slots, descs
        self.consts, self.options, self.fast = consts, options, fast
        # With descriptors, the C launch past Triton's launcher object (raw_launcher), and per tuple of the
        # descriptors' base addresses their encoded arguments, spliced in from the last position back.
        self.raw = raw_launcher(fast[0], len(descs)) if fast is not None and descs else None
        self.expanded: dict[tuple[int, ...], tuple] = {}

    @classmethod
    def record(cls, fn: Any, grid: tuple[int, ...], args: Sequence[Any], consts: Mapping[str, Any],
               options: Mapping[str, Any], tensors: Sequence[Any]) -> RecordedLaunch | None:  # fmt: skip
        where = {id(t): i for i, t in enumerate(tensors) if t is not None}
        base, slots, descs = list(args), [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                j = where.get(id(a))
                if j is None:
                    return None
                slots.append((i, j))
                base[i] = None
            elif isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):
                j, fields = where.get(id(a.base)), getattr(a, "__dict__", None)
                if j is None or fields is None:
                    return None
                descs.append((i, type(a), {n: x for n, x in fields.items() if n != "base"}, j))
                base[i] = None
        fast = jit_direct(fn, args, consts, **options)
        return cls(fn, grid, base, tuple(slots), tuple(descs), dict(consts), dict(options), fast)

    def launch(self, tensors: Sequence[Any]) -> None:
        args = self.base.copy()
        for i, j in self.slots:
            args[i] = tensors[j]
        fast, raw = self.fast, self.raw
        if raw is not None and not _hooks_active():
            kernel, cvals, device, current_device, current_stream = fast  # type: ignore[misc]
            if current_device() == device:
                key = tuple(tensors[d[3]].data_ptr() for d in self.descs)
                exp = self.expanded.get(key)
                if exp is None:
                    exp = self._expand(tensors, key)
                for (i, _, _, _), e in zip(reversed(self.descs), exp, strict=True):
                    args[i : i + 1] = e
                g = self.grid
                raw[0](g[0], g[1], g[2], current_stream(device), kernel.function, raw[1], raw[2], None, None,
                       kernel.packed_metadata, None, None, None, *args, *cvals)  # fmt: skip
                return
        for i, kind, fields, j in self.descs:
            args[i] = clone_descriptor(kind, fields, tensors[j])
        if fast is not None and not _hooks_active():
            kernel, cvals, device, current_device, current_stream = fast
            if current_device() == device:
                g = self.grid
                kernel.run(g[0], g[1], g[2], current_stream(device), kernel.function, kernel.packed_metadata, None,
                           None, None, *args, *cvals)  # fmt: skip
                return
        launch_jit(self.fn, self.grid, args, self.consts, **self.options)

    def _expand(self, tensors: Sequence[Any], key: tuple[int, ...]) -> tuple:
        """The descriptors over ``tensors`` as the raw launcher takes them (Triton's own encoder), last argument
        first, kept under their base addresses."""
        raw, out = self.raw, []
        for (_, kind, fields, j), meta in zip(self.descs, raw[3], strict=True):  # type: ignore[index]
            out.append(tuple(raw[4](clone_descriptor(kind, fields, tensors[j]), meta)))  # type: ignore[index]
        exp = tuple(reversed(out))
        if len(self.expanded) >= RAW_EXPANDED_MAX:
            self.expanded.clear()
        self.expanded[key] = exp
        return exp


def export_tuned(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Write every config chosen so far (per arch, kernel and key) as JSON, in the committed-file layout."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, tk in _REGISTRY.items():
        for (arch, key), cfg in tk._chosen.items():
            if arch == "interpreter":
                continue
            out.setdefault(arch, {}).setdefault(name, {})[_key_str(key)] = config_to_json(cfg)
    if path is not None:
        base = Path(path)
        base.mkdir(parents=True, exist_ok=True)
        for arch, kernels in out.items():
            (base / f"{arch}.json").write_text(json.dumps(kernels, indent=1, sort_keys=True) + "\n")
    return out
