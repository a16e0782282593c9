"""How ``kvforge router --workers N`` scales with cores, on a host with enough of them (issue 31's target: two
workers carry >= 1.6x one worker's error-free rate at p50 added latency <= 2 ms, stickiness 100% across workers).

    python bench/bench_router_workers.py [--workers 1,2,4] [--rates 500,1000,...] [--window-s 3] [--out DIR]

Every process gets cores of its own (``os.sched_setaffinity``, out of the cores this process may use): the
router (its supervisor and N workers) the first ``max(--workers)`` cores (N of them while N workers run), then
``--backends`` fake backends (``kvforge.service.testing.FakeBackend``, one process and one core each,
``--tokens`` streamed tokens at ``--tokens-per-s``), then ``--loadgens`` load generators one core each; this
orchestrator takes what is left. ``--share-cores`` pins nothing (a small machine, to check that it runs: its
figures then measure the machine's contention, not the router's scaling).

Load: seeded open-loop Poisson arrivals of multi-turn conversations (``X-Conversation-Id``; each turn's prompt
extends the conversation's), each load generator an independent stream of ``rate / loadgens`` requests/s over
``--sessions`` client sessions, a request's session picked by its index, so that the turns of one conversation
travel over different connections and thus, as the kernel spreads connections over the workers
(``SO_REUSEPORT``), through different workers. First the backends alone ("direct", the client routing each
conversation to one backend) at every rate, until the harness itself stops keeping up; then each worker count
in turn at rising rates, until the first rate it misses. A rate is carried when no request failed and the
requests completed at >= 95% of the offered rate; added latency is a percentile through the router minus the
same percentile direct at that rate. Per worker count: the highest rate carried ("error-free max") and the
highest carried with p50 added time to first chunk <= 2 ms, each against one worker's; router CPU per request
(its whole process tree) and each worker's share of it; stickiness (share of conversations whose turns all met
one backend) and the busiest backend's share.

Writes ``router_workers.csv`` (a row per target and rate, then a summary row per worker count),
``router_workers.png`` and ``router_workers_summary.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._net import free_port, wait_port

ROOT = Path(__file__).resolve().parents[1]
SERVICE_BENCH = ROOT / "bench" / "bench_router_service.py"


# ---------------------------------------------------------------- load generator (a child process)


async def _loadgen(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    from bench.bench_router_service import _conversation_workload, _one_conv

    offsets, reqs = _conversation_workload(
        spec["rate"], spec["seconds"], spec["seed"], spec["prompt_chars"], spec["turn_chars"], spec["tokens"]
    )
    targets = spec["targets"]
    out: list[Any] = []
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30))
        for _ in range(spec["sessions"])
    ]
    try:
        t0 = spec["start_at"] - time.time() + time.perf_counter()  # the orchestrator's common start
        tasks = []
        for i, (off, (c, body)) in enumerate(zip(offsets, reqs)):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = targets[c % len(targets)]
            s = sessions[i % len(sessions)]
            tasks.append(asyncio.create_task(_one_conv(s, url, f"{spec['tag']}-{c}", body, out, off, t0)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        for s in sessions:
            await s.close()
    # (each row: time to first chunk, total, ok, backend, conversation, lag behind its scheduled start)
    return {"rows": [list(r) for r in out], "wall": wall}


def _run_loadgen(spec_json: str) -> int:
    spec = json.loads(spec_json)
    sys.stdout.write(json.dumps(asyncio.run(_loadgen(spec))))
    return 0


# ---------------------------------------------------------------- orchestration


def _pin(cores: list[int] | None):  # type: ignore[no-untyped-def]
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def _tree_cpu(pid: int) -> dict[int, float]:
    from bench.bench_router_service import _cpu_s, _tree_pids

    out = {}
    for p in _tree_pids(pid):
        with contextlib.suppress(OSError):
            out[p] = _cpu_s(p)
    return out


def _window(args: argparse.Namespace, targets: list[str], rate: float, tag: str, seed: int, cores: list | None,
            env: dict[str, str], seconds: float | None = None) -> tuple[list, float]:  # fmt: skip
    """One window of ``rate`` requests/s split over the load generators; (rows, wall seconds to the last end)."""
    start_at = time.time() + args.spawn_s
    procs = []
    for g in range(args.loadgens):
        spec = {"targets": targets, "rate": rate / args.loadgens, "seconds": seconds or args.window_s,
                "seed": seed * 100 + g, "prompt_chars": args.prompt_chars, "turn_chars": args.turn_chars,
                "tokens": args.tokens, "sessions": args.sessions, "start_at": start_at,
                "tag": f"{tag}-g{g}"}  # fmt: skip
        cmd = [sys.executable, __file__, "--loadgen", json.dumps(spec)]
        pin = _pin([cores[g]] if cores else None)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, preexec_fn=pin))
    rows: list = []
    wall = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=(seconds or args.window_s) + 60)
        if p.returncode != 0:
            raise RuntimeError(f"load generator exited with {p.returncode}")
        got = json.loads(out)
        rows += got["rows"]
        wall = max(wall, got["wall"])  # from the common start to the last request's end
    return rows, wall


def _stats(rows: list, direct: dict | None, rate: float, window_s: float, wall: float) -> dict[str, Any]:
    from bench.bench_router_service import _summarise

    sm = _summarise(rows)
    ok = sm["requests"] - sm["errors"]
    row: dict[str, Any] = {
        "rate": rate,
        "requests": sm["requests"],
        "errors": sm["errors"],
        "offered_per_s": round(sm["requests"] / window_s, 1),
        "completed_per_s": round(ok / wall, 1) if wall else float("nan"),
        "send_lag_p99_ms": round(sm["send_lag_p99_ms"], 2),
        "sticky_conversations": round(sm["sticky_conversations"], 4),
        "max_backend_share": round(sm["max_backend_share"], 4),
    }
    for k in ("ttfb", "total"):
        for q in ("p50", "p99"):
            v = sm[f"{k}_{q}_ms"]
            row[f"{k}_{q}_ms"] = round(v, 3)
            row[f"{k}_{q}_added_ms"] = round(v - direct[f"{k}_{q}_ms"], 3) if direct else ""
    row["carried"] = bool(sm["errors"] == 0 and ok and row["completed_per_s"] >= 0.95 * row["offered_per_s"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4", help="worker counts, comma separated")
    ap.add_argument("--rates", default="500,1000,1500,2000,2500,3000,4000,5000,6000,8000",
                    help="offered requests/s, ascending, comma separated")  # fmt: skip
    ap.add_argument("--window-s", type=float, default=3.0, help="seconds of arrivals per window")
    ap.add_argument("--backends", type=int, default=5, help="fake backend processes (one core each)")
    ap.add_argument("--loadgens", type=int, default=6, help="load generator processes (one core each)")
    ap.add_argument("--sessions", type=int, default=8, help="client sessions per load generator")
    ap.add_argument("--tokens", type=int, default=8, help="streamed tokens per response")
    ap.add_argument("--tokens-per-s", type=float, default=800.0)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--turn-chars", type=int, default=200)
    ap.add_argument("--http", default="fast", choices=("fast", "aiohttp"))
    ap.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    ap.add_argument("--spawn-s", type=float, default=1.5, help="load generators' start-up allowance per window")
    ap.add_argument("--share-cores", action="store_true", help="pin nothing (a machine with too few cores)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router_workers"))
    ap.add_argument("--loadgen", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        return _run_loadgen(args.loadgen)
    workers = [int(x) for x in args.workers.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    if not workers or min(workers) < 1 or rates != sorted(rates) or min(rates) <= 0:
        raise ValueError("--workers: ints >= 1; --rates: ascending positive numbers")
    for name in ("backends", "loadgens", "sessions"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from bench._common import git_revision

    rev = git_revision()
    avail = sorted(os.sched_getaffinity(0))
    need = max(workers) + args.backends + args.loadgens + 1
    if args.share_cores:
        router_cores = backend_cores = lg_cores = None
    else:
        if len(avail) < need:
            raise SystemExit(
                f"{len(avail)} cores available, {need} needed (max workers {max(workers)} + {args.backends} "
                f"backends + {args.loadgens} load generators + 1); or --share-cores"
            )
        r_n = max(workers)
        router_cores = avail[:r_n]
        backend_cores = avail[r_n : r_n + args.backends]
        lg_cores = avail[r_n + args.backends : r_n + args.backends + args.loadgens]
        os.sched_setaffinity(0, avail[r_n + args.backends + args.loadgens :])
    log = open(out_dir / "router_workers.log", "a")  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    stamp = {"git_rev": rev, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine":
             f"{platform.processor() or platform.machine()} x{os.cpu_count()}", "python": platform.python_version(),
             "http": args.http, "event_loop": args.event_loop, "window_s": args.window_s, "backends": args.backends,
             "loadgens": args.loadgens, "sessions": args.sessions, "tokens": args.tokens,
             "tokens_per_s": args.tokens_per_s, "prompt_chars": args.prompt_chars, "turn_chars": args.turn_chars,
             "pinned": not args.share_cores}  # fmt: skip
    say(f"# {stamp['date']} git {rev} {stamp['machine']} load avg {os.getloadavg()} workers {workers} rates {rates}")
    shared = "  (--share-cores: nothing pinned)" if args.share_cores else ""
    say(f"# cores: router {router_cores} backends {backend_cores} load generators {lg_cores} "
        f"orchestrator {sorted(os.sched_getaffinity(0))}{shared}")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen] = []
    port_files: list[Path] = []
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"stamp": stamp, "workers": {}}
    csv_path = out_dir / "router_workers.csv"

    def write_csv() -> None:
        import csv

        fields: list[str] = []
        for r in rows:
            fields += [k for k in r if k not in fields]
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)

    try:
        urls: list[str] = []
        for i in range(args.backends):
            pf = Path(f"/tmp/kvf_bench_workers_{os.getpid()}_{i}.json")
            port_files.append(pf)
            procs.append(subprocess.Popen(
                [sys.executable, str(SERVICE_BENCH), "--serve-backends", str(pf), "--backends", "1", "--tokens",
                 str(args.tokens), "--tokens-per-s", str(args.tokens_per_s)],
                env={**env, "CTL_PORT": str(free_port()), "BACKEND_PREFIX": f"b{i}-"}, stderr=subprocess.DEVNULL,
                preexec_fn=_pin([backend_cores[i]] if backend_cores else None)))  # fmt: skip
        for pf in port_files:
            for _ in range(600):
                if pf.exists() and pf.read_text():
                    break
                time.sleep(0.05)
            urls += json.loads(pf.read_text())

        # Direct: the harness's own latency at each rate, and the rate where it stops keeping up.
        direct: dict[float, dict] = {}
        for k, rate in enumerate(rates):
            got, wall = _window(args, urls, rate, f"direct-{rate}", k, lg_cores, env)
            d = _stats(got, None, rate, args.window_s, wall)
            from bench.bench_router_service import _summarise

            direct[rate] = {**_summarise(got), "carried": d["carried"]}
            rows.append({**stamp, "target": "direct", "workers": 0, **d})
            say(f"direct      {rate:7.0f}/s  err {d['errors']:5d}/{d['requests']:6d} done "
                f"{d['completed_per_s']:8.1f}/s  ttfb p50 {d['ttfb_p50_ms']:7.2f} p99 {d['ttfb_p99_ms']:8.2f} ms  "
                f"lag p99 {d['send_lag_p99_ms']:7.1f}")  # fmt: skip
            write_csv()
            if not d["carried"]:
                say(f"# the harness (backends + load generators) does not carry {rate:.0f}/s: routers are measured "
                    "below it")  # fmt: skip
                break
        harness_rates = [r for r in rates if r in direct and direct[r]["carried"]]

        kvf = [sys.executable, "-m", "kvforge", "router", "--policy", "conversation", "--tokens-per-block", "512",
               "--log-level", "warning", "--http", args.http, "--event-loop", args.event_loop]  # fmt: skip
        for u in urls:
            kvf += ["--backend", u]
        for n in workers:
            port = free_port()
            cores = router_cores[:n] if router_cores else None
            router = subprocess.Popen([*kvf, "--workers", str(n), "--port", str(port)], env=env,
                                      preexec_fn=_pin(cores))  # fmt: skip
            try:
                wait_port(port, router, f"router --workers {n}")
                time.sleep(1.0 + 0.5 * n)  # every worker listening
                target = f"http://127.0.0.1:{port}"
                got, wall = _window(args, [target], min(rates[0], 200.0), f"warm-{n}", 999, lg_cores, env, 1.0)
                bad = sum(not r[2] for r in got)
                if bad:
                    raise RuntimeError(f"--workers {n}: {bad} of {len(got)} warm-up requests failed")
                clean = fast = 0.0
                fast_open = True
                cpu_total: dict[int, float] = {}
                requests_total = 0
                for k, rate in enumerate(harness_rates):
                    c0 = _tree_cpu(router.pid)
                    got, wall = _window(args, [target], rate, f"w{n}-{rate}", k, lg_cores, env)
                    c1 = _tree_cpu(router.pid)
                    for p, v in c1.items():
                        cpu_total[p] = cpu_total.get(p, 0.0) + v - c0.get(p, 0.0)
                    requests_total += len(got)
                    cpu = sum(v - c0.get(p, 0.0) for p, v in c1.items())
                    r = _stats(got, direct[rate], rate, args.window_s, wall)
                    r["cpu_ms_per_request"] = round(cpu * 1e3 / max(1, r["requests"]), 4)
                    rows.append({**stamp, "target": f"kvforge-{n}w", "workers": n, **r})
                    say(f"kvforge {n}w  {rate:7.0f}/s  err {r['errors']:5d}/{r['requests']:6d} done "
                        f"{r['completed_per_s']:8.1f}/s  ttfb+ p50 {r['ttfb_p50_added_ms']:7.2f} p99 "
                        f"{r['ttfb_p99_added_ms']:8.2f} ms  cpu {r['cpu_ms_per_request']:.3f} ms/req  sticky "
                        f"{r['sticky_conversations']:.3f}  max share {r['max_backend_share']:.3f}")  # fmt: skip
                    write_csv()
                    if not r["carried"]:
                        break
                    clean = rate
                    fast_open = fast_open and r["ttfb_p50_added_ms"] <= 2.0
                    if fast_open:
                        fast = rate
                # Each worker's share of the router's CPU over the ladder (the supervisor's share included).
                tot = sum(cpu_total.values()) or 1.0
                # (--workers 1 is one process; processes that used no CPU, such as a resource tracker, are left out)
                shares = sorted((round(v / tot, 3) for p, v in cpu_total.items() if p != router.pid and v > 0),
                                reverse=True) or [1.0]  # fmt: skip
                sticky = [x["sticky_conversations"] for x in rows if x["target"] == f"kvforge-{n}w" and x["carried"]]
                summary["workers"][n] = {"max_rate_error_free": clean, "max_rate_p50_added_le_2ms": fast,
                                         "worker_cpu_shares": shares,
                                         "supervisor_cpu_share": round(cpu_total.get(router.pid, 0.0) / tot, 3),
                                         "min_sticky": min(sticky) if sticky else None,
                                         "harness_max_rate": harness_rates[-1] if harness_rates else 0.0}  # fmt: skip
            finally:
                router.terminate()
                try:
                    router.wait(20)
                except subprocess.TimeoutExpired:
                    router.kill()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for pf in port_files:
            pf.unlink(missing_ok=True)

    one = summary["workers"].get(1, {})
    for n, s in summary["workers"].items():
        for key in ("max_rate_error_free", "max_rate_p50_added_le_2ms"):
            base = one.get(key) or 0.0
            s[f"{key}_x_1_worker"] = round(s[key] / base, 3) if base else None
        rows.append({**stamp, "target": f"summary-{n}w", "workers": n, **{k: v for k, v in s.items()
                                                                          if not isinstance(v, list)},
                     "worker_cpu_shares": " ".join(map(str, s["worker_cpu_shares"]))})  # fmt: skip
        say(f"--workers {n}: error-free max {s['max_rate_error_free']:.0f}/s "
            f"(x{s['max_rate_error_free_x_1_worker']} of 1 worker), with p50 added <= 2 ms "
            f"{s['max_rate_p50_added_le_2ms']:.0f}/s (x{s['max_rate_p50_added_le_2ms_x_1_worker']}), stickiness "
            f"min {s['min_sticky']}, worker CPU shares {s['worker_cpu_shares']}, harness carried up to "
            f"{s['harness_max_rate']:.0f}/s")  # fmt: skip
    say(f"# load avg {os.getloadavg()}")
    write_csv()
    (out_dir / "router_workers_summary.json").write_text(json.dumps(summary, indent=1))
    _plot(rows, out_dir)
    log.close()
    return 0


def _plot(rows: list[dict[str, Any]], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure", flush=True)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    targets = dict.fromkeys(r["target"] for r in rows if r["target"].startswith("kvforge-"))
    for i, target in enumerate(targets):
        pts = [r for r in rows if r["target"] == target]
        xs = [r["rate"] for r in pts]
        c = f"C{i}"
        axes[0].plot(xs, [r["ttfb_p50_added_ms"] for r in pts], "o-", color=c, label=f"{target} p50")
        axes[0].plot(xs, [r["ttfb_p99_added_ms"] for r in pts], "x--", color=c, label=f"{target} p99")
        axes[1].plot(xs, [r["completed_per_s"] for r in pts], "o-", color=c, label=target)
    pts = [r for r in rows if r["target"] == "direct"]
    axes[1].plot([r["rate"] for r in pts], [r["completed_per_s"] for r in pts], "k:", label="direct (harness)")
    axes[0].axhline(2.0, color="grey", lw=0.8)
    axes[0].set(xlabel="offered requests/s", ylabel="added time to first chunk, ms", yscale="symlog")
    axes[1].set(xlabel="offered requests/s", ylabel="completed requests/s")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvforge router --workers N ({rows[0]['machine']}, git {rows[0]['git_rev']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "router_workers.png", dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
