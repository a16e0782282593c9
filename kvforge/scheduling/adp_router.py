"""The attention-DP router: which attention data-parallel rank each new request joins.

* **Default**: queued requests are placed in queue order on the least-loaded rank (``(active tokens, active
  requests, rank)``), or on the ``attention_dp_rank`` they name; a rank at ``max_requests_per_rank`` takes no
  more.
* **KV-balanced admission**: a *planner* (:class:`DefaultKvBalancedPlanner`, or a model's
  ``RuntimeHooks.kv_balanced_admission_planner``) chooses which requests of a window at the head of the queue to
  admit and where, from each rank's free KV tokens. The library validates the plan, forces admission of a
  candidate skipped ``max_skipped_rounds`` times, and gives the queue head to an idle rank when a round admits
  nothing.

``candidate_groups`` tells a planner which candidates are interchangeable (groups in priority order; the FCFS
queue here puts every candidate in group 0). Both modes in full: ``docs/scheduling.md``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvforge.kvcache.hooks import RuntimeHooks

__all__ = [
    "DEFAULT_MAX_SKIPPED_ROUNDS",
    "AdmissionCandidate",
    "AttentionDPRouter",
    "DefaultKvBalancedPlanner",
    "KvBalancedAdmissionPlanner",
    "RankState",
    "RoutingRound",
]

DEFAULT_MAX_SKIPPED_ROUNDS = 8


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return v


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank's load when a round starts: active tokens and requests, and the KV tokens it can still take
    (``free_kv_tokens``; needed by KV-balanced admission only)."""

    rank: int
    num_tokens: int = 0
    num_requests: int = 0
    free_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 0)
        _check_int("num_tokens", self.num_tokens, 0)
        _check_int("num_requests", self.num_requests, 0)
        if self.free_kv_tokens is not None:
            _check_int("free_kv_tokens", self.free_kv_tokens, 0)


@dataclass(frozen=True, slots=True)
class AdmissionCandidate:
    """A head-of-queue request offered to the planner: its prompt tokens (the KV it will need first), the rank
    it asked for (or None), how many rounds it has been skipped, and its admission group."""

    request: Any
    request_id: Hashable
    num_tokens: int
    requested_rank: int | None
    skipped_rounds: int
    group: int


@runtime_checkable
class KvBalancedAdmissionPlanner(Protocol):
    """What a model may declare as ``RuntimeHooks.kv_balanced_admission_planner``.

    ``window(num_ranks=..., queue_len=...)``: how many head-of-queue requests to consider (>= 1; clipped to the
    queue). ``plan(candidates=..., candidate_groups=..., ranks=...)``: ``(candidate index, rank)`` pairs to
    admit; candidates left out are skipped this round. Both are called with keyword arguments.
    """

    def window(self, *, num_ranks: int, queue_len: int) -> int: ...

    def plan(
        self,
        *,
        candidates: Sequence[AdmissionCandidate],
        candidate_groups: Sequence[int],
        ranks: Sequence[RankState],
    ) -> Iterable[tuple[int, int]]: ...


class DefaultKvBalancedPlanner:
    """The library's planner: a window of ``per_rank`` candidates per rank; each candidate, in queue order, goes
    to the rank (its requested one, if any) with the most free KV tokens that can hold its prompt."""

    def __init__(self, per_rank: int = 2) -> None:
        self.per_rank = _check_int("per_rank", per_rank, 1)

    def window(self, *, num_ranks: int, queue_len: int) -> int:
        return max(1, min(queue_len, self.per_rank * num_ranks))

    def plan(
        self,
        *,
        candidates: Sequence[AdmissionCandidate],
        candidate_groups: Sequence[int],
        ranks: Sequence[RankState],
    ) -> list[tuple[int, int]]:
        free = {r.rank: (r.free_kv_tokens or 0) for r in ranks}
        out: list[tuple[int, int]] = []
        for i, c in enumerate(candidates):
            if c.requested_rank is not None:
                best = c.requested_rank if free.get(c.requested_rank, -1) >= c.num_tokens else None
            else:
                best = None
                for r, f in free.items():
                    if f >= c.num_tokens and (best is None or f > free[best]):
                        best = r
            if best is not None:
                free[best] -= c.num_tokens
                out.append((i, best))
        return out


@dataclass(frozen=True)
class RoutingRound:
    """One round's decisions: ``assignments`` (request, rank) in admission order; ``forced`` the ids admitted
    by the skipped-rounds rule or the idle-rank fallback; ``skipped`` the ids considered and left queued."""

    assignments: tuple[tuple[Any, int], ...]
    forced: tuple[Hashable, ...] = ()
    skipped: tuple[Hashable, ...] = ()

    def by_rank(self, num_ranks: int) -> list[list[Any]]:
        out: list[list[Any]] = [[] for _ in range(num_ranks)]
        for req, rank in self.assignments:
            out[rank].append(req)
        return out


class _Entry:
    __slots__ = ("group", "num_tokens", "request", "request_id", "requested_rank", "skipped_rounds")

    def __init__(self, request: Any, request_id: Hashable, num_tokens: int, requested_rank: int | None, group: int):
        self.request = request
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.requested_rank = requested_rank
        self.group = group
        self.skipped_rounds = 0


class AttentionDPRouter:
    """Places queued requests on ``num_ranks`` attention-DP ranks (see the module docstring).

    ``planner``: a :class:`KvBalancedAdmissionPlanner`; None takes ``hooks.kv_balanced_admission_planner``, else
    :class:`DefaultKvBalancedPlanner`. It is used only with ``kv_balanced_admission``.
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        kv_balanced_admission: bool = False,
        planner: KvBalancedAdmissionPlanner | None = None,
        hooks: RuntimeHooks | None = None,
        max_skipped_rounds: int = DEFAULT_MAX_SKIPPED_ROUNDS,
        max_requests_per_rank: int | None = None,
    ) -> None:
        self.num_ranks = _check_int("num_ranks", num_ranks, 1)
        if not isinstance(kv_balanced_admission, bool):
            raise TypeError(f"kv_balanced_admission: expected a bool, got {type(kv_balanced_admission).__name__}")
        if hooks is not None and not isinstance(hooks, RuntimeHooks):
            raise TypeError(f"hooks: expected a RuntimeHooks or None, got {type(hooks).__name__}")
        if planner is None and hooks is not None:
            planner = hooks.kv_balanced_admission_planner
        if planner is not None:
            missing = [n for n in ("window", "plan") if not callable(getattr(planner, n, None))]
            if missing:
                raise TypeError(
                    f"planner: expected an object with window() and plan(), {type(planner).__name__} lacks "
                    f"{', '.join(missing)}"
                )
        self.planner: KvBalancedAdmissionPlanner = planner if planner is not None else DefaultKvBalancedPlanner()
        self.kv_balanced_admission = kv_balanced_admission
        self.max_skipped_rounds = _check_int("max_skipped_rounds", max_skipped_rounds, 0)
        if max_requests_per_rank is not None:
            _check_int("max_requests_per_rank", max_requests_per_rank, 1)
        self.max_requests_per_rank = max_requests_per_rank
        self._queue: deque[_Entry] = deque()
        self._ids: set[Hashable] = set()
        self.num_forced = 0

    # --- queue -------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def queued_ids(self) -> tuple[Hashable, ...]:
        return tuple(e.request_id for e in self._queue)

    def skipped_rounds(self, request_id: Hashable) -> int:
        for e in self._queue:
            if e.request_id == request_id:
                return e.skipped_rounds
        raise ValueError(f"request_id: {request_id!r} is not queued")

    def enqueue(
        self,
        request: Any,
        *,
        num_tokens: int | None = None,
        requested_rank: int | None = None,
        request_id: Hashable | None = None,
    ) -> None:
        """Queue a request. ``num_tokens`` / ``requested_rank`` / ``request_id`` default to the request's
        ``prompt_len`` / ``attention_dp_rank`` / ``request_id`` attributes (a scheduling
        :class:`~kvforge.scheduling.request.Request` has them)."""
        if num_tokens is None:
            num_tokens = getattr(request, "prompt_len", None)
            if num_tokens is None:
                raise ValueError("num_tokens: required for a request without a prompt_len")
        _check_int("num_tokens", num_tokens, 0)
        if requested_rank is None:
            requested_rank = getattr(request, "attention_dp_rank", None)
        if requested_rank is not None:
            _check_int("requested_rank", requested_rank, 0)
            if requested_rank >= self.num_ranks:
                raise ValueError(f"requested_rank: {requested_rank} is not a rank (0..{self.num_ranks - 1})")
        if request_id is None:
            request_id = getattr(request, "request_id", None)
            if request_id is None:
                raise ValueError("request_id: required for a request without a request_id")
        if request_id in self._ids:
            raise ValueError(f"request_id: {request_id!r} is already queued")
        self._ids.add(request_id)
        self._queue.append(_Entry(request, request_id, num_tokens, requested_rank, 0))

    # --- a round -----------------------------------------------------------------------------------------------

    def route(self, ranks: Sequence[RankState]) -> RoutingRound:
        """Decide this round from each rank's state (one :class:`RankState` per rank, any order)."""
        states = self._check_ranks(ranks)
        if not self._queue:
            return RoutingRound(())
        if self.kv_balanced_admission:
            return self._route_kv_balanced(states)
        return self._route_min_heap(states)

    def _check_ranks(self, ranks: Sequence[RankState]) -> list[RankState]:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks: expected a sequence of RankState, got {type(ranks).__name__}")
        out: list[RankState | None] = [None] * self.num_ranks
        for i, r in enumerate(ranks):
            if not isinstance(r, RankState):
                raise TypeError(f"ranks[{i}]: expected a RankState, got {type(r).__name__}")
            if r.rank >= self.num_ranks or out[r.rank] is not None:
                raise ValueError(f"ranks[{i}]: rank {r.rank} is out of range or given twice")
            out[r.rank] = r
        if any(r is None for r in out):
            raise ValueError(f"ranks: expected one RankState per rank (0..{self.num_ranks - 1})")
        if self.kv_balanced_admission and any(r.free_kv_tokens is None for r in out):  # type: ignore[union-attr]
            raise ValueError("ranks: KV-balanced admission needs free_kv_tokens on every RankState")
        return out  # type: ignore[return-value]

    def _full(self, n_req: list[int], rank: int) -> bool:
        return self.max_requests_per_rank is not None and n_req[rank] >= self.max_requests_per_rank

    def _route_min_heap(self, states: list[RankState]) -> RoutingRound:
        tokens = [s.num_tokens for s in states]
        n_req = [s.num_requests for s in states]
        heap = [(tokens[r], n_req[r], r) for r in range(self.num_ranks) if not self._full(n_req, r)]
        heapq.heapify(heap)
        out: list[tuple[Any, int]] = []
        kept: deque[_Entry] = deque()
        while self._queue:
            e = self._queue.popleft()
            if e.requested_rank is not None:
                rank = e.requested_rank
                if self._full(n_req, rank):
                    kept.append(e)
                    continue
            else:
                rank = -1
                while heap:
                    t, n, r = heap[0]
                    if (t, n) != (tokens[r], n_req[r]) or self._full(n_req, r):
                        # Stale (every load change pushes a fresh entry) or the rank is full.
                        heapq.heappop(heap)
                        continue
                    rank = r
                    break
                if rank < 0:
                    kept.append(e)
                    continue
            tokens[rank] += e.num_tokens
            n_req[rank] += 1
            if not self._full(n_req, rank):
                heapq.heappush(heap, (tokens[rank], n_req[rank], rank))
            self._ids.discard(e.request_id)
            out.append((e.request, rank))
        self._queue = kept
        return RoutingRound(tuple(out))

    def _least_loaded(self, tokens: list[int], n_req: list[int]) -> int:
        return min(range(self.num_ranks), key=lambda r: (tokens[r], n_req[r], r))

    def _route_kv_balanced(self, states: list[RankState]) -> RoutingRound:
        planner = self.planner
        w = planner.window(num_ranks=self.num_ranks, queue_len=len(self._queue))
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"planner.window(): expected an int >= 1, got {w!r}")
        w = min(w, len(self._queue))
        window = [self._queue[i] for i in range(w)]
        candidates = tuple(
            AdmissionCandidate(e.request, e.request_id, e.num_tokens, e.requested_rank, e.skipped_rounds, e.group)
            for e in window
        )
        groups = tuple(e.group for e in window)
        raw = planner.plan(candidates=candidates, candidate_groups=groups, ranks=tuple(states))
        plan = self._check_plan(raw, window)

        tokens = [s.num_tokens for s in states]
        n_req = [s.num_requests for s in states]
        chosen: dict[int, int] = {}
        forced: list[Hashable] = []
        for i, rank in plan:
            chosen[i] = rank
        for i, e in enumerate(window):
            if i not in chosen and e.skipped_rounds >= self.max_skipped_rounds:
                # Forced admission: a request the plan keeps skipping runs anyway, so no request starves.
                chosen[i] = e.requested_rank if e.requested_rank is not None else self._least_loaded(tokens, n_req)
                forced.append(e.request_id)
        if not chosen:
            idle = [s.rank for s in states if s.num_requests == 0]
            head = window[0]
            if idle and (head.requested_rank is None or head.requested_rank in idle):
                # Nothing admitted while a rank has no work: give it the head of the queue.
                chosen[0] = head.requested_rank if head.requested_rank is not None else idle[0]
                forced.append(head.request_id)
        out: list[tuple[Any, int]] = []
        skipped: list[Hashable] = []
        for i, e in enumerate(window):
            picked = chosen.get(i)
            if picked is None:
                e.skipped_rounds += 1
                skipped.append(e.request_id)
                continue
            tokens[picked] += e.num_tokens
            n_req[picked] += 1
            out.append((e.request, picked))
            self._ids.discard(e.request_id)
        admitted = {id(window[i]) for i in chosen}
        self._queue = deque(e for e in self._queue if id(e) not in admitted)
        self.num_forced += len(forced)
        return RoutingRound(tuple(out), tuple(forced), tuple(skipped))

    def _check_plan(self, raw: Any, window: list[_Entry]) -> list[tuple[int, int]]:
        if raw is None or isinstance(raw, (str, bytes)):
            raise TypeError(f"planner.plan(): expected (candidate index, rank) pairs, got {type(raw).__name__}")
        try:
            pairs = list(raw)
        except TypeError:
            raise TypeError(f"planner.plan(): expected an iterable of pairs, got {type(raw).__name__}") from None
        seen: set[int] = set()
        out = []
        for k, pair in enumerate(pairs):
            try:
                i, rank = pair
            except (TypeError, ValueError):
                raise TypeError(f"planner.plan()[{k}]: expected a (candidate index, rank) pair, got {pair!r}") from None
            for name, v in (("candidate index", i), ("rank", rank)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"planner.plan()[{k}]: {name} must be an int, got {type(v).__name__}")
            if not 0 <= i < len(window) or i in seen:
                raise ValueError(f"planner.plan()[{k}]: candidate index {i} is out of the window or repeated")
            if not 0 <= rank < self.num_ranks:
                raise ValueError(f"planner.plan()[{k}]: rank {rank} is not a rank (0..{self.num_ranks - 1})")
            want = window[i].requested_rank
            if want is not None and want != rank:
                raise ValueError(
                    f"planner.plan()[{k}]: candidate {window[i].request_id!r} asked for rank {want}, planned on {rank}"
                )
            seen.add(i)
            out.append((i, rank))
        return out
