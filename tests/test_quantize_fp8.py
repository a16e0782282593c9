"""quantize_fp8 against quantize_fp8_ref, bit for bit: dtypes, ranks, strided rows, token-major output, bad input."""

from __future__ import annotations

import pytest
import torch

import kvforge.kernels.quantize_fp8 as qmod
from kvforge.kernels._fp8 import E4M3_MAX
from kvforge.kernels.quantize_fp8 import quantize_fp8, quantize_fp8_ref
from tests.helpers import assert_all_written, poisoned

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SCALES = [1.0, 1.5, 2.0]


def _rand(shape, dtype, gen, device, spread=300.0) -> torch.Tensor:
    # Wide enough that some values saturate at ±448 and many land in e4m3's subnormal range. Drawn on the
    # device from a seed taken from the test's generator (full-size inputs are large).
    g = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    x = torch.randn(shape, generator=g, device=device) * spread * torch.rand(shape, generator=g, device=device) ** 4
    return x.to(dtype)


def _assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    bad = (g != w).nonzero()
    assert bad.shape[0] == 0, f"{bad.shape[0]} of {g.numel()} bytes differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (5, 33), (3, 4, 19), (2, 3, 2, 9), (1, 1, 129)])
def test_matches_reference(dtype, shape, device, gen):
    x = _rand(shape, dtype, gen, device)
    for s in SCALES:
        out = poisoned(shape, torch.float8_e4m3fn, device)
        got = quantize_fp8(x, s, out=out)
        assert got is out
        assert_all_written(out)
        _assert_bits(out, quantize_fp8_ref(x, s))


def test_scale_multiplies_not_divides(device):
    # The reference system's bug: a helper divided by its scale. 1.0 * 2 must become 2.0, not 0.5.
    x = torch.tensor([1.0, -3.0, 0.25], device=device)
    assert quantize_fp8(x, 2.0).float().tolist() == [2.0, -6.0, 0.5]
    s = torch.tensor([2.0], device=device)
    assert quantize_fp8(x, s).float().tolist() == [2.0, -6.0, 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_tensor_is_read_in_kernel(dtype, device, gen):
    x = _rand((11, 3, 40), dtype, gen, device)
    s = torch.tensor([1.5], dtype=torch.float32, device=device)
    _assert_bits(quantize_fp8(x, s), quantize_fp8_ref(x, 1.5))
    s.fill_(0.37)  # an awkward scale whose product rounds in fp32
    _assert_bits(quantize_fp8(x, s), quantize_fp8_ref(x, s))


def test_saturation_rounding_and_specials(device):
    edge = [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 465.0, 1e4, -1e30, float("inf"), float("-inf"), 31.625]
    edge += [1.95, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10, 2**-10 + 2**-20, 1e-30, 0.0625 * 1.0625]
    x = torch.tensor(edge, device=device)
    got = quantize_fp8(x, 1.0)
    _assert_bits(got, quantize_fp8_ref(x, 1.0))
    assert got.float().abs().max().item() == E4M3_MAX
    nan = quantize_fp8(torch.tensor([float("nan"), 1.0], device=device), 1.0)
    assert torch.isnan(nan.float()[0]) and nan.float()[1].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_v_slice_is_read_in_place(dtype, device, gen):
    kv = _rand((21, 3, 48 + 40), dtype, gen, device)
    v = kv[..., 48:]  # V sliced out of a wider K/V projection: rows strided, last dim contiguous
    v2 = kv.view(21, -1)[:, 7:60]  # 2-D strided rows
    for x in (v, v2):
        assert not x.is_contiguous()
        out = poisoned(x.shape, torch.float8_e4m3fn, device)
        quantize_fp8(x, 1.5, out=out)
        assert_all_written(out)
        _assert_bits(out, quantize_fp8_ref(x, 1.5))
    # The two row axes come straight from the view's strides: nothing was copied.
    lead = qmod._collapse(list(v.shape[:-1]), list(v.stride()[:-1]), [3 * 40, 40])
    assert lead == [(1, 0, 0), (63, 88, 40)]


def test_uncollapsible_layout_is_still_exact(device, gen):
    x = _rand((4, 5, 6, 7), torch.float32, gen, device).permute(1, 0, 2, 3)  # last dim still contiguous
    out_strides = torch.empty(x.shape).stride()
    assert qmod._collapse(list(x.shape[:-1]), list(x.stride()[:-1]), list(out_strides[:-1])) is None
    _assert_bits(quantize_fp8(x, 2.0), quantize_fp8_ref(x, 2.0))


@pytest.mark.parametrize("shape", [(13, 3, 40), (29, 17), (5,), (32, 2, 16), (33, 24)])  # full and partial token tiles
def test_token_major_output(shape, device, gen):
    x = _rand(shape, torch.bfloat16, gen, device)
    want = quantize_fp8_ref(x, 1.5, transpose_tokens=True)
    assert want.shape == (*shape[1:], shape[0])
    out = poisoned(want.shape, torch.float8_e4m3fn, device)
    quantize_fp8(x, 1.5, out=out, transpose_tokens=True)
    assert_all_written(out)
    _assert_bits(out, want)


def test_token_major_into_a_slice_of_a_larger_buffer(device, gen):
    # The attention kernel's V buffer [H, d, capacity]: a step writes tokens [start, start + T).
    x = _rand((9, 2, 24), torch.float16, gen, device)
    buf = poisoned((2, 24, 40), torch.float8_e4m3fn, device)
    quantize_fp8(x, 2.0, out=buf[:, :, 5:14], transpose_tokens=True)
    _assert_bits(buf[:, :, 5:14], quantize_fp8_ref(x, 2.0, transpose_tokens=True))
    untouched = torch.cat([buf[:, :, :5].reshape(-1), buf[:, :, 14:].reshape(-1)])
    assert bool(((untouched.view(torch.uint8) & 0x7F) == 0x7F).all())


def test_empty_input_launches_nothing(device, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched on an empty input")

    monkeypatch.setattr(qmod._KERNEL, "launch", no_launch)
    x = torch.empty(0, 3, 8, dtype=torch.bfloat16, device=device)
    got = quantize_fp8(x, 1.0)
    assert got.shape == (0, 3, 8) and got.dtype == torch.float8_e4m3fn
    assert quantize_fp8(x, 1.0, transpose_tokens=True).shape == (3, 8, 0)
    assert quantize_fp8(torch.empty(4, 0, device=device), 1.0).shape == (4, 0)


def _x(device):
    return torch.randn(6, 16, device=device)


def _fp8(shape, device):
    return torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)


# (id, argument named in the message, exception, call(device, out))
BAD = [
    ("x-int", "x", TypeError, lambda d, out: quantize_fp8(_x(d).int(), 1.0, out=out)),
    ("x-list", "x", TypeError, lambda d, out: quantize_fp8([[1.0]], 1.0, out=out)),
    ("x-0d", "x", ValueError, lambda d, out: quantize_fp8(torch.tensor(1.0, device=d), 1.0, out=out)),
    ("x-last-strided", "x", ValueError, lambda d, out: quantize_fp8(_x(d).t().contiguous().t(), 1.0, out=out)),
    (
        "x-rank4-t",
        "x",
        ValueError,
        lambda d, out: quantize_fp8(torch.randn(2, 2, 2, 16, device=d), 1.0, transpose_tokens=True),
    ),
    ("scale-str", "kv_scale_orig_quant", TypeError, lambda d, out: quantize_fp8(_x(d), "2", out=out)),
    ("scale-bool", "kv_scale_orig_quant", TypeError, lambda d, out: quantize_fp8(_x(d), True, out=out)),
    ("scale-nan", "kv_scale_orig_quant", ValueError, lambda d, out: quantize_fp8(_x(d), float("nan"), out=out)),
    ("scale-inf", "kv_scale_orig_quant", ValueError, lambda d, out: quantize_fp8(_x(d), float("inf"), out=out)),
    (
        "scale-f64",
        "kv_scale_orig_quant",
        TypeError,
        lambda d, out: quantize_fp8(_x(d), torch.tensor([2.0], dtype=torch.float64, device=d), out=out),
    ),
    ("scale-2", "kv_scale_orig_quant", ValueError, lambda d, out: quantize_fp8(_x(d), torch.ones(2, device=d), out)),
    (
        "out-dtype",
        "out",
        TypeError,
        lambda d, out: quantize_fp8(_x(d), 1.0, out=torch.empty(6, 16, dtype=torch.uint8, device=d)),
    ),
    ("out-shape", "out", ValueError, lambda d, out: quantize_fp8(_x(d), 1.0, out=out[:5])),
    ("out-not-t", "out", ValueError, lambda d, out: quantize_fp8(_x(d), 1.0, out=out, transpose_tokens=True)),
    ("out-last-strided", "out", ValueError, lambda d, out: quantize_fp8(_x(d), 1.0, out=_fp8((16, 6), d).t())),
    ("out-overlap", "out", ValueError, lambda d, out: quantize_fp8(_x(d), 1.0, out=_fp8((1, 16), d).expand(6, 16))),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_writing(case, device):
    _, name, exc, call = case
    out = poisoned((6, 16), torch.float8_e4m3fn, device)
    with pytest.raises(exc, match=name):
        call(device, out)
    assert bool(((out.view(torch.uint8) & 0x7F) == 0x7F).all()), "a rejected call wrote into out"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size_gpu(dtype, device, gen):
    # An MLA context step: 16,384 tokens, 32 heads, V (128) sliced from a 320-wide K/V projection.
    kv = _rand((16384, 32, 192 + 128), dtype, gen, device)
    v = kv[..., 192:]
    k = kv[..., :192]
    for s in SCALES:
        _assert_bits(quantize_fp8(v, s), quantize_fp8_ref(v, s))
        _assert_bits(quantize_fp8(k, s), quantize_fp8_ref(k, s))
        want_t = quantize_fp8_ref(v, s, transpose_tokens=True)
        _assert_bits(quantize_fp8(v, s, transpose_tokens=True), want_t)


@pytest.mark.gpu
def test_cuda_graph_reads_the_scale_at_replay(device, gen):
    x = _rand((512, 8, 128), torch.bfloat16, gen, device)
    s = torch.tensor([1.0], device=device)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    quantize_fp8(x, s, out=out)  # compile (and tune) outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        quantize_fp8(x, s, out=out)
    for value in (2.0, 1.5):
        s.fill_(value)
        x.copy_(_rand(x.shape, torch.bfloat16, gen, device))
        g.replay()
        torch.cuda.synchronize()
        _assert_bits(out, quantize_fp8_ref(x, value))


@pytest.mark.gpu
def test_host_tensor_is_rejected_on_a_gpu_machine(device):
    out = poisoned((4, 8), torch.float8_e4m3fn, device)
    with pytest.raises(ValueError, match="x: expected a tensor on cuda"):
        quantize_fp8(torch.randn(4, 8), 1.0, out=out)
    with pytest.raises(ValueError, match="kv_scale_orig_quant: expected a tensor on"):
        quantize_fp8(torch.randn(4, 8, device=device), torch.tensor([1.0]), out=out)
    assert bool(((out.view(torch.uint8) & 0x7F) == 0x7F).all())
