"""kernel_bench's W4A16 section: int4 weight-only GEMM and dequant checks against the fp32 product
of the same rounded operands, timings against cuBLAS fp16, and the tile sweep that suggests a
DISPATCH table for kernels/w4a16_gemm.py."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from slimserve.eval.kernels.common import (
    BF16,
    DT,
    F16,
    Ctx,
    fmt,
    gen,
    memo,
    print_table,
    randn,
    run_check,
)
from slimserve.eval.kernels.sweep import cfg_repr, report_sweep
from slimserve.kernels import reference as R  # pure torch: no @triton.jit


def make_w4_ct(n, k, group, dtype, dev, *, asym=False, actorder=None, seed=0) -> dict:
    """Random compressed-tensors pack-quantized tensors: every int32 word is a valid pack of 8
    codes, scales ~ 2^-6; actorder "regular" (GPTQ: a permutation of k // group) or
    "irregular" (any group per column)."""
    g = gen(dev, seed)
    groups = -(-k // group)
    packed = torch.randint(
        -(2**31), 2**31 - 1, (n, -(-k // 8)), generator=g, device=dev, dtype=torch.int32
    )
    scale = ((torch.rand(n, groups, generator=g, device=dev) + 0.5) / 64).to(dtype)
    zp = (
        torch.randint(
            -(2**31), 2**31 - 1, (-(-n // 8), groups), generator=g, device=dev, dtype=torch.int32
        )
        if asym
        else None
    )
    g_idx = None
    if actorder == "regular":
        g_idx = (torch.arange(k, device=dev) // group)[torch.randperm(k, generator=g, device=dev)]
    elif actorder == "irregular":
        g_idx = torch.randint(0, groups, (k,), generator=g, device=dev)
    return dict(
        weight_packed=packed,
        weight_scale=scale,
        weight_zero_point=zp,
        weight_g_idx=None if g_idx is None else g_idx.to(torch.int32),
        weight_shape=(n, k),
        group_size=group,
    )


def _w4_dequant_ref(ct: dict) -> torch.Tensor:
    return R.dequantize_packed(
        ct["weight_packed"],
        ct["weight_scale"],
        ct["weight_zero_point"],
        ct["weight_g_idx"],
        ct["weight_shape"],
        4,
        ct["group_size"],
    )


def w4_error(y, x, w, bias=None):
    """(ok, max err, note) of y against the fp32 product of the same rounded x and w [N, K]:
    fp32 sums in another order (2 K 2^-24 sum|x||w|) plus one rounding to x's dtype (u |y|),
    the bound of tests/kernels/test_w4a16_gemm.py."""
    xf = x.float().reshape(-1, x.shape[-1])
    ref = xf @ w.float().t() + (bias.float() if bias is not None else 0.0)
    u = 2.0**-8 if x.dtype == BF16 else 2.0**-11
    bound = u * ref.abs() + 2 * x.shape[-1] * 2.0**-24 * (xf.abs() @ w.float().abs().t())
    err = (y.float().reshape(ref.shape) - ref).abs()
    ratio = (err / (bound + 2.0**-24)).max().item()
    return y.dtype == x.dtype and ratio <= 1.0, err.max().item(), f"{ratio:.2f} of bound"


def checks_w4a16(ctx: Ctx) -> None:
    from slimserve.kernels import w4a16_gemm as W

    p, dev = ctx.plan, ctx.dev
    (n, k), ms = p.w4_sym
    (vn, vk), vms = p.w4_var
    cases = [
        ("sym", n, k, F16, {}, ms),
        ("sym", n, k, BF16, {}, ms),
        ("asym", vn, vk, F16, dict(asym=True), vms),
        ("asym", vn, vk, BF16, dict(asym=True), vms[:1]),
        ("act-order", vn, vk, F16, dict(actorder="regular"), vms),
        ("act-order irregular", vn, vk, BF16, dict(actorder="irregular"), vms[:1]),
    ]
    if p.name == "full":
        cases.append(("sym", k, n, F16, {}, (7,)))  # (11008, 4096): the other orientation
    for i, (label, cn, ck, dt, kw, cms) in enumerate(cases):
        ct_w = memo(
            lambda cn=cn, ck=ck, dt=dt, kw=kw, i=i: _prepare_w4(W, cn, ck, p.group, dt, dev, kw, i)
        )
        for m in cms:

            def check(m=m, ct_w=ct_w, dt=dt, ck=ck, cn=cn):
                ct, w, wq = ct_w()
                x = randn((m, ck), dev, dt, seed=m)
                bias = randn((cn,), dev, dt, seed=7) if m % 2 else None  # odd M: with a bias
                return w4_error(W.w4a16_gemm(x, w, bias), x, wq, bias)

            path = W.select_config(m).path
            run_check(ctx, "w4a16_gemm", f"{label} {DT[dt]} M={m} N={cn} K={ck} ({path})", check)
        if label in ("sym", "act-order") or "irregular" in label:

            def exact(ct_w=ct_w, dt=dt):
                ct, w, wq = ct_w()
                got = W.dequantize_w4a16(w, dt)
                bad = (got != wq).sum().item()
                return bad == 0 and got.dtype == dt, float(bad), "mismatched elements"

            run_check(ctx, "dequantize_w4a16", f"{label} {DT[dt]} N={cn} K={ck} (bit exact)", exact)
        ctx.save()


def _prepare_w4(W, n, k, group, dtype, dev, kw, seed):
    ct = make_w4_ct(n, k, group, dtype, dev, seed=seed, **kw)
    return ct, W.prepare_w4a16(**ct, num_bits=4), _w4_dequant_ref(ct).to(dtype)


def w4_candidates(W, m: int, limit: int) -> list:
    """The DISPATCH choice for M, tile variants for M's size class, and the dequant path."""
    C = W.W4A16Config
    if m <= 16:
        grid = [
            C("gemm", 16, 32, 128, 0, 4, 4),
            C("gemm", 16, 128, 128, 0, 4, 4),
            C("gemm", 16, 64, 64, 0, 4, 4),
            C("gemm", 16, 128, 64, 0, 4, 4),
            C("gemm", 16, 64, 128, 8, 4, 4),
            C("gemm", 16, 64, 128, 1, 4, 4),
        ]
    elif m <= 64:
        grid = [
            C("gemm", 32, 64, 128, 0, 4, 4),
            C("gemm", 64, 64, 128, 0, 4, 4),
            C("gemm", 64, 128, 64, 0, 4, 4),
            C("gemm", 64, 128, 128, 0, 8, 3),
            C("gemm", 16, 64, 128, 0, 4, 4),
            C("gemm", 64, 256, 64, 0, 8, 3),
        ]
    else:
        grid = [
            C("gemm", 128, 128, 64, 0, 8, 3),
            C("gemm", 64, 128, 64, 0, 4, 4),
            C("gemm", 128, 128, 128, 0, 8, 3),
            C("gemm", 128, 256, 64, 0, 8, 3),
            C("gemm", 64, 256, 64, 0, 8, 3),
            C("gemm", 128, 64, 64, 0, 4, 4),
        ]
    out = [W.select_config(m)]
    for c in grid[: max(0, limit - 2)] + [C("dequant", 0, 64, 128, 0, 4, 1)]:
        if c not in out:
            out.append(c)
    return out


def _w4_bytes(w, m: int) -> int:
    """Least bytes a W4A16 GEMM moves: int4 words, scales (+ zero points, perm, group index),
    x and y, all once."""
    b = w.qweight.numel() * 4 + w.scales.numel() * w.scales.element_size() + m * (w.k + w.n) * 2
    for t in (w.zeros, w.perm, w.group_idx):
        b += 0 if t is None else t.numel() * t.element_size()
    return b


def time_w4a16(ctx: Ctx) -> None:
    from slimserve.kernels import w4a16_gemm as W

    p, dev, rows, weights = ctx.plan, ctx.dev, [], {}
    for si, (n, k) in enumerate(p.t_nk):
        try:
            w = W.prepare_w4a16(**make_w4_ct(n, k, 128, F16, dev, seed=si), num_bits=4)
            wd = randn((n, k), dev, F16, seed=si + 100, scale=0.02)
        except Exception:
            ctx.error(f"w4a16 weights N={n} K={k}")
            continue
        weights[(n, k)] = w
        for m in p.t_w4_ms:
            rows.append(_w4_row(ctx, W, "sym", w, wd, randn((m, k), dev, F16, seed=m)))
        for label, kw in (("asym", dict(asym=True)), ("act-order", dict(actorder="regular"))):
            try:
                wv = W.prepare_w4a16(**make_w4_ct(n, k, 128, F16, dev, seed=si, **kw), num_bits=4)
                rows.append(_w4_row(ctx, W, label, wv, wd, randn((1, k), dev, F16, seed=1)))
            except Exception:
                ctx.error(f"w4a16 {label} N={n} K={k}")
        ctx.res["tables"]["w4a16"] = rows
        ctx.save()
    print_table(
        f"W4A16 (int4 g128, fp16 x) vs cuBLAS fp16 | copy {fmt(ctx.copy_gbps, '.0f')} "
        "GB/s | target >= 3x at M <= 16, >= 1x everywhere",
        [
            ("N", "N", 6, ""),
            ("K", "K", 6, ""),
            ("M", "M", 5, ""),
            ("variant", "w", 10, ""),
            ("path", "path", 8, ""),
            ("fp16_us", "fp16 us", 9, ".1f"),
            ("w4_us", "w4 us", 9, ".1f"),
            ("speedup", "speedup", 8, ".2f"),
            ("w4_GBps", "w4 GB/s", 8, ".0f"),
            ("w4_pct_copy", "%copy", 6, ".0f"),
            ("fp16_TFLOPs", "fp16 TF/s", 9, ".1f"),
            ("w4_TFLOPs", "w4 TF/s", 8, ".1f"),
            ("target", "target", 6, ""),
        ],
        rows,
    )
    if p.sweep_w4:
        _w4_sweep_all(ctx, W, weights, rows)


def _w4_sweep_all(ctx: Ctx, W, weights: dict, rows: list[dict]) -> None:
    """M-major, so that a sweep cut short at the time limit still covers the small-M buckets
    of every shape (decode matters most)."""
    p, sweep = ctx.plan, []
    deadline = ctx.t0 + 0.85 * p.limits.get("w4a16", 1e9)
    default = {(r["M"], r["N"], r["K"]): r.get("w4_us") for r in rows if r["variant"] == "sym"}
    for m in p.t_w4_ms:
        for (n, k), w in weights.items():
            if default.get((m, n, k)):
                x = randn((m, k), ctx.dev, F16, seed=m)
                sweep += _w4_sweep(ctx, W, w, x, default[(m, n, k)], deadline)
        ctx.res["sweeps"]["w4a16"] = sweep
        ctx.save()
    if sweep:
        _report_w4_sweep(ctx, W, sweep)


def _w4_row(ctx: Ctx, W, label, w, wd, x) -> dict:
    m, n, k = x.shape[0], w.n, w.k
    row = {"N": n, "K": k, "M": m, "variant": label, "path": W.select_config(m).path}
    try:
        t16 = ctx.bench(lambda: F.linear(x, wd))
        t4 = ctx.bench(lambda: W.w4a16_gemm(x, w))
        gb = _w4_bytes(w, m) / t4 / 1e3
        row.update(
            fp16_us=t16,
            w4_us=t4,
            speedup=t16 / t4,
            w4_GBps=gb,
            w4_pct_copy=ctx.pct(gb),
            fp16_TFLOPs=2 * m * n * k / t16 / 1e6,
            w4_TFLOPs=2 * m * n * k / t4 / 1e6,
        )
        need = 3.0 if m <= 16 else 1.0
        row["target"] = ctx.target(
            f"w4a16 {label} M={m} N={n} K={k} >= {need}x fp16", t16 / t4 >= need, f"{t16 / t4:.2f}x"
        )
    except Exception:
        ctx.error(f"w4a16 {label} M={m} N={n} K={k}")
    return row


def _w4_sweep(ctx: Ctx, W, w, x, t_default: float, deadline: float) -> list[dict]:
    """Time every candidate at one (M, N, K); a candidate whose output is off is marked."""
    m, out = x.shape[0], []
    ref = None
    for i, cfg in enumerate(w4_candidates(W, m, ctx.plan.sweep_w4)):
        rec = {"M": m, "N": w.n, "K": w.k, "config": cfg_repr(cfg), "default": i == 0}
        if i == 0:
            rec["us"] = t_default
        elif time.monotonic() > deadline:
            rec["skipped"] = "time limit"
        else:
            try:
                y = W.w4a16_gemm(x, w, config=cfg).float()
                if ref is None:
                    ref = W.w4a16_gemm(x, w).float()
                rel = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                rec["valid"] = rel <= 2.0**-6  # different tilings agree to ~u; a bug is O(1)
                rec["us"] = ctx.bench(lambda: W.w4a16_gemm(x, w, config=cfg), sweep=True)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        out.append(rec)
    return out


def _report_w4_sweep(ctx: Ctx, W, records: list[dict]) -> None:
    bounds = [b for b, _ in W.DISPATCH]
    ms = sorted({r["M"] for r in records})
    buckets = []
    for i, b in enumerate(bounds):
        lo = bounds[i - 1] if i else 0
        buckets.append((b, [m for m in ms if m > lo and (b is None or m <= b)]))
    report_sweep(
        ctx,
        "w4a16",
        records,
        buckets,
        "Suggested DISPATCH for kernels/w4a16_gemm.py (the current table's M buckets; "
        "each row picks the smallest geo-mean slowdown over the measured points):",
        "DISPATCH: tuple[tuple[int | None, W4A16Config], ...] = (",
        str,
        {b: cfg_repr(c) for b, c in W.DISPATCH},
    )
