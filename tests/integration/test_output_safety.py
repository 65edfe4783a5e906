"""`compress run` never deletes what is not its own, a failed gate never replaces a passing
artifact, and the engine refuses a failed-gate artifact unless allowed (tiny random Llama)."""

import json
import os
import stat
import subprocess
import sys

import pytest

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.errors import ArtifactError

RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: {gate}}}
stages:
  - rtn: {{scheme: {scheme}, group_size: 32}}
"""


def _write(tmp_path, model, out, gate=0.5, scheme="W4A16", name="r"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(RECIPE.format(model=model, out=out, gate=gate, scheme=scheme))
    return path


def _run(path):
    return run_recipe(parse_recipe(path.read_text(), path), log=lambda m: None, progress=False)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "slimserve.compress.cli", *args], capture_output=True, text=True
    )


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_refuses_non_artifact_output_and_leaves_it(tmp_path, tiny_checkpoint):
    models = tmp_path / "models"
    (models / "keep").mkdir(parents=True)
    (models / "keep" / "weights.bin").write_bytes(b"precious")
    before = _snapshot(models)
    r = _cli(
        "run",
        str(_write(tmp_path, tiny_checkpoint, tmp_path / "elsewhere")),
        "--output",
        str(models),
        "--no-progress",
    )
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(models) in r.stderr
    assert "not a slimserve artifact" in r.stderr and "Traceback" not in r.stderr
    assert _snapshot(models) == before


@pytest.mark.parametrize("where", ["model", "inside", "parent"])
def test_cli_refuses_output_overlapping_model(tmp_path, tiny_checkpoint, where):
    out = {
        "model": tiny_checkpoint,
        "inside": tiny_checkpoint / "art",
        "parent": tiny_checkpoint.parent,
    }[where]
    before = _snapshot(tiny_checkpoint)
    r = _cli("run", str(_write(tmp_path, tiny_checkpoint, out)), "--no-progress")
    assert r.returncode == 2, r.stderr
    assert "model folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _snapshot(tiny_checkpoint) == before


def test_pass_replaces_failed_gate_keeps_and_serving_refuses(tmp_path, tiny_checkpoint):
    from slimserve.runtime.llm import LLM

    art = tmp_path / "art"
    old = os.umask(0o022)
    try:
        first = _run(_write(tmp_path, tiny_checkpoint, art))
        assert first.passed and first.artifact == art
        (art / "stale.txt").write_text("left by the earlier run")
        second = _run(_write(tmp_path, tiny_checkpoint, art))  # an earlier artifact: replaced
    finally:
        os.umask(old)
    assert second.passed and not (art / "stale.txt").exists()
    assert stat.S_IMODE(art.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in art.rglob("*") if p.is_file()}
    assert "report.md" in modes and set(modes.values()) == {0o644}, modes

    before = _snapshot(art)
    r = _cli(
        "run",
        str(_write(tmp_path, tiny_checkpoint, art, gate=0.0, scheme="W3A16", name="fail")),
        "--no-progress",
    )
    assert r.returncode == 3, r.stderr
    failed = tmp_path / "art.failed"
    assert _snapshot(art) == before  # the passing artifact is byte-identical
    assert str(failed) in r.stdout
    assert json.loads((failed / "slimserve.json").read_text())["eval"]["gate"]["passed"] is False
    assert "FAILED" in (failed / "report.md").read_text()
    assert json.loads((failed / "report.json").read_text())["artifact"] == str(failed)

    with pytest.raises(ArtifactError, match="--allow-failed-gate") as e:
        LLM(str(failed), device="cpu", kv_cache_memory=2**20)
    assert str(failed) in str(e.value) and "FAILED" in str(e.value)
    llm = LLM(str(failed), device="cpu", kv_cache_memory=2**20, allow_failed_gate=True)
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs
    LLM(str(art), device="cpu", kv_cache_memory=2**20)  # the passing one loads as before


def test_serve_cli_refuses_failed_gate_in_one_line(tmp_path, tiny_checkpoint):
    art = _run(
        _write(tmp_path, tiny_checkpoint, tmp_path / "art", gate=0.0, scheme="W3A16")
    ).artifact
    assert art.name == "art.failed" and not (tmp_path / "art").exists()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimserve.runtime.cli",
            "serve",
            str(art),
            "--device",
            "cpu",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert str(art) in line and "--allow-failed-gate" in line and "gate" in line
