"""The planted copy head: peaked logits that come from attention over the paged cache.

With ``ModelConfig.copy_offset = k >= 1`` the model's first MLA layer is overwritten by a copy circuit; every
other weight stays the random draw of ``copy_offset = 0`` (same seed). The logits at position ``p >= k`` then
peak at the token at ``p - k``, and their top-2 margin is far above the engine's rounding error, so greedy
identity with the plain forward pass is a sound, exact requirement. A wrong page, a stale reused block or a
bad snapshot copy moves the attention to another token and flips the argmax with a large margin.

Reserved residual coordinates: ``0`` (a constant, "DC"), ``U`` (``copy_dim`` coordinates holding the token's
unit code) and ``C`` (``copy_dim`` coordinates, 0 in the embedding, written by the copy head); no random layer
writes DC or U. The copy layer's query is a constant vector on the rotary part, its key the DC coordinate on
the rotary part, so their score depends on ``p - s`` alone and peaks at ``k`` (phase ``-theta_i * k`` on pair
i, weights from :func:`copy_rope_weights`); keys carry no content score; values are the latent's copy of U;
the output writes C; the LM head reads C only (row j: token j's code). :func:`copy_contrast`,
:func:`copy_rope_weights` and :func:`copy_key_amplitude` expose the positional design so tests check it
instead of trusting constants. ``ModelConfig`` refuses a copy head its sizes cannot hold (code width, rotary
contrast, FP8 range). Design notes and measurements: docs/engine_greedy.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Protocol

import torch


class CopySizes(Protocol):
    """The sizes of a model config the copy head's design reads (``kvforge.engine.config.ModelConfig`` has them;
    a protocol rather than an import, so the config module can call this one without an import loop)."""

    copy_offset: int
    qk_rope_dim: int
    rope_theta: float

    @property
    def qk_head_dim(self) -> int: ...


__all__ = [
    "COPY_MAX_POSITIONS",
    "COPY_SCORE_GAP",
    "MIN_COPY_CONTRAST",
    "MIN_COPY_DIM",
    "copy_contrast",
    "copy_key_amplitude",
    "copy_rope_weights",
    "plant_copy_head",
]

# Sequences the positional design is chosen for (the contrast is guaranteed up to here; the tests stay below).
COPY_MAX_POSITIONS = 4096
# The score of the copied key minus the best other key's (in logits of the copy layer's softmax): e^-32 leaves
# the other keys no weight even when FP8 rounding (3 mantissa bits on Q and K) moves scores by a few percent.
COPY_SCORE_GAP = 32.0
# The key's scale is DC / rms(x), and rms(x) varies a little from token to token (what the random layers wrote):
# with contrast c a neighbour can only win if its key is 1 / (1 - c) = 1.18 times larger; measured ratios stay
# under 1.1 (docs/engine_greedy.md).
MIN_COPY_CONTRAST = 0.15
# Narrower random codes collide: the largest cosine between two of V random unit codes is ~sqrt(2 ln V / m),
# 0.83 for 256 tokens at m = 16 and 0.4 for 32,768 at m = 128; the margin of the copied token is 1 minus it.
MIN_COPY_DIM = 16
# The largest |value| an FP8 e4m3 element holds, and the share of it the rotary Q/K amplitude may use (bf16
# rounding stays below the saturation point).
FP8_MAX = 448.0
FP8_HEADROOM = 0.85
# Residual-stream size of the copied code per C coordinate: large against what the random layers write into C
# (3.3 per coordinate after the 28 layers that follow the copy layer at the real size; docs/engine_greedy.md).
COPY_GAIN = 16.0
# Energy of the exact reserved coordinates as multiples of hidden_size: U (the code) 8, DC 1, against ~1/2 of
# random embedding coordinates and 0.3-1.5 written by the layers before the copy layer, so rms(x) there varies
# by a few percent only. U rather than DC carries it so the random layers still see token-dependent input.
U_ENERGY = 8.0
DC_ENERGY = 1.0
# Weights of the pairs after the fastest one, tried by copy_rope_weights (1: equal weights).
_TAIL_WEIGHTS = (1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 6, 1 / 8)


def _inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    half = rope_dim // 2
    return 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) / half))


def _profile(w: torch.Tensor, rope_dim: int, theta: float, k: int, max_len: int) -> torch.Tensor:
    """Unit-key scores of the query at p against the keys at distances r = p - s = 0 .. max_len - 1."""
    r = torch.arange(max_len, dtype=torch.float64)
    return (torch.cos((r[:, None] - k) * _inv_freq(rope_dim, theta)[None, :]) * w).sum(-1)


def _separation(w: torch.Tensor, rope_dim: int, theta: float, k: int, max_len: int) -> tuple[float, float]:
    """(relative contrast, absolute gap f(k) - max_{r != k} f(r)) of the profile of pair weights ``w``."""
    f = _profile(w, rope_dim, theta, k, max_len)
    top = float(f[k])
    f[k] = -math.inf
    gap = top - float(f.max())
    return gap / top, gap


@functools.lru_cache(maxsize=32)
def _design(rope_dim: int, theta: float, k: int) -> tuple[tuple[float, ...], float, float]:
    half = rope_dim // 2
    best: tuple[float, float, tuple[float, ...]] = (-math.inf, 0.0, ())
    for n in range(1, half + 1):
        for tail in _TAIL_WEIGHTS if n > 1 else (1.0,):
            w = (1.0,) + (tail,) * (n - 1) + (0.0,) * (half - n)
            contrast, gap = _separation(torch.tensor(w, dtype=torch.float64), rope_dim, theta, k, COPY_MAX_POSITIONS)
            # The largest absolute gap among designs with enough contrast; the best contrast if none has enough.
            key = (gap if contrast >= MIN_COPY_CONTRAST else -1.0 / max(contrast, 1e-9), contrast, w)
            if key[:2] > best[:2]:
                best = key
    _, contrast, w = best
    return w, contrast, _separation(torch.tensor(w, dtype=torch.float64), rope_dim, theta, k, COPY_MAX_POSITIONS)[1]


def copy_rope_weights(config: CopySizes) -> torch.Tensor:
    """Per rotary pair, the weight of the copy head's score (fp64, ``qk_rope_dim // 2``): 1 on the fastest pair,
    ``w`` on the next ``n - 1``, 0 on the rest; ``(n, w)`` give the largest score gap per unit amplitude among
    those with a contrast >= ``MIN_COPY_CONTRAST`` over ``COPY_MAX_POSITIONS`` distances."""
    return torch.tensor(_design(config.qk_rope_dim, config.rope_theta, config.copy_offset)[0], dtype=torch.float64)


def copy_contrast(config: CopySizes, max_len: int = COPY_MAX_POSITIONS) -> float:
    """``1 - max_{r != k} f(r) / f(k)`` over distances ``r < max_len`` of the copy head's score profile ``f``
    (query at p, key at p - r, keys of equal scale; fp64): how much lower than the copied key any other key
    scores, as a share of the copied key's score."""
    if config.copy_offset < 1:
        raise ValueError(f"config: expected a model with a copy head (copy_offset >= 1), got {config.copy_offset}")
    if type(max_len) is not int or max_len <= config.copy_offset:
        raise ValueError(f"max_len: expected an int > copy_offset ({config.copy_offset}), got {max_len!r}")
    w = copy_rope_weights(config)
    return _separation(w, config.qk_rope_dim, config.rope_theta, config.copy_offset, max_len)[0]


def copy_key_amplitude(config: CopySizes) -> float:
    """The rotary amplitude ``a`` of the copy head's (largest) key and of its query on the fastest pair: the one
    whose score gap ``softmax_scale * a^2 * gap(weights)`` is ``COPY_SCORE_GAP``."""
    gap = _design(config.qk_rope_dim, config.rope_theta, config.copy_offset)[2]
    return math.sqrt(COPY_SCORE_GAP * math.sqrt(config.qk_head_dim) / gap)


def plant_copy_head(model: Any) -> None:
    """Overwrite ``model``'s weights in place with the copy circuit (see the module docstring); ``model`` is a
    ``kvforge.engine.model.HybridModel`` (not imported: that module imports this one)."""
    c = model.config
    k, m, d, h = c.copy_offset, c.copy_dim, c.hidden_size, c.num_heads
    dev, dt = model.device, model.dtype
    U = slice(1, 1 + m)
    C = slice(1 + m, 1 + 2 * m)
    # A stream of its own, so the random weights are exactly those of copy_offset = 0.
    gen = torch.Generator(device=dev).manual_seed(c.seed + 1)
    codes = torch.nn.functional.normalize(torch.randn(c.vocab_size, m, generator=gen, device=dev), dim=-1)

    # Embedding: DC and U are exact and hold most of the row's energy (U_ENERGY, DC_ENERGY), so rms(x) at the copy
    # layer, which scales every key, barely depends on the token.
    e_dc, e_u = math.sqrt(DC_ENERGY * d), math.sqrt(U_ENERGY * d)
    emb = model.embed.float()
    emb[:, 0] = e_dc
    emb[:, U] = e_u * codes
    emb[:, C] = 0.0
    model.embed = emb.to(dt)
    for blk in model.blocks:  # no random layer writes the coordinates the copy layer reads
        blk.mixer.o[:, : 1 + m] = 0
        blk.down[:, : 1 + m] = 0

    blk = model.blocks[c.mla_layers[0]]
    mx = blk.mixer
    if not all(hasattr(mx, f) for f in ("q_a", "q_b", "kv_a", "kv_b", "o")):
        raise TypeError(f"model: expected an MLA layer at layer {c.mla_layers[0]}, got {type(mx).__name__}")
    blk.norm1 = torch.ones(d, device=dev, dtype=dt)
    w = copy_rope_weights(c)
    amp = copy_key_amplitude(c)
    theta = _inv_freq(c.qk_rope_dim, c.rope_theta)
    half = c.qk_rope_dim // 2
    # Query: q_a maps DC to one lora coordinate, whose rms-normalised value is exactly sqrt(q_lora_rank) for every
    # token; q_b turns it into the rotary query a * w_i * exp(-i theta_i k) per pair (halves layout: cos, sin).
    mx.q_a = torch.zeros(d, c.q_lora_rank, device=dev, dtype=dt)
    mx.q_a[0, 0] = 1.0
    mx.q_a_norm = torch.ones(c.q_lora_rank, device=dev, dtype=dt)
    q_rope = torch.cat([amp * w * torch.cos(-theta * k), amp * w * torch.sin(-theta * k)])
    q_b = torch.zeros(c.q_lora_rank, h, c.qk_head_dim, dtype=torch.float64)
    q_b[0, :, c.qk_nope_dim :] = q_rope / math.sqrt(c.q_lora_rank)
    mx.q_b = q_b.reshape(c.q_lora_rank, -1).to(dev, dt)
    # Key: (a, 0) per used pair before rotation, from the DC coordinate of rms(x); that coordinate is at most
    # sqrt(d) * e_dc / sqrt(e_dc^2 + e_u^2) (DC and U are exact, the rest only adds to rms(x)), so no key element
    # exceeds the amplitude.
    h0_max = math.sqrt(d) * e_dc / math.sqrt(e_dc**2 + e_u**2)
    kv_a = torch.zeros(d, c.latent_dim, dtype=torch.float64)
    kv_a[0, c.kv_lora_rank : c.kv_lora_rank + half] = (w > 0).double() * amp / h0_max
    # Latent: the first m lora coordinates copy U, the rest are 0, so rms(c_kv)[:m] = sqrt(kv_lora_rank) * code.
    kv_a[U, :m] = torch.eye(m, dtype=torch.float64)
    mx.kv_a = kv_a.to(dev, dt)
    mx.kv_a_norm = torch.ones(c.kv_lora_rank, device=dev, dtype=dt)
    # kv_b: keys get no content part (only position scores); each head's value is sqrt(m) * code (entries ~1).
    kv_b = torch.zeros(c.kv_lora_rank, h, c.qk_nope_dim + c.v_head_dim, dtype=torch.float64)
    idx = torch.arange(m)
    kv_b[idx, :, c.qk_nope_dim + idx] = math.sqrt(m / c.kv_lora_rank)
    mx.kv_b = kv_b.reshape(c.kv_lora_rank, -1).to(dev, dt)
    # Output: the mean of the (identical) heads into C at COPY_GAIN per coordinate.
    o = torch.zeros(h, c.v_head_dim, d, dtype=torch.float64)
    o[:, idx, 1 + m + idx] = COPY_GAIN / h
    mx.o = o.reshape(h * c.v_head_dim, d).to(dev, dt)

    # LM head: row j is token j's code on C, so the logits are the copied code's cosines with every code.
    fn = model.final_norm.float()
    fn[C] = 1.0
    model.final_norm = fn.to(dt)
    lm = torch.zeros(d, c.vocab_size, device=dev)
    lm[C] = c.logit_scale * codes.T
    model.lm_head = lm.to(dt)
