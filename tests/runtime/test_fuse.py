"""Fusing q/k/v and gate/up: the fused layer's output is the concatenation of the parts'."""

import pytest
import torch
from torch import nn

from slimserve.runtime.artifact.scheme import preset
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.models.fuse import fuse_linears


def _random_quant(k, n, scheme_name, asym, g):
    scheme = preset(scheme_name)
    if asym:
        scheme = scheme.__class__(scheme.weights.with_(symmetric=False), scheme.input_activations)
    fmt = "int-quantized" if scheme.input_activations is not None else "pack-quantized"
    q = QuantLinear(k, n, True, scheme, fmt, dtype=torch.float32)
    for name, buf in q.named_buffers():
        if name == "weight_shape":
            continue
        if buf.dtype == torch.int32:
            buf.copy_(torch.randint(-(2**31), 2**31 - 1, buf.shape, generator=g, dtype=torch.int32))
        elif buf.dtype == torch.int8:
            buf.copy_(torch.randint(-127, 128, buf.shape, generator=g, dtype=torch.int8))
        else:
            buf.copy_(torch.rand(buf.shape, generator=g) * 0.01 + 0.001)
    return q


@pytest.mark.parametrize(
    "scheme,asym", [("W4A16", False), ("W4A16", True), ("W8A16", True), ("W8A8", False)]
)
def test_fused_quant_linear_equals_concatenated_outputs(scheme, asym):
    g = torch.Generator().manual_seed(0)
    parts = [_random_quant(256, n, scheme, asym, g) for n in (96, 32, 32)]  # q, k, v of a GQA layer
    fused = fuse_linears(parts)
    assert fused is not None and fused.sizes == [96, 32, 32]
    x = torch.randn(5, 256, generator=g)
    # same fp32 dequantization and one GEMM over the stacked rows: bit-identical rows
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_dense_fusion_and_refusals():
    g = torch.Generator().manual_seed(1)
    dense = [nn.Linear(64, n, bias=False) for n in (64, 16, 16)]
    x = torch.randn(3, 64, generator=g)
    fused = fuse_linears(dense)
    torch.testing.assert_close(fused(x), torch.cat([d(x) for d in dense], -1), rtol=0, atol=1e-6)
    # a dense and a quantized part, or asymmetric int4 rows that do not fill int32 words: no fusion
    assert fuse_linears([dense[0], _random_quant(64, 16, "W4A16", False, g)]) is None
    assert fuse_linears([_random_quant(64, n, "W4A16", True, g) for n in (12, 4)]) is None
