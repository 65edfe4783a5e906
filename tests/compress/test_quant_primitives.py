"""RTN arithmetic against compressed-tensors' rules (compress/quant/primitives.py), worked
examples computed by hand, and invariants."""

import pytest
import torch

from slimserve.compress.quant.primitives import compute_qparams, quantize_weight
from slimserve.runtime.artifact.scheme import PRESETS, QuantArgs, QuantScheme, SchemeError, preset

W = torch.tensor([[-0.30, 0.10, 0.45, -0.05]])


def test_symmetric_int4_worked_example():
    qw = quantize_weight(W, QuantArgs(4, strategy="channel", group_size=None), torch.float32)
    assert qw.codes.tolist() == [[-5, 2, 7, -1]]  # 0.45/0.06 = 7.5 is clamped to 7 before rounding
    assert qw.scale.item() == pytest.approx(0.06)
    assert qw.zero_point is None


def test_asymmetric_int4_worked_example():
    qw = quantize_weight(
        W, QuantArgs(4, symmetric=False, strategy="channel", group_size=None), torch.float32
    )
    assert qw.codes.tolist() == [[-8, 0, 7, -3]]
    assert (qw.codes.int() + 8).tolist() == [[0, 8, 15, 5]]  # stored unsigned codes
    assert qw.zero_point.item() == -2 and qw.zero_point.item() + 8 == 6
    assert qw.scale.item() == pytest.approx(0.05)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_codes_in_range_and_error_bounded(bits, sym):
    torch.manual_seed(0)
    w = torch.randn(37, 256)
    args = QuantArgs(bits, symmetric=sym, group_size=64)
    qw = quantize_weight(w, args, torch.float32)
    assert qw.codes.min() >= args.qmin and qw.codes.max() <= args.qmax
    # Round-to-nearest: every in-range element is within half a step of its group's scale.
    err = (qw.dequantize(torch.float32) - w).abs()
    step = qw.scale[:, torch.arange(256) // 64]
    assert torch.all(err <= step * 0.5 + 1e-6 + (w.abs() > step * (args.qmax + 0.5)) * step)


def test_scale_rounded_to_storage_dtype_before_codes():
    torch.manual_seed(1)
    w = torch.randn(8, 128)
    qw = quantize_weight(w, QuantArgs(4, group_size=128), torch.bfloat16)
    assert qw.scale.dtype == torch.bfloat16
    # Codes come from the *stored* (bf16) scale, not the fp32 one it was rounded from.
    expected = torch.round(torch.clamp(w / qw.scale.float(), -8, 7)).to(torch.int8)
    assert torch.equal(qw.codes, expected)


def test_partial_last_group():
    w = torch.randn(4, 100)
    scale, zp = compute_qparams(w, QuantArgs(4, group_size=64), torch.float32)
    assert scale.shape == (4, 2) and zp is None


def test_presets_and_validation():
    assert set(PRESETS) >= {"W4A16", "W4A16_ASYM", "W8A16"}
    assert preset("w4a16").weights.group_size == 128
    assert QuantScheme(preset("W8A16").weights).ct_format() == "pack-quantized"
    assert preset("W3A16").ct_format() == "naive-quantized"
    with pytest.raises(SchemeError, match="W5A16"):
        preset("W5A16")
    with pytest.raises(SchemeError, match="group_size=100"):
        QuantArgs(4, group_size=100)
    with pytest.raises(SchemeError, match="num_bits=5"):
        QuantArgs(5)
    with pytest.raises(SchemeError, match="dynamic"):
        QuantArgs(8, strategy="token", group_size=None)
