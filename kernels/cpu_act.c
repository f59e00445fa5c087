/* The gated MLP's activation of bfloat16 rows on the CPU: out = silu(gate) * up (kernels/silu.h: as torch
   computes it for bfloat16, an output rarely one bfloat16 step from torch's), gate and up the two halves of the
   merged gate|up projection's row. One pass where torch makes two over a strided view, each element alone: a
   row's output does not depend on the batch. Sixteen lanes of AVX-512 at a time (`bf16_silu_mul_vectorized`:
   elsewhere the scalar loop alone would be slower than torch, and gpu_worker/native_mlp.py keeps torch's). Where
   the linears run on AMX tiles the projection's epilogue does this itself (kernels/cpu_linear.c, `gated`).
   Built and loaded by kernels/native.py.

   Layouts: x [m, 2n] bfloat16 with a row stride, each row gate then up, contiguous; out [m, n] contiguous. */
#include <stdint.h>

#include "cpu_kernels.h"
#include "silu.h"

int bf16_silu_mul_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

void bf16_silu_mul(const uint16_t *x, int64_t x_row, uint16_t *out, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *gate = x + i * x_row, *up = gate + n;
        uint16_t *o = out + i * n;
        int64_t d = 0;
#ifdef __AVX512F__
        for (; d + 16 <= n; d += 16)
            _mm256_storeu_si256((void *)(o + d), silu_mul16(bf16_widen16(gate + d), bf16_widen16(up + d)));
#endif
        for (; d < n; d++) o[d] = silu_mul1(from_bf16(gate[d]), from_bf16(up[d]));
    }
}
