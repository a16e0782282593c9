"""What a router sees of a request: its content (token ids, text or precomputed block keys) and identity.

A router never needs the prompt itself, only the block keys of its full blocks and its length in tokens. Three
ways to give them:

- ``token_ids``: keyed by :mod:`kvforge.kvcache.hashing`, the same keys a server's KV cache publishes in its
  block events.
- ``text`` (no tokenizer at the router): keyed over code points in blocks of ``tokens_per_block *
  chars_per_token`` characters and estimated at ``ceil(len / chars_per_token)`` tokens. These keys only match
  other text requests (never a server's token blocks).
- ``block_keys`` + ``num_tokens``: keys computed elsewhere (a trace's ``hash_ids``, a gateway that already
  tokenised), one per ``tokens_per_block`` tokens, each an ``int`` or 16 ``bytes`` (:func:`check_block_keys`).
  Keys are meant to be chained by prefix (equal keys at position ``i`` mean equal prompts up to block ``i``);
  the router stays consistent when they are not, it only matches less well.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.kvcache.hashing import block_keys as _hash_token_blocks

__all__ = ["BlockKeys", "RouteRequest", "RoutingKey", "check_block_keys", "request_content", "text_block_keys"]

BlockKeys = tuple[int | bytes, ...]

_KEY_BYTES = 16


def check_block_keys(keys: object, name: str = "block_keys") -> BlockKeys:
    """``keys`` as a tuple, checked: a sequence of ``int`` (not bool) or of 16-byte ``bytes``, not a mix.

    Raises TypeError for a str/bytes in place of the sequence, a non-sequence, or any other element type
    (str, bool, float, None, ...), and ValueError for ``bytes`` of another length. The checks run at C speed
    (``map``/``set``), since they sit on every routing decision.
    """
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
        raise TypeError(f"{name}: expected a sequence of block keys (ints or 16-byte bytes), got {type(keys).__name__}")
    t: tuple[Any, ...] = tuple(keys)
    if not t:
        return t
    kinds = set(map(type, t))
    if kinds == {int}:
        return t
    if kinds == {bytes}:
        if set(map(len, t)) != {_KEY_BYTES}:
            bad = next(k for k in t if len(k) != _KEY_BYTES)
            raise ValueError(f"{name}: expected {_KEY_BYTES}-byte keys, got one of {len(bad)} bytes")
        return t
    if kinds == {int, bytes}:
        raise TypeError(f"{name}: expected keys of one kind (all int or all bytes), got a mix")
    bad_kind = next(k for k in kinds if k is not int and k is not bytes)
    raise TypeError(f"{name}: expected int or 16-byte bytes keys, got a {bad_kind.__name__}")


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")


def _check_conversation_id(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"conversation_id: expected a str or None, got {type(value).__name__}")
    if not value:
        raise ValueError("conversation_id: expected a non-empty str or None, got ''")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to place. Give ``token_ids``, ``text``, or ``block_keys`` with ``num_tokens``.

    ``block_keys`` may accompany ``token_ids``/``text`` to skip keying them again; ``num_tokens`` then
    defaults to the token count (or the text estimate). ``scope`` is the reuse scope (LoRA id, salt) the
    server's cache keys under. ``block_keys`` is stored as the checked tuple (:func:`check_block_keys`).
    """

    request_id: Hashable
    token_ids: Sequence[int] | None = None
    text: str | None = None
    block_keys: Sequence[int | bytes] | None = None
    num_tokens: int | None = None
    conversation_id: str | None = None
    scope: Hashable | None = None

    def __post_init__(self) -> None:
        if self.request_id is None:
            raise ValueError("request_id: expected a hashable id, got None")
        try:
            hash(self.request_id)
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(self.request_id).__name__}") from None
        if self.token_ids is None and self.text is None and self.block_keys is None:
            raise ValueError("RouteRequest: expected token_ids, text or block_keys (with num_tokens), got none")
        if self.token_ids is not None and self.text is not None:
            raise ValueError("RouteRequest: expected token_ids or text, not both")
        if self.text is not None and not isinstance(self.text, str):
            raise TypeError(f"text: expected a str, got {type(self.text).__name__}")
        if self.token_ids is not None and (
            isinstance(self.token_ids, (str, bytes, bytearray)) or not isinstance(self.token_ids, Sequence)
        ):
            raise TypeError(f"token_ids: expected a sequence of ints, got {type(self.token_ids).__name__}")
        if self.block_keys is not None:
            object.__setattr__(self, "block_keys", check_block_keys(self.block_keys))
        if self.num_tokens is not None:
            _check_count("num_tokens", self.num_tokens)
        elif self.token_ids is None and self.text is None:
            raise ValueError("num_tokens: required when a request carries only block_keys")
        _check_conversation_id(self.conversation_id)


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a coordinator forwards instead of the request: enough to place it and to weigh its load.

    ``num_tokens`` is in the router's one load unit (tokens; text is estimated), so the coordinator path and
    the direct path charge a server the same. ``block_keys`` lets a new conversation be matched without
    sending its content again (any sequence is checked and stored as a tuple).
    """

    conversation_id: str | None
    num_tokens: int
    block_keys: BlockKeys = ()

    def __post_init__(self) -> None:
        _check_conversation_id(self.conversation_id)
        _check_count("num_tokens", self.num_tokens)
        object.__setattr__(self, "block_keys", check_block_keys(self.block_keys))

    def as_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-friendly form (``from_mapping`` reads it back)."""
        return {
            "conversation_id": self.conversation_id,
            "num_tokens": self.num_tokens,
            "block_keys": list(self.block_keys),
        }

    @classmethod
    def from_mapping(cls, key: Mapping[str, Any]) -> RoutingKey:
        """Read :meth:`as_dict`'s form (an older sender's ``block_hashes`` entry is read as ``block_keys``)."""
        if not isinstance(key, Mapping):
            raise TypeError(f"key: expected a RoutingKey or a mapping, got {type(key).__name__}")
        if "num_tokens" not in key:
            raise ValueError("key: expected a 'num_tokens' entry (the request's prompt length in tokens)")
        keys = key.get("block_keys", key.get("block_hashes"))
        return cls(
            conversation_id=key.get("conversation_id"),
            num_tokens=key["num_tokens"],
            block_keys=() if keys is None else check_block_keys(keys, "key['block_keys']"),
        )


_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"


def text_code_points(text: str, chars_per_block: int) -> np.ndarray:
    """The code points of ``text``'s full blocks of ``chars_per_block`` characters, as uint32 (a trailing
    partial block has no key, so it is not converted). The same ints as ``ord()`` per character, lone
    surrogates included, decoded in C (UTF-32 in native order viewed as uint32). A non-str ``text`` is a
    TypeError, a ``chars_per_block`` other than an int >= 1 a TypeError/ValueError, each naming the argument."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    if isinstance(chars_per_block, bool) or not isinstance(chars_per_block, int):
        raise TypeError(f"chars_per_block: expected an int, got {type(chars_per_block).__name__}")
    if chars_per_block < 1:
        raise ValueError(f"chars_per_block: expected an int >= 1, got {chars_per_block}")
    full = len(text) - len(text) % chars_per_block
    return np.frombuffer(text[:full].encode(_UTF32, "surrogatepass"), dtype=np.uint32)


def text_block_keys(text: str, chars_per_block: int, scope: Hashable | None = None) -> list[int]:
    """Block keys of ``text`` keyed over code points (what ``RouteRequest(text=...)`` and the router service's
    text keys use): one key per full block of ``chars_per_block`` characters, chained under ``("text", scope)``."""
    return _hash_token_blocks(text_code_points(text, chars_per_block), chars_per_block, ("text", scope))


def request_content(request: RouteRequest, tokens_per_block: int, chars_per_token: float) -> tuple[BlockKeys, int]:
    """The request's block keys (a tuple) and its length in tokens (text estimated in the same token unit)."""
    if request.text is not None:
        # Code points, not ``hash(str)``: string hashing is salted per process, so two router processes
        # would disagree about the same text.
        num_tokens = math.ceil(len(request.text) / chars_per_token)
        keys = request.block_keys
        if keys is None:
            chars_per_block = max(1, round(tokens_per_block * chars_per_token))
            keys = text_block_keys(request.text, chars_per_block, request.scope)
    elif request.token_ids is not None:
        num_tokens = len(request.token_ids)
        keys = request.block_keys
        if keys is None:
            keys = _hash_token_blocks(request.token_ids, tokens_per_block, request.scope)
    else:
        num_tokens = 0  # replaced below: __post_init__ guarantees num_tokens with bare keys
        keys = request.block_keys
    if request.num_tokens is not None:
        num_tokens = request.num_tokens
    assert keys is not None
    return tuple(keys), num_tokens
