"""A local fleet for tests and benchmarks: N ``kvforge serve`` processes and one ``kvforge router`` in front.

:class:`LocalFleet` picks free ports, starts every engine with ``--kv-events-endpoint`` / ``--kv-replay-endpoint``
and the router with ``--kv-events`` / ``--kv-replay`` for each, waits until every ``/health`` answers 200 (or
raises ``RuntimeError`` with the tail of the failing process's log), and stops them all on :meth:`close` (or at
the end of a ``with`` block). :meth:`kill_engine` SIGKILLs one engine (a crash). The command lines it runs are
:attr:`commands` (what a user would type). Logs go to files under ``log_dir``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EngineProc", "LocalFleet", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


@dataclass
class EngineProc:
    url: str
    events: str
    replay: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    name: str = ""


@dataclass
class LocalFleet:
    """See the module docstring. ``serve_args`` go to every engine; ``router_args`` to the router."""

    n_engines: int = 2
    log_dir: Path = Path(".")
    serve_args: Sequence[str] = ()
    router_args: Sequence[str] = ()
    policy: str = "conversation"
    with_router: bool = True
    startup_timeout_s: float = 240.0
    engines: list[EngineProc] = field(default_factory=list)
    router_url: str = ""
    router_proc: subprocess.Popen | None = None
    commands: list[list[str]] = field(default_factory=list)

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, cmd: list[str], log: Path) -> subprocess.Popen:
        self.commands.append(cmd)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> None:
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        py = [sys.executable, "-m", "kvforge"]
        for i in range(self.n_engines):
            port, ev, rp = free_port(), free_port(), free_port()
            name = f"engine{i}"
            cmd = [*py, "serve", "--port", str(port), "--instance-name", name, "--log-format", "text",
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}", "--kv-replay-endpoint", f"tcp://127.0.0.1:{rp}",
                   *self.serve_args]  # fmt: skip
            e = EngineProc(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", cmd,
                           self.log_dir / f"{name}.log", name=name)  # fmt: skip
            e.proc = self._spawn(cmd, e.log)
            self.engines.append(e)
        if self.with_router:
            port = free_port()
            cmd = [*py, "router", "--port", str(port), "--policy", self.policy, "--log-format", "text"]
            for e in self.engines:
                cmd += ["--backend", e.url, "--kv-events", e.events, "--kv-replay", e.replay]
            cmd += list(self.router_args)
            self.router_url = f"http://127.0.0.1:{port}"
            self.router_proc = self._spawn(cmd, self.log_dir / "router.log")
        try:
            self._wait()
        except BaseException:
            self.close()
            raise

    def _wait(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = [(e.url, e.proc, e.log) for e in self.engines]
        if self.router_proc is not None:
            pending.append((self.router_url, self.router_proc, self.log_dir / "router.log"))
        while pending:
            url, proc, log = pending[0]
            if proc is not None and proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{url}: exited with status {proc.returncode} during start-up:\n{tail}")
            if _healthy(url):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: not healthy after {self.startup_timeout_s} s")
            time.sleep(0.2)

    def kill_engine(self, i: int) -> None:
        p = self.engines[i].proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)

    def close(self) -> None:
        procs = [e.proc for e in self.engines] + [self.router_proc]
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            if p is None:
                continue
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
