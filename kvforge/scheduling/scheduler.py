"""The token-budget scheduler: every iteration, which requests run and how many tokens each computes.

One server's :class:`Scheduler` over one :class:`~kvforge.kvcache.manager.KVCacheManager` (or a subclass such as
the hybrid manager), driven by a step API independent of wall-clock time::

    sched = Scheduler(manager, SchedulerConfig(max_num_tokens=8192), hooks=runtime_hooks_of(model))
    sched.add_request(Request("r1", tokens=prompt, max_new_tokens=128))
    while sched.has_unfinished:
        batch = sched.schedule()                  # ScheduledBatch: per request, start and token count
        ...run the forward step...
        finished = sched.on_step_done(batch)      # commit progress; optional accepted draft counts, token ids

Contract: every page claim is check-then-act (nothing changes when pages are short); the oldest running request
always progresses; a pass that can schedule nothing raises :class:`~kvforge.errors.SchedulerDeadlockError`
instead of spinning; bad requests and step results raise ``TypeError`` / ``ValueError`` before any state
changes. The pass order, demotion, prefix waits and the optional manager hooks are described on
:class:`Scheduler`. Not thread-safe: one thread drives a scheduler.
"""

from __future__ import annotations

import os
from bisect import insort
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, cast

from kvforge.errors import KvforgeError, OutOfPagesError, SchedulerDeadlockError
from kvforge.kvcache.hooks import RuntimeHooks
from kvforge.kvcache.manager import CacheStatus, KVCacheManager
from kvforge.scheduling.chunking import passed_snapshot_point, snapshot_chunk_end
from kvforge.scheduling.prefix_wait import PrefixWaitPlanner, PrefixWaitStats
from kvforge.scheduling.request import Request, RequestState
from kvforge.scheduling.seams import ContextMarker, PrefixWaitCounter, SnapshotSlotCache

__all__ = [
    "DEFAULT_DEMOTE_MAX_ITERS",
    "ENV_DEMOTE_MAX_ITERS",
    "ENV_DEMOTE_UNCACHED_TOKENS",
    "ScheduleAction",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStateError",
    "SchedulerStats",
    "resolve_demotion",
]

ENV_DEMOTE_UNCACHED_TOKENS = "KVFORGE_CTX_DEMOTE_UNCACHED_TOKENS"
ENV_DEMOTE_MAX_ITERS = "KVFORGE_CTX_DEMOTE_MAX_ITERS"
DEFAULT_DEMOTE_MAX_ITERS = 8

_WAITING = RequestState.WAITING
_CONTEXT = RequestState.CONTEXT
_GENERATION = RequestState.GENERATION
_DONE = RequestState.DONE


class SchedulerStateError(KvforgeError):
    """A scheduler call is not valid now (e.g. ``schedule`` while a batch awaits ``on_step_done``); nothing
    was changed."""


class ScheduleAction(Enum):
    """Outcome of preparing one context request in a pass."""

    RUN = "run"
    SKIP = "skip"  # a running request that found no pages this pass
    DEFER = "defer"  # released its claim, retried after the rest of the pass
    BLOCKED = "blocked"  # a new admission found no pages: the queue stops admitting for this pass


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return v


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policies of one scheduler.

    ``demote_uncached_tokens``: the long-context threshold in tokens (0: demotion off); None reads
    ``KVFORGE_CTX_DEMOTE_UNCACHED_TOKENS`` (unset: off). ``demote_max_iters``: demoted iterations before a
    request keeps its place; None reads ``KVFORGE_CTX_DEMOTE_MAX_ITERS`` (unset: 8). ``exact_context_demotion``:
    None takes the model's ``RuntimeHooks.exact_context_demotion``; a bool overrides it. ``prefix_wait``: let
    new requests wait for a prefix in flight, at most ``max_prefix_wait_iters`` iterations, when it saves at
    least ``min_prefix_wait_tokens`` (None: one block). ``reserve_verify_width``: a generation request with
    fewer tokens left than ``1 + draft_len`` is scheduled for what it has left, as always, but its cache reserves
    room for all ``1 + draft_len`` positions, so a fixed-width step (a CUDA graph) may compute them; positions past
    the scheduled count are never committed, and the room is released when the step is done.
    """

    max_num_tokens: int = 8192
    max_num_requests: int = 256
    demote_uncached_tokens: int | None = None
    demote_max_iters: int | None = None
    exact_context_demotion: bool | None = None
    prefix_wait: bool = True
    max_prefix_wait_iters: int = 16
    min_prefix_wait_tokens: int | None = None
    reserve_verify_width: bool = False

    def __post_init__(self) -> None:
        _check_int("max_num_tokens", self.max_num_tokens, 1)
        _check_int("max_num_requests", self.max_num_requests, 1)
        if self.demote_uncached_tokens is not None:
            _check_int("demote_uncached_tokens", self.demote_uncached_tokens, 0)
        if self.demote_max_iters is not None:
            _check_int("demote_max_iters", self.demote_max_iters, 0)
        if self.exact_context_demotion is not None and not isinstance(self.exact_context_demotion, bool):
            raise TypeError(
                f"exact_context_demotion: expected a bool or None, got {type(self.exact_context_demotion).__name__}"
            )
        if not isinstance(self.prefix_wait, bool):
            raise TypeError(f"prefix_wait: expected a bool, got {type(self.prefix_wait).__name__}")
        _check_int("max_prefix_wait_iters", self.max_prefix_wait_iters, 0)
        if self.min_prefix_wait_tokens is not None:
            _check_int("min_prefix_wait_tokens", self.min_prefix_wait_tokens, 1)
        if not isinstance(self.reserve_verify_width, bool):
            raise TypeError(f"reserve_verify_width: expected a bool, got {type(self.reserve_verify_width).__name__}")


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        v = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}") from None
    if v < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}")
    return v


def resolve_demotion(config: SchedulerConfig) -> tuple[int, int]:
    """``(threshold tokens, max demoted iterations)``: the config's values, else the environment's, else
    (0 = off, 8)."""
    thr = config.demote_uncached_tokens
    if thr is None:
        thr = _env_count(ENV_DEMOTE_UNCACHED_TOKENS) or 0
    iters = config.demote_max_iters
    if iters is None:
        env = _env_count(ENV_DEMOTE_MAX_ITERS)
        iters = DEFAULT_DEMOTE_MAX_ITERS if env is None else env
    return thr, iters


class ScheduledRequest(NamedTuple):
    """One request's share of a step: ``num_tokens`` new tokens from position ``start`` (the KV it attends
    to before them). ``is_last_chunk``: the context chunk that ends the prefill (it emits the first token).
    ``snapshot_point``: a snapshot point the step passes inside it (mid-chunk snapshot); when the cache has a
    pending snapshot slot (hybrid manager) the scheduler acquired it, the recurrent kernel writes the state at
    that point into ``cache.pending_snapshot_slot``, and ``on_step_done`` commits up to the point from it."""

    request: Request
    num_tokens: int
    start: int
    is_last_chunk: bool
    snapshot_point: int | None = None


@dataclass(frozen=True)
class ScheduledBatch:
    """What one step runs, in execution order: ``generation`` then ``context``. Also what the pass did to
    other requests: ``preempted`` (suspended, back to waiting), ``deferred`` (DEFER at least once in this pass;
    a retried one also appears in ``context``) and ``prefix_waiting`` (waiting for a prefix in flight)."""

    step: int
    generation: tuple[ScheduledRequest, ...]
    context: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()
    deferred: tuple[Request, ...] = ()
    prefix_waiting: tuple[Request, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.generation) + len(self.context)

    @property
    def num_context_tokens(self) -> int:
        return sum(s.num_tokens for s in self.context)

    @property
    def num_generation_tokens(self) -> int:
        return sum(s.num_tokens for s in self.generation)

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + self.num_generation_tokens

    def tokens_by_id(self) -> dict[Hashable, int]:
        """Scheduled tokens per request id."""
        return {s.request.request_id: s.num_tokens for s in (*self.generation, *self.context)}

    def __iter__(self):
        yield from self.generation
        yield from self.context


@dataclass
class SchedulerStats:
    """Running totals since the scheduler was built (prefix-wait counters live in ``prefix_wait``)."""

    steps: int = 0
    context_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    deferrals: int = 0
    demotions: int = 0  # request-iterations moved to the tail (DEFERs included)
    probes: int = 0  # read-only prefix probes (exact demotion)
    finished: int = 0
    aborted: int = 0
    recomputes: int = 0  # suspended caches that could not resume and were rebuilt
    stall_preemptions: int = 0  # preemptions because a whole pass scheduled nothing


class Scheduler:
    """One server's scheduler (see the module docstring for the step API).

    ``hooks``: the model's :class:`~kvforge.kvcache.hooks.RuntimeHooks` (exact demotion); ``clock``: a callable
    giving the current time for request timestamps (default: the step number), so a simulator drives it with
    simulated time.

    **A pass.** Generation requests first, oldest first, one token each (plus ``draft_len`` speculative tokens);
    then context requests, within a token budget (``max_num_tokens``) and a request budget (``max_num_requests``):
    chunks in flight first, then the waiting queue, each in arrival order. A context chunk is as long as the
    budget allows, ends at snapshot points (:func:`~kvforge.scheduling.chunking.snapshot_chunk_end`) and is cut
    to the pages that can be found.

    **Pages.** Every claim is check-then-act: ``KVCache.resize`` changes nothing when pages are short. A running
    request that cannot grow preempts (suspends) the newest running requests not in this batch, never an older
    one, so the oldest request always progresses. A new admission never preempts: it is cut to the pages left, or
    the queue stops admitting for this pass. If a pass schedules nothing while requests remain, the newest
    running request is preempted and the pass repeated (a request preempted in a ``schedule`` call is not
    readmitted by it); with nothing left to preempt the scheduler raises
    :class:`~kvforge.errors.SchedulerDeadlockError` naming what is stuck, instead of spinning.

    **Long-context demotion.** With a threshold (``KVFORGE_CTX_DEMOTE_UNCACHED_TOKENS``), a context request whose
    uncached prefill is estimated above it moves behind the others (to the tail of the context order); each
    iteration it is moved back counts, and after ``demote_max_iters`` (``KVFORGE_CTX_DEMOTE_MAX_ITERS``) such
    iterations it is *starved* and keeps its place. Config values win over the environment. The estimate is the
    request's ``estimated_uncached_tokens`` (a router's guess, used for every chunk) when given, else its whole
    remaining context.

    **Exact demotion** (``RuntimeHooks.exact_context_demotion``): an estimate above the threshold is checked once
    with the manager's read-only ``probe_reuse`` (one walk per request and attempt); a request that holds a cache
    is judged by its exact remainder. A request ordered as short whose first prepare (reuse match) shows a long
    remainder returns DEFER: its claim is released (the cache closed, or suspended again if it was resumed), its
    exact remainder kept, one demoted iteration counted, and it is retried after the rest of the pass. A starved
    request is never deferred, so the aging bound holds for every request.

    **Prefix waits.** A new request whose prefix an in-flight request is still prefilling waits (at most
    ``max_prefix_wait_iters`` iterations) instead of computing it too, asks that owner for a snapshot point where
    their prompts part, and is probed again once it stops waiting. See :mod:`kvforge.scheduling.prefix_wait`.

    **Optional manager hooks** (the protocols of :mod:`kvforge.scheduling.seams`, so ``kvcache`` never imports this
    package): a :class:`~kvforge.scheduling.seams.ContextMarker` is asked to mark each context request before its
    chunk is sized (the hybrid manager sets the snapshot marks there); a
    :class:`~kvforge.scheduling.seams.PrefixWaitCounter` receives the requests that started waiting in a pass.
    When a chunk passes a snapshot point inside it and the cache is a
    :class:`~kvforge.scheduling.seams.SnapshotSlotCache` (hybrid), the scheduler claims the pending slot with the
    chunk (no slot: the chunk ends at the point instead) and ``on_step_done`` commits up to the point with
    ``snapshot_from_pending=True``, then the rest.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        *,
        hooks: RuntimeHooks | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager: expected a KVCacheManager, got {type(manager).__name__}")
        if config is None:
            config = SchedulerConfig()
        elif not isinstance(config, SchedulerConfig):
            raise TypeError(f"config: expected a SchedulerConfig, got {type(config).__name__}")
        if hooks is not None and not isinstance(hooks, RuntimeHooks):
            raise TypeError(f"hooks: expected a RuntimeHooks or None, got {type(hooks).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock: expected a callable or None, got {type(clock).__name__}")
        self.manager = manager
        self.config = config
        self.tokens_per_block = manager.tokens_per_block
        self.demote_uncached_tokens, self.demote_max_iters = resolve_demotion(config)
        exact = config.exact_context_demotion
        if exact is None:
            exact = bool(hooks is not None and hooks.exact_context_demotion)
        self.exact_context_demotion = exact
        self._clock = clock if clock is not None else (lambda: float(self._step))
        self.stats = SchedulerStats()
        min_wait = config.min_prefix_wait_tokens or self.tokens_per_block
        self.prefix_waits: PrefixWaitPlanner | None = (
            PrefixWaitPlanner(
                self.tokens_per_block, max_wait_iters=config.max_prefix_wait_iters, min_shared_tokens=min_wait
            )
            if config.prefix_wait and config.max_prefix_wait_iters > 0
            else None
        )
        self._mark_hook: Callable[[Request], Any] | None = (
            manager.mark_context_request if isinstance(manager, ContextMarker) else None
        )
        self._count_waits_hook: Callable[[Sequence[Request]], Any] | None = (
            manager.count_prefix_waits if isinstance(manager, PrefixWaitCounter) else None
        )
        self._requests: dict[Hashable, Request] = {}
        self._waiting: list[Request] = []  # by seq (arrival order)
        self._running: list[Request] = []  # by seq; every one holds an active cache
        self._pending: ScheduledBatch | None = None
        self._step: int = 0
        self._next_seq = 0
        # Per-pass scratch.
        self._budget = 0
        self._slots = 0
        self._pass_step = 0

    # --- views -------------------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Number of ``schedule`` calls so far."""
        return self._step

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def pending_batch(self) -> ScheduledBatch | None:
        """The batch handed out by ``schedule`` and not yet reported by ``on_step_done``."""
        return self._pending

    @property
    def prefix_wait_stats(self) -> PrefixWaitStats:
        return self.prefix_waits.stats if self.prefix_waits is not None else PrefixWaitStats()

    def get(self, request_id: Hashable) -> Request | None:
        return self._requests.get(request_id)

    # --- requests -----------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING, never added anywhere before). Raises ValueError / TypeError naming the
        argument on bad input, changing nothing."""
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a Request, got {type(request).__name__}")
        if request.seq != -1 or request.state is not _WAITING or request.cache is not None:
            raise ValueError(f"request: {request.request_id!r} was already given to a scheduler")
        if request.request_id in self._requests:
            raise ValueError(f"request: id {request.request_id!r} is already in use by an unfinished request")
        keys = None
        if request.token_ids is not None and request.block_keys is None:
            # The one time a token-mode request is keyed (from its validated array, checked here against the
            # manager's vocabulary): every later call passes these keys down.
            ids = cast("Sequence[int]", request.token_ids)  # prompt_keys hashes numpy arrays too (hashing.py)
            keys = tuple(self.manager.prompt_keys(ids, request.scope, request.cache_salt))
        if keys is None and (
            request.block_keys is not None
            and not request.keyless
            and len(request.block_keys) != request.prompt_len // self.tokens_per_block
        ):
            raise ValueError(
                f"block_keys: expected one key per full block of the prompt "
                f"({request.prompt_len // self.tokens_per_block} at {self.tokens_per_block} tokens per block), "
                f"got {len(request.block_keys)}"
            )
        if request.draft_len + 1 > self.config.max_num_tokens:
            raise ValueError(
                f"draft_len: a generation step needs {request.draft_len + 1} tokens, more than max_num_tokens "
                f"({self.config.max_num_tokens})"
            )
        if keys is not None:
            request.block_keys = keys
        request.seq = self._next_seq
        self._next_seq += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: Hashable) -> Request:
        """Finish a request now (closing its cache). Not while it is part of a pending batch."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: no unfinished request {request_id!r}")
        if self._pending is not None and req._batch_step == self._pending.step:
            raise SchedulerStateError(f"abort: request {request_id!r} is in the pending batch; call on_step_done first")
        if req.state is _WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
        req.aborted = True
        self.stats.aborted += 1
        self._finish(req)
        return req

    # --- one step ------------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Decide the next step (see the module docstring). Raises SchedulerStateError while a batch is pending
        and SchedulerDeadlockError when nothing can make progress."""
        if self._pending is not None:
            raise SchedulerStateError(f"schedule: step {self._pending.step} is pending; call on_step_done first")
        self._step += 1
        preempted: list[Request] = []
        while True:
            batch = self._schedule_pass(preempted)
            if batch.num_requests or not self._requests:
                break
            # Nothing ran: the pages are held by running requests that cannot grow. Free the newest one's and
            # try again; each round removes one running request, so this ends.
            if not self._running:
                raise SchedulerDeadlockError(self._deadlock_message())
            victim = self._running[-1]
            self._preempt(victim)
            self.stats.stall_preemptions += 1
            preempted.append(victim)
        self.stats.steps += 1
        self._pending = batch
        return batch

    def on_step_done(
        self,
        batch: ScheduledBatch,
        *,
        accepted_tokens: Mapping[Hashable, int] | None = None,
        new_tokens: Mapping[Hashable, Sequence[int]] | None = None,
    ) -> tuple[Request, ...]:
        """Commit the step's progress; returns the requests that finished.

        ``accepted_tokens``: per generation request id, the tokens the step produced (1 .. scheduled; default 1:
        no draft accepted). ``new_tokens``: the token ids produced, per request id (token-mode requests: they
        are committed so a later prompt can reuse them). Validated before anything changes.
        """
        if self._pending is None or batch is not self._pending:
            raise SchedulerStateError("on_step_done: expected the batch returned by the last schedule()")
        gen_n = {s.request.request_id: s.num_tokens for s in batch.generation}
        if accepted_tokens is not None:
            if not isinstance(accepted_tokens, Mapping):
                raise TypeError(f"accepted_tokens: expected a mapping, got {type(accepted_tokens).__name__}")
            for rid, a in accepted_tokens.items():
                n = gen_n.get(rid)
                # One cheap test per entry; anything it does not pass gets the detailed checks and their errors.
                if n is None or type(a) is not int or not 1 <= a <= n:
                    self._check_accepted(rid, a, gen_n)
        if new_tokens is not None:
            if not isinstance(new_tokens, Mapping):
                raise TypeError(f"new_tokens: expected a mapping, got {type(new_tokens).__name__}")
            # Tokens each request emits this step: a generation step its accepted count, a last chunk one.
            acc = accepted_tokens or {}
            emits = {rid: acc.get(rid, 1) for rid in gen_n}
            for s in batch.context:
                emits[s.request.request_id] = int(s.is_last_chunk)
            vocab = self.manager.hasher.vocab_size
            for rid, toks in new_tokens.items():
                ok = type(toks) is list or type(toks) is tuple
                if ok and len(toks) == emits.get(rid, -1):
                    for t in toks:
                        if type(t) is not int or not 0 <= t < vocab:
                            ok = False
                            break
                    if ok:
                        continue
                self._check_new_tokens(rid, toks, emits, vocab)
        self._pending = None
        now = self._clock()
        finished: list[Request] = []
        stats = self.stats
        for s in batch.context:
            req = s.request
            cache = req.cache
            end = s.start + s.num_tokens
            cache.resize(history=end)  # type: ignore[union-attr]
            req.num_computed_tokens = end
            stats.context_tokens += s.num_tokens
            if s.is_last_chunk:
                if self.prefix_waits is not None:
                    self.prefix_waits.remove_owner(req)
                self._emit(req, 1, None if new_tokens is None else new_tokens.get(req.request_id))
                if req.first_token_time is None:
                    req.first_token_time = now
                req.state = _GENERATION
            if (
                s.snapshot_point is not None
                and isinstance(cache, SnapshotSlotCache)
                and cache.pending_snapshot_slot is not None
            ):
                # The state at the passed point sits in the pending page: commit up to it from there first.
                self._commit(req, upto=s.snapshot_point, from_pending=True)
            self._commit(req)
            if req.num_generated >= req.max_new_tokens:
                finished.append(req)
        acc_get = None if accepted_tokens is None else accepted_tokens.get
        new_get = None if new_tokens is None else new_tokens.get
        commit = self._commit
        for s in batch.generation:
            req = s.request
            cache = req.cache
            a = 1 if acc_get is None else acc_get(req.request_id, 1)
            hist = cache.history + a  # type: ignore[union-attr]
            cache.resize(capacity=hist, history=hist)  # type: ignore[union-attr]
            stats.generation_tokens += s.num_tokens
            # _emit, inlined (once per running request per step)
            ids = None if new_get is None else new_get(req.request_id)
            if req.tokens is not None and ids is not None and len(req.output_tokens) == req.num_generated:
                req.output_tokens.extend(ids)
            req.num_generated += a
            commit(req)
            if req.num_generated >= req.max_new_tokens:
                finished.append(req)
        for req in finished:
            self._running.remove(req)
            req.finish_time = now
            stats.finished += 1
            self._finish(req)
        return tuple(finished)

    @staticmethod
    def _check_accepted(rid: Hashable, a: object, gen_n: Mapping[Hashable, int]) -> None:
        """The detailed checks of one ``accepted_tokens`` entry (raises naming it)."""
        if rid not in gen_n:
            raise ValueError(f"accepted_tokens: {rid!r} is not a generation request of this batch")
        _check_int(f"accepted_tokens[{rid!r}]", a, 1)
        if a > gen_n[rid]:  # type: ignore[operator]
            raise ValueError(f"accepted_tokens[{rid!r}]: {a} exceeds the {gen_n[rid]} tokens scheduled")

    @staticmethod
    def _check_new_tokens(rid: Hashable, toks: object, emits: Mapping[Hashable, int], vocab: int) -> None:
        """The detailed checks of one ``new_tokens`` entry (raises naming it)."""
        if rid not in emits:
            raise ValueError(f"new_tokens: {rid!r} is not part of this batch")
        if isinstance(toks, (str, bytes)) or not isinstance(toks, Sequence):
            raise TypeError(f"new_tokens[{rid!r}]: expected a sequence of ints, got {type(toks).__name__}")
        if len(toks) != emits[rid]:
            raise ValueError(f"new_tokens[{rid!r}]: this step emits {emits[rid]} tokens, got {len(toks)} ids")
        for t in toks:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"new_tokens[{rid!r}]: expected ints, got {type(t).__name__}")
            if not 0 <= t < vocab:
                # Checked here: a token-mode request keys these ids when it commits them.
                raise ValueError(f"new_tokens[{rid!r}]: expected token ids in [0, {vocab}), got {t}")

    # --- the pass ----------------------------------------------------------------------------------------------------

    def _schedule_pass(self, preempted: list[Request]) -> ScheduledBatch:
        step = self._step
        self._pass_step = step
        self._budget = self.config.max_num_tokens
        self._slots = self.config.max_num_requests
        gen: list[ScheduledRequest] = []
        ctx: list[ScheduledRequest] = []
        in_flight: list[Request] = []
        now: float | None = None
        reserve = self.config.reserve_verify_width

        for req in tuple(self._running):
            if self._slots <= 0:
                break
            state = req.state
            if state is _CONTEXT:
                in_flight.append(req)
                continue
            if state is not _GENERATION:
                continue  # preempted earlier in this pass
            n = room = 1 + req.draft_len
            left = req.max_new_tokens - req.num_generated
            if n > left:
                n = left
                if not reserve:
                    room = n
            if n > self._budget:
                continue
            cache = req.cache
            hist = cache.history  # type: ignore[union-attr]
            if not cache.resize(capacity=hist + room) and not self._make_room(req, hist + room, preempted):  # type: ignore[union-attr]
                continue
            req._batch_step = step
            gen.append(ScheduledRequest(req, n, hist, False))
            self._budget -= n
            self._slots -= 1

        deferred: list[Request] = []
        waited: list[Request] = []
        new_waiters: list[Request] = []
        if self._budget > 0 and self._slots > 0:
            thr = self.demote_uncached_tokens
            max_iters = self.demote_max_iters
            allow_defer = self.exact_context_demotion and thr > 0
            tail: list[Request] = []
            blocked = False
            gone = _Preempted(preempted)
            waiting = tuple(self._waiting)
            for phase, state in ((in_flight, _CONTEXT), (waiting, _WAITING)):
                for req in phase:
                    if self._budget <= 0 or self._slots <= 0 or (blocked and state is _WAITING):
                        break
                    # Preempted in this pass (its state changed) or already scheduled: not again.
                    if req.state is not state or req._batch_step == step or req in gone:
                        continue
                    if req.cache is None and self.prefix_waits is not None and self._prefix_wait(req, new_waiters):
                        waited.append(req)
                        continue
                    if thr > 0 and req.demote_iters < max_iters and self._is_long(req, thr):
                        req.demote_iters += 1
                        self.stats.demotions += 1
                        tail.append(req)
                        continue
                    act = self._try_context(req, ctx, allow_defer, preempted)
                    if act is ScheduleAction.DEFER:
                        deferred.append(req)
                    elif act is ScheduleAction.BLOCKED:
                        blocked = True
            for req in (*tail, *deferred):
                if self._budget <= 0 or self._slots <= 0:
                    break
                if req._batch_step == step or req in gone:
                    continue
                if req.state is _CONTEXT:
                    self._try_context(req, ctx, False, preempted)
                elif req.state is _WAITING and not blocked:
                    blocked = self._try_context(req, ctx, False, preempted) is ScheduleAction.BLOCKED
        if new_waiters and self._count_waits_hook is not None:
            self._count_waits_hook(tuple(new_waiters))
        if ctx:
            now = self._clock()
            for s in ctx:
                if s.request.first_scheduled_time is None:
                    s.request.first_scheduled_time = now
        return ScheduledBatch(step, tuple(gen), tuple(ctx), tuple(preempted), tuple(deferred), tuple(waited))

    def _estimate(self, req: Request) -> int:
        """Uncached prefill tokens as demotion sees them (exact where the scheduler knows them)."""
        cache = req.cache
        if self.exact_context_demotion:
            if cache is not None:
                done = req.num_computed_tokens if cache.is_active else cache.num_committed_tokens
                return req.context_len - done
            if req.uncached_prefill_probed:
                return req.probed_uncached_tokens  # type: ignore[return-value]
        if req.estimated_uncached_tokens is not None:
            return req.estimated_uncached_tokens
        return req.context_len - req.num_computed_tokens

    def _is_long(self, req: Request, thr: int) -> bool:
        if self._estimate(req) <= thr:
            return False
        if self.exact_context_demotion and req.cache is None and not req.uncached_prefill_probed:
            reused = self._probe(req)
            req.uncached_prefill_probed = True
            req.probed_uncached_tokens = req.context_len - reused
            return req.probed_uncached_tokens > thr
        return True

    def _probe(self, req: Request) -> int:
        self.stats.probes += 1
        limit = req.context_len - 1
        if req.tokens is not None:
            seq = self._sequence(req)
            return self.manager.probe_reuse(
                seq,
                req.scope,
                block_keys=self._keys_range(req, 0, len(seq) // self.tokens_per_block),
                max_reuse_tokens=limit,
                cache_salt=req.cache_salt,
            )
        return self.manager.probe_reuse(
            None, req.scope, block_keys=req.block_keys, max_reuse_tokens=limit, cache_salt=req.cache_salt
        )

    def _keys_range(self, req: Request, first: int, stop: int) -> tuple[int, ...]:
        """Block keys of blocks ``first .. stop - 1`` of a token-mode request's known tokens: the prompt's,
        computed once in add_request, then keys of generated blocks, each computed once (from its own tokens
        and its parent's key) and kept."""
        keys = req.block_keys
        assert keys is not None
        n_prompt = len(keys)
        if stop <= n_prompt:
            return keys[first:stop]
        ext = req._generated_keys
        have = n_prompt + len(ext)
        if have < stop:
            tpb = self.tokens_per_block
            parent = ext[-1] if ext else (keys[-1] if keys else self.manager.hasher.root_key(req.scope, req.cache_salt))
            new = self._token_range(req, have * tpb, stop * tpb)
            ext.extend(self.manager.hasher.block_keys(new, tpb, parent=parent))
        if first >= n_prompt:
            return tuple(ext[first - n_prompt : stop - n_prompt])
        return (*keys[first:], *ext[: stop - n_prompt])

    @staticmethod
    def _token_range(req: Request, start: int, stop: int) -> Sequence[int]:
        """Token ids at positions ``start .. stop - 1`` of a token-mode request (prompt, then generated ids),
        without building the whole sequence (a decode step touches only its own tokens)."""
        toks = req.tokens
        assert toks is not None
        p = req.prompt_len
        if stop <= p:
            return toks[start:stop]
        out = req.output_tokens
        if start >= p:
            return out[start - p : stop - p]
        return (*toks[start:], *out[: stop - p])

    def _sequence(self, req: Request) -> Sequence[int]:
        """Known tokens of the current context (token mode): the prompt, then generated ids when given."""
        toks = req.tokens
        assert toks is not None
        if req.output_tokens and req.context_len > req.prompt_len:
            return (*toks, *req.output_tokens[: req.context_len - req.prompt_len])
        # The read-only uint32 copy of the prompt: the manager takes it as validated and keeps it an array.
        # (typed as a Sequence for the manager's signature; it indexes and slices like one).
        return cast("Sequence[int]", req.token_ids) if req.token_ids is not None else toks

    def _prefix_wait(self, req: Request, new_waiters: list[Request]) -> bool:
        planner = self.prefix_waits
        assert planner is not None
        found = planner.find_owner(req)
        if found is not None and req.prefix_wait_iters < planner.max_wait_iters:
            owner, shared = found
            st = planner.stats
            if req.prefix_wait_iters == 0:
                st.requests_waited += 1
                new_waiters.append(req)
            req.prefix_wait_iters += 1
            st.wait_iterations += 1
            req.waiting_for_prefix_of = owner.request_id
            if owner.request_snapshot_point(shared):
                st.snapshot_points_requested += 1
            return True
        if req.waiting_for_prefix_of is not None:
            if found is not None:
                planner.stats.waits_expired += 1
            req.waiting_for_prefix_of = None
            # The tree changed while it waited: what the probe said is stale.
            req.uncached_prefill_probed = False
            req.probed_uncached_tokens = None
        return False

    def _prepare(self, req: Request) -> bool | None:
        """Give a WAITING request an active cache: resume its suspended one or create one with reuse. Returns
        True (resumed), False (created) or None when no pages can be found (the request then holds none)."""
        cache = req.cache
        if cache is not None:
            if cache.resume():
                req.context_len = req.prompt_len + req.num_generated
                req.num_computed_tokens = cache.num_committed_tokens
                return True
            # Part of its prefix was evicted, or no pages: start over from whatever the tree holds now.
            cache.close()
            req.cache = None
            req.reset_for_recompute()
            self.stats.recomputes += 1
        limit = req.context_len - 1
        try:
            if req.tokens is not None:
                seq = self._sequence(req)
                cache = self.manager.create_cache(
                    seq,
                    block_keys=self._keys_range(req, 0, len(seq) // self.tokens_per_block),
                    scope=req.scope,
                    max_reuse_tokens=limit,
                    cache_salt=req.cache_salt,
                )
            else:
                cache = self.manager.create_cache(
                    block_keys=req.block_keys, scope=req.scope, max_reuse_tokens=limit, cache_salt=req.cache_salt
                )
        except OutOfPagesError:
            return None
        cache.user_data = req
        req.cache = cache
        req.num_computed_tokens = cache.num_committed_tokens
        return False

    def _release_claim(self, req: Request, resumed: bool) -> None:
        cache = req.cache
        assert cache is not None
        if resumed:
            cache.suspend()
        else:
            cache.close()
            req.cache = None
            req.num_computed_tokens = 0

    def _try_context(
        self, req: Request, ctx: list[ScheduledRequest], allow_defer: bool, preempted: list[Request]
    ) -> ScheduleAction:
        fresh = req.state is _WAITING
        resumed = False
        if fresh:
            got = self._prepare(req)
            if got is None:
                return ScheduleAction.BLOCKED
            resumed = got
            remainder = req.context_len - req.num_computed_tokens
            if allow_defer and remainder > self.demote_uncached_tokens and req.demote_iters < self.demote_max_iters:
                # Ordered as short, but the match shows a long remainder: keep the exact figure so it is judged
                # by it from now on (and ages), release the claim, and retry after the rest of the pass.
                self._release_claim(req, resumed)
                req.uncached_prefill_probed = True
                req.probed_uncached_tokens = remainder
                req.demote_iters += 1
                req.num_deferrals += 1
                self.stats.deferrals += 1
                self.stats.demotions += 1
                return ScheduleAction.DEFER
        if self._mark_hook is not None:
            self._mark_hook(req)
        cache = req.cache
        assert cache is not None
        start = req.num_computed_tokens
        limit = req.context_len
        if limit - start > self._budget:
            limit = start + self._budget
        end = snapshot_chunk_end(
            start, limit, req.snapshot_points, req.midchunk_snapshot_alignment, req.midchunk_pass_point
        )
        if not cache.resize(capacity=end):
            fit = self._fit(req, start, end)
            if fit == start and not fresh:
                # A running chunk found no page at all: make room from newer requests (a new admission never
                # preempts, or admissions and preemptions would chase each other).
                fit = end if self._make_room(req, end, preempted) else self._fit(req, start, end)
            if fit == start:
                if fresh:
                    self._release_claim(req, resumed)
                    return ScheduleAction.BLOCKED
                return ScheduleAction.SKIP
            if cache.capacity != fit and not cache.resize(capacity=fit):
                raise AssertionError("can_resize promised pages that resize could not find")
            end = fit
        point = None
        if req.midchunk_snapshot_alignment is not None:
            point = passed_snapshot_point(start, end, req.snapshot_points)
            if (
                point is not None
                and isinstance(cache, SnapshotSlotCache)
                and cache.pending_snapshot_slot is None
                and cache.acquire_snapshot_slot() is None
            ):
                # No page for the mid-step snapshot: end the step at the point instead, where the live state is
                # saved at the end of the step (shrinking capacity always succeeds).
                end = point
                point = None
                cache.resize(capacity=end)
        n = end - start
        req._batch_step = self._pass_step
        ctx.append(ScheduledRequest(req, n, start, end == req.context_len, point))
        self._budget -= n
        self._slots -= 1
        if fresh:
            self._waiting.remove(req)
            req.state = _CONTEXT
            insort(self._running, req, key=_seq)
            if self.prefix_waits is not None:
                self.prefix_waits.add_owner(req)
        return ScheduleAction.RUN

    def _fit(self, req: Request, start: int, end: int) -> int:
        """The furthest end in ``(start, end]`` whose pages can be found now (``start`` when none)."""
        cache = req.cache
        assert cache is not None
        lo, hi = start, end  # lo fits (no growth), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cache.can_resize(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _make_room(self, req: Request, capacity: int, preempted: list[Request]) -> bool:
        """Preempt running requests newer than ``req`` and not in this batch, newest first, until ``req``'s cache
        can grow to ``capacity`` (then resized). False when that is not enough."""
        running = self._running
        cache = req.cache
        assert cache is not None
        i = len(running) - 1
        step = self._pass_step
        while i >= 0:
            v = running[i]
            if v.seq <= req.seq:
                break
            if v._batch_step != step:
                self._preempt(v)
                preempted.append(v)
                if cache.resize(capacity=capacity):
                    return True
            i -= 1
        return False

    def _preempt(self, req: Request) -> None:
        cache = req.cache
        assert cache is not None and cache.is_active
        cache.suspend()
        self._running.remove(req)
        insort(self._waiting, req, key=_seq)
        req.state = _WAITING
        req.num_preemptions += 1
        # What a resume recomputes: the prompt and every token generated so far, from the committed prefix.
        req.context_len = req.prompt_len + req.num_generated
        req.num_computed_tokens = cache.num_committed_tokens
        req.clear_snapshot_marks()
        req.requested_snapshot_points = set()
        self.stats.preemptions += 1
        if self.prefix_waits is not None:
            self.prefix_waits.remove_owner(req)

    # --- step results ------------------------------------------------------------------------------------------------

    def _emit(self, req: Request, n: int, toks: Sequence[int] | None) -> None:
        # (inlined in on_step_done's generation loop: keep the two alike)
        if req.tokens is not None and toks is not None and len(req.output_tokens) == req.num_generated:
            # Only a gap-free record of outputs can be committed (a step reported without ids breaks it).
            req.output_tokens.extend(toks)
        req.num_generated += n

    def _commit(self, req: Request, upto: int | None = None, from_pending: bool = False) -> None:
        """Commit what the cache holds and the request knows the keys of (up to ``upto``); ``from_pending``:
        the snapshot at the end comes from the pending slot (released when nothing can be committed)."""
        cache = req.cache
        assert cache is not None
        c = cache.num_committed_tokens
        target = min(cache.history, req.known_tokens())
        if upto is not None and upto < target:
            target = upto
        if target <= c or not cache.committing:
            if from_pending and isinstance(cache, SnapshotSlotCache):
                cache.release_snapshot_slot()
            return
        kw: dict[str, Any] = {"snapshot_from_pending": True} if from_pending else {}
        if req.tokens is not None:
            tpb = self.tokens_per_block
            if target // tpb > c // tpb:
                kw["block_keys"] = self._keys_range(req, c // tpb, target // tpb)
            elif not kw:  # a decode step inside a block: no keyword arguments to build
                cache.commit(self._token_range(req, c, target))
                return
            cache.commit(self._token_range(req, c, target), **kw)
            return
        tpb = self.tokens_per_block
        first = c // tpb
        n_full = target // tpb - first
        keys = req.block_keys[first : first + n_full] if n_full else None  # type: ignore[index]
        cache.commit(num_tokens=target - c, block_keys=keys, **kw)

    def _finish(self, req: Request) -> None:
        cache = req.cache
        if cache is not None and cache.status is not CacheStatus.CLOSED:
            cache.close()
        if self.prefix_waits is not None:
            self.prefix_waits.remove_owner(req)
        req.state = _DONE
        del self._requests[req.request_id]

    def _deadlock_message(self) -> str:
        mgr = self.manager
        avail = [mgr.num_available_pages(g) for g in range(mgr.num_groups)]
        total = [mgr.pool(g).capacity for g in range(mgr.num_groups)]
        head = self._waiting[0] if self._waiting else None
        what = "no request is waiting" if head is None else f"the oldest waiting request {head!r}"
        return (
            f"no request can make progress and nothing is left to preempt: {what} cannot get pages for its next "
            f"chunk (GPU pages available per pool group: {avail} of {total}; tokens per block "
            f"{self.tokens_per_block}); {len(self._requests)} unfinished requests. The pool is too small for "
            f"this request or the budgets admit no work."
        )


class _Preempted:
    """Membership in the pass's preempted list by identity (the list is short; requests are unhashable-safe)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Request]) -> None:
        self.items = items

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self.items)


def _seq(req: Request) -> int:
    return req.seq
