"""kvforge.engine: a small serving engine on real tensors, composing the scheduler, the hybrid cache manager,
the kernels and disaggregation (a reference for people wiring kvforge into a server).

* :mod:`~kvforge.engine.config`: model sizes (``tiny`` for the CPU interpreter, ``real`` ~2.9 B) and budgets;
* :mod:`~kvforge.engine.model`: the Kimi-Linear-like hybrid model (KDA + MLA layers, one MTP-style drafter);
* :mod:`~kvforge.engine.planted`: the optional copy head (``ModelConfig.copy_offset``) that makes logits peaked;
* :mod:`~kvforge.engine.cache`: the tensors the manager's page ids index (latent, draft latent, states);
* :mod:`~kvforge.engine.runner`: one forward step over the paged cache;
* :mod:`~kvforge.engine.engine`: the loop (:class:`Engine`);
* :mod:`~kvforge.engine.reference`: the plain forward pass the tests compare against;
* :mod:`~kvforge.engine.disagg`: context -> generation handoff through ``kvforge.disagg``;
* :mod:`~kvforge.engine.numerics`: the logits check (near-tie aware) and the per-layer, per-component error probe;
* :mod:`~kvforge.engine.fla_configs`: committed fla-core launch configs per GPU (no tuning pause).
"""

from kvforge.engine.config import EngineConfig, ModelConfig, real, tiny
from kvforge.engine.engine import Engine, kv_cache_config
from kvforge.engine.model import HybridModel
from kvforge.engine.reference import reference_greedy, reference_logits

__all__ = [
    "Engine",
    "EngineConfig",
    "HybridModel",
    "ModelConfig",
    "kv_cache_config",
    "real",
    "reference_greedy",
    "reference_logits",
    "tiny",
]
