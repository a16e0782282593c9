"""The warp-specialised sm_90 Gluon path of MLA decode attention (kvforge.kernels.mla_decode_gluon).

Gluon does not run in the interpreter: on the CPU these tests check that a ``GLUON`` config computes the right
result with the portable kernel, that only sm_90 bf16 many-head keys keep such candidates, that the path says
why it cannot run, and that the kernel compiles offline for sm_90 within the SM's shared memory (this file is
also the compile script: ``python tests/test_mla_decode_gluon.py``). The ``gpu`` cases run the Gluon kernel on
the H200 against the independent reference (awkward lengths, partial last tiles over NaN page tails, an empty
request, head counts that are not a multiple of 64, page sizes 64 and 128, several split counts) and fail if it
did not run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # the compile script: no driver here, so turn the interpreter off before kvforge decides
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, str(ROOT))

import kvforge.kernels.mla_decode as md  # noqa: E402
import kvforge.kernels.mla_decode_gluon as mdg  # noqa: E402
from kvforge.kernels import _runtime  # noqa: E402
from kvforge.kernels._runtime import ConfigTable, TunedKernel  # noqa: E402
from tests.test_mla_decode import check, make_case  # noqa: E402

VARIANTS = md.gluon_variants()  # (block_n, stages, early) of every Gluon candidate, the TRIAL_ENV ones too
VARIANT_IDS = [f"bn{bn}-s{st}{'-early' if ea else ''}" for bn, st, ea in VARIANTS]
# The e4m3-cache form (KV_FP8) of each variant that fits shared memory with it.
_FP8_VARIANTS = [(32, 2, False), (32, 2, True)]


def _gluon_cfg(block_n: int, stages: int, early: bool):
    """The sm_90 table's config of this Gluon variant."""
    cfg = md._cfg(64, block_n, 8, stages, tma=True, per_sm=1, gluon=2 if early else 1)
    assert md._gluon_variant(cfg) == (block_n, stages, early)
    return cfg


def _only(monkeypatch, cfg) -> None:
    """Make ``cfg`` the decode kernel's only candidate on every architecture and in the interpreter."""
    table = ConfigTable(fallback=[cfg], interpreter=cfg, by_arch={9: [cfg]})
    monkeypatch.setattr(md, "_SPLIT", TunedKernel(f"mla_decode_gluon_test_{id(cfg)}", md._mla_decode_split_kernel,
                                                  table))  # fmt: skip


def _count_gluon_launches(monkeypatch) -> list:
    """[launch count, the variant (block_n, stages, early) of the last launch]."""
    calls: list = [0, None]
    real = mdg.mla_decode_gluon_split

    def counted(*args, **kwargs):
        calls[0] += 1
        calls[1] = (kwargs.get("block_n", mdg.BLOCK_N), kwargs.get("stages", mdg.STAGES), kwargs.get("early", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(mdg, "mla_decode_gluon_split", counted)
    return calls


@pytest.mark.parametrize("gluon", [1, 2])
def test_gluon_config_elsewhere_is_the_portable_kernel(gen, device, monkeypatch, gluon):
    """Where the Gluon kernel cannot run (here: the interpreter), a GLUON config (either schedule) is the
    portable kernel with its own tiles: partial last tiles, an empty request, several key shares."""
    if mdg._mcg.gluon_available(device):
        pytest.skip("the Gluon path runs on this device (see the gpu cases)")
    _only(monkeypatch, md._cfg(16, 16, 1, 1, gluon=gluon))
    calls = _count_gluon_launches(monkeypatch)
    q, kv, bt, sl = make_case(gen, 3, 5, 32, 16, 16, [0, 37, 70], torch.bfloat16, device)
    check(q, kv, bt, sl, 32, 0.25, torch.bfloat16, num_splits=2)
    assert calls[0] == 0


def test_gluon_candidates_only_for_sm90_bf16_many_heads():
    def gluon_kept(arch, key):
        return [c for c in md._CONFIGS.candidates(arch, key) if c.kwargs.get("GLUON")]

    key = (512, 64, "bfloat16", 128, 64, True)
    assert gluon_kept((9, 0), key)
    assert gluon_kept((9, 0), (512, 64, "bfloat16", 64, 128, True))
    for arch in ((8, 0), (8, 9), (10, 0), (12, 0)):
        assert not gluon_kept(arch, key), arch
    assert gluon_kept((9, 0), (512, 64, "bfloat16", 32, 64, True))
    assert [md._gluon_variant(c) for c in gluon_kept((9, 0), (512, 64, "bfloat16", 128, 32, True))] == [(32, 4, False)]
    for other in (
        (512, 64, "float16", 128, 64, True),  # bf16 only
        (512, 64, "bfloat16,e4m3", 128, 64, True),  # an e4m3 cache takes the portable kernel
        (512, 64, "bfloat16", 16, 64, True),  # 16 heads: memory-bound, the portable kernel
        (512, 64, "bfloat16", 128, 64, False),  # no TMA-able layout
    ):
        assert not gluon_kept((9, 0), other), other


def test_e4m3_gluon_form_is_a_trial_variant_only(monkeypatch):
    """The e4m3-cache form of the Gluon kernel (KV_FP8) is a candidate only under TRIAL_ENV, and only as the
    2-deep ring of 32-token tiles (the one that fits shared memory beside the e4m3 ring)."""
    key = (512, 64, "bfloat16,e4m3", 128, 64, True)

    def gluon_kept():
        return [md._gluon_variant(c) for c in md._CONFIGS.candidates((9, 0), key) if c.kwargs.get("GLUON")]

    monkeypatch.delenv(md.TRIAL_ENV, raising=False)
    assert gluon_kept() == []
    monkeypatch.setenv(md.TRIAL_ENV, "1")
    assert gluon_kept() == [(32, 2, False), (32, 2, True)]
    assert mdg.smem_bytes(512, 64, 32, 2, kv_fp8=True) <= 232448
    assert mdg.smem_bytes(512, 64, 64, 2, kv_fp8=True) > 232448
    assert mdg.smem_bytes(512, 64, 32, 3, kv_fp8=True) > 232448
    # The e4m3 ring is deeper than the bf16 one (its slots go back to the loader once widened).
    assert mdg.fp8_ring_slots(512, 64, 32, 2) == 4
    assert mdg.smem_bytes(512, 64, 32, 2, kv_fp8=True, stages8=5) > 232448


def test_reason_names_the_obstacle(device, monkeypatch):
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16, device=device)
    monkeypatch.setenv("KVFORGE_DISABLE_GLUON", "1")
    assert mdg.gluon_decode_reason(q, kv, 64, 512, 64) == "disabled by KVFORGE_DISABLE_GLUON"
    monkeypatch.delenv("KVFORGE_DISABLE_GLUON")
    if not mdg._mcg.gluon_available(device):
        assert mdg.gluon_decode_reason(q, kv, 64, 512, 64) is not None
        return
    assert mdg.gluon_decode_reason(q, kv, 64, 512, 64) is None
    assert "bf16" in mdg.gluon_decode_reason(q.half(), kv.half(), 64, 512, 64)
    assert "page size" in mdg.gluon_decode_reason(q, kv.view(8, 32, 576), 32, 512, 64)
    assert "contiguous" in mdg.gluon_decode_reason(q.transpose(0, 1).contiguous().transpose(0, 1), kv, 64, 512, 64)
    kv8 = kv.to(torch.float8_e4m3fn)
    assert mdg.gluon_decode_reason(q, kv8, 64, 512, 64, 32, 2) is None
    assert "device tensor" in mdg.gluon_decode_reason(q, kv8, 64, 512, 64, 32, 2, scale_tensor=True)
    assert "shared memory" in mdg.gluon_decode_reason(q, kv8, 64, 512, 64, 64, 2)


def test_out_vec_only_where_every_row_is_16_byte_aligned():
    """The epilogue's 16-byte stores (OUT_VEC > 1) only when out's pointer and batch/head strides allow them."""
    buf = torch.empty(4 * 8 * 520 + 8, dtype=torch.bfloat16)
    base = (-buf.data_ptr() % 16) // 2  # the first 16-byte aligned element
    dense = buf[base : base + 4 * 8 * 512].view(4, 8, 512)
    assert mdg._out_vec(dense, 512) == 8
    assert mdg._out_vec(buf[base : base + 4 * 8 * 520].view(4, 8, 520)[..., :512], 512) == 8  # row stride 520
    assert mdg._out_vec(buf[base : base + 4 * 8 * 515].view(4, 8, 515)[..., :512], 512) == 1  # row stride 515
    assert mdg._out_vec(buf[base + 1 : base + 1 + 4 * 8 * 512].view(4, 8, 512), 512) == 1  # 2 bytes off
    assert mdg._out_vec(torch.empty(4, 8, 512, dtype=torch.float32), 512) == 4
    assert mdg._out_vec(dense, 40) == 1  # a half of 20 bf16 columns is not whole 16-byte pieces


def test_shared_memory_fits_sm90():
    assert mdg.smem_bytes(512, 64) <= 232448  # sm_90's opt-in limit per block
    assert mdg.smem_bytes(512, 128) > 232448  # wider rows take the portable kernel


# Interpreters that compile the variants: this one, and another Triton's (e.g. 3.6, what the H200 runs) when
# KVFORGE_ALT_TRITON_PYTHON names its python.
_COMPILERS = [sys.executable] + [p for p in [os.environ.get("KVFORGE_ALT_TRITON_PYTHON")] if p]


@pytest.mark.skipif(mdg._mcg._GLUON_IMPORT_ERROR is not None, reason="Gluon is not importable here")
@pytest.mark.parametrize("python", _COMPILERS)
def test_compiles_offline_for_sm90(python):
    """Every Gluon variant of the sm_90 table compiles for sm_90 (no GPU needed) and its shared memory fits."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([python, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["name"] for r in recs] == [f"BN{bn} s{st}{' early' if ea else ''}" for bn, st, ea in
                                         md.gluon_variants()] + [
        f"BN{bn} s{st}{' early' if ea else ''} e4m3" for bn, st, ea in _FP8_VARIANTS
    ]  # fmt: skip
    for rec in recs:
        assert rec["ok"], rec
        assert 0 < rec["shared"] <= 232448, rec
        assert rec["shared"] >= rec["estimate"] - 1024, rec  # the estimate the dispatcher uses is not low


def test_trial_variants_are_candidates_only_when_asked(monkeypatch):
    """Gluon variants past the first never win an untuned key's speed-only autotune unless TRIAL_ENV asks."""
    key = (512, 64, "bfloat16", 128, 64, True)
    monkeypatch.delenv(md.TRIAL_ENV, raising=False)
    plain = [md._gluon_variant(c) for c in md._CONFIGS.candidates((9, 0), key) if c.kwargs.get("GLUON")]
    assert plain == [md._GLUON_FIRST]
    plain32 = [
        md._gluon_variant(c) for c in md._CONFIGS.candidates((9, 0), (*key[:4], 32, True)) if c.kwargs.get("GLUON")
    ]
    assert plain32 == [md._gluon_first(32)] and plain + plain32 == md.gluon_variants(trial=False)
    monkeypatch.setenv(md.TRIAL_ENV, "1")
    trial = [md._gluon_variant(c) for c in md._CONFIGS.candidates((9, 0), key) if c.kwargs.get("GLUON")]
    assert trial == md.gluon_variants() and len(trial) > 1
    for bn, stages, _ in trial:
        assert mdg.smem_bytes(512, 64, bn, stages) <= 232448
    # A committed Gluon config is one of the variants these tests compile and run on the GPU.
    for entry in _runtime._committed("sm90").get(md._SPLIT.name, {}).values():
        cfg = _runtime.config_from_json(entry)
        if cfg.kwargs.get("GLUON"):
            assert md._gluon_variant(cfg) in md.gluon_variants(), entry


GPU_CASES = [
    # H, B, page_size, lens, num_splits
    (128, 4, 64, [8192, 5, 300, 0], None),
    (64, 3, 64, [1, 64, 65], 1),
    (96, 2, 128, [4097, 127], 3),
    (128, 2, 64, [2000, 33], 7),
    (128, 16, 64, [32768] + [513] * 15, None),
    # lengths around 32- and 64-token tile edges, every share count from 1 to 7
    (128, 4, 64, [31, 96, 97, 6000], 2),
    (64, 3, 128, [33, 4095, 255], 4),
    (96, 3, 64, [8191, 0, 159], 5),
    (128, 2, 128, [7777, 32], 6),
    # fewer heads than the 64-row tile: 16 (a Q tile spans four requests) and 24
    (16, 5, 64, [700, 1, 65, 3000, 64], None),
    (24, 3, 64, [40, 999, 0], 3),
]


def _nan_outside(kv: torch.Tensor, bt: torch.Tensor, lens: list[int], page_size: int) -> None:
    """NaN into the rows past each request's length in its last page and into every page no request reads."""
    used = set()
    for b, n in enumerate(lens):
        pages = bt[b, : math.ceil(n / page_size)].tolist()
        used |= set(pages)
        if n % page_size:
            kv[pages[-1], n % page_size :] = float("nan")
    for p in range(kv.shape[0]):
        if p not in used:
            kv[p] = float("nan")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("H,B,page_size,lens,splits", GPU_CASES)
def test_gpu_gluon_matches_reference(gen, device, monkeypatch, H, B, page_size, lens, splits, variant):
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*variant))
    calls = _count_gluon_launches(monkeypatch)
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    _nan_outside(kv, bt, lens, page_size)
    check(q, kv, bt, sl, 512, 576**-0.5, torch.bfloat16, num_splits=splits)
    assert calls == [1, variant], "the Gluon kernel (this variant) did not run"
    # Request by request too (a short request's error would hide in the whole batch's RMSE).
    got = md.mla_decode_attention(q, kv, bt, sl, softmax_scale=576**-0.5, num_splits=splits).float()
    ref, _ = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=576**-0.5)
    for b, n in enumerate(lens):
        if n:
            err = (got[b] - ref[b]).pow(2).mean().sqrt() / ref[b].pow(2).mean().sqrt()
            assert float(err) < 8e-3, (b, n, float(err))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _FP8_VARIANTS, ids=[f"bn{bn}-s{st}{'-early' if ea else ''}" for bn, st, ea in
                                                       _FP8_VARIANTS])  # fmt: skip
@pytest.mark.parametrize("H,B,page_size,lens,splits", [*GPU_CASES[:6], (128, 3, 32, [33, 4000, 95], 3)])
def test_gpu_gluon_e4m3_cache_matches_reference(gen, device, monkeypatch, H, B, page_size, lens, splits, variant):
    """The e4m3-cache form (KV_FP8, a trial variant): bf16 q, the cache widened on chip, scale 1.5; NaN in the rows
    past each length and in pages no request reads; against fp32 attention over the dequantised cache."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*variant))
    monkeypatch.setenv(md.TRIAL_ENV, "1")
    calls = _count_gluon_launches(monkeypatch)
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    kv8 = (kv.float() / 1.5).to(torch.float8_e4m3fn)
    _nan_outside(kv8, bt, lens, page_size)
    got, lse = md.mla_decode_attention(q, kv8, bt, sl, softmax_scale=576**-0.5, num_splits=splits,
                                       kv_scale_quant_orig=1.5, return_lse=True)  # fmt: skip
    got = got.float()
    assert calls == [1, variant], "the Gluon kernel (this variant) did not run"
    ref, ref_lse = md.mla_decode_attention_ref(q, kv8, bt, sl, softmax_scale=576**-0.5, kv_scale_quant_orig=1.5)
    # The lse of the dequantised scaled scores (the scale folded into the score multiplier), -inf when empty.
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=2e-3, rtol=0)
    for b, n in enumerate(lens):
        if n:
            err = (got[b] - ref[b].to(got.device)).pow(2).mean().sqrt() / ref[b].pow(2).mean().sqrt()
            assert float(err) < 1e-2, (b, n, float(err))
        else:
            assert (got[b] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [3, 8, 0])
def test_gpu_gluon_out_view(gen, device, monkeypatch, pad):
    """``out`` a view into a wider buffer (row stride 515: no 16-byte stores; 520: 16-byte stores; 0: a fresh
    tensor) or starting 2 bytes in: right values, and nothing written past a row's 512 columns, for a request
    with one share (the output staged and stored by the kernel) and split ones (partials staged, then merged)."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*VARIANTS[0]))
    lens = [40, 5000, 1, 700]
    q, kv, bt, sl = make_case(gen, 4, 96, 512, 64, 64, lens, torch.bfloat16, device)
    ref, _ = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.05)
    for shift in (0, 1):
        calls = _count_gluon_launches(monkeypatch)
        buf = torch.full((4 * 96 * (512 + pad) + 1,), 7.0, dtype=torch.bfloat16, device=device)
        out = buf[shift : shift + 4 * 96 * (512 + pad)].view(4, 96, 512 + pad)[..., :512]
        for splits in (1, 4):
            md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out, num_splits=splits)
            assert calls[0] >= 1, "the Gluon kernel did not run"
            for b in range(4):
                err = (out[b].float() - ref[b]).pow(2).mean().sqrt() / ref[b].pow(2).mean().sqrt()
                assert float(err) < 8e-3, (pad, shift, splits, b, float(err))
            rest = buf.clone()
            rest[shift : shift + 4 * 96 * (512 + pad)].view(4, 96, 512 + pad)[..., :512] = 7.0
            assert (rest == 7.0).all(), (pad, shift, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_gpu_gluon_cuda_graph_replay(gen, device, monkeypatch, variant):
    """Captured in a CUDA graph, the Gluon path replays on the buffers' current contents."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*variant))
    q, kv, bt, sl = make_case(gen, 3, 128, 512, 64, 64, [3000, 64, 1], torch.bfloat16, device)
    out = torch.empty(3, 128, 512, dtype=torch.bfloat16, device=device)
    md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out, check_values=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out, check_values=False)
    q.copy_(torch.randn(q.shape, generator=gen).to(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.05)
    err = (out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert float(err) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS[:1], ids=VARIANT_IDS[:1])
def test_gpu_gluon_planned_runs_and_replay(gen, device, monkeypatch, variant):
    """``MLADecodePlan`` on the Gluon path: runs over several layers' q and caches (the later ones launched
    directly with raw scratch addresses and cloned descriptors), each against the reference, then a run captured
    in a CUDA graph replaying new contents; the repeated default call takes the same direct path."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*variant))
    calls = _count_gluon_launches(monkeypatch)
    q, kv, bt, sl = make_case(gen, 3, 128, 512, 64, 64, [3000, 64, 1], torch.bfloat16, device)
    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.05)
    assert plan._plan.grid[2] > 1  # the merge runs
    out = torch.empty(3, 128, 512, dtype=torch.bfloat16, device=device)
    for layer in range(3):
        q2, kv2 = torch.randn_like(q), torch.randn_like(kv)
        got = plan.run(q2, kv2, out=out if layer else None)
        ref, _ = md.mla_decode_attention_ref(q2, kv2, bt, sl, softmax_scale=0.05)
        assert float((got.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3, layer
    assert calls[0] == 3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kv, out=out)
    q.copy_(torch.randn(q.shape, generator=gen).to(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.05)
    assert float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3
    for _ in range(3):  # the default call: checked, then the plan cache's direct launches
        out.fill_(float("nan"))
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, out=out)
        assert float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [VARIANTS[0], (32, 2, False)], ids=["default", "bn32-s2"])
@pytest.mark.parametrize("H,B,page_size,lens,splits", [GPU_CASES[0], GPU_CASES[3], GPU_CASES[8], GPU_CASES[10],
                                                       (64, 64, 64, [1973] * 64, None)])  # fmt: skip
def test_gpu_gluon_fused_merge(gen, device, monkeypatch, H, B, page_size, lens, splits, variant):
    """The in-kernel merge (``FUSED_MERGE``: a split request's last share to finish merges it; here at any share
    count) against the reference and against the merge kernel's result on the same shares; out and lse
    NaN-poisoned first; the arrival counters are zero after each call (a counter left at one would make the next
    call merge early)."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    monkeypatch.setattr(md, "FUSED_MAX_SHARES", 65535)  # the fused merge at every share count, not only the default's
    _only(monkeypatch, _gluon_cfg(*variant))
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    _nan_outside(kv, bt, lens, page_size)
    ref, ref_lse = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=576**-0.5)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(md, "FUSED_MERGE", fused)
        plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=576**-0.5, num_splits=splits)
        assert plan._plan.gluon is not None and plan._plan.fused == (fused and plan._plan.grid[2] > 1)
        for _ in range(2):  # a second run finds the counters the first left
            out = torch.full((B, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
            lse = torch.full((B, H), float("nan"), dtype=torch.float32, device=device)
            plan.run(q, kv, out=out, lse=lse)
            if plan._plan.fused:
                assert int(plan._scratch[0][2].abs().sum()) == 0
        got[fused] = (out.float(), lse)
        for b, n in enumerate(lens):
            if n:
                err = (out[b].float() - ref[b]).pow(2).mean().sqrt() / ref[b].pow(2).mean().sqrt()
                assert float(err) < 8e-3, (fused, b, n, float(err))
        torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=2e-3, rtol=0)
    torch.testing.assert_close(got[True][0], got[False][0], atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_gluon_fused_merge_poison_and_streams(gen, device, monkeypatch):
    """A bad page id in one share of a split request makes that request's merged rows and lse NaN (and sets the
    flag) and no other request's; the one call run on two streams at once (each stream its own counters) and
    in a CUDA graph replayed twice gives the reference's result."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*VARIANTS[0]))
    lens = [6000, 3000, 90, 4500]
    q, kv, bt, sl = make_case(gen, 4, 128, 512, 64, 64, lens, torch.bfloat16, device)
    ref, _ = md.mla_decode_attention_ref(q, kv, bt, sl, softmax_scale=0.05)
    flags = torch.zeros(2, dtype=torch.int32, device=device)
    bad = bt.clone()
    bad[1, 40] = kv.shape[0] + 7  # in request 1's last share
    out, lse = md.mla_decode_attention(q, kv, bad, sl, softmax_scale=0.05, num_splits=4, error_flag=flags,
                                       return_lse=True)  # fmt: skip
    assert flags.tolist() == [0, 1]
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    for b in (0, 2, 3):
        err = (out[b].float() - ref[b]).pow(2).mean().sqrt() / ref[b].pow(2).mean().sqrt()
        assert float(err) < 8e-3, b
    outs = [torch.empty(4, 128, 512, dtype=torch.bfloat16, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    torch.cuda.synchronize()
    for _ in range(3):
        for o, st in zip(outs, streams):
            with torch.cuda.stream(st):
                md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, num_splits=4, out=o)
    torch.cuda.synchronize()
    for o in outs:
        assert float((o.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3
    out = torch.empty(4, 128, 512, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        md.mla_decode_attention(q, kv, bt, sl, softmax_scale=0.05, num_splits=4, out=out, check_values=False)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3


def test_raw_launch_only_for_the_checked_launcher(monkeypatch):
    """The split kernel's launcher is called past its Python layers only where it has the checked shape (the C
    function in the descriptor wrapper's closure, no scratch buffers, four descriptors) on the checked Triton."""
    import triton

    def launch(*args):  # stands in for the C launch function
        return args

    def make(scratch=0, metas=4, fn=launch):
        def wrapper(*args):  # the shape of Triton's descriptor wrapper: the C function in its closure
            return fn(*args)

        launcher = type("L", (), {"launch": staticmethod(wrapper), "global_scratch_size": scratch,
                                  "profile_scratch_size": 0, "launch_cooperative_grid": False,
                                  "launch_pdl": False})()  # fmt: skip
        meta = type("M", (), {"tensordesc_meta": [{"swizzle": 3}] * metas})()
        return type("K", (), {"run": launcher, "metadata": meta})()

    monkeypatch.setattr(mdg._rt, "RAW_VERSIONS", ("0.0.",))
    assert mdg._raw_launch(make()) is None  # another Triton: the launcher object as before
    monkeypatch.setattr(mdg._rt, "RAW_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(mdg._rt, "RAW_LAUNCH", True)
    raw = mdg._raw_launch(make())
    assert raw is not None and raw[0] is launch and raw[1:3] == (False, False) and len(raw[3]) == 4
    assert mdg._raw_launch(make(scratch=128)) is None
    assert mdg._raw_launch(make(metas=3)) is None
    assert mdg._raw_launch(make(fn=print)) is None  # no function named launch in the closure
    assert mdg._raw_launch(object()) is None


@pytest.mark.gpu
def test_gpu_gluon_raw_launch(gen, device, monkeypatch):
    """Repeat calls and ``MLADecodePlan.run`` over two caches in turn take the raw launch on the checked Triton
    (the descriptors encoded once per address pair) and match the reference each time, the default call too."""
    import triton

    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, _gluon_cfg(*VARIANTS[0]))
    lens = [300, 5000, 1, 77]
    q, kv, bt, sl = make_case(gen, 4, 64, 512, 64, 64, lens, torch.bfloat16, device)
    kv2 = torch.randn_like(kv)
    refs = [md.mla_decode_attention_ref(q, c, bt, sl, softmax_scale=0.05)[0] for c in (kv, kv2)]

    def close(got, ref):
        return float((got.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 8e-3

    plan = md.MLADecodePlan(q, kv, bt, sl, softmax_scale=0.05)
    for i in range(6):
        assert close(plan.run(q, (kv, kv2)[i % 2]), refs[i % 2]), i
    for _ in range(3):
        assert close(md.mla_decode_attention(q, kv2, bt, sl, softmax_scale=0.05), refs[1])
    prep = plan._plan.state.gluon
    if triton.__version__.startswith(mdg._rt.RAW_VERSIONS) and mdg.RAW_LAUNCH and mdg._rt.RAW_LAUNCH:
        assert prep.raw is not None and len(prep.expanded) == 2


def _compile_one(block_n: int, stages: int, early: bool, ptxas_v: bool = False, fp8: bool = False) -> dict[str, object]:
    """Compile one Gluon variant for sm_90 offline (``fp8``: its e4m3-cache form); with ``ptxas_v``, also
    ptxas -v's registers and spills."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvforge.kernels import mla_decode_gluon as g

    dv, dr = 512, 64
    name = f"BN{block_n} s{stages}{' early' if early else ''}{' e4m3' if fp8 else ''}"
    q_lay_h, q_lay_r = g.descriptor_layouts(dv, dr, g.BLOCK_H)
    k_lay_h, k_lay_r = g.descriptor_layouts(dv, dr, block_n, torch.float8_e4m3fn if fp8 else torch.bfloat16)

    def desc(rows: int, cols: int, lay: object, dt: str = "bf16") -> str:
        return f"tensordesc<{dt}[{rows}, {cols}],{lay!r}>"

    kt = "fp8e4nv" if fp8 else "bf16"
    types = {"q_desc_h": desc(g.BLOCK_H, dv // 2, q_lay_h), "q_desc_r": desc(g.BLOCK_H, dr, q_lay_r),
             "k_desc_h": desc(block_n, dv // 2, k_lay_h, kt), "k_desc_r": desc(block_n, dr, k_lay_r, kt),
             "bt_ptr": "*i32", "seq_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16",
             "lse_ptr": "*fp32", "nshare_ptr": "*i32", "err_ptr": "*i32", "scale_log2": "fp32",
             "v_scale": "fp32"}  # fmt: skip
    fn = g._mla_decode_gluon_kernel
    consts = {"PAGE_SIZE": 64, "D_V": dv, "D_R": dr, "BLOCK_H": g.BLOCK_H, "BLOCK_N": block_n,
              "C_REGS": g._C_REGS, "L_REGS": g._L_REGS, "FIRST_W": g._FIRST_W, "STAGES": stages,
              "EARLY": early, "CHECK": True, "BALANCE": 2, "KV_FP8": fp8, "ORDER": True, "OUT_VEC": 8, "MERGE": True,
              "STAGES8": g.fp8_ring_slots(dv, dr, block_n, stages) if fp8 else stages}  # fmt: skip
    sig = {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}
    rec: dict[str, object] = {"name": name, "triton": triton.__version__,
                              "estimate": g.smem_bytes(dv, dr, block_n, stages, fp8)}  # fmt: skip
    try:
        k = triton.compile(GluonASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 128),
                           options={"num_warps": 4, "maxnreg": g._MAXNREG})  # fmt: skip
    except Exception as e:  # reported; the test fails on it
        return {**rec, "ok": False, "error": f"{e}"[:2000]}
    rec.update(ok=True, shared=k.metadata.shared)
    if ptxas_v:
        import tempfile

        from triton.backends.nvidia.compiler import get_ptxas

        try:  # the ptxas Triton itself would run for sm_90 (the argument is new in 3.7)
            ptxas = get_ptxas(90).path
        except TypeError:
            ptxas = get_ptxas().path
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(k.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                                 capture_output=True, text=True)  # fmt: skip
        log = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        rec.update(regs=int(regs.group(1)) if regs else None, spills=spills,
                   warnings=[ln.strip() for ln in log.splitlines() if "arning" in ln or "rror" in ln][:6])  # fmt: skip
    return rec


def _compile(ptxas_v: bool = False) -> list[dict[str, object]]:
    return [_compile_one(bn, st, ea, ptxas_v) for bn, st, ea in md.gluon_variants()] + [
        _compile_one(bn, st, ea, ptxas_v, fp8=True) for bn, st, ea in _FP8_VARIANTS
    ]


if __name__ == "__main__":
    print(json.dumps(_compile(ptxas_v="-v" in sys.argv)))
