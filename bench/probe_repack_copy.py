"""The unaligned dim-major V's repack copy (``mla_context._repack_v``) on the GPU: torch's ``copy_`` against
``copy_dim_major_rows`` (one word-copy launch), bit-exact first, then ``bench._common.time_gpu`` (median, L2
flushed before each call; the logs in bench/results up to rev 5c83049 timed the median of 50 calls behind a 256 MB
write instead).
Shapes: the context grid's unaligned rows ``[H, 128, T]`` e4m3 with T not a multiple of 16, and a bf16 one; then
the kernel's tile candidates, and the host time per call (``bench._common.host_time``, GC on).

    PYTHONPATH=$PWD python3 bench/probe_repack_copy.py --out $OUT     # H200, well under a minute
    PYTHONPATH=$PWD python3 bench/probe_repack_copy.py --transpose --out $OUT

Prints one line per shape (µs, GB/s of bytes read + written, ratio) and writes ``repack_copy.log``.
``--transpose``: a token-major V ``[T, H, 128]`` to dim-major (``v_to_dim_major``: one ``_tokens_to_dims_kernel``
launch) against torch's ``copy_`` of the permuted view, the kernel's tile candidates, and the quantising form
(``quantize_v_dim_major``, bf16 in, e4m3 dim-major out) against ``quantize_fp8`` of the same V token-major (same
bytes, no transpose), and ``quantize_fp8``'s kernel with its integer encoder against the hardware conversion;
writes ``transpose_v.log``.
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
    ap.add_argument("--transpose", action="store_true", help="token-major -> dim-major V instead (see above)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [f"# {torch.cuda.get_device_name()} torch {torch.__version__} rev {os.environ.get('KVFORGE_GIT_REV', '?')}"]
    if args.transpose:
        transpose(lines, dev)
        with open(os.path.join(args.out, "transpose_v.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return
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


TRANSPOSE_TILES = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4), (32, 128, 4)]


def transpose(lines: list[str], dev: torch.device) -> None:
    """Token-major ``[T, H, 128]`` -> dim-major: the kernel (committed tile, then candidates) against torch, each
    checked bit-exact against torch's copy first; then the quantising transpose against the plain quantise."""
    from kvforge.kernels.quantize_fp8 import quantize_fp8

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    for h, t, dt in SHAPES:
        v = torch.randn(t, h, 128, device=dev).to(dt)
        a = mc._dim_major_empty(h, 128, t, dt, dev)
        a.copy_(v.permute(1, 2, 0))
        b = mc.v_to_dim_major(v)
        nb = 2 * v.numel() * v.element_size()
        name = f"T{t} x H{h} x 128 {str(dt).split('.')[-1]}"
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            say(f"{name}: MISMATCH, not timed")
            continue
        ta = _time(lambda a=a, v=v: a.copy_(v.permute(1, 2, 0)))
        tb = _time(lambda v=v: mc.v_to_dim_major(v))
        say(f"{name}: torch copy_ {ta:.1f} us ({nb / ta / 1e3:.0f} GB/s), v_to_dim_major {tb:.1f} us "
            f"({nb / tb / 1e3:.0f} GB/s), x{ta / tb:.2f}")  # fmt: skip
        for bt, bd, w in TRANSPOSE_TILES:
            grid, kargs, consts = mc._transpose_launch(b, v, bt, bd)

            def run(grid=grid, kargs=kargs, consts=consts, w=w):
                mc._tokens_to_dims_kernel[grid](*kargs, **consts, num_warps=w)

            b.view(torch.uint8).zero_()
            run()
            ok = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            tc = _time(run) if ok else float("nan")
            say(f"  BLOCK_T {bt} BLOCK_D {bd} w{w}: {tc:.1f} us ({nb / tc / 1e3:.0f} GB/s){'' if ok else ' WRONG'}")
        if dt == torch.float8_e4m3fn:  # the engine's form: bf16 V quantised into each layout
            vb = torch.randn(t, h, 128, device=dev, dtype=torch.bfloat16)
            same = torch.equal(mc.quantize_v_dim_major(vb, 16.0).view(torch.uint8),
                               quantize_fp8(vb, 16.0).permute(1, 2, 0).view(torch.uint8))  # fmt: skip
            if not same:
                say("  quantize_v_dim_major: MISMATCH with quantize_fp8, not timed")
                continue
            tq = _time(lambda vb=vb: quantize_fp8(vb, 16.0))
            tt = _time(lambda vb=vb: mc.quantize_v_dim_major(vb, 16.0))
            nq = 3 * vb.numel()
            say(f"  bf16 -> e4m3: quantize_fp8 token-major {tq:.1f} us ({nq / tq / 1e3:.0f} GB/s), "
                f"quantize_v_dim_major {tt:.1f} us ({nq / tt / 1e3:.0f} GB/s)")  # fmt: skip
            encoders(say, vb.view(-1, 128))


def encoders(say, x: torch.Tensor) -> None:
    """``quantize_fp8``'s kernel on ``x`` ``[N, d]`` (bf16) with the integer encoder and with the hardware
    conversion (``NATIVE``), same tile: bytes compared first, then each timed."""
    from kvforge.kernels import quantize_fp8 as qmod

    n, d = x.shape
    outs = {}
    for native in (False, True):
        out = torch.empty(n, d, dtype=torch.uint8, device=x.device)
        grid = (triton.cdiv(n, 64), 1, triton.cdiv(d, 128))

        def run(out=out, grid=grid, native=native):
            qmod._quantize_fp8_kernel[grid](x, out, x, 16.0, n, 1, d, 0, d, 0, d, 1, SCALE_IS_PTR=False, BLOCK_R=64,
                                            BLOCK_D=128, NATIVE=native, num_warps=8)  # fmt: skip

        run()
        outs[native] = (out, run)
    if not torch.equal(outs[False][0], outs[True][0]):
        say("  quantize_fp8 kernel: NATIVE bytes differ from the integer encoder's, not timed")
        return
    t_int, t_nat = (_time(outs[f][1]) for f in (False, True))
    nb = 3 * x.numel()
    say(f"  quantize_fp8 kernel [{n}, {d}] 64x128 w8: integer encoder {t_int:.1f} us ({nb / t_int / 1e3:.0f} GB/s), "
        f"hardware conversion {t_nat:.1f} us ({nb / t_nat / 1e3:.0f} GB/s), x{t_int / t_nat:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
