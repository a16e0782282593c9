"""How far FP8 MLA's log-sum-exp strays from the fp32 reference on a GPU (H200 diagnostics).

Hopper's FP8 matrix products accumulate with fewer mantissa bits than fp32, so FP8 scores, and the LSE built
from them, differ from a reference computed in fp32. This prints, for the mixed workload of the GPU tests (one
16k prefill + 32 x (4096 + 256), 32 heads, 192/128) and three seeds, the largest and mean absolute error, the
spread and the count above 1e-3: the figures behind ``tests/tolerances.py``'s ``LSE_FP8_MMA``.

Usage (GPU): ``PYTHONPATH=. python bench/probe_fp8_lse.py``.
"""

import torch

from kvforge.kernels.mla_context import mla_context_attention, mla_context_attention_ref
from tests.test_mla_context import _cast, _make


def main() -> None:
    dev = torch.device("cuda")
    for seed in (0, 1, 2):
        gen = torch.Generator().manual_seed(seed)
        q, k, v, cu_q, cu_kv = _make(gen, dev, [16384] + [256] * 32, [0] + [4096] * 32, heads=32, extra_rows=0)
        q8, k8, v8 = _cast("fp8", q, k, v, 1.5)
        _, ref_lse = mla_context_attention_ref(
            q8, k8, v8, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=1.5, head_chunk=4
        )
        _, lse = mla_context_attention(q8, k8, v8, cu_q, cu_kv, kv_scale_quant_orig=1.5, return_lse=True)
        e = lse.double() - ref_lse.double()
        print(
            f"seed {seed}: n {e.numel()} max|e| {e.abs().max().item():.3e} mean|e| {e.abs().mean().item():.3e} "
            f"std {e.std().item():.3e} mean {e.mean().item():.3e} count>1e-3 {(e.abs() > 1e-3).sum().item()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
