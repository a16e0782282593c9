"""What a router sees of a request: its content (token ids, text or precomputed block hashes) and identity.

A router never needs the prompt itself, only the chained block hashes of its full blocks and its length in
tokens. Three ways to give them:

- ``token_ids``: hashed with :func:`kvforge.kvcache.hashing.block_hashes`, the same hashes a server's KV cache
  publishes in its block events.
- ``text`` (no tokenizer at the router): hashed over code points in blocks of ``tokens_per_block *
  chars_per_token`` characters and estimated at ``ceil(len / chars_per_token)`` tokens. These hashes only match
  other text requests (never a server's token blocks).
- ``block_hashes`` + ``num_tokens``: hashes computed elsewhere (a trace's ``hash_ids``, a gateway that already
  tokenised), one per ``tokens_per_block`` tokens of the prompt and chained by prefix: equal hashes at position
  ``i`` mean equal prompts up to the end of block ``i``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvforge.kvcache.hashing import block_hashes

__all__ = ["RouteRequest", "RoutingKey", "request_content"]


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
    """One request to place. Give ``token_ids``, ``text``, or ``block_hashes`` with ``num_tokens``.

    ``block_hashes`` may accompany ``token_ids``/``text`` to skip hashing them again; ``num_tokens`` then
    defaults to the token count (or the text estimate). ``scope`` is the reuse scope (LoRA id, salt) the
    server's cache hashes under.
    """

    request_id: Hashable
    token_ids: Sequence[int] | None = None
    text: str | None = None
    block_hashes: Sequence[int] | None = None
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
        if self.token_ids is None and self.text is None and self.block_hashes is None:
            raise ValueError("RouteRequest: expected token_ids, text or block_hashes (with num_tokens), got none")
        if self.token_ids is not None and self.text is not None:
            raise ValueError("RouteRequest: expected token_ids or text, not both")
        if self.text is not None and not isinstance(self.text, str):
            raise TypeError(f"text: expected a str, got {type(self.text).__name__}")
        if self.token_ids is not None and isinstance(self.token_ids, (str, bytes)):
            raise TypeError("token_ids: expected a sequence of ints, got a string")
        if self.block_hashes is not None and isinstance(self.block_hashes, (str, bytes)):
            raise TypeError("block_hashes: expected a sequence of ints, got a string")
        if self.num_tokens is not None:
            _check_count("num_tokens", self.num_tokens)
        elif self.token_ids is None and self.text is None:
            raise ValueError("num_tokens: required when a request carries only block_hashes")
        _check_conversation_id(self.conversation_id)


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a coordinator forwards instead of the request: enough to place it and to weigh its load.

    ``num_tokens`` is in the router's one load unit (tokens; text is estimated), so the coordinator path and
    the direct path charge a server the same. ``block_hashes`` lets a new conversation be matched without
    sending its content again.
    """

    conversation_id: str | None
    num_tokens: int
    block_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_conversation_id(self.conversation_id)
        _check_count("num_tokens", self.num_tokens)
        if not isinstance(self.block_hashes, tuple):
            raise TypeError(f"block_hashes: expected a tuple of ints, got {type(self.block_hashes).__name__}")

    def as_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-friendly form (``from_mapping`` reads it back)."""
        return {
            "conversation_id": self.conversation_id,
            "num_tokens": self.num_tokens,
            "block_hashes": list(self.block_hashes),
        }

    @classmethod
    def from_mapping(cls, key: Mapping[str, Any]) -> RoutingKey:
        if not isinstance(key, Mapping):
            raise TypeError(f"key: expected a RoutingKey or a mapping, got {type(key).__name__}")
        if "num_tokens" not in key:
            raise ValueError("key: expected a 'num_tokens' entry (the request's prompt length in tokens)")
        return cls(
            conversation_id=key.get("conversation_id"),
            num_tokens=key["num_tokens"],
            block_hashes=tuple(key.get("block_hashes") or ()),
        )


def request_content(request: RouteRequest, tokens_per_block: int, chars_per_token: float) -> tuple[Sequence[int], int]:
    """The request's block hashes and its length in tokens (text estimated in the same token unit)."""
    if request.text is not None:
        # Code points, not ``hash(str)``: string hashing is salted per process, so two router processes
        # would disagree about the same text.
        num_tokens = math.ceil(len(request.text) / chars_per_token)
        hashes = request.block_hashes
        if hashes is None:
            chars_per_block = max(1, round(tokens_per_block * chars_per_token))
            hashes = block_hashes([ord(c) for c in request.text], chars_per_block, ("text", request.scope))
    elif request.token_ids is not None:
        num_tokens = len(request.token_ids)
        hashes = request.block_hashes
        if hashes is None:
            hashes = block_hashes(request.token_ids, tokens_per_block, request.scope)
    else:
        num_tokens = 0  # replaced below: __post_init__ guarantees num_tokens with bare hashes
        hashes = request.block_hashes
    if request.num_tokens is not None:
        num_tokens = request.num_tokens
    assert hashes is not None
    return hashes, num_tokens
