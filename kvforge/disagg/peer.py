"""Peer compatibility checks run when a context and a generation instance register with each other.

Every rule names the property and both values. What must agree and why:

* wire version, MLA-ness, KV dtype and element size, head dim: the bytes of a token row mean the same thing;
* tokens per block (the page size): blocks travel whole, and helix deals whole blocks over CP ranks;
* target layer count: PP stages on the two sides cover the same layers;
* context parallelism on at most one side (helix pairs a cp=1 context with a cp=N generation instance);
* draft layers (a drafter sharing the cache): equal count, dtype and head count when both sides have them; when
  only one side has a drafter the draft layers are simply not transferred;
* recurrent state layers (hybrid models): equal count and state size, or none on either side;
* attention DP on either side or both is accepted (the request's DP rank picks the group on each side, see
  ``kvforge.disagg.mapping``); a rank whose DP metadata contradicts itself is refused with the rule the mapping
  uses (:func:`attention_dp_problem`);
* for non-MLA caches, KV head count and an attention TP (per DP group) that splits the heads evenly on both
  sides (target and shared draft layers). MLA caches are replicated across TP, so their head split is not
  checked: asymmetric MLA TP (per DP group or not) is accepted, as in the reference system, which dropped its
  total-TP and attention-DP checks for a per-DP attention TP check that skips MLA peers.
"""

from __future__ import annotations

from kvforge.disagg.rank_info import RankInfo


class PeerMismatchError(ValueError):
    """Two instances cannot exchange KV caches; the message lists every mismatch with both values."""


def _diff(what: str, a: object, b: object, why: str = "") -> str:
    return f"{what}: local {a!r} vs peer {b!r}" + (f" ({why})" if why else "")


def peer_mismatches(local: RankInfo, peer: RankInfo) -> list[str]:
    """Every reason ``local`` and ``peer`` cannot exchange KV caches (empty when compatible)."""
    out: list[str] = []
    helix = local.cp_size > 1 or peer.cp_size > 1
    if local.version != peer.version:
        out.append(_diff("wire version", local.version, peer.version))
    if local.is_mla != peer.is_mla:
        out.append(_diff("is_mla", local.is_mla, peer.is_mla))
    if local.kv_dtype != peer.kv_dtype:
        out.append(_diff("kv_dtype", local.kv_dtype, peer.kv_dtype))
    if local.element_bytes != peer.element_bytes:
        out.append(_diff("element_bytes", local.element_bytes, peer.element_bytes))
    if local.tokens_per_block != peer.tokens_per_block:
        why = "helix deals whole blocks over the CP ranks" if helix else "blocks are transferred whole"
        out.append(_diff("tokens_per_block (page size)", local.tokens_per_block, peer.tokens_per_block, why))
    if local.head_dim != peer.head_dim:
        out.append(_diff("head_dim", local.head_dim, peer.head_dim))
    if local.num_layers != peer.num_layers:
        out.append(_diff("target layers (sum of layers_per_pp)", local.num_layers, peer.num_layers))
    if local.cp_size > 1 and peer.cp_size > 1:
        out.append(
            _diff("cp_size", local.cp_size, peer.cp_size, "context parallelism is supported on at most one side")
        )
    if local.has_draft and peer.has_draft:
        if local.num_draft_layers != peer.num_draft_layers:
            out.append(_diff("num_draft_layers", local.num_draft_layers, peer.num_draft_layers))
        if local.draft_kv_dtype != peer.draft_kv_dtype:
            out.append(_diff("draft_kv_dtype", local.draft_kv_dtype, peer.draft_kv_dtype))
        if local.draft_kv_heads != peer.draft_kv_heads:
            out.append(_diff("draft_kv_heads", local.draft_kv_heads, peer.draft_kv_heads))
    if (local.state_layers, local.state_bytes) != (peer.state_layers, peer.state_bytes):
        out.append(
            _diff(
                "recurrent state (state_layers, state_bytes)",
                (local.state_layers, local.state_bytes),
                (peer.state_layers, peer.state_bytes),
                "the states travel beside the KV and must mean the same on both sides",
            )
        )
    for side in (local, peer):
        problem = attention_dp_problem(side)
        if problem is not None:
            out.append(problem)
    if not local.is_mla and not peer.is_mla:
        if local.kv_heads != peer.kv_heads:
            out.append(_diff("kv_heads", local.kv_heads, peer.kv_heads))
        a, b = local.attention_tp_size, peer.attention_tp_size
        draft_l = local.draft_kv_heads if draft_layers_shared(local, peer) else None
        draft_p = peer.draft_kv_heads if draft_layers_shared(local, peer) else None
        if local.kv_heads % a or peer.kv_heads % b or (draft_l or a) % a or (draft_p or b) % b:
            out.append(
                _diff(
                    "attention TP size per DP group",
                    a,
                    b,
                    f"must split the KV heads evenly on both sides (kv_heads {local.kv_heads} / {peer.kv_heads}, "
                    f"draft_kv_heads {draft_l} / {draft_p})",
                )
            )
    return out


def attention_dp_problem(info: RankInfo) -> str | None:
    """Why a rank's DP layout cannot be mapped for KV transfer (None when it can). The mapping
    (``InstanceLayout.of``) and the peer check share this rule.

    Under attention DP, DP group d holds TP ranks ``[d * attention_tp, (d + 1) * attention_tp)``, so a rank's
    ``dp_rank`` must be ``tp_rank // attention_tp``; a rank announcing another group would receive (or send) the
    KV of requests it does not hold. Without attention DP ``dp_size`` / ``dp_rank`` do not split the TP ranks and
    are not checked (the reference system ignores them there too).
    """
    if info.attention_dp:
        expected = info.tp_rank // info.attention_tp_size
        if info.dp_rank != expected:
            return (
                f"dp_rank: under attention DP, TP rank {info.tp_rank} of {info.tp_size} with dp_size {info.dp_size} "
                f"belongs to DP group {expected}, got dp_rank {info.dp_rank} on {info.instance_name!r}"
            )
    return None


def dp_group(info: RankInfo) -> int:
    """The attention-DP group this rank holds requests of (0 without attention DP)."""
    return info.tp_rank // info.attention_tp_size if info.attention_dp else 0


def check_peer(local: RankInfo, peer: RankInfo) -> None:
    """Raise ``PeerMismatchError`` naming every incompatible property and both values."""
    problems = peer_mismatches(local, peer)
    if problems:
        raise PeerMismatchError(
            f"peer {peer.instance_name!r} rank {peer.instance_rank} is incompatible with "
            f"{local.instance_name!r} rank {local.instance_rank}: " + "; ".join(problems)
        )


def draft_layers_shared(local: RankInfo, peer: RankInfo) -> bool:
    """Whether draft layers travel: only when both sides have a drafter sharing the cache."""
    return local.has_draft and peer.has_draft
