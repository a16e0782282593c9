"""merge_attention_states against its fp64 reference, and against attention over the union of the keys.

The second kind of test is what gives the LSE convention teeth: attention over key chunks (one of them empty),
or over helix shards of blocks dealt round-robin, merged, must equal attention over all keys.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.disagg.mapping import helix_blocks
from kvforge.kernels.merge_states import attention_with_lse_ref, merge_attention_states, merge_attention_states_ref
from tests.helpers import assert_all_written, poisoned
from tests.tolerances import assert_close


def random_states(gen, S, T, H, D, dtype, device):
    o = torch.randn(S, T, H, D, generator=gen).to(dtype).to(device)
    lse = (torch.randn(S, T, H, generator=gen) * 5).to(device)
    return o, lse


@pytest.mark.parametrize(
    "S,T,H,D,dtype",
    [
        (1, 3, 2, 16, torch.float32),
        (2, 7, 3, 40, torch.bfloat16),
        (3, 33, 1, 127, torch.float16),
        (5, 1, 16, 64, torch.float32),
        (4, 9, 5, 72, torch.bfloat16),
    ],
)
def test_merge_matches_reference(S, T, H, D, dtype, gen, device, full_sizes):
    if full_sizes:
        T, H, D = T * 37, H * 8, 512 if D == 64 else D
    o, lse = random_states(gen, S, T, H, D, dtype, device)
    out = poisoned((T, H, D), dtype, device)
    out_lse = poisoned((T, H), torch.float32, device)
    got, got_lse = merge_attention_states(o, lse, out=out, out_lse=out_lse)
    assert got is out and got_lse is out_lse
    assert_all_written(out, "out")
    assert_all_written(out_lse, "out_lse")
    ref, ref_lse = merge_attention_states_ref(o, lse)
    assert_close(got, ref, dtype)
    assert_close(got_lse, ref_lse, torch.float32)
    # The merged lse dominates every share's: a kernel returning one share's state would fail here too.
    assert bool((got_lse >= lse.max(0).values - 1e-5).all())


def test_empty_shares_contribute_nothing_even_when_their_output_is_nan(gen, device):
    S, T, H, D = 3, 6, 2, 24
    o, lse = random_states(gen, S, T, H, D, torch.float32, device)
    lse[1, :3] = float("-inf")
    o[1, :3] = float("nan")  # an empty softmax (0/0) in the producing kernel
    lse[:, 4] = float("-inf")  # every share empty for token 4
    o[:, 4] = float("nan")
    got, got_lse = merge_attention_states(o, lse)
    ref, ref_lse = merge_attention_states_ref(o, lse)
    assert not torch.isnan(got).any(), "an empty share leaked NaN into the merge"
    assert torch.equal(got[4], torch.zeros_like(got[4])) and bool(torch.isneginf(got_lse[4]).all())
    keep = torch.ones(T, dtype=torch.bool)
    keep[4] = False
    assert_close(got[keep], ref[keep], torch.float32)
    assert_close(got_lse[keep], ref_lse[keep], torch.float32)
    # Dropping the empty share must give the same answer for tokens 0..2.
    two, two_lse = merge_attention_states(o[[0, 2], :3], lse[[0, 2], :3])
    assert_close(got[:3], two, torch.float32)
    assert_close(got_lse[:3], two_lse, torch.float32)


def test_single_share_is_returned_unchanged(gen, device):
    o, lse = random_states(gen, 1, 5, 3, 32, torch.float32, device)
    got, got_lse = merge_attention_states(o, lse)
    assert torch.equal(got, o[0]) and torch.equal(got_lse, lse[0])


def test_list_input_and_strided_layouts(gen, device):
    S, T, H, D = 3, 5, 4, 48
    base = torch.randn(T, S, H, D + 8, generator=gen).to(device)
    o = base[..., :D].permute(1, 0, 2, 3)  # [S, T, H, D] with token-major strides, D contiguous
    lse = (torch.randn(T, H, S, generator=gen) * 3).to(device).permute(2, 0, 1)
    ref, ref_lse = merge_attention_states_ref(o, lse)
    got, got_lse = merge_attention_states(o, lse)
    assert_close(got, ref, torch.float32)
    assert_close(got_lse, ref_lse, torch.float32)
    listed, listed_lse = merge_attention_states(list(o.unbind(0)), list(lse.unbind(0)))
    assert torch.equal(listed, got) and torch.equal(listed_lse, got_lse)
    out_big = poisoned((T, H, D + 4), torch.float32, device)
    merge_attention_states(o, lse, out=out_big[..., :D])
    assert_close(out_big[..., :D], ref, torch.float32)
    assert bool(torch.isnan(out_big[..., D:]).all()), "wrote outside the given out view"


def _chunked_case(gen, device, dtype, chunks):
    T, H, dk, dv = 5, 3, 24, 16
    n = sum(len(c) for c in chunks)
    q = torch.randn(T, H, dk, generator=gen)
    k = torch.randn(n, H, dk, generator=gen)
    v = torch.randn(n, H, dv, generator=gen)
    scale = 1.0 / math.sqrt(dk)
    full, full_lse = attention_with_lse_ref(q, k, v, scale)
    outs, lses = [], []
    for idx in chunks:
        o, lse = attention_with_lse_ref(q, k[idx], v[idx], scale)
        outs.append(o.to(dtype).to(device))
        lses.append(lse.float().to(device))
    got, got_lse = merge_attention_states(outs, lses)
    assert_close(got.cpu(), full.to(dtype), dtype)
    assert_close(got_lse.cpu(), full_lse.float(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_key_chunks_equal_attention_over_all_keys(dtype, gen, device):
    """Chunked-prefix attention: prefix, an empty chunk, new rows."""
    _chunked_case(gen, device, dtype, [list(range(0, 13)), [], list(range(13, 20))])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_helix_round_robin_shards_merge_to_full_attention(cp, gen, device):
    """Blocks of 4 tokens dealt round-robin over CP ranks (some ranks get none when there are few blocks)."""
    tpb, num_blocks = 4, 5
    shards = [[b * tpb + t for b in helix_blocks(num_blocks, r, cp) for t in range(tpb)] for r in range(cp)]
    _chunked_case(gen, device, torch.float32, shards)


def test_bad_arguments_name_the_argument(device):
    o = torch.zeros(2, 3, 4, 8, device=device)
    lse = torch.zeros(2, 3, 4, device=device)
    cases = [
        ("lses", TypeError, lambda: merge_attention_states(o, lse.bfloat16())),
        ("lses", ValueError, lambda: merge_attention_states(o, lse[:, :2])),
        ("outputs", TypeError, lambda: merge_attention_states(o.int(), lse)),
        ("outputs", ValueError, lambda: merge_attention_states(o[:, :, :, :0], lse)),
        ("outputs", ValueError, lambda: merge_attention_states([], [])),
        ("outputs\\[1\\]", ValueError, lambda: merge_attention_states([o[0], o[1, :2]], [lse[0], lse[1]])),
        ("out", ValueError, lambda: merge_attention_states(o, lse, out=torch.zeros(3, 4, 7, device=device))),
        ("out_lse", TypeError, lambda: merge_attention_states(o, lse, out_lse=torch.zeros(3, 4, device=device).half())),
        ("outputs", ValueError, lambda: merge_attention_states(o.transpose(2, 3), lse)),
    ]
    for name, exc, call in cases:
        with pytest.raises(exc, match=rf"^{name}"):
            call()
