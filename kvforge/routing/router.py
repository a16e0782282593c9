"""The conversation router: places each request on one of several servers, where its prefix is cached.

``ConversationRouter(servers, ...)``: ``route(request) -> server``, then ``finish(request_id, success)``; the
coordinator path is ``routing_key`` / ``route_by_key`` / ``finish_request_by_id``; ``on_event(server, event)``
consumes a server's block events (with ``use_cache_events``). Settings: :class:`RouterConfig`; optional guards:
:class:`ImbalanceGuard`, :class:`CostGuard`. Membership changes in place (``add_server``, ``remove_server``,
``set_server_available``).

A request with a known ``conversation_id`` sticks to its session's server; one without an id whose leading
blocks match enough of a remembered conversation continues it; any other is new and follows a matched prefix
only when that prefix is specific enough (``new_conversation_follow``), else goes to the least-loaded server.
Load is tokens in flight per server: ``finish`` subtracts exactly what ``route`` added, and a request never
finished is reclaimed after ``request_ttl_s``.

Bad input raises ``TypeError`` / ``ValueError`` before any state changes; ``NoServerAvailableError`` when every
server is out of rotation; ``RequestInFlightError`` for an id already in flight. Thread-safe (one lock per
public call). The full rules, weights and guards: ``docs/routing.md``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count, repeat
from operator import add
from typing import Any, Final

from kvforge.errors import KvforgeError
from kvforge.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvforge.routing.load import LoadLedger, RequestInFlightError, Reservation
from kvforge.routing.membership import ServerMembership
from kvforge.routing.request import (
    RouteRequest,
    RoutingKey,
    _check_conversation_id,
    check_block_keys,
    request_content,
)
from kvforge.routing.trie import BlockTrie, ServerPrefixIndex

__all__ = [
    "FOLLOW_MODES",
    "ConversationRouter",
    "CostGuard",
    "ImbalanceGuard",
    "NoServerAvailableError",
    "RouterConfig",
    "RouterStats",
]

logger = logging.getLogger("kvforge.routing")

FOLLOW_MODES = ("specific", "always")

# The trie's cold dict work is left to ``finish`` (BlockTrie.drain): a decision's new blocks wait in a small dict
# of recent additions, and an evicted session's blocks are queued for removal, taken off up to this many per
# finish; a decision takes off only what exceeds the cap (requests placed faster than they finish, or never
# finished), and the trie folds its additions in itself beyond 4,096 keys.
_DRAIN_PER_FINISH: Final = 256
_PENDING_CAP_BLOCKS: Final = 8192

# How a request was matched (decides its weight on the affinity server).
_NEW, _FOLLOWED, _KNOWN = 0, 1, 2

_new_object: Final = object.__new__

# Integers up to this size are floats exactly: sums of integral floats below it are exact.
_EXACT: Final = 2.0**53


class NoServerAvailableError(KvforgeError):
    """Every server is out of rotation (:meth:`ConversationRouter.set_server_available`); nothing was placed."""


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ImbalanceGuard:
    """Keep affinity only while the affine server's backlog (after placing the request) stays within
    ``min * (1 + rel_slack) + abs_slack_tokens`` of the least backlog any server would have; otherwise place
    the request among the servers within that bound (the one caching most of it, then the least loaded).

    Moving a conversation recomputes its prompt elsewhere, which the whole fleet pays for, so the slack is
    wide: the defaults come from the Mooncake replay (``bench/bench_router_replay.py``), where tighter bounds
    lost prefix hits without shortening waits.
    """

    rel_slack: float = 2.0
    abs_slack_tokens: int = 32768

    def __post_init__(self) -> None:
        if not _finite_number(self.rel_slack) or self.rel_slack < 0:
            raise ValueError(f"rel_slack: expected a finite number >= 0, got {self.rel_slack!r}")
        _positive_int("abs_slack_tokens", self.abs_slack_tokens, minimum=0)

    def limit(self, min_backlog: float) -> float:
        return min_backlog * (1.0 + self.rel_slack) + self.abs_slack_tokens


@dataclass(frozen=True)
class CostGuard:
    """Place each request on the server with the least ``backlog + recompute_weight * uncached``, where
    ``uncached`` is the router's estimate of the prompt tokens that server would compute for it (on the affine
    server the conversation's growth or the prompt past the followed prefix; elsewhere the prompt past what
    cache events say is held, else the whole prompt). Ties keep the affine server.

    A request leaves its affine server ``t`` for ``s`` only when ``backlog[t] - backlog[s]`` exceeds
    ``recompute_weight * (uncached[s] - uncached[t])``: the wait it escapes must beat, that many times over,
    the prompt the move makes the fleet compute again, since every recomputed token lengthens some other
    request's queue. At 1 (the greedy earliest-finish rule) the Mooncake replay on 8 servers lost a quarter of
    the prefix hits and doubled the mean wait. The default 16 kept 98% of the same-capacity ceiling and cut
    the mean wait at utilisation 0.8 (``bench/bench_router_replay.py``); near saturation a recomputed token
    costs more than any fixed weight assumes, and there sticking to the affine server waits least. New
    conversations with no affine server take the same minimum, so with cache events they lean towards servers
    holding their prefix.
    """

    recompute_weight: float = 16.0

    def __post_init__(self) -> None:
        w = self.recompute_weight
        if not _finite_number(w) or not w >= 1.0:
            raise ValueError(f"recompute_weight: expected a finite number >= 1, got {w!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Router settings; the defaults are the reference system's (128 tokens/block, 0.75, 100,000, "specific")."""

    tokens_per_block: int = 128
    match_threshold: float = 0.75
    max_sessions: int = 100_000
    new_conversation_follow: str = "specific"
    new_conversation_min_match_blocks: int = 2
    specific_max_conversations: int = 4
    chars_per_token: float = 4.0
    request_ttl_s: float | None = 600.0
    use_cache_events: bool = False
    imbalance_guard: ImbalanceGuard | CostGuard | None = None
    log_every_new_conversations: int = 256
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("tokens_per_block", self.tokens_per_block)
        t = self.match_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 < t <= 1.0:
            raise ValueError(f"match_threshold: expected a number in (0, 1], got {t!r}")
        _positive_int("max_sessions", self.max_sessions)
        if self.new_conversation_follow not in FOLLOW_MODES:
            raise ValueError(
                f"new_conversation_follow: expected one of {FOLLOW_MODES}, got {self.new_conversation_follow!r}"
            )
        _positive_int("new_conversation_min_match_blocks", self.new_conversation_min_match_blocks, minimum=0)
        _positive_int("specific_max_conversations", self.specific_max_conversations)
        c = self.chars_per_token
        if not _finite_number(c) or not c > 0:
            raise ValueError(f"chars_per_token: expected a finite positive number, got {c!r}")
        ttl = self.request_ttl_s
        if ttl is not None and (not _finite_number(ttl) or not ttl > 0):
            raise ValueError(f"request_ttl_s: expected a finite positive number of seconds or None, got {ttl!r}")
        if not isinstance(self.use_cache_events, bool):
            raise TypeError(f"use_cache_events: expected a bool, got {type(self.use_cache_events).__name__}")
        if self.imbalance_guard is not None and not isinstance(self.imbalance_guard, (ImbalanceGuard, CostGuard)):
            raise TypeError(
                "imbalance_guard: expected an ImbalanceGuard, a CostGuard or None, "
                f"got {type(self.imbalance_guard).__name__}"
            )
        _positive_int("log_every_new_conversations", self.log_every_new_conversations)
        r = self.prefill_tokens_per_s
        if r is not None and (not _finite_number(r) or not r > 0):
            raise ValueError(
                f"prefill_tokens_per_s: expected a positive number (load units per second) or None, got {r!r}"
            )

    @property
    def always(self) -> bool:
        return self.new_conversation_follow == "always"

    @property
    def matching(self) -> bool:
        """New conversations may follow a matched prefix (0 minimum blocks turns that off)."""
        return self.new_conversation_min_match_blocks > 0


@dataclass
class RouterStats:
    """Counters since construction (what the INFO line and a bench report)."""

    routed: int = 0
    sticky: int = 0
    implicit: int = 0
    new_conversations: int = 0
    followed: int = 0
    guard_moves: int = 0
    failed: int = 0
    expired: int = 0
    evicted_sessions: int = 0


class _Placement(Reservation):
    """A reservation with the undo information a failure needs to restore its conversation's baseline.

    One object per placement (the ledger's record and the undo record at once). ``prev`` is the placement whose
    baseline this one replaced, kept only while it may still be needed: a finished or reclaimed placement drops
    it, so a chain only spans requests still in flight or failed. ``placed`` is when it was placed (the prefill
    estimate's start). The router builds it; the ledger sets its ``seq`` and ``deadline`` (``LoadLedger._insert``).
    """

    __slots__ = ("baseline_before", "failed", "handle", "placed", "prev")

    handle: int  # the session's integer handle: a reference back would make a garbage cycle
    baseline_before: int
    prev: _Placement | None
    failed: bool
    placed: float


# A session is a tuple of atoms, (handle, server, keys, baseline), so that the cyclic garbage collector stops
# tracking it after one young collection: 100,000 session objects made full collections pause decisions. An
# anonymous conversation is keyed by its handle; a named one by its id, with handle -> id in ``_key_of``.
_H: Final = 0
_SRV: Final = 1
_KEYS: Final = 2
_BASE: Final = 3
_Sess = tuple[int, int, tuple[Any, ...], int]


def _finite_time(t: object) -> float:
    if type(t) is not float:
        if type(t) is not int:
            raise TypeError(f"clock: expected it to return seconds as a float, got {type(t).__name__}")
        t = float(t)
    if t - t != 0.0:  # NaN and +-inf alike
        raise ValueError(f"clock: expected a finite time in seconds, got {t!r}")
    return t


class ConversationRouter(ServerMembership):
    """Routes requests over ``servers`` (any distinct hashable ids).

    Direct path: ``route(request) -> server``, then ``finish(request_id, success)``. Coordinator path:
    ``routing_key(request)`` on the front end, ``route_by_key(request_id, key)`` and
    ``finish_request_by_id(request_id, success)`` where the load lives. Cache events: ``on_event(server, ev)``.
    ``clock`` (seconds, monotonic, finite) is injectable for the time-to-live.

    Membership: ``servers`` is the tuple of current members, in order of joining. ``add_server`` joins a server
    empty (a server removed earlier and added again starts afresh); ``remove_server`` drops it with its
    block-event index (the last member cannot be removed); ``set_server_available(server, False)`` takes it out
    of rotation but keeps its event index, so it comes back knowing what it caches. A server out of rotation
    receives no new request; a conversation stuck to it moves on its next request, weighed and based as on a
    server caching nothing of it (unless events say otherwise), and sticks there; requests already in flight on
    it finish and restore their load and baseline exactly. With every member out of rotation, placing raises
    :class:`NoServerAvailableError`. Internally each membership takes a fresh index (never reused, so a late
    finish can never touch a newcomer's load); decisions cost nothing extra until a server leaves rotation.

    Thread-safe: every public method holds one lock for its whole call, so request handlers on several threads
    may share one router (decisions are serialised; each takes microseconds).

    ``prefill_tokens_per_s`` (in the load unit: tokens, uncached ones in ``"always"`` mode) is each server's
    prefill rate as the router assumes it. Set, decisions use :meth:`backlogs` instead of :meth:`loads`: the
    oldest in-flight request of each server is taken to have been computed at that rate since it was placed or
    since the server's previous finish, whichever is later. That assumes a server works through its requests
    roughly in arrival order; the discount never exceeds that one request's weight, so a wrong rate misjudges a
    server by at most one request. Accounting (:meth:`loads`, finishes, the time-to-live) is unchanged.
    """

    def __init__(
        self,
        servers: Sequence[Hashable],
        *,
        tokens_per_block: int = 128,
        match_threshold: float = 0.75,
        max_sessions: int = 100_000,
        new_conversation_follow: str = "specific",
        new_conversation_min_match_blocks: int = 2,
        specific_max_conversations: int = 4,
        chars_per_token: float = 4.0,
        request_ttl_s: float | None = 600.0,
        use_cache_events: bool = False,
        imbalance_guard: ImbalanceGuard | CostGuard | None = None,
        log_every_new_conversations: int = 256,
        prefill_tokens_per_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = RouterConfig(
            tokens_per_block=tokens_per_block,
            match_threshold=match_threshold,
            max_sessions=max_sessions,
            new_conversation_follow=new_conversation_follow,
            new_conversation_min_match_blocks=new_conversation_min_match_blocks,
            specific_max_conversations=specific_max_conversations,
            chars_per_token=chars_per_token,
            request_ttl_s=request_ttl_s,
            use_cache_events=use_cache_events,
            imbalance_guard=imbalance_guard,
            log_every_new_conversations=log_every_new_conversations,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        self._setup(servers, config, clock)

    @classmethod
    def from_config(
        cls, servers: Sequence[Hashable], config: RouterConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> ConversationRouter:
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config: expected a RouterConfig, got {type(config).__name__}")
        self = cls.__new__(cls)
        self._setup(servers, config, clock)
        return self

    def _setup(self, servers: Sequence[Hashable], config: RouterConfig, clock: Callable[[], float]) -> None:
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(clock).__name__}")
        self._init_membership(servers)
        self._config = config
        # Settings every decision reads, as plain attributes (the config is frozen; ``config`` is read-only).
        self._tpb = config.tokens_per_block
        self._always = config.always
        self._matching = config.matching
        self._events = config.use_cache_events
        guard = config.imbalance_guard
        self._cost_weight = guard.recompute_weight if isinstance(guard, CostGuard) else None
        self._cost_integral = isinstance(guard, CostGuard) and float(guard.recompute_weight).is_integer()
        self._guard = guard if isinstance(guard, ImbalanceGuard) else None
        self._threshold = config.match_threshold
        self._specific_max = config.specific_max_conversations
        self._min_blocks = config.new_conversation_min_match_blocks
        self._max_sessions = config.max_sessions
        self._log_every = config.log_every_new_conversations
        self._rate = config.prefill_tokens_per_s
        self.stats = RouterStats()
        self._lock = threading.Lock()
        self._clock = clock
        self._ledger = LoadLedger(len(self.servers), config.request_ttl_s)
        # key -> (handle, server, keys, baseline), least recent first (an anonymous conversation's key is its
        # handle); handle -> id for the named ones (a trie owner's session is sessions[_key_of.get(h, h)]).
        self._sessions: OrderedDict[Hashable, _Sess] = OrderedDict()
        # Keyed by str ids and int handles alike: made general now, since a table of str keys alone is rebuilt
        # the first time an anonymous conversation arrives (about 20 ms at 100,000 sessions, inside a decision).
        self._sessions[-1] = (-1, -1, (), 0)
        del self._sessions[-1]
        self._key_of: dict[int, str] = {}
        # handle -> the session's latest placement, only while it is in flight (or failed and rolled onto).
        self._last: dict[int, _Placement] = {}
        self._trie = BlockTrie()
        self._drain_per_finish = _DRAIN_PER_FINISH
        self._pending_cap = _PENDING_CAP_BLOCKS
        self._cache_index = ServerPrefixIndex(len(self.servers))
        self._handles = count()
        self._rotor = 0
        self._followed_at_last_log = 0
        # Per server, its reservations in placement order (finished ones are skipped when they reach the
        # front) and when its latest request left: what the prefill-progress estimate needs.
        n = len(self.servers)
        self._queues: list[deque[_Placement]] | None = (
            [deque() for _ in range(n)] if config.prefill_tokens_per_s is not None else None
        )
        self._last_release = [float("-inf")] * n
        # Per server, the weight of its oldest live reservation and when that one is taken to have started
        # (its placement or the server's latest release, whichever is later); 0 and +inf for a server with
        # nothing in flight. Kept by every placement and release (_advance_head), so that a decision reads
        # each server's backlog without walking its queue.
        self._head_weight = [0] * n
        self._head_start = [math.inf] * n

    @property
    def config(self) -> RouterConfig:
        """The router's settings (fixed at construction)."""
        return self._config

    def _now(self) -> float:
        t = self._clock()
        if t.__class__ is float and t - t == 0.0:  # the common case, without a call
            return t
        return _finite_time(t)

    # ---------------------------------------------------------------- queries

    def backlogs(self) -> dict[Hashable, float]:
        """The load each server is judged by when placing: :meth:`loads`, less the estimated progress of its
        oldest in-flight request when ``prefill_tokens_per_s`` is set."""
        with self._lock:
            backlogs = self._backlogs(self._now())
            return {s: backlogs[i] for s, i in self._index_of.items()}

    def in_flight(self) -> int:
        with self._lock:
            return len(self._ledger)

    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def session_server(self, conversation_id: str) -> Hashable | None:
        """The server an explicit conversation sticks to (None if unknown); does not refresh its recency."""
        _check_conversation_id(conversation_id)
        with self._lock:
            s = self._sessions.get(conversation_id)
            return None if s is None else self._slot_server[s[_SRV]]

    def cached_blocks(self, server: Hashable) -> int:
        """Blocks the server's cache events say it holds."""
        with self._lock:
            return self._cache_index.blocks(self._server_index(server))

    def sanity_check(self) -> None:
        """Raise AssertionError if the internal state is inconsistent (for tests and simulators; O(state))."""
        with self._lock:
            self._sanity_check()

    def _sanity_check(self) -> None:
        n = len(self._slot_server)
        assert self.servers, "no member"
        assert self._ledger.num_servers == n == self._cache_index.num_servers == len(self._last_release)
        assert self._queues is None or len(self._queues) == n
        assert len(self._head_weight) == len(self._head_start) == n
        if self._queues is not None:
            for i, q in enumerate(self._queues):
                # The front of each queue is live, and its weight and start are those recorded for the server.
                head = (0, math.inf)
                if q:
                    front = q[0]
                    assert self._ledger.get(front.request_id) is front, f"server {i}: a finished request at the front"
                    head = (front.weight, max(front.placed, self._last_release[i]))
                assert (self._head_weight[i], self._head_start[i]) == head, f"server {i}: head {head} not recorded"
        assert self._retired <= self._down and all(0 <= i < n for i in self._down)
        members = tuple(s for i, s in enumerate(self._slot_server) if i not in self._retired)
        assert members == self.servers, f"members {members} != servers {self.servers}"
        assert self._index_of == {s: i for i, s in enumerate(self._slot_server) if i not in self._retired}
        for i in self._retired:
            assert self._cache_index.blocks(i) == 0, f"removed index {i} still holds blocks"
        loads = [0] * n
        for res in self._ledger.reservations():
            loads[res.server] += res.weight
        assert loads == self._ledger.loads, f"loads {self._ledger.loads} != reservations {loads}"
        assert self._ledger.total == sum(loads), f"total {self._ledger.total} != loads {sum(loads)}"
        assert min(loads) >= 0, f"negative load {loads}"
        assert len(self._sessions) <= self._config.max_sessions
        named = 0
        refs: dict[Hashable, int] = {}
        for key, s in self._sessions.items():
            if key.__class__ is int:
                assert key == s[_H], f"anonymous session {key!r} holds handle {s[_H]}"
            else:
                assert isinstance(key, str), f"session key {key!r}: expected an id or a handle"
                named += 1
            assert self._key_of.get(s[_H], s[_H]) == key, f"session {key!r}: handle {s[_H]} maps elsewhere"
            for h in s[_KEYS]:
                refs[h] = refs.get(h, 0) + 1
        assert len(self._key_of) == named, "named sessions and their handles differ"
        for h in self._last:
            kept = self._sessions.get(self._key_of.get(h, h))
            assert kept is not None and kept[_H] == h, f"a placement is kept for session handle {h}, which is gone"
        self._trie.sanity_check()
        assert self._trie.pending_removals <= self._pending_cap, "queued trie removals above the cap"
        assert len(refs) == len(self._trie), f"trie holds {len(self._trie)} blocks, sessions {len(refs)}"
        for h, n in refs.items():
            node = self._trie.node(h)
            assert node is not None and node.refs == n, f"block {h!r}: {n} sessions, node {node and node.refs}"

    # ---------------------------------------------------------------- membership

    # add_server, remove_server, set_server_available and the membership queries are ServerMembership's;
    # these hooks keep the per-server state (event index, release times, prefill queues) in step.

    def _grow(self) -> None:
        self._cache_index.add_server()
        self._last_release.append(float("-inf"))
        self._head_weight.append(0)
        self._head_start.append(math.inf)
        if self._queues is not None:
            self._queues.append(deque())

    def _forget(self, index: int) -> None:
        self._cache_index.clear(index)

    # ---------------------------------------------------------------- routing

    def route(self, request: RouteRequest) -> Hashable:
        """Place ``request`` and reserve its load on the chosen server."""
        keys: tuple[Any, ...]
        num_tokens: int
        if request.__class__ is RouteRequest and request.token_ids is None and request.text is None:
            # Bare keys: the request checked them when it was built (a tuple, and an int count with them).
            keys, num_tokens = request.block_keys, request.num_tokens  # type: ignore[assignment]
        else:
            if not isinstance(request, RouteRequest):
                raise TypeError(f"request: expected a RouteRequest, got {type(request).__name__}")
            keys, num_tokens = request_content(request, self._tpb, self._config.chars_per_token)
        lock = self._lock
        lock.acquire()  # (what ``with`` does, at half its cost)
        try:
            return self._slot_server[self._place(request.request_id, request.conversation_id, keys, num_tokens)]
        finally:
            lock.release()

    def routing_key(self, request: RouteRequest) -> RoutingKey:
        """What a coordinator forwards: ``{conversation_id, num_tokens}`` (tokens, text estimated) + block keys."""
        if not isinstance(request, RouteRequest):
            raise TypeError(f"request: expected a RouteRequest, got {type(request).__name__}")
        keys, num_tokens = request_content(request, self._config.tokens_per_block, self._config.chars_per_token)
        return RoutingKey(request.conversation_id, num_tokens, keys)

    def route_by_key(self, request_id: Hashable, key: RoutingKey | Mapping[str, Any]) -> Hashable:
        """Coordinator path: place a request from its routing key (same rules and weights as ``route``)."""
        _check_request_id(request_id)
        if not isinstance(key, RoutingKey):
            key = RoutingKey.from_mapping(key)
        with self._lock:
            return self._slot_server[self._place(request_id, key.conversation_id, key.block_keys, key.num_tokens)]

    def finish_request_by_id(self, request_id: Hashable, success: bool = True) -> bool:
        """Remove exactly the load the request added; False if it is not in flight (unknown or expired).

        A failed request restores its conversation's token baseline, so a retry reserves its uncached prompt
        again, unless a newer request of that conversation has set a baseline since.
        """
        _check_request_id(request_id)
        if not isinstance(success, bool):
            raise TypeError(f"success: expected a bool, got {type(success).__name__}")
        with self._lock:
            return self._finish(request_id, success)

    finish = finish_request_by_id

    def _finish(self, request_id: Hashable, success: bool) -> bool:
        now = self._now()
        self._reclaim(now)
        if self._trie.deferred:
            self._trie.drain(self._drain_per_finish)
        res = self._ledger.release(request_id)
        if res is None:
            return False
        self._last_release[res.server] = now
        if self._queues is not None:
            self._advance_head(res.server)
        undo: _Placement = res  # type: ignore[assignment]
        last = self._last
        if success:
            undo.prev = None
            if last.get(undo.handle) is undo:
                del last[undo.handle]  # a finished placement at the head rolls nothing back
            return True
        self.stats.failed += 1
        undo.failed = True
        if last.get(undo.handle) is undo:
            key = self._key_of.get(undo.handle, undo.handle)
            # Roll back past every failed placement at the head of the chain: their prompts were never
            # cached. A failure of an older placement, superseded by a newer one, leaves the baseline alone.
            q = undo
            while q.prev is not None and q.prev.failed:
                q = q.prev
            h, srv, keys, _ = self._sessions[key]
            self._sessions[key] = (h, srv, keys, q.baseline_before)
            if q.prev is None:
                del last[undo.handle]
            else:
                last[undo.handle] = q.prev
        return True

    def reclaim_expired(self) -> int:
        """Release requests older than the time-to-live now; returns how many."""
        with self._lock:
            now = self._now()  # (checked before anything changes)
            if self._trie.deferred:
                self._trie.drain(self._drain_per_finish)
            return self._reclaim(now)

    def _reclaim(self, now: float) -> int:
        if self._config.request_ttl_s is None:
            return 0
        expired = self._ledger._expire(now)
        if not expired:
            return 0
        last = self._last
        for res in expired:
            undo: _Placement = res  # type: ignore[assignment]
            undo.prev = None
            if last.get(undo.handle) is undo:
                del last[undo.handle]
            self._last_release[res.server] = now
        if self._queues is not None:
            for server in {res.server for res in expired}:
                self._advance_head(server)
        self.stats.expired += len(expired)
        return len(expired)

    # ---------------------------------------------------------------- cache events

    def on_event(self, server: Hashable, event: KVEvent) -> None:
        """Consume one block event of ``server``'s KV cache (data only; the router never calls back).

        Events are validated always but indexed only with ``use_cache_events``, so a router that does not use
        them spends no memory on them.
        """
        with self._lock:
            self._on_event(server, event)

    def on_events(self, server: Hashable, events: Iterable[KVEvent]) -> None:
        """Consume several events of ``server`` in order (all checked before any is applied)."""
        if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
            raise TypeError(f"events: expected an iterable of KV events, got {type(events).__name__}")
        events = list(events)
        with self._lock:
            checked = [self._check_event(server, ev) for ev in events]
            for idx, keys, ev in checked:
                self._apply_event(idx, keys, ev)

    def _on_event(self, server: Hashable, event: KVEvent) -> None:
        idx, keys, ev = self._check_event(server, event)
        self._apply_event(idx, keys, ev)

    def _check_event(self, server: Hashable, event: KVEvent) -> tuple[int, tuple[Any, ...], KVEvent]:
        idx = self._server_index(server)
        if isinstance(event, BlockStored):
            if event.tokens_per_block != self._config.tokens_per_block:
                raise ValueError(
                    f"event.tokens_per_block: expected {self._config.tokens_per_block} (the router's block size), "
                    f"got {event.tokens_per_block!r}"
                )
            return idx, _event_keys(event), event
        if isinstance(event, BlockRemoved):
            return idx, _event_keys(event), event
        if isinstance(event, AllBlocksCleared):
            return idx, (), event
        raise TypeError(f"event: expected a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}")

    def _apply_event(self, idx: int, keys: tuple[Any, ...], event: KVEvent) -> None:
        if not self._config.use_cache_events:
            return
        if isinstance(event, BlockStored):
            self._cache_index.store(idx, keys)
        elif isinstance(event, BlockRemoved):
            self._cache_index.remove(idx, keys)
        else:
            self._cache_index.clear(idx)

    # ---------------------------------------------------------------- core

    def _place(self, request_id: Hashable, conv: str | None, keys: tuple[Any, ...], num_tokens: int) -> int:
        # One function, its state in locals: a decision is a few microseconds, and each call or record it made
        # (a match record, lookups of the cached lengths through a helper) cost a tenth of one.
        # The clock is checked first: a bad argument (here, a NaN time) is reported as such whatever the
        # fleet's state, and nothing has changed yet.
        now = self._clock()
        if now.__class__ is not float or now - now != 0.0:  # (the common case costs no call)
            now = _finite_time(now)
        down = self._down
        if down and len(down) == len(self._slot_server):
            raise NoServerAvailableError("no server is in rotation (every member was set unavailable)")
        ledger = self._ledger
        # (The ledger's own fields, read in place.)
        deadlines = ledger._deadlines
        if deadlines and deadlines[0][0] <= now:
            self._reclaim(now)
        live = ledger._live
        if request_id in live:
            raise RequestInFlightError(f"request {request_id!r} is already in flight; finish it before reusing its id")
        loads: list[float]
        if live and self._queues is not None:
            loads = self._backlogs(now)
            int_loads = False
        else:
            loads = ledger._loads.copy()  # type: ignore[assignment]
            int_loads = True  # (the ledger's integer loads; +inf out of rotation)
        if down:
            for i in down:  # out of rotation: loses every comparison
                loads[i] = math.inf

        # ---- What the request continues: a known session (by id, or by its leading blocks), a prefix, nothing.
        sessions = self._sessions
        stats = self.stats
        tpb = self._tpb
        events = self._events
        # Servers out of rotation cache nothing a new placement could use: their held lengths read 0.
        down_mask = 0
        if down and events:
            for i in down:
                down_mask |= 1 << i
        key: Hashable = conv
        session = None if conv is None else sessions.get(conv)
        kind = _NEW
        target: int | None = None  # the affine server
        own_base = 0  # the prompt tokens the affine server caches, as far as the router knows
        common = 0  # a known session's leading blocks this prompt still shares
        # Per server, the leading blocks its cache events say it holds; None when no server (outside ``ignore``)
        # holds the first one, i.e. every length 0. Looked up once, on first use (``have_held``): a decision that
        # keeps its affine server within an ImbalanceGuard's bound never needs it.
        held: list[int] | None = None
        have_held = False
        if session is not None:
            stats.sticky += 1
        else:
            # The longest run of the prompt's leading blocks the router remembers, and its last block's node.
            matched, refs, owner, node_server = self._trie.match_fields(keys)
            # A prefix held by a few conversations says where a request belongs; so does one held by less than
            # one server's share of the session table (a document some conversations share). One in more than
            # that share (a system prompt in front of everything) does not: following it would pile everyone
            # onto one server, and every server soon caches it anyway.
            if (
                conv is None
                and matched
                and matched >= self._threshold * len(keys)
                and (refs <= self._specific_max or refs * len(self.servers) <= len(sessions))
            ):
                key = self._key_of.get(owner, owner)
                session = sessions.get(key)
                if session is not None:
                    stats.implicit += 1
            if session is None and self._matching:
                min_blocks = self._min_blocks
                if matched >= min_blocks and (
                    refs <= self._specific_max or (self._always and refs * len(self.servers) <= len(sessions))
                ):
                    owner_session = sessions.get(self._key_of.get(owner, owner))
                    kind = _FOLLOWED
                    target = owner_session[_SRV] if owner_session is not None else node_server
                    own_base = matched * tpb
                # Events place a new conversation in either mode. In "specific" mode only where the router's own
                # memory does not call the prefix a shared preamble (the same test as above: held by a few
                # conversations, or by less than one server's share of the table); that keeps a preamble that
                # one engine announced first from pulling every new conversation onto it.
                if events and (
                    kind == _FOLLOWED
                    or self._always
                    or refs <= self._specific_max
                    or refs * len(self.servers) <= len(sessions)
                ):
                    held = self._cache_index.held_lengths(keys, down_mask)
                    have_held = True
                    # (A prefix cached nowhere for the minimum length cannot be followed: skip the search.)
                    if held is not None and max(held) >= min_blocks:
                        # The servers' own events beat the router's memory: follow where the prefix is actually
                        # cached, and among servers caching equally much (a preamble held everywhere), the least
                        # loaded.
                        best = _most_cached(held, loads)
                        have = held[best]
                        if have >= min_blocks and (
                            target is None or (have, -loads[best]) > (held[target], -loads[target])
                        ):
                            kind = _FOLLOWED
                            target = best
                            own_base = have * tpb
        if session is not None:
            kind = _KNOWN
            target = session[_SRV]
            old = session[_KEYS]
            n = len(old)
            common = n if len(keys) >= n and keys[:n] == old else self._common_blocks(old, keys)
            # An edited history (the prompt no longer extends the previous one) is only cached up to the fork.
            own_base = session[_BASE] if common == n else min(session[_BASE], common * tpb)
        if down and target in down:
            # Its server left rotation: the conversation is placed afresh (and sticks to where it lands).
            target = None
            if kind == _FOLLOWED:
                kind = _NEW
        # The prompt tokens the affine server would compute: a known conversation's growth (at least a block),
        # else the prompt past the followed prefix.
        # (Conditional expressions where min() and max() of two ints would cost a call each; same values.)
        own_uncached = 0
        if target is not None:
            own_uncached = num_tokens - own_base
            floor = tpb if kind == _KNOWN else 0
            if own_uncached < floor:
                own_uncached = floor
        # A known conversation's own server is weighed by its growth, never by ``held``: its entry is left at 0
        # (and the lookup stops once no other server still matches).
        ignore = down_mask | (1 << target) if kind == _KNOWN and target is not None else down_mask

        # ---- The server.
        cost_weight = self._cost_weight
        if cost_weight is not None:
            if target is None and not events:
                chosen = self._pick_min(loads)  # every server would compute the whole prompt
            else:
                if events and not have_held:
                    held = self._cache_index.held_lengths(keys, ignore)
                    have_held = True
                chosen = self._choose_by_cost(target, own_uncached, held, num_tokens, loads, cost_weight, int_loads)
        else:
            chosen = self._choose(target, own_uncached, held, have_held, ignore, keys, num_tokens, loads, int_loads)

        # ---- Its weight, the baseline a failure restores, the session and the reservation.
        always = self._always
        if chosen == target:
            weight = own_uncached if always else num_tokens
            chosen_held = 0  # (unused: the affine server's baseline is its own)
        else:
            if events and not have_held:
                held = self._cache_index.held_lengths(keys, ignore)
            chosen_held = 0 if held is None else held[chosen]
            weight = num_tokens
            if always:
                weight = num_tokens - chosen_held * tpb
                if weight < 0:
                    weight = 0
        last = self._last
        if kind == _KNOWN:
            assert session is not None
            handle, _, old, old_base = session
            baseline_before = old_base if chosen == target else chosen_held * tpb
            prev = last.get(handle)
            # The session now holds this prompt: the trie trades its blocks past the common run for the new ones.
            if common < len(old):
                self._trie.remove(old[common:])
            if common < len(keys):
                self._trie._add(keys[common:], handle, chosen)
            sessions[key] = (handle, chosen, keys, num_tokens)
            sessions.move_to_end(key)
        else:
            followed = kind == _FOLLOWED and chosen == target
            baseline_before = own_base if followed else chosen_held * tpb
            if baseline_before > num_tokens:
                baseline_before = num_tokens
            prev = None
            handle = self._new_session(conv, chosen, keys, num_tokens)
            stats.new_conversations += 1
            stats.followed += followed
            if self._matching and stats.new_conversations % self._log_every == 0:
                self._log_new_conversations()
        # (Built field by field: calling the class runs the dataclass __init__, a frame and an argument tuple.)
        res: _Placement = _new_object(_Placement)
        res.request_id = request_id
        res.server = chosen
        res.weight = weight
        res.payload = None
        res.handle = handle
        res.baseline_before = baseline_before
        res.prev = prev
        res.failed = False
        res.placed = now
        ledger._insert(res, now)
        last[handle] = res
        queues = self._queues
        if queues is not None:
            q = queues[chosen]
            if not q:  # the server's oldest in-flight request now
                self._head_weight[chosen] = weight
                released = self._last_release[chosen]
                self._head_start[chosen] = released if released > now else now
            q.append(res)
            if len(q) > 64 and len(q) > 2 * ledger._counts[chosen] + 64:
                # A request stuck at the front (no time-to-live) would keep every later, finished one queued.
                queues[chosen] = deque(e for e in q if live.get(e.request_id) is e)
        stats.routed += 1
        return chosen

    def _backlogs(self, now: float) -> list[float]:
        ledger = self._ledger
        loads: list[float] = ledger._loads.copy()  # type: ignore[assignment]
        rate = self._rate
        if self._queues is None or rate is None or not ledger._live:
            return loads
        # Each server's oldest in-flight request counts as computed at ``rate`` since it started, up to its
        # weight; a server with none (weight 0, start +inf) keeps its load (0) as it is.
        return [
            load - min(w, rate * max(0.0, now - started))
            for load, w, started in zip(loads, self._head_weight, self._head_start)
        ]

    def _advance_head(self, server: int) -> None:
        """After a release on ``server``: drop its finished reservations from the front of its queue and
        record its oldest live one's weight and start (the per-server state :meth:`_backlogs` reads)."""
        assert self._queues is not None
        q = self._queues[server]
        live = self._ledger._live
        while q and live.get(q[0].request_id) is not q[0]:
            q.popleft()
        if q:
            head = q[0]
            self._head_weight[server] = head.weight
            self._head_start[server] = max(head.placed, self._last_release[server])
        else:
            self._head_weight[server] = 0
            self._head_start[server] = math.inf

    def _choose(
        self,
        target: int | None,
        own_uncached: int,
        held: list[int] | None,
        have_held: bool,
        ignore: int,
        keys: tuple[Any, ...],
        num_tokens: int,
        loads: list[float],
        int_loads: bool,
    ) -> int:
        """The server for this request without a :class:`CostGuard` (with one: :meth:`_choose_by_cost`).

        ``held`` is the cache index's ``held_lengths(keys, ignore)`` when ``have_held``, else looked up here if
        needed; ``ignore`` already holds the servers out of rotation when events are on (``_place``'s mask).
        ``int_loads``: ``loads`` are the ledger's integer loads (and +inf out of rotation), not backlogs.
        """
        guard = self._guard
        if target is not None and guard is None:
            return target
        varying = self._always and self._events
        if target is None and not varying:
            return self._pick_min(loads)
        own_weight = own_uncached if self._always else num_tokens
        if target is not None:
            assert guard is not None
            # Every backlog below is at least its server's load, so the guard's bound is at least this one: an
            # affine server within it keeps the request without the per-server backlogs (the same answer).
            if loads[target] + own_weight <= guard.limit(min(loads)):
                return target
        if varying and not have_held:
            held = self._cache_index.held_lengths(keys, ignore)
            have_held = True
        if varying and held is not None:
            tpb = self._tpb
            backlog = [load + max(num_tokens - c * tpb, 0) for load, c in zip(loads, held)]
        elif target is None and int_loads:
            # Integer loads plus one integer: exact sums, so the same order and ties as the loads themselves.
            return self._pick_min(loads)
        else:
            backlog = list(map(add, loads, repeat(num_tokens)))
        if target is None:
            return self._pick_min(backlog)
        assert guard is not None
        backlog[target] = loads[target] + own_weight
        limit = guard.limit(min(backlog))
        if backlog[target] <= limit:
            return target
        self.stats.guard_moves += 1
        near = [s for s in range(len(backlog)) if backlog[s] <= limit]
        if self._events and not have_held:
            held = self._cache_index.held_lengths(keys, ignore)
        if held is not None:
            return _most_cached_near(near, held, backlog)
        return min(near, key=backlog.__getitem__)  # (what _most_cached_near gives when nothing is held)

    def _choose_by_cost(
        self,
        target: int | None,
        own_uncached: int,
        held: list[int] | None,
        num_tokens: int,
        loads: list[float],
        weight: float,
        int_loads: bool,
    ) -> int:
        """The server with the least ``backlog + weight * uncached`` (ties keep the affine server ``target``).

        ``own_uncached`` is what ``target`` would compute; every other server computes the prompt past its
        ``held`` blocks (the cache index's ``held_lengths``; None: the whole prompt). ``int_loads``: ``loads`` are the
        ledger's integer loads (and +inf out of rotation), not backlogs.
        """
        own = 0.0 if target is None else loads[target] + weight * own_uncached
        # A server caching nothing would compute the whole prompt: ``extra`` is the same float as the general
        # term with a count of 0, without a max() per server.
        extra = weight * num_tokens
        if held is not None:
            tpb = self._tpb
            scores = [
                load + (extra if c == 0 else weight * max(num_tokens - c * tpb, 0)) for load, c in zip(loads, held)
            ]
        else:
            # Every other server scores load + extra, none below min(loads) + extra (rounding keeps the order
            # of sums with one constant term): an affine server at or below that keeps the request without the
            # list. Backlogs are never negative, so min(loads) + extra >= extra: an affine server at or below
            # ``extra`` keeps it without the minimum either.
            if target is not None:
                if not extra < own or not min(loads) + extra < own:
                    return target
            elif int_loads and self._cost_integral and self._ledger._total < _EXACT - extra:
                # Every score load + extra is an exact integer (no load exceeds the total, and the sums stay
                # below 2**53): the same order and the same ties as the loads themselves, so the same server.
                return self._pick_min(loads)
            scores = [load + extra for load in loads]
        if target is None:
            return self._pick_min(scores)
        scores[target] = own
        # The first server strictly below the affine one's score, at the minimum (ties keep the affine server).
        m = min(scores)
        if not m < own:
            return target
        self.stats.guard_moves += 1
        return scores.index(m)

    def _pick_min(self, values: list[float]) -> int:
        # Ties rotate so that idle servers take turns instead of server 0 taking every new conversation: the
        # first server at the minimum from the rotor on, wrapping around (scanned at C speed; never NaN).
        r = self._rotor % len(values)
        m = min(values)
        best = values.index(m)
        if best < r:
            try:  # noqa: SIM105 (contextlib.suppress would cost a call and a context manager per decision)
                best = values.index(m, r)
            except ValueError:  # (none at or after the rotor: the first one stands)
                pass
        self._rotor = best + 1
        return best

    # ---------------------------------------------------------------- sessions

    @staticmethod
    def _common_blocks(old: tuple[Any, ...], new: tuple[Any, ...]) -> int:
        """Length of the common leading run of ``old`` and ``new``, compared in full (keys from a client are
        not trusted to be chained: a last-block shortcut let a forged prompt desynchronise the trie)."""
        n = len(old)
        if len(new) >= n and new[:n] == old:
            return n
        k = 0
        for a, b in zip(old, new):
            if a != b:
                break
            k += 1
        return k

    def _new_session(self, conv: str | None, server: int, keys: tuple[Any, ...], baseline: int) -> int:
        handle = next(self._handles)
        sessions = self._sessions
        if conv is None:
            sessions[handle] = (handle, server, keys, baseline)
        else:
            sessions[conv] = (handle, server, keys, baseline)
            self._key_of[handle] = conv
        trie = self._trie
        trie._add(keys, handle, server)
        if len(sessions) > self._max_sessions:
            limit = self._max_sessions
            while len(sessions) > limit:
                old_key, old = sessions.popitem(False)  # (the least recent; positional: no keyword parsing)
                trie.remove_deferred(old[_KEYS])  # answers change now; the dict work waits for a finish
                if old_key.__class__ is not int:  # (a named conversation: ids are str, handles int)
                    del self._key_of[old[_H]]
                self._last.pop(old[_H], None)
                self.stats.evicted_sessions += 1
        if trie._queued > self._pending_cap:
            trie.drain(trie._queued - self._pending_cap)
        return handle

    def _log_new_conversations(self) -> None:
        st = self.stats
        every = self._config.log_every_new_conversations
        recent = st.followed - self._followed_at_last_log
        self._followed_at_last_log = st.followed
        logger.info(
            "router: %d new conversations, %d of the last %d followed a prefix match (%d in total, %.1f%%)",
            st.new_conversations,
            recent,
            every,
            st.followed,
            100.0 * st.followed / st.new_conversations,
        )


# Module functions rather than lambdas: a closure would make every call of the method around it allocate cells.
def _most_cached(cached: list[int], loads: list[float]) -> int:
    """The server caching most of the prompt, the least loaded among equals (the first of those)."""
    return max(range(len(cached)), key=lambda s: (cached[s], -loads[s]))


def _most_cached_near(near: list[int], held: list[int], backlog: list[float]) -> int:
    """Among ``near``, the server caching most, then the one with the least backlog (the first of those)."""
    return min(near, key=lambda s: (-held[s], backlog[s]))


def _check_request_id(request_id: object) -> None:
    if request_id is None:
        raise ValueError("request_id: expected a hashable id, got None")
    try:
        hash(request_id)
    except TypeError:
        raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None


def _event_keys(event: BlockStored | BlockRemoved) -> tuple[Any, ...]:
    return check_block_keys(event.block_keys, "event.block_keys")
