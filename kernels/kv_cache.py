"""Scatter new tokens' keys and values into the paged KV cache, fp8 / int8 / int4 quantized or as
they are.

Twin: `reference_attention.write_kv_cache`, matched bit for bit. Caches are
[num_blocks, block_size, num_kv_heads, head_dim]; token t goes to slot slot_mapping[t] =
block * block_size + offset, and a negative slot skips it (padding tokens of a CUDA graph).

fp8 caches hold float8_e4m3fn codes of x / scale, saturated to +-448 and rounded to nearest
even, exactly as torch's `.clamp(-448, 448).to(torch.float8_e4m3fn)`. The kernel encodes and
decodes the codes with integer bit arithmetic on a uint8 view of the cache: Triton rejects the
fp8e4nv type on sm_80 (measured: triton 3.9 "type fp8e4nv not supported in this architecture"),
and the interpreter's fp8 cast rounds wrongly. The division is IEEE `div_rn`, as torch's CPU
`x / scale`; Triton's plain fp32 `/` is the approximate `div.full.f32` on the GPU.

One program per token stores its [num_kv_heads, head_dim] key and value rows: 2 x Hkv x D
elements (4 KiB of bf16 for 8 x 128), contiguous in the source and in the destination slot.
The cache's read side (`load_kv_tile`: a block-table gather plus the fp8 decode; `load_kv_codes`
for int8 / int4) lives here too, for paged_attention's kernels, so the layout and the codec
change in one place.

int8 / int4 caches (QUANT = 8 / 4) are uint8 [num_blocks, block_size, Hkv, row_bytes] of rows
quantized per token and KV head with their own fp16 scale and zero (kernels/kv_quant.py, whose
twin they match bit for bit): min and max of the row, scale = fp16(div_rn(max - min, qmax)),
zero = fp16(min), code = clamp(rint(div_rn(x - zero, scale)), 0, qmax); int4 codes of a row's
elements 2j and 2j + 1 share byte j (low nibble first). Rounding to an integer adds and
subtracts 1.5 x 2^23, which leaves no fraction bits (round half to even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve.kernels import kv_quant
from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2
from slimserve.kernels._rounding import round_to

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (torch.float16, torch.bfloat16, FP8, torch.uint8)  # uint8: int8 / int4 rows
_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_TYPE = {  # torch dtype -> the Triton pointer type of an AOT signature
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    FP8: "u8",
    torch.uint8: "u8",
}
NUM_WARPS = 4  # 2 x 8 x 128 elements a program: 16 a thread per tensor


@triton.jit
def fp8_e4m3_encode(y):
    """float8_e4m3fn codes (int32 in 0..255) of fp32 y, saturated to +-448, rounded half to even."""
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit fp32 mantissa to 3 bits, half to even; a carry
    # moves into the exponent. (bits >> 20) is then exponent << 3 | mantissa, rebiased 127 -> 7.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: codes are multiples of 2^-9. Adding 2^23 to a * 2^9 < 8 makes the add round
    # half to even to an integer, which is then the low bits of the sum; 2^-6 itself gives code 8,
    # the smallest normal, as it should.
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(y != y, 0x7F, tl.where(a >= 0.015625, normal, sub))  # NaN stays NaN
    return code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)  # sign bit (also of -0.0)


@triton.jit
def fp8_e4m3_decode_scaled(code):
    """fp16 holding 2^-8 times the value of float8_e4m3fn codes (uint8): the code's magnitude bits
    shifted into fp16's exponent and mantissa. Exact for normals and subnormals alike (fp16's
    exponent bias is 8 more than e4m3's, and its subnormals cover e4m3's); the caller folds the
    2^8 into its scale. NaN codes read as 480 (write_kv_cache stores them only for NaN inputs)."""
    c = code.to(tl.int32)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def load_kv_tile(
    cache_ptr,
    bt_row,
    toks,
    tok_ok,
    offs_d,
    stride_b,
    stride_o,
    head_off,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    MASKED: tl.constexpr,
):
    """[BLOCK_N, D] rows of one KV head for a sequence's logical tokens `toks` [BLOCK_N], through
    its block-table row `bt_row`: fp16/bf16 as stored, fp8 as fp16 value * 2^-8 (the caller's
    scale carries the 2^8). MASKED=False skips the masks (every token valid)."""
    if MASKED:
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + toks // BLOCK_SIZE).to(tl.int64)
    ptrs = (
        cache_ptr
        + (blk * stride_b + (toks % BLOCK_SIZE) * stride_o + head_off)[:, None]
        + offs_d[None, :]
    )
    if MASKED:
        x = tl.load(ptrs, mask=tok_ok[:, None], other=0)
    else:
        x = tl.load(ptrs)
    if IS_FP8:
        x = fp8_e4m3_decode_scaled(x)
    return x


@triton.jit
def load_kv_codes(
    cache_ptr,
    bt_row,
    toks,
    tok_ok,
    offs_d,
    stride_b,
    stride_o,
    head_off,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """An int8 / int4 tile of one KV head for tokens `toks` [BLOCK_N] (as `load_kv_tile`): the
    codes [BLOCK_N, D] (int32, 0..255 or 0..15) and each row's scale and zero [BLOCK_N] (fp32;
    value = code * scale + zero). Masked tokens read code, scale and zero 0."""
    if MASKED:
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + toks // BLOCK_SIZE).to(tl.int64)
    row = blk * stride_b + (toks % BLOCK_SIZE) * stride_o + head_off  # [BLOCK_N] byte offsets
    if QUANT == 8:
        cols = offs_d
        code_bytes = HEAD_DIM
    else:
        cols = offs_d // 2
        code_bytes = HEAD_DIM // 2
    ptrs = cache_ptr + row[:, None] + cols[None, :]
    side = (cache_ptr + row + code_bytes).to(tl.pointer_type(tl.float16))
    if MASKED:
        x = tl.load(ptrs, mask=tok_ok[:, None], other=0).to(tl.int32)
        scale = tl.load(side, mask=tok_ok, other=0.0).to(tl.float32)
        zero = tl.load(side + 1, mask=tok_ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs).to(tl.int32)
        scale = tl.load(side).to(tl.float32)
        zero = tl.load(side + 1).to(tl.float32)
    if QUANT == 4:
        x = (x >> ((offs_d % 2) * 4)[None, :]) & 15
    return x, scale, zero


@triton.jit
def quant_scale_zero(lo, hi, QUANT: tl.constexpr):
    """fp16 scale and zero of rows whose min / max are lo / hi (fp32): kernels/kv_quant.py."""
    qmax = 255.0 if QUANT == 8 else 15.0
    scale = tl.math.div_rn(hi - lo, tl.zeros_like(lo) + qmax).to(tl.float16)
    return scale, lo.to(tl.float16)


@triton.jit
def quant_codes(x, scale, zero, QUANT: tl.constexpr):
    """int32 codes of fp32 x [R, C] with the rows' fp16 scale and zero [R]."""
    qmax = 255.0 if QUANT == 8 else 15.0
    sf = scale.to(tl.float32)[:, None] + tl.zeros_like(x)
    y = tl.math.div_rn(x - zero.to(tl.float32)[:, None], sf)
    y = tl.minimum(tl.maximum(y, 0.0), qmax)
    y = (y + 12582912.0) - 12582912.0  # rint, half to even (y in [0, 255])
    return tl.where(sf > 0, y, 0.0).to(tl.int32)


@triton.jit
def store_codes(dst_ptr, row_off, col0, codes, row_ok, QUANT: tl.constexpr):
    """Codes [R, C] of row elements col0 .. col0 + C - 1 into rows at dst_ptr + row_off [R]
    (row_ok [R]: the rows to write): a byte each (int8), or two a byte, low nibble first (int4;
    col0 and C even)."""
    R: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    if QUANT == 8:
        c = tl.arange(0, C)[None, :]
        m = row_ok[:, None] & (c < C)
        tl.store(dst_ptr + row_off[:, None] + col0 + c, codes.to(tl.uint8), mask=m)
    else:
        even, odd = tl.split(tl.reshape(codes, (R, C // 2, 2)))
        c = tl.arange(0, C // 2)[None, :]
        m = row_ok[:, None] & (c < C // 2)
        tl.store(
            dst_ptr + row_off[:, None] + col0 // 2 + c, (even | (odd << 4)).to(tl.uint8), mask=m
        )


@triton.jit
def store_scale_zero(
    dst_ptr, row_off, scale, zero, mask, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr
):
    """A row's fp16 scale and zero after its codes (row_off, scale, zero, mask: [R])."""
    code_bytes = HEAD_DIM if QUANT == 8 else HEAD_DIM // 2
    side = (dst_ptr + row_off + code_bytes).to(tl.pointer_type(tl.float16))
    tl.store(side, scale, mask=mask)
    tl.store(side + 1, zero, mask=mask)


@triton.jit
def store_cache(dst_ptr, dst_off, x, mask, scale, IS_FP8: tl.constexpr):
    """fp32 x (already rounded to the source's dtype) into the cache: fp8 codes of x / scale,
    or x rounded to the cache's dtype. Shared with kernels/rope_kv_cache.py."""
    if IS_FP8:
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        tl.store(dst_ptr + dst_off, fp8_e4m3_encode(y).to(tl.uint8), mask=mask)
    else:
        dt = dst_ptr.dtype.element_ty
        tl.store(dst_ptr + dst_off, round_to(x, dt).to(dt), mask=mask)


@triton.jit
def _write_rows(src_ptr, dst_ptr, src_off, dst_off, mask, scale, IS_FP8: tl.constexpr):
    x = tl.load(src_ptr + src_off, mask=mask, other=0.0).to(tl.float32)  # fp32 at once: bf16
    store_cache(dst_ptr, dst_off, x, mask, scale, IS_FP8)


@triton.jit
def _write_quant_rows(
    src_ptr, dst_ptr, src_off, row_off, mask, h_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr
):
    """Rows [BLOCK_H, D] at src_ptr + src_off quantized into the rows at dst_ptr + row_off
    [BLOCK_H] (h_ok: the real heads)."""
    x = tl.load(src_ptr + src_off, mask=mask, other=0.0).to(tl.float32)
    scale, zero = quant_scale_zero(tl.min(x, 1), tl.max(x, 1), QUANT)
    store_codes(dst_ptr, row_off, 0, quant_codes(x, scale, zero, QUANT), h_ok, QUANT)
    store_scale_zero(dst_ptr, row_off, scale, zero, h_ok, HEAD_DIM, QUANT)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,  # [T, Hkv, D] fp16/bf16/fp32, last dim contiguous
    kc_ptr,
    vc_ptr,  # [num_blocks, block_size, Hkv, D] fp16/bf16, or uint8 views of fp8 caches
    slot_ptr,  # [T] int64
    ks_ptr,
    vs_ptr,  # [1] fp32 scales (read only when IS_FP8)
    num_kv_heads,
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
    HEAD_DIM: tl.constexpr,  # power of two
    BLOCK_H: tl.constexpr,  # next_pow2(num_kv_heads)
    IS_FP8: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 8 / 4: int8 / int4 rows (caches uint8 [.., Hkv, row bytes])
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    if QUANT != 0:
        h_ok = tl.arange(0, BLOCK_H) < num_kv_heads
        _write_quant_rows(
            key_ptr,
            kc_ptr,
            t * stride_kt + h * stride_kh + d,
            blk * stride_kcb + off * stride_kco + tl.arange(0, BLOCK_H) * stride_kch,
            mask,
            h_ok,
            HEAD_DIM,
            QUANT,
        )
        _write_quant_rows(
            value_ptr,
            vc_ptr,
            t * stride_vt + h * stride_vh + d,
            blk * stride_vcb + off * stride_vco + tl.arange(0, BLOCK_H) * stride_vch,
            mask,
            h_ok,
            HEAD_DIM,
            QUANT,
        )
        return
    ks = 1.0
    vs = 1.0
    if IS_FP8:
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)
    _write_rows(
        key_ptr,
        kc_ptr,
        t * stride_kt + h * stride_kh + d,
        blk * stride_kcb + off * stride_kco + h * stride_kch + d,
        mask,
        ks,
        IS_FP8,
    )
    _write_rows(
        value_ptr,
        vc_ptr,
        t * stride_vt + h * stride_vh + d,
        blk * stride_vcb + off * stride_vco + h * stride_vch + d,
        mask,
        vs,
        IS_FP8,
    )


def scale_tensor(name: str, scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-layer scale as the fp32 [1] device tensor the kernels read (CUDA-graph friendly);
    a half-precision tensor (a module buffer cast with the model) is upcast, exactly."""
    if isinstance(scale, torch.Tensor):
        check_tensor(
            name, scale, dtypes=(torch.float32, torch.bfloat16, torch.float16), device=device
        )
        check(
            scale.numel() == 1,
            lambda: (
                f"{name} has shape {tuple(scale.shape)}; expected one element "
                f"(a per-layer scale, shape [1])"
            ),
        )
        return scale.reshape(1).float()
    check(
        isinstance(scale, (int, float)) and float(scale) > 0,
        lambda: f"{name}={scale!r} must be a positive float or a float32 tensor of shape [1]",
    )
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def cache_view(name: str, cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel indexes: fp8 caches as uint8 codes (see the module docstring)."""
    check_tensor(name, cache, dtypes=CACHE_DTYPES, ndim=4, last_contiguous=True)
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def cache_quant(name: str, cache: torch.Tensor, head_dim: int) -> int:
    """0 for a float cache, 8 / 4 for int8 / int4 rows (a ValueError naming `name` for a uint8
    cache of another row width; kernels/kv_quant.py `cache_bits`)."""
    try:
        return kv_quant.cache_bits(cache, head_dim)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def cache_row(cache: torch.Tensor, head_dim: int, quant: int) -> int:
    """A cache row's last-dimension size: head_dim, or an int8 / int4 row's bytes."""
    return kv_quant.row_bytes(head_dim, quant) if quant else head_dim


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Store key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] in
    place at slot_mapping int64 [T] (negative: skip). fp8 caches store x / scale (scales: fp32
    tensors of shape [1] or floats); int8 / int4 caches (uint8, last dim the row bytes) each
    row's codes, scale and zero; fp16/bf16 caches store the values cast to their dtype."""
    check_tensor("key", key, dtypes=_KEY_DTYPES, ndim=3, last_contiguous=True)
    dev = key.device
    kc = cache_view("key_cache", key_cache)
    vc = cache_view("value_cache", value_cache)
    t, hkv, d = key.shape
    check_tensor(
        "value", value, dtypes=_KEY_DTYPES, shape=(t, hkv, d), device=dev, last_contiguous=True
    )
    quant = cache_quant("key_cache", key_cache, d)
    row = cache_row(key_cache, d, quant)
    check_tensor("key_cache", key_cache, shape=(None, None, hkv, row), device=dev)
    check_tensor(
        "value_cache",
        value_cache,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=dev,
    )
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(t,), device=dev)
    check(d >= 1 and d == next_pow2(d), lambda: f"key has head_dim {d}; expected a power of two")
    ks = scale_tensor("k_scale", k_scale, dev)
    vs = scale_tensor("v_scale", v_scale, dev)
    if t == 0:
        return
    _write_kv_cache_kernel[(t,)](
        key,
        value,
        kc,
        vc,
        slot_mapping,
        ks,
        vs,
        hkv,
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
        HEAD_DIM=d,
        BLOCK_H=next_pow2(hkv),
        IS_FP8=key_cache.dtype == FP8,
        QUANT=quant,
        num_warps=NUM_WARPS,
    )


def aot_variants() -> list[AotVariant]:
    """fp16/bf16/fp32 key x fp16/bf16/fp8/int8/int4 cache, head_dim 64 and 128, 8 KV heads
    (BLOCK_H is next_pow2(num_kv_heads): models with other head counts compile the same code),
    block 16."""
    variants = []
    for kdt in _KEY_DTYPES:
        for cdt, quant in [(c, 0) for c in CACHE_DTYPES if c != torch.uint8] + [
            (torch.uint8, 8),
            (torch.uint8, 4),
        ]:
            for d in (64, 128):
                sig = {
                    "key_ptr": f"*{TRITON_TYPE[kdt]}",
                    "value_ptr": f"*{TRITON_TYPE[kdt]}",
                    "kc_ptr": f"*{TRITON_TYPE[cdt]}",
                    "vc_ptr": f"*{TRITON_TYPE[cdt]}",
                    "slot_ptr": "*i64",
                    "ks_ptr": "*fp32",
                    "vs_ptr": "*fp32",
                    "num_kv_heads": "i32",
                }
                for s in ("kt", "kh", "vt", "vh", "kcb", "kco", "kch", "vcb", "vco", "vch"):
                    sig[f"stride_{s}"] = "i32"
                consts = {
                    "BLOCK_SIZE": 16,
                    "HEAD_DIM": d,
                    "BLOCK_H": 8,
                    "IS_FP8": cdt == FP8,
                    "QUANT": quant,
                }
                sig.update({k: "constexpr" for k in consts})
                variants.append(
                    AotVariant(
                        _write_kv_cache_kernel,
                        sig,
                        consts,
                        {"num_warps": NUM_WARPS},
                        name=f"write_kv_{TRITON_TYPE[kdt]}_{f'int{quant}' if quant else TRITON_TYPE[cdt]}_d{d}",
                    )
                )
    return variants
