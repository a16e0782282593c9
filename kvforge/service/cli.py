"""``kvforge router``: argument parsing and the server's main loop.

Every value is checked by argparse (a bad one is a one-line usage error, exit status 2) and again by
:class:`~kvforge.service.proxy.ServiceConfig`, whose ``ValueError`` is reported the same way.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from kvforge.service.keys import POLICIES
from kvforge.service.urls import normalize_backend_url

__all__ = ["DESCRIPTION", "add_arguments", "config_from_args", "run"]

DESCRIPTION = (
    "Route OpenAI-compatible requests (/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, "
    "/v1/models, /v1/models/{id}) over a fleet of "
    "engines with kvforge's conversation router; streams pass through chunk by chunk. Also serves /metrics "
    '(Prometheus), /health and /admin/backends (GET lists, POST {"url": ...} adds, DELETE ?url=... removes).'
)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return v


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"int>={lo}"
    return parse


def _url(text: str) -> str:
    try:
        return normalize_backend_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    v = _int_at_least(0)(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {v}")
    return v


def _endpoint(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise argparse.ArgumentTypeError(f"expected a ZMQ endpoint like tcp://host:5557, got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet")
    g.add_argument(
        "--backend",
        action="append",
        type=_url,
        default=[],
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://10.0.0.1:8000 (repeat for each; at least one, "
        "or --backends-file)",
    )
    g.add_argument(
        "--backends-file",
        metavar="PATH",
        help="a file of backends, one 'URL [kv_events=tcp://..] [kv_replay=tcp://..]' per line, "
        "re-read when it changes (adds and removes at run time)",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="conversation",
        help="conversation: sticky by conversation, new ones follow a specific prefix (default); "
        "conversation-always: follow any matched prefix; cache-aware: SGLang-like; "
        "least-load; round-robin. Only conversation and conversation-always use --kv-events: a new "
        "conversation goes where the engines announce its prefix (under conversation, unless the router has "
        "seen that prefix shared by many conversations)",
    )
    g.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on /admin/backends (default: no check)",
    )
    g = p.add_argument_group("keys")
    g.add_argument(
        "--tokenizer",
        metavar="tokenizer.json",
        help="a local tokenizers file: keys from token ids (required with --kv-events); default: keys from text chunks",
    )
    g.add_argument(
        "--chat-template",
        metavar="PATH",
        help="the model's tokenizer_config.json (its chat_template) or a Jinja file: chat requests are keyed as "
        "the engine renders them, so their keys match its KV events (default: role-tagged messages)",
    )
    g.add_argument(
        "--tokens-per-block",
        type=_int_at_least(1),
        default=128,
        help="router block size in tokens; with KV events, a multiple of the engines' block size (default 128)",
    )
    g.add_argument(
        "--chars-per-token",
        type=_positive_float,
        default=4.0,
        help="text-chunk keys: characters per estimated token (default 4)",
    )
    g.add_argument(
        "--conversation-header",
        default="X-Conversation-Id",
        metavar="NAME",
        help="request header naming the conversation (a 'conversation_id' body field works too; "
        "default X-Conversation-Id)",
    )
    g.add_argument(
        "--request-ttl-s",
        type=_positive_float,
        default=3600.0,
        help="reclaim the load of a request never finished after this long (default 3600)",
    )
    g = p.add_argument_group("timeouts and health")
    g.add_argument("--connect-timeout-s", type=_positive_float, default=3.0, help="TCP connect (default 3)")
    g.add_argument(
        "--read-timeout-s",
        type=_positive_float,
        default=300.0,
        help="longest silence from a backend, before its headers or between chunks: the request fails (504 "
        "before the headers), the backend stays in rotation (default 300)",
    )
    g.add_argument(
        "--request-timeout-s", type=_positive_float, default=1800.0, help="longest whole request (default 1800)"
    )
    g.add_argument(
        "--max-retries",
        type=_int_at_least(0),
        default=2,
        help="attempts moved to another backend when one fails before responding (default 2)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_int_at_least(1),
        default=8 * 2**20,
        help="largest request body, after decompression; larger ones get 413 (default 8 MiB)",
    )
    g.add_argument(
        "--body-timeout-s",
        type=_positive_float,
        default=30.0,
        help="longest wait for a whole request body; a slower one gets 408 and its connection closed (default 30)",
    )
    g.add_argument("--health-path", default="/health", help="GET path of the health check (default /health)")
    g.add_argument("--health-interval-s", type=_positive_float, default=2.0, help="between checks (default 2)")
    g.add_argument("--health-timeout-s", type=_positive_float, default=1.0, help="per check (default 1)")
    g.add_argument(
        "--unhealthy-after",
        type=_int_at_least(1),
        default=2,
        help="failed checks that eject a backend (default 2; a refused or reset connection ejects at once, "
        "a slow answer never does)",
    )
    g.add_argument(
        "--healthy-after",
        type=_int_at_least(1),
        default=1,
        help="passed checks that bring an ejected backend back (default 1)",
    )
    g = p.add_argument_group("KV events (vLLM --kv-events-config publisher)")
    g.add_argument(
        "--kv-events",
        action="append",
        type=_endpoint,
        default=[],
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint of each --backend's KV events, in the same order, e.g. tcp://10.0.0.1:5557 "
        "(needs --tokenizer; used by --policy conversation and conversation-always)",
    )
    g.add_argument(
        "--kv-replay",
        action="append",
        type=_endpoint,
        default=[],
        metavar="ENDPOINT",
        help="ZMQ replay (ROUTER) endpoint of each --backend, in the same order, e.g. tcp://10.0.0.1:5558",
    )
    g.add_argument("--kv-topic", default="", help="topic the engines publish on (default '')")
    g.add_argument(
        "--kv-group",
        type=_int_at_least(0),
        default=0,
        help="KV-cache group whose events are used on hybrid models (default 0)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8080, help="listen port (default 8080)")
    g.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="debug logs one JSON line per request (default info)",
    )
    g.add_argument("--log-format", choices=("json", "text"), default="json", help="default json")
    _add_worker_arguments(g)
    g.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="auto: uvloop when it is installed (less CPU per request), else asyncio (default auto)",
    )
    g.add_argument(
        "--http",
        choices=("fast", "aiohttp"),
        default="fast",
        help="HTTP layer: fast (asyncio protocols and httptools, least CPU per request) or aiohttp (default fast)",
    )


def _workers(text: str) -> int:
    import socket

    from kvforge.service.shared_state import max_workers

    hi = max_workers()
    v = _int_at_least(1)(text)
    if v > hi:
        raise argparse.ArgumentTypeError(f"expected 1..{hi} (4 per core), got {v}")
    if v > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise argparse.ArgumentTypeError(f"{v} workers need SO_REUSEPORT, which this platform lacks; use 1")
    return v


def _power_of_two(text: str) -> int:
    v = _int_at_least(8)(text)
    if v & (v - 1) or v > 1 << 24:
        raise argparse.ArgumentTypeError(f"expected a power of two in 8..{1 << 24}, got {v}")
    return v


def _add_worker_arguments(g) -> None:
    g.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="router processes on one port (SO_REUSEPORT), sharing conversation owners and backend load in "
        "shared memory; policies conversation, conversation-always, least-load, round-robin (default 1)",
    )
    g.add_argument(
        "--shared-conversations",
        type=_power_of_two,
        default=1 << 17,
        help="--workers > 1: entries of the shared conversation map; the least recently used of 8 neighbours "
        "is forgotten when full (default 131072, 4 MiB)",
    )
    g.add_argument(
        "--shutdown-grace-s",
        type=_positive_float,
        default=10.0,
        help="--workers > 1: on SIGTERM/SIGINT, how long workers may finish before SIGKILL (default 10)",
    )


def config_from_args(args: argparse.Namespace):
    from kvforge.service.proxy import ServiceConfig

    return ServiceConfig.from_args(args)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    http = getattr(args, "http", "fast")
    try:
        import aiohttp  # noqa: F401  (the service's modules import it; the fast layer's client uses httptools)

        if http == "fast":
            import httptools  # noqa: F401

        from kvforge.service.metrics import configure_logging
        from kvforge.service.proxy import RouterService
        from kvforge.service.server import serve
    except ImportError as exc:
        print(f"kvforge router: error: {exc.name} is missing; install kvforge[router]", file=sys.stderr)
        return 1

    if getattr(args, "workers", 1) > 1:
        from kvforge.service.workers import run_workers

        return run_workers(args)
    try:
        cfg = config_from_args(args)
        service = RouterService(cfg)
    except ValueError as exc:
        print(f"kvforge router: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("kvforge.service").info(
        "router listening",
        extra={"fields": {"host": args.host, "port": args.port, "policy": cfg.policy, "backends": list(cfg.backends),
                          "http": http}},
    )  # fmt: skip
    try:
        serve(service, args.host, args.port, http=http, event_loop=args.event_loop)
    except ImportError:
        print("kvforge router: error: --event-loop uvloop: uvloop is not installed", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvforge router: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
