"""Host CPU cost of prefix caching on the Mooncake trace, like for like: kvforge's manager vs vLLM's KVCacheManager.

Every request of the trace (``--trace``, default ``$KVFORGE_TRACE`` or ``shared/data/``; skipped when absent) is
served in order, one at a time, by each system at each capacity (unlimited; LRU 20,000 blocks), with the garbage
collector ON. The trace gives one id per 512-token block; each id becomes 512 real token ids (``id * 512 + 0..511``,
distinct per id), so a prompt is ``input_length`` token ids and both sides hash real 512-token blocks. Building the
token list is outside the timed region (a server receives it); everything a server then does is inside:

* ``kvforge`` (xxh3-128, its default) and ``kvforge-sha256``: the general token path as kvforge's scheduler
  takes it: the list validated once into a read-only uint32 array (``token_array``), ``prompt_keys`` (keys
  computed once), ``create_cache(tokens, block_keys=, max_reuse_tokens=len - 1)``, ``resize``, ``commit`` of the
  tokens not reused, ``close``.
* ``vllm`` (its default ``sha256``) and ``vllm-xxhash``: vLLM's full ``KVCacheManager`` as its scheduler drives it:
  a ``Request`` built with the block hasher (its constructor hashes the full blocks), ``get_computed_blocks``
  (capped at ``len - 1``), ``allocate_slots`` for the rest (caches the full blocks), ``free``.
* ``vllm-pool``: the bare ``BlockPool`` primitives under the same hashes (``hash_block_tokens`` per full block,
  ``get_cached_block``, ``touch``, ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks`` in reverse): the
  second line, the pool without the manager around it.

The peers run unmodified from vLLM's published wheel (``--wheels``, default ``$KVFORGE_PEER_WHEELS`` or
``/tmp/peer_wheels``; get it with ``pip download --no-deps vllm==0.33.0 -d /tmp/peer_wheels``): only the modules
named in ``_VLLM_REAL`` execute (the v1 core, the request, the hashing), infrastructure imports are stubbed
(``bench/_peer_import.py``). Each (system, capacity, repetition) runs in a fresh process that imports both systems
first, so every run starts from the same heap. Full-block hits must agree exactly between all systems with an
unlimited cache (the same longest-prefix semantics); with LRU eviction they differ by design (vLLM may evict a
block whose children stay cached; kvforge evicts leaves) and are reported side by side. After building its pools,
every run calls ``gc.collect(); gc.freeze()`` (:func:`kvforge.kvcache.host.freeze_gc`), as vLLM's and SGLang's
servers do after start-up (``--no-freeze``: not). The bench's earlier form: ``docs/history.md``.

A shared machine's load moves single runs of the same code a lot (``docs/kvcache.md``), so each repetition runs
every system once, kvforge next to vLLM (reversed every other repetition), and besides each system's median-total
run the bench reports the **paired ratio** of each repetition (a system's total over vLLM's total in the same
repetition), as its median and range over repetitions, with ``os.getloadavg()`` at start and end. Rows go to
``bench/results/host_cache.csv`` (workload ``mooncake_conversation_tokens``), the plot to
``bench/results/host_cache.png``. Run::

    python bench/bench_host_cache.py [--reps 3] [--systems kvforge,vllm,vllm-pool,...] [--limit N] [--no-save]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._peer_import import find_wheel, install, stub_module

TPB = 512
CAPACITIES: dict[str, int | None] = {"unlimited": None, "lru20k": 20_000}
SYSTEMS = ("kvforge", "vllm", "vllm-pool", "kvforge-sha256", "vllm-xxhash")  # run order (kvforge next to vLLM)
BASELINE = "vllm"  # ratios are against vLLM's full manager with its default hash
WHEELS_ENV = "KVFORGE_PEER_WHEELS"
WORKLOAD = "mooncake_conversation_tokens"

_VLLM_REAL = (
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.request",
    "vllm.v1.utils",
    "vllm.utils.hashing",
    "vllm.utils.math_utils",
)


def _trace_path(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    from kvforge.kvcache.replay import find_trace

    return find_trace()


def _wheels_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get(WHEELS_ENV) or "/tmp/peer_wheels")


def _import_vllm(wheels: Path) -> Any:
    vllm_whl = find_wheel(wheels, "vllm")
    if vllm_whl is None:
        raise FileNotFoundError(f"vLLM wheel not found in {wheels}: pip download --no-deps vllm==0.33.0 -d {wheels}")
    for name in ("cbor2", "uvloop"):  # imported by vLLM modules; the bench never calls them
        try:
            __import__(name)
        except ImportError:
            stub_module(name)
    install(
        vllm_whl,
        "vllm",
        _VLLM_REAL,
        {
            "vllm.logger": {"init_logger": logging.getLogger},
            "vllm.envs": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": False},
            # vllm.utils is an empty namespace here; this one helper of it is what Request's constructor calls.
            "vllm.utils": {"length_from_prompt_token_ids_or_embeds": lambda ids, embeds: len(ids)},
        },
    )
    import vllm.v1.core.single_type_kv_cache_manager as single_type

    single_type.register_all_kvcache_specs(None)  # what vLLM's engine does at start-up
    return single_type


def _prompt_tokens(ids: tuple[int, ...], input_length: int) -> list[int]:
    """The prompt as token ids: block i holds ``ids[i] * 512 + 0..511`` (distinct per id), cut to the length."""
    import numpy as np

    arr = (np.asarray(ids, dtype=np.uint32)[:, None] * TPB + np.arange(TPB, dtype=np.uint32)).ravel()
    return arr[:input_length].tolist()


# --- the systems: each returns a per-request function of the prompt's tokens giving the full blocks it reused ------


def _kvforge(capacity: int, algorithm: str) -> Any:
    from kvforge.kvcache.config import KVCacheConfig, LayerSpec, TierConfig
    from kvforge.kvcache.hashing import BlockKeyHasher, token_array
    from kvforge.kvcache.manager import KVCacheManager

    mgr = KVCacheManager(
        KVCacheConfig(
            tokens_per_block=TPB, layers=(LayerSpec(0, bytes_per_token=1),), tiers=(TierConfig(pages=capacity),)
        ),
        hasher=BlockKeyHasher(algorithm=algorithm),
    )

    def serve(tokens: list[int]) -> int:
        # As kvforge's scheduler keeps a request's prompt: validated once into a read-only uint32 array, which
        # every later call takes without checking or copying it again.
        arr = token_array(tokens)
        arr.flags.writeable = False
        n = len(arr)
        keys = mgr.prompt_keys(arr)
        cache = mgr.create_cache(arr, block_keys=keys, max_reuse_tokens=n - 1)
        reused = cache.num_committed_tokens
        if cache.resize(capacity=n, history=n):
            cache.commit(arr[reused:], block_keys=keys[reused // TPB :])
        cache.close()
        return reused // TPB

    return serve


def _vllm_hash(hash_name: str) -> tuple[Any, Any]:
    from vllm.utils import hashing as vh
    from vllm.v1.core import kv_cache_utils

    hash_fn = getattr(vh, hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    return hash_fn, kv_cache_utils


def _vllm(capacity: int, hash_name: str) -> Any:
    """vLLM's KVCacheManager with one full-attention group, driven as its scheduler drives a new request."""
    import types

    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    hash_fn, kv_cache_utils = _vllm_hash(hash_name)
    block_hasher = kv_cache_utils.get_request_block_hasher(TPB, hash_fn)
    spec = kvi.FullAttentionSpec(block_size=TPB, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = kvi.KVCacheConfig(
        num_blocks=capacity + 1,  # block 0 is vLLM's null block
        kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec(["mla.0"], spec)],
    )
    mgr = KVCacheManager(
        config, max_model_len=1 << 22, scheduler_block_size=TPB, hash_block_size=TPB, enable_caching=True
    )
    # The sampling parameters' fields the request reads (a real SamplingParams needs vLLM's full install).
    params = types.SimpleNamespace(max_tokens=1, extra_args=None, skip_reading_prefix_cache=None)
    ids = iter(range(1 << 62))

    def serve(tokens: list[int]) -> int:
        req = Request(str(next(ids)), tokens, params, None, block_hasher=block_hasher)
        blocks, hit, _ = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            return hit // TPB  # longer than the whole pool: counted its hits, caches nothing
        mgr.free(req)
        return hit // TPB

    return serve


def _vllm_pool(capacity: int, hash_name: str) -> Any:
    """vLLM's bare BlockPool: the primitives its manager calls, with the same per-block token hashing."""
    from vllm.v1.core.block_pool import BlockPool

    hash_fn, kv_cache_utils = _vllm_hash(hash_name)
    hash_block_tokens = kv_cache_utils.hash_block_tokens
    pool = BlockPool(capacity + 1, True, TPB)  # block 0 is vLLM's null block
    get_cached = pool.get_cached_block
    group = [0]

    class _Req:
        __slots__ = ("block_hashes",)

    def serve(tokens: list[int]) -> int:
        parent = None
        hashes = []
        for start in range(0, len(tokens) - TPB + 1, TPB):
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + TPB], None)
            hashes.append(parent)
        hit = []
        for h in hashes[: (len(tokens) - 1) // TPB]:  # the last token is computed, as the manager caps it
            found = get_cached(h, group)
            if found is None:
                break
            hit.append(found[0])
        pool.touch(hit)
        try:
            new = pool.get_new_blocks(-(-len(tokens) // TPB) - len(hit))
        except ValueError:  # longer than the whole pool: counted its hits, caches nothing
            pool.free_blocks(reversed(hit))
            return len(hit)
        blocks = hit + new
        req = _Req()
        req.block_hashes = hashes
        pool.cache_full_blocks(req, blocks, len(hit), len(hashes), TPB, 0)
        pool.free_blocks(reversed(blocks))
        return len(hit)

    return serve


# --- one run (child process) ---------------------------------------------------------------------------------------


def _run_child(
    system: str, capacity_name: str, trace: Path, wheels: Path, limit: int | None, freeze: bool
) -> dict[str, Any]:
    from kvforge.kvcache.replay import load_trace

    _import_vllm(wheels)  # every run imports both systems: the same heap for all
    requests = load_trace(trace, limit=limit)
    for r in requests:
        if max(r.hash_ids) >= (1 << 32) // TPB:
            raise SystemExit(f"trace: hash id {max(r.hash_ids)} too large for distinct 32-bit token ids")
    cap = CAPACITIES[capacity_name]
    capacity = sum(len(r.hash_ids) for r in requests) if cap is None else cap
    if system.startswith("kvforge"):
        serve = _kvforge(capacity, "sha256" if system.endswith("sha256") else "xxh3_128")
    elif system == "vllm-pool":
        serve = _vllm_pool(capacity, "sha256")
    elif system.startswith("vllm"):
        serve = _vllm(capacity, "xxhash" if system.endswith("xxhash") else "sha256")
    else:
        raise ValueError(f"system: unknown {system!r}")
    if not gc.isenabled():
        raise RuntimeError("the garbage collector must be on")
    if freeze:
        from kvforge.kvcache.host import freeze_gc

        freeze_gc()
    gc_ns = [0]
    gc_counts = [0, 0, 0]
    gc_start = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.process_time_ns()
        else:
            gc_ns[0] += time.process_time_ns() - gc_start[0]
            gc_counts[info["generation"]] += 1

    clock = time.process_time_ns
    samples = []
    hit_blocks = hit_tokens = prompt_tokens = 0
    gc.callbacks.append(on_gc)
    try:
        for r in requests:
            tokens = _prompt_tokens(r.hash_ids, r.input_length)  # what a server receives: not timed
            t0 = clock()
            hit = serve(tokens)
            samples.append(clock() - t0)
            hit_blocks += hit
            hit_tokens += min(hit * TPB, r.input_length)
            prompt_tokens += r.input_length
    finally:
        gc.callbacks.remove(on_gc)
    return {
        "system": system,
        "capacity": capacity_name,
        "capacity_blocks": capacity,
        "requests": len(requests),
        "samples_ns": samples,
        "gc_ns": gc_ns[0],
        "gc_collections": gc_counts,
        "hit_blocks": hit_blocks,
        "hit_tokens": hit_tokens,
        "prompt_tokens": prompt_tokens,
        "freeze": freeze,
    }


def _stats(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {
        "median_us": s[len(s) // 2] / 1e3,
        "mean_us": sum(s) / len(s) / 1e3,
        "p99_us": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3,
        "total_ms": sum(s) / 1e6,
    }


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def _paired_ratios(
    runs: dict[tuple[str, str], list[dict[str, Any]]], systems: list[str], cap: str
) -> dict[str, list[float]]:
    """Per system, its total CPU time over vLLM's in each repetition both ran (empty without vLLM)."""
    if BASELINE not in systems:
        return {}
    base = {r["rep"]: sum(r["samples_ns"]) for r in runs[(BASELINE, cap)]}
    out = {}
    for system in systems:
        mine = {r["rep"]: sum(r["samples_ns"]) for r in runs[(system, cap)]}
        out[system] = [mine[k] / base[k] for k in sorted(mine) if k in base]
    return out


def _plot_title(load_start: tuple[float, float, float], load_end: tuple[float, float, float]) -> str:
    """What the figure shows, the path and the machine it ran on (two lines: the figure is narrow)."""
    return (
        "Host CPU of prefix caching (median-total run),\nMooncake trace as 512-token blocks, GC on:\n"
        "kvforge token path vs vLLM KVCacheManager / BlockPool\n"
        f"{platform.machine()}, {os.cpu_count()} cores, load {load_start[0]:.1f} -> {load_end[0]:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="the Mooncake conversation trace (JSONL)")
    ap.add_argument("--wheels", default=None, help=f"folder with the vllm wheel (${WHEELS_ENV})")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--capacities", default=",".join(CAPACITIES))
    ap.add_argument("--reps", type=int, default=3, help="runs per (system, capacity); the median-total run reports")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--no-save", action="store_true", help="print only (no CSV / PNG)")
    ap.add_argument("--no-freeze", action="store_true", help="no gc.freeze() after building the pools")
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "CAPACITY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    trace = _trace_path(args.trace)
    wheels = _wheels_dir(args.wheels)
    if args.child:
        print(json.dumps(_run_child(args.child[0], args.child[1], trace, wheels, args.limit, not args.no_freeze)))
        return 0
    if trace is None or not trace.is_file():
        print(f"bench_host_cache: trace not found ({trace}); set --trace or $KVFORGE_TRACE. Skipped.", file=sys.stderr)
        return 0
    if find_wheel(wheels, "vllm") is None:
        print(
            f"bench_host_cache: the vLLM wheel is not in {wheels}. Get it with\n"
            f"  pip download --no-deps vllm==0.33.0 -d {wheels}\nSkipped.",
            file=sys.stderr,
        )
        return 0
    systems = [s for s in args.systems.split(",") if s]
    caps = [c for c in args.capacities.split(",") if c]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown {s!r} (expected some of {SYSTEMS})")
    for c in caps:
        if c not in CAPACITIES:
            raise SystemExit(f"--capacities: unknown {c!r} (expected some of {tuple(CAPACITIES)})")
    if args.reps < 1:
        raise SystemExit(f"--reps: expected an int >= 1, got {args.reps}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    load_start = os.getloadavg()
    print(f"load average at start (1/5/15 min): {_load(load_start)}", flush=True)
    for rep in range(args.reps):
        for cap in caps:
            order = systems if rep % 2 == 0 else systems[::-1]  # alternate, so no system always runs first
            for system in order:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, cap, "--trace", str(trace)]
                cmd += ["--wheels", str(wheels)] + (["--limit", str(args.limit)] if args.limit else [])
                cmd += ["--no-freeze"] if args.no_freeze else []
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    raise SystemExit(f"{system} {cap} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["rep"] = rep
                runs.setdefault((system, cap), []).append(res)
                print(
                    f"  rep {rep} {cap:>9} {system:>15}: {_stats(res['samples_ns'])['total_ms']:9.1f} ms"
                    f"  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    load_end = os.getloadavg()
    print(f"load average at end (1/5/15 min): {_load(load_end)}", flush=True)
    rows = []
    for cap in caps:
        paired = _paired_ratios(runs, systems, cap)
        chosen: dict[str, dict[str, Any]] = {}
        for system in systems:
            reps = sorted(runs[(system, cap)], key=lambda r: sum(r["samples_ns"]))
            chosen[system] = reps[len(reps) // 2]
        hits = {s: r["hit_blocks"] for s, r in chosen.items()}
        if CAPACITIES[cap] is None and len(set(hits.values())) != 1:
            raise SystemExit(f"hit blocks disagree with an unlimited cache: {hits}")
        base = _stats(chosen[BASELINE]["samples_ns"])["total_ms"] if BASELINE in chosen else None
        if paired:
            print(f"\ncapacity {cap}: paired ratio to vLLM per repetition (same repetition's vLLM total)")
            for system, pr in paired.items():
                print(f"{system:>15} " + " ".join(f"{x:5.2f}" for x in pr))
        frozen = "gc.freeze() after start-up" if not args.no_freeze else "no gc.freeze()"
        print(f"\ncapacity {cap} ({chosen[systems[0]]['capacity_blocks']:,} blocks), GC on, {frozen}, CPU per request:")
        print(
            f"{'system':>15} {'median us':>10} {'mean us':>9} {'p99 us':>9} {'total ms':>9} {'gc ms':>7} "
            f"{'gen2':>5} {'hit blocks':>10} {'hit rate':>8} {'x vllm':>7} {'paired x vllm: median [min, max]':>33}"
        )
        for system, r in chosen.items():
            st = _stats(r["samples_ns"])
            totals = sorted(sum(x["samples_ns"]) / 1e6 for x in runs[(system, cap)])
            ratio = st["total_ms"] / base if base else float("nan")
            pr = paired.get(system, [])
            pr_text = f"{_median(pr):.2f} [{min(pr):.2f}, {max(pr):.2f}]" if pr else "-"
            print(
                f"{system:>15} {st['median_us']:10.1f} {st['mean_us']:9.1f} {st['p99_us']:9.1f} {st['total_ms']:9.1f} "
                f"{r['gc_ns'] / 1e6:7.1f} {r['gc_collections'][2]:5d} {r['hit_blocks']:10d} "
                f"{r['hit_tokens'] / r['prompt_tokens']:8.2%} {ratio:7.2f} {pr_text:>33}"
            )
            rows.append(
                {
                    "workload": WORKLOAD,
                    "capacity": cap,
                    "capacity_blocks": r["capacity_blocks"],
                    "system": system,
                    "requests": r["requests"],
                    **{k: round(v, 2) for k, v in st.items()},
                    "total_ms_all_reps": ";".join(f"{t:.1f}" for t in totals),
                    "gc_ms": round(r["gc_ns"] / 1e6, 2),
                    "gc_gen0_1_2": "/".join(map(str, r["gc_collections"])),
                    "hit_blocks": r["hit_blocks"],
                    "hit_tokens": r["hit_tokens"],
                    "hit_rate": round(r["hit_tokens"] / r["prompt_tokens"], 5),
                    "ratio_to_vllm": round(ratio, 3),
                    "paired_ratio_median": round(_median(pr), 3) if pr else "",
                    "paired_ratio_min": round(min(pr), 3) if pr else "",
                    "paired_ratio_max": round(max(pr), 3) if pr else "",
                    "paired_ratios_all_reps": ";".join(f"{x:.3f}" for x in pr),
                    "reps": len(runs[(system, cap)]),
                    "loadavg_start": _load(load_start),
                    "loadavg_end": _load(load_end),
                    "gc": "on",
                    "gc_freeze_at_start": r["freeze"],
                    "cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                    "vllm_wheel": find_wheel(wheels, "vllm").name,  # type: ignore[union-attr]
                    "hash_path": "token ids, 512-token blocks",
                    "vllm_api": {"vllm-pool": "BlockPool"}.get(
                        system, "KVCacheManager" if system.startswith("vllm") else ""
                    ),
                }
            )
    if not args.no_save:
        from bench._common import RESULTS, append_csv, bar_plot

        print(f"appended to {append_csv('host_cache', rows)}")
        total = {(r["system"], r["capacity"]): r["total_ms"] for r in rows}
        series = {s: [total[(s, c)] for c in caps] for s in systems}
        print(
            "plot:",
            bar_plot(
                RESULTS / "host_cache.png",
                _plot_title(load_start, load_end),
                caps,
                series,
                "total CPU ms (12,031 requests)" if args.limit is None else "total CPU ms",
            ),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
