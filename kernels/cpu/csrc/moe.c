/* Mixture-of-experts MLP, fused: every token's top-k experts, each a SiLU-gated MLP, summed with the router's
 * weights. The step's (token, expert) pairs are sorted by expert first, so each chosen expert's weights stream
 * through once for all of its tokens, and an expert no token chose is never read (a batch-1 step reads only
 * its k experts). Threads take (expert, block of weight rows) items, so a step with one busy expert still
 * spreads over every thread. fp32 inside; the output is rounded once, to the activations' dtype. */
#include <stdlib.h>

#include "bf16.h"

#define MOE_ROWS 16        /* weight rows per work item */
#define MOE_WIDEN_TOKENS 8 /* a bf16 or int8 block is widened to fp32 once for at least this many tokens */

/* How the expert weights are stored: fp32, bf16, or int8 with an fp32 scale per group of inputs
 * (w = scale * q: GGUF's Q8_0, group 32; the engine's int8 quantization, one group per row). */
enum moe_weight { MOE_F32, MOE_BF16, MOE_INT8 };

/* A block of `rows` weight rows of length n, and (int8) its scales [rows, n / group]. */
struct moe_rows {
    const char *w;
    const float *scale;
    int type, group;
};


/* out[p * ld + r] = x[p] . w[r] for `count` input rows x[p] and `rows` fp32 weight rows of length n: four
 * input rows at a time share each weight row's loads (the block stays in L1/L2 while its tokens stream). */
static void moe_block(const float *w, int rows, int n, const float **x, int count, float *out, long ld) {
    int p = 0;
    for (; p + 4 <= count; p += 4) {
        const float *x0 = x[p], *x1 = x[p + 1], *x2 = x[p + 2], *x3 = x[p + 3];
        for (int r = 0; r < rows; r++) {
            const float *wr = w + (long)r * n;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            for (int i = 0; i < n; i++) {
                float v = wr[i];
                s0 += x0[i] * v, s1 += x1[i] * v, s2 += x2[i] * v, s3 += x3[i] * v;
            }
            out[(long)p * ld + r] = s0, out[(long)(p + 1) * ld + r] = s1;
            out[(long)(p + 2) * ld + r] = s2, out[(long)(p + 3) * ld + r] = s3;
        }
    }
    for (; p < count; p++)
        for (int r = 0; r < rows; r++) {
            const float *wr = w + (long)r * n;
            float s0 = 0.f;
            for (int i = 0; i < n; i++) s0 += x[p][i] * wr[i];
            out[(long)p * ld + r] = s0;
        }
}

/* x . row r of the block, read as stored. */
static float moe_dot(const struct moe_rows *b, int r, int n, const float *x) {
    float s = 0.f;
    if (b->type == MOE_BF16) {
        const uint16_t *v = (const uint16_t *)b->w + (long)r * n;
        for (int i = 0; i < n; i++) s += x[i] * bf16_to_float(v[i]);
    } else {
        const int8_t *q = (const int8_t *)b->w + (long)r * n;
        const float *scale = b->scale + (long)r * (n / b->group);
        for (int g = 0; g < n / b->group; g++) {
            float part = 0.f;
            for (int i = g * b->group; i < (g + 1) * b->group; i++) part += x[i] * (float)q[i];
            s += scale[g] * part;
        }
    }
    return s;
}

/* out[p * ld + r] = x[p] . w[r] for the block's `rows` rows (row length n). A bf16 or int8 block that serves
 * MOE_WIDEN_TOKENS tokens or more is widened to fp32 once first; fewer tokens read it as it is (a decode step
 * reads each weight once). Returns -1 without memory for the widened block. */
static int moe_project(const struct moe_rows *b, int rows, int n, const float **x, int count, float *out, long ld) {
    if (b->type == MOE_F32) {
        moe_block((const float *)b->w, rows, n, x, count, out, ld);
        return 0;
    }
    if (count < MOE_WIDEN_TOKENS) {
        for (int p = 0; p < count; p++)
            for (int r = 0; r < rows; r++) out[(long)p * ld + r] = moe_dot(b, r, n, x[p]);
        return 0;
    }
    float *wide = malloc(sizeof(float) * rows * n);
    if (!wide) return -1;
    if (b->type == MOE_BF16)
        for (long i = 0; i < (long)rows * n; i++) wide[i] = bf16_to_float(((const uint16_t *)b->w)[i]);
    else
        for (long i = 0; i < (long)rows * n; i++)
            wide[i] = b->scale[i / b->group] * (float)((const int8_t *)b->w)[i]; /* n is a multiple of group */
    moe_block(wide, rows, n, x, count, out, ld);
    free(wide);
    return 0;
}

static inline float moe_silu(float x) {
    float e = expf_nonpositive(x < 0.f ? x : -x);
    return x * ((x < 0.f ? e : 1.f) / (1.f + e));
}

/* (expert, first row) items over the experts that have pairs, `rows` weight rows each; returns their count. */
static int moe_items(const int *start, int experts, int rows, int *item_expert, int *item_row) {
    int n = 0;
    for (int e = 0; e < experts; e++) {
        if (start[e + 1] == start[e]) continue;
        for (int r = 0; r < rows; r += MOE_ROWS) item_expert[n] = e, item_row[n++] = r;
    }
    return n;
}

/* out [tokens, hidden] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), where expert_e(x) =
 * w2[e] (silu(gate_e x) * up_e x), w13 [experts, 2 * inter, hidden] holding gate's rows then up's, and
 * w2 [experts, hidden, inter], stored as `wtype` says (int8: with scales s13 [experts, 2 * inter, hidden /
 * group13] and s2 [experts, hidden, inter / group2]; else both null). x and out are bf16 where `bf16`, else fp32;
 * ids [tokens, top_k] in [0, experts). Returns 0, or -1 without memory for the scratch buffers. */
int moe_forward(const void *x, const void *w13, const void *w2, const float *s13, const float *s2,
                const int32_t *ids, const float *weights, void *out, int tokens, int hidden, int inter,
                int experts, int top_k, int bf16, int wtype, int group13, int group2, int num_threads) {
    long pairs = (long)tokens * top_k;
    int rows_max = (inter > hidden ? inter : hidden) + MOE_ROWS;
    size_t elem = wtype == MOE_F32 ? 4 : wtype == MOE_BF16 ? 2 : 1;
    int *start = calloc(experts + 1, sizeof(int)), *next = malloc(sizeof(int) * experts);
    int *order = malloc(sizeof(int) * pairs), *slot = malloc(sizeof(int) * pairs);
    int *item_expert = malloc(sizeof(int) * experts * (rows_max / MOE_ROWS));
    int *item_row = malloc(sizeof(int) * experts * (rows_max / MOE_ROWS));
    float *xf = malloc(sizeof(float) * tokens * hidden), *act = malloc(sizeof(float) * pairs * inter);
    float *y = malloc(sizeof(float) * pairs * hidden);
    int status = -1;
    if (!start || !next || !order || !slot || !item_expert || !item_row || !xf || !act || !y) goto done;

    /* Counting sort of the pairs by expert: order[sorted] = pair (t * top_k + j), slot[pair] = sorted. */
    for (long p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int e = 0; e < experts; e++) start[e + 1] += start[e], next[e] = start[e];
    for (long p = 0; p < pairs; p++) {
        int s = next[ids[p]]++;
        order[s] = (int)p, slot[p] = s;
    }

#pragma omp parallel for num_threads(num_threads)
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < hidden; h++)
            xf[(long)t * hidden + h] = bf16 ? bf16_to_float(((const uint16_t *)x)[(long)t * hidden + h])
                                            : ((const float *)x)[(long)t * hidden + h];

    int items = moe_items(start, experts, inter, item_expert, item_row), failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int it = 0; it < items; it++) {
        int e = item_expert[it], r0 = item_row[it], rows = r0 + MOE_ROWS < inter ? MOE_ROWS : inter - r0;
        int count = start[e + 1] - start[e];
        float *gu = malloc(sizeof(float) * count * 2 * rows); /* each token's gate outputs, then up's */
        const float **x = malloc(sizeof(float *) * count);
        if (gu && x) {
            size_t gate_row = (size_t)e * 2 * inter + r0, up_row = gate_row + inter;
            struct moe_rows gate = {(const char *)w13 + gate_row * hidden * elem,
                                    s13 ? s13 + gate_row * (hidden / group13) : 0, wtype, group13};
            struct moe_rows up = {(const char *)w13 + up_row * hidden * elem,
                                  s13 ? s13 + up_row * (hidden / group13) : 0, wtype, group13};
            for (int c = 0; c < count; c++) x[c] = xf + (long)(order[start[e] + c] / top_k) * hidden;
            if (moe_project(&gate, rows, hidden, x, count, gu, 2 * rows) ||
                moe_project(&up, rows, hidden, x, count, gu + rows, 2 * rows))
                failed = 1;
            for (int c = 0; c < count && !failed; c++)
                for (int r = 0; r < rows; r++)
                    act[(long)(start[e] + c) * inter + r0 + r] =
                        moe_silu(gu[(long)c * 2 * rows + r]) * gu[(long)c * 2 * rows + rows + r];
        } else {
            failed = 1;
        }
        free(gu), free(x);
    }

    items = failed ? 0 : moe_items(start, experts, hidden, item_expert, item_row);
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int it = 0; it < items; it++) {
        int e = item_expert[it], r0 = item_row[it], rows = r0 + MOE_ROWS < hidden ? MOE_ROWS : hidden - r0;
        int count = start[e + 1] - start[e];
        const float **x = malloc(sizeof(float *) * count);
        size_t down_row = (size_t)e * hidden + r0;
        struct moe_rows down = {(const char *)w2 + down_row * inter * elem, s2 ? s2 + down_row * (inter / group2) : 0,
                                wtype, group2};
        if (x) {
            for (int c = 0; c < count; c++) x[c] = act + (long)(start[e] + c) * inter;
            failed |= moe_project(&down, rows, inter, x, count, y + (long)start[e] * hidden + r0, hidden) != 0;
        } else {
            failed = 1;
        }
        free(x);
    }
    if (failed) goto done;

#pragma omp parallel for num_threads(num_threads)
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
    status = 0;
done:
    free(start), free(next), free(order), free(slot), free(item_expert), free(item_row);
    free(xf), free(act), free(y);
    return status;
}
