"""kvforge serve's warm-up: on a GPU it captures every decode-graph bucket before the server listens (a bucket's
first use would otherwise capture it inside a live step, and the step-time profile captures them all first)."""

from __future__ import annotations

import argparse

import pytest

from kvforge.serve.cli import add_arguments, build


def _built(*flags: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    loop, _ = build(p.parse_args(["--model", "tiny", *flags]))
    return loop.engine


@pytest.mark.gpu
def test_warmup_captures_every_bucket():
    graphs = _built("--device", "cuda", "--max-num-requests", "8").graphs
    assert graphs is not None and sorted(graphs._graphs) == list(graphs.buckets)


@pytest.mark.gpu
def test_no_warmup_captures_nothing():
    graphs = _built("--device", "cuda", "--max-num-requests", "8", "--no-warmup").graphs
    assert graphs is not None and not graphs._graphs
