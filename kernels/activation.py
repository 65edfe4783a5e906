"""SiLU-and-multiply of a fused gate/up projection: [..., 2I] -> [..., I].

Twin: `reference.silu_and_mul` = `F.silu(gate) * up` in x's dtype, i.e. silu computed in fp32
and rounded to x's dtype, then the product rounded again (a product of two 8- or 11-bit-mantissa
values is exact in fp32, so it is one rounding on both paths; fp32 x: one fp32 multiply on both).
The kernel differs from the twin only in the fp32 exp (the GPU's ex2.approx is a few fp32 ulp
off): at most one fp16/bf16 ulp on silu.

Grid: (rows, cdiv(I, BLOCK)); each program streams BLOCK gate and BLOCK up values and writes
BLOCK outputs: 6 bytes an output in bf16, memory bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2
from slimserve.kernels._rounding import round_to

BLOCK_DEFAULT = 1024  # outputs a program: 8 a thread at 4 warps (16-byte bf16 vectors)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def launch_block(inter: int) -> int:
    """Outputs a program for rows of `inter` outputs: BLOCK_DEFAULT, or 256/512 for short rows."""
    return min(BLOCK_DEFAULT, max(next_pow2(inter), 256))


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I] fp16/bf16/fp32, last dim contiguous: gate = x[:, :I], up = x[:, I:]
    out_ptr,  # [T, I] x's dtype, contiguous
    I,  # noqa: E741 (the intermediate size, as in the docstring's [T, 2I])
    stride_x,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g / (1 + exp(-g)), as torch computes it; IEEE division keeps it close.
    silu = round_to(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), dt)
    tl.store(out_ptr + row * I + cols, round_to(silu * up, dt).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [..., 2I] fp16/bf16/fp32 -> silu(x[..., :I]) * x[..., I:] as [..., I] in x's dtype."""
    check_tensor("x", x, dtypes=_DTYPES, last_contiguous=True)
    check(
        x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0,
        lambda: (
            f"x has shape {tuple(x.shape)}; its last dim must be 2 * intermediate_size (even, > 0)"
        ),
    )
    inter = x.shape[-1] // 2
    block = block or launch_block(inter)
    check(block == next_pow2(block), lambda: f"block={block} must be a power of two")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), BLOCK=block, num_warps=num_warps)
    return out.view(*x.shape[:-1], inter)


def aot_variants() -> list[AotVariant]:
    """fp16, bf16 and fp32 at every tile the launcher picks: 256 and 512 (I < 512, < 1024), 1024."""
    variants = []
    for _dtype, name in _TL.items():
        sig = {
            "x_ptr": f"*{name}",
            "out_ptr": f"*{name}",
            "I": "i32",
            "stride_x": "i32",
            "BLOCK": "constexpr",
        }
        for block in (256, 512, BLOCK_DEFAULT):
            variants.append(
                AotVariant(
                    _silu_and_mul_kernel,
                    sig,
                    {"BLOCK": block},
                    {"num_warps": 4},
                    name=f"silu_and_mul_{name}_b{block}",
                )
            )
    return variants
