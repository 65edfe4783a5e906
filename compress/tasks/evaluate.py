"""Task accuracy of a model or artifact: items (compress/tasks/catalog.py) scored on our engine
(compress/tasks/scorer.py), aggregated as lm-evaluation-harness does; the task gate's
before/after judgement (compress/tasks/stats.py).

`evaluate_tasks` loads the model once with the runtime (runtime/llm.py), scores every task's
items in one run of the scorer and returns a `TaskRun`: per task its metrics (value, standard
error, Wilson interval) and each item's correctness, keyed by (leaf task, index) so that two runs
on the same items pair up. `judge_tasks` compares two runs for the recipe's `gate.tasks`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from slimserve.compress.progress import counting_bar
from slimserve.compress.tasks.catalog import (
    aggregate,
    load_items,
    score_item,
    task_metrics,
)
from slimserve.compress.tasks.scorer import score_items
from slimserve.compress.tasks.stats import paired_comparison, wilson_interval
from slimserve.runtime.llm import LLM


@dataclass
class TaskResult:
    """One task (or group) of a run."""

    name: str
    n: int  # items scored
    # metric -> {"value", "stderr", "ci_low", "ci_high"} (fractions; Wilson 95 % interval)
    metrics: dict[str, dict[str, float]]
    # metric -> per item 1.0 / 0.0, in the order of `keys`
    correct: dict[str, list[float]] = field(repr=False)
    keys: list[str] = field(repr=False)  # "<leaf task>/<index>" per item

    def to_dict(self, with_items: bool = False) -> dict:
        out = {"n": self.n, **{m: dict(v) for m, v in self.metrics.items()}}
        if with_items:
            out["items"] = {"keys": self.keys, "correct": self.correct}
        return out

    @classmethod
    def from_dict(cls, name: str, d: dict) -> TaskResult:
        items = d.get("items") or {"keys": [], "correct": {}}
        metrics = {k: v for k, v in d.items() if k not in ("n", "items")}
        return cls(name, d["n"], metrics, items["correct"], items["keys"])


@dataclass
class TaskRun:
    """Every task of one evaluation, and what it cost."""

    tasks: dict[str, TaskResult]
    seconds: float  # scoring alone (the model load excluded)
    load_seconds: float
    requests: int  # choices scored (one engine request each)
    prompt_tokens: int  # tokens of every choice's prompt (before prefix-cache hits)
    cached_tokens: int  # of those, tokens the prefix cache served

    def to_dict(self, with_items: bool = False) -> dict:
        return {
            "tasks": {n: r.to_dict(with_items) for n, r in self.tasks.items()},
            "seconds": round(self.seconds, 3),
            "load_seconds": round(self.load_seconds, 3),
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


def evaluate_tasks(
    model: str,
    names: Sequence[str],
    limit: int | None | Mapping[str, int | None] = None,
    *,
    progress: bool = True,
    note: Callable[[str], None] = print,
    **engine_args,
) -> TaskRun:
    """Score the tasks `names` (checked with catalog.parse_tasks) on `model`, the first `limit`
    items of each leaf task (a mapping: per name, absent names all). engine_args go to the
    runtime's LLM (device, dtype, kv_cache_dtype, verify, allow_failed_gate, ...)."""
    limits = limit if isinstance(limit, Mapping) else dict.fromkeys(names, limit)
    per_task = {name: load_items(name, limits.get(name)) for name in names}
    t0 = time.perf_counter()
    llm = LLM(model, **engine_args)
    try:
        load_s = time.perf_counter() - t0
        return _score(llm, per_task, load_s, progress, note)
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def _score(llm: LLM, per_task: dict, load_s: float, progress: bool, note) -> TaskRun:
    flat = [item for items in per_task.values() for item in items]
    bm = llm.engine.block_manager
    queried, hits = bm.num_queried_tokens, bm.num_hit_tokens
    t0 = time.perf_counter()
    with counting_bar("tasks", progress) as bar:
        job = bar.add_task("tasks", total=len(flat))
        scores = score_items(
            llm,
            [(it.contexts, it.continuations) for it in flat],
            on_progress=lambda done: bar.update(job, completed=done),
        )
    seconds = time.perf_counter() - t0
    by_item = {}
    for item, choice_scores in zip(flat, scores):
        by_item[(item.task, item.index)] = score_item(
            item, [c.logprob for c in choice_scores], [c.greedy for c in choice_scores]
        )
    results = {}
    for name, items in per_task.items():
        verdicts = [by_item[(it.task, it.index)] for it in items]
        agg = aggregate(name, items, verdicts)
        metrics = {}
        for metric, acc in agg.items():
            right = round(sum(v.metric(metric) for v in verdicts))
            low, high = wilson_interval(right, len(items))
            metrics[metric] = {
                "value": acc.value,
                "stderr": acc.stderr,
                "ci_low": low,
                "ci_high": high,
            }
        results[name] = TaskResult(
            name,
            len(items),
            metrics,
            {m: [v.metric(m) for v in verdicts] for m in task_metrics(name)},
            [f"{it.task}/{it.index}" for it in items],
        )
    n_requests = sum(len(s) for s in scores)
    run = TaskRun(
        results,
        seconds,
        load_s,
        n_requests,
        bm.num_queried_tokens - queried,
        bm.num_hit_tokens - hits,
    )
    note(
        f"scored {len(flat)} items ({n_requests} choices) in {seconds:.1f} s "
        f"({len(flat) / max(seconds, 1e-9):.1f} items/s; model load {load_s:.1f} s)"
    )
    return run


@dataclass(frozen=True)
class TaskVerdict:
    """The task gate's judgement of one task: the paired comparison and the rule applied."""

    task: str
    metric: str
    max_drop: float  # accuracy points
    alpha: float
    n: int
    before: float
    after: float
    drop_points: float
    p_value: float
    diff_ci: tuple[float, float]  # after - before, fractions (paired bootstrap)
    before_ci: tuple[float, float]
    after_ci: tuple[float, float]
    significant: bool
    passed: bool

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def judge_task(
    before: TaskResult, after: TaskResult, metric: str, max_drop: float, alpha: float
) -> TaskVerdict:
    """A task fails when its accuracy dropped by more than `max_drop` points AND the drop is
    significant (exact McNemar on the same items, p < alpha): a drop the items cannot tell from
    noise does not fail a run, and neither does a significant drop within the allowance."""
    if before.keys != after.keys:
        raise ValueError(
            f"task {before.name}: the runs scored different items; the gate compares the same items"
        )
    cmp = paired_comparison(before.correct[metric], after.correct[metric])
    significant = cmp.significant(alpha) and cmp.drop_points > 0
    return TaskVerdict(
        task=before.name,
        metric=metric,
        max_drop=max_drop,
        alpha=alpha,
        n=cmp.n,
        before=cmp.before,
        after=cmp.after,
        drop_points=cmp.drop_points,
        p_value=cmp.p_value,
        diff_ci=cmp.diff_ci,
        before_ci=cmp.before_ci,
        after_ci=cmp.after_ci,
        significant=significant,
        passed=not (significant and cmp.drop_points > max_drop),
    )
