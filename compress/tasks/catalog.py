"""The evaluation tasks: which rows, how each becomes a multiple-choice item, which metrics.

Every task follows the lm-evaluation-harness 0.4.x task YAML of the same name (0-shot, no chat
template), so that our accuracies and lm-eval's agree on the same model:

- a request is (context, continuation) per choice; the continuation is the target delimiter " "
  followed by the choice text; the model's score for a choice is the summed log-probability of
  the continuation's tokens given the context;
- `acc` takes the argmax of those sums, `acc_norm` the argmax of sum / len(choice text) in
  characters (lm-eval divides by the length of the choice string, without the delimiter);
  ties go to the first choice (numpy's argmax);
- a task reports the metrics of its YAML's metric_list (`TaskSpec.metrics`); the aggregate is the
  mean over items with lm-eval's standard error (sample standard deviation / sqrt(n));
- `mmlu` is lm-eval's group of 57 `mmlu_<subject>` tasks (test split, 0-shot, the subject's
  description first); its accuracy weights subjects by size (the mean over all items) and its
  standard error pools the subjects' (`pooled_stderr`), as lm-eval's group aggregation does.

`--limit N` keeps the first N items of every task in dataset order, and for `mmlu` the first N of
every subject, as lm-eval's `--limit` does (each subject is a task there).

Winogrande is "partial evaluation": its choices differ in the context (the sentence up to "_"
with the option in place) and share the continuation (the rest after "_"), so an `Item` carries
one context per choice. The model-side detail that lm-eval's HF backend adds (trailing spaces of
a context moved to the continuation before tokenizing) belongs to the scorer; no context here
ends with whitespace.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slimserve.compress.tasks.data import (
    DataSource,
    HubLoader,
    Row,
    TaskDataError,
    load_from_hub,
    load_rows,
)

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter, used by every task here

# lm-eval's mmlu/default/mmlu_<subject>.yaml tags: the subject's category group.
MMLU_CATEGORIES: dict[str, str] = {
    "abstract_algebra": "stem",
    "anatomy": "stem",
    "astronomy": "stem",
    "business_ethics": "other",
    "clinical_knowledge": "other",
    "college_biology": "stem",
    "college_chemistry": "stem",
    "college_computer_science": "stem",
    "college_mathematics": "stem",
    "college_medicine": "other",
    "college_physics": "stem",
    "computer_security": "stem",
    "conceptual_physics": "stem",
    "econometrics": "social_sciences",
    "electrical_engineering": "stem",
    "elementary_mathematics": "stem",
    "formal_logic": "humanities",
    "global_facts": "other",
    "high_school_biology": "stem",
    "high_school_chemistry": "stem",
    "high_school_computer_science": "stem",
    "high_school_european_history": "humanities",
    "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences",
    "high_school_macroeconomics": "social_sciences",
    "high_school_mathematics": "stem",
    "high_school_microeconomics": "social_sciences",
    "high_school_physics": "stem",
    "high_school_psychology": "social_sciences",
    "high_school_statistics": "stem",
    "high_school_us_history": "humanities",
    "high_school_world_history": "humanities",
    "human_aging": "other",
    "human_sexuality": "social_sciences",
    "international_law": "humanities",
    "jurisprudence": "humanities",
    "logical_fallacies": "humanities",
    "machine_learning": "stem",
    "management": "other",
    "marketing": "other",
    "medical_genetics": "other",
    "miscellaneous": "other",
    "moral_disputes": "humanities",
    "moral_scenarios": "humanities",
    "nutrition": "other",
    "philosophy": "humanities",
    "prehistory": "humanities",
    "professional_accounting": "other",
    "professional_law": "humanities",
    "professional_medicine": "other",
    "professional_psychology": "social_sciences",
    "public_relations": "social_sciences",
    "security_studies": "social_sciences",
    "sociology": "social_sciences",
    "us_foreign_policy": "social_sciences",
    "virology": "other",
    "world_religions": "humanities",
}
MMLU_SUBJECTS: tuple[str, ...] = tuple(sorted(MMLU_CATEGORIES))


@dataclass(frozen=True, slots=True)
class Item:
    """One multiple-choice question, ready for log-likelihood scoring.

    `contexts[i]` + `continuations[i]` is choice i's full text; only the continuation's tokens are
    scored. `norm_lengths[i]` is the character count `acc_norm` divides by.
    """

    task: str  # the leaf task: "piqa", "mmlu_anatomy", ...
    index: int  # position in the task's split (dataset order), the key of paired comparisons
    contexts: tuple[str, ...]  # one per choice (all equal except for partial-evaluation tasks)
    continuations: tuple[str, ...]  # one per choice, starting with the target delimiter
    gold: int  # index of the correct choice
    norm_lengths: tuple[int, ...]  # len(choice text) per choice, as lm-eval's acc_norm uses

    @property
    def num_choices(self) -> int:
        return len(self.continuations)

    @property
    def shared_context(self) -> str | None:
        """The context when all choices share it (the prefix to prefill once), else None."""
        first = self.contexts[0]
        return first if all(c == first for c in self.contexts) else None

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) per choice: lm-eval's loglikelihood request arguments."""
        return list(zip(self.contexts, self.continuations, strict=True))


# What a task's row becomes: (contexts, choice texts, gold). A single context is shared.
Builder = Callable[[Row], tuple[Sequence[str], Sequence[str], int]]


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One leaf task: where its rows are, how a row becomes an `Item`, what lm-eval reports."""

    name: str
    source: DataSource
    build: Builder
    metrics: tuple[str, ...]  # ("acc", "acc_norm") or ("acc",), lm-eval's metric_list
    description: str = ""  # prepended to every context (mmlu's subject line)
    partial: bool = False  # the choices are in the contexts (winogrande)

    def item(self, index: int, row: Row) -> Item:
        contexts, choices, gold = self.build(row)
        choices = list(choices)
        if not 0 <= gold < len(choices):
            raise TaskDataError(
                f"{self.name} item {index}: gold {gold} outside {len(choices)} choices"
            )
        if self.partial:
            # contexts are the choices; one shared target continues each of them
            (target,) = contexts
            ctxs = tuple(self.description + c for c in choices)
            conts = (TARGET_DELIMITER + target,) * len(choices)
        else:
            (context,) = contexts
            ctxs = (self.description + context,) * len(choices)
            conts = tuple(TARGET_DELIMITER + c for c in choices)
        return Item(
            task=self.name,
            index=index,
            contexts=ctxs,
            continuations=conts,
            gold=gold,
            norm_lengths=tuple(len(c) for c in choices),
        )


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag/utils.py `preprocess`: WikiHow artifacts out, double spaces once."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _piqa(row: Row):
    return [f"Question: {row['goal']}\nAnswer:"], [row["sol1"], row["sol2"]], int(row["label"])


def _arc(row: Row):
    choices = row["choices"]
    gold = choices["label"].index(row["answerKey"])
    return [f"Question: {row['question']}\nAnswer:"], choices["text"], gold


def _hellaswag(row: Row):
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_preprocess(row["activity_label"] + ": " + ctx)
    return [query], [_hellaswag_preprocess(e) for e in row["endings"]], int(row["label"])


def _winogrande(row: Row):
    sentence = row["sentence"]
    blank = sentence.index("_")
    target = sentence[blank + 1 :].strip()
    options = [sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]]
    return [target], options, {"1": 0, "2": 1}[row["answer"]]


def _boolq(row: Row):
    # super_glue's boolq (the hub's) has `label`; google's (the offline copy) has `answer`
    label = row["label"] if "label" in row else int(bool(row["answer"]))
    return [f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"], ["no", "yes"], int(label)


def _openbookqa(row: Row):
    choices = row["choices"]
    gold = choices["label"].index(row["answerKey"].lstrip())
    return [row["question_stem"]], choices["text"], gold


def _mmlu(row: Row):
    c = row["choices"]
    text = f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"
    return [text], ["A", "B", "C", "D"], int(row["answer"])


ACC = ("acc",)
ACC_NORM = ("acc", "acc_norm")


def _mmlu_spec(subject: str) -> TaskSpec:
    return TaskSpec(
        name=f"mmlu_{subject}",
        source=DataSource("cais/mmlu", subject, "test", f"hails/mmlu_no_train/{subject}/test"),
        build=_mmlu,
        metrics=ACC,
        description="The following are multiple choice questions (with answers) about "
        f"{subject.replace('_', ' ')}.\n\n",
    )


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            "piqa",
            DataSource("baber/piqa", None, "validation", "piqa/plain_text/validation"),
            _piqa,
            ACC_NORM,
        ),
        TaskSpec(
            "arc_easy",
            DataSource("allenai/ai2_arc", "ARC-Easy", "validation", "ai2_arc/ARC-Easy/validation"),
            _arc,
            ACC_NORM,
        ),
        TaskSpec(
            "arc_challenge",
            DataSource(
                "allenai/ai2_arc", "ARC-Challenge", "validation", "ai2_arc/ARC-Challenge/validation"
            ),
            _arc,
            ACC_NORM,
        ),
        TaskSpec(
            "hellaswag",
            DataSource("Rowan/hellaswag", None, "validation", "hellaswag/none/validation"),
            _hellaswag,
            ACC_NORM,
        ),
        TaskSpec(
            "winogrande",
            DataSource(
                "allenai/winogrande",
                "winogrande_xl",
                "validation",
                "winogrande/winogrande_xl/validation",
            ),
            _winogrande,
            ACC,
            partial=True,
        ),
        TaskSpec(
            "boolq",
            DataSource("aps/super_glue", "boolq", "validation", "boolq/none/validation"),
            _boolq,
            ACC,
        ),
        TaskSpec(
            "openbookqa",
            DataSource("allenai/openbookqa", "main", "validation", "openbookqa/main/validation"),
            _openbookqa,
            ACC_NORM,
        ),
        *(_mmlu_spec(s) for s in MMLU_SUBJECTS),
    )
}

# Groups: a name standing for several leaf tasks, aggregated weighted by size.
GROUPS: dict[str, tuple[str, ...]] = {
    "mmlu": tuple(f"mmlu_{s}" for s in MMLU_SUBJECTS),
    **{
        f"mmlu_{cat}": tuple(f"mmlu_{s}" for s in MMLU_SUBJECTS if MMLU_CATEGORIES[s] == cat)
        for cat in sorted(set(MMLU_CATEGORIES.values()))
    },
}
MAIN_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa")


def known_tasks() -> str:
    """The names `parse_tasks` accepts, for error messages."""
    return ", ".join([*MAIN_TASKS, *GROUPS]) + ", mmlu_<subject>"


def parse_tasks(spec: str) -> list[str]:
    """Task and group names from "piqa,arc_easy,mmlu": checked, deduplicated, in the given order."""
    names: list[str] = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in TASKS and name not in GROUPS:
            raise TaskDataError(f"unknown task {name!r}; known: {known_tasks()}")
        if name not in names:
            names.append(name)
    if not names:
        raise TaskDataError(f"no task given; known: {known_tasks()}")
    return names


def leaf_tasks(name: str) -> tuple[str, ...]:
    """The leaf tasks a task or group name stands for."""
    if name in GROUPS:
        return GROUPS[name]
    if name in TASKS:
        return (name,)
    raise TaskDataError(f"unknown task {name!r}; known: {known_tasks()}")


def task_metrics(name: str) -> tuple[str, ...]:
    """The metrics a task or group reports (a group: those all its leaves report)."""
    leaves = [TASKS[t].metrics for t in leaf_tasks(name)]
    return tuple(m for m in leaves[0] if all(m in ms for ms in leaves))


def load_items(
    name: str,
    limit: int | None = None,
    *,
    root: Path | None | str = "auto",
    hub: HubLoader | None = load_from_hub,
) -> list[Item]:
    """The items of a task or group: the first `limit` of every leaf task (all when None).

    `root` and `hub` as in `data.load_rows` (tests pass `hub=None`).
    """
    items: list[Item] = []
    for leaf in leaf_tasks(name):
        spec = TASKS[leaf]
        rows = load_rows(spec.source, limit, root=root, hub=hub, task=leaf)
        items.extend(spec.item(i, row) for i, row in enumerate(rows))
    return items


# --- scoring: log-likelihoods to correctness, lm-eval's way -----------------------------------


@dataclass(frozen=True, slots=True)
class ItemScore:
    """One item's verdicts from its choices' summed log-likelihoods."""

    pred: int  # argmax of the log-likelihoods (first on ties)
    pred_norm: int  # argmax of log-likelihood / norm length
    acc: float  # 1.0 when pred is gold
    acc_norm: float  # 1.0 when pred_norm is gold
    exact_match: float | None = (
        None  # 1.0 when gold's continuation is the greedy one; None if unknown
    )

    def metric(self, name: str) -> float:
        return {"acc": self.acc, "acc_norm": self.acc_norm}[name]


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def score_choices(
    logprobs: Sequence[float],
    norm_lengths: Sequence[int],
    gold: int,
    is_greedy: Sequence[bool] | None = None,
) -> ItemScore:
    """acc / acc_norm of one item from each choice's summed continuation log-probability."""
    if len(logprobs) != len(norm_lengths) or not logprobs:
        raise ValueError(f"{len(logprobs)} log-likelihoods for {len(norm_lengths)} choices")
    pred = _argmax(logprobs)
    # lm-eval divides by float lengths with numpy; a zero length gives +-inf (or nan), as there
    pred_norm = _argmax(
        [lp / n if n else math.copysign(math.inf, lp) for lp, n in zip(logprobs, norm_lengths)]
    )
    greedy = None if is_greedy is None else float(bool(is_greedy[gold]))
    return ItemScore(pred, pred_norm, float(pred == gold), float(pred_norm == gold), greedy)


def score_item(
    item: Item, logprobs: Sequence[float], is_greedy: Sequence[bool] | None = None
) -> ItemScore:
    """`score_choices` for an `Item` (logprobs in the item's choice order)."""
    if len(logprobs) != item.num_choices:
        raise ValueError(
            f"{item.task} item {item.index}: {len(logprobs)} log-likelihoods for "
            f"{item.num_choices} choices"
        )
    return score_choices(logprobs, item.norm_lengths, item.gold, is_greedy)


@dataclass(frozen=True, slots=True)
class Accuracy:
    """A metric's mean over items with lm-eval's standard error."""

    value: float
    stderr: float
    n: int


def mean_stderr(values: Sequence[float]) -> float:
    """lm-eval's `mean_stderr`: sample standard deviation (n - 1) / sqrt(n); nan below 2 items."""
    n = len(values)
    if n < 2:
        return math.nan
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def accuracy(values: Sequence[float]) -> Accuracy:
    """Mean and standard error of one task's per-item 0/1 values."""
    if not values:
        raise ValueError("no items to aggregate")
    return Accuracy(sum(values) / len(values), mean_stderr(values), len(values))


def pooled_stderr(stderrs: Sequence[float], sizes: Sequence[int]) -> float:
    """lm-eval's `pooled_sample_stderr`: a size-weighted group's standard error from its parts'."""
    if len(stderrs) != len(sizes) or sum(sizes) <= len(sizes):
        return math.nan
    var = sum((n - 1) * s**2 * n for s, n in zip(stderrs, sizes)) / (sum(sizes) - len(sizes))
    return math.sqrt(var / sum(sizes))


def group_accuracy(parts: Sequence[Accuracy]) -> Accuracy:
    """A group's metric from its leaf tasks', weighted by size, as lm-eval aggregates groups."""
    if not parts:
        raise ValueError("no tasks to aggregate")
    total = sum(p.n for p in parts)
    value = sum(p.value * p.n for p in parts) / total
    if len(parts) == 1:
        return Accuracy(value, parts[0].stderr, total)
    return Accuracy(value, pooled_stderr([p.stderr for p in parts], [p.n for p in parts]), total)


def aggregate(name: str, items: Sequence[Item], scores: Sequence[ItemScore]) -> dict[str, Accuracy]:
    """Each metric `name` reports over its items: per task, or size-weighted over a group's leaves."""
    if len(items) != len(scores):
        raise ValueError(f"{len(scores)} scores for {len(items)} items")
    by_leaf: dict[str, list[ItemScore]] = {}
    for item, score in zip(items, scores):
        by_leaf.setdefault(item.task, []).append(score)
    out: dict[str, Accuracy] = {}
    for metric in task_metrics(name):
        parts = [accuracy([s.metric(metric) for s in ss]) for ss in by_leaf.values()]
        out[metric] = group_accuracy(parts) if name in GROUPS else parts[0]
    return out
