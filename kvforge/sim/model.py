"""The simulator's model layout and step-time model: what a server's forward step costs.

* :class:`ModelSpec`: MLA layers (a compressed latent per token), recurrent layers (a fixed-size state per
  request) and a speculative drafter whose MLA layers join the target's KV manager (a DRAFT pool group).
  :meth:`ModelSpec.kv_layers` gives the :class:`~kvforge.kvcache.config.LayerSpec` list the real managers are
  built from. :data:`KIMI_K3_LIKE` (the default) is derived from
  :data:`kvforge.kvcache.snapshot_policy.KIMI_K3_LIKE`; other layouts are JSON files (:func:`load_model`).
* :class:`StepTimeModel`: a roofline over one server of ``gpus`` GPUs: ``max(compute, memory) + overhead``, with
  matmul and MLA-attention FLOPs over their throughputs and the bytes read (weights once per step, every
  request's latent and recurrent state) over the HBM bandwidth.
* :class:`Throughputs`: per-GPU peaks read from ``bench/results`` when present, else the ``FALLBACK_*``
  constants; ``efficiency`` scales them down and ``step_overhead_s`` adds a fixed per-step cost.

Single-kernel peaks make simulated step times a lower bound on a real engine's. Invalid fields raise
``TypeError`` / ``ValueError``. Where the default figures come from: ``docs/history.md``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvforge.kvcache.config import DTYPE_BYTES, LayerOwner, LayerSpec, LifeCycle
from kvforge.kvcache.snapshot_policy import KIMI_K3_LIKE as _K3_COST
from kvforge.kvcache.snapshot_policy import ModelCostSpec

__all__ = [
    "FALLBACK_ATTENTION_TFLOPS",
    "FALLBACK_HBM_GBPS",
    "FALLBACK_MATMUL_TFLOPS",
    "KIMI_K3_LIKE",
    "ModelSpec",
    "StepTimeModel",
    "Throughputs",
    "bench_results_dir",
    "load_model",
]

# H200 values from bench/results (see docs/history.md); used when the CSVs are not beside the package.
FALLBACK_MATMUL_TFLOPS = 1289.6
FALLBACK_ATTENTION_TFLOPS = 625.0
FALLBACK_HBM_GBPS = 4096.0


def _pos(name: str, v: object, *, integer: bool = False, zero_ok: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or not math.isfinite(v):
        raise TypeError(f"{name}: expected {'an int' if integer else 'a number'}, got {v!r}")
    if v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name}: expected a value {'>=' if zero_ok else '>'} 0, got {v!r}")


# Bytes per element -> the cache dtype name a ModelCostSpec's kv_dtype_bytes stands for.
_DTYPE_OF_BYTES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


@dataclass(frozen=True)
class ModelSpec:
    """A hybrid model as the simulator sees it. Sizes are per model (all GPUs of a server together).

    MLA: ``mla_layers`` layers of ``mla_heads`` heads; prefill attends with ``mla_qk_dim``/``mla_v_dim`` head
    dims, decode reads the cached latent (``mla_latent_dim`` elements per token per layer, ``kv_dtype``).
    Recurrent: ``recurrent_layers`` layers, each holding ``recurrent_state_bytes`` per request (the state a
    snapshot copies) and doing ``recurrent_flops_per_token`` per token. MoE: ``total_params`` /
    ``active_params`` (per token), of which ``dense_params`` every token uses; ``experts`` with ``top_k``
    routed per token, weights of ``weight_bytes`` each. Drafter: ``draft_layers`` MLA layers (in the KV
    manager), ``draft_params`` weights, ``draft_len`` tokens proposed per step, each accepted with probability
    ``draft_acceptance`` given the previous ones were.
    """

    # Layout and prefill-cost defaults come from the project's one model description,
    # kvforge.kvcache.snapshot_policy.KIMI_K3_LIKE; the MoE and drafter figures below are the simulator's own.
    name: str = "custom"
    mla_layers: int = len(_K3_COST.attention_layers)
    mla_heads: int = _K3_COST.attn_heads
    mla_qk_dim: int = _K3_COST.qk_head_dim
    mla_v_dim: int = _K3_COST.v_head_dim
    mla_latent_dim: int = _K3_COST.kv_elements_per_token
    kv_dtype: str = _DTYPE_OF_BYTES[_K3_COST.kv_dtype_bytes]
    recurrent_layers: int = len(_K3_COST.recurrent_layers)
    recurrent_state_bytes: int = _K3_COST.recurrent_state_bytes
    recurrent_flops_per_token: float = _K3_COST.recurrent_flops_per_token
    total_params: float = 1.0e12
    active_params: float = _K3_COST.active_params
    dense_params: float = 12e9
    experts: int = 384
    top_k: int = 8
    weight_bytes: float = 1.0
    draft_layers: int = 1
    draft_params: float = 1.5e9
    draft_len: int = 3
    draft_acceptance: float = 0.7

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty str, got {self.name!r}")
        for f in ("mla_layers", "mla_heads", "mla_qk_dim", "mla_v_dim", "mla_latent_dim", "experts", "top_k"):
            _pos(f, getattr(self, f), integer=True)
        for f in ("recurrent_layers", "recurrent_state_bytes", "draft_layers", "draft_len"):
            _pos(f, getattr(self, f), integer=True, zero_ok=True)
        for f in ("total_params", "active_params", "weight_bytes"):
            _pos(f, getattr(self, f))
        for f in ("dense_params", "draft_params", "recurrent_flops_per_token"):
            _pos(f, getattr(self, f), zero_ok=True)
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"kv_dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.kv_dtype!r}")
        if (self.recurrent_layers == 0) != (self.recurrent_state_bytes == 0):
            raise ValueError("recurrent_layers and recurrent_state_bytes: give both (a hybrid) or neither")
        if not self.dense_params <= self.active_params <= self.total_params:
            raise ValueError(
                f"params: expected dense ({self.dense_params:g}) <= active ({self.active_params:g}) <= total "
                f"({self.total_params:g})"
            )
        if self.top_k > self.experts:
            raise ValueError(f"top_k: {self.top_k} exceeds experts ({self.experts})")
        a = self.draft_acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"draft_acceptance: expected a probability in [0, 1], got {a!r}")
        if self.draft_len and not self.draft_layers:
            raise ValueError("draft_len: a drafter needs draft_layers >= 1")

    # --- derived -----------------------------------------------------------------------------------------------

    @property
    def is_hybrid(self) -> bool:
        return self.recurrent_layers > 0

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.mla_latent_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention cache bytes per token, target and drafter layers together."""
        return (self.mla_layers + self.draft_layers) * self.kv_bytes_per_token_layer

    @property
    def state_bytes(self) -> int:
        """One request's recurrent state (every recurrent layer): what one snapshot costs."""
        return self.recurrent_layers * self.recurrent_state_bytes

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens a generation step emits: 1 + a + a² + ... + a^draft_len."""
        a = self.draft_acceptance
        return float(sum(a**i for i in range(self.draft_len + 1)))

    def _recurrent_layer(self, layer_id: int) -> LayerSpec:
        return LayerSpec(layer_id, LifeCycle.recurrent(), state_bytes=self.recurrent_state_bytes, dtype="float32")

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """The layer list a KV cache manager is configured with: MLA (full attention, the latent), recurrent
        (one state per layer), then the drafter's MLA layers (owner DRAFT, sharing the manager)."""
        out: list[LayerSpec] = []
        lid = 0
        # Interleave as a 3:1 hybrid does (the manager groups by life cycle, so the order only names the ids).
        per = max(1, self.recurrent_layers // self.mla_layers)
        rec_left = self.recurrent_layers
        for _ in range(self.mla_layers):
            for _ in range(min(per, rec_left)):
                out.append(self._recurrent_layer(lid))
                lid += 1
                rec_left -= 1
            out.append(LayerSpec(lid, bytes_per_token=self.kv_bytes_per_token_layer, dtype=self.kv_dtype))
            lid += 1
        for _ in range(rec_left):
            out.append(self._recurrent_layer(lid))
            lid += 1
        for _ in range(self.draft_layers):
            out.append(
                LayerSpec(
                    lid, bytes_per_token=self.kv_bytes_per_token_layer, dtype=self.kv_dtype, owner=LayerOwner.DRAFT
                )
            )
            lid += 1
        return tuple(out)

    @classmethod
    def from_cost_spec(cls, spec: ModelCostSpec, **fields_: Any) -> ModelSpec:
        """The layout of a :class:`kvforge.kvcache.snapshot_policy.ModelCostSpec`, plus ``fields_`` (MoE and
        drafter figures, which it does not describe)."""
        if not isinstance(spec, ModelCostSpec):
            raise TypeError(f"spec: expected a ModelCostSpec, got {type(spec).__name__}")
        base: dict[str, Any] = {
            "name": spec.name,
            "mla_layers": len(spec.attention_layers),
            "mla_heads": spec.attn_heads,
            "mla_qk_dim": spec.qk_head_dim,
            "mla_v_dim": spec.v_head_dim,
            "mla_latent_dim": spec.kv_elements_per_token,
            "kv_dtype": _DTYPE_OF_BYTES[spec.kv_dtype_bytes],
            "recurrent_layers": len(spec.recurrent_layers),
            "recurrent_state_bytes": spec.recurrent_state_bytes,
            "recurrent_flops_per_token": spec.recurrent_flops_per_token,
            "active_params": spec.active_params,
        }
        base.update(fields_)
        return cls(**base)

    def to_cost_spec(self) -> ModelCostSpec:
        """This layout as the :class:`~kvforge.kvcache.snapshot_policy.ModelCostSpec` the cost-aware snapshot
        policy values snapshots with (a hybrid model only: it needs recurrent layers)."""
        if not self.is_hybrid:
            raise ValueError(f"{self.name}: a cost spec needs recurrent layers")
        n = self.mla_layers + self.recurrent_layers
        ids = [layer.layer_id for layer in self.kv_layers() if layer.owner is LayerOwner.TARGET]
        attn = tuple(lid for lid, layer in zip(ids, self.kv_layers()) if layer.life_cycle.is_attention)
        assert len(ids) == n
        return ModelCostSpec(
            name=self.name,
            num_layers=n,
            attention_layers=attn,
            hidden_size=_K3_COST.hidden_size,  # not part of the cost; the simulator does not model it
            active_params=self.active_params,
            kv_elements_per_token=self.mla_latent_dim,
            kv_dtype_bytes=DTYPE_BYTES[self.kv_dtype],
            attn_heads=self.mla_heads,
            qk_head_dim=self.mla_qk_dim,
            v_head_dim=self.mla_v_dim,
            recurrent_state_bytes=self.recurrent_state_bytes,
            recurrent_flops_per_token=self.recurrent_flops_per_token,
        )

    def attention_only(self) -> ModelSpec:
        """The same model without recurrent layers (what a manager that cannot snapshot them could reuse)."""
        from dataclasses import replace

        return replace(self, name=f"{self.name} (attention only)", recurrent_layers=0, recurrent_state_bytes=0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KIMI_K3_LIKE = ModelSpec.from_cost_spec(_K3_COST)
"""Derived from :data:`kvforge.kvcache.snapshot_policy.KIMI_K3_LIKE` (the cache layout and prefill cost: 16 MLA +
45 KDA layers, bf16 latent, 4.3 MB of state per KDA layer, ~32e9 active parameters), completed with the
simulator's defaults for what that description leaves out: a Kimi-K2-sized MoE (1e12 parameters, 384 experts,
top-8, FP8 weights, ~12e9 dense) and one MTP drafter layer proposing 3 tokens at 70% acceptance each."""


def load_model(spec: str | Path | None) -> ModelSpec:
    """``None`` or ``"kimi-k3-like"``: the default; otherwise a JSON file of :class:`ModelSpec` fields (missing
    ones take the default's values). Raises ValueError naming the problem."""
    if spec is None or str(spec) == KIMI_K3_LIKE.name:
        return KIMI_K3_LIKE
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--model: expected 'kimi-k3-like' or a JSON file, no such file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model {path}: expected a JSON object of model fields")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--model {path}: unknown field(s) {unknown}; known: {sorted(known)}")
    data.setdefault("name", path.stem)
    try:
        return ModelSpec(**{**KIMI_K3_LIKE.to_dict(), **data})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--model {path}: {exc}") from None


# --- throughputs ---------------------------------------------------------------------------------------------------


def bench_results_dir() -> Path:
    """``bench/results`` of the checkout this package runs from (it may not exist in an installed wheel)."""
    return Path(__file__).resolve().parents[2] / "bench" / "results"


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _latest(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    if not rows or "date" not in rows[0]:
        return rows
    last = max(r.get("date") or "" for r in rows)
    return [r for r in rows if (r.get("date") or "") == last]


def _floats(rows: Sequence[dict[str, str]], column: str, **match: str) -> list[float]:
    out = []
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            try:
                out.append(float(r[column]))
            except (KeyError, TypeError, ValueError):
                continue
    return out


@dataclass(frozen=True)
class Throughputs:
    """Per-GPU throughputs of the step-time model (where the defaults come from: ``docs/history.md``).
    ``source`` says whether they were read from ``bench/results`` or are the fallback constants."""

    matmul_tflops: float = FALLBACK_MATMUL_TFLOPS
    attention_tflops: float = FALLBACK_ATTENTION_TFLOPS
    hbm_gbps: float = FALLBACK_HBM_GBPS
    gpus: int = 8
    efficiency: float = 1.0
    step_overhead_s: float = 0.0005
    source: str = "fallback constants (H200 measurements)"

    def __post_init__(self) -> None:
        for f in ("matmul_tflops", "attention_tflops", "hbm_gbps"):
            _pos(f, getattr(self, f))
        _pos("gpus", self.gpus, integer=True)
        _pos("step_overhead_s", self.step_overhead_s, zero_ok=True)
        e = self.efficiency
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0.0 < e <= 1.0:
            raise ValueError(f"efficiency: expected a number in (0, 1], got {e!r}")

    @classmethod
    def from_bench_results(cls, results_dir: Path | None = None, **overrides: Any) -> Throughputs:
        """The H200 figures from ``results_dir`` (default :func:`bench_results_dir`), each falling back to its
        constant when its file or row is missing; ``overrides`` (not None) win."""
        d = bench_results_dir() if results_dir is None else Path(results_dir)
        # The latest run of each bench (rows are appended, one run per date stamp).
        mla = _latest(_read_csv(d / "mla_context.csv"))
        copies = _latest(_read_csv(d / "small_copies.csv"))
        mm = _floats(mla, "fp8_mm_tflops")
        attn = _floats(mla, "tflops", provider="kvforge fp8")
        bw = _floats(copies, "gbps", provider="d2d copy (same bytes)")
        found = [name for name, xs in (("matmul", mm), ("attention", attn), ("bandwidth", bw)) if xs]
        values: dict[str, Any] = {
            "matmul_tflops": mm[-1] if mm else FALLBACK_MATMUL_TFLOPS,
            "attention_tflops": statistics.median(attn) if attn else FALLBACK_ATTENTION_TFLOPS,
            "hbm_gbps": bw[-1] if bw else FALLBACK_HBM_GBPS,
            "source": (f"{d} ({', '.join(found)})" if found else "fallback constants (H200 measurements)"),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class StepTimeModel:
    """Seconds one server's step takes (see the module docstring). Cheap: called once per simulated step."""

    def __init__(self, model: ModelSpec, throughputs: Throughputs) -> None:
        self.model = model
        self.tp = throughputs
        g, e = throughputs.gpus, throughputs.efficiency
        self._mm = throughputs.matmul_tflops * 1e12 * g * e
        self._attn = throughputs.attention_tflops * 1e12 * g * e
        self._bw = throughputs.hbm_gbps * 1e9 * g * e
        m = model
        self._attn_pair_flops = 2.0 * m.mla_heads * (m.mla_qk_dim + m.mla_v_dim) * m.mla_layers
        # Absorbed MLA decode: scores over the latent (qk) and the output in latent space (v).
        self._decode_pair_flops = 2.0 * m.mla_heads * (m.mla_latent_dim + m.mla_latent_dim - 64) * m.mla_layers
        self._token_flops = 2.0 * m.active_params + m.recurrent_layers * m.recurrent_flops_per_token
        self._dense_bytes = m.dense_params * m.weight_bytes
        self._expert_bytes = (m.total_params - m.dense_params) * m.weight_bytes
        self._kv_tok = m.kv_bytes_per_token
        self._state = m.state_bytes
        self._draft_bytes = m.draft_params * m.weight_bytes

    def weight_bytes(self, tokens: int) -> float:
        """Weights one real forward step reads for ``tokens`` tokens: the dense part and every expert at least
        one token is routed to (uniform routing: ``1 - (1 - k/E)^tokens`` of them)."""
        if tokens <= 0:
            return 0.0
        m = self.model
        touched = 1.0 - (1.0 - m.top_k / m.experts) ** tokens
        return self._dense_bytes + self._expert_bytes * touched

    def step_time(
        self,
        prefill: Sequence[tuple[int, int]],
        decode_contexts: float,
        decode_requests: float,
        real_steps: int = 1,
    ) -> float:
        """One simulated step: context chunks ``prefill`` as ``(start, num_tokens)`` pairs, plus ``real_steps``
        generation steps of ``decode_requests`` requests whose contexts sum to ``decode_contexts`` tokens (both
        may be fractional: the mean over the real steps, when requests finish inside them).

        Each generation step verifies ``1 + draft_len`` tokens per request and runs the drafter ``draft_len``
        times. The prefill is spread over the ``real_steps`` steps (chunked prefill), so the weights are read
        ``real_steps`` times in all.
        """
        m = self.model
        flops = 0.0
        attn = 0.0
        prefill_tokens = 0
        for start, n in prefill:
            prefill_tokens += n
            attn += self._attn_pair_flops * n * (start + (n + 1) / 2)
        flops += self._token_flops * prefill_tokens
        mem = 0.0
        if decode_requests:
            verify = decode_requests * (1 + m.draft_len)
            flops += real_steps * self._token_flops * verify
            attn += real_steps * self._decode_pair_flops * (decode_contexts + decode_requests) * (1 + m.draft_len)
            per_step_tokens = verify + prefill_tokens / real_steps
            mem += real_steps * (
                self.weight_bytes(math.ceil(per_step_tokens))
                + decode_contexts * self._kv_tok
                + 2 * decode_requests * self._state
                + m.draft_len * self._draft_bytes
            )
            flops += real_steps * m.draft_len * 2.0 * m.draft_params * decode_requests
        elif prefill_tokens:
            mem += real_steps * self.weight_bytes(math.ceil(prefill_tokens / real_steps))
        if not prefill_tokens and not decode_requests:
            return 0.0
        compute = flops / self._mm + attn / self._attn
        return max(compute, mem / self._bw) + real_steps * self.tp.step_overhead_s
