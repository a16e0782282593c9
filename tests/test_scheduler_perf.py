"""Host time of one scheduling step with 256 running and 512 waiting requests, recorded by pytest-benchmark.

No time is asserted (CI machines vary). Measure with
``python -m pytest tests/test_scheduler_perf.py --benchmark-enable -q``; the target is a median <= 1 ms.
Each round rebuilds the state outside the timing (pedantic setup) and the test checks what the step decided.
"""

from __future__ import annotations

import pytest

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.scheduling import Request, RequestState, Scheduler, SchedulerConfig

TPB = 64
RUNNING = 256
WAITING = 512


def build(exact: bool) -> Scheduler:
    mgr = KVCacheManager(KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=16384),)))
    cfg = SchedulerConfig(
        max_num_tokens=8192, max_num_requests=512, demote_uncached_tokens=4096, exact_context_demotion=exact
    )
    s = Scheduler(mgr, cfg)
    # 256 requests in generation: admitted and prefilled (1,000-token prompts), one token produced.
    for i in range(RUNNING):
        n = 1000
        s.add_request(
            Request(
                ("run", i),
                block_keys=[hash(("run", i, b)) & (1 << 64) - 1 for b in range(n // TPB)],
                prompt_len=n,
                max_new_tokens=64,
            )
        )
    while any(r.state is not RequestState.GENERATION for r in s.running) or s.waiting:
        s.on_step_done(s.schedule())
    # 512 waiting: mostly short prompts, every 16th a long one (demoted, probed in exact mode).
    for i in range(WAITING):
        n = 20_000 if i % 16 == 0 else 300 + (i * 37) % 1500
        keys = [hash(("wait", i, b)) & (1 << 64) - 1 for b in range(n // TPB)]
        s.add_request(Request(("wait", i), block_keys=keys, prompt_len=n, max_new_tokens=16))
    return s


@pytest.mark.parametrize("exact", [False, True], ids=["estimate", "exact"])
def test_one_step_256_running_512_waiting(benchmark, exact):
    states = []

    def setup():
        s = build(exact)
        states.append(s)
        return (s,), {}

    batch = benchmark.pedantic(lambda s: s.schedule(), setup=setup, rounds=15, iterations=1)
    s = states[-1]
    assert len(batch.generation) == RUNNING
    assert batch.num_tokens == 8192  # 256 decode tokens, the rest of the budget to short prompts
    assert all(x.request.prompt_len < 20_000 for x in batch.context)
    assert batch.num_requests <= 512
    s.on_step_done(batch)
