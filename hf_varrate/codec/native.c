/* Fused loops for a compact layer's read (hf_varrate/codec/native.py builds and loads this file).

   Each function does in one pass what the eager PyTorch read does in several passes over a layer-sized
   buffer; native.py says which eager code each one replaces, and tests/test_native.py checks them against
   it. Built with -ffp-contract=off: every multiply and add rounds as PyTorch's separate ops do, so
   `dequantize_runs` equals the eager dequantization bit for bit. With -fopenmp (where the compiler has it)
   each loop runs on `threads` threads, split over tokens: the same values whatever the count. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define STRIPES 32

/* fp32 -> bf16, round to nearest even (as PyTorch converts finite values). */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Value i of a packed stream of `bits`-bit codes (2, 3 or 8; see unpack_codes), from the one or two bytes its bits
   lie in: no byte past them is read. */
static inline uint8_t code_at(const uint8_t *codes, int bits, int64_t i) {
    const int64_t bit = i * bits;
    const unsigned shift = (unsigned)(bit & 7);
    unsigned word = codes[bit >> 3];
    if (shift + (unsigned)bits > 8u) word |= (unsigned)codes[(bit >> 3) + 1] << 8;
    return (uint8_t)((word >> shift) & ((1u << bits) - 1u));
}

/* Values start .. start + count - 1 of a packed stream of `bits`-bit codes (2, 3, 4 or 8) into q: value i
   sits at bits bits * i .. bits * i + bits - 1 of the little-endian bit stream (pack_bits: for 4 bits, value
   2i in byte i's low nibble, 2i + 1 in its high one). Reads no byte past the last value's. */
static inline void unpack_codes(const uint8_t *codes, int bits, int64_t start, int64_t count, uint8_t *q) {
    if (bits == 4) {  /* whole bytes into a scratch that starts at start's byte, so q may lag it by one */
        const uint8_t *bytes = codes + start / 2;
        uint8_t *scratch = q - start % 2;
        const int64_t n_bytes = (start % 2 + count + 1) / 2;
        for (int64_t i = 0; i < n_bytes; i++) {
            scratch[2 * i] = bytes[i] & 0xF;
            scratch[2 * i + 1] = bytes[i] >> 4;
        }
        return;
    }
    const unsigned mask = (1u << bits) - 1u;
    int64_t j = 0;
    for (; j < count && (start + j) % 8; j++)  /* up to the next 8 values, which start on a byte */
        q[j] = code_at(codes, bits, start + j);
    for (; j + 8 <= count; j += 8) {  /* 8 values in `bits` whole bytes */
        const uint8_t *bytes = codes + (start + j) / 8 * bits;
        uint64_t word = 0;
        for (int b = 0; b < bits; b++) word |= (uint64_t)bytes[b] << (8 * b);
        for (int k = 0; k < 8; k++) q[j + k] = (uint8_t)((word >> (k * bits)) & mask);
    }
    for (; j < count; j++)  /* the last few */
        q[j] = code_at(codes, bits, start + j);
}

/* out[at + j] = q[j] * step[j * stride] + min[j * stride] for j < n (fp32, or bf16 as uint16 when bf16): stride 0
   for one (min, step) over all n values, 1 for one per value. Inlined with a constant stride, each call is its
   own loop. */
static inline void scale_shift(const uint8_t *q, const float *step, const float *min, int64_t stride, int64_t n,
                               void *out, int64_t at, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)out + at;
        for (int64_t j = 0; j < n; j++) {
            float value = (float)q[j] * step[j * stride];
            dst[j] = to_bf16(value + min[j * stride]);
        }
    } else {
        float *dst = (float *)out + at;
        for (int64_t j = 0; j < n; j++) {
            float value = (float)q[j] * step[j * stride];
            dst[j] = value + min[j * stride];
        }
    }
}

/* Group-wise codes of `bits` bits -> values, for ranks constant over runs of tokens (hf_varrate.codec.
   quantization.dequantize_runs, then .to(bf16) when out_bf16). codes: the packed stream (unpack_codes).
   runs [n_runs, 3]: (first, stop, rank). With width 0 the scales sit per token: steps, mins fp32, one per
   group, token after token; a token's groups cover `group` values, its last one the rest. With width > 0 they
   sit per component (axis "component"): steps, mins fp32 [T, width], row t // group for token t, column j for
   its j-th coefficient. out: [count] fp32, or bf16 as uint16. */
void dequantize_runs(const uint8_t *codes, int bits, const float *steps, const float *mins, const int64_t *runs,
                     int64_t n_runs, int64_t group, int64_t width, void *out, int out_bf16, int threads) {
    int64_t offset = 0, first_group = 0;
    for (int64_t run = 0; run < n_runs; run++) {
        const int64_t first = runs[3 * run], rows = runs[3 * run + 1] - first, rank = runs[3 * run + 2];
        const int64_t groups = width ? 1 : (rank + group - 1) / group;  /* per token: groups of `group` values */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < rows; row++) {
            uint8_t scratch[rank + 2];
            const int64_t start = offset + row * rank;
            uint8_t *q = scratch + start % 2;
            unpack_codes(codes, bits, start, rank, q);
            if (width) {  /* one (min, step) per component of this token's group of tokens */
                const int64_t at = (first + row) / group * width;
                scale_shift(q, steps + at, mins + at, 1, rank, out, start, out_bf16);
                continue;
            }
            const float *row_steps = steps + first_group + row * groups, *row_mins = mins + first_group + row * groups;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * group, n = (j0 + group < rank ? j0 + group : rank) - j0;
                scale_shift(q + j0, row_steps + g, row_mins + g, 0, n, out, start + j0, out_bf16);
            }
        }
        offset += rows * rank;
        first_group += rows * groups;
    }
}

/* The coded tokens' attention scores (hf_varrate.codec.attend: the anchor means, the projection added to
   them, RoPE, `_block_scores`), one token at a time.
   proj [C, width] (fp32, or bf16 as uint16 when proj_bf16): each token's projection onto the keys' basis,
   width = heads * dim, each head's RoPE pairs adjacent. anchors [A, width] fp32: the anchors' keys,
   un-rotated and divided by n_neighbours, in the same layout. neighbours [C, n_neighbours]: rows of
   anchors. turns [S, dim / 2, 2] fp32: (cos, sin) per prompt position and pair; positions [C]: each
   token's. queries [heads, rows, dim] fp32, paired as the keys. scores [heads, rows, C] fp32 (unscaled). */
void coded_key_scores(const void *proj, int proj_bf16, int64_t n_tokens, int64_t heads, int64_t dim,
                      const float *restrict anchors, const int64_t *restrict neighbours, int64_t n_neighbours,
                      const float *restrict turns, const int64_t *restrict positions, const float *restrict queries,
                      int64_t rows, float *restrict scores, int threads) {
    const int64_t width = heads * dim, pairs = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n_tokens; t++) {
        float key[width], rotated[width];
        const int64_t *nb = neighbours + t * n_neighbours;
        /* the anchors' sum, in order (((a0 + a1) + a2) + ...) as F.embedding_bag adds them; the first two in
           one loop (a copy that later loads read at another width stalls store forwarding: 4x slower) */
        const float *a0 = anchors + nb[0] * width;
        if (n_neighbours == 1) {
            for (int64_t i = 0; i < width; i++) key[i] = a0[i];
        } else {
            const float *a1 = anchors + nb[1] * width;
            for (int64_t i = 0; i < width; i++) key[i] = a0[i] + a1[i];
        }
        for (int64_t n = 2; n < n_neighbours; n++) {
            const float *an = anchors + nb[n] * width;
            for (int64_t i = 0; i < width; i++) key[i] += an[i];
        }
        if (proj_bf16) {
            const uint16_t *p = (const uint16_t *)proj + t * width;
            for (int64_t i = 0; i < width; i++) key[i] += from_bf16(p[i]);
        } else {
            const float *p = (const float *)proj + t * width;
            for (int64_t i = 0; i < width; i++) key[i] += p[i];
        }
        const float *turn = turns + positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *k = key + h * dim;
            float *r = rotated + h * dim;
            for (int64_t p = 0; p < pairs; p++) {
                const float re = k[2 * p], im = k[2 * p + 1], c = turn[2 * p], s = turn[2 * p + 1];
                r[2 * p] = re * c - im * s;
                r[2 * p + 1] = re * s + im * c;
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *r = rotated + h * dim;
            for (int64_t row = 0; row < rows; row++) {
                const float *q = queries + (h * rows + row) * dim;
                float lanes[LANES] = {0.0f}, sum = 0.0f;
                int64_t i = 0;
                for (; i + LANES <= dim; i += LANES)
                    for (int j = 0; j < LANES; j++) lanes[j] += q[i + j] * r[i + j];
                for (; i < dim; i++) sum += q[i] * r[i];
                for (int w = LANES / 2; w > 0; w /= 2)
                    for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
                scores[(h * rows + row) * n_tokens + t] = sum + lanes[0];
            }
        }
    }
}

/* The anchors' keys as `coded_key_scores` reads them (hf_varrate.codec.attend._anchor_keys): each anchor's
   key un-rotated by its position's turn and divided by n_neighbours, each head's RoPE pairs (i, i + dim/2)
   made adjacent. keys [heads, E, dim] fp32 (the exact tokens, post-RoPE); rows [A]: each anchor's row among
   them; positions [A]: its prompt position; turns [S, dim / 2, 2]. out [A, heads * dim]. */
void anchor_keys(const float *restrict keys, int64_t heads, int64_t n_exact, int64_t dim, const int64_t *restrict rows,
                 const int64_t *restrict positions, int64_t n_anchors, const float *restrict turns, int64_t n_neighbours,
                 float *restrict out) {
    const int64_t pairs = dim / 2;
    for (int64_t a = 0; a < n_anchors; a++) {
        const float *turn = turns + positions[a] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *k = keys + (h * n_exact + rows[a]) * dim;
            float *z = out + (a * heads + h) * dim;
            for (int64_t p = 0; p < pairs; p++) {
                const float c = turn[2 * p], s = turn[2 * p + 1], x = k[p], y = k[p + pairs];
                const float scale = (c * c + s * s) * (float)n_neighbours;
                z[2 * p] = (x * c + y * s) / scale;
                z[2 * p + 1] = (y * c - x * s) / scale;
            }
        }
    }
}

/* The anchors' share of the coded tokens' attention (hf_varrate.codec.attend, values): a coded token's
   value is the mean of its anchors' plus a projection, so each of its n_neighbours anchors gets
   1 / n_neighbours of its weight. coded [n_rows, n_tokens] and exact [n_rows, E] are row views with
   stride row_stride (into the same weights); neighbours [n_tokens, n_neighbours] index the anchors,
   anchor_rows [A] their columns among the exact tokens. Adds into exact. */
void add_anchor_shares(const float *coded, float *exact, int64_t n_rows, int64_t row_stride, int64_t n_tokens,
                       const int64_t *restrict neighbours, int64_t n_neighbours, const int64_t *restrict anchor_rows,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n_rows; row++) {
        const float *p = coded + row * row_stride;
        float *e = exact + row * row_stride;
        for (int64_t t = 0; t < n_tokens; t++) {
            const float share = p[t] / (float)n_neighbours;
            for (int64_t n = 0; n < n_neighbours; n++) e[anchor_rows[neighbours[t * n_neighbours + n]]] += share;
        }
    }
}

/* ---- The prefill's loops: coding a prompt (hf_varrate.codec.pipeline's fast path). ---- */

/* z_t = [un-rotated key ; value] of each token at `positions` (hf_varrate.codec.joint.joint_rows, then
   `* scales` where scales is not NULL), with the same operations in the same order, so bit for bit:
   ((k1 * c) + (k2 * s)) / ((c * c) + (s * s)) for the first half of each head, ((k2 * c) - (k1 * s)) / ... for
   the second. keys, values: [heads, S, dim] fp32 with the given head and token strides (dim contiguous);
   cos, sin [S, dim] fp32 contiguous; out [n, 2 * heads * dim]. */
void joint_rows(const float *keys, const float *values, int64_t heads, int64_t dim, int64_t key_head_stride,
                int64_t key_token_stride, int64_t value_head_stride, int64_t value_token_stride, const float *cos,
                const float *sin, const int64_t *restrict positions, int64_t n, const float *scales, float *out,
                int threads) {
    const int64_t half = dim / 2, width = heads * dim;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n; t++) {
        const int64_t p = positions[t];
        const float *c = cos + p * dim, *s = sin + p * dim;
        float *z = out + t * 2 * width;
        for (int64_t h = 0; h < heads; h++) {
            const float *k = keys + h * key_head_stride + p * key_token_stride;
            const float *v = values + h * value_head_stride + p * value_token_stride;
            float *zk = z + h * dim, *zv = z + width + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float c1 = c[i], s1 = s[i], c2 = c[i + half], s2 = s[i + half];
                const float den1 = c1 * c1 + s1 * s1, den2 = c2 * c2 + s2 * s2;
                zk[i] = (k[i] * c1 + k[i + half] * s1) / den1;
                zk[i + half] = (k[i + half] * c2 - k[i] * s2) / den2;
            }
            for (int64_t i = 0; i < dim; i++) zv[i] = v[i];
        }
        if (scales)
            for (int64_t i = 0; i < 2 * width; i++) z[i] *= scales[i];
    }
}

/* For each row of scores [n_rows, n_cols] fp32, the columns of its k smallest values, smallest first, in out
   [n_rows, k] int64; ties[row] = 1 where that choice depends on how equal values are ordered (two of the
   k + 1 smallest are equal), whose order torch.topk leaves to its sort, or where the row holds a NaN or
   infinities enough to leave a slot empty: the caller takes those rows from torch.topk, so that the
   anchors are the same everywhere. */
void smallest_columns(const float *scores, int64_t n_rows, int64_t n_cols, int64_t k, int64_t *out, uint8_t *ties,
                      int threads) {
    const int64_t keep = k < n_cols ? k + 1 : k;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *row = scores + r * n_cols;
        float best[keep];
        int64_t index[keep];
        uint8_t odd = 0;  /* a NaN seen */
        for (int64_t i = 0; i < keep; i++) {
            best[i] = __builtin_inff();
            index[i] = -1;
        }
        /* an upper bound on the (k + 1)-th smallest value: the (k + 1)-th smallest of the minima of STRIPES
           stripes of columns (j, j + STRIPES, j + 2 STRIPES, ...; k + 1 stripes each hold a value at most
           it), so that the scan below inserts few values; the minima vectorize, the scan mostly skips */
        float low[STRIPES];
        const int64_t stripes = n_cols < STRIPES ? n_cols : STRIPES;
        for (int64_t j = 0; j < stripes; j++) low[j] = row[j];
        for (int64_t j0 = stripes; j0 < n_cols; j0 += stripes) {
            const int64_t width = n_cols - j0 < stripes ? n_cols - j0 : stripes;
            for (int64_t j = 0; j < width; j++) low[j] = row[j0 + j] < low[j] ? row[j0 + j] : low[j];
        }
        for (int64_t j = 0; j < n_cols; j++) odd |= row[j] != row[j];
        for (int64_t j = 0; j < stripes; j++) {  /* the keep smallest minima, in best */
            if (!(low[j] < best[keep - 1])) continue;
            int64_t at = keep - 1;
            while (at > 0 && low[j] < best[at - 1]) {
                best[at] = best[at - 1];
                at--;
            }
            best[at] = low[j];
        }
        const float bound = best[keep - 1];
        for (int64_t i = 0; i < keep; i++) best[i] = __builtin_inff();
        for (int64_t j = 0; j < n_cols; j++) {
            const float value = row[j];
            if (!(value <= bound) || !(value < best[keep - 1])) continue;  /* equal values keep column order */
            int64_t at = keep - 1;  /* the last slot, then moved up past larger values */
            while (at > 0 && value < best[at - 1]) {
                best[at] = best[at - 1];
                index[at] = index[at - 1];
                at--;
            }
            best[at] = value;
            index[at] = j;
        }
        for (int64_t i = 0; i < keep; i++) odd |= index[i] < 0 || (i > 0 && best[i] == best[i - 1]);
        ties[r] = odd;
        for (int64_t i = 0; i < k; i++) out[r * k + i] = index[i] < 0 ? 0 : index[i];
    }
}

/* Eq. 2 in place: z[t] -= mean of anchors[neighbours[t, :]], the mean as F.embedding_bag(mode="mean") forms
   it (((a0 + a1) + a2) + ...) / k, bit for bit; also written to means [n, width] where means is not NULL.
   z [n, width], anchors [A, width] fp32 contiguous. */
void subtract_means(float *z, int64_t n, int64_t width, const float *restrict anchors,
                    const int64_t *restrict neighbours, int64_t k, float *means, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n; t++) {
        const int64_t *nb = neighbours + t * k;
        float *row = z + t * width, *mean_row = means ? means + t * width : NULL;
        if (k == 4) {  /* the default n_anchors: one vectorized pass */
            const float *a0 = anchors + nb[0] * width, *a1 = anchors + nb[1] * width;
            const float *a2 = anchors + nb[2] * width, *a3 = anchors + nb[3] * width;
            for (int64_t i = 0; i < width; i++) {
                const float mean = (((a0[i] + a1[i]) + a2[i]) + a3[i]) / 4.0f;
                row[i] -= mean;
                if (mean_row) mean_row[i] = mean;
            }
            continue;
        }
        float sum[width];
        const float *a0 = anchors + nb[0] * width;
        for (int64_t i = 0; i < width; i++) sum[i] = a0[i];
        for (int64_t m = 1; m < k; m++) {
            const float *am = anchors + nb[m] * width;
            for (int64_t i = 0; i < width; i++) sum[i] += am[i];
        }
        for (int64_t i = 0; i < width; i++) {
            const float mean = sum[i] / (float)k;
            row[i] -= mean;
            if (mean_row) mean_row[i] = mean;
        }
    }
}

static inline float coefficient(const void *coefs, int bf16, int64_t at) {
    return bf16 ? from_bf16(((const uint16_t *)coefs)[at]) : ((const float *)coefs)[at];
}

/* The smallest and largest value of every group of the dense coefficients [C, row_stride] (fp32, or bf16 as
   uint16), groups in stream order (hf_varrate.codec.quantization.quantize_dense's amin / amax over the groups
   that exist). runs [n_runs, 3]: (first, stop, rank) as dequantize_runs reads them. lo, hi [groups] fp32. */
void group_ranges(const void *coefs, int bf16, int64_t row_stride, const int64_t *runs, int64_t n_runs,
                  int64_t group, float *lo, float *hi, int threads) {
    int64_t first_group = 0;
    for (int64_t run = 0; run < n_runs; run++) {
        const int64_t first = runs[3 * run], rows = runs[3 * run + 1] - first, rank = runs[3 * run + 2];
        const int64_t groups = (rank + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < rows; row++) {
            const int64_t base = (first + row) * row_stride;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * group, j1 = j0 + group < rank ? j0 + group : rank;
                float low = coefficient(coefs, bf16, base + j0), high = low;
                int nan = low != low;  /* a NaN anywhere makes the range NaN, as torch's amin / amax give it */
                for (int64_t j = j0 + 1; j < j1; j++) {
                    const float value = coefficient(coefs, bf16, base + j);
                    low = value < low ? value : low;
                    high = value > high ? value : high;
                    nan |= value != value;
                }
                lo[first_group + row * groups + g] = nan ? NAN : low;
                hi[first_group + row * groups + g] = nan ? NAN : high;
            }
        }
        first_group += rows * groups;
    }
}

/* A value's code: clamp(round_half_even((x - min) / divisor), 0, top), as quantize_dense computes it (a constant
   group's divisor is inf, which gives 0). */
static inline uint8_t code_of(float x, float min, float divisor, float top) {
    float value = __builtin_nearbyintf((x - min) / divisor);
    value = value > 0.0f ? value : 0.0f;
    return (uint8_t)(value < top ? value : top);
}

/* scratch [count] values of `bits` bits (2, 3 or 4) -> codes, as pack_bits writes them: value i at bits bits * i
   .. of the little-endian bit stream, 8 values in `bits` bytes, zero-padded to ceil(count / 8) * bits bytes. */
static void pack_codes(const uint8_t *scratch, int64_t count, int bits, uint8_t *codes, int threads) {
    const int64_t chunks = (count + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {  /* 8 values (zeros past count) -> `bits` bytes */
        uint64_t word = 0;
        for (int64_t k = 0; k < 8 && 8 * c + k < count; k++) word |= (uint64_t)scratch[8 * c + k] << (k * bits);
        for (int b = 0; b < bits; b++) codes[c * bits + b] = (uint8_t)(word >> (8 * b));
    }
}

/* `bits`-bit codes (2, 3 or 4) of the dense coefficients (as group_ranges reads them): q = clamp(round_half_even(
   (x - min) / divisor), 0, 2^bits - 1) per value, the divisor inf for a constant group, as quantize_dense computes
   them; then packed (pack_codes). mins, divisors [groups] fp32; scratch [count] uint8. */
void quantize_runs(const void *coefs, int bf16, int64_t row_stride, const int64_t *runs, int64_t n_runs,
                   int64_t group, int bits, const float *mins, const float *divisors, uint8_t *scratch, int64_t count,
                   uint8_t *codes, int threads) {
    const float top = (float)((1 << bits) - 1);
    int64_t offset = 0, first_group = 0;
    for (int64_t run = 0; run < n_runs; run++) {
        const int64_t first = runs[3 * run], rows = runs[3 * run + 1] - first, rank = runs[3 * run + 2];
        const int64_t groups = (rank + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < rows; row++) {
            const int64_t base = (first + row) * row_stride;
            uint8_t *q = scratch + offset + row * rank;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * group, j1 = j0 + group < rank ? j0 + group : rank;
                const float min = mins[first_group + row * groups + g], div = divisors[first_group + row * groups + g];
                for (int64_t j = j0; j < j1; j++) q[j] = code_of(coefficient(coefs, bf16, base + j), min, div, top);
            }
        }
        offset += rows * rank;
        first_group += rows * groups;
    }
    pack_codes(scratch, count, bits, codes, threads);
}

/* The rank of token `token` under runs [n_runs, 3] (first, stop, rank) that tile the tokens in order. */
static inline int64_t rank_of(const int64_t *runs, int64_t n_runs, int64_t token) {
    for (int64_t run = 0; run < n_runs; run++)
        if (token < runs[3 * run + 1]) return runs[3 * run + 2];
    return 0;
}

/* Per-component ranges of the dense coefficients [C, row_stride] (fp32, or bf16 as uint16) whose ranks are
   constant over runs (as quantize_runs reads them): lo, hi [T, width] fp32, row t the smallest and largest value
   of component j over tokens t * group .. t * group + group - 1 that have it (rank > j), 0 and 0 where none does
   (hf_varrate.codec.components._component_ranges). */
void component_ranges(const void *coefs, int bf16, int64_t row_stride, const int64_t *runs, int64_t n_runs,
                      int64_t n_tokens, int64_t group, int64_t width, float *lo, float *hi, int threads) {
    const int64_t n_groups = (n_tokens + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n_groups; t++) {
        float *low = lo + t * width, *high = hi + t * width;
        int64_t seen = 0;  /* components some token of the group has so far */
        const int64_t stop = (t + 1) * group < n_tokens ? (t + 1) * group : n_tokens;
        int nan = 0;
        for (int64_t token = t * group; token < stop; token++) {
            const int64_t rank = rank_of(runs, n_runs, token), base = token * row_stride;
            for (int64_t j = 0; j < rank; j++) {
                const float value = coefficient(coefs, bf16, base + j);
                if (j >= seen) {
                    low[j] = high[j] = value;
                } else {
                    low[j] = value < low[j] ? value : low[j];
                    high[j] = value > high[j] ? value : high[j];
                }
                nan |= value != value;
            }
            seen = rank > seen ? rank : seen;
        }
        for (int64_t j = seen; j < width; j++) low[j] = high[j] = 0.0f;
        for (int64_t token = t * group; nan && token < stop; token++) {  /* a NaN makes its range NaN, as in torch */
            const int64_t rank = rank_of(runs, n_runs, token), base = token * row_stride;
            for (int64_t j = 0; j < rank; j++) {
                const float value = coefficient(coefs, bf16, base + j);
                if (value != value) low[j] = high[j] = NAN;
            }
        }
    }
}

/* `bits`-bit codes (2, 3 or 4) of the same coefficients with one (min, divisor) per component and group of
   tokens (mins, divisors [T, width] fp32, as component_ranges lays them out): q = clamp(round_half_even((x - min)
   / divisor), 0, 2^bits - 1) for each token's first rank values, token after token, then packed as quantize_runs
   packs them (hf_varrate.codec.components.quantize_components). scratch [count] uint8. */
void quantize_component_runs(const void *coefs, int bf16, int64_t row_stride, const int64_t *runs, int64_t n_runs,
                             int64_t group, int64_t width, int bits, const float *mins, const float *divisors,
                             uint8_t *scratch, int64_t count, uint8_t *codes, int threads) {
    const float top = (float)((1 << bits) - 1);
    int64_t offset = 0;
    for (int64_t run = 0; run < n_runs; run++) {
        const int64_t first = runs[3 * run], rows = runs[3 * run + 1] - first, rank = runs[3 * run + 2];
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < rows; row++) {
            const int64_t token = first + row, base = token * row_stride, at = token / group * width;
            uint8_t *q = scratch + offset + row * rank;
            for (int64_t j = 0; j < rank; j++)
                q[j] = code_of(coefficient(coefs, bf16, base + j), mins[at + j], divisors[at + j], top);
        }
        offset += rows * rank;
    }
    pack_codes(scratch, count, bits, codes, threads);
}
