"""One forward step of the hybrid model over the engine's paged cache: prefill / extend / decode / verify rows.

A step is a list of :class:`Row` (generation rows first, then context rows, as the scheduler orders them).
Its tokens are laid out flat in that order. Per layer:

* **MLA**: the new tokens' latent rows are written into their pages first (with kernels on and a 16-bit cache
  by ``mla_latent_store`` straight from the projection; else :meth:`EngineCache.write_latent`:
  quantised to e4m3 when ``EngineConfig.latent_cache_dtype="fp8_e4m3"``, then dequantised by every reader,
  :meth:`EngineCache.read_latent` and the decode kernel's ``kv_scale_quant_orig``). Context rows then gather their
  whole prefix ``[0, start + n)`` from the pages (through the block table from ``DevicePageTable``),
  up-project it to K/V, quantise Q, K and V to FP8 at one per-tensor scale (``quantize_fp8``; V into the
  dim-major layout, ``EngineConfig.context_v_layout``; or pass them in
  16 bits with ``EngineConfig.context_fp8=False``) and run ``mla_context_attention`` over all context rows at
  once. Generation rows (one token, or 1 + draft tokens when verifying) run absorbed-MLA decode
  (:func:`kvforge.engine.ops.decode_attention`), one query row per token with ``seq_len = start + t + 1``.
* **KDA**: each row starts from its live state page (indices uploaded by ``StateIndexUpload``). A context row
  that passes a snapshot point mid-step is split there: the state at the point is written into the cache's
  pending snapshot page, then the rest runs from it. Generation rows update their states in place
  (:func:`~kvforge.engine.ops.kda_recurrent_inplace`): token 0's state into the live row, token t's into the
  batch row's scratch row; once the accepted count is known, ``select_accepted_states`` moves the accepted
  one into the live row on the device (:meth:`Runner.step`). The rows of one step may verify different counts.

:meth:`Runner.decode_static` is the generation-only step on device tensors alone (no host data, no host read)
that :mod:`kvforge.engine.graphs` captures per batch bucket. With ``HybridModel.use_kernels`` (on CUDA) the
blocks use the fused projections and kernels (``rms_norm`` with the residual add, ``swiglu``, ``rotary``,
``kda_prepare``, ``mla_latent_store``, ``greedy_accept``) and the step's bookkeeping is ``decode_inputs`` /
``decode_finish``; elsewhere the plain forms. ``bench/probe_decode_kernels.py`` counts the step's launches.

The drafter (one MLA layer) runs after acceptance over the accepted positions of every row, writing its own
latent pages, and proposes the next draft token from the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvforge.engine.cache import EngineCache
from kvforge.engine.model import HybridModel, MLAWeights
from kvforge.engine.ops import decode_attention, host_to_device, kda_recurrent_inplace, kda_segments
from kvforge.kernels.decode_step import (
    DecodeInputs,
    decode_finish,
    decode_finish_ref,
    decode_inputs,
    decode_inputs_ref,
)
from kvforge.kernels.greedy_accept import greedy_accept
from kvforge.kernels.mla_context import MLAContextPlan, quantize_v_dim_major
from kvforge.kernels.quantize_fp8 import quantize_fp8
from kvforge.kernels.slot_ops import SlotStores
from kvforge.kernels.state_select import select_accepted_states

__all__ = ["Row", "Runner", "StepResult"]


@dataclass
class Row:
    """One request's part of a step. ``tokens``: its input ids; ``gen``: a generation row; ``snapshot_point`` and
    ``pending_page``: the mid-step snapshot (both or neither)."""

    tokens: list[int]
    start: int
    gen: bool
    is_last: bool
    state_page: int
    snapshot_point: int | None = None
    pending_page: int | None = None
    next_token: int | None = None  # context row that is not the last chunk: the prompt token after it

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class StepResult:
    """Per row: emitted tokens (empty for a non-final context chunk), the logits rows that chose them (when
    recorded), and the new draft token (None without a drafter)."""

    emitted: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)
    drafts: list[int | None] = field(default_factory=list)
    draft_logits: list[torch.Tensor | None] = field(default_factory=list)


class _Layout:
    """Token layout of one pass (target or drafter) over the rows, for one page pool.

    Index tensors are built on the host in one go and moved with one copy; page lookups are one device gather
    from the pass's block table ``table [rows, max_blocks]`` (per-row device ops cost a launch each)."""

    def __init__(self, rows: list[Row], counts: list[int], table: torch.Tensor, tpb: int, device: torch.device):
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        n = torch.tensor(counts, dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), n)
        first = torch.cumsum(n, 0) - n
        pos = starts[row_of] + torch.arange(int(n.sum())) - first[row_of]
        gen = torch.tensor([r.gen for r in rows], dtype=torch.bool)
        self.num_gen_tokens = int(n[gen].sum())
        ctx_rows = [i for i, r in enumerate(rows) if not r.gen]
        kv_len = (starts + n)[ctx_rows] if ctx_rows else torch.zeros(0, dtype=torch.long)
        kv_row = torch.repeat_interleave(torch.tensor(ctx_rows, dtype=torch.long), kv_len)
        kv_first = torch.cumsum(kv_len, 0) - kv_len
        kv_pos = torch.arange(int(kv_len.sum())) - torch.repeat_interleave(kv_first, kv_len)
        host = torch.cat([row_of, pos, kv_row, kv_pos])
        dev = host_to_device(host, device)
        t, k = len(pos), len(kv_pos)
        row_d, pos_d = dev[:t], dev[t : 2 * t]
        self.positions = pos_d
        self.write_rows = table[row_d, pos_d // tpb].long() * tpb + pos_d % tpb
        if k:
            kr, kp = dev[2 * t : 2 * t + k], dev[2 * t + k :]
            self.ctx_kv_rows: torch.Tensor | None = table[kr, kp // tpb].long() * tpb + kp % tpb
        else:
            self.ctx_kv_rows = None
        g = self.num_gen_tokens
        self.gen_table = table[row_d[:g]] if g else None
        self.gen_lens = (pos_d[:g] + 1).to(torch.int32) if g else None
        cu_q = [0]
        cu_kv = [0]
        for i in ctx_rows:
            cu_q.append(cu_q[-1] + counts[i])
            cu_kv.append(cu_kv[-1] + rows[i].start + counts[i])
        self.cu_q = torch.tensor(cu_q, dtype=torch.int32)
        self.cu_kv = torch.tensor(cu_kv, dtype=torch.int32)
        # Built at a step's first layer that needs them, reused by the others: the context attention's plan per
        # dtypes and head shapes, the KDA context rows' segments.
        self.context_plans: dict[tuple, MLAContextPlan] = {}
        self.kda_segments: _KdaSegments | None = None


class _KdaSegments:
    """The context rows' KDA segments of one step (the same at every layer): segment A of each row runs to its
    snapshot point (or its end), segment B from the point, for the rows that have one (``split``: their
    positions among the context rows). Token indices are flat over the step, uploaded once."""

    def __init__(self, rows: list[Row], ctx: list[int], off: int, device: torch.device) -> None:
        a_tok, b_tok, cu_a, cu_b, split = [], [], [0], [0], []
        for j, i in enumerate(ctx):
            r = rows[i]
            cut = r.n if r.snapshot_point is None else r.snapshot_point - r.start
            a_tok.append(torch.arange(off, off + cut))
            cu_a.append(cu_a[-1] + cut)
            if cut < r.n:
                b_tok.append(torch.arange(off + cut, off + r.n))
                cu_b.append(cu_b[-1] + r.n - cut)
                split.append(j)
            off += r.n
        self.cu_a, self.cu_b = cu_a, cu_b
        self.ta = host_to_device(torch.cat(a_tok), device)
        self.split = host_to_device(split, device) if split else None
        if split:
            self.pending = host_to_device([rows[ctx[j]].pending_page for j in split], device)
            self.tb = host_to_device(torch.cat(b_tok), device)


class _DecodeLayout:
    """The layout of a generation-only step from its :class:`DecodeInputs` (built on the device from per-row starts,
    no host data: the CUDA-graph path): token ``j`` of row ``i`` at flat index ``i * t + j``."""

    ctx_kv_rows = None

    def __init__(self, inp: DecodeInputs):
        self.positions = inp.positions
        self.num_gen_tokens = int(inp.positions.shape[0])
        self.write_rows = inp.write_rows
        self.gen_table = inp.table_rows
        self.gen_lens = inp.lens


class Runner:
    """Runs steps of ``model`` over ``cache`` (see the module docstring)."""

    def __init__(
        self,
        model: HybridModel,
        cache: EngineCache,
        *,
        record_logits: bool = False,
        context_fp8: bool = True,
        context_v_layout: str = "dim_major",
        max_rows: int = 1,
        verify_width: int = 1,
    ) -> None:
        self.model = model
        self.cache = cache
        self.record_logits = record_logits
        self.context_fp8 = context_fp8
        self.context_v_layout = context_v_layout
        # Diagnostics (kvforge.engine.numerics): called after every layer as probe(layer, layout, h, mixer, x).
        self.probe: Callable[[int, _Layout, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        mc = model.config
        self.kv_scale_orig_quant = float(mc.kv_scale_orig_quant)
        # The context kernel takes bf16/fp16 queries; the interpreter's fp16 keeps more of the fp32 model's bits.
        self.q_dtype = torch.bfloat16 if model.device.type == "cuda" else torch.float16
        # Verifying rows' scratch state rows: row i's state after token t >= 1 goes to scratch[i, t - 1].
        w = max(1, verify_width - 1)
        self.verify_width = verify_width
        self._scratch = (cache.scratch_base + torch.arange(max_rows * w, dtype=torch.int32).view(max_rows, w)).to(
            model.device
        )
        self._verify: tuple[int, int] | None = None  # (rows, tokens) of this step's verification
        self._row_base: dict[tuple[int, int], torch.Tensor] = {}  # (b, t) -> arange(b) * t on the device

    def _verify_indices(self, state_idx: torch.Tensor, rows: int, t: int) -> torch.Tensor:
        """``[rows, t]`` int32: the live row, then the row's scratch rows (see :meth:`_kda`)."""
        live = state_idx[:rows].to(torch.int32)[:, None]
        return torch.cat([live, self._scratch[:rows, : t - 1]], 1) if t > 1 else live.contiguous()

    def select_states(self, state_idx: torch.Tensor, accepted: torch.Tensor, rows: int, t: int) -> None:
        """After verification: each row's live state becomes the state after its last accepted token
        (``accepted [rows]`` int32 on the device, 1 .. t); rows that accepted only token 0 copy nothing."""
        live = state_idx[:rows].to(torch.int32).contiguous()
        scratch = self._scratch[:rows, : t - 1].contiguous()
        for pool in self.cache.state.values():
            select_accepted_states(pool, live, scratch, accepted, check_values=False)

    # --- attention -----------------------------------------------------------------------------------------------

    def _mla(self, m: MLAWeights, h: torch.Tensor, pool: torch.Tensor, lay: _Layout) -> torch.Tensor:
        model, mc = self.model, self.model.config
        cache = self.cache
        # A generation-only step rotates the queries' rope part straight into the absorbed queries.
        ctx = lay.ctx_kv_rows is not None
        fused = model.rope_kernels  # mla_project's fused form runs (the same condition)
        store = (pool, lay.write_rows) if fused and not cache.latent_fp8 else None  # an e4m3 cache quantises
        q, latent = model.mla_project(m, h, lay.positions, fused=True, rope_q=ctx or not fused, store=store)
        if latent is not None:
            cache.write_latent(pool, lay.write_rows, latent)
        out = torch.empty(h.shape[0], mc.num_heads, mc.v_head_dim, device=h.device, dtype=model.dtype)
        g = lay.num_gen_tokens
        if g:
            assert lay.gen_table is not None and lay.gen_lens is not None
            q_abs = model.mla_absorb(m, q[:g], None if ctx or not fused else lay.positions[:g])
            if cache.latent_fp8:  # the kernel reads an e4m3 cache with a 16-bit q (fp16 on the interpreter)
                q_abs = q_abs.to(self.q_dtype)
            o_lat = decode_attention(
                q_abs,
                pool,
                lay.gen_table,
                lay.gen_lens,
                softmax_scale=model.softmax_scale,
                v_head_dim=mc.kv_lora_rank,
                kv_scale_quant_orig=cache.latent_scale_inv,
            )
            model.mla_unabsorb(m, o_lat, out=out[:g])
        if lay.ctx_kv_rows is not None:
            k, v = model.mla_up(m, cache.read_latent(pool, lay.ctx_kv_rows, model.dtype))
            q_ctx = q[g:]
            layout = "token_major"
            if self.context_fp8:
                # Q too, at the K/V scale. V dim-major by default (transposed in the quantising pass), else
                # token-major; every FP8 and 16-bit layout key has committed H200 launch configs, so a first
                # prefill does not stop to tune the context kernel.
                s = self.kv_scale_orig_quant
                q_in, k_in = (quantize_fp8(x, s) for x in (q_ctx, k))
                layout = self.context_v_layout
                v_in = quantize_v_dim_major(v, s) if layout == "dim_major" else quantize_fp8(v, s)
                scale = 1.0 / s
            else:
                q_in, k_in, v_in = (x.to(self.q_dtype).contiguous() for x in (q_ctx, k, v))
                scale = 1.0
            d_v = v_in.shape[1] if layout == "dim_major" else v_in.shape[2]
            # One plan per step, dtypes, layout and head shapes (every layer has the same lengths): one upload.
            key = (q_in.dtype, k_in.dtype, layout, *q_in.shape[1:], k_in.shape[1], d_v)
            plan = lay.context_plans.get(key)
            if plan is None:
                plan = MLAContextPlan.plan(
                    lay.cu_q, lay.cu_kv, num_heads=q_in.shape[1], num_kv_heads=k_in.shape[1],
                    head_dim_qk=q_in.shape[2], head_dim_v=d_v, q_dtype=q_in.dtype, kv_dtype=k_in.dtype,
                    v_layout=layout, device=q_in.device,
                )  # fmt: skip
                lay.context_plans[key] = plan
            o = plan.run(q_in, k_in, v_in, kv_scale_quant_orig=scale, softmax_scale=model.softmax_scale)
            assert isinstance(o, torch.Tensor)
            out[g:] = o.to(model.dtype)
        return model.mla_out(m, out)

    # --- recurrence ----------------------------------------------------------------------------------------------

    def _kda(
        self, layer_id: int, m, h: torch.Tensor, rows: list[Row], state_idx: torch.Tensor, lay: _Layout
    ) -> torch.Tensor:
        model = self.model
        pool = self.cache.state[layer_id]
        q, k, v, g, beta = model.kda_project(m, h, fused=True)
        out = torch.empty_like(v)
        off = 0
        gen = [i for i, r in enumerate(rows) if r.gen]
        if gen:
            counts = [rows[i].n for i in gen]
            n, ng, nr = max(counts), sum(counts), len(gen)
            # In place: token 0's state goes to the live row, token t's to the row's scratch row t - 1;
            # Runner.step moves the accepted one into the live row once the accepted counts are known.
            sidx = self._verify_indices(state_idx, nr, n)
            if min(counts) == n:  # every row verifies the same count (the usual step): views, no gathers
                qs, ks, vs, gs, bs = (x[:ng].reshape(nr, n, *x.shape[1:]) for x in (q, k, v, g, beta))
                o = kda_recurrent_inplace(qs, ks, vs, gs, bs, pool, sidx)
                out[:ng] = o.reshape(ng, *o.shape[2:]).to(out.dtype)
            else:
                # A request one token from its limit gets no draft, so rows may verify different counts: shorter
                # rows repeat their last token up to the longest; the states after the repeats land in scratch
                # rows that are never selected (acceptance picks the state after an accepted token) and their
                # outputs are dropped. Integer indices throughout: a boolean mask would make the host wait.
                first = [0]
                for cnt in counts[:-1]:
                    first.append(first[-1] + cnt)
                pad = [[f + min(t, cnt - 1) for t in range(n)] for f, cnt in zip(first, counts)]
                keep = [r * n + t for r, cnt in enumerate(counts) for t in range(cnt)]
                pad_t = host_to_device(pad, h.device)
                keep_t = host_to_device(keep, h.device)
                o = kda_recurrent_inplace(q[pad_t], k[pad_t], v[pad_t], g[pad_t], beta[pad_t], pool, sidx)
                out[:ng] = o.reshape(-1, *o.shape[2:])[keep_t].to(out.dtype)  # the real tokens, in flat order
            if n > 1:
                self._verify = (nr, n)
            off = ng
        ctx = [i for i, r in enumerate(rows) if not r.gen]
        if ctx:
            idx = state_idx[ctx[0] : ctx[-1] + 1].long()
            seg = lay.kda_segments
            if seg is None:
                seg = lay.kda_segments = _KdaSegments(rows, ctx, off, h.device)
            ta = seg.ta
            o_a, fin = kda_segments(q[ta], k[ta], v[ta], g[ta], beta[ta], pool[idx], seg.cu_a)
            out[ta] = o_a.to(out.dtype)
            if seg.split is not None:
                pool[seg.pending] = fin[seg.split]
                tb = seg.tb
                o_b, fin_b = kda_segments(q[tb], k[tb], v[tb], g[tb], beta[tb], fin[seg.split], seg.cu_b)
                out[tb] = o_b.to(out.dtype)
                fin[seg.split] = fin_b
            pool[idx] = fin
        return model.kda_out(m, out)

    # --- a step --------------------------------------------------------------------------------------------------

    def forward(self, rows: list[Row], state_idx: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The target model over the rows' tokens; returns the final hidden states ``[T, D]`` (pre-norm).
        ``tables [pools, rows, max_blocks]``: page index per block (pool 0: target latent, 1: drafter latent)."""
        model = self.model
        dev = model.device
        ids = host_to_device([t for r in rows for t in r.tokens], dev)
        lay = _Layout(rows, [r.n for r in rows], tables[0], self.cache.tokens_per_block, dev)
        self._verify = None

        def mixer(i: int, blk, h: torch.Tensor) -> torch.Tensor:
            if isinstance(blk.mixer, MLAWeights):
                return self._mla(blk.mixer, h, self.cache.latent[i], lay)
            return self._kda(i, blk.mixer, h, rows, state_idx, lay)

        return self._blocks(model.embed[ids], model.blocks, mixer, lay)

    def _blocks(self, x: torch.Tensor, blocks: list, mixer, lay) -> torch.Tensor:
        """Pre-norm blocks ``x += mixer(rms(x)); x += mlp(rms(x))``, each residual add fused with the norm that
        follows it (one kernel on CUDA, :meth:`HybridModel.add_norm`); returns the last residual stream."""
        model = self.model
        h = model.norm(x, blocks[0].norm1)
        for j, blk in enumerate(blocks):
            h_in = h
            mix = mixer(j, blk, h)
            x, h2 = model.add_norm(x, mix, blk.norm2)
            mlp = model.mlp_normed(blk, h2)
            if j + 1 < len(blocks):
                x, h = model.add_norm(x, mlp, blocks[j + 1].norm1)
            else:
                x = x + mlp
            if self.probe is not None:
                layer = j if blocks is model.blocks else model.config.num_layers
                self.probe(layer, lay, h_in, mix, x)
        return x

    def step(
        self, rows: list[Row], state_idx: torch.Tensor, tables: torch.Tensor, *, draft: bool
    ) -> tuple[StepResult, list[int]]:
        """Forward, greedy choice with draft verification, state selection and the drafter; returns the result
        and the accepted token count per row (0 for a context row that emits nothing)."""
        model = self.model
        hidden = self.forward(rows, state_idx, tables)
        res = StepResult()
        # Logits: every token of a generation row, the last token of a final context chunk.
        want: list[int] = []
        off = 0
        for r in rows:
            if r.gen:
                want.extend(range(off, off + r.n))
            elif r.is_last:
                want.append(off + r.n - 1)
            off += r.n
        logits = model.logits(hidden[host_to_device(want, hidden.device)], fused=True) if want else None
        best = logits.argmax(-1).tolist() if logits is not None else []
        accepted, j, off = [], 0, 0
        for r in rows:
            if r.gen:
                a = 1
                while a < r.n and r.tokens[a] == best[j + a - 1]:
                    a += 1
                res.emitted.append(best[j : j + a])
                res.logits.append(logits[j : j + a].cpu() if self.record_logits else None)  # type: ignore[index]
                j += r.n
            elif r.is_last:
                a = 1
                res.emitted.append([best[j]])
                res.logits.append(logits[j : j + 1].cpu() if self.record_logits else None)  # type: ignore[index]
                j += 1
            else:
                a = 0
                res.emitted.append([])
                res.logits.append(None)
            accepted.append(a)
        if self._verify is not None:
            nr, t = self._verify
            acc = host_to_device([accepted[i] for i in range(nr)], model.device, torch.int32)
            self.select_states(state_idx, acc, nr, t)
            self._verify = None
        if draft and model.draft_block is not None:
            self._draft(rows, hidden, accepted, res, tables[1])
        else:
            res.drafts = [None] * len(rows)
            res.draft_logits = [None] * len(rows)
        return res, accepted

    def _draft(
        self, rows: list[Row], hidden: torch.Tensor, accepted: list[int], res: StepResult, table: torch.Tensor
    ) -> None:
        """The drafter over each row's accepted positions (a context row: all of its tokens)."""
        model = self.model
        blk = model.draft_block
        assert blk is not None and isinstance(blk.mixer, MLAWeights) and self.cache.draft_latent is not None
        sel: list[int] = []
        nxt: list[int] = []
        counts: list[int] = []
        off = 0
        for r, a, em in zip(rows, accepted, res.emitted):
            if r.gen:
                cnt = a
                nexts = em[:a]
            else:
                cnt = r.n
                tail = em[0] if r.is_last else r.next_token
                assert tail is not None
                nexts = [*r.tokens[1:], tail]
            sel.extend(range(off, off + cnt))
            nxt.extend(nexts)
            counts.append(cnt)
            off += r.n
        dev = model.device
        x = model.draft_input(hidden[host_to_device(sel, dev)], host_to_device(nxt, dev), fused=True)
        lay = _Layout(rows, counts, table, self.cache.tokens_per_block, dev)
        draft_latent = self.cache.draft_latent
        x = self._blocks(x, [blk], lambda j, b, h: self._mla(b.mixer, h, draft_latent, lay), lay)
        last, off = [], 0
        for c in counts:
            off += c
            last.append(off - 1)
        dl = model.draft_logits(x[host_to_device(last, dev)], fused=True)
        best = dl.argmax(-1).tolist()
        for i, r in enumerate(rows):
            emits = r.gen or r.is_last
            res.drafts.append(best[i] if emits else None)
            res.draft_logits.append(dl[i].cpu() if (self.record_logits and emits) else None)

    # --- the generation-only step on device tensors (captured into CUDA graphs) --------------------------------------

    def decode_static(
        self,
        slots: torch.Tensor,
        state_idx: torch.Tensor,
        starts: torch.Tensor,
        tables: torch.Tensor,
        stores: SlotStores,
        out: torch.Tensor,
        *,
        draft: bool,
        limits: torch.Tensor | None = None,
    ) -> None:
        """A generation-only step of ``b`` rows of ``t = verify_width`` tokens with no host data and no host
        read, so it can be captured: ``slots [b]`` int32 (the rows' slot-store slots; padding rows name a trash
        slot), ``state_idx [b]`` int32 live state rows, ``starts [b]`` int64 positions of each row's first
        token, ``tables [pools, b, max_blocks]`` page ids, ``limits [b]`` int32 the most tokens each row may
        accept (a row's last step may have fewer left than ``t``; its other positions are computed in reserved
        room and dropped; None: ``t``). Writes ``out [b, t + 2]`` int32: the greedy token at
        each position, the accepted count, the drafter's next token (0 without a drafter), and stores the same
        into the slot stores as :class:`~kvforge.engine.engine.Engine` does after an eager step. The drafter
        runs over every position of a row (a rejected position's draft latent row is rewritten by the next
        step before anything reads it) and proposes from the last accepted one."""
        model = self.model
        b, t, tpb = slots.shape[0], self.verify_width, self.cache.tokens_per_block
        dev = model.device
        # Inputs and results as one kernel each on the kernel path (a dozen small torch ops each otherwise).
        inputs = decode_inputs if model.use_kernels else decode_inputs_ref
        finish = decode_finish if model.use_kernels else decode_finish_ref
        inp = inputs(slots, starts, tables[0], stores.next_new_tokens, t, tpb)
        ids = inp.ids
        lay = _DecodeLayout(inp)
        sidx = self._verify_indices(state_idx, b, t)

        def mixer(i: int, blk, h: torch.Tensor) -> torch.Tensor:
            if isinstance(blk.mixer, MLAWeights):
                return self._mla(blk.mixer, h, self.cache.latent[i], lay)
            qkv = model.kda_project(blk.mixer, h, fused=True)
            o = kda_recurrent_inplace(
                *(y.view(b, t, *y.shape[1:]) for y in qkv), self.cache.state[i], sidx, use_kernel=model.use_kernels
            )
            return model.kda_out(blk.mixer, o.view(b * t, *o.shape[2:]))

        x = self._blocks(model.embed[ids], model.blocks, mixer, lay)
        logits = model.logits(x, fused=True, fp32=False).view(b, t, -1)
        lim = limits if t > 1 else None
        if model.use_kernels:  # argmax, acceptance and its cap in one kernel
            best, acc = greedy_accept(logits, ids.view(b, t), limits=lim)
        else:
            best = logits.argmax(-1).to(torch.int32)
            match = (ids.view(b, t)[:, 1:] == best[:, :-1]).to(torch.int32).cumprod(1)
            acc = (1 + match.sum(1)).to(torch.int32)
            if lim is not None:
                acc = torch.minimum(acc, lim)
        if t > 1:
            live = state_idx.to(torch.int32).contiguous()
            scratch = self._scratch[:b, : t - 1].contiguous()
            for pool in self.cache.state.values():
                select_accepted_states(pool, live, scratch, acc, check_values=False)
        drafts = None
        if draft and model.draft_block is not None:
            blk = model.draft_block
            assert isinstance(blk.mixer, MLAWeights) and self.cache.draft_latent is not None
            xd = model.draft_input(x, best.reshape(-1), fused=True)
            dlay = _DecodeLayout(inputs(slots, starts, tables[1], stores.next_new_tokens, t, tpb))
            dlat = self.cache.draft_latent
            xd = self._blocks(xd, [blk], lambda j, bk, h: self._mla(bk.mixer, h, dlat, dlay), dlay)
            if (b, t) not in self._row_base:
                self._row_base[(b, t)] = torch.arange(b, device=dev) * t
            pick = self._row_base[(b, t)] + (acc - 1)
            drafts = model.draft_logits(xd[pick], fused=True, fp32=False).argmax(-1)
        # Padding rows all name the trash slot: duplicates there are harmless (slot_scatter would refuse them).
        finish(best, acc, drafts, slots, stores, out)
