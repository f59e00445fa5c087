/* Rotary position embedding of bfloat16 query and key heads on the CPU, as gpu_worker/models/layers.py's
   apply_rotary computes it with torch for bfloat16: out = addcmul(x * cos, roll(x, half), sin), that is
   round(round(x · cos) + roll(x) · sin) with the products and the sum in float32 (a multiply, then an add: no
   fused multiply-add, as torch's vectorized addcmul). So the same bits as torch, in one pass over the heads
   where torch takes three ops over a strided view. Built and loaded by
   kernels/native.py; gpu_worker/native_rotary.py calls it.

   Layouts: x [tokens, heads, dim] bfloat16 with a token stride, heads and dim contiguous; cos and sin
   [tokens, dim] bfloat16 with a token stride (sin's first half negated: layers.py's RotaryEmbedding); out
   [tokens, heads, dim] contiguous. With AVX-512 only (`bf16_rotary_vectorized`), half the head size a multiple of
   16: elsewhere torch's path is the faster one. */
#include <stdint.h>

#include "cpu_kernels.h"
#include "bf16.h"

#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

int bf16_rotary_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 where this build has no AVX-512 or half the head size is no multiple of 16 (torch's path is
   then the faster one: gpu_worker/native_rotary.py takes it). */
int bf16_rotary(const uint16_t *x, int64_t x_row, int64_t heads, int64_t dim, const uint16_t *cos,
                const uint16_t *sin, int64_t cs_row, uint16_t *out, int64_t tokens) {
#ifdef __AVX512F__
    const int64_t half = dim / 2;
    if (half % 16) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xi = x + t * x_row + h * dim;
            uint16_t *o = out + (t * heads + h) * dim;
            for (int64_t d = 0; d < dim; d += 16) {
                const __m512 rolled = bf16_widen16(xi + (d < half ? d + half : d - half));
                const __m512 first = bf16_round16(_mm512_mul_ps(bf16_widen16(xi + d), bf16_widen16(c + d)));
                /* the _round forms: builtins the compiler does not fuse into a multiply-add */
                const __m512 product = _mm512_mul_round_ps(rolled, bf16_widen16(s + d), NEAREST);
                const __m512 sum = bf16_round16(_mm512_add_round_ps(first, product, NEAREST));
                _mm256_storeu_si256((void *)(o + d), bf16_narrow16(sum));
            }
        }
    }
    return 0;
#else
    (void)x, (void)x_row, (void)heads, (void)dim, (void)cos, (void)sin, (void)cs_row, (void)out, (void)tokens;
    return -1;
#endif
}
