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
        raise ValueError(f"report summary lacks {', '.join(missing)}; it needs {', '.join(REQUIRED_KEYS)}")
    for i, stage in enumerate(summary["stages"]):
        absent = [k for k in ("name", "ppl", "seconds", "size_bytes") if k not in stage]
        if absent:
            raise ValueError(f"report summary stages[{i}] lacks {', '.join(absent)}; "
                             f"each stage needs name, ppl, seconds, size_bytes")


def write_report(out_dir: Path, summary: dict) -> dict[str, Path]:
    """Write report.json, report.md and report.png into `out_dir`; returns {'json'|'md'|'png': path}."""
    _check(summary)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md", "png": out_dir / "report.png"}
    paths["json"].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    paths["md"].write_text(render_markdown(summary), encoding="utf-8")
    plot_report(summary, paths["png"])
    return paths


def _delta_pct(ppl: float, baseline: float) -> float:
    return (ppl / baseline - 1.0) * 100.0 if baseline > 0 else math.nan


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def render_markdown(summary: dict) -> str:
    """A PASSED/FAILED headline, the run's facts and a per-stage table."""
    base, final, gate = summary["baseline"], summary["final"], summary["gate"]
    verdict = "PASSED" if gate.get("passed") else "FAILED"
    size_ratio = base["size_bytes"] / final["size_bytes"] if final.get("size_bytes") else math.nan
    lines = [
        f"# Compression report: {verdict}",
        "",
        f"Perplexity {base['ppl']:.3f} → {final['ppl']:.3f} ({gate['ppl_increase'] * 100:+.2f} %, "
        f"gate ≤ +{gate['max_ppl_increase'] * 100:.2f} %): **{verdict}**. "
        f"Weights {base['size_bytes'] / MB:.2f} MB → {final['size_bytes'] / MB:.2f} MB ({size_ratio:.2f}× smaller).",
        "",
    ]
    for key in ("model", "recipe", "dataset", "seq_len", "tokens"):
        if key in summary:
            lines.append(f"- {key}: `{summary[key]}`")
    lines += ["", "| stage | ppl | Δ vs baseline % | size MB | seconds |", "|---|---:|---:|---:|---:|"]
    lines.append(f"| baseline | {base['ppl']:.3f} | +0.00 | {base['size_bytes'] / MB:.2f} | — |")
    for s in summary["stages"]:
        lines.append(f"| {s['name']} | {s['ppl']:.3f} | {_delta_pct(s['ppl'], base['ppl']):+.2f} | "
                     f"{s['size_bytes'] / MB:.2f} | {_fmt(s.get('seconds'), '.1f')} |")
    return "\n".join(lines) + "\n"


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
    ax_ppl.axhline(threshold, linestyle="--", color="tab:red", label=f"gate (+{gate['max_ppl_increase'] * 100:.1f} %)")
    ax_ppl.set(title=f"Perplexity ({'PASSED' if gate.get('passed') else 'FAILED'})", ylabel="perplexity")
    ax_ppl.legend()
    ax_size.bar(x, sizes, color="tab:blue")
    ax_size.set(title="Weight size", ylabel="MB")
    for ax in (ax_ppl, ax_size):
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
