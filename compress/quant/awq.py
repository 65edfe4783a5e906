"""AWQ (activation-aware weight quantization, Lin et al., 2024) as pure functions of tensors.

AWQ does not quantize: it finds a per-input-channel scale s that, applied as an equivalence
transform (`smoothing.apply_smooth_scale`), makes the *following* quantizer lose less on the
channels that carry large activations, and it clips weight outliers per (row, group) where that
lowers the error of the group's dot products. The quantizer used inside both searches is the
scheme's own round-to-nearest (`primitives.quantize_weight`), so the search optimizes for exactly
what `rtn` (or the grid of `gptq`) will do next.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from slimserve.compress.quant.primitives import quantize_weight
from slimserve.runtime.artifact.scheme import QuantArgs

# Floor of a candidate scale and the term that keeps 1 / w_mean finite (AutoAWQ's constants).
_MIN_SCALE = 1e-4
# Elements of the [rows, tokens, groups] product the clip search holds at once (256 MiB in fp32).
_CLIP_CHUNK_ELEMS = 2**26


def fake_quantize(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp32 [N, K]: `w` quantized with the scheme's min/max round-to-nearest and dequantized."""
    return quantize_weight(w.float(), args, scale_dtype or torch.float32).dequantize(torch.float32)


def weight_group_absmean(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[K] mean over rows of |w| normalized by its (row, group) max: AWQ's `w_mean`.

    w [N, K]; `group_size` None means one group per row.
    """
    n, k = w.shape
    g = group_size or k
    if k % g:
        raise ValueError(f"input size {k} is not a multiple of group_size={g}; "
                         "choose a group_size that divides every Linear's input size")
    wa = w.float().abs().reshape(n, k // g, g)
    wa = wa / wa.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return wa.reshape(n, k).mean(dim=0)


def candidate_scale(x_absmean: torch.Tensor, w_absmean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """[K] s = x^a / (w^(1-a) + 1e-4) (duo) or x^a (w_absmean None), floored and centred on 1."""
    s = x_absmean.float().pow(ratio)
    if w_absmean is not None:
        s = s / (w_absmean.float().pow(1.0 - ratio) + _MIN_SCALE)
    s = s.clamp(min=_MIN_SCALE)
    s = s / torch.sqrt(s.max() * s.min())  # geometric centre at 1: max * min = 1
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def awq_search_scale(
    x_absmean: torch.Tensor,
    w: torch.Tensor,
    forward_loss: Callable[[torch.Tensor], float],
    n_grid: int = 20,
    duo_scaling: bool = True,
    group_size: int | None = None,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search the migration ratio a over n_grid points of [0, 1] (both ends included).

    x_absmean [K]: mean |x| per input channel over the calibration tokens. w [N_total, K]: the
    mapping's Linears concatenated along rows (only used by duo scaling, grouped by `group_size`).
    `forward_loss(s)` returns the output error when the Linears' weights are replaced by
    Q(W * s) / s. Returns (best scale [K], best ratio, loss of every grid point); ties keep the
    smallest ratio.
    """
    if n_grid < 2:
        raise ValueError(f"n_grid={n_grid} is too small; use at least 2 grid points (20 is the default)")
    if x_absmean.dim() != 1 or w.dim() != 2 or w.shape[1] != x_absmean.numel():
        raise ValueError(f"x_absmean {tuple(x_absmean.shape)} and w {tuple(w.shape)} disagree; "
                         "pass x_absmean [K] and the concatenated weights [N, K]")
    w_absmean = weight_group_absmean(w, group_size) if duo_scaling else None
    best, best_ratio, best_loss, losses = None, 0.0, math.inf, []
    for i in range(n_grid):
        ratio = i / (n_grid - 1)
        s = candidate_scale(x_absmean, w_absmean, ratio)
        loss = float(forward_loss(s))
        losses.append(loss)
        if loss < best_loss:
            best, best_ratio, best_loss = s, ratio, loss
    if best is None:
        raise RuntimeError(f"AWQ scale search found no finite loss (losses {losses}); "
                           "the calibration activations contain inf/nan")
    return best, best_ratio, losses


@torch.no_grad()
def awq_clip_search(
    w: torch.Tensor,
    x_sample: torch.Tensor,
    args: QuantArgs,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per (row, group) clipping threshold max_val [N, G] minimizing the group dot-product error.

    w [N, K] weight, x_sample [T, K] input tokens (a few hundred suffice). For each shrink step
    i < n_grid * max_shrink, W is clamped to +-absmax * (1 - i / n_grid), fake-quantized with
    `args`, and the error mean_t (sum_{k in g} x_tk (w_nk - q_nk))^2 is measured per (n, g);
    the threshold with the smallest error wins (i = 0, no clipping, on ties).
    """
    n, k = w.shape
    g = args.group_size if args.strategy == "group" else k
    if k % g:
        raise ValueError(f"input size {k} is not a multiple of group_size={g}; "
                         "choose a group_size that divides every Linear's input size")
    if not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"max_shrink={max_shrink} must be in [0, 1); 0.5 is the reference value")
    groups = k // g
    xg = x_sample.float().reshape(-1, groups, g)  # [T, G, g]
    org_max = w.float().abs().reshape(n, groups, g).amax(dim=-1)  # [N, G]
    best_max = org_max.clone()
    rows = max(1, _CLIP_CHUNK_ELEMS // max(1, xg.shape[0] * groups))
    for r0 in range(0, n, rows):
        sl = slice(r0, min(n, r0 + rows))
        best_max[sl] = _clip_rows(w[sl].float(), xg, org_max[sl], args, n_grid, max_shrink, scale_dtype)
    return best_max


def _clip_rows(w: torch.Tensor, xg: torch.Tensor, org_max: torch.Tensor, args: QuantArgs,
               n_grid: int, max_shrink: float, scale_dtype: torch.dtype | None) -> torch.Tensor:
    """Clip search for a block of rows: w [n, K], xg [T, G, g], org_max [n, G] -> max_val [n, G]."""
    n, k = w.shape
    groups, g = xg.shape[1], xg.shape[2]
    ref = torch.einsum("tgc,ngc->ntg", xg, w.reshape(n, groups, g))  # [n, T, G] exact group outputs
    best_err = torch.full_like(org_max, math.inf)
    best_max = org_max.clone()
    for i in range(max(1, int(max_shrink * n_grid))):
        max_val = org_max * (1.0 - i / n_grid)  # [n, G]
        lim = max_val.repeat_interleave(g, dim=1)  # [n, K]
        q = fake_quantize(torch.clamp(w, -lim, lim), args, scale_dtype)
        out = torch.einsum("tgc,ngc->ntg", xg, q.reshape(n, groups, g))
        err = (out - ref).pow(2).mean(dim=1)  # [n, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max
