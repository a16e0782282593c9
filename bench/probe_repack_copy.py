"""The unaligned dim-major V's repack copy (``mla_context._repack_v``) on the GPU: torch's ``copy_`` against
``copy_dim_major_rows`` (one word-copy launch), bit-exact first, then ``bench._common.time_gpu`` (median, L2
flushed before each call; the logs in bench/results up to rev 5c83049 timed the median of 50 calls behind a 256 MB
write instead).
Shapes: the context grid's unaligned rows ``[H, 128, T]`` e4m3 with T not a multiple of 16, and a bf16 one; then
the kernel's tile candidates, and the host time per call (``bench._common.host_time``, GC on).

    PYTHONPATH=$PWD python3 bench/probe_repack_copy.py --out $OUT     # H200, well under a minute

Prints one line per shape (µs, GB/s of bytes read + written, ratio) and writes ``repack_copy.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import host_time, time_gpu
from kvforge.kernels import mla_context as mc

SHAPES = [(32, 13475, torch.float8_e4m3fn), (32, 26934, torch.float8_e4m3fn), (128, 4108, torch.float8_e4m3fn),
          (16, 92192, torch.float8_e4m3fn), (64, 58339, torch.float8_e4m3fn), (32, 13475, torch.bfloat16)]  # fmt: skip


CONFIGS = [(2, 512, 4), (1, 1024, 4), (4, 256, 4), (4, 512, 8), (1, 512, 4), (8, 128, 4), (2, 1024, 8)]


def _time(fn) -> float:
    """Median µs of ``fn`` (``time_gpu``)."""
    return time_gpu(fn)["ms"] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--host-only", action="store_true", help="only the host time per call")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [f"# {torch.cuda.get_device_name()} torch {torch.__version__} rev {os.environ.get('KVFORGE_GIT_REV', '?')}"]
    for h, t, dt in SHAPES if not args.host_only else []:
        v = torch.randn(h, 128, t, device=dev).to(dt)  # packed: token stride t, not 16-byte aligned
        a = mc._dim_major_empty(h, 128, t, dt, dev)
        b = mc._dim_major_empty(h, 128, t, dt, dev)
        a.copy_(v)
        mc.copy_dim_major_rows(b, v)
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            lines.append(f"H{h} T{t} {dt}: MISMATCH, not timed")
            continue
        ta = _time(lambda a=a, v=v: a.copy_(v))
        tb = _time(lambda b=b, v=v: mc.copy_dim_major_rows(b, v))
        nb = 2 * v.numel() * v.element_size()
        name = f"H{h} x 128 x T{t} {str(dt).split('.')[-1]}"
        lines.append(f"{name}: torch copy_ {ta:.1f} us ({nb / ta / 1e3:.0f} GB/s), copy_dim_major_rows {tb:.1f} us "
                     f"({nb / tb / 1e3:.0f} GB/s), x{ta / tb:.2f}")  # fmt: skip
        print(lines[-1], flush=True)
        for br, bw, w in CONFIGS:  # the kernel's tile and warps
            es = v.element_size()
            grid = (triton.cdiv(h * 128, br), triton.cdiv(t * es // 4, bw))
            kargs = (v, b, h * 128, 128, t * es, v.stride(0) * es, v.stride(1) * es, v.data_ptr() % 4,
                     b.stride(0) * es, b.stride(1) * es)  # fmt: skip

            def run(grid=grid, kargs=kargs, br=br, bw=bw, w=w):
                mc._rows_copy_kernel[grid](*kargs, BLOCK_R=br, BLOCK_W=bw, num_warps=w)

            run()
            b.view(torch.uint8).zero_()
            run()
            ok = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            tc = _time(run) if ok else float("nan")
            lines.append(
                f"  BLOCK_R {br} BLOCK_W {bw} w{w}: {tc:.1f} us ({nb / tc / 1e3:.0f} GB/s){'' if ok else ' WRONG'}"
            )
            print(lines[-1], flush=True)
    lines.append("host time per call (us, mean of 300 back-to-back calls, GC on), small shapes:")
    for h, t in ((16, 669), (32, 653)):
        v = torch.randn(h, 128, t, device=dev).to(torch.float8_e4m3fn)
        b = mc._dim_major_empty(h, 128, t, v.dtype, dev)
        for name, fn in (("torch copy_", lambda b=b, v=v: b.copy_(v)),
                         ("copy_dim_major_rows", lambda b=b, v=v: mc.copy_dim_major_rows(b, v)),
                         ("_repack_v", lambda v=v, t=t: mc._repack_v(v, t))):  # fmt: skip
            host, _ = host_time(fn, calls=300)
            lines.append(f"  H{h} T{t} {name}: {host:.1f}")
            print(lines[-1], flush=True)
    t = 669
    q, k, vt = (torch.randn(t, 16, d, device=dev).to(torch.float8_e4m3fn) for d in (192, 192, 128))
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    for name, v in (("aligned", mc.v_to_dim_major(vt)), ("unaligned", vt.permute(1, 2, 0).contiguous())):
        fn = lambda v=v: mc.mla_context_attention(q, k, v, cu, cu, v_layout="dim_major")
        host, total = host_time(fn, calls=300, warm=3)
        lines.append(f"  one call H16 q669 c0 dim-major {name}: host {host:.1f} us, with the GPU {total:.1f} us")
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "repack_copy.log"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
