"""The event loop: requests arrive, the router places them, each server's scheduler steps in simulated time.

Composition (nothing here decides a policy): a :class:`~kvforge.routing.Router` (``route`` on arrival,
``finish`` when the request's last token is out, ``on_event`` fed by every server manager's block events) →
one :class:`~kvforge.sim.server.SimServer` per server (the real ``Scheduler`` over the real cache manager) →
the step-time model for durations.

Events, in time order: an arrival is routed and queued on its server, which starts a step if idle; a step's
end reports the batch to the scheduler (finished requests leave the router's load) and starts the next step
at once while the server has unfinished requests. Ties go to step ends first, so a request that finishes at
the instant another arrives has already left the router's load. Servers declared as sharing a device
(``SimConfig.servers_per_device``) step through a :class:`~kvforge.sim.contention.SharedDevice`: a step's end
moves whenever another step on the same device starts or ends.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvforge.errors import SchedulerDeadlockError
from kvforge.kvcache.config import LifeCycleKind
from kvforge.routing import (
    CacheAwareRouter,
    ConversationRouter,
    ImbalanceGuard,
    LeastLoadRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from kvforge.scheduling import SchedulerConfig
from kvforge.sim.contention import Contention, SharedDevice
from kvforge.sim.model import KIMI_K3_LIKE, ModelSpec, StepTimeModel, Throughputs
from kvforge.sim.profile import ProfiledStepTime, StepProfile
from kvforge.sim.server import GiB, SimServer, make_cache_manager, plan_cache_layout, snapshot_policies
from kvforge.sim.workload import SimRequest

__all__ = [
    "MAX_MODEL_LAYERS",
    "MAX_SIMULATED_S",
    "MAX_TOTAL_PAGES",
    "ROUTER_POLICIES",
    "RunResult",
    "SimConfig",
    "SimulationError",
    "make_router",
    "percentile",
    "simulate",
]

# Page bookkeeping costs ~140 bytes of host memory per page (measured on the default layout), so 2**24 pages over
# the whole fleet is ~2.4 GB: beyond that a typo (--servers 100000, --cache-gib 1e6) would end in MemoryError.
MAX_TOTAL_PAGES = 1 << 24
# Layers are materialised one LayerSpec each (kv_layers), so a model of 10**8 layers would hang before any check.
MAX_MODEL_LAYERS = 4096
# About 31.7 years of simulated time: a step-time model whose steps reach it is broken input, not a workload.
MAX_SIMULATED_S = 1e9

ROUTER_POLICIES: dict[str, str] = {
    "conversation": "ConversationRouter: sticky sessions, prefix trie, 'specific' follow mode (the default)",
    "conversation-always": "ConversationRouter, 'always' follow mode (weighs load by uncached tokens)",
    "conversation-events": "ConversationRouter, 'always' + the servers' cache events + imbalance guard",
    "conversation-kv": "ConversationRouter, 'specific' + the servers' cache events (kvforge router --policy "
    "conversation --kv-events)",
    "cache-aware": "SGLang-router-like: best approximate prefix match unless imbalanced, then shortest queue",
    "least-load": "fewest prompt tokens in flight",
    "round-robin": "servers in turn",
}


class SimulationError(ValueError):
    """The simulation cannot run with these inputs (the message says why, in one line)."""


def make_router(name: str, servers: Sequence[Hashable], tokens_per_block: int, tree_blocks: int) -> Router:
    """A router by policy name (see :data:`ROUTER_POLICIES`). Requests always finish in the simulator, so the
    time-to-live that reclaims leaked load is off."""
    common: dict[str, Any] = {"tokens_per_block": tokens_per_block, "request_ttl_s": None}
    if name == "conversation":
        return ConversationRouter(servers, **common)
    if name == "conversation-always":
        return ConversationRouter(servers, new_conversation_follow="always", **common)
    if name == "conversation-events":
        return ConversationRouter(
            servers,
            new_conversation_follow="always",
            use_cache_events=True,
            imbalance_guard=ImbalanceGuard(),
            **common,
        )
    if name == "conversation-kv":
        return ConversationRouter(servers, use_cache_events=True, **common)
    if name == "cache-aware":
        return CacheAwareRouter(servers, tree_capacity_blocks=tree_blocks, **common)
    if name == "least-load":
        return LeastLoadRouter(servers, **common)
    if name == "round-robin":
        return RoundRobinRouter(servers, **common)
    raise SimulationError(f"--router: unknown policy {name!r}; expected one of {', '.join(ROUTER_POLICIES)}")


@dataclass(frozen=True)
class SimConfig:
    """One simulated fleet. ``cache_gib``: KV bytes per server (attention latent + recurrent states);
    ``state_fraction``: the share of them for recurrent states; ``max_num_tokens``: the real per-step token
    budget (the scheduler gets ``decode_quantum`` times it, see :mod:`kvforge.sim.server`)."""

    servers: int = 4
    model: ModelSpec = KIMI_K3_LIKE
    throughputs: Throughputs = field(default_factory=Throughputs)
    cache_gib: float = 64.0
    state_fraction: float = 0.5
    tokens_per_block: int = 128
    snapshot_policy: str | None = None  # None: the best the model allows (cost-aware for a hybrid model)
    max_num_tokens: int = 8192
    max_num_requests: int = 256
    decode_quantum: int = 8
    demote_uncached_tokens: int = 0
    exact_demotion: bool = False
    load_samples: int = 200
    # Measured step times (kvforge.sim.profile) instead of the roofline; its model must be ``model``.
    step_profile: StepProfile | None = None
    # Servers 0..k-1, k..2k-1, ... share one device each (kvforge.sim.contention); 1: every server has its own.
    servers_per_device: int = 1
    # The shared devices' slowdown curve; None: the profile's measured one (needed when servers_per_device > 1).
    contention: Contention | None = None

    def __post_init__(self) -> None:
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise SimulationError(f"--servers: expected an int >= 1, got {self.servers!r}")
        if not isinstance(self.model, ModelSpec):
            raise TypeError(f"model: expected a ModelSpec, got {type(self.model).__name__}")
        layers = self.model.mla_layers + self.model.recurrent_layers + self.model.draft_layers
        if layers > MAX_MODEL_LAYERS:
            raise SimulationError(
                f"argument --model: {self.model.name} has {layers:,} layers (MLA + recurrent + draft), over the "
                f"simulator's limit of {MAX_MODEL_LAYERS}"
            )
        if not (isinstance(self.cache_gib, (int, float)) and math.isfinite(self.cache_gib) and self.cache_gib > 0):
            raise SimulationError(f"--cache-gib: expected a positive number, got {self.cache_gib!r}")
        if not 0.0 < self.state_fraction < 1.0:
            raise SimulationError(f"--state-fraction: expected a number in (0, 1), got {self.state_fraction!r}")
        for name in ("tokens_per_block", "max_num_tokens", "max_num_requests", "decode_quantum", "load_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimulationError(f"{name}: expected an int >= 1, got {v!r}")
        step = 1 + self.model.draft_len
        if self.max_num_tokens < step:
            raise SimulationError(
                f"argument --max-num-tokens: expected at least {step} (one request's decode step: 1 token + "
                f"{self.model.draft_len} draft tokens of {self.model.name}), got {self.max_num_tokens}"
            )
        if self.demote_uncached_tokens < 0:
            raise SimulationError(f"--demote: expected tokens >= 0, got {self.demote_uncached_tokens}")
        if self.snapshot_policy is None:
            object.__setattr__(self, "snapshot_policy", snapshot_policies(self.model)[0])
        if self.exact_demotion and not self.demote_uncached_tokens:
            raise SimulationError("--exact-demotion needs a demotion threshold (--demote TOKENS)")
        if self.step_profile is not None and self.step_profile.model != self.model:
            raise SimulationError("--profile: the profile's model differs from --model (the profile sets the model)")
        k = self.servers_per_device
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.servers:
            raise SimulationError(f"--servers-per-device: expected an int in [1, --servers], got {k!r}")
        if self.contention is not None and not isinstance(self.contention, Contention):
            raise TypeError(f"contention: expected a Contention, got {type(self.contention).__name__}")
        if self.contention is None and k > 1:
            measured = self.step_profile.contention if self.step_profile is not None else None
            if measured is None:
                raise SimulationError(
                    "--servers-per-device: servers sharing a device need a slowdown curve: give "
                    "--shared-device-capacity, or a --profile with a measured contention curve"
                )
            object.__setattr__(self, "contention", measured)


@dataclass
class RunResult:
    """The figures of one run (one router policy over one workload)."""

    policy: str
    snapshot_policy: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    hit_rate: float
    hit_tokens: int
    prefill_computed: int
    prefill_saved: int
    snapshots: dict[str, float]
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    throughput_tok_s: float
    makespan_s: float
    imbalance: float
    preemptions: int
    demotions: int
    deferrals: int
    wall_s: float
    load_times: list[float] = field(default_factory=list, repr=False)
    load_series: list[list[int]] = field(default_factory=list, repr=False)
    ttfts: dict[int, float] = field(default_factory=dict, repr=False)  # request id -> time to first token
    steps: int = 0  # simulated steps over all servers (not in the CSV row)
    busy_s: float = 0.0  # their summed single-instance step times (the step-time model's)
    step_s: float = 0.0  # their summed simulated durations (longer than busy_s only on shared devices)

    def row(self) -> dict[str, Any]:
        """The CSV row (time series left out); every column name carries its unit."""
        out: dict[str, Any] = {
            "policy": self.policy,
            "snapshot_policy": self.snapshot_policy,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "hit_rate_fraction": self.hit_rate,
            "hit_tokens": self.hit_tokens,
            "prefill_computed_tokens": self.prefill_computed,
            "prefill_saved_tokens": self.prefill_saved,
            "ttft_p50_s": self.ttft_p50,
            "ttft_p99_s": self.ttft_p99,
            "itl_p50_ms": self.itl_p50 * 1e3,
            "itl_p99_ms": self.itl_p99 * 1e3,
            "throughput_tok_per_s": self.throughput_tok_s,
            "makespan_s": self.makespan_s,
            "imbalance_busy_max_over_mean": self.imbalance,
            "preemptions": self.preemptions,
            "demotions": self.demotions,
            "deferrals": self.deferrals,
            "wall_s": self.wall_s,
        }
        for k, v in self.snapshots.items():
            # The hybrid managers' counters: token counts, the pages held at the end, and event counts.
            unit = "" if k.endswith("_tokens") else "_pages" if k == "held_at_end" else "_count"
            out[f"snapshot_{k}{unit}"] = v
        return out


def percentile(values: Sequence[float], q: float, weights: Sequence[float] | None = None) -> float:
    """numpy's percentile: linear interpolation without ``weights``; with them, the inverted CDF (the smallest
    value whose cumulative weight reaches ``q`` percent). NaN for no values."""
    if len(values) == 0:
        return float("nan")
    if weights is None:
        return float(np.percentile(np.asarray(values, dtype=np.float64), q))
    return float(
        np.percentile(
            np.asarray(values, dtype=np.float64),
            q,
            weights=np.asarray(weights, dtype=np.float64),
            method="inverted_cdf",
        )
    )


def _snapshot_stats(managers: Sequence[Any]) -> dict[str, float]:
    """The hybrid managers' counters (``HybridCounters``), summed over servers, plus the snapshot pages held at
    the end; empty for plain managers."""
    out: dict[str, float] = {}
    for m in managers:
        counters = getattr(m, "counters", None)
        if counters is None:
            continue
        for k, v in vars(counters).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
        held = 0
        for g in m.groups:
            if g.life_cycle.kind is LifeCycleKind.RECURRENT:
                pool = m.pool(g.group_id)
                held += pool.capacity - m.num_free_pages(g.group_id)
        # Every request has finished, so no live state is left: what the recurrent pools hold are snapshots.
        out["held_at_end"] = out.get("held_at_end", 0) + held
    return out


def _check_step(dt: float) -> None:
    if not (math.isfinite(dt) and 0 <= dt <= MAX_SIMULATED_S):
        raise SimulationError(
            f"a simulated step lasts {dt:g} s: the step-time model is out of range (check --efficiency, "
            "--matmul-tflops, --attention-tflops, --hbm-gbps and the --model sizes)"
        )


def simulate(
    requests: Sequence[SimRequest],
    config: SimConfig,
    policy: str,
    *,
    progress: bool = False,
    desc: str | None = None,
) -> RunResult:
    """Replay ``requests`` over ``config.servers`` servers under router ``policy``.

    ``requests`` must be sorted by ``arrival_s`` (finite times); raises :class:`SimulationError` (one line,
    naming the command-line flag concerned) when they are not, when the fleet's cache bookkeeping would pass
    :data:`MAX_TOTAL_PAGES`, when a server cannot hold the longest request or deadlocks, or when simulated
    time would pass :data:`MAX_SIMULATED_S`. Nothing is allocated before the input checks pass.
    """
    t_wall = time.perf_counter()
    if not requests:
        raise SimulationError("workload: no requests")
    prev = -math.inf
    for sim_req in requests:
        if not math.isfinite(sim_req.arrival_s):
            raise SimulationError(
                f"workload: request {sim_req.request_id} arrives at {sim_req.arrival_s!r}, not a finite time"
            )
        if sim_req.arrival_s < prev:
            raise SimulationError(
                f"workload: requests must be sorted by arrival; request {sim_req.request_id} arrives at "
                f"{sim_req.arrival_s:g} s, before the one ahead of it ({prev:g} s)"
            )
        prev = sim_req.arrival_s
    tpb = config.tokens_per_block
    try:
        layout = plan_cache_layout(config.model, int(config.cache_gib * GiB), tpb, config.state_fraction)
    except ValueError as exc:
        raise SimulationError(f"argument --cache-gib: {exc}") from None
    total_pages = sum(layout.pages) * config.servers
    if total_pages > MAX_TOTAL_PAGES:
        raise SimulationError(
            f"argument --cache-gib: {config.servers} servers x {config.cache_gib:g} GiB is {total_pages:,} cache "
            f"pages of {tpb} tokens, over the simulator's limit of {MAX_TOTAL_PAGES:,} (~140 bytes of host memory "
            "each); lower --servers or --cache-gib"
        )
    quantum = config.decode_quantum
    step_tokens = quantum * (1 + config.model.draft_len)
    longest = max(r.prompt_tokens + r.output_tokens for r in requests) + step_tokens
    if longest > layout.attention_tokens:
        raise SimulationError(
            f"argument --cache-gib: {config.cache_gib:g} GiB per server holds {layout.attention_tokens:,} tokens "
            f"of {config.model.name} KV, but the longest request needs {longest:,}; raise --cache-gib"
        )
    snapshot_policy = config.snapshot_policy
    assert snapshot_policy is not None  # SimConfig.__post_init__ resolves None
    server_ids = list(range(config.servers))
    router = make_router(policy, server_ids, tpb, layout.attention_tokens // tpb)
    step_model = (
        StepTimeModel(config.model, config.throughputs)
        if config.step_profile is None
        else ProfiledStepTime(config.step_profile)
    )
    sched_cfg = SchedulerConfig(
        max_num_tokens=quantum * config.max_num_tokens,
        max_num_requests=config.max_num_requests,
        demote_uncached_tokens=config.demote_uncached_tokens,
        exact_context_demotion=config.exact_demotion,
    )
    servers: list[SimServer] = []
    clock = [0.0]
    for s in server_ids:
        sink: Callable[[Any], None] = partial(router.on_event, s)
        try:
            mgr = make_cache_manager(layout, config.model, snapshot_policy, sink, lambda: clock[0])
        except ValueError as exc:
            raise SimulationError(str(exc)) from None
        servers.append(
            SimServer(
                s,
                mgr,
                sched_cfg,
                step_model,
                decode_quantum=quantum,
                real_step_tokens=config.max_num_tokens,
                exact_context_demotion=config.exact_demotion,
            )
        )

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=desc or policy, unit="req", file=sys.stderr, leave=False, mininterval=0.5)

    per_device = config.servers_per_device
    contention = config.contention
    # Servers alone on their device (the default) keep a plain end time; shared ones go through their device.
    devices: list[SharedDevice | None] = [None] * config.servers
    if per_device > 1:
        assert contention is not None  # SimConfig.__post_init__ resolves it
        for first in range(0, config.servers, per_device):
            shared = SharedDevice(contention)
            for s in range(first, min(first + per_device, config.servers)):
                devices[s] = shared
    t0 = requests[0].arrival_s
    # The load grid starts at the arrival span's resolution and doubles its step (dropping every other point)
    # whenever it holds 2 * load_samples points, so a zero span (one request, equal timestamps) or a long drain
    # costs O(load_samples * log(makespan / step)) samples, never one per picosecond.
    max_points = 2 * config.load_samples
    sample_dt = max(requests[-1].arrival_s - t0, 1e-6) / config.load_samples
    next_sample = t0
    load_times: list[float] = []
    load_series: list[list[int]] = []
    ttfts: dict[int, float] = {}
    last_finish = t0
    # Step ends, as (time, seq, server). A shared device's step ends move when another step on it starts or
    # ends: each move pushes a new entry, and only the entry whose seq is the server's ``current`` one is live.
    ends: list[tuple[float, int, int]] = []
    current = [0] * config.servers
    batches: list[Any] = [None] * config.servers
    step_start = [0.0] * config.servers
    step_work = [0.0] * config.servers
    seq = 0
    n = len(requests)
    i = 0
    inf = math.inf
    done = 0

    def push(t_end: float, s: int) -> None:
        nonlocal seq
        seq += 1
        current[s] = seq
        heapq.heappush(ends, (t_end, seq, s))

    def begin(s: int, t: float) -> None:
        b, dt = servers[s].start_step(t, requests[i].arrival_s if i < n else inf)
        _check_step(dt)
        batches[s], step_start[s], step_work[s] = b, t, dt
        dev = devices[s]
        if dev is None:
            push(t + dt, s)
        else:
            dev.start(s, dt, t)

    def reschedule(dev: SharedDevice) -> None:
        for s, t_end in dev.ends().items():
            push(t_end, s)  # type: ignore[arg-type]  # the device's keys are server indices

    try:
        while True:
            while ends and current[ends[0][2]] != ends[0][1]:
                heapq.heappop(ends)  # a shared step's end that has moved since
            if i >= n and not ends:
                break
            t_arr = requests[i].arrival_s if i < n else inf
            t_end = ends[0][0] if ends else inf
            t = t_end if t_end <= t_arr else t_arr
            if t - t0 > MAX_SIMULATED_S:
                raise SimulationError(
                    f"simulated time passed {MAX_SIMULATED_S:g} s: the step-time model makes steps too long "
                    "(check --efficiency, --matmul-tflops, --attention-tflops, --hbm-gbps and the --model sizes)"
                )
            clock[0] = t
            if next_sample <= t:
                loads = [sv.num_unfinished for sv in servers]  # constant since the last event
                while next_sample <= t:
                    load_times.append(next_sample - t0)
                    load_series.append(loads)
                    if len(load_times) >= max_points:
                        del load_times[1::2], load_series[1::2]
                        sample_dt *= 2
                    next_sample = t0 + len(load_times) * sample_dt
            if t_end <= t_arr:
                _, _, s = heapq.heappop(ends)
                current[s] = 0
                sv = servers[s]
                dev = devices[s]
                if dev is None:
                    duration = step_work[s]
                else:
                    dev.finish(s, t)
                    duration = t - step_start[s]
                batch, batches[s] = batches[s], None
                finished = sv.finish_step(batch, t, duration)
                for r in finished:
                    router.finish(r.request_id)
                    ttfts[r.request_id] = r.first_token_time - r.arrival_time  # type: ignore[index,operator]
                    last_finish = t
                if finished:
                    done += len(finished)
                    if bar is not None:
                        bar.update(len(finished))
                if sv.num_unfinished:
                    begin(s, t)
                else:
                    sv.busy = False
                if dev is not None:
                    reschedule(dev)
            else:
                arriving = requests[i]
                i += 1
                routed = router.route(
                    RouteRequest(
                        request_id=arriving.request_id,
                        block_keys=arriving.block_keys,
                        num_tokens=arriving.prompt_tokens,
                        conversation_id=arriving.conversation_id,
                    )
                )
                assert isinstance(routed, int)  # the server ids are 0..servers-1
                s = routed
                sv = servers[s]
                sv.submit(arriving)
                if not sv.busy:
                    sv.busy = True
                    begin(s, t)
                    dev = devices[s]
                    if dev is not None:
                        reschedule(dev)
    except SchedulerDeadlockError as exc:
        raise SimulationError(
            f"--cache-gib: a server deadlocked ({str(exc).split(':', 1)[0]}); raise --cache-gib"
        ) from None
    finally:
        if bar is not None:
            bar.close()

    leaked = {k: v for k, v in router.loads().items() if v}
    if leaked or any(sv.num_unfinished for sv in servers):
        # Every request finished, so the router must hold no load: anything else is a bug in the composition.
        raise RuntimeError(
            f"simulation ended with load left: router {leaked}, servers {[sv.num_unfinished for sv in servers]}"
        )
    hit = sum(sv.stats.first_admission_reused for sv in servers)
    managers = [sv.manager for sv in servers]
    prompt = sum(r.prompt_tokens for r in requests)
    output = sum(r.output_tokens for r in requests)
    busy = [sv.stats.busy_s for sv in servers]
    mean_busy = sum(busy) / len(busy)
    itl_v = [x for sv in servers for x in sv.stats.itl_values]
    itl_w = [x for sv in servers for x in sv.stats.itl_weights]
    makespan = max(last_finish - t0, 1e-9)
    stats = [sv.scheduler.stats for sv in servers]
    return RunResult(
        policy=policy,
        snapshot_policy=snapshot_policy,
        requests=n,
        prompt_tokens=prompt,
        output_tokens=output,
        hit_rate=hit / prompt,
        hit_tokens=hit,
        prefill_computed=sum(s.context_tokens for s in stats),
        prefill_saved=sum(m.stats.reused_tokens for m in managers),
        snapshots=_snapshot_stats(managers),
        ttft_p50=percentile(list(ttfts.values()), 50),
        ttft_p99=percentile(list(ttfts.values()), 99),
        itl_p50=percentile(itl_v, 50, itl_w),
        itl_p99=percentile(itl_v, 99, itl_w),
        throughput_tok_s=output / makespan,
        makespan_s=makespan,
        imbalance=max(busy) / mean_busy if mean_busy > 0 else float("nan"),
        preemptions=sum(s.preemptions for s in stats),
        demotions=sum(s.demotions for s in stats),
        deferrals=sum(s.deferrals for s in stats),
        wall_s=time.perf_counter() - t_wall,
        load_times=load_times,
        load_series=load_series,
        ttfts=ttfts,
        steps=sum(sv.stats.steps for sv in servers),
        busy_s=sum(busy),
        step_s=sum(sv.stats.step_s for sv in servers),
    )
