"""Shared test helpers: poisoned outputs and write checks; a RankInfo with defaults; what a disaggregation plan
delivers to a generation rank; multi-turn engine traffic."""

from __future__ import annotations

import random
from typing import Any

import torch

from kvforge.disagg.mapping import InstanceLayout, helix_blocks
from kvforge.disagg.rank_info import RankInfo

INT_POISON = -0x2A2A2A2A


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with values no kernel writes on purpose (NaN for floats), in place."""
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # NaN
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:
        t.fill_(0xAB)
    else:
        t.fill_(max(INT_POISON, torch.iinfo(t.dtype).min))
    return t


def poisoned(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return poison(torch.empty(shape, dtype=dtype, device=device))


def assert_all_written(t: torch.Tensor, what: str = "output") -> None:
    """Every element differs from the poison value (floats: no NaN left)."""
    if t.dtype == torch.float8_e4m3fn:
        left = (t.view(torch.uint8) & 0x7F) == 0x7F
    elif t.is_floating_point():
        left = torch.isnan(t)
    elif t.dtype == torch.uint8:
        left = t == 0xAB
    elif t.dtype == torch.bool:
        return
    else:
        left = t == max(INT_POISON, torch.iinfo(t.dtype).min)
    n = int(left.sum())
    assert n == 0, f"{what}: {n} of {t.numel()} elements were not written"


def rank_info(**kw) -> RankInfo:
    """A single-rank MLA RankInfo (bf16, 4 layers, 64-token blocks); ``kw`` overrides fields."""
    base = dict(
        instance_name="a",
        instance_rank=0,
        transport_rank=0,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        cp_size=1,
        cp_rank=0,
        attention_dp=False,
        layers_per_pp=(4,),
        is_mla=True,
        kv_heads=1,
        head_dim=576,
        kv_dtype="bfloat16",
        element_bytes=2,
        tokens_per_block=64,
        page_groups=(0,),
    )
    base.update(kw)
    return RankInfo(**base)


def held(lay: InstanceLayout, rank: int, heads: int) -> set:
    """(layer key, global head) pairs a rank holds: its DP group's heads split over the group's TP ranks."""
    tp, pp, _ = lay.coords(rank)
    atp = lay.attention_tp_size
    local = tp % atp
    keys = [("target", i) for i in lay.target_layers(pp)] + [("draft", i) for i in lay.draft_layers(pp)]
    hs = [0] if lay.is_mla else range(local * heads // atp, (local + 1) * heads // atp)
    return {(k, h) for k in keys for h in hs}


def plan_delivery(
    ctx: InstanceLayout, gen: InstanceLayout, pieces: list, gen_rank: int, heads: int, num_blocks: int
) -> tuple[list, set]:
    """What ``pieces`` (those of a plan addressed to ``gen_rank``) deliver, one ``((layer key, head), block)`` per
    delivery, checked to come from a context rank that holds it; and the set that rank needs."""
    _, _, cp = gen.coords(gen_rank)
    need = {(kh, b) for kh in held(gen, gen_rank, heads) for b in helix_blocks(num_blocks, cp, gen.cp_size)}
    got = []
    for p in pieces:
        lo, hi = p.head_range(1 if ctx.is_mla else heads)
        have = held(ctx, p.ctx_rank, heads)
        for key in p.layer_keys():
            for h in range(lo, hi):
                assert (key, h) in have, f"ctx rank {p.ctx_rank} does not hold {key} head {h}"
                got += [((key, h), b) for b in p.blocks(num_blocks)]
    return got, need


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def multi_turn(
    eng: Any, seed: int, *, turns: int, n_conv: int, new_tokens: int, vocab: int,
    first: tuple[int, int], follow: tuple[int, int],
) -> dict[str, list[int]]:  # fmt: skip
    """Runs ``n_conv`` conversations for ``turns`` turns on an engine: turn t+1's prompt is turn t's prompt + its
    answer + new user tokens (first prompts of ``first`` tokens, follow-ups of ``follow``, both [lo, hi)).
    Returns every request's prompt by id."""
    rng = random.Random(seed)
    prompts = {}
    history = {c: random_prompt(rng, rng.randrange(*first), vocab) for c in range(n_conv)}
    for t in range(turns):
        for c in range(n_conv):
            rid = f"c{c}t{t}"
            prompts[rid] = list(history[c])
            eng.add_request(rid, history[c], new_tokens)
        eng.run()
        for c in range(n_conv):
            extra = random_prompt(rng, rng.randrange(*follow), vocab)
            history[c] = [*history[c], *eng.outputs[f"c{c}t{t}"], *extra]
    return prompts


def pick_min_reference(values: list[float], rotor: int) -> int:
    """The router's rotating argmin, written as a plain loop: scan from ``rotor`` (wrapping around) and keep the
    first strictly smaller value."""
    n = len(values)
    best = rotor % n
    for j in range(1, n):
        s = (rotor + j) % n
        if values[s] < values[best]:
            best = s
    return best


def engine_rows_and_reference(model: Any, eng: Any, rid: Any, prompt: list[int]) -> tuple:
    """A finished request's recorded logits rows next to the plain forward pass's at the same positions (teacher
    forced on the engine's tokens): ``(emitted tokens, engine rows, reference rows, the reference's drafter
    logits [T - 1, V] or None)``; row i predicted ``tokens[i]``."""
    from kvforge.engine import reference_logits

    out = eng.outputs[rid]
    rows = torch.cat(eng.logits[rid])
    assert rows.shape[0] == len(out), (rid, rows.shape, len(out))
    ref, ref_draft = reference_logits(model, [*prompt, *out])
    p = len(prompt)
    return out, rows, ref[p - 1 : p - 1 + len(out)], ref_draft
