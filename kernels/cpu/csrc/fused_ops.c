/* Fused bf16 elementwise layers for the CPU: residual add + RMSNorm, and the rotary embedding.
 *
 * On a CPU every PyTorch op costs microseconds of dispatch, and a decode step of a small model is made of
 * hundreds of them on tensors of a few thousand elements: each function here replaces three to six
 * ops with one pass (SiLU * up, which the native decoder also needs, is in decoder.c). Results are
 * rounded to bf16 at the same points as the PyTorch ops they replace (only the order of the RMSNorm's sum
 * of squares differs). Built with -O3 -march=native by kernels/cpu/_build.py, so the elementwise loops are
 * vectorised for the machine at hand.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define PARALLEL_OVER(rows, work) if ((long)(rows) * (work) >= (1L << 13)) num_threads(num_threads)

/* sum <- x + residual; out <- weight * rmsnorm(sum). [rows, hidden], all contiguous. */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *sum_out, const uint16_t *weight,
                       uint16_t *out, int rows, int hidden, float eps, int num_threads) {
#pragma omp parallel for PARALLEL_OVER(rows, hidden)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (long)r * hidden, *rr = residual + (long)r * hidden;
        uint16_t *res = sum_out + (long)r * hidden, *o = out + (long)r * hidden;
        for (int i = 0; i < hidden; i++) res[i] = float_to_bf16(bf16_to_float(xr[i]) + bf16_to_float(rr[i]));
        float inv = 1.f / __builtin_sqrtf(sum_of_squares_bf16(res, hidden) / hidden + eps);
        for (int i = 0; i < hidden; i++) {
            float normed = round_bf16(bf16_to_float(res[i]) * inv);
            o[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
        }
    }
}

/* Rotate-half RoPE in place on the first rotary_dim features of the first `heads` heads (head_stride elements
 * apart) of each token's row (queries then keys); the rest of each head is left alone (partial rotation, Phi-3/4).
 * cos/sin: [max_position, rotary_dim] fp32, laid out as RotaryEmbedding's buffers (sin's first half negated). */
void rotary_heads_bf16(uint16_t *x, long row_stride, long head_stride, const int64_t *positions, const float *cos,
                       const float *sin, int tokens, int heads, int rotary_dim, int num_threads) {
    int half = rotary_dim / 2;
#pragma omp parallel for PARALLEL_OVER(tokens, heads * rotary_dim)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * rotary_dim, *s = sin + positions[t] * rotary_dim + half;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + (long)t * row_stride + (long)h * head_stride;
            for (int i = 0; i < half; i++) {
                float x1 = bf16_to_float(v[i]), x2 = bf16_to_float(v[i + half]);
                float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
                v[i] = float_to_bf16(a - b);
                v[i + half] = float_to_bf16(d + e);
            }
        }
    }
}
