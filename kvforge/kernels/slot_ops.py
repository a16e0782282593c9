"""Speculative-decoding bookkeeping: one launch to store a step's outputs per slot, one to build the next inputs.

A *slot* is a request's row in the slot stores (``SlotStores``: ``new_tokens [W_new, S]``,
``next_new_tokens [W_next, S]``, ``new_token_counts [S]``, ``next_draft_tokens [S, W_draft]``).

* ``slot_scatter``: stores row ``row_begin + r`` of the step's outputs into slot ``slot_ids[r]`` of every store,
  zero-padded or truncated to the store's width; slots not named in ``slot_ids`` are untouched.
* ``step_gather``: builds ``input_ids``, ``position_offsets``, ``draft_tokens`` and ``kv_offsets`` of the next
  step for ``N`` rows of ``T = 1 + draft length`` tokens from the stores.

Host (CPU) ``slot_ids`` are checked before the launch (``ValueError``): each in ``[0, S)``, and no duplicates
for a scatter. Device ``slot_ids`` are not checked (no synchronisation): out-of-range rows are skipped by a
scatter and read as zeros by a gather. Both functions accept preallocated outputs and allocate nothing else, so
they are CUDA-graph capturable; call each once before capture (compile, tune). Exact formulas: ``docs/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kvforge.kernels._checks import check_launch_device, check_no_overlap, check_tensor
from kvforge.kernels._runtime import (
    ConfigTable,
    DirectLaunch,
    PlanCache,
    TunedKernel,
    cdiv,
    hooks_active,
    kernel_device,
    next_pow2,
    tensor_key,
)
from kvforge.kernels._selfcheck import CheckRow, timed_check

__all__ = [
    "SlotStores",
    "StepInputs",
    "selfcheck",
    "slot_scatter",
    "slot_scatter_ref",
    "step_gather",
    "step_gather_ref",
]

_INT = (torch.int32, torch.int64)


@cache
def _kernel_device_type() -> str:
    # Fixed for the process (CUDA present or not, interpreter on or not): queried once, not per call.
    return kernel_device().type


def _spec(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What Triton specialises a pointer on: dtype and 16-byte alignment (and the device)."""
    return (*((t.dtype, t.data_ptr() % 16 == 0) for t in tensors), tensors[0].device)


_I32_LIMIT = 2**31 - 1


def _needs_i64(tensors: tuple[torch.Tensor, ...]) -> bool:
    """True when some element of some tensor lies past an int32 element offset from its base.

    Only then do the kernels compute offsets in int64. A masked-off lane's offset may overflow int32 and wrap,
    which is harmless: that lane never touches memory.
    """
    return any(sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) > _I32_LIMIT for t in tensors)


@triton.jit
def _step_rows(slot_ptr, n_rows, S_SLOT: tl.constexpr, N_SLOTS: tl.constexpr, I64: tl.constexpr,
               BLOCK_R: tl.constexpr):  # fmt: skip
    """This program's rows of the step, which of them exist, their slot ids, and which slots are valid. A device
    slot id cannot be range-checked on the host: a row with a bad slot is masked out of every slot access. The
    range check runs on the loaded value, before any narrowing, so a huge int64 id cannot wrap into range."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if I64:
        rows = rows.to(tl.int64)
    in_step = rows < n_rows
    slot = tl.load(slot_ptr + rows * S_SLOT, mask=in_step, other=-1)
    ok = in_step & (slot >= 0) & (slot < N_SLOTS)
    if I64:
        slot = slot.to(tl.int64)
    else:
        slot = slot.to(tl.int32)
    return rows, in_step, slot, ok


# Layouts are compile-time constants: every stride, width and the slot count. A server's stores and step
# buffers keep one layout for its lifetime, so each layout compiles once, and the kernel shrinks to the loads,
# the stores and the masks its widths need (376 sm_90 instructions with runtime strides; timed against an
# empty launch after an L2 flush, the runtime-stride form was 1.67x, the constant-layout one 1.38x).
@triton.jit(do_not_specialize=["n_rows", "row_begin"])
def _slot_scatter_kernel(
    slot_ptr, n_rows, row_begin, new_ptr, next_ptr, count_ptr, draft_ptr, st_new_ptr, st_next_ptr, st_count_ptr,
    st_draft_ptr,
    S_SLOT: tl.constexpr, N_SLOTS: tl.constexpr,
    S_NEW_R: tl.constexpr, S_NEW_W: tl.constexpr, A_NEW: tl.constexpr,
    S_NEXT_R: tl.constexpr, S_NEXT_W: tl.constexpr, A_NEXT: tl.constexpr,
    S_COUNT: tl.constexpr,
    S_DRAFT_R: tl.constexpr, S_DRAFT_W: tl.constexpr, A_DRAFT: tl.constexpr,
    ST_NEW_W: tl.constexpr, ST_NEW_S: tl.constexpr, W_NEW: tl.constexpr,
    ST_NEXT_W: tl.constexpr, ST_NEXT_S: tl.constexpr, W_NEXT: tl.constexpr,
    ST_COUNT_S: tl.constexpr,
    ST_DRAFT_S: tl.constexpr, ST_DRAFT_W: tl.constexpr, W_DRAFT: tl.constexpr,
    I64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """``A_*``: the step outputs' widths; ``W_*``: the stores' widths; ``S_*`` / ``ST_*``: strides."""
    rows, in_step, slot, ok = _step_rows(slot_ptr, n_rows, S_SLOT, N_SLOTS, I64, BLOCK_R)  # a bad slot writes nothing
    src = row_begin + rows
    w = tl.arange(0, BLOCK_W)[None, :]
    inw = in_step[:, None]
    src2 = src[:, None]
    # Every load comes before every store, and source loads are masked by the row alone, never by the slot:
    # the compiler must assume a store may alias a later load, so a load placed after a store waits for it,
    # and with cold caches each such wave is one more memory round trip (four of them once made this kernel
    # 2.8 us slower than an empty launch). The host checked that the step's rows exist.
    count = tl.load(count_ptr + src * S_COUNT, mask=in_step, other=0)
    # Zero padding comes from the masked loads' other=0; truncation from the store masks.
    v_new = tl.load(new_ptr + src2 * S_NEW_R + w * S_NEW_W, mask=inw & (w < A_NEW), other=0)
    v_next = tl.load(next_ptr + src2 * S_NEXT_R + w * S_NEXT_W, mask=inw & (w < A_NEXT), other=0)
    v_draft = tl.load(draft_ptr + src2 * S_DRAFT_R + w * S_DRAFT_W, mask=inw & (w < A_DRAFT), other=0)

    okw = ok[:, None]
    slot2 = slot[:, None]
    tl.store(st_count_ptr + slot * ST_COUNT_S, count.to(st_count_ptr.dtype.element_ty), mask=ok)
    # The count mask is applied after the load so that the load does not wait for the count.
    v_new = tl.where(w < count[:, None], v_new, 0)
    tl.store(
        st_new_ptr + w * ST_NEW_W + slot2 * ST_NEW_S, v_new.to(st_new_ptr.dtype.element_ty), mask=okw & (w < W_NEW)
    )
    tl.store(
        st_next_ptr + w * ST_NEXT_W + slot2 * ST_NEXT_S,
        v_next.to(st_next_ptr.dtype.element_ty),
        mask=okw & (w < W_NEXT),
    )
    tl.store(
        st_draft_ptr + slot2 * ST_DRAFT_S + w * ST_DRAFT_W,
        v_draft.to(st_draft_ptr.dtype.element_ty),
        mask=okw & (w < W_DRAFT),
    )


@triton.jit(do_not_specialize=["n_rows"])
def _step_gather_kernel(
    slot_ptr, n_rows, st_next_ptr, st_count_ptr, st_draft_ptr, ids_ptr, pos_ptr, draft_ptr, kv_ptr,
    S_SLOT: tl.constexpr, N_SLOTS: tl.constexpr, T: tl.constexpr, K: tl.constexpr,
    ST_NEXT_W: tl.constexpr, ST_NEXT_S: tl.constexpr, ST_COUNT_S: tl.constexpr,
    ST_DRAFT_S: tl.constexpr, ST_DRAFT_W: tl.constexpr,
    S_IDS: tl.constexpr, S_POS: tl.constexpr, S_DRAFT_R: tl.constexpr, S_DRAFT_K: tl.constexpr, S_KV: tl.constexpr,
    I64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Layouts, ``T`` and ``K`` are compile-time constants, as in the scatter."""
    rows, in_step, slot, ok = _step_rows(slot_ptr, n_rows, S_SLOT, N_SLOTS, I64, BLOCK_R)  # a bad slot gathers zeros
    t = tl.arange(0, BLOCK_T)[None, :]
    k = tl.arange(0, BLOCK_K)[None, :]
    # All loads (each needs only the slot id) before any store: a load after a store waits for it (the
    # compiler must assume they alias), one more memory round trip per wave with cold caches.
    # Counts keep the store's width: an int64 count is not narrowed (offsets are int64 then, and the launcher
    # refuses outputs narrower than the stores they are read from).
    count = tl.load(st_count_ptr + slot * ST_COUNT_S, mask=ok, other=0)
    ids = tl.load(st_next_ptr + t * ST_NEXT_W + slot[:, None] * ST_NEXT_S, mask=ok[:, None] & (t < T), other=0)
    d = tl.load(st_draft_ptr + slot[:, None] * ST_DRAFT_S + k * ST_DRAFT_W, mask=ok[:, None] & (k < K), other=0)

    offset = tl.where(ok, count - T, 0)
    tl.store(kv_ptr + rows * S_KV, offset.to(kv_ptr.dtype.element_ty), mask=in_step)
    tok = rows[:, None] * T + t
    row_t = in_step[:, None] & (t < T)
    tl.store(ids_ptr + tok * S_IDS, ids.to(ids_ptr.dtype.element_ty), mask=row_t)
    pos = offset[:, None] + tl.zeros([BLOCK_R, BLOCK_T], dtype=tl.int32)
    tl.store(pos_ptr + tok * S_POS, pos.to(pos_ptr.dtype.element_ty), mask=row_t)
    dst = draft_ptr + rows[:, None] * S_DRAFT_R + k * S_DRAFT_K
    tl.store(dst, d.to(draft_ptr.dtype.element_ty), mask=in_step[:, None] & (k < K))


def _row_configs(pairs: list[tuple[int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in pairs]


# Rows per program trade parallelism (a few hundred rows: more, smaller programs) against per-program cost.
_SM90_ROWS = _row_configs([(8, 1), (16, 1), (32, 1), (32, 2), (64, 2), (128, 4)])


_SCATTER_TABLE = ConfigTable(
    fallback=[triton.Config({"BLOCK_R": 32}, num_warps=2)],
    interpreter=triton.Config({"BLOCK_R": 16}, num_warps=1),
    by_arch={(9, 0): _SM90_ROWS},
)
_GATHER_TABLE = ConfigTable(
    fallback=[triton.Config({"BLOCK_R": 32}, num_warps=2)],
    interpreter=triton.Config({"BLOCK_R": 16}, num_warps=1),
    by_arch={(9, 0): _SM90_ROWS},
)
_SCATTER = TunedKernel("slot_scatter", _slot_scatter_kernel, _SCATTER_TABLE)
_GATHER = TunedKernel("step_gather", _step_gather_kernel, _GATHER_TABLE)


@dataclass(frozen=True)
class SlotStores:
    """The four per-slot stores (layouts in the module docstring). Validates shapes, dtypes and device."""

    new_tokens: torch.Tensor
    next_new_tokens: torch.Tensor
    new_token_counts: torch.Tensor
    next_draft_tokens: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("stores.new_tokens", self.new_tokens, dtype=_INT, ndim=2)
        device = self.new_tokens.device
        check_tensor("stores.next_new_tokens", self.next_new_tokens, dtype=_INT, ndim=2, device=device)
        check_tensor("stores.new_token_counts", self.new_token_counts, dtype=_INT, ndim=1, device=device)
        check_tensor("stores.next_draft_tokens", self.next_draft_tokens, dtype=_INT, ndim=2, device=device)
        s = self.num_slots
        for name, n in [
            ("stores.next_new_tokens", self.next_new_tokens.shape[1]),
            ("stores.new_token_counts", self.new_token_counts.shape[0]),
            ("stores.next_draft_tokens", self.next_draft_tokens.shape[0]),
        ]:
            if n != s:
                raise ValueError(f"{name}: expected {s} slots (as stores.new_tokens [W_new, S]), got {n}")
        # The scatter writes every store: a stride-0 store or two stores sharing memory would race.
        names = ("stores.new_tokens", "stores.next_new_tokens", "stores.new_token_counts", "stores.next_draft_tokens")
        check_no_overlap(dict(zip(names, self.tensors())), {})

    @property
    def num_slots(self) -> int:
        return self.new_tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.new_tokens.device

    @classmethod
    def zeros(
        cls,
        num_slots: int,
        new_width: int,
        next_width: int,
        draft_width: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.int32,
    ) -> SlotStores:
        z = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)
        return cls(z(new_width, num_slots), z(next_width, num_slots), z(num_slots), z(num_slots, draft_width))

    def clone(self) -> SlotStores:
        return SlotStores(*(t.clone() for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.new_tokens, self.next_new_tokens, self.new_token_counts, self.next_draft_tokens)


class StepInputs(NamedTuple):
    """The next step's inputs gathered from the stores (shapes for N rows of T tokens, K draft tokens)."""

    input_ids: torch.Tensor  # [N*T]
    position_offsets: torch.Tensor  # [N*T]
    draft_tokens: torch.Tensor  # [N, K]
    kv_offsets: torch.Tensor  # [N]


def _check_stores(stores: object) -> SlotStores:
    if not isinstance(stores, SlotStores):
        raise TypeError(f"stores: expected SlotStores, got {type(stores).__name__}")
    if stores.device.type != _kernel_device_type():
        raise ValueError(f"stores: expected tensors on {kernel_device()} (where kernels run), got {stores.device}")
    for name, t in zip(("new_tokens", "next_new_tokens", "new_token_counts", "next_draft_tokens"), stores.tensors()):
        check_launch_device(f"stores.{name}", t)
    return stores


def _check_slot_ids(slot_ids: object, stores: SlotStores, *, unique: bool) -> torch.Tensor:
    check_tensor("slot_ids", slot_ids, dtype=_INT, ndim=1, device=stores.device)
    assert isinstance(slot_ids, torch.Tensor)
    check_launch_device("slot_ids", slot_ids)
    if slot_ids.device.type == "cpu":
        _check_host_slot_values(slot_ids, stores.num_slots, unique=unique)
    return slot_ids


def _check_host_slot_values(slot_ids: torch.Tensor, num_slots: int, *, unique: bool) -> None:
    """Host memory: range and uniqueness cost no device synchronisation."""
    n = slot_ids.shape[0]
    if n == 0:
        return
    lo, hi = int(slot_ids.min()), int(slot_ids.max())
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"slot_ids: values must lie in [0, {num_slots}), got min {lo}, max {hi}")
    if unique and torch.unique(slot_ids).numel() != n:
        raise ValueError("slot_ids: duplicate slots (two rows would write one slot)")


def _check_row_begin(row_begin: object) -> int:
    if isinstance(row_begin, bool) or not isinstance(row_begin, int):
        raise TypeError(f"row_begin: expected an int, got {type(row_begin).__name__}")
    if row_begin < 0:
        raise ValueError(f"row_begin: expected >= 0, got {row_begin}")
    return row_begin


class _ScatterPlan:
    """What a validated ``slot_scatter`` argument set launches with; holds no tensors (addresses only).

    ``ptr_args`` are the kernel's runtime arguments with every tensor replaced by its device address
    (``row_begin``, argument 2, is the only per-call value). ``direct`` / ``grid`` are filled once the kernel for
    ``spec`` is compiled (on a GPU; in the interpreter every launch takes Triton's path).
    """

    __slots__ = ("direct", "grid", "host_ids", "min_rows", "n", "num_slots", "ptr_args", "spec")

    def __init__(self, n: int, min_rows: int, num_slots: int, host_ids: bool) -> None:
        self.n = n
        self.min_rows = min_rows
        self.num_slots = num_slots
        self.host_ids = host_ids
        self.spec: tuple = ()
        self.ptr_args: tuple = ()
        self.direct: DirectLaunch | None = None
        self.grid = 0


_SCATTER_PLANS = PlanCache()


def _cached_plan(cache: PlanCache, key_fn: Callable[..., tuple], *args: object) -> Any:
    """The plan cached for these arguments, or None (also when they are not what a key is built from: the
    checked path then names the bad argument)."""
    try:
        return cache.get(key_fn(*args))
    except (AttributeError, TypeError):
        return None


def _scatter_key(stores: SlotStores, tensors: tuple[torch.Tensor, ...]) -> tuple:
    st = stores
    return (
        tensor_key(st.new_tokens),
        tensor_key(st.next_new_tokens),
        tensor_key(st.new_token_counts),
        tensor_key(st.next_draft_tokens),
        *[tensor_key(t) for t in tensors],
    )


def slot_scatter(
    stores: SlotStores,
    slot_ids: torch.Tensor,
    new_tokens: torch.Tensor,
    next_new_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    next_draft_tokens: torch.Tensor,
    *,
    row_begin: int = 0,
) -> None:
    """Store one step's per-row outputs into their slots, in one launch (semantics in the module docstring).

    ``slot_ids [N]`` int32/int64; ``new_tokens [M, a]``, ``next_new_tokens [M, b]``, ``new_token_counts [M]``,
    ``next_draft_tokens [M, c]`` integer tensors (any strides) of which rows ``row_begin .. row_begin + N - 1``
    are stored; everything on ``stores.device``. Values are cast to each store's dtype.

    Every argument is checked on every call; a call whose tensors have the same addresses, shapes, strides,
    dtypes and devices as an earlier valid call reuses that call's checked launch plan (host ``slot_ids``
    values are still range- and duplicate-checked each time).
    """
    plan = None
    if type(stores) is SlotStores:
        tensors = (slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens)
        plan = _cached_plan(_SCATTER_PLANS, _scatter_key, stores, tensors)
    if plan is None or type(row_begin) is not int or row_begin < 0 or row_begin + plan.n > plan.min_rows:
        plan = _scatter_plan(
            stores, slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens, row_begin
        )
    elif plan.host_ids:
        _check_host_slot_values(slot_ids, plan.num_slots, unique=True)
    if plan.n == 0:
        return
    _scatter_launch(plan, row_begin, stores, slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens)


def _scatter_plan(
    stores: SlotStores,
    slot_ids: torch.Tensor,
    new_tokens: torch.Tensor,
    next_new_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    next_draft_tokens: torch.Tensor,
    row_begin: object,
) -> _ScatterPlan:
    """Every check of ``slot_scatter``; returns (and caches) the plan of this argument set."""
    dev = _check_stores(stores).device
    slot_ids = _check_slot_ids(slot_ids, stores, unique=True)
    row_begin = _check_row_begin(row_begin)
    n = slot_ids.shape[0]
    outputs = [
        ("new_tokens", new_tokens, 2),
        ("next_new_tokens", next_new_tokens, 2),
        ("new_token_counts", new_token_counts, 1),
        ("next_draft_tokens", next_draft_tokens, 2),
    ]
    for name, t, nd in outputs:
        check_tensor(name, t, dtype=_INT, ndim=nd, device=dev)
        if t.shape[0] < row_begin + n:
            raise ValueError(f"{name}: has {t.shape[0]} rows, needs row_begin + len(slot_ids) = {row_begin + n}")
    names = ("stores.new_tokens", "stores.next_new_tokens", "stores.new_token_counts", "stores.next_draft_tokens")
    check_no_overlap(dict(zip(names, stores.tensors())), {"slot_ids": slot_ids, **{nm: t for nm, t, _ in outputs}})
    plan = _ScatterPlan(n, min(t.shape[0] for _, t, _ in outputs), stores.num_slots, slot_ids.device.type == "cpu")
    if n:
        args, _, plan.spec = _scatter_args(
            stores, slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens, n, 0
        )
        plan.ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    tensors = (slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens)
    return _SCATTER_PLANS.put(_scatter_key(stores, tensors), plan)


def _scatter_args(
    st: SlotStores,
    slot_ids: torch.Tensor,
    new_tokens: torch.Tensor,
    next_new_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    next_draft_tokens: torch.Tensor,
    n: int,
    row_begin: int,
) -> tuple[tuple, dict[str, int], tuple]:
    """The scatter kernel's runtime arguments (signature order), its layout constants and launch spec."""
    widths = (st.new_tokens.shape[0], st.next_new_tokens.shape[0], st.next_draft_tokens.shape[1])
    block_w = next_pow2(max(widths))
    tensors = (slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens, *st.tensors())
    layout = {
        "S_SLOT": slot_ids.stride(0),
        "N_SLOTS": st.num_slots,
        "S_NEW_R": new_tokens.stride(0),
        "S_NEW_W": new_tokens.stride(1),
        "A_NEW": new_tokens.shape[1],
        "S_NEXT_R": next_new_tokens.stride(0),
        "S_NEXT_W": next_new_tokens.stride(1),
        "A_NEXT": next_new_tokens.shape[1],
        "S_COUNT": new_token_counts.stride(0),
        "S_DRAFT_R": next_draft_tokens.stride(0),
        "S_DRAFT_W": next_draft_tokens.stride(1),
        "A_DRAFT": next_draft_tokens.shape[1],
        "ST_NEW_W": st.new_tokens.stride(0),
        "ST_NEW_S": st.new_tokens.stride(1),
        "W_NEW": widths[0],
        "ST_NEXT_W": st.next_new_tokens.stride(0),
        "ST_NEXT_S": st.next_new_tokens.stride(1),
        "W_NEXT": widths[1],
        "ST_COUNT_S": st.new_token_counts.stride(0),
        "ST_DRAFT_S": st.next_draft_tokens.stride(0),
        "ST_DRAFT_W": st.next_draft_tokens.stride(1),
        "W_DRAFT": widths[2],
        "I64": int(_needs_i64(tensors)),
        "BLOCK_W": block_w,
    }
    args = (slot_ids, n, row_begin, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens, *st.tensors())
    # n and row_begin are do_not_specialize: they change per step without a new compiled kernel.
    return args, layout, (_spec(tensors), tuple(layout.values()))


def _scatter_launch(
    plan: _ScatterPlan,
    row_begin: int,
    stores: SlotStores,
    slot_ids: torch.Tensor,
    new_tokens: torch.Tensor,
    next_new_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    next_draft_tokens: torch.Tensor,
) -> None:
    d = plan.direct
    if d is not None and not hooks_active() and d.current_device() == d.device:
        a = plan.ptr_args
        d.run(
            plan.grid, 1, 1, d.current_stream(d.device), d.function, d.packed_metadata, None, None, None,
            a[0], a[1], row_begin, *a[3:], *d.consts,
        )  # fmt: skip
        return
    n = plan.n
    args, layout, spec = _scatter_args(
        stores, slot_ids, new_tokens, next_new_tokens, new_token_counts, next_draft_tokens, n, row_begin
    )
    _SCATTER.launch_fast(lambda m: (cdiv(n, m["BLOCK_R"]),), (layout["BLOCK_W"],), spec, args, **layout)
    if plan.direct is None:
        # Every tensor is on the kernel's GPU (checked), so raw addresses stand for them from now on.
        d = _SCATTER.direct(spec)
        if d is not None:
            plan.grid = cdiv(n, d.meta["BLOCK_R"])
            plan.direct = d


def _check_out(out: StepInputs, n: int, t: int, dev: torch.device, st: SlotStores, slot_ids: torch.Tensor) -> int:
    if not isinstance(out, StepInputs):
        raise TypeError(f"out: expected StepInputs, got {type(out).__name__}")
    for name, x, shape, src in [
        ("out.input_ids", out.input_ids, (n * t,), st.next_new_tokens),
        ("out.position_offsets", out.position_offsets, (n * t,), st.new_token_counts),
        ("out.kv_offsets", out.kv_offsets, (n,), st.new_token_counts),
    ]:
        check_tensor(name, x, dtype=_INT, device=dev)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
        _check_not_narrower(name, x, src)
    check_tensor("out.draft_tokens", out.draft_tokens, dtype=_INT, ndim=2, device=dev)
    if out.draft_tokens.shape[0] != n:
        raise ValueError(f"out.draft_tokens: expected {n} rows, got {out.draft_tokens.shape[0]}")
    _check_not_narrower("out.draft_tokens", out.draft_tokens, st.next_draft_tokens)
    for name, x in zip(StepInputs._fields, out):
        check_launch_device(f"out.{name}", x)
    check_no_overlap(
        {f"out.{name}": x for name, x in zip(StepInputs._fields, out)},
        {"slot_ids": slot_ids, "stores.next_new_tokens": st.next_new_tokens,
         "stores.new_token_counts": st.new_token_counts, "stores.next_draft_tokens": st.next_draft_tokens},
    )  # fmt: skip
    return out.draft_tokens.shape[1]


def _check_not_narrower(name: str, x: torch.Tensor, src: torch.Tensor) -> None:
    # Device values cannot be range-checked without a synchronisation, so an int64 store's values (a count of
    # 2**40 + 3, say) would be truncated silently by an int32 output: refuse the narrowing itself.
    if x.element_size() < src.element_size():
        raise ValueError(f"{name}: {x.dtype} cannot hold every {src.dtype} value of the store it is read from; "
                         f"expected {src.dtype}")  # fmt: skip


class _GatherPlan:
    """What a validated ``step_gather`` argument set launches with; holds no tensors (addresses only).

    ``ptr_args`` are the kernel's runtime arguments with every tensor replaced by its device address; when the
    call allocates its outputs (no ``out``), they end after the stores and the outputs' addresses follow per call.
    """

    __slots__ = (
        "direct",
        "grid",
        "host_ids",
        "k",
        "layout",
        "n",
        "num_slots",
        "out_dtypes",
        "own_out",
        "ptr_args",
        "spec",
        "t",
    )

    def __init__(self, n: int, t: int, k: int, num_slots: int, host_ids: bool, own_out: bool) -> None:
        self.n, self.t, self.k = n, t, k
        self.num_slots = num_slots
        self.host_ids = host_ids
        self.own_out = own_out
        self.out_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.int32, torch.int32, torch.int32)
        self.layout: dict[str, int] = {}
        self.spec: tuple = ()
        self.ptr_args: tuple = ()
        self.direct: DirectLaunch | None = None
        self.grid = 0

    def allocate(self, device: torch.device) -> StepInputs:
        """Outputs for a call without ``out``, contiguous: the store dtypes for tokens, and for offsets the counts
        store's dtype (int32 or int64, so a count is never narrowed)."""
        n, t, k = self.n, self.t, self.k
        tok, cnt, draft = self.out_dtypes
        return StepInputs(
            torch.empty(n * t, dtype=tok, device=device),
            torch.empty(n * t, dtype=cnt, device=device),
            torch.empty((n, k), dtype=draft, device=device),
            torch.empty(n, dtype=cnt, device=device),
        )


_GATHER_PLANS = PlanCache()


def _gather_key(
    stores: SlotStores, slot_ids: torch.Tensor, t: int, draft_len: int | None, out: StepInputs | None
) -> tuple:
    st = stores
    outs = None if out is None else tuple(tensor_key(x) for x in out)
    return (
        tensor_key(st.next_new_tokens),
        tensor_key(st.new_token_counts),
        tensor_key(st.next_draft_tokens),
        tensor_key(slot_ids),
        t,
        draft_len,
        type(out),
        outs,
    )


def step_gather(
    stores: SlotStores,
    slot_ids: torch.Tensor,
    tokens_per_row: int,
    *,
    draft_len: int | None = None,
    out: StepInputs | None = None,
) -> StepInputs:
    """Build the next step's inputs for ``N = len(slot_ids)`` rows of ``T = tokens_per_row`` tokens, one launch.

    Returns ``StepInputs`` (``out`` when given; its ``draft_tokens`` width sets K, else ``draft_len``, else
    ``T - 1``). Allocated outputs take the store dtypes for tokens and the counts store's dtype for offsets; a
    given ``out`` narrower than the store it is read from is refused (an int64 count is never truncated). As for
    the scatter, a call whose tensors (and ``T``, ``draft_len``) match an earlier valid call reuses its checked
    launch plan.
    """
    plan = None
    if type(stores) is SlotStores and type(tokens_per_row) is int and (draft_len is None or type(draft_len) is int):
        plan = _cached_plan(_GATHER_PLANS, _gather_key, stores, slot_ids, tokens_per_row, draft_len, out)
    if plan is None:
        plan = _gather_plan(stores, slot_ids, tokens_per_row, draft_len, out)
    elif plan.host_ids:
        _check_host_slot_values(slot_ids, plan.num_slots, unique=False)
    if out is None:
        out = plan.allocate(stores.device)
    if plan.n:
        _gather_launch(plan, stores, slot_ids, out)
    return out


def _gather_plan(
    stores: SlotStores, slot_ids: torch.Tensor, t: object, draft_len: object, out: StepInputs | None
) -> _GatherPlan:
    """Every check of ``step_gather``; returns (and caches) the plan of this argument set."""
    dev = _check_stores(stores).device
    slot_ids = _check_slot_ids(slot_ids, stores, unique=False)
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"tokens_per_row: expected an int, got {type(t).__name__}")
    st = stores
    w_next, w_draft = st.next_new_tokens.shape[0], st.next_draft_tokens.shape[1]
    if not 1 <= t <= w_next:
        raise ValueError(f"tokens_per_row: expected 1 <= T <= W_next = {w_next}, got {t}")
    n = slot_ids.shape[0]
    if out is not None:
        if draft_len is not None:
            raise ValueError("draft_len: give either draft_len or out (whose draft_tokens width sets it), not both")
        k = _check_out(out, n, t, dev, st, slot_ids)
    else:
        k = t - 1 if draft_len is None else draft_len
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"draft_len: expected an int, got {type(k).__name__}")
    if not 0 <= k <= w_draft:
        raise ValueError(f"draft_len: expected 0 <= K <= W_draft = {w_draft}, got {k}")
    plan = _GatherPlan(n, t, k, st.num_slots, slot_ids.device.type == "cpu", out is None)
    plan.out_dtypes = (st.next_new_tokens.dtype, st.new_token_counts.dtype, st.next_draft_tokens.dtype)
    if n:
        outs = plan.allocate(dev) if out is None else out
        tensors = (slot_ids, *st.tensors()[1:], *outs)
        plan.layout = _gather_layout(st, slot_ids, t, k, outs)
        # Freshly allocated outputs are contiguous and allocator-aligned, so one spec serves every such call.
        plan.spec = (_spec(tensors), tuple(plan.layout.values()))
        kept = (slot_ids, n, *st.tensors()[1:], *(() if out is None else out))
        plan.ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in kept)
    return _GATHER_PLANS.put(_gather_key(stores, slot_ids, t, draft_len, out), plan)


def _gather_layout(st: SlotStores, slot_ids: torch.Tensor, t: int, k: int, out: StepInputs) -> dict[str, int]:
    """The gather kernel's compile-time constants for these tensors (checked by the caller)."""
    return {
        "S_SLOT": slot_ids.stride(0),
        "N_SLOTS": st.num_slots,
        "T": t,
        "K": k,
        "ST_NEXT_W": st.next_new_tokens.stride(0),
        "ST_NEXT_S": st.next_new_tokens.stride(1),
        "ST_COUNT_S": st.new_token_counts.stride(0),
        "ST_DRAFT_S": st.next_draft_tokens.stride(0),
        "ST_DRAFT_W": st.next_draft_tokens.stride(1),
        "S_IDS": out.input_ids.stride(0),
        "S_POS": out.position_offsets.stride(0),
        "S_DRAFT_R": out.draft_tokens.stride(0),
        "S_DRAFT_K": out.draft_tokens.stride(1),
        "S_KV": out.kv_offsets.stride(0),
        "I64": int(_needs_i64((slot_ids, *st.tensors()[1:], *out))),
        "BLOCK_T": next_pow2(t),
        "BLOCK_K": next_pow2(max(k, 1)),
    }


def _gather_launch(plan: _GatherPlan, stores: SlotStores, slot_ids: torch.Tensor, out: StepInputs) -> None:
    d = plan.direct
    if d is not None and not hooks_active() and d.current_device() == d.device:
        a = plan.ptr_args
        if plan.own_out:
            a = (*a, *(x.data_ptr() for x in out))
        d.run(plan.grid, 1, 1, d.current_stream(d.device), d.function, d.packed_metadata, None, None, None, *a,
              *d.consts)  # fmt: skip
        return
    n, layout = plan.n, plan.layout
    args = (slot_ids, n, *stores.tensors()[1:], *out)
    key = (layout["BLOCK_T"], layout["BLOCK_K"])
    _GATHER.launch_fast(lambda m: (cdiv(n, m["BLOCK_R"]),), key, plan.spec, args, **layout)
    if plan.direct is None:
        d = _GATHER.direct(plan.spec)
        if d is not None:
            plan.grid = cdiv(n, d.meta["BLOCK_R"])
            plan.direct = d


def _fit(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad or truncate [N, w] rows to [N, width] (int64)."""
    fitted = torch.zeros(rows.shape[0], width, dtype=torch.int64, device=rows.device)
    w = min(width, rows.shape[1])
    fitted[:, :w] = rows[:, :w].long()
    return fitted


def slot_scatter_ref(
    stores: SlotStores,
    slot_ids: torch.Tensor,
    new_tokens: torch.Tensor,
    next_new_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    next_draft_tokens: torch.Tensor,
    *,
    row_begin: int = 0,
) -> SlotStores:
    """Plain torch: returns the stores as ``slot_scatter`` leaves them (new tensors; ``stores`` untouched)."""
    n = slot_ids.shape[0]
    rows = slice(row_begin, row_begin + n)
    slots = slot_ids.long()
    counts = new_token_counts[rows].long()
    res = stores.clone()
    new = _fit(new_tokens[rows], res.new_tokens.shape[0])
    cols = torch.arange(new.shape[1], device=new.device)
    new = torch.where(cols[None, :] < counts[:, None], new, 0)
    res.new_tokens[:, slots] = new.t().to(res.new_tokens.dtype)
    res.next_new_tokens[:, slots] = (
        _fit(next_new_tokens[rows], res.next_new_tokens.shape[0]).t().to(res.next_new_tokens.dtype)
    )
    res.new_token_counts[slots] = counts.to(res.new_token_counts.dtype)
    res.next_draft_tokens[slots] = _fit(next_draft_tokens[rows], res.next_draft_tokens.shape[1]).to(
        res.next_draft_tokens.dtype
    )
    return res


def step_gather_ref(
    stores: SlotStores, slot_ids: torch.Tensor, tokens_per_row: int, *, draft_len: int | None = None
) -> StepInputs:
    """Plain torch, int64: the inputs ``step_gather`` builds (offsets as int64)."""
    t = tokens_per_row
    k = t - 1 if draft_len is None else draft_len
    slots = slot_ids.long()
    counts = stores.new_token_counts.long()[slots]
    offsets = counts - t
    return StepInputs(
        stores.next_new_tokens.long()[:t, slots].t().reshape(-1),
        offsets.repeat_interleave(t),
        stores.next_draft_tokens.long()[slots, :k],
        offsets,
    )


def selfcheck(device: torch.device) -> list[CheckRow]:
    g = torch.Generator().manual_seed(4)
    slots, n, t = 37, 11, 4
    stores = SlotStores.zeros(slots, 8, 8, 7, device)
    slot_ids = torch.randperm(slots, generator=g)[:n].to(device)
    rand = lambda *shape: torch.randint(1, 32000, shape, generator=g, dtype=torch.int32).to(device)
    new, nxt, draft = rand(n, t), rand(n, t), rand(n, t - 1)
    counts = torch.randint(1, t + 1, (n,), generator=g, dtype=torch.int32).to(device)

    def scatter() -> tuple[float, bool]:
        want = slot_scatter_ref(stores, slot_ids, new, nxt, counts, draft)
        slot_scatter(stores, slot_ids, new, nxt, counts, draft)
        bad = sum(int((a.long() != b.long()).sum()) for a, b in zip(stores.tensors(), want.tensors()))
        return float(bad), bad == 0

    def gather() -> tuple[float, bool]:
        got, want = step_gather(stores, slot_ids, t), step_gather_ref(stores, slot_ids, t)
        bad = sum(int((a.long() != b.long()).sum()) for a, b in zip(got, want))
        return float(bad), bad == 0

    shapes = f"{n} of {slots} slots, T={t}, stores W=8"
    return [
        timed_check("slot_scatter", device, shapes, scatter, unit="mismatched entries"),
        timed_check("step_gather", device, shapes, gather, unit="mismatched entries"),
    ]
