"""Tensor/pipeline-parallel benchmark: offline greedy generation at --tp 1 and --tp 2, and at
--pp M stages (runtime/distributed/).

    python -m slimserve.eval.bench_tensor_parallel [MODEL] [--tp 1 2] [--pp 2] [--prompts 16]
                                                   [--max-tokens 64] [--device cpu]
                                                   [--dtype float32] [--json-out FILE]

For each size: load the model (`LLM(..., tensor_parallel_size=N)` or
`pipeline_parallel_size=M`), generate once untimed (4
tokens, warm-up), then time greedy generation of `--prompts` prompts x `--max-tokens` tokens
(ignore_eos, one batch). Reports output tokens/s, steps, and rank 0's time in collectives per
step (TP: the per-layer all-reduces, the embedding's all-reduce and the logits gather; PP: the
sends of activations and the receives of logits; it includes
waiting for the slowest rank, which is what a step pays) from `ModelRunner.comm_stats()`.
On CPU every rank gets cores / N threads, so TP on one CPU machine measures the communication
cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import time

from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM


def run_one(
    model: str, tp: int, prompts: list[str], max_tokens: int, device: str, dtype: str, pp: int = 1
) -> dict:
    t0 = time.perf_counter()
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        kv_cache_memory=64 * 2**20,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    load_s = time.perf_counter() - t0
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        before = llm.engine.runner.comm_stats()
        t0 = time.perf_counter()
        outs = llm.generate(
            prompts,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        seconds = time.perf_counter() - t0
        after = llm.engine.runner.comm_stats()
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after["steps"] - before["steps"]
    comm = after["comm_s"] - before["comm_s"]
    return {
        "tp": tp,
        "pp": pp,
        "load_s": load_s,
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "steps": steps,
        "comm_ms_per_step": 1e3 * comm / steps if steps else 0.0,
        "comm_calls_per_step": (after["comm_calls"] - before["comm_calls"]) / steps
        if steps
        else 0.0,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="recipes/demo-model")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--pp", type=int, nargs="*", default=[], help="pipeline stages to run too (tp 1)"
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    texts = [t for t in read_texts("validation") if len(t) > 200][: a.prompts]
    prompts = [t[:120] for t in texts]
    print(hardware_line(hardware_info()))
    rows = []
    for tp, pp in [(tp, 1) for tp in a.tp] + [(1, pp) for pp in a.pp]:
        r = run_one(a.model, tp, prompts, a.max_tokens, a.device, a.dtype, pp)
        rows.append(r)
        print(
            f"tp={tp} pp={pp}: {r['tokens_per_s']:.1f} output tok/s ({r['output_tokens']} tokens, "
            f"{r['steps']} steps, {r['seconds']:.2f} s), collectives {r['comm_ms_per_step']:.2f} ms/step "
            f"({r['comm_calls_per_step']:.0f} per step), load {r['load_s']:.1f} s"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"hardware": hardware_info(), "runs": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
