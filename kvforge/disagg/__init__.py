"""Disaggregated serving: moving a request's KV cache from context workers to generation workers.

Modules (imported on demand, so ``kvforge.disagg.launch`` and ``rank_info`` stay free of torch and Triton):

* ``rank_info``: ``RankInfo``, the rank metadata exchanged at registration, and its versioned msgpack wire format;
* ``peer``: compatibility checks between two instances (``check_peer``);
* ``mapping``: which context rank sends which layers, heads and blocks to which generation rank (TP, PP, helix CP);
* ``layers``: what the KV cache provides (``KVLayer``, ``RequestKV``): the disagg -> cache seam;
* ``transport``: the ``Transport`` interface and its torch.distributed implementation (gloo, NCCL);
* ``transceiver``: ``KVSender`` (context side) and ``KVReceiver`` (generation side) with deadlines, cancellation,
  consensus polling and the helix idle probe;
* ``launch``: server-role forwarding through environment overrides, and local process worlds;
* ``synthetic``: toy instances and a deterministic logical cache for tests and benchmarks.

The block gather/scatter kernels are ``kvforge.kernels.kv_pack``; the helix combine is
``kvforge.kernels.merge_states.merge_attention_states``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RankInfo": "rank_info",
    "WireVersionError": "rank_info",
    "WIRE_VERSION": "rank_info",
    "PeerMismatchError": "peer",
    "check_peer": "peer",
    "Piece": "mapping",
    "plan_pieces": "mapping",
    "helix_blocks": "mapping",
    "KVLayer": "layers",
    "RequestKV": "layers",
    "Transport": "transport",
    "TorchDistTransport": "transport",
    "KVSender": "transceiver",
    "KVReceiver": "transceiver",
    "TransferStatus": "transceiver",
    "ServerRole": "launch",
    "role_env_overrides": "launch",
    "apply_env_overrides": "launch",
    "launch_workers": "launch",
    "run_world": "launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvforge.disagg.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvforge.disagg' has no attribute {name!r}")
