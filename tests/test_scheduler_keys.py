"""The scheduler's key path: a token-mode request is validated once, keeps its ids as a uint32 array, is keyed
from it in ``add_request``, and on decode only the newly completed blocks are keyed.

Keys are checked against :func:`kvforge.kvcache.hashing.block_keys` over the whole known sequence (prompt and
generated ids) as one plain list, computed independently of the scheduler's incremental path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvforge.kvcache import KVCacheConfig, KVCacheManager, LayerSpec, TierConfig
from kvforge.kvcache.hashing import BlockKeyHasher
from kvforge.scheduling import Request, RequestState, Scheduler, SchedulerConfig

SALT = bytes(range(16))


def _sched(tpb: int, pages: int = 256, vocab_size: int = 1 << 32, **cfg) -> tuple[Scheduler, KVCacheManager]:
    hasher = BlockKeyHasher(SALT, vocab_size=vocab_size)
    mgr = KVCacheManager(
        KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=pages),)), hasher=hasher
    )
    return Scheduler(mgr, SchedulerConfig(**cfg)), mgr


def _reference_keys(tokens: list[int], tpb: int, scope=None, cache_salt=None) -> list[int]:
    return BlockKeyHasher(SALT).block_keys(list(tokens), tpb, scope, cache_salt=cache_salt)


class _CountingHasher(BlockKeyHasher):
    """Records how many tokens each block_keys call hashes (to show decode keys only the new blocks)."""

    __slots__ = ("calls",)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: list[int] = []

    def block_keys(self, tokens, tokens_per_block, scope=None, *, cache_salt=None, parent=None):  # type: ignore[override]
        self.calls.append(len(tokens))
        return super().block_keys(tokens, tokens_per_block, scope, cache_salt=cache_salt, parent=parent)


@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "uint32"])
def test_request_keeps_validated_uint32_ids(kind: str) -> None:
    rng = random.Random(kind)
    ids = [rng.randrange(1 << 32) for _ in range(37)]
    given = {
        "list": list(ids),
        "tuple": tuple(ids),
        "int64": np.array(ids, dtype=np.int64),
        "uint32": np.array(ids, dtype=np.uint32),
    }[kind]
    r = Request("r", tokens=given, max_new_tokens=1)
    assert r.tokens == tuple(ids) and all(type(t) is int for t in r.tokens)
    assert r.token_ids is not None and r.token_ids.dtype == np.dtype("<u4") and r.token_ids.tolist() == ids
    assert not r.token_ids.flags.writeable
    with pytest.raises(ValueError):
        r.token_ids[0] = 1
    if isinstance(given, np.ndarray):
        given[:] = 0  # the caller's array changes later: the request's prompt does not
    else:
        assert given == (tuple(ids) if kind == "tuple" else ids)
    assert r.token_ids.tolist() == ids and r.tokens == tuple(ids)


def test_key_mode_requests_have_no_token_ids() -> None:
    assert Request("k", block_keys=[1, 2], prompt_len=9).token_ids is None
    assert Request("p", prompt_len=9).token_ids is None


@pytest.mark.parametrize("tpb", [1, 3, 16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_add_request_keys_match_the_reference(tpb: int, n: int) -> None:
    s, _ = _sched(tpb)
    rng = random.Random(n * 100 + tpb)
    ids = [rng.randrange(200_000) for _ in range(n)]
    for i, given in enumerate((ids, tuple(ids), np.array(ids, dtype=np.int64))):
        r = Request(i, tokens=given, max_new_tokens=1, scope="lora", cache_salt="tenant")
        assert r.block_keys is None
        s.add_request(r)
        assert r.block_keys == tuple(_reference_keys(ids, tpb, "lora", "tenant"))
        assert len(r.block_keys) == n // tpb


def test_add_request_checks_the_managers_vocabulary_before_any_change() -> None:
    s, mgr = _sched(4, vocab_size=1000)
    before = mgr.state_snapshot()
    bad = Request("bad", tokens=[1, 2, 3, 999, 1000, 5], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"tokens\[4\]"):
        s.add_request(bad)
    assert bad.block_keys is None and bad.seq == -1 and s.num_unfinished == 0
    assert mgr.state_snapshot() == before
    s.add_request(Request("ok", tokens=[1, 2, 3, 999, 5], max_new_tokens=1))
    assert s.num_unfinished == 1


def _run_with_outputs(s: Scheduler, reqs: list[Request], rng: random.Random, vocab: int = 200_000) -> None:
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished:
        b = s.schedule()
        new = {x.request.request_id: [rng.randrange(vocab) for _ in range(x.num_tokens)] for x in b.generation}
        new.update({x.request.request_id: [rng.randrange(vocab)] for x in b.context if x.is_last_chunk})
        s.on_step_done(b, new_tokens=new)


@pytest.mark.parametrize("tpb,prompt,out", [(4, 6, 11), (4, 8, 9), (3, 2, 10), (16, 37, 40), (1, 5, 4)])
def test_decode_keys_each_new_block_once_and_match_the_reference(tpb: int, prompt: int, out: int) -> None:
    hasher = _CountingHasher(SALT)
    mgr = KVCacheManager(
        KVCacheConfig(tpb, (LayerSpec(0, bytes_per_token=2),), (TierConfig(pages=128),)), hasher=hasher
    )
    s = Scheduler(mgr, SchedulerConfig(max_num_tokens=7))  # several prefill chunks, none aligned to a block
    rng = random.Random(tpb * 1000 + prompt)
    r = Request("r", tokens=[rng.randrange(200_000) for _ in range(prompt)], max_new_tokens=out)
    _run_with_outputs(s, [r], rng)
    assert r.state is RequestState.DONE and len(r.output_tokens) == out
    # The last output is never fed back, so the known sequence is the prompt and all outputs but the last.
    seq = [*r.tokens, *r.output_tokens[:-1]]
    ref = _reference_keys(seq, tpb)
    assert r.block_keys == tuple(ref[: prompt // tpb])
    assert r._generated_keys == ref[prompt // tpb :]
    # The prompt's keys in add_request, then each generated block's tokens hashed exactly once in all.
    assert hasher.calls[0] == prompt
    assert sum(hasher.calls[1:]) == (len(seq) // tpb - prompt // tpb) * tpb
    # What was committed is what a follow-up with the same tokens reuses (all but its last token).
    assert mgr.probe_reuse([*seq, 7], max_reuse_tokens=len(seq)) == len(seq) // tpb * tpb + len(seq) % tpb
    mgr.check_invariants()


def test_decode_with_draft_tokens_keys_every_completed_block() -> None:
    tpb = 4
    s, mgr = _sched(tpb, max_num_tokens=64)
    rng = random.Random(3)
    r = Request("r", tokens=[rng.randrange(200_000) for _ in range(10)], max_new_tokens=30, draft_len=3)
    s.add_request(r)
    while s.has_unfinished:
        b = s.schedule()
        acc, new = {}, {}
        for x in b.generation:
            a = min(rng.randint(1, x.num_tokens), r.max_new_tokens - r.num_generated)
            acc[x.request.request_id] = a
            new[x.request.request_id] = [rng.randrange(200_000) for _ in range(a)]
        for x in b.context:
            if x.is_last_chunk:
                new[x.request.request_id] = [rng.randrange(200_000)]
        s.on_step_done(b, accepted_tokens=acc, new_tokens=new)
    seq = [*r.tokens, *r.output_tokens[:-1]]
    ref = _reference_keys(seq, tpb)
    assert (*r.block_keys, *r._generated_keys) == tuple(ref)
    mgr.check_invariants()


def test_out_of_range_new_token_ids_are_refused_before_any_change() -> None:
    s, mgr = _sched(4, vocab_size=1000)
    r = Request("r", tokens=[1, 2, 3, 4, 5], max_new_tokens=3)
    s.add_request(r)
    b = s.schedule()
    s.on_step_done(b, new_tokens={"r": [7]})
    b = s.schedule()
    before = (mgr.state_snapshot(), r.num_generated, list(r.output_tokens))
    for bad in (-1, 1000, 1 << 32):
        with pytest.raises(ValueError, match="new_tokens"):
            s.on_step_done(b, new_tokens={"r": [bad]})
        assert (mgr.state_snapshot(), r.num_generated, list(r.output_tokens)) == before
    s.on_step_done(b, new_tokens={"r": [999]})
    assert r.output_tokens == [7, 999]


def test_preempted_request_with_outputs_is_readmitted_with_the_same_keys() -> None:
    tpb = 4
    s, mgr = _sched(tpb, pages=64)
    rng = random.Random(5)
    r = Request("r", tokens=[rng.randrange(200_000) for _ in range(9)], max_new_tokens=12)
    s.add_request(r)
    for _ in range(8):
        b = s.schedule()
        new = {x.request.request_id: [rng.randrange(200_000)] for x in b.generation}
        new.update({x.request.request_id: [rng.randrange(200_000)] for x in b.context if x.is_last_chunk})
        s.on_step_done(b, new_tokens=new)
    keys_before = (*r.block_keys, *r._generated_keys)
    s._preempt(r)  # as a stall would: its cache is suspended, then resumed or recreated from the tree
    r.cache.close()
    r.cache = None
    r.reset_for_recompute()
    _run_with_outputs(s, [], rng)
    seq = [*r.tokens, *r.output_tokens[:-1]]
    ref = _reference_keys(seq, tpb)
    assert (*r.block_keys, *r._generated_keys) == tuple(ref)
    assert tuple(ref[: len(keys_before)]) == keys_before
    mgr.check_invariants()
