"""The compiled CPU decode attention (kernels/cpu_attention.c) against its torch twin
(`reference_attention.paged_attention_decode`): every cache dtype it reads, GQA ratios, the
specialised and the generic head sizes, short and empty contexts, scattered blocks; its refusal
of out-of-range tables. The build itself: tests/kernels/test_cpu_build.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from slimserve.kernels import cpu_attention as ca
from slimserve.kernels import reference_attention as ra

needs_kernel = pytest.mark.skipif(
    not ca.available(), reason=f"no CPU kernel: {ca.unavailable_reason()}"
)


def test_builds_wherever_a_compiler_exists():
    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert ca.available(), ca.unavailable_reason()


def _case(dtype, h, h_kv, d, bs, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // bs) for n in lens) + 5
    kc = torch.randn(blocks, bs, h_kv, d, generator=g)
    vc = torch.randn(blocks, bs, h_kv, d, generator=g)
    if dtype == torch.float8_e4m3fn:
        kc, vc = ra.quantize_fp8(kc, 0.5), ra.quantize_fp8(vc, 0.25)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    width = max(1, max(-(-n // bs) for n in lens))
    perm = torch.randperm(blocks, generator=g).tolist()  # scattered, as a busy cache's are
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for r, n in enumerate(lens):
        k = -(-n // bs)
        tables[r, :k] = torch.tensor(perm[at : at + k], dtype=torch.int32)
        at += k
    q = torch.randn(len(lens), h, d, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "h,h_kv,d,bs", [(6, 2, 64, 16), (8, 8, 128, 16), (9, 3, 64, 4), (4, 1, 48, 8), (8, 2, 80, 32)]
)
def test_matches_the_torch_twin(dtype, h, h_kv, d, bs):
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 200]
    q, kc, vc, tables, ctx = _case(dtype, h, h_kv, d, bs, lens)
    ks, vs = (0.5, 0.25) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    got = ca.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5, ks, vs)
    want = ra.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5, ks, vs)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # both accumulate in fp32 over the same values; only summation order differs
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    "h,h_kv,d,bs",
    [
        (6, 2, 64, 16),
        (8, 8, 128, 16),
        (9, 3, 64, 32),
        (4, 1, 128, 64),
        (9, 3, 64, 4),
        (16, 2, 64, 16),
        (14, 2, 128, 16),
        (20, 2, 64, 16),
    ],
)
def test_bf16_queries_on_a_bf16_cache_match_the_twin(h, h_kv, d, bs):
    """A bf16 query over a bf16 cache takes the kernel's tiled path on CPUs with AVX512-BF16
    (keys transposed by bf16 pairs, 16 at a time, partial tiles and blocks of 32 or 64 included;
    the values widened in registers into G x chunk accumulators, in one pass of D or in passes
    of 4 or 2 chunks for 4 to 8 heads a group; 10 heads a group take the converted-rows loop):
    each value is within the bf16 rounding of the twin's fp32 result."""
    lens = [1, 15, 16, 17, bs + 1, 3 * bs + 5, 200]
    q, kc, vc, tables, ctx = _case(torch.bfloat16, h, h_kv, d, bs, lens)
    qb = q.to(torch.bfloat16)
    got = ca.paged_attention_decode(qb, kc, vc, tables, ctx, d**-0.5)
    want = ra.paged_attention_decode(qb.float(), kc, vc, tables, ctx, d**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h,h_kv,d,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (6, 2, 64, 64)])
def test_many_sequences_copy_their_blocks_first(dtype, threads, h, h_kv, d, bs):
    """With at least 4 sequences a thread, a task is a whole sequence, and its cache blocks are
    copied out together before the tiles read them (`gather_blocks`; an fp8 cache's codes as
    their bf16 values, `gather_fp8_as_bf16`): the result is the twin's within bf16 rounding, at
    one and two threads, whatever the block size."""
    lens = [1, 15, 16, 17, bs + 1, 3 * bs + 5, 200, 33, 64, 129]
    q, kc, vc, tables, ctx = _case(dtype, h, h_kv, d, bs, lens, seed=3)
    ks, vs = (0.5, 0.25) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    qb = q.to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ca.paged_attention_decode(qb, kc, vc, tables, ctx, d**-0.5, ks, vs)
    finally:
        torch.set_num_threads(before)
    want = ra.paged_attention_decode(qb.float(), kc, vc, tables, ctx, d**-0.5, ks, vs)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)


@needs_kernel
def test_every_fp8_code_is_read_as_its_value():
    """Keys and values that hold every finite float8_e4m3fn code (subnormals, zeros of both
    signs, the largest +-448) through the whole-sequence path of a bf16 query: as the twin
    reads them. A NaN code gives NaN, as in the twin."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    bs, h_kv, d, n = 16, 1, 64, 8
    blocks = -(-vals.numel() // d) + 1
    flat = torch.zeros(blocks * d)
    flat[: vals.numel()] = vals
    rows = flat.view(blocks, d)  # every code in some row; rows spread over tokens of 1 block each
    kc = torch.zeros(n, bs, h_kv, d)
    for i in range(n):
        kc[i, : min(bs, blocks), 0] = rows[: min(bs, blocks)].roll(i, 0)
    kc8 = kc.to(torch.float8_e4m3fn)
    vc8 = kc.flip(-1).to(torch.float8_e4m3fn)
    tables = torch.arange(n, dtype=torch.int32).view(n, 1)
    ctx = torch.full((n,), bs, dtype=torch.int32)
    q = (torch.randn(n, 4, d, generator=torch.Generator().manual_seed(1)) / 64).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = ca.paged_attention_decode(q, kc8, vc8, tables, ctx, d**-0.5, 0.5, 0.25)
        kn = kc8.clone()
        kn.view(torch.uint8)[0, 0, 0, 0] = 0x7F
        nan = ca.paged_attention_decode(q, kn, vc8, tables, ctx, d**-0.5, 0.5, 0.25)
    finally:
        torch.set_num_threads(before)
    want = ra.paged_attention_decode(q.float(), kc8, vc8, tables, ctx, d**-0.5, 0.5, 0.25)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)
    assert nan[0].isnan().all() and not nan[1:].isnan().any()


@needs_kernel
def test_query_dtype_kept_and_scale_tensors_taken():
    q, kc, vc, tables, ctx = _case(torch.bfloat16, 6, 2, 64, 16, [7, 40])
    qb = q.to(torch.bfloat16)
    got = ca.paged_attention_decode(
        qb, kc, vc, tables, ctx, 0.125, torch.tensor(1.0), torch.tensor([1.0])
    )
    want = ra.paged_attention_decode(qb, kc, vc, tables, ctx, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)


@needs_kernel
def test_empty_context_gives_zeros_and_no_rows_give_an_empty_result():
    q, kc, vc, tables, ctx = _case(torch.float32, 6, 2, 64, 16, [0, 5])
    got = ca.paged_attention_decode(q, kc, vc, tables, ctx, 0.125)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and got[1].abs().sum() > 0
    none = ca.paged_attention_decode(q[:0], kc, vc, tables[:0], ctx[:0], 0.125)
    assert none.shape == (0, 6, 64)


@needs_kernel
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t, c: (t.fill_(10_000), c), "outside"),  # a block id past the cache
        (lambda t, c: (t, c.fill_(10_000)), "outside"),  # a context longer than its table
        (lambda t, c: (t.fill_(-1), c), "outside"),
        (lambda t, c: (t[:1], c), "block tables"),
    ],
)
def test_refuses_tables_outside_the_cache(mutate, match):
    q, kc, vc, tables, ctx = _case(torch.float32, 6, 2, 64, 16, [20, 5])
    tables, ctx = mutate(tables.clone(), ctx.clone())
    with pytest.raises(ValueError, match=match):
        ca.paged_attention_decode(q, kc, vc, tables, ctx, 0.125)


@needs_kernel
def test_refuses_caches_it_does_not_read():
    q, kc, vc, tables, ctx = _case(torch.float32, 6, 2, 64, 16, [5])
    assert not ca.supports(torch.float16)
    with pytest.raises(ValueError, match="float16"):
        ca.paged_attention_decode(q, kc.half(), vc.half(), tables, ctx, 0.125)
