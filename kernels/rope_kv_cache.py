"""RoPE on q and k, in place, fused with the KV-cache write of k and v: one launch per layer.

Twin: `reference_attention.rope_and_write_kv`, matched bit for bit. It replaces, per layer, the eager
rotate_half RoPE of q and of k (7 ops each) and the `write_kv_cache` launch.

RoPE is transformers' rotate_half form computed in fp32 and rounded once to q's (k's) dtype:
with x1, x2 the two halves of a head and c, s = cos, sin of position * inv_freq (the step's
tables, [T, D/2] fp32, computed once per step for every layer):
    out1 = x1 * c - x2 * s,  out2 = x2 * c + x1 * s
which is exactly `x * cat(c, c) + cat(-x2, x1) * cat(s, s)` (negation is exact). The products
and the sum round separately, as the eager ops do: the kernel is compiled without FMA
contraction (`enable_fp_fusion=False`).

The rotated k (rounded to k's dtype) and v go to the cache at slot_mapping[t] as
`write_kv_cache` stores them (kernels/kv_cache.py: fp8 codes of x / scale, int8 / int4 rows with
their own scale and zero from the row's min and max over both halves, or a cast); a
negative slot skips the cache write of that token (padding rows of a CUDA graph), its q and k
are still rotated. q, k, v may be strided views of one fused qkv projection (last dim
contiguous).

One program per token: its H query heads and Hkv key/value heads, [heads, D/2] tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2
from slimserve.kernels._rounding import round_to
from slimserve.kernels.kv_cache import (
    FP8,
    TRITON_TYPE,
    cache_quant,
    cache_row,
    cache_view,
    quant_codes,
    quant_scale_zero,
    scale_tensor,
    store_cache,
    store_codes,
    store_scale_zero,
)

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_WARPS = 4


@triton.jit
def _rotate_rows(ptr, row_off, heads, stride_h, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate `heads` rows [*, 2 * HALF] at ptr + row_off in place; returns the rotated halves
    (fp32, rounded to the tensor's dtype), their offsets and mask for a cache write."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    off = row_off + h * stride_h + d
    dt = ptr.dtype.element_ty
    x1 = tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + off + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = round_to(x1 * c - x2 * s, dt)
    o2 = round_to(x2 * c + x1 * s, dt)
    tl.store(ptr + off, o1.to(dt), mask=mask)
    tl.store(ptr + off + HALF, o2.to(dt), mask=mask)
    return o1, o2, h, d, mask


@triton.jit
def _quant_halves(dst_ptr, row_off, x1, x2, h_ok, HALF: tl.constexpr, QUANT: tl.constexpr):
    """Rows given as their two halves x1, x2 [BLOCK_H, HALF] (fp32) quantized into the int8 /
    int4 rows at dst_ptr + row_off [BLOCK_H] (kernels/kv_cache.py)."""
    lo = tl.minimum(tl.min(x1, 1), tl.min(x2, 1))
    hi = tl.maximum(tl.max(x1, 1), tl.max(x2, 1))
    scale, zero = quant_scale_zero(lo, hi, QUANT)
    store_codes(dst_ptr, row_off, 0, quant_codes(x1, scale, zero, QUANT), h_ok, QUANT)
    store_codes(dst_ptr, row_off, HALF, quant_codes(x2, scale, zero, QUANT), h_ok, QUANT)
    store_scale_zero(dst_ptr, row_off, scale, zero, h_ok, 2 * HALF, QUANT)


@triton.jit
def _rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # [T, H, D], [T, Hkv, D], [T, Hkv, D]; last dim contiguous
    cos_ptr,
    sin_ptr,  # [T, D/2] fp32, contiguous
    kc_ptr,
    vc_ptr,  # [num_blocks, block_size, Hkv, D] fp16/bf16, or uint8 views of fp8 caches
    slot_ptr,  # [T] int64
    ks_ptr,
    vs_ptr,  # [1] fp32 (read only when IS_FP8)
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HALF: tl.constexpr,  # head_dim / 2, a power of two
    BLOCK_H: tl.constexpr,  # next_pow2(num_heads)
    BLOCK_HKV: tl.constexpr,  # next_pow2(num_kv_heads)
    IS_FP8: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 8 / 4: int8 / int4 rows (caches uint8 [.., Hkv, row bytes])
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + t * HALF + cols)
    s = tl.load(sin_ptr + t * HALF + cols)
    _rotate_rows(q_ptr, t * stride_qt, num_heads, stride_qh, c, s, HALF, BLOCK_H)
    k1, k2, h, d, mask = _rotate_rows(
        k_ptr, t * stride_kt, num_kv_heads, stride_kh, c, s, HALF, BLOCK_HKV
    )
    slot = tl.load(slot_ptr + t)
    if QUANT != 0 and slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        hs = tl.arange(0, BLOCK_HKV)
        h_ok = hs < num_kv_heads
        k_row = blk * stride_kcb + off * stride_kco + hs * stride_kch
        _quant_halves(kc_ptr, k_row, k1, k2, h_ok, HALF, QUANT)
        v_src = t * stride_vt + h * stride_vh + d
        v1 = tl.load(v_ptr + v_src, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + v_src + HALF, mask=mask, other=0.0).to(tl.float32)
        v_row = blk * stride_vcb + off * stride_vco + hs * stride_vch
        _quant_halves(vc_ptr, v_row, v1, v2, h_ok, HALF, QUANT)
    if QUANT == 0 and slot >= 0:
        ks = 1.0
        vs = 1.0
        if IS_FP8:
            ks = tl.load(ks_ptr)
            vs = tl.load(vs_ptr)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_dst = blk * stride_kcb + off * stride_kco + h * stride_kch + d
        store_cache(kc_ptr, k_dst, k1, mask, ks, IS_FP8)
        store_cache(kc_ptr, k_dst + HALF, k2, mask, ks, IS_FP8)
        v_src = t * stride_vt + h * stride_vh + d
        v_dst = blk * stride_vcb + off * stride_vco + h * stride_vch + d
        v1 = tl.load(v_ptr + v_src, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + v_src + HALF, mask=mask, other=0.0).to(tl.float32)
        store_cache(vc_ptr, v_dst, v1, mask, vs, IS_FP8)
        store_cache(vc_ptr, v_dst + HALF, v2, mask, vs, IS_FP8)


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
    """Rotate query [T, H, D] and key [T, Hkv, D] in place with cos/sin [T, D/2] (fp32), and
    store the rotated key and value [T, Hkv, D] into key_cache/value_cache [num_blocks,
    block_size, Hkv, D] at slot_mapping int64 [T] (negative: no write). See the module
    docstring; the twin is `reference_attention.rope_and_write_kv`."""
    check_tensor("query", query, dtypes=_X_DTYPES, ndim=3, last_contiguous=True)
    dev, (t, h, d) = query.device, query.shape
    hkv = key.shape[1] if isinstance(key, torch.Tensor) and key.dim() == 3 else -1
    check_tensor(
        "key", key, dtypes=(query.dtype,), shape=(t, None, d), device=dev, last_contiguous=True
    )
    check_tensor(
        "value", value, dtypes=(query.dtype,), shape=(t, hkv, d), device=dev, last_contiguous=True
    )
    check(
        d >= 2 and d == next_pow2(d),
        lambda: f"query has head_dim {d}; expected a power of two >= 2",
    )
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, dtypes=(torch.float32,), shape=(t, d // 2), device=dev)
        check(
            table.is_contiguous(),
            lambda name=name: f"{name} must be contiguous; call .contiguous()",
        )
    kc = cache_view("key_cache", key_cache)
    vc = cache_view("value_cache", value_cache)
    quant = cache_quant("key_cache", key_cache, d)
    check_tensor(
        "key_cache", key_cache, shape=(None, None, hkv, cache_row(key_cache, d, quant)), device=dev
    )
    check_tensor(
        "value_cache",
        value_cache,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=dev,
    )
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(t,), device=dev)
    ks = scale_tensor("k_scale", k_scale, dev)
    vs = scale_tensor("v_scale", v_scale, dev)
    if t == 0:
        return
    _rope_kv_kernel[(t,)](
        query,
        key,
        value,
        cos,
        sin,
        kc,
        vc,
        slot_mapping,
        ks,
        vs,
        h,
        hkv,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HALF=d // 2,
        BLOCK_H=next_pow2(h),
        BLOCK_HKV=next_pow2(hkv),
        IS_FP8=key_cache.dtype == FP8,
        QUANT=quant,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def aot_variants() -> list[AotVariant]:
    """fp16/bf16 q/k/v x their dtype, fp8, int8 or int4 cache, head_dim 64 and 128, 32 query /
    8 KV heads (Llama-3-8B; other head counts compile the same code with other BLOCK_H), block
    16."""
    variants = []
    for xdt in (torch.float16, torch.bfloat16):
        for cdt, quant in ((xdt, 0), (FP8, 0), (torch.uint8, 8), (torch.uint8, 4)):
            for d in (64, 128):
                x, c = TRITON_TYPE[xdt], TRITON_TYPE[cdt]
                sig = {
                    "q_ptr": f"*{x}",
                    "k_ptr": f"*{x}",
                    "v_ptr": f"*{x}",
                    "cos_ptr": "*fp32",
                    "sin_ptr": "*fp32",
                    "kc_ptr": f"*{c}",
                    "vc_ptr": f"*{c}",
                    "slot_ptr": "*i64",
                    "ks_ptr": "*fp32",
                    "vs_ptr": "*fp32",
                    "num_heads": "i32",
                    "num_kv_heads": "i32",
                }
                for s in (
                    "qt",
                    "qh",
                    "kt",
                    "kh",
                    "vt",
                    "vh",
                    "kcb",
                    "kco",
                    "kch",
                    "vcb",
                    "vco",
                    "vch",
                ):
                    sig[f"stride_{s}"] = "i32"
                consts = {
                    "BLOCK_SIZE": 16,
                    "HALF": d // 2,
                    "BLOCK_H": 32,
                    "BLOCK_HKV": 8,
                    "IS_FP8": cdt == FP8,
                    "QUANT": quant,
                }
                sig.update({k: "constexpr" for k in consts})
                variants.append(
                    AotVariant(
                        _rope_kv_kernel,
                        sig,
                        consts,
                        {"num_warps": NUM_WARPS, "enable_fp_fusion": False},
                        name=f"rope_kv_{x}_{f'int{quant}' if quant else c}_d{d}",
                    )
                )
    return variants
