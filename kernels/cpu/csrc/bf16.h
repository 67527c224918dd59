/* Helpers shared by the CPU kernels: bf16 <-> fp32 conversions (bf16 is the top half of an fp32), an exp
 * that vectorises and, with AVX-512, the lane mask of a partial last vector. */
#ifndef LLMSERVE_BF16_H
#define LLMSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays a (quiet) NaN. Branch-free, so loops vectorise. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* exp(x) for x <= 0 as 2^n * 2^r with |r| <= 1/2 and a degree-6 Taylor polynomial (error ~1e-7,
 * an ulp or so): unlike libm's expf it vectorises (it was a third of the decode attention's time). */
static inline float expf_nonpositive(float x) {
    float t = (x < -87.f ? -87.f : x) * 1.44269504088896341f;
    float n = __builtin_rintf(t), r = (t - n) * 0.69314718055994531f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The first min(remaining, 16) lanes of a 16-lane vector. */
static inline __mmask16 first_lanes(int remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1);
}
#endif

#endif
