"""A digest of the conversation router's decisions on random workloads: equal digests, the same decisions.

    python bench/bench_router_digest.py [--steps 4000] [--seeds 3]

For a change meant to keep every decision (a speed-up), run this before and after and compare the lines. Per
configuration (the follow modes, cache events, both guards, a prefill rate, a small session table) and seed, a
random mix of known conversations (with and without their id, growing or edited), new conversations sharing
prefixes, finishes (some failed), cache events (stored, removed, cleared), clock steps past the time-to-live
and servers leaving and rejoining rotation drives one router; the digest covers every chosen server, the
stats, the loads, the backlogs and the sessions of the latest conversations at the end. Nothing is timed and
nothing is written.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvforge.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvforge.routing import ConversationRouter, CostGuard, ImbalanceGuard, NoServerAvailableError, RouteRequest

TPB = 4
SERVERS = ["a", "b", "c", "d", "e"]
CONFIGS: dict[str, dict] = {
    "specific": {},
    "specific-min0": {"new_conversation_min_match_blocks": 0},
    "always": {"new_conversation_follow": "always"},
    "specific+events": {"use_cache_events": True},
    "always+events": {"new_conversation_follow": "always", "use_cache_events": True},
    "specific+guard": {"imbalance_guard": ImbalanceGuard(rel_slack=0.2, abs_slack_tokens=40)},
    "always+events+guard": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": ImbalanceGuard(rel_slack=0.3, abs_slack_tokens=30),
    },
    "specific+events+cost": {"use_cache_events": True, "imbalance_guard": CostGuard(2.0)},
    "always+events+cost": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": CostGuard(),
    },
    "always+events+cost+drain": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": CostGuard(1.5),
        "prefill_tokens_per_s": 40.0,
    },
    "always+cost+drain": {
        "new_conversation_follow": "always",
        "imbalance_guard": CostGuard(),
        "prefill_tokens_per_s": 9.0,
    },
    "always+events+guard+drain": {
        "new_conversation_follow": "always",
        "use_cache_events": True,
        "imbalance_guard": ImbalanceGuard(rel_slack=0.5, abs_slack_tokens=20),
        "prefill_tokens_per_s": 25.0,
    },
}


def run(name: str, seed: int, steps: int) -> str:
    rng = random.Random(seed)
    t = [100.0]
    r = ConversationRouter(
        SERVERS,
        tokens_per_block=TPB,
        max_sessions=40,
        specific_max_conversations=3,
        request_ttl_s=30.0,
        clock=lambda: t[0],
        **CONFIGS[name],
    )
    convs: list[tuple[str, tuple[int, ...]]] = []
    live: list[str] = []
    out: list[object] = []
    prefixes = [tuple(rng.randrange(1 << 40) for _ in range(rng.randrange(1, 5))) for _ in range(6)]
    for step in range(steps):
        op = rng.random()
        rid = f"r{step}"
        if op < 0.4:
            if convs and rng.random() < 0.6:
                i = rng.randrange(len(convs))
                cid, keys = convs[i]
                if rng.random() < 0.1 and len(keys) > 1:
                    keys = keys[: rng.randrange(1, len(keys))]  # an edited history
                keys = keys + tuple(rng.randrange(1 << 40) for _ in range(rng.randrange(0, 3)))
                convs[i] = (cid, keys)
                conv = cid if rng.random() < 0.6 else None
            else:
                keys = (rng.choice(prefixes) if rng.random() < 0.5 else ()) + tuple(
                    rng.randrange(1 << 40) for _ in range(rng.randrange(0, 6))
                )
                cid = f"c{step}"
                conv = cid if rng.random() < 0.7 else None
                convs.append((cid, keys))
                if len(convs) > 60:
                    convs.pop(0)
            n = len(keys) * TPB + rng.randrange(TPB)
            try:
                got = r.route(RouteRequest(rid, block_keys=keys, num_tokens=n, conversation_id=conv))
            except NoServerAvailableError:
                got = "none"
            else:
                live.append(rid)
            out.append(got)
        elif op < 0.8:
            if live:
                rid = live.pop(rng.randrange(len(live)))
                out.append(r.finish(rid, rng.random() < 0.9))
        elif op < 0.89:
            s = rng.choice(SERVERS)
            _, keys = rng.choice(convs) if convs else ("", ())
            what = rng.random()
            if what < 0.7 and keys:
                r.on_event(s, BlockStored(keys[: rng.randrange(1, len(keys) + 1)], None, TPB))
            elif what < 0.95 and keys:
                r.on_event(s, BlockRemoved(keys[rng.randrange(len(keys)) :]))
            elif what >= 0.95:
                r.on_event(s, AllBlocksCleared())
        elif op < 0.97:
            t[0] += 31.0 if rng.random() < 0.03 else rng.choice([0.0, 0.05, 0.4, 2.0])
        else:
            s = rng.choice(SERVERS)
            r.set_server_available(s, not r.is_available(s) or rng.random() < 0.3)
        if step % 97 == 0:
            r.sanity_check()
    r.sanity_check()
    out.append(sorted(vars(r.stats).items()))
    out.append(sorted(r.loads().items()))
    out.append(sorted(r.backlogs().items()))
    out.append([(cid, r.session_server(cid)) for cid, _ in convs])
    out.append(r.num_sessions())
    return hashlib.sha1(repr(out).encode()).hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    for name in CONFIGS:
        digests = [run(name, seed, args.steps) for seed in range(args.seeds)]
        print(f"{name:<28}" + " ".join(digests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
