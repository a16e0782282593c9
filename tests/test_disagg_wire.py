"""RankInfo on the wire: round trip, optional fields left off when unset, an old reader, version mismatches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack
import pytest

from kvforge.disagg.rank_info import OPTIONAL_FIELDS, WIRE_VERSION, RankInfo, WireVersionError
from tests.helpers import rank_info


def info(**kw) -> RankInfo:
    base = dict(
        instance_name="ctx0",
        instance_rank=3,
        transport_rank=7,
        tp_size=2,
        tp_rank=1,
        pp_size=2,
        pp_rank=1,
        layers_per_pp=(31, 30),
        page_groups=(0, 0, 1),
    )
    base.update(kw)
    return rank_info(**base)


DRAFT = dict(num_draft_layers=1, draft_kv_dtype="float8_e4m3fn", draft_kv_heads=1)


@dataclass(frozen=True)
class OldRankInfo:
    """A reader from before draft layers: it knows only the old fields and builds itself with cls(**fields)."""

    version: int
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
    layers_per_pp: list
    is_mla: bool
    kv_heads: int
    head_dim: int
    kv_dtype: str
    element_bytes: int
    tokens_per_block: int
    page_groups: list


def old_read(data: bytes) -> OldRankInfo:
    return OldRankInfo(**msgpack.unpackb(data, raw=False))


def old_write(old: OldRankInfo) -> bytes:
    return msgpack.packb(dataclasses.asdict(old), use_bin_type=True)


@pytest.mark.parametrize("extra", [{}, DRAFT], ids=["no-draft", "draft"])
def test_round_trip(extra):
    a = info(**extra)
    b = RankInfo.from_wire(a.to_wire())
    assert b == a
    assert isinstance(b.layers_per_pp, tuple) and isinstance(b.page_groups, tuple)


def test_unset_optional_fields_are_left_off_the_wire():
    fields = msgpack.unpackb(info().to_wire(), raw=False)
    assert not set(OPTIONAL_FIELDS) & set(fields)
    assert fields["version"] == WIRE_VERSION
    with_draft = msgpack.unpackb(info(**DRAFT).to_wire(), raw=False)
    assert {k: with_draft[k] for k in OPTIONAL_FIELDS if k in with_draft} == DRAFT


def test_old_reader_decodes_a_new_message_when_optional_fields_are_unset():
    new = info()
    old = old_read(new.to_wire())
    assert old.tokens_per_block == 64 and old.layers_per_pp == [31, 30] and old.version == WIRE_VERSION
    # The payload is byte for byte the one the old writer produced for the same rank: unset fields cost nothing.
    assert old_write(old) == new.to_wire()


def test_old_reader_rejects_a_message_with_draft_fields_set():
    with pytest.raises(TypeError, match="draft"):
        old_read(info(**DRAFT).to_wire())


def test_new_reader_decodes_an_old_message():
    old = old_read(info().to_wire())
    assert RankInfo.from_wire(old_write(old)) == info()


def test_version_mismatch_is_detected_with_both_versions():
    fields = msgpack.unpackb(info().to_wire(), raw=False)
    fields["version"] = WIRE_VERSION + 1
    with pytest.raises(WireVersionError, match=rf"version {WIRE_VERSION}.*version {WIRE_VERSION + 1}"):
        RankInfo.from_wire(msgpack.packb(fields))
    del fields["version"]
    with pytest.raises(WireVersionError, match="None"):
        RankInfo.from_wire(msgpack.packb(fields))


def test_malformed_messages_are_rejected():
    fields = msgpack.unpackb(info().to_wire(), raw=False)
    with pytest.raises(ValueError, match="unknown RankInfo fields \\['surprise'\\]"):
        RankInfo.from_wire(msgpack.packb({**fields, "surprise": 1}))
    del fields["head_dim"]
    with pytest.raises(ValueError, match="lacks required fields \\['head_dim'\\]"):
        RankInfo.from_wire(msgpack.packb(fields))
    with pytest.raises(ValueError, match="not a msgpack"):
        RankInfo.from_wire(b"\xc1")
    with pytest.raises(ValueError, match="expected a msgpack map"):
        RankInfo.from_wire(msgpack.packb([1, 2]))


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(tp_rank=2), "tp_rank"),
        (dict(instance_rank=2), "instance_rank"),
        (dict(layers_per_pp=(61,)), "layers_per_pp"),
        (dict(kv_dtype="bf16"), "kv_dtype"),
        (dict(element_bytes=1), "element_bytes"),
        (dict(kv_heads=8), "kv_heads"),
        (dict(num_draft_layers=1), "draft_kv_dtype"),
        (dict(tokens_per_block=0), "tokens_per_block"),
        (dict(instance_name=""), "instance_name"),
    ],
)
def test_invalid_rank_info_is_rejected_naming_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        info(**kw)
