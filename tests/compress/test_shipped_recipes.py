"""Every recipe shipped in recipes/ validates (keys, schemes, stage names, export format)."""

from pathlib import Path

import pytest

from slimserve.compress.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {"quickstart.yaml", "demo-w4a16-gptq.yaml", "demo-w4a16-awq.yaml", "demo-w3a16-gptq.yaml",
            "demo-w8a8-smoothquant.yaml", "demo-w4a16-gptq-kvfp8.yaml", "demo-prune-mlp30-distill.yaml",
            "demo-prune-heads-layers-distill.yaml", "demo-prune-distill-w4a16.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    r = load_recipe(path)
    assert r.stages and r.text.lstrip().startswith("#")  # each recipe says what it is for
