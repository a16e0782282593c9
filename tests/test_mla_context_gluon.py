"""The warp-specialised sm_90 Gluon path of MLA context attention (kvforge.kernels.mla_context_gluon).

Gluon does not run in the interpreter: on the CPU these tests check that a ``GLUON`` config falls back to the
portable kernel with the same result, that only sm_90 keeps such candidates, and that the path says why it is
unavailable; the offline sm_90 compile is in tests/test_compile_targets.py. The ``gpu`` cases run the Gluon
kernel itself on the H200 against the independent reference (awkward lengths, NaN rows around the batch, an
empty request, GQA, both V layouts, FP8 and bf16 Q, s in {1, 1.5, 2}) and fail if it did not run.
"""

from __future__ import annotations

import pytest
import torch

import kvforge.kernels.mla_context as mc
import kvforge.kernels.mla_context_gluon as mg
from kvforge.kernels._checks import FP8
from kvforge.kernels.mla_context import MLAContextPlan, mla_context_attention_ref
from tests.helpers import assert_all_written, poison, poisoned
from tests.test_mla_context import _cast, _dim_major, _make
from tests.tolerances import LSE_FP8_MMA, rel_rmse, tol

_TORCH = {"e4m3": FP8, "bf16": torch.bfloat16}
GLUON_CFG = mc._cfg(block_m=128, block_n=128, warps=8, stages=2, gluon=True, heads_outer=True)


def _run(plan: MLAContextPlan, q, k, v, s: float, heads: int, d_v: int, device):
    out = poisoned((q.shape[0], heads, d_v), torch.bfloat16, device)
    lse = poisoned((q.shape[0], heads), torch.float32, device)
    plan.run(q, k, v, kv_scale_quant_orig=s, out=out, lse_out=lse)
    return out, lse


def _plan(cu_q, cu_kv, heads, kv_heads, q, k, v_layout, cfg):
    return MLAContextPlan.plan(
        cu_q, cu_kv, num_heads=heads, num_kv_heads=kv_heads, head_dim_qk=q.shape[2], head_dim_v=128,
        q_dtype=q.dtype, kv_dtype=k.dtype, v_layout=v_layout, config=cfg,
    )  # fmt: skip


def test_unavailable_reason_on_this_machine(device):
    reason = mg.gluon_unavailable_reason(device if device.type == "cuda" else None)
    if device.type == "cpu":
        assert reason is not None and not mg.gluon_available()


def test_gluon_candidates_only_on_sm90_for_its_modes():
    """sm_90 keeps Gluon candidates for every key the kernel has a mode for (gluon_supports), no other GPU does;
    a 16-bit Q with FP8 K/V only with V widened (an e4m3 P on top of the quantised Q: past the accuracy bound)."""
    keys = [(192, 128, q, kv, layout) for q, kv in (("e4m3", "e4m3"), ("bf16", "e4m3"), ("bf16", "bf16"))
            for layout in ("token_major", "dim_major")]  # fmt: skip
    for key in keys:
        has_mode = (key[2] == "e4m3" and key[3] == "e4m3") or key[4] == "token_major"
        for arch, expect in (((9, 0), True), ((8, 9), False), ((10, 0), False), ((12, 0), False), ((8, 0), False)):
            kept = [c for c in mc._CONFIGS.candidates(arch, key) if c.kwargs.get("GLUON")]
            assert bool(kept) == (expect and has_mode), (arch, key)
            assert all(mc._smem_estimate(c, key) <= mc.capability_for(arch).smem_per_block for c in kept)
            for c in kept:
                widen = bool(c.kwargs.get("V_WIDEN"))
                assert mg.gluon_supports(_TORCH[key[2]], _TORCH[key[3]], key[4] == "dim_major", widen), (c, key)
    mixed = (192, 128, "bf16", "e4m3", "token_major")
    kept = [c for c in mc._CONFIGS.candidates((9, 0), mixed) if c.kwargs.get("GLUON")]
    assert kept and all(c.kwargs.get("V_WIDEN") for c in kept)


def test_gluon_supports_table():
    f8, b16, f16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
    assert mg.gluon_supports(f8, f8, True, False) and mg.gluon_supports(f8, f8, False, True)
    assert not mg.gluon_supports(f8, f8, True, True)  # dim-major V is never widened
    assert mg.gluon_supports(b16, f8, False, True) and not mg.gluon_supports(b16, f8, False, False)
    assert mg.gluon_supports(b16, b16, False, False) and mg.gluon_supports(f16, f16, False, False)
    assert not mg.gluon_supports(b16, f16, False, False) and not mg.gluon_supports(b16, b16, True, False)
    assert not mg.gluon_supports(f8, b16, False, False) and not mg.gluon_supports(
        torch.float32, torch.float32, False, False
    )


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("KVFORGE_DISABLE_GLUON", "1")
    assert mg.gluon_unavailable_reason() == "disabled by KVFORGE_DISABLE_GLUON"


@pytest.mark.parametrize(
    "mode,v_layout,key_perm",
    [
        ("fp8", "token_major", False),
        ("fp8kv", "token_major", False),
        ("fp8", "dim_major", False),
        ("fp8", "token_major", True),
        ("bf16", "token_major", False),
    ],
)
def test_gluon_config_elsewhere_is_the_portable_kernel(gen, device, mode, v_layout, key_perm):
    """Where the Gluon path cannot run (here: the interpreter), a GLUON config computes the same result with
    the portable kernel (128x128 tiles, FP8 Q quantised on chip for a bf16 Q, token-major V widened)."""
    if mg.gluon_available(device):
        pytest.skip("the Gluon path runs on this device (see the gpu cases)")
    q, k, v, cu_q, cu_kv = _make(gen, device, [5, 0, 130], [17, 40, 3], heads=2, kv_start=3)
    q, k, v = _cast(mode, q, k, v, 1.5)
    vk = _dim_major(v) if v_layout == "dim_major" else v
    cfg = mc._cfg(block_m=128, block_n=128, warps=8, stages=2, gluon=True, heads_outer=True, key_perm=key_perm)
    plan = _plan(cu_q, cu_kv, 2, 2, q, k, v_layout, cfg)
    s = 1.0 if mode == "bf16" else 1.5  # the scale dequantises FP8 K/V only
    out, lse = _run(plan, q, k, vk, s, 2, 128, device)
    assert_all_written(out)
    assert_all_written(lse, "lse")
    ref, _ = mla_context_attention_ref(q, k, v, cu_q, cu_kv, kv_scale_quant_orig=s)
    assert rel_rmse(out, ref) < (0.01 if mode == "bf16" else 0.03)


GPU_CASES = [
    # v_layout, s, heads, kv_heads, kv_start, q_lens, cached
    ("token_major", 1.5, 16, 16, 5, [1, 300, 0, 1000, 129], [64, 17, 5, 2000, 0]),
    ("dim_major", 2.0, 16, 16, 7, [1, 300, 0, 1000, 129], [64, 17, 5, 2000, 0]),
    ("token_major", 1.0, 8, 2, 3, [777, 64], [4097, 33]),
    ("dim_major", 1.5, 8, 2, 16, [2048, 5], [0, 9000]),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "stages,pingpong,key_perm",
    [(2, False, False), (2, True, False), (2, False, True), (3, True, True)],
)
@pytest.mark.parametrize("v_layout,s,heads,kv_heads,kv_start,q_lens,cached", GPU_CASES)
def test_gpu_gluon_matches_reference(gen, device, stages, pingpong, key_perm, v_layout, s, heads, kv_heads, kv_start,
                                     q_lens, cached):  # fmt: skip
    assert mg.gluon_available(device), mg.gluon_unavailable_reason(device)
    q, k, v, cu_q, cu_kv = _make(gen, device, q_lens, cached, heads=heads, kv_heads=kv_heads, kv_start=kv_start)
    q, k, v = _cast("fp8", q, k, v, s)
    vk = _dim_major(v) if v_layout == "dim_major" else v
    cfg = mc._cfg(
        block_m=128,
        block_n=128,
        warps=8,
        stages=stages,
        gluon=True,
        pingpong=pingpong,
        key_perm=key_perm,
        heads_outer=True,
    )
    plan = _plan(cu_q, cu_kv, heads, kv_heads, q, k, v_layout, cfg)
    out = poisoned((q.shape[0], heads, 128), torch.bfloat16, device)
    lse = poisoned((q.shape[0], heads), torch.float32, device)
    handle = plan._launch(q, k, vk, out, lse, 1.0 / 192**0.5, s, None)
    assert "gluon" in str(getattr(handle, "name", "")), f"the Gluon kernel did not run: {handle!r}"
    torch.cuda.synchronize()
    assert_all_written(out)
    assert_all_written(lse, "lse")
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=s, head_chunk=4)
    atol, rtol = tol(FP8)
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=LSE_FP8_MMA[0], rtol=LSE_FP8_MMA[1])
    assert rel_rmse(out, ref) < 0.035


@pytest.mark.gpu
@pytest.mark.parametrize("mode,pingpong", [("bf16", False), ("bf16", True), ("fp16", False), ("fp8kv", False),
                                           ("fp8kv", True), ("fp8", False)])  # fmt: skip
@pytest.mark.parametrize(
    "v_layout,s,heads,kv_heads,kv_start,q_lens,cached", [c for c in GPU_CASES if c[0] == "token_major"]
)
def test_gpu_gluon_16bit_pv_modes(gen, device, mode, pingpong, v_layout, s, heads, kv_heads, kv_start, q_lens, cached):
    """The Gluon modes whose P·V runs in 16 bits: bf16/fp16 Q/K/V (``KV16``), bf16 Q quantised on chip with FP8
    K/V (``Q_QUANT``) and FP8 Q/K/V, both with V widened to fp16 on chip (``V_WIDEN``)."""
    assert mg.gluon_available(device), mg.gluon_unavailable_reason(device)
    q, k, v, cu_q, cu_kv = _make(gen, device, q_lens, cached, heads=heads, kv_heads=kv_heads, kv_start=kv_start)
    q, k, v = _cast(mode, q, k, v, s)
    widen = k.dtype == FP8
    cfg = mc._cfg(block_m=128, block_n=128, warps=8, stages=2, gluon=True, pingpong=pingpong, v_widen=widen,
                  heads_outer=True)  # fmt: skip
    plan = _plan(cu_q, cu_kv, heads, kv_heads, q, k, v_layout, cfg)
    out = poisoned((q.shape[0], heads, 128), torch.bfloat16, device)
    lse = poisoned((q.shape[0], heads), torch.float32, device)
    handle = plan._launch(q, k, v, out, lse, 1.0 / 192**0.5, s, None)
    assert "gluon" in str(getattr(handle, "name", "")), f"the Gluon kernel did not run: {handle!r}"
    torch.cuda.synchronize()
    assert_all_written(out)
    assert_all_written(lse, "lse")
    ref, ref_lse = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=s, head_chunk=4)
    if mode in ("bf16", "fp16"):
        atol, rtol = tol(torch.bfloat16)  # the output is bf16
        torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-2, rtol=1e-3)
        assert rel_rmse(out, ref) < 0.01
    else:  # FP8 K: the FP8 bounds; the output against the unquantised Q, the LSE against Q quantised as stated
        if mode == "fp8kv":  # the kernel's rule: per (row, head) s_q = amax / 448, q8 = RNE(q * (1 / s_q))
            qf = q.float()
            amax = qf.abs().amax(dim=2, keepdim=True)
            s_q = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            q_deq = (qf * (1.0 / s_q)).clamp(-448, 448).to(FP8).float() * s_q
            _, ref_lse = mla_context_attention_ref(q_deq, k, v, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=s,
                                                   head_chunk=4)  # fmt: skip
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=LSE_FP8_MMA[0], rtol=LSE_FP8_MMA[1])
        assert rel_rmse(out, ref) < 0.035


@pytest.mark.gpu
def test_gpu_bf16_q_with_gluon_config_takes_the_portable_kernel(gen, device):
    """A 16-bit Q with FP8 K/V and a Gluon config without V widened (no such Gluon mode) runs portable."""
    q, k, v, cu_q, cu_kv = _make(gen, device, [300, 7], [100, 0], heads=4)
    q, k, v = _cast("fp8kv", q, k, v, 1.5)
    plan = _plan(cu_q, cu_kv, 4, 4, q, k, "token_major", GLUON_CFG)
    out = poisoned((q.shape[0], 4, 128), torch.bfloat16, device)
    handle = plan._launch(q, k, v, out, None, 1.0 / 192**0.5, 1.5, None)
    assert "gluon" not in str(getattr(handle, "name", ""))
    ref, _ = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=1.5)
    assert rel_rmse(out, ref) < 0.035


@pytest.mark.gpu
def test_gpu_gluon_scale_tensor_and_one_call(gen, device):
    """Device scale tensor and the one-call API (device-built work table) through the Gluon config."""
    assert mg.gluon_available(device), mg.gluon_unavailable_reason(device)
    q, k, v, cu_q, cu_kv = _make(gen, device, [1000, 3, 257], [500, 0, 4096], heads=16, extra_rows=5)
    q, k, v = _cast("fp8", q, k, v, 2.0)
    sh = mc._check_shapes(16, 16, 192, 128, q.dtype, k.dtype, "token_major")
    plan = mc.MLAContextPlan._plan_on_device(sh, cu_q, cu_kv, 1000, 4353, q.shape[0], k.shape[0], config=GLUON_CFG)
    assert plan is not None
    out = plan.run(q, k, v, kv_scale_quant_orig=torch.tensor([2.0], device=device))
    ref, _ = mla_context_attention_ref(q, k, v, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=2.0, head_chunk=4)
    assert rel_rmse(out, ref) < 0.035


def test_paths_table_names_the_gluon_kernel_on_sm90(monkeypatch):
    monkeypatch.setattr(mc, "gpu_capability", lambda d=None: mc.capability_for((9, 0)))
    assert "Gluon" in mc.mla_context_paths("cuda")["fp8 q/k/v"]
    monkeypatch.setattr(mc, "gpu_capability", lambda d=None: mc.capability_for((10, 0)))
    assert "Gluon" not in mc.mla_context_paths("cuda")["fp8 q/k/v"]


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_replay(gen, device):
    """The Gluon launch captured in a CUDA graph replays the current contents of the same buffers."""
    assert mg.gluon_available(device), mg.gluon_unavailable_reason(device)
    q, k, v, cu_q, cu_kv = _make(gen, device, [1000, 0, 77], [500, 64, 4096], heads=16, extra_rows=0)
    q8, k8, v8 = _cast("fp8", q, k, v, 2.0)
    plan = _plan(cu_q, cu_kv, 16, 16, q8, k8, "token_major", GLUON_CFG)
    scale = torch.tensor([2.0], device=device)
    out = torch.empty(plan.total_q, 16, 128, device=device, dtype=torch.bfloat16)
    plan.run(q8, k8, v8, kv_scale_quant_orig=scale, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q8, k8, v8, kv_scale_quant_orig=scale, out=out)
    q8.copy_(_cast("fp8", torch.randn(q.shape, generator=gen).to(device), k, v, 2.0)[0])
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = mla_context_attention_ref(q8, k8, v8, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=2.0, head_chunk=4)
    assert rel_rmse(out, ref) < 0.035


@pytest.mark.gpu
def test_gpu_context_raw_launch(gen, device):
    """Replays of ``MLAContextPlan.run`` and of the one call over two K/V buffers in turn take the C launch past
    Triton's launcher object on the checked Triton (a recording per buffer pair, its descriptors encoded once)
    and match the reference each time."""
    import triton

    import kvforge.kernels._runtime as rt

    assert mg.gluon_available(device), mg.gluon_unavailable_reason(device)
    q, k, v, cu_q, cu_kv = _make(gen, device, [700, 5, 130], [300, 0, 2000], heads=16, extra_rows=0)
    q8, k8, v8 = _cast("fp8", q, k, v, 2.0)
    k2, v2 = _cast("fp8", q, torch.randn_like(k), torch.randn_like(v), 2.0)[1:]
    refs = [mla_context_attention_ref(q8, kk, vv, cu_q.cpu(), cu_kv.cpu(), kv_scale_quant_orig=2.0, head_chunk=4)[0]
            for kk, vv in ((k8, v8), (k2, v2))]  # fmt: skip
    plan = _plan(cu_q, cu_kv, 16, 16, q8, k8, "token_major", GLUON_CFG)
    for i in range(6):
        kk, vv = ((k8, v8), (k2, v2))[i % 2]
        assert rel_rmse(plan.run(q8, kk, vv, kv_scale_quant_orig=2.0), refs[i % 2]) < 0.035, i
    for i in range(4):
        kk, vv = ((k8, v8), (k2, v2))[i % 2]
        got = mc.mla_context_attention(q8, kk, vv, cu_q, cu_kv, kv_scale_quant_orig=2.0)
        assert rel_rmse(got, refs[i % 2]) < 0.035, i
    launches = [f.launch for f in plan._runs.values() if f is not None and f.launch is not None]
    assert launches
    if triton.__version__.startswith(rt.RAW_VERSIONS) and rt.RAW_LAUNCH:
        assert all(rec.raw is not None for rec in launches if rec.descs)
        assert all(len(rec.expanded) == 1 for rec in launches if rec.descs)
