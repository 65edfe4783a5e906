"""Paged decode / chunked-prefill attention kernels vs their fp32 torch twins.

Tolerance: each output is a convex combination of (dequantized) V rows, so the reference is
bounded by max|V|. The kernel differs from the fp32 twin by (1) rounding P to the KV dtype before
P @ V: relative error <= u = eps/2 on each weight, at most u * max|V| on the output; (2) rounding
the output to its dtype: <= u * max|V|; (3) fp32 scores summed in another order: ~D * 2^-24
relative on scores of a few units, 1e-5 on the weights, negligible. Total <= eps * max|V|;
the tests allow 2 * eps * max|V| (bf16: eps 2^-7, fp16: 2^-10), where a wrong mask, a wrong block
or a missed tile moves outputs by O(max|V| / context) >> that.
"""

import pytest
import torch

from slimserve.kernels import reference_attention
from slimserve.kernels.paged_attention import (
    AttentionConfig,
    paged_attention_decode,
    paged_attention_prefill,
    use_split,
)

FP8 = torch.float8_e4m3fn
pytest.importorskip("triton")
DTYPES = [
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, FP8),
    (torch.bfloat16, FP8),
]
GQA = [(4, 4), (6, 2), (8, 2)]  # (H, Hkv): ratios 1, 3, 4
K_SCALE, V_SCALE = torch.tensor([0.25]), 0.5  # fp8 scales: a tensor and a float
# Big tiles: the interpreter pays per program and per loop step.
DECODE = AttentionConfig(block_n=64, partition=64)


def _cache(ctx, h_kv, d, bs, kv_dtype, seed):
    """Random caches whose blocks are a random permutation of physical ids (plus spare blocks)
    and the block tables pointing at them. fp8 codes spread over +-16 (scaled: +-4 and +-8)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(1, max(-(-c // bs) for c in ctx))
    n_blocks = len(ctx) * per_seq + 3
    tables = torch.randperm(n_blocks, generator=g)[: len(ctx) * per_seq].view(len(ctx), per_seq)
    k = torch.randn(n_blocks, bs, h_kv, d, generator=g) * (4 if kv_dtype == FP8 else 1)
    v = torch.randn(n_blocks, bs, h_kv, d, generator=g) * (4 if kv_dtype == FP8 else 1)
    return k.to(kv_dtype), v.to(kv_dtype), tables.int(), torch.tensor(ctx, dtype=torch.int32)


def _assert_close(out, ref, v_cache):
    vmax = v_cache.float().abs().max() * (V_SCALE if v_cache.dtype == FP8 else 1)
    tol = 2 * torch.finfo(out.dtype).eps * float(vmax)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_decode_matches_twin(dtypes, gqa):
    (q_dtype, kv_dtype), (h, h_kv) = dtypes, gqa
    kc, vc, tables, ctx = _cache([1, 17, 100], h_kv, 32, 16, kv_dtype, seed=h * 10 + h_kv)
    q = torch.randn(3, h, 32, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    out = paged_attention_decode(
        q,
        kc,
        vc,
        tables,
        ctx,
        0.2,
        K_SCALE,
        V_SCALE,
        config=AttentionConfig(block_n=64, split=False),
    )
    _assert_close(
        out,
        reference_attention.paged_attention_decode(q, kc, vc, tables, ctx, 0.2, K_SCALE, V_SCALE),
        vc,
    )


@pytest.mark.parametrize("dtypes", DTYPES)
def test_split_decode_matches_twin(dtypes):
    """Flash-decoding: 64-token partitions, so contexts 1, 65 and 150 use 1, 2 and 3 splits of the
    grid's 3 (the block table's capacity) and a context of 0 uses none (output 0)."""
    q_dtype, kv_dtype = dtypes
    kc, vc, tables, ctx = _cache([1, 65, 150, 0], 2, 64, 16, kv_dtype, seed=3)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    cfg = AttentionConfig(block_n=32, partition=64, split=True)
    out = paged_attention_decode(q, kc, vc, tables, ctx, 0.125, K_SCALE, V_SCALE, config=cfg)
    ref = reference_attention.paged_attention_decode(
        q, kc, vc, tables, ctx, 0.125, K_SCALE, V_SCALE
    )
    _assert_close(out[:3], ref[:3], vc)  # the twin leaves context 0 undefined (a padding row)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_other_block_sizes_and_strided_query(block_size):
    kc, vc, tables, ctx = _cache([33, 7], 2, 32, block_size, torch.float16, seed=block_size)
    qkv = torch.randn(2, 3, 8, 32, generator=torch.Generator().manual_seed(5)).half()
    q = qkv[:, 0]  # [B, H, D] view of a fused projection: batch stride 3 * H * D
    for split in (False, True):
        out = paged_attention_decode(
            q,
            kc,
            vc,
            tables,
            ctx,
            0.3,
            max_context_len=33,
            config=AttentionConfig(block_n=32, partition=32, split=split),
        )
        _assert_close(
            out, reference_attention.paged_attention_decode(q, kc, vc, tables, ctx, 0.3), vc
        )


def test_split_heuristic():
    cfg, cpu = AttentionConfig(), torch.device("cpu")  # CPU counts as 132 SMs
    assert use_split(1, 8, 8192, cfg, cpu)  # 8 programs: split 16 ways
    assert not use_split(256, 8, 8192, cfg, cpu)  # 2048 programs fill the GPU
    assert not use_split(1, 8, 512, cfg, cpu)  # one partition: nothing to split
    assert not use_split(1, 8, 8192, AttentionConfig(split=False), cpu)


def _prefill_case(ctx, q_lens, h, h_kv, q_dtype, kv_dtype, seed, bs=16, d=32):
    kc, vc, tables, ctx_t = _cache(ctx, h_kv, d, bs, kv_dtype, seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(q_dtype), kc, vc, tables, cu, ctx_t


@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_prefill_matches_twin(dtypes, gqa):
    """Sequences: 33 cached + 7 new (several query tiles and unmasked full KV tiles before the
    diagonal), 5 new with no cached prefix, 1 new after 39 cached, and one with no new tokens."""
    (q_dtype, kv_dtype), (h, h_kv) = dtypes, gqa
    q, kc, vc, tables, cu, ctx = _prefill_case(
        [40, 5, 40, 9], [7, 5, 1, 0], h, h_kv, q_dtype, kv_dtype, seed=h + h_kv
    )
    cfg = AttentionConfig(block_m=16, block_n=16)  # 16 // G query tokens per program
    out = paged_attention_prefill(
        q, kc, vc, tables, cu, ctx, 0.2, K_SCALE, V_SCALE, config=cfg, max_q_len=7
    )
    ref = reference_attention.paged_attention_prefill(
        q, kc, vc, tables, cu, ctx, 0.2, K_SCALE, V_SCALE
    )
    _assert_close(out, ref, vc)


def test_prefill_long_chunk_default_grid_and_strided_query():
    """One 50-token chunk after 30 cached tokens with block size 8, max_q_len left to the launcher
    (T: no sync), query a view of a fused projection."""
    q, kc, vc, tables, cu, ctx = _prefill_case(
        [80, 3], [50, 3], 4, 2, torch.float16, torch.float16, seed=7, bs=8, d=64
    )
    q = torch.cat([q, q], dim=-1)[..., :64]  # row stride 2 * H * D, last dim contiguous
    cfg = AttentionConfig(block_m=32, block_n=32)
    out = paged_attention_prefill(q, kc, vc, tables, cu, ctx, 0.125, config=cfg)
    _assert_close(
        out, reference_attention.paged_attention_prefill(q, kc, vc, tables, cu, ctx, 0.125), vc
    )


def _decode_args(**over):
    kc, vc, tables, ctx = _cache([5, 9], 2, 32, 16, torch.float16, seed=0)
    args = dict(
        query=torch.randn(2, 4, 32, dtype=torch.float16),
        key_cache=kc,
        value_cache=vc,
        block_tables=tables,
        context_lens=ctx,
        scale=0.2,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "name,over",
    [
        ("query", dict(query=torch.randn(2, 4, 32))),
        ("query", dict(query=torch.randn(2, 3, 32, dtype=torch.float16))),  # 3 heads, 2 KV heads
        ("key_cache", dict(query=torch.randn(2, 4, 32, dtype=torch.bfloat16))),  # bf16 q, fp16 KV
        ("value_cache", dict(value_cache=torch.zeros(3, 16, 2, 32, dtype=FP8))),
        (
            "head_dim",
            dict(
                query=torch.randn(2, 4, 48, dtype=torch.float16),
                key_cache=torch.zeros(3, 16, 2, 48, dtype=torch.float16),
                value_cache=torch.zeros(3, 16, 2, 48, dtype=torch.float16),
            ),
        ),
        ("block_tables", dict(block_tables=torch.zeros(2, 1, dtype=torch.int64))),
        ("block_tables", dict(block_tables=torch.zeros(3, 1, dtype=torch.int32))),
        ("context_lens", dict(context_lens=torch.tensor([5], dtype=torch.int32))),
        ("k_scale", dict(k_scale=torch.ones(1, dtype=torch.int32))),
        ("partition", dict(config=AttentionConfig(block_n=64, partition=96))),
        ("block_n", dict(config=AttentionConfig(block_n=24))),
    ],
)
def test_decode_errors_name_the_argument(name, over):
    with pytest.raises(ValueError, match=name):
        paged_attention_decode(**_decode_args(**over))


@pytest.mark.parametrize(
    "name,over",
    [
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2, 4]))),  # int64
        (
            "block_tables",
            dict(cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32)),
        ),  # 1 seq, 2 rows
        # 32 query heads per KV head do not fit 16 rows
        ("block_m", dict(config=AttentionConfig(block_m=16), query=torch.randn(4, 64, 32).half())),
        ("max_q_len", dict(max_q_len=-1)),
    ],
)
def test_prefill_errors_name_the_argument(name, over):
    args = _decode_args()
    args.update(
        query=torch.randn(4, 4, 32, dtype=torch.float16),
        cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
    )
    args.update(over)
    with pytest.raises(ValueError, match=name):
        paged_attention_prefill(**args)
