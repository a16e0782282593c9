"""Local-process plumbing of the router benchmarks (no torch import): a free port, a child's port file, a child
that listens. ``wait_port`` raises RuntimeError when the child exits first or does not listen in time."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_port_file(path: Path, timeout: float) -> Any:
    """The JSON a child writes to ``path`` once it listens (read when it appears, or after ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not (path.exists() and path.read_text()):
        time.sleep(0.05)
    return json.loads(path.read_text())


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f} s")
