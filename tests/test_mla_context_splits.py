"""MLA context attention with key shares (split-KV): few (query tile, head) programs over a long cached prefix.

``MLAContextPlan.plan`` splits each work item's keys into ``kv_splits`` shares when its programs are too few for
the GPU (``context_kv_splits``); the kernels write fp32 partials and ``merge_attention_states`` merges them. The
one call with device lengths splits its device-built items the same way on chip (``_chip_share``), its share
count from bounds alone. CPU (interpreter) cases check the share table, the rules and the merged output against
the plain-torch reference on awkward lengths (items shorter than their shares, an empty request, dim-major V's
aligned head, invalid requests' NaN rows); the ``gpu`` cases repeat them at serving sizes and inside a CUDA
graph on the H200.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import triton

import kvforge.kernels.mla_context as mc
from kvforge.kernels.mla_context import (
    MLAContextPlan,
    context_kv_splits,
    mla_context_attention_ref,
    quantize_kv_e4m3,
    v_to_dim_major,
)
from tests.helpers import assert_all_written, poisoned
from tests.test_mla_context_nosync import _cu
from tests.tolerances import assert_close, rel_rmse

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 / 0 and log(0) of empty shares

# A short tile over a long prefix, a request shorter than its shares, an empty request, no prefix at all.
Q_LENS, CACHED = [3, 0, 21, 1], [150, 9, 0, 11]
MODES = ["bf16", "fp8", "fp8-dim-major", "fp8kv"]


def _inputs(gen, device, mode, q_lens=Q_LENS, cached=CACHED, heads=2, dqk=192, dv=128, s=1.5):
    kv_lens = [a + b for a, b in zip(q_lens, cached)]
    cu_q, cu_kv = _cu(q_lens), _cu(kv_lens)
    g = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(int(torch.randint(1 << 30, (1,))))
    q = torch.randn(int(cu_q[-1]), heads, dqk, generator=g, device=device)
    k = torch.randn(int(cu_kv[-1]), heads, dqk, generator=g, device=device)
    v = torch.randn(int(cu_kv[-1]), heads, dv, generator=g, device=device)
    kw: dict = {}
    ref_kw: dict = {}
    if mode == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    else:
        q = quantize_kv_e4m3(q, 1.0 / s) if mode.startswith("fp8") and mode != "fp8kv" else q.bfloat16()
        k, v = quantize_kv_e4m3(k, 1.0 / s), quantize_kv_e4m3(v, 1.0 / s)
        kw = ref_kw = {"kv_scale_quant_orig": s}
    return q, k, v, cu_q.to(device), cu_kv.to(device), kw, ref_kw


def _plan(q, k, v, cu_q, cu_kv, mode, **kw):
    return MLAContextPlan.plan(
        cu_q, cu_kv, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim_qk=q.shape[2],
        head_dim_v=v.shape[1] if mode == "fp8-dim-major" else v.shape[-1], q_dtype=q.dtype, kv_dtype=k.dtype,
        v_layout="dim_major" if mode == "fp8-dim-major" else "token_major", **kw,
    )  # fmt: skip


def _check(got, lse, ref, ref_lse, mode):
    assert_all_written(got)
    fp8 = mode != "bf16"
    if mode == "fp8kv":  # a bf16 q quantised on chip: see test_one_call_reads_nothing_back's bounds
        torch.testing.assert_close(got.double(), ref.double(), atol=0.12, rtol=0.07)
    else:
        assert_close(got, ref, mc.FP8 if fp8 else torch.bfloat16)
    assert rel_rmse(got, ref) < (0.03 if fp8 else 0.02)
    if lse is not None:
        atol = 0.12 if mode == "fp8kv" else 2e-2 if fp8 else 1e-3
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=atol, rtol=1e-3)


def test_rule_splits_only_few_programs():
    """The wave model: shares only below two programs per resident slot, the count with the fewest modelled
    block times (waves x (blocks per share + KV_SPLIT_PROGRAM_COST)), only if that saves 10%."""
    assert context_kv_splits(200, 128, 400, 132) == 1  # 25600 programs: the GPU is full
    assert context_kv_splits(3, 128, 400, 132) == 1  # 384 programs: more than two per SM already
    assert context_kv_splits(2, 128, 400, 132) == 1  # 256 programs: two even waves, shares add waves
    assert context_kv_splits(1, 128, 400, 132) == 1  # 128 programs: one wave already
    assert context_kv_splits(4, 16, 163, 132) == 2  # 64 programs: 2 shares fill one wave, 3 would need two
    assert context_kv_splits(1, 16, 185, 132) == 8  # 16 programs: 8 shares, one wave of 128
    assert context_kv_splits(6, 16, 240, 132) == 4  # 96 programs: 2 shares take 2 waves of half; 4 take 3
    assert context_kv_splits(1, 2, 20, 132) == 2  # 20 blocks: shares of at least 8
    assert context_kv_splits(1, 2, 7, 132) == 1
    assert context_kv_splits(1, 2, 10_000, 132) == mc.KV_SPLIT_MAX
    assert context_kv_splits(1, 2, 10_000, 132, mc.KV_SPLIT_SCRATCH_BYTES // 3) == 3
    assert context_kv_splits(0, 16, 0, 132) == 1
    # Two resident per SM: 200 programs leave 64 of 264 slots idle; 13 shares fill 10 waves to 98%.
    assert context_kv_splits(1, 200, 10_000, 132, 0, 2) == 13
    # One resident: 200 programs take two waves, the second half empty; 15 shares fill 23 waves to 99%.
    assert context_kv_splits(1, 200, 10_000, 132, 0, 1) == 15
    assert context_kv_splits(1, 200, 100, 132, 0, 1) == 5  # 100 blocks: 8 waves of 22 block times, 14% saved
    assert context_kv_splits(1, 200, 40, 132, 0, 1) == 1  # 40 blocks: the programs' fixed cost eats the gain


def _model(programs: int, blocks: int, slots: int, s: int) -> float:
    return -(-programs * s // slots) * (blocks / s + mc.KV_SPLIT_PROGRAM_COST)


@pytest.mark.parametrize("seed", range(4))
def test_rule_is_the_best_modelled_count(seed):
    """Random batches: the chosen count is allowed (share size, cap) and no allowed count models faster."""
    rng = random.Random(seed)
    for _ in range(200):
        items, heads, blocks = rng.randint(1, 40), rng.choice([1, 2, 8, 16, 32, 64, 128]), rng.randint(0, 2000)
        sms, resident = rng.choice([8, 78, 132]), rng.randint(1, 2)
        got = context_kv_splits(items, heads, blocks, sms, 0, resident)
        p, slots = items * heads, sms * resident
        assert 1 <= got <= mc.KV_SPLIT_MAX
        if got > 1:
            assert p < mc.KV_SPLIT_MAX_PROGRAMS * slots and blocks // got >= mc.KV_SPLIT_MIN_BLOCKS
            assert _model(p, blocks, slots, got) < mc.KV_SPLIT_MIN_GAIN * _model(p, blocks, slots, 1)
            allowed = range(1, min(blocks // mc.KV_SPLIT_MIN_BLOCKS, mc.KV_SPLIT_MAX) + 1)
            assert all(_model(p, blocks, slots, got) <= _model(p, blocks, slots, s) for s in allowed)


@pytest.mark.parametrize(
    "args",
    [
        (-1, 2, 3, 4),
        (1, 0, 3, 4),
        (1, 2, -3, 4),
        (1, 2, 3, 0),
        (1.0, 2, 3, 4),
        (True, 2, 3, 4),
        (1, 2, 3, 4, -1),
        (1, 2, 3, 4, 0, 0),
        (1, 2, 3, 4, 0, 1.5),
    ],
)
def test_rule_refuses_bad_arguments(args):
    with pytest.raises((TypeError, ValueError), match=r"expected an int"):
        context_kv_splits(*args)


@pytest.mark.parametrize("seed", range(8))
def test_shares_cover_every_key_once(seed):
    """Random items: mapped back to the item's key indices, the shares' key ranges (below ``min(diag0' + rows,
    cap)`` of their rebased base) tile [0, diag0 + rows) in order; a rebased share starts on an aligned token
    (no head block); each share writes its own partial rows; the costs add up to the item's blocks."""
    rng = random.Random(seed)
    bn, align, total_q = rng.choice([16, 64, 128]), rng.choice([1, 8, 16]), 500
    items = []
    for _ in range(rng.randint(1, 6)):
        n, d0, k0 = rng.randint(1, 128), rng.randint(0, 5000), rng.randint(0, 10_000)
        items.append((d0 + n, rng.randint(0, total_q - n), n, k0, d0))
    splits = rng.randint(2, 16)
    shares = mc._share_items(items, splits, bn, align, total_q)
    assert len(shares) == splits * len(items)
    for i, (_c, q0, n, k0, d0) in enumerate(items):
        mine = shares[i * splits : (i + 1) * splits]
        blocks = -(-(d0 + n + k0 % align) // bn)
        assert all(s[1:3] == (q0, n) and s[7:] == (0, 0) for s in mine)
        assert [s[5] for s in mine] == [c * total_q + q0 for c in range(splits)]
        assert mine[0][3:5] == (k0, d0)
        start = 0
        for c, (_keys, _q, _n, k, d, _row, cap, *_rest) in enumerate(mine):
            if c > 0:
                assert k % align == 0 and k - k0 == d0 - d
            end = max(0, min(d + n, cap))  # keys the share sweeps, in its own indices
            lo, hi = (k - k0) + 0, (k - k0) + end  # in the item's indices
            if end > 0:
                assert lo == start, (c, lo, start)
                start = hi
        assert start == d0 + n
        assert sum(s[0] for s in mine) == blocks * bn


def test_bad_kv_splits_refused(gen, device):
    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16")
    for bad in (0, mc.KV_SPLIT_MAX + 1, -1):
        with pytest.raises(ValueError, match="kv_splits"):
            _plan(q, k, v, cu_q, cu_kv, "bf16", kv_splits=bad)
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match="kv_splits"):
            _plan(q, k, v, cu_q, cu_kv, "bf16", kv_splits=bad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [2, 5])
def test_split_plan_equals_reference(gen, device, mode, splits):
    """Forced shares, every input mode: the merged output and lse equal the reference (an item with fewer key
    blocks than shares leaves empty shares, which the merge drops), and the planned run without ``lse`` writes
    the same output through the plan's own lse sink."""
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), **ref_kw)
    if mode == "fp8-dim-major":
        v = v_to_dim_major(v)
    plan = _plan(q, k, v, cu_q, cu_kv, mode, kv_splits=splits)
    items = _plan(q, k, v, cu_q, cu_kv, mode, kv_splits=1).n_items
    assert plan.kv_splits == splits and plan.n_items == splits * items and plan.work.shape == (splits * items, 8)
    out = poisoned((q.shape[0], q.shape[1], 128), torch.bfloat16, device)
    lse = poisoned((q.shape[0], q.shape[1]), torch.float32, device)
    for t in plan._share_tensors[:3]:  # every partial row a share owns must be written (NaN would survive the merge)
        t.fill_(float("nan"))
    got, got_lse = plan.run(q, k, v, out=out, lse_out=lse, **kw)
    assert got is out and got_lse is lse
    _check(got, got_lse, ref, ref_lse, mode)
    again = plan.run(q, k, v, **kw)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["bf16", "fp8-dim-major"])
def test_random_batches_with_shares_equal_the_reference(device, mode, seed):
    """Seeded random batches (2-3 requests, so a request's first key is rarely 16-aligned: dim-major V's
    ``shift``), random share counts and kernel forms (carried score product, heads outer, polynomial exp2),
    partials NaN-filled first: the merged output and lse equal the reference."""
    rng = random.Random(1000 * seed + len(mode))
    n = rng.randint(2, 3)
    q_lens, cached = [rng.randint(1, 40) for _ in range(n)], [rng.randint(0, 200) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode, q_lens=q_lens, cached=cached)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), **ref_kw)
    if mode == "fp8-dim-major":
        v = v_to_dim_major(v)
    bm, bn = (16, 16) if device.type == "cpu" else (64, 64)
    cfg = mc._cfg(block_m=bm, block_n=bn, warps=4, stages=2, pipe_qk=rng.choice([0, 2]),
                  heads_outer=rng.random() < 0.5, exp_poly=rng.random() < 0.5)  # fmt: skip
    plan = _plan(q, k, v, cu_q, cu_kv, mode, config=cfg, kv_splits=rng.randint(2, 6))
    for t in plan._share_tensors[:3]:
        t.fill_(float("nan"))
    got, lse = plan.run(q, k, v, return_lse=True, **kw)
    _check(got, lse, ref.to(device), ref_lse.to(device), mode)


def test_strict_call_takes_the_device_calls_shares(gen, device):
    """``strict=True`` only adds host checks: on a batch the device-table call splits (one 3-row tile over many
    cached keys, 2 heads: 600 for the interpreter's 16-key blocks, 4000 for the GPU's 128), its host plan takes
    the same config and share count, so the host-built shares equal the on-chip ones bit for bit."""
    from kvforge.kernels.mla_context import mla_context_attention

    cached = 600 if device.type == "cpu" else 4000
    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16", q_lens=[3], cached=[cached])
    dev_plan = MLAContextPlan._plan_on_device(mc._check_shapes(2, 2, 192, 128, q.dtype, k.dtype, "token_major"),
                                              cu_q, cu_kv, None, None, 3, k.shape[0])  # fmt: skip
    assert dev_plan.kv_splits > 1 and dev_plan.chip_shares and dev_plan.work.shape[1] == 4
    strict, strict_lse = mla_context_attention(q, k, v, cu_q, cu_kv, return_lse=True, strict=True)
    dev, dev_lse = mla_context_attention(q, k, v, cu_q, cu_kv, return_lse=True)
    assert torch.equal(strict, dev) and torch.equal(strict_lse, dev_lse)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())
    _check(dev, dev_lse, ref.to(device), ref_lse.to(device), "bf16")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_one_call_shares_on_chip_equal_the_reference(device, monkeypatch, mode, seed):
    """The one call with device lengths (no host read): its 4-int items split into shares on chip. Random
    batches, random forced share counts (2-6) and kernel forms, with and without ``max_seqlen_*``: output and
    lse equal the reference; replays (third call on) reuse their kept scratch and equal the first call."""
    from kvforge.kernels.mla_context import mla_context_attention

    rng = random.Random(7000 + 100 * seed + len(mode))
    n = rng.randint(1, 3)
    q_lens, cached = [rng.randint(1, 40) for _ in range(n)], [rng.randint(0, 200) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode, q_lens=q_lens, cached=cached)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), **ref_kw)
    layout = "token_major"
    if mode == "fp8-dim-major":
        v, layout = v_to_dim_major(v), "dim_major"
    splits = rng.randint(2, 6)
    monkeypatch.setattr(mc, "_device_kv_splits", lambda *a: splits)
    monkeypatch.setattr(mc, "_CALLS", mc.PlanCache(maxsize=8))
    if device.type == "cpu":
        cfg = mc._cfg(block_m=16, block_n=16, warps=4, stages=2, pipe_qk=rng.choice([0, 2]),
                      heads_outer=rng.random() < 0.5, exp_poly=rng.random() < 0.5)  # fmt: skip
        monkeypatch.setattr(mc, "_device_config", lambda *a: cfg)
    if rng.random() < 0.5:
        kw = {**kw, "max_seqlen_q": max(q_lens), "max_seqlen_kv": max(a + b for a, b in zip(q_lens, cached))}
    out = poisoned((q.shape[0], 2, 128), torch.bfloat16, device)
    first = None
    for _ in range(4):  # checked, noted, recorded, replayed
        out.fill_(float("nan"))
        got, lse = mla_context_attention(q, k, v, cu_q, cu_kv, out=out, return_lse=True, v_layout=layout, **kw)
        _check(got, lse, ref.to(device), ref_lse.to(device), mode)
        if first is None:
            first = got.clone(), lse.clone()
        assert torch.equal(got, first[0]) and torch.equal(lse, first[1])


def test_one_call_recordings_share_one_scratch(gen, device, monkeypatch):
    """Two one-call recordings of the same shapes on other buffers (two layers of a step) replay through one
    shared share scratch on their stream, not one each, and still compute their own outputs."""
    from kvforge.kernels.mla_context import mla_context_attention

    monkeypatch.setattr(mc, "_device_kv_splits", lambda *a: 3)
    monkeypatch.setattr(mc, "_CALLS", mc.PlanCache(maxsize=8))
    monkeypatch.setattr(mc, "_SCRATCH", {})
    layers = [_inputs(gen, device, "bf16", q_lens=[5, 9], cached=[40, 3]) for _ in range(2)]
    for _ in range(3):  # checked, recorded, replayed
        for q, k, v, cu_q, cu_kv, _, _ in layers:
            got = mla_context_attention(q, k, v, cu_q, cu_kv)
            _check(got, None, mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())[0].to(device), None,
                   "bf16")  # fmt: skip
    ones = [e[1] for e in mc._CALLS._plans.values() if e is not None]
    assert len(ones) == 2 and all(len(one.kept) == 1 for one in ones)
    (a,), (b,) = (list(one.kept.values()) for one in ones)
    assert a[0] is not b[0]  # each recording its own table buffer
    assert len(a) == len(b) == 8 and all(x is y for x, y in zip(a[3:], b[3:]))
    assert len(mc._SCRATCH) == 1


@pytest.mark.parametrize("max_seqlen", [False, True])
def test_one_call_shares_keep_nan_rows_for_a_bad_batch(gen, device, monkeypatch, max_seqlen):
    """An invalid request of a device-built table (kv_len < q_len, or past k's rows) writes lse NaN in its
    shares, so the merge gives it NaN rows and lse as the one-share kernel does; valid requests stay exact."""
    from kvforge.kernels.mla_context import mla_context_attention

    monkeypatch.setattr(mc, "_device_kv_splits", lambda *a: 3)
    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16", q_lens=[5, 20, 7, 9], cached=[40, 0, 3, 2])
    bad = cu_kv.clone()
    bad[3] = bad[2] + 2  # request 2: kv_len 2 < q_len 7
    bad[4] = k.shape[0] + 5  # request 3: past k's rows
    kw = {"max_seqlen_q": 20, "max_seqlen_kv": 64} if max_seqlen else {}
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = mla_context_attention(q, k, v, cu_q, bad, error_flag=flag, return_lse=True, **kw)
    assert int(flag[0]) == 1
    good, good_lse = mla_context_attention(q, k, v, cu_q, cu_kv, error_flag=flag, return_lse=True, **kw)
    assert int(flag[0]) == 0
    cq = cu_q.tolist()
    assert torch.equal(out[: cq[2]], good[: cq[2]]) and torch.equal(lse[: cq[2]], good_lse[: cq[2]])
    assert torch.isnan(out[cq[2] :].float()).all() and torch.isnan(lse[cq[2] :]).all()
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())
    _check(good, good_lse, ref.to(device), ref_lse.to(device), "bf16")


def test_device_rule_from_bounds(device):
    """The device-table call's share count comes from bounds alone: its slot count and ``max_seqlen_kv`` (else
    every key row), with the wave model of ``context_kv_splits``."""
    sh = mc._check_shapes(16, 16, 192, 128, torch.bfloat16, torch.bfloat16, "token_major")
    cfg = mc._cfg(block_m=128, block_n=128, warps=8, stages=2, gluon=True)
    dev = torch.device("cpu")
    assert mc._device_kv_splits(sh, dev, cfg, 1, 109, 23710) == context_kv_splits(1, 16, 186, 132, 109 * 16 * 516)
    assert mc._device_kv_splits(sh, dev, cfg, 1, 109, 23710) == 8
    assert mc._device_kv_splits(sh, dev, cfg, 200, 25600, 23710) == 1  # 3200 programs: the GPU is full
    assert mc._device_slots(1, 422, 422, 128) == 4 and mc._device_slots(3, 300, 300, 128) == 5
    assert mc._device_slots(0, 0, 0, 128) == 0


def test_shares_refuse_oversized_scratch_and_mismatched_tables(gen, device, monkeypatch):
    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16")
    monkeypatch.setattr(mc, "KV_SPLIT_SCRATCH_BYTES", 1024)
    with pytest.raises(ValueError, match="kv_splits: 2 shares"):
        _plan(q, k, v, cu_q, cu_kv, "bf16", kv_splits=2)
    plan = _plan(q, k, v, cu_q, cu_kv, "bf16", kv_splits=1)
    with pytest.raises(ValueError, match="work: expected 8-int items"):
        MLAContextPlan(plan.shapes, plan.device, plan.config, plan.work, plan.n_items, plan.total_q,
                       plan.total_kv, kv_splits=2)  # fmt: skip


def test_no_tuning_inside_a_graph_capture(monkeypatch):
    """A TunedKernel launched while the stream captures takes its committed or first config without timing
    candidates (timing synchronises, which breaks the capture) and does not remember it."""
    from kvforge.kernels import _runtime as rt
    from kvforge.kernels.merge_states import _MERGE

    monkeypatch.setattr(rt, "_stream_capturing", lambda: True)
    monkeypatch.setattr(rt.TunedKernel, "_tune", staticmethod(lambda *a: pytest.fail("tuned inside a capture")))
    key = (12345,)  # no committed config; two candidates, so the key would be tuned outside a capture
    two = [triton.Config({"BLOCK_R": 16, "BLOCK_D": 64}, num_warps=1), triton.Config({"BLOCK_R": 8, "BLOCK_D": 64})]
    monkeypatch.setattr(_MERGE, "table", SimpleNamespace(candidates=lambda cap, k: two))
    launched = []
    monkeypatch.setattr(
        _MERGE, "fn", type("F", (), {"__getitem__": lambda self, g: lambda *a, **k: launched.append(k)})()
    )
    _MERGE.launch(lambda meta: (1,), key, 1, 2)
    assert launched and launched[0]["BLOCK_R"] == 16 and not any(m[1] == key for m in _MERGE._chosen)


def test_rule_picks_shares_for_a_short_tile_over_a_long_prefix(gen, device):
    """Automatic: one 3-row request over 2000 cached keys on 2 heads is 2 programs, far below the GPU; the plan
    takes ``context_kv_splits``'s shares and still equals the reference. A Gluon config takes them too, with
    one program resident per SM instead of the portable kernel's ``KV_SPLIT_RESIDENT_PORTABLE``."""
    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16", q_lens=[3], cached=[2000])
    plan = _plan(q, k, v, cu_q, cu_kv, "bf16")
    bn = int(plan.config.kwargs["BLOCK_N"])
    sms = mc.num_sms(device) if device.type == "cuda" else 132
    resident = 1 if plan.config.kwargs.get("GLUON") else mc.KV_SPLIT_RESIDENT_PORTABLE
    want = context_kv_splits(1, 2, -(-2003 // bn), sms, 3 * 2 * 129 * 4, resident)
    assert want > 1 and plan.kv_splits == want
    ref, _ = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())
    _check(plan.run(q, k, v), None, ref, None, "bf16")
    gl = mc._cfg(block_m=128, block_n=128, warps=8, stages=2, gluon=True)
    want_gl = context_kv_splits(1, 2, -(-2003 // 128), sms, 3 * 2 * 129 * 4, 1)
    assert _plan(q, k, v, cu_q, cu_kv, "bf16", config=gl).kv_splits == want_gl > 1


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-dim-major", "fp8kv"])
def test_rule_is_the_same_on_every_path(device, mode):
    """Every input mode plans the wave model's count (the partials are fp32 whatever the inputs): 3-row tiles
    over 2003 keys on 64-key blocks, at a quarter, three quarters and one and a half programs per slot."""
    q_dt = torch.bfloat16 if mode in ("bf16", "fp8kv") else mc.FP8
    kv_dt = torch.bfloat16 if mode == "bf16" else mc.FP8
    layout = "dim_major" if mode == "fp8-dim-major" else "token_major"
    cfg = mc._cfg(block_m=64, block_n=64, warps=4, stages=2)
    sms = mc.num_sms(device) if device.type == "cuda" else 132
    slots = sms * mc.KV_SPLIT_RESIDENT_PORTABLE
    # Dim-major V's blocks start up to 15 keys before the request: one block more at most.
    blocks = -(-(2003 + (15 if layout == "dim_major" else 0)) // 64)
    for heads in (slots // 4, slots * 3 // 4, slots * 3 // 2):
        plan = MLAContextPlan.plan(
            _cu([3]).to(device), _cu([2003]).to(device), num_heads=heads, num_kv_heads=heads, head_dim_qk=192,
            head_dim_v=128, q_dtype=q_dt, kv_dtype=kv_dt, v_layout=layout, config=cfg,
        )  # fmt: skip
        assert plan.kv_splits == context_kv_splits(1, heads, blocks, sms, 3 * heads * 129 * 4, 2), heads


# ----------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_split_plan_serving_size(gen, device, mode):
    """A 50-row chunk over 21,850 cached keys on 128 heads (the context grid's weakest kind of row): output and
    lse of the share form against the reference."""
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode, q_lens=[50], cached=[21850], heads=128)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), head_chunk=16, **ref_kw)
    if mode == "fp8-dim-major":
        v = v_to_dim_major(v)
    # Forced: 128 programs fill the H200's 132 SMs in one wave, where the rule takes one share.
    plan = _plan(q, k, v, cu_q, cu_kv, mode, kv_splits=5)
    assert plan.kv_splits > 1, plan.config
    got, lse = plan.run(q, k, v, return_lse=True, **kw)
    _check(got, lse, ref.to(device), ref_lse.to(device), mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_gluon_share_form(gen, device, mode):
    """16 heads, one 109-row tile over 23,601 cached keys (seed 5151's r19): 16 programs of the Gluon kernel,
    which now takes key shares (the GPU otherwise idles); output and lse against the reference."""
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode, q_lens=[109], cached=[23601], heads=16)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), **ref_kw)
    if mode == "fp8-dim-major":
        v = v_to_dim_major(v)
    plan = _plan(q, k, v, cu_q, cu_kv, mode)
    assert plan.kv_splits > 1, plan.config
    got, lse = plan.run(q, k, v, return_lse=True, **kw)
    _check(got, lse, ref.to(device), ref_lse.to(device), mode)


@pytest.mark.gpu
def test_gpu_gluon_shares_with_unaligned_request_starts(gen, device):
    """FP8 dim-major V on the Gluon kernel's share form where requests start off a 16-token boundary (``shift``
    > 0 in the first share, rebased later shares), a short tile and a long one over long prefixes."""
    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, "fp8-dim-major", q_lens=[109, 7], cached=[9003, 20001],
                                               heads=16)  # fmt: skip
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), **ref_kw)
    v = v_to_dim_major(v)
    plan = _plan(q, k, v, cu_q, cu_kv, "fp8-dim-major", kv_splits=7)
    for t in plan._share_tensors[:3]:
        t.fill_(float("nan"))
    got, lse = plan.run(q, k, v, return_lse=True, **kw)
    _check(got, lse, ref.to(device), ref_lse.to(device), "fp8-dim-major")


@pytest.mark.gpu
def test_gpu_split_plan_in_a_cuda_graph(gen, device):
    """Shares and merge captured in a CUDA graph: replays on new inputs (same buffers) equal eager runs."""
    q, k, v, cu_q, cu_kv, kw, _ = _inputs(gen, device, "fp8", q_lens=[40, 7], cached=[9000, 3000], heads=32)
    plan = _plan(q, k, v, cu_q, cu_kv, "fp8")
    assert plan.kv_splits > 1
    out = torch.empty(q.shape[0], 32, 128, dtype=torch.bfloat16, device=device)
    lse = torch.empty(q.shape[0], 32, dtype=torch.float32, device=device)
    plan.run(q, k, v, out=out, lse_out=lse, **kw)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(q, k, v, out=out, lse_out=lse, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out, lse_out=lse, **kw)
    for _ in range(2):
        q2, k2, v2, *_ = _inputs(gen, device, "fp8", q_lens=[40, 7], cached=[9000, 3000], heads=32)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        want, want_lse = plan.run(q, k, v, return_lse=True, **kw)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_first_split_run_captured_without_lse(gen, device):
    """The first run of a share plan inside a capture (the merge's config not yet chosen: no tuning there) and
    without ``lse_out`` (the plan's own lse sink): replays equal eager runs."""
    q, k, v, cu_q, cu_kv, kw, _ = _inputs(gen, device, "bf16", q_lens=[33], cached=[7001], heads=8)
    plan = _plan(q, k, v, cu_q, cu_kv, "bf16", kv_splits=3)
    out = torch.empty(q.shape[0], 8, 128, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out, **kw)
    graph.replay()
    want = plan.run(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("max_seqlen", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_one_call_shares_serving_size(gen, device, mode, max_seqlen):
    """The one call with device lengths on seed 5151 r19's kind of row (16 heads, one 109-row request over
    23,601 cached keys: 16 programs on 132 SMs) splits its items on chip; output and lse equal the reference."""
    from kvforge.kernels.mla_context import mla_context_attention

    q, k, v, cu_q, cu_kv, kw, ref_kw = _inputs(gen, device, mode, q_lens=[109], cached=[23601], heads=16)
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), head_chunk=8, **ref_kw)
    layout = "token_major"
    if mode == "fp8-dim-major":
        v, layout = v_to_dim_major(v), "dim_major"
    if max_seqlen:
        kw = {**kw, "max_seqlen_q": 109, "max_seqlen_kv": 23710}
    sh = mc._check_shapes(16, 16, 192, 128, q.dtype, k.dtype, layout)
    cfg = mc._device_config(sh, device, 1, 109, 109 if max_seqlen else None)
    assert mc._device_kv_splits(sh, device, cfg, 1, 109, 23710) > 1
    for _ in range(3):  # checked, recorded, replayed
        got, lse = mla_context_attention(q, k, v, cu_q, cu_kv, return_lse=True, v_layout=layout, **kw)
        _check(got, lse, ref.to(device), ref_lse.to(device), mode)


@pytest.mark.gpu
def test_gpu_one_call_shares_in_a_cuda_graph(gen, device):
    """The one call's table launch, on-chip shares and merge captured in a CUDA graph: replays with new lengths
    written into the same length buffers (same totals) equal eager calls."""
    from kvforge.kernels.mla_context import mla_context_attention

    q, k, v, cu_q, cu_kv, _, _ = _inputs(gen, device, "bf16", q_lens=[40, 7], cached=[9000, 3000], heads=16)
    out = torch.empty(q.shape[0], 16, 128, dtype=torch.bfloat16, device=device)
    for _ in range(3):  # compile, note, record outside the capture
        mla_context_attention(q, k, v, cu_q, cu_kv, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mla_context_attention(q, k, v, cu_q, cu_kv, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_context_attention(q, k, v, cu_q, cu_kv, out=out)
    # Same totals (47 rows, 12047 keys), other split: (7, 40) rows over (4000 + 7, 8000 + 40) keys.
    cu_q.copy_(torch.tensor([0, 7, 47], dtype=torch.int32))
    cu_kv.copy_(torch.tensor([0, 4007, 12047], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())
    _check(out, None, ref.to(device), None, "bf16")
