"""The transfer plan covers every (layer, head, block) a generation rank needs exactly once, from a context rank
that holds it, for TP, PP and helix CP of sizes 1, 2, 4 and 8, MLA and GQA, with and without draft layers."""

from __future__ import annotations

import itertools

import pytest

from kvforge.disagg.mapping import InstanceLayout, helix_block_count, helix_blocks, layouts_for, plan_pieces
from tests.helpers import plan_delivery, rank_info

SIZES = [1, 2, 4, 8]


def layout(tp=1, pp=1, cp=1, layers=8, drafts=1, mla=True) -> InstanceLayout:
    base, extra = divmod(layers, pp)
    split = tuple(base + (p < extra) for p in range(pp))
    return InstanceLayout(tp, pp, cp, split, drafts, mla)


def check_cover(ctx: InstanceLayout, gen: InstanceLayout, heads: int, num_blocks: int):
    pieces = plan_pieces(ctx, gen)
    for g in range(gen.world_size):
        got, need = plan_delivery(ctx, gen, [p for p in pieces if p.gen_rank == g], g, heads, num_blocks)
        assert len(got) == len(set(got)), f"gen rank {g} receives something twice"
        assert set(got) == need, (
            f"gen rank {g}: missing {sorted(need - set(got))[:3]} extra {sorted(set(got) - need)[:3]}"
        )


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "gqa"])
def test_tp_and_pp_combinations_cover_exactly(mla):
    for ctp, cpp, gtp, gpp in itertools.product(SIZES, [1, 2], SIZES, [1, 2, 4]):
        check_cover(layout(ctp, cpp, mla=mla), layout(gtp, gpp, mla=mla), heads=8, num_blocks=3)


@pytest.mark.parametrize("cp", SIZES)
@pytest.mark.parametrize("num_blocks", [0, 1, 5, 9, 16])
def test_helix_cp_covers_every_block_once(cp, num_blocks):
    for ctp, gtp, mla in itertools.product([1, 2], [1, 2], [True, False]):
        check_cover(layout(ctp, mla=mla), layout(gtp, 1, cp, mla=mla), heads=4, num_blocks=num_blocks)


def test_helix_deal_is_round_robin_with_lower_ranks_taking_the_extra_block():
    assert [list(helix_blocks(10, r, 4)) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    for n, cp in itertools.product(range(0, 20), SIZES):
        counts = [helix_block_count(n, r, cp) for r in range(cp)]
        assert sum(counts) == n and counts == sorted(counts, reverse=True) and counts[0] - counts[-1] <= 1


def test_mla_generation_ranks_spread_over_context_tp_ranks():
    pieces = plan_pieces(layout(tp=4), layout(tp=2, cp=2))
    assert sorted(p.ctx_rank for p in pieces) == [0, 1, 2, 3]


def test_gqa_head_slices_follow_both_tp_sizes():
    pieces = plan_pieces(layout(tp=2, mla=False), layout(tp=4, mla=False))
    assert [(p.ctx_rank, p.gen_rank, p.head_range(8)) for p in pieces] == [
        (0, 0, (0, 2)),
        (0, 1, (2, 4)),
        (1, 2, (4, 6)),
        (1, 3, (6, 8)),
    ]
    pieces = plan_pieces(layout(tp=4, mla=False), layout(tp=1, mla=False))
    assert [p.head_range(8) for p in pieces] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_draft_layers_ride_with_the_last_stage_only():
    pieces = plan_pieces(layout(pp=2, drafts=2), layout(pp=1, drafts=2))
    assert [(p.ctx_rank, p.target_layers, p.draft_layers) for p in pieces] == [
        (0, (0, 1, 2, 3), ()),
        (1, (4, 5, 6, 7), (0, 1)),
    ]


def test_unsupported_layouts_are_rejected():
    with pytest.raises(ValueError, match=r"ctx\.cp_size"):
        plan_pieces(layout(cp=2), layout())
    with pytest.raises(ValueError, match="layers_per_pp"):
        plan_pieces(layout(layers=8), layout(layers=9))
    # A rank announcing a DP group its TP rank is not in (TP rank 1 of 2 with dp 2 is DP group 1).
    info = rank_info(tp_size=2, tp_rank=1, instance_rank=1, dp_size=2, dp_rank=0, attention_dp=True)
    with pytest.raises(ValueError, match="dp_rank: under attention DP"):
        layouts_for(info, rank_info(instance_name="b"))
