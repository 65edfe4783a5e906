"""write_kv_cache kernel vs its torch twin: bit for bit, fp8 rounding boundaries included."""

import pytest
import torch

from slimserve.kernels import reference_attention
from slimserve.kernels.kv_cache import write_kv_cache

FP8 = torch.float8_e4m3fn
pytest.importorskip("triton")


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """Raw bits, so fp8 NaN/-0.0 codes and untouched slots compare exactly."""
    return cache.view(torch.uint8 if cache.dtype == FP8 else torch.int16)


def _run_both(key, value, kc, vc, slots, ks, vs):
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_cache(key, value, kc, vc, slots, ks, vs)
    reference_attention.write_kv_cache(key, value, kc2, vc2, slots, ks, vs)
    assert torch.equal(_bits(kc), _bits(kc2))
    assert torch.equal(_bits(vc), _bits(vc2))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_matches_twin_bit_for_bit(key_dtype, cache_dtype):
    torch.manual_seed(0)
    t, hkv, d, blocks, bs = 37, 3, 32, 6, 16  # 3 KV heads: a masked head tile
    # Rows from 1e-4 to 1e3 in magnitude: fp8 subnormals, normals and saturation at 448.
    mag = torch.logspace(-4, 3, t)[:, None, None]
    key = (torch.randn(t, hkv, d) * mag).to(key_dtype)
    value = (torch.randn(t, hkv, d) * mag.flip(0)).to(key_dtype)
    slots = torch.randperm(blocks * bs)[:t]  # scattered slots in scattered blocks
    slots[[3, 10]] = torch.tensor([-1, -7])  # padding tokens: skipped
    kc = torch.randn(blocks, bs, hkv, d).to(cache_dtype)
    vc = torch.randn(blocks, bs, hkv, d).to(cache_dtype)
    _run_both(key, value, kc, vc, slots, torch.tensor([0.37]), 0.9)  # tensor and float scales


def test_fp8_rounding_boundaries():
    """Every fp8 value, every midpoint between neighbours (ties to even), one fp32 ulp on either
    side of each midpoint, values past 448, +-inf, NaN and -0.0: exactly torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[codes.isfinite()].unique()  # sorted, -448 .. 448
    mid = (finite[1:] + finite[:-1]) / 2
    ulp = torch.nextafter(mid, torch.tensor(float("inf"))) - mid
    extra = torch.tensor([449.0, 464.0, 465.0, 1e6, float("inf"), float("nan"), -0.0, 2e-45])
    vals = torch.cat([finite, mid, mid + ulp, mid - ulp, extra, -extra])
    d = 64
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % d)]).view(-1, 1, d)
    t = vals.shape[0]
    kc = torch.zeros(t, 1, 1, d, dtype=FP8)
    vc = torch.zeros(t, 1, 1, d, dtype=FP8)
    _run_both(vals, vals * 3, kc, vc, torch.arange(t), 1.0, torch.tensor([3.0]))


def test_strided_key_and_padded_cache():
    """key/value as column slices of a fused qkv projection; caches as slices of a bigger one."""
    torch.manual_seed(1)
    t, hkv, d = 9, 2, 64
    qkv = torch.randn(t, 5 * hkv * d, dtype=torch.bfloat16)
    key = qkv[:, 3 * hkv * d : 4 * hkv * d].view(t, hkv, d)
    value = qkv[:, 4 * hkv * d :].view(t, hkv, d)
    both = torch.randn(4, 2, 8, hkv, d).to(FP8)  # [blocks, k/v, block_size, Hkv, D]
    _run_both(key, value, both[:, 0], both[:, 1], torch.randperm(32)[:t], 0.05, 0.02)


def test_empty_batch_is_a_no_op():
    kc = torch.randn(2, 16, 2, 32, dtype=torch.float16)
    before = kc.clone()
    empty = torch.empty(0, 2, 32, dtype=torch.float16)
    write_kv_cache(empty, empty, kc, kc.clone(), torch.empty(0, dtype=torch.int64))
    assert torch.equal(kc, before)


def _args(**over):
    args = dict(
        key=torch.randn(3, 2, 32, dtype=torch.float16),
        value=torch.randn(3, 2, 32, dtype=torch.float16),
        key_cache=torch.zeros(2, 16, 2, 32, dtype=FP8),
        value_cache=torch.zeros(2, 16, 2, 32, dtype=FP8),
        slot_mapping=torch.arange(3),
        k_scale=1.0,
        v_scale=1.0,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "name,over",
    [
        ("slot_mapping", dict(slot_mapping=torch.arange(3, dtype=torch.int32))),
        ("slot_mapping", dict(slot_mapping=torch.arange(4))),
        ("value", dict(value=torch.randn(3, 2, 16, dtype=torch.float16))),
        ("key_cache", dict(key_cache=torch.zeros(2, 16, 4, 32, dtype=FP8))),
        ("key_cache", dict(key_cache=torch.zeros(2, 16, 2, 32, dtype=torch.float32))),
        ("value_cache", dict(value_cache=torch.zeros(2, 16, 2, 32, dtype=torch.float16))),
        ("k_scale", dict(k_scale=torch.ones(2))),
        ("v_scale", dict(v_scale=-1.0)),
        ("key", dict(key=torch.randn(3, 2, 32, dtype=torch.float16).transpose(0, 2))),
    ],
)
def test_launcher_errors_name_the_argument(name, over):
    with pytest.raises(ValueError, match=name):
        write_kv_cache(**_args(**over))
