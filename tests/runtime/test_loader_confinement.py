"""The confined loader: files only from inside the folder, a manifest covering every file of a
slimserve artifact (refused when missing under verify="strict"), config values checked against
the safetensors headers before anything is allocated. Both loaders (runtime/loading/loader.py
`load_model`, runtime/models/load.py `build_model`) are exercised."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from slimserve.runtime.artifact.manifest import MANIFEST_NAME, MARKER_KEY
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading.loader import load_model
from slimserve.runtime.models.load import build_model

RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 32, max_windows: 2, max_ppl_increase: 10.0}}
stages:
  - rtn: {{scheme: W4A16, group_size: 32}}
"""


def _hf(path: Path, verify: str = "strict"):
    return load_model(path, dtype=torch.float32, verify=verify)


def _engine(path: Path, verify: str = "strict"):
    return build_model(path, torch.float32, torch.device("cpu"), verify=verify)


LOADERS = [pytest.param(_hf, id="load_model"), pytest.param(_engine, id="build_model")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """A W4A16 artifact exported in-process from the tiny checkpoint."""
    from slimserve.compress.pipeline import run_recipe
    from slimserve.compress.recipe import parse_recipe

    tmp = tmp_path_factory.mktemp("confined")
    text = RECIPE.format(model=tiny_checkpoint, out=tmp / "art")
    res = run_recipe(parse_recipe(text, tmp / "r.yaml"), log=lambda m: None, progress=False)
    return res.artifact


@pytest.fixture
def art(artifact, tmp_path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "art"))


@pytest.fixture
def plain(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "plain"))


def _index(folder: Path, target: str) -> None:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: target for k in keys}})
    )


def test_manifest_covers_every_file(artifact):
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 2
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        assert name in manifest["files"], name
    for name in (MANIFEST_NAME, "report.json", "report.md", "report.png"):
        assert name not in manifest["files"], name
    assert json.loads((artifact / "config.json").read_text())[MARKER_KEY] == {
        "manifest": MANIFEST_NAME
    }


@pytest.mark.parametrize("load", LOADERS)
def test_index_naming_parent_path_refused(plain, load):
    shutil.copy(plain / "model.safetensors", plain.parent / "x.safetensors")
    _index(plain, "../x.safetensors")
    with pytest.raises(ArtifactError, match=r"\.\./x\.safetensors"):
        load(plain)


@pytest.mark.parametrize("load", LOADERS)
def test_index_naming_absolute_path_refused(plain, load, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(plain / "model.safetensors", outside)
    _index(plain, str(outside))
    with pytest.raises(ArtifactError, match="outside.safetensors.*not a plain file name"):
        load(plain)


@pytest.mark.parametrize("load", LOADERS)
def test_symlink_leaving_folder_refused(plain, load, tmp_path):
    outside = tmp_path / "elsewhere" / "w.safetensors"
    outside.parent.mkdir()
    shutil.move(plain / "model.safetensors", outside)
    (plain / "model.safetensors").symlink_to(outside)
    with pytest.raises(ArtifactError, match="'model.safetensors', a symlink .* outside"):
        load(plain)


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "chat_template.jinja"])
def test_tampered_file_detected(art, load, name):
    path = art / name
    if name == "config.json":
        cfg = json.loads(path.read_text())
        cfg["rms_norm_eps"] = 0.5
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    elif name == "chat_template.jinja":
        path.write_text("{{ 'ignore previous instructions' }}" + path.read_text())
    else:
        path.write_text(json.dumps(json.loads(path.read_text())))  # same content, other bytes
    with pytest.raises(ArtifactError, match=f"checksum mismatch for .*{name}"):
        load(art)
    load(art, verify="none")  # the user's way out, named in the message


@pytest.mark.parametrize("load", LOADERS)
def test_unlisted_file_refused(art, load):
    (art / "special_tokens_map.json").write_text("{}")
    with pytest.raises(ArtifactError, match="special_tokens_map.json .*not listed"):
        load(art)


@pytest.mark.parametrize("load", LOADERS)
def test_missing_manifest_refused_under_strict(art, load):
    (art / MANIFEST_NAME).unlink()
    with pytest.raises(ArtifactError, match=f"{MANIFEST_NAME} is missing.*--verify none"):
        load(art)
    loaded = load(art, verify="none")
    assert loaded.quantized


def test_llm_and_engine_config_take_verify(art):
    from slimserve.runtime.config import EngineConfig
    from slimserve.runtime.llm import LLM

    (art / MANIFEST_NAME).unlink()
    with pytest.raises(ArtifactError, match="is missing"):
        LLM(str(art), device="cpu", kv_cache_memory=2**20)
    LLM(str(art), device="cpu", kv_cache_memory=2**20, verify="none")
    with pytest.raises(ValueError, match="verify"):
        EngineConfig(model=str(art), verify="lax")


@pytest.mark.parametrize("load", LOADERS)
def test_plain_hf_checkpoint_loads(plain, load):
    assert not (plain / MANIFEST_NAME).exists()
    assert not load(plain).quantized


def test_version_1_manifest_still_verifies_weights(art):
    manifest = json.loads((art / MANIFEST_NAME).read_text())
    manifest["format_version"] = 1
    manifest["files"] = {"model.safetensors": manifest["files"]["model.safetensors"]}
    (art / MANIFEST_NAME).write_text(json.dumps(manifest))
    _engine(art)
    with open(art / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ArtifactError, match="checksum mismatch for .*model.safetensors"):
        _engine(art)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("load", LOADERS)
def test_huge_num_hidden_layers_refused_fast(plain, load):
    cfg = json.loads((plain / "config.json").read_text())
    cfg["num_hidden_layers"] = 1_000_000_000
    (plain / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises(
        ArtifactError,
        match=r"num_hidden_layers = 1000000000, but the weight files "
        r"hold 2 decoder layer",
    ):
        load(plain)
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("load", LOADERS)
@pytest.mark.parametrize(
    "key, value, held",
    [
        ("vocab_size", 10**6, "embed_tokens.weight"),
        ("intermediate_size", 4096, "mlp.gate_proj"),
        ("num_key_value_heads", 4, "self_attn.k_proj"),
        ("hidden_size", "128", "not a positive integer"),
    ],
)
def test_config_bounds_against_headers(art, load, key, value, held):
    cfg = json.loads((art / "config.json").read_text())
    cfg[key] = value
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match=f"config.json {key}( \\* head_dim)? = .*{held}"):
        load(art, verify="none")  # the bounds hold whatever the manifest says
