"""Small-copy kernels on the GPU against the torch code a user would otherwise write, in the same run.

Workloads follow ../shared/anchors (H200): a step's slot scatter (256 of 1,024 slots, store width 8) against
four ``index_copy_`` (eager and CUDA graph); the paired pinned upload (512 int32 + 512 bool) against two
``copy_(non_blocking=True)``; block offsets for 256 requests x 2,048 blocks x 2 pools against torch
elementwise code; and block offsets at 64 x 262,144 x 2 pools against a device-to-device copy of the same
bytes (and at 256 x 2,048 x 2 too, for reading the launch-floor ratio against the hardware's). An empty Triton
kernel gives the launch floor. Eager times come from ``time_interleaved``: each workload's providers and the
empty kernel are timed sample by sample in turn, each call behind its own L2 flush, and each ratio against the
floor uses the floor of its own workload's group. Every kvforge output and every peer's output is checked
against the reference before timing (ReferenceMismatch otherwise).

Usage (H200): ``PYTHONPATH=. python bench/bench_small_copies.py [--quick] [--out DIR]``. Appends rows to
``DIR/small_copies.csv`` (default bench/results), draws ``DIR/small_copies.png`` and writes the sm_90 configs
chosen while tuning to ``DIR/tuned/``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from bench import _common
from bench._common import (
    ReferenceMismatch,
    append_csv,
    bar_plot,
    env_stamp,
    time_gpu,
    time_graph,
    time_interleaved,
)


@triton.jit
def _empty_kernel(x_ptr):
    pass


# Targets of issue 2, as same-run ratios: (name, numerator, denominator, bound, "<=" or ">=").
TARGETS = [
    ("scatter vs 4x index_copy_ (eager)", ("scatter", "kvforge", "eager"), ("scatter", "4x index_copy_", "eager"), 0.4),
    ("scatter vs 4x index_copy_ (graph)", ("scatter", "kvforge", "graph"), ("scatter", "4x index_copy_", "graph"), 0.4),
    ("scatter vs empty launch", ("scatter", "kvforge", "eager"), ("scatter", "empty kernel", "eager"), 1.5),
    ("pinned pair vs 2x copy_", ("pinned pair", "kvforge", "eager"), ("pinned pair", "2x copy_", "eager"), 0.6),
    (
        "block offsets vs torch (anchor form)",
        ("offsets 256x2048x2", "kvforge", "eager"),
        ("offsets 256x2048x2", "torch per pool/plane", "eager"),
        0.05,
    ),
    (
        "block offsets vs empty launch",
        ("offsets 256x2048x2", "kvforge", "eager"),
        ("offsets 256x2048x2", "empty kernel", "eager"),
        2.0,
    ),
]

# Reported beside the targets, without a bound: what moving the same bytes costs the device's own copy, so a
# ratio against the empty launch can be read against the hardware's; and block offsets against the torch code in
# a CUDA graph, where both sides are GPU time only (the eager torch figure moves with the host's launch speed).
INFO = [
    (
        "d2d copy of the same bytes vs empty launch",
        ("offsets 256x2048x2", "d2d copy (same bytes)", "eager"),
        ("offsets 256x2048x2", "empty kernel", "eager"),
    ),
    (
        "block offsets vs torch per pool/plane (graph)",
        ("offsets 256x2048x2", "kvforge", "graph"),
        ("offsets 256x2048x2", "torch per pool/plane", "graph"),
    ),
    (
        "block offsets vs d2d copy of the same bytes",
        ("offsets 256x2048x2", "kvforge", "eager"),
        ("offsets 256x2048x2", "d2d copy (same bytes)", "eager"),
    ),
]


ROLES = {
    "kvforge": "kvforge",
    "kvforge (pinned table)": "kvforge, pinned host table",
    "empty kernel": "empty Triton kernel",
    "4x index_copy_": "torch peer",
    "torch index_select": "torch peer",
    "2x copy_": "torch peer",
    "torch per pool/plane": "torch peer",
    "d2d copy (same bytes)": "device copy, same bytes",
    "torch vectorised": "torch, vectorised",
}


class Bench:
    def __init__(self, quick: bool, dev: torch.device) -> None:
        self.rep = 30 if quick else 200
        self.samples = 200 if quick else 1000
        self.rows: list[dict[str, Any]] = []
        self.times: dict[tuple[str, str, str], float] = {}
        x = torch.empty(1, device=dev)
        self.floor = lambda: _empty_kernel[(1,)](x)

    def eager(
        self,
        workload: str,
        fns: dict[str, Callable[[], Any]],
        nbytes: int = 0,
        alone: dict[str, Callable[[], Any]] | None = None,
    ) -> None:
        """Time ``fns`` and the empty kernel sample by sample in turn, each call behind its own L2 flush; then
        each of ``alone`` in a do_bench run of its own.

        A call of a few microseconds is timed below the CUDA events' ~0.5 us resolution, and the empty kernel
        timed in a run of its own read 3.33, 3.90 and 4.06 us on three machine starts while the ops divided by
        it moved by 0.2 us. Interleaved, every provider and the floor see the same clocks and moment of the run
        (``time_interleaved``); the time reported and compared is the 5%-trimmed mean of the samples (the grid's
        rounding averages out), with the median and p20/p80 in the row.

        ``alone``: torch peers whose host time per call (100-300 us: a dozen launches) exceeds the flush. In
        the interleaved loop they would leave the GPU idle while the host catches up, and the calls after them
        would start from an idle GPU; they are timed as the anchors timed them, one do_bench run each. Their
        eager figure is host time less what the flush hides, so it moves with the host's speed.
        """
        for fn in (*fns.values(), *(alone or {}).values()):
            fn()
        torch.cuda.synchronize()
        stats = time_interleaved({"empty kernel": self.floor, **fns}, samples=self.samples)
        for provider, fn in (alone or {}).items():
            stats[provider] = time_gpu(fn, warmup=25, rep=self.rep)
        every = {**fns, **(alone or {})}
        for provider, st in stats.items():
            t = {"ms": st["ms_mean"], "ms_median": st["ms"], "ms_p20": st["ms_p20"], "ms_p80": st["ms_p80"]}
            self._row(workload, provider, "eager", t, st["n"], every.get(provider, self.floor), nbytes)

    def graph(self, workload: str, fns: dict[str, Callable[[], Any]], nbytes: int = 0) -> None:
        for provider, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            self._row(workload, provider, "graph", time_graph(fn, rep=self.rep), 0, None, nbytes)

    def _row(self, workload: str, provider: str, mode: str, t: dict, n: int, loop_fn: Any, nbytes: int) -> None:
        row: dict[str, Any] = {"workload": workload, "provider": provider, "mode": mode, **t, "us": t["ms"] * 1e3}
        if n:
            row["samples"] = n
        if nbytes and provider != "empty kernel":
            row["bytes"] = nbytes
            row["gbps"] = nbytes / (t["ms"] * 1e-3) / 1e9
        if loop_fn is not None:
            # The flush before each timed call hides up to its duration of host time. A serving loop calls the
            # op back to back on the same tensors: time that too.
            row["us_loop"] = _loop_us(loop_fn, self.rep)
        self.rows.append(row)
        self.times[(workload, provider, mode)] = t["ms"]
        extra = f"  {row['gbps']:8.1f} GB/s" if "gbps" in row else ""
        extra += f"  (median {row['ms_median'] * 1e3:6.2f})" if "ms_median" in row else ""
        extra += f"  (back-to-back {row['us_loop']:8.2f} us/call)" if "us_loop" in row else ""
        print(f"{workload:22s} {provider:28s} {mode:6s} {row['us']:9.2f} us{extra}", flush=True)


def _loop_us(fn: Callable[[], Any], rep_ms: int) -> float:
    """Median over 5 rounds of (wall time of n back-to-back calls + one synchronize) / n, in us."""
    import time

    n = max(50, rep_ms * 5)
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(rounds)[2]


def _check(what: str, ok: bool) -> None:
    if not ok:
        raise ReferenceMismatch(f"{what}: output differs from the reference; not timing it")


def bench_slots(b: Bench, dev: torch.device) -> None:
    from kvforge.kernels.slot_ops import SlotStores, slot_scatter, slot_scatter_ref, step_gather, step_gather_ref

    slots, n, w = 1024, 256, 8
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randint(1, 32000, shape, generator=g, dtype=torch.int32).to(dev)
    new, nxt, drafts = r(n, w), r(n, w), r(n, w)
    counts = torch.randint(1, w + 1, (n,), generator=g, dtype=torch.int32).to(dev)
    ids = torch.randperm(slots, generator=g)[:n].to(dev)
    stores = SlotStores.zeros(slots, w, w, w, dev)
    want = slot_scatter_ref(stores, ids, new, nxt, counts, drafts)
    slot_scatter(stores, ids, new, nxt, counts, drafts)
    _check("slot_scatter", all(torch.equal(a.long(), e.long()) for a, e in zip(stores.tensors(), want.tensors())))

    # The peer: four index_copy_ of inputs already masked and laid out like the stores (the masking and the
    # transposes are left outside its timing, which favours torch).
    peer = SlotStores.zeros(slots, w, w, w, dev)
    cols = torch.arange(w, device=dev)
    new_t = torch.where(cols[None, :] < counts[:, None], new, 0).t().contiguous()
    nxt_t = nxt.t().contiguous()
    ids64 = ids.long()

    def four() -> None:
        peer.new_tokens.index_copy_(1, ids64, new_t)
        peer.next_new_tokens.index_copy_(1, ids64, nxt_t)
        peer.new_token_counts.index_copy_(0, ids64, counts)
        peer.next_draft_tokens.index_copy_(0, ids64, drafts)

    four()
    _check("4x index_copy_", all(torch.equal(a.long(), e.long()) for a, e in zip(peer.tensors(), want.tensors())))
    ours = lambda: slot_scatter(stores, ids, new, nxt, counts, drafts)
    b.eager("scatter", {"kvforge": ours, "4x index_copy_": four})
    b.graph("scatter", {"kvforge": ours, "4x index_copy_": four})

    t = 4
    out = step_gather(stores, ids, t)
    _check("step_gather", all(torch.equal(a.long(), e.long()) for a, e in zip(out, step_gather_ref(stores, ids, t))))
    ids_out, pos_out, draft_out, kv_out = (torch.empty_like(x) for x in out)

    def torch_gather() -> None:
        ids_out.copy_(stores.next_new_tokens[:t].index_select(1, ids64).t().reshape(-1))
        off = stores.new_token_counts.index_select(0, ids64) - t
        pos_out.copy_(off.repeat_interleave(t))
        draft_out.copy_(stores.next_draft_tokens.index_select(0, ids64)[:, : t - 1])
        kv_out.copy_(off)

    torch_gather()
    _check("torch gather", all(torch.equal(a, e) for a, e in zip((ids_out, pos_out, draft_out, kv_out), out)))
    gather = lambda: step_gather(stores, ids, t, out=out)
    b.eager("gather", {"kvforge": gather}, alone={"torch index_select": torch_gather})
    b.graph("gather", {"kvforge": gather, "torch index_select": torch_gather})


def bench_pinned_pair(b: Bench, dev: torch.device) -> None:
    from kvforge.kernels.pinned_pair import copy_small_pinned_pair

    g = torch.Generator().manual_seed(1)
    ha = torch.randint(0, 1 << 20, (512,), generator=g, dtype=torch.int32).pin_memory()
    hb = torch.randint(0, 2, (512,), generator=g).bool().pin_memory()
    da, db = torch.empty(512, dtype=torch.int32, device=dev), torch.empty(512, dtype=torch.bool, device=dev)
    _check("copy_small_pinned_pair took the kernel path", copy_small_pinned_pair(ha, hb, da, db))
    torch.cuda.synchronize()
    _check("copy_small_pinned_pair", torch.equal(da.cpu(), ha) and torch.equal(db.cpu(), hb))
    pa, pb = torch.empty_like(da), torch.empty_like(db)

    def two() -> None:
        pa.copy_(ha, non_blocking=True)
        pb.copy_(hb, non_blocking=True)

    two()
    torch.cuda.synchronize()
    _check("2x copy_", torch.equal(pa.cpu(), ha) and torch.equal(pb.cpu(), hb))
    b.eager("pinned pair", {"kvforge": lambda: copy_small_pinned_pair(ha, hb, da, db), "2x copy_": two})


def bench_block_offsets(b: Bench, dev: torch.device) -> None:
    from kvforge.kernels.block_offsets import copy_block_offsets, copy_block_offsets_ref

    g = torch.Generator().manual_seed(2)
    pools, capacity, blocks, n = 2, 1024, 2048, 256
    table = torch.randint(-1, 1 << 20, (pools, capacity, blocks), generator=g, dtype=torch.int32)
    pinned = table.pin_memory()
    table = table.to(dev)
    idx = torch.randperm(capacity, generator=g)[:n].to(dev)
    scales = torch.tensor([2, 4], dtype=torch.int32, device=dev)
    kv_off = torch.tensor([0, 1 << 20], dtype=torch.int32, device=dev)
    out = torch.zeros(pools, n, 2, blocks, dtype=torch.int32, device=dev)
    want = copy_block_offsets_ref(table, idx, scales, kv_off, out)
    wl = "offsets 256x2048x2"
    for name, src in (("kvforge", table), ("kvforge (pinned table)", pinned)):
        out.zero_()
        copy_block_offsets(src, idx, scales, kv_off, out)
        _check(f"copy_block_offsets ({name})", torch.equal(out, want))
    peer = torch.zeros_like(out)
    idx64 = idx.long()

    def torch_loop() -> None:
        # The anchor's form: one where per pool and plane.
        sel = table.index_select(1, idx64)
        valid = sel >= 0
        for p in range(pools):
            base = sel[p] * scales[p]
            peer[p, :, 0] = torch.where(valid[p], base, 0)
            peer[p, :, 1] = torch.where(valid[p], base + kv_off[p], 0)

    def torch_vec() -> None:
        sel = table.index_select(1, idx64)
        valid = sel >= 0
        p0 = torch.where(valid, sel * scales.view(-1, 1, 1), 0)
        peer[:, :, 0] = p0
        peer[:, :, 1] = torch.where(valid, p0 + kv_off.view(-1, 1, 1), 0)

    for name, fn in (("torch per pool/plane", torch_loop), ("torch vectorised", torch_vec)):
        peer.zero_()
        fn()
        _check(name, torch.equal(peer, want))
    nbytes = pools * n * blocks * 4 * 3
    # The device's own copy of the same bytes (half read, half written): what moving them costs the hardware.
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ours = lambda: copy_block_offsets(table, idx, scales, kv_off, out)
    fns = {
        "kvforge": ours,
        "kvforge (pinned table)": lambda: copy_block_offsets(pinned, idx, scales, kv_off, out),
        "d2d copy (same bytes)": lambda: dst.copy_(src),
    }
    b.eager(wl, fns, nbytes, alone={"torch per pool/plane": torch_loop, "torch vectorised": torch_vec})
    # In a graph every provider is GPU time only: the torch peers' figures no longer depend on the host.
    graphed = {"kvforge": ours, "d2d copy (same bytes)": lambda: dst.copy_(src), "torch per pool/plane": torch_loop}
    b.graph(wl, {**graphed, "torch vectorised": torch_vec}, nbytes)


def bench_block_offsets_bandwidth(b: Bench, dev: torch.device) -> None:
    from kvforge.kernels.block_offsets import copy_block_offsets, copy_block_offsets_ref

    g = torch.Generator(device=dev).manual_seed(3)
    pools, n, blocks = 2, 64, 262144
    table = torch.randint(-1, 1 << 20, (pools, n, blocks), generator=g, device=dev, dtype=torch.int32)
    idx = torch.randperm(n, generator=g, device=dev)
    out = torch.zeros(pools, n, 2, blocks, dtype=torch.int32, device=dev)
    want = copy_block_offsets_ref(table, idx, [2, 4], [0, 1 << 20], out)
    copy_block_offsets(table, idx, [2, 4], [0, 1 << 20], out)
    _check("copy_block_offsets 64x262144", torch.equal(out, want))
    del want
    nbytes = pools * n * blocks * 4 * 3  # read the rows once, write two planes
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    wl = "offsets 64x262144x2"
    ours = lambda: copy_block_offsets(table, idx, [2, 4], [0, 1 << 20], out)
    b.eager(wl, {"kvforge": ours, "d2d copy (same bytes)": lambda: dst.copy_(src)}, nbytes)


def bench_floor(b: Bench, dev: torch.device) -> None:
    # Eager, the floor is timed within every workload's interleaved group (Bench.eager); a graph replay here.
    b.graph("launch floor", {"empty kernel": b.floor})


def ratio_rows(times: dict[tuple[str, str, str], float]) -> list[dict[str, Any]]:
    rows = []
    for name, num, den, bound in TARGETS:
        if num in times and den in times:
            rows.append({"target": name, "ratio": times[num] / times[den], "bound": bound, "op": "<="})
    bw = ("offsets 64x262144x2", "kvforge", "eager"), ("offsets 64x262144x2", "d2d copy (same bytes)", "eager")
    if all(k in times for k in bw):
        # Same bytes on both sides, so the bandwidth fraction is the inverse time ratio.
        rows.append(
            {
                "target": "64x262144 bandwidth vs d2d copy",
                "ratio": times[bw[1]] / times[bw[0]],
                "bound": 0.6,
                "op": ">=",
            }
        )
    for r in rows:
        r["met"] = r["ratio"] <= r["bound"] if r["op"] == "<=" else r["ratio"] >= r["bound"]
    for name, num, den in INFO:
        if num in times and den in times:
            rows.append({"target": name, "ratio": times[num] / times[den], "bound": None, "op": "", "met": None})
    return rows


def report(b: Bench, stamp: dict[str, str], out: Path) -> tuple[Path, Path]:
    """Print the target table, append the CSV rows, draw the PNG."""
    ratios = ratio_rows(b.times)
    print(f"\n{'target':44s} {'ratio':>8s}  bound   result")
    for r in ratios:
        if r["bound"] is None:
            print(f"{r['target']:44s} {r['ratio']:8.3f}           (for reading)")
            continue
        verdict = "met" if r["met"] else "MISSED"
        print(f"{r['target']:44s} {r['ratio']:8.3f}  {r['op']} {r['bound']:<5g} {verdict}")
    csv_rows = [{"kind": "time", **r} for r in b.rows]
    csv_rows += [
        {
            "kind": "ratio",
            "workload": r["target"],
            "ratio": r["ratio"],
            "bound": "" if r["bound"] is None else f"{r['op']}{r['bound']}",
            "met": "" if r["met"] is None else r["met"],
        }
        for r in ratios
    ]
    path = append_csv("small_copies", csv_rows)

    png = plot(b.rows, stamp, out / "small_copies.png")
    return path, png


def plot(rows: list[dict[str, Any]], stamp: dict[str, str], path: Path) -> Path:
    """One bar per role (kvforge, the torch peer, ...) so each group shows only what it measured."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    peers: dict[str, str] = {}
    for role in ("device copy, same bytes", "torch peer"):  # a torch peer names the group when there is one
        peers.update({r["workload"]: r["provider"] for r in rows if ROLES.get(r["provider"]) == role})
    groups = [f"{w}\nvs {peers[w]}" if w in peers else w for w in workloads]
    series: dict[str, list[float]] = {}
    for r in rows:
        label = f"{ROLES.get(r['provider'], r['provider'])} ({r['mode']})"
        series.setdefault(label, [math.nan] * len(groups))[workloads.index(r["workload"])] = float(r["us"])
    return bar_plot(
        path,
        f"Small copies, {stamp['gpu']} (torch {stamp['torch']}, triton {stamp['triton']}): us, lower is better",
        groups,
        dict(sorted(series.items())),
        "us per call (eager: trimmed mean; graph: per replay)",
        log=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder for the CSV, PNG and configs")
    parser.add_argument("--replot", metavar="REV", help="redraw the PNG from DIR/small_copies.csv rows of REV (no GPU)")
    args = parser.parse_args(argv)
    if args.replot:
        import csv

        with (args.out / "small_copies.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r["git_rev"] == args.replot and r["kind"] == "time"]
        if not rows:
            print(f"no rows of revision {args.replot} in {args.out / 'small_copies.csv'}", file=sys.stderr)
            return 2
        print(f"wrote {plot(rows, rows[0], args.out / 'small_copies.png')}")
        return 0
    if not torch.cuda.is_available():
        print("bench_small_copies needs a CUDA GPU", file=sys.stderr)
        return 2
    import kvforge.kernels  # noqa: F401
    from kvforge.kernels import export_tuned

    # append_csv writes under _common.RESULTS; point it at --out for this run.
    _common.RESULTS = args.out
    dev = torch.device("cuda", torch.cuda.current_device())
    stamp = env_stamp()
    print(" ".join(f"{k}={v}" for k, v in stamp.items()), flush=True)
    b = Bench(args.quick, dev)
    for section in (bench_floor, bench_slots, bench_pinned_pair, bench_block_offsets, bench_block_offsets_bandwidth):
        section(b, dev)

    path, png = report(b, stamp, args.out)
    export_tuned(args.out / "tuned")
    print(f"\nwrote {path}, {png} and {args.out / 'tuned'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
