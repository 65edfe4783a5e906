"""GPTQ and AWQ artifacts end to end on the tiny Llama: export -> our loader -> same weights and logits.

Every decoder Linear is fake-quantized with `quantize_weight` (or with a shuffled act-order
g_idx), exported with `export_artifact`, and read back by `load_model`, which converts the
GPTQ/AWQ tensors to compressed-tensors buffers: each dequantized weight must equal our
fake-quantized weight bit for bit, and the logits must be identical (same weights, same ops,
same dtype). transformers reads GPTQ/AWQ only through gptqmodel (+ optimum for GPTQ), which
the project does not install, so that check skips unless they are present.
"""

import copy
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from slimserve.compress.export.formats import export_artifact
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.quant.primitives import compute_qparams, quantize, quantize_weight
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.artifact.manifest import ArtifactManifest
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantArgs, SchemeError
from slimserve.runtime.layers import QuantLinear
from slimserve.runtime.loading.loader import load_model

W4 = QuantArgs(4, group_size=32)
W4_ASYM = W4.with_(symmetric=False)
CASES = {  # name -> (format, args, mode: None | "act_order" (shuffled g_idx) | "zero0")
    "gptq_sym": ("gptq", W4, None),
    "gptq_asym": ("gptq", W4_ASYM, None),
    "gptq_desc_act": ("gptq", W4.with_(actorder="group"), "act_order"),
    # one Linear with non-negative weights gets zero points of 0, which only gptq_v2 can store
    "gptq_v2": ("gptq", W4_ASYM, "zero0"),
    "awq_asym": ("awq", W4_ASYM, None),
    "awq_sym": ("awq", W4, None),  # written as asymmetric with zero point 8
}


def act_order(w: torch.Tensor, args: QuantArgs, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    k = w.shape[1]
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // args.group_size).to(torch.int32)
    scale, zp = compute_qparams(w, args, w.dtype, g_idx)
    return QuantizedWeight(quantize(w, scale, zp, args, g_idx.long()), scale, zp, g_idx, args)


def build(base, tok, out, fmt: str, args: QuantArgs, mode: str | None):
    """(artifact path, fake-quantized copy of `base`, {module name: fake-quantized weight})."""
    model = copy.deepcopy(base)
    quantized, fake = {}, {}
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                if mode == "zero0" and name.endswith("0.self_attn.q_proj"):
                    mod.weight.abs_()
                qw = (
                    act_order(mod.weight, args, i)
                    if mode == "act_order"
                    else quantize_weight(mod.weight, args)
                )
                quantized[name], fake[name] = qw, qw.dequantize(torch.bfloat16)
                mod.weight.copy_(fake[name])
    path = export_artifact(fmt, model, tok, quantized, out, ArtifactManifest(base_model="tiny"))
    return path, model, fake


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    root = tmp_path_factory.mktemp("formats")
    return {name: build(base, tok, root / name, *case) for name, case in CASES.items()}


@pytest.mark.parametrize("name", CASES)
def test_artifact_layout(artifacts, name):
    fmt, args, mode = CASES[name]
    path, _, fake = artifacts[name]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(path / "model.safetensors")
    suffixes = {
        "gptq": {"qweight", "qzeros", "scales", "g_idx"},
        "awq": {"qweight", "qzeros", "scales"},
    }[fmt]
    for n in fake:
        assert {k.removeprefix(n + ".") for k in tensors if k.startswith(n + ".")} == suffixes, n
    assert "lm_head.weight" in tensors
    if fmt == "gptq":
        assert qc["quant_method"] == "gptq"
        assert qc["checkpoint_format"] == ("gptq_v2" if mode == "zero0" else "gptq")
        assert (
            qc["desc_act"] is (mode == "act_order")
            and qc["sym"] is args.symmetric
            and qc["group_size"] == 32
        )
        assert json.loads((path / "quantize_config.json").read_text()) == qc
    else:
        assert qc == {
            "quant_method": "awq",
            "zero_point": True,
            "group_size": 32,
            "bits": 4,
            "version": "gemm",
            "modules_to_not_convert": ["lm_head"],
        }


@pytest.mark.parametrize("name", CASES)
def test_loader_reads_back_bit_for_bit(artifacts, name):
    path, model, fake = artifacts[name]
    loaded = load_model(path)
    assert loaded.quantized and loaded.tokenizer is not None
    for n, w in fake.items():
        layer = loaded.model.get_submodule(n)
        assert isinstance(layer, QuantLinear), n
        assert torch.equal(layer.dequantized_weight(torch.bfloat16), w), n
    if CASES[name][2] == "act_order":
        assert all(loaded.model.get_submodule(n).weight_g_idx is not None for n in fake)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", ["gptq_asym", "awq_asym"])
def test_transformers_reads_our_artifacts(artifacts, name):
    missing = [m for m in ("gptqmodel", "optimum") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"transformers loads gptq/awq checkpoints only through {', '.join(missing)} "
            "(not installed in the project venv, on purpose)"
        )
    from transformers import AutoModelForCausalLM

    path, model, _ = artifacts[name]
    hf = AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = model(ids).logits.float(), hf(ids).logits.float()
    # their kernels compute in fp16 with fp16 accumulation paths: bf16/fp16-level agreement
    torch.testing.assert_close(theirs, ours, rtol=2e-2, atol=2e-2 * ours.abs().max().item())


def test_export_refuses_partial_gptq_and_mixed_schemes(tiny_checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    q = {
        "model.layers.0.self_attn.q_proj": quantize_weight(
            model.model.layers[0].self_attn.q_proj.weight, W4
        )
    }
    with pytest.raises(SchemeError, match="is not quantized.*gptq loaders"):
        export_artifact("gptq", model, None, q, tmp_path / "a", ArtifactManifest(base_model="t"))
    q["model.layers.0.self_attn.k_proj"] = quantize_weight(
        model.model.layers[0].self_attn.k_proj.weight, W4.with_(group_size=64)
    )
    with pytest.raises(SchemeError, match="one scheme for all Linears"):
        export_artifact("awq", model, None, q, tmp_path / "b", ArtifactManifest(base_model="t"))
    with pytest.raises(SchemeError, match="KV-cache"):
        export_artifact(
            "awq",
            model,
            None,
            q,
            tmp_path / "c",
            ArtifactManifest(base_model="t"),
            kv_scales={"model.layers.0.self_attn": (1.0, 1.0)},
        )
    assert list(tmp_path.iterdir()) == []


RECIPE = """
model: {model}
output: {out}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10}}
stages:
  - rtn: {{scheme: {scheme}, group_size: 32}}
export: {{format: {fmt}}}
"""


def test_pipeline_exports_gptq_and_refuses_early(tiny_checkpoint, tmp_path):
    def recipe(scheme, fmt):
        text = RECIPE.format(
            model=tiny_checkpoint, out=tmp_path / f"{fmt}-{scheme}", scheme=scheme, fmt=fmt
        )
        return parse_recipe(text, tmp_path / "r.yaml")

    logs = []
    with pytest.raises(SchemeError, match="input activations.*awq"):
        run_recipe(recipe("W8A8", "awq"), log=logs.append, progress=False)
    assert logs == []  # refused before the baseline perplexity, the first expensive step
    res = run_recipe(recipe("W4A16", "gptq"), log=lambda m: None, progress=False)
    assert (
        json.loads((res.artifact / "config.json").read_text())["quantization_config"][
            "quant_method"
        ]
        == "gptq"
    )
    assert load_model(res.artifact).quantized
