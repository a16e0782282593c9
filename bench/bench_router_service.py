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

``--compare`` runs the peer comparison instead: one fake backend per process, then kvforge (``--http fast``
with 1 and 2 workers, ``--http aiohttp`` with 1 worker; all on uvloop) and the SGLang router
(``sglang-router`` wheel, ``cache_aware``, installed by pip into ``--sglang-site`` on first use) side by side;
at each of ``--rates`` and each of ``--rounds``, the same seeded Poisson arrivals of multi-turn conversations
(``X-Conversation-Id`` sent; SGLang matches text prefixes; ``aiohttp-floor``, a bare aiohttp pass-through,
marks the framework's CPU floor) go to each router and straight to the backends in turn (``--window-s`` each,
order rotated per
round). Per router and rate: added time to first chunk and to the end (p50/p99, against direct), CPU per
request over the router's whole process tree (/proc), errors, completions per second, stickiness (share of
conversations whose turns all met one backend) and load split; the highest rate carried (no error, at least
95% of the offered rate completed) and the highest with p50 added <= 2 ms. Rows go to
``bench/results/router_service_peers.csv``, the log and figure beside it.
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
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np

from bench._net import free_port, read_port_file, wait_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


async def _serve_backends(n: int, tokens_per_s: float, tokens: int, tpb: int, port_file: str) -> None:
    from kvforge.service.keys import Keyer
    from kvforge.service.testing import FakeBackend

    prefix = os.environ.get("BACKEND_PREFIX", "b")
    bes = [
        FakeBackend(Keyer(tpb), tokens_per_s=tokens_per_s, max_output_tokens=tokens, name=f"{prefix}{i}")
        for i in range(n)
    ]
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


def _serve_floor(port: int, urls: list[str]) -> None:
    """A bare aiohttp pass-through on uvloop (round robin; no keys, metrics, retries or health checks): the
    CPU floor of the framework kvforge's router is built on, as a reference in ``--compare``."""
    import itertools

    import uvloop
    from aiohttp import web

    turn = itertools.count()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = urls[next(turn) % len(urls)]
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app["session"].post(url + request.path, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        yield
        await app["session"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.cleanup_ctx.append(session)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


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


# ---------------------------------------------------------------- --compare: kvforge workers against SGLang's router


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc: every process's parent, read from its stat line)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children[ppid].append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree_pids(pid):
        with contextlib.suppress(OSError):
            total += _cpu_s(p)
    return total


def _sglang_site(path: str, version: str) -> str:
    """A directory holding the ``sglang-router`` wheel (installed there with pip on first use)."""
    site = Path(path)
    if not (site / "sglang_router").is_dir():
        print(f"installing sglang-router=={version} into {site}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site),
                        f"sglang-router=={version}"], check=True)  # fmt: skip
    return str(site)


def _conversation_workload(rate: float, seconds: float, seed: int, prompt_chars: int, turn_chars: int,
                           tokens: int) -> tuple[list[float], list[tuple[int, bytes]]]:  # fmt: skip
    """Poisson arrival offsets and ``(conversation, body)`` per request: each conversation's prompt grows by
    ``turn_chars`` per turn (its history), conversations picked uniformly; about 8 turns each per window."""
    rng = np.random.default_rng(seed)
    n = max(1, int(rng.poisson(rate * seconds)))
    offsets = np.sort(rng.uniform(0.0, seconds, n)).tolist()
    n_conv = max(16, n // 8)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    history = [letters[rng.integers(0, 27, prompt_chars)].tobytes().decode() for _ in range(n_conv)]
    reqs = []
    for c in rng.integers(0, n_conv, n).tolist():
        history[c] += letters[rng.integers(0, 27, turn_chars)].tobytes().decode()
        body = {"model": "fake", "messages": [{"role": "user", "content": history[c]}], "stream": True,
                "max_tokens": tokens}  # fmt: skip
        reqs.append((c, json.dumps(body).encode()))
    return offsets, reqs


async def _one_conv(session: aiohttp.ClientSession, url: str, conv: str, body: bytes, out: list, t_sched: float,
                    t0: float) -> None:  # fmt: skip
    start = time.perf_counter()
    first = None
    backend = None
    ok = False
    headers = {"Content-Type": "application/json", "X-Conversation-Id": conv}
    try:
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            buf = b""
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                if backend is None:
                    buf += chunk
                    i = buf.find(b'"backend": "')
                    if i >= 0:
                        j = buf.find(b'"', i + 12)
                        if j > 0:
                            backend = buf[i + 12 : j].decode()
            ok = r.status == 200 and backend is not None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        ok = False
    end = time.perf_counter()
    out.append((first - start if first else float("nan"), end - start, ok, backend, conv, start - (t0 + t_sched)))


async def _poisson_window(target: str | list[str], offsets: list[float], reqs: list, tag: str) -> tuple[list, float]:
    """Send ``reqs`` at ``offsets`` (open loop); ``target`` a router URL, or the backends' URLs (direct, each
    conversation on one backend). Returns the per-request rows and the wall time until the last one ended."""
    out: list = []
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        tasks = []
        t0 = time.perf_counter() + 0.05
        for off, (c, body) in zip(offsets, reqs):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = target if isinstance(target, str) else target[c % len(target)]
            tasks.append(asyncio.create_task(_one_conv(s, url, f"{tag}-{c}", body, out, off, t0)))
        await asyncio.gather(*tasks)
        return out, time.perf_counter() - t0


def _summarise(rows: list) -> dict:
    ok = [r for r in rows if r[2]]
    by_conv: dict = defaultdict(list)
    split: dict = defaultdict(int)
    for r in ok:
        by_conv[r[4]].append(r[3])
        split[r[3]] += 1
    multi = [bs for bs in by_conv.values() if len(bs) >= 2]
    on_first = sum(sum(b == bs[0] for b in bs) for bs in multi)
    return {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "ttfb_p50_ms": _pct([r[0] for r in ok], 50) if ok else float("nan"),
        "ttfb_p99_ms": _pct([r[0] for r in ok], 99) if ok else float("nan"),
        "total_p50_ms": _pct([r[1] for r in ok], 50) if ok else float("nan"),
        "total_p99_ms": _pct([r[1] for r in ok], 99) if ok else float("nan"),
        "send_lag_p99_ms": _pct([r[5] for r in rows], 99),
        "sticky_conversations": sum(len(set(bs)) == 1 for bs in multi) / max(1, len(multi)),
        "sticky_requests": on_first / max(1, sum(len(bs) for bs in multi)),
        "max_backend_share": max(split.values()) / max(1, len(ok)) if split else float("nan"),
        "split": dict(sorted(split.items())),
    }


def compare(args: argparse.Namespace) -> int:
    """kvforge (1 and 2 workers, uvloop; 1 worker asyncio) and the SGLang router over the same fake backends."""
    from bench._common import git_revision

    rev = git_revision()  # before this run writes its own log (a tracked file)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    port_files = []
    routers: dict[str, tuple[str, subprocess.Popen]] = {}
    rows: list[dict] = []
    log = open(RESULTS / "router_service_peers.log", "a")  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    try:
        site = _sglang_site(args.sglang_site, args.sglang_version)
        # One process per fake backend, so that no router is judged against a backend process that saturates.
        urls = []
        for i in range(args.backends):
            pf = Path(f"/tmp/kvf_bench_peer_{os.getpid()}_{i}.json")
            port_files.append(pf)
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve-backends", str(pf), "--backends", "1",
                                           "--tokens", str(args.tokens), "--tokens-per-s", str(args.tokens_per_s)],
                                          env={**env, "CTL_PORT": str(free_port()), "BACKEND_PREFIX": f"b{i}-"},
                                          stderr=subprocess.DEVNULL))  # fmt: skip
            # (stderr: SGLang's router opens with an HTTP/2 preface the fake backends log as a bad request)
        for pf in port_files:
            for _ in range(300):
                if pf.exists() and pf.read_text():
                    break
                time.sleep(0.05)
            urls += json.loads(pf.read_text())
        # The fake backends call themselves b0 in every process: tell them apart by URL order instead.
        kvf = [sys.executable, "-m", "kvforge", "router", "--policy", "conversation", "--tokens-per-block", "512",
               "--log-level", "warning"]  # fmt: skip
        for u in urls:
            kvf += ["--backend", u]
        aio = [*kvf, "--http", "aiohttp"]
        variants = {
            "kvforge-1w-asyncio": [*aio, "--event-loop", "asyncio"],
            "kvforge-1w-uvloop": [*aio, "--event-loop", "uvloop"],
            "kvforge-2w-uvloop": [*aio, "--event-loop", "uvloop", "--workers", "2"],
            "kvforge-1w-fast": [*kvf, "--http", "fast", "--event-loop", "uvloop"],
            "kvforge-2w-fast": [*kvf, "--http", "fast", "--event-loop", "uvloop", "--workers", "2"],
        }
        for name in args.routers.split(","):
            port = free_port()
            if name == "aiohttp-floor":
                p = subprocess.Popen([sys.executable, __file__, "--serve-floor", str(port), *urls], env=env)
            elif name == "sglang":
                cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                       str(port), "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *urls]  # fmt: skip
                p = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": site}, stdout=subprocess.DEVNULL)
            else:
                p = subprocess.Popen([*variants[name], "--port", str(port)], env=env)
            procs.append(p)
            routers[name] = (f"http://127.0.0.1:{port}", p)
        for name, (url, p) in routers.items():
            wait_port(int(url.rsplit(":", 1)[1]), p, name)
        time.sleep(2.0)  # every kvforge worker listening, SGLang's workers healthy
        # Warm every path (connections, SGLang's worker discovery).
        off, reqs = _conversation_workload(50, 1.0, 0, args.prompt_chars, args.turn_chars, args.tokens)
        for name, (url, _) in routers.items():
            got, _ = asyncio.run(_poisson_window(url, off, reqs, f"warm-{name}"))
            bad = sum(not r[2] for r in got)
            if bad:
                raise RuntimeError(f"{name}: {bad} of {len(got)} warm-up requests failed")
        names = ["direct", *routers]
        say(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} rates {args.rates} window {args.window_s} s x "
            f"{args.rounds} rounds, {args.backends} fake backends ({args.tokens} tokens at {args.tokens_per_s}/s), "
            f"load avg {os.getloadavg()}")  # fmt: skip
        acc: dict = {(n, r): {"rows": [], "cpu": 0.0, "wall": 0.0} for n in names for r in args.rates}
        for rate in args.rates:
            for rnd in range(args.rounds):
                off, reqs = _conversation_workload(rate, args.window_s, 1000 * rnd + int(rate), args.prompt_chars,
                                                   args.turn_chars, args.tokens)  # fmt: skip
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for name in order:
                    target: str | list[str] = urls if name == "direct" else routers[name][0]
                    pid = routers[name][1].pid if name != "direct" else None
                    c0 = _tree_cpu_s(pid) if pid else 0.0
                    got, wall = asyncio.run(_poisson_window(target, off, reqs, f"{name}-{rate}-{rnd}"))
                    a = acc[(name, rate)]
                    a["cpu"] += (_tree_cpu_s(pid) - c0) if pid else 0.0
                    a["rows"] += got
                    a["wall"] += wall
                    time.sleep(0.3)
            say(f"rate {rate}: load avg {os.getloadavg()[0]:.2f}")
            for name in names:
                sm = _summarise(acc[(name, rate)]["rows"])
                say(f"  {name:20s} err {sm['errors']:4d}/{sm['requests']:5d} ttfb p50 {sm['ttfb_p50_ms']:7.2f} "
                    f"p99 {sm['ttfb_p99_ms']:8.2f} ms  lag p99 {sm['send_lag_p99_ms']:6.1f}  sticky "
                    f"{sm['sticky_conversations']:.3f} split {sm['split']}")  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for pf in port_files:
            pf.unlink(missing_ok=True)

    import aiohttp as _a

    from bench._common import append_csv

    stamp = {"git_rev": rev, "machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()}",
             "python": platform.python_version(), "aiohttp": _a.__version__, "sglang_router": args.sglang_version,
             "window_s": args.window_s, "rounds": args.rounds, "backends": args.backends, "tokens": args.tokens,
             "tokens_per_s": args.tokens_per_s, "prompt_chars": args.prompt_chars, "turn_chars": args.turn_chars,
             "load_avg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    for rate in args.rates:
        d = _summarise(acc[("direct", rate)]["rows"])
        for name in names:
            a = acc[(name, rate)]
            sm = _summarise(a["rows"])
            row = {**stamp, "router": name, "rate": rate}
            for k in ("ttfb", "total"):
                for q in ("p50", "p99"):
                    row[f"{k}_{q}_ms"] = round(sm[f"{k}_{q}_ms"], 3)
                    row[f"{k}_{q}_added_ms"] = round(sm[f"{k}_{q}_ms"] - d[f"{k}_{q}_ms"], 3)
            ok = sm["requests"] - sm["errors"]
            row.update(requests=sm["requests"], errors=sm["errors"],
                       offered_per_s=round(sm["requests"] / (args.rounds * args.window_s), 1),
                       completed_per_s=round(ok / a["wall"], 1) if a["wall"] else float("nan"),
                       send_lag_p99_ms=round(sm["send_lag_p99_ms"], 2),
                       cpu_ms_per_request=round(a["cpu"] * 1e3 / max(1, sm["requests"]), 4) if name != "direct" else "",
                       sticky_conversations=round(sm["sticky_conversations"], 4),
                       sticky_requests=round(sm["sticky_requests"], 4),
                       max_backend_share=round(sm["max_backend_share"], 4))  # fmt: skip
            rows.append(row)
    # A rate is carried when no request failed and the router kept up (completions per second of the window,
    # queue drained included, at least 95% of the offered rate); the highest carried rate, and the highest
    # with p50 added time to first chunk <= 2 ms. Rates are tried in order: the first miss ends the search.
    summary = []
    for name in names[1:]:
        clean = fast = 0.0
        fast_open = True
        for r in (r for r in rows if r["router"] == name):
            if r["errors"] or r["completed_per_s"] < 0.95 * r["offered_per_s"]:
                break
            clean = r["rate"]
            fast_open = fast_open and r["ttfb_p50_added_ms"] <= 2.0
            if fast_open:
                fast = r["rate"]
        summary.append((name, clean, fast))
    for r in rows:
        for name, clean, fast in summary:
            if r["router"] == name:
                r["max_rate_error_free"] = clean
                r["max_rate_p50_added_le_2ms"] = fast
    path = append_csv("router_service_peers", rows)
    say(f"git {rev}  appended {path}")
    say(f"{'router':20s} {'rate':>6s} {'err':>5s} {'ttfb+p50':>9s} {'ttfb+p99':>9s} {'cpu ms/req':>10s} "
        f"{'sticky':>7s} {'max share':>9s}")  # fmt: skip
    for r in rows:
        say(f"{r['router']:20s} {r['rate']:6.0f} {r['errors']:5d} {r['ttfb_p50_added_ms']:9.2f} "
            f"{r['ttfb_p99_added_ms']:9.2f} {r['cpu_ms_per_request']!s:>10s} {r['sticky_conversations']:7.3f} "
            f"{r['max_backend_share']:9.3f}")  # fmt: skip
    for name, clean, fast in summary:
        say(f"{name}: max error-free rate {clean}, with p50 added <= 2 ms {fast}")
    log.close()
    _plot_peers(rows, args)
    return 0


def _plot_peers(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name in dict.fromkeys(r["router"] for r in rows):
        mine = [r for r in rows if r["router"] == name]
        rates = [r["rate"] for r in mine]
        style = {"color": "black", "linestyle": "--"} if name == "direct" else {}
        axes[0].plot(rates, [r["ttfb_p50_ms"] for r in mine], marker="o", label=name, **style)
        axes[1].plot(rates, [r["ttfb_p99_ms"] for r in mine], marker="o", label=name, **style)
        if name != "direct":
            axes[2].plot(rates, [r["cpu_ms_per_request"] for r in mine], marker="o", label=name)
    for ax, title in zip(axes, ("time to first chunk, p50 (ms)", "time to first chunk, p99 (ms)",
                                "router CPU ms per request (all its processes)")):  # fmt: skip
        ax.set_xlabel("offered req/s (open loop, Poisson)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"kvforge router vs sglang-router {args.sglang_version} (cache_aware), {args.backends} fake backends, "
                 f"{r0['machine']}, load avg {r0['load_avg_1m']} @ {r0['git_rev']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(RESULTS / "router_service_peers.png", dpi=110)


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
    g = ap.add_argument_group("--compare: kvforge (1 and 2 workers) against the SGLang router")
    g.add_argument("--compare", action="store_true", help="run the peer comparison instead")
    g.add_argument("--rates", default="200,400,600,800,1000", help="offered req/s, comma separated")
    g.add_argument("--window-s", type=float, default=2.0, help="seconds per router per round")
    g.add_argument("--rounds", type=int, default=2, help="interleaved rounds per rate")
    g.add_argument("--turn-chars", type=int, default=200, help="characters each turn adds to a conversation")
    g.add_argument(
        "--routers",
        default="kvforge-1w-fast,kvforge-1w-uvloop,kvforge-2w-fast,sglang,aiohttp-floor",
        help="kvforge-{1w,2w}-fast: --http fast on uvloop; kvforge-1w-asyncio, kvforge-{1w,2w}-uvloop: --http "
        "aiohttp on that loop; sglang; aiohttp-floor: a bare aiohttp pass-through (round robin), the framework's "
        "CPU floor",
    )
    g.add_argument("--sglang-version", default="0.3.2")
    g.add_argument("--sglang-site", default="/tmp/sglang_router_site", help="where the wheel is installed")
    ap.add_argument("--serve-floor", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_floor:
        _serve_floor(int(args.serve_floor[0]), args.serve_floor[1:])
        return 0
    if args.compare:
        args.rates = [float(x) for x in args.rates.split(",")]
        return compare(args)
    if args.serve_backends:
        asyncio.run(_serve_backends(args.backends, args.tokens_per_s, args.tokens, 512, args.serve_backends))
        return 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ctl_port = free_port()
    port_file = Path(f"/tmp/kvf_bench_ports_{os.getpid()}.json")
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-backends", str(port_file), "--backends",
                                       str(args.backends), "--tokens", str(args.tokens), "--tokens-per-s",
                                       str(args.tokens_per_s)], env={**env, "CTL_PORT": str(ctl_port)}))  # fmt: skip
        urls = read_port_file(port_file, 15.0)
        port = free_port()
        prof = os.environ.get("KVFORGE_PROFILE_ROUTER")  # a path: profile the router process into it
        cmd = [sys.executable, *(["-m", "cProfile", "-o", prof] if prof else []), "-m", "kvforge", "router",
               "--port", str(port), "--policy", args.policy, "--tokens-per-block", "512", "--log-level", "warning",
               "--event-loop", args.event_loop]  # fmt: skip
        for u in urls:
            cmd += ["--backend", u]
        procs.append(subprocess.Popen(cmd, env=env))
        proxy = f"http://127.0.0.1:{port}"
        wait_port(port, procs[-1], "router", 45.0)
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
