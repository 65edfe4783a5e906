"""W8A8 QuantLinears on CPU through the int8 GEMM (kernels/cpu_quant_gemm.py) instead of a
dequantized float weight.

Before this, a W8A8 layer on CPU was dequantized at load and every forward fake-quantized its
input per token and ran a float GEMM: more work than a dense model. Now a layer whose weights are
int8 per-channel symmetric codes (compressed-tensors int-quantized, W8A8's format) keeps them
and runs: the input quantized per token (codes and scales of
`reference.quantize_per_token_int8`, bit for bit), an int32 GEMM (exact), then
acc * x_scale * w_scale (+ bias) in fp32, cast once to the input's dtype. That is
`reference.linear_w8a8`, the twin of the Triton W8A8 kernel, which is also what vLLM's int8
kernels compute.

Against the path it replaces: the same activation codes; the weight enters as codes times scale
exactly, where the dequantized weight was rounded to the checkpoint's dtype first (bf16 for most
artifacts: 2^-9 relative per weight), and the sums run in another order. Outputs agree to fp32
rounding for fp32 scales and to that weight rounding for bf16 ones
(tests/runtime/test_cpu_quant_linear.py).

Speed (eval/bench_cpu_quant_gemm.py, 2-core AVX2 EPYC without VNNI, one thread, measured on a
host shared with other jobs): 3.2-6.1x the path it replaces at one row (decoding; the weight
bytes are a quarter), 1.1-3.5x at 8 and 32 rows, 1.0-2.0x at 128 and 512 (parity, 0.98-0.99x,
for 576x576 at 128 and 512 rows and 192x576 at 512), so there is no row threshold. The kernel
compiles nothing per row count, so no row buckets (runtime/layers/cpu_linear.py needs them for
oneDNN). The layer holds its int8 buffers, a quarter of the fp32 weight it replaces; where the
packed VNNI GEMM runs (`cpu_quant_gemm.packed_available()`) it holds the codes a second time in
that layout (half the fp32 weight in all), and the kernel writes bf16 outputs itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve.kernels import cpu_quant_gemm

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)  # activations served; others keep the float path


@dataclass
class Int8Weight:
    """A W8A8 layer's run-time form: int8 codes [N, K], fp32 per-channel scales [N], bias, and
    the codes' row sums (int32 [N], the VNNI path's correction, summed once here)."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    row_sums: torch.Tensor
    # the codes again in the VNNI layout, where `cpu_quant_gemm.packed_available()` (None else)
    packed: cpu_quant_gemm.PackedWeight | None = None


def serves(
    scheme, ct_format: str, has_g_idx: bool, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether this path serves a layer: W8A8 (dynamic symmetric per-token int8 activations, int8
    per-channel symmetric weights, unpacked int-quantized codes) on CPU, in a dtype it takes, where
    the kernel builds and agrees with its twins (`cpu_quant_gemm.available`)."""
    w, acts = scheme.weights, scheme.input_activations
    return (
        acts is not None
        and ct_format == "int-quantized"
        and w.num_bits == 8
        and w.symmetric
        and w.strategy == "channel"
        and not has_g_idx
        and torch.device(device).type == "cpu"
        and dtype in COMPUTE_DTYPES
        and cpu_quant_gemm.available()
    )


def prepare(
    weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> Int8Weight:
    """The run-time form from a layer's CT buffers: int8 weight [N, K] (kept, not copied when
    contiguous), weight_scale [N, 1] in the checkpoint's dtype, bias [N] or None."""
    scale = weight_scale.detach().float().reshape(-1).contiguous()
    b = None if bias is None else bias.detach().float().contiguous()
    codes = weight.detach().contiguous()
    if cpu_quant_gemm.packed_available():
        packed = cpu_quant_gemm.pack(codes)
        return Int8Weight(codes, scale, b, packed.w_sum, packed)
    return Int8Weight(codes, scale, b, cpu_quant_gemm.weight_sums(codes))


def linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: `reference.linear_w8a8(x, codes, scale, bias)`."""
    k = w.codes.shape[1]
    flat = x.reshape(-1, k)
    q, scale = cpu_quant_gemm.quantize_per_token(flat, fp32_scale=True)
    n = w.codes.shape[0]
    if w.packed is not None:  # written in x's dtype by the kernel: no fp32 copy to cast
        out = cpu_quant_gemm.w8a8_gemm_packed(q, scale, w.packed, w.scale, w.bias, x.dtype)
        return out.reshape(*x.shape[:-1], n)
    out = cpu_quant_gemm.w8a8_gemm(q, scale, w.codes, w.scale, w.bias, w.row_sums)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
