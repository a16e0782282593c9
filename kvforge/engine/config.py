"""Sizes of the Kimi-Linear-like hybrid model and the engine's budgets (frozen dataclasses that validate).

:class:`ModelConfig` describes the model: ``layer_types`` is one letter per layer, ``"L"`` a linear-attention
(KDA) layer with a recurrent state of ``linear_heads x linear_head_dim x linear_head_dim`` fp32 values and
``"M"`` an MLA layer whose latent cache holds ``kv_lora_rank + qk_rope_dim`` values per token (576 for the
DeepSeek/Kimi sizes: 512 + 64). MLA attention in context form uses ``qk_nope_dim + qk_rope_dim`` wide keys
(192 = 128 + 64) and ``v_head_dim`` wide values (128). ``draft_layers`` is 0 or 1 (one MLA drafter layer, MTP
style). :func:`tiny` is the CPU-interpreter size of the tests; :func:`real` is about 2.9 B parameters.
``copy_offset`` (0: all weights random) plants a copy head in the first MLA layer (:mod:`kvforge.engine.planted`);
a config whose sizes cannot hold one (code width, rotary contrast, FP8 range) raises ``ValueError``.

:class:`EngineConfig` holds the cache and scheduler budgets: ``tokens_per_block``, pages per pool group (attention,
recurrent state, draft), the token and request budgets of a step, snapshot placement, the device, and the
latent cache's dtype (``latent_cache_dtype="fp8_e4m3"``: one byte per latent value at ``latent_scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["LATENT_CACHE_DTYPES", "EngineConfig", "ModelConfig", "real", "tiny"]

# "auto": the model dtype (bf16 on a GPU, fp32 on the CPU); "fp8_e4m3": float8_e4m3fn at a per-tensor scale.
LATENT_CACHE_DTYPES = ("auto", "fp8_e4m3")
CONTEXT_V_LAYOUTS = ("dim_major", "token_major")


def _pos(name: str, v: object, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: str = "LLLM"
    num_heads: int = 2
    qk_nope_dim: int = 32
    qk_rope_dim: int = 16
    v_head_dim: int = 32
    q_lora_rank: int = 32
    kv_lora_rank: int = 64
    linear_heads: int = 2
    linear_head_dim: int = 16
    draft_layers: int = 1
    rope_theta: float = 10000.0
    # FP8 K/V of the context kernel hold e4m3(x * kv_scale_orig_quant); the kernel dequantises by the reciprocal.
    kv_scale_orig_quant: float = 16.0
    logit_scale: float = 4.0
    seed: int = 0
    # 0: all weights random. k >= 1: the first MLA layer is a planted copy head (kvforge.engine.planted): the
    # logits at position p peak at the token at p - k, so greedy outputs are decisive.
    copy_offset: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "qk_nope_dim",
            "qk_rope_dim",
            "v_head_dim",
            "q_lora_rank",
            "kv_lora_rank",
            "linear_heads",
            "linear_head_dim",
        ):
            _pos(name, getattr(self, name))
        _pos("draft_layers", self.draft_layers, 0)
        if self.draft_layers > 1:
            raise ValueError(f"draft_layers: expected 0 or 1 (one MTP-style drafter layer), got {self.draft_layers}")
        if not isinstance(self.layer_types, str) or not self.layer_types or set(self.layer_types) - {"L", "M"}:
            raise ValueError(f"layer_types: expected a non-empty string of 'L' and 'M', got {self.layer_types!r}")
        if "M" not in self.layer_types or "L" not in self.layer_types:
            raise ValueError(f"layer_types: a hybrid model needs both 'L' and 'M' layers, got {self.layer_types!r}")
        if self.qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim: expected an even size (rotary pairs), got {self.qk_rope_dim}")
        if not self.kv_scale_orig_quant > 0:
            raise ValueError(f"kv_scale_orig_quant: expected a positive float, got {self.kv_scale_orig_quant}")
        _pos("copy_offset", self.copy_offset, 0)
        if self.copy_offset:
            self._check_copy_head()

    def _check_copy_head(self) -> None:
        from kvforge.engine import planted

        if self.copy_offset >= planted.COPY_MAX_POSITIONS:
            raise ValueError(
                f"copy_offset: expected an int < {planted.COPY_MAX_POSITIONS} (the positions the copy head is "
                f"designed for), got {self.copy_offset}"
            )
        if self.copy_dim < planted.MIN_COPY_DIM:
            raise ValueError(
                f"copy_offset: the copy head needs v_head_dim, kv_lora_rank and hidden_size // 4 >= "
                f"{planted.MIN_COPY_DIM} (its code width), got {self.v_head_dim}, {self.kv_lora_rank}, "
                f"{self.hidden_size // 4}"
            )
        contrast = planted.copy_contrast(self)
        if contrast < planted.MIN_COPY_CONTRAST:
            raise ValueError(
                f"copy_offset: the rotary pairs (qk_rope_dim {self.qk_rope_dim}, rope_theta {self.rope_theta}) give "
                f"the copy head a contrast of {contrast:.3f} < {planted.MIN_COPY_CONTRAST}; use more rotary dims"
            )
        amp, fp8_max = planted.copy_key_amplitude(self), planted.FP8_HEADROOM * planted.FP8_MAX
        if amp * self.kv_scale_orig_quant > fp8_max:
            raise ValueError(
                f"copy_offset: the copy head's rotary Q/K amplitude {amp:.1f} x kv_scale_orig_quant "
                f"{self.kv_scale_orig_quant} exceeds {fp8_max:.0f} (FP8 e4m3 range with headroom); lower the scale"
            )

    @property
    def copy_dim(self) -> int:
        """Width of the copy head's token codes (reserved residual coordinates U and C, values, latent)."""
        return min(self.v_head_dim, self.kv_lora_rank, self.hidden_size // 4)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's MLA latent cache row: kv_lora_rank + qk_rope_dim (576 at real sizes)."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "M")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "L")

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.linear_heads, self.linear_head_dim, self.linear_head_dim)

    def num_params(self) -> int:
        d, h = self.hidden_size, self.num_heads
        mla = (
            d * self.q_lora_rank
            + self.q_lora_rank * h * self.qk_head_dim
            + d * self.latent_dim
            + self.kv_lora_rank * h * (self.qk_nope_dim + self.v_head_dim)
            + h * self.v_head_dim * d
        )
        lin_w = self.linear_heads * self.linear_head_dim
        lin = d * lin_w * 4 + d * self.linear_heads + lin_w * d
        mlp = 3 * d * self.intermediate_size
        n_m, n_l = len(self.mla_layers), len(self.linear_layers)
        draft = self.draft_layers * (2 * d * d + mla + mlp)
        return n_m * (mla + mlp) + n_l * (lin + mlp) + 2 * self.vocab_size * d + draft


def tiny(**kw: object) -> ModelConfig:
    """The CPU-interpreter size: 4 layers (3 KDA + 1 MLA) of width 64, one drafter layer."""
    return replace(ModelConfig(), **kw)  # type: ignore[arg-type]


def real(**kw: object) -> ModelConfig:
    """About 2.9 B parameters with the DeepSeek/Kimi MLA sizes (qk 128 + 64, v 128, latent 512 + 64)."""
    base = ModelConfig(
        vocab_size=32768,
        hidden_size=2560,
        intermediate_size=6912,
        layer_types="LLLM" * 8,
        num_heads=20,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        linear_heads=20,
        linear_head_dim=128,
        draft_layers=1,
        kv_scale_orig_quant=16.0,
        logit_scale=1.0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EngineConfig:
    """Budgets of one engine. ``attention_pages`` / ``state_pages`` / ``draft_pages``: GPU pages of the MLA
    latent group, the recurrent-state group (live states and snapshots) and the drafter's latent group.
    ``snapshot_interval`` / ``prompt_end_offsets`` / ``midchunk_snapshot_alignment``: the hybrid manager's
    snapshot placement (alignment None: a step always ends at a snapshot point; 1: the recurrent prefill splits
    a step at any point, so one point per step is passed mid-step). ``reuse``: prefix reuse on or off.
    ``staging_state_pages``: extra recurrent-state rows outside the manager, where a disaggregated generation
    engine receives snapshots before it commits them. ``device``: None picks CUDA when available.
    ``context_fp8``: the context (prefill/extend) attention reads Q/K/V quantised to FP8 e4m3 at the model's
    ``kv_scale_orig_quant``; False passes them in 16 bits (bf16 on a GPU, fp16 in the CPU interpreter), the
    mode whose only rounding is the model dtype's (decode reads the latent cache in ``latent_cache_dtype``).
    ``context_v_layout`` (FP8 context only): ``"dim_major"`` quantises V straight into ``[H, d_v, T]``
    (``quantize_v_dim_major``: transposed on chip in the same pass), the layout the FP8 context kernel reads
    without transposing V itself; ``"token_major"`` keeps ``[T, H, d_v]`` (the kernel transposes each V tile).
    ``cuda_graphs``: generation-only steps replay a CUDA graph per batch bucket (:mod:`kvforge.engine.graphs`);
    None turns them on exactly when the model is on CUDA, True on a CPU model is refused by the engine.
    ``latent_cache_dtype``: ``"auto"`` keeps the MLA latent caches (target and drafter) in the model dtype;
    ``"fp8_e4m3"`` stores them as float8_e4m3fn, one byte per value: rows are written as
    ``e4m3(row * latent_scale)`` (``store_latent_rows``) and read back times ``1 / latent_scale`` by decode and by
    the context path. ``latent_scale`` (fp8 only; None: the model's ``kv_scale_orig_quant``, the scale the
    context path already quantises K/V at) must be a finite float > 0. ``profile_phases``: ``Engine.step`` times
    its phases (:mod:`kvforge.engine.phases`, totals in ``Engine.timings``); off, the step reads no clock."""

    tokens_per_block: int = 16
    attention_pages: int = 64
    state_pages: int = 32
    draft_pages: int = 64
    max_num_tokens: int = 256
    max_num_requests: int = 16
    max_blocks_per_request: int = 64
    snapshot_interval: int = 0
    prompt_end_offsets: tuple[int, ...] = (0,)
    midchunk_snapshot_alignment: int | None = 1
    reuse: bool = True
    staging_state_pages: int = 8
    device: str | None = None
    prefix_wait: bool = True
    context_fp8: bool = True
    context_v_layout: str = "dim_major"
    cuda_graphs: bool | None = None
    latent_cache_dtype: str = "auto"
    latent_scale: float | None = None
    profile_phases: bool = False

    def __post_init__(self) -> None:
        for name in (
            "tokens_per_block",
            "attention_pages",
            "state_pages",
            "draft_pages",
            "max_num_tokens",
            "max_num_requests",
            "max_blocks_per_request",
        ):
            _pos(name, getattr(self, name))
        _pos("snapshot_interval", self.snapshot_interval, 0)
        _pos("staging_state_pages", self.staging_state_pages, 0)
        if self.midchunk_snapshot_alignment is not None:
            _pos("midchunk_snapshot_alignment", self.midchunk_snapshot_alignment)
        for name in ("reuse", "context_fp8", "prefix_wait", "profile_phases"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.context_v_layout, str) or self.context_v_layout not in CONTEXT_V_LAYOUTS:
            raise ValueError(f"context_v_layout: expected one of {CONTEXT_V_LAYOUTS}, got {self.context_v_layout!r}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool or None, got {type(self.cuda_graphs).__name__}")
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"device: expected a device name or None, got {type(self.device).__name__}")
        if not isinstance(self.latent_cache_dtype, str) or self.latent_cache_dtype not in LATENT_CACHE_DTYPES:
            raise ValueError(
                f"latent_cache_dtype: expected one of {LATENT_CACHE_DTYPES}, got {self.latent_cache_dtype!r}"
            )
        sc = self.latent_scale
        if sc is not None:
            if self.latent_cache_dtype != "fp8_e4m3":
                raise ValueError(
                    f"latent_scale: only latent_cache_dtype='fp8_e4m3' takes a scale, got {sc!r} with "
                    f"{self.latent_cache_dtype!r}"
                )
            if isinstance(sc, bool) or not isinstance(sc, (int, float)):
                raise TypeError(f"latent_scale: expected a float or None, got {type(sc).__name__}")
            if not (math.isfinite(sc) and sc > 0):
                raise ValueError(f"latent_scale: expected a finite float > 0, got {sc}")

    @property
    def fp8_latent(self) -> bool:
        """The MLA latent caches hold float8_e4m3fn (``latent_cache_dtype == "fp8_e4m3"``)."""
        return self.latent_cache_dtype == "fp8_e4m3"
