"""The engine with an FP8 latent cache (``EngineConfig(latent_cache_dtype="fp8_e4m3")``), CPU interpreter, tiny model.

The bounds come from the stated ones by the triangle inequality, no new constant. The FP8 latent cache adds
one stage of e4m3 rounding (relative error at most 2^-4 per value, 2.5-2.8% RMS at unit-variance rows, plus the
decode kernel's relative RMSE <= 1e-2 over the dequantised cache: ``kvforge.kernels.mla_decode``'s docstring) of
the latent rows K, V and the decode keys come from. That is no more than the context path's FP8 stage (Q, K and
V each rounded to e4m3 the same way), whose effect on the logits is bounded by ``B`` = ``LOGIT_ATOL`` (random) /
``PLANTED_BOUND x std`` (planted) of tests/test_engine.py. Errors of stages add at worst, so:

* FP8-latent engine vs the plain forward pass (teacher forced on the engine's own tokens): ``2 B`` (latent stage
  + context FP8 stage), with :func:`compare_logits`'s greedy check; the planted model keeps exact greedy identity;
* vs the 16-bit-cache engine on every row up to and including the first token where the two differ: ``3 B``
  (``2 B`` for this engine plus ``B`` for that one: the two engines round K/V to e4m3 at different points, so
  their context-FP8 errors do not cancel). A first rule of ``B`` here failed on the planted model (1.84 against
  1.20 on one prefill row, 0.23 x std) for exactly that reason; the planted outputs are equal token for token.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.engine import Engine, EngineConfig, HybridModel
from kvforge.engine.numerics import compare_logits
from tests.helpers import engine_rows_and_reference, multi_turn
from tests.test_engine import LOGIT_ATOL, PLANTED_BOUND, VOCAB, _model

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module", params=["random", "planted"])
def model(request: pytest.FixtureRequest) -> HybridModel:
    return _model(request.param)


def _run(model: HybridModel, cfg: EngineConfig) -> tuple[Engine, dict]:
    eng = Engine(model, cfg, draft_len=1, record_logits=True)
    prompts = multi_turn(eng, 1, turns=2, n_conv=2, new_tokens=4, vocab=VOCAB, first=(20, 45), follow=(3, 12))
    return eng, prompts


def test_fp8_latent_multiturn_with_reuse(model: HybridModel) -> None:
    """The multi-turn scenario with prefix reuse and the drafter, 16-bit and FP8 latent caches side by side."""
    planted = model.config.copy_offset > 0
    base, base_prompts = _run(model, EngineConfig())
    eng, prompts = _run(model, EngineConfig(latent_cache_dtype="fp8_e4m3"))
    assert eng.cache.latent_fp8 and all(p.dtype == FP8 for p in eng.cache.latent.values())
    assert eng.cache.draft_latent is not None and eng.cache.draft_latent.dtype == FP8
    assert eng.cache.latent_scale == model.config.kv_scale_orig_quant  # the documented default scale
    assert eng.manager.stats.reused_tokens > 0 and eng.manager.counters.snapshots > 0
    compared = 0
    for rid, prompt in prompts.items():
        out, rows, ref_rows, _ = engine_rows_and_reference(model, eng, rid, prompt)
        std = float(ref_rows.std())
        bound = PLANTED_BOUND * std if planted else LOGIT_ATOL
        chk = compare_logits(rows, ref_rows, out, 2 * bound)
        assert chk.ok, f"{rid}: {chk.summary()}; differing tokens not at a near tie: {chk.unexcused}"
        if planted:
            assert chk.exact, f"{rid}: greedy identity is not exact: {chk.summary()}"
        if base_prompts.get(rid) != prompt:
            continue  # an earlier near tie sent the conversation elsewhere: no 16-bit row to compare with
        b_out = base.outputs[rid]
        k = next((i for i, (x, y) in enumerate(zip(out, b_out)) if x != y), len(out) - 1) + 1
        b_rows = torch.cat(base.logits[rid])
        err = float((rows[:k] - b_rows[:k]).abs().max())
        assert err <= 3 * bound, f"{rid}: FP8 latent vs 16-bit cache logits differ by {err:.4f} (3 x {bound:.4f})"
        compared += 1
        if planted:
            assert out == b_out, (rid, out, b_out)
    assert compared >= 2, compared  # the first turn's prompts are equal by construction
    eng.manager.check_invariants()


def test_fp8_latent_rows_round_trip_through_the_cache(random_model: HybridModel) -> None:
    """write_latent stores what store_latent_rows_ref stores (e4m3 of row x scale); read_latent returns it times
    1 / scale; a page copy moves the bytes unchanged."""
    from kvforge.engine.cache import EngineCache
    from kvforge.kernels.mla_decode import store_latent_rows_ref

    mc = random_model.config
    cfg = EngineConfig(attention_pages=5, draft_pages=5, latent_cache_dtype="fp8_e4m3", latent_scale=8.0)
    cache = EngineCache(mc, cfg, attn_group=0, state_group=1, draft_group=None, device=torch.device("cpu"),
                        dtype=torch.float32)  # fmt: skip
    pool = cache.latent[mc.mla_layers[0]]
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(7, mc.latent_dim, generator=g) * 3
    slots = torch.tensor([0, 5, 17, 18, 33, 47, 80], dtype=torch.int64)
    want = store_latent_rows_ref(pool, slots, rows, kv_scale_orig_quant=8.0)
    cache.write_latent(pool, slots, rows)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    back = cache.read_latent(pool, slots, torch.float32)
    torch.testing.assert_close(back, want.view(-1, mc.latent_dim)[slots].float() / 8.0, rtol=0, atol=0)
    # e4m3 rounds to 3 mantissa bits: at most 2^-4 relative off (values kept clear of the subnormal range here).
    big = rows.abs() * 8.0 > 2.0**-6
    assert bool(((back - rows).abs() <= rows.abs() * 2.0**-4 + 1e-7)[big].all())
    from kvforge.kvcache.config import Tier
    from kvforge.kvcache.manager import PageCopy

    cache.execute([PageCopy(0, Tier.GPU, 2, Tier.GPU, 4, num_tokens=3)])
    assert torch.equal(pool[4, :3].view(torch.uint8), pool[2, :3].view(torch.uint8))


@pytest.fixture(scope="module")
def random_model() -> HybridModel:
    return _model("random")


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        (dict(latent_cache_dtype="fp8"), ValueError, "latent_cache_dtype"),
        (dict(latent_cache_dtype="bf16"), ValueError, "latent_cache_dtype"),
        (dict(latent_cache_dtype=torch.float8_e4m3fn), ValueError, "latent_cache_dtype"),
        (dict(latent_cache_dtype=None), ValueError, "latent_cache_dtype"),
        (dict(latent_scale=16.0), ValueError, "latent_scale"),  # a scale without the FP8 cache
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=0.0), ValueError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=-2.0), ValueError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=math.nan), ValueError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=math.inf), ValueError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=True), TypeError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale="16"), TypeError, "latent_scale"),
        (dict(latent_cache_dtype="fp8_e4m3", latent_scale=torch.tensor(16.0)), TypeError, "latent_scale"),
    ],
)
def test_hostile_latent_cache_config_is_refused(kw: dict, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        EngineConfig(**kw)


def test_a_latent_scale_that_saturates_the_copy_head_is_refused() -> None:
    planted = _model("planted")
    with pytest.raises(ValueError, match="latent_scale"):
        Engine(planted, EngineConfig(latent_cache_dtype="fp8_e4m3", latent_scale=1e4))


def test_a_handoff_at_another_latent_scale_is_refused(random_model: HybridModel) -> None:
    """Disaggregation moves FP8 latent pages as stored bytes: a receiver at another scale (or a 16-bit cache)
    refuses the handoff before it takes any page."""
    from kvforge.engine.disagg import Handoff, prepare_receive

    eng = Engine(random_model, EngineConfig(latent_cache_dtype="fp8_e4m3"), draft_len=1)
    free = eng.manager.num_free_pages(eng.attn_group)
    for scale in (None, 4.0):
        h = Handoff(1, [1, 2, 3], 4, 0, [], 2, scale)
        with pytest.raises(ValueError, match="latent_scale"):
            prepare_receive(eng, h)
    assert eng.manager.num_free_pages(eng.attn_group) == free
    assert not eng.scheduler.has_unfinished
