/* Helpers shared by the CPU kernels: bf16 <-> fp32 and fp16 -> fp32 conversions (bf16 is the top half of an
 * fp32), an exp that vectorises, and their 8-lane (AVX2) and 16-lane (AVX-512) forms with the lane mask of a
 * partial last vector; and the packed weight of linear_bf16.c, whose routines linear_quant.c runs on tiles it
 * dequantizes. */
#ifndef LLMSERVE_BF16_H
#define LLMSERVE_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define TILE 32 /* output rows per tile of the packed bf16 weight */

/* A packed bf16 weight (see linear_bf16.c), set up once per layer by the caller. */
struct bf16_weight {
    const uint16_t *tiles;
    int n, k;     /* k even */
    int portable; /* the plain loops even where vector code is present (tests run both paths) */
    int fma_rows; /* chunks of at least this many rows go through fp32 FMAs instead of vdpbf16ps (0: none);
                     the caller times where that pays on this CPU */
    int amx_rows; /* steps of at least this many rows go through AMX tiles where present (0: never) */
};

/* Where the pair tiles of a weight come from: `tile` of `source`, either a pointer into its packed tiles or
 * (linear_quant.c) the tile dequantized into `scratch`, a buffer of k * TILE values of the calling thread. */
typedef const uint16_t *(*pair_tile_fn)(const void *source, int tile, uint16_t *scratch);

/* out [m, w->n] = x [m, w->k] (row stride ldx) times the weight whose tiles `tile_of` gives, + bias [w->n] or
 * null: linear_bf16's routines, and so its bits, whatever the source. `scratch`: whether `tile_of` needs a
 * buffer. Returns 0, or -1 without memory for the buffers. */
int linear_bf16_from(const struct bf16_weight *w, pair_tile_fn tile_of, const void *source, int scratch,
                     const uint16_t *x, long ldx, int m, const uint16_t *bias, uint16_t *out, int num_threads);

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

/* IEEE half to float: the F16C instruction where the CPU has it, else by hand (subnormals included). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        float f = (float)mantissa * 5.9604644775390625e-8f; /* 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
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

/* Attention soft-capping (Gemma 2): cap * tanh(s / cap), tanh|x| as (1 - e) / (1 + e) with e = exp(-2|x|) <= 1,
 * so it vectorises as expf_nonpositive does; within ~1e-7 * cap of libm's. */
static inline float soft_cap(float s, float cap) {
    float x = s / cap, e = expf_nonpositive(-2.f * (x < 0.f ? -x : x)), t = (1.f - e) / (1.f + e);
    return cap * (x < 0.f ? -t : t);
}

/* RMSNorm's sum of squares of a bf16 row, in 16 interleaved partial sums added pairwise at the end: one running
 * sum would make every addition wait for the one before, where 16 lanes vectorise. Every native RMSNorm sums
 * through here, so all give the same bits. */
static inline float sum_of_squares_bf16(const uint16_t *row, int count) {
    enum { LANES = 16 };
    float part[LANES] = {0};
    int i = 0;
    for (; i + LANES <= count; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += bf16_to_float(row[i + l]) * bf16_to_float(row[i + l]);
    for (int l = 0; i < count; i++, l++) part[l] += bf16_to_float(row[i]) * bf16_to_float(row[i]);
    for (int width = LANES / 2; width; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0];
}

#if defined(__AVX512F__)
/* The first min(remaining, 16) lanes of a 16-lane vector (none where remaining <= 0). */
static inline __mmask16 first_lanes(int remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : remaining <= 0 ? 0 : (__mmask16)((1u << remaining) - 1);
}

/* expf_nonpositive() on 16 lanes. */
static inline __m512 exp512_nonpositive(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* soft_cap() on 16 lanes. */
static inline __m512 soft_cap512(__m512 s, float cap) {
    __m512 c = _mm512_set1_ps(cap), x = _mm512_div_ps(s, c);
    __m512 e = exp512_nonpositive(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f)));
    __m512 one = _mm512_set1_ps(1.f), t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mul_ps(c, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)));
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
/* expf_nonpositive() on 8 lanes. */
static inline __m256 exp256_nonpositive(__m256 x) {
    __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* soft_cap() on 8 lanes. */
static inline __m256 soft_cap256(__m256 s, float cap) {
    __m256 c = _mm256_set1_ps(cap), x = _mm256_div_ps(s, c);
    __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)); /* not -0.f: -fno-signed-zeros */
    __m256 e = exp256_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.f)));
    __m256 one = _mm256_set1_ps(1.f), t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_mul_ps(c, _mm256_or_ps(t, _mm256_and_ps(sign, x)));
}

/* fp32 lanes to bf16 as float_to_bf16 rounds them, in the high (odd: 1) or low (0) half of each 32-bit lane. */
static inline __m256i bf16_lanes(__m256 f, int odd) {
    __m256i bits = _mm256_castps_si256(f), one = _mm256_set1_epi32(1);
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(bits, 16), one)));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    /* a NaN stays a quiet NaN: bit 0x40 of its top half set */
    __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    return odd ? _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)) : _mm256_srli_epi32(r, 16);
}
#endif

#if defined(__AVX512F__)
/* 16 fp32 lanes rounded to bf16: vcvtneps2bf16 where the CPU has AVX512-BF16; else (AVX512-VNNI CPUs without
 * it, such as Cascade Lake and Ice Lake) by integer steps, rounding as float_to_bf16 does. */
static inline __m256i bf16_from_512(__m512 f) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    __m512i bits = _mm512_castps_si512(f), one = _mm512_set1_epi32(1);
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000))); /* quiet NaN */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

#ifdef __AVX512BF16__
/* Lane i of `even` and of `odd` rounded to bf16, side by side in 32-bit lane i: a pair as vdpbf16ps and TDPBF16PS
 * take it. The two-vector conversion puts lane i of `even` in word i and of `odd` in word 16 + i. */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}
#endif

/* 16 bf16 values as fp32, the lanes outside `lanes` zero (and not read: no fault past an array's end). */
static inline __m512 load_bf16_ps(__mmask16 lanes, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}
#endif

#endif
