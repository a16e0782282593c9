"""Attention-DP KV transfer: the plan per (context DP rank, generation DP rank), the peer check's acceptances and
refusals, the wire, and byte-exact transfers between gloo processes (dp 2 -> dp 1 and the reverse, with draft
layers, MLA and GQA, asymmetric TP), with the pages released exactly once when a peer dies mid-transfer.

The reference system accepts attention-DP peers and asymmetric MLA-TP peers with draft views (its peer check
dropped the total-TP and attention-DP checks for a per-DP attention-TP check skipped for MLA); its transfer plan
picks the peer's ranks from the request's DP rank (``peer_dp_rank * tp_per_dp_group`` onwards).
"""

from __future__ import annotations

import collections
import itertools
import os

import msgpack
import pytest

from kvforge.disagg import synthetic as syn
from kvforge.disagg.launch import run_world
from kvforge.disagg.mapping import InstanceLayout, layouts_for, plan_pieces
from kvforge.disagg.peer import PeerMismatchError, check_peer, peer_mismatches
from kvforge.disagg.rank_info import RankInfo
from tests.helpers import plan_delivery, rank_info

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
DRAFT = dict(num_draft_layers=2, draft_kv_dtype="float8_e4m3fn", draft_kv_heads=1)
GQA = dict(is_mla=False, kv_heads=8, head_dim=64)
GQA_DRAFT = {**DRAFT, "draft_kv_heads": 4}


# --- the plan ------------------------------------------------------------------------------------------------------


def layout(tp=1, dp=1, pp=1, cp=1, layers=6, drafts=2, mla=True) -> InstanceLayout:
    base, extra = divmod(layers, pp)
    return InstanceLayout(tp, pp, cp, tuple(base + (p < extra) for p in range(pp)), drafts, mla, dp)


def check_dp_cover(ctx: InstanceLayout, gen: InstanceLayout, heads: int, num_blocks: int) -> None:
    for c_dp, g_dp in itertools.product(range(ctx.dp_size), range(gen.dp_size)):
        pieces = plan_pieces(ctx, gen, ctx_dp_rank=c_dp, gen_dp_rank=g_dp)
        assert {ctx.dp_rank_of(p.ctx_rank) for p in pieces} <= {c_dp}, "a rank of another context DP group sends"
        for g in range(gen.world_size):
            mine = [p for p in pieces if p.gen_rank == g]
            if gen.dp_rank_of(g) != g_dp:
                assert mine == [], f"gen rank {g} of DP group {gen.dp_rank_of(g)} receives a group-{g_dp} request"
                continue
            got, need = plan_delivery(ctx, gen, mine, g, heads, num_blocks)
            assert len(got) == len(set(got)), f"dp ({c_dp}, {g_dp}): gen rank {g} receives something twice"
            assert set(got) == need, f"dp ({c_dp}, {g_dp}): gen rank {g} missing {sorted(need - set(got))[:3]}"


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "gqa"])
def test_every_dp_pair_covers_its_groups_exactly(mla):
    shapes = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 8)]  # (tp, dp)
    for (ctp, cdp), (gtp, gdp), gpp in itertools.product(shapes, shapes, [1, 2]):
        check_dp_cover(layout(ctp, cdp, mla=mla), layout(gtp, gdp, pp=gpp, mla=mla), heads=8, num_blocks=3)


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "gqa"])
def test_dp_with_helix_generation_covers_every_block_once(mla):
    for (ctp, cdp), gcp, nb in itertools.product([(2, 2), (4, 2)], [2, 4], [0, 1, 5, 9]):
        check_dp_cover(layout(ctp, cdp, mla=mla), layout(2, 2, cp=gcp, mla=mla), heads=4, num_blocks=nb)


def test_dp_rank_picks_the_rank_group_on_each_side():
    # dp 2 x tp 4 (2 attention-TP ranks per group) -> dp 1 x tp 2, MLA: each generation rank reads from one
    # context rank of the request's group, round-robin over that group's two ranks.
    ctx, gen = layout(4, 2), layout(2, 1)
    assert [(p.ctx_rank, p.gen_rank) for p in plan_pieces(ctx, gen, ctx_dp_rank=1)] == [(2, 0), (3, 1)]
    assert [(p.ctx_rank, p.gen_rank) for p in plan_pieces(ctx, gen, ctx_dp_rank=0)] == [(0, 0), (1, 1)]
    # The reverse, GQA: a group of one rank holds every head and receives them from both context ranks.
    ctx, gen = layout(2, 1, mla=False), layout(4, 4, mla=False)
    got = [(p.ctx_rank, p.gen_rank, p.head_range(8)) for p in plan_pieces(ctx, gen, gen_dp_rank=3)]
    assert got == [(0, 3, (0, 4)), (1, 3, (4, 8))]
    # Draft layers ride with the request's group like the target layers.
    assert all(p.draft_layers == (0, 1) for p in plan_pieces(layout(2, 2), layout(1), ctx_dp_rank=1))


def test_plan_refuses_dp_ranks_outside_the_instance():
    with pytest.raises(ValueError, match=r"ctx_dp_rank: expected an int in \[0, 2\)"):
        plan_pieces(layout(2, 2), layout(), ctx_dp_rank=2)
    with pytest.raises(ValueError, match=r"gen_dp_rank: expected an int in \[0, 1\)"):
        plan_pieces(layout(2, 2), layout(), gen_dp_rank=1)
    with pytest.raises(ValueError, match="tp_size % dp_size"):
        layout(4, 3)


# --- the peer check: what is accepted, what stays refused -----------------------------------------------------------


def dp_info(tp=1, dp=1, tp_rank=0, **kw) -> RankInfo:
    atp = tp // dp
    return rank_info(
        tp_size=tp,
        tp_rank=tp_rank,
        instance_rank=tp_rank,
        dp_size=dp,
        dp_rank=tp_rank // atp if dp > 1 else 0,
        attention_dp=dp > 1,
        **kw,
    )


@pytest.mark.parametrize(
    "a,b",
    [
        (dict(tp=2, dp=2, **DRAFT), dict(tp=1, **DRAFT)),  # MLA dp 2 -> dp 1, draft views on both sides
        (dict(tp=4, dp=2, **DRAFT), dict(tp=2, **DRAFT)),  # MLA: attention TP 2 per group vs TP 2
        (dict(tp=8, dp=8, **DRAFT), dict(tp=3, **DRAFT)),  # MLA asymmetric TP (1 per group vs 3)
        (dict(tp=4, dp=4, **GQA), dict(tp=2, **GQA)),  # GQA: attention TP 1 vs 2 splits 8 heads
        (dict(tp=4, dp=2, **GQA, **GQA_DRAFT), dict(tp=8, dp=2, **GQA, **GQA_DRAFT)),  # attention TP 2 vs 4
        (dict(tp=2, dp=2), dict(tp=2, cp_size=4)),  # attention DP context -> helix generation
    ],
)  # fmt: skip
def test_attention_dp_and_asymmetric_mla_peers_are_accepted(a, b):
    x = dp_info(**a)
    y = dp_info(instance_name="b", **b)
    for local, peer in ((x, y), (y, x)):
        check_peer(local, peer)
        ctx, gen = layouts_for(local, peer)
        assert ctx.num_draft_layers == gen.num_draft_layers == (2 if "num_draft_layers" in a else 0)


@pytest.mark.parametrize(
    "a,b,needle",
    [
        # The reference system's refusals stay: CP on both sides; a per-DP attention TP that cannot split the
        # KV heads (target or shared draft heads) of a non-MLA cache; helix with unequal page sizes.
        (dict(tp=2, dp=2, cp_size=2), dict(cp_size=2), "cp_size: local 2 vs peer 2"),
        (dict(tp=6, dp=2, **GQA), dict(tp=2, **GQA), "attention TP size per DP group: local 3 vs peer 2"),
        (
            dict(tp=4, dp=2, **GQA, **DRAFT),
            dict(tp=1, **GQA, **DRAFT),
            "attention TP size per DP group: local 2 vs peer 1",
        ),
        (dict(tp=2, dp=2), dict(cp_size=2, tokens_per_block=32), "tokens_per_block (page size): local 64 vs peer 32"),
    ],
)
def test_layouts_the_reference_refuses_stay_refused(a, b, needle):
    x, y = dp_info(**a), dp_info(instance_name="b", **b)
    assert any(p.startswith(needle) for p in peer_mismatches(x, y)), peer_mismatches(x, y)
    with pytest.raises(PeerMismatchError, match="is incompatible"):
        check_peer(x, y)


def test_dp_size_without_attention_dp_does_not_split_the_tp_ranks():
    # As in the reference system (tp_size_per_dp_group is tp_size without attention DP): one group of every TP rank.
    plain = rank_info(tp_size=2, tp_rank=1, instance_rank=1, dp_size=2, dp_rank=0, attention_dp=False)
    check_peer(plain, rank_info(instance_name="b"))
    ctx, gen = layouts_for(plain, rank_info(instance_name="b"))
    assert (ctx.dp_size, ctx.attention_tp_size) == (1, 2)
    assert [p.ctx_rank for p in plan_pieces(ctx, gen)] == [0]


def test_a_rank_in_another_dp_group_than_it_announces_is_refused():
    bad = rank_info(tp_size=4, tp_rank=2, instance_rank=2, dp_size=4, dp_rank=1, attention_dp=True)
    with pytest.raises(PeerMismatchError, match="TP rank 2 of 4 with dp_size 4 belongs to DP group 2"):
        check_peer(rank_info(instance_name="b"), bad)
    with pytest.raises(ValueError, match="belongs to DP group 2"):
        layouts_for(bad, rank_info(instance_name="b"))
    # RankInfo itself refuses a DP size that does not divide the TP ranks.
    with pytest.raises(ValueError, match="tp_size % dp_size"):
        rank_info(tp_size=4, dp_size=3, attention_dp=True)


# --- the wire -------------------------------------------------------------------------------------------------------

# The fields of a reader from before draft layers (main's first RankInfo): it builds itself with cls(**fields).
OLD_FIELDS = [
    *("version", "instance_name", "instance_rank", "transport_rank", "tp_size", "tp_rank", "pp_size", "pp_rank"),
    *("dp_size", "dp_rank", "cp_size", "cp_rank", "attention_dp", "layers_per_pp", "is_mla", "kv_heads"),
    *("head_dim", "kv_dtype", "element_bytes", "tokens_per_block", "page_groups"),
]
OldRankInfo = collections.namedtuple("OldRankInfo", OLD_FIELDS)


def test_an_old_reader_decodes_an_attention_dp_message_with_optional_fields_unset():
    new = dp_info(tp=4, dp=2, tp_rank=3, instance_name="ctx-dp")
    old = OldRankInfo(**msgpack.unpackb(new.to_wire(), raw=False))
    assert (old.dp_size, old.dp_rank, old.attention_dp, old.tp_rank) == (2, 1, True, 3)
    assert RankInfo.from_wire(msgpack.packb(old._asdict(), use_bin_type=True)) == new
    # With draft fields set, the old reader refuses the message loudly (unknown keys), never misreads it.
    with pytest.raises(TypeError):
        OldRankInfo(**msgpack.unpackb(dp_info(tp=2, dp=2, **DRAFT).to_wire(), raw=False))


def test_message_header_is_unchanged_without_attention_dp():
    from kvforge.disagg.transceiver import _piece_word

    assert [_piece_word(i, 0, 0) for i in range(5)] == list(range(5))  # format 1 as before DP
    words = {_piece_word(i, c, g) for i in range(3) for c in range(4) for g in range(4)}
    assert len(words) == 3 * 4 * 4  # a DP disagreement between the two sides changes the header


# --- byte-exact transfers between processes --------------------------------------------------------------------------

PROMPTS = [0, 1, 4, 7, 18, 33, 5, 12]  # 8 requests: every (context, generation) DP pair several times
MLA = syn.ModelSpec(num_layers=3, num_draft_layers=2, head_dim=12, tokens_per_block=4)
GQA_M = syn.ModelSpec(num_layers=2, is_mla=False, kv_heads=4, draft_kv_heads=2, head_dim=6, tokens_per_block=4)
Inst = syn.InstanceSpec

SCENARIOS = [
    ("mla dp2 -> dp1", MLA, Inst("c", (0, 1), tp=2, dp=2), Inst("g", (2,))),
    ("mla dp1 -> dp2", MLA, Inst("c", (0,)), Inst("g", (1, 2), tp=2, dp=2)),
    # Asymmetric MLA TP: 2 attention-TP ranks per context DP group against 3 generation TP ranks.
    ("mla dp2 tp4 -> tp3 (asymmetric)", MLA, Inst("c", (0, 1, 2, 3), tp=4, dp=2), Inst("g", (4, 5, 6), tp=3)),
    ("gqa dp2 -> tp2", GQA_M, Inst("c", (0, 1), tp=2, dp=2), Inst("g", (2, 3), tp=2)),
    ("gqa tp2 -> dp2", GQA_M, Inst("c", (0, 1), tp=2), Inst("g", (2, 3), tp=2, dp=2)),
    ("gqa dp2 tp4 -> dp2 tp2", GQA_M, Inst("c", (0, 1, 2, 3), tp=4, dp=2), Inst("g", (4, 5), tp=2, dp=2)),
    ("mla dp2 -> helix cp2", MLA, Inst("c", (0, 1), tp=2, dp=2), Inst("g", (2, 3), cp=2)),
]
WORLD = 7


def dp_transfer_world(rank: int, world: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from kvforge.disagg.transport import TorchDistTransport

    transport = TorchDistTransport()
    out: dict = {}
    for k, (name, model, ctx, gen) in enumerate(SCENARIOS):
        res = syn.run_pair(
            transport, model, ctx, gen, PROMPTS, seed, first_transfer_id=100 * k, device=torch.device("cpu"),
            timeout_s=40,
        )  # fmt: skip
        if res is not None:
            out[name] = res
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_attention_dp_transfers_are_byte_exact_with_draft_layers():
    seed = int.from_bytes(os.urandom(3), "little")
    results = run_world(dp_transfer_world, WORLD, args=(seed,), timeout_s=280, env_overrides=CPU_ONLY)
    bad = [f"rank {r.rank}: exit {r.exitcode}\n{r.error}" for r in results if not r.reported]
    assert not bad, f"seed {seed}:\n" + "\n".join(bad)
    by_rank = [r.value for r in results]
    for k, (name, model, ctx, gen) in enumerate(SCENARIOS):
        where = f"{name} (seed {seed})"
        ids = {side: collections.defaultdict(list) for side in ("c", "g")}
        for i in range(len(PROMPTS)):
            c_dp, g_dp = syn.dp_pair(i, ctx, gen)
            ids["c"][c_dp].append(100 * k + i)
            ids["g"][g_dp].append(100 * k + i)
        for inst, side in ((ctx, "c"), (gen, "g")):
            for ir, r in enumerate(inst.ranks):
                res = by_rank[r][name]
                assert res.failed == {}, f"{where}: {res.role} rank {r} failures {res.failed}"
                # Each rank completes exactly the requests of its own DP group.
                assert sorted(res.completed) == ids[side][inst.dp_rank(ir)], f"{where}: rank {r} {res.completed}"
                assert res.leaked_pages == 0 and res.orphans == 0, f"{where}: rank {r} leaked pages or buffers"
        gen_res = [by_rank[r][name] for r in gen.ranks]
        problems = [p for res in gen_res for p in res.check.problems]
        assert problems == [], f"{where}: {problems[:5]}"
        # Blocks verified: every request by every rank of its generation DP group (helix splits the blocks).
        blocks = sum(-(-n // model.tokens_per_block) for n in PROMPTS)
        checked = {o: sum(res.check.blocks_checked[o] for res in gen_res) for o in ("target", "draft")}
        assert checked == {
            "target": model.num_layers * blocks * gen.attention_tp,
            "draft": model.num_draft_layers * blocks * gen.attention_tp,
        }, f"{where}: verified {checked}"


# --- a peer dies mid-transfer: pages released exactly once ----------------------------------------------------------

FAULT_MODEL = syn.ModelSpec(num_layers=2, is_mla=False, kv_heads=4, draft_kv_heads=2, head_dim=6, tokens_per_block=4)
FC = Inst("C", (0, 1), tp=2)  # one DP group of two ranks: a request needs both ranks' heads
FG = Inst("G", (2, 3), tp=2, dp=2)  # two DP groups of one rank each
FB = Inst("B", (4, 5), tp=2, dp=2)  # a second context instance with attention DP, for the retry
FAULT_TOKENS = 13


def fault_world(rank: int, world: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from kvforge.disagg.transceiver import KVReceiver, KVSender
    from kvforge.disagg.transport import TorchDistTransport

    t = TorchDistTransport()
    g_group = t.new_group(FG.ranks)
    survivors = dist.new_group([0, 2, 3, 4, 5])
    c_group = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    m = FAULT_MODEL
    nb = -(-FAULT_TOKENS // m.tokens_per_block)
    out: dict = {}
    ledger: collections.Counter = collections.Counter()  # release calls per request id

    if rank in FG.ranks:
        ir = FG.ranks.index(rank)
        layers = syn.make_layers(m, FG, ir, cpu)
        alloc = syn.PageAllocator(m.total_groups, FG.num_pages, seed + rank)
    else:
        inst = FC if rank in FC.ranks else FB
        ir = inst.ranks.index(rank)
        layers = syn.make_layers(m, inst, ir, cpu)
        alloc = syn.PageAllocator(m.total_groups, inst.num_pages, seed + rank)

    def release(req) -> None:
        ledger[req.request_id] += 1
        alloc.release(req)

    if rank in FG.ranks:
        ep = KVReceiver(t, syn.make_rank_info(m, FG, ir), layers, group=g_group, release=release, timeout_s=20)
        ep.connect("C", FC.ranks)
        ep.connect("B", FB.ranks)
    else:
        ep = KVSender(t, syn.make_rank_info(m, inst, ir), layers, release=release, timeout_s=20)
        ep.connect("G", FG.ranks)
    dist.barrier()

    def gen_request(tid: int, peer: str, peer_dp_rank: int):
        req = alloc.alloc(tid, FAULT_TOKENS, [nb] * m.total_groups)
        ep.request(tid, req, peer, peer_dp_rank=peer_dp_rank)
        return req

    # 1. Request 1 goes to generation DP group 1 (rank 3) from C, whose two ranks each send half the heads.
    #    C's rank 1 dies before sending: rank 3 gets 1 of 2 messages. Rank 2 (DP group 0) is not involved.
    if rank == 3:
        gen_request(1, "C", 0)
    if rank in FG.ranks:
        st = ep.check_status(blocking=True)
        out["killed"] = (list(st.completed), dict(st.failed))
        out["leak_after_kill"] = alloc.leaked
    elif rank == 0:
        req = alloc.alloc(1, FAULT_TOKENS, [nb] * m.total_groups)
        syn.fill_context(m, layers, req, seed, FC.attention_tp_rank(0))
        ep.send(1, req, "G", peer_dp_rank=1)
        out["c0_sent"] = ep.wait().completed
        dist.barrier(group=c_group)
    elif rank == 1:
        alloc.alloc(1, FAULT_TOKENS, [nb] * m.total_groups)
        dist.barrier(group=c_group)
        os._exit(1)  # killed mid-transfer: its half of the heads never leaves
    dist.barrier(group=survivors)

    # 2. Retry from instance B: context DP group 1 (rank 5) -> generation DP group 1 (rank 3), and a second
    #    request from B's group 0 (rank 4) -> generation group 0 (rank 2) at the same time.
    if rank in FG.ranks:
        req = gen_request(2 + ir, "B", ir)  # rank 2: transfer 2 from B group 0; rank 3: transfer 3 from group 1
        st = ep.check_status(blocking=True)
        report = syn.CheckReport()
        if st.completed == [2 + ir]:
            syn.check_generation(m, FG, ir, layers, req, seed, expect_draft=True, report=report)
        out["retry"] = (sorted(st.completed), dict(st.failed), report.problems, dict(report.blocks_checked))
        alloc.release(req)
    elif rank in FB.ranks:
        req = alloc.alloc(2 + ir, FAULT_TOKENS, [nb] * m.total_groups)
        syn.fill_context(m, layers, req, seed, FB.attention_tp_rank(ir))
        ep.send(2 + ir, req, "G", peer_dp_rank=ir)
        out["b_sent"] = ep.wait().completed
    dist.barrier(group=survivors)

    # 3. A generation rank cancels mid-transfer (nothing sent yet): released once, reported once.
    if rank == 2:
        gen_request(9, "B", 0)
        ep.cancel(9)
        with pytest.raises(ValueError, match="no transfer 9 in flight"):
            ep.cancel(9)  # a second cancel must not release again
    if rank in FG.ranks:
        out["cancelled"] = dict(ep.check_status().failed)
        out["in_flight"] = ep.in_flight
    out["ledger"] = dict(ledger)
    out["leaked"] = alloc.leaked
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_peer_dying_mid_transfer_releases_the_pages_exactly_once():
    seed = int.from_bytes(os.urandom(3), "little")
    res = run_world(fault_world, 6, args=(seed,), timeout_s=180, env_overrides=CPU_ONLY)
    assert res[1].exitcode == 1 and res[1].value is None, "rank 1 was meant to die"
    for r in (0, 2, 3, 4, 5):
        assert res[r].reported, f"rank {r} (seed {seed}): exit {res[r].exitcode}\n{res[r].error}"
    c0, g0, g1, b0, b1 = (res[r].value for r in (0, 2, 3, 4, 5))
    # 1. The dead context rank: a clear error on the generation rank of the request's DP group, after one of the
    #    two messages arrived; the other DP group saw nothing of it. Its pages went back exactly once.
    assert g1["killed"][0] == [] and list(g1["killed"][1]) == [1], g1["killed"]
    reason = g1["killed"][1][1]
    assert "from rank 1 failed" in reason and "1 of 2 messages done" in reason, reason
    assert g0["killed"] == ([], {}), g0["killed"]
    assert g1["leak_after_kill"] == 0
    assert c0["c0_sent"] == [1] and c0["ledger"] == {1: 1}  # the sender's pages: once, after its send
    # 2. The retries land byte-exact in both generation DP groups.
    for g, tid in ((g0, 2), (g1, 3)):
        completed, failed, problems, checked = g["retry"]
        assert (completed, failed, problems) == ([tid], {}, []), g["retry"]
        assert checked == {"target": FAULT_MODEL.num_layers * 4, "draft": 4}
    assert b0["b_sent"] == [2] and b1["b_sent"] == [3]
    # 3. Cancellation: one report, one release.
    assert g0["cancelled"] == {9: "cancelled"} and g1["cancelled"] == {}
    # The ledger: every failed or cancelled transfer released exactly once by the transceiver (completed ones
    # are released by their owner here, outside the ledger), and nothing leaked anywhere.
    assert g1["ledger"] == {1: 1} and g0["ledger"] == {9: 1}
    assert b0["ledger"] == {2: 1} and b1["ledger"] == {3: 1}
    assert g0["in_flight"] == g1["in_flight"] == 0
    for r in (0, 2, 3, 4, 5):
        assert res[r].value["leaked"] == 0, f"rank {r} leaked {res[r].value['leaked']} pages"
