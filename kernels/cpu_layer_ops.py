"""A decoder layer's element-wise CPU ops in C (kernels/cpu_layer_ops.c, built and loaded by
kernels/cpu_build.py): RMSNorm (with the residual add), SiLU-and-multiply, and RoPE + KV-cache
write, one pass over the data each where the torch twins run 2-15 ops (`reference.rms_norm`,
`reference.fused_add_rms_norm`, `reference.silu_and_mul`,
`reference_attention.rope_and_write_kv`). Same signatures and the same rounding points as the
twins; the math differs only in summation order, fused multiply-adds and silu's exponential (a
polynomial within 2e-7 relative, kernels/cpu_math.h), so tests/kernels/test_cpu_layer_ops.py
holds them within one unit in the last place.

Each function takes fp32 and bf16 tensors whose last dimension is contiguous; anything else
(fp16, other layouts) goes to the twin, so callers need not check. Caches: fp32, bf16,
float8_e4m3fn, or int8 / int4 rows (uint8, kernels/kv_quant.py: quantized per token and KV head
as they are written, codes bit for bit with the twin). `available()` is False where the library
does not build; runtime/layers/ops.py then keeps the twins.
"""

from __future__ import annotations

import ctypes

import torch

from slimserve.kernels import cpu_build, kv_quant, reference, reference_attention

NAME = "cpu_layer_ops"
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_INT_CACHE_KINDS = {8: 3, 4: 4}  # uint8 caches by their bits (kernels/kv_quant.py `cache_bits`)
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _configure(lib: ctypes.CDLL) -> None:
    lib.slimserve_rms_norm.restype = None
    lib.slimserve_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _I, _I64, _I64, _F, _I]
    lib.slimserve_silu_and_mul.restype = None
    lib.slimserve_silu_and_mul.argtypes = [_P, _I64, _P, _I, _I64, _I64, _I]
    lib.slimserve_rope_write_kv.restype = _I
    lib.slimserve_rope_write_kv.argtypes = [
        _P,
        _I64,
        _P,
        _I64,
        _P,
        _I64,
        _I,
        _I64,
        _I,
        _I,
        _I,
        _P,
        _P,
        _P,
        _P,
        _I,
        _P,
        _I64,
        _F,
        _F,
        _I,
    ]


_LIB = cpu_build.CLibrary(NAME, _configure)
_library = _LIB.get
available = _LIB.available  # whether it runs here (built on the first call: about a second)
unavailable_reason = _LIB.unavailable_reason


def _rows(x: torch.Tensor) -> bool:
    """A [rows, hidden] CPU matrix of a handled dtype with contiguous rows."""
    return x.dim() == 2 and x.dtype in _KINDS and x.device.type == "cpu" and x.stride(1) == 1


def _norm(x, residual, weight, eps):
    lib = _library()
    weight = weight.to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    lib.slimserve_rms_norm(
        x.data_ptr(),
        x.stride(0),
        0 if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        0 if summed is None else summed.data_ptr(),
        _KINDS[x.dtype],
        x.shape[0],
        x.shape[1],
        float(eps),
        torch.get_num_threads(),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm` in one pass."""
    if _library() is None or not _rows(x) or weight.shape != x.shape[1:]:
        return reference.rms_norm(x, weight, eps)
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fused_add_rms_norm` in one pass: (rms_norm(x + residual), x + residual)."""
    if (
        _library() is None
        or not _rows(x)
        or not _rows(residual)
        or residual.dtype != x.dtype
        or residual.shape != x.shape
        or weight.shape != x.shape[1:]
    ):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    return _norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul` in one pass: [rows, 2I] -> [rows, I], silu(gate) * up."""
    if _library() is None or not _rows(x) or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    _library().slimserve_silu_and_mul(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        _KINDS[x.dtype],
        x.shape[0],
        inter,
        torch.get_num_threads(),
    )
    return out


def _heads(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """[T, heads, D] with heads D apart and D contiguous (a view of a projection's output)."""
    return (
        t.dim() == 3
        and t.dtype == dtype
        and t.device.type == "cpu"
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
    )


def rope_and_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """`reference_attention.rope_and_write_kv` in one pass: RoPE on query and key in place, the
    rotated key and the value stored at their slots (negative slots skipped; fp8 caches take
    value / scale, saturated, nearest even; int8 / int4 caches each row's codes and scales)."""
    dtype = query.dtype
    t, _, d = query.shape
    bits = kv_quant.cache_bits(key_cache, d)
    cache_kind = _INT_CACHE_KINDS[bits] if bits else _CACHE_KINDS.get(key_cache.dtype)
    row = kv_quant.row_bytes(d, bits) if bits else d
    ok = (
        _library() is not None
        and dtype in _KINDS
        and _heads(query, dtype)
        and _heads(key, dtype)
        and _heads(value, dtype)
        and key.shape[0] == value.shape[0] == t
        and d % 2 == 0
        and key.shape[2] == value.shape[2] == d
        and key.shape[1] == value.shape[1]
        and key_cache.dtype == value_cache.dtype
        and cache_kind is not None
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key_cache.shape == value_cache.shape
        and key_cache.shape[2:] == (key.shape[1], row)
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (t, d // 2)
    )
    if not ok:
        return reference_attention.rope_and_write_kv(
            query, key, value, cos, sin, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    rc = _library().slimserve_rope_write_kv(
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        _KINDS[dtype],
        t,
        query.shape[1],
        key.shape[1],
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        cache_kind,
        slots.data_ptr(),
        num_slots,
        cpu_build.scalar(k_scale),
        cpu_build.scalar(v_scale),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"a slot of slot_mapping lies past the cache's {num_slots} slots")
