"""One simulated server: the real :class:`~kvforge.scheduling.Scheduler` over a real KV cache manager, stepped
in simulated time by the step-time model.

The server never decides anything itself: which requests run, how long their chunks are, what is reused,
evicted or preempted is the scheduler's and the manager's doing. The server only turns a
:class:`~kvforge.scheduling.ScheduledBatch` into a duration and reports the step back.

**Aggregated decode.** A simulated step stands for ``R <= decode_quantum`` (Q) real forward steps, so the
Mooncake trace (4.1 M output tokens) replays in seconds. Each request is given to the scheduler with
``draft_len = Q·(1 + model.draft_len) - 1``: a generation step claims pages for up to Q real steps' verified
tokens, as a speculative decoder claims pages for its draft, and reports ``R · E[tokens per real step]``
accepted tokens (the drafter's expected acceptance; the fraction is carried to the next step). The scheduler's
token budget is Q times the real per-step budget. ``R`` is what the step's context chunks need at the real
budget (their first tokens come out after those real steps, as with chunked prefill), and for pure decode Q,
cut short when a request may arrive sooner or one is waiting. Q = 1 is the unaggregated simulation (still with
the drafter's expected acceptance).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvforge.kvcache.config import KVCacheConfig, LifeCycleKind, TierConfig
from kvforge.kvcache.events import EventSink
from kvforge.kvcache.manager import KVCacheManager
from kvforge.scheduling import Request, Scheduler, SchedulerConfig
from kvforge.sim.model import ModelSpec, StepTimeModel
from kvforge.sim.workload import SimRequest

__all__ = [
    "SNAPSHOT_POLICIES",
    "CacheLayout",
    "SimServer",
    "hybrid_available",
    "make_cache_manager",
    "plan_cache_layout",
    "snapshot_policies",
]

GiB = 1 << 30

# Snapshot eviction policies by name. "none" is the plain manager, which takes no recurrent snapshots (a hybrid
# model then reuses nothing: the 0% hit trap); the others are the hybrid manager with an eviction policy.
SNAPSHOT_POLICIES: dict[str, str] = {
    "none": "plain KVCacheManager: no recurrent snapshots (a hybrid model reuses nothing)",
    "lru": "HybridCacheManager, prioritised LRU over snapshots and attention pages alike",
    "short-prompt": "HybridCacheManager, recurrent pages of prompts under 4096 tokens evicted first",
    "cost-aware": "HybridCacheManager, GreedyDual snapshot eviction by saved prefill FLOPs per byte",
}
SHORT_PROMPT_TOKENS = 4096


def hybrid_available() -> bool:
    """Whether the hybrid manager and its snapshot policies can be imported."""
    try:
        import kvforge.kvcache.hybrid
        import kvforge.kvcache.snapshot_policy  # noqa: F401
    except ImportError:
        return False
    return True


def snapshot_policies(model: ModelSpec | None = None) -> tuple[str, ...]:
    """Snapshot policies usable here (``none`` only for an attention-only model or without the hybrid manager);
    the first is the default."""
    if (model is not None and not model.is_hybrid) or not hybrid_available():
        return ("none",)
    return ("cost-aware", "lru", "short-prompt", "none")


@dataclass(frozen=True)
class CacheLayout:
    """How one server's cache bytes are split into pages per pool group (group-id order)."""

    config: KVCacheConfig
    pages: tuple[int, ...]
    attention_tokens: int  # tokens the target's attention pool holds
    state_pages: int  # recurrent pages (live states + snapshots); 0 for an attention-only model
    capacity_bytes: int


def plan_cache_layout(
    model: ModelSpec, capacity_bytes: int, tokens_per_block: int, state_fraction: float = 0.5
) -> CacheLayout:
    """Pages per pool group for ``capacity_bytes``: ``state_fraction`` of it for recurrent states (live ones and
    snapshots) when the model has recurrent layers, the rest for the attention latent, target and draft
    groups holding the same number of pages (a drafter writes one draft page per target block).

    Raises ValueError when the bytes cannot hold one block of attention and one recurrent state.
    """
    if capacity_bytes <= 0:
        raise ValueError(f"capacity: expected a positive number of bytes, got {capacity_bytes}")
    if not 0.0 < state_fraction < 1.0:
        raise ValueError(f"state_fraction: expected a number in (0, 1), got {state_fraction}")
    layers = model.kv_layers()
    probe = KVCacheConfig(tokens_per_block=tokens_per_block, layers=layers, tiers=(TierConfig(pages=1),))
    groups = probe.groups
    attn_bytes = sum(g.bytes_per_page for g in groups if g.life_cycle.kind is not LifeCycleKind.RECURRENT)
    rec = [g for g in groups if g.life_cycle.kind is LifeCycleKind.RECURRENT]
    state_budget = int(capacity_bytes * state_fraction) if rec else 0
    state_pages = state_budget // rec[0].bytes_per_page if rec else 0
    attn_pages = (capacity_bytes - state_budget) // attn_bytes
    if attn_pages < 1 or (rec and state_pages < 1):
        need = attn_bytes + (rec[0].bytes_per_page / state_fraction if rec else 0)
        raise ValueError(
            f"capacity: {capacity_bytes / GiB:.3g} GiB per server cannot hold one {tokens_per_block}-token block "
            f"and one recurrent state of {model.name} (needs at least {need / GiB:.3g} GiB)"
        )
    pages = tuple(state_pages if g.life_cycle.kind is LifeCycleKind.RECURRENT else attn_pages for g in groups)
    config = KVCacheConfig(tokens_per_block=tokens_per_block, layers=layers, tiers=(TierConfig(pages=pages),))
    return CacheLayout(config, pages, attn_pages * tokens_per_block, state_pages, capacity_bytes)


def make_cache_manager(
    layout: CacheLayout,
    model: ModelSpec,
    snapshot_policy: str,
    event_sink: EventSink | None,
    clock: Callable[[], float] | None = None,
) -> KVCacheManager:
    """The manager one server runs: the plain :class:`KVCacheManager` for ``"none"``, else the hybrid manager
    with the named snapshot policy. Mid-chunk snapshots are off: they need the runtime to fill a pending slot
    and commit from it, which the scheduler's own commits do not do, so every snapshot point ends a chunk."""
    allowed = snapshot_policies(model)
    if snapshot_policy not in allowed:
        raise ValueError(
            f"--snapshot-policy: expected one of {', '.join(allowed)} for {model.name}, got {snapshot_policy!r}"
        )
    if snapshot_policy == "none":
        return KVCacheManager(layout.config, event_sink=event_sink)
    from kvforge.kvcache.hooks import HybridCachePolicy
    from kvforge.kvcache.hybrid import HybridCacheManager

    kwargs: dict[str, Any] = {"event_sink": event_sink, "midchunk_snapshot_alignment": None}
    if clock is not None:
        kwargs["clock"] = clock
    if snapshot_policy == "short-prompt":
        kwargs["policy"] = HybridCachePolicy(low_priority_snapshot_prompt_len=SHORT_PROMPT_TOKENS)
    elif snapshot_policy == "cost-aware":
        from kvforge.kvcache.snapshot_policy import cost_aware_eviction

        # The hit-density snapshot policy with snapshot-aware attention eviction: the best pair on the snapshot
        # bench (bench/bench_snapshot_policy.py; figures in docs/history.md).
        kwargs["eviction_policy"] = cost_aware_eviction(
            model.to_cost_spec(), layout.config.tokens_per_block, aging="hit-density"
        )
    return HybridCacheManager(layout.config, **kwargs)


@dataclass
class ServerStats:
    busy_s: float = 0.0  # single-instance step time (the step-time model's), summed
    step_s: float = 0.0  # the steps' simulated durations, device sharing included
    steps: int = 0
    first_admission_reused: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    itl_values: list[float] = field(default_factory=list)
    itl_weights: list[int] = field(default_factory=list)


class SimServer:
    """A scheduler + cache manager pair driven in simulated time (see the module docstring)."""

    def __init__(
        self,
        index: int,
        manager: KVCacheManager,
        scheduler_config: SchedulerConfig,
        step_model: StepTimeModel,
        *,
        decode_quantum: int = 1,
        real_step_tokens: int = 8192,
        exact_context_demotion: bool | None = None,
    ) -> None:
        if decode_quantum < 1:
            raise ValueError(f"decode_quantum: expected an int >= 1, got {decode_quantum}")
        self.index = index
        self.manager = manager
        self.now = 0.0
        self.scheduler = Scheduler(manager, scheduler_config, clock=self._clock)
        if exact_context_demotion is not None:
            self.scheduler.exact_context_demotion = exact_context_demotion
        self.step_model = step_model
        self.quantum = decode_quantum
        self.real_step_tokens = real_step_tokens
        model = step_model.model
        self.draft_len = decode_quantum * (1 + model.draft_len) - 1
        # Tokens a request gains per simulated generation step: Q real steps at the drafter's expected rate. The
        # fraction is carried from step to step, so the mean is exact (2.53 tokens/step: 2, 3, 3, 2, 3, ...).
        self.tokens_per_gen_step = decode_quantum * model.tokens_per_step
        self._carry = 0.0
        self._accept = 1
        self._itl_rows = 0  # generation rows of the step in progress (0: none)
        self.stats = ServerStats()
        self.busy = False
        self._started: set[Any] = set()

    def _clock(self) -> float:
        return self.now

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def submit(self, req: SimRequest) -> Request:
        r = Request(
            req.request_id,
            block_keys=req.block_keys,
            prompt_len=req.prompt_tokens,
            max_new_tokens=req.output_tokens,
            arrival_time=req.arrival_s,
            conversation_id=req.conversation_id,
            draft_len=self.draft_len,
        )
        r.user_data = req
        self.scheduler.add_request(r)
        self.stats.requests += 1
        self.stats.prompt_tokens += req.prompt_tokens
        return r

    def start_step(self, now: float, next_arrival: float = math.inf) -> tuple[Any, float]:
        """Schedule the next step at ``now``; returns the batch and its duration (seconds).

        The step stands for ``R`` real steps: enough for its context chunks at the real per-step budget, or, for
        pure decode, the quantum, cut so that the step ends about when the next request may arrive (so an
        arrival waits about one real step, not a whole quantum, for its first chunk).
        """
        self.now = now
        sched = self.scheduler
        batch = sched.schedule()
        prefill = []
        first_reused = 0
        for s in batch.context:
            prefill.append((s.start, s.num_tokens))
            req = s.request
            if req.request_id not in self._started:
                # The first chunk of the first attempt: what its cache reused is the request's prefix hit.
                self._started.add(req.request_id)
                first_reused += req.cache.num_reused_tokens  # type: ignore[union-attr]
        gen = batch.generation
        q = self.quantum
        model = self.step_model
        real_steps = min(q, max(1, math.ceil(batch.num_context_tokens / self.real_step_tokens)))
        dec_req = dec_ctx = 0.0
        if gen:
            if not prefill and q > 1:
                one = model.step_time((), sum(s.start for s in gen), len(gen), 1)
                gap = (next_arrival - now) / one if one > 0 else q
                real_steps = 1 if sched.waiting else max(1, int(min(q, gap)))
            # A request with fewer tokens left than the step yields takes part in only the real steps it needs:
            # weigh each request by its share of them, or aggregation would inflate the batch.
            per_real = self.tokens_per_gen_step / q
            for s in gen:
                r = s.request
                share = min(1.0, math.ceil((r.max_new_tokens - r.num_generated) / per_real) / real_steps)
                dec_req += share
                dec_ctx += share * s.start
        dt = model.step_time(prefill, dec_ctx, dec_req, real_steps)
        st = self.stats
        st.first_admission_reused += first_reused
        st.busy_s += dt
        st.steps += 1
        if gen:
            self._carry += real_steps * self.tokens_per_gen_step / q
            acc = max(1, int(self._carry))
            self._carry -= acc
            self._accept = acc
        self._itl_rows = len(gen)
        return batch, dt

    def finish_step(self, batch: Any, now: float, duration: float) -> tuple[Request, ...]:
        """Report the step started last to the scheduler; ``duration`` is how long it took (its step time, or
        longer on a shared device: :mod:`kvforge.sim.contention`)."""
        self.now = now
        st = self.stats
        st.step_s += duration
        if self._itl_rows:
            # Every generation request gained ``acc`` tokens in the step (fewer at its end): the per-token latency.
            st.itl_values.append(duration / self._accept)
            st.itl_weights.append(self._itl_rows * self._accept)
            self._itl_rows = 0
        acc = self._accept
        accepted = (
            {s.request.request_id: min(acc, s.num_tokens) for s in batch.generation} if batch.generation else None
        )
        done = self.scheduler.on_step_done(batch, accepted_tokens=accepted)
        for r in done:
            self._started.discard(r.request_id)
        return done
