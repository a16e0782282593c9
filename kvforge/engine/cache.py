"""The engine's cache tensors: paged MLA latent pages, the drafter's latent pages, recurrent-state pages.

The cache manager owns page *ids*; this object owns the memory they index, and is the only place where the
two meet (``shared/DESIGN.md``):

* ``latent[layer_id]``: ``[attention_pages, tokens_per_block, latent_dim]`` in the model dtype, one per MLA
  layer, all addressed by the target attention group's page ids (``KVCache.page_indices(attn_group)``);
* ``draft_latent``: the same for the drafter's layer (the DRAFT group's page ids);
* ``state[layer_id]``: ``[state_pages + staging_state_pages, HL, dk, dv]`` fp32, one per KDA layer, addressed by
  the recurrent group's page ids (live states and snapshots alike). Rows past ``state_pages`` are staging rows
  the manager never hands out (a disaggregated receiver lands snapshots there before committing them).
  After them come ``scratch_rows`` rows where verifying rows put the states after their draft tokens
  (:attr:`scratch_base`), and one trash row (:attr:`state_trash`);
* every latent pool has one trash page past the manager's pages (:attr:`latent_trash`, :attr:`draft_trash`):
  the padded rows of a CUDA-graph batch bucket read and write there, never in a page the manager owns.

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
        self.latent = {
            i: torch.zeros(ec.attention_pages + 1, tpb, mc.latent_dim, device=device, dtype=dtype)
            for i in mc.mla_layers
        }
        self.draft_latent = (
            torch.zeros(ec.draft_pages + 1, tpb, mc.latent_dim, device=device, dtype=dtype)
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
            pool[pages] = 0.0

    @staticmethod
    def slots(block_table: torch.Tensor, positions: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
        """Flat row index ``page * tokens_per_block + offset`` of each position of one request."""
        pages = block_table[positions // tokens_per_block].long()
        return pages * tokens_per_block + positions % tokens_per_block

    @staticmethod
    def write(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        pool.view(-1, pool.shape[-1])[rows] = values.to(pool.dtype)

    @staticmethod
    def read(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, pool.shape[-1])[rows]
