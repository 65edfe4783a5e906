"""Checkpoints written by the real peer tools load through our importers, loader and engine.

tests/fixtures/peers/<name>/ hold checkpoints that AutoAWQ 0.2.9 and GPTQModel 7.6.0 wrote for a
random-init 2-layer Llama (hidden 128, GQA, MLP 256, vocab 512, tied embeddings; made and packed
by eval/peers/tiny_llama.py, quantized by eval/peers/autoawq_quant.py / gptqmodel_quant.py in
their own venvs). Beside each folder, `<name>.reference.safetensors` holds the peer's OWN dequantization of
the last layer's Linears (AutoAWQ's `dequantize_gemm`, GPTQModel's `TorchQuantLinear
.dequantize_weight` at fp16) and the peer's logits on `probe_ids`.

Tolerances: the dequantized weights are (q - z) * scale with fp16 scales, rounded to fp16 by
both sides, so they must match bit for bit. Logits: AutoAWQ's reference ran in fp32 on those
weights (only summation order can differ: measured exactly equal; 1e-5 allows reordering on
|logits| < 1.5); GPTQModel's ran its fp16 torch kernel, whose activations carry fp16 rounding
(2^-11 = 5e-4 relative) through 2 layers of K <= 256 sums: measured up to 6.4e-4 on |logits| < 1.5,
so 5e-3 absolute leaves an 8x margin.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slimserve.eval.peers.tiny_llama import TOKENIZER_FILES
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.loading.loader import load_model
from tests.helpers import DEMO_MODEL

FIXTURES = DEMO_MODEL.parents[1] / "tests" / "fixtures" / "peers"
# name -> (logits atol, modules the peer left unquantized: AWQ modules_to_not_convert ["o_proj"],
# GPTQModel dynamic "-:" rule; the asym-dynamic case also stores every down_proj as 8-bit sym)
CASES = {
    "autoawq-gemm-asym": (
        1e-5,
        ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"),
    ),
    "gptqmodel-sym": (5e-3, ()),
    "gptqmodel-sym-descact": (5e-3, ()),
    "gptqmodel-asym-dynamic": (5e-3, ("model.layers.0.self_attn.o_proj",)),
}


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.reference.safetensors"))


def _check_weights(model: nn.Module, ref: dict[str, torch.Tensor]) -> int:
    checked = 0
    for key, w in ref.items():
        if not key.endswith(".weight"):
            continue
        mod = model.get_submodule(key.removesuffix(".weight"))
        assert isinstance(mod, QuantLinear), key
        torch.testing.assert_close(mod.dequantized_weight(torch.float32), w.float(), rtol=0, atol=0)
        checked += 1
    return checked


@pytest.mark.parametrize("name", sorted(CASES))
def test_peer_checkpoint_matches_the_peers_own_dequantization(name):
    atol, dense = CASES[name]
    loaded = load_model(FIXTURES / name, dtype=torch.float32)
    assert loaded.quantized
    model, ref = loaded.model, _reference(name)
    last_dense = [d for d in dense if d.startswith("model.layers.1.")]
    assert _check_weights(model, ref) == 7 - len(
        last_dense
    )  # every quantized Linear of the last layer
    for d in dense:  # left unquantized by the peer: plain Linears holding the stored weight
        assert type(model.get_submodule(d)) is nn.Linear
    # tied embeddings: lm_head is not stored and shares the embedding matrix
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(ref["probe_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"].float(), rtol=0, atol=atol)


def test_gptqmodel_metadata_and_act_order():
    qc = json.loads((FIXTURES / "gptqmodel-sym-descact" / "config.json").read_text())[
        "quantization_config"
    ]
    assert (
        qc["desc_act"] is True and qc["format"] == "gptq" and "meta" in qc
    )  # GPTQModel's own fields
    model = load_model(FIXTURES / "gptqmodel-sym-descact", dtype=torch.float32).model
    g_idx = model.model.layers[1].mlp.down_proj.weight_g_idx
    assert g_idx is not None and not torch.equal(
        g_idx.long(), torch.arange(256) // 128
    )  # a permuting g_idx
    # GPTQModel's default act_group_aware writes the trivial g_idx k // g, which the importer drops
    assert (
        load_model(FIXTURES / "gptqmodel-sym", dtype=torch.float32)
        .model.model.layers[1]
        .mlp.down_proj.weight_g_idx
        is None
    )


def test_gptqmodel_dynamic_overrides():
    """GPTQModel's `dynamic`: a '+:' rule changes bits/sym per module, a '-:' rule leaves one dense."""
    qc = json.loads((FIXTURES / "gptqmodel-asym-dynamic" / "config.json").read_text())[
        "quantization_config"
    ]
    assert qc["sym"] is False and qc["bits"] == 4 and len(qc["dynamic"]) == 2
    model = load_model(FIXTURES / "gptqmodel-asym-dynamic", dtype=torch.float32).model
    for layer in model.model.layers:
        down, up = layer.mlp.down_proj.scheme.weights, layer.mlp.up_proj.scheme.weights
        assert (down.num_bits, down.symmetric) == (8, True) and (up.num_bits, up.symmetric) == (
            4,
            False,
        )
    assert type(model.model.layers[0].self_attn.o_proj) is nn.Linear
    assert isinstance(model.model.layers[1].self_attn.o_proj, QuantLinear)


def test_sharded_peer_checkpoint_loads_the_same(tmp_path):
    """A safetensors index splitting the tensors over two files (as hub checkpoints are) loads alike."""
    src, dst = FIXTURES / "gptqmodel-sym-descact", tmp_path / "sharded"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in src.glob("model*.safetensors"):
        tensors.update(load_file(str(f)))
    keys = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for fname, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(dst / fname))
    weight_map = {k: fname for fname, part in shards.items() for k in part}
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    ref = _reference("gptqmodel-sym-descact")
    model = load_model(dst, dtype=torch.float32).model
    assert _check_weights(model, ref) == 7
    with torch.no_grad():
        torch.testing.assert_close(
            model(ref["probe_ids"]).logits, ref["logits"].float(), rtol=0, atol=5e-3
        )


@pytest.mark.parametrize("name", ["autoawq-gemm-asym", "gptqmodel-sym-descact"])
def test_engine_serves_peer_checkpoint_like_the_dense_loop(tmp_path, name):
    """LLM(path) greedy == argmax of the loaded model recomputed every step (fp32 both)."""
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    for f in TOKENIZER_FILES:  # fixtures ship no tokenizer: the demo model's (ids < 512 decode)
        shutil.copy(DEMO_MODEL / f, path / f)
    prompt = _reference(name)["probe_ids"][0, :8].tolist()
    model = load_model(path, dtype=torch.float32).model
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    out = LLM(str(path), dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == ids[len(prompt) :]
