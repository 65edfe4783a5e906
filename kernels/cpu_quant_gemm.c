/* W8A8 Linears on CPU: dynamic per-token int8 activations times int8 per-channel weights with
 * exact int32 accumulation. Built and loaded by kernels/cpu_quant_gemm.py, which documents the
 * contract; twins: kernels/reference.py `quantize_per_token_int8` (codes and scales bit for
 * bit) and `w8a8_gemm` (the same fp32 epilogue, in its order, without fused multiply-adds).
 *
 * The products are formed in 16 bits (vpmovsxbw + vpmaddwd: |a*b + c*d| <= 2 * 128 * 128 fits
 * int32), not with vpmaddubsw, whose 16-bit pair sums saturate: oneDNN's int8 GEMM on an AVX2
 * CPU without VNNI gives 143340 for 40 products of 100 * 100 (measured, torch 2.13). Where the
 * compiler targets AVX512-VNNI (-march=native on such a CPU), vpdpbusd forms them instead: four
 * u8 x s8 products per 32-bit lane, added without saturation (dot_tile), and on weights packed
 * 16 channels by 4 k a vector (slimserve_w8a8_pack) no horizontal sums (slimserve_w8a8_gemm_packed).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#pragma STDC FP_CONTRACT OFF

#define NR 4 /* weight rows (output channels) a tile */
#define MR 2 /* activation rows (tokens) a tile */
#define VNNI_MAX_K 65536 /* K * 255 * 128 < 2^31 */

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/* f rounded to the nearest bfloat16 (ties to even), as torch's .to(torch.bfloat16) does for the
 * finite positive scales here */
static inline float round_to_bf16(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    return v.f;
}

/* element k of a row of fp32 values, or of bf16 bits (the top half of an fp32: exact) */
static inline __attribute__((always_inline)) float load1(const void *r, int bf16, int64_t k) {
    if (!bf16) return ((const float *)r)[k];
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)((const uint16_t *)r)[k] << 16};
    return v.f;
}

#ifdef __AVX2__
static inline __attribute__((always_inline)) __m256 load8(const void *r, int bf16, int64_t k) {
    if (!bf16) return _mm256_loadu_ps((const float *)r + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)r + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* One row: scale = max(absmax / 127, FLT_EPSILON), rounded to bfloat16 if bf16_scale (the twin
 * rounds the scale to x's dtype); codes = round_half_even(clamp(x / scale, -128, 127)). IEEE
 * division, as torch's `/` does. */
NO_CONTRACT static inline __attribute__((always_inline)) void quantize_row(
    const void *r, int bf16, int64_t K, int8_t *out, float *scale, int bf16_scale) {
    float amax = 0.0f;
    int64_t k = 0;
#ifdef __AVX2__
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(r, bf16, k), abs_mask));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
    for (; k < K; k++) {
        const float a = fabsf(load1(r, bf16, k));
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    s = s < FLT_EPSILON ? FLT_EPSILON : s;
    if (bf16_scale) s = round_to_bf16(s);
    *scale = s;
    k = 0;
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_div_ps(load8(r, bf16, k), vs);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        int32_t codes[8];
        _mm256_storeu_si256((__m256i *)codes, _mm256_cvtps_epi32(v));
        for (int i = 0; i < 8; i++) out[k + i] = (int8_t)codes[i];
    }
#endif
    for (; k < K; k++) {
        float v = load1(r, bf16, k) / s;
        v = v < -128.0f ? -128.0f : v;
        v = v > 127.0f ? 127.0f : v;
        out[k] = (int8_t)nearbyintf(v);
    }
}

/* Per row of fp32 x [M, K] (row stride ldx): quantize_row. */
NO_CONTRACT void slimserve_quantize_per_token(const float *x, int64_t ldx, int64_t M, int64_t K,
                                              int8_t *q, float *scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, 0, K, q + m * K, scale + m, 0);
}

/* The same for bf16 x [M, K] (raw bits, row stride ldx): each value widened exactly, the scale
 * rounded to bf16 (fp32 in `scale`), as the twin does for a bf16 x. */
NO_CONTRACT void slimserve_quantize_per_token_bf16(const uint16_t *x, int64_t ldx, int64_t M,
                                                   int64_t K, int8_t *q, float *scale,
                                                   int num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, 1, K, q + m * K, scale + m, 1);
}

#ifdef __AVX2__
static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}
#endif

/* acc[i][j] = sum_k x[i][k] * w[j][k] for i < mr, j < nr (rows K apart), exact in int32. With
 * literal mr / nr the loops unroll and the accumulators stay in registers. wsum[j] = sum_k
 * w[j][k] (the VNNI path's correction; NULL: summed here). */
static inline __attribute__((always_inline)) void dot_tile(const int8_t *x, int mr,
                                                           const int8_t *w, int nr, int64_t K,
                                                           const int32_t *wsum,
                                                           int32_t acc[MR][NR]) {
    int64_t k = 0;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies u8 by s8, four products a lane, and adds them to int32 without
     * saturation: x + 128 (x ^ 0x80 as u8) times w, minus 128 * sum_k w[j][k], is exact while
     * K * 255 * 128 < 2^31. Masked loads zero the tail (a zero weight adds nothing). */
    if (K <= VNNI_MAX_K) {
        const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
        __m512i a[MR][NR], ws[NR];
        for (int j = 0; j < nr; j++) ws[j] = _mm512_setzero_si512();
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) a[i][j] = _mm512_setzero_si512();
        for (; k < K; k += 64) {
            const __mmask64 mask = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
            __m512i xv[MR];
            for (int i = 0; i < mr; i++)
                xv[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, x + i * K + k), flip);
            for (int j = 0; j < nr; j++) {
                const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + j * K + k);
                if (!wsum) ws[j] = _mm512_dpbusd_epi32(ws[j], ones, wv);
                for (int i = 0; i < mr; i++) a[i][j] = _mm512_dpbusd_epi32(a[i][j], xv[i], wv);
            }
        }
        for (int j = 0; j < nr; j++) {
            const int32_t sum = wsum ? wsum[j] : _mm512_reduce_add_epi32(ws[j]);
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_reduce_add_epi32(a[i][j]) - 128 * sum;
        }
        return;
    }
#endif
#ifdef __AVX2__
    __m256i a[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) a[i][j] = _mm256_setzero_si256();
    for (; k + 16 <= K; k += 16) {
        __m256i xv[MR];
        for (int i = 0; i < mr; i++)
            xv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + i * K + k)));
        for (int j = 0; j < nr; j++) {
            const __m256i wv =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j * K + k)));
            for (int i = 0; i < mr; i++)
                a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(xv[i], wv));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = hsum(a[i][j]);
#endif
    for (; k < K; k++)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] += (int32_t)x[i * K + k] * (int32_t)w[j * K + k];
}

/* out = (float)acc * x_scale[m] * w_scale[n] (+ bias[n]), in that order, no fused multiply-add */
NO_CONTRACT static void store_tile(const int32_t acc[MR][NR], int mr, int nr, int64_t m,
                                   int64_t n, const float *xs, const float *ws, const float *bias,
                                   float *out, int64_t N) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float v = (float)acc[i][j] * xs[m + i];
            v = v * ws[n + j];
            if (bias) v = v + bias[n + j];
            out[(m + i) * N + n + j] = v;
        }
}

/* out [M, N] fp32 = x [M, K] int8 (scales xs [M]) @ w [N, K]^T int8 (scales ws [N]) + bias [N]
 * (or NULL); all contiguous. wsum [N]: each weight row's sum (or NULL: summed per tile).
 * Threads split the output channels; each walks every token row over its weight tile, which
 * stays in L1. */
void slimserve_w8a8_gemm(const int8_t *x, const float *xs, int64_t M, const int8_t *w,
                         const float *ws, const float *bias, float *out, int64_t N, int64_t K,
                         const int32_t *wsum, int num_threads) {
    const int64_t blocks = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        const int8_t *wb = w + n * K;
        const int32_t *sb = wsum ? wsum + n : 0;
        int32_t acc[MR][NR];
        int64_t m = 0;
        for (; m + MR <= M; m += MR) {
            if (nr == NR)
                dot_tile(x + m * K, MR, wb, NR, K, sb, acc);
            else
                dot_tile(x + m * K, MR, wb, nr, K, sb, acc);
            store_tile(acc, MR, nr, m, n, xs, ws, bias, out, N);
        }
        for (; m < M; m++) {
            if (nr == NR)
                dot_tile(x + m * K, 1, wb, NR, K, sb, acc);
            else
                dot_tile(x + m * K, 1, wb, nr, K, sb, acc);
            store_tile(acc, 1, nr, m, n, xs, ws, bias, out, N);
        }
    }
}

/* 1 when this build has the packed VNNI GEMM below (the compiler targets AVX512-VNNI and -BW). */
int slimserve_w8a8_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#define VG 16 /* output channels a packed group: one zmm of int32 accumulators */
#define VNB 4 /* groups a tile */
#define VMR 4 /* token rows a tile */

/* w [N, K] int8 -> packed [ceil(N/16)][ceil(K/4)][16][4]: for group g and k-quad q, channel
 * 16g + c's bytes k = 4q .. 4q + 3 at ((g * KQ + q) * 16 + c) * 4. Padding (channels >= N,
 * k >= K) is zero, so it adds nothing to a sum. One vpdpbusd of a broadcast 4-byte x quad then
 * adds 4 products to each of 16 channels' int32 lanes: no horizontal sums, as oneDNN's VNNI
 * layouts do. */
void slimserve_w8a8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *packed) {
    const int64_t groups = (N + VG - 1) / VG, kq = (K + 3) / 4;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t q = 0; q < kq; q++)
            for (int c = 0; c < VG; c++)
                for (int r = 0; r < 4; r++) {
                    const int64_t n = g * VG + c, k = q * 4 + r;
                    packed[((g * kq + q) * VG + c) * 4 + r] = n < N && k < K ? w[n * K + k] : 0;
                }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc[i][j] (16 int32 lanes: channels of group j) = sum over k of xu[i][k] * w, xu = x + 128 as
 * u8 rows KP apart (KP = 4 * kq), wp the tile's first group, groups gstride bytes apart. */
NO_CONTRACT static inline __attribute__((always_inline)) void vnni_tile(const uint8_t *xu, int64_t kq,
                                                            int mr, const int8_t *wp,
                                                            int64_t gstride, int nb,
                                                            __m512i acc[VMR][VNB]) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t q = 0; q < kq; q++) {
        __m512i wv[VNB];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_loadu_si512(wp + j * gstride + q * 64);
        for (int i = 0; i < mr; i++) {
            int32_t quad;
            memcpy(&quad, xu + i * kq * 4 + q * 4, 4);
            const __m512i xb = _mm512_set1_epi32(quad);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, wv[j]);
        }
    }
}

/* bf16 bits of fp32 lanes, nearest even (torch's rounding for finite values) */
static inline __m256i to_bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* the epilogue of store_tile on 16 lanes: ((float)(acc - 128 * wsum) * xs) * ws (+ bias), no
 * fused multiply-adds, stored as fp32 or bf16, masked to the channels < N */
NO_CONTRACT static inline __attribute__((always_inline)) void vnni_store(__m512i acc, int64_t m, int64_t n,
                                                             int64_t N, const float *xs,
                                                             const float *ws, const float *bias,
                                                             const int32_t *wsum, void *out,
                                                             int out_bf16) {
    const __mmask16 mask = N - n >= VG ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, wsum + n), 7);
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr));
    v = _mm512_mul_ps(v, _mm512_set1_ps(xs[m]));
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, ws + n));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
    if (out_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)out + m * N + n, mask, to_bf16_bits(v));
    else
        _mm512_mask_storeu_ps((float *)out + m * N + n, mask, v);
}

NO_CONTRACT static inline __attribute__((always_inline)) void vnni_block(
    const uint8_t *xu, int64_t m, int mr, int64_t kq, const int8_t *wp, int64_t g, int nb,
    int64_t N, const float *xs, const float *ws, const float *bias, const int32_t *wsum,
    void *out, int out_bf16) {
    __m512i acc[VMR][VNB];
    const int64_t gstride = kq * 64;
    vnni_tile(xu + m * kq * 4, kq, mr, wp + g * gstride, gstride, nb, acc);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nb; j++)
            vnni_store(acc[i][j], m + i, (g + j) * VG, N, xs, ws, bias, wsum, out, out_bf16);
}
#endif

/* out [M, N] (fp32, or bf16 bits if out_bf16) = x [M, K] int8 (scales xs [M]) @ w^T, w packed by
 * slimserve_w8a8_pack, wsum [N] its rows' sums, ws [N] its scales, bias [N] or NULL: the values
 * of slimserve_w8a8_gemm bit for bit (rounded to bf16 after). Only in a VNNI build
 * (slimserve_w8a8_vnni); returns 0 when it did nothing (no VNNI, or no memory), 1 when done.
 * Threads take equal runs of 16-channel groups and walk every token row over them. */
NO_CONTRACT int slimserve_w8a8_gemm_packed(const int8_t *x, const float *xs, int64_t M, const int8_t *wp,
                               const float *ws, const float *bias, void *out, int out_bf16,
                               int64_t N, int64_t K, const int32_t *wsum, int num_threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t kq = (K + 3) / 4, groups = (N + VG - 1) / VG;
    uint8_t *xu = malloc((size_t)(M * kq * 4 + 64));
    if (!xu) return 0;
    for (int64_t m = 0; m < M; m++) { /* x + 128 as u8, padded with 128 (times a zero weight) */
        uint8_t *dst = xu + m * kq * 4;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64)
            _mm512_storeu_si512(dst + k, _mm512_xor_si512(_mm512_loadu_si512(x + m * K + k),
                                                          _mm512_set1_epi8((char)0x80)));
        for (; k < kq * 4; k++) dst[k] = k < K ? (uint8_t)(x[m * K + k] ^ 0x80) : 0x80;
    }
    const int threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        for (int64_t g = g0; g < g1; g += VNB) {
            const int nb = g1 - g >= VNB ? VNB : (int)(g1 - g);
            int64_t m = 0;
            for (; m + VMR <= M; m += VMR) {
                if (nb == VNB)
                    vnni_block(xu, m, VMR, kq, wp, g, VNB, N, xs, ws, bias, wsum, out, out_bf16);
                else
                    vnni_block(xu, m, VMR, kq, wp, g, nb, N, xs, ws, bias, wsum, out, out_bf16);
            }
            for (; m < M; m++) {
                if (nb == VNB)
                    vnni_block(xu, m, 1, kq, wp, g, VNB, N, xs, ws, bias, wsum, out, out_bf16);
                else
                    vnni_block(xu, m, 1, kq, wp, g, nb, N, xs, ws, bias, wsum, out, out_bf16);
            }
        }
    }
    free(xu);
    return 1;
#else
    (void)x, (void)xs, (void)M, (void)wp, (void)ws, (void)bias, (void)out, (void)out_bf16;
    (void)N, (void)K, (void)wsum, (void)num_threads;
    return 0;
#endif
}
