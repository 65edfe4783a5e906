/* Paged decode attention for the CPU: one new query token per sequence, read straight from the
 * paged KV cache (no gather of each sequence's context into a contiguous copy first).
 *
 * Built and loaded by kernels/cpu_attention.py (which documents the contract); the pure-torch
 * twin and test oracle is `paged_attention_decode` in kernels/reference_attention.py.
 *
 * Layouts: query and out fp32 [n, H, D]; caches [num_blocks, block_size, Hkv, D] of fp32,
 * bf16 (raw uint16) or float8_e4m3fn codes (uint8, value = code * scale), or int8 / int4 rows
 * [num_blocks, block_size, Hkv, R] of uint8 (R = D or D / 2 code bytes + fp16 scale and zero,
 * value = code * scale + zero: kernels/kv_quant.py); block tables int32
 * [n, bt_stride]; context lengths int32 [n]. Query head h reads KV head h / (H / Hkv).
 * A task is one sequence (or one sequence and KV head when there are few sequences); each KV
 * head's group of query heads is attended together, so each cached key and value is read once per
 * group; scores, softmax and the weighted sum are fp32. On AVX512 a bf16 cache's values are
 * widened in registers into accumulators held over the whole context (values_bf16): 279 ->
 * 203 us for 32 sequences of 192 tokens, 9 / 3 heads of 64, 2 threads, Zen 4 EPYC. A task
 * that covers a whole sequence first copies its blocks out together (gather_blocks): with 30
 * layers' caches cycling through DRAM as in a serving step, 524 -> 325 us on that shape (the
 * same cache read hot from L3: 172 -> 207 us). An fp8 cache's codes are copied out as their
 * bf16 values (gather_fp8_as_bf16) and then take the bf16 tiles: cold 875 -> 270 us (half the
 * bytes of bf16 to read; the code-by-code table lookup it replaces was compute-bound).
 *
 * A sliding window (window > 0) restricts a sequence of L cached tokens to its last `window`
 * keys (the query sits at position L - 1 and sees positions > L - 1 - window); the blocks before
 * the window are not read. Soft-capping (softcap > 0) replaces each scaled score s by
 * softcap * tanh(s / softcap) before the softmax (Gemma 2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2, KV_INT8 = 3, KV_INT4 = 4 };
/* or-ed into `kind` by the caller when every query value is a bf16 value (a bf16 model's) */
enum { QUERY_BF16 = 16 };
/* the most bytes of one sequence's key and value blocks attend copies together (gather_blocks):
 * about what stays in L2 beside the scores */
#ifndef GATHER_MAX_BYTES
#define GATHER_MAX_BYTES (768 * 1024)
#endif

static float fp8_e4m3_values[256];

static float fp8_e4m3_decode(unsigned code) {
    unsigned sign = code >> 7, exp = (code >> 3) & 15u, man = code & 7u;
    float v;
    if (exp == 15u && man == 7u) return NAN; /* e4m3fn: the only NaN codes, no infinities */
    if (exp == 0u) v = ldexpf((float)man, -9); /* subnormal: man / 8 * 2^-6 */
    else v = ldexpf(1.0f + (float)man / 8.0f, (int)exp - 7);
    return sign ? -v : v;
}

void slimserve_cpu_attention_init(void) {
    for (unsigned c = 0; c < 256; ++c) fp8_e4m3_values[c] = fp8_e4m3_decode(c);
}

static inline float f16_value(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                       : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000u) ? -v : v;
}

static inline float bf16_value(uint16_t x) {
    union { uint32_t u; float f; } bits = {(uint32_t)x << 16};
    return bits.f;
}

/* Scores of the G query heads qg [G, D] against `count` cached fp32 rows starting at k (row
 * stride `stride`), written to s[g * L + t0 + i]. */
#define INLINE static inline __attribute__((always_inline))

INLINE void block_scores(const float *restrict qg, const float *restrict k, int64_t stride,
                                int count, int G, int D, float score_scale, float *restrict s,
                                int L, int t0) {
    for (int i = 0; i < count; ++i) {
        const float *row = k + (int64_t)i * stride;
        for (int g = 0; g < G; ++g) {
            const float *qh = qg + (int64_t)g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += qh[d] * row[d];
            s[(int64_t)g * L + t0 + i] = dot * score_scale;
        }
    }
}

/* acc[g, :] += p[g, t0 + i] * v row i, for `count` fp32 rows starting at v: head by head, so a
 * head's accumulator stays in registers over the block (the rows come from L1). */
INLINE void block_values(const float *restrict s, const float *restrict v, int64_t stride,
                         int count, int G, int D, float *restrict acc, int L, int t0) {
    for (int g = 0; g < G; ++g) {
        float a[D];
        float *out = acc + (int64_t)g * D;
        const float *w = s + (int64_t)g * L + t0;
        for (int d = 0; d < D; ++d) a[d] = out[d];
        for (int i = 0; i < count; ++i) {
            const float *row = v + (int64_t)i * stride;
            const float wi = w[i];
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += wi * row[d];
        }
        for (int d = 0; d < D; ++d) out[d] = a[d];
    }
}

/* The `count` rows of one KV head in a cache block as fp32: the block itself for an fp32 cache
 * (row stride *stride), else converted into buf [count, D] (*stride becomes D). `first` and
 * *stride count cache elements (bytes for fp8, int8 and int4). */
INLINE const float *block_rows(const void *cache, int kind, int64_t first, int count,
                                      int D, int64_t *stride, float *restrict buf) {
    if (kind == KV_F32) return (const float *)cache + first;
    for (int i = 0; i < count; ++i) {
        float *dst = buf + (int64_t)i * D;
        if (kind == KV_INT8 || kind == KV_INT4) {
            const uint8_t *src = (const uint8_t *)cache + first + (int64_t)i * *stride;
            const int codes = kind == KV_INT8 ? D : D / 2;
            uint16_t sh, zh;
            memcpy(&sh, src + codes, 2);
            memcpy(&zh, src + codes + 2, 2);
            const float sc = f16_value(sh), z = f16_value(zh);
            if (kind == KV_INT8) {
#pragma omp simd
                for (int d = 0; d < D; ++d) dst[d] = (float)src[d] * sc + z;
            } else {
#pragma omp simd
                for (int j = 0; j < D / 2; ++j) {
                    dst[2 * j] = (float)(src[j] & 15u) * sc + z;
                    dst[2 * j + 1] = (float)(src[j] >> 4) * sc + z;
                }
            }
        } else if (kind == KV_BF16) {
            const uint16_t *src = (const uint16_t *)cache + first + (int64_t)i * *stride;
#pragma omp simd
            for (int d = 0; d < D; ++d) dst[d] = bf16_value(src[d]);
        } else {
            const uint8_t *src = (const uint8_t *)cache + first + (int64_t)i * *stride;
            for (int d = 0; d < D; ++d) dst[d] = fp8_e4m3_values[src[d]];
        }
    }
    *stride = D;
    return buf;
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_TILES 1

/* In-place transpose of 16 rows of 16 32-bit elements (r[i] lane j -> r[j] lane i). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4b + k] holds, in 128-bit lane l, rows 4b..4b+3 of column 4l + (k's column in the lane) */
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Scores of the G query heads (bf16 pairs qp [G, D / 2] as uint32) against `count` <= 16 bf16
 * cache rows starting at k (row stride `stride` elements), s[g * L + t0 + i]: the rows are
 * transposed by bf16 pairs in registers, so one vdpbf16ps adds a pair of dimensions for 16 keys
 * at once (fp32 accumulation, no horizontal sums). */
static inline void tile_scores_bf16(const uint32_t *restrict qp, const uint16_t *restrict k,
                                    int64_t stride, int count, int G, int D, float score_scale,
                                    float *restrict s, int L, int t0) {
    const int P = D / 2; /* bf16 pairs per row: 32 or 64 */
    __m512i kt[4][16];   /* [pairs / 16][16 columns] */
    for (int c = 0; c < P / 16; ++c) {
        for (int i = 0; i < 16; ++i)
            kt[c][i] = i < count ? _mm512_loadu_si512((const void *)(k + (int64_t)i * stride + 32 * c))
                                 : _mm512_setzero_si512();
        transpose16(kt[c]);
    }
    const __mmask16 live = (__mmask16)((1u << count) - 1u);
    for (int g = 0; g < G; ++g) {
        const uint32_t *q = qp + (int64_t)g * P;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int c = 0; c < P / 16; ++c) {
            for (int j = 0; j < 16; j += 2) {
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)kt[c][j],
                                      (__m512bh)_mm512_set1_epi32((int)q[16 * c + j]));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)kt[c][j + 1],
                                      (__m512bh)_mm512_set1_epi32((int)q[16 * c + j + 1]));
            }
        }
        const __m512 v = _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(score_scale));
        _mm512_mask_storeu_ps(s + (int64_t)g * L + t0, live, v);
    }
}

/* acc[g, 16 c0 .. 16 (c0 + CC)) = sum over t in [begin, L) of p[g, t] * v row t, for G heads of
 * one KV head of a bf16 cache (row t at table[t / bs] * bs + t % bs; `hoff` the head's offset):
 * each row's CC chunks of 16 are widened in registers (bf16 is the top half of fp32) and
 * multiplied into G * CC accumulators that stay in registers over the whole context, in the
 * order of t, as block_values does on the converted rows. */
INLINE void values_bf16_pass(const float *restrict s, const uint16_t *restrict vc,
                             const int32_t *table, int bs, int64_t token_stride, int64_t hoff,
                             int begin, int L, int G, int CC, int c0, float *restrict acc,
                             int D) {
    __m512 a[24];
    for (int x = 0; x < G * CC; ++x) a[x] = _mm512_setzero_ps();
    for (int t = begin; t < L; ++t) {
        const uint16_t *row =
            vc + ((int64_t)table[t / bs] * bs + t % bs) * token_stride + hoff + 16 * c0;
        for (int c = 0; c < CC; ++c) {
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 16 * c))), 16));
            for (int g = 0; g < G; ++g)
                a[g * CC + c] =
                    _mm512_fmadd_ps(_mm512_set1_ps(s[(int64_t)g * L + t]), v, a[g * CC + c]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < CC; ++c) _mm512_storeu_ps(acc + (int64_t)g * D + 16 * (c0 + c), a[g * CC + c]);
}

/* values_bf16_pass over all of D, in passes of CC chunks (G * CC <= 24 accumulators), with G,
 * CC and D literals so the loops unroll and the accumulators are registers; 0 if G > 8. */
INLINE int values_bf16(const float *s, const uint16_t *vc, const int32_t *table, int bs,
                       int64_t token_stride, int64_t hoff, int begin, int L, int G, int D,
                       float *acc) {
#define VPASS(GG, CCC)                                                                          \
    for (int c0 = 0; c0 < D / 16; c0 += CCC)                                                    \
        values_bf16_pass(s, vc, table, bs, token_stride, hoff, begin, L, GG, CCC, c0, acc, D); \
    return 1
#define VCASE(GG)                                     \
    case GG:                                          \
        if (GG * (D / 16) <= 24) { VPASS(GG, D / 16); } \
        if (GG <= 6) { VPASS(GG, 4); }                \
        VPASS(GG, 2)
    switch (G) {
        VCASE(1); VCASE(2); VCASE(3); VCASE(4); VCASE(5); VCASE(6); VCASE(7); VCASE(8);
    }
#undef VCASE
#undef VPASS
    return 0;
}
#endif

/* Softmax of each head's scores at [start, L); the block-aligned ones before, [begin, start),
 * get weight 0 (outside the window). softcap > 0 caps the scores first. */
static void softmax_rows(float *scores, int G, int L, int begin, int start, float softcap) {
    for (int g = 0; g < G; ++g) {
        float *s = scores + (int64_t)g * L;
        float m = -INFINITY, sum = 0.0f;
        for (int t = begin; t < start; ++t) s[t] = 0.0f;
        if (softcap > 0.0f) {
            const float inv_cap = 1.0f / softcap;
            for (int t = start; t < L; ++t) s[t] = softcap * tanhf(s[t] * inv_cap);
        }
        for (int t = start; t < L; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = start; t < L; ++t) {
            s[t] = exp_nonpositive(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int t = start; t < L; ++t) s[t] *= inv;
    }
}

/* Copies cache blocks b0 .. b1 - 1 of a sequence (block ids from `table`, `block_bytes` each, of
 * the key and the value cache) into kdst / vdst in order, four blocks of each cache at a time,
 * their 64-byte lines interleaved. A sequence's blocks lie anywhere in the cache, and each step
 * reads every sequence's cache from DRAM (all layers' caches exceed L3): read block by block,
 * each new block waited on memory (software prefetch hints did not help on the Zen 4 this was
 * measured on); eight streams at once keep several misses in flight, and the attention then
 * reads the copies from L2. */
#ifndef GATHER_WAYS
#define GATHER_WAYS 4
#endif
static void gather_blocks(const char *kc, const char *vc, const int32_t *table, int b0, int b1,
                          int64_t block_bytes, char *restrict kdst, char *restrict vdst) {
    for (int b = b0; b < b1; b += GATHER_WAYS) {
        const int w = b1 - b < GATHER_WAYS ? b1 - b : GATHER_WAYS;
        const char *ks[GATHER_WAYS], *vs[GATHER_WAYS];
        char *kd = kdst + (int64_t)(b - b0) * block_bytes, *vd = vdst + (int64_t)(b - b0) * block_bytes;
        for (int i = 0; i < w; ++i) {
            ks[i] = kc + (int64_t)table[b + i] * block_bytes;
            vs[i] = vc + (int64_t)table[b + i] * block_bytes;
        }
        int64_t off = 0;
#ifdef __AVX512F__
        for (; off + 64 <= block_bytes; off += 64)
            for (int i = 0; i < w; ++i) {
                _mm512_storeu_si512((void *)(kd + i * block_bytes + off),
                                    _mm512_loadu_si512((const void *)(ks[i] + off)));
                _mm512_storeu_si512((void *)(vd + i * block_bytes + off),
                                    _mm512_loadu_si512((const void *)(vs[i] + off)));
            }
#endif
        if (off < block_bytes)
            for (int i = 0; i < w; ++i) {
                memcpy(kd + i * block_bytes + off, ks[i] + off, (size_t)(block_bytes - off));
                memcpy(vd + i * block_bytes + off, vs[i] + off, (size_t)(block_bytes - off));
            }
    }
}

#if defined(HAVE_BF16_TILES) && defined(__AVX512BW__)
/* The bf16 bits of 32 float8_e4m3fn codes (every e4m3 value is a bf16 value): a normal code's
 * exponent rebiased (7 -> 127) under its 3 mantissa bits, the subnormals (m * 2^-9) from a
 * table, NaN (|code| 0x7f) as bf16's quiet NaN; the sign bit moved up. */
static inline __m512i fp8_e4m3_to_bf16_bits(__m256i codes) {
    const __m512i c = _mm512_cvtepu8_epi16(codes);
    const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7f));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
    __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    /* m * 2^-9 for m = 0..7 (0x3B00 = 2^-9), in lanes 0-7, the only ones read (the
     * index is masked to m < 8); the other lanes repeat them */
    const __m512i sub = _mm512_set_epi16(
        0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
        0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
        0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
        0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
    bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)),
                                         mag, sub);
    bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                                 _mm512_set1_epi16(0x7fc0));
    return _mm512_or_si512(bits, sign);
}

/* gather_blocks for fp8 caches, each code written as its bf16 value (two bytes) */
static void gather_fp8_as_bf16(const uint8_t *kc, const uint8_t *vc, const int32_t *table, int b0,
                               int b1, int64_t block_bytes, uint16_t *restrict kdst,
                               uint16_t *restrict vdst) {
    for (int b = b0; b < b1; b += GATHER_WAYS) {
        const int w = b1 - b < GATHER_WAYS ? b1 - b : GATHER_WAYS;
        const uint8_t *ks[GATHER_WAYS], *vs[GATHER_WAYS];
        uint16_t *kd = kdst + (int64_t)(b - b0) * block_bytes, *vd = vdst + (int64_t)(b - b0) * block_bytes;
        for (int i = 0; i < w; ++i) {
            ks[i] = kc + (int64_t)table[b + i] * block_bytes;
            vs[i] = vc + (int64_t)table[b + i] * block_bytes;
        }
        int64_t off = 0;
        for (; off + 32 <= block_bytes; off += 32)
            for (int i = 0; i < w; ++i) {
                _mm512_storeu_si512((void *)(kd + i * block_bytes + off),
                                    fp8_e4m3_to_bf16_bits(_mm256_loadu_si256((const __m256i *)(ks[i] + off))));
                _mm512_storeu_si512((void *)(vd + i * block_bytes + off),
                                    fp8_e4m3_to_bf16_bits(_mm256_loadu_si256((const __m256i *)(vs[i] + off))));
            }
        for (; off < block_bytes; ++off)
            for (int i = 0; i < w; ++i) {
                const float kv = fp8_e4m3_values[ks[i][off]], vv = fp8_e4m3_values[vs[i][off]];
                uint32_t kb, vb;
                memcpy(&kb, &kv, 4);
                memcpy(&vb, &vv, 4);
                kd[i * block_bytes + off] = (uint16_t)(kb >> 16);
                vd[i * block_bytes + off] = (uint16_t)(vb >> 16);
            }
    }
}
#endif

/* Attention of the query heads of KV heads [h0, h1) of one sequence (G = H / Hkv heads each).
 * gbuf (NULL: none): room for the sequence's key and value blocks and their table, where they
 * are copied first (gather_blocks) when the task covers every KV head. */
INLINE void attend(const float *q, const void *kc, const void *vc, int kind, int q_bf16, const int32_t *table,
                   int L, int H, int Hkv, int D, int bs, int h0, int h1, float score_scale,
                   float v_scale, float *out, float *scores, float *acc, float *rows_buf,
                   int window, float softcap, char *gbuf) {
    const int G = H / Hkv;
    /* the first key the query sees, and the start of its cache block (where the loops begin) */
    const int start = window > 0 && L > window ? L - window : 0;
    const int begin = start / bs * bs;
    /* a head's row in cache elements: D, or for int8 / int4 its code bytes + fp16 scale, zero */
    const int64_t R = kind == KV_INT8 ? D + 4 : kind == KV_INT4 ? D / 2 + 4 : D;
    const int64_t token_stride = (int64_t)Hkv * R;
#ifdef HAVE_BF16_TILES
    const int tileable = q_bf16 && (D == 64 || D == 128) && bs % 16 == 0 && G <= 64;
#endif
    if (gbuf && h0 == 0 && h1 == Hkv && L > begin) {
        const int b0 = begin / bs, b1 = (L + bs - 1) / bs;
        const int64_t block_bytes = (int64_t)bs * token_stride * (kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1);
        int widen = 0; /* fp8 codes copied out as their bf16 values, for the bf16 tiles */
#if defined(HAVE_BF16_TILES) && defined(__AVX512BW__)
        widen = kind == KV_FP8_E4M3 && tileable;
#endif
        const int64_t out_bytes = widen ? 2 * block_bytes : block_bytes;
        char *kd = gbuf, *vd = gbuf + (int64_t)(b1 - b0) * out_bytes;
        int32_t *local = (int32_t *)(vd + (int64_t)(b1 - b0) * out_bytes);
#if defined(HAVE_BF16_TILES) && defined(__AVX512BW__)
        if (widen) {
            gather_fp8_as_bf16((const uint8_t *)kc, (const uint8_t *)vc, table, b0, b1, block_bytes,
                               (uint16_t *)kd, (uint16_t *)vd);
            kind = KV_BF16;
        } else
#endif
        gather_blocks((const char *)kc, (const char *)vc, table, b0, b1, block_bytes, kd, vd);
        for (int b = b0; b < b1; ++b) local[b] = b - b0;
        kc = kd, vc = vd, table = local;
    }
#ifdef HAVE_BF16_TILES
    const int tiles = tileable && kind == KV_BF16;
#endif
    for (int h = h0; h < h1; ++h) {
        const float *qg = q + (int64_t)h * G * D;
#ifdef HAVE_BF16_TILES
        if (tiles) {
            /* the query heads as bf16 pairs (exact: a bf16 model's queries are bf16 values) */
            uint32_t qp[64 * 64];
            for (int i = 0; i < G * D / 32; ++i) {
                const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 32 * i + 16),
                                                       _mm512_loadu_ps(qg + 32 * i));
                _mm512_storeu_si512((void *)(qp + 16 * i), (__m512i)b);
            }
            for (int t0 = begin; t0 < L; t0 += 16) {
                const int count = L - t0 < 16 ? L - t0 : 16;
                const int64_t first = ((int64_t)table[t0 / bs] * bs + t0 % bs) * token_stride + (int64_t)h * R;
                tile_scores_bf16(qp, (const uint16_t *)kc + first, token_stride, count, G, D,
                                 score_scale, scores, L, t0);
            }
        } else
#endif
        for (int t0 = begin; t0 < L; t0 += bs) {
            const int count = L - t0 < bs ? L - t0 : bs;
            int64_t stride = token_stride;
            const float *k = block_rows(kc, kind, ((int64_t)table[t0 / bs] * bs) * token_stride + (int64_t)h * R,
                                        count, D, &stride, rows_buf);
            block_scores(qg, k, stride, count, G, D, score_scale, scores, L, t0);
        }
        softmax_rows(scores, G, L, begin, start, softcap);
        memset(acc, 0, sizeof(float) * (size_t)G * D);
#ifdef HAVE_BF16_TILES
        if (!(kind == KV_BF16 && (D == 64 || D == 128) &&
              values_bf16(scores, (const uint16_t *)vc, table, bs, token_stride, (int64_t)h * R,
                          begin, L, G, D, acc)))
#endif
        for (int t0 = begin; t0 < L; t0 += bs) {
            const int count = L - t0 < bs ? L - t0 : bs;
            int64_t stride = token_stride;
            const float *v = block_rows(vc, kind, ((int64_t)table[t0 / bs] * bs) * token_stride + (int64_t)h * R,
                                        count, D, &stride, rows_buf);
            block_values(scores, v, stride, count, G, D, acc, L, t0);
        }
        float *og = out + (int64_t)h * G * D;
        for (int i = 0; i < G * D; ++i) og[i] = acc[i] * v_scale;
    }
}

/* attend with the head size a constant (the common 64 and 128), so its loops unroll whole. */
#define ATTEND_ARGS const float *q, const void *kc, const void *vc, int kind, int q_bf16, const int32_t *table, \
    int L, int H, int Hkv, int D, int bs, int h0, int h1, float score_scale, float v_scale,          \
    float *out, float *scores, float *acc, float *rows_buf, int window, float softcap, char *gbuf
#define ATTEND_WITH(DIM) attend(q, kc, vc, kind, q_bf16, table, L, H, Hkv, DIM, bs, h0, h1, score_scale, \
                                v_scale, out, scores, acc, rows_buf, window, softcap, gbuf)
static void attend_d64(ATTEND_ARGS) { (void)D; ATTEND_WITH(64); }
static void attend_d128(ATTEND_ARGS) { (void)D; ATTEND_WITH(128); }
static void attend_any(ATTEND_ARGS) { ATTEND_WITH(D); }

/* window: keys per query under a sliding window (0: all); softcap: the scores' cap (0: none).
 * Returns 0; -2 when a context length or block id lies outside the tables or the cache (nothing
 * is read then); -1 when a thread's scratch could not be allocated (out is then incomplete). */
int slimserve_paged_decode_attention(const float *query, const void *key_cache,
                                     const void *value_cache, int kind,
                                     const int32_t *block_tables, int64_t bt_stride,
                                     const int32_t *context_lens, float *out, int n, int H,
                                     int Hkv, int D, int block_size, int64_t num_blocks,
                                     float scale, float k_scale, float v_scale, int num_threads,
                                     int window, float softcap) {
    int max_len = 1;
    for (int r = 0; r < n; ++r) {
        const int L = context_lens[r];
        if (L < 0 || (int64_t)L > bt_stride * block_size) return -2;
        for (int b = 0; b < (L + block_size - 1) / block_size; ++b) {
            const int32_t blk = block_tables[(int64_t)r * bt_stride + b];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
        max_len = L > max_len ? L : max_len;
    }
    const int G = H / Hkv;
    /* Whole sequences per task when there are enough of them (each cache block then read in
     * one pass over its KV heads), else one task per (sequence, KV head). */
    const int threads = num_threads > 0 ? num_threads : 1;
    const int per_row = n >= 4 * threads ? Hkv : 1;
    const int chunks = Hkv / per_row;
    const int tasks = n * chunks;
    const int q_bf16 = (kind & QUERY_BF16) != 0;
    kind &= ~QUERY_BF16;
    void (*attend_fn)(ATTEND_ARGS) = D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const size_t floats = (size_t)G * max_len + (size_t)G * D + (size_t)block_size * D;
        /* a bf16 cache's blocks of one sequence, keys and values, and their table (attend) */
        const int max_blocks = (max_len + block_size - 1) / block_size;
        const size_t row_bytes = kind == KV_F32 ? 4 * (size_t)D : kind == KV_BF16 ? 2 * (size_t)D
                               : kind == KV_INT8 ? (size_t)D + 4 : kind == KV_INT4 ? (size_t)D / 2 + 4
                               : 2 * (size_t)D; /* fp8: room for its codes as bf16 values */
        const size_t gbytes = per_row == Hkv
            ? 2 * (size_t)max_blocks * block_size * Hkv * row_bytes + sizeof(int32_t) * (size_t)max_blocks : 0;
        const int gather = gbytes > 0 && gbytes <= GATHER_MAX_BYTES;
        float *scratch = malloc(sizeof(float) * floats + (gather ? gbytes + 64 : 0));
        char *gbuf = gather && scratch ? (char *)(((uintptr_t)(scratch + floats) + 63) & ~(uintptr_t)63) : NULL;
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; ++task) {
            if (!scratch) continue;
            const int r = task / chunks, h0 = (task % chunks) * per_row;
            attend_fn(query + (int64_t)r * H * D, key_cache, value_cache, kind, q_bf16,
                   block_tables + (int64_t)r * bt_stride, context_lens[r], H, Hkv, D, block_size,
                   h0, h0 + per_row, scale * k_scale, v_scale, out + (int64_t)r * H * D, scratch,
                   scratch + (size_t)G * max_len, scratch + (size_t)G * max_len + (size_t)G * D,
                   window, softcap, gbuf);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
