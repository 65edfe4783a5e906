"""Dynamic symmetric per-token int8 activation quantization in one fused kernel.

Twin: `reference.quantize_per_token_int8`, matched bit for bit. Per row of x [M, K]:
absmax over K, scale = max(absmax / 127, fp32 eps) rounded to x's dtype, then
codes = round_half_even(clamp(x / scale, -128, 127)) with the fp32 value of the rounded scale.
Both divisions are IEEE round-to-nearest (`div_rn`); Triton's plain fp32 `/` is the approximate
`div.full.f32` on the GPU and would flip codes that sit on a rounding boundary.

One program per row. A row of up to MAX_ONE_PASS_K elements (8192: 16 KiB of bf16, 16 fp32
values a thread at 16 warps) is loaded once and kept in registers; a longer row is read twice
in BLOCK_K chunks (absmax pass, then quantize pass; the row, 32 KiB at K = 16384 in bf16, is
still in L2 for the second read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2
from slimserve.kernels._rounding import rint_small, round_to

_INT8_ACT_DIV = tl.constexpr(127.0)  # vLLM's per-token divisor (kernels/reference.py _INT8_ACT_DIV)
_EPS = tl.constexpr(1.1920928955078125e-07)  # torch.finfo(torch.float32).eps, smallest scale
MAX_ONE_PASS_K = 8192  # longest row kept in registers; longer rows loop in chunks of this size
MIN_BLOCK_K = 256  # shorter rows still get a 256 tile (masked): fewer variants to compile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _num_warps(block_k: int) -> int:
    """Warps for a row tile of block_k elements: at most 16 elements a thread."""
    return 4 if block_k <= 1024 else 8 if block_k <= 4096 else 16


def launch_params(k: int, block_k: int | None = None) -> dict:
    """The constexprs and num_warps the launcher uses for rows of k elements."""
    if block_k is None:
        block_k = min(max(next_pow2(k), MIN_BLOCK_K), MAX_ONE_PASS_K)
    check(
        block_k >= 16 and block_k == next_pow2(block_k),
        lambda: f"block_k={block_k} must be a power of two >= 16",
    )
    return {"BLOCK_K": block_k, "ONE_PASS": block_k >= k, "num_warps": _num_warps(block_k)}


@triton.jit
def _quantize_chunk(x, scale, q_row, cols, mask):
    """Store int8 codes of fp32 x [BLOCK_K] for one chunk of a row."""
    y = tl.math.div_rn(x, scale)
    y = rint_small(tl.minimum(tl.maximum(y, -128.0), 127.0))
    tl.store(q_row + cols, y.to(tl.int8), mask=mask)


@triton.jit
def _act_quant_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, last dim contiguous
    q_ptr,  # [M, K] int8, contiguous
    s_ptr,  # [M, 1] x's dtype, contiguous
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,  # power of two; >= K when ONE_PASS
    ONE_PASS: tl.constexpr,  # the whole row fits one BLOCK_K tile
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(x), axis=0)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = k0 + cols < K
            xc = tl.load(x_row + k0 + cols, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xc))
        absmax = tl.max(amax, axis=0)
    scale = tl.maximum(tl.math.div_rn(absmax, _INT8_ACT_DIV), _EPS)
    scale = round_to(scale, s_ptr.dtype.element_ty)  # the stored scale, as fp32
    tl.store(s_ptr + row, scale.to(s_ptr.dtype.element_ty))
    if ONE_PASS:
        _quantize_chunk(x, scale, q_row, cols, mask)
    else:
        for k0 in range(0, K, BLOCK_K):
            m = k0 + cols < K
            xc = tl.load(x_row + k0 + cols, mask=m, other=0.0).to(tl.float32)
            _quantize_chunk(xc, scale, q_row, k0 + cols, m)


def act_quant(
    x: torch.Tensor, *, block_k: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8: x [M, K] fp16/bf16/fp32 -> (codes int8 [M, K], scale [M, 1] in x's dtype).

    block_k: the row tile (power of two); default next_pow2(K) clamped to [MIN_BLOCK_K,
    MAX_ONE_PASS_K], so rows of up to 8192 are read once. A block_k < K loops over K.
    """
    check_tensor("x", x, dtypes=_DTYPES, ndim=2, last_contiguous=True)
    m, k = x.shape
    check(k > 0, lambda: f"x has shape {tuple(x.shape)}; K (the last dim) must be > 0")
    params = launch_params(k, block_k)
    if num_warps is not None:
        params["num_warps"] = num_warps
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=x.dtype, device=x.device)
    if m == 0:
        return q, scale
    _act_quant_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), **params)
    return q, scale


def aot_variants() -> list[AotVariant]:
    """Every (dtype, block, one-pass or chunked) combination the default launch can pick."""
    variants = []
    for _dtype, name in _TL.items():
        sig = {
            "x_ptr": f"*{name}",
            "q_ptr": "*i8",
            "s_ptr": f"*{name}",
            "K": "i32",
            "stride_xm": "i32",
            "stride_qm": "i32",
            "BLOCK_K": "constexpr",
            "ONE_PASS": "constexpr",
        }
        for block_k in (256, 512, 1024, 2048, 4096, MAX_ONE_PASS_K):
            for one_pass in (True, False) if block_k == MAX_ONE_PASS_K else (True,):
                variants.append(
                    AotVariant(
                        _act_quant_kernel,
                        sig,
                        {"BLOCK_K": block_k, "ONE_PASS": one_pass},
                        {"num_warps": _num_warps(block_k)},
                        name=f"act_quant_{name}_bk{block_k}_{'one' if one_pass else 'loop'}",
                    )
                )
    return variants
