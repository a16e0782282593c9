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
from kvforge.kernels._runtime import ConfigTable, TunedKernel  # noqa: E402
from tests.test_mla_decode import check, make_case  # noqa: E402

GLUON_CFG_ARGS = dict(bh=64, bn=64, warps=8, stages=2, tma=True, per_sm=1, gluon=True)


def _only(monkeypatch, cfg) -> None:
    """Make ``cfg`` the decode kernel's only candidate on every architecture and in the interpreter."""
    table = ConfigTable(fallback=[cfg], interpreter=cfg, by_arch={9: [cfg]})
    monkeypatch.setattr(md, "_SPLIT", TunedKernel(f"mla_decode_gluon_test_{id(cfg)}", md._mla_decode_split_kernel,
                                                  table))  # fmt: skip


def _count_gluon_launches(monkeypatch) -> list[int]:
    calls = [0]
    real = mdg.mla_decode_gluon_split

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(mdg, "mla_decode_gluon_split", counted)
    return calls


def test_gluon_config_elsewhere_is_the_portable_kernel(gen, device, monkeypatch):
    """Where the Gluon kernel cannot run (here: the interpreter), a GLUON config is the portable kernel with its
    own tiles: partial last tiles, an empty request, several key shares."""
    if mdg._mcg.gluon_available(device):
        pytest.skip("the Gluon path runs on this device (see the gpu cases)")
    _only(monkeypatch, md._cfg(16, 16, 1, 1, gluon=True))
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
    for other in (
        (512, 64, "float16", 128, 64, True),  # bf16 only
        (512, 64, "bfloat16", 16, 64, True),  # few heads: memory-bound, the portable kernel
        (512, 64, "bfloat16", 128, 32, True),  # a 64-token tile would cross pages
        (512, 64, "bfloat16", 128, 64, False),  # no TMA-able layout
    ):
        assert not gluon_kept((9, 0), other), other


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


def test_shared_memory_fits_sm90():
    assert mdg.smem_bytes(512, 64) <= 232448  # sm_90's opt-in limit per block
    assert mdg.smem_bytes(512, 128) > 232448  # wider rows take the portable kernel


@pytest.mark.skipif(mdg._mcg._GLUON_IMPORT_ERROR is not None, reason="Gluon is not importable here")
def test_compiles_offline_for_sm90():
    """The Gluon kernel compiles for sm_90 (no GPU needed) and its shared memory fits the SM."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["ok"], rec.get("error")
    assert 0 < rec["shared"] <= 232448, rec
    assert rec["shared"] >= mdg.smem_bytes(512, 64) - 1024, rec  # the estimate the dispatcher uses is not low


GPU_CASES = [
    # H, B, page_size, lens, num_splits
    (128, 4, 64, [8192, 5, 300, 0], None),
    (64, 3, 64, [1, 64, 65], 1),
    (96, 2, 128, [4097, 127], 3),
    (128, 2, 64, [2000, 33], 7),
    (128, 16, 64, [32768] + [513] * 15, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,page_size,lens,splits", GPU_CASES)
def test_gpu_gluon_matches_reference(gen, device, monkeypatch, H, B, page_size, lens, splits):
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, md._cfg(**GLUON_CFG_ARGS))
    calls = _count_gluon_launches(monkeypatch)
    q, kv, bt, sl = make_case(gen, B, H, 512, 64, page_size, lens, torch.bfloat16, device)
    # Rows past each request's length in its last page, and pages no request reads, hold NaN.
    used = set()
    for b, n in enumerate(lens):
        pages = bt[b, : math.ceil(n / page_size)].tolist()
        used |= set(pages)
        if n % page_size:
            kv[pages[-1], n % page_size :] = float("nan")
    for p in range(kv.shape[0]):
        if p not in used:
            kv[p] = float("nan")
    check(q, kv, bt, sl, 512, 576**-0.5, torch.bfloat16, num_splits=splits)
    assert calls[0] == 1, "the Gluon kernel did not run"


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_replay(gen, device, monkeypatch):
    """Captured in a CUDA graph, the Gluon path replays on the buffers' current contents."""
    assert mdg._mcg.gluon_available(device), mdg._mcg.gluon_unavailable_reason(device)
    _only(monkeypatch, md._cfg(**GLUON_CFG_ARGS))
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


def _compile() -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvforge.kernels import mla_decode_gluon as g

    dv, dr = 512, 64
    lay_h, lay_r = g.descriptor_layouts(dv, dr)

    def desc(cols: int, lay: object) -> str:
        return f"tensordesc<bf16[{g.BLOCK_N}, {cols}],{lay!r}>"

    types = {"q_desc_h": desc(dv // 2, lay_h), "q_desc_r": desc(dr, lay_r), "k_desc_h": desc(dv // 2, lay_h),
             "k_desc_r": desc(dr, lay_r), "bt_ptr": "*i32", "seq_ptr": "*i32", "po_ptr": "*fp32",
             "plse_ptr": "*fp32", "scale_log2": "fp32"}  # fmt: skip
    fn = g._mla_decode_gluon_kernel
    consts = {"PAGE_SIZE": 64, "D_V": dv, "D_R": dr, "BLOCK_H": g.BLOCK_H, "BLOCK_N": g.BLOCK_N,
              "C_REGS": g._C_REGS, "L_REGS": g._L_REGS, "FIRST_W": g._FIRST_W}  # fmt: skip
    sig = {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}
    try:
        k = triton.compile(GluonASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 128),
                           options={"num_warps": 4, "maxnreg": g._MAXNREG})  # fmt: skip
    except Exception as e:  # reported; the test fails on it
        return {"ok": False, "error": f"{e}"[:2000], "triton": triton.__version__}
    return {"ok": True, "shared": k.metadata.shared, "triton": triton.__version__}


if __name__ == "__main__":
    print(json.dumps(_compile()))
