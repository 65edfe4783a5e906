"""A fresh install works from the repository root (docs/architecture.md, "Layer folders and
sys.path"): the layer folders `kernels/`, `runtime/`, `compress/` and `eval/` sit at the root,
which is on sys.path in every `python -c` / `python -m` started there and in pytest. They are
namespace portions, so an installed package of the same name (Hugging Face's `kernels`, which
transformers imports, or any future `runtime`/`compress`/`eval`) is always the one imported.

Every check runs in a child process whose working directory is the repository root, as a user
typing the README's commands there would; with an `__init__.py` back in a layer folder, these
tests fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "runtime", "compress", "eval")
BIN = Path(sys.executable).parent


def _hf_kernels_installed() -> bool:
    """Hugging Face's `kernels` is installed (transformers >= 5.2x depends on it): asked of the
    installed distributions, since pytest's own sys.path may map the bare name elsewhere."""
    try:
        distribution("kernels")
    except PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    """A site directory holding a regular package named like each layer folder (except
    `kernels` when Hugging Face's is installed: that one is imported from the venv)."""
    site = tmp_path_factory.mktemp("site")
    for name in LAYERS:
        if name == "kernels" and _hf_kernels_installed():
            continue
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"STANDIN = {name!r}\n")
    return site


def _in_a_layer_folder(file: str) -> bool:
    """The venv may live inside the checkout (the README's `.venv`): only the layer folders count."""
    return any(Path(file).resolve().is_relative_to(REPO / layer) for layer in LAYERS)


def _run_at_root(args: list[str], pythonpath: Path | None = None, timeout: float = 300):
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # the root must be on sys.path, as for a user typing there
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p
        )
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_installed_packages_win_over_the_layer_folders(standins):
    probe = (
        "import importlib, json, sys\n"
        "assert sys.path[0] == '', sys.path[:2]\n"  # `python -c`: the working directory comes first
        f"out = {{n: importlib.import_module(n).__file__ for n in {LAYERS!r}}}\n"
        "print(json.dumps(out))\n"
    )
    r = _run_at_root([sys.executable, "-c", probe], standins)
    assert r.returncode == 0, r.stderr[-2000:]
    files = json.loads(r.stdout.strip().splitlines()[-1])
    for name, file in files.items():
        assert file is not None and not _in_a_layer_folder(file), (
            f"`import {name}` from the repository root resolved to {file}: the layer folder "
            "shadows the installed package"
        )


def test_transformers_llama_and_hub_kernels_import_from_the_root(standins):
    probe = (
        "from transformers import LlamaForCausalLM, LlamaConfig\n"
        "import transformers.integrations.hub_kernels as hk\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "print('ok', type(m).__name__)\n"
    )
    r = _run_at_root([sys.executable, "-c", probe], standins)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok LlamaForCausalLM")


@pytest.mark.skipif(not _hf_kernels_installed(), reason="Hugging Face's kernels is not installed")
def test_hf_kernels_is_the_installed_one_from_the_root():
    r = _run_at_root([sys.executable, "-c", "import kernels; print(kernels.__file__)"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert not _in_a_layer_folder(r.stdout.strip()), r.stdout


def test_python_m_child_at_the_root_loads_a_model(standins):
    """A `python -m slimserve...` child from the root (as `runtime bench`, the tune runner,
    replicas and ranks start theirs) imports transformers' Llama and scores the demo model."""
    r = _run_at_root(
        [
            sys.executable,
            "-m",
            "slimserve.compress.cli",
            "eval",
            "recipes/demo-model",
            "--dataset",
            "stdlib",
            "--max-windows",
            "2",
            "--json",
        ],
        standins,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert json.loads(r.stdout)["ppl"] > 1


def test_readme_bench_with_hf_baseline_at_the_root(tmp_path):
    """The README's `runtime bench recipes/demo-model --baseline hf`, typed at the root (the
    bench starts `runtime serve` as a `python -m` child there, and HF generate in-process)."""
    out = tmp_path / "bench.json"
    r = _run_at_root(
        [
            str(BIN / "runtime"),
            "bench",
            "recipes/demo-model",
            "--baseline",
            "hf",
            "--num-prompts",
            "4",
            "--input-len-min",
            "16",
            "--input-len-median",
            "32",
            "--input-len-max",
            "48",
            "--output-len-min",
            "4",
            "--output-len-median",
            "8",
            "--output-len-max",
            "12",
            "--no-progress",
            "--json-out",
            str(out),
        ],
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(out.read_text())
    run, hf = result["runs"][0], result["baseline"]
    assert run["completed"] == 4 and run["failed"] == 0 and hf["completed"] == 4
    assert run["ratio_vs_hf"] > 0
