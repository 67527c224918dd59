/* Batched LoRA update, one adapter per row: y[t] += scales[s] * B_s (A_s x[t]) with s = slots[t] (-1: none).
 * The rows are counting-sorted by slot first, so each adapter's A and B stream through once for all of its
 * rows: the shrink (x -> rank) runs over (slot, block of rows) items, the expand (rank -> out) over
 * (slot, block of output columns) items, so a step with one adapter still spreads over every thread. fp32
 * inside; each updated element of y is rounded once, to y's dtype. */
#include <stdlib.h>

#include "bf16.h"

#define LORA_ROWS 16 /* rows per shrink item */
#define LORA_COLS 64 /* output columns per expand item */

static inline float lora_load(const void *p, long i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* y [rows, out] (row stride ldy) += per-row update from x [rows, in] (row stride ldx), lora_a [slots, rank,
 * in], lora_b [slots, out, rank], scales [slots]; x, y, lora_a and lora_b are bf16 where `bf16`, else fp32.
 * slots[t] in [-1, num_slots). Returns 0, or -1 without memory for the scratch buffers. */
int lora_add(void *y, long ldy, const void *x, long ldx, const void *lora_a, const void *lora_b,
             const int32_t *slots, const float *scales, int rows, int in, int out, int rank, int num_slots,
             int bf16, int num_threads) {
    int *start = calloc(num_slots + 1, sizeof(int)), *next = malloc(sizeof(int) * (num_slots + 1));
    int *order = malloc(sizeof(int) * (rows + 1));
    int blocks = rows / LORA_ROWS + num_slots + 1, col_blocks = (out + LORA_COLS - 1) / LORA_COLS;
    int *shrink_slot = malloc(sizeof(int) * blocks), *shrink_first = malloc(sizeof(int) * blocks);
    float *t = malloc(sizeof(float) * ((long)rows * rank + 1));
    int status = -1;
    if (!start || !next || !order || !shrink_slot || !shrink_first || !t) goto done;

    /* Counting sort of the rows that have an adapter: order[start[s] .. start[s + 1]) are slot s's rows. */
    for (int r = 0; r < rows; r++)
        if (slots[r] >= 0) start[slots[r] + 1]++;
    for (int s = 0; s < num_slots; s++) start[s + 1] += start[s], next[s] = start[s];
    for (int r = 0; r < rows; r++)
        if (slots[r] >= 0) order[next[slots[r]]++] = r;

    int items = 0;
    for (int s = 0; s < num_slots; s++)
        for (int p = start[s]; p < start[s + 1]; p += LORA_ROWS) shrink_slot[items] = s, shrink_first[items++] = p;

    /* Shrink: t[p] = scales[s] * A_s x[order[p]], one row of t per sorted position p. */
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int it = 0; it < items; it++) {
        int s = shrink_slot[it], p0 = shrink_first[it];
        int p1 = p0 + LORA_ROWS < start[s + 1] ? p0 + LORA_ROWS : start[s + 1];
        long a0 = (long)s * rank * in;
        for (int p = p0; p < p1; p++) {
            long x0 = (long)order[p] * ldx;
            for (int k = 0; k < rank; k++) {
                float acc = 0.f;
                long ak = a0 + (long)k * in;
                for (int i = 0; i < in; i++) acc += lora_load(x, x0 + i, bf16) * lora_load(lora_a, ak + i, bf16);
                t[(long)p * rank + k] = acc * scales[s];
            }
        }
    }

    /* Expand: y[order[p], o] += B_s[o] . t[p] for each slot s and block of output columns o. */
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int s = 0; s < num_slots; s++) {
        for (int cb = 0; cb < col_blocks; cb++) {
            if (start[s + 1] == start[s]) continue;
            int o0 = cb * LORA_COLS, o1 = o0 + LORA_COLS < out ? o0 + LORA_COLS : out;
            for (int p = start[s]; p < start[s + 1]; p++) {
                const float *tp = t + (long)p * rank;
                long y0 = (long)order[p] * ldy;
                for (int o = o0; o < o1; o++) {
                    long bo = ((long)s * out + o) * rank;
                    float acc = 0.f;
                    for (int k = 0; k < rank; k++) acc += tp[k] * lora_load(lora_b, bo + k, bf16);
                    float v = lora_load(y, y0 + o, bf16) + acc;
                    if (bf16)
                        ((uint16_t *)y)[y0 + o] = float_to_bf16(v);
                    else
                        ((float *)y)[y0 + o] = v;
                }
            }
        }
    }
    status = 0;
done:
    free(start), free(next), free(order), free(shrink_slot), free(shrink_first), free(t);
    return status;
}
