"""kernel_bench's W8A8 section: act_quant, int8 GEMM and linear_w8a8 checks (bit exact or <= 1 ulp
against the torch twins), timings against cuBLAS fp16, and the tile sweep that suggests the large-M
rows of CONFIGS in kernels/w8a8_gemm.py."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from slimserve.eval.kernels.common import (
    BF16,
    DT,
    F16,
    Ctx,
    gen,
    print_table,
    randn,
    run_check,
    ulp_ok,
)
from slimserve.eval.kernels.sweep import cfg_repr, report_sweep
from slimserve.kernels import reference as R  # pure torch: no @triton.jit


def checks_w8a8(ctx: Ctx) -> None:
    from slimserve.kernels import act_quant as A
    from slimserve.kernels import w8a8_gemm as G

    p, dev = ctx.plan, ctx.dev
    for m, k in p.aq_shapes:
        for dt in (F16, BF16):

            def aq(m=m, k=k, dt=dt):
                g = gen("cpu", m + k)
                x = torch.randn(m, k, generator=g) * torch.exp2(
                    torch.randint(-6, 7, (m, 1), generator=g)
                )
                x = x.to(dt)
                q, s = A.act_quant(x.to(dev))
                q_ref, s_ref = R.quantize_per_token_int8(x)
                bad = (q.cpu() != q_ref).sum().item() + (s.cpu() != s_ref).sum().item()
                return (
                    bad == 0,
                    float((q.cpu().int() - q_ref.int()).abs().max()),
                    "codes+scales bit exact",
                )

            run_check(ctx, "act_quant", f"{DT[dt]} [{m}, {k}]", aq)
    for n, k in p.w8_nk:
        wq = torch.randint(-128, 128, (n, k), generator=gen(dev, n), device=dev, dtype=torch.int8)
        ws = (torch.rand(n, 1, generator=gen(dev, 1), device=dev) + 0.5) * 2.0**-9
        bias = torch.randn(n, generator=gen(dev, 2), device=dev)
        for m in p.w8_ms:
            a = torch.randint(
                -128, 128, (m, k), generator=gen(dev, m), device=dev, dtype=torch.int8
            )
            a_s = (torch.rand(m, 1, generator=gen(dev, 3), device=dev) + 0.5) * 2.0**-10

            def acc(a=a):
                got, ref = (
                    G.w8a8_gemm(a, a_s, wq, ws, None, torch.int32),
                    R.w8a8_matmul_int32(a, wq),
                )
                return torch.equal(got, ref), float((got - ref).abs().max()), "int32 exact"

            def scaled(
                a=a, a_s=a_s, sdt=F16 if m % 2 else torch.float32, odt=BF16 if m % 2 else F16
            ):
                args = (a, a_s.to(sdt), wq, ws.to(sdt), bias.to(sdt))
                return ulp_ok(G.w8a8_gemm(*args, odt), R.w8a8_gemm(*args, odt), 1.0)

            run_check(ctx, "w8a8_gemm", f"int32 M={m} N={n} K={k}", acc)
            run_check(ctx, "w8a8_gemm", f"scaled+bias M={m} N={n} K={k} (<= 1 ulp)", scaled)
        for dt in (F16, BF16):

            def lin(dt=dt, m=p.w8_ms[-1]):
                x = randn((m, k), "cpu", dt, seed=5)
                q, s = R.quantize_per_token_int8(x)  # on the CPU: the CPU tests' oracle
                ref = R.w8a8_gemm(q.to(dev), s.to(dev), wq, ws.to(dt), None, dt)
                return ulp_ok(G.linear_w8a8(x.to(dev), wq, ws.to(dt)), ref, 1.0)

            run_check(ctx, "linear_w8a8", f"{DT[dt]} M={p.w8_ms[-1]} N={n} K={k} (<= 1 ulp)", lin)
        ctx.save()


def w8_candidates(G) -> list:
    C = G.W8A8Config
    return [
        C(128, 128, 128, 8, 8, 4),
        C(128, 128, 128, 8, 4, 4),
        C(128, 256, 128, 8, 8, 3),
        C(256, 128, 128, 8, 8, 3),
        C(128, 256, 64, 8, 8, 4),
        C(128, 128, 64, 8, 4, 4),
        C(64, 128, 128, 8, 4, 4),
        C(128, 64, 128, 8, 4, 4),
    ]


def time_w8a8(ctx: Ctx) -> None:
    from slimserve.kernels import w8a8_gemm as G
    from slimserve.kernels.act_quant import act_quant

    p, dev, rows, weights = ctx.plan, ctx.dev, [], {}
    for si, (n, k) in enumerate(p.t_nk):
        wq = torch.randint(-128, 128, (n, k), generator=gen(dev, si), device=dev, dtype=torch.int8)
        ws = torch.rand(n, 1, generator=gen(dev, si), device=dev).to(F16) * 1e-3
        weights[(n, k)] = (wq, ws)
        wd = randn((n, k), dev, F16, seed=si, scale=0.02)
        for m in p.t_w8_ms:
            rows.append(_w8_row(ctx, G, wq, ws, wd, randn((m, k), dev, F16, seed=m)))
        ctx.res["tables"]["w8a8"] = rows
        ctx.save()
        del wd
    print_table(
        "W8A8 (act_quant + int8 GEMM, fp16 out) vs cuBLAS fp16 | target >= 1.5x at M >= 1024",
        [
            ("N", "N", 6, ""),
            ("K", "K", 6, ""),
            ("M", "M", 5, ""),
            ("fp16_us", "fp16 us", 9, ".1f"),
            ("fp16_TFLOPs", "fp16 TF/s", 9, ".0f"),
            ("w8_us", "w8a8 us", 9, ".1f"),
            ("w8_TOPs", "w8a8 TOP/s", 10, ".0f"),
            ("speedup", "speedup", 8, ".2f"),
            ("gemm_us", "gemm us", 9, ".1f"),
            ("gemm_TOPs", "gemm TOP/s", 10, ".0f"),
            ("gemm_speedup", "gemm x", 7, ".2f"),
            ("gemm_GBps", "gemm GB/s", 9, ".0f"),
            ("gemm_pct_copy", "%copy", 6, ".0f"),
            ("aq_us", "quant us", 8, ".1f"),
            ("target", "target", 6, ""),
        ],
        rows,
    )
    sweep, deadline = [], ctx.t0 + 0.85 * p.limits.get("w8a8", 1e9)
    default = {(r["M"], r["N"], r["K"]): r.get("gemm_us") for r in rows}
    for m in p.sweep_w8_ms:
        for (n, k), (wq, ws) in weights.items():
            if default.get((m, n, k)):
                try:
                    a, a_s = act_quant(randn((m, k), dev, F16, seed=m))
                    sweep += _w8_sweep(ctx, G, a, a_s, wq, ws, default[(m, n, k)], deadline)
                except Exception:
                    ctx.error(f"w8a8 sweep M={m} N={n} K={k}")
        ctx.res["sweeps"]["w8a8"] = sweep
        ctx.save()
    if sweep:
        ms = sorted({r["M"] for r in sweep})
        buckets = [(m if i < len(ms) - 1 else None, [m]) for i, m in enumerate(ms)]
        report_sweep(
            ctx,
            "w8a8",
            sweep,
            buckets,
            f"Suggested rows for the tail of CONFIGS in kernels/w8a8_gemm.py (M >= {ms[0]}"
            " measured; the first bound also takes the unmeasured Ms below it):",
            "    # ... rows for smaller M unchanged ...",
            lambda b: "1 << 62" if b is None else str(b),
        )


def _w8_row(ctx: Ctx, G, wq, ws, wd, x) -> dict:
    """fp16 F.linear, linear_w8a8 (quantize + GEMM), the GEMM alone and act_quant alone."""
    from slimserve.kernels.act_quant import act_quant

    m, k, n = x.shape[0], x.shape[1], wq.shape[0]
    row = {"N": n, "K": k, "M": m}
    try:
        a, a_s = act_quant(x)
        t16 = ctx.bench(lambda: F.linear(x, wd))
        tl_ = ctx.bench(lambda: G.linear_w8a8(x, wq, ws))
        tg = ctx.bench(lambda: G.w8a8_gemm(a, a_s, wq, ws, None, F16))
        ta = ctx.bench(lambda: act_quant(x))
        fl = 2 * m * n * k / 1e6
        gb = (m * k + n * k + 2 * m * n + 2 * (m + n)) / tg / 1e3
        row.update(
            fp16_us=t16,
            w8_us=tl_,
            gemm_us=tg,
            aq_us=ta,
            fp16_TFLOPs=fl / t16,
            w8_TOPs=fl / tl_,
            gemm_TOPs=fl / tg,
            speedup=t16 / tl_,
            gemm_speedup=t16 / tg,
            gemm_GBps=gb,
            gemm_pct_copy=ctx.pct(gb),
        )
        if m >= 1024:
            row["target"] = ctx.target(
                f"w8a8 M={m} N={n} K={k} >= 1.5x fp16", t16 / tl_ >= 1.5, f"{t16 / tl_:.2f}x"
            )
    except Exception:
        ctx.error(f"w8a8 M={m} N={n} K={k}")
    return row


def _w8_sweep(ctx: Ctx, G, a, a_s, wq, ws, t_default, deadline) -> list[dict]:
    m, n, k = a.shape[0], wq.shape[0], wq.shape[1]
    ref = G.w8a8_gemm(a, a_s, wq, ws, None, F16)
    out = [
        {
            "M": m,
            "N": n,
            "K": k,
            "config": cfg_repr(G.default_config(m)),
            "default": True,
            "us": t_default,
        }
    ]
    for cfg in w8_candidates(G):
        if cfg == G.default_config(m):
            continue
        rec = {"M": m, "N": n, "K": k, "config": cfg_repr(cfg), "default": False}
        if time.monotonic() > deadline:
            rec["skipped"] = "time limit"
        else:
            try:
                rec["valid"] = torch.equal(G.w8a8_gemm(a, a_s, wq, ws, None, F16, config=cfg), ref)
                rec["us"] = ctx.bench(
                    lambda: G.w8a8_gemm(a, a_s, wq, ws, None, F16, config=cfg), sweep=True
                )
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        out.append(rec)
    return out
