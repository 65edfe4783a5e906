"""act_quant vs reference.quantize_per_token_int8: codes and scales bit for bit.

Bit-exactness is the right bar: the kernel performs the twin's IEEE operations (exact absmax,
correctly rounded divisions, round-to-nearest-even casts and rounding), so no tolerance is
needed on any path (interpreter on CPU, compiled on CUDA).
"""

import pytest
import torch

from slimserve.kernels import act_quant as aq
from slimserve.kernels import reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rows(m, k, dtype, seed):
    """Random rows whose magnitudes span ~2^-6..2^6 between rows (per-token scales differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g))
    return x.to(dtype).to(DEV)


def _assert_matches(x, **kw):
    q, s = aq.act_quant(x, **kw)
    q_ref, s_ref = reference.quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == x.dtype and s.shape == (x.shape[0], 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref), (q.int() - q_ref.int()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 16), (7, 1000), (33, 384), (4, 4096)])
def test_codes_and_scales_bit_exact(m, k, dtype):
    _assert_matches(_rows(m, k, dtype, seed=m * 131 + k))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("k,block_k", [(1000, 256), (16384, None), (3000, 1024)])
def test_chunked_rows_bit_exact(k, block_k, dtype):
    """Rows longer than the tile loop over K twice (absmax pass, quantize pass); 16384 is the
    default two-chunk path, the others force it with a smaller tile and a ragged last chunk."""
    assert aq.launch_params(k, block_k)["ONE_PASS"] is False
    _assert_matches(_rows(3, k, dtype, seed=k), block_k=block_k)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_ties_round_half_to_even(dtype):
    """absmax 127 * 2^-4 gives the exact scale 2^-4, so (j + 0.5) * 2^-4 lands exactly on a
    tie: torch.round (and the kernel) must give the even neighbour, not round away from zero."""
    halves = torch.arange(-127, 126, dtype=torch.float32) + 0.5  # -126.5 .. 125.5
    row = torch.cat([halves, torch.tensor([127.0, -127.0])]) / 16
    x = row.to(dtype).to(DEV).unsqueeze(0)
    q, s = aq.act_quant(x)
    assert s.item() == 2.0**-4
    expected = torch.round(torch.clamp(row * 16, -128, 127)).to(torch.int8)
    assert torch.equal(q.cpu()[0], expected)
    assert (q.cpu()[0, :-2].int() % 2 == 0).all()  # every tie went to even
    _assert_matches(x)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_edge_rows(dtype):
    """A zero row (scale = fp32 eps rounded to dtype, codes 0), a constant row, the dtype's
    largest finite value, and tiny values near the eps floor."""
    k = 40
    big = torch.finfo(dtype).max
    x = (
        torch.stack(
            [
                torch.zeros(k),
                torch.full((k,), -3.0),
                torch.linspace(-1, 1, k) * big,
                torch.linspace(-1e-6, 2e-6, k),
            ]
        )
        .to(dtype)
        .to(DEV)
    )
    _assert_matches(x)


def test_strided_rows():
    """Rows that are a slice of a wider tensor (stride(0) > K) are read in place."""
    wide = _rows(5, 700, torch.bfloat16, seed=3)
    _assert_matches(wide[:, :500])


def test_empty_batch():
    q, s = aq.act_quant(torch.randn(0, 64, device=DEV).half())
    assert q.shape == (0, 64) and s.shape == (0, 1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: torch.randn(4, 64).to(torch.int32), "x has dtype int32"),
        (lambda: torch.randn(2, 4, 64).half(), "x must have 2 dims"),
        (lambda: torch.randn(64, 4).half().t(), "x must be contiguous in its last dim"),
        (lambda: torch.randn(4, 0).half(), "K .* must be > 0"),
    ],
)
def test_argument_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        aq.act_quant(bad().to(DEV))


def test_block_k_error():
    with pytest.raises(ValueError, match="block_k=100"):
        aq.act_quant(torch.randn(2, 64, device=DEV).half(), block_k=100)


def test_default_launches_are_aot_compiled():
    """Every (BLOCK_K, ONE_PASS, num_warps) the launcher picks for K up to 16384 is in
    aot_variants() for each dtype, so the compile gate covers what the GPU runs."""
    compiled = {
        (
            v.signature["x_ptr"],
            v.constexprs["BLOCK_K"],
            v.constexprs["ONE_PASS"],
            v.options["num_warps"],
        )
        for v in aq.aot_variants()
    }
    for k in list(range(1, 17)) + [100, 384, 1000, 2048, 4096, 5120, 8192, 8193, 14336, 16384]:
        p = aq.launch_params(k)
        for t in ("*fp16", "*bf16", "*fp32"):
            assert (t, p["BLOCK_K"], p["ONE_PASS"], p["num_warps"]) in compiled, (k, p)
