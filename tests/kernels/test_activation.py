"""silu_and_mul vs reference.silu_and_mul (F.silu(gate) * up in x's dtype).

Tolerance, per element: 2 ulp of x's dtype at |ref|. Why: both compute silu(g) = g / (1 + e^-g)
in fp32 and round it to the dtype, then multiply by `up` (exact in fp32) and round once. Only
the fp32 exp differs (numpy's or the GPU's ex2.approx against torch's vectorized exp, a few
fp32 ulp), far below a dtype ulp, so the rounded silu can only land on the adjacent dtype value
near a rounding boundary (1 ulp, relative <= 2^-(p-1)); the product is then at most 1 ulp off
before its own rounding, which adds at most 1 more. Those boundary cases are rare: at most 1% of
the elements may differ at all.

fp32 is never rounded to a coarser dtype, so the exp difference shows directly: exp(-g) computed
as exp2(-g * log2 e) carries the argument's rounding, |g| * 2^-24 relative, plus 2^-22 for an
approximate exp2; with |g| <= 32 (randn * 4 stays far inside) that is below 2^-18 relative,
which silu and the exact-then-rounded product pass on unchanged (+2^-24).
"""

import pytest
import torch

from slimserve.kernels import activation as act
from slimserve.kernels import reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ulp_error(out, ref):
    """|out - ref| in ulps of ref's dtype at |ref| (ulp(r) = 2^floor(log2 r) * eps)."""
    fin = torch.finfo(ref.dtype)
    r = ref.float().abs().clamp_min(fin.tiny)
    return (out.float() - ref.float()).abs() / (torch.exp2(torch.floor(torch.log2(r))) * fin.eps)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", [(1, 2), (7, 2000), (33, 768), (3, 8192), (2, 5, 1000)])
def test_silu_and_mul(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).to(dtype).to(DEV)  # gates deep in both tails
    out, ref = act.silu_and_mul(x), reference.silu_and_mul(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (*shape[:-1], shape[-1] // 2)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2.0**-18, atol=0)
        return
    err = _ulp_error(out, ref)
    assert err.max().item() <= 2, f"max error {err.max().item():.2f} ulp"
    assert (out != ref).float().mean().item() <= 0.01


def test_strided_rows_and_small_block():
    """Rows of a wider tensor; a block smaller than I (several programs a row, ragged tail)."""
    x = torch.randn(6, 1100, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    xs = x[:, :1000]
    out = act.silu_and_mul(xs, block=128)
    err = _ulp_error(out, reference.silu_and_mul(xs))
    assert err.max().item() <= 2


def test_extreme_gates():
    """exp(-g) overflows for very negative gates (silu -> -0) and vanishes for large ones."""
    gate = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 6e4, -6e4])
    x = torch.cat([gate, torch.full_like(gate, 0.5)]).half().to(DEV).unsqueeze(0)
    assert torch.equal(act.silu_and_mul(x), reference.silu_and_mul(x))


def test_empty_batch():
    assert act.silu_and_mul(torch.randn(0, 64, device=DEV).half()).shape == (0, 32)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: torch.randn(4, 64).double(), "x has dtype float64"),
        (lambda: torch.randn(4, 63).half(), r"x has shape \(4, 63\); its last dim must be"),
        (lambda: torch.randn(64, 4).half().t(), "x must be contiguous in its last dim"),
    ],
)
def test_argument_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        act.silu_and_mul(bad().to(DEV))


def test_block_error():
    with pytest.raises(ValueError, match="block=100"):
        act.silu_and_mul(torch.randn(2, 64, device=DEV).half(), block=100)


def test_default_launches_are_aot_compiled():
    """The BLOCK the launcher picks for any I is among aot_variants() for both dtypes."""
    compiled = {(v.signature["x_ptr"], v.constexprs["BLOCK"]) for v in act.aot_variants()}
    for inter in (1, 100, 256, 300, 512, 700, 1024, 5000, 14336):
        block = act.launch_block(inter)
        for t in ("*fp16", "*bf16", "*fp32"):
            assert (t, block) in compiled, (inter, block)
