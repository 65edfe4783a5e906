"""FP8 KV-cache scales: the arithmetic both the calibrating stage and every loader agree on.

The KV cache stores `k_fp8 = k / k_scale` in float8_e4m3fn, one static per-tensor scale for K and
one for V per attention layer, where K is the key *as cached*: after Qwen3's `k_norm` and after
RoPE (docs/architecture.md, "The artifact contract"). `scale = absmax / 448` puts the largest
calibration value at the top of e4m3's range; the `kv_cache` stage (compress/quant/kv_cache.py)
stores a scale between 2x and 4x that by default (headroom against clipping, and the rounding
grid's position searched), which every reader applies the same way. On disk the scales are the
attention module's `k_scale` / `v_scale` tensors (runtime/artifact/compressed_tensors.py writes them).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
# Floor of a scale: the smallest normal float16, so a scale stored in any model dtype is > 0.
_MIN_SCALE = torch.finfo(torch.float16).tiny
SUPPORTED_KV_DTYPES = ("fp8_e4m3",)


def fp8_e4m3_roundtrip(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """What reading back `x` from an fp8 e4m3 cache with `scale` gives, in x's dtype.

    x / scale is computed in float32, saturated to ±448 (e4m3fn has no infinity), rounded to
    nearest-even by torch's cast, and multiplied back by the scale.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def kv_scale_from_absmax(absmax: float) -> float:
    """Static per-tensor fp8 scale: absmax maps to 448; an all-zero tensor still gets a positive scale."""
    return max(absmax, _MIN_SCALE * FP8_E4M3_MAX) / FP8_E4M3_MAX
