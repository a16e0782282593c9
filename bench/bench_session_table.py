"""The router's session table alone: an OrderedDict LRU against key-hash shards with a heap of shard heads.

    python bench/bench_session_table.py [--sessions 100000] [--ops 300000] [--shards 8 16 32] [--gc]

At 100,000 sessions CPython rebuilds the router's ``OrderedDict`` (hash table and node index) in one go when
inserts have used up its free slots, about once per 75,000-250,000 new conversations. The candidate splits the
table over ``S`` OrderedDicts by ``hash(key) & (S - 1)``, so a rebuild is 1/S as large, and keeps the exact
global LRU order with a stamp per entry (a counter at its insert or last touch) and a heap holding, per
non-empty shard, a lower bound of its head's stamp (checked, and refreshed, when it reaches the top).

The table is filled with ``--sessions`` str ids, then ``--ops`` operations drawn once (same for both): half
touch a random live session (read, rewrite, move to the end, as a known conversation's ``route``), half insert
a new int handle and evict the least recent (a new conversation's). Reported per table: max, p99.9, p99,
median and mean ns per operation (wall, gc off unless ``--gc``), how many operations took over 1 ms, bytes per
entry (tracemalloc over the fill, values included), and whether every evicted key and every read agreed with
the OrderedDict's (the run refuses to report a candidate that disagrees).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from heapq import heappop, heappush, heapreplace
from itertools import count
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GET, TOUCH, INSERT, UPDATE = 0, 1, 2, 3  # read only; read + rewrite + most recent; new key (+ evict); rewrite
Op = tuple[int, Hashable]
_ONLY_DRAWN = 40_000  # operations drawn in --only mode (about half of each kind)


def _zero() -> int:
    return 0


def drive_od(
    capacity: int,
    fill: Sequence[Hashable],
    ops: Sequence[Op],
    clock: Callable[[], int] = _zero,
    keep: list | None = None,
) -> tuple[list[object], list[int]]:
    """The router's table: returns the log (reads and evicted keys, in order) and ns per operation; ``keep``
    receives the table (for the memory count)."""
    d: OrderedDict[Hashable, tuple] = OrderedDict()
    d[-1] = ()  # (general keys from the start, as the router does)
    del d[-1]
    log: list[object] = []
    for i, k in enumerate(fill):
        d[k] = (i, 0)
        while len(d) > capacity:
            log.append(d.popitem(False)[0])
    times: list[int] = []
    for code, k in ops:
        t0 = clock()
        if code == INSERT:
            d[k] = (0, 0)
            while len(d) > capacity:
                log.append(d.popitem(False)[0])
        else:
            s = d.get(k)
            if code == GET:
                log.append(s)
            elif s is not None:
                d[k] = (s[0], s[1] + 1)
                if code == TOUCH:
                    d.move_to_end(k)
        times.append(clock() - t0)
    if keep is not None:
        keep.append(d)
        return log, times
    log.append(list(d))
    return log, times


def drive_sharded(
    capacity: int,
    fill: Sequence[Hashable],
    ops: Sequence[Op],
    shards: int,
    clock: Callable[[], int] = _zero,
    keep: list | None = None,
) -> tuple[list[object], list[int]]:
    """The candidate, written inline as the router would run it (a value's last field is its stamp)."""
    if shards < 1 or shards & (shards - 1):
        raise ValueError(f"shards: expected a power of two, got {shards!r}")
    mask = shards - 1
    table: list[OrderedDict[Hashable, tuple]] = [OrderedDict() for _ in range(shards)]
    for t in table:
        t[-1] = ()
        del t[-1]
    # Per non-empty shard, (a stamp <= its head's stamp, shard): exact at the top after the check below.
    heads: list[tuple[int, int]] = []
    tick = count()
    size = 0
    log: list[object] = []

    def evict() -> None:
        while True:
            stamp, si = heads[0]
            t = table[si]
            for hk in t:  # noqa: B007 (the head: a for loop costs less than next(iter(t)))
                break
            s = t[hk][-1]
            if s == stamp:  # the global least recent: every other head's stamp is at least its bound
                log.append(t.popitem(False)[0])
                if t:
                    for hk in t:  # noqa: B007
                        break
                    heapreplace(heads, (t[hk][-1], si))
                else:
                    heappop(heads)
                return
            heapreplace(heads, (s, si))  # its head was touched since: a tighter bound, try again

    def insert(k: Hashable, v: tuple) -> None:
        nonlocal size
        t = table[hash(k) & mask]
        if not t:
            heappush(heads, (v[-1], hash(k) & mask))
        t[k] = v
        size += 1
        while size > capacity:
            evict()
            size -= 1

    for i, k in enumerate(fill):
        insert(k, (i, 0, next(tick)))
    times: list[int] = []
    for code, k in ops:
        t0 = clock()
        if code == INSERT:  # (insert() and evict() inline: the loop times what the router would run)
            si = hash(k) & mask
            t = table[si]
            v = (0, 0, next(tick))
            if not t:
                heappush(heads, (v[-1], si))
            t[k] = v
            size += 1
            while size > capacity:
                while True:
                    stamp, si = heads[0]
                    t = table[si]
                    for hk in t:  # noqa: B007
                        break
                    s = t[hk][-1]
                    if s == stamp:
                        log.append(t.popitem(False)[0])
                        if t:
                            for hk in t:  # noqa: B007
                                break
                            heapreplace(heads, (t[hk][-1], si))
                        else:
                            heappop(heads)
                        break
                    heapreplace(heads, (s, si))
                size -= 1
        else:
            t = table[hash(k) & mask]
            s = t.get(k)
            if code == GET:
                log.append(None if s is None else s[:-1])
            elif s is not None:
                if code == TOUCH:
                    t[k] = (s[0], s[1] + 1, next(tick))
                    t.move_to_end(k)
                else:
                    t[k] = (s[0], s[1] + 1, s[2])
        times.append(clock() - t0)
    if keep is not None:
        keep += (table, heads)
        return log, times
    # The final order: merge the shards by stamp.
    log.append([k for _, k in sorted((v[-1], k) for t in table for k, v in t.items())])
    return log, times


def drive_sharded_heads(
    capacity: int,
    fill: Sequence[Hashable],
    ops: Sequence[Op],
    shards: int,
    clock: Callable[[], int] = _zero,
    keep: list | None = None,
) -> tuple[list[object], list[int]]:
    """The candidate with a list of exact head stamps instead of the heap: a touch of a shard's head refreshes
    its entry; an eviction takes the shard at the least head stamp (``min`` and ``list.index``, at C speed)."""
    if shards < 1 or shards & (shards - 1):
        raise ValueError(f"shards: expected a power of two, got {shards!r}")
    mask = shards - 1
    table: list[OrderedDict[Hashable, tuple]] = [OrderedDict() for _ in range(shards)]
    for t in table:
        t[-1] = ()
        del t[-1]
    inf = float("inf")
    head = [inf] * shards  # per shard, its least recent entry's stamp (inf: empty)
    tick = 0
    size = 0
    log: list[object] = []
    times: list[int] = []
    first = len(fill)
    for j, (code, k) in enumerate([(INSERT, k) for k in fill] + list(ops)):
        t0 = clock()
        if code == INSERT:
            si = hash(k) & mask
            t = table[si]
            if not t:
                head[si] = tick
            t[k] = (0, 0, tick) if j >= first else (j, 0, tick)
            tick += 1
            size += 1
            while size > capacity:
                si = head.index(min(head))
                t = table[si]
                log.append(t.popitem(False)[0])
                if t:
                    for hk in t:  # noqa: B007
                        break
                    head[si] = t[hk][-1]
                else:
                    head[si] = inf
                size -= 1
        else:
            si = hash(k) & mask
            t = table[si]
            s = t.get(k)
            if code == GET:
                log.append(None if s is None else s[:-1])
            elif s is not None:
                if code == TOUCH:
                    t[k] = (s[0], s[1] + 1, tick)
                    tick += 1
                    t.move_to_end(k)
                    if s[2] == head[si]:  # it was the shard's head: the next one is
                        for hk in t:  # noqa: B007
                            break
                        head[si] = t[hk][-1]
                else:
                    t[k] = (s[0], s[1] + 1, s[2])
        if j >= first:
            times.append(clock() - t0)
    if keep is not None:
        keep += (table, head)
        return log, times
    log.append([k for _, k in sorted((v[-1], k) for t in table for k, v in t.items())])
    return log, times


def drive_dict(
    capacity: int,
    fill: Sequence[Hashable],
    ops: Sequence[Op],
    clock: Callable[[], int] = _zero,
    keep: list | None = None,
) -> tuple[list[object], list[int]]:
    """Not an LRU: one plain dict doing the same inserts and deletions (each insert deletes the key the
    OrderedDict evicted, given in ``ops`` as ``(INSERT, key, evicted)``), i.e. the floor of any design that keeps
    all sessions in one dict: its rebuilds without the OrderedDict's node index."""
    d: dict[Hashable, tuple] = {-1: ()}
    del d[-1]
    for i, k in enumerate(fill):
        d[k] = (i, 0)
    times: list[int] = []
    for op in ops:
        code, k = op[0], op[1]
        t0 = clock()
        if code == INSERT:
            d[k] = (0, 0)
            del d[op[2]]  # type: ignore[misc]
        else:
            v = d.get(k)
            if v is not None:
                d[k] = (v[0], v[1] + 1)
        times.append(clock() - t0)
    if keep is not None:
        keep.append(d)
    return [], times


def make_ops(sessions: int, n: int, seed: int) -> tuple[list[str], list[Op]]:
    rng = random.Random(seed)
    fill = [f"c{i}" for i in range(sessions)]
    live = list(fill)  # a superset of the table's keys is enough: a touch of an evicted key reads None
    ops: list[Op] = []
    handle = 0
    for _ in range(n):
        if rng.random() < 0.5:
            ops.append((INSERT, handle))
            live[rng.randrange(sessions)] = handle
            handle += 1
        else:
            ops.append((TOUCH, live[rng.randrange(sessions)]))
    return fill, ops


def _bytes_per_entry(build: Callable[[list], object], entries: int) -> float:
    gc.collect()
    tracemalloc.start()
    held: list = []
    build(held)
    gc.collect()
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del held
    return size / entries


def _full_collection_ms(build: Callable[[list], object]) -> float:
    """The median of three ``gc.collect()`` with the table alive (the OrderedDicts are always tracked)."""
    held: list = []
    build(held)
    gc.collect()
    ms = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        gc.collect()
        ms.append((time.perf_counter_ns() - t0) / 1e6)
    del held
    return sorted(ms)[1]


def report(name: str, times: list[int], per_entry: float, full_ms: float) -> None:
    ts = sorted(times)
    n = len(ts)
    print(
        f"{name:<18}{ts[-1] / 1e6:>9.2f}{ts[int(0.999 * n)] / 1e3:>10.1f}{ts[int(0.99 * n)] / 1e3:>8.1f}"
        f"{ts[n // 2] / 1e3:>8.2f}{sum(ts) / n / 1e3:>8.2f}{sum(t > 1_000_000 for t in ts):>7}{per_entry:>9.0f}"
        f"{full_ms:>11.1f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--ops", type=int, default=300_000)
    ap.add_argument("--shards", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--gc", action="store_true", help="leave the garbage collector on while timing")
    ap.add_argument("--only", choices=["touch", "insert"], help="no timing: run --ops/2 such operations once")
    ap.add_argument(
        "--table", choices=["od", "sharded", "heads"], default="od", help="with --only (shards: --shards[0])"
    )
    args = ap.parse_args(argv)
    if (
        args.sessions < 1
        or args.ops < (0 if args.only else 1)
        or not args.shards
        or any(s < 1 or s & (s - 1) for s in args.shards)
    ):
        ap.error("--sessions, --ops: positive counts; --shards: powers of two")

    if args.only is not None:
        # Instruction counting (run under valgrind twice, with --ops N and --ops 0, the same operations drawn
        # either way): one table, the first N/2 operations of one kind.
        code = TOUCH if args.only == "touch" else INSERT
        fill, ops = make_ops(args.sessions, 2 * _ONLY_DRAWN, args.seed)
        picked = [op for op in ops if op[0] == code][: args.ops // 2]
        if args.table == "od":
            drive_od(args.sessions, fill, picked)
        elif args.table == "sharded":
            drive_sharded(args.sessions, fill, picked, args.shards[0])
        else:
            drive_sharded_heads(args.sessions, fill, picked, args.shards[0])
        print(f"{args.table} {args.only}: {len(picked)} operations")
        return 0
    size = args.sessions
    fill = make_ops(size, 0, args.seed)[0]
    # The tables filled, nothing else alive but the fill keys: bytes per entry and a full collection's time.
    builders: dict[str, Callable[[list], object]] = {"OrderedDict": lambda h: drive_od(size, fill, [], _zero, h)}
    for s in args.shards:
        builders[f"{s} shards, heap"] = lambda h, s=s: drive_sharded(size, fill, [], s, _zero, h)
        builders[f"{s} shards, heads"] = lambda h, s=s: drive_sharded_heads(size, fill, [], s, _zero, h)
    builders["dict (no order)"] = lambda h: drive_dict(size, fill, [], _zero, h)
    memory = {name: (_bytes_per_entry(b, size), _full_collection_ms(b)) for name, b in builders.items()}
    fill, ops = make_ops(size, args.ops, args.seed)
    print(
        f"python {sys.version.split()[0]}, {size} sessions, {args.ops} operations (half new), "
        f"gc {'on' if args.gc else 'off'}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'table':<18}{'max ms':>9}{'p99.9 µs':>10}{'p99 µs':>8}{'med µs':>8}{'mean µs':>8}{'>1ms':>7}{'B/entry':>9}"
        f"{'full gc ms':>11}"
    )
    clock = time.perf_counter_ns
    if not args.gc:
        gc.disable()
    ref_log, times = drive_od(size, fill, ops, clock)
    report("OrderedDict", times, *memory["OrderedDict"])
    for s in args.shards:
        for name, drive in ((f"{s} shards, heap", drive_sharded), (f"{s} shards, heads", drive_sharded_heads)):
            log, times = drive(size, fill, ops, s, clock)
            if log != ref_log:
                print(f"{name}: the reads or the eviction order differ from the OrderedDict's: not reported")
                continue
            report(name, times, *memory[name])
        del log
    # The plain dict is given the keys the OrderedDict evicted, in its order.
    evicted = iter(ref_log)
    dict_ops = [(code, k, next(evicted)) if code == INSERT else (code, k) for code, k in ops]
    _, times = drive_dict(size, fill, dict_ops, clock)  # type: ignore[arg-type]
    report("dict (no order)", times, *memory["dict (no order)"])
    gc.enable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
