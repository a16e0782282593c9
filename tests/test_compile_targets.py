"""Every kernel of kvforge.kernels compiles for sm_80, sm_89, sm_90, sm_100 and sm_120, offline (no GPU).

Triton compiles for a ``GPUTarget`` without a driver, so a kernel that stops compiling on one architecture
fails here rather than at a user's first launch. The compiles run in a subprocess with the interpreter off (this
file is also the script: ``python tests/test_compile_targets.py 90``); one test per architecture, so xdist
spreads them. ``SPECS`` holds one signature per kernel and, for the MLA kernel, one small-tile variant per
product mode that architecture runs (e4m3 MMA from sm_89, FP8 decoded from bytes on sm_80). A new ``*_kernel``
without a spec fails ``test_every_kernel_has_a_spec``: add its signature below. The warp-specialised Gluon
kernel of ``mla_context_gluon`` compiles for sm_90 only (``GLUON_VARIANTS``: its input modes, both V layouts,
ring depths), whenever the installed Triton has Gluon.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kvforge" / "kernels"
ARCHS = [80, 89, 90, 100, 120]

# Kernel -> (module, {param: type} for the runtime parameters, {constexpr: value}, num_warps).
SPECS: dict[str, tuple[str, dict[str, str], dict[str, object], int]] = {
    "_block_offsets_kernel": (
        "block_offsets",
        {"page_ptr": "*i32", "index_ptr": "*i32", "scale_ptr": "*i32", "kv_offset_ptr": "*i32", "out_ptr": "*i32",
         **{n: "i32" for n in ("n_seq", "n_blocks", "row_capacity", "sp_pool", "sp_row", "sp_block", "s_index",
                               "s_scale", "s_kv_offset", "so_pool", "so_row", "so_plane", "so_block")}},
        {"BLOCK": 512, "FOLD": False},
        4,
    ),
    "_kv_block_copy_kernel": (
        "kv_pack", {"base_ptr": "*u8", "meta_ptr": "*i64", "page_ptr": "*i32"},
        {"UNPACK": False, "ALIGN": 4, "BLOCK": 1024, "NMETA": 8}, 4,
    ),
    "_merge_states_kernel": (
        "merge_states",
        {"o_ptr": "*bf16", "lse_ptr": "*fp32", "out_ptr": "*bf16", "out_lse_ptr": "*fp32",
         **{n: "i32" for n in ("S", "R", "H", "D", "s_os", "s_ot", "s_oh", "s_ls", "s_lt", "s_lh", "s_out_t",
                               "s_out_h", "s_olse_t", "s_olse_h")}},
        {"BLOCK_R": 16, "BLOCK_D": 128}, 4,
    ),
    "_pinned_pair_kernel": (
        "pinned_pair",
        {"src_a": "*i32", "off_a": "i32", "dst_a": "*i32", "n_a": "i32", "src_b": "*u8", "off_b": "i32",
         "dst_b": "*u8", "n_b": "i32"},
        {"BLOCK": 1024}, 4,
    ),
    "_quantize_fp8_kernel": (
        "quantize_fp8",
        {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32", "scale_val": "fp32",
         **{n: "i32" for n in ("n_inner", "n_outer", "d", "sx_outer", "sx_inner", "so_outer", "so_inner", "so_d")}},
        {"SCALE_IS_PTR": False, "BLOCK_R": 16, "BLOCK_D": 128}, 4,
    ),
    "_slot_scatter_kernel": (
        "slot_ops",
        {"slot_ptr": "*i32", "n_rows": "i32", "row_begin": "i32", "new_ptr": "*i32", "next_ptr": "*i32",
         "count_ptr": "*i32", "draft_ptr": "*i32", "st_new_ptr": "*i32", "st_next_ptr": "*i32",
         "st_count_ptr": "*i32", "st_draft_ptr": "*i32"},
        {"S_SLOT": 1, "N_SLOTS": 64, "S_NEW_R": 4, "S_NEW_W": 1, "A_NEW": 4, "S_NEXT_R": 4, "S_NEXT_W": 1,
         "A_NEXT": 4, "S_COUNT": 1, "S_DRAFT_R": 4, "S_DRAFT_W": 1, "A_DRAFT": 4, "ST_NEW_W": 64, "ST_NEW_S": 1,
         "W_NEW": 4, "ST_NEXT_W": 64, "ST_NEXT_S": 1, "W_NEXT": 4, "ST_COUNT_S": 1, "ST_DRAFT_S": 4, "ST_DRAFT_W": 1,
         "W_DRAFT": 4, "I64": False, "BLOCK_R": 16, "BLOCK_W": 4},
        1,
    ),
    "_step_gather_kernel": (
        "slot_ops",
        {"slot_ptr": "*i32", "n_rows": "i32", "st_next_ptr": "*i32", "st_count_ptr": "*i32", "st_draft_ptr": "*i32",
         "ids_ptr": "*i32", "pos_ptr": "*i32", "draft_ptr": "*i32", "kv_ptr": "*i32"},
        {"S_SLOT": 1, "N_SLOTS": 64, "T": 4, "K": 4, "ST_NEXT_W": 64, "ST_NEXT_S": 1, "ST_COUNT_S": 1,
         "ST_DRAFT_S": 4, "ST_DRAFT_W": 1, "S_IDS": 1, "S_POS": 1, "S_DRAFT_R": 4, "S_DRAFT_K": 1, "S_KV": 1,
         "I64": False, "BLOCK_R": 32, "BLOCK_T": 4, "BLOCK_K": 4},
        2,
    ),
    "_mla_decode_split_kernel": (
        "mla_decode",
        {"q_ptr": "*bf16", "kv_ptr": "*bf16", "desc_h": "*bf16", "desc_r": "*bf16", "bt_ptr": "*i32",
         "seq_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
         "nshare_ptr": "*i32", "err_ptr": "*i32", "scale_ptr": "*fp32", "sm_scale_log2": "fp32", "kv_scale": "fp32",
         **{n: "i32" for n in ("H", "s_qb", "s_qh", "s_kp", "s_kr", "s_btb", "s_pob", "s_poh", "s_pos", "B", "S",
                               "max_len", "min_tiles", "slots", "num_pages", "s_plb", "s_plh", "s_ob", "s_oh", "s_lb",
                               "s_lh")}},
        {"PAGE_SIZE": 32, "D_V": 512, "D_R": 64, "UPCAST": False, "BLOCK_H": 16, "BLOCK_N": 64, "SPLIT_DV": False,
         "USE_TMA": False, "PRECISION": "tf32", "CHECK": True, "BALANCE": 2, "SCALE_MODE": 0, "FP8_BYTES": False,
         "ORDER": True, "MERGE": True},
        4,
    ),
    "_decode_merge_kernel": (
        "mla_decode",
        {"po_ptr": "*fp32", "plse_ptr": "*fp32", "nshare_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
         **{n: "i32" for n in ("H", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh", "s_ob", "s_oh", "s_lb", "s_lh")}},
        {"BLOCK_S": 64, "BLOCK_D": 128, "CH": 8, "HB": 4}, 2,
    ),
    "_store_latent_kernel": (
        "mla_decode",
        {"rows_ptr": "*bf16", "slot_ptr": "*i64", "cache_ptr": "*u8", "scale_ptr": "*fp32", "scale_val": "fp32",
         **{n: "i32" for n in ("n_rows", "n_slots", "s_row", "s_page", "s_tok")}},
        {"PAGE_SIZE": 64, "D": 576, "FP8_OUT": True, "SCALE_IS_PTR": True, "BLOCK_R": 8, "BLOCK_D": 128}, 4,
    ),
    "_mla_tile_starts_kernel": (
        "mla_context",
        {"CuQ": "*i32", "CuKV": "*i32", "Starts": "*i32", "Flag": "*i32",
         **{n: "i32" for n in ("n_req", "total_q", "kv_rows", "max_q", "max_kv")}},
        {"BLOCK_M": 128, "R_BLOCK": 256, "SET_FLAG": True}, 4,
    ),
    "_mla_work_items_kernel": (
        "mla_context",
        {"CuQ": "*i32", "CuKV": "*i32", "Starts": "*i32", "Work": "*i32",
         **{n: "i32" for n in ("n_req", "n_slots", "n_iter", "total_q", "kv_rows", "max_q", "max_kv")}},
        {"BLOCK_M": 128, "N_PAD": 64, "SORT": True}, 4,
    ),
    "_mla_work_table_kernel": (
        "mla_context",
        {"CuQ": "*i32", "CuKV": "*i32", "Starts": "*i32", "Flag": "*i32", "Work": "*i32",
         **{n: "i32" for n in ("n_req", "n_slots", "n_iter", "total_q", "kv_rows", "max_q", "max_kv")}},
        {"BLOCK_M": 128, "R_BLOCK": 256, "SET_FLAG": True, "N_PAD": 64}, 4,
    ),
    "_mla_context_fwd_kernel": ("mla_context", {}, {}, 4),  # variants below
    "_rows_copy_kernel": (
        "mla_context",
        {"src": "*u8", "dst": "*u8",
         **{n: "i32" for n in ("n_rows", "d", "cols", "s_h", "s_d", "s_mis", "t_h", "t_d")}},
        {"BLOCK_R": 1, "BLOCK_W": 512}, 4,
    ),
    "_tokens_to_dims_kernel": (
        "mla_context",
        {"src": "*u8", "dst": "*u8", **{n: "i32" for n in ("n_tok", "n_dblk", "s_t", "s_h", "t_h", "t_d")}},
        {"D": 128, "BLOCK_T": 128, "BLOCK_D": 64}, 4,
    ),
    # the engine's fused ops and the accepted-state select
    "_state_select_kernel": (
        "state_select", {"pool_ptr": "*fp32", "live_ptr": "*i32", "scratch_ptr": "*i32", "accepted_ptr": "*i32",
                         "row_elems": "i32", "n_scratch": "i32"}, {"BLOCK": 2048}, 4,
    ),
    "_rms_norm_kernel": (
        "rms_norm", {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
                     **{n: "i32" for n in ("n_rows", "D", "sx", "sr", "so", "ss")}, "eps": "fp32"},
        {"HAS_RES": True, "BLOCK_D": 4096}, 8,
    ),
    "_swiglu_kernel": (
        "swiglu", {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "sg": "i32",
                   "su": "i32", "so": "i32"}, {"BLOCK": 1024}, 4,
    ),
    "_rotary_kernel": (
        "rotary", {"x_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "out_ptr": "*bf16",
                   **{n: "i32" for n in ("sx_t", "sx_h", "so_t", "so_h")}}, {"HALF": 32, "BLOCK": 32}, 1,
    ),
    "_greedy_accept_kernel": (
        "greedy_accept", {"logits_ptr": "*fp32", "tok_ptr": "*i64", "best_ptr": "*i32", "acc_ptr": "*i32",
                          "lim_ptr": "*i32", "V": "i32", "sl_b": "i32", "sl_t": "i32", "st_b": "i32"},
        {"T": 2, "BLOCK_V": 2048, "LIMITS": True}, 4,
    ),
    "_kda_prepare_kernel": (
        "kda_prep", {"p_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32",
                     "b_ptr": "*fp32", "sp": "i32", "gate_bias": "fp32"}, {"H": 20, "K": 128, "BLOCK_K": 128}, 1,
    ),
    "_mla_latent_kernel": (
        "mla_latent", {"kv_ptr": "*bf16", "w_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "pool_ptr": "*bf16",
                       "rows_ptr": "*i64", "sk": "i32", "eps": "fp32"},
        {"R": 512, "HALF": 32, "BLOCK_R": 512, "BLOCK_H": 32}, 2,
    ),
    "_decode_inputs_kernel": (
        "decode_step", {"slots_ptr": "*i32", "starts_ptr": "*i64", "table_ptr": "*i32", "nnt_ptr": "*i32",
                        "ids_ptr": "*i64", "pos_ptr": "*i64", "rows_ptr": "*i64", "trows_ptr": "*i32",
                        "lens_ptr": "*i32", "st": "i32", "sn": "i32", "n_blocks": "i32"},
        {"T": 2, "TPB": 64, "BLOCK_MB": 128}, 1,
    ),
    "_decode_finish_kernel": (
        "decode_step", {"best_ptr": "*i32", "acc_ptr": "*i32", "draft_ptr": "*i64", "slots_ptr": "*i32",
                        "new_ptr": "*i32", "next_ptr": "*i32", "cnt_ptr": "*i32", "dft_ptr": "*i32", "out_ptr": "*i32",
                        "s_new": "i32", "s_next": "i32", "s_draft": "i32"},
        {"T": 2, "BLOCK_T": 2, "HAS_DRAFT": True}, 1,
    ),
}  # fmt: skip

_MLA_BASE: dict[str, object] = {
    "H": 16, "GROUP": 1, "D_A": 128, "D_B": 64, "DV": 128, "Q_FP8": False, "KV_FP8": False, "QK_MODE": 0,
    "PV_MODE": 0, "Q_QUANT": False, "V_DIM_MAJOR": False, "SCALE_FROM_PTR": False, "Q_SCALE_FROM_PTR": False,
    "WRITE_LSE": True,
    "UPCAST": False, "NATIVE_FP8": True, "P_OFFSET": 0.0, "BLOCK_M": 64, "BLOCK_N": 32, "EXP_POLY": False,
    "USE_TMA": False, "KV_ALIGN": 1, "PIPE_QK": 2, "HEADS_OUTER": True,
}  # fmt: skip
_FP8 = {"KV_FP8": True, "P_OFFSET": 8.0}
# name -> (Q pointer type, K/V pointer type, constexprs over _MLA_BASE)
MLA_VARIANTS: dict[str, tuple[str, str, dict[str, object]]] = {
    "bf16": ("*bf16", "*bf16", {}),
    "fp8 q/k/v, dim-major V": ("*fp8e4nv", "*fp8e4nv", {**_FP8, "Q_FP8": True, "QK_MODE": 1, "PV_MODE": 1,
                                                        "V_DIM_MAJOR": True, "KV_ALIGN": 16,
                                                        "Q_SCALE_FROM_PTR": True}),
    "bf16 q + fp8 k/v, Q quantised, V widened": ("*bf16", "*fp8e4nv", {**_FP8, "QK_MODE": 1, "PV_MODE": 2,
                                                                      "Q_QUANT": True}),
    "fp8 q/k/v as bytes": ("*u8", "*u8", {**_FP8, "Q_FP8": True, "QK_MODE": 2, "PV_MODE": 3}),
    "bf16 q + fp8 k/v as bytes": ("*bf16", "*u8", {**_FP8, "QK_MODE": 2, "PV_MODE": 3}),
    # Key shares (SPLIT_KV): 8-int items, fp32 partial outputs; the two paths the planner splits.
    "bf16, key shares": ("*bf16", "*bf16", {"SPLIT_KV": True}),
    "fp8 q/k/v token-major, key shares": ("*fp8e4nv", "*fp8e4nv", {**_FP8, "Q_FP8": True, "QK_MODE": 1,
                                                                   "PV_MODE": 1, "SPLIT_KV": True}),
    "fp8 q/k/v as bytes, key shares": ("*u8", "*u8", {**_FP8, "Q_FP8": True, "QK_MODE": 2, "PV_MODE": 3,
                                                      "SPLIT_KV": True}),
    # Shares of a device-built table's 4-int items, derived on chip (the one call with device lengths).
    "bf16, shares on chip": ("*bf16", "*bf16", {"SPLIT_KV": True, "CHIP_SHARES": True}),
}  # fmt: skip
# Which variants each architecture runs (kvforge.kernels.mla_context._launch picks the same way).
MLA_BY_ARCH = {
    80: ["bf16", "fp8 q/k/v as bytes", "bf16 q + fp8 k/v as bytes", "bf16, key shares",
         "fp8 q/k/v as bytes, key shares", "bf16, shares on chip"],
    **{a: ["bf16", "fp8 q/k/v, dim-major V", "bf16 q + fp8 k/v, Q quantised, V widened", "bf16, key shares",
           "fp8 q/k/v token-major, key shares", "bf16, shares on chip"] for a in (89, 90, 100, 120)},
}  # fmt: skip


# name -> (mode, V dim-major, ring stages, consumers take turns, keys reordered); mode: "fp8" (FP8 Q/K/V),
# "fp8 widen" (FP8 Q/K/V, V widened to fp16), "mixed" (bf16 Q quantised on chip, FP8 K/V, V widened), "bf16"
GLUON_VARIANTS: dict[str, tuple[str, bool, int, bool, bool]] = {
    "token-major V, 2 stages": ("fp8", False, 2, False, False),
    "token-major V, 3 stages, ping-pong, keys reordered": ("fp8", False, 3, True, True),
    "dim-major V, 2 stages": ("fp8", True, 2, False, False),
    "dim-major V, 2 stages, ping-pong, keys reordered": ("fp8", True, 2, True, True),
    "bf16 q + fp8 k/v, V widened, ping-pong": ("mixed", False, 2, True, False),
    "bf16 q/k/v, 2 stages": ("bf16", False, 2, False, False),
}


GLUON_SHARE_FORMS = ("token-major V, 3 stages, ping-pong, keys reordered", "dim-major V, 2 stages",
                     "bf16 q + fp8 k/v, V widened, ping-pong", "bf16 q/k/v, 2 stages")  # fmt: skip


def _gluon_jobs() -> list[tuple[str, object, dict[str, str], dict[str, object], int, dict[str, object]]]:
    """(label, kernel, types, constexprs, num_warps, extra options) of the sm_90 Gluon kernel; [] without Gluon."""
    from kvforge.kernels import mla_context_gluon as mg

    if mg._GLUON_IMPORT_ERROR is not None:
        return []
    gl = mg.gl

    def desc(block: list[int], kv16: bool) -> str:
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if kv16 else gl.float8e4nv)
        return f"tensordesc<{'bf16' if kv16 else 'fp8e4nv'}[{block[0]}, {block[1]}],{layout!r}>"

    jobs = []
    for label, (mode, dim_major, stages, pingpong, key_perm) in GLUON_VARIANTS.items():
        kv16, widen = mode == "bf16", mode in ("fp8 widen", "mixed")
        types = {"Q": "*fp8e4nv" if mode.startswith("fp8") else "*bf16", "O": "*bf16", "LSE": "*fp32",
                 "k_desc_a": desc([128, 128], kv16), "k_desc_b": desc([128, 64], kv16),
                 "v_desc": desc([128, 128], kv16), "Work": "*i32", "n_items": "i32",
                 "scale_ptr": "*fp32", "softmax_scale": "fp32", "kv_scale": "fp32", "q_scale_ptr": "*fp32",
                 "q_scale": "fp32"}  # fmt: skip
        consts = {"H": 16, "GROUP": 1, "D_A": 128, "D_B": 64, "DV": 128, "V_DIM_MAJOR": dim_major,
                  "SCALE_FROM_PTR": False, "Q_SCALE_FROM_PTR": not dim_major,
                  "WRITE_LSE": True, "P_OFFSET": 8.0, "BLOCK_N": 128, "NUM_STAGES": stages,
                  "KV_ALIGN": 16 if dim_major else 1, "HEADS_OUTER": True, "C_REGS": mg._C_REGS,
                  "V_REGS": mg._V_REGS, "PINGPONG": pingpong, "KEY_PERM": key_perm, "KV16": kv16,
                  "Q_QUANT": mode == "mixed", "V_WIDEN": widen}  # fmt: skip
        if kv16 or widen:
            consts["P_OFFSET"] = 0.0
        jobs.append((f"_mla_context_gluon_kernel [{label}]", mg._mla_context_gluon_kernel, types, consts,
                     4, {"maxnreg": mg._MAXNREG}))  # fmt: skip
        if label in GLUON_SHARE_FORMS:  # the key-share forms: 8-int items, or 4-int split on chip
            for form, chip in (("key shares", False), ("shares on chip", True)):
                jobs.append((f"_mla_context_gluon_kernel [{label}, {form}]", mg._mla_context_gluon_kernel,
                             {**types, "O": "*fp32"}, {**consts, "SPLIT_KV": True, "CHIP_SHARES": chip}, 4,
                             {"maxnreg": mg._MAXNREG}))  # fmt: skip
    return jobs


def _jit_kernels() -> dict[str, str]:
    """``*_kernel`` functions decorated with triton.jit in kvforge/kernels/*.py -> module name."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            is_kernel = isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            if is_kernel and any("jit" in ast.unparse(d) for d in node.decorator_list):
                found[node.name] = path.stem
    return found


def _compile_all(arch: int) -> list[dict[str, object]]:
    """Compile every spec for ``arch``; one record per compile (name, ok, seconds, error)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    jobs: list = []
    for name, (module, types, consts, warps) in SPECS.items():
        fn = getattr(importlib.import_module(f"kvforge.kernels.{module}"), name)
        if name == "_mla_decode_split_kernel" and arch >= 89:  # the e4m3 cache widened in place (FP8_PIN)
            fp8 = {**types, "kv_ptr": "*fp8e4nv", "desc_h": "*fp8e4nv", "desc_r": "*fp8e4nv"}
            jobs.append((f"{name} [e4m3 pinned]", fn, fp8, {**consts, "SCALE_MODE": 1, "FP8_PIN": True}, warps, {}))
        if name in ("_quantize_fp8_kernel", "_store_latent_kernel") and arch >= 89:  # hardware e4m3 conversion
            jobs.append((f"{name} [native e4m3]", fn, types, {**consts, "NATIVE": True}, warps, {}))
        if name != "_mla_context_fwd_kernel":
            jobs.append((name, fn, types, consts, warps, {}))
            continue
        for variant in MLA_BY_ARCH[arch]:
            q_t, kv_t, over = MLA_VARIANTS[variant]
            o_t = "*fp32" if over.get("SPLIT_KV") else "*bf16"  # shares write fp32 partials
            types = {"Q": q_t, "K": kv_t, "V": kv_t, "O": o_t, "LSE": "*fp32", "Qd_a": q_t, "Qd_b": q_t,
                     "Kd_a": kv_t, "Kd_b": kv_t, "Vd": kv_t, "Work": "*i32", "n_items": "i32", "scale_ptr": "*fp32",
                     "softmax_scale": "fp32", "kv_scale": "fp32", "q_scale_ptr": "*fp32",
                     "q_scale": "fp32"}  # fmt: skip
            jobs.append((f"{name} [{variant}]", fn, types, {**_MLA_BASE, **over}, warps, {}))
    gluon = _gluon_jobs() if arch == 90 else []
    records = []
    for label, fn, types, consts, warps, extra in jobs + gluon:
        sig = {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}
        t0 = time.time()
        try:
            if extra:  # a Gluon kernel
                from triton.experimental.gluon._runtime import GluonASTSource

                src = GluonASTSource(fn, sig, constexprs=dict(consts))
            else:
                src = ASTSource(fn, sig, constexprs=dict(consts))
            triton.compile(src, target=target, options={"num_warps": warps, "num_stages": 2, **extra})
            records.append({"name": label, "ok": True, "s": round(time.time() - t0, 1)})
        except Exception as e:  # reported with the kernel's name; the test fails on any
            records.append({"name": label, "ok": False, "s": round(time.time() - t0, 1), "error": f"{e}"[:400]})
    return records


def test_every_kernel_has_a_spec():
    missing = sorted(set(_jit_kernels()) - set(SPECS))
    assert not missing, f"kernels without an offline-compile spec in {Path(__file__).name}: {missing}"


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
def test_kernels_compile_offline(arch: int):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(arch)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [f"{r['name']}: {r['error']}" for r in records if not r["ok"]]
    assert not failed, f"sm_{arch}: " + "\n".join(failed)
    n_gluon = sum("_mla_context_gluon_kernel" in str(r["name"]) for r in records)
    assert n_gluon in ((len(GLUON_VARIANTS) + 2 * len(GLUON_SHARE_FORMS), 0) if arch == 90 else (0,)), n_gluon
    assert len(records) == len(SPECS) - 1 + len(MLA_BY_ARCH[arch]) + n_gluon + 3 * (arch >= 89)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before kvforge.kernels decides (no driver here)
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_compile_all(int(sys.argv[1]))))
