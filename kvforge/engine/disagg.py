"""Disaggregated serving with the engine: a context engine prefills, a generation engine continues decoding.

Both sides describe their memory with ``kvforge.disagg.layers.kv_layers_from_manager`` (MLA latent pages, the
drafter's latent pages, KDA state pages) and their requests with ``request_kv_from_cache``.

* Context side: the request runs with ``max_new_tokens=1`` (prefill, first token, first draft). Then
  :func:`export_request` re-acquires its pages through a *sender cache* (a cache that reuses the whole prompt,
  so its pages stay locked while they are sent) and lists the state pages to move: the live state, then the
  snapshots at :func:`transfer_points` (the snapshot points both sides derive from the prompt length alone).
* Generation side: :func:`prepare_receive` creates a cache for the prompt (no reuse) and lists its pages; the
  snapshots land in the engine's staging state rows. After the transfer, :func:`finish_receive` commits the
  prompt step by step so the manager records a snapshot at each point, runs those copies from the staging
  rows, and admits the request straight into the generation phase with its first token and draft.

An FP8 latent cache (``EngineConfig.latent_cache_dtype="fp8_e4m3"``) moves as stored: one byte per value, the
layers and ``RankInfo`` announce float8_e4m3fn, and :class:`Handoff` carries the scale the receiver must share.

Gap worked around here: the scheduler has no public call to admit a request whose prefill ran elsewhere;
:func:`finish_receive` sets the request's phase and the scheduler's running list directly.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.disagg.layers import KVLayer, RequestKV, kv_layers_from_manager, request_kv_from_cache
from kvforge.disagg.rank_info import RankInfo
from kvforge.engine.engine import Engine
from kvforge.kernels.slot_ops import slot_scatter
from kvforge.kvcache.config import LayerOwner, dtype_name
from kvforge.kvcache.hybrid import HybridKVCache
from kvforge.kvcache.manager import PageCopy
from kvforge.scheduling import Request, RequestState

__all__ = ["Handoff", "engine_layers", "engine_rank_info", "export_request", "finish_receive", "prepare_receive"]


@dataclass
class Handoff:
    """What travels beside the KV (a coordinator's message): the prompt, the first token and draft, the
    snapshot positions whose states travel after the live one."""

    request_id: int
    prompt: list[int]
    first_token: int
    draft_token: int
    snapshot_points: list[int]
    max_new_tokens: int
    # The sender's FP8 latent scale (None: a 16-bit latent cache). Pages move as stored bytes, so the receiver
    # must read them at the same scale; the dtypes are matched by the RankInfo peer check.
    latent_scale: float | None = None


def engine_layers(engine: Engine) -> list[KVLayer]:
    pools = {**engine.cache.latent, **engine.cache.state}
    if engine.cache.draft_latent is not None:
        pools[engine.model.config.num_layers] = engine.cache.draft_latent
    return kv_layers_from_manager(engine.manager, pools)


def engine_rank_info(engine: Engine, instance_name: str, transport_rank: int) -> RankInfo:
    """A one-rank instance (TP = PP = CP = DP = 1) announcing the engine's MLA latent cache and drafter."""
    mc = engine.model.config
    # The latent pools' dtype (float8_e4m3fn with an FP8 latent cache: one byte per value, moved as stored).
    ldt = engine.cache.latent_dtype
    dt = dtype_name(ldt)
    esize = torch.empty(0, dtype=ldt).element_size()
    has_draft = any(s.owner is LayerOwner.DRAFT for s in engine.kv_config.layers)
    layers = engine_layers(engine)
    return RankInfo(
        instance_name=instance_name,
        instance_rank=0,
        transport_rank=transport_rank,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        cp_size=1,
        cp_rank=0,
        attention_dp=False,
        layers_per_pp=(mc.num_layers,),
        is_mla=True,
        kv_heads=1,
        head_dim=mc.latent_dim,
        kv_dtype=dt,
        element_bytes=esize,
        tokens_per_block=engine.config.tokens_per_block,
        page_groups=tuple(ly.group for ly in layers),
        num_draft_layers=1 if has_draft else None,
        draft_kv_dtype=dt if has_draft else None,
        draft_kv_heads=1 if has_draft else None,
        state_layers=len(mc.linear_layers),
        state_bytes=4 * mc.linear_heads * mc.linear_head_dim * mc.linear_head_dim,
    )


def transfer_points(engine: Engine, prompt_len: int) -> list[int]:
    """Snapshot points below ``prompt_len`` that any engine of this configuration marks for this prompt length
    (periodic ones and prompt-end offsets; not branch points, which depend on the tree)."""
    cfg, tpb = engine.config, engine.config.tokens_per_block
    pts: set[int] = set()
    if cfg.snapshot_interval:
        pts.update(range(cfg.snapshot_interval, prompt_len, cfg.snapshot_interval))
    for d in cfg.prompt_end_offsets:
        p = (prompt_len - d) // tpb * tpb
        if 0 < p < prompt_len:
            pts.add(p)
    return sorted(pts)


def export_request(engine: Engine, request_id: int, prompt: Sequence[int]) -> tuple[RequestKV, Handoff, HybridKVCache]:
    """Context side, after the request finished its prefill: the pages to send, the handoff message, and the
    sender cache (close it when the transfer ends: ``KVSender``'s ``release``)."""
    req = engine.finished.get(request_id)
    if req is None or not req.output_tokens:
        raise ValueError(f"request_id: {request_id!r} has not finished its prefill on this engine")
    prompt = list(prompt)
    mgr = engine.manager
    cache = mgr.create_cache(prompt, scope=req.scope, max_reuse_tokens=len(prompt))
    engine.cache.execute(mgr.take_pending_copies())
    if cache.num_reused_tokens != len(prompt):
        cache.close()
        raise ValueError(
            f"request_id: only {cache.num_reused_tokens} of {len(prompt)} prompt tokens are still cached (evicted)"
        )
    g = engine.state_group
    live = cache.live_page(g)
    assert live is not None
    # Snapshot pages of the prompt's blocks, walking the tree by the cache's block keys.
    tpb = engine.config.tokens_per_block
    node = mgr.tree.find_root(req.scope)
    snaps: dict[int, int] = {}
    for i, key in enumerate(cache.block_keys):
        node = node.children.get(key) if node is not None else None
        if node is None:
            break
        page = node.pages[g]
        if page is not None:
            snaps[(i + 1) * tpb] = page.index
    points = [p for p in transfer_points(engine, len(prompt)) if p in snaps]
    kv = request_kv_from_cache(
        cache, request_id, len(prompt), state_pages={g: [live.index, *(snaps[p] for p in points)]}
    )
    handoff = Handoff(
        request_id,
        prompt,
        req.output_tokens[0],
        engine.last_draft.get(request_id, 0),
        points,
        req.max_new_tokens,
        engine.cache.latent_scale,
    )
    return kv, handoff, cache


def prepare_receive(engine: Engine, handoff: Handoff) -> tuple[RequestKV, HybridKVCache]:
    """Generation side: a cache for the prompt and the pages the transfer fills (snapshots into staging rows)."""
    if handoff.latent_scale != engine.cache.latent_scale:
        raise ValueError(
            f"handoff.latent_scale: the sender's latent pages are at scale {handoff.latent_scale}, this engine "
            f"reads its latent cache at {engine.cache.latent_scale} (EngineConfig.latent_cache_dtype/latent_scale)"
        )
    n_snap = len(handoff.snapshot_points)
    free = _staging_free(engine)
    if n_snap > len(free):
        raise ValueError(
            f"handoff.snapshot_points: {n_snap} snapshots exceed the {len(free)} free staging state rows of the "
            f"engine ({engine.config.staging_state_pages} in all, the rest held by transfers in flight)"
        )
    cache = engine.manager.create_cache(handoff.prompt, reuse=False, capacity=len(handoff.prompt))
    engine.cache.execute(engine.manager.take_pending_copies())
    g = engine.state_group
    live = cache.live_page(g)
    assert live is not None
    staging = [free.pop() for _ in range(n_snap)]
    engine.__dict__.setdefault("_staging_held", {})[handoff.request_id] = staging
    kv = request_kv_from_cache(cache, handoff.request_id, len(handoff.prompt), state_pages={g: [live.index, *staging]})
    return kv, cache  # type: ignore[return-value]


def _staging_free(engine: Engine) -> list[int]:
    """The engine's free staging state rows (rows past the manager's pages), one set per transfer in flight."""
    free = engine.__dict__.get("_staging_free")
    if free is None:
        lo = engine.config.state_pages
        free = engine.__dict__["_staging_free"] = list(range(lo + engine.config.staging_state_pages - 1, lo - 1, -1))
    return free


def finish_receive(engine: Engine, handoff: Handoff, cache: HybridKVCache, max_new_tokens: int) -> Request:
    """Generation side, after the transfer completed: commit the prompt (snapshots from the staging rows) and
    admit the request into the generation phase."""
    mgr, g = engine.manager, engine.state_group
    prompt = handoff.prompt
    staging = engine.__dict__.get("_staging_held", {}).pop(handoff.request_id)
    for k, p in enumerate(handoff.snapshot_points):
        cache.resize(history=p)
        cache.commit(prompt[cache.num_committed_tokens : p])
        copies = []
        for c in mgr.take_pending_copies():
            if c.group == g and c.src_index == cache.live_page(g).index:  # type: ignore[union-attr]
                # The state at p arrived in staging row k, not in the live page (which holds the end state).
                c = PageCopy(c.group, c.src_tier, staging[k], c.dst_tier, c.dst_index)
            copies.append(c)
        engine.cache.execute(copies)
    _staging_free(engine).extend(staging)
    cache.resize(history=len(prompt))
    cache.commit(prompt[cache.num_committed_tokens :])
    engine.cache.execute(mgr.take_pending_copies())
    sched = engine.scheduler
    req = Request(handoff.request_id, tokens=prompt, max_new_tokens=max_new_tokens, draft_len=engine.draft_len)
    sched.add_request(req)
    # No public scheduler call admits a request whose prefill ran elsewhere: move it by hand (see the docstring).
    sched._waiting.remove(req)
    req.cache = cache
    cache.user_data = req
    req.state = RequestState.GENERATION
    req.num_computed_tokens = req.context_len = len(prompt)
    req.output_tokens.append(handoff.first_token)
    req.num_generated = 1
    insort(sched._running, req, key=lambda r: r.seq)
    slot = engine._slot_of(req.request_id)
    dev = engine.stores.device
    w = 1 + engine.draft_len
    nxt = torch.zeros(1, w, dtype=torch.int32)
    nxt[0, 0] = handoff.first_token
    if engine.draft_len:
        nxt[0, 1] = handoff.draft_token
    slot_scatter(
        engine.stores,
        torch.tensor([slot], dtype=torch.int32, device=dev),
        nxt.to(dev),
        nxt.to(dev),
        torch.ones(1, dtype=torch.int32, device=dev),
        torch.tensor([[handoff.draft_token]], dtype=torch.int32, device=dev),
    )
    return req
