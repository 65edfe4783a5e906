"""eval/interop_check.py: transformers reproduces the perplexity our report gives an artifact."""

import json
import shutil

import pytest

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.eval.interop_check import check_artifact, main, reference_ppl
from tests.helpers.tiny_model import save_tiny_llama

RECIPE = """\
model: {model}
output: {output}
calibration: {{dataset: stdlib, num_samples: 4, seq_len: 64, seed: 0}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 6, max_ppl_increase: 10.0}}
stages:
  - gptq: {{scheme: W4A16, group_size: 32}}
  - kv_cache: {{dtype: fp8_e4m3}}
export: {{format: compressed-tensors}}
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    work = tmp_path_factory.mktemp("interop")
    model = save_tiny_llama(work / "tiny")
    text = RECIPE.format(model=model, output=work / "artifact")
    run_recipe(parse_recipe(text, work / "r.yaml"), log=lambda m: None, progress=False)
    return work / "artifact"


def test_transformers_reproduces_the_weight_stages_perplexity(artifact):
    check = check_artifact(artifact, progress=False)
    report = json.loads((artifact / "report.json").read_text())
    # The kv_cache stage's scales are not applied by transformers: the reference is GPTQ's number.
    assert check.reference_stage == "gptq" and check.ours == report["stages"][0]["ppl"]
    assert check.windows == 6 and check.seq_len == 64
    assert check.ok(), (check.ours, check.transformers)


def test_a_report_that_disagrees_with_the_weights_fails(artifact, tmp_path, capsys):
    copy = shutil.copytree(artifact, tmp_path / "copy")
    report = json.loads((copy / "report.json").read_text())
    report["stages"][0]["ppl"] *= 1.01  # a claim 1% off what the weights measure
    (copy / "report.json").write_text(json.dumps(report))
    assert main([str(copy)]) == 1
    out = capsys.readouterr().out
    assert "| copy | gptq |" in out and "| NO (0.001) |" in out


def test_reference_stage_and_unreadable_folders(tmp_path, capsys):
    report = {"baseline": {"ppl": 5.0}, "stages": [{"name": "kv_cache", "ppl": 6.0}]}
    assert reference_ppl(report) == ("baseline", 5.0)
    report["stages"].insert(0, {"name": "smoothquant", "ppl": 5.5})
    assert reference_ppl(report) == ("smoothquant", 5.5)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no report.json" in err and "Traceback" not in err
