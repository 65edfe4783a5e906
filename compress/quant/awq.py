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
from collections.abc import Callable

import torch

from slimserve.compress.quant.primitives import qparams_from_range, quantize_weight
from slimserve.runtime.artifact.scheme import QuantArgs

# Floor of a candidate scale and the term that keeps 1 / w_mean finite (AutoAWQ's constants).
_MIN_SCALE = 1e-4
# Elements of the [steps, rows, K] tensors the clip search holds at once (64 MiB each in fp32).
_CLIP_CHUNK_ELEMS = 2**24


def fake_quantize(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fp32 [..., N, K]: `w` quantized with the scheme's min/max round-to-nearest and dequantized.

    Whole groups (every search here: the stage refuses partial ones) take a batched path over
    any leading dimensions that does exactly `primitives.quantize_weight`'s arithmetic (qparams
    from the same `qparams_from_range`, the same divide / add / clamp / round, then (q - zp) * s),
    so it is bit-identical to it; anything else goes through `quantize_weight` itself.
    """
    w = w.float()
    k = w.shape[-1]
    g = args.group_size if args.strategy == "group" else k
    sdt = scale_dtype or torch.float32
    if w.dim() < 2 or not g or k % g:
        flat = w.reshape(-1, k)
        return quantize_weight(flat, args, sdt).dequantize(torch.float32).reshape(w.shape)
    wg = w.reshape(*w.shape[:-1], k // g, g)  # [..., N, G, g]
    scale, zp = qparams_from_range(wg.amin(dim=-1), wg.amax(dim=-1), args, sdt)
    s = scale.float().unsqueeze(-1)
    x = wg / s
    if zp is not None:
        z = zp.float().unsqueeze(-1)
        x = x + z
    q = torch.round(torch.clamp(x, args.qmin, args.qmax))
    if zp is not None:
        q = q - z
    return (q * s).reshape(w.shape)


def weight_group_absmean(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[K] mean over rows of |w| normalized by its (row, group) max: AWQ's `w_mean`.

    w [N, K]; `group_size` None means one group per row.
    """
    n, k = w.shape
    g = group_size or k
    if k % g:
        raise ValueError(
            f"input size {k} is not a multiple of group_size={g}; "
            "choose a group_size that divides every Linear's input size"
        )
    wa = w.float().abs().reshape(n, k // g, g)
    wa = wa / wa.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return wa.reshape(n, k).mean(dim=0)


def candidate_scale(
    x_absmean: torch.Tensor, w_absmean: torch.Tensor | None, ratio: float
) -> torch.Tensor:
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
        raise ValueError(
            f"n_grid={n_grid} is too small; use at least 2 grid points (20 is the default)"
        )
    if x_absmean.dim() != 1 or w.dim() != 2 or w.shape[1] != x_absmean.numel():
        raise ValueError(
            f"x_absmean {tuple(x_absmean.shape)} and w {tuple(w.shape)} disagree; "
            "pass x_absmean [K] and the concatenated weights [N, K]"
        )
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
        raise RuntimeError(
            f"AWQ scale search found no finite loss (losses {losses}); "
            "the calibration activations contain inf/nan"
        )
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

    Vectorised: every shrink step is quantized in one batched call, and the error is taken
    through a per-group factor F_g of the inputs (F_g^T F_g = X_g^T X_g, from a QR of X_g when
    there are more tokens than group columns), so each step costs N * K * min(T, g) instead of
    N * T * K multiply-adds: mean_t (X_g d)_t^2 = |F_g d|^2 / T for d = w - q of one (row, group).
    """
    n, k = w.shape
    g = args.group_size if args.strategy == "group" else k
    if k % g:
        raise ValueError(
            f"input size {k} is not a multiple of group_size={g}; "
            "choose a group_size that divides every Linear's input size"
        )
    if not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"max_shrink={max_shrink} must be in [0, 1); 0.5 is the reference value")
    if x_sample.dim() != 2 or x_sample.shape[1] != k or x_sample.shape[0] == 0:
        raise ValueError(
            f"x_sample {tuple(x_sample.shape)} does not match w {tuple(w.shape)}; pass [T, K] tokens"
        )
    groups = k // g
    factor = group_input_factor(x_sample, g)  # [G, r, g]
    steps = max(1, int(max_shrink * n_grid))
    shrink = torch.tensor(
        [1.0 - i / n_grid for i in range(steps)], dtype=torch.float32, device=w.device
    )
    wg = w.float().reshape(n, groups, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, G]
    org_max = torch.maximum(lo.abs(), hi.abs())
    best_max = org_max.clone()
    rows = max(1, _CLIP_CHUNK_ELEMS // (steps * max(k, groups * factor.shape[1])))
    for r0 in range(0, n, rows):
        sl = slice(r0, min(n, r0 + rows))
        best_max[sl] = _clip_rows(
            wg[sl], factor, lo[sl], hi[sl], org_max[sl], shrink, args, scale_dtype
        )
    return best_max


def group_input_factor(x: torch.Tensor, g: int) -> torch.Tensor:
    """[G, r, g] per group of `g` input columns of x [T, K], with F^T F = X_g^T X_g and r = min(T, g).

    |F_g d|^2 = |X_g d|^2 for any d [g]: the squared outputs of a group summed over tokens,
    from r <= g rows instead of T. A QR's R (sums of squares, no cancellation) when T > g.
    """
    t, k = x.shape
    xg = x.float().reshape(t, k // g, g).transpose(0, 1)  # [G, T, g]
    if t <= g:
        return xg.contiguous()
    return torch.linalg.qr(xg, mode="r").R


def _clip_rows(
    wg: torch.Tensor,
    factor: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    org_max: torch.Tensor,
    shrink: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Clip search for a block of rows: wg [n, G, g], factor [G, r, g], lo/hi/org_max [n, G] -> max_val [n, G].

    Every step at once, laid out [G, S, n, g] so the error is one batched matmul per group. The
    quantizer is `fake_quantize`'s arithmetic on the clamped weights, done in place; the clamped
    groups' min/max are the clamped min/max (clamping is monotone), so no step reduces over them.
    """
    n, groups, g = wg.shape
    sdt = scale_dtype or torch.float32
    w_t = wg.transpose(0, 1).contiguous().unsqueeze(1)  # [G, 1, n, g]
    max_val = org_max.t().unsqueeze(1) * shrink.view(1, -1, 1)  # [G, S, n]
    scale, zp = qparams_from_range(
        torch.clamp(lo.t().unsqueeze(1), -max_val, max_val),
        torch.clamp(hi.t().unsqueeze(1), -max_val, max_val),
        args,
        sdt,
    )
    s = scale.float().unsqueeze(-1)  # [G, S, n, 1]
    lim = max_val.unsqueeze(-1)
    d = torch.empty(
        groups, max_val.shape[1], n, g, dtype=torch.float32, device=wg.device
    )  # [G, S, n, g]
    torch.clamp(w_t, -lim, lim, out=d).div_(s)
    if zp is not None:
        z = zp.float().unsqueeze(-1)
        d.add_(z)
    d.clamp_(args.qmin, args.qmax).round_()
    if zp is not None:
        d.sub_(z)
    d.mul_(s).sub_(w_t)  # dequantized minus original: the error of each weight
    steps = max_val.shape[1]
    out = torch.bmm(d.view(groups, steps * n, g), factor.transpose(1, 2))  # [G, S * n, r]
    # |F_g d|^2 = tokens * mean squared error
    err = out.square_().sum(dim=-1).view(groups, steps, n)
    err = torch.nan_to_num(err, nan=math.inf)
    best = err.argmin(dim=1, keepdim=True)  # the first (least clipping) of equal errors
    return max_val.gather(1, best).squeeze(1).t()
