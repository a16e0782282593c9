"""Host cost of ``mla_decode_attention`` (and the one-call ``mla_context_attention``) on the CPU, launches stubbed.

What one eager call costs in Python besides the driver launch: argument checks, the plan lookup, split planning,
allocations, descriptor building, the torch ops the wrapper issues. The wrapper runs as on an sm_90 GPU with 132
SMs (``device_capability``, ``num_sms``, Gluon availability and Triton's active driver are patched; CPU tensors
stand in for CUDA ones, so ``check_launch_device`` is patched to take them as it takes CUDA tensors), and every
compiled kernel is a stub whose ``run`` does nothing: the first call per launch spec goes through the JIT path as
on the GPU and registers the stub as the direct launcher, later calls take the direct path. What is not here:
the driver launch itself (a few µs per kernel on the H200 host), Triton's launcher work per argument (for each
TMA descriptor argument it encodes a ``CUtensorMap``) and the CUDA caching allocator (a CPU ``torch.empty`` is
cheaper than a CUDA one). Timed with ``time.perf_counter`` over many calls with the garbage collector on; the
torch ops each call issues are counted with a ``TorchDispatchMode``; ``--profile`` prints a cProfile of one
workload. Context calls repeat their tensors, so from the third call on they replay recorded launches;
``--no-replay`` empties those caches before each call (the cost for buffers that never recur). ``--device cuda``
runs the same calls unpatched on a GPU (kernels included, caches uninitialised):
the host's whole enqueue time per call, driver launches and the CUDA allocator included.

    PYTHONPATH=. python3 bench/probe_decode_host_cost.py [--context] [--calls 200] [--rounds 15] [--profile 3]
    PYTHONPATH=. python3 bench/probe_decode_host_cost.py --device cuda --context --calls 100   # on the H200
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# Run as a script without --device cuda: the interpreter, even on a GPU machine (CPU tensors as an sm_90's).
# Imported (tests): never here, so one test module cannot switch a whole pytest run on the H200 to the
# interpreter; kvforge.kernels turns it on by itself where torch sees no CUDA device.
if __name__ == "__main__" and not any(a.endswith("cuda") for a in sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DV, DR = 512, 64
# (heads, batch, page size, longest length): the decode grid's shapes (bench_mla_decode_grid.py --grid), rows 0-11.
WORKLOADS = [
    (16, 1, 64, 55301),
    (32, 4, 64, 625),
    (64, 16, 64, 4826),
    (128, 64, 64, 3631),
    (16, 256, 32, 1529),
    (32, 1, 32, 2555),
    (64, 4, 32, 48702),
    (128, 16, 32, 838),
    (16, 64, 64, 4546),
    (32, 256, 64, 678),
    (64, 1, 64, 7588),
    (128, 4, 64, 1962),
]


class _Stub:
    """A compiled kernel whose launcher does nothing; ``LAUNCHES`` records the last launches when it is a list."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.packed_metadata = object()
        self.function = 0

    def run(self, *args: object) -> None:
        global COUNT
        COUNT += 1
        if LAUNCHES is not None:
            LAUNCHES.append(("direct", self.name, args))


COUNT = 0  # launches so far (JIT path and direct)
LAUNCHES: list | None = None


class _StubJIT:
    """Stands in for a ``JITFunction``: ``fn[grid](*args, **kw)`` returns a stub kernel; ``params`` name the real
    kernel's parameters (what ``launch_fast`` reads the constexpr order from)."""

    def __init__(self, real: object, name: str) -> None:
        import inspect
        from types import SimpleNamespace

        names = getattr(real, "arg_names", None) or list(inspect.signature(real.fn).parameters)
        self.params = [SimpleNamespace(name=n) for n in names]
        self.name = name

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> _Stub:
            global COUNT
            COUNT += 1
            if LAUNCHES is not None:
                LAUNCHES.append(("jit", self.name, (tuple(grid), args, kwargs)))
            return _Stub(self.name)

        return launch


class _Driver:
    """Triton's active driver as ``launch_fast`` / the Gluon launcher read it: device 0, stream 0."""

    @staticmethod
    def get_current_device() -> int:
        return 0

    @staticmethod
    def get_current_stream(device: int) -> int:
        return 0


def patch_as_sm90(set_=setattr) -> None:
    """Make the decode wrappers take their sm_90 paths on CPU tensors with stubbed kernels (see the module
    docstring). Every change goes through ``set_`` (``monkeypatch.setattr`` in a test, to be undone); the
    kernels, their launch caches and the plan cache are fresh ones."""
    import triton

    from kvforge.kernels import _checks, _runtime
    from kvforge.kernels import mla_context_gluon as mcg
    from kvforge.kernels import mla_decode as md
    from kvforge.kernels import mla_decode_gluon as mdg

    def check_launch_device(name: str, t: torch.Tensor) -> None:  # _checks' test, with CPU standing in for CUDA
        kind = t.device.type
        if kind == "meta":
            raise ValueError(f"{name}: expected a tensor with storage on a CUDA device, got a meta tensor")
        if kind in ("cuda", "cpu"):
            return
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")

    cap = (9, 0)
    for mod in (_runtime, md):
        set_(mod, "interpreting", lambda: False)
        set_(mod, "device_capability", lambda device=None: cap)
        set_(mod, "num_sms", lambda device=None: 132)
    for mod in (_checks, md, mdg):
        if hasattr(mod, "check_launch_device"):
            set_(mod, "check_launch_device", check_launch_device)
    set_(mcg, "gluon_unavailable_reason", lambda device=None: None)
    set_(triton.runtime.driver, "_active", _Driver())
    set_(_runtime, "_REGISTRY", dict(_runtime._REGISTRY))  # the fresh kernels below register under the real names
    split = _StubJIT(md._mla_decode_split_kernel, "split")
    set_(md, "_mla_decode_split_kernel", split)
    set_(md, "_SPLIT", _runtime.TunedKernel(md._SPLIT.name, split, md._CONFIGS, tune_first=md._SPLIT.tune_first))
    merge = _StubJIT(md._decode_merge_kernel, "merge")
    set_(md, "_DMERGE", _runtime.TunedKernel(md._DMERGE.name, merge, md._DMERGE.table))
    set_(mdg, "_mla_decode_gluon_kernel", _StubJIT(mdg._mla_decode_gluon_kernel, "gluon"))
    set_(mdg, "_FAST", {})
    set_(md, "_PLANS", _runtime.PlanCache(maxsize=64))
    set_(_runtime, "_JIT_FAST", {})


def patch_context_as_sm90(set_=setattr) -> None:
    """``patch_as_sm90`` for ``mla_context``: sm_90 capability (TMA, FP8 MMA, the Gluon kernel), CPU tensors taken
    as CUDA ones, its three kernels and the Gluon kernel stubbed. These launch through the JIT path (the stub
    stands for Triton's ``kernel[grid]`` launch, whose own host work is not measured here)."""
    from kvforge.kernels import mla_context as mc
    from kvforge.kernels import mla_context_gluon as mcg
    from kvforge.kernels.capability import capability_for

    patch_as_sm90(set_)
    from kvforge.kernels import mla_decode as md

    set_(mc, "interpreting", lambda: False)
    set_(mc, "check_launch_device", md.check_launch_device)
    set_(mc, "gpu_capability", lambda device=None: capability_for((9, 0)))
    for name in (
        "_mla_context_fwd_kernel",
        "_mla_tile_starts_kernel",
        "_mla_work_items_kernel",
        "_mla_work_table_kernel",
    ):
        set_(mc, name, _StubJIT(getattr(mc, name), name))
    set_(mcg, "_mla_context_gluon_kernel", _StubJIT(mcg._mla_context_gluon_kernel, "context_gluon"))
    set_(mc, "_CALLS", type(mc._CALLS)(maxsize=256))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops issued inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


ALLOC_OPS = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "new_empty", "new_zeros", "ones")


def decode_inputs(H: int, B: int, page: int, longest: int, device: str = "cpu") -> dict:
    n_pages = -(-longest // page)
    pages = B * n_pages + 8
    g = torch.Generator().manual_seed(H * 1000 + B)
    q = torch.randn(B, H, DV + DR, generator=g).to(torch.bfloat16)
    kv = torch.empty(pages, page, DV + DR, dtype=torch.bfloat16, device=device)  # not initialised: never checked
    bt = torch.randperm(pages, generator=g)[: B * n_pages].view(B, n_pages).to(torch.int32)
    lens = torch.randint(max(1, longest // 20), longest + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = longest
    out = torch.empty(B, H, DV, dtype=torch.bfloat16, device=device)
    return {"q": q.to(device), "kv_cache": kv, "block_table": bt.to(device), "seq_lens": lens.to(device), "out": out}


def time_calls(fn, calls: int, rounds: int) -> tuple[float, float, float]:
    """Per call, in µs: the median over ``rounds`` of the wall time (``perf_counter``) of ``calls`` calls, its
    minimum, and the median of the thread's CPU time (``thread_time``: what the call costs the CPU, the time a
    contended machine spends running other processes left out). The garbage collector stays on."""
    assert gc.isenabled()
    # On a GPU the device is drained before each round and a round enqueues fewer launches than CUDA's queue
    # holds, so the loop measures the host's enqueue time, not the kernels'.
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    wall, cpu = [], []
    for _ in range(rounds):
        sync()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.thread_time() - c0) / calls * 1e6)
    sync()
    return statistics.median(wall), min(wall), statistics.median(cpu)


def count_ops(fn) -> tuple[int, int, int, Counter]:
    """(torch ops, allocations, kernel launches) of one call, and the ops by name."""
    before = COUNT
    with OpCounter() as c:
        fn()
    allocs = sum(n for name, n in c.ops.items() if name in ALLOC_OPS)
    return sum(c.ops.values()), allocs, COUNT - before, c.ops


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def decode_cases(md, device: str = "cpu") -> list[tuple[str, object]]:
    cases = []
    for H, B, page, longest in WORKLOADS:
        t = decode_inputs(H, B, page, longest, device)
        scale = (DV + DR) ** -0.5
        name = f"H{H} B{B} p{page} {longest}"

        def default(t=t, scale=scale) -> None:  # the bench's call: out given, default checks
            md.mla_decode_attention(t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], softmax_scale=scale,
                                    out=t["out"])  # fmt: skip

        def fresh_out(t=t, scale=scale) -> None:  # out and lse allocated by the call
            md.mla_decode_attention(t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], softmax_scale=scale,
                                    return_lse=True)  # fmt: skip

        cases.append((f"{name} default out=", default))
        cases.append((f"{name} fresh out+lse", fresh_out))
        plan_cls = getattr(md, "MLADecodePlan", None)
        if plan_cls is not None:
            plan = plan_cls(t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], softmax_scale=scale)

            def planned(t=t, plan=plan) -> None:
                plan.run(t["q"], t["kv_cache"], out=t["out"])

            cases.append((f"{name} planned run", planned))
    # An engine step: one call per layer (61, as DeepSeek-V3), each layer's cache its own tensor (here slices of one
    # buffer at different addresses), q and out shared; timed per layer call.
    H, B, page, longest = 128, 64, 64, 3631
    t = decode_inputs(H, B, page, longest, device)
    pages = t["kv_cache"].shape[0]
    buf = torch.empty(pages + 61 * 8, page, DV + DR, dtype=torch.bfloat16, device=device)
    layers = [buf[8 * i : 8 * i + pages] for i in range(61)]
    scale = (DV + DR) ** -0.5
    name = f"H{H} B{B} p{page} {longest} x61 layers"

    def step(t=t, layers=layers, scale=scale) -> None:
        for kv in layers:
            md.mla_decode_attention(t["q"], kv, t["block_table"], t["seq_lens"], softmax_scale=scale, out=t["out"])

    cases.append((f"{name} default out=", step))
    if plan_cls is not None:
        plan = plan_cls(t["q"], layers[0], t["block_table"], t["seq_lens"], softmax_scale=scale)

        def planned_step(t=t, layers=layers, plan=plan) -> None:
            for kv in layers:
                plan.run(t["q"], kv, out=t["out"])

        cases.append((f"{name} planned run", planned_step))
    return cases


def context_cases(device: str = "cpu") -> list[tuple[str, object]]:
    """bf16 q/k/v, 192 = 128 + 64 wide keys, 128-wide values (DeepSeek's context attention after the
    up-projections), token-major V; device ``cu_seqlens``: the one call without and with ``max_seqlen_*``,
    ``MLAContextPlan.run`` (planned from host lengths outside the timing) and ``plan`` + ``run`` end to end (what
    issue 28 holds the one call to: at most 1.1x)."""
    from kvforge.kernels import mla_context as mc

    cases = []
    for H, B, cached, new in ((16, 8, 2048, 1024), (128, 4, 4096, 512)):
        tq, tkv = B * new, B * (cached + new)
        q = torch.empty(tq, H, 192, dtype=torch.bfloat16, device=device)
        k = torch.empty(tkv, H, 192, dtype=torch.bfloat16, device=device)
        v = torch.empty(tkv, H, 128, dtype=torch.bfloat16, device=device)
        cu_q = torch.arange(0, tq + 1, new, dtype=torch.int32, device=device)
        cu_kv = torch.arange(0, tkv + 1, cached + new, dtype=torch.int32, device=device)
        out = torch.empty(tq, H, 128, dtype=torch.bfloat16, device=device)
        name = f"ctx H{H} {B}x({cached}+{new})"

        def one(q=q, k=k, v=v, cu_q=cu_q, cu_kv=cu_kv, out=out) -> None:
            mc.mla_context_attention(q, k, v, cu_q, cu_kv, out=out)

        def one_max(q=q, k=k, v=v, cu_q=cu_q, cu_kv=cu_kv, out=out, new=new, kvl=cached + new) -> None:
            mc.mla_context_attention(q, k, v, cu_q, cu_kv, out=out, max_seqlen_q=new, max_seqlen_kv=kvl)

        plan = mc.MLAContextPlan.plan(cu_q, cu_kv, num_heads=H, num_kv_heads=H, head_dim_qk=192, head_dim_v=128,
                                      device=q.device)  # fmt: skip

        def planned(q=q, k=k, v=v, out=out, plan=plan) -> None:
            plan.run(q, k, v, out=out)

        def plan_run(q=q, k=k, v=v, cu_q=cu_q, cu_kv=cu_kv, out=out, H=H) -> None:
            p = mc.MLAContextPlan.plan(cu_q, cu_kv, num_heads=H, num_kv_heads=H, head_dim_qk=192, head_dim_v=128,
                                       device=q.device)  # fmt: skip
            p.run(q, k, v, out=out)

        cases += [(f"{name} one call", one), (f"{name} one call max_seqlen", one_max), (f"{name} planned run", planned),
                  (f"{name} plan + run", plan_run)]  # fmt: skip
    return cases


def _no_replay(fn):
    """``fn`` with ``mla_context``'s replay caches (the one call's ``_CALLS``, the plan's ``_runs``) emptied first:
    every call takes the checked path, as with buffers that never recur."""
    from kvforge.kernels import mla_context as mc

    plans = [d for d in fn.__defaults__ or () if isinstance(d, mc.MLAContextPlan)]

    def call() -> None:
        getattr(mc, "_CALLS", {}).clear()
        for p in plans:
            getattr(p, "_runs", {}).clear()
        fn()

    return call


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--profile", type=int, default=-1, help="cProfile this case index (one round)")
    ap.add_argument("--only", type=str, default="", help="substring of the case names to run")
    ap.add_argument("--context", action="store_true", help="also mla_context_attention's one call and plan.run")
    ap.add_argument("--no-replay", action="store_true",
                    help="context: empty the replay caches before each call (tensors that never recur)")  # fmt: skip
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the real calls on a GPU, kernels included (timing only)")  # fmt: skip
    args = ap.parse_args()
    if args.device == "cpu":
        patch_context_as_sm90() if args.context else patch_as_sm90()
    from kvforge.kernels import mla_decode as md

    load = os.getloadavg()
    print(f"host {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, torch {torch.__version__}, rev {git_revision()}, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(20000):
        torch.empty(0)
    print(f"reference: CPU torch.empty(0) {(time.perf_counter() - t0) / 20000 * 1e6:.2f} µs")
    ctx = context_cases(args.device) if args.context else []
    if args.no_replay:
        ctx = [(name + " no replay", _no_replay(fn)) for name, fn in ctx]
    cases = decode_cases(md, args.device) + ctx
    cases = [c for c in cases if args.only in c[0]]
    rows = []
    for i, (name, fn) in enumerate(cases):
        for _ in range(3):  # plan, "compile", register the direct launcher; a context call's first replay
            fn()  # makes the buffers it keeps: the counted call is a steady one
        ops, allocs, launches, by_name = count_ops(fn)
        per = 61 if "x61 layers" in name else 1  # figures per layer call
        med, best, cpu = (x / per for x in time_calls(fn, max(1, args.calls // per), args.rounds))
        ops, allocs, launches = ops / per, allocs / per, launches / per
        rows.append((name, med, best, ops, allocs, launches, cpu))
        top = ", ".join(f"{k} {v / per:g}" for k, v in by_name.most_common())
        print(f"{i:2d} {name:>44}: {med:7.2f} µs/call (min {best:6.2f}, CPU {cpu:6.2f}) | torch ops {ops:g} "
              f"(allocations {allocs:g}) | launches {launches:g} | {top}", flush=True)  # fmt: skip
        if i == args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.calls):
                fn()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    med = statistics.median
    groups = [("decode", t) for t in ("default out=", "fresh out+lse", "planned run")]
    groups += [("context", t + r) for r in ("", " no replay")
               for t in ("one call", "one call max_seqlen", "planned run", "plan + run")]  # fmt: skip
    for op, tag in groups:
        sel = [r for r in rows if r[0].endswith(tag) and r[0].startswith("ctx") == (op == "context")
               and "x61" not in r[0]]  # fmt: skip
        if sel:
            print(f"{op} {tag:>29}: median over {len(sel)} workloads: wall {med(r[1] for r in sel):.2f} µs/call "
                  f"(max {max(r[1] for r in sel):.2f}), min wall {med(r[2] for r in sel):.2f}, CPU "
                  f"{med(r[6] for r in sel):.2f}; torch ops {min(r[3] for r in sel):g}-{max(r[3] for r in sel):g}, "
                  f"allocations {min(r[4] for r in sel):g}-{max(r[4] for r in sel):g}")  # fmt: skip
    load = os.getloadavg()
    print(f"load average after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
