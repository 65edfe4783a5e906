"""Mixture-of-experts compression (issue 34): experts as per-expert Linears under the checkpoints'
names (runtime/loading/moe_experts.py, compress/moe.py), quantized by rtn and gptq, routers kept
dense and listed in `ignore`, calibration that reaches every expert, and artifacts transformers
reads back with the perplexity the pipeline reported."""

import json
import warnings

import pytest
import torch
from safetensors import safe_open

from slimserve.compress.datasets import load_token_documents
from slimserve.compress.mappings import mapping_for
from slimserve.compress.moe import MIN_EXPERT_TOKENS
from slimserve.compress.perplexity import evaluate_perplexity
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.loading.moe_experts import ExpertList, dense_moe_modules, unfuse_experts
from tests.helpers.tiny_model import save_tiny_moe

TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
BLOCK = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "mixtral": "block_sparse_moe", "olmoe": "mlp"}
PROJ = {"mixtral": ("w1", "w3", "w2")}
EXPERTS, LAYERS = 4, 2
SEQ, WINDOWS = 64, 2
RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: stdlib, num_samples: {samples}, seq_len: {cal_len}}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 2, max_ppl_increase: 10.0}}
stages:
  - {stage}
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(model_type: str, experts: int = EXPERTS, top_k: int = 2):
        key = (model_type, experts, top_k)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{model_type}-{experts}-{top_k}")
            made[key] = save_tiny_moe(folder, model_type, experts=experts, top_k=top_k)
        return made[key]

    return get


def _run(tmp_path, model, stage, name="out", samples=4, cal_len=32):
    text = RECIPE.format(
        model=model, out=tmp_path / name, stage=stage, samples=samples, cal_len=cal_len
    )
    return run_recipe(parse_recipe(text, tmp_path / "r.yaml"), log=lambda m: None, progress=False)


def _keys(folder) -> dict[str, str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def _expert_linears(model_type: str, experts: int = EXPERTS) -> list[str]:
    proj = PROJ.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    return [
        f"model.layers.{i}.{BLOCK[model_type]}.experts.{e}.{p}"
        for i in range(LAYERS)
        for e in range(experts)
        for p in proj
    ]


@pytest.mark.parametrize("model_type", TYPES)
def test_per_expert_model_computes_what_transformers_computes(checkpoints, model_type):
    """Same logits as transformers' own experts: bit for bit against its eager loop (fp32, bf16)
    and its default (fp32), within bf16 rounding otherwise, with and without every expert running on every token; the state-dict names are the
    checkpoint's."""
    from transformers import AutoModelForCausalLM

    path = checkpoints(model_type)
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        for impl in ("eager", None):
            kw = {"experts_implementation": impl} if impl else {}
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
            with torch.no_grad():
                ref = model(ids).logits
                assert unfuse_experts(model) == LAYERS
                assert unfuse_experts(model) == 0  # already per expert
                out = model(ids).logits
                lists = [m for m in model.modules() if isinstance(m, ExpertList)]
                for m in lists:
                    m.calibrate_all = True
                every = model(ids).logits
            assert len(lists) == LAYERS and all(len(m) == EXPERTS for m in lists)
            if impl == "eager" or dtype == torch.float32:  # the same loop: the same bits
                assert torch.equal(ref, out), (dtype, impl, (ref - out).abs().max())
            else:  # transformers' default grouped_mm rounds bf16 products its own way
                assert torch.allclose(ref, out, atol=0.02), (impl, (ref - out).abs().max())
            assert torch.allclose(ref, every, atol=1e-5 if dtype == torch.float32 else 0.05)
    assert set(model.state_dict()) == set(_keys(path))
    dense = list(dense_moe_modules(model))
    assert dense[0] == f"model.layers.0.{BLOCK[model_type]}.gate"
    if model_type == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate" in dense


@pytest.mark.parametrize("model_type", TYPES)
def test_mapping_lists_every_expert_linear(checkpoints, model_type):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints(model_type))
    unfuse_experts(model)
    m = mapping_for(model)
    layer = model.get_submodule("model.layers.0")
    listed = [rel for group in m.sequential for rel in group]
    linears = {
        n for n, x in layer.named_modules() if isinstance(x, torch.nn.Linear) and ".experts." in n
    }
    assert linears == {r for r in listed if ".experts." in r}
    assert len(linears) == EXPERTS * 3
    for sm in m.smooth:  # every mapping names modules of the layer; no norm -> experts mapping
        layer.get_submodule(sm.prev)
        assert not (sm.prev == "post_attention_layernorm" and ".experts." in sm.linears[0])
    assert m.mlp_residual is None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    "stage", ["rtn: {scheme: W4A16, group_size: 32}", "gptq: {scheme: W4A16, group_size: 32}"]
)
def test_every_expert_is_quantized_and_transformers_reads_the_artifact(
    tmp_path, checkpoints, model_type, stage
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoints(model_type)
    res = _run(tmp_path, path, stage)
    art, summary = res.artifact, res.summary
    st = summary["stages"][0]
    quantized = {m["name"] for m in st["modules"]}
    experts = _expert_linears(model_type)
    assert len(experts) == EXPERTS * 3 * LAYERS and set(experts) <= quantized
    assert st["details"]["modules_quantized"] == len(experts) + 4 * LAYERS  # + q/k/v/o

    keys = _keys(art)
    for name in experts:
        assert keys[f"{name}.weight_packed"] == "I32" and f"{name}.weight" not in keys
    routers = [f"model.layers.{i}.{BLOCK[model_type]}.gate" for i in range(LAYERS)]
    for r in routers:
        assert keys[f"{r}.weight"] == "BF16"
    qc = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert set(routers) <= set(qc["ignore"])
    # the tensor names are the checkpoint's, each quantized `.weight` replaced by the CT tensors
    source = set(_keys(path))
    modules = {k.rsplit(".", 1)[0] for k in keys}
    assert {k.rsplit(".", 1)[0] for k in source} == modules
    assert {k for k in keys if k.endswith(".weight")} == {
        k for k in source if k.rsplit(".", 1)[0] not in quantized
    }

    if model_type == "qwen3_moe" and stage.startswith("gptq"):
        assert set(st["details"]["expert_tokens"].values()) == {4 * 32}  # every calibration token

    model = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    ids = load_token_documents("stdlib", AutoTokenizer.from_pretrained(art))
    ppl = evaluate_perplexity(model, ids, SEQ, WINDOWS, 8, progress=False).ppl
    assert ppl == pytest.approx(summary["final"]["ppl"], rel=1e-4)
    assert summary["final"]["ppl"] != pytest.approx(summary["baseline"]["ppl"], rel=1e-6)


def test_qwen2_moe_shared_expert_quantized_and_its_gate_dense(tmp_path, checkpoints):
    art = _run(tmp_path, checkpoints("qwen2_moe"), "rtn: {scheme: W4A16, group_size: 32}").artifact
    keys = _keys(art)
    for i in range(LAYERS):
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert keys[f"model.layers.{i}.mlp.shared_expert.{p}.weight_packed"] == "I32"
        assert keys[f"model.layers.{i}.mlp.shared_expert_gate.weight"] == "BF16"
    ignore = json.loads((art / "config.json").read_text())["quantization_config"]["ignore"]
    assert {
        f"model.layers.{i}.mlp.{g}" for i in range(LAYERS) for g in ("gate", "shared_expert_gate")
    } <= set(ignore)


@pytest.mark.parametrize("stage", ["gptq", "awq"])
def test_calibration_reaches_every_expert(tmp_path, checkpoints, stage):
    """16 calibration tokens, 32 experts, top-1: routed, at most 16 experts per layer see any
    token; with `calibrate_all_experts` (the default) every expert sees all 16."""
    path = checkpoints("qwen3_moe", experts=32, top_k=1)
    seen = {}
    for on in (False, True):
        opt = "" if on else ", calibrate_all_experts: false"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = f"{stage}: {{scheme: W4A16, group_size: 32{opt}}}"
            res = _run(tmp_path, path, spec, f"out-{on}", samples=1, cal_len=16)
        details = res.summary["stages"][0]["details"]
        seen[on] = details["expert_tokens"]
        assert details["calibrate_all_experts"] is on
        starved = [str(w.message) for w in caught if "calibration tokens" in str(w.message)]
        assert len(seen[on]) == 32 * LAYERS
        if not on:
            assert min(seen[on].values()) == 0 and sum(v == 0 for v in seen[on].values()) >= 32
            assert any(
                "model.layers.0.mlp.experts." in m and "saw 0 calibration tokens" in m
                for m in starved
            )
            assert f"stages.{stage}.calibrate_all_experts: true" in starved[0]
    assert set(seen[True].values()) == {16} and MIN_EXPERT_TOKENS <= 16


def test_smoothquant_keeps_the_function(tmp_path, checkpoints):
    """Its exact mappings only (no norm -> experts): the model computes what it did."""
    res = _run(tmp_path, checkpoints("olmoe"), "smoothquant: {alpha: 0.5}")
    s = res.summary
    assert s["final"]["ppl"] == pytest.approx(s["baseline"]["ppl"], rel=1e-4)
    prevs = {m["prev"] for m in s["stages"][0]["details"]["mappings"]}
    assert prevs == {"input_layernorm"}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_our_loader_reads_the_artifact_in_every_format(tmp_path, checkpoints, fmt):
    """runtime/loading/loader.py builds the per-expert model too: the reported perplexity, exactly."""
    from slimserve.runtime.loading.loader import load_model

    text = (
        RECIPE.format(
            model=checkpoints("mixtral"),
            out=tmp_path / "out",
            stage="rtn: {scheme: W4A16_ASYM, group_size: 32}",
            samples=2,
            cal_len=32,
        )
        + f"export: {{format: {fmt}}}\n"
    )
    res = run_recipe(parse_recipe(text, tmp_path / "r.yaml"), log=lambda m: None, progress=False)
    loaded = load_model(res.artifact, dtype=torch.float32)
    assert loaded.quantized
    ids = load_token_documents("stdlib", loaded.tokenizer)
    ppl = evaluate_perplexity(loaded.model, ids, SEQ, WINDOWS, 8, progress=False).ppl
    assert ppl == pytest.approx(res.summary["final"]["ppl"], rel=1e-6)
