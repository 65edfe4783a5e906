"""INT8 / INT4 KV caches (kernels/kv_quant.py): the twin's round trip against its derived error
bound, the row layout, the refusals; the C kernels (kernels/cpu_layer_ops.c write, codes bit for
bit; kernels/cpu_attention.c decode) and the Triton kernels (kernels/kv_cache.py,
kernels/rope_kv_cache.py bit for bit; kernels/paged_attention.py decode, split decode and
prefill, through the interpreter) against the twins.

Tolerances. A read-back value differs from the written one by at most `kv_quant.max_error` of
its row (half a step plus the fp16 rounding of scale and zero). Attention over such values:
each score q.k moves by at most delta = scale x sum_d |q_d| err_k (err_k the key rows' bound),
so every softmax weight moves by a factor within e^(+-2 delta) and the output, a convex
combination of V rows, by at most (e^(2 delta) - 1) max|v| + err_v. Against the twin reading
the same codes, the C kernel differs only in summation order and a fused multiply-add per
dequantized value (fp32: ~1e-6 relative); the Triton kernels round P x scale to the query
dtype before P @ V (<= eps/2 relative per weight) and the output to its dtype, so 2 eps max|V|
as in tests/kernels/test_paged_attention.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimserve.kernels import cpu_attention as ca
from slimserve.kernels import cpu_layer_ops as cl
from slimserve.kernels import kv_quant as kq
from slimserve.kernels import reference_attention as ra

BITS = [8, 4]


def _rows(seed: int, shape, offset: float = 0.0) -> torch.Tensor:
    """Rows of several magnitudes (1e-3 to 1e2) and offsets, one constant row."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-3, 2, shape[0])[(slice(None),) + (None,) * (len(shape) - 1)]
    x = torch.randn(*shape, generator=g) * mag + offset * mag
    x[1] = 0.75
    return x


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_the_derived_bound(bits, dtype):
    x = _rows(bits, (24, 3, 64), offset=2.0).to(dtype)
    rows = kq.quantize_rows(x, bits)
    assert rows.dtype == torch.uint8 and rows.shape == (24, 3, kq.row_bytes(64, bits))
    back = kq.dequantize_rows(rows, 64, bits)
    err = (back - x.float()).abs()
    assert (err <= kq.max_error(x, bits)).all()
    # the bound is tight to about half a step: not a bound that any code would meet
    step = (x.float().amax(-1) - x.float().amin(-1)) / kq.qmax(bits)
    assert (err.amax(-1) >= 0.3 * step).sum() > 20
    assert torch.equal(back[1], torch.full_like(back[1], 0.75))  # a constant row: exact


def test_layout_codes_then_fp16_scale_and_zero_low_nibble_first():
    x = torch.tensor([[0.0, 15.0, 1.0, 14.0, 2.0, 2.0]])  # min 0, max 15: scale 1 (int4)
    rows = kq.quantize_rows(x, 4)
    assert rows[0, :3].tolist() == [0 | 15 << 4, 1 | 14 << 4, 2 | 2 << 4]
    assert rows[0, 3:].clone().view(torch.float16).tolist() == [1.0, 0.0]
    rows8 = kq.quantize_rows(x * 17, 8)  # min 0, max 255: scale 1
    assert rows8[0, :6].tolist() == [0, 255, 17, 238, 34, 34]
    assert rows8[0, 6:].clone().view(torch.float16).tolist() == [1.0, 0.0]


def test_odd_head_dim_and_wrong_widths_are_one_line_errors():
    with pytest.raises(ValueError, match=r"int4: head_dim 63 is odd .* use --kv-cache-dtype int8"):
        kq.row_bytes(63, 4)
    with pytest.raises(
        ValueError, match=r"rows of 30 bytes is neither int8 \(68\) nor int4 \(36\)"
    ):
        kq.cache_bits(torch.zeros(2, 4, 1, 30, dtype=torch.uint8), 64)
    assert kq.cache_bits(torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16), 64) == 0


def _paged(bits, h_kv, d, bs, lens, seed):
    """int caches of scattered blocks holding random rows; tables; the float K/V written."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // bs) for n in lens) + 3
    k = torch.randn(blocks, bs, h_kv, d, generator=g) * 2 + 0.5
    v = torch.randn(blocks, bs, h_kv, d, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    width = max(1, max(-(-n // bs) for n in lens))
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for r, n in enumerate(lens):
        nb = -(-n // bs)
        tables[r, :nb] = torch.tensor(perm[at : at + nb], dtype=torch.int32)
        at += nb
    kc, vc = kq.quantize_rows(k, bits), kq.quantize_rows(v, bits)
    return k, v, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("bits", BITS)
def test_twin_attention_over_int_caches_within_the_derived_bound(bits):
    d, bs, h, h_kv = 32, 8, 6, 2
    k, v, kc, vc, tables, ctx = _paged(bits, h_kv, d, bs, [1, 9, 40], seed=bits)
    q = torch.randn(3, h, d, generator=torch.Generator().manual_seed(3))
    scale = d**-0.5
    got = ra.paged_attention_decode(q, kc, vc, tables, ctx, scale)
    exact = ra.paged_attention_decode(q, k, v, tables, ctx, scale)
    err_k = kq.max_error(k, bits).max()
    err_v = kq.max_error(v, bits).max()
    delta = scale * q.abs().sum(-1).max() * err_k
    bound = (math.exp(2 * float(delta)) - 1) * float(v.abs().max()) + float(err_v)
    assert (got - exact).abs().max() <= bound
    assert (got - exact).abs().max() > 0  # the cache is really quantized


needs_c = pytest.mark.skipif(
    not (ca.available() and cl.available()), reason=f"no CPU kernels: {ca.unavailable_reason()}"
)


@needs_c
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_rope_write_codes_bit_for_bit(bits, dtype):
    t, h, h_kv, d, bs, nb = 9, 6, 3, 64, 4, 8
    g = torch.Generator().manual_seed(bits)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = _rows(1, (t, h_kv, d), offset=1.0).to(dtype)
    v = _rows(2, (t, h_kv, d)).to(dtype)
    cos, sin = torch.randn(t, d // 2, generator=g), torch.randn(t, d // 2, generator=g)
    width = kq.row_bytes(d, bits)
    kc = torch.randint(0, 256, (nb, bs, h_kv, width), dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 256, (nb, bs, h_kv, width), dtype=torch.uint8, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([3, 5, -1, 0, 31, 20, 11, -4, 7])
    cl.rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots)
    # the C rotation may differ from the twin's by a fused multiply-add in fp32 (one ulp,
    # tests/kernels/test_cpu_layer_ops.py), so the codes are checked against the twin's write of
    # the keys the C kernel rotated
    ra.write_kv_cache(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_c
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("h,h_kv,d,bs", [(6, 2, 64, 16), (8, 8, 128, 16), (4, 1, 48, 8)])
def test_c_decode_matches_the_twin(bits, h, h_kv, d, bs):
    _, v, kc, vc, tables, ctx = _paged(bits, h_kv, d, bs, [0, 1, bs + 1, 3 * bs + 5, 200], 7)
    q = torch.randn(5, h, d, generator=torch.Generator().manual_seed(1))
    got = ca.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5)
    want = ra.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    # same codes read back; fp32 summation order and one fused multiply-add per value differ
    torch.testing.assert_close(got, want, atol=2e-6 * float(v.abs().max()), rtol=1e-5)


# --- Triton, through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_write_matches_twin_bit_for_bit(bits, key_dtype):
    pytest.importorskip("triton")
    from slimserve.kernels.kv_cache import write_kv_cache

    t, h_kv, d, blocks, bs = 21, 3, 32, 4, 16  # 3 KV heads: a masked head tile
    key = _rows(5, (t, h_kv, d), offset=1.0).to(key_dtype)
    value = _rows(6, (t, h_kv, d)).to(key_dtype)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(0))[:t]
    slots[[3, 10]] = torch.tensor([-1, -7])
    width = kq.row_bytes(d, bits)
    kc = torch.randint(0, 256, (blocks, bs, h_kv, width), dtype=torch.uint8)
    vc = torch.randint(0, 256, (blocks, bs, h_kv, width), dtype=torch.uint8)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_cache(key, value, kc, vc, slots)
    ra.write_kv_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_rope_write_matches_twin_bit_for_bit(bits, dtype):
    pytest.importorskip("triton")
    from slimserve.kernels.rope_kv_cache import rope_and_write_kv

    t, h, h_kv, d, bs, nb = 7, 6, 3, 32, 4, 10
    g = torch.Generator().manual_seed(bits)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = (torch.randn(t, h_kv, d, generator=g) * 3 + 1).to(dtype)
    v = torch.randn(t, h_kv, d, generator=g).to(dtype)
    cos, sin = torch.randn(t, d // 2, generator=g), torch.randn(t, d // 2, generator=g)
    width = kq.row_bytes(d, bits)
    kc = torch.zeros(nb, bs, h_kv, width, dtype=torch.uint8)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    slots = torch.tensor([3, 5, -1, 0, 39, 20, 11])
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots)
    ra.rope_and_write_kv(q2, k2, v2, cos, sin, kc2, vc2, slots)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_attention_matches_twin(bits, dtype):
    pytest.importorskip("triton")
    from slimserve.kernels import paged_attention as pa

    h, h_kv, d, bs = 6, 2, 32, 16
    _, v, kc, vc, tables, ctx = _paged(bits, h_kv, d, bs, [1, 17, 70], seed=bits + 1)
    tol = 2 * torch.finfo(dtype).eps * float(v.abs().max())
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, h, d, generator=g).to(dtype)
    want = ra.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5)
    for split in (False, True):
        cfg = pa.AttentionConfig(block_n=16, partition=32, split=split)
        got = pa.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5, config=cfg)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
    cu = torch.tensor([0, 1, 6, 26], dtype=torch.int32)  # a decode, a chunk after a prefix, more
    qq = torch.randn(26, h, d, generator=g).to(dtype)
    cfg = pa.AttentionConfig(block_m=16, block_n=16)
    got = pa.paged_attention_prefill(qq, kc, vc, tables, cu, ctx, d**-0.5, config=cfg)
    want = ra.paged_attention_prefill(qq, kc, vc, tables, cu, ctx, d**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
