"""Serving a :class:`~kvforge.service.proxy.RouterService` with either HTTP layer, in the single process of
``kvforge router`` and in every worker of ``--workers N`` alike: :func:`serve` picks the event loop and the layer
(``fast``: :mod:`kvforge.service.fasthttp`; ``aiohttp``: the service's ``make_app``), runs
:func:`setup_process` once the service is built, serves until SIGTERM or SIGINT and shuts down gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvforge.service.proxy import RouterService, new_event_loop

__all__ = ["HTTP_LAYERS", "serve", "setup_process"]


HTTP_LAYERS = ("fast", "aiohttp")


def setup_process() -> None:
    """What a serving process sets once its service is built (the single process and every worker alike)."""
    # What start-up allocated (modules, the tokenizer, the app) lives as long as the process: out of the
    # collector's sight, a full collection no longer walks it while requests wait.
    gc.freeze()
    # Big requests are keyed and placed on worker threads; a thread that computes holds the GIL for up to the
    # switch interval each time the event loop's thread wants it back after a socket call, and a request takes
    # several. 1 ms instead of Python's 5 bounds what a computing thread adds to another client's request.
    sys.setswitchinterval(0.001)


def serve(
    service: RouterService,
    host: str,
    port: int,
    *,
    http: str = "fast",
    event_loop: str = "auto",
    reuse_port: bool = False,
    on_listening: Any = None,
    shutdown_timeout: float = 60.0,
    background: Sequence[Any] = (),
) -> None:
    """Serve ``service`` on ``host:port`` with the ``http`` layer until SIGTERM or SIGINT. ``on_listening()`` is
    called once it listens; each of ``background`` (``async fn()``) runs as a task meanwhile. Raises OSError
    when it cannot listen, ImportError for ``event_loop="uvloop"`` without uvloop."""
    if http not in HTTP_LAYERS:
        raise ValueError(f"http: expected one of {HTTP_LAYERS}, got {http!r}")
    loop = new_event_loop(event_loop)
    if http == "fast":
        from kvforge.service import fasthttp  # (httptools is needed only here)

        setup_process()
        fasthttp.run(
            service, host, port, loop=loop, reuse_port=reuse_port, on_listening=on_listening,
            shutdown_timeout=shutdown_timeout, background=background,
        )  # fmt: skip
        return
    app = service.make_app()
    for fn in background:
        app.cleanup_ctx.append(_background(fn))
    setup_process()
    web.run_app(
        app,
        host=host,
        port=port,
        reuse_port=reuse_port or None,
        access_log=None,
        print=None if on_listening is None else (lambda _banner: on_listening()),
        handler_cancellation=True,
        loop=loop,
        shutdown_timeout=shutdown_timeout,
    )


def _background(fn: Any) -> Any:
    async def ctx(app: web.Application) -> Any:
        task = asyncio.get_running_loop().create_task(fn())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx
