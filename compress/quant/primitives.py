"""Quantization arithmetic shared by every quantizer, in compressed-tensors' conventions.

Codes are signed (int4 runs -8..7); the observed range is extended to include 0; symmetric
scale = absmax / ((qmax - qmin) / 2) (absmax/7.5 for int4); asymmetric scale = range / (2^b - 1)
with a signed zero point. Scales are rounded to their storage dtype (the model dtype) *before*
codes are computed, so what a loader dequantizes from disk is bit-identical to our fake-quant.
"""

from __future__ import annotations

import torch

from slimserve.runtime.artifact.qweight import QuantizedWeight, group_index, num_groups
from slimserve.runtime.artifact.scheme import QuantArgs

# Smallest scale, as in compressed-tensors (fp32 machine epsilon).
_MIN_SCALE = torch.finfo(torch.float32).eps


def compute_qparams(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype, g_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scale and zero point per (row, group) of `w` [N, K].

    Returns scale [N, G] rounded to `scale_dtype` and zero point int8 [N, G] (None if symmetric).
    """
    wf = w.float()
    n, k = wf.shape
    gi = group_index(k, args, g_idx)
    g = num_groups(k, args) if g_idx is None else int(gi.max()) + 1
    idx = gi.unsqueeze(0).expand(n, k)
    big = torch.finfo(torch.float32).max
    lo = torch.full((n, g), big).scatter_reduce(1, idx, wf, "amin", include_self=True)
    hi = torch.full((n, g), -big).scatter_reduce(1, idx, wf, "amax", include_self=True)
    return qparams_from_range(lo, hi, args, scale_dtype)


def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (rounded to `scale_dtype`) and int8 zero point from observed min/max tensors."""
    lo = torch.clamp(lo, max=0.0)  # the range always contains 0 (exact zero is representable)
    hi = torch.clamp(hi, min=0.0)
    if args.symmetric:
        absmax = torch.maximum(lo.abs(), hi)
        scale = absmax / ((args.qmax - args.qmin) / 2)
        scale = torch.clamp(scale, min=_MIN_SCALE).to(scale_dtype)
        return scale, None
    scale = torch.clamp((hi - lo) / (args.qmax - args.qmin), min=_MIN_SCALE).to(scale_dtype)
    zp = torch.round(args.qmin - lo / scale.float()).clamp(args.qmin, args.qmax)
    return scale, zp.to(torch.int8)


def quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    gidx: torch.Tensor,
) -> torch.Tensor:
    """int8 codes [N, K] = round(clamp(w / scale + zp, qmin, qmax)); gidx int64 [K]."""
    s = scale.float()[:, gidx]
    x = w.float() / s
    if zero_point is not None:
        x = x + zero_point.float()[:, gidx]
    return torch.round(torch.clamp(x, args.qmin, args.qmax)).to(torch.int8)


def quantize_weight(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Round-to-nearest quantization of a [N, K] weight with min/max qparams."""
    scale_dtype = scale_dtype or (w.dtype if w.dtype.is_floating_point else torch.bfloat16)
    scale, zp = compute_qparams(w, args, scale_dtype)
    codes = quantize(w, scale, zp, args, group_index(w.shape[1], args))
    return QuantizedWeight(codes=codes, scale=scale, zero_point=zp, g_idx=None, args=args)
