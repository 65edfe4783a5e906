"""Kernel benchmark on one GPU: correctness of every Triton kernel against its torch twin at
Llama-7B/8B shapes, then triton.testing.do_bench timings against cuBLAS / torch baselines (one
table per section, bandwidth as a share of the measured device copy bandwidth), W4A16 and W8A8
tile sweeps with suggested dispatch tables, and the end-to-end engine benchmark.

    python -m slimserve.eval.kernels.bench [--quick] [--sections w4a16,w8a8,attn,norm,e2e]
                                          [--json-out F]

On CUDA every section runs in a child process with a time limit, so a CUDA fault or a hang in one
kernel cannot take the others down; children save their results after every table and the
parent merges them into one JSON (default $OUT/kernel_bench.json when $OUT is set). A failed
check or a failed row is reported and the run goes on; the exit code is 1 if anything failed.
Without CUDA the script says so, runs the correctness checks at tiny shapes through the Triton
interpreter, in process, and skips the timings.

Times are do_bench medians of GPU time between events, L2 flushed before every call: host-side
launcher overhead is not counted (the engine pays it once per step, outside these numbers).
e2e imports pydantic, absent on the nvidia-h200 image: carry it and its deps as wheels in .whl/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace

import torch

# common.py sets TRITON_INTERPRET (no CUDA) before any kernel module is imported; the
# sections import their kernels inside their functions, and triton is imported in hardware()
from slimserve.eval.kernels.attention import checks_attn, time_attn
from slimserve.eval.kernels.common import CUDA, F16, Ctx, bench, clean, tail
from slimserve.eval.kernels.plans import PLANS, SECTIONS, Plan
from slimserve.eval.kernels.rows import checks_norm, time_norm
from slimserve.eval.kernels.w4a16 import checks_w4a16, time_w4a16
from slimserve.eval.kernels.w8a8 import checks_w8a8, time_w8a8

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
    saved = (
        torch.get_float32_matmul_precision(),
        mm.allow_fp16_reduced_precision_reduction,
        mm.allow_bf16_reduced_precision_reduction,
    )
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
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if CUDA:
        prop = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            sms=prop.multi_processor_count,
            memory_GiB=round(prop.total_memory / 2**30, 1),
            capability=f"{prop.major}.{prop.minor}",
        )
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
    return bench(lambda: dst.copy_(src), 10, 100)


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
    cmd = [
        sys.executable,
        "-m",
        "slimserve.eval.kernels.bench",
        "--child",
        section,
        "--plan",
        plan.name,
        "--result",
        path,
        "--limit",
        str(timeout),
    ]
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
        print(
            f"\n!! section {section}: {status}; {'partial' if res else 'no'} results kept",
            flush=True,
        )
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
        print(
            f"{'PASS' if not bad else 'FAIL'}  {name:<24} {ok} passed, {bad} failed, "
            f"worst max err {err:.3g}"
        )
    missed = [t for sec in results.values() for t in sec.get("targets", []) if not t["ok"]]
    hit = sum(1 for sec in results.values() for t in sec.get("targets", []) if t["ok"])
    if hit or missed:
        print(f"targets: {hit} met, {len(missed)} missed")
    for t in missed:
        print(f"  MISS {t['target']}: {t['detail']}")
    e2e = results.get("e2e", {}).get("tables", {}).get("e2e") or []
    if e2e:
        print(
            "e2e: " + ", ".join(f"{r['config']} {r['output_tok_per_s']:.0f} out tok/s" for r in e2e)
        )
    errors = [e for sec in results.values() for e in sec.get("errors", [])]
    for e in errors:
        print(f"  ERROR {e['where']}: {e['traceback'].splitlines()[-1] if e['traceback'] else ''}")
    return all(not bad for _, bad, _ in kernels.values()) and not errors


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shrink every size and sweep")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    ap.add_argument("--json-out", default=None, help="default: $OUT/kernel_bench.json if $OUT")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every section's time limit (the full plan's sum to 430 s)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--copy-gbps", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _start_report(plan: Plan, sections: list[str]) -> dict:
    """Print the hardware line (and the no-CUDA note), measure the copy bandwidth on CUDA."""
    hw = hardware()
    print(
        f"slimserve kernel bench | {hw['device']} | SMs {hw.get('sms')} | sm_{hw.get('capability')}"
        f" | {hw.get('memory_GiB')} GiB | torch {hw['torch']} | triton {hw['triton']} | "
        f"CUDA {hw['cuda']} | python {hw['python']} | plan {plan.name}",
        flush=True,
    )
    if not CUDA:
        print(
            "No CUDA device: correctness checks at tiny shapes through the Triton interpreter "
            "(TRITON_INTERPRET=1); timings and e2e skipped."
        )
    report = {"hardware": hw, "plan": plan.name, "sections": sections, "results": {}}
    if CUDA:
        report["copy_GBps"] = None
        try:
            report["copy_GBps"] = copy_bandwidth(plan)
            print(
                f"device-to-device copy: {report['copy_GBps']:.0f} GB/s (read + write bytes)",
                flush=True,
            )
        except Exception:
            print(f"copy bandwidth failed:\n{tail(traceback.format_exc())}", flush=True)
    return report


def _run_sections(
    plan: Plan, sections: list[str], report: dict, out_path: str | None, t0: float
) -> None:
    """Each section in a child process on CUDA (in process without), the JSON rewritten after
    every one."""
    total = sum(plan.limits.get(s, 0) for s in sections)
    for i, sec in enumerate(sections):
        s0 = time.monotonic()
        if CUDA:
            # the section's own limit plus whatever earlier sections left unused
            later = sum(plan.limits.get(s, 0) for s in sections[i + 1 :])
            limit = max(30.0, total - (time.monotonic() - t0) - later)
            res = _spawn(
                sec, replace(plan, limits={**plan.limits, sec: limit}), report["copy_GBps"], limit
            )
        else:
            ctx = Ctx(plan, torch.device("cpu"), None, None)
            run_section(sec, ctx)
            res = ctx.res
        res["seconds"] = time.monotonic() - s0
        report["results"][sec] = res
        if out_path:
            _write_json(out_path, report)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
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
    out_path = args.json_out or (
        os.path.join(os.environ["OUT"], "kernel_bench.json") if os.environ.get("OUT") else None
    )
    t0 = time.monotonic()
    report = _start_report(plan, sections)
    _run_sections(plan, sections, report, out_path, t0)
    ok = summarize(report["results"])
    report["seconds"] = time.monotonic() - t0
    print(
        "time per section: "
        + ", ".join(f"{s} {r['seconds']:.0f} s" for s, r in report["results"].items())
        + f"; total {report['seconds']:.0f} s"
    )
    if out_path:
        _write_json(out_path, report)
        print(f"results: {out_path}")
    return 0 if ok else 1


def _write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean(report), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
