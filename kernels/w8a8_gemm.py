"""W8A8 GEMM: int8 activations [M, K] x int8 weights [N, K]^T with int32 tensor-core accumulation.

Twins: `reference.w8a8_matmul_int32` (out_dtype=torch.int32: the raw accumulators, exact) and
`reference.w8a8_gemm` (out = acc * a_scale[m] * w_scale[n] (+ bias[n]) in fp32, in that order,
then one cast). The kernel is compiled without FMA contraction (`enable_fp_fusion=False`), so
the fp32 epilogue performs the twin's IEEE operations in the twin's order: the scaled output
matches bit for bit (measured in the interpreter; the GPU path uses the same correctly rounded
cvt/mul/add). `linear_w8a8` = `act_quant` + this GEMM (twin `reference.linear_w8a8`).

Tiling: one program per [BLOCK_M, BLOCK_N] output tile, K walked in BLOCK_K steps (int8 dot needs
BLOCK_K >= 32 on the GPU); programs are grouped GROUP_M tiles down M so neighbours share the same
weight panel in L2. Row and column indices wrap modulo M and N, so the K-loop loads never need
M/N masks; only the store is masked. EVEN_K drops the K mask from the loop when K % BLOCK_K == 0.

Split-K (small M, decode): at M <= 16 a 4096-wide layer is only N / BLOCK_N tiles, fewer programs
than an H200 has SMs, so o_proj / down_proj would leave most SMs idle. The K loop is then cut into
`split` slices, one program per (tile, slice), each storing its raw int32 accumulators to a
[split, M, N] buffer; a second kernel adds the slices and applies the epilogue. Integer addition
is exact in any order, so the split result is bit for bit the unsplit one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2, split_k_slices
from slimserve.kernels._rounding import round_to
from slimserve.kernels.act_quant import act_quant

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)


@dataclass(frozen=True)
class W8A8Config:
    """One tile configuration of the GEMM kernel."""

    block_m: int  # rows of A (tokens) a program, power of two >= 16
    block_n: int  # rows of W (output channels) a program, power of two >= 16
    block_k: int  # K step of the int8 tl.dot, power of two >= 32
    group_m: int = 8  # M tiles grouped so consecutive programs reuse one weight panel from L2
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined K steps in shared memory
    split_k: int = 1  # K slices summed by a second pass; 0 = as many as fill the SMs, 1 = off


# Default configs for H200 (sm_90), keyed by M: the first row whose bound is >= M is used.
# Not yet measured on a GPU (none was lent when this was written): they are the usual starting
# points. Small M (decode) is weight-bandwidth bound: BLOCK_M 16 wastes no MMA rows, 64-wide N
# tiles give N/64 programs, deep 256-byte K steps keep bytes in flight. Large M is tensor-core
# bound: 128x128 tiles with 128-byte K steps (one full cache line a row). Shared memory is at
# most (BM + BN) * BK * num_stages bytes, 128 KiB for the largest row: under sm_80's 164 KiB and
# sm_90's 227 KiB (the AOT gate checks the compiler's figure). A benchmark retunes this table;
# nothing else chooses tiles.
CONFIGS: tuple[tuple[int, W8A8Config], ...] = (
    (16, W8A8Config(16, 64, 256, group_m=1, num_warps=4, num_stages=4, split_k=0)),
    (32, W8A8Config(32, 64, 256, group_m=1, num_warps=4, num_stages=4)),
    (64, W8A8Config(64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    (128, W8A8Config(64, 128, 128, group_m=8, num_warps=4, num_stages=4)),
    (1 << 62, W8A8Config(128, 128, 128, group_m=8, num_warps=8, num_stages=4)),
)


_REDUCE_BLOCK = 1024  # elements of [M, N] per program of the split-K reduction


def default_config(m: int) -> W8A8Config:
    """The CONFIGS row for M tokens."""
    return next(cfg for bound, cfg in CONFIGS if m <= bound)


def split_k(cfg: W8A8Config, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(slices, K tiles per slice) for this config and shape (kernels/_launch.py
    `split_k_slices`: config.split_k, or for 0 enough to fill the SMs)."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = split_k_slices(
        cfg.split_k, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), k_tiles, device
    )
    return split, triton.cdiv(k_tiles, split)


@triton.jit
def _epilogue(
    acc,
    c_ptr,
    as_ptr,
    ws_ptr,
    bias_ptr,
    offs_m,
    offs_n,
    rm,
    rn,
    M,
    N,
    stride_as,
    stride_ws,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Store acc (int32 [BM, BN]) scaled (acc * a_scale * w_scale (+ bias), one rounding) or raw."""
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SCALED:
        a_s = tl.load(as_ptr + rm * stride_as).to(tl.float32)
        w_s = tl.load(ws_ptr + rn * stride_ws).to(tl.float32)
        out = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        dt = c_ptr.dtype.element_ty
        tl.store(c_ptrs, round_to(out, dt).to(dt), mask=c_mask)
    else:
        tl.store(c_ptrs, acc, mask=c_mask)


# M and the split change with the step: not specialized on (one variant per config)
@triton.jit(do_not_specialize=["M", "k_tiles_per_split"])
def _w8a8_gemm_kernel(
    a_ptr,  # [M, K] int8 activation codes, last dim contiguous
    as_ptr,  # [M] per-token scales (fp16/bf16/fp32)
    w_ptr,  # [N, K] int8 weight codes, last dim contiguous
    ws_ptr,  # [N] per-channel scales (fp16/bf16/fp32)
    bias_ptr,  # [N] bias (read only when HAS_BIAS)
    c_ptr,  # [M, N] out_dtype (int32 accumulators when not SCALED), contiguous; PARTIAL: the
    # int32 [split, M, N] slices
    M,
    N,
    K,
    stride_am,
    stride_as,
    stride_wn,
    stride_ws,
    k_tiles_per_split,  # PARTIAL: BLOCK_K steps of this program's K slice (grid axis 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask in the loop
    SCALED: tl.constexpr,  # apply the scales (and bias) and store out_dtype; else store int32
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split-K: store this slice's raw accumulators at slice pid_k
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # wrapped rows: in-bounds loads, garbage rows never stored
    rn = (offs_n % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first, k_last = 0, k_tiles
    if PARTIAL:
        k_first = tl.program_id(1) * k_tiles_per_split
        k_last = tl.minimum(k_first + k_tiles_per_split, k_tiles)
    # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_first * BLOCK_K + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + (k_first * BLOCK_K + rk)[:, None]  # W^T tile

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(k_first, k_last):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0)
            w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if PARTIAL:
        part = c_ptr + tl.program_id(1).to(tl.int64) * M * N
        _epilogue(
            acc,
            part,
            as_ptr,
            ws_ptr,
            bias_ptr,
            offs_m,
            offs_n,
            rm,
            rn,
            M,
            N,
            stride_as,
            stride_ws,
            False,
            False,
        )
    else:
        _epilogue(
            acc,
            c_ptr,
            as_ptr,
            ws_ptr,
            bias_ptr,
            offs_m,
            offs_n,
            rm,
            rn,
            M,
            N,
            stride_as,
            stride_ws,
            SCALED,
            HAS_BIAS,
        )


@triton.jit(do_not_specialize=["M", "split"])
def _w8a8_splitk_reduce_kernel(
    part_ptr,
    as_ptr,
    ws_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    split,
    stride_as,
    stride_ws,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """c[M, N] = epilogue(sum over s of part[s, M, N]): int32 sums, so exact in any order.
    Grid: (cdiv(M * N, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for s in range(0, split):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0)
    rm, rn = offs // N, offs % N
    if SCALED:
        a_s = tl.load(as_ptr + rm * stride_as, mask=mask, other=0.0).to(tl.float32)
        w_s = tl.load(ws_ptr + rn * stride_ws, mask=mask, other=0.0).to(tl.float32)
        out = acc.to(tl.float32) * a_s * w_s
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
        dt = c_ptr.dtype.element_ty
        tl.store(c_ptr + offs, round_to(out, dt).to(dt), mask=mask)
    else:
        tl.store(c_ptr + offs, acc, mask=mask)


def _check_config(cfg: W8A8Config) -> None:
    for name, value, least in (
        ("block_m", cfg.block_m, 16),
        ("block_n", cfg.block_n, 16),
        ("block_k", cfg.block_k, 32),
    ):
        check(
            value >= least and value == next_pow2(value),
            lambda: f"config.{name}={value} must be a power of two >= {least} (tl.dot int8 tiles)",
        )
    check(cfg.group_m >= 1, lambda: f"config.group_m={cfg.group_m} must be >= 1")
    check(cfg.split_k >= 0, lambda: f"config.split_k={cfg.split_k} must be >= 0 (0: auto, 1: off)")


def _check_scale(name: str, s: torch.Tensor, rows: int, device: torch.device) -> None:
    check_tensor(name, s, dtypes=_SCALE_DTYPES, device=device)
    check(
        s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)),
        lambda: (
            f"{name} has shape {tuple(s.shape)}; expected [{rows}, 1] or [{rows}] (one "
            f"scale per "
            "row)"
        ),
    )


def w8a8_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: W8A8Config | None = None,
) -> torch.Tensor:
    """a_q int8 [M, K], a_scale [M, 1], w_q int8 [N, K], w_scale [N, 1] or [N], bias [N] ->
    [M, N] out_dtype (fp16/bf16/fp32 scaled, or int32 raw accumulators with scales ignored)."""
    check_tensor("a_q", a_q, dtypes=(torch.int8,), ndim=2, last_contiguous=True)
    dev = a_q.device
    check_tensor("w_q", w_q, dtypes=(torch.int8,), ndim=2, device=dev, last_contiguous=True)
    m, k = a_q.shape
    n = w_q.shape[0]
    check(
        w_q.shape[1] == k, lambda: f"w_q has shape {tuple(w_q.shape)}; expected [N, {k}] (K of a_q)"
    )
    check(
        out_dtype in _OUT_DTYPES,
        lambda: (
            f"out_dtype={out_dtype} must be one of torch.float16, "
            "torch.bfloat16, torch.float32, torch.int32"
        ),
    )
    _check_scale("a_scale", a_scale, m, dev)
    _check_scale("w_scale", w_scale, n, dev)
    if bias is not None:
        check(
            out_dtype != torch.int32,
            "bias is not applied to int32 accumulators; pass bias=None with out_dtype=torch.int32",
        )
        check_tensor("bias", bias, dtypes=_SCALE_DTYPES, shape=(n,), device=dev)
        check(bias.stride(0) == 1 or n == 1, "bias must be contiguous; call .contiguous()")
    cfg = config or default_config(m)
    _check_config(cfg)
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split, per = split_k(cfg, m, n, k, dev)
    bias_arg = bias if bias is not None else w_scale
    scaled = out_dtype != torch.int32
    target = torch.empty((split, m, n), dtype=torch.int32, device=dev) if split > 1 else out
    _w8a8_gemm_kernel[(tiles, split)](
        a_q,
        a_scale,
        w_q,
        w_scale,
        bias_arg,
        target,
        m,
        n,
        k,
        a_q.stride(0),
        a_scale.stride(0),
        w_q.stride(0),
        w_scale.stride(0),
        per,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0,
        SCALED=scaled,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )
    if split > 1:
        _w8a8_splitk_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            target,
            a_scale,
            w_scale,
            bias_arg,
            out,
            m,
            n,
            split,
            a_scale.stride(0),
            w_scale.stride(0),
            SCALED=scaled,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: W8A8Config | None = None,
) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 -> [..., N] in x's dtype: per-token int8 quantization of x, then
    the GEMM with int8 weight [N, K] and weight_scale [N, 1] or [N]."""
    check_tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check(x.dim() >= 1, "x must have at least one dim [..., K]")
    lead = x.shape[:-1]
    q, s = act_quant(x.reshape(-1, x.shape[-1]).contiguous())
    return w8a8_gemm(q, s, weight, weight_scale, bias, x.dtype, config=config).view(*lead, -1)


def aot_variants() -> list[AotVariant]:
    """Every CONFIGS row with: raw int32 (ragged K), bf16 + bias (even K), fp16 (ragged K), and
    fp32 with fp32 scales + bias (even K); both K branches and every epilogue per tile."""
    combos = [
        ("i32", "fp16", False, False),
        ("bf16", "bf16", True, True),
        ("fp16", "fp16", False, False),
        ("fp32", "fp32", True, True),
    ]
    variants = []
    for bound, cfg in CONFIGS:
        for out, sc, has_bias, even_k in combos:
            sig = {
                "a_ptr": "*i8",
                "as_ptr": f"*{sc}",
                "w_ptr": "*i8",
                "ws_ptr": f"*{sc}",
                "bias_ptr": f"*{sc}",
                "c_ptr": f"*{out}",
                "M": "i32",
                "N": "i32",
                "K": "i32",
                "stride_am": "i32",
                "stride_as": "i32",
                "stride_wn": "i32",
                "stride_ws": "i32",
                "BLOCK_M": "constexpr",
                "BLOCK_N": "constexpr",
                "BLOCK_K": "constexpr",
                "GROUP_M": "constexpr",
                "EVEN_K": "constexpr",
                "SCALED": "constexpr",
                "HAS_BIAS": "constexpr",
            }
            const = {
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k,
                "GROUP_M": cfg.group_m,
                "EVEN_K": even_k,
                "SCALED": out != "i32",
                "HAS_BIAS": has_bias,
            }
            opts = {
                "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages,
                "enable_fp_fusion": False,
            }
            for partial in (False, True) if cfg.split_k != 1 else (False,):
                variants.append(
                    AotVariant(
                        _w8a8_gemm_kernel,
                        dict(sig, k_tiles_per_split="i32", PARTIAL="constexpr"),
                        dict(const, PARTIAL=partial),
                        opts,
                        name=f"w8a8_m{bound}_{out}_{sc}{'_bias' if has_bias else ''}"
                        f"_{'even' if even_k else 'ragged'}k{'_partial' if partial else ''}",
                    )
                )
    for out, sc, has_bias in (
        ("i32", "fp16", False),
        ("bf16", "bf16", True),
        ("fp16", "fp16", False),
        ("fp32", "fp32", True),
    ):
        sig = {
            "part_ptr": "*i32",
            "as_ptr": f"*{sc}",
            "ws_ptr": f"*{sc}",
            "bias_ptr": f"*{sc}",
            "c_ptr": f"*{out}",
            "M": "i32",
            "N": "i32",
            "split": "i32",
            "stride_as": "i32",
            "stride_ws": "i32",
            "SCALED": "constexpr",
            "HAS_BIAS": "constexpr",
            "BLOCK": "constexpr",
        }
        variants.append(
            AotVariant(
                _w8a8_splitk_reduce_kernel,
                sig,
                {"SCALED": out != "i32", "HAS_BIAS": has_bias, "BLOCK": _REDUCE_BLOCK},
                {"num_warps": 4, "enable_fp_fusion": False},
                name=f"w8a8_splitk_reduce_{out}_{sc}{'_bias' if has_bias else ''}",
            )
        )
    return variants
