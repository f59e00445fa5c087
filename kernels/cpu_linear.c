/* bfloat16 linears on CPUs without native bfloat16: out = x w^T + bias, reading the bfloat16 weights and widening
   them in registers. Built and loaded by kernels/native.py; gpu_worker/packed_linear.py calls it.

   The weight is packed once into panels of PANEL output columns: panel p holds w[p*PANEL : (p+1)*PANEL, :]
   transposed, [k][PANEL] bfloat16 (the last panel padded with zeros), so that a panel is read in order, one row
   of PANEL weights per input column. A tile of up to ROWS input rows × PANEL outputs keeps its sums in
   registers: per input column, the panel's row widened once and one broadcast per input row.

   Each output is one float32 sum over the input columns in order, the bias added in float32 and the result
   rounded to bfloat16 once: what a bfloat16 matmul with float32 accumulation gives, up to the order of the sums.
   That order is the same whatever the number of rows and wherever a row falls in a tile, so a sequence's
   outputs do not depend on the batch it is in (through float32 copies and MKL they did: bfloat16 greedy tokens
   changed with the sequences beside them).

   Layouts: x [m, k] bfloat16 with a row stride; panels [ceil(n / PANEL), k, PANEL] bfloat16; bias [n] bfloat16
   or NULL; out [m, n] bfloat16 contiguous. */
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

#define PANEL 16 /* output columns per panel: two vectors of 8 */
#define ROWS 6   /* input rows per tile: 12 accumulators, 2 widened weight vectors and a broadcast in 16 registers */
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

/* Input rows [i0, i0 + rows) of xf against one panel, whose outputs are columns [n0, n0 + PANEL) of out. */
INLINE void tile(const float *restrict xf, int64_t k, const uint16_t *restrict panel, int64_t i0, int64_t rows,
                 const uint16_t *restrict bias, uint16_t *restrict out, int64_t n, int64_t n0) {
    v8f lo[ROWS] = {{0}}, hi[ROWS] = {{0}};
    const float *restrict xr = xf + i0 * k;
    for (int64_t d = 0; d < k; d++) {
        const v8f a = widen8(panel + d * PANEL), b = widen8(panel + d * PANEL + 8);
        for (int64_t i = 0; i < rows; i++) {
            const float s = xr[i * k + d];
            const v8f sv = {s, s, s, s, s, s, s, s};
            lo[i] += sv * a;
            hi[i] += sv * b;
        }
    }
    const int64_t cols = n - n0 < PANEL ? n - n0 : PANEL;
    for (int64_t i = 0; i < rows; i++) {
        float sums[PANEL];
        memcpy(sums, &lo[i], sizeof lo[i]);
        memcpy(sums + 8, &hi[i], sizeof hi[i]);
        for (int64_t c = 0; c < cols; c++)
            out[(i0 + i) * n + n0 + c] = to_bf16(bias ? sums[c] + from_bf16(bias[n0 + c]) : sums[c]);
    }
}

/* The panel width, for the packing (gpu_worker/packed_linear.py). */
int64_t bf16_panel_width(void) { return PANEL; }

/* Returns 0, or -1 when the widened input cannot be allocated. */
int bf16_linear(const uint16_t *x, int64_t x_row, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                int64_t m, int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0) return 0;
    float *xf = malloc((size_t)(m * k + 1) * sizeof *xf); /* + 1: never malloc(0), which may give NULL */
    if (!xf) return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t d = 0; d < k; d++) xf[i * k + d] = from_bf16(x[i * x_row + d]);
    const int64_t count = (n + PANEL - 1) / PANEL;
    /* a panel at a time, every input row against it: the panel stays in cache while the rows stream by */
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t p = 0; p < count; p++) {
        const uint16_t *panel = panels + p * k * PANEL;
        int64_t i = 0;
        for (; i + ROWS <= m; i += ROWS) tile(xf, k, panel, i, ROWS, bias, out, n, p * PANEL);
        _Static_assert(ROWS == 6, "the cases below are the counts below ROWS");
        switch (m - i) { /* the rest as a constant count, so that the compiler unrolls the loop over rows */
        case 5: tile(xf, k, panel, i, 5, bias, out, n, p * PANEL); break;
        case 4: tile(xf, k, panel, i, 4, bias, out, n, p * PANEL); break;
        case 3: tile(xf, k, panel, i, 3, bias, out, n, p * PANEL); break;
        case 2: tile(xf, k, panel, i, 2, bias, out, n, p * PANEL); break;
        case 1: tile(xf, k, panel, i, 1, bias, out, n, p * PANEL); break;
        }
    }
    free(xf);
    return 0;
}
