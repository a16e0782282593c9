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
