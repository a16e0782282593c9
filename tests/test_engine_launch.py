"""Launcher items: shared-draft-KV resolution and its eligibility gate, the INFO lines, the memory cap call."""

from __future__ import annotations

import logging

import pytest
import torch

from kvforge.disagg.launch import (
    SHARED_DRAFT_KV_ENV,
    apply_memory_cap,
    log_manager_class,
    resolve_shared_draft_kv,
)
from kvforge.kvcache.hybrid import HybridCacheManager
from kvforge.kvcache.manager import KVCacheManager

OK = dict(manages_context_pages=True, tokens_per_block=32)


@pytest.mark.parametrize(
    "setting,env,kw,expected",
    [
        ("auto", {}, {}, True),
        (None, {}, {}, True),
        ("0", {}, {}, False),
        ("1", {}, {}, True),
        ("auto", {SHARED_DRAFT_KV_ENV: "0"}, {}, False),  # the environment wins
        ("0", {SHARED_DRAFT_KV_ENV: "auto"}, {}, True),
        ("auto", {}, {"manages_context_pages": False}, False),
        ("auto", {}, {"draft_tokens_per_block": 64}, False),
        ("auto", {}, {"draft_tokens_per_block": 32}, True),
        ("auto", {}, {"helix": True}, False),
        ("auto", {}, {"cp_size": 2}, False),
    ],
)
def test_shared_draft_kv_resolution(setting, env, kw, expected, caplog) -> None:
    args = {**OK, **kw}
    with caplog.at_level(logging.INFO, logger="kvforge.disagg.launch"):
        assert resolve_shared_draft_kv(setting, environ=env, **args) is expected
    assert any("draft KV pool share" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"manages_context_pages": False}, "does not manage"),
        ({"draft_tokens_per_block": 16}, "page size"),
        ({"helix": True}, "helix"),
        ({"cp_size": 4}, "context parallelism"),
    ],
)
def test_forcing_shared_draft_kv_on_an_ineligible_layout_raises(kw, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        resolve_shared_draft_kv("1", environ={}, **{**OK, **kw})


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="expected 'auto', '0' or '1'"):
        resolve_shared_draft_kv("yes", environ={}, **OK)
    with pytest.raises(ValueError, match=SHARED_DRAFT_KV_ENV):
        resolve_shared_draft_kv("auto", environ={SHARED_DRAFT_KV_ENV: "2"}, **OK)
    with pytest.raises(ValueError, match="tokens_per_block"):
        resolve_shared_draft_kv("auto", environ={}, manages_context_pages=True, tokens_per_block=0)


def test_manager_class_info_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvforge.disagg.launch"):
        assert log_manager_class(KVCacheManager, HybridCacheManager) is HybridCacheManager
        assert log_manager_class(KVCacheManager, None) is KVCacheManager
    msgs = [r.getMessage() for r in caplog.records]
    assert any("HybridCacheManager (declared by the model)" in m for m in msgs)
    assert any("KVCacheManager (the library's default)" in m for m in msgs)
    with pytest.raises(ValueError, match="not a subclass"):
        log_manager_class(HybridCacheManager, KVCacheManager)


def test_memory_cap(caplog) -> None:
    for bad in (0, 1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="fraction"):
            apply_memory_cap(bad)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="kvforge.disagg.launch"):
        applied = apply_memory_cap(0.5)
    assert applied is torch.cuda.is_available()
    if not applied:
        assert any("not applied: no CUDA device" in r.getMessage() for r in caplog.records)


# ---- the engine's setup wiring (kvforge.engine.launch) -------------------------------------------------------


def _tiny_model():
    from kvforge.engine import HybridModel, tiny

    return HybridModel(tiny())


@pytest.mark.parametrize(
    ("env", "draft_len", "shared", "scratch"),
    [
        ({}, 1, True, True),  # a speculative config: auto -> shared
        ({}, 0, False, False),  # none: "0" -> no draft layer, no draft pages
        ({"KVFORGE_DISAGG_ROLE": "context"}, 0, True, False),  # context-only drafter computes the draft KV
        ({"KVFORGE_DISAGG_ROLE": "context"}, 1, True, False),  # context-only layout: no verify scratch rows
        ({"KVFORGE_DISAGG_ROLE": "generation"}, 1, True, True),
        ({SHARED_DRAFT_KV_ENV: "1"}, 0, True, False),  # the environment wins
    ],
)
def test_engine_setup_follows_role_and_speculative_config(monkeypatch, caplog, env, draft_len, shared, scratch):
    from kvforge.engine import Engine, EngineConfig
    from kvforge.kvcache.config import LayerOwner

    monkeypatch.delenv("KVFORGE_DISAGG_ROLE", raising=False)
    monkeypatch.delenv(SHARED_DRAFT_KV_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="kvforge.disagg.launch"):
        eng = Engine(_tiny_model(), EngineConfig(max_num_requests=4), draft_len=draft_len)
    assert eng.launch.shared_draft_kv is shared
    has_draft_layer = any(s.owner is LayerOwner.DRAFT for s in eng.kv_config.layers)
    assert has_draft_layer is shared and (eng.cache.draft_latent is not None) is shared
    assert (eng.cache.state_trash > eng.cache.scratch_base) is scratch
    assert eng.launch.context_only is (env.get("KVFORGE_DISAGG_ROLE") == "context")
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("draft KV pool share" in m for m in msgs) == 1, msgs  # once per manager
    assert sum("KV cache manager class" in m and "HybridCacheManager" in m for m in msgs) == 1, msgs
    assert eng.launch.memory_fraction is None  # a CPU model: nothing to cap


def test_engine_refuses_a_drafter_without_the_shared_pool(monkeypatch) -> None:
    from kvforge.engine import Engine, EngineConfig

    monkeypatch.setenv(SHARED_DRAFT_KV_ENV, "0")
    with pytest.raises(ValueError, match="draft_len"):
        Engine(_tiny_model(), EngineConfig(), draft_len=1)


def test_engine_skips_uploading_unchanged_slot_ids() -> None:
    from kvforge.engine import Engine, EngineConfig

    eng = Engine(_tiny_model(), EngineConfig(max_num_requests=4), draft_len=1)
    eng.add_request("a", list(range(20)), 4)
    eng.add_request("b", list(range(30, 47)), 4)
    uploaded = []
    while eng.scheduler.has_unfinished:
        before = eng._slots_up[1]
        eng.step()
        uploaded.append(eng._slots_up[1] is not before)
    # The first generation step uploads the two slots; the next steps (same rows) reuse them.
    assert uploaded.count(True) >= 1 and uploaded.count(False) >= 2, uploaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cap applies to CUDA memory)")
def test_engine_applies_the_memory_cap_on_cuda() -> None:
    from kvforge.engine import Engine, EngineConfig, HybridModel, tiny

    eng = Engine(HybridModel(tiny(), device="cuda"), EngineConfig())
    assert eng.launch.memory_fraction is not None and 0.5 < eng.launch.memory_fraction <= 1.0
