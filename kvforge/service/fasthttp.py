"""``kvforge router --http fast``: the router's HTTP/1.1 layer on asyncio protocols and ``httptools``.

Server side, one :class:`_Conn` per client connection: requests are parsed by httptools' C parser and answered
one at a time, in order (pipelined requests wait, with reading paused, until the one before has been answered).
Keep-alive as the client asks (HTTP/1.0 only with ``Connection: keep-alive``), idle connections closed after
``IDLE_S``. Bodies come with Content-Length or chunked; gzip and deflate Content-Encoding are decoded (bounded
by ``max_body_bytes``) and forwarded decoded. Refused with an error in OpenAI's shape and the connection closed:
a request line or headers over ``MAX_HEAD_BYTES`` or ``MAX_HEADERS`` (431), a declared or received body over
``max_body_bytes`` (413), headers and body not received within ``body_timeout_s`` (408), bytes that do not
parse, an Upgrade or an unknown Content-Encoding (400). What the routes answer is :class:`RouterService`'s, as
under aiohttp; a client that disconnects cancels its request (its placement is finished as failed).

Client side, :class:`Pool`: keep-alive connections per backend (idle ones closed after ``IDLE_S``), responses
parsed by httptools. A forwarded response's body goes straight from the backend's protocol to the client's
transport as each piece arrives (re-framed chunked when the backend sent no length), with the backend's
reading paused while the client's socket is full. Timeouts as ``ServiceConfig`` says: connect, silence between
bytes (``read_timeout_s``), whole request; a reused connection that the backend closed before answering is
retried once on a new one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import ssl
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httptools

from kvforge.service import keys as K
from kvforge.service.proxy import _HOP, Reply, RouterService, ServiceConfig, UpstreamError, _error

__all__ = ["IDLE_S", "MAX_HEADERS", "MAX_HEAD_BYTES", "Pool", "Server", "run", "start"]

logger = logging.getLogger("kvforge.service")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers of one request
MAX_HEADERS = 128
IDLE_S = 75.0  # an idle keep-alive connection (client side, as aiohttp's server); the pool's own idle ones: 15 s
_POOL_IDLE_S = 15.0
_INFLATE_ON_THREAD = 64 * 1024  # compressed bodies at least this big are decoded on a worker thread
_KEYED = frozenset(K.KEYED_PATHS)
_MODEL_PREFIX = "/v1/models/"
_NO_BODY = frozenset((204, 304))
_HOP_BYTES = frozenset(h.encode() for h in _HOP)
_CONNECTION = (b"Connection: close\r\n", b"Connection: keep-alive\r\n")


def _timer_by(conn: Any, due: float, callback: Callable[[], None]) -> None:
    """Have ``conn._timer`` fire by ``due`` (loop time): a timer already set for no later stays, as the connections'
    callbacks find a deadline that moved later and set the timer again for it; one set for later is replaced.
    Both connection kinds keep one timer this way rather than a cancel and a new timer per request."""
    t = conn._timer
    if t is not None:
        if conn._timer_at <= due:
            return
        t.cancel()
    conn._timer_at = due
    conn._timer = conn.loop.call_at(due, callback)


_REASONS = {
    200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Payload Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout",
}  # fmt: skip


class _Refused(Exception):
    """Raised inside a parser callback: the request is answered ``reply`` and the connection closed."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


class _Headers:
    """Headers as received: ``raw`` (name, value) bytes in order, original case; ``items()`` decoded (latin-1),
    case-insensitive ``get`` (the last of a repeated name), ``wire(drop)`` the lines to forward.

    Decoded only when read, in one pass: the parser's per-header callback just keeps the bytes."""

    __slots__ = ("_items", "_low", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._low: dict[str, str] | None = None
        self._items: list[tuple[str, str]] | None = None

    def get(self, name: str, default: Any = None) -> Any:
        low = self._low
        if low is None:
            low = self._low = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw}
        return low.get(name.lower(), default)

    def items(self) -> list[tuple[str, str]]:
        it = self._items
        if it is None:
            it = self._items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw]
        return it

    def wire(self, drop: frozenset[bytes]) -> bytes:
        """``Name: value\r\n`` lines of the headers whose lower-case name is not in ``drop``, as received; a
        name repeated in the same case is sent once, with its last value (as a dict of ``items()`` would)."""
        kept = {k: v for k, v in self.raw if k.lower() not in drop}
        return b"".join([b"%b: %b\r\n" % kv for kv in kept.items()])


class _Request:
    """One parsed request, as the service's handlers read it."""

    __slots__ = ("body", "head", "headers", "keep_alive", "method", "path", "query_string", "version")

    def __init__(self, method: str, path: str, query: str, headers: _Headers, keep_alive: bool, version: str) -> None:
        self.method = method
        self.head = method == "HEAD"
        self.path = path
        self.query_string = query
        self.headers = headers
        self.keep_alive = keep_alive
        self.version = version
        self.body = b""

    @property
    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(self.query_string).items()}

    async def read(self) -> bytes:
        return self.body


def _head(status: int, headers: Any, framing: bytes, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers]
    lines.append("Connection: keep-alive\r\n" if keep_alive else "Connection: close\r\n")
    return "".join(lines).encode("latin-1", "replace") + framing + b"\r\n"


class _Conn(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.service = server.service
        self.loop = server.loop
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_size = 0
        self._in_head = False
        self._body: list[bytes] = []
        self._body_len = 0
        self._done: collections.deque[_Request] = collections.deque()
        self._cur: _Request | None = None  # the request being answered
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when ``_timer`` fires (loop time)
        self._due = 0.0  # the deadline (loop time), and what happens then (``_on_due`` None: nothing is due)
        self._on_due: Callable[[], None] | None = None
        self._reading = True
        self._write_paused = False
        self._relay_up: _UpConn | None = None
        self._stop_after: Reply | None = None  # an error to answer once the requests before it have been
        self._last_request = False  # a request without keep-alive came: nothing after it is read
        self._closing = False  # close once the response being sent ends
        self._pending: _Request | None = None

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.conns.add(self)
        self._arm(IDLE_S, self._idle_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.server.conns.discard(self)
        self._on_due = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()  # (a disconnected client cancels its request, as aiohttp's handler_cancellation)
        up = self._relay_up
        if up is not None:
            up.resume()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._relay_up is not None:
            self._relay_up.pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._relay_up is not None:
            self._relay_up.resume()

    def data_received(self, data: bytes) -> None:
        if self._last_request or self._stop_after is not None or self._closing:
            return  # (after a request that closes the connection, nothing more is read)
        try:
            self.parser.feed_data(data)
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    raise _Refused(_error(431, f"request headers: over {MAX_HEAD_BYTES} bytes"))
        except _Refused as exc:
            self._refuse(exc.reply)
        except httptools.HttpParserCallbackError as exc:
            ctx = exc.__context__
            if isinstance(ctx, _Refused):
                self._refuse(ctx.reply)
            else:
                logger.exception("request parsing failed")
                self._refuse(_error(400, "request: cannot be parsed"))
        except httptools.HttpParserUpgrade:
            self._refuse(_error(400, "request: protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            if not self._last_request:  # (bytes after a request without keep-alive are not read)
                self._refuse(_error(400, f"request: not HTTP/1.1 ({str(exc)[:120]})"))

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._url = []
        self._headers = []
        self._head_bytes = 0  # received while the head is incomplete (httptools holds a header until it ends)
        self._head_size = 0
        self._in_head = True
        self._body = []
        self._body_len = 0
        self._arm(self.service.cfg.body_timeout_s, self._deadline)

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            raise _Refused(_error(431, f"request line: over {MAX_HEAD_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        h = self._headers
        h.append((name, value))
        self._head_size += len(name) + len(value)
        if len(h) > MAX_HEADERS or self._head_size > MAX_HEAD_BYTES:
            raise _Refused(_error(431, f"request headers: over {MAX_HEADERS} or {MAX_HEAD_BYTES} bytes"))

    def on_headers_complete(self) -> None:
        self._in_head = False
        p = self.parser
        url = b"".join(self._url)
        path, _, query = url.partition(b"?")
        spath = path.decode("latin-1")
        if "%" in spath:
            spath = unquote(path.decode("utf-8", "replace"))
        if p.should_upgrade():
            raise _Refused(_error(400, "request: protocol upgrades are not supported"))
        headers = _Headers(self._headers)
        req = _Request(
            p.get_method().decode("latin-1"), spath, query.decode("latin-1"), headers, p.should_keep_alive(),
            p.get_http_version(),
        )  # fmt: skip
        declared = headers.get("content-length")
        limit = self.service.cfg.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # Refused before a byte of it is read (a chunked upload is stopped by the limit as it arrives).
            raise _Refused(self.service.too_big(int(declared)))
        if headers.get("expect", "").lower() == "100-continue" and self._task is None and not self._done:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._pending = req

    def on_body(self, data: bytes) -> None:
        self._body_len += len(data)
        if self._body_len > self.service.cfg.max_body_bytes:
            raise _Refused(self.service.too_big())
        self._body.append(data)

    def on_message_complete(self) -> None:
        req = self._pending
        assert req is not None
        body = self._body
        req.body = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._disarm()
        if not req.keep_alive:
            self._last_request = True
        if self._task is None and not self._done:
            self._dispatch(req)
        else:
            self._done.append(req)
            if self._reading:  # pipelined: nothing more is read until the ones before are answered
                self._reading = False
                self.transport.pause_reading()

    # ---------------------------------------------------------------- timers

    # One deadline at a time (the body's or the idle connection's), kept by one timer that is not cancelled when
    # the deadline moves later: it fires at the time it was set for, finds the deadline moved and is set again
    # for it. A keep-alive connection thus makes a timer about once per deadline period, not two per request.

    def _arm(self, after: float, fn: Callable[[], None]) -> None:
        due = self.loop.time() + after
        self._due = due
        self._on_due = fn
        _timer_by(self, due, self._tick)

    def _disarm(self) -> None:
        self._on_due = None  # (a timer still set finds nothing due)

    def _tick(self) -> None:
        self._timer = None
        fn = self._on_due
        if fn is None or self.closed:
            return
        due = self._due
        if self.loop.time() < due:
            _timer_by(self, due, self._tick)
            return
        self._on_due = None
        fn()

    def _deadline(self) -> None:
        if self._task is not None:  # answering the request before (pipelined): this one's clock waits
            self._arm(self.service.cfg.body_timeout_s, self._deadline)
            return
        self._refuse(self.service.body_timeout())

    def _idle_out(self) -> None:
        if self._task is None and not self._done and self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- answering

    def _refuse(self, reply: Reply) -> None:
        """Answer ``reply`` and close, once the request being answered (if any) is done."""
        self._disarm()
        if self._task is not None or self._done:
            if self._stop_after is None:
                self._stop_after = reply
            if self._reading:
                self._reading = False
                self.transport.pause_reading()
            return
        self._cur = None
        self._stop_after = reply
        self._finish_connection()

    def _finish_connection(self) -> None:
        reply = self._stop_after
        if reply is not None and not self.closed:
            self._write_reply(reply, head_only=False, keep_alive=False)
        self.transport.close()

    def _dispatch(self, req: _Request) -> None:
        self._cur = req
        self._task = self.loop.create_task(self._handle(req))

    async def _handle(self, req: _Request) -> None:
        svc = self.service
        try:
            path, method = req.path, req.method
            if path in _KEYED:
                if method != "POST":
                    self.reply(_error(405, "Method Not Allowed"))
                else:
                    # (Most bodies come without a Content-Encoding: no coroutine to decode them.)
                    headers = req.headers
                    raw = req.body if headers.get("content-encoding") is None else await self._decoded_body(req)
                    if raw is not None:
                        await svc.forward(self, path, raw, headers)
            else:
                handler = self.server.routes.get((method if method != "HEAD" else "GET", path))
                if handler is not None:
                    if req.body:
                        raw = await self._decoded_body(req)
                        if raw is None:
                            return
                        req.body = raw
                    self.reply(await handler(req))
                elif path.startswith(_MODEL_PREFIX) and len(path) > len(_MODEL_PREFIX):
                    if method in ("GET", "HEAD"):
                        self.reply(await svc.model(path[len(_MODEL_PREFIX) :]))
                    else:
                        self.reply(_error(405, "Method Not Allowed"))
                elif any(p == path for _, p in self.server.routes):
                    self.reply(_error(405, "Method Not Allowed"))
                else:
                    self.reply(_error(404, "Not Found"))
        except asyncio.CancelledError:
            return  # the client went away: nothing to answer
        except Exception:
            logger.exception("request failed", extra={"fields": {"path": req.path}})
            if self._cur is req and not self.closed:
                self.reply(_error(500, "internal error"))
            else:  # (the response had started)
                self._closing = True
        finally:
            self._task = None
            if not self.closed:
                self._next()

    def _next(self) -> None:
        if self._closing or (self._last_request and not self._done):
            self.transport.close()
            return
        if self._done:
            self._dispatch(self._done.popleft())
            return
        if self._stop_after is not None:
            self._finish_connection()
            return
        if not self._reading:
            self._reading = True
            self.transport.resume_reading()
        if self._on_due is None:
            self._arm(IDLE_S, self._idle_out)

    async def _decoded_body(self, req: _Request) -> bytes | None:
        """The body without its Content-Encoding; None when a refusal has been answered."""
        enc = req.headers.get("content-encoding")
        if enc is None:
            return req.body
        enc = enc.strip().lower()
        if enc in ("", "identity"):
            return req.body
        if enc not in ("gzip", "x-gzip", "deflate"):
            self._refuse_now(self.service.refuse_body(400, f"body: Content-Encoding {enc[:40]!r} is not supported"))
            return None
        limit = self.service.cfg.max_body_bytes
        try:
            if len(req.body) >= _INFLATE_ON_THREAD:
                return await self.loop.run_in_executor(None, _inflate, req.body, enc, limit)
            return _inflate(req.body, enc, limit)
        except OverflowError:
            self._refuse_now(self.service.refuse_body(413, f"body: decoded, over the limit of {limit}"))
        except (zlib.error, ValueError) as exc:
            self._refuse_now(self.service.unreadable(exc))
        return None

    def _refuse_now(self, reply: Reply) -> None:
        self._closing = True  # (the rest of what the client sends is not read)
        self.reply(reply)

    def reply(self, r: Reply) -> None:
        """Send a whole response for the request being answered (``RouterService.forward``'s ``io``)."""
        req = self._cur
        if req is None or self.closed:
            return
        self._cur = None
        self._write_reply(r, req.head, req.keep_alive and not self._closing)

    def _write_reply(self, r: Reply, head_only: bool, keep_alive: bool) -> None:
        headers = r.headers.items() if r.headers is not None else (("Content-Type", r.content_type),)
        head = _head(r.status, headers, b"Content-Length: %d\r\n" % len(r.body), keep_alive)
        self.transport.write(head if head_only else head + r.body)

    async def relay(self, up: _UpConn) -> tuple[str, str | None]:
        """Pass ``up`` through to the client as it arrives: ("done" | "client_gone" | "cut", why a cut backend
        looks dead or None)."""
        req = self._cur
        if req is None or self.closed:
            up.discard()
            return "client_gone", None
        self._cur = None
        keep = req.keep_alive and not self._closing
        status = up.status
        nobody = req.head or status in _NO_BODY or status < 200
        if up.content_length is not None:
            chunked = False
            framing = b"Content-Length: %d\r\n" % up.content_length
        elif nobody:
            chunked, framing = False, b""
        elif req.version == "1.0":
            chunked, framing, keep = False, b"", False  # no chunked coding for HTTP/1.0: the close ends it
        else:
            chunked, framing = True, b"Transfer-Encoding: chunked\r\n"
        t = self.transport
        # (The backend's status line and headers pass as they came, less the hop-by-hop ones: never decoded.)
        reason = up.reason_bytes or _REASONS.get(status, "Unknown").encode()
        head = b"HTTP/1.1 %d %b\r\n%b%b%b\r\n" % (status, reason, up.forward_head, _CONNECTION[keep], framing)
        try:
            got = up.take(self, head, chunked, nobody, b"0\r\n\r\n" if chunked else b"")
            if got is not None:
                self._relay_up = up
                if self._write_paused:
                    up.pause()
                try:
                    await got
                finally:
                    self._relay_up = None
        except UpstreamError as exc:
            self._closing = True
            t.close()  # the client must see an error, not a clean end
            return "cut", (exc.name if exc.dead else None)
        except BaseException:
            up.discard()
            raise
        if not keep:
            self._closing = True
        up.release()
        return "done", None


def _inflate(data: bytes, enc: str, limit: int) -> bytes:
    d = zlib.decompressobj(31 if enc in ("gzip", "x-gzip") else (zlib.MAX_WBITS if data[:1] == b"\x78" else -15))
    out = d.decompress(data, limit + 1)
    if len(out) > limit or d.unconsumed_tail:
        raise OverflowError("decoded body over the limit")
    if not d.eof:
        raise ValueError(f"{enc} stream ends early")
    return out


# ---------------------------------------------------------------- client side


class _UpConn(asyncio.Protocol):
    """One connection to a backend; while a request is on it, also that request's response."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = 0
        self.idle_since = 0.0
        self.active = False  # a request is on it
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason_bytes = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.forward_head = b""  # the headers to pass on to the client, as received, hop-by-hop ones left out
        self._headers: _Headers | None = None
        self.content_length: int | None = None
        self.complete = False
        self.got_bytes = False
        self.keep_alive = True
        self._eof_ends_body = False
        self._head_fut: asyncio.Future[None] | None = None
        self._done_fut: asyncio.Future[None] | None = None
        self._buf: list[bytes] = []
        # While the body is relayed (``take``): what goes to ``_client`` after this read, each piece as it came
        # or framed as a chunk; None while the body is kept in ``_buf`` instead.
        self._out: list[bytes] | None = None
        self._client: _Conn | None = None
        self._chunked = False
        self._nobody = False
        self._tail = b""  # sent after the body's last piece
        self._error: UpstreamError | None = None
        self._timing = False  # the request's deadlines are watched (see ``_arm``)
        self._last = 0.0
        self._deadline = 0.0
        self._read_s = 0.0
        self._paused = False

    # ---------------------------------------------------------------- protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad response ({str(exc)[:80]})", True))
        # What one read from the backend brought goes out in one write (the head with the first piece, the
        # last piece with the chunked terminator).
        out = self._out
        if out:
            c = self._client
            if not c.closed:  # type: ignore[union-attr]
                c.transport.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
            out.clear()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if not self.complete and self.active and self.status >= 200 and self._eof_ends_body:
            self.on_message_complete()  # (a body without length or chunks ends with the connection)
        if not self.complete:
            self._fail(UpstreamError(type(exc).__name__ if exc else "ServerDisconnectedError", True))
        self._stop_timer()

    def pause_writing(self) -> None:
        pass  # (request bodies are written whole; the transport buffers them)

    def resume_writing(self) -> None:
        pass

    def on_status(self, status: bytes) -> None:
        self.reason_bytes = status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            self.raw_headers = []
            return  # (an informational response: the real one follows)
        self.keep_alive = self.parser.should_keep_alive()
        chunked = False
        fwd = []
        for k, v in self.raw_headers:
            low = k.lower()
            if low in _HOP_BYTES:
                if low == b"content-length" and v.isdigit():
                    self.content_length = int(v)
                elif low == b"transfer-encoding":
                    chunked = b"chunked" in v.lower()
            else:
                fwd.append(b"%b: %b\r\n" % (k, v))
        self.forward_head = b"".join(fwd)
        self._eof_ends_body = self.content_length is None and not chunked
        f = self._head_fut
        if f is not None and not f.done():
            f.set_result(None)

    @property
    def headers(self) -> _Headers:
        """The response's headers, decoded (read where a response is not relayed as it comes)."""
        h = self._headers
        if h is None:
            h = self._headers = _Headers(self.raw_headers)
        return h

    def on_body(self, data: bytes) -> None:
        out = self._out
        if out is None:
            self._buf.append(data)
        elif data and not self._nobody:
            out.append(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.complete = True
        self._disarm()
        if self._out is not None:
            self._send(self._tail)
            self._out = None
        f = self._done_fut
        if f is not None and not f.done():
            f.set_result(None)

    # ---------------------------------------------------------------- timeouts

    # As the client side's: one timer per connection, not cancelled when a request ends (a later request on the
    # kept-alive connection lets it fire, finds its own deadlines later and sets it again for them).

    def _arm(self, read_s: float, total_s: float) -> None:
        now = self.loop.time()
        self._last = now
        self._read_s = read_s
        self._deadline = now + total_s
        self._timing = True
        _timer_by(self, min(now + read_s, self._deadline), self._on_timer)

    def _disarm(self) -> None:
        self._timing = False

    def _stop_timer(self) -> None:
        self._timing = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if not self._timing or self.closed:
            return
        now = self.loop.time()
        if now >= self._deadline:
            self._fail(UpstreamError("TimeoutError", False))
            return
        if self._paused:  # the client is slow to take what arrived: that is not the backend's silence
            self._last = now
        due = self._last + self._read_s
        if now >= due:
            self._fail(UpstreamError("SocketTimeoutError", False))
            return
        _timer_by(self, min(due, self._deadline), self._on_timer)

    def _fail(self, err: UpstreamError) -> None:
        if self._error is not None:
            return
        self._error = err
        if self._out is not None:  # (what arrived before the cut still goes out)
            self._send()
            self._out = None
        self._stop_timer()
        self.keep_alive = False
        for f in (self._head_fut, self._done_fut):
            if f is not None and not f.done():
                f.set_exception(err)
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- the response, as the service sees it

    def pause(self) -> None:
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if not self.closed:
                self.transport.resume_reading()

    def take(self, client: _Conn, head: bytes, chunked: bool, nobody: bool, end: bytes) -> asyncio.Future[None] | None:
        """Relay the response to ``client``: ``head``, then the body piece by piece (framed as chunks when
        ``chunked``; dropped when ``nobody``), what has arrived now and the rest as it arrives, one write per
        read from the backend, ``end`` after the last piece; a future for the end (None when it is already
        complete). Raises :class:`UpstreamError` when it was cut before."""
        self._client, self._chunked, self._nobody, self._tail = client, chunked, nobody, end
        self._out = [head]
        for piece in self._buf:
            self.on_body(piece)
        self._buf = []
        if self.complete:
            self._send(end)
            self._out = None
            return None
        self._send()
        if self._error is not None:
            self._out = None
            raise self._error
        return self._wait_done()

    def _send(self, end: bytes = b"") -> None:
        out = self._out
        assert out is not None
        if end:
            out.append(end)
        if out:
            c = self._client
            if not c.closed:  # type: ignore[union-attr]
                c.transport.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
            out.clear()

    def _wait_done(self) -> asyncio.Future[None]:
        f = self._done_fut = self.loop.create_future()
        return f

    async def read(self) -> bytes:
        if not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait_done()
        body = b"".join(self._buf)
        self._buf = []
        self.release()
        return body

    def close(self) -> None:
        """Done with this response: the connection goes back to the pool when it was read to the end."""
        if self.complete:
            self.release()
        else:
            self.discard()

    def release(self) -> None:
        if not self.active:
            return  # (already released)
        self.active = False
        self._disarm()
        reusable = self.complete and self.keep_alive and self._error is None and not self.closed
        if self._paused:
            self.resume()
        self._out = self._client = None  # (status and headers stay readable; cleared at the next request)
        if reusable:
            self.pool.put(self)
        else:
            self._stop_timer()
            if not self.closed:
                self.transport.close()

    def discard(self) -> None:
        self.active = False
        self._stop_timer()
        self._out = self._client = None
        self.keep_alive = False
        if not self.closed and self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to the backends (the service's ``client`` under ``--http fast``)."""

    def __init__(self, cfg: ServiceConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self._idle: dict[tuple[str, int, bool], list[_UpConn]] = {}
        self._bases: dict[str, tuple[tuple[str, int, bool], str, str]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._sweeper = loop.create_task(self._sweep())
        self._closed = False

    def _base(self, base: str) -> tuple[tuple[str, int, bool], str, str]:
        got = self._bases.get(base)
        if got is None:
            u = urlsplit(base)
            tls = u.scheme == "https"
            host = u.hostname or ""
            port = u.port or (443 if tls else 80)
            got = self._bases[base] = ((host, port, tls), u.netloc, u.path)
        return got

    def put(self, conn: _UpConn) -> None:
        if self._closed:
            conn.transport.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    async def _connect(self, key: tuple[str, int, bool], timeout: float) -> _UpConn:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _UpConn(self, key), host, port, ssl=self._ssl if tls else None),
                timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("ConnectionTimeoutError", True) from None
        except OSError as exc:
            raise UpstreamError(type(exc).__name__, True) from None
        return conn  # type: ignore[return-value]

    async def request(
        self,
        method: str,
        base: str,
        path: str,
        body: bytes | None = None,
        headers: Any = None,
        total: float | None = None,
    ) -> _UpConn:
        """Send a request; returns once the response's headers are in (the connection, read on through it).
        ``headers``: a mapping, or header lines already in wire form (``_Headers.wire``)."""
        cfg = self.cfg
        key, netloc, prefix = self._base(base)
        total_s = cfg.request_timeout_s if total is None else total
        read_s = cfg.read_timeout_s if total is None else total
        if headers.__class__ is bytes:
            wire = headers
        elif headers:
            wire = "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1", "replace")
        else:
            wire = b""
        length = b"" if body is None else b"Content-Length: %d\r\n" % len(body)
        line = f"{method} {prefix}{path} HTTP/1.1\r\nHost: {netloc}\r\n".encode("latin-1", "replace")
        head = line + wire + length + b"\r\n"
        payload = head + body if body is not None and len(body) < 65536 else head
        idle = self._idle.get(key)
        for _ in range(2):
            conn = None
            while idle:
                c = idle.pop()
                if not c.closed:
                    conn = c
                    break
            fresh = conn is None
            if conn is None:
                conn = await self._connect(key, min(cfg.connect_timeout_s, total_s))
            conn.used += 1
            conn._reset()
            conn.active = True
            f = conn._head_fut = self.loop.create_future()
            conn._arm(read_s, total_s)
            conn.transport.write(payload)
            if payload is head and body:
                conn.transport.write(body)
            try:
                await f
            except UpstreamError:
                if not fresh and not conn.got_bytes and conn._error is not None and conn._error.dead:
                    # A kept-alive connection the backend had closed before it read this request: once more on
                    # a new connection.
                    conn.discard()
                    idle = None
                    continue
                conn.discard()
                raise
            except BaseException:
                conn.discard()
                raise
            return conn
        raise AssertionError("unreachable")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_POOL_IDLE_S / 3)
            cut = self.loop.time() - _POOL_IDLE_S
            for key, conns in list(self._idle.items()):
                keep = [c for c in conns if not c.closed and c.idle_since > cut]
                for c in conns:
                    if c not in keep and not c.closed:
                        c.transport.close()
                self._idle[key] = keep

    async def close(self) -> None:
        self._closed = True
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper
        for conns in self._idle.values():
            for c in conns:
                if not c.closed:
                    c.transport.close()
        self._idle.clear()


# ---------------------------------------------------------------- serving


class Server:
    """A listening fast-layer server for ``service`` (see :func:`start`)."""

    def __init__(self, service: RouterService, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop
        self.routes = service.handlers()
        self.conns: set[_Conn] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening, let requests in progress finish for up to ``timeout`` s, then stop the service."""
        if self.server is not None:
            self.server.close()
        for c in list(self.conns):
            if c._task is None and not c._done:
                c.transport.close()
        end = time.monotonic() + timeout
        while any(c._task is not None for c in self.conns) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.transport.close()
        await self.service.stop()


async def start(service: RouterService, host: str, port: int, *, reuse_port: bool = False) -> Server:
    """Start ``service`` and listen on ``host:port`` (0: a free port, in ``Server.port``)."""
    loop = asyncio.get_running_loop()
    srv = Server(service, loop)
    srv.server = await loop.create_server(
        lambda: _Conn(srv), host, port, reuse_port=reuse_port or None, backlog=1024, start_serving=False
    )
    try:
        await service.start(Pool(service.cfg, loop))
    except BaseException:
        srv.server.close()
        raise
    srv.port = srv.server.sockets[0].getsockname()[1]
    await srv.server.start_serving()
    return srv


def run(
    service: RouterService,
    host: str,
    port: int,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    reuse_port: bool = False,
    on_listening: Callable[[], Any] | None = None,
    shutdown_timeout: float = 60.0,
    background: Sequence[Callable[[], Any]] = (),
) -> None:
    """Serve until SIGTERM or SIGINT (see :func:`kvforge.service.proxy.serve`)."""

    async def main() -> None:
        srv = await start(service, host, port, reuse_port=reuse_port)
        lp = asyncio.get_running_loop()
        stop = asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            lp.add_signal_handler(s, stop.set)
        tasks = [lp.create_task(fn()) for fn in background]
        if on_listening is not None:
            on_listening()
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await srv.close(shutdown_timeout)

    with asyncio.Runner(loop_factory=None if loop is None else (lambda: loop)) as runner:
        runner.run(main())
