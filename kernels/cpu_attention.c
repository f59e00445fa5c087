/* Paged attention on the CPU, reading keys and values in place: decode tokens and prefill chunks alike.

   A task is a run of consecutive query rows of one sequence, the first seeing `len` keys and each next one more
   (a decode is a run of one). For each kv head, the group of query heads that share it walks the sequence's
   blocks once for the whole run; per block and row, the scores of the tokens that row sees (eight at a time),
   one rescale of its running output (online softmax, block by block), then the weighted values, each step for
   the group's heads side by side. Each row's sums are
   taken in the same order whatever run it is in, so a token's output is the same bits whether it was decoded,
   prefilled whole, prefilled in chunks or recomputed after a preemption or a worker's restart. Arithmetic in
   float32 whatever the cache dtype (float32 or bfloat16); nothing is copied out of the cache. Built and loaded
   by kernels/native.py; kernels/cpu_attention.py calls it.

   Layouts (strides in elements): query and out [rows, heads, head_dim] with a row and a head stride, the
   head_dim contiguous; caches [num_blocks, block_size, kv_heads, head_dim] contiguous; block tables int32
   [num_seqs, table_row]; tasks int64 [n, 4]: first query row, sequence, keys its first row sees, rows.
   head_dim and block_size are multiples of 8. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#ifdef __FMA__
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

/* Eight floats: one AVX register, two SSE ones. A key's score is eight partial sums over its head_dim (lane u
   takes d = u mod 8), added in one tree for eight keys at once, with no horizontal sum per key. */
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t lanes8 __attribute__((vector_size(32)));
#define LANES 8
#ifdef __clang__
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (lanes8){__VA_ARGS__})
#endif

/* a * b + c, rounded once where the CPU has fused multiply-adds. Written out, so that a row's bits do not
   depend on where the compiler chose to fuse a product and a sum (it may, differently, in a loop's first pass). */
INLINE vec8 fma8(vec8 a, vec8 b, vec8 c) {
#if defined(__FMA__) && defined(__AVX__)
    return (vec8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

INLINE vec8 splat(float x) {
    return (vec8){x, x, x, x, x, x, x, x};
}

/* x where `mask` is set, y elsewhere */
INLINE vec8 blend(lanes8 mask, vec8 x, vec8 y) {
    return (vec8)(((lanes8)x & mask) | ((lanes8)y & ~mask));
}

/* e^x for the scores less their running max (x <= 0), eight at a time without a call: Cephes' expf (x = n ln 2
   + r, a degree-6 polynomial for e^r, 2^n put in the exponent bits); within 1 ulp of expf over every float in
   [-87, 0]. Below -87 the result is clamped near 2^-126 where expf would give a subnormal: a weight of ~1e-38
   beside the max's 1, invisible in the sum. Lanes past a block's tokens hold anything: clamped to [-87, 0]
   too, so that no conversion overflows. */
INLINE vec8 exp8_nonpositive(vec8 x) {
    const vec8 low = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f}, zero = {0};
    x = blend(x < low, low, x);
    x = blend(x > zero, zero, x);
    /* n = round(x log2 e) by adding and taking away 1.5 · 2^23 (round to nearest); the multiply-adds written out,
       as in the scores, so that every inlined copy rounds alike */
    const vec8 n = fma8(x, splat(1.44269504088896341f), splat(12582912.0f)) - 12582912.0f;
    const vec8 r = fma8(n, splat(2.12194440e-4f), fma8(n, splat(-0.693359375f), x));
    vec8 p = fma8(r, splat(1.9875691500e-4f), splat(1.3981999507e-3f));
    p = fma8(p, r, splat(8.3334519073e-3f));
    p = fma8(p, r, splat(4.1665795894e-2f));
    p = fma8(p, r, splat(1.6666665459e-1f));
    p = fma8(p, r, splat(5.0000001201e-1f));
    const vec8 e = fma8(p * r, r, r) + 1.0f;
    return e * (vec8)((__builtin_convertvector(n, lanes8) + 127) << 23);
}

INLINE vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The scores of the LANES keys at k (rows `stride` apart) for the query q: key t's score is
   ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) of its partial sums p, whatever else is computed beside it. */
INLINE vec8 scores8(const float *restrict q, const float *restrict k, int64_t stride, int64_t dim) {
    vec8 p[LANES] = {0};
    for (int64_t d = 0; d < dim; d += LANES) { /* eight keys' chains side by side */
        const vec8 qd = load8(q + d);
        for (int t = 0; t < LANES; t++) p[t] = fma8(qd, load8(k + t * stride + d), p[t]);
    }
    vec8 x[4], y[2];
    for (int i = 0; i < 4; i++) /* lanes: keys 2i, 2i+1 by pairs of partial sums */
        x[i] = PICK(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               PICK(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++) /* keys 4i .. 4i+3 by quarters */
        y[i] = PICK(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               PICK(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return PICK(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) + PICK(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Lanes [0, n) of x, `fill` in the others: a block's last lanes, past its tokens. */
INLINE vec8 keep(vec8 x, int64_t n, vec8 fill) {
    const lanes8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    return blend(lane < (int32_t)n, x, fill);
}

/* a = a * shrink + the values v (rows `stride` apart) weighted by w, token by token, over `width` vectors of a
   (a constant where inlined, so that they stay in registers) */
INLINE void weigh_values(float *restrict a, float shrink, const float *restrict w, const float *restrict v,
                         int64_t stride, int64_t count, const int width) {
    vec8 out[8];
    for (int i = 0; i < width; i++) out[i] = load8(a + i * LANES) * shrink;
    for (int64_t t = 0; t < count; t++)
        for (int i = 0; i < width; i++) out[i] = fma8(splat(w[t]), load8(v + t * stride + i * LANES), out[i]);
    for (int i = 0; i < width; i++) memcpy(a + i * LANES, &out[i], sizeof out[i]);
}

/* One block of `count` tokens for the `group` query heads qf [group, dim]: keys and values are rows `stride`
   floats apart, readable in whole LANES of rows. Running max m, sum l and output acc [group, dim] are rescaled
   once per block; a block's weights are summed in lanes, then in one tree. Each step for every head of the group
   before the next step: a head's steps depend on each other (the max, then the exponentials, then the values),
   so one head at a time left the vector units waiting on each step's latency; the heads' are independent. */
INLINE void attend_block(const float *restrict qf, const float *restrict k, const float *restrict v, int64_t stride,
                         int64_t count, int64_t group, int64_t dim, int64_t size, float *restrict s,
                         float *restrict acc, float *restrict m, float *restrict l) {
    const vec8 none = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const vec8 zero = {0};
    float top[group], shrink[group];
    for (int64_t j = 0; j < group; j++) { /* s [group, size]: the scores, then the weights */
        vec8 high = none;
        for (int64_t t = 0; t < count; t += LANES) {
            const vec8 part = keep(scores8(qf + j * dim, k + t * stride, stride, dim), count - t, none);
            memcpy(s + j * size + t, &part, sizeof part);
            high = blend(part > high, part, high);
        }
        top[j] = m[j];
        for (int u = 0; u < LANES; u++) top[j] = high[u] > top[j] ? high[u] : top[j];
    }
    for (int64_t j = 0; j < group; j++) {
        /* ~1e-38 at the first block (m is -inf), where acc and l are 0 */
        shrink[j] = exp8_nonpositive(splat(m[j] - top[j]))[0];
        vec8 sums = zero;
        for (int64_t t = 0; t < count; t += LANES) {
            const vec8 e = keep(exp8_nonpositive(load8(s + j * size + t) - top[j]), count - t, zero);
            memcpy(s + j * size + t, &e, sizeof e);
            sums += e;
        }
        m[j] = top[j];
        l[j] = l[j] * shrink[j] + (((sums[0] + sums[1]) + (sums[2] + sums[3])) +
                                   ((sums[4] + sums[5]) + (sums[6] + sums[7])));
    }
    for (int64_t j = 0; j < group; j++) {
        /* the output eight vectors at a time (a head_dim's tail one at a time), in registers over the block */
        int64_t d = 0;
        for (; d + 8 * LANES <= dim; d += 8 * LANES)
            weigh_values(acc + j * dim + d, shrink[j], s + j * size, v + d, stride, count, 8);
        for (; d < dim; d += LANES) weigh_values(acc + j * dim + d, shrink[j], s + j * size, v + d, stride, count, 1);
    }
}

/* Ask for a block's keys and values before they are needed, into L2: the arithmetic of one block then hides the
   memory latency of a later one, which the hardware prefetcher does not foresee (blocks lie anywhere in the
   cache). Two blocks ahead, into L2 rather than L1: 0.94x the time of one block ahead into L1, with a cache of
   100 MB read from memory. */
INLINE void prefetch(const char *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 1);
}

#define AHEAD 2 /* blocks */

/* The blocks a task reads: those of the keys its last row sees (`len` for its first of `span` rows, one more each). */
INLINE int64_t task_blocks(int64_t len, int64_t span, int64_t block_size) {
    return (len + span - 1 + block_size - 1) / block_size;
}

/* The cache block `index` blocks into a task's walk (it has `blocks`), or past its end into the next task's (0
   blocks where there is none); -1 past both. */
INLINE int64_t block_at(const int32_t *table, int64_t blocks, const int32_t *next_table, int64_t next_blocks,
                        int64_t index) {
    if (index < blocks) return table[index];
    return index - blocks < next_blocks ? next_table[index - blocks] : -1;
}

/* One task: `span` query rows from `row` on, the first seeing `len` keys of the sequence. Block by block, every kv
   head in turn, so that a block's keys and values are read from memory once for the run (a token's heads sit
   side by side). */
INLINE void task(int dtype, const void *q, int64_t q_row, int64_t q_head, const void *kc, const void *vc, void *o,
                 int64_t o_row, int64_t o_head, const int32_t *table, int64_t len, int64_t row, int64_t span,
                 const int32_t *next_table, int64_t next_blocks, int warm, int64_t heads, int64_t kv_heads,
                 int64_t dim, int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * dim, width = heads * dim;
    const int64_t last = len + span - 1; /* keys the run's last row sees */
    /* bfloat16 keys and values are widened a block and a head at a time into kb / vb */
    float qf[span * width], acc[span * width], sc[(heads / kv_heads) * block_size], m[span * heads], l[span * heads];
    float kb[dtype ? block_size * dim : 1], vb[dtype ? block_size * dim : 1];
    for (int64_t r = 0; r < span; r++)
        for (int64_t j = 0; j < heads; j++) {
            const int64_t at = (row + r) * q_row + j * q_head;
            float *qj = qf + r * width + j * dim;
            for (int64_t d = 0; d < dim; d++)
                qj[d] = (dtype ? from_bf16(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d]) * scale;
            m[r * heads + j] = -INFINITY;
            l[r * heads + j] = 0.0f;
        }
    memset(acc, 0, sizeof acc);
    /* a later block is prefetched a share per kv head (all at once would stall on the memory queues): AHEAD
       blocks on, past this task's end into the next task's first blocks (else each sequence's first blocks wait on
       memory: 1.1x the time at 64 sequences of 192 tokens, one thread), and at the first block the ones between as
       well, but for those the task before fetched (`warm`: it reached AHEAD blocks past its end) */
    const int64_t share = block_size * dim * (dtype ? 2 : 4), block_bytes = share * kv_heads;
    const int64_t blocks = task_blocks(len, span, block_size);
    const int64_t fetched = warm ? (blocks < AHEAD ? blocks : AHEAD) : 1; /* the first block's first prefetch */
    for (int64_t start = 0, index = 0; start < last; start += block_size, index++) {
        const int64_t count = last - start < block_size ? last - start : block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t b = index ? AHEAD : fetched; b <= AHEAD; b++) {
                const int64_t at = block_at(table, blocks, next_table, next_blocks, index + b);
                if (at < 0) break;
                prefetch((const char *)kc + at * block_bytes + h * share, share);
                prefetch((const char *)vc + at * block_bytes + h * share, share);
            }
            const int64_t first = (int64_t)table[index] * block_size * token_stride + h * dim;
            const float *k = kb, *v = vb;
            int64_t stride = dim;
            if (dtype) {
                for (int64_t t = 0; t < (count + LANES - 1) / LANES * LANES; t++)
                    for (int64_t d = 0; d < dim; d++) {
                        kb[t * dim + d] = from_bf16(((const uint16_t *)kc)[first + t * token_stride + d]);
                        vb[t * dim + d] = from_bf16(((const uint16_t *)vc)[first + t * token_stride + d]);
                    }
            } else {
                k = (const float *)kc + first, v = (const float *)vc + first, stride = token_stride;
            }
            for (int64_t r = 0; r < span; r++) {
                const int64_t seen = len + r - start; /* the block's tokens row r sees */
                if (seen <= 0) continue;
                const int64_t at = r * heads + h * group;
                attend_block(qf + at * dim, k, v, stride, seen < block_size ? seen : block_size, group, dim, block_size,
                             sc, acc + at * dim, m + at, l + at);
            }
        }
    }
    for (int64_t r = 0; r < span; r++)
        for (int64_t j = 0; j < heads; j++) {
            const int64_t at = (row + r) * o_row + j * o_head;
            const float inv = 1.0f / l[r * heads + j], *a = acc + r * width + j * dim;
            for (int64_t d = 0; d < dim; d++) {
                if (dtype)
                    ((uint16_t *)o)[at + d] = to_bf16(a[d] * inv);
                else
                    ((float *)o)[at + d] = a[d] * inv;
            }
        }
}

/* dtype: 0 float32, 1 bfloat16 (query, caches and out alike). Returns 0, or -1 for an unknown dtype. */
int paged_attention(int dtype, const void *q, int64_t q_row, int64_t q_head, const void *kc, const void *vc, void *o,
                    int64_t o_row, int64_t o_head, const int32_t *tables, int64_t table_row, const int64_t *tasks,
                    int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                    int threads) {
    if (dtype != 0 && dtype != 1) return -1;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        /* alone, this thread runs the tasks in turn, and each prefetches the next one's first blocks; in a team the
           next task goes to whichever thread is free first (prefetched into this core's cache: 1.06x the time) */
        const int alone = omp_get_num_threads() == 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            const int64_t *t = tasks + 4 * i, *u = t + 4;
            const int ahead = alone && i + 1 < n;
            const int32_t *table = tables + t[1] * table_row, *next_table = ahead ? tables + u[1] * table_row : 0;
            const int64_t next_blocks = ahead ? task_blocks(u[2], u[3], block_size) : 0;
            /* the common head sizes as constants, so that the compiler unrolls the loops over them */
#define TASK(DIM) task(dtype, q, q_row, q_head, kc, vc, o, o_row, o_head, table, t[2], t[0], t[3], next_table, \
                       next_blocks, alone && i > 0, heads, kv_heads, DIM, block_size, scale)
            if (dim == 64)
                TASK(64);
            else if (dim == 128)
                TASK(128);
            else
                TASK(dim);
#undef TASK
        }
    }
    return 0;
}
