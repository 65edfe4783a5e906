"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized through the inverse Hessian of the layer's
squared output error. Pure functions of tensors; the `gptq` stage only collects H and wires.

Notation: W [N, K] (out, in), H [K, K] = (2 / tokens) * sum_x x x^T over calibration inputs.
The inverse is used through its upper Cholesky factor U (H^-1 = U^T U): quantizing column p
with error e = (w_p - q_p) / U[p, p] is compensated by W[:, p:] -= e U[p, p:] (the paper's
Algorithm 1).

Choices that differ from the reference implementations, and why:
* Group qparams are fitted when a group's first column is reached, on the *current* values of
  all its columns (every earlier column's update applied, including pending lazy block updates),
  so the result does not depend on `block_size` or on where groups fall inside a block.
* `actorder='static'`: columns are visited in order of descending diag(H), but groups stay the
  original contiguous column blocks (no g_idx at run time). Each block's qparams are fitted when
  the first of its columns is visited, on the updated weights (the reference's static_groups
  fits up front on the original W). One rule then serves every mode. On synthetic correlated
  Hessians (K=256, 4-bit, g=32/128, 4 seeds) the two choices are a wash: loss ratio
  updated/up-front 0.98-1.07, mean 1.02; either is 1.6-7x below natural-order GPTQ there.
* Dead inputs (diag(H) == 0) keep their weights (the reference zeroes them). The calibration
  loss is the same (those inputs were always 0), but a channel merely absent from calibration
  (e.g. a rarely used token's feature) still works at run time. Their H diagonal is set to the
  mean of the live diagonal, so they neither distort the dampening nor receive any update.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from slimserve.compress.quant.primitives import qparams_from_range
from slimserve.runtime.artifact.qweight import QuantizedWeight, num_groups
from slimserve.runtime.artifact.scheme import QuantArgs

# Dampening multipliers tried after the requested one fails (relative to max(damp, 1e-3)).
_DAMP_RETRIES = (10.0, 100.0)
# Largest K whose inverse-Hessian factor is computed in float64; wider inputs (an 8B model's
# down_proj, K = 14336) use float32 like the reference implementations.
FLOAT64_MAX_K = 8192
_TRIANGULAR_LEAF = 512  # blocks up to this size are inverted by one triangular solve


@dataclass(slots=True)
class GptqResult:
    qweight: QuantizedWeight  # quantized weight, columns in the original order
    loss: float  # output_loss(W, dequantized Q, H) against the undamped H
    # The paper's sum over columns of ||w' - q||^2 / U[p,p]^2, / N (w' = updated column). It equals
    # tr((W - Q) H_damped (W - Q)^T) / N exactly, which tests use to check the loop against Q.
    loop_loss: float
    damp: float  # dampening fraction of mean(diag(H)) actually used
    fallback: str | None  # why plain RTN (H = I) was used instead, or None


def accumulate_hessian(h: torch.Tensor, x: torch.Tensor, count: int) -> int:
    """Fold inputs x [..., K] into the running mean h [K, K] (fp32, in place); returns the new count.

    After all batches h = (2 / tokens) * sum x x^T, the Hessian of the mean squared output error.
    Any positive multiple of H gives the same GPTQ result (dampening is relative, updates use
    ratios of H^-1 entries); the running mean only keeps fp32 sums at the activations' scale.
    """
    x = x.reshape(-1, x.shape[-1]).to(h.dtype)  # [tokens, K]
    m = x.shape[0]
    if m == 0:
        return count
    total = count + m
    h.mul_(count / total)
    h.addmm_(x.t(), x, alpha=2.0 / total)
    return total


def output_loss(
    w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, max_rows: int | None = None
) -> float:
    """tr((W - W_hat) H (W - W_hat)^T) / N: the product in fp32, the sum in float64.

    With H from accumulate_hessian this is 2 x the mean squared error of the Linear's outputs on
    the calibration tokens (per output element), so GPTQ and RTN losses compare directly. Every
    row's term d H d^T is >= 0 (H is PSD), so nothing cancels and fp32's ~1e-6 relative rounding
    of the [N, K] x [K, K] product (a quarter of float64's cost) stays ~1e-6 in the result.
    With `max_rows` and N above it, the mean runs over every ceil(N / max_rows)-th row only (an
    estimate: the product costs 2 N K^2 flops, 11 s for a Llama-3-8B down_proj on 2 CPU cores).
    """
    d = w.float() - w_hat.float()  # [N, K]
    if max_rows is not None and d.shape[0] > max_rows:
        d = d[:: -(-d.shape[0] // max_rows)]
    dh = d @ h.float().to(d.device)
    return max(float((dh.double() * d.double()).sum() / d.shape[0]), 0.0)


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 in fp32, and the damp used.

    Retries with 10x and 100x more dampening; (None, last damp) when every attempt fails
    (H not finite or not positive semi-definite). Computed in float64 up to K = FLOAT64_MAX_K
    and in float32 above it (the factor is returned in fp32 either way; float64 took 67 s of a
    Llama-3-8B down_proj's 103 s GPTQ at K = 14336 on 2 CPU cores, float32 25 s), holding at
    most three [K, K] matrices at a time: each try builds its damped copy from the fp32 H.
    """
    if not torch.isfinite(h).all():  # LAPACK reads one triangle and would not notice
        return None, damp
    k = h.shape[0]
    dtype = torch.float64 if k <= FLOAT64_MAX_K else torch.float32
    mean_diag = torch.diagonal(h).double().mean()
    tries = [damp] + [max(damp, 1e-3) * f for f in _DAMP_RETRIES]
    for d in tries:
        # One Cholesky and one triangular inverse: with J the column reversal, J M J = L L^T
        # (L lower) gives M^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is upper triangular with a
        # positive diagonal, so it is U itself (no explicit inverse, no second Cholesky).
        m = h.to(dtype).flip(0, 1)  # J M J before dampening (J keeps the diagonal on the diagonal)
        m.diagonal().add_(float(d * mean_diag))
        lower, info = torch.linalg.cholesky_ex(m)
        del m
        if info.item() != 0:
            continue
        _invert_lower_(lower)
        u = lower.flip(0, 1)
        del lower
        if torch.isfinite(u).all():
            return u.float(), d
    return None, tries[-1]


def _invert_lower_(lower: torch.Tensor) -> None:
    """Replace a lower-triangular L [n, n] (zeros above the diagonal) by L^-1, in place.

    By halves, [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]: the off-diagonal blocks
    become matrix products, about half the flops of one triangular solve against I and faster per
    flop (2.0x on 2 CPU cores at K = 4096 in float32, 1.2x in float64), same accuracy.
    """
    n = lower.shape[0]
    if n <= _TRIANGULAR_LEAF:
        lower.copy_(
            torch.linalg.solve_triangular(
                lower, torch.eye(n, dtype=lower.dtype, device=lower.device), upper=False
            )
        )
        return
    half = n // 2
    a, b, c = lower[:half, :half], lower[half:, :half], lower[half:, half:]
    _invert_lower_(a)
    _invert_lower_(c)
    b.copy_(torch.mm(c, torch.mm(b, a)).neg_())


def _check_inputs(
    w: torch.Tensor, h: torch.Tensor, args: QuantArgs, block_size: int, damp: float
) -> None:
    if w.ndim != 2:
        raise ValueError(f"gptq: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    k = w.shape[1]
    if tuple(h.shape) != (k, k):
        raise ValueError(
            f"gptq: H must be [K, K] = [{k}, {k}] for a weight of shape "
            f"{tuple(w.shape)}, got {tuple(h.shape)}; collect H from this Linear's inputs"
        )
    if args.type != "int" or args.strategy not in ("group", "channel") or args.dynamic:
        raise ValueError(
            f"gptq quantizes static int weights per group or channel; got type={args.type!r}, "
            f"strategy={args.strategy!r}, dynamic={args.dynamic}; use an int scheme such as W4A16"
        )
    if block_size <= 0:
        raise ValueError(
            f"gptq: block_size={block_size} must be a positive number of columns, e.g. 128"
        )
    if damp < 0:
        raise ValueError(f"gptq: damp={damp} must be >= 0 (a fraction of mean(diag H), e.g. 0.01)")


def _prepare_hessian(h: torch.Tensor) -> torch.Tensor:
    """fp32 copy of H with dead inputs (zero diagonal) given the live mean diagonal, isolated."""
    h = h.float().clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    if dead.any():
        live = diag[~dead]
        h[dead, :] = 0
        h[:, dead] = 0
        fill = live.mean() if live.numel() else torch.tensor(1.0, device=h.device)
        diag[dead] = fill if fill > 0 else 1.0
    return h


def column_order(h: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """int64 [K] processing order: descending diag(H) with act-order (stable), else 0..K-1."""
    k = h.shape[0]
    if args.actorder is None:
        return torch.arange(k, device=h.device)
    return torch.argsort(torch.diagonal(h), descending=True, stable=True)


def group_of_position(perm: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """int64 [K]: the scale group used by the column visited at each processing position.

    channel: one group; no act-order or 'static': the original column's block perm[p] // g;
    'group': blocks of consecutive positions p // g (hence a non-monotonic g_idx on disk).
    """
    k = perm.numel()
    if args.strategy == "channel":
        return torch.zeros(k, dtype=torch.long, device=perm.device)
    if args.actorder == "group":
        return torch.arange(k, device=perm.device) // args.group_size
    return perm // args.group_size


@dataclass(slots=True)
class HessianFactor:
    """What GPTQ derives from H alone, shared by every Linear that reads the same input."""

    perm: torch.Tensor  # int64 [K] processing order (column_order)
    u: torch.Tensor  # [K, K] fp32 upper Cholesky factor of the damped H^-1, in processing order
    damp: float  # dampening fraction actually used
    fallback: str | None  # why H = I (plain RTN) is used instead, or None
    # float64 [K], processing order: what the factored matrix adds to diag(H) (the dampening, plus
    # the diagonal given to dead inputs); None when H = I replaced it (fallback).
    added_diag: torch.Tensor | None = None


def factor_hessian(h: torch.Tensor, args: QuantArgs, damp: float = 0.01) -> HessianFactor:
    """Column order and inverse-Hessian factor of H [K, K] (one Cholesky pass for all its readers)."""
    perm = column_order(h, args)  # [K]; dead inputs (diag 0) come last
    hp = _prepare_hessian(h)[perm][:, perm]  # [K, K] fp32, in processing order
    u, used = inverse_hessian_factor(hp, damp)
    if u is None:
        fallback = (
            f"Cholesky of H failed even with dampening {used:g} (H not finite or not PSD); "
            "quantized with round-to-nearest (H = I)"
        )
        return HessianFactor(perm, torch.eye(hp.shape[0], device=hp.device), used, fallback)
    diag = torch.diagonal(hp).double()
    added = diag - torch.diagonal(h)[perm].double() + used * diag.mean()
    return HessianFactor(perm, u, used, None, added)


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    damp: float = 0.01,
) -> GptqResult:
    """GPTQ of w [N, K] against H [K, K]; see the module docstring for the exact variant."""
    return gptq_shared([w], h, args, scale_dtype, block_size, damp)[0]


def gptq_shared(
    ws: list[torch.Tensor],
    h: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    damp: float = 0.01,
) -> list[GptqResult]:
    """GPTQ of several weights [N_i, K] that read the same input, so share H [K, K] (q/k/v, gate/up).

    H is factored once and one column loop runs over their stacked rows: GPTQ treats every output
    row independently given H (each row's error only moves that row's later columns, and a row's
    group scales depend on that row alone), so each result is `gptq(w_i, h)`'s, up to the fp32
    rounding of the lazy-update matmul, whose summation order may depend on the row count
    (tests/compress/test_gptq.py), at the cost of one loop instead of one per Linear.
    """
    for w in ws:
        _check_inputs(w, h, args, block_size, damp)
    if not ws:
        return []
    h = h.to(ws[0].device)
    f = factor_hessian(h, args, damp)
    gid = group_of_position(f.perm, args)
    rows = [w.shape[0] for w in ws]
    stacked = torch.cat([w.float() for w in ws]) if len(ws) > 1 else ws[0].float()
    codes, scale, zp, err_sq = _quantize_columns(
        stacked[:, f.perm], f.u, gid, args, scale_dtype, block_size
    )
    inv = torch.argsort(f.perm)
    g_idx = gid[inv].to(torch.int32) if args.actorder == "group" else None
    zps = zp.split(rows) if zp is not None else [None] * len(ws)
    out = []
    added = None if f.added_diag is None else f.added_diag[inv]  # original column order
    for w, c, s, z, e in zip(ws, codes.split(rows), scale.split(rows), zps, err_sq.split(rows)):
        qw = QuantizedWeight(
            codes=c[:, inv].contiguous(),
            scale=s.contiguous(),
            zero_point=None if z is None else z.contiguous(),
            g_idx=None if g_idx is None else g_idx.clone(),
            args=args,
        )
        loop_loss = float(e.sum()) / w.shape[0]
        if added is None:
            loss = output_loss(w, qw.dequantize(torch.float32), h)
        else:
            loss = _undamped_loss(loop_loss, w, qw, added)
        out.append(
            GptqResult(qweight=qw, loss=loss, loop_loss=loop_loss, damp=f.damp, fallback=f.fallback)
        )
    return out


def _undamped_loss(
    loop_loss: float, w: torch.Tensor, qw: QuantizedWeight, added: torch.Tensor
) -> float:
    """output_loss(W, Q, H) from the loop's own sum, without an [N, K] x [K, K] product.

    The loop's sum is tr(D H' D^T) / N with D = W - Q and H' = H + diag(added) (the matrix it
    factored), so tr(D H D^T) / N = loop_loss - sum_k added_k ||D[:, k]||^2 / N: O(N K) instead
    of the product's 2 N K^2 flops (12 s of a Llama-3-8B down_proj's GPTQ on 2 CPU cores). The
    dampening term is ~1% of the loop's sum, so the subtraction keeps ~1e-7 relative accuracy.
    """
    d = w.double() - qw.dequantize(torch.float32).double()
    return max(
        loop_loss - float((d.square().sum(dim=0) * added.to(d.device)).sum()) / w.shape[0], 0.0
    )


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    damp: float = 0.01,
) -> tuple[QuantizedWeight, float]:
    """(quantized weight, output_loss) of GPTQ; warns (RuntimeWarning) when it fell back to RTN."""
    res = gptq(w, h, args, scale_dtype, block_size, damp)
    if res.fallback:
        warnings.warn(f"gptq: {res.fallback}", RuntimeWarning, stacklevel=2)
    return res.qweight, res.loss


def _quantize_columns(
    w: torch.Tensor,
    u: torch.Tensor,
    gid: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The GPTQ loop in processing order on w [N, K] (updated in place) with factor u [K, K].

    Returns codes int8 [N, K] (processing order), scale [N, G] (scale_dtype), zero point int8
    [N, G] or None, and per row sum_p e_p^2 / U[p,p]^2 (float64 [N]). Groups are indexed by gid
    [K] (group of each processing position).
    """
    n, k = w.shape
    g = num_groups(k, args)
    codes = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, g, dtype=scale_dtype, device=w.device)
    zp = None if args.symmetric else torch.empty(n, g, dtype=torch.int8, device=w.device)
    # Rows of U over their diagonal: e U[p, :] with e = (w - q) / U[p, p] becomes (w - q) us[p, :].
    diag = torch.diagonal(u)  # [K]
    us = u / diag.unsqueeze(1)  # [K, K] upper, unit diagonal
    err_sq = torch.zeros(n, dtype=torch.float64, device=w.device)
    gid_list = gid.tolist()
    members = _members(gid, g)  # positions of each group, ascending
    first = [int(m[0]) if m.numel() else -1 for m in members]  # position that fits each group
    fitted: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # group -> fp32 scale, zp [N]
    qmin, qmax = float(args.qmin), float(args.qmax)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        # The block transposed, [B, N]: column p is the contiguous row p - i1, so each column's
        # few elementwise ops (the loop's whole cost at these sizes) run on contiguous memory.
        w1t = w[:, i1:i2].t().contiguous()  # block being quantized, updated within the block
        errt = torch.empty_like(w1t)  # rounding errors w - q of the block's columns
        qt = torch.empty_like(w1t)  # codes of the block's columns, as floats
        for p in range(i1, i2):
            j, c = gid_list[p], p - i1
            if first[j] == p:  # first column of group j: fit its qparams now
                cols = _current_columns(w, w1t, errt, us, i1, p, i2, members[j])
                s, z = qparams_from_range(cols.amin(dim=1), cols.amax(dim=1), args, scale_dtype)
                scale[:, j] = s
                if zp is not None:
                    zp[:, j] = z
                fitted[j] = (s.float(), None if z is None else z.float())
            x, q, e, (s, z) = w1t[c], qt[c], errt[c], fitted[j]
            # primitives.quantize's arithmetic: round(clamp(x / s + zp, qmin, qmax)).
            torch.div(x, s, out=q)
            if z is not None:
                q.add_(z)
            q.clamp_(qmin, qmax).round_()
            if z is None:
                torch.mul(q, s, out=e)
            else:
                torch.sub(q, z, out=e).mul_(s)
            torch.sub(x, e, out=e)  # e = x - dequantized q
            if c + 1 < i2 - i1:
                w1t[c + 1 :].addr_(us[p, p + 1 : i2], e, alpha=-1.0)
        codes[:, i1:i2] = qt.t()
        err = errt.t().contiguous()  # [N, B]
        # Lazy batch update of the columns after the block, in place (no [N, K - i2] temporary:
        # 2.2x faster than `-=` of the product at an 8B down_proj's size).
        w[:, i2:].addmm_(err, us[i1:i2, i2:], alpha=-1.0)
        err_sq += ((err.double() / diag[i1:i2].double()) ** 2).sum(dim=1)
    return codes, scale, zp, err_sq


def _members(gid: torch.Tensor, g: int) -> list[torch.Tensor]:
    """For each group, the ascending processing positions that read its scale."""
    order = torch.argsort(gid, stable=True)
    counts = torch.bincount(gid, minlength=g).tolist()
    return list(torch.split(order, counts))


def _current_columns(
    w: torch.Tensor,
    w1t: torch.Tensor,
    errt: torch.Tensor,
    us: torch.Tensor,
    i1: int,
    p: int,
    i2: int,
    pos: torch.Tensor,
) -> torch.Tensor:
    """[N, len(pos)] current values of the not-yet-quantized positions pos (all >= p).

    Inside the block they are in w1t (transposed); after it, w still lacks this block's pending
    update from the columns i1..p-1 (errt's first rows), which is applied here to a temporary.
    """
    inside, after = pos[pos < i2], pos[pos >= i2]
    parts = [w1t[inside - i1].t()]
    if after.numel():
        parts.append(w[:, after] - errt[: p - i1].t().contiguous() @ us[i1:p][:, after])
    return torch.cat(parts, dim=1)
