"""Hostile input to ``kvforge serve``: every route answers bad requests with an OpenAI-shaped 4xx JSON error
(never a traceback, never an engine request), a client that disconnects aborts its request (slot and pages
freed), a failing engine step is a 500 and the server keeps serving, the published KV events decode as vLLM's
format with the stored blocks' tokens, and every command-line flag answers a bad value with one line and exit
status 2. The server runs in-process (aiohttp on a free port, the engine loop in its thread, tiny model)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
zmq = pytest.importorskip("zmq")

from aiohttp import web  # noqa: E402

from kvforge.__main__ import main as kvforge_main  # noqa: E402
from kvforge.engine import Engine, EngineConfig, HybridModel, tiny  # noqa: E402
from kvforge.serve.app import ServeApp, ServeSettings  # noqa: E402
from kvforge.serve.cli import add_arguments  # noqa: E402
from kvforge.serve.loop import EngineLoop  # noqa: E402
from kvforge.service.kv_events import AllBlocksCleared, BlockStored, KVEventPublisher, decode_batch  # noqa: E402
from kvforge.service.testing import build_tokenizer  # noqa: E402

TPB = 16
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 200)
    model = HybridModel(tiny(vocab_size=204, draft_layers=0))
    eng = Engine(model, EngineConfig(attention_pages=40, draft_pages=40, state_pages=24, max_num_requests=4))
    eng.generate({"warm": [1, 2, 3]}, 2)
    eng.outputs.clear()
    eng.finished.clear()
    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub_ctx = zmq.Context()
    sub = sub_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.2)  # the SUB joins before the first batch
    loop = EngineLoop(eng, pub)
    loop.start()
    app = ServeApp(loop, ServeSettings(model_name="tiny", tokenizer=str(tok), max_body_bytes=4096, instance="s0"))
    yield loop, app, sub
    loop.stop()
    sub.close(0)
    sub_ctx.term()


@contextlib.asynccontextmanager
async def _server(app: ServeApp):
    runner = web.AppRunner(app.make_app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as s:
        yield f"http://127.0.0.1:{port}", s
    await runner.cleanup()


def _run(app: ServeApp, fn) -> None:
    async def main() -> None:
        async with _server(app) as (base, s):
            await fn(base, s)

    asyncio.run(main())


def _idle(loop: EngineLoop, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while loop.num_live or loop.engine.scheduler.has_unfinished:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)
    eng = loop.engine
    assert eng.num_free_slots == eng.config.max_num_requests
    for g in range(eng.manager.num_groups):
        assert eng.manager.num_available_pages(g) == eng.manager.pool(g).capacity


OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
BAD = [
    (COMP, b"{not json", 400, "body"),
    (COMP, b"\xff\xfe\x00", 400, "body"),
    (COMP, b"[1, 2]", 400, "body"),
    (COMP, b'"text"', 400, "body"),
    (COMP, b"{}", 400, "prompt"),
    (COMP, b'{"prompt": 5}', 400, "prompt"),
    (COMP, b'{"prompt": []}', 400, "prompt"),
    (COMP, b'{"prompt": ""}', 400, "prompt"),
    (COMP, b'{"prompt": [1, -2]}', 400, "prompt"),
    (COMP, b'{"prompt": [1, 204]}', 400, "prompt"),
    (COMP, b'{"prompt": [1, 99999999999999999999999]}', 400, "prompt"),
    (COMP, b'{"prompt": [1, "a"]}', 400, "prompt"),
    (COMP, b'{"prompt": [1.5]}', 400, "prompt"),
    (COMP, b'{"prompt": [true]}', 400, "prompt"),
    (COMP, b'{"prompt": [[1], [2]]}', 400, "prompt"),
    (COMP, b'{"prompt": ["a", "b"]}', 400, "prompt"),
    (COMP, b'{"prompt": [null]}', 400, "prompt"),
    (COMP, b'{"prompt": [1], "max_tokens": 0}', 400, "max_tokens"),
    (COMP, b'{"prompt": [1], "max_tokens": -1}', 400, "max_tokens"),
    (COMP, b'{"prompt": [1], "max_tokens": "3"}', 400, "max_tokens"),
    (COMP, b'{"prompt": [1], "max_tokens": 2.5}', 400, "max_tokens"),
    (COMP, b'{"prompt": [1], "max_tokens": true}', 400, "max_tokens"),
    (COMP, b'{"prompt": [1], "max_tokens": 100000}', 400, "tokens"),
    (COMP, b'{"prompt": [1], "max_completion_tokens": 0}', 400, "max_completion_tokens"),
    (COMP, b'{"prompt": [1], "n": 2}', 400, "n"),
    (COMP, b'{"prompt": [1], "best_of": 3}', 400, "best_of"),
    (COMP, b'{"prompt": [1], "temperature": "hot"}', 400, "temperature"),
    (COMP, b'{"prompt": [1], "temperature": -1}', 400, "temperature"),
    (COMP, b'{"prompt": [1], "top_p": NaN}', 400, "body"),
    (COMP, b'{"prompt": [1], "presence_penalty": "x"}', 400, "presence_penalty"),
    (COMP, b'{"prompt": [1], "stop": ["x"]}', 400, "stop"),
    (COMP, b'{"prompt": [1], "suffix": "x"}', 400, "suffix"),
    (COMP, b'{"prompt": [1], "logprobs": 2}', 400, "logprobs"),
    (COMP, b'{"prompt": [1], "echo": true}', 400, "echo"),
    (COMP, b'{"prompt": [1], "echo": "yes"}', 400, "echo"),
    (COMP, b'{"prompt": [1], "stream": "yes"}', 400, "stream"),
    (COMP, b'{"prompt": [1], "stream": true, "stream_options": 3}', 400, "stream_options"),
    (COMP, b'{"prompt": [1], "stream_options": {"include_usage": "y"}}', 400, "include_usage"),
    (COMP, b'{"prompt": [1], "model": 5}', 400, "model"),
    (COMP, b'{"prompt": [1], "model": "gpt-4"}', 404, "model"),
    (COMP, b'{"prompt": [' + b"1," * 700 + b"1]}", 400, "never fit"),
    (CHAT, b"{}", 400, "messages"),
    (CHAT, b'{"messages": "hi"}', 400, "messages"),
    (CHAT, b'{"messages": []}', 400, "messages"),
    (CHAT, b'{"messages": [5]}', 400, "messages"),
    (CHAT, b'{"messages": [{"content": "x"}]}', 400, "role"),
    (CHAT, b'{"messages": [{"role": 7, "content": "x"}]}', 400, "role"),
    (CHAT, b'{"messages": [{"role": "user", "content": 7}]}', 400, "content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}', 400, "text"),
    (CHAT, b'{"messages": [{"role": "user", "content": [7]}]}', 400, "content"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 400, "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": "other"}', 404, "model"),
]


def test_bad_bodies_get_openai_shaped_4xx_and_reach_no_engine(served):
    loop, app, _ = served
    added = loop.stats.requests_added

    async def fn(base, s):
        for path, raw, status, needle in BAD:
            async with s.post(base + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                body = await r.json()
                assert r.status == status, (raw[:80], body)
                err = body["error"]
                assert err["code"] == status and err["type"], raw[:80]
                assert needle in err["message"] or needle == err["param"], (raw[:80], err)
                assert "Traceback" not in err["message"]
        async with s.post(base + COMP, data=b'{"prompt": "' + b"w1 " * 2000 + b'"}') as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == 413
        async with s.get(base + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == 404
        async with s.get(base + COMP) as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == 405
        async with s.post(base + "/v1/models") as r:
            assert r.status == 405
        async with s.post(base + "/health") as r:
            assert r.status == 405
        async with s.post(base + CHAT, json=OK_CHAT) as r:  # still serving
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2

    _run(app, fn)
    # Only the one good request (and the never-fit one, refused by add_request) reached the engine.
    assert loop.stats.requests_added == added + 1
    _idle(loop)


def test_text_without_a_tokenizer_is_refused(served):
    loop, _, _ = served
    bare = ServeApp(loop, ServeSettings(model_name="tiny"))

    async def fn(base, s):
        async with s.post(base + COMP, json={"prompt": "w1 w2"}) as r:
            assert r.status == 400 and "tokenizer" in (await r.json())["error"]["message"]
        async with s.post(base + CHAT, json=OK_CHAT) as r:
            assert r.status == 400 and "tokenizer" in (await r.json())["error"]["message"]
        async with s.post(base + COMP, json={"prompt": [5, 6, 7], "max_tokens": 3}) as r:
            body = await r.json()
            assert r.status == 200 and len(body["choices"][0]["token_ids"]) == 3

    _run(bare, fn)
    _idle(loop)


def test_a_stream_ends_with_the_engines_own_ttft(served):
    """The SSE comment ``: kvforge {"ttft_s": ...}`` comes after the last data chunk and before ``[DONE]``, and
    its time to first token is within what the client saw."""
    loop, app, _ = served

    async def fn(base, s):
        body = {"prompt": list(range(1, 20)), "max_tokens": 3, "stream": True}
        sent = time.perf_counter()
        first = None
        async with s.post(base + COMP, json=body) as r:
            assert r.status == 200
            lines = []
            async for line in r.content:
                if line.startswith(b"data: {") and first is None:
                    first = time.perf_counter()
                if line.strip():
                    lines.append(line.strip())
        comments = [x for x in lines if x.startswith(b": kvforge ")]
        assert len(comments) == 1 and lines[-1] == b"data: [DONE]" and lines[-2] == comments[0]
        ttft = json.loads(comments[0][len(b": kvforge ") :])["ttft_s"]
        assert first is not None and 0 < ttft <= first - sent

    _run(app, fn)
    _idle(loop)


def test_step_log_has_one_line_per_step_with_the_batch():
    import io

    eng = Engine(HybridModel(tiny(draft_layers=0)), EngineConfig(attention_pages=24, state_pages=8, max_num_requests=2))
    log = io.StringIO()
    loop = EngineLoop(eng, None, step_log=log)
    loop.start()

    async def run() -> None:
        q = loop.submit("r", list(range(1, 21)), 3)
        while (await q.get())[0] != "done":
            pass

    try:
        asyncio.run(run())
        lines = [json.loads(x) for x in log.getvalue().splitlines()]
    finally:
        loop.stop()
    assert len(lines) == loop.stats.steps >= 3
    assert lines[0]["prefill"] == [[0, 20]] and lines[0]["decode_requests"] == 0
    assert lines[-1]["decode_requests"] == 1 and lines[-1]["prefill"] == []
    assert all(x["t0"] <= x["t1"] for x in lines) and all(a["t1"] <= b["t0"] for a, b in itertools.pairwise(lines))


def test_a_client_that_disconnects_aborts_its_request(served):
    loop, app, _ = served
    aborted = loop.stats.requests_aborted

    async def fn(base, s):
        body = {"prompt": list(range(1, 40)), "max_tokens": 300, "stream": True}
        async with s.post(base + COMP, json=body) as r:
            assert r.status == 200
            line = await r.content.readline()
            assert line.startswith(b"data: ")
            # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 20
        while loop.stats.requests_aborted == aborted:
            assert time.monotonic() < deadline, "the disconnect did not abort the request"
            await asyncio.sleep(0.05)

    _run(app, fn)
    _idle(loop)


def test_a_failing_step_is_a_500_and_the_server_goes_on(served, monkeypatch):
    loop, app, _ = served
    real_step = loop.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(loop.engine, "step", flaky)

    async def fn(base, s):
        async with s.post(base + CHAT, json=OK_CHAT) as r:
            body = await r.json()
            assert r.status == 500 and body["error"]["type"] == "server_error"
            assert "Traceback" not in body["error"]["message"]
        async with s.get(base + "/health") as r:
            assert r.status == 200
        async with s.post(base + CHAT, json=OK_CHAT) as r:
            assert r.status == 200

    _run(app, fn)
    _idle(loop)


def test_kv_events_carry_the_stored_blocks_tokens(served):
    loop, app, sub = served
    prompt = [(7 * i) % 200 + 1 for i in range(3 * TPB + 5)]

    async def fn(base, s):
        async with s.post(base + COMP, json={"prompt": prompt, "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.get(base + "/metrics") as r:
            text = await r.text()
            assert "kvforge_serve_prefix_hit_tokens_total" in text and "kvforge_serve_kv_event_batches_total" in text

    _run(app, fn)
    stored: list[int] = []
    deadline = time.monotonic() + 5
    seen_cleared = False
    while time.monotonic() < deadline and len(stored) < 3 * TPB:
        if not sub.poll(100):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        for ev in decode_batch(payload).events:
            if isinstance(ev, AllBlocksCleared):
                seen_cleared = True
            if isinstance(ev, BlockStored) and ev.token_ids[:TPB] == prompt[:TPB]:
                assert ev.block_size == TPB and ev.parent_block_hash is None
                stored = ev.token_ids
    assert stored[: 3 * TPB] == prompt[: 3 * TPB]
    assert seen_cleared or loop.stats.event_batches > 1
    # The replay socket answers from sequence 0: the first batch is AllBlocksCleared.
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(loop.publisher.replay_endpoint)
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    assert d.poll(5000)
    frames = d.recv_multipart()
    assert int.from_bytes(frames[2], "big") == 0
    assert isinstance(decode_batch(frames[3]).events[0], AllBlocksCleared)
    d.close(0)
    ctx.term()
    _idle(loop)


# ---------------------------------------------------------------- the command line


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = kvforge_main(["serve", *argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    return rc, err


BAD_FLAGS = {
    "--model": ["huge", ""],
    "--planted": ["0", "64", "x", "-1"],
    "--seed": ["-1", "x"],
    "--vocab-size": ["1", "x", "1e3"],
    "--served-model-name": ["", "a b", "x\x01"],
    "--device": ["tpu", "cuda:x", ""],
    "--draft-len": ["2", "-1", "x"],
    "--tokenizer": ["/nonexistent/tokenizer.json"],
    "--tokens-per-block": ["0", "-3", "x", "1.5"],
    "--attention-pages": ["0", "x"],
    "--draft-pages": ["0", "x"],
    "--state-pages": ["0", "x"],
    "--max-num-tokens": ["0", "x"],
    "--max-num-requests": ["0", "x"],
    "--max-blocks-per-request": ["0", "x"],
    "--snapshot-interval": ["-1", "x"],
    "--kv-events-endpoint": ["udp://x", "localhost:5557", ""],
    "--kv-replay-endpoint": ["udp://x"],
    "--kv-topic": [],
    "--kv-buffer-steps": ["0", "x"],
    "--host": [],
    "--port": ["-1", "65536", "x"],
    "--max-tokens-default": ["0", "x"],
    "--max-body-bytes": ["0", "x"],
    "--instance-name": ["", "a b"],
    "--log-level": ["loud"],
    "--log-format": ["xml"],
    "--step-log": ["/nonexistent-folder/steps.jsonl"],
}
# Flags whose every value is valid at parse time (a string, or a switch): covered by the cases below.
FREE = {"--kv-topic", "--host", "--no-reuse", "--context-16bit", "--no-warmup", "--help"}


@pytest.mark.parametrize(("flag", "value"), [(f, v) for f, vs in BAD_FLAGS.items() for v in vs])
def test_bad_flag_values_are_one_line_exit_2(flag, value, capsys):
    argv = [flag, value]
    if flag == "--kv-replay-endpoint":
        argv += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
    rc, err = _cli(argv, capsys)
    assert rc == 2, (flag, value, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvforge serve: error:"), err
    assert flag in err or flag.lstrip("-").replace("-", "_") in err or "tokenizer" in err, err
    assert "Traceback" not in err


def test_every_flag_has_a_bad_value_case():
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings if s.startswith("--")}
    assert flags - set(BAD_FLAGS) - FREE == set()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-replay-endpoint", "tcp://127.0.0.1:0"], "--kv-replay-endpoint"),
        (["--device", "cuda"], "--device"),
    ],
)
def test_bad_combinations_are_one_line_exit_2(argv, needle, capsys):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    rc, err = _cli([*argv, "--no-warmup"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_tokenizer_vocab_larger_than_the_model_is_refused(tmp_path: Path, capsys):
    tok = build_tokenizer(tmp_path / "t.json", 300)
    rc, err = _cli(["--tokenizer", str(tok), "--vocab-size", "256", "--no-warmup"], capsys)
    assert rc == 2 and "--vocab-size" in err, err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    rc, err = _cli(["--tokenizer", str(bad)], capsys)
    assert rc == 2 and "--tokenizer" in err and len(err.strip().splitlines()) == 1, err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        kvforge_main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    p = argparse.ArgumentParser()
    add_arguments(p)
    for a in p._actions:
        for s in a.option_strings:
            if s.startswith("--"):
                assert s in out
                assert a.help, s


def test_evictions_are_published_as_block_removed():
    # A cache of 12 attention pages: distinct 3-block prompts evict earlier blocks, which the subscriber must hear.
    from kvforge.service.kv_events import BlockRemoved

    eng = Engine(HybridModel(tiny(draft_layers=0)), EngineConfig(attention_pages=12, state_pages=8, max_num_requests=2))
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.2)
    loop = EngineLoop(eng, pub)
    loop.start()

    async def main() -> None:
        for i in range(8):
            q = loop.submit(i, [(i * 31 + j) % 250 + 1 for j in range(3 * TPB)], 1)
            while (await q.get())[0] != "done":
                pass

    try:
        asyncio.run(main())
        kinds: dict[str, int] = {}
        stored: set = set()
        removed: set = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not removed:
            if sub.poll(100):
                for ev in decode_batch(sub.recv_multipart()[2]).events:
                    kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
                    if isinstance(ev, BlockStored):
                        stored.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        removed.update(ev.block_hashes)
        assert removed and removed <= stored, kinds  # every removed block was announced as stored first
        assert loop.stats.unmapped_blocks == 0
    finally:
        loop.stop()
        sub.close(0)
        ctx.term()
