/* Weight-only quantized linear layers for the CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), where
 *     int4: W[o, k] = d[o, g] * q[o, k] + m[o, g]   (q in 0..15; GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ),
 *           m = -8 d where the format is symmetric (GGUF Q4_0, GPTQ with sym=True), so m is not stored
 *     int8: W[o, k] = d[o, g] * q[o, k]             (q in -128..127; GGUF Q8_0/Q6_K, per-channel int8)
 * for groups g of `group` input columns.
 *
 * x is quantized too, per block of 32 columns with its own fp32 scale, so the products are integer dot
 * products: vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes per 32-bit lane and adds them, 64
 * products an instruction with no conversion of the weights to floating point. Unlike llama.cpp, which
 * rounds x to 8 bits (an error of about 0.5 % of the output, twice that of a bf16 matmul), x is rounded
 * to 16 bits, x16 = 256 * hi + lo with hi and lo signed bytes, and each weight meets both: twice the
 * instructions, an error 256 times smaller. Each sub-block (32 columns, or 16 where the group is 16)
 * gives one int32 dot product per output, which x's block scale turns into the group's fp32 sum, which
 * the group's weight scale multiplies. The int4 offsets multiply the group's exact (fp32) sum of x.
 * With AMX-INT8, steps of many rows take each sub-block's integer dot products 16 rows by 16 outputs at a time
 * from tile registers (qtile_amx); being integers they are the same whatever their order, and the floating-point
 * steps after them are the same too, so a row gets the same bits in a step of any size (batch invariance).
 *
 * Packed layout (built once by kernels/cpu/linear.py): tiles of 16 output rows; per tile, per group, its
 * sub-blocks' weights, then the group's 16 scales, then (int4, not symmetric) its 16 offsets, fp16 where all are exact
 * in fp16, else fp32. Within a sub-block, one 64-byte vector per unit of 4 columns (int8) or 8 columns
 * (int4): byte 4j+i is row j's column 4u+i (int8, stored as q + 128, unsigned), or its columns 8u+i (low
 * nibble) and 8u+4+i (high nibble) (int4), so a lane holds the 4 bytes vpdpbusd takes for one output.
 * Rows past N are zero, and so are columns past K (K is padded to a whole number of 32-column blocks;
 * x's padding is zero).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define QTILE 16
#define XBLOCK 32 /* columns of x per int8 scale */
#define MAX_QMR 8
#define STACK_SCRATCH (64 * 1024) /* quantized x up to this size lives on the stack, not the heap */

/* How far ahead of its loads each thread asks for its weight stream, into L2. The best distance depends on the
 * machine: on some a long one keeps more of the stream in flight, on others it holds up the very loads it
 * should feed. kernels/cpu/linear.py times a few on the model's own weights when it loads and sets the
 * fastest. */
static int prefetch_bytes = 4096;

void linear_quant_set_prefetch(int bytes) { prefetch_bytes = bytes; }

int linear_quant_prefetch(void) { return prefetch_bytes; }

/* A packed weight, set up once per layer by the caller. */
struct qweight {
    const uint8_t *packed;
    const int32_t *perm; /* act-order: stored column c multiplies x[perm[c]]; or null */
    int n, k, k_in;      /* k: k_in padded to a multiple of XBLOCK */
    int group;           /* columns per group (a multiple of the sub-block) */
    int sub;             /* columns per sub-block: 32, or 16 for groups of 16 */
    int bits;            /* 4 or 8 */
    int half;            /* scales and offsets stored as fp16 (1) or fp32 (0) */
    int symmetric;       /* int4 with every offset -8 scales: offsets not stored */
    int portable;        /* the plain C loops even where vector code is present (tests run both) */
};

/* x quantized per XBLOCK: hi and lo [M, k], scales [M, k / XBLOCK]; per row and group, the exact sum of
 * x (which the int4 offsets multiply) and the correction each group's sum starts from (see quantize_row). */
struct qx {
    int8_t *hi, *lo;
    float *scale, *gsum, *gcorr;
};

#define X16_MAX (127 * 256 + 127) /* the largest |x16| whose hi byte is at most 127 */

/* Bytes of a tile's group: its weights, then its 16 scales, then (int4, not symmetric) its 16 offsets. */
static long group_weight_bytes(const struct qweight *w) { return (long)w->group * w->bits / 8 * QTILE; }
static int group_value_bytes(const struct qweight *w) { return QTILE * (w->half ? 2 : 4); }

static long group_bytes(const struct qweight *w) {
    return group_weight_bytes(w) + group_value_bytes(w) * (w->bits == 4 && !w->symmetric ? 2 : 1);
}

static inline float load_value(const uint8_t *p, int j, int half) {
    if (half) {
        uint16_t h;
        memcpy(&h, p + 2 * j, 2);
        return half_to_float(h);
    }
    float f;
    memcpy(&f, p + 4 * j, 4);
    return f;
}

#if defined(__AVX512F__)
/* A tile's 16 scales or offsets (fp16 or fp32) in lanes. */
static inline __m512 load_values16(const uint8_t *p, const int HALF) {
    return HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps(p);
}
#endif

/* Column c of x's row as fp32 (zero past k_in), through the act-order where given. */
static inline float x_at(const struct qweight *w, const void *x, int is_bf16, int c) {
    int src = c >= w->k_in ? -1 : w->perm ? w->perm[c] : c;
    return src < 0 ? 0.f : is_bf16 ? bf16_to_float(((const uint16_t *)x)[src]) : ((const float *)x)[src];
}

/* One block of XBLOCK values of x into x16 = round(x / d) (nearest, ties to even, as rintf and vcvtps2dq
 * round) with d = max|x| / X16_MAX, stored as its bytes hi = floor((x16 + 128) / 256) and lo = x16 - 256 hi,
 * both signed. Stores hi, lo and d, and the sums of x16 and of x over each half of the block. */
#if defined(__AVX512F__)
static inline void quantize_block(const float *v, const void *x, int is_bf16, int8_t *hi, int8_t *lo, float *d,
                                  int *sums, float *exact) {
    __m512 half[2];
    if (v) { /* gathered already */
        half[0] = _mm512_loadu_ps(v), half[1] = _mm512_loadu_ps(v + 16);
    } else if (is_bf16) {
        __m512i raw = _mm512_loadu_si512(x);
        half[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        half[1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    } else {
        half[0] = _mm512_loadu_ps(x), half[1] = _mm512_loadu_ps((const float *)x + 16);
    }
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(half[0]), _mm512_abs_ps(half[1])));
    __m512 inv = _mm512_set1_ps(amax > 0.f ? X16_MAX / amax : 0.f);
    for (int h = 0; h < 2; h++) {
        __m512i x16 = _mm512_cvtps_epi32(_mm512_mul_ps(half[h], inv));
        __m512i high = _mm512_srai_epi32(_mm512_add_epi32(x16, _mm512_set1_epi32(128)), 8);
        _mm_storeu_si128((__m128i *)(hi + 16 * h), _mm512_cvtepi32_epi8(high));
        _mm_storeu_si128((__m128i *)(lo + 16 * h), _mm512_cvtepi32_epi8(_mm512_sub_epi32(x16, _mm512_slli_epi32(high, 8))));
        sums[h] = _mm512_reduce_add_epi32(x16);
        exact[h] = _mm512_reduce_add_ps(half[h]);
    }
    *d = amax / X16_MAX;
}
#else
static inline void quantize_block(const float *v, const void *x, int is_bf16, int8_t *hi, int8_t *lo, float *d,
                                  int *sums, float *exact) {
    float loaded[XBLOCK], amax = 0.f;
    if (!v) {
        for (int i = 0; i < XBLOCK; i++)
            loaded[i] = is_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        v = loaded;
    }
    for (int i = 0; i < XBLOCK; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    float inv = amax > 0.f ? X16_MAX / amax : 0.f;
    sums[0] = sums[1] = 0, exact[0] = exact[1] = 0.f;
    for (int i = 0; i < XBLOCK; i++) {
        int x16 = (int)rintf(v[i] * inv), high = (x16 + 128) >> 8;
        hi[i] = (int8_t)high;
        lo[i] = (int8_t)(x16 - 256 * high);
        sums[i / 16] += x16;
        exact[i / 16] += v[i];
    }
    *d = amax / X16_MAX;
}
#endif

/* One row of x (bf16 or fp32, columns in act-order where given) into blocks x16 with scales s, and per
 * group: gsum, the exact sum of x, and gcorr, what the group's sum of products starts from. Int8 weights
 * are stored as q + 128, so their products carry 128 * s * sum(x16) too: gcorr takes it off. For int4,
 * gcorr = 8 * (sum(x) - s * sum(x16)) makes the rounding of x count as if weighed by q - 8 (about the
 * weight's size: the usual offset is about -8 scales) rather than by q (0..15). */
static void quantize_row(const struct qweight *w, const void *x, int is_bf16, int8_t *hi, int8_t *lo, float *scale,
                         float *gsum, float *gcorr) {
    float v[XBLOCK];
    int groups = w->k / w->group;
    for (int g = 0; g < groups; g++) gsum[g] = gcorr[g] = 0.f;
    for (int b = 0; b < w->k / XBLOCK; b++) {
        int c0 = b * XBLOCK, gather = w->perm || c0 + XBLOCK > w->k_in, sums[2];
        if (gather)
            for (int i = 0; i < XBLOCK; i++) v[i] = x_at(w, x, is_bf16, c0 + i);
        float exact[2];
        quantize_block(gather ? v : 0, (const char *)x + (long)c0 * (is_bf16 ? 2 : 4), is_bf16, hi + c0, lo + c0,
                       scale + b, sums, exact);
        float d = scale[b];
        for (int h = 0; h < 2; h++) { /* halves: a group of 16 columns holds one */
            int g = (c0 + h * 16) / w->group;
            float quantized = d * (float)sums[h];
            gsum[g] += exact[h];
            gcorr[g] += w->bits == 4 ? 8.f * (exact[h] - quantized) : -128.f * quantized;
        }
    }
}

static inline void store_row(void *out, long at, const float *y, const void *bias, int is_bf16, int valid) {
    for (int j = 0; j < valid; j++) {
        float b = !bias ? 0.f : is_bf16 ? bf16_to_float(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
        if (is_bf16)
            ((uint16_t *)out)[at + j] = float_to_bf16(y[j] + b);
        else
            ((float *)out)[at + j] = y[j] + b;
    }
}

/* The plain C loops over the same layout, for CPUs with neither AVX512-VNNI nor AVX2. */
static void qtile_portable(const struct qweight *w, const uint8_t *tile, const struct qx *x, int m0, int mr,
                           const void *bias, int is_bf16, void *out, int valid) {
    int groups = w->k / w->group, xblocks = w->k / XBLOCK, vec_cols = w->bits == 4 ? 8 : 4;
    int values = group_value_bytes(w);
    for (int m = m0; m < m0 + mr; m++) {
        float y[QTILE] = {0};
        const uint8_t *p = tile;
        const int8_t *xh = x->hi + (long)m * w->k, *xl = x->lo + (long)m * w->k;
        for (int g = 0; g < groups; g++) {
            float gacc[QTILE];
            for (int j = 0; j < QTILE; j++) gacc[j] = x->gcorr[(long)m * groups + g];
            for (int c0 = g * w->group; c0 < (g + 1) * w->group; c0 += w->sub) {
                int32_t dot[QTILE] = {0};
                for (int u = 0; u < w->sub / vec_cols; u++, p += 64) {
                    const int8_t *h = xh + c0 + u * vec_cols, *l = xl + c0 + u * vec_cols;
                    for (int j = 0; j < QTILE; j++)
                        for (int i = 0; i < 4; i++) {
                            int byte = p[4 * j + i], x0 = 256 * h[i] + l[i];
                            dot[j] += w->bits == 8 ? byte * x0 : (byte & 15) * x0 + (byte >> 4) * (256 * h[4 + i] + l[4 + i]);
                        }
                }
                float s = x->scale[(long)m * xblocks + c0 / XBLOCK];
                for (int j = 0; j < QTILE; j++) gacc[j] += (float)dot[j] * s;
            }
            const uint8_t *d = p;
            for (int j = 0; j < QTILE; j++) y[j] += load_value(d, j, w->half) * gacc[j];
            p += values;
            if (w->bits == 4) {
                float sx = x->gsum[(long)m * groups + g];
                for (int j = 0; j < QTILE; j++) y[j] += (w->symmetric ? -8.f * load_value(d, j, w->half) : load_value(p, j, w->half)) * sx;
                p += w->symmetric ? 0 : values;
            }
        }
        store_row(out, (long)m * w->n, y, bias, is_bf16, valid);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1

/* One tile against MR rows of x, all of MR, BITS, SUB and HALF constant at each call site (the sums stay
 * in registers). */
static inline __attribute__((always_inline)) void qtile_avx512(const struct qweight *w, const uint8_t *tile,
                                                               const struct qx *x, int m0, const int MR,
                                                               const int BITS, const int SUB, const int HALF,
                                                               const void *bias, int is_bf16, void *out, int valid) {
    const int UNITS = SUB * BITS / 32, WV = SUB / 4, VALUES = QTILE * (HALF ? 2 : 4);
    const int groups = w->k / w->group, subs = w->group / SUB, xblocks = w->k / XBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const int8_t *xh[MAX_QMR], *xl[MAX_QMR];
    const float *xs[MAX_QMR], *gsum[MAX_QMR], *gcorr[MAX_QMR];
    __m512 y[MAX_QMR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
        xh[m] = x->hi + (long)(m0 + m) * w->k;
        xl[m] = x->lo + (long)(m0 + m) * w->k;
        xs[m] = x->scale + (long)(m0 + m) * xblocks;
        gsum[m] = x->gsum + (long)(m0 + m) * groups;
        gcorr[m] = x->gcorr + (long)(m0 + m) * groups;
        y[m] = _mm512_setzero_ps();
    }
    const uint8_t *p = tile;
    for (int g = 0, c = 0; g < groups; g++) {
        __m512 gacc[MAX_QMR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) gacc[m] = _mm512_set1_ps(gcorr[m][g]);
        for (int s = 0; s < subs; s++, c += SUB, p += 64 * UNITS) {
            __m512i wv[8];
#pragma GCC unroll 8
            for (int u = 0; u < UNITS; u++) {
                _mm_prefetch((const char *)p + 64 * u + prefetch_bytes, _MM_HINT_T1);
                __m512i v = _mm512_loadu_si512(p + 64 * u);
                if (BITS == 8) {
                    wv[u] = v;
                } else {
                    wv[2 * u] = _mm512_and_si512(v, low);
                    wv[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < MR; m++) {
                __m512i dot_hi = _mm512_setzero_si512(), dot_lo = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int v = 0; v < WV; v++) {
                    int32_t h, l;
                    memcpy(&h, xh[m] + c + 4 * v, 4);
                    memcpy(&l, xl[m] + c + 4 * v, 4);
                    dot_hi = _mm512_dpbusd_epi32(dot_hi, wv[v], _mm512_set1_epi32(h));
                    dot_lo = _mm512_dpbusd_epi32(dot_lo, wv[v], _mm512_set1_epi32(l));
                }
                __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(dot_hi, 8), dot_lo));
                gacc[m] = _mm512_fmadd_ps(sum, _mm512_set1_ps(xs[m][c / XBLOCK]), gacc[m]);
            }
        }
        __m512 d = load_values16(p, HALF);
        p += VALUES;
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) y[m] = _mm512_fmadd_ps(d, gacc[m], y[m]);
        if (BITS == 4) {
            __m512 off = w->symmetric ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : load_values16(p, HALF);
            p += w->symmetric ? 0 : VALUES;
#pragma GCC unroll 8
            for (int m = 0; m < MR; m++) y[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(gsum[m][g]), y[m]);
        }
    }
    __mmask16 mask = first_lanes(valid);
    __m512 b = _mm512_setzero_ps();
    if (bias && is_bf16)
        b = load_bf16_ps(mask, bias);
    else if (bias)
        b = _mm512_maskz_loadu_ps(mask, bias);
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
        __m512 r = _mm512_add_ps(y[m], b);
        long at = (long)(m0 + m) * w->n;
        if (is_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, bf16_from_512(r));
        else
            _mm512_mask_storeu_ps((float *)out + at, mask, r);
    }
}

static void qtile_rows_avx512(const struct qweight *w, const uint8_t *tile, const struct qx *x, int m0, int mr,
                              const void *bias, int is_bf16, void *out, int valid) {
#define CASE(MR, BITS, SUB, HALF)                                                         \
    if (mr == MR && w->bits == BITS && w->sub == SUB && w->half == HALF) {               \
        qtile_avx512(w, tile, x, m0, MR, BITS, SUB, HALF, bias, is_bf16, out, valid);    \
        return;                                                                           \
    }
#define ROWS(BITS, SUB, HALF)                                                                                     \
    CASE(1, BITS, SUB, HALF) CASE(2, BITS, SUB, HALF) CASE(3, BITS, SUB, HALF) CASE(4, BITS, SUB, HALF)          \
    CASE(5, BITS, SUB, HALF) CASE(6, BITS, SUB, HALF) CASE(7, BITS, SUB, HALF) CASE(8, BITS, SUB, HALF)
    ROWS(4, 32, 1) ROWS(4, 32, 0) ROWS(4, 16, 1) ROWS(4, 16, 0)
    ROWS(8, 32, 1) ROWS(8, 32, 0) ROWS(8, 16, 1) ROWS(8, 16, 0)
#undef ROWS
#undef CASE
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* 8 of a tile's scales or offsets (fp16 or fp32) in lanes. */
static inline __m256 load_values8(const uint8_t *p, const int HALF) {
    return HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}
#endif

#if defined(HAVE_AVX512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_QUANT_AMX 1
#include "amx.h"

/* Steps of at least this many rows take AMX-INT8 tiles (qtile_amx); fewer, qtile_avx512. Both give every row
 * the same bits, so this is a matter of speed alone. */
#define QUANT_AMX_ROWS 16
#define QUANT_AMX_CHUNK 64 /* rows of x that meet each of a thread's tiles in turn, while they stay in L2 */

/* tmm0, tmm1: 16 rows of x's hi and lo bytes, one sub-block's columns; tmm2: the sub-block's weights, a row per
 * 4 columns (the packed unit layout is AMX's: byte 4j + i of a row is output j's i-th column); tmm3, tmm4: the
 * hi and lo dot products, 16 rows by 16 outputs. */
static void configure_quant_tiles(int sub) {
    struct tile_config config = {.palette = 1};
    config.rows[0] = config.rows[1] = config.rows[3] = config.rows[4] = 16;
    config.bytes_per_row[0] = config.bytes_per_row[1] = sub;
    config.rows[2] = sub / 4;
    config.bytes_per_row[2] = config.bytes_per_row[3] = config.bytes_per_row[4] = 64;
    _tile_loadconfig(&config);
}

/* qtile_avx512 for 16 rows of x at once (m0 onwards; rows past `rows` are zero in x), with each sub-block's
 * integer dot products from TDPBSUD (x signed, weights unsigned) rather than vpdpbusd: integer sums are exact
 * whatever their order, and every floating-point step after them is qtile_avx512's, in its order, so each row
 * gets the bits it gets there. */
static void qtile_amx(const struct qweight *w, const uint8_t *tile, const struct qx *x, int m0, int rows,
                      const void *bias, int is_bf16, void *out, int valid) {
    const int SUB = w->sub, UNITS = SUB * w->bits / 32, VALUES = group_value_bytes(w);
    const int groups = w->k / w->group, subs = w->group / SUB, xblocks = w->k / XBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    int32_t hi[16 * 16] __attribute__((aligned(64))), lo[16 * 16] __attribute__((aligned(64)));
    uint8_t unpacked[8 * 64] __attribute__((aligned(64)));
    __m512 y[16], gacc[16];
    for (int m = 0; m < rows; m++) y[m] = _mm512_setzero_ps();
    const uint8_t *p = tile;
    for (int g = 0, c = 0; g < groups; g++) {
        for (int m = 0; m < rows; m++) gacc[m] = _mm512_set1_ps(x->gcorr[(long)(m0 + m) * groups + g]);
        for (int s = 0; s < subs; s++, c += SUB, p += 64 * UNITS) {
            const uint8_t *weights = p;
            if (w->bits == 4) { /* unit u: columns 8u..8u+3 (low nibbles), then 8u+4..8u+7 (high) */
                for (int u = 0; u < UNITS; u++) {
                    __m512i v = _mm512_loadu_si512(p + 64 * u);
                    _mm512_store_si512(unpacked + 128 * u, _mm512_and_si512(v, low));
                    _mm512_store_si512(unpacked + 128 * u + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
                weights = unpacked;
            }
            _tile_loadd(2, weights, 64);
            _tile_loadd(0, x->hi + (long)m0 * w->k + c, w->k);
            _tile_loadd(1, x->lo + (long)m0 * w->k + c, w->k);
            _tile_zero(3);
            _tile_zero(4);
            _tile_dpbsud(3, 0, 2);
            _tile_dpbsud(4, 1, 2);
            _tile_stored(3, hi, 64);
            _tile_stored(4, lo, 64);
            for (int m = 0; m < rows; m++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + 16 * m), 8),
                                               _mm512_load_si512(lo + 16 * m));
                __m512 scale = _mm512_set1_ps(x->scale[(long)(m0 + m) * xblocks + c / XBLOCK]);
                gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, gacc[m]);
            }
        }
        __m512 d = load_values16(p, w->half);
        p += VALUES;
        for (int m = 0; m < rows; m++) y[m] = _mm512_fmadd_ps(d, gacc[m], y[m]);
        if (w->bits == 4) {
            __m512 off = w->symmetric ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : load_values16(p, w->half);
            p += w->symmetric ? 0 : VALUES;
            for (int m = 0; m < rows; m++)
                y[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(x->gsum[(long)(m0 + m) * groups + g]), y[m]);
        }
    }
    __mmask16 mask = first_lanes(valid);
    __m512 b = _mm512_setzero_ps();
    if (bias && is_bf16)
        b = load_bf16_ps(mask, bias);
    else if (bias)
        b = _mm512_maskz_loadu_ps(mask, bias);
    for (int m = 0; m < rows; m++) {
        __m512 r = _mm512_add_ps(y[m], b);
        long at = (long)(m0 + m) * w->n;
        if (is_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, bf16_from_512(r));
        else
            _mm512_mask_storeu_ps((float *)out + at, mask, r);
    }
}
#endif

#if !defined(HAVE_AVX512_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2_QUANT 1
#define MAX_QMR_AVX2 2 /* rows a pass: each takes 4-6 of the 16 ymm registers */

/* The same tiles with AVX2, in two passes of 8 rows (a unit's 32-byte halves). vpmaddubsw multiplies
 * unsigned weight bytes by signed x bytes and adds adjacent pairs into 16 bits, saturating: weights are
 * therefore taken as nibbles (0..15; an 8-bit weight is 16 * high + low), which keeps a pair at most
 * 2 * 15 * 128 and a sub-block's sum of 8 such pairs within int16. vpmaddwd by ones then widens each lane's
 * pairs to the int32 vpdpbusd would give, and from there the arithmetic is the AVX-512 path's. */
static inline __attribute__((always_inline)) void qtile_avx2(const struct qweight *w, const uint8_t *tile,
                                                             const struct qx *x, int m0, const int MR,
                                                             const int BITS, const int SUB, const int HALF,
                                                             const void *bias, int is_bf16, void *out, int valid) {
    const int UNITS = SUB * BITS / 32, SIZE = HALF ? 2 : 4, size = is_bf16 ? 2 : 4;
    const int groups = w->k / w->group, subs = w->group / SUB, xblocks = w->k / XBLOCK;
    const long weight_bytes = (long)w->group * BITS / 8 * QTILE, gbytes = group_bytes(w);
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        const int8_t *xh[MAX_QMR_AVX2], *xl[MAX_QMR_AVX2];
        __m256 y[MAX_QMR_AVX2];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            xh[m] = x->hi + (long)(m0 + m) * w->k;
            xl[m] = x->lo + (long)(m0 + m) * w->k;
            y[m] = _mm256_setzero_ps();
        }
        for (int g = 0, c = 0; g < groups; g++) {
            const uint8_t *q = tile + g * gbytes, *p = q + 32 * half;
            __m256 gacc[MAX_QMR_AVX2];
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) gacc[m] = _mm256_set1_ps(x->gcorr[(long)(m0 + m) * groups + g]);
            for (int s = 0; s < subs; s++, c += SUB) {
                __m256i hi16[MAX_QMR_AVX2][2], lo16[MAX_QMR_AVX2][2];
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++)
                    hi16[m][0] = hi16[m][1] = lo16[m][0] = lo16[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int u = 0; u < UNITS; u++, p += 64) {
                    _mm_prefetch((const char *)p + prefetch_bytes, _MM_HINT_T1);
                    __m256i v = _mm256_loadu_si256((const __m256i *)p);
                    __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
                    for (int m = 0; m < MR; m++) {
                        int32_t h0, l0, h1, l1;
                        int col = BITS == 4 ? c + 8 * u : c + 4 * u, second = BITS == 4 ? col + 4 : col;
                        memcpy(&h0, xh[m] + col, 4), memcpy(&l0, xl[m] + col, 4);
                        memcpy(&h1, xh[m] + second, 4), memcpy(&l1, xl[m] + second, 4);
                        __m256i xh0 = _mm256_set1_epi32(h0), xl0 = _mm256_set1_epi32(l0);
                        __m256i xh1 = _mm256_set1_epi32(h1), xl1 = _mm256_set1_epi32(l1);
                        const int j = BITS == 4 ? 0 : 1; /* int4: columns of both nibbles add up alike */
                        hi16[m][0] = _mm256_add_epi16(hi16[m][0], _mm256_maddubs_epi16(wl, xh0));
                        lo16[m][0] = _mm256_add_epi16(lo16[m][0], _mm256_maddubs_epi16(wl, xl0));
                        hi16[m][j] = _mm256_add_epi16(hi16[m][j], _mm256_maddubs_epi16(wh, xh1));
                        lo16[m][j] = _mm256_add_epi16(lo16[m][j], _mm256_maddubs_epi16(wh, xl1));
                    }
                }
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    __m256i dh = _mm256_madd_epi16(hi16[m][0], ones), dl = _mm256_madd_epi16(lo16[m][0], ones);
                    if (BITS == 8) {
                        dh = _mm256_add_epi32(dh, _mm256_slli_epi32(_mm256_madd_epi16(hi16[m][1], ones), 4));
                        dl = _mm256_add_epi32(dl, _mm256_slli_epi32(_mm256_madd_epi16(lo16[m][1], ones), 4));
                    }
                    __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(dh, 8), dl));
                    gacc[m] = _mm256_fmadd_ps(sum, _mm256_set1_ps(x->scale[(long)(m0 + m) * xblocks + c / XBLOCK]),
                                              gacc[m]);
                }
            }
            __m256 d = load_values8(q + weight_bytes + 8 * half * SIZE, HALF);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) y[m] = _mm256_fmadd_ps(d, gacc[m], y[m]);
            if (BITS == 4) {
                __m256 off = w->symmetric ? _mm256_mul_ps(d, _mm256_set1_ps(-8.f))
                                          : load_values8(q + weight_bytes + QTILE * SIZE + 8 * half * SIZE, HALF);
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++)
                    y[m] = _mm256_fmadd_ps(off, _mm256_set1_ps(x->gsum[(long)(m0 + m) * groups + g]), y[m]);
            }
        }
        int rows = valid - 8 * half < 8 ? valid - 8 * half : 8;
        for (int m = 0; m < MR && rows > 0; m++) {
            float sums[8];
            _mm256_storeu_ps(sums, y[m]);
            const void *b = bias ? (const char *)bias + 8 * half * size : 0;
            store_row(out, (long)(m0 + m) * w->n + 8 * half, sums, b, is_bf16, rows);
        }
    }
}

static void qtile_rows_avx2(const struct qweight *w, const uint8_t *tile, const struct qx *x, int m0, int mr,
                            const void *bias, int is_bf16, void *out, int valid) {
#define CASE(MR, BITS, SUB, HALF)                                                              \
    if (rows == MR && w->bits == BITS && w->sub == SUB && w->half == HALF) {                  \
        qtile_avx2(w, tile, x, m, MR, BITS, SUB, HALF, bias, is_bf16, out, valid);            \
        continue;                                                                              \
    }
#define ROWS(BITS, SUB, HALF) CASE(1, BITS, SUB, HALF) CASE(2, BITS, SUB, HALF)
    for (int m = m0; m < m0 + mr; m += MAX_QMR_AVX2) {
        int rows = m0 + mr - m < MAX_QMR_AVX2 ? m0 + mr - m : MAX_QMR_AVX2;
        ROWS(4, 32, 1) ROWS(4, 32, 0) ROWS(4, 16, 1) ROWS(4, 16, 0)
        ROWS(8, 32, 1) ROWS(8, 32, 0) ROWS(8, 16, 1) ROWS(8, 16, 0)
    }
#undef ROWS
#undef CASE
}
#endif

/* Whether linear_quant runs vector code of its own here (1: AVX512-VNNI or AVX2) or the plain loops (0). */
int linear_quant_native(void) {
#if defined(HAVE_AVX512_VNNI) || defined(HAVE_AVX2_QUANT)
    return 1;
#else
    return 0;
#endif
}

/* Whether the quantized kernel multiplies through AVX512-VNNI here (1), where a step's extra rows cost a
 * fraction of its first, or not (0: on AVX2 each extra row costs about what the first does). */
int linear_quant_vnni(void) {
#ifdef HAVE_AVX512_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Row r of x into the scratch of qx; row_bytes: x's row stride in bytes. */
static void quantize(const struct qweight *w, const void *x, long row_bytes, int is_bf16, const struct qx *qx,
                     int r) {
    int groups = w->k / w->group;
    quantize_row(w, (const char *)x + r * row_bytes, is_bf16, qx->hi + (long)r * w->k, qx->lo + (long)r * w->k,
                 qx->scale + (long)r * (w->k / XBLOCK), qx->gsum + (long)r * groups, qx->gcorr + (long)r * groups);
}

/* x [M, k_in] bf16 or fp32 (row stride ldx); out [M, N] in x's dtype, contiguous; bias [N] in x's dtype or
 * null. Returns 0, or -1 where scratch memory ran out. */
int linear_quant(const struct qweight *w, const void *x, long ldx, int m, int is_bf16, const void *bias, void *out,
                 int num_threads) {
    if (m == 0) return 0;
    int groups = w->k / w->group, tiles = (w->n + QTILE - 1) / QTILE, chunks = (m + MAX_QMR - 1) / MAX_QMR;
    int mr = (m + chunks - 1) / chunks; /* rows per chunk, as even as MAX_QMR allows */
    int amx = 0;
#ifdef HAVE_QUANT_AMX
    amx = !w->portable && m >= QUANT_AMX_ROWS && amx_permitted();
#endif
    int padded = amx ? (m + 15) / 16 * 16 : m; /* AMX loads x's hi and lo bytes 16 rows at a time */
    long q_bytes = 2L * padded * w->k, f_count = (long)m * (w->k / XBLOCK + 2 * groups);
    size_t scratch_bytes = q_bytes + sizeof(float) * f_count + 64;
    int on_heap = scratch_bytes > STACK_SCRATCH;
    char stack[on_heap ? 1 : scratch_bytes];
    char *scratch = on_heap ? malloc(scratch_bytes) : stack;
    if (!scratch) return -1;
    float *f = (float *)(((uintptr_t)scratch + q_bytes + 63) & ~(uintptr_t)63);
    struct qx qx = {(int8_t *)scratch, (int8_t *)scratch + (long)padded * w->k, f, f + (long)m * (w->k / XBLOCK),
                    f + (long)m * (w->k / XBLOCK + groups)};
    if (padded > m) {
        memset(qx.hi + (long)m * w->k, 0, (size_t)(padded - m) * w->k);
        memset(qx.lo + (long)m * w->k, 0, (size_t)(padded - m) * w->k);
    }
    int size = is_bf16 ? 2 : 4;
    long tile_bytes = groups * group_bytes(w);
    if (num_threads > tiles) num_threads = tiles;
    /* A few rows are quantized before the threads start (well under a microsecond a row), sparing the
     * barrier, which a thread of a busy machine can hold up for a whole time slice. */
    int serial = m <= MAX_QMR;
    if (serial)
        for (int r = 0; r < m; r++) quantize(w, x, ldx * size, is_bf16, &qx, r);
#pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), threads = omp_get_num_threads();
        if (!serial) {
            for (int r = m * t / threads; r < m * (t + 1) / threads; r++) quantize(w, x, ldx * size, is_bf16, &qx, r);
#pragma omp barrier
        }
        int first = tiles * t / threads, last = tiles * (t + 1) / threads;
#ifdef HAVE_QUANT_AMX
        if (amx) {
            configure_quant_tiles(w->sub);
            for (int r0 = 0; r0 < m; r0 += QUANT_AMX_CHUNK)
                for (int tile = first; tile < last; tile++) {
                    const void *b = bias ? (const char *)bias + (long)tile * QTILE * size : 0;
                    int valid = w->n - tile * QTILE < QTILE ? w->n - tile * QTILE : QTILE;
                    for (int r = r0; r < m && r < r0 + QUANT_AMX_CHUNK; r += 16)
                        qtile_amx(w, w->packed + tile * tile_bytes, &qx, r, m - r < 16 ? m - r : 16, b, is_bf16,
                                  (char *)out + (long)tile * QTILE * size, valid);
                }
            _tile_release(); /* a thread holding tile state costs every context switch 8 KB more */
        }
#endif
        for (int tile = first; !amx && tile < last; tile++) {
            const uint8_t *tp = w->packed + tile * tile_bytes;
            const void *b = bias ? (const char *)bias + (long)tile * QTILE * size : 0;
            void *o = (char *)out + (long)tile * QTILE * size;
            int valid = w->n - tile * QTILE < QTILE ? w->n - tile * QTILE : QTILE;
            for (int r = 0; r < m; r += mr) {
                int rows = m - r < mr ? m - r : mr;
#ifdef HAVE_AVX512_VNNI
                if (!w->portable) {
                    qtile_rows_avx512(w, tp, &qx, r, rows, b, is_bf16, o, valid);
                    continue;
                }
#elif defined(HAVE_AVX2_QUANT)
                if (!w->portable) {
                    qtile_rows_avx2(w, tp, &qx, r, rows, b, is_bf16, o, valid);
                    continue;
                }
#endif
                qtile_portable(w, tp, &qx, r, rows, b, is_bf16, o, valid);
            }
        }
    }
    if (on_heap) free(scratch);
    return 0;
}

/* Row j (of 16) of one group of a tile dequantized as the reference does it (q * d + m, each step rounded
 * to fp32 as PyTorch computes it) into v [group], columns in stored order. */
static void group_row(const struct qweight *w, const uint8_t *group, int j, float *v) {
    long weight_bytes = group_weight_bytes(w);
    float d = load_value(group + weight_bytes, j, w->half);
    float m = w->bits != 4 ? 0.f : w->symmetric ? -8.f * d : load_value(group + weight_bytes + group_value_bytes(w), j, w->half);
    for (int u = 0; u < w->group / (w->bits == 4 ? 8 : 4); u++) {
        const uint8_t *b = group + 64 * u + 4 * j;
        for (int i = 0; i < 4; i++) {
            if (w->bits == 4) {
                v[8 * u + i] = (float)(b[i] & 15) * d + m;
                v[8 * u + 4 + i] = (float)(b[i] >> 4) * d + m;
            } else {
                v[4 * u + i] = (float)(int8_t)(b[i] ^ 0x80) * d;
            }
        }
    }
}

/* Rows ids[0..count) (ids null: rows 0..count) of the weight dequantized by group_row, columns in stored
 * order, into out [count, k_in] bf16 or fp32: embedding lookups of a tied weight, and whole weights for a
 * dense matmul of many rows. Returns -1, writing nothing, where an id lies outside [0, n). */
int quant_rows(const struct qweight *w, const int64_t *ids, int count, int is_bf16, void *out, int num_threads) {
    for (int r = 0; ids && r < count; r++)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    long gbytes = group_bytes(w);
    int groups = w->k / w->group;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 16)
    for (int r = 0; r < count; r++) {
        long row = ids ? ids[r] : r;
        const uint8_t *tile = w->packed + row / QTILE * groups * gbytes;
        float v[w->group]; /* one group of the row, in stored column order */
        for (int g = 0; g < groups; g++) {
            group_row(w, tile + g * gbytes, (int)(row % QTILE), v);
            int cols = w->k_in - g * w->group < w->group ? w->k_in - g * w->group : w->group;
            long at = (long)r * w->k_in + (long)g * w->group;
            if (is_bf16)
                for (int c = 0; c < cols; c++) ((uint16_t *)out)[at + c] = float_to_bf16(v[c]);
            else
                memcpy((float *)out + at, v, sizeof(float) * cols);
        }
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* One 64-byte unit of a group, 16 outputs by 8 (int4) or 4 (int8) columns, into 4 or 2 pairs of a bf16 pair
 * tile (dst[2 * TILE * pair + 2 * output + t]): group_row's values rounded to bf16, with d and m its row's
 * scales and offsets in lanes. */
static void unit_avx512(const struct qweight *w, const uint8_t *unit, __m512 d, __m512 m, uint16_t *dst) {
    __m512i v = _mm512_loadu_si512(unit), byte = _mm512_set1_epi32(0xff);
    __m512i nibbles[2] = {_mm512_and_si512(v, _mm512_set1_epi8(15)),
                          _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15))};
    int pairs = w->bits == 4 ? 4 : 2;
    for (int p = 0; p < pairs; p++) {
        __m512 f[2];
        for (int t = 0; t < 2; t++) {
            int col = 2 * p + t; /* int4: bytes 0-3 hold columns 0-3 (low nibble) and 4-7 (high) */
            __m512i q = w->bits == 4 ? nibbles[col / 4] : v;
            q = _mm512_and_si512(_mm512_srli_epi32(q, 8 * (col % 4)), byte);
            if (w->bits == 8) {
                f[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(128))), d);
            } else if (w->half) { /* q * d is exact (4 bits by fp16's 11): one rounding, as the add alone gives */
                f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
            } else {
                f[t] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d), m);
            }
        }
        /* words 2j and 2j + 1 of the pair: row j's even and odd column */
        _mm512_storeu_si512(dst + 2 * TILE * p, bf16_pairs(f[0], f[1]));
    }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__)) && defined(__AVX2__) && defined(__F16C__)
#define HAVE_AVX2_UNIT 1
/* The same as unit_avx512 with AVX2, in two halves of 8 outputs (a lane holds one output's 4 bytes), each value
 * as group_row computes it. */
static void unit_avx2(const struct qweight *w, const uint8_t *unit, const __m256 d[2], const __m256 m[2], uint16_t *dst) {
    const __m256i byte = _mm256_set1_epi32(0xff), low = _mm256_set1_epi8(15);
    int pairs = w->bits == 4 ? 4 : 2;
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(unit + 32 * h));
        __m256i nibbles[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
        for (int p = 0; p < pairs; p++) {
            __m256i both = _mm256_setzero_si256();
            for (int t = 0; t < 2; t++) {
                int col = 2 * p + t; /* int4: bytes 0-3 hold columns 0-3 (low nibble) and 4-7 (high) */
                __m256i q = _mm256_and_si256(_mm256_srli_epi32(w->bits == 4 ? nibbles[col / 4] : v, 8 * (col % 4)), byte);
                __m256 f = w->bits == 4 ? _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d[h]), m[h])
                                        : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(128))), d[h]);
                both = _mm256_or_si256(both, bf16_lanes(f, t));
            }
            _mm256_storeu_si256((__m256i *)(dst + 2 * TILE * p + 16 * h), both);
        }
    }
}
#endif

/* Quantized tile qt (16 outputs) into half h of a bf16 pair tile of the padded k columns. */
static void dequantize_tile(const struct qweight *w, int qt, int h, uint16_t *pairs) {
    int groups = w->k / w->group;
    long gbytes = group_bytes(w);
    for (int g = 0; g < groups; g++) {
        const uint8_t *group = w->packed + (qt * (long)groups + g) * gbytes;
        uint16_t *dst = pairs + (long)g * w->group / 2 * 2 * TILE + 2 * QTILE * h;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (!w->portable) {
            long weight_bytes = group_weight_bytes(w), values = group_value_bytes(w);
            int cols = w->bits == 4 ? 8 : 4; /* columns per unit */
            __m512 d = load_values16(group + weight_bytes, w->half), m = _mm512_setzero_ps();
            if (w->bits == 4)
                m = w->symmetric ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : load_values16(group + weight_bytes + values, w->half);
            for (int u = 0; u < w->group / cols; u++) unit_avx512(w, group + 64 * u, d, m, dst + u * cols / 2 * 2 * TILE);
            continue;
        }
#endif
#ifdef HAVE_AVX2_UNIT
        if (!w->portable) {
            long weight_bytes = group_weight_bytes(w), values = group_value_bytes(w);
            int cols = w->bits == 4 ? 8 : 4; /* columns per unit */
            __m256 d[2], m[2];
            for (int half = 0; half < 2; half++) {
                long rows = half * values / 2; /* rows 8 * half onwards of the scales, and of the offsets */
                d[half] = load_values8(group + weight_bytes + rows, w->half);
                m[half] = w->bits != 4     ? _mm256_setzero_ps()
                          : w->symmetric ? _mm256_mul_ps(d[half], _mm256_set1_ps(-8.f))
                                         : load_values8(group + weight_bytes + values + rows, w->half);
            }
            for (int u = 0; u < w->group / cols; u++) unit_avx2(w, group + 64 * u, d, m, dst + u * cols / 2 * 2 * TILE);
            continue;
        }
#endif
        float v[w->group];
        for (int j = 0; j < QTILE; j++) {
            group_row(w, group, j, v);
            for (int c = 0; c < w->group; c++) dst[c / 2 * 2 * TILE + 2 * j + c % 2] = float_to_bf16(v[c]);
        }
    }
}

/* Pair tile `tile` (quantized tiles 2 * tile and 2 * tile + 1) of the quantized weight `source`, in `pairs`. */
static const uint16_t *dequantized_pair_tile(const void *source, int tile, uint16_t *pairs) {
    const struct qweight *w = source;
    for (int h = 0; h < 2; h++) {
        if (2 * tile + h < (w->n + QTILE - 1) / QTILE)
            dequantize_tile(w, 2 * tile + h, h, pairs);
        else
            for (long p = 0; p < w->k / 2; p++) memset(pairs + p * 2 * TILE + 2 * QTILE * h, 0, 4 * QTILE);
    }
    return pairs;
}

/* Many rows against a quantized weight at the speed of the dense bf16 kernel, and with its bits: each thread
 * dequantizes one tile of 32 outputs at a time into bf16 pair tiles in a buffer of its own, which stays in
 * its cache while the bf16 kernel's routines (vdpbf16ps, its FMAs from `fma_rows` rows, AMX from `amx_rows`,
 * as a dense copy's plan would take them) run every row against it (AMX, rows in several groups: each thread
 * keeps its tiles for the call, see linear_bf16_amx). No dense copy of the weight is kept. x bf16 [m, k] (the
 * padded columns zero, columns in stored order) with row stride ldx; out bf16 [m, n]; bias bf16 [n] or null.
 * Returns 0, or -1 where a buffer could not be had. */
int linear_quant_bf16(const struct qweight *w, const uint16_t *x, long ldx, int m, int fma_rows, int amx_rows,
                      const uint16_t *bias, uint16_t *out, int num_threads) {
    struct bf16_weight dense = {0, w->n, w->k, w->portable, fma_rows, amx_rows};
    return linear_bf16_from(&dense, dequantized_pair_tile, w, 1, x, ldx, m, bias, out, num_threads);
}
