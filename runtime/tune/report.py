"""The report of `runtime tune`: the search table, the side-by-side re-measurement, the plot and
the JSON file (the YAML for `runtime serve --config` is runtime/serve_config.py's writer).

Everything is drawn from one result dict that runtime/tune/command.py assembles: evaluations
(runtime/tune/search.py) become plain dicts with `evaluation_dict`, so the JSON holds every run's
metrics and the table and plot are functions of the JSON alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table

from slimserve.runtime.bench.report import jsonable
from slimserve.runtime.bench.sysinfo import hardware_line
from slimserve.runtime.tune.search import Evaluation


def _p99(metrics: dict, key: str) -> float | None:
    stats = metrics.get(key)
    return stats["p99"] if stats else None


def evaluation_dict(e: Evaluation) -> dict:
    best = e.best_probe
    return {
        "label": e.setting.label,
        "setting": e.setting.flags(),
        "round": e.round,
        "num_prompts": e.num_prompts,
        "steps": e.steps,
        "runs": e.runs,
        "max_throughput": e.max_throughput,
        "goodput": e.goodput,
        "bracket": list(e.bracket),
        "saturated": e.saturated,
        "at_goodput": None
        if best is None
        else {
            "rate": best.rate,
            "attainment": best.attainment,
            "p99_ttft_ms": _p99(best.metrics, "ttft_ms"),
            "p99_tpot_ms": _p99(best.metrics, "tpot_ms"),
        },
        "probes": [
            {
                "rate": p.rate,
                "num_prompts": p.num_prompts,
                "attainment": p.attainment,
                "passed": p.passed,
                "metrics": dict(p.metrics),
            }
            for p in e.probes
        ],
    }


def _num(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def slo_text(slo: dict) -> str:
    terms = [
        f"{name} <= {slo[k]:g} ms"
        for k, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))
        if slo.get(k) is not None
    ]
    return f"{' and '.join(terms)} for >= {slo['attainment']:.0%} of requests"


def caption(result: dict) -> str:
    wl, m = result["workload"], result["model"]
    params = f", {m['params'] / 1e6:.1f}M params" if "params" in m else ""
    s = result["search"]
    return "\n".join(
        [
            hardware_line(result["hardware"]),
            f"model: {m['name']}{params}; shared serve options: "
            f"{', '.join(f'{k}={v}' for k, v in result['base_options'].items()) or 'serve defaults'}",
            f"workload: {wl['dataset']}, seed {wl['seed']}; input tokens mean "
            f"{wl['input_len']['mean']:.0f} ({wl['input_len']['min']}..{wl['input_len']['max']}); "
            f"output tokens mean {wl['output_len']['mean']:.0f} ({wl['output_len']['min']}.."
            f"{wl['output_len']['max']}); Poisson arrivals",
            f"SLO: {slo_text(result['slo'])}; goodput = highest rate (req/s) meeting it (sat.: "
            "even all requests at once do; it is the max throughput); P99 TTFT/TPOT (ms) at that rate "
            "(-: no run of that round passed; a goodput there comes from the round before)",
            f"search: {len(result['space']['settings'])} settings, {len(result['plan'])} rounds of "
            f"successive halving, {s['runs']} benchmark runs ({s['server_starts']} server starts) in "
            f"{s['wall_s']:.0f} s; a full grid at the last round's precision: "
            f"{s['full_grid_runs']} runs",
        ]
    )


def format_search_table(result: dict) -> Table:
    table = Table(
        title=f"runtime tune: {result['model']['name']}",
        caption=caption(result),
        caption_justify="left",
        min_width=100,
    )
    for name in (
        "seqs/tokens",
        "round",
        "prompts",
        "runs",
        "max thr",
        "goodput",
        "P99 TTFT",
        "P99 TPOT",
    ):
        table.add_column(name, justify="left" if name == "seqs/tokens" else "right")
    for rnd in reversed(result["search"]["rounds"]):  # the last round (the finalists) on top
        for e in rnd:
            at = e["at_goodput"] or {}
            good = _num(e["goodput"]) + (" (sat.)" if e["saturated"] else "")
            table.add_row(
                e["label"],
                str(e["round"]),
                str(e["num_prompts"]),
                str(e["runs"]),
                _num(e["max_throughput"]),
                good,
                _num(at.get("p99_ttft_ms"), ".0f"),
                _num(at.get("p99_tpot_ms"), ".1f"),
            )
    return table


def format_final_table(result: dict) -> Table:
    fin = result["final"]
    cols = [("search winner", fin["tuned"])] + (
        [("vLLM defaults", fin["defaults"])] if fin["defaults"] else []
    )
    table = Table(
        title=f"re-measured: {fin['num_prompts']} prompts per run, {fin['steps']} "
        f"bisection steps; {fin['runs']} runs in {fin['wall_s']:.0f} s"
    )
    table.add_column("")
    for name, _ in cols:
        table.add_column(name, justify="right")
    rows = [
        ("setting (seqs/tokens)", lambda e: e["label"]),
        ("goodput (req/s)", lambda e: _num(e["goodput"]) + (" (sat.)" if e["saturated"] else "")),
        ("max throughput (req/s)", lambda e: _num(e["max_throughput"])),
        (
            "P99 TTFT at goodput (ms)",
            lambda e: _num((e["at_goodput"] or {}).get("p99_ttft_ms"), ".0f"),
        ),
        (
            "P99 TPOT at goodput (ms)",
            lambda e: _num((e["at_goodput"] or {}).get("p99_tpot_ms"), ".1f"),
        ),
        ("runs", lambda e: str(e["runs"])),
    ]
    for label, get in rows:
        table.add_row(label, *(get(e) for _, e in cols))
    return table


def _curve(ax_ttft, ax_tpot, e: dict, style: str, name: str) -> None:
    runs = sorted(
        (p for p in e["probes"] if p["metrics"]["completed"]), key=lambda p: p["rate"]
    )  # in order of load, the rate-inf run last
    x = [p["metrics"]["request_throughput"] for p in runs]
    for ax, key in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
        y = [(p["metrics"][key] or {}).get("p99", math.nan) for p in runs]
        ax.plot(x, y, style, label=name)
        for xi, yi, p in zip(x, y, runs):
            ax.annotate(
                "inf" if not math.isfinite(p["rate"]) else f"{p['rate']:.2g}",
                (xi, yi),
                textcoords="offset points",
                xytext=(3, 3),
                fontsize=7,
            )


def save_plot(result: dict, path: Path) -> None:
    """Goodput per setting (its last round) as bars; throughput vs P99 TTFT and TPOT of the
    re-measured search winner (and of the defaults), one point per run, labelled by rate."""
    from matplotlib.figure import Figure

    last = {}
    for rnd in result["search"]["rounds"]:
        for e in rnd:
            last[e["label"]] = e
    evals = sorted(last.values(), key=lambda e: -e["goodput"])
    fig = Figure(figsize=(15, 4.8))
    ax_bar, ax_ttft, ax_tpot = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.4, 1, 1]})
    colors = ["#c6dbef", "#9ecae1", "#6baed6", "#3182bd", "#08519c", "#08306b"]
    chosen = result["final"]["tuned"]["label"]
    bars = ax_bar.bar(
        range(len(evals)),
        [e["goodput"] for e in evals],
        color=[colors[min(e["round"], len(colors) - 1)] for e in evals],
    )
    for bar, e in zip(bars, evals):
        if e["label"] == chosen:
            bar.set_edgecolor("red")
            bar.set_linewidth(2)
    ax_bar.set_xticks(range(len(evals)), [e["label"] for e in evals], rotation=70, fontsize=7)
    ax_bar.set_xlabel("max_num_seqs/max_num_batched_tokens (darker: later round; red: winner)")
    ax_bar.set_ylabel("goodput (req/s)")
    ax_bar.grid(axis="y", alpha=0.3)
    _curve(
        ax_ttft,
        ax_tpot,
        result["final"]["tuned"],
        "o-",
        f"search winner {result['final']['tuned']['label']}",
    )
    if result["final"]["defaults"] and result["final"]["defaults"]["label"] != chosen:
        _curve(ax_ttft, ax_tpot, result["final"]["defaults"], "s--", "defaults 256/2048")
    for ax, key, name in ((ax_ttft, "ttft_ms", "TTFT"), (ax_tpot, "tpot_ms", "TPOT")):
        if result["slo"].get(key) is not None:
            ax.axhline(result["slo"][key], color="red", ls=":", label="SLO")
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel(f"P99 {name} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"runtime tune, {result['model']['name']}: {slo_text(result['slo'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(jsonable(result), indent=1) + "\n")
