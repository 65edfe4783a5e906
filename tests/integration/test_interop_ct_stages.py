"""Artifacts the *pipeline* writes, read back by the compressed-tensors library.

test_interop_ct.py checks the exporter on hand-built fake-quant models; here the tensors come
from `run_recipe` on the tiny checkpoint: (a) GPTQ W4A16 g32 with `actorder: group` (pack-quantized
with `weight_g_idx`), (b) `smoothquant` + `rtn` W8A8 (int-quantized: int8 `weight` + per-channel
`weight_scale`, dynamic per-token int8 input activations). compressed-tensors' own unpacking and
dequantization must give exactly the weights our loader dequantizes
(`load_model` -> `QuantLinear.dequantized_weight`).

compressed-tensors 0.20 removed `actorder: group` (its QuantizationArgs refuses the value, and its
group dequantization ignores `weight_g_idx`), so for (a) the test pins that refusal and reads the
tensors with CT's unpack + dequantize on the columns sorted by g_idx: with act-order groups every
group is `group_size` columns, so in that order they are contiguous, which is all CT's group
dequantization knows.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.layers import QuantLinear
from slimserve.runtime.loading.loader import load_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from pydantic import ValidationError  # noqa: E402

RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: "text:{cal}", num_samples: 8, seq_len: 64}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10.0}}
stages:
{stages}
"""
STAGES = {
    "gptq_group": "  - gptq: {scheme: W4A16, group_size: 32, actorder: group}",
    "smoothquant_w8a8": "  - smoothquant: {alpha: 0.8}\n  - rtn: {scheme: W8A8}",
}
GROUP = 32
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down; lm_head is ignored


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint, tmp_path_factory):
    """Stage name -> (artifact path, loaded model, safetensors of the artifact)."""
    tmp = tmp_path_factory.mktemp("interop-stages")
    # 100 kB of the stdlib train split: `dataset: stdlib` tokenizes all 10.8 MB of it (~20 s).
    cal = tmp / "calib.txt"
    cal.write_text("\n\n".join(read_texts("train")[:16])[:100_000], encoding="utf-8")
    threads = torch.get_num_threads()
    # GPTQ's column loop is thousands of tiny ops; on 2 shared cores one thread is far faster.
    torch.set_num_threads(1)
    try:
        out = {}
        for name, stages in STAGES.items():
            text = RECIPE.format(model=tiny_checkpoint, out=tmp / name, cal=cal, stages=stages)
            res = run_recipe(
                parse_recipe(text, tmp / f"{name}.yaml"), log=lambda m: None, progress=False
            )
            out[name] = (
                res.artifact,
                load_model(res.artifact).model,
                load_file(res.artifact / "model.safetensors"),
            )
    finally:
        torch.set_num_threads(threads)
    return out


def _quant_config(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def _quant_linears(model) -> dict[str, QuantLinear]:
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(mods) == 2 * LINEARS_PER_LAYER and not any(n.startswith("lm_head") for n in mods)
    return mods


def _module_tensors(tensors: dict, name: str) -> dict[str, torch.Tensor]:
    """`<name>.<key>` tensors as CT's per-module state dict ({key: tensor})."""
    return {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}


def test_gptq_group_actorder_is_refused_by_ct_configs(artifacts):
    path, _, _ = artifacts["gptq_group"]
    qc = _quant_config(path)
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "pack-quantized" and group["weights"]["actorder"] == "group"
    with pytest.raises(ValidationError, match="actorder='group' has been removed"):
        QuantizationConfig.model_validate(qc)


def test_gptq_group_actorder_ct_unpack_and_dequantize_match_our_loader(artifacts):
    path, model, tensors = artifacts["gptq_group"]
    (group,) = _quant_config(path)["config_groups"].values()
    # The same args without the act-order CT 0.20 refuses; group dequantization does not read it.
    args = QuantizationArgs.model_validate({**group["weights"], "actorder": None})
    assert (args.num_bits, args.group_size, args.strategy, args.symmetric) == (
        4,
        GROUP,
        "group",
        True,
    )
    permuted = 0
    for name, lin in _quant_linears(model).items():
        t = _module_tensors(tensors, name)
        assert set(t) == {"weight_packed", "weight_scale", "weight_shape", "weight_g_idx"}, name
        g_idx = t["weight_g_idx"].long()
        n, k = t["weight_shape"].tolist()
        # Every act-order group is full, so sorting the columns by group makes groups contiguous.
        assert torch.equal(
            torch.bincount(g_idx, minlength=k // GROUP), torch.full((k // GROUP,), GROUP)
        ), name
        order = torch.argsort(g_idx, stable=True)
        permuted += not torch.equal(order, torch.arange(k))
        codes = unpack_from_int32(
            t["weight_packed"], args.num_bits, t["weight_shape"]
        )  # CT's unpacking
        sorted_w = dequantize(codes[:, order], t["weight_scale"], None, args)  # CT's dequantization
        theirs = torch.empty_like(sorted_w)
        theirs[:, order] = sorted_w
        ours = lin.dequantized_weight(lin.storage_dtype)
        assert theirs.dtype == ours.dtype == torch.bfloat16 and theirs.shape == (n, k), name
        assert torch.equal(theirs, ours), name
    assert permuted > 0  # act-order really reordered columns, so g_idx was exercised


def test_smoothquant_w8a8_ct_decompresses_to_our_loader(artifacts, tiny_checkpoint):
    path, model, tensors = artifacts["smoothquant_w8a8"]
    qconfig = QuantizationConfig.model_validate(_quant_config(path))
    assert qconfig.format == "int-quantized" and qconfig.ignore == ["lm_head"]
    (scheme,) = qconfig.config_groups.values()
    assert isinstance(scheme, QuantizationScheme) and scheme.targets == ["Linear"]
    w, a = scheme.weights, scheme.input_activations
    assert (w.num_bits, w.type, w.strategy, w.symmetric, w.dynamic) == (
        8,
        "int",
        "channel",
        True,
        False,
    )
    assert (a.num_bits, a.type, a.strategy, a.symmetric, a.dynamic) == (
        8,
        "int",
        "token",
        True,
        True,
    )
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
    for name, lin in _quant_linears(model).items():
        t = _module_tensors(tensors, name)
        assert set(t) == {"weight", "weight_scale"}, name  # symmetric: no zero point on disk
        assert t["weight"].dtype == torch.int8 and t["weight_scale"].shape == (
            t["weight"].shape[0],
            1,
        ), name
        theirs = compressor.decompress(t, scheme)["weight"]
        ours = lin.dequantized_weight(lin.storage_dtype)
        assert theirs.dtype == ours.dtype == torch.bfloat16, name
        assert torch.equal(theirs, ours), name
    # SmoothQuant really ran: it folded its scales into the norms in front of q/k/v and gate/up.
    base = load_file(tiny_checkpoint / "model.safetensors")
    key = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(tensors[key], base[key])
