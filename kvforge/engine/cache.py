"""The engine's cache tensors: paged MLA latent pages, the drafter's latent pages, recurrent-state pages.

The cache manager owns page *ids*; this object owns the memory they index, and is the only place where the
two meet (``shared/DESIGN.md``):

* ``latent[layer_id]``: ``[attention_pages, tokens_per_block, latent_dim]`` in :attr:`latent_dtype` (the model
  dtype, or float8_e4m3fn with ``EngineConfig.latent_cache_dtype="fp8_e4m3"``), one per MLA layer, all
  addressed by the target attention group's page ids (``KVCache.page_indices(attn_group)``);
* ``draft_latent``: the same for the drafter's layer (the DRAFT group's page ids);
* ``state[layer_id]``: ``[state_pages + staging_state_pages, HL, dk, dv]`` fp32, one per KDA layer, addressed by
  the recurrent group's page ids (live states and snapshots alike). Rows past ``state_pages`` are staging rows
  the manager never hands out (a disaggregated receiver lands snapshots there before committing them).
  After them come ``scratch_rows`` rows where verifying rows put the states after their draft tokens
  (:attr:`scratch_base`), and one trash row (:attr:`state_trash`);
* every latent pool has one trash page past the manager's pages (:attr:`latent_trash`, :attr:`draft_trash`):
  the padded rows of a CUDA-graph batch bucket read and write there, never in a page the manager owns.

Latent rows go in through :meth:`write_latent` (an e4m3 cache: ``store_latent_rows`` at :attr:`latent_scale`,
no host read) and come out through :meth:`read_latent` (dequantised by :attr:`latent_scale_inv`, which decode
passes to the kernel as ``kv_scale_quant_orig``). Page copies move stored bytes, so an e4m3 page is copied exactly.

:meth:`EngineCache.execute` runs the manager's :class:`~kvforge.kvcache.manager.PageCopy` list (copy-on-write of a
partial block, a snapshot copied into a live state, a live state copied into a snapshot page) in order; a copy
from a staging row is expressed with ``src_index >= state_pages``. Only the GPU tier is supported.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvforge.engine.config import EngineConfig, ModelConfig
from kvforge.kvcache.config import Tier
from kvforge.kvcache.manager import PageCopy

__all__ = ["EngineCache"]


class EngineCache:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        *,
        attn_group: int,
        state_group: int,
        draft_group: int | None,
        device: torch.device,
        dtype: torch.dtype,
        scratch_rows: int = 0,
    ) -> None:
        mc, ec = model_config, engine_config
        tpb = ec.tokens_per_block
        self.tokens_per_block = tpb
        self.attn_group, self.state_group, self.draft_group = attn_group, state_group, draft_group
        self.state_pages = ec.state_pages
        self.latent_trash, self.draft_trash = ec.attention_pages, ec.draft_pages
        # FP8: rows are stored as e4m3(row * latent_scale); readers multiply by latent_scale_inv.
        self.latent_fp8 = ec.fp8_latent
        self.latent_dtype = torch.float8_e4m3fn if self.latent_fp8 else dtype
        scale = float(ec.latent_scale if ec.latent_scale is not None else mc.kv_scale_orig_quant)
        self.latent_scale: float | None = scale if self.latent_fp8 else None
        self.latent_scale_inv: float | None = 1.0 / scale if self.latent_fp8 else None
        ldt = self.latent_dtype
        self.latent = {
            i: torch.zeros(ec.attention_pages + 1, tpb, mc.latent_dim, device=device, dtype=ldt) for i in mc.mla_layers
        }
        self.draft_latent = (
            torch.zeros(ec.draft_pages + 1, tpb, mc.latent_dim, device=device, dtype=ldt)
            if draft_group is not None
            else None
        )
        self.scratch_base = ec.state_pages + ec.staging_state_pages
        self.state_trash = self.scratch_base + scratch_rows
        rows = self.state_trash + 1
        self.state = {
            i: torch.zeros(rows, *mc.state_shape, device=device, dtype=torch.float32) for i in mc.linear_layers
        }
        self.copies_done = 0

    def nbytes(self) -> int:
        ts = [*self.latent.values(), *self.state.values()]
        if self.draft_latent is not None:
            ts.append(self.draft_latent)
        return sum(t.numel() * t.element_size() for t in ts)

    def _attention_pools(self, group: int) -> list[torch.Tensor]:
        if group == self.attn_group:
            return list(self.latent.values())
        if group == self.draft_group and self.draft_latent is not None:
            return [self.draft_latent]
        raise ValueError(f"group: {group} is not an attention group of this engine")

    def execute(self, copies: Iterable[PageCopy]) -> None:
        """Run the manager's copies in order (see the module docstring)."""
        for c in copies:
            if c.src_tier is not Tier.GPU or c.dst_tier is not Tier.GPU:
                raise ValueError(f"copies: only GPU-tier pages are supported by this engine, got {c}")
            if c.group == self.state_group:
                for pool in self.state.values():
                    pool[c.dst_index].copy_(pool[c.src_index])
            else:
                n = self.tokens_per_block if c.num_tokens is None else c.num_tokens
                for pool in self._attention_pools(c.group):
                    pool[c.dst_index, :n].copy_(pool[c.src_index, :n])
            self.copies_done += 1

    def zero_states(self, pages: torch.Tensor) -> None:
        for pool in self.state.values():
            pool.index_fill_(0, pages, 0.0)  # a scalar fill: ``pool[pages] = 0.0`` uploads the 0 with a sync

    @staticmethod
    def slots(block_table: torch.Tensor, positions: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
        """Flat row index ``page * tokens_per_block + offset`` of each position of one request."""
        pages = block_table[positions // tokens_per_block].long()
        return pages * tokens_per_block + positions % tokens_per_block

    def write_latent(self, pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Latent rows ``values [N, latent_dim]`` into flat rows ``rows [N]`` of a latent pool (quantised to e4m3 at
        :attr:`latent_scale` on an FP8 cache, by the same kernel the decode tests hold to its reference)."""
        if self.latent_fp8:
            from kvforge.kernels.mla_decode import store_latent_rows

            store_latent_rows(pool, rows, values.contiguous(), kv_scale_orig_quant=self.latent_scale)
        else:
            self.write(pool, rows, values)

    def read_latent(self, pool: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Flat rows ``rows`` of a latent pool in ``dtype`` (an e4m3 cache dequantised: value x latent_scale_inv,
        the same product the decode kernel forms)."""
        x = self.read(pool, rows)
        if self.latent_fp8:
            assert self.latent_scale_inv is not None
            return (x.float() * self.latent_scale_inv).to(dtype)
        return x.to(dtype)

    @staticmethod
    def write(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        pool.view(-1, pool.shape[-1])[rows] = values.to(pool.dtype)

    @staticmethod
    def read(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, pool.shape[-1])[rows]
