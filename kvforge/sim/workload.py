"""Workloads for the simulator: a seeded synthetic multi-turn generator and a Mooncake-format trace loader.

Both yield ``SimRequest``s whose prompts are given as chained block keys at a fixed ``tokens_per_block``
(the unit the caches and the router work in), so a 12k-request trace never materialises its ~10^8 tokens.
A block's key depends on its content and on every block before it: keys come from the one key path,
:mod:`kvforge.kvcache.hashing` (``chain_payloads`` over a synthetic block's segment pieces, ``keys_from_ids``
over a trace's ids), under the process's default hasher.

Synthetic content is described as runs of (segment id, offset range); two prompts share a block exactly when
they hold the same segments at the same offsets up to that block's end, which is what token ids would give.
"""

from __future__ import annotations

import random
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.kvcache.hashing import default_hasher
from kvforge.kvcache.replay import (  # noqa: F401  (default_trace_path, TraceFormatError: re-exported)
    TRACE_TOKENS_PER_BLOCK,
    TraceFormatError,
    default_trace_path,
    load_trace,
)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload. ``block_keys`` covers the prompt's full blocks only."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]
    conversation_id: str | None = None
    kind: str = "turn"  # turn | fork | document | trace

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: expected >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens: expected >= 1, got {self.output_tokens}")


# A prompt is a list of runs (segment id, length); segment content is fixed by its id.
Runs = list[tuple[int, int]]


def keys_from_runs(runs: Sequence[tuple[int, int]], tokens_per_block: int, root: int) -> tuple[int, ...]:
    """Chained keys of every full block of the concatenated runs (a block's payload: its pieces as
    (segment, start, end) words)."""
    payloads: list[bytes] = []
    block: list[int] = []  # segment, start, end of each piece of the current block
    filled = 0
    for seg, length in runs:
        pos = 0
        while pos < length:
            take = min(length - pos, tokens_per_block - filled)
            block += (seg, pos, pos + take)
            pos += take
            filled += take
            if filled == tokens_per_block:
                payloads.append(struct.pack(f"<{len(block)}Q", *block))
                block = []
                filled = 0
    return tuple(default_hasher().chain_payloads(root, payloads))


@dataclass(frozen=True)
class SyntheticWorkload:
    """A seeded multi-turn workload: growing conversations over shared system prompts, sub-agent forks from a
    shared prefix, and a few very long documents. The defaults are ``kvforge simulate``'s embedded workload
    (~2,500 requests arriving over ~190 s, which keeps a 4-server default fleet busy but not saturated); they
    simulate in a few seconds per policy."""

    conversations: int = 400
    seed: int = 0
    tokens_per_block: int = 128
    system_prompts: int = 6
    system_prompt_tokens: tuple[int, int] = (800, 4000)
    turns: tuple[int, int] = (1, 8)
    user_tokens: tuple[int, int] = (40, 1200)
    output_tokens: tuple[int, int] = (20, 600)
    think_time_s: float = 6.0
    conversation_rate_per_s: float = 3.0
    fork_probability: float = 0.12
    forks: tuple[int, int] = (2, 5)
    document_probability: float = 0.04
    document_tokens: tuple[int, int] = (24_000, 64_000)

    def __post_init__(self) -> None:
        if self.conversations < 1:
            raise ValueError(f"conversations: expected >= 1, got {self.conversations}")
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: expected >= 1, got {self.tokens_per_block}")
        for name in ("system_prompt_tokens", "turns", "user_tokens", "output_tokens", "forks", "document_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name}: expected 0 < low <= high, got ({lo}, {hi})")
        for name in ("fork_probability", "document_probability"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1], got {p}")
        if self.conversation_rate_per_s <= 0 or self.think_time_s < 0:
            raise ValueError("conversation_rate_per_s must be > 0 and think_time_s >= 0")

    def requests(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        root = default_hasher().root_key(("kvforge.sim.synthetic", self.seed))
        next_seg = iter(range(1, 1 << 62))
        sys_prompts = [(next(next_seg), rng.randint(*self.system_prompt_tokens)) for _ in range(self.system_prompts)]
        out: list[tuple[float, str, Runs, int, str]] = []
        t = 0.0
        for c in range(self.conversations):
            t += rng.expovariate(self.conversation_rate_per_s)
            runs: Runs = [rng.choice(sys_prompts)]
            if rng.random() < self.document_probability:
                runs.append((next(next_seg), rng.randint(*self.document_tokens)))
            kind = "document" if len(runs) > 1 else "turn"
            when = t
            n_turns = rng.randint(*self.turns)
            for turn in range(n_turns):
                runs = [*runs, (next(next_seg), rng.randint(*self.user_tokens))]
                n_out = rng.randint(*self.output_tokens)
                out.append((when, f"c{c}", list(runs), n_out, kind if turn == 0 else "turn"))
                if rng.random() < self.fork_probability:
                    # Sub-agents: each forks the conversation so far and adds its own task.
                    for f in range(rng.randint(*self.forks)):
                        fork_runs = [*runs, (next(next_seg), rng.randint(*self.user_tokens))]
                        out.append(
                            (
                                when + 0.05 * (f + 1),
                                f"c{c}.f{turn}.{f}",
                                fork_runs,
                                rng.randint(*self.output_tokens),
                                "fork",
                            )
                        )
                runs = [*runs, (next(next_seg), n_out)]  # the answer becomes part of the next prompt
                when += rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
        out.sort(key=lambda r: r[0])
        return [
            SimRequest(
                request_id=i,
                arrival_s=when,
                prompt_tokens=sum(n for _, n in runs),
                output_tokens=n_out,
                block_keys=keys_from_runs(runs, self.tokens_per_block, root),
                conversation_id=conv,
                kind=kind,
            )
            for i, (when, conv, runs, n_out, kind) in enumerate(out)
        ]


MOONCAKE_BLOCK_TOKENS = TRACE_TOKENS_PER_BLOCK


class TraceOrderWarning(UserWarning):
    """A trace's requests were not in time order; they were sorted (see :func:`load_mooncake_trace`)."""


def load_mooncake_trace(path: str | Path, *, limit: int | None = None) -> list[SimRequest]:
    """Read a Mooncake-format JSONL trace (:func:`kvforge.kvcache.replay.load_trace`) as ``SimRequest``s.

    ``hash_ids`` are chained by prefix in the trace; each full block's id becomes a block key through
    :func:`~kvforge.kvcache.hashing.keys_from_ids`. Requests have no conversation ids (matching is by prefix).
    ``limit`` keeps the first ``limit`` lines' requests. Requests out of time order are sorted by timestamp
    (stable: equal times keep file order; request ids stay the file order) and one :class:`TraceOrderWarning`
    names the first line that went back in time. Raises ``FileNotFoundError``, ``IsADirectoryError`` or
    ``TraceFormatError`` naming the file and line.
    """
    keys_from_ids = default_hasher().keys_from_ids
    reqs = [
        SimRequest(
            i,
            r.timestamp / 1000.0,
            r.input_length,
            r.output_length,
            tuple(keys_from_ids(r.hash_ids[: r.input_length // MOONCAKE_BLOCK_TOKENS])),
            None,
            "trace",
        )
        for i, r in enumerate(load_trace(path, limit=limit))
    ]
    if not reqs:
        raise TraceFormatError(f"{Path(path)}: no requests")
    back = next((i for i in range(1, len(reqs)) if reqs[i].arrival_s < reqs[i - 1].arrival_s), None)
    if back is not None:
        late = sum(1 for i in range(1, len(reqs)) if reqs[i].arrival_s < reqs[i - 1].arrival_s)
        warnings.warn(
            f"{Path(path)}: requests are not in time order (request {back} arrives before request {back - 1}; "
            f"{late} such step(s) back); sorted by timestamp",
            TraceOrderWarning,
            stacklevel=2,
        )
        reqs.sort(key=lambda r: r.arrival_s)
    return reqs


@dataclass
class WorkloadStats:
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


def describe(reqs: Sequence[SimRequest]) -> WorkloadStats:
    st = WorkloadStats()
    for r in reqs:
        st.requests += 1
        st.prompt_tokens += r.prompt_tokens
        st.output_tokens += r.output_tokens
        st.kinds[r.kind] = st.kinds.get(r.kind, 0) + 1
    return st
