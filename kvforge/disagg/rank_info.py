"""Rank metadata exchanged at registration, and its msgpack wire format.

Wire format (``WIRE_VERSION`` 1): one msgpack map from field name to value.

* Required keys, always present: ``version`` (int) and every field of ``RankInfo`` without a default.
* Optional keys (``OPTIONAL_FIELDS``): present only when set (not None). An older reader that builds the
  dataclass with ``cls(**fields)`` and therefore rejects unknown keys still decodes a message from a newer
  writer as long as the newer optional fields are unset, and an unset field costs the wire nothing.
* Tuples travel as msgpack arrays; dtypes as torch's names (``"bfloat16"``, ``"float8_e4m3fn"``).
* Decoding is typed and strict (msgspec): an int field takes a msgpack int only (not a bool, not a float such as
  2.0), a bool field a msgpack bool only, a str field a str; a message over ``MAX_WIRE_BYTES`` is refused. Every
  malformed message raises ``ValueError`` (never ``TypeError`` or a decoder's own exception type).
* ``version`` changes only for incompatible changes (a field removed, renamed or re-typed, a meaning changed);
  adding an optional field does not change it. A reader rejects another version with ``WireVersionError``.

This module does not import torch: metadata is plain data.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgpack

from kvforge.kvcache.config import DTYPE_BYTES  # the KV dtypes a peer may announce (torch names)

WIRE_VERSION = 1
OPTIONAL_FIELDS = ("num_draft_layers", "draft_kv_dtype", "draft_kv_heads", "state_layers", "state_bytes")
MAX_WIRE_BYTES = 1 << 16  # a real message is a few hundred bytes; registration frames hold 4 KiB


class WireVersionError(ValueError):
    """A RankInfo message was written with a wire version this reader does not speak."""


_INT_MAX = 2**31 - 1  # every count, size and rank fits an int32 (a 2**64 block size is a hostile message)


def _positive(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _INT_MAX:
        raise ValueError(f"{name}: expected an int in [1, {_INT_MAX}], got {v!r}")


def _rank(name: str, rank: object, size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name}: expected an int in [0, {size}), got {rank!r}")


@cache
def _wire_types() -> tuple[type, type]:
    """The typed shapes of a message, built on first decode (msgspec is imported only when a message is read, so
    importing the disaggregation package does not need it)."""
    import msgspec

    class _WireHead(msgspec.Struct):
        """First pass: the version only (other keys skipped), so another version is told apart from a bad message."""

        version: Any = None

    # The typed shape of a version-1 message, derived from RankInfo's own fields (so a new field cannot be
    # forgotten here): required fields first, ``version`` required on the wire, optional ones default to None.
    # ``__post_init__`` checks the values.
    hints = typing.get_type_hints(RankInfo)
    fields = dataclasses.fields(RankInfo)
    required = [(f.name, hints[f.name]) for f in fields if f.default is dataclasses.MISSING or f.name == "version"]
    optional = [(f.name, hints[f.name], None) for f in fields if f.name in OPTIONAL_FIELDS]
    _WireV1 = msgspec.defstruct("_WireV1", [*required, *optional], forbid_unknown_fields=True)

    return _WireHead, _WireV1


def _wire_error(msg: str) -> str:
    """msgspec's message in this module's words (the field named as the contract's messages name it)."""
    import re

    m = re.fullmatch(r"Object contains unknown field `(.*)`", msg)
    if m:
        return f"data: unknown RankInfo fields [{m.group(1)!r}] (written by a newer, incompatible writer?)"
    m = re.fullmatch(r"Object missing required field `(.*)`", msg)
    if m:
        return f"data: RankInfo message lacks required fields [{m.group(1)!r}]"
    m = re.fullmatch(r"(.*) - at `\$\.([A-Za-z_]+)(.*)`", msg)
    if m:
        return f"{m.group(2)}{m.group(3)}: {m.group(1)} (malformed RankInfo message)"
    return f"data: malformed RankInfo message ({msg})"


@dataclass(frozen=True)
class RankInfo:
    """What one rank of a serving instance tells its peers about its KV cache and parallelism.

    ``layers_per_pp[p]`` counts the target layers of PP stage p (draft layers sit on the last stage).
    ``kv_heads`` is the KV head count of a target layer over the whole TP group (1 for MLA, whose latent cache
    is replicated across TP) and ``head_dim`` the elements per head per token (576 for DeepSeek-style MLA).
    ``page_groups`` describes the page table: the layer group of each of this rank's layers, targets then drafts.
    ``transport_rank`` is this rank's address in the transport (torch.distributed global rank) and
    ``instance_rank`` its rank inside the instance, ``(pp_rank * cp_size + cp_rank) * tp_size + tp_rank``.
    Under ``attention_dp`` the TP ranks form ``dp_size`` groups of ``tp_size // dp_size`` consecutive ranks and
    ``dp_rank`` is ``tp_rank // (tp_size // dp_size)`` (checked by the peer check, not here); without it
    ``dp_size`` / ``dp_rank`` do not split the TP ranks.
    ``state_layers`` / ``state_bytes``: a hybrid model's recurrent layers (whole model) and the bytes of one of
    their states (set both or neither; their states travel beside the KV).
    """

    instance_name: str
    instance_rank: int
    transport_rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    attention_dp: bool
    layers_per_pp: tuple[int, ...]
    is_mla: bool
    kv_heads: int
    head_dim: int
    kv_dtype: str
    element_bytes: int
    tokens_per_block: int
    page_groups: tuple[int, ...]
    version: int = WIRE_VERSION
    num_draft_layers: int | None = None
    draft_kv_dtype: str | None = None
    draft_kv_heads: int | None = None
    state_layers: int | None = None
    state_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.instance_name, str) or not self.instance_name:
            raise ValueError(f"instance_name: expected a non-empty str, got {self.instance_name!r}")
        for name in ("tp_size", "pp_size", "dp_size", "cp_size", "kv_heads", "head_dim", "tokens_per_block"):
            _positive(name, getattr(self, name))
        for name in ("tp", "pp", "dp", "cp"):
            _rank(f"{name}_rank", getattr(self, f"{name}_rank"), getattr(self, f"{name}_size"))
        expected = (self.pp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank
        if self.instance_rank != expected:
            raise ValueError(
                f"instance_rank: expected (pp_rank * cp_size + cp_rank) * tp_size + tp_rank = {expected}, "
                f"got {self.instance_rank!r}"
            )
        tr = self.transport_rank
        if isinstance(tr, bool) or not isinstance(tr, int) or not 0 <= tr <= _INT_MAX:
            raise ValueError(f"transport_rank: expected an int in [0, {_INT_MAX}], got {tr!r}")
        if not isinstance(self.layers_per_pp, tuple) or not isinstance(self.page_groups, tuple):
            raise ValueError("layers_per_pp/page_groups: expected tuples of ints")
        if any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= _INT_MAX for g in self.page_groups):
            raise ValueError(f"page_groups: expected ints in [0, {_INT_MAX}], got {self.page_groups!r:.80}")
        if len(self.layers_per_pp) != self.pp_size or any(
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _INT_MAX for n in self.layers_per_pp
        ):
            raise ValueError(
                f"layers_per_pp: expected {self.pp_size} non-negative ints (one per PP stage), "
                f"got {self.layers_per_pp!r}"
            )
        for name in ("attention_dp", "is_mla"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r:.40}")
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"kv_dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.kv_dtype!r}")
        if self.element_bytes != DTYPE_BYTES[self.kv_dtype]:
            raise ValueError(
                f"element_bytes: {self.kv_dtype} has {DTYPE_BYTES[self.kv_dtype]} bytes, got {self.element_bytes!r}"
            )
        if self.attention_dp and self.tp_size % self.dp_size:
            raise ValueError(
                f"dp_size: attention DP needs tp_size % dp_size == 0, got {self.tp_size} and {self.dp_size}"
            )
        if self.is_mla and self.kv_heads != 1:
            raise ValueError(f"kv_heads: an MLA cache has one latent head, got {self.kv_heads}")
        if self.num_draft_layers is not None:
            _positive("num_draft_layers", self.num_draft_layers)
        if self.draft_kv_dtype is not None and (
            not isinstance(self.draft_kv_dtype, str) or self.draft_kv_dtype not in DTYPE_BYTES
        ):
            raise ValueError(f"draft_kv_dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.draft_kv_dtype!r}")
        if self.draft_kv_heads is not None:
            _positive("draft_kv_heads", self.draft_kv_heads)
        if (self.state_layers is None) != (self.state_bytes is None):
            raise ValueError(
                f"state_layers/state_bytes: set both (a hybrid model's recurrent layers) or neither, got "
                f"{(self.state_layers, self.state_bytes)!r}"
            )
        if self.state_layers is not None:
            _positive("state_layers", self.state_layers)
            _positive("state_bytes", self.state_bytes)
        drafts = (self.num_draft_layers, self.draft_kv_dtype, self.draft_kv_heads)
        if any(d is not None for d in drafts) and any(d is None for d in drafts):
            raise ValueError(
                "num_draft_layers/draft_kv_dtype/draft_kv_heads: set all three (a drafter sharing the cache) or none, "
                f"got {drafts!r}"
            )

    @property
    def num_layers(self) -> int:
        """Target layers of the whole model (all PP stages)."""
        return sum(self.layers_per_pp)

    @property
    def attention_tp_size(self) -> int:
        """Ranks that split one request's attention heads: the TP size per DP group under attention DP."""
        return self.tp_size // self.dp_size if self.attention_dp else self.tp_size

    @property
    def has_draft(self) -> bool:
        return self.num_draft_layers is not None

    def fields(self) -> dict[str, Any]:
        """The wire map: required fields always, optional fields only when set."""
        out: dict[str, Any] = {"version": self.version}
        for f in dataclasses.fields(self):
            if f.name == "version":
                continue
            v = getattr(self, f.name)
            if f.name in OPTIONAL_FIELDS and v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_wire(self) -> bytes:
        return msgpack.packb(self.fields(), use_bin_type=True)

    @classmethod
    def from_wire(cls, data: bytes) -> RankInfo:
        """Decode a message; raises ``WireVersionError`` on another version, ``ValueError`` on a malformed one
        (``TypeError`` only when ``data`` is not bytes-like at all)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data: expected bytes, got {type(data).__name__}")
        if len(data) > MAX_WIRE_BYTES:
            raise ValueError(f"data: a RankInfo message has at most {MAX_WIRE_BYTES} bytes, got {len(data)}")
        import msgspec

        wire_head, wire_v1 = _wire_types()
        try:
            version = msgspec.msgpack.decode(data, type=wire_head).version
        except msgspec.ValidationError as exc:
            raise ValueError(f"data: expected a msgpack map with string keys ({exc})") from exc
        except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
            raise ValueError(f"data: not a msgpack RankInfo message ({exc})") from exc
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version: expected an int, got {type(version).__name__} {version!r:.40}")
        if version != WIRE_VERSION:
            raise WireVersionError(
                f"RankInfo wire version: this reader speaks version {WIRE_VERSION}, the message has version {version!r}"
            )
        try:
            wire = msgspec.msgpack.decode(data, type=wire_v1)
        except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
            raise ValueError(_wire_error(str(exc))) from exc
        fields = {f: getattr(wire, f) for f in wire.__struct_fields__}
        try:
            return cls(**fields)
        except ValueError:
            raise
        except Exception as exc:  # a value check that tripped on a type: still a malformed message
            raise ValueError(f"data: malformed RankInfo message ({type(exc).__name__}: {exc})") from exc
