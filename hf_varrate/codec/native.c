/* Fused loops for a compact layer's read (hf_varrate/codec/native.py builds and loads this file).

   Each function does in one pass what the eager PyTorch read does in several passes over a layer-sized
   buffer; native.py says which eager code each one replaces, and tests/test_native.py checks them against
   it. Built with -ffp-contract=off: every multiply and add rounds as PyTorch's separate ops do, so
   `dequantize_runs` equals the eager dequantization bit for bit. With -fopenmp (where the compiler has it)
   each loop runs on `threads` threads, split over tokens: the same values whatever the count. */

#include <stdint.h>
#include <string.h>

#define LANES 16

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

/* 4-bit group-wise codes -> values, for ranks constant over runs of tokens (hf_varrate.codec.quantization.
   dequantize_runs, then .to(bf16) when out_bf16). codes: the packed stream, value i in byte i/2's low
   nibble if i is even, its high one if odd. runs [n_runs, 3]: (first, stop, rank). steps, mins: fp32, one
   per group, token after token; a token's groups cover `group` values, its last one the rest. out: [count]
   fp32, or bf16 as uint16. */
void dequantize_runs(const uint8_t *codes, const float *steps, const float *mins, const int64_t *runs,
                     int64_t n_runs, int64_t group, void *out, int out_bf16, int threads) {
    int64_t offset = 0, first_group = 0;
    for (int64_t run = 0; run < n_runs; run++) {
        const int64_t rows = runs[3 * run + 1] - runs[3 * run], rank = runs[3 * run + 2];
        const int64_t groups = (rank + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < rows; row++) {
            uint8_t scratch[rank + 2];
            const int64_t start = offset + row * rank;
            const uint8_t *bytes = codes + start / 2;
            const int64_t n_bytes = (start % 2 + rank + 1) / 2;
            for (int64_t i = 0; i < n_bytes; i++) {
                scratch[2 * i] = bytes[i] & 0xF;
                scratch[2 * i + 1] = bytes[i] >> 4;
            }
            const uint8_t *q = scratch + start % 2;
            const float *row_steps = steps + first_group + row * groups, *row_mins = mins + first_group + row * groups;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * group, j1 = j0 + group < rank ? j0 + group : rank;
                const float step = row_steps[g], min = row_mins[g];
                if (out_bf16) {
                    uint16_t *dst = (uint16_t *)out + start;
                    for (int64_t j = j0; j < j1; j++) {
                        float value = (float)q[j] * step;
                        dst[j] = to_bf16(value + min);
                    }
                } else {
                    float *dst = (float *)out + start;
                    for (int64_t j = j0; j < j1; j++) {
                        float value = (float)q[j] * step;
                        dst[j] = value + min;
                    }
                }
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
