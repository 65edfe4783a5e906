"""`compress run` with prune + distill (+ quantization) on a tiny Llama: artifacts that load
everywhere with the perplexity the run reported, and the shapes config.json promises."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from slimserve.compress.datasets import load_token_documents
from slimserve.compress.errors import RecipeError
from slimserve.compress.perplexity import evaluate_perplexity
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.prune.sizes import Dims
from slimserve.compress.prune.structured import expected_parameters
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.corpus import read_texts

SEQ, WINDOWS = 64, 6
RECIPE = """# test
model: {model}
output: {out}
calibration: {{dataset: "text:{calib}", num_samples: 8, seq_len: 64}}
eval: {{dataset: "text:{evalf}", seq_len: {seq}, max_windows: {windows}, max_ppl_increase: 10.0}}
stages:
{stages}
"""
PRUNE = "  - prune: {heads: 0.5, mlp: 0.25, hidden: 0.5, layers: 1, multiple_of: 32}"
DISTILL = "  - distill: {steps: 4, batch_size: 2, seq_len: 32, ce_weight: 0.5, hidden_weight: 0.5, warmup_steps: 1}"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "calib.txt").write_text("\n".join(read_texts("train")[:6]))
    (d / "eval.txt").write_text("\n".join(read_texts("validation")[:3]))
    return d


def _run(tmp_path, model, texts, stages: list[str], name: str):
    text = RECIPE.format(
        model=model,
        out=tmp_path / name,
        calib=texts / "calib.txt",
        evalf=texts / "eval.txt",
        seq=SEQ,
        windows=WINDOWS,
        stages="\n".join(stages),
    )
    return run_recipe(
        parse_recipe(text, tmp_path / f"{name}.yaml"), log=lambda m: None, progress=False
    )


def _ppl(model, tok, texts) -> float:
    ids = load_token_documents(f"text:{texts / 'eval.txt'}", tok)
    return evaluate_perplexity(model, ids, SEQ, WINDOWS, progress=False).ppl


def _tensor_params(folder) -> int:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, tiny_checkpoint, texts):
    return _run(tmp_path_factory.mktemp("pruned"), tiny_checkpoint, texts, [PRUNE, DISTILL], "art")


def test_config_carries_the_pruned_shape_and_params_match(pruned):
    art = pruned.artifact
    cfg = json.loads((art / "config.json").read_text())
    assert (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_hidden_layers"],
    ) == (64, 192, 2, 2, 32, 1)
    assert "quantization_config" not in cfg
    from transformers import AutoConfig

    dims = Dims.from_config(AutoConfig.from_pretrained(art))
    expect = expected_parameters(dims, cfg["vocab_size"], tied=False)
    assert _tensor_params(art) == expect == pruned.summary["final"]["params"]
    assert pruned.summary["baseline"]["params"] > 2 * expect


def test_pruned_artifact_loads_in_transformers_and_ours_with_the_reported_ppl(pruned, texts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimserve.runtime.loading.loader import load_model

    art, reported = pruned.artifact, pruned.summary["final"]["ppl"]
    hf = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(art)
    assert _ppl(hf, tok, texts) == pytest.approx(reported, rel=1e-5)
    ours = load_model(art, dtype=torch.float32)
    assert not ours.quantized
    assert _ppl(ours.model, ours.tokenizer, texts) == pytest.approx(reported, rel=1e-5)


def test_pruned_artifact_serves_from_our_engine(pruned):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    art = pruned.artifact
    hf = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(art)("def main(argv):\n").input_ids
    dense, gaps = [], []
    with torch.no_grad():  # plain greedy over the whole sequence: the reference
        for _ in range(6):
            top = hf(torch.tensor([ids + dense])).logits[0, -1].topk(2)
            dense.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
    assert min(gaps) > 1e-4  # no near-tie, so fp32 summation order cannot flip the argmax
    out = LLM(str(art), max_num_seqs=2).generate(
        [ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == dense


def test_report_lists_importance_and_loss_curve(pruned):
    art, summary = pruned.artifact, pruned.summary
    prune, distill = summary["stages"]
    imp = prune["details"]["importance"]
    assert imp["method"] == "activation" and len(imp["layers"]["kept"]) == 1
    assert len(imp["layers"]["removed"]) == 1 and len(imp["layers"]["scores"]) == 2
    assert all(len(h["kept"]) == 2 and len(h["removed"]) == 2 for h in imp["heads"])
    assert len(imp["mlp"]["per_layer"][0]["removed"]) == 64 and len(imp["hidden"]["removed"]) == 64
    d = distill["details"]
    assert d["dataset"].startswith("text:") and d["steps"] == 4 and len(d["loss_curve"]) == 4
    assert {"kl", "ce", "hidden", "loss"} <= set(d["loss_curve"][0])
    for name in ("report-prune.png", "report-distill.png"):
        assert (art / name).read_bytes()[:4] == b"\x89PNG"
    assert "report-distill.png" in (art / "report.md").read_text()


def test_prune_distill_quantize_loads_with_the_reported_ppl(tmp_path, tiny_checkpoint, texts):
    from slimserve.runtime.loading.loader import load_model

    rtn = "  - rtn: {scheme: W4A16, group_size: 32}"
    res = _run(
        tmp_path, tiny_checkpoint, texts, [PRUNE, DISTILL.replace("steps: 4", "steps: 2"), rtn], "q"
    )
    cfg = json.loads((res.artifact / "config.json").read_text())
    assert (
        cfg["intermediate_size"] == 192
        and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    )
    loaded = load_model(res.artifact, dtype=torch.float32)
    assert loaded.quantized
    assert _ppl(loaded.model, loaded.tokenizer, texts) == pytest.approx(
        res.summary["final"]["ppl"], rel=1e-5
    )


@pytest.mark.parametrize(
    "stages,needle",
    [
        (
            "  - prune: {mlp: 0.25}\n  - prune: {intermediate_size: 200}",
            "prune.intermediate_size=200 is not between 1 and the model's 191",
        ),  # checked on the first's shape
        (
            "  - prune: {mlp: 0.25, multiple_of: 32}\n  - rtn: {scheme: W4A16, group_size: 128}",
            "stages[1].rtn.group_size: 128 does not divide the input width of 2 Linears: model.layers.*.mlp.down_proj "
            "(in 192); use group_size 64 (or 32); 64 divides 128 and 192, or set prune.multiple_of: 128",
        ),
    ],
)
def test_impossible_target_is_refused_before_any_work(
    tmp_path, tiny_checkpoint, texts, stages, needle
):
    logged = []
    text = RECIPE.format(
        model=tiny_checkpoint,
        out=tmp_path / "x",
        calib=texts / "calib.txt",
        evalf=texts / "eval.txt",
        seq=SEQ,
        windows=WINDOWS,
        stages=stages,
    )
    with pytest.raises(RecipeError) as e:
        run_recipe(parse_recipe(text, tmp_path / "x.yaml"), log=logged.append, progress=False)
    assert needle in str(e.value)
    assert logged == [] and not (tmp_path / "x").exists()  # no baseline measured, nothing written


def test_distill_from_a_teacher_checkpoint(tiny_checkpoint, texts):
    from slimserve.compress.distill.stages import DistillOptions, DistillStage
    from slimserve.compress.stage import CompressionState
    from slimserve.runtime.loading.loader import load_model

    loaded = load_model(tiny_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    state = CompressionState(loaded.model, loaded.tokenizer, torch.bfloat16, progress=False)
    opts = DistillOptions(
        teacher=str(tiny_checkpoint),
        dataset=f"text:{texts / 'calib.txt'}",
        steps=2,
        batch_size=1,
        seq_len=16,
        hidden_weight=1.0,
    )
    stage = DistillStage(opts)
    stage.prepare(state)
    stage.apply(state)
    d = stage.finalize(state).details
    assert (
        d["teacher"] == str(tiny_checkpoint) and d["steps"] == 2 and "hidden" in d["loss_curve"][0]
    )
    w = state.model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w, w.to(torch.bfloat16).float())  # rounded to what the artifact will store
    assert not state.model.training


def test_distill_refuses_the_evaluation_split(tiny_checkpoint):
    from slimserve.compress.datasets import DatasetError
    from slimserve.compress.distill.stages import DistillOptions, DistillStage
    from slimserve.compress.stage import CompressionState
    from slimserve.runtime.loading.loader import load_model

    loaded = load_model(tiny_checkpoint, dtype=torch.float32)
    state = CompressionState(loaded.model, loaded.tokenizer, torch.bfloat16, teacher=loaded.model)
    with pytest.raises(DatasetError, match="is the evaluation split"):
        DistillStage(DistillOptions(dataset="stdlib:validation")).prepare(state)
