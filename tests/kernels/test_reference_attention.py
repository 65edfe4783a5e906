"""The batched torch attention (the CPU serving path and the kernels' oracle) against the most
direct formulation: one sequence at a time, K/V gathered slot by slot, GQA by repeating heads."""

import pytest
import torch

from slimserve.kernels import reference_attention


def _naive(query, key_cache, value_cache, block_tables, cu, ctx, scale, k_scale, v_scale):
    out = torch.empty_like(query)
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    bs = key_cache.shape[1]
    for b in range(len(cu) - 1):
        q = query[cu[b] : cu[b + 1]].float()
        n, c = q.shape[0], ctx[b]
        slots = [(int(block_tables[b, p // bs]), p % bs) for p in range(c)]
        k = torch.stack([key_cache[blk, off].float() for blk, off in slots]) * k_scale
        v = torch.stack([value_cache[blk, off].float() for blk, off in slots]) * v_scale
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        for i in range(n):
            pos = c - n + i
            s = torch.einsum("hd,khd->hk", q[i], k[: pos + 1]) * scale
            out[cu[b] + i] = torch.einsum("hk,khd->hd", s.softmax(-1), v[: pos + 1]).to(query.dtype)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_batched_reference_equals_per_sequence_loop(kv_dtype):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs, nblocks = 6, 2, 16, 4, 40
    q_lens, ctx = [3, 1, 7, 1], [9, 1, 7, 14]  # prefix + chunk, lone token, no prefix, decode
    kc = torch.randn(nblocks, bs, kv_heads, d, generator=g).to(kv_dtype)
    vc = torch.randn(nblocks, bs, kv_heads, d, generator=g).to(kv_dtype)
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.stack([perm[i * 8 : (i + 1) * 8] for i in range(4)]).int()  # scattered blocks
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], heads, d, generator=g)
    ks, vs = (0.7, 1.3) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    got = reference_attention.paged_attention_prefill(
        query,
        kc,
        vc,
        tables,
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        0.25,
        ks,
        vs,
    )
    want = _naive(query, kc, vc, tables, cu, ctx, 0.25, ks, vs)
    # same fp32 math in a different summation order: a few ulp of fp32 on |out| <= max|V| ~ 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_planned_attention_buckets_and_fresh_keys_equal_the_loop():
    """More one-token rows than a bucket holds, in no order of context length, between chunks
    with and without a prefix; the CPU serving path's variant that attends a prefix-free chunk
    over the keys it has just written gives the same result as reading the cache."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs = 4, 2, 8, 4
    q_lens = [1, 5, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1, 1, 6, 1]
    prefix = [12, 0, 3, 30, 2, 7, 0, 19, 5, 1, 25, 9, 14, 0, 4]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    width = max(-(-c // bs) for c in ctx)
    nblocks = width * len(ctx)
    perm = torch.randperm(nblocks, generator=g)
    tables = perm.view(len(ctx), width).int()
    kc = torch.randn(nblocks, bs, kv_heads, d, generator=g)
    vc = torch.randn(nblocks, bs, kv_heads, d, generator=g)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], heads, d, generator=g)
    # this step's keys/values: what the cache holds at each sequence's new positions
    key = torch.empty(cu[-1], kv_heads, d)
    value = torch.empty_like(key)
    for b, (p, n) in enumerate(zip(prefix, q_lens)):
        for i in range(n):
            blk, off = int(tables[b, (p + i) // bs]), (p + i) % bs
            key[cu[b] + i], value[cu[b] + i] = kc[blk, off], vc[blk, off]
    cu_t, ctx_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
    plan = reference_attention.plan_attention(cu_t, ctx_t, tables, bs)
    assert len(plan.decode) == 2 and len(plan.prefill) == 3
    want = _naive(query, kc, vc, tables, cu, ctx, 0.3, 1.0, 1.0)
    cached = reference_attention.paged_attention(query, kc, vc, plan, 0.3)
    fresh = reference_attention.paged_attention(query, kc, vc, plan, 0.3, key=key, value=value)
    torch.testing.assert_close(cached, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)
    # an fp8 cache does not hold the keys exactly: the fresh keys are ignored there
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    torch.testing.assert_close(
        reference_attention.paged_attention(query, k8, v8, plan, 0.3, key=key, value=value),
        _naive(query, k8, v8, tables, cu, ctx, 0.3, 1.0, 1.0),
        rtol=1e-5,
        atol=1e-5,
    )
