"""mla_decode_attention against its fp32 reference: awkward lengths, splits, page sizes, empty requests,
NaN-poisoned outputs, buffers given by the caller, and every refused input (before launch).

Interpreter cases use a narrow latent (32 + 16) so they stay fast; the ``gpu`` cases run DeepSeek's 512 + 64.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref
from tests.helpers import assert_all_written, poisoned
from tests.tolerances import rel_rmse


def make_case(gen, B, H, DV, DR, page_size, lens, dtype, device, spare_pages=3):
    max_pages = max(1, max(math.ceil(n / page_size) for n in lens) + 1)
    num_pages = B * max_pages + spare_pages
    q = torch.randn(B, H, DV + DR, generator=gen).to(dtype).to(device)
    kv = torch.randn(num_pages, page_size, DV + DR, generator=gen).to(dtype).to(device)
    bt = torch.randperm(num_pages, generator=gen)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    return q, kv, bt.to(device), sl.to(device)


def check(q, kv, bt, sl, DV, scale, dtype, **kw):
    out = poisoned((q.shape[0], q.shape[1], DV), dtype, q.device)
    lse = poisoned((q.shape[0], q.shape[1]), torch.float32, q.device)
    got, got_lse = mla_decode_attention(
        q, kv, bt, sl, softmax_scale=scale, v_head_dim=DV, out=out, lse=lse, return_lse=True, **kw
    )
    assert got is out and got_lse is lse
    assert_all_written(out)
    ref, ref_lse = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=scale, v_head_dim=DV)
    ref = ref.to(q.device)
    empty = sl.cpu() == 0
    assert torch.isneginf(got_lse.cpu()[empty]).all()
    assert (got.cpu()[empty] == 0).all()
    full = ~empty
    if full.any():
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        assert rel_rmse(got.cpu()[full].float(), ref.cpu()[full]) < tol
        torch.testing.assert_close(got_lse.cpu()[full], ref_lse.cpu()[full], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "B,H,page_size,lens,dtype,splits",
    [
        (3, 5, 4, [0, 23, 7], torch.float32, None),
        (2, 3, 16, [1, 33], torch.bfloat16, 1),
        (4, 16, 8, [9, 0, 40, 17], torch.float16, 3),
        (1, 17, 2, [31], torch.bfloat16, 64),  # more splits asked than key tiles: capped, empty shares merged away
    ],
)
def test_matches_reference(gen, device, B, H, page_size, lens, dtype, splits):
    q, kv, bt, sl = make_case(gen, B, H, 32, 16, page_size, lens, dtype, device)
    check(q, kv, bt, sl, 32, 0.3, dtype, num_splits=splits)


def test_split_count_does_not_change_the_result(gen, device):
    q, kv, bt, sl = make_case(gen, 2, 4, 32, 16, 4, [30, 19], torch.float32, device)
    outs = [mla_decode_attention(q, kv, bt, sl, softmax_scale=0.2, v_head_dim=32, num_splits=s) for s in (1, 2, 5)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size,dtype", [(4, torch.float32), (16, torch.float32), (32, torch.float16)])
def test_split_value_halves(gen, device, monkeypatch, page_size, dtype):
    """The SPLIT_DV variant (two programs per head tile, each writing half of the output columns), with tiles
    inside one page (16, 32) and across pages (4), several key shares per request."""
    import kvforge.kernels.mla_decode as md
    from kvforge.kernels._runtime import ConfigTable, TunedKernel

    if device.type != "cpu":
        pytest.skip("the GPU sweeps every configuration in bench/bench_mla_decode.py")
    cfg = md._cfg(16, 16, 1, 1, split_dv=True)
    monkeypatch.setattr(md, "_SPLIT", TunedKernel("mla_decode_split_dv_test", md._mla_decode_split_kernel,
                                                  ConfigTable(fallback=[cfg], interpreter=cfg)))  # fmt: skip
    q, kv, bt, sl = make_case(gen, 3, 5, 32, 16, page_size, [0, 37, 70], dtype, device)
    check(q, kv, bt, sl, 32, 0.25, dtype, num_splits=2)


def test_default_num_splits_fills_the_wave():
    from kvforge.kernels.mla_decode import default_num_splits

    # 64 requests x 1 head tile on 132 SMs: two resident programs per SM -> 4 shares (256 of 264 slots), one
    # resident program -> 2 shares (128 of 132).
    assert default_num_splits(64, 1, 128, 132) == 4
    assert default_num_splits(64, 1, 128, 132, per_sm=1) == 2
    assert default_num_splits(64, 1, 1, 132) == 1  # never more shares than key tiles
    assert default_num_splits(500, 2, 64, 132) == 1  # a full wave already
    with pytest.raises(ValueError, match="per_sm"):
        default_num_splits(4, 1, 8, 132, per_sm=0)


def test_strided_q_and_full_width_latent(gen, device):
    """A q slice of a wider buffer (head stride > row width) and the real 512 + 64 split, one short request."""
    q_wide = torch.randn(2, 3, 600, generator=gen).to(device)
    q = q_wide[:, :, :576]
    kv = torch.randn(5, 4, 576, generator=gen).to(device)
    bt = torch.tensor([[4, 1], [0, 2]], dtype=torch.int32, device=device)
    sl = torch.tensor([6, 3], dtype=torch.int32, device=device)
    check(q, kv, bt, sl, 512, 576**-0.5, torch.float32)


def test_poisoned_unused_pages_are_not_read(gen, device):
    q, kv, bt, sl = make_case(gen, 2, 3, 32, 16, 4, [5, 9], torch.float32, device)
    used = set()
    for b, n in enumerate(sl.tolist()):
        used |= set(bt[b, : math.ceil(n / 4)].tolist())
    for p in range(kv.shape[0]):
        if p not in used:
            kv[p] = float("nan")
    kv[bt[0, 1], 1:] = float("nan")  # rows past request 0's length (5 = one page + one row)
    check(q, kv, bt, sl, 32, 0.5, torch.float32)


def _args(device, dtype=torch.float32):
    q = torch.zeros(2, 3, 48, dtype=dtype, device=device)
    kv = torch.zeros(6, 4, 48, dtype=dtype, device=device)
    bt = torch.zeros(2, 3, dtype=torch.int32, device=device)
    sl = torch.tensor([4, 12], dtype=torch.int32, device=device)
    return q, kv, bt, sl


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "q": a["q"].tolist()}, TypeError, "q: expected a torch.Tensor"),
        (lambda a: {**a, "q": a["q"].double()}, TypeError, "q: expected dtype"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].half()}, TypeError, "kv_cache: expected dtype"),
        (lambda a: {**a, "block_table": a["block_table"].long()}, TypeError, "block_table"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens"),
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q: expected 3 dimensions"),
        (lambda a: {**a, "kv_cache": a["kv_cache"][:, :, :40]}, ValueError, "kv_cache: expected rows"),
        (lambda a: {**a, "kv_cache": torch.zeros(6, 3, 48)}, ValueError, "page size"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens: expected shape"),
        (lambda a: {**a, "block_table": a["block_table"][:1]}, ValueError, "block_table: expected shape"),
        (lambda a: {**a, "seq_lens": torch.tensor([4, 13], dtype=torch.int32)}, ValueError, r"seq_lens\[1\]"),
        (lambda a: {**a, "seq_lens": torch.tensor([-1, 3], dtype=torch.int32)}, ValueError, r"seq_lens\[0\]"),
        (
            lambda a: {**a, "block_table": torch.tensor([[0, 0, 0], [1, 2, 6]], dtype=torch.int32)},
            ValueError,
            r"block_table\[1, 2\]",
        ),
        (
            lambda a: {**a, "block_table": torch.tensor([[-1, 0, 0], [1, 2, 3]], dtype=torch.int32)},
            ValueError,
            r"block_table\[0, 0\]",
        ),
        (lambda a: {**a, "softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        (lambda a: {**a, "softmax_scale": "0.1"}, TypeError, "softmax_scale"),
        (lambda a: {**a, "softmax_scale": True}, TypeError, "softmax_scale"),
        (lambda a: {**a, "v_head_dim": 48}, ValueError, "v_head_dim"),
        (lambda a: {**a, "v_head_dim": 24}, ValueError, "v_head_dim"),
        (lambda a: {**a, "v_head_dim": 32.0}, TypeError, "v_head_dim"),
        (lambda a: {**a, "num_splits": 0}, ValueError, "num_splits"),
        (lambda a: {**a, "num_splits": 2.0}, TypeError, "num_splits"),
        (lambda a: {**a, "q": a["q"].to("meta")}, ValueError, "q: .*meta"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].to("meta")}, ValueError, "kv_cache"),
        (lambda a: {**a, "out": torch.zeros(2, 3, 32).expand(2, 3, 32)[:, :1].expand(2, 3, 32)}, ValueError, "out"),
        (lambda a: {**a, "out": torch.zeros(2, 3, 16)}, ValueError, "out: expected shape"),
        (lambda a: {**a, "out": a["q"][:, :, :32]}, ValueError, "out: overlaps q"),
        (lambda a: {**a, "lse": torch.zeros(2, 3, dtype=torch.float64)}, TypeError, "lse"),
    ],
)
def test_refused_before_launch(device, change, exc, match):
    if device.type != "cpu":
        pytest.skip("the cases build CPU tensors")
    q, kv, bt, sl = _args(device)
    args = change({"q": q, "kv_cache": kv, "block_table": bt, "seq_lens": sl, "softmax_scale": 0.1, "v_head_dim": 32})
    if "seq_lens[" in match or "block_table[" in match:  # value checks that raise: the opt-in strict mode
        args["check_values"] = "strict"
    with pytest.raises(exc, match=match):
        mla_decode_attention(args.pop("q"), args.pop("kv_cache"), args.pop("block_table"), args.pop("seq_lens"), **args)


def test_out_aliasing_lse_refused(device):
    q, kv, bt, sl = _args(device)
    buf = torch.zeros(2 * 3 * 32, device=device)
    with pytest.raises(ValueError, match="overlaps"):
        mla_decode_attention(
            q, kv, bt, sl, softmax_scale=0.1, v_head_dim=32, out=buf.view(2, 3, 32), lse=buf[:6].view(2, 3)
        )


def test_zero_requests(device):
    q, kv, bt, sl = _args(device)
    out, lse = mla_decode_attention(q[:0], kv, bt[:0], sl[:0], softmax_scale=0.1, v_head_dim=32, return_lse=True)
    assert out.shape == (0, 3, 32) and lse.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,lens", [(16, 7, [1, 63, 64, 65, 1000, 4097, 0]), (128, 3, [8192, 5, 300])])
@pytest.mark.parametrize("page_size", [1, 64])
def test_gpu_deepseek_sizes(gen, device, H, B, lens, page_size):
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    check(q, kv, bt, sl, 512, 576**-0.5, torch.bfloat16)


def test_repeat_calls_reuse_the_checked_plan(gen, device, monkeypatch):
    """A call with the same tensors (address, shape, strides, dtype, device) and arguments reuses the first
    call's checked launch plan: results stay right, values are still checked, and a plan made for another
    kernel or config is not used."""
    import kvforge.kernels.mla_decode as md
    from kvforge.kernels._runtime import ConfigTable, TunedKernel

    q, kv, bt, sl = make_case(gen, 3, 5, 32, 16, 4, [0, 23, 9], torch.float32, device)
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    out = torch.empty(3, 5, 32, device=device)

    def call() -> None:
        out.fill_(float("nan"))
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out)
        assert_all_written(out)
        assert rel_rmse(out.cpu()[1:], ref.cpu()[1:]) < 1e-5 and bool((out[0] == 0).all())

    call()
    plans = len(md._PLANS)
    for _ in range(2):
        call()
    assert len(md._PLANS) == plans  # the same plan, used again
    good = sl.clone()
    sl.copy_(torch.tensor([0, 23, 13 * 4], dtype=torch.int32))  # past the block table: refused on a reused plan
    with pytest.raises(ValueError, match=r"seq_lens\[2\]"):
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out)
    sl.copy_(good)
    cfg = md._cfg(16, 16, 1, 1, split_dv=True)
    monkeypatch.setattr(md, "_SPLIT", TunedKernel("mla_decode_plan_test", md._mla_decode_split_kernel,
                                                  ConfigTable(fallback=[cfg], interpreter=cfg)))  # fmt: skip
    call()
    assert any(p.cfg is cfg for p in md._PLANS._plans.values())  # planned again with the swapped kernel's config
