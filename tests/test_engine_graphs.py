"""The CUDA-graph decode path (kvforge.engine.graphs) on the CPU: the padded static step a graph replays, run eagerly.

CUDA graphs need a CUDA device; on the CPU ``EngineConfig(cuda_graphs=True)`` is refused with a clear error and
the same static step (``Engine.decode_graphs(capture=False)``) runs without capture. On the planted model
(exact greedy identity) its outputs equal the plain forward pass's greedy continuation: padded buckets, the
drafter, and drafts injected into the slot stores so that verification accepts (in-place states selected on
the device). The capture itself runs in tests/test_engine_gpu.py on the H200.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvforge.engine import Engine, EngineConfig, HybridModel, reference_greedy
from kvforge.engine.graphs import BUCKETS
from kvforge.kernels._runtime import interpreting
from tests.test_engine import PLANTED

VOCAB = PLANTED.vocab_size


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(PLANTED)


def test_cuda_graphs_on_a_cpu_model_are_refused(model: HybridModel) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: graphs are allowed")
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(model, EngineConfig(cuda_graphs=True))
    with pytest.raises(TypeError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")  # type: ignore[arg-type]
    assert Engine(model, EngineConfig()).graphs is None  # the default on a CPU model: eager


def test_buckets_are_capped_at_the_request_budget(model: HybridModel) -> None:
    eng = Engine(model, EngineConfig(max_num_requests=6))
    g = eng.decode_graphs(capture=False)
    assert g.buckets == (1, 2, 4, 6)
    assert [g.bucket(n) for n in (1, 3, 5, 6, 7)] == [1, 4, 6, 6, None]
    assert set(BUCKETS) >= {1, 2, 4, 8, 16, 32, 64, 128, 256}


@pytest.mark.parametrize(("inject", "latent"), [(False, "auto"), (True, "auto"), (True, "fp8_e4m3")])
def test_static_decode_is_greedy_exact(model: HybridModel, inject: bool, latent: str) -> None:
    """Three requests (bucket 4: one padding row), one draft token; with ``inject`` every draft is the reference's
    next token, so rows accept two tokens and the live states come from the scratch rows. ``fp8_e4m3``: the
    static step writes and reads an e4m3 latent cache (the planted model's margins keep greedy identity)."""
    _check_static_decode(model, inject, latent)


@pytest.mark.skipif(not interpreting(), reason="a CPU model's kernels need the interpreter (no GPU here)")
@pytest.mark.parametrize("inject", [False, True])
def test_static_decode_on_the_kernel_path_is_greedy_exact(inject: bool) -> None:
    """The same with ``use_kernels`` on (the interpreter runs the GPU's op sequence: fused projections,
    ``kda_prepare``, the norm / rotary / swiglu kernels, fla-core's recurrence, ``greedy_accept``)."""
    fused = HybridModel(PLANTED)
    fused.use_kernels = True
    _check_static_decode(fused, inject, "auto")


def _check_static_decode(model: HybridModel, inject: bool, latent: str) -> None:
    rng = random.Random(5 + inject)
    prompts = {i: [rng.randrange(VOCAB) for _ in range(rng.randrange(18, 40))] for i in range(3)}
    n_new = 7
    want = {i: reference_greedy(model, p, n_new) for i, p in prompts.items()}
    eng = Engine(model, EngineConfig(max_num_requests=8, latent_cache_dtype=latent), draft_len=1)
    eng.graphs = g = eng.decode_graphs(capture=False)
    reqs = {i: eng.add_request(i, p, n_new) for i, p in prompts.items()}
    accepted_two = 0
    run = g.run

    def spy(slots, state_rows, starts, **kw):
        nonlocal accepted_two
        if inject:
            for rid, req in reqs.items():
                slot = eng._slot.get(rid)
                k = len(req.output_tokens)
                if slot in slots and k < n_new:
                    eng.stores.next_new_tokens[1, slot] = want[rid][k]
        out = run(slots, state_rows, starts, **kw)
        assert out.shape == (len(slots), 4)
        accepted_two += int((out[:, 2] == 2).sum())
        return out

    g.run = spy  # type: ignore[method-assign]
    out = eng.run()
    assert {i: out[i] for i in prompts} == want
    assert g.replays > 0
    assert (accepted_two > 0) is inject, accepted_two
    eng.manager.check_invariants()
    # The batch kept its slots and state rows between steps: their upload was skipped, only starts went up.
    assert g.uploads_skipped > 0
    # The padding row wrote the trash latent page (the manager's pages are all below it).
    layer = model.config.mla_layers[0]
    assert bool(eng.cache.latent[layer][eng.cache.latent_trash].view(torch.uint8).ne(0).any())


def test_last_step_with_fewer_tokens_left_stays_on_the_graph_path(model: HybridModel) -> None:
    """A row whose last step has one token left while the verify width is two (draft_len 1) still replays the
    static step: the scheduler reserved room for the draft position, the injected (correct) draft would be
    accepted, and the device caps acceptance at the one token left, so outputs stop at max_new_tokens, the live
    state is the one after that token (a follow-up turn reusing the conversation's prefix is still exact), and
    no page leaks."""
    rng = random.Random(17)
    prompts = {i: [rng.randrange(VOCAB) for _ in range(rng.randrange(40, 70))] for i in range(3)}
    n_new = 6  # prefill emits 1, two accepted-draft steps emit 4, the last step has 1 left
    want = {i: reference_greedy(model, p, n_new) for i, p in prompts.items()}
    eng = Engine(model, EngineConfig(max_num_requests=8, tokens_per_block=8), draft_len=1)
    assert eng.scheduler.config.reserve_verify_width
    eng.graphs = g = eng.decode_graphs(capture=False)
    reqs = {i: eng.add_request(i, p, n_new) for i, p in prompts.items()}
    run, eager, limits_seen = g.run, [], []

    def spy(slots, state_rows, starts, **kw):
        for rid, req in reqs.items():  # the reference's next token as the draft: every draft is accepted
            slot, k = eng._slot.get(rid), len(req.output_tokens)
            if slot in slots and k < n_new:
                eng.stores.next_new_tokens[1, slot] = want[rid][k]
        limits_seen.append(list(kw["limits"]))
        return run(slots, state_rows, starts, **kw)

    g.run = spy  # type: ignore[method-assign]
    step = eng.runner.step

    def eager_spy(rows, *a, **kw):
        eager.append([r.gen for r in rows])
        return step(rows, *a, **kw)

    eng.runner.step = eager_spy  # type: ignore[method-assign]
    out = eng.run()
    assert {i: out[i] for i in prompts} == want
    assert [1, 1, 1] in limits_seen  # the last step ran on the static path with one token left per row
    assert all(not any(gen) for gen in eager), eager  # eager steps were prefill only
    eng.manager.check_invariants()
    # A follow-up turn over the first conversation: its reused prefix (KV and recurrent state) must be exact.
    follow = prompts[0] + out[0] + [rng.randrange(VOCAB) for _ in range(9)]
    want2 = reference_greedy(model, follow, 4)
    eng.add_request("turn2", follow, 4)
    assert eng.run()["turn2"] == want2
    assert eng.manager.stats.reused_tokens > 0
    eng.manager.check_invariants()


def test_bad_limits_are_refused_before_the_step_runs(model: HybridModel) -> None:
    eng = Engine(model, EngineConfig(max_num_requests=4), draft_len=1)
    g = eng.decode_graphs(capture=False)
    for bad in ([3], [0], [1, 1], [True], [1.0]):
        with pytest.raises(ValueError, match="limits"):
            g.run([0], [0], [0], limits=bad)
    assert g.replays == 0 and g._last_ids is None
