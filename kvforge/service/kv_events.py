"""vLLM's published KV-event wire format: decode, encode, map onto router keys, subscribe, publish.

Wire (``vllm/distributed/kv_events.py``, read in vLLM 0.33): a ZMQ PUB message is three frames
``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian batch counter from 0; ``payload`` is msgpack of an
``EventBatch`` encoded as an array ``[ts, events, data_parallel_rank?]``. Each event is a msgspec struct
tagged by its class name (``"type"``): ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name`` required; ``extra_keys``,
``group_idx``, ... optional), ``BlockRemoved`` (``block_hashes``, ``medium``, ...), ``AllBlocksCleared``.
vLLM 0.33 encodes events as maps; earlier releases encoded them as arrays (``array_like=True``, tag first).
:func:`decode_batch` reads both; :func:`encode_batch` writes the map layout (or the legacy one on request).
Engine block hashes are ``bytes`` or ``int``.

Replay: a DEALER sends ``(b"", start_seq)`` to the engine's ROUTER socket and receives
``(b"", topic, seq, payload)`` for every buffered batch from ``start_seq``, then ``(b"", b"", -1, b"")``.

:class:`BlockMapper` turns one engine's events into router events, rebuilding router keys from the token ids
in ``BlockStored`` (the engine's hash function is never needed). :class:`KVEventSubscriber` (asyncio) detects
sequence gaps and fills them from the replay socket. :class:`KVEventPublisher` speaks the same protocol.
Hostile bytes raise :class:`WireError` (a ``ValueError``); the subscriber counts and skips them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Annotated, Any

import msgspec

from kvforge.kvcache.hashing import TOKEN_ID_LIMIT
from kvforge.service import keys as _keys

__all__ = [
    "AllBlocksCleared",
    "BlockMapper",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "WireError",
    "decode_batch",
    "encode_batch",
    "from_kvforge_event",
]

logger = logging.getLogger("kvforge.service.kv_events")

END_SEQ = -1
EngineHash = bytes | int


class WireError(ValueError):
    """Bytes that are not a valid vLLM KV-event message."""


# Field names below are vLLM's wire names (its ``block_hashes`` are the engine's hashes, not kvforge keys).
# Token ids are 32-bit (kvforge.kvcache.hashing's bound) and a block holds at least one: checked by msgspec in C
# while decoding, so a hostile id (-1, 2**40) is a WireError before anything is mapped.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]
BlockSize = Annotated[int, msgspec.Meta(gt=0)]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    # lora_id, medium and lora_name have no default, as in vLLM: its decoder requires them on the wire.
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


# The legacy layout: the same fields, in the same order, as a tagged array. Required fields are those a
# legacy writer always sent (through ``medium``); later optional fields may follow.
class _LegacyStored(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _LegacyRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class _LegacyCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False):
    pass


KVWireEvent = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _LegacyStored | _LegacyRemoved | _LegacyCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


_raw_decoder = msgspec.msgpack.Decoder(EventBatch)
_encoder = msgspec.msgpack.Encoder()
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


def _from_legacy(ev: Any) -> KVWireEvent:
    if isinstance(ev, _LegacyStored):
        return BlockStored(**{f: getattr(ev, f) for f in BlockStored.__struct_fields__})
    if isinstance(ev, _LegacyRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return AllBlocksCleared()


def _check_stored(ev: BlockStored) -> None:
    if ev.block_size <= 0:
        raise WireError(f"BlockStored.block_size: expected a positive int, got {ev.block_size}")
    if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
        raise WireError(
            f"BlockStored.token_ids: expected {len(ev.block_hashes)} blocks x {ev.block_size} tokens, "
            f"got {len(ev.token_ids)}"
        )


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload (either event layout) into an :class:`EventBatch` of wire events; raises WireError."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload: expected bytes, got {type(payload).__name__}")
    try:
        raw = _raw_decoder.decode(payload)
        events: list[KVWireEvent] = []
        for ev in raw.events:
            if isinstance(ev, dict):
                events.append(msgspec.convert(ev, _MapEvent))  # type: ignore[arg-type]
            elif isinstance(ev, list):
                events.append(_from_legacy(msgspec.convert(ev, _ArrayEvent)))  # type: ignore[arg-type]
            else:
                raise WireError(f"event: expected a map or an array, got {type(ev).__name__}")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"payload: not a vLLM EventBatch ({exc})") from None
    except RecursionError:
        raise WireError("payload: nested too deeply") from None
    for ev in events:
        if isinstance(ev, BlockStored):
            _check_stored(ev)
    return EventBatch(raw.ts, events, raw.data_parallel_rank)  # type: ignore[arg-type]


def encode_batch(
    events: Sequence[KVWireEvent],
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    *,
    legacy_array: bool = False,
) -> bytes:
    """msgpack of an EventBatch as vLLM writes it (events as tagged maps; ``legacy_array``: tagged arrays)."""
    for ev in events:
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"events: expected BlockStored, BlockRemoved or AllBlocksCleared, got {type(ev).__name__}")
        if isinstance(ev, BlockStored):
            _check_stored(ev)
    evs: list[Any] = list(events)
    if legacy_array:
        evs = [
            _LegacyStored(**msgspec.structs.asdict(e))
            if isinstance(e, BlockStored)
            else _LegacyRemoved(**msgspec.structs.asdict(e))
            if isinstance(e, BlockRemoved)
            else _LegacyCleared()
            for e in evs
        ]
    return _encoder.encode(EventBatch(time.time() if ts is None else ts, evs, data_parallel_rank))


def _wire_hash(key: object) -> EngineHash:
    """A kvforge block key as vLLM's wire carries a hash: msgpack ints stop at 64 bits, so a 128-bit key travels
    as 16 big-endian bytes (vLLM's sha256 hashes are bytes too); a subscriber treats either as opaque."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key if key < 1 << 64 else key.to_bytes(16, "big")
    if isinstance(key, bytes):
        return key
    raise TypeError(f"block key: expected a non-negative int or bytes, got {type(key).__name__}")


def from_kvforge_event(
    event: Any, token_ids: Sequence[int] | None = None, *, medium: str | None = "GPU"
) -> KVWireEvent:
    """The wire form of a ``kvforge.kvcache.events`` event, for a kvforge manager publishing like vLLM.

    kvforge's ``BlockStored`` carries keys, not tokens; the wire form needs the stored blocks' tokens
    (``token_ids``, exactly ``len(keys) * tokens_per_block`` of them) so a router can rebuild its own keys.
    """
    from kvforge.kvcache import events as kv

    if isinstance(event, kv.BlockStored):
        keys = [_wire_hash(k) for k in _keys.event_keys(event)]
        if token_ids is None:
            raise ValueError("token_ids: required to publish a BlockStored (the wire carries the blocks' tokens)")
        parent = None if event.parent_key is None else _wire_hash(event.parent_key)
        ev = BlockStored(keys, parent, list(token_ids), event.tokens_per_block, None, medium, None)
        _check_stored(ev)
        return ev
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved([_wire_hash(k) for k in _keys.event_keys(event)], medium)
    if isinstance(event, kv.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(
        f"event: expected a kvforge BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}"
    )


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one PUB message; raises WireError."""
    if len(frames) != 3:
        raise WireError(f"message: expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError(f"seq: expected 8 bytes, got {len(seq)}")
    return bytes(topic), int.from_bytes(seq, "big", signed=True), bytes(payload)


# ---------------------------------------------------------------- engine blocks -> router keys


class BlockMapper:
    """One engine's blocks, mapped onto router keys of ``tokens_per_block`` tokens.

    Each engine block remembers the router key chain state after it (the last full router key and the tokens
    of the partial router block since), so a child block extends it without the engine's hash function.
    A router block is reported stored when the engine block that completes it is stored, and removed when
    that engine block leaves every medium. Blocks under a LoRA, with extra keys (multimodal, cache salt), of
    another KV-cache group than ``group_idx``, or whose parent is unknown are skipped (counted in
    ``skipped``): their router keys cannot be rebuilt from tokens alone.
    """

    def __init__(self, tokens_per_block: int, group_idx: int = 0, max_blocks: int = 4_000_000) -> None:
        self.tokens_per_block = tokens_per_block
        self.group_idx = group_idx
        self.max_blocks = max_blocks
        # engine hash -> (router key after it, partial tokens after that key, keys it completed, media)
        # (Entries hold only atoms and tuples of atoms, media as a tuple too, so the garbage collector stops
        # tracking them: a full collection over millions of tracked sets took tens of milliseconds.)
        self._blocks: dict[EngineHash, tuple[Hashable, tuple[int, ...], tuple[Hashable, ...], tuple[str | None, ...]]]
        self._blocks = {}
        self.present: dict[Hashable, int] = {}  # router keys held, with how many engine blocks complete them
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, event: KVWireEvent) -> list[Any]:
        """Router events (``kvforge.kvcache.events``) for one wire event."""
        if isinstance(event, AllBlocksCleared):
            self._blocks.clear()
            self.present.clear()
            return [_keys.cleared_event()]
        if event.group_idx not in (None, self.group_idx):
            if isinstance(event, BlockStored):
                self.skipped += len(event.block_hashes)
            return []
        if isinstance(event, BlockRemoved):
            gone: list[Hashable] = []
            for h in event.block_hashes:
                entry = self._blocks.get(h)
                if entry is None:
                    continue
                media = entry[3]
                if event.medium in media:
                    media = tuple(m for m in media if m != event.medium)
                    self._blocks[h] = (*entry[:3], media)
                if not media:
                    del self._blocks[h]
                    for k in entry[2]:
                        c = self.present.get(k, 0)
                        if c <= 1:
                            self.present.pop(k, None)
                            gone.append(k)
                        else:
                            self.present[k] = c - 1
            return [_keys.removed_event(gone)] if gone else []
        if event.lora_id is not None or event.lora_name is not None or event.extra_keys:
            self.skipped += len(event.block_hashes)
            return []
        partial: tuple[int, ...]
        if event.parent_block_hash is None:
            key, partial = _keys.root_key(), ()
        else:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self.skipped += len(event.block_hashes)
                return []
            key, partial = parent[0], parent[1]
        first_parent = key
        stored: list[Hashable] = []
        tpb, bs = self.tokens_per_block, event.block_size
        tokens = event.token_ids
        for i, h in enumerate(event.block_hashes):
            run = partial + tuple(tokens[i * bs : (i + 1) * bs])
            done: list[Hashable] = []
            while len(run) >= tpb:
                key = _keys.chain_keys(key, run[:tpb], tpb)[0]
                done.append(key)
                run = run[tpb:]
            partial = run
            old = self._blocks.get(h)
            if old is not None:
                if event.medium not in old[3]:  # the same block in another medium (or stored again)
                    self._blocks[h] = (*old[:3], (*old[3], event.medium))
                continue
            if len(self._blocks) >= self.max_blocks:
                self.skipped += 1
                continue
            self._blocks[h] = (key, partial, tuple(done), (event.medium,))
            for k in done:
                self.present[k] = self.present.get(k, 0) + 1
            stored.extend(done)
        if not stored:
            return []
        return [_keys.stored_event(stored, None if first_parent == _keys.root_key() else first_parent, tpb)]


# ---------------------------------------------------------------- subscriber


class _RateLimitedWarning:
    """At most one warning per ``interval_s`` (the rest are counted and reported with the next one)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self.interval_s
        if self._suppressed:
            msg += " (%d similar warnings suppressed)"
            args = (*args, self._suppressed)
            self._suppressed = 0
        logger.warning(msg, *args)


def _pieces(event: KVWireEvent, blocks: int) -> Iterable[KVWireEvent]:
    """``event`` cut into events of at most ``blocks`` blocks that a mapper applies to the same effect (each
    stored piece's parent is the previous piece's last block)."""
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= blocks:
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for a in range(0, len(hashes), blocks):
            yield BlockRemoved(hashes[a : a + blocks], event.medium, event.group_idx)
        return
    bs = event.block_size
    for a in range(0, len(hashes), blocks):
        yield BlockStored(
            hashes[a : a + blocks],
            event.parent_block_hash if a == 0 else hashes[a - 1],
            event.token_ids[a * bs : (a + blocks) * bs],
            bs,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
        )


class KVEventSubscriber:
    """Subscribes to one engine's PUB socket (and its replay ROUTER), feeding router events to ``sink``.

    Any bytes: a message that cannot be parsed, decoded, mapped or applied (wrong frames, bad msgpack, wrong
    types, token ids outside [0, 2**32), nesting past the decoder's depth, a sink that raises) is counted
    (``bad``), logged at most once per ``log_interval_s`` and skipped; the task only ends when stopped.
    A message over ``max_message_bytes`` (512 KiB) is not decoded (``oversized``). Big batches are applied in
    pieces of ``slice_blocks`` engine blocks, and a burst of messages one by one, yielding to the event loop
    every ``slice_s`` seconds of work.

    Sequence numbers: a jump forward asks the replay socket for the missing batches (at most
    ``replay_timeout_s`` waiting for them); a number at or below the last one applied is a duplicate and is
    dropped, except a restart at 0, which clears the engine's blocks. The first batch seen, if not 0, asks for
    a replay from 0 so the router learns what the engine already holds. A jump of more than ``max_seq_jump``
    past what the engine's replay socket confirms is implausible (a forged number): that batch is dropped
    (``implausible_seq``) and nothing is counted lost. ``resync_after`` consecutive numbers in a run far from
    the last one applied (forward past ``max_seq_jump`` without a replay socket to confirm it, or backward past
    it, as after a poisoned start) are the engine's stream: the subscriber follows them (``resyncs``).
    """

    def __init__(
        self,
        endpoint: str,
        sink: Callable[[list[Any]], None],
        mapper: BlockMapper,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        on_stats: Callable[[str, int], None] | None = None,
        max_seq_jump: int = 100_000,
        resync_after: int = 3,
        max_message_bytes: int = 512 * 1024,
        slice_blocks: int = 256,
        slice_s: float = 0.001,
        log_interval_s: float = 10.0,
    ) -> None:
        for name, v in (("max_seq_jump", max_seq_jump), ("resync_after", resync_after),
                        ("max_message_bytes", max_message_bytes), ("slice_blocks", slice_blocks)):  # fmt: skip
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        # (A NaN slice would never yield to the event loop; a NaN interval would never hold a warning back.)
        for name, x in (("slice_s", slice_s), ("log_interval_s", log_interval_s)):
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x < float("inf"):
                raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {x!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sink = sink
        self.mapper = mapper
        self.replay_timeout_s = replay_timeout_s
        self.max_seq_jump = max_seq_jump
        self.resync_after = resync_after
        self.max_message_bytes = max_message_bytes
        self.slice_blocks = slice_blocks
        self.slice_s = slice_s
        self.last_seq: int | None = None
        self.counts = dict.fromkeys(
            ("batches", "events", "gaps", "replayed", "lost", "bad", "duplicates", "oversized", "implausible_seq",
             "resyncs", "skipped_blocks", "block_size_mismatch"),
            0,
        )  # fmt: skip
        self._on_stats = on_stats
        self._warn = _RateLimitedWarning(log_interval_s)
        self._warned_block_size = False
        self._run_seq: int | None = None  # the last number of a run far from last_seq
        self._run_len = 0
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None
        self._dealer: Any = None
        self._yielded = 0.0

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n
        if self._on_stats is not None:
            try:
                self._on_stats(what, n)
            except Exception:  # a metrics callback must not stop the stream
                logger.exception("kv events: stats callback failed")

    def _bad(self, seq: int | None, why: str) -> None:
        self._count("bad")
        self._warn("kv events from %s: message %s skipped: %s", self.endpoint, seq, why)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv events {self.endpoint}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---------------------------------------------------------------- applying one batch

    async def _maybe_yield(self) -> None:
        if time.perf_counter() - self._yielded > self.slice_s:
            await asyncio.sleep(0)
            self._yielded = time.perf_counter()

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch as number ``seq`` (``last_seq`` becomes ``seq`` whatever its content)."""
        self.last_seq = seq
        if len(payload) > self.max_message_bytes:
            self._count("oversized")
            self._warn(
                "kv events from %s: batch %d of %d bytes not decoded (over %d): its blocks stay unknown",
                self.endpoint, seq, len(payload), self.max_message_bytes,
            )  # fmt: skip
            return
        try:
            batch = decode_batch(payload)
        except Exception as exc:  # WireError, and whatever else hostile bytes may raise
            self._bad(seq, f"{type(exc).__name__}: {exc}")
            return
        self._count("batches")
        self._count("events", len(batch.events))
        mapper = self.mapper
        for ev in batch.events:
            if isinstance(ev, BlockStored) and mapper.tokens_per_block % ev.block_size:
                self._count("block_size_mismatch")
                if not self._warned_block_size:
                    self._warned_block_size = True
                    logger.warning(
                        "kv events from %s: the engine's block size %d does not divide --tokens-per-block %d; "
                        "router blocks straddle engine blocks (each is dropped with the engine block that "
                        "completed it): use a multiple of %d",
                        self.endpoint, ev.block_size, mapper.tokens_per_block, ev.block_size,
                    )  # fmt: skip
            for piece in _pieces(ev, self.slice_blocks):
                skipped = mapper.skipped
                try:
                    out = mapper.apply(piece)
                    if out:
                        self.sink(out)
                except Exception as exc:
                    self._bad(seq, f"{type(piece).__name__} not applied: {type(exc).__name__}: {exc}")
                if mapper.skipped != skipped:
                    self._count("skipped_blocks", mapper.skipped - skipped)
                await self._maybe_yield()

    # ---------------------------------------------------------------- sequence numbers

    def _far_run(self, seq: int) -> bool:
        """Counts ``seq`` into the current run of numbers far from ``last_seq``; True once the run is long
        enough to be the engine's own stream."""
        if self._run_seq is not None and seq == self._run_seq + 1:
            self._run_len += 1
        else:
            self._run_len = 1
        self._run_seq = seq
        return self._run_len >= self.resync_after

    def _end_run(self) -> None:
        """Forget the run of far numbers: a batch in sequence (or a resync) ends it."""
        self._run_seq, self._run_len = None, 0

    def _resync(self, seq: int) -> None:
        self._count("resyncs")
        self._warn("kv events from %s: following the engine's numbers from %d (was %s)", self.endpoint, seq,
                   self.last_seq)  # fmt: skip
        self._end_run()
        self.last_seq = seq - 1

    async def on_message(self, frames: Sequence[bytes]) -> None:
        """Handle one PUB message (never raises, except on cancellation)."""
        try:
            _, seq, payload = parse_frames(frames)
        except Exception as exc:
            self._bad(None, f"{type(exc).__name__}: {exc}")
            return
        try:
            await self._on_batch(seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a defect here must not end the stream either
            logger.exception("kv events from %s: batch %d failed", self.endpoint, seq)
            self._bad(seq, f"{type(exc).__name__}: {exc}")

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        if seq < 0:  # an engine numbers its batches from 0 (-1 ends a replay, never a live message)
            self._bad(seq, "negative batch number")
            return
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == 0:  # the engine restarted
                self.mapper.apply(AllBlocksCleared())
                self.sink([_keys.cleared_event()])
                self.last_seq = None
                self._end_run()
                await self._apply(seq, payload)
            elif last - seq > self.max_seq_jump and self._far_run(seq):
                self._resync(seq)  # the numbers before were not the engine's: follow these
                await self._apply(seq, payload)
            else:
                self._count("duplicates")
            return
        if seq == (0 if last is None else last + 1):
            self._end_run()
            await self._apply(seq, payload)
            return
        # A gap (or the first batch seen, not 0).
        if last is not None:
            self._count("gaps")
        confirmed = None  # the engine's newest number as its replay socket says, when it answered
        if self._dealer is not None:
            confirmed = await self._replay(0 if last is None else last + 1, seq)
        top = self.last_seq if confirmed is None else max(confirmed, -1 if self.last_seq is None else self.last_seq)
        if self.last_seq is not None and seq <= self.last_seq:
            self._count("duplicates")  # the replay brought it
            return
        if top is not None and seq - top > self.max_seq_jump:
            if confirmed is None and self._far_run(seq):
                self._resync(seq)  # no replay socket to ask: a long enough run is the engine's stream
                await self._apply(seq, payload)
                return
            self._count("implausible_seq")
            self._warn("kv events from %s: batch number %d dropped: %d past the engine's %s", self.endpoint, seq,
                       seq - top, top)  # fmt: skip
            return
        self._end_run()
        if self.last_seq is not None and seq > self.last_seq + 1:
            lost = seq - self.last_seq - 1
            self._count("lost", lost)
            self._warn("kv events from %s: %d batches lost before %d", self.endpoint, lost, seq)
        await self._apply(seq, payload)

    async def _replay(self, start: int, upto: int) -> int | None:
        """Ask for batches from ``start``; applies those that continue ``last_seq`` (below ``upto``). Returns the
        highest number the engine's replay socket sent (-1 for none), or None when it did not answer in time."""
        import zmq

        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        deadline = time.monotonic() + self.replay_timeout_s
        top: int | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(int(left * 1000), zmq.POLLIN):
                return top
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._bad(None, f"replay: expected 4 frames with an 8-byte number, got {len(frames)}")
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return -1 if top is None else top
            top = seq if top is None else max(top, seq)
            if seq >= upto:
                continue
            last = self.last_seq
            if (last is None and seq >= start) or (last is not None and seq == last + 1):
                await self._apply(seq, frames[3])
                self._count("replayed")
            elif last is not None and seq > last + 1 and seq - last <= self.max_seq_jump:
                # The engine's buffer no longer reaches back to the gap: what it lacks is lost.
                self._count("lost", seq - last - 1)
                self._warn("kv events from %s: %d batches lost before %d", self.endpoint, seq - last - 1, seq)
                await self._apply(seq, frames[3])
                self._count("replayed")

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # A hard bound on what one message may allocate (ZMQ drops the connection past it, then reconnects;
        # the replay fills the gap). Smaller messages over max_message_bytes are counted and skipped.
        sub.setsockopt(zmq.MAXMSGSIZE, 8 * self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        dealer = None
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.MAXMSGSIZE, 8 * self.max_message_bytes)
                dealer.connect(self.replay_endpoint)
        except zmq.ZMQError as exc:
            logger.error("kv events: cannot connect to %s / %s: %s", self.endpoint, self.replay_endpoint, exc)
            self._count("bad")
            sub.close(0)
            if dealer is not None:
                dealer.close(0)
            self._ctx.term()
            return
        self._dealer = dealer
        try:
            while True:
                try:
                    frames = await sub.recv_multipart()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # (a ZMQ error on a live socket: keep listening)
                    self._bad(None, f"receive failed: {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.01)
                    continue
                await self.on_message(frames)
                # Queued messages are received without a suspension: a burst (1,000 junk messages) would
                # otherwise be worked through in one go.
                await self._maybe_yield()
        finally:
            self._dealer = None
            sub.close(0)
            if dealer is not None:
                dealer.close(0)
            self._ctx.term()


# ---------------------------------------------------------------- publisher


class KVEventPublisher:
    """Publishes batches in vLLM's format (PUB + optional replay ROUTER), for kvforge's own managers.

    Synchronous and thread-free: :meth:`publish` sends at once (a PUB socket never blocks; past ``hwm`` queued
    messages ZMQ drops them, which subscribers see as a gap) and keeps the last ``buffer_steps`` payloads;
    :meth:`serve_replay` answers pending replay requests (call it from the owner's loop; ``publish`` calls it
    too). ``endpoint`` / ``replay_endpoint`` are bound (``tcp://127.0.0.1:0`` picks a port: read
    :attr:`endpoint` back).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        legacy_array: bool = False,
    ) -> None:
        import zmq

        if not isinstance(buffer_steps, int) or buffer_steps <= 0:
            raise ValueError(f"buffer_steps: expected a positive int, got {buffer_steps!r}")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._dp_rank = data_parallel_rank
        self._legacy = legacy_array

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: Iterable[KVWireEvent], *, send: bool = True) -> int:
        """Encode and send one batch; returns its sequence number. ``send=False`` only buffers it (a test's
        way to make a gap that replay must fill)."""
        import zmq

        payload = encode_batch(list(events), data_parallel_rank=self._dp_rank, legacy_array=self._legacy)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if send:
            # At the high-water mark the message is dropped: subscribers see a gap and replay it.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.serve_replay()
        return seq

    def serve_replay(self) -> int:
        """Answer every waiting replay request; returns how many were served."""
        import zmq

        if self._replay is None:
            return 0
        served = 0
        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((ident, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""))
            served += 1
        return served

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
