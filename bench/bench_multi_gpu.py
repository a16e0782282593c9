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


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    # The host's Python time too: the sender's posting rate is what bounds a batch of transfers.
    import cProfile

    prof.py = cProfile.Profile()
    prof.py.enable()
    return prof


def _profile_dump(prof, device: torch.device, path: Path) -> None:
    import io
    import pstats

    prof.py.disable()
    _sync(device)
    prof.__exit__(None, None, None)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    text += "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    py = io.StringIO()
    pstats.Stats(prof.py, stream=py).sort_stats("tottime").print_stats(30)
    text += "\n\n" + py.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _median_time(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Ctx:
    """What a scenario's worker has: its rank, the world, the transport, host barriers and a progress log."""

    def __init__(self, rank: int, world: int, cfg: dict, device: torch.device, transport, ctrl, scenario: str):
        self.rank, self.world, self.cfg, self.device = rank, world, cfg, device
        self.transport, self.ctrl, self.scenario = transport, ctrl, scenario

    def log(self, step: str) -> None:
        print(f"[{time.time() - self.cfg['t0']:7.1f}s] rank {self.rank} {self.scenario}: {step}", flush=True)

    def barrier(self, step: str) -> None:
        """Host-side barrier over gloo: never an NCCL kernel queued next to a posted receive."""
        import torch.distributed as dist

        self.log(f"barrier {step} ...")
        dist.all_reduce(torch.zeros(1), group=self.ctrl)
        self.log(f"barrier {step} passed")

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (pickled, over the gloo control group)."""
        import pickle

        import torch.distributed as dist

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.world, 1, dtype=torch.int64)
        dist.all_gather(list(sizes.unbind(0)), torch.tensor([data.numel()]), group=self.ctrl)
        sizes = sizes[:, 0]
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = torch.zeros(self.world, width, dtype=torch.uint8)
        dist.all_gather(list(out.unbind(0)), padded, group=self.ctrl)
        return [pickle.loads(out[i, : int(sizes[i])].numpy().tobytes()) for i in range(self.world)]


def part_transfer(c: Ctx) -> list[dict]:
    from kvforge.disagg import synthetic as syn
    from kvforge.disagg.transceiver import KVReceiver, KVSender

    rank, cfg, device, transport = c.rank, c.cfg, c.device, c.transport
    model = syn.ModelSpec(
        num_layers=cfg["layers"], head_dim=cfg["elems"], tokens_per_block=cfg["tpb"], num_groups=1, num_draft_layers=1
    )
    nb = -(-cfg["tokens"] // cfg["tpb"])
    n_req = cfg["requests"]
    ctx = syn.InstanceSpec("ctx", (0,), num_pages=n_req * nb + 8)
    gen = syn.InstanceSpec("gen", (1,), num_pages=n_req * nb + 8)
    rows: list[dict] = []
    inst = ctx if rank == 0 else gen
    layers = syn.make_layers(model, inst, 0, device)
    alloc = syn.PageAllocator(model.total_groups, inst.num_pages, seed=rank)
    reqs = [alloc.alloc(i, cfg["tokens"], [nb] * model.total_groups) for i in range(n_req)]
    info = syn.make_rank_info(model, inst, 0)
    payload = sum(nb * model.tokens_per_block * ly.elems_per_token * ly.pool.element_size() for ly in layers) * n_req
    c.log(f"{n_req} requests x {nb} blocks, {payload / 1e9:.3f} GB; connecting")
    if rank == 0:
        ep = KVSender(transport, info, layers, timeout_s=cfg["timeout"])
        ep.connect("gen", gen.ranks)
        for r in reqs:
            _fill(layers, r, model.tokens_per_block, device)
        _sync(device)
    else:
        ep = KVReceiver(transport, info, layers, timeout_s=cfg["timeout"])
        ep.connect("ctx", ctx.ranks)
    c.log("connected")
    # An untimed round first (one request): compiles and tunes pack/unpack, warms NCCL's channels. Then
    # ``reps`` timed rounds of the whole batch (fresh transfer ids each); the median is reported and every page
    # of the last round is verified.
    rounds = [("warm-up", [(10_000, 0)])]
    rounds += [(f"timed {k}", [(1_000 * k + i, i) for i in range(n_req)]) for k in range(cfg["reps"])]
    if cfg.get("profile_dir"):  # one more round under the profilers, after (and not among) the timed ones
        rounds.append(("profiled", [(1_000 * cfg["reps"] + i, i) for i in range(n_req)]))
    timed: list[float] = []
    for rnd, ids in rounds:
        profile = rnd == "profiled"
        if rank == 1:
            for tid, i in ids:
                ep.request(tid, reqs[i], "ctx")
            c.log(f"{rnd}: {len(ids)} receives posted")
        c.barrier(f"before {rnd} transfer")
        prof = _profiler(device) if profile else None
        t0 = time.perf_counter()
        if rank == 0:
            for tid, i in ids:
                ep.send(tid, reqs[i], "gen")
            posted = time.perf_counter() - t0
            st = ep.wait()
            assert sorted(st.completed) == sorted(t for t, _ in ids) and not st.failed, st.failed
            c.log(
                f"{rnd}: sends posted after {posted * 1e3:.2f} ms, done after {(time.perf_counter() - t0) * 1e3:.2f} ms"
            )
        else:
            st = ep.check_status(blocking=True)
            _sync(device)
            seconds = time.perf_counter() - t0
            assert sorted(st.completed) == sorted(t for t, _ in ids) and not st.failed, st.failed
            c.log(f"{rnd}: received and unpacked in {seconds * 1e3:.2f} ms")
            if rnd.startswith("timed"):
                timed.append(seconds)
        if prof is not None:
            _profile_dump(prof, device, Path(cfg["profile_dir"]) / f"transfer_profile_rank{rank}.txt")
    if rank == 1:
        seconds = statistics.median(timed)
        checked = bad = 0
        for r in reqs:
            n_checked, n_bad = _verify(layers, r, list(range(nb)), device)
            checked, bad = checked + n_checked, bad + n_bad
        c.log(f"verified {checked} blocks, {bad} differ")
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
                "rounds_ms": [round(t * 1e3, 2) for t in timed],
            }
        )
    c.barrier("after transfer")
    del layers
    # Raw transport: one message of the same bytes.
    buf = torch.empty(payload, dtype=torch.uint8, device=device)

    def raw_msg() -> None:
        h = transport.isend(buf, 1, _RAW_TAG) if rank == 0 else transport.irecv(buf, 0, _RAW_TAG)
        while not h.done():
            pass

    raw = []
    for i in range(2 + cfg["reps"]):
        c.barrier(f"raw message {i}")
        _sync(device)
        t0 = time.perf_counter()
        raw_msg()
        _sync(device)
        raw.append(time.perf_counter() - t0)
    if rank == 1:
        s = statistics.median(raw[2:])
        rows.append(
            {"part": "transfer", "provider": f"raw {transport.backend} message", "seconds": s, "bytes": payload}
        )
        rows[-1]["GBps"] = payload / s / 1e9
    c.log("raw messages done")
    # GPU-to-GPU copies from rank 0 while rank 1 waits on the host (its GPU idle).
    if rank == 0 and device.type == "cuda" and torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1)
        to_s = _median_time(lambda: buf.to(other), other, cfg["reps"])
        dst = torch.empty(payload, dtype=torch.uint8, device=other)
        copy_s = _median_time(lambda: dst.copy_(buf), other, cfg["reps"])
        for name, s in (('tensor.to("cuda:1")', to_s), ("copy_ into cuda:1 (preallocated)", copy_s)):
            rows.append(
                {"part": "transfer", "provider": name, "seconds": s, "bytes": payload, "GBps": payload / s / 1e9}
            )
        c.log("GPU-to-GPU copies done")
    c.barrier("end")
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


def part_helix(c: Ctx) -> list[dict]:
    import torch.distributed as dist

    from kvforge.disagg.mapping import helix_blocks
    from kvforge.kernels.merge_states import merge_attention_states

    rank, world, cfg, device = c.rank, c.world, c.cfg, c.device
    B, H, N, tpb = cfg["helix_batch"], cfg["helix_heads"], cfg["helix_tokens"], cfg["tpb"]
    dk, dv = cfg["elems"], cfg["elems"] - 64
    scale = 1.0 / dk**0.5
    g = torch.Generator(device="cpu").manual_seed(7)
    # The same inputs on every rank (generated on the host, then copied): q and the latent cache.
    q = (torch.randn(B, H, dk, generator=g) * 0.5).to(torch.bfloat16).to(device)
    kv = torch.randn(B, N, dk, generator=g).to(torch.bfloat16).to(device)
    rows: list[dict] = []
    cps = [c for c in (2, 4, 8) if c <= world]
    # One group per CP size, every one created by every rank in the same order (NCCL: a split of the default
    # communicator; non-members take part in the split too).
    groups = {cp: dist.new_group(list(range(cp))) for cp in cps}
    c.log(f"groups for CP {cps} created")
    full = None
    if rank == 0:
        full, _ = _decode_attention(q, kv, kv[..., :dv], scale)
        single = _median_time(lambda: _decode_attention(q, kv, kv[..., :dv], scale), device, cfg["reps"] * 5)
        rows.append({"part": "helix", "provider": "single GPU", "cp": 1, "seconds": single})
        c.log(f"single-device step {single * 1e3:.3f} ms")
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

            c.log(f"CP={cp}: first step ...")
            merged = step()
            _sync(device)
            c.log(f"CP={cp}: first step done; timing")
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
                c.log(f"CP={cp}: {t * 1e3:.3f} ms per step, relative RMSE {rel:.2e}")
        c.barrier(f"after CP={cp}")
    return rows


def part_probe_and_faults(c: Ctx) -> list[dict]:
    from kvforge.disagg import synthetic as syn
    from kvforge.disagg.transceiver import KVReceiver, KVSender

    rank, world, cfg, device, transport = c.rank, c.world, c.cfg, c.device, c.transport
    model = syn.ModelSpec(num_layers=2, head_dim=64, tokens_per_block=cfg["tpb"], num_groups=1)
    rows: list[dict] = []
    c.log("probe: start")
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
    c.barrier("probe: after the uneven polls")
    if rank != world - 1:
        rx.request(900, alloc.alloc(900, 0, [0] * model.total_groups), "ctx0")
    st = rx.check_status(blocking=True)
    trace.append(("blocking", tuple(st.completed)))
    poll()
    c.log("probe: polls done")
    traces = c.gather(trace)
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
        c.log("helix transfer 0 -> (1, 2): start")
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
        c.log("helix transfer 0 -> (1, 2): done")
        collected = c.gather(res)
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
    c.barrier("faults: start")
    fctx, fgen = syn.InstanceSpec("fctx", (0,)), syn.InstanceSpec("fgen", (1,))
    ep = rx2 = None
    if rank in (0, 1):
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
        else:
            rx2 = KVReceiver(transport, info, flayers, release=falloc.release, timeout_s=cfg["fault_timeout"])
            rx2.connect("fctx", fctx.ranks)
            for i, r in enumerate(reqs):
                rx2.request(2000 + i, r, "fctx")
        c.log("faults: connected")
    c.barrier("faults: receives posted")
    if ep is not None:
        for i in range(2):  # then it stops: transfers 2002 and 2003 are never sent
            ep.send(2000 + i, reqs[i], "fgen")
        ep.wait()
        c.log("faults: context sent 2 of 4 and stopped")
    if rx2 is not None:
        t0 = time.perf_counter()
        st = rx2.check_status(blocking=True)
        waited = time.perf_counter() - t0
        c.log(
            f"faults: generation side ended after {waited:.2f} s: completed {st.completed}, failed {sorted(st.failed)}"
        )
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
    # The context side stays alive (stopped, not dead) until the generation side has given up. No device-wide
    # synchronisation after this point: the generation side's two unmatched NCCL receives stay posted.
    c.barrier("faults: end")
    return rows


SCENARIOS = {"transfer": part_transfer, "helix": part_helix, "probe_faults": part_probe_and_faults}
# Share of the run's time each scenario may take (a scenario that ends early leaves its time to the next).
_SHARES = {"transfer": 0.4, "helix": 0.25, "probe_faults": 0.35}


def scenario_entry(rank: int, world: int, port: int, backend: str, pg_timeout_s: float, name: str, cfg: dict):
    """One scenario's worker: its own process group (a hang or crash stays inside the scenario)."""
    import datetime
    import warnings

    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor; torch 2.11 (the GPU machine) has only the old name.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")
    t_start = time.time()

    def log(step: str) -> None:
        print(f"[{time.time() - cfg['t0']:7.1f}s] rank {rank} {name}: {step}", flush=True)

    log("process started")
    if backend == "nccl":
        # Set the device before any CUDA or NCCL call, and bind it to the group: NCCL then creates the world's
        # communicator now (eager), every rank's collectives run on its own GPU (no guessed device), and a
        # send/receive uses that communicator instead of creating a 2-rank one on a rank's first P2P call
        # (which blocks that rank until its peer makes its own first P2P call).
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    import kvforge.kernels  # noqa: F401
    from kvforge.disagg.transport import TorchDistTransport

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s), **kw
    )
    log(f"process group up ({backend}, device {device}) in {time.time() - t_start:.1f} s")
    # Host-side control (barriers, result gathering): gloo, never NCCL. Every rank creates the groups here, in
    # the same order: the bench's control group, then the transport's.
    ctrl = (
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout_s)) if backend == "nccl" else None
    )
    transport = TorchDistTransport()
    c = Ctx(rank, world, cfg, device, transport, ctrl, name)
    c.barrier("start")
    rows = SCENARIOS[name](c)
    log(f"finished, {len(rows)} rows")
    return rows


def run_scenario(name: str, world: int, backend: str, cfg: dict, budget_s: float, env: dict) -> tuple[list, str]:
    """Run one scenario in a fresh process world bounded by ``budget_s``; returns (rows, status line)."""
    import torch.distributed as dist

    from kvforge.disagg.launch import launch_workers

    t0 = time.time()
    print(f"[{t0 - cfg['t0']:7.1f}s] scenario {name}: {world} processes, budget {budget_s:.0f} s", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    try:
        results = launch_workers(
            scenario_entry,
            world,
            env_overrides=env,
            args=(store.port, backend, max(30.0, budget_s), name, cfg),
            timeout_s=budget_s,
        )
    finally:
        del store
    rows = [row for r in results if r.value for row in r.value]
    failed = [r for r in results if not r.reported]
    for r in failed:
        print(f"scenario {name}: rank {r.rank} failed (exit {r.exitcode}):\n{r.error}", file=sys.stderr, flush=True)
    status = "ok" if not failed else f"FAILED on rank(s) {[r.rank for r in failed]}"
    line = f"[{time.time() - cfg['t0']:7.1f}s] scenario {name}: {status} in {time.time() - t0:.1f} s"
    print(line, flush=True)
    return rows, status


def report(rows: list[dict], out: Path, stamp: dict[str, str], smoke: bool) -> None:
    copies = [r["GBps"] for r in rows if r["part"] == "transfer" and "cuda:1" in r["provider"]]
    best_copy = max(copies) if copies else None
    print(f"\n{'part':9s} {'provider':42s} {'ms':>9s} {'GB/s':>8s}  notes")
    for r in rows:
        notes = {k: v for k, v in r.items() if k not in ("part", "provider", "seconds", "GBps", "bytes", "trace")}
        if (
            r["part"] == "transfer"
            and best_copy
            and "GBps" in r
            and not r["provider"].startswith(("tensor.to", "copy_"))
        ):
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
    tr = [r for r in rows if r["part"] == "transfer" and "GBps" in r]
    hx = [r for r in rows if r["part"] == "helix" and "seconds" in r]
    png = out / "bench_multi_gpu.png"
    bar_plot(
        png,
        f"KV transfer between two GPUs\n{stamp['gpu']}, torch {stamp['torch']} (GB/s, higher is better)",
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
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of one timed transfer round")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before every worker is stopped")
    args = parser.parse_args(argv)
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
        # Mute the note that unbatched P2P ops share the eagerly created communicator (intended: nothing else runs
        # on it). A stuck NCCL op ends its process when the group's timeout (the scenario's budget) expires.
        env = {"TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "false"}
    cfg["backend"] = backend
    if args.profile:
        cfg["profile_dir"] = str(args.out)
    cfg["t0"] = time.time()
    deadline = cfg["t0"] + args.timeout - 10.0  # leaves time to write the CSV and PNGs
    stamp = env_stamp()
    print(" ".join(f"{k}={v}" for k, v in stamp.items()), f"world={world} backend={backend}", flush=True)
    rows: list[dict] = []
    statuses: dict[str, str] = {}
    names = list(SCENARIOS)
    for i, name in enumerate(names):
        left = deadline - time.time()
        budget = left * _SHARES[name] / sum(_SHARES[n] for n in names[i:])
        if budget < 20:
            statuses[name] = f"skipped (only {left:.0f} s left)"
            print(f"scenario {name}: {statuses[name]}", flush=True)
            continue
        n = 2 if name == "transfer" else world
        got, statuses[name] = run_scenario(name, n, backend, cfg, budget, env)
        rows += got
    order = ["transfer", "helix", "probe", "faults"]
    rows.sort(key=lambda row: order.index(row["part"]))
    for name, st in statuses.items():
        rows.append({"part": "faults" if name == "probe_faults" else name, "provider": f"scenario {name}: {st}"})
    report(rows, args.out, stamp, smoke)
    ok = all(st == "ok" for st in statuses.values())
    print(f"result: {'all scenarios completed' if ok else 'some scenarios failed'}: {statuses}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
