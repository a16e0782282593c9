"""Host-time benchmarks of the cache's hot paths (pytest-benchmark; no time assertions).

CI runs each once (``--benchmark-disable`` is the default) and checks the results; record timings with
``python -m pytest tests/test_kvcache_perf.py --benchmark-enable -q``. Targets (issue 4, on the 2-core CI
machine): matching and inserting a 131,072-token prompt (1,024 blocks of 128 tokens) <= 1 ms each; one decode
step's bookkeeping for 256 running requests <= 0.5 ms.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pytest_benchmark")

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.kvcache.hashing import block_keys
from kvforge.kvcache.page_table import DevicePageTable

TPB = 128
PROMPT = 131_072
BLOCKS = PROMPT // TPB


def _config(pages: int) -> KVCacheConfig:
    # An MLA-like layer: 576 fp8 elements per token.
    return KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=576, dtype="float8_e4m3fn"),), (TierConfig(pages=pages),))


@pytest.fixture(scope="module")
def prompt() -> tuple[tuple[int, ...], list[int]]:
    rng = random.Random(4)
    tokens = tuple(rng.randrange(1 << 17) for _ in range(PROMPT))
    return tokens, block_keys(tokens, TPB)


@pytest.fixture(scope="module")
def cached(prompt):
    tokens, keys = prompt
    mgr = KVCacheManager(_config(BLOCKS + 64))
    cache = mgr.create_cache()
    assert cache.resize(PROMPT, PROMPT)
    cache.commit(tokens, block_keys=keys)
    cache.close()
    return mgr


def test_hash_131k_prompt(benchmark, prompt):
    tokens, keys = prompt
    assert benchmark(block_keys, tokens, TPB) == keys


def test_probe_131k_prompt(benchmark, cached, prompt):
    _tokens, keys = prompt
    assert benchmark(lambda: cached.probe_reuse(block_keys=keys)) == PROMPT


def _match(benchmark, mgr, **kw):
    held = []

    def setup():
        while held:
            held.pop().close()

    def run():
        held.append(mgr.create_cache(max_reuse_tokens=PROMPT, **kw))

    benchmark.pedantic(run, setup=setup, rounds=40, warmup_rounds=2)
    assert held[-1].num_committed_tokens == PROMPT and held[-1].num_blocks == BLOCKS
    setup()
    mgr.check_invariants()


def test_match_131k_prompt_with_keys(benchmark, cached, prompt):
    """create_cache with precomputed block keys: walk, lock 1,024 pages, build the cache."""
    tokens, keys = prompt
    _match(benchmark, cached, tokens=tokens, block_keys=keys)


def test_match_131k_prompt_hashing(benchmark, cached, prompt):
    """The same, hashing the tokens on the way (the one-time cost a request pays without cached keys)."""
    _match(benchmark, cached, tokens=prompt[0])


def _insert(benchmark, tokens, keys):
    cache_box = []

    def setup():
        cache_box.clear()
        mgr = KVCacheManager(_config(BLOCKS + 8))
        cache = mgr.create_cache()
        assert cache.resize(PROMPT, PROMPT)
        cache_box.append(cache)
        # No gc.collect() here: the collector runs as it would in a server, so its cost shows in the timing.
        return (), {}

    benchmark.pedantic(lambda: cache_box[0].commit(tokens, block_keys=keys), setup=setup, rounds=25)
    cache = cache_box[0]
    assert cache.num_committed_tokens == PROMPT and cache.manager.num_tree_blocks == BLOCKS
    cache.manager.check_invariants()


def test_insert_131k_prompt_with_keys(benchmark, prompt):
    """commit of 131,072 tokens whose block keys are known: 1,024 blocks into the tree."""
    _insert(benchmark, *prompt)


def test_insert_131k_prompt_hashing(benchmark, prompt):
    _insert(benchmark, prompt[0], None)


def test_decode_step_256_requests(benchmark):
    """One decode step: every request grows by one token (a new page every 128 tokens), commits it, and the
    host page table is brought up to date."""
    rng = random.Random(7)
    mgr = KVCacheManager(_config(256 * 48))
    table = DevicePageTable(mgr, max_rows=256, max_blocks=64)
    caches = []
    for _ in range(256):
        n = rng.randrange(200, 4000)
        c = mgr.create_cache()
        assert c.resize(n, n)
        c.commit([rng.randrange(1000) for _ in range(n)])
        table.row(c)
        caches.append(c)
    table.sync()
    start = sum(c.num_committed_tokens for c in caches)

    def step():
        for c in caches:
            h = c.history + 1
            c.resize(h, h)
            c.commit((h,))
        table.sync()

    benchmark.pedantic(step, rounds=300, warmup_rounds=5)
    steps = (sum(c.num_committed_tokens for c in caches) - start) // 256
    assert steps >= 1 and all(c.history == c.num_committed_tokens for c in caches)
    i = max(range(256), key=lambda i: caches[i].num_blocks)
    row = table.host[0, table.row(caches[i])]
    assert row[: caches[i].num_blocks].tolist() == caches[i].page_indices(0)
    mgr.check_invariants()
