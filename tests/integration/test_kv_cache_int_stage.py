"""The `kv_cache` stage with `dtype: int8` / `int4`: no calibration windows asked for, the dtype
recorded in the manifest, served by `--kv-cache-dtype auto`, and the refusals."""

import json

import pytest

from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.llm import LLM

RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10.0}}
stages:
{stages}
"""


def _recipe(tmp_path, model, stages: str, name: str):
    text = RECIPE.format(model=model, out=tmp_path / name, stages=stages)
    return parse_recipe(text, tmp_path / f"{name}.yaml")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_int_kv_stage_needs_no_calibration_and_auto_serves_it(tmp_path, tiny_checkpoint, dtype):
    stages = f"  - rtn: {{scheme: W4A16, group_size: 32}}\n  - kv_cache: {{dtype: {dtype}}}"
    recipe = _recipe(tmp_path, tiny_checkpoint, stages, dtype)
    assert not recipe.needs_calibration
    res = run_recipe(recipe, log=lambda m: None, progress=False)
    rtn_report, kv_report = res.summary["stages"]
    assert kv_report["ppl"] != rtn_report["ppl"]  # the int K/V is really in the measured model
    manifest = json.loads((res.artifact / "slimserve.json").read_text())
    assert manifest["kv_cache_dtype"] == dtype and manifest["kv_cache_skip_layers"] == []
    runner = LLM(str(res.artifact), device="cpu", dtype="float32").engine.runner
    assert runner.kv_cache_name == dtype and runner.kv_bits == int(dtype[3:])


def test_skip_layers_recorded_and_skip_sensitive_refused(tmp_path, tiny_checkpoint):
    recipe = _recipe(
        tmp_path, tiny_checkpoint, "  - kv_cache: {dtype: int8, skip_layers: [1]}", "s"
    )
    res = run_recipe(recipe, log=lambda m: None, progress=False)
    manifest = json.loads((res.artifact / "slimserve.json").read_text())
    assert manifest["kv_cache_skip_layers"] == [1]
    runner = LLM(str(res.artifact), device="cpu", dtype="float32").engine.runner
    assert [k.dtype.itemsize for k, _ in runner.kv_caches] == [1, 4]
    bad = _recipe(tmp_path, tiny_checkpoint, "  - kv_cache: {dtype: int4, skip_sensitive: 1}", "b")
    with pytest.raises(RecipeError, match=r"skip_sensitive .* with dtype int4 list the layers"):
        run_recipe(bad, log=lambda m: None, progress=False)


def test_int4_with_an_odd_head_dim_is_refused_before_anything_runs():
    from types import SimpleNamespace

    from slimserve.compress.quant.kv_cache import KvCacheOptions, KvCacheStage

    config = SimpleNamespace(num_attention_heads=4, head_dim=33, num_hidden_layers=2)
    with pytest.raises(RecipeError, match=r"int4 needs an even head_dim .* is 33; use dtype int8"):
        KvCacheStage(KvCacheOptions(dtype="int4")).preflight(config)
    assert KvCacheStage(KvCacheOptions(dtype="int8")).preflight(config) is None


def test_a_manifest_kv_dtype_that_cannot_be_served_is_one_line(tmp_path, tiny_checkpoint):
    from slimserve.runtime.errors import ArtifactError

    text = RECIPE.format(
        model=tiny_checkpoint, out=tmp_path / "fp8", stages="  - kv_cache: {dtype: fp8_e4m3}"
    )
    text += "calibration: {dataset: stdlib, num_samples: 2, seq_len: 32}\n"
    fp8 = parse_recipe(text, tmp_path / "fp8.yaml")
    art = run_recipe(fp8, log=lambda m: None, progress=False).artifact
    path = art / "slimserve.json"
    manifest = json.loads(path.read_text())
    for value, needle in [
        ("int8", r"kv_cache_dtype int8 with fp8 k/v scales .* not a supported combination"),
        ("int3", r"kv_cache_dtype 'int3' is not one of int8, int4"),
    ]:
        path.write_text(json.dumps({**manifest, "kv_cache_dtype": value}))
        with pytest.raises(ArtifactError, match=needle) as e:
            LLM(str(art), device="cpu", dtype="float32")
        assert "\n" not in str(e.value)
