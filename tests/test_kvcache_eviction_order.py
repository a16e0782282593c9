"""PrioritizedLRU picks the same victims, in the same order, as a plain min over its ordering key (also through
``add_unless_next``, the block pool's shortcut for add-then-pop)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.kvcache import PrioritizedLRU
from kvforge.kvcache.pools import Page

N_PAGES = 24

op = st.one_of(
    # add: page, priority (few values, so ties on priority are common), clock step (mostly rising), depth
    st.tuples(
        st.sampled_from(["add", "add", "add_unless_next"]),
        st.integers(0, N_PAGES - 1),
        st.sampled_from([35, 35, 35, 10, 90]),
        st.integers(-3, 4),
        st.integers(0, 5),
    ),
    st.tuples(st.just("discard"), st.integers(0, N_PAGES - 1)),
    st.tuples(st.just("pop"), st.sampled_from([None, 2, 3])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=120))
def test_victims_follow_priority_then_recency_then_depth(ops: list[tuple]) -> None:
    pool = SimpleNamespace()
    pool.pages = [Page(pool, i) for i in range(N_PAGES)]  # type: ignore[arg-type]
    policy = PrioritizedLRU()
    model: dict[int, tuple[int, int, int, int]] = {}  # page index -> (priority, last_used, -depth, add order)
    clock = adds = 0
    for o in ops:
        if o[0] in ("add", "add_unless_next"):
            kind, i, prio, step, depth = o
            page = pool.pages[i]
            if i in model:
                continue
            clock = max(0, clock + step)
            page.priority, page.last_used = prio, clock
            page.block = SimpleNamespace(depth=depth)
            adds += 1
            key = (prio, clock, -depth, adds)
            if kind == "add":
                policy.add(page)
                model[i] = key
            else:
                taken = policy.add_unless_next(page)
                # Taken only when it would have been the next victim (it is then no candidate); else added, and
                # taken always when nothing at all (not even a lazily deleted entry) sorts before it.
                next_victim = all(key < k for k in model.values())
                assert not taken or next_victim
                if not model and not policy._heap and not policy._run:
                    assert taken
                if taken:
                    assert page.policy_data is None and page not in policy
                else:
                    model[i] = key
        elif o[0] == "discard":
            policy.discard(pool.pages[o[1]])
            model.pop(o[1], None)
        else:
            mod = o[1]
            accept = None if mod is None else (lambda p, m=mod: p.index % m == 0)
            want = min(((k, i) for i, k in model.items() if mod is None or i % mod == 0), default=None)
            got = policy.pop_victim(accept)
            if want is None:
                assert got is None
            else:
                assert got is pool.pages[want[1]]
                del model[want[1]]
        assert len(policy) == len(model)
        assert [p.index for p in policy.ordered()] == sorted(model, key=model.__getitem__)
