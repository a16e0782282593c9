"""How far the engine's numbers are from the plain forward pass, and the greedy check that is sound for them.

* :func:`compare_logits`: the engine's logits rows against the reference's at the same positions (teacher
  forced on the engine's tokens). The acceptance rule: ``max |engine - reference| <= bound``, and every emitted
  token equals the reference's argmax except where the reference's top-2 margin is under twice that row's own
  largest error (a near tie the measured error can flip; such rows are counted as ``excused``). With random
  weights the logits are flat (std ~1 over 32k tokens at the real size), so the top-2 margin is often a few
  hundredths and any rounding change (FP8 or bf16, op order) flips some argmaxes: exact greedy identity with a
  differently computed reference is not a sound requirement there. Scaling the LM head does not help: it
  scales the margins and the errors alike. A model with a planted copy head (``ModelConfig.copy_offset``) has
  peaked logits; for it the check is :attr:`LogitCheck.exact`: no token differs and every row is decisive.
* :func:`component_errors`: one request (prefill, then decode with a one-token drafter) through an
  :class:`~kvforge.engine.Engine` (eager decode: no CUDA graphs) with a probe on every layer. For each layer and
  phase (prompt positions: ``prefill``, generated positions: ``decode``) it reports the mixer's error against
  the reference mixer fed the engine's own inputs (isolates that component: MLA prefill = FP8/16-bit context
  kernel, MLA decode = the Triton decode kernel over the bf16 latent cache, KDA = fla-core, drafter) and the
  accumulated error of the residual stream after that layer against the reference forward pass. Both as
  relative RMS errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvforge.engine.config import EngineConfig
from kvforge.engine.engine import Engine
from kvforge.engine.model import HybridModel, MLAWeights
from kvforge.engine.reference import reference_hidden, reference_mixer

__all__ = ["ComponentError", "LogitCheck", "compare_logits", "component_errors"]


@dataclass
class LogitCheck:
    """``max_abs_err`` / ``logit_std``: over all rows; ``mismatches``: emitted tokens that differ from the
    reference's argmax; ``excused``: those at a near tie (margin < 2 x the row's error); ``unexcused``: the
    indices of the others; ``decisive``: rows whose margin is at least twice their error (must all match);
    ``min_margin_ratio``: the smallest top-2 margin / row error (inf where a row's error is 0)."""

    rows: int
    max_abs_err: float
    logit_std: float
    bound: float
    mismatches: int = 0
    excused: int = 0
    decisive: int = 0
    unexcused: list[int] = field(default_factory=list)
    min_margin_ratio: float = float("inf")

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.bound and not self.unexcused

    @property
    def exact(self) -> bool:
        """Greedy identity without excuses: within the bound, no token differs, every row decisive."""
        return self.ok and self.mismatches == 0 and self.decisive == self.rows

    def summary(self) -> str:
        return (
            f"{self.rows} rows: max |logit err| {self.max_abs_err:.4f} (bound {self.bound}, logit std "
            f"{self.logit_std:.3f}); greedy differs at {self.mismatches} ({self.excused} near ties excused, "
            f"{len(self.unexcused)} not); {self.decisive} decisive rows; smallest margin / error "
            f"{self.min_margin_ratio:.1f}"
        )


def compare_logits(
    engine_rows: torch.Tensor, ref_rows: torch.Tensor, tokens: Sequence[int], bound: float
) -> LogitCheck:
    """``engine_rows`` / ``ref_rows`` ``[N, V]`` (row i chose ``tokens[i]``); see the module docstring. A NaN or
    inf in ``engine_rows`` is a failed check, not an error; the reference must be finite."""
    for name, t in (("engine_rows", engine_rows), ("ref_rows", ref_rows)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")
    if ref_rows.dim() != 2 or ref_rows.shape[1] < 2:
        raise ValueError(f"ref_rows: expected [N, V] with V >= 2, got {list(ref_rows.shape)}")
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < float("inf"):
        raise ValueError(f"bound: expected a finite number >= 0, got {bound!r}")
    if any(type(t) is not int or not 0 <= t < ref_rows.shape[1] for t in tokens):
        raise ValueError(f"tokens: expected ints in [0, {ref_rows.shape[1]}), got {list(tokens)!r:.200}")
    if engine_rows.shape != ref_rows.shape or engine_rows.shape[0] != len(tokens):
        raise ValueError(
            f"engine_rows: expected the shape of ref_rows {list(ref_rows.shape)} with {len(tokens)} rows, got "
            f"{list(engine_rows.shape)}"
        )
    e, r = engine_rows.double().cpu(), ref_rows.double().cpu()
    if not bool(torch.isfinite(r).all()):
        raise ValueError("ref_rows: expected finite logits, got NaN or inf")
    err = (e - r).abs().max(-1).values
    top2 = r.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    best = r.argmax(-1).tolist()
    chk = LogitCheck(len(tokens), float(err.max()), float(r.std()), bound)
    ratio = torch.where(err > 0, margin / err, torch.full_like(err, float("inf")))
    chk.min_margin_ratio = float(ratio.min())
    for i, tok in enumerate(tokens):
        near = bool(margin[i] < 2 * err[i])
        chk.decisive += not near
        if tok != best[i]:
            chk.mismatches += 1
            if near:
                chk.excused += 1
            else:
                chk.unexcused.append(i)
    return chk


@dataclass(frozen=True)
class ComponentError:
    """``layer``: target layer index (``num_layers`` = the drafter); ``kind``: ``"MLA"``, ``"KDA"`` or
    ``"draft"``; ``phase``: ``"prefill"`` or ``"decode"``; ``mixer_rel``: the mixer's relative RMS error on the
    engine's own inputs; ``hidden_rel``: the residual stream's after this layer (None for the drafter)."""

    layer: int
    kind: str
    phase: str
    tokens: int
    mixer_rel: float
    hidden_rel: float | None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def component_errors(
    model: HybridModel,
    config: EngineConfig,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    draft_len: int = 1,
) -> list[ComponentError]:
    """One request through a fresh engine (no reuse, so every position is computed); see the module docstring."""
    if type(max_new_tokens) is not int or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens: expected an int >= 2 (at least one decode position), got {max_new_tokens!r}")
    # The probe is a Python call after every layer: a replayed CUDA graph makes none, so decode runs eager here.
    eng = Engine(model, replace(config, cuda_graphs=False), draft_len=draft_len)
    # Per layer: position -> (h, mixer, x) of the latest computation of that position (a rejected draft token's
    # position is computed again with the accepted token in the next step).
    seen: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def probe(layer: int, lay, h: torch.Tensor, mix: torch.Tensor, x: torch.Tensor) -> None:
        per = seen.setdefault(layer, {})
        for j, p in enumerate(lay.positions.tolist()):
            per[p] = (h[j].detach().clone(), mix[j].detach().clone(), x[j].detach().clone())

    eng.runner.probe = probe
    out = eng.generate({0: list(prompt)}, max_new_tokens)[0]
    seq = [*prompt, *out[:-1]]  # the positions the target computed
    n_prompt, n = len(prompt), len(seq)
    ref_x = reference_hidden(model, seq)
    mc = model.config
    report = []
    for layer in sorted(seen):
        per = seen[layer]
        is_draft = layer == mc.num_layers
        t = max(per) + 1 if is_draft else n
        if any(p not in per for p in range(t)):
            raise RuntimeError(f"layer {layer}: positions missing from the probe (a reused or preempted prefix?)")
        h, mix, x = (torch.stack([per[p][k] for p in range(t)]) for k in range(3))
        ref_mix = reference_mixer(model, layer, h)
        blk = model.draft_block if is_draft else model.blocks[layer]
        assert blk is not None
        kind = "draft" if is_draft else ("MLA" if isinstance(blk.mixer, MLAWeights) else "KDA")
        for phase, sl in (("prefill", slice(0, min(n_prompt, t))), ("decode", slice(n_prompt, t))):
            if sl.stop <= sl.start:
                continue
            hidden = None if is_draft else _rel(x[sl], ref_x[layer][sl])
            report.append(ComponentError(layer, kind, phase, sl.stop - sl.start, _rel(mix[sl], ref_mix[sl]), hidden))
    return report
