"""``Scheduler.on_step_done``'s argument checks: a cheap first pass per entry, the detailed checks for an entry
that fails it. Each bad entry is refused with the error naming it, before anything changes, exactly as the
detailed checks word it; good entries of any accepted form still go through."""

from __future__ import annotations

import enum

import pytest

from kvforge.scheduling import Request
from tests.test_scheduler_keys import _sched


class _Tok(enum.IntEnum):
    SEVEN = 7


def _two_decoding(draft_len: int = 1):
    s, mgr = _sched(4, vocab_size=1000)
    for rid, first in (("a", 1), ("b", 50)):  # different prompts: no prefix wait
        s.add_request(Request(rid, tokens=[first, 2, 3, 4, 5], max_new_tokens=6, draft_len=draft_len))
    b = s.schedule()
    s.on_step_done(b, new_tokens={"a": [9], "b": [9]})  # both prompts done: the next step verifies 2 tokens each
    b = s.schedule()
    assert [x.num_tokens for x in b.generation] == [2, 2]
    return s, mgr, b


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"accepted_tokens": {"zz": 1}}, ValueError, r"accepted_tokens: 'zz' is not a generation request"),
        ({"accepted_tokens": {"a": True}}, TypeError, r"accepted_tokens\['a'\]: expected an int, got bool"),
        ({"accepted_tokens": {"a": 1.0}}, TypeError, r"accepted_tokens\['a'\]: expected an int, got float"),
        ({"accepted_tokens": {"a": 0}}, ValueError, r"accepted_tokens\['a'\]: expected an int >= 1, got 0"),
        ({"accepted_tokens": {"b": 3}}, ValueError, r"accepted_tokens\['b'\]: 3 exceeds the 2 tokens scheduled"),
        ({"new_tokens": {"zz": [1]}}, ValueError, r"new_tokens: 'zz' is not part of this batch"),
        ({"new_tokens": {"a": "x"}}, TypeError, r"new_tokens\['a'\]: expected a sequence of ints, got str"),
        ({"new_tokens": {"a": [1, 2]}}, ValueError, r"new_tokens\['a'\]: this step emits 1 tokens, got 2 ids"),
        ({"new_tokens": {"a": [True]}}, TypeError, r"new_tokens\['a'\]: expected ints, got bool"),
        ({"new_tokens": {"a": [1000]}}, ValueError, r"new_tokens\['a'\]: expected token ids in \[0, 1000\), got 1000"),
        ({"accepted_tokens": {"a": 2}, "new_tokens": {"a": [1]}}, ValueError, r"this step emits 2 tokens, got 1"),
    ],
)
def test_bad_entries_are_refused_before_any_change(kw: dict, exc: type, match: str) -> None:
    s, mgr, b = _two_decoding()
    before = (mgr.state_snapshot(), [(r.num_generated, list(r.output_tokens)) for r in s.running])
    with pytest.raises(exc, match=match):
        s.on_step_done(b, **kw)
    assert (mgr.state_snapshot(), [(r.num_generated, list(r.output_tokens)) for r in s.running]) == before


def test_good_entries_of_every_form_go_through() -> None:
    s, _, b = _two_decoding()
    # A tuple, and an int subclass: not the fast path's plain list of ints, still valid for the detailed checks.
    s.on_step_done(b, accepted_tokens={"a": 2, "b": 1}, new_tokens={"a": (3, 4), "b": [_Tok.SEVEN]})
    a, bb = (r for r in s.running)
    assert (a.output_tokens, a.num_generated) == ([9, 3, 4], 3)
    assert (bb.output_tokens, bb.num_generated) == ([9, 7], 2)
