"""No quantization stage reports success while weights its targets cover stay in full precision.

transformers 5 stores a mixture-of-experts layer's experts as stacked 3-D tensors in one module
(`mlp.experts.gate_up_proj` [E, 2I, H]), not as nn.Linears, so a Linear selection never sees
them. For Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE the pipeline converts them to one Linear per
expert (compress/moe.py; tests/compress/test_moe.py); stacked experts that remain (another
architecture, or a model that skipped the conversion) are refused by compress/targets.py
`check_reach`, naming the expert modules, unless `ignore` lists them on purpose."""

import pytest
import torch
from safetensors import safe_open
from torch import nn

from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.compress.targets import check_reach, stacked_weights
from tests.helpers.tiny_model import save_tiny_moe

RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: stdlib, num_samples: 2, seq_len: 32}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 2, max_ppl_increase: 10.0}}
stages:
  - {stage}
"""


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_checkpoint(request, tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)


def _run(tmp_path, model, stage: str, name: str = "out"):
    text = RECIPE.format(model=model, out=tmp_path / name, stage=stage)
    return run_recipe(parse_recipe(text, tmp_path / "r.yaml"), log=lambda m: None, progress=False)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6))
        self.down_proj = nn.Parameter(torch.zeros(4, 6, 4))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(6, 6)
        self.experts = _Experts()
        self.router = nn.Linear(6, 4)


def test_the_rule_on_a_module_tree():
    model = nn.Sequential(_Layer(), _Layer())
    assert stacked_weights(model) == {
        f"{i}.experts": [("gate_up_proj", (4, 8, 6)), ("down_proj", (4, 6, 4))] for i in (0, 1)
    }
    with pytest.raises(RecipeError, match=r"stages\.rtn: .* 2 module\(s\) .*: 0\.experts "):
        check_reach(model, ["Linear"], [], "rtn")
    # a name or regex target covering them counts as well; one that does not, does not
    with pytest.raises(RecipeError, match=r"1\.experts \(gate_up_proj \[4, 8, 6\]"):
        check_reach(model, ["re:1\\..*"], [], "gptq")
    check_reach(model, ["re:.*q_proj"], [], "rtn")
    check_reach(model, ["Linear"], ["re:.*experts$"], "rtn")  # kept unquantized on purpose


class _Config:
    def __init__(self, model_type):
        self.model_type = model_type


def test_the_message_says_which_architectures_are_converted():
    model = nn.Sequential(_Layer())
    model.config = _Config("gpt_oss")
    with pytest.raises(RecipeError) as e:
        check_reach(model, ["Linear"], [], "rtn")
    msg = str(e.value)
    assert "quantized per expert for mixtral, olmoe, qwen2_moe, qwen3_moe, not for 'gpt_oss'" in msg
    model.config = _Config("mixtral")  # a supported one whose experts were not converted
    with pytest.raises(RecipeError, match="convert the model to per-expert Linears first"):
        check_reach(model, ["Linear"], [], "rtn")


def test_experts_ignored_on_purpose_stay_bf16(tmp_path, moe_checkpoint):
    """Asked for, the experts are left alone: the attention is packed, each expert's Linears
    are the bf16 tensors under their checkpoint names."""
    stage = "rtn: {scheme: W4A16, group_size: 32, ignore: [lm_head, 're:.*\\.experts\\..*']}"
    art = _run(tmp_path, moe_checkpoint, stage).artifact
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys() if ".layers.0." in k}
    assert dtypes["model.layers.0.self_attn.q_proj.weight_packed"] == "I32"
    experts = {k: v for k, v in dtypes.items() if ".experts." in k}
    assert len(experts) == 4 * 3 and set(experts.values()) == {"BF16"}, dtypes
    assert all(k.endswith(".weight") for k in experts)
