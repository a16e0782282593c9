"""Replaying a block-hash trace (the Mooncake conversation trace) through one KV cache manager.

The trace gives, per request, ``input_length`` and ``hash_ids``: one id per 512-token block of the prompt,
chained by prefix (two requests share a block exactly when they share the id there and every id before it).
The ids therefore stand for chained block hashes: each becomes a block key through
:meth:`~kvforge.kvcache.hashing.BlockKeyHasher.keys_from_ids`, and each request is created and committed in *key mode*
(:meth:`~kvforge.kvcache.manager.KVCacheManager.create_cache` with ``block_keys``), every id as one block
(the last, partial one included, as the trace's own measurement does). A request's hit is the reused
blocks' tokens, capped at its prompt length.

The trace file is not part of the repository: :func:`default_trace_path` names it (``$KVFORGE_TRACE``, else
``shared/data/mooncake_conversation_trace.jsonl`` beside the checkout or a folder above it) and
:func:`find_trace` returns it only when the file is there. :func:`load_trace` is the one reader of the
format, used by the replay here, by the simulator's workloads and by the benches.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvforge.kvcache.config import KVCacheConfig, LayerSpec, TierConfig
from kvforge.kvcache.manager import KVCacheManager

__all__ = [
    "MAX_TRACE_LINE_BYTES",
    "TRACE_ENV",
    "TRACE_TOKENS_PER_BLOCK",
    "ReplayResult",
    "TraceFormatError",
    "TraceRequest",
    "default_trace_path",
    "find_trace",
    "load_trace",
    "replay_prefix_hits",
]

TRACE_ENV = "KVFORGE_TRACE"
TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_TOKENS_PER_BLOCK = 512  # tokens per hash_id
# One request per line: 1 MiB holds ~47k hash ids (a 24M-token prompt). A longer line is refused after reading
# at most this much, so a hostile file (one 2 GiB line) costs 1 MiB of memory, not a MemoryError.
MAX_TRACE_LINE_BYTES = 1 << 20


class TraceFormatError(ValueError):
    """A trace line is missing a field or holds a value of the wrong type; the message names the line."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float  # milliseconds, as in the file
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


def default_trace_path() -> Path | None:
    """``$KVFORGE_TRACE`` as given (present or not, so a caller can name it), else the shared trace in
    ``shared/data/`` beside the checkout or beside a folder above it; None when neither is set or found."""
    env = os.environ.get(TRACE_ENV)
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        cand = parent.parent / "shared" / "data" / TRACE_NAME
        if cand.is_file():
            return cand
    return None


def find_trace() -> Path | None:
    """:func:`default_trace_path` when that file exists; None otherwise."""
    p = default_trace_path()
    return p if p is not None and p.is_file() else None


def load_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids per 512 tokens),
    skipping blank lines and stopping after ``limit`` requests, in file order.

    Strict: integers are JSON integers (not ``true``, not ``2.0``), ``hash_ids`` are non-negative, below 2**64
    and at least one per full block of ``input_length``, and every line is UTF-8 JSON of at most
    :data:`MAX_TRACE_LINE_BYTES` bytes (read line by line with a bounded read). Raises
    ``FileNotFoundError`` or ``IsADirectoryError`` naming the path, or ``TraceFormatError`` naming the file and
    line (``path:line: ...``); never another exception for bad bytes.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"trace: {path} is a folder, expected a JSONL file")
    if not path.is_file():
        if path.exists():  # a device, a FIFO: reading one could block or never end
            raise TraceFormatError(f"trace: {path} is not a regular file")
        raise FileNotFoundError(f"trace: no such file: {path}")
    out: list[TraceRequest] = []

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    with path.open("rb") as f:
        lineno = 0
        while limit is None or len(out) < limit:
            raw = f.readline(MAX_TRACE_LINE_BYTES + 1)  # bounded: never the whole of a hostile line
            if not raw:
                break
            lineno += 1
            if len(raw) > MAX_TRACE_LINE_BYTES and not raw.endswith(b"\n"):
                raise TraceFormatError(
                    f"{path}:{lineno}: line longer than {MAX_TRACE_LINE_BYTES:,} bytes (one request per line)"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            except RecursionError:
                raise TraceFormatError(f"{path}:{lineno}: JSON nested too deeply") from None
            except ValueError as exc:  # e.g. an integer of more than 4,300 digits
                raise TraceFormatError(f"{path}:{lineno}: not a usable JSON value ({exc})") from None
            if not isinstance(d, dict):
                raise TraceFormatError(f"{path}:{lineno}: expected a JSON object")
            try:
                ts, n_in, n_out, ids = d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"]
            except KeyError as exc:
                raise TraceFormatError(f"{path}:{lineno}: missing field {exc.args[0]!r}") from None
            ok = (
                isinstance(ts, (int, float))
                and not isinstance(ts, bool)
                and math.isfinite(ts)
                and is_int(n_in)
                and n_in >= 1
                and is_int(n_out)
                and n_out >= 1
                and isinstance(ids, list)
                and all(is_int(h) and 0 <= h < 1 << 64 for h in ids)
            )
            if not ok:
                raise TraceFormatError(
                    f"{path}:{lineno}: expected numeric timestamp, positive integer "
                    "input_length/output_length and a list of integer hash_ids in [0, 2**64)"
                )
            if len(ids) < n_in // TRACE_TOKENS_PER_BLOCK:
                raise TraceFormatError(
                    f"{path}:{lineno}: expected at least {n_in // TRACE_TOKENS_PER_BLOCK} hash_ids (one per "
                    f"{TRACE_TOKENS_PER_BLOCK}-token block of input_length {n_in}), got {len(ids)}"
                )
            out.append(TraceRequest(ts, n_in, n_out, tuple(ids)))
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
    keys_from_ids = mgr.hasher.keys_from_ids
    prompt = hits = 0
    for r in requests:
        keys = keys_from_ids(r.hash_ids)
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
