"""Fused mixture-of-experts FFN: every expert's GEMM of a step in one grouped launch.

A MoE block sends each token t to k experts (`topk_ids` [T, k], weights `topk_weights` [T, k]);
slot s = t * k + j is one (token, expert) pair. `fused_moe` computes, for every token,
    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
with three launches (plus the per-token int8 quantization launches of W8A8):
  1. `moe_align` (torch, no host sync): the slots sorted by expert, each expert's run padded to
     a multiple of BLOCK_M with the sentinel S = T * k, and the expert of every BLOCK_M block
     (-1 past the padded end). The grid is sized by the bound sum_e ceil(c_e / BLOCK_M) <=
     (S + min(E, S) * (BLOCK_M - 1)) // BLOCK_M, so no count is read back to the host.
  2. the grouped gate/up GEMM: one program per (block, N tile) loads its block's rows of x
     (gathered by token, s // k), multiplies them by that block's expert weight [N, K] and
     writes the rows of the slot-indexed intermediate [S, 2I]; padded rows are neither read
     (their row index is clamped) nor written. Unused blocks return at once.
  3. `activation.silu_and_mul` on [S, 2I] -> [S, I], then the grouped down GEMM over the same
     alignment (rows gathered by slot), the routing weight applied to the fp32 accumulator
     before the one rounding; the k slots of each token are summed by torch ([T, k, H] -> [T, H],
     fp32 accumulation, one rounding).

Weight variants (each projection independently):
  * dense: a tensor [E, N, K] in x's dtype (fp16, bf16; fp32 with IEEE fp32 dots);
  * `MoeW4A16Weight`: each expert's `W4A16Weight` (kernels/w4a16_layout.py, `prepare_w4a16`)
    stacked on a leading expert dim (`stack_w4a16`); tiles are dequantized exactly as
    kernels/w4a16_gemm.py does (its `_dequant_tile`), rounded once to x's dtype; fp16/bf16 x;
  * `MoeW8A8Weight`: int8 [E, N, K] per-channel weights and scales [E, N]; the activations are
    quantized per row by kernels/act_quant.py (x once per token, the intermediate once per
    slot), int8 x int8 -> int32 dot, epilogue acc * a_scale * w_scale (* routing weight) in
    fp32 without FMA contraction, as kernels/w8a8_gemm.py.

Twins: `moe_gemm_torch` (one grouped GEMM, per expert in plain torch: the same fp32 products,
the W8A8 epilogue's operations in the same order) and `fused_moe_torch` (the whole FFN from
them and reference.py's `silu_and_mul` / `quantize_per_token_int8`).

The tile table (`DISPATCH`) is NOT measured: no GPU was lent when this was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from slimserve.kernels import reference
from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2, use_triton
from slimserve.kernels._rounding import round_to
from slimserve.kernels.act_quant import act_quant
from slimserve.kernels.activation import silu_and_mul
from slimserve.kernels.w4a16_gemm import _dequant_tile, _kernel_args
from slimserve.kernels.w4a16_layout import W4A16Weight, dequantize_torch

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the grouped GEMMs (powers of two; W8A8 needs block_k >= 32, W4A16 lowers
    block_k to divide the group size)."""

    block_m: int  # slots per block: each expert's run is padded to a multiple of it
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Keyed by slots per expert on average (T * k / E): the first row whose bound is >= it wins.
# Defaults, NOT measured (no GPU when written): decode (a few slots an expert) keeps BLOCK_M at
# tl.dot's minimum of 16, since every block holds one expert's slots and the rest is padding;
# prefill grows the M tile as the runs fill it. Shared memory, (BM + BN) * BK * 4 bytes * stages
# for fp32 at most, stays under sm_80's 164 KiB (the AOT gate checks the compiler's figure).
DISPATCH: tuple[tuple[int | None, MoeConfig], ...] = (
    (16, MoeConfig(16, 64, 64, num_warps=4, num_stages=4)),
    (64, MoeConfig(32, 64, 64, num_warps=4, num_stages=4)),
    (None, MoeConfig(64, 128, 64, num_warps=8, num_stages=3)),
)


def select_config(num_slots: int, num_experts: int) -> MoeConfig:
    """The DISPATCH row for `num_slots` (T * k) slots over `num_experts` experts."""
    per = -(-num_slots // max(num_experts, 1))
    return next(cfg for bound, cfg in DISPATCH if bound is None or per <= bound)


# -- weights ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MoeW4A16Weight:
    """Per-expert `W4A16Weight`s stacked on dim 0 (field meanings as there). Experts whose K
    orders or groups differ are brought to one form: an identity `perm` where another expert
    has one, explicit `group_idx` rows where the group sizes differ or one expert gathers."""

    qweight: torch.Tensor  # int32 [E, ceil(K*b/32), N]
    scales: torch.Tensor  # [E, G, N]
    zeros: torch.Tensor | None  # int8 [E, G, N]
    perm: torch.Tensor | None  # int32 [E, K]
    group_idx: torch.Tensor | None  # int32 [E, K]
    n: int
    k: int
    group_size: int  # 0 with group_idx set or one group
    num_bits: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    def expert(self, e: int) -> W4A16Weight:
        """Expert e's layout: views into the stacked tensors (what w4a16_gemm takes)."""
        return W4A16Weight(
            self.qweight[e],
            self.scales[e],
            None if self.zeros is None else self.zeros[e],
            None if self.perm is None else self.perm[e],
            None if self.group_idx is None else self.group_idx[e],
            self.n,
            self.k,
            self.group_size,
            self.num_bits,
        )


@dataclass(frozen=True, eq=False)
class MoeW8A8Weight:
    """int8 per-channel expert weights for dynamic per-token int8 activations."""

    weight: torch.Tensor  # int8 [E, N, K], last dim contiguous
    scale: torch.Tensor  # [E, N] fp16/bf16/fp32, one per output channel


MoeWeight = torch.Tensor | MoeW4A16Weight | MoeW8A8Weight


def _groups_of(w: W4A16Weight) -> torch.Tensor:
    """int32 [K]: the group of each (sorted) K position of one expert."""
    if w.group_idx is not None:
        return w.group_idx
    k = torch.arange(w.k, device=w.qweight.device)
    return (k // w.group_size if w.group_size else torch.zeros_like(k)).to(torch.int32)


def stack_w4a16(weights: Sequence[W4A16Weight]) -> MoeW4A16Weight:
    """Stack per-expert layouts (same N, K, bits, groups and zero-point presence) into one."""
    check(len(weights) > 0, "stack_w4a16 needs at least one expert's weight")
    first = weights[0]
    for e, w in enumerate(weights):
        check(
            (w.n, w.k, w.num_bits, w.scales.shape, w.zeros is None)
            == (first.n, first.k, first.num_bits, first.scales.shape, first.zeros is None),
            lambda e=e, w=w: (
                f"expert {e}'s W4A16 layout (N={w.n}, K={w.k}, {w.num_bits} bits, scales "
                f"{tuple(w.scales.shape)}, zero points {w.zeros is not None}) differs from "
                f"expert 0's; only experts of one shape and scheme stack"
            ),
        )
    dev = first.qweight.device
    perm = None
    if any(w.perm is not None for w in weights):
        ident = torch.arange(first.k, dtype=torch.int32, device=dev)
        perm = torch.stack([ident if w.perm is None else w.perm for w in weights])
    gather = (
        any(w.group_idx is not None for w in weights) or len({w.group_size for w in weights}) > 1
    )
    return MoeW4A16Weight(
        torch.stack([w.qweight for w in weights]),
        torch.stack([w.scales for w in weights]),
        None if first.zeros is None else torch.stack([w.zeros for w in weights]),
        perm,
        torch.stack([_groups_of(w) for w in weights]) if gather else None,
        first.n,
        first.k,
        0 if gather else first.group_size,
        first.num_bits,
    )


def _dims(w: MoeWeight) -> tuple[int, int, int]:
    """(E, N, K) of a stacked expert weight."""
    if isinstance(w, MoeW4A16Weight):
        return w.num_experts, w.n, w.k
    if isinstance(w, MoeW8A8Weight):
        return tuple(w.weight.shape)
    return tuple(w.shape)


def _check_weight(name: str, w: MoeWeight, x_dtype: torch.dtype, dev: torch.device) -> None:
    if isinstance(w, MoeW4A16Weight):
        check_tensor(f"{name}.qweight", w.qweight, dtypes=(torch.int32,), ndim=3, device=dev)
        check(
            x_dtype in _HALF,
            lambda: f"x has dtype {x_dtype}; W4A16 experts take float16 or bfloat16 activations",
        )
    elif isinstance(w, MoeW8A8Weight):
        check_tensor(
            f"{name}.weight",
            w.weight,
            dtypes=(torch.int8,),
            ndim=3,
            device=dev,
            last_contiguous=True,
        )
        e, n, _ = w.weight.shape
        check_tensor(f"{name}.scale", w.scale, dtypes=_FLOAT, shape=(e, n), device=dev)
    else:
        check_tensor(name, w, dtypes=(x_dtype,), ndim=3, device=dev, last_contiguous=True)


# -- alignment -------------------------------------------------------------------------------


class MoeAlignment(NamedTuple):
    """The slots of a step grouped by expert in blocks of `block_m` (see the module docstring)."""

    sorted_slots: torch.Tensor  # int32 [blocks * block_m]; padding holds num_slots
    block_experts: torch.Tensor  # int32 [blocks]: each block's expert; -1: past the padded end
    num_padded: torch.Tensor  # int32 [1]: entries of sorted_slots in use (stays on the device)
    num_slots: int  # S = T * k
    block_m: int


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(c_e / block_m) over counts c_e summing to num_slots: at most
    min(E, S) experts are non-empty and each wastes at most block_m - 1 padding entries."""
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the slots s = t * k + j of `topk_ids` [T, k] (values in [0, num_experts)) by expert,
    stable, and pad each expert's run to a multiple of `block_m`; device ops only (no sync)."""
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    check(num_experts > 0, lambda: f"num_experts={num_experts}; it must be > 0")
    check(
        block_m > 0 and block_m == next_pow2(block_m),
        lambda: f"block_m={block_m} must be a power of two",
    )
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    s = flat.numel()
    # scatter_add_ (not bincount, whose output size is read back) fails on ids out of range
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # slot ids grouped by expert, in slot order
    expert_of = flat[order]
    first = counts.cumsum(0) - counts  # index in `order` of each expert's first slot
    pos = starts[expert_of] + torch.arange(s, device=dev) - first[expert_of]
    blocks = max_blocks(s, num_experts, block_m)
    slots = torch.full((blocks * block_m,), s, dtype=torch.int32, device=dev)
    slots[pos] = order.to(torch.int32)
    block_start = torch.arange(blocks, device=dev) * block_m
    # the expert whose padded range [starts, ends) holds the block's first entry
    owner = torch.searchsorted(ends, block_start, right=True)
    owner = torch.where(block_start < ends[-1], owner, -1).to(torch.int32)
    return MoeAlignment(slots, owner, ends[-1:].to(torch.int32), s, block_m)


# -- kernels ---------------------------------------------------------------------------------


@triton.jit
def _block_rows(slots_ptr, pid_m, num_slots, x_div, BLOCK_M: tl.constexpr):
    """(slots, valid, x rows as int64) of block pid_m; padding rows read row 0, never stored."""
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots // x_div, 0).to(tl.int64)
    return slots, valid, rows


@triton.jit
def _store_rows(out_ptr, acc, rw_ptr, slots, valid, offs_n, N, HAS_RW: tl.constexpr):
    """out[slot, n] = acc (* routing weight of the slot), rounded once to out's dtype."""
    if HAS_RW:
        acc = acc * tl.load(rw_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    dt = out_ptr.dtype.element_ty
    tl.store(
        out_ptr + slots.to(tl.int64)[:, None] * N + offs_n[None, :],
        round_to(acc, dt).to(dt),
        mask=valid[:, None] & (offs_n < N)[None, :],
    )


# num_slots changes with the step: not specialized on (one compiled variant per config)
@triton.jit(do_not_specialize=["num_slots"])
def _moe_dense_kernel(
    x_ptr,  # [R, K] fp16/bf16/fp32, last dim contiguous: R = T (gate/up) or S (down)
    w_ptr,  # [E, N, K] x's dtype, last dim contiguous
    rw_ptr,  # [S] routing weights (read only when HAS_RW)
    out_ptr,  # [S, N] x's dtype, contiguous
    slots_ptr,  # int32 [blocks * BLOCK_M] (moe_align)
    experts_ptr,  # int32 [blocks]
    N,
    K,
    num_slots,
    x_div,  # x row of slot s: s // x_div (top_k for gate/up, 1 for down)
    stride_xm,
    stride_we,
    stride_wn,
    HAS_RW: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 dots (fp32 x, or the interpreter, whose bf16 dot is wrong)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[s] = x[s // x_div] @ W[e]^T (* rw[s]) for the slots s of block pid_m, whose
    expert is e; BLOCK_N columns of them. Grid: (blocks, N tiles)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    slots, valid, rows = _block_rows(slots_ptr, pid_m, num_slots, x_div, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)  # wrapped columns: in-bounds loads, never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_rows(out_ptr, acc, rw_ptr, slots, valid, offs_n, N, HAS_RW)


@triton.jit(do_not_specialize=["num_slots"])
def _moe_w4a16_kernel(
    x_ptr,  # [R, K] fp16/bf16, last dim contiguous
    qw_ptr,  # int32 [E, K words, N]
    s_ptr,  # [E, G, N] scales
    z_ptr,  # int8 [E, G, N] zero points (HAS_ZP)
    perm_ptr,  # int32 [E, K] sorted position -> x column (HAS_PERM)
    gidx_ptr,  # int32 [E, K] group of each sorted position (GATHER)
    rw_ptr,
    out_ptr,  # [S, N] x's dtype
    slots_ptr,
    experts_ptr,
    N,
    K,
    num_slots,
    x_div,
    stride_xm,
    stride_qe,
    stride_se,  # of scales and zero points (the same [G, N] per expert)
    group_size,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_RW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The dense kernel with W[e] dequantized tile by tile (w4a16_gemm's `_dequant_tile`: exact
    fp32, then one rounding to x's dtype). Grid: (blocks, N tiles)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    slots, valid, rows = _block_rows(slots_ptr, pid_m, num_slots, x_div, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    qw = qw_ptr + e64 * stride_qe
    sc = s_ptr + e64 * stride_se
    zp = z_ptr
    if HAS_ZP:
        zp = z_ptr + e64 * stride_se
    perm = perm_ptr
    if HAS_PERM:
        perm = perm_ptr + e64 * K
    gidx = gidx_ptr
    if GATHER:
        gidx = gidx_ptr + e64 * K
    xdt: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        kx = offs_k
        if HAS_PERM:  # act-order: sorted position -> x column
            kx = tl.load(perm + offs_k, mask=k_mask, other=0)
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + kx[None, :], mask=k_mask[None, :], other=0.0
        )
        w = _dequant_tile(
            qw,
            sc,
            zp,
            gidx,
            offs_k,
            offs_n,
            k_mask,
            n_mask,
            k0,
            N,
            K,
            group_size,
            BITS,
            HAS_ZP,
            GATHER,
            BLOCK_K,
            BLOCK_N,
        )
        if INTERPRET:  # the interpreter's bf16 cast truncates and its bf16 dot is wrong
            acc = tl.dot(a.to(tl.float32), round_to(w, xdt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(xdt), acc)
    _store_rows(out_ptr, acc, rw_ptr, slots, valid, offs_n, N, HAS_RW)


@triton.jit(do_not_specialize=["num_slots"])
def _moe_w8a8_kernel(
    a_ptr,  # int8 [R, K] activation codes, last dim contiguous
    as_ptr,  # [R] per-row activation scales
    w_ptr,  # int8 [E, N, K], last dim contiguous
    ws_ptr,  # [E, N] per-channel weight scales
    rw_ptr,
    out_ptr,  # [S, N] fp16/bf16/fp32
    slots_ptr,
    experts_ptr,
    N,
    K,
    num_slots,
    x_div,
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    HAS_RW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """int32 accumulators, then acc * a_scale * w_scale (* rw) in fp32, the order of
    reference.w8a8_gemm (compiled with enable_fp_fusion=False). Grid: (blocks, N tiles)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    slots, valid, rows = _block_rows(slots_ptr, pid_m, num_slots, x_div, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e64 * stride_we + rn[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0)
        w = tl.load(w_ptrs, mask=k_mask[:, None], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_s = tl.load(as_ptr + rows).to(tl.float32)
    w_s = tl.load(ws_ptr + e64 * stride_wse + rn).to(tl.float32)
    out = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
    _store_rows(out_ptr, out, rw_ptr, slots, valid, offs_n, N, HAS_RW)


# Under TRITON_INTERPRET=1 (read when the kernels were defined) @triton.jit yields a wrapper, not
# a JITFunction; the kernels then take their interpreter-safe branches.
_INTERPRET = not isinstance(_moe_dense_kernel, triton.runtime.jit.JITFunction)


# -- launchers -------------------------------------------------------------------------------


def _check_config(cfg: MoeConfig, least_k: int) -> None:
    for name, value, least in (
        ("block_m", cfg.block_m, 16),
        ("block_n", cfg.block_n, 16),
        ("block_k", cfg.block_k, least_k),
    ):
        check(
            value >= least and value == next_pow2(value),
            lambda name=name, value=value, least=least: (
                f"config.{name}={value} must be a power of two >= {least} (tl.dot tiles)"
            ),
        )


def moe_gemm(
    x: torch.Tensor,
    w: MoeWeight,
    align: MoeAlignment,
    x_div: int,
    topk_weights: torch.Tensor | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """One grouped GEMM (the kernel): out[s] = x[s // x_div] @ W[expert(s)]^T (* topk_weights
    .flat[s]) for every slot s of `align`, [S, N]. W8A8: x is int8 codes [R, K] with `a_scale`
    [R, 1] and the output is `out_dtype` (default bf16); otherwise the output is x's dtype."""
    e_count, n, k = _dims(w)
    w8a8 = isinstance(w, MoeW8A8Weight)
    dev = align.sorted_slots.device
    if w8a8:
        check_tensor("x", x, dtypes=(torch.int8,), ndim=2, device=dev, last_contiguous=True)
        check_tensor("a_scale", a_scale, dtypes=_FLOAT, device=dev)
        check(
            a_scale.numel() == x.shape[0],
            lambda: f"a_scale has shape {tuple(a_scale.shape)}; expected [{x.shape[0]}, 1]",
        )
        out_dtype = out_dtype or torch.bfloat16
        check(out_dtype in _FLOAT, lambda: f"out_dtype={out_dtype} must be fp16, bf16 or fp32")
    else:
        check_tensor("x", x, dtypes=_FLOAT, ndim=2, device=dev, last_contiguous=True)
        out_dtype = x.dtype
    _check_weight("w", w, out_dtype if w8a8 else x.dtype, dev)
    check(
        x.shape[1] == k,
        lambda: f"x has shape {tuple(x.shape)}; its last dim must be the experts' K = {k}",
    )
    s = align.num_slots
    check(x_div >= 1 and x.shape[0] * x_div >= s, lambda: f"x has {x.shape[0]} rows for {s} slots")
    rw = None
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=_FLOAT, device=dev)
        check(topk_weights.numel() == s, lambda: f"topk_weights has {topk_weights.numel()} != {s}")
        rw = topk_weights.reshape(-1).contiguous()
    cfg = config or select_config(s, e_count)
    check(
        cfg.block_m == align.block_m,
        lambda: f"config.block_m={cfg.block_m} but the alignment's block_m is {align.block_m}",
    )
    _check_config(cfg, 32 if w8a8 else 16)
    out = torch.empty(s, n, dtype=out_dtype, device=dev)
    blocks = align.block_experts.numel()
    if s == 0 or n == 0 or blocks == 0:
        return out
    grid = (blocks, triton.cdiv(n, cfg.block_n))
    common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if w8a8:
        _moe_w8a8_kernel[grid](
            x,
            a_scale.reshape(-1).contiguous(),
            w.weight,
            w.scale,
            rw,
            out,
            align.sorted_slots,
            align.block_experts,
            n,
            k,
            s,
            x_div,
            x.stride(0),
            w.weight.stride(0),
            w.weight.stride(1),
            w.scale.stride(0),
            HAS_RW=rw is not None,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            enable_fp_fusion=False,
            **common,
        )
    elif isinstance(w, MoeW4A16Weight):
        block_k, group_size, gather = _kernel_args(w, cfg.block_k)
        _moe_w4a16_kernel[grid](
            x,
            w.qweight,
            w.scales,
            w.zeros,
            w.perm,
            w.group_idx,
            rw,
            out,
            align.sorted_slots,
            align.block_experts,
            n,
            k,
            s,
            x_div,
            x.stride(0),
            w.qweight.stride(0),
            w.scales.stride(0),
            group_size,
            BITS=w.num_bits,
            HAS_ZP=w.zeros is not None,
            HAS_PERM=w.perm is not None,
            GATHER=gather,
            HAS_RW=rw is not None,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=block_k,
            INTERPRET=_INTERPRET,
            **common,
        )
    else:
        _moe_dense_kernel[grid](
            x,
            w,
            rw,
            out,
            align.sorted_slots,
            align.block_experts,
            n,
            k,
            s,
            x_div,
            x.stride(0),
            w.stride(0),
            w.stride(1),
            HAS_RW=rw is not None,
            IEEE=_INTERPRET or x.dtype == torch.float32,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            **common,
        )
    return out


def moe_gemm_torch(
    x: torch.Tensor,
    w: MoeWeight,
    topk_ids: torch.Tensor,
    x_div: int,
    topk_weights: torch.Tensor | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Twin of `moe_gemm`, one expert at a time in plain torch: the fp32 product of the same
    (rounded) operands times the routing weight, rounded once; W8A8: the exact int32 product,
    then acc * a_scale * w_scale (* rw) in fp32, in that order."""
    flat = topk_ids.reshape(-1)
    e_count, n, _ = _dims(w)
    w8a8 = isinstance(w, MoeW8A8Weight)
    dtype = (out_dtype or torch.bfloat16) if w8a8 else x.dtype
    out = torch.empty(flat.numel(), n, dtype=dtype, device=x.device)
    rw = None if topk_weights is None else topk_weights.reshape(-1).float()
    for e in range(e_count):
        slots = (flat == e).nonzero().squeeze(1)
        if slots.numel() == 0:
            continue
        rows = slots // x_div
        if w8a8:
            acc = reference.w8a8_matmul_int32(x[rows], w.weight[e]).float()
            y = acc * a_scale.float().reshape(-1, 1)[rows] * w.scale[e].float().reshape(1, -1)
        else:
            we = (
                dequantize_torch(w.expert(e)).to(x.dtype) if isinstance(w, MoeW4A16Weight) else w[e]
            )
            y = x[rows].float() @ we.float().t()
        if rw is not None:
            y = y * rw[slots, None]
        out[slots] = y.to(dtype)
    return out


def _check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids) -> tuple[int, int, int, int]:
    """(T, k, H, I) after checking every argument of `fused_moe`."""
    check_tensor("x", x, dtypes=_FLOAT, ndim=2, last_contiguous=True)
    dev = x.device
    t, h = x.shape
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2, device=dev)
    check(
        topk_ids.shape[0] == t,
        lambda: f"topk_ids has shape {tuple(topk_ids.shape)}; expected [{t}, k] (x's tokens)",
    )
    check_tensor(
        "topk_weights", topk_weights, dtypes=_FLOAT, shape=tuple(topk_ids.shape), device=dev
    )
    _check_weight("w_gate_up", w_gate_up, x.dtype, dev)
    _check_weight("w_down", w_down, x.dtype, dev)
    e1, n1, k1 = _dims(w_gate_up)
    e2, n2, k2 = _dims(w_down)
    check(
        k1 == h and n1 % 2 == 0 and (e2, n2, k2) == (e1, h, n1 // 2),
        lambda: (
            f"w_gate_up is [E={e1}, N={n1}, K={k1}] and w_down [E={e2}, N={n2}, K={k2}]; "
            f"expected [E, 2I, H={h}] and [E, H={h}, I]"
        ),
    )
    return t, topk_ids.shape[1], h, n1 // 2


def fused_moe(
    x: torch.Tensor,
    w_gate_up: MoeWeight,
    w_down: MoeWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoeConfig | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """The experts' FFN of a MoE block: x [T, H], w_gate_up [E, 2I, H] (gate rows first, then
    up), w_down [E, H, I], routing `topk_weights` / `topk_ids` [T, k] -> [T, H] in x's dtype.
    use_kernel: the kernels (True) or `fused_moe_torch` (False); None reads SLIMSERVE_KERNELS."""
    t, k, h, _ = _check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    if not (use_triton(x) if use_kernel is None else use_kernel):
        return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids)
    if t == 0:
        return x.new_zeros(0, h)
    e = _dims(w_gate_up)[0]
    cfg = config or select_config(t * k, e)
    align = moe_align(topk_ids, e, cfg.block_m)
    if isinstance(w_gate_up, MoeW8A8Weight):
        q, qs = act_quant(x)  # once per token, shared by its k slots
        mid = moe_gemm(q, w_gate_up, align, k, a_scale=qs, out_dtype=x.dtype, config=cfg)
    else:
        mid = moe_gemm(x, w_gate_up, align, k, config=cfg)
    act = silu_and_mul(mid)  # [S, I]
    if isinstance(w_down, MoeW8A8Weight):
        q, qs = act_quant(act)
        y = moe_gemm(q, w_down, align, 1, topk_weights, a_scale=qs, out_dtype=x.dtype, config=cfg)
    else:
        y = moe_gemm(act, w_down, align, 1, topk_weights, config=cfg)
    return y.view(t, k, h).sum(1) if k > 1 else y


def _project_torch(x, w, topk_ids, x_div, topk_weights=None) -> torch.Tensor:
    if isinstance(w, MoeW8A8Weight):
        q, qs = reference.quantize_per_token_int8(x)
        return moe_gemm_torch(q, w, topk_ids, x_div, topk_weights, a_scale=qs, out_dtype=x.dtype)
    return moe_gemm_torch(x, w, topk_ids, x_div, topk_weights)


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: MoeWeight,
    w_down: MoeWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Twin of `fused_moe`, per expert in plain torch: the gate/up rows of every slot
    (`moe_gemm_torch`), reference.silu_and_mul, the down rows times the routing weight, then
    the k slots of each token summed ([T, k, H] -> [T, H])."""
    t, k, h, _ = _check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    mid = _project_torch(x, w_gate_up, topk_ids, k)
    y = _project_torch(reference.silu_and_mul(mid), w_down, topk_ids, 1, topk_weights)
    return y.view(t, k, h).sum(1)


# -- ahead-of-time variants ------------------------------------------------------------------


def _variant(kernel, name, ptrs, ints, consts, cfg: MoeConfig, **options) -> AotVariant:
    """AotVariant with pointers typed by `ptrs` (None: passed as None, a constexpr)."""
    sig = {a: ("*" + t if t else "constexpr") for a, t in ptrs.items()}
    sig.update({a: "i32" for a in ints}, **{a: "constexpr" for a in consts})
    consts = {**{a: None for a, t in ptrs.items() if t is None}, **consts}
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **options}
    return AotVariant(kernel, sig, consts, opts, name)


_SLOTS = {"slots_ptr": "i32", "experts_ptr": "i32"}
_INTS = ("N", "K", "num_slots", "x_div")


def aot_variants() -> list[AotVariant]:
    """Every DISPATCH row with: dense fp16 / bf16 (with and without routing weights) / fp32;
    W4A16 fp16 / bf16 x 4 / 8 bits x sym / asym with act-order, gathered groups and routing
    weights toggled across them (all 8 on the decode row, 4 on the others; block_k lowered to a
    32-wide group once); W8A8 to fp16 / bf16 / fp32 with and without routing weights."""
    out = []
    for row, (_, cfg) in enumerate(DISPATCH):
        tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        tag = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
        for dt, rw in (("fp16", False), ("bf16", True), ("bf16", False), ("fp32", True)):
            if row and (dt, rw) == ("bf16", False):
                continue
            out.append(
                _variant(
                    _moe_dense_kernel,
                    f"moe_dense_{tag}_{dt}{'_rw' * rw}",
                    {"x_ptr": dt, "w_ptr": dt, "rw_ptr": dt if rw else None, "out_ptr": dt}
                    | _SLOTS,
                    (*_INTS, "stride_xm", "stride_we", "stride_wn"),
                    dict(HAS_RW=rw, IEEE=dt == "fp32", **tiles),
                    cfg,
                )
            )
        combos = [(d, b, a) for d in ("fp16", "bf16") for b in (4, 8) for a in (False, True)]
        for i, (dt, bits, asym) in enumerate(
            combos if row == 0 else [combos[j] for j in (0, 3, 5, 6)]
        ):
            perm, gather, rw = bool(i & 1), i in (2, 5), i != 1
            block_k = 32 if (row, i) == (0, 3) else cfg.block_k
            out.append(
                _variant(
                    _moe_w4a16_kernel,
                    f"moe_w4a16_{cfg.block_m}x{cfg.block_n}x{block_k}_{dt}_w{bits}"
                    f"_{'asym' if asym else 'sym'}{'_perm' * perm}{'_gather' * gather}"
                    f"{'_rw' * rw}",
                    {
                        "x_ptr": dt,
                        "qw_ptr": "i32",
                        "s_ptr": dt,
                        "z_ptr": "i8" if asym else None,
                        "perm_ptr": "i32" if perm else None,
                        "gidx_ptr": "i32" if gather else None,
                        "rw_ptr": dt if rw else None,
                        "out_ptr": dt,
                    }
                    | _SLOTS,
                    (*_INTS, "stride_xm", "stride_qe", "stride_se", "group_size"),
                    dict(
                        BITS=bits,
                        HAS_ZP=asym,
                        HAS_PERM=perm,
                        GATHER=gather,
                        HAS_RW=rw,
                        BLOCK_M=cfg.block_m,
                        BLOCK_N=cfg.block_n,
                        BLOCK_K=block_k,
                        INTERPRET=False,
                    ),
                    cfg,
                )
            )
        for dt, rw in (("fp16", False), ("bf16", True), ("fp32", True)):
            out.append(
                _variant(
                    _moe_w8a8_kernel,
                    f"moe_w8a8_{tag}_{dt}{'_rw' * rw}",
                    {
                        "a_ptr": "i8",
                        "as_ptr": dt,
                        "w_ptr": "i8",
                        "ws_ptr": dt,
                        "rw_ptr": dt if rw else None,
                        "out_ptr": dt,
                    }
                    | _SLOTS,
                    (*_INTS, "stride_am", "stride_we", "stride_wn", "stride_wse"),
                    dict(HAS_RW=rw, **tiles),
                    cfg,
                    enable_fp_fusion=False,
                )
            )
    return out
