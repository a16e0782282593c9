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
from typing import Any

import msgspec

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
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    # lora_id, medium and lora_name have no default, as in vLLM: its decoder requires them on the wire.
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
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
    token_ids: list[int]
    block_size: int
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
        self._blocks: dict[EngineHash, tuple[Hashable, tuple[int, ...], tuple[Hashable, ...], set[str | None]]] = {}
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
                entry[3].discard(event.medium)
                if not entry[3]:
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
                old[3].add(event.medium)  # the same block in another medium (or stored again)
                continue
            if len(self._blocks) >= self.max_blocks:
                self.skipped += 1
                continue
            self._blocks[h] = (key, partial, tuple(done), {event.medium})
            for k in done:
                self.present[k] = self.present.get(k, 0) + 1
            stored.extend(done)
        if not stored:
            return []
        return [_keys.stored_event(stored, None if first_parent == _keys.root_key() else first_parent, tpb)]


# ---------------------------------------------------------------- subscriber


class KVEventSubscriber:
    """Subscribes to one engine's PUB socket (and its replay ROUTER), feeding router events to ``sink``.

    Sequence numbers: a jump forward asks the replay socket for the missing batches (at most
    ``replay_timeout_s`` waiting for them); a number at or below the last one applied is a duplicate and is
    dropped, except a restart at 0, which clears the engine's blocks. The first batch seen, if not 0, asks for
    a replay from 0 so the router learns what the engine already holds.
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
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sink = sink
        self.mapper = mapper
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.counts = {"batches": 0, "events": 0, "gaps": 0, "replayed": 0, "lost": 0, "bad": 0, "duplicates": 0}
        self._on_stats = on_stats
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n
        if self._on_stats is not None:
            self._on_stats(what, n)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self._count("bad")
            logger.warning("kv events from %s: batch %d skipped: %s", self.endpoint, seq, exc)
            self.last_seq = seq
            return
        out: list[Any] = []
        for ev in batch.events:
            out.extend(self.mapper.apply(ev))
        self.last_seq = seq
        self._count("batches")
        self._count("events", len(batch.events))
        if out:
            self.sink(out)

    def handle(self, seq: int, payload: bytes) -> int | None:
        """Apply one live batch; returns the first missing sequence number when there is a gap before it."""
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == 0:
                self.mapper.apply(AllBlocksCleared())
                self.sink([_keys.cleared_event()])
                self.last_seq = None
                self._apply(seq, payload)
            else:
                self._count("duplicates")
            return None
        if (last is None and seq > 0) or (last is not None and seq > last + 1):
            return 0 if last is None else last + 1
        self._apply(seq, payload)
        return None

    async def _replay(self, dealer: Any, start: int, upto: int) -> None:
        import zmq

        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = start
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(int(left * 1000), zmq.POLLIN):
                break
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._count("bad")
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                break
            if seq >= upto:
                continue
            if (self.last_seq is None and seq >= 0) or (self.last_seq is not None and seq == self.last_seq + 1):
                self._apply(seq, frames[3])
                self._count("replayed")
                got = seq + 1
        if self.last_seq is None or self.last_seq + 1 < upto:
            lost = upto - (got if self.last_seq is None else self.last_seq + 1)
            if lost > 0 and not (self.last_seq is None and start == 0):
                self._count("lost", lost)
                logger.warning("kv events from %s: %d batches lost before %d", self.endpoint, lost, upto)

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        dealer = None
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(self.replay_endpoint)
        except zmq.ZMQError as exc:
            logger.error("kv events: cannot connect to %s / %s: %s", self.endpoint, self.replay_endpoint, exc)
            self._count("bad")
            sub.close(0)
            if dealer is not None:
                dealer.close(0)
            self._ctx.term()
            return
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    _, seq, payload = parse_frames(frames)
                except WireError as exc:
                    self._count("bad")
                    logger.warning("kv events from %s: message skipped: %s", self.endpoint, exc)
                    continue
                missing = self.handle(seq, payload)
                if missing is None:
                    continue
                if missing > 0 or self.last_seq is not None:
                    self._count("gaps")
                if dealer is not None:
                    await self._replay(dealer, missing, seq)
                elif missing > 0 or self.last_seq is not None:
                    self._count("lost", seq - missing)
                    logger.warning(
                        "kv events from %s: %d batches lost (no replay socket)", self.endpoint, seq - missing
                    )
                # Whatever the replay brought, the live batch comes next (a lost stretch is accepted).
                self.last_seq = seq - 1
                self._apply(seq, payload)
        finally:
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
