"""What the scheduler uses of a cache manager and its caches beyond the base manager's API.

The base :class:`~kvforge.kvcache.manager.KVCacheManager` is all a scheduler needs. A manager that also takes
recurrent snapshots (the hybrid manager) offers more, described here as protocols so that ``kvcache`` never
imports this package and the scheduler never reaches for names it has not typed:

* :class:`ContextMarker`: ``mark_context_request(request)``, called before each context chunk is sized; it sets
  the request's snapshot marks.
* :class:`PrefixWaitCounter`: ``count_prefix_waits(requests)``, told which requests started waiting in a pass.
* :class:`SnapshotSlotCache`: a cache with a pending snapshot slot for a snapshot inside a step
  (``acquire_snapshot_slot`` / ``pending_snapshot_slot`` / ``release_snapshot_slot``) and a ``commit`` that can
  take the snapshot at its end from that slot (``snapshot_from_pending=True``).

Each is ``runtime_checkable``: the scheduler tests a manager once, when built, and a cache only on the steps
where a snapshot point lies inside a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvforge.scheduling.request import Request

__all__ = ["ContextMarker", "PrefixWaitCounter", "SnapshotSlotCache"]


@runtime_checkable
class ContextMarker(Protocol):
    def mark_context_request(self, request: Request) -> None:
        """Set the request's snapshot points, mid-chunk alignment and pass point (or clear them)."""


@runtime_checkable
class PrefixWaitCounter(Protocol):
    def count_prefix_waits(self, requests: Sequence[Request]) -> None:
        """These requests started waiting for a prefix another request is computing."""


@runtime_checkable
class SnapshotSlotCache(Protocol):
    @property
    def pending_snapshot_slot(self) -> int | None:
        """The page index of the pending snapshot slot, None when the cache holds none."""

    def acquire_snapshot_slot(self) -> int | None:
        """Reserve a page for a snapshot inside the next step; None when none can be found."""

    def release_snapshot_slot(self) -> bool:
        """Give the pending page back; False when there is none."""

    def commit(
        self,
        tokens: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        block_keys: Sequence[int] | None = None,
        snapshot_from_pending: bool = False,
        is_end: bool = False,
    ) -> None:
        """Commit; with ``snapshot_from_pending`` the snapshot at the end comes from the pending slot."""
