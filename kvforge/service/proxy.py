"""The OpenAI-compatible routing proxy: :class:`RouterService` (what every route does, whichever HTTP layer
serves it) and its aiohttp layer (``make_app``, ``--http aiohttp``); the default layer is
:mod:`kvforge.service.fasthttp`, and :func:`kvforge.service.server.serve` runs either.

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and ``/v1/embeddings`` are keyed
(:class:`~kvforge.service.keys.Keyer`), placed by the configured policy and forwarded; the backend's response
is passed through chunk by chunk as it arrives (SSE included, never buffered whole). ``GET /v1/models`` goes
to a healthy backend; ``GET /v1/models/{id}`` is answered from that list. The conversation id is the
``X-Conversation-Id`` header (name configurable) or a ``conversation_id`` body field (stripped before
forwarding); without one the policy matches by prefix. A body must arrive within ``body_timeout_s`` (408,
connection closed); it is forwarded decoded (without its Content-Encoding); every malformed body is a 400 in
OpenAI's shape; big ones are decoded and keyed on a worker thread.

Every placement is finished exactly once, when the response ends: success for a status < 400 streamed to the
end, failure otherwise (client disconnect, upstream error, timeout), which restores the conversation's
baseline as ``finish_request_by_id(success=False)`` does. An attempt that fails before the response has
started (connection refused, reset, connect timeout, or its backend ejected while it waited) ejects the backend
and is retried on another, up to ``max_retries`` times; silence past ``read_timeout_s`` is a 504 that ejects
nothing (a slow backend is not a dead one).

Membership: backends are health-checked (``GET health_path``) and ejected on a failed check or a failed
connection; they rejoin after ``healthy_after`` passing checks. Admin: ``GET/POST/DELETE /admin/backends``
(``Authorization: Bearer <token>`` when an admin token is set) and an optional backends file polled for
changes. One router lives across membership changes (its ``add_server`` / ``remove_server`` /
``set_server_available``): an ejected backend leaves rotation, and only its conversations move (each on its
next request, then sticking to its new backend); every other conversation keeps its backend, and the event
index of a backend merely out of rotation is kept. ``GET /metrics`` is Prometheus text;
``GET /health`` is 200 while any backend is in rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvforge.routing.router import NoServerAvailableError
from kvforge.service import keys as K
from kvforge.service.kv_events import BlockMapper, KVEventSubscriber
from kvforge.service.metrics import ServiceMetrics
from kvforge.service.urls import check_zmq_endpoint as _check_zmq_endpoint
from kvforge.service.urls import normalize_backend_url

__all__ = [
    "Backend", "Fleet", "Reply", "RouterService", "ServiceConfig", "UpstreamError", "new_event_loop",
    "normalize_backend_url",
]  # fmt: skip

logger = logging.getLogger("kvforge.service")

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes are not forwarded in either direction.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip
# Content-Encoding passes through: responses are relayed undecoded (auto_decompress=False).
_MAX_CONV_ID = 512
# Bodies at least this big are decoded and keyed on a worker thread, so the event loop keeps serving others.
_OFFLOAD_BYTES = 64 * 1024
# ... and from this size on (with a tokenizer), in a keyer pool process: decoding and tokenising them here
# would hold the GIL, and the loop with it, for tens of milliseconds at a time.
_POOL_BYTES = 256 * 1024
# Requests with at least this many block keys are placed from a worker thread (the router is thread-safe):
# adding tens of thousands of keys to its trie takes tens of milliseconds.
_OFFLOAD_KEYS = 4096
_EVENTS_NEED_TOKENIZER = (
    "kv_events: needs --tokenizer (engines announce blocks by token ids; without a tokenizer requests are keyed "
    "by text and no event could ever match one)"
)
# Request headers that describe the body as the client sent it: a compressed body has been decoded here, and the
# whole body is in hand (no 100-continue to wait for).
_REQUEST_HOP = _HOP | {"content-encoding", "expect"}
_REQUEST_HOP_BYTES = frozenset(h.encode() for h in _REQUEST_HOP)


@dataclass
class ServiceConfig:
    """What ``kvforge router`` is told on its command line (validated there and here)."""

    backends: Sequence[str] = ()
    policy: str = "conversation"
    tokenizer: str | None = None
    chat_template: str | None = None
    tokens_per_block: int = 128
    chars_per_token: float = 4.0
    conversation_header: str = "X-Conversation-Id"
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 300.0
    request_timeout_s: float = 1800.0
    max_retries: int = 2
    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 30.0
    tokenizer_processes: int = 1
    health_path: str = "/health"
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1
    request_ttl_s: float | None = 3600.0
    kv_events: Sequence[str | None] = ()
    kv_replay: Sequence[str | None] = ()
    kv_topic: str = ""
    kv_group: int = 0
    backends_file: str | None = None
    admin_token: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> ServiceConfig:
        """The configuration in ``kvforge router``'s parsed arguments (``kvforge.service.cli.add_arguments``)."""
        return cls(
            backends=args.backend,
            policy=args.policy,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            tokens_per_block=args.tokens_per_block,
            chars_per_token=args.chars_per_token,
            conversation_header=args.conversation_header,
            connect_timeout_s=args.connect_timeout_s,
            read_timeout_s=args.read_timeout_s,
            request_timeout_s=args.request_timeout_s,
            max_retries=args.max_retries,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout_s,
            health_path=args.health_path,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
            unhealthy_after=args.unhealthy_after,
            healthy_after=args.healthy_after,
            request_ttl_s=args.request_ttl_s,
            kv_events=args.kv_events,
            kv_replay=args.kv_replay,
            kv_topic=args.kv_topic,
            kv_group=args.kv_group,
            backends_file=args.backends_file,
            admin_token=args.admin_token,
        )

    def __post_init__(self) -> None:
        if self.policy not in K.POLICIES:
            raise ValueError(f"policy: expected one of {K.POLICIES}, got {self.policy!r}")
        for name in (
            "connect_timeout_s",
            "read_timeout_s",
            "request_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "body_timeout_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ValueError(f"{name}: expected a positive number of seconds, got {v!r}")
        for name, lo in (
            ("max_retries", 0),
            ("max_body_bytes", 1),
            ("unhealthy_after", 1),
            ("healthy_after", 1),
            ("tokenizer_processes", 0),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        self.backends = [normalize_backend_url(b) for b in self.backends]
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("backends: the same URL is given twice")
        if not self.backends and self.backends_file is None:
            raise ValueError("backends: expected at least one --backend URL or a --backends-file")
        for name in ("kv_events", "kv_replay"):
            eps = list(getattr(self, name))
            if eps and len(eps) != len(self.backends):
                raise ValueError(f"{name}: expected one endpoint per --backend ({len(self.backends)}), got {len(eps)}")
            setattr(self, name, [_check_zmq_endpoint(name, e) for e in eps])
        if self.kv_replay and not self.kv_events:
            raise ValueError("kv_replay: given without kv_events")
        if any(e is not None for e in self.kv_events) and self.tokenizer is None:
            raise ValueError(_EVENTS_NEED_TOKENIZER)
        if not self.health_path.startswith("/"):
            raise ValueError(f"health_path: expected a path starting with '/', got {self.health_path!r}")


@dataclass(eq=False)
class Backend:
    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    from_file: bool = False
    healthy: bool = True
    fails: int = 0
    passes: int = 0
    mapper: BlockMapper | None = None
    subscriber: KVEventSubscriber | None = None
    sent: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)  # keys sent here (hit estimate)
    attempts: set[_Attempt] = field(default_factory=set)


class _Epoch:
    """One router, and the requests it placed that are still in flight.

    A router lives across membership changes; a new one is built only when the first backend joins an empty
    fleet, or when a backend with KV events joins a conversation router built without them (``events``).
    """

    __slots__ = ("events", "in_flight", "router")

    def __init__(self, router: Any, events: bool) -> None:
        self.router = router
        self.events = events
        self.in_flight = 0


@dataclass(eq=False)
class _Attempt:
    task: asyncio.Task[Any] | None
    started: bool = False
    ejected: bool = False


class NoBackend(RuntimeError):
    pass


class Fleet:
    """Backends, their health, and one router over them all (healthy ones in rotation, changed in place)."""

    _SENT_CAP = 1_000_000  # keys remembered per backend for the hit estimate without events

    def __init__(self, cfg: ServiceConfig, metrics_cb: Any = None) -> None:
        self.cfg = cfg
        self.backends: dict[str, Backend] = {}
        self._epoch: _Epoch | None = None
        self._draining: list[_Epoch] = []
        self._on_kv_stat = metrics_cb
        self._started = False

    # ---------------------------------------------------------------- membership

    def add(
        self, url: str, kv_events: str | None = None, kv_replay: str | None = None, *, from_file: bool = False
    ) -> Backend:
        url = normalize_backend_url(url)
        if url in self.backends:
            raise ValueError(f"backend {url} is already in the fleet")
        b = Backend(
            url, _check_zmq_endpoint("kv_events", kv_events), _check_zmq_endpoint("kv_replay", kv_replay), from_file
        )
        if b.kv_replay is not None and b.kv_events is None:
            raise ValueError("kv_replay: given without kv_events")
        if b.kv_events is not None and self.cfg.tokenizer is None:
            raise ValueError(_EVENTS_NEED_TOKENIZER)
        self.backends[url] = b
        if b.kv_events is not None:
            b.mapper = BlockMapper(self.cfg.tokens_per_block, self.cfg.kv_group)
        ep = self._epoch
        if ep is None or (b.mapper is not None and not ep.events and self._conversation_policy()):
            self._new_router()
        else:
            ep.router.add_server(url)
        if b.mapper is not None and self._started:
            self._start_subscriber(b)
        logger.info("backend added", extra={"fields": {"backend": url, "kv_events": kv_events}})
        return b

    async def remove(self, url: str) -> bool:
        url = normalize_backend_url(url)
        b = self.backends.pop(url, None)
        if b is None:
            return False
        # Out of the router before the first await, so the same URL may be added again meanwhile.
        ep = self._epoch
        if ep is not None:
            if self.backends:
                ep.router.remove_server(url)
            else:
                self._retire(ep)
                self._epoch = None
        if b.subscriber is not None:
            await b.subscriber.stop()
        logger.info("backend removed", extra={"fields": {"backend": url}})
        return True

    def set_health(self, b: Backend, ok: bool, reason: str = "") -> None:
        if ok:
            b.fails = 0
            b.passes += 1
            if not b.healthy and b.passes >= self.cfg.healthy_after:
                b.healthy = True
                logger.info("backend back in rotation", extra={"fields": {"backend": b.url}})
                self._set_available(b)
            return
        b.passes = 0
        b.fails += 1
        if b.healthy and b.fails >= self.cfg.unhealthy_after:
            self.eject(b, reason)

    def eject(self, b: Backend, reason: str) -> None:
        b.passes = 0
        if not b.healthy:
            return
        b.healthy = False
        logger.warning("backend out of rotation", extra={"fields": {"backend": b.url, "reason": reason}})
        self._set_available(b)
        # Requests still waiting for its response headers move elsewhere now rather than at their timeout.
        for a in list(b.attempts):
            if not a.started and not a.ejected and a.task is not None:
                a.ejected = True
                a.task.cancel()

    def _set_available(self, b: Backend) -> None:
        ep = self._epoch
        if ep is not None and self.backends.get(b.url) is b:
            ep.router.set_server_available(b.url, b.healthy)

    def _conversation_policy(self) -> bool:
        return self.cfg.policy in ("conversation", "conversation-always")

    def _retire(self, ep: _Epoch) -> None:
        if ep.in_flight:
            self._draining.append(ep)

    def _new_router(self) -> None:
        """A router over every backend (the unhealthy ones out of rotation); the old one drains."""
        old = self._epoch
        if old is not None:
            self._retire(old)
            logger.warning("router rebuilt: a backend with KV events joined; conversations start afresh")
        cfg = self.cfg
        servers = tuple(self.backends)
        use_events = any(b.mapper is not None for b in self.backends.values())
        router = K.make_router(
            cfg.policy,
            servers,
            tokens_per_block=cfg.tokens_per_block,
            chars_per_token=cfg.chars_per_token,
            use_cache_events=use_events,
            request_ttl_s=cfg.request_ttl_s,
        )
        for u, b in self.backends.items():
            if not b.healthy:
                router.set_server_available(u, False)
            # What an engine holds survives a rebuild: its mapper re-announces it to the new router.
            m = b.mapper
            if m is not None and len(m.present):
                router.on_event(u, K.stored_event(list(m.present), None, cfg.tokens_per_block))
        self._epoch = _Epoch(router, use_events)

    # ---------------------------------------------------------------- placement

    def place(
        self, request_id: Hashable, keys: Sequence[Hashable], num_tokens: int, conv: str | None
    ) -> tuple[_Epoch, Backend]:
        ep = self._routable_epoch()
        url = _route(ep.router, request_id, keys, num_tokens, conv)
        ep.in_flight += 1
        return ep, self.backends[url]  # type: ignore[index]

    async def place_off_loop(
        self, request_id: Hashable, keys: Sequence[Hashable], num_tokens: int, conv: str | None
    ) -> tuple[_Epoch, Backend]:
        """:meth:`place`, the router's decision taken on a worker thread (for requests with many keys)."""
        ep = self._routable_epoch()
        url = await asyncio.get_running_loop().run_in_executor(
            None, _route, ep.router, request_id, keys, num_tokens, conv
        )
        ep.in_flight += 1
        b = self.backends.get(url)  # type: ignore[arg-type]
        if b is None:  # removed while the decision was being taken: undo it and decide again here
            self.finish(ep, request_id, False)
            return self.place(request_id, keys, num_tokens, conv)
        return ep, b

    def _routable_epoch(self) -> _Epoch:
        if self._epoch is None:
            raise NoBackend("no backend is in rotation")
        return self._epoch

    def finish(self, ep: _Epoch, request_id: Hashable, success: bool) -> None:
        K.finish(ep.router, request_id, success)
        ep.in_flight -= 1
        if ep.in_flight == 0 and ep is not self._epoch and ep in self._draining:
            self._draining.remove(ep)

    def estimate_hit(self, b: Backend, keys: Sequence[Hashable], num_tokens: int) -> int:
        held: Any = b.mapper.present if b.mapper is not None else b.sent
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        if b.mapper is None:
            sent = b.sent
            for k in keys:
                if k in sent:
                    sent.move_to_end(k)
                else:
                    sent[k] = None
            while len(sent) > self._SENT_CAP:
                sent.popitem(last=False)
        return min(n * self.cfg.tokens_per_block, num_tokens)

    def snapshot(self) -> list[tuple[str, float, int, bool]]:
        loads: dict[str, float] = dict.fromkeys(self.backends, 0.0)
        counts: dict[str, int] = {u: len(b.attempts) for u, b in self.backends.items()}
        for ep in [*self._draining, *([self._epoch] if self._epoch else [])]:
            for s, v in K.loads(ep.router).items():
                loads[str(s)] = loads.get(str(s), 0.0) + v
        return [(u, loads.get(u, 0.0), counts.get(u, 0), b.healthy) for u, b in self.backends.items()]

    def total_backlog(self) -> float:
        return sum(v for _, v, _, _ in self.snapshot())

    # ---------------------------------------------------------------- kv events

    def _start_subscriber(self, b: Backend) -> None:
        assert b.mapper is not None and b.kv_events is not None

        def sink(events: list[Any], url: str = b.url, backend: Backend = b) -> None:
            # Also while the backend is out of rotation: the router keeps its index for when it returns.
            ep = self._epoch
            if ep is not None and self.backends.get(url) is backend:
                for ev in events:
                    ep.router.on_event(url, ev)

        def stat(kind: str, n: int, url: str = b.url) -> None:
            if self._on_kv_stat is not None:
                self._on_kv_stat(url, kind, n)

        b.subscriber = KVEventSubscriber(
            b.kv_events, sink, b.mapper, replay_endpoint=b.kv_replay, topic=self.cfg.kv_topic, on_stats=stat
        )
        b.subscriber.start()

    async def start(self) -> None:
        self._started = True
        for b in self.backends.values():
            if b.mapper is not None and b.subscriber is None:
                self._start_subscriber(b)

    async def stop(self) -> None:
        for b in self.backends.values():
            if b.subscriber is not None:
                await b.subscriber.stop()


class UpstreamError(Exception):
    """A failed exchange with a backend, from either HTTP layer's client. ``dead``: the backend looks down
    (refused, reset, unreachable, cut, connect timeout), as opposed to slow (no byte within the read or total
    timeout)."""

    def __init__(self, name: str, dead: bool) -> None:
        super().__init__(name)
        self.name = name
        self.dead = dead


@dataclass(slots=True)
class Reply:
    """A whole response as a handler answers it, whichever HTTP layer sends it. ``headers`` (when given) are
    sent as they are, Content-Type included; otherwise ``content_type`` is."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] | None = None


class RouterService:
    """The router behind either HTTP layer: routes (:meth:`handlers`, :meth:`forward`), health checks, the
    backends file. ``make_app()`` serves it with aiohttp; :mod:`kvforge.service.fasthttp` with its own layer.
    A layer calls :meth:`start` with its backend client before serving and :meth:`stop` after."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.keyer = K.Keyer(cfg.tokens_per_block, cfg.chars_per_token, cfg.tokenizer, cfg.chat_template)
        self.fleet = self._make_fleet()
        self.metrics = ServiceMetrics(self.fleet.snapshot)
        for i, url in enumerate(cfg.backends):
            ev = cfg.kv_events[i] if cfg.kv_events else None
            rp = cfg.kv_replay[i] if cfg.kv_replay else None
            self.fleet.add(url, ev, rp)
        self._ids = itertools.count()
        self._prefix = f"kvf-{os.getpid():x}-"
        self.client: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._file_mtime: float | None = None
        self._conv_header = cfg.conversation_header
        self._rr = itertools.count()

    def _make_fleet(self) -> Fleet:
        # (kvforge.service.workers gives each worker of ``--workers N`` a fleet that shares state across them.)
        return Fleet(self.cfg, self._kv_stat)

    def _kv_stat(self, url: str, kind: str, n: int) -> None:
        self.metrics.kv_events.labels(url, kind).inc(n)

    def handlers(self) -> dict[tuple[str, str], Any]:
        """(method, path) -> ``async handler(request) -> Reply``, besides the keyed POST paths
        (:meth:`forward`) and ``GET /v1/models/{id}`` (:meth:`model`). A request needs ``headers.get``,
        ``query.get`` and ``await read()``."""
        return {
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/admin/backends"): self._admin_list,
            ("POST", "/admin/backends"): self._admin_add,
            ("DELETE", "/admin/backends"): self._admin_remove,
        }

    # ---------------------------------------------------------------- lifecycle

    async def start(self, client: Any) -> None:
        """Start serving with ``client`` (``await client.request(method, base_url, path, body, headers,
        total=None)``, raising :class:`UpstreamError`; ``await client.close()``)."""
        cfg = self.cfg
        self.client = client
        await self.fleet.start()
        if cfg.tokenizer_processes and self.keyer.uses_tokens:
            # (Spawning takes a second; the loop is not held meanwhile.)
            await asyncio.get_running_loop().run_in_executor(None, self.keyer.start_pool, cfg.tokenizer_processes)
        if cfg.backends_file is not None:
            self._sync_file()
        self._tasks.append(asyncio.get_running_loop().create_task(self._health_loop(), name="health"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.fleet.stop()
        self.keyer.close()
        if self.client is not None:
            await self.client.close()

    def make_app(self) -> web.Application:
        """The aiohttp application (``--http aiohttp``)."""
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[_error_middleware])
        for path in K.KEYED_PATHS:
            app.router.add_post(path, self._aio_completion)
        for (method, path), handler in self.handlers().items():
            if method == "GET":
                app.router.add_get(path, _aio_handler(handler))
            else:
                app.router.add_route(method, path, _aio_handler(handler))

        async def model(request: web.Request) -> web.Response:
            return _web_response(await self.model(request.match_info["model"]))

        app.router.add_get("/v1/models/{model:.+}", model)
        app.on_startup.append(self._aio_startup)
        app.on_cleanup.append(self._aio_cleanup)
        return app

    async def _aio_startup(self, app: web.Application) -> None:
        await self.start(_AioClient(self.cfg))

    async def _aio_cleanup(self, app: web.Application) -> None:
        await self.stop()

    # ---------------------------------------------------------------- health

    async def _check(self, b: Backend) -> None:
        cfg = self.cfg
        try:
            up = await self.client.request("GET", b.url, cfg.health_path, total=cfg.health_timeout_s)
            try:
                await up.read()
            finally:
                up.close()
            ok = up.status < 500
            reason = f"health status {up.status}"
        except UpstreamError as exc:
            ok, reason = False, f"health check failed: {exc.name}"
        if b.url in self.fleet.backends:
            self.fleet.set_health(b, ok, reason)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            if self.cfg.backends_file is not None:
                self._sync_file()
            await asyncio.gather(*(self._check(b) for b in list(self.fleet.backends.values())))

    def _sync_file(self) -> None:
        path = Path(self.cfg.backends_file)  # type: ignore[arg-type]
        try:
            mtime = path.stat().st_mtime
            if mtime == self._file_mtime:
                return
            text = path.read_text()
        except OSError as exc:
            logger.warning("backends file unreadable", extra={"fields": {"path": str(path), "error": str(exc)}})
            return
        self._file_mtime = mtime
        wanted: dict[str, tuple[str | None, str | None]] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            opts = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
            try:
                wanted[normalize_backend_url(parts[0])] = (opts.get("kv_events"), opts.get("kv_replay"))
            except ValueError as exc:
                logger.warning("backends file line skipped", extra={"fields": {"line": n, "error": str(exc)}})
        for url, b in list(self.fleet.backends.items()):
            if b.from_file and url not in wanted:
                asyncio.get_running_loop().create_task(self.fleet.remove(url))
        for url, (ev, rp) in wanted.items():
            if url not in self.fleet.backends:
                try:
                    self.fleet.add(url, ev, rp, from_file=True)
                except ValueError as exc:
                    logger.warning("backends file entry skipped", extra={"fields": {"backend": url, "error": str(exc)}})

    # ---------------------------------------------------------------- handlers

    async def _health(self, request: Any) -> Reply:
        n = sum(b.healthy for b in self.fleet.backends.values())
        return _json({"healthy_backends": n}, 200 if n else 503)

    async def _metrics(self, request: Any) -> Reply:
        return Reply(200, self.metrics.render(), "text/plain; charset=utf-8")

    async def _fetch_models(self) -> tuple[int, bytes, dict[str, str]] | Reply:
        """``/v1/models`` from a healthy backend (status, body, headers), or the error to answer."""
        healthy = [b for b in self.fleet.backends.values() if b.healthy]
        if not healthy:
            return _error(503, "no backend is in rotation")
        start = next(self._rr)
        for i in range(len(healthy)):
            b = healthy[(start + i) % len(healthy)]
            try:
                up = await self.client.request("GET", b.url, "/v1/models")
                try:
                    return up.status, await up.read(), _forward_headers(up.headers)
                finally:
                    up.close()
            except UpstreamError as exc:
                if exc.dead:  # a slow answer is not a dead backend: health checks decide that
                    self.fleet.eject(b, f"/v1/models failed: {exc.name}")
        return _error(502, "every backend failed to answer /v1/models")

    async def _models(self, request: Any) -> Reply:
        got = await self._fetch_models()
        if isinstance(got, Reply):
            return got
        status, body, headers = got
        return Reply(status, body, headers=headers)

    async def model(self, model: str) -> Reply:
        """``/v1/models/{id}`` (``client.models.retrieve``), answered from the backends' model list."""
        got = await self._fetch_models()
        if isinstance(got, Reply):
            return got
        status, body, _ = got
        if status >= 400:
            return _error(502, f"/v1/models answered {status}")
        try:
            listing = msgspec.json.decode(body)
            entries = listing["data"] if isinstance(listing, dict) else None
        except (msgspec.DecodeError, KeyError, RecursionError):
            entries = None
        if not isinstance(entries, list):
            return _error(502, "/v1/models: the backend's answer is not a model list")
        for entry in entries:
            if isinstance(entry, dict) and entry.get("id") == model:
                return _json(entry)
        return _error(404, f"The model '{model[:200]}' does not exist")

    def refuse_body(self, status: int, message: str, outcome: str = "bad_request") -> Reply:
        """The 4xx for a body that cannot be taken (counted under ``outcome``): 413 over ``max_body_bytes``,
        408 past ``body_timeout_s``, 400 for one that does not decode."""
        self.metrics.requests.labels("", outcome).inc()
        return _error(status, message)

    def too_big(self, n: int | None = None) -> Reply:
        got = "more" if n is None else f"{n} bytes,"
        return self.refuse_body(413, f"body: {got} over the limit of {self.cfg.max_body_bytes}")

    def body_timeout(self) -> Reply:
        return self.refuse_body(408, f"body: not received within {self.cfg.body_timeout_s:g} s", "body_timeout")

    def unreadable(self, exc: BaseException) -> Reply:
        return self.refuse_body(400, f"body: cannot be read as sent ({type(exc).__name__}: {str(exc)[:200]})")

    async def _aio_read_body(self, request: web.Request) -> bytes | web.Response:
        """The request body within ``body_timeout_s`` (decompressed by aiohttp as its Content-Encoding says),
        or the 4xx to answer (the connection is closed after a 408 and a 413 declared up front)."""
        declared = request.content_length
        if declared is not None and declared > self.cfg.max_body_bytes:
            # Refused before a byte of it is read (a chunked upload is stopped by the read limit instead).
            return await _answer_and_close(request, self.too_big(declared))
        try:
            return await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            return await _answer_and_close(request, self.body_timeout())
        except web.HTTPException:
            raise  # 413 (over max_body_bytes): the middleware answers in OpenAI's shape
        except Exception as exc:  # (aiohttp's RequestPayloadError for a body that does not decode, and kin)
            return await _answer_and_close(request, self.unreadable(exc))

    async def _aio_completion(self, request: web.Request) -> web.StreamResponse:
        raw = await self._aio_read_body(request)
        if isinstance(raw, web.StreamResponse):
            return raw
        io = _AioExchange(request)
        await self.forward(io, request.path, raw, request.headers)
        assert io.response is not None
        return io.response

    async def forward(self, io: Any, path: str, raw: bytes, headers: Any) -> None:
        """Key, place and forward one keyed POST whose body has been read; the answer goes to ``io``
        (``io.reply(Reply)``, ``await io.relay(upstream) -> (how, dead)``), with retries on other backends."""
        # Routing time starts once the body is in: a slow client is not the router's time.
        t0 = time.perf_counter()
        conv_header = headers.get(self._conv_header)
        try:
            if len(raw) < _OFFLOAD_BYTES:
                raw, conv, keys, num_tokens = _prepare_body(self.keyer, path, raw, conv_header)
            elif len(raw) >= _POOL_BYTES and self.keyer.has_pool:
                fut = self.keyer.submit(_prepare_in_child, path, raw, conv_header)
                changed, conv, keys, num_tokens = await asyncio.wrap_future(fut)
                raw = raw if changed is None else changed
            else:
                raw, conv, keys, num_tokens = await asyncio.get_running_loop().run_in_executor(
                    None, _prepare_body, self.keyer, path, raw, conv_header
                )
        except K.BadRequest as exc:
            self.metrics.requests.labels("", "bad_request").inc()
            io.reply(_error(400, str(exc)))
            return
        # (The fast layer's headers give their forwarded lines as received, never decoded; aiohttp's, a dict.)
        wire = getattr(headers, "wire", None)
        fwd = wire(_REQUEST_HOP_BYTES) if wire is not None else _forward_headers(headers, _REQUEST_HOP)
        rid = f"{self._prefix}{next(self._ids)}"
        m = self.metrics
        for attempt_no in range(self.cfg.max_retries + 1):
            try:
                if len(keys) >= _OFFLOAD_KEYS:
                    ep, b = await self.fleet.place_off_loop(rid, keys, num_tokens, conv)
                else:
                    ep, b = self.fleet.place(rid, keys, num_tokens, conv)
            except NoBackend as exc:
                m.requests.labels("", "no_backend").inc()
                io.reply(_error(503, str(exc)))
                return
            if attempt_no == 0:
                m.routing_seconds.observe(time.perf_counter() - t0)
            m.add(m.prompt_tokens, (b.url,), num_tokens)
            m.add(m.hit_tokens, (b.url,), self.fleet.estimate_hit(b, keys, num_tokens))
            status = await self._attempt(io, path, raw, fwd, ep, b, rid)
            if status is not None:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "request",
                        extra={"fields": {"request_id": rid, "backend": b.url, "conversation": conv,
                                          "prompt_tokens": num_tokens, "status": status,
                                          "attempts": attempt_no + 1, "seconds": round(time.perf_counter() - t0, 6)}},
                    )  # fmt: skip
                return
            m.retries.labels(b.url).inc()
        m.requests.labels("", "no_backend").inc()
        io.reply(_error(502, f"request failed on {self.cfg.max_retries + 1} backends before any response"))

    async def _attempt(
        self, io: Any, path: str, raw: bytes, headers: dict[str, str] | bytes, ep: _Epoch, b: Backend, rid: str
    ) -> int | None:
        """One forward: the status answered, or None when it failed before the response started (the caller
        retries elsewhere)."""
        a = _Attempt(asyncio.current_task())
        b.attempts.add(a)
        success = False
        outcome = "upstream_failed"
        answered = False
        try:
            try:
                up = await self.client.request("POST", b.url, path, raw, headers)
            except asyncio.CancelledError:
                if a.ejected and not a.started:
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    return None
                outcome = "client_gone"
                raise
            except UpstreamError as exc:
                b.attempts.discard(a)  # the ejection below cancels waiting attempts: not this one
                if not exc.dead:
                    # Silence past read_timeout_s (a long prefill, a queue): the backend is alive and may be
                    # computing this very request, so it stays in rotation and the request is not sent again
                    # elsewhere. Health checks, not one slow request, take a backend out.
                    outcome, answered = "upstream_timeout", True
                    io.reply(_error(504, f"backend {b.url} sent no response within {self.cfg.read_timeout_s:g} s"))
                    return 504
                self.fleet.eject(b, f"request failed: {exc.name}")
                return None
            a.started = answered = True
            try:
                how, dead = await io.relay(up)
            except asyncio.CancelledError:
                outcome = "client_gone"
                raise
            if how == "done":
                success = up.status < 400
                outcome = "ok" if success else "upstream_status"
            elif how == "client_gone":
                outcome = "client_gone"
            elif dead is not None:  # cut mid-response (the layer has dropped the client's connection)
                self.fleet.eject(b, f"response cut: {dead}")
            return up.status
        finally:
            b.attempts.discard(a)
            if answered or outcome == "client_gone":
                self.metrics.add(self.metrics.requests, (b.url, outcome))
            self.fleet.finish(ep, rid, success)

    # ---------------------------------------------------------------- admin

    def _admin_ok(self, request: Any) -> bool:
        tok = self.cfg.admin_token
        return tok is None or request.headers.get("Authorization", "") == f"Bearer {tok}"

    async def _admin_list(self, request: Any) -> Reply:
        if not self._admin_ok(request):
            return _error(401, "admin: missing or wrong bearer token")
        return _json(
            [
                {"url": u, "healthy": ok, "backlog_tokens": load, "in_flight": n,
                 "kv_events": self.fleet.backends[u].kv_events}
                for u, load, n, ok in self.fleet.snapshot()
            ]
        )  # fmt: skip

    async def _admin_body(self, request: Any) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(await request.read())
        except (msgspec.DecodeError, RecursionError):
            raise K.BadRequest("body: expected a JSON object") from None
        if not isinstance(body, dict):
            raise K.BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
        return body

    async def _admin_add(self, request: Any) -> Reply:
        if not self._admin_ok(request):
            return _error(401, "admin: missing or wrong bearer token")
        try:
            body = await self._admin_body(request)
            b = self.fleet.add(body.get("url"), body.get("kv_events"), body.get("kv_replay"))  # type: ignore[arg-type]
        except ValueError as exc:
            return _error(400, str(exc))
        return _json({"url": b.url}, 201)

    async def _admin_remove(self, request: Any) -> Reply:
        if not self._admin_ok(request):
            return _error(401, "admin: missing or wrong bearer token")
        url = request.query.get("url")
        try:
            if url is None:
                url = (await self._admin_body(request)).get("url")
            removed = await self.fleet.remove(url)  # type: ignore[arg-type]
        except ValueError as exc:
            return _error(400, str(exc))
        if not removed:
            return _error(404, f"backend {url} is not in the fleet")
        return _json({"removed": url})


# ---------------------------------------------------------------- the aiohttp layer (--http aiohttp)


class _AioUpstream:
    """An aiohttp response from a backend, as :meth:`RouterService.forward` sees one."""

    __slots__ = ("headers", "r", "status")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self.r = r
        self.status = r.status
        self.headers = r.headers

    async def read(self) -> bytes:
        try:
            return await self.r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise UpstreamError(type(exc).__name__, _dead(exc)) from None

    def close(self) -> None:
        self.r.close()


class _AioClient:
    """aiohttp's client session, its errors turned into :class:`UpstreamError` (built inside the loop)."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
        )

    async def request(
        self, method: str, base: str, path: str, body: bytes | None = None, headers: Any = None, total: Any = None
    ) -> _AioUpstream:
        timeout = self._timeout if total is None else aiohttp.ClientTimeout(total=total)
        try:
            r = await self._session.request(method, base + path, data=body, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise UpstreamError(type(exc).__name__, _dead(exc)) from None
        return _AioUpstream(r)

    async def close(self) -> None:
        await self._session.close()


class _AioExchange:
    """One keyed request under aiohttp: :meth:`RouterService.forward`'s ``io``; ``response`` is what the
    handler returns."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def reply(self, r: Reply) -> None:
        self.response = _web_response(r)

    async def relay(self, up: _AioUpstream) -> tuple[str, str | None]:
        """Stream ``up`` to the client chunk by chunk: ("done" | "client_gone" | "cut", why a cut backend
        looks dead or None)."""
        r, request = up.r, self.request
        finished = False
        try:
            resp = self.response = web.StreamResponse(
                status=r.status, reason=r.reason, headers=_forward_headers(r.headers)
            )
            if r.content_length is not None:
                resp.content_length = r.content_length
            try:
                await resp.prepare(request)
            except (ConnectionError, RuntimeError):
                return "client_gone", None
            while True:
                try:
                    chunk = await r.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    # The client must see an error, not a clean end: drop its connection.
                    if request.transport is not None:
                        request.transport.close()
                    return "cut", (type(exc).__name__ if _dead(exc) else None)
                if not chunk:
                    break
                try:
                    await resp.write(chunk)
                except (ConnectionError, RuntimeError):
                    return "client_gone", None
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write_eof()
            finished = r.status < 400
            return "done", None
        finally:
            if finished:
                r.release()
            else:
                r.close()  # an unfinished response must not go back to the pool


def _aio_handler(handler: Any) -> Any:
    async def run(request: web.Request) -> web.Response:
        return _web_response(await handler(request))

    return run


def _web_response(r: Reply) -> web.Response:
    headers = r.headers if r.headers is not None else {"Content-Type": r.content_type}
    return web.Response(body=r.body, status=r.status, headers=headers)


def new_event_loop(choice: str):
    """The loop ``--event-loop choice`` asks for (None: asyncio's default); ImportError for ``uvloop`` when it
    is not installed (``auto`` falls back to asyncio)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop()


def _route(router: Any, request_id: Hashable, keys: Sequence[Hashable], num_tokens: int, conv: str | None) -> Any:
    """:func:`K.route`, an empty rotation raised as :class:`NoBackend` (from a worker thread too)."""
    try:
        return K.route(router, request_id, keys, num_tokens, conv)
    except NoServerAvailableError:
        raise NoBackend("no backend is in rotation") from None


def _conversation_id(conv: str | None, body: dict[str, Any]) -> str | None:
    if conv is None:
        conv = body.get("conversation_id")
        if conv is None:
            return None
        if not isinstance(conv, str):
            raise K.BadRequest(f"conversation_id: expected a string, got {type(conv).__name__}")
    if not conv or len(conv) > _MAX_CONV_ID:
        raise K.BadRequest(f"conversation id: expected 1 to {_MAX_CONV_ID} characters, got {len(conv)}")
    return conv


def _prepare_body(
    keyer: K.Keyer, path: str, raw: bytes, conv_header: str | None
) -> tuple[bytes, str | None, list[Hashable], int]:
    """Decode, validate and key one body: (body to forward, conversation id, keys, prompt tokens). Raises
    BadRequest. CPU work on immutable inputs only: big bodies run it on a worker thread or in a child."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise K.BadRequest("body: expected a JSON object") from None
    except RecursionError:
        raise K.BadRequest("body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise K.BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    conv = _conversation_id(conv_header, body)
    if "conversation_id" in body:
        del body["conversation_id"]
        raw = msgspec.json.encode(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise K.BadRequest(f"stream: expected a boolean, got {type(stream).__name__}")
    try:
        keys, num_tokens = keyer.keys_for_body(path, body)
    except K.BadRequest:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # (A value the checks above let through and the tokenizer or the hashing refuses.)
        raise K.BadRequest(f"prompt: cannot be keyed ({type(exc).__name__}: {str(exc)[:200]})") from None
    return raw, conv, keys, num_tokens


def _prepare_in_child(
    path: str, raw: bytes, conv_header: str | None
) -> tuple[bytes | None, str | None, list[Hashable], int]:
    """:func:`_prepare_body` in a keyer pool process (the body comes back only when it changed)."""
    out, conv, keys, num_tokens = _prepare_body(K.pool_keyer(), path, raw, conv_header)
    return (None if out is raw else out), conv, keys, num_tokens


def _forward_headers(headers: Any, drop: frozenset[str] = _HOP) -> dict[str, str]:
    # (One set built at import: each forwarded header costs one lower() and one lookup.)
    return {k: v for k, v in headers.items() if k.lower() not in drop}


async def _answer_and_close(request: web.Request, reply: Reply) -> web.Response:
    """Send ``reply`` and close the connection at once: the rest of an unread body is not waited for (aiohttp
    would otherwise drain it for up to its lingering time)."""
    resp = _web_response(reply)
    resp.force_close()
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.prepare(request)
        await resp.write_eof()
    if request.transport is not None:
        request.transport.close()
    return resp


def _dead(exc: BaseException) -> bool:
    """Whether a failed exchange says the backend is down (refused, reset, unreachable, connect timeout), as
    opposed to slow (no byte within the read or total timeout)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return True
    return not isinstance(exc, asyncio.TimeoutError)


def _json(obj: Any, status: int = 200) -> Reply:
    return Reply(status, msgspec.json.encode(obj))


def _error(status: int, message: str) -> Reply:
    """An error in OpenAI's shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": kind, "code": status}}, status)


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _web_response(_error(exc.status, exc.reason))
        raise
