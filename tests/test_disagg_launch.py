"""Server-role forwarding: the override replaces an existing value on every rank; no role leaves env unchanged."""

from __future__ import annotations

import os

import pytest

from kvforge.disagg.launch import (
    ROLE_ENV,
    ServerRole,
    apply_env_overrides,
    current_role,
    launch_workers,
    parse_role,
    role_env_overrides,
)


def test_role_is_added_to_the_overrides():
    assert role_env_overrides("generation") == {ROLE_ENV: "generation"}
    assert role_env_overrides(ServerRole.CONTEXT, {"A": "1"}) == {"A": "1", ROLE_ENV: "context"}


def test_role_override_replaces_an_existing_value():
    assert role_env_overrides("context", {ROLE_ENV: "generation", "B": "2"}) == {ROLE_ENV: "context", "B": "2"}
    env = {ROLE_ENV: "generation", "PATH": "/bin"}
    apply_env_overrides(role_env_overrides("context"), env)
    assert env == {ROLE_ENV: "context", "PATH": "/bin"}
    assert current_role(env) is ServerRole.CONTEXT


def test_no_role_leaves_everything_unchanged():
    given = {"A": "1"}
    got = role_env_overrides(None, given)
    assert got == {"A": "1"} and got is not given
    env = {ROLE_ENV: "generation", "PATH": "/bin"}
    apply_env_overrides(role_env_overrides(None), env)
    assert env == {ROLE_ENV: "generation", "PATH": "/bin"}
    assert current_role({}) is None


def test_bad_roles_and_overrides_are_rejected():
    with pytest.raises(ValueError, match="role: expected one of"):
        role_env_overrides("prefill")
    with pytest.raises(TypeError, match="env_overrides"):
        apply_env_overrides({"A": 1}, {})
    assert parse_role("GENERATION") is ServerRole.GENERATION


def report_role(rank: int, nprocs: int) -> tuple[str | None, str | None]:
    return os.environ.get(ROLE_ENV), os.environ.get("KVFORGE_TEST_MARK")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_role_reaches_every_spawned_worker(monkeypatch):
    # The launcher's own environment says "context"; the workers must see the role given to the launch.
    monkeypatch.setenv(ROLE_ENV, "context")
    got = launch_workers(report_role, 2, role="generation", env_overrides={"KVFORGE_TEST_MARK": "x"}, timeout_s=50)
    assert [r.value for r in got] == [("generation", "x")] * 2
    got = launch_workers(report_role, 2, timeout_s=50)
    assert [r.value for r in got] == [("context", None)] * 2


def misbehave(rank: int, nprocs: int) -> str:
    if rank == 0:
        os._exit(3)  # dies without a report
    if rank == 1:
        raise RuntimeError("boom")
    import time

    time.sleep(600)  # never reports: the launcher must stop it
    return "unreachable"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_launcher_reports_dead_failing_and_hung_workers():
    got = launch_workers(misbehave, 3, timeout_s=3.0)
    assert got[0].exitcode == 3 and got[0].value is None and not got[0].reported
    assert got[1].exitcode == 1 and "RuntimeError: boom" in got[1].error
    assert got[2].error == "rank 2 still running after 3 s; killed" and got[2].exitcode != 0


# --- launcher defaults per role and without a speculative config (the reference system's serve.py rules) -----------

SPEC = {"max_draft_len": 3}  # any speculative config: the launcher only asks whether there is one


@pytest.mark.parametrize("role", ["context", "generation", None])
@pytest.mark.parametrize("spec", [SPEC, None], ids=["spec", "no-spec"])
@pytest.mark.parametrize("setting", [None, "auto"])
def test_launch_defaults_for_both_roles_and_a_missing_speculative_config(role, spec, setting):
    from kvforge.disagg.launch import SHARED_DRAFT_KV_ENV, launch_defaults

    got = launch_defaults(role, spec, shared_draft_kv=setting, environ={})
    # Reference: an unset or "auto" shared-draft-KV setting resolves to "auto" with a drafter and "0" without
    # one; the memory margin defaults to 1 GiB for every run; neither depends on the role.
    shared = "auto" if spec is not None else "0"
    assert got.shared_draft_kv == shared
    assert got.torch_mem_safety_margin == 1 << 30
    assert got.role == parse_role(role)
    want_env = {SHARED_DRAFT_KV_ENV: shared}
    if role is not None:
        want_env[ROLE_ENV] = role
    assert got.env_overrides == want_env


@pytest.mark.parametrize("spec", [SPEC, None], ids=["spec", "no-spec"])
def test_workers_resolve_the_launchers_decision(spec):
    from kvforge.disagg.launch import launch_defaults, resolve_shared_draft_kv

    # A worker whose layout is eligible shares exactly when the launch had a drafter; the role arrives too.
    env = {ROLE_ENV: "context"}
    apply_env_overrides(launch_defaults("generation", spec, environ={}).env_overrides, env)
    assert current_role(env) is ServerRole.GENERATION
    shared = resolve_shared_draft_kv(None, manages_context_pages=True, tokens_per_block=32, environ=env)
    assert shared is (spec is not None)


def test_explicit_launch_settings_win_and_bad_ones_are_refused():
    from kvforge.disagg.launch import SHARED_DRAFT_KV_ENV, launch_defaults

    assert launch_defaults("context", SPEC, shared_draft_kv="0", environ={}).shared_draft_kv == "0"
    assert launch_defaults("context", SPEC, shared_draft_kv="1", environ={}).shared_draft_kv == "1"
    assert launch_defaults("context", SPEC, environ={SHARED_DRAFT_KV_ENV: "0"}).shared_draft_kv == "0"
    assert launch_defaults("generation", None, declared_mem_margin=4 << 30, environ={}).torch_mem_safety_margin == (
        4 << 30
    )
    kept = launch_defaults("context", None, env_overrides={"A": "1", ROLE_ENV: "generation"}, environ={})
    assert kept.env_overrides[ROLE_ENV] == "context" and kept.env_overrides["A"] == "1"
    with pytest.raises(ValueError, match="no speculative config"):
        launch_defaults("context", None, shared_draft_kv="1", environ={})
    with pytest.raises(ValueError, match=f"env {SHARED_DRAFT_KV_ENV}"):
        launch_defaults("context", SPEC, environ={SHARED_DRAFT_KV_ENV: "yes"})
    with pytest.raises(ValueError, match="role: expected one of"):
        launch_defaults("prefill", SPEC, environ={})
    with pytest.raises(ValueError, match="declared_mem_margin"):
        launch_defaults("context", SPEC, declared_mem_margin=-1, environ={})
