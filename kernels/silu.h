/* silu(gate) * up of bfloat16 values, as torch computes `F.silu(gate) * up` for bfloat16: silu in float32 as
   gate / (1 + exp(-gate)), rounded to bfloat16, then the product in float32, rounded again. The exponential is
   Cephes' expf (within 1 ulp, as torch's Sleef one is, though not always the same ulp). Shared by
   kernels/cpu_act.c (the activation alone) and kernels/cpu_linear.c (in the merged gate|up projection's
   epilogue), so that both give the same bits. */
#ifndef PAGEDSERVE_SILU_H
#define PAGEDSERVE_SILU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define SILU_MIN_ARG -87.3f       /* below, e^x stays near 2^-126: beside the 1 it is added to, nothing */
#define SILU_OVERFLOW 88.7228391f /* expf's overflow to infinity */

/* e^x: x = n ln 2 + r, a degree-6 polynomial for e^r, times 2^n in two exact halves (2^n alone is no float at
   n = 128, below the overflow) */
static inline float silu_exp1(float x) {
    if (x > SILU_OVERFLOW) return INFINITY;
    x = x < SILU_MIN_ARG ? SILU_MIN_ARG : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
    float p = fmaf(r, 1.9875691500e-4f, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float e = fmaf(p * r, r, r) + 1.0f;
    const int32_t half = (int32_t)n >> 1;
    const uint32_t bits[2] = {(uint32_t)(half + 127) << 23, (uint32_t)((int32_t)n - half + 127) << 23};
    float scale[2];
    memcpy(scale, bits, sizeof scale);
    return e * scale[0] * scale[1];
}

/* gate and up: bfloat16 values */
static inline uint16_t silu_mul1(float gate, float up) {
    return to_bf16(from_bf16(to_bf16(gate / (1.0f + silu_exp1(-gate)))) * up);
}

#ifdef __AVX512F__
/* silu_exp1 on sixteen lanes, the same operations in the same order */
static inline __m512 silu_exp16(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(SILU_OVERFLOW), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(SILU_MIN_ARG)), _mm512_set1_ps(SILU_OVERFLOW));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i whole = _mm512_cvtps_epi32(n), half = _mm512_srai_epi32(whole, 1), bias = _mm512_set1_epi32(127);
    const __m512i rest = _mm512_sub_epi32(whole, half);
    const __m512 low = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
    const __m512 high = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(rest, bias), 23));
    return _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_mul_ps(e, low), high), over, _mm512_set1_ps(INFINITY));
}

/* silu_mul1 on sixteen lanes of bfloat16 values (as floats) → sixteen bfloat16 */
static inline __m256i silu_mul16(__m512 gate, __m512 up) {
    const __m512 e = silu_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    const __m512 act = bf16_round16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return bf16_narrow16(bf16_round16(_mm512_mul_ps(act, up)));
}
#endif

#endif
