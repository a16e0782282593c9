"""The planted copy head (``ModelConfig.copy_offset``, :mod:`kvforge.engine.planted`) on the CPU interpreter.

* Design: the copy layer's actual scores (the model's own projections and rope) peak at distance k with the
  stated contrast, in fp32 and after FP8 rounding of Q and K, and the reference's greedy output copies the
  token k positions back.
* Greedy identity scenarios live in tests/test_engine.py (every scenario on the planted model, exact); here:
  verify rows of different token counts in one step (oracle drafts), and the power of the check: the same run
  with two requests' pages swapped after the prefill fails it.
* ``copy_offset = 0`` leaves the model's weights as they were; the planted model keeps the random weights it
  does not overwrite. Hostile configs are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import pytest
import torch

from kvforge.engine import Engine, EngineConfig, HybridModel, real, reference_greedy, tiny
from kvforge.engine.model import MLAWeights
from kvforge.engine.planted import (
    COPY_MAX_POSITIONS,
    COPY_SCORE_GAP,
    MIN_COPY_CONTRAST,
    copy_contrast,
    copy_key_amplitude,
    copy_rope_weights,
)
from kvforge.engine.reference import reference_hidden
from kvforge.kernels.quantize_fp8 import quantize_fp8_ref
from tests.test_engine import PLANTED, check_against_reference

K = PLANTED.copy_offset
VOCAB = PLANTED.vocab_size


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(PLANTED)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _copy_continuation(prompt: list[int], n: int) -> list[int]:
    """What a perfect copy head generates: the token at position p + 1 is the one at p - K."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(seq[len(seq) - 1 - K])
    return seq[len(prompt) :]


def _copy_scores(model: HybridModel, tokens: list[int], fp8: bool) -> torch.Tensor:
    """The copy layer's scores ``[T, T]`` (query, key; fp64, causal entries only) on the reference's inputs."""
    mc = model.config
    layer = mc.mla_layers[0]
    blk = model.blocks[layer]
    assert isinstance(blk.mixer, MLAWeights)
    x = reference_hidden(model, tokens)[layer - 1]
    pos = torch.arange(len(tokens))
    q, latent = model.mla_project(blk.mixer, model.rms(x, blk.norm1), pos)
    k, _ = model.mla_up(blk.mixer, latent)
    if fp8:
        s = mc.kv_scale_orig_quant
        assert float(q.abs().max()) * s < 448 and float(k.abs().max()) * s < 448  # no saturation
        q, k = (quantize_fp8_ref(t, s).double() / s for t in (q, k))
    scores = torch.einsum("qd,kd->qk", q[:, 0].double(), k[:, 0].double()) * model.softmax_scale
    return scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), float("-inf"))


@pytest.mark.parametrize("fp8", [False, True])
def test_copy_layer_attends_k_back(model: HybridModel, fp8: bool) -> None:
    """Every query p >= K scores the key at p - K highest. The gap is the designed one times the key's scale
    (about 0.93: rms(x) is above its floor) less what a neighbour's larger scale takes (rms(x) varies by a few
    percent): measured minima 17.5-20 of 32 (median 29), FP8 included; its softmax weight is 1 to 3e-8."""
    assert copy_contrast(PLANTED) >= MIN_COPY_CONTRAST
    assert copy_contrast(PLANTED, 300) >= copy_contrast(PLANTED)  # fewer distances, no worse
    rng = random.Random(0)
    scores = _copy_scores(model, _prompt(rng, 300), fp8)[K:]
    top2 = scores.topk(2, -1)
    assert top2.indices[:, 0].tolist() == list(range(300 - K))
    gap = top2.values[:, 0] - top2.values[:, 1]
    assert float(gap.min()) > 0.45 * COPY_SCORE_GAP, float(gap.min())
    weight = torch.softmax(scores, -1).diagonal()
    assert float(weight.min()) > 1 - 1e-6


@pytest.mark.parametrize("cfg", [PLANTED, real(copy_offset=100)], ids=["tiny", "real"])
def test_copy_design_of_the_sizes_in_use(cfg) -> None:
    """The rotary design (config only, no weights): the profile computed here from the weights peaks at k with
    at least MIN_COPY_CONTRAST over all designed distances, and the Q/K amplitude fits FP8 at the model's scale."""
    w = copy_rope_weights(cfg)
    half = cfg.qk_rope_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    r = torch.arange(COPY_MAX_POSITIONS, dtype=torch.float64)
    f = (torch.cos((r[:, None] - cfg.copy_offset) * inv_freq) * w).sum(-1)
    assert int(f.argmax()) == cfg.copy_offset
    others = torch.cat([f[: cfg.copy_offset], f[cfg.copy_offset + 1 :]])
    contrast = 1 - float(others.max() / f[cfg.copy_offset])
    assert contrast == pytest.approx(copy_contrast(cfg)) and contrast >= MIN_COPY_CONTRAST
    assert copy_key_amplitude(cfg) * cfg.kv_scale_orig_quant < 448


def test_reference_greedy_copies(model: HybridModel) -> None:
    rng = random.Random(1)
    prompt = _prompt(rng, 30)
    assert reference_greedy(model, prompt, 12) == _copy_continuation(prompt, 12)


def test_verify_rows_of_different_token_counts(model: HybridModel) -> None:
    """Oracle drafts (always accepted): requests with 4 and 5 new tokens verify 1 and 2 tokens in the same step
    once the first is one token from its limit; outputs and logits stay exact."""
    rng = random.Random(2)
    prompts = {"a": _prompt(rng, 20), "b": _prompt(rng, 20)}
    want = {"a": _copy_continuation(prompts["a"], 4), "b": _copy_continuation(prompts["b"], 5)}
    rid_of = {}

    def oracle(req, emitted):
        nxt = req.num_generated + len(emitted)
        w = want[rid_of[req.request_id]]
        return w[nxt] if nxt < len(w) else 0

    eng = Engine(model, EngineConfig(), draft_len=1, record_logits=True, draft_fn=oracle)
    counts = []
    step = eng.runner.step

    def spy(rows, *a, **kw):
        counts.append(sorted(r.n for r in rows if r.gen))
        return step(rows, *a, **kw)

    eng.runner.step = spy
    for rid, p in prompts.items():
        rid_of[rid] = rid
        eng.add_request(rid, p, len(want[rid]))
    eng.run()
    assert [1, 2] in counts, counts
    assert eng.outputs == want
    assert check_against_reference(model, eng, prompts) == 0


def _swap_pages_after_prefill(eng: Engine) -> None:
    """From the second step on, the target pool's block 2 of the first two rows trade places in the block table
    (reads and writes): both requests then read the other's prefill tokens at positions 32-47."""
    materialize = eng.page_table.materialize

    def wrong(caches, out=None):
        t = materialize(caches, out=out)
        if eng.steps >= 1 and len(caches) >= 2:
            t[0, [0, 1], :, 2] = t[0, [1, 0], :, 2].clone()
        return t

    eng.page_table.materialize = wrong  # type: ignore[method-assign]


@pytest.mark.parametrize("corrupt", [False, True])
def test_greedy_check_fails_on_a_wrong_page(model: HybridModel, corrupt: bool) -> None:
    """The check has power: two 40-token prompts decode 6 tokens, copying positions 33-38 (block 2 at 16 tokens
    per block). With the block-table entries swapped after the prefill the engine copies the other request's
    tokens: the exact greedy check fails (differing tokens on decisive rows). The same run unswapped passes."""
    rng = random.Random(3)
    prompts = {"a": _prompt(rng, 40), "b": _prompt(rng, 40)}
    eng = Engine(model, EngineConfig(), record_logits=True)
    if corrupt:
        _swap_pages_after_prefill(eng)
    for rid, p in prompts.items():
        eng.add_request(rid, p, 6)
    eng.run()
    if not corrupt:
        assert check_against_reference(model, eng, prompts) == 0
        return
    with pytest.raises(AssertionError, match="not at a near tie"):
        check_against_reference(model, eng, prompts)
    for rid, p in prompts.items():  # the first token comes from the prefill, the rest from the wrong pages
        assert eng.outputs[rid][0] == _copy_continuation(p, 1)[0]
        assert eng.outputs[rid][1:] != _copy_continuation(p, 6)[1:]


def _digest(model: HybridModel) -> str:
    h = hashlib.sha256()
    tensors = [model.embed, model.final_norm, model.lm_head, model.draft_fc, *model.draft_norms]  # type: ignore[misc]
    tensors.append(model.draft_final_norm)
    for blk in [*model.blocks, model.draft_block]:
        assert blk is not None
        tensors += [blk.norm1, blk.norm2, blk.gate, blk.up, blk.down]
        tensors += [getattr(blk.mixer, f.name) for f in dataclasses.fields(blk.mixer)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_copy_offset_zero_keeps_the_random_weights() -> None:
    """tiny()'s weights hash to what they did before the copy head existed (31df771, torch's CPU generator),
    and the planted model keeps every random weight it does not overwrite."""
    base = HybridModel(tiny())
    assert _digest(base) == "0c92d24de622556f1ca6fef3f199447261564b85878edd7d64e08a245c467aa2"
    plain = HybridModel(dataclasses.replace(PLANTED, copy_offset=0))
    planted = HybridModel(PLANTED)
    m = PLANTED.copy_dim
    kept = slice(1 + 2 * m, None)  # residual coordinates outside DC, U and C
    assert torch.equal(plain.embed[:, kept], planted.embed[:, kept])
    copy_layer = PLANTED.mla_layers[0]
    for i, (a, b) in enumerate(zip(plain.blocks, planted.blocks)):
        assert torch.equal(a.gate, b.gate) and torch.equal(a.up, b.up) and torch.equal(a.norm2, b.norm2)
        assert torch.equal(a.down[:, 1 + m :], b.down[:, 1 + m :]) and not b.down[:, : 1 + m].any()
        if i != copy_layer:
            assert torch.equal(a.norm1, b.norm1)
            for f in dataclasses.fields(a.mixer):
                wa, wb = getattr(a.mixer, f.name), getattr(b.mixer, f.name)
                assert torch.equal(wa[:, 1 + m :], wb[:, 1 + m :]) if f.name == "o" else torch.equal(wa, wb)
    assert plain.draft_block is not None and planted.draft_block is not None
    assert torch.equal(plain.draft_block.gate, planted.draft_block.gate)
    assert torch.equal(plain.draft_fc, planted.draft_fc)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        (dict(copy_offset=True), TypeError, "copy_offset"),
        (dict(copy_offset=2.0), TypeError, "copy_offset"),
        (dict(copy_offset="3"), TypeError, "copy_offset"),
        (dict(copy_offset=-1), ValueError, "copy_offset"),
        (dict(copy_offset=COPY_MAX_POSITIONS), ValueError, "copy_offset"),
        (dict(copy_offset=5, v_head_dim=8), ValueError, "code width"),
        (dict(copy_offset=5, hidden_size=48), ValueError, "code width"),
        (dict(copy_offset=5, qk_rope_dim=4), ValueError, "contrast"),
        (dict(copy_offset=5, kv_scale_orig_quant=64.0), ValueError, "FP8"),
        (dict(copy_offset=5, layer_types="LLL"), ValueError, "layer_types"),
    ],
)
def test_copy_offset_refuses_bad_configs(kw, err, match) -> None:
    with pytest.raises(err, match=match):
        tiny(**kw)


def test_copy_contrast_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="copy head"):
        copy_contrast(tiny())
    with pytest.raises(ValueError, match="max_len"):
        copy_contrast(PLANTED, PLANTED.copy_offset)
    with pytest.raises(ValueError, match="max_len"):
        copy_contrast(PLANTED, 100.0)  # type: ignore[arg-type]
