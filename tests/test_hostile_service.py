"""Hostile input to the router service: bad bodies get a clean 4xx JSON error (never a traceback, never a
placement), bad command-line values a one-line argparse error, bad config values a ValueError."""

from __future__ import annotations

import asyncio

import pytest

from kvforge.__main__ import main as kvforge_main
from kvforge.service.keys import BadRequest, Keyer
from kvforge.service.proxy import ServiceConfig, normalize_backend_url
from tests.service_harness import fleet

CHAT = "/v1/chat/completions"
BAD_BODIES = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'"text"', 400),
    (b"{}", 400),
    (b'{"messages": "hi"}', 400),
    (b'{"messages": []}', 400),
    (b'{"messages": [5]}', 400),
    (b'{"messages": [{"content": "x"}]}', 400),
    (b'{"messages": [{"role": 7, "content": "x"}]}', 400),
    (b'{"messages": [{"role": "user", "content": 7}]}', 400),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}', 400),
    (b'{"messages": [{"role": "user", "content": [7]}]}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "conversation_id": 5}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "conversation_id": ""}', 400),
    (b"\xff\xfe\x00", 400),
]


@pytest.mark.usefixtures("http_layer")
def test_bad_bodies_get_clean_4xx_and_place_nothing() -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, max_body_bytes=4096) as (svc, base, backends, s):
            for raw, status in BAD_BODIES:
                async with s.post(base + CHAT, data=raw, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == status, raw
                    err = (await r.json())["error"]
                    assert err["code"] == status and err["message"] and "Traceback" not in err["message"]
            for raw in (b'{"prompt": 5}', b'{"prompt": []}', b'{"prompt": [1, -2]}', b'{"prompt": [1, "a"]}',
                        b'{"prompt": ["a", 1]}', b'{"prompt": [true]}'):  # fmt: skip
                async with s.post(base + "/v1/completions", data=raw) as r:
                    assert r.status == 400, raw
            # A body over the limit: 413, and the backend never sees it.
            async with s.post(base + CHAT, data=b'{"messages": "' + b"x" * 10_000 + b'"}') as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == 413
            async with s.post(base + CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                              headers={"X-Conversation-Id": "c" * 1000}) as r:  # fmt: skip
                assert r.status == 400
            # Admin endpoint: wrong shapes are 400, an unknown backend 404.
            for raw in (b"nope", b"[]", b'{"url": 5}', b'{"url": "ftp://x"}', b'{"url": "http://h:99999"}',
                        b'{"url": "http://h:1", "kv_events": "udp://x"}'):  # fmt: skip
                async with s.post(base + "/admin/backends", data=raw) as r:
                    assert r.status == 400, raw
            async with s.delete(base + "/admin/backends", params={"url": "http://nowhere:1"}) as r:
                assert r.status == 404
            assert backends[0].requests == [] and svc.fleet.total_backlog() == 0
            # One client's garbage leaves another's request alone.
            async with s.post(base + CHAT, json={"messages": [{"role": "user", "content": "fine"}]}) as r:
                assert r.status == 200

    asyncio.run(asyncio.wait_for(main(), 20))


@pytest.mark.parametrize(
    "argv",
    [
        ["router"],
        ["router", "--backend", "not a url"],
        ["router", "--backend", "ftp://h:1"],
        ["router", "--backend", "http://h:1?x=1"],
        ["router", "--backend", "http://h:70000"],
        ["router", "--backend", "http://h:1", "--backend", "http://h:1"],
        ["router", "--backend", "http://h:1", "--connect-timeout-s", "-1"],
        ["router", "--backend", "http://h:1", "--read-timeout-s", "0"],
        ["router", "--backend", "http://h:1", "--request-timeout-s", "nan"],
        ["router", "--backend", "http://h:1", "--health-interval-s", "inf"],
        ["router", "--backend", "http://h:1", "--max-retries", "-1"],
        ["router", "--backend", "http://h:1", "--tokens-per-block", "0"],
        ["router", "--backend", "http://h:1", "--max-body-bytes", "1.5"],
        ["router", "--backend", "http://h:1", "--port", "70000"],
        ["router", "--backend", "http://h:1", "--policy", "random"],
        ["router", "--backend", "http://h:1", "--log-level", "loud"],
        ["router", "--backend", "http://h:1", "--kv-events", "udp://h:1"],
        ["router", "--backend", "http://h:1", "--kv-events", "tcp://h:1", "--kv-events", "tcp://h:2"],
        ["router", "--backend", "http://h:1", "--kv-replay", "tcp://h:2"],
        ["router", "--backend", "http://h:1", "--tokenizer", "/nonexistent/tokenizer.json"],
        ["router", "--backend", "http://h:1", "--health-path", "health"],
        ["router", "--backend", "http://h:1", "--chat-template", "/nonexistent/tokenizer_config.json"],
        ["router", "--backend", "http://h:1", "--http", "h2"],
    ],
)
def test_bad_cli_values_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = kvforge_main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kvforge_main(["router", "--help"])
    out = capsys.readouterr().out
    import argparse

    from kvforge.service.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 28
    for action in flags:
        assert action.help, action.option_strings
        for flag in action.option_strings:
            assert flag in out
    assert out.count("(default") >= 15


def test_config_and_keyer_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="policy"):
        ServiceConfig(backends=["http://h:1"], policy="nope")
    with pytest.raises(ValueError, match="read_timeout_s"):
        ServiceConfig(backends=["http://h:1"], read_timeout_s=-1)
    with pytest.raises(ValueError, match="max_retries"):
        ServiceConfig(backends=["http://h:1"], max_retries=True)
    with pytest.raises(ValueError, match="backend URL"):
        normalize_backend_url(None)
    with pytest.raises(ValueError, match="tokens_per_block"):
        Keyer(0)
    with pytest.raises(ValueError, match="tokenizer"):
        Keyer(16, tokenizer=__file__)
    with pytest.raises(BadRequest, match="prompt"):
        Keyer(16).keys_for_body("/v1/completions", {"prompt": {"a": 1}})


def test_the_cli_entry_point_does_not_import_the_service_stack() -> None:
    # `kvforge simulate` must work without the router extra installed.
    import subprocess
    import sys

    code = (
        "import sys, kvforge.__main__, kvforge.service.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'zmq', 'prometheus_client', 'tokenizers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- issue 31


async def _ok_error(r, status: int) -> None:
    assert r.status == status
    err = (await r.json())["error"]
    assert err["code"] == status and err["message"] and "Traceback" not in err["message"]


@pytest.mark.usefixtures("http_layer")
def test_hostile_prompts_and_encodings_are_400s() -> None:
    import gzip

    async def main() -> None:
        async with fleet(1, tokens_per_block=4) as (svc, base, backends, s):
            for ids in ([1, 2**32], [2**64 - 1], [-1, 3], [[5, 2**40]]):
                async with s.post(base + "/v1/completions", json={"prompt": ids}) as r:
                    await _ok_error(r, 400)
            deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            async with s.post(base + "/v1/completions", data=deep) as r:
                await _ok_error(r, 400)
            deep_obj = b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b'{"a":' * 100_000 + b"1"
            deep_obj += b"}" * 100_000 + b"}"
            async with s.post(base + CHAT, data=deep_obj) as r:
                await _ok_error(r, 400)
            not_gzip = b'{"messages": [{"role": "user", "content": "x"}]}'
            async with s.post(base + CHAT, data=not_gzip, headers={"Content-Encoding": "gzip"}) as r:
                await _ok_error(r, 400)
            assert backends[0].requests == [] and svc.fleet.total_backlog() == 0
            # A valid gzip body is decoded here and forwarded decoded, without the label.
            body = b'{"messages": [{"role": "user", "content": "zipped"}]}'
            async with s.post(base + CHAT, data=gzip.compress(body), headers={"Content-Encoding": "gzip"}) as r:
                assert r.status == 200, await r.text()
            assert backends[0].requests[-1]["body"]["messages"][0]["content"] == "zipped"

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.usefixtures("http_layer")
def test_never_finished_bodies_are_dropped_after_the_deadline() -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, body_timeout_s=0.5) as (_, base, _b, s):
            host, port = base[len("http://") :].split(":")
            conns = []
            for _ in range(200):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n" + b'{"messages": ['
                )
                conns.append((reader, writer))
            await asyncio.sleep(0.1)

            async def outcome(reader) -> bytes:
                return await asyncio.wait_for(reader.read(), 5)  # to EOF: the router closed the connection

            answers = await asyncio.gather(*(outcome(r) for r, _ in conns))
            assert all(a.startswith(b"HTTP/1.1 408") for a in answers)
            for _, w in conns:
                w.close()
            async with s.get(base + "/metrics") as m:
                assert 'kvforge_router_requests_total{backend="",outcome="body_timeout"} 200.0' in await m.text()
            async with s.post(base + CHAT, json={"messages": [{"role": "user", "content": "fine"}]}) as r:
                assert r.status == 200

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.usefixtures("http_layer")
def test_routing_seconds_start_after_the_body_is_read() -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64) as (svc, base, _b, _s):
            host, port = base[len("http://") :].split(":")
            body = b'{"messages": [{"role": "user", "content": "slow"}]}'
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5]
            )
            await writer.drain()
            await asyncio.sleep(0.5)  # a slow client
            writer.write(body[5:])
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()
            samples = svc.metrics.routing_seconds.collect()[0].samples
            total = next(x.value for x in samples if x.name.endswith("_sum"))
            count = next(x.value for x in samples if x.name.endswith("_count"))
            assert count == 1 and total < 0.25, total

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.usefixtures("http_layer")
def test_routes_real_clients_call() -> None:
    async def main() -> None:
        async with fleet(2, tokens_per_block=4) as (_, base, backends, s):
            async with s.get(base + "/v1/models/fake") as r:  # client.models.retrieve("fake")
                assert r.status == 200 and (await r.json())["id"] == "fake"
            async with s.get(base + "/v1/models/org/some-model") as r:
                await _ok_error(r, 404)
            async with s.post(base + "/v1/embeddings", json={"model": "fake", "input": "hello there"}) as r:
                assert r.status == 200 and (await r.json())["data"][0]["object"] == "embedding"
            async with s.post(base + "/v1/embeddings", json={"model": "fake", "input": [[1, 2**33]]}) as r:
                await _ok_error(r, 400)
            seen = set()
            for turn in range(3):
                part = {"type": "input_text", "text": f"q{turn}"}
                body = {"model": "fake", "instructions": "be brief", "input": [{"role": "user", "content": [part]}]}
                async with s.post(base + "/v1/responses", json=body, headers={"X-Conversation-Id": "r1"}) as r:
                    assert r.status == 200
                    seen.add((await r.json())["backend"])
            assert len(seen) == 1  # a conversation sticks on /v1/responses too
            for bad in ({"input": 5}, {"input": []}, {"input": "x", "instructions": 3}, {"input": [7]}):
                async with s.post(base + "/v1/responses", json=bad) as r:
                    await _ok_error(r, 400)
            paths = [q.get("path") for b in backends for q in b.requests]
            assert paths.count("/v1/embeddings") == 1 and paths.count("/v1/responses") == 3

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.usefixtures("http_layer")
def test_a_big_prompt_is_tokenised_and_keyed_off_the_event_loop(tmp_path) -> None:
    import threading

    from kvforge.service.testing import build_tokenizer

    tok = build_tokenizer(tmp_path / "tokenizer.json")

    async def main() -> None:
        async with fleet(1, tokens_per_block=16, tokenizer=str(tok)) as (svc, base, _b, s):
            threads: list[str] = []
            keys_for_body = svc.keyer.keys_for_body

            def spy(path, body):
                threads.append(threading.current_thread().name)
                return keys_for_body(path, body)

            svc.keyer.keys_for_body = spy  # type: ignore[method-assign]
            main_thread = threading.current_thread().name
            small = {"messages": [{"role": "user", "content": "w1 w2"}]}
            big = {"messages": [{"role": "user", "content": " ".join(f"w{i % 500}" for i in range(40_000))}]}
            for body in (small, big):
                async with s.post(base + CHAT, json=body) as r:
                    assert r.status == 200
            assert threads[0] == main_thread and threads[1] != main_thread

    asyncio.run(asyncio.wait_for(main(), 60))


def test_kv_events_without_a_tokenizer_are_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        ServiceConfig(backends=["http://h:1"], kv_events=["tcp://h:5557"])
    ServiceConfig(backends=["http://h:1"], kv_events=["tcp://h:5557"], tokenizer="tokenizer.json")
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServiceConfig(backends=["http://h:1"], body_timeout_s=0)


def test_big_bodies_prepared_in_a_child_process_key_the_same(tmp_path) -> None:
    import msgspec

    from kvforge.service.proxy import _prepare_body, _prepare_in_child
    from kvforge.service.testing import build_tokenizer

    tok = build_tokenizer(tmp_path / "tokenizer.json")
    text = " ".join(f"w{(i * 13) % 500}" for i in range(80_000))
    plain = Keyer(16, tokenizer=tok)
    pooled = Keyer(16, tokenizer=tok)
    pooled.start_pool(1)
    try:
        msgs = [{"role": "user", "content": text}]
        for body, header in (({"messages": msgs}, "c1"), ({"messages": msgs, "conversation_id": "c2"}, None)):
            raw = msgspec.json.encode(body)
            want = _prepare_body(plain, CHAT, raw, header)
            changed, conv, keys, n = pooled.submit(_prepare_in_child, CHAT, raw, header).result()
            # The child's keys are this process's keys (same salt), the body comes back only when changed.
            assert (conv, keys, n) == want[1:] and len(keys) == n // 16 > 1000
            assert (changed is None) == ("conversation_id" not in body)
            assert (raw if changed is None else changed) == want[0]
        with pytest.raises(BadRequest, match="2\\*\\*32"):
            pooled.submit(_prepare_in_child, "/v1/completions", b'{"prompt": [1, 4294967296]}', None).result()
    finally:
        pooled.close()


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_seq_jump", 0), ("resync_after", True), ("max_message_bytes", 1.5), ("slice_blocks", -1),
     ("slice_s", float("nan")), ("slice_s", -0.5), ("log_interval_s", float("inf")), ("log_interval_s", "10")],
)  # fmt: skip
def test_kv_event_subscriber_refuses_bad_settings(name, value) -> None:
    from kvforge.service.kv_events import BlockMapper, KVEventSubscriber

    with pytest.raises(ValueError, match=name):
        KVEventSubscriber("tcp://127.0.0.1:1", lambda evs: None, BlockMapper(4), **{name: value})


def test_shared_state_writers_refuse_indices_outside_their_tables(tmp_path) -> None:
    from kvforge.service.shared_state import SharedState

    st = SharedState.create(2, str(tmp_path / "lock"), max_backends=4, conversations=64)
    try:
        for worker, slot in ((2, 0), (-1, 0), (0, 4), (0, -1)):
            with pytest.raises(ValueError, match="worker, slot"):
                st.add_load(worker, slot, 1, 10)
        key = st.conversation_key("c")
        for bad_slot in (4, -1):
            with pytest.raises(ValueError, match="slot"):
                st.claim(key, bad_slot)
        for bad_key in (0, 1 << 63, -(1 << 63) - 1):
            with pytest.raises(ValueError, match="key"):
                st.claim(bad_key, 0)
        assert st.load(0) == (0, 0) and st.owner(key) == -1  # nothing was written
        st.add_load(1, 3, 1, 10)
        assert st.claim(key, 3) == 3 and st.load(3) == (1, 10)
    finally:
        st.close()
