"""Paged decode attention on the CPU without a gather: kernels/cpu_attention.c, built and loaded
by kernels/cpu_build.py.

Why C: the pure-torch twin (`reference_attention.paged_attention`) copies every decoding
sequence's whole context out of the paged cache (`index_select`) at every layer of every step
before torch's SDPA reads the copy again, so each cached K/V byte crosses memory three times; in
the serving benchmark that gather and SDPA were 40% of a step. The C kernel reads each key and
value once, in place, for the whole group of query heads that shares it (GQA), one task per
sequence (or per sequence and KV head when there are few sequences) on torch's OpenMP threads.
`SLIMSERVE_KERNELS=torch` selects the twin instead (runtime/layers/ops.py), as does a machine
where the kernel does not build.

Caches: fp32, bf16 and float8_e4m3fn (dequantized with k_scale / v_scale), and int8 / int4 rows
(uint8, kernels/kv_quant.py: each row dequantized with its own scale and zero as it is read; the
kernel tells them apart by the row width). fp16 caches are not handled here (`supports` says so)
and stay on the twin.
"""

from __future__ import annotations

import ctypes

import torch

from slimserve.kernels import cpu_build, kv_quant

NAME = "cpu_attention"
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.uint8: -1}
QUERY_BF16 = 16  # or-ed into the kind: the query's values are bf16 (the kernel's exact fast path)
_INT_KINDS = {8: 3, 4: 4}  # uint8 caches by their bits (kernels/kv_quant.py `cache_bits`)


def _configure(lib: ctypes.CDLL) -> None:
    lib.slimserve_cpu_attention_init()
    fn = lib.slimserve_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
    ]


_LIB = cpu_build.CLibrary(NAME, _configure)
_library = _LIB.get
available = _LIB.available  # whether it runs here (built on the first call: about a second)
unavailable_reason = _LIB.unavailable_reason


def supports(cache_dtype: torch.dtype) -> bool:
    """Whether caches of this dtype can be read by the kernel (fp32, bf16, float8_e4m3fn, and
    uint8: int8 / int4 rows)."""
    return cache_dtype in _KINDS


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`reference_attention.paged_attention_decode` on CPU tensors, read in place: query [B, H, D]
    (any float dtype), caches [num_blocks, block_size, Hkv, D] (`supports`), block_tables int
    [B, max_blocks], context_lens int [B] (0 gives a zero row) -> [B, H, D] in query's dtype.
    window: each query sees its sequence's last `window` keys only (None: all); softcap: scores
    capped to softcap * tanh(score / softcap) before the softmax (None: not capped)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    if key_cache.dtype != value_cache.dtype or not supports(key_cache.dtype):
        raise ValueError(
            "CPU attention reads fp32, bf16, fp8 or int8/int4 caches, not "
            f"{key_cache.dtype}/{value_cache.dtype}"
        )
    if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError(f"window {window} and softcap {softcap} must be positive (or None)")
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise ValueError("CPU attention takes CPU tensors")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("CPU attention needs contiguous caches")
    n, heads, dim = query.shape
    _, block_size, kv_heads, cache_dim = key_cache.shape
    bits = kv_quant.cache_bits(key_cache, dim)
    row = kv_quant.row_bytes(dim, bits) if bits else dim
    if cache_dim != row or value_cache.shape != key_cache.shape or heads % kv_heads:
        raise ValueError(
            f"query [{n}, {heads}, {dim}] does not match caches of {kv_heads} heads x {cache_dim}"
        )
    q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] != n or lens.shape[0] != n:
        raise ValueError(
            f"{n} queries but {tables.shape[0]} block tables and {lens.shape[0]} lengths"
        )
    out = torch.empty(n, heads, dim, dtype=torch.float32)
    if n == 0:
        return out.to(query.dtype)
    rc = lib.slimserve_paged_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        (_INT_KINDS[bits] if bits else _KINDS[key_cache.dtype])
        | (QUERY_BF16 if query.dtype == torch.bfloat16 else 0),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        dim,
        block_size,
        key_cache.shape[0],
        float(scale),
        cpu_build.scalar(k_scale),
        cpu_build.scalar(v_scale),
        torch.get_num_threads(),
        window or 0,
        float(softcap or 0.0),
    )
    if rc == -2:
        raise ValueError("a context length or block id lies outside the block tables or the cache")
    if rc != 0:
        raise MemoryError("CPU attention could not allocate its scores buffer")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
