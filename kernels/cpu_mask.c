/* Structured outputs on the CPU: set to -inf, in place, the logits of every token a row's grammar does not allow
   next. Each row's mask is llguidance's bitmask (bit t % 32 of 32-bit word t / 32: token t allowed); a word with
   every bit set (inside a string) is skipped whole, one with none set (between a JSON's tokens) filled whole. Torch's unpacking of the bits and masked fill
   took a tenth of a decode step here (RESULTS.md). Built and loaded by kernels/native.py; gpu_worker/structured.py
   calls it. */
#include <stdint.h>

#include "cpu_kernels.h"

/* For i < count: row `rows[i]` of `logits` (rows `row_stride` elements apart, each `cols` contiguous) masked by
   `words + i * words_per_row`. dtype: 0 float32, 1 bfloat16. Returns 0, or -1 for an unknown dtype. */
int rows_mask_bits(int dtype, void *logits, int64_t row_stride, int64_t cols, int64_t count, const int64_t *rows,
                   const uint32_t *words, int64_t words_per_row) {
    if (dtype != 0 && dtype != 1) return -1;
    const uint32_t f32_neg_inf = 0xFF800000u;
    const uint16_t bf16_neg_inf = 0xFF80u;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t *mask = words + i * words_per_row;
        char *row = (char *)logits + rows[i] * row_stride * (dtype ? 2 : 4);
        for (int64_t w = 0; w < words_per_row && w * 32 < cols; w++) {
            uint32_t banned = ~mask[w];
            if (banned == 0xFFFFFFFFu && w * 32 + 32 <= cols) { /* none allowed, the common case between strings */
                if (dtype) for (int b = 0; b < 32; b++) ((uint16_t *)row)[w * 32 + b] = bf16_neg_inf;
                else for (int b = 0; b < 32; b++) ((uint32_t *)row)[w * 32 + b] = f32_neg_inf;
                continue;
            }
            while (banned) {
                const int64_t t = w * 32 + __builtin_ctz(banned);
                banned &= banned - 1;
                if (t >= cols) break;
                if (dtype) ((uint16_t *)row)[t] = bf16_neg_inf;
                else ((uint32_t *)row)[t] = f32_neg_inf;
            }
        }
    }
    return 0;
}
