"""Recipe validation: every problem names its path and the fix, before any model loads."""

from pathlib import Path

import pytest

from slimserve.compress.errors import RecipeError
from slimserve.compress.recipe import load_recipe, parse_recipe

GOOD = """
model: demo-model
output: ../artifacts/x
eval: {dataset: stdlib, seq_len: 256, max_ppl_increase: 0.05}
stages:
  - rtn: {scheme: W4A16, group_size: 64, ignore: [lm_head]}
"""


def test_good_recipe_resolves_paths(tmp_path: Path):
    (tmp_path / "demo-model").mkdir()
    f = tmp_path / "r.yaml"
    f.write_text(GOOD)
    r = load_recipe(f)
    assert r.model == str((tmp_path / "demo-model").resolve())
    assert r.output == (tmp_path / "../artifacts/x").resolve()
    assert r.eval.max_ppl_increase == 0.05 and r.eval.max_windows is None
    (stage,) = r.stages
    assert stage.name == "rtn"
    assert stage.config.resolve_scheme().weights.group_size == 64
    assert r.text == GOOD and not r.needs_calibration


def test_output_override(tmp_path: Path):
    f = tmp_path / "r.yaml"
    f.write_text(GOOD)
    assert load_recipe(f, output=tmp_path / "o").output == (tmp_path / "o").resolve()


def test_hub_id_kept_when_no_local_folder():
    assert (
        parse_recipe(GOOD.replace("demo-model", "meta-llama/Llama-3.1-8B")).model
        == "meta-llama/Llama-3.1-8B"
    )


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("group_size: 64", "bitz: 4", "stages[0].rtn.bitz: unknown key; did you mean 'bits'?"),
        ("eval:", "evl:", "evl: unknown key; did you mean 'eval'?"),
        (
            "max_ppl_increase",
            "max_ppl_increse",
            "eval.max_ppl_increse: unknown key; did you mean 'max_ppl_increase'?",
        ),
        ("rtn:", "rnt:", "stages[0].rnt: unknown stage; did you mean 'rtn'?"),
        ("scheme: W4A16", "scheme: W5A16", "stages[0].rtn: unknown scheme 'W5A16'"),
        ("group_size: 64", "group_size: 100", "group_size=100 is invalid"),
        ("seq_len: 256", "seq_len: -1", "eval.seq_len: Input should be greater than 1"),
        ("output: ../artifacts/x", "", "output: required key is missing"),
        ("model: demo-model", "model: ./nope", "model: folder"),
    ],
)
def test_bad_recipes_name_the_path(old, new, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe(GOOD.replace(old, new))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_not_yaml_and_missing_file(tmp_path: Path):
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse_recipe("model: [unclosed")
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match="YAML mapping"):
        parse_recipe("- just a list")
