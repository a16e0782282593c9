"""The router service end to end: fake OpenAI backends (streaming at a set rate, publishing KV events over
ZMQ on loopback) behind the proxy, driven by a prefix of the Mooncake trace or a seeded synthetic workload."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import pytest

from kvforge.service import keys as K
from kvforge.service.keys import Keyer
from kvforge.service.testing import build_tokenizer
from tests.service_harness import fleet, load_trace, post_chat, trace_body, trace_path, wait_for


def run(coro, timeout: float = 25.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _conversations(n_conv: int, turns: int, seed: int) -> list[tuple[str, int, str]]:
    """(conversation, turn, prompt) interleaved across conversations; each turn extends the previous prompt."""
    rng = random.Random(seed)
    prompts = {c: "".join(rng.choice("abcdefgh ") for _ in range(3000)) for c in range(n_conv)}
    out = []
    for t in range(turns):
        for c in range(n_conv):
            prompts[c] += "".join(rng.choice("abcdefgh ") for _ in range(300))
            out.append((f"conv-{c}", t, prompts[c]))
    return out


@pytest.mark.parametrize("policy", K.POLICIES)
def test_conversations_stick_as_the_policy_promises(policy: str) -> None:
    async def main() -> None:
        async with fleet(3, policy=policy, tokens_per_block=64, backend_kw={"tokens_per_s": 4000}) as (svc, base, _, s):
            placed: dict[str, list[str]] = defaultdict(list)
            for conv, turn, prompt in _conversations(6, 4, seed=1):
                explicit = conv in ("conv-0", "conv-1", "conv-2")  # the others are matched by prefix
                body = {"messages": [{"role": "user", "content": prompt}], "stream": turn % 2 == 0, "max_tokens": 3}
                r = await post_chat(s, base, body, conv if explicit else None)
                assert r["done"] and r["status"] == 200, r
                placed[conv].append(r["backend"])
            counts = defaultdict(int)
            for b in (b for bs in placed.values() for b in bs):
                counts[b] += 1
            if policy in ("conversation", "conversation-always", "cache-aware"):
                assert all(len(set(bs)) == 1 for bs in placed.values()), placed
                assert len({bs[0] for bs in placed.values()}) > 1  # and not all on one backend
            if policy == "round-robin":
                assert max(counts.values()) - min(counts.values()) <= 1
            assert svc.fleet.total_backlog() == 0

    run(main())


@pytest.mark.skipif(trace_path() is None, reason="Mooncake trace absent (../shared/data)")
def test_trace_replay_hit_rate_equals_in_process_replay() -> None:
    rows = load_trace(60)

    async def main() -> tuple[float, list[str]]:
        async with fleet(3, policy="conversation", backend_kw={"tokens_per_s": 20000}) as (svc, base, backends, s):
            names = []
            for row in rows:
                r = await post_chat(s, base, trace_body(row, stream=True, max_tokens=2))
                assert r["done"], r
                names.append(r["backend"])
            assert svc.fleet.total_backlog() == 0
            hit = sum(b.hit_tokens for b in backends) / sum(b.prompt_tokens for b in backends)
            return hit, names

    hit_proxy, names = run(main())
    # The same requests through an in-process router, finished as they complete, and the same ideal caches.
    keyer = Keyer(512)
    router = K.make_router(
        "conversation", ["b0", "b1", "b2"], tokens_per_block=512, chars_per_token=4.0, use_cache_events=False,
        request_ttl_s=None,
    )  # fmt: skip
    caches: dict[str, set] = defaultdict(set)
    hit = total = 0
    in_proc = []
    for i, row in enumerate(rows):
        keys, n = keyer.keys_for_body("/v1/chat/completions", trace_body(row))
        b = K.route(router, i, keys, n, None)
        K.finish(router, i, True)
        in_proc.append(b)
        k = 0
        while k < len(keys) and keys[k] in caches[b]:
            k += 1
        caches[b].update(keys)
        hit += min(k * 512, n)
        total += n
    assert hit_proxy == pytest.approx(hit / total, abs=1e-12)
    assert hit > 0  # the trace's prefix reuse is visible at all
    # Same grouping of requests onto backends (backend names may be permuted by the server order).
    assert len(set(zip(names, in_proc))) == len(set(in_proc))


@pytest.mark.usefixtures("http_layer")
def test_killing_a_backend_mid_run_loses_no_request_that_had_not_started() -> None:
    async def main() -> None:
        kw = {"tokens_per_s": 200, "tokens_per_chunk": 2, "max_output_tokens": 10}
        async with fleet(
            3, policy="conversation", tokens_per_block=64, backend_kw=kw, max_retries=2, health_interval_s=30.0
        ) as (svc, base, backends, s):  # fmt: skip
            work = _conversations(10, 3, seed=2)
            sem = asyncio.Semaphore(12)

            async def one(conv: str, prompt: str) -> dict:
                async with sem:
                    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 10}
                    return await post_chat(s, base, body, conv)

            tasks = [asyncio.create_task(one(c, p)) for c, _, p in work]
            await asyncio.sleep(0.12)
            victim = backends[1]
            await victim.kill()
            results = await asyncio.gather(*tasks)
            failed = [r for r in results if not r["done"]]
            # Only requests whose response had started on the victim may fail; every other one completed.
            assert all(r["started"] and r["status"] == 200 for r in failed), failed
            assert len(failed) < len(results)
            assert not svc.fleet.backends[victim.url].healthy
            # Conversations move: the next turn of every conversation lands on a live backend.
            for c in range(10):
                r = await post_chat(
                    s, base, {"messages": [{"role": "user", "content": work[c][2] + "x"}], "stream": True}, f"conv-{c}"
                )
                assert r["done"] and r["backend"] != victim.name
            assert await wait_for(lambda: svc.fleet.total_backlog() == 0)
            assert all(n == 0 for _, _, n, _ in svc.fleet.snapshot())
            # A backend that dies while idle is found by the next request sent to it (health checks are 30 s
            # apart here): that request is retried elsewhere and completes.
            last = {}
            for c in range(10):
                r = await post_chat(
                    s, base, {"messages": [{"role": "user", "content": work[c][2] + "x"}], "stream": True}, f"conv-{c}"
                )
                last[c] = r["backend"]
            second = next(b for b in backends if b is not victim and b.name in last.values())
            await second.kill()
            for c in range(10):
                r = await post_chat(
                    s, base, {"messages": [{"role": "user", "content": work[c][2] + "xy"}], "stream": True}, f"conv-{c}"
                )
                assert r["done"] and r["backend"] not in (victim.name, second.name)
            retried = sum(
                x.value for m in svc.metrics.retries.collect() for x in m.samples if x.name.endswith("_total")
            )
            assert retried >= 1  # the first request sent to the silently dead backend moved
            assert await wait_for(lambda: svc.fleet.total_backlog() == 0)

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_a_slow_backend_answers_504_and_stays_in_rotation() -> None:
    # Issue 31: silence past --read-timeout-s (a long prefill) ejected the backend and every retry target.
    async def main() -> None:
        async with fleet(2, policy="round-robin", tokens_per_block=64, read_timeout_s=0.3, health_interval_s=0.1) as (
            svc, base, backends, s,
        ):  # fmt: skip
            for b in backends:
                b.hang = True  # both compute for longer than the read timeout; both answer health checks
            results = [await post_chat(s, base, {"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(4)]
            assert [r["status"] for r in results] == [504] * 4, results
            assert all(b.healthy for b in svc.fleet.backends.values())
            assert sum(len(b.requests) for b in backends) == 4  # each sent once, never again elsewhere
            assert await wait_for(lambda: svc.fleet.total_backlog() == 0)

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_hung_backend_failing_health_is_ejected_and_requests_move() -> None:
    async def main() -> None:
        async with fleet(2, policy="round-robin", tokens_per_block=64, read_timeout_s=0.3, health_interval_s=0.1) as (
            svc, base, backends, s,
        ):  # fmt: skip
            backends[0].hang = True
            backends[0].health_ok = False
            assert await wait_for(lambda: not svc.fleet.backends[backends[0].url].healthy, timeout=5)
            results = [await post_chat(s, base, {"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(4)]
            assert all(r["done"] and r["backend"] == "b1" for r in results), results
            assert svc.fleet.total_backlog() == 0

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_client_disconnect_restores_the_baseline() -> None:
    async def main() -> None:
        kw = {"tokens_per_s": 50, "max_output_tokens": 50}
        async with fleet(2, policy="conversation-always", tokens_per_block=64, backend_kw=kw) as (svc, base, _, s):
            body = {"messages": [{"role": "user", "content": "z" * 4000}], "stream": True, "max_tokens": 50}
            async with s.post(base + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "c"}) as r:
                await r.content.readany()
                assert svc.fleet.total_backlog() > 0
                r.close()  # the client goes away mid-stream
            assert await wait_for(lambda: svc.fleet.total_backlog() == 0)
            router = svc.fleet._epoch.router
            assert router.stats.failed == 1
            # Exactly as finish(success=False): the retry of the same prompt is charged in full again.
            keys, n = svc.keyer.keys_for_body("/v1/chat/completions", body)
            ref = K.make_router("conversation-always", router.servers, tokens_per_block=64, chars_per_token=4.0,
                                use_cache_events=False, request_ttl_s=None)  # fmt: skip
            K.route(ref, "a", keys, n, "c")
            K.finish(ref, "a", False)
            K.route(ref, "b", keys, n, "c")
            K.route(router, "probe", keys, n, "c")
            assert sorted(K.loads(router).values()) == sorted(K.loads(ref).values())
            K.finish(router, "probe", True)

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_admin_endpoint_and_backends_file(tmp_path) -> None:
    async def main() -> None:
        async with fleet(1, policy="round-robin", tokens_per_block=64, admin_token="s3cret") as (svc, base, bes, s):
            from kvforge.service.testing import FakeBackend

            extra = FakeBackend(Keyer(64), name="extra")
            await extra.start()
            auth = {"Authorization": "Bearer s3cret"}
            async with s.post(base + "/admin/backends", json={"url": extra.url}) as r:
                assert r.status == 401
            async with s.post(base + "/admin/backends", json={"url": extra.url}, headers=auth) as r:
                assert r.status == 201
            async with s.post(base + "/admin/backends", json={"url": extra.url}, headers=auth) as r:
                assert r.status == 400  # already there
            got = {
                (await post_chat(s, base, {"messages": [{"role": "user", "content": f"m{i}"}]}))["backend"]
                for i in range(4)
            }
            assert got == {"b0", "extra"}
            async with s.delete(base + "/admin/backends", params={"url": bes[0].url}, headers=auth) as r:
                assert r.status == 200
            got = {
                (await post_chat(s, base, {"messages": [{"role": "user", "content": f"n{i}"}]}))["backend"]
                for i in range(3)
            }
            assert got == {"extra"}
            async with s.delete(base + "/admin/backends", params={"url": bes[0].url}, headers=auth) as r:
                assert r.status == 404
            async with s.get(base + "/admin/backends", headers=auth) as r:
                assert [b["url"] for b in await r.json()] == [extra.url]
            await extra.kill()

        # A backends file: read at start, re-read when it changes.
        b1, b2 = FakeBackend(Keyer(64), name="f1"), FakeBackend(Keyer(64), name="f2")
        await b1.start()
        await b2.start()
        path = tmp_path / "backends.txt"
        path.write_text(f"# fleet\n{b1.url}\nnot a url\n")
        async with fleet(0, policy="round-robin", tokens_per_block=64, backends_file=str(path)) as (svc, base, _, s):
            assert list(svc.fleet.backends) == [b1.url]
            await asyncio.sleep(0.05)
            path.write_text(f"{b2.url}\n")
            assert await wait_for(lambda: list(svc.fleet.backends) == [b2.url], timeout=3)
            r = await post_chat(s, base, {"messages": [{"role": "user", "content": "hi"}]})
            assert r["backend"] == "f2"
        await b1.kill()
        await b2.kill()

    run(main())


TEMPLATE = (
    "{% for m in messages %}{{ bos_token }} <|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _template(tmp_path) -> str:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": {"content": "w1"}, "eos_token": "w2"}))
    return str(path)


def _events_fleet(tmp_path, policy: str, tokens_per_block: int):
    """A keyer over the test tokenizer and chat template, and a function opening a 2-backend fleet under
    ``policy`` whose fake engines (16-token blocks) publish KV events the router subscribes to."""
    tok = build_tokenizer(tmp_path / "tokenizer.json")
    template = _template(tmp_path)
    keyer = Keyer(tokens_per_block, tokenizer=tok, chat_template=template)
    return keyer, lambda: fleet(
        2, keyer=keyer, events=True, policy=policy, tokens_per_block=tokens_per_block, tokenizer=str(tok),
        chat_template=template, backend_kw={"engine_block_size": 16},
    )  # fmt: skip


def test_chat_template_keys_are_the_rendered_prompts_tokens(tmp_path) -> None:
    tok = build_tokenizer(tmp_path / "tokenizer.json")
    keyer = Keyer(4, tokenizer=tok, chat_template=_template(tmp_path))
    body = {"messages": [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w3 w4 w5"}]}
    ids = keyer.encode("w1 <|system|> w9 w8 w1 <|user|> w3 w4 w5 <|assistant|>", add_special_tokens=False)
    assert 0 not in ids  # every word is in the vocabulary: the rendering is what the test says it is
    assert keyer.keys_for_body("/v1/chat/completions", body) == (K.chain_keys(K.root_key(), ids, 4), len(ids))
    body["add_generation_prompt"] = False
    assert keyer.keys_for_body("/v1/chat/completions", body)[1] == len(ids) - 1
    body["add_generation_prompt"] = "yes"
    with pytest.raises(K.BadRequest, match="add_generation_prompt"):
        keyer.keys_for_body("/v1/chat/completions", body)
    raising = tmp_path / "raising.jinja"
    raising.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    with pytest.raises(K.BadRequest, match="user first"):
        Keyer(4, chat_template=raising).keys_for_body("/v1/chat/completions", {"messages": [{"role": "a"}]})
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ValueError, match="chat_template"):
        Keyer(4, chat_template=bad)
    nojson = tmp_path / "x.json"
    nojson.write_text("{}")
    with pytest.raises(ValueError, match="chat_template"):
        Keyer(4, chat_template=nojson)


def test_kv_events_from_backends_reach_the_router(tmp_path) -> None:
    keyer, events_fleet = _events_fleet(tmp_path, "conversation-always", 32)

    async def main() -> None:
        async with events_fleet() as (svc, base, backends, s):
            text = " ".join(f"w{i % 97}" for i in range(200))
            body = {"messages": [{"role": "user", "content": text}], "stream": True}
            r = await post_chat(s, base, body)
            assert r["done"]
            keys, _ = keyer.keys_for_body("/v1/chat/completions", body)
            b = svc.fleet.backends[next(x.url for x in backends if x.name == r["backend"])]
            # Learned through ZMQ from the engine's token ids, not from the router's own placements.
            assert await wait_for(lambda: set(keys) <= set(b.mapper.present), timeout=5)
            other = next(x for x in svc.fleet.backends.values() if x is not b)
            assert not other.mapper.present
            router = svc.fleet._epoch.router
            assert router.cached_blocks(b.url) == len(keys)
            async with s.get(base + "/metrics") as m:
                exposition = await m.text()
            assert f'kvforge_router_kv_events_total{{backend="{b.url}",kind="batches"}}' in exposition
            # A new conversation with that prefix follows the events to the same backend.
            body2 = {"messages": [{"role": "user", "content": text + " w5 w6"}], "stream": False}
            r2 = await post_chat(s, base, body2, "fresh")
            assert r2["backend"] == r["backend"]

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_no_backend_left_answers_503() -> None:
    async def main() -> None:
        async with fleet(1, tokens_per_block=64, max_retries=1) as (svc, base, backends, s):
            await backends[0].kill()
            r = await post_chat(s, base, {"messages": [{"role": "user", "content": "x"}]})
            assert r["status"] in (502, 503)
            async with s.get(base + "/health") as h:
                assert h.status == 503
            assert svc.fleet.total_backlog() == 0

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_models_passthrough() -> None:
    async def main() -> None:
        async with fleet(2, tokens_per_block=64) as (_, base, _, s), s.get(base + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_streaming_is_passed_through_chunk_by_chunk() -> None:
    async def main() -> None:
        kw = {"tokens_per_s": 20, "max_output_tokens": 6}
        async with fleet(1, tokens_per_block=64, backend_kw=kw) as (_, base, _, s):
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 6}
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            arrivals = []
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                async for _ in r.content.iter_any():
                    arrivals.append(loop.time() - t0)
            # Six chunks 50 ms apart: the first arrives long before the last (nothing buffered whole).
            assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] > 0.15

    run(main())


@pytest.mark.usefixtures("http_layer")
@pytest.mark.parametrize("policy", ["conversation", "conversation-always"])
def test_membership_changes_keep_sessions_and_move_only_the_dead_backends_conversations(policy: str) -> None:
    async def main() -> None:
        kw = {"tokens_per_s": 4000}
        async with fleet(3, policy=policy, tokens_per_block=64, backend_kw=kw, health_interval_s=30.0) as (
            svc, base, backends, s,
        ):  # fmt: skip
            by_name = {b.name: b for b in backends}
            router = svc.fleet._epoch.router
            prompts = {f"k{i}": "".join(random.Random(i).choice("abcdefgh ") for _ in range(2000)) for i in range(6)}

            async def turn(conv: str) -> str:
                prompts[conv] += " more" * 20
                body = {"messages": [{"role": "user", "content": prompts[conv]}], "stream": True, "max_tokens": 2}
                r = await post_chat(s, base, body, conv)
                assert r["done"] and r["status"] == 200, r
                return r["backend"]

            home = {c: await turn(c) for c in prompts}
            assert len(set(home.values())) == 3  # spread over the fleet
            a = home["k0"]
            c = next(n for n in by_name if n != a)
            # An unrelated backend leaves (admin) and comes back: no other conversation moves.
            async with s.delete(base + "/admin/backends", params={"url": by_name[c].url}) as r:
                assert r.status == 200
            for conv in prompts:
                got = await turn(conv)
                assert got != c and (home[conv] == c or got == home[conv]), (conv, home[conv], got)
                home[conv] = got
            async with s.post(base + "/admin/backends", json={"url": by_name[c].url}) as r:
                assert r.status == 201
            for conv in prompts:
                assert await turn(conv) == home[conv]
            assert svc.fleet._epoch.router is router  # one router throughout: sessions were never lost
            # The backend of k0 dies: its conversations move once (the first request is retried elsewhere) and
            # stick to their new backend, also after the dead one is back in rotation.
            await by_name[a].kill()
            moved = {}
            for conv in prompts:
                got = await turn(conv)
                assert got != a
                if home[conv] == a:
                    moved[conv] = got
                else:
                    assert got == home[conv], (conv, home[conv], got)
            assert "k0" in moved and not svc.fleet.backends[by_name[a].url].healthy
            svc.fleet.set_health(svc.fleet.backends[by_name[a].url], True)
            assert svc.fleet.backends[by_name[a].url].healthy
            for _ in range(2):
                for conv, b in moved.items():
                    assert await turn(conv) == b
            assert svc.fleet._epoch.router is router
            assert await wait_for(lambda: svc.fleet.total_backlog() == 0)
            router.sanity_check()

    run(main())


def test_fleet_changes_its_router_in_place() -> None:
    from kvforge.service.proxy import Fleet, NoBackend, ServiceConfig

    async def main() -> None:
        cfg = ServiceConfig(backends=["http://h0:1"], policy="conversation", tokens_per_block=64)
        with pytest.raises(ValueError, match="tokenizer"):  # events could never match a text key
            Fleet(cfg).add("http://h9:1", kv_events="tcp://127.0.0.1:1")
        # (The fleet only checks that a tokenizer is configured; the service loads it.)
        cfg = ServiceConfig(backends=["http://h0:1"], policy="conversation", tokens_per_block=64, tokenizer="t.json")
        f = Fleet(cfg)
        b0 = f.add("http://h0:1")
        router = f._epoch.router
        b1 = f.add("http://h1:1")
        assert f._epoch.router is router and router.servers == (b0.url, b1.url)
        f.eject(b0, "test")
        assert not router.is_available(b0.url) and router.available_servers() == (b1.url,)
        f.eject(b1, "test")
        with pytest.raises(NoBackend):  # every backend out of rotation
            f.place("r0", [1, 2], 128, "c")
        f.set_health(b0, True)
        assert router.available_servers() == (b0.url,)
        ep, b = f.place("r1", [1, 2], 128, "c")
        assert b is b0 and ep.router is router
        assert await f.remove(b0.url)  # in flight on it: still finishes exactly
        assert router.servers == (b1.url,) and router.available_servers() == ()
        f.finish(ep, "r1", True)
        assert router.in_flight() == 0 and set(router._ledger.loads) == {0}
        # A backend with KV events joining a conversation router built without them: rebuilt with events,
        # the unhealthy member kept out of rotation.
        b2 = f.add("http://h2:1", kv_events="tcp://127.0.0.1:1")
        assert f._epoch.router is not router and f._epoch.router.config.use_cache_events
        assert f._epoch.router.servers == (b1.url, b2.url)
        assert f._epoch.router.available_servers() == (b2.url,)
        router = f._epoch.router
        f.add("http://h3:1", kv_events="tcp://127.0.0.1:2")
        assert f._epoch.router is router  # already has events
        for u in list(f.backends):
            assert await f.remove(u)
        assert f._epoch is None
        with pytest.raises(NoBackend):
            f.place("r2", [1], 64, None)

    run(main())


def test_readme_configuration_sends_a_new_conversation_to_the_backend_announcing_its_prefix(tmp_path) -> None:
    # Issue 31: under the README's --policy conversation, KV events never placed a new conversation.
    keyer, events_fleet = _events_fleet(tmp_path, "conversation", 64)

    async def main() -> None:
        async with events_fleet() as (svc, base, backends, s):
            router = svc.fleet._epoch.router
            for n, announcer in enumerate((backends[1], backends[0], backends[1])):
                doc = " ".join(f"w{(7 * i + 31 * n) % 400}" for i in range(300))
                body = {"messages": [{"role": "user", "content": doc}], "stream": False}
                keys, _ = keyer.keys_for_body("/v1/chat/completions", body)
                # The announcer already holds earlier documents' blocks (n=2 reuses backends[1]), so wait
                # for this document's blocks on top of them, not for a count the old blocks already meet.
                url = announcer.url
                want = router.cached_blocks(url) + len(keys)
                # The engine holds this prompt (another router, a warm-up): it says so on its event stream.
                announcer._publish(keyer.prompt_token_ids("/v1/chat/completions", body))
                assert await wait_for(lambda u=url, w=want: router.cached_blocks(u) >= w, timeout=5)
                follow = {"messages": [{"role": "user", "content": doc + " w1 w2 w3"}], "stream": False}
                r = await post_chat(s, base, follow, f"new-{n}")
                assert r["backend"] == announcer.name, (n, r)

    run(main())


def _samples(exposition: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric's samples in Prometheus text."""
    out = {}
    for line in exposition.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


@pytest.mark.usefixtures("http_layer")
def test_metrics_count_every_request_and_prompt_token_at_each_scrape() -> None:
    async def main() -> None:
        async with fleet(2, tokens_per_block=64) as (svc, base, backends, s):
            texts = [f"conversation {i} " + "y" * (100 * i) for i in range(6)]
            expect_tokens = sum(
                svc.keyer.keys_for_body("/v1/chat/completions", {"messages": [{"role": "user", "content": t}]})[1]
                for t in texts
            )
            seen = {"ok": 0.0, "tokens": 0.0}
            for round_ in range(2):  # the second scrape adds what came after the first, once
                for i, t in enumerate(texts):
                    body = {"messages": [{"role": "user", "content": t}], "stream": i % 2 == 0}
                    assert (await post_chat(s, base, body, f"c{i}"))["done"]
                async with s.get(base + "/metrics") as m:
                    exposition = await m.text()
                ok = _samples(exposition, "kvforge_router_requests_total")
                tokens = _samples(exposition, "kvforge_router_prompt_tokens_total")
                assert set(ok) <= {f'{{backend="{b.url}",outcome="ok"}}' for b in backends}
                assert sum(ok.values()) == 6 * (round_ + 1) == seen["ok"] + 6
                assert sum(tokens.values()) == expect_tokens * (round_ + 1) == seen["tokens"] + expect_tokens
                seen = {"ok": sum(ok.values()), "tokens": sum(tokens.values())}

    run(main())


@pytest.mark.usefixtures("http_layer")
def test_request_headers_are_forwarded_less_the_hop_by_hop_ones() -> None:
    from aiohttp import web

    from kvforge.service.proxy import RouterService, ServiceConfig
    from tests.service_harness import serve_service

    got: list[list[tuple[bytes, bytes]]] = []

    async def chat(request: web.Request) -> web.Response:
        got.append(list(request.raw_headers))
        await request.read()
        return web.json_response({"backend": "cap"})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        port, close = await serve_service(RouterService(ServiceConfig(backends=[url], tokens_per_block=64)))
        try:
            body = b'{"messages": [{"role": "user", "content": "hello"}]}'
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nX-Custom: Mixed Case Value\r\n"
                b"x-lower: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nContent-Type: application/json\r\n"
                b"X-Conversation-Id: conv-1\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            status = await reader.readline()
            writer.close()
            assert status.startswith(b"HTTP/1.1 200"), status
            assert len(got) == 1
            names = [k.lower() for k, _ in got[0]]
            for k, v in ((b"X-Custom", b"Mixed Case Value"), (b"x-lower", b"1"), (b"X-Conversation-Id", b"conv-1")):
                assert (k, v) in got[0], got[0]
            for hop in (b"keep-alive", b"te"):
                assert hop not in names
            assert names.count(b"host") == 1 and dict(got[0])[b"Host"] == url.split("//")[1].encode()
            assert dict(got[0])[b"Content-Length"] == str(len(body)).encode()
        finally:
            await close()
            await runner.cleanup()

    run(main())
