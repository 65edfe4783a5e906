"""The run report of `compress run`: report.json (machine), report.md (human), report.png (plot).

The summary dict is the single source; every file is rendered from it:

    {"model": str, "dataset": str, "seq_len": int, "tokens": int, "recipe": str,
     "baseline": {"ppl": float, "size_bytes": int},
     "stages": [{"name": str, "ppl": float, "seconds": float, "size_bytes": int}, ...],
     "final": {"ppl": float, "size_bytes": int},
     "gate": {"max_ppl_increase": float, "ppl_increase": float, "passed": bool}}

`max_ppl_increase` and `ppl_increase` are fractions (0.10 = +10 %): final / baseline - 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REQUIRED_KEYS = ("baseline", "stages", "final", "gate")
MB = 1e6  # bytes per MB (decimal, as file sizes are usually shown)


def _check(summary: dict) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in summary]
    if missing:
        raise ValueError(
            f"report summary lacks {', '.join(missing)}; it needs {', '.join(REQUIRED_KEYS)}"
        )
    for i, stage in enumerate(summary["stages"]):
        absent = [k for k in ("name", "ppl", "seconds", "size_bytes") if k not in stage]
        if absent:
            raise ValueError(
                f"report summary stages[{i}] lacks {', '.join(absent)}; "
                f"each stage needs name, ppl, seconds, size_bytes"
            )


def write_report(out_dir: Path, summary: dict) -> dict[str, Path]:
    """Write report.json, report.md and report.png into `out_dir`; returns {'json'|'md'|'png': path}."""
    _check(summary)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "md": out_dir / "report.md",
        "png": out_dir / "report.png",
    }
    paths["json"].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    paths["md"].write_text(render_markdown(summary), encoding="utf-8")
    plot_report(summary, paths["png"])
    paths.update(plot_stage_details(summary, out_dir))
    if summary.get("task_gate"):
        paths["tasks"] = out_dir / "report-tasks.png"
        plot_tasks(summary["task_gate"], paths["tasks"])
    return paths


def plot_stage_details(summary: dict, out_dir: Path) -> dict[str, Path]:
    """report-prune.png / report-distill.png / report-kv_cache.png for stages whose details carry
    importance scores, a loss curve or per-layer fp8-KV sensitivities (the first of each kind;
    numbered when a recipe repeats a stage)."""
    paths: dict[str, Path] = {}
    for i, stage in enumerate(summary["stages"]):
        details = stage.get("details") or {}
        kind = (
            "prune"
            if "importance" in details
            else "distill"
            if "loss_curve" in details
            else "kv_cache"
            if "sensitivity" in details
            else None
        )
        if kind is None:
            continue
        key = kind if kind not in paths else f"{kind}-{i}"
        paths[key] = Path(out_dir) / f"report-{key}.png"
        if kind == "prune":
            plot_importance(details, paths[key])
        elif kind == "kv_cache":
            plot_kv_sensitivity(details["sensitivity"], paths[key])
        else:
            before = summary["stages"][i - 1]["ppl"] if i else summary["baseline"]["ppl"]
            plot_distillation(details, summary["baseline"]["ppl"], before, stage["ppl"], paths[key])
    return paths


def _delta_pct(ppl: float, baseline: float) -> float:
    return (ppl / baseline - 1.0) * 100.0 if baseline > 0 else math.nan


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def render_markdown(summary: dict) -> str:
    """A PASSED/FAILED headline, the run's facts and a per-stage table."""
    base, final, gate = summary["baseline"], summary["final"], summary["gate"]
    task_gate = summary.get("task_gate")
    passed = gate.get("passed") and (task_gate is None or task_gate["passed"])
    verdict = "PASSED" if passed else "FAILED"
    size_ratio = base["size_bytes"] / final["size_bytes"] if final.get("size_bytes") else math.nan
    lines = [
        f"# Compression report: {verdict}",
        "",
        f"Perplexity {base['ppl']:.3f} → {final['ppl']:.3f} ({gate['ppl_increase'] * 100:+.2f} %, "
        f"gate ≤ +{gate['max_ppl_increase'] * 100:.2f} %): **{'PASSED' if gate.get('passed') else 'FAILED'}**. "
        f"Weights {base['size_bytes'] / MB:.2f} MB → {final['size_bytes'] / MB:.2f} MB ({size_ratio:.2f}× smaller).",
        "",
    ]
    for key in ("model", "recipe", "dataset", "seq_len", "tokens"):
        if key in summary:
            lines.append(f"- {key}: `{summary[key]}`")
    if "params" in base and "params" in final:
        lines.append(f"- parameters: {base['params'] / 1e6:.2f}M → {final['params'] / 1e6:.2f}M")
    lines += [
        "",
        "| stage | ppl | Δ vs baseline % | size MB | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    lines.append(f"| baseline | {base['ppl']:.3f} | +0.00 | {base['size_bytes'] / MB:.2f} | — |")
    for s in summary["stages"]:
        lines.append(
            f"| {s['name']} | {s['ppl']:.3f} | {_delta_pct(s['ppl'], base['ppl']):+.2f} | "
            f"{s['size_bytes'] / MB:.2f} | {_fmt(s.get('seconds'), '.1f')} |"
        )
    for s in summary["stages"]:
        d = s.get("details") or {}
        if "dims_after" in d:
            changed = {
                k: f"{d['dims_before'][k]} → {v}"
                for k, v in d["dims_after"].items()
                if v != d["dims_before"][k]
            }
            lines += [
                "",
                f"{s['name']}: "
                + (", ".join(f"{k} {v}" for k, v in changed.items()) or "nothing removed")
                + " (importance: `report-prune.png`)",
            ]
        if "loss_curve" in d:
            lines += [
                "",
                f"{s['name']}: {d['steps']} steps, loss {_fmt(d['loss_first'], '.4f')} → "
                f"{_fmt(d['loss_last'], '.4f')} (curve: `report-distill.png`)",
            ]
        if d.get("skip_layers"):
            total = len(d.get("layers") or {})
            lines += [
                "",
                f"{s['name']}: fp8 K/V in {total - len(d['skip_layers'])} of {total} layers; "
                f"layers {', '.join(map(str, d['skip_layers']))} keep the model dtype (vLLM: "
                f"`{d['vllm']}`"
                + ("; sensitivity: `report-kv_cache.png`)" if "sensitivity" in d else ")"),
            ]
    lines += _task_lines(summary)
    return "\n".join(lines) + "\n"


def _task_lines(summary: dict) -> list[str]:
    """The task gate's table: accuracy before/after with 95 % intervals, the drop, its
    significance (exact McNemar on the same items) and the verdict per task."""
    task_gate = summary.get("task_gate")
    if not task_gate:
        return []
    lines = [
        "",
        f"Task gate: **{'PASSED' if task_gate['passed'] else 'FAILED'}** (a task fails when "
        f"it drops by more than its allowance and McNemar's p < {task_gate['alpha']}; first "
        f"{task_gate['limit'] or 'all'} items of each task; plot: `report-tasks.png`)",
        "",
        "| task | metric | items | before % (95 % CI) | after % (95 % CI) | drop, points "
        "(95 % CI) | McNemar p | allowed | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, v in task_gate["tasks"].items():
        lo, hi = (-100 * x for x in v["diff_ci"])
        lines.append(
            f"| {name} | {v['metric']} | {v['n']} | {v['before'] * 100:.2f} "
            f"({v['before_ci'][0] * 100:.1f}-{v['before_ci'][1] * 100:.1f}) | "
            f"{v['after'] * 100:.2f} ({v['after_ci'][0] * 100:.1f}-{v['after_ci'][1] * 100:.1f}) | "
            f"{v['drop_points']:+.2f} ({hi:+.2f} to {lo:+.2f}) | {v['p_value']:.3g} | "
            f"{v['max_drop']:.2f} | {'PASSED' if v['passed'] else 'FAILED'} |"
        )
    return lines


def plot_tasks(task_gate: dict, path: Path) -> None:
    """Accuracy before and after per gated task, with 95 % Wilson intervals; failed tasks'
    labels in red."""
    names = list(task_gate["tasks"])
    fig, ax = _figure(max(5.0, 1.4 * len(names) + 2), 3.8, 1)
    width = 0.38
    for k, (when, color) in enumerate((("before", "tab:blue"), ("after", "tab:orange"))):
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        vals = [task_gate["tasks"][n][when] * 100 for n in names]
        cis = [task_gate["tasks"][n][f"{when}_ci"] for n in names]
        err = [
            [v - lo * 100 for v, (lo, _) in zip(vals, cis)],
            [hi * 100 - v for v, (_, hi) in zip(vals, cis)],
        ]
        ax.bar(xs, vals, width, yerr=err, capsize=3, color=color, label=when)
    ax.set_xticks(range(len(names)), names)
    for label, n in zip(ax.get_xticklabels(), names):
        if not task_gate["tasks"][n]["passed"]:
            label.set_color("tab:red")
    ax.set(
        title=f"Task accuracy ({'PASSED' if task_gate['passed'] else 'FAILED'})",
        ylabel="accuracy %",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_report(summary: dict, path: Path) -> None:
    """Two panels: perplexity per stage with the gate threshold (dashed), weight size per stage in MB."""
    # The Agg canvas directly, not pyplot: no display needed and the caller's backend is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base, gate = summary["baseline"], summary["gate"]
    names = ["baseline"] + [s["name"] for s in summary["stages"]]
    ppls = [base["ppl"]] + [s["ppl"] for s in summary["stages"]]
    sizes = [base["size_bytes"] / MB] + [s["size_bytes"] / MB for s in summary["stages"]]
    threshold = base["ppl"] * (1.0 + gate["max_ppl_increase"])
    x = list(range(len(names)))

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_ppl, ax_size = fig.subplots(1, 2)
    ax_ppl.plot(x, ppls, marker="o", label="perplexity")
    ax_ppl.axhline(
        threshold,
        linestyle="--",
        color="tab:red",
        label=f"gate (+{gate['max_ppl_increase'] * 100:.1f} %)",
    )
    ax_ppl.set(
        title=f"Perplexity ({'PASSED' if gate.get('passed') else 'FAILED'})", ylabel="perplexity"
    )
    ax_ppl.legend()
    ax_size.bar(x, sizes, color="tab:blue")
    ax_size.set(title="Weight size", ylabel="MB")
    for ax in (ax_ppl, ax_size):
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_kv_sensitivity(sensitivity: dict, path: Path) -> None:
    """Per decoder layer, the mean KL divergence fp8 K/V in that layer alone causes; the layers
    kept unquantized in another colour."""
    kl = {int(i): v for i, v in sensitivity["kl_per_layer"].items()}
    layers = sorted(kl)
    chosen = set(sensitivity["chosen"])
    fig, ax = _figure(max(6.0, 0.25 * len(layers) + 2), 3.5, 1)
    ax.bar(
        layers,
        [kl[i] for i in layers],
        color=["tab:red" if i in chosen else "tab:blue" for i in layers],
    )
    ax.set(
        title=f"fp8 KV sensitivity per layer (red: kept unquantized), {sensitivity['windows']} windows",
        xlabel="decoder layer",
        ylabel="mean KL (nats / token)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _figure(width: float, height: float, cols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, cols)


def plot_importance(details: dict, path: Path) -> None:
    """Prune report: layer scores (kept/removed), head scores per layer, sorted MLP-channel and
    hidden-channel scores with the cut (what lies right of the dashed line was removed)."""
    imp = details["importance"]
    fig, (ax_l, ax_h, ax_m, ax_e) = _figure(16, 3.8, 4)
    layers = imp["layers"]
    if layers["scores"] is not None:
        colors = [
            "tab:blue" if i in layers["kept"] else "tab:red" for i in range(len(layers["scores"]))
        ]
        ax_l.bar(range(len(layers["scores"])), layers["scores"], color=colors)
    ax_l.set(title="layers (red: removed)", xlabel="layer", ylabel="importance")
    for row in imp["heads"]:
        kept = set(row["kept"])
        for h, v in enumerate(row["scores"]):
            ax_h.scatter(row["layer"], v, color="tab:blue" if h in kept else "tab:red", s=14)
    ax_h.set_xticks([row["layer"] for row in imp["heads"]])
    ax_h.set(title="attention heads (red: removed)", xlabel="layer", ylabel="importance")
    for ax, scores, kept, of, title in (
        (
            ax_m,
            [r["sorted_scores"] for r in imp["mlp"]["per_layer"]],
            imp["mlp"]["kept"],
            imp["mlp"]["of"],
            "MLP channels, sorted",
        ),
        (
            ax_e,
            [imp["hidden"]["sorted_scores"]],
            imp["hidden"]["kept"],
            imp["hidden"]["of"],
            "hidden channels, sorted",
        ),
    ):
        for curve in scores:
            ax.plot([j / max(1, len(curve) - 1) for j in range(len(curve))], curve)
        ax.axvline(kept / of, linestyle="--", color="tab:red")
        ax.set(title=f"{title} (kept {kept}/{of})", xlabel="rank (fraction)", ylabel="importance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_distillation(
    details: dict, baseline: float, before: float, after: float, path: Path
) -> None:
    """Distill report: loss per step (and its parts), perplexity baseline / before / after."""
    fig, (ax_loss, ax_ppl) = _figure(11, 4, 2)
    curve = details["loss_curve"]
    steps = [r["step"] for r in curve]
    parts = [k for k in ("kl", "ce", "hidden") if curve and k in curve[0]]
    for key in ["loss"] + (
        parts if len(parts) > 1 else []
    ):  # the parts only when there are several
        ax_loss.plot(steps, [r[key] for r in curve], label=key)
    ax_loss.set(title="distillation loss", xlabel="step", ylabel="nats")
    ax_loss.legend()
    ax_ppl.bar([0, 1, 2], [baseline, before, after], color=["tab:gray", "tab:red", "tab:green"])
    ax_ppl.set_xticks([0, 1, 2], ["baseline", "before distill", "after distill"])
    ax_ppl.set(title="perplexity", ylabel="perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
