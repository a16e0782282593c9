"""The scheduler's request model: what a request asks for, where it stands, and the marks other layers set on it.

A request is given by its prompt either as ``tokens`` (token mode: generated tokens are committed too) or as
``block_keys`` plus ``prompt_len`` (key mode: only the prompt is committed; ``prompt_len`` alone, ``keyless``,
reuses and commits nothing). Token ids are checked once, here: ``tokens`` keeps them as a tuple of ints and
``token_ids`` as a read-only little-endian uint32 array, which the scheduler keys (the manager's vocabulary
bound is checked in ``add_request``).

States: ``WAITING`` → ``CONTEXT`` → ``GENERATION`` → ``DONE``; a preempted request goes back to ``WAITING``.
The manager writes snapshot marks with :meth:`Request.set_snapshot_marks`; the scheduler writes
``requested_snapshot_points`` and ``waiting_for_prefix_of``. Bad arguments raise ``TypeError`` / ``ValueError``.

Modes, states and marks in full: ``docs/scheduling.md``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.errors import CacheStateError
from kvforge.kvcache.hashing import check_block_keys, token_array
from kvforge.kvcache.manager import CacheStatus

if TYPE_CHECKING:
    from kvforge.kvcache.manager import KVCache

__all__ = ["Request", "RequestState"]


class RequestState(Enum):
    WAITING = "waiting"
    CONTEXT = "context"
    GENERATION = "generation"
    DONE = "done"


def _count(name: str, v: object, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return v


def _int_tuple(name: str, v: object) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(v).__name__}")
    out = tuple(v)
    if all(type(x) is int for x in out):  # the common case, ~10x cheaper than the checks below on long prompts
        return out
    for i, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(x).__name__}")
    return out


def _prompt_tokens(tokens: object) -> tuple[tuple[int, ...], np.ndarray]:
    """The prompt as a tuple of ints and as a read-only uint32 array, validated once (one C pass)."""
    ids = token_array(tokens, "tokens")
    if isinstance(tokens, np.ndarray):
        if np.may_share_memory(ids, tokens):
            ids = ids.copy()  # the caller's array may change later; the request's prompt may not
        as_tuple = tuple(ids.tolist())
    else:
        as_tuple = tokens if type(tokens) is tuple else tuple(tokens)  # type: ignore[arg-type]
    ids.flags.writeable = False
    return as_tuple, ids


class Request:
    """One request as the scheduler sees it (see the module docstring for modes, states and marks).

    Arguments: ``request_id`` (hashable, unique within a scheduler), ``tokens`` or ``block_keys`` +
    ``prompt_len``, ``max_new_tokens`` (>= 1; the request is done after that many), ``arrival_time`` (the
    caller's clock), ``conversation_id``, ``draft_len`` (speculative tokens checked per generation step),
    ``scope`` (reuse scope: LoRA id), ``cache_salt`` (tenant isolation: no block is shared with a request of
    another salt), ``estimated_uncached_tokens`` (a router's estimate of the prefill
    the prompt needs, e.g. its growth since the conversation's previous prompt; None: unknown) and
    ``attention_dp_rank`` (a requested attention-DP rank for :class:`~kvforge.scheduling.adp_router.AttentionDPRouter`).
    """

    __slots__ = (
        "_batch_step",
        "_generated_keys",
        "_prefix_keys",
        "aborted",
        "arrival_time",
        "attention_dp_rank",
        "block_keys",
        "cache",
        "cache_salt",
        "context_len",
        "conversation_id",
        "demote_iters",
        "draft_len",
        "estimated_uncached_tokens",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "keyless",
        "max_new_tokens",
        "midchunk_pass_point",
        "midchunk_snapshot_alignment",
        "num_computed_tokens",
        "num_deferrals",
        "num_generated",
        "num_preemptions",
        "output_tokens",
        "prefix_wait_iters",
        "probed_uncached_tokens",
        "prompt_len",
        "request_id",
        "requested_snapshot_points",
        "scope",
        "seq",
        "snapshot_points",
        "state",
        "token_ids",
        "tokens",
        "uncached_prefill_probed",
        "user_data",
        "waiting_for_prefix_of",
    )

    def __init__(
        self,
        request_id: Hashable,
        *,
        tokens: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        prompt_len: int | None = None,
        max_new_tokens: int = 1,
        arrival_time: float = 0.0,
        conversation_id: str | None = None,
        draft_len: int = 0,
        scope: Hashable | None = None,
        estimated_uncached_tokens: int | None = None,
        attention_dp_rank: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> None:
        if request_id is None:
            raise ValueError("request_id: expected a hashable id, got None")
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None
        self.request_id = request_id
        if tokens is None and block_keys is None and prompt_len is None:
            raise ValueError("Request: expected tokens, or block_keys with prompt_len (or prompt_len alone)")
        self.tokens: tuple[int, ...] | None = None
        self.token_ids: np.ndarray | None = None
        if tokens is not None:
            self.tokens, self.token_ids = _prompt_tokens(tokens)
        if self.tokens is not None:
            if prompt_len is not None and prompt_len != len(self.tokens):
                raise ValueError(f"prompt_len: {prompt_len} differs from the {len(self.tokens)} tokens given")
            prompt_len = len(self.tokens)
        if prompt_len is None:
            raise ValueError("prompt_len: required with block_keys (the keys cover full blocks only)")
        self.prompt_len = _count("prompt_len", prompt_len, 1)
        # Key mode without keys (prompt_len alone) is an empty key list: nothing to reuse, nothing committed.
        self.keyless = self.tokens is None and block_keys is None
        # Token mode: the scheduler fills block_keys in add_request (kvforge.kvcache.hashing, once per request).
        self.block_keys = None if block_keys is None and self.tokens is not None else check_block_keys(block_keys or ())
        self.max_new_tokens = _count("max_new_tokens", max_new_tokens, 1)
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
            raise TypeError(f"arrival_time: expected a number, got {type(arrival_time).__name__}")
        if not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time: expected a finite number, got {arrival_time}")
        self.arrival_time = float(arrival_time)
        if conversation_id is not None and not isinstance(conversation_id, str):
            raise TypeError(f"conversation_id: expected a str or None, got {type(conversation_id).__name__}")
        self.conversation_id = conversation_id
        self.draft_len = _count("draft_len", draft_len)
        self.scope = scope
        if cache_salt is not None and (not isinstance(cache_salt, (str, bytes)) or not cache_salt):
            raise TypeError(f"cache_salt: expected a non-empty str or bytes, or None, got {cache_salt!r}")
        self.cache_salt = cache_salt
        self._generated_keys: list[int] = []  # keys of blocks past the prompt's, from generated tokens
        if estimated_uncached_tokens is not None:
            _count("estimated_uncached_tokens", estimated_uncached_tokens)
        self.estimated_uncached_tokens = estimated_uncached_tokens
        self.attention_dp_rank = None if attention_dp_rank is None else _count("attention_dp_rank", attention_dp_rank)

        self.state = RequestState.WAITING
        self.aborted = False
        self.seq = -1  # arrival order in its scheduler: the lower, the older (set by Scheduler.add_request)
        self.user_data: Any = None
        self.num_generated = 0
        self.output_tokens: list[int] = []
        self.demote_iters = 0  # iterations spent demoted; not per attempt, so a preempted request keeps its age
        self.num_preemptions = 0
        self.num_deferrals = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._prefix_keys: tuple[Hashable, ...] | None = None
        self._batch_step = -1
        self.cache: KVCache | None = None
        self._clear_attempt()

    def _clear_attempt(self) -> None:
        self.context_len = self.prompt_len + self.num_generated
        self.num_computed_tokens = 0
        self.snapshot_points: tuple[int, ...] = ()
        self.midchunk_snapshot_alignment: int | None = None
        self.midchunk_pass_point: int | None = None
        self.requested_snapshot_points: set[int] = set()
        self.uncached_prefill_probed = False
        self.probed_uncached_tokens: int | None = None
        self.prefix_wait_iters = 0
        self.waiting_for_prefix_of: Hashable | None = None

    # --- views ---------------------------------------------------------------------------------------------

    @property
    def key_mode(self) -> bool:
        return self.tokens is None

    @property
    def is_done(self) -> bool:
        return self.state is RequestState.DONE

    @property
    def remaining_context_tokens(self) -> int:
        """Tokens of the current attempt's context still to compute (0 outside the context phase)."""
        return self.context_len - self.num_computed_tokens if self.state is RequestState.CONTEXT else 0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, prompt={self.prompt_len}, "
            f"computed={self.num_computed_tokens}/{self.context_len}, "
            f"generated={self.num_generated}/{self.max_new_tokens})"
        )

    # --- marks ---------------------------------------------------------------------------------------------

    def set_snapshot_marks(
        self,
        points: Sequence[int],
        *,
        alignment: int | None = None,
        pass_point: int | None = None,
    ) -> None:
        """Set the snapshot points (strictly increasing, > 0) and the mid-chunk marks (the hybrid manager's call,
        from its ``mark_context_request(request)``, which the scheduler calls before it sizes each context chunk).

        ``pass_point`` needs an ``alignment`` and must be one of ``points`` other than the last. Raises
        ValueError / TypeError naming the argument and changes nothing on bad input. The marks:

        * ``snapshot_points``: sorted prompt positions (tokens from the start) where the manager wants the recurrent
          state saved. A step never crosses one it may not pass (see below): the chunk ends at it.
        * ``midchunk_snapshot_alignment``: None (the manager can only snapshot the live state at the end of a step), or
          ``A``: the recurrent prefill can store the state at ``start + k*A`` inside a step that starts at ``start``
          (the kernel splits a step into A-token chunks counted from the step's first token), into the one pending
          snapshot slot a cache has. Then *one* point per step may be passed mid-step, if it is so aligned and it is
          the last snapshot point or ``midchunk_pass_point``; the step ends at the following point at the latest.
        * ``midchunk_pass_point``: one earlier point (not the last) that may also be passed mid-step.

        The scheduler writes, and the manager reads:

        * ``requested_snapshot_points``: positions that requests waiting for this request's prefix asked to have saved
          (the divergence point of the shared prefix); the manager decides whether they become ``snapshot_points``.
        * ``waiting_for_prefix_of``: the id of the in-flight request whose prefix this one waits for (None when not
          waiting); the scheduler also passes the requests that started waiting to the manager's optional
          ``count_prefix_waits(requests)``.
        """
        pts = _int_tuple("points", points)
        for i, p in enumerate(pts):
            if p <= 0 or (i and p <= pts[i - 1]):
                raise ValueError(f"points: expected strictly increasing positions > 0, got {pts}")
        if alignment is not None:
            _count("alignment", alignment, 1)
        if pass_point is not None:
            _count("pass_point", pass_point, 1)
            if alignment is None:
                raise ValueError("pass_point: a pass point needs a mid-chunk snapshot alignment")
            if pass_point not in pts[:-1]:
                raise ValueError(f"pass_point: {pass_point} is not one of the snapshot points before the last {pts}")
        self.snapshot_points = pts
        self.midchunk_snapshot_alignment = alignment
        self.midchunk_pass_point = pass_point

    def clear_snapshot_marks(self) -> None:
        self.snapshot_points = ()
        self.midchunk_snapshot_alignment = None
        self.midchunk_pass_point = None

    def request_snapshot_point(self, position: int) -> bool:
        """Ask this request (a prefix owner) for a snapshot at ``position``; True when the point is new."""
        _count("position", position, 1)
        if position in self.requested_snapshot_points:
            return False
        self.requested_snapshot_points.add(position)
        return True

    def reset_for_recompute(self) -> None:
        """Forget everything about the current attempt, so the request is computed again from what the cache
        holds then: progress, snapshot marks and requested points, the prefix-probe mark (so it is probed again)
        and the prefix-wait state. Results (generated tokens, timestamps) and the demotion age stay.

        The request's cache must be closed first (CacheStateError otherwise, nothing changed).
        """
        if self.cache is not None and self.cache.status is not CacheStatus.CLOSED:
            raise CacheStateError(
                f"reset_for_recompute: request {self.request_id!r} still holds a {self.cache.status.value} cache"
            )
        if self.state is RequestState.DONE:
            raise CacheStateError(f"reset_for_recompute: request {self.request_id!r} is done")
        self.cache = None
        self.state = RequestState.WAITING
        self._clear_attempt()

    # --- helpers for the scheduler ---------------------------------------------------------------------------

    def known_tokens(self) -> int:
        """How many leading tokens of the sequence have known keys, i.e. can be committed to the tree."""
        if self.keyless:
            return 0
        if self.tokens is None:
            return self.prompt_len
        return self.prompt_len + len(self.output_tokens)
