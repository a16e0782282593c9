"""kvforge: a Triton-kernel-first library for serving hybrid-attention LLMs.

Layers (imports point down only): ``routing`` / ``scheduling`` / ``disagg`` -> ``kvcache`` -> ``kernels``.
Importing the top-level package is cheap: subpackages are imported on demand.
"""

from kvforge.errors import KvforgeError

__version__ = "0.1.0"
__all__ = ["KvforgeError", "__version__"]
