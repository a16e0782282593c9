"""Device kernels one CUDA-graph decode step launches, counted on the CPU, per layer kind (issue 29).

    python3 -m bench.probe_decode_kernels                          # tiny sizes, tiny and real layer structure
    python3 -m bench.probe_decode_kernels --full-size --structure real --batch 64   # on a GPU: the real model

One :meth:`Runner.decode_static <kvforge.engine.runner.Runner.decode_static>` step (the body
:class:`~kvforge.engine.graphs.DecodeGraphs` captures) runs on trash inputs, as a capture's warm-up does, once to
warm up and once counted. The model is built in bf16 with ``HybridModel.use_kernels`` on, so the op sequence is
the CUDA path's, casts included (without a GPU, ``kvforge.kernels`` runs the Triton kernels in the interpreter).
Counted as one launch each: every aten op a ``TorchDispatchMode`` sees that is neither a view nor an allocation
(``empty*``), and every Triton kernel launch (the ops Triton's launcher itself dispatches are not counted).
GPU-only extras are not seen: a cuBLAS GEMM may add a split-K reduce kernel. A host read inside the step
(``_local_scalar_dense``) is reported apart (a captured step must have none). Launches are attributed to the
outermost region active: ``MLA`` / ``KDA`` (a target layer's mixer), ``MLP``, ``norm`` (the residual add + norm
between blocks), ``drafter`` (everything from ``draft_input`` to ``draft_logits``), ``head`` (final norm, LM
head, greedy acceptance) and ``step`` (the rest: embedding, layout, slot stores). ``--json`` writes the counts,
the per-op breakdown and the environment (revision, machine, load average).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvforge.engine.runner as runner_mod
from bench._common import env_stamp
from kvforge.engine import Engine, EngineConfig, HybridModel, real, tiny

KINDS = ("MLA", "KDA", "MLP", "norm", "drafter", "head", "step")
# Allocations and metadata: no kernel. Views are recognised by their schema (OpOverload.is_view).
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_unsafe_view",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "resize_",
    "set_",
    "scalar_tensor",  # a Python number wrapped for an op: a CPU scalar, no device kernel
}


class KernelCounter(TorchDispatchMode):
    """Counts launching aten ops and Triton launches by (region, name) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.host_reads = 0
        self.region: str | None = None
        self._inside_triton = 0

    @contextlib.contextmanager
    def enter(self, region: str):
        """The outermost region wins (a mixer's own norms belong to the mixer)."""
        outer = self.region
        if outer is None:
            self.region = region
        try:
            yield
        finally:
            self.region = outer

    def record(self, name: str) -> None:
        self.counts[(self.region or "step", name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._inside_triton:
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.host_reads += 1
        elif not func.is_view and name not in _NO_KERNEL:
            self.record(f"aten.{name}")
        return out


def _wrap(obj, attr: str, counter: KernelCounter, region: str) -> None:
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        with counter.enter(region):
            return fn(*a, **k)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(obj, attr, wrapped)


_ACTIVE: list[KernelCounter] = []  # the counter the patched Triton launchers report to


def _patch_triton() -> None:
    """Count each Triton launch once (JITFunction on a GPU, InterpretedFunction in the interpreter)."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    for cls in (jit.JITFunction, interp.InterpretedFunction):
        run = cls.run
        if getattr(run, "_probe", False):
            continue

        def counted(self, *a, _run=run, **k):
            if k.get("warmup") or not _ACTIVE:
                return _run(self, *a, **k)
            counter = _ACTIVE[-1]
            counter.record(f"triton.{getattr(self, '__name__', '?')}")
            counter._inside_triton += 1
            try:
                return _run(self, *a, **k)
            finally:
                counter._inside_triton -= 1

        counted._probe = True  # type: ignore[attr-defined]
        cls.run = counted  # type: ignore[method-assign]


@contextlib.contextmanager
def _full_launch_path():
    """On a GPU kvforge's direct launcher (``_runtime.launch_fast``) skips ``JITFunction.run`` unless a launch
    hook is set (a profiler's): set a no-op one while counting (a chain of hooks from Triton 3.5, one before)."""
    import triton

    rt = triton.knobs.runtime
    hook = rt.launch_enter_hook

    def noop(*a, **k) -> None:
        return None

    if hasattr(hook, "add"):
        hook.add(noop)
        try:
            yield
        finally:
            hook.remove(noop)
    else:
        rt.launch_enter_hook = noop
        try:
            yield
        finally:
            rt.launch_enter_hook = hook


def _instrument(eng: Engine, counter: KernelCounter) -> None:
    _patch_triton()
    model, runner = eng.model, eng.runner
    _wrap(runner, "_mla", counter, "MLA")
    for attr in ("kda_project", "kda_out"):
        _wrap(model, attr, counter, "KDA")
    for attr in ("kda_recurrent_inplace", "greedy_accept"):
        _wrap(runner_mod, attr, counter, "KDA" if attr.startswith("kda") else "head")
    _wrap(model, "mlp_normed", counter, "MLP")
    for attr in ("norm", "add_norm"):
        _wrap(model, attr, counter, "norm")
    _wrap(model, "logits", counter, "head")
    # The drafter: from draft_input to the end of draft_logits, everything (its MLA, MLP and norms too).
    draft_input, draft_logits = model.draft_input, model.draft_logits

    def d_in(*a, **k):
        counter.region = "drafter"
        return draft_input(*a, **k)

    def d_out(*a, **k):
        try:
            return draft_logits(*a, **k)
        finally:
            counter.region = None

    model.draft_input, model.draft_logits = d_in, d_out


def count_step(structure: str, batch: int, draft_len: int, device: str, full_size: bool) -> dict:
    layer_types = real().layer_types if structure == "real" else tiny().layer_types
    cfg = real() if full_size else tiny(layer_types=layer_types)
    model = HybridModel(cfg, device=device, dtype=torch.bfloat16)
    model.use_kernels = True
    ec = EngineConfig(
        device=device, cuda_graphs=False, max_num_requests=batch, attention_pages=8, state_pages=8, draft_pages=8,
        max_blocks_per_request=4,
    )  # fmt: skip
    eng = Engine(model, ec, draft_len=draft_len)
    graphs = eng.decode_graphs(capture=False)
    graphs._trash_inputs(batch)
    graphs._pad_tables(0, batch)
    graphs._body(batch)  # warm-up: compiles kernels, caches the step's index tensors
    counter = KernelCounter()
    _instrument(eng, counter)
    _ACTIVE.append(counter)
    try:
        with _full_launch_path(), counter:
            graphs._body(batch)
    finally:
        _ACTIVE.remove(counter)
        for name in ("kda_recurrent_inplace", "greedy_accept"):  # the module functions unwrapped again
            setattr(runner_mod, name, getattr(runner_mod, name).__wrapped__)
    n_layers = {"MLA": len(cfg.mla_layers), "KDA": len(cfg.linear_layers), "MLP": cfg.num_layers}
    n_layers["norm"] = cfg.num_layers
    per_kind = {k: sum(v for (r, _), v in counter.counts.items() if r == k) for k in KINDS}
    ops = {k: dict(Counter({n: v for (r, n), v in counter.counts.items() if r == k}).most_common()) for k in KINDS}
    return {
        "structure": structure,
        "layer_types": layer_types,
        "sizes": "real" if full_size else "tiny",
        "batch": batch,
        "draft_len": draft_len,
        "device": device,
        "total": sum(per_kind.values()),
        "per_kind": per_kind,
        "per_layer": {k: per_kind[k] / n for k, n in n_layers.items()},
        "host_reads": counter.host_reads,
        "ops": ops,
    }


def _report(r: dict) -> str:
    lines = [
        f"{r['structure']} structure ({r['layer_types']}), {r['sizes']} sizes, batch {r['batch']}, draft_len "
        f"{r['draft_len']}, {r['device']}: {r['total']} launches per step, {r['host_reads']} host reads"
    ]
    for k in KINDS:
        per = r["per_layer"].get(k)
        per_s = f" ({per:g} per layer)" if per is not None else ""
        top = ", ".join(f"{n} x{v}" for n, v in r["ops"][k].items())
        lines.append(f"  {k:8s} {r['per_kind'][k]:5d}{per_s}: {top}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--structure", choices=("tiny", "real", "both"), default="both")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--draft-len", type=int, choices=(0, 1), nargs="*", default=[0, 1])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full-size", action="store_true", help="the real config's sizes too (a GPU's memory)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch: expected an int >= 1, got {args.batch}")
    structures = ("tiny", "real") if args.structure == "both" else (args.structure,)
    results = []
    for s in structures:
        for d in args.draft_len:
            r = count_step(s, args.batch, d, args.device, args.full_size)
            print(_report(r), flush=True)
            results.append(r)
    if args.json is not None:
        stamp = {**env_stamp(), "machine": platform.node(), "load_average": os.getloadavg()}
        args.json.write_text(json.dumps({"env": stamp, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
