"""The engine's numeric building blocks that are not plain projections: decode attention and the KDA recurrence.

* :func:`decode_attention` is the one switch point for absorbed-MLA paged decode: ``q [B, H, latent]`` against
  the latent cache ``kv_cache [num_pages, page_size, latent]`` addressed by ``block_table [B, max_pages]`` int32
  and ``seq_lens [B]`` int32, returning ``[B, H, v_head_dim]`` with values the first ``v_head_dim`` latent
  columns (or an e4m3 cache with a 16-bit q and ``kv_scale_quant_orig``). It runs the Triton kernel
  ``kvforge.kernels.mla_decode.mla_decode_attention`` (whose plain-torch reference is
  ``mla_decode_attention_ref``).
* :func:`kda_segments` runs the KDA (Kimi delta attention) recurrence over varlen segments with initial states
  and returns every segment's final state: on CUDA fla-core's ``fused_recurrent_kda`` (varlen) when every
  segment is short, its ``chunk_kda`` otherwise; its ``naive_recurrent_kda`` reference on CPU.
  :func:`kda_tokens` does the same one token at a time and returns the state after every token (speculative
  verification keeps the state after the last accepted token). Before fla-core's first GPU call, its committed
  launch configs for the GPU are selected (:mod:`kvforge.engine.fla_configs`).
* :func:`kda_recurrent_inplace` is the decode / verify path: ``N`` rows of ``T`` tokens read their initial
  state from ``pool[state_indices[n, 0]]`` and write the state after token ``t`` into
  ``pool[state_indices[n, t]]``, in place (fla-core's ``fused_recurrent_kda`` with ``ssm_state_indices`` and
  ``inplace_final_state``): no gather of the states before, no scatter after. A plain-torch loop with the same
  contract runs on CPU (``use_kernel=False``; the kernel also runs under the Triton interpreter).
* :func:`host_to_device` is how the engine's step uploads host values: without the stream sync of a blocking copy.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["decode_attention", "host_to_device", "kda_recurrent_inplace", "kda_segments", "kda_tokens"]


def host_to_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values on ``device`` without the stream sync torch adds after a blocking copy. A host-to-device copy
    from pageable memory is staged by the driver before the call returns, so the host may drop or change its copy
    at once; ``non_blocking`` only keeps the host from waiting for the device's queue (which a prefill step would
    otherwise drain dozens of times, leaving the GPU idle while the host launches the next kernels)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    v_head_dim: int,
    kv_scale_quant_orig: float | None = None,
) -> torch.Tensor:
    """The engine's decode attention (see the module docstring): the Triton kernel. The engine built the block
    table and lengths itself, so the kernel's value check (a device-to-host read) is skipped. An e4m3 cache
    (``kv_scale_quant_orig`` dequantises it) needs a 16-bit q: the output then has q's dtype."""
    from kvforge.kernels.mla_decode import mla_decode_attention

    out = mla_decode_attention(
        q.contiguous(),
        kv_cache,
        block_table.contiguous(),
        seq_lens.contiguous(),
        softmax_scale=softmax_scale,
        v_head_dim=v_head_dim,
        check_values=False,
        kv_scale_quant_orig=kv_scale_quant_orig,
    )
    assert isinstance(out, torch.Tensor)  # return_lse=False: the output alone
    return out


def _use_fla_kernels(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


_FLA_CONFIGS_SET = False


def _fla_configs_once() -> None:
    """Before fla-core's first GPU call: its committed configs for this GPU, if any (no tuning pause)."""
    global _FLA_CONFIGS_SET
    if not _FLA_CONFIGS_SET:
        _FLA_CONFIGS_SET = True
        from kvforge.engine.fla_configs import use_committed_fla_configs

        use_committed_fla_configs()


# Segments up to this many tokens take fla-core's recurrent kernel (one launch; each program walks its segment
# token by token) instead of the chunked one, whose host side (a dozen autotuned launches and their index
# preparation) cost ~2.7 ms per call on the H200 at any length: most of a short eager prefill step.
RECURRENT_PREFILL_MAX_TOKENS = 512

# The last segment boundaries' host and device tensors: a step's KDA layers all pass the same boundaries, so they
# are uploaded once per step (without waiting for the device) and fla-core's own per-tensor caches, which compare
# tensors by identity, build its chunk indices once per step too.
_LAST_CU: tuple[tuple[int, ...], torch.device, torch.Tensor, torch.Tensor] | None = None


def _cu_tensors(cu_seqlens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    global _LAST_CU
    key = tuple(cu_seqlens)
    last = _LAST_CU
    if last is not None and last[0] == key and last[1] == device:
        return last[2], last[3]
    cu_cpu = torch.tensor(key, dtype=torch.long)
    cu = host_to_device(cu_cpu, device)
    _LAST_CU = (key, device, cu_cpu, cu)
    return cu_cpu, cu


def kda_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: list[int],
    *,
    use_kernel: bool | None = None,
    recurrent_max: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over segments ``cu_seqlens`` of the flat ``[T, H, ...]`` inputs, segment i starting from
    ``initial_states[i]`` (fp32 ``[N, H, K, V]``). Returns (``o [T, H, V]`` in v's dtype, final states fp32).
    ``use_kernel`` None: fla-core's kernels on CUDA (the recurrent one when no segment is longer than
    ``recurrent_max`` tokens, default :data:`RECURRENT_PREFILL_MAX_TOKENS` as it is at the call, else the chunked
    one), the torch loop on CPU."""
    n = len(cu_seqlens) - 1
    if initial_states.shape[0] != n:
        raise ValueError(f"initial_states: expected {n} states (one per segment), got {initial_states.shape[0]}")
    if recurrent_max is not None:
        if isinstance(recurrent_max, bool) or not isinstance(recurrent_max, int):
            raise TypeError(f"recurrent_max: expected an int or None, got {type(recurrent_max).__name__}")
        if recurrent_max < 0:
            raise ValueError(f"recurrent_max: expected an int >= 0 (0: chunk_kda only), got {recurrent_max}")
    if use_kernel is None:
        use_kernel = _use_fla_kernels(q)
    if use_kernel:
        if q.device.type == "cuda":
            _fla_configs_once()
        # The host copy goes to fla too: its chunk indices are then built without reading the device's back.
        cu_cpu, cu = _cu_tensors(cu_seqlens, q.device)
        limit = RECURRENT_PREFILL_MAX_TOKENS if recurrent_max is None else recurrent_max
        if max(b - a for a, b in itertools.pairwise(cu_seqlens)) <= limit:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # type: ignore[import-untyped]

            # Every token belongs to a segment, so the kernel writes all of ``out``: no zero fill before it.
            o, final = fused_recurrent_kda_fwd(
                q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].float().contiguous(),
                beta[None].float().contiguous(), initial_state=initial_states.float().contiguous(),
                output_final_state=True, inplace_final_state=False, cu_seqlens=cu,
                out=torch.empty((1, *v.shape), dtype=v.dtype, device=v.device),
            )  # fmt: skip
            return o[0], final
        from fla.ops.kda import chunk_kda  # type: ignore[import-untyped]

        o, final = chunk_kda(
            q[None],
            k[None],
            v[None],
            g[None].float(),
            beta[None].float(),
            initial_state=initial_states.float(),
            output_final_state=True,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        return o[0], final.float()
    from fla.ops.kda.naive import naive_recurrent_kda  # type: ignore[import-untyped]

    outs, finals = [], []
    for i in range(n):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        o, s = naive_recurrent_kda(
            q[None, a:b],
            k[None, a:b],
            v[None, a:b],
            g[None, a:b],
            beta[None, a:b],
            initial_state=initial_states[i : i + 1].float(),
            output_final_state=True,
        )
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs, 0), torch.stack(finals, 0)


def kda_tokens(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``N`` rows of ``T`` tokens (inputs ``[N, T, H, ...]``) from ``states [N, H, K, V]``: returns
    (``o [N, T, H, V]``, ``states_after [T, N, H, K, V]``, the state after each token)."""
    t_len = q.shape[1]
    outs, after = [], []
    s = states.float()
    for t in range(t_len):
        sl = slice(t, t + 1)
        if _use_fla_kernels(q):
            _fla_configs_once()
            from fla.ops.kda import fused_recurrent_kda  # type: ignore[import-untyped]

            o, s = fused_recurrent_kda(
                q[:, sl], k[:, sl], v[:, sl], g[:, sl].float(), beta[:, sl].float(),
                initial_state=s, output_final_state=True,
            )  # fmt: skip
        else:
            from fla.ops.kda.naive import naive_recurrent_kda  # type: ignore[import-untyped]

            o, s = naive_recurrent_kda(
                q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s, output_final_state=True
            )
        s = s.float().clone()  # a kernel may write its final state in place: keep each token's state apart
        outs.append(o)
        after.append(s)
    return torch.cat(outs, 1), torch.stack(after, 0)


def kda_recurrent_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """``N`` rows of ``T`` tokens (inputs ``[N, T, H, ...]``; ``g`` and ``beta`` fp32) against the state rows of
    ``pool [rows, H, K, V]`` fp32 named by ``state_indices [N, T]`` int32 (see the module docstring); returns
    ``o [N, T, H, V]`` in v's dtype. ``use_kernel`` None: fla-core's kernel on CUDA, the torch loop on CPU."""
    n, t = q.shape[:2]
    if state_indices.shape != (n, t) or state_indices.dtype != torch.int32:
        raise ValueError(
            f"state_indices: expected int32 [{n}, {t}], got {state_indices.dtype} {list(state_indices.shape)}"
        )
    if pool.dtype != torch.float32 or pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(
            f"pool: expected a contiguous fp32 [rows, H, K, V] tensor, got {pool.dtype} {list(pool.shape)}"
        )
    if use_kernel is None:
        use_kernel = _use_fla_kernels(q)
    if use_kernel:
        if q.device.type == "cuda":
            _fla_configs_once()
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # type: ignore[import-untyped]

        # Every row has T tokens, so the kernel writes all of ``out``: no zero fill before it.
        o, _ = fused_recurrent_kda_fwd(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            initial_state=pool, inplace_final_state=True, ssm_state_indices=state_indices.contiguous(),
            out=torch.empty(v.shape, dtype=v.dtype, device=v.device),
        )  # fmt: skip
        return o
    from fla.ops.kda.naive import naive_recurrent_kda  # type: ignore[import-untyped]

    idx = state_indices.long()
    s = pool[idx[:, 0]]
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s,
                                   output_final_state=True)  # fmt: skip
        s = s.float()
        pool[idx[:, i]] = s
        outs.append(o.to(v.dtype))
    return torch.cat(outs, 1)
