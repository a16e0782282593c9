"""Multi-GPU run (issue 9): NCCL KV transfer through the transceiver, helix decode attention, probe and faults.

One command starts one process per GPU (``kvforge.disagg.launch.run_world``, spawn inside) and runs, in order:

1. Transfer. Rank 0 is a context instance, rank 1 a generation instance (TP 1, CP 1). A batch of requests with
   61 bf16 MLA layers of 576 elements plus one FP8 draft layer (64 tokens per block) goes through
   ``KVSender``/``KVReceiver`` over NCCL; every page of every layer on the generation side is then compared byte
   for byte with the deterministic pattern the context side wrote. Bandwidth of the whole transfer (pack, NCCL,
   unpack) and of one raw NCCL message of the same bytes, against ``tensor.to("cuda:1")`` (and a preallocated
   ``copy_``) of the same bytes in the same run; target: transfer >= 0.70 x the faster GPU-to-GPU copy.
2. Helix. A decode-attention step (MLA absorbed form: 576-dim keys, 512-dim values) over KV blocks dealt
   round-robin over CP = 2 (and 4 with 4 GPUs): each rank attends over its blocks, the partial outputs and their
   LSEs are all-gathered and combined with ``merge_attention_states``; the result must equal the single-GPU
   step within bf16 tolerance. Time per step against the single-GPU step.
3. Probe and faults. The helix idle probe over NCCL (a generation group over all GPUs: ranks with different
   session counts all run the consensus; all idle skips it), and with 3+ GPUs a real helix transfer from rank 0 to
   ranks 1..2 under the probe. Then the context side stops mid-batch: the transfers it never sends end in a clear
   timeout error within their deadline, and the generation side refuses that NCCL peer afterwards (a receive left
   posted would swallow its next message).

Usage: ``PYTHONPATH=. python bench/bench_multi_gpu.py [--quick] [--out DIR] [--gpus N]`` on a machine with 2 or
more GPUs (exits with a message otherwise). Writes ``DIR/bench_multi_gpu.csv`` and ``DIR/bench_multi_gpu.png``
(default bench/results). ``--cpu-smoke`` runs the same script on 3 CPU processes over gloo at toy sizes (the
interpreter), to check the plumbing; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import _common
from bench._common import append_csv, bar_plot, env_stamp

TARGET = 0.70
_RAW_TAG = 50_000


def _pattern(layer_code: int, blocks: torch.Tensor, row_bytes: int, device: torch.device) -> torch.Tensor:
    """Deterministic bytes [len(blocks), row_bytes] of one layer: an integer hash, identical on every device."""
    pos = torch.arange(row_bytes, device=device, dtype=torch.int64)
    x = blocks.to(device=device, dtype=torch.int64)[:, None] * 1_000_003 + layer_code * 7_919 + pos[None, :]
    x = (x * 2_654_435_761) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 2_246_822_519) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    return (x & 0xFF).to(torch.uint8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_code(layer) -> int:
    return (1 if layer.owner == "target" else 1000) + layer.layer_id


def _fill(layers, req, tpb: int, device: torch.device) -> None:
    nb = req.num_blocks(tpb)
    blocks = torch.arange(nb)
    for ly in layers:
        raw = ly.pool.view(torch.uint8)
        rows = _pattern(_layer_code(ly), blocks, raw.shape[1] * raw.shape[2], device).view(nb, *raw.shape[1:])
        raw.index_copy_(0, torch.as_tensor(req.page_indices[ly.group], device=device), rows)


def _verify(layers, req, block_ids: list[int], device: torch.device) -> tuple[int, int]:
    """(blocks compared, blocks differing) over every layer; draft layers must be among them."""
    assert any(ly.owner == "draft" for ly in layers), "no draft layer to verify"
    checked = bad = 0
    for ly in layers:
        pages = req.page_indices[ly.group]
        assert len(pages) == len(block_ids), f"{ly.owner} layer {ly.layer_id}: {len(pages)} pages"
        if not pages:
            continue
        raw = ly.pool.view(torch.uint8)
        got = raw.index_select(0, torch.as_tensor(pages, device=device))
        want = _pattern(_layer_code(ly), torch.tensor(block_ids), raw.shape[1] * raw.shape[2], device).view(got.shape)
        bad += int((got != want).flatten(1).any(1).sum())
        checked += len(pages)
    return checked, bad


def _median_time(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_transfer(rank: int, world: int, cfg: dict, device: torch.device, transport) -> list[dict]:
    import torch.distributed as dist

    from kvforge.disagg import synthetic as syn
    from kvforge.disagg.transceiver import KVReceiver, KVSender

    model = syn.ModelSpec(
        num_layers=cfg["layers"], head_dim=cfg["elems"], tokens_per_block=cfg["tpb"], num_groups=1, num_draft_layers=1
    )
    nb = -(-cfg["tokens"] // cfg["tpb"])
    n_req = cfg["requests"]
    ctx = syn.InstanceSpec("ctx", (0,), num_pages=n_req * nb + 8)
    gen = syn.InstanceSpec("gen", (1,), num_pages=n_req * nb + 8)
    rows: list[dict] = []
    if rank not in (0, 1):
        return rows
    pair = _pair_group()
    inst = ctx if rank == 0 else gen
    layers = syn.make_layers(model, inst, 0, device)
    alloc = syn.PageAllocator(model.total_groups, inst.num_pages, seed=rank)
    reqs = [alloc.alloc(i, cfg["tokens"], [nb] * model.total_groups) for i in range(n_req)]
    info = syn.make_rank_info(model, inst, 0)
    payload = sum(nb * model.tokens_per_block * ly.elems_per_token * ly.pool.element_size() for ly in layers) * n_req
    if rank == 0:
        ep = KVSender(transport, info, layers, timeout_s=cfg["timeout"])
        ep.connect("gen", gen.ranks)
        for r in reqs:
            _fill(layers, r, model.tokens_per_block, device)
        _sync(device)
    else:
        ep = KVReceiver(transport, info, layers, timeout_s=cfg["timeout"])
        ep.connect("ctx", ctx.ranks)
        for i, r in enumerate(reqs):
            ep.request(i, r, "ctx")
    dist.barrier(group=pair)
    t0 = time.perf_counter()
    if rank == 0:
        for i, r in enumerate(reqs):
            ep.send(i, r, "gen")
        st = ep.wait()
        assert st.completed == list(range(n_req)) and not st.failed, st.failed
    else:
        st = ep.check_status(blocking=True)
        _sync(device)
        seconds = time.perf_counter() - t0
        assert sorted(st.completed) == list(range(n_req)) and not st.failed, st.failed
        checked = bad = 0
        for r in reqs:
            c, b = _verify(layers, r, list(range(nb)), device)
            checked, bad = checked + c, bad + b
        rows.append(
            {
                "part": "transfer",
                "provider": f"transceiver (pack+{transport.backend}+unpack)",
                "seconds": seconds,
                "bytes": payload,
                "GBps": payload / seconds / 1e9,
                "blocks_checked": checked,
                "blocks_bad": bad,
                "byte_exact": bad == 0 and checked == len(layers) * nb * n_req,
            }
        )
    dist.barrier(group=pair)
    del layers
    # Raw transport: one message of the same bytes.
    buf = torch.empty(payload, dtype=torch.uint8, device=device)

    def raw_msg() -> None:
        h = transport.isend(buf, 1, _RAW_TAG) if rank == 0 else transport.irecv(buf, 0, _RAW_TAG)
        while not h.done():
            pass

    for _ in range(2):
        dist.barrier(group=pair)
        raw_msg()
    raw = []
    for _ in range(cfg["reps"]):
        dist.barrier(group=pair)
        _sync(device)
        t0 = time.perf_counter()
        raw_msg()
        _sync(device)
        raw.append(time.perf_counter() - t0)
    if rank == 1:
        s = statistics.median(raw)
        rows.append(
            {
                "part": "transfer",
                "provider": f"raw {transport.backend} message",
                "seconds": s,
                "bytes": payload,
                "GBps": payload / s / 1e9,
            }
        )
    dist.barrier(group=pair)
    if rank == 0 and device.type == "cuda" and torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1)
        to_s = _median_time(lambda: buf.to(other), other, cfg["reps"])
        dst = torch.empty(payload, dtype=torch.uint8, device=other)
        copy_s = _median_time(lambda: dst.copy_(buf), other, cfg["reps"])
        for name, s in (('tensor.to("cuda:1")', to_s), ("copy_ into cuda:1 (preallocated)", copy_s)):
            rows.append(
                {"part": "transfer", "provider": name, "seconds": s, "bytes": payload, "GBps": payload / s / 1e9}
            )
    return rows


def _decode_attention(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Dk], k [B,N,Dk], v [B,N,Dv] (bf16) -> (O [B,H,Dv] bf16, lse [B,H] fp32, natural log, scaled)."""
    if k.shape[1] == 0:  # an empty shard: output 0, lse -inf (merge_attention_states drops it)
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        return out, torch.full(q.shape[:2], float("-inf"), device=q.device)
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(v.dtype)
    return torch.bmm(p, v), lse


def part_helix(rank: int, world: int, cfg: dict, device: torch.device) -> list[dict]:
    import torch.distributed as dist

    from kvforge.disagg.mapping import helix_blocks
    from kvforge.kernels.merge_states import merge_attention_states

    B, H, N, tpb = cfg["helix_batch"], cfg["helix_heads"], cfg["helix_tokens"], cfg["tpb"]
    dk, dv = cfg["elems"], cfg["elems"] - 64
    scale = 1.0 / dk**0.5
    g = torch.Generator(device="cpu").manual_seed(7)
    # The same inputs on every rank (generated on the host, then copied): q and the latent cache.
    q = (torch.randn(B, H, dk, generator=g) * 0.5).to(torch.bfloat16).to(device)
    kv = torch.randn(B, N, dk, generator=g).to(torch.bfloat16).to(device)
    rows: list[dict] = []
    cps = [c for c in (2, 4, 8) if c <= world]
    groups = {c: dist.new_group(list(range(c))) if c < world else None for c in cps}
    full = None
    if rank == 0:
        full, _ = _decode_attention(q, kv, kv[..., :dv], scale)
        single = _median_time(lambda: _decode_attention(q, kv, kv[..., :dv], scale), device, cfg["reps"] * 5)
        rows.append({"part": "helix", "provider": "single GPU", "cp": 1, "seconds": single})
    for cp in cps:
        if rank < cp:
            nb = -(-N // tpb)
            idx = torch.tensor([b * tpb + t for b in helix_blocks(nb, rank, cp) for t in range(tpb) if b * tpb + t < N])
            k_shard = kv.index_select(1, idx.to(device)).contiguous()
            v_shard = k_shard[..., :dv]
            # gloo's all_gather_into_tensor wants the shares concatenated along dim 0; NCCL takes either.
            outs = torch.empty(cp * B, H, dv, dtype=torch.bfloat16, device=device)
            lses = torch.empty(cp * B, H, dtype=torch.float32, device=device)

            def step(k_shard=k_shard, v_shard=v_shard, outs=outs, lses=lses, group=groups[cp], cp=cp) -> torch.Tensor:
                o, lse = _decode_attention(q, k_shard, v_shard, scale)
                dist.all_gather_into_tensor(outs, o.contiguous(), group=group)
                dist.all_gather_into_tensor(lses, lse.contiguous(), group=group)
                return merge_attention_states(outs.view(cp, B, H, dv), lses.view(cp, B, H))[0]

            merged = step()
            t = _median_time(step, device, cfg["reps"] * 5)
            if rank == 0:
                # Relative RMSE over the whole output (outputs are averages of many values, so an absolute
                # bound would pass even an all-zero result); bf16 rounding of the partials costs ~0.4%.
                diff = (merged.float() - full.float()).pow(2).mean().sqrt()
                rel = float(diff / full.float().pow(2).mean().sqrt())
                rows.append(
                    {
                        "part": "helix",
                        "provider": f"helix CP={cp}",
                        "cp": cp,
                        "seconds": t,
                        "rel_rmse": rel,
                        "within_bf16_tol": rel <= 1e-2,
                    }
                )
        dist.barrier()
    return rows


def part_probe_and_faults(rank: int, world: int, cfg: dict, device: torch.device, transport) -> list[dict]:
    import torch.distributed as dist

    from kvforge.disagg import synthetic as syn
    from kvforge.disagg.transceiver import KVReceiver, KVSender

    model = syn.ModelSpec(num_layers=2, head_dim=64, tokens_per_block=cfg["tpb"], num_groups=1)
    rows: list[dict] = []
    # (a) The probe over every rank as one helix generation group, peers registered without messages.
    gen_all = syn.InstanceSpec("gen_all", tuple(range(world)), cp=world)
    ctx0 = syn.InstanceSpec("ctx0", (0,))
    group_all = transport.new_group(gen_all.ranks)
    layers = syn.make_layers(model, gen_all, rank, device)
    rx = KVReceiver(transport, syn.make_rank_info(model, gen_all, rank), layers, group=group_all, timeout_s=30)
    rx.add_peer("ctx0", [syn.make_rank_info(model, ctx0, 0)])
    alloc = syn.PageAllocator(model.total_groups, gen_all.num_pages)
    trace = []

    def poll() -> None:
        before = (rx.stats.probe_skips, rx.stats.consensus_rounds)
        st = rx.check_status()
        trace.append((rx.stats.probe_skips - before[0], rx.stats.consensus_rounds - before[1], tuple(st.completed)))

    poll()
    if rank == world - 1:
        rx.request(900, alloc.alloc(900, 0, [0] * model.total_groups), "ctx0")  # an empty prompt: no messages
    poll()
    dist.barrier()
    if rank != world - 1:
        rx.request(900, alloc.alloc(900, 0, [0] * model.total_groups), "ctx0")
    st = rx.check_status(blocking=True)
    trace.append(("blocking", tuple(st.completed)))
    poll()
    traces = [None] * world
    dist.all_gather_object(traces, trace)
    if rank == 0:
        same = all(t == traces[0] for t in traces)
        expect = [(1, 0, ()), (0, 1, ()), ("blocking", (900,)), (1, 0, ())]
        rows.append(
            {
                "part": "probe",
                "provider": f"idle probe, CP={world} group",
                "same_branch": same,
                "as_expected": traces[0] == expect,
                "trace": str(traces[0]),
            }
        )

    # (b) With 3+ GPUs: a real helix transfer 0 -> (1, 2) with the probe on between polls.
    if world >= 3:
        tpb = model.tokens_per_block
        prompts = [0, tpb + tpb // 2, 9 * tpb, 32 * tpb]  # 0, 2, 9 and 32 blocks
        res = syn.run_pair(
            transport,
            model,
            syn.InstanceSpec("hctx", (0,), num_pages=64),
            syn.InstanceSpec("helix", (1, 2), cp=2, num_pages=64),
            prompts,
            3,
            first_transfer_id=1000,
            device=device,
            timeout_s=60,
        )
        collected = [None] * world
        dist.all_gather_object(collected, res)
        if rank == 0:
            g = [collected[1], collected[2]]
            ok = all(not x.failed and not x.check.problems for x in g)
            rows.append(
                {
                    "part": "probe",
                    "provider": f"helix transfer 0 -> (1, 2) over {transport.backend}",
                    "byte_exact": ok,
                    "draft_blocks_checked": sum(x.check.blocks_checked["draft"] for x in g),
                }
            )

    # (c) Faults: the context side stops mid-batch; its unsent transfers time out on the generation side.
    dist.barrier()
    if rank in (0, 1):
        fctx, fgen = syn.InstanceSpec("fctx", (0,)), syn.InstanceSpec("fgen", (1,))
        inst = fctx if rank == 0 else fgen
        flayers = syn.make_layers(model, inst, 0, device)
        falloc = syn.PageAllocator(model.total_groups, inst.num_pages)
        info = syn.make_rank_info(model, inst, 0)
        nb = 4
        reqs = [falloc.alloc(i, nb * model.tokens_per_block, [nb] * model.total_groups) for i in range(4)]
        if rank == 0:
            ep = KVSender(transport, info, flayers, timeout_s=30)
            ep.connect("fgen", fgen.ranks)
            for r in reqs:
                _fill(flayers, r, model.tokens_per_block, device)
            dist.barrier(group=_pair_group())
            for i in range(2):  # then it stops: transfers 2002 and 2003 are never sent
                ep.send(2000 + i, reqs[i], "fgen")
            ep.wait()
        else:
            rx2 = KVReceiver(transport, info, flayers, release=falloc.release, timeout_s=cfg["fault_timeout"])
            rx2.connect("fctx", fctx.ranks)
            for i, r in enumerate(reqs):
                rx2.request(2000 + i, r, "fctx")
            dist.barrier(group=_pair_group())
            t0 = time.perf_counter()
            st = rx2.check_status(blocking=True)
            waited = time.perf_counter() - t0
            for tid in st.completed:
                falloc.release(reqs[tid - 2000])
            late = falloc.alloc(2010, 1, [1] * model.total_groups)
            try:
                rx2.request(2010, late, "fctx")
                refused = "accepted (gloo matches by tag, so the peer stays usable)"
                rx2.cancel(2010)
            except Exception as exc:  # reported in the table, whatever it is
                refused = f"{type(exc).__name__}: {exc}"
                falloc.release(late)
            rows.append(
                {
                    "part": "faults",
                    "provider": "context stops after 2 of 4 transfers",
                    "completed": str(sorted(st.completed)),
                    "failed": str(st.failed),
                    "seconds": waited,
                    "timeout_s": cfg["fault_timeout"],
                    "leaked_pages": falloc.leaked,
                    "next_transfer": refused,
                }
            )
        # The context side stays alive (stopped, not dead) until the generation side has given up.
        dist.barrier(group=_pair_group())
    return rows


_PAIR = None


def _pair_group():
    return _PAIR


def worker(rank: int, world: int, cfg: dict) -> list[dict]:
    import warnings

    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor; torch 2.11 (the GPU machine) has only the old name.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")

    import kvforge.kernels  # noqa: F401
    from kvforge.disagg.transport import TorchDistTransport

    global _PAIR
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["backend"] == "nccl" else torch.device("cpu")
    transport = TorchDistTransport()
    _PAIR = dist.new_group([0, 1])
    rows = []
    rows += part_transfer(rank, world, cfg, device, transport)
    dist.barrier()
    rows += part_helix(rank, world, cfg, device)
    dist.barrier()
    rows += part_probe_and_faults(rank, world, cfg, device, transport)
    return rows


def report(rows: list[dict], out: Path, stamp: dict[str, str], smoke: bool) -> None:
    copies = [r["GBps"] for r in rows if r["part"] == "transfer" and "cuda:1" in r["provider"]]
    best_copy = max(copies) if copies else None
    print(f"\n{'part':9s} {'provider':42s} {'ms':>9s} {'GB/s':>8s}  notes")
    for r in rows:
        notes = {k: v for k, v in r.items() if k not in ("part", "provider", "seconds", "GBps", "bytes", "trace")}
        if r["part"] == "transfer" and best_copy and not r["provider"].startswith(("tensor.to", "copy_")):
            r["ratio_vs_gpu_copy"] = r["GBps"] / best_copy
            r["target"] = TARGET
            r["met"] = r["ratio_vs_gpu_copy"] >= TARGET
            notes.update(ratio=round(r["ratio_vs_gpu_copy"], 3), met=r["met"])
        ms = f"{r['seconds'] * 1e3:9.3f}" if "seconds" in r else " " * 9
        gb = f"{r['GBps']:8.1f}" if "GBps" in r else " " * 8
        print(f"{r['part']:9s} {r['provider']:42s} {ms} {gb}  {notes}")
        if "trace" in r:
            print(f"{'':9s} trace {r['trace']}")
    if smoke:
        print("\n(CPU smoke run over gloo: timings mean nothing and nothing is written)")
        return
    _common.RESULTS = out
    path = append_csv("bench_multi_gpu", [{k: v for k, v in r.items()} for r in rows])
    tr = [r for r in rows if r["part"] == "transfer"]
    hx = [r for r in rows if r["part"] == "helix"]
    png = out / "bench_multi_gpu.png"
    bar_plot(
        png,
        f"KV transfer between two GPUs, {stamp['gpu']} (torch {stamp['torch']}): GB/s, higher is better",
        ["transfer"],
        {r["provider"]: [r["GBps"]] for r in tr},
        "GB/s",
    )
    if hx:
        bar_plot(
            out / "bench_multi_gpu_helix.png",
            f"Helix decode step, {stamp['gpu']}: ms per step, lower is better",
            ["decode step"],
            {r["provider"]: [r["seconds"] * 1e3] for r in hx},
            "ms",
        )
    print(f"\nwrote {path}, {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests and repetitions")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder for the CSV and PNGs")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all, at most 8)")
    parser.add_argument("--cpu-smoke", action="store_true", help="3 CPU processes over gloo, toy sizes")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before every worker is stopped")
    args = parser.parse_args(argv)
    from kvforge.disagg.launch import run_world

    smoke = args.cpu_smoke
    if smoke:
        world, backend = 3, "gloo"
        cfg = dict(
            requests=2,
            tokens=40,
            layers=3,
            elems=80,
            tpb=4,
            reps=2,
            helix_batch=2,
            helix_heads=2,
            helix_tokens=37,
            timeout=60,
            fault_timeout=1.0,
        )
        env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    else:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            print(
                f"bench_multi_gpu needs at least 2 GPUs; this machine has {n}. Run it on a multi-GPU machine "
                "(e.g. nvidia-h200-x2 or -x4), or use --cpu-smoke to check the plumbing on CPUs.",
                file=sys.stderr,
            )
            return 2
        world = min(n, args.gpus or n, 8)
        backend = "nccl"
        cfg = dict(
            requests=8 if args.quick else 32,
            tokens=2048,
            layers=61,
            elems=576,
            tpb=64,
            reps=3 if args.quick else 7,
            helix_batch=8,
            helix_heads=128,
            helix_tokens=16384 if args.quick else 65536,
            timeout=120,
            fault_timeout=5.0,
        )
        env = {}
    cfg["backend"] = backend
    stamp = env_stamp()
    print(" ".join(f"{k}={v}" for k, v in stamp.items()), f"world={world} backend={backend}", flush=True)
    results = run_world(
        worker, world, backend=backend, args=(cfg,), timeout_s=1500, pg_timeout_s=1800, env_overrides=env
    )
    failed = [r for r in results if not r.reported]
    for r in failed:
        print(f"rank {r.rank} failed (exit {r.exitcode}):\n{r.error}", file=sys.stderr)
    order = ["transfer", "helix", "probe", "faults"]
    rows = sorted((row for r in results if r.value for row in r.value), key=lambda row: order.index(row["part"]))
    report(rows, args.out, stamp, smoke)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
