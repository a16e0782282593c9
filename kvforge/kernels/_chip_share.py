"""Key shares of a device-built context-attention table, derived on chip (one helper for both kernels).

``_chip_share(rows, kv_row0, diag0, c, n_shares, KV_ALIGN, BLOCK_N)`` is share ``c`` of ``n_shares`` of a 4-int
work item (first query row, rows, first KV row of the request, keys every row sees - 1), as
``mla_context._share_items`` computes it on the host: ``(kv_row0', diag0', key cap)``. The item's key blocks
(keys plus dim-major V's ``shift = kv_row0 % KV_ALIGN``) go ``ceil(blocks / n_shares)`` to a share. Share 0 keeps
the item's base with its keys capped at the end of its blocks; a later share is rebased to its first block
(aligned, so it has no head block) and capped at its blocks' length; the last share has no cap. A share past
the item's blocks sweeps nothing. Integer arithmetic only: the portable ``@triton.jit`` kernel and the Gluon
kernel both call it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chip_share(n_rows, kv_row0, diag0, c, n_shares, KV_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Share ``c`` of ``n_shares`` of a 4-int item, as ``_share_items`` computes it on the host: (kv_row0',
    diag0', key cap). Blocks are ``ceil((diag0 + rows + shift) / BLOCK_N)``, ``ceil(blocks / n_shares)`` a share."""
    shift = kv_row0 % KV_ALIGN
    blocks = tl.maximum(diag0 + n_rows + shift + BLOCK_N - 1, 0) // BLOCK_N
    per = tl.maximum((blocks + n_shares - 1) // n_shares, 1)
    b0 = tl.minimum(c * per, blocks)
    b1 = tl.minimum((c + 1) * per, blocks)
    base = tl.where(c == 0, 0, b0 * BLOCK_N - shift)
    cap = tl.where(c == 0, b1 * BLOCK_N - shift, (b1 - b0) * BLOCK_N)
    cap = tl.where(c == n_shares - 1, 1 << 30, cap)
    return kv_row0 + base, diag0 - base, cap
