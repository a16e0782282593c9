"""The Kimi-Linear-like hybrid model with random weights: KDA linear-attention layers, MLA layers, one drafter.

Every layer is pre-norm: ``x += mixer(rms(x)); x += mlp(rms(x))`` with a SwiGLU MLP. The mixers:

* **MLA** (DeepSeek style): ``q = q_b(rms(q_a(x)))`` split into ``qk_nope_dim`` + ``qk_rope_dim`` per head; the
  latent row ``[rms(c_kv) (kv_lora_rank), rope(k_rope) (qk_rope_dim)]`` is what the cache stores per token.
  Context form: ``kv_b`` up-projects the latent to keys (nope part, plus the shared rope part) and values.
  Absorbed form (decode): ``q_nope`` is multiplied into the latent space by ``kv_b``'s key half, attention runs
  over latent rows, and the value half maps the result back.
* **KDA** (Kimi delta attention): L2-normalised q and k, per-dimension log-decay ``g``, ``beta = sigmoid``; the
  recurrence itself is in :mod:`kvforge.engine.ops` (fla-core). No short convolution (a simplification).
* **Drafter** (MTP style, one MLA layer): from the target's last hidden state at position p and the embedding of
  token p + 1 it predicts token p + 2, sharing the embedding and the LM head.

Projections that read the same input are stored concatenated (``[q_a | kv_a]``, ``[q | k | v | g | b]``,
``[gate | up]``; the separate weights are column views of them): the engine's kernel path runs one GEMM each.
The absorbed-MLA products run in the model dtype with fp32 accumulation (one rounding, as the fp32 product
rounded to the model dtype would be). This module holds weights and the per-token projections; it owns no
cache (the engine's ``mla_project(store=...)`` writes latent rows into a pool it is handed). The engine
(:mod:`kvforge.engine.runner`) and the plain reference (:mod:`kvforge.engine.reference`) both call it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.engine.config import ModelConfig
from kvforge.engine.planted import plant_copy_head
from kvforge.kernels.kda_prep import kda_prepare
from kvforge.kernels.mla_latent import mla_latent_store
from kvforge.kernels.rms_norm import rms_norm
from kvforge.kernels.rotary import rotary, rotary_table
from kvforge.kernels.swiglu import swiglu
from kvforge.kvcache.hooks import HybridCachePolicy, RuntimeHooks
from kvforge.kvcache.hybrid import HybridCacheManager

__all__ = ["HybridModel", "KDAWeights", "MLAWeights"]

KDA_GATE_BIAS = -2.0  # g = -softplus(x + bias): at x = 0 a decay of exp(g) = 0.88 per step


def _fused(parts: tuple[torch.Tensor, ...], align: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``parts`` (same rows) concatenated along columns, zero columns added up to a multiple of ``align``, and
    each part as a column view of the result."""
    cols = [0, *itertools.accumulate(p.shape[1] for p in parts)]
    pad = parts[0].new_zeros(parts[0].shape[0], (-cols[-1]) % align)
    whole = torch.cat([*parts, pad], 1)
    return whole, [whole[:, a:b] for a, b in itertools.pairwise(cols)]


@dataclass
class MLAWeights:
    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o: torch.Tensor


@dataclass
class KDAWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    b: torch.Tensor
    o: torch.Tensor


@dataclass
class Block:
    norm1: torch.Tensor
    mixer: MLAWeights | KDAWeights
    norm2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class HybridModel:
    """Random weights (seeded by ``config.seed``) on ``device`` in ``dtype`` (fp32 on CPU, bf16 on a GPU); with
    ``config.copy_offset >= 1`` the first MLA layer is then overwritten by a copy head
    (:mod:`kvforge.engine.planted`). ``use_kernels`` (default: on CUDA) selects the engine's fused Triton forms
    below; set on a CPU model they run under the Triton interpreter (the kernel-count probe and its tests)."""

    runtime_hooks = RuntimeHooks(
        kv_cache_manager_cls=HybridCacheManager,
        hybrid_cache=HybridCachePolicy(state_index_upload_kernel=True),
    )

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # Drawn where they live (a CPU generator on CPU, the device's on a GPU: billions of values).
        gen = torch.Generator(device=self.device).manual_seed(c.seed)
        d = c.hidden_size

        def w(i: int, o: int, gain: float = 1.0) -> torch.Tensor:
            t = torch.randn(i, o, generator=gen, device=self.device) * (gain / math.sqrt(i))
            return t.to(self.dtype)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=gen, device=self.device)).to(self.dtype)

        def mla() -> MLAWeights:
            h = c.num_heads
            return MLAWeights(
                q_a=w(d, c.q_lora_rank),
                q_a_norm=norm(c.q_lora_rank),
                q_b=w(c.q_lora_rank, h * c.qk_head_dim),
                kv_a=w(d, c.latent_dim),
                kv_a_norm=norm(c.kv_lora_rank),
                kv_b=w(c.kv_lora_rank, h * (c.qk_nope_dim + c.v_head_dim)),
                o=w(h * c.v_head_dim, d),
            )

        def kda() -> KDAWeights:
            hk = c.linear_heads * c.linear_head_dim
            return KDAWeights(
                q=w(d, hk), k=w(d, hk), v=w(d, hk), g=w(d, hk), b=w(d, c.linear_heads), o=w(hk, d)
            )  # fmt: skip

        def block(kind: str) -> Block:
            mixer = mla() if kind == "M" else kda()
            return Block(
                norm(d), mixer, norm(d), w(d, c.intermediate_size), w(d, c.intermediate_size), w(c.intermediate_size, d)
            )

        self.embed = torch.randn(c.vocab_size, d, generator=gen, device=self.device).to(self.dtype)
        self.blocks = [block(t) for t in c.layer_types]
        self.final_norm = norm(d)
        self.lm_head = w(d, c.vocab_size, c.logit_scale)
        self.draft_fc = w(2 * d, d) if c.draft_layers else None
        self.draft_norms = (norm(d), norm(d)) if c.draft_layers else None
        self.draft_block = block("M") if c.draft_layers else None
        self.draft_final_norm = norm(d) if c.draft_layers else None
        half = c.qk_rope_dim // 2
        self._inv_freq = (1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))).to(self.device)
        self.softmax_scale = 1.0 / math.sqrt(c.qk_head_dim)
        self._rope_table: torch.Tensor | None = None
        self.use_kernels = self.device.type == "cuda"
        if c.copy_offset:
            plant_copy_head(self)
        self._fuse_projections()

    def _fuse_projections(self) -> None:
        """Projections that read the same input, concatenated into one weight each (``Block.gate_up``,
        ``MLAWeights.a = [q_a | kv_a]``, ``KDAWeights.proj = [q | k | v | g | b | 0]``), so the kernel path runs one
        GEMM where it ran several. The separate weights become column views of the fused one (same memory, same
        values): the plain forms and the reference keep using them."""
        for blk in [*self.blocks, *([self.draft_block] if self.draft_block is not None else [])]:
            blk.gate_up, (blk.gate, blk.up) = _fused((blk.gate, blk.up))
            m = blk.mixer
            if isinstance(m, MLAWeights):
                m.a, (m.q_a, m.kv_a) = _fused((m.q_a, m.kv_a))
            else:
                # Zero columns up to a multiple of 64: 4hk + h (10,260 at the real size) leaves the GEMM's output
                # rows misaligned for Hopper's kernels, and cuBLAS fell back to an sm_80 one (40 ms of a 187 ms
                # 8 x 1024 prefill on the H200). kda_project reads the first 4hk + h columns.
                m.proj, (m.q, m.k, m.v, m.g, m.b) = _fused((m.q, m.k, m.v, m.g, m.b), align=64)

    # --- shared pieces ----------------------------------------------------------------------------------------

    @staticmethod
    def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the last dimension (halves rotated) at integer ``positions [T]``."""
        ang = positions.float().to(self.device)[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)

    def mlp(self, blk: Block, x: torch.Tensor) -> torch.Tensor:
        h = self.rms(x, blk.norm2)
        return (F.silu(h @ blk.gate) * (h @ blk.up)) @ blk.down

    # --- the engine's fused forms (Triton kernels on CUDA, the plain forms above elsewhere) ----------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:meth:`rms` in one kernel on CUDA (``kvforge.kernels.rms_norm``)."""
        if self.use_kernels and x.dim() == 2:
            out = rms_norm(x, weight)
            assert isinstance(out, torch.Tensor)
            return out
        return self.rms(x, weight)

    def add_norm(self, x: torch.Tensor, mix: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + mix`` (the residual stream, in the model dtype) and ``rms(s, weight)``: one kernel on CUDA."""
        if self.use_kernels and x.dim() == 2 and mix.dtype == x.dtype:
            y, s = rms_norm(mix, weight, residual=x)  # type: ignore[misc]
            return s, y
        s = x + mix
        return s, self.rms(s, weight)

    def mlp_normed(self, blk: Block, h: torch.Tensor) -> torch.Tensor:
        """The MLP on its already normalised input (one GEMM for gate and up, ``swiglu`` in one kernel on CUDA)."""
        if self.use_kernels:
            gu = h @ blk.gate_up
            i = blk.down.shape[0]
            return swiglu(gu[:, :i], gu[:, i:]) @ blk.down
        return (F.silu(h @ blk.gate) * (h @ blk.up)) @ blk.down

    def ensure_rope_table(self, positions: int) -> None:
        """A cos/sin table for positions ``[0, positions)`` (fused rotary on CUDA reads it; it cannot check a
        position on the device, so the engine sizes it for its longest request)."""
        if self.use_kernels and (self._rope_table is None or self._rope_table.shape[0] < positions):
            self._rope_table = rotary_table(self._inv_freq, positions)

    @property
    def rope_kernels(self) -> bool:
        """The fused MLA projection can run: kernels on and the rope table built (:meth:`ensure_rope_table`)."""
        return self.use_kernels and self._rope_table is not None

    # --- MLA ---------------------------------------------------------------------------------------------------

    def mla_project(
        self,
        m: MLAWeights,
        h: torch.Tensor,
        positions: torch.Tensor,
        *,
        fused: bool = False,
        rope_q: bool = True,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries ``[T, H, qk_head_dim]`` (rope applied) and latent cache rows ``[T, latent_dim]``. ``fused``
        (kernels on, rope table present): one GEMM for ``q_a`` and ``kv_a``, the norms and the rotary embedding as
        kernels writing in place; ``rope_q=False`` then leaves the queries' rope part unrotated (for
        :meth:`mla_absorb` with ``positions``, which rotates it into its output); ``store=(pool, rows)`` (a latent
        pool in the model dtype, flat row indices) writes the latent rows straight into the pool in one kernel
        (``mla_latent_store``) and returns None for them."""
        c = self.config
        if fused and self.rope_kernels:
            a = h @ m.a
            r = c.q_lora_rank
            q = (self.norm(a[:, :r], m.q_a_norm) @ m.q_b).view(-1, c.num_heads, c.qk_head_dim)
            if rope_q:
                q_rope = q[..., c.qk_nope_dim :]
                rotary(q_rope, positions, self._rope_table, out=q_rope)
            kv = a[:, r:]
            if store is not None:
                mla_latent_store(kv, m.kv_a_norm, positions, self._rope_table, *store)
                return q, None
            latent = torch.empty(kv.shape[0], c.latent_dim, device=h.device, dtype=h.dtype)
            rms_norm(kv[:, : c.kv_lora_rank], m.kv_a_norm, out=latent[:, : c.kv_lora_rank])
            rotary(kv[:, c.kv_lora_rank :], positions, self._rope_table, out=latent[:, c.kv_lora_rank :])
            return q, latent
        q = (self.rms(h @ m.q_a, m.q_a_norm) @ m.q_b).view(-1, c.num_heads, c.qk_head_dim)
        q = torch.cat([q[..., : c.qk_nope_dim], self.rope(q[..., c.qk_nope_dim :], positions)], -1)
        kv = h @ m.kv_a
        latent = torch.cat(
            [self.rms(kv[:, : c.kv_lora_rank], m.kv_a_norm), self.rope(kv[:, c.kv_lora_rank :], positions)], -1
        )
        return q, latent

    def mla_up(self, m: MLAWeights, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context form: latent rows ``[T, latent_dim]`` -> keys ``[T, H, qk_head_dim]``, values ``[T, H, v]``."""
        c = self.config
        kv = (latent[:, : c.kv_lora_rank] @ m.kv_b).view(-1, c.num_heads, c.qk_nope_dim + c.v_head_dim)
        k_rope = latent[:, None, c.kv_lora_rank :].expand(-1, c.num_heads, c.qk_rope_dim)
        return torch.cat([kv[..., : c.qk_nope_dim], k_rope], -1), kv[..., c.qk_nope_dim :]

    def mla_absorb(self, m: MLAWeights, q: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Absorbed queries ``[T, H, latent_dim]``: ``q_nope`` moved into the latent space, rope part kept (or,
        with ``positions``, rotated from the unrotated ``q`` of ``mla_project(rope_q=False)`` by the rotary kernel).

        One batched GEMM per head in the model dtype (fp32 accumulation, one rounding, as the fp32 product rounded
        to the model dtype), written straight into the output's latent columns, ``kv_b`` read in place: no fp32
        copy of the weights, no concatenation."""
        c = self.config
        nope, r = c.qk_nope_dim, c.kv_lora_rank
        out = torch.empty(q.shape[0], c.num_heads, c.latent_dim, device=q.device, dtype=q.dtype)
        wk = m.kv_b.view(r, c.num_heads, nope + c.v_head_dim)[..., :nope].permute(1, 2, 0)  # [H, nope, r]
        torch.bmm(q[..., :nope].transpose(0, 1), wk.to(q.dtype), out=out[..., :r].transpose(0, 1))
        if positions is None:
            out[..., r:] = q[..., nope:]
        else:
            assert self._rope_table is not None
            rotary(q[..., nope:], positions, self._rope_table, out=out[..., r:])
        return out

    def mla_unabsorb(self, m: MLAWeights, o_lat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Latent attention output ``[T, H, kv_lora_rank]`` -> per-head values ``[T, H, v_head_dim]`` in the model
        dtype (one batched GEMM per head, as :meth:`mla_absorb`; written into ``out`` when given)."""
        c = self.config
        nope = c.qk_nope_dim
        wv = m.kv_b.view(c.kv_lora_rank, c.num_heads, nope + c.v_head_dim)[..., nope:].permute(1, 0, 2)  # [H, r, v]
        if out is None:
            out = torch.empty(o_lat.shape[0], c.num_heads, c.v_head_dim, device=o_lat.device, dtype=wv.dtype)
        torch.bmm(o_lat.to(wv.dtype).transpose(0, 1), wv, out=out.transpose(0, 1))
        return out

    def mla_out(self, m: MLAWeights, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1).to(self.dtype) @ m.o

    # --- KDA ---------------------------------------------------------------------------------------------------

    def kda_project(self, m: KDAWeights, h: torch.Tensor, *, fused: bool = False):
        """``q, k [T, HL, dk]`` (L2-normalised), ``v [T, HL, dv]``, ``g [T, HL, dk]`` (log decay), ``beta [T, HL]``
        (``g`` and ``beta`` fp32). ``fused`` (kernels on): one GEMM against ``[q | k | v | g | b]`` and one
        ``kda_prepare`` kernel for the norms and gates."""
        c = self.config
        if fused and self.use_kernels and h.dim() == 2:
            n = c.linear_heads * (4 * c.linear_head_dim + 1)  # [q | k | v | g | b] without the padding
            return kda_prepare((h @ m.proj)[:, :n], c.linear_heads, c.linear_head_dim, KDA_GATE_BIAS)
        shape = (-1, c.linear_heads, c.linear_head_dim)
        q = F.normalize((h @ m.q).float().view(shape), dim=-1).to(h.dtype)
        k = F.normalize((h @ m.k).float().view(shape), dim=-1).to(h.dtype)
        v = (h @ m.v).view(shape)
        g = -F.softplus((h @ m.g).float().view(shape) + KDA_GATE_BIAS)
        beta = torch.sigmoid((h @ m.b).float())
        return q, k, v, g, beta

    def kda_out(self, m: KDAWeights, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1).to(self.dtype) @ m.o

    # --- heads -------------------------------------------------------------------------------------------------

    # ``fused`` (the engine's calls): the norms as kernels when they are on; ``fp32=False`` keeps the logits in the
    # model dtype (the greedy choice reads them as they are: converting to fp32 changes no order).

    def _head(self, hidden: torch.Tensor, norm: torch.Tensor, fused: bool, fp32: bool) -> torch.Tensor:
        h = self.norm(hidden, norm) if fused else self.rms(hidden, norm)
        y = h @ self.lm_head
        return y.float() if fp32 else y

    def logits(self, hidden: torch.Tensor, *, fused: bool = False, fp32: bool = True) -> torch.Tensor:
        return self._head(hidden, self.final_norm, fused, fp32)

    def draft_input(self, hidden: torch.Tensor, next_ids: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """The drafter's input at position p: its hidden state and the embedding of token p + 1."""
        assert self.draft_norms is not None and self.draft_fc is not None
        if fused and self.use_kernels and hidden.dim() == 2:  # both norms straight into the GEMM's input halves
            d = hidden.shape[1]
            hin = torch.empty(hidden.shape[0], 2 * d, device=hidden.device, dtype=hidden.dtype)
            rms_norm(hidden, self.draft_norms[1], out=hin[:, :d])
            rms_norm(self.embed[next_ids], self.draft_norms[0], out=hin[:, d:])
            return hin @ self.draft_fc
        e = self.rms(self.embed[next_ids], self.draft_norms[0])
        h = self.rms(hidden, self.draft_norms[1])
        return torch.cat([h, e], -1) @ self.draft_fc

    def draft_logits(self, hidden: torch.Tensor, *, fused: bool = False, fp32: bool = True) -> torch.Tensor:
        assert self.draft_final_norm is not None
        return self._head(hidden, self.draft_final_norm, fused, fp32)
