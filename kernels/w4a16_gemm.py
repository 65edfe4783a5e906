"""W4A16 / W8A16 linear: y[M, N] = x[M, K] @ W^T (+ bias), W from compressed-tensors packed codes.

Load time, `prepare_w4a16` (kernels/w4a16_layout.py, re-exported here) turns compressed-tensors'
pack-quantized tensors into `W4A16Weight`, the layout the kernels read. Run time, `w4a16_gemm`
dispatches on M through `DISPATCH`:
  * "gemm", small M (decode): fused dequant + tl.dot with BLOCK_M = 16 and split-K, so that a
    4096-wide layer still spreads over all SMs; fp32 partials [split, M, N] are summed by a
    second, deterministic pass (no atomics, no memset).
  * "gemm", mid M: the same kernel with bigger M tiles; split-K only while the tiles under-fill
    the GPU.
  * "dequant", large M (prefill): `dequantize_w4a16` writes W [N, K] once per call and cuBLAS
    does the product; the M at which this wins is for eval/kernels/bench.py to measure.
Dequantization is W[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)] in fp32 (exact, see
reference.py), rounded once to x's dtype for the tensor cores; accumulation is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, split_k_slices, use_triton
from slimserve.kernels.w4a16_layout import (  # noqa: F401  (prepare_w4a16: re-exported)
    SCALE_DTYPES,
    W4A16Weight,
    dequantize_torch,
    prepare_w4a16,
)

_X_DTYPES = (torch.float16, torch.bfloat16)
_TL_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_PER_CHANNEL = 1 << 30  # group_size passed to the kernel for one group: k0 // it is always 0


@dataclass(frozen=True)
class W4A16Config:
    """One launch configuration; tiles in elements, block_k lowered to divide group_size."""

    path: str  # "gemm": fused dequant + tl.dot; "dequant": dequantize_w4a16 + torch matmul
    block_m: int  # rows of x per program (gemm); unused by "dequant"
    block_n: int  # output columns per program
    block_k: int  # reduction step per loop iteration
    split_k: int = 0  # gemm only: K slices summed by a 2nd pass; 0 = pick to fill the SMs
    num_warps: int = 4
    num_stages: int = 3


# Dispatch table: the first row whose max_m >= M wins (None = no upper bound). Every launch choice
# lives here for eval/kernels/bench.py to set by measurement. These defaults are NOT measured (no
# GPU when written): decode keeps ~4 KiB of int4 words per pipeline stage per program and
# split-K fills 2 programs per SM; the mid rows are wgmma-sized tiles (BLOCK_M 64 per warpgroup);
# from M = 513 on, dequantizing a 4096x4096 W (~40 MB of traffic, ~10 us at 4 TB/s) is small
# next to the matmul (17 GFLOP, ~25 us at ~700 TFLOP/s), so cuBLAS takes over.
# Measured on an H200 (docs/gpu.md, eval/kernels/w4a16.py's sweep over M 1..4096 at N, K of
# 4096 / 11008, fp16): one K slice beats the SM-filling split at M <= 16 (70 against 149 us at
# M = 1, N = K = 4096); the dequant + cuBLAS path already wins from M = 256 (50 against 141 us).
DISPATCH: tuple[tuple[int | None, W4A16Config], ...] = (
    (16, W4A16Config("gemm", 16, 64, 128, split_k=1, num_warps=4, num_stages=4)),
    (64, W4A16Config("gemm", 32, 64, 128, split_k=0, num_warps=4, num_stages=4)),
    (None, W4A16Config("dequant", 0, 64, 128, split_k=0, num_warps=4, num_stages=1)),
)
_REDUCE_BLOCK = 1024  # elements of [M, N] per program of the split-K reduction
_GROUP_M = 8  # M tiles that walk one N column together, so W tiles are reused from L2


@triton.jit
def _round(v, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DT, round to nearest even. The interpreter's bf16 cast truncates and its bf16 dot
    is wrong, so there the value is rounded by bit manipulation and kept in fp32."""
    if INTERPRET:
        if DT == tl.bfloat16:
            b = v.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            return b.to(tl.float32, bitcast=True)
        return v.to(DT).to(tl.float32)
    return v.to(DT)


@triton.jit
def _dequant_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    offs_k,
    offs_n,
    k_mask,
    n_mask,
    k0,
    N,
    K,
    group_size,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """fp32 [BLOCK_K, BLOCK_N] tile of W^T (sorted K order); exact, as in reference.py."""
    PACK: tl.constexpr = 32 // BITS
    # [BLOCK_K / PACK, BLOCK_N] words, each loaded once and N-coalesced, split into their PACK
    # fields in registers; k = word * PACK + field is the packing order, so the reshape moves no
    # data (and the pipeliner stages 1/PACK of what a per-k-row gather of the words would)
    offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(
        qw_ptr + offs_w[:, None] * N + offs_n[None, :],
        mask=(offs_w * PACK < K)[:, None] & n_mask[None, :],
        other=0,
    )
    fields = (words[:, None, :] >> (tl.arange(0, PACK) * BITS)[None, :, None]) & ((1 << BITS) - 1)
    fields = tl.reshape(fields, (BLOCK_K, BLOCK_N))
    # int -> fp32 without I2F (16/clk/SM on sm_80/sm_90 against 64-128 for fp32 adds, CUDA
    # guide's throughput table): 0x4B000000 | f is the float 2^23 + f for f < 2^23
    q = (fields | 0x4B000000).to(tl.float32, bitcast=True)
    offset = 8388608.0 + (1 << (BITS - 1))  # 2^23 + the offset-binary bias
    if GATHER:
        g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)
        sz = g[:, None] * N + offs_n[None, :]  # [BLOCK_K, BLOCK_N]
        smask = k_mask[:, None] & n_mask[None, :]
    else:
        # [1, BLOCK_N]: the tile lies in one group; a split's last tile may start past K (x is 0
        # there), so the group is clamped to the last one to keep w finite
        sz = (min(k0, K - 1) // group_size) * N + offs_n[None, :]
        smask = n_mask[None, :]
    scale = tl.load(s_ptr + sz, mask=smask, other=0.0).to(tl.float32)
    if HAS_ZP:
        offset = offset + tl.load(z_ptr + sz, mask=smask, other=0).to(tl.float32)
    return (q - offset) * scale


# M and the split change with the step: not specialized on (one variant per config)
@triton.jit(do_not_specialize=["M", "k_tiles_per_split"])
def _w4a16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    gidx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    group_size,
    k_tiles_per_split,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[M, N] (or fp32 partial [split, M, N] when PARTIAL) = x[M, K] @ W^T over this program's
    K slice. Grid: (M tiles * N tiles, split)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows
    pid_n = (pid % group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    xdt: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * k_tiles_per_split * BLOCK_K
    for t in range(0, k_tiles_per_split):
        k0 = k_first + t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        kx = offs_k
        if HAS_PERM:  # act-order: sorted position -> x column
            kx = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = _dequant_tile(
            qw_ptr,
            s_ptr,
            z_ptr,
            gidx_ptr,
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
        w = _round(w, xdt, INTERPRET)
        if INTERPRET:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, _round(acc, xdt, INTERPRET), mask=out_mask)


@triton.jit(do_not_specialize=["MN", "split"])
def _splitk_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    MN,
    N,
    split,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[M, N] = sum over s of part[s, M, N] (+ bias), in a fixed order: deterministic."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _round(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _dequant_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    gidx_ptr,
    out_ptr,
    N,
    K,
    group_size,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[N, K] (original K order) = W, rounded to out's dtype. Grid: (K tiles, N tiles)."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = offs_k < K, offs_n < N
    w = _dequant_tile(
        qw_ptr,
        s_ptr,
        z_ptr,
        gidx_ptr,
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
    col = offs_k
    if HAS_PERM:
        col = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    tl.store(
        out_ptr + offs_n[None, :] * K + col[:, None],
        _round(w, out_ptr.dtype.element_ty, INTERPRET),
        mask=k_mask[:, None] & n_mask[None, :],
    )


# Under TRITON_INTERPRET=1 (read when the kernels were defined) @triton.jit yields a wrapper, not
# a JITFunction; the kernels then take the interpreter-safe branches of `_round`.
_INTERPRET = not isinstance(_dequant_kernel, triton.runtime.jit.JITFunction)


def _kernel_args(w: W4A16Weight, block_k: int) -> tuple[int, int, bool]:
    """(block_k, group_size for the kernel, gather) with block_k dividing the group."""
    check(
        block_k >= 16 and block_k & (block_k - 1) == 0,
        lambda: f"config.block_k={block_k}; use a power of two >= 16 (tl.dot's K step)",
    )
    if w.group_idx is not None:
        return block_k, _PER_CHANNEL, True
    if not w.group_size:
        return block_k, _PER_CHANNEL, False
    while w.group_size % block_k:
        block_k //= 2  # group_size % 16 == 0 here (prepare_w4a16), so this stops at >= 16
    return block_k, w.group_size, False


def dequantize_w4a16(
    w: W4A16Weight,
    dtype: torch.dtype | None = None,
    *,
    config: W4A16Config | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """W [N, K] in `dtype` (default: the scales' dtype), columns in the checkpoint's order.
    use_kernel: run the kernel (True) or the torch twin (False); None: as SLIMSERVE_KERNELS says."""
    dtype = dtype or w.scales.dtype
    check(
        dtype in SCALE_DTYPES, lambda: f"dtype={dtype} is not supported; use one of {SCALE_DTYPES}"
    )
    if not (use_triton(w.qweight) if use_kernel is None else use_kernel):
        return dequantize_torch(w).to(dtype)
    check(
        w.n * w.k < 2**31,
        lambda: (
            f"W [{w.n}, {w.k}] has 2^31 elements or more, past the dequant "
            "kernel's int32 indexing; split the layer along N"
        ),
    )
    cfg = config or DISPATCH[-1][1]
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.qweight.device)
    block_k, group_size, gather = _kernel_args(w, cfg.block_k)
    grid = (triton.cdiv(w.k, block_k), triton.cdiv(w.n, cfg.block_n))
    _dequant_kernel[grid](
        w.qweight,
        w.scales,
        w.zeros,
        w.perm,
        w.group_idx,
        out,
        w.n,
        w.k,
        group_size,
        BITS=w.num_bits,
        HAS_ZP=w.zeros is not None,
        HAS_PERM=w.perm is not None,
        GATHER=gather,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        INTERPRET=_INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def select_config(m: int) -> W4A16Config:
    """The DISPATCH row for M rows of x."""
    return next(cfg for max_m, cfg in DISPATCH if max_m is None or m <= max_m)


def _split_k(cfg: W4A16Config, m: int, n: int, k_tiles: int, device: torch.device) -> int:
    """K slices for this config and shape (kernels/_launch.py `split_k_slices`)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return split_k_slices(cfg.split_k, tiles, k_tiles, device)


def w4a16_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    *,
    config: W4A16Config | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """x [..., K] fp16/bf16 @ W^T (+ bias [N]) -> [..., N] in x's dtype. `config` forces a path
    and tiles (tests, benchmarks); by default `DISPATCH` picks by M. use_kernel: the kernel (True)
    or the torch twin (False); None reads SLIMSERVE_KERNELS (callers that resolved the backend
    once, like QuantLinear, pass it)."""
    check_tensor("x", x, dtypes=_X_DTYPES, device=w.qweight.device, last_contiguous=True)
    check(
        x.dim() >= 1 and x.shape[-1] == w.k,
        lambda: (
            f"x has shape {tuple(x.shape)}; its last dim must be the weight's in_features {w.k}"
        ),
    )
    if bias is not None:
        check_tensor(
            "bias", bias, dtypes=(x.dtype,), shape=(w.n,), device=x.device, last_contiguous=True
        )
    lead, x2 = x.shape[:-1], x.reshape(-1, w.k)
    m = x2.shape[0]
    cfg = config or select_config(m)
    check(
        cfg.path in ("gemm", "dequant"),
        lambda: f"config.path={cfg.path!r}; use 'gemm' or 'dequant'",
    )
    check(
        cfg.path == "dequant" or min(cfg.block_m, cfg.block_n) >= 16,
        lambda: f"config block_m={cfg.block_m}, block_n={cfg.block_n}; tl.dot needs tiles >= 16",
    )
    if not (use_triton(x) if use_kernel is None else use_kernel):
        return F.linear(x, dequantize_torch(w).to(x.dtype), bias)
    if m == 0:
        return x.new_empty(*lead, w.n)
    block_k, group_size, gather = _kernel_args(w, cfg.block_k)
    k_tiles = triton.cdiv(w.k, block_k)
    split = _split_k(cfg, m, w.n, k_tiles, x.device) if cfg.path == "gemm" else 1
    if cfg.path == "dequant" or split * m * max(w.k, w.n) >= 2**31:  # the kernel's i32 offsets
        return F.linear(x, dequantize_w4a16(w, x.dtype, config=cfg, use_kernel=True), bias)
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, w.n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n), split)
    _w4a16_gemm_kernel[grid](
        x2,
        w.qweight,
        w.scales,
        w.zeros,
        w.perm,
        w.group_idx,
        bias,
        part,
        m,
        w.n,
        w.k,
        x2.stride(0),
        group_size,
        triton.cdiv(k_tiles, split),
        BITS=w.num_bits,
        HAS_ZP=w.zeros is not None,
        HAS_PERM=w.perm is not None,
        GATHER=gather,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        GROUP_M=_GROUP_M,
        INTERPRET=_INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * w.n, _REDUCE_BLOCK),)](
            part,
            bias,
            out,
            m * w.n,
            w.n,
            split,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            INTERPRET=_INTERPRET,
            num_warps=4,
        )
    return out.reshape(*lead, w.n)


def _variant(
    kernel,
    name: str,
    ptrs: dict[str, str | None],
    ints: tuple[str, ...],
    consts: dict,
    num_warps: int,
    num_stages: int = 1,
) -> AotVariant:
    """AotVariant with pointer args typed by `ptrs` (None: passed as None, a constexpr)."""
    sig = {a: ("*" + t if t else "constexpr") for a, t in ptrs.items()}
    sig.update({a: "i32" for a in ints}, **{a: "constexpr" for a in consts})
    consts = {**{a: None for a, t in ptrs.items() if t is None}, **consts, "INTERPRET": False}
    sig["INTERPRET"] = "constexpr"
    return AotVariant(kernel, sig, consts, {"num_warps": num_warps, "num_stages": num_stages}, name)


def aot_variants() -> list[AotVariant]:
    """Every DISPATCH row x {fp16, bf16} x {sym, asym} x {4, 8 bits}; the optional inputs (perm,
    gathered groups, bias), the split-K epilogue (always on the decode row) and block_k lowered
    to a 32-wide group are toggled across them so that each constexpr branch compiles."""
    out = []
    for row, (_, cfg) in enumerate(DISPATCH):
        for i, (dt, asym, bits) in enumerate(
            (d, a, b) for d in _X_DTYPES for a in (False, True) for b in (4, 8)
        ):
            perm, gather, bias = bool(i & 1), i in (2, 5), bool(i & 2)
            x = _TL_TYPES[dt]
            ptrs = {
                "qw_ptr": "i32",
                "s_ptr": x,
                "z_ptr": "i8" if asym else None,
                "perm_ptr": "i32" if perm else None,
                "gidx_ptr": "i32" if gather else None,
            }
            flags = dict(BITS=bits, HAS_ZP=asym, HAS_PERM=perm, GATHER=gather)
            name = (
                f"{x}_w{bits}_{'asym' if asym else 'sym'}{'_perm' if perm else ''}"
                f"{'_gather' if gather else ''}"
            )
            block_k, partial = (32 if i == 3 else cfg.block_k), row == 0 or i == 7
            if cfg.path == "dequant":
                out.append(
                    _variant(
                        _dequant_kernel,
                        f"dequant_k{block_k}_{name}",
                        {**ptrs, "out_ptr": x},
                        ("N", "K", "group_size"),
                        dict(**flags, BLOCK_N=cfg.block_n, BLOCK_K=block_k),
                        cfg.num_warps,
                        cfg.num_stages,
                    )
                )
                continue
            ptrs = {
                "x_ptr": x,
                **ptrs,
                "bias_ptr": x if bias else None,
                "out_ptr": "fp32" if partial else x,
            }
            consts = dict(
                **flags,
                HAS_BIAS=bias,
                PARTIAL=partial,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=block_k,
                GROUP_M=_GROUP_M,
            )
            out.append(
                _variant(
                    _w4a16_gemm_kernel,
                    f"gemm_{cfg.block_m}x{cfg.block_n}x{block_k}_{name}"
                    f"{'_split' if partial else ''}{'_bias' if bias else ''}",
                    ptrs,
                    ("M", "N", "K", "stride_xm", "group_size", "k_tiles_per_split"),
                    consts,
                    cfg.num_warps,
                    cfg.num_stages,
                )
            )
    for dt in _X_DTYPES:
        for bias in (False, True):
            x = _TL_TYPES[dt]
            out.append(
                _variant(
                    _splitk_reduce_kernel,
                    f"splitk_reduce_{x}{'_bias' * bias}",
                    {"part_ptr": "fp32", "bias_ptr": x if bias else None, "out_ptr": x},
                    ("MN", "N", "split"),
                    dict(HAS_BIAS=bias, BLOCK=_REDUCE_BLOCK),
                    4,
                )
            )
    return out
