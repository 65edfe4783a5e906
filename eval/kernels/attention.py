"""kernel_bench's attention section: paged decode (one pass and split) and chunked prefill checks
over scattered fp16 / bf16 / fp8 KV blocks, decode timings as a share of copy bandwidth, and
prefill timings against torch SDPA."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

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
    twin,
)
from slimserve.kernels import reference_attention as RA


def make_paged_kv(ctxs, hkv, d, bs, kv_dtype, dev, seed):
    """Caches whose blocks are a random permutation of physical ids (scattered), plus block
    tables and context lengths; fp8 codes spread over +-16 (scaled by 0.25 / 0.5: +-4, +-8)."""
    g = gen(dev, seed)
    per_seq = max(1, max(-(-c // bs) for c in ctxs))
    nblk = len(ctxs) * per_seq + 3
    tables = torch.randperm(nblk, generator=g, device=dev)[: len(ctxs) * per_seq]
    spread = 4.0 if kv_dtype == FP8 else 1.0
    k = (torch.randn(nblk, bs, hkv, d, generator=g, device=dev) * spread).to(kv_dtype)
    v = (torch.randn(nblk, bs, hkv, d, generator=g, device=dev) * spread).to(kv_dtype)
    return (
        k,
        v,
        tables.view(len(ctxs), per_seq).int(),
        torch.tensor(ctxs, dtype=torch.int32, device=dev),
    )


def _attn_close(out, ref, vc, v_scale):
    """Outputs are convex combinations of V rows: P rounded to the KV dtype and the output
    rounding cost <= eps * max|V|; allowed 2 eps max|V| (tests/kernels/test_paged_attention.py)."""
    vmax = vc.float().abs().max().item() * (v_scale if vc.dtype == FP8 else 1.0)
    tol = 2 * torch.finfo(out.dtype).eps * vmax
    err = (out.float() - ref.float()).abs().max().item()
    return out.shape == ref.shape and out.dtype == ref.dtype and err <= tol, err, f"tol {tol:.3g}"


def checks_attn(ctx: Ctx) -> None:
    from slimserve.kernels import paged_attention as PA

    p, dev = ctx.plan, ctx.dev
    h, hkv, d, bs = p.attn
    ks, vs = torch.tensor([0.25], device=dev), 0.5
    scale = d**-0.5
    dec = PA.default_config("decode", d)
    pre = PA.default_config("prefill", d)
    if p.cpu_tiles:
        dec, pre = PA.AttentionConfig(block_n=32, partition=32), PA.AttentionConfig(16, 16)
    for qdt, kvdt in ((F16, F16), (BF16, BF16), (F16, FP8), (BF16, FP8)):
        tag = f"q {DT[qdt]} kv {DT[kvdt]}"
        for split in (False, True):

            def decode(split=split, qdt=qdt, kvdt=kvdt):
                kc, vc, bt, cl = make_paged_kv(p.dec_ctx, hkv, d, bs, kvdt, dev, seed=3)
                q = randn((len(p.dec_ctx), h, d), dev, qdt, seed=4)
                out = PA.paged_attention_decode(
                    q, kc, vc, bt, cl, scale, ks, vs, config=replace(dec, split=split)
                )
                ref = twin(RA.paged_attention_decode, q, kc, vc, bt, cl, scale, ks, vs)
                return _attn_close(out, ref, vc, vs)

            run_check(
                ctx,
                "paged_attention_decode",
                f"{tag} {'split' if split else 'one pass'} ctx {min(p.dec_ctx)}..{max(p.dec_ctx)}",
                decode,
            )

        def prefill(qdt=qdt, kvdt=kvdt):
            q_lens, ctxs = p.prefill
            kc, vc, bt, cl = make_paged_kv(ctxs, hkv, d, bs, kvdt, dev, seed=5)
            cu = torch.tensor(
                [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
            )
            q = randn((sum(q_lens), h, d), dev, qdt, seed=6)
            out = PA.paged_attention_prefill(
                q, kc, vc, bt, cu, cl, scale, ks, vs, config=pre, max_q_len=max(q_lens)
            )
            ref = twin(RA.paged_attention_prefill, q, kc, vc, bt, cu, cl, scale, ks, vs)
            return _attn_close(out, ref, vc, vs)

        run_check(
            ctx, "paged_attention_prefill", f"{tag} q {p.prefill[0]} ctx {p.prefill[1]}", prefill
        )
        ctx.save()


def time_attn(ctx: Ctx) -> None:
    from slimserve.kernels import paged_attention as PA

    p, dev, rows = ctx.plan, ctx.dev, []
    h, hkv, d, bs = p.attn
    n_new, cached = p.t_prefill
    per_seq = max(max(p.t_dec_ctx), n_new + cached) // bs
    tables = torch.randperm(p.dec_batch * per_seq + 16, device=dev)[: p.dec_batch * per_seq]
    tables = tables.view(p.dec_batch, per_seq).int()
    nblk = p.dec_batch * per_seq + 16
    ks, vs = torch.tensor([0.25], device=dev), torch.tensor([0.5], device=dev)
    cases = [(p.dec_batch, c) for c in p.t_dec_ctx] + [(1, max(p.t_dec_ctx))]
    base = {}
    for kv_dtype in (F16, FP8):
        kc = randn((nblk, bs, hkv, d), dev, F16, seed=1).to(kv_dtype)
        vc = randn((nblk, bs, hkv, d), dev, F16, seed=2).to(kv_dtype)
        for b, c in cases:
            row = {"batch": b, "ctx": c, "kv": DT[kv_dtype]}
            try:
                row.update(
                    _decode_row(
                        ctx, PA, kc, vc, tables[:b, : c // bs].contiguous(), b, c, h, ks, vs
                    )
                )
                if kv_dtype == F16:
                    base[(b, c)] = row["us"]
                elif (b, c) in base:
                    row["vs_fp16"] = base[(b, c)] / row["us"]
                    if b == p.dec_batch and c >= 4096:
                        row["target"] = ctx.target(
                            f"fp8 decode B={b} ctx={c} >= 1.6x fp16 and >= 70% copy",
                            row["vs_fp16"] >= 1.6 and (row["pct_copy"] or 0) >= 70,
                            f"{row['vs_fp16']:.2f}x, {row['pct_copy'] or 0:.0f}% copy",
                        )
            except Exception:
                ctx.error(f"decode B={b} ctx={c} {DT[kv_dtype]}")
            rows.append(row)
        del kc, vc
    ctx.res["tables"]["decode"] = rows
    ctx.save()
    print_table(
        f"Paged decode attention ({h} q heads, {hkv} KV heads, D {d}, block {bs}, "
        f"scattered blocks, fp16 q) | GB/s of KV read vs copy {fmt(ctx.copy_gbps, '.0f')} GB/s | "
        "target fp8 >= 1.6x fp16 and >= 70% copy at long context",
        [
            ("batch", "batch", 6, ""),
            ("ctx", "ctx", 6, ""),
            ("kv", "kv", 6, ""),
            ("path", "path", 7, ""),
            ("us", "us", 10, ".1f"),
            ("GBps", "GB/s", 8, ".0f"),
            ("pct_copy", "%copy", 7, ".0f"),
            ("other_path", "other", 8, ""),
            ("other_us", "other us", 10, ".1f"),
            ("vs_fp16", "fp8 x", 7, ".2f"),
            ("target", "target", 8, ""),
        ],
        rows,
    )
    _time_prefill(ctx, PA)


def _decode_row(ctx: Ctx, PA, kc, vc, bt, b, c, h, ks, vs) -> dict:
    """Default path and the other one (split / one pass) at one (batch, context)."""
    d, hkv = kc.shape[3], kc.shape[2]
    q = randn((b, h, d), ctx.dev, F16, seed=b + c)
    cl = torch.full((b,), c, dtype=torch.int32, device=ctx.dev)
    dflt = PA.default_config("decode", d)
    split = PA.use_split(b, hkv, c, dflt, ctx.dev)
    other = replace(dflt, split=not split)
    t = ctx.bench(lambda: PA.paged_attention_decode(q, kc, vc, bt, cl, d**-0.5, ks, vs))
    t_other = ctx.bench(
        lambda: PA.paged_attention_decode(q, kc, vc, bt, cl, d**-0.5, ks, vs, config=other)
    )
    gb = 2 * b * c * hkv * d * kc.element_size() / t / 1e3  # K and V bytes read
    return {
        "path": "split" if split else "1pass",
        "us": t,
        "GBps": gb,
        "pct_copy": ctx.pct(gb),
        "other_path": "1pass" if split else "split",
        "other_us": t_other,
    }


def _time_prefill(ctx: Ctx, PA) -> None:
    """One chunk of n_new queries after `cached` tokens, paged fp16 / fp8 KV, against torch SDPA
    on contiguous K/V with the KV heads repeated: exact lower-right causal (torch picks the
    backend), and the flash backend without a mask (its causal mask is top-left, wrong for a
    chunk after a prefix; no mask does n_new * total scores, a few % more than the chunk)."""
    p, dev, rows = ctx.plan, ctx.dev, []
    h, hkv, d, bs = p.attn
    n_new, cached = p.t_prefill
    total = n_new + cached
    flops = 4 * h * d * (n_new * cached + n_new * (n_new + 1) // 2) / 1e6  # per us -> TFLOP/s
    try:
        k = randn((total, hkv, d), dev, F16, seed=11)
        v = randn((total, hkv, d), dev, F16, seed=12)
        q = randn((n_new, h, d), dev, F16, seed=13)
        qs = q.transpose(0, 1)[None].contiguous()  # [1, H, n_new, D]
        kr, vr = (
            t.repeat_interleave(h // hkv, 1).transpose(0, 1)[None].contiguous() for t in (k, v)
        )
        sdpa, t_base = _sdpa_rows(ctx, qs, kr, vr, rows, flops, 4 * h * d * n_new * total / 1e6)
        cu = torch.tensor([0, n_new], dtype=torch.int32, device=dev)
        cl = torch.tensor([total], dtype=torch.int32, device=dev)
        nblk = -(-total // bs)
        bt = torch.randperm(nblk, device=dev).int()[None]  # logical block i -> physical bt[0, i]
        for kv_dtype, scf in ((F16, 1.0), (FP8, 0.25)):
            sc = torch.tensor([scf], device=dev)
            kc = torch.zeros(nblk * bs, hkv, d, dtype=F16, device=dev)
            vc = torch.zeros_like(kc)
            kc[:total], vc[:total] = k / scf, v / scf
            kc, vc = (t.view(nblk, bs, hkv, d)[bt[0].argsort()] for t in (kc, vc))
            kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
            out = PA.paged_attention_prefill(
                q, kc, vc, bt, cu, cl, d**-0.5, sc, sc, max_q_len=n_new
            )
            diff = (
                None
                if sdpa is None
                else (out.transpose(0, 1)[None].float() - sdpa.float()).abs().max().item()
            )
            t = ctx.bench(
                lambda: PA.paged_attention_prefill(
                    q, kc, vc, bt, cu, cl, d**-0.5, sc, sc, max_q_len=n_new
                )
            )
            rows.append(
                {
                    "impl": f"paged prefill {DT[kv_dtype]} KV",
                    "us": t,
                    "TFLOPs": flops / t,
                    "vs_sdpa": t_base / t if t_base else None,
                    "max_diff_vs_sdpa": diff,
                }
            )
    except Exception:
        ctx.error("prefill timing")
    ctx.res["tables"]["prefill"] = rows
    ctx.save()
    print_table(
        f"Chunked prefill: {n_new} new queries after {cached} cached tokens, {h}/{hkv} "
        f"heads, D {d}, fp16 q (TF/s of each row's own work; 'vs SDPA' against the "
        "exact causal SDPA row)",
        [
            ("impl", "impl", 46, ""),
            ("us", "us", 10, ".1f"),
            ("TFLOPs", "TF/s", 8, ".1f"),
            ("vs_sdpa", "vs SDPA", 9, ".2f"),
            ("max_diff_vs_sdpa", "max |diff|", 12, ".3g"),
        ],
        rows,
    )


def _sdpa_rows(ctx: Ctx, qs, kr, vr, rows, flops_causal, flops_full):
    """Time the SDPA baselines; returns (causal output or None, causal time or None)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sdpa = t_causal = None
    try:
        mask = causal_lower_right(qs.shape[2], kr.shape[2])
        sdpa = F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask)
        t_causal = ctx.bench(lambda: F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask))
        rows.append(
            {
                "impl": "torch SDPA lower-right causal (contiguous)",
                "us": t_causal,
                "TFLOPs": flops_causal / t_causal,
            }
        )
    except Exception:
        ctx.error("SDPA lower-right causal baseline")
    try:

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, kr, vr)

        t = ctx.bench(flash)
        rows.append(
            {"impl": "torch SDPA flash, no mask (+6% work)", "us": t, "TFLOPs": flops_full / t}
        )
    except Exception:
        ctx.error("SDPA flash baseline")
    return sdpa, t_causal
