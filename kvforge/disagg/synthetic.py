"""Synthetic instances for tests and benchmarks: pools, pages, a deterministic logical KV cache, verification.

The logical cache gives every (owner, layer, block) a fixed pseudo-random byte pattern over the *whole* model
(all KV heads, every block of the prompt), derived from a seed alone. A context rank writes its share of it
into its pages; a generation rank checks its pages against it. The expectation therefore depends only on the
seed and on which heads, layers and blocks a rank holds, never on the transfer plan under test.

Page allocation is a small free-list allocator per layer group (pages handed out in shuffled order so that
scatter and gather see non-contiguous pages); leaked pages show up as a free count below the total.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvforge.disagg.layers import KVLayer, RequestKV
from kvforge.disagg.mapping import helix_blocks, rank_coords
from kvforge.disagg.rank_info import RankInfo
from kvforge.disagg.transport import Transport
from kvforge.kvcache.config import DTYPE_BYTES

_POISON = 0xAB
_OWNER_CODE = {"target": 1, "draft": 2}


@dataclass(frozen=True)
class ModelSpec:
    """A tiny model's KV shape. MLA: one latent head of ``head_dim`` elements, replicated across TP."""

    num_layers: int = 3
    num_draft_layers: int = 1
    is_mla: bool = True
    kv_heads: int = 1
    draft_kv_heads: int = 1
    head_dim: int = 12
    kv_dtype: str = "bfloat16"
    draft_kv_dtype: str = "float8_e4m3fn"
    tokens_per_block: int = 4
    num_groups: int = 2  # target layer groups (layer i in group i % num_groups); drafts get their own group

    def heads(self, owner: str) -> int:
        return self.kv_heads if owner == "target" else self.draft_kv_heads

    def dtype(self, owner: str) -> torch.dtype:
        return getattr(torch, self.kv_dtype if owner == "target" else self.draft_kv_dtype)

    def group(self, owner: str, layer_id: int) -> int:
        return layer_id % self.num_groups if owner == "target" else self.num_groups

    @property
    def total_groups(self) -> int:
        return self.num_groups + (1 if self.num_draft_layers else 0)


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    ranks: tuple[int, ...]  # transport ranks, by instance rank
    tp: int = 1
    pp: int = 1
    cp: int = 1
    layers_per_pp: tuple[int, ...] | None = None
    draft: bool = True
    num_pages: int = 48
    dp: int = 1  # attention-DP groups over the TP ranks (1: no attention DP)

    def __post_init__(self) -> None:
        if len(self.ranks) != self.tp * self.pp * self.cp:
            raise ValueError(f"ranks: expected tp*pp*cp = {self.tp * self.pp * self.cp} ranks, got {self.ranks}")
        if self.dp < 1 or self.tp % self.dp:
            raise ValueError(f"dp: expected a divisor of tp = {self.tp}, got {self.dp}")

    @property
    def attention_tp(self) -> int:
        return self.tp // self.dp

    def dp_rank(self, instance_rank: int) -> int:
        """The attention-DP group of an instance rank."""
        return self.coords(instance_rank)[0] // self.attention_tp

    def attention_tp_rank(self, instance_rank: int) -> int:
        """The rank's place among its DP group's TP ranks (its head slice)."""
        return self.coords(instance_rank)[0] % self.attention_tp

    def coords(self, instance_rank: int) -> tuple[int, int, int]:
        return rank_coords(instance_rank, self.tp, self.pp, self.cp)

    def split(self, num_layers: int) -> tuple[int, ...]:
        if self.layers_per_pp is not None:
            return self.layers_per_pp
        base, extra = divmod(num_layers, self.pp)
        return tuple(base + (1 if p < extra else 0) for p in range(self.pp))


def make_rank_info(model: ModelSpec, inst: InstanceSpec, instance_rank: int) -> RankInfo:
    tp, pp, cp = inst.coords(instance_rank)
    draft = inst.draft and model.num_draft_layers > 0
    layers = _local_keys(model, inst, pp)
    return RankInfo(
        instance_name=inst.name,
        instance_rank=instance_rank,
        transport_rank=inst.ranks[instance_rank],
        tp_size=inst.tp,
        tp_rank=tp,
        pp_size=inst.pp,
        pp_rank=pp,
        dp_size=inst.dp,
        dp_rank=inst.dp_rank(instance_rank),
        cp_size=inst.cp,
        cp_rank=cp,
        attention_dp=inst.dp > 1,
        layers_per_pp=inst.split(model.num_layers),
        is_mla=model.is_mla,
        kv_heads=1 if model.is_mla else model.kv_heads,
        head_dim=model.head_dim,
        kv_dtype=model.kv_dtype,
        element_bytes=DTYPE_BYTES[model.kv_dtype],
        tokens_per_block=model.tokens_per_block,
        page_groups=tuple(model.group(o, i) for o, i in layers),
        num_draft_layers=model.num_draft_layers if draft else None,
        draft_kv_dtype=model.draft_kv_dtype if draft else None,
        draft_kv_heads=(1 if model.is_mla else model.draft_kv_heads) if draft else None,
    )


def _local_keys(model: ModelSpec, inst: InstanceSpec, pp: int) -> list[tuple[str, int]]:
    split = inst.split(model.num_layers)
    start = sum(split[:pp])
    keys = [("target", i) for i in range(start, start + split[pp])]
    if inst.draft and pp == inst.pp - 1:
        keys += [("draft", i) for i in range(model.num_draft_layers)]
    return keys


def make_layers(model: ModelSpec, inst: InstanceSpec, instance_rank: int, device: torch.device) -> list[KVLayer]:
    """This rank's pools, filled with the poison byte 0xAB (so unwritten pages are visible)."""
    _, pp, _ = inst.coords(instance_rank)
    out = []
    for owner, layer_id in _local_keys(model, inst, pp):
        heads = 1 if model.is_mla else model.heads(owner) // inst.attention_tp
        elems = heads * model.head_dim
        dtype = model.dtype(owner)
        esize = torch.empty(0, dtype=dtype).element_size()
        shape = (inst.num_pages, model.tokens_per_block, elems * esize)
        pool = torch.full(shape, _POISON, dtype=torch.uint8, device=device).view(dtype)
        out.append(KVLayer(owner, layer_id, model.group(owner, layer_id), dtype, elems, pool, heads))
    return out


class PageAllocator:
    """Free lists per layer group; pages come out shuffled."""

    def __init__(self, num_groups: int, num_pages: int, seed: int = 0) -> None:
        self.num_pages = num_pages
        self.free: list[list[int]] = []
        rng = random.Random(seed)
        for _ in range(num_groups):
            pages = list(range(num_pages))
            rng.shuffle(pages)
            self.free.append(pages)

    def alloc(self, request_id: int, num_tokens: int, counts: Sequence[int]) -> RequestKV:
        if any(len(f) < n for f, n in zip(self.free, counts)):
            raise RuntimeError(f"out of pages: need {list(counts)}, free {[len(f) for f in self.free]}")
        pages = tuple(tuple(self.free[g].pop() for _ in range(n)) for g, n in enumerate(counts))
        return RequestKV(request_id, num_tokens, pages)

    def release(self, request: RequestKV) -> None:
        for g, pages in enumerate(request.page_indices):
            if set(pages) & set(self.free[g]):
                raise RuntimeError(f"group {g}: pages {sorted(set(pages) & set(self.free[g]))} released twice")
            self.free[g].extend(pages)

    @property
    def leaked(self) -> int:
        return sum(self.num_pages - len(f) for f in self.free)


def logical_block(model: ModelSpec, seed: int, owner: str, layer_id: int, block: int) -> torch.Tensor:
    """The bytes of one block of one layer over all heads: uint8 ``[tokens_per_block, heads, head_dim * esize]``."""
    heads = 1 if model.is_mla else model.heads(owner)
    esize = torch.empty(0, dtype=model.dtype(owner)).element_size()
    g = torch.Generator().manual_seed(hash((seed, _OWNER_CODE[owner], layer_id, block)) & 0x7FFF_FFFF_FFFF)
    return torch.randint(
        0, 256, (model.tokens_per_block, heads, model.head_dim * esize), generator=g, dtype=torch.uint8
    )


def _rank_heads(model: ModelSpec, layer: KVLayer, tp_rank: int) -> slice:
    """The heads a rank holds; ``tp_rank`` is its attention-TP rank (inside its DP group)."""
    if model.is_mla:
        return slice(0, 1)
    return slice(tp_rank * layer.heads, (tp_rank + 1) * layer.heads)


def fill_context(model: ModelSpec, layers: Sequence[KVLayer], request: RequestKV, seed: int, tp_rank: int) -> None:
    """Write the logical cache of every block of ``request`` into this context rank's pages (``tp_rank``: the
    rank's attention-TP rank, ``InstanceSpec.attention_tp_rank``; its TP rank without attention DP)."""
    nb = request.num_blocks(model.tokens_per_block)
    for ly in layers:
        raw = ly.pool.view(torch.uint8)
        hs = _rank_heads(model, ly, tp_rank)
        for b in range(nb):
            data = logical_block(model, seed, ly.owner, ly.layer_id, b)[:, hs].reshape(model.tokens_per_block, -1)
            raw[request.page_indices[ly.group][b]] = data.to(raw.device)


@dataclass
class CheckReport:
    """What a generation rank verified: blocks compared per owner, and every problem found."""

    blocks_checked: dict[str, int] = field(default_factory=lambda: {"target": 0, "draft": 0})
    problems: list[str] = field(default_factory=list)


def check_generation(
    model: ModelSpec,
    inst: InstanceSpec,
    instance_rank: int,
    layers: Sequence[KVLayer],
    request: RequestKV,
    seed: int,
    *,
    expect_draft: bool,
    report: CheckReport,
) -> None:
    """Compare this generation rank's pages of ``request`` with the logical cache, byte for byte.

    Before comparing, the layers and pages that must exist are asserted to exist (a review finding: a verifier
    that skips missing blocks lets a transfer that dropped the draft layers pass): for a non-empty prompt, every
    layer of this rank's stage, the draft layers on the last stage when both sides have a drafter, and one page
    per block of this rank's helix share in every group.
    """
    _, pp, cp = inst.coords(instance_rank)
    tp = inst.attention_tp_rank(instance_rank)
    nb = request.num_blocks(model.tokens_per_block)
    blocks = list(helix_blocks(nb, cp, inst.cp))
    keys = {ly.key for ly in layers}
    expected = set(_local_keys(model, inst, pp))
    if not expect_draft:
        expected = {k for k in expected if k[0] == "target"}
    if request.num_tokens > 0:
        missing = sorted(expected - keys)
        if missing:
            report.problems.append(f"request {request.request_id}: rank {instance_rank} lacks layers {missing}")
        if expect_draft and pp == inst.pp - 1 and not any(k[0] == "draft" for k in keys):
            report.problems.append(f"request {request.request_id}: no draft layer on the last stage")
    for ly in layers:
        if ly.key not in expected:
            continue
        pages = request.page_indices[ly.group] if ly.group < len(request.page_indices) else ()
        if len(pages) != len(blocks):
            report.problems.append(
                f"request {request.request_id}: {ly.owner} layer {ly.layer_id} has {len(pages)} pages for "
                f"{len(blocks)} blocks"
            )
            continue
        raw = ly.pool.view(torch.uint8)
        hs = _rank_heads(model, ly, tp)
        for k, b in enumerate(blocks):
            want = logical_block(model, seed, ly.owner, ly.layer_id, b)[:, hs].reshape(model.tokens_per_block, -1)
            got = raw[pages[k]].cpu()
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                report.problems.append(
                    f"request {request.request_id}: {ly.owner} layer {ly.layer_id} block {b} (page {pages[k]}): "
                    f"{bad} of {want.numel()} bytes differ"
                )
            report.blocks_checked[ly.owner] += 1


def shard_counts(model: ModelSpec, inst: InstanceSpec, instance_rank: int, num_tokens: int) -> list[int]:
    """Pages per group this rank needs for a prompt (its helix share of the blocks)."""
    _, _, cp = inst.coords(instance_rank)
    nb = -(-num_tokens // model.tokens_per_block)
    n = len(helix_blocks(nb, cp, inst.cp))
    return [n] * model.total_groups


@dataclass
class PairResult:
    """One rank's view of a transfer run between two instances."""

    role: str
    completed: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    leaked_pages: int = 0
    orphans: int = 0
    check: CheckReport = field(default_factory=CheckReport)
    seconds: float = 0.0


def dp_pair(i: int, ctx: InstanceSpec, gen: InstanceSpec) -> tuple[int, int]:
    """The (context, generation) DP groups of a pair run's request ``i``: every pair of groups comes up within
    ``ctx.dp * gen.dp`` requests."""
    return i % ctx.dp, (i // ctx.dp) % gen.dp


def run_pair(
    transport: Transport,
    model: ModelSpec,
    ctx: InstanceSpec,
    gen: InstanceSpec,
    prompts: Sequence[int],
    seed: int,
    *,
    first_transfer_id: int,
    device: torch.device,
    timeout_s: float = 20.0,
    corrupt: str | None = None,
) -> PairResult | None:
    """Transfer one request per prompt length from ``ctx`` to ``gen`` and verify; call on every world rank.

    Every rank of the world must call it (the generation group is created collectively); ranks outside both
    instances return None. ``corrupt="draft"`` (or ``"target"``) flips one bit per block of that owner's layers
    on the context side after filling: a negative control that the verification catches a broken layer.

    Attention DP: request i is held by context DP group ``dp_pair(i, ctx, gen)[0]`` and generation DP group
    ``dp_pair(i, ctx, gen)[1]``; a rank only sends, requests and verifies the requests of its own DP group.
    """
    from kvforge.disagg.transceiver import KVReceiver, KVSender

    group = transport.new_group(gen.ranks)
    me = transport.rank
    if me in ctx.ranks:
        ir = ctx.ranks.index(me)
        tp = ctx.attention_tp_rank(ir)
        layers = make_layers(model, ctx, ir, device)
        alloc = PageAllocator(model.total_groups, ctx.num_pages, seed + me)
        sender = KVSender(transport, make_rank_info(model, ctx, ir), layers, release=alloc.release, timeout_s=timeout_s)
        sender.connect(gen.name, gen.ranks)
        res = PairResult("context")
        t0 = time.perf_counter()
        for i, n in enumerate(prompts):
            c_dp, g_dp = dp_pair(i, ctx, gen)
            if c_dp != ctx.dp_rank(ir):
                continue
            nb = -(-n // model.tokens_per_block)
            req = alloc.alloc(i, n, [nb] * model.total_groups)
            fill_context(model, layers, req, seed, tp)
            if corrupt is not None:
                for ly in layers:
                    if ly.owner == corrupt:
                        raw = ly.pool.view(torch.uint8)
                        for page in req.page_indices[ly.group]:
                            raw[page, 0, 0] ^= 1
            sender.send(first_transfer_id + i, req, gen.name, peer_dp_rank=g_dp)
        st = sender.wait()
        res.seconds = time.perf_counter() - t0
        res.completed, res.failed = st.completed, st.failed
        res.leaked_pages, res.orphans = alloc.leaked, len(sender.orphans)
        return res
    if me in gen.ranks:
        ir = gen.ranks.index(me)
        layers = make_layers(model, gen, ir, device)
        alloc = PageAllocator(model.total_groups, gen.num_pages, seed + me)
        info = make_rank_info(model, gen, ir)
        receiver = KVReceiver(
            transport,
            info,
            layers,
            group=group if gen.tp * gen.pp * gen.cp > 1 else None,
            release=alloc.release,
            timeout_s=timeout_s,
        )
        receiver.connect(ctx.name, ctx.ranks)
        res = PairResult("generation")
        reqs = {}
        t0 = time.perf_counter()
        for i, n in enumerate(prompts):
            c_dp, g_dp = dp_pair(i, ctx, gen)
            if g_dp != gen.dp_rank(ir):
                continue
            req = alloc.alloc(i, n, shard_counts(model, gen, ir, n))
            reqs[first_transfer_id + i] = req
            receiver.request(first_transfer_id + i, req, ctx.name, peer_dp_rank=c_dp)
        st = receiver.check_status(blocking=True)
        res.seconds = time.perf_counter() - t0
        res.completed, res.failed = st.completed, st.failed
        expect_draft = ctx.draft and gen.draft and model.num_draft_layers > 0
        for tid in st.completed:
            check_generation(model, gen, ir, layers, reqs[tid], seed, expect_draft=expect_draft, report=res.check)
            alloc.release(reqs[tid])
        res.leaked_pages, res.orphans = alloc.leaked, len(receiver.orphans)
        return res
    return None
