"""vLLM KV-event wire format: golden fixtures from vLLM's encoder, our batches through vLLM's decoder, the
legacy array layout, the engine-block -> router-key mapper, and a live subscriber that replays gaps."""

from __future__ import annotations

import asyncio
import glob
import json
import os
from pathlib import Path

import msgspec
import pytest

from kvforge.kvcache.events import AllBlocksCleared as RAllCleared
from kvforge.kvcache.events import BlockRemoved as RRemoved
from kvforge.kvcache.events import BlockStored as RStored
from kvforge.service import keys as K
from kvforge.service.kv_events import (
    AllBlocksCleared,
    BlockMapper,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    WireError,
    decode_batch,
    encode_batch,
    from_kvforge_event,
    parse_frames,
)

FIX = Path(__file__).parent / "fixtures" / "vllm_kv_events"


def _unjson(v):
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


def _vllm_wheel() -> str | None:
    env = os.environ.get("KVFORGE_VLLM_WHEEL")
    if env:
        return env if Path(env).is_file() else None
    found = sorted(glob.glob("/tmp/vllm*/vllm-*.whl"))
    return found[-1] if found else None


def test_golden_fixtures_decode_to_expected_events() -> None:
    expected = json.loads((FIX / "expected.json").read_text())["batches"]
    assert len(expected) == 3
    for name, exp in expected.items():
        batch = decode_batch((FIX / f"batch_{name}.msgpack").read_bytes())
        assert batch.ts == exp["ts"]
        assert batch.data_parallel_rank == exp["data_parallel_rank"]
        assert len(batch.events) == len(exp["events"])
        for ev, e in zip(batch.events, exp["events"]):
            assert type(ev).__name__ == e["type"]
            for k, v in e.items():
                if k != "type":
                    assert getattr(ev, k) == _unjson(v), (name, k)


@pytest.mark.skipif(_vllm_wheel() is None, reason="vLLM wheel absent (set KVFORGE_VLLM_WHEEL to a vllm-*.whl)")
def test_kvforge_batches_decode_with_vllms_decoder() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkfix", FIX / "make_fixtures.py")
    mkfix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mkfix)
    vllm = mkfix.load_vllm_kv_events(_vllm_wheel())
    dec = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    ours = [
        BlockStored([b"\x07" * 32, 5], None, list(range(32)), 16, None, "GPU", None),
        BlockStored([9], 5, list(range(16)), 16, 3, "CPU", "lora-a", group_idx=2),
        BlockRemoved([b"\x07" * 32], "GPU"),
        AllBlocksCleared(),
    ]
    got = dec.decode(encode_batch(ours, ts=12.5, data_parallel_rank=1))
    assert got.ts == 12.5 and got.data_parallel_rank == 1
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert got.events[0].block_hashes == [b"\x07" * 32, 5] and got.events[0].token_ids == list(range(32))
    assert got.events[1].parent_block_hash == 5 and got.events[1].lora_name == "lora-a"
    assert got.events[1].group_idx == 2 and got.events[1].medium == "CPU"
    assert got.events[2].block_hashes == [b"\x07" * 32]


def test_legacy_array_layout_round_trip_and_map_layout() -> None:
    evs = [BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None), BlockRemoved([1], None), AllBlocksCleared()]
    for legacy in (False, True):
        b = decode_batch(encode_batch(evs, ts=3.0, legacy_array=legacy))
        assert b.events == evs and b.ts == 3.0
    # The legacy writers sent only five BlockStored fields: still readable.
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [4], None, [1, 2], 2, None]]])
    assert decode_batch(old).events[0].block_hashes == [4]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]]),  # 3 tokens for 1x2
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 0, None]]]),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode(["x", []]),
    ],
)
def test_hostile_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_parse_frames_checks_shape() -> None:
    assert parse_frames([b"t", (5).to_bytes(8, "big"), b"p"]) == (b"t", 5, b"p")
    with pytest.raises(WireError):
        parse_frames([b"t", b"\x00" * 7, b"p"])
    with pytest.raises(WireError):
        parse_frames([b"t", b"p"])
    with pytest.raises(TypeError):
        decode_batch("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_batch([RStored((1,), None, 4)])  # type: ignore[list-item]


def test_mapper_rebuilds_router_keys_from_token_ids() -> None:
    tpb, bs = 8, 4
    tokens = list(range(100, 124))  # 6 engine blocks = 3 router blocks
    want = K.chain_keys(K.root_key(), tokens, tpb)
    m = BlockMapper(tpb)
    # Engine hashes are arbitrary bytes: the mapper never needs the engine's hash function.
    h = [bytes([i]) * 16 for i in range(6)]
    out = m.apply(BlockStored(h[:3], None, tokens[:12], bs, None, "GPU", None))
    assert out == [RStored(tuple(want[:1]), None, tpb)]
    out = m.apply(BlockStored(h[3:], h[2], tokens[12:], bs, None, "GPU", None))
    assert out == [RStored(tuple(want[1:]), want[0], tpb)]
    assert set(m.present) == set(want)
    # The same block offloaded to CPU, then dropped from GPU: still held.
    assert m.apply(BlockStored([h[5]], h[4], tokens[20:24], bs, None, "CPU", None)) == []
    assert m.apply(BlockRemoved([h[5]], "GPU")) == []
    assert m.apply(BlockRemoved([h[5]], "CPU")) == [RRemoved((want[2],))]
    assert m.apply(BlockRemoved([h[0]], "GPU")) == []  # completes no router block
    assert m.apply(BlockRemoved([h[3]], "GPU")) == [RRemoved((want[1],))]
    # Unknown parent, LoRA, extra keys, another group: skipped.
    assert m.apply(BlockStored([b"z"], b"unknown", tokens[:4], bs, None, "GPU", None)) == []
    assert m.apply(BlockStored([b"y"], None, tokens[:8], bs, 1, "GPU", "l")) == []
    assert m.apply(BlockStored([b"x"], None, tokens[:8], bs, None, "GPU", None, extra_keys=[["salt"]])) == []
    assert m.apply(BlockStored([b"w"], None, tokens[:8], bs, None, "GPU", None, group_idx=1)) == []
    assert m.skipped == 4
    assert m.apply(AllBlocksCleared()) == [RAllCleared()]
    assert len(m) == 0 and not m.present


def test_mapper_keys_match_request_keys() -> None:
    keyer = K.Keyer(16)
    ids = list(range(1000, 1000 + 70))
    keys, n = keyer.keys_for_body("/v1/completions", {"prompt": ids})
    m = BlockMapper(16)
    out = m.apply(BlockStored([i.to_bytes(4, "big") for i in range(17)], None, ids[:68], 4, None, None, None))
    assert out == [RStored(tuple(keys), None, 16)] and n == 70


def test_subscriber_replays_a_gap_over_zmq() -> None:
    async def main() -> None:
        pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        got: list = []
        sub = KVEventSubscriber(pub.endpoint, got.extend, BlockMapper(4), replay_endpoint=pub.replay_endpoint)
        sub.start()
        served = asyncio.get_running_loop().create_task(_serve(pub))
        try:
            toks = list(range(40))
            h = [bytes([i]) for i in range(10)]
            # PUB/SUB joins late: publish until the subscriber has seen something.
            for _ in range(200):
                if sub.counts["batches"]:
                    break
                pub.publish([AllBlocksCleared()])
                await asyncio.sleep(0.01)
            assert sub.counts["batches"] > 0
            pub.publish([BlockStored(h[:2], None, toks[:8], 4, None, "GPU", None)], send=False)  # lost on the wire
            pub.publish([BlockStored(h[2:4], h[1], toks[8:16], 4, None, "GPU", None)])
            for _ in range(200):
                if sub.counts["replayed"] >= 1 and len(sub.mapper) == 4:
                    break
                await asyncio.sleep(0.01)
            assert sub.counts["gaps"] == 1 and sub.counts["replayed"] >= 1 and sub.counts["lost"] == 0
            assert set(sub.mapper.present) == set(K.chain_keys(K.root_key(), toks[:16], 4))
            assert sub.last_seq == pub.next_seq - 1
            # Hostile frames are counted and skipped; the stream goes on.
            raw = pub._pub  # a test reaching for the socket to send garbage
            raw.send_multipart([b"", b"\x00\x01", b"x"])
            raw.send_multipart([b"", (pub.next_seq).to_bytes(8, "big"), b"\xc1garbage"])
            pub._next_seq += 1
            pub.publish([BlockRemoved(h[:1], "GPU")])
            for _ in range(200):
                if sub.counts["bad"] >= 2 and sub.last_seq == pub.next_seq - 1:
                    break
                await asyncio.sleep(0.01)
            assert sub.counts["bad"] >= 2 and sub.last_seq == pub.next_seq - 1
        finally:
            served.cancel()
            await sub.stop()
            pub.close()

    asyncio.run(asyncio.wait_for(main(), 20))


async def _serve(pub: KVEventPublisher) -> None:
    while True:
        pub.serve_replay()
        await asyncio.sleep(0.005)


def test_kvforge_events_to_wire_and_back_through_the_mapper() -> None:
    tokens = list(range(50, 66))
    keys = K.chain_keys(K.root_key(), tokens, 8)
    wire = from_kvforge_event(RStored(tuple(keys), None, 8), tokens)
    back = decode_batch(
        encode_batch([wire, from_kvforge_event(RRemoved((keys[1],))), from_kvforge_event(RAllCleared())])
    )
    m = BlockMapper(8)
    assert m.apply(back.events[0]) == [RStored(tuple(keys), None, 8)]  # its own keys, rebuilt from the tokens
    assert m.apply(back.events[1]) == [RRemoved((keys[1],))]
    with pytest.raises(ValueError, match="token_ids"):
        from_kvforge_event(RStored(tuple(keys), None, 8))
    with pytest.raises(WireError):
        from_kvforge_event(RStored(tuple(keys), None, 8), tokens[:-1])
    with pytest.raises(TypeError):
        from_kvforge_event("BlockStored")


def test_subscriber_with_a_bad_endpoint_logs_and_stops() -> None:
    async def main() -> None:
        sub = KVEventSubscriber("tcp://no host:x", lambda evs: None, BlockMapper(4))
        sub.start()
        await asyncio.sleep(0.05)
        assert sub.counts["bad"] == 1
        await sub.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
