"""Peer checks at registration: every failure names the property and both values; compatible pairs pass."""

from __future__ import annotations

import pytest

from kvforge.disagg.peer import PeerMismatchError, check_peer, draft_layers_shared, peer_mismatches
from tests.helpers import rank_info as info

DRAFT = dict(num_draft_layers=1, draft_kv_dtype="float8_e4m3fn", draft_kv_heads=1)
GQA = dict(is_mla=False, kv_heads=8, head_dim=128)
GQA_DRAFT = {**DRAFT, "draft_kv_heads": 4}


@pytest.mark.parametrize(
    "local,peer,what,a,b",
    [
        (dict(), dict(**GQA), "is_mla", "True", "False"),
        (dict(), dict(kv_dtype="float8_e4m3fn", element_bytes=1), "element_bytes", "2", "1"),
        (dict(), dict(kv_dtype="float16"), "kv_dtype", "'bfloat16'", "'float16'"),
        (dict(), dict(tokens_per_block=32), "tokens_per_block", "64", "32"),
        (dict(), dict(head_dim=512), "head_dim", "576", "512"),
        (dict(), dict(layers_per_pp=(5,)), "target layers", "4", "5"),
        (dict(cp_size=2), dict(cp_size=4), "cp_size", "2", "4"),
        (dict(**DRAFT), dict(**{**DRAFT, "num_draft_layers": 2}), "num_draft_layers", "1", "2"),
        (
            dict(**DRAFT),
            dict(**{**DRAFT, "draft_kv_dtype": "bfloat16"}),
            "draft_kv_dtype",
            "'float8_e4m3fn'",
            "'bfloat16'",
        ),
        (
            dict(**GQA, **{**DRAFT, "draft_kv_heads": 2}),
            dict(**GQA, **{**DRAFT, "draft_kv_heads": 4}),
            "draft_kv_heads",
            "2",
            "4",
        ),
        (dict(**GQA), dict(**{**GQA, "kv_heads": 4}), "kv_heads", "8", "4"),
        (dict(**GQA, tp_size=3), dict(**GQA), "attention TP size per DP group", "3", "1"),
    ],
)
def test_every_mismatch_names_both_values(local, peer, what, a, b):
    lo, pe = info(**local), info(instance_name="b", **peer)
    problems = peer_mismatches(lo, pe)
    hits = [p for p in problems if p.startswith(what)]
    assert len(hits) == 1, problems
    assert f"local {a} vs peer {b}" in hits[0]
    with pytest.raises(PeerMismatchError, match="peer 'b' rank 0 is incompatible") as err:
        check_peer(lo, pe)
    assert hits[0] in str(err.value)
    assert isinstance(err.value, ValueError)


def test_helix_page_size_message_explains_why():
    problems = peer_mismatches(info(), info(cp_size=2, tokens_per_block=32))
    assert any("helix deals whole blocks" in p and "local 64 vs peer 32" in p for p in problems)


@pytest.mark.parametrize(
    "local,peer",
    [
        (dict(), dict()),
        (dict(), dict(cp_size=8)),  # helix: cp on the generation side only
        (dict(cp_size=4), dict()),
        (dict(**DRAFT), dict()),  # only one side has a drafter: draft layers are simply not transferred
        (dict(), dict(**DRAFT)),
        (dict(**DRAFT), dict(**DRAFT)),
        (dict(tp_size=4), dict(tp_size=2)),  # MLA: replicated over TP, head split not checked
        (dict(**GQA, tp_size=2), dict(**GQA, tp_size=4)),
    ],
)
def test_compatible_pairs_pass(local, peer):
    check_peer(info(**local), info(instance_name="b", **peer))
    check_peer(info(instance_name="b", **peer), info(**local))


@pytest.mark.parametrize(
    "local,peer",
    [
        (dict(tp_size=3), dict(tp_size=2, attention_dp=True, dp_size=2)),  # MLA: asymmetric TP, DP on one side
        (dict(**GQA, tp_size=8, attention_dp=True, dp_size=4), dict(**GQA, tp_size=1)),  # per-DP TP 2 vs 1
        (dict(**GQA, **GQA_DRAFT, tp_size=4, attention_dp=True, dp_size=4), dict(**GQA, **GQA_DRAFT, tp_size=2)),
    ],
)
def test_attention_dp_peers_are_accepted_by_the_check_and_the_mapping(local, peer):
    from kvforge.disagg.mapping import layouts_for

    a, b = info(**local), info(instance_name="b", **peer)
    for x, y in ((a, b), (b, a)):
        check_peer(x, y)
        layouts_for(x, y)


def test_a_contradictory_dp_rank_is_refused_by_the_same_rule_as_the_mapping():
    from kvforge.disagg.mapping import layouts_for

    bad = info(tp_size=4, tp_rank=3, instance_rank=3, attention_dp=True, dp_size=2, dp_rank=0)
    for x, y in ((bad, info(instance_name="b")), (info(instance_name="b"), bad)):
        with pytest.raises(PeerMismatchError, match="belongs to DP group 1, got dp_rank 0"):
            check_peer(x, y)
        with pytest.raises(ValueError, match="belongs to DP group 1, got dp_rank 0"):
            layouts_for(x, y)


def test_mla_skips_the_attention_tp_check_that_gqa_applies():
    # 3 ranks cannot split 8 KV heads; an MLA cache has one latent head replicated on every rank.
    check_peer(info(tp_size=3), info(instance_name="b"))
    with pytest.raises(PeerMismatchError, match="attention TP size per DP group: local 3 vs peer 1"):
        check_peer(info(**GQA, tp_size=3), info(instance_name="b", **GQA))


def test_draft_layers_shared_only_when_both_sides_have_them():
    assert draft_layers_shared(info(**DRAFT), info(**DRAFT))
    assert not draft_layers_shared(info(**DRAFT), info())
    assert not draft_layers_shared(info(), info(**DRAFT))


def test_all_mismatches_are_reported_at_once():
    problems = peer_mismatches(info(), info(head_dim=512, tokens_per_block=16))
    assert len(problems) == 2


def test_recurrent_state_layers_must_agree():
    state = dict(state_layers=3, state_bytes=4096)
    check_peer(info(**state), info(instance_name="b", **state))
    for other in (dict(), dict(state_layers=3, state_bytes=2048), dict(state_layers=2, state_bytes=4096)):
        with pytest.raises(PeerMismatchError, match="recurrent state"):
            check_peer(info(**state), info(instance_name="b", **other))
    with pytest.raises(ValueError, match="state_layers/state_bytes"):
        info(state_layers=3)
