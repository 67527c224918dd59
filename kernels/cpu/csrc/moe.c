/* Mixture-of-experts MLP, fused: every token's top-k experts, each a SiLU-gated MLP, summed with the router's
 * weights. The step's (token, expert) pairs are sorted by expert first, so each chosen expert's weights stream
 * through once for all of its tokens, and an expert no token chose is never read (a batch-1 step reads only
 * its k experts). Threads take (expert, block of weight rows) items, so a step with one busy expert still
 * spreads over every thread. fp32 inside; the output is rounded once, to the activations' dtype. */
#include <stdlib.h>

#include "bf16.h"

#define MOE_ROWS 16 /* weight rows per work item */

static float moe_dot_f32(const float *x, const void *w, int n) {
    const float *v = w;
    float s = 0.f;
    for (int i = 0; i < n; i++) s += x[i] * v[i];
    return s;
}

static float moe_dot_bf16(const float *x, const void *w, int n) {
    const uint16_t *v = w;
    float s = 0.f;
    for (int i = 0; i < n; i++) s += x[i] * bf16_to_float(v[i]);
    return s;
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
 * w2 [experts, hidden, inter]. x, out, w13 and w2 are bf16 where `bf16`, else fp32; ids [tokens, top_k] in
 * [0, experts). Returns 0, or -1 without memory for the scratch buffers. */
int moe_forward(const void *x, const void *w13, const void *w2, const int32_t *ids, const float *weights,
                void *out, int tokens, int hidden, int inter, int experts, int top_k, int bf16, int num_threads) {
    long pairs = (long)tokens * top_k;
    int rows_max = (inter > hidden ? inter : hidden) + MOE_ROWS;
    size_t elem = bf16 ? 2 : 4;
    float (*dot)(const float *, const void *, int) = bf16 ? moe_dot_bf16 : moe_dot_f32;
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

    int items = moe_items(start, experts, inter, item_expert, item_row);
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int it = 0; it < items; it++) {
        int e = item_expert[it], r0 = item_row[it], r1 = r0 + MOE_ROWS < inter ? r0 + MOE_ROWS : inter;
        const char *gate = (const char *)w13 + (size_t)e * 2 * inter * hidden * elem;
        const char *up = gate + (size_t)inter * hidden * elem;
        for (int s = start[e]; s < start[e + 1]; s++) {
            const float *xr = xf + (long)(order[s] / top_k) * hidden;
            for (int r = r0; r < r1; r++) {
                float g = dot(xr, gate + (size_t)r * hidden * elem, hidden);
                float u = dot(xr, up + (size_t)r * hidden * elem, hidden);
                act[(long)s * inter + r] = moe_silu(g) * u;
            }
        }
    }

    items = moe_items(start, experts, hidden, item_expert, item_row);
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int it = 0; it < items; it++) {
        int e = item_expert[it], r0 = item_row[it], r1 = r0 + MOE_ROWS < hidden ? r0 + MOE_ROWS : hidden;
        const char *down = (const char *)w2 + (size_t)e * hidden * inter * elem;
        for (int s = start[e]; s < start[e + 1]; s++)
            for (int r = r0; r < r1; r++)
                y[(long)s * hidden + r] = dot(act + (long)s * inter, down + (size_t)r * inter * elem, inter);
    }

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
