"""Request → block keys for the router service, and the one seam to the router's public API.

Every key the service computes goes through :func:`chain_keys` (token runs chained from a parent key) and
:func:`root_key`, which delegate to :mod:`kvforge.kvcache.hashing`: request keys and keys rebuilt from an
engine's ``BlockStored`` token ids therefore agree by construction.

:class:`Keyer` turns an OpenAI request body into ``(block_keys, num_tokens)``:

- with a ``tokenizers`` tokenizer (``tokenizer.json``): the prompt's token ids in blocks of
  ``tokens_per_block``. A chat request is rendered with the model's chat template when one is given
  (``chat_template``: a ``tokenizer_config.json`` or a Jinja file, rendered in a sandbox as Hugging Face does,
  then tokenised without special tokens, as vLLM does), so its keys match the engine's own blocks; without a
  template as ``<|role|>\\ncontent\\n`` per message (keys consistent among requests, not the engine's);
- without one: the text's code points in chunks of ``tokens_per_block * chars_per_token`` characters, the
  prompt estimated at ``ceil(len / chars_per_token)`` tokens.

Bad bodies raise :class:`BadRequest` (a ``ValueError``) naming the field; nothing is routed.
The functions at the bottom (``make_router``, ``route``, ``finish``, ``stored_event`` ...) are the only places
the service touches ``kvforge.routing`` / ``kvforge.kvcache.events`` field names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.kvcache import hashing

_IDS_SLICE = 1 << 17

__all__ = [
    "EVENT_POLICIES",
    "KEYED_PATHS",
    "POLICIES",
    "BadRequest",
    "Keyer",
    "chain_keys",
    "finish",
    "make_router",
    "removed_event",
    "root_key",
    "route",
    "stored_event",
]

BlockKey = Hashable

POLICIES = ("conversation", "conversation-always", "cache-aware", "least-load", "round-robin")
# The policies whose placements use the engines' KV events (the others ignore them).
EVENT_POLICIES = ("conversation", "conversation-always")
# The POST routes the service keys and places (everything else it serves is answered or passed through).
KEYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
# Texts at least this long are tokenised through encode_batch, which releases the GIL (encode holds it).
_LONG_TEXT = 32 * 1024


class BadRequest(ValueError):
    """A client's request body is not a valid OpenAI request (the message names the field)."""


# ---------------------------------------------------------------- keys (kvforge.kvcache.hashing, salted 128-bit)


def root_key(scope: Hashable | None = None) -> BlockKey:
    """The parent of every chain's first block under ``scope``."""
    return hashing.root_key(scope)


def chain_keys(parent: BlockKey, tokens: Sequence[int], tokens_per_block: int) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens``, chained from ``parent`` (a trailing partial block has none)."""
    return list(hashing.block_keys(tokens, tokens_per_block, parent=parent))  # type: ignore[arg-type]


def block_keys_from_tokens(tokens: Sequence[int], tokens_per_block: int) -> list[BlockKey]:
    return chain_keys(root_key(), tokens, tokens_per_block)


_TEXT_SCOPE = ("text", None)


def block_keys_from_text(text: str, chars_per_block: int) -> list[BlockKey]:
    # Code points, not hash(str): str hashing is salted per process, so two routers would disagree. The
    # library's own text keying (one implementation, vectorised), so RouteRequest(text=...) agrees.
    from kvforge.routing.request import text_block_keys

    return text_block_keys(text, chars_per_block)  # type: ignore[return-value]


# ---------------------------------------------------------------- request bodies


def _content_text(content: Any, where: str, *, typed: bool = True) -> str:
    # typed: chat parts count only with "type": "text" (images and the like add nothing); untyped (responses
    # items: input_text, output_text, ...): every part's "text", where it has one.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"{where}[{j}]: expected an object, got {type(part).__name__}")
            text = part.get("text")
            if (part.get("type") != "text") if typed else text is None:
                continue
            if not isinstance(text, str):
                raise BadRequest(f"{where}[{j}].text: expected a string, got {type(text).__name__}")
            parts.append(text)
        return "".join(parts)
    raise BadRequest(f"{where}: expected a string, a list of parts or null, got {type(content).__name__}")


def render_chat(messages: Any) -> str:
    """The text the router keys a chat request by (messages in order, each tagged with its role)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{i}].role: expected a non-empty string, got {role!r:.40}")
        out.append(f"<|{role}|>\n{_content_text(m.get('content'), f'messages[{i}].content')}\n")
    return "".join(out)


def _prompt(body: dict[str, Any], field: str = "prompt") -> str | list[int]:
    prompt = body.get(field)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        # A batch of prompts is routed by its first (one request goes to one server).
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise BadRequest(f"{field}: expected a string, a list of strings or a list of token ids")
            return first
        if isinstance(first, list):
            prompt = first
        if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < hashing.TOKEN_ID_LIMIT for t in prompt):
            return prompt
    raise BadRequest(f"{field}: expected a string, a list of strings or a non-empty list of token ids in [0, 2**32)")


def render_responses(body: dict[str, Any]) -> str:
    """The text a ``/v1/responses`` request is keyed by: ``instructions`` as a system message, then ``input``
    (a string, or message items whose content is a string or parts with ``text``); other items (tool calls,
    their outputs) add nothing."""
    out = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest(f"instructions: expected a string, got {type(instructions).__name__}")
        out.append(f"<|system|>\n{instructions}\n")
    items = body.get("input")
    if isinstance(items, str):
        out.append(f"<|user|>\n{items}\n")
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadRequest(f"input[{i}]: expected an object, got {type(item).__name__}")
            role = item.get("role")
            if role is None:
                continue
            if not isinstance(role, str) or not role:
                raise BadRequest(f"input[{i}].role: expected a non-empty string, got {role!r:.40}")
            out.append(f"<|{role}|>\n{_content_text(item.get('content'), f'input[{i}].content', typed=False)}\n")
    else:
        raise BadRequest("input: expected a string or a non-empty list of items")
    return "".join(out)


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered in jinja2's immutable sandbox."""

    def __init__(self, path: str | Path) -> None:
        import json

        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: cannot read {str(path)!r}: {exc}") from None
        self.bos_token = self.eos_token = ""
        if str(path).endswith(".json"):
            try:
                cfg = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"chat_template: {str(path)!r} is not JSON: {exc}") from None
            tpl = cfg.get("chat_template") if isinstance(cfg, dict) else None
            if isinstance(tpl, list):  # named templates: the default one
                tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
            if not isinstance(tpl, str):
                raise ValueError(f"chat_template: {str(path)!r} has no 'chat_template' string")
            self.bos_token = _token_text(cfg.get("bos_token"))
            self.eos_token = _token_text(cfg.get("eos_token"))
            text = tpl

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self._template = env.from_string(text)
        except TemplateError as exc:
            raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from None

    def render(self, messages: list[Any], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise BadRequest(f"messages: the chat template rejected them ({exc})") from None


def _token_text(tok: Any) -> str:
    if isinstance(tok, dict):  # AddedToken form
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


class Keyer:
    """Computes a request's ``(block_keys, num_tokens)`` (see the module docstring)."""

    def __init__(
        self,
        tokens_per_block: int,
        chars_per_token: float = 4.0,
        tokenizer: str | Path | None = None,
        chat_template: str | Path | None = None,
    ):
        if not isinstance(tokens_per_block, int) or isinstance(tokens_per_block, bool) or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block: expected a positive int, got {tokens_per_block!r}")
        if not isinstance(chars_per_token, (int, float)) or not chars_per_token > 0:
            raise ValueError(f"chars_per_token: expected a positive number, got {chars_per_token!r}")
        self.tokens_per_block = tokens_per_block
        self.chars_per_token = float(chars_per_token)
        self.chars_per_block = max(1, round(tokens_per_block * chars_per_token))
        self.tokenizer = None
        self._tokenizer_path = None if tokenizer is None else str(tokenizer)
        self._chat_template_path = None if chat_template is None else str(chat_template)
        self._pool: Any = None
        self.chat_template = ChatTemplate(chat_template) if chat_template is not None else None
        if tokenizer is not None:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(str(tokenizer))
            except Exception as exc:  # tokenizers raises a bare Exception for a bad file
                raise ValueError(f"tokenizer: cannot load {str(tokenizer)!r} as a tokenizer.json: {exc}") from None

    @property
    def uses_tokens(self) -> bool:
        return self.tokenizer is not None

    def start_pool(self, processes: int = 1) -> None:
        """Spawn ``processes`` children holding a keyer with these settings (and this process's block-key
        salt, so their keys are this process's keys); :meth:`submit` runs work there.

        A long prompt keyed in this process holds the GIL for tens of milliseconds at a time even on a worker
        thread (decoding its JSON, turning its ids into a list: one C call each), and with it the event loop."""
        import concurrent.futures
        import multiprocessing

        if self._pool is not None:
            return
        args = (self.tokens_per_block, self.chars_per_token, self._tokenizer_path, self._chat_template_path,
                hashing.default_hasher().salt.hex())  # fmt: skip
        self._pool = concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_pool_init, initargs=args
        )
        self._pool.submit(_pool_ready).result()  # loaded and ready before the first request

    @property
    def has_pool(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a child of :meth:`start_pool` (a ``concurrent.futures.Future``); ``fn`` reaches the
        child's keyer through :func:`pool_keyer`."""
        assert self._pool is not None
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self.tokenizer is not None
        if len(text) >= _LONG_TEXT:
            # Same ids; encode_batch releases the GIL while it works, so a long prompt tokenised on a worker
            # thread does not hold the event loop (encode holds the GIL throughout).
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def keys_for_tokens(self, token_ids: Sequence[int]) -> tuple[list[BlockKey], int]:
        if isinstance(token_ids, list) and len(token_ids) > _IDS_SLICE:
            # A long list converted to uint32 in slices: one C call over millions of ints would hold the GIL
            # (and the event loop, when this runs on a worker thread) for tens of milliseconds.
            ids = np.empty(len(token_ids), dtype=np.uint32)
            try:
                for a in range(0, len(token_ids), _IDS_SLICE):
                    ids[a : a + _IDS_SLICE] = hashing.token_array(token_ids[a : a + _IDS_SLICE])
            except (TypeError, ValueError):
                pass  # the checked path below names the bad id by its index in the whole list
            else:
                return block_keys_from_tokens(ids, self.tokens_per_block), len(token_ids)  # type: ignore[arg-type]
        return block_keys_from_tokens(token_ids, self.tokens_per_block), len(token_ids)

    def keys_for_text(self, text: str) -> tuple[list[BlockKey], int]:
        if self.tokenizer is not None:
            return self.keys_for_tokens(self.encode(text, add_special_tokens=False))
        return block_keys_from_text(text, self.chars_per_block), math.ceil(len(text) / self.chars_per_token)

    def prompt(self, path: str, body: dict[str, Any]) -> str | list[int]:
        """The prompt as the engine sees it: rendered chat text, a completion's string, or its token ids."""
        if path.endswith("/responses"):
            return render_responses(body)
        if path.endswith("/embeddings"):
            return _prompt(body, "input")
        if path.endswith("/chat/completions"):
            text = render_chat(body.get("messages"))  # validates the messages in every case
            if self.chat_template is not None:
                agp = body.get("add_generation_prompt", True)
                if not isinstance(agp, bool):
                    raise BadRequest(f"add_generation_prompt: expected a boolean, got {type(agp).__name__}")
                text = self.chat_template.render(body["messages"], agp)
            return text
        return _prompt(body)

    def prompt_token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """Token ids of the prompt (needs a tokenizer): chat text without special tokens (the template holds
        them), a completion string with them, token ids as given."""
        p = self.prompt(path, body)
        if isinstance(p, list):
            return p
        return self.encode(p, add_special_tokens=not path.endswith(("/chat/completions", "/responses")))

    def keys_for_body(self, path: str, body: dict[str, Any]) -> tuple[list[BlockKey], int]:
        """Keys of a ``/v1/chat/completions`` or ``/v1/completions`` body; raises :class:`BadRequest`."""
        if self.tokenizer is not None:
            return self.keys_for_tokens(self.prompt_token_ids(path, body))
        p = self.prompt(path, body)
        if isinstance(p, list):
            # Token ids without a tokenizer: key the ids themselves (they only meet other id prompts).
            return block_keys_from_tokens(p, self.tokens_per_block), len(p)
        return self.keys_for_text(p)


_POOL_KEYER: Keyer | None = None


def _pool_init(
    tokens_per_block: int, chars_per_token: float, tokenizer: str | None, chat_template: str | None, salt: str
) -> None:
    global _POOL_KEYER
    import os

    os.environ[hashing.SALT_ENV] = salt  # (read when the child's default hasher is first made)
    _POOL_KEYER = Keyer(tokens_per_block, chars_per_token, tokenizer, chat_template)


def _pool_ready() -> bool:
    return _POOL_KEYER is not None


def pool_keyer() -> Keyer:
    """In a child of :meth:`Keyer.start_pool`: its keyer."""
    assert _POOL_KEYER is not None, "not in a keyer pool process"
    return _POOL_KEYER


# ---------------------------------------------------------------- the router's public API, in one place


def make_router(
    policy: str,
    servers: Sequence[Hashable],
    *,
    tokens_per_block: int,
    chars_per_token: float,
    use_cache_events: bool,
    request_ttl_s: float | None,
) -> Any:
    from kvforge.routing import CacheAwareRouter, ConversationRouter, LeastLoadRouter, RoundRobinRouter

    common: dict[str, Any] = dict(
        tokens_per_block=tokens_per_block, chars_per_token=chars_per_token, request_ttl_s=request_ttl_s
    )
    if policy in ("conversation", "conversation-always"):
        follow = "always" if policy == "conversation-always" else "specific"
        return ConversationRouter(servers, new_conversation_follow=follow, use_cache_events=use_cache_events, **common)
    cls = {"cache-aware": CacheAwareRouter, "least-load": LeastLoadRouter, "round-robin": RoundRobinRouter}.get(policy)
    if cls is None:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    return cls(servers, **common)


def route(router: Any, request_id: Hashable, keys: Sequence[BlockKey], num_tokens: int, conv: str | None) -> Hashable:
    from kvforge.routing.request import RouteRequest  # (a module: a package would run _handle_fromlist per call)

    req = RouteRequest(request_id, block_keys=keys, num_tokens=num_tokens, conversation_id=conv)  # type: ignore[arg-type]
    return router.route(req)


def finish(router: Any, request_id: Hashable, success: bool) -> bool:
    return bool(router.finish(request_id, success))


def loads(router: Any) -> dict[Hashable, float]:
    return dict(router.loads())


def stored_event(keys: Sequence[BlockKey], parent: BlockKey | None, tokens_per_block: int) -> Any:
    from kvforge.kvcache.events import BlockStored

    return BlockStored(block_keys=tuple(keys), parent_key=parent, tokens_per_block=tokens_per_block)  # type: ignore[arg-type]


def event_keys(event: Any) -> list[BlockKey]:
    """The block keys a ``kvforge.kvcache.events`` BlockStored / BlockRemoved carries."""
    return list(event.block_keys)


def removed_event(keys: Sequence[BlockKey]) -> Any:
    from kvforge.kvcache.events import BlockRemoved

    return BlockRemoved(block_keys=tuple(keys))  # type: ignore[arg-type]


def cleared_event() -> Any:
    from kvforge.kvcache.events import AllBlocksCleared

    return AllBlocksCleared()
