"""`rtn` then `kv_cache` through the pipeline: fp8 K/V scales in the artifact, same ppl on reload.

Both recipes keep the checkpoint's bf16 storage: QuantLinear rounds its dequantized weight to the
storage dtype, so a float32 reload computes with exactly the weights the pipeline measured, and
fp8 rounding of K/V cannot amplify a weight difference.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.artifact.compressed_tensors import kv_cache_scheme
from slimserve.runtime.loading.loader import load_model

RECIPE = """
model: {model}
output: {out}
dtype: {dtype}
calibration: {{dataset: "text:{calib}", num_samples: 8, seq_len: 64}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10.0}}
stages:
{stages}
"""
RTN = "  - rtn: {scheme: W4A16, group_size: 32}"
KV = "  - kv_cache: {dtype: fp8_e4m3}"
KV_PLAIN = "  - kv_cache: {dtype: fp8_e4m3, headroom: 1, scale_search: 1}"  # scale = absmax / 448
KV_SKIP = "  - kv_cache: {dtype: fp8_e4m3, skip_sensitive: 1, sensitivity_samples: 2}"


def _run(tmp_path, model, stages: list[str], name: str, dtype: str = "auto"):
    from slimserve.runtime.corpus import read_texts

    # A few stdlib train documents: tokenizing the whole 10 MB train split would dominate the test.
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(read_texts("train")[:8]))
    text = RECIPE.format(
        model=model, out=tmp_path / name, stages="\n".join(stages), dtype=dtype, calib=calib
    )
    return run_recipe(
        parse_recipe(text, tmp_path / f"{name}.yaml"), log=lambda m: None, progress=False
    )


def _reload_ppl(artifact) -> float:
    from slimserve.compress.datasets import load_token_documents
    from slimserve.compress.perplexity import evaluate_perplexity

    loaded = load_model(artifact, dtype=torch.float32)
    ids = load_token_documents("stdlib", loaded.tokenizer)
    return evaluate_perplexity(loaded.model, ids, 64, 4, progress=False).ppl


def test_rtn_then_kv_cache_artifact_and_reload(tmp_path, tiny_checkpoint):
    from compressed_tensors.quantization import QuantizationConfig

    res = _run(tmp_path, tiny_checkpoint, [RTN, KV], "w4-kv")
    rtn_report, kv_report = res.summary["stages"]
    assert kv_report["name"] == "kv_cache"
    assert kv_report["ppl"] != rtn_report["ppl"]  # fp8 K/V is really in the measured model
    layers = kv_report["details"]["layers"]
    assert sorted(layers) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]

    tensors = load_file(str(res.artifact / "model.safetensors"))
    for name, facts in layers.items():
        for kv in ("k", "v"):
            t = tensors[f"{name}.{kv}_scale"]
            assert t.shape == (1,) and t.dtype == torch.bfloat16  # the artifact's dtype
            assert t.item() == facts[f"{kv}_scale"]
            # the default headroom 2 and scale search: one of the bf16-rounded scales in
            # [2, 4) x absmax/448 (within half a bf16 ulp, 2^-9 relative, of the exact ones)
            ratio = facts[f"{kv}_scale"] / (facts[f"{kv}_absmax"] / 448)
            assert 2 * (1 - 2**-8) <= ratio < 4 * (1 + 2**-8)
    qc = json.loads((res.artifact / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == kv_cache_scheme()
    assert qc["format"] == "pack-quantized" and "group_0" in qc["config_groups"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.strategy == "tensor"

    assert _reload_ppl(res.artifact) == pytest.approx(res.summary["final"]["ppl"], rel=1e-5)


def test_kv_cache_only_artifact(tmp_path, tiny_checkpoint):
    """No weight quantization: config_groups is {}, format dense, and the ppl still reloads."""
    from compressed_tensors.quantization import QuantizationConfig

    res = _run(tmp_path, tiny_checkpoint, [KV_PLAIN], "kv-only")
    qc = json.loads((res.artifact / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == {} and qc["format"] == "dense" and qc["ignore"] == []
    assert qc["kv_cache_scheme"] == kv_cache_scheme()
    QuantizationConfig.model_validate(qc)
    tensors = load_file(str(res.artifact / "model.safetensors"))
    layer1 = res.summary["stages"][0]["details"]["layers"]["model.layers.1.self_attn"]
    k_scale = tensors["model.layers.1.self_attn.k_scale"]
    assert k_scale.dtype == torch.bfloat16 and k_scale.item() == layer1["k_scale"]
    assert layer1["k_scale"] == pytest.approx(layer1["k_absmax"] / 448, rel=2**-8)  # bf16 rounding
    loaded = load_model(res.artifact, dtype=torch.float32)
    assert loaded.model.model.layers[1].self_attn.v_scale.shape == (1,)
    assert _reload_ppl(res.artifact) == pytest.approx(res.summary["final"]["ppl"], rel=1e-5)


def test_skipped_layer_is_recorded_and_every_loader_keeps_it_exact(tmp_path, tiny_checkpoint):
    """skip_sensitive: the chosen layer is in the manifest; the artifact still holds calibrated
    scales for every layer; transformers through our loader reproduces the reported perplexity
    (measured with that layer exact) and the engine caches that layer unquantized."""
    from slimserve.runtime.artifact.manifest import read_manifest
    from slimserve.runtime.llm import LLM

    res = _run(tmp_path, tiny_checkpoint, [RTN, KV_SKIP], "w4-kv-skip")
    details = res.summary["stages"][1]["details"]
    chosen = details["sensitivity"]["chosen"]
    assert len(chosen) == 1 and details["skip_layers"] == chosen
    assert read_manifest(res.artifact).kv_cache_skip_layers == chosen
    assert (res.artifact / "report-kv_cache.png").stat().st_size > 0
    assert (
        f"fp8 K/V in 1 of 2 layers; layers {chosen[0]} keep the model dtype (vLLM: `--kv-cache-dtype fp8 "
        f"--kv-cache-dtype-skip-layers {chosen[0]}`"
    ) in (res.artifact / "report.md").read_text()
    tensors = load_file(str(res.artifact / "model.safetensors"))
    assert all(f"model.layers.{i}.self_attn.{kv}_scale" in tensors for i in range(2) for kv in "kv")

    loaded = load_model(res.artifact, dtype=torch.float32)
    assert [hasattr(layer.self_attn, "k_scale") for layer in loaded.model.model.layers] == [
        i not in chosen for i in range(2)
    ]
    assert _reload_ppl(res.artifact) == pytest.approx(res.summary["final"]["ppl"], rel=1e-5)

    runner = LLM(str(res.artifact), device="cpu", dtype="float32").engine.runner
    assert runner.kv_dtype == torch.float8_e4m3fn  # auto: the artifact has fp8 scales
    assert [k.dtype for k, _ in runner.kv_caches] == [
        torch.float32 if i in chosen else torch.float8_e4m3fn for i in range(2)
    ]
