"""Kernel benchmark on one GPU: correctness of every Triton kernel against its torch twin at
Llama-7B/8B shapes, then triton.testing.do_bench timings against cuBLAS / torch baselines (one
table per section, bandwidth as a share of the measured device copy bandwidth), W4A16 and W8A8
tile sweeps with suggested dispatch tables, and the end-to-end engine benchmark.

    python -m slimserve.eval.kernel_bench [--quick] [--sections w4a16,w8a8,attn,norm,e2e]
                                          [--json-out F]

On CUDA every section runs in a child process with a time limit, so a CUDA fault or a hang in one
kernel cannot take the others down; children save their results after every table and the
parent merges them into one JSON (default $OUT/kernel_bench.json when $OUT is set). A failed
check or a failed row is reported and the run goes on; the exit code is 1 if anything failed.
Without CUDA the script says so, runs the correctness checks at tiny shapes through the Triton
interpreter, in process, and skips the timings.

Times are do_bench medians of GPU time between events, L2 flushed before every call: host-side
launcher overhead is not counted (the engine pays it once per step, outside these numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # read when the kernel modules define their @triton.jit functions: set it first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from slimserve.kernels import reference as R  # noqa: E402  (pure torch: no @triton.jit)

SECTIONS = ("w4a16", "w8a8", "attn", "norm", "e2e")
F16, BF16, FP8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
_DT = {F16: "fp16", BF16: "bf16", FP8: "fp8", torch.float32: "fp32"}


@dataclass(frozen=True)
class Plan:
    """Every size the run uses. `full` (GPU), `quick` (GPU smoke) and `cpu` (interpreter)."""

    name: str
    timings: bool
    group: int  # W4A16 group size
    w4_sym: tuple  # ((N, K), Ms) for the symmetric checks, fp16 and bf16
    w4_var: tuple  # ((N, K), Ms) for the asymmetric / act-order checks
    w8_nk: tuple  # (N, K) pairs for the W8A8 checks
    w8_ms: tuple
    aq_shapes: tuple  # act_quant check shapes
    rows: tuple  # (T, hidden, intermediate) of the row-kernel checks
    attn: tuple  # (H, Hkv, D, block_size)
    dec_ctx: tuple  # decode check contexts (one sequence each)
    prefill: tuple  # (q_lens, contexts) of the prefill check
    kv_tokens: int
    cpu_tiles: bool = False  # big forced tiles for the interpreter
    t_nk: tuple = ()  # (N, K) of the GEMM timings
    t_w4_ms: tuple = ()
    t_w8_ms: tuple = ()
    sweep_w4: int = 0  # candidates a point (0: no sweep)
    sweep_w8_ms: tuple = ()
    dec_batch: int = 64
    t_dec_ctx: tuple = ()
    t_prefill: tuple = (512, 4096)  # (new tokens, cached tokens before them)
    t_rows: tuple = (4096, 4096, 11008)
    warmup: int = 10
    rep: int = 50
    sweep_rep: int = 20
    e2e: tuple = ()
    limits: dict = field(default_factory=dict)  # section -> child time limit, seconds


_LLAMA = dict(group=128, w4_sym=((4096, 11008), (1, 16, 33, 300, 1024)),
              w4_var=((4096, 4096), (1, 64, 1024)), w8_nk=((11008, 4096), (4096, 11008)),
              w8_ms=(1, 16, 300, 1024), aq_shapes=((1024, 4096), (257, 11008)),
              rows=(1024, 4096, 11008), attn=(32, 8, 128, 16),
              dec_ctx=(1, 15, 16, 17, 500, 1024, 4100, 8192),
              prefill=((512, 7, 100, 1), (4608, 300, 100, 2000)), kv_tokens=4096)
_E2E = ("--shape", "llama-7b", "--device", "cuda", "--max-num-seqs", "128")
PLANS = {
    "full": Plan("full", True, **_LLAMA, t_nk=((4096, 4096), (11008, 4096), (4096, 11008)),
                 t_w4_ms=(1, 4, 16, 64, 256, 4096), t_w8_ms=(256, 1024, 2048, 4096, 8192),
                 sweep_w4=8, sweep_w8_ms=(1024, 2048, 4096, 8192),
                 t_dec_ctx=(512, 1024, 2048, 4096, 8192),
                 e2e=_E2E + ("--num-prompts", "128", "--input-len", "256", "--output-len", "128",
                             "--kv-cache-memory", "30GiB"),
                 limits=dict(w4a16=125, w8a8=70, attn=70, norm=35, e2e=130)),
    "quick": Plan("quick", True, **{**_LLAMA, "w4_sym": ((4096, 11008), (1, 300, 1024)),
                                    "w8_ms": (16, 1024), "dec_ctx": (17, 4100)},
                  t_nk=((4096, 4096),), t_w4_ms=(1, 16, 256), t_w8_ms=(1024,), sweep_w4=3,
                  sweep_w8_ms=(1024,), dec_batch=16, t_dec_ctx=(1024, 4096),
                  t_rows=(1024, 4096, 11008), warmup=5, rep=20, sweep_rep=10,
                  e2e=_E2E + ("--num-prompts", "16", "--input-len", "128", "--output-len", "32",
                              "--kv-cache-memory", "8GiB"),
                  limits=dict(w4a16=90, w8a8=60, attn=60, norm=30, e2e=100)),
    "cpu": Plan("cpu", False, group=32, w4_sym=((72, 192), (1, 33, 600)),
                w4_var=((64, 128), (1, 7)), w8_nk=((96, 200),), w8_ms=(1, 33),
                aq_shapes=((7, 200), (3, 1000)), rows=(7, 1000, 1000), attn=(8, 2, 32, 16),
                dec_ctx=(1, 17, 40), prefill=((7, 1), (40, 30)), kv_tokens=37, cpu_tiles=True),
}


# ----------------------------------------------------------------------------- shared helpers

def _gen(dev, seed: int) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def _randn(shape, dev, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(dev, seed), device=dev) * scale).to(dtype)


def _ulp_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in ulps of ref's dtype at |ref| (ulp(r) = 2^floor(log2 r) * eps)."""
    fin = torch.finfo(ref.dtype)
    r = ref.float().abs().clamp_min(fin.tiny)
    return (out.float() - ref.float()).abs() / (torch.exp2(torch.floor(torch.log2(r))) * fin.eps)


def _ulp_ok(out, ref, max_ulp: float, max_frac: float = 1.0):
    """(ok, max ulp error, note): shapes and dtypes equal, every element within max_ulp and at
    most max_frac of them differing at all."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False, math.inf, f"got {out.dtype}{tuple(out.shape)}, want {ref.dtype}{tuple(ref.shape)}"
    err = _ulp_err(out, ref)
    frac = (out != ref).float().mean().item()
    return err.max().item() <= max_ulp and frac <= max_frac, err.max().item(), f"{frac:.2%} differ"


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _bench(fn, warmup: int, rep: int) -> float:
    """Median GPU time of fn() in microseconds."""
    from triton.testing import do_bench

    r = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])
    return float(r[0] if isinstance(r, (list, tuple)) else r) * 1e3


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec) if spec else str(v)


def print_table(title: str, cols: list[tuple[str, str, int, str]], rows: list[dict]) -> None:
    """cols: (key, header, width, format spec); a missing key prints '-'."""
    print(f"\n{title}")
    print(" ".join(f"{h:>{w}}" for _, h, w, _ in cols))
    for r in rows:
        print(" ".join(f"{_fmt(r.get(k), s):>{w}}" for k, _, w, s in cols))
    sys.stdout.flush()


class Ctx:
    """One section's run: device, plan, copy bandwidth, results (saved after every table)."""

    def __init__(self, plan: Plan, dev: torch.device, copy_gbps: float | None,
                 result_path: str | None):
        self.plan, self.dev, self.copy_gbps, self.path = plan, dev, copy_gbps, result_path
        self.res: dict = {"correctness": [], "tables": {}, "sweeps": {}, "suggestions": {},
                          "errors": [], "targets": []}
        self.t0 = time.monotonic()

    def save(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(_clean(self.res), f)
            os.replace(self.path + ".tmp", self.path)

    def error(self, where: str) -> None:
        tb = _tail(traceback.format_exc())
        print(f"ERROR in {where}:\n{tb}", flush=True)
        self.res["errors"].append({"where": where, "traceback": tb})

    def pct(self, gbps: float | None) -> float | None:
        return 100.0 * gbps / self.copy_gbps if gbps and self.copy_gbps else None

    def bench(self, fn, sweep: bool = False) -> float:
        p = self.plan
        return _bench(fn, p.warmup // 2 if sweep else p.warmup, p.sweep_rep if sweep else p.rep)

    def target(self, name: str, ok: bool, detail: str) -> str:
        self.res["targets"].append({"target": name, "ok": bool(ok), "detail": detail})
        return "ok" if ok else "MISS"


def _clean(obj):
    """JSON-safe: non-finite floats -> None, tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def run_check(ctx: Ctx, kernel: str, case: str, fn) -> None:
    """Run one check (fn() -> (ok, max error, note)); an exception is a FAIL, not an abort."""
    t0 = time.perf_counter()
    try:
        ok, err, note = fn()
        _sync()
    except Exception:
        ok, err, note = False, math.nan, "exception"
        print(_tail(traceback.format_exc()), flush=True)
    status = "PASS" if ok else "FAIL"
    print(f"{status}  {kernel:<24} {case:<46} max err {err:<10.3g} {note}", flush=True)
    ctx.res["correctness"].append({"kernel": kernel, "case": case, "ok": bool(ok),
                                   "max_err": float(err), "note": note,
                                   "seconds": time.perf_counter() - t0})
    ctx.save()  # a child killed at its time limit still reports the checks it finished


def _twin(fn, *args):
    """A torch twin on the inputs' device, or on CPU copies when the device lacks an op for a
    dtype (float8 indexing on older CUDA builds); the result comes back to the device."""
    try:
        return fn(*args)
    except (RuntimeError, NotImplementedError):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        return out.to(dev)


def _memo(fn):
    box = []

    def get():
        if not box:
            box.append(fn())
        return box[0]
    return get


# ----------------------------------------------------------------------------- W4A16

def make_w4_ct(n, k, group, dtype, dev, *, asym=False, actorder=None, seed=0) -> dict:
    """Random compressed-tensors pack-quantized tensors: every int32 word is a valid pack of 8
    codes, scales ~ 2^-6; actorder "regular" (GPTQ: a permutation of k // group) or
    "irregular" (any group per column)."""
    g = _gen(dev, seed)
    groups = -(-k // group)
    packed = torch.randint(-2**31, 2**31 - 1, (n, -(-k // 8)), generator=g, device=dev,
                           dtype=torch.int32)
    scale = ((torch.rand(n, groups, generator=g, device=dev) + 0.5) / 64).to(dtype)
    zp = (torch.randint(-2**31, 2**31 - 1, (-(-n // 8), groups), generator=g, device=dev,
                        dtype=torch.int32) if asym else None)
    g_idx = None
    if actorder == "regular":
        g_idx = (torch.arange(k, device=dev) // group)[torch.randperm(k, generator=g, device=dev)]
    elif actorder == "irregular":
        g_idx = torch.randint(0, groups, (k,), generator=g, device=dev)
    return dict(weight_packed=packed, weight_scale=scale, weight_zero_point=zp,
                weight_g_idx=None if g_idx is None else g_idx.to(torch.int32),
                weight_shape=(n, k), group_size=group)


def _w4_dequant_ref(ct: dict) -> torch.Tensor:
    return R.dequantize_packed(ct["weight_packed"], ct["weight_scale"], ct["weight_zero_point"],
                               ct["weight_g_idx"], ct["weight_shape"], 4, ct["group_size"])


def w4_error(y, x, w, bias=None):
    """(ok, max err, note) of y against the fp32 product of the same rounded x and w [N, K]:
    fp32 sums in another order (2 K 2^-24 sum|x||w|) plus one rounding to x's dtype (u |y|),
    the bound of tests/kernels/test_w4a16_gemm.py."""
    xf = x.float().reshape(-1, x.shape[-1])
    ref = xf @ w.float().t() + (bias.float() if bias is not None else 0.0)
    u = 2.0 ** -8 if x.dtype == BF16 else 2.0 ** -11
    bound = u * ref.abs() + 2 * x.shape[-1] * 2.0 ** -24 * (xf.abs() @ w.float().abs().t())
    err = (y.float().reshape(ref.shape) - ref).abs()
    ratio = (err / (bound + 2.0 ** -24)).max().item()
    return y.dtype == x.dtype and ratio <= 1.0, err.max().item(), f"{ratio:.2f} of bound"


def checks_w4a16(ctx: Ctx) -> None:
    from slimserve.kernels import w4a16_gemm as W

    p, dev = ctx.plan, ctx.dev
    (n, k), ms = p.w4_sym
    (vn, vk), vms = p.w4_var
    cases = [("sym", n, k, F16, {}, ms), ("sym", n, k, BF16, {}, ms),
             ("asym", vn, vk, F16, dict(asym=True), vms), ("asym", vn, vk, BF16, dict(asym=True), vms[:1]),
             ("act-order", vn, vk, F16, dict(actorder="regular"), vms),
             ("act-order irregular", vn, vk, BF16, dict(actorder="irregular"), vms[:1])]
    if p.name == "full":
        cases.append(("sym", k, n, F16, {}, (7,)))  # (11008, 4096): the other orientation
    for i, (label, cn, ck, dt, kw, cms) in enumerate(cases):
        ct_w = _memo(lambda cn=cn, ck=ck, dt=dt, kw=kw, i=i: _prepare_w4(W, cn, ck, p.group, dt,
                                                                           dev, kw, i))
        for m in cms:
            def check(m=m, ct_w=ct_w, dt=dt, ck=ck, cn=cn):
                ct, w, wq = ct_w()
                x = _randn((m, ck), dev, dt, seed=m)
                bias = _randn((cn,), dev, dt, seed=7) if m % 2 else None  # odd M: with a bias
                return w4_error(W.w4a16_gemm(x, w, bias), x, wq, bias)
            path = W.select_config(m).path
            run_check(ctx, "w4a16_gemm", f"{label} {_DT[dt]} M={m} N={cn} K={ck} ({path})", check)
        if label in ("sym", "act-order") or "irregular" in label:
            def exact(ct_w=ct_w, dt=dt):
                ct, w, wq = ct_w()
                got = W.dequantize_w4a16(w, dt)
                bad = (got != wq).sum().item()
                return bad == 0 and got.dtype == dt, float(bad), "mismatched elements"
            run_check(ctx, "dequantize_w4a16", f"{label} {_DT[dt]} N={cn} K={ck} (bit exact)",
                      exact)
        ctx.save()


def _prepare_w4(W, n, k, group, dtype, dev, kw, seed):
    ct = make_w4_ct(n, k, group, dtype, dev, seed=seed, **kw)
    return ct, W.prepare_w4a16(**ct, num_bits=4), _w4_dequant_ref(ct).to(dtype)


def w4_candidates(W, m: int, limit: int) -> list:
    """The DISPATCH choice for M, tile variants for M's size class, and the dequant path."""
    C = W.W4A16Config
    if m <= 16:
        grid = [C("gemm", 16, 32, 128, 0, 4, 4), C("gemm", 16, 128, 128, 0, 4, 4),
                C("gemm", 16, 64, 64, 0, 4, 4), C("gemm", 16, 128, 64, 0, 4, 4),
                C("gemm", 16, 64, 128, 8, 4, 4), C("gemm", 16, 64, 128, 1, 4, 4)]
    elif m <= 64:
        grid = [C("gemm", 32, 64, 128, 0, 4, 4), C("gemm", 64, 64, 128, 0, 4, 4),
                C("gemm", 64, 128, 64, 0, 4, 4), C("gemm", 64, 128, 128, 0, 8, 3),
                C("gemm", 16, 64, 128, 0, 4, 4), C("gemm", 64, 256, 64, 0, 8, 3)]
    else:
        grid = [C("gemm", 128, 128, 64, 0, 8, 3), C("gemm", 64, 128, 64, 0, 4, 4),
                C("gemm", 128, 128, 128, 0, 8, 3), C("gemm", 128, 256, 64, 0, 8, 3),
                C("gemm", 64, 256, 64, 0, 8, 3), C("gemm", 128, 64, 64, 0, 4, 4)]
    out = [W.select_config(m)]
    for c in grid[: max(0, limit - 2)] + [C("dequant", 0, 64, 128, 0, 4, 1)]:
        if c not in out:
            out.append(c)
    return out


def cfg_repr(c) -> str:
    """A paste-able constructor call of a W4A16Config / W8A8Config."""
    name = type(c).__name__
    if name == "W4A16Config":
        return (f'W4A16Config("{c.path}", {c.block_m}, {c.block_n}, {c.block_k}, '
                f"split_k={c.split_k}, num_warps={c.num_warps}, num_stages={c.num_stages})")
    return (f"W8A8Config({c.block_m}, {c.block_n}, {c.block_k}, group_m={c.group_m}, "
            f"num_warps={c.num_warps}, num_stages={c.num_stages})")


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
            wd = _randn((n, k), dev, F16, seed=si + 100, scale=0.02)
        except Exception:
            ctx.error(f"w4a16 weights N={n} K={k}")
            continue
        weights[(n, k)] = w
        for m in p.t_w4_ms:
            rows.append(_w4_row(ctx, W, "sym", w, wd, _randn((m, k), dev, F16, seed=m)))
        for label, kw in (("asym", dict(asym=True)), ("act-order", dict(actorder="regular"))):
            try:
                wv = W.prepare_w4a16(**make_w4_ct(n, k, 128, F16, dev, seed=si, **kw), num_bits=4)
                rows.append(_w4_row(ctx, W, label, wv, wd, _randn((1, k), dev, F16, seed=1)))
            except Exception:
                ctx.error(f"w4a16 {label} N={n} K={k}")
        ctx.res["tables"]["w4a16"] = rows
        ctx.save()
    print_table(f"W4A16 (int4 g128, fp16 x) vs cuBLAS fp16 | copy {_fmt(ctx.copy_gbps, '.0f')} "
                "GB/s | target >= 3x at M <= 16, >= 1x everywhere", [
                    ("N", "N", 6, ""), ("K", "K", 6, ""), ("M", "M", 5, ""),
                    ("variant", "w", 10, ""), ("path", "path", 8, ""),
                    ("fp16_us", "fp16 us", 9, ".1f"), ("w4_us", "w4 us", 9, ".1f"),
                    ("speedup", "speedup", 8, ".2f"), ("w4_GBps", "w4 GB/s", 8, ".0f"),
                    ("w4_pct_copy", "%copy", 6, ".0f"), ("fp16_TFLOPs", "fp16 TF/s", 9, ".1f"),
                    ("w4_TFLOPs", "w4 TF/s", 8, ".1f"), ("target", "target", 6, "")], rows)
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
                x = _randn((m, k), ctx.dev, F16, seed=m)
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
        row.update(fp16_us=t16, w4_us=t4, speedup=t16 / t4, w4_GBps=gb, w4_pct_copy=ctx.pct(gb),
                   fp16_TFLOPs=2 * m * n * k / t16 / 1e6, w4_TFLOPs=2 * m * n * k / t4 / 1e6)
        need = 3.0 if m <= 16 else 1.0
        row["target"] = ctx.target(f"w4a16 {label} M={m} N={n} K={k} >= {need}x fp16",
                                   t16 / t4 >= need, f"{t16 / t4:.2f}x")
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
                rec["valid"] = rel <= 2.0 ** -6  # different tilings agree to ~u; a bug is O(1)
                rec["us"] = ctx.bench(lambda: W.w4a16_gemm(x, w, config=cfg), sweep=True)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        out.append(rec)
    return out


def suggest(times: dict, buckets: list) -> list[dict]:
    """Per bucket (bound, [points]) of a dispatch table, the candidate with the smallest
    geometric-mean slowdown against each point's best, among those measured at every point of
    the bucket; adjacent buckets with the same pick merge into the larger bound.

    times: {point: {config: us}} (failed or invalid candidates absent). Returns
    [{"bound", "config", "geo_slowdown", "worst_slowdown"}]; a bucket with no common candidate
    gets config None."""
    picks = []
    for bound, points in buckets:
        points = [pt for pt in points if times.get(pt)]
        common = set.intersection(*(set(times[pt]) for pt in points)) if points else set()
        best = None
        for cfg in sorted(common):
            slow = [times[pt][cfg] / min(times[pt].values()) for pt in points]
            geo = math.exp(sum(map(math.log, slow)) / len(slow))
            if best is None or geo < best["geo_slowdown"]:
                best = {"config": cfg, "geo_slowdown": geo, "worst_slowdown": max(slow)}
        picks.append({"bound": bound, **(best or {"config": None})})
    merged = []
    for pk in picks:
        if merged and pk["config"] is not None and merged[-1]["config"] == pk["config"]:
            merged[-1] = {**pk, "geo_slowdown": max(pk["geo_slowdown"], merged[-1]["geo_slowdown"]),
                          "worst_slowdown": max(pk["worst_slowdown"], merged[-1]["worst_slowdown"])}
        else:
            merged.append(pk)
    return merged


def _sweep_points(records: list[dict]) -> tuple[dict, list[dict]]:
    """({(M, N, K): {config: us}} of valid timings, per-point best vs default rows)."""
    times, best_rows = {}, []
    for r in records:
        if r.get("us") and r.get("valid", True):
            times.setdefault((r["M"], r["N"], r["K"]), {})[r["config"]] = r["us"]
    for pt, cands in times.items():
        dflt = next((r for r in records if (r["M"], r["N"], r["K"]) == pt and r["default"]), None)
        best = min(cands, key=cands.get)
        d_us = dflt.get("us") if dflt else None
        best_rows.append({"M": pt[0], "N": pt[1], "K": pt[2], "best_us": cands[best],
                          "default_us": d_us, "ratio": d_us / cands[best] if d_us else None,
                          "within_10pct": bool(d_us and d_us <= 1.1 * cands[best]),
                          "best": best})
    return times, sorted(best_rows, key=lambda r: (r["N"], r["K"], r["M"]))


def _report_sweep(ctx: Ctx, name: str, records: list[dict], buckets: list, head: str,
                  opener: str, fmt_bound, current: dict | None = None) -> list:
    """Print the per-point table, the failed candidates and a paste-able suggested table
    (a bucket without measurements keeps its `current` row)."""
    times, best_rows = _sweep_points(records)
    bad = [r for r in records if r.get("error") or r.get("valid") is False]
    skipped = sum(1 for r in records if r.get("skipped"))
    print_table(f"{name} tuning sweep: best config per (M, N, K); is the default within 10%?", [
        ("M", "M", 6, ""), ("N", "N", 6, ""), ("K", "K", 6, ""),
        ("default_us", "default us", 11, ".1f"), ("best_us", "best us", 9, ".1f"),
        ("ratio", "dflt/best", 9, ".2f"), ("within_10pct", "<=10%", 6, ""),
        ("best", "best config", 0, "")], best_rows)
    for r in bad:
        print(f"  {'WRONG OUTPUT' if r.get('valid') is False else 'FAILED'}: M={r['M']} "
              f"N={r['N']} K={r['K']} {r['config']} {r.get('error', '')}")
    if skipped:
        print(f"  {skipped} candidates skipped at the section's time limit")
    picks = suggest(times, [(b, [pt for pt in times if pt[0] in ms]) for b, ms in buckets])
    print(f"\n{head}\n{opener}")
    for pk in picks:
        if pk["config"] is not None:
            print(f"    ({fmt_bound(pk['bound'])}, {pk['config']}),  # geo-mean "
                  f"{pk['geo_slowdown']:.2f}x of best, worst {pk['worst_slowdown']:.2f}x")
        elif (current or {}).get(pk["bound"]):
            print(f"    ({fmt_bound(pk['bound'])}, {current[pk['bound']]}),  # not measured: "
                  "current row")
    print(")" if opener.endswith("(") else "", flush=True)
    ctx.res["suggestions"][name] = {"best": best_rows, "table": picks}
    ctx.save()
    return picks


def _report_w4_sweep(ctx: Ctx, W, records: list[dict]) -> None:
    bounds = [b for b, _ in W.DISPATCH]
    ms = sorted({r["M"] for r in records})
    buckets = []
    for i, b in enumerate(bounds):
        lo = bounds[i - 1] if i else 0
        buckets.append((b, [m for m in ms if m > lo and (b is None or m <= b)]))
    _report_sweep(ctx, "w4a16", records, buckets,
                  "Suggested DISPATCH for kernels/w4a16_gemm.py (the current table's M buckets; "
                  "each row picks the smallest geo-mean slowdown over the measured points):",
                  "DISPATCH: tuple[tuple[int | None, W4A16Config], ...] = (", str,
                  {b: cfg_repr(c) for b, c in W.DISPATCH})


# ----------------------------------------------------------------------------- W8A8

def checks_w8a8(ctx: Ctx) -> None:
    from slimserve.kernels import act_quant as A
    from slimserve.kernels import w8a8_gemm as G

    p, dev = ctx.plan, ctx.dev
    for (m, k) in p.aq_shapes:
        for dt in (F16, BF16):
            def aq(m=m, k=k, dt=dt):
                g = _gen("cpu", m + k)
                x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g))
                x = x.to(dt)
                q, s = A.act_quant(x.to(dev))
                q_ref, s_ref = R.quantize_per_token_int8(x)
                bad = (q.cpu() != q_ref).sum().item() + (s.cpu() != s_ref).sum().item()
                return bad == 0, float((q.cpu().int() - q_ref.int()).abs().max()), "codes+scales bit exact"
            run_check(ctx, "act_quant", f"{_DT[dt]} [{m}, {k}]", aq)
    for n, k in p.w8_nk:
        wq = torch.randint(-128, 128, (n, k), generator=_gen(dev, n), device=dev, dtype=torch.int8)
        ws = ((torch.rand(n, 1, generator=_gen(dev, 1), device=dev) + 0.5) * 2.0 ** -9)
        bias = torch.randn(n, generator=_gen(dev, 2), device=dev)
        for m in p.w8_ms:
            a = torch.randint(-128, 128, (m, k), generator=_gen(dev, m), device=dev, dtype=torch.int8)
            a_s = (torch.rand(m, 1, generator=_gen(dev, 3), device=dev) + 0.5) * 2.0 ** -10

            def acc(a=a):
                got, ref = G.w8a8_gemm(a, a_s, wq, ws, None, torch.int32), R.w8a8_matmul_int32(a, wq)
                return torch.equal(got, ref), float((got - ref).abs().max()), "int32 exact"

            def scaled(a=a, a_s=a_s, sdt=F16 if m % 2 else torch.float32, odt=BF16 if m % 2 else F16):
                args = (a, a_s.to(sdt), wq, ws.to(sdt), bias.to(sdt))
                return _ulp_ok(G.w8a8_gemm(*args, odt), R.w8a8_gemm(*args, odt), 1.0)
            run_check(ctx, "w8a8_gemm", f"int32 M={m} N={n} K={k}", acc)
            run_check(ctx, "w8a8_gemm", f"scaled+bias M={m} N={n} K={k} (<= 1 ulp)", scaled)
        for dt in (F16, BF16):
            def lin(dt=dt, m=p.w8_ms[-1]):
                x = _randn((m, k), "cpu", dt, seed=5)
                q, s = R.quantize_per_token_int8(x)  # on the CPU: the CPU tests' oracle
                ref = R.w8a8_gemm(q.to(dev), s.to(dev), wq, ws.to(dt), None, dt)
                return _ulp_ok(G.linear_w8a8(x.to(dev), wq, ws.to(dt)), ref, 1.0)
            run_check(ctx, "linear_w8a8", f"{_DT[dt]} M={p.w8_ms[-1]} N={n} K={k} (<= 1 ulp)", lin)
        ctx.save()


def w8_candidates(G) -> list:
    C = G.W8A8Config
    return [C(128, 128, 128, 8, 8, 4), C(128, 128, 128, 8, 4, 4), C(128, 256, 128, 8, 8, 3),
            C(256, 128, 128, 8, 8, 3), C(128, 256, 64, 8, 8, 4), C(128, 128, 64, 8, 4, 4),
            C(64, 128, 128, 8, 4, 4), C(128, 64, 128, 8, 4, 4)]


def time_w8a8(ctx: Ctx) -> None:
    from slimserve.kernels import w8a8_gemm as G
    from slimserve.kernels.act_quant import act_quant

    p, dev, rows, weights = ctx.plan, ctx.dev, [], {}
    for si, (n, k) in enumerate(p.t_nk):
        wq = torch.randint(-128, 128, (n, k), generator=_gen(dev, si), device=dev, dtype=torch.int8)
        ws = torch.rand(n, 1, generator=_gen(dev, si), device=dev).to(F16) * 1e-3
        weights[(n, k)] = (wq, ws)
        wd = _randn((n, k), dev, F16, seed=si, scale=0.02)
        for m in p.t_w8_ms:
            rows.append(_w8_row(ctx, G, wq, ws, wd, _randn((m, k), dev, F16, seed=m)))
        ctx.res["tables"]["w8a8"] = rows
        ctx.save()
        del wd
    print_table("W8A8 (act_quant + int8 GEMM, fp16 out) vs cuBLAS fp16 | target >= 1.5x at "
                "M >= 1024", [
                    ("N", "N", 6, ""), ("K", "K", 6, ""), ("M", "M", 5, ""),
                    ("fp16_us", "fp16 us", 9, ".1f"), ("fp16_TFLOPs", "fp16 TF/s", 9, ".0f"),
                    ("w8_us", "w8a8 us", 9, ".1f"), ("w8_TOPs", "w8a8 TOP/s", 10, ".0f"),
                    ("speedup", "speedup", 8, ".2f"), ("gemm_us", "gemm us", 9, ".1f"),
                    ("gemm_TOPs", "gemm TOP/s", 10, ".0f"), ("gemm_speedup", "gemm x", 7, ".2f"),
                    ("gemm_GBps", "gemm GB/s", 9, ".0f"), ("gemm_pct_copy", "%copy", 6, ".0f"),
                    ("aq_us", "quant us", 8, ".1f"), ("target", "target", 6, "")], rows)
    sweep, deadline = [], ctx.t0 + 0.85 * p.limits.get("w8a8", 1e9)
    default = {(r["M"], r["N"], r["K"]): r.get("gemm_us") for r in rows}
    for m in p.sweep_w8_ms:
        for (n, k), (wq, ws) in weights.items():
            if default.get((m, n, k)):
                try:
                    a, a_s = act_quant(_randn((m, k), dev, F16, seed=m))
                    sweep += _w8_sweep(ctx, G, a, a_s, wq, ws, default[(m, n, k)], deadline)
                except Exception:
                    ctx.error(f"w8a8 sweep M={m} N={n} K={k}")
        ctx.res["sweeps"]["w8a8"] = sweep
        ctx.save()
    if sweep:
        ms = sorted({r["M"] for r in sweep})
        buckets = [(m if i < len(ms) - 1 else None, [m]) for i, m in enumerate(ms)]
        _report_sweep(ctx, "w8a8", sweep, buckets,
                      f"Suggested rows for the tail of CONFIGS in kernels/w8a8_gemm.py (M >= {ms[0]}"
                      " measured; the first bound also takes the unmeasured Ms below it):",
                      "    # ... rows for smaller M unchanged ...",
                      lambda b: "1 << 62" if b is None else str(b))


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
        row.update(fp16_us=t16, w8_us=tl_, gemm_us=tg, aq_us=ta, fp16_TFLOPs=fl / t16,
                   w8_TOPs=fl / tl_, gemm_TOPs=fl / tg, speedup=t16 / tl_,
                   gemm_speedup=t16 / tg, gemm_GBps=gb, gemm_pct_copy=ctx.pct(gb))
        if m >= 1024:
            row["target"] = ctx.target(f"w8a8 M={m} N={n} K={k} >= 1.5x fp16",
                                       t16 / tl_ >= 1.5, f"{t16 / tl_:.2f}x")
    except Exception:
        ctx.error(f"w8a8 M={m} N={n} K={k}")
    return row


def _w8_sweep(ctx: Ctx, G, a, a_s, wq, ws, t_default, deadline) -> list[dict]:
    m, n, k = a.shape[0], wq.shape[0], wq.shape[1]
    ref = G.w8a8_gemm(a, a_s, wq, ws, None, F16)
    out = [{"M": m, "N": n, "K": k, "config": cfg_repr(G.default_config(m)), "default": True,
            "us": t_default}]
    for cfg in w8_candidates(G):
        if cfg == G.default_config(m):
            continue
        rec = {"M": m, "N": n, "K": k, "config": cfg_repr(cfg), "default": False}
        if time.monotonic() > deadline:
            rec["skipped"] = "time limit"
        else:
            try:
                rec["valid"] = torch.equal(G.w8a8_gemm(a, a_s, wq, ws, None, F16, config=cfg), ref)
                rec["us"] = ctx.bench(lambda: G.w8a8_gemm(a, a_s, wq, ws, None, F16, config=cfg),
                                      sweep=True)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        out.append(rec)
    return out


# ----------------------------------------------------------------------------- attention

def make_paged_kv(ctxs, hkv, d, bs, kv_dtype, dev, seed):
    """Caches whose blocks are a random permutation of physical ids (scattered), plus block
    tables and context lengths; fp8 codes spread over +-16 (scaled by 0.25 / 0.5: +-4, +-8)."""
    g = _gen(dev, seed)
    per_seq = max(1, max(-(-c // bs) for c in ctxs))
    nblk = len(ctxs) * per_seq + 3
    tables = torch.randperm(nblk, generator=g, device=dev)[: len(ctxs) * per_seq]
    spread = 4.0 if kv_dtype == FP8 else 1.0
    k = (torch.randn(nblk, bs, hkv, d, generator=g, device=dev) * spread).to(kv_dtype)
    v = (torch.randn(nblk, bs, hkv, d, generator=g, device=dev) * spread).to(kv_dtype)
    return (k, v, tables.view(len(ctxs), per_seq).int(),
            torch.tensor(ctxs, dtype=torch.int32, device=dev))


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
    scale = d ** -0.5
    dec = PA.default_config("decode", d)
    pre = PA.default_config("prefill", d)
    if p.cpu_tiles:
        dec, pre = PA.AttentionConfig(block_n=32, partition=32), PA.AttentionConfig(16, 16)
    for qdt, kvdt in ((F16, F16), (BF16, BF16), (F16, FP8), (BF16, FP8)):
        tag = f"q {_DT[qdt]} kv {_DT[kvdt]}"
        for split in (False, True):
            def decode(split=split, qdt=qdt, kvdt=kvdt):
                kc, vc, bt, cl = make_paged_kv(p.dec_ctx, hkv, d, bs, kvdt, dev, seed=3)
                q = _randn((len(p.dec_ctx), h, d), dev, qdt, seed=4)
                out = PA.paged_attention_decode(q, kc, vc, bt, cl, scale, ks, vs,
                                                config=replace(dec, split=split))
                ref = _twin(R.paged_attention_decode, q, kc, vc, bt, cl, scale, ks, vs)
                return _attn_close(out, ref, vc, vs)
            run_check(ctx, "paged_attention_decode", f"{tag} {'split' if split else 'one pass'} "
                      f"ctx {min(p.dec_ctx)}..{max(p.dec_ctx)}", decode)

        def prefill(qdt=qdt, kvdt=kvdt):
            q_lens, ctxs = p.prefill
            kc, vc, bt, cl = make_paged_kv(ctxs, hkv, d, bs, kvdt, dev, seed=5)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=dev)
            q = _randn((sum(q_lens), h, d), dev, qdt, seed=6)
            out = PA.paged_attention_prefill(q, kc, vc, bt, cu, cl, scale, ks, vs, config=pre,
                                             max_q_len=max(q_lens))
            ref = _twin(R.paged_attention_prefill, q, kc, vc, bt, cu, cl, scale, ks, vs)
            return _attn_close(out, ref, vc, vs)
        run_check(ctx, "paged_attention_prefill", f"{tag} q {p.prefill[0]} ctx {p.prefill[1]}",
                  prefill)
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
        kc = _randn((nblk, bs, hkv, d), dev, F16, seed=1).to(kv_dtype)
        vc = _randn((nblk, bs, hkv, d), dev, F16, seed=2).to(kv_dtype)
        for b, c in cases:
            row = {"batch": b, "ctx": c, "kv": _DT[kv_dtype]}
            try:
                row.update(_decode_row(ctx, PA, kc, vc, tables[:b, : c // bs].contiguous(), b, c,
                                       h, ks, vs))
                if kv_dtype == F16:
                    base[(b, c)] = row["us"]
                elif (b, c) in base:
                    row["vs_fp16"] = base[(b, c)] / row["us"]
                    if b == p.dec_batch and c >= 4096:
                        row["target"] = ctx.target(
                            f"fp8 decode B={b} ctx={c} >= 1.6x fp16 and >= 70% copy",
                            row["vs_fp16"] >= 1.6 and (row["pct_copy"] or 0) >= 70,
                            f"{row['vs_fp16']:.2f}x, {row['pct_copy'] or 0:.0f}% copy")
            except Exception:
                ctx.error(f"decode B={b} ctx={c} {_DT[kv_dtype]}")
            rows.append(row)
        del kc, vc
    ctx.res["tables"]["decode"] = rows
    ctx.save()
    print_table(f"Paged decode attention ({h} q heads, {hkv} KV heads, D {d}, block {bs}, "
                f"scattered blocks, fp16 q) | GB/s of KV read vs copy {_fmt(ctx.copy_gbps, '.0f')} GB/s | "
                "target fp8 >= 1.6x fp16 and >= 70% copy at long context", [
                    ("batch", "batch", 6, ""), ("ctx", "ctx", 6, ""), ("kv", "kv", 6, ""),
                    ("path", "path", 7, ""), ("us", "us", 10, ".1f"), ("GBps", "GB/s", 8, ".0f"),
                    ("pct_copy", "%copy", 7, ".0f"), ("other_path", "other", 8, ""),
                    ("other_us", "other us", 10, ".1f"), ("vs_fp16", "fp8 x", 7, ".2f"),
                    ("target", "target", 8, "")], rows)
    _time_prefill(ctx, PA)


def _decode_row(ctx: Ctx, PA, kc, vc, bt, b, c, h, ks, vs) -> dict:
    """Default path and the other one (split / one pass) at one (batch, context)."""
    d, hkv = kc.shape[3], kc.shape[2]
    q = _randn((b, h, d), ctx.dev, F16, seed=b + c)
    cl = torch.full((b,), c, dtype=torch.int32, device=ctx.dev)
    dflt = PA.default_config("decode", d)
    split = PA.use_split(b, hkv, c, dflt, ctx.dev)
    other = replace(dflt, split=not split)
    t = ctx.bench(lambda: PA.paged_attention_decode(q, kc, vc, bt, cl, d ** -0.5, ks, vs))
    t_other = ctx.bench(lambda: PA.paged_attention_decode(q, kc, vc, bt, cl, d ** -0.5, ks, vs,
                                                          config=other))
    gb = 2 * b * c * hkv * d * kc.element_size() / t / 1e3  # K and V bytes read
    return {"path": "split" if split else "1pass", "us": t, "GBps": gb, "pct_copy": ctx.pct(gb),
            "other_path": "1pass" if split else "split", "other_us": t_other}


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
        k = _randn((total, hkv, d), dev, F16, seed=11)
        v = _randn((total, hkv, d), dev, F16, seed=12)
        q = _randn((n_new, h, d), dev, F16, seed=13)
        qs = q.transpose(0, 1)[None].contiguous()  # [1, H, n_new, D]
        kr, vr = (t.repeat_interleave(h // hkv, 1).transpose(0, 1)[None].contiguous() for t in (k, v))
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
            out = PA.paged_attention_prefill(q, kc, vc, bt, cu, cl, d ** -0.5, sc, sc,
                                             max_q_len=n_new)
            diff = None if sdpa is None else \
                (out.transpose(0, 1)[None].float() - sdpa.float()).abs().max().item()
            t = ctx.bench(lambda: PA.paged_attention_prefill(q, kc, vc, bt, cu, cl, d ** -0.5,
                                                             sc, sc, max_q_len=n_new))
            rows.append({"impl": f"paged prefill {_DT[kv_dtype]} KV", "us": t,
                         "TFLOPs": flops / t, "vs_sdpa": t_base / t if t_base else None,
                         "max_diff_vs_sdpa": diff})
    except Exception:
        ctx.error("prefill timing")
    ctx.res["tables"]["prefill"] = rows
    ctx.save()
    print_table(f"Chunked prefill: {n_new} new queries after {cached} cached tokens, {h}/{hkv} "
                f"heads, D {d}, fp16 q (TF/s of each row's own work; 'vs SDPA' against the "
                "exact causal SDPA row)", [
                    ("impl", "impl", 46, ""), ("us", "us", 10, ".1f"),
                    ("TFLOPs", "TF/s", 8, ".1f"), ("vs_sdpa", "vs SDPA", 9, ".2f"),
                    ("max_diff_vs_sdpa", "max |diff|", 12, ".3g")], rows)


def _sdpa_rows(ctx: Ctx, qs, kr, vr, rows, flops_causal, flops_full):
    """Time the SDPA baselines; returns (causal output or None, causal time or None)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sdpa = t_causal = None
    try:
        mask = causal_lower_right(qs.shape[2], kr.shape[2])
        sdpa = F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask)
        t_causal = ctx.bench(lambda: F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask))
        rows.append({"impl": "torch SDPA lower-right causal (contiguous)", "us": t_causal,
                     "TFLOPs": flops_causal / t_causal})
    except Exception:
        ctx.error("SDPA lower-right causal baseline")
    try:
        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, kr, vr)
        t = ctx.bench(flash)
        rows.append({"impl": "torch SDPA flash, no mask (+6% work)", "us": t,
                     "TFLOPs": flops_full / t})
    except Exception:
        ctx.error("SDPA flash baseline")
    return sdpa, t_causal


# ----------------------------------------------------------------------------- row kernels

def checks_norm(ctx: Ctx) -> None:
    from slimserve.kernels import activation as ACT
    from slimserve.kernels import rms_norm as RN
    from slimserve.kernels.kv_cache import write_kv_cache

    p, dev = ctx.plan, ctx.dev
    t, hidden, inter = p.rows
    _, hkv, d, bs = p.attn
    for kdt, cdt in ((F16, F16), (BF16, BF16), (F16, FP8), (BF16, FP8), (torch.float32, FP8)):
        def kv(kdt=kdt, cdt=cdt):
            n, g = p.kv_tokens, _gen("cpu", 1)
            key, val = (torch.randn(n, hkv, d, generator=g) * 8).to(kdt), (torch.randn(n, hkv, d, generator=g) * 8).to(kdt)
            nblk = 2 * -(-n // bs) + 1
            slots = torch.randperm(nblk * bs, generator=g)[:n]
            slots[::10] = -1  # padding tokens are skipped
            kc, vc = torch.zeros(nblk, bs, hkv, d, dtype=cdt), torch.zeros(nblk, bs, hkv, d, dtype=cdt)
            kc_d, vc_d = kc.to(dev), vc.to(dev)
            write_kv_cache(key.to(dev), val.to(dev), kc_d, vc_d, slots.to(dev), 0.5, 0.25)
            R.write_kv_cache(key, val, kc, vc, slots, 0.5, 0.25)
            view = torch.uint8 if cdt == FP8 else torch.int16
            bad = sum((a.cpu().view(view) != b.view(view)).sum().item() for a, b in ((kc_d, kc), (vc_d, vc)))
            return bad == 0, float(bad), "mismatched codes (bit exact)"
        run_check(ctx, "write_kv_cache", f"{_DT[kdt]} -> {_DT[cdt]} cache, {p.kv_tokens} tokens", kv)
    for dt in (F16, BF16):
        g = _gen("cpu", 2)
        x, r = (torch.randn(t, hidden, generator=g) * 4).to(dt), (torch.randn(t, hidden, generator=g) * 4).to(dt)
        w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dt)

        def rms(x=x, w=w):
            return _ulp_ok(RN.rms_norm(x.to(dev), w.to(dev), 1e-6).cpu(), R.rms_norm(x, w, 1e-6), 2, 0.01)

        def fused(x=x, r=r, w=w):
            out, res = RN.fused_add_rms_norm(x.to(dev), r.to(dev), w.to(dev), 1e-6)
            ref_out, ref_res = R.fused_add_rms_norm(x, r, w, 1e-6)
            ok, err, note = _ulp_ok(out.cpu(), ref_out, 2, 0.01)
            return ok and torch.equal(res.cpu(), ref_res), err, note + ", sum exact"

        def silu(dt=dt):
            xs = (torch.randn(t, 2 * inter, generator=_gen("cpu", 3)) * 4).to(dt)
            return _ulp_ok(ACT.silu_and_mul(xs.to(dev)).cpu(), R.silu_and_mul(xs), 2, 0.01)
        run_check(ctx, "rms_norm", f"{_DT[dt]} [{t}, {hidden}] (<= 2 ulp)", rms)
        run_check(ctx, "fused_add_rms_norm", f"{_DT[dt]} [{t}, {hidden}] (<= 2 ulp)", fused)
        run_check(ctx, "silu_and_mul", f"{_DT[dt]} [{t}, {2 * inter}] (<= 2 ulp)", silu)
    ctx.save()


def time_norm(ctx: Ctx) -> None:
    from slimserve.kernels import act_quant as A
    from slimserve.kernels import activation as ACT
    from slimserve.kernels import rms_norm as RN
    from slimserve.kernels.kv_cache import write_kv_cache

    p, dev, rows = ctx.plan, ctx.dev, []
    t, hidden, inter = p.t_rows
    _, hkv, d, bs = p.attn
    x, r = _randn((t, hidden), dev, F16, 1), _randn((t, hidden), dev, F16, 2)
    w = torch.ones(hidden, dtype=F16, device=dev)
    xs = _randn((t, 2 * inter), dev, F16, 3)
    xi = xs[:, :inter].contiguous()
    key, val = _randn((t, hkv, d), dev, F16, 4), _randn((t, hkv, d), dev, F16, 5)
    nblk = 2 * -(-t // bs)
    slots = torch.randperm(nblk * bs, device=dev)[:t]
    kvb = t * hkv * d
    sc = torch.tensor([0.5], device=dev)  # a device scale: a float would cost a fill per call
    cases = []
    for cdt in (F16, FP8):
        kc = torch.zeros(nblk, bs, hkv, d, dtype=cdt, device=dev)
        vc = torch.zeros_like(kc)
        cases.append((f"write_kv_cache -> {_DT[cdt]}", f"[{t}, {hkv}, {d}] x2",
                      2 * kvb * (2 + kc.element_size()) + 8 * t,
                      lambda kc=kc, vc=vc: write_kv_cache(key, val, kc, vc, slots, sc, sc),
                      lambda kc=kc, vc=vc: R.write_kv_cache(key, val, kc, vc, slots, 0.5, 0.5)))
    n = t * hidden
    cases += [
        ("rms_norm", f"[{t}, {hidden}]", 4 * n, lambda: RN.rms_norm(x, w, 1e-6),
         lambda: R.rms_norm(x, w, 1e-6)),
        ("fused_add_rms_norm", f"[{t}, {hidden}]", 8 * n,
         lambda: RN.fused_add_rms_norm(x, r, w, 1e-6), lambda: R.fused_add_rms_norm(x, r, w, 1e-6)),
        ("silu_and_mul", f"[{t}, {2 * inter}]", 6 * t * inter, lambda: ACT.silu_and_mul(xs),
         lambda: R.silu_and_mul(xs)),
        ("act_quant", f"[{t}, {hidden}]", 3 * n + 2 * t, lambda: A.act_quant(x),
         lambda: R.quantize_per_token_int8(x)),
        ("act_quant", f"[{t}, {inter}]", 3 * t * inter + 2 * t, lambda: A.act_quant(xi),
         lambda: R.quantize_per_token_int8(xi)),
    ]
    for name, shape, nbytes, fn, twin in cases:
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
    print_table(f"Row kernels (fp16, memory bound) vs torch eager twins | copy "
                f"{_fmt(ctx.copy_gbps, '.0f')} GB/s", [
                    ("kernel", "kernel", 24, ""), ("shape", "shape", 20, ""), ("us", "us", 9, ".1f"),
                    ("GBps", "GB/s", 8, ".0f"), ("pct_copy", "%copy", 7, ".0f"),
                    ("torch_us", "torch us", 10, ".1f"), ("speedup", "speedup", 9, ".2f")], rows)


# ----------------------------------------------------------------------------- orchestration

CHECKS = {"w4a16": checks_w4a16, "w8a8": checks_w8a8, "attn": checks_attn, "norm": checks_norm}
TIMINGS = {"w4a16": time_w4a16, "w8a8": time_w8a8, "attn": time_attn, "norm": time_norm}


def run_e2e(ctx: Ctx) -> None:
    from slimserve.eval import engine_bench

    print(f"\nEnd to end: engine_bench {' '.join(ctx.plan.e2e)}", flush=True)
    try:
        ctx.res["tables"]["e2e"] = engine_bench.main(list(ctx.plan.e2e))
    except Exception:
        ctx.error("e2e engine_bench")
    ctx.save()


def run_section(section: str, ctx: Ctx) -> None:
    """Correctness (with exact fp32 matmuls and no reduced-precision cuBLAS reductions), then
    the timings under the defaults the engine runs with."""
    if section == "e2e":
        if ctx.plan.timings:
            run_e2e(ctx)
        else:
            print("\n== e2e: skipped (no CUDA) ==", flush=True)
        ctx.res["done"] = True
        ctx.save()
        return
    mm = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), mm.allow_fp16_reduced_precision_reduction,
             mm.allow_bf16_reduced_precision_reduction)
    torch.set_float32_matmul_precision("highest")
    mm.allow_fp16_reduced_precision_reduction = mm.allow_bf16_reduced_precision_reduction = False
    print(f"\n== {section}: correctness vs torch twins ==", flush=True)
    try:
        CHECKS[section](ctx)
    except Exception:
        ctx.error(f"{section} checks")
    torch.set_float32_matmul_precision(saved[0])
    mm.allow_fp16_reduced_precision_reduction, mm.allow_bf16_reduced_precision_reduction = saved[1:]
    ctx.save()
    if ctx.plan.timings:
        if CUDA:
            torch.cuda.empty_cache()
        try:
            TIMINGS[section](ctx)
        except Exception:
            ctx.error(f"{section} timings")
    ctx.res["done"] = True
    ctx.save()


def hardware() -> dict:
    info = {"torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "cuda": torch.version.cuda}
    if CUDA:
        prop = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sms=prop.multi_processor_count,
                    memory_GiB=round(prop.total_memory / 2**30, 1),
                    capability=f"{prop.major}.{prop.minor}")
    else:
        info.update(device="CPU (no CUDA: Triton interpreter)", sms=None)
    return info


def copy_bandwidth(plan: Plan) -> float:
    """Device-to-device copy in GB/s, read + write bytes counted (1 GiB each way)."""
    n = 2**29 if plan.name == "full" else 2**27
    us = _copy_us(n)
    torch.cuda.empty_cache()
    return 2 * n * 2 / us / 1e3


def _copy_us(n: int) -> float:
    src = torch.ones(n, dtype=F16, device="cuda")
    dst = torch.empty_like(src)
    return _bench(lambda: dst.copy_(src), 10, 100)


def _use_kernels_on_cpu() -> None:
    """Without CUDA the launchers must take the Triton kernels (interpreted), not the twins."""
    if not CUDA:
        os.environ["SLIMSERVE_KERNELS"] = "triton"


def _child(args) -> int:
    _use_kernels_on_cpu()
    plan = PLANS[args.plan]
    if args.limit:
        plan = replace(plan, limits={**plan.limits, args.child: args.limit})
    ctx = Ctx(plan, torch.device("cuda" if CUDA else "cpu"), args.copy_gbps, args.result)
    run_section(args.child, ctx)
    return 0


def _spawn(section: str, plan: Plan, copy_gbps: float | None, timeout: float) -> dict:
    """Run one section in a child process; whatever it saved comes back even on a crash."""
    fd, path = tempfile.mkstemp(prefix=f"kb-{section}-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, "-m", "slimserve.eval.kernel_bench", "--child", section, "--plan",
           plan.name, "--result", path, "--limit", str(timeout)]
    if copy_gbps:
        cmd += ["--copy-gbps", str(copy_gbps)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    status = "ok"
    sys.stdout.flush()
    try:
        rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
        status = "ok" if rc == 0 else f"child exited with code {rc}"
    except subprocess.TimeoutExpired:
        status = f"killed at its {timeout:.0f} s limit"
    res = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        os.unlink(path)
    if status != "ok" or not res.get("done"):
        print(f"\n!! section {section}: {status}; {'partial' if res else 'no'} results kept",
              flush=True)
        res.setdefault("errors", []).append({"where": section, "traceback": status})
    return res


def summarize(results: dict) -> bool:
    """Print the per-kernel PASS/FAIL summary and the missed targets; True if all passed."""
    print("\n== Summary ==")
    kernels: dict = {}
    for sec in results.values():
        for c in sec.get("correctness", []):
            k = kernels.setdefault(c["kernel"], [0, 0, 0.0])
            k[0 if c["ok"] else 1] += 1
            if c.get("max_err") is not None:
                k[2] = max(k[2], c["max_err"])
    for name, (ok, bad, err) in kernels.items():
        print(f"{'PASS' if not bad else 'FAIL'}  {name:<24} {ok} passed, {bad} failed, "
              f"worst max err {err:.3g}")
    missed = [t for sec in results.values() for t in sec.get("targets", []) if not t["ok"]]
    hit = sum(1 for sec in results.values() for t in sec.get("targets", []) if t["ok"])
    if hit or missed:
        print(f"targets: {hit} met, {len(missed)} missed")
    for t in missed:
        print(f"  MISS {t['target']}: {t['detail']}")
    e2e = results.get("e2e", {}).get("tables", {}).get("e2e") or []
    if e2e:
        print("e2e: " + ", ".join(f"{r['config']} {r['output_tok_per_s']:.0f} out tok/s"
                                  for r in e2e))
    errors = [e for sec in results.values() for e in sec.get("errors", [])]
    for e in errors:
        print(f"  ERROR {e['where']}: {e['traceback'].splitlines()[-1] if e['traceback'] else ''}")
    return all(not bad for _, bad, _ in kernels.values()) and not errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shrink every size and sweep")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--json-out", default=None, help="default: $OUT/kernel_bench.json if $OUT")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply every section's time limit (the full plan's sum to 430 s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--copy-gbps", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"error: --sections {','.join(bad)} unknown; choose from {','.join(SECTIONS)}")
        return 2
    _use_kernels_on_cpu()
    plan = PLANS["cpu" if not CUDA else "quick" if args.quick else "full"]
    plan = replace(plan, limits={k: v * args.time_scale for k, v in plan.limits.items()})
    out_path = args.json_out or (os.path.join(os.environ["OUT"], "kernel_bench.json")
                                 if os.environ.get("OUT") else None)
    t0 = time.monotonic()
    hw = hardware()
    print(f"slimserve kernel bench | {hw['device']} | SMs {hw.get('sms')} | sm_{hw.get('capability')}"
          f" | {hw.get('memory_GiB')} GiB | torch {hw['torch']} | triton {hw['triton']} | "
          f"CUDA {hw['cuda']} | python {hw['python']} | plan {plan.name}", flush=True)
    if not CUDA:
        print("No CUDA device: correctness checks at tiny shapes through the Triton interpreter "
              "(TRITON_INTERPRET=1); timings and e2e skipped.")
    report = {"hardware": hw, "plan": plan.name, "sections": sections, "results": {}}
    if CUDA:
        report["copy_GBps"] = None
        try:
            report["copy_GBps"] = copy_bandwidth(plan)
            print(f"device-to-device copy: {report['copy_GBps']:.0f} GB/s (read + write bytes)",
                  flush=True)
        except Exception:
            print(f"copy bandwidth failed:\n{_tail(traceback.format_exc())}", flush=True)
    total = sum(plan.limits.get(s, 0) for s in sections)
    for i, sec in enumerate(sections):
        s0 = time.monotonic()
        if CUDA:
            # the section's own limit plus whatever earlier sections left unused
            later = sum(plan.limits.get(s, 0) for s in sections[i + 1:])
            limit = max(30.0, total - (time.monotonic() - t0) - later)
            res = _spawn(sec, replace(plan, limits={**plan.limits, sec: limit}),
                         report["copy_GBps"], limit)
        else:
            ctx = Ctx(plan, torch.device("cpu"), None, None)
            run_section(sec, ctx)
            res = ctx.res
        res["seconds"] = time.monotonic() - s0
        report["results"][sec] = res
        if out_path:
            _write_json(out_path, report)
    ok = summarize(report["results"])
    report["seconds"] = time.monotonic() - t0
    print("time per section: " + ", ".join(f"{s} {r['seconds']:.0f} s"
                                            for s, r in report["results"].items())
          + f"; total {report['seconds']:.0f} s")
    if out_path:
        _write_json(out_path, report)
        print(f"results: {out_path}")
    return 0 if ok else 1


def _write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(report), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
