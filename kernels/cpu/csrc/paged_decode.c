/* Paged decode attention for the CPU: one query token per sequence against its cached K/V.
 *
 * Reads K/V in place through the block table (no gather into a padded copy, no work on padding) and
 * handles the query heads that share a KV head together, so each cached row is loaded and converted
 * once per step. Softmax is online, block by block, so no buffer grows with the context length.
 * Accumulation is in fp32 whatever the cache dtype. Where the CPU has AMX, bf16 caches of head dim 64 or 128
 * go through tiles instead (paged_decode_amx), a sequence's consecutive tokens in one step together.
 *
 * Built at run time by kernels/cpu/_build.py with -O3 -march=native, so the plain
 * loops below are vectorised for the machine at hand. Layouts (all contiguous except q's row stride):
 *   q            [batch, heads, head_dim]          row stride q_stride elements
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables [batch, max_blocks] int32
 *   seq_lens     [batch] int32 (cached tokens, the new one included)
 *   out          [batch, heads, head_dim]
 * With a sliding window (window > 0) a sequence's query sees its last `window` keys only, and blocks wholly
 * before them are never read; with soft-capping (softcap > 0) scores become softcap * tanh(score / softcap)
 * after scaling (Gemma 2).
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

/* Whether a query that sees `len` keys, with sliding window `window` (0: none), took the AMX route: it does for
 * lo to hi keys where the window cuts none of them. */
static inline int takes_keys(int len, int lo, int hi, int window) {
    return len >= lo && len <= hi && (window <= 0 || len <= window);
}

/* One cached row of head_dim values as fp32. */
static inline __attribute__((always_inline)) void load_row(const void *cache, long off, int head_dim, int is_bf16,
                                                           float *row) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + off;
        for (int d = 0; d < head_dim; d++) row[d] = bf16_to_float(src[d]);
    } else {
        memcpy(row, (const float *)cache + off, sizeof(float) * head_dim);
    }
}

/* One (sequence, KV head): `group` query heads attend to cached tokens first..len-1. q/out rows are fp32.
 * Always inlined into callers with a constant head_dim, so the inner loops unroll for 64 and 128. */
static inline __attribute__((always_inline)) void attend(const float *q, int group, int head_dim, int first, int len,
                                                         int block_size, int row_stride, const int32_t *table,
                                                         const void *k_cache, const void *v_cache, int is_bf16,
                                                         float scale, float cap, float *out) {
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    float row[MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int start = first / block_size * block_size; start < len; start += block_size) {
        int n = len - start < block_size ? len - start : block_size;
        int lo = first > start ? first - start : 0; /* the block's keys before the window: weight 0 */
        long base = (long)table[start / block_size] * block_size * row_stride;
        for (int t = lo; t < n; t++) {
            load_row(k_cache, base + (long)t * row_stride, head_dim, is_bf16, row);
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                float dot = 0.f;
                for (int d = 0; d < head_dim; d++) dot += qg[d] * row[d];
                s[g][t] = cap > 0.f ? soft_cap(dot * scale, cap) : dot * scale;
            }
        }
        for (int g = 0; g < group; g++) {
            float block_max = m[g];
            for (int t = lo; t < n; t++) block_max = s[g][t] > block_max ? s[g][t] : block_max;
            float correction = expf_nonpositive(m[g] - block_max);
            l[g] *= correction;
            float *o = out + g * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] *= correction;
            for (int t = 0; t < lo; t++) s[g][t] = 0.f;
            for (int t = lo; t < n; t++) {
                s[g][t] = expf_nonpositive(s[g][t] - block_max);
                l[g] += s[g][t];
            }
            m[g] = block_max;
        }
        for (int t = lo; t < n; t++) {
            load_row(v_cache, base + (long)t * row_stride, head_dim, is_bf16, row);
            for (int g = 0; g < group; g++) {
                float p = s[g][t];
                float *o = out + g * head_dim;
                for (int d = 0; d < head_dim; d++) o[d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.f / l[g];
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* One key row's dot product with a query row as 16 partial sums (zero past the block's last key). */
static inline __m512 dot_row(const __m512bh *qv, const int NQ, const uint16_t *k, int t, int row_stride, int n) {
    __m512 dot = _mm512_setzero_ps();
    if (t < n)
        for (int i = 0; i < NQ; i++)
            dot = _mm512_dpbf16_ps(dot, qv[i], (__m512bh)_mm512_loadu_si512(k + (long)t * row_stride + 32 * i));
    return dot;
}

/* The dot products of up to 16 consecutive key rows with one query row, lane t for key t. Reducing each
 * key's 16 partial sums on its own costs a shuffle-and-add chain per key; here the keys' vectors are
 * interleaved and added pairwise, level by level, so 15 adds and 30 shuffles serve all 16 keys. */
static inline __m512 dot16(const __m512bh *qv, const int NQ, const uint16_t *k, int row_stride, int n) {
    __m512 e[8], f[4];
    for (int p = 0; p < 8; p++) { /* 128-bit lane L: key 2p's and 2p+1's partial sums, alternating */
        __m512 a = dot_row(qv, NQ, k, 2 * p, row_stride, n), b = dot_row(qv, NQ, k, 2 * p + 1, row_stride, n);
        e[p] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int p = 0; p < 4; p++) { /* lane L, element j: lane L's share of key 4p+j */
        __m512d x = _mm512_castps_pd(e[2 * p]), y = _mm512_castps_pd(e[2 * p + 1]);
        f[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88), _mm512_shuffle_f32x4(f[0], f[1], 0xDD));
    __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x88), _mm512_shuffle_f32x4(f[2], f[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

/* One KV head's rows in the next block of the sequence and in the block after it (null past its end). */
struct ahead {
    const uint16_t *k1, *v1, *k2, *v2;
};

/* Asks for rows [r, r + rows) of the next block into L1 and of the block after into L2. Always inlined:
 * GCC drops calls to a function whose only effect is prefetching. */
static inline __attribute__((always_inline)) void prefetch_rows(const struct ahead *a, int r, int rows,
                                                                int row_stride, int bytes) {
    for (long off = (long)r * row_stride; off < (long)(r + rows) * row_stride; off += row_stride)
        for (int b = 0; b < bytes; b += 64) {
            if (a->k1) {
                _mm_prefetch((const char *)(a->k1 + off) + b, _MM_HINT_T0);
                _mm_prefetch((const char *)(a->v1 + off) + b, _MM_HINT_T0);
            }
            if (a->k2) {
                _mm_prefetch((const char *)(a->k2 + off) + b, _MM_HINT_T1);
                _mm_prefetch((const char *)(a->v2 + off) + b, _MM_HINT_T1);
            }
        }
}

/* One block of n cached tokens for one KV head and its G query heads (keys before lo outside the window, their
 * weights 0), with G and D constant at each call site: q.k runs on bf16 pairs straight from the cache (vdpbf16ps,
 * exact products, fp32 sums) and each query head's output row stays in registers while the block's values are
 * summed into it. The online softmax state (acc, m, l) lives in memory between blocks, so one task can walk
 * several KV heads block by block. */
static inline __attribute__((always_inline)) void attend_block(const uint16_t *q, const int G, const int D, int lo,
                                                               int n, int row_stride, const uint16_t *k,
                                                               const uint16_t *v, float scale, float cap,
                                                               __m512 *state, float *m, float *l,
                                                               const struct ahead *ahead) {
    const int NQ = D / 32, NO = D / 16; /* bf16 pairs vectors and fp32 vectors per row */
    __m512bh qv[G][NQ];
    __m512 acc[G][NO];
    float s[G][MAX_BLOCK + 16]; /* room for a whole vector past n */
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < NQ; i++) qv[g][i] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * i);
        for (int i = 0; i < NO; i++) acc[g][i] = state[g * NO + i];
    }
    for (int t0 = 0; t0 < n; t0 += 16)
        for (int g = 0; g < G; g++) {
            __m512 x = _mm512_mul_ps(dot16(qv[g], NQ, k + (long)t0 * row_stride, row_stride, n - t0),
                                     _mm512_set1_ps(scale));
            _mm512_storeu_ps(s[g] + t0, cap > 0.f ? soft_cap512(x, cap) : x);
        }
    /* Softmax of the block, 16 scores per vector; lanes past n hold p = 0. The probabilities go on
     * rounded to bf16 (as flash attention does on GPUs), as the pairs of keys P @ V takes them. */
    uint32_t pairs[G][MAX_BLOCK / 2];
    for (int g = 0; g < G; g++) {
        float block_max = m[g];
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 valid = first_lanes(n - t0) & ~first_lanes(lo - t0);
            float chunk = _mm512_mask_reduce_max_ps(valid, _mm512_maskz_loadu_ps(valid, s[g] + t0));
            block_max = chunk > block_max ? chunk : block_max;
        }
        float correction = expf_nonpositive(m[g] - block_max);
        __m512 sums = _mm512_setzero_ps(), shift = _mm512_set1_ps(block_max);
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 valid = first_lanes(n - t0) & ~first_lanes(lo - t0);
            __m512 p = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s[g] + t0), shift)));
            _mm256_storeu_si256((__m256i *)(pairs[g] + t0 / 2), (__m256i)_mm512_cvtneps_pbh(p));
            sums = _mm512_add_ps(sums, p);
        }
        m[g] = block_max;
        l[g] = l[g] * correction + _mm512_reduce_add_ps(sums);
        __m512 c = _mm512_set1_ps(correction);
        for (int i = 0; i < NO; i++) acc[g][i] = _mm512_mul_ps(acc[g][i], c);
    }
    /* P @ V on bf16 pairs too: two keys' V rows interleaved per lane, sums in fp32. Half the work of
     * fp32 FMAs. The blocks to come are asked for two rows at a time between the pairs; only the last
     * block is partial, and it has no next block, so the rows asked for cover every full block. */
    for (int kp = 0; kp < (n + 1) / 2; kp++) {
        prefetch_rows(ahead, 2 * kp, 2, row_stride, D * 2);
        const uint16_t *v0 = v + (long)(2 * kp) * row_stride, *v1 = v0 + row_stride;
        int second = 2 * kp + 1 < n;
        for (int h = 0; h < NQ; h++) {
            __m512i a = _mm512_loadu_si512(v0 + 32 * h);
            __m512i b = second ? _mm512_loadu_si512(v1 + 32 * h) : _mm512_setzero_si512();
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < G; g++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[g][kp]);
                acc[g][2 * h] = _mm512_dpbf16_ps(acc[g][2 * h], lo, w);
                acc[g][2 * h + 1] = _mm512_dpbf16_ps(acc[g][2 * h + 1], hi, w);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NO; i++) state[g * NO + i] = acc[g][i];
}

/* The KV heads [h0, h0 + nh) of one sequence, block by block from the one holding key `from`: every block is read
 * from memory once, all of the task's heads in turn, while the next two stream in. Measured faster than walking
 * one head through the whole context and then the next (benchmarks/results/kernel-and-runner-timings.md).
 * q: the sequence's query rows; out: nh * G rows of D fp32. */
static inline __attribute__((always_inline)) void attend_avx512(const uint16_t *q, const int G, const int D,
                                                                int h0, int nh, int from, int len,
                                                                int block_size, int row_stride,
                                                                const int32_t *table, const uint16_t *k_cache,
                                                                const uint16_t *v_cache, float scale, float cap,
                                                                float *out) {
    const int NQ = D / 32, NO = D / 16;
    __m512 state[nh][G * NO];
    float m[nh][G], l[nh][G];
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < NO; i++) state[h][g * NO + i] = _mm512_setzero_ps();
            m[h][g] = -FLT_MAX;
            l[h][g] = 0.f;
        }
    int blocks = (len + block_size - 1) / block_size;
    for (int j = from / block_size; j < blocks; j++) {
        /* Blocks lie anywhere in memory, which the hardware prefetchers do not follow: while this block
         * is computed, its heads ask for the next block into L1 and the one after into L2, a few rows
         * at a time (see attend_block). Asked for all at once at the start of each block, the requests
         * outnumbered the core's line fill buffers and the computation waited on them (timings:
         * benchmarks/results/kernel-and-runner-timings.md). */
        long next = j + 1 < blocks ? (long)table[j + 1] * block_size * row_stride : -1;
        long after = j + 2 < blocks ? (long)table[j + 2] * block_size * row_stride : -1;
        int n = len - j * block_size < block_size ? len - j * block_size : block_size;
        int lo = from > j * block_size ? from - j * block_size : 0;
        long base = (long)table[j] * block_size * row_stride;
        for (int h = h0; h < h0 + nh; h++) {
            long head = (long)h * D;
            struct ahead a = {next < 0 ? 0 : k_cache + next + head, next < 0 ? 0 : v_cache + next + head,
                              after < 0 ? 0 : k_cache + after + head, after < 0 ? 0 : v_cache + after + head};
            attend_block(q + (long)h * G * D, G, D, lo, n, row_stride, k_cache + base + head,
                         v_cache + base + head, scale, cap, state[h - h0], m[h - h0], l[h - h0], &a);
        }
    }
    /* Unpacking interleaved words per 128-bit lane: acc[g][2h] lane 4c+w holds dim 32h+8c+w and
     * acc[g][2h+1] lane 4c+w holds dim 32h+8c+4+w. Put the dims back in order. */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < G; g++) {
            __m512 inv = _mm512_set1_ps(1.f / l[h][g]);
            float *o = out + ((long)h * G + g) * D;
            for (int i = 0; i < NQ; i++) {
                __m512 lo = state[h][g * NO + 2 * i], hi = state[h][g * NO + 2 * i + 1];
                _mm512_storeu_ps(o + 32 * i, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
                _mm512_storeu_ps(o + 32 * i + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
            }
        }
}

/* The specialised kernel for the common shapes; returns 0 where it has none (the caller goes generic). */
static int attend_bf16_fast(const uint16_t *q, int group, int head_dim, int h0, int nh, int first, int len,
                            int block_size, int row_stride, const int32_t *table, const uint16_t *k,
                            const uint16_t *v, float scale, float cap, float *out) {
#define CASE(G, D)                                                                                           \
    if (group == G && head_dim == D) {                                                                       \
        attend_avx512(q, G, D, h0, nh, first, len, block_size, row_stride, table, k, v, scale, cap, out);    \
        return 1;                                                                                            \
    }
    CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64)
    CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128) CASE(6, 128) CASE(7, 128) CASE(8, 128)
#undef CASE
    return 0;
}
#endif

#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_DECODE_AMX 1
#include <omp.h>

#include "amx.h"

/* With AMX, a strip of up to 16 query rows of one KV head (a token's query heads, or those of several tokens
 * of one sequence: a draft being verified) runs in three passes over its keys, whatever its row count:
 *   1. S^T = K Q^T through tiles: the cache's key rows are the left operand as they lie (16 keys by 32
 *      dimensions a tile load), the strip's queries, their dimension pairs transposed once, the right one; so
 *      each key's scores come out as one vector, a lane per row;
 *   2. in those vectors (several keys to one where the strip has few rows), each row's maximum over the keys it
 *      sees, then its probabilities (zero for keys it does not see) and their sum, and the probabilities,
 *      rounded to bf16 as the other routes round them, transposed into rows;
 *   3. O = P V through tiles, over pairs of keys whose value rows are interleaved into the layout TDPBF16PS
 *      takes (value rows past the strip's last key zeroed), the sums in tile registers over all keys.
 * Every step is lane by lane or row by row, so a row gets the same bits whatever other rows share its strip:
 * a draft's tokens verify as decoding alone would compute them. The vdpbf16ps routine reduces each key's
 * sums across lanes and reads the keys once a token, which costs a run of tokens several times more a row.
 * Tiles, all 16 rows by 64 bytes: tmm4-7 hold the queries' dimension pairs for S (then O's four blocks of 16
 * dimensions), tmm0-1 key tiles, tmm2-3 scores; for O, tmm0 a block of P (32 keys), tmm1-3 value blocks. */
#define STRIP 16
#define DIMS_A_PASS 64
#define AHEAD 4 /* groups of 16 keys ahead that the rows are asked for */
/* Rows that see fewer or more keys than these take the vdpbf16ps routine: below, a strip's fixed costs (tile
 * state, three passes) outweigh what it saves a lone token; above, its buffers outgrow L2 and its three passes
 * reread them, which costs a lone token's rows more than the vector routine's single pass. */
#define AMX_MIN_KEYS 256
#define AMX_MAX_KEYS 2048
/* Nor do steps of more tokens than SAME_BITS_ROWS (kernels/cpu/linear.py), where rows need not get the bits they get
 * alone: there most tokens are other sequences' lone ones, whose three rows a KV head the vector routine serves
 * faster, all of a sequence's heads block by block. */
#define AMX_MAX_TOKENS 20

static int decode_amx = 1; /* tests turn it off to exercise the vdpbf16ps routine on AMX CPUs */

/* A thread's buffers for strips of up to `keys` keys (a multiple of 32) of head dim D. */
struct strip_buffers {
    float *scores;    /* [keys][16] */
    uint16_t *probs;  /* [16][keys] */
    uint16_t *values; /* two chunks' value pairs, VALUE_PAIRS each */
    uint32_t *pairs;  /* [D / 2][16]: the queries' dimension pairs */
    float *obuf;      /* [16][64] */
};

/* Key `key`'s row of one KV head in the paged cache; from a multiple of 16, the next 15 keys' rows follow it at
 * the cache's row stride (blocks hold a multiple of 16 keys). */
static inline const uint16_t *key_rows(const uint16_t *cache, const int32_t *table, int key, int block_size,
                                       int row_stride, long head) {
    return cache + ((long)table[key / block_size] * block_size + key % block_size) * row_stride + head;
}

/* A 16 x 16 matrix of 32-bit elements transposed: row i's element j (lane j of r[i]) goes to lane i of r[j]. */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* Scores of 16 keys (their rows from `keys`, `stride` bytes apart) against the queries in tiles 4.., into tile
 * S and then `out`, [16 keys][16 rows]. */
#define SCORE_GROUP(S, D, keys, stride, out)                                                                 \
    do {                                                                                                     \
        _tile_zero(S);                                                                                       \
        _tile_loadd(0, keys, stride);                                                                        \
        _tile_dpbf16ps(S, 0, 4);                                                                             \
        _tile_loadd(1, (keys) + 32, stride);                                                                 \
        _tile_dpbf16ps(S, 1, 5);                                                                             \
        if ((D) == 128) {                                                                                    \
            _tile_loadd(0, (keys) + 64, stride);                                                             \
            _tile_dpbf16ps(S, 0, 6);                                                                         \
            _tile_loadd(1, (keys) + 96, stride);                                                             \
            _tile_dpbf16ps(S, 1, 7);                                                                         \
        }                                                                                                    \
        _tile_stored(S, out, 64);                                                                            \
    } while (0)

/* The value rows of keys c..c+31 (64 of their dimensions from `head`) as TDPBF16PS's right operand: 16 pairs of
 * keys, a pair's 64 dimensions side by side, each dimension's two values together; keys from `last` on are
 * zero (their probabilities are, and a stale row must not make 0 * NaN). */
#define VALUE_PAIRS (16 * 2 * DIMS_A_PASS)
static void value_pairs(const uint16_t *v_cache, const int32_t *table, int c, int last, int block_size,
                        int row_stride, long head, uint16_t *out) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    const uint16_t *group_rows[2]; /* each 16 keys' rows: one block's, consecutive */
    for (int g = 0; g < 2; g++)
        group_rows[g] = c + 16 * g < last ? key_rows(v_cache, table, c + 16 * g, block_size, row_stride, head) : 0;
    for (int kp = 0; kp < 16; kp++) {
        __m512i v[2][2]; /* key, 32 dimensions */
        for (int i = 0; i < 2; i++) {
            int key = c + 2 * kp + i;
            const uint16_t *row = key < last ? group_rows[kp / 8] + (long)(key % 16) * row_stride : 0;
            v[i][0] = row ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
            v[i][1] = row ? _mm512_loadu_si512(row + 32) : _mm512_setzero_si512();
        }
        uint16_t *dst = out + kp * 2 * DIMS_A_PASS;
        for (int h = 0; h < 2; h++) { /* dims 32h..32h+15, then 32h+16..32h+31 */
            _mm512_store_si512(dst + 64 * h, _mm512_permutex2var_epi16(v[0][h], low, v[1][h]));
            _mm512_store_si512(dst + 64 * h + 32, _mm512_permutex2var_epi16(v[0][h], high, v[1][h]));
        }
    }
}

/* x as computed: the build lets the compiler reassociate floating-point sums (-fassociative-math), which could
 * add a row's terms in another order in one inlined copy than in another; a sum passed through here is not. */
static inline __m512 exactly(__m512 x) {
    __asm__("" : "+v"(x));
    return x;
}

/* The scores of keys key..key+P-1 (P = 1, 2 or 4), rows 0..16/P-1 of each, as one vector: lane 16/P * i + r is
 * key + i's row r; zero for keys from `last` on. */
static inline __m512 packed_keys(const float *scores, int key, int last, const int P) {
    if (P == 1) return _mm512_maskz_load_ps(key < last ? 0xffff : 0, scores + 16L * key);
    if (P == 2) {
        __m256 first = _mm256_maskz_load_ps(key < last ? 0xff : 0, scores + 16L * key);
        __m256 next = _mm256_maskz_load_ps(key + 1 < last ? 0xff : 0, scores + 16L * (key + 1));
        return _mm512_insertf32x8(_mm512_castps256_ps512(first), next, 1);
    }
    __m512 v = _mm512_castps128_ps512(_mm_maskz_load_ps(key < last ? 0xf : 0, scores + 16L * key));
    v = _mm512_insertf32x4(v, _mm_maskz_load_ps(key + 1 < last ? 0xf : 0, scores + 16L * (key + 1)), 1);
    v = _mm512_insertf32x4(v, _mm_maskz_load_ps(key + 2 < last ? 0xf : 0, scores + 16L * (key + 2)), 2);
    return _mm512_insertf32x4(v, _mm_maskz_load_ps(key + 3 < last ? 0xf : 0, scores + 16L * (key + 3)), 3);
}

/* Each row's probabilities in keys key.. (P to a vector, as packed_keys lays them out) and their sums: the sums
 * over keys k = 0, 1, 2 and 3 mod 4 are kept apart (sum[k % 4 / P] holds P of them, lane groups as the keys),
 * and `pairs` gets the bf16 probabilities of pairs of keys, a row's pair a lane. */
static inline __attribute__((always_inline)) void probabilities(const float *scores, int key, int last, const int P,
                                                                __m512i seen, __m512i offsets, __m512 k, float cap,
                                                                __m512 top, __m512 *sum, __m512i *pairs) {
    __m512 e[2];
    for (int i = 0; i < (P == 1 ? 2 : 1); i++) {
        __mmask16 lanes = _mm512_cmpgt_epi32_mask(seen, _mm512_add_epi32(_mm512_set1_epi32(key + i), offsets));
        __m512 s = _mm512_mul_ps(packed_keys(scores, key + i, last, P), k);
        if (cap > 0.f) s = soft_cap512(s, cap);
        e[i] = _mm512_maskz_mov_ps(lanes, exp512_nonpositive(_mm512_sub_ps(s, top)));
        sum[(key + i) % 4 / P] = exactly(_mm512_add_ps(sum[(key + i) % 4 / P], e[i]));
    }
    if (P == 1) {
        pairs[0] = bf16_pairs(e[0], e[1]);
    } else if (P == 2) { /* words r and 8 + r of the key pair side by side */
        const __m256i halves = _mm256_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
        pairs[0] = _mm512_zextsi256_si512(_mm256_permutexvar_epi16(halves, (__m256i)_mm512_cvtneps_pbh(e[0])));
    } else { /* words r and 4 + r, then 8 + r and 12 + r */
        const __m256i quarters = _mm256_set_epi16(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
        __m256i both = _mm256_permutexvar_epi16(quarters, (__m256i)_mm512_cvtneps_pbh(e[0]));
        pairs[0] = _mm512_zextsi128_si512(_mm256_castsi256_si128(both));
        pairs[1] = _mm512_zextsi128_si512(_mm256_extracti128_si256(both, 1));
    }
}

/* Passes 1 and 2 of a strip (see strip_amx), P keys to a softmax vector (rows <= 16 / P): its scores, each row's
 * maximum, probabilities (into b->probs, a row's keys in a row) and their sum, ((S0 + S1) + (S2 + S3)) of the
 * sums over keys k = 0..3 mod 4, each taken key by key, whatever P. */
static inline __attribute__((always_inline)) void scores_and_probabilities(
    const struct strip_buffers *b, int rows, const int *lens, int last, int groups, int width, float scale, float cap,
    const int P,
    const int D, const int32_t *table, int block_size, int row_stride, long head, const uint16_t *k_cache,
    const uint16_t *v_cache, float *sums) {
    __m512i seen = _mm512_maskz_loadu_epi32(first_lanes(rows), lens), offsets = _mm512_setzero_si512();
    if (P == 2) {
        seen = _mm512_inserti64x4(seen, _mm512_castsi512_si256(seen), 1);
        offsets = _mm512_inserti64x4(offsets, _mm256_set1_epi32(1), 1);
    } else if (P == 4) {
        seen = _mm512_broadcast_i32x4(_mm512_castsi512_si128(seen));
        offsets = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    }
    __m512 k = _mm512_set1_ps(scale), top = _mm512_set1_ps(-FLT_MAX);
    for (int j = 0; j <= groups; j++) {
        if (j + AHEAD < groups) { /* a later group's key and value rows (for pass 3) into L2 */
            const uint16_t *keys = key_rows(k_cache, table, 16 * (j + AHEAD), block_size, row_stride, head);
            const uint16_t *values = key_rows(v_cache, table, 16 * (j + AHEAD), block_size, row_stride, head);
            for (int r = 0; r < 16; r++)
                for (int line = 0; line < 2 * D; line += 64) {
                    _mm_prefetch((const char *)(keys + (long)r * row_stride) + line, _MM_HINT_T1);
                    _mm_prefetch((const char *)(values + (long)r * row_stride) + line, _MM_HINT_T1);
                }
        }
        if (j < groups) {
            const uint16_t *keys = key_rows(k_cache, table, 16 * j, block_size, row_stride, head);
            if (j % 2 == 0)
                SCORE_GROUP(2, D, keys, 2L * row_stride, b->scores + 16L * 16 * j);
            else
                SCORE_GROUP(3, D, keys, 2L * row_stride, b->scores + 16L * 16 * j);
        }
        for (int key = 16 * (j - 1); j > 0 && key < 16 * j && key < last; key += P) {
            __mmask16 lanes = _mm512_cmpgt_epi32_mask(seen, _mm512_add_epi32(_mm512_set1_epi32(key), offsets));
            __m512 s = _mm512_mul_ps(packed_keys(b->scores, key, last, P), k);
            top = _mm512_mask_max_ps(top, lanes, top, cap > 0.f ? soft_cap512(s, cap) : s);
        }
    }
    if (P >= 2) /* each row's maximum over the lane groups, in all of them */
        top = _mm512_max_ps(top, _mm512_shuffle_f32x4(top, top, _MM_SHUFFLE(1, 0, 3, 2)));
    if (P == 4)
        top = _mm512_max_ps(top, _mm512_shuffle_f32x4(top, top, _MM_SHUFFLE(2, 3, 0, 1)));
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < width; c += 32) { /* 32 keys: 16 pairs of keys, a row's pair a lane, then a row a vector */
        __m512i pairs[16];
        for (int key = c; key < c + 32; key += P == 4 ? 4 : 2)
            probabilities(b->scores, key, last, P, seen, offsets, k, cap, top, sum, pairs + (key - c) / 2);
        transpose16(pairs);
        for (int r = 0; r < rows; r++) _mm512_storeu_si512((char *)b->probs + 2L * (r * width + c), pairs[r]);
    }
    /* S_i of each row in lanes 0..: P = 1: sum[i]; P = 2: sum[i / 2]'s group i % 2; P = 4: sum[0]'s group i */
    __m512 part[4];
    for (int i = 0; i < 4; i++) {
        __m512 v = sum[P == 1 ? i : P == 2 ? i / 2 : 0];
        int group = P == 1 ? 0 : P == 2 ? i % 2 : i;
        part[i] = group == 0   ? v
                  : group == 1 ? (P == 2 ? _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2))
                                         : _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(0, 3, 2, 1)))
                  : group == 2 ? _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2))
                               : _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 1, 0, 3));
    }
    __m512 low = exactly(_mm512_add_ps(part[0], part[1])), high = exactly(_mm512_add_ps(part[2], part[3]));
    _mm512_storeu_ps(sums, _mm512_add_ps(low, high));
}

/* One strip: rows[r] is row r's query (D bf16), lens[r] the keys it sees, outs[r] where its output goes. */
static void strip_amx(const int D, int rows, const uint16_t *const *q, const int *lens, const int32_t *table,
                      int block_size, int row_stride, long head, const uint16_t *k_cache, const uint16_t *v_cache,
                      float scale, float cap, uint16_t *const *outs, const struct strip_buffers *b) {
    int last = 0;
    for (int r = 0; r < rows; r++) last = lens[r] > last ? lens[r] : last;
    const int groups = (last + 15) / 16, width = (last + 31) / 32 * 32, pitch = 2 * width; /* P's, bytes */
    for (int p = 0; p < D / 2; p++)
        for (int r = 0; r < STRIP; r++) b->pairs[p * STRIP + r] = r < rows ? ((const uint32_t *)q[r])[p] : 0;
    _tile_loadd(4, b->pairs, 64);
    _tile_loadd(5, b->pairs + 16 * STRIP, 64);
    if (D == 128) {
        _tile_loadd(6, b->pairs + 32 * STRIP, 64);
        _tile_loadd(7, b->pairs + 48 * STRIP, 64);
    }
    /* 1. scores, a key a row of 16 lanes; each group's maxima are taken while the next group multiplies. A
     * strip of up to 8 (4) rows takes 2 (4) keys a vector for its softmax. */
    float sums[STRIP];
    if (rows <= 4)
        scores_and_probabilities(b, rows, lens, last, groups, width, scale, cap, 4, D, table, block_size, row_stride,
                                 head, k_cache, v_cache, sums);
    else if (rows <= 8)
        scores_and_probabilities(b, rows, lens, last, groups, width, scale, cap, 2, D, table, block_size, row_stride,
                                 head, k_cache, v_cache, sums);
    else
        scores_and_probabilities(b, rows, lens, last, groups, width, scale, cap, 1, D, table, block_size, row_stride,
                                 head, k_cache, v_cache, sums);
    /* 3. O = P V, 64 dimensions a pass; each chunk's value pairs are laid out while the chunk before multiplies */
    for (int d0 = 0; d0 < D; d0 += DIMS_A_PASS) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        value_pairs(v_cache, table, 0, last, block_size, row_stride, head + d0, b->values);
        for (int c = 0; c < width; c += 32) {
            const uint16_t *values = b->values + (c / 32 % 2) * VALUE_PAIRS;
            tiles_pv((const char *)b->probs + 2L * c, pitch, values, 4 * DIMS_A_PASS);
            if (c + 32 < width)
                value_pairs(v_cache, table, c + 32, last, block_size, row_stride, head + d0,
                            b->values + (c / 32 + 1) % 2 * VALUE_PAIRS);
        }
        _tile_stored(4, b->obuf, 4 * DIMS_A_PASS);
        _tile_stored(5, b->obuf + 16, 4 * DIMS_A_PASS);
        _tile_stored(6, b->obuf + 32, 4 * DIMS_A_PASS);
        _tile_stored(7, b->obuf + 48, 4 * DIMS_A_PASS);
        for (int r = 0; r < rows; r++) {
            __m512 inv = _mm512_set1_ps(1.f / sums[r]);
            for (int i = 0; i < DIMS_A_PASS / 16; i++)
                _mm256_storeu_si256((__m256i *)(outs[r] + d0 + 16 * i),
                                    bf16_from_512(_mm512_mul_ps(_mm512_load_ps(b->obuf + r * DIMS_A_PASS + 16 * i), inv)));
        }
    }
}

/* paged_decode through AMX strips for the tokens that see AMX_MIN_KEYS to AMX_MAX_KEYS keys, all of their
 * sequence's (a window cuts none of them: the strips read from key 0), batch: at most AMX_MAX_TOKENS. The tokens
 * of a step that follow each other with the same block table are one sequence's (a draft being verified, a short
 * prompt chunk): a task is such a run's rows for one KV head, 16 at a time, so the run reads its keys once a strip
 * rather than once a token. Its buffers, bounded by both limits, are on the threads' stacks. */
static void paged_decode_amx(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *tables, int max_blocks, const int32_t *seq_lens, uint16_t *out, int batch,
                             int heads, int kv_heads, int D, int block_size, float scale, int window, float cap,
                             int num_threads) {
    int group = heads / kv_heads, row_stride = kv_heads * D, runs = 0, longest = 0;
    int first[AMX_MAX_TOKENS], end[AMX_MAX_TOKENS]; /* run r: tokens [first, end) */
    for (int b = 0; b < batch; b++) {
        if (!takes_keys(seq_lens[b], AMX_MIN_KEYS, AMX_MAX_KEYS, window)) continue;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
        if (runs == 0 || end[runs - 1] != b ||
            memcmp(tables + (long)b * max_blocks, tables + (long)(b - 1) * max_blocks, sizeof(int32_t) * max_blocks))
            first[runs++] = b;
        end[runs - 1] = b + 1;
    }
    int strips = 0; /* per KV head: each run's rows, STRIP at a time */
    for (int r = 0; r < runs; r++) strips += ((end[r] - first[r]) * group + STRIP - 1) / STRIP;
    if (strips == 0) return;
    int strip_run[strips], strip_row[strips];
    for (int r = 0, i = 0; r < runs; r++)
        for (int row = 0; row < (end[r] - first[r]) * group; row += STRIP, i++) strip_run[i] = r, strip_row[i] = row;
    long keys = (longest + 31) / 32 * 32;
    /* each part a multiple of 64 bytes (keys is a multiple of 32) */
    const long parts[] = {sizeof(float) * keys * STRIP, sizeof(uint16_t) * STRIP * keys,
                          sizeof(uint16_t) * 2 * VALUE_PAIRS, sizeof(uint32_t) * D / 2 * STRIP,
                          sizeof(float) * STRIP * DIMS_A_PASS};
#pragma omp parallel num_threads(num_threads)
    {
        char buffer[parts[0] + parts[1] + parts[2] + parts[3] + parts[4]] __attribute__((aligned(64)));
        struct strip_buffers b = {(float *)buffer, (uint16_t *)(buffer + parts[0]),
                                  (uint16_t *)(buffer + parts[0] + parts[1]),
                                  (uint32_t *)(buffer + parts[0] + parts[1] + parts[2]),
                                  (float *)(buffer + parts[0] + parts[1] + parts[2] + parts[3])};
        configure_full_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < strips * kv_heads; task++) {
            int h = task % kv_heads, i = task / kv_heads, r = strip_run[i], row0 = strip_row[i];
            int tokens = end[r] - first[r], rows = tokens * group - row0 < STRIP ? tokens * group - row0 : STRIP;
            const uint16_t *rq[STRIP];
            uint16_t *ro[STRIP];
            int lens[STRIP];
            for (int j = 0; j < rows; j++) {
                int token = first[r] + (row0 + j) / group, head = h * group + (row0 + j) % group;
                rq[j] = q + token * q_stride + (long)head * D;
                ro[j] = out + ((long)token * heads + head) * D;
                lens[j] = seq_lens[token];
            }
            strip_amx(D, rows, rq, lens, tables + (long)first[r] * max_blocks, block_size, row_stride, (long)h * D,
                      k_cache, v_cache, scale, cap, ro, &b);
        }
        _tile_release(); /* a thread holding tile state costs every context switch 8 KB more */
    }
}

int paged_decode_set_amx(int on) {
    decode_amx = on;
    return on && amx_permitted();
}
#else
int paged_decode_set_amx(int on) {
    (void)on;
    return 0;
}
#endif

/* One KV head of one sequence through the generic loops: fp32 caches, or shapes without a fast path. */
static void attend_generic(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int first,
                           int len, int group, int head_dim, int block_size, int row_stride, int is_bf16, float scale,
                           float cap, void *out) {
    float qf[MAX_GROUP * MAX_HEAD_DIM], of[MAX_GROUP * MAX_HEAD_DIM];
    int n = group * head_dim;
    if (is_bf16) {
        for (int i = 0; i < n; i++) qf[i] = bf16_to_float(((const uint16_t *)q)[i]);
    } else {
        memcpy(qf, q, sizeof(float) * n);
    }
#define ATTEND(DIM, BF16) \
    attend(qf, group, DIM, first, len, block_size, row_stride, table, k_cache, v_cache, BF16, scale, cap, of)
    if (is_bf16 && head_dim == 64) ATTEND(64, 1);
    else if (is_bf16 && head_dim == 128) ATTEND(128, 1);
    else if (is_bf16) ATTEND(head_dim, 1);
    else if (head_dim == 64) ATTEND(64, 0);
    else if (head_dim == 128) ATTEND(128, 0);
    else ATTEND(head_dim, 0);
#undef ATTEND
    if (is_bf16) {
        for (int i = 0; i < n; i++) ((uint16_t *)out)[i] = float_to_bf16(of[i]);
    } else {
        memcpy(out, of, sizeof(float) * n);
    }
}

/* Returns 0, or -1 when a shape exceeds this kernel's fixed limits (the caller falls back). window: 0 or the
 * keys a query sees (its own included); softcap: 0 or the cap of the scores. */
int paged_decode(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, void *out,
                 int batch, int heads, int kv_heads, int head_dim, int block_size, int is_bf16,
                 float scale, int window, float softcap, int num_threads) {
    int group = heads / kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;
    int row_stride = kv_heads * head_dim, size = is_bf16 ? 2 : 4;
    int amx_keys[2] = {1, 0}; /* tokens that see this many keys or more, and at most this many, went through AMX */
#ifdef HAVE_DECODE_AMX
    if (decode_amx && is_bf16 && (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 &&
        batch <= AMX_MAX_TOKENS && amx_permitted()) {
        paged_decode_amx(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, batch, heads,
                         kv_heads, head_dim, block_size, scale, window, softcap, num_threads);
        amx_keys[0] = AMX_MIN_KEYS, amx_keys[1] = AMX_MAX_KEYS;
    }
#endif
    int left = 0;
    for (int b = 0; b < batch; b++) left += !takes_keys(seq_lens[b], amx_keys[0], amx_keys[1], window);
    if (left == 0) return 0;
    /* With enough sequences to keep every thread busy, a task is a whole sequence, all its KV heads on
     * one core (see attend_avx512); with fewer, one KV head, so a single sequence still uses several. */
    int heads_per_task = batch >= 2 * num_threads ? kv_heads : 1, tasks_per_seq = kv_heads / heads_per_task;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < batch * tasks_per_seq; task++) {
        int b = task / tasks_per_seq, h0 = task % tasks_per_seq * heads_per_task;
        if (takes_keys(seq_lens[b], amx_keys[0], amx_keys[1], window)) continue;
        int first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0; /* its first visible key */
        const char *q_seq = (const char *)q + (long)b * q_stride * size;
        char *out_seq = (char *)out + (long)b * heads * head_dim * size;
        const int32_t *table = block_tables + (long)b * max_blocks;
#ifdef HAVE_AVX512_BF16
        float of[heads_per_task * group * head_dim];
        if (is_bf16 && attend_bf16_fast((const uint16_t *)q_seq, group, head_dim, h0, heads_per_task, first,
                                        seq_lens[b], block_size, row_stride, table, k_cache, v_cache, scale, softcap,
                                        of)) {
            uint16_t *o = (uint16_t *)out_seq + (long)h0 * group * head_dim;
            for (int i = 0; i < heads_per_task * group * head_dim; i++) o[i] = float_to_bf16(of[i]);
            continue;
        }
#endif
        for (int h = h0; h < h0 + heads_per_task; h++) {
            long rows = (long)h * group * head_dim * size, cache_off = (long)h * head_dim * size;
            attend_generic(q_seq + rows, (const char *)k_cache + cache_off, (const char *)v_cache + cache_off, table,
                           first, seq_lens[b], group, head_dim, block_size, row_stride, is_bf16, scale, softcap,
                           out_seq + rows);
        }
    }
    return 0;
}
