"""Fused RoPE + KV-cache write kernel vs its torch twin (bit for bit), and the twin vs the unfused
eager path it replaced (transformers' rotate_half in fp32 on full cos/sin tables, then
write_kv_cache): bit for bit too, fp8 caches and padding slots included."""

import pytest
import torch

from slimserve.kernels import reference_attention
from slimserve.kernels.rope_kv_cache import rope_and_write_kv

FP8 = torch.float8_e4m3fn
pytest.importorskip("triton")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.dtype == FP8
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def _unfused(q, k, v, positions, inv_freq, kc, vc, slots, ks, vs):
    """The eager path before fusion (runtime/models/llama.py `_rotate` + write_kv_cache)."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = emb.cos(), emb.sin()

    def rotate(x):
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    q, k = rotate(q), rotate(k)
    reference_attention.write_kv_cache(k, v, kc, vc, slots, ks, vs)
    return q, k


def _case(dtype, cache_dtype, t=11, h=4, hkv=2, d=32, blocks=4, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a fused qkv projection's output: q, k, v are strided views of it
    qkv = (torch.randn(t, (h + 2 * hkv) * d, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 4000, (t,), generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    slots[[2, t - 1]] = -1  # padding rows: rotated, never written
    kc = torch.randn(blocks, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(blocks, bs, hkv, d, generator=g).to(cache_dtype)
    return qkv, positions, inv_freq, slots, kc, vc, (h, hkv, d)


def _split(qkv, h, hkv, d):
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(t, h, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, FP8),
        (torch.bfloat16, FP8),
        (torch.float32, torch.bfloat16),
        (torch.float32, FP8),
    ],
)
def test_kernel_matches_twin_and_unfused_path_bit_for_bit(dtype, cache_dtype):
    qkv, pos, inv_freq, slots, kc, vc, (h, hkv, d) = _case(dtype, cache_dtype)
    ks, vs = (torch.tensor([0.05]), torch.tensor([0.02])) if cache_dtype == FP8 else (1.0, 1.0)
    cos, sin = reference_attention.rope_tables(pos, inv_freq)

    got_qkv, got_kc, got_vc = qkv.clone(), kc.clone(), vc.clone()
    rope_and_write_kv(*_split(got_qkv, h, hkv, d), cos, sin, got_kc, got_vc, slots, ks, vs)

    twin_qkv, twin_kc, twin_vc = qkv.clone(), kc.clone(), vc.clone()
    reference_attention.rope_and_write_kv(
        *_split(twin_qkv, h, hkv, d), cos, sin, twin_kc, twin_vc, slots, ks, vs
    )

    old_kc, old_vc = kc.clone(), vc.clone()
    q0, k0, v0 = _split(qkv, h, hkv, d)
    old_q, old_k = _unfused(q0, k0, v0, pos, inv_freq, old_kc, old_vc, slots, ks, vs)

    for a, b in ((got_qkv, twin_qkv), (got_kc, twin_kc), (got_vc, twin_vc)):
        assert torch.equal(_bits(a), _bits(b))
    tq, tk, tv = _split(twin_qkv, h, hkv, d)
    assert torch.equal(_bits(tq.contiguous()), _bits(old_q))
    assert torch.equal(_bits(tk.contiguous()), _bits(old_k))
    assert torch.equal(_bits(tv.contiguous()), _bits(v0.contiguous()))  # v is not rotated
    assert torch.equal(_bits(twin_kc), _bits(old_kc)) and torch.equal(_bits(twin_vc), _bits(old_vc))
    # padding rows' slots were not written: the cache differs from the input only at real slots
    real = slots[slots >= 0]
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    untouched[real] = False

    def flat(c):
        return _bits(c).reshape(-1, *c.shape[2:])

    assert torch.equal(flat(got_kc)[untouched], flat(kc)[untouched])


def test_odd_head_counts_and_empty_batch():
    qkv, pos, inv_freq, slots, kc, vc, (h, hkv, d) = _case(
        torch.bfloat16, torch.bfloat16, t=5, h=6, hkv=3, d=16, seed=3
    )
    cos, sin = reference_attention.rope_tables(pos, inv_freq)
    a, b = qkv.clone(), qkv.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    rope_and_write_kv(*_split(a, h, hkv, d), cos, sin, kc, vc, slots)
    reference_attention.rope_and_write_kv(*_split(b, h, hkv, d), cos, sin, kc2, vc2, slots)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(kc), _bits(kc2))
    empty = qkv[:0]
    before = kc.clone()
    rope_and_write_kv(*_split(empty, h, hkv, d), cos[:0], sin[:0], kc, vc, slots[:0])
    assert torch.equal(_bits(kc), _bits(before))


def test_bad_arguments_are_named():
    qkv, pos, inv_freq, slots, kc, vc, (h, hkv, d) = _case(torch.float16, torch.float16)
    q, k, v = _split(qkv, h, hkv, d)
    cos, sin = reference_attention.rope_tables(pos, inv_freq)
    with pytest.raises(ValueError, match="cos"):
        rope_and_write_kv(q, k, v, cos.half(), sin, kc, vc, slots)
    with pytest.raises(ValueError, match="key has dtype"):
        rope_and_write_kv(q, k.float(), v, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots.int())
