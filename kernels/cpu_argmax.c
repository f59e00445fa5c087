/* Each row's first maximum, for greedy sampling on the CPU, reading the logits in place in their dtype, where
   torch's `max(dim=-1)` (after widening bfloat16 logits to float32) took several times as long
   (benchmarks/results/cpu-efficiency-log-2026-12.md). As torch's: a NaN is the maximum (the first NaN's index), and ties go to the first index.
   Built and loaded by kernels/native.py; gpu_worker/sampler.py calls it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "bf16.h"

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))

INLINE v16f load16(int dtype, const void *row, int64_t at) {
    v16f v;
    if (dtype) {
        v16h h;
        memcpy(&h, (const uint16_t *)row + at, sizeof h);
        const v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, (const float *)row + at, sizeof v);
    }
    return v;
}

INLINE float load1(int dtype, const void *row, int64_t at) {
    return dtype ? from_bf16(((const uint16_t *)row)[at]) : ((const float *)row)[at];
}

static int64_t row_argmax(int dtype, const void *row, int64_t cols) {
    /* one pass for the largest value (a NaN fails every comparison, so is only noted), one for its first index */
    const v16f none = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                       -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    v16f high = none;
    v16i nan = {0};
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        const v16f v = load16(dtype, row, c);
        const v16i more = (v16i)(v > high);
        high = (v16f)(((v16i)v & more) | ((v16i)high & ~more));
        nan |= (v16i)(v != v);
    }
    float top = -INFINITY;
    int any_nan = 0;
    for (int u = 0; u < 16; u++) {
        top = high[u] > top ? high[u] : top;
        any_nan |= nan[u];
    }
    for (; c < cols; c++) {
        const float x = load1(dtype, row, c);
        top = x > top ? x : top;
        any_nan |= x != x;
    }
    const v16f tops = (v16f){0} + top; /* top in every lane */
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) { /* the first 16 with a hit, then lane by lane */
        const v16f v = load16(dtype, row, i);
        const v16i hit = any_nan ? (v16i)(v != v) : (v16i)(v == tops);
        int found = 0;
        for (int u = 0; u < 16; u++) found |= hit[u];
        if (found) break;
    }
    for (; i < cols; i++) {
        const float x = load1(dtype, row, i);
        if (any_nan ? x != x : x == top) return i;
    }
    return 0;
}

/* out[r] = the first index of row r's maximum; rows `row_stride` elements apart, each `cols` contiguous.
   dtype: 0 float32, 1 bfloat16. Returns 0, or -1 for an unknown dtype. */
int rows_argmax(int dtype, const void *x, int64_t row_stride, int64_t rows, int64_t cols, int64_t *out) {
    if (dtype != 0 && dtype != 1) return -1;
    const int64_t size = dtype ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(dtype, (const char *)x + r * row_stride * size, cols);
    return 0;
}
