"""The integer FP8 encoder that every FP8-writing kernel uses, against torch's cast.

Checked bit-exact over every finite bf16 value (clamped to ±448) plus saturation and rounding edge cases, in
the interpreter on CPU and on the GPU, where it is also compared with the hardware conversion.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvforge.kernels._fp8 import e4m3_ref, fp32_to_e4m3, fp32_to_e4m3_bits, fp32_to_e4m3_byte, native_e4m3_store


@triton.jit
def _encode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, fp32_to_e4m3_bits(x).to(tl.uint8), mask=m)


@triton.jit
def _native_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, fp32_to_e4m3(x, True), mask=m)


@triton.jit
def _byte_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, fp32_to_e4m3_byte(x, NATIVE), mask=m)


def _encode(x: torch.Tensor) -> torch.Tensor:
    y = torch.full((x.numel(),), 0xAB, dtype=torch.uint8, device=x.device)
    _encode_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    return y


def _all_bf16_values(device: torch.device) -> torch.Tensor:
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)].to(device)


EDGE = [
    0.0,
    -0.0,
    448.0,
    -448.0,
    449.0,
    464.0,
    465.0,
    1000.0,
    -1e9,
    float("inf"),
    float("-inf"),
    31.625,
    1.95,
    2**-6,
    2**-7,
    2**-9,
    2**-10,
    3 * 2**-10,
    2**-10 + 2**-20,
    1e-30,
    1e-45,
    0.0625 * 1.0625,
]


def test_encoder_bit_exact_all_bf16(device):
    x = _all_bf16_values(device).clamp(-448, 448)
    got = _encode(x)
    want = e4m3_ref(x).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()}"


def test_encoder_saturates_and_rounds_to_even(device, gen):
    x = torch.tensor(EDGE, device=device)
    x = torch.cat([x, (torch.randn(50_000, generator=gen) * 300).to(device)])
    got = _encode(x)
    assert torch.equal(got, e4m3_ref(x).view(torch.uint8))
    # Beyond the clamp: 1000 must saturate to 448, not wrap to 256 as the interpreter's cast does.
    assert torch.tensor([0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() == 448.0
    assert got[EDGE.index(1000.0)].item() == 0x7E
    assert got[EDGE.index(31.625)].item() == e4m3_ref(torch.tensor([32.0])).view(torch.uint8).item()


def test_encoder_nan_keeps_nan(device):
    got = _encode(torch.tensor([float("nan")], device=device))
    assert (got & 0x7F).item() == 0x7F


@pytest.mark.gpu
def test_encoder_matches_hardware_conversion(device, gen):
    x = torch.cat([_all_bf16_values(device), (torch.randn(1_000_000, generator=gen) * 200).to(device)])
    x = torch.cat([x, torch.tensor(EDGE, device=device)])
    x = x.clamp(-448, 448)
    native = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=device)
    _native_kernel[(triton.cdiv(x.numel(), 4096),)](x, native, x.numel(), BLOCK=4096)
    assert torch.equal(_encode(x), native.view(torch.uint8))


def _bytes_of(x: torch.Tensor, native: bool) -> torch.Tensor:
    y = torch.full((x.numel(),), 0xAB, dtype=torch.uint8, device=x.device)
    _byte_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096, NATIVE=native)
    return y


def _unclamped_inputs(device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Every bf16 value (NaN and inf of both signs included, not clamped), random fp32 bit patterns (subnormals,
    NaN payloads, huge values), and the rounding edges."""
    raw = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = torch.cat([_all_bf16_values(device), raw.view(torch.float32).to(device), torch.tensor(EDGE, device=device)])
    return torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")], device=device)])


def test_byte_form_without_native_is_the_encoder(device, gen):
    """``fp32_to_e4m3_byte``'s integer form stores the encoder's bytes, NaN and inf included; the store gate
    never takes the native form off a CUDA device."""
    x = _unclamped_inputs(device, gen)[: 1 << 16]
    assert torch.equal(_bytes_of(x, False), _encode(x))
    assert not native_e4m3_store(torch.device("cpu"))
    assert not native_e4m3_store(torch.device("meta"))


@pytest.mark.gpu
def test_native_byte_form_matches_the_encoder(device, gen):
    """The hardware form (``quantize_fp8``'s on sm_89+) gives the integer encoder's byte for every input,
    unclamped: saturation, inf, NaN with its sign, subnormals, random bit patterns."""
    if not native_e4m3_store(device):
        pytest.skip("no e4m3 conversion on this GPU")
    x = _unclamped_inputs(device, gen)
    assert torch.equal(_bytes_of(x, True), _encode(x))
