"""In-flight prefix sharing: a new request whose prefix another request is prefilling right now waits for it.

Without this, two requests with a long common prefix that arrive together both compute it: the second one's
reuse probe finds nothing because the first has not committed yet. The planner keeps an index of the prompt
blocks of every request that is prefilling (an *owner*), keyed by chained block key (a key names the whole
prefix up to its block's end, so one dict lookup per block finds the longest shared prefix). A new request
whose shared prefix with an owner goes past what the owner has computed waits, for at most
``max_wait_iters`` scheduling iterations, and asks the owner for a snapshot point where their prompts part
(hybrid models can only reuse a recurrent state at a point where it was saved).

Pure bookkeeping: the scheduler decides when to consult it and what a wait means.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvforge.scheduling.request import Request

__all__ = ["PrefixWaitPlanner", "PrefixWaitStats", "prefix_keys"]


def prefix_keys(req: Request, tokens_per_block: int) -> tuple[Hashable, ...]:
    """The request's block keys per full prompt block (computed once per request, by the scheduler's
    ``add_request``). Key-mode keys are the caller's and may repeat across scopes or salts, so they are paired
    with those; token-mode keys already depend on both."""
    keys: tuple[Hashable, ...] | None = req._prefix_keys
    if keys is None:
        own = req.block_keys or ()
        if req.tokens is None and (req.scope is not None or req.cache_salt is not None):
            ns = (req.scope, req.cache_salt)
            keys = tuple((ns, k) for k in own)
        else:
            keys = own
        req._prefix_keys = keys
    return keys


@dataclass
class PrefixWaitStats:
    """Running totals. ``requests_waited``: distinct requests that waited at least once (per attempt);
    ``wait_iterations``: request-iterations spent waiting; ``snapshot_points_requested``: distinct (owner,
    position) points asked of owners; ``waits_expired``: waits ended by the bound rather than by the owner."""

    requests_waited: int = 0
    wait_iterations: int = 0
    snapshot_points_requested: int = 0
    waits_expired: int = 0


class PrefixWaitPlanner:
    """Index of in-flight prefills and the wait decision (see the module docstring).

    ``min_shared_tokens``: a wait must save at least this many tokens of recompute (the part of the shared
    prefix the owner has not computed yet).
    """

    def __init__(self, tokens_per_block: int, *, max_wait_iters: int, min_shared_tokens: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.max_wait_iters = max_wait_iters
        self.min_shared_tokens = min_shared_tokens
        self.stats = PrefixWaitStats()
        self._index: dict[Hashable, Request] = {}
        self._owned: dict[int, tuple[Hashable, ...]] = {}  # id(owner) -> keys it indexed

    def __len__(self) -> int:
        return len(self._owned)

    def add_owner(self, owner: Request) -> None:
        """``owner`` started prefilling: its prompt blocks become waitable (first owner of a key keeps it)."""
        if id(owner) in self._owned:
            return
        keys = prefix_keys(owner, self.tokens_per_block)
        mine = []
        index = self._index
        for k in keys:
            if k not in index:
                index[k] = owner
                mine.append(k)
        self._owned[id(owner)] = tuple(mine)

    def remove_owner(self, owner: Request) -> None:
        keys = self._owned.pop(id(owner), None)
        if keys is None:
            return
        index = self._index
        for k in keys:
            if index.get(k) is owner:
                del index[k]

    def find_owner(self, req: Request) -> tuple[Request, int] | None:
        """The owner whose in-flight prefill covers the longest prefix of ``req`` and the shared length in
        tokens, when waiting would save at least ``min_shared_tokens``; else None. Read-only."""
        if not self._index:
            return None
        keys = prefix_keys(req, self.tokens_per_block)
        index = self._index
        owner = None
        n = 0
        for k in keys:
            o = index.get(k)
            if o is None or o is req:
                break
            owner = o
            n += 1
        if owner is None:
            return None
        # The last prompt token is always computed by the request itself.
        shared = min(n * self.tokens_per_block, req.context_len - 1)
        if shared - owner.num_computed_tokens < max(1, self.min_shared_tokens):
            return None
        return owner, shared
