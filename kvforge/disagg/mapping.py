"""Which context rank sends which layers, heads and blocks to which generation rank.

Ranks inside an instance are numbered ``instance_rank = (pp_rank * cp_size + cp_rank) * tp_size + tp_rank``.
The plan is per instance pair and covers PP (stage layer ranges; draft layers on the last stage), TP (a piece
carries the intersection of the two sides' KV head ranges; an MLA cache is replicated and sent from one context
TP rank, round-robin) and CP/helix (the generation instance deals blocks round-robin over its CP ranks; the
context side has cp = 1). Recurrent state layers travel whole in the pieces with ``with_state``.

Attention DP: an instance with ``attention_dp`` splits its TP ranks into ``dp_size`` groups of
``attention_tp = tp_size // dp_size`` consecutive TP ranks (group d holds TP ranks ``[d * attention_tp,
(d + 1) * attention_tp)``); a request lives in one group per side. The plan is per (context DP rank, generation
DP rank) pair: only the ranks of those two groups take part, and TP/head/round-robin rules apply to the
attention-TP ranks of the groups. Without attention DP (``dp_size`` is then ignored, as in the reference
system) the instance is one group and the request's DP rank is 0. ``InstanceLayout.of`` raises ``ValueError``
for a rank whose DP metadata contradicts itself (:func:`kvforge.disagg.peer.attention_dp_problem`, the rule the
peer check applies at registration).

The mapping rules in full: ``docs/disagg.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.disagg.peer import attention_dp_problem, draft_layers_shared
from kvforge.disagg.rank_info import RankInfo


def helix_blocks(num_blocks: int, cp_rank: int, cp_size: int) -> range:
    """Global block ids held by generation CP rank ``cp_rank`` (round-robin deal)."""
    return range(cp_rank, num_blocks, cp_size)


def helix_block_count(num_blocks: int, cp_rank: int, cp_size: int) -> int:
    return len(helix_blocks(num_blocks, cp_rank, cp_size))


def rank_coords(rank: int, tp: int, pp: int, cp: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, cp_rank) of an instance rank: TP varies fastest, then CP, then PP."""
    if not 0 <= rank < tp * pp * cp:
        raise ValueError(f"rank: expected an instance rank in [0, {tp * pp * cp}), got {rank}")
    return rank % tp, rank // (tp * cp), (rank // tp) % cp


@dataclass(frozen=True)
class InstanceLayout:
    """The parallel layout of one instance, as far as the KV cache is concerned."""

    tp_size: int
    pp_size: int
    cp_size: int
    layers_per_pp: tuple[int, ...]
    num_draft_layers: int
    is_mla: bool
    dp_size: int = 1  # attention-DP groups over the TP ranks (1 without attention DP)

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "cp_size", "dp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.tp_size % self.dp_size:
            raise ValueError(
                f"dp_size: attention DP needs tp_size % dp_size == 0, got {self.tp_size} and {self.dp_size}"
            )

    @classmethod
    def of(cls, info: RankInfo, *, with_draft: bool) -> InstanceLayout:
        problem = attention_dp_problem(info)
        if problem is not None:
            raise ValueError(problem)
        return cls(
            tp_size=info.tp_size,
            pp_size=info.pp_size,
            cp_size=info.cp_size,
            layers_per_pp=tuple(info.layers_per_pp),
            num_draft_layers=(info.num_draft_layers or 0) if with_draft else 0,
            is_mla=info.is_mla,
            dp_size=info.dp_size if info.attention_dp else 1,
        )

    @property
    def attention_tp_size(self) -> int:
        """TP ranks of one attention-DP group (they split one request's heads)."""
        return self.tp_size // self.dp_size

    def dp_rank_of(self, rank: int) -> int:
        """The attention-DP group of an instance rank."""
        return self.coords(rank)[0] // self.attention_tp_size

    def check_dp_rank(self, name: str, dp_rank: object) -> int:
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < self.dp_size:
            raise ValueError(
                f"{name}: expected an int in [0, {self.dp_size}) (the instance's DP groups), got {dp_rank!r}"
            )
        return dp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size

    def rank(self, tp: int, pp: int, cp: int) -> int:
        return (pp * self.cp_size + cp) * self.tp_size + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, cp_rank) of an instance rank."""
        return rank_coords(rank, self.tp_size, self.pp_size, self.cp_size)

    def target_layers(self, pp: int) -> range:
        start = sum(self.layers_per_pp[:pp])
        return range(start, start + self.layers_per_pp[pp])

    def draft_layers(self, pp: int) -> range:
        return range(self.num_draft_layers) if pp == self.pp_size - 1 else range(0)


@dataclass(frozen=True)
class Piece:
    """One message of a transfer: what context rank ``ctx_rank`` sends generation rank ``gen_rank``."""

    ctx_rank: int
    gen_rank: int
    target_layers: tuple[int, ...]
    draft_layers: tuple[int, ...]
    heads_lo: int
    heads_hi: int
    heads_den: int
    cp_rank: int
    cp_size: int
    with_state: bool = True

    def layer_keys(self) -> list[tuple[str, int]]:
        """Layers in message order: target layers ascending, then draft layers ascending."""
        return [("target", i) for i in self.target_layers] + [("draft", i) for i in self.draft_layers]

    def blocks(self, num_blocks: int) -> range:
        return helix_blocks(num_blocks, self.cp_rank, self.cp_size)

    def head_range(self, total_heads: int) -> tuple[int, int]:
        """Global head range [lo, hi) of a layer with ``total_heads`` KV heads (1 for MLA)."""
        if (total_heads * self.heads_lo) % self.heads_den or (total_heads * self.heads_hi) % self.heads_den:
            raise ValueError(
                f"total_heads: {total_heads} heads do not split at {self.heads_lo}/{self.heads_den} and "
                f"{self.heads_hi}/{self.heads_den} of the head space"
            )
        return total_heads * self.heads_lo // self.heads_den, total_heads * self.heads_hi // self.heads_den


def plan_pieces(ctx: InstanceLayout, gen: InstanceLayout, *, ctx_dp_rank: int = 0, gen_dp_rank: int = 0) -> list[Piece]:
    """Every (context rank, generation rank) message of a transfer between two instances, for a request held by
    DP group ``ctx_dp_rank`` of the context instance and DP group ``gen_dp_rank`` of the generation instance
    (both 0 without attention DP). Ranks are instance ranks; only those two groups' ranks appear."""
    ctx.check_dp_rank("ctx_dp_rank", ctx_dp_rank)
    gen.check_dp_rank("gen_dp_rank", gen_dp_rank)
    if ctx.cp_size != 1:
        raise ValueError(
            f"ctx.cp_size: context parallelism is supported on the generation side only, got {ctx.cp_size}"
        )
    if sum(ctx.layers_per_pp) != sum(gen.layers_per_pp):
        raise ValueError(f"layers_per_pp: {ctx.layers_per_pp} and {gen.layers_per_pp} cover different layer counts")
    if ctx.num_draft_layers != gen.num_draft_layers:
        raise ValueError(f"num_draft_layers: {ctx.num_draft_layers} vs {gen.num_draft_layers}")
    if ctx.is_mla != gen.is_mla:
        raise ValueError(f"is_mla: {ctx.is_mla} vs {gen.is_mla}")
    c_atp, g_atp = ctx.attention_tp_size, gen.attention_tp_size
    c_base = ctx_dp_rank * c_atp  # first TP rank of the context DP group
    den = math.lcm(c_atp, g_atp)
    pieces = []
    for g_rank in range(gen.world_size):
        g_tp_global, g_pp, g_cp = gen.coords(g_rank)
        if g_tp_global // g_atp != gen_dp_rank:
            continue
        g_tp = g_tp_global % g_atp  # attention-TP rank inside the generation DP group
        g_targets = gen.target_layers(g_pp)
        g_drafts = gen.draft_layers(g_pp)
        for c_pp in range(ctx.pp_size):
            c_targets = ctx.target_layers(c_pp)
            targets = tuple(range(max(g_targets.start, c_targets.start), min(g_targets.stop, c_targets.stop)))
            drafts = tuple(i for i in g_drafts if i in ctx.draft_layers(c_pp))
            if not targets and not drafts:
                continue
            if ctx.is_mla:
                c_tp = (g_cp * g_atp + g_tp) % c_atp
                spans = [(c_tp, 0, 1, 1)]
            else:
                g_lo, g_hi = g_tp * den // g_atp, (g_tp + 1) * den // g_atp
                spans = []
                for c_tp in range(c_atp):
                    c_lo, c_hi = c_tp * den // c_atp, (c_tp + 1) * den // c_atp
                    lo, hi = max(g_lo, c_lo), min(g_hi, c_hi)
                    if lo < hi:
                        spans.append((c_tp, lo, hi, den))
            for k, (c_tp, lo, hi, d) in enumerate(spans):
                pieces.append(
                    Piece(
                        ctx_rank=ctx.rank(c_base + c_tp, c_pp, 0),
                        gen_rank=g_rank,
                        target_layers=targets,
                        draft_layers=drafts,
                        heads_lo=lo,
                        heads_hi=hi,
                        heads_den=d,
                        cp_rank=g_cp,
                        cp_size=gen.cp_size,
                        with_state=k == 0,
                    )
                )
    return pieces


def layouts_for(ctx: RankInfo, gen: RankInfo) -> tuple[InstanceLayout, InstanceLayout]:
    """Both sides' layouts; draft layers count only when both sides have a drafter sharing the cache."""
    shared = draft_layers_shared(ctx, gen)
    return InstanceLayout.of(ctx, with_draft=shared), InstanceLayout.of(gen, with_draft=shared)
