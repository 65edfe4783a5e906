"""The kv_cache stage's unquantized layers: explicit `skip_layers`, and `skip_sensitive` scored by
each layer's end-to-end KL divergence with fp8 K/V in that layer alone."""

import pytest
import torch

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import memory_plan
from slimserve.compress.quant.kv_cache import KvCacheOptions, KvCacheStage
from slimserve.compress.recipe import parse_recipe
from slimserve.compress.stage import CompressionState
from slimserve.runtime.artifact.kv_scales import fp8_e4m3_roundtrip
from slimserve.runtime.loading.hf_fp8kv import decoder_layer_index


def _model(layers: int = 4):
    """A random GQA Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _calibrate(model, options: KvCacheOptions, ids):
    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.float32, calibration=ids, progress=False
    )
    stage = KvCacheStage(options)
    stage.prepare(state)
    run_layerwise(state, stage, batch_size=2)
    return state, stage.finalize(state)


def _kl_alone(model, scales: dict[str, tuple[float, float]], layer: int, windows) -> float:
    """Mean KL(exact || fp8 K/V in `layer` only), through an attention function of the test's
    own that rounds that layer's (rotated) K and V before transformers' sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = f"model.layers.{layer}.self_attn"
    k_scale, v_scale = scales[name]

    def attend(module, q, k, v, mask, **kw):
        if module.layer_idx == layer:
            k, v = fp8_e4m3_roundtrip(k, k_scale), fp8_e4m3_roundtrip(v, v_scale)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("test_one_layer_fp8", attend)
    before = model.config._attn_implementation
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for w in windows.split(1):
                model.set_attn_implementation("sdpa")
                exact = model(input_ids=w, use_cache=False).logits.float().log_softmax(-1)
                model.set_attn_implementation("test_one_layer_fp8")
                logp = model(input_ids=w, use_cache=False).logits.float().log_softmax(-1)
                total += (exact.exp() * (exact - logp)).sum().item()
                tokens += w.numel()
    finally:
        model.set_attn_implementation(before)
    return total / tokens


def test_skip_sensitive_keeps_the_layer_with_the_largest_end_to_end_kl():
    model = _model()
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))
    state, report = _calibrate(model, KvCacheOptions(skip_sensitive=1, sensitivity_samples=2), ids)
    sens = report.details["sensitivity"]
    kl = {int(i): v for i, v in sens["kl_per_layer"].items()}
    assert sorted(kl) == [0, 1, 2, 3] and sens["windows"] == 2
    # the stage's KL, computed again independently of its code path, with the stage's scales
    ref = {layer: _kl_alone(model, state.kv_scales, layer, ids[:2]) for layer in range(4)}
    for layer in range(4):
        assert kl[layer] == pytest.approx(ref[layer], rel=1e-4)
    first, second = sorted(ref.values())[-1:-3:-1]
    assert first > 1.01 * second and first > 3 * min(ref.values())  # a clear choice, not a tie
    top = max(ref, key=ref.get)
    assert (
        sens["chosen"] == [top]
        and state.kv_skip_layers == [top]
        and report.details["skip_layers"] == [top]
    )
    assert report.details["vllm"] == f"--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers {top}"
    # every layer keeps calibrated scales for the artifact; only the skipped one attends exactly
    assert len(state.kv_scales) == 4
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.self_attn, "k_scale") == (i != top)
    assert (
        model.model.layers[0].self_attn.k_scale.item()
        == state.kv_scales["model.layers.0.self_attn"][0]
    )


def test_explicit_skip_layers_attend_exactly_while_calibrating():
    model = _model()
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    state, report = _calibrate(model, KvCacheOptions(skip_layers=[1, 1, 3], scale_search=1), ids)
    assert state.kv_skip_layers == [1, 3] and "sensitivity" not in report.details
    assert sorted(decoder_layer_index(n) for n in state.kv_scales) == [0, 1, 2, 3]
    assert [hasattr(layer.self_attn, "k_scale") for layer in model.model.layers] == [
        True,
        False,
        True,
        False,
    ]


def test_no_skip_means_no_skip_details():
    model = _model(layers=2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    state, report = _calibrate(model, KvCacheOptions(scale_search=1), ids)
    assert (
        state.kv_skip_layers == []
        and report.details["skip_layers"] == []
        and "vllm" not in report.details
    )


def test_skip_options_are_checked_before_any_work():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=4)
    with pytest.raises(
        RecipeError, match=r"skip_layers: \[4, 9\] are not layers of this 4-layer model; use 0 to 3"
    ):
        KvCacheStage(KvCacheOptions(skip_layers=[0, 4, 9])).preflight(cfg)
    with pytest.raises(RecipeError, match="leave none of the 4 layers in fp8_e4m3; skip fewer"):
        KvCacheStage(KvCacheOptions(skip_layers=[0, 1], skip_sensitive=2)).preflight(cfg)
    assert KvCacheStage(KvCacheOptions(skip_layers=[3], skip_sensitive=2)).preflight(cfg) is None
    for bad, match in (
        ("skip_layers: [-1]", "layer indices start at 0"),
        ("skip_sensitive: -2", "give a number of layers >= 0"),
        ("sensitivity_samples: 0", "at least 1 calibration window"),
    ):
        with pytest.raises(RecipeError, match=match):
            parse_recipe(f"model: x\noutput: y\nstages:\n  - kv_cache: {{{bad}}}\n")


def test_skip_options_keep_the_pipeline_layer_by_layer(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=4)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for stages in (
        "[{gptq: {scheme: W4A16}}, {kv_cache: {skip_layers: [1]}}]",
        "[{gptq: {scheme: W4A16}}, {kv_cache: {skip_sensitive: 1}}]",
    ):
        recipe = parse_recipe(
            f"model: {folder}\noutput: y\nstages: {stages}\n", tmp_path / "r.yaml"
        )
        assert memory_plan(recipe, [spec.build() for spec in recipe.stages], str(folder), cfg) == ""
