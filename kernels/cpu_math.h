/* Math shared by the CPU kernels in C (kernels/cpu_attention.c, kernels/cpu_layer_ops.c):
 * included by each, and hashed with each source by kernels/cpu_build.py, so an edit here
 * rebuilds both. */
#ifndef SLIMSERVE_CPU_MATH_H
#define SLIMSERVE_CPU_MATH_H

#include <stdint.h>

/* e^x for x <= 0 (attention scores less their maximum, silu's e^-|x|), vectorizable:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
 * < 2e-7 on that range), 2^n built in the exponent bits; x below -87 is taken as -87
 * (e^-87 ~ 1.6e-38, the smallest normal float's order). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln2): adding 1.5 * 2^23 leaves no fraction bits, so the sum rounds (nearest) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
