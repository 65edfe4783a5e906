"""kernel_bench's shared pieces: the device flag (set before any kernel module is imported),
dtype names, seeded inputs, ulp checks, do_bench timing, table printing, and the per-section
context that records every check, table and error and saves them after each one."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch

from slimserve.eval.kernels.plans import Plan

CUDA = torch.cuda.is_available()
if not CUDA:  # read when the kernel modules define their @triton.jit functions: set it first
    os.environ.setdefault("TRITON_INTERPRET", "1")

F16, BF16, FP8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
DT = {F16: "fp16", BF16: "bf16", FP8: "fp8", torch.float32: "fp32"}


def gen(dev, seed: int) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def randn(shape, dev, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=gen(dev, seed), device=dev) * scale).to(dtype)


def ulp_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in ulps of ref's dtype at |ref| (ulp(r) = 2^floor(log2 r) * eps)."""
    fin = torch.finfo(ref.dtype)
    r = ref.float().abs().clamp_min(fin.tiny)
    return (out.float() - ref.float()).abs() / (torch.exp2(torch.floor(torch.log2(r))) * fin.eps)


def ulp_ok(out, ref, max_ulp: float, max_frac: float = 1.0):
    """(ok, max ulp error, note): shapes and dtypes equal, every element within max_ulp and at
    most max_frac of them differing at all."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return (
            False,
            math.inf,
            f"got {out.dtype}{tuple(out.shape)}, want {ref.dtype}{tuple(ref.shape)}",
        )
    err = ulp_err(out, ref)
    frac = (out != ref).float().mean().item()
    return err.max().item() <= max_ulp and frac <= max_frac, err.max().item(), f"{frac:.2%} differ"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def bench(fn, warmup: int, rep: int) -> float:
    """Median GPU time of fn() in microseconds."""
    from triton.testing import do_bench

    r = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])
    return float(r[0] if isinstance(r, (list, tuple)) else r) * 1e3


def fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec) if spec else str(v)


def print_table(title: str, cols: list[tuple[str, str, int, str]], rows: list[dict]) -> None:
    """cols: (key, header, width, format spec); a missing key prints '-'."""
    print(f"\n{title}")
    print(" ".join(f"{h:>{w}}" for _, h, w, _ in cols))
    for r in rows:
        print(" ".join(f"{fmt(r.get(k), s):>{w}}" for k, _, w, s in cols))
    sys.stdout.flush()


class Ctx:
    """One section's run: device, plan, copy bandwidth, results (saved after every table)."""

    def __init__(
        self, plan: Plan, dev: torch.device, copy_gbps: float | None, result_path: str | None
    ):
        self.plan, self.dev, self.copy_gbps, self.path = plan, dev, copy_gbps, result_path
        self.res: dict = {
            "correctness": [],
            "tables": {},
            "sweeps": {},
            "suggestions": {},
            "errors": [],
            "targets": [],
        }
        self.t0 = time.monotonic()

    def save(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(clean(self.res), f)
            os.replace(self.path + ".tmp", self.path)

    def error(self, where: str) -> None:
        tb = tail(traceback.format_exc())
        print(f"ERROR in {where}:\n{tb}", flush=True)
        self.res["errors"].append({"where": where, "traceback": tb})

    def pct(self, gbps: float | None) -> float | None:
        return 100.0 * gbps / self.copy_gbps if gbps and self.copy_gbps else None

    def bench(self, fn, sweep: bool = False) -> float:
        p = self.plan
        return bench(fn, p.warmup // 2 if sweep else p.warmup, p.sweep_rep if sweep else p.rep)

    def target(self, name: str, ok: bool, detail: str) -> str:
        self.res["targets"].append({"target": name, "ok": bool(ok), "detail": detail})
        return "ok" if ok else "MISS"


def clean(obj):
    """JSON-safe: non-finite floats -> None, tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def run_check(ctx: Ctx, kernel: str, case: str, fn) -> None:
    """Run one check (fn() -> (ok, max error, note)); an exception is a FAIL, not an abort."""
    t0 = time.perf_counter()
    try:
        ok, err, note = fn()
        sync()
    except Exception:
        ok, err, note = False, math.nan, "exception"
        print(tail(traceback.format_exc()), flush=True)
    status = "PASS" if ok else "FAIL"
    print(f"{status}  {kernel:<24} {case:<46} max err {err:<10.3g} {note}", flush=True)
    ctx.res["correctness"].append(
        {
            "kernel": kernel,
            "case": case,
            "ok": bool(ok),
            "max_err": float(err),
            "note": note,
            "seconds": time.perf_counter() - t0,
        }
    )
    ctx.save()  # a child killed at its time limit still reports the checks it finished


def twin(fn, *args):
    """A torch twin on the inputs' device, or on CPU copies when the device lacks an op for a
    dtype (float8 indexing on older CUDA builds); the result comes back to the device."""
    try:
        return fn(*args)
    except (RuntimeError, NotImplementedError):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        return out.to(dev)


def memo(fn):
    box = []

    def get():
        if not box:
            box.append(fn())
        return box[0]

    return get
