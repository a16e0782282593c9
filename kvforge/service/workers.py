"""``kvforge router --workers N``: N router processes on one port, sharing what only the router knows.

:func:`run_workers` is the supervising parent: it validates the configuration, reserves the port (``--port 0``
resolves once for all), creates the :class:`~kvforge.service.shared_state.SharedState` block and starts N spawned
workers, each listening on the port with ``SO_REUSEPORT``. It restarts nothing: a worker that exits is logged
with its status, its process group is killed and its load row zeroed; with none left the parent exits 1.
SIGTERM / SIGINT stop every worker (SIGKILL after ``--shutdown-grace-s``, then what is left of its process
group), remove the shared block and exit 0.

Each worker is a :class:`~kvforge.service.proxy.RouterService` whose fleet is a :class:`SharedFleet`: it
subscribes to every engine's KV events itself; a request goes to the owner the shared conversation map names
(by conversation id, or by the last block of the prompt it extends) when that one is in rotation, else it is
placed (``conversation*``: the longest held run of the prompt's leading blocks within
:class:`~kvforge.routing.ImbalanceGuard`'s bound, else the fewest prompt tokens in flight over all workers;
``least-load``; ``round-robin``; ``cache-aware`` is refused) and claimed, first claim winning. Health checks,
the backends file and metrics are per worker; ``/admin/backends`` refuses POST/DELETE (409). The rules in full:
``docs/router_service.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence
from typing import Any

from kvforge.kvcache.hashing import SALT_ENV
from kvforge.routing import ImbalanceGuard
from kvforge.service.proxy import (
    Backend,
    Fleet,
    NoBackend,
    Reply,
    RouterService,
    ServiceConfig,
    _Epoch,
    _error,
    _json,
)
from kvforge.service.server import serve
from kvforge.service.shared_state import SharedState, max_workers
from kvforge.service.urls import normalize_backend_url

__all__ = ["MULTI_WORKER_POLICIES", "SharedFleet", "WorkerService", "max_workers", "run_workers"]

logger = logging.getLogger("kvforge.service")

MULTI_WORKER_POLICIES = ("conversation", "conversation-always", "least-load", "round-robin")
_MIN_FOLLOW_BLOCKS = 2
_MATCH_SHARE = 0.75  # an anonymous prompt continues a conversation whose last prompt covers this share of it
_MAX_BACK = 64  # blocks searched back from a prompt's end for that conversation's last block
# Leading blocks compared with each engine's events: a decision stays well under a millisecond on the event loop
# for any prompt (a longer held run counts as this long).
_MAX_HELD_SCAN = 4096


class _NullRouter:
    """Stands in for the per-process router: a SharedFleet places requests itself."""

    def add_server(self, server: Hashable) -> None:
        pass

    def remove_server(self, server: Hashable) -> None:
        pass

    def set_server_available(self, server: Hashable, available: bool) -> None:
        pass

    def on_event(self, server: Hashable, event: Any) -> None:
        pass

    def loads(self) -> dict[Hashable, float]:
        return {}


class SharedFleet(Fleet):
    """A worker's fleet: placement from the shared conversation map, shared load and its own event index."""

    def __init__(self, cfg: ServiceConfig, metrics_cb: Any, state: SharedState, worker: int) -> None:
        if cfg.policy not in MULTI_WORKER_POLICIES:
            raise ValueError(
                f"policy: {cfg.policy!r} keeps per-process state; with several workers use one of "
                f"{MULTI_WORKER_POLICIES}"
            )
        if not 0 <= worker < state.workers:
            raise ValueError(f"worker: expected 0..{state.workers - 1}, got {worker!r}")
        self.state = state
        self.worker = worker
        self._slot_of: dict[str, int] = {}
        self._by_slot: dict[int, Backend] = {}
        self._rotation: list[tuple[Backend, int]] | None = None
        self._in_flight_here: dict[Hashable, tuple[int, int]] = {}
        self.placed: dict[str, int] = {}
        self._rotor = worker
        self._follow = cfg.policy in ("conversation", "conversation-always")
        self._guard = ImbalanceGuard()
        super().__init__(cfg, metrics_cb)

    # ---------------------------------------------------------------- membership (the rotation cache)

    def add(
        self, url: str, kv_events: str | None = None, kv_replay: str | None = None, *, from_file: bool = False
    ) -> Backend:
        # The shared slot first: a full table refuses the backend before anything (a subscriber) starts.
        slot = self.state.backend_slot(normalize_backend_url(url))
        b = super().add(url, kv_events, kv_replay, from_file=from_file)
        self._slot_of[b.url] = slot
        self._by_slot[slot] = b
        self.placed.setdefault(b.url, 0)
        self._rotation = None
        return b

    async def remove(self, url: str) -> bool:
        url = normalize_backend_url(url)
        slot = self._slot_of.get(url)
        removed = await super().remove(url)
        if removed and slot is not None:
            self._by_slot.pop(slot, None)
            self._slot_of.pop(url, None)
        self._rotation = None
        return removed

    def _set_available(self, b: Backend) -> None:
        self._rotation = None

    def _new_router(self) -> None:
        self._epoch = _Epoch(_NullRouter(), any(b.mapper is not None for b in self.backends.values()))

    def _in_rotation(self) -> list[tuple[Backend, int]]:
        rot = self._rotation
        if rot is None:
            rot = self._rotation = [(b, self._slot_of[u]) for u, b in self.backends.items() if b.healthy]
        return rot

    # ---------------------------------------------------------------- placement

    def place(
        self, request_id: Hashable, keys: Sequence[Hashable], num_tokens: int, conv: str | None
    ) -> tuple[_Epoch, Backend]:
        rot = self._in_rotation()
        ep = self._epoch
        if not rot or ep is None:
            raise NoBackend("no backend is in rotation")
        st = self.state
        chosen: Backend | None = None
        key = owner = -1
        if conv is not None:
            key = st.conversation_key(conv)
            owner = st.owner(key)
            if owner >= 0:
                b = self._by_slot.get(owner)
                if b is not None and b.healthy:
                    chosen = b
        elif self._follow and keys:
            # Anonymous: continue the conversation whose latest prompt this one extends (its last block is in the
            # map, within the trailing quarter of this prompt, as the single-process router's 0.75 match).
            chosen = self._continued(keys, num_tokens)
            key = st.block_key(keys[-1])  # type: ignore[arg-type]
            owner = st.owner(key)
        if chosen is None:
            chosen, slot = self._choose(rot, keys, num_tokens)
            if key != -1:
                won = st.claim(key, slot, owner)
                if won != slot:
                    b = self._by_slot.get(won)
                    if b is not None and b.healthy:  # another worker placed it first
                        chosen = b
        elif conv is None and key != -1 and owner != self._slot_of[chosen.url]:
            st.claim(key, self._slot_of[chosen.url], owner)
        slot = self._slot_of[chosen.url]
        st.add_load(self.worker, slot, 1, num_tokens)
        self._in_flight_here[request_id] = (slot, num_tokens)
        self.placed[chosen.url] += 1
        ep.in_flight += 1
        return ep, chosen

    async def place_off_loop(
        self, request_id: Hashable, keys: Sequence[Hashable], num_tokens: int, conv: str | None
    ) -> tuple[_Epoch, Backend]:
        # The shared-state decision reads a bounded number of keys (see _MAX_HELD_SCAN, _MAX_BACK): it stays on
        # the loop, where this worker's row of the load table has a single writer.
        return self.place(request_id, keys, num_tokens, conv)

    def _continued(self, keys: Sequence[Hashable], num_tokens: int) -> Backend | None:
        st = self.state
        n = len(keys)
        lowest = max(1, math.ceil(_MATCH_SHARE * n), n - _MAX_BACK)
        for i in range(n - 1, lowest - 2, -1):
            owner = st.owner(st.block_key(keys[i]))  # type: ignore[arg-type]
            if owner >= 0:
                b = self._by_slot.get(owner)
                if b is None or not b.healthy:
                    return None
                # The guard against load collapse: a continuation far beyond the least loaded is placed afresh.
                least = min(st.tokens(s) for _, s in self._in_rotation())
                return b if st.tokens(owner) + num_tokens <= self._guard.limit(least) else None
        return None

    def _choose(self, rot: list[tuple[Backend, int]], keys: Sequence[Hashable], num_tokens: int) -> tuple[Backend, int]:
        n = len(rot)
        if self.cfg.policy == "round-robin":
            self._rotor += 1
            return rot[self._rotor % n]
        tokens = self.state.tokens
        loads = [tokens(s) for _, s in rot]
        least = min(loads)
        if self._follow and keys:
            best = -1
            best_held = _MIN_FOLLOW_BLOCKS - 1
            for i, (b, _) in enumerate(rot):
                m = b.mapper
                if m is None:
                    continue
                present = m.present
                held = 0
                for k in itertools.islice(keys, _MAX_HELD_SCAN):
                    if k not in present:
                        break
                    held += 1
                if held > best_held or (held == best_held and best >= 0 and loads[i] < loads[best]):
                    best, best_held = i, held
            if best >= 0 and loads[best] + num_tokens <= self._guard.limit(least):
                return rot[best]
        # The least loaded; ties rotate (each worker from its own rotor) so idle backends take turns.
        r = self._rotor % n
        try:
            i = loads.index(least, r)
        except ValueError:
            i = loads.index(least)
        self._rotor = i + 1
        return rot[i]

    def finish(self, ep: _Epoch, request_id: Hashable, success: bool) -> None:
        placed = self._in_flight_here.pop(request_id, None)
        if placed is not None:
            self.state.add_load(self.worker, placed[0], -1, -placed[1])
        ep.in_flight -= 1

    def snapshot(self) -> list[tuple[str, float, int, bool]]:
        out = []
        for u, b in self.backends.items():
            r, t = self.state.load(self._slot_of[u])
            out.append((u, float(t), int(r), b.healthy))
        return out


class WorkerService(RouterService):
    """One worker of ``--workers N``: a RouterService over a :class:`SharedFleet`."""

    def __init__(self, cfg: ServiceConfig, state: SharedState, worker: int) -> None:
        self._state = state
        self._worker = worker
        super().__init__(cfg)

    def _make_fleet(self) -> Fleet:
        return SharedFleet(self.cfg, self._kv_stat, self._state, self._worker)

    def handlers(self) -> dict[tuple[str, str], Any]:
        return {**super().handlers(), ("GET", "/admin/shared"): self._admin_shared}

    async def _health(self, request: Any) -> Reply:
        n = sum(b.healthy for b in self.fleet.backends.values())
        return _json({"healthy_backends": n, "worker": self._worker}, 200 if n else 503)

    async def _admin_list(self, request: Any) -> Reply:
        if not self._admin_ok(request):
            return _error(401, "admin: missing or wrong bearer token")
        fleet = self.fleet
        assert isinstance(fleet, SharedFleet)
        return _json(
            [
                {"url": u, "healthy": ok, "backlog_tokens": load, "in_flight": n,
                 "kv_events": fleet.backends[u].kv_events, "worker": self._worker,
                 "placed_by_worker": fleet.placed.get(u, 0), "cached_blocks": _cached_blocks(fleet.backends[u])}
                for u, load, n, ok in fleet.snapshot()
            ]
        )  # fmt: skip

    async def _admin_shared(self, request: Any) -> Reply:
        if not self._admin_ok(request):
            return _error(401, "admin: missing or wrong bearer token")
        return _json(
            {"worker": self._worker, "pid": os.getpid(), "workers": self._state.workers, "name": self._state.name,
             "conversation_map": self._state.stats()}
        )  # fmt: skip

    async def _admin_add(self, request: Any) -> Reply:
        return _error(409, "admin: with --workers > 1, change the fleet through --backends-file (each worker reads it)")

    async def _admin_remove(self, request: Any) -> Reply:
        return await self._admin_add(request)


def _cached_blocks(b: Backend) -> int:
    return len(b.mapper.present) if b.mapper is not None else 0


# ---------------------------------------------------------------- processes


def _worker_main(args: argparse.Namespace, shm_name: str, lock_path: str, worker: int, parent: int, ready: Any) -> None:
    from kvforge.service.metrics import configure_logging

    # Its own process group: the parent reaches whatever this worker starts (a tokenizer pool) even after it dies.
    os.setpgid(0, 0)
    configure_logging(args.log_level, args.log_format)
    state = SharedState.attach(shm_name, lock_path)
    service = WorkerService(ServiceConfig.from_args(args), state, worker)

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        logger.error("router parent gone; worker exiting", extra={"fields": {"worker": worker}})
        os.kill(os.getpid(), signal.SIGTERM)

    def listening() -> None:  # called once the worker listens
        logger.info("worker listening", extra={"fields": {"worker": worker, "pid": os.getpid(), "port": args.port}})
        ready.set()

    try:
        serve(
            service, args.host, args.port, http=getattr(args, "http", "fast"), event_loop=args.event_loop,
            reuse_port=True, on_listening=listening, shutdown_timeout=max(0.1, args.shutdown_grace_s - 1.0),
            background=[watch_parent],
        )  # fmt: skip
    finally:
        state.close()


def _sweep_group(pid: int) -> None:
    """SIGKILL what is left of a reaped worker's process group (what it started, e.g. a tokenizer pool)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _reserve_port(host: str, port: int) -> socket.socket:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(info[4])
    except OSError:
        s.close()
        raise
    return s


def run_workers(args: argparse.Namespace) -> int:
    """The supervising parent of ``kvforge router --workers N`` (N >= 2); returns the exit status."""
    from kvforge.service import keys as K
    from kvforge.service.metrics import configure_logging

    prog = "kvforge router"
    n = args.workers  # (SO_REUSEPORT support is checked once, where --workers is parsed)
    try:
        cfg = ServiceConfig.from_args(args)
        if cfg.policy not in MULTI_WORKER_POLICIES:
            raise ValueError(
                f"--policy {cfg.policy} keeps per-process state; with --workers > 1 use one of "
                f"{', '.join(MULTI_WORKER_POLICIES)}"
            )
        K.Keyer(cfg.tokens_per_block, cfg.chars_per_token, cfg.tokenizer, cfg.chat_template)  # fail here, once
        if args.event_loop == "uvloop":
            import uvloop  # noqa: F401
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print(f"{prog}: error: --event-loop uvloop: uvloop is not installed", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        reserved = _reserve_port(args.host, args.port)
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    args = argparse.Namespace(**vars(args))
    args.port = reserved.getsockname()[1]
    fd, lock_path = tempfile.mkstemp(prefix="kvforge-router-", suffix=".lock")
    os.close(fd)
    state = SharedState.create(n, lock_path, conversations=args.shared_conversations)
    if not os.environ.get(SALT_ENV):
        # Workers key anonymous prompts in the shared map by their block keys: every worker must hash alike.
        os.environ[SALT_ENV] = secrets.token_hex(16)
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    ready = [ctx.Event() for _ in range(n)]
    try:
        for i in range(n):
            p = ctx.Process(
                target=_worker_main,
                args=(args, state.name, lock_path, i, os.getpid(), ready[i]),
                name=f"kvforge-router-worker-{i}",
                daemon=False,
            )
            p.start()
            procs.append(p)
        alive = {p.sentinel: (i, p) for i, p in enumerate(procs)}
        announced = False
        while alive and not stopping:
            if not announced and all(e.is_set() for e in ready):
                announced = True
                logger.info(
                    "router listening",
                    extra={"fields": {"host": args.host, "port": args.port, "workers": n, "policy": cfg.policy,
                                      "backends": list(cfg.backends), "pids": [p.pid for p in procs]}},
                )  # fmt: skip
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.5 if announced else 0.05):
                i, p = alive.pop(sentinel)  # type: ignore[call-overload]
                p.join()
                _sweep_group(p.pid)  # what it started must not outlive it
                state.clear_worker(i)
                logger.error(
                    "router worker exited; not restarted",
                    extra={"fields": {"worker": i, "pid": p.pid, "exitcode": p.exitcode, "still_serving": len(alive)}},
                )
        if not alive and not stopping:
            logger.error("no router worker left; exiting")
            status = 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)  # (the worker shuts down what it started itself)
        deadline = time.monotonic() + args.shutdown_grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for i, p in enumerate(procs):
            if p.is_alive():
                logger.warning("router worker ignored SIGTERM; killing it", extra={"fields": {"worker": i}})
                p.kill()
                p.join()
            _sweep_group(p.pid)
            state.clear_worker(i)
        state.close()
        reserved.close()
    logger.info("router stopped", extra={"fields": {"workers": n, "status": status}})
    return status
