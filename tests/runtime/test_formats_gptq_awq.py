"""GPTQ (v1/v2) and AWQ GEMM layouts: fixed test vectors, refusals, config blocks, and
the importers that turn both back into compressed-tensors buffers.

Every expected word below was computed by an independent numpy implementation of the layouts
(docs/architecture.md, "GPTQ and AWQ checkpoints"), not derived from our own packer.
"""

import json

import pytest
import torch

from slimserve.compress.export.formats import check_exportable
from slimserve.compress.quant.primitives import compute_qparams, quantize, quantize_weight
from slimserve.kernels import reference
from slimserve.runtime.artifact import awq_format, gptq_format
from slimserve.runtime.artifact.awq_format import awq_config, awq_tensors, pack_awq, unpack_awq
from slimserve.runtime.artifact.compressed_tensors import linear_tensors, scheme_from_ct_dict
from slimserve.runtime.artifact.gptq_format import V1, V2, gptq_config, gptq_tensors
from slimserve.runtime.artifact.importers import import_checkpoint, read_quant_config
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import PRESETS, QuantArgs, QuantScheme, SchemeError
from slimserve.runtime.errors import ArtifactError

W4 = QuantArgs(4, group_size=32)
W4_ASYM = W4.with_(symmetric=False)


def i32(word: int) -> int:
    """The signed int32 that holds the 32-bit pattern `word`."""
    return word - (1 << 32) if word >= 1 << 31 else word


def qw_from_unsigned(
    u: torch.Tensor,
    args: QuantArgs,
    zeros: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    g_idx=None,
) -> QuantizedWeight:
    """A QuantizedWeight whose unsigned codes are `u` [N, K] (and unsigned zeros [N, G])."""
    half = 1 << (args.num_bits - 1)
    n, k = u.shape
    g = -(-k // args.group_size) if args.strategy == "group" else 1
    scale = scale if scale is not None else torch.full((n, g), 0.01, dtype=torch.bfloat16)
    zp = None if zeros is None else (zeros - half).to(torch.int8)
    return QuantizedWeight((u - half).to(torch.int8), scale, zp, g_idx, args)


def ct_dequant(ct: dict, prefix: str, scheme: QuantScheme) -> torch.Tensor:
    """fp32 [N, K] weight of imported CT buffers, through the runtime's reference ops."""
    w = scheme.weights
    if f"{prefix}.weight_packed" in ct:
        return reference.dequantize_packed(
            ct[f"{prefix}.weight_packed"],
            ct[f"{prefix}.weight_scale"],
            ct.get(f"{prefix}.weight_zero_point"),
            ct.get(f"{prefix}.weight_g_idx"),
            ct[f"{prefix}.weight_shape"],
            w.num_bits,
            w.group_size,
        )
    return reference.dequantize_codes(
        ct[f"{prefix}.weight"],
        ct[f"{prefix}.weight_scale"],
        ct.get(f"{prefix}.weight_zero_point"),
        ct.get(f"{prefix}.weight_g_idx"),
        w.group_size,
    )


def import_one(method_cfg: dict, tensors: dict, prefix="m"):
    """(scheme, CT format, CT tensors) of one imported module."""
    qc, ct = import_checkpoint(method_cfg, dict(tensors), "ckpt")
    (group,) = qc["config_groups"].values()
    assert group["targets"] == [prefix]
    return scheme_from_ct_dict(group), group["format"], ct


# ---- fixed test vectors ---------------------------------------------------------------------


def test_gptq_qweight_vector():
    """Output column 0 holds codes 0..7 along K, column 1 codes 15..8 (N padded to 8)."""
    u = torch.zeros(8, 8, dtype=torch.int32)
    u[0] = torch.arange(8)
    u[1] = torch.arange(15, 7, -1)
    t = gptq_tensors("m", qw_from_unsigned(u, W4.with_(group_size=8)))
    assert t["m.qweight"].shape == (1, 8) and t["m.qweight"].dtype == torch.int32
    assert t["m.qweight"][0, :2].tolist() == [0x76543210, i32(0x89ABCDEF)]
    assert t["m.g_idx"].dtype == torch.int32 and t["m.g_idx"].tolist() == [0] * 8


@pytest.mark.parametrize("bits, v1, v2", [(4, 0x77777777, 0x88888888), (8, 0x7F7F7F7F, 0x80808080)])
def test_gptq_symmetric_qzeros_vectors(bits, v1, v2):
    args = QuantArgs(bits, group_size=32)
    qw = qw_from_unsigned(torch.randint(0, 1 << bits, (16, 64), dtype=torch.int32), args)
    assert gptq_tensors("m", qw, checkpoint_format=V1)["m.qzeros"].unique().tolist() == [i32(v1)]
    assert gptq_tensors("m", qw, checkpoint_format=V2)["m.qzeros"].unique().tolist() == [i32(v2)]
    assert (
        v1 == {4: 2004318071, 8: 2139062143}[bits]
        and i32(v2) == {4: -2004318072, 8: -2139062144}[bits]
    )


def autogptq_v1_pack_zeros(zeros: list[int], bits: int = 4) -> int:
    """AutoGPTQ's pack() for one qzeros word: `zeros -= 1`, cast to uint32, shift, OR (§2.4)."""
    word = 0
    for j, z in enumerate(zeros):
        word |= (((z - 1) & 0xFFFFFFFF) << (bits * j)) & 0xFFFFFFFF
    return word


def test_gptq_v1_zero_of_zero():
    zeros = [3, 0, 5, 9, 15, 1, 2, 7]
    assert autogptq_v1_pack_zeros(zeros) == 0xFFFFFFF2  # the §6 vector: the -1 bleeds upwards
    u = torch.randint(0, 16, (8, 32), dtype=torch.int32)
    qw = qw_from_unsigned(u, W4_ASYM, zeros=torch.tensor(zeros).view(8, 1))
    assert gptq_format.needs_v2(qw)
    with pytest.raises(SchemeError, match="zero point of 0.*gptq_v2"):
        gptq_tensors("m", qw, checkpoint_format=V1)
    assert gptq_tensors("m", qw, checkpoint_format=V2)["m.qzeros"].tolist() == [[0x721F9503]]

    # An AutoGPTQ v1 file with that word reads back as [3, 16, 16, ...], as every v1 kernel
    # computes it: zero 16 is outside CT's 4-bit range, so the module becomes naive-quantized.
    t = gptq_tensors("m", qw, checkpoint_format=V2)
    t["m.qzeros"] = torch.tensor([[i32(0xFFFFFFF2)]], dtype=torch.int32)
    cfg = gptq_config(W4_ASYM, checkpoint_format=V1)
    scheme, fmt, ct = import_one(cfg, t)
    assert fmt == "naive-quantized" and not scheme.weights.symmetric
    assert (ct["m.weight_zero_point"].view(-1) + 8).tolist() == [3] + [16] * 7
    v1_reading = torch.tensor([3] + [16] * 7).view(8, 1)
    assert torch.equal(ct_dequant(ct, "m", scheme), (u - v1_reading).float() * qw.scale.float())


def test_awq_interleave_vector():
    u = torch.zeros(32, 8, dtype=torch.int32)  # [N, K]; input column 0 holds codes 0..7 over N
    u[:, 0] = torch.arange(32) % 8
    t = awq_tensors(
        "m", qw_from_unsigned(u, W4_ASYM.with_(group_size=8), zeros=torch.full((32, 1), 8))
    )
    assert t["m.qweight"].shape == (8, 4) and t["m.qweight"][0].tolist() == [0x75316420] * 4
    assert pack_awq(torch.arange(8).view(1, 8)).item() == 0x75316420
    assert awq_format.REVERSE == tuple(torch.argsort(torch.tensor(awq_format.ORDER)).tolist())


def test_cross_format_random_16x256_g128():
    torch.manual_seed(0)
    args = QuantArgs(4, symmetric=False, group_size=128)
    qw = quantize_weight(torch.randn(16, 256, dtype=torch.bfloat16), args)
    ct = linear_tensors("m", qw, QuantScheme(args))
    v2 = gptq_tensors("m", qw, checkpoint_format=V2)
    assert torch.equal(ct["m.weight_packed"], v2["m.qweight"].T)
    assert torch.equal(ct["m.weight_zero_point"], v2["m.qzeros"].T)
    assert torch.equal(ct["m.weight_scale"], v2["m.scales"].T)
    if not gptq_format.needs_v2(qw):  # v1 differs from v2 by exactly 1 per zero nibble
        v1 = gptq_tensors("m", qw, checkpoint_format=V1)
        mask = 0xFFFFFFFF  # compare as unsigned 32-bit words
        assert torch.equal(
            (v1["m.qzeros"].long() + 0x11111111) & mask, v2["m.qzeros"].long() & mask
        )
    awq = awq_tensors("m", qw)
    u = qw.codes.int() + 8
    assert torch.equal(unpack_awq(awq["m.qweight"]), u.T)  # AWQ pack/unpack round trip
    assert torch.equal(unpack_awq(pack_awq(u)), u)
    for cfg, tensors in ((gptq_config(args, checkpoint_format=V2), v2), (awq_config(args), awq)):
        scheme, fmt, back = import_one(cfg, tensors)
        assert fmt == "pack-quantized" and scheme.weights == args
        for key in ("weight_packed", "weight_zero_point", "weight_shape"):
            assert torch.equal(back[f"m.{key}"], ct[f"m.{key}"]), key
        assert torch.equal(ct_dequant(back, "m", scheme), qw.dequantize(torch.float32))


def test_awq_matches_compressed_tensors_converter():
    """compressed-tensors' own AutoAWQConverter reads our AWQ tensors as our CT tensors."""
    conv = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    torch.manual_seed(1)
    args = QuantArgs(4, symmetric=False, group_size=32)
    qw = quantize_weight(torch.randn(24, 64, dtype=torch.float16), args)
    theirs = conv.AutoAWQConverter(group_size=32).process(dict(awq_tensors("model.x", qw)))
    ours = linear_tensors("model.x", qw, QuantScheme(args))
    for key in ours:
        assert torch.equal(theirs[key], ours[key]), key


# ---- round trips through the importers ------------------------------------------------------


def shuffled_qw(args: QuantArgs, n=16, k=128, seed=0) -> QuantizedWeight:
    """Act-order weight: groups formed in a random column order (non-monotonic g_idx)."""
    torch.manual_seed(seed)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    g_idx = (torch.argsort(torch.randperm(k)) // args.group_size).to(torch.int32)
    scale, zp = compute_qparams(w, args, torch.bfloat16, g_idx)
    codes = quantize(w, scale, zp, args, g_idx.long())
    return QuantizedWeight(codes, scale, zp, g_idx, args)


@pytest.mark.parametrize(
    "args",
    [
        W4,
        W4_ASYM,
        QuantArgs(8, strategy="channel", group_size=None),
        QuantArgs(8, symmetric=False, group_size=64),
        QuantArgs(2, group_size=32),
        QuantArgs(2, symmetric=False, strategy="channel", group_size=None),
    ],
    ids=lambda a: (
        f"w{a.num_bits}-{'sym' if a.symmetric else 'asym'}-{a.strategy}{a.group_size or ''}"
    ),
)
@pytest.mark.parametrize("version", [V1, V2])
def test_gptq_import_round_trip(args, version):
    torch.manual_seed(2)
    qw = quantize_weight(torch.randn(32, 128, dtype=torch.bfloat16), args)
    if version == V1 and gptq_format.needs_v2(qw):
        pytest.skip("a zero of 0 drawn; v1 cannot hold it (covered above)")
    cfg = gptq_config(args, checkpoint_format=version)
    scheme, fmt, ct = import_one(cfg, gptq_tensors("m", qw, checkpoint_format=version))
    assert fmt == ("pack-quantized" if args.num_bits in (4, 8) else "naive-quantized")
    assert scheme.weights == args and ("m.weight_g_idx" not in ct)
    assert torch.equal(ct_dequant(ct, "m", scheme).to(torch.bfloat16), qw.dequantize())


@pytest.mark.parametrize("args", [W4, W4_ASYM])
def test_gptq_desc_act_round_trip(args):
    qw = shuffled_qw(args.with_(actorder="group"))
    assert gptq_format.is_monotonic(torch.arange(10) // 3) and not gptq_format.is_monotonic(
        qw.g_idx
    )
    t = gptq_tensors("m", qw)
    assert torch.equal(t["m.g_idx"], qw.g_idx)
    scheme, fmt, ct = import_one(gptq_config(args, desc_act=True), t)
    assert scheme.weights.actorder == "group" and torch.equal(ct["m.weight_g_idx"], qw.g_idx)
    assert torch.equal(ct_dequant(ct, "m", scheme).to(torch.bfloat16), qw.dequantize())
    with pytest.raises(SchemeError, match="g_idx.*awq"):
        awq_tensors("m", QuantizedWeight(qw.codes, qw.scale, qw.zero_point, qw.g_idx, W4_ASYM))


def test_awq_symmetric_scheme_is_written_with_zero_8():
    torch.manual_seed(3)
    qw = quantize_weight(torch.randn(16, 64, dtype=torch.bfloat16), W4)
    t = awq_tensors("m", qw)
    assert t["m.qzeros"].unique().tolist() == [i32(0x88888888)]
    scheme, _, ct = import_one(awq_config(W4), t)
    assert not scheme.weights.symmetric  # AWQ GEMM is asymmetric; the values are the same
    assert torch.equal(ct_dequant(ct, "m", scheme).to(torch.bfloat16), qw.dequantize())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scales_keep_the_layer_dtype(dtype):
    qw = quantize_weight(torch.randn(8, 64, dtype=dtype), W4_ASYM)
    for t in (gptq_tensors("m", qw), awq_tensors("m", qw)):
        assert t["m.scales"].dtype == dtype and torch.equal(t["m.scales"], qw.scale.T)


# ---- configs and refusals --------------------------------------------------------------------


def test_gptq_config_block():
    cfg = gptq_config(QuantArgs(8, strategy="channel", group_size=None), desc_act=True)
    assert cfg == {
        "bits": 8,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
        "desc_act": True,
        "group_size": -1,
        "model_file_base_name": None,
        "model_name_or_path": None,
        "quant_method": "gptq",
        "static_groups": False,
        "sym": True,
        "true_sequential": True,
    }
    assert gptq_config(W4_ASYM)["group_size"] == 32 and gptq_config(W4_ASYM)["sym"] is False


def test_awq_config_block():
    assert awq_config(W4_ASYM, ["lm_head"]) == {
        "bits": 4,
        "group_size": 32,
        "modules_to_not_convert": ["lm_head"],
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }


@pytest.mark.parametrize(
    "fmt, scheme, match",
    [
        ("gptq", PRESETS["W8A8"], "input activations.*compressed-tensors"),
        ("gptq", PRESETS["W3A16"], "3-bit.*compressed-tensors"),
        (
            "gptq",
            QuantScheme(QuantArgs(4, strategy="tensor", group_size=None)),
            "strategy 'tensor'",
        ),
        ("awq", PRESETS["W8A8"], "input activations.*W4A16_ASYM"),
        ("awq", PRESETS["W8A16"], "8-bit int.*W4A16_ASYM"),
        (
            "awq",
            QuantScheme(QuantArgs(4, symmetric=False, strategy="channel", group_size=None)),
            "group_size",
        ),
        ("awq", QuantScheme(W4_ASYM.with_(actorder="group")), "actorder"),
        ("onnx", PRESETS["W4A16"], "unknown.*compressed-tensors, gptq, awq"),
    ],
)
def test_check_exportable_refuses(fmt, scheme, match):
    with pytest.raises(SchemeError, match=match):
        check_exportable(fmt, scheme)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_check_exportable_accepts(fmt):
    check_exportable(fmt, PRESETS["W4A16"])  # awq: written as asymmetric with zero 8
    check_exportable(fmt, PRESETS["W4A16_ASYM"])


def test_shape_refusals():
    qw = quantize_weight(torch.randn(12, 64), W4_ASYM)  # N=12 is not a multiple of 8
    with pytest.raises(SchemeError, match="multiples of 8"):
        gptq_tensors("m", qw)
    with pytest.raises(SchemeError, match="out_features % 8"):
        awq_tensors("m", qw)


# ---- config discovery and import errors ------------------------------------------------------


def test_read_quant_config_side_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_quant_config(tmp_path) is None
    (tmp_path / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"})
    )
    qc = read_quant_config(tmp_path)
    assert qc["quant_method"] == "awq"
    qw = quantize_weight(torch.randn(16, 128), W4_ASYM.with_(group_size=64))
    scheme, _, _ = import_one(qc, awq_tensors("m", qw))
    assert scheme.weights.group_size == 64
    (tmp_path / "quantize_config.json").write_text(
        json.dumps({"bits": 4, "group_size": 128, "sym": True})
    )
    assert read_quant_config(tmp_path)["quant_method"] == "gptq"  # AutoGPTQ's file comes first
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "compressed_tensors"}})
    )
    assert read_quant_config(tmp_path)["quant_method"] == "compressed-tensors"


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "missing tensor m.qzeros"),
    ],
)
def test_import_errors(cfg, match):
    with pytest.raises(ArtifactError, match=match):
        import_checkpoint(cfg, {"m.qweight": torch.zeros(4, 8, dtype=torch.int32)}, "ckpt")
