"""Prefix indexes over chained block hashes: what the router remembers, and what each server has cached.

Because a block hash covers every token before it, the hash at depth ``i`` names the whole path from the root:
a trie over chained hashes is a flat dict from hash to node, and the longest match of a prompt is its longest
leading run of hashes present in the dict.

- :class:`BlockTrie` holds the prompts of the conversations in the router's session table, with per block the
  number of conversations that contain it (how *specific* a prefix is) and the key of the latest one to add it.
- :class:`ServerPrefixIndex` holds, per server, the set of blocks it can reuse: exact when fed by the server's
  own KV-cache events, or an LRU-bounded guess built from the router's own placements (as SGLang's
  cache-aware router does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

__all__ = ["BlockTrie", "ServerPrefixIndex", "TrieNode"]


class TrieNode(NamedTuple):
    """One block: how many sessions contain it, the key of the latest session to add it, and its server then."""

    refs: int
    owner: Hashable
    server: int


class BlockTrie:
    """Reference-counted blocks of the prompts the router remembers.

    Nodes are stored as plain tuples of atoms (ints, str keys) rather than objects: the cyclic garbage
    collector stops tracking such tuples, and with a million blocks in the table a tracked node per block made
    full collections pause routing for tens of milliseconds.
    """

    def __init__(self) -> None:
        self._nodes: dict[int, tuple[int, Hashable, int]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` the trie holds."""
        nodes = self._nodes
        n = 0
        for h in hashes:
            if h not in nodes:
                break
            n += 1
        return n

    def node(self, block_hash: int) -> TrieNode | None:
        t = self._nodes.get(block_hash)
        return None if t is None else TrieNode._make(t)

    def add(self, hashes: Iterable[int], owner: Hashable, server: int) -> None:
        """Take one reference on each block (creating it), making ``owner`` its latest session."""
        nodes = self._nodes
        for h in hashes:
            t = nodes.get(h)
            nodes[h] = (1 if t is None else t[0] + 1, owner, server)

    def remove(self, hashes: Iterable[int]) -> None:
        """Drop one reference on each block; a block nobody holds any more leaves the trie."""
        nodes = self._nodes
        for h in hashes:
            t = nodes.get(h)
            if t is None:
                raise KeyError(f"block {h:#x} is not in the trie (removed more often than added)")
            if t[0] == 1:
                del nodes[h]
            else:
                nodes[h] = (t[0] - 1, t[1], t[2])


class ServerPrefixIndex:
    """Which blocks each server can reuse, as one bitmask of servers per block hash.

    ``capacity_blocks=None``: the index is what events say (store / remove / clear), nothing more.
    ``capacity_blocks=N``: each server's set is an LRU of N blocks refreshed by ``store`` (an approximation
    of a server's cache for a router that receives no events).
    """

    def __init__(self, num_servers: int, capacity_blocks: int | None = None) -> None:
        if not isinstance(num_servers, int) or num_servers <= 0:
            raise ValueError(f"num_servers: expected a positive int, got {num_servers!r}")
        if capacity_blocks is not None and (
            not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks <= 0
        ):
            raise ValueError(f"capacity_blocks: expected a positive int or None, got {capacity_blocks!r}")
        self.num_servers = num_servers
        self.capacity_blocks = capacity_blocks
        self._mask: dict[int, int] = {}
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_servers)]
        self._all = (1 << num_servers) - 1

    def blocks(self, server: int) -> int:
        """Number of blocks server index ``server`` holds."""
        return len(self._blocks[server])

    def contains(self, server: int, block_hash: int) -> bool:
        return block_hash in self._blocks[server]

    def store(self, server: int, hashes: Iterable[int]) -> None:
        held = self._blocks[server]
        mask = self._mask
        bit = 1 << server
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                mask[h] = mask.get(h, 0) | bit
        cap = self.capacity_blocks
        if cap is not None:
            while len(held) > cap:
                old, _ = held.popitem(last=False)
                self._clear_bit(old, bit)

    def remove(self, server: int, hashes: Iterable[int]) -> None:
        held = self._blocks[server]
        bit = 1 << server
        for h in hashes:
            if h in held:
                del held[h]
                self._clear_bit(h, bit)

    def clear(self, server: int) -> None:
        bit = 1 << server
        for h in self._blocks[server]:
            self._clear_bit(h, bit)
        self._blocks[server].clear()

    def _clear_bit(self, h: int, bit: int) -> None:
        m = self._mask[h] & ~bit
        if m:
            self._mask[h] = m
        else:
            del self._mask[h]

    def match_lengths(self, hashes: Sequence[int]) -> list[int]:
        """Per server, the number of leading blocks of ``hashes`` it holds (one pass for all servers)."""
        lengths = [0] * self.num_servers
        get = self._mask.get
        alive = self._all
        i = 0
        for h in hashes:
            still = get(h, 0) & alive
            dropped = alive & ~still
            while dropped:
                low = dropped & -dropped
                lengths[low.bit_length() - 1] = i
                dropped ^= low
            alive = still
            if not alive:
                return lengths
            i += 1
        while alive:
            low = alive & -alive
            lengths[low.bit_length() - 1] = i
            alive ^= low
        return lengths
