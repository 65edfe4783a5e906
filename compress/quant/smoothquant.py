"""SmoothQuant's closed-form smoothing scale (Xiao et al., 2023), a pure function of tensors.

Per-token int8 activations lose the ordinary channels of a token whose few outlier channels set
its scale. Dividing channel j of the activation by s_j and multiplying column j of the weights
by s_j (an equivalence transform, `smoothing.apply_smooth_scale`) moves part of that range into
the weights, which are quantized per output channel and absorb it more easily. The migration
strength alpha in [0, 1] sets how much: 0 leaves activations alone, 1 flattens them completely.
"""

from __future__ import annotations

import torch

# Smallest scale (the reference's and llm-compressor's floor): keeps the division finite.
_MIN_SCALE = 1e-5


def smoothquant_scales(
    act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.8
) -> torch.Tensor:
    """s [K] with s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), floored at 1e-5.

    act_absmax [K]: max |x| of input channel j over every calibration token. weights: the
    [N_i, K] weights of every Linear reading that input (q/k/v together, gate/up together);
    max|W_j| is taken over all of their rows. A channel whose weight column is all zero uses the
    activation term alone (the weight term would divide by zero).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"alpha={alpha} is outside [0, 1]; use e.g. 0.5 (reference default) or 0.8-0.85 for Llama"
        )
    if not weights:
        raise ValueError("smoothquant_scales needs the weights of at least one Linear")
    k = act_absmax.numel()
    bad = [tuple(w.shape) for w in weights if w.dim() != 2 or w.shape[1] != k]
    if bad:
        raise ValueError(
            f"weights {bad} do not have {k} input columns like act_absmax; pass [N, K] weights"
        )
    w_absmax = torch.cat([w.float().abs() for w in weights], dim=0).amax(dim=0)  # [K]
    a = act_absmax.float().pow(alpha)
    s = torch.where(w_absmax > 0, a / w_absmax.pow(1.0 - alpha), a)
    return s.clamp(min=_MIN_SCALE)
