/* A decoder layer's element-wise CPU ops in one pass each, where the torch twins run 5-15 ops
 * (kernels/reference.py `rms_norm`, `fused_add_rms_norm`; kernels/reference_attention.py
 * `rope_and_write_kv`). Built and loaded by kernels/cpu_layer_ops.py, which documents the
 * contract. Values are fp32 (kind 0) or bf16 (kind 1, raw uint16); caches also fp8 e4m3
 * (kind 2) and int8 / int4 rows with their own fp16 scale and zero (kinds 3 and 4, the layout and
 * arithmetic of kernels/kv_quant.py, codes bit for bit). The math is fp32 and each result is rounded once to its dtype (nearest even), at the
 * points where the twins round.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

enum { K_F32 = 0, K_BF16 = 1, K_FP8_E4M3 = 2, K_INT8 = 3, K_INT4 = 4 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } b = {(uint32_t)x << 16};
    return b.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } b = {f};
    const uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16; /* nearest even */
    const uint32_t quiet_nan = (b.u >> 16) | 0x40u;
    return (uint16_t)((b.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded); /* branch-free */
}

static inline float load(const void *p, int kind, int64_t i) {
    return kind == K_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* value rounded to the dtype of `kind` and back (what a store then a load gives) */
static inline float round_to(float v, int kind) {
    return kind == K_F32 ? v : bf16_to_f32(f32_to_bf16(v));
}

static inline void store(void *p, int kind, int64_t i, float v) {
    if (kind == K_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* float8_e4m3fn code of v (saturated to +-448, nearest even), as torch's cast gives */
static uint8_t f32_to_fp8_e4m3(float v) {
    if (isnan(v)) return 0x7f;
    uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (a >= 448.0f) return sign | 0x7e;
    if (a < ldexpf(1.0f, -6)) { /* subnormal range: steps of 2^-9 */
        int m = (int)nearbyintf(a * 512.0f);
        return sign | (uint8_t)m; /* m == 8 is the smallest normal, code 0x08: still right */
    }
    int e;
    float frac = frexpf(a, &e); /* a = frac * 2^e, frac in [0.5, 1) */
    int m = (int)nearbyintf((frac * 2.0f - 1.0f) * 8.0f);
    int exp = e - 1 + 7;
    if (m == 8) { m = 0; exp += 1; }
    if (exp > 15 || (exp == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(exp << 3) | (uint8_t)m;
}

/* float16 bits of v, nearest even (torch's .half()), subnormals included */
static uint16_t f32_to_f16(float v) {
    union { float f; uint32_t u; } b = {v};
    const uint16_t sign = (uint16_t)((b.u >> 16) & 0x8000u);
    const uint32_t a = b.u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds past 65504: infinity */
    if (a < 0x38800000u) /* below 2^-14: a subnormal half, steps of 2^-24 (exact scaling) */
        return sign | (uint16_t)nearbyintf(fabsf(v) * 16777216.0f);
    const uint32_t r = a - 0x38000000u; /* rebias the exponent (127 - 15) */
    return sign | (uint16_t)((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}

static inline float f16_to_f32(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                       : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000u) ? -v : v;
}

/* One row of D values into `dst`: int8 / int4 codes of (x - zero) / scale, then scale and zero
 * as fp16, per kernels/kv_quant.py (min/max of the row; a zero scale gives code 0). */
static void quantize_row(const float *x, int D, int bits, uint8_t *dst) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < D; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    const int q = (1 << bits) - 1;
    const uint16_t sh = f32_to_f16((hi - lo) / (float)q), zh = f32_to_f16(lo);
    const float sf = f16_to_f32(sh), zf = f16_to_f32(zh);
    const int codes = bits == 8 ? D : D / 2;
    if (bits == 4) memset(dst, 0, (size_t)codes);
    for (int i = 0; i < D; ++i) {
        int c = 0;
        if (sf > 0.0f) {
            const float r = nearbyintf((x[i] - zf) / sf);
            c = r < 0.0f ? 0 : r > (float)q ? q : (int)r;
        }
        if (bits == 8) dst[i] = (uint8_t)c;
        else dst[i / 2] |= (uint8_t)(c << ((i & 1) * 4));
    }
    memcpy(dst + codes, &sh, 2);
    memcpy(dst + codes + 2, &zh, 2);
}

/* out = weight * round(normalize(s)) with s = x (+ residual, rounded; written to summed).
 * x, residual, summed, out: rows of `hidden` values, row strides given; weight: hidden values. */
#define INLINE static inline __attribute__((always_inline))

INLINE void rms_norm_row(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                         const void *weight, void *out, void *summed, int kind, int64_t r,
                         int64_t hidden, float eps) {
    const void *src = x;
    int64_t at = r * x_stride;
    if (residual) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i)
            store(summed, kind, r * hidden + i,
                  load(x, kind, r * x_stride + i) + load(residual, kind, r * r_stride + i));
        src = summed;
        at = r * hidden;
    }
    float sumsq = 0.0f;
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = 0; i < hidden; ++i) {
        const float v = load(src, kind, at + i);
        sumsq += v * v;
    }
    const float inv = 1.0f / sqrtf(sumsq / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
        const float normed = round_to(load(src, kind, at + i) * inv, kind);
        store(out, kind, r * hidden + i, load(weight, kind, i) * normed);
    }
}

void slimserve_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                        const void *weight, void *out, void *summed, int kind, int64_t rows,
                        int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (kind == K_F32) rms_norm_row(x, x_stride, residual, r_stride, weight, out, summed, K_F32, r, hidden, eps);
        else rms_norm_row(x, x_stride, residual, r_stride, weight, out, summed, K_BF16, r, hidden, eps);
    }
}

/* out [rows, I] = round(silu(gate)) * up for x [rows, 2I] = [gate | up] (row stride given), each
 * product rounded to the dtype: the twin's `F.silu(gate) * up` (silu in fp32, rounded, then the
 * product). silu(g) = g * sigmoid(g) with e = e^-|g|: sigmoid is 1 / (1 + e) for g >= 0 and
 * e / (1 + e) below, so the exponential never overflows. */
INLINE void silu_and_mul_row(const void *x, int64_t x_stride, void *out, int kind, int64_t r,
                             int64_t I) {
    const int64_t at = r * x_stride;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
        const float g = load(x, kind, at + i), u = load(x, kind, at + I + i);
        const float e = exp_nonpositive(g < 0.0f ? g : -g);
        const float sig = (g < 0.0f ? e : 1.0f) / (1.0f + e);
        store(out, kind, r * I + i, round_to(g * sig, kind) * u);
    }
}

void slimserve_silu_and_mul(const void *x, int64_t x_stride, void *out, int kind, int64_t rows,
                            int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (kind == K_F32) silu_and_mul_row(x, x_stride, out, K_F32, r, I);
        else silu_and_mul_row(x, x_stride, out, K_BF16, r, I);
    }
}

/* RoPE (rotate_half) on q [T, H, D] and k [T, Hkv, D] in place, then the rotated k and v stored
 * at their slots of the caches [blocks * block_size, Hkv, D] (negative slots skipped). q, k, v:
 * token strides given, heads D apart. cos/sin: fp32 [T, D/2]. */
INLINE void rope_write_token(void *q, int64_t q_stride, void *k, int64_t k_stride,
                             const void *v, int64_t v_stride, int kind, int64_t t, int H,
                             int Hkv, int D, const float *cos, const float *sin, void *key_cache,
                             void *value_cache, int cache_kind, const int64_t *slots,
                             float k_scale, float v_scale) {
    const int half = D / 2;
    {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < H + Hkv; ++h) {
            void *base = h < H ? q : k;
            const int64_t row = h < H ? t * q_stride + (int64_t)h * D : t * k_stride + (int64_t)(h - H) * D;
            for (int i = 0; i < half; ++i) {
                const float x1 = load(base, kind, row + i), x2 = load(base, kind, row + half + i);
                store(base, kind, row + i, x1 * c[i] - x2 * s[i]);
                store(base, kind, row + half + i, x2 * c[i] + x1 * s[i]);
            }
        }
        const int64_t slot = slots[t];
        if (slot < 0) return;
        if (cache_kind == K_INT8 || cache_kind == K_INT4) {
            const int bits = cache_kind == K_INT8 ? 8 : 4;
            const int64_t R = (bits == 8 ? D : D / 2) + 4; /* row bytes (kernels/kv_quant.py) */
            float row[D];
            for (int h = 0; h < Hkv; ++h) {
                const int64_t dst = (slot * Hkv + h) * R;
                for (int i = 0; i < D; ++i) row[i] = load(k, kind, t * k_stride + (int64_t)h * D + i);
                quantize_row(row, D, bits, (uint8_t *)key_cache + dst);
                for (int i = 0; i < D; ++i) row[i] = load(v, kind, t * v_stride + (int64_t)h * D + i);
                quantize_row(row, D, bits, (uint8_t *)value_cache + dst);
            }
            return;
        }
        for (int h = 0; h < Hkv; ++h) {
            const int64_t src_k = t * k_stride + (int64_t)h * D, src_v = t * v_stride + (int64_t)h * D;
            const int64_t dst = (slot * Hkv + h) * (int64_t)D;
            for (int i = 0; i < D; ++i) {
                const float kv = load(k, kind, src_k + i), vv = load(v, kind, src_v + i);
                if (cache_kind == K_FP8_E4M3) {
                    ((uint8_t *)key_cache)[dst + i] = f32_to_fp8_e4m3(kv / k_scale);
                    ((uint8_t *)value_cache)[dst + i] = f32_to_fp8_e4m3(vv / v_scale);
                } else {
                    store(key_cache, cache_kind, dst + i, kv);
                    store(value_cache, cache_kind, dst + i, vv);
                }
            }
        }
    }
}

/* Returns 0, or -2 (nothing written) when a slot lies past the cache's num_slots. */
int slimserve_rope_write_kv(void *q, int64_t q_stride, void *k, int64_t k_stride,
                            const void *v, int64_t v_stride, int kind, int64_t T, int H,
                            int Hkv, int D, const float *cos, const float *sin, void *key_cache,
                            void *value_cache, int cache_kind, const int64_t *slots,
                            int64_t num_slots, float k_scale, float v_scale, int num_threads) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) return -2;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        if (kind == K_F32)
            rope_write_token(q, q_stride, k, k_stride, v, v_stride, K_F32, t, H, Hkv, D, cos, sin,
                             key_cache, value_cache, cache_kind, slots, k_scale, v_scale);
        else
            rope_write_token(q, q_stride, k, k_stride, v, v_stride, K_BF16, t, H, Hkv, D, cos, sin,
                             key_cache, value_cache, cache_kind, slots, k_scale, v_scale);
    }
    return 0;
}
