"""``kvforge router --workers N``: the shared-memory block, two worker fleets in one process, and the real
command with two workers in front of fake backends (stickiness, shared load, KV events in every worker, a
worker killed while the other keeps serving, a clean SIGTERM)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.__main__ import main as kvforge_main
from kvforge.service import keys as K
from kvforge.service.kv_events import KVEventPublisher
from kvforge.service.proxy import NoBackend, ServiceConfig
from kvforge.service.shared_state import PROBE, SharedState
from kvforge.service.testing import FakeBackend, build_tokenizer
from kvforge.service.workers import SharedFleet

ROOT = Path(__file__).resolve().parents[1]
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


@pytest.fixture
def state(tmp_path: Path):
    s = SharedState.create(2, str(tmp_path / "lock"), max_backends=8, conversations=1024)
    yield s
    s.close()


# ---------------------------------------------------------------- the shared block


def test_load_rows_are_summed_and_a_dead_workers_row_is_cleared(state: SharedState, tmp_path: Path) -> None:
    other = SharedState.attach(state.name, state.lock_path)
    try:
        a, b = state.backend_slot(URLS[0]), other.backend_slot(URLS[1])
        assert (a, b) == (0, 1) and other.backend_slot(URLS[0]) == 0 and state.backend_slot(URLS[1]) == 1
        state.add_load(0, a, 2, 300)
        other.add_load(1, a, 1, 50)
        other.add_load(1, b, 1, 7)
        assert state.load(a) == other.load(a) == (3, 350) and other.tokens(b) == 7
        state.clear_worker(1)  # the parent, after reaping worker 1
        assert other.load(a) == (2, 300) and other.load(b) == (0, 0) and state.worker_load(0, a) == (2, 300)
        with pytest.raises(ValueError, match="worker"):
            state.clear_worker(2)
    finally:
        other.close()
    assert Path(state.lock_path).exists()  # only the owner removes it


def test_bad_sizes_and_foreign_blocks_are_refused(tmp_path: Path) -> None:
    lock = str(tmp_path / "lock")
    for kw, match in (
        ({"workers": 0}, "workers"),
        ({"workers": 2, "conversations": 100}, "power of two"),
        ({"workers": 2, "conversations": 4}, "conversations"),
        ({"workers": 2, "max_backends": 0}, "max_backends"),
        ({"workers": True}, "workers"),
    ):
        with pytest.raises(ValueError, match=match):
            SharedState.create(lock_path=lock, **kw)
    from multiprocessing import shared_memory

    foreign = shared_memory.SharedMemory(create=True, size=4096)
    try:
        with pytest.raises(ValueError, match="not a kvforge router block"):
            SharedState.attach(foreign.name, lock)
    finally:
        foreign.close()
        foreign.unlink()


def test_backend_table_full_is_a_clear_error(tmp_path: Path) -> None:
    s = SharedState.create(1, str(tmp_path / "lock"), max_backends=2, conversations=8)
    try:
        s.backend_slot("http://a:1")
        s.backend_slot("http://b:1")
        with pytest.raises(ValueError, match="full"):
            s.backend_slot("http://c:1")
    finally:
        s.close()


def test_conversation_map_first_claim_wins_and_moves_need_the_expected_owner(state: SharedState) -> None:
    k = state.conversation_key("conv-a")
    assert k != 0 and state.owner(k) == -1
    assert state.claim(k, 2) == 2
    assert state.claim(k, 1) == 2  # another worker's late claim gets the first owner
    assert state.owner(k) == 2
    assert state.claim(k, 1, expect=0) == 2  # a move based on a stale view is refused
    assert state.claim(k, 1, expect=2) == 1 and state.owner(k) == 1
    assert state.stats()["moves"] == 1


def test_conversation_map_evicts_the_least_recently_used_of_a_window(state: SharedState) -> None:
    # Keys that share one home entry: the window holds PROBE of them; the next evicts the least recently used.
    home: dict[int, list[int]] = defaultdict(list)
    for i in range(20_000):
        k = state.conversation_key(f"c{i}")
        home[k & state._mask].append(k)
        if len(home[k & state._mask]) > PROBE:
            break
    keys = home[k & state._mask]
    for j, key in enumerate(keys[:PROBE]):
        assert state.claim(key, j % 3) == j % 3
    # Touch all but the second (refreshes are at most once a second, so set the clock through the block).
    w = state._w
    at = state._conv_at
    for i in range(state.conversations):
        if w[at + 4 * i] == keys[1]:
            w[at + 4 * i + 2] = 1  # the oldest use
    assert state.claim(keys[PROBE], 0) == 0
    assert state.owner(keys[1]) == -1  # forgotten: placed afresh on its next request
    assert all(state.owner(key) == j % 3 for j, key in enumerate(keys[:PROBE]) if j != 1)
    assert state.stats()["evictions"] == 1 and state.stats()["used"] == PROBE


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7), st.booleans()), max_size=200))
def test_random_map_operations_never_return_a_wrong_owner(ops: list[tuple[int, int, bool]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        s = SharedState.create(1, os.path.join(d, "lock"), max_backends=8, conversations=16)
        try:
            model: dict[int, int] = {}
            for conv, slot, move in ops:
                key = s.conversation_key(f"c{conv}")
                cur = s.owner(key)
                assert cur in (-1, model.get(key, -1))  # forgotten, or exactly the owner last claimed
                got = s.claim(key, slot, cur if move else -1)
                assert got == (slot if cur == -1 or move else cur)
                model[key] = got
                assert s.owner(key) == got  # a claim is readable at once
            assert s.stats()["used"] <= 16
        finally:
            s.close()


# ---------------------------------------------------------------- two worker fleets, one process


@functools.lru_cache(maxsize=1)
def _tokenizer() -> str:
    import tempfile

    return str(build_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json"))


def _fleets(state: SharedState, policy: str = "conversation", events: bool = False) -> list[SharedFleet]:
    eps = [f"tcp://127.0.0.1:{5000 + i}" for i in range(len(URLS))] if events else []
    tok = _tokenizer() if events else None  # (KV events are keyed by token ids: the service requires one)
    cfg = ServiceConfig(backends=URLS, policy=policy, tokens_per_block=16, kv_events=eps, tokenizer=tok)
    out = []
    for w in range(2):
        f = SharedFleet(cfg, None, state, w)
        for i, u in enumerate(URLS):
            f.add(u, eps[i] if eps else None)
        out.append(f)
    return out


def test_two_workers_agree_on_conversations_and_see_one_load(state: SharedState) -> None:
    fleets = _fleets(state)
    rng = random.Random(0)
    owner: dict[str, str] = {}
    live = []
    for n in range(300):
        conv = f"c{rng.randrange(60)}"
        f = fleets[n % 2]
        ep, b = f.place(n, [n], 100, conv)
        assert owner.setdefault(conv, b.url) == b.url
        live.append((f, ep, n))
        snaps = [dict((u, (load, k)) for u, load, k, _ in g.snapshot()) for g in fleets]
        assert snaps[0] == snaps[1]
        assert sum(k for _, k in snaps[0].values()) == len(live)
        if len(live) > 20:
            g, ep, rid = live.pop(rng.randrange(len(live)))
            g.finish(ep, rid, True)
    assert len(set(owner.values())) == 3  # new conversations spread over the backends
    for g, ep, rid in live:
        g.finish(ep, rid, False)
    assert all(load == 0 and k == 0 for f in fleets for _, load, k, _ in f.snapshot())


def test_anonymous_conversations_continue_across_workers(state: SharedState) -> None:
    fleets = _fleets(state)
    rng = random.Random(3)
    history = {c: [(c << 32) + i for i in range(6)] for c in range(30)}
    placed: dict[int, set[str]] = defaultdict(set)
    n = 0
    for _ in range(4):
        for c in range(30):
            history[c] += [(c << 32) + len(history[c]) + i for i in range(2)]  # the reply and the next question
            f = fleets[rng.randrange(2)]
            ep, b = f.place(n, history[c], 16 * len(history[c]), None)
            f.finish(ep, n, True)
            placed[c].add(b.url)
            n += 1
    assert all(len(bs) == 1 for bs in placed.values()), placed
    assert len({next(iter(bs)) for bs in placed.values()}) == 3
    # A prompt sharing less than the last 3/4 of a known one is new (placed by load, not followed).
    short = history[0][:4] + [(99 << 32) + i for i in range(8)]
    _, b = fleets[0].place("short", short, 16 * len(short), None)
    assert state.owner(state.block_key(short[-1])) == fleets[0]._slot_of[b.url]


def test_new_conversations_go_to_the_least_shared_load(state: SharedState) -> None:
    f0, f1 = _fleets(state, policy="least-load")
    _, b = f0.place("x", [], 10_000, None)  # a big request through worker 0
    seen = {f1.place(i, [], 10, None)[1].url for i in range(4)}
    assert b.url not in seen  # worker 1 sees worker 0's load and avoids that backend


def test_events_place_a_conversation_in_either_worker(state: SharedState) -> None:
    fleets = _fleets(state, events=True)
    prefix = [(7 << 40) + i for i in range(4)]
    for f in fleets:  # each worker's own subscriber applied the engine's BlockStored for backend 2
        f.backends[URLS[2]].mapper.present.update(dict.fromkeys(prefix, 1))  # type: ignore[union-attr]
    for n in range(10):
        _, b = fleets[n % 2].place(n, [*prefix, (8 << 40) + n], 80, f"conv-{n}")
        assert b.url == URLS[2]
    # Too little held (one block) is not followed.
    _, b = fleets[0].place("one", [prefix[0], 9 << 40], 32, None)
    assert b.url != URLS[2]  # the least loaded decides (URLS[2] carries the 10 requests above)


def test_a_huge_prompt_is_placed_in_bounded_time(state: SharedState) -> None:
    import time

    fleets = _fleets(state, events=True)
    keys = list(range(1, 300_001))  # a 16 MiB body's worth of blocks, every one held by every engine
    for f in fleets:
        for b in f.backends.values():
            b.mapper.present.update(dict.fromkeys(keys, 1))  # type: ignore[union-attr]
    t = time.perf_counter()
    ep, b = asyncio.run(fleets[0].place_off_loop("big", keys, 300_000 * 16, None))
    assert time.perf_counter() - t < 0.05
    fleets[0].finish(ep, "big", True)


def test_a_conversation_leaves_an_ejected_backend_once_for_every_worker(state: SharedState) -> None:
    f0, f1 = _fleets(state)
    _, b = f0.place(1, [], 10, "conv")
    f0.finish(f0._epoch, 1, True)  # type: ignore[arg-type]
    for f in (f0, f1):
        f.eject(f.backends[b.url], "test")
    _, moved = f1.place(2, [], 10, "conv")
    _, again = f0.place(3, [], 10, "conv")
    assert moved.url != b.url and again.url == moved.url
    for f in (f0, f1):
        for u in URLS:
            f.eject(f.backends[u], "test")
    with pytest.raises(NoBackend):
        f0.place(4, [], 10, "conv")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.sampled_from(["place", "finish", "eject", "back"]), st.integers(0, 1), st.integers(0, 30)),
        max_size=120,
    )
)
def test_random_operations_keep_the_shared_books(ops: list[tuple[str, int, int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        s = SharedState.create(2, os.path.join(d, "lock"), max_backends=8, conversations=64)
        try:
            fleets = _fleets(s)
            live: dict[int, tuple[SharedFleet, Any, str, int]] = {}
            owner: dict[str, str] = {}
            for n, (op, w, x) in enumerate(ops):
                f = fleets[w]
                if op == "place":
                    conv = f"c{x % 7}"
                    try:
                        ep, b = f.place(n, [x], 10 + x, conv)
                    except NoBackend:
                        assert not any(b.healthy for b in f.backends.values())
                        continue
                    # A conversation keeps its owner unless that owner is out of rotation for this worker.
                    prev = owner.get(conv)
                    if prev is not None and f.backends[prev].healthy:
                        assert b.url == prev
                    owner[conv] = b.url
                    live[n] = (f, ep, b.url, 10 + x)
                elif op == "finish" and live:
                    rid = sorted(live)[x % len(live)]
                    g, ep, _, _ = live.pop(rid)
                    g.finish(ep, rid, x % 2 == 0)
                elif op == "eject":
                    f.eject(f.backends[URLS[x % len(URLS)]], "test")
                elif op == "back":
                    f.set_health(f.backends[URLS[x % len(URLS)]], True)
                want: dict[str, list[int]] = {u: [0, 0] for u in URLS}
                for _, _, u, t in live.values():
                    want[u][0] += 1
                    want[u][1] += t
                for g in fleets:
                    assert {u: [k, int(load)] for u, load, k, _ in g.snapshot()} == want
        finally:
            s.close()


def test_membership_changes_keep_slots_and_a_full_table_refuses_cleanly(tmp_path: Path) -> None:
    s = SharedState.create(2, str(tmp_path / "lock"), max_backends=4, conversations=64)
    try:
        f0, f1 = _fleets(s)
        assert f0._slot_of == f1._slot_of  # every worker maps a URL to the same slot
        asyncio.run(f0.remove(URLS[1] + "/"))  # (normalised like every other URL)
        assert URLS[1] not in f0.backends and all(b.url != URLS[1] for b, _ in f0._in_rotation())
        f0.add("http://127.0.0.1:4")
        with pytest.raises(ValueError, match="full"):
            f0.add("http://127.0.0.1:5")
        assert "http://127.0.0.1:5" not in f0.backends
        f0.add(URLS[1])  # a URL seen before gets its old slot back
        assert f0._slot_of[URLS[1]] == f1._slot_of[URLS[1]]
    finally:
        s.close()


def test_policies_with_per_process_state_are_refused(state: SharedState) -> None:
    cfg = ServiceConfig(backends=URLS, policy="cache-aware")
    with pytest.raises(ValueError, match="cache-aware"):
        SharedFleet(cfg, None, state, 0)


def test_worker_admin_and_hostile_conversation_ids(state: SharedState) -> None:
    from aiohttp import web

    from kvforge.service.workers import WorkerService

    async def main() -> None:
        fakes = [FakeBackend(K.Keyer(16), name=f"b{i}", tokens_per_s=5000) for i in range(2)]
        for f in fakes:
            await f.start()
        svc = WorkerService(ServiceConfig(backends=[f.url for f in fakes], admin_token="tok"), state, 1)
        runner = web.AppRunner(svc.make_app(), access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        auth = {"Authorization": "Bearer tok"}
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/admin/shared", "/admin/backends"):
                    async with s.get(base + path) as r:
                        assert r.status == 401
                async with s.get(base + "/admin/shared", headers=auth) as r:
                    assert r.status == 200 and (await r.json())["worker"] == 1
                async with s.post(base + "/admin/backends", json={"url": "http://127.0.0.1:9"}, headers=auth) as r:
                    assert r.status == 409 and "backends-file" in (await r.json())["error"]["message"]
                async with s.delete(base + "/admin/backends?url=" + fakes[0].url, headers=auth) as r:
                    assert r.status == 409
                chat = "/v1/chat/completions"
                msgs = [{"role": "user", "content": "hi"}]
                # Ids the map must key without raising (control characters, the longest allowed, non-ASCII); a lone
                # surrogate is refused by the JSON decoder before it reaches the map.
                for conv, status in (("\x00\n\t", 200), ("x" * 512, 200), ("é" * 300, 200), ("\ud800", 400)):
                    body = json.dumps({"messages": msgs, "conversation_id": conv}, ensure_ascii=True)
                    async with s.post(base + chat, data=body, headers={"Content-Type": "application/json"}) as r:
                        assert r.status == status, (conv[:8], r.status, await r.text())
                async with s.post(base + chat, json={"messages": msgs}, headers={"X-Conversation-Id": "y" * 513}) as r:
                    assert r.status == 400
            assert all(load == 0 and k == 0 for _, load, k, _ in svc.fleet.snapshot())
            assert state.stats()["inserts"] == 3
        finally:
            await runner.cleanup()
            for f in fakes:
                await f.kill()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--workers", "0"], "--workers"),
        (["--workers", "100000"], "--workers"),
        (["--workers", "two"], "--workers"),
        (["--workers", "2", "--policy", "cache-aware"], "cache-aware"),
        (["--workers", "2", "--shared-conversations", "1000"], "--shared-conversations"),
        (["--workers", "2", "--shutdown-grace-s", "0"], "--shutdown-grace-s"),
        (["--workers", "2", "--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer"),
    ],
)
def test_bad_worker_flags_are_one_line_errors(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = kvforge_main(["router", "--backend", "http://h:1", *argv])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the command, end to end


class _Router:
    """``python -m kvforge router --workers 2`` as a user runs it; its log lines are collected."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.lines: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvforge", "router", "--workers", "2", "--port", "0", *self.args,
            cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self._reader = asyncio.get_running_loop().create_task(self._read())
        assert await self.wait_log("router listening", 30)
        self.port = next(x["port"] for x in self.lines if x.get("msg") == "router listening")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.lines.append({"msg": line.decode(errors="replace")})

    async def wait_log(self, msg: str, timeout: float, count: int = 1) -> bool:
        for _ in range(int(timeout / 0.05)):
            if sum(x.get("msg") == msg for x in self.lines) >= count:
                return True
            await asyncio.sleep(0.05)
        return False


async def _per_worker(s: aiohttp.ClientSession, url: str, workers: int = 2, tries: int = 400) -> dict[int, Any]:
    """GET ``url`` over fresh connections until every worker has answered (the kernel picks the worker)."""
    out: dict[int, Any] = {}
    for _ in range(tries):
        async with s.get(url) as r:
            body = await r.json()
        w = body[0]["worker"] if isinstance(body, list) else body["worker"]
        out[w] = body
        if len(out) == workers:
            return out
    raise AssertionError(f"only workers {sorted(out)} answered {url}")


def _chat(text: str, tokens: int = 2, stream: bool = True) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "stream": stream, "max_tokens": tokens}


async def _post(s: aiohttp.ClientSession, base: str, body: dict[str, Any], conv: str | None) -> dict[str, Any]:
    headers = {"X-Conversation-Id": conv} if conv else {}
    try:
        async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            text = (await r.read()).decode()
            first = text.split("\n\n", 1)[0]
            backend = json.loads(first[6:])["backend"] if first.startswith("data: {") else None
            return {"status": r.status, "backend": backend, "done": text.rstrip().endswith("[DONE]")}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"status": None, "backend": None, "done": False, "error": type(exc).__name__}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(512)}" for _ in range(n))


def test_two_workers_end_to_end(tmp_path: Path) -> None:
    async def main() -> None:
        tok = build_tokenizer(tmp_path / "tokenizer.json")
        keyer = K.Keyer(16, tokenizer=tok)
        pubs = [KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
        fakes = [
            FakeBackend(keyer, publisher=p, engine_block_size=16, name=f"b{i}", tokens_per_s=2000)
            for i, p in enumerate(pubs)
        ]
        for f in fakes:
            await f.start()
        args = ["--tokenizer", str(tok), "--tokens-per-block", "16", "--health-interval-s", "0.5",
                "--log-level", "info", "--shutdown-grace-s", "5"]  # fmt: skip
        for f, p in zip(fakes, pubs):
            args += ["--backend", f.url, "--kv-events", p.endpoint, "--kv-replay", str(p.replay_endpoint)]
        router = _Router(args)
        fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=20)
        )
        try:
            await router.start()
            base = f"http://127.0.0.1:{router.port}"
            assert await router.wait_log("worker listening", 30, count=2)
            shared = await _per_worker(fresh, base + "/admin/shared")
            pids = {w: b["pid"] for w, b in shared.items()}
            shm = Path("/dev/shm") / shared[0]["name"].lstrip("/")
            rng = random.Random(7)

            # ---- KV events reach every worker: backend 1 computes a prompt (as an engine would for another
            # client); both workers learn it from its events and send new conversations with it there.
            prefix = _words(rng, 80)
            async with fresh.post(fakes[1].url + "/v1/chat/completions", json=_chat(prefix, stream=False)) as r:
                assert r.status == 200
            for _ in range(200):  # (late subscribers catch up through the replay socket)
                for p in pubs:
                    p.publish([])
                views = await _per_worker(fresh, base + "/admin/backends")
                if all(v[1]["cached_blocks"] >= 4 for v in views.values()):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"events not applied in every worker: {views}")
            for i in range(24):
                r = await _post(fresh, base, _chat(prefix + " " + _words(rng, 20)), f"ev-{i}")
                assert r["status"] == 200 and r["done"] and r["backend"] == "b1", r
            views = await _per_worker(fresh, base + "/admin/backends")
            assert all(v[1]["placed_by_worker"] >= 1 for v in views.values()), views  # both workers placed some

            # ---- Stickiness across workers: every request on a fresh connection (a worker at random).
            placed: dict[str, set[str]] = defaultdict(set)
            history = {c: _words(rng, 40) for c in range(40)}
            before = {w: sum(b["placed_by_worker"] for b in v) for w, v in views.items()}
            for _ in range(3):
                for c in range(40):
                    history[c] += " " + _words(rng, 8)
                    r = await _post(fresh, base, _chat(history[c]), f"conv-{c}")
                    assert r["status"] == 200 and r["done"], r
                    placed[f"conv-{c}"].add(r["backend"])
            # Anonymous conversations (no id) continue through the map's block keys (and the engines' events).
            anon = {c: _words(rng, 60) for c in range(10)}
            for _ in range(3):
                for c in range(10):
                    anon[c] += " " + _words(rng, 20)
                    r = await _post(fresh, base, _chat(anon[c]), None)
                    assert r["status"] == 200 and r["done"], r
                    placed[f"anon-{c}"].add(r["backend"])
            assert all(len(bs) == 1 for bs in placed.values()), placed
            split = defaultdict(int)
            for bs in placed.values():
                split[next(iter(bs))] += 1
            assert min(split.values()) >= 12, split  # and new conversations spread over both backends
            views = await _per_worker(fresh, base + "/admin/backends")
            by_worker = {w: sum(b["placed_by_worker"] for b in v) - before[w] for w, v in views.items()}
            assert sum(by_worker.values()) == 150 and min(by_worker.values()) >= 25, by_worker

            # ---- Shared load: slow streams through both workers; each worker reports all of them.
            for f in fakes:
                f.tokens_per_s = 6.0
            slow = [asyncio.create_task(_post(fresh, base, _chat(_words(rng, 30), tokens=12), f"slow-{i}"))
                    for i in range(10)]  # fmt: skip
            for _ in range(100):
                views = await _per_worker(fresh, base + "/admin/backends")
                if all(sum(b["in_flight"] for b in v) == 10 for v in views.values()):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"shared load not seen by both workers: {views}")
            assert all(sum(b["backlog_tokens"] for b in v) > 0 for v in views.values())

            # ---- One worker killed mid-stream: its row is cleared, the other keeps serving and sticking.
            os.kill(pids[0], signal.SIGKILL)
            assert await router.wait_log("router worker exited; not restarted", 10)
            for f in fakes:
                f.tokens_per_s = 2000.0
            results = await asyncio.gather(*slow)
            assert any(r["status"] is None or not r["done"] for r in results)  # some went through worker 0
            assert any(r["done"] for r in results)  # and some through worker 1, which finished them
            for _ in range(100):
                views = await _per_worker(fresh, base + "/admin/backends", workers=1)
                if sum(b["in_flight"] for b in views[1]) == 0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the killed worker's load leaked: {views}")
            for c in range(40):
                r = await _post(fresh, base, _chat(history[c] + " w1"), f"conv-{c}")
                assert r["status"] == 200 and r["done"] and {r["backend"]} == placed[f"conv-{c}"], r

            # ---- SIGTERM: the parent stops the survivor, reaps it, removes the block and exits 0.
            assert router.proc is not None
            router.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(router.proc.wait(), 15) == 0
            for pid in pids.values():
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)

            def group_left(pid: int) -> bool:
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    return False
                return True

            # Nothing a worker started (a tokenizer pool) is left; killed orphans may take init a moment to reap.
            for _ in range(100):
                if not any(group_left(pid) for pid in pids.values()):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"a worker's process group outlived the router: {pids}")
            assert not shm.exists()
        finally:
            await fresh.close()
            if router.proc is not None and router.proc.returncode is None:
                router.proc.kill()
                await router.proc.wait()
            for f in fakes:
                await f.kill()
            for p in pubs:
                p.close()

    asyncio.run(asyncio.wait_for(main(), 90))


@pytest.mark.parametrize("http", ["fast", "aiohttp"])
def test_a_worker_sets_the_process_up_as_the_single_process_does(
    state: SharedState, http: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: workers of ``--workers N`` skipped gc.freeze() and the 1 ms switch interval. Both paths now
    serve through kvforge.service.server.serve, which runs setup_process once the service is built."""
    import argparse
    import gc
    import threading

    from kvforge.service import fasthttp, server, workers
    from kvforge.service.cli import add_arguments

    real_setup = server.setup_process
    calls: list[str] = []
    monkeypatch.setattr(server, "setup_process", lambda: calls.append("setup"))
    monkeypatch.setattr(fasthttp, "run", lambda *a, **k: calls.append("fast"))
    monkeypatch.setattr(server.web, "run_app", lambda *a, **k: calls.append("aiohttp"))
    monkeypatch.setattr(workers.os, "setpgid", lambda *a: None)  # (not this test process's group)
    monkeypatch.setattr("kvforge.service.metrics.configure_logging", lambda *a: None)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--backend", "http://127.0.0.1:9", "--http", http, "--policy", "least-load"])
    workers._worker_main(args, state.name, str(tmp_path / "lock"), 0, os.getpid(), threading.Event())
    assert calls == ["setup", http]
    # ... and what setup_process does, in this process (undone after).
    old = sys.getswitchinterval()
    try:
        real_setup()
        assert sys.getswitchinterval() == pytest.approx(0.001) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        sys.setswitchinterval(old)
