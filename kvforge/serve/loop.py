"""The serving loop: one :class:`~kvforge.engine.Engine` stepped by one background thread, fed from asyncio.

Contract:

* :meth:`EngineLoop.submit` queues a request (thread-safe) and returns an ``asyncio.Queue`` on the caller's loop
  that receives, in order: ``("accepted", None)`` once ``Engine.add_request`` took it, or ``("error", message)``
  when it refused it (bad ids, a request that can never fit); then ``("cached", n)`` once admitted (the prompt
  tokens reused from the prefix cache); ``("tokens", ids)`` for each step that emitted tokens; then
  ``("done", reason)`` (``"length"``, ``"abort"`` or ``"error"``).
* :meth:`EngineLoop.abort` (thread-safe) finishes a request between steps (``Engine.abort``: its slot and pages
  are freed); aborting an unknown or finished request does nothing. Requests join and leave only between steps.
* The engine's block events (``BlockStored`` / ``BlockRemoved``) are published after each step in vLLM's wire
  format through :class:`~kvforge.service.kv_events.KVEventPublisher` (one batch per step that had events);
  ``AllBlocksCleared`` is the first batch a loop publishes (a restarted engine's subscribers drop its old
  blocks). ``BlockStored`` carries the stored blocks' token ids, looked up from the requests that committed them.
* A step that raises fails every live request with ``("done", "error")``; if aborting them fails too, the loop
  stops stepping and :attr:`EngineLoop.healthy` turns False (``/health`` answers 503).
* With ``step_log`` (a writable text file), each step appends one JSON line: ``t0`` / ``t1`` (``time.monotonic``,
  one clock for every process of the machine), ``prefill`` (the context chunks as ``[start, tokens]``),
  ``decode_requests`` and ``decode_context`` (the generation rows and their context tokens): what
  :mod:`kvforge.sim.profile` fits, so a benchmark can set each real step against the profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvforge.kvcache import events as kv

logger = logging.getLogger("kvforge.serve")

__all__ = ["EngineLoop", "LoopStats"]


@dataclass
class LoopStats:
    """Running totals (written by the engine thread; ints read from any thread)."""

    requests_added: int = 0
    requests_refused: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    event_batches: int = 0
    unmapped_blocks: int = 0
    step_errors: int = 0


@dataclass
class _Live:
    request: Any
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: int = 0
    counted_reuse: bool = False
    # Block keys this request's committed blocks have, with their tokens (for BlockStored's token ids).
    keys: list[Hashable] = field(default_factory=list)


class EngineLoop:
    """See the module docstring. ``publisher`` is optional (no KV events without one)."""

    def __init__(
        self, engine: Any, publisher: Any | None = None, *, idle_wait_s: float = 0.005, step_log: Any | None = None
    ) -> None:
        self.engine = engine
        self.step_log = step_log
        self._batch: Any = None
        if step_log is not None:
            schedule = engine.scheduler.schedule

            def recorded() -> Any:
                self._batch = schedule()
                return self._batch

            engine.scheduler.schedule = recorded
        self.publisher = publisher
        self.idle_wait_s = idle_wait_s
        self.stats = LoopStats()
        self.healthy = True
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[Hashable, _Live] = {}
        self._tokens: dict[Hashable, tuple[int, ...]] = {}
        self._events: list[Any] = []
        self._ids = 0
        self._id_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
        engine.manager.block_pool.set_event_sink(self._events.append)
        if publisher is not None:
            self._publish([kv.AllBlocksCleared()])

    # --- any thread ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.manager.block_pool.set_event_sink(None)
        if self.publisher is not None:
            self.publisher.close()
        if self.step_log is not None:
            self.step_log.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.healthy

    def new_id(self) -> int:
        with self._id_lock:
            self._ids += 1
            return self._ids

    def submit(self, request_id: Hashable, tokens: list[int], max_new_tokens: int) -> asyncio.Queue:
        """Queue a request from a coroutine; see the module docstring for what the returned queue receives."""
        queue: asyncio.Queue = asyncio.Queue()
        self._inbox.append(("add", request_id, tokens, max_new_tokens, queue, asyncio.get_running_loop()))
        self._wake.set()
        return queue

    def abort(self, request_id: Hashable) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    @property
    def num_live(self) -> int:
        return len(self._live)

    # --- the engine thread ---------------------------------------------------------------------------------------

    def _send(self, live: _Live, item: tuple[str, Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody is listening
            live.loop.call_soon_threadsafe(live.queue.put_nowait, item)

    def _drain(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, rid, tokens, max_new, queue, loop = cmd
                live = _Live(None, queue, loop)
                try:
                    live.request = self.engine.add_request(rid, tokens, max_new)
                except (TypeError, ValueError) as exc:
                    self.stats.requests_refused += 1
                    self._send(live, ("error", str(exc)))
                    continue
                self._live[rid] = live
                self.stats.requests_added += 1
                self.stats.prompt_tokens += len(tokens)
                self._send(live, ("accepted", None))
            else:
                live_or_none = self._live.pop(cmd[1], None)
                if live_or_none is None:
                    continue
                with contextlib.suppress(ValueError):
                    self.engine.abort(cmd[1])
                self.engine.outputs.pop(cmd[1], None)
                self.stats.requests_aborted += 1
                self._forget(live_or_none)
                self._send(live_or_none, ("done", "abort"))

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain()
            if self.publisher is not None:
                self.publisher.serve_replay()
            if not self.healthy or not eng.scheduler.has_unfinished:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            m0 = time.monotonic()
            try:
                eng.step()
            except Exception as exc:
                self._fail_all(exc)
                continue
            self.stats.step_seconds += time.perf_counter() - t0
            self.stats.steps += 1
            if self.step_log is not None and self._batch is not None:
                self._log_step(m0, time.monotonic())
            self._deliver()
            self._flush_events()
            self._reap()

    def _log_step(self, t0: float, t1: float) -> None:
        b, self._batch = self._batch, None
        gen = list(b.generation)
        rec = {"t0": t0, "t1": t1, "prefill": [[c.start, c.num_tokens] for c in b.context],
               "decode_requests": len(gen), "decode_context": sum(g.start for g in gen)}  # fmt: skip
        log = self.step_log
        assert log is not None  # only called with a step log
        log.write(json.dumps(rec) + "\n")

    def _fail_all(self, exc: Exception) -> None:
        logger.exception("engine step failed; failing %d live requests", len(self._live))
        self.stats.step_errors += 1
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                self.healthy = False
            self._send(live, ("done", "error"))
        self._live.clear()
        self._tokens.clear()
        self._events.clear()

    def _deliver(self) -> None:
        for live in self._live.values():
            req = live.request
            if not live.counted_reuse and req.cache is not None:
                live.counted_reuse = True
                n = min(req.cache.num_reused_tokens, req.prompt_len)
                self.stats.cached_prompt_tokens += n
                self._send(live, ("cached", n))
            out = req.output_tokens
            if len(out) > live.sent:
                new = list(out[live.sent :])
                live.sent = len(out)
                self.stats.generated_tokens += len(new)
                self._send(live, ("tokens", new))

    def _reap(self) -> None:
        for rid in [rid for rid, live in self._live.items() if live.request.is_done]:
            live = self._live.pop(rid)
            self.stats.requests_finished += 1
            self._forget(live)
            self._send(live, ("done", "length"))
            self.engine.finished.pop(rid, None)
            self.engine.outputs.pop(rid, None)

    # --- events --------------------------------------------------------------------------------------------------

    def _forget(self, live: _Live) -> None:
        for k in live.keys:
            self._tokens.pop(k, None)
        live.keys.clear()

    def _learn(self) -> None:
        """Map the committed blocks of every live request to their tokens (prompt keys as the scheduler computed
        them, generated blocks keyed by the manager's hasher from their parent: the same chain)."""
        tpb = self.engine.config.tokens_per_block
        hasher = self.engine.manager.hasher
        for live in self._live.values():
            req = live.request
            seq = (*req.tokens, *req.output_tokens)
            n_full = len(seq) // tpb
            have = len(live.keys)
            if have >= n_full:
                continue
            prompt_keys = req.block_keys or ()
            new_keys: list[Hashable] = list(prompt_keys[have : min(n_full, len(prompt_keys))])
            start = have + len(new_keys)
            if start < n_full:
                parent = (new_keys or live.keys or [None])[-1]
                if parent is None:
                    parent = hasher.root_key(req.scope, req.cache_salt)
                new_keys.extend(hasher.block_keys(seq[start * tpb : n_full * tpb], tpb, parent=parent))
            for i, k in enumerate(new_keys, start=have):
                self._tokens[k] = tuple(seq[i * tpb : (i + 1) * tpb])
            live.keys.extend(new_keys)

    def _flush_events(self) -> None:
        if not self._events:
            return
        events, self._events[:] = list(self._events), []
        if self.publisher is None:
            return
        if any(isinstance(e, kv.BlockStored) and any(k not in self._tokens for k in e.block_keys) for e in events):
            self._learn()
        out: list[Any] = []
        for e in events:
            if isinstance(e, kv.BlockStored):
                missing = [k for k in e.block_keys if k not in self._tokens]
                if missing:
                    # Cannot happen for blocks a live request committed; counted, never published half-known.
                    self.stats.unmapped_blocks += len(e.block_keys)
                    continue
            out.append(e)
        if out:
            self._publish(out)

    def _publish(self, events: list[Any]) -> None:
        from kvforge.service.kv_events import from_kvforge_event

        assert self.publisher is not None
        wire = []
        for e in events:
            if isinstance(e, kv.BlockStored):
                toks = [t for k in e.block_keys for t in self._tokens[k]]
                wire.append(from_kvforge_event(e, toks))
            else:
                wire.append(from_kvforge_event(e))
        self.publisher.publish(wire)
        self.stats.event_batches += 1
