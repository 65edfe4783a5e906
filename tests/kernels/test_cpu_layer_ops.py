"""The C element-wise ops (kernels/cpu_layer_ops.c) against their torch twins: RMSNorm with and
without the residual, SiLU-and-multiply, RoPE + KV-cache write into fp32, bf16 and fp8 caches (negative slots
skipped, strided q/k/v views of one projection output), and the fallback to the twin for what
the C code does not take."""

import pytest
import torch

from slimserve.kernels import cpu_layer_ops as lo
from slimserve.kernels import reference, reference_attention

pytestmark = pytest.mark.skipif(not lo.available(), reason=f"no C ops: {lo.unavailable_reason()}")


def _ulp(dtype):
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 384), (7, 576), (33, 100)])
def test_rms_norm_matches_the_twin(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    got = lo.rms_norm(x, w, 1e-5)
    want = reference.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    # one rounding of the dtype apart at most (summation order of the mean square)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * _ulp(dtype), atol=1e-6)
    normed, summed = lo.fused_add_rms_norm(x, res, w, 1e-5)
    want_normed, want_summed = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)  # one rounded add: exact
    torch.testing.assert_close(normed.float(), want_normed.float(), rtol=2 * _ulp(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (5, 37)])
def test_silu_and_mul_matches_the_twin(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    x = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # e^-|g| at 1 and far below the range
    got = lo.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (rows, inter)
    # fp32: the exponential's polynomial and the division round differently; bf16: the silu's
    # rounding point is the twin's, so a value differs only where fp32 silu sits on a bf16 tie
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * _ulp(dtype), atol=1e-6)
    if dtype == torch.bfloat16:
        assert (got != want).sum() <= max(1, got.numel() // 200)


def test_silu_and_mul_takes_a_strided_view_and_leaves_fp16_to_the_twin():
    x = torch.randn(6, 40).to(torch.bfloat16)
    view = x[:, :20]  # rows 40 apart, 20 wide: gate 10, up 10
    torch.testing.assert_close(
        lo.silu_and_mul(view), reference.silu_and_mul(view), rtol=0.01, atol=1e-3
    )
    h = torch.randn(3, 8).half()
    assert torch.equal(lo.silu_and_mul(h), reference.silu_and_mul(h))


def test_rms_norm_takes_a_strided_row_view_and_leaves_fp16_to_the_twin():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 200, generator=g)
    x = wide[:, :96]  # rows 200 apart
    w = torch.randn(96, generator=g)
    torch.testing.assert_close(
        lo.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6
    )
    xh = x.half()
    assert torch.equal(lo.rms_norm(xh, w.half(), 1e-6), reference.rms_norm(xh, w.half(), 1e-6))


def _rope_case(dtype, cache_dtype, t=9, h=6, hkv=2, d=64, blocks=6, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)  # one projection's output
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    pos = torch.randint(0, 5000, (t,), generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = reference_attention.rope_tables(pos, inv_freq)
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    slots[2] = -1  # a padding row: no write
    kc = torch.zeros(blocks, bs, hkv, d, dtype=cache_dtype)
    return qkv, q, k, v, cos, sin, kc, kc.clone(), slots


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.float8_e4m3fn),
    ],
)
def test_rope_and_write_kv_matches_the_twin(dtype, cache_dtype):
    qkv, q, k, v, cos, sin, kc, vc, slots = _rope_case(dtype, cache_dtype)
    qkv2, q2, k2, v2, _, _, kc2, vc2, _ = _rope_case(dtype, cache_dtype)
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    lo.rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots, torch.tensor([scales[0]]), scales[1])
    reference_attention.rope_and_write_kv(q2, k2, v2, cos, sin, kc2, vc2, slots, *scales)
    tol = 2 * _ulp(dtype)
    torch.testing.assert_close(
        qkv.float(), qkv2.float(), rtol=tol, atol=1e-5
    )  # q, k rotated in place
    if cache_dtype == torch.float8_e4m3fn:
        # fp8 codes agree wherever the rotated key agrees exactly; a last-bit difference may
        # move a code by one step
        step = (kc.float() - kc2.float()).abs().max() / max(1e-9, kc2.float().abs().max())
        assert step <= 0.125 and torch.equal(vc, vc2)
    else:
        torch.testing.assert_close(kc.float(), kc2.float(), rtol=tol, atol=1e-5)
        assert torch.equal(vc, vc2)
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not kc.view(-1, *kc.shape[2:])[~written].float().any()  # nothing else touched


def test_fp8_codes_equal_torchs_cast():
    g = torch.Generator().manual_seed(1)
    kc = torch.zeros(4, 16, 1, 64, dtype=torch.float8_e4m3fn)
    v = torch.cat([torch.randn(40, 1, 64, generator=g) * s for s in (1e-4, 0.01, 1.0, 50.0)])[:64]
    v[0, 0, :8] = torch.tensor([448.0, 500.0, -1e6, 2.0**-9, 2.0**-10, 0.0, -0.0, 464.0])
    t = v.shape[0]
    q = torch.zeros(t, 1, 64)
    k = torch.zeros(t, 1, 64)
    cos, sin = torch.ones(t, 32), torch.zeros(t, 32)
    slots = torch.arange(t)
    vc = kc.clone()
    lo.rope_and_write_kv(q, k, v.clone(), cos, sin, kc, vc, slots, 1.0, 1.0)
    want = reference_attention.quantize_fp8(v, 1.0)
    got = vc.view(-1, 1, 64)[:t]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_a_slot_past_the_cache_is_refused_before_any_write():
    qkv, q, k, v, cos, sin, kc, vc, slots = _rope_case(torch.float32, torch.float32)
    before = qkv.clone()
    slots[0] = kc.shape[0] * kc.shape[1]
    with pytest.raises(ValueError, match="past the cache"):
        lo.rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(qkv, before) and not kc.any()
