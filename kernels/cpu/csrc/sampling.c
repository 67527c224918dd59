/* Sampling over fp32 logits rows on the CPU: greedy argmax, and temperature / top-k / top-p / min-p
 * sampling with the acceptance test of speculative verification, one row per thread at a time.
 *
 * A sampled row keeps the tokens v with
 *     x_v >= (k-th largest logit)          top-k,
 *     w_v >= cut_p                         top-p: the smallest set of most likely tokens (within top-k)
 *                                          whose mass reaches top_p; ties at the cut stay,
 *     w_v >= min_p                         min-p,
 * where w_v = exp((x_v - max) / temperature), and draws by inverse CDF: the first kept token, in vocabulary
 * order, at which the running sum of kept weights exceeds u * (their total). That needs one uniform per
 * row and no sort of the vocabulary; the PyTorch path in inference_engine/sampler.py follows the same
 * definition.
 *
 * Speculative verification of a proposed (draft) token d: accept it with probability p(d) under that
 * distribution; otherwise draw from the distribution with d removed. Greedy rows accept d when it is the
 * argmax.
 *
 * Top-k rows read the logits once, for the maxima of blocks of tokens, and then, from cache, only the
 * blocks that can hold the k largest; everything after works on those few candidates. Rows without top-k
 * weigh the whole row into a scratch row; top-p then orders only the weights above the largest threshold
 * of a ladder whose mass already reaches top_p (tens to a few thousand tokens for model logits at top_p
 * 0.95), by a weighted quickselect behind a histogram of the weights' float bits. Draws from a whole row go
 * through kept-weight sums per chunk of CHUNK tokens, so only the chunk where the running sum crosses is
 * walked token by token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define CHUNK 256
#define SLACK 16 /* vector stores may write up to 15 floats past a buffer's logical end */

typedef struct {
    float *weights; /* [vocab + SLACK]: a whole row's weights */
    float *values;  /* [max(vocab, 4096) + SLACK]: block maxima, selections, candidate weights */
    int32_t *index; /* [vocab + SLACK]: candidate token ids */
    double *chunk;  /* [vocab / CHUNK + 1]: kept weight of each chunk of a whole row */
} Scratch;

static void swap_float(float *a, float *b) {
    float t = *a;
    *a = *b;
    *b = t;
}

static float median3(float a, float b, float c) {
    if (a > b) swap_float(&a, &b);
    if (b > c) swap_float(&b, &c);
    return a > b ? a : b;
}

/* Three-way partition of a[lo..hi) around pivot: a[lo..*gt) > pivot, a[*gt..*lt) == pivot,
 * a[*lt..hi) < pivot. Returns the sums (in double) of the first two parts through sum_gt / sum_eq when given. */
static void partition3(float *a, int lo, int hi, float pivot, int *gt_end, int *lt_start, double *sum_gt,
                       double *sum_eq) {
    int gt = lo, i = lo, lt = hi;
    double s_gt = 0.0, s_eq = 0.0;
    while (i < lt) {
        float v = a[i];
        if (v > pivot) {
            swap_float(&a[gt++], &a[i++]);
            s_gt += v;
        } else if (v < pivot) {
            swap_float(&a[i], &a[--lt]);
        } else {
            s_eq += v;
            i++;
        }
    }
    *gt_end = gt;
    *lt_start = lt;
    if (sum_gt) *sum_gt = s_gt;
    if (sum_eq) *sum_eq = s_eq;
}

/* The k-th largest of a[0..n) (1 <= k <= n); reorders a so that a[0..k) holds the k largest. */
static float select_desc(float *a, int n, int k) {
    int lo = 0, hi = n;
    for (;;) {
        float pivot = median3(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        int gt, lt;
        partition3(a, lo, hi, pivot, &gt, &lt, NULL, NULL);
        if (k - 1 < gt)
            hi = gt;
        else if (k - 1 < lt)
            return pivot;
        else
            lo = lt;
    }
}

/* The top-p cut: taking a[0..n) (non-negative weights) from the largest down, the value at which the running
 * sum first reaches target (> 0); the smallest value where it never does (rounding). Reorders a. */
static float weighted_cut_select(float *a, int n, double target) {
    int lo = 0, hi = n;
    double above = 0.0; /* weight of everything larger than a[lo..hi) */
    while (hi - lo > 1) {
        float pivot = median3(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        int gt, lt;
        double s_gt, s_eq;
        partition3(a, lo, hi, pivot, &gt, &lt, &s_gt, &s_eq);
        if (above + s_gt >= target)
            hi = gt;
        else if (above + s_gt + s_eq >= target || lt == hi)
            return pivot;
        else {
            above += s_gt + s_eq;
            lo = lt;
        }
    }
    return a[lo];
}

/* Weights in [0, 1] by their top 11 bits (exponent and 3 mantissa bits): bins of an eighth of an octave,
 * ordered as the values. */
#define HIST_BINS 1024
static inline int weight_bin(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return (int)(bits >> 20) & (HIST_BINS - 1);
}

/* weighted_cut_select, after narrowing a large input to the one histogram bin where the running sum
 * crosses target: a quickselect over many weights is slow (branchy partitions), a histogram pass is not. */
static float weighted_cut(float *a, int n, double target) {
    if (n <= 4096) return weighted_cut_select(a, n, target);
    double hist[HIST_BINS] = {0};
    for (int i = 0; i < n; i++) hist[weight_bin(a[i])] += a[i];
    double above = 0.0;
    int bin = HIST_BINS - 1;
    for (; bin > 0; bin--) {
        if (above + hist[bin] >= target) break;
        above += hist[bin];
    }
    int m = 0;
    for (int i = 0; i < n; i++)
        if (weight_bin(a[i]) == bin) a[m++] = a[i];
    return m ? weighted_cut_select(a, m, target - above) : 0.0f;
}

/* The ladder of weight thresholds tried, largest first, for the tokens top-p needs to look at. */
static const float LADDER[] = {0x1p-4f, 0x1p-8f, 0x1p-14f, 0x1p-20f};
#define LADDER_STEPS ((int)(sizeof LADDER / sizeof LADDER[0]))

#if defined(__AVX512F__)

/* Greedy: the first index of the maximum, or of the first NaN where the row has one (as torch.argmax).
 * A first pass finds the maximum and whether a NaN is present, a second the first index of that value. */
static int64_t argmax_row(const float *row, int cols) {
    const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
    __m512 best = lowest;
    __mmask16 nan = 0;
    for (int c = 0; c < cols; c += 16) {
        __mmask16 valid = first_lanes(cols - c);
        __m512 v = _mm512_mask_loadu_ps(lowest, valid, row + c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    for (int c = 0; c < cols; c += 16) {
        __mmask16 valid = first_lanes(cols - c);
        __m512 v = _mm512_mask_loadu_ps(lowest, valid, row + c);
        __mmask16 hit =
            nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        hit &= valid;
        if (hit) return c + __builtin_ctz(hit);
    }
    return 0;
}

/* The row's maximum, NaNs ignored (-inf where every entry is NaN or -inf). */
static float row_max(const float *x, int n) {
    const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
    __m512 best = lowest;
    for (int c = 0; c < n; c += 16) {
        __m512 v = _mm512_mask_loadu_ps(lowest, first_lanes(n - c), x + c);
        best = _mm512_max_ps(v, best); /* a NaN in v yields best */
    }
    return _mm512_reduce_max_ps(best);
}

/* exp(s) for s <= 0 (NaN and anything below -104 give 0): Cephes' expf polynomial on the reduced argument,
 * within 2 ulp of expf. */
static inline __m512 exp_nonpositive(__m512 s) {
    s = _mm512_max_ps(s, _mm512_set1_ps(-104.0f)); /* a NaN in s yields -104 */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(s, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), s);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline double sum_lanes(__m512 acc) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(acc));
    __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(acc, 1));
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

/* w[v] = exp((x[v] - max) * inv_t) for the whole row; chunk[c] = kept weight (w >= cut) of chunk c; with
 * ladder, ladder[i] = total weight at or above LADDER[i]. Returns the kept total. */
static double weigh_row(const float *x, int n, float max, float inv_t, float cut, float *w, double *chunk,
                        double *ladder) {
    const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_t), vcut = _mm512_set1_ps(cut);
    const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
    __m512 rung[LADDER_STEPS];
    for (int i = 0; i < LADDER_STEPS; i++) rung[i] = _mm512_setzero_ps();
    double total = 0.0;
    for (int c0 = 0, c = 0; c0 < n; c0 += CHUNK, c++) {
        __m512 acc = _mm512_setzero_ps();
        int end = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int v = c0; v < end; v += 16) {
            __mmask16 valid = first_lanes(end - v);
            __m512 s = _mm512_mul_ps(_mm512_sub_ps(_mm512_mask_loadu_ps(lowest, valid, x + v), vmax), vinv);
            __m512 e = exp_nonpositive(s);
            _mm512_mask_storeu_ps(w + v, valid, e);
            acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(e, vcut, _CMP_GE_OQ), acc, e);
            if (ladder)
                for (int i = 0; i < LADDER_STEPS; i++)
                    rung[i] = _mm512_mask_add_ps(
                        rung[i], _mm512_cmp_ps_mask(e, _mm512_set1_ps(LADDER[i]), _CMP_GE_OQ), rung[i], e);
        }
        chunk[c] = sum_lanes(acc);
        total += chunk[c];
    }
    if (ladder)
        for (int i = 0; i < LADDER_STEPS; i++) ladder[i] = sum_lanes(rung[i]);
    return total;
}

/* chunk[c] = kept weight (w >= cut) of chunk c of a weighed row; returns their total. */
static double chunk_sums(const float *w, int n, float cut, double *chunk) {
    const __m512 vcut = _mm512_set1_ps(cut);
    double total = 0.0;
    for (int c0 = 0, c = 0; c0 < n; c0 += CHUNK, c++) {
        __m512 acc = _mm512_setzero_ps();
        int end = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int v = c0; v < end; v += 16) {
            __m512 e = _mm512_maskz_loadu_ps(first_lanes(end - v), w + v);
            acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(e, vcut, _CMP_GE_OQ), acc, e);
        }
        chunk[c] = sum_lanes(acc);
        total += chunk[c];
    }
    return total;
}

/* Copies the weights at or above cut into out; returns their count. */
static int gather_weights_ge(const float *w, int n, float cut, float *out) {
    const __m512 vcut = _mm512_set1_ps(cut);
    int count = 0;
    for (int v = 0; v < n; v += 16) {
        __mmask16 valid = first_lanes(n - v);
        __m512 e = _mm512_maskz_loadu_ps(valid, w + v);
        __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, e, vcut, _CMP_GE_OQ);
        _mm512_storeu_ps(out + count, _mm512_maskz_compress_ps(keep, e)); /* out has SLACK */
        count += __builtin_popcount(keep);
    }
    return count;
}

/* out[b] = maximum of x[b * block, (b + 1) * block) (block a multiple of 16), NaNs ignored. */
static void block_maxima(const float *x, int n, int block, float *out) {
    const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
    for (int b = 0, start = 0; start < n; b++, start += block) {
        int end = start + block < n ? start + block : n;
        __m512 best = lowest;
        for (int v = start; v < end; v += 16)
            best = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, first_lanes(end - v), x + v), best);
        out[b] = _mm512_reduce_max_ps(best);
    }
}

/* Ids (in order) and values of the x[v] >= cut, looking only in blocks whose maximum reaches cut; returns
 * their count. */
static int gather_ge(const float *x, int n, int block, const float *maxima, float cut, int32_t *ids,
                     float *values) {
    const __m512 vcut = _mm512_set1_ps(cut);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int count = 0;
    for (int b = 0, start = 0; start < n; b++, start += block) {
        if (!(maxima[b] >= cut)) continue;
        int end = start + block < n ? start + block : n;
        for (int v = start; v < end; v += 16) {
            __mmask16 valid = first_lanes(end - v);
            __m512 xv = _mm512_maskz_loadu_ps(valid, x + v);
            __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, xv, vcut, _CMP_GE_OQ);
            __m512i id = _mm512_add_epi32(iota, _mm512_set1_epi32(v));
            _mm512_storeu_si512(ids + count, _mm512_maskz_compress_epi32(keep, id)); /* SLACK */
            _mm512_storeu_ps(values + count, _mm512_maskz_compress_ps(keep, xv));
            count += __builtin_popcount(keep);
        }
    }
    return count;
}

/* w[i] = exp((x[i] - max) * inv_t), in place, for a short contiguous array. */
static void weigh_values(float *w, int n, float max, float inv_t) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 valid = first_lanes(n - i);
        __m512 s = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, w + i), _mm512_set1_ps(max)),
                                 _mm512_set1_ps(inv_t));
        _mm512_mask_storeu_ps(w + i, valid, exp_nonpositive(s));
    }
}

#else /* portable C */

static int64_t argmax_row(const float *row, int cols) {
    int64_t index = 0;
    for (int c = 0; c < cols; c++) {
        if (row[c] != row[c]) return c;
        if (row[c] > row[index]) index = c;
    }
    return index;
}

static float row_max(const float *x, int n) {
    float best = -__builtin_inff();
    for (int v = 0; v < n; v++)
        if (x[v] > best) best = x[v];
    return best;
}

static inline float exp_nonpositive(float s) { return s >= -104.0f ? expf(s) : 0.0f; }

static double weigh_row(const float *x, int n, float max, float inv_t, float cut, float *w, double *chunk,
                        double *ladder) {
    double total = 0.0;
    if (ladder)
        for (int i = 0; i < LADDER_STEPS; i++) ladder[i] = 0.0;
    for (int c0 = 0, c = 0; c0 < n; c0 += CHUNK, c++) {
        float acc = 0.0f;
        int end = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int v = c0; v < end; v++) {
            w[v] = exp_nonpositive((x[v] - max) * inv_t);
            if (w[v] >= cut) acc += w[v];
            if (ladder)
                for (int i = 0; i < LADDER_STEPS; i++)
                    if (w[v] >= LADDER[i]) ladder[i] += w[v];
        }
        chunk[c] = acc;
        total += acc;
    }
    return total;
}

static double chunk_sums(const float *w, int n, float cut, double *chunk) {
    double total = 0.0;
    for (int c0 = 0, c = 0; c0 < n; c0 += CHUNK, c++) {
        float acc = 0.0f;
        int end = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int v = c0; v < end; v++)
            if (w[v] >= cut) acc += w[v];
        chunk[c] = acc;
        total += acc;
    }
    return total;
}

static int gather_weights_ge(const float *w, int n, float cut, float *out) {
    int count = 0;
    for (int v = 0; v < n; v++)
        if (w[v] >= cut) out[count++] = w[v];
    return count;
}

static void block_maxima(const float *x, int n, int block, float *out) {
    for (int b = 0, start = 0; start < n; b++, start += block) {
        int end = start + block < n ? start + block : n;
        out[b] = row_max(x + start, end - start);
    }
}

static int gather_ge(const float *x, int n, int block, const float *maxima, float cut, int32_t *ids,
                     float *values) {
    int count = 0;
    for (int b = 0, start = 0; start < n; b++, start += block) {
        if (!(maxima[b] >= cut)) continue;
        int end = start + block < n ? start + block : n;
        for (int v = start; v < end; v++)
            if (x[v] >= cut) {
                ids[count] = v;
                values[count++] = x[v];
            }
    }
    return count;
}

static void weigh_values(float *w, int n, float max, float inv_t) {
    for (int i = 0; i < n; i++) w[i] = exp_nonpositive((w[i] - max) * inv_t);
}

#endif

/* The parameters of one row and where its results go. */
typedef struct {
    float inv_t, top_p, min_p;
    int top_k;
    int64_t draft;   /* -1: none */
    double u_accept; /* uniform for the acceptance test */
    double u_draw;   /* uniform for the inverse-CDF draw */
    uint8_t *accepted;
} Row;

/* The draft's acceptance test; returns the total to draw from (0 when the draft is accepted). */
static double accept_draft(const Row *r, double total, float draft_weight) {
    if (r->draft < 0) return total;
    double rest = total - draft_weight;
    if (r->u_accept * total < draft_weight || !(rest > 0.0)) {
        *r->accepted = 1;
        return 0.0;
    }
    return rest;
}

/* Candidates (ids in vocabulary order, weights w): the kept ones (w >= cut) except the draft, drawn by
 * inverse CDF; the last kept one where rounding leaves the running sum short of target. */
static int64_t draw_candidates(const int32_t *ids, const float *w, int n, float cut, int64_t skip,
                               double target) {
    double acc = 0.0;
    int64_t last = -1;
    for (int i = 0; i < n; i++) {
        if (!(w[i] >= cut) || ids[i] == skip || w[i] == 0.0f) continue;
        acc += w[i];
        last = ids[i];
        if (acc > target) break;
    }
    return last;
}

/* The candidates of a top-k row: ids (in order) and logits of every x >= the k-th largest (ties stay), into
 * s->index and s->weights; returns their count. The k-th largest of the maxima of about 8k blocks is a lower
 * bound for the row's k-th largest that about k blocks reach, so only those are read again (from cache). */
static int top_k_candidates(const float *x, int n, int k, Scratch *s) {
    int block = 16 * (n / (16 * 8 * k) > 1 ? n / (16 * 8 * k) : 1);
    int blocks = (n + block - 1) / block;
    float *maxima = s->values, *copy = s->values + blocks;
    block_maxima(x, n, block, maxima);
    for (int b = 0; b < blocks; b++) copy[b] = maxima[b];
    float bound = blocks >= k ? select_desc(copy, blocks, k) : -__builtin_inff();
    int count = gather_ge(x, n, block, maxima, bound, s->index, s->weights);
    if (count < k) return count; /* fewer than k values above -inf (or NaN): all of them */
    for (int i = 0; i < count; i++) s->values[i] = s->weights[i];
    float kth = select_desc(s->values, count, k);
    int kept = 0;
    for (int i = 0; i < count; i++)
        if (s->weights[i] >= kth) {
            s->index[kept] = s->index[i];
            s->weights[kept++] = s->weights[i];
        }
    return kept;
}

/* Top-k rows: everything after the selection works on the candidates. */
static int64_t sample_top_k(const float *x, int n, const Row *r, Scratch *s) {
    int count = top_k_candidates(x, n, r->top_k, s);
    float *w = s->weights, max = -__builtin_inff();
    for (int i = 0; i < count; i++)
        if (w[i] > max) max = w[i];
    if (!isfinite(max)) return argmax_row(x, n);
    weigh_values(w, count, max, r->inv_t);
    float cut = r->min_p;
    if (r->top_p < 1.0f) {
        double total = 0.0;
        for (int i = 0; i < count; i++) total += w[i];
        for (int i = 0; i < count; i++) s->values[i] = w[i];
        float cut_p = weighted_cut(s->values, count, r->top_p * total);
        if (cut_p > cut) cut = cut_p;
    }
    double kept = 0.0;
    float draft_weight = 0.0f;
    for (int i = 0; i < count; i++) {
        if (!(w[i] >= cut)) continue;
        kept += w[i];
        if (s->index[i] == r->draft) draft_weight = w[i];
    }
    double total = accept_draft(r, kept, draft_weight);
    if (total == 0.0) return r->draft;
    return draw_candidates(s->index, w, count, cut, r->draft, r->u_draw * total);
}

/* The top-p cut of a weighed row: only the weights above the largest ladder threshold whose mass reaches
 * target need ordering. */
static float top_p_cut(const float *w, int n, const double *ladder, double target, Scratch *s) {
    float floor = 0.0f;
    for (int i = 0; i < LADDER_STEPS; i++)
        if (ladder[i] >= target) {
            floor = LADDER[i];
            break;
        }
    int count = gather_weights_ge(w, n, floor, s->values);
    return count ? weighted_cut(s->values, count, target) : 0.0f;
}

/* Rows without top-k: the whole row is weighed, and draws walk the chunk sums. */
static int64_t sample_full(const float *x, int n, const Row *r, Scratch *s) {
    float max = row_max(x, n);
    if (!isfinite(max)) return argmax_row(x, n);
    float *w = s->weights, cut = r->min_p;
    double kept;
    if (r->top_p < 1.0f) {
        double ladder[LADDER_STEPS];
        double total = weigh_row(x, n, max, r->inv_t, 0.0f, w, s->chunk, ladder);
        float cut_p = top_p_cut(w, n, ladder, r->top_p * total, s);
        if (cut_p > cut) cut = cut_p;
        kept = chunk_sums(w, n, cut, s->chunk);
    } else {
        kept = weigh_row(x, n, max, r->inv_t, cut, w, s->chunk, NULL);
    }
    int64_t d = r->draft;
    float draft_weight = d >= 0 && w[d] >= cut ? w[d] : 0.0f;
    double total = accept_draft(r, kept, draft_weight);
    if (total == 0.0) return d;
    double target = r->u_draw * total, acc = 0.0, rest = __builtin_inf(); /* inf: the chunk's last token */
    int chunks = (n + CHUNK - 1) / CHUNK, last = -1;
    for (int c = 0; c < chunks; c++) {
        double sum = s->chunk[c] - (d >= 0 && d / CHUNK == c ? draft_weight : 0.0f);
        if (!(sum > 0.0)) continue;
        last = c;
        if (acc + sum > target) {
            rest = target - acc;
            break;
        }
        acc += sum;
    }
    if (last < 0) return argmax_row(x, n);
    int start = last * CHUNK, end = start + CHUNK < n ? start + CHUNK : n;
    int64_t token = -1;
    double run = 0.0;
    for (int v = start; v < end; v++) {
        if (!(w[v] >= cut) || v == d || w[v] == 0.0f) continue;
        run += w[v];
        token = v;
        if (run > rest) break;
    }
    return token;
}

/* Rows whose maximum is not finite (all -inf, or a +inf) take the argmax, as does any row where rounding
 * left no token drawn: a token id out of range must never come back. */
static int64_t sample_row(const float *x, int n, const Row *r, Scratch *s) {
    int64_t token = r->top_k > 0 && r->top_k < n ? sample_top_k(x, n, r, s) : sample_full(x, n, r, s);
    return token >= 0 && token < n ? token : argmax_row(x, n);
}

/* x [rows, cols] contiguous; out [rows]. */
void argmax_rows_f32(const float *x, int rows, int cols, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (long)r * cols, cols);
}

/* logits [rows, vocab] contiguous fp32. Per row: temperature (0: greedy), top_k (0: off), top_p (1: off),
 * min_p (0: off), draft (-1: none), uniforms[2 * row + 0 / 1] (acceptance test / draw; unread for greedy
 * rows, may be NULL when every row is greedy). Writes tokens[row] and accepted[row] (whether the row's
 * draft was accepted; tokens[row] is then the draft). */
void sample_rows_f32(const float *logits, int rows, int vocab, const float *temperature, const int32_t *top_k,
                     const float *top_p, const float *min_p, const int64_t *draft, const double *uniforms,
                     int64_t *tokens, uint8_t *accepted, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        Scratch s = {0};
        s.weights = malloc(sizeof(float) * (vocab + SLACK));
        s.values = malloc(sizeof(float) * ((vocab > 4096 ? vocab : 4096) + SLACK));
        s.index = malloc(sizeof(int32_t) * (vocab + SLACK));
        s.chunk = malloc(sizeof(double) * (vocab / CHUNK + 1));
        int ok = s.weights && s.values && s.index && s.chunk;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < rows; i++) {
            const float *x = logits + (long)i * vocab;
            accepted[i] = 0;
            if (temperature[i] == 0.0f || !ok) { /* greedy (or no scratch memory: greedy beats a crash) */
                tokens[i] = argmax_row(x, vocab);
                accepted[i] = draft[i] >= 0 && tokens[i] == draft[i];
                continue;
            }
            Row r = {.inv_t = 1.0f / temperature[i],
                     .top_p = top_p[i],
                     .min_p = min_p[i],
                     .top_k = top_k[i],
                     .draft = draft[i],
                     .u_accept = uniforms[2 * i],
                     .u_draw = uniforms[2 * i + 1],
                     .accepted = &accepted[i]};
            tokens[i] = sample_row(x, vocab, &r, &s);
        }
        free(s.weights);
        free(s.values);
        free(s.index);
        free(s.chunk);
    }
}
