"""Per-server load as the sum of what each in-flight request reserved, reclaimed after a time-to-live.

A router adds a request's weight to its server when it places it and subtracts exactly that weight when the
request finishes. A request whose finish never arrives (a crashed client, a lost message) would otherwise
hold its load forever and steer traffic away from a healthy server; like llm-d's pending-token scorer, each
reservation carries a deadline after which it is reclaimed. Not thread-safe on its own (the routers lock).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from heapq import heappush
from typing import Any

from kvforge.errors import KvforgeError

__all__ = ["LoadLedger", "RequestInFlightError", "Reservation", "server_tuple"]


class RequestInFlightError(KvforgeError):
    """A request id was placed again while its first placement is still in flight; nothing was changed."""


def server_tuple(servers: Sequence[Hashable]) -> tuple[Hashable, ...]:
    """Validate a router's server list: a non-empty sequence of distinct hashable ids."""
    if isinstance(servers, (str, bytes)) or not isinstance(servers, Sequence):
        raise TypeError(f"servers: expected a sequence of server ids, got {type(servers).__name__}")
    out = tuple(servers)
    if not out:
        raise ValueError("servers: expected at least one server, got none")
    try:
        distinct = len(set(out))
    except TypeError:
        raise TypeError("servers: expected hashable server ids") from None
    if distinct != len(out):
        raise ValueError(f"servers: expected distinct ids, got {list(out)}")
    return out


@dataclass(slots=True)
class Reservation:
    """What one in-flight request holds: ``weight`` units of load on server index ``server``."""

    request_id: Hashable
    server: int
    weight: int
    deadline: float
    seq: int
    payload: Any = None


class LoadLedger:
    """In-flight reservations per server; ``ttl_s=None`` never expires them."""

    def __init__(self, num_servers: int, ttl_s: float | None) -> None:
        if not isinstance(num_servers, int) or isinstance(num_servers, bool) or num_servers <= 0:
            raise ValueError(f"num_servers: expected a positive int, got {num_servers!r}")
        if ttl_s is not None and (
            not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not 0 < ttl_s < math.inf
        ):
            raise ValueError(f"ttl_s: expected a finite positive number of seconds or None, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self._loads = [0] * num_servers
        self._counts = [0] * num_servers
        self._total = 0  # sum(_loads), kept by every reservation and release (a bound on every load)
        self._live: dict[Hashable, Reservation] = {}
        # (deadline, seq, request_id); entries of released requests stay until they surface (lazy deletion).
        self._deadlines: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    @property
    def loads(self) -> list[int]:
        """Load per server index (a copy)."""
        return list(self._loads)

    def load(self, server: int) -> int:
        return self._loads[server]

    @property
    def total(self) -> int:
        """The load of every server together."""
        return self._total

    @property
    def num_servers(self) -> int:
        return len(self._loads)

    def add_server(self) -> int:
        """Append an empty server index and return it (a router adding a server; indexes are never reused)."""
        self._loads.append(0)
        self._counts.append(0)
        return len(self._loads) - 1

    def in_flight(self, server: int) -> int:
        """Number of requests in flight on server index ``server``."""
        return self._counts[server]

    def reservations(self) -> list[Reservation]:
        """The live reservations (a snapshot)."""
        return list(self._live.values())

    def get(self, request_id: Hashable) -> Reservation | None:
        return self._live.get(request_id)

    def reserve(self, request_id: Hashable, server: int, weight: int, now: float, payload: Any = None) -> Reservation:
        """Add ``weight`` to server index ``server`` for ``request_id`` (checked; the routers call
        :meth:`_reserve` with values they have checked already)."""
        if request_id in self._live:
            raise RequestInFlightError(f"request {request_id!r} is already in flight; finish it before reusing its id")
        if type(server) is not int or not 0 <= server < len(self._loads):
            raise ValueError(f"server: expected a server index in [0, {len(self._loads)}), got {server!r}")
        if type(weight) is not int or weight < 0:
            raise ValueError(f"weight: expected a non-negative int load, got {weight!r}")
        if not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ValueError(f"now: expected a finite time in seconds, got {now!r}")
        return self._reserve(request_id, server, weight, now, payload)

    def _reserve(self, request_id: Hashable, server: int, weight: int, now: float, payload: Any) -> Reservation:
        """:meth:`reserve` with values the caller has checked."""
        res = Reservation(request_id, server, weight, math.inf, 0, payload)
        self._insert(res, now)
        return res

    def _insert(self, res: Reservation, now: float) -> None:
        """Add a reservation the caller built (``request_id``, ``server``, ``weight`` and ``payload`` set, checked,
        the id not in flight): its ``seq`` and ``deadline`` are set here. A router builds its own subclass of
        :class:`Reservation`, so that one object is both the ledger's record and the router's."""
        seq = self._seq = self._seq + 1
        res.seq = seq
        request_id = res.request_id
        self._live[request_id] = res
        ttl = self.ttl_s
        if ttl is None:
            res.deadline = math.inf
        else:
            deadline = res.deadline = now + ttl
            heap = self._deadlines
            heappush(heap, (deadline, seq, request_id))
            if len(heap) > 2 * len(self._live) + 1024:
                self._compact()
        server = res.server
        weight = res.weight
        self._loads[server] += weight
        self._counts[server] += 1
        self._total += weight

    def release(self, request_id: Hashable) -> Reservation | None:
        """Remove a reservation and its load; None when it is unknown (never placed, finished or expired)."""
        res = self._live.pop(request_id, None)
        if res is not None:
            self._loads[res.server] -= res.weight
            self._counts[res.server] -= 1
            self._total -= res.weight
            heap = self._deadlines
            # Drop up to two released entries from the top: while requests finish roughly in order, the heap
            # stays near the live set, and no placement has to rebuild it (freeing ~1,000 entries at once).
            live = self._live
            for _ in range(2):
                if not heap:
                    break
                _, seq, rid = heap[0]
                r = live.get(rid)
                if r is not None and r.seq == seq:
                    break
                heapq.heappop(heap)
        return res

    def expire(self, now: float) -> list[Reservation]:
        """Release every reservation whose deadline is at or before ``now``."""
        if not isinstance(now, (int, float)) or math.isnan(now):
            raise ValueError(f"now: expected a time in seconds, got {now!r}")
        return self._expire(now)

    def _expire(self, now: float) -> list[Reservation]:
        out: list[Reservation] = []
        heap = self._deadlines
        if not heap or heap[0][0] > now:
            return out
        while heap and heap[0][0] <= now:
            _, seq, request_id = heapq.heappop(heap)
            res = self._live.get(request_id)
            if res is not None and res.seq == seq:
                del self._live[request_id]
                self._loads[res.server] -= res.weight
                self._counts[res.server] -= 1
                self._total -= res.weight
                out.append(res)
        return out

    def _compact(self) -> None:
        # Released requests leave their heap entries behind; rebuild so the heap tracks live requests only.
        self._deadlines = [(r.deadline, r.seq, r.request_id) for r in self._live.values()]
        heapq.heapify(self._deadlines)
