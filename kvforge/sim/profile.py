"""Measured step times: a profile of one engine's forward step, fitted on samples, for ``kvforge simulate``.

As Vidur does, the simulator can take step times measured on the engine instead of a roofline. A profile is a
JSON file (``format: kvforge-step-profile/1``) that ``bench/profile_step_time.py`` writes from timed engine steps:

* ``coefficients``: seconds per unit of each feature of one real step, :data:`FEATURES`: ``intercept`` (1),
  ``prefill_tokens``, ``prefill_chunks`` (context rows), ``prefill_attention`` (query-key pairs of the context
  rows, ``sum n * (start + (n + 1) / 2)``, in thousands), ``decode_requests``, ``decode_context`` (the
  generation rows' context tokens) and ``prefill_steps`` (1 for a step with any context row: the eager step's
  fixed cost, which a captured decode step does not pay; absent in older files, read as 0). Non-negative,
  fitted by least squares with negative terms dropped;
* ``model``: the profiled model's :class:`~kvforge.sim.model.ModelSpec` fields (its cache layout);
* ``engine``: the budgets it ran with (``tokens_per_block``, ``attention_pages``, ``state_pages``,
  ``max_num_tokens``, ``max_num_requests``), so a simulated fleet can be sized like the real one;
* ``contention`` (optional): ``{"slowdown": [1, s2, s3, ...], ...}``, the step-time slowdown measured with
  k = 1, 2, 3, ... engines stepping at once on the profiled device (:class:`~kvforge.sim.contention.Contention`;
  the simulator applies it to servers declared as sharing a device); its other fields are the record;
* ``samples`` / ``fit``: the measurements and the fit's relative errors (kept for the record, not read back).

:class:`ProfiledStepTime` is a :class:`~kvforge.sim.model.StepTimeModel` whose ``step_time`` evaluates the fit
(per real step, summed over ``real_steps``). Bad files raise ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.kvcache.config import KVCacheConfig, LifeCycleKind, TierConfig
from kvforge.sim.contention import Contention
from kvforge.sim.model import ModelSpec, StepTimeModel, Throughputs

__all__ = ["FEATURES", "FORMAT", "ProfiledStepTime", "StepProfile", "fit_step_times", "load_profile", "step_features"]

FORMAT = "kvforge-step-profile/1"
FEATURES = (
    "intercept",
    "prefill_tokens",
    "prefill_chunks",
    "prefill_attention",
    "decode_requests",
    "decode_context",
    "prefill_steps",
)
# Features a profile written before they existed may lack: read as 0 (that file's fit did not have them).
_OPTIONAL = ("prefill_steps",)
ENGINE_FIELDS = ("tokens_per_block", "attention_pages", "state_pages", "max_num_tokens", "max_num_requests")
_MAX_BYTES = 64 * 2**20


def step_features(prefill: Sequence[tuple[int, int]], decode_requests: float, decode_context: float) -> list[float]:
    """The feature vector of one real step (see the module docstring), in :data:`FEATURES` order."""
    tokens = sum(n for _, n in prefill)
    pairs = sum(n * (s + (n + 1) / 2) for s, n in prefill) / 1e3
    has = 1.0 if prefill else 0.0
    return [1.0, float(tokens), float(len(prefill)), pairs, float(decode_requests), float(decode_context), has]


def fit_step_times(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> dict[str, float]:
    """Non-negative least squares by elimination: fit, drop the most negative coefficient, refit, until none is
    negative. Rows are :func:`step_features` vectors. Columns with no variation other than the intercept are
    dropped too (they cannot be told apart)."""
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(y) != len(x) or len(y) < len(FEATURES):
        raise ValueError(f"rows: expected at least {len(FEATURES)} feature rows of {len(FEATURES)} and one time each")
    keep = [0] + [j for j in range(1, x.shape[1]) if np.ptp(x[:, j]) > 0]
    while True:
        # Relative least squares (weights 1/y): small steps matter as much as large ones.
        w = 1.0 / np.maximum(y, 1e-9)
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        negative = [(c, i) for i, c in enumerate(coef) if keep[i] != 0 and c < 0]
        if not negative:
            break
        keep.pop(min(negative)[1])
    out = dict.fromkeys(FEATURES, 0.0)
    for j, c in zip(keep, coef):
        out[FEATURES[j]] = max(0.0, float(c))
    return out


@dataclass(frozen=True)
class StepProfile:
    """A loaded profile (see the module docstring)."""

    coefficients: Mapping[str, float]
    model: ModelSpec
    engine: Mapping[str, int]
    source: str = ""
    meta: Mapping[str, Any] | None = None
    contention: Contention | None = None

    def __post_init__(self) -> None:
        if isinstance(self.coefficients, Mapping) and any(n not in self.coefficients for n in _OPTIONAL):
            object.__setattr__(self, "coefficients", {**dict.fromkeys(_OPTIONAL, 0.0), **self.coefficients})
        for name in FEATURES:
            v = self.coefficients.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"coefficients.{name}: expected a finite number >= 0, got {v!r}")
        if not any(self.coefficients[n] > 0 for n in FEATURES):
            raise ValueError("coefficients: all zero (every step would take no time)")
        for name in ENGINE_FIELDS:
            v = self.engine.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"engine.{name}: expected an int >= 1, got {v!r}")

    def seconds(self, features: Sequence[float]) -> float:
        return sum(self.coefficients[n] * f for n, f in zip(FEATURES, features))

    def cache_size(self) -> tuple[float, float]:
        """``(cache_gib, state_fraction)`` that give a simulated server the profiled engine's pages exactly
        (:func:`~kvforge.sim.server.plan_cache_layout`; half a page of slack on each side of the split)."""
        tpb = self.engine["tokens_per_block"]
        cfg = KVCacheConfig(tokens_per_block=tpb, layers=self.model.kv_layers(), tiers=(TierConfig(pages=1),))
        attn = sum(g.bytes_per_page for g in cfg.groups if g.life_cycle.kind is not LifeCycleKind.RECURRENT)
        rec = [g.bytes_per_page for g in cfg.groups if g.life_cycle.kind is LifeCycleKind.RECURRENT]
        state = rec[0] if rec else 0
        state_bytes = self.engine["state_pages"] * state + state / 2
        total = self.engine["attention_pages"] * attn + attn / 2 + state_bytes
        return total / 2**30, (state_bytes / total if rec else 0.5)


class ProfiledStepTime(StepTimeModel):
    """:class:`StepTimeModel` with measured step times (the profile's fit) instead of the roofline."""

    def __init__(self, profile: StepProfile) -> None:
        super().__init__(profile.model, Throughputs())
        self.profile = profile

    def step_time(
        self,
        prefill: Sequence[tuple[int, int]],
        decode_contexts: float,
        decode_requests: float,
        real_steps: int = 1,
    ) -> float:
        if not prefill and not decode_requests:
            return 0.0
        c = self.profile.coefficients
        f = step_features(prefill, decode_requests, decode_contexts)
        # Per real step: the intercept and the decode terms, and with context rows the prefill step's fixed cost
        # (the server spreads a prefill over all ``real_steps``); the context tokens and chunks are paid once.
        per_step = c["intercept"] + c["decode_requests"] * decode_requests + c["decode_context"] * decode_contexts
        per_step += c["prefill_steps"] * f[6]
        once = c["prefill_tokens"] * f[1] + c["prefill_chunks"] * f[2] + c["prefill_attention"] * f[3]
        return real_steps * per_step + once


def _model_from(data: Any, where: str) -> ModelSpec:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: 'model' must be an object of ModelSpec fields")
    names = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: model: unknown fields {unknown[:5]}")
    try:
        return ModelSpec(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: model: {exc}") from None


def load_profile(path: str | Path) -> StepProfile:
    """Read a profile file; raises ``ValueError`` (or ``OSError``) naming the file and the bad field."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p}: is a folder, expected a JSON profile file")
    if p.stat().st_size > _MAX_BYTES:
        raise ValueError(f"{p}: larger than {_MAX_BYTES} bytes; not a step profile")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{p}: JSON nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{p}: expected a JSON object with format {FORMAT!r}")
    coef, engine = data.get("coefficients"), data.get("engine")
    if not isinstance(coef, dict) or not isinstance(engine, dict):
        raise ValueError(f"{p}: 'coefficients' and 'engine' must be objects")
    model = _model_from(data.get("model"), str(p))
    try:
        return StepProfile(dict(coef), model, dict(engine), str(p), data.get("meta"), _contention_from(data, p))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{p}: {exc}") from None


def _contention_from(data: dict[str, Any], p: Path) -> Contention | None:
    c = data.get("contention")
    if c is None:
        return None
    if not isinstance(c, dict) or not isinstance(c.get("slowdown"), list):
        raise ValueError("contention: expected an object with a 'slowdown' list (k = 1, 2, ...)")
    try:
        return Contention(tuple(c["slowdown"]), f"measured ({p.name})")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"contention.{exc}") from None
