"""RMSNorm and fused residual-add + RMSNorm over the last dim, one row per program.

Twins: `reference.rms_norm`, `reference.fused_add_rms_norm`, which round as transformers' Llama
does: the residual sum is rounded to x's dtype (the unfused `hidden + residual`), the sum of
squares and the normalization run in fp32, the normalized row is rounded to x's dtype, then
multiplied by the weight (rounded to x's dtype) and rounded again. The product of two 8- or
11-bit-mantissa values is exact in fp32, so that last step is one rounding on both paths (for
fp32 x it is one fp32 multiply on both); the kernel differs from the twin only in the fp32
summation order of the mean square.

A row of hidden <= MAX_HIDDEN elements is one tile in registers (8192 bf16 at 16 warps: 16 fp32
values a thread): it is read once and written once, the memory-bound minimum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2
from slimserve.kernels._rounding import round_to

MAX_HIDDEN = 16384  # one row is one register tile; larger rows would spill
MIN_BLOCK = 256  # shorter rows still get a 256 tile (masked): fewer variants to compile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def launch_params(hidden: int) -> dict:
    """BLOCK and num_warps for rows of `hidden` elements: at most 16 elements a thread."""
    block = max(next_pow2(hidden), MIN_BLOCK)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8 if block <= 4096 else 16}


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H] fp16/bf16/fp32, last dim contiguous
    r_ptr,  # [T, H] residual in x's dtype (read only when HAS_RESIDUAL)
    w_ptr,  # [H] weight, fp16/bf16/fp32
    out_ptr,  # [T, H] x's dtype, contiguous
    res_out_ptr,  # [T, H] x + residual in x's dtype (written only when HAS_RESIDUAL)
    H,
    stride_x,
    stride_r,
    eps,  # fp32
    BLOCK: tl.constexpr,  # next_pow2(H)
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dt = out_ptr.dtype.element_ty
    # fp32 right after every load: the interpreter gets bf16 arithmetic wrong.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, dt)  # torch adds two halves in fp32 and rounds once, as here
        tl.store(res_out_ptr + row * H + cols, x.to(dt), mask=mask)
    sum_sq = tl.sum(x * x, axis=0)
    mean_sq = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + H)  # H may be a constexpr 1
    # 1 / sqrt with IEEE rounding, as torch.rsqrt on CPU; the GPU's rsqrt.approx is 2 ulp off.
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    normed = round_to(x * inv_rms, dt)
    w = round_to(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), dt)
    tl.store(out_ptr + row * H + cols, round_to(normed * w, dt).to(dt), mask=mask)


def _launch(x, residual, weight, eps, num_warps):
    check_tensor("x", x, dtypes=_DTYPES, last_contiguous=True)
    check(
        x.dim() >= 1 and x.shape[-1] > 0,
        lambda: f"x has shape {tuple(x.shape)}; it needs a non-empty last (hidden) dim",
    )
    hidden = x.shape[-1]
    check(
        hidden <= MAX_HIDDEN,
        lambda: (
            f"x has hidden size {hidden}; rms_norm supports up to "
            f"{MAX_HIDDEN} (one row per program)"
        ),
    )
    check_tensor("weight", weight, dtypes=_DTYPES, shape=(hidden,), device=x.device)
    check(weight.stride(0) == 1 or hidden == 1, "weight must be contiguous; call .contiguous()")
    check(isinstance(eps, (int, float)) and eps >= 0, lambda: f"eps={eps!r} must be a float >= 0")
    x2 = x.reshape(-1, hidden)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = r2 = None
    if residual is not None:
        check_tensor(
            "residual",
            residual,
            dtypes=(x.dtype,),
            shape=tuple(x.shape),
            device=x.device,
            last_contiguous=True,
        )
        r2 = residual.reshape(-1, hidden)
        res_out = torch.empty_like(out)
    if x2.shape[0]:
        params = launch_params(hidden)
        if num_warps is not None:
            params["num_warps"] = num_warps
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2 if r2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else out,
            hidden,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            **params,
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., H] (fp16/bf16/fp32) with weight [H] -> [..., H] in x's dtype."""
    return _launch(x, None, weight, eps, num_warps)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both [..., H] in x's dtype, in one pass.

    The inputs are not modified (vLLM's op of the same name works in place)."""
    return _launch(x, residual, weight, eps, num_warps)


def aot_variants() -> list[AotVariant]:
    """fp16/bf16 rows with a weight of the same dtype or fp32, fp32 rows with an fp32 weight, with
    and without the residual, at every tile size the launcher picks (MIN_BLOCK to MAX_HIDDEN)."""
    variants = []
    for dtype in _DTYPES:
        name = _TL[dtype]
        for wname in dict.fromkeys((name, "fp32")):
            sig = {
                "x_ptr": f"*{name}",
                "r_ptr": f"*{name}",
                "w_ptr": f"*{wname}",
                "out_ptr": f"*{name}",
                "res_out_ptr": f"*{name}",
                "H": "i32",
                "stride_x": "i32",
                "stride_r": "i32",
                "eps": "fp32",
                "BLOCK": "constexpr",
                "HAS_RESIDUAL": "constexpr",
            }
            for block in (256, 512, 1024, 2048, 4096, 8192, MAX_HIDDEN):
                params = launch_params(block)
                for res in (False, True):
                    variants.append(
                        AotVariant(
                            _rms_norm_kernel,
                            sig,
                            {"BLOCK": block, "HAS_RESIDUAL": res},
                            {"num_warps": params["num_warps"]},
                            name=f"rms_norm_{name}_w{wname}_b{block}_{'add' if res else 'plain'}",
                        )
                    )
    return variants
