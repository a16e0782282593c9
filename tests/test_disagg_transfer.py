"""Byte-exact KV transfers between real processes over torch.distributed (gloo), and the idle probe.

One world of 9 processes runs every layout in turn (process start-up dominates the cost, so the scenarios
share it): TP 1->2 and 2->1 (MLA and GQA), PP 2->1, helix CP 1->2, 1->4, 1->8, TP 2 -> TP 2 x CP 2, a drafter on
one side only, and a negative control whose context corrupts its draft layer. Every model has bf16 target
layers in two layer groups and an FP8 draft layer in a third. The generation ranks verify their pages against
a logical cache derived from the seed alone, and the parent checks that the number of draft blocks verified is
the number the layout implies (a verifier that skips missing draft blocks would come up short).
"""

from __future__ import annotations

import os

import pytest

from kvforge.disagg import synthetic as syn
from kvforge.disagg.launch import run_world

WORLD = 9
PROMPTS = [0, 1, 4, 7, 18, 33]  # tokens: no block, partial block, full block, ..., more blocks than CP ranks
MLA = syn.ModelSpec(num_layers=3, head_dim=12, tokens_per_block=4)
GQA = syn.ModelSpec(num_layers=2, is_mla=False, kv_heads=4, draft_kv_heads=2, head_dim=6, tokens_per_block=4)
Inst = syn.InstanceSpec

SCENARIOS = [
    ("tp1->2 mla", MLA, Inst("c", (0,)), Inst("g", (1, 2), tp=2), None),
    ("tp2->1 mla", MLA, Inst("c", (0, 1), tp=2), Inst("g", (2,)), None),
    ("tp1->2 gqa", GQA, Inst("c", (0,)), Inst("g", (1, 2), tp=2), None),
    ("tp2->1 gqa", GQA, Inst("c", (0, 1), tp=2), Inst("g", (2,)), None),
    ("pp2->1", MLA, Inst("c", (0, 1), pp=2), Inst("g", (2,)), None),
    ("cp1->2", MLA, Inst("c", (0,)), Inst("g", (1, 2), cp=2), None),
    ("cp1->4", MLA, Inst("c", (0,)), Inst("g", (1, 2, 3, 4), cp=4), None),
    ("cp1->8", MLA, Inst("c", (0,)), Inst("g", tuple(range(1, 9)), cp=8), None),
    ("tp2->tp2cp2 gqa", GQA, Inst("c", (0, 1), tp=2), Inst("g", (2, 3, 4, 5), tp=2, cp=2), None),
    ("drafter on generation only", MLA, Inst("c", (0,), draft=False), Inst("g", (1,)), None),
    ("negative control: corrupted draft", MLA, Inst("c", (0,)), Inst("g", (1, 2), cp=2), "draft"),
]

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def _probe(transport, rank: int) -> dict | None:
    """Helix group of 4 generation ranks; rank 3 alone registers a transfer before the others."""
    import torch
    import torch.distributed as dist

    from kvforge.disagg.transceiver import KVReceiver, KVSender

    ctx, gen = Inst("pc", (0,)), Inst("pg", (1, 2, 3, 4), cp=4)
    group = transport.new_group(gen.ranks)
    cpu = torch.device("cpu")
    trace = []
    if rank == 0:
        layers = syn.make_layers(MLA, ctx, 0, cpu)
        ep = KVSender(transport, syn.make_rank_info(MLA, ctx, 0), layers, timeout_s=30)
        ep.connect("pg", gen.ranks)
        req = syn.PageAllocator(MLA.total_groups, ctx.num_pages).alloc(0, 16, [4] * MLA.total_groups)
        syn.fill_context(MLA, layers, req, 1, 0)
    elif rank in gen.ranks:
        ir = gen.ranks.index(rank)
        layers = syn.make_layers(MLA, gen, ir, cpu)
        ep = KVReceiver(transport, syn.make_rank_info(MLA, gen, ir), layers, group=group, timeout_s=30)
        ep.connect("pc", ctx.ranks)
        req = syn.PageAllocator(MLA.total_groups, gen.num_pages).alloc(0, 16, [1] * MLA.total_groups)

    def poll():
        before = (ep.stats.probe_skips, ep.stats.consensus_rounds)
        st = ep.check_status()
        trace.append((ep.stats.probe_skips - before[0], ep.stats.consensus_rounds - before[1], st.completed))

    if rank in gen.ranks:
        poll()  # nobody has a session: skipped on every rank
        if rank == 3:
            ep.request(7, req, "pc")
        poll()  # counts 0, 0, 1, 0: every rank runs the consensus
    dist.barrier()
    if rank in gen.ranks and rank != 3:
        ep.request(7, req, "pc")
    dist.barrier()
    if rank == 0:
        ep.send(7, req, "pg")
        assert ep.wait().completed == [7]
    if rank in gen.ranks:
        st = ep.check_status(blocking=True)
        trace.append(("blocking", st.completed))
        poll()  # idle again
    dist.barrier()
    return {"trace": trace, "eligible": ep.probe_eligible} if rank in gen.ranks else None


def transfer_world(rank: int, world: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from kvforge.disagg.transport import TorchDistTransport

    transport = TorchDistTransport()
    out: dict = {}
    for k, (name, model, ctx, gen, corrupt) in enumerate(SCENARIOS):
        res = syn.run_pair(
            transport,
            model,
            ctx,
            gen,
            PROMPTS,
            seed,
            first_transfer_id=100 * k,
            device=torch.device("cpu"),
            timeout_s=40,
            corrupt=corrupt,
        )
        if res is not None:
            out[name] = res
        dist.barrier()
    out["probe"] = _probe(transport, rank)
    return out


def _blocks(model: syn.ModelSpec) -> int:
    return sum(-(-n // model.tokens_per_block) for n in PROMPTS)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_transfers_byte_exact_for_every_layout_and_the_idle_probe():
    seed = int.from_bytes(os.urandom(3), "little")
    results = run_world(transfer_world, WORLD, args=(seed,), timeout_s=220, env_overrides=CPU_ONLY)
    for r in results:
        assert r.reported, f"rank {r.rank} (seed {seed}): exit {r.exitcode}\n{r.error}"
    by_rank = [r.value for r in results]
    ids_of = {name: [100 * k + i for i in range(len(PROMPTS))] for k, (name, *_) in enumerate(SCENARIOS)}
    for name, model, ctx, gen, corrupt in SCENARIOS:
        ctx_res = [by_rank[r][name] for r in ctx.ranks]
        gen_res = [by_rank[r][name] for r in gen.ranks]
        where = f"{name} (seed {seed})"
        for res in ctx_res + gen_res:
            assert res.failed == {}, f"{where}: {res.role} failures {res.failed}"
            assert sorted(res.completed) == ids_of[name], f"{where}: {res.role} completed {res.completed}"
            assert res.leaked_pages == 0 and res.orphans == 0, f"{where}: {res.role} leaked pages or buffers"
        draft = ctx.draft and gen.draft
        checked = {o: sum(res.check.blocks_checked[o] for res in gen_res) for o in ("target", "draft")}
        expect = {
            "target": model.num_layers * _blocks(model) * gen.tp,
            "draft": model.num_draft_layers * _blocks(model) * gen.tp if draft else 0,
        }
        assert checked == expect, f"{where}: verified {checked}, the layout implies {expect}"
        problems = [p for res in gen_res for p in res.check.problems]
        if corrupt is None:
            assert problems == [], f"{where}: {problems[:5]}"
        else:
            # Every draft block of every non-empty prompt is caught, and nothing else is blamed.
            assert len(problems) == expect["draft"] and all(" draft layer " in p for p in problems), problems[:5]

    probes = [by_rank[r]["probe"] for r in (1, 2, 3, 4)]
    assert all(p["eligible"] for p in probes)
    traces = [p["trace"] for p in probes]
    assert all(t == traces[0] for t in traces), f"ranks took different branches: {traces}"
    assert traces[0] == [(1, 0, []), (0, 1, []), ("blocking", [7]), (1, 0, [])]
