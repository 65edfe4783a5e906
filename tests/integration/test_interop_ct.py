"""Our compressed-tensors artifacts read back by the compressed-tensors library and by transformers.

A tiny random bf16 Llama has its decoder Linears fake-quantized, is exported, then:
(a) compressed-tensors' own compressors decompress every tensor to exactly our fake-quantized
weight, and compress that weight to exactly our tensors; (b) transformers' loader (which
decompresses through compressed-tensors) and our `load_model` give the same logits; (c) a
tampered weight file is refused; (d) config.json carries only CT-0.12 keys and no zero point
for symmetric schemes.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from slimserve.compress.export.io import export_compressed_tensors
from slimserve.compress.quant.primitives import quantize_weight
from slimserve.runtime.artifact.manifest import ArtifactManifest
from slimserve.runtime.artifact.scheme import QuantArgs
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers import QuantLinear
from slimserve.runtime.loading.loader import load_model

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

CT_012_ARG_KEYS = {
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
    "observer",
    "observer_kwargs",
}
W4 = QuantArgs(4, group_size=32)
W4_ASYM = W4.with_(symmetric=False)
W8_CH = QuantArgs(8, strategy="channel", group_size=None)
W8_CH_ASYM = W8_CH.with_(symmetric=False)
W3_NAIVE = QuantArgs(3, symmetric=False, group_size=32)
# suffix of a decoder Linear -> its args, per artifact
LAYOUTS = {
    "mixed": {
        "q_proj": W4,
        "k_proj": W4,
        "v_proj": W4_ASYM,
        "o_proj": W4_ASYM,
        "gate_proj": W8_CH,
        "up_proj": W8_CH_ASYM,
        "down_proj": W3_NAIVE,
    },
    # transformers 5.24 + compressed-tensors 0.20.1 cannot load *packed* asymmetric zero points
    # (CT's meta-device compress path leaves them unpacked, so the shapes mismatch); vLLM and
    # CT's decompressor read them, which (a) checks. (b) therefore uses symmetric packed layers.
    "hf_mixed": {
        "q_proj": W4,
        "k_proj": W4,
        "v_proj": W8_CH,
        "o_proj": W8_CH,
        "gate_proj": W4,
        "up_proj": W4,
        "down_proj": W3_NAIVE,
    },
    "single": {
        s: W4 for s in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    },
}


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0} | {f"t{i}": i for i in range(1, 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def build_artifact(out, layout: dict[str, QuantArgs]):
    """(artifact path, fake-quantized model, {module name: fake-quantized weight}, quantized)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    quantized, fake = {}, {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            args = layout.get(name.rsplit(".", 1)[-1])
            if isinstance(mod, torch.nn.Linear) and args is not None:
                quantized[name] = quantize_weight(mod.weight, args)
                fake[name] = quantized[name].dequantize(torch.bfloat16)
                mod.weight.copy_(fake[name])
    manifest = ArtifactManifest(base_model="tiny-random-llama", recipe="# test\n")
    path = export_compressed_tensors(model, tiny_tokenizer(), quantized, out, manifest)
    return path, model, fake, quantized


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    return {name: build_artifact(root / name, layout) for name, layout in LAYOUTS.items()}


def _ct_scheme(qconfig, name):
    return next(
        s for s in qconfig.config_groups.values() if name in s.targets or "Linear" in s.targets
    )


def test_compressed_tensors_decompresses_to_our_fake_quant(artifacts):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    path, _, fake, quantized = artifacts["mixed"]
    qconfig = QuantizationConfig.model_validate(
        json.loads((path / "config.json").read_text())["quantization_config"]
    )
    tensors = load_file(path / "model.safetensors")
    for name, w_fq in fake.items():
        scheme = _ct_scheme(qconfig, name)
        compressor = BaseCompressor.get_value_from_registry(
            getattr(scheme.format, "value", scheme.format)
        )
        ours = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        assert torch.equal(compressor.decompress(ours, scheme)["weight"], w_fq), name
        qw = quantized[name]
        # fp32 weight: CT re-quantizes in the weight's dtype, and bf16 w / s is not exact for
        # 8-bit codes (bf16 spacing is 0.5 near 127); in fp32 it recovers every code.
        state = {"weight": w_fq.float(), "weight_scale": qw.scale}
        if qw.zero_point is not None:
            state["weight_zero_point"] = qw.zero_point
        theirs = compressor.compress(state, scheme)
        assert set(theirs) == set(ours), name
        for key in ours:
            assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), (
                f"{name}.{key}"
            )


@pytest.mark.parametrize("name", ["hf_mixed", "single"])
def test_transformers_and_our_loader_agree(artifacts, name):
    path, model, fake, _ = artifacts[name]
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    loaded = load_model(path)
    assert loaded.quantized and loaded.manifest is not None
    replaced = {n for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert replaced == set(fake)  # lm_head stays dense
    assert loaded.tokenizer("t5 t7").input_ids == [5, 7]
    with torch.no_grad():
        ours, theirs, ref = loaded.model(ids).logits, hf(ids).logits, model(ids).logits
    # Same bf16 ops on the same weights: expected identical; 1e-3 relative leaves room for
    # a different but equivalent decompression order on the transformers side.
    scale = theirs.float().abs().max().item()
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-3, atol=1e-3 * scale)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-3, atol=1e-3 * scale)
    for n in fake:  # transformers' decompressed weights are ours bit for bit
        assert torch.equal(hf.get_submodule(n).weight, fake[n]), n


def test_tampered_weights_are_refused(artifacts, tmp_path):
    path = shutil.copytree(artifacts["single"][0], tmp_path / "copy")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch for .*model.safetensors"):
        load_model(path)


def test_config_has_only_ct012_keys_and_no_symmetric_zero_points(artifacts):
    for name, (path, _, _fake, quantized) in artifacts.items():
        text = (path / "config.json").read_text()
        assert "zp_dtype" not in text and "scale_dtype" not in text
        qc = json.loads(text)["quantization_config"]
        for group in qc["config_groups"].values():
            assert set(group) <= {
                "targets",
                "weights",
                "input_activations",
                "output_activations",
                "format",
            }
            assert set(group["weights"]) == CT_012_ARG_KEYS
        keys = set(load_file(path / "model.safetensors"))
        for module, qw in quantized.items():
            assert (f"{module}.weight_zero_point" in keys) == (not qw.args.symmetric), module
            assert (f"{module}.weight" in keys) == (qw.args.num_bits == 3), module
        if name == "single":
            (group,) = qc["config_groups"].values()
            assert group["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
            assert qc["format"] == "pack-quantized"
        else:
            assert qc["format"] == "mixed-precision" and qc["ignore"] == []
