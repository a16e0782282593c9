"""Replaying a block-hash trace (the Mooncake conversation trace) through one KV cache manager.

The trace gives, per request, ``input_length`` and ``hash_ids``: one id per 512-token block of the prompt,
chained by prefix (two requests share a block exactly when they share the id there and every id before it).
The ids therefore stand for chained block hashes, and each request is created and committed in *key mode*
(:meth:`~kvforge.kvcache.manager.KVCacheManager.create_cache` with ``block_keys``), every id as one block
(the last, partial one included, as the trace's own measurement does). A request's hit is the reused
blocks' tokens, capped at its prompt length.

The trace file is not part of the repository: :func:`find_trace` looks for it in ``$KVFORGE_TRACE`` or
``<repo>/../shared/data/mooncake_conversation_trace.jsonl`` and returns None when it is absent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvforge.kvcache.config import KVCacheConfig, LayerSpec, TierConfig
from kvforge.kvcache.manager import KVCacheManager

__all__ = ["TRACE_ENV", "ReplayResult", "TraceRequest", "find_trace", "load_trace", "replay_prefix_hits"]

TRACE_ENV = "KVFORGE_TRACE"
TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_TOKENS_PER_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    capacity_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def find_trace() -> Path | None:
    """The trace file from ``$KVFORGE_TRACE``, else ``<repo>/../shared/data/``; None when absent."""
    env = os.environ.get(TRACE_ENV)
    if env:
        p = Path(env)
        return p if p.is_file() else None
    p = Path(__file__).resolve().parents[2].parent / "shared" / "data" / TRACE_NAME
    return p if p.is_file() else None


def load_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(
                    TraceRequest(
                        int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]), tuple(d["hash_ids"])
                    )
                )
    return out


def replay_prefix_hits(
    requests: Sequence[TraceRequest] | Iterable[TraceRequest],
    capacity_blocks: int | None = None,
    *,
    tokens_per_block: int = TRACE_TOKENS_PER_BLOCK,
) -> ReplayResult:
    """Token hit rate of one manager with ``capacity_blocks`` GPU pages (None: enough for every block, i.e.
    unlimited) under the default prioritised LRU: a hit needs the whole leading run of blocks present, and
    reuse and insertion both refresh recency. Requests are served one at a time, in trace order."""
    requests = list(requests)
    if capacity_blocks is None:
        capacity_blocks = sum(len(r.hash_ids) for r in requests) or 1
    config = KVCacheConfig(
        tokens_per_block=tokens_per_block,
        layers=(LayerSpec(0, bytes_per_token=1),),
        tiers=(TierConfig(pages=capacity_blocks),),
    )
    mgr = KVCacheManager(config)
    prompt = hits = 0
    for r in requests:
        keys = r.hash_ids
        prompt += r.input_length
        cache = mgr.create_cache(block_keys=keys)
        reused = cache.num_committed_tokens
        hits += min(reused, r.input_length)
        n = len(keys) * tokens_per_block
        # A prompt larger than the whole cache cannot be inserted; it still counted its hits.
        if cache.resize(capacity=n, history=n):
            cache.commit(num_tokens=n - reused, block_keys=keys[reused // tokens_per_block :])
        cache.close()
    return ReplayResult(len(requests), prompt, hits, capacity_blocks)
