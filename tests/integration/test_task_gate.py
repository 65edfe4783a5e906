"""The recipe's task gate end to end on the demo model: a stage that wrecks the model fails it
(significant drop, artifact to `<output>.failed`, loaders refuse it), a harmless one passes.

The task is PIQA-shaped data made here from the stdlib code the demo model learned: each item's
goal is three lines of stdlib source and the first half of the next, one solution that line's
true end and the other the end of another line: the demo model is right on about two items in three
(0.68 on 80), a model pruned to one layer near chance (0.45).
"""

import json
import random

import datasets
import pytest

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.compress.tasks.data import ENV_VAR
from slimserve.runtime.artifact.manifest import check_gate, read_manifest
from slimserve.runtime.errors import ArtifactError
from tests.helpers import DEMO_MODEL

ITEMS = 160

RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 2, max_ppl_increase: 100000.0}}
calibration: {{num_samples: 4, seq_len: 64}}
gate:
  limit: {items}
  tasks:
    piqa: {{max_drop: 2.0}}
stages:
{stages}
"""


def stdlib_items(n: int) -> list[tuple[str, str, str]]:
    """n (context, true end, other end) from stdlib sources (what the demo model read): the three
    lines before a code line of 30-70 characters and its first half, its second half, and the
    second half of another such line."""
    import argparse
    import collections
    import json as json_mod

    lines = []
    for mod in (argparse, collections, json_mod):
        with open(mod.__file__, encoding="utf-8") as f:
            lines += [line.rstrip() for line in f]
    picks = [
        i
        for i in range(3, len(lines))
        if 30 <= len(lines[i].strip()) <= 70 and not lines[i].strip().startswith("#")
    ]
    random.Random(0).shuffle(picks)
    out = []
    for i, j in zip(picks[:n], picks[n : 2 * n], strict=True):
        line, other = lines[i], lines[j].strip()
        cut = len(line) - len(line.strip()) + len(line.strip()) // 2
        out.append(
            ("\n".join(lines[i - 3 : i]) + "\n" + line[:cut], line[cut:], other[len(other) // 2 :])
        )
    return out


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("task-data")
    rng = random.Random(1)
    rows = {"goal": [], "sol1": [], "sol2": [], "label": []}
    for goal, right, wrong in stdlib_items(ITEMS):
        label = rng.randrange(2)
        sols = (right, wrong) if label == 0 else (wrong, right)
        rows["goal"].append(goal)
        rows["sol1"].append(sols[0])
        rows["sol2"].append(sols[1])
        rows["label"].append(label)
    datasets.Dataset.from_dict(rows).save_to_disk(str(root / "piqa/plain_text/validation"))
    return root


def run(tmp_path, stages: str, name: str):
    text = RECIPE.format(model=DEMO_MODEL, out=tmp_path / name, items=ITEMS, stages=stages)
    return run_recipe(parse_recipe(text, tmp_path / f"{name}.yaml"), log=print, progress=False)


def test_a_wrecked_model_fails_the_task_gate(tmp_path, task_data, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(task_data))
    res = run(tmp_path, "  - prune: {num_layers: 1, multiple_of: 1}", "wrecked")
    assert not res.passed
    assert res.summary["gate"]["passed"]  # the perplexity allowance was huge on purpose
    gate = res.summary["task_gate"]
    v = gate["tasks"]["piqa"]
    assert gate["failed"] == ["piqa"] and not v["passed"] and v["significant"]
    assert v["before"] > 0.6 and v["drop_points"] > 2.0 and v["p_value"] < 0.05
    assert v["n"] == ITEMS
    assert res.artifact == tmp_path / "wrecked.failed"
    assert not (tmp_path / "wrecked").exists()
    report = json.loads((res.artifact / "report.json").read_text())
    assert report["task_gate"]["failed"] == ["piqa"]
    assert "Task gate: **FAILED**" in (res.artifact / "report.md").read_text()
    assert (res.artifact / "report-tasks.png").is_file()
    manifest = read_manifest(res.artifact)
    assert manifest.eval["task_gate"]["passed"] is False
    with pytest.raises(ArtifactError, match="task gate FAILED"):
        check_gate(res.artifact, manifest)


def test_a_harmless_stage_passes_the_task_gate(tmp_path, task_data, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(task_data))
    res = run(tmp_path, "  - rtn: {scheme: W8A16}", "w8")
    assert res.passed, res.summary["task_gate"]
    v = res.summary["task_gate"]["tasks"]["piqa"]
    assert v["passed"] and abs(v["drop_points"]) <= 5.0
    assert res.artifact == tmp_path / "w8"
    before = res.summary["tasks"]["baseline"]["tasks"]["piqa"]["acc"]["value"]
    assert before == pytest.approx(v["before"])
    check_gate(res.artifact, read_manifest(res.artifact))


@pytest.mark.parametrize(
    "gate, message",
    [
        ("{tasks: {pika: {}}}", "gate.tasks.pika: unknown task 'pika'"),
        ("{tasks: {winogrande: {metric: acc_norm}}}", "gate.tasks.winogrande.metric"),
        ("{tasks: {piqa: {max_drop: -1}}}", "gate.tasks.piqa.max_drop"),
        ("{limit: 0, tasks: {piqa: {}}}", "gate.limit"),
    ],
)
def test_bad_task_gates_name_the_key(tmp_path, gate, message):
    from slimserve.compress.errors import RecipeError

    text = f"model: {DEMO_MODEL}\noutput: {tmp_path / 'o'}\ngate: {gate}\nstages:\n  - rtn: {{}}\n"
    with pytest.raises(RecipeError, match=message):
        parse_recipe(text, tmp_path / "r.yaml")
