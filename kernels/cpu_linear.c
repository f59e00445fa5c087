/* bfloat16 linears of a few rows on CPUs without native bfloat16: out = x w^T + bias, reading the bfloat16
   weights as they are stored and widening them in registers.

   What bounds a decode step's linear at a few tokens is reading its weight once; a float32 copy reads twice the
   bytes. Sums in float32, the bias added in float32, the output rounded to bfloat16 once: what a bfloat16 matmul
   with float32 accumulation gives, up to the order of the sums. Built and loaded by kernels/native.py;
   gpu_worker/packed_linear.py calls it for a few rows and multiplies more through float32 chunks with MKL.

   Layouts: x [m, k] bfloat16 with a row stride; w [n, k] bfloat16 contiguous; bias [n] bfloat16 or NULL;
   out [m, n] bfloat16 contiguous. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#define ROWS 4  /* weight rows per tile: with two input rows, 8 accumulators that stay in registers */
#define AHEAD 4 /* tiles prefetched ahead, 16 weight rows: the best of 0, 4 and 16 measured at k = 768 */
#define INLINE static inline __attribute__((always_inline))

INLINE v8f widen8(const uint16_t *p) {
#ifdef __AVX2__ /* one vpmovzxwd from memory, where gcc's generic widening splits it in halves */
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
#endif
}

INLINE float lanes_sum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Weight rows [n0, n0 + rows) against input rows [i0, i0 + pair): each widened weight vector serves both input
   rows of a pair, and the tile stays in L1 from the first pair on. */
INLINE void tile_rows(const float *restrict xf, const uint16_t *restrict w, const uint16_t *restrict bias,
                      uint16_t *restrict out, int64_t n, int64_t k, int64_t n0, int64_t rows, int64_t i0,
                      int64_t pair) {
    const int64_t body = k & ~(int64_t)7;
    const float *restrict x0 = xf + i0 * k, *restrict x1 = xf + (i0 + pair - 1) * k;
    v8f acc0[ROWS] = {{0}}, acc1[ROWS] = {{0}};
    /* a tile's rows are one contiguous run: per step of 8 columns (ROWS × 16 bytes), a line AHEAD tiles on */
    const char *ahead = i0 == 0 && n0 + (AHEAD + 1) * ROWS <= n ? (const char *)(w + (n0 + AHEAD * ROWS) * k) : NULL;
    for (int64_t d = 0; d < body; d += 8) {
        if (ahead) __builtin_prefetch(ahead + d * ROWS * 2, 0, 0);
        v8f a, b;
        memcpy(&a, x0 + d, sizeof a);
        memcpy(&b, x1 + d, sizeof b);
        for (int64_t r = 0; r < rows; r++) {
            const v8f wv = widen8(w + (n0 + r) * k + d);
            acc0[r] += a * wv;
            if (pair == 2) acc1[r] += b * wv;
        }
    }
    for (int64_t j = 0; j < pair; j++)
        for (int64_t r = 0; r < rows; r++) {
            const float *restrict xi = j ? x1 : x0;
            float s = lanes_sum(j ? acc1[r] : acc0[r]);
            for (int64_t d = body; d < k; d++) s += xi[d] * from_bf16(w[(n0 + r) * k + d]);
            if (bias) s += from_bf16(bias[n0 + r]);
            out[(i0 + j) * n + n0 + r] = to_bf16(s);
        }
}

INLINE void tile(const float *restrict xf, const uint16_t *restrict w, const uint16_t *restrict bias,
                 uint16_t *restrict out, int64_t m, int64_t n, int64_t k, int64_t n0, int64_t rows) {
    int64_t i = 0;
    for (; i + 2 <= m; i += 2) tile_rows(xf, w, bias, out, n, k, n0, rows, i, 2);
    if (i < m) tile_rows(xf, w, bias, out, n, k, n0, rows, i, 1);
}

/* Returns 0, or -1 when the widened input cannot be allocated. */
int bf16_linear(const uint16_t *x, int64_t x_row, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0) return 0;
    float *xf = malloc((size_t)(m * k + 1) * sizeof *xf); /* + 1: never malloc(0), which may give NULL */
    if (!xf) return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t d = 0; d < k; d++) xf[i * k + d] = from_bf16(x[i * x_row + d]);
    const int64_t tiles = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * ROWS, rows = n - n0 < ROWS ? n - n0 : ROWS;
        if (rows == ROWS)
            tile(xf, w, bias, out, m, n, k, n0, ROWS); /* a constant count, so the loop over rows unrolls */
        else
            tile(xf, w, bias, out, m, n, k, n0, rows);
    }
    free(xf);
    return 0;
}
