"""Committed launch configurations for fla-core's autotuned kernels, so the engine's first KDA call does not tune.

fla-core's chunk and recurrent KDA kernels carry ``@autotune`` lists; on a fresh process their first call times
every config of every kernel (minutes on an H200). fla-core can instead read one JSON file per kernel from
``$FLA_CONFIG_DIR`` (``{"kernel_name", "autotune_entries": {key hash: {"autotune_key", "config"}}}``), looked up
according to ``$FLA_CACHE_MODE``. This module keeps such files per GPU under ``kvforge/engine/fla_configs/<GPU>/``
(the GPU name as fla sanitises it, e.g. ``NVIDIA_H200``):

* :func:`use_committed_fla_configs` points fla-core at the directory of this GPU, in ``strict`` mode (a config is
  used only for exactly the key it was tuned for: heads, head dims, chunk size, dtypes; any other key tunes as
  usual). It does nothing when the user set ``FLA_CACHE_MODE`` or ``FLA_CONFIG_DIR``, or when there is no
  directory for this GPU. It sets ``FLA_CONFIG_DIR`` in the process environment (fla reads it per lookup).
* :func:`export_fla_configs` writes the configs fla-core's autotuners chose in this process (after a warm-up
  that tuned them) into a directory of that format: how the committed files were made.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["FLA_CONFIG_ROOT", "export_fla_configs", "use_committed_fla_configs"]

FLA_CONFIG_ROOT = Path(__file__).with_name("fla_configs")


def use_committed_fla_configs() -> Path | None:
    """Point fla-core at kvforge's committed configs for this GPU (see the module docstring); returns the
    directory used, or None."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        return None
    from fla.ops.utils import cache as fla_cache  # type: ignore[import-untyped]

    d = FLA_CONFIG_ROOT / fla_cache.get_gpu_info()
    if not d.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"] = str(d)
    # fla reads FLA_CACHE_MODE once at import into this module global, which its lookups consult per call.
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.STRICT
    return d


def _autotuners() -> list:
    from triton.runtime.autotuner import Autotuner  # type: ignore[import-untyped]

    found, seen = [], set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            o = obj
            while o is not None and not isinstance(o, Autotuner) and hasattr(o, "fn"):
                o = o.fn  # through @triton.heuristics wrappers
            if isinstance(o, Autotuner) and id(o) not in seen:
                seen.add(id(o))
                found.append(o)
    return found


def export_fla_configs(dest: str | os.PathLike[str]) -> int:
    """Write the configs fla-core's autotuners hold in this process into ``dest`` (one JSON per kernel, fla's
    format); returns the number of kernels written."""
    import triton  # type: ignore[import-untyped]
    from fla.ops.utils.cache import AutotuneKey  # type: ignore[import-untyped]

    if not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"dest: expected a path, got {type(dest).__name__}")
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"dest: expected a directory, got the file {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for tuner in _autotuners():
        if not tuner.cache:
            continue
        fn = tuner.fn
        name = getattr(getattr(fn, "fn", fn), "__name__", None)
        if name is None:
            continue
        entries = {}
        for key, cfg in tuner.cache.items():
            entries[AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key),
                "config": {
                    "kwargs": dict(cfg.kwargs),
                    "num_warps": cfg.num_warps,
                    "num_stages": cfg.num_stages,
                    "num_ctas": getattr(cfg, "num_ctas", 1),
                    "maxnreg": getattr(cfg, "maxnreg", None),
                },
            }
        doc = {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": entries}
        (dest / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        n += 1
    return n
