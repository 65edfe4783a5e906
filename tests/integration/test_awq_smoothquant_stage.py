"""The `awq` and `smoothquant` stages: exact equivalence transforms in the model, composed with
`rtn` through the pipeline into loadable artifacts."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.quant.awq_stage import AwqOptions, AwqStage
from slimserve.compress.quant.smoothquant_stage import SmoothQuantOptions, SmoothQuantStage
from slimserve.compress.recipe import parse_recipe
from slimserve.compress.stage import CompressionState
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.loading.loader import load_model

RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: "text:{cal}", num_samples: 8, seq_len: 64}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10.0}}
stages:
{stages}
"""


def _run(tmp_path, model, stages: str, name: str):
    # A small calibration file: tokenizing the whole stdlib train split would dominate the test.
    cal = tmp_path / "calibration.txt"
    cal.write_text("\n\n".join(read_texts("validation")[:4])[:20000], encoding="utf-8")
    text = RECIPE.format(model=model, out=tmp_path / name, stages=stages, cal=cal)
    return run_recipe(
        parse_recipe(text, tmp_path / f"{name}.yaml"), log=lambda m: None, progress=False
    )


def _check_loads(artifact):
    loaded = load_model(artifact, dtype=torch.float32)
    assert loaded.quantized
    with torch.no_grad():
        logits = loaded.model(torch.arange(1, 17).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()


def test_awq_then_rtn_w4a16(tmp_path, tiny_checkpoint):
    stages = "  - awq: {group_size: 32, n_grid: 5}\n  - rtn: {scheme: W4A16, group_size: 32}"
    res = _run(tmp_path, tiny_checkpoint, stages, "awq")
    awq, rtn = res.summary["stages"]
    assert (awq["name"], rtn["name"]) == ("awq", "rtn")
    assert awq["modules"] == [] and len(rtn["modules"]) == 2 * 7  # awq quantizes nothing itself
    d = awq["details"]
    assert d["scheme"] == {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}
    # GQA (4 heads, 2 KV heads): v_proj -> o_proj cannot absorb a scale; the other three can.
    assert "grouped-query attention" in d["skipped"]["self_attn.v_proj"]
    assert [(m["layer"], m["prev"]) for m in d["mappings"]] == [
        (i, p)
        for i in range(2)
        for p in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj")
    ]
    assert all(0.0 <= m["ratio"] <= 1.0 and m["scale_min"] > 0 for m in d["mappings"])
    assert all(
        m["loss_after"] <= m["loss_before"] for m in d["mappings"]
    )  # never worse than plain RTN
    # Clipping covers v, o, gate, up, down (never q/k).
    clipped = [c["module"].rsplit(".", 1)[-1] for c in d["clipped"]]
    assert clipped == ["v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2
    _check_loads(res.artifact)


def test_smoothquant_then_rtn_w8a8(tmp_path, tiny_checkpoint):
    stages = "  - smoothquant: {alpha: 0.8}\n  - rtn: {scheme: W8A8}"
    res = _run(tmp_path, tiny_checkpoint, stages, "sq")
    sq = res.summary["stages"][0]
    assert sq["name"] == "smoothquant" and sq["modules"] == []
    assert (
        len(sq["details"]["mappings"]) == 2 * 2
    )  # input_layernorm and post_attention_layernorm per layer
    # An equivalence transform: perplexity is unchanged (fp32 rounding only).
    assert sq["ppl"] == pytest.approx(res.summary["baseline"]["ppl"], rel=1e-4)
    qc = json.loads((res.artifact / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    for group in qc["config_groups"].values():
        assert group["input_activations"]["dynamic"] is True
        assert group["input_activations"]["strategy"] == "token"
    _check_loads(res.artifact)


def _mha_state(seed: int = 0) -> CompressionState:
    """A 2-layer multi-head (no GQA) fp32 Llama, so every mapping including v_proj -> o_proj applies."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (4, 16))
    return CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids
    )


# Two layers + lm_head in fp32: each rescaled product carries a few extra roundings (~1e-7
# relative), compounded through attention and the norms; 1e-4 leaves ample room.
@pytest.mark.parametrize(
    "stage",
    [
        AwqStage(AwqOptions(group_size=32, clip=False, n_grid=5)),
        SmoothQuantStage(SmoothQuantOptions(alpha=0.5)),
    ],
    ids=["awq", "smoothquant"],
)
def test_stage_preserves_model_function(stage):
    state = _mha_state()
    with torch.no_grad():
        ref = state.model(state.calibration).logits
    stage.prepare(state)
    run_layerwise(state, stage)
    report = stage.finalize(state)
    with torch.no_grad():
        torch.testing.assert_close(state.model(state.calibration).logits, ref, rtol=1e-4, atol=1e-4)
    assert state.quantized == {}
    prevs = {m["prev"] for m in report.details["mappings"]}
    if isinstance(stage, AwqStage):
        assert prevs == {
            "input_layernorm",
            "self_attn.v_proj",
            "post_attention_layernorm",
            "mlp.up_proj",
        }
        assert sum(m["applied"] for m in report.details["mappings"]) >= 4  # scales really moved
    else:
        assert prevs == {"input_layernorm", "post_attention_layernorm"}
        assert set(report.details["skipped"]) == {"self_attn.v_proj", "mlp.up_proj"}


def test_stages_refuse_to_run_after_the_quantizer():
    state = _mha_state()
    state.quantized["model.layers.1.mlp.down_proj"] = object()
    for stage in (AwqStage(AwqOptions()), SmoothQuantStage(SmoothQuantOptions())):
        with pytest.raises(RecipeError, match=f"move '- {stage.name}' above rtn/gptq"):
            stage.prepare(state)


def test_awq_group_size_must_divide_inputs():
    with pytest.raises(RecipeError, match="group_size: 48 does not divide the 64 inputs"):
        AwqStage(AwqOptions(group_size=48)).prepare(_mha_state())
