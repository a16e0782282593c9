"""Baseline routing policies, with the same interface as :class:`~kvforge.routing.router.ConversationRouter`.

- :class:`RoundRobinRouter`: servers in turn.
- :class:`LeastLoadRouter`: the server with the fewest prompt tokens in flight.
- :class:`CacheAwareRouter`: SGLang-router-like. When the fleet is imbalanced (max - min in-flight requests
  above ``balance_abs_threshold`` *and* max above ``balance_rel_threshold`` * min) it takes the shortest queue;
  otherwise the server whose approximate prefix tree (the blocks the router sent it, LRU-bounded) matches the
  largest share of the request, if that share exceeds ``cache_threshold``, else the server with the smallest
  tree. Defaults are SGLang's (0.3, 64, 1.5).

All of them charge a server the whole prompt in tokens and reclaim unfinished requests after a time-to-live,
and share the conversation router's membership API (``add_server``, ``remove_server``, ``set_server_available``,
same semantics: a server out of rotation is skipped; the cache-aware policy's approximate tree of a removed
server is dropped, that of one merely out of rotation kept).
Like the conversation router, each is thread-safe (one lock per public call) and checks its inputs first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvforge.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvforge.routing.load import LoadLedger, RequestInFlightError
from kvforge.routing.membership import ServerMembership
from kvforge.routing.request import RouteRequest, request_content
from kvforge.routing.router import (
    NoServerAvailableError,
    _check_request_id,
    _finite_number,
    _finite_time,
)
from kvforge.routing.trie import ServerPrefixIndex

__all__ = ["CacheAwareRouter", "LeastLoadRouter", "RoundRobinRouter", "Router"]


@runtime_checkable
class Router(Protocol):
    """What a server front end or a simulator drives: place, finish, feed cache events."""

    servers: tuple[Hashable, ...]

    def route(self, request: RouteRequest) -> Hashable: ...

    def finish(self, request_id: Hashable, success: bool = True) -> bool: ...

    def on_event(self, server: Hashable, event: KVEvent) -> None: ...

    def loads(self) -> dict[Hashable, int]: ...

    def add_server(self, server: Hashable) -> None: ...

    def remove_server(self, server: Hashable) -> None: ...

    def set_server_available(self, server: Hashable, available: bool) -> None: ...


class _LedgerRouter(ServerMembership):
    """Shared plumbing: server ids, whole-prompt token load with a time-to-live, content hashing."""

    def __init__(
        self,
        servers: Sequence[Hashable],
        *,
        tokens_per_block: int = 128,
        chars_per_token: float = 4.0,
        request_ttl_s: float | None = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(tokens_per_block, int) or isinstance(tokens_per_block, bool) or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block: expected a positive int, got {tokens_per_block!r}")
        if not _finite_number(chars_per_token) or not chars_per_token > 0:
            raise ValueError(f"chars_per_token: expected a finite positive number, got {chars_per_token!r}")
        if request_ttl_s is not None and (not _finite_number(request_ttl_s) or not request_ttl_s > 0):
            raise ValueError(f"request_ttl_s: expected a finite positive number or None, got {request_ttl_s!r}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(clock).__name__}")
        self._init_membership(servers)
        self.tokens_per_block = tokens_per_block
        self.chars_per_token = chars_per_token
        self._ledger = LoadLedger(len(self.servers), request_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()

    def route(self, request: RouteRequest) -> Hashable:
        if not isinstance(request, RouteRequest):
            raise TypeError(f"request: expected a RouteRequest, got {type(request).__name__}")
        keys, num_tokens = request_content(request, self.tokens_per_block, self.chars_per_token)
        with self._lock:
            if len(self._down) == len(self._slot_server):
                raise NoServerAvailableError("no server is in rotation (every member was set unavailable)")
            now = _finite_time(self._clock())
            self._ledger.expire(now)
            if request.request_id in self._ledger:
                raise RequestInFlightError(f"request {request.request_id!r} is already in flight")
            server = self._pick(keys, num_tokens)
            self._ledger.reserve(request.request_id, server, num_tokens, now)
            return self._slot_server[server]

    def finish(self, request_id: Hashable, success: bool = True) -> bool:
        _check_request_id(request_id)
        if not isinstance(success, bool):
            raise TypeError(f"success: expected a bool, got {type(success).__name__}")
        with self._lock:
            self._ledger.expire(_finite_time(self._clock()))
            return self._ledger.release(request_id) is not None

    def on_event(self, server: Hashable, event: KVEvent) -> None:
        # Baselines ignore cache events, but still reject an unknown server or something that is no event.
        self._server_index(server)
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(
                f"event: expected a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}"
            )

    def _pick(self, hashes: Sequence[Hashable], num_tokens: int) -> int:
        raise NotImplementedError


class RoundRobinRouter(_LedgerRouter):
    def __init__(self, servers: Sequence[Hashable], **kwargs: Any) -> None:
        super().__init__(servers, **kwargs)
        self._next = 0

    def _pick(self, hashes: Sequence[Hashable], num_tokens: int) -> int:
        n = len(self._slot_server)
        s = self._next % n
        while s in self._down:
            s = (s + 1) % n
        self._next = (s + 1) % n
        return s


class LeastLoadRouter(_LedgerRouter):
    def __init__(self, servers: Sequence[Hashable], **kwargs: Any) -> None:
        super().__init__(servers, **kwargs)
        self._rotor = 0

    def _pick(self, hashes: Sequence[Hashable], num_tokens: int) -> int:
        loads: list[float] = self._ledger.loads  # type: ignore[assignment]
        for s in self._down:
            loads[s] = float("inf")
        n = len(loads)
        best = self._rotor % n
        for j in range(1, n):
            s = (self._rotor + j) % n
            if loads[s] < loads[best]:
                best = s
        self._rotor = best + 1  # idle servers take turns
        return best


class CacheAwareRouter(_LedgerRouter):
    """SGLang-router-like cache-aware policy (see the module docstring)."""

    def __init__(
        self,
        servers: Sequence[Hashable],
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        tree_capacity_blocks: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(servers, **kwargs)
        if not _finite_number(cache_threshold) or not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: expected a number in [0, 1], got {cache_threshold!r}")
        if (
            not isinstance(balance_abs_threshold, int)
            or isinstance(balance_abs_threshold, bool)
            or balance_abs_threshold < 0
        ):
            raise ValueError(f"balance_abs_threshold: expected an int >= 0, got {balance_abs_threshold!r}")
        if not _finite_number(balance_rel_threshold) or balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold: expected a number >= 1, got {balance_rel_threshold!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._trees = ServerPrefixIndex(len(self.servers), tree_capacity_blocks)

    def _grow(self) -> None:
        self._trees.add_server()

    def _forget(self, index: int) -> None:
        self._trees.clear(index)

    def _pick(self, hashes: Sequence[Hashable], num_tokens: int) -> int:
        n = len(self._slot_server)
        queued = [self._ledger.in_flight(s) for s in range(n)]
        down = self._down
        cand: Sequence[int] = range(n) if not down else [s for s in range(n) if s not in down]
        lo = min(queued[s] for s in cand)
        hi = max(queued[s] for s in cand)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            server = min(cand, key=queued.__getitem__)
        else:
            matched = self._trees.match_lengths(hashes)
            best = max(cand, key=lambda s: (matched[s], -queued[s]))
            if hashes and matched[best] / len(hashes) > self.cache_threshold:
                server = best
            else:
                server = min(cand, key=lambda s: (self._trees.blocks(s), queued[s]))
        self._trees.store(server, hashes)
        return server
