/* bfloat16 <-> float32 for the CPU kernels: a bfloat16 is the top half of a float32. One value at a time, and
   sixteen at a time where the build has AVX-512. */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's conversion */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* sixteen bfloat16 → float32 */
static inline __m512 bf16_widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

/* to_bf16 on sixteen lanes, kept as floats (the bfloat16 in the top halves) */
static inline __m512 bf16_round16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __m512i kept = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(kept, _mm512_set1_epi32((int)0xffff0000u)));
}

/* sixteen floats already rounded by bf16_round16 → their bfloat16 */
static inline __m256i bf16_narrow16(__m512 rounded) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
}
#endif

#endif
