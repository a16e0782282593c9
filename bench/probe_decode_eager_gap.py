"""Why MLA decode is slower timed eagerly behind an L2 flush than replayed from a CUDA graph (issue 28).

The grid bench (``bench_mla_decode_grid.py``) times each call behind a 256 MB flush with CUDA events, five
providers interleaved; on small workloads kvforge's default call reads up to 75 µs above its graph replay
where FlashInfer reads 5-16 µs above its own. This probe separates the candidate causes on the grid's small rows
(``--grid`` seed 0 and ``--random 12 --seed 7`` workloads with batch <= 16 and batch x longest <= 40k keys).
Per workload, each provider is first checked against ``mla_decode_attention_ref`` (fp32, the grid bench's
check: every element written and finite, relative RMSE < 1e-2) and is not timed if it fails. Providers:
kvforge's default call (``default``, plan cache as in serving), ``MLADecodePlan.run`` with the shipped planner
(``planned``), with one share per request (``splits1``: no partials, no merge), with shares of at least 512
keys (``share512``) and with the byte rule proposed for large head counts (``bytes``: shares of at least as
many key bytes as their fp32 partial output, rounded up to a power of two; only where it differs from
``planned``), and FlashInfer fa3 (its ``plan`` outside the timing). Timings, median ms over samples:

- ``warm_hidden``: back-to-back calls without flush, the GPU held by ``torch.cuda._sleep`` while the host
  enqueues them all (per call: the kernels and their launch gaps, warm L2); ``warm_exposed``: the same after
  a synchronize (the host's enqueue rate can limit).
- ``cold_hidden``: each call behind the 256 MB write flush, the whole batch enqueued behind a sleep (the
  host is hidden: ``hidden`` says whether the GPU was still behind the host when the last sample was queued);
  ``cold_read_hidden``: the same behind a 256 MB read (no dirty lines left in L2); ``cold_sync``: a
  synchronize before each flush (the host fully exposed); ``cold_bench``: the grid bench's loop for this call
  alone; ``cold_interleaved``: ``bench._common.time_interleaved`` over all providers (the grid bench itself).
- ``graph``: ``do_bench_cudagraph`` as the grid bench.
- profiler (CUPTI, ``default`` and FlashInfer, cold with and without the sleep): the kernels' summed duration
  per call, the span from the first kernel's start to the last's end, and the idle time from the flush's end
  to the first kernel (host lag), medians in µs.

    PYTHONPATH=$PWD:$PWD/.flashinfer python3 bench/probe_decode_eager_gap.py --out $OUT/gap   # H200, sized for 3 min
    python3 bench/probe_decode_eager_gap.py --plan-only       # CPU: the planner's shares per workload

Writes ``<out>/decode_eager_gap.csv`` (one row per workload and provider, environment stamped) and
``<out>/decode_eager_gap.log``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--plan-only" in sys.argv[1:]:  # the planner on the CPU, as on an sm_90 with 132 SMs (launches stubbed)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_mla_decode_grid import DR, DV, build, check, draw, flashinfer_runner

FLUSH_MB = 256


def small_workloads() -> list[tuple[str, dict]]:
    """The grid's and random12 seed 7's small rows: batch <= 16 and batch x longest length <= 40k keys."""
    out = []
    for tag, ws in (("grid", draw(24, 0, True)), ("random12_seed7", draw(12, 7, False))):
        for i, w in enumerate(ws):
            if w["B"] <= 16 and w["B"] * max(w["lens"]) <= 40_000:
                out.append((f"{tag}#{i}", w))
    return out


def bytes_rule_tokens(heads: int, v_head_dim: int = DV, d_qk: int = DV + DR, elt: int = 2) -> int:
    """The proposed share floor: a share reads at least as many key bytes as the fp32 partial it writes
    (``heads * v_head_dim * 4`` bytes), rounded up to a power of two, never below the shipped 128."""
    need = -(-heads * v_head_dim * 4 // (d_qk * elt))
    return max(128, 1 << max(0, need - 1).bit_length())


def share_table(md, w: dict, num_splits: int | None = None, dv: int = DV, dr: int = DR,
                dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """The shipped planner's launch for workload ``w`` (``md`` patched as sm_90 on the CPU, the interpreter, or a
    real GPU): programs per request, the share grid S, shares per request (``_request_share``'s arithmetic on the
    host; ``tests/test_probe_decode_eager_gap.py`` holds it to the kernel's count), keys per share, programs
    doing work, partial bytes written (and read back by the merge), key bytes."""
    H, B, page, lens = w["H"], w["B"], w["page"], w["lens"]
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    n_pages = [max(1, -(-n // page)) for n in lens]
    q = torch.zeros(B, H, dv + dr, dtype=dtype, device=dev)
    kv = torch.zeros(sum(n_pages) + 8, page, dv + dr, dtype=dtype, device=dev)
    bt = torch.zeros(B, max(n_pages), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.04, v_head_dim=dv, num_splits=num_splits)._plan
    hp, _, S = plan.grid
    _, _, _, min_tiles, slots = plan.rt[:5]
    bn = plan.gluon[0] if plan.gluon else int(plan.cfg.kwargs["BLOCK_N"])
    tiles = [-(-n // bn) for n in lens]
    shares = md.share_counts_ref(tiles, S, slots, hp, min_tiles, plan.balance)
    per = [-(-t // n) for t, n in zip(tiles, shares)]
    kernel = f"gluon bn{bn} x{plan.gluon[1]}" if plan.gluon else f"triton bh{plan.cfg.kwargs['BLOCK_H']} bn{bn}"
    return {"kernel": kernel, "head_progs": hp, "S": S, "slots": slots, "min_tiles": min_tiles,
            "per_request": shares, "shares": (min(shares), max(shares)),
            "share_tokens": (min(per) * bn, max(per) * bn), "ctas_working": hp * sum(shares),
            "ctas_launched": hp * B * S, "partial_bytes": sum(n * H * (dv + 1) * 4 for n in shares if n > 1),
            "kv_bytes": sum(lens) * (dv + dr) * kv.element_size(),
            "merge_programs": B * H * (dv // min(md.MERGE_BLOCK_D, dv)) if plan.merge else 0}  # fmt: skip


def plan_only() -> None:
    from bench.probe_decode_host_cost import patch_as_sm90

    patch_as_sm90()
    from kvforge.kernels import mla_decode as md

    print("shipped planner as on an sm_90 with 132 SMs; shares from _request_share's arithmetic on the host")
    for name, w in small_workloads():
        t = share_table(md, w)
        alt = bytes_rule_tokens(w["H"])
        note = ""
        if alt != md.MIN_SHARE_TOKENS:
            old = md.MIN_SHARE_TOKENS
            md.MIN_SHARE_TOKENS = alt
            try:
                a = share_table(md, w)
            finally:
                md.MIN_SHARE_TOKENS = old
            note = (f" | bytes rule ({alt} keys): S={a['S']} shares {a['shares'][0]}-{a['shares'][1]}, "
                    f"partials {a['partial_bytes'] / 1e6:.2f} MB")  # fmt: skip
        print(f"{name:18} {w['name']:34} {t['kernel']:16} progs/req {t['head_progs']} S {t['S']:3d} shares "
              f"{t['shares'][0]}-{t['shares'][1]} of {t['share_tokens'][0]}-{t['share_tokens'][1]} keys, CTAs "
              f"{t['ctas_working']}/{t['ctas_launched']}, partials {t['partial_bytes'] / 1e6:.2f} MB vs keys "
              f"{t['kv_bytes'] / 1e6:.2f} MB, merge programs {t['merge_programs']}{note}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- GPU


def _cycles_per_ms() -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    torch.cuda._sleep(2_000_000)
    e.record()
    torch.cuda.synchronize()
    return 2_000_000 / s.elapsed_time(e)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Timer:
    """The timing modes of the module docstring for one call ``fn``."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.flush = torch.empty(FLUSH_MB << 18, dtype=torch.int32, device="cuda")
        self.cpm = _cycles_per_ms()
        self.host_ms = 0.2  # per sample, refined by each batch's own enqueue time

    def _sleep_for(self, n: int) -> None:
        torch.cuda._sleep(int(self.cpm * (2.0 * n * self.host_ms + 1.0)))

    def warm(self, fn: Callable[[], object], hidden: bool) -> float:
        n = self.samples
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if hidden:
            self._sleep_for(n)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n

    def cold(self, fn: Callable[[], object], mode: str) -> tuple[float, bool]:
        """mode: hidden, read_hidden, sync, bench. Returns (median ms, whether the GPU was still behind the host
        when the last sample was enqueued)."""
        n = self.samples
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        if mode in ("hidden", "read_hidden"):
            self._sleep_for(n)
        t0 = time.perf_counter()
        for s, e in ev:
            if mode == "sync":
                torch.cuda.synchronize()
            if mode == "read_hidden":
                self.flush.sum(dtype=torch.int64)
            else:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        behind = not ev[-1][0].query()
        self.host_ms = max(self.host_ms, (time.perf_counter() - t0) * 1e3 / n)
        torch.cuda.synchronize()
        return _median([s.elapsed_time(e) for s, e in ev]), behind

    def profile(self, fn: Callable[[], object], hidden: bool) -> dict[str, float]:
        """CUPTI kernel records of ``samples`` flushed calls: medians (µs) of the summed kernel time per call, the
        span first start -> last end, and the idle time from the flush kernel's end to the call's first kernel."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        n = min(self.samples, 20)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if hidden:
                self._sleep_for(n)
            for _ in range(n):
                self.flush.zero_()
                fn()
            torch.cuda.synchronize()
        # Kernels in start order; the sleep kernel comes before the first flush and belongs to no sample.
        ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == DeviceType.CUDA)  # fmt: skip
        calls: list[list[tuple[float, float, str]]] = []
        flush_end = []
        for k in ks:
            if "fill" in k[2].lower() or "memset" in k[2].lower():  # the flush (zero_) opens a sample
                flush_end.append(k[1])
                calls.append([])
            elif calls:
                calls[-1].append(k)
        calls_ok = [(f, c) for f, c in zip(flush_end, calls) if c]
        if not calls_ok:
            names = sorted({k[2][:60] for k in ks})[:6]
            raise RuntimeError(f"no flush-then-kernel records among {len(ks)} device records ({names})")
        return {
            "kernels_us": _median([sum(b - a for a, b, _ in c) for _, c in calls_ok]),
            "span_us": _median([c[-1][1] - c[0][0] for _, c in calls_ok]),
            "lead_gap_us": _median([c[0][0] - f for f, c in calls_ok]),
            "kernels_per_call": _median([len(c) for _, c in calls_ok]),
        }


def run_workload(name: str, w: dict, seed: int, timer: Timer, use_fi: bool, log) -> list[dict]:
    from bench._common import time_graph, time_interleaved
    from kvforge.kernels import mla_decode as md

    q, kv, bt, sl, indptr, indices = build(w, seed)
    scale = 1.0 / math.sqrt(DV + DR)
    B, H = q.shape[:2]
    flags = md.decode_error_flags(q.device)
    flags.zero_()
    providers: dict[str, tuple[Callable[[], object], torch.Tensor]] = {}
    notes: dict[str, str] = {}

    out_d = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
    providers["default"] = (lambda: md.mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=out_d), out_d)

    def planned(label: str, min_share: int | None = None, num_splits: int | None = None) -> None:
        old = md.MIN_SHARE_TOKENS
        if min_share is not None:
            md.MIN_SHARE_TOKENS = min_share
        try:
            plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=scale, num_splits=num_splits)
            t = share_table(md, w, num_splits)
        finally:
            md.MIN_SHARE_TOKENS = old
        o = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        providers[label] = (lambda: plan.run(q, kv, out=o), o)
        notes[label] = f"S={t['S']} shares={t['shares'][0]}-{t['shares'][1]} partial_MB={t['partial_bytes'] / 1e6:.2f}"

    planned("planned")
    notes["default"] = notes["planned"]  # the same planner, through the plan cache
    planned("splits1", num_splits=1)
    planned("share512", min_share=512)
    if bytes_rule_tokens(H) != md.MIN_SHARE_TOKENS:
        planned("bytes", min_share=bytes_rule_tokens(H))
    if use_fi:
        try:
            run_fi, fi_out = flashinfer_runner(q, kv, sl, indptr, indices, H, w["page"], scale)
            providers["flashinfer"] = (run_fi, fi_out)
        except Exception as exc:  # reported; the kvforge rows stand on their own
            log(f"  flashinfer unavailable: {type(exc).__name__}: {str(exc)[:200]}")
    checked: dict[str, Callable[[], object]] = {}
    rows = []
    for label, (fn, o) in providers.items():
        o.fill_(float("nan"))
        try:
            fn()
            rmse = check(label, o, q, kv, bt, sl, scale)
            if int(flags.sum()):
                raise RuntimeError(f"error flags {flags.tolist()} on a valid table")
        except Exception as exc:  # refuse to time a provider whose output is wrong
            log(f"  {label}: FAILED reference check, not timed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        checked[label] = fn
        rows.append({"workload": w["name"], "id": name, "heads": H, "batch": B, "page": w["page"],
                     "max_len": max(w["lens"]), "provider": label, "rmse": rmse,
                     "plan": notes.get(label, "")})  # fmt: skip
    inter = time_interleaved(checked, samples=timer.samples, warmup=5, flush_mb=FLUSH_MB)
    for row in rows:
        fn = checked[row["provider"]]
        row["warm_hidden_ms"] = timer.warm(fn, True)
        row["warm_exposed_ms"] = timer.warm(fn, False)
        for mode in ("hidden", "read_hidden", "sync", "bench"):
            row[f"cold_{mode}_ms"], behind = timer.cold(fn, mode)
            if mode == "hidden":
                row["hidden"] = behind
        row["cold_interleaved_ms"] = inter[row["provider"]]["ms"]
        row["graph_ms"] = time_graph(fn, rep=20)["ms"]
        if row["provider"] in ("default", "flashinfer"):
            for hidden in (True, False):
                try:
                    p = timer.profile(fn, hidden)
                except Exception as exc:  # the profiler is a diagnostic: its failure leaves the timings
                    log(f"  profiler failed: {type(exc).__name__}: {str(exc)[:200]}")
                    break
                tag = "hidden" if hidden else "bench"
                row.update({f"prof_{tag}_{k}": v for k, v in p.items()})
    for label, (_, o) in providers.items():  # the timed calls' last outputs are checked too
        if label in checked:
            check(f"{label} (timed)", o, q, kv, bt, sl, scale)
    if int(flags.sum()):
        raise RuntimeError(f"kvforge: error flags {flags.tolist()} on a valid table")
    return rows


def describe(name: str, w: dict, r: dict) -> str:
    """One log line: the timings of one provider on one workload, in µs."""

    def us(key: str) -> str:
        return f"{r[key] * 1e3:6.1f}"

    line = (f"{name:18} {w['name']:34} {r['provider']:10} warm {us('warm_hidden_ms')}/{us('warm_exposed_ms')} | "
            f"cold hidden {us('cold_hidden_ms')} (behind {r['hidden']}) read {us('cold_read_hidden_ms')} sync "
            f"{us('cold_sync_ms')} bench {us('cold_bench_ms')} interleaved {us('cold_interleaved_ms')} | graph "
            f"{us('graph_ms')} us | {r['plan']}")  # fmt: skip
    for t in ("hidden", "bench"):
        if f"prof_{t}_span_us" in r:
            k, sp, gap, n = (r[f"prof_{t}_{x}"] for x in ("kernels_us", "span_us", "lead_gap_us", "kernels_per_call"))
            line += f" | prof {t}: kernels {k:.1f} span {sp:.1f} lead gap {gap:.1f} us ({n:.0f} kernels)"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--plan-only", action="store_true", help="CPU: the shipped planner's shares, nothing timed")
    ap.add_argument("--out", type=Path, default=None, help="folder for decode_eager_gap.csv and .log")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--only", type=str, default="", help="substring of workload ids/names (e.g. 'grid#5')")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no workload after this many seconds")
    args = ap.parse_args()
    if args.plan_only:
        plan_only()
        return
    if args.out is None:
        ap.error("--out is required for the GPU run")
    if not 5 <= args.samples <= 1000:
        ap.error(f"--samples: expected 5..1000, got {args.samples}")
    import csv

    from bench._common import env_stamp

    args.out.mkdir(parents=True, exist_ok=True)
    logf = (args.out / "decode_eager_gap.log").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    stamp = env_stamp()
    log(f"# probe_decode_eager_gap {stamp}, load average {os.getloadavg()}, samples {args.samples}")
    timer = Timer(args.samples)
    work = [(n, w) for n, w in small_workloads() if args.only in n or args.only in w["name"]]
    rows: list[dict] = []
    t_all = time.perf_counter()
    for name, w in work:
        t0 = time.perf_counter()
        if t0 - t_all > args.budget_s:
            log(f"{name} {w['name']}: skipped (--budget-s {args.budget_s:g} spent)")
            continue
        try:
            got = run_workload(name, w, int(name.split("#")[1]), timer, not args.no_flashinfer, log)
        except Exception as exc:  # reported; nothing of a failed workload is written
            log(f"{name} {w['name']}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        finally:
            torch.cuda.empty_cache()
        for r in got:
            log(describe(name, w, r))
        rows += got
        log(f"  ({time.perf_counter() - t0:.1f}s)")
        # Rewritten after each workload: a run stopped by its time limit keeps what it measured.
        fields: list[str] = list(stamp)
        for r in rows:
            fields += [k for k in r if k not in fields]
        with (args.out / "decode_eager_gap.csv").open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=fields)
            wr.writeheader()
            wr.writerows({**stamp, **r} for r in rows)
    log(f"# done in {time.perf_counter() - t_all:.1f}s, load average {os.getloadavg()}")
    logf.close()


if __name__ == "__main__":
    main()
