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
