/* Paged attention of single-query (decode) sequences on the CPU, reading keys and values in place.

   For each (sequence, kv head): the group of query heads that share the kv head walks the sequence's blocks
   once; per block, the scores of all its tokens, one rescale of the running output (online softmax, block by
   block), then the weighted values. Arithmetic in float32 whatever the cache dtype (float32 or bfloat16);
   nothing is copied out of the cache. Built and loaded by kernels/native.py; kernels/cpu_attention.py calls it.

   Layouts (strides in elements): query and out [rows, heads, head_dim] with a row and a head stride, the
   head_dim contiguous; caches [num_blocks, block_size, kv_heads, head_dim] contiguous; block tables int32
   [num_seqs, table_row]; seq_lens int32 [num_seqs]. Decode i reads query row rows[i] of sequence seqs[i]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

/* e^x for the scores less their running max (x <= 0) without a call, so that a block's scores vectorize:
   Cephes' expf (x = n ln 2 + r, a degree-6 polynomial for e^r, 2^n put in the exponent bits); within 1 ulp of
   expf over every float in [-87, 0]. Below -87 the result is clamped near 2^-126 where expf would give a subnormal: a weight of ~1e-38
   beside the max's 1, invisible in the sum. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x log2 e) by adding and taking away 1.5 · 2^23 (round to nearest, as floorf would need
       -fno-trapping-math to vectorize) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

/* 8 partial sums, so that the compiler keeps them in one vector register (head_dim is a multiple of 8 in every
   supported model; a tail is summed apart). */
INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s[8] = {0}, tail = 0.0f;
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; u++) s[u] += a[d + u] * b[d + u];
    for (; d < n; d++) tail += a[d] * b[d];
    return tail + ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

INLINE void axpy(float *restrict y, float p, const float *restrict x, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] += p * x[d];
}

/* One block of `count` tokens for the `group` query heads qf [group, dim]: keys and values are rows `stride`
   floats apart. Running max m, sum l and output acc [group, dim] are rescaled once per block. */
INLINE void attend_block(const float *restrict qf, const float *restrict k, const float *restrict v, int64_t stride,
                         int64_t count, int64_t group, int64_t dim, float *restrict sc, float *restrict acc,
                         float *restrict m, float *restrict l) {
    for (int64_t j = 0; j < group; j++) {
        float *restrict s = sc + j * count, top = m[j];
        for (int64_t t = 0; t < count; t++) {
            s[t] = dot(qf + j * dim, k + t * stride, dim);
            top = s[t] > top ? s[t] : top;
        }
        const float shrink = expf(m[j] - top); /* 0 at the first block: acc and l are 0 */
        for (int64_t t = 0; t < count; t++) s[t] = exp_nonpositive(s[t] - top);
        float sum = 0.0f;
        for (int64_t t = 0; t < count; t++) sum += s[t];
        m[j] = top;
        l[j] = l[j] * shrink + sum;
        float *restrict a = acc + j * dim;
        for (int64_t d = 0; d < dim; d++) a[d] *= shrink;
        for (int64_t t = 0; t < count; t++) axpy(a, s[t], v + t * stride, dim);
    }
}

/* Ask for a block's keys and values before they are needed: the arithmetic of one block then hides the memory
   latency of the next, which the hardware prefetcher does not foresee (blocks lie anywhere in the cache). */
INLINE void prefetch(const char *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 3);
}

/* One decode's attention over its sequence: block by block, every kv head in turn, so that a block's keys and
   values are read from memory once (a token's heads sit side by side). */
INLINE void task(int dtype, const void *q, int64_t q_row, int64_t q_head, const void *kc, const void *vc, void *o,
                 int64_t o_row, int64_t o_head, const int32_t *table, int64_t len, int64_t row, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
    /* bfloat16 keys and values are widened a block and a head at a time into kb / vb */
    float qf[heads * dim], acc[heads * dim], sc[group * block_size], m[heads], l[heads];
    float kb[dtype ? block_size * dim : 1], vb[dtype ? block_size * dim : 1];
    for (int64_t j = 0; j < heads; j++) {
        const int64_t at = row * q_row + j * q_head;
        for (int64_t d = 0; d < dim; d++)
            qf[j * dim + d] = (dtype ? from_bf16(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d]) * scale;
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof acc);
    /* the next block is prefetched a share per kv head: all at once would stall on the line fill buffers */
    const int64_t share = block_size * dim * (dtype ? 2 : 4), block_bytes = share * kv_heads;
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t next = start + block_size < len ? (int64_t)table[start / block_size + 1] * block_bytes : -1;
        for (int64_t h = 0; h < kv_heads; h++) {
            if (next >= 0) {
                prefetch((const char *)kc + next + h * share, share);
                prefetch((const char *)vc + next + h * share, share);
            }
            const int64_t first = (int64_t)table[start / block_size] * block_size * token_stride + h * dim;
            float *qh = qf + h * group * dim, *ah = acc + h * group * dim, *mh = m + h * group, *lh = l + h * group;
            if (dtype) {
                for (int64_t t = 0; t < count; t++)
                    for (int64_t d = 0; d < dim; d++) {
                        kb[t * dim + d] = from_bf16(((const uint16_t *)kc)[first + t * token_stride + d]);
                        vb[t * dim + d] = from_bf16(((const uint16_t *)vc)[first + t * token_stride + d]);
                    }
                attend_block(qh, kb, vb, dim, count, group, dim, sc, ah, mh, lh);
            } else {
                attend_block(qh, (const float *)kc + first, (const float *)vc + first, token_stride, count, group, dim,
                             sc, ah, mh, lh);
            }
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        const int64_t at = row * o_row + j * o_head;
        const float inv = 1.0f / l[j];
        for (int64_t d = 0; d < dim; d++) {
            if (dtype)
                ((uint16_t *)o)[at + d] = to_bf16(acc[j * dim + d] * inv);
            else
                ((float *)o)[at + d] = acc[j * dim + d] * inv;
        }
    }
}

/* dtype: 0 float32, 1 bfloat16 (query, caches and out alike). Returns 0, or -1 for an unknown dtype. */
int paged_decode(int dtype, const void *q, int64_t q_row, int64_t q_head, const void *kc, const void *vc, void *o,
                 int64_t o_row, int64_t o_head, const int32_t *tables, int64_t table_row, const int32_t *seq_lens,
                 const int64_t *rows, const int64_t *seqs, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                 int64_t block_size, float scale, int threads) {
    if (dtype != 0 && dtype != 1) return -1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if(threads > 1)
    for (int64_t i = 0; i < n; i++) {
        const int32_t *table = tables + seqs[i] * table_row;
        const int64_t len = seq_lens[seqs[i]];
        /* the common head sizes as constants, so that the compiler unrolls the loops over them */
#define TASK(DIM) task(dtype, q, q_row, q_head, kc, vc, o, o_row, o_head, table, len, rows[i], heads, kv_heads, DIM, \
                       block_size, scale)
        if (dim == 64)
            TASK(64);
        else if (dim == 128)
            TASK(128);
        else
            TASK(dim);
#undef TASK
    }
    return 0;
}
