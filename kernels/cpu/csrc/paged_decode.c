/* Paged decode attention for the CPU: one query token per sequence against its cached K/V.
 *
 * Reads K/V in place through the block table (no gather into a padded copy, no work on padding) and
 * handles the query heads that share a KV head together, so each cached row is loaded and converted
 * once per step. Softmax is online, block by block, so no buffer grows with the context length.
 * Accumulation is in fp32 whatever the cache dtype.
 *
 * Built at run time by kernels/cpu/_build.py with -O3 -march=native, so the plain
 * loops below are vectorised for the machine at hand. Layouts (all contiguous except q's row stride):
 *   q            [batch, heads, head_dim]          row stride q_stride elements
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables [batch, max_blocks] int32
 *   seq_lens     [batch] int32 (cached tokens, the new one included)
 *   out          [batch, heads, head_dim]
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

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

/* One (sequence, KV head): `group` query heads attend to `len` cached tokens. q/out rows are fp32.
 * Always inlined into callers with a constant head_dim, so the inner loops unroll for 64 and 128. */
static inline __attribute__((always_inline)) void attend(const float *q, int group, int head_dim, int len, int block_size, int row_stride,
                   const int32_t *table, const void *k_cache, const void *v_cache, int is_bf16,
                   float scale, float *out) {
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    float row[MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int start = 0; start < len; start += block_size) {
        int n = len - start < block_size ? len - start : block_size;
        long base = (long)table[start / block_size] * block_size * row_stride;
        for (int t = 0; t < n; t++) {
            load_row(k_cache, base + (long)t * row_stride, head_dim, is_bf16, row);
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                float dot = 0.f;
                for (int d = 0; d < head_dim; d++) dot += qg[d] * row[d];
                s[g][t] = dot * scale;
            }
        }
        for (int g = 0; g < group; g++) {
            float block_max = m[g];
            for (int t = 0; t < n; t++) block_max = s[g][t] > block_max ? s[g][t] : block_max;
            float correction = expf_nonpositive(m[g] - block_max);
            l[g] *= correction;
            float *o = out + g * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] *= correction;
            for (int t = 0; t < n; t++) {
                s[g][t] = expf_nonpositive(s[g][t] - block_max);
                l[g] += s[g][t];
            }
            m[g] = block_max;
        }
        for (int t = 0; t < n; t++) {
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

/* One block of n cached tokens for one KV head and its G query heads, with G and D constant at each call
 * site: q.k runs on bf16 pairs straight from the cache (vdpbf16ps, exact products, fp32 sums) and each
 * query head's output row stays in registers while the block's values are summed into it. The online
 * softmax state (acc, m, l) lives in memory between blocks, so one task can walk several KV heads block
 * by block. */
static inline __attribute__((always_inline)) void attend_block(const uint16_t *q, const int G, const int D, int n,
                                                               int row_stride, const uint16_t *k,
                                                               const uint16_t *v, float scale, __m512 *state,
                                                               float *m, float *l, const struct ahead *ahead) {
    const int NQ = D / 32, NO = D / 16; /* bf16 pairs vectors and fp32 vectors per row */
    __m512bh qv[G][NQ];
    __m512 acc[G][NO];
    float s[G][MAX_BLOCK + 16]; /* room for a whole vector past n */
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < NQ; i++) qv[g][i] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * i);
        for (int i = 0; i < NO; i++) acc[g][i] = state[g * NO + i];
    }
    for (int t0 = 0; t0 < n; t0 += 16)
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(s[g] + t0, _mm512_mul_ps(dot16(qv[g], NQ, k + (long)t0 * row_stride, row_stride, n - t0),
                                                      _mm512_set1_ps(scale)));
    /* Softmax of the block, 16 scores per vector; lanes past n hold p = 0. The probabilities go on
     * rounded to bf16 (as flash attention does on GPUs), as the pairs of keys P @ V takes them. */
    uint32_t pairs[G][MAX_BLOCK / 2];
    for (int g = 0; g < G; g++) {
        float block_max = m[g];
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 valid = first_lanes(n - t0);
            float chunk = _mm512_mask_reduce_max_ps(valid, _mm512_maskz_loadu_ps(valid, s[g] + t0));
            block_max = chunk > block_max ? chunk : block_max;
        }
        float correction = expf_nonpositive(m[g] - block_max);
        __m512 sums = _mm512_setzero_ps(), shift = _mm512_set1_ps(block_max);
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 valid = first_lanes(n - t0);
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

/* The KV heads [h0, h0 + nh) of one sequence, block by block: every block is read from memory once,
 * all of the task's heads in turn, while the next two stream in. Measured faster than walking one head
 * through the whole context and then the next (AVX512-BF16 EPYC, batch 26, 30 layers' caches: 7.7 ms a
 * step against 9.5 with blocks in order, 11.4 against 12.5 in random order). q: the sequence's query
 * rows; out: nh * G rows of D fp32. */
static inline __attribute__((always_inline)) void attend_avx512(const uint16_t *q, const int G, const int D,
                                                                int h0, int nh, int len, int block_size,
                                                                int row_stride, const int32_t *table,
                                                                const uint16_t *k_cache, const uint16_t *v_cache,
                                                                float scale, float *out) {
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
    for (int j = 0; j < blocks; j++) {
        /* Blocks lie anywhere in memory, which the hardware prefetchers do not follow: while this block
         * is computed, its heads ask for the next block into L1 and the one after into L2, a few rows
         * at a time (see attend_block). Asked for all at once at the start of each block, the requests
         * outnumbered the core's line fill buffers and the computation waited on them: batch 26,
         * contexts 450, 30 layers' caches in random block order on a 2-core Xeon with AMX, 20.3-21.0 ms
         * a step against 17.3-17.9 spread out. */
        long next = j + 1 < blocks ? (long)table[j + 1] * block_size * row_stride : -1;
        long after = j + 2 < blocks ? (long)table[j + 2] * block_size * row_stride : -1;
        int n = len - j * block_size < block_size ? len - j * block_size : block_size;
        long base = (long)table[j] * block_size * row_stride;
        for (int h = h0; h < h0 + nh; h++) {
            long head = (long)h * D;
            struct ahead a = {next < 0 ? 0 : k_cache + next + head, next < 0 ? 0 : v_cache + next + head,
                              after < 0 ? 0 : k_cache + after + head, after < 0 ? 0 : v_cache + after + head};
            attend_block(q + (long)h * G * D, G, D, n, row_stride, k_cache + base + head, v_cache + base + head,
                         scale, state[h - h0], m[h - h0], l[h - h0], &a);
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
static int attend_bf16_fast(const uint16_t *q, int group, int head_dim, int h0, int nh, int len, int block_size,
                            int row_stride, const int32_t *table, const uint16_t *k, const uint16_t *v,
                            float scale, float *out) {
#define CASE(G, D)                                                                              \
    if (group == G && head_dim == D) {                                                          \
        attend_avx512(q, G, D, h0, nh, len, block_size, row_stride, table, k, v, scale, out); \
        return 1;                                                                               \
    }
    CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64)
    CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128) CASE(6, 128) CASE(7, 128) CASE(8, 128)
#undef CASE
    return 0;
}
#endif

/* One KV head of one sequence through the generic loops: fp32 caches, or shapes without a fast path. */
static void attend_generic(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
                           int group, int head_dim, int block_size, int row_stride, int is_bf16, float scale,
                           void *out) {
    float qf[MAX_GROUP * MAX_HEAD_DIM], of[MAX_GROUP * MAX_HEAD_DIM];
    int n = group * head_dim;
    if (is_bf16) {
        for (int i = 0; i < n; i++) qf[i] = bf16_to_float(((const uint16_t *)q)[i]);
    } else {
        memcpy(qf, q, sizeof(float) * n);
    }
#define ATTEND(DIM, BF16) attend(qf, group, DIM, len, block_size, row_stride, table, k_cache, v_cache, BF16, scale, of)
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

/* Returns 0, or -1 when a shape exceeds this kernel's fixed limits (the caller falls back). */
int paged_decode(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, void *out,
                 int batch, int heads, int kv_heads, int head_dim, int block_size, int is_bf16,
                 float scale, int num_threads) {
    int group = heads / kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;
    int row_stride = kv_heads * head_dim, size = is_bf16 ? 2 : 4;
    /* With enough sequences to keep every thread busy, a task is a whole sequence, all its KV heads on
     * one core (see attend_avx512); with fewer, one KV head, so a single sequence still uses several. */
    int heads_per_task = batch >= 2 * num_threads ? kv_heads : 1, tasks_per_seq = kv_heads / heads_per_task;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < batch * tasks_per_seq; task++) {
        int b = task / tasks_per_seq, h0 = task % tasks_per_seq * heads_per_task;
        const char *q_seq = (const char *)q + (long)b * q_stride * size;
        char *out_seq = (char *)out + (long)b * heads * head_dim * size;
        const int32_t *table = block_tables + (long)b * max_blocks;
#ifdef HAVE_AVX512_BF16
        float of[heads_per_task * group * head_dim];
        if (is_bf16 && attend_bf16_fast((const uint16_t *)q_seq, group, head_dim, h0, heads_per_task, seq_lens[b],
                                        block_size, row_stride, table, k_cache, v_cache, scale, of)) {
            uint16_t *o = (uint16_t *)out_seq + (long)h0 * group * head_dim;
            for (int i = 0; i < heads_per_task * group * head_dim; i++) o[i] = float_to_bf16(of[i]);
            continue;
        }
#endif
        for (int h = h0; h < h0 + heads_per_task; h++) {
            long rows = (long)h * group * head_dim * size, cache_off = (long)h * head_dim * size;
            attend_generic(q_seq + rows, (const char *)k_cache + cache_off, (const char *)v_cache + cache_off, table,
                           seq_lens[b], group, head_dim, block_size, row_stride, is_bf16, scale, out_seq + rows);
        }
    }
    return 0;
}
