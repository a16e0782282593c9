"""A plain forward pass of the hybrid model: no pages, no cache, no kernels, the whole sequence at once.

Attention is the context (non-absorbed) form with an explicit causal mask, without FP8; the KDA recurrence is
a token loop written here in fp64 (independent of fla-core). :func:`reference_logits` returns the target's
logits at every position (row p predicts token p + 1) and, for a model with a drafter, the drafter's logits
at every position p < T - 1 (row p predicts token p + 2 from token p + 1). The engine's tests compare against
these; :func:`reference_greedy` is the same model generating greedily. :func:`reference_hidden` (the residual
stream after every layer) and :func:`reference_mixer` (one layer's mixer on given inputs) serve the per-layer
error report of :mod:`kvforge.engine.numerics`.

Precision: the projections, norms, MLP and residual adds run in the model's dtype (bf16 on a GPU) exactly as
the engine runs them (the same :class:`HybridModel` methods); only the two mixer cores differ: attention here
is fp64 over unquantised K/V, and the KDA recurrence is an fp64 token loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.engine.model import HybridModel, KDAWeights, MLAWeights

__all__ = ["reference_greedy", "reference_hidden", "reference_logits", "reference_mixer"]


def _mla(model: HybridModel, m: MLAWeights, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    q, latent = model.mla_project(m, h, pos)
    k, v = model.mla_up(m, latent)
    q, k, v = q.double(), k.double(), v.double()
    t = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * model.softmax_scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return model.mla_out(m, torch.einsum("hqk,khd->qhd", p, v))


def _kda(model: HybridModel, m: KDAWeights, h: torch.Tensor) -> torch.Tensor:
    q, k, v, g, beta = (x.double() for x in model.kda_project(m, h))
    scale = q.shape[-1] ** -0.5
    s = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64, device=q.device)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[..., None]
        kt = k[t]
        s = s + (beta[t][:, None] * kt)[..., None] * (v[t] - (kt[..., None] * s).sum(-2))[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, s)
    return model.kda_out(m, out)


def reference_mixer(model: HybridModel, layer: int, h: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s mixer (``num_layers``: the drafter's MLA) on normed inputs ``h [T, D]`` at positions
    ``0 .. T - 1``: what the engine's mixer should return for the same inputs (diagnostics)."""
    pos = torch.arange(h.shape[0], device=h.device)
    blk = model.draft_block if layer == model.config.num_layers else model.blocks[layer]
    assert blk is not None
    if isinstance(blk.mixer, MLAWeights):
        return _mla(model, blk.mixer, h, pos)
    return _kda(model, blk.mixer, h)


def _stack(model: HybridModel, x: torch.Tensor, pos: torch.Tensor, trace: list | None = None) -> torch.Tensor:
    for blk in model.blocks:
        h = model.rms(x, blk.norm1)
        if isinstance(blk.mixer, MLAWeights):
            x = x + _mla(model, blk.mixer, h, pos)
        else:
            x = x + _kda(model, blk.mixer, h)
        x = x + model.mlp(blk, x)
        if trace is not None:
            trace.append(x)
    return x


def reference_hidden(model: HybridModel, tokens: Sequence[int]) -> list[torch.Tensor]:
    """The residual stream ``[T, D]`` after every target layer (diagnostics)."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
    trace: list[torch.Tensor] = []
    _stack(model, model.embed[ids], torch.arange(len(ids), device=model.device), trace)
    return trace


def reference_logits(model: HybridModel, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(target logits ``[T, V]``, drafter logits ``[T - 1, V]`` or None), fp32 on the model's device."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
    pos = torch.arange(len(ids), device=model.device)
    hidden = _stack(model, model.embed[ids], pos)
    logits = model.logits(hidden)
    draft = None
    if model.draft_block is not None and len(ids) > 1:
        blk = model.draft_block
        x = model.draft_input(hidden[:-1], ids[1:])
        assert isinstance(blk.mixer, MLAWeights)
        x = x + _mla(model, blk.mixer, model.rms(x, blk.norm1), pos[:-1])
        x = x + model.mlp(blk, x)
        draft = model.draft_logits(x)
    return logits, draft


def reference_greedy(model: HybridModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` by the plain forward pass (recomputed from scratch each token)."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, _ = reference_logits(model, seq)
        tok = int(logits[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out
