"""W8A8 QuantLinears on CPU through the int8 GEMM (runtime/layers/cpu_quant_linear.py,
kernels/cpu_quant_gemm.py): codes and outputs against the twins in kernels/reference.py, the
layer against the fake-quantized float path it replaces, a tiny model's logits, and the fallback
when the kernel is unavailable."""

import pytest
import torch

from slimserve.eval.engine_bench import quantize_randomly
from slimserve.kernels import cpu_quant_gemm, reference
from slimserve.runtime.artifact.scheme import preset
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.layers import cpu_quant_linear
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.worker import model_runner
from slimserve.runtime.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not cpu_quant_gemm.available(),
    reason=f"the int8 CPU kernel does not build here: {cpu_quant_gemm.unavailable_reason()}",
)


def _w8a8(k, n, bias, storage, g):
    """A W8A8 QuantLinear with random codes (the full int8 range) and plausible scales."""
    layer = QuantLinear(k, n, bias, preset("W8A8"), "int-quantized", dtype=storage)
    layer.weight.copy_(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
    layer.weight_scale.copy_((torch.rand(n, 1, generator=g) + 0.5) * 0.02 / 128)
    if bias:
        layer.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 200])
def test_codes_and_scales_equal_the_twin_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x[0, :5] = torch.tensor([0.5, -0.5, 2.5, -127.0, 1e-3])  # scale 1: ties, the extreme
    if rows > 1:
        x[1] = 0  # an all-zero row: scale clamped to fp32 eps
    strided = torch.randn(rows, 200, generator=g)[:, ::2]  # rows not contiguous columns: the twin
    for t in (x, strided, x[:, :37], x.bfloat16(), strided.bfloat16()):
        q, s = cpu_quant_gemm.quantize_per_token(t)
        want_q, want_s = reference.quantize_per_token_int8(t)
        assert s.dtype == want_s.dtype
        assert torch.equal(q, want_q) and torch.equal(s, want_s)
        q32, s32 = cpu_quant_gemm.quantize_per_token(t, fp32_scale=True)  # what the layers take
        assert s32.dtype == torch.float32
        assert torch.equal(q32, want_q) and torch.equal(s32, want_s.float())


@pytest.mark.parametrize("rows,n,k", [(1, 96, 64), (7, 13, 40), (9, 200, 576), (33, 6, 1536)])
def test_gemm_equals_the_twin_bit_for_bit(rows, n, k):
    g = torch.Generator().manual_seed(n)
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    xs, ws = torch.rand(rows, 1, generator=g), torch.rand(n, generator=g)
    bias = torch.randn(n, generator=g)
    for b in (bias, None):
        want = reference.w8a8_gemm(q, xs, w, ws, b, torch.float32)
        assert torch.equal(cpu_quant_gemm.w8a8_gemm(q, xs, w, ws, b), want)
        # the row sums held with the weight (the VNNI path's correction) give the same result
        sums = cpu_quant_gemm.weight_sums(w)
        assert torch.equal(sums, w.int().sum(1, dtype=torch.int32))
        assert torch.equal(cpu_quant_gemm.w8a8_gemm(q, xs, w, ws, b, sums), want)
    with pytest.raises(ValueError, match="w_sum must be int32"):
        cpu_quant_gemm.w8a8_gemm(q, xs, w, ws, None, torch.zeros(n, dtype=torch.int64))
    # every pair sum at 2 * 128 * 128: where a saturating 16-bit kernel goes wrong
    ext = torch.full((rows, k), -128, dtype=torch.int8)
    acc = cpu_quant_gemm.w8a8_gemm(
        ext, torch.ones(rows), ext[:1].expand(n, k).contiguous(), torch.ones(n)
    )
    assert torch.equal(acc, torch.full((rows, n), 128.0 * 128 * k))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 130])
def test_layer_matches_the_fake_quant_float_path(bias, rows):
    g = torch.Generator().manual_seed(rows + bias)
    for storage in (torch.float32, torch.bfloat16):
        layer = _w8a8(576, 960, bias, storage, g)
        x = torch.randn(2, rows, 576, generator=g)  # 3-D input: 2 * rows tokens
        # before freeze_dense: the float path (fake-quantized x, weight dequantized and rounded
        # to the checkpoint's dtype) that the engine ran until now
        float_path = layer(x)
        layer.freeze_dense(torch.float32)
        assert "_int8" in layer.__dict__ and not hasattr(layer, "_packed")
        got = layer(x)
        twin = reference.linear_w8a8(x, layer.weight, layer.weight_scale, layer.bias)
        assert torch.equal(got, twin)  # the W8A8 twin (the Triton kernel's), bit for bit
        span = float(float_path.abs().max())
        # fp32 scales: the same weight and codes, only the summation order differs; bf16 scales:
        # the float path's weight was rounded to bf16 (2^-9 relative), the int8 path's is exact
        tol = 2e-6 if storage == torch.float32 else 1e-2
        torch.testing.assert_close(got, float_path, rtol=0, atol=tol * span)


def float_path_out(layer, x):
    """The path this replaces: fake-quantized activations times the dequantized float weight."""
    w = layer.dequantized_weight(torch.float32)
    b = None if layer.bias is None else layer.bias.float()
    return torch.nn.functional.linear(reference.fake_quantize_per_token_int8(x), w, b)


def test_zero_tokens_and_non_contiguous_operands():
    g = torch.Generator().manual_seed(5)
    layer = _w8a8(64, 24, True, torch.float32, g)
    layer.freeze_dense(torch.float32)
    assert layer(torch.zeros(0, 64)).shape == (0, 24)
    q = torch.randint(-128, 128, (64, 6), generator=g, dtype=torch.int8).t()  # [6, 64], a view
    w = torch.randint(-128, 128, (64, 24), generator=g, dtype=torch.int8).t()
    xs, ws = torch.rand(6, 1, generator=g), torch.rand(24, generator=g).to(torch.bfloat16)
    want = reference.w8a8_gemm(q, xs, w, ws, None, torch.float32)
    assert torch.equal(cpu_quant_gemm.w8a8_gemm(q, xs, w, ws), want)


def test_bf16_activations_round_once_like_the_twin():
    g = torch.Generator().manual_seed(3)
    layer = _w8a8(64, 48, True, torch.bfloat16, g)
    layer.freeze_dense(torch.bfloat16)
    assert "_int8" in layer.__dict__
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    want = reference.linear_w8a8(x, layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(got, want)


needs_vnni = pytest.mark.skipif(
    not cpu_quant_gemm.vnni(), reason="the packed GEMM needs a library built for AVX512-VNNI"
)


@needs_vnni
@pytest.mark.parametrize(
    "rows,n,k", [(1, 96, 64), (3, 13, 37), (4, 16, 4), (9, 200, 576), (33, 70, 1536)]
)
def test_packed_gemm_equals_the_twin_bit_for_bit(rows, n, k):
    """Ragged 16-channel groups (13, 70, 200), a ragged k-quad (37), one row and rows past the
    4-row tile; fp32 and bf16 out, with and without bias; and every product -128 x -128."""
    assert cpu_quant_gemm.packed_available()
    g = torch.Generator().manual_seed(k)
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    xs, ws = torch.rand(rows, 1, generator=g), torch.rand(n, generator=g)
    pw = cpu_quant_gemm.pack(w)
    assert pw.data.numel() == -(-n // 16) * 16 * -(-k // 4) * 4
    for b in (torch.randn(n, generator=g), None):
        for dtype in (torch.float32, torch.bfloat16):
            want = reference.w8a8_gemm(q, xs, w, ws, b, dtype)
            got = cpu_quant_gemm.w8a8_gemm_packed(q, xs, pw, ws, b, dtype)
            assert got.dtype == dtype and torch.equal(got, want)
    ext = torch.full((rows, k), -128, dtype=torch.int8)
    acc = cpu_quant_gemm.w8a8_gemm_packed(
        ext, torch.ones(rows), cpu_quant_gemm.pack(ext[:1].expand(n, k)), torch.ones(n)
    )
    assert torch.equal(acc, torch.full((rows, n), 128.0 * 128 * k))
    assert cpu_quant_gemm.w8a8_gemm_packed(q[:0], xs[:0], pw, ws).shape == (0, n)
    with pytest.raises(ValueError, match=f"int8 codes \\[M, {k}\\]"):
        cpu_quant_gemm.w8a8_gemm_packed(q[:, :-1], xs, pw, ws)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_quant_gemm.w8a8_gemm_packed(q, xs, pw, ws, None, torch.float16)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_take_the_packed_gemm_where_it_runs(dtype):
    g = torch.Generator().manual_seed(5)
    layer = _w8a8(576, 200, True, torch.bfloat16, g)
    layer.freeze_dense(dtype)
    assert layer.__dict__["_int8"].packed is not None
    x = torch.randn(2, 7, 576, generator=g).to(dtype)
    want = reference.linear_w8a8(x.reshape(-1, 576), layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(layer(x), want.to(dtype).reshape(2, 7, 200))


def test_probe_refuses_a_packed_gemm_that_disagrees(monkeypatch):
    real = cpu_quant_gemm.w8a8_gemm_packed
    monkeypatch.setattr(cpu_quant_gemm, "w8a8_gemm_packed", lambda *a: real(*a) * 1.0001)
    cpu_quant_gemm.packed_available.cache_clear()
    try:
        assert not cpu_quant_gemm.packed_available()
        g = torch.Generator().manual_seed(6)
        layer = _w8a8(64, 32, False, torch.float32, g)
        layer.freeze_dense(torch.float32)
        assert layer.__dict__["_int8"].packed is None  # the unpacked int8 GEMM serves it
    finally:
        monkeypatch.undo()
        cpu_quant_gemm.packed_available.cache_clear()
    assert cpu_quant_gemm.packed_available() == cpu_quant_gemm.vnni()


def test_only_w8a8_int8_channel_layers_on_cpu_take_the_path():
    w8a8, w4a16 = preset("W8A8"), preset("W4A16")
    cpu = torch.device("cpu")
    assert cpu_quant_linear.serves(w8a8, "int-quantized", False, cpu, torch.float32)
    assert not cpu_quant_linear.serves(w4a16, "pack-quantized", False, cpu, torch.float32)
    assert not cpu_quant_linear.serves(w8a8, "int-quantized", False, cpu, torch.float16)
    assert not cpu_quant_linear.serves(w8a8, "int-quantized", True, cpu, torch.float32)
    asym = w8a8.__class__(w8a8.weights.with_(symmetric=False), w8a8.input_activations)
    assert not cpu_quant_linear.serves(asym, "int-quantized", False, cpu, torch.float32)
    assert not cpu_quant_linear.serves(
        w8a8, "int-quantized", False, torch.device("meta"), torch.float32
    )


def test_unavailable_kernel_keeps_the_float_path(monkeypatch):
    g = torch.Generator().manual_seed(4)
    layer = _w8a8(64, 32, True, torch.float32, g)
    monkeypatch.setattr(cpu_quant_gemm, "available", lambda: False)
    layer.freeze_dense(torch.float32)
    assert "_int8" not in layer.__dict__
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), float_path_out(layer, x), rtol=1e-5, atol=1e-6)


def test_probe_refuses_a_kernel_that_disagrees(monkeypatch):
    real = cpu_quant_gemm.w8a8_gemm
    monkeypatch.setattr(cpu_quant_gemm, "w8a8_gemm", lambda *a: real(*a) + 1e-3)
    cpu_quant_gemm.available.cache_clear()
    try:
        assert not cpu_quant_gemm.available()
    finally:
        monkeypatch.undo()
        cpu_quant_gemm.available.cache_clear()
    assert cpu_quant_gemm.available()


def _logits(tiny_checkpoint, monkeypatch, int8):
    monkeypatch.setattr(model_runner, "pack_linears", lambda model, dtype: 0)  # keep nn.Linear
    if not int8:
        monkeypatch.setattr(cpu_quant_gemm, "available", lambda: False)
    runner = ModelRunner(
        EngineConfig(model=str(tiny_checkpoint), dtype="float32", kv_cache_memory="4MiB")
    )
    quantize_randomly(runner.model, seed=1, scheme_name="W8A8")
    runner._prepare_weights()
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(("_int8" in m.__dict__) == int8 for m in layers)
    table = [[3, 1], [0, 2]]
    first = runner.execute(
        runner.prepare([[5, 9, 100, 7, 42, 3, 8], [17, 4]], [0, 0], table, [True, True])
    )
    second = runner.execute(runner.prepare([[77], [78]], [7, 2], table, [True, True]))
    monkeypatch.undo()
    return first, second


def test_tiny_model_logits_match_the_float_path(tiny_checkpoint, monkeypatch):
    got = _logits(tiny_checkpoint, monkeypatch, int8=True)
    want = _logits(tiny_checkpoint, monkeypatch, int8=False)
    for g, w in zip(got, want):
        # fp32 scales (the model is loaded in fp32): the same weights and activation codes, only
        # the summation order differs (~1e-7 relative); but where that moves an activation
        # across a rounding boundary of the next layer's per-token quantization, the code flips
        # by one step (1/127 of the row's absmax), measured here at up to ~1.1e-3 of the logit
        # range; a wrong scale, index or sign moves logits by O(range)
        span = float(w.max() - w.min())
        torch.testing.assert_close(g, w, rtol=0, atol=5e-3 * span)
