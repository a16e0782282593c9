"""The engine's fused elementwise kernels against their plain-torch references.

rms_norm (+ residual add), swiglu, rotary (table, in place and into a strided slice), greedy_accept (argmax +
draft acceptance), kda_prepare (KDA's norms and gates from one fused projection), mla_latent_store (MLA's
latent rows normed, rotated and stored into their pages). Fresh random data per test,
awkward (non power-of-two) sizes, NaN-poisoned outputs (every element must be written); the interpreter on CPU
at small sizes, the GPU at full sizes (``full_sizes``); ``gpu``-marked tests at the real model's sizes.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels._runtime import interpreting
from kvforge.kernels.greedy_accept import greedy_accept, greedy_accept_ref
from kvforge.kernels.kda_prep import kda_prepare, kda_prepare_ref
from kvforge.kernels.mla_latent import mla_latent_store, mla_latent_store_ref
from kvforge.kernels.rms_norm import rms_norm, rms_norm_ref
from kvforge.kernels.rotary import rotary, rotary_ref, rotary_table
from kvforge.kernels.swiglu import swiglu, swiglu_ref
from tests.tolerances import TOL

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOL[dtype]  # the kernels compute in fp32 and round the output once
    return dict(atol=atol, rtol=rtol)


def _nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(gen, device, full_sizes, dtype, residual) -> None:
    n, d = (77, 2560) if full_sizes else (5, 37)
    big = torch.randn(n, d + 3, generator=gen).to(device, dtype)
    x = big[:, 1 : d + 1]  # a strided view: row stride d + 3
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype)
    r = torch.randn(n, d, generator=gen).to(device, dtype) if residual else None
    out, sum_out = _nan((n, d), dtype, device), _nan((n, d), dtype, device)
    got = rms_norm(x, w, 1e-6, residual=r, out=out, sum_out=sum_out if residual else None)
    want = rms_norm_ref(x, w, 1e-6, residual=r)
    if residual:
        assert isinstance(got, tuple) and isinstance(want, tuple)
        torch.testing.assert_close(got[1].float(), want[1].float(), **_tol(dtype))
        got, want = got[0], want[0]
    assert got is out and not bool(out.isnan().any())
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(gen, device, full_sizes, dtype) -> None:
    n, i = (33, 6912) if full_sizes else (3, 1100)
    gu = torch.randn(n, 2 * i, generator=gen).to(device, dtype) * 3
    g, u = gu[:, :i], gu[:, i:]
    out = _nan((n, i), dtype, device)
    assert swiglu(g, u, out=out) is out
    torch.testing.assert_close(out.float(), swiglu_ref(g, u).float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_and_into_a_slice(gen, device, full_sizes, dtype) -> None:
    t, h, r = (301, 20, 64) if full_sizes else (7, 3, 12)
    inv = 1.0 / (10000.0 ** (torch.arange(r // 2, dtype=torch.float32) / (r // 2)))
    table = rotary_table(inv.to(device), 5000)
    pos = torch.randint(0, 5000, (t,), generator=gen).to(device)
    q = torch.randn(t, h, 128 + r, generator=gen).to(device, dtype)
    x = q[..., 128:]
    want = rotary_ref(x, pos, inv.to(device))
    into = _nan((t, h, r + 5), dtype, device)[..., 2 : 2 + r]
    rotary(x, pos, table, out=into)
    torch.testing.assert_close(into.float(), want.float(), **_tol(dtype))
    before_nope = q[..., :128].clone()
    assert rotary(x, pos, table, out=x) is x  # in place, through the strided view
    torch.testing.assert_close(x.float(), want.float(), **_tol(dtype))
    assert torch.equal(q[..., :128], before_nope)
    flat = torch.randn(t, r, generator=gen).to(device, dtype)
    torch.testing.assert_close(
        rotary(flat, pos.int(), table).float(), rotary_ref(flat, pos, inv.to(device)).float(), **_tol(dtype)
    )


@pytest.mark.parametrize("t", [1, 2, 3])
def test_greedy_accept(gen, device, full_sizes, t) -> None:
    b, v = (67, 32768) if full_sizes else (5, 3001)
    logits = torch.randn(b, t, v, generator=gen).to(device)
    # Ties across blocks (the first index wins), a NaN, an all -inf row.
    logits[0, 0, 5] = logits[0, 0, v - 3] = 100.0
    logits[1, 0, 17] = float("nan")
    logits[2, -1] = float("-inf")
    best_ref, _ = greedy_accept_ref(logits, torch.zeros(b, t, dtype=torch.int64))
    # Drafts: agree with the target for a random prefix of each row, then disagree.
    tokens = torch.randint(0, v, (b, t), generator=gen)
    keep = torch.randint(0, t, (b,), generator=gen)
    for i in range(b):
        for j in range(1, t):
            tokens[i, j] = best_ref[i, j - 1] if j <= keep[i] else (best_ref[i, j - 1] + 1) % v
    tokens = tokens.to(device)
    best_out, acc_out = (
        torch.full((b, t), -7, dtype=torch.int32, device=device),
        torch.full((b,), -7, dtype=torch.int32, device=device),
    )
    best, acc = greedy_accept(logits, tokens, best=best_out, accepted=acc_out)
    want_best, want_acc = greedy_accept_ref(logits, tokens)
    assert best is best_out and acc is acc_out
    assert torch.equal(best.cpu(), want_best) and torch.equal(acc.cpu(), want_acc)
    assert int(best[0, 0]) == 5 and int(best[1, 0]) == 17 and int(best[2, -1]) == 0
    assert torch.equal(acc.cpu(), (keep + 1).clamp(max=t).int())
    # Per-request caps (a last step with fewer tokens left than T): acceptance stops there, the choices do not.
    limits = torch.randint(1, t + 1, (b,), generator=gen, dtype=torch.int32)
    best2, acc2 = greedy_accept(logits, tokens, limits=limits.to(device))
    assert torch.equal(best2.cpu(), want_best)
    assert torch.equal(acc2.cpu(), torch.minimum(want_acc, limits))
    assert torch.equal(greedy_accept_ref(logits, tokens, limits)[1], torch.minimum(want_acc, limits))


def _kda_proj(gen, t: int, h: int, k: int, dtype, device, pad: int = 3) -> torch.Tensor:
    """A ``[t, 4hk + h]`` projection as a strided view (one column in, row stride ``4hk + h + 1 + pad``), with a
    spread of gate values that crosses softplus's threshold and a zero head (the norm's eps) in row 0."""
    n = 4 * h * k + h
    big = torch.randn(t, n + 1 + pad, generator=gen) * 3
    big[:, 1 + 3 * h * k : 1 + 4 * h * k] *= 10  # gates from about -60 to 60: both sides of the threshold
    big[0, 1 : 1 + k] = 0.0  # q of head 0 at token 0 is zero: F.normalize keeps it zero
    return big.to(device, dtype)[:, 1 : n + 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_prepare(gen, device, full_sizes, dtype) -> None:
    t, h, k = (67, 20, 128) if full_sizes else (5, 3, 24)  # 24: not a power of two (masked lanes)
    proj = _kda_proj(gen, t, h, k, dtype, device)
    outs = tuple(
        _nan(s, d, device) for s, d in (((t, h, k), dtype),) * 3 + (((t, h, k), torch.float32), ((t, h), torch.float32))
    )
    got = kda_prepare(proj, h, k, -2.0, out=outs)  # type: ignore[arg-type]
    want = kda_prepare_ref(proj, h, k, -2.0)
    assert all(a is b for a, b in zip(got, outs))
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert not bool(a.isnan().any()), name
        torch.testing.assert_close(a.float(), b.float(), **_tol(a.dtype), msg=name)
    assert torch.equal(got[2], want[2])  # v is a copy
    assert bool((got[0][0, 0] == 0).all())
    # Allocated outputs, another bias: the gate moves with it.
    q2, _, _, g2, b2 = kda_prepare(proj, h, k, 1.5)
    torch.testing.assert_close(g2, kda_prepare_ref(proj, h, k, 1.5)[3], **_tol(torch.float32))
    assert q2.is_contiguous() and g2.dtype == torch.float32 and b2.shape == (t, h)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 128])
def test_kda_prepare_real_sizes_gpu(gen, rows) -> None:
    """The real model's KDA layer (20 heads x 128) at decode batch sizes, bf16, against the fp32 reference."""
    proj = _kda_proj(gen, rows, 20, 128, torch.bfloat16, torch.device("cuda"), pad=0)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), kda_prepare(proj, 20, 128), kda_prepare_ref(proj, 20, 128)):
        torch.testing.assert_close(a.float(), b.float(), **_tol(a.dtype), msg=name)


def _latent_case(gen, t: int, r: int, rope: int, pages: int, tpb: int, dtype, device):
    big = torch.randn(t, 7 + r + rope + 2, generator=gen) * 2
    kv = big.to(device, dtype)[:, 7 : 7 + r + rope]  # a strided view, as the kv_a columns of a fused GEMM
    w = (1 + 0.1 * torch.randn(r, generator=gen)).to(device, dtype)
    inv = (1.0 / (10000.0 ** (torch.arange(rope // 2, dtype=torch.float32) / (rope // 2)))).to(device)
    table = rotary_table(inv, 4000)
    pos = torch.randint(0, 4000, (t,), generator=gen).to(device)
    rows = torch.randperm(pages * tpb, generator=gen)[:t].to(device)  # distinct rows, scattered over the pages
    pool = _nan((pages, tpb, r + rope), dtype, device)
    return kv, w, inv, table, pos, rows, pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_latent_store(gen, device, full_sizes, dtype) -> None:
    t, r, rope = (77, 512, 64) if full_sizes else (6, 40, 12)  # 40 and 6 pairs: masked lanes in both parts
    kv, w, inv, table, pos, rows, pool = _latent_case(gen, t, r, rope, t // 4 + 3, 4, dtype, device)
    mla_latent_store(kv, w, pos, table, pool, rows.int(), check_values=True)
    flat = pool.view(-1, r + rope)
    torch.testing.assert_close(flat[rows].float(), mla_latent_store_ref(kv, w, pos, inv).float(), **_tol(dtype))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[rows] = False
    assert bool(flat[untouched].isnan().all())  # only the named rows are written
    # The values the unfused kernels write (rms_norm into the latent columns, rotary into the rope ones); on a GPU
    # the sum's order and FMA contraction may differ by an ulp, so at the dtype's tolerance.
    y = rms_norm(kv[:, :r], w)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(flat[rows][:, :r], y, **_tol(dtype))
    torch.testing.assert_close(flat[rows][:, r:], rotary(kv[:, r:], pos, table), **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 128])
def test_mla_latent_store_real_sizes_gpu(gen, rows) -> None:
    """The real model's latent row (512 + 64) in bf16 at decode batch sizes over a 64-token-page pool."""
    kv, w, inv, table, pos, idx, pool = _latent_case(gen, rows, 512, 64, 300, 64, torch.bfloat16, torch.device("cuda"))
    mla_latent_store(kv, w, pos, table, pool, idx)
    got = pool.view(-1, 576)[idx]
    torch.testing.assert_close(got.float(), mla_latent_store_ref(kv, w, pos, inv).float(), **_tol(torch.bfloat16))


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: rms_norm(torch.randn(3, 4), torch.randn(5)), ValueError, "weight"),
        (lambda: rms_norm(torch.randn(3, 4).int(), torch.randn(4)), TypeError, "x"),
        (lambda: rms_norm(torch.randn(3, 4), torch.randn(4), float("nan")), ValueError, "eps"),
        (lambda: rms_norm(torch.randn(3, 4), torch.randn(4), residual=torch.randn(3, 5)), ValueError, "residual"),
        (lambda: rms_norm(torch.randn(3, 4), torch.randn(4), sum_out=torch.randn(3, 4)), ValueError, "sum_out"),
        (lambda: (lambda x: rms_norm(x, torch.randn(4), out=x))(torch.randn(3, 4)), ValueError, "overlap"),
        (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 5)), ValueError, "up"),
        (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 4).half()), TypeError, "up"),
        (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 4), out=torch.randn(3, 4).t()), ValueError, "out"),
        (lambda: rotary(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), torch.zeros(9, 5)), ValueError, "even"),
        (
            lambda: rotary(torch.randn(3, 4), torch.zeros(2, dtype=torch.long), torch.zeros(9, 4)),
            ValueError,
            "positions",
        ),
        (lambda: rotary(torch.randn(3, 4), torch.zeros(3), torch.zeros(9, 4)), TypeError, "positions"),
        (
            lambda: rotary(torch.randn(3, 4), torch.tensor([0, 9, 1]), torch.zeros(9, 4), check_values=True),
            ValueError,
            "positions",
        ),
        (lambda: greedy_accept(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long)), ValueError, "logits"),
        (lambda: greedy_accept(torch.randn(2, 3, 9), torch.zeros(2, 2, dtype=torch.long)), ValueError, "tokens"),
        (lambda: greedy_accept(torch.randn(2, 1, 9), torch.zeros(2, 1)), TypeError, "tokens"),
        (lambda: rms_norm(torch.empty(3, 4, device="meta"), torch.randn(4)), ValueError, "meta"),
        (lambda: swiglu(torch.empty(3, 4, device="meta"), torch.empty(3, 4, device="meta")), ValueError, "meta"),
        (lambda: _latent_bad(w=torch.randn(0)), ValueError, "weight"),
        (lambda: _latent_bad(kv=torch.randn(3, 11)), ValueError, "kv"),
        (lambda: _latent_bad(kv=torch.randn(3, 12).half()), TypeError, "pool"),
        (lambda: _latent_bad(pos=torch.zeros(2, dtype=torch.long)), ValueError, "positions"),
        (lambda: _latent_bad(pos=torch.zeros(3)), TypeError, "positions"),
        (lambda: _latent_bad(rows=torch.tensor([0, 1, 99])), ValueError, "rows"),
        (lambda: _latent_bad(pos=torch.tensor([0, 9, 1])), ValueError, "positions"),
        (lambda: _latent_bad(table=torch.zeros(9, 6)), ValueError, "cos_sin"),
        (lambda: _latent_bad(pool=torch.zeros(2, 4, 13)), ValueError, "pool"),
        (lambda: _latent_bad(eps=-1.0), ValueError, "eps"),
        (lambda: kda_prepare(torch.randn(3, 17), 2, 2), ValueError, "proj"),
        (lambda: kda_prepare(torch.randn(3, 18).int(), 2, 2), TypeError, "proj"),
        (lambda: kda_prepare(torch.randn(3, 18), 2.0, 2), TypeError, "num_heads"),
        (lambda: kda_prepare(torch.randn(3, 18), 0, 2), ValueError, "num_heads"),
        (lambda: kda_prepare(torch.randn(3, 4 * 2048 + 1), 1, 2048), ValueError, "head_dim"),
        (lambda: kda_prepare(torch.randn(3, 18), 2, 2, float("nan")), ValueError, "gate_bias"),
        (lambda: kda_prepare(torch.randn(3, 18), 2, 2, float("inf")), ValueError, "gate_bias"),
        (lambda: kda_prepare(torch.randn(3, 18).t(), 2, 2), ValueError, "proj"),
        (lambda: kda_prepare(torch.randn(3, 18), 2, 2, out=torch.empty(3)), TypeError, "out"),
        (
            lambda: kda_prepare(
                torch.randn(3, 18),
                2,
                2,
                out=(*[torch.empty(3, 2, 2)] * 3, torch.empty(3, 2, 2).half(), torch.empty(3, 2)),
            ),
            TypeError,
            "out \\(g\\)",
        ),
        (
            lambda: (
                lambda p: kda_prepare(
                    p, 2, 2, out=(p.view(-1)[:12].view(3, 2, 2), *[torch.empty(3, 2, 2)] * 3, torch.empty(3, 2))
                )
            )(torch.randn(3, 18)),
            ValueError,
            "overlap",
        ),
    ],
)
@pytest.mark.skipif(not interpreting(), reason="the cases build CPU tensors (interpreter only)")
def test_bad_input_is_refused(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def _latent_bad(**kw) -> None:
    """mla_latent_store on a valid small case (r 8, rope 4, a 2 x 4 pool, rows checked) with ``kw`` replaced."""
    args = dict(kv=torch.randn(3, 12), w=torch.randn(8), pos=torch.tensor([0, 1, 2]), table=torch.zeros(9, 4))
    args.update(pool=torch.zeros(2, 4, 12), rows=torch.tensor([0, 5, 7]), eps=1e-6)
    args.update(kw)
    mla_latent_store(
        args["kv"], args["w"], args["pos"], args["table"], args["pool"], args["rows"], args["eps"], check_values=True
    )
