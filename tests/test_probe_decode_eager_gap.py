"""The eager-gap probe's host-side share arithmetic against the split kernel's own count (issue 28).

``bench/probe_decode_eager_gap.py --plan-only`` reports, per workload, how many key shares the planner gives
each request by repeating ``_request_share``'s arithmetic on the host; here a planned run writes its share
counts (``nshare``) on the device and the two must agree, balanced and with ``num_splits`` forced.
"""

from __future__ import annotations

import pytest
import torch

import kvforge.kernels.mla_decode as md
from bench.probe_decode_eager_gap import bytes_rule_tokens, share_table
from kvforge.kernels.mla_decode import MLADecodePlan

DV, DR, PAGE = 32, 16, 4


@pytest.mark.parametrize("num_splits", [None, 3])
def test_share_table_matches_kernel_share_counts(gen, device, monkeypatch, num_splits):
    monkeypatch.setattr(md, "FUSED_MERGE", False)  # share counts go to nshare only for the merge kernel
    lens = [700, 90, 0, 333]
    B, H = len(lens), 5
    width = max(-(-n // PAGE) for n in lens)
    pages = B * width + 2
    q = torch.randn(B, H, DV + DR, generator=gen).to(device)
    kv = torch.randn(pages, PAGE, DV + DR, generator=gen).to(device)
    bt = torch.randperm(pages, generator=gen)[: B * width].view(B, width).to(torch.int32).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.2, v_head_dim=DV, num_splits=num_splits)
    assert plan._scratch is not None, "the case must split (a share grid above 1), or nshare is never written"
    nshare = plan._scratch[0][2]
    nshare.fill_(-1)
    plan.run(q, kv)
    table = share_table(md, {"H": H, "B": B, "page": PAGE, "lens": lens}, num_splits, DV, DR, torch.float32)
    assert max(table["per_request"]) > 1
    assert nshare.tolist() == table["per_request"]


def test_bytes_rule_tokens():
    # A share of n keys reads n * 576 * 2 bytes and writes H * 512 * 4: the floor is the smallest power of two
    # n with reads >= writes, never below 128.
    assert [bytes_rule_tokens(h) for h in (16, 32, 64, 128, 256)] == [128, 128, 128, 256, 512]
    for h in (64, 128, 256, 96):
        n = bytes_rule_tokens(h)
        assert n * 576 * 2 >= h * 512 * 4
        assert n == 128 or (n // 2) * 576 * 2 < h * 512 * 4
