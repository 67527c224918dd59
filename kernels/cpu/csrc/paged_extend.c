/* Paged extend attention for the CPU: the new tokens of each sequence (a prompt, or a chunk of one) attend
 * causally to its whole paged K/V, the cached prefix and their own rows (stored before the call).
 *
 * The decode kernel (paged_decode.c) serves one query a cached row at a time; run once per prompt token it
 * reads every key once per query and reduces each score across lanes. Here many queries share each key:
 * every sequence's K/V of each KV head is first laid out once, in tiles of 16 keys, as the two products
 * need them (`relayout_tile`), then groups of query rows run flash-attention style over those tiles with their
 * output rows in registers: scores of 16 keys per vector by vdpbf16ps over the head's dimension pairs, an
 * online softmax, and P @ V by vdpbf16ps over pairs of keys (probabilities rounded to bf16, as the decode
 * kernel and flash attention on GPUs do). Sums are fp32.
 *
 * Where the CPU has AMX, a strip of 16 query rows multiplies both products through tile registers instead, in
 * three passes over its keys (attend_strip_amx): the same tiles are the layout AMX takes.
 *
 * With AVX2 (no AVX512-BF16) the same tiles hold fp32, 8 keys each: scores of 8 keys per vector by FMAs over the
 * head's dimensions, the probabilities kept in fp32 for P @ V.
 *
 * bf16 only, head dims 64 and 128, AVX512-BF16 or AVX2 with FMA; the caller falls back elsewhere. Layouts:
 *   q               [tokens, heads, head_dim]  row stride q_stride elements
 *   k/v_cache       [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables    [batch, max_blocks] int32
 *   query_start_loc [batch + 1] int32: sequence b's new tokens are rows [query_start_loc[b], [b + 1])
 *   seq_lens        [batch] int32: cached tokens after this step, the new ones included
 *   out             [tokens, heads, head_dim]  only the rows of the sequences this call serves are written
 * With a sliding window (window > 0) a query at position p sees keys p - window + 1 to p: a sequence's tiles
 * start at the step holding the earliest key any of its new tokens sees (keys before it in those tiles zero,
 * blocks before it never read). With soft-capping (softcap > 0) scores become softcap * tanh(score / softcap)
 * after scaling (Gemma 2).
 */
#include <float.h>
#include <limits.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 128
#define STEP_KEYS 64   /* a multiple of every step's keys (T tiles) */
#define QUERY_CHUNK 16 /* new tokens per task: enough tasks to balance threads on one prompt */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_EXTEND 1
typedef uint16_t kv_t; /* the tiles' values: bf16 */
#define KEYS 16        /* keys per tile: one vector of scores */
/* Array bounds (fixed, unlike C's variable-length arrays, so that the compiler keeps them in registers). */
#define MAX_ROWS 4
#define MAX_STEP 4
/* Rows a group and tiles a step (R, T) by head dim, the fastest measured: the scores (R * T vectors), the output
 * rows (R * D / 16) and a step's key vectors (T) fit the 32 vector registers. */
#define RT64 3, 4
#define RT128 2, 4
#define TASK_SCRATCH 0 /* bytes of scratch a thread's tasks need */
#define MAX_GROUP INT_MAX /* query heads a KV head: any */

/* Tile j of one KV head of one sequence, from the paged cache: keys as [D/2][16 keys][2] (dimension pair p of
 * 16 keys in one vector, which a query's pair p multiplies into 16 scores) and values as [8][D][2] (keys 2i
 * and 2i + 1 interleaved along the dimensions, which a pair of probabilities multiplies). Keys before `from`
 * (outside every window) and from `len` on are zero, so their masked probabilities multiply zeros, never
 * stale NaNs. */
static void relayout_tile(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int from, int len,
                          int block_size, int row_stride, int head_offset, int D, int j, uint16_t *keys,
                          uint16_t *values) {
    for (int t = 0; t < KEYS; t++) {
        int key = j * KEYS + t;
        uint16_t *vt = values + (long)(t / 2) * D * 2 + (t & 1);
        if (key < from || key >= len) {
            for (int p = 0; p < D / 2; p++) keys[(p * KEYS + t) * 2] = keys[(p * KEYS + t) * 2 + 1] = 0;
            for (int d = 0; d < D; d++) vt[2 * d] = 0;
            continue;
        }
        long row = ((long)table[key / block_size] * block_size + key % block_size) * row_stride + head_offset;
        const uint16_t *k = k_cache + row, *v = v_cache + row;
        for (int p = 0; p < D / 2; p++) {
            keys[(p * KEYS + t) * 2] = k[2 * p];
            keys[(p * KEYS + t) * 2 + 1] = k[2 * p + 1];
        }
        for (int d = 0; d < D; d++) vt[2 * d] = v[d];
    }
}

/* R query rows of one KV head (row r at position pos[r]) against the tiles of keys up to the latest of them, from
 * the step holding the earliest key one of them sees (keys: from tile j0 on), T tiles a step: each key vector
 * loaded serves R rows, each query pair T tiles, and the softmax's maximum and rescaling come once a step. D, R
 * and T are constants at each call site, so the output rows (R * D / 16 vectors) and the step's scores (R * T
 * vectors) stay in registers. */
static inline __attribute__((always_inline)) void attend_rows(const int D, const int R, const int T,
                                                              const uint16_t *const *q, const int *pos,
                                                              const uint16_t *keys, const uint16_t *values, int j0,
                                                              float scale, int window, float cap,
                                                              uint16_t *const *out) {
    const int NO = D / 16;
    __m512 acc[MAX_ROWS][MAX_HEAD_DIM / 16], sums[MAX_ROWS];
    float m[MAX_ROWS];
    int last = 0, earliest = INT_MAX;
    for (int r = 0; r < R; r++) {
        for (int i = 0; i < NO; i++) acc[r][i] = _mm512_setzero_ps();
        sums[r] = _mm512_setzero_ps();
        m[r] = -FLT_MAX;
        last = pos[r] > last ? pos[r] : last;
        earliest = pos[r] < earliest ? pos[r] : earliest;
    }
    int start = window > 0 && earliest - window + 1 > j0 * KEYS ? (earliest - window + 1) / KEYS / T * T : j0;
    for (int j = start; j <= last / KEYS; j += T) {
        const uint16_t *kt = keys + (long)(j - j0) * D * KEYS, *vt = values + (long)(j - j0) * D * KEYS;
        __m512 s[MAX_ROWS][MAX_STEP];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) s[r][t] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; p++) {
            __m512bh k[MAX_STEP];
            for (int t = 0; t < T; t++) k[t] = (__m512bh)_mm512_loadu_si512(kt + ((long)t * D / 2 + p) * KEYS * 2);
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, q[r] + 2 * p, sizeof pair);
                __m512bh qp = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int t = 0; t < T; t++) s[r][t] = _mm512_dpbf16_ps(s[r][t], k[t], qp);
            }
        }
        uint32_t pairs[MAX_ROWS][MAX_STEP * KEYS / 2];
        for (int r = 0; r < R; r++) {
            __mmask16 visible[MAX_STEP];
            __m512 top = _mm512_set1_ps(m[r]);
            for (int t = 0; t < T; t++) {
                visible[t] = first_lanes(pos[r] - (j + t) * KEYS + 1);
                if (window > 0) visible[t] &= ~first_lanes(pos[r] - window + 1 - (j + t) * KEYS);
                s[r][t] = _mm512_mul_ps(s[r][t], _mm512_set1_ps(scale));
                if (cap > 0.f) s[r][t] = soft_cap512(s[r][t], cap);
                top = _mm512_mask_max_ps(top, visible[t], top, s[r][t]);
            }
            float new_max = _mm512_reduce_max_ps(top);
            __m512 shift = _mm512_set1_ps(new_max), correction = _mm512_set1_ps(expf_nonpositive(m[r] - new_max));
            m[r] = new_max;
            sums[r] = _mm512_mul_ps(sums[r], correction);
            for (int i = 0; i < NO; i++) acc[r][i] = _mm512_mul_ps(acc[r][i], correction);
            for (int t = 0; t < T; t++) {
                __m512 p = _mm512_maskz_mov_ps(visible[t], exp512_nonpositive(_mm512_sub_ps(s[r][t], shift)));
                sums[r] = _mm512_add_ps(sums[r], p);
                _mm256_storeu_si256((__m256i *)(pairs[r] + t * KEYS / 2), (__m256i)_mm512_cvtneps_pbh(p));
            }
        }
        for (int kp = 0; kp < T * KEYS / 2; kp++) {
            __m512bh w[MAX_ROWS];
            for (int r = 0; r < R; r++) w[r] = (__m512bh)_mm512_set1_epi32((int)pairs[r][kp]);
            for (int i = 0; i < NO; i++) {
                __m512bh v = (__m512bh)_mm512_loadu_si512(vt + ((long)kp * D + 16 * i) * 2);
                for (int r = 0; r < R; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], v, w[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sums[r]));
        for (int i = 0; i < NO; i++)
            _mm256_storeu_si256((__m256i *)(out[r] + 16 * i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][i], inv)));
    }
}

/* All query rows of one task, R at a time: rows are (token, query head of the group) in that order, so a group
 * of R rows spans one or two positions. A last group short of R repeats its last row into a scratch row. */
static inline __attribute__((always_inline)) void attend_task(const int D, const int R, const int T, const uint16_t *q,
                                                              long q_stride, int group, int heads, int head0,
                                                              int first_pos, int tokens, const uint16_t *keys,
                                                              const uint16_t *values, int j0, float scale,
                                                              int window, float cap, uint16_t *out, void *unused) {
    (void)unused;
    uint16_t scratch[MAX_HEAD_DIM];
    for (int row0 = 0; row0 < tokens * group; row0 += R) {
        const uint16_t *rows[MAX_ROWS];
        uint16_t *outs[MAX_ROWS];
        int pos[MAX_ROWS];
        for (int r = 0; r < R; r++) {
            int row = row0 + r < tokens * group ? row0 + r : tokens * group - 1, t = row / group;
            int head = head0 + row % group;
            rows[r] = q + (long)t * q_stride + (long)head * D;
            outs[r] = row0 + r < tokens * group ? out + ((long)t * heads + head) * D : scratch;
            pos[r] = first_pos + t;
        }
        attend_rows(D, R, T, rows, pos, keys, values, j0, scale, window, cap, outs);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_EXTEND_AMX 1
#include "amx.h"

/* With AMX a tile multiply takes 16 query rows by 32 dimensions against 16 keys at once (the key tiles above
 * are already the layout it takes, as are the value tiles for P @ V), so a strip of 16 rows runs as three
 * passes over its keys: S = Q K^T through tiles, the softmax row by row in vectors (exact maxima, no
 * rescaling), and O = P V through tiles, its sums in tile registers for all the keys. Tiles, all 16 rows by
 * 64 bytes: for S, tmm0 and tmm1 a key tile's dimension blocks, tmm2 and tmm3 the scores of two key tiles,
 * tmm4-7 the queries' dimension blocks (32 dimensions each); for O, tmm0 a block of P (32 keys), tmm1-3
 * value blocks, tmm4-7 four blocks of 16 dimensions of O. */
#define STRIP 16
#define DIMS_A_PASS 64 /* dimensions of O a pass over P: four tiles */

static int extend_amx = 1; /* tests turn it off to exercise the vdpbf16ps routine on AMX CPUs */

/* Scores of key tile j (16 keys) for the strip's queries, in tiles 4.. (D / 32 of them), into scores. */
#define SCORE_TILE(S, B, D, j)                                                                               \
    do {                                                                                                     \
        const uint16_t *kt = keys + (long)((j) - j0) * (D) * KEYS;                                           \
        _tile_zero(S);                                                                                       \
        _tile_loadd(B, kt, 64);                                                                              \
        _tile_dpbf16ps(S, 4, B);                                                                             \
        _tile_loadd(B, kt + 16 * KEYS * 2, 64);                                                              \
        _tile_dpbf16ps(S, 5, B);                                                                             \
        if ((D) == 128) {                                                                                    \
            _tile_loadd(B, kt + 32 * KEYS * 2, 64);                                                          \
            _tile_dpbf16ps(S, 6, B);                                                                         \
            _tile_loadd(B, kt + 48 * KEYS * 2, 64);                                                          \
            _tile_dpbf16ps(S, 7, B);                                                                         \
        }                                                                                                    \
        _tile_stored(S, scores + (long)(j) * KEYS, 4 * width);                                               \
    } while (0)

/* One strip of up to 16 query rows (row r: its query qrows[r], at position pos[r], out to outs[r]) over the
 * keys up to its latest position, from the pair of tiles holding the earliest key one of them sees (keys and
 * values: from tile j0 on). Scratch: qbuf [16][D] bf16, scores [16][width] fp32 and probs [16][width]
 * bf16 for width = keys rounded up to 32, obuf [16][64] fp32. */
static void attend_strip_amx(const int D, int rows, const uint16_t *const *qrows, const int *pos,
                             const uint16_t *keys, const uint16_t *values, int j0, float scale, int window, float cap,
                             uint16_t *const *outs, uint16_t *qbuf, float *scores, uint16_t *probs, float *obuf) {
    int last = 0, earliest = INT_MAX;
    for (int r = 0; r < rows; r++) {
        last = pos[r] > last ? pos[r] : last;
        earliest = pos[r] < earliest ? pos[r] : earliest;
    }
    const int width = (last / 32 + 1) * 32, key_tiles = width / KEYS;
    /* the first key column: a multiple of 32 (whole pairs of tiles), at or after tile j0 */
    const int c0 = window > 0 && earliest - window + 1 > j0 * KEYS ? (earliest - window + 1) / 32 * 32 : j0 * KEYS;
    for (int r = 0; r < STRIP; r++) {
        if (r < rows)
            memcpy(qbuf + r * D, qrows[r], sizeof(uint16_t) * D);
        else
            memset(qbuf + r * D, 0, sizeof(uint16_t) * D);
    }
    _tile_loadd(4, qbuf, 2 * D);
    _tile_loadd(5, qbuf + 32, 2 * D);
    if (D == 128) {
        _tile_loadd(6, qbuf + 64, 2 * D);
        _tile_loadd(7, qbuf + 96, 2 * D);
    }
    for (int j = c0 / KEYS; j < key_tiles; j += 2) { /* width is whole pairs of key tiles */
        SCORE_TILE(2, 0, D, j);
        SCORE_TILE(3, 1, D, j + 1);
    }
    float sums[STRIP];
    for (int r = 0; r < STRIP; r++) {
        float *s = scores + (long)r * width;
        uint16_t *p = probs + (long)r * width;
        int visible = r < rows ? pos[r] + 1 : 0, hidden = window > 0 && r < rows ? pos[r] - window + 1 : 0;
        __m512 top = _mm512_set1_ps(-FLT_MAX), sum = _mm512_setzero_ps(), k = _mm512_set1_ps(scale);
        for (int c = c0; c < visible; c += 16) {
            __mmask16 lanes = first_lanes(visible - c) & ~first_lanes(hidden - c);
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + c), k);
            top = _mm512_mask_max_ps(top, lanes, top, cap > 0.f ? soft_cap512(x, cap) : x);
        }
        __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int c = c0; c < width; c += 16) {
            __mmask16 lanes = c < visible ? first_lanes(visible - c) & ~first_lanes(hidden - c) : 0;
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + c), k);
            __m512 e = exp512_nonpositive(_mm512_sub_ps(cap > 0.f ? soft_cap512(x, cap) : x, shift));
            e = _mm512_maskz_mov_ps(lanes, e);
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(p + c), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[r] = _mm512_reduce_add_ps(sum);
    }
    for (int d0 = 0; d0 < D; d0 += DIMS_A_PASS) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int c = c0; c < width; c += 32) {
            /* value rows: key pairs of keys c..c+31 (two value tiles, contiguous), D pairs of dims apart */
            const uint16_t *vt = values + (long)(c / KEYS - j0) * D * KEYS + 2 * d0;
            tiles_pv(probs + c, 2 * width, vt, 4 * D);
        }
        _tile_stored(4, obuf, 4 * DIMS_A_PASS);
        _tile_stored(5, obuf + 16, 4 * DIMS_A_PASS);
        _tile_stored(6, obuf + 32, 4 * DIMS_A_PASS);
        _tile_stored(7, obuf + 48, 4 * DIMS_A_PASS);
        for (int r = 0; r < rows; r++) {
            __m512 inv = _mm512_set1_ps(1.f / sums[r]);
            for (int i = 0; i < DIMS_A_PASS / 16; i++)
                _mm256_storeu_si256((__m256i *)(outs[r] + d0 + 16 * i),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(obuf + r * DIMS_A_PASS + 16 * i), inv)));
        }
    }
}

/* A task's rows (token, query head of the group), 16 at a time, through attend_strip_amx. */
static void attend_task_amx(const int D, const uint16_t *q, long q_stride, int group, int heads, int head0,
                            int first_pos, int tokens, const uint16_t *keys, const uint16_t *values, int j0,
                            float scale, int window, float cap, uint16_t *out, uint16_t *qbuf, float *scores,
                            uint16_t *probs, float *obuf) {
    for (int row0 = 0; row0 < tokens * group; row0 += STRIP) {
        const uint16_t *rows[STRIP];
        uint16_t *outs[STRIP];
        int pos[STRIP], n = tokens * group - row0 < STRIP ? tokens * group - row0 : STRIP;
        for (int r = 0; r < n; r++) {
            int t = (row0 + r) / group, head = head0 + (row0 + r) % group;
            rows[r] = q + (long)t * q_stride + (long)head * D;
            outs[r] = out + ((long)t * heads + head) * D;
            pos[r] = first_pos + t;
        }
        attend_strip_amx(D, n, rows, pos, keys, values, j0, scale, window, cap, outs, qbuf, scores, probs, obuf);
    }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_EXTEND 1
typedef float kv_t; /* the tiles' values: fp32 */
#define KEYS 8          /* keys per tile: one vector of scores */
#define MAX_ROWS 2
#define MAX_STEP 4
/* Rows a group and tiles a step: 8 score vectors, a step's 4 key vectors and a broadcast of q fit the 16
 * vector registers, as do P @ V's 8 sums (2 rows by 32 dimensions), its 4 value vectors and a broadcast. */
#define RT64 2, 4
#define RT128 2, 4

/* Tile j of one KV head of one sequence in fp32: keys as [D][8 keys] (dimension d of 8 keys in one vector,
 * which a query's dimension d multiplies into 8 scores) and values as [8 keys][D]. Keys before `from` and from
 * `len` on are zero. */
static void relayout_tile(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int from, int len,
                          int block_size, int row_stride, int head_offset, int D, int j, float *keys,
                          float *values) {
    for (int t = 0; t < KEYS; t++) {
        int key = j * KEYS + t;
        float *vt = values + (long)t * D;
        if (key < from || key >= len) {
            for (int d = 0; d < D; d++) keys[d * KEYS + t] = vt[d] = 0.f;
            continue;
        }
        long row = ((long)table[key / block_size] * block_size + key % block_size) * row_stride + head_offset;
        const uint16_t *k = k_cache + row, *v = v_cache + row;
        for (int d = 0; d < D; d++) {
            keys[d * KEYS + t] = bf16_to_float(k[d]);
            vt[d] = bf16_to_float(v[d]);
        }
    }
}

/* The running state of one query row: its query in fp32 (scaled), its output sums, softmax maximum and sum, its
 * position and its window's first key (0 without one). */
struct row_state {
    float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], m, sum;
    int pos, from;
};

/* R rows' states against tiles j0 up to j1 (exclusive), T tiles a step, with an online softmax as in the AVX-512
 * routine; keys and values hold the tiles from `base` on. D, R and T are constants at each call site, so a step's
 * scores (R * T vectors) and P @ V's sums (R rows by 32 dimensions) stay in registers. */
static inline __attribute__((always_inline)) void attend_steps(const int D, const int R, const int T,
                                                               struct row_state *const *st, int j0, int j1,
                                                               const float *keys, const float *values, int base,
                                                               int window, float cap) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = j0; j < j1; j += T) {
        const float *kt = keys + (long)(j - base) * D * KEYS, *vt = values + (long)(j - base) * D * KEYS;
        __m256 s[MAX_ROWS][MAX_STEP];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) s[r][t] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m256 k[MAX_STEP];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) k[t] = _mm256_loadu_ps(kt + ((long)t * D + d) * KEYS);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                __m256 qd = _mm256_broadcast_ss(&st[r]->q[d]);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) s[r][t] = _mm256_fmadd_ps(k[t], qd, s[r][t]);
            }
        }
        float p[MAX_ROWS][MAX_STEP * KEYS], correction[MAX_ROWS];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            __m256i visible[MAX_STEP]; /* keys up to the row's own position */
            __m256 top = _mm256_set1_ps(st[r]->m), sum = _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32((j + t) * KEYS));
                visible[t] = _mm256_cmpgt_epi32(_mm256_set1_epi32(st[r]->pos + 1), key);
                if (window > 0) {
                    __m256i seen = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(st[r]->from - 1));
                    visible[t] = _mm256_and_si256(visible[t], seen);
                }
                if (cap > 0.f) s[r][t] = soft_cap256(s[r][t], cap);
                top = _mm256_max_ps(top, _mm256_blendv_ps(top, s[r][t], _mm256_castsi256_ps(visible[t])));
            }
            top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
            top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0x4e));
            top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0xb1));
            float new_max = _mm256_cvtss_f32(top);
            correction[r] = expf_nonpositive(st[r]->m - new_max);
            st[r]->m = new_max;
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                __m256 e = exp256_nonpositive(_mm256_sub_ps(s[r][t], top));
                e = _mm256_and_ps(e, _mm256_castsi256_ps(visible[t]));
                sum = _mm256_add_ps(sum, e);
                _mm256_storeu_ps(p[r] + t * KEYS, e);
            }
            sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 1));
            sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0x4e));
            sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0xb1));
            st[r]->sum = st[r]->sum * correction[r] + _mm256_cvtss_f32(sum);
        }
        for (int d0 = 0; d0 < D; d0 += 32) {
            __m256 a[MAX_ROWS][4];
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                __m256 c = _mm256_set1_ps(correction[r]);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(st[r]->acc + d0 + 8 * i), c);
            }
            for (int key = 0; key < T * KEYS; key++) {
                __m256 v[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(vt + (long)key * D + d0 + 8 * i);
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) {
                    __m256 pk = _mm256_broadcast_ss(&p[r][key]);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) a[r][i] = _mm256_fmadd_ps(v[i], pk, a[r][i]);
                }
            }
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(st[r]->acc + d0 + 8 * i, a[r][i]);
        }
    }
}

/* All query rows of one task (rows (token, query head of the group) in that order), flash-attention style with
 * the keys outermost: a block of BLOCK_TILES tiles (K and V of 128 keys, 64-128 KB) meets every row that sees
 * it while it is in L2, R rows at a time, the rows' states kept in between. Row by row instead, every pair of
 * rows would stream the sequence's whole K/V from L3, which held the routine to a third of its FMA rate.
 * Rows go in parts of up to MAX_TASK_ROWS; `state` holds that many and R - 1 more, for a last group short of R
 * to repeat its last row into. */
#define BLOCK_TILES 16
#define MAX_TASK_ROWS (QUERY_CHUNK * 8)
#define TASK_SCRATCH (sizeof(struct row_state) * (MAX_TASK_ROWS + MAX_ROWS))
#define MAX_GROUP MAX_TASK_ROWS /* query heads a KV head: a token's rows fit a part */
static inline __attribute__((always_inline)) void attend_task(const int D, const int R, const int T, const uint16_t *q,
                                                              long q_stride, int group, int heads, int head0,
                                                              int first_pos, int tokens, const float *keys,
                                                              const float *values, int j0, float scale, int window,
                                                              float cap, uint16_t *out, struct row_state *state) {
    int part = MAX_TASK_ROWS / group; /* tokens a part */
    for (int t0 = 0; t0 < tokens; t0 += part) {
        int n = tokens - t0 < part ? tokens - t0 : part, rows = n * group, padded = (rows + R - 1) / R * R;
        for (int row = 0; row < padded; row++) {
            int from = row < rows ? row : rows - 1;
            const uint16_t *qr = q + (long)(t0 + from / group) * q_stride + (long)(head0 + from % group) * D;
            for (int d = 0; d < D; d++) {
                state[row].q[d] = bf16_to_float(qr[d]) * scale;
                state[row].acc[d] = 0.f;
            }
            state[row].m = -FLT_MAX;
            state[row].sum = 0.f;
            state[row].pos = first_pos + t0 + from / group;
            state[row].from = window > 0 && state[row].pos - window + 1 > 0 ? state[row].pos - window + 1 : 0;
        }
        int last_tile = (first_pos + t0 + n - 1) / KEYS;
        /* from the step holding the part's earliest visible key, at or after tile j0 (where keys start) */
        int first_tile = state[0].from / KEYS / T * T > j0 ? state[0].from / KEYS / T * T : j0;
        for (int b = first_tile; b <= last_tile; b += BLOCK_TILES)
            for (int row0 = 0; row0 < padded; row0 += R) {
                struct row_state *st[MAX_ROWS];
                for (int r = 0; r < R; r++) st[r] = &state[row0 + r];
                /* this block's tiles from the earlier row's window up to the later row's position, in whole
                 * steps (past them masked) */
                int end = st[R - 1]->pos / KEYS + 1, j1 = b + BLOCK_TILES < end ? b + BLOCK_TILES : end;
                int j0r = st[0]->from / KEYS / T * T > b ? st[0]->from / KEYS / T * T : b;
                if (j0r < j1)
                    attend_steps(D, R, T, st, j0r, j0r + (j1 - j0r + T - 1) / T * T, keys, values, j0, window, cap);
            }
        for (int row = 0; row < rows; row++) {
            uint16_t *o = out + ((long)(t0 + row / group) * heads + head0 + row % group) * D;
            for (int d = 0; d < D; d++) o[d] = float_to_bf16(state[row].acc[d] / state[row].sum);
        }
    }
}
#endif

#ifdef HAVE_EXTEND
/* Tiles a sequence of `len` keys takes up to its last key: whole steps of the longest step, the last ones zero. */
static inline int seq_tiles(int len) {
    return (len + STEP_KEYS - 1) / STEP_KEYS * (STEP_KEYS / KEYS);
}

/* The earliest key the n new tokens of a sequence of `len` keys see (0 without a window). */
static inline int first_key(int len, int n, int window) {
    return window > 0 && len - n - window + 1 > 0 ? len - n - window + 1 : 0;
}

/* The tiles before the step holding that key, which the buffers leave out (whole steps, so that every routine's
 * steps and pairs of tiles stay aligned). */
static inline int skipped_tiles(int len, int n, int window) {
    return first_key(len, n, window) / STEP_KEYS * (STEP_KEYS / KEYS);
}

struct task {
    int seq, head, token; /* the sequence, its KV head, the first of its new tokens this task takes */
};

/* Costlier tasks (later positions) first, so that the last ones to finish are short. */
static int later_first(const void *a, const void *b) {
    const struct task *x = a, *y = b;
    return y->token - x->token;
}

/* Serves the sequences that bring min_query_len to max_query_len new tokens. Returns 0; -1 where there is no
 * kernel for the shape, -2 without memory for the tiles (nothing written either way). */
int paged_extend(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *query_start_loc, const int32_t *seq_lens,
                 uint16_t *out, int batch, int heads, int kv_heads, int head_dim, int block_size, int min_query_len,
                 int max_query_len, float scale, int window, float softcap, int num_threads) {
    if ((head_dim != 64 && head_dim != 128) || heads % kv_heads || heads / kv_heads > MAX_GROUP) return -1;
    const int D = head_dim, group = heads / kv_heads, row_stride = kv_heads * D;
    /* Where each served sequence's tiles start in the buffers (-1: not served), and how many tasks there are.
     * The buffers hold, per served sequence and KV head, its keys' tiles from its first skipped tile on and then,
     * after all of them, the values' tiles in the same order. */
    long *tile0 = malloc(sizeof(long) * batch);
    int *skip = malloc(sizeof(int) * batch), *kept = malloc(sizeof(int) * batch); /* tiles left out, and in */
    if (!tile0 || !skip || !kept) {
        free(tile0);
        free(skip);
        free(kept);
        return -2;
    }
    int tasks = 0;
    long tiles = 0;
    for (int b = 0; b < batch; b++) {
        int n = query_start_loc[b + 1] - query_start_loc[b];
        tile0[b] = n >= min_query_len && n <= max_query_len && n > 0 ? tiles : -1;
        if (tile0[b] >= 0) {
            skip[b] = skipped_tiles(seq_lens[b], n, window);
            kept[b] = seq_tiles(seq_lens[b]) - skip[b];
            tiles += kept[b];
            tasks += kv_heads * ((n + QUERY_CHUNK - 1) / QUERY_CHUNK);
        }
    }
    if (tasks == 0) {
        free(tile0);
        free(skip);
        free(kept);
        return 0;
    }
    long tile_values = (long)D * KEYS; /* per tile and KV head, in keys and again in values */
    long strip_bytes = 0; /* AMX: a thread's strip scratch (attend_strip_amx) */
#ifdef HAVE_EXTEND_AMX
    long widest = 0; /* the keys of the longest served sequence, rounded up to 32 */
    if (extend_amx && amx_permitted()) {
        for (int b = 0; b < batch; b++)
            if (tile0[b] >= 0 && seq_lens[b] > widest) widest = seq_lens[b];
        widest = (widest + 31) / 32 * 32;
        strip_bytes = (4L * STRIP * 64 + 6L * STRIP * widest + 2L * STRIP * MAX_HEAD_DIM + 63) / 64 * 64;
    }
#endif
    kv_t *keys = malloc(sizeof(kv_t) * tiles * kv_heads * tile_values * 2);
    struct task *list = malloc(sizeof(struct task) * tasks);
    char *scratch = TASK_SCRATCH ? malloc(TASK_SCRATCH * num_threads) : 0; /* each thread's part */
    char *strips = strip_bytes ? aligned_alloc(64, strip_bytes * num_threads) : 0; /* each thread's part */
    if (!keys || !list || (TASK_SCRATCH && !scratch) || (strip_bytes && !strips)) {
        free(tile0);
        free(skip);
        free(kept);
        free(keys);
        free(list);
        free(scratch);
        free(strips);
        return -2;
    }
    kv_t *values = keys + tiles * kv_heads * tile_values;
    int at = 0;
    for (int b = 0; b < batch; b++) {
        int n = query_start_loc[b + 1] - query_start_loc[b];
        if (tile0[b] < 0) continue;
        for (int h = 0; h < kv_heads; h++)
            for (int t = 0; t < n; t += QUERY_CHUNK) list[at++] = (struct task){b, h, seq_lens[b] - n + t};
    }
    qsort(list, tasks, sizeof *list, later_first);
#pragma omp parallel num_threads(num_threads)
    {
        /* Every served sequence's tiles, for every KV head, laid out once. */
#pragma omp for schedule(static)
        for (long i = 0; i < tiles * kv_heads; i++) {
            long tile = i / kv_heads;
            int h = (int)(i % kv_heads), b = 0;
            while (tile0[b] < 0 || tile0[b] + kept[b] <= tile) b++;
            long at_tile = tile0[b] * kv_heads + (long)h * kept[b] + (tile - tile0[b]);
            int n = query_start_loc[b + 1] - query_start_loc[b];
            relayout_tile(k_cache, v_cache, block_tables + (long)b * max_blocks, first_key(seq_lens[b], n, window),
                          seq_lens[b], block_size, row_stride, h * D, D, skip[b] + (int)(tile - tile0[b]),
                          keys + at_tile * tile_values, values + at_tile * tile_values);
        }
        void *own = scratch ? scratch + TASK_SCRATCH * omp_get_thread_num() : 0;
#ifdef HAVE_EXTEND_AMX
        /* The thread's strip scratch, in the parts attend_strip_amx takes. */
        char *strip = strips ? strips + strip_bytes * omp_get_thread_num() : 0;
        float *obuf = 0, *scores = 0;
        uint16_t *qbuf = 0, *probs = 0;
        if (strip) {
            obuf = (float *)strip, scores = obuf + STRIP * 64;
            qbuf = (uint16_t *)(scores + STRIP * widest), probs = qbuf + STRIP * MAX_HEAD_DIM;
            configure_full_tiles();
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < tasks; i++) {
            struct task task = list[i];
            int b = task.seq, n = query_start_loc[b + 1] - query_start_loc[b];
            int first = task.token - (seq_lens[b] - n), tokens = n - first < QUERY_CHUNK ? n - first : QUERY_CHUNK;
            long at_tile = tile0[b] * kv_heads + (long)task.head * kept[b];
            const uint16_t *rows = q + (long)(query_start_loc[b] + first) * q_stride;
            uint16_t *dst = out + (long)(query_start_loc[b] + first) * heads * D;
#ifdef HAVE_EXTEND_AMX
            if (strip) {
                attend_task_amx(D, rows, q_stride, group, heads, task.head * group, task.token, tokens,
                                keys + at_tile * tile_values, values + at_tile * tile_values, skip[b], scale, window,
                                softcap, dst, qbuf, scores, probs, obuf);
                continue;
            }
#endif
            if (D == 64)
                attend_task(64, RT64, rows, q_stride, group, heads, task.head * group, task.token, tokens,
                            keys + at_tile * tile_values, values + at_tile * tile_values, skip[b], scale, window,
                            softcap, dst, own);
            else
                attend_task(128, RT128, rows, q_stride, group, heads, task.head * group, task.token, tokens,
                            keys + at_tile * tile_values, values + at_tile * tile_values, skip[b], scale, window,
                            softcap, dst, own);
        }
#ifdef HAVE_EXTEND_AMX
        if (strip) _tile_release(); /* a thread holding tile state costs every context switch 8 KB more */
#endif
    }
    free(strips);
    free(tile0);
    free(skip);
    free(kept);
    free(keys);
    free(list);
    free(scratch);
    return 0;
}

#else
int paged_extend(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *query_start_loc, const int32_t *seq_lens,
                 uint16_t *out, int batch, int heads, int kv_heads, int head_dim, int block_size, int min_query_len,
                 int max_query_len, float scale, int window, float softcap, int num_threads) {
    return -1; /* neither AVX512-BF16 nor AVX2 here: the caller takes another path */
}
#endif

/* Whether the kernel multiplies through AMX tiles (on: where the CPU has them, the default) or not; returns
 * whether it now does. */
int paged_extend_set_amx(int on) {
#ifdef HAVE_EXTEND_AMX
    extend_amx = on;
    return on && amx_permitted();
#else
    (void)on;
    return 0;
#endif
}
