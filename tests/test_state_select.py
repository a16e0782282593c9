"""select_accepted_states against its reference, and the in-place KDA decode/verify path against the gather path.

* The kernel copies ``pool[scratch[n, a - 2]]`` into ``pool[live[n]]`` for rows with ``a >= 2`` and touches no
  other row: fresh random pools (NaN-poisoned rows that must stay NaN), awkward row sizes and counts.
* ``kda_recurrent_inplace`` (fla-core's kernel with ``ssm_state_indices`` and ``inplace_final_state``, under the
  interpreter here; and the CPU torch loop) equals ``kda_tokens`` fed gathered states: outputs, the state after
  every token in its row, every other row untouched.
* ``kda_segments``'s short-prefill path (fla-core's varlen recurrent kernel, interpreter here) equals its torch
  loop over segments, an empty segment included: outputs and final states, in bf16 as the engine runs it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.engine.ops import kda_recurrent_inplace, kda_segments, kda_tokens
from kvforge.kernels.state_select import select_accepted_states, select_accepted_states_ref


def _case(gen: torch.Generator, device, rows: int, n: int, t: int, inner: tuple[int, ...]):
    pool = torch.randn(rows, *inner, generator=gen).to(device)
    perm = torch.randperm(rows, generator=gen)
    live = perm[:n].to(torch.int32)
    scratch = perm[n : n + n * (t - 1)].view(n, t - 1).to(torch.int32)
    accepted = torch.randint(1, t + 1, (n,), generator=gen, dtype=torch.int32)
    return pool, live.to(device), scratch.to(device), accepted.to(device)


@pytest.mark.parametrize(("rows", "n", "t", "inner"), [(11, 3, 2, (5, 7)), (40, 6, 4, (3, 3, 37)), (9, 1, 3, (2101,))])
def test_select_matches_the_reference(gen, device, rows, n, t, inner) -> None:
    for _ in range(3):
        pool, live, scratch, acc = _case(gen, device, rows, n, t, inner)
        # Rows no request names are poisoned: they must come back NaN (nothing wrote them).
        named = set(live.tolist()) | set(scratch.flatten().tolist())
        idle = [r for r in range(rows) if r not in named]
        pool[idle] = float("nan")
        want = select_accepted_states_ref(pool, live, scratch, acc)
        select_accepted_states(pool, live, scratch, acc)
        assert torch.equal(pool.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
        assert bool(pool[idle].isnan().all())
        assert (acc >= 2).any() or (acc == 1).all()


def test_rejected_rows_copy_nothing(device) -> None:
    pool = torch.arange(6 * 4, dtype=torch.float32).view(6, 4).to(device)
    before = pool.clone()
    live = torch.tensor([0, 1], dtype=torch.int32, device=device)
    scratch = torch.tensor([[2], [3]], dtype=torch.int32, device=device)
    select_accepted_states(pool, live, scratch, torch.tensor([1, 1], dtype=torch.int32, device=device))
    assert torch.equal(pool, before)
    select_accepted_states(pool, live, scratch, torch.tensor([1, 2], dtype=torch.int32, device=device))
    assert torch.equal(pool[1], before[3]) and torch.equal(pool[0], before[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"accepted": [0, 1]}, "accepted: counts"),
        ({"accepted": [1, 3]}, "accepted: counts"),
        ({"live": [0, 0]}, "two requests"),
        ({"live": [0, 9]}, "live: row indices"),
        ({"scratch": [[2], [-1]]}, "scratch: row indices"),
    ],
)
def test_checked_values_are_refused_before_anything_changes(device, bad, match) -> None:
    pool = torch.randn(6, 4).to(device)
    before = pool.clone()
    args = {"live": [0, 1], "scratch": [[2], [3]], "accepted": [2, 2], **bad}
    t = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        select_accepted_states(pool, t["live"], t["scratch"], t["accepted"])
    assert torch.equal(pool, before)


def _kda_inputs(gen: torch.Generator, n: int, t: int, h: int, d: int):
    q = F.normalize(torch.randn(n, t, h, d, generator=gen), dim=-1)
    k = F.normalize(torch.randn(n, t, h, d, generator=gen), dim=-1)
    v = torch.randn(n, t, h, d, generator=gen)
    g = -F.softplus(torch.randn(n, t, h, d, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(n, t, h, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize(("n", "t", "h", "d"), [(3, 1, 2, 16), (5, 2, 3, 16), (2, 3, 1, 32)])
def test_inplace_recurrence_equals_the_gather_path(gen, device, use_kernel, n, t, h, d) -> None:
    """The kernel on the kernel device (interpreter on CPU), the torch loop on CPU."""
    dev = device if use_kernel else torch.device("cpu")
    rows = 2 * n * t + 3
    pool = torch.randn(rows, h, d, d, generator=gen).to(dev)
    perm = torch.randperm(rows, generator=gen)
    sidx = perm[: n * t].view(n, t).to(torch.int32).to(dev)
    q, k, v, g, beta = (x.to(dev) for x in _kda_inputs(gen, n, t, h, d))
    ref_o, after = kda_tokens(q, k, v, g, beta, pool[sidx[:, 0].long()])  # gathered states in, states out
    got = pool.clone()
    o = kda_recurrent_inplace(q, k, v, g, beta, got, sidx, use_kernel=use_kernel)
    torch.testing.assert_close(o.float(), ref_o.float(), rtol=1e-5, atol=1e-5)
    for i in range(t):
        torch.testing.assert_close(got[sidx[:, i].long()], after[i], rtol=1e-5, atol=1e-5)
    untouched = perm[n * t :].to(dev)
    assert torch.equal(got[untouched], pool[untouched])


def test_inplace_recurrence_refuses_bad_indices() -> None:
    q = torch.randn(2, 1, 1, 4)
    pool = torch.zeros(4, 1, 4, 4)
    with pytest.raises(ValueError, match="state_indices"):
        kda_recurrent_inplace(q, q, q, q, q[..., 0], pool, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="pool"):
        kda_recurrent_inplace(q, q, q, q, q[..., 0], pool.double(), torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("lens", [[5, 11, 7], [1], [9, 0, 4]])
def test_short_segments_recurrent_kernel_equals_the_loop(gen, device, lens) -> None:
    """The varlen recurrent kernel (every segment under ``recurrent_max``) against the CPU torch loop."""
    h, d = 2, 16
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = (x[0] for x in _kda_inputs(gen, 1, cu[-1], h, d))
    s0 = torch.randn(len(lens), h, d, d, generator=gen)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()  # the engine's dtypes: bf16 q/k/v, fp32 g/beta/states
    want_o, want_s = kda_segments(q, k, v, g, beta, s0, cu, use_kernel=False)
    dev = [x.to(device) for x in (q, k, v, g, beta, s0)]
    got_o, got_s = kda_segments(*dev, cu, use_kernel=True)
    assert got_o.dtype == v.dtype and got_s.dtype == torch.float32 and got_s.shape == s0.shape
    torch.testing.assert_close(got_o.float().cpu(), want_o.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_s.cpu(), want_s.float(), rtol=1e-3, atol=1e-3)
    if 0 in lens:  # an empty segment ends where it started
        assert torch.equal(got_s[lens.index(0)].cpu(), s0[lens.index(0)])


def test_kda_segments_refuses_a_bad_recurrent_max(gen) -> None:
    q, k, v, g, beta = (x[0] for x in _kda_inputs(gen, 1, 4, 1, 16))
    s0 = torch.zeros(1, 1, 16, 16)
    for bad, err in ((1.5, TypeError), (True, TypeError), ("8", TypeError), (-1, ValueError)):
        with pytest.raises(err, match="recurrent_max"):
            kda_segments(q, k, v, g, beta, s0, [0, 4], use_kernel=False, recurrent_max=bad)
    o, _ = kda_segments(q, k, v, g, beta, s0, [0, 4], use_kernel=False, recurrent_max=0)  # 0 is valid
    assert o.shape == v.shape
