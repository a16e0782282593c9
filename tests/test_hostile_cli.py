"""Hostile input to ``kvforge`` (the CLI's ``main``, run in-process) and to the Mooncake trace reader.

Every option of ``kvforge simulate`` gets bad values and must answer with exit status 2 and one line
``kvforge simulate: error: argument --x: ...`` naming the flag (and the value where there is one), never a
traceback, a hang or a MemoryError; hostile trace files must raise ``TraceFormatError`` (or a path error)
naming the file and line. The regression tests of issue 17 (2.1, 2.7) and issue 21 (CLI and outputs) are here
too; the ones that hung on the old code carry a timeout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvforge.__main__ import main
from kvforge.kvcache.replay import TraceFormatError, load_trace
from kvforge.sim.cli import LIMITS, OUT_FILES, add_arguments
from kvforge.sim.model import KIMI_K3_LIKE, Throughputs
from kvforge.sim.simulator import MAX_TOTAL_PAGES, SimConfig, SimulationError, percentile, simulate
from kvforge.sim.workload import SimRequest, SyntheticWorkload, TraceOrderWarning, load_mooncake_trace

SHORT = ["--conversations", "6", "--servers", "2", "--no-progress", "--router", "conversation"]
INTS = {"--limit", "--conversations", "--seed", "--servers", "--demote", "--max-num-tokens", "--decode-quantum"}
INTS |= {"--gpus-per-server", "--servers-per-device"}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: usage errors, --help, --version
        rc = int(exc.code or 0)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvforge simulate: error: argument --"), err
    for n in needles:
        assert n in lines[0], (n, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert not any(line.startswith("policy") for line in out.splitlines())  # no summary table: nothing ran


def _line(**over: object) -> str:
    d: dict[str, object] = {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]}
    d.update(over)
    return json.dumps(d)


def _trace(tmp_path: Path, lines: list[str] | bytes, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(lines if isinstance(lines, bytes) else ("\n".join(lines) + "\n").encode())
    return p


# --- every option, bad values --------------------------------------------------------------------------------------


def _numeric_cases() -> list[tuple[str, str]]:
    cases = []
    for flag, (lo, hi) in LIMITS.items():
        integer = flag in INTS
        below = lo - 1 if integer else lo / 2
        above = hi + 1 if integer else hi * 2
        bad = ["abc", "", "nan", "inf", "-inf", repr(below), repr(above), "1e400"]
        if integer:
            bad += ["1.5", "0x10", "9" * 5000]
        cases += [(flag, v) for v in bad]
    return cases


@pytest.mark.parametrize(("flag", "value"), _numeric_cases())
def test_numeric_option_out_of_range_or_not_a_number(flag: str, value: str, capsys):
    rc, out, err = _run([*SHORT, f"{flag}={value}"], capsys)
    _assert_one_line_error(rc, out, err, f"argument {flag}:")
    if len(value) < 50:
        assert repr(value) in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--router", "nope"], ["argument --router:", "'nope'"]),
        (["--router", ","], ["argument --router:", "at least one"]),
        (["--router", "conversation,round-robin,x"], ["argument --router:", "'x'"]),
        (["--snapshot-policy", "nope"], ["argument --snapshot-policy:", "'nope'"]),
        (["--snapshot-policy", " , "], ["argument --snapshot-policy:"]),
        (["--model", "no-such-model"], ["argument --model:", "no-such-model"]),
        (["--model", "{dir}"], ["argument --model:"]),
        (["--model", "{bad_json}"], ["argument --model:", "not JSON"]),
        (["--model", "{list_json}"], ["argument --model:", "JSON object"]),
        (["--model", "{unknown_field}"], ["argument --model:", "unknown field"]),
        (["--model", "{zero_layers}"], ["argument --model:", "mla_layers"]),
        (["--model", "{huge_model}"], ["argument --model:", "layers"]),
        (["--model", "{huge_state}"], ["argument --cache-gib:", "cannot hold"]),
        (["--model", "{deep_json}"], ["argument --model:", "nested too deeply"]),
        (["--model", "{latin1_json}"], ["argument --model:"]),
        (["--exact-demotion"], ["argument --exact-demotion:", "--demote"]),
        (["--exact-demotion=1"], ["argument --exact-demotion:"]),
        (["--no-progress=yes"], ["argument --no-progress:"]),
        (["--trace"], ["argument --trace:", "expected one argument"]),
        (["--trace", "{absent}"], ["argument --trace:", "no such file"]),
        (["--trace", "{dir}"], ["argument --trace:", "is a folder"]),
        (["--out", "{file}"], ["argument --out:", "not a folder"]),
        (["--out", "{file}/sub"], ["argument --out:", "is a file"]),
        (["--out", "{out_with_dir}"], ["argument --out:", "summary.csv", "a folder"]),
        (["--cache-gib", "0.05"], ["argument --cache-gib:", "cannot hold one"]),
        (["--cache-gib", "0.5", "--state-fraction", "0.9"], ["argument --cache-gib:", "longest request needs"]),
        (["--servers", "1024", "--cache-gib", "16384"], ["argument --cache-gib:", f"{MAX_TOTAL_PAGES:,}"]),
        (["--max-num-tokens", "1"], ["argument --max-num-tokens:", "got 1", "at least 4"]),
        (["--max-num-tokens", "3"], ["argument --max-num-tokens:", "got 3"]),
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--profile", "{bad_json}"], ["argument --profile:", "not JSON"]),
        (["--profile", "{list_json}"], ["argument --profile:", "kvforge-step-profile/1"]),
        (["--profile", "{absent}"], ["argument --profile:"]),
        (["--profile", "{dir}"], ["argument --profile:", "folder"]),
    ],
)
def test_other_options_bad_values(tmp_path: Path, capsys, argv: list[str], needles: list[str]):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "unknown.json").write_text('{"layers": 3}')
    (tmp_path / "zero.json").write_text('{"mla_layers": 0}')
    (tmp_path / "huge.json").write_text('{"mla_layers": 100000000}')
    (tmp_path / "state.json").write_text('{"recurrent_state_bytes": 1000000000000000}')
    (tmp_path / "o" / "summary.csv").mkdir(parents=True)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "latin1.json").write_bytes(b'{"name": "caf\xe9"}')
    subs = {
        "{dir}": tmp_path / "d",
        "{file}": tmp_path / "f",
        "{bad_json}": tmp_path / "bad.json",
        "{list_json}": tmp_path / "list.json",
        "{unknown_field}": tmp_path / "unknown.json",
        "{zero_layers}": tmp_path / "zero.json",
        "{huge_model}": tmp_path / "huge.json",
        "{huge_state}": tmp_path / "state.json",
        "{deep_json}": tmp_path / "deep.json",
        "{latin1_json}": tmp_path / "latin1.json",
        "{absent}": tmp_path / "absent.jsonl",
        "{out_with_dir}": tmp_path / "o",
    }
    args = []
    for a in argv:
        for k, v in subs.items():
            a = a.replace(k, str(v))
        args.append(a)
    rc, out, err = _run([*SHORT, *args], capsys)
    if argv == ["--bogus"]:
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needles[0] in err
        return
    _assert_one_line_error(rc, out, err, *needles)


def test_every_option_has_a_bad_value_case():
    """The cases above cover every option ``kvforge simulate`` has (a new flag must add its own)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    covered = set(LIMITS) | {"--router", "--snapshot-policy", "--model", "--exact-demotion", "--no-progress"}
    covered |= {"--trace", "--out", "--profile"}
    assert flags == covered


# --- issue 17, 2.1: nothing hangs or grows memory --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_limit_1_finishes(capsys):
    rc, out, err = _run([*SHORT, "--limit", "1"], capsys)
    assert rc == 0, err
    assert "1 requests" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 7])
def test_all_equal_timestamps_finish_with_a_bounded_load_grid(n: int):
    reqs = [r for r in SyntheticWorkload(conversations=4, seed=2).requests()][:n]
    same = [SimRequest(r.request_id, 1.7e9, r.prompt_tokens, r.output_tokens, r.block_keys) for r in reqs]
    cfg = SimConfig(servers=2, load_samples=50)
    res = simulate(same, cfg, "conversation")
    assert res.requests == n and res.makespan_s > 0
    assert 0 < len(res.load_times) <= 2 * cfg.load_samples
    assert res.load_times == sorted(res.load_times) and res.load_times[-1] <= res.makespan_s


@pytest.mark.timeout(60)
def test_equal_timestamp_trace_through_the_cli(tmp_path: Path, capsys):
    p = _trace(tmp_path, [_line(timestamp=5)] * 4)
    rc, out, err = _run(["--trace", str(p), "--servers", "2", "--no-progress", "--router", "round-robin"], capsys)
    assert rc == 0, err
    assert "4 requests" in out


@pytest.mark.timeout(60)
def test_arrivals_compressed_to_zero_finish():
    """What --speedup 1e308 did to the arrival times (now refused at parse time) still finishes in the library."""
    reqs = SyntheticWorkload(conversations=4, seed=1).requests()
    tiny = [SimRequest(r.request_id, r.arrival_s / 1e308, r.prompt_tokens, r.output_tokens, r.block_keys) for r in reqs]
    res = simulate(tiny, SimConfig(servers=2), "round-robin")
    assert res.requests == len(reqs)
    assert len(res.load_times) <= 2 * SimConfig().load_samples


@pytest.mark.timeout(60)
def test_steps_that_last_forever_are_refused():
    reqs = SyntheticWorkload(conversations=2, seed=1).requests()
    slow = SimConfig(servers=1, throughputs=Throughputs(efficiency=1e-300))
    with pytest.raises(SimulationError, match="step"):
        simulate(reqs, slow, "conversation")


@pytest.mark.timeout(60)
def test_huge_model_is_refused_before_allocation():
    from dataclasses import replace

    with pytest.raises(SimulationError, match="layers"):
        SimConfig(model=replace(KIMI_K3_LIKE, mla_layers=10**8))


@pytest.mark.timeout(60)
def test_fleet_page_bound_is_checked_before_allocation():
    reqs = SyntheticWorkload(conversations=2, seed=1).requests()
    with pytest.raises(SimulationError, match="--servers or --cache-gib"):
        simulate(reqs, SimConfig(servers=100_000, cache_gib=1e6), "round-robin")


def test_out_of_order_trace_is_sorted_with_a_warning(tmp_path: Path, capsys):
    p = _trace(tmp_path, [_line(timestamp=3000), _line(timestamp=1000), _line(timestamp=2000, hash_ids=[9, 8, 7])])
    with pytest.warns(TraceOrderWarning, match="not in time order"):
        reqs = load_mooncake_trace(p)
    assert [r.arrival_s for r in reqs] == [1.0, 2.0, 3.0]
    assert [r.request_id for r in reqs] == [1, 2, 0]  # ids keep the file's order
    rc, _, err = _run(["--trace", str(p), "--servers", "2", "--no-progress", "--router", "round-robin"], capsys)
    assert rc == 0, err
    assert err.strip().startswith("kvforge simulate: warning:") and "sorted" in err


def test_simulate_refuses_unsorted_or_non_finite_arrivals():
    reqs = SyntheticWorkload(conversations=3, seed=1).requests()
    assert len(reqs) >= 2
    swapped = [reqs[1], reqs[0], *reqs[2:]]
    if swapped[0].arrival_s != swapped[1].arrival_s:
        with pytest.raises(SimulationError, match="sorted by arrival"):
            simulate(swapped, SimConfig(servers=1), "round-robin")
    bad = [SimRequest(0, math.nan, 10, 1, ())]
    with pytest.raises(SimulationError, match="finite"):
        simulate(bad, SimConfig(servers=1), "round-robin")


# --- issue 17, 2.7: --out checked first, trace files, sizes -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--servers=100000", "--cache-gib=1e6", "--conversations=1000000000"])
def test_unbounded_sizes_are_refused_at_parse_time(flag: str, capsys):
    rc, out, err = _run([*SHORT, flag], capsys)
    _assert_one_line_error(rc, out, err, f"argument {flag.split('=')[0]}:")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ([_line(hash_ids=[1, True, 3])], "hash_ids"),
        ([_line(hash_ids=[False])], "hash_ids"),
        ([_line(input_length=True)], "input_length"),
        ([_line(output_length=True)], "output_length"),
        ([_line(timestamp=True)], "timestamp"),
        ([_line(input_length=2.0)], "input_length"),
        ([_line(hash_ids=[1.0])], "hash_ids"),
        ([_line(hash_ids=[1])], "at least 2 hash_ids"),
        ([_line(hash_ids=[-1])], "hash_ids"),
        ([_line(hash_ids=[2**64])], "hash_ids"),
        ([_line(hash_ids="abc")], "hash_ids"),
        ([_line(hash_ids=None)], "hash_ids"),
        ([_line(hash_ids={"a": 1})], "hash_ids"),
        ([_line(timestamp="0")], "timestamp"),
        (['{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": []}'], "timestamp"),
        (['{"timestamp": Infinity, "input_length": 5, "output_length": 1, "hash_ids": []}'], "timestamp"),
        ([_line(input_length=0)], "input_length"),
        ([_line(output_length=-3)], "output_length"),
        (["[" * 100_000 + "]" * 100_000], "nested too deeply"),
        (['{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"], "nested too deeply"),
        ([_line(hash_ids=[[[[[[1]]]]]])], "hash_ids"),
        (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [' + "9" * 5000 + "]}"], "JSON"),
        (
            b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": \xff\xfe}\n',
            "UTF-8",
        ),
        (b"\xef\xbb\xbf" + _line().encode() + b"\n", "JSON"),
        (b'{"timestamp": 0, "input_length": 5\x00, "output_length": 1, "hash_ids": []}\n', "JSON"),
        (['{"timestamp": 0, "input_length": 5,'], "not JSON"),
        (["17"], "JSON object"),
        (['"a string"'], "JSON object"),
        (["null"], "JSON object"),
        (['{"timestamp": 0, "input_length": 5, "output_length": 1}'], "missing field 'hash_ids'"),
    ],
)
def test_hostile_trace_lines_name_file_and_line(tmp_path: Path, content: list[str] | bytes, needle: str):
    if isinstance(content, list):
        content = [_line(), *content]  # the bad line is line 2 (or line 1 for raw bytes starting bad)
    p = _trace(tmp_path, content)
    with pytest.raises(TraceFormatError) as info:
        load_trace(p)
    msg = str(info.value)
    assert needle in msg
    assert msg.startswith(f"{p}:"), msg
    if isinstance(content, list):
        assert msg.startswith(f"{p}:2:"), msg


@pytest.mark.parametrize(
    "content",
    [
        [_line(hash_ids=[1, True, 3])],
        ["[" * 100_000 + "]" * 100_000],
        b"\xff\xfe\n",
    ],
    ids=["bool-hash-ids", "deep-nesting", "non-utf8"],
)
def test_hostile_trace_through_the_cli_is_one_line(tmp_path: Path, capsys, content: list[str] | bytes):
    p = _trace(tmp_path, content)
    rc, out, err = _run(["--trace", str(p), "--no-progress"], capsys)
    _assert_one_line_error(rc, out, err, "argument --trace:", f"{p}:1:")


def test_trace_paths_that_are_not_files(tmp_path: Path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        load_trace(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_mooncake_trace(_trace(tmp_path, ["", "   "]))
    if Path("/dev/zero").exists():
        with pytest.raises(TraceFormatError, match="not a regular file"):
            load_trace("/dev/zero")  # would never end


def test_mooncake_without_a_trace_names_the_variable(monkeypatch, capsys):
    import kvforge.sim.cli as cli

    monkeypatch.setattr(cli, "default_trace_path", lambda: None)
    rc, out, err = _run(["--trace", "mooncake", "--no-progress"], capsys)
    _assert_one_line_error(rc, out, err, "argument --trace:", "KVFORGE_TRACE")


@pytest.mark.parametrize("make", ["file", "under-file", "summary-dir", "load-png-dir"])
def test_out_is_checked_before_simulating(tmp_path: Path, capsys, monkeypatch, make: str):
    import kvforge.sim.cli as cli

    ran = []
    monkeypatch.setattr(cli, "simulate", lambda *a, **k: ran.append(1))
    target = tmp_path / "out"
    if make == "file":
        target.write_text("x")
    elif make == "under-file":
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "a" / "b"
    else:
        (target / ("summary.csv" if make == "summary-dir" else "load.png")).mkdir(parents=True)
    rc, out, err = _run([*SHORT, "--out", str(target)], capsys)
    _assert_one_line_error(rc, out, err, "argument --out:")
    assert not ran  # refused before the first simulation


# --- issue 21, items 4 and 5 --------------------------------------------------------------------------------------


def test_version(capsys):
    from kvforge import __version__

    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and out.strip().startswith("kvforge ") and out.strip().split()[1][0].isdigit()
    assert __version__ in out or out.strip() != "kvforge "


@pytest.mark.parametrize("argv", [["--help"], ["simulate", "--help"], ["selfcheck", "--help"]])
def test_help_is_plain_text_and_shows_defaults(argv: list[str], capsys):
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    for markup in ("``", ":func:", ":class:", ":mod:", ":data:"):
        assert markup not in out, markup
    if argv[0] == "simulate":
        text = " ".join(out.split())
        for flag, default in (
            ("--gpus-per-server", "(8)"),
            ("--matmul-tflops", "1289.6"),
            ("--attention-tflops", "625"),
            ("--hbm-gbps", "4096"),
        ):
            after = text.split(flag, 2)[-1]  # the option's line in the listing, after the usage line
            assert default in after.split("--", 1)[0], (flag, after[:200])


def test_progress_bar_is_off_when_stderr_is_not_a_terminal(capsys):
    rc, _, err = _run(["--conversations", "6", "--servers", "2", "--router", "conversation"], capsys)
    assert rc == 0 and err == ""  # no tqdm output on a pipe, without --no-progress


def test_summary_and_load_csv_columns(tmp_path: Path, capsys):
    rc, _, err = _run([*SHORT, "--router", "conversation,round-robin", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    with (tmp_path / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    cols = summary[0].keys()
    for c in ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "throughput_tok_per_s", "makespan_s"):
        assert c in cols
    assert not {"ttft_p50", "itl_p99", "load_imbalance_p99"} & set(cols)
    for r in summary:
        for k, v in r.items():
            if k not in ("policy", "snapshot_policy", "workload", "model", "exact_demotion"):
                assert math.isfinite(float(v)), (k, v)  # every figure is a number
        assert float(r["itl_p99_ms"]) >= float(r["itl_p50_ms"]) > 0
    with (tmp_path / "load.csv").open() as f:
        load = list(csv.DictReader(f))
    runs = {(r["policy"], r["snapshot_policy"]) for r in summary}
    assert {(r["policy"], r["snapshot_policy"]) for r in load} == runs
    assert {p.name for p in tmp_path.iterdir()} >= set(OUT_FILES) - {"policies.png", "load.png"}


def test_percentiles_are_numpys():
    rng = np.random.default_rng(3)
    xs = rng.exponential(size=101).tolist()
    for q in (0, 50, 99, 100):
        assert percentile(xs, q) == float(np.percentile(xs, q))
    w = rng.integers(1, 5, size=101).tolist()
    assert percentile(xs, 99, w) == float(np.percentile(xs, 99, weights=w, method="inverted_cdf"))
    assert math.isnan(percentile([], 50))


def test_selfcheck_rows_name_their_unit():
    import torch

    from kvforge.kernels._selfcheck import format_table, timed_check

    rows = [
        timed_check("a", torch.device("cpu"), "-", lambda: (0.5, True), unit="x tol"),
        timed_check("b", torch.device("cpu"), "-", lambda: (3.0, False), unit="mismatched entries"),
        timed_check("c", torch.device("cpu"), "-", lambda: (1e-3, True)),
    ]
    table = format_table(rows).splitlines()
    assert "err unit" in table[0]
    assert "x tol" in table[2] and "mismatched entries" in table[3] and " abs " in table[4]


# --- issue 32, item 5: a hostile trace line, --out probed by doing, no prefix matching, integer bounds -------------


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` NUL bytes and no newline (one line), sparse so it costs no disk."""
    with path.open("wb") as f:
        f.truncate(size)
    return path


def test_a_trace_line_over_the_limit_is_refused_after_a_bounded_read(tmp_path: Path):
    import tracemalloc

    from kvforge.kvcache.replay import MAX_TRACE_LINE_BYTES

    p = _sparse(tmp_path / "one_line.jsonl", 64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError) as info:
            load_trace(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value).startswith(f"{p}:1: line longer than"), info.value
    assert peak < 4 * MAX_TRACE_LINE_BYTES, peak  # the old reader held the whole 64 MiB line


def test_a_line_at_the_limit_is_read_and_the_next_line_is_numbered(tmp_path: Path):
    from kvforge.kvcache.replay import MAX_TRACE_LINE_BYTES

    first = _line()
    first = first[:-1] + " " * (MAX_TRACE_LINE_BYTES - len(first)) + "}"
    assert len(first.encode()) == MAX_TRACE_LINE_BYTES
    p = _trace(tmp_path, [first, _line(), _line() + " " * MAX_TRACE_LINE_BYTES])
    with pytest.raises(TraceFormatError, match=r":3: line longer than"):
        load_trace(p)
    assert len(load_trace(p, limit=2)) == 2


@pytest.mark.timeout(60)
def test_a_2_gib_trace_line_through_the_cli_is_one_line_and_exit_2(tmp_path: Path, capsys):
    p = _sparse(tmp_path / "huge.jsonl", 2 << 30)
    rc, out, err = _run(["--trace", str(p), "--no-progress"], capsys)
    _assert_one_line_error(rc, out, err, "argument --trace:", f"{p}:1: line longer than")


def test_out_is_probed_by_creating_a_file_even_when_permission_bits_say_yes(tmp_path: Path, capsys, monkeypatch):
    """Root passes every ``os.access`` check; ``/proc/foo`` (as root) or a read-only folder must still fail up
    front, before anything is simulated."""
    import os

    import kvforge.sim.cli as cli

    ran = []
    monkeypatch.setattr(cli, "simulate", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # what root sees
    if os.geteuid() == 0 and Path("/proc/self").exists():
        target = Path("/proc/kvforge-out-probe")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "out"
    rc, out, err = _run([*SHORT, "--out", str(target)], capsys)
    _assert_one_line_error(rc, out, err, "argument --out:", "cannot create a file there")
    assert not ran


def test_out_probe_leaves_nothing_behind(tmp_path: Path):
    from kvforge.sim.cli import check_out_dir

    nested = tmp_path / "a" / "b" / "c"
    check_out_dir(nested)
    assert list(tmp_path.iterdir()) == []  # the folders it made to probe are gone again
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "summary.csv").write_text("old")
    check_out_dir(tmp_path / "kept")
    assert [q.name for q in (tmp_path / "kept").iterdir()] == ["summary.csv"]
    assert (tmp_path / "kept" / "summary.csv").read_text() == "old"


@pytest.mark.parametrize(
    "argv",
    [
        ["--server", "8"],
        ["simulate", "--server", "8"],
        ["--conv", "3"],
        ["simulate", "--no-prog"],
        ["router", "--back", "http://h:1"],
    ],
)
def test_no_prefix_matching_of_options(argv: list[str], capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "unrecognized arguments" in err, err
    assert "Traceback" not in err


def _parser_tree() -> list[argparse.ArgumentParser]:
    """Every parser ``kvforge`` builds: the top one, caught as it parses, and each subcommand's."""
    import kvforge.__main__ as entry

    class Caught(Exception):
        pass

    seen: list[argparse.ArgumentParser] = []

    def catch(self, *a, **k):
        seen.append(self)
        raise Caught

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        with pytest.raises(Caught):
            entry.main(["--help"])
    finally:
        argparse.ArgumentParser.parse_args = orig  # type: ignore[method-assign]
    todo, out = list(seen), []
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return out


def test_every_parser_refuses_abbreviations():
    parsers = _parser_tree()
    names = {p.prog for p in parsers}
    assert {"kvforge", "kvforge simulate", "kvforge selfcheck", "kvforge router"} <= names, names
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers if p.allow_abbrev]
    from kvforge.sim import cli

    assert cli._Parser(prog="x").allow_abbrev is False  # ``python -m kvforge.sim.cli``


def test_no_other_argument_parser_in_kvforge():
    """A parser built anywhere else in kvforge/ must pass allow_abbrev=False itself."""
    import ast

    root = Path(__file__).resolve().parents[1] / "kvforge"
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if name == "ArgumentParser" and not any(
                    k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                ):
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not bad, bad


@pytest.mark.parametrize("flag", sorted(INTS))
def test_integer_bounds_print_as_integers(flag: str, capsys):
    lo, hi = LIMITS[flag]
    rc, out, err = _run([*SHORT, f"{flag}={int(lo) - 1}"], capsys)
    _assert_one_line_error(rc, out, err, f"argument {flag}:", f"[{int(lo)}, {int(hi)}]")
    assert "e+" not in err


def test_seed_minus_one_names_the_bound_exactly(capsys):
    rc, out, err = _run([*SHORT, "--seed", "-1"], capsys)
    _assert_one_line_error(rc, out, err, "argument --seed:", "[0, 9223372036854775807]", "'-1'")
