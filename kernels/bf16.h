/* bfloat16 <-> float32 for the CPU kernels: a bfloat16 is the top half of a float32. */
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

#endif
