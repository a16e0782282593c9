"""FP8 e4m3 (``torch.float8_e4m3fn``) encoding shared by every kernel that writes FP8.

Why our own encoder: the Triton interpreter's fp32 -> float8e4nv cast is wrong for ~5% of values (ties round
away from even, the mantissa carry into the exponent is lost, no saturation), so a CPU test of a kernel that
used the cast would test the interpreter, not the kernel. ``fp32_to_e4m3_bits`` uses int32 arithmetic only,
is exact in the interpreter and matches the GPU's ``cvt.rn.satfinite`` conversion, so it is the path every
kernel that stores FP8 takes in the interpreter; on a GPU with e4m3 conversions (sm_89+) the stores take the
hardware conversion with the same bytes (``fp32_to_e4m3_byte``, ``native_e4m3_store``). Kernels that convert
inside a hot loop (attention's P) may take the native cast on a GPU via ``native_fp8_cast()``.

Encoding: clamp |x| to 448 (saturate; inf -> ±448), round to nearest even, NaN -> 0x7F with its sign.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels._runtime import device_capability, interpreting

E4M3_MAX = 448.0


@triton.jit
def fp32_to_e4m3_bits(x):
    """fp32 tensor -> int32 tensor holding the e4m3fn byte (0..255)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    # Non-negative floats order like their bit patterns, so an integer min saturates at 448 (0x43E00000).
    mag = tl.minimum(mag, 0x43E00000)
    # Normal e4m3 (|x| >= 2**-6): re-bias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits,
    # nearest-even; a carry out of the mantissa lands in the exponent by itself.
    v = mag - (120 << 23)
    v = (v + 0x7FFFF + ((v >> 20) & 1)) >> 20
    # Subnormal e4m3 (steps of 2**-9): shift the mantissa with its implicit bit, nearest-even. A shift of 25
    # or more rounds everything to zero, so the shift is clamped to stay defined.
    e = mag >> 23
    m = (mag & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(141 - e, 1), 25)
    q = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s
    res = tl.where(mag < (121 << 23), q, v)
    res = tl.where(is_nan, 0x7F, res)
    return res | sign


@triton.jit
def fp32_to_e4m3(x, NATIVE: tl.constexpr):
    """fp32 -> float8e4nv values (for tl.dot operands). NATIVE uses the hardware cast (GPU only)."""
    if NATIVE:
        y = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv)
    else:
        y = fp32_to_e4m3_bits(x).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return y


@triton.jit
def fp32_to_e4m3_byte(x, NATIVE: tl.constexpr):
    """fp32 tensor -> uint8 tensor of e4m3fn bytes, ``fp32_to_e4m3_bits``' bytes either way. NATIVE (a GPU with
    e4m3 conversions, ``native_e4m3_store``): the hardware's round-to-nearest-even conversion of the value clamped
    to ±448 (two values per instruction, where the integer encoder spends ~30 integer instructions on each, so a
    store-bound kernel using it runs at the integer pipes' rate), NaN set apart first (the clamp would turn it
    into 448) and given the encoder's byte, 0x7F with its sign."""
    if NATIVE:
        y = fp32_to_e4m3(x, True).to(tl.uint8, bitcast=True)
        nan = ((x.to(tl.int32, bitcast=True) >> 24) | 0x7F).to(tl.uint8)
        res = tl.where(x != x, nan, y)
    else:
        res = fp32_to_e4m3_bits(x).to(tl.uint8)
    return res


def native_fp8_cast() -> bool:
    """Whether kernels may use the hardware fp32 -> e4m3 conversion (never in the interpreter)."""
    return not interpreting()


def native_e4m3_store(device: torch.device) -> bool:
    """Whether a kernel storing e4m3 on ``device`` takes ``fp32_to_e4m3_byte``'s NATIVE form: a CUDA device of
    compute capability 8.9 or later (Triton has no e4m3 conversion before), never the interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    cap = device_capability(device)
    return cap is not None and cap >= (8, 9)


def e4m3_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference encoding in plain torch: saturate to ±448, then torch's round-to-nearest-even cast.

    Clamping first matters: torch on some versions turns |x| > 464 into NaN instead of saturating.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
