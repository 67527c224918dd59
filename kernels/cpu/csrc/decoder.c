/* A Llama-family decoder's forward pass for a step of tokens (decode steps, speculative drafts, prompts of up
 * to a few hundred tokens), bf16, all layers in one call; and several decode steps in one call
 * (decoder_generate). Layers may take the variants of other families (struct decoder_layer): q/k RMSNorms,
 * norms on the sublayers' outputs, no norm before a sublayer, GELU-tanh, sliding windows, soft-capping, their
 * own attention scale and rotary tables, partial rotation.
 *
 * At batch 1 a decode step reads every weight once; the arithmetic is the kernels' (linear_bf16.c,
 * linear_quant.c, paged_decode.c, fused_ops.c, kv_store.c). What one call saves is the interpreter: a step
 * through Python is some 300 calls, each converting its arguments and allocating its output, about as long
 * as the attention itself. Here each layer is the same sequence of the same kernels the Python path calls,
 * in the same order, on buffers allocated once, so both paths give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

struct bf16_weight;
struct qweight;
void linear_bf16(const struct bf16_weight *w, const uint16_t *x, long ldx, int m, const uint16_t *bias,
                 uint16_t *out, int num_threads);
int linear_quant(const struct qweight *w, const void *x, long ldx, int m, int is_bf16, const void *bias, void *out,
                 int num_threads);
int linear_quant_bf16(const struct qweight *w, const uint16_t *x, long ldx, int m, int fma_rows, int amx_rows,
                      const uint16_t *bias, uint16_t *out, int num_threads);
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *sum_out, const uint16_t *weight,
                       uint16_t *out, int rows, int hidden, float eps, int num_threads);
void rotary_heads_bf16(uint16_t *x, long row_stride, long head_stride, const int64_t *positions, const float *cos,
                       const float *sin, int tokens, int heads, int rotary_dim, int num_threads);
int store_kv(const char *k, long k_stride, const char *v, long v_stride, char *k_cache, char *v_cache,
             const int64_t *slots, int tokens, long num_slots, int row_bytes);
int bf16_rows(const struct bf16_weight *w, const int64_t *ids, int count, int k_in, uint16_t *out);
int quant_rows(const struct qweight *w, const int64_t *ids, int count, int is_bf16, void *out, int num_threads);
void argmax_rows_f32(const float *x, int rows, int cols, int64_t *out, int num_threads);
void sample_rows_f32(const float *logits, int rows, int vocab, const float *temperature, const int32_t *top_k,
                     const float *top_p, const float *min_p, const int64_t *draft, const double *uniforms,
                     int64_t *tokens, uint8_t *accepted, int num_threads);
int paged_decode(const void *q, long q_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 int max_blocks, const int32_t *seq_lens, void *out, int batch, int heads, int kv_heads, int head_dim,
                 int block_size, int is_bf16, float scale, int window, float softcap, int num_threads);
int paged_extend(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *query_start_loc, const int32_t *seq_lens,
                 uint16_t *out, int batch, int heads, int kv_heads, int head_dim, int block_size, int min_query_len,
                 int max_query_len, float scale, int window, float softcap, int num_threads);

enum { LINEAR_BF16 = 1, LINEAR_QUANT = 2 };

struct linear_op {
    int kind;
    const void *weight; /* struct bf16_weight * or struct qweight * */
    const uint16_t *bias;
    int out_features;
    /* Quantized: steps of more rows than this go through dequantized pair tiles and the bf16 kernel's routines
     * (fma_rows, amx_rows as for a dense copy), as kernels/cpu/linear.py sends them. Where it sends them
     * elsewhere, the decoder takes no step of more rows (kernels/cpu/decoder.py: native_rows). */
    int native_rows, fma_rows, amx_rows;
};

/* The packed weight whose rows are the token embeddings (kernels/cpu/linear.py's `rows`). */
struct rows_op {
    int kind;
    const void *weight;
};

/* What a burst samples with where a sequence samples: per sequence, sample_rows_f32's parameters (draft all
 * -1), the uniforms of every step [steps, m, 2], and scratch for the acceptance flags. */
struct burst_sampling {
    const float *temperature;
    const int32_t *top_k;
    const float *top_p, *min_p;
    const int64_t *draft;
    const double *uniforms;
    uint8_t *accepted;
};

/* A step's sequences, for the attention of those bringing `lo` to `hi` new tokens through the extend kernel, as
 * the layer path runs them (inference_engine/attention/torch_backend.py); every other token is a query of the
 * decode kernel. query_start_loc [batch + 1], seq_lens [batch], tables [batch, max_blocks]. */
struct extend_op {
    int batch, lo, hi, max_blocks;
    const int32_t *query_start_loc, *seq_lens, *tables;
};

/* A layer: Llama's, unless its variants say otherwise (kernels/cpu/decoder.py: DecoderLayer). Norms are bf16
 * RMSNorms as rms_norm_bf16 rounds them; a null norm is none. */
struct decoder_layer {
    const uint16_t *input_norm; /* before attention, the residual add fused (null: attention reads the stream) */
    const uint16_t *post_norm;  /* before the MLP, likewise (null: the MLP reads the stream) */
    struct linear_op qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;
    const uint16_t *q_norm, *k_norm; /* before the rotation: over each head ([head_dim]) or, with qk_norm_whole,
                                        over the whole projection ([heads * head_dim], [kv_heads * head_dim]) */
    int qk_norm_whole;
    const uint16_t *post_attn_norm, *post_mlp_norm; /* on a sublayer's output, before the residual add */
    int window;                                     /* sliding window in keys (0: none) */
    float softcap, scale;                           /* attention logit cap (0: none) and scale */
    int gelu;                                       /* GELU-tanh in the MLP instead of SiLU */
    const float *cos, *sin;                         /* this layer's rotary tables, as RotaryEmbedding's */
    int rotary_dim;                                 /* the features of each head that turn: the first ones */
};

struct decoder {
    int num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    long num_slots;
    float eps;
    const uint16_t *final_norm;
    const struct decoder_layer *layers;
};

static int linear(const struct linear_op *op, const uint16_t *x, long ldx, int m, uint16_t *out, int threads) {
    if (op->kind == LINEAR_BF16) {
        linear_bf16(op->weight, x, ldx, m, op->bias, out, threads);
        return 0;
    }
    if (m > op->native_rows)
        return linear_quant_bf16(op->weight, x, ldx, m, op->fma_rows, op->amx_rows, op->bias, out, threads);
    return linear_quant(op->weight, x, ldx, m, 1, op->bias, out, threads);
}

/* out <- weight * rmsnorm(x), rounded as add_rms_norm_bf16 rounds (the first layer has no residual yet). */
void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int rows, int hidden, float eps) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (long)r * hidden;
        uint16_t *o = out + (long)r * hidden;
        float inv = 1.f / sqrtf(sum_of_squares_bf16(xr, hidden) / hidden + eps);
        for (int i = 0; i < hidden; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv));
            o[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
        }
    }
}

/* out [rows, width] <- silu(gate) * up of gate_up [rows, 2 * width]: the SiLU rounded to bf16, then the
 * product, as PyTorch rounds F.silu(gate).mul_(up). x * sigmoid(x) with exp(-|x|) <= 1, so the loop
 * vectorises (libm's expf does not: the scalar loop was 10-20x PyTorch's SiLU); within a bf16 ulp of it. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int width, int num_threads) {
#pragma omp parallel for if ((long)rows * width >= (1L << 13)) num_threads(num_threads)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * width, *u = g + width;
        uint16_t *o = out + (long)r * width;
        for (int i = 0; i < width; i++) {
            float x = bf16_to_float(g[i]);
            float e = expf_nonpositive(x < 0.f ? x : -x), sigmoid = (x < 0.f ? e : 1.f) / (1.f + e);
            float silu = bf16_to_float(float_to_bf16(x * sigmoid));
            o[i] = float_to_bf16(silu * bf16_to_float(u[i]));
        }
    }
}

/* out [rows, width] <- gelu_tanh(gate) * up of gate_up [rows, 2 * width] (Gemma's MLP), rounded as PyTorch rounds
 * F.gelu(gate, approximate="tanh").mul_(up): the GELU to bf16, then the product. 0.5 x (1 + tanh(u)) as
 * x * sigmoid(2u), with exp(-|2u|) <= 1 from expf_nonpositive, so the loop vectorises and the far negative side
 * keeps its digits (1 + tanh(u) cancels there); within a bf16 ulp of the exact GELU. */
void gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int width, int num_threads) {
#pragma omp parallel for if ((long)rows * width >= (1L << 13)) num_threads(num_threads)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * width, *u = g + width;
        uint16_t *o = out + (long)r * width;
        for (int i = 0; i < width; i++) {
            float x = bf16_to_float(g[i]), z = 1.5957691216057308f * (x + 0.044715f * x * x * x);
            float a = z < 0.f ? z : -z, e = a < -87.f ? 0.f : expf_nonpositive(a);
            float gelu = bf16_to_float(float_to_bf16(x * ((z < 0.f ? e : 1.f) / (1.f + e))));
            o[i] = float_to_bf16(gelu * bf16_to_float(u[i]));
        }
    }
}

/* sum <- x + residual, rounded as PyTorch adds bf16 tensors. [rows, width] contiguous. */
static void add_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *sum, int rows, int width, int threads) {
#pragma omp parallel for if ((long)rows * width >= (1L << 13)) num_threads(threads)
    for (int r = 0; r < rows; r++)
        for (long i = (long)r * width; i < (long)(r + 1) * width; i++)
            sum[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(residual[i]));
}

/* The layer's q/k RMSNorms on each token's row of qkv, in place: per head, or over the whole q and k. */
static void qk_norms(const struct decoder *d, const struct decoder_layer *layer, uint16_t *qkv, long qkv_row, int m,
                     int threads) {
    int D = d->head_dim, q_width = d->heads * D;
#pragma omp parallel for if ((long)m * qkv_row >= (1L << 13)) num_threads(threads)
    for (int t = 0; t < m; t++) {
        uint16_t *q = qkv + t * qkv_row, *k = q + q_width;
        if (layer->qk_norm_whole) {
            if (layer->q_norm) rms_norm_bf16(q, layer->q_norm, q, 1, q_width, d->eps);
            if (layer->k_norm) rms_norm_bf16(k, layer->k_norm, k, 1, d->kv_heads * D, d->eps);
        } else {
            if (layer->q_norm) rms_norm_bf16(q, layer->q_norm, q, d->heads, D, d->eps);
            if (layer->k_norm) rms_norm_bf16(k, layer->k_norm, k, d->kv_heads, D, d->eps);
        }
    }
}

/* The step's attention into attn [m, heads D]: each token a query of the decode kernel over the first lens[t]
 * cached tokens of its sequence, but for the sequences `extend` gives the extend kernel (where it runs here;
 * where it does not, they are decode queries too, as in the layer path). */
static int attend(const struct decoder *d, const struct decoder_layer *layer, const uint16_t *qkv, long qkv_row,
                  int m, const int32_t *tables, int max_blocks, const int32_t *lens, const struct extend_op *extend,
                  uint16_t *attn, int threads) {
    int D = d->head_dim, q_width = d->heads * D, window = layer->window;
    float scale = layer->scale, cap = layer->softcap;
    if (!extend || paged_extend(qkv, qkv_row, layer->k_cache, layer->v_cache, extend->tables, extend->max_blocks,
                                extend->query_start_loc, extend->seq_lens, attn, extend->batch, d->heads,
                                d->kv_heads, D, d->block_size, extend->lo, extend->hi, scale, window, cap, threads))
        return paged_decode(qkv, qkv_row, layer->k_cache, layer->v_cache, tables, max_blocks, lens, attn, m, d->heads,
                            d->kv_heads, D, d->block_size, 1, scale, window, cap, threads);
    /* The other sequences' tokens, a run of consecutive rows at a time. */
    const int32_t *starts = extend->query_start_loc;
    for (int b = 0, first = 0; b <= extend->batch; b++) {
        int extended = b < extend->batch && starts[b + 1] - starts[b] >= extend->lo &&
                       starts[b + 1] - starts[b] <= extend->hi;
        if (b < extend->batch && !extended) continue;
        int end = starts[b], rows = end - first;
        if (rows > 0) {
            int status = paged_decode(qkv + (long)first * qkv_row, qkv_row, layer->k_cache, layer->v_cache,
                                      tables + (long)first * max_blocks, max_blocks, lens + first,
                                      attn + (long)first * q_width, rows, d->heads, d->kv_heads, D, d->block_size, 1,
                                      scale, window, cap, threads);
            if (status) return status;
        }
        if (b < extend->batch) first = starts[b + 1];
    }
    return 0;
}

/* hidden [m, H]: the tokens' embeddings in, the final norm of the last layer's output out. Token t is at
 * positions[t], stored to slots[t], and attends over the first lens[t] cached tokens of its sequence
 * (tables: [m, max_blocks]), or as `extend` (null: none) says. Scratch: residual [m, H], normed [m, H],
 * qkv [m, (heads + 2 kv_heads) D], attn [m, heads D], gate_up [m, 2 I], act [m, I]. Returns 0, or the first
 * failing kernel's status. */
int decoder_forward(const struct decoder *d, uint16_t *hidden, int m, const int64_t *positions, const int64_t *slots,
                    const int32_t *tables, int max_blocks, const int32_t *lens, const struct extend_op *extend,
                    uint16_t *residual, uint16_t *normed, uint16_t *qkv, uint16_t *attn, uint16_t *gate_up,
                    uint16_t *act, int threads) {
    int H = d->hidden, D = d->head_dim, q_width = d->heads * D, kv_width = d->kv_heads * D;
    long qkv_row = q_width + 2L * kv_width;
    for (int l = 0; l < d->num_layers; l++) {
        const struct decoder_layer *layer = &d->layers[l];
        /* the stream (residual) takes the last sublayer's output (hidden); attention reads its norm, or it */
        if (l == 0) {
            memcpy(residual, hidden, sizeof(uint16_t) * m * H);
            if (layer->input_norm) rms_norm_bf16(hidden, layer->input_norm, normed, m, H, d->eps);
        } else if (layer->input_norm) {
            add_rms_norm_bf16(hidden, residual, residual, layer->input_norm, normed, m, H, d->eps, threads);
        } else {
            add_bf16(hidden, residual, residual, m, H, threads);
        }
        int status = linear(&layer->qkv, layer->input_norm ? normed : residual, H, m, qkv, threads);
        if (status) return status;
        if (layer->q_norm || layer->k_norm) qk_norms(d, layer, qkv, qkv_row, m, threads);
        rotary_heads_bf16(qkv, qkv_row, D, positions, layer->cos, layer->sin, m, d->heads + d->kv_heads,
                          layer->rotary_dim, threads);
        status = store_kv((const char *)(qkv + q_width), qkv_row * 2, (const char *)(qkv + q_width + kv_width),
                          qkv_row * 2, (char *)layer->k_cache, (char *)layer->v_cache, slots, m, d->num_slots,
                          kv_width * 2);
        if (status) return status;
        status = attend(d, layer, qkv, qkv_row, m, tables, max_blocks, lens, extend, attn, threads);
        if (status) return status;
        if ((status = linear(&layer->o, attn, q_width, m, hidden, threads))) return status;
        if (layer->post_attn_norm) rms_norm_bf16(hidden, layer->post_attn_norm, hidden, m, H, d->eps);
        if (layer->post_norm)
            add_rms_norm_bf16(hidden, residual, residual, layer->post_norm, normed, m, H, d->eps, threads);
        else
            add_bf16(hidden, residual, residual, m, H, threads);
        if ((status = linear(&layer->gate_up, layer->post_norm ? normed : residual, H, m, gate_up, threads)))
            return status;
        if (layer->gelu)
            gelu_tanh_mul_bf16(gate_up, act, m, d->intermediate, threads);
        else
            silu_mul_bf16(gate_up, act, m, d->intermediate, threads);
        if ((status = linear(&layer->down, act, d->intermediate, m, hidden, threads))) return status;
        if (layer->post_mlp_norm) rms_norm_bf16(hidden, layer->post_mlp_norm, hidden, m, H, d->eps);
    }
    add_rms_norm_bf16(hidden, residual, residual, d->final_norm, normed, m, H, d->eps, threads);
    memcpy(hidden, normed, sizeof(uint16_t) * m * H);
    return 0;
}

/* `steps` decode steps of m sequences in one call: each step runs decoder_forward, the LM head (`head`), the
 * sampler's choice of each row's token (over the bf16 logits widened to fp32: the argmax where every sequence
 * is greedy, else sample_rows_f32 with `sampling`, as a step of greedy and sampled rows takes them) and the
 * lookup of the chosen tokens' embeddings (`embed`), which are the next step's input.
 * Between steps Python would otherwise build inputs, sample and append tokens, refetching its own code and
 * data, which each step's stream of weights evicts from the caches.
 *
 * hidden [m, H]: the first step's embeddings. positions, slots, lens: [steps, m], each step's as
 * decoder_forward takes them; tables [m, max_blocks] serve every step. tokens [steps, m] out. Scratch: logits
 * [m, vocab] bf16, wide [m, vocab] fp32, then decoder_forward's. choice_threads: the threads of the choice,
 * as kernels/cpu/sampling.py gives its kernels. Returns 0, or the first failing kernel's status. */
int decoder_generate(const struct decoder *d, const struct linear_op *head, const struct rows_op *embed,
                     const struct burst_sampling *sampling, uint16_t *hidden, int m, int steps,
                     const int64_t *positions, const int64_t *slots,
                     const int32_t *tables, int max_blocks, const int32_t *lens, int64_t *tokens, uint16_t *logits,
                     float *wide, uint16_t *residual, uint16_t *normed, uint16_t *qkv, uint16_t *attn,
                     uint16_t *gate_up, uint16_t *act, int threads, int choice_threads) {
    long vocab = head->out_features, cells = vocab * m;
    for (int s = 0; s < steps; s++) {
        long at = (long)s * m;
        int status = decoder_forward(d, hidden, m, positions + at, slots + at, tables, max_blocks, lens + at, 0,
                                     residual, normed, qkv, attn, gate_up, act, threads);
        if (status || (status = linear(head, hidden, d->hidden, m, logits, threads))) return status;
        for (long i = 0; i < cells; i++) wide[i] = bf16_to_float(logits[i]);
        if (sampling)
            sample_rows_f32(wide, m, (int)vocab, sampling->temperature, sampling->top_k, sampling->top_p,
                            sampling->min_p, sampling->draft, sampling->uniforms + 2 * at, tokens + at,
                            sampling->accepted, choice_threads);
        else
            argmax_rows_f32(wide, m, (int)vocab, tokens + at, choice_threads);
        if (s + 1 == steps) break;
        status = embed->kind == LINEAR_BF16 ? bf16_rows(embed->weight, tokens + at, m, d->hidden, hidden)
                                            : quant_rows(embed->weight, tokens + at, m, 1, hidden, threads);
        if (status) return status;
    }
    return 0;
}
