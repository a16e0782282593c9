"""MLA decode's host path: ``MLADecodePlan`` (plan once, run per layer) against the reference, its refusals, and
the direct launches that only a GPU takes, checked on the CPU.

The direct launches (a plan's compiled kernels called through their launchers, the scratch passed as raw
addresses, TMA descriptors cloned from checked fields) never run in the interpreter. Here the wrapper runs as on
an sm_90 GPU with stubbed kernels (``bench/probe_decode_host_cost.patch_as_sm90``): the first call launches
through the JIT path (what the interpreter and the GPU both run), the next through the direct path, and the two
launches must carry the same arguments: same tensors or their addresses, equal descriptors over the same
memory, the same integers, grid and constexprs. The kernels' results on the GPU: tests/test_mla_decode_gluon.py
and tests/test_mla_decode.py's gpu cases.
"""

from __future__ import annotations

import pytest
import torch

import bench.probe_decode_host_cost as probe
import kvforge.kernels.mla_decode as md
import kvforge.kernels.mla_decode_gluon as mdg
from kvforge.kernels.mla_decode import MLADecodePlan, mla_decode_attention, mla_decode_attention_ref
from tests.helpers import assert_all_written, poisoned
from tests.test_mla_decode import make_case
from tests.tolerances import rel_rmse

# CPU tensors posing as an sm_90's: the JIT path runs them only in Triton's interpreter (on a GPU machine this
# module is skipped rather than switching the interpreter on for the whole pytest process).
pytestmark = pytest.mark.skipif(not md.interpreting(), reason="needs Triton's interpreter (CPU-only machines)")


@pytest.mark.parametrize("lens", [[0, 37, 70], [5, 300, 17, 1000]])
def test_plan_runs_match_reference(gen, device, lens):
    """One plan, several runs over different q and caches of the planned layout (a layer each): every run right,
    with fresh and given outputs, the key shares (several per request for the longer batch) merged exactly."""
    B = len(lens)
    q, kv, bt, sl = make_case(gen, B, 5, 32, 16, 16, lens, torch.float32, device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    for layer in range(3):
        q2 = torch.randn(q.shape, generator=gen).to(device)
        kv2 = torch.randn(kv.shape, generator=gen).to(device)
        ref, ref_lse = mla_decode_attention_ref(q2, kv2, bt, sl, softmax_scale=0.3, v_head_dim=32)
        if layer == 1:
            out = poisoned((B, 5, 32), torch.float32, device)
            lse = poisoned((B, 5), torch.float32, device)
            got, got_lse = plan.run(q2, kv2, out=out, lse=lse, return_lse=True)
            assert got is out and got_lse is lse
            assert_all_written(out)
        else:
            got, got_lse = plan.run(q2, kv2, return_lse=True)
        live = sl.cpu() > 0
        assert rel_rmse(got.cpu()[live], ref[live]) < 1e-5
        assert torch.allclose(got_lse.cpu()[live], ref_lse[live], atol=1e-4)
        assert bool((got.cpu()[~live] == 0).all()) and bool(torch.isneginf(got_lse.cpu()[~live]).all())
    if max(lens) == 1000:
        assert plan._plan.grid[2] > 1  # the merge ran


def test_plan_reads_the_tables_at_each_run(gen, device):
    """The plan keeps the caller's block table and lengths: updated in place, the next run reads the new values."""
    q, kv, bt, sl = make_case(gen, 2, 5, 32, 16, 16, [40, 7], torch.float32, device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    plan.run(q, kv)
    sl.copy_(torch.tensor([9, 33], dtype=torch.int32))
    ref, _ = mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    assert rel_rmse(plan.run(q, kv).cpu(), ref) < 1e-5


def test_plan_refusals(gen, device):
    q, kv, bt, sl = make_case(gen, 2, 5, 32, 16, 16, [40, 7], torch.float32, device)
    with pytest.raises(TypeError, match="softmax_scale"):  # the one call's checks, at plan time
        MLADecodePlan(q, kv, bt, sl, softmax_scale="x", v_head_dim=32)
    with pytest.raises(ValueError, match="block_table"):
        MLADecodePlan(q, kv, bt[:1], sl, softmax_scale=0.3, v_head_dim=32)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    with pytest.raises(TypeError, match="q"):
        plan.run(q.numpy(), kv)
    with pytest.raises(ValueError, match="q: expected the planned"):
        plan.run(q[:, :4], kv)
    with pytest.raises(ValueError, match="q: expected the planned"):  # same shape, other strides
        plan.run(q.transpose(0, 1).contiguous().transpose(0, 1), kv)
    with pytest.raises(ValueError, match="kv_cache: expected the planned"):
        plan.run(q, kv.double())
    with pytest.raises(ValueError, match="kv_cache: expected the planned"):  # one more page
        plan.run(q, torch.cat([kv, kv[:1]]))
    with pytest.raises(ValueError, match="kv_cache: expected the planned"):  # the same rows 4 bytes further on
        flat = torch.zeros(kv.numel() + 1, device=device)
        plan.run(q, flat[1:].view(kv.shape))
    with pytest.raises(TypeError, match="out"):
        plan.run(q, kv, out=torch.empty(2, 5, 32, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="out"):
        plan.run(q, kv, out=torch.empty(2, 5, 64, device=device)[..., :32])
    with pytest.raises(ValueError, match="lse"):
        plan.run(q, kv, lse=torch.empty(5, 2, device=device))
    with pytest.raises(TypeError, match="return_lse"):
        plan.run(q, kv, return_lse=1)


def test_plan_output_overlap_refused(gen, device):
    q, kv, bt, sl = make_case(gen, 2, 5, 32, 16, 16, [40, 7], torch.float32, device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32)
    out = torch.empty(2, 5, 32, device=device)
    with pytest.raises(ValueError, match="out: overlaps q"):
        plan.run(q, kv, out=q.view(-1)[: out.numel()].view(out.shape))
    with pytest.raises(ValueError, match="lse: overlaps kv_cache"):
        plan.run(q, kv, out=out, lse=kv.view(-1)[:10].view(2, 5))
    with pytest.raises(ValueError, match="out: overlaps lse"):
        plan.run(q, kv, out=out, lse=out.view(-1)[:10].view(2, 5))
    plan.run(q, kv, out=out)  # and a separate buffer is fine


def test_plan_value_checks(gen, device):
    """Default: bad values poison that request and set the plan's error flag on the device; strict: every run
    raises on the host, naming the entry."""
    q, kv, bt, sl = make_case(gen, 2, 5, 32, 16, 16, [40, 7], torch.float32, device)
    flags = torch.zeros(2, dtype=torch.int32, device=device)
    plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, error_flag=flags)
    strict = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32, check_values="strict")
    good = sl.clone()
    sl[1] = bt.shape[1] * 16 + 1
    out = plan.run(q, kv)
    assert flags.tolist() == [1, 0] and bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        strict.run(q, kv)
    sl.copy_(good)
    strict.run(q, kv)


def test_plan_without_requests(device):
    q = torch.empty(0, 5, 48, device=device)
    kv = torch.zeros(4, 16, 48, device=device)
    bt = torch.zeros(0, 2, dtype=torch.int32, device=device)
    sl = torch.zeros(0, dtype=torch.int32, device=device)
    out, lse = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.3, v_head_dim=32).run(q, kv, return_lse=True)
    assert out.shape == (0, 5, 32) and lse.shape == (0, 5)


# ---- The direct launches, on the CPU with stubbed kernels -------------------------------------------------------


def _same(jit_arg: object, direct_arg: object) -> bool:
    """A direct launch's argument stands for the JIT launch's: the same tensor or its address (an e4m3 cache
    for its byte view), a descriptor with equal fields over the same memory, an equal value."""
    if isinstance(jit_arg, torch.Tensor):
        ptr = direct_arg if isinstance(direct_arg, int) else direct_arg.data_ptr()
        return ptr == jit_arg.data_ptr()
    if hasattr(jit_arg, "base") and hasattr(jit_arg, "block_shape"):
        if type(direct_arg) is not type(jit_arg) or direct_arg.base.data_ptr() != jit_arg.base.data_ptr():
            return False
        strip = lambda d: {k: v for k, v in vars(d).items() if k != "base"}
        return strip(direct_arg) == strip(jit_arg)
    return type(direct_arg) is type(jit_arg) and direct_arg == jit_arg


def _check_direct_matches(jit: tuple, direct: tuple, params: list[str], skip: tuple[int, ...] = ()) -> None:
    (grid, args, kwargs), run_args = jit[2], direct[2]
    assert jit[1] == direct[1]
    assert tuple(run_args[:3]) == tuple(grid) + (1,) * (3 - len(grid))
    body, consts = run_args[9 : 9 + len(args)], run_args[9 + len(args) :]
    assert len(body) == len(args)
    for i, (a, b) in enumerate(zip(args, body)):
        if i not in skip:
            assert _same(a, b), (jit[1], params[i], a, b)
    assert consts == tuple(kwargs[n] for n in params[len(args) :]), jit[1]


WORKLOADS = {
    # heads, page size, lengths, cache / q variant, kernel: the paths the sm_90 table takes
    "portable 16 heads, shares merged": (16, 64, [3000, 64, 1], None, "split"),
    "portable 16 heads, one share each": (16, 64, [60, 7], None, "split"),
    "gluon 64 heads, shares merged": (64, 64, [3000, 64, 1], None, "gluon"),
    "gluon 128 heads, one share each": (128, 32, [30, 7], None, "gluon"),
    "portable e4m3 cache, shares merged": (128, 64, [3000, 64, 1], "e4m3", "split"),
    "portable TMA (q not contiguous), shares merged": (64, 64, [3000, 64, 1], "strided q", "split"),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("planned", [False, True])
def test_direct_launch_matches_checked_launch(gen, monkeypatch, name, planned):
    H, page, lens, kind, expect = WORKLOADS[name]
    merged = "merged" in name
    probe.patch_as_sm90(monkeypatch.setattr)
    monkeypatch.setattr(probe, "LAUNCHES", [])
    B = len(lens)
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page, lens, torch.bfloat16, torch.device("cpu"))
    scale_kw = {}
    if kind == "e4m3":
        kv = kv.to(torch.float8_e4m3fn)
        scale_kw = {"kv_scale_quant_orig": torch.tensor([0.5])}
    if kind == "strided q":  # Gluon refuses it: the table's Gluon config runs the portable kernel through TMA
        q = torch.randn(H, B, 576, generator=gen).to(torch.bfloat16).transpose(0, 1)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16)
    lse = torch.empty(B, H)
    if planned:
        plan = MLADecodePlan(q, kv, bt, sl, softmax_scale=0.05, **scale_kw)
        call = lambda: plan.run(q, kv, out=out, lse=lse)
    else:
        call = lambda: mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out, lse=lse, **scale_kw)
    call()
    first = list(probe.LAUNCHES)
    probe.LAUNCHES.clear()
    call()
    second = list(probe.LAUNCHES)
    assert [e[0] for e in first] == ["jit"] * len(first) and [e[0] for e in second] == ["direct"] * len(first)
    assert [e[1] for e in first] == [expect, "merge"][: 1 + merged]
    # The scratch (partial, partial_lse, nshare: arguments 6, 7 and 10 of both split kernels, 0-2 of the merge)
    # is a fresh buffer per call unless planned: then its addresses must match too.
    skip = () if planned or not merged else (6, 7, 10)
    split_fn = md._mla_decode_split_kernel if expect == "split" else mdg._mla_decode_gluon_kernel
    _check_direct_matches(first[0], second[0], [p.name for p in split_fn.params], skip)
    if merged:
        _check_direct_matches(first[1], second[1], [p.name for p in md._DMERGE.fn.params], skip and (0, 1, 2))
        # One buffer: partial_lse and nshare at the planned offsets past partial, 16-byte aligned; the merge
        # reads what the split wrote.
        a = second[0][2][9:]
        _, o_pl, o_ns = (plan._plan if planned else next(iter(md._PLANS._plans.values()))).scratch
        assert isinstance(a[6], int) and a[7] - a[6] == 4 * o_pl and a[10] - a[6] == 4 * o_ns and a[6] % 16 == 0
        m = second[1][2][9:]
        assert (m[0], m[1], m[2]) == (a[6], a[7], a[10])
    if expect == "gluon":
        assert [d.base for d in second[0][2][9:13]] == [q, q, kv, kv]  # this call's tensors


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("short_q", [False, True], ids=["gluon", "short q portable TMA"])
def test_context_direct_launch_matches_checked_launch(gen, monkeypatch, planned, short_q):
    """``mla_context_attention``'s launches (``_runtime.launch_jit``) as on sm_90: the second call's direct launches
    carry the first call's arguments (the one call's fresh work table aside), and so do the third call's, replayed
    from the second's recording (``_runtime.RecordedLaunch``)."""
    from kvforge.kernels import mla_context as mc
    from kvforge.kernels import mla_context_gluon as mcg

    probe.patch_context_as_sm90(monkeypatch.setattr)
    monkeypatch.setattr(probe, "LAUNCHES", [])
    H, B, cached, new = 16, 3, 200, 16 if short_q else 130
    tq, tkv = B * new, B * (cached + new)
    q = torch.randn(tq, H, 192, generator=gen).to(torch.bfloat16)
    k = torch.randn(tkv, H, 192, generator=gen).to(torch.bfloat16)
    v = torch.randn(tkv, H, 128, generator=gen).to(torch.bfloat16)
    cu_q = torch.arange(0, tq + 1, new, dtype=torch.int32)
    cu_kv = torch.arange(0, tkv + 1, cached + new, dtype=torch.int32)
    out = torch.empty(tq, H, 128, dtype=torch.bfloat16)
    if planned:
        plan = mc.MLAContextPlan.plan(cu_q, cu_kv, num_heads=H, num_kv_heads=H, head_dim_qk=192, head_dim_v=128)
        call = lambda: plan.run(q, k, v, out=out)
    else:
        call = lambda: mc.mla_context_attention(q, k, v, cu_q, cu_kv, out=out)
    call()
    first = list(probe.LAUNCHES)
    probe.LAUNCHES.clear()
    call()
    second = list(probe.LAUNCHES)
    probe.LAUNCHES.clear()
    call()
    third = list(probe.LAUNCHES)
    main = "_mla_context_fwd_kernel" if short_q else "context_gluon"
    names = [] if planned else ["_mla_work_table_kernel"]
    assert [e[1] for e in first] == [*names, main] and [e[0] for e in first] == ["jit"] * len(first)
    for later in (second, third):
        assert [e[1] for e in later] == [*names, main] and [e[0] for e in later] == ["direct"] * len(first)
    fns = {
        "_mla_work_table_kernel": mc._mla_work_table_kernel,
        "_mla_context_fwd_kernel": mc._mla_context_fwd_kernel,
        "context_gluon": mcg._mla_context_gluon_kernel,
    }
    # The one call's work table (starts, table, and the flag / scale placeholders that point at it) is new per call.
    skips = {"_mla_work_table_kernel": (2, 3, 4),
             "_mla_context_fwd_kernel": (10, 13, 16), "context_gluon": (6, 9, 12)}  # fmt: skip
    for later in (second, third):
        for a, b in zip(first, later):
            _check_direct_matches(a, b, [p.name for p in fns[a[1]].params], () if planned else skips[a[1]])
        if short_q:  # the portable kernel read q, k and v through TMA descriptors over this call's tensors
            assert [d.base for d in later[-1][2][9 + 5 : 9 + 10]] == [q, q, k, k, v]
        else:
            assert [d.base for d in later[-1][2][9 + 3 : 9 + 6]] == [k, k, v]
    if not planned:  # the replay's table launches and attention launch share this call's work table
        w = third[0][2][9 + 4]
        assert third[0][2][9 + 2].data_ptr() == w.data_ptr() + 4 * w.numel()  # starts follow the table
        assert third[-1][2][9 + (10 if short_q else 6)] is w


@pytest.mark.parametrize("name", ["gluon 64 heads, shares merged", "portable TMA (q not contiguous), shares merged"])
def test_cached_launch_state_keeps_no_tensor(gen, monkeypatch, name):
    """The plan cache, the per-plan launch state and the descriptor fields keep no caller tensor alive."""
    import gc
    import weakref

    H, page, lens, kind, _ = WORKLOADS[name]
    probe.patch_as_sm90(monkeypatch.setattr)
    q, kv, bt, sl = make_case(gen, len(lens), H, 512, 64, page, lens, torch.bfloat16, torch.device("cpu"))
    if kind == "strided q":
        q = torch.randn(H, len(lens), 576, generator=gen).to(torch.bfloat16).transpose(0, 1)
    out = torch.empty(len(lens), H, 512, dtype=torch.bfloat16)
    for _ in range(2):  # planned and checked, then launched directly
        mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out)
    refs = [weakref.ref(t) for t in (q, kv, bt, sl, out)]
    assert len(md._PLANS) == 1
    del q, kv, bt, sl, out
    gc.collect()
    assert all(r() is None for r in refs)
