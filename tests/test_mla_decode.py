"""mla_decode_attention against its fp32 reference: awkward lengths, splits, page sizes, empty requests,
NaN-poisoned outputs, buffers given by the caller, and every refused input (before launch).

Interpreter cases use a narrow latent (32 + 16) so they stay fast; the ``gpu`` cases run DeepSeek's 512 + 64.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from kvforge.kernels.mla_decode import _longest_first, mla_decode_attention, mla_decode_attention_ref
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
    if match.startswith(("seq_lens\\[", "block_table\\[")):  # value checks that raise: the opt-in strict mode
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

    md._PLANS.clear()  # plans of earlier tests (other tensors) are not this one's
    call()
    plans = len(md._PLANS)
    for _ in range(2):
        call()
    assert len(md._PLANS) == plans  # the same plan, used again
    # Replayed without return_lse, the lse goes to the plan's own sink (allocated once); asked for, it is fresh.
    (plan,) = [p for p in md._PLANS._plans.values() if p.state.lse_sink is not None and p.B == 3 and p.H == 5]
    sink = plan.state.lse_sink
    assert sink is not None and sink.shape == (3, 5) and sink.dtype == torch.float32
    sink.fill_(float("nan"))  # a kernel that read the sink would carry the NaN into out
    call()
    assert plan.state.lse_sink is sink and not bool(sink.isnan().any())  # written again (-inf for request 0)
    # The sink outlives its plan (a captured graph keeps its address): it comes from the never-freed buffers.
    base = md._KEPT[(sink.device, 0, "lse")]
    assert sink.data_ptr() == base.data_ptr()
    md._PLANS.clear()
    call()
    assert md._KEPT[(sink.device, 0, "lse")] is base
    ref_lse = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)[1]
    lses = [mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out, return_lse=True)[1]
            for _ in range(2)]  # fmt: skip
    assert lses[0].data_ptr() != sink.data_ptr() and lses[0].data_ptr() != lses[1].data_ptr()
    for got in lses:
        torch.testing.assert_close(got.cpu()[1:], ref_lse.cpu()[1:], atol=1e-4, rtol=1e-4)
    good = sl.clone()
    sl.copy_(torch.tensor([0, 23, 13 * 4], dtype=torch.int32))  # past the block table: refused on a reused plan
    with pytest.raises(ValueError, match=r"seq_lens\[2\]"):
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out, check_values="strict")
    with pytest.raises(ValueError, match=r"seq_lens\[2\]"):  # the strict call's plan, reused
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out, check_values="strict")
    flags = torch.zeros(2, dtype=torch.int32, device=device)
    mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out, error_flag=flags)
    assert flags.tolist() == [1, 0] and bool(out[2].isnan().all())  # the reused default plan checks on the device
    sl.copy_(good)
    cfg = md._cfg(16, 16, 1, 1, split_dv=True)
    monkeypatch.setattr(md, "_SPLIT", TunedKernel("mla_decode_plan_test", md._mla_decode_split_kernel,
                                                  ConfigTable(fallback=[cfg], interpreter=cfg)))  # fmt: skip
    call()
    assert any(p.cfg is cfg for p in md._PLANS._plans.values())  # planned again with the swapped kernel's config


def _flags(device):
    return torch.zeros(4, dtype=torch.int32, device=device)


@pytest.mark.parametrize("page_size", [4, 16])
def test_device_checks_poison_and_flag(gen, device, page_size):
    """The default call checks on the device, without a host read: a length past the table or a page id out of
    range makes that request's output and lse NaN (the others stay right) and sets its flag; nothing raises."""
    lens = [5, 23, 9]
    q, kv, bt, sl = make_case(gen, 3, 5, 32, 16, page_size, lens, torch.float32, device)
    ref, ref_lse = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    bad_len = sl.clone()
    bad_len[0] = bt.shape[1] * page_size + 1
    bad_page = bt.clone()
    bad_page[1, (lens[1] - 1) // page_size] = kv.shape[0]  # the last page request 1 reads
    neg_page = bt.clone()
    neg_page[2, 0] = -1
    for table, lengths, who, flag in ((bt, bad_len, 0, 0), (bad_page, sl, 1, 1), (neg_page, sl, 2, 1)):
        for splits in (None, 2):
            flags = _flags(device)
            out, lse = mla_decode_attention(q, kv, table, lengths, softmax_scale=0.3, v_head_dim=32, return_lse=True,
                                            error_flag=flags, num_splits=splits)  # fmt: skip
            assert flags.tolist() == [int(flag == 0), int(flag == 1), 0, 0]
            assert bool(out[who].isnan().all()) and bool(lse[who].isnan().all())
            good = [b for b in range(3) if b != who]
            assert rel_rmse(out.cpu()[good], ref.cpu()[good]) < 1e-5
            torch.testing.assert_close(lse.cpu()[good], ref_lse.cpu()[good], atol=1e-4, rtol=1e-5)
    # A page id past the request's length is never read, so it is not an error.
    unread = bt.clone()
    unread[0, -1] = 10**6
    flags = _flags(device)
    out = mla_decode_attention(q, kv, unread, sl, softmax_scale=0.3, v_head_dim=32, error_flag=flags)
    assert flags.tolist() == [0, 0, 0, 0] and rel_rmse(out.cpu(), ref.cpu()) < 1e-5


def test_device_flags_default_and_strict(gen, device):
    """Without ``error_flag`` the device's flags are set; ``raise_decode_errors`` reads, clears and names the
    argument; ``check_values="strict"`` raises before launch; ``check_values=False`` checks nothing."""
    from kvforge.kernels.mla_decode import decode_error_flags, raise_decode_errors

    q, kv, bt, sl = make_case(gen, 2, 3, 32, 16, 4, [6, 9], torch.float32, device)
    raise_decode_errors(device)  # clears anything an earlier test left
    bad = bt.clone()
    bad[1, 0] = -7
    out = poisoned((2, 3, 32), torch.float32, device)
    mla_decode_attention(q, kv, bad, sl, softmax_scale=0.3, v_head_dim=32, out=out)
    assert decode_error_flags(device).tolist() == [0, 1]
    with pytest.raises(ValueError, match="block_table: a page id"):
        raise_decode_errors(device)
    assert decode_error_flags(device).tolist() == [0, 0]
    raise_decode_errors(device)  # cleared: nothing to raise
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        mla_decode_attention(q, kv, bad, sl, softmax_scale=0.3, v_head_dim=32, check_values="strict")
    with pytest.raises(TypeError, match="check_values"):
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, check_values="yes")
    with pytest.raises(ValueError, match="error_flag"):
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, error_flag=_flags(device)[:1])
    with pytest.raises(TypeError, match="error_flag"):
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, error_flag=_flags(device).long())
    # Unchecked, a page id past the cache is read as it is: the cache here is a view of a larger buffer, so the
    # read stays in allocated memory (a negative id, as above, would read before it: undefined on a GPU).
    spare = torch.cat([kv, kv[:2]])
    kv_view = spare[: kv.shape[0]]
    past = bt.clone()
    past[1, 0] = kv.shape[0]
    flags = _flags(device)
    mla_decode_attention(q, kv_view, past, sl, softmax_scale=0.3, v_head_dim=32, check_values=False,
                         error_flag=flags)  # fmt: skip
    assert flags.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("lens", [[600, 37, 1100, 0], [1500, 1500, 1500, 1500], [2000, 1, 2, 3]])
def test_balanced_shares_match_reference(gen, device, lens):
    """The default split (shares sized on the device from the batch's total work; a request with one share
    writes ``out`` itself, the others are merged) on uniform and mixed lengths long enough to be split."""
    q, kv, bt, sl = make_case(gen, len(lens), 5, 32, 16, 16, lens, torch.float32, device)
    check(q, kv, bt, sl, 32, 0.3, torch.float32)


@pytest.mark.parametrize(
    "lens", [[600, 37, 1100, 0, 5000, 90, 700, 2000], [3000, 2500, 1800, 6000], [200] * 8 + [9000], [9, 3000, 77]]
)
@pytest.mark.parametrize("sms", [None, 66])
def test_balanced_share_counts_match_host_reference(gen, device, monkeypatch, lens, sms):
    """The share counts each program works out on the device (written to the plan's ``nshare``) are
    ``share_counts_ref``'s in the mode ``balance_mode`` picks (costed share sizes for 8+ requests in half a
    wave, rounded-down even shares otherwise; ``sms`` poses as a device that many SMs wide, so that both modes
    run here), and the output still matches the reference."""
    import kvforge.kernels.mla_decode as md
    from kvforge.kernels.mla_decode import MLADecodePlan, balance_mode, share_counts_ref

    if sms is not None:
        monkeypatch.setattr(md, "num_sms", lambda dev: sms)
    monkeypatch.setattr(md, "FUSED_MERGE", False)  # share counts go to nshare only for the merge kernel
    q, kv, bt, sl = make_case(gen, len(lens), 5, 32, 16, 16, lens, torch.float32, device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    p = plan._plan
    if p.merge is None or not p.balance:
        pytest.skip("this device's plan does not split these lengths")
    assert p.balance == balance_mode(len(lens), p.grid[0], p.rt[4])
    out = plan.run(q, kv)
    bn = p.cfg.kwargs["BLOCK_N"] if p.gluon is None else p.gluon[0]
    _, S, max_len, min_tiles, slots = p.rt[:5]
    tiles = [-(-min(max(n, 0), max_len) // bn) for n in lens]
    want = share_counts_ref(tiles, S, slots, p.grid[0], min_tiles, p.balance)
    assert plan._scratch[0][2].cpu().tolist() == want
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert rel_rmse(out.cpu(), ref.cpu()) < 1e-5


@triton.jit(do_not_specialize=["B", "max_len"])  # as the split kernel (B == 1 specialised: Triton 3.6 failed)
def _places_kernel(seq_ptr, ys_ptr, out_ptr, B, max_len, BLOCK_N: tl.constexpr):
    """The request an ORDER grid's program at place ``ys[i]`` works on (``_longest_first``), into ``out[i]``."""
    i = tl.program_id(0)
    tl.store(out_ptr + i, _longest_first(seq_ptr, tl.load(ys_ptr + i), B, max_len, BLOCK_N))


@pytest.mark.parametrize("B,seed", [(1, 0), (5, 1), (37, 2), (300, 3)])
def test_longest_first_is_the_host_order(device, B, seed):
    """``_longest_first`` (every program of an ORDER grid computes its request from its place) gives
    ``longest_first_ref``'s permutation: most key tiles first, ties by index, lengths clamped to [0, max_len]
    (negative and too-long ones included; more than one 256-wide pass over the lengths at 300)."""
    import kvforge.kernels.mla_decode as md

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(-5, 700, (B,), generator=g, dtype=torch.int32)
    lens[torch.randperm(B, generator=g)[: B // 3]] = 64  # ties
    max_len, bn = 600, 32
    # every place of a small batch; of 300, the ends and a random dozen (each place is a bisection)
    ys = list(range(B)) if B <= 40 else sorted({0, B - 1, *torch.randperm(B, generator=g)[:12].tolist()})
    got = torch.full((len(ys),), -1, dtype=torch.int32, device=device)
    _places_kernel[(len(ys),)](lens.to(device), torch.tensor(ys, dtype=torch.int32, device=device), got, B, max_len,
                               BLOCK_N=bn)  # fmt: skip
    tiles = [-(-min(max(int(n), 0), max_len) // bn) for n in lens]
    want = md.longest_first_ref(tiles)
    assert got.cpu().tolist() == [want[y] for y in ys]


def test_longest_first_grid_matches_reference(gen, device, monkeypatch):
    """A batch of more requests than programs fit at once runs longest first (ORDER) and still writes every
    request's own output: mixed lengths, one of 0, split and unsplit requests."""
    import kvforge.kernels.mla_decode as md

    monkeypatch.setattr(md, "num_sms", lambda dev: 2)
    lens = [5, 900, 37, 0, 1200, 64, 64, 300, 1, 700, 33, 450]
    q, kv, bt, sl = make_case(gen, len(lens), 5, 32, 16, 16, lens, torch.float32, device)
    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert plan._plan.order
    out = plan.run(q, kv)
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert rel_rmse(out.cpu(), ref.cpu()) < 1e-5
    check(q, kv, bt, sl, 32, 0.3, torch.float32)


def test_merge_takes_several_heads_a_program(gen, device, monkeypatch):
    """Past ``MERGE_PROGRAMS`` merge programs, each takes HB heads (5 heads, HB 4: a partial head block), and
    split and unsplit requests still match the reference."""
    import kvforge.kernels.mla_decode as md

    monkeypatch.setattr(md, "MERGE_PROGRAMS", 8)
    monkeypatch.setattr(md, "FUSED_MERGE", False)
    lens = [900, 37, 1500, 5]
    q, kv, bt, sl = make_case(gen, len(lens), 5, 32, 16, 16, lens, torch.float32, device)
    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    if plan._plan.merge is None:
        pytest.skip("this device's plan does not split these lengths")
    assert dict(plan._plan.merge[2])["HB"] == 4
    out = plan.run(q, kv)
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert rel_rmse(out.cpu(), ref.cpu()) < 1e-5


@pytest.mark.parametrize("HB,CH", [(1, 8), (4, 2), (8, 1)])
def test_merge_kernel_against_torch(gen, device, HB, CH):
    """The share merge alone, on fresh random partials: head blocks of HB over 6 heads (a partial block), share
    counts 0, 1, 2, 5 and 7 (several CH-share chunks), an empty share (lse -inf) inside a request and a NaN share
    lse (that row NaN, the others untouched); rows of requests with one share or none are left as they were."""
    import kvforge.kernels.mla_decode as md

    B, H, S, D, BD = 5, 6, 8, 32, 16
    ns = torch.tensor([2, 1, 7, 0, 5], dtype=torch.int32)
    po = torch.randn(B, H, S, D, generator=gen)
    plse = torch.randn(B, H, S, generator=gen) * 3
    plse[2, 1, 3] = float("-inf")
    plse[4, 5, 2] = float("nan")
    out = torch.full((B, H, D), 7.0)
    lse = torch.full((B, H), 7.0)
    args = [t.to(device) for t in (po, plse, ns, out, lse)]
    grid = (B, -(-H // HB), D // BD)
    md._decode_merge_kernel[grid](*args, H, H * S * D, S * D, D, H * S, S, H * D, D, H, 1, BLOCK_S=8, BLOCK_D=BD,
                                  CH=CH, HB=HB, num_warps=4)  # fmt: skip
    got_o, got_l = args[3].cpu(), args[4].cpu()
    for b in range(B):
        n = int(ns[b])
        if n <= 1:
            assert (got_o[b] == 7).all() and (got_l[b] == 7).all()
            continue
        x = plse[b, :, :n].double()
        ref_l = torch.logsumexp(x, 1)
        ref_o = (torch.softmax(x, 1)[..., None] * po[b, :, :n].double()).sum(1)
        for h in range(H):
            if torch.isnan(x[h]).any():
                assert torch.isnan(got_o[b, h]).all() and torch.isnan(got_l[b, h])
            else:
                torch.testing.assert_close(got_o[b, h].double(), ref_o[h], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got_l[b, h].double(), ref_l[h], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split_dv,balance_sms", [(False, None), (True, None), (False, 66)])
def test_fused_merge_matches_reference_and_merge_kernel(gen, device, monkeypatch, split_dv, balance_sms):
    """``FUSED_MERGE``: a split request's last share to finish merges it (no merge launch): against the reference
    and the merge kernel's result, out and lse NaN-poisoned first, both SPLIT_DV halves, the balanced split, a
    poisoned share (a page id out of range in one share) making only its request NaN; the arrival counters are
    zero after every call, over a random sequence of length changes on one plan."""
    import kvforge.kernels.mla_decode as md
    from kvforge.kernels._runtime import ConfigTable, TunedKernel

    if device.type != "cpu":
        pytest.skip("the GPU runs the fused merge in every split test (tests/test_mla_decode_gluon.py too)")
    if balance_sms is not None:
        monkeypatch.setattr(md, "num_sms", lambda dev: balance_sms)
    cfg = md._cfg(8, 16, 1, 1, split_dv=split_dv)
    monkeypatch.setattr(md, "_SPLIT", TunedKernel(f"mla_decode_fused_test_{split_dv}", md._mla_decode_split_kernel,
                                                  ConfigTable(fallback=[cfg], interpreter=cfg)))  # fmt: skip
    monkeypatch.setattr(md, "FUSED_MAX_SHARES", 65535)  # the fused merge at every share count, not only the default's
    lens = [150, 3, 0, 97, 64] if balance_sms is None else [900, 3, 0, 400, 260]  # the balanced split: long keys
    q, kv, bt, sl = make_case(gen, len(lens), 11, 32, 16, 16, lens, torch.float32, device)
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(md, "FUSED_MERGE", fused)
        plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, num_splits=None if balance_sms
                                else 4)  # fmt: skip
        assert plan._plan.grid[2] > 1 and plan._plan.fused == fused and (plan._plan.merge is None) == fused
        assert balance_sms is None or plan._plan.balance > 0
        out = poisoned((len(lens), 11, 32), torch.float32, device)
        lse = poisoned((len(lens), 11), torch.float32, device)
        plan.run(q, kv, out=out, lse=lse)
        ref, ref_lse = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
        assert rel_rmse(out, ref) < 1e-5
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
        got[fused] = (out, lse)
        if fused:
            cnt = plan._scratch[0][2]
            assert cnt.numel() == 2 * plan._plan.grid[0] * len(lens) and int(cnt.abs().sum()) == 0
            rng = torch.Generator().manual_seed(5)
            for _ in range(4):  # new lengths in place: each run's shares and counts differ
                sl.copy_(torch.randint(0, 16 * bt.shape[1] + 1, (len(lens),), generator=rng).to(sl))
                out = plan.run(q, kv)
                ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
                assert rel_rmse(out, ref) < 1e-5 and int(cnt.abs().sum()) == 0
            sl.copy_(torch.tensor(lens).to(sl))
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-6, rtol=1e-5)
    bad = bt.clone()
    bad[0, 8] = kv.shape[0] + 3  # request 0's page 8: tokens 128-143, in its last share
    flags = _flags(device)
    out, lse = mla_decode_attention(q, kv, bad, sl, softmax_scale=0.3, v_head_dim=32, num_splits=4, error_flag=flags,
                                    return_lse=True)  # fmt: skip
    assert flags.tolist() == [0, 1, 0, 0]
    assert bool(out[0].isnan().all()) and bool(lse[0].isnan().all())
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert rel_rmse(out[1:], ref[1:]) < 1e-5


def test_merge_heads():
    from kvforge.kernels.mla_decode import MERGE_PROGRAMS, merge_heads

    assert merge_heads(4, 16, 4) == 1 and merge_heads(16, 128, 4) == 1
    assert merge_heads(256, 64, 4) == 8 and merge_heads(64, 64, 4) == 2
    assert merge_heads(4096, 16, 4) == 16  # never more than the heads
    for b, h in ((256, 64), (64, 64), (300, 48)):
        hb = merge_heads(b, h, 4)
        assert b * -(-h // hb) * 4 <= MERGE_PROGRAMS < b * -(-h // (hb // 2 or 1)) * 4 or hb == 1


def test_order_requests():
    from kvforge.kernels.mla_decode import longest_first_ref, order_requests

    assert [order_requests(b, 1, 132) for b in (1, 132, 133, 256)] == [False, False, True, True]
    assert order_requests(67, 2, 132) and not order_requests(66, 2, 132)
    assert longest_first_ref([3, 9, 3, 0, 9]) == [1, 4, 0, 2, 3]


def test_balance_mode():
    from kvforge.kernels.mla_decode import balance_mode

    assert [balance_mode(b, 1, 132) for b in (1, 4, 7, 8, 16, 64, 66, 67, 256)] == [1, 1, 1, 2, 2, 2, 2, 1, 1]
    assert balance_mode(40, 2, 132) == 1 and balance_mode(33, 2, 132) == 2  # head programs count too
    assert balance_mode(128, 1, 264) == 2 and balance_mode(256, 1, 264) == 1  # two programs per SM


@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda f: f.share_chunk_ref([4, 5], 4, 0, 1, 1), ValueError, "slots"),
        (lambda f: f.share_chunk_ref([4, -1], 4, 132, 1, 1), ValueError, "tiles"),
        (lambda f: f.share_chunk_ref("ab", 4, 132, 1, 1), TypeError, "tiles"),
        (lambda f: f.share_chunk_ref([4, 5], 0, 132, 1, 1), ValueError, "S"),
        (lambda f: f.share_chunk_ref([4, 5.0], 4, 132, 1, 1), TypeError, "tiles"),
        (lambda f: f.share_counts_ref([4], 4, 132, 0, 1, 2), ValueError, "head_progs"),
        (lambda f: f.share_counts_ref([4], 4, 132, 1, -1, 1), ValueError, "min_tiles"),
        (lambda f: f.share_counts_ref([4], 4, 132, 1, 1, 3), ValueError, "mode"),
        (lambda f: f.balance_mode(8, 1, 0), ValueError, "slots"),
        (lambda f: f.balance_mode(-1, 1, 132), ValueError, "batch"),
        (lambda f: f.balance_mode(True, 1, 132), TypeError, "batch"),
        (lambda f: f.order_requests(8, 1, 0), ValueError, "slots"),
        (lambda f: f.order_requests(8.0, 1, 132), TypeError, "batch"),
        (lambda f: f.longest_first_ref([3, -1]), ValueError, "tiles"),
        (lambda f: f.merge_heads(0, 16, 4), ValueError, "batch"),
        (lambda f: f.merge_heads(4, 16.0, 4), TypeError, "heads"),
    ],
)
def test_share_helpers_reject_bad_arguments(call, exc, name):
    from kvforge.kernels import mla_decode

    with pytest.raises(exc, match=name):
        call(mla_decode)


def test_share_chunk_ref_never_leaves_a_request_twice_as_long():
    """A mixed batch whose shortest requests hold just under two even shares: rounding the counts down gave
    them one share of almost twice the others' length (the critical path); the chosen chunk keeps every share
    within the candidate's size and the programs within a wave."""
    from kvforge.kernels.mla_decode import share_chunk_ref, share_counts_ref

    tiles = [79, 620, 350, 200, 400, 500, 300, 610, 150, 450, 520, 380, 79, 78, 77, 420]  # even share: 40
    ns = share_counts_ref(tiles, 64, 132, 1, 4, 2)
    longest = max(-(-t // n) for t, n in zip(tiles, ns))
    even = -(-sum(tiles) // 132)
    assert sum(ns) <= 132
    assert longest <= even * 5 // 4, (share_chunk_ref(tiles, 64, 132, 1, 4), longest, even)
    # the rounded-down form at the even share (mode 1), for contrast: a request of 79 tiles in one share
    assert max(-(-t // n) for t, n in zip(tiles, share_counts_ref(tiles, 64, 132, 1, 4, 1))) == 79
    assert share_chunk_ref([], 8, 132, 1, 4)[0] == 4  # no requests: the smallest share


def _fp8_case(gen, device, B, H, page_size, lens, s):
    """bf16 q; the cache quantised by the repo's int-only e4m3 encoder (quantize_fp8) from fp32 rows: it holds
    e4m3(x / s), so its dequant scale kv_scale_quant_orig is s."""
    from kvforge.kernels.quantize_fp8 import quantize_fp8

    q, kv32, bt, sl = make_case(gen, B, H, 32, 16, page_size, lens, torch.float32, device)
    kv8 = quantize_fp8(kv32, 1.0 / s)
    return q.to(torch.bfloat16), kv32, kv8, bt, sl


# Relative RMSE bounds of the docstring: against fp32 attention over the dequantised cache (the kernel's own
# error: bf16 q, fp16 products, fp32 accumulation) and over the rows before quantisation (e4m3 keeps 3 mantissa
# bits: 2.5-2.8% measured at 576-wide unit-variance rows, up to 7.4% at the narrow 48-wide test rows).
FP8_BOUND_DEQUANT = 1e-2
FP8_BOUND_ORIGINAL = 0.1  # narrow rows
FP8_BOUND_ORIGINAL_576 = 4e-2


@pytest.mark.parametrize("s", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_fp8_cache_matches_reference(gen, device, s, as_tensor):
    q, kv32, kv8, bt, sl = _fp8_case(gen, device, 3, 5, 4, [0, 23, 70], s)
    scale = torch.tensor([s], dtype=torch.float32, device=device) if as_tensor else s
    out = poisoned((3, 5, 32), torch.bfloat16, device)
    lse = poisoned((3, 5), torch.float32, device)
    mla_decode_attention(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32, out=out, lse=lse,
                         kv_scale_quant_orig=scale)  # fmt: skip
    assert_all_written(out)
    ref, ref_lse = mla_decode_attention_ref(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32, kv_scale_quant_orig=s)
    orig, _ = mla_decode_attention_ref(q, kv32, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert bool((out[0] == 0).all()) and bool(lse[0].isneginf().all())
    assert rel_rmse(out.cpu()[1:].float(), ref.cpu()[1:]) < FP8_BOUND_DEQUANT
    assert rel_rmse(out.cpu()[1:].float(), orig.cpu()[1:]) < FP8_BOUND_ORIGINAL
    torch.testing.assert_close(lse.cpu()[1:], ref_lse.cpu()[1:], atol=2e-2, rtol=1e-3)
    # A wrong scale direction (the quantise scale given as the dequant one) is far off the bound at s != 1.
    if s != 1.0:
        wrong = mla_decode_attention(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32, kv_scale_quant_orig=1 / s)
        assert rel_rmse(wrong.cpu()[1:].float(), ref.cpu()[1:]) > 5 * FP8_BOUND_DEQUANT


def test_fp8_cache_refusals(gen, device):
    q, kv32, kv8, bt, sl = _fp8_case(gen, device, 2, 3, 4, [5, 9], 1.0)
    with pytest.raises(ValueError, match="kv_scale_quant_orig"):
        mla_decode_attention(q, kv32.bfloat16(), bt, sl, softmax_scale=0.3, v_head_dim=32, kv_scale_quant_orig=2.0)
    with pytest.raises(ValueError, match="kv_scale_quant_orig"):
        mla_decode_attention(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32, kv_scale_quant_orig=float("nan"))
    with pytest.raises(TypeError, match="kv_scale_quant_orig"):
        mla_decode_attention(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32, kv_scale_quant_orig="2")
    with pytest.raises(ValueError, match="kv_scale_quant_orig"):
        mla_decode_attention(q, kv8, bt, sl, softmax_scale=0.3, v_head_dim=32,
                             kv_scale_quant_orig=torch.ones(2, device=device))  # fmt: skip
    with pytest.raises(TypeError, match="kv_cache: expected dtype"):  # an fp32 q takes an fp32 cache only
        mla_decode_attention(q.float(), kv8, bt, sl, softmax_scale=0.3, v_head_dim=32)


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,lens", [(16, 5, [1, 700, 8192, 0, 30000]), (128, 3, [8192, 5, 3000])])
@pytest.mark.parametrize("page_size", [32, 64])
def test_gpu_fp8_deepseek_sizes(gen, device, H, B, lens, page_size):
    from kvforge.kernels._fp8 import e4m3_ref

    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    kv8 = e4m3_ref(kv.float() / 0.5)
    out = mla_decode_attention(q, kv8, bt, sl, softmax_scale=576**-0.5, kv_scale_quant_orig=0.5)
    ref, _ = mla_decode_attention_ref(q, kv8, bt, sl, softmax_scale=576**-0.5, kv_scale_quant_orig=0.5)
    orig, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=576**-0.5)
    full = sl.cpu() > 0
    assert rel_rmse(out.cpu()[full].float(), ref.cpu()[full]) < FP8_BOUND_DEQUANT
    assert rel_rmse(out.cpu()[full].float(), orig.cpu()[full]) < FP8_BOUND_ORIGINAL_576


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("page_size", [32, 64])
def test_gpu_device_checks(gen, device, H, page_size):
    """The device checks on the GPU's default path (the Gluon kernel for 32 or more heads): a bad length and a
    bad page id poison their requests only and set the flags."""
    lens = [3000, 100, 5000, 64]
    q, kv, bt, sl = make_case(gen, 4, H, 512, 64, page_size, lens, torch.bfloat16, device)
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=576**-0.5)
    sl2 = sl.clone()
    sl2[1] = -5
    bt2 = bt.clone()
    bt2[2, 40] = kv.shape[0] + 3
    flags = _flags(device)
    out = mla_decode_attention(q, kv, bt2, sl2, softmax_scale=576**-0.5, error_flag=flags)
    assert flags.tolist() == [1, 1, 0, 0]
    assert bool(out[1].isnan().all()) and bool(out[2].isnan().all())
    assert rel_rmse(out.cpu()[[0, 3]].float(), ref.cpu()[[0, 3]]) < 8e-3


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_store_latent_rows_matches_reference(gen, device, dtype, as_tensor):
    """The latent write path: rows to scattered slots (-1 and out-of-range slots skipped), quantised on write
    to e4m3 with kv_scale_orig_quant; bit-exact against the plain-torch reference, then read back by decode."""
    from kvforge.kernels.mla_decode import store_latent_rows, store_latent_rows_ref

    P, S, D = 7, 4, 48
    cache = torch.zeros(P, S, D, device=device).to(dtype)
    rows = (torch.randn(9, D, generator=gen) * 3).to(device)
    rows[0, :3] = torch.tensor([1000.0, -1000.0, 0.0])  # saturates at ±448 in e4m3
    slots = torch.tensor([3, 27, -1, 0, 12, 28, 5, 19, 8], dtype=torch.int32, device=device)
    fp8 = dtype == torch.float8_e4m3fn
    s = 1.5
    sc = (torch.tensor([s], device=device) if as_tensor else s) if fp8 else None
    want = store_latent_rows_ref(cache, slots, rows, kv_scale_orig_quant=s if fp8 else None)
    store_latent_rows(cache, slots, rows, kv_scale_orig_quant=sc)
    got_bits = cache.view(torch.uint8 if fp8 else torch.int16).cpu().int()
    want_bits = want.view(torch.uint8 if fp8 else torch.int16).cpu().int()
    # The interpreter's fp32 -> bf16 cast truncates (a GPU rounds to nearest even): one ulp apart there.
    ulps = 1 if (not fp8 and device.type == "cpu") else 0
    assert int((got_bits - want_bits).abs().max()) <= ulps
    assert bool((cache.float().view(P * S, D)[[1, 2, 4]] == 0).all())  # slots nobody wrote
    if fp8:
        with pytest.raises(ValueError, match="kv_scale_orig_quant"):
            store_latent_rows(cache, slots, rows, kv_scale_orig_quant=0.0)
    else:
        with pytest.raises(ValueError, match="kv_scale_orig_quant"):
            store_latent_rows(cache, slots, rows, kv_scale_orig_quant=2.0)
    with pytest.raises(ValueError, match="rows: expected rows as wide"):
        store_latent_rows(cache, slots, rows[:, :40])
    with pytest.raises(TypeError, match="slots"):
        store_latent_rows(cache, slots.float(), rows)


def test_store_then_decode_fp8(gen, device):
    """Write a request's rows through the FP8 write path, decode over them: within the stated bound of fp32
    attention over the original rows."""
    from kvforge.kernels.mla_decode import store_latent_rows

    P, S, DV, DR, n = 6, 8, 32, 16, 37
    rows = torch.randn(n, DV + DR, generator=gen).to(device)
    cache = torch.zeros(P, S, DV + DR, device=device).to(torch.float8_e4m3fn)
    bt = torch.tensor([[4, 0, 5, 2, 1]], dtype=torch.int32, device=device)
    slots = torch.tensor([int(bt[0, t // S]) * S + t % S for t in range(n)], dtype=torch.int64, device=device)
    store_latent_rows(cache, slots, rows, kv_scale_orig_quant=2.0)
    q = torch.randn(1, 5, DV + DR, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    out = mla_decode_attention(q, cache, bt, sl, softmax_scale=0.3, v_head_dim=DV, kv_scale_quant_orig=0.5)
    ref_cache = torch.zeros(P, S, DV + DR, device=device)
    ref_cache.view(P * S, -1)[slots] = rows
    orig, _ = mla_decode_attention_ref(q, ref_cache, bt, sl, softmax_scale=0.3, v_head_dim=DV)
    assert rel_rmse(out.cpu().float(), orig.cpu()) < FP8_BOUND_ORIGINAL


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize(("B", "page_size"), [(1, 32), (4, 64)])
def test_gpu_default_call_and_plan_run_never_sync(gen, device, H, B, page_size):
    """Once a shape has been planned (its first call tunes and compiles), the default call and
    ``MLADecodePlan.run`` enqueue without a host sync that torch can see (CUDA's sync debug mode raises on one),
    on the Triton and the Gluon paths, and their outputs match the reference."""
    from kvforge.kernels.mla_decode import MLADecodePlan

    lens = [2555] + [700] * (B - 1)
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    scale = 576**-0.5
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=scale)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=device)
    mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=out)
    plan.run(q, kv, out=out)
    outs = [poisoned((B, H, 512), torch.bfloat16, q.device) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode_attention(q, kv, bt, sl, softmax_scale=scale, out=outs[0])
        plan.run(q, kv, out=outs[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=scale)
    for got in outs:
        assert_all_written(got)
        assert rel_rmse(got.cpu().float(), ref.cpu()) < 8e-3
