"""A read-only uint32 token array (a scheduler request's ``token_ids``) is taken as validated, not copied.

* ``check_tokens`` returns such an array itself (no list), still enforces a smaller vocabulary, and treats a
  writable or other-dtype array as before (validated, returned as a list).
* A manager fed read-only arrays (``create_cache``, ``probe_reuse``, ``commit`` in chunks, partial blocks)
  ends in exactly the state it reaches from the same prompts as tuples, and keeps only Python ints.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.kvcache.hashing import check_tokens, token_array

TPB = 4


def _frozen(tokens: list[int]) -> np.ndarray:
    arr = token_array(tokens)
    arr.flags.writeable = False
    return arr


def test_check_tokens_takes_a_read_only_uint32_array_as_is() -> None:
    arr = _frozen([5, 0, 2**32 - 1, 7])
    assert check_tokens(arr) is arr
    small = _frozen([5, 0, 9, 7])
    assert check_tokens(small, vocab_size=10) is small
    with pytest.raises(ValueError, match=r"tokens\[2\]"):
        check_tokens(small, vocab_size=9)
    writable = np.array([1, 2, 3], dtype=np.uint32)
    assert check_tokens(writable) == [1, 2, 3] and type(check_tokens(writable)) is list
    big = np.array([1, 2, 3], dtype=np.int64)
    big.flags.writeable = False
    assert type(check_tokens(big)) is list
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        check_tokens(np.array([1, -2], dtype=np.int64))
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        token_array(np.array([1, 12, 3], dtype=np.uint32), vocab_size=12)


def _manager() -> KVCacheManager:
    config = KVCacheConfig(TPB, (LayerSpec(0, bytes_per_token=1),), (TierConfig(pages=24),))
    return KVCacheManager(config)


def _serve(mgr: KVCacheManager, prompt: list[int], as_array: bool, chunks: list[int]) -> tuple[int, int]:
    form = _frozen if as_array else tuple
    probed = mgr.probe_reuse(form(prompt), max_reuse_tokens=len(prompt) - 1)
    cache = mgr.create_cache(form(prompt), max_reuse_tokens=len(prompt) - 1)
    done = cache.num_committed_tokens
    assert cache.resize(capacity=len(prompt), history=len(prompt))
    for c in chunks:
        if done >= len(prompt):
            break
        stop = min(len(prompt), done + c)
        cache.commit(form(prompt[done:stop]))
        done = stop
    if done < len(prompt):
        cache.commit(form(prompt[done:]))
    cache.close()
    return probed, cache.num_reused_tokens


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16))
def test_manager_state_is_the_same_from_arrays_and_tuples(seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(30) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    by_tuple, by_array = _manager(), _manager()
    for _ in range(25):
        prompt = list(rng.choice(stems)) + [rng.randrange(30) for _ in range(rng.randint(1, 10))]
        chunks = [rng.randint(1, 6) for _ in range(4)]
        assert _serve(by_tuple, prompt, False, chunks) == _serve(by_array, prompt, True, chunks)
        by_array.check_invariants()
        assert by_array.state_snapshot() == by_tuple.state_snapshot()
    for block in by_array.tree.blocks():
        assert block.tokens is None or all(type(t) is int for t in block.tokens)
