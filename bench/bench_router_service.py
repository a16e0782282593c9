"""Proxy overhead and throughput of ``kvforge router``, and the hit rate of a trace replayed through it.

    python bench/bench_router_service.py [--rate 200] [--seconds 10] [--backends 2] [--trace-requests 300]

Three processes: fake OpenAI backends (``kvforge.service.testing.FakeBackend``, streaming ``--tokens`` tokens
at ``--tokens-per-s``), the router (``python -m kvforge router``, as a user runs it) and this load generator.

- **Added latency**: open loop at ``--rate`` requests/s with streaming chat requests, in alternating one-second
  windows straight to the backends (round robin in the client) and through the router; per request the time
  to the first chunk and to the end of the stream. Added = percentile through the router minus the same
  percentile direct (the two runs are not paired request by request). Target: p50 <= 1 ms, p99 <= 5 ms at 200 req/s.
- **Router CPU per request**: the router process's CPU time over the proxied run, per request (what a core
  would carry; independent of how busy the machine's other processes keep it).
- **Sustained requests/s**: closed loop, ``--concurrency`` clients, one-token non-streaming responses.
- **Hit rate**: the first ``--trace-requests`` requests of the Mooncake trace sent one at a time through the
  router (``--policy``) and through an in-process router with the same keys; hits counted by the same ideal
  per-backend prefix caches. They must be equal.

All of it shares this machine's cores (2 here), so the router competes with the client and the backends:
the added latency includes that contention. Rows go to ``bench/results/router_service.csv``, the figure to
``bench/results/router_service_<rate>rps.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve_backends(n: int, tokens_per_s: float, tokens: int, tpb: int, port_file: str) -> None:
    from kvforge.service.keys import Keyer
    from kvforge.service.testing import FakeBackend

    bes = [FakeBackend(Keyer(tpb), tokens_per_s=tokens_per_s, max_output_tokens=tokens, name=f"b{i}") for i in range(n)]
    urls = [await b.start() for b in bes]
    Path(port_file).write_text(json.dumps(urls))
    ctl = aiohttp.web.Application()

    async def stats(_req: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(
            [{"name": b.name, "prompt": b.prompt_tokens, "hit": b.hit_tokens} for b in bes]
        )

    async def reset(_req: aiohttp.web.Request) -> aiohttp.web.Response:
        for b in bes:
            b.cache.clear()
            b.prompt_tokens = b.hit_tokens = 0
        return aiohttp.web.json_response({})

    ctl.router.add_get("/stats", stats)
    ctl.router.add_post("/reset", reset)
    runner = aiohttp.web.AppRunner(ctl, access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", int(os.environ["CTL_PORT"]))
    await site.start()
    await asyncio.Event().wait()


async def _one(session: aiohttp.ClientSession, url: str, body: dict, out: list) -> None:
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
        ok = r.status == 200
    out.append((first - t0 if first else float("nan"), time.perf_counter() - t0, ok))


async def _open_loop(targets: list[str], rate: float, seconds: float, body: dict) -> list:
    out: list = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for t in targets:  # warm connections
            await _one(s, t, body, [])
        n = int(rate * seconds)
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(s, targets[i % len(targets)], body, out)))
        await asyncio.gather(*tasks)
    return out


async def _closed_loop(target: str, concurrency: int, seconds: float) -> float:
    body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "stream": False}
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                async with s.post(target + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    done += r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def _replay(target: str, ctl: str, rows: list, policy: str, n_backends: int) -> tuple[float, float]:
    from kvforge.service import keys as K
    from kvforge.service.testing import trace_text

    async with aiohttp.ClientSession() as s:
        async with s.post(ctl + "/reset") as r:
            await r.read()
        for row in rows:
            body = {"messages": [{"role": "user", "content": trace_text(row["hash_ids"], row["input_length"])}],
                    "max_tokens": 1, "stream": True}  # fmt: skip
            async with s.post(target + "/v1/chat/completions", json=body) as r:
                await r.read()
                assert r.status == 200
        async with s.get(ctl + "/stats") as r:
            st = await r.json()
    proxy_hit = sum(b["hit"] for b in st) / sum(b["prompt"] for b in st)
    keyer = K.Keyer(512)
    router = K.make_router(policy, [f"b{i}" for i in range(n_backends)], tokens_per_block=512, chars_per_token=4.0,
                           use_cache_events=False, request_ttl_s=None)  # fmt: skip
    caches: dict = defaultdict(set)
    hit = total = 0
    for i, row in enumerate(rows):
        body = {"messages": [{"role": "user", "content": trace_text(row["hash_ids"], row["input_length"])}]}
        keys, n = keyer.keys_for_body("/v1/chat/completions", body)
        b = K.route(router, i, keys, n, None)
        K.finish(router, i, True)
        k = 0
        while k < len(keys) and keys[k] in caches[b]:
            k += 1
        caches[b].update(keys)
        hit += min(k * 512, n)
        total += n
    return proxy_hit, hit / total


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8, help="streamed tokens per response")
    ap.add_argument("--tokens-per-s", type=float, default=800.0)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--policy", default="conversation")
    ap.add_argument("--trace-requests", type=int, default=300)
    ap.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"), help="the router's")
    ap.add_argument("--serve-backends", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_backends:
        asyncio.run(_serve_backends(args.backends, args.tokens_per_s, args.tokens, 512, args.serve_backends))
        return 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ctl_port = _free_port()
    port_file = Path(f"/tmp/kvf_bench_ports_{os.getpid()}.json")
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-backends", str(port_file), "--backends",
                                       str(args.backends), "--tokens", str(args.tokens), "--tokens-per-s",
                                       str(args.tokens_per_s)], env={**env, "CTL_PORT": str(ctl_port)}))  # fmt: skip
        for _ in range(300):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        urls = json.loads(port_file.read_text())
        port = _free_port()
        prof = os.environ.get("KVFORGE_PROFILE_ROUTER")  # a path: profile the router process into it
        cmd = [sys.executable, *(["-m", "cProfile", "-o", prof] if prof else []), "-m", "kvforge", "router",
               "--port", str(port), "--policy", args.policy, "--tokens-per-block", "512", "--log-level", "warning",
               "--event-loop", args.event_loop]  # fmt: skip
        for u in urls:
            cmd += ["--backend", u]
        procs.append(subprocess.Popen(cmd, env=env))
        proxy = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
            except OSError:
                time.sleep(0.05)
        # The trace replay runs first, on a fresh proxy, so its router starts as empty as the in-process one.
        hit_proxy = hit_inproc = float("nan")
        from kvforge.kvcache.replay import find_trace

        trace = find_trace()
        if trace is not None and args.trace_requests > 0:
            rows = [json.loads(line) for _, line in zip(range(args.trace_requests), trace.open())]
            hit_proxy, hit_inproc = asyncio.run(_replay(proxy, f"http://127.0.0.1:{ctl_port}", rows, args.policy,
                                                        args.backends))  # fmt: skip
        body = {"messages": [{"role": "user", "content": "x" * args.prompt_chars}], "stream": True,
                "max_tokens": args.tokens}  # fmt: skip
        # One-second windows, direct and proxied in turn, so that the machine's other load (this machine is
        # shared) falls on both alike.
        direct: list = []
        via: list = []
        cpu = 0.0
        for _ in range(max(1, round(args.seconds))):
            direct += asyncio.run(_open_loop(urls, args.rate, 1.0, body))
            cpu0 = _cpu_s(procs[1].pid)
            via += asyncio.run(_open_loop([proxy], args.rate, 1.0, body))
            cpu += _cpu_s(procs[1].pid) - cpu0
        proxy_cpu_ms = cpu * 1e3 / max(1, len(via))
        rps_direct = asyncio.run(_closed_loop(urls[0], args.concurrency, 5.0))
        rps_proxy = asyncio.run(_closed_loop(proxy, args.concurrency, 5.0))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(5)
        port_file.unlink(missing_ok=True)

    ok_d = [r for r in direct if r[2]]
    ok_v = [r for r in via if r[2]]
    assert len(ok_d) == len(direct) and len(ok_v) == len(via), "failed requests in the latency runs"
    row = {}
    for name, idx in (("ttfb", 0), ("total", 1)):
        for q in (50, 99):
            d, v = _pct([r[idx] for r in ok_d], q), _pct([r[idx] for r in ok_v], q)
            row[f"{name}_p{q}_direct_ms"] = round(d, 3)
            row[f"{name}_p{q}_proxy_ms"] = round(v, 3)
            row[f"{name}_p{q}_added_ms"] = round(v - d, 3)
    import aiohttp as _a

    from bench._common import append_csv, git_revision

    stamp = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_rev": git_revision(),
             "machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()}",
             "python": platform.python_version(),
             "aiohttp": _a.__version__, "rate": args.rate, "seconds": args.seconds, "backends": args.backends,
             "tokens": args.tokens, "tokens_per_s": args.tokens_per_s, "policy": args.policy,
             "event_loop": args.event_loop}  # fmt: skip
    out = {**stamp, **row, "requests": len(via), "proxy_cpu_ms_per_request": round(proxy_cpu_ms, 3),
           "load_avg_1m": round(os.getloadavg()[0], 2), "rps_direct": round(rps_direct, 1),
           "rps_proxy": round(rps_proxy, 1),
           "concurrency": args.concurrency, "trace_requests": args.trace_requests,
           "hit_proxy": round(hit_proxy, 6), "hit_in_process": round(hit_inproc, 6)}  # fmt: skip
    path = append_csv("router_service", [out])
    print(json.dumps(out, indent=1))
    print(f"appended {path}")
    _plot(ok_d, ok_v, out)
    return 0


def _plot(direct: list, via: list, row: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, idx, title in ((axes[0], 0, "time to first chunk"), (axes[1], 1, "time to end of stream")):
        for data, label in ((direct, "direct"), (via, "through kvforge router")):
            xs = np.sort([r[idx] * 1e3 for r in data])
            ax.plot(xs, np.linspace(0, 1, len(xs)), label=label)
        ax.set_xlabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"{row['rate']:.0f} req/s streaming, {row['backends']} fake backends, {row['machine']} "
                 f"@ {row['git_rev']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(RESULTS / f"router_service_{row['rate']:.0f}rps.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
