"""The engine against the plain forward pass (CPU interpreter, tiny model, fp32 weights).

Every emitted token's logits row is compared with the reference's logits at that position (teacher forced on
the engine's own tokens). Each scenario runs on two models:

* ``random``: all weights random. ``|engine - reference| <= LOGIT_ATOL``: the engine's prefill attention reads
  FP8 K/V (e4m3 at scale 16) and bf16/fp16 queries, so the bound is the FP8 one: measured maxima are 0.05-0.1 at
  logit std ~4 (``logit_scale=4``); the bound is 0.3. Greedy: each token equals the reference's argmax, except
  where the reference's top-2 margin is under twice that row's actual error (a near tie; counted).
* ``planted``: the same random weights with a copy head (``copy_offset=7``, :mod:`kvforge.engine.planted`): the
  logits peak at the token 7 positions back, so greedy identity is exact: no emitted token differs from the
  reference's argmax and every row is decisive (margin >= 2 x its error). The bound is ``PLANTED_BOUND`` x the
  reference's logit std (FP8 maxima measured 0.05-0.09 x std: the copy layer's FP8 values feed the logits).

Scenarios: multi-turn conversations with prefix reuse on and off (FP8 and 16-bit context attention), reuse cut
back to a snapshot, preemption and resume, chunked prefill at snapshot-aware chunk ends (end-at-point and
mid-step passes), draft acceptance; the drafter (one draft token) runs in the multi-turn and preemption ones.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvforge.engine import Engine, EngineConfig, HybridModel, reference_logits, tiny
from kvforge.engine.numerics import compare_logits, component_errors
from tests.helpers import engine_rows_and_reference, multi_turn, random_prompt

LOGIT_ATOL = 0.3
PLANTED_BOUND = 0.15
# Width 128 gives the copy head 32-wide token codes (hidden_size // 4), so 256 tokens' codes stay apart.
PLANTED = tiny(copy_offset=7, hidden_size=128)
_MODELS: dict[str, HybridModel] = {}


def _model(kind: str) -> HybridModel:
    if kind not in _MODELS:
        _MODELS[kind] = HybridModel(PLANTED if kind == "planted" else tiny())
    return _MODELS[kind]


@pytest.fixture(scope="module", params=["random", "planted"])
def model(request: pytest.FixtureRequest) -> HybridModel:
    return _model(request.param)


@pytest.fixture(scope="module")
def random_model() -> HybridModel:
    return _model("random")


VOCAB = 256


def _prompt(rng: random.Random, n: int) -> list[int]:
    return random_prompt(rng, n, VOCAB)


def _conversations(eng: Engine, seed: int, **kw) -> dict:
    return multi_turn(eng, seed, vocab=VOCAB, first=(20, 45), follow=(3, 12), **kw)


def check_against_reference(model: HybridModel, eng: Engine, prompts: dict, *, check_drafts: bool = False) -> int:
    """Every recorded logits row of every finished request vs the reference (:func:`compare_logits`: within the
    bound, greedy equal outside near ties; for the planted model greedy equal on every row, every row decisive);
    returns the near ties seen."""
    ties = 0
    planted = model.config.copy_offset > 0
    for rid, prompt in prompts.items():
        out, rows, ref_rows, ref_draft = engine_rows_and_reference(model, eng, rid, prompt)
        p = len(prompt)
        bound = PLANTED_BOUND * float(ref_rows.std()) if planted else LOGIT_ATOL
        chk = compare_logits(rows, ref_rows, out, bound)
        assert chk.ok, f"{rid}: {chk.summary()}; differing tokens not at a near tie: {chk.unexcused}"
        if planted:
            assert chk.exact, f"{rid}: greedy identity is not exact: {chk.summary()}"
        ties += chk.excused
        if check_drafts and eng.draft_logits[rid]:
            # The draft proposed after the last emitted token of the prefill: drafter logits at position p - 1.
            first = eng.draft_logits[rid][0].to(ref_rows.device)
            assert ref_draft is not None
            derr = (first - ref_draft[p - 1]).abs().max().item()
            assert derr <= bound, f"{rid}: drafter logits differ by {derr:.4f} (bound {bound})"
    return ties


@pytest.mark.parametrize(("reuse", "fp8"), [(True, True), (False, True), (True, False)])
def test_multiturn_reuse_on_and_off(model: HybridModel, reuse: bool, fp8: bool) -> None:
    eng = Engine(model, EngineConfig(reuse=reuse, context_fp8=fp8), draft_len=1, record_logits=True)
    prompts = _conversations(eng, 1, turns=2, n_conv=2, new_tokens=4)
    assert check_against_reference(model, eng, prompts, check_drafts=True) == 0
    reused = eng.manager.stats.reused_tokens
    assert (reused > 0) if reuse else (reused == 0), reused
    assert eng.manager.counters.snapshots > 0
    eng.manager.check_invariants()


def test_fp8_context_v_layouts_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 context's V quantised straight into the dim-major layout (the default) and kept token-major give
    the same greedy tokens on the planted model (both quantise V to the same e4m3 values; only the kernel's V
    layout differs), and the token-major engine holds the reference bound too. A bad layout is refused."""
    from kvforge.engine import runner

    model = _model("planted")
    outs = {}
    real = runner.quantize_v_dim_major
    for layout in ("dim_major", "token_major"):
        calls: list[int] = []
        monkeypatch.setattr(runner, "quantize_v_dim_major", lambda *a, calls=calls: calls.append(1) or real(*a))
        eng = Engine(model, EngineConfig(context_v_layout=layout), draft_len=1, record_logits=True)
        prompts = _conversations(eng, 5, turns=2, n_conv=2, new_tokens=4)
        assert check_against_reference(model, eng, prompts) == 0
        assert bool(calls) == (layout == "dim_major"), (layout, len(calls))
        outs[layout] = {rid: eng.outputs[rid] for rid in prompts}
    assert outs["dim_major"] == outs["token_major"]
    for bad in ("dim-major", "", None, 1):
        with pytest.raises(ValueError, match="context_v_layout"):
            EngineConfig(context_v_layout=bad)  # type: ignore[arg-type]


def test_reuse_cut_back_to_a_snapshot(model: HybridModel) -> None:
    """Prompts that share 60 and 70 tokens of an 80-token first one (snapshots every 32 tokens and at 80): the
    attention blocks are cached up to 48 and 64 tokens, the recurrent state only at 32 and 64, so the first
    match is cut back to the snapshot at 32."""
    rng = random.Random(7)
    eng = Engine(model, EngineConfig(snapshot_interval=32, midchunk_snapshot_alignment=None), record_logits=True)
    base = _prompt(rng, 80)
    prompts = {"a": base}
    eng.add_request("a", base, 2)
    eng.run()
    prompts["b"] = [*base[:60], *_prompt(rng, 5)]
    prompts["c"] = [*base[:70], *_prompt(rng, 3)]
    for rid in ("b", "c"):
        eng.add_request(rid, prompts[rid], 2)
    eng.run()
    b, c = eng.finished["b"], eng.finished["c"]
    assert eng.manager.counters.pruned_tokens >= 16
    assert eng.manager.stats.reused_tokens >= 32 + 64
    assert check_against_reference(model, eng, prompts) == 0
    assert b.num_generated == c.num_generated == 2


def test_preemption_and_resume(model: HybridModel) -> None:
    """Few attention pages: the scheduler preempts running requests, which later resume and recompute."""
    rng = random.Random(3)
    cfg = EngineConfig(attention_pages=7, draft_pages=7, state_pages=12, max_num_tokens=128)
    eng = Engine(model, cfg, draft_len=1, record_logits=True)
    prompts = {f"r{i}": _prompt(rng, 30 + 5 * i) for i in range(3)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, 8)
    eng.run()
    assert eng.scheduler.stats.preemptions > 0
    assert check_against_reference(model, eng, prompts) == 0
    eng.manager.check_invariants()


@pytest.mark.parametrize("alignment", [None, 1])
def test_chunked_prefill_at_snapshot_points(model: HybridModel, alignment: int | None) -> None:
    """A 24-token budget and snapshots every 16 tokens: chunks end at points (alignment None) or pass one
    mid-step into the pending snapshot page (alignment 1); a second prompt then reuses those snapshots."""
    rng = random.Random(11)
    cfg = EngineConfig(max_num_tokens=24, snapshot_interval=16, midchunk_snapshot_alignment=alignment)
    eng = Engine(model, cfg, record_logits=True)
    base = _prompt(rng, 70)
    prompts = {"a": base, "b": [*base[:52], *_prompt(rng, 6)]}
    eng.add_request("a", base, 2)
    eng.run()
    eng.add_request("b", prompts["b"], 2)
    eng.run()
    counters = eng.manager.counters
    if alignment is None:
        assert counters.pending_committed == 0
    else:
        assert counters.pending_committed > 0
    assert eng.finished["b"].cache is not None
    assert eng.manager.stats.reused_tokens >= 48
    assert check_against_reference(model, eng, prompts) == 0


def test_draft_acceptance_keeps_outputs(model: HybridModel) -> None:
    """With a drafter replaced by an oracle (the reference's next token), every draft is accepted: two tokens per
    step, and the logits of both verified positions match the reference."""
    rng = random.Random(5)
    prompt = _prompt(rng, 33)
    seq = list(prompt)
    ref, _ = reference_logits(model, seq)
    # Precompute the reference's greedy continuation once (12 tokens).
    for _ in range(12):
        seq.append(int(reference_logits(model, seq)[0][-1].argmax()))
    greedy = seq[len(prompt) :]

    def oracle(req, emitted):
        nxt = req.num_generated + len(emitted)
        return greedy[nxt] if nxt < len(greedy) else 0

    eng = Engine(model, EngineConfig(), draft_len=1, record_logits=True, draft_fn=oracle)
    eng.add_request("o", prompt, 12)
    eng.run()
    assert eng.outputs["o"] == greedy
    assert eng.steps <= 1 + 6  # prefill + 11 tokens at two per step
    assert check_against_reference(model, eng, {"o": prompt}) == 0
    del ref


def test_bad_input_is_refused(model: HybridModel) -> None:
    eng = Engine(model, EngineConfig())
    with pytest.raises(ValueError, match="tokens"):
        eng.add_request("x", [1, 2, 999], 2)
    with pytest.raises(ValueError, match="draft_len"):
        Engine(model, EngineConfig(), draft_len=2)
    with pytest.raises(TypeError, match="model"):
        Engine("model", EngineConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_types"):
        tiny(layer_types="LLL")
    assert not eng.scheduler.has_unfinished


def test_decode_attention_matches_a_per_request_softmax() -> None:
    """The engine's absorbed-MLA decode switch point (the Triton kernel) on awkward lengths, against an explicit
    per-request softmax over rows gathered page by page."""
    from kvforge.engine.ops import decode_attention

    g = torch.Generator().manual_seed(2)
    pages, ps, d, dv, h = 11, 4, 48, 32, 3
    kv = torch.randn(pages, ps, d, generator=g)
    lens = torch.tensor([1, 7, 11], dtype=torch.int32)
    table = torch.tensor([[4, 0, 0], [2, 9, 0], [10, 3, 6]], dtype=torch.int32)
    q = torch.randn(3, h, d, generator=g)
    out = decode_attention(q, kv, table, lens, softmax_scale=0.3, v_head_dim=dv)
    for b in range(3):
        rows = torch.cat([kv[int(p)] for p in table[b]])[: int(lens[b])].double()
        p = torch.softmax(q[b].double() @ rows.T * 0.3, -1)
        torch.testing.assert_close(out[b].double(), p @ rows[:, :dv], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="v_head_dim"):
        decode_attention(q[..., :8], kv, table, lens, softmax_scale=0.3, v_head_dim=dv)


def test_compare_logits_excuses_only_near_ties() -> None:
    ref = torch.tensor([[3.0, 2.99, 0.0], [3.0, 1.0, 0.0], [1.0, 0.0, 2.0]])
    eng = ref + torch.tensor([[-0.02, 0.02, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.01]])
    chk = compare_logits(eng, ref, [1, 0, 2], bound=0.05)  # row 0 flips at a near tie (margin 0.01 < 2 x 0.02)
    assert chk.ok and chk.mismatches == 1 and chk.excused == 1 and chk.decisive == 2
    chk = compare_logits(eng, ref, [1, 1, 2], bound=0.05)  # row 1 differs with margin 2.0: not excused
    assert not chk.ok and chk.unexcused == [1]
    assert not compare_logits(eng, ref, [1, 0, 2], bound=0.015).ok  # the error is over the bound
    with pytest.raises(ValueError, match="engine_rows"):
        compare_logits(eng[:2], ref, [1, 0, 2], bound=0.05)
    bad = eng.clone()
    bad[1, 2] = float("nan")
    assert not compare_logits(bad, ref, [1, 0, 2], bound=0.05).ok  # a NaN from the engine fails the check


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        ((torch.zeros(3, 3, dtype=torch.int64), torch.zeros(3, 3), [0, 0, 0], 0.1), TypeError, "engine_rows"),
        ((torch.zeros(3, 3), [[0.0] * 3] * 3, [0, 0, 0], 0.1), TypeError, "ref_rows"),
        ((torch.zeros(3, 3, device="meta"), torch.zeros(3, 3), [0, 0, 0], 0.1), ValueError, "meta"),
        ((torch.zeros(3, 1), torch.zeros(3, 1), [0, 0, 0], 0.1), ValueError, "ref_rows"),
        ((torch.zeros(3), torch.zeros(3), [0, 0, 0], 0.1), ValueError, "ref_rows"),
        ((torch.zeros(3, 3), torch.zeros(3, 3), [0, 0, 0], float("nan")), ValueError, "bound"),
        ((torch.zeros(3, 3), torch.zeros(3, 3), [0, 0, 0], -1.0), ValueError, "bound"),
        ((torch.zeros(3, 3), torch.zeros(3, 3), [0, 0, 0], True), ValueError, "bound"),
        ((torch.zeros(3, 3), torch.zeros(3, 3), [0, 3, 0], 0.1), ValueError, "tokens"),
        ((torch.zeros(3, 3), torch.zeros(3, 3), [0, 1.0, 0], 0.1), ValueError, "tokens"),
        ((torch.zeros(3, 3), torch.full((3, 3), float("inf")), [0, 0, 0], 0.1), ValueError, "finite"),
    ],
)
def test_compare_logits_refuses_bad_input(args, err, match) -> None:
    with pytest.raises(err, match=match):
        compare_logits(*args)


@pytest.mark.parametrize("fp8", [True, False])
def test_component_errors_isolate_the_context_attention(random_model: HybridModel, fp8: bool) -> None:
    """Per layer and phase, each mixer against the reference mixer on the engine's own inputs (fp32 model):
    KDA (fla-core's naive recurrence here), MLA decode (the Triton decode kernel over the fp32 latent cache) and
    the drafter's decode agree to fp32 rounding; the MLA context attention carries FP8's 3 mantissa bits
    (relative RMS error of a few percent) or fp16's (16-bit mode, under 2e-3)."""
    rng = random.Random(4)
    rep = component_errors(random_model, EngineConfig(context_fp8=fp8), _prompt(rng, 40), 4)
    kinds = {(c.kind, c.phase) for c in rep}
    assert kinds == {("KDA", "prefill"), ("KDA", "decode"), ("MLA", "prefill"), ("MLA", "decode"),
                     ("draft", "prefill"), ("draft", "decode")}  # fmt: skip
    for c in rep:
        if c.kind != "KDA" and c.phase == "prefill":
            assert (5e-3 < c.mixer_rel < 0.08) if fp8 else (c.mixer_rel < 2e-3), c
        else:
            assert c.mixer_rel < 1e-5, c
        if c.kind != "draft":
            assert c.hidden_rel is not None and c.hidden_rel < (0.05 if fp8 else 2e-3), c


def test_committed_fla_configs_are_found_for_their_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed fla-core configs parse as fla's config files, are selected for their GPU (strict mode: the
    exact tuned key finds its config, another key does not), and a user's own FLA_CACHE_MODE is left alone."""
    import os

    from fla.ops.utils import cache as fla_cache

    from kvforge.engine.fla_configs import FLA_CONFIG_ROOT, use_committed_fla_configs

    gpu_dir = FLA_CONFIG_ROOT / "NVIDIA_H200"
    files = sorted(gpu_dir.glob("*.json"))
    assert files
    monkeypatch.setattr(fla_cache, "get_gpu_info", lambda: "NVIDIA_H200")
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.DISABLED)
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert use_committed_fla_configs() is None  # the user chose a mode
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    assert use_committed_fla_configs() == gpu_dir
    assert os.environ["FLA_CONFIG_DIR"] == str(gpu_dir)  # monkeypatch restores the environment afterwards
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.STRICT
    for f in files:
        doc = fla_cache.KernelConfigFile.from_file(f)
        assert doc is not None and doc.kernel_name == f.stem and doc.autotune_entries
        for entry in doc.autotune_entries.values():
            key = fla_cache.AutotuneKey(tuple(entry["autotune_key"]))
            assert fla_cache.load_cached_config(f.stem, key) == entry["config"]
            other = fla_cache.AutotuneKey((*entry["autotune_key"][:-1], "torch.float16"))
            assert fla_cache.load_cached_config(f.stem, other) is None


@pytest.mark.parametrize("n", [1, 2.5, True, "3"])
def test_component_errors_refuses_bad_max_new_tokens(model: HybridModel, n) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        component_errors(model, EngineConfig(), [1, 2, 3], n)


def test_export_fla_configs_refuses_bad_dest(tmp_path) -> None:
    pytest.importorskip("fla")
    from kvforge.engine.fla_configs import export_fla_configs

    with pytest.raises(TypeError, match="dest"):
        export_fla_configs(3)  # type: ignore[arg-type]
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="dest"):
        export_fla_configs(f)
