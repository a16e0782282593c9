"""Hostile bytes at the router's fast HTTP layer (``--http fast``, httptools): every malformed or oversized
request gets a 4xx in OpenAI's shape (or a closed connection), never a traceback, and the router keeps serving;
pipelining, HTTP/1.0, chunked and compressed bodies work as a client expects."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import random
import re
import zlib

import pytest

from tests.service_harness import fleet

CHAT = b"/v1/chat/completions"
BODY = b'{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}'


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def post(body: bytes = BODY, extra: bytes = b"", path: bytes = CHAT, close: bool = True) -> bytes:
    conn = b"Connection: close\r\n" if close else b""
    return b"POST %b HTTP/1.1\r\nHost: x\r\n%bContent-Length: %d\r\n%b\r\n%b" % (path, conn, len(body), extra, body)


async def exchange(base: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` and read to EOF (the router must close the connection)."""
    host, port = base[len("http://") :].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def statuses(answer: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) [A-Za-z][A-Za-z -]*\r\n", answer)]


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:80]
    return int(answer[9:12])


def error_of(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == status_of(answer) and "Traceback" not in err["message"]
    return err


async def still_serves(base: str) -> None:
    answer = await exchange(base, post())
    assert status_of(answer) == 200, answer[:200]


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="kvforge.service")
    yield
    assert not [r for r in caplog.records if r.exc_info], "a hostile request logged a traceback"


MALFORMED = [
    (b"\x00\xff garbage \r\n\r\n", 400),
    (b"GET / HTTP/9.9\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
    (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n", 431),
    (post(b"x" * 5000), 413),
    (post(b'{"a": 1}', b"Content-Encoding: br\r\n"), 400),
    (post(b"not gzip at all", b"Content-Encoding: gzip\r\n"), 400),
    (post(gzip.compress(b" " * 100_000), b"Content-Encoding: gzip\r\n"), 413),
]


@pytest.mark.parametrize("data,status", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_get_a_4xx_and_a_closed_connection(data: bytes, status: int, no_tracebacks) -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, max_body_bytes=4096) as (svc, base, backends, _s):
            answer = await exchange(base, data)
            assert status_of(answer) == status, answer[:300]
            error_of(answer)
            await still_serves(base)
            assert len(backends[0].requests) == 1 and svc.fleet.total_backlog() == 0

    run(main())


def test_a_chunked_upload_over_the_limit_is_stopped_as_it_arrives(no_tracebacks) -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, max_body_bytes=4096) as (_svc, base, backends, _s):
            host, port = base[len("http://") :].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(10):  # 10 x 1000 bytes, each chunk sent on its own
                writer.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
                await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert status_of(answer) == 413
            error_of(answer)
            assert backends[0].requests == []

    run(main())


def test_slowloris_headers_and_bodies_get_408_at_the_deadline(no_tracebacks) -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, body_timeout_s=0.5) as (_svc, base, _b, _s):
            host, port = base[len("http://") :].split(":")
            loop = asyncio.get_running_loop()

            async def drip(data: bytes) -> tuple[bytes, float]:
                reader, writer = await asyncio.open_connection(host, int(port))
                t0 = loop.time()
                answer = loop.create_task(reader.read())
                with contextlib.suppress(ConnectionError):
                    for i in range(min(len(data), 60)):
                        if answer.done():  # answered and closed: stop writing
                            break
                        writer.write(data[i : i + 1])
                        await writer.drain()
                        await asyncio.sleep(0.05)
                answer = await asyncio.wait_for(answer, 5)
                writer.close()
                return answer, loop.time() - t0

            for data in (post(), b"GET /health HTTP/1.1\r\n" + b"X-Slow: 1\r\n" * 20):
                answer, took = await drip(data)
                assert status_of(answer) == 408 and took < 2.0, (answer[:100], took)
            await still_serves(base)

    run(main())


def test_pipelined_requests_are_answered_in_order_and_keep_alive_works(no_tracebacks) -> None:
    async def main() -> None:
        async with fleet(2, tokens_per_block=64) as (_svc, base, backends, _s):
            reqs = [post(close=False), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", post(close=False),
                    b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]  # fmt: skip
            answer = await exchange(base, b"".join(reqs))
            assert statuses(answer) == [200, 200, 200, 404], answer[:600]
            assert sum(len(b.requests) for b in backends) == 2
            # One request at a time on a kept-alive connection, then a pipelined one behind garbage: the good one
            # is answered, then the 400, then the connection closes.
            answer = await exchange(base, post(close=False) + b"\x00garbage\r\n\r\n")
            assert statuses(answer) == [200, 400]

    run(main())


def test_http_10_chunked_and_compressed_bodies_and_100_continue(no_tracebacks) -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64) as (_svc, base, backends, _s):
            stream = b'{"messages": [{"role": "user", "content": "s"}], "stream": true, "max_tokens": 3}'
            answer = await exchange(
                base, b"POST %b HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (CHAT, len(stream), stream)
            )
            head, _, body = answer.partition(b"\r\n\r\n")
            assert status_of(answer) == 200 and b"chunked" not in head.lower(), head
            assert body.rstrip().endswith(b"data: [DONE]")
            chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (BODY[:10], BODY[10:])) + b"0\r\n\r\n"
            answer = await exchange(
                base, b"POST %b HTTP/1.1\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n%b" % (CHAT, chunked)
            )
            assert status_of(answer) == 200
            for enc, data in (("gzip", gzip.compress(BODY)), ("deflate", zlib.compress(BODY))):
                answer = await exchange(base, post(data, f"Content-Encoding: {enc}\r\n".encode()))
                assert status_of(answer) == 200, answer[:300]
            answer = await exchange(base, post(extra=b"Expect: 100-continue\r\n"))
            assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 ")
            assert all(r["body"]["messages"] for r in backends[0].requests) and len(backends[0].requests) == 5

    run(main())


PIECES = [
    b"GET /health HTTP/1.1\r\n", b"POST /v1/completions HTTP/1.1\r\n", b"\r\n", b"Content-Length: 3\r\n",
    b"Transfer-Encoding: chunked\r\n", b"5\r\nabc", b"0\r\n\r\n", b"Content-Encoding: gzip\r\n", b"Host: x\r\n",
    b"\x00", b" HTTP/1.1", b"Connection: close\r\n", b'{"prompt": [1, 2]}', b"Expect: 100-continue\r\n",
]  # fmt: skip


def test_random_bytes_never_crash_the_parser_path(no_tracebacks) -> None:
    rng = random.Random(31)

    def case() -> bytes:
        out = []
        for _ in range(rng.randrange(1, 12)):
            out.append(rng.choice(PIECES) if rng.random() < 0.7 else rng.randbytes(rng.randrange(1, 200)))
        return b"".join(out)

    async def main() -> None:
        async with fleet(1, tokens_per_block=64, body_timeout_s=0.3) as (_svc, base, _b, _s):
            host, port = base[len("http://") :].split(":")

            async def one(data: bytes) -> None:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(data)
                got = b""
                with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                    while piece := await asyncio.wait_for(reader.read(65536), 1.0):
                        got += piece
                writer.close()
                assert all(code < 500 for code in statuses(got)), (data, got[:300])

            cases = [case() for _ in range(300)]
            for i in range(0, len(cases), 30):
                await asyncio.gather(*(one(c) for c in cases[i : i + 30]))
            await still_serves(base)

    run(main(), 120)


def test_backend_answers_without_length_and_cut_mid_body(no_tracebacks) -> None:
    """A backend answering close-delimited (no length, no chunks) is passed through whole; one that cuts a
    chunked body short cuts the client's connection (an error, not a clean end) and ejects nothing slow."""
    from kvforge.service.proxy import RouterService, ServiceConfig
    from tests.service_harness import serve_service

    async def main() -> None:
        cut = {"on": False}

        async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(re.search(rb"(?i)content-length: (\d+)", head).group(1)) if b"ength" in head else 0
            await reader.readexactly(n)
            if cut["on"] and head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n")
                await writer.drain()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                for piece in (b"data: a\n\n", b"data: [DONE]\n\n"):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
            writer.close()

        server = await asyncio.start_server(backend, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        svc = RouterService(ServiceConfig(backends=[url], tokens_per_block=64, health_interval_s=5.0))
        port, close = await serve_service(svc, "fast")
        base = f"http://127.0.0.1:{port}"
        try:
            answer = await exchange(base, post())
            assert status_of(answer) == 200
            assert b"data: a\n\n" in answer and b"data: [DONE]" in answer and answer.endswith(b"0\r\n\r\n")
            cut["on"] = True
            answer = await exchange(base, post())
            assert status_of(answer) == 200 and not answer.endswith(b"0\r\n\r\n")
            exposition = svc.metrics.render().decode()
            failed = f'kvforge_router_requests_total{{backend="{url}",outcome="upstream_failed"}} 1.0'
            assert svc.fleet.total_backlog() == 0 and failed in exposition
        finally:
            await close()
            server.close()

    run(main())


def test_a_client_that_does_not_read_pauses_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backpressure: a big response to a client that reads nothing is held in the socket buffers (the backend's
    reading paused), not in the router's memory; it arrives whole once the client reads."""
    from kvforge.service import fasthttp
    from kvforge.service.proxy import RouterService, ServiceConfig
    from tests.service_harness import serve_service

    size = 24 * 2**20
    paused: list[int] = []
    real_pause = fasthttp._UpConn.pause

    def pause(self: fasthttp._UpConn) -> None:
        paused.append(1)
        real_pause(self)

    monkeypatch.setattr(fasthttp._UpConn, "pause", pause)

    async def main() -> None:
        async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            m = re.search(rb"(?i)content-length: (\d+)", head)
            await reader.readexactly(int(m.group(1)) if m else 0)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(backend, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        svc = RouterService(ServiceConfig(backends=[url], tokens_per_block=64, health_interval_s=5.0))
        port, close = await serve_service(svc, "fast")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**16)
            writer.write(post())
            await asyncio.sleep(1.0)
            assert paused, "the backend kept being read while the client read nothing"
            got = 0
            while piece := await reader.read(2**20):
                got += len(piece)
            writer.close()
            assert got > size
        finally:
            await close()
            server.close()

    run(main())


def test_a_backend_silent_or_trickling_mid_stream_is_cut_at_its_deadlines(no_tracebacks) -> None:
    """After the response has started: silence past read_timeout_s, or a trickle past request_timeout_s, cuts
    the client's connection (an error, not a clean end); also on a pooled connection whose deadline timer an
    earlier request on it had set; the backend stays in rotation (slow is not dead)."""
    from kvforge.service.proxy import RouterService, ServiceConfig
    from tests.service_harness import serve_service

    async def main() -> None:
        mode = {"how": "ok"}

        async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while True:  # keep-alive: several requests per connection
                    head = await reader.readuntil(b"\r\n\r\n")
                    m = re.search(rb"(?i)content-length: (\d+)", head)
                    await reader.readexactly(int(m.group(1)) if m else 0)
                    if not head.startswith(b"POST"):
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                        continue
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n")
                    how = mode["how"]
                    if how == "ok":
                        writer.write(b"0\r\n\r\n")
                        continue
                    for _ in range(100):  # silent: sleeps; trickle: a byte every 0.1 s, past the total
                        await asyncio.sleep(0.1 if how == "trickle" else 10)
                        writer.write(b"1\r\nx\r\n")
                        await writer.drain()

        server = await asyncio.start_server(backend, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        cfg = ServiceConfig(backends=[url], tokens_per_block=64, health_interval_s=5.0, read_timeout_s=0.4,
                            request_timeout_s=1.2)  # fmt: skip
        svc = RouterService(cfg)
        port, close = await serve_service(svc, "fast")
        base = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()
        try:
            answer = await exchange(base, post())  # (the pool now holds a kept-alive connection)
            assert status_of(answer) == 200 and answer.endswith(b"0\r\n\r\n")
            for how, lo, hi in (("silent", 0.35, 1.0), ("trickle", 1.1, 2.0)):
                mode["how"] = how
                t0 = loop.time()
                answer = await exchange(base, post(), timeout=5.0)
                took = loop.time() - t0
                assert status_of(answer) == 200 and b"data:" in answer and not answer.endswith(b"0\r\n\r\n"), how
                assert lo <= took <= hi, (how, took)
            assert svc.fleet.backends[url].healthy and svc.fleet.total_backlog() == 0
        finally:
            await close()
            server.close()

    run(main())
