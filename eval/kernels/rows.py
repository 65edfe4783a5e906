"""kernel_bench's row-kernel section ("norm"): write_kv_cache and rope_and_write_kv (bit exact), rms_norm,
fused_add_rms_norm and silu_and_mul (<= 2 ulp) checks, and memory-bound timings of those and
act_quant against their torch eager twins."""

from __future__ import annotations

import torch

from slimserve.eval.kernels.common import (
    BF16,
    DT,
    F16,
    FP8,
    Ctx,
    fmt,
    gen,
    print_table,
    randn,
    run_check,
    ulp_ok,
)
from slimserve.kernels import reference as R  # pure torch: no @triton.jit
from slimserve.kernels import reference_attention as RA


def checks_norm(ctx: Ctx) -> None:
    from slimserve.kernels import activation as ACT
    from slimserve.kernels import rms_norm as RN
    from slimserve.kernels.kv_cache import write_kv_cache

    p, dev = ctx.plan, ctx.dev
    t, hidden, inter = p.rows
    _, hkv, d, bs = p.attn
    for kdt, cdt in ((F16, F16), (BF16, BF16), (F16, FP8), (BF16, FP8), (torch.float32, FP8)):

        def kv(kdt=kdt, cdt=cdt):
            n, g = p.kv_tokens, gen("cpu", 1)
            key, val = (
                (torch.randn(n, hkv, d, generator=g) * 8).to(kdt),
                (torch.randn(n, hkv, d, generator=g) * 8).to(kdt),
            )
            nblk = 2 * -(-n // bs) + 1
            slots = torch.randperm(nblk * bs, generator=g)[:n]
            slots[::10] = -1  # padding tokens are skipped
            kc, vc = (
                torch.zeros(nblk, bs, hkv, d, dtype=cdt),
                torch.zeros(nblk, bs, hkv, d, dtype=cdt),
            )
            kc_d, vc_d = kc.to(dev), vc.to(dev)
            write_kv_cache(key.to(dev), val.to(dev), kc_d, vc_d, slots.to(dev), 0.5, 0.25)
            RA.write_kv_cache(key, val, kc, vc, slots, 0.5, 0.25)
            view = torch.uint8 if cdt == FP8 else torch.int16
            bad = sum(
                (a.cpu().view(view) != b.view(view)).sum().item()
                for a, b in ((kc_d, kc), (vc_d, vc))
            )
            return bad == 0, float(bad), "mismatched codes (bit exact)"

        run_check(ctx, "write_kv_cache", f"{DT[kdt]} -> {DT[cdt]} cache, {p.kv_tokens} tokens", kv)
    h = p.attn[0]
    for kdt, cdt in ((F16, F16), (BF16, BF16), (BF16, FP8)):

        def rope_kv(kdt=kdt, cdt=cdt):
            from slimserve.kernels.rope_kv_cache import rope_and_write_kv

            n, g = p.kv_tokens, gen("cpu", 4)
            qkv = (torch.randn(n, (h + 2 * hkv) * d, generator=g) * 4).to(
                kdt
            )  # one fused projection
            pos = torch.randint(0, 8192, (n,), generator=g)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
            cos, sin = RA.rope_tables(pos, inv_freq)
            nblk = 2 * -(-n // bs) + 1
            slots = torch.randperm(nblk * bs, generator=g)[:n]
            slots[::10] = -1
            kc, vc = (
                torch.zeros(nblk, bs, hkv, d, dtype=cdt),
                torch.zeros(nblk, bs, hkv, d, dtype=cdt),
            )

            def split(x):
                return (
                    x[:, : h * d].view(n, h, d),
                    x[:, h * d : (h + hkv) * d].view(n, hkv, d),
                    x[:, (h + hkv) * d :].view(n, hkv, d),
                )

            ref, out = qkv.clone(), qkv.to(dev)
            kc_d, vc_d = kc.to(dev), vc.to(dev)
            rope_and_write_kv(
                *split(out), cos.to(dev), sin.to(dev), kc_d, vc_d, slots.to(dev), 0.5, 0.25
            )
            RA.rope_and_write_kv(*split(ref), cos, sin, kc, vc, slots, 0.5, 0.25)
            view = torch.uint8 if cdt == FP8 else torch.int16
            bad = sum(
                (a.cpu().view(view) != b.view(view)).sum().item()
                for a, b in ((kc_d, kc), (vc_d, vc))
            )
            bad += (out.cpu().view(torch.int16) != ref.view(torch.int16)).sum().item()
            return bad == 0, float(bad), "mismatched q/k bits and cache codes (bit exact)"

        run_check(
            ctx, "rope_and_write_kv", f"{DT[kdt]} -> {DT[cdt]} cache, {p.kv_tokens} tokens", rope_kv
        )
    for dt in (F16, BF16):
        g = gen("cpu", 2)
        x, r = (
            (torch.randn(t, hidden, generator=g) * 4).to(dt),
            (torch.randn(t, hidden, generator=g) * 4).to(dt),
        )
        w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dt)

        def rms(x=x, w=w):
            return ulp_ok(
                RN.rms_norm(x.to(dev), w.to(dev), 1e-6).cpu(), R.rms_norm(x, w, 1e-6), 2, 0.01
            )

        def fused(x=x, r=r, w=w):
            out, res = RN.fused_add_rms_norm(x.to(dev), r.to(dev), w.to(dev), 1e-6)
            ref_out, ref_res = R.fused_add_rms_norm(x, r, w, 1e-6)
            ok, err, note = ulp_ok(out.cpu(), ref_out, 2, 0.01)
            return ok and torch.equal(res.cpu(), ref_res), err, note + ", sum exact"

        def silu(dt=dt):
            xs = (torch.randn(t, 2 * inter, generator=gen("cpu", 3)) * 4).to(dt)
            return ulp_ok(ACT.silu_and_mul(xs.to(dev)).cpu(), R.silu_and_mul(xs), 2, 0.01)

        run_check(ctx, "rms_norm", f"{DT[dt]} [{t}, {hidden}] (<= 2 ulp)", rms)
        run_check(ctx, "fused_add_rms_norm", f"{DT[dt]} [{t}, {hidden}] (<= 2 ulp)", fused)
        run_check(ctx, "silu_and_mul", f"{DT[dt]} [{t}, {2 * inter}] (<= 2 ulp)", silu)
    ctx.save()


def _row_cases(ctx: Ctx) -> list[tuple]:
    """(kernel, shape, least bytes moved, kernel call, torch twin call) of every timed row."""
    from slimserve.kernels import act_quant as A
    from slimserve.kernels import activation as ACT
    from slimserve.kernels import rms_norm as RN
    from slimserve.kernels.kv_cache import write_kv_cache

    p, dev = ctx.plan, ctx.dev
    t, hidden, inter = p.t_rows
    _, hkv, d, bs = p.attn
    x, r = randn((t, hidden), dev, F16, 1), randn((t, hidden), dev, F16, 2)
    w = torch.ones(hidden, dtype=F16, device=dev)
    xs = randn((t, 2 * inter), dev, F16, 3)
    xi = xs[:, :inter].contiguous()
    key, val = randn((t, hkv, d), dev, F16, 4), randn((t, hkv, d), dev, F16, 5)
    nblk = 2 * -(-t // bs)
    slots = torch.randperm(nblk * bs, device=dev)[:t]
    kvb = t * hkv * d
    sc = torch.tensor([0.5], device=dev)  # a device scale: a float would cost a fill per call
    cases = []
    for cdt in (F16, FP8):
        kc = torch.zeros(nblk, bs, hkv, d, dtype=cdt, device=dev)
        vc = torch.zeros_like(kc)
        cases.append(
            (
                f"write_kv_cache -> {DT[cdt]}",
                f"[{t}, {hkv}, {d}] x2",
                2 * kvb * (2 + kc.element_size()) + 8 * t,
                lambda kc=kc, vc=vc: write_kv_cache(key, val, kc, vc, slots, sc, sc),
                lambda kc=kc, vc=vc: RA.write_kv_cache(key, val, kc, vc, slots, 0.5, 0.5),
            )
        )
    n = t * hidden
    cases += [
        (
            "rms_norm",
            f"[{t}, {hidden}]",
            4 * n,
            lambda: RN.rms_norm(x, w, 1e-6),
            lambda: R.rms_norm(x, w, 1e-6),
        ),
        (
            "fused_add_rms_norm",
            f"[{t}, {hidden}]",
            8 * n,
            lambda: RN.fused_add_rms_norm(x, r, w, 1e-6),
            lambda: R.fused_add_rms_norm(x, r, w, 1e-6),
        ),
        (
            "silu_and_mul",
            f"[{t}, {2 * inter}]",
            6 * t * inter,
            lambda: ACT.silu_and_mul(xs),
            lambda: R.silu_and_mul(xs),
        ),
        (
            "act_quant",
            f"[{t}, {hidden}]",
            3 * n + 2 * t,
            lambda: A.act_quant(x),
            lambda: R.quantize_per_token_int8(x),
        ),
        (
            "act_quant",
            f"[{t}, {inter}]",
            3 * t * inter + 2 * t,
            lambda: A.act_quant(xi),
            lambda: R.quantize_per_token_int8(xi),
        ),
    ]
    return cases


def time_norm(ctx: Ctx) -> None:
    rows = []
    for name, shape, nbytes, fn, twin in _row_cases(ctx):
        row = {"kernel": name, "shape": shape}
        try:
            row["us"] = ctx.bench(fn)
            row["GBps"] = nbytes / row["us"] / 1e3
            row["pct_copy"] = ctx.pct(row["GBps"])
            row["torch_us"] = ctx.bench(twin)
            row["speedup"] = row["torch_us"] / row["us"]
        except Exception:
            ctx.error(f"{name} {shape}" + (" (torch twin)" if "us" in row else ""))
        rows.append(row)
    ctx.res["tables"]["rows"] = rows
    ctx.save()
    print_table(
        f"Row kernels (fp16, memory bound) vs torch eager twins | copy "
        f"{fmt(ctx.copy_gbps, '.0f')} GB/s",
        [
            ("kernel", "kernel", 24, ""),
            ("shape", "shape", 20, ""),
            ("us", "us", 9, ".1f"),
            ("GBps", "GB/s", 8, ".0f"),
            ("pct_copy", "%copy", 7, ".0f"),
            ("torch_us", "torch us", 10, ".1f"),
            ("speedup", "speedup", 9, ".2f"),
        ],
        rows,
    )
