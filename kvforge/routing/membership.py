"""Server membership shared by the conversation router and the baseline policies.

:class:`ServerMembership` owns the slot bookkeeping: every membership ever gets an index (``_slot_server``;
removed ones keep theirs, since their requests may still be in flight), ``_index_of`` maps the current members
to theirs, ``_down`` holds the indexes that take no new request (members out of rotation and removed
memberships) and ``_retired`` the removed ones. ``servers`` is the members' ids, in order of addition.

It provides the public membership calls (:meth:`~ServerMembership.add_server`,
:meth:`~ServerMembership.remove_server`, :meth:`~ServerMembership.set_server_available`) and the queries on
them. Each public call checks its inputs first, then holds the router's ``_lock``; the class using it sets
``_lock`` and ``_ledger`` (a :class:`~kvforge.routing.load.LoadLedger`) and calls
:meth:`~ServerMembership._init_membership`. Per-server state of the router itself follows through two hooks,
run under the lock: :meth:`~ServerMembership._grow` (one more index) and :meth:`~ServerMembership._forget`
(an index removed).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

from kvforge.routing.load import LoadLedger, server_tuple

__all__ = ["ServerMembership"]


def _check_server_id(server: object) -> None:
    try:
        hash(server)
    except TypeError:
        raise TypeError(f"server: expected a hashable server id, got {type(server).__name__}") from None


def _check_available(available: object) -> None:
    if not isinstance(available, bool):
        raise TypeError(f"available: expected a bool, got {type(available).__name__}")


class ServerMembership:
    """Members, rotation and slot indexes of a router (see the module docstring for what the user provides)."""

    servers: tuple[Hashable, ...]
    _lock: threading.Lock
    _ledger: LoadLedger
    _index_of: dict[Hashable, int]
    _slot_server: list[Hashable]
    _down: set[int]
    _retired: set[int]

    def _init_membership(self, servers: Sequence[Hashable]) -> None:
        """Check ``servers`` and make them the members, all in rotation, at indexes 0..n-1."""
        self.servers = server_tuple(servers)
        self._index_of = {s: i for i, s in enumerate(self.servers)}
        # Index -> server id for every membership ever (removed ones included: their requests may be in flight).
        self._slot_server = list(self.servers)
        # Indexes that take no new request: members out of rotation and removed memberships (``_retired``).
        self._down = set()
        self._retired = set()

    def _grow(self) -> None:
        """Per-server state of the router for one more index (called under the lock, by :meth:`add_server`)."""

    def _forget(self, index: int) -> None:
        """Drop a removed index's per-server state (called under the lock, by :meth:`remove_server`)."""

    # ---------------------------------------------------------------- queries

    def load(self, server: Hashable) -> int:
        """The server's load (tokens in flight by this router's estimate)."""
        with self._lock:
            return self._ledger.load(self._server_index(server))

    def loads(self) -> dict[Hashable, int]:
        """Load per member (a removed server's requests still in flight are not reported)."""
        with self._lock:
            loads = self._ledger.loads
            return {s: loads[i] for s, i in self._index_of.items()}

    def available_servers(self) -> tuple[Hashable, ...]:
        """The members in rotation (that new requests may go to), in order."""
        with self._lock:
            down = self._down
            return tuple(s for s in self.servers if self._index_of[s] not in down)

    def is_available(self, server: Hashable) -> bool:
        """Whether member ``server`` is in rotation (ValueError for a server that is not a member)."""
        with self._lock:
            return self._server_index(server) not in self._down

    def _server_index(self, server: Hashable) -> int:
        try:
            return self._index_of[server]
        except (KeyError, TypeError):
            raise ValueError(f"server: expected one of {list(self.servers)}, got {server!r}") from None

    # ---------------------------------------------------------------- membership

    def add_server(self, server: Hashable) -> None:
        """Add ``server`` (a hashable id not already a member) in rotation, with no load and empty per-server
        state (no sessions, blocks or approximate tree)."""
        _check_server_id(server)
        with self._lock:
            if server in self._index_of:
                raise ValueError(f"server: {server!r} is already a member")
            i = self._ledger.add_server()
            self._grow()
            self._slot_server.append(server)
            self._index_of[server] = i
            self.servers = (*self.servers, server)

    def remove_server(self, server: Hashable) -> None:
        """Remove member ``server``: no new request goes there, its per-server index (block events, or a
        cache-aware policy's approximate tree) is dropped, its conversations move on their next request; its
        requests in flight still finish exactly. The last member cannot be removed (ValueError)."""
        _check_server_id(server)
        with self._lock:
            i = self._server_index(server)
            if len(self.servers) == 1:
                raise ValueError(f"server: cannot remove {server!r}, the router's last server")
            del self._index_of[server]
            self._down.add(i)
            self._retired.add(i)
            self._forget(i)
            self.servers = tuple(s for j, s in enumerate(self._slot_server) if j not in self._retired)

    def set_server_available(self, server: Hashable, available: bool) -> None:
        """Take member ``server`` out of rotation (``False``) or put it back (``True``); its per-server index is
        kept (a block-event index is still updated by ``on_event`` meanwhile). Setting the current state again
        changes nothing."""
        _check_server_id(server)
        _check_available(available)
        with self._lock:
            i = self._server_index(server)
            if available:
                self._down.discard(i)
            else:
                self._down.add(i)
