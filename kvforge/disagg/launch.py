"""Starting worker processes: server-role forwarding through environment overrides, and a local process world.

Role forwarding. A server launcher knows its role (context or generation), but workers started before it (or
by another launcher) never see the launcher's environment, so role-dependent cache layouts would silently fall
back to the default. The role therefore travels in an environment-override mapping that every worker applies
to its own environment first thing (``worker_entry`` / ``apply_env_overrides``):

* ``role_env_overrides(role, overrides)`` returns a new mapping with ``KVFORGE_DISAGG_ROLE`` set to the role; the
  override replaces any value already there (in the mapping or, once applied, in the worker's environment);
* with ``role=None`` the mapping comes back unchanged, so a launch without a role changes nothing.

``launch_workers`` starts N processes (multiprocessing "spawn"), applies the overrides on every rank, runs a
target and collects each rank's return value; ``run_world`` does the same inside a torch.distributed process
group (gloo on CPU, NCCL on GPU) whose rendezvous store the parent hosts on a port the OS picks, so parallel
worlds never collide. Both bound the whole run with a timeout and end only the processes they started.
"""

from __future__ import annotations

import datetime
import enum
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLE_ENV = "KVFORGE_DISAGG_ROLE"


class ServerRole(str, enum.Enum):
    CONTEXT = "context"
    GENERATION = "generation"


def parse_role(role: ServerRole | str | None) -> ServerRole | None:
    if role is None or isinstance(role, ServerRole):
        return role
    try:
        return ServerRole(str(role).lower())
    except ValueError:
        raise ValueError(f"role: expected one of {[r.value for r in ServerRole]} or None, got {role!r}") from None


def role_env_overrides(role: ServerRole | str | None, env_overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The overrides every worker applies: ``env_overrides`` plus the role (replacing any value), or unchanged."""
    out = dict(env_overrides or {})
    r = parse_role(role)
    if r is not None:
        out[ROLE_ENV] = r.value
    return out


def apply_env_overrides(overrides: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Apply overrides to a worker's environment (``os.environ`` by default); each value replaces the old one."""
    env = os.environ if environ is None else environ
    for k, v in overrides.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"env_overrides: expected str keys and values, got {k!r}: {v!r}")
        env[k] = v


def current_role(environ: Mapping[str, str] | None = None) -> ServerRole | None:
    """The role this worker was launched with, or None."""
    env = os.environ if environ is None else environ
    value = env.get(ROLE_ENV)
    return None if value is None else parse_role(value)


@dataclass
class WorkerResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    @property
    def reported(self) -> bool:
        return self.error is None and self.exitcode == 0


def worker_entry(
    rank: int,
    nprocs: int,
    overrides: Mapping[str, str],
    target: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
) -> None:
    """A worker's main: apply the overrides, run ``target(rank, nprocs, *args)``, report, exit.

    The process leaves through ``os._exit`` after its report is flushed: a worker whose peer died may still hold
    posted receives whose destructors would block a normal interpreter shutdown.
    """
    apply_env_overrides(overrides)
    code = 0
    try:
        value = target(rank, nprocs, *args)
        results.put((rank, "ok", value))
    except BaseException:
        code = 1
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(code)


def launch_workers(
    target: Callable[..., Any],
    nprocs: int,
    *,
    role: ServerRole | str | None = None,
    env_overrides: Mapping[str, str] | None = None,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
) -> list[WorkerResult]:
    """Run ``target(rank, nprocs, *args)`` in ``nprocs`` spawned processes with the role forwarded to each.

    Returns one ``WorkerResult`` per rank. A rank that exits without reporting (killed, crashed) has its exit
    code and no value; ranks still running after ``timeout_s`` are killed and reported with ``error``.
    """
    import multiprocessing as mp

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs: expected an int >= 1, got {nprocs!r}")
    overrides = role_env_overrides(role, env_overrides)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker_entry, args=(r, nprocs, overrides, target, tuple(args), results), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    out = {r: WorkerResult(r, None) for r in range(nprocs)}
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(reported) < nprocs and time.monotonic() < deadline:
        try:
            rank, kind, value = results.get(timeout=0.05)
        except queue_mod.Empty:
            # A process that died without a report will never send one.
            if all(p.exitcode is not None for i, p in enumerate(procs) if i not in reported) and results.empty():
                break
            continue
        reported.add(rank)
        if kind == "ok":
            out[rank].value = value
        else:
            out[rank].error = value
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
            if out[r].error is None:
                out[r].error = f"rank {r} still running after {timeout_s:g} s; killed"
        out[r].exitcode = p.exitcode
    results.close()
    return [out[r] for r in range(nprocs)]


def _world_entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
) -> Any:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
    )
    return fn(rank, world_size, *args)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    pg_timeout_s: float = 300.0,
    role: ServerRole | str | None = None,
    env_overrides: Mapping[str, str] | None = None,
) -> list[WorkerResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes joined in a torch.distributed group.

    The parent hosts the rendezvous store on an OS-chosen port (no port is guessed). gloo uses the loopback
    interface. ``pg_timeout_s`` is the process group's own timeout; keep it above every transfer timeout (gloo
    closes a connection whose operation outlives it).
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    env = {"GLOO_SOCKET_IFNAME": "lo", **(env_overrides or {})} if backend == "gloo" else dict(env_overrides or {})
    try:
        return launch_workers(
            _world_entry,
            world_size,
            role=role,
            env_overrides=env,
            args=(store.port, backend, pg_timeout_s, fn, tuple(args)),
            timeout_s=timeout_s,
        )
    finally:
        del store
