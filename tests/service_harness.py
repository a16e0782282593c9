"""Shared by the service tests and the bench: a router service plus fake backends in one event loop."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvforge.kvcache.replay import find_trace
from kvforge.service.keys import Keyer
from kvforge.service.kv_events import KVEventPublisher
from kvforge.service.proxy import RouterService, ServiceConfig
from kvforge.service.testing import FakeBackend, trace_text

# The HTTP layer :func:`fleet` serves with ("fast" or "aiohttp"); tests/conftest.py's ``http_layer`` fixture sets
# it per test where a test runs over both.
HTTP = "fast"


def trace_path() -> Path | None:
    """The conversation trace ($KVFORGE_TRACE or shared/data beside the checkout), None when absent."""
    return find_trace()


def load_trace(limit: int) -> list[dict[str, Any]]:
    p = trace_path()
    assert p is not None
    out = []
    with p.open() as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= limit:
                break
    return out


def trace_body(row: dict[str, Any], stream: bool = True, max_tokens: int = 4) -> dict[str, Any]:
    text = trace_text(row["hash_ids"], row["input_length"])
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "max_tokens": max_tokens,
    }


@asynccontextmanager
async def fleet(
    n: int,
    *,
    keyer: Keyer | None = None,
    events: bool = False,
    backend_kw: dict[str, Any] | None = None,
    **cfg_kw: Any,
):
    """Yields (service, base_url, backends, session)."""
    cfg_kw.setdefault("tokens_per_block", 512)
    keyer = keyer or Keyer(cfg_kw["tokens_per_block"], cfg_kw.get("chars_per_token", 4.0), cfg_kw.get("tokenizer"))
    backends = []
    pubs = []
    for i in range(n):
        pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") if events else None
        if pub is not None:
            pubs.append(pub)
        b = FakeBackend(keyer, publisher=pub, name=f"b{i}", **(backend_kw or {}))
        await b.start()
        backends.append(b)
    cfg_kw.setdefault("health_interval_s", 0.2)
    cfg_kw.setdefault("health_timeout_s", 0.2)
    cfg = ServiceConfig(
        backends=[b.url for b in backends],
        kv_events=[p.endpoint for p in pubs],
        kv_replay=[p.replay_endpoint for p in pubs],
        **cfg_kw,
    )
    service = RouterService(cfg)
    port, close = await serve_service(service)
    if events:
        # ZMQ's slow joiner: a batch published before a subscription has reached the publisher is dropped, and
        # a test that sends one request would wait for events that never come (seen on a loaded CI machine).
        # Publish empty batches until every subscriber has applied one (a first batch after 0 asks for a
        # replay from 0, which the fake backend serves).
        for _ in range(1000):
            subs = [service.fleet.backends[b.url].subscriber for b in backends]
            if all(sub is not None and sub.counts["batches"] for sub in subs):
                break
            for pub in pubs:
                pub.publish([])
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("kv events: a subscriber saw no batch in 10 s")
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    try:
        yield service, f"http://127.0.0.1:{port}", backends, session
    finally:
        await session.close()
        await close()
        for b in backends:
            await b.kill()
        for p in pubs:
            p.close()


async def serve_service(service: RouterService, http: str | None = None) -> tuple[int, Any]:
    """Serve ``service`` on a free port of 127.0.0.1 with the ``http`` layer (default :data:`HTTP`): (port,
    ``async close()``)."""
    if (http or HTTP) == "fast":
        from kvforge.service import fasthttp

        srv = await fasthttp.start(service, "127.0.0.1", 0)
        return srv.port, lambda: srv.close(0.1)
    runner = web.AppRunner(service.make_app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return site._server.sockets[0].getsockname()[1], runner.cleanup  # type: ignore[union-attr]


async def post_chat(
    session: aiohttp.ClientSession, base: str, body: dict[str, Any], conv: str | None = None
) -> dict[str, Any]:
    """Send one request; returns status, whether the response started, the chunks' backend and completion."""
    headers = {"X-Conversation-Id": conv} if conv else {}
    out: dict[str, Any] = {"status": None, "started": False, "done": False, "backend": None, "error": None}
    try:
        async with session.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            out["status"] = r.status
            out["started"] = True
            data = await r.read()
            text = data.decode()
            if body.get("stream"):
                out["done"] = text.rstrip().endswith("data: [DONE]")
                first = text.split("\n\n", 1)[0]
                if first.startswith("data: {"):
                    out["backend"] = json.loads(first[6:]).get("backend")
            else:
                out["done"] = r.status == 200
                if r.status == 200:
                    out["backend"] = json.loads(text).get("backend")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out["error"] = type(exc).__name__
    return out


async def wait_for(pred, timeout: float = 5.0, step: float = 0.01) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(step)
    return bool(pred())
