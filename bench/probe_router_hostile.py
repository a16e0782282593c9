"""How long one hostile input stalls other clients of ``kvforge router`` (issue 31's target: none > 50 ms).

    python bench/probe_router_hostile.py [--quiet-s 2] [--after-s 3] [--tag NAME]

Four processes: two fake OpenAI backends (``FakeBackend``, one-token answers), the router
(``python -m kvforge router`` with ``--tokenizer``, ``--kv-events`` / ``--kv-replay`` from this process's two
publishers, ``--tokens-per-block 64``, ``--body-timeout-s 1``, defaults otherwise, GC on), a probe client
that sends one small chat request at a time (5 ms apart) through the router, and this process, which sends
the hostile inputs one after another. Per input: the probe's median over ``--quiet-s`` of quiet just before
it, and its maximum from when the input is sent until ``--after-s`` after it was answered (or taken).
Extra = that maximum minus the quiet median: the longest delay another client saw because of this input. It
also holds whatever else the 2 shared cores were doing (other processes on the machine): the quiet window's
own maximum is reported beside it as that noise floor.

Inputs: an ~8 MiB chat prompt (tokenised), a 20 MiB body (413), 100,000-deep JSON, token ids >= 2**32, a body
labelled gzip that is not, 200 bodies that never finish, one KV batch of 1,000,000 hashes, one of 24,000
blocks (applied, in slices), and a burst of forged / malformed KV messages (a 2**62 number, token id -1, deep
msgpack, 1,000 random byte strings); at the HTTP layer (``--http``, default fast): garbage on 200
connections at once, a 1 MiB header and 5,000 headers (20 connections each), a bad chunk size (200
connections), headers dripped a byte per 20 ms (100 connections). Rows go to
``bench/results/router_hostile.csv``; ``--log`` keeps the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._net import free_port, read_port_file, wait_port

TARGET_MS = 50.0
CHAT = "/v1/chat/completions"


async def _serve_backends(port_file: str) -> None:
    from kvforge.service.keys import Keyer
    from kvforge.service.testing import FakeBackend

    backends = [FakeBackend(Keyer(64), tokens_per_s=1e5, max_output_tokens=1, name=f"b{i}") for i in range(2)]
    urls = [await b.start() for b in backends]
    Path(port_file).write_text(json.dumps(urls))
    await asyncio.Event().wait()


async def _probe_main(base: str, out_path: str) -> None:
    """The probe process: one small chat request at a time, 5 ms apart; one line per answered request
    (start time in seconds since the epoch, latency in ms), until terminated."""
    import aiohttp

    body = {"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        with open(out_path, "a", buffering=1) as out:
            while True:
                start, t0 = time.time(), time.perf_counter()
                try:
                    async with session.post(base + CHAT, json=body) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    out.write(f"{start:.6f} {(time.perf_counter() - t0) * 1e3:.3f}\n")
                await asyncio.sleep(0.005)


async def _run(args: argparse.Namespace, base: str, pubs: list, log) -> list[dict]:
    import aiohttp
    import msgspec

    from kvforge.service.kv_events import AllBlocksCleared, BlockStored, encode_batch

    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    host, port = base[len("http://") :].split(":")

    async def serve_replay() -> None:
        while True:
            for p in pubs:
                p.serve_replay()
            await asyncio.sleep(0.005)

    replay_task = asyncio.get_running_loop().create_task(serve_replay())
    for _ in range(600):
        async with session.get(base + "/metrics") as m:
            text = await m.text()
        if text.count('kind="batches"') >= 2:
            break
        for p in pubs:
            p.publish([AllBlocksCleared()])
        await asyncio.sleep(0.05)

    async def post(data: bytes, headers: dict | None = None, path: str = CHAT) -> str:
        async with session.post(base + path, data=data, headers=headers or {}) as r:
            await r.read()
            return str(r.status)

    def raw(pub, seq: int, payload: bytes) -> None:
        pub._pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])

    def next_raw(pub, payload: bytes) -> None:
        raw(pub, pub.next_seq, payload)
        pub._next_seq += 1

    # Built before any timing: the probe must not wait on this process building inputs.
    words = " ".join(f"w{i % 500}" for i in range(1_600_000))
    big_prompt = msgspec.json.encode({"messages": [{"role": "user", "content": words}], "max_tokens": 1})
    huge = b'{"messages": [{"role": "user", "content": "' + b"w1 " * (20 * 2**20 // 3) + b'"}]}'
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big_ids = msgspec.json.encode({"prompt": [1, 2**32, 3]})
    not_gzip = b'{"messages": [{"role": "user", "content": "x"}]}'
    n1m = 1_000_000
    kv_1m = encode_batch([BlockStored(list(range(1, n1m + 1)), None, [7] * n1m, 1, None, "GPU", None)])
    n50k = 24_000  # (just under the 512 KiB message cap)
    toks = [i % 100 for i in range(n50k * 16)]
    kv_50k = encode_batch([BlockStored(list(range(10**6, 10**6 + n50k)), None, toks, 16, None, "GPU", None)])
    bad_token = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                               "token_ids": [-1] * 16, "block_size": 16, "lora_id": None,
                                               "medium": "GPU", "lora_name": None}]])  # fmt: skip
    deep_mp = b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\x00"
    rng = random.Random(31)
    garbage = [rng.randbytes(rng.randint(0, 300)) for _ in range(1000)]
    log(f"inputs built: prompt {len(big_prompt)} B, kv 1M {len(kv_1m)} B, kv 50k {len(kv_50k)} B")

    async def slowloris() -> str:
        conns = []
        for _ in range(200):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            conns.append((reader, writer))
        answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in conns), return_exceptions=True)
        for _, w in conns:
            w.close()
        return f"{sum(isinstance(a, bytes) and a.startswith(b'HTTP/1.1 408') for a in answers)}x408"

    async def raw_http(data: bytes, conns: int = 1, drip_s: float = 0.0) -> str:
        """``data`` on ``conns`` connections at once (byte by byte, ``drip_s`` apart, when given); the statuses
        answered before each connection closed."""

        async def one() -> str:
            reader, writer = await asyncio.open_connection(host, int(port))
            answer = asyncio.get_running_loop().create_task(reader.read())
            try:
                if drip_s:
                    for i in range(min(len(data), 200)):
                        if answer.done():  # answered and closed: stop sending
                            break
                        writer.write(data[i : i + 1])
                        await writer.drain()
                        await asyncio.sleep(drip_s)
                else:
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass  # (the router closed the connection before it had all: its answer may be in)
            try:
                got = await asyncio.wait_for(answer, 10)
            except (ConnectionError, asyncio.TimeoutError) as exc:
                return type(exc).__name__
            finally:
                writer.close()
            return got[9:12].decode("latin-1") if got.startswith(b"HTTP/1.1 ") else "closed"

        got = await asyncio.gather(*(one() for _ in range(conns)))
        return "+".join(f"{n}x{k}" for k, n in sorted(collections.Counter(got).items()))

    head_1m = b"GET /health HTTP/1.1\r\nX: " + b"a" * 2**20 + b"\r\n\r\n"
    many_headers = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(5000)) + b"\r\n"
    bad_chunks = b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n" * 1
    drip_head = b"GET /health HTTP/1.1\r\n" + b"X-Slow: 1\r\n" * 40

    async def kv(payload_fn: Callable[[], None], settle_s: float = 1.0) -> str:
        payload_fn()
        await asyncio.sleep(settle_s)  # the router works on it meanwhile; the probe keeps measuring
        return "sent"

    def forged() -> None:
        p = pubs[1]
        next_raw(p, bad_token)
        next_raw(p, deep_mp)
        for g in garbage:
            next_raw(p, g)
        raw(p, 2**62, encode_batch([]))
        p.publish([AllBlocksCleared()])

    cases: list[tuple[str, Callable[[], Awaitable[str]]]] = [
        ("prompt_8MiB_tokenised", lambda: post(big_prompt)),
        ("body_20MiB_over_limit", lambda: post(huge)),
        ("json_100k_deep", lambda: post(deep, path="/v1/completions")),
        ("token_id_2**32", lambda: post(big_ids, path="/v1/completions")),
        ("gzip_label_not_gzip", lambda: post(not_gzip, {"Content-Encoding": "gzip"})),
        ("slowloris_200_bodies", slowloris),
        ("http_garbage_200_conns", lambda: raw_http(b"\x00\xffGARBAGE\r\n\r\n" * 4, 200)),
        ("http_header_1MiB", lambda: raw_http(head_1m, 20)),
        ("http_5000_headers", lambda: raw_http(many_headers, 20)),
        ("http_bad_chunk_size", lambda: raw_http(bad_chunks, 200)),
        ("http_slowloris_headers_100", lambda: raw_http(drip_head, 100, 0.02)),
        ("kv_batch_1M_hashes", lambda: kv(lambda: next_raw(pubs[0], kv_1m))),
        ("kv_batch_24k_blocks", lambda: kv(lambda: next_raw(pubs[0], kv_50k), 3.0)),
        ("kv_forged_and_malformed", lambda: kv(forged)),
    ]
    probe_file = Path(args.probe_file)
    probe = subprocess.Popen([sys.executable, __file__, "--probe", base, str(probe_file)])
    await asyncio.sleep(2.0)  # the probe's first requests (connection set-up) stay out of every window
    windows = []
    for name, fire in cases:
        q0 = time.time()
        await asyncio.sleep(args.quiet_s)
        d0 = time.time()
        result = await fire()
        took = time.time() - d0
        await asyncio.sleep(args.after_s)
        windows.append((name, result, took, q0, d0, time.time()))
    probe.terminate()
    probe.wait(10)
    samples = [tuple(map(float, ln.split())) for ln in probe_file.read_text().splitlines() if ln.strip()]
    rows = []
    for name, result, took, q0, d0, d1 in windows:
        quiet = [ms for t, ms in samples if q0 <= t < d0]
        during = [ms for t, ms in samples if d0 <= t < d1]
        med, worst = statistics.median(quiet), max(during)
        row = {"input": name, "result": result, "input_s": round(took, 3), "probe_quiet_p50_ms": round(med, 3),
               "probe_quiet_max_ms": round(max(quiet), 3), "probe_during_max_ms": round(worst, 3),
               "extra_ms": round(worst - med, 3), "probe_requests_during": len(during), "target_ms": TARGET_MS,
               "within_target": worst - med <= TARGET_MS}  # fmt: skip
        log(json.dumps(row))
        rows.append(row)
    async with session.get(base + "/metrics") as m:
        kv_lines = [ln for ln in (await m.text()).splitlines() if ln.startswith("kvforge_router_kv_events_total")]
    log("\n".join(kv_lines))
    replay_task.cancel()
    await session.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet-s", type=float, default=2.0)
    ap.add_argument("--after-s", type=float, default=3.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--log", default=None, help="also write the run's lines here")
    ap.add_argument("--http", default="fast", choices=("fast", "aiohttp"), help="the router's HTTP layer")
    ap.add_argument("--serve-backends", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        asyncio.run(_probe_main(*args.probe))
        return 0
    if args.serve_backends:
        asyncio.run(_serve_backends(args.serve_backends))
        return 0

    from bench._common import append_csv, git_revision
    from kvforge.service.kv_events import KVEventPublisher
    from kvforge.service.testing import build_tokenizer

    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (so the child processes are stopped below)
    tmp = Path(tempfile.mkdtemp(prefix="kvf-hostile-"))
    args.probe_file = str(tmp / "probe.txt")
    tok = build_tokenizer(tmp / "tokenizer.json")
    port_file = tmp / "backends.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-backends", str(port_file)])]
    pubs = [KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    try:
        urls = read_port_file(port_file, 30.0)
        port = free_port()
        cmd = [sys.executable, "-m", "kvforge", "router", "--port", str(port), "--tokenizer", str(tok),
               "--tokens-per-block", "64", "--body-timeout-s", "1", "--log-level", "error",
               "--http", args.http]  # fmt: skip
        for u, p in zip(urls, pubs):
            cmd += ["--backend", u, "--kv-events", p.endpoint, "--kv-replay", p.replay_endpoint]
        log(" ".join(cmd))
        procs.append(subprocess.Popen(cmd, cwd=str(Path(__file__).resolve().parents[1])))
        base = f"http://127.0.0.1:{port}"
        wait_port(port, procs[-1], "router", 150.0)
        rows = asyncio.run(_run(args, base, pubs, log))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        for pub in pubs:
            pub.close()
    import aiohttp

    stamp = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_rev": git_revision(),
             "machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()}",
             "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
             "aiohttp": aiohttp.__version__, "gc": "on", "tag": args.tag, "http": args.http}  # fmt: skip
    path = append_csv("router_hostile", [{**stamp, **r} for r in rows])
    worst = max(rows, key=lambda r: r["extra_ms"])
    log(f"worst: {worst['input']} +{worst['extra_ms']} ms (target {TARGET_MS} ms); appended {path}")
    if args.log:
        Path(args.log).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
