"""`compress run` end to end on a tiny random Llama: report, gate, exit codes, artifact."""

import json
import subprocess
import sys

import pytest
import torch

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe

RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 6, max_ppl_increase: {gate}}}
stages:
  - rtn: {{scheme: {scheme}, group_size: 32}}
"""


def _recipe(tmp_path, model, gate=0.5, scheme="W4A16", name="art"):
    text = RECIPE.format(model=model, out=tmp_path / name, gate=gate, scheme=scheme)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_run_writes_artifact_and_report(tmp_path, tiny_checkpoint):
    res = run_recipe(
        parse_recipe(_recipe(tmp_path, tiny_checkpoint).read_text(), tmp_path / "r.yaml"),
        log=lambda m: None,
        progress=False,
    )
    art = res.artifact
    for f in [
        "config.json",
        "model.safetensors",
        "slimserve.json",
        "report.json",
        "report.md",
        "report.png",
    ]:
        assert (art / f).is_file(), f
    rep = json.loads((art / "report.json").read_text())
    assert rep["stages"][0]["name"] == "rtn"
    assert rep["final"]["ppl"] == rep["stages"][-1]["ppl"]
    assert rep["gate"]["ppl_increase"] == pytest.approx(
        rep["final"]["ppl"] / rep["baseline"]["ppl"] - 1
    )
    # 4-bit weights: the artifact's weight files are well under the bf16 baseline.
    assert rep["final"]["size_bytes"] < rep["baseline"]["size_bytes"]
    assert (
        len(rep["stages"][0]["modules"]) == 2 * 7
    )  # q,k,v,o,gate,up,down per layer; lm_head ignored
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == ["lm_head"]
    assert cfg["dtype"] == "bfloat16"  # the checkpoint's dtype, although compression ran in fp32
    manifest = json.loads((art / "slimserve.json").read_text())
    assert manifest["base_model_sha256"] and manifest["recipe"].startswith("\nmodel:")


def test_final_ppl_is_the_artifacts_ppl(tmp_path, tiny_checkpoint):
    """The ppl the pipeline reports is what a loader measures on the exported artifact."""
    from slimserve.compress.datasets import load_token_documents
    from slimserve.compress.perplexity import evaluate_perplexity
    from slimserve.runtime.loading.loader import load_model

    res = run_recipe(
        parse_recipe(_recipe(tmp_path, tiny_checkpoint).read_text(), tmp_path / "r.yaml"),
        log=lambda m: None,
        progress=False,
    )
    loaded = load_model(res.artifact, dtype=torch.float32)
    ids = load_token_documents("stdlib", loaded.tokenizer)
    ppl = evaluate_perplexity(loaded.model, ids, 64, 6, progress=False).ppl
    assert ppl == pytest.approx(res.summary["final"]["ppl"], rel=1e-5)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "slimserve.compress.cli", *args], capture_output=True, text=True
    )


def test_cli_gate_failure_exit_3(tmp_path, tiny_checkpoint):
    p = _recipe(tmp_path, tiny_checkpoint, gate=0.0, scheme="W3A16", name="fail")
    r = _cli("run", str(p), "--no-progress")
    assert r.returncode == 3, r.stderr
    assert "FAILED" in r.stderr
    # a failed gate writes beside the output, never over it (a passing artifact may live there)
    assert not (tmp_path / "fail").exists() and str(tmp_path / "fail.failed") in r.stdout
    assert "FAILED" in (tmp_path / "fail.failed" / "report.md").read_text()
    assert (
        json.loads((tmp_path / "fail.failed" / "slimserve.json").read_text())["eval"]["gate"][
            "passed"
        ]
        is False
    )


def test_cli_bad_recipe_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: x\noutput: y\nstages:\n  - rtn: {bitz: 4}\n")
    r = _cli("run", str(p))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "stages[0].rtn.bitz: unknown key; did you mean 'bits'?" in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "nope.yaml"], "recipe file not found"),
        (["eval", "/no/such/model"], "/no/such/model"),
        (["eval", "x", "--dataset", "bogus"], "bogus"),
        (["eval", "x", "--device", "tpu"], "--device: 'tpu' is not a device"),
        (["eval", "x", "--memory", "bogus"], "--memory 'bogus': use one of auto, layers, whole"),
        (["eval", "/no/such/model", "--memory", "layers"], "cannot be evaluated layer by layer"),
    ],
)
def test_cli_user_errors(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_cli_eval_json(tiny_checkpoint):
    r = _cli("eval", str(tiny_checkpoint), "--seq-len", "64", "--max-windows", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"ppl", "tokens", "seconds"} and out["tokens"] == 2 * 63
