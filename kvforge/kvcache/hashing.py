"""Block keys: the identity of a block of tokens everywhere in kvforge (cache tree, scheduler, events, router, sim).

A **block key** is a 128-bit unsigned ``int`` (``0 <= key < KEY_LIMIT``): a salted hash of the block's token
bytes and its parent's key. A chain starts at a **root key** from the hasher's salt, the reuse ``scope`` and an
optional per-request ``cache_salt``. Processes that exchange keys must share salt and algorithm.

Token ids are ints in ``[0, vocab_size)`` (``vocab_size <= TOKEN_ID_LIMIT = 2**32``), given as a sequence of
ints or a 1-D numpy integer array (a read-only uint32 one is taken as validated by its dtype and flags, see
:func:`check_tokens`). ``TypeError``: bool, float, str, None, objects without ``__index__``;
``ValueError``: negative ids, ids at or past the bound. Keys given by callers are checked by
:func:`check_block_keys`. Algorithms: ``"xxh3_128"`` (default, not cryptographic) and ``"sha256"``; the salt is
random per process unless given (``salt=`` or ``$KVFORGE_BLOCK_KEY_SALT``).

Rationale and the full input rules: ``docs/kvcache.md``.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import os
import struct
import sys
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np
import xxhash

__all__ = [
    "ALGORITHMS",
    "KEY_BYTES",
    "KEY_LIMIT",
    "SALT_ENV",
    "TOKEN_ID_LIMIT",
    "BlockKeyHasher",
    "block_keys",
    "check_block_keys",
    "check_tokens",
    "default_hasher",
    "keys_from_ids",
    "root_key",
    "token_array",
    "token_ints",
]

KEY_BYTES = 16
KEY_LIMIT = 1 << (8 * KEY_BYTES)
TOKEN_ID_LIMIT = 1 << 32
# Scope elements whose encoding depends only on their type and value (see BlockKeyHasher.root_key's memo).
_FLAT_TYPES = frozenset((type(None), bool, int, str, bytes))
ALGORITHMS = ("xxh3_128", "sha256")
SALT_ENV = "KVFORGE_BLOCK_KEY_SALT"
_ID_LIMIT = 1 << 64  # external block ids (a trace's hash_ids) are hashed as 8-byte words

_U32 = "<u4"
_U32_DTYPE = np.dtype(_U32)
# A parent key's 16 bytes then an external id as the 8-byte little-endian word: what an id's key hashes.
_PACK_ID_INPUT = struct.Struct(f"<{KEY_BYTES}sQ").pack
_NATIVE_LITTLE = sys.byteorder == "little"
# The byteorder argument of int.from_bytes mapped over many digests. (In the checks below, an exact list or tuple
# skips the ABC Sequence isinstance test, which costs as much as checking a few keys, on every admission.)
_LITTLE: itertools.repeat[Literal["little"]] = itertools.repeat("little")
if array.array("I").itemsize != 4:  # 4 on every platform CPython supports today
    raise ImportError("kvforge.kvcache.hashing needs array('I') to hold 32-bit words")


# --- validation --------------------------------------------------------------------------------------------------


def _check_vocab(vocab_size: object) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__}")
    if not 1 <= vocab_size <= TOKEN_ID_LIMIT:
        raise ValueError(f"vocab_size: expected 1 <= vocab_size <= 2**32, got {vocab_size}")
    return vocab_size


def _int_like(kind: type) -> bool:
    return issubclass(kind, (int, np.integer)) and kind is not bool


def _bad_token(name: str, tokens: Sequence[Any], vocab_size: int) -> Exception:
    """The precise error for the first bad element of a sequence (the slow path, taken only on failure)."""
    for i, t in enumerate(tokens):
        if isinstance(t, (bool, np.bool_)):
            return TypeError(f"{name}[{i}]: expected an int token id, got bool")
        if not isinstance(t, (int, np.integer)):
            return TypeError(f"{name}[{i}]: expected an int token id, got {type(t).__name__}")
        if not 0 <= int(t) < vocab_size:
            return ValueError(f"{name}[{i}]: expected a token id in [0, {vocab_size}), got {int(t)}")
    return TypeError(f"{name}: expected a sequence of int token ids")


def token_array(tokens: object, name: str = "tokens", *, vocab_size: int = TOKEN_ID_LIMIT) -> np.ndarray:
    """``tokens`` validated (see the module docstring) as a 1-D little-endian uint32 array (no copy when it
    already is one). Raises ``TypeError``/``ValueError`` naming ``name`` and the first bad index."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array of token ids, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an integer array of token ids, got dtype {tokens.dtype}")
        if tokens.dtype == _U32_DTYPE:  # every id of the project's own dtype is in [0, 2**32): only the vocab bound
            if vocab_size < TOKEN_ID_LIMIT and tokens.size and int(tokens.max()) >= vocab_size:
                i = int(np.argmax(tokens))
                raise ValueError(f"{name}[{i}]: expected a token id in [0, {vocab_size}), got {int(tokens[i])}")
        elif tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab_size:
                i = int(np.argmin(tokens)) if lo < 0 else int(np.argmax(tokens))
                raise ValueError(f"{name}[{i}]: expected a token id in [0, {vocab_size}), got {int(tokens[i])}")
        return np.ascontiguousarray(tokens, dtype=_U32)
    if (
        type(tokens) is not list
        and type(tokens) is not tuple
        and (isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence))
    ):
        raise TypeError(f"{name}: expected a sequence of int token ids, got {type(tokens).__name__}")
    try:
        # One C loop converts and range-checks every element: it refuses floats, str, None and any object
        # without __index__, and accepts Python and numpy ints (and bool, handled below). fromlist walks a
        # list's items directly, about 1.4x faster than array("I", seq)'s generic per-item lookup.
        if isinstance(tokens, list):
            words = array.array("I")
            words.fromlist(tokens)
        else:
            words = array.array("I", tokens)
    except (TypeError, OverflowError):
        raise _bad_token(name, tokens, vocab_size) from None
    out = np.frombuffer(words, dtype=np.uint32)
    if not _NATIVE_LITTLE:
        out = out.astype(_U32)
    if out.size:
        # A bool, or any other object whose __index__ gives 0 or 1 (a 0-d torch bool tensor), reads as 0 or 1:
        # only those positions need a look at the original objects, and there only ints (not bool) pass.
        if int(out.min()) <= 1:
            small = np.flatnonzero(out <= 1)
            # Many 0s and 1s: one C pass over every object's type beats fetching them one by one.
            many = 4 * small.size > out.size
            kinds = set(map(type, tokens if many else map(tokens.__getitem__, small.tolist())))
            if not all(_int_like(k) for k in kinds) and (
                not many or not all(_int_like(type(tokens[i])) for i in small.tolist())
            ):
                raise _bad_token(name, tokens, vocab_size)
        if vocab_size < TOKEN_ID_LIMIT and int(out.max()) >= vocab_size:
            raise _bad_token(name, tokens, vocab_size)
    return out


def check_tokens(tokens: object, name: str = "tokens", *, vocab_size: int = TOKEN_ID_LIMIT) -> Sequence[int]:
    """``tokens`` after the checks of :func:`token_array`, as a sequence of Python ints (a numpy array comes back
    as a list; a valid list or tuple comes back as given). Short sequences (a decode step) take a cheap path.

    A *read-only* 1-D little-endian uint32 array (what :func:`token_array` makes and a scheduler's request
    keeps) comes back as is, not as a list: its dtype already bounds every id below 2**32 (a smaller
    ``vocab_size`` takes one numpy max), and read-only means the caller promised it will not change. Callers
    that keep tokens take Python ints from it with :func:`token_ints`."""
    if (
        type(tokens) is np.ndarray
        and tokens.dtype == _U32_DTYPE
        and tokens.ndim == 1
        and not tokens.flags.writeable
        and (vocab_size >= TOKEN_ID_LIMIT or not tokens.size or int(tokens.max()) < vocab_size)
    ):
        return tokens  # type: ignore[return-value]  # a sequence of ints in every way the library reads it
    if isinstance(tokens, (list, tuple)) and len(tokens) <= 64:
        for t in tokens:
            if type(t) is not int or not 0 <= t < vocab_size:
                break
        else:
            return tokens
    arr = token_array(tokens, name, vocab_size=vocab_size)
    return arr.tolist() if isinstance(tokens, np.ndarray) else tokens  # type: ignore[return-value]


def token_ints(tokens: Sequence[int] | np.ndarray) -> Sequence[int]:
    """Validated token ids as Python ints, to keep: a numpy array's as a list, any other sequence as given."""
    return tokens.tolist() if type(tokens) is np.ndarray else tokens  # type: ignore[return-value]


def _bytes_view(arr: np.ndarray) -> memoryview:
    return memoryview(arr).cast("B")  # type: ignore[arg-type]  # a contiguous numpy array is a buffer


def check_block_keys(keys: object, name: str = "block_keys") -> tuple[int, ...]:
    """``keys`` as a tuple after checking each is a Python int in ``[0, KEY_LIMIT)`` (bool and numpy ints refused)."""
    if (
        type(keys) is not list
        and type(keys) is not tuple
        and (isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence))
    ):
        raise TypeError(f"{name}: expected a sequence of int block keys, got {type(keys).__name__}")
    out = tuple(keys)
    limit = KEY_LIMIT
    for k in out:  # one pass (a prompt's keys on every admission); the failure is named below
        if type(k) is not int or not 0 <= k < limit:
            break
    else:
        return out
    for i, k in enumerate(out):
        if type(k) is not int:
            raise TypeError(f"{name}[{i}]: expected an int block key, got {type(k).__name__}")
        if not 0 <= k < KEY_LIMIT:
            raise ValueError(f"{name}[{i}]: expected a block key in [0, 2**128), got {k}")
    raise AssertionError("check_block_keys: a key failed the check but not the search")  # pragma: no cover


def _check_tpb(tokens_per_block: object) -> int:
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise TypeError(f"tokens_per_block: expected an int, got {type(tokens_per_block).__name__}")
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block: expected a positive int, got {tokens_per_block}")
    return tokens_per_block


def _check_parent(parent: object) -> int:
    if type(parent) is not int:
        raise TypeError(f"parent: expected an int block key, got {type(parent).__name__}")
    if not 0 <= parent < KEY_LIMIT:
        raise ValueError(f"parent: expected a block key in [0, 2**128), got {parent}")
    return parent


def _encode(obj: object, name: str, out: bytearray, depth: int = 0) -> None:
    """A canonical, type-tagged byte encoding of a scope (so ``1``, ``True``, ``"1"`` and ``(1,)`` all differ)."""
    if depth > 16:
        raise ValueError(f"{name}: nested more than 16 levels deep")
    if obj is None:
        out += b"N"
    elif obj is True or obj is False:
        out += b"T" if obj else b"F"
    elif type(obj) is int:
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out += b"I" + len(raw).to_bytes(4, "little") + raw
    elif type(obj) is str:
        raw = obj.encode("utf-8", "surrogatepass")
        out += b"S" + len(raw).to_bytes(4, "little") + raw
    elif type(obj) is bytes:
        out += b"B" + len(obj).to_bytes(4, "little") + obj
    elif type(obj) is tuple:
        out += b"(" + len(obj).to_bytes(4, "little")
        for item in obj:
            _encode(item, name, out, depth + 1)
    else:
        raise TypeError(f"{name}: expected None, bool, int, str, bytes or a tuple of those, got {type(obj).__name__}")


def _check_cache_salt(cache_salt: object) -> bytes | None:
    if cache_salt is None:
        return None
    if isinstance(cache_salt, str):
        cache_salt = cache_salt.encode("utf-8", "surrogatepass")
    elif not isinstance(cache_salt, bytes):
        raise TypeError(f"cache_salt: expected a str, bytes or None, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt: expected a non-empty str or bytes (None for no salt)")
    return cache_salt


def _check_ids(ids: Sequence[object]) -> None:
    """Raise the precise error for the first id of ``ids`` that is not an int in ``[0, 2**64)``."""
    for i, v in enumerate(ids):
        if type(v) is not int:
            raise TypeError(f"ids[{i}]: expected an int, got {type(v).__name__}")
        if not 0 <= v < _ID_LIMIT:
            raise ValueError(f"ids[{i}]: expected an id in [0, 2**64), got {v}")


# --- the hasher ----------------------------------------------------------------------------------------------------


class BlockKeyHasher:
    """Computes block keys under one salt and algorithm (see the module docstring).

    ``salt``: bytes (>= 16) or None for 16 random bytes; ``algorithm``: one of :data:`ALGORITHMS`;
    ``vocab_size``: token ids must be below it (default and maximum 2**32).
    """

    __slots__ = (
        "_default_id_root",
        "_default_root",
        "_flat_roots",
        "_prefix",
        "_salt",
        "_seed",
        "algorithm",
        "vocab_size",
    )

    def __init__(
        self, salt: bytes | None = None, *, algorithm: str = "xxh3_128", vocab_size: int = TOKEN_ID_LIMIT
    ) -> None:
        if salt is None:
            salt = os.urandom(16)
        elif not isinstance(salt, bytes):
            raise TypeError(f"salt: expected bytes or None, got {type(salt).__name__}")
        elif len(salt) < 16:
            raise ValueError(f"salt: expected at least 16 bytes, got {len(salt)}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        self.vocab_size = _check_vocab(vocab_size)
        self._salt = salt
        # XXH3's 64-bit seed and the root both come from the salt; sha256 sees the salt through the root only
        # (every key's input starts with its parent's key, so every key depends on the root).
        self._seed = int.from_bytes(hashlib.blake2b(salt, digest_size=8, person=b"kvforge-seed").digest(), "little")
        self._prefix = b"kvforge-root\0" + algorithm.encode() + b"\0" + salt
        # The two roots of a request without scope or salt, computed once (every keys_from_ids call needs one).
        self._default_root = self.root_key()
        self._default_id_root = self._root(b"X", None, None)
        # Roots of flat scopes (text keys are chained under ("text", scope) on every request), by the scope and
        # its element types, since equal scopes may encode differently (("t", 1) and ("t", True)).
        self._flat_roots: dict[tuple[tuple[Any, ...], tuple[type, ...]], int] = {}

    @property
    def salt(self) -> bytes:
        return self._salt

    def _digest(self, data: bytes) -> bytes:
        if self.algorithm == "sha256":
            return hashlib.sha256(data).digest()[:KEY_BYTES]
        return xxhash.xxh3_128_digest(data, self._seed)

    def _root(self, domain: bytes, scope: Hashable | None, cache_salt: object) -> int:
        buf = bytearray(self._prefix)
        buf += domain
        _encode(scope, "scope", buf)
        salt = _check_cache_salt(cache_salt)
        if salt is None:
            buf += b"-"
        else:
            buf += b"+" + len(salt).to_bytes(4, "little") + salt
        return int.from_bytes(self._digest(bytes(buf)), "little")

    def root_key(self, scope: Hashable | None = None, cache_salt: str | bytes | None = None) -> int:
        """The key every chain under ``scope`` (None, bool, int, str, bytes or nested tuples of those) and
        ``cache_salt`` starts from."""
        if cache_salt is None:
            if scope is None:
                try:
                    return self._default_root
                except AttributeError:  # computing it in __init__
                    pass
            elif type(scope) is tuple and len(scope) <= 4:
                types = tuple(map(type, scope))
                if _FLAT_TYPES.issuperset(types):
                    memo = (scope, types)
                    got = self._flat_roots.get(memo)
                    if got is None:
                        if len(self._flat_roots) >= 1024:
                            self._flat_roots.clear()
                        got = self._flat_roots[memo] = self._root(b"T", scope, None)
                    return got
        return self._root(b"T", scope, cache_salt)

    def _chain(self, parent: int, data: bytes | memoryview, n_blocks: int, step: int) -> list[int]:
        """Keys of ``n_blocks`` consecutive ``step``-byte blocks of ``data`` chained from ``parent``."""
        if n_blocks <= 0:
            return []
        h = parent.to_bytes(KEY_BYTES, "little")
        keys: list[int] = []
        append, frm = keys.append, int.from_bytes
        stop = n_blocks * step
        if self.algorithm == "sha256":
            sha = hashlib.sha256
            for i in range(0, stop, step):
                h = sha(h + data[i : i + step]).digest()[:KEY_BYTES]
                append(frm(h, "little"))
        else:
            f, seed = xxhash.xxh3_128_digest, self._seed
            for i in range(0, stop, step):
                h = f(h + data[i : i + step], seed)
                append(frm(h, "little"))
        return keys

    def block_keys(
        self,
        tokens: Sequence[int] | np.ndarray,
        tokens_per_block: int,
        scope: Hashable | None = None,
        *,
        cache_salt: str | bytes | None = None,
        parent: int | None = None,
    ) -> list[int]:
        """Keys of every *full* block of ``tokens`` (a trailing partial block has none), chained from
        ``parent`` (a block key) or else from :meth:`root_key` of ``scope`` and ``cache_salt``."""
        tpb = _check_tpb(tokens_per_block)
        if parent is None:
            parent = self.root_key(scope, cache_salt)
        else:
            _check_parent(parent)
            if scope is not None or cache_salt is not None:
                raise ValueError("parent: give a parent key or a scope/cache_salt, not both")
        arr = token_array(tokens, vocab_size=self.vocab_size)
        n_blocks = len(arr) // tpb
        if n_blocks == 0:
            return []
        # A memoryview, not tobytes(): a fresh multi-100-kB bytes object costs more in page faults than hashing.
        return self._chain(parent, _bytes_view(arr), n_blocks, 4 * tpb)

    def partial_key(self, parent: int, tokens: Sequence[int] | np.ndarray) -> int:
        """The key a *partial* block (fewer than a block's tokens, matched by comparing tokens) is filed under
        below ``parent``: the same hash over its shorter input, so it never equals a full block's key."""
        arr = token_array(tokens, vocab_size=self.vocab_size)
        if not len(arr):
            raise ValueError("tokens: a partial block holds at least one token")
        return self._chain(_check_parent(parent), _bytes_view(arr), 1, 4 * len(arr))[0]

    def chain_payloads(self, parent: int, payloads: Sequence[bytes]) -> list[int]:
        """Keys of blocks described by opaque byte strings (e.g. a simulator's synthetic content), chained from
        ``parent``: for callers that have no token ids. Give such chains their own root (a scope naming the
        producer), so they never meet token chains."""
        _check_parent(parent)
        if isinstance(payloads, (bytes, bytearray, str)) or not isinstance(payloads, Sequence):
            raise TypeError(f"payloads: expected a sequence of bytes, got {type(payloads).__name__}")
        for i, p in enumerate(payloads):
            if type(p) is not bytes:
                raise TypeError(f"payloads[{i}]: expected bytes, got {type(p).__name__}")
        h = parent.to_bytes(KEY_BYTES, "little")
        out = []
        if self.algorithm == "sha256":
            sha = hashlib.sha256
            for p in payloads:
                h = sha(h + p).digest()[:KEY_BYTES]
                out.append(int.from_bytes(h, "little"))
        else:
            f, seed = xxhash.xxh3_128_digest, self._seed
            for p in payloads:
                h = f(h + p, seed)
                out.append(int.from_bytes(h, "little"))
        return out

    def keys_from_ids(
        self, ids: Sequence[int], scope: Hashable | None = None, *, cache_salt: str | bytes | None = None
    ) -> list[int]:
        """Block keys for external per-block ids already chained by prefix (a trace's ``hash_ids``: equal ids
        at a position with equal ids before it mean an equal block). Ids are ints in ``[0, 2**64)``; their
        keys live in their own domain, so they never equal keys of token blocks."""
        if (
            type(ids) is not list
            and type(ids) is not tuple
            and (isinstance(ids, (str, bytes, bytearray, memoryview)) or not isinstance(ids, Sequence))
        ):
            raise TypeError(f"ids: expected a sequence of ints, got {type(ids).__name__}")
        parent = self._default_id_root if scope is None and cache_salt is None else self._root(b"X", scope, cache_salt)
        # The chain inlined, each id packed as it is hashed: the pack refuses a negative, too large or non-integer
        # id, and the exact type test refuses bool and numpy ints (both would pack); the first failure re-checks
        # the whole sequence for a precise error, before anything is returned.
        # The digests are collected, then turned into ints in one C loop (map), not one call per id here.
        h = parent.to_bytes(KEY_BYTES, "little")
        digests: list[bytes] = []
        append, pack = digests.append, _PACK_ID_INPUT
        try:
            if self.algorithm == "sha256":
                sha = hashlib.sha256
                for v in ids:
                    if type(v) is not int:
                        break
                    h = sha(pack(h, v)).digest()[:KEY_BYTES]
                    append(h)
            else:
                f, seed = xxhash.xxh3_128_digest, self._seed
                for v in ids:
                    if type(v) is not int:
                        break
                    h = f(pack(h, v), seed)
                    append(h)
        except struct.error:
            pass
        if len(digests) != len(ids):
            _check_ids(ids)
            raise AssertionError("keys_from_ids: an id failed to pack but passed the checks")  # pragma: no cover
        return list(map(int.from_bytes, digests, _LITTLE))

    def __repr__(self) -> str:
        return f"BlockKeyHasher(algorithm={self.algorithm!r}, vocab_size={self.vocab_size})"


def _salt_from_env() -> bytes | None:
    raw = os.environ.get(SALT_ENV)
    if not raw:
        return None
    try:
        salt = bytes.fromhex(raw)
    except ValueError:
        raise ValueError(f"${SALT_ENV}: expected hex digits, got {raw!r}") from None
    if len(salt) < 16:
        raise ValueError(f"${SALT_ENV}: expected at least 32 hex digits (16 bytes), got {len(raw)}")
    return salt


_DEFAULT: BlockKeyHasher | None = None


def default_hasher() -> BlockKeyHasher:
    """The process's hasher: xxh3_128 with the salt of ``$KVFORGE_BLOCK_KEY_SALT`` (hex) or a random one,
    made on first use and the same object afterwards."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = BlockKeyHasher(_salt_from_env())
    return _DEFAULT


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    tokens_per_block: int,
    scope: Hashable | None = None,
    *,
    cache_salt: str | bytes | None = None,
    parent: int | None = None,
    hasher: BlockKeyHasher | None = None,
) -> list[int]:
    """:meth:`BlockKeyHasher.block_keys` with ``hasher`` (default: :func:`default_hasher`)."""
    h = default_hasher() if hasher is None else hasher
    return h.block_keys(tokens, tokens_per_block, scope, cache_salt=cache_salt, parent=parent)


def root_key(
    scope: Hashable | None = None, cache_salt: str | bytes | None = None, *, hasher: BlockKeyHasher | None = None
) -> int:
    """:meth:`BlockKeyHasher.root_key` with ``hasher`` (default: :func:`default_hasher`)."""
    return (default_hasher() if hasher is None else hasher).root_key(scope, cache_salt)


def keys_from_ids(
    ids: Sequence[int],
    scope: Hashable | None = None,
    *,
    cache_salt: str | bytes | None = None,
    hasher: BlockKeyHasher | None = None,
) -> list[int]:
    """:meth:`BlockKeyHasher.keys_from_ids` with ``hasher`` (default: :func:`default_hasher`)."""
    return (default_hasher() if hasher is None else hasher).keys_from_ids(ids, scope, cache_salt=cache_salt)
