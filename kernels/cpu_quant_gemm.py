"""W8A8 GEMMs on CPU with int8 weights and exact int32 accumulation (kernels/cpu_quant_gemm.c,
built and loaded by kernels/cpu_build.py).

Math, twins in kernels/reference.py: `quantize_per_token` returns the codes and scales of
`reference.quantize_per_token_int8` bit for bit (fp32 rows in C; other dtypes through the twin
itself); `w8a8_gemm` is `reference.w8a8_gemm` with fp32 output: int32 accumulators, exact, then
acc * x_scale[m] * w_scale[n] (+ bias[n]) in fp32 in that order, without fused multiply-adds,
so the result equals the twin's bit for bit.

Why C and not torch's int8 ops (measured on a 2-core AVX2 EPYC without VNNI, torch 2.13;
eval/bench_cpu_quant_gemm.py's docstring has the numbers): `torch._int_mm` on CPU is exact but a
scalar loop (0.76 ms for one row through 960x576, 3x the fp32 GEMM; 4.3 ms for 8 rows, 14x);
oneDNN's int8 inner product (`torch.ops.onednn.qlinear_pointwise`, the op PT2E's x86 quantizer
lowers to) forms u8 x s8 pair sums in 16 bits with saturation on a CPU without VNNI, so it is
not exact (40 products of 100 * 100 give 143340, not 400000); `torch._weight_int8pack_mm` takes
float activations and runs a generic loop on AVX2 (160 ms at 128 rows). The C kernel widens the
codes to 16 bits (vpmaddwd), whose pair sums cannot saturate; built for a CPU with AVX512-VNNI it
uses vpdpbusd (u8 x s8 into int32 without saturation) on x + 128 and subtracts 128 times each
weight row's sum (`weight_sums`), exact for K <= 65536.

On such a CPU the layers hold their codes once more in a packed layout (`pack`: 16 output
channels by 4 k a 64-byte vector) that `w8a8_gemm_packed` reads: one vpdpbusd of a broadcast x
quad adds 4 products to each of 16 channels, so no horizontal sums are left, and it writes bf16
itself. At 2 threads on a Zen 4 EPYC it is 1.3-2.1x the unpacked kernel at 32 and 128 rows of
SmolLM2's Linears (qkv 960x576 at 32 rows 122.6 -> 58.4 us, ~300 GMAC/s), 1.0-1.2x at one row,
where the call's fixed costs dominate; eval/bench_cpu_quant_gemm.py measures it.

`available()` builds the library on first use and checks it once against the twins (codes that
would saturate a 16-bit pair sum included); where it is missing or disagrees, callers keep the
float path; `packed_available()` checks the packed GEMM likewise.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from slimserve.kernels import cpu_build, reference

NAME = "cpu_quant_gemm"
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _configure(lib: ctypes.CDLL) -> None:
    lib.slimserve_quantize_per_token.restype = None
    lib.slimserve_quantize_per_token.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I]
    lib.slimserve_quantize_per_token_bf16.restype = None
    lib.slimserve_quantize_per_token_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I]
    lib.slimserve_w8a8_gemm.restype = None
    lib.slimserve_w8a8_gemm.argtypes = [_P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _P, _I]
    lib.slimserve_w8a8_vnni.restype = _I
    lib.slimserve_w8a8_vnni.argtypes = []
    lib.slimserve_w8a8_pack.restype = None
    lib.slimserve_w8a8_pack.argtypes = [_P, _I64, _I64, _P]
    lib.slimserve_w8a8_gemm_packed.restype = _I
    lib.slimserve_w8a8_gemm_packed.argtypes = [_P, _P, _I64, _P, _P, _P, _P, _I, _I64, _I64, _P, _I]


_LIB = cpu_build.CLibrary(NAME, _configure)
_library = _LIB.get
unavailable_reason = _LIB.unavailable_reason


def quantize_per_token(
    x: torch.Tensor, fp32_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scale [M, 1] in x's dtype, or fp32 with `fp32_scale`):
    the codes and scales of `reference.quantize_per_token_int8` bit for bit, in C for fp32 and
    bf16 rows (bf16 read as it is and widened exactly; its scale rounded to bf16 as the twin
    rounds it, so fp32 holds it exactly), else through the twin."""
    lib = _library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        q, s = reference.quantize_per_token_int8(x)
        return q, s.float() if fp32_scale else s
    bf16 = x.dtype == torch.bfloat16
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    if m:
        fn = lib.slimserve_quantize_per_token_bf16 if bf16 else lib.slimserve_quantize_per_token
        fn(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), scale.data_ptr(), _threads())
    return q, scale.to(torch.bfloat16) if bf16 and not fp32_scale else scale


def _epilogue_operands(x_scale, w_scale, bias):
    """The scales and bias as the C epilogue reads them: contiguous fp32 [M], [N], [N] or None."""
    xs = x_scale.reshape(-1).float().contiguous()
    ws = w_scale.reshape(-1).float().contiguous()
    return xs, ws, None if bias is None else bias.float().contiguous()


def w8a8_gemm(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    w_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [M, N] = codes q int8 [M, K] @ weight int8 [N, K]^T, times x_scale [M] (or [M, 1])
    and w_scale [N], plus bias [N] or None: `reference.w8a8_gemm` with fp32 output. w_sum:
    `weight_sums(weight)`, held with the weight (without it, the VNNI path sums each tile)."""
    if q.dtype != torch.int8 or weight.dtype != torch.int8 or q.shape[1] != weight.shape[1]:
        raise ValueError(
            f"w8a8_gemm takes int8 codes [M, K] and [N, K], got {q.dtype} {tuple(q.shape)} "
            f"and {weight.dtype} {tuple(weight.shape)}"
        )
    # the C kernel reads raw pointers: every operand contiguous fp32 / int8, held here
    q, weight = q.contiguous(), weight.contiguous()
    xs, ws, b = _epilogue_operands(x_scale, w_scale, bias)
    m, k = q.shape
    n = weight.shape[0]
    if w_sum is not None and (w_sum.dtype != torch.int32 or w_sum.shape != (n,)):
        raise ValueError(f"w_sum must be int32 [{n}], got {w_sum.dtype} {tuple(w_sum.shape)}")
    ws_ptr = 0 if w_sum is None else w_sum.contiguous().data_ptr()
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    _library().slimserve_w8a8_gemm(
        q.data_ptr(),
        xs.data_ptr(),
        m,
        weight.data_ptr(),
        ws.data_ptr(),
        0 if b is None else b.data_ptr(),
        out.data_ptr(),
        n,
        k,
        ws_ptr,
        _threads(),
    )
    return out


@dataclass(frozen=True)
class PackedWeight:
    """int8 weight codes [N, K] in the VNNI layout of `slimserve_w8a8_pack` (groups of 16
    output channels, k in quads: [ceil(N/16) * ceil(K/4) * 64] bytes), with the rows' sums."""

    data: torch.Tensor
    n: int
    k: int
    w_sum: torch.Tensor  # int32 [N]


def vnni() -> bool:
    """Whether the library was built with the packed AVX512-VNNI GEMM (`w8a8_gemm_packed`)."""
    lib = _library()
    return lib is not None and bool(lib.slimserve_w8a8_vnni())


@functools.cache
def packed_available() -> bool:
    """Whether `w8a8_gemm_packed` runs here and equals `reference.w8a8_gemm` bit for bit, fp32
    and bf16 out, with and without bias, on random codes and extreme ones (-128 x -128 in every
    product), at shapes with a ragged last 16-channel group, a ragged k-quad, one row and rows
    past the 4-row tile."""
    if not (available() and vnni()):
        return False
    g = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 8, 64), (5, 13, 37), (6, 70, 131)):
        q, s = quantize_per_token(torch.randn(m, k, generator=g) * 3)
        w_scale = torch.rand(n, generator=g) + 0.5
        bias = torch.randn(n, generator=g)
        codes = [
            (q, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)),
            (
                torch.full((m, k), -128, dtype=torch.int8),
                torch.full((n, k), -128, dtype=torch.int8),
            ),
        ]
        for a, w in codes:
            pw = pack(w)
            for b in (bias, None):
                for dtype in (torch.float32, torch.bfloat16):
                    want = reference.w8a8_gemm(a, s, w, w_scale, b, dtype)
                    if not torch.equal(w8a8_gemm_packed(a, s, pw, w_scale, b, dtype), want):
                        return False
    return True


def pack(weight: torch.Tensor) -> PackedWeight:
    """int8 [N, K] -> `PackedWeight` for `w8a8_gemm_packed` (only where `vnni()`)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"pack takes int8 codes [N, K], got {weight.dtype} {tuple(weight.shape)}")
    w = weight.contiguous()
    n, k = w.shape
    data = torch.empty(-(-n // 16) * -(-k // 4) * 64, dtype=torch.int8)
    _library().slimserve_w8a8_pack(w.data_ptr(), n, k, data.data_ptr())
    return PackedWeight(data, n, k, weight_sums(w))


def w8a8_gemm_packed(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: PackedWeight,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`w8a8_gemm` on a `pack`ed weight, out_dtype fp32 or bf16 (the fp32 values rounded to
    nearest even, as `.to(torch.bfloat16)`): `reference.w8a8_gemm(..., out_dtype)` bit for bit.
    One vpdpbusd adds four products to 16 output channels at once (no horizontal sums)."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] != weight.k:
        raise ValueError(
            f"w8a8_gemm_packed takes int8 codes [M, {weight.k}], got {q.dtype} {tuple(q.shape)}"
        )
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"w8a8_gemm_packed writes float32 or bfloat16, not {out_dtype}")
    q = q.contiguous()
    xs, ws, b = _epilogue_operands(x_scale, w_scale, bias)
    m, n = q.shape[0], weight.n
    out = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return out
    done = _library().slimserve_w8a8_gemm_packed(
        q.data_ptr(),
        xs.data_ptr(),
        m,
        weight.data.data_ptr(),
        ws.data_ptr(),
        0 if b is None else b.data_ptr(),
        out.data_ptr(),
        int(out_dtype == torch.bfloat16),
        n,
        weight.k,
        weight.w_sum.data_ptr(),
        _threads(),
    )
    if not done:
        raise RuntimeError(
            "w8a8_gemm_packed did nothing: no VNNI build (check vnni() first) or no memory"
        )
    return out


def weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each int8 weight row's sum, the correction the VNNI path (u8 x s8 products of
    x + 128) subtracts 128 times."""
    return weight.sum(dim=1, dtype=torch.int32).contiguous()


def _threads() -> int:
    return torch.get_num_threads()


@functools.cache
def available() -> bool:
    """Whether the C kernel builds here and agrees with the twins: codes and scales equal, and
    the scaled GEMM equal to `reference.w8a8_gemm` on random codes and on extreme ones (every
    product 127 * 127 or -128 * -127, where a 16-bit pair sum would saturate), at odd shapes
    (one row, K not a multiple of 16, N not a multiple of 4)."""
    if _library() is None:
        return False
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 8, 64), (5, 13, 40), (3, 4, 37)):
        x = torch.randn(m, k, generator=g) * 3
        for xd in (x, x.bfloat16()):
            q, s = quantize_per_token(xd)
            want_q, want_s = reference.quantize_per_token_int8(xd)
            if not (torch.equal(q, want_q) and torch.equal(s, want_s)):
                return False
        q, s = quantize_per_token(x)
        codes = [
            (q, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)),
            (torch.full((m, k), 127, dtype=torch.int8), torch.full((n, k), 127, dtype=torch.int8)),
            (
                torch.full((m, k), -128, dtype=torch.int8),
                torch.full((n, k), -127, dtype=torch.int8),
            ),
        ]
        w_scale = torch.rand(n, generator=g) + 0.5
        bias = torch.randn(n, generator=g)
        for a, w in codes:
            want = reference.w8a8_gemm(a, s, w, w_scale, bias, torch.float32)
            for w_sum in (None, weight_sums(w)):
                if not torch.equal(w8a8_gemm(a, s, w, w_scale, bias, w_sum), want):
                    return False
    return True
