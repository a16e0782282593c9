"""``KVCache.commit(tokens, block_keys=[])`` when the commit completes no block (the keys of the blocks it
completes are none): found by the host bench's token path, where a reuse that ends inside the last, partial
block leaves one token to commit. It raised IndexError; it must commit like ``block_keys=None``."""

from __future__ import annotations

import pytest

from kvforge.kvcache.config import KVCacheConfig, LayerSpec, TierConfig
from kvforge.kvcache.manager import KVCacheManager


def _manager() -> KVCacheManager:
    return KVCacheManager(
        KVCacheConfig(tokens_per_block=4, layers=(LayerSpec(0, bytes_per_token=1),), tiers=(TierConfig(pages=16),))
    )


@pytest.mark.parametrize("prompt_len", [5, 6, 7, 9])
def test_commit_with_no_completed_block_and_empty_keys(prompt_len: int):
    mgr = _manager()
    tokens = list(range(100, 100 + prompt_len))
    first = mgr.create_cache(tokens)
    assert first.resize(capacity=prompt_len, history=prompt_len)
    first.commit(tokens)
    first.close()
    keys = mgr.prompt_keys(tokens)
    cache = mgr.create_cache(tokens, block_keys=keys, max_reuse_tokens=prompt_len - 1)
    reused = cache.num_committed_tokens
    assert reused == prompt_len - 1  # the partial tail is matched by its tokens, up to the cap
    assert cache.resize(capacity=prompt_len, history=prompt_len)
    cache.commit(tokens[reused:], block_keys=keys[reused // 4 :])
    assert cache.num_committed_tokens == prompt_len
    cache.close()
    mgr.check_invariants()
    again = mgr.create_cache(tokens)
    assert again.num_committed_tokens == prompt_len  # the whole prompt is still reusable
    again.close()
    mgr.check_invariants()


def test_key_mode_commit_with_no_completed_block_and_empty_keys():
    mgr = _manager()
    keys = mgr.hasher.keys_from_ids([7, 8])
    cache = mgr.create_cache(block_keys=keys)
    assert cache.resize(capacity=10, history=10)
    cache.commit(num_tokens=8, block_keys=keys)
    cache.commit(num_tokens=1, block_keys=[])
    assert cache.num_committed_tokens == 9
    cache.close()
    mgr.check_invariants()
