"""Regressions of issue 17 (block identity, cache and scheduler defects): each test failed on the code at 0475e71."""

from __future__ import annotations

from kvforge.scheduling import Request, RequestState
from tests.test_scheduler import assert_nothing_held, drain, make_sched


def test_prompt_len_alone_is_accepted_and_runs() -> None:
    # Documented as valid ("prompt_len alone"), but add_request refused it: 0 keys for 25 full blocks.
    s, mgr = make_sched(pages=64)
    req = Request("anon", prompt_len=100, max_new_tokens=3)
    assert req.keyless and req.known_tokens() == 0
    s.add_request(req)
    drain(s, mgr)
    assert req.state is RequestState.DONE and req.num_generated == 3
    assert mgr.tree.num_blocks == 0  # nothing to key, nothing committed
    assert_nothing_held(mgr)
