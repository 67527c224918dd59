/* Mixture-of-experts MLP, fused: every token's top-k experts, each a SiLU-gated MLP, summed with the router's
 * weights. The step's (token, expert) pairs are sorted by expert first, so each chosen expert's weights stream
 * through once for all of its tokens, and an expert no token chose is never read (a batch-1 step reads only
 * its k experts).
 *
 * Two routes, by how many tokens an expert has this step:
 *  - few (decode): threads take (expert, block of weight rows) items, so a step with one busy expert still
 *    spreads over every thread. Each weight is read as stored (int8 times its group's scale, bf16 or fp32),
 *    once per chunk of up to 8 of the expert's tokens, and multiplied into fp32 sums held in registers: a tile
 *    of up to 4 rows by the chunk's tokens, so a lone token still keeps 4 independent sums in flight.
 *  - many (a prompt, bf16 activations): the expert's tokens are gathered and its gate/up and down projections
 *    run through the dense bf16 kernel's routines (linear_bf16_from: AMX tiles, vdpbf16ps or FMAs, as the
 *    caller's plan says), its weight dequantized a tile of 32 rows at a time into the kernel's pair layout.
 * fp32 inside; the output is rounded once, to the activations' dtype. */
#include <stdlib.h>

#include "bf16.h"

#define MOE_ROWS 16  /* weight rows per work item */
#define MOE_CHUNK 8  /* tokens whose sums a tile keeps in registers */

/* How the expert weights are stored: fp32, bf16, or int8 with an fp32 scale per group of inputs
 * (w = scale * q: GGUF's Q8_0, group 32; the engine's int8 quantization, one group per row). */
enum moe_weight { MOE_F32, MOE_BF16, MOE_INT8 };

/* Rows of one projection of one expert: `n` rows of length k from `w`, and (int8) their scales [n, k / group]. */
struct moe_rows {
    const char *w;
    const float *scale;
    int type, group, n, k;
};

static inline size_t moe_elem(int type) { return type == MOE_F32 ? 4 : type == MOE_BF16 ? 2 : 1; }

/* Row r's value at column c, in fp32. */
static inline float moe_at(const struct moe_rows *b, int r, int c) {
    long i = (long)r * b->k + c;
    if (b->type == MOE_F32) return ((const float *)b->w)[i];
    if (b->type == MOE_BF16) return bf16_to_float(((const uint16_t *)b->w)[i]);
    return b->scale[(long)r * (b->k / b->group) + c / b->group] * (float)((const int8_t *)b->w)[i];
}

/* The plain loops: out[p * ld + r] = x[p] . row r for rows [r0, r1), where the vector code cannot run. */
static void moe_rows_portable(const struct moe_rows *b, int r0, int r1, const float *const *x, int count, float *out,
                              long ld) {
    for (int p = 0; p < count; p++)
        for (int r = r0; r < r1; r++) {
            float s = 0.f;
            for (int c = 0; c < b->k; c++) s += x[p][c] * moe_at(b, r, c);
            out[(long)p * ld + r - r0] = s;
        }
}

#ifdef __AVX512F__
/* 16 values of a row from column c in fp32; int8 times `scale`. */
static inline __attribute__((always_inline)) __m512 moe_load16(const int type, const char *row, int c, float scale) {
    if (type == MOE_F32) return _mm512_loadu_ps((const float *)row + c);
    if (type == MOE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
    return _mm512_mul_ps(q, _mm512_set1_ps(scale));
}

/* out[p * ld + j] = x[p] . row (r0 + j) for j < R, p < P: R * P sums in registers, each weight loaded once. */
static inline __attribute__((always_inline)) void moe_tile(const int type, const int R, const int P,
                                                           const struct moe_rows *b, int r0, const float *const *x,
                                                           float *out, long ld) {
    __m512 acc[R][P];
    const char *row[R];
    const float *scale[R];
    int groups = type == MOE_INT8 ? b->k / b->group : 1;
    for (int j = 0; j < R; j++) {
        row[j] = b->w + (long)(r0 + j) * b->k * moe_elem(type);
        scale[j] = type == MOE_INT8 ? b->scale + (long)(r0 + j) * groups : 0;
        for (int p = 0; p < P; p++) acc[j][p] = _mm512_setzero_ps();
    }
    int g = 0, next = type == MOE_INT8 ? b->group : b->k;
    for (int c = 0; c < b->k; c += 16) {
        if (c == next) g++, next += b->group;
        __m512 xv[P];
        for (int p = 0; p < P; p++) xv[p] = _mm512_loadu_ps(x[p] + c);
        for (int j = 0; j < R; j++) {
            __m512 w = moe_load16(type, row[j], c, type == MOE_INT8 ? scale[j][g] : 0.f);
            for (int p = 0; p < P; p++) acc[j][p] = _mm512_fmadd_ps(w, xv[p], acc[j][p]);
        }
    }
    for (int j = 0; j < R; j++)
        for (int p = 0; p < P; p++) out[(long)p * ld + j] = _mm512_reduce_add_ps(acc[j][p]);
}

/* Rows [r0, r1) against P (<= MOE_CHUNK) tokens: tiles of 4 rows for up to 4 tokens, of 2 for more (registers
 * hold R * P sums, P inputs and a weight), then single rows. */
static inline __attribute__((always_inline)) void moe_rows_typed(const int type, const int P, const struct moe_rows *b,
                                                                 int r0, int r1, const float *const *x, float *out,
                                                                 long ld) {
    int r = r0;
    if (P <= 4)
        for (; r + 4 <= r1; r += 4) moe_tile(type, 4, P, b, r, x, out + r - r0, ld);
    for (; r + 2 <= r1; r += 2) moe_tile(type, 2, P, b, r, x, out + r - r0, ld);
    for (; r < r1; r++) moe_tile(type, 1, P, b, r, x, out + r - r0, ld);
}

#define MOE_BY_COUNT(type)                                                                                   \
    switch (count) {                                                                                         \
    case 1: moe_rows_typed(type, 1, b, r0, r1, x, out, ld); break;                                           \
    case 2: moe_rows_typed(type, 2, b, r0, r1, x, out, ld); break;                                           \
    case 3: moe_rows_typed(type, 3, b, r0, r1, x, out, ld); break;                                           \
    case 4: moe_rows_typed(type, 4, b, r0, r1, x, out, ld); break;                                           \
    case 5: moe_rows_typed(type, 5, b, r0, r1, x, out, ld); break;                                           \
    case 6: moe_rows_typed(type, 6, b, r0, r1, x, out, ld); break;                                           \
    case 7: moe_rows_typed(type, 7, b, r0, r1, x, out, ld); break;                                           \
    default: moe_rows_typed(type, 8, b, r0, r1, x, out, ld); break;                                          \
    }

static void moe_rows_avx512(const struct moe_rows *b, int r0, int r1, const float *const *x, int count, float *out,
                            long ld) {
    if (b->type == MOE_F32) {
        MOE_BY_COUNT(MOE_F32)
    } else if (b->type == MOE_BF16) {
        MOE_BY_COUNT(MOE_BF16)
    } else {
        MOE_BY_COUNT(MOE_INT8)
    }
}
#endif

/* out[p * ld + r - r0] = x[p] . row r for rows [r0, r1) and `count` inputs, in chunks of MOE_CHUNK inputs. */
static void moe_rows(const struct moe_rows *b, int r0, int r1, const float *const *x, int count, float *out, long ld) {
    for (int p = 0; p < count; p += MOE_CHUNK) {
        int chunk = count - p < MOE_CHUNK ? count - p : MOE_CHUNK;
#ifdef __AVX512F__
        if (b->k % 16 == 0 && (b->type != MOE_INT8 || b->group % 16 == 0)) {
            moe_rows_avx512(b, r0, r1, x + p, chunk, out + (long)p * ld, ld);
            continue;
        }
#endif
        moe_rows_portable(b, r0, r1, x + p, chunk, out + (long)p * ld, ld);
    }
}

static inline float moe_silu(float x) {
    float e = expf_nonpositive(x < 0.f ? x : -x);
    return x * ((x < 0.f ? e : 1.f) / (1.f + e));
}

/* Pair tile `tile` of an expert's projection (`source`, a struct moe_rows) in linear_bf16's layout:
 * pairs[p][j][t] = W[32 * tile + j][2 * p + t] in bf16, zero past the last row. */
static const uint16_t *moe_pair_tile(const void *source, int tile, uint16_t *pairs) {
    const struct moe_rows *b = source;
    for (int j = 0; j < TILE; j++) {
        int r = TILE * tile + j;
        if (r >= b->n) {
            for (int c = 0; c < b->k; c++) pairs[(long)c / 2 * 2 * TILE + 2 * j + c % 2] = 0;
        } else if (b->type == MOE_BF16) {
            const uint16_t *row = (const uint16_t *)b->w + (long)r * b->k;
            for (int c = 0; c < b->k; c++) pairs[(long)c / 2 * 2 * TILE + 2 * j + c % 2] = row[c];
        } else {
            for (int c = 0; c < b->k; c++) pairs[(long)c / 2 * 2 * TILE + 2 * j + c % 2] = float_to_bf16(moe_at(b, r, c));
        }
    }
    return pairs;
}

/* The expert's `count` tokens (x rows xs[c], bf16) through its gate/up and down as one grouped matmul each,
 * into y rows [count, hidden] (fp32). Returns 0, or -1 without memory. */
static int moe_grouped(const struct moe_rows *gate_up, const struct moe_rows *down, const uint16_t *x, const int *rows,
                       int count, int fma_rows, int amx_rows, float *y, int num_threads) {
    int hidden = gate_up->k, inter = down->k, status = -1;
    uint16_t *xb = malloc(sizeof(uint16_t) * count * hidden), *gu = malloc(sizeof(uint16_t) * count * 2 * inter);
    uint16_t *act = malloc(sizeof(uint16_t) * count * inter), *yb = malloc(sizeof(uint16_t) * count * hidden);
    if (!xb || !gu || !act || !yb) goto done;
    for (int c = 0; c < count; c++) memcpy(xb + (long)c * hidden, x + (long)rows[c] * hidden, sizeof(uint16_t) * hidden);
    struct bf16_weight w13 = {0, 2 * inter, hidden, 0, fma_rows, amx_rows}, w2 = {0, hidden, inter, 0, fma_rows, amx_rows};
    if (linear_bf16_from(&w13, moe_pair_tile, gate_up, 1, xb, hidden, count, 0, gu, num_threads)) goto done;
    for (long c = 0; c < count; c++)
        for (int i = 0; i < inter; i++)
            act[c * inter + i] =
                float_to_bf16(moe_silu(bf16_to_float(gu[c * 2 * inter + i])) * bf16_to_float(gu[c * 2 * inter + inter + i]));
    if (linear_bf16_from(&w2, moe_pair_tile, down, 1, act, inter, count, 0, yb, num_threads)) goto done;
    for (long i = 0; i < (long)count * hidden; i++) y[i] = bf16_to_float(yb[i]);
    status = 0;
done:
    free(xb), free(gu), free(act), free(yb);
    return status;
}

/* (expert, first row) items over the experts that have pairs and are not `grouped`, `rows` weight rows each;
 * returns their count. */
static int moe_items(const int *start, const char *grouped, int experts, int rows, int *item_expert, int *item_row) {
    int n = 0;
    for (int e = 0; e < experts; e++) {
        if (start[e + 1] == start[e] || grouped[e]) continue;
        for (int r = 0; r < rows; r += MOE_ROWS) item_expert[n] = e, item_row[n++] = r;
    }
    return n;
}

/* out [tokens, hidden] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), where expert_e(x) =
 * w2[e] (silu(gate_e x) * up_e x), w13 [experts, 2 * inter, hidden] holding gate's rows then up's, and
 * w2 [experts, hidden, inter], stored as `wtype` says (int8: with scales s13 [experts, 2 * inter, hidden /
 * group13] and s2 [experts, hidden, inter / group2]; else both null). x and out are bf16 where `bf16`, else fp32;
 * ids [tokens, top_k] in [0, experts). With bf16 activations, an expert with `grouped_tokens` tokens or more
 * (0: none) runs grouped through the bf16 kernel's routines, from `fma_rows` / `amx_rows` rows through its FMA /
 * AMX routine. Returns 0, or -1 without memory for the scratch buffers. */
int moe_forward(const void *x, const void *w13, const void *w2, const float *s13, const float *s2,
                const int32_t *ids, const float *weights, void *out, int tokens, int hidden, int inter,
                int experts, int top_k, int bf16, int wtype, int group13, int group2, int grouped_tokens,
                int fma_rows, int amx_rows, int num_threads) {
    long pairs = (long)tokens * top_k;
    long item_max = (long)experts * ((inter + hidden) / MOE_ROWS + 2); /* gate/up's items, then down's */
    size_t elem = moe_elem(wtype);
    int *start = calloc(experts + 1, sizeof(int)), *next = malloc(sizeof(int) * experts);
    int *order = malloc(sizeof(int) * pairs), *slot = malloc(sizeof(int) * pairs), *token = malloc(sizeof(int) * pairs);
    int *item_expert = malloc(sizeof(int) * item_max), *item_row = malloc(sizeof(int) * item_max);
    char *grouped = calloc(experts, 1);
    const float **xs = malloc(sizeof(float *) * pairs), **as = malloc(sizeof(float *) * pairs);
    float *xf = malloc(sizeof(float) * tokens * hidden), *act = malloc(sizeof(float) * pairs * inter);
    float *y = malloc(sizeof(float) * pairs * hidden);
    int status = -1;
    if (!start || !next || !order || !slot || !token || !item_expert || !item_row || !grouped || !xs || !as || !xf ||
        !act || !y)
        goto done;

    /* Counting sort of the pairs by expert: order[sorted] = pair (t * top_k + j), slot[pair] = sorted. */
    for (long p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int e = 0; e < experts; e++) start[e + 1] += start[e], next[e] = start[e];
    for (long p = 0; p < pairs; p++) {
        int s = next[ids[p]]++;
        order[s] = (int)p, slot[p] = s;
    }
    for (long s = 0; s < pairs; s++) {
        token[s] = order[s] / top_k;
        xs[s] = xf + (long)token[s] * hidden, as[s] = act + s * inter;
    }

    for (int e = 0; e < experts && bf16 && grouped_tokens; e++) {
        int count = start[e + 1] - start[e];
        if (count < grouped_tokens) continue;
        grouped[e] = 1;
        size_t gate_row = (size_t)e * 2 * inter, down_row = (size_t)e * hidden;
        struct moe_rows gate_up = {(const char *)w13 + gate_row * hidden * elem,
                                   s13 ? s13 + gate_row * (hidden / group13) : 0, wtype, group13, 2 * inter, hidden};
        struct moe_rows down = {(const char *)w2 + down_row * inter * elem, s2 ? s2 + down_row * (inter / group2) : 0,
                                wtype, group2, hidden, inter};
        if (moe_grouped(&gate_up, &down, x, token + start[e], count, fma_rows, amx_rows, y + (long)start[e] * hidden,
                        num_threads))
            goto done;
    }

    /* One team for the rest, a barrier between the steps: x in fp32, gate/up, down, the weighted sums. */
    int items13 = moe_items(start, grouped, experts, inter, item_expert, item_row);
    int items = items13 + moe_items(start, grouped, experts, hidden, item_expert + items13, item_row + items13);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for
        for (int t = 0; t < tokens; t++)
            for (int h = 0; h < hidden; h++)
                xf[(long)t * hidden + h] = bf16 ? bf16_to_float(((const uint16_t *)x)[(long)t * hidden + h])
                                                : ((const float *)x)[(long)t * hidden + h];

#pragma omp for schedule(dynamic)
        for (int it = 0; it < items13; it++) {
            int e = item_expert[it], r0 = item_row[it], r1 = r0 + MOE_ROWS < inter ? r0 + MOE_ROWS : inter;
            int count = start[e + 1] - start[e];
            size_t gate_row = (size_t)e * 2 * inter;
            struct moe_rows gate_up = {(const char *)w13 + gate_row * hidden * elem,
                                       s13 ? s13 + gate_row * (hidden / group13) : 0, wtype, group13, 2 * inter, hidden};
            for (int p = 0; p < count; p += MOE_CHUNK) {
                int chunk = count - p < MOE_CHUNK ? count - p : MOE_CHUNK;
                float g[MOE_CHUNK * MOE_ROWS], u[MOE_CHUNK * MOE_ROWS];
                moe_rows(&gate_up, r0, r1, xs + start[e] + p, chunk, g, MOE_ROWS);
                moe_rows(&gate_up, inter + r0, inter + r1, xs + start[e] + p, chunk, u, MOE_ROWS);
                for (int c = 0; c < chunk; c++)
                    for (int r = 0; r < r1 - r0; r++)
                        act[(long)(start[e] + p + c) * inter + r0 + r] =
                            moe_silu(g[c * MOE_ROWS + r]) * u[c * MOE_ROWS + r];
            }
        }

#pragma omp for schedule(dynamic)
        for (int it = items13; it < items; it++) {
            int e = item_expert[it], r0 = item_row[it], r1 = r0 + MOE_ROWS < hidden ? r0 + MOE_ROWS : hidden;
            size_t down_row = (size_t)e * hidden;
            struct moe_rows down = {(const char *)w2 + down_row * inter * elem,
                                    s2 ? s2 + down_row * (inter / group2) : 0, wtype, group2, hidden, inter};
            moe_rows(&down, r0, r1, as + start[e], start[e + 1] - start[e], y + (long)start[e] * hidden + r0, hidden);
        }

#pragma omp for
        for (int t = 0; t < tokens; t++) {
            for (int h = 0; h < hidden; h++) {
                float sum = 0.f;
                for (int j = 0; j < top_k; j++)
                    sum += weights[(long)t * top_k + j] * y[(long)slot[(long)t * top_k + j] * hidden + h];
                if (bf16)
                    ((uint16_t *)out)[(long)t * hidden + h] = float_to_bf16(sum);
                else
                    ((float *)out)[(long)t * hidden + h] = sum;
            }
        }
    }
    status = 0;
done:
    free(start), free(next), free(order), free(slot), free(token), free(item_expert), free(item_row), free(grouped);
    free(xs), free(as), free(xf), free(act), free(y);
    return status;
}
