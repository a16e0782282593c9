"""In-process fakes for tests and benchmarks: an OpenAI-compatible backend, a tiny tokenizer, trace prompts.

:class:`FakeBackend` serves ``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` (and
minimal ``/v1/embeddings`` and ``/v1/responses``) on
127.0.0.1 (a free port), streaming ``max_tokens`` tokens (capped by ``max_output_tokens``) at
``tokens_per_s`` as SSE chunks. It keeps an unbounded prefix cache of the router's own keys (computed with the
same :class:`~kvforge.service.keys.Keyer`) to count hits, and, given a :class:`KVEventPublisher`, publishes
``BlockStored`` for the prompt's token ids in engine blocks of ``engine_block_size`` under its own hash
function (so the router can only map them through token ids). ``kill()`` drops the listener and every open
connection at once; ``hang`` makes requests wait forever; ``health_ok = False`` fails its health checks.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from kvforge.service.keys import Keyer
from kvforge.service.kv_events import BlockStored, KVEventPublisher

__all__ = ["FakeBackend", "build_tokenizer", "trace_text"]


def build_tokenizer(path: str | Path, vocab_words: int = 512) -> Path:
    """Save a word-level ``tokenizer.json`` (``w0`` .. ``w{n-1}`` plus role markers) and return its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    for w in [f"w{i}" for i in range(vocab_words)] + ["<|user|>", "<|assistant|>", "<|system|>"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(path)
    tok.save(str(path))
    return path


_LETTERS = bytes((b"abcdefghijklmnopqrstuvwxyz "[i % 27]) for i in range(256))


@functools.lru_cache(maxsize=65536)
def _block_text(hash_id: int, chars: int) -> str:
    return random.Random(hash_id).randbytes(chars).translate(_LETTERS).decode()


def trace_text(
    hash_ids: Sequence[int], input_length: int, block_tokens: int = 512, chars_per_token: float = 4.0
) -> str:
    """A prompt of ``input_length`` estimated tokens whose i-th block of ``block_tokens`` depends only on
    ``hash_ids[: i + 1]`` (as the trace's ids do), so equal id prefixes give equal text prefixes."""
    chars = round(block_tokens * chars_per_token)
    return "".join(_block_text(h, chars) for h in hash_ids)[: max(1, round(input_length * chars_per_token))]


def _engine_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(json.dumps(list(tokens)).encode())
    return h.digest()


class FakeBackend:
    def __init__(
        self,
        keyer: Keyer,
        *,
        tokens_per_s: float = 1000.0,
        tokens_per_chunk: int = 1,
        max_output_tokens: int = 16,
        publisher: KVEventPublisher | None = None,
        engine_block_size: int = 16,
        name: str = "fake",
    ) -> None:
        self.keyer = keyer
        self.tokens_per_s = tokens_per_s
        self.tokens_per_chunk = tokens_per_chunk
        self.max_output_tokens = max_output_tokens
        self.publisher = publisher
        self.engine_block_size = engine_block_size
        self.name = name
        self.hang = False
        self.health_ok = True
        self.cache: set[Any] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.requests: list[dict[str, Any]] = []
        self._engine_blocks: set[bytes | int] = set()
        self._runner: web.AppRunner | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/embeddings", self._embed)
        app.router.add_post("/v1/responses", self._respond)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.05, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        if self.publisher is not None and self.publisher.replay_endpoint is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self.url

    async def _serve_replay(self) -> None:
        assert self.publisher is not None
        while True:
            self.publisher.serve_replay()
            await asyncio.sleep(0.005)

    async def kill(self) -> None:
        """Stop listening and cut every open connection (as a crashed server would)."""
        if self._replay_task is not None:
            self._replay_task.cancel()
        if self._runner is not None:
            server = self._runner.server
            if server is not None:
                for conn in list(server.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": self.health_ok}, status=200 if self.health_ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]})

    def _account(self, path: str, body: dict[str, Any]) -> None:
        keys, n = self.keyer.keys_for_body(path, body)
        hit = 0
        for k in keys:
            if k not in self.cache:
                break
            hit += 1
        self.cache.update(keys)
        self.prompt_tokens += n
        self.hit_tokens += min(hit * self.keyer.tokens_per_block, n)
        if self.publisher is not None and self.keyer.uses_tokens:
            self._publish(self.keyer.prompt_token_ids(path, body))

    def _publish(self, ids: Sequence[int]) -> None:
        assert self.publisher is not None
        bs = self.engine_block_size
        parent: bytes | None = None
        new_hashes: list[bytes | int] = []
        new_tokens: list[int] = []
        first_parent: bytes | None = None
        for i in range(len(ids) // bs):
            blk = ids[i * bs : (i + 1) * bs]
            h = _engine_hash(parent, blk)
            if h not in self._engine_blocks:
                if not new_hashes:
                    first_parent = parent
                new_hashes.append(h)
                new_tokens.extend(blk)
            parent = h
        if new_hashes:
            self._engine_blocks.update(new_hashes)
            self.publisher.publish([BlockStored(new_hashes, first_parent, new_tokens, bs, None, "GPU", None)])

    async def _embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"conversation": request.headers.get("X-Conversation-Id"), "body": body,
                              "path": request.path})  # fmt: skip
        return web.json_response({"object": "list", "data": [{"object": "embedding", "index": 0,
                                  "embedding": [0.0, 1.0]}], "model": "fake", "backend": self.name})  # fmt: skip

    async def _respond(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"conversation": request.headers.get("X-Conversation-Id"), "body": body,
                              "path": request.path})  # fmt: skip
        return web.json_response({"id": "resp_x", "object": "response", "status": "completed", "output": [],
                                  "backend": self.name})  # fmt: skip

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"conversation": request.headers.get("X-Conversation-Id"), "body": body})
        if self.hang:
            await asyncio.sleep(3600)
        self._account(request.path, body)
        n = min(int(body.get("max_tokens") or self.max_output_tokens), self.max_output_tokens)
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            await asyncio.sleep(n / self.tokens_per_s)
            text = " ".join(f"w{i % 7}" for i in range(n))
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            return web.json_response(
                {"id": "x", "object": "chat.completion", "choices": [choice], "backend": self.name}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        step = self.tokens_per_chunk
        for i in range(0, n, step):
            await asyncio.sleep(min(step, n - i) / self.tokens_per_s)
            delta = " ".join(f"w{j % 7}" for j in range(i, min(n, i + step)))
            choice = {"index": 0, "delta": {"content": delta}} if chat else {"index": 0, "text": delta}
            await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [choice], 'backend': self.name})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
