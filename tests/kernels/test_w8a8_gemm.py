"""w8a8_gemm / linear_w8a8 vs reference.w8a8_matmul_int32, reference.w8a8_gemm, reference.linear_w8a8.

The int32 accumulators are compared exactly (integer arithmetic has one right answer). The
scaled outputs are compared with the twin's fp32 epilogue on the same int8 codes and scales;
the kernel does the same IEEE fp32 ops in the same order with FMA contraction off, so they
agree bit for bit in practice; the asserted bound is one ulp of the output dtype, the most a
different final rounding path (e.g. a contracted mul+add on another compiler) could cost.
"""

import pytest
import torch

from slimserve.kernels import reference
from slimserve.kernels import w8a8_gemm as wg
from slimserve.kernels._launch import MIN_K_TILES_PER_SPLIT, next_pow2

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Big tiles keep interpreter runs short (cost is per program and K step); the default table
# (config=None) is exercised on the int32 path.
BIG = wg.W8A8Config(64, 64, 128, group_m=2)
CONFIGS = [BIG, None]
SHAPES = [(1, 96, 200), (7, 130, 256), (33, 64, 1000)]  # (M, N, K): none a multiple of all tiles


def _operands(m, n, k, seed, scale_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    a_s = (torch.rand(m, 1, generator=g) + 0.5) * 2.0**-10  # typical activation scales
    w_s = (torch.rand(n, 1, generator=g) + 0.5) * 2.0**-9
    bias = torch.randn(n, generator=g)
    return (
        a.to(DEV),
        a_s.to(scale_dtype).to(DEV),
        w.to(DEV),
        w_s.to(scale_dtype).to(DEV),
        bias.to(scale_dtype).to(DEV),
    )


def _assert_within_one_ulp(out, ref):
    """|out - ref| <= one ulp of out's dtype at |ref| (ulp(r) = 2^floor(log2 r) * eps)."""
    fin = torch.finfo(ref.dtype)
    r = ref.float().abs().clamp_min(fin.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(r))) * fin.eps
    err = (out.float() - ref.float()).abs()
    assert (err <= ulp).all(), f"max error {(err / ulp).max().item():.2f} ulp"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "big" if c else "default")
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int32_accumulators_exact(m, n, k, cfg):
    a, a_s, w, w_s, _ = _operands(m, n, k, seed=m + n + k)
    out = wg.w8a8_gemm(a, a_s, w, w_s, out_dtype=torch.int32, config=cfg)
    assert out.dtype == torch.int32 and out.shape == (m, n)
    assert torch.equal(out, reference.w8a8_matmul_int32(a, w))


def test_int32_extreme_codes_exact():
    """All codes -128: every accumulator is K * 2^14 (16.8M at K = 1025), far from int32's limit
    but past fp32's 2^24 exact-integer range, so any float path would show."""
    k = 1025
    a = torch.full((3, k), -128, dtype=torch.int8, device=DEV)
    w = torch.full((70, k), -128, dtype=torch.int8, device=DEV)
    w[1::2] = 127
    ones = torch.ones(70, 1, device=DEV)
    out = wg.w8a8_gemm(a, ones[:3], w, ones, out_dtype=torch.int32, config=BIG)
    assert torch.equal(out, reference.w8a8_matmul_int32(a, w))
    assert out[0, 0].item() == k * 16384


@pytest.mark.parametrize("out_dtype", (torch.float16, torch.bfloat16, torch.float32))
@pytest.mark.parametrize("with_bias", (False, True))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_scaled_output_matches_fp32_epilogue(m, n, k, with_bias, out_dtype):
    a, a_s, w, w_s, bias = _operands(m, n, k, seed=7 * m + k, scale_dtype=out_dtype)
    b = bias if with_bias else None
    out = wg.w8a8_gemm(a, a_s, w, w_s, b, out_dtype, config=BIG)
    assert out.dtype == out_dtype and out.shape == (m, n)
    _assert_within_one_ulp(out, reference.w8a8_gemm(a, a_s, w, w_s, b, out_dtype))


def test_scale_layouts_and_fp32_scales():
    """w_scale as [N] instead of [N, 1], fp32 scales and bias, bf16 output."""
    a, a_s, w, w_s, bias = _operands(7, 130, 256, seed=11)
    out = wg.w8a8_gemm(a, a_s, w, w_s.view(-1), bias, torch.bfloat16, config=BIG)
    _assert_within_one_ulp(out, reference.w8a8_gemm(a, a_s, w, w_s, bias, torch.bfloat16))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_linear_w8a8_matches_reference(dtype):
    """Quantize-then-GEMM on [2, 7, K] activations; act_quant is bit-exact, so the same bound."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 7, 300, generator=g) * 3).to(dtype).to(DEV)
    _, _, w, w_s, bias = _operands(1, 130, 300, seed=5, scale_dtype=dtype)
    out = wg.linear_w8a8(x, w, w_s, bias, config=BIG)
    ref = reference.linear_w8a8(x, w, w_s, bias)
    assert out.shape == ref.shape == (2, 7, 130)
    _assert_within_one_ulp(out, ref)


def test_zero_sizes():
    a, a_s, w, w_s, bias = _operands(3, 20, 64, seed=1)
    assert wg.w8a8_gemm(a[:0], a_s[:0], w, w_s, config=BIG).shape == (0, 20)
    out = wg.w8a8_gemm(a[:, :0], a_s, w[:, :0], w_s, bias, torch.float16, config=BIG)
    assert torch.equal(out, bias.half().expand(3, 20))


def _call(**over):
    a, a_s, w, w_s, bias = _operands(4, 32, 64, seed=2)
    args = {
        "a_q": a,
        "a_scale": a_s,
        "w_q": w,
        "w_scale": w_s,
        "bias": None,
        "out_dtype": torch.bfloat16,
        "config": BIG,
    }
    args.update(over)
    return wg.w8a8_gemm(**args)


@pytest.mark.parametrize(
    "over,match",
    [
        (lambda: {"a_q": torch.zeros(4, 64, dtype=torch.int16)}, "a_q has dtype int16"),
        (lambda: {"w_q": torch.zeros(32, 48, dtype=torch.int8)}, r"w_q has shape \(32, 48\)"),
        (lambda: {"w_q": torch.zeros(64, 32, dtype=torch.int8).t()}, "w_q must be contiguous"),
        (lambda: {"a_scale": torch.ones(5, 1)}, r"a_scale has shape \(5, 1\)"),
        (lambda: {"w_scale": torch.ones(32, 2)}, r"w_scale has shape \(32, 2\)"),
        (lambda: {"w_scale": torch.ones(32, 1, dtype=torch.int32)}, "w_scale has dtype int32"),
        (lambda: {"bias": torch.ones(31)}, r"bias has shape \(31,\)"),
        (lambda: {"bias": torch.ones(32), "out_dtype": torch.int32}, "bias is not applied"),
        (lambda: {"out_dtype": torch.float64}, "out_dtype=torch.float64"),
        (lambda: {"config": wg.W8A8Config(64, 64, 16)}, "config.block_k=16"),
        (lambda: {"config": wg.W8A8Config(48, 64, 64)}, "config.block_m=48"),
    ],
)
def test_argument_errors(over, match):
    kw = {key: v.to(DEV) if isinstance(v, torch.Tensor) else v for key, v in over().items()}
    with pytest.raises(ValueError, match=match):
        _call(**kw)


def test_config_table():
    """CONFIGS is ordered by M bound, every row is a legal tile (powers of two, K tile >= 32 for
    the int8 dot) and the tile's M never exceeds the next power of two of its bound."""
    bounds = [bound for bound, _ in wg.CONFIGS]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 31
    for bound, cfg in wg.CONFIGS:
        wg._check_config(cfg)
        assert cfg.block_m <= next_pow2(bound)
    assert wg.default_config(1) is wg.CONFIGS[0][1]
    assert wg.default_config(4096) is wg.CONFIGS[-1][1]
    gemms = [v for v in wg.aot_variants() if v.kernel is wg._w8a8_gemm_kernel]
    tiles = {
        (v.constexprs["BLOCK_M"], v.constexprs["BLOCK_N"], v.constexprs["BLOCK_K"]) for v in gemms
    }
    assert tiles == {(c.block_m, c.block_n, c.block_k) for _, c in wg.CONFIGS}
    # the rows that may split compile their partial variant and the reduction its epilogues
    partial = {v.constexprs["BLOCK_M"] for v in gemms if v.constexprs["PARTIAL"]}
    assert partial == {c.block_m for _, c in wg.CONFIGS if c.split_k != 1}
    assert sum(v.kernel is wg._w8a8_splitk_reduce_kernel for v in wg.aot_variants()) == 4


SPLIT = wg.W8A8Config(16, 64, 32, group_m=1, split_k=3)  # forced split, slices of uneven length


@pytest.mark.parametrize(
    "out_dtype,with_bias", [(torch.int32, False), (torch.bfloat16, True), (torch.float32, False)]
)
@pytest.mark.parametrize("m,n,k", [(1, 96, 200), (5, 130, 256)])
def test_split_k_is_bit_identical_to_unsplit(m, n, k, out_dtype, with_bias):
    """int32 slices summed exactly, then the same epilogue: the split output equals the unsplit
    kernel's bit for bit (and the twin's accumulators exactly)."""
    a, a_s, w, w_s, bias = _operands(m, n, k, seed=3 * m + n, scale_dtype=torch.float32)
    b = bias if with_bias else None
    assert wg.split_k(SPLIT, m, n, k, torch.device(DEV))[0] == 3
    split = wg.w8a8_gemm(a, a_s, w, w_s, b, out_dtype, config=SPLIT)
    whole = wg.w8a8_gemm(a, a_s, w, w_s, b, out_dtype, config=wg.W8A8Config(16, 64, 32, group_m=1))
    assert torch.equal(split, whole)
    if out_dtype == torch.int32:
        assert torch.equal(split, reference.w8a8_matmul_int32(a, w))


def test_split_k_choice_fills_the_sms_at_small_m_only():
    dev = torch.device("cpu")  # num_sms: the H200's 132 when no GPU is visible
    small = wg.default_config(4)
    assert small.split_k == 0  # the decode row splits on its own
    n_split, per = wg.split_k(small, 4, 4096, 4096, dev)  # 64 tiles over 132 SMs
    assert n_split > 1 and per >= MIN_K_TILES_PER_SPLIT and n_split * per >= 4096 // 256
    assert wg.split_k(small, 4, 4096, 256, dev)[0] == 1  # one K step: nothing to split
    big = wg.default_config(4096)
    assert wg.split_k(big, 4096, 4096, 4096, dev)[0] == 1  # split_k 1: never
    # every slice holds at least one K step: no empty programs
    for k in (300, 1000, 14336):
        n_split, per = wg.split_k(SPLIT, 1, 64, k, dev)
        assert (n_split - 1) * per < -(-k // SPLIT.block_k) <= n_split * per
