"""Starting worker processes: server-role forwarding through environment overrides, and a local process world.

Role forwarding. A server launcher knows its role (context or generation), but workers started before it (or
by another launcher) never see the launcher's environment, so role-dependent cache layouts would silently fall
back to the default. The role therefore travels in an environment-override mapping that every worker applies
to its own environment first thing (``worker_entry`` / ``apply_env_overrides``):

* ``role_env_overrides(role, overrides)`` returns a new mapping with ``KVFORGE_DISAGG_ROLE`` set to the role; the
  override replaces any value already there (in the mapping or, once applied, in the worker's environment);
* with ``role=None`` the mapping comes back unchanged, so a launch without a role changes nothing.

``launch_defaults(role, speculative_config)`` is what a server launcher resolves once and hands every worker: the
role, the shared-draft-KV setting (``"auto"`` with a speculative config, ``"0"`` without one, as the reference
system's launcher resolves an unset or ``"auto"`` value) and the PyTorch memory margin (1 GiB unless the model
declares one), the same for both server roles.

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


# --- launcher items: shared draft KV, INFO lines, memory cap ---------------------------------------------------------

SHARED_DRAFT_KV_ENV = "KVFORGE_SHARED_DRAFT_KV"
_launch_log = __import__("logging").getLogger("kvforge.disagg.launch")


def _shared_draft_setting(setting: str | None, environ: Mapping[str, str] | None) -> tuple[str, str]:
    """The shared-draft-KV setting, ``"auto"``, ``"0"`` or ``"1"`` (``KVFORGE_SHARED_DRAFT_KV`` overrides the
    argument; None is ``"auto"``), and where it came from; ValueError naming that source for any other value."""
    env = os.environ if environ is None else environ
    raw, source = setting, "argument"
    if env.get(SHARED_DRAFT_KV_ENV) not in (None, ""):
        raw, source = env[SHARED_DRAFT_KV_ENV], f"env {SHARED_DRAFT_KV_ENV}"
    value = "auto" if raw is None else str(raw).strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"shared draft KV ({source}): expected 'auto', '0' or '1', got {raw!r}")
    return value, source


def resolve_shared_draft_kv(
    setting: str | None,
    *,
    manages_context_pages: bool,
    tokens_per_block: int,
    draft_tokens_per_block: int | None = None,
    helix: bool = False,
    cp_size: int = 1,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether the drafter's KV shares the target's cache manager (its layers appended as DRAFT layers).

    ``setting``: ``"auto"`` (or None), ``"0"`` (off) or ``"1"`` (on); the environment variable
    ``KVFORGE_SHARED_DRAFT_KV`` overrides it with the same values. Eligibility (all needed; ``"auto"`` turns on
    exactly when eligible, ``"1"`` on an ineligible layout raises ValueError naming the reason): the manager
    manages the context pages, the drafter's page size equals the target's (``draft_tokens_per_block`` None means
    equal), no helix and no context parallelism (``cp_size == 1``), whose per-rank block shares a shared draft
    pool would not follow. Logs one INFO line with the setting, its source and the outcome.
    """
    value, source = _shared_draft_setting(setting, environ)
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
        raise ValueError(f"tokens_per_block: expected an int >= 1, got {tokens_per_block!r}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    reasons = []
    if not manages_context_pages:
        reasons.append("the cache manager does not manage the context pages")
    if draft_tokens_per_block is not None and draft_tokens_per_block != tokens_per_block:
        reasons.append(f"draft page size {draft_tokens_per_block} != target page size {tokens_per_block}")
    if helix:
        reasons.append("helix parallelism")
    if cp_size > 1:
        reasons.append(f"context parallelism (cp_size {cp_size})")
    if value == "1" and reasons:
        raise ValueError(f"shared draft KV ({source}) = 1, but the layout is not eligible: {'; '.join(reasons)}")
    shared = value == "1" or (value == "auto" and not reasons)
    _launch_log.info(
        "draft KV pool share: %s (setting %r from %s%s)",
        "shared with the target's cache manager" if shared else "separate",
        value,
        source,
        f"; not eligible: {'; '.join(reasons)}" if reasons else "",
    )
    return shared


@dataclass(frozen=True)
class LaunchDefaults:
    """What a server launch resolves once and hands its workers (see :func:`launch_defaults`)."""

    role: ServerRole | None
    shared_draft_kv: str  # "auto", "0" or "1": the workers resolve it against their layout (resolve_shared_draft_kv)
    torch_mem_safety_margin: int  # bytes kept outside PyTorch's cap, before the clamp to the free memory
    env_overrides: dict[str, str]  # what every worker applies first: the role and the shared-draft-KV setting


def launch_defaults(
    role: ServerRole | str | None,
    speculative_config: object | None,
    *,
    shared_draft_kv: str | None = None,
    declared_mem_margin: int | None = None,
    env_overrides: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchDefaults:
    """The launcher's defaults for a server of ``role`` (context, generation or None for a plain server).

    * Shared draft KV: the setting is ``shared_draft_kv`` (``"auto"``, ``"0"``, ``"1"`` or None), overridden by
      ``KVFORGE_SHARED_DRAFT_KV`` in ``environ``. Unset or ``"auto"`` resolves to ``"auto"`` when there is a
      ``speculative_config`` (the workers then share when their layout is eligible) and to ``"0"`` without one (no
      drafter: the launch is the one it was before shared draft KV existed). ``"1"`` without a speculative config
      raises ValueError: there is no drafter whose KV could be shared.
    * The memory margin is ``declared_mem_margin`` (a model's ``RuntimeHooks.torch_mem_safety_margin``) or 1 GiB.
    * Neither depends on the role; the role only travels in the overrides (``role_env_overrides``), with the
      shared-draft-KV setting beside it so workers started before the launcher see the launcher's decision.
    """
    from kvforge.kvcache.sizing import DEFAULT_TORCH_MEM_SAFETY_MARGIN

    r = parse_role(role)
    value, source = _shared_draft_setting(shared_draft_kv, environ)
    if value == "1" and speculative_config is None:
        raise ValueError(
            f"shared draft KV ({source}) = 1, but there is no speculative config (no drafter whose KV to share)"
        )
    if value == "auto":
        value = "auto" if speculative_config is not None else "0"
    margin = declared_mem_margin
    if margin is None:
        margin = DEFAULT_TORCH_MEM_SAFETY_MARGIN
    elif isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"declared_mem_margin: expected bytes >= 0 or None, got {declared_mem_margin!r}")
    overrides = role_env_overrides(r, env_overrides)
    overrides[SHARED_DRAFT_KV_ENV] = value
    return LaunchDefaults(r, value, margin, overrides)


def log_manager_class(resolved: type, declared: type | None) -> type:
    """Resolve the cache manager class (``kvforge.kvcache.hooks.resolve_kv_cache_manager_cls`` rules) and log one
    INFO line naming it and whether the model declared it."""
    from kvforge.kvcache.hooks import RuntimeHooks, resolve_kv_cache_manager_cls

    cls = resolve_kv_cache_manager_cls(resolved, RuntimeHooks(kv_cache_manager_cls=declared))
    how = "declared by the model" if declared is not None else "the library's default"
    _launch_log.info("KV cache manager class: %s.%s (%s)", cls.__module__, cls.__qualname__, how)
    return cls


def apply_memory_cap(fraction: float, device: Any = None) -> bool:
    """Cap this process's PyTorch CUDA allocations at ``fraction`` of the device memory
    (``torch.cuda.set_per_process_memory_fraction``); True when applied. Without CUDA nothing can be capped:
    logs that at INFO and returns False. ``fraction`` must lie in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < float(fraction) <= 1:
        raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
    import torch

    if not torch.cuda.is_available():
        _launch_log.info("memory cap %.3f not applied: no CUDA device (PyTorch's CPU memory has no cap)", fraction)
        return False
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.cuda.set_per_process_memory_fraction(float(fraction), dev)
    _launch_log.info("memory cap applied: PyTorch may allocate %.3f of %s", fraction, dev)
    return True
