"""The serving loop: ``Scheduler`` + ``HybridCacheManager`` decide, :class:`EngineCache` + :class:`Runner` compute.

One :meth:`Engine.step`:

1. ``scheduler.schedule()`` picks the rows (generation first, then context chunks cut at snapshot points);
2. the manager's recorded page copies run (:meth:`EngineCache.execute`), and a fresh attempt's live state is
   zeroed (a cache that reused nothing gets no copy for it);
3. the device page table (``DevicePageTable.materialize`` -> ``copy_block_offsets``) gives each row's block
   table; the live-state indices go up through ``StateIndexUpload`` (``copy_small_pinned_pair`` on a GPU);
4. generation rows read their input tokens from the slot stores (``step_gather``): the last emitted token and
   the draft token(s) to verify;
5. :meth:`Runner.step` runs the model, accepts drafts greedily and runs the drafter;
6. emitted tokens and next inputs go into the slot stores (``slot_scatter``), and ``scheduler.on_step_done``
   commits them (new snapshot copies are recorded for the next step).

Prefix reuse off gives every request its own reuse scope. ``draft_len`` (0 or 1) is the engine's speculative
length. ``EngineConfig(profile_phases=True)`` or ``sync=True`` gives the step a phase timer
(:mod:`kvforge.engine.phases`; :attr:`Engine.timings` holds its host seconds per phase, ``sync=True`` waits for
the device at each phase end so the split between host and device is measurable); without either the step reads
no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

import torch

from kvforge.engine.cache import EngineCache
from kvforge.engine.config import EngineConfig
from kvforge.engine.graphs import DecodeGraphs
from kvforge.engine.launch import plan_launch
from kvforge.engine.model import HybridModel
from kvforge.engine.ops import host_to_device
from kvforge.engine.phases import PhaseTimer
from kvforge.engine.runner import Row, Runner, StepResult
from kvforge.kernels.slot_ops import SlotStores, slot_scatter, step_gather
from kvforge.kvcache.config import (
    FULL_ATTENTION,
    RECURRENT_STATE,
    KVCacheConfig,
    LayerOwner,
    LayerSpec,
    Tier,
    TierConfig,
    dtype_name,
)
from kvforge.kvcache.hooks import runtime_hooks_of
from kvforge.kvcache.hybrid import HybridCacheManager
from kvforge.kvcache.page_table import DevicePageTable
from kvforge.scheduling import Request, RequestState, Scheduler, SchedulerConfig

__all__ = ["Engine", "kv_cache_config", "latent_dtype"]


def latent_dtype(model: HybridModel, config: EngineConfig) -> torch.dtype:
    """The MLA latent caches' dtype: float8_e4m3fn with ``latent_cache_dtype="fp8_e4m3"``, else the model's."""
    return torch.float8_e4m3fn if config.fp8_latent else model.dtype


def kv_cache_config(model: HybridModel, config: EngineConfig, *, draft: bool = True) -> KVCacheConfig:
    """The manager's layer list: MLA layers (latent bytes per token, in :func:`latent_dtype`), KDA layers (state
    bytes), and the drafter's layer when the model has one and ``draft`` (the shared draft KV pool) is on."""
    mc = model.config
    ldt = latent_dtype(model, config)
    dt = dtype_name(ldt)
    esize = torch.empty(0, dtype=ldt).element_size()
    state_bytes = 4 * mc.linear_heads * mc.linear_head_dim * mc.linear_head_dim
    layers = []
    for i, t in enumerate(mc.layer_types):
        if t == "M":
            layers.append(LayerSpec(i, FULL_ATTENTION, bytes_per_token=mc.latent_dim * esize, dtype=dt))
        else:
            layers.append(LayerSpec(i, RECURRENT_STATE, state_bytes=state_bytes, dtype="float32"))
    if mc.draft_layers and draft:
        layers.append(
            LayerSpec(
                mc.num_layers, FULL_ATTENTION, bytes_per_token=mc.latent_dim * esize, dtype=dt, owner=LayerOwner.DRAFT
            )
        )
    probe = KVCacheConfig(tokens_per_block=config.tokens_per_block, layers=tuple(layers))
    pages = []
    for g in probe.groups:
        if g.owner is LayerOwner.DRAFT:
            pages.append(config.draft_pages)
        elif g.life_cycle.is_attention:
            pages.append(config.attention_pages)
        else:
            pages.append(config.state_pages)
    return KVCacheConfig(
        tokens_per_block=config.tokens_per_block,
        layers=tuple(layers),
        tiers=(TierConfig(Tier.GPU, pages=tuple(pages)),),
    )


class Engine:
    """A serving engine over ``model`` (see the module docstring)."""

    def __init__(
        self,
        model: HybridModel,
        config: EngineConfig | None = None,
        *,
        draft_len: int = 0,
        record_logits: bool = False,
        sync: bool = False,
        draft_fn: Callable[[Request, list[int]], int] | None = None,
    ) -> None:
        if not isinstance(model, HybridModel):
            raise TypeError(f"model: expected a HybridModel, got {type(model).__name__}")
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
        if isinstance(draft_len, bool) or draft_len not in (0, 1):
            raise ValueError(f"draft_len: expected 0 or 1 (one drafter layer proposes one token), got {draft_len!r}")
        if draft_len and not model.config.draft_layers:
            raise ValueError("draft_len: the model has no drafter layer (ModelConfig.draft_layers = 0)")
        if config.fp8_latent and model.config.copy_offset and config.latent_scale is not None:
            from kvforge.engine import planted

            amp, top = planted.copy_key_amplitude(model.config), planted.FP8_HEADROOM * planted.FP8_MAX
            if amp * config.latent_scale > top:
                raise ValueError(
                    f"config.latent_scale: the copy head's rotary key amplitude {amp:.1f} x latent_scale "
                    f"{config.latent_scale} exceeds {top:.0f} (e4m3 range with headroom): its rows would saturate"
                )
        self.model = model
        self.config = config
        self.draft_len = draft_len
        # The fused rotary kernel reads a cos/sin table it cannot bounds-check on the device: size it for the
        # longest request this engine admits.
        model.ensure_rope_table((config.max_blocks_per_request + 1) * config.tokens_per_block)
        # Tests replace the drafter's proposal (e.g. by the reference's next token) to exercise acceptance.
        self.draft_fn = draft_fn
        self.sync = sync and model.device.type == "cuda"
        hooks = runtime_hooks_of(model)
        dev = model.device
        self.launch = plan_launch(
            HybridCacheManager,
            hooks,
            device=dev,
            draft_len=draft_len,
            has_drafter=model.config.draft_layers > 0,
            tokens_per_block=config.tokens_per_block,
        )
        self.kv_config = kv_cache_config(model, config, draft=self.launch.shared_draft_kv)
        manager_cls = self.launch.manager_cls
        self.manager: HybridCacheManager = manager_cls(
            self.kv_config,
            policy=hooks.hybrid_cache,
            snapshot_interval=config.snapshot_interval,
            prompt_end_offsets=config.prompt_end_offsets,
            midchunk_snapshot_alignment=config.midchunk_snapshot_alignment,
        )
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_tokens=config.max_num_tokens,
                max_num_requests=config.max_num_requests,
                prefix_wait=config.prefix_wait,
                # A request's last step may have fewer tokens left than a verify step's width; room for the
                # full width keeps that step on the fixed-width (graph) path.
                reserve_verify_width=draft_len > 0,
            ),
            hooks=hooks,
        )
        mc = model.config
        self.attn_group = self.kv_config.group_of_layer(mc.mla_layers[0])
        self.state_group = self.kv_config.group_of_layer(mc.linear_layers[0])
        self.draft_group = self.kv_config.group_of_layer(mc.num_layers) if self.launch.shared_draft_kv else None
        self.cache = EngineCache(
            mc,
            config,
            attn_group=self.attn_group,
            state_group=self.state_group,
            draft_group=self.draft_group,
            device=dev,
            dtype=model.dtype,
            # A context-only worker never verifies drafts: no scratch rows (its context-only layout).
            scratch_rows=0 if self.launch.context_only else config.max_num_requests * draft_len,
        )
        groups = [self.attn_group] + ([self.draft_group] if self.draft_group is not None else [])
        # Suspended caches keep their rows until they close, hence more rows than running requests.
        self.page_table = DevicePageTable(
            self.manager, 4 * config.max_num_requests, config.max_blocks_per_request, groups=groups
        )
        self.upload = self.manager.state_index_upload(config.max_num_requests)
        self._offsets = torch.empty(
            (len(groups), config.max_num_requests, 2, config.max_blocks_per_request), dtype=torch.int32, device=dev
        )
        t = 1 + draft_len
        # One slot past the requests' slots: the trash slot of CUDA-graph padding rows.
        self.stores = SlotStores.zeros(config.max_num_requests + 1, t, t, max(1, draft_len), dev)
        self._free_slots = list(range(config.max_num_requests - 1, -1, -1))
        self._slots_up: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)  # last uploaded slot ids
        self._slot: dict[Hashable, int] = {}
        self.runner = Runner(
            model,
            self.cache,
            record_logits=record_logits,
            context_fp8=config.context_fp8,
            context_v_layout=config.context_v_layout,
            max_rows=config.max_num_requests,
            verify_width=t,
        )
        graphs = config.cuda_graphs if config.cuda_graphs is not None else dev.type == "cuda"
        graphs = graphs and not self.launch.context_only  # no generation steps to capture
        if graphs and dev.type != "cuda":
            raise ValueError(f"config.cuda_graphs: CUDA graphs need a CUDA device, the model is on {dev}")
        # Recorded logits and a host draft_fn need the eager step's host data: no graphs then.
        self.graphs: DecodeGraphs | None = None
        if graphs and not record_logits and draft_fn is None:
            self.graphs = self.decode_graphs(capture=True)
        self.record_logits = record_logits
        self.outputs: dict[Hashable, list[int]] = {}
        self.logits: dict[Hashable, list[torch.Tensor]] = defaultdict(list)
        self.draft_logits: dict[Hashable, list[torch.Tensor]] = defaultdict(list)
        self.finished: dict[Hashable, Request] = {}
        self.last_draft: dict[Hashable, int] = {}
        # The phase timer (kvforge.engine.phases): only with config.profile_phases or sync.
        self.phases: PhaseTimer | None = None
        self.timings: dict[str, float] = {}
        if config.profile_phases or sync:
            self.set_phase_timer(PhaseTimer(self.sync))
        self.steps = 0
        self.tokens = {"context": 0, "generation": 0}

    def set_phase_timer(self, timer: PhaseTimer | None) -> None:
        """Time the step's phases with ``timer`` (None: stop timing; the step then reads no clock).
        :attr:`timings` becomes the timer's totals (an empty dict without one)."""
        if timer is not None and not isinstance(timer, PhaseTimer):
            raise TypeError(f"timer: expected a PhaseTimer or None, got {type(timer).__name__}")
        bp = self.manager.block_pool
        for name in ("flush_events", "publish_stored"):  # the KV event emission, inside on_step_done
            if name in vars(bp):
                delattr(bp, name)
            if timer is not None:
                setattr(bp, name, timer.nested("kv_events", getattr(bp, name)))
        self.phases = timer
        self.timings = timer.totals if timer is not None else {}

    def decode_graphs(self, *, capture: bool) -> DecodeGraphs:
        """The engine's :class:`DecodeGraphs` (``capture=False``: the same padded static step, run eagerly)."""
        return DecodeGraphs(
            self.runner,
            self.cache,
            self.stores,
            self._offsets,
            max_rows=self.config.max_num_requests,
            trash_slot=self.config.max_num_requests,
            draft=self.draft_len > 0,
            capture=capture,
        )

    # --- requests ------------------------------------------------------------------------------------------------

    def add_request(self, request_id: Hashable, tokens: Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request (token mode). With reuse off it gets its own reuse scope.

        Raises ``TypeError`` / ``ValueError`` naming the argument, changing nothing: ``request_id`` None,
        unhashable or already unfinished here; ``tokens`` not a non-empty sequence of ids in ``[0, vocab)``;
        ``max_new_tokens`` not an int >= 1; a request whose prompt + ``max_new_tokens`` can never fit the cache
        (``max_blocks_per_request`` x ``tokens_per_block``, or more blocks than a pool group's pages)."""
        if request_id is None:
            raise ValueError("request_id: expected a hashable id, got None")
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None
        if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
            raise TypeError(f"tokens: expected a sequence of token ids, got {type(tokens).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens: expected an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens}")
        vocab = self.model.config.vocab_size
        toks = list(tokens)
        if not toks:
            raise ValueError("tokens: expected at least one token id, got an empty sequence")
        bad = [t for t in toks if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"tokens: expected ids in [0, {vocab}), got {bad[:4]}")
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
        tpb = self.config.tokens_per_block
        total = len(toks) + max_new_tokens
        if total > self.config.max_blocks_per_request * tpb:
            raise ValueError(
                f"tokens: {len(toks)} + max_new_tokens {max_new_tokens} exceed max_blocks_per_request x "
                f"tokens_per_block ({self.config.max_blocks_per_request * tpb})"
            )
        # A request holds one page per block of its whole sequence in each attention group (the drafter's too),
        # so one needing more than a group has could never be scheduled: refuse it here, not in every schedule().
        blocks = -(-total // tpb)
        for group in (self.attn_group, self.draft_group):
            if group is None:
                continue
            capacity = self.manager.pool(group).capacity
            if blocks > capacity:
                raise ValueError(
                    f"tokens: {len(toks)} + max_new_tokens {max_new_tokens} need {blocks} blocks of {tpb} tokens, "
                    f"more than the {capacity} pages of pool group {group}: the request can never fit the cache"
                )
        scope = None if self.config.reuse else ("no-reuse", request_id)
        req = Request(request_id, tokens=toks, max_new_tokens=max_new_tokens, draft_len=self.draft_len, scope=scope)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: Hashable) -> Request:
        """Finish an unfinished request now, between steps: its cache closes (pages go back to the manager;
        committed blocks stay reusable) and its slot is freed. Its tokens so far stay in :attr:`outputs`.
        Raises ``ValueError`` naming ``request_id`` when no unfinished request has that id."""
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None
        if self.scheduler.get(request_id) is None:
            raise ValueError(f"request_id: no unfinished request {request_id!r}")
        req = self.scheduler.abort(request_id)
        self.outputs[request_id] = list(req.output_tokens)
        self.last_draft.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return req

    @property
    def num_free_slots(self) -> int:
        """Slot-store rows not held by an unfinished request."""
        return len(self._free_slots)

    def _slot_of(self, rid: Hashable) -> int:
        s = self._slot.get(rid)
        if s is None:
            s = self._slot[rid] = self._free_slots.pop()
        return s

    # --- the loop ------------------------------------------------------------------------------------------------

    def step(self) -> tuple[Request, ...]:
        """Run one scheduler step; returns the requests that finished in it."""
        prof = self.phases  # None unless profiling: then no clock is read (kvforge.engine.phases)
        if prof is not None:
            prof.start()
        batch = self.scheduler.schedule()
        if prof is not None:
            prof.mark("schedule")
        copies = self.manager.take_pending_copies()
        if copies:
            self.cache.execute(copies)
        gen, ctx = batch.generation, batch.context
        if ctx:
            fresh = [s.request.cache.live_page(self.state_group).index for s in ctx if s.start == 0]  # type: ignore[union-attr]
            if fresh:
                self.cache.zero_states(host_to_device(fresh, self.model.device))
        if prof is not None:
            prof.mark("cache_copies")
        sched = (*gen, *ctx)
        caches = [s.request.cache for s in sched]
        n_rows = len(caches)
        offsets = self.page_table.materialize(caches, out=self._offsets[:, :n_rows])
        if prof is not None:
            prof.mark("page_table")
        idx, mask = self.manager.step_state_indices(caches)
        width = 1 + self.draft_len
        n_gen = len(gen)
        # Every generation row fits the graph's width: one with fewer tokens left (its last step) has room
        # reserved for the rest (reserve_verify_width) and its acceptance is capped on the device.
        if self.graphs is not None and n_gen == n_rows and n_gen:
            if prof is not None:
                prof.mark("state_index")
            res, accepted = self._graph_step(gen, idx, prof)
            graph_step = True
        else:
            graph_step = False
            self.upload.upload(idx, mask)
            state_idx = self.upload.dev_indices[: len(caches)]
            if prof is not None:
                prof.mark("state_index")
            rows = self._eager_rows(batch, sched, idx, width)
            if prof is not None:
                prof.mark("inputs")
            res, accepted = self.runner.step(rows, state_idx, offsets[:, :, 0], draft=self.draft_len > 0)
            if prof is not None:
                prof.mark("forward")
        if self.draft_fn is not None:
            for i, s in enumerate(sched):
                if res.emitted[i]:
                    res.drafts[i] = self.draft_fn(s.request, res.emitted[i])
            if prof is not None:
                prof.mark("accept")
        self._store(sched, res, accepted, on_device=graph_step)
        if prof is not None:
            prof.mark("store")
        accepted_by_id = {s.request.request_id: accepted[i] for i, s in enumerate(gen)}
        new_tokens = {s.request.request_id: res.emitted[i] for i, s in enumerate(sched)}
        finished = self.scheduler.on_step_done(batch, accepted_tokens=accepted_by_id, new_tokens=new_tokens)
        if prof is not None:
            prof.mark("commit")
        for req in finished:
            self.outputs[req.request_id] = list(req.output_tokens)
            self.finished[req.request_id] = req
            slot = self._slot.pop(req.request_id, None)
            if slot is not None:
                self._free_slots.append(slot)
        self.steps += 1
        self.tokens["context"] += batch.num_context_tokens
        self.tokens["generation"] += sum(accepted_by_id.values())
        if prof is not None:
            prof.mark("finish")
        return finished

    def _eager_rows(self, batch, sched, idx: list[int], width: int) -> list[Row]:
        """The eager step's rows: generation rows read their input ids from the slot stores (one host read),
        context rows take theirs from the request's known tokens."""
        gen_ids = None
        n_gen = len(batch.generation)
        if n_gen:
            slots = tuple(self._slot_of(s.request.request_id) for s in batch.generation)
            if slots != self._slots_up[0]:  # the same rows as last step: their slot ids are on the device
                dev_slots = host_to_device(slots, self.stores.device, torch.int32)
                self._slots_up = (slots, dev_slots)
            gen_ids = step_gather(self.stores, self._slots_up[1], width).input_ids.tolist()
        rows = []
        for i, s in enumerate(sched):
            req = s.request
            cache = req.cache
            if i < n_gen:
                assert gen_ids is not None
                toks = gen_ids[i * width : i * width + s.num_tokens]
                nxt = None
            else:
                seq = (*req.tokens, *req.output_tokens)  # type: ignore[misc]
                toks = list(seq[s.start : s.start + s.num_tokens])
                nxt = None if s.is_last_chunk else seq[s.start + s.num_tokens]
            pending = getattr(cache, "pending_ssm_snapshot_slot", None) if s.snapshot_point is not None else None
            rows.append(
                Row(
                    tokens=toks,
                    start=s.start,
                    gen=i < n_gen,
                    is_last=s.is_last_chunk,
                    state_page=idx[i],
                    snapshot_point=s.snapshot_point if pending is not None else None,
                    pending_page=pending,
                    next_token=nxt,
                )
            )
        return rows

    def _graph_step(self, gen, idx: list[int], prof: PhaseTimer | None) -> tuple[StepResult, list[int]]:
        """A generation-only step through :attr:`graphs`: one host read, the slot stores written on the device."""
        assert self.graphs is not None
        slot, free = self._slot, self._free_slots
        slots = []
        starts = []
        limits = []
        for s in gen:
            rid = s.request.request_id
            k = slot.get(rid)
            if k is None:
                k = slot[rid] = free.pop()
            slots.append(k)
            starts.append(s.start)
            limits.append(s.num_tokens)
        g = self.graphs
        out = g.run(slots, idx, starts, limits=limits, phases=prof).tolist()
        w = 1 + self.draft_len
        res = StepResult()
        n = len(out)
        accepted = [r[w] for r in out]
        res.emitted = [r[:a] for r, a in zip(out, accepted)]
        res.logits = [None] * n
        res.drafts = [r[w + 1] for r in out] if self.draft_len else [None] * n
        res.draft_logits = [None] * n
        if prof is not None:
            prof.mark("accept")
        return res, accepted

    def _store(self, sched, res, accepted, *, on_device: bool = False) -> None:
        """Emitted tokens and the next step's inputs into the slot stores (unless a graph step already stored
        them ``on_device``); logits into the record."""
        width = 1 + self.draft_len
        emit_rows = [i for i, em in enumerate(res.emitted) if em]
        if not emit_rows:
            return
        if on_device:
            for i in emit_rows:
                if res.drafts[i] is not None:
                    self.last_draft[sched[i].request.request_id] = res.drafts[i]
            return
        n = len(emit_rows)
        d = max(1, self.draft_len)
        # One host buffer, one copy: [new tokens | next tokens | count | drafts | slot] per row.
        host = torch.zeros(n, 2 * width + 2 + d, dtype=torch.int32)
        for j, i in enumerate(emit_rows):
            em = res.emitted[i]
            rid = sched[i].request.request_id
            host[j, -1] = self._slot_of(rid)
            host[j, : len(em)] = torch.tensor(em, dtype=torch.int32)
            host[j, 2 * width] = len(em)
            host[j, width] = em[-1]
            if res.drafts[i] is not None:
                self.last_draft[rid] = res.drafts[i]
                if self.draft_len:
                    host[j, width + 1] = res.drafts[i]
                    host[j, 2 * width + 1] = res.drafts[i]
            if self.record_logits:
                self.logits[rid].append(res.logits[i])
                if res.draft_logits[i] is not None:
                    self.draft_logits[rid].append(res.draft_logits[i])
        dev = host_to_device(host, self.stores.device)
        slot_scatter(
            self.stores,
            dev[:, -1],
            dev[:, :width],
            dev[:, width : 2 * width],
            dev[:, 2 * width],
            dev[:, 2 * width + 1 : 2 * width + 1 + d],
        )

    def run(self, max_steps: int = 100_000) -> dict[Hashable, list[int]]:
        """Step until every request finished; returns the outputs of all finished requests."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return self.outputs
            self.step()
        raise RuntimeError(f"max_steps: {max_steps} steps did not finish every request")

    def generate(self, prompts: dict[Hashable, Sequence[int]], max_new_tokens: int) -> dict[Hashable, list[int]]:
        for rid, p in prompts.items():
            self.add_request(rid, p, max_new_tokens)
        self.run()
        return {rid: self.outputs[rid] for rid in prompts}

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.scheduler.running if r.state is RequestState.GENERATION)
