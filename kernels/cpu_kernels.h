/* The CPU kernels' entry points: the one definition of their ABI. Every kernels/cpu_*.c includes it, so the
   compiler refuses a definition that differs from its prototype here, and kernels/native.py types its ctypes calls
   from these prototypes (types: void, int, int64_t, float, and pointers). What each computes is said where it is
   defined. dtype arguments: 0 float32, 1 bfloat16. */
#ifndef PAGEDSERVE_CPU_KERNELS_H
#define PAGEDSERVE_CPU_KERNELS_H
#include <stdint.h>

/* kernels/cpu_attention.c */
int paged_attention(int dtype, const void *q, int64_t q_row, int64_t q_head, const void *kc, const void *vc, void *o,
                    int64_t o_row, int64_t o_head, const int32_t *tables, int64_t table_row, const int64_t *tasks,
                    int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                    int threads);

/* kernels/cpu_linear.c */
int bf16_amx(void);
int bf16_dp(void);
int64_t packed_size(int64_t n, int64_t k, int pairs);
void bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int pairs);
int bf16_unpack_rows(const uint16_t *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out,
                     int pairs);
int bf16_linear(const uint16_t *x, int64_t x_row, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                int64_t m, int64_t n, int64_t k, int threads, int way, int gated);
int f32_linear_preferred(void);
void f32_pack(const float *w, int64_t n, int64_t k, float *packed);
int f32_unpack_rows(const float *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out);
int f32_linear(const float *x, int64_t x_row, const float *packed, const float *bias, float *out, int64_t m,
               int64_t n, int64_t k, int threads);

/* kernels/cpu_norm.c */
void bf16_rms_norm(const uint16_t *x, int64_t x_row, const uint16_t *w, uint16_t *out, int64_t m, int64_t n,
                   float eps);

/* kernels/cpu_act.c */
int bf16_silu_mul_vectorized(void);
void bf16_silu_mul(const uint16_t *x, int64_t x_row, uint16_t *out, int64_t m, int64_t n);

/* kernels/cpu_rotary.c */
int bf16_rotary_vectorized(void);
int bf16_rotary(const uint16_t *x, int64_t x_row, int64_t heads, int64_t dim, const uint16_t *cos,
                const uint16_t *sin, int64_t cs_row, uint16_t *out, int64_t tokens);

/* kernels/cpu_argmax.c */
int rows_argmax(int dtype, const void *x, int64_t row_stride, int64_t rows, int64_t cols, int64_t *out);

/* kernels/cpu_mask.c */
int rows_mask_bits(int dtype, void *logits, int64_t row_stride, int64_t cols, int64_t count, const int64_t *rows,
                   const uint32_t *words, int64_t words_per_row);

#endif
