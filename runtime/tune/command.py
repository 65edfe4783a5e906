"""`runtime tune`: find the engine setting with the highest goodput for a workload and an SLO.

    runtime tune recipes/demo-model --slo-ttft-p99 2000 --slo-tpot-p99 60 --out tune-out

Validates everything first (SLOs, the workload, the grid: one line and exit 2 for a bad one),
builds the workload once with the benchmark's own code (runtime/bench/driver.py,
`build_requests`), runs the search of runtime/tune/search.py against real servers
(runtime/tune/runner.py), re-measures the winner and vLLM's defaults (256 / 2048) at the
final precision, and writes the report (runtime/tune/report.py) and the `runtime serve --config`
file (runtime/serve_config.py) into --out.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from slimserve.runtime.bench.driver import (
    BenchArgs,
    InputLenMedian,
    InputLenSigma,
    OutputLenMedian,
    OutputLenSigma,
    build_requests,
)
from slimserve.runtime.bench.workload import BenchRequest, LengthDist, length_stats
from slimserve.runtime.config import KV_CACHE_DTYPES, EngineConfig
from slimserve.runtime.loading.gguf import resolve_model
from slimserve.runtime.serve_config import write_serve_config
from slimserve.runtime.serve_options import file_options
from slimserve.runtime.server.process import BenchError
from slimserve.runtime.tune.search import (
    Evaluation,
    Setting,
    expected_runs,
    find_goodput,
    full_grid_runs,
    plan_rounds,
    successive_halving,
)

VLLM_DEFAULTS = Setting(256, 2048)  # vLLM's max_num_seqs / max_num_batched_tokens (= serve's)
PREFIX_MODES = ("auto", "on", "off", "both")


def parse_ints(flag: str, text: str) -> list[int]:
    """'8,16,32' -> [8, 16, 32] (positive, duplicates dropped, order kept)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(
            f"{flag} {text!r}: give positive integers separated by commas, e.g. 8,16,32"
        )
    return list(dict.fromkeys(values))


def check_slos(ttft_ms: float | None, tpot_ms: float | None, attainment: float) -> None:
    if ttft_ms is None and tpot_ms is None:
        raise ValueError("give an SLO: --slo-ttft-p99 MS and/or --slo-tpot-p99 MS (milliseconds)")
    for flag, v in (("--slo-ttft-p99", ttft_ms), ("--slo-tpot-p99", tpot_ms)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{flag} {v:g}: must be a positive number of milliseconds")
    if not 0 < attainment <= 1:
        raise ValueError(
            f"--attainment {attainment:g}: must be in (0, 1], e.g. 0.9 (90% of the "
            "requests within every SLO term)"
        )


def shares_prefixes(
    requests: list[BenchRequest], block_size: int = EngineConfig.block_size
) -> bool:
    """True when two prompts begin with the same full KV block (a prefix-cache hit is possible)."""
    heads = [tuple(r.prompt_ids[:block_size]) for r in requests if r.prompt_len >= block_size]
    return len(set(heads)) < len(heads)


def search_space(
    seqs: list[int], tokens: list[int], kv_dtypes: list[str], prefix: list[bool]
) -> list[Setting]:
    """The grid without pairs whose token budget cannot hold one decode per sequence."""
    return [
        Setting(s, t, kv, pc)
        for s in seqs
        for t in tokens
        if t >= s
        for kv in kv_dtypes
        for pc in prefix
    ]


@dataclass(frozen=True, slots=True)
class Grid:
    """The search space's axes as the options gave them (prefix: a PREFIX_MODES value)."""

    max_num_seqs: list[int]
    max_num_batched_tokens: list[int]
    kv_cache_dtypes: list[str]
    prefix: str

    def settings(self, requests: list[BenchRequest]) -> tuple[list[Setting], str]:
        """The settings to search and how prefix caching was decided (auto: from the prompts)."""
        if self.prefix == "auto":
            shared = shares_prefixes(requests)
            values = [True, False] if shared else [True]
            note = (
                "auto: prompts share prefixes, on and off searched"
                if shared
                else "auto: no two prompts share a first KV block, so it cannot matter; kept on "
                "(serve's default)"
            )
        else:
            values = {"on": [True], "off": [False], "both": [True, False]}[self.prefix]
            note = self.prefix
        return search_space(
            self.max_num_seqs, self.max_num_batched_tokens, self.kv_cache_dtypes, values
        ), note


def parse_grid(
    max_num_seqs: str, max_num_batched_tokens: str, kv_cache_dtype: str, prefix_caching: str
) -> Grid:
    """The grid options checked (one line each for a bad list or an empty grid)."""
    seqs = parse_ints("--max-num-seqs", max_num_seqs)
    tokens = parse_ints("--max-num-batched-tokens", max_num_batched_tokens)
    kvs = list(dict.fromkeys(v.strip() for v in kv_cache_dtype.split(",") if v.strip()))
    if not kvs or any(v not in KV_CACHE_DTYPES for v in kvs):
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r}: give values of "
            f"{', '.join(KV_CACHE_DTYPES)} separated by commas"
        )
    if prefix_caching not in PREFIX_MODES:
        raise ValueError(
            f"--prefix-caching {prefix_caching!r}: choose one of {', '.join(PREFIX_MODES)}"
        )
    if not search_space(seqs, tokens, kvs, [True]):
        raise ValueError(
            f"the grid is empty: no --max-num-batched-tokens value ({max_num_batched_tokens}) "
            f"is >= a --max-num-seqs value ({max_num_seqs}); widen the lists"
        )
    return Grid(seqs, tokens, kvs, prefix_caching)


Opt = typer.Option


def tune_main(
    model: Annotated[str, typer.Argument(help="artifact or checkpoint folder to serve")],
    slo_ttft_ms: Annotated[
        float | None,
        Opt(
            "--slo-ttft-p99",
            "--slo-ttft-ms",
            help="SLO term: time to first token, ms (a request "
            "meets it when its TTFT is at most this)",
        ),
    ] = None,
    slo_tpot_ms: Annotated[
        float | None,
        Opt("--slo-tpot-p99", "--slo-tpot-ms", help="SLO term: time per output token, ms"),
    ] = None,
    attainment: Annotated[
        float,
        Opt(
            help="fraction of the requests that must meet every SLO term "
            "for a rate to count as sustained (DistServe: 0.9; 0.99 "
            "makes the SLOs literal P99 bounds)"
        ),
    ] = 0.9,
    dataset: Annotated[
        str,
        Opt(help='stdlib, or a JSONL file with a "prompt" (and optional "output_len") per line'),
    ] = "stdlib",
    num_prompts: Annotated[
        int,
        Opt(
            help="requests per run in the last round and the "
            "re-measurement (earlier rounds halve it)"
        ),
    ] = 48,
    input_len_median: InputLenMedian = 128,
    input_len_sigma: InputLenSigma = 0.8,
    input_len_min: int = 32,
    input_len_max: int = 512,
    output_len_median: OutputLenMedian = 64,
    output_len_sigma: OutputLenSigma = 1.0,
    output_len_min: int = 16,
    output_len_max: int = 512,
    seed: Annotated[int, Opt(help="seeds lengths, prompt offsets and arrivals")] = 0,
    max_num_seqs: Annotated[
        str, Opt(help="values to search, comma-separated")
    ] = "8,16,32,64,128,256",
    max_num_batched_tokens: Annotated[
        str, Opt(help="values to search (pairs below max_num_seqs are skipped)")
    ] = "256,512,1024,2048,4096",
    kv_cache_dtype: Annotated[
        str,
        Opt(
            help="values to search: auto (the model's: fp8 for an "
            "artifact with calibrated KV scales) and/or fp8_e4m3 "
            "(scale 1.0 without them), int8, int4 (per-token "
            "scales; these change the outputs, so only when listed)"
        ),
    ] = "auto",
    prefix_caching: Annotated[
        str,
        Opt(
            help="auto: search on and off only when prompts of the "
            "workload share a first KV block, else keep it on | on | "
            "off | both"
        ),
    ] = "auto",
    bisect_steps: Annotated[
        int,
        Opt(
            help="rate probes per setting after the rate-inf run, in "
            "the last round and the re-measurement"
        ),
    ] = 4,
    min_prompts: Annotated[int, Opt(help="requests per run in the first round at least")] = 8,
    max_probe_seconds: Annotated[
        float,
        Opt(
            help="no probe runs at a rate whose arrivals take "
            "longer (rate >= prompts / this); a setting missing "
            "the SLO there has goodput 0"
        ),
    ] = 120.0,
    compare_defaults: Annotated[
        bool, Opt(help="re-measure vLLM's defaults (256/2048) beside the tuned setting")
    ] = True,
    out: Annotated[
        str, Opt(help="folder for tune.json, tune.png, serve.yaml and the servers' logs")
    ] = "tune-out",
    kv_cache_memory: Annotated[
        str | None, Opt(help="serve option for every run, e.g. 512MiB")
    ] = None,
    device: Annotated[str | None, Opt(help="serve option for every run: auto | cpu | cuda")] = None,
    verify: Annotated[str | None, Opt(help="serve option for every run: strict | none")] = None,
    allow_failed_gate: Annotated[
        bool,
        Opt("--allow-failed-gate", help="serve option: an artifact whose perplexity gate failed"),
    ] = False,
    progress: Annotated[bool, Opt(help="progress bar")] = True,
) -> dict:
    """Search max_num_seqs x max_num_batched_tokens (and the KV-cache dtype and prefix caching
    where they apply) for the highest goodput within an SLO; write a `runtime serve --config` file.

    Goodput: the highest Poisson request rate at which --attainment of the requests meet every
    SLO term, found per setting by a rate-inf run (the upper bracket) and bisection. Successive
    halving spends the runs: all settings get a cheap evaluation, the better half goes on with
    twice the prompts and a finer bisection, until two remain. The winner and vLLM's defaults
    are then re-measured side by side.
    """
    from rich.console import Console
    from rich.markup import escape

    from slimserve.runtime.errors import ArtifactError

    err = Console(stderr=True)
    try:
        check_slos(slo_ttft_ms, slo_tpot_ms, attainment)
        if not max_probe_seconds > 0:
            raise ValueError(f"--max-probe-seconds {max_probe_seconds:g}: must be > 0 (seconds)")
        for flag, v in (("--bisect-steps", bisect_steps), ("--min-prompts", min_prompts)):
            if v < 1:
                raise ValueError(f"{flag} {v}: must be >= 1")
        args = BenchArgs(
            model=model,
            dataset=dataset,
            num_prompts=num_prompts,
            seed=seed,
            input_len=LengthDist(input_len_median, input_len_sigma, input_len_min, input_len_max),
            output_len=LengthDist(
                output_len_median, output_len_sigma, output_len_min, output_len_max
            ),
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
            kv_cache_memory=kv_cache_memory,
            device=device,
            verify=verify,
            allow_failed_gate=allow_failed_gate,
            progress=progress,
        )
        args.validate()
        grid = parse_grid(max_num_seqs, max_num_batched_tokens, kv_cache_dtype, prefix_caching)
        if not Path(resolve_model(model)).expanduser().is_dir():  # a GGUF: its HF conversion
            raise ValueError(
                f"MODEL {model}: no such folder; give an artifact or checkpoint "
                "folder (or a .gguf file)"
            )
        requests = build_requests(args)
        settings, prefix_note = grid.settings(requests)
        return run_tune(
            args,
            requests,
            settings,
            prefix_note,
            attainment=attainment,
            steps=bisect_steps,
            min_prompts=min_prompts,
            compare_defaults=compare_defaults,
            out=Path(out),
            max_probe_s=max_probe_seconds,
        )
    except (ValueError, BenchError, ArtifactError, OSError) as e:
        err.print(
            f"[bold red]error:[/] {escape(str(e).splitlines()[0])}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


# typer keeps the docstring's line breaks: one line per paragraph reads better in --help
tune_main.__doc__ = "\n\n".join(
    " ".join(par.split()) for par in inspect.cleandoc(tune_main.__doc__ or "").split("\n\n")
)


def run_tune(
    args: BenchArgs,
    requests: list[BenchRequest],
    settings: list[Setting],
    prefix_note: str,
    *,
    attainment: float,
    steps: int,
    min_prompts: int,
    compare_defaults: bool,
    out: Path,
    measure=None,
    max_probe_s: float | None = None,
) -> dict:
    """The search, the re-measurement and the report; `measure` defaults to real servers
    (runtime/tune/runner.py), tests pass a synthetic one."""
    from rich.console import Console
    from rich.markup import escape
    from tqdm.auto import tqdm

    from slimserve.runtime.bench.report import model_summary
    from slimserve.runtime.bench.sysinfo import hardware_info
    from slimserve.runtime.tune.report import (
        evaluation_dict,
        format_final_table,
        format_search_table,
        save_plot,
        slo_text,
        write_json,
    )
    from slimserve.runtime.tune.runner import BenchMeasure, local_model, serve_options

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    base = {
        "device": args.device,
        "kv_cache_memory": args.kv_cache_memory,
        "verify": args.verify,
        "allow_failed_gate": True if args.allow_failed_gate else None,
    }
    base = {k: v for k, v in base.items() if v is not None}
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": attainment}
    plan = plan_rounds(len(settings), args.num_prompts, steps, min_prompts)
    final_runs = (1 + steps) * (2 if compare_defaults else 1)
    console.print(
        f"[bold]runtime tune[/]: {len(settings)} settings, SLO {escape(slo_text(slo))}; "
        f"{len(plan)} rounds ({', '.join(f'{r.settings} x {r.num_prompts} prompts' for r in plan)}), "
        f"at most {expected_runs(plan)} search runs + {final_runs} to re-measure "
        f"(a full grid at the final precision: {full_grid_runs(len(settings), steps)}); "
        f"prefix caching {prefix_note}",
        highlight=False,
    )
    bar = tqdm(total=expected_runs(plan) + final_runs, unit="run", disable=not args.progress)
    stage = {"name": ""}

    def on_server(setting: Setting) -> None:
        bar.set_description(f"{stage['name']} {setting.label}")

    def on_probe(p) -> None:
        bar.update()
        bar.set_postfix_str(f"rate {p.rate:.3g} att {p.attainment:.2f}")

    def on_round(i, rnd, alive) -> None:
        stage["name"] = f"round {i}"

    own = measure is None
    if own:
        measure = BenchMeasure(args, requests, base, out / "servers", on_server=on_server)
    try:
        t0 = time.perf_counter()
        result = successive_halving(
            measure,
            settings,
            target=attainment,
            num_prompts=args.num_prompts,
            steps=steps,
            min_prompts=min_prompts,
            on_probe=on_probe,
            on_round=on_round,
            max_probe_s=max_probe_s,
        )
        search_s = time.perf_counter() - t0
        search_starts = measure.server_starts if own else 0
        bar.total = result.runs + final_runs  # saturated settings skipped their bisection
        winner = result.best.setting
        t1 = time.perf_counter()
        stage["name"] = "re-measure"

        def remeasure(s: Setting) -> Evaluation:
            if own:
                measure.close()  # a fresh server for each, as for the defaults
            return find_goodput(
                measure,
                s,
                num_prompts=args.num_prompts,
                target=attainment,
                steps=steps,
                round_=len(plan),
                on_probe=on_probe,
                max_probe_s=max_probe_s,
            )

        tuned = remeasure(winner)
        defaults = None
        if compare_defaults:
            defaults = tuned if winner == VLLM_DEFAULTS else remeasure(VLLM_DEFAULTS)
        final_s = time.perf_counter() - t1
        bar.total = bar.n  # saturated settings skip their bisection
    finally:
        bar.close()
        if own:
            measure.close()
    chosen = tuned if defaults is None or tuned.goodput >= defaults.goodput else defaults
    final_run_count = tuned.runs + (
        defaults.runs if defaults is not None and defaults is not tuned else 0
    )
    workload = {
        "dataset": args.dataset,
        "seed": args.seed,
        "num_prompts": len(requests),
        "input_len": length_stats([r.prompt_len for r in requests]),
        "output_len": length_stats([r.output_len for r in requests]),
    }
    yaml_path, plot_path, json_path = out / "serve.yaml", out / "tune.png", out / "tune.json"
    res = {
        "model": model_summary(args.model, None),
        "hardware": hardware_info(),
        "slo": slo,
        "workload": workload,
        "base_options": base,
        "space": {"settings": [s.label for s in settings], "prefix_caching": prefix_note},
        "plan": [
            {"settings": r.settings, "num_prompts": r.num_prompts, "steps": r.steps} for r in plan
        ],
        "search": {
            "runs": result.runs,
            "wall_s": search_s,
            "server_starts": search_starts,
            "full_grid_runs": full_grid_runs(len(settings), steps),
            "winner": winner.label,
            "rounds": [[evaluation_dict(e) for e in rnd] for rnd in result.rounds],
        },
        "final": {
            "num_prompts": args.num_prompts,
            "steps": steps,
            "runs": final_run_count,
            "wall_s": final_s,
            "tuned": evaluation_dict(tuned),
            "chosen": evaluation_dict(chosen),
            "defaults": evaluation_dict(defaults) if defaults is not None else None,
            "kept_defaults": chosen is not tuned,
        },
        "total": {"runs": result.runs + final_run_count, "wall_s": search_s + final_s},
        "files": {"serve_config": str(yaml_path), "plot": str(plot_path), "json": str(json_path)},
    }
    comment = (
        f"written by runtime tune: goodput {chosen.goodput:.3g} req/s with "
        f"{slo_text(slo)}\non {workload['dataset']} (seed {args.seed}); serve it with: "
        f"runtime serve --config {yaml_path.name}"
    )
    write_serve_config(
        yaml_path,
        serve_options(local_model(str(args.model)), base, chosen.setting),
        comment=comment,
        options=file_options(),
    )
    save_plot(res, plot_path)
    write_json(res, json_path)
    console.print(format_search_table(res))
    console.print(format_final_table(res))
    line = f"search winner {tuned.setting.label}: goodput {tuned.goodput:.3g} req/s"
    if defaults is tuned:
        line += " (the search chose vLLM's defaults 256/2048)"
    elif defaults is not None:
        ratio = f" ({tuned.goodput / defaults.goodput:.2f}x)" if defaults.goodput > 0 else ""
        line += f" vs vLLM defaults 256/2048: {defaults.goodput:.3g} req/s{ratio}"
    console.print(line, highlight=False)
    if chosen is not tuned:
        console.print(
            "[yellow]the search's winner measured below the defaults when re-measured; "
            "serve.yaml keeps the defaults[/]"
        )
    console.print(
        f"search: {result.runs} benchmark runs in {search_s:.0f} s; re-measurement: "
        f"{final_run_count} runs in {final_s:.0f} s; total {res['total']['runs']} runs, "
        f"{res['total']['wall_s']:.0f} s",
        highlight=False,
    )
    for what, path in (("serve config", yaml_path), ("plot", plot_path), ("json", json_path)):
        console.print(f"{what}: {path}", highlight=False)
    console.print(f"serve it: runtime serve --config {yaml_path}", highlight=False)
    return res
