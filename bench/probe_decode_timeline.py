"""Where a Gluon decode program's time goes: ``%globaltimer`` stamps at fixed points of every program.

The probe loads a copy of ``kvforge.kernels.mla_decode_gluon`` with stamp calls inserted at the points below (the
library's kernel is untouched; a change to its source that the anchors no longer match fails loudly), runs one call,
and reports per program the time from its first stamp to each later one (median, p10 and p90 over the programs) and
the spread of the programs' starts. Points: 0 entry; 1 share worked out (past the early exits); 2 loader: Q copy
issued (with the balanced split, where the body issued it: the loader's start); 3 loader: first key tile's copy
issued; 4/5 consumer warpgroup 0/1: Q landed; 6/7 its key loop done; 8/9 the row sums exchanged; 10/11 its output
stored (and merged, by a split request's last share); 12 the partitions joined; 13 (balanced split only) the share
size picked. A workload is equal lengths, ``num_splits=1`` (a program is one request; 64 heads: one program per SM)
unless a fifth field gives the splits (0: the default call's choice); programs that leave early (past their share)
are counted, not timed. Also the whole call (kernel and merge) replayed in a CUDA graph, for the time outside the
stamps. Made to find what the 22 us fixed cost of a short program (``probe_decode_fixed_cost.py``) was made of.

    python3 bench/probe_decode_timeline.py [--workload 64,132,32,32] [--workload 64,64,64,1973,0]
    python3 bench/probe_decode_timeline.py --compile-only   # no GPU: the stamped kernel compiles for sm_90
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import load_source_copy, time_graph  # noqa: E402

SRC = ROOT / "kvforge" / "kernels" / "mla_decode_gluon.py"
SLOTS = 16
STAMP_DEF = '''    TRACE_ADDR = gl.constexpr({addr})

    @gluon.jit
    def _tl_stamp(slot: gl.constexpr):
        """The global timer (ns) into this program's row of the trace buffer, column ``slot``."""
        pid = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                      pack=1)  # fmt: skip
        base = gl.to_tensor(TRACE_ADDR).to(gl.int64).to(gl.pointer_type(gl.int64), bitcast=True)
        gl.store(base + pid.to(gl.int64) * {slots} + slot, t)

'''
# (text before, text after, stamp inserted between them); each anchor (before + after) must occur exactly once.
POINTS = [
    ("        pid_h = gl.program_id(0)\n", "", "        _tl_stamp(0)\n"),
    ("", "        h0 = pid_h * BLOCK_H\n        q_row = b * H + h0\n", "        _tl_stamp(1)\n"),
    ("", "        for t in range(n_tiles):\n            s = t % STAGES8\n", "        _tl_stamp(2)\n"),
    (
        "            _tma_load(k_desc_r, [row, D_V], k_ready.index(s), k8_r.index(s))\n",
        "",
        "            if t == 0:\n                _tl_stamp(3)\n",
    ),
    ("\n        mbarrier.wait(q_ready, 0)\n", "        if KV_FP8:  # fp16 products", "        _tl_stamp(4 + W)\n"),
    ("", "        last = n_tiles - 1\n        if last >= 0 and last % 2 != W:", "        _tl_stamp(6 + W)\n"),
    ("        mbarrier.wait(l_ready, 0)\n", "", "        _tl_stamp(8 + W)\n"),
    ("                gl.store(plse_base + hr * s_plh, lse, mask=hr < H)\n\n", "", "        _tl_stamp(10 + W)\n"),
    ("\n", "        mbarrier.invalidate(q_ready)\n        mbarrier.invalidate(p_full)", "        _tl_stamp(12)\n"),
    (
        "",
        "        if MERGE:  # nshare_ptr: the arrival counters, [B, head tiles, 2] int32\n",
        "        _tl_stamp(13)\n",
    ),
]
NAMES = ["entry", "share", "Q issued", "tile 0 issued", "Q landed w0", "Q landed w1", "loop done w0",
         "loop done w1", "sums w0", "sums w1", "stored w0", "stored w1", "joined", "share picked"]  # fmt: skip


def patched_source(addr: int) -> str:
    text = SRC.read_text()
    anchor = "    _barrier = _mcg._barrier\n"
    for a in [anchor, *(pre + post for pre, post, _ in POINTS)]:
        if text.count(a) != 1:
            raise SystemExit(f"timeline anchor not found once in {SRC.name}: {a[:70]!r}")
    text = text.replace(anchor, anchor + "\n" + STAMP_DEF.format(addr=addr, slots=SLOTS))
    for pre, post, ins in POINTS:
        text = text.replace(pre + post, pre + ins + post)
    return text


def load_patched(addr: int) -> object:
    return load_source_copy("kvforge.kernels.mla_decode_gluon", patched_source(addr), "mla_decode_gluon_timeline.py")


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 10], xs[n // 2], xs[min(n - 1, (9 * n) // 10)]


def run(workloads: list[tuple[int, int, int, int]]) -> None:
    import torch

    # Trace rows: every program of the grid (head tiles, requests, splits); a share holds at least one 32-key tile.
    n_max = max(w[1] * -(-w[0] // 64) * max(w[4], -(-w[3] // 32)) for w in workloads)
    trace = torch.zeros(n_max, SLOTS, dtype=torch.int64, device="cuda")
    load_patched(trace.data_ptr())
    import kvforge.kernels.mla_decode as md

    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; us from each program's entry stamp")
    for H, B, page, n, splits in workloads:
        ns = None if splits == 0 else splits
        g = torch.Generator().manual_seed(0)
        pages = B * -(-n // page)
        kv = (torch.randn(pages, page, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
        bt = torch.randperm(pages, generator=g).to(torch.int32).view(B, -1).cuda()
        q = torch.randn(B, H, 576, generator=g).to("cuda", torch.bfloat16)
        sl = torch.full((B,), n, dtype=torch.int32, device="cuda")
        out = torch.empty(B, H, 512, dtype=torch.bfloat16, device="cuda")

        def call(q=q, kv=kv, bt=bt, sl=sl, out=out, ns=ns) -> None:
            md.mla_decode_attention(q, kv, bt, sl, softmax_scale=576**-0.5, out=out, num_splits=ns)

        for _ in range(3):  # compile, warm, then the traced call
            trace.zero_()
            call()
            torch.cuda.synchronize()
        rows = trace.cpu()
        entered = rows[:, 0] != 0
        if not bool(entered.any()):
            raise SystemExit(f"H{H} B{B}: no program left an entry stamp")
        tmin = rows[entered, 0].min()
        rows = rows[rows[:, 12] != 0]  # the programs that ran a share
        t0 = rows[:, 0]
        starts = (t0 - tmin).double() / 1e3
        span = (rows[:, 12].max() - tmin).item() / 1e3
        whole = time_graph(call)["ms"] * 1e3
        print(f"H{H} B{B} page {page} keys {n} splits {splits or 'default'}: {len(rows)} programs ran a share, "
              f"{int(entered.sum()) - len(rows)} left early; kernel span {span:.1f} us, whole call in a graph "
              f"{whole:.1f} us; program starts spread "
              f"p10/p50/p90 {_quantiles(starts.tolist())[0]:.1f}/{starts.median().item():.1f}/"
              f"{_quantiles(starts.tolist())[2]:.1f} us")  # fmt: skip
        for k in range(1, len(NAMES)):
            if not bool((rows[:, k] != 0).all()):  # a point this call's programs do not pass (no balanced split)
                continue
            d = ((rows[:, k] - t0).double() / 1e3).tolist()
            p10, p50, p90 = _quantiles(d)
            print(f"  {k:2d} {NAMES[k]:>14}: p10 {p10:7.2f}  median {p50:7.2f}  p90 {p90:7.2f}")


def compile_only() -> None:
    load_patched(0)
    sys.path.insert(0, str(ROOT))
    from tests.test_mla_decode_gluon import _compile_one

    for v in ((32, 4, False), (64, 2, False)):
        rec = _compile_one(*v)
        print(rec["name"], "ok" if rec["ok"] else f"FAILED: {rec.get('error')}")
        if not rec["ok"]:
            raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", default=[],
                    help="H,B,page,keys[,splits] (equal lengths; splits 0: the default call's)")  # fmt: skip
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        os.environ["TRITON_INTERPRET"] = "0"
        compile_only()
        return
    specs = args.workload or ["64,132,32,32", "64,132,32,512", "64,264,32,32"]
    try:
        workloads = [tuple(int(x) for x in w.split(",")) for w in specs]
    except ValueError:
        raise SystemExit(f"--workload: expected H,B,page,keys, got {specs}") from None
    if any(len(w) not in (4, 5) or min(w[:4]) < 1 or (w[4:5] and w[4] < 0) for w in workloads):
        raise SystemExit(f"--workload: H,B,page,keys positive, splits >= 0, got {specs}")
    workloads = [(*w[:4], w[4] if len(w) == 5 else 1) for w in workloads]
    run(workloads)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
