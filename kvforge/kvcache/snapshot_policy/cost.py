"""The cost model: a hybrid model's cache layout and what prefilling a prefix costs.

:class:`ModelCostSpec` describes the layers (which are MLA attention, which recurrent), the bytes one token
of attention cache and one recurrent snapshot take, and the prefill FLOPs of the first ``n`` tokens
(:meth:`ModelCostSpec.prefill_flops`: linear in the dense and recurrent parts, quadratic in attention).
:data:`KIMI_K3_LIKE` is the project's one description of its default model; the simulator's
:data:`kvforge.sim.model.KIMI_K3_LIKE` is derived from it. Its figures are assumptions (the K3 numbers are not
public): 61 layers, MLA where ``i % 4 == 3`` and the last (16 MLA, 45 KDA), ~32e9 active parameters, a bf16 MLA
latent of 576 elements per token per layer, and a KDA state of 64 heads of 128x128 fp32 plus a width-4 short
convolution for q, k, v (4,341,760 bytes per layer). Invalid fields raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvforge.kvcache.config import LayerSpec, LifeCycle

if TYPE_CHECKING:
    from kvforge.kvcache.pools import Block

__all__ = ["KIMI_K3_LIKE", "ModelCostSpec", "prefix_tokens"]


@dataclass(frozen=True)
class ModelCostSpec:
    """A hybrid model's cache layout and prefill cost (see the module docstring for the default's assumptions).

    ``attention_layers``: ids of the MLA (full-attention) layers among ``range(num_layers)``; every other layer
    is recurrent. ``active_params``: parameters one token passes through (2 FLOPs each). Attention cost per
    token at position ``t`` per layer: ``2 * attn_heads * (qk_head_dim + v_head_dim) * t``; recurrent cost per
    token per layer: ``recurrent_flops_per_token``.
    """

    name: str
    num_layers: int
    attention_layers: tuple[int, ...]
    hidden_size: int
    active_params: float
    kv_elements_per_token: int
    kv_dtype_bytes: int
    attn_heads: int
    qk_head_dim: int
    v_head_dim: int
    recurrent_state_bytes: int
    recurrent_flops_per_token: float

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected >= 1, got {self.num_layers}")
        attn = tuple(sorted(set(self.attention_layers)))
        if not attn or attn[0] < 0 or attn[-1] >= self.num_layers:
            raise ValueError(f"attention_layers: expected ids in [0, {self.num_layers}), got {self.attention_layers}")
        if len(attn) == self.num_layers:
            raise ValueError("attention_layers: a hybrid model needs at least one recurrent layer")
        object.__setattr__(self, "attention_layers", attn)
        for name in ("hidden_size", "kv_elements_per_token", "kv_dtype_bytes", "attn_heads", "recurrent_state_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.active_params <= 0 or self.recurrent_flops_per_token < 0:
            raise ValueError("active_params must be > 0 and recurrent_flops_per_token >= 0")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        attn = set(self.attention_layers)
        return tuple(i for i in range(self.num_layers) if i not in attn)

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention-cache bytes per token over every attention layer."""
        return len(self.attention_layers) * self.kv_elements_per_token * self.kv_dtype_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot: the state of every recurrent layer."""
        return len(self.recurrent_layers) * self.recurrent_state_bytes

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to prefill the first ``num_tokens`` tokens of a sequence from nothing."""
        n = num_tokens
        linear = n * (2.0 * self.active_params + len(self.recurrent_layers) * self.recurrent_flops_per_token)
        per_pos = 2.0 * self.attn_heads * (self.qk_head_dim + self.v_head_dim) * len(self.attention_layers)
        return linear + per_pos * n * (n + 1) / 2

    def layer_specs(self, kv_dtype: str = "bfloat16") -> tuple[LayerSpec, ...]:
        """Cache layer specs of the target model: MLA layers (one latent head) then recurrent layers."""
        attn = set(self.attention_layers)
        out = []
        for i in range(self.num_layers):
            if i in attn:
                per_token = self.kv_elements_per_token * self.kv_dtype_bytes
                out.append(LayerSpec(i, bytes_per_token=per_token, dtype=kv_dtype))
            else:
                out.append(LayerSpec(i, LifeCycle.recurrent(), state_bytes=self.recurrent_state_bytes, dtype="float32"))
        return tuple(out)


def _kimi_k3_like() -> ModelCostSpec:
    layers = 61
    heads, dk = 64, 128
    state = heads * dk * dk * 4 + 3 * 3 * heads * dk * 2
    return ModelCostSpec(
        name="kimi-k3-like",
        num_layers=layers,
        attention_layers=tuple(i for i in range(layers) if i % 4 == 3 or i == layers - 1),
        hidden_size=7168,
        active_params=32e9,
        kv_elements_per_token=576,
        kv_dtype_bytes=2,
        attn_heads=64,
        qk_head_dim=192,
        v_head_dim=128,
        recurrent_state_bytes=state,
        recurrent_flops_per_token=4.0 * heads * dk * dk,
    )


KIMI_K3_LIKE = _kimi_k3_like()


def prefix_tokens(block: Block | None, tokens_per_block: int) -> int:
    """Tokens up to the end of ``block`` (0 for none or a root)."""
    return 0 if block is None or block.depth < 0 else block.depth * tokens_per_block + block.num_tokens
