"""The `compress` command: `compress run RECIPE`, `compress eval MODEL`.

Exit codes: 0 success (gates passed), 2 bad input (one line on stderr, no traceback; also an
output folder that is not an earlier artifact, or the model's own folder), 3 the perplexity gate
or the task gate failed (the artifact and report are still written, to `<output>.failed`, and
say FAILED).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compress a Hugging Face causal LM with a recipe, evaluate perplexity, export artifacts.",
)
console = Console(stderr=True)

EXIT_BAD_INPUT = 2
EXIT_GATE_FAILED = 3


def _user_errors() -> tuple[type[BaseException], ...]:
    from slimserve.compress.datasets import DatasetError
    from slimserve.compress.errors import RecipeError, UnsupportedModelError
    from slimserve.runtime.artifact.scheme import SchemeError
    from slimserve.runtime.errors import ArtifactError

    return (
        RecipeError,
        UnsupportedModelError,
        SchemeError,
        DatasetError,
        ArtifactError,
        FileNotFoundError,
    )


def _fail(message: str) -> None:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
    # soft_wrap: one line however long the paths in it are (tests and scripts read it)
    console.print(
        f"[bold red]error:[/] {escape(first)}", highlight=False, markup=True, soft_wrap=True
    )
    raise typer.Exit(EXIT_BAD_INPUT)


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="recipe YAML file (see recipes/)"),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="artifact folder (overrides the recipe's output)"
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bars"),
) -> None:
    """Run a recipe: baseline ppl, every stage with ppl after it, the gate, export and report."""
    from slimserve.compress.pipeline import run_recipe
    from slimserve.compress.recipe import load_recipe

    try:
        rec = load_recipe(recipe, output)
        result = run_recipe(
            rec, log=lambda m: console.print(m, highlight=False), progress=not no_progress
        )
    except _user_errors() as e:
        _fail(str(e))
    gate = result.summary["gate"]
    verdict = "[green]PASSED[/]" if gate["passed"] else "[bold red]FAILED[/]"
    console.print(
        f"gate {verdict}: ppl {result.summary['baseline']['ppl']:.4f} -> {result.summary['final']['ppl']:.4f} "
        f"({gate['ppl_increase'] * 100:+.2f}%, limit {gate['max_ppl_increase'] * 100:.2f}%)"
    )
    for name, v in result.summary.get("task_gate", {}).get("tasks", {}).items():
        mark = "[green]PASSED[/]" if v["passed"] else "[bold red]FAILED[/]"
        console.print(
            f"task gate {mark}: {name} {v['metric']} {v['before'] * 100:.2f} -> "
            f"{v['after'] * 100:.2f} ({-v['drop_points']:+.2f} points, limit -{v['max_drop']:.2f}; "
            f"McNemar p {v['p_value']:.3g}{', significant' if v['significant'] else ''}; "
            f"n {v['n']})",
            highlight=False,
        )
    console.print(f"artifact: {result.artifact}  report: {result.artifact / 'report.md'}")
    if not result.passed:
        typer.echo(
            f"gate failed: the artifact was written to {result.artifact}, not {rec.output} "
            "(left as it was); serving it needs --allow-failed-gate"
        )
        raise typer.Exit(EXIT_GATE_FAILED)


@app.command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="HF model id, local HF checkpoint or slimserve artifact"),
    dataset: str = typer.Option("stdlib", help="stdlib | wikitext2 | text:PATH | jsonl:PATH:FIELD"),
    seq_len: int = typer.Option(512, "--seq-len", min=2, help="tokens per window"),
    max_windows: int | None = typer.Option(
        None, "--max-windows", min=1, help="evaluate at most N windows"
    ),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="windows per forward pass"),
    as_json: bool = typer.Option(
        False, "--json", help='print {"ppl", "tokens", "seconds"} as JSON'
    ),
    device: str = typer.Option(
        "auto", "--device", help="auto (CUDA when available) | cpu | cuda | cuda:N"
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="allow code from the model repo"
    ),
    verify: str = typer.Option(
        "strict",
        "--verify",
        help="strict: a slimserve artifact must have a "
        "slimserve.json matching every file (plain checkpoints load as they are) "
        "| none: skip the manifest check",
    ),
    memory: str = typer.Option(
        "auto",
        "--memory",
        help="layers: read a local unquantized checkpoint's "
        "decoder layers one at a time | whole: load the float32 model | auto: "
        "layers when the float32 model would not fit in memory",
    ),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help="task accuracy instead of perplexity: comma-separated tasks (piqa, arc_easy, "
        "arc_challenge, hellaswag, winogrande, boolq, openbookqa, mmlu, mmlu_<subject>), "
        "scored by log-likelihood on the serving engine",
    ),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="with --tasks: the first N items of each task"
    ),
) -> None:
    """Perplexity of a model or artifact on a dataset (non-overlapping windows), or its task
    accuracy with --tasks (multiple-choice log-likelihood, lm-eval's conventions)."""
    from slimserve.compress.datasets import load_token_documents, parse_dataset
    from slimserve.compress.devices import resolve_device
    from slimserve.compress.layerwise_eval import MEMORY_MODES, model_perplexity

    if tasks is not None:
        _eval_tasks(model, tasks, limit, device, verify, trust_remote_code, as_json)
        return
    if limit is not None:
        _fail("--limit: counts task items; use it with --tasks (perplexity has --max-windows)")
    if memory not in MEMORY_MODES:
        _fail(f"--memory {memory!r}: use one of {', '.join(MEMORY_MODES)}")
    try:
        dev = resolve_device(device, "--device")
        spec = parse_dataset(dataset, Path.cwd())  # a bad spec fails before the model loads
        res = model_perplexity(
            model,
            lambda tok: load_token_documents(spec, tok),
            seq_len,
            max_windows,
            batch_size,
            dev,
            memory=memory,
            verify=verify,
            trust_remote_code=trust_remote_code,
            progress=not as_json,
            note=lambda m: None if as_json else console.print(m, highlight=False),
        )
    except _user_errors() as e:
        _fail(str(e))
    if as_json:
        print(json.dumps({"ppl": res.ppl, "tokens": res.tokens, "seconds": round(res.seconds, 3)}))
    else:
        console.print(
            f"{model} on {dataset} (seq_len {seq_len}): ppl {res.ppl:.4f} over {res.tokens} tokens "
            f"in {res.seconds:.1f}s",
            highlight=False,
        )


def _eval_tasks(
    model: str,
    tasks: str,
    limit: int | None,
    device: str,
    verify: str,
    trust_remote_code: bool,
    as_json: bool,
) -> None:
    from slimserve.compress.devices import resolve_device
    from slimserve.compress.tasks.catalog import parse_tasks
    from slimserve.compress.tasks.evaluate import evaluate_tasks

    try:
        names = parse_tasks(tasks)
        dev = resolve_device(device, "--device")
        run = evaluate_tasks(
            model,
            names,
            limit,
            progress=not as_json,
            note=lambda m: None if as_json else console.print(m, highlight=False),
            device=str(dev),
            verify=verify,
            trust_remote_code=trust_remote_code,
        )
    except (*_user_errors(), ValueError) as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(run.to_dict()))
        return
    print(f"{'task':<16} {'items':>6}  {'acc':>15}  {'acc_norm':>15}")
    for name, res in run.tasks.items():
        cells = []
        for metric in ("acc", "acc_norm"):
            m = res.metrics.get(metric)
            cells.append(
                f"{m['value'] * 100:6.2f} ± {m['stderr'] * 100:5.2f}" if m else f"{'-':>15}"
            )
        print(f"{name:<16} {res.n:>6}  {cells[0]:>15}  {cells[1]:>15}")


@app.command()
def stages() -> None:
    """List the stages a recipe can use and their options."""
    from slimserve.compress.registry import STAGES

    for name, (options, _) in STAGES.items():
        fields = ", ".join(f"{k}={v.default!r}" for k, v in options.model_fields.items())
        print(f"{name}: {fields}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
