"""Sampler benchmark: the batched sampler (runtime/engine/sampler.py) against the per-row one it replaced.

    python -m slimserve.eval.bench_sampler [--device auto|cpu|cuda] [--rows 16 64 256]
                                           [--vocab 49152 128256] [--top-p 0.9] [--top-k 50]
                                           [--runs 3] [--json-out FILE]

One "step" is one call of the sampler on fp32 logits [rows, vocab] already on the device, half
the rows greedy and half sampled with temperature 0.8, top-p 0.9 and top-k 50 (`--top-k -1`:
top-p alone, the batched sampler's full-sort path; `--top-p 1 --top-k -1`: temperature
alone), each sampled row
with its own seeded CPU torch.Generator (as runtime/engine/llm_engine.py makes them). A step's time
includes the host planning, the draws and the copy of the tokens to the host (CUDA is
synchronized before the clock stops). Each cell is the median of `--runs` timed steps after one
warm-up step. The baseline below is a verbatim copy of the per-row algorithm (before issue 12):
per sampled row a full-vocabulary sort, a boolean index, a `.cpu()` copy and a CPU multinomial.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.engine.sampler import SampleResult, sample
from slimserve.runtime.engine.sequence import SamplingParams

DEFAULT_ROWS = (16, 64, 256)
DEFAULT_VOCABS = (49152, 128256)  # SmolLM/StarCoder2-sized and Llama-3-sized vocabularies


# -- baseline: the per-row sampler as runtime/engine/sampler.py had it before issue 12 -----------------


def _baseline_truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] logits with everything outside top-k and the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


def baseline_sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleResult:
    """BASELINE (per-row, pre-issue-12): kept here only to be timed against `sample`."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    if greedy_rows:
        tokens[greedy_rows] = logits[greedy_rows].argmax(-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _baseline_truncate(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1).float().cpu()
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    if want:
        lp = torch.log_softmax(logits[want].float(), -1).cpu()
        for j, i in enumerate(want):
            n = params[i].logprobs
            top = torch.topk(lp[j], n) if n else None
            tops = (
                {int(t): float(v) for t, v in zip(top.indices, top.values)}
                if top is not None
                else {}
            )
            logprobs[i] = (float(lp[j, tokens[i]]), tops)
    return SampleResult(tokens.tolist(), logprobs, [True] * len(params))  # (no finite check then)


# -- the measurement ----------------------------------------------------------------------------


def workload(
    rows: int, vocab: int, device: torch.device, top_p: float = 0.9, top_k: int = 50, seed: int = 0
):
    """Logits (randn x 3: a few dozen tokens hold most of the mass, as for a language model),
    params alternating greedy / temperature 0.8 with top_p and top_k, one seeded generator per row."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    sampled = SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else sampled for i in range(rows)]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(rows)]
    return logits, params, gens


def time_step(fn, logits, params, gens, runs: int) -> float:
    """Median milliseconds of `runs` calls after one warm-up call."""
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    fn(logits, params, gens)
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn(logits, params, gens)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCABS))
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50, help="-1: off")
    ap.add_argument("--runs", type=int, default=3, help="timed steps per cell (median)")
    ap.add_argument("--json-out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    name = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(name)

    hw = hardware_info()
    print(hardware_line(hw))
    print(
        f"device: {device}; torch threads: {torch.get_num_threads()}; median of {args.runs} steps "
        "after 1 warm-up; half the rows greedy, half temperature 0.8 "
        f"top-p {args.top_p} top-k {args.top_k}"
    )
    print()
    print("| rows | vocab | per-row baseline ms | batched ms | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    results = []
    for vocab in args.vocab:
        for rows in args.rows:
            logits, params, gens = workload(rows, vocab, device, args.top_p, args.top_k)
            old = time_step(baseline_sample, logits, params, gens, args.runs)
            new = time_step(sample, logits, params, gens, args.runs)
            results.append({"rows": rows, "vocab": vocab, "baseline_ms": old, "batched_ms": new})
            print(f"| {rows} | {vocab} | {old:.2f} | {new:.2f} | {old / new:.1f}x |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "hardware": hw,
                    "device": str(device),
                    "runs": args.runs,
                    "top_p": args.top_p,
                    "top_k": args.top_k,
                    "rows": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
