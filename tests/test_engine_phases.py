"""The engine's phase timer (``EngineConfig(profile_phases=True)``, :mod:`kvforge.engine.phases`).

Off by default and then never called; on, every phase it reports is one of ``STEP_PHASES`` and the phases add
up to the whole step (checked with a counting clock, so exactly); the KV event emission nested inside the commit
is taken out of it; turning the timer on changes no output.
"""

from __future__ import annotations

import random

import pytest

from kvforge.engine import Engine, EngineConfig, HybridModel
from kvforge.engine.phases import STEP_PHASES, PhaseTimer
from tests.test_engine import PLANTED

VOCAB = PLANTED.vocab_size


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(PLANTED)


class _Counter:
    """A clock that advances by one per reading."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> float:
        self.n += 1
        return float(self.n)


def _prompts(n: int, seed: int = 5) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {i: [rng.randrange(VOCAB) for _ in range(rng.randrange(10, 20))] for i in range(n)}


def test_profile_phases_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="profile_phases"):
        EngineConfig(profile_phases=1)  # type: ignore[arg-type]


def test_the_timer_checks_its_arguments(model: HybridModel) -> None:
    with pytest.raises(TypeError, match="sync"):
        PhaseTimer(sync=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clock"):
        PhaseTimer(clock=3.0)  # type: ignore[arg-type]
    eng = Engine(model, EngineConfig(max_num_requests=2))
    with pytest.raises(TypeError, match="timer"):
        eng.set_phase_timer({})  # type: ignore[arg-type]
    assert eng.phases is None


def test_nested_time_leaves_the_enclosing_phase() -> None:
    clock = _Counter()
    t = PhaseTimer(clock=clock)
    inner = t.nested("kv_events", lambda: clock())  # one more reading inside
    outer = t.nested("kv_events", lambda: inner())  # an inner call counts once, in the outermost
    t.start()  # reading 1
    clock()  # 2: work of the phase
    outer()  # 3 (outer entry), 4 (inner entry), 5 (inside), 6 (outer exit; the inner one reads none): 3 nested
    t.mark("commit")  # 7
    assert t.totals["kv_events"] == 3.0
    assert t.totals["commit"] == 3.0  # 7 - 1 - 3
    assert t.steps == 1 and t.per_step_ms() == {"commit": 3000.0, "kv_events": 3000.0}


def test_off_by_default_and_never_called(model: HybridModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("the phase timer ran while off")

    for name in ("start", "mark", "nested"):
        monkeypatch.setattr(PhaseTimer, name, boom)
    eng = Engine(model, EngineConfig(max_num_requests=4))
    eng.graphs = eng.decode_graphs(capture=False)
    assert eng.phases is None
    eng.generate(_prompts(2), 3)
    assert eng.timings == {}
    assert "flush_events" not in vars(eng.manager.block_pool)


def test_phases_add_up_to_the_step_and_change_no_output(model: HybridModel) -> None:
    prompts = _prompts(3)
    ref = Engine(model, EngineConfig(max_num_requests=4))
    ref.graphs = ref.decode_graphs(capture=False)
    want = ref.generate(prompts, 5)

    eng = Engine(model, EngineConfig(max_num_requests=4, profile_phases=True))
    assert isinstance(eng.phases, PhaseTimer) and eng.timings is eng.phases.totals
    eng.graphs = eng.decode_graphs(capture=False)
    clock = _Counter()
    eng.set_phase_timer(PhaseTimer(clock=clock))
    assert "flush_events" in vars(eng.manager.block_pool)  # the KV event emission is timed on its own
    for rid, p in prompts.items():
        eng.add_request(rid, p, 5)
    seen: set[str] = set()
    graph_steps = 0
    while eng.scheduler.has_unfinished:
        replays = eng.graphs.replays
        eng.phases.clear()  # type: ignore[union-attr]
        first = clock.n + 1
        eng.step()
        # Every reading of the step's clock falls in exactly one phase: the totals telescope to the whole step.
        assert sum(eng.timings.values()) == clock.n - first
        assert set(eng.timings) <= set(STEP_PHASES)
        seen |= set(eng.timings)
        graph_steps += eng.graphs.replays - replays
    assert graph_steps > 0
    assert {"schedule", "page_table", "state_index", "inputs", "replay", "read", "accept", "commit"} <= seen
    assert {"forward"} <= seen  # the prefill steps ran eagerly
    assert eng.outputs == want
    eng.set_phase_timer(None)
    assert eng.timings == {} and "flush_events" not in vars(eng.manager.block_pool)
