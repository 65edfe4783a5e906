"""The CPU paged decode attention (kernels/cpu_attention.c) hot and cold, at a serving step's shape.

    python -m slimserve.eval.bench_cpu_attention [--seqs 32] [--context 192] [--heads 9 3]
        [--dim 64] [--block-size 16] [--layers 30] [--kv bf16 fp8] [--runs 7] [--json-out FILE]

A serving step calls the attention once per layer, and all layers' caches together exceed L3
(SmolLM2-135M, 32 sequences of 256 tokens, bf16: 189 MB), so each call reads its layer's cache
from DRAM. `cold` times that: `--layers` caches, each with every sequence's blocks scattered
(a random permutation of block ids, as a busy cache's are), called in layer order; `hot` calls
the first layer's cache `--layers` times (it stays in L2/L3: the kernel's compute alone). Each
cell: median (and min) over `--runs` of the mean time per call; queries bf16 (a bf16 model's),
`torch.get_num_threads()` threads (`--threads`).

Measured when the kernel started copying each sequence's blocks out together before reading
them (gather_blocks; 2-core AMD EPYC Zen 4, AVX512-BF16, torch 2.13, 2 threads, the defaults
above): bf16 cold 524 -> 325 us a call, hot 172 -> 207; fp8 cold 1042 -> 836, hot 746 -> 787.
Then fp8 codes copied out as bf16 values into the bf16 tiles: fp8 cold 875 -> 270, hot 814 -> 233
(bf16 in the same run: cold 317, hot 206).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from slimserve.kernels import cpu_attention
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line

KV = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


def caches(args, dtype: torch.dtype):
    per_seq = -(-args.context // args.block_size)
    blocks = args.seqs * per_seq + 8
    hq, hkv = args.heads
    shape = (blocks, args.block_size, hkv, args.dim)
    layers = [
        (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)
    ]
    ids = list(range(blocks))
    random.Random(0).shuffle(ids)
    tables = torch.tensor(ids[: args.seqs * per_seq], dtype=torch.int32).view(args.seqs, per_seq)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.seqs, hq, args.dim).to(torch.bfloat16)
    return layers, tables, lens, q


def time_calls(order, layers, tables, lens, q, scale, runs) -> dict:
    def sweep():
        for i in order:
            k, v = layers[i]
            cpu_attention.paged_attention_decode(q, k, v, tables, lens, scale)

    sweep()
    per_call = []
    for _ in range(runs):
        t = time.perf_counter()
        sweep()
        per_call.append((time.perf_counter() - t) / len(order) * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "runs": per_call}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if bad := [k for k in args.kv if k not in KV]:
        raise SystemExit(f"--kv: {', '.join(bad)} unknown; use some of {', '.join(KV)}")
    if args.heads[0] % args.heads[1]:
        raise SystemExit(f"--heads {args.heads[0]} {args.heads[1]}: Q must be a multiple of KV")
    if not cpu_attention.available():
        raise SystemExit(
            f"the CPU attention kernel is unavailable: {cpu_attention.unavailable_reason()}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    print(hardware_line(hardware_info()), flush=True)
    print(
        f"{args.seqs} sequences x {args.context} tokens, {args.heads[0]}/{args.heads[1]} heads of "
        f"{args.dim}, blocks of {args.block_size}, {args.layers} layers, "
        f"{torch.get_num_threads()} threads"
    )
    print("| KV cache | cold us/call (min) | hot us/call (min) |\n|---|---:|---:|")
    rows = []
    for name in args.kv:
        layers, tables, lens, q = caches(args, KV[name])
        scale = args.dim**-0.5
        cold = time_calls(range(args.layers), layers, tables, lens, q, scale, args.runs)
        hot = time_calls([0] * args.layers, layers, tables, lens, q, scale, args.runs)
        rows.append({"kv": name, "cold": cold, "hot": hot})
        print(
            f"| {name} | {cold['median_us']:.0f} ({cold['min_us']:.0f}) "
            f"| {hot['median_us']:.0f} ({hot['min_us']:.0f}) |",
            flush=True,
        )
        del layers
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"hardware": hardware_info(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
