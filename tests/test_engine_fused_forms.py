"""The engine's fused model forms (``HybridModel.use_kernels``) against the plain forms the reference runs.

One GEMM per shared input (``[q_a | kv_a]``, ``[q | k | v | g | b]``, ``[gate | up]``), ``kda_prepare``,
``mla_latent_store``, the norm kernels of the head and the drafter, and the absorbed MLA products as batched
GEMMs in the model dtype (against fp32 einsums of the same operands). Here a tiny bf16 model with the kernels
in the interpreter (CPU); tests/test_engine_gpu.py runs the same checks at the real size on the GPU. Tolerances:
two bf16 roundings (the GEMM's output, then the op's), the MLP looser (the plain form rounds silu apart).
"""

from __future__ import annotations

import pytest
import torch

from kvforge.engine import HybridModel, tiny
from kvforge.kernels._runtime import interpreting

TOL = dict(atol=3e-2, rtol=3e-2)


def check_absorbed_mla(model: HybridModel, rows: int) -> None:
    c, dev = model.config, model.device
    m = model.blocks[c.mla_layers[0]].mixer
    gen = torch.Generator(device=dev).manual_seed(rows)
    q = torch.randn(rows, c.num_heads, c.qk_head_dim, device=dev, generator=gen).to(model.dtype)
    kv_b = m.kv_b.view(c.kv_lora_rank, c.num_heads, c.qk_nope_dim + c.v_head_dim).float()
    want = torch.einsum("thn,lhn->thl", q[..., : c.qk_nope_dim].float(), kv_b[..., : c.qk_nope_dim])
    got = model.mla_absorb(m, q)
    torch.testing.assert_close(got[..., : c.kv_lora_rank].float(), want, atol=1e-2, rtol=1.6e-2)
    assert torch.equal(got[..., c.kv_lora_rank :], q[..., c.qk_nope_dim :])
    o_lat = torch.randn(rows, c.num_heads, c.kv_lora_rank, device=dev, generator=gen).to(model.dtype)
    want_v = torch.einsum("thl,lhv->thv", o_lat.float(), kv_b[..., c.qk_nope_dim :])
    torch.testing.assert_close(model.mla_unabsorb(m, o_lat).float(), want_v, atol=1e-2, rtol=1.6e-2)


def check_fused_forms(model: HybridModel, rows: int) -> None:
    assert model.use_kernels
    c, dev = model.config, model.device
    model.ensure_rope_table(4096)
    gen = torch.Generator(device=dev).manual_seed(100 + rows)
    h = torch.randn(rows, c.hidden_size, device=dev, generator=gen).to(model.dtype)
    kda = model.blocks[c.linear_layers[0]].mixer
    fused, plain = model.kda_project(kda, h, fused=True), model.kda_project(kda, h)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], fused, plain):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), **TOL, msg=name)
    mla = model.blocks[c.mla_layers[0]].mixer
    pos = torch.randint(0, 4096, (rows,), device=dev, generator=gen)
    pool = torch.full((rows + 3, 1, c.latent_dim), float("nan"), device=dev, dtype=model.dtype)
    slots = torch.randperm(rows + 3, device=dev, generator=gen)[:rows]
    q_f, none = model.mla_project(mla, h, pos, fused=True, store=(pool, slots))
    q_p, latent = model.mla_project(mla, h, pos)
    assert none is None and latent is not None
    torch.testing.assert_close(q_f.float(), q_p.float(), **TOL)
    torch.testing.assert_close(pool.view(-1, c.latent_dim)[slots].float(), latent.float(), **TOL)
    # Unrotated queries, rotated into the absorbed query by mla_absorb: the same as rotating first.
    q_u, _ = model.mla_project(mla, h, pos, fused=True, rope_q=False, store=(pool, slots))
    torch.testing.assert_close(model.mla_absorb(mla, q_u, pos).float(), model.mla_absorb(mla, q_f).float(), **TOL)
    blk = model.blocks[0]
    hn = model.rms(h, blk.norm2)
    plain_mlp = (torch.nn.functional.silu(hn @ blk.gate) * (hn @ blk.up)) @ blk.down
    torch.testing.assert_close(model.mlp_normed(blk, hn).float(), plain_mlp.float(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(model.logits(h, fused=True), model.logits(h), **TOL)
    assert model.logits(h, fused=True, fp32=False).dtype == model.dtype
    ids = torch.randint(0, c.vocab_size, (rows,), device=dev, generator=gen)
    torch.testing.assert_close(model.draft_input(h, ids, fused=True).float(), model.draft_input(h, ids).float(), **TOL)


@pytest.fixture(scope="module")
def bf16_model() -> HybridModel:
    model = HybridModel(tiny(), device="cpu", dtype=torch.bfloat16)
    model.use_kernels = True
    return model


@pytest.mark.skipif(not interpreting(), reason="a CPU model's kernels need the interpreter (no GPU here)")
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_forms_match_the_plain_forms(bf16_model: HybridModel, rows: int) -> None:
    check_absorbed_mla(bf16_model, rows)
    check_fused_forms(bf16_model, rows)


def test_fused_weights_share_memory_with_the_fields() -> None:
    """The separate projection weights are column views of the fused ones: one copy of the bytes, one value."""
    model = HybridModel(tiny())
    for blk in model.blocks:
        assert blk.gate.data_ptr() == blk.gate_up.data_ptr()
        assert blk.up.data_ptr() == blk.gate_up[:, blk.gate.shape[1] :].data_ptr()
        m = blk.mixer
        fused = m.a if hasattr(m, "a") else m.proj
        parts = [m.q_a, m.kv_a] if hasattr(m, "a") else [m.q, m.k, m.v, m.g, m.b]
        n = sum(p.shape[1] for p in parts)
        assert torch.equal(torch.cat(parts, 1), fused[:, :n])
        if not hasattr(m, "a"):  # the KDA projection is padded with zero columns to a multiple of 64
            assert fused.shape[1] % 64 == 0 and fused.shape[1] - n < 64 and not fused[:, n:].any()
        assert all(p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in parts)
