"""Pure-torch twins of the GEMM, norm and activation kernels: the CPU path and the test oracle
(the KV-cache, RoPE and attention twins are in kernels/reference_attention.py).

Everything follows compressed-tensors' on-disk layout (docs/architecture.md, "The safetensors"):
codes are stored offset-binary, packed 32/b per int32 word along K with the lowest index in the
low bits; asymmetric zero points are packed the same way along N. Dequantization is done in fp32,
W[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)], and the caller casts once; since
|q - zp| < 2^8 and the scale has at most 11 significant bits, the fp32 product is exact and
the single cast matches the fake-quantized weight bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Dynamic per-token int8 activations: absmax / 127, the divisor of vLLM's scaled_int8_quant (CPU
# and GPU) and of the SmoothQuant paper, so a W8A8 artifact serves the same codes here and there.
# Weights keep compressed-tensors' symmetric divisor (qmax - qmin) / 2 = 127.5 (compress/quant/).
_INT8_ACT_DIV = 127.0
_EPS = torch.finfo(torch.float32).eps  # smallest scale, as in compressed-tensors


def _unpack(packed: torch.Tensor, num_bits: int, size: int) -> torch.Tensor:
    """int32 signed codes [R, size] from int32 words [R, W] packed along the last dim."""
    if 32 % num_bits:
        return _unpack_dense(packed, num_bits, size)
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * num_bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # arithmetic shift, masked
    return fields.reshape(packed.shape[0], -1)[:, :size] - (1 << (num_bits - 1))


def _unpack_dense(packed: torch.Tensor, num_bits: int, size: int) -> torch.Tensor:
    """Widths that do not divide 32 (3, 5, 6, 7): code i is bits [i*b, (i+1)*b) of the row's
    little-endian word stream and may straddle two words."""
    words = torch.cat(
        [packed.long() & 0xFFFFFFFF, torch.zeros_like(packed[:, :1], dtype=torch.long)], 1
    )
    start = torch.arange(size, device=packed.device) * num_bits
    w, off = start // 32, start % 32
    fields = ((words[:, w] >> off) | (words[:, w + 1] << (32 - off))) & ((1 << num_bits) - 1)
    return fields.to(torch.int32) - (1 << (num_bits - 1))


def unpack_int4_weight(weight_packed: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [N, size] signed codes in [-8, 7] from int32 [N, ceil(size/8)]."""
    return _unpack(weight_packed, 4, size)


def unpack_int8_weight(weight_packed: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [N, size] signed codes in [-128, 127] from int32 [N, ceil(size/4)]."""
    return _unpack(weight_packed, 8, size)


def unpack_zero_point(weight_zero_point: torch.Tensor, num_bits: int, rows: int) -> torch.Tensor:
    """int32 [N, G] signed zero points from int32 [ceil(N*b/32), G] packed along N."""
    return _unpack(weight_zero_point.t().contiguous(), num_bits, rows).t()


def _group_index(
    k: int, groups: int, g_idx: torch.Tensor | None, group_size: int | None, device: torch.device
) -> torch.Tensor:
    """int64 [K] scale column of each input column."""
    if g_idx is not None:
        return g_idx.long()
    if groups == 1:
        return torch.zeros(k, dtype=torch.long, device=device)
    if not group_size:
        raise ValueError(
            f"scales have {groups} groups but group_size={group_size}; pass the "
            "scheme's group_size or a weight_g_idx"
        )
    return torch.arange(k, device=device) // group_size


def dequantize_codes(
    codes: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    group_size: int | None,
) -> torch.Tensor:
    """fp32 [N, K] from signed codes [N, K], scale [N, G] (or [1]), signed zero point [N, G]."""
    k = codes.shape[1]
    scale = weight_scale.float().reshape(weight_scale.shape[0], -1)  # [N, G] or [1, 1]
    gidx = _group_index(k, scale.shape[1], weight_g_idx, group_size, codes.device)
    q = codes.float()
    if weight_zero_point is not None:
        q = q - weight_zero_point.float().reshape(scale.shape)[:, gidx]
    return q * scale[:, gidx]


def dequantize_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    weight_shape: torch.Tensor | tuple[int, int],
    num_bits: int,
    group_size: int | None,
) -> torch.Tensor:
    """fp32 [N, K] weight of a pack-quantized Linear (4 or 8 bits); the caller casts it."""
    n, k = (int(v) for v in weight_shape)
    codes = _unpack(weight_packed, num_bits, k)
    zp = (
        unpack_zero_point(weight_zero_point, num_bits, n) if weight_zero_point is not None else None
    )
    return dequantize_codes(codes, weight_scale, zp, weight_g_idx, group_size)


def linear_w4a16(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
    num_bits: int = 4,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W from packed codes (wNa16, N=4 or 8)."""
    w = dequantize_packed(
        weight_packed,
        weight_scale,
        weight_zero_point,
        weight_g_idx,
        weight_shape,
        num_bits,
        group_size,
    )
    return F.linear(x, w.to(x.dtype), bias)


def linear_dequant(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W from unpacked int8 codes [N, K]."""
    w = dequantize_codes(weight, weight_scale, weight_zero_point, weight_g_idx, group_size)
    return F.linear(x, w.to(x.dtype), bias)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per token: codes int8 [..., K] and scale [..., 1] in x's dtype.

    scale = absmax / 127 (vLLM's divisor, see _INT8_ACT_DIV), rounded to x's dtype before the
    codes are computed; codes = round(clamp(x / scale, -128, 127)).
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(absmax / _INT8_ACT_DIV, min=_EPS).to(x.dtype)
    q = torch.round(torch.clamp(xf / scale.float(), -128, 127)).to(torch.int8)
    return q, scale


def fake_quantize_per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per token and back, in x's dtype (what a W8A8 kernel sees)."""
    q, scale = quantize_per_token_int8(x)
    return (q.float() * scale.float()).to(x.dtype)


def w8a8_matmul_int32(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 [M, N] = a_q int8 [M, K] @ w_q int8 [N, K]^T (fp64 sums are exact: |sum| <
    K * 2^14 < 2^53)."""
    return (a_q.double() @ w_q.double().t()).to(torch.int32)


def w8a8_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[M, N] out_dtype = (int32 acc) * a_scale [M, 1] * w_scale [N, 1]^T (+ bias), fp32 epilogue."""
    acc = w8a8_matmul_int32(a_q, w_q).float()
    out = acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: dynamic per-token int8 activations times int8 [N, K] weights."""
    lead = x.shape[:-1]
    q, s = quantize_per_token_int8(x.reshape(-1, x.shape[-1]))
    return w8a8_gemm(q, s, weight, weight_scale, bias, x.dtype).reshape(*lead, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm exactly as transformers computes it: normalize in fp32, round to x's dtype,
    then multiply by the weight in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum is rounded to x's dtype first, as the
    unfused `residual = residual + hidden` of a transformers decoder layer does."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up with gate = x[..., :I], up = x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
