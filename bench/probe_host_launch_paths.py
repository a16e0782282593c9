"""Host time per call of a few kernel entry points with their launches stubbed (CPU, the interpreter's Python
only): what kvforge's own Python costs around a launch, garbage collector on.

    TRITON_INTERPRET=1 python3 bench/probe_host_launch_paths.py [--tree DIR]   # DIR: another checkout to compare

Entry points: ``rms_norm`` (64 x 7168 bf16), ``swiglu`` (64 x 2048), ``quantize_fp8`` (64 x 7168), and
``v_to_dim_major(v, out=buf)`` (669 tokens x 16 heads x 128, e4m3). Each: 200 warm calls, then the best of 5 rounds
of 1000 calls (µs a call). The kernels are replaced by no-ops (``quantize_fp8``'s tuned launch by its grid
function), so only the checks, the argument handling and the grid sizing are timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="checkout whose kvforge runs")
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, args.tree)
    import torch

    from kvforge.kernels import mla_context as mc
    from kvforge.kernels import quantize_fp8 as q
    from kvforge.kernels import rms_norm as r
    from kvforge.kernels import swiglu as s

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    r._rms_norm_kernel = _NoLaunch()
    s._swiglu_kernel = _NoLaunch()
    q._KERNEL.launch_fast = lambda grid, key, spec, a, **kw: grid({"BLOCK_R": 32, "BLOCK_D": 64})
    mc.launch_jit = lambda *a, **k: None
    x = torch.randn(64, 7168, dtype=torch.bfloat16)
    w = torch.randn(7168, dtype=torch.bfloat16)
    g = torch.randn(64, 2048, dtype=torch.bfloat16)
    v = torch.randn(669, 16, 128).to(torch.float8_e4m3fn)
    buf = torch.empty(16, 128, 672, dtype=torch.float8_e4m3fn)[:, :, :669]
    cases = {
        "rms_norm": lambda: r.rms_norm(x, w),
        "swiglu": lambda: s.swiglu(g, g),
        "quantize_fp8": lambda: q.quantize_fp8(x, 2.0),
        "v_to_dim_major(out=)": lambda: mc.v_to_dim_major(v, out=buf),
    }
    print(f"# {args.tree}: host us a call, launches stubbed, GC on")
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            best = min(best, (time.perf_counter() - t0) / 1000 * 1e6)
        print(f"{name}: {best:.1f} us", flush=True)


if __name__ == "__main__":
    main()
