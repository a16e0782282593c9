"""copy_small_pinned_pair: fallbacks, bad pairs, the copy kernel itself, the staging ring, and the GPU upload."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvforge.kernels.pinned_pair as pmod
from kvforge.kernels.pinned_pair import (
    MAX_PAIR_BYTES,
    StagingRing,
    copy_small_pinned_pair,
    copy_small_pinned_pair_ref,
)
from tests.helpers import poison

HAS_GPU = torch.cuda.is_available()


def _host(n, dtype, gen, *, pin=False) -> torch.Tensor:
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=gen).bool()
    else:
        t = torch.randint(-(2**15), 2**15, (n,), generator=gen).to(dtype)
    return t.pin_memory() if pin else t


def test_no_pinned_memory_falls_back(device, gen, monkeypatch):
    # CPU torch has no pinned memory: the caller must copy itself. Nothing is launched, nothing written.
    def no_launch(*args, **kwargs):
        raise AssertionError("launched on the fallback path")

    monkeypatch.setattr(pmod._KERNEL, "launch", no_launch)
    ha, hb = _host(512, torch.int32, gen), _host(512, torch.bool, gen)
    da = poison(torch.empty(512, dtype=torch.int32, device=device))
    db = torch.zeros(512, dtype=torch.bool, device=device)
    assert copy_small_pinned_pair(ha, hb, da, db) is False
    assert bool((da == poison(torch.empty(1, dtype=torch.int32, device=device)).item()).all())
    assert not bool(db.any())


@pytest.mark.parametrize(
    ("dtype_a", "n_a", "dtype_b", "n_b"),
    [(torch.int32, 512, torch.bool, 512), (torch.int64, 3, torch.uint8, 7), (torch.int16, 1, torch.bool, 4096)],
)
def test_copy_kernel_is_byte_exact(dtype_a, n_a, dtype_b, n_b, device, gen):
    # The kernel alone (in the interpreter on a CPU machine), including sizes that are not whole int32 words.
    ha, hb = _host(n_a, dtype_a, gen), _host(n_b, dtype_b, gen)
    da = poison(torch.empty(n_a, dtype=dtype_a, device=device))
    db = poison(torch.empty(n_b, dtype=dtype_b, device=device)) if dtype_b != torch.bool else None
    if db is None:
        db = (~hb).to(device)  # every element starts wrong
    pmod._launch_pair(ha.to(device), da, hb.to(device), db)
    ra, rb = copy_small_pinned_pair_ref(ha, hb, da, db)
    assert torch.equal(da, ra) and torch.equal(db, rb)


def test_word_views_only_when_aligned():
    x = torch.zeros(16, dtype=torch.uint8)
    assert pmod._words(x, x.clone())[0].dtype == torch.int32
    assert pmod._words(x[:15], x[:15].clone())[0].dtype == torch.uint8
    assert pmod._words(x[1:5], x[:4].clone())[0].dtype == torch.uint8


BAD = [
    ("host-type", "host_a", TypeError, lambda a, b, da, db: copy_small_pinned_pair(a.tolist(), b, da, db)),
    ("dev-type", "dev_b", TypeError, lambda a, b, da, db: copy_small_pinned_pair(a, b, da, None)),
    ("dtype", "dev_a", TypeError, lambda a, b, da, db: copy_small_pinned_pair(a, b, da.long(), db)),
    ("numel", "dev_b", ValueError, lambda a, b, da, db: copy_small_pinned_pair(a, b, da, db[:-1])),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_mismatched_pairs_are_errors(case, device, gen):
    _, name, exc, call = case
    a, b = _host(64, torch.int32, gen, pin=HAS_GPU), _host(64, torch.bool, gen, pin=HAS_GPU)
    da = poison(torch.empty(64, dtype=torch.int32, device=device))
    db = torch.zeros(64, dtype=torch.bool, device=device)
    with pytest.raises(exc, match=name):
        call(a, b, da, db)
    assert bool((da == da[0]).all()) and not bool(db.any())


class _FakeEvent:
    """Stands in for torch.cuda.Event: pending from record() until the test completes it or someone waits."""

    def __init__(self) -> None:
        self.pending = False
        self.waits = 0

    def record(self, stream: object = None) -> None:
        self.pending = True

    def query(self) -> bool:
        return not self.pending

    def synchronize(self) -> None:
        self.waits += 1
        self.pending = False


class RingMachine(RuleBasedStateMachine):
    """A slot is never handed out while a kernel may still read it; no slot is lost; the ring stays bounded."""

    MAX = 4

    def __init__(self) -> None:
        super().__init__()
        self.made: list[pmod._Slot] = []
        self.ring = StagingRing(self.MAX, self._new)
        self.held: list[pmod._Slot] = []  # acquired, kernel not yet launched
        self.in_flight: list[pmod._Slot] = []  # released after record(): a kernel may be reading it
        self.peak_held = 0

    def _new(self) -> pmod._Slot:
        slot = pmod._Slot(buffer=len(self.made), event=_FakeEvent())
        self.made.append(slot)
        return slot

    @precondition(lambda self: len(self.held) < RingMachine.MAX + 2)
    @rule()
    def acquire(self) -> None:
        # The ring asks only the oldest slot in flight (in_flight keeps release order), so reuse is expected
        # when a slot was given back or the oldest has finished.
        given_back = [s for s in self.made if s not in self.held and s not in self.in_flight]
        oldest_done = bool(self.in_flight) and not self.in_flight[0].event.pending
        made_before = len(self.made)
        slot = self.ring.acquire()
        assert slot not in self.held, "a slot was handed out twice"
        assert not slot.event.pending, "a slot was handed out while its kernel may still read it"
        if given_back or oldest_done:
            assert len(self.made) == made_before, "a new slot was made while a finished one was free"
        if slot in self.in_flight:
            self.in_flight.remove(slot)
        self.held.append(slot)
        self.peak_held = max(self.peak_held, len(self.held))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def launch_and_release(self, i: int) -> None:
        slot = self.held.pop(i % len(self.held))
        slot.event.record()
        self.ring.release(slot)
        self.in_flight.append(slot)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def launch_fails(self, i: int) -> None:
        self.ring.give_back(self.held.pop(i % len(self.held)))

    @precondition(lambda self: any(s.event.pending for s in self.in_flight))
    @rule(i=st.integers(0, 10))
    def kernel_completes(self, i: int) -> None:
        pending = [s for s in self.in_flight if s.event.pending]
        pending[i % len(pending)].event.pending = False

    @invariant()
    def bounded_and_nothing_lost(self) -> None:
        # Past MAX only when callers hold every slot at once (nothing in flight to wait for).
        assert len(self.made) <= max(self.MAX, self.peak_held)
        free, busy = self.ring.counts()
        assert free + busy + len(self.held) == len(self.made) == self.ring.created


TestStagingRing = RingMachine.TestCase


def test_full_ring_waits_for_the_oldest():
    made: list[pmod._Slot] = []

    def new() -> pmod._Slot:
        made.append(pmod._Slot(len(made), _FakeEvent()))
        return made[-1]

    ring = StagingRing(2, new)
    for _ in range(2):
        s = ring.acquire()
        s.event.record()
        ring.release(s)
    third = ring.acquire()
    assert third is made[0] and made[0].event.waits == 1 and made[1].event.waits == 0


@pytest.mark.gpu
def test_upload_lands_and_falls_back_on_gpu(device, gen):
    ha, hb = _host(512, torch.int32, gen, pin=True), _host(512, torch.bool, gen, pin=True)
    da = torch.full((512,), -1, dtype=torch.int32, device=device)
    db = (~hb).to(device)
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    torch.cuda.synchronize()
    ra, rb = copy_small_pinned_pair_ref(ha, hb, da, db)
    assert torch.equal(da, ra) and torch.equal(db, rb)
    # Fallbacks: pageable host, more than 4 KiB (4 KiB exactly still qualifies), non-contiguous destination.
    assert copy_small_pinned_pair(ha.clone(), hb, da, db) is False
    big = _host(MAX_PAIR_BYTES // 4 + 1, torch.int32, gen, pin=True)
    assert copy_small_pinned_pair(big, hb, torch.empty_like(big, device=device), db) is False
    edge = _host(MAX_PAIR_BYTES // 4, torch.int32, gen, pin=True)
    dedge = torch.empty_like(edge, device=device)
    assert copy_small_pinned_pair(edge, hb, dedge, db) is True
    strided = torch.empty(1024, dtype=torch.int32, device=device)[::2]
    assert copy_small_pinned_pair(ha, hb, strided, db) is False
    torch.cuda.synchronize()
    assert torch.equal(dedge.cpu(), edge)


@pytest.mark.gpu
def test_back_to_back_uploads_keep_their_own_values(device, gen):
    # The reference review's case: the first upload is still pending when the host buffers are refilled and a
    # second upload is submitted. Each result is captured by a stream-ordered clone, compared after one sync.
    ha, hb = _host(512, torch.int32, gen, pin=True), _host(512, torch.bool, gen, pin=True)
    da = torch.empty(512, dtype=torch.int32, device=device)
    db = torch.empty(512, dtype=torch.bool, device=device)
    expected, captured = [], []
    torch.cuda._sleep(50_000_000)  # keep the stream busy (~tens of ms) so every upload below is still pending
    for _ in range(5):
        ha.copy_(_host(512, torch.int32, gen))
        hb.copy_(_host(512, torch.bool, gen))
        expected.append((ha.clone(), hb.clone()))
        assert copy_small_pinned_pair(ha, hb, da, db) is True
        captured.append((da.clone(), db.clone()))
    torch.cuda.synchronize()
    for (ea, eb), (ca, cb) in zip(expected, captured):
        assert torch.equal(ca.cpu(), ea) and torch.equal(cb.cpu(), eb)


@pytest.mark.gpu
def test_more_uploads_in_flight_than_ring_slots(device, gen):
    ha, hb = _host(100, torch.int32, gen, pin=True), _host(9, torch.uint8, gen, pin=True)
    da = torch.empty(100, dtype=torch.int32, device=device)
    db = torch.empty(9, dtype=torch.uint8, device=device)
    expected, captured = [], []
    torch.cuda._sleep(10_000_000)
    for i in range(pmod._RING_SLOTS + 10):
        ha.fill_(i)
        hb.fill_(i % 251)
        assert copy_small_pinned_pair(ha, hb, da, db) is True
        expected.append(i)
        captured.append((da.clone(), db.clone()))
    torch.cuda.synchronize()
    for i, (ca, cb) in zip(expected, captured):
        assert bool((ca == i).all()) and bool((cb == i % 251).all())


class _FakeStream:
    cuda_stream = 0


@pytest.fixture
def staged_on_cpu(monkeypatch):
    """The kernel path end to end on a CPU machine: CUDA queries faked, pinned memory stood in by host memory,
    events pending until the test completes them; the kernel itself runs in the interpreter."""
    if HAS_GPU:
        pytest.skip("the real path runs on the GPU (test_back_to_back_uploads_keep_their_own_values)")
    events: list[_FakeEvent] = []

    def new_event() -> _FakeEvent:
        events.append(_FakeEvent())
        return events[-1]

    monkeypatch.setattr(pmod, "interpreting", lambda: False)
    monkeypatch.setattr(pmod, "_kernel_path_applies", lambda host, dev: True)
    monkeypatch.setattr(pmod, "_pinned_bytes", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(pmod, "_STAGING", {})
    monkeypatch.setattr(pmod, "_PLANS", pmod.PlanCache())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", new_event)
    return events


def test_staged_uploads_snapshot_into_distinct_slots_while_in_flight(staged_on_cpu, gen):
    events = staged_on_cpu
    ha, hb = _host(512, torch.int32, gen), _host(509, torch.bool, gen)  # b: bytes, not whole words
    da = torch.empty(512, dtype=torch.int32)
    db = torch.empty(509, dtype=torch.bool)
    plans = []
    for i in range(pmod._RING_SLOTS):
        ha.copy_(_host(512, torch.int32, gen))
        hb.copy_(_host(509, torch.bool, gen))
        assert copy_small_pinned_pair(ha, hb, da, db) is True
        assert torch.equal(da, ha) and torch.equal(db, hb)  # the interpreter runs the kernel at once
        plans.append(len(pmod._PLANS))
        # Every upload so far is still in flight (its event pending): each took a slot of its own, whose
        # snapshot still holds that upload's values.
        staging = pmod._STAGING[0]
        assert staging.ring.created == i + 1 and len(events) == i + 1
        slab = staging.slab[i * pmod._SLOT_BYTES :]
        assert torch.equal(slab[: 512 * 4].view(torch.int32), ha)
        assert torch.equal(slab[pmod.MAX_PAIR_BYTES : pmod.MAX_PAIR_BYTES + 509].view(torch.bool), hb)
    assert plans == [1] * len(plans)  # one checked plan, reused
    assert all(e.pending and e.waits == 0 for e in events)
    # The ring is full: the next upload waits for the oldest and reuses its slot (no new pinned memory).
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    assert events[0].waits == 1 and pmod._STAGING[0].ring.created == pmod._RING_SLOTS
    # Completed uploads free their slots without waiting.
    for e in events:
        e.pending = False
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    assert sum(e.waits for e in events) == 1


def test_staged_path_rechecks_changed_buffers(staged_on_cpu, gen):
    ha, hb = _host(64, torch.int32, gen), _host(64, torch.uint8, gen)
    da, db = torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=torch.uint8)
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    assert torch.equal(da, ha) and torch.equal(db, hb)
    with pytest.raises(ValueError, match="dev_b"):
        copy_small_pinned_pair(ha, hb, da, db[:-1])
    with pytest.raises(TypeError, match="dev_a"):
        copy_small_pinned_pair(ha, hb, da.view(torch.float32), db)
    db.resize_(63)  # same tensor and address, one element fewer
    with pytest.raises(ValueError, match="dev_b"):
        copy_small_pinned_pair(ha, hb, da, db)
    # An empty pair needs no launch but still reports the kernel path.
    e = torch.empty(0, dtype=torch.int32)
    assert copy_small_pinned_pair(e, e[:0], e.clone(), e.clone()) is True


def _wide_int64(n: int, sign: int, gen: torch.Generator) -> torch.Tensor:
    """int64 values whose magnitude lies in [2**32, 2**62): a copy through 32-bit values would lose them."""
    return sign * torch.randint(2**32, 2**62, (n,), generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("sign", [1, -1], ids=["above+2^32", "below-2^32"])
@pytest.mark.parametrize("n_a", [1, 3, 512])  # odd counts: the int64 table is still whole int32 words
def test_int64_values_beyond_32_bits_are_copied_exactly(sign, n_a, device, gen):
    # The kernel copies words; an int64 table's high word must land beside its low word, for large positive
    # and large negative values alike (the other tests keep values within +-2**15).
    ha = _wide_int64(n_a, sign, gen)
    hb = _wide_int64(5, -sign, gen)
    da = poison(torch.empty(n_a, dtype=torch.int64, device=device))
    db = poison(torch.empty(5, dtype=torch.int64, device=device))
    pmod._launch_pair(ha.to(device), da, hb.to(device), db)
    ra, rb = copy_small_pinned_pair_ref(ha, hb, da, db)
    assert torch.equal(da.cpu(), ha) and torch.equal(db.cpu(), hb)
    assert torch.equal(da, ra) and torch.equal(db, rb)


@pytest.mark.parametrize("sign", [1, -1], ids=["above+2^32", "below-2^32"])
def test_staged_upload_of_int64_values_beyond_32_bits(sign, staged_on_cpu, gen):
    # The whole staged path (snapshot into the ring slot, word views, the kernel) with int64 tables.
    ha, hb = _wide_int64(257, sign, gen), _wide_int64(3, -sign, gen)
    da, db = torch.empty(257, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    assert torch.equal(da, ha) and torch.equal(db, hb)
    ha.copy_(_wide_int64(257, -sign, gen))  # the next step's table, the other sign
    assert copy_small_pinned_pair(ha, hb, da, db) is True
    assert torch.equal(da, ha) and torch.equal(db, hb)
