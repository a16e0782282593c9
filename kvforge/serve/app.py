"""The OpenAI-compatible HTTP front of ``kvforge serve`` (aiohttp), over one :class:`~kvforge.serve.loop.EngineLoop`.

Routes: ``POST /v1/completions`` (``prompt``: token ids, or text with a tokenizer), ``POST /v1/chat/completions``
(``messages``, needs a tokenizer; rendered exactly as ``kvforge router`` keys them, through
:class:`~kvforge.service.keys.Keyer`, so the router's keys match this server's KV events), both streaming (SSE,
one chunk per engine step that emitted tokens, ``data: [DONE]`` last) or not; ``GET /v1/models``; ``GET /health``
(503 once the engine loop died); ``GET /metrics`` (Prometheus, ``kvforge_serve_*``, with the engine's prefix-hit
counters). Decoding is greedy; ``temperature`` / ``top_p`` are accepted and ignored, and the fields that would
change the output in ways this engine does not support (``n`` > 1, ``stop``, ``logprobs``, ``echo``, ``suffix``,
``best_of`` > 1, batched prompts) are refused. Every choice carries ``token_ids`` (the generated ids);
``usage.prompt_tokens_details.cached_tokens`` is the prompt's reused length; ``system_fingerprint`` names the
server (``--instance-name``, default ``host:port``), so a client behind a router sees which engine answered.
A streamed response ends with an SSE comment before ``data: [DONE]``, ``: kvforge {"ttft_s": ...}``: this
server's own time to first token (handler entered -> first token chunk written), which SSE clients ignore and a
benchmark subtracts from its own to get what the router and the network add.

Every client error is an OpenAI-shaped JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status (404 for an unknown model or route, 405, 413 for a body over ``max_body_bytes``); an unexpected failure is a
500 of the same shape, never a traceback. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvforge.serve.loop import EngineLoop
from kvforge.service.keys import BadRequest, Keyer

__all__ = ["ServeApp", "ServeSettings"]

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"


class _ClientError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> web.Response:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _error_middleware(log: Any, max_body_bytes: int) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except _ClientError as exc:
            return _error(exc.status, exc.message, exc.param, exc.kind)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body: larger than {max_body_bytes} bytes", "body")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason or "error", None, "not_found_error" if exc.status == 404 else None)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # never a traceback to the client
            log.exception("unhandled error on %s", request.path)
            return _error(500, f"internal error: {type(exc).__name__}")

    return middleware


@dataclass(frozen=True)
class ServeSettings:
    """What the HTTP front needs besides the loop (validated by ``kvforge serve``'s parser and here)."""

    model_name: str = "tiny"
    tokenizer: str | None = None
    default_max_tokens: int = 16
    max_body_bytes: int = 16 * 2**20
    # Names this server in every response's ``system_fingerprint`` (which engine of a fleet answered).
    instance: str = "kvforge"

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name: expected a non-empty string, got {self.model_name!r}")
        for name in ("default_max_tokens", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")


class _Collector:
    """Engine and loop counters, read at scrape time."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self) -> list[Any]:
        st, eng = self.loop.stats, self.loop.engine
        out = []

        def counter(name: str, doc: str, v: float) -> None:
            c = CounterMetricFamily(f"kvforge_serve_{name}", doc)
            c.add_metric([], v)
            out.append(c)

        def gauge(name: str, doc: str, v: float) -> None:
            g = GaugeMetricFamily(f"kvforge_serve_{name}", doc)
            g.add_metric([], v)
            out.append(g)

        counter("requests_added", "Requests the engine accepted", st.requests_added)
        counter("requests_refused", "Requests the engine refused at add_request", st.requests_refused)
        counter("requests_finished", "Requests that finished", st.requests_finished)
        counter("requests_aborted", "Requests aborted (client gone)", st.requests_aborted)
        counter("prompt_tokens", "Prompt tokens of accepted requests", st.prompt_tokens)
        counter("prefix_hit_tokens", "Prompt tokens reused from the prefix cache at admission", st.cached_prompt_tokens)
        counter(
            "engine_reused_tokens", "The cache manager's reused tokens (every attempt)", eng.manager.stats.reused_tokens
        )
        counter("generated_tokens", "Tokens generated", st.generated_tokens)
        counter("steps", "Engine steps", st.steps)
        counter("step_seconds", "Seconds spent in Engine.step", st.step_seconds)
        counter("kv_event_batches", "KV-event batches published", st.event_batches)
        counter("kv_unmapped_blocks", "Stored blocks not published (tokens unknown)", st.unmapped_blocks)
        counter("step_errors", "Engine steps that raised", st.step_errors)
        gauge("live_requests", "Requests in the engine", self.loop.num_live)
        gauge("free_slots", "Engine slots free", eng.num_free_slots)
        for g in range(eng.manager.num_groups):
            gauge(f"available_pages_group{g}", f"GPU pages of pool group {g} free or evictable",
                  eng.manager.num_available_pages(g))  # fmt: skip
        gauge("healthy", "1 while the engine loop runs", 1.0 if self.loop.alive else 0.0)
        return out


def _opt_int(body: dict[str, Any], name: str, lo: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _ClientError(400, f"{name}: expected an integer, got {type(v).__name__}", name)
    if v < lo:
        raise _ClientError(400, f"{name}: expected an integer >= {lo}, got {v}", name)
    return v


def _opt_number(body: dict[str, Any], name: str) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _ClientError(400, f"{name}: expected a finite number >= 0, got {v!r:.40}", name)


def _opt_bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _ClientError(400, f"{name}: expected a boolean, got {type(v).__name__}", name)
    return v


class ServeApp:
    """The aiohttp application (see the module docstring). ``make_app()`` builds it; the loop must be started."""

    def __init__(self, loop: EngineLoop, settings: ServeSettings | None = None) -> None:
        import logging

        self.loop = loop
        self.settings = settings or ServeSettings()
        self.keyer = (
            Keyer(loop.engine.config.tokens_per_block, tokenizer=self.settings.tokenizer)
            if self.settings.tokenizer
            else None
        )
        self.vocab = loop.engine.model.config.vocab_size
        self.log = logging.getLogger("kvforge.serve")
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(loop))  # type: ignore[arg-type]
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("kvforge_serve_ttft_seconds", "Request to first token", buckets=buckets,
                              registry=self.registry)  # fmt: skip
        self.e2e = Histogram("kvforge_serve_request_seconds", "Request to last token", buckets=buckets,
                             registry=self.registry)  # fmt: skip
        self.created = int(time.time())

    def make_app(self) -> web.Application:
        mw = _error_middleware(self.log, self.settings.max_body_bytes)
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[mw])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post(_COMPLETIONS, self._complete)
        app.router.add_post(_CHAT, self._complete)
        return app

    # --- simple routes -------------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.loop.alive
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        cfg = self.loop.engine.config
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvforge",
            "max_model_len": cfg.max_blocks_per_request * cfg.tokens_per_block,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    # --- completions ---------------------------------------------------------------------------------------------

    def _prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == _CHAT:
            if self.keyer is None:
                raise _ClientError(400, "messages: chat completions need a server started with --tokenizer", "messages")
            try:
                ids = self.keyer.prompt_token_ids(path, body)
            except BadRequest as exc:
                raise _ClientError(400, str(exc), str(exc).split(":")[0].split("[")[0]) from None
            if not ids:
                raise _ClientError(400, "messages: they render to an empty prompt", "messages")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                if len(prompt) != 1:
                    raise _ClientError(400, "prompt: expected one prompt (batches are not supported)", "prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if self.keyer is None:
                    raise _ClientError(400, "prompt: text prompts need a server started with --tokenizer", "prompt")
                if not prompt:
                    raise _ClientError(400, "prompt: expected a non-empty string", "prompt")
                ids = self.keyer.encode(prompt, add_special_tokens=True)
            elif isinstance(prompt, list) and prompt:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    raise _ClientError(400, "prompt: expected a list of integer token ids", "prompt")
                ids = prompt
            else:
                raise _ClientError(400, "prompt: expected a string, a non-empty list of token ids, or one of either",
                                   "prompt")  # fmt: skip
            if not ids:
                raise _ClientError(400, "prompt: it encodes to no tokens", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise _ClientError(400, f"prompt: token ids must be in [0, {self.vocab}), got {bad[:4]}", "prompt")
        return list(ids)

    async def _parse(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise _ClientError(400, f"body: not valid JSON ({exc})", "body") from None
        if not isinstance(body, dict):
            raise _ClientError(400, f"body: expected a JSON object, got {type(body).__name__}", "body")
        return body

    def _check(self, path: str, body: dict[str, Any]) -> tuple[list[int], int, bool, bool]:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _ClientError(400, f"model: expected a string, got {type(model).__name__}", "model")
        if model is not None and model != self.settings.model_name:
            raise _ClientError(404, f"model: '{model:.80}' does not exist; this server serves "
                               f"'{self.settings.model_name}'", "model", "not_found_error")  # fmt: skip
        max_tokens = _opt_int(body, "max_tokens", 1)
        mct = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = mct if mct is not None else self.settings.default_max_tokens
        n = _opt_int(body, "n", 1)
        if n is not None and n != 1:
            raise _ClientError(400, f"n: only 1 is supported, got {n}", "n")
        best_of = _opt_int(body, "best_of", 1)
        if best_of is not None and best_of != 1:
            raise _ClientError(400, f"best_of: only 1 is supported, got {best_of}", "best_of")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            if name.endswith("penalty"):
                v = body.get(name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                    raise _ClientError(400, f"{name}: expected a finite number, got {v!r:.40}", name)
            else:
                _opt_number(body, name)
        for name in ("stop", "suffix"):
            if body.get(name) not in (None, [], ""):
                raise _ClientError(400, f"{name}: not supported by this server", name)
        if body.get("logprobs") not in (None, False):
            raise _ClientError(400, "logprobs: not supported by this server", "logprobs")
        if _opt_bool(body, "echo"):
            raise _ClientError(400, "echo: not supported by this server", "echo")
        stream = _opt_bool(body, "stream")
        so = body.get("stream_options")
        usage_in_stream = False
        if so is not None:
            if not isinstance(so, dict):
                raise _ClientError(400, f"stream_options: expected an object, got {type(so).__name__}",
                                   "stream_options")  # fmt: skip
            usage_in_stream = _opt_bool(so, "include_usage")
        ids = self._prompt_ids(path, body)
        return ids, max_tokens, stream, usage_in_stream

    def _decode(self, ids: list[int]) -> str:
        if self.keyer is None or self.keyer.tokenizer is None:
            return ""
        return self.keyer.tokenizer.decode(ids, skip_special_tokens=False)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = request.path
        body = await self._parse(request)
        ids, max_tokens, stream, usage_in_stream = self._check(path, body)
        if not self.loop.alive:
            raise _ClientError(503, "engine: the serving loop is not running", None, "server_error")
        rid = self.loop.new_id()
        queue = self.loop.submit(rid, ids, max_tokens)
        done = False
        try:
            kind, payload = await queue.get()
            if kind == "error":
                done = True
                raise _ClientError(400, payload, "prompt" if payload.startswith("tokens") else None)
            chat = path == _CHAT
            cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            out: list[int] = []
            first_at: float | None = None
            written_at = t0
            cached = 0
            if not stream:
                reason = "length"
                while True:
                    kind, payload = await queue.get()
                    if kind == "cached":
                        cached = payload
                    elif kind == "tokens":
                        if first_at is None:
                            first_at = time.perf_counter()
                            self.ttft.observe(first_at - t0)
                        out.extend(payload)
                    elif kind == "done":
                        done, reason = True, payload
                        break
                if reason == "error":
                    raise _ClientError(500, "engine: the step running this request failed", None, "server_error")
                self.e2e.observe(time.perf_counter() - t0)
                text = self._decode(out)
                choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "token_ids": out}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                    choice["logprobs"] = None
                return web.json_response(
                    {
                        "id": cid,
                        "object": "chat.completion" if chat else "text_completion",
                        "created": int(time.time()),
                        "model": self.settings.model_name,
                        "system_fingerprint": self.settings.instance,
                        "choices": [choice],
                        "usage": self._usage(len(ids), len(out), cached),
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            created = int(time.time())

            def chunk(delta: dict[str, Any] | None, text: str, toks: list[int], reason: str | None) -> bytes:
                c: dict[str, Any] = {"index": 0, "finish_reason": reason, "token_ids": toks}
                if chat:
                    c["delta"] = delta if delta is not None else {}
                else:
                    c["text"] = text
                    c["logprobs"] = None
                msg = {"id": cid, "object": obj, "created": created, "model": self.settings.model_name,
                       "system_fingerprint": self.settings.instance, "choices": [c]}  # fmt: skip
                return b"data: " + json.dumps(msg).encode() + b"\n\n"

            if chat:
                await resp.write(chunk({"role": "assistant", "content": ""}, "", [], None))
            text_sent = ""
            reason = "length"
            while True:
                kind, payload = await queue.get()
                if kind == "done":
                    done, reason = True, payload
                    break
                if kind == "cached":
                    cached = payload
                    continue
                first = first_at is None
                if first:
                    first_at = time.perf_counter()
                    self.ttft.observe(first_at - t0)
                out.extend(payload)
                full = self._decode(out)
                delta = full[len(text_sent) :] if full.startswith(text_sent) else full
                text_sent = full
                await resp.write(chunk({"content": delta}, delta, list(payload), None))
                if first:
                    written_at = time.perf_counter()
            if reason == "error":
                err = {"error": {"message": "engine: the step running this request failed", "type": "server_error",
                                 "param": None, "code": 500}}  # fmt: skip
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            else:
                self.e2e.observe(time.perf_counter() - t0)
                await resp.write(chunk({}, "", [], reason))
                if usage_in_stream:
                    msg = {"id": cid, "object": obj, "created": created, "model": self.settings.model_name,
                           "choices": [], "usage": self._usage(len(ids), len(out), cached)}  # fmt: skip
                    await resp.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
            if first_at is not None:
                await resp.write(b": kvforge " + json.dumps({"ttft_s": written_at - t0}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            if not done:
                self.loop.abort(rid)  # client gone (cancelled) or a write failed: free its slot and pages

    @staticmethod
    def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
