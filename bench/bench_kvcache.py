"""Prefix-hit rates of the KV cache manager replaying the Mooncake conversation trace, next to the reference.

Run: ``python -m bench.bench_kvcache`` (needs ``../shared/data/mooncake_conversation_trace.jsonl`` or
``$KVFORGE_TRACE``). The reference column is ``shared/data/README.md``'s independent measurement (one LRU
cache over blocks; a hit needs the whole leading run present; hits and inserts refresh recency). Rows are
appended to ``bench/results/kvcache_replay.csv``. Host-time benchmarks of the hot paths live in
``tests/test_kvcache_perf.py`` (pytest-benchmark).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvforge.kvcache.replay import TRACE_ENV, find_trace, load_trace, replay_prefix_hits

# shared/data/README.md: capacity in blocks (None: unlimited) -> measured token hit rate.
REFERENCE = {None: 0.374, 20_000: 0.293, 40_000: 0.358, 80_000: 0.369, 160_000: 0.374}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-csv", action="store_true", help="print only")
    args = parser.parse_args(argv)
    path = find_trace()
    if path is None:
        print(f"Mooncake trace not found: set {TRACE_ENV} or put it in <repo>/../shared/data/", file=sys.stderr)
        return 1
    requests = load_trace(path)
    rows = []
    print(f"{'capacity (blocks)':>18} {'hit rate':>9} {'reference':>9} {'seconds':>8}")
    for capacity, reference in REFERENCE.items():
        start = time.perf_counter()
        result = replay_prefix_hits(requests, capacity)
        seconds = time.perf_counter() - start
        label = "unlimited" if capacity is None else f"{capacity:,}"
        print(f"{label:>18} {result.hit_rate:9.2%} {reference:9.1%} {seconds:8.2f}")
        rows.append(
            {
                "workload": "mooncake_conversation",
                "capacity_blocks": "unlimited" if capacity is None else capacity,
                "requests": result.requests,
                "prompt_tokens": result.prompt_tokens,
                "hit_tokens": result.hit_tokens,
                "hit_rate": round(result.hit_rate, 5),
                "reference_hit_rate": reference,
                "replay_s": round(seconds, 3),
            }
        )
    if not args.no_csv:
        from bench._common import append_csv

        print(f"appended to {append_csv('kvcache_replay', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
