"""bench/probe_decode_kernels.py: the launches of one CUDA-graph decode step, counted on the CPU.

The counts are the guard against the decode step growing small kernels again (issue 29): each layer kind is
held to the launches it has now (the fused projections, ``kda_prepare``, ``mla_latent_store``, the norm kernels,
the step's two bookkeeping kernels), and the captured step reads nothing back to the host.
"""

from __future__ import annotations

import pytest

from bench.probe_decode_kernels import count_step
from kvforge.kernels._runtime import kernel_device

# Launches per layer (MLA, KDA, MLP, norm) and per step (head, step) with one draft token or none.
MOST = {"MLA": 9, "KDA": 4, "MLP": 3, "norm": 2}


@pytest.mark.parametrize("draft_len", [0, 1])
def test_decode_step_launches(draft_len: int) -> None:
    r = count_step("tiny", 2, draft_len, str(kernel_device()), False)  # the GPU where there is one
    assert r["host_reads"] == 0
    # On a GPU the decode kernel may add its merge launch (one per MLA layer): not held here.
    merges = {k: sum(v for n, v in ops.items() if "merge" in n) for k, ops in r["ops"].items()}
    n_mla = len(r["layer_types"].replace("L", ""))
    for kind, most in MOST.items():
        per = r["per_layer"][kind] - (merges["MLA"] / n_mla if kind == "MLA" else 0)
        assert 0 < per <= most, (kind, r["ops"][kind])
    assert r["per_kind"]["head"] <= 3, r["ops"]["head"]
    # Draft verification adds one state selection per KDA layer (3 in tiny()) and the drafter's layer.
    assert r["per_kind"]["step"] <= (4 if draft_len == 0 else 9), r["ops"]["step"]
    assert (r["per_kind"]["drafter"] > 0) is (draft_len > 0)
    assert r["per_kind"]["drafter"] - merges["drafter"] <= 25, r["ops"]["drafter"]
    # Every Triton kernel the step uses shows up as a launch (the counting hook sees the interpreter's launches).
    launched = {n for ops in r["ops"].values() for n in ops}
    assert {"triton._kda_prepare_kernel", "triton._mla_latent_kernel", "triton._decode_finish_kernel"} <= launched
