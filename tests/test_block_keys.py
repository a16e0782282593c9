"""Block keys (kvforge.kvcache.hashing): collision-safe identity, validation, salts, one chain for every caller."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvforge.kvcache import hashing
from kvforge.kvcache.hashing import ALGORITHMS, KEY_LIMIT, TOKEN_ID_LIMIT, BlockKeyHasher, check_block_keys, token_array

SALT = bytes(range(16))


@pytest.fixture(params=["xxh3_128", "sha256"])
def hasher(request: pytest.FixtureRequest) -> BlockKeyHasher:
    return BlockKeyHasher(SALT, algorithm=request.param)


def test_keys_are_128_bit_ints_one_per_full_block(hasher: BlockKeyHasher) -> None:
    keys = hasher.block_keys(list(range(10)), 4)
    assert len(keys) == 2  # the trailing 2 tokens form no full block
    assert all(type(k) is int and 0 <= k < KEY_LIMIT for k in keys)
    assert len(set(keys)) == 2
    assert hasher.block_keys(list(range(3)), 4) == []


def test_builtin_hash_collisions_give_distinct_keys(hasher: BlockKeyHasher) -> None:
    # Python's hash: hash(-1) == hash(-2), and ints congruent mod 2**61 - 1 hash alike. The first is now refused
    # (negative ids), the second is out of the id range; in-range lookalikes never share a key.
    assert hash(-1) == hash(-2)
    with pytest.raises(ValueError, match=r"tokens\[0\].*\[0, 4294967296\)"):
        hasher.block_keys([-1] * 4, 4)
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        hasher.block_keys([5, 5 + (2**61 - 1)], 2)
    assert hasher.block_keys([1] * 8, 4) != hasher.block_keys([2] * 8, 4)
    a, b = hasher.block_keys([0, 1, 2, 3], 4), hasher.block_keys([1, 0, 2, 3], 4)
    assert a != b


@pytest.mark.parametrize(
    "bad, exc",
    [
        ([1, True, 3], TypeError),
        ([1, False], TypeError),
        ([1.0, 2], TypeError),
        ([np.float64(1.0)], TypeError),
        ([np.float32(1.0)], TypeError),
        (["1"], TypeError),
        ([None], TypeError),
        ([object()], TypeError),
        ([np.bool_(True)], TypeError),
        ([-1], ValueError),
        ([TOKEN_ID_LIMIT], ValueError),
        ([2**70], ValueError),
        ("abcd", TypeError),
        (b"abcd", TypeError),
        ({1, 2}, TypeError),
        (np.array([1.0, 2.0]), TypeError),
        (np.array([True, False]), TypeError),
        (np.array([[1, 2]]), ValueError),
        (np.array([1, -3]), ValueError),
        (np.array([1, 2**33], dtype=np.int64), ValueError),
        (np.array([1, 2], dtype=object), TypeError),
    ],
)
def test_bad_tokens_are_refused_naming_the_argument(hasher: BlockKeyHasher, bad: object, exc: type) -> None:
    with pytest.raises(exc, match="tokens"):
        hasher.block_keys(bad, 1)  # type: ignore[arg-type]


def test_true_and_float_never_match_int(hasher: BlockKeyHasher) -> None:
    for lookalike in ([True, 2], [1.0, 2]):
        with pytest.raises(TypeError):
            hasher.block_keys(lookalike, 2)


def test_numpy_and_list_inputs_agree(hasher: BlockKeyHasher) -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 200_000, size=1000)
    ref = hasher.block_keys(toks.tolist(), 16)
    for arr in (toks, toks.astype(np.int32), toks.astype(np.uint32), toks.astype(np.uint64), toks[::-1][::-1]):
        assert hasher.block_keys(arr, 16) == ref
    assert hasher.block_keys(tuple(toks.tolist()), 16) == ref
    assert hasher.block_keys([np.int64(t) for t in toks], 16) == ref


def test_chain_continues_from_a_parent_key(hasher: BlockKeyHasher) -> None:
    toks = list(range(100, 164))
    full = hasher.block_keys(toks, 8)
    head = hasher.block_keys(toks[:24], 8)
    tail = hasher.block_keys(toks[24:], 8, parent=head[-1])
    assert head + tail == full
    with pytest.raises(ValueError, match="parent"):
        hasher.block_keys(toks, 8, "scope", parent=head[-1])
    for bad in (True, -1, KEY_LIMIT, 1.0, b"x" * 16):
        with pytest.raises((TypeError, ValueError), match="parent"):
            hasher.block_keys(toks, 8, parent=bad)  # type: ignore[arg-type]


def test_salts_scopes_and_cache_salts_separate_chains() -> None:
    toks = list(range(32))
    a, b = BlockKeyHasher(SALT), BlockKeyHasher(bytes(16))
    assert a.block_keys(toks, 8) == BlockKeyHasher(SALT).block_keys(toks, 8)  # deterministic under one salt
    assert set(a.block_keys(toks, 8)).isdisjoint(b.block_keys(toks, 8))
    assert set(a.block_keys(toks, 8)).isdisjoint(BlockKeyHasher(SALT, algorithm="sha256").block_keys(toks, 8))
    variants = [
        a.block_keys(toks, 8),
        a.block_keys(toks, 8, scope=1),
        a.block_keys(toks, 8, scope=True),
        a.block_keys(toks, 8, scope="1"),
        a.block_keys(toks, 8, scope=(1,)),
        a.block_keys(toks, 8, scope=("lora", 3)),
        a.block_keys(toks, 8, cache_salt="tenant-a"),
        a.block_keys(toks, 8, cache_salt="tenant-b"),
        a.block_keys(toks, 8, scope=("lora", 3), cache_salt="tenant-a"),
    ]
    flat = [k for v in variants for k in v]
    assert len(set(flat)) == len(flat)  # no block of one tenant/scope matches another's
    assert a.block_keys(toks, 8, cache_salt="t") == a.block_keys(toks, 8, cache_salt=b"t")


def test_remembered_roots_of_flat_scopes_equal_computed_ones() -> None:
    """root_key remembers the roots of flat tuple scopes: equal tuples whose elements differ in type (("t", 1),
    ("t", True)) keep their own roots, and every remembered root is the one computed afresh."""
    h = BlockKeyHasher(SALT)
    scopes = [("text", None), ("text", 1), ("text", True), ("text", "1"), ("text", b"1"), ("t", 1, 2, 3), ("t", 1.5)]
    roots = [h.root_key(s) for s in scopes[:-1]]
    assert len(set(roots)) == len(roots)
    for _ in range(2):  # first computed, then remembered
        assert [h.root_key(s) for s in scopes[:-1]] == [BlockKeyHasher(SALT).root_key(s) for s in scopes[:-1]]
        assert [h.root_key(s) for s in scopes[:-1]] == [h._root(b"T", s, None) for s in scopes[:-1]]
    with pytest.raises(TypeError, match="scope"):
        h.root_key(scopes[-1])  # (not flat: checked as before)
    assert h.root_key(("text", None), "tenant") != h.root_key(("text", None))


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"scope": 1.5}, TypeError),
        ({"scope": [1]}, TypeError),
        ({"scope": object()}, TypeError),
        ({"cache_salt": ""}, ValueError),
        ({"cache_salt": 3}, TypeError),
    ],
)
def test_bad_scope_or_cache_salt(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc, match=r"scope|cache_salt"):
        BlockKeyHasher(SALT).block_keys([1, 2], 1, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        (("short",), {}, TypeError),
        ((b"short",), {}, ValueError),
        ((SALT,), {"algorithm": "md5"}, ValueError),
        ((SALT,), {"vocab_size": 0}, ValueError),
        ((SALT,), {"vocab_size": 2**33}, ValueError),
        ((SALT,), {"vocab_size": 1.0}, TypeError),
    ],
)
def test_bad_hasher_arguments(args: tuple, kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        BlockKeyHasher(*args, **kwargs)


def test_vocab_size_bound() -> None:
    h = BlockKeyHasher(SALT, vocab_size=1000)
    assert len(h.block_keys([999, 0], 1)) == 2
    with pytest.raises(ValueError, match=r"tokens\[1\].*\[0, 1000\)"):
        h.block_keys([1, 1000], 1)
    with pytest.raises(ValueError, match="1000"):
        h.block_keys(np.array([1, 1000]), 1)


@pytest.mark.parametrize("tpb", [0, -1, True, 1.0, None])
def test_bad_tokens_per_block(tpb: object) -> None:
    with pytest.raises((TypeError, ValueError), match="tokens_per_block"):
        BlockKeyHasher(SALT).block_keys([1, 2], tpb)  # type: ignore[arg-type]


def test_check_block_keys() -> None:
    assert check_block_keys([0, 5, KEY_LIMIT - 1]) == (0, 5, KEY_LIMIT - 1)
    assert check_block_keys(()) == ()
    for bad, exc in (
        ([1, True], TypeError),
        ([1.0], TypeError),
        (["a"], TypeError),
        ([None], TypeError),
        ([np.int64(3)], TypeError),
        ([-1], ValueError),
        ([KEY_LIMIT], ValueError),
        ("abc", TypeError),
        (b"abc", TypeError),
        (5, TypeError),
    ):
        with pytest.raises(exc, match="block_keys"):
            check_block_keys(bad)


def test_keys_from_ids_chain_and_domain() -> None:
    h = BlockKeyHasher(SALT)
    k1 = h.keys_from_ids([0, 1, 2])
    k2 = h.keys_from_ids([0, 1, 3])
    assert k1[:2] == k2[:2] and k1[2] != k2[2]
    assert h.keys_from_ids([5, 1, 2])[1:] != k1[1:]  # chained: a different first id changes every key after it
    assert set(k1).isdisjoint(h.block_keys([0, 0, 1, 0, 2, 0], 2))  # its own domain
    assert h.keys_from_ids([]) == []
    for bad in ([True], [1.5], [-1], [2**64], "ab"):
        with pytest.raises((TypeError, ValueError), match="ids"):
            h.keys_from_ids(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_keys_from_ids_equals_an_independent_chain(algorithm: str) -> None:
    # The hashed input written out by hand: the root of domain "X", then 16-byte parent key + 8-byte id per block.
    rng = random.Random(7)
    h = BlockKeyHasher(SALT, algorithm=algorithm)

    def digest(data: bytes) -> bytes:
        if algorithm == "sha256":
            return hashlib.sha256(data).digest()[:16]
        return xxhash.xxh3_128_digest(data, h._seed)

    for scope, salt in ((None, None), (("lora", 2), None), (None, "tenant")):
        root = h._root(b"X", scope, salt)
        ids = [rng.randrange(2**64) for _ in range(rng.randint(0, 30))] + [0, 2**64 - 1]
        want, parent = [], root.to_bytes(16, "little")
        for v in ids:
            parent = digest(parent + v.to_bytes(8, "little"))
            want.append(int.from_bytes(parent, "little"))
        assert h.keys_from_ids(ids, scope, cache_salt=salt) == want
        assert h.keys_from_ids(tuple(ids), scope, cache_salt=salt) == want


@pytest.mark.parametrize("bad_at", [0, 5, 11])
def test_keys_from_ids_names_the_first_bad_id_anywhere(hasher: BlockKeyHasher, bad_at: int) -> None:
    for bad, exc in (
        (True, TypeError),
        (np.int64(3), TypeError),
        (2.0, TypeError),
        (-1, ValueError),
        (2**64, ValueError),
    ):
        ids = list(range(12))
        ids[bad_at] = bad  # type: ignore[call-overload]
        with pytest.raises(exc, match=rf"ids\[{bad_at}\]"):
            hasher.keys_from_ids(ids)


def test_token_array_returns_uint32_view() -> None:
    out = token_array([1, 2, 3])
    assert out.dtype == np.dtype("<u4") and out.tolist() == [1, 2, 3]
    src = np.arange(5, dtype="<u4")
    assert token_array(src) is src or np.shares_memory(token_array(src), src)


def test_default_hasher_is_random_per_process_unless_salted(tmp_path) -> None:
    code = "from kvforge.kvcache.hashing import block_keys; print(block_keys([1, 2, 3, 4], 2))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in (0, 1)]
    assert runs[0].stdout != runs[1].stdout
    env_salt = {"KVFORGE_BLOCK_KEY_SALT": SALT.hex(), "PYTHONPATH": ":".join(sys.path)}
    salted = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env_salt)
        for _ in (0, 1)
    ]
    assert salted[0].stdout == salted[1].stdout
    assert salted[0].stdout.strip() == str(BlockKeyHasher(SALT).block_keys([1, 2, 3, 4], 2))
    assert hashing.default_hasher() is hashing.default_hasher()


# Keys computed with SALT before the list fast path landed: a change of key derivation (byte order, word size,
# chaining, seed, root encoding) fails here, and would silently invalidate every key a deployment has exchanged.
_PINNED = {
    "xxh3_128": {
        "blocks": [0x54AF6E516DDFEDDE339ABD8507B6024F, 0x289FA637EA0699EEF0E2371AB1A292A3],
        "scoped": [0x5964348F80045900E6F5C65DA2254469, 0x2FAB5164EA580E0159778759707F9E49],
        "root": 0xDD70C455B43D695BC4F41A99EBA2EB21,
        "partial": 0xAB005D17B4B48AD6D449BEDEE5B190CF,
        "ids": [
            0xAD75281229C9D8741AC377FF7B393DC3,
            0x7190FB20DCE53C8C8741ACED3BBE8308,
            0xEBCC348956E61D81A1EF6537CADD1092,
        ],
        "edge": [0x6C2CEB6FD91FFC8BCFB50EA3795CC30C, 0xC9F37BBDC4E17165D7CA5678FC6E0145],
    },
    "sha256": {
        "blocks": [0xAABF6E657268A66C507401A63AFAEDA2, 0x592B2B913285EEB221F9432E4E769D],
        "scoped": [0xDA57B3E12B21DC80726FC0F6B2EEB317, 0x11A34FB5CAC51F14A004F185B23A2C4D],
        "root": 0xE5CA3F8999FD90109C0E3E7D5B44CA65,
        "partial": 0xCD6CD882821A714A50B7E6F103DDB6F6,
        "ids": [
            0x9FA7782DC75D6DC3F281CA33944672C5,
            0x32DD47DB7C662EED9826CE38B3DFFA17,
            0x85ED2371DCA1CB69E043DB763F103FCA,
        ],
        "edge": [0x4BAE1CE3002BE6479EC09269E1C453F3, 0xB3D8940813B7D7B3E7DE7971B56D24FB],
    },
}


@pytest.mark.parametrize("algorithm", sorted(_PINNED))
def test_keys_are_pinned_under_a_fixed_salt(algorithm: str) -> None:
    want = _PINNED[algorithm]
    h = BlockKeyHasher(SALT, algorithm=algorithm)
    toks = [(i * 2654435761) % 200003 for i in range(40)]
    for form in (toks, tuple(toks), np.array(toks, dtype=np.int64), np.array(toks, dtype=np.uint32)):
        assert h.block_keys(form, 16) == want["blocks"]
    assert h.block_keys(toks[:8], 4, scope=("lora", 3), cache_salt="tenant-a") == want["scoped"]
    assert h.root_key() == want["root"]
    assert h.partial_key(h.root_key(), toks[:5]) == want["partial"]
    assert h.keys_from_ids([0, 7, 2**64 - 1]) == want["ids"]
    assert h.block_keys([0, 2**32 - 1], 1) == want["edge"]


def test_list_path_refuses_bool_lookalikes_among_many_small_ids(hasher: BlockKeyHasher) -> None:
    # The list path reads 0s and 1s through __index__ and looks at those positions' objects afterwards: a bool
    # hidden among ordinary ids, or among many 0/1 ids (the one-pass branch), is still named by position.
    n = 5000
    ids = [(i * 7919) % 50_000 + 2 for i in range(n)]
    zero_one = [i & 1 for i in range(n)]
    for base in (ids, zero_one):
        for pos in (0, n // 2, n - 1):
            bad = list(base)
            bad[pos] = bool(base[pos] & 1)
            with pytest.raises(TypeError, match=rf"tokens\[{pos}\].*bool"):
                hasher.block_keys(bad, 16)
            with pytest.raises(TypeError, match=rf"tokens\[{pos}\].*bool"):
                hasher.block_keys(tuple(bad), 16)
    assert hasher.block_keys(zero_one, 16) == hasher.block_keys(np.array(zero_one), 16)


def test_list_path_refuses_torch_bool_scalars() -> None:
    torch = pytest.importorskip("torch")
    h = BlockKeyHasher(SALT)
    for flag in (True, False):
        with pytest.raises(TypeError, match=r"tokens\[1\].*Tensor"):
            h.block_keys([5, torch.tensor(flag), 7], 1)


def test_int_subclasses_read_as_their_value() -> None:
    import enum

    class Tok(enum.IntEnum):
        PAD = 0
        BOS = 1
        EOS = 2

    h = BlockKeyHasher(SALT)
    assert h.block_keys([Tok.BOS, Tok.PAD, Tok.EOS, 9], 2) == h.block_keys([1, 0, 2, 9], 2)
