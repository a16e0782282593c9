"""The Python cost of one proxied streaming request in ``kvforge router --http fast``, without sockets.

    python bench/probe_router_python_cost.py [--requests 150] [--reps 24]
    valgrind --tool=cachegrind --cache-sim=no python3 bench/probe_router_python_cost.py --count N

A :class:`~kvforge.service.proxy.RouterService` (``conversation`` policy, 2 backends, 512 tokens per block) served by
the fast layer's own protocol objects (``fasthttp._Conn`` for a client connection, ``fasthttp._UpConn`` for each
pooled backend connection) over fake transports that keep what is written, on uvloop. Each request is the bench's
(``bench_router_service._conversation_workload``: multi-turn conversations, about 3,000-character prompts,
``X-Conversation-Id``) as aiohttp's client sends it; the chosen backend answers as the fake backend does (chunked
SSE: a head with the first token, 7 more tokens one read each, ``[DONE]`` with the terminator), the event loop
stepped between reads as a network would. What it measures is the router's Python and C-extension work per
request (parsing, keying, placing, metrics, relaying 9 reads), none of the kernel's (socket calls, wake-ups):
that share, and the cache misses of a machine shared with the client and the backends, come on top in
``bench_router_service.py --compare``. Printed: thread CPU µs per request, min / p25 / median over ``--reps``
batches (gc on). ``--count N`` instead runs N requests after start-up and exits: two cachegrind runs (N and a
larger N) differ by the instructions of the extra requests, a figure a loaded machine does not disturb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_router_service import _conversation_workload

URLS = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Date: Wed, 02 Dec 2026 16:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n\r\n"
)
DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class _Transport:
    """Keeps what is written; reading is never paused for real."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, *_a: Any, **_k: Any) -> None:
        return None


def _request(conv: int, body: bytes) -> bytes:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-Conversation-Id: c-%d\r\n"
        b"Content-Type: application/json\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
        b"User-Agent: Python/3.11 aiohttp/3.14.5\r\nContent-Length: %d\r\n\r\n" % (conv, len(body))
    )
    return head + body


def _token(i: int, name: str) -> bytes:
    choice = {"index": 0, "delta": {"content": f"tok{i} "}}
    data = f"data: {json.dumps({'id': 'x', 'choices': [choice], 'backend': name})}\n\n".encode()
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _main(args: argparse.Namespace) -> None:
    from kvforge.service import fasthttp as F
    from kvforge.service.proxy import RouterService, ServiceConfig

    loop = asyncio.get_running_loop()
    svc = RouterService(ServiceConfig(backends=URLS, policy="conversation", tokens_per_block=512))
    srv = F.Server(svc, loop)
    pool = F.Pool(svc.cfg, loop)
    svc.client = pool  # (no health checks: nothing listens at the URLs)
    ups = []
    for url in URLS:
        up = F._UpConn(pool, pool._base(url)[0])
        t = _Transport()
        up.connection_made(t)
        pool.put(up)
        ups.append((up, t))
    conn = F._Conn(srv)
    client = _Transport()
    conn.connection_made(client)
    tokens = {f"b{i}": [_token(j, f"b{i}") for j in range(8)] for i in range(len(URLS))}

    async def steps(n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    async def one(conv: int, body: bytes) -> None:
        client.out.clear()
        conn.data_received(_request(conv, body))
        await steps(4)
        i = next(i for i, (_, t) in enumerate(ups) if t.out)
        up, t = ups[i]
        t.out.clear()
        toks = tokens[f"b{i}"]
        up.data_received(HEAD + toks[0])
        await steps(3)
        for tok in toks[1:]:
            up.data_received(tok)
        up.data_received(DONE)
        await steps(4)
        if not (client.out and client.out[-1].endswith(b"0\r\n\r\n")):
            raise RuntimeError("the response did not reach the client whole")

    n_total = args.count if args.count is not None else 300 + args.reps * args.requests
    # (At least 30 s of arrivals whatever is run: two --count runs then build the same workload.)
    _, reqs = _conversation_workload(200, max(30.0, n_total / 190), 7, 2000, 200, 8)
    if args.count is not None:
        for conv, body in reqs[: args.count]:
            await one(conv, body)
        return
    for conv, body in reqs[:300]:  # warm: sessions known, connections pooled, caches filled
        await one(conv, body)
    res = []
    for rep in range(args.reps):
        batch = reqs[300 + rep * args.requests : 300 + (rep + 1) * args.requests]
        t0 = time.thread_time()
        for conv, body in batch:
            await one(conv, body)
        res.append((time.thread_time() - t0) / len(batch) * 1e6)
    res.sort()
    print(f"thread CPU us/request: min {res[0]:.1f} p25 {res[len(res) // 4]:.1f} median {res[len(res) // 2]:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=150, help="requests per timed batch")
    ap.add_argument("--reps", type=int, default=24, help="timed batches")
    ap.add_argument("--count", type=int, help="run this many requests untimed and exit (for cachegrind)")
    args = ap.parse_args()
    if args.requests < 1 or args.reps < 1 or (args.count is not None and args.count < 1):
        ap.error("--requests, --reps and --count: expected integers >= 1")
    import uvloop

    uvloop.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
