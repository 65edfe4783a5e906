"""w4a16_gemm kernels vs their twins in kernels/reference.py.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets it), with big tiles
and small shapes; on a CUDA machine the same tests run the compiled kernels.

Tolerance (`_assert_close`): the kernel multiplies exactly the weight the twin builds (fp32
dequantization is exact, then one rounding to x's dtype: `test_dequantize_is_bit_exact`), so it
differs from an fp32 reference on the same rounded inputs only by
  * the order of the fp32 sums (tiles, split-K partials): |err| <= K * 2^-24 * sum_k |x||w|
    for the kernel and again for the reference, hence the factor 2;
  * the single rounding of the output to x's dtype: <= u * |y|, u = 2^-8 (bf16), 2^-11 (fp16);
  * plus 2^-24 absolute for fp16 subnormals.
"""

import pytest
import torch

from slimserve.kernels import reference
from slimserve.kernels.w4a16_gemm import (
    DISPATCH,
    W4A16Config,
    _split_k,
    aot_variants,
    dequantize_w4a16,
    prepare_w4a16,
    select_config,
    w4a16_gemm,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F16, BF16 = torch.float16, torch.bfloat16

# Forced configs, one per dispatch path; large tiles keep the interpreter at a few programs.
PATHS = {
    "decode": W4A16Config("gemm", 16, 128, 128, split_k=2),  # split-K + reduction pass
    "tiled": W4A16Config("gemm", 64, 256, 128, split_k=1),  # direct epilogue
    "dequant": W4A16Config("dequant", 0, 256, 128),  # dequantize + torch matmul
}

# (x shape, N, K, group_size (None: per channel), bits, asym, actorder, dtype, bias)
#   actorder: None; "regular" (GPTQ: a permutation of k // g); "irregular" (any group per
#   column: scales gathered per element); "identity" (g_idx = k // g, dropped at load).
CASES = [
    ((1, 256), 96, 256, 32, 4, False, None, F16, False),
    ((1, 7, 320), 200, 320, 64, 4, True, None, BF16, True),  # K, N not tile multiples
    ((3, 11, 384), 130, 384, 128, 4, True, "regular", F16, True),  # M = 33
    ((1, 203), 64, 203, None, 4, False, None, BF16, True),  # per channel, K % 8 != 0
    ((7, 256), 72, 256, 64, 4, False, "irregular", BF16, False),
    ((33, 192), 100, 192, 32, 8, True, None, F16, True),  # W8A16
    ((1, 512), 256, 512, 128, 8, False, "regular", BF16, False),
    ((7, 96), 48, 96, 24, 4, True, "identity", F16, False),  # group not a multiple of 16
]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [R, C] -> CT int32 [R, ceil(C*bits/32)], offset binary, low index low bits."""
    per = 32 // bits
    fields = torch.zeros(codes.shape[0], -(-codes.shape[1] // per) * per, dtype=torch.int64)
    fields[:, : codes.shape[1]] = codes.long() + (1 << (bits - 1))
    words = (fields.reshape(codes.shape[0], -1, per) << (torch.arange(per) * bits)).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _make_ct(n, k, group_size, bits, asym, actorder, dtype, seed=0) -> dict:
    """Random CT pack-quantized tensors: full-range codes and zero points, scales ~ 2^-6."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    groups = 1 if group_size is None else -(-k // group_size)
    g_idx = None
    if actorder == "irregular":
        g_idx = torch.randint(0, groups, (k,), generator=g, dtype=torch.int32)
    elif actorder is not None:
        g_idx = (torch.arange(k) // group_size).to(torch.int32)
        if actorder == "regular":
            g_idx = g_idx[torch.randperm(k, generator=g)]
    zp = None
    if asym:
        zp = _pack(torch.randint(lo, hi, (groups, n), generator=g), bits).t().contiguous()
    ct = dict(
        weight_packed=_pack(torch.randint(lo, hi, (n, k), generator=g), bits),
        weight_scale=((torch.rand(n, groups, generator=g) + 0.5) / 64).to(dtype),
        weight_zero_point=zp,
        weight_g_idx=g_idx,
        weight_shape=(n, k),
        group_size=group_size,
    )
    return {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for key, v in ct.items()}


def _dequant_ref(ct: dict, bits: int) -> torch.Tensor:
    return reference.dequantize_packed(
        ct["weight_packed"],
        ct["weight_scale"],
        ct["weight_zero_point"],
        ct["weight_g_idx"],
        ct["weight_shape"],
        bits,
        ct["group_size"],
    )


def _assert_close(y, x, w, bias):
    """y vs the fp32 product of the same rounded x [.., K] and w [N, K] (module docstring)."""
    xf = x.float().reshape(-1, x.shape[-1])
    ref = xf @ w.float().t() + (bias.float() if bias is not None else 0.0)
    u = 2.0**-8 if x.dtype == BF16 else 2.0**-11
    bound = u * ref.abs() + 2 * x.shape[-1] * 2.0**-24 * (xf.abs() @ w.float().abs().t())
    err = (y.float().reshape(ref.shape) - ref).abs()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert bool((err <= bound + 2.0**-24).all()), f"err {err.max():.3g} > bound {bound.max():.3g}"


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"x{c[0]}-n{c[1]}-g{c[3]}-w{c[4]}-{c[6]}")
def test_paths_match_reference(triton_backend, path, case):
    shape, n, k, group_size, bits, asym, actorder, dtype, has_bias = case
    ct = _make_ct(n, k, group_size, bits, asym, actorder, dtype)
    torch.manual_seed(1)
    x = torch.randn(shape, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if has_bias else None
    w = prepare_w4a16(**ct, num_bits=bits)
    assert (w.perm is not None) == (actorder in ("regular", "irregular"))
    assert (w.group_idx is not None) == (actorder == "irregular" or group_size == 24)
    y = w4a16_gemm(x, w, bias, config=PATHS[path])
    _assert_close(y, x, _dequant_ref(ct, bits).to(dtype), bias)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4], CASES[5]], ids=str)
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_dequantize_is_bit_exact(triton_backend, case, dtype):
    _, n, k, group_size, bits, asym, actorder, sdtype, _ = case
    ct = _make_ct(n, k, group_size, bits, asym, actorder, sdtype, seed=2)
    w = prepare_w4a16(**ct, num_bits=bits)
    got = dequantize_w4a16(w, dtype, config=PATHS["dequant"])
    assert torch.equal(got, _dequant_ref(ct, bits).to(dtype))


def test_per_tensor_scale_and_plain_transpose(triton_backend):
    ct = _make_ct(40, 136, None, 4, False, None, BF16, seed=4)
    ct["weight_scale"] = ct["weight_scale"][:1, 0]  # CT's per-tensor scale: shape [1]
    w = prepare_w4a16(**ct)
    assert torch.equal(w.qweight, ct["weight_packed"].t())  # no act-order: words only transposed
    assert torch.equal(
        dequantize_w4a16(w, BF16, config=PATHS["dequant"]), _dequant_ref(ct, 4).to(BF16)
    )
    x = torch.randn(7, 136, device=DEVICE).to(BF16)
    _assert_close(w4a16_gemm(x, w, config=PATHS["decode"]), x, _dequant_ref(ct, 4).to(BF16), None)


def test_torch_backend_equals_twin(monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    for shape, n, k, group_size, bits, asym, actorder, dtype, has_bias in CASES:
        ct = _make_ct(n, k, group_size, bits, asym, actorder, dtype, seed=3)
        x = torch.randn(shape, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE).to(dtype) if has_bias else None
        w = prepare_w4a16(**ct, num_bits=bits)
        want = reference.linear_w4a16(x, **ct, bias=bias, num_bits=bits)
        assert torch.equal(w4a16_gemm(x, w, bias), want)
        assert torch.equal(dequantize_w4a16(w), _dequant_ref(ct, bits).to(dtype))


def test_dispatch_table():
    assert DISPATCH[-1][0] is None and DISPATCH[-1][1].path == "dequant"
    bounds = [m for m, _ in DISPATCH[:-1]]
    assert bounds == sorted(bounds)
    assert select_config(1).block_m == 16 and select_config(1).path == "gemm"
    assert select_config(10**6).path == "dequant"
    cpu = torch.device("cpu")  # assumes an H200's 132 SMs
    decode = select_config(1)
    assert _split_k(decode, 1, 4096, 4096 // decode.block_k, cpu) == 1  # measured: no split
    auto = W4A16Config("gemm", 16, 64, 128)  # split_k=0: slices to fill the SMs
    split = _split_k(auto, 1, 4096, 4096 // auto.block_k, cpu)
    assert 1 < split <= 4096 // auto.block_k
    assert _split_k(W4A16Config("gemm", 128, 128, 64), 8192, 8192, 64, cpu) == 1
    assert _split_k(W4A16Config("gemm", 16, 64, 128, split_k=7), 1, 64, 5, cpu) == 5


@pytest.mark.parametrize("m", [1, 33, 600])  # one per DISPATCH row: decode, mid, dequant
def test_default_dispatch_matches_reference(triton_backend, m):
    ct = _make_ct(96, 256, 64, 4, True, "regular", BF16, seed=5)
    w = prepare_w4a16(**ct)
    x = torch.randn(m, 256, device=DEVICE).to(BF16)
    _assert_close(w4a16_gemm(x, w), x, _dequant_ref(ct, 4).to(BF16), None)


def test_launcher_errors(triton_backend):
    ct = _make_ct(64, 128, 32, 4, True, None, F16)
    w = prepare_w4a16(**ct)
    x = torch.randn(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="x has dtype float32"):
        w4a16_gemm(x, w)
    with pytest.raises(ValueError, match="x has shape .*in_features 128"):
        w4a16_gemm(x[:, :96].half(), w)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        w4a16_gemm(x.half().t().contiguous().t(), w)
    with pytest.raises(ValueError, match="bias has dtype bfloat16"):
        w4a16_gemm(x.half(), w, torch.zeros(64, dtype=BF16, device=DEVICE))
    with pytest.raises(ValueError, match=r"bias has shape \(63,\)"):
        w4a16_gemm(x.half(), w, torch.zeros(63, dtype=F16, device=DEVICE))
    with pytest.raises(ValueError, match="config.path"):
        w4a16_gemm(x.half(), w, config=W4A16Config("marlin", 16, 64, 64))
    with pytest.raises(ValueError, match="block_k=24"):
        w4a16_gemm(x.half(), w, config=W4A16Config("gemm", 16, 64, 24))
    with pytest.raises(ValueError, match="block_m=8"):
        w4a16_gemm(x.half(), w, config=W4A16Config("gemm", 8, 64, 64))
    with pytest.raises(ValueError, match="weight_packed has dtype int64"):
        prepare_w4a16(**{**ct, "weight_packed": ct["weight_packed"].long()})
    with pytest.raises(ValueError, match="weight_packed has shape"):
        prepare_w4a16(**{**ct, "weight_shape": (64, 256)})
    with pytest.raises(ValueError, match="group_size=64"):
        prepare_w4a16(**{**ct, "group_size": 64})
    with pytest.raises(ValueError, match="weight_zero_point has shape"):
        prepare_w4a16(**{**ct, "weight_zero_point": ct["weight_zero_point"][:4]})
    with pytest.raises(ValueError, match="weight_g_idx values"):
        prepare_w4a16(
            **{**ct, "weight_g_idx": torch.full((128,), 4, dtype=torch.int32, device=DEVICE)}
        )
    with pytest.raises(ValueError, match="num_bits=3"):
        prepare_w4a16(**ct, num_bits=3)


def test_aot_variants_cover_every_path():
    names = {v.name for v in aot_variants()}
    for dt in ("fp16", "bf16"):
        for sym in ("sym", "asym"):
            for bits in (4, 8):
                tag = f"_{dt}_w{bits}_{sym}"
                for _, cfg in DISPATCH:
                    prefix = (
                        "dequant" if cfg.path == "dequant" else f"gemm_{cfg.block_m}x{cfg.block_n}x"
                    )
                    assert any(s.startswith(prefix) and tag in s for s in names), (prefix, tag)
    for flag in ("_split", "_perm", "_gather", "_bias"):
        assert any(flag in s for s in names) and any(flag not in s for s in names), flag
    assert {"splitk_reduce_fp16", "splitk_reduce_bf16_bias"} <= names
