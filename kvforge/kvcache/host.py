"""Host-side process settings for a server that runs kvforge's cache: keeping the cyclic garbage collector cheap.

A manager builds its pages and its tree blocks once, at construction, and reuses them (``docs/kvcache.md``, host
cost); each collection of CPython's cyclic collector walks every object of the generations it collects.
:func:`freeze_gc` moves every object alive now (the imported modules, the pools' pages and blocks) into the
collector's permanent generation, as vLLM and SGLang do once their engine has started: call it once after building
the managers (and a warm-up, if any). The collector stays on; objects created afterwards are collected as usual.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_gc"]


def freeze_gc() -> int:
    """Collect garbage now, then freeze every surviving object (``gc.freeze``); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
