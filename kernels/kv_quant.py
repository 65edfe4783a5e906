"""INT8 and INT4 KV caches: the row layout and its pure-torch quantize / dequantize twins.

Scales are computed online, for each token and each KV head, from that row's own minimum and
maximum (asymmetric): no calibration. A cache is uint8 [num_blocks, block_size, kv_heads,
row_bytes]; one row is one KV head of one token:

    codes (head_dim bytes for int8; head_dim / 2 for int4, element 2j in the low nibble of byte
    j and 2j + 1 in the high one) | scale fp16 | zero fp16 (little-endian, 2 bytes each)

so a block carries its own scales and every path that moves blocks as raw bytes (prefix caching,
preemption, the prefill/decode hand-over, tensor parallel's per-rank heads) moves them unchanged.
A value reads back as `code * scale + zero` (fp32). At write time:

    scale = fp16((max - min) / qmax), zero = fp16(min), qmax = 255 (int8) or 15 (int4)
    code  = clamp(round_half_even((x - zero) / scale), 0, qmax) with the fp16 scale and zero
            read back to fp32 (code 0 when the scale is 0: a constant row reads back as zero)

so the codes are chosen against the stored scale and zero. The read-back error of x is at most
scale / 2 plus what rounding min to fp16 moved the grid, |min| x 2^-11, and the clamp of the top
code (scale's own fp16 rounding, qmax x scale x 2^-11): `max_error` gives that bound per row.
Values beyond fp16's range (|x| > 65504) cannot be stored. The C kernels (kernels/cpu_layer_ops.c,
kernels/cpu_attention.c) and the Triton kernels (kernels/kv_cache.py, kernels/rope_kv_cache.py,
kernels/paged_attention.py) follow this file bit for bit where they write codes.
"""

from __future__ import annotations

import torch

KV_QUANT_BITS = (8, 4)
SCALE_BYTES = 4  # fp16 scale + fp16 zero after the codes of a row
_FP16_HALF_ULP = 2.0**-11  # relative rounding of fp32 -> fp16 (nearest)


def qmax(bits: int) -> int:
    return (1 << bits) - 1


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of a row's codes: head_dim (int8) or head_dim / 2 (int4, which needs it even)."""
    if bits == 8:
        return head_dim
    if bits == 4:
        if head_dim % 2:
            raise ValueError(
                f"kv_cache_dtype int4: head_dim {head_dim} is odd and int4 packs two codes per "
                "byte; use --kv-cache-dtype int8 for this model"
            )
        return head_dim // 2
    raise ValueError(f"KV cache bits {bits} are not supported; use 8 or 4")


def row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one row (one token, one KV head): its codes, then scale and zero as fp16."""
    return code_bytes(head_dim, bits) + SCALE_BYTES


def cache_bits(cache: torch.Tensor, head_dim: int) -> int:
    """0 for a float cache; 8 or 4 for a uint8 cache whose rows are `row_bytes` of that many bits
    (a ValueError names a uint8 cache of neither width)."""
    if cache.dtype != torch.uint8:
        return 0
    width = cache.shape[-1]
    if width == head_dim + SCALE_BYTES:
        return 8
    if head_dim % 2 == 0 and width == head_dim // 2 + SCALE_BYTES:
        return 4
    raise ValueError(
        f"a uint8 KV cache of rows of {width} bytes is neither int8 ({head_dim + SCALE_BYTES}) "
        f"nor int4 ({head_dim // 2 + SCALE_BYTES}) for head_dim {head_dim}"
    )


def quantize_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 rows [..., row_bytes] of x [..., head_dim] (any float dtype; the min/max and the
    codes are computed in fp32 from x as it is)."""
    d = x.shape[-1]
    q = qmax(bits)
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((hi - lo) / q).half()
    zero = lo.half()
    sf, zf = scale.float(), zero.float()
    codes = torch.where(sf > 0, ((xf - zf) / sf).round().clamp(0, q), 0).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    side = torch.cat([scale, zero], -1).contiguous().view(torch.uint8)  # [..., 4]
    out = torch.empty(
        *x.shape[:-1], code_bytes(d, bits) + SCALE_BYTES, dtype=torch.uint8, device=x.device
    )
    out[..., :-SCALE_BYTES] = codes
    out[..., -SCALE_BYTES:] = side
    return out


def row_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale, zero) [..., 1] of uint8 rows [..., row_bytes]."""
    side = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return side[..., :1], side[..., 1:]


def dequantize_rows(rows: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """fp32 [..., head_dim] of uint8 rows [..., row_bytes]: code * scale + zero."""
    codes = rows[..., : code_bytes(head_dim, bits)]
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    scale, zero = row_scales(rows)
    return codes.float() * scale + zero


def max_error(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Upper bound [..., 1] of |dequantize(quantize(x)) - x| per row of x [..., head_dim]: half
    a step, plus the grid's shift by the fp16 rounding of min and of the scale (module doc),
    plus fp32 rounding of the read-back; the tests' tolerances derive from it."""
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    step = (hi - lo) / qmax(bits) * (1 + _FP16_HALF_ULP)
    shift = (lo.abs() + (hi - lo)) * _FP16_HALF_ULP
    fp32 = (lo.abs() + hi.abs()) * 2.0**-22
    subnormal = (qmax(bits) + 1) * 2.0**-25  # fp16's absolute rounding below 2^-14
    return step / 2 + shift + fp32 + subnormal
