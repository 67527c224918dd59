/* Dense bf16 linear layers for the CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), sums in fp32.
 *
 * At small M a linear layer is bound by reading W from memory, so W is packed once (kernels/cpu/linear.py)
 * into "pair tiles" that one thread reads front to back: tiles of 32 output rows, and in each tile, for
 * every pair of input columns, the 32 rows' two values side by side,
 *     tile[p][j][t] = W[32 * tile + j][2 * p + t]     (zero past N and past an odd K),
 * so that one pair of a tile is two 16-lane vectors of bf16 pairs: vdpbf16ps multiplies them by a
 * broadcast pair of x and adds each lane's two exact products to its row's fp32 sum, with no shuffles and
 * no horizontal sums. Up to MAX_MR rows of x share each loaded vector; larger M runs in chunks of rows,
 * the tile then coming from L2. Threads take contiguous runs of tiles, one sequential stream each. Where
 * the CPU has AMX, steps of enough rows multiply whole blocks of a tile at once instead (linear_bf16_amx).
 *
 * Layouts: x [M, K] bf16 with row stride ldx (its pairs are read as 32-bit words, so K is even here: the
 * caller pads an odd K); out [M, N] bf16, contiguous; bias [N] bf16 or null.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_MR 12
/* How far ahead of its loads each thread asks for its stream, into L2: a few pages ahead keeps more of the
 * stream in flight than the hardware prefetchers do alone, and at batch 1 that is the layer's speed. */
#define PREFETCH_BYTES 4096

static inline int chunk_rows(int m) { /* rows per chunk, as even as MAX_MR allows */
    int chunks = (m + MAX_MR - 1) / MAX_MR;
    return (m + chunks - 1) / chunks;
}

/* The plain C loops, for CPUs with neither AVX512-BF16 nor AVX2 (vectorised by the compiler). */
static void tile_portable(const uint16_t *x, long ldx, int mr, const uint16_t *w, int pairs, const uint16_t *bias,
                          uint16_t *out, long ldo, int valid) {
    for (int m = 0; m < mr; m++) {
        float acc[TILE] = {0};
        const uint16_t *xm = x + m * ldx;
        for (int p = 0; p < pairs; p++) {
            float x0 = bf16_to_float(xm[2 * p]), x1 = bf16_to_float(xm[2 * p + 1]);
            const uint16_t *wp = w + (long)p * 2 * TILE;
            for (int j = 0; j < TILE; j++) acc[j] += bf16_to_float(wp[2 * j]) * x0 + bf16_to_float(wp[2 * j + 1]) * x1;
        }
        for (int j = 0; j < valid; j++)
            out[m * ldo + j] = float_to_bf16(acc[j] + (bias ? bf16_to_float(bias[j]) : 0.f));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1

/* The lanes of a tile's first `valid` outputs, 0-15 and 16-31, and its bias there in fp32 (zero without). */
static inline void tile_bias(const uint16_t *bias, int valid, __mmask16 lanes[2], __m512 b[2]) {
    lanes[0] = first_lanes(valid);
    lanes[1] = valid > 16 ? first_lanes(valid - 16) : 0;
    for (int half = 0; half < 2; half++) b[half] = bias ? load_bf16_ps(lanes[half], bias + 16 * half) : _mm512_setzero_ps();
}

/* One row of a tile's fp32 sums, outputs 0-15 and 16-31 (+ the bias b), into its bf16 outputs. */
static inline void store_row_avx512(__m512 sum0, __m512 sum1, const __m512 b[2], const __mmask16 lanes[2],
                                    uint16_t *out) {
    _mm256_mask_storeu_epi16(out, lanes[0], (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum0, b[0])));
    if (lanes[1]) _mm256_mask_storeu_epi16(out + 16, lanes[1], (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum1, b[1])));
}

/* A tile's fp32 sums for MR rows (+ bias) into bf16 outputs: the first `valid` of its 32 columns. */
static inline __attribute__((always_inline)) void store_tile_avx512(__m512 acc[][2], const int MR,
                                                                    const uint16_t *bias, uint16_t *out, long ldo,
                                                                    int valid) {
    __mmask16 lanes[2];
    __m512 b[2];
    tile_bias(bias, valid, lanes, b);
#pragma GCC unroll 12
    for (int m = 0; m < MR; m++) store_row_avx512(acc[m][0], acc[m][1], b, lanes, out + m * ldo);
}

/* One tile against MR rows of x, MR constant at each call site so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_avx512(const uint16_t *x, long ldx, const int MR,
                                                              const uint16_t *w, int pairs, const uint16_t *bias,
                                                              uint16_t *out, long ldo, int valid) {
    __m512 acc[MAX_MR][2]; /* fixed size (not MR): a variable-length array would live in memory */
#pragma GCC unroll 12
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint16_t *wp = w + (long)p * 2 * TILE;
        _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)wp + PREFETCH_BYTES + 64, _MM_HINT_T1);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
#pragma GCC unroll 12
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * p, sizeof pair);
            __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xp);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xp);
        }
    }
    store_tile_avx512(acc, MR, bias, out, ldo, valid);
}

/* The same sums with fp32 FMAs, for chunks of many rows: where vdpbf16ps issues once every two cycles and
 * FMAs twice a cycle (AVX512-BF16 CPUs without AMX), four FMAs a pair of columns beat its two vdpbf16ps
 * once the weight's conversion to fp32 (a shift and a mask a vector) is shared by enough rows. The odd
 * column's product is added first, then the even one's, each rounded as vdpbf16ps rounds them, so both
 * routines give the same bits (outside fp32's subnormal range, which vdpbf16ps flushes to zero). xf: the
 * chunk's rows of x in fp32, row stride k. */
static inline __attribute__((always_inline)) void tile_fma_avx512(const float *xf, long k, const int MR,
                                                                  const uint16_t *w, int pairs, const uint16_t *bias,
                                                                  uint16_t *out, long ldo, int valid) {
    __m512 acc[MAX_MR][2];
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 12
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint16_t *wp = w + (long)p * 2 * TILE;
        _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)wp + PREFETCH_BYTES + 64, _MM_HINT_T1);
        __m512i v0 = _mm512_loadu_si512(wp), v1 = _mm512_loadu_si512(wp + 32);
        __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
        __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high_half));
        __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
        __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high_half));
#pragma GCC unroll 12
        for (int m = 0; m < MR; m++) {
            __m512 x0 = _mm512_set1_ps(xf[m * k + 2 * p]), x1 = _mm512_set1_ps(xf[m * k + 2 * p + 1]);
            acc[m][0] = _mm512_fmadd_ps(even0, x0, _mm512_fmadd_ps(odd0, x1, acc[m][0]));
            acc[m][1] = _mm512_fmadd_ps(even1, x0, _mm512_fmadd_ps(odd1, x1, acc[m][1]));
        }
    }
    store_tile_avx512(acc, MR, bias, out, ldo, valid);
}

/* MR rows of x against one tile: through FMAs on xf (the rows in fp32) where given, else vdpbf16ps on x. */
static void tile_rows_avx512(const uint16_t *x, long ldx, const float *xf, long k, int mr, const uint16_t *w,
                             int pairs, const uint16_t *bias, uint16_t *out, long ldo, int valid) {
    switch (mr) {
#define CASE(MR)                                                              \
    case MR:                                                                  \
        if (xf)                                                               \
            tile_fma_avx512(xf, k, MR, w, pairs, bias, out, ldo, valid);      \
        else                                                                  \
            tile_avx512(x, ldx, MR, w, pairs, bias, out, ldo, valid);         \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
    }
}
#endif

#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include "amx.h"

/* With AMX, a tile multiply takes 16 rows of x by 32 columns against 32 columns of 16 outputs at once, and
 * its fp32 sums stay in a tile register for the whole of K: enough rows share every weight for the stream
 * to run at memory speed whatever the row count up to 32 (vdpbf16ps spends two instructions per row and
 * pair of columns, and oneDNN's prepacked linear streams its weight at well under memory speed here). Its
 * sums are added in another order than vdpbf16ps's, so its bits may differ: `amx_rows` gives it every step or
 * only those of many rows (kernels/cpu/linear.py: _amx_rows). Tiles:
 *   tmm0, tmm1: x, rows 0-15 and 16-31 of a pass, 32 columns;
 *   tmm2, tmm3: a block of 16 column pairs of the weight tile, its outputs 0-15 and 16-31 (in the packed
 *               tile a pair's 32 outputs lie side by side, 128 bytes: the layout AMX takes, 64 bytes apart);
 *   tmm4-tmm7: the sums, rows 0-15 x outputs 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31. */
#define AMX_ROWS 32

static void configure_tiles(int rows) {
    struct tile_config config = {.palette = 1};
    int first = rows < 16 ? rows : 16, second = rows - first;
    config.rows[0] = config.rows[4] = config.rows[5] = first;
    config.rows[1] = config.rows[6] = config.rows[7] = second;
    config.rows[2] = config.rows[3] = 16;
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = config.rows[t] ? 64 : 0;
    _tile_loadconfig(&config);
}

/* Column pairs of x and of a weight tile a block: both blocks, 32 rows each (12 KB), fit L1 together. */
#define AMX_BLOCK_PAIRS 96
/* Bytes of x a group of passes: every tile of a thread meets the group's rows while they stay in L2, so that a
 * step of many rows reads x from L2, not L3, once per tile (x of 1,000 rows by K = 1536 is 3 MB). */
#define AMX_GROUP_BYTES (512 * 1024)

/* How far ahead a pass that streams its weight from memory asks for it: into L2 a few pages ahead, and into
 * L1 the block after the one it multiplies, so that the tile loads find it there. Where the passes share
 * each block from L1, the L1 requests would evict the blocks still in use. */
#define AMX_STREAM_L2_BYTES 8192
#define AMX_STREAM_L1_BYTES 2048

/* What a pass asks for ahead of its loads: nothing (a block that an earlier pass of its group brought into L1),
 * the weight PREFETCH_BYTES ahead into L2 (the group's first pass over a block), or the stream above. */
enum { FETCH_NONE, FETCH_AHEAD, FETCH_STREAM };

/* One weight tile's column pairs [p0, p1) against `rows` rows of x (configured by configure_tiles; x
 * holds that many, row stride ldx): the sums, [32][32] fp32 in `sums`, go on from there (start from zero
 * where p0 is 0); after the last pairs, the first `valid_rows` rows of them are stored. `fetch`: FETCH_*, with
 * FETCH_STREAM where the weight is read once, from memory (a step of one pass on a dense weight). */
static void tile_amx(const uint16_t *x, long ldx, int rows, int valid_rows, const uint16_t *w, int p0, int p1,
                     int pairs, const uint16_t *bias, uint16_t *out, long ldo, int valid, float *sums, int fetch) {
    int two = rows > 16;
    if (p0 == 0) {
        _tile_zero(4);
        _tile_zero(5);
    } else {
        _tile_loadd(4, sums, 4 * TILE);
        _tile_loadd(5, sums + 16, 4 * TILE);
    }
    if (two && p0 == 0) {
        _tile_zero(6);
        _tile_zero(7);
    } else if (two) {
        _tile_loadd(6, sums + 16 * TILE, 4 * TILE);
        _tile_loadd(7, sums + 16 * TILE + 16, 4 * TILE);
    }
    for (int p = p0; p < p1; p += 16) {
        const uint16_t *wp = w + (long)p * 2 * TILE;
        if (fetch == FETCH_STREAM) {
            for (int line = 0; line < 32; line++) {
                _mm_prefetch((const char *)wp + AMX_STREAM_L2_BYTES + 64 * line, _MM_HINT_T1);
                _mm_prefetch((const char *)wp + AMX_STREAM_L1_BYTES + 64 * line, _MM_HINT_T0);
            }
        } else if (fetch == FETCH_AHEAD) {
            for (int line = 0; line < 32; line++) _mm_prefetch((const char *)wp + PREFETCH_BYTES + 64 * line, _MM_HINT_T1);
        }
        _tile_loadd(0, x + 2 * p, 2 * ldx);
        _tile_loadd(2, wp, 4 * TILE);
        _tile_loadd(3, wp + TILE, 4 * TILE);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
            _tile_loadd(1, x + 16 * ldx + 2 * p, 2 * ldx);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, sums, 4 * TILE);
    _tile_stored(5, sums + 16, 4 * TILE);
    if (two) {
        _tile_stored(6, sums + 16 * TILE, 4 * TILE);
        _tile_stored(7, sums + 16 * TILE + 16, 4 * TILE);
    }
    if (p1 < pairs) return;
    __mmask16 lanes[2];
    __m512 b[2];
    tile_bias(bias, valid, lanes, b);
    for (int m = 0; m < valid_rows; m++)
        store_row_avx512(_mm512_load_ps(sums + m * TILE), _mm512_load_ps(sums + m * TILE + 16), b, lanes, out + m * ldo);
}

/* linear_bf16_from through AMX tiles, in passes of up to AMX_ROWS rows, as even as they can be. The passes read
 * x in place, but for a last pass shorter than the others, which reads a copy zero-padded to their rows: the
 * tiles are configured once for all passes. Passes go in groups of AMX_GROUP_BYTES of x; within a group each
 * weight tile is taken once, a block of its columns at a time, and each block meets every pass of the group
 * while it and the pass's x stay in L1 (a whole tile against a whole pass, 72 KB for K = 576, would run from
 * L2); each pass's sums wait in memory between blocks. A tile built into scratch (a quantized weight's,
 * dequantized) is built once, in the first group, and kept for the later ones: a thread keeps its share of
 * the tiles, as much memory as its share of a dense copy, for the call. Whatever the grouping, each sum adds
 * the same products in the same order. Returns 0, or -1 without scratch memory. */
static int linear_bf16_amx(const struct bf16_weight *w, pair_tile_fn tile_of, const void *source, int scratch,
                           const uint16_t *x, long ldx, int m, const uint16_t *bias, uint16_t *out, int threads) {
    int tiles = (w->n + TILE - 1) / TILE, pairs = w->k / 2, passes = (m + AMX_ROWS - 1) / AMX_ROWS, failed = 0;
    int rows = (m + passes - 1) / passes, block = passes > 1 ? AMX_BLOCK_PAIRS : pairs; /* one pass: no reuse */
    int streaming = passes == 1 && !scratch; /* the weight is read once, from memory */
    long k = w->k;
    int last = (passes - 1) * rows; /* the last pass's first row */
    int group = AMX_GROUP_BYTES / (int)(2 * k) / rows * rows; /* rows a group */
    if (group < rows) group = rows;
    int kept = scratch && group < m; /* built tiles are kept for the later groups */
    uint16_t *tail = 0;
    if (m - last < rows) {
        tail = aligned_alloc(64, (sizeof(uint16_t) * rows * k + 63) / 64 * 64);
        if (!tail) return -1;
        for (int r = 0; r < rows; r++) {
            if (last + r < m)
                memcpy(tail + r * k, x + (last + r) * ldx, sizeof(uint16_t) * k);
            else
                memset(tail + r * k, 0, sizeof(uint16_t) * k);
        }
    }
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int t = omp_get_thread_num(), nthreads = omp_get_num_threads();
        int first = tiles * t / nthreads, own = tiles * (t + 1) / nthreads - first;
        float *sums = aligned_alloc(64, sizeof(float) * TILE * TILE * passes); /* each pass's */
        uint16_t *buffer = scratch ? aligned_alloc(64, sizeof(uint16_t) * k * TILE * (kept && own ? own : 1)) : 0;
        failed = !sums || (scratch && !buffer);
        configure_tiles(rows);
        for (int g0 = 0; g0 < m; g0 += group) {
            int g1 = g0 + group < m ? g0 + group : m;
            for (int tile = first; !failed && tile < first + own; tile++) {
                uint16_t *slot = kept ? buffer + (tile - first) * k * TILE : buffer;
                const uint16_t *wt = kept && g0 > 0 ? slot : tile_of(source, tile, slot);
                const uint16_t *b = bias ? bias + tile * TILE : 0;
                int valid = w->n - tile * TILE < TILE ? w->n - tile * TILE : TILE;
                /* A block of the tile's columns meets every pass while it and the pass's x stay in L1. */
                for (int p0 = 0; p0 < pairs; p0 += block) {
                    int p1 = p0 + block < pairs ? p0 + block : pairs;
                    for (int r = g0; r < g1; r += rows) {
                        int copied = tail && r == last;
                        tile_amx(copied ? tail : x + r * ldx, copied ? k : ldx, rows, m - r < rows ? m - r : rows,
                                 wt, p0, p1, pairs, b, out + (long)r * w->n + tile * TILE, w->n, valid,
                                 sums + r / rows * TILE * TILE,
                                 streaming ? FETCH_STREAM : r == g0 ? FETCH_AHEAD : FETCH_NONE);
                    }
                }
            }
        }
        _tile_release(); /* a thread holding tile state costs every context switch 8 KB more */
        free(sums);
        free(buffer);
    }
    free(tail);
    return failed ? -1 : 0;
}
#endif

#if !defined(HAVE_AVX512_BF16) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_FMA 1
#define MAX_MR_AVX2 4 /* 16 sums in the 16 ymm registers' budget; more rows spill */

/* The same tiles with AVX2: a 32-bit lane of a loaded vector is one row's pair of bf16 weights, so
 * shifting it left by 16 gives the first weight as fp32 and masking off its low half the second; two
 * FMAs per lane then add the pair's products (exact in fp32, like vdpbf16ps's) to the row's sum. */
static inline __attribute__((always_inline)) void tile_avx2(const uint16_t *x, long ldx, const int MR,
                                                            const uint16_t *w, int pairs, const uint16_t *bias,
                                                            uint16_t *out, long ldo, int valid) {
    __m256 acc[MAX_MR_AVX2][4];
    const __m256i high_half = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
        for (int g = 0; g < 4; g++) acc[m][g] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint16_t *wp = w + (long)p * 2 * TILE;
        _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)wp + PREFETCH_BYTES + 64, _MM_HINT_T1);
        __m256 x0[MAX_MR_AVX2], x1[MAX_MR_AVX2];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            x0[m] = _mm256_set1_ps(bf16_to_float(x[m * ldx + 2 * p]));
            x1[m] = _mm256_set1_ps(bf16_to_float(x[m * ldx + 2 * p + 1]));
        }
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wp + 16 * g));
            __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 second = _mm256_castsi256_ps(_mm256_and_si256(v, high_half));
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++)
                acc[m][g] = _mm256_fmadd_ps(second, x1[m], _mm256_fmadd_ps(first, x0[m], acc[m][g]));
        }
    }
    for (int m = 0; m < MR; m++) {
        float sums[TILE];
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(sums + 8 * g, acc[m][g]);
        for (int j = 0; j < valid; j++)
            out[m * ldo + j] = float_to_bf16(sums[j] + (bias ? bf16_to_float(bias[j]) : 0.f));
    }
}

static void tile_rows_avx2(const uint16_t *x, long ldx, int mr, const uint16_t *w, int pairs, const uint16_t *bias,
                           uint16_t *out, long ldo, int valid) {
    for (int r = 0; r < mr; r += MAX_MR_AVX2) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *o = out + r * ldo;
        switch (mr - r < MAX_MR_AVX2 ? mr - r : MAX_MR_AVX2) {
        case 1: tile_avx2(xr, ldx, 1, w, pairs, bias, o, ldo, valid); break;
        case 2: tile_avx2(xr, ldx, 2, w, pairs, bias, o, ldo, valid); break;
        case 3: tile_avx2(xr, ldx, 3, w, pairs, bias, o, ldo, valid); break;
        default: tile_avx2(xr, ldx, 4, w, pairs, bias, o, ldo, valid);
        }
    }
}

/* For steps of many rows (a prompt's), the tile converted once to fp32, wf [k][TILE], and every row run
 * against it in blocks of MR_FP32 rows by 16 outputs: 12 sums, 2 weight vectors and a broadcast of x fill the
 * 16 ymm registers, so each weight load serves six rows and no register spills (tile_avx2 converts each pair
 * again for every four rows and spills its broadcasts). The sums run over k in the same order as tile_avx2's,
 * so both give the same bits. xf: the rows of x in fp32, row stride k. */
#define MR_FP32 6

static void tile_to_fp32_avx2(const uint16_t *w, int pairs, float *wf) {
    const __m256i high_half = _mm256_set1_epi32((int)0xffff0000u);
    for (int p = 0; p < pairs; p++)
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + (long)p * 2 * TILE + 16 * g));
            _mm256_store_ps(wf + (2L * p) * TILE + 8 * g, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_store_ps(wf + (2L * p + 1) * TILE + 8 * g, _mm256_castsi256_ps(_mm256_and_si256(v, high_half)));
        }
}

static inline __attribute__((always_inline)) void block_fp32_avx2(const float *xf, long k, const int MR,
                                                                  const float *wf, const uint16_t *bias,
                                                                  uint16_t *out, long ldo, int valid) {
    __m256 acc[MR_FP32][2];
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (long c = 0; c < k; c++) {
        __m256 w0 = _mm256_load_ps(wf + c * TILE), w1 = _mm256_load_ps(wf + c * TILE + 8);
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            __m256 b = _mm256_broadcast_ss(xf + m * k + c);
            acc[m][0] = _mm256_fmadd_ps(w0, b, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, b, acc[m][1]);
        }
    }
#pragma GCC unroll 6 /* acc indexed by constants only, so it stays in registers */
    for (int m = 0; m < MR; m++) {
        float sums[16];
        _mm256_storeu_ps(sums, acc[m][0]);
        _mm256_storeu_ps(sums + 8, acc[m][1]);
        for (int j = 0; j < valid; j++)
            out[m * ldo + j] = float_to_bf16(sums[j] + (bias ? bf16_to_float(bias[j]) : 0.f));
    }
}

static void tile_fp32_avx2(const float *xf, long k, int m, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                           long ldo, int valid, float *wf) {
    tile_to_fp32_avx2(w, k / 2, wf);
    for (int half = 0; half < 2 && 16 * half < valid; half++) {
        int v = valid - 16 * half < 16 ? valid - 16 * half : 16;
        const uint16_t *b = bias ? bias + 16 * half : 0;
        for (int r = 0; r < m; r += MR_FP32) {
            const float *xr = xf + r * k, *wh = wf + 16 * half;
            uint16_t *o = out + r * ldo + 16 * half;
            switch (m - r < MR_FP32 ? m - r : MR_FP32) {
#define CASE(MR)                                                    \
    case MR: block_fp32_avx2(xr, k, MR, wh, b, o, ldo, v); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
            }
        }
    }
}
#endif

/* Whether linear_bf16 has an fp32 routine for many rows here (AVX512-BF16: FMAs instead of vdpbf16ps; AVX2: the
 * tile converted to fp32 once), which `fma_rows` selects. */
int linear_bf16_fma_routine(void) {
#if defined(HAVE_AVX512_BF16) || defined(HAVE_AVX2_FMA)
    return 1;
#else
    return 0;
#endif
}

/* Whether linear_bf16 can take steps of many rows through AMX tiles here (compiled for them, allowed by Linux). */
int linear_bf16_amx_routine(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Whether linear_bf16 runs vector code of its own here (1: AVX512-BF16 or AVX2) or the plain loops (0). */
int linear_bf16_native(void) {
#if defined(HAVE_AVX512_BF16) || defined(HAVE_AVX2_FMA)
    return 1;
#else
    return 0;
#endif
}

/* Tile `tile` of w, its pairs at wt, against the m rows of x (xf: x in fp32 for the fp32 routine, or null; wf:
 * the calling thread's buffer of k * TILE floats for AVX2's): outputs tile * TILE onwards of out [m, w->n]. */
static void linear_bf16_tile(const struct bf16_weight *w, int tile, const uint16_t *wt, const uint16_t *x, long ldx,
                             const float *xf, float *wf, int m, const uint16_t *bias, uint16_t *out);

int linear_bf16_from(const struct bf16_weight *w, pair_tile_fn tile_of, const void *source, int scratch,
                     const uint16_t *x, long ldx, int m, const uint16_t *bias, uint16_t *out, int num_threads) {
    int tiles = (w->n + TILE - 1) / TILE, failed = 0;
    int threads = tiles < num_threads ? tiles : num_threads;
    if (m == 0) return 0;
#ifdef HAVE_AMX
    if (!w->portable && w->amx_rows && m >= w->amx_rows && w->k % 32 == 0 && amx_permitted() &&
        linear_bf16_amx(w, tile_of, source, scratch, x, ldx, m, bias, out, threads) == 0)
        return 0;
#endif
    float *xf = 0; /* x in fp32, for the fp32 routine: AVX-512 takes it by chunks of rows, AVX2 by whole steps */
#if defined(HAVE_AVX512_BF16) || defined(HAVE_AVX2_FMA)
#ifdef HAVE_AVX512_BF16
    int fp32_rows = chunk_rows(m);
#else
    int fp32_rows = m;
#endif
    if (!w->portable && w->fma_rows && fp32_rows >= w->fma_rows && (xf = malloc(sizeof(float) * m * w->k)))
        for (int r = 0; r < m; r++)
            for (int c = 0; c < w->k; c++) xf[(long)r * w->k + c] = bf16_to_float(x[r * ldx + c]);
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int t = omp_get_thread_num(), nthreads = omp_get_num_threads();
        uint16_t *buffer = scratch ? aligned_alloc(64, sizeof(uint16_t) * w->k * TILE) : 0;
#ifdef HAVE_AVX2_FMA
        float *wf = xf ? aligned_alloc(64, sizeof(float) * w->k * TILE) : 0;
        failed = (scratch && !buffer) || (xf && !wf);
#else
        float *wf = 0;
        failed = scratch && !buffer;
#endif
        for (int tile = tiles * t / nthreads; !failed && tile < tiles * (t + 1) / nthreads; tile++)
            linear_bf16_tile(w, tile, tile_of(source, tile, buffer), x, ldx, xf, wf, m, bias, out);
        free(buffer);
        free(wf);
    }
    free(xf);
    return failed ? -1 : 0;
}

static const uint16_t *packed_tile(const void *w, int tile, uint16_t *unused) {
    (void)unused;
    const struct bf16_weight *weight = w;
    return weight->tiles + (long)tile * weight->k * TILE;
}

void linear_bf16(const struct bf16_weight *w, const uint16_t *x, long ldx, int m, const uint16_t *bias,
                 uint16_t *out, int num_threads) {
    linear_bf16_from(w, packed_tile, w, 0, x, ldx, m, bias, out, num_threads);
}

/* Rows ids[0..count) of the weight, their first k_in columns, into out [count, k_in]: the embedding lookups of a
 * tied weight, which keeps only its packed tiles. Returns -1, writing nothing, where an id lies outside [0, n). */
int bf16_rows(const struct bf16_weight *w, const int64_t *ids, int count, int k_in, uint16_t *out) {
    for (int r = 0; r < count; r++)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    for (int r = 0; r < count; r++) {
        const uint16_t *row = w->tiles + ids[r] / TILE * w->k * TILE + 2 * (ids[r] % TILE);
        uint16_t *o = out + (long)r * k_in;
        for (int c = 0; c < k_in; c++) o[c] = row[c / 2 * 2 * TILE + c % 2]; /* tile[c / 2][row][c % 2] */
    }
    return 0;
}

static void linear_bf16_tile(const struct bf16_weight *w, int tile, const uint16_t *wt, const uint16_t *x, long ldx,
                             const float *xf, float *wf, int m, const uint16_t *bias, uint16_t *out) {
    int pairs = w->k / 2, mr = chunk_rows(m), valid = w->n - tile * TILE < TILE ? w->n - tile * TILE : TILE;
    const uint16_t *b = bias ? bias + tile * TILE : 0;
#ifdef HAVE_AVX2_FMA
    if (xf) {
        tile_fp32_avx2(xf, w->k, m, wt, b, out + tile * TILE, w->n, valid, wf);
        return;
    }
#else
    (void)wf;
#endif
    for (int r = 0; r < m; r += mr) {
        int rows = m - r < mr ? m - r : mr;
        const uint16_t *xr = x + r * ldx;
        uint16_t *o = out + (long)r * w->n + tile * TILE;
#ifdef HAVE_AVX512_BF16
        if (!w->portable) {
            const float *xfr = xf && rows >= w->fma_rows ? xf + (long)r * w->k : 0;
            tile_rows_avx512(xr, ldx, xfr, w->k, rows, wt, pairs, b, o, w->n, valid);
            continue;
        }
#elif defined(HAVE_AVX2_FMA)
        if (!w->portable) {
            tile_rows_avx2(xr, ldx, rows, wt, pairs, b, o, w->n, valid);
            continue;
        }
#endif
        tile_portable(xr, ldx, rows, wt, pairs, b, o, w->n, valid);
    }
}
