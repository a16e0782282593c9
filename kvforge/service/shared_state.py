"""Fixed-size shared memory for ``kvforge router --workers N``: conversation owners and per-backend load.

One ``multiprocessing.shared_memory`` block of little-endian int64 words, created by the supervising parent
(:meth:`SharedState.create`) and attached by each worker (:meth:`SharedState.attach`):

- a header (magic, layout version, sizes, a random seed for conversation keys, counters);
- a backend table: a slot per backend URL ever seen (``max_backends``), claimed under the lock;
- the load table: one row per worker, ``[requests, tokens]`` in flight per backend slot. Each worker writes only
  its own row (a single writer: no lock); readers sum the rows. The parent zeroes a dead worker's row after it
  has reaped it (:meth:`clear_worker`), so a killed worker's load never outlives it;
- the conversation map: ``conversations`` entries ``[key, backend slot, last use (monotonic ns), 0]`` (keys of
  conversation ids, and of the last block of anonymous prompts: :meth:`block_key`), open
  addressing over a window of ``PROBE`` entries from the key's home. Lookups take no lock (a reader re-reads the
  key after the slot and retries if it changed). Inserts hold the lock; a key not in its window takes an empty
  entry, else evicts the least recently used entry of the window (the bounded-memory rule: a conversation idle
  longest among its 8 neighbours loses its owner and is placed afresh on its next request).

The lock is ``fcntl.flock`` on a lock file, which the kernel releases when its holder dies (a killed worker
cannot leave it held). Aligned 8-byte stores are single instructions on the platforms this runs on, so a
reader never sees half a word. Bad sizes raise ``ValueError``; a block of another layout raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from multiprocessing import shared_memory

import xxhash

__all__ = ["PROBE", "SharedState", "SharedTableFull", "max_workers"]

_MAGIC = 0x6B7666726F757431  # "kvfrout1"
_VERSION = 1
PROBE = 8  # conversation entries searched from a key's home entry
_HEADER_WORDS = 16
# Header word indices.
_H_MAGIC, _H_VERSION, _H_WORKERS, _H_BACKENDS, _H_CONVS, _H_SEED = 0, 1, 2, 3, 4, 5
_H_INSERTS, _H_EVICTIONS, _H_MOVES, _H_USED = 6, 7, 8, 9
_CONV_WORDS = 4
_REFRESH_NS = 1_000_000_000  # a hit refreshes an entry's last use at most once a second (fewer shared writes)
_KEY_MASK = (1 << 128) - 1
_BLOCK_DOMAIN = 0x5A5A_0B10_C4E9_0000  # block keys and conversation ids never share a map key by construction
_MAX_WORKERS = 1024
_MAX_BACKENDS = 4096
_MAX_CONVS = 1 << 24


def max_workers() -> int:
    """The most router workers accepted: 4 per core (at least 4); more only adds context switches."""
    return min(_MAX_WORKERS, max(4, 4 * (os.cpu_count() or 1)))


class SharedTableFull(ValueError):
    """Every backend slot is taken (URLs are never released while the router runs)."""


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


class SharedState:
    """A view of the shared block; see the module docstring for the layout and the rules."""

    def __init__(self, shm: shared_memory.SharedMemory, lock_path: str, *, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        self.lock_path = lock_path
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        w = shm.buf.cast("q")
        self._w = w
        if w[_H_MAGIC] != _MAGIC or w[_H_VERSION] != _VERSION:
            self.close()
            raise ValueError(f"shared state {shm.name!r}: not a kvforge router block of layout {_VERSION}")
        self.workers = int(w[_H_WORKERS])
        self.max_backends = int(w[_H_BACKENDS])
        self.conversations = int(w[_H_CONVS])
        self._seed = int(w[_H_SEED]) & ((1 << 63) - 1)
        self._mask = self.conversations - 1
        self._backends_at = _HEADER_WORDS
        self._load_at = self._backends_at + self.max_backends
        self._row_words = 2 * self.max_backends
        self._conv_at = self._load_at + self.workers * self._row_words

    # ---------------------------------------------------------------- lifecycle

    @staticmethod
    def _words(workers: int, max_backends: int, conversations: int) -> int:
        return _HEADER_WORDS + max_backends + workers * 2 * max_backends + conversations * _CONV_WORDS

    @classmethod
    def create(
        cls, workers: int, lock_path: str, *, max_backends: int = 256, conversations: int = 1 << 17
    ) -> SharedState:
        """A new zeroed block (the parent's). ``conversations`` is a power of two >= ``PROBE``."""
        for name, v, lo, hi in (
            ("workers", workers, 1, _MAX_WORKERS),
            ("max_backends", max_backends, 1, _MAX_BACKENDS),
            ("conversations", conversations, PROBE, _MAX_CONVS),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{name}: expected an int in {lo}..{hi}, got {v!r}")
        if conversations & (conversations - 1):
            raise ValueError(f"conversations: expected a power of two, got {conversations}")
        shm = shared_memory.SharedMemory(create=True, size=8 * cls._words(workers, max_backends, conversations))
        w = shm.buf.cast("q")
        w[_H_VERSION] = _VERSION
        w[_H_WORKERS] = workers
        w[_H_BACKENDS] = max_backends
        w[_H_CONVS] = conversations
        w[_H_SEED] = secrets.randbits(63)  # conversation keys an outsider cannot aim at one window
        w[_H_MAGIC] = _MAGIC
        w.release()
        return cls(shm, lock_path, owner=True)

    @classmethod
    def attach(cls, name: str, lock_path: str) -> SharedState:
        """The block the parent created (a worker's view)."""
        return cls(shared_memory.SharedMemory(name=name), lock_path, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        """Detach; the owner also removes the block and the lock file."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._w.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)

    def _lock(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # ---------------------------------------------------------------- backends

    def backend_slot(self, url: str) -> int:
        """The slot of ``url`` (claimed on first use; the same in every worker). Raises SharedTableFull."""
        h = _signed(xxhash.xxh3_64_intdigest(url.encode(), 0) or 1)
        w, at = self._w, self._backends_at
        for s in range(self.max_backends):  # (no lock: slots are only ever claimed, never released)
            if w[at + s] == h:
                return s
        self._lock()
        try:
            for s in range(self.max_backends):
                v = w[at + s]
                if v == h:
                    return s
                if v == 0:
                    w[at + s] = h
                    return s
        finally:
            self._unlock()
        raise SharedTableFull(f"the shared backend table is full ({self.max_backends} URLs since start)")

    # ---------------------------------------------------------------- load

    def add_load(self, worker: int, slot: int, requests: int, tokens: int) -> None:
        """Add to ``worker``'s own row (only that worker may call this for its index)."""
        # (An index out of range would write another worker's row or the conversation map, not fail.)
        if not (0 <= worker < self.workers and 0 <= slot < self.max_backends):
            raise ValueError(
                f"worker, slot: expected 0..{self.workers - 1} and 0..{self.max_backends - 1}, got {worker!r}, {slot!r}"
            )
        i = self._load_at + worker * self._row_words + 2 * slot
        w = self._w
        w[i] += requests
        w[i + 1] += tokens

    def load(self, slot: int) -> tuple[int, int]:
        """``(requests, tokens)`` in flight on backend ``slot``, summed over every worker."""
        w = self._w
        i = self._load_at + 2 * slot
        step = self._row_words
        r = t = 0
        for _ in range(self.workers):
            r += w[i]
            t += w[i + 1]
            i += step
        return r, t

    def tokens(self, slot: int) -> int:
        w = self._w
        i = self._load_at + 2 * slot + 1
        step = self._row_words
        t = 0
        for _ in range(self.workers):
            t += w[i]
            i += step
        return t

    def worker_load(self, worker: int, slot: int) -> tuple[int, int]:
        i = self._load_at + worker * self._row_words + 2 * slot
        return self._w[i], self._w[i + 1]

    def clear_worker(self, worker: int) -> None:
        """Zero a worker's row: the parent, after reaping it (no writer is left)."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker: expected 0..{self.workers - 1}, got {worker!r}")
        i = self._load_at + worker * self._row_words
        self._w[i : i + self._row_words] = memoryview(bytes(8 * self._row_words)).cast("q")

    # ---------------------------------------------------------------- conversations

    def conversation_key(self, conversation_id: str) -> int:
        """The map key of a conversation id (seeded per router; never 0, which marks an empty entry)."""
        return _signed(xxhash.xxh3_64_intdigest(conversation_id.encode("utf-8", "surrogatepass"), self._seed) or 1)

    def block_key(self, block_key: int) -> int:
        """The map key of a prompt's block key (a 128-bit int; workers must share the block-key salt)."""
        h = xxhash.xxh3_64_intdigest((block_key & _KEY_MASK).to_bytes(16, "little"), self._seed ^ _BLOCK_DOMAIN)
        return _signed(h or 1)

    def owner(self, key: int) -> int:
        """The backend slot owning ``key``, or -1 when the map does not hold it. Takes no lock."""
        w = self._w
        at = self._conv_at
        mask = self._mask
        i = key & mask
        for _ in range(PROBE):
            j = at + 4 * i
            if w[j] == key:
                slot = w[j + 1]
                if w[j] == key:  # not evicted while the slot was read
                    now = time.monotonic_ns()
                    if now - w[j + 2] > _REFRESH_NS:
                        w[j + 2] = now  # (a race with an eviction only misorders the LRU; never the owner)
                    return slot
                return self.owner(key)
            i = (i + 1) & mask
        return -1

    def claim(self, key: int, slot: int, expect: int = -1) -> int:
        """Make ``slot`` the owner of ``key`` unless another owner than ``expect`` is there; return the owner.

        ``expect=-1``: insert only if absent (the first worker to place a new conversation wins); ``expect=s``:
        replace owner ``s`` (a worker moving a conversation off a backend it found out of rotation); an owner
        other than ``expect`` found under the lock is returned unchanged (another worker decided first).
        """
        if not 0 <= slot < self.max_backends:
            raise ValueError(f"slot: expected 0..{self.max_backends - 1}, got {slot!r}")
        if key == 0 or not -(1 << 63) <= key < 1 << 63:  # 0 marks an empty entry
            raise ValueError(f"key: expected a nonzero int64 (conversation_key, block_key), got {key!r}")
        w = self._w
        at = self._conv_at
        mask = self._mask
        home = key & mask
        self._lock()
        try:
            empty = oldest = -1
            oldest_t = 0
            i = home
            for _ in range(PROBE):
                j = at + 4 * i
                k = w[j]
                if k == key:
                    cur = w[j + 1]
                    if cur != expect or cur == slot:
                        return cur
                    w[j + 1] = slot
                    w[j + 2] = time.monotonic_ns()
                    w[_H_MOVES] += 1
                    return slot
                if k == 0:
                    if empty < 0:
                        empty = j
                elif oldest < 0 or w[j + 2] < oldest_t:
                    oldest, oldest_t = j, w[j + 2]
                i = (i + 1) & mask
            j = empty
            if j < 0:
                j = oldest
                w[_H_EVICTIONS] += 1
            else:
                w[_H_USED] += 1
            w[j] = 0  # readers of the old key see it gone before the new slot appears
            w[j + 1] = slot
            w[j + 2] = time.monotonic_ns()
            w[j] = key
            w[_H_INSERTS] += 1
            return slot
        finally:
            self._unlock()

    def stats(self) -> dict[str, int]:
        """Conversation-map counters: inserts, evictions (an owner forgotten to make room), moves."""
        w = self._w
        return {
            "conversations": self.conversations,
            "used": int(w[_H_USED]),
            "inserts": int(w[_H_INSERTS]),
            "evictions": int(w[_H_EVICTIONS]),
            "moves": int(w[_H_MOVES]),
        }
