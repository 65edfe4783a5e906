"""Exporter pieces: CT config block, per-Linear tensors, QuantLinear, manifest, atomic export, loader."""

import json

import pytest
import torch

from slimserve.compress.export import io as export_io
from slimserve.compress.export.io import export_compressed_tensors, size_bytes
from slimserve.compress.quant.primitives import compute_qparams, quantize, quantize_weight
from slimserve.kernels import reference
from slimserve.runtime.artifact.compressed_tensors import (
    args_from_ct_dict,
    linear_tensors,
    quantization_config,
)
from slimserve.runtime.artifact.manifest import (
    ArtifactManifest,
    read_manifest,
    sha256_file,
    verify_files,
)
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import PRESETS, QuantArgs, QuantScheme
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers import QuantLinear
from slimserve.runtime.loading.loader import load_model

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
W3_ASYM = QuantArgs(3, symmetric=False, group_size=32)
W8A8 = QuantScheme(W8_CH, QuantArgs(8, strategy="token", group_size=None, dynamic=True))
SCHEMES = {
    "w4_sym": QuantScheme(W4),
    "w4_asym": QuantScheme(W4_ASYM),
    "w8_channel": QuantScheme(W8_CH),
    "w8_channel_asym": QuantScheme(W8_CH.with_(symmetric=False)),
    "w3_asym_naive": QuantScheme(W3_ASYM),
    "w8a8_int": W8A8,
}


def tiny_llama(tie: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=tie,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def fake_quantize(model, names_to_args: dict[str, QuantArgs]) -> dict[str, QuantizedWeight]:
    """Quantize the named Linears and put their fake-quantized weights in place."""
    out = {}
    with torch.no_grad():
        for name, args in names_to_args.items():
            lin = model.get_submodule(name)
            out[name] = quantize_weight(lin.weight, args)
            lin.weight.copy_(out[name].dequantize(lin.weight.dtype))
    return out


# ---------------------------------------------------------------- config block


def test_single_group_targets_linear_and_ignores_unquantized():
    linears = {
        "model.layers.0.self_attn.q_proj": "Linear",
        "model.layers.0.mlp.down_proj": "Linear",
        "lm_head": "Linear",
    }
    schemes = {n: PRESETS["W4A16"] for n in linears if n != "lm_head"}
    qc = quantization_config(schemes, linears)
    assert set(qc) == {
        "config_groups",
        "format",
        "global_compression_ratio",
        "ignore",
        "kv_cache_scheme",
        "quant_method",
        "quantization_status",
        "sparsity_config",
        "transform_config",
        "version",
    }
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    assert qc["kv_cache_scheme"] is None and qc["sparsity_config"] == {} == qc["transform_config"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert set(group["weights"]) == CT_012_ARG_KEYS


def test_several_groups_list_exact_names_and_mixed_format():
    linears = {"a": "Linear", "b": "Linear", "c": "Linear", "lm_head": "Linear"}
    schemes = {"a": SCHEMES["w4_sym"], "b": SCHEMES["w3_asym_naive"], "c": SCHEMES["w4_sym"]}
    qc = quantization_config(schemes, linears)
    assert qc["format"] == "mixed-precision" and qc["ignore"] == []
    groups = list(qc["config_groups"].values())
    assert [g["targets"] for g in groups] == [["a", "c"], ["b"]]
    assert [g["format"] for g in groups] == ["pack-quantized", "naive-quantized"]


def test_w8a8_group_is_int_quantized_with_token_activations():
    qc = quantization_config({"a": W8A8}, {"a": "Linear"})
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "int-quantized"
    acts = group["input_activations"]
    assert set(acts) == CT_012_ARG_KEYS and acts["strategy"] == "token" and acts["dynamic"] is True


@pytest.mark.parametrize("name", SCHEMES)
def test_ct_args_round_trip(name):
    scheme = SCHEMES[name]
    assert args_from_ct_dict(scheme.weights.to_ct_dict()) == scheme.weights


# ---------------------------------------------------------------- tensors and QuantLinear


def _quantized(args: QuantArgs, n: int = 13, k: int = 80, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return quantize_weight(w, args)


@pytest.mark.parametrize("name", SCHEMES)
def test_linear_tensors_shapes_and_quantlinear_bit_exact(name):
    scheme = SCHEMES[name]
    a = scheme.weights
    qw = _quantized(a)  # N=13, K=80: odd rows, a partial last group
    t = linear_tensors("p", qw, scheme)
    groups = 3 if a.strategy == "group" else 1
    packed = scheme.ct_format() == "pack-quantized"
    expect = {"p.weight_scale": (torch.bfloat16, (13, groups))}
    if packed:
        expect["p.weight_packed"] = (torch.int32, (13, -(-80 * a.num_bits // 32)))
        expect["p.weight_shape"] = (torch.int64, (2,))
        if not a.symmetric:
            expect["p.weight_zero_point"] = (torch.int32, (-(-13 * a.num_bits // 32), groups))
    else:
        expect["p.weight"] = (torch.int8, (13, 80))
        if not a.symmetric:
            expect["p.weight_zero_point"] = (torch.int8, (13, groups))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == expect

    layer = QuantLinear(80, 13, True, scheme, scheme.ct_format(), dtype=torch.bfloat16)
    bias = torch.randn(13).to(torch.bfloat16)
    layer.load_state_dict({k[2:]: v for k, v in t.items()} | {"bias": bias}, strict=True)
    w_fq = qw.dequantize(torch.bfloat16)
    assert torch.equal(layer.dequantized_weight(torch.bfloat16), w_fq)
    x = torch.randn(3, 5, 80).to(torch.bfloat16)
    x_in = reference.fake_quantize_per_token_int8(x) if scheme.input_activations else x
    assert torch.equal(layer(x), torch.nn.functional.linear(x_in, w_fq, bias))


def test_actorder_group_writes_and_uses_g_idx():
    args = W4.with_(actorder="group")
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    g_idx = (torch.randperm(64, generator=torch.Generator().manual_seed(2)) // 32).int()
    scale, zp = compute_qparams(w, args, torch.bfloat16, g_idx)
    qw = QuantizedWeight(quantize(w, scale, zp, args, g_idx.long()), scale, zp, g_idx, args)
    t = linear_tensors("p", qw, QuantScheme(args))
    assert torch.equal(t["p.weight_g_idx"], g_idx)
    w_ref = reference.dequantize_packed(
        t["p.weight_packed"],
        t["p.weight_scale"],
        None,
        t["p.weight_g_idx"],
        t["p.weight_shape"],
        4,
        32,
    )
    assert torch.equal(w_ref.to(torch.bfloat16), qw.dequantize(torch.bfloat16))


def test_per_token_int8_matches_vllms_formula():
    """Dynamic activations: absmax / 127 as vLLM's scaled_int8_quant (not CT's 127.5 of weights),
    so the row's extreme is exactly -127 and -128 is never used."""
    x = torch.tensor([[0.0, 1.0, -2.54, 0.3, 0.01]], dtype=torch.float32)
    q, scale = reference.quantize_per_token_int8(x)
    assert torch.equal(scale, torch.tensor([[2.54 / 127]]))
    assert q.tolist() == [[0, 50, -127, 15, 0]]  # 0.01 / 0.02 = 0.5 -> 0: half to even


# ---------------------------------------------------------------- manifest


def test_manifest_round_trip_and_verify(tmp_path):
    m = ArtifactManifest(
        base_model="tiny", recipe="stages: []\n", stages=[{"name": "rtn"}], eval={"ppl": 3.5}
    )
    assert m.format_version == 2 and m.tool_version
    assert ArtifactManifest.from_json(m.to_json()) == m
    assert read_manifest(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    m.files = {"model.safetensors": sha256_file(tmp_path / "model.safetensors")}
    verify_files(tmp_path, m)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    with pytest.raises(ArtifactError, match="checksum mismatch for .*model.safetensors"):
        verify_files(tmp_path, m)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="model.safetensors is listed .* but missing"):
        verify_files(tmp_path, m)
    with pytest.raises(ArtifactError, match="format_version=3"):
        ArtifactManifest.from_json(json.dumps({"format_version": 3, "base_model": "x"}))


# ---------------------------------------------------------------- export and load


def test_export_is_atomic_on_failure(tmp_path, monkeypatch):
    model = tiny_llama()
    q = fake_quantize(model, {"model.layers.0.self_attn.q_proj": W4})
    out = tmp_path / "art"

    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(export_io, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export_compressed_tensors(model, None, q, out, ArtifactManifest(base_model="tiny"))
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    export_compressed_tensors(model, None, q, out, ArtifactManifest(base_model="tiny"))
    before = sha256_file(out / "model.safetensors")
    monkeypatch.setattr(export_io, "save_file", broken_save)
    with pytest.raises(OSError):
        export_compressed_tensors(model, None, {}, out, ArtifactManifest(base_model="tiny"))
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # old artifact intact, no temp dirs
    assert sha256_file(out / "model.safetensors") == before


def test_export_replaces_existing_artifact(tmp_path):
    model = tiny_llama()
    out = tmp_path / "art"
    export_compressed_tensors(model, None, {}, out, ArtifactManifest(base_model="tiny"))
    q = fake_quantize(model, {"model.layers.1.mlp.up_proj": W4})
    export_compressed_tensors(model, None, q, out, ArtifactManifest(base_model="tiny"))
    assert [p.name for p in tmp_path.iterdir()] == ["art"]
    assert "quantization_config" in json.loads((out / "config.json").read_text())


def test_dense_export_loads_back(tmp_path):
    model = tiny_llama()
    out = export_compressed_tensors(
        model, None, {}, tmp_path / "dense", ArtifactManifest(base_model="tiny")
    )
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    manifest = read_manifest(out)
    assert {"model.safetensors", "config.json"} <= set(manifest.files) and size_bytes(out) > 0
    loaded = load_model(out)
    assert not loaded.quantized and loaded.manifest == manifest and loaded.tokenizer is None
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


def test_tied_embeddings_written_once_and_retied(tmp_path):
    from safetensors import safe_open

    model = tiny_llama(tie=True)
    q = fake_quantize(model, {"model.layers.0.mlp.down_proj": W4_ASYM})
    out = export_compressed_tensors(
        model, None, q, tmp_path / "tied", ArtifactManifest(base_model="t")
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.0.mlp.down_proj.weight" not in keys
    loaded = load_model(out).model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_quantizing_a_tied_weight_is_refused(tmp_path):
    model = tiny_llama(tie=True)
    q = fake_quantize(model, {"lm_head": W8_CH})
    with pytest.raises(ValueError, match="lm_head.weight is tied"):
        export_compressed_tensors(model, None, q, tmp_path / "x", ArtifactManifest(base_model="t"))
    assert list(tmp_path.iterdir()) == []


def test_loader_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(
        ArtifactError, match="no such model or artifact: .*nope.*Hugging Face model id"
    ):
        load_model(tmp_path / "nope")
    model = tiny_llama()
    q = fake_quantize(model, {"model.layers.0.self_attn.k_proj": W4})
    out = export_compressed_tensors(
        model, None, q, tmp_path / "a", ArtifactManifest(base_model="t")
    )
    (out / "slimserve.json").unlink()  # edit the weights freely below (loaded with verify="none")
    tensors = load_file(out / "model.safetensors")
    scale = tensors.pop("model.layers.0.self_attn.k_proj.weight_scale")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ArtifactError, match="slimserve.json is missing.*--verify none"):
        load_model(out)
    with pytest.raises(ArtifactError, match="missing tensor.*k_proj.weight_scale"):
        load_model(out, verify="none")
    save_file(
        tensors
        | {"model.layers.0.self_attn.k_proj.weight_scale": scale, "extra.thing": scale.clone()},
        out / "model.safetensors",
    )
    with pytest.raises(ArtifactError, match="unexpected tensor.*extra.thing"):
        load_model(out, verify="none")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ArtifactError, match="quant_method 'bitsandbytes' is not supported.*compressed-tensors"
    ):
        load_model(out, verify="none")
