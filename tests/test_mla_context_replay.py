"""MLA context attention: replayed launches (issue 28 item 4, host cost).

A call of ``mla_context_attention`` (device lengths) or of ``MLAContextPlan.run`` with the same tensors (address,
shape, strides, dtype, device) and scalars as two earlier checked calls (the first notes the key, the second
records) skips the checks and replays the recorded launches. These tests pin what that must keep: the work table
rebuilt from the lengths' current values, the device error flag, every check for a changed argument (raised
before any launch) and no caller tensor kept alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvforge.kernels.mla_context as mc
from kvforge.kernels.mla_context import MLAContextPlan, mla_context_attention, mla_context_attention_ref
from tests.helpers import poisoned
from tests.tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 / 0 of empty items in the interpreter


def _case(gen, device, q_lens=(5, 11, 7), cached=(9, 0, 20)):
    kv_lens = [a + b for a, b in zip(q_lens, cached)]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), 2, 192, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(sum(kv_lens), 2, 192, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(sum(kv_lens), 2, 128, generator=gen).to(device, torch.bfloat16)
    return q, k, v, cu_q, cu_kv


class _Counter:
    """Counts the checked path (``_check_inputs``), the launches (``launch_jit``, replays included) and among them
    the attention launches (the one call's table launches run before ``run``'s checks and write only its table
    and the error flag)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checked = 0
        self.launches = 0
        self.attention = 0
        real_check, real_launch = mc._check_inputs, mc.launch_jit

        def check(*a, **kw):
            self.checked += 1
            return real_check(*a, **kw)

        def launch(fn, *a, **kw):
            self.launches += 1
            self.attention += fn not in (
                mc._mla_tile_starts_kernel,
                mc._mla_work_items_kernel,
                mc._mla_work_table_kernel,
            )
            return real_launch(fn, *a, **kw)

        import kvforge.kernels._runtime as rt

        monkeypatch.setattr(mc, "_check_inputs", check)
        monkeypatch.setattr(mc, "launch_jit", launch)
        monkeypatch.setattr(rt, "launch_jit", launch)  # RecordedLaunch's fallback
        # On a GPU, launches would go to the compiled kernels' launchers, past the counter: not here.
        monkeypatch.setattr(rt, "_FAST_LAUNCH", False)


@pytest.mark.parametrize("max_seqlen", [False, True], ids=["no max", "max_seqlen"])
def test_one_call_replay_rebuilds_the_table_from_new_lengths(gen, device, monkeypatch, max_seqlen):
    """The second call replays (no checks) yet reads the lengths' new values, written in place into the same
    buffers: its output is that of the new batch."""
    c = _Counter(monkeypatch)
    monkeypatch.setattr(mc, "_CALLS", mc.PlanCache(maxsize=8))
    q, k, v, cu_q, cu_kv = _case(gen, device)
    kw = {"max_seqlen_q": 16, "max_seqlen_kv": 32} if max_seqlen else {}
    out = poisoned((*q.shape[:2], 128), torch.bfloat16, device)
    first = mla_context_attention(q, k, v, cu_q, cu_kv, out=out, **kw).clone()
    assert_close(first, mla_context_attention_ref(q, k, v, cu_q, cu_kv)[0], torch.bfloat16)
    assert torch.equal(mla_context_attention(q, k, v, cu_q, cu_kv, out=out, **kw), first)
    assert c.checked == 2 and len(mc._CALLS) == 1
    launches = c.launches
    # Same totals, other split: q lens (5, 11, 7) -> (12, 4, 7), kv lens (14, 11, 27) -> (21, 4, 27).
    cu_q.copy_(torch.tensor([0, 12, 16, 23], dtype=torch.int32))
    cu_kv.copy_(torch.tensor([0, 21, 25, 52], dtype=torch.int32))
    again = mla_context_attention(q, k, v, cu_q, cu_kv, out=out, **kw)
    assert c.checked == 2, "the third call took the checked path"
    assert c.launches - launches == 2  # the table launch (both passes in one program) and the attention launch
    assert again is out
    assert_close(again, mla_context_attention_ref(q, k, v, cu_q, cu_kv)[0], torch.bfloat16)
    assert not torch.equal(again, first)
    # The replays wrote their table into one kept buffer (this stream's), allocated once.
    ((_, one),) = [e for e in mc._CALLS._plans.values() if e is not None]
    assert len(one.kept) == 1
    ptr = next(iter(one.kept.values()))[0].data_ptr()
    mla_context_attention(q, k, v, cu_q, cu_kv, out=out, **kw)
    assert len(one.kept) == 1 and next(iter(one.kept.values()))[0].data_ptr() == ptr


def test_one_call_replay_sets_the_error_flag(gen, device, monkeypatch):
    """A replayed call checks the lengths on the device like the checked one: a bad batch written into the
    recorded buffers sets the flag and gets NaN rows, a good one clears it."""
    monkeypatch.setattr(mc, "_CALLS", mc.PlanCache(maxsize=8))
    q, k, v, cu_q, cu_kv = _case(gen, device)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    good = cu_kv.clone()
    for _ in range(2):  # noted, then recorded
        flag.fill_(1)
        mla_context_attention(q, k, v, cu_q, cu_kv, error_flag=flag)
        assert int(flag[0]) == 0 and len(mc._CALLS) == 1
    cu_kv[2] = cu_kv[1] + 3  # request 1: kv_len 3 < q_len 11
    out = mla_context_attention(q, k, v, cu_q, cu_kv, error_flag=flag)
    assert int(flag[0]) == 1 and len(mc._CALLS) == 1
    assert torch.isnan(out[5:16].float()).all() and not torch.isnan(out[:5].float()).any()
    cu_kv.copy_(good)
    out = mla_context_attention(q, k, v, cu_q, cu_kv, error_flag=flag)
    assert int(flag[0]) == 0
    assert_close(out, mla_context_attention_ref(q, k, v, cu_q, cu_kv)[0], torch.bfloat16)


def _changed_arguments(q, k, v, cu_q, cu_kv, device):
    """(name, kwargs changed from a recorded call, exception, message) for arguments the checks must refuse."""
    out = torch.empty(q.shape[0], 2, 128, dtype=torch.bfloat16, device=device)
    return [
        ("out dtype", {"out": out.float()}, TypeError, "out"),
        ("out shape", {"out": out[1:]}, ValueError, "out"),
        ("out over q", {"out": q[:, :, :128]}, ValueError, "overlaps"),
        ("k dtype", {"k": k.half()}, TypeError, "dtype"),
        ("q strided", {"q": torch.cat([q, q], 2)[:, :, ::2]}, ValueError, "last dimension contiguous"),
        ("v heads", {"v": torch.cat([v, v], 1)}, ValueError, "v"),
        ("softmax_scale", {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ("kv scale", {"kv_scale_quant_orig": 2.0}, ValueError, "kv_scale_quant_orig"),
    ]


def test_one_call_refuses_changed_arguments_after_a_replay(gen, device, monkeypatch):
    """Recorded and replayed calls do not let a changed argument through: each raises, before any launch."""
    q, k, v, cu_q, cu_kv = _case(gen, device)
    out = torch.empty(q.shape[0], 2, 128, dtype=torch.bfloat16, device=device)
    base = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv, "out": out}
    for _ in range(3):
        mla_context_attention(**base)
    c = _Counter(monkeypatch)
    for name, change, exc, text in _changed_arguments(q, k, v, cu_q, cu_kv, device):
        with pytest.raises(exc, match=text):
            mla_context_attention(**{**base, **change})
        assert c.attention == 0, name


def test_plan_run_replay_and_changed_arguments(gen, device, monkeypatch):
    """``run`` replays for the same tensors (fresh ``out`` and LSE when not given), and refuses the same changed
    arguments as the checked path, before launching."""
    q, k, v, cu_q, cu_kv = _case(gen, device)
    plan = MLAContextPlan.plan(cu_q, cu_kv, num_heads=2, num_kv_heads=2, head_dim_qk=192, head_dim_v=128)
    c = _Counter(monkeypatch)
    o1, l1 = plan.run(q, k, v, return_lse=True)
    plan.run(q, k, v, return_lse=True)
    o2, l2 = plan.run(q, k, v, return_lse=True)
    assert c.checked == 2 and c.launches == 3 and len(plan._runs) == 1
    assert o2 is not o1 and l2 is not l1
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert_close(o2, mla_context_attention_ref(q, k, v, cu_q, cu_kv)[0], torch.bfloat16)
    launches = c.launches
    changed = [*_changed_arguments(q, k, v, cu_q, cu_kv, device), ("v rows", {"v": v[:3]}, ValueError, "token rows")]
    for name, change, exc, text in changed:
        args = {"q": q, "k": k, "v": v, **change}
        with pytest.raises(exc, match=text):
            plan.run(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert c.launches == launches, name


@pytest.mark.parametrize("lse", ["none", "returned", "given"])
def test_plan_run_with_key_shares_replays_both_launches(gen, device, monkeypatch, lse):
    """A plan with key shares records its two launches (the share kernel into the plan's partials, the merge into
    ``out`` and the lse or the plan's sink) and replays both from the third call: no checks, two launches, the
    output of the current inputs, whatever the partials held before."""
    c = _Counter(monkeypatch)
    q, k, v, cu_q, cu_kv = _case(gen, device)
    plan = MLAContextPlan.plan(cu_q, cu_kv, num_heads=2, num_kv_heads=2, head_dim_qk=192, head_dim_v=128,
                               q_dtype=q.dtype, kv_dtype=k.dtype, kv_splits=3)  # fmt: skip
    out = poisoned((*q.shape[:2], 128), torch.bfloat16, device)
    lse_out = poisoned(q.shape[:2], torch.float32, device) if lse == "given" else None
    kw = {"out": out, "lse_out": lse_out, "return_lse": lse == "returned"}

    def call():
        res = plan.run(q, k, v, **kw)
        return res if isinstance(res, tuple) else (res, lse_out)

    for _ in range(2):  # noted, then recorded
        call()
    assert c.checked == 2 and c.attention == 4
    ((fast,),) = [[f for f in plan._runs.values() if f is not None]]
    assert fast.launch is not None and fast.merge is not None
    q.copy_(torch.randn(q.shape, generator=gen).to(device, q.dtype))
    for t in plan._share_tensors[:3]:
        t.fill_(float("nan"))
    out.fill_(float("nan"))
    got, got_lse = call()
    assert c.checked == 2 and c.attention == 6, "the third call should replay the share kernel and the merge"
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu())
    assert got is out
    assert_close(got, ref.to(device), torch.bfloat16)
    if lse != "none":
        torch.testing.assert_close(got_lse, ref_lse.to(device), atol=1e-3, rtol=1e-3)


def test_replay_state_keeps_no_tensor(gen, device):
    """The one call's replay cache and a plan's replays keep no caller tensor alive."""
    q, k, v, cu_q, cu_kv = _case(gen, device)
    out = torch.empty(q.shape[0], 2, 128, dtype=torch.bfloat16, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    plan = MLAContextPlan.plan(cu_q, cu_kv, num_heads=2, num_kv_heads=2, head_dim_qk=192, head_dim_v=128)
    for _ in range(3):
        mla_context_attention(q, k, v, cu_q, cu_kv, out=out, return_lse=True)
        plan.run(q, k, v, out=out, kv_scale_quant_orig=scale)
    assert len(plan._runs) == 1
    refs = [weakref.ref(t) for t in (q, k, v, cu_q, cu_kv, out, scale)]
    del q, k, v, cu_q, cu_kv, out, scale
    gc.collect()
    assert all(r() is None for r in refs)
