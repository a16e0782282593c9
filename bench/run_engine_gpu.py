"""The engine's H200 session in one process, so kernels tune and compile once for all of it.

    python3 -m bench.run_engine_gpu --out DIR [bench_engine args...]   # first-call timing, GPU tests, bench
    python3 -m bench.run_engine_gpu --first-call                       # only the first KDA calls, timed

1. times the first fla-core KDA calls at the real model's shapes (chunk_kda over two varlen segments, then
   one fused_recurrent_kda token): with fla-core tuning, this is its tuning pause;
2. runs tests/test_engine_gpu.py (``-s``: the measured logit errors are printed);
3. runs ``bench.bench_engine --size real`` with the remaining arguments, exporting fla-core's tuned configs
   to ``DIR/fla`` (see :mod:`kvforge.engine.fla_configs`).

``--first-call`` alone is step 1, for a fresh process pointed at exported configs (``FLA_CACHE_MODE=strict
FLA_CONFIG_DIR=...``, and a fresh ``TRITON_CACHE_DIR`` so kernels compile as on a new machine).
"""

from __future__ import annotations

import sys
import time


def first_kda_calls() -> float:
    import torch

    from kvforge.engine import real
    from kvforge.engine.ops import kda_segments, kda_tokens

    c = real()
    h, d, t = c.linear_heads, c.linear_head_dim, 700
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    q = torch.nn.functional.normalize(r(t, h, d), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(r(t, h, d), dim=-1).bfloat16()
    v = r(t, h, d).bfloat16()
    gate = -torch.nn.functional.softplus(r(t, h, d) - 2.0)
    beta = torch.sigmoid(r(t, h))
    s0 = torch.zeros(2, h, d, d, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, fin = kda_segments(q, k, v, gate, beta, s0, [0, 300, t])
    kda_tokens(q[None, :1], k[None, :1], v[None, :1], gate[None, :1], beta[None, :1], fin[:1])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"first KDA calls (chunk_kda + fused_recurrent_kda): {dt:.1f} s", flush=True)
    return dt


def main() -> int:
    argv = sys.argv[1:]
    if argv == ["--first-call"]:
        first_kda_calls()
        return 0
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    first_kda_calls()
    import pytest

    t0 = time.perf_counter()
    rc = pytest.main(["-q", "-s", "-p", "no:cacheprovider", "tests/test_engine_gpu.py"])
    print(f"GPU tests: exit code {int(rc)}, {time.perf_counter() - t0:.1f} s", flush=True)
    from bench import bench_engine

    extra = ["--export-fla-configs", f"{out}/fla"] if out else []
    sys.argv = ["bench_engine", "--size", "real", *argv, *extra]
    bench_engine.main()
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
