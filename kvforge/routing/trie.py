"""Prefix indexes over block keys: what the router remembers, and what each server has cached.

Block keys are chained (a key covers every token before it), so a trie over them is a flat dict from key to
node, and the longest match of a prompt is its longest leading run of keys present in the dict. Keys are ints
or 16-byte ``bytes`` (checked by the router's callers); nothing here relies on the chaining for consistency.

- :class:`BlockTrie` holds the prompts of the conversations in the router's session table, with per block the
  number of prompt positions that hold it (how *specific* a prefix is) and the integer handle and server of
  the latest session to add it.
- :class:`ServerPrefixIndex` holds, per server, the set of blocks it can reuse: exact when fed by the server's
  own KV-cache events, or an LRU-bounded guess built from the router's own placements (as SGLang's
  cache-aware router does).

Both store only ints and keys (no per-block objects), so with millions of blocks they give the cyclic garbage
collector nothing to traverse. Neither is thread-safe; :class:`~kvforge.routing.ConversationRouter` locks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

__all__ = ["BlockTrie", "ServerPrefixIndex", "TrieNode"]

_FIELD = 32  # bits of refs and of server in a packed node
_MASK = (1 << _FIELD) - 1
_RECENT_CAP = 4096  # recent additions folded in by add itself beyond this many keys
_NO_MATCH = (0, 0, 0, 0)


class TrieNode(NamedTuple):
    """One block: how many session positions hold it, the handle of the latest session to add it, its server."""

    refs: int
    owner: int
    server: int


class BlockTrie:
    """Reference-counted blocks of the prompts the router remembers.

    A node is one int, ``refs | server << 32 | owner << 64``: a dict of ints is never tracked by the cyclic
    garbage collector, whatever its size, so a million blocks cost no collection time. ``owner`` is an integer
    session handle (the router maps handles to sessions); ``server`` an index below 2**32.

    The node dict is large and its slots are cold, so updates go through two cheap layers that :meth:`drain`
    folds in off the caller's hot path: :meth:`add` counts into a small dict of recent additions (the latest
    tag and the references added per key), and :meth:`remove_deferred` queues a prompt for removal (its keys are
    counted only if something reads the trie before they are drained). Every read combines the node, its recent
    additions and its queued removals, so every method answers exactly as if each update had been applied at
    once; :meth:`remove` folds the additions in first.
    """

    def __init__(self) -> None:
        self._nodes: dict[Hashable, int] = {}
        # Additions not yet in ``_nodes``: per key, the latest tag | the references added (a node's layout).
        self._recent: dict[Hashable, int] = {}
        # Queued removals: the keys in queue order (``_queue[0][_done:]`` first) and their total; per key, how
        # many references are still to come off (None until a read needs it).
        self._queue: deque[tuple[Hashable, ...]] = deque()
        self._done = 0
        self._queued = 0
        self._pending: Counter[Hashable] | None = None

    def __len__(self) -> int:
        self._fold()
        pending = self._pending_counts()
        if pending is None:
            return len(self._nodes)
        nodes = self._nodes
        return len(nodes) - sum(1 for k, n in pending.items() if nodes[k] & _MASK == n)

    @property
    def deferred(self) -> bool:
        """Whether :meth:`drain` has work: additions to fold in or removals to take off."""
        return bool(self._queued or self._recent)

    def _fold(self) -> None:
        """Fold the recent additions into the node dict (the cold lookups :meth:`add` deferred)."""
        recent = self._recent
        if not recent:
            return
        nodes = self._nodes
        get = nodes.get
        for k, a in recent.items():
            v = get(k)
            nodes[k] = a if v is None else (a & ~_MASK) | ((v & _MASK) + (a & _MASK))
        recent.clear()

    @property
    def pending_removals(self) -> int:
        """References queued by :meth:`remove_deferred` that :meth:`drain` has not taken off yet."""
        return self._queued

    def _pending_counts(self) -> Counter[Hashable] | None:
        """Per key, its queued references (None when nothing is queued); counted on the first read."""
        if not self._queued:
            return None
        pending = self._pending
        if pending is None:
            pending = Counter(self._queue[0][self._done :])
            for i in range(1, len(self._queue)):
                pending.update(self._queue[i])
            self._pending = pending
        return pending

    def _live(self, key: Hashable) -> int | None:
        """``key``'s node with its recent additions, less its queued references; None when none is left.

        The queued keys must have been counted (:meth:`_pending_counts`) if any are queued.
        """
        v = self._nodes.get(key)
        a = self._recent.get(key)
        if a is not None:
            v = a if v is None else (a & ~_MASK) | ((v & _MASK) + (a & _MASK))
        if v is None or self._pending is None:
            return v
        n = self._pending.get(key)
        if n is None:
            return v
        return v - n if v & _MASK > n else None

    def _held(self, key: Hashable) -> bool:
        """Whether ``key`` is held once deferred updates count (:meth:`_live`'s precondition applies)."""
        return self._live(key) is not None

    def match(self, keys: Sequence[Hashable]) -> int:
        """Number of leading blocks of ``keys`` the trie holds.

        Exact for prefix-chained keys, where the held blocks of a prompt are always a leading run: the search
        tries the whole prompt and all but its last block first (a conversation's next turn), then bisects.
        For keys that are not chained it returns some ``m`` with ``keys[m - 1]`` held and ``keys[m]`` not.
        """
        n = len(keys)
        held: Callable[[Hashable], bool]
        if self._queued or self._recent:
            self._pending_counts()
            held = self._held
            if n == 0 or not held(keys[0]):
                return 0
        else:
            nodes = self._nodes
            if n == 0 or keys[0] not in nodes:  # (a new conversation: one lookup, nothing else)
                return 0
            held = nodes.__contains__
        if held(keys[n - 1]):
            return n
        if n == 2 or held(keys[n - 2]):
            return n - 1
        lo, hi = 1, n - 2  # keys[lo - 1] held, keys[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if held(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def match_fields(self, keys: Sequence[Hashable]) -> tuple[int, int, int, int]:
        """``(matched, refs, owner, server)``: :meth:`match`, and :meth:`fields` of the last matched block
        (zeros when nothing matches), in one call (the router's hot path)."""
        if self._queued or self._recent:
            m = self.match(keys)
            if not m:
                return _NO_MATCH
            f = self.fields(keys[m - 1])
            assert f is not None
            return (m, *f)
        # Nothing deferred: the node dict alone answers (the same search as match's).
        nodes = self._nodes
        n = len(keys)
        if n == 0 or keys[0] not in nodes:  # (a new conversation: one lookup, nothing else)
            return _NO_MATCH
        v = nodes.get(keys[n - 1])
        if v is not None:
            m = n
        elif n == 2:
            m = 1
            v = nodes[keys[0]]
        else:
            v = nodes.get(keys[n - 2])
            if v is not None:
                m = n - 1
            else:
                lo, hi = 1, n - 2  # keys[lo - 1] held, keys[hi] not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if keys[mid] in nodes:
                        lo = mid + 1
                    else:
                        hi = mid
                m = lo
                v = nodes[keys[m - 1]]
        return m, v & _MASK, v >> (2 * _FIELD), (v >> _FIELD) & _MASK

    def node(self, key: Hashable) -> TrieNode | None:
        if self._queued or self._recent:
            self._pending_counts()
            v = self._live(key)
        else:
            v = self._nodes.get(key)
        return None if v is None else TrieNode(v & _MASK, v >> (2 * _FIELD), (v >> _FIELD) & _MASK)

    def fields(self, key: Hashable) -> tuple[int, int, int] | None:
        """``(refs, owner, server)`` of ``key``'s node as a plain tuple (the hot path's :meth:`node`)."""
        if self._queued or self._recent:
            self._pending_counts()
            v = self._live(key)
        else:
            v = self._nodes.get(key)
        return None if v is None else (v & _MASK, v >> (2 * _FIELD), (v >> _FIELD) & _MASK)

    def refs(self, key: Hashable) -> int:
        """How many session positions hold ``key`` (0 when absent)."""
        self._pending_counts()
        v = self._live(key)
        return 0 if v is None else v & _MASK

    def add(self, keys: Iterable[Hashable], owner: int, server: int) -> None:
        """Take one reference per position on each block (creating it), making ``owner`` its latest session."""
        if type(owner) is not int or owner < 0:
            raise ValueError(f"owner: expected a non-negative int session handle, got {owner!r}")
        if type(server) is not int or not 0 <= server <= _MASK:
            raise ValueError(f"server: expected a server index in [0, 2**32), got {server!r}")
        self._add(keys if type(keys) is tuple else tuple(keys), owner, server)

    def _add(self, keys: tuple[Hashable, ...], owner: int, server: int) -> None:
        """:meth:`add` with ``owner`` and ``server`` already checked (the router's path)."""
        recent = self._recent
        tag = (owner << (2 * _FIELD)) | (server << _FIELD)
        first = tag | 1
        # (Combined with its node on every read and folded in by drain; a node whose references are all queued
        # for removal is logically absent, and adding to it gives the fields of a fresh node.)
        if not recent:
            # Nothing pending (finishes fold the additions in): the keys become the dict of recent additions
            # themselves, built at C speed; a key listed more than once takes one reference per position.
            recent = self._recent = dict.fromkeys(keys, first)
            if len(recent) != len(keys):
                for k, n in Counter(keys).items():
                    if n > 1:
                        recent[k] = tag | n
        elif len(keys) > 2 and recent.keys().isdisjoint(keys):
            # None of them recently added (a new conversation): one reference each, stored at C speed; a key
            # listed more than once takes one reference per position.
            before = len(recent)
            recent.update(dict.fromkeys(keys, first))
            if len(recent) - before != len(keys):
                for k, n in Counter(keys).items():
                    if n > 1:
                        recent[k] = tag | n
        else:
            get = recent.get
            for k in keys:
                v = get(k)
                recent[k] = first if v is None else tag | ((v & _MASK) + 1)
        if len(recent) > _RECENT_CAP:
            self._fold()

    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop one reference per position on each block; a block nobody holds any more leaves the trie.

        Raises KeyError, with the trie unchanged, if some key is held fewer times than ``keys`` lists it.
        """
        self._fold()
        nodes = self._nodes
        pending = self._pending_counts()
        if len(keys) == 1 and pending is None:
            v = nodes.get(keys[0])
            if v is None:
                raise KeyError(f"block {keys[0]!r} is not in the trie (removed more often than added)")
            if v & _MASK == 1:
                del nodes[keys[0]]
            else:
                nodes[keys[0]] = v - 1
            return
        distinct = set(keys)
        if len(distinct) == len(keys) and pending is None:
            if not nodes.keys() >= distinct:  # every key present once is enough (checked at C speed)
                bad = next(k for k in keys if k not in nodes)
                raise KeyError(f"block {bad!r} is not in the trie (removed more often than added)")
        else:
            need: dict[Hashable, int] = {}
            for k in keys:
                need[k] = need.get(k, 0) + 1
            for k, n in need.items():
                if self.refs(k) < n:
                    raise KeyError(f"block {k!r} is not in the trie {n} times (removed more often than added)")
        for k in keys:
            # A queued reference keeps its node until drained (stored refs never drop below the queued ones).
            v = nodes[k]
            if v & _MASK == 1:
                del nodes[k]
            else:
                nodes[k] = v - 1

    def remove_deferred(self, keys: Sequence[Hashable]) -> None:
        """:meth:`remove`, with the dict work queued for :meth:`drain`; every answer changes at once.

        ``keys`` must be held as often as listed (a session's own prompt, which the caller added and has not
        removed since): that is not checked here, since checking costs the lookups this defers. O(1) until
        the trie is read with removals still queued (then one hash per queued key, once).
        """
        t = keys if type(keys) is tuple else tuple(keys)  # the queue keeps it: a caller's list may change
        if not t:
            return
        self._queue.append(t)
        self._queued += len(t)
        if self._pending is not None:
            self._pending.update(t)

    def drain(self, budget: int | None = None) -> int:
        """Fold the recent additions in, then take off up to ``budget`` queued references (all with None),
        oldest first; returns how many references were taken off."""
        if budget is not None and (type(budget) is not int or budget < 0):
            raise ValueError(f"budget: expected an int >= 0 or None, got {budget!r}")
        self._fold()
        left = self._queued if budget is None else min(budget, self._queued)
        taken = left
        nodes = self._nodes
        pending = self._pending
        queue = self._queue
        while left > 0:
            keys = queue[0]
            start = self._done
            stop = min(len(keys), start + left)
            for i in range(start, stop):
                k = keys[i]
                if pending is not None:
                    n = pending[k]
                    if n == 1:
                        del pending[k]
                    else:
                        pending[k] = n - 1
                v = nodes[k]
                if v & _MASK == 1:
                    del nodes[k]
                else:
                    nodes[k] = v - 1
            left -= stop - start
            if stop == len(keys):
                queue.popleft()
                self._done = 0
            else:
                self._done = stop
        self._queued -= taken
        if not self._queued:
            self._pending = None
        return taken

    def sanity_check(self) -> None:
        """Raise AssertionError if the removal queue disagrees with the nodes (for tests; O(queue))."""
        left: Counter[Hashable] = Counter()
        for i, keys in enumerate(self._queue):
            left.update(keys[self._done :] if i == 0 else keys)
        assert self._pending is None or left == self._pending, "queued keys and pending counts differ"
        assert self._queued == sum(left.values()), f"{self._queued} queued, {sum(left.values())} in the queue"
        assert (self._done == 0) if not self._queue else (0 <= self._done < len(self._queue[0]))
        assert self._queued or self._pending is None, "counts kept for an empty queue"
        for k, n in left.items():
            held = (self._nodes.get(k, 0) & _MASK) + (self._recent.get(k, 0) & _MASK)
            assert held >= n, f"block {k!r}: {n} removals queued, fewer references"
        assert all(a & _MASK > 0 for a in self._recent.values()), "a recent addition of no reference"


class ServerPrefixIndex:
    """Which blocks each server can reuse, as one bitmask of servers per block key.

    ``capacity_blocks=None``: the index is what events say (store / remove / clear), nothing more.
    ``capacity_blocks=N``: each server's set is an LRU of N blocks refreshed by ``store`` (an approximation
    of a server's cache for a router that receives no events).
    """

    def __init__(self, num_servers: int, capacity_blocks: int | None = None) -> None:
        if not isinstance(num_servers, int) or isinstance(num_servers, bool) or num_servers <= 0:
            raise ValueError(f"num_servers: expected a positive int, got {num_servers!r}")
        if capacity_blocks is not None and (
            not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks <= 0
        ):
            raise ValueError(f"capacity_blocks: expected a positive int or None, got {capacity_blocks!r}")
        self.num_servers = num_servers
        self.capacity_blocks = capacity_blocks
        self._mask: dict[Hashable, int] = {}
        # A plain dict of atoms is never tracked by the cyclic GC; an OrderedDict always is (and a full
        # collection walks every key), so the LRU order is kept only when there is a capacity to enforce.
        self._blocks: list[dict[Hashable, None]] = [
            {} if capacity_blocks is None else OrderedDict() for _ in range(num_servers)
        ]
        self._all = (1 << num_servers) - 1

    def add_server(self) -> int:
        """Append a server index holding nothing and return it."""
        self._blocks.append({} if self.capacity_blocks is None else OrderedDict())
        self.num_servers += 1
        self._all = (1 << self.num_servers) - 1
        return self.num_servers - 1

    def _held(self, server: int) -> dict[Hashable, None]:
        if type(server) is not int or not 0 <= server < self.num_servers:
            raise ValueError(f"server: expected a server index in [0, {self.num_servers}), got {server!r}")
        return self._blocks[server]

    def blocks(self, server: int) -> int:
        """Number of blocks server index ``server`` holds."""
        return len(self._held(server))

    def contains(self, server: int, key: Hashable) -> bool:
        return key in self._held(server)

    def store(self, server: int, keys: Iterable[Hashable]) -> None:
        held = self._held(server)
        mask = self._mask
        bit = 1 << server
        cap = self.capacity_blocks
        if cap is None:
            for h in keys:
                if h not in held:
                    held[h] = None
                    mask[h] = mask.get(h, 0) | bit
            return
        assert isinstance(held, OrderedDict)
        for h in keys:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                mask[h] = mask.get(h, 0) | bit
        while len(held) > cap:
            old, _ = held.popitem(last=False)
            self._clear_bit(old, bit)

    def remove(self, server: int, keys: Iterable[Hashable]) -> None:
        held = self._held(server)
        bit = 1 << server
        for h in keys:
            if h in held:
                del held[h]
                self._clear_bit(h, bit)

    def clear(self, server: int) -> None:
        held = self._held(server)
        bit = 1 << server
        for h in held:
            self._clear_bit(h, bit)
        held.clear()

    def _clear_bit(self, h: Hashable, bit: int) -> None:
        m = self._mask[h] & ~bit
        if m:
            self._mask[h] = m
        else:
            del self._mask[h]

    def held_lengths(self, keys: Sequence[Hashable], ignore: int = 0) -> list[int] | None:
        """:meth:`match_lengths`, or None when no server outside ``ignore`` holds the first block (every length
        0): one lookup for a prompt no other server caches, without building the list."""
        if not keys or not self._mask.get(keys[0], 0) & ~ignore & self._all:
            return None
        return self.match_lengths(keys, ignore)

    def match_lengths(self, keys: Sequence[Hashable], ignore: int = 0) -> list[int]:
        """Per server, the number of leading blocks of ``keys`` it holds (one pass for all servers).

        ``ignore``: a bitmask of server indexes whose lengths the caller does not need; they read 0 (a lower
        bound), and the pass stops as soon as no other server still matches (exact for the others).
        """
        lengths = [0] * self.num_servers
        get = self._mask.get
        alive = self._all & ~ignore
        i = 0
        for h in keys:
            still = get(h, 0) & alive
            if still != alive:
                if i:  # (servers dropped at the first block keep their 0)
                    dropped = alive & ~still
                    while dropped:
                        low = dropped & -dropped
                        lengths[low.bit_length() - 1] = i
                        dropped ^= low
                if not still:
                    return lengths
                alive = still
            i += 1
        while alive:
            low = alive & -alive
            lengths[low.bit_length() - 1] = i
            alive ^= low
        return lengths
