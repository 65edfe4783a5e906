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

`available()` builds the library on first use and checks it once against the twins (codes that
would saturate a 16-bit pair sum included); where it is missing or disagrees, callers keep the
float path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from slimserve.kernels import cpu_build, reference

NAME = "cpu_quant_gemm"
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _configure(lib: ctypes.CDLL) -> None:
    lib.slimserve_quantize_per_token.restype = None
    lib.slimserve_quantize_per_token.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I, _I]
    lib.slimserve_w8a8_gemm.restype = None
    lib.slimserve_w8a8_gemm.argtypes = [_P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _P, _I]


_LIB = cpu_build.CLibrary(NAME, _configure)
_library = _LIB.get
unavailable_reason = _LIB.unavailable_reason


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scale [M, 1] in x's dtype): the codes and scales of
    `reference.quantize_per_token_int8` bit for bit, in C for fp32 and bf16 rows (bf16 widened
    to fp32 first, exactly; the scale rounded to bf16 as the twin rounds it), else through the
    twin."""
    lib = _library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        return reference.quantize_per_token_int8(x)
    bf16 = x.dtype == torch.bfloat16
    if bf16 or x.stride(1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    if m:
        lib.slimserve_quantize_per_token(
            x.data_ptr(), x.stride(0), m, k, q.data_ptr(), scale.data_ptr(), int(bf16), _threads()
        )
    return q, scale.to(torch.bfloat16) if bf16 else scale


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
    xs = x_scale.reshape(-1).float().contiguous()
    ws = w_scale.reshape(-1).float().contiguous()
    b = None if bias is None else bias.float().contiguous()
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
