"""rms_norm / fused_add_rms_norm vs reference.rms_norm / reference.fused_add_rms_norm.

Tolerance, per element: 2 ulp of x's dtype at |ref|. Why: the kernel and the twin do the same
steps with the same roundings (sum rounded to dtype; fp32 normalization; normed rounded to
dtype; product with the weight, exact in fp32, rounded once). The only difference is the fp32
summation order of sum(x^2) over H <= 8192 terms (and, on CUDA, torch's approximate rsqrt):
a relative error of order sqrt(H) * 2^-24 < 2^-17 in 1/rms, far below a dtype ulp (2^-8 bf16,
2^-11 fp16), so it can only move `normed` to the adjacent dtype value when the fp32 value sits
next to a rounding boundary: 1 ulp. The weight product of a value 1 ulp off (relative
<= 2^-(p-1)) is then at most 1 ulp off before its own rounding, which adds at most 1 more: 2 ulp.
Such boundary cases are rare, so at most 1% of the elements may differ at all; the residual sum
is one correctly rounded add on both paths and must match exactly.

fp32 rows are never rounded to a coarser dtype, so the summation-order error shows directly: the
bound is the worst case of recursive summation of H positive terms, H * 2^-24 relative in the
mean square (half that after the square root), plus 2 fp32 ulp for the final multiplies.
"""

import pytest
import torch

from slimserve.kernels import reference
from slimserve.kernels import rms_norm as rn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16)
EPS = 1e-6


def _ulp_error(out, ref):
    """|out - ref| in ulps of ref's dtype at |ref| (ulp(r) = 2^floor(log2 r) * eps)."""
    fin = torch.finfo(ref.dtype)
    r = ref.float().abs().clamp_min(fin.tiny)
    return (out.float() - ref.float()).abs() / (torch.exp2(torch.floor(torch.log2(r))) * fin.eps)


def _assert_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        rtol = ref.shape[-1] * 2.0**-24 + 2.0**-22
        torch.testing.assert_close(out, ref, rtol=rtol, atol=0)
        return
    err = _ulp_error(out, ref)
    assert err.max().item() <= 2, f"max error {err.max().item():.2f} ulp"
    assert (out != ref).float().mean().item() <= 0.01


def _inputs(shape, dtype, seed, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 4
    r = torch.randn(*shape, generator=g) * 4
    w = 1 + 0.2 * torch.randn(shape[-1], generator=g)  # Llama norm weights sit around 1
    return (x.to(dtype).to(DEV), r.to(dtype).to(DEV), w.to(w_dtype or dtype).to(DEV))


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize(
    "shape", [(1, 384), (7, 1000), (33, 384), (3, 4096), (2, 8192), (2, 3, 128)]
)
def test_rms_norm(shape, dtype):
    x, _, w = _inputs(shape, dtype, seed=sum(shape))
    _assert_close(rn.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (7, 1000), (33, 384), (2, 8192)])
def test_fused_add_rms_norm(shape, dtype):
    x, r, w = _inputs(shape, dtype, seed=3 * sum(shape))
    x0, r0 = x.clone(), r.clone()
    out, res = rn.fused_add_rms_norm(x, r, w, EPS)
    ref_out, ref_res = reference.fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(res, ref_res)
    _assert_close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # not in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp32_weight_is_rounded_to_x_dtype(dtype):
    """An fp32 weight is cast to x's dtype first, as `weight.to(x.dtype)` in transformers."""
    x, r, w = _inputs((7, 1000), dtype, seed=9, w_dtype=torch.float32)
    _assert_close(rn.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS))
    out, res = rn.fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(res, x + r)
    _assert_close(out, reference.fused_add_rms_norm(x, r, w, EPS)[0])


def test_strided_rows_and_large_eps():
    """Rows that are a slice of a wider tensor; an eps that dominates small rows."""
    x, r, w = _inputs((5, 1000), torch.bfloat16, seed=4)
    xs, rs, small = x[:, :384], r[:, :384], (x * 1e-3)[:, :384]
    assert xs.stride(0) == small.stride(0) == 1000
    _assert_close(rn.rms_norm(small, w[:384], 1e-2), reference.rms_norm(small, w[:384], 1e-2))
    out, res = rn.fused_add_rms_norm(xs, rs, w[:384], EPS)
    assert torch.equal(res, xs + rs)
    _assert_close(out, reference.rms_norm(xs + rs, w[:384], EPS))


def test_empty_batch():
    x = torch.randn(0, 64, device=DEV).half()
    w = torch.ones(64, device=DEV).half()
    assert rn.rms_norm(x, w, EPS).shape == (0, 64)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, r, w: rn.rms_norm(x.double(), w, EPS), "x has dtype float64"),
        (lambda x, r, w: rn.rms_norm(x, w[:10], EPS), r"weight has shape \(10,\)"),
        (lambda x, r, w: rn.rms_norm(x.t(), w, EPS), "x must be contiguous in its last dim"),
        (lambda x, r, w: rn.rms_norm(x, w, -1.0), "eps=-1.0"),
        (lambda x, r, w: rn.fused_add_rms_norm(x, r.float(), w, EPS), "residual has dtype float32"),
        (lambda x, r, w: rn.fused_add_rms_norm(x, r[:3], w, EPS), r"residual has shape \(3, 64\)"),
        (
            lambda x, r, w: rn.rms_norm(
                torch.zeros(2, 20000, dtype=x.dtype, device=DEV), torch.ones(20000, device=DEV), EPS
            ),
            "hidden size 20000",
        ),
    ],
)
def test_argument_errors(call, match):
    x, r, w = _inputs((4, 64), torch.float16, seed=0)
    with pytest.raises(ValueError, match=match):
        call(x, r, w)


def test_default_launches_are_aot_compiled():
    """Every (BLOCK, num_warps) the launcher picks for hidden sizes up to MAX_HIDDEN is in
    aot_variants(), for both dtypes, with and without the residual."""
    compiled = {
        (
            v.signature["x_ptr"],
            v.constexprs["BLOCK"],
            v.constexprs["HAS_RESIDUAL"],
            v.options["num_warps"],
        )
        for v in rn.aot_variants()
    }
    for h in (1, 64, 128, 384, 1000, 2048, 3072, 4096, 5120, 8192, 12288, rn.MAX_HIDDEN):
        p = rn.launch_params(h)
        for t in ("*fp16", "*bf16", "*fp32"):
            for res in (False, True):
                assert (t, p["BLOCK"], res, p["num_warps"]) in compiled, (h, p)
