/* RMSNorm of bfloat16 rows on the CPU: out = x · rsqrt(mean(x²) + eps) · w, in float32 and rounded to bfloat16
   once, as torch's fused F.rms_norm does for bfloat16. One call where torch dispatches several ops, a fixed cost
   that at small batches was a large share of a decode step. Each row alone, its sum in
   one order: a row's output does not depend on the batch. Built and loaded by kernels/native.py;
   gpu_worker/native_norm.py calls it.

   Layouts: x [m, n] bfloat16 with a row stride, n contiguous; w [n] bfloat16; out [m, n] bfloat16 contiguous. */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "bf16.h"

#define LANES 16

void bf16_rms_norm(const uint16_t *x, int64_t x_row, const uint16_t *w, uint16_t *out, int64_t m, int64_t n,
                   float eps) {
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = x + i * x_row;
        float lanes[LANES] = {0}; /* LANES partial sums, added in one tree: vectorizes, and one order per row */
        int64_t d = 0;
        for (; d + LANES <= n; d += LANES)
            for (int u = 0; u < LANES; u++) {
                const float v = from_bf16(row[d + u]);
                lanes[u] += v * v;
            }
        for (int u = 0; d < n; d++, u++) {
            const float v = from_bf16(row[d]);
            lanes[u] += v * v;
        }
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int u = 0; u < width; u++) lanes[u] += lanes[u + width];
        const float scale = 1.0f / sqrtf(lanes[0] / (float)n + eps);
        for (d = 0; d < n; d++) out[i * n + d] = to_bf16(from_bf16(row[d]) * scale * from_bf16(w[d]));
    }
}
