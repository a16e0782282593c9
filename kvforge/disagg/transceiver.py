"""Context-side sender and generation-side receiver of KV caches, with sessions, deadlines and status polling.

``KVSender`` / ``KVReceiver``: ``connect(peer, ranks)`` once per peer instance on both sides (exchanges
``RankInfo`` and runs the peer checks); then per transfer (``transfer_id`` an int in ``[0, MAX_TRANSFER_ID)``,
unique per attempt, known to both sides) the generation side calls ``KVReceiver.request(transfer_id, request,
peer)`` and the context side ``KVSender.send(transfer_id, request, peer)`` on every rank of their instance;
under attention DP, on every rank of the DP group holding the request, with ``peer_dp_rank`` naming the other
side's group. ``check_status`` polls completion (non-blocking, blocking, or until N transfers completed) on every
rank of the receiving instance; a transfer is complete only when every rank of its DP group (the whole instance
without attention DP) has all its messages.

Failures are bounded: every session has a deadline; a dead or silent peer, a malformed message or a cancellation
ends it with a reason, and the pages go back through ``release`` exactly once. A failed request may be retried
under a new transfer id. Over NCCL both sides must start the transfers between two ranks in the same order.

Neither class is thread-safe: drive each from one thread. Design notes (message layout, ordering, helix
polling, posting thread): ``docs/disagg.md``.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvforge.disagg.layers import KVLayer, RequestKV, check_layers
from kvforge.disagg.mapping import InstanceLayout, Piece, helix_block_count, layouts_for, plan_pieces
from kvforge.disagg.peer import check_peer, dp_group
from kvforge.disagg.rank_info import RankInfo
from kvforge.disagg.transport import Group, Handle, Transport
from kvforge.errors import TransferError
from kvforge.kernels.kv_pack import KVPackLayout, KVPackPlan

HEADER_BYTES = 32
_MAGIC = 0x4B5646470001  # "KVFG", message format 1
MAX_TRANSFER_ID = 2**30
# Registration frames (int64 length + msgpack RankInfo, zero-padded) use a tag above every transfer id.
_TAG_INFO = 2**30 + 1
_INFO_BYTES = 4096
_POLL_SLEEP_S = 0.002  # longest sleep between polls of a blocking wait
_POLL_MIN_S = 2e-5  # first sleep after progress: a message of a batch lands every few hundred microseconds
# The header's piece word: the piece's index in its plan, and the request's DP ranks (context, generation) above
# it, so a sender and a receiver that disagree on a request's DP groups see a malformed message, not wrong KV.
# Without attention DP both DP ranks are 0 and the word is the index, as in message format 1 before DP.
_DP_SHIFT_CTX = 24
_DP_SHIFT_GEN = 44
_MAX_PIECES = 1 << _DP_SHIFT_CTX


def _piece_word(index: int, ctx_dp_rank: int, gen_dp_rank: int) -> int:
    return index | (ctx_dp_rank << _DP_SHIFT_CTX) | (gen_dp_rank << _DP_SHIFT_GEN)


class _Backoff:
    """Sleeps of a polling loop: short right after progress, doubling up to ``_POLL_SLEEP_S`` while idle.

    A fixed 2 ms sleep delayed each unpack (and the end of a batch) by up to 2 ms, several times the NCCL time
    of a request's KV; spinning without sleeps would take a host core from the serving loop.
    """

    def __init__(self, progress: Callable[[], int]) -> None:
        self._progress = progress
        self._seen = progress()
        self._sleep = _POLL_MIN_S

    def sleep(self) -> None:
        now = self._progress()
        self._sleep = _POLL_MIN_S if now != self._seen else min(2 * self._sleep, _POLL_SLEEP_S)
        self._seen = now
        time.sleep(self._sleep)


class State(enum.Enum):
    PENDING = "pending"
    LOCAL_DONE = "local_done"  # this rank has all its data; the instance may not
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class TransferStatus:
    """Transfers that ended since the last poll: ``completed`` ids and ``failed`` id -> reason."""

    completed: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)

    def raise_for_failures(self) -> None:
        if self.failed:
            raise TransferError("; ".join(f"transfer {i}: {why}" for i, why in sorted(self.failed.items())))

    def merge(self, other: TransferStatus) -> None:
        self.completed.extend(other.completed)
        self.failed.update(other.failed)


@dataclass
class PollStats:
    """Counters of the collectives a receiver ran (the idle probe's effect is visible here)."""

    polls: int = 0
    probes: int = 0
    probe_skips: int = 0
    consensus_rounds: int = 0


@dataclass
class _Op:
    piece: Piece
    handle: Handle
    buf: torch.Tensor
    peer_rank: int
    plan: KVPackPlan | None = None
    index: int = 0
    done: bool = False


@dataclass
class _Session:
    transfer_id: int
    request: RequestKV
    peer: str
    deadline: float
    timeout_s: float
    ops: list[_Op]
    state: State = State.PENDING
    reason: str = ""
    released: bool = False


@dataclass
class _Peer:
    name: str
    infos: list[RankInfo]  # by instance rank
    ctx: InstanceLayout
    gen: InstanceLayout
    plans: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)

    @property
    def pieces(self) -> list[Piece]:
        """The plan of DP ranks (0, 0): the whole plan without attention DP."""
        return self.plan(0, 0)

    def plan(self, ctx_dp_rank: int, gen_dp_rank: int) -> list[Piece]:
        """The pieces of a request held by context DP group ``ctx_dp_rank`` and generation DP group
        ``gen_dp_rank`` (planned once per pair)."""
        key = (ctx_dp_rank, gen_dp_rank)
        got = self.plans.get(key)
        if got is None:
            got = self.plans[key] = plan_pieces(self.ctx, self.gen, ctx_dp_rank=ctx_dp_rank, gen_dp_rank=gen_dp_rank)
            if len(got) >= _MAX_PIECES:
                raise ValueError(f"peer {self.name!r}: {len(got)} pieces per transfer, at most {_MAX_PIECES - 1}")
        return got


class _DeferredHandle(Handle):
    """An operation handed to the posting thread: not done until posted and then finished; a posting error is
    raised from ``done()`` as a ``TransferError`` (so the session fails through the usual path)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._posted = threading.Event()
        self._handle: Handle | None = None
        self._error: str | None = None

    def _set(self, handle: Handle | None, error: str | None = None) -> None:
        self._handle, self._error = handle, error
        self._posted.set()

    def done(self) -> bool:
        if not self._posted.is_set():
            return False
        if self._error is not None:
            raise TransferError(f"{self.what}: {self._error}")
        assert self._handle is not None
        return self._handle.done()


class _Poster:
    """One thread that posts a sender's messages, in ``send()`` call order, while ``send()`` returns at once.

    Posting an NCCL send costs the host more than packing the message does (torch's process group records
    events and enqueues the kernel), and a batch of transfers is bounded by the host time per request: posting
    on this thread overlaps it with the next request's planning and packing on the caller's. Messages are posted
    under the caller's CUDA device and stream, so each send still waits for its pack. After a posting error the
    transfer's remaining messages are not posted (as when ``send`` posts them itself).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, posts: list[tuple[Callable[[], Handle], _DeferredHandle]], device: torch.device) -> None:
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._queue.put((posts, stream))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                posts, stream = item
                # Entering the caller's stream also makes its device current on this thread.
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    failed: str | None = None
                    for post, deferred in posts:
                        if failed is not None:
                            deferred._set(None, f"not posted: an earlier message of this transfer failed ({failed})")
                            continue
                        try:
                            deferred._set(post())
                        except Exception as exc:  # reported through the handle, never raised in this thread
                            failed = f"posting failed: {type(exc).__name__}: {exc}"
                            deferred._set(None, failed)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted message is posted (posting never waits for a peer)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Endpoint:
    side = ""

    def __init__(
        self,
        transport: Transport,
        info: RankInfo,
        layers: Sequence[KVLayer],
        *,
        release: Callable[[RequestKV], None] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport: expected a Transport, got {type(transport).__name__}")
        if not isinstance(info, RankInfo):
            raise TypeError(f"info: expected a RankInfo, got {type(info).__name__}")
        if info.transport_rank != transport.rank:
            raise ValueError(
                f"info.transport_rank: expected this process's rank {transport.rank}, got {info.transport_rank}"
            )
        tpb = check_layers(layers)
        if tpb != info.tokens_per_block:
            raise ValueError(
                f"layers: tokens_per_block {tpb} differs from info.tokens_per_block {info.tokens_per_block}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.transport = transport
        self.info = info
        self.layers = {ly.key: ly for ly in layers}
        self.tokens_per_block = tpb
        self.release_fn = release
        self.timeout_s = float(timeout_s)
        self.peers: dict[str, _Peer] = {}
        self._layouts: dict[tuple[str, int], tuple[KVPackLayout, list[tuple[str, int]]]] = {}
        # Pages of each layer group (the smallest pool of the group bounds its page indices), KV and state apart.
        self._group_pages: dict[int, int] = {}
        self._state_group_pages: dict[int, int] = {}
        for ly in layers:
            bounds = self._group_pages if ly.kind == "kv" else self._state_group_pages
            bounds[ly.group] = min(bounds.get(ly.group, ly.num_pages), ly.num_pages)
        self.ops_done = 0  # operations seen finished (polling loops back off while it stays put)
        self.sessions: dict[int, _Session] = {}
        self.orphans: list[_Op] = []

    # -- registration -------------------------------------------------------------------------------------------

    def connect(self, peer: str, ranks: Sequence[int], *, timeout_s: float | None = None) -> None:
        """Exchange RankInfo with every rank of instance ``peer`` (transport ranks ``ranks``) and check them."""
        if peer in self.peers:
            raise ValueError(f"peer: {peer!r} is already connected")
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks: expected distinct transport ranks of instance {peer!r}, got {ranks}")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        dev = self.transport.device
        wire = self.info.to_wire()
        if len(wire) > _INFO_BYTES - 8:
            raise ValueError(f"info: its wire form takes {len(wire)} bytes, more than the {_INFO_BYTES - 8} allowed")
        frame = bytearray(_INFO_BYTES)
        frame[:8] = len(wire).to_bytes(8, "little")
        frame[8 : 8 + len(wire)] = wire
        mine = torch.frombuffer(frame, dtype=torch.uint8).to(dev)
        theirs = {r: torch.empty(_INFO_BYTES, dtype=torch.uint8, device=dev) for r in ranks}
        ops = []
        for r in ranks:
            # NCCL serialises a pair's operations in posting order: the lower rank sends first, the higher
            # receives first, so the two directions cannot wait on each other.
            if self.transport.rank < r:
                ops += [self.transport.isend(mine, r, _TAG_INFO), self.transport.irecv(theirs[r], r, _TAG_INFO)]
            else:
                ops += [self.transport.irecv(theirs[r], r, _TAG_INFO), self.transport.isend(mine, r, _TAG_INFO)]
        self._wait_all(ops, deadline, f"registration with {peer!r} (transport ranks {ranks})")
        payloads = {}
        for r in ranks:
            raw = theirs[r].cpu().numpy().tobytes()
            n = int.from_bytes(raw[:8], "little")
            if n > _INFO_BYTES - 8:
                raise TransferError(f"registration with {peer!r}: rank {r} sent a malformed RankInfo frame ({n} bytes)")
            payloads[r] = raw[8 : 8 + n]
        infos = [RankInfo.from_wire(payloads[r]) for r in ranks]
        for r, inf in zip(ranks, infos):
            if inf.transport_rank != r:
                raise ValueError(f"ranks: transport rank {r} announced itself as rank {inf.transport_rank}")
        self.add_peer(peer, infos)

    def add_peer(self, peer: str, infos: Sequence[RankInfo]) -> None:
        """Register instance ``peer`` from its ranks' RankInfo obtained another way (e.g. from a coordinator).

        Runs the peer checks and derives the transfer plan; sends nothing, so the peer must register this
        instance likewise. ``connect`` exchanges the RankInfo over the transport and then calls this.
        """
        if peer in self.peers:
            raise ValueError(f"peer: {peer!r} is already connected")
        infos = sorted(infos, key=lambda i: i.instance_rank)
        if not infos or not all(isinstance(i, RankInfo) for i in infos):
            raise TypeError(f"infos: expected RankInfo of every rank of {peer!r}")
        for inf in infos:
            check_peer(self.info, inf)
        first = infos[0]
        for inf in infos:
            for attr in ("instance_name", "tp_size", "pp_size", "cp_size", "dp_size", "layers_per_pp"):
                if getattr(inf, attr) != getattr(first, attr):
                    raise ValueError(
                        f"peer {peer!r}: ranks disagree on {attr}: {getattr(first, attr)!r} vs {getattr(inf, attr)!r}"
                    )
        world = first.tp_size * first.pp_size * first.cp_size
        if [i.instance_rank for i in infos] != list(range(world)):
            raise ValueError(
                f"infos: instance {peer!r} has {world} ranks, got instance ranks {[i.instance_rank for i in infos]}"
            )
        ctx_info, gen_info = (self.info, first) if self.side == "context" else (first, self.info)
        ctx, gen = layouts_for(ctx_info, gen_info)
        entry = _Peer(peer, infos, ctx, gen)
        entry.plan(0, 0)  # planned at registration: a layout the mapping refuses fails here, not at the first send
        self.peers[peer] = entry
        for key in [k for k in self._layouts if k[0] == peer]:  # a re-registered peer may cut pieces differently
            del self._layouts[key]

    def _wait_all(self, handles, deadline: float, what: str) -> None:
        pending = list(handles)
        backoff = _Backoff(lambda: len(pending))
        while pending:
            pending = [h for h in pending if not h.done()]
            if pending and time.monotonic() > deadline:
                raise TransferError(f"{what}: timed out ({len(pending)} operations unfinished)")
            if pending:
                backoff.sleep()

    # -- shared helpers -----------------------------------------------------------------------------------------

    def _peer(self, peer: str) -> _Peer:
        if peer not in self.peers:
            raise ValueError(f"peer: {peer!r} is not connected (connected: {sorted(self.peers)})")
        return self.peers[peer]

    def _check_new(self, transfer_id: int, request: RequestKV, timeout_s: float | None) -> float:
        if isinstance(transfer_id, bool) or not isinstance(transfer_id, int) or not 0 <= transfer_id < MAX_TRANSFER_ID:
            raise ValueError(f"transfer_id: expected an int in [0, {MAX_TRANSFER_ID}), got {transfer_id!r}")
        if transfer_id in self.sessions:
            raise ValueError(f"transfer_id: transfer {transfer_id} is already in flight; retry under a new id")
        if not isinstance(request, RequestKV):
            raise TypeError(f"request: expected a RequestKV, got {type(request).__name__}")
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        return t

    def _layer_cols(self, layer: KVLayer, piece: Piece, tp_rank: int) -> tuple[int, int]:
        """Columns of ``layer``'s token rows that ``piece`` carries, from this rank's head range."""
        info = self.info
        if info.is_mla or layer.kind == "state":
            return 0, layer.elems_per_token
        total = layer.heads * info.attention_tp_size
        lo, hi = piece.head_range(total)
        start = (tp_rank % info.attention_tp_size) * layer.heads  # heads are split inside this rank's DP group
        if lo < start or hi > start + layer.heads:
            raise ValueError(
                f"layers: {layer.owner} layer {layer.layer_id} holds heads [{start}, {start + layer.heads}), "
                f"the transfer plan needs [{lo}, {hi})"
            )
        return (lo - start) * layer.head_elems, (hi - start) * layer.head_elems

    def _my_pieces(
        self, p: _Peer, request: RequestKV, nb: int, ctx_dp: int, gen_dp: int, *, sending: bool
    ) -> list[tuple[int, Piece, KVPackPlan]]:
        """(piece word, piece, pack plan) of each piece of ``request``'s plan that this rank sends (``sending``)
        or receives and that carries blocks; raises before anything is posted when a peer rank it needs is gone.
        A sender packs the piece's blocks from its pages; a receiver unpacks its share, one page per block."""
        me = self.info.instance_rank
        planned = []
        for k, piece in enumerate(p.plan(ctx_dp, gen_dp)):
            if (piece.ctx_rank if sending else piece.gen_rank) != me:
                continue
            blocks = piece.blocks(nb)
            if not blocks:
                continue
            index = _piece_word(k, ctx_dp, gen_dp)
            rows = list(blocks) if sending else range(len(blocks))
            planned.append((index, piece, self._piece_plan(p.name, index, piece, request, rows, unpack=not sending)))
        for _, piece, _ in planned:
            self.transport.check_peer(p.infos[piece.gen_rank if sending else piece.ctx_rank].transport_rank)
        return planned

    def _piece_layout(self, peer: str, index: int, piece: Piece) -> tuple[KVPackLayout, list[tuple[str, int]]]:
        """The pack layout of a piece's layers (built once per peer and piece; ``index`` is the piece word, which
        names the DP pair too) and the layer group of each table."""
        key = (peer, index)
        got = self._layouts.get(key)
        if got is not None:
            return got
        pools, cols, tables, groups = [], [], [], []
        for lk in piece.layer_keys():
            layer = self.layers.get(lk)
            if layer is None:
                raise ValueError(
                    f"layers: this rank has no {lk[0]} layer {lk[1]}, which the transfer plan assigns to it"
                )
            table = (layer.kind, layer.group)
            if table not in groups:
                groups.append(table)
            pools.append(layer.pool)
            cols.append(self._layer_cols(layer, piece, self.info.tp_rank))
            tables.append(groups.index(table))
        got = self._layouts[key] = (KVPackLayout(pools, cols, tables), groups)
        return got

    def _piece_plan(
        self, peer: str, index: int, piece: Piece, request: RequestKV, positions: Sequence[int], *, unpack: bool
    ) -> KVPackPlan:
        layout, groups = self._piece_layout(peer, index, piece)
        pages = []
        for kind, g in groups:  # one list per layer group: every layer of the group reads it
            if kind == "state":
                pages.append(list(request.state_pages[g]) if piece.with_state else [])
                continue
            if g >= len(request.page_indices):
                raise ValueError(f"request.page_indices: no page list for layer group {g}")
            src = request.page_indices[g]
            pages.append([src[k] for k in positions])
        return layout.plan(pages, unpack=unpack)

    def _check_pages(self, request: RequestKV, expected: int, *, unique: bool) -> None:
        """Every group this rank's layers use lists ``expected`` valid pages (distinct ones where we write)."""
        pages_of = self._group_pages
        for g in sorted(pages_of):
            pages = request.page_indices[g] if g < len(request.page_indices) else None
            name = f"request.page_indices[{g}]"
            if pages is None or len(pages) != expected:
                n = None if pages is None else len(pages)
                raise ValueError(
                    f"{name}: expected {expected} pages (the blocks this rank holds of {request.num_tokens} tokens), "
                    f"got {n}"
                )
            bad = [p for p in pages if not 0 <= p < pages_of[g]]
            if bad:
                raise ValueError(f"{name}: pages must lie in [0, {pages_of[g]}), got {bad[:4]}")
            if unique and len(set(pages)) != len(pages):
                dup = sorted({p for p in pages if pages.count(p) > 1})[:4]
                raise ValueError(f"{name}: page(s) {dup} appear more than once")
        for g in sorted(self._state_group_pages):
            name = f"request.state_pages[{g}]"
            pages = request.state_pages[g] if g < len(request.state_pages) else None
            if not pages:
                raise ValueError(f"{name}: expected the recurrent-state pages to move (live state first), got none")
            bound = self._state_group_pages[g]
            bad = [p for p in pages if not 0 <= p < bound]
            if bad:
                raise ValueError(f"{name}: pages must lie in [0, {bound}), got {bad[:4]}")
            if unique and len(set(pages)) != len(pages):
                raise ValueError(f"{name}: a state page appears more than once")

    def _release(self, s: _Session) -> None:
        if not s.released:
            s.released = True
            if self.release_fn is not None:
                self.release_fn(s.request)

    def _end(self, s: _Session, state: State, reason: str, *, release: bool) -> None:
        s.state = state
        s.reason = reason
        for op in s.ops:
            if not op.done:
                self.orphans.append(op)
                # An operation left posted may match the peer's next message (NCCL matches in order); the
                # transport decides whether that makes the peer unusable.
                self.transport.mark_broken(op.peer_rank, f"transfer {s.transfer_id} ended with an operation posted")
        if release:
            self._release(s)

    def _sweep_orphans(self) -> None:
        kept = []
        for op in self.orphans:
            try:
                finished = op.handle.done()
            except TransferError:
                finished = True
            if not finished:
                kept.append(op)
        self.orphans = kept

    def _progress_ops(self, s: _Session) -> None:
        for op in s.ops:
            if op.done:
                continue
            try:
                op.done = op.handle.done()
                self.ops_done += op.done
            except TransferError as exc:
                got = sum(o.done for o in s.ops)
                self._fail(
                    s,
                    f"{exc} ({self._counterpart} rank {op.peer_rank} of {s.peer!r}; "
                    f"{got} of {len(s.ops)} messages done)",
                )
                return
        if s.state is State.PENDING and not all(op.done for op in s.ops) and time.monotonic() > s.deadline:
            waiting = sorted({op.peer_rank for op in s.ops if not op.done})
            got = sum(op.done for op in s.ops)
            self._fail(
                s,
                f"timed out after {s.timeout_s:g} s waiting for {self._counterpart} rank(s) {waiting} of {s.peer!r} "
                f"({got} of {len(s.ops)} messages done)",
            )

    def _fail(self, s: _Session, reason: str) -> None:
        self._end(s, State.FAILED, reason, release=True)

    _counterpart = ""

    def _post_all(self, posts, transfer_id: int) -> list[_Op]:
        """Post every operation of a transfer; if posting fails midway, what was posted becomes orphaned."""
        ops: list[_Op] = []
        try:
            for post in posts:
                ops.append(post())
        except Exception:
            for op in ops:
                self.orphans.append(op)
                self.transport.mark_broken(op.peer_rank, f"transfer {transfer_id}: posting failed midway")
            raise
        return ops

    def cancel(self, transfer_id: int) -> None:
        """End a transfer in flight now; its pages are released and it is reported as cancelled."""
        s = self.sessions.get(transfer_id)
        if s is None or s.state in (State.FAILED, State.CANCELLED, State.DONE):
            raise ValueError(f"transfer_id: no transfer {transfer_id} in flight to cancel")
        self._end(s, State.CANCELLED, "cancelled", release=True)

    @property
    def in_flight(self) -> int:
        return len(self.sessions)


class KVSender(_Endpoint):
    """Context side: packs a request's blocks for every generation rank it serves and sends them.

    ``release(request)`` is called once per transfer when it ends (sent, failed or cancelled): the pages are no
    longer needed for sending.
    """

    side = "context"
    _counterpart = "generation"

    def __init__(
        self,
        transport: Transport,
        info: RankInfo,
        layers: Sequence[KVLayer],
        *,
        post_async: bool | None = None,
        **kw,
    ) -> None:
        super().__init__(transport, info, layers, **kw)
        if info.cp_size != 1:
            raise ValueError(
                "info.cp_size: a context instance must have cp_size 1 (helix splits the generation side), "
                f"got {info.cp_size}"
            )
        if post_async is not None and not isinstance(post_async, bool):
            raise TypeError(f"post_async: expected a bool or None, got {type(post_async).__name__}")
        # Default: post from a thread when messages live on a GPU (NCCL), where posting costs the most.
        if post_async is None:
            post_async = transport.device.type == "cuda"
        self._poster = _Poster(f"kvforge-post rank {transport.rank}") if post_async else None

    def close(self) -> None:
        """Post what is queued and stop the posting thread (if any); sessions in flight stay pollable."""
        if self._poster is not None:
            self._poster.drain()
            self._poster.close()
            self._poster = None

    def connect(self, peer: str, ranks: Sequence[int], *, timeout_s: float | None = None) -> None:
        if self._poster is not None:
            self._poster.drain()  # registration uses the transport from this thread: nothing else may be posting
        super().connect(peer, ranks, timeout_s=timeout_s)

    def send(
        self,
        transfer_id: int,
        request: RequestKV,
        peer: str,
        *,
        timeout_s: float | None = None,
        peer_dp_rank: int = 0,
    ) -> None:
        """Start sending ``request``'s KV to instance ``peer``; every check runs before anything is sent.

        ``peer_dp_rank``: the generation instance's DP group that will hold the request (0 without attention DP
        there). Under attention DP on this side, only the ranks of the DP group holding the request call
        ``send`` (this rank's own group, ``dp_rank``); the others do not know the request.
        """
        t = self._check_new(transfer_id, request, timeout_s)
        p = self._peer(peer)
        gen_dp = p.gen.check_dp_rank("peer_dp_rank", peer_dp_rank)
        ctx_dp = dp_group(self.info)
        nb = request.num_blocks(self.tokens_per_block)
        self._check_pages(request, nb, unique=False)
        planned = self._my_pieces(p, request, nb, ctx_dp, gen_dp, sending=True)

        # Pack every message before posting any send: packing may tune its kernel on first use, and tuning
        # synchronises the device, which must not happen behind this transfer's own posted NCCL sends.
        packed = []
        for index, piece, plan in planned:
            buf = torch.empty(HEADER_BYTES + plan.nbytes, dtype=torch.uint8, device=plan.device)
            plan.pack(out=buf, header=(_MAGIC, transfer_id, plan.nbytes, index))
            wire = buf if buf.device == self.transport.device else buf.to(self.transport.device)
            packed.append((index, piece, wire))

        if self._poster is not None:
            ops, posts = [], []
            for index, piece, wire in packed:
                dst = p.infos[piece.gen_rank].transport_rank
                deferred = _DeferredHandle(f"send of {wire.numel()} bytes to rank {dst}")
                posts.append((lambda w=wire, d=dst: self.transport.isend(w, d, transfer_id), deferred))
                ops.append(_Op(piece, deferred, wire, dst, index=index))
            self._poster.submit(posts, self.transport.device)
        else:

            def post(index: int, piece: Piece, wire: torch.Tensor):
                def run() -> _Op:
                    dst = p.infos[piece.gen_rank].transport_rank
                    return _Op(piece, self.transport.isend(wire, dst, transfer_id), wire, dst, index=index)

                return run

            ops = self._post_all([post(*x) for x in packed], transfer_id)
        s = _Session(transfer_id, request, peer, time.monotonic() + t, t, ops)
        self.sessions[transfer_id] = s

    def poll(self) -> TransferStatus:
        """Advance every send; report (and forget) the ones that ended."""
        st = TransferStatus()
        self._sweep_orphans()
        for tid, s in list(self.sessions.items()):
            if s.state is State.PENDING:
                self._progress_ops(s)
                if s.state is State.PENDING and all(op.done for op in s.ops):
                    s.state = State.DONE
                    self._release(s)
            if s.state is State.DONE:
                st.completed.append(tid)
            elif s.state in (State.FAILED, State.CANCELLED):
                st.failed[tid] = s.reason
            else:
                continue
            del self.sessions[tid]
        return st

    def wait(self) -> TransferStatus:
        """Poll until every send in flight has ended (each bounded by its deadline)."""
        st = TransferStatus()
        backoff = _Backoff(lambda: self.ops_done)
        while True:
            st.merge(self.poll())
            if not self.sessions:
                return st
            backoff.sleep()


class KVReceiver(_Endpoint):
    """Generation side: receives a request's blocks into the pages it registered.

    ``group``: the transport group of this generation instance's ranks (from ``transport.new_group``); None for
    a one-rank instance. ``release(request)`` is called once when a transfer fails or is cancelled.
    """

    side = "generation"
    _counterpart = "context"

    def __init__(
        self,
        transport: Transport,
        info: RankInfo,
        layers: Sequence[KVLayer],
        *,
        group: Group | None = None,
        **kw,
    ) -> None:
        super().__init__(transport, info, layers, **kw)
        world = info.tp_size * info.pp_size * info.cp_size
        if group is None and world != 1:
            raise ValueError(f"group: an instance of {world} ranks needs its transport group for the consensus")
        if group is not None:
            if transport.rank not in group.ranks:
                raise ValueError(f"group: this rank ({transport.rank}) is not in {group.ranks}")
            if group.size != world:
                raise ValueError(f"group: expected the instance's {world} ranks, got {group.size}")
        self.group = group
        self.stats = PollStats()
        self._warmed: set = set()
        # The reference system's eligibility for the idle probe: helix, no attention DP, one PP stage, and a
        # group that is exactly the TP x CP ranks.
        self.probe_eligible = (
            info.cp_size > 1
            and not info.attention_dp
            and info.dp_size == 1
            and info.pp_size == 1
            and group is not None
            and group.size == info.tp_size * info.cp_size
        )

    def request(
        self,
        transfer_id: int,
        request: RequestKV,
        peer: str,
        *,
        timeout_s: float | None = None,
        peer_dp_rank: int = 0,
    ) -> None:
        """Register the pages of ``request`` on this rank and post the receives; checks run before any is posted.

        ``request.page_indices[g]`` lists this rank's pages of group g, one per block it holds: all blocks, or
        under helix its round-robin share. ``peer_dp_rank``: the context instance's DP group holding the request
        (0 without attention DP there). Under attention DP on this side, only the ranks of the DP group that will
        hold the request call ``request`` (this rank's own group); the transfer completes when all of them have
        their share.
        """
        t = self._check_new(transfer_id, request, timeout_s)
        p = self._peer(peer)
        ctx_dp = p.ctx.check_dp_rank("peer_dp_rank", peer_dp_rank)
        gen_dp = dp_group(self.info)
        nb = request.num_blocks(self.tokens_per_block)
        info = self.info
        self._check_pages(request, helix_block_count(nb, info.cp_rank, info.cp_size), unique=True)
        planned = self._my_pieces(p, request, nb, ctx_dp, gen_dp, sending=False)

        bufs = [
            torch.empty(HEADER_BYTES + plan.nbytes, dtype=torch.uint8, device=self.transport.device)
            for _, _, plan in planned
        ]
        self._warm_unpack([(plan, buf) for (_, _, plan), buf in zip(planned, bufs)])

        def post(index: int, piece: Piece, plan: KVPackPlan, buf: torch.Tensor):
            def run() -> _Op:
                src = p.infos[piece.ctx_rank].transport_rank
                return _Op(piece, self.transport.irecv(buf, src, transfer_id), buf, src, plan, index)

            return run

        ops = self._post_all([post(*x, buf) for x, buf in zip(planned, bufs)], transfer_id)
        s = _Session(transfer_id, request, peer, time.monotonic() + t, t, ops)
        self.sessions[transfer_id] = s
        if not ops:
            s.state = State.LOCAL_DONE

    def _warm_unpack(self, plans: Sequence[tuple[KVPackPlan, torch.Tensor]]) -> None:
        """NCCL: run each new kind of unpack once now, while no operation of this endpoint is posted.

        The first launch of the unpack kernel for a layer set may tune it, and tuning synchronises the whole
        device. Done later (when the messages have arrived) it would wait for every receive still posted on
        NCCL's stream, including those of a peer that stopped, which never finish: the host would hang where
        the deadline cannot fire. Unpacking the not yet received buffer writes garbage into this request's own
        pages, which the real unpack overwrites (or which are released if the transfer fails).
        """
        if self.transport.supports_tags or self.transport.device.type != "cuda":
            return
        if self.orphans or any(not op.done for s in self.sessions.values() for op in s.ops):
            return  # not safe now; the kernel tunes on first real use instead
        for plan, buf in plans:
            key = plan.layout  # layouts are cached per peer and piece, so each is warmed once
            if plan.nbytes == 0 or key in self._warmed:
                continue
            plan.unpack(buf[HEADER_BYTES:])
            self._warmed.add(key)

    def _finish_local(self, s: _Session) -> None:
        """All messages arrived: check their headers, then unpack every one into the pages."""
        # Every header of the session in one download (one wait on the stream, not one per message).
        got = torch.stack([op.buf[:HEADER_BYTES] for op in s.ops]).cpu().view(torch.int64).tolist()
        for op, hdr in zip(s.ops, got):
            assert op.plan is not None
            want = [_MAGIC, s.transfer_id, op.plan.nbytes, op.index]
            if hdr != want:
                self._fail(
                    s,
                    f"malformed message from rank {op.peer_rank}: header [magic, transfer, bytes, piece] = {hdr}, "
                    f"expected {want}",
                )
                return
        for op in s.ops:
            payload = op.buf[HEADER_BYTES:]
            assert op.plan is not None
            if payload.device != op.plan.device:
                payload = payload.to(op.plan.device)
            op.plan.unpack(payload)
        s.state = State.LOCAL_DONE

    def _progress(self) -> None:
        self._sweep_orphans()
        now = time.monotonic()
        for s in self.sessions.values():
            if s.state is State.PENDING:
                self._progress_ops(s)
                if s.state is State.PENDING and all(op.done for op in s.ops):
                    self._finish_local(s)
            elif s.state is State.LOCAL_DONE and now > s.deadline and self.group is not None:
                # This rank has its share but the instance never agreed: another rank lost its data. Bounded too.
                self._end(
                    s,
                    State.FAILED,
                    f"timed out after {s.timeout_s:g} s waiting for the other generation ranks",
                    release=True,
                )

    def _local_lists(self) -> tuple[list[int], list[int], list[int]]:
        pending, done, failed = [], [], []
        for tid, s in self.sessions.items():
            if s.state is State.LOCAL_DONE:
                done.append(tid)
            elif s.state in (State.FAILED, State.CANCELLED):
                failed.append(tid)
            else:
                pending.append(tid)
        return pending, done, failed

    def _consensus(self) -> tuple[TransferStatus, int]:
        """Agree on ended transfers over the group; returns the status and the transfers still open anywhere.

        A transfer is done when every rank of the DP group that holds it has its share (without attention DP the
        group is the whole instance); each rank announces its DP group with its lists. A transfer announced by
        ranks of two DP groups fails (the caller registered it on the wrong ranks).
        """
        pending, done, failed = self._local_lists()
        me = dp_group(self.info)
        if self.group is None or self.group.size == 1:
            per_rank = [(me, set(pending), set(done), set(failed))]
        else:
            self.stats.consensus_rounds += 1
            vec = [me, len(pending), len(done), len(failed), *pending, *done, *failed]
            sizes = self.transport.all_gather_int64(torch.tensor([len(vec)], dtype=torch.int64), self.group)
            width = int(sizes.max())
            padded = torch.full((width,), -1, dtype=torch.int64)
            padded[: len(vec)] = torch.tensor(vec, dtype=torch.int64)
            rows = self.transport.all_gather_int64(padded, self.group).tolist()
            per_rank = []
            for row in rows:
                g, a, b, c = row[0], row[1], row[2], row[3]
                ids = row[4 : 4 + a + b + c]
                per_rank.append((g, set(ids[:a]), set(ids[a : a + b]), set(ids[a + b :])))
        every = set().union(*(p | d | f for _, p, d, f in per_rank))
        failed_any = set().union(*(f for _, _, _, f in per_rank))
        groups_of: dict[int, set[int]] = {}
        for g, p, d, f in per_rank:
            for tid in p | d | f:
                groups_of.setdefault(tid, set()).add(g)
        mixed = {tid for tid, gs in groups_of.items() if len(gs) > 1} - failed_any
        done_all = set()
        for tid in every - failed_any - mixed:
            (g,) = groups_of[tid]
            if all(tid in d for gg, _, d, _ in per_rank if gg == g):
                done_all.add(tid)
        st = TransferStatus()
        # Each rank reports the transfers of its own DP group (another group's are not its caller's business).
        ours = {tid for tid, gs in groups_of.items() if me in gs}
        for tid in sorted(done_all & ours):
            s = self.sessions.pop(tid)
            s.state = State.DONE
            st.completed.append(tid)
        for tid in sorted((failed_any | mixed) & ours):
            s = self.sessions.pop(tid, None)
            if tid in mixed:
                why = f"registered by ranks of DP groups {sorted(groups_of[tid])}; a request lives in one DP group"
            else:
                ranks = [
                    self.group.ranks[i] if self.group else 0 for i, (_, _, _, f) in enumerate(per_rank) if tid in f
                ]
                why = f"failed on generation rank(s) {ranks} of this instance"
            if s is not None and s.state in (State.FAILED, State.CANCELLED):
                st.failed[tid] = s.reason
            else:
                st.failed[tid] = why
                if s is not None:
                    self._end(s, State.FAILED, why, release=True)
        return st, len(every - done_all - failed_any - mixed)

    def check_status(self, *, blocking: bool = False, at_least: int | None = None) -> TransferStatus:
        """Report the transfers that ended on every rank of the instance since the last call.

        * default (non-blocking): one round; under helix the idle probe may skip it (see the module docstring);
        * ``blocking=True``: until no transfer is open on any rank;
        * ``at_least=N``: until N transfers completed in this call or none is open.
        Every rank of the instance must call it with the same arguments (it runs collectives).
        """
        if at_least is not None and (isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 1):
            raise ValueError(f"at_least: expected an int >= 1, got {at_least!r}")
        self.stats.polls += 1
        result = TransferStatus()
        if not blocking and at_least is None:
            self._progress()
            if self.probe_eligible:
                self.stats.probes += 1
                counts = self.transport.all_gather_int64(
                    torch.tensor([len(self.sessions)], dtype=torch.int64), self.group
                )
                if int(counts.abs().sum()) == 0:
                    self.stats.probe_skips += 1
                    return result
            st, _ = self._consensus()
            return st
        backoff = _Backoff(lambda: self.ops_done)
        while True:
            self._progress()
            st, still_open = self._consensus()
            result.merge(st)
            if still_open == 0 or (at_least is not None and len(result.completed) >= at_least):
                return result
            backoff.sleep()
