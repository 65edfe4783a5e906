"""The README's quantization table reproduces to its last printed digit (marker `slow`: a
calibration and full-split perplexity passes per row). The recipes are the ones
`python -m slimserve.eval.bench_quant` generates for its table; this re-runs three rows in-process
and compares them with the numbers the README prints."""

import pytest

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.eval.bench_quant import CONFIGS, recipe_yaml, workload

from tests.helpers import DEMO_MODEL

pytestmark = pytest.mark.slow

BASELINE = 13.3528
# (scheme, method) -> final ppl, as printed in README "Quantization quality".
EXPECTED = {
    ("W4A16 g128", "rtn"): 13.4352,
    ("W4A16 g128", "gptq"): 13.3762,
    ("W8A8", "smoothquant + rtn"): 13.3583,
}


@pytest.mark.parametrize("row", sorted(EXPECTED), ids=lambda r: f"{r[0]}-{r[1]}".replace(" ", "_"))
def test_bench_quant_row_reproduces_readme_perplexity(row, tmp_path):
    cfg = next(c for c in CONFIGS if (c.scheme, c.method) == row)
    text = recipe_yaml(DEMO_MODEL, cfg, workload(quick=False), tmp_path / "artifact")
    res = run_recipe(parse_recipe(text, tmp_path / "recipe.yaml"), log=lambda m: None, progress=False)
    assert round(res.summary["baseline"]["ppl"], 4) == BASELINE
    assert round(res.summary["final"]["ppl"], 4) == EXPECTED[row]
