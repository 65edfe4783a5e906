"""Rounding helpers for the Triton kernels: the same bits on the GPU and in the interpreter.

The interpreter casts fp32 -> bf16 by truncation (measured on triton 3.9: 1.1999 -> 1.1875, torch
and the GPU give 1.1953), so a kernel that stores bf16 rounds with `round_to` first; the value it
returns is exactly representable, so the final cast is exact on both paths.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 `x` rounded to nearest-even in DTYPE (bf16, fp16 or fp32), returned as fp32."""
    if DTYPE == tl.bfloat16:
        # Add 0x7FFF plus the kept lsb to the fp32 bits, then drop the low 16: round half to
        # even on the 8-bit bf16 mantissa; a carry moves into the exponent as it should
        # (overflow becomes inf, as torch's cast does).
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def rint_small(x):
    """fp32 round half to even for |x| <= 2^22: adding 1.5 * 2^23 puts the value in
    [2^23, 2^24), where the fp32 ulp is 1, so the add itself rounds (torch.round semantics)."""
    return (x + 12582912.0) - 12582912.0
