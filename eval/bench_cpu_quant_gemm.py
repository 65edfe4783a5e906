"""W8A8 Linears on CPU: the int8 GEMM (runtime/layers/cpu_quant_linear.py) against the path it
replaced (fake-quantized activations + the dequantized fp32 weight through oneDNN,
runtime/layers/cpu_linear.py), at SmolLM2-135M's Linear shapes.

    python -m slimserve.eval.bench_cpu_quant_gemm [--rows 1 8 32 128 512] [--threads 1 2]
                                                  [--runs 3] [--w4a16] [--json-out FILE]

Each cell is the median of `--runs` timed runs (each a loop of calls long enough to time, after
two warm-up calls) of one whole forward from fp32 activations [M, K] to fp32 outputs [M, N]
with a bias: `current` = `reference.fake_quantize_per_token_int8` + `cpu_linear.linear` on the
reordered weight; `int8` = `cpu_quant_gemm.quantize_per_token` + `cpu_quant_gemm.w8a8_gemm`.
`quant twin` / `quant C` time the per-token quantization alone (`reference.
quantize_per_token_int8` / the C kernel), which both totals include. `--w4a16` adds
`torch._weight_int4pack_mm_for_cpu` (group 64, symmetric) against the fp32 GEMM of the same
dequantized weight, the candidate for W4A16 layers, at the row counts up to 32 (it is 10-50x
slower than fp32 here: 1.55 ms against 0.12 ms for one row through 960x576, so W4A16 keeps the
dequantized fp32 weight).

Measured when this was added (2-core AMD EPYC, AVX2, no VNNI; torch 2.13), with the host shared
with other jobs (load average 5-8 on 2 cores, so the 2-thread cells were not usable), 1 thread:
the int8 path ran 3.2-6.1x the path it replaced at one row, 1.1-3.5x at 8 and 32 rows and
1.0-2.0x at 128 and 512 (0.98-0.99x for 576x576 at 128 and 512 and 192x576 at 512); outputs
within 3e-6 of it (fp32 scales). Candidates ruled out on the same host: `torch._int_mm` (exact
but a scalar loop: 0.76 ms for one row through 960x576, 4.3 ms for 8 rows); oneDNN's int8 inner
product (`torch.ops.onednn.qlinear_pointwise`: its 16-bit pair sums saturate without VNNI, 40
products of 100 * 100 give 143340); `torch._weight_int8pack_mm` (a generic loop: 160 ms at 128
rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slimserve.kernels import cpu_quant_gemm, reference
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.layers import cpu_linear

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64
SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}
DEFAULT_ROWS = (1, 8, 32, 128, 512)


def _time(fn, runs: int, min_s: float = 0.02) -> float:
    """Median seconds per call over `runs` loops of calls, each loop at least ~min_s long."""
    fn()
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_s:
            break
        n *= 2
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def _w8a8_row(n: int, k: int, m: int, runs: int, g: torch.Generator) -> dict:
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) + 0.5) * 0.02 / 128
    bias = torch.randn(n, generator=g) * 0.1
    packed = cpu_linear.reorder(codes.float() * scale[:, None])
    x = torch.randn(m, k, generator=g)

    def current():
        return cpu_linear.linear(reference.fake_quantize_per_token_int8(x), packed, bias)

    def int8():
        q, s = cpu_quant_gemm.quantize_per_token(x)
        return cpu_quant_gemm.w8a8_gemm(q, s, codes, scale, bias)

    diff = float((current() - int8()).abs().max())
    return {
        "current_us": _time(current, runs) * 1e6,
        "int8_us": _time(int8, runs) * 1e6,
        "quant_twin_us": _time(lambda: reference.quantize_per_token_int8(x), runs) * 1e6,
        "quant_c_us": _time(lambda: cpu_quant_gemm.quantize_per_token(x), runs) * 1e6,
        "max_abs_diff": diff,
        "max_abs_out": float(current().abs().max()),
    }


def _w4a16_row(n: int, k: int, m: int, runs: int, g: torch.Generator) -> dict:
    group = 64
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // group, generator=g) + 0.5) * 0.005
    dense = codes.float() * scale.repeat_interleave(group, 1)
    packed = cpu_linear.reorder(dense)
    w4 = torch._convert_weight_to_int4pack_for_cpu(codes + 8, 1)
    scales_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()
    x = torch.randn(m, k, generator=g)
    return {
        "fp32_us": _time(lambda: cpu_linear.linear(x, packed, None), runs) * 1e6,
        "int4mm_us": _time(
            lambda: torch._weight_int4pack_mm_for_cpu(x, w4, group, scales_zeros), runs
        )
        * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--w4a16", action="store_true", help="also time the int4 candidate")
    ap.add_argument("--json-out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if not cpu_quant_gemm.available():
        raise SystemExit(
            f"the int8 CPU kernel does not run here: {cpu_quant_gemm.unavailable_reason()}"
        )
    if not cpu_linear.available(torch.float32):
        raise SystemExit("oneDNN's reordered fp32 Linear is not available in this torch")
    hw = hardware_info()
    print(hardware_line(hw))
    print(f"median of {args.runs} runs; fp32 activations, bias on; times in microseconds")
    print()
    print(
        "| Linear | N x K | M | threads | current us | int8 us | speed-up | quant twin us "
        "| quant C us | max abs diff |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, (n, k) in SHAPES.items():
                for m in args.rows:
                    r = _w8a8_row(n, k, m, args.runs, g)
                    r.update(linear=name, n=n, k=k, m=m, threads=threads)
                    rows.append(r)
                    print(
                        f"| {name} | {n} x {k} | {m} | {threads} | {r['current_us']:.1f} "
                        f"| {r['int8_us']:.1f} | {r['current_us'] / r['int8_us']:.2f}x "
                        f"| {r['quant_twin_us']:.1f} | {r['quant_c_us']:.1f} "
                        f"| {r['max_abs_diff']:.1e} (of {r['max_abs_out']:.2f}) |",
                        flush=True,
                    )
        w4 = []
        if args.w4a16:
            print()
            print("| Linear | N x K | M | threads | fp32 GEMM us | int4pack_mm us | speed-up |")
            print("|---|---|---:|---:|---:|---:|---:|")
            for threads in args.threads:
                torch.set_num_threads(threads)
                for name, (n, k) in SHAPES.items():
                    for m in [r for r in args.rows if r <= 32]:
                        r = _w4a16_row(n, k, m, args.runs, g)
                        r.update(linear=name, n=n, k=k, m=m, threads=threads)
                        w4.append(r)
                        print(
                            f"| {name} | {n} x {k} | {m} | {threads} | {r['fp32_us']:.1f} "
                            f"| {r['int4mm_us']:.1f} | {r['fp32_us'] / r['int4mm_us']:.2f}x |",
                            flush=True,
                        )
    finally:
        torch.set_num_threads(before)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"hardware": hw, "w8a8": rows, "w4a16": w4}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
