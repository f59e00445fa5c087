/* bfloat16 linears on the CPU: out = x w^T + bias, each output one float32 sum over the input columns in one order
   whatever the batch, the bias added in float32 and the result rounded to bfloat16 once, as a bfloat16 matmul with
   float32 accumulation does. Built and loaded by kernels/native.py; gpu_worker/packed_linear.py calls it.

   Why not oneDNN's bfloat16 matmul: its sums take an order that depends on the number of rows, so a sequence's
   bfloat16 tokens changed with the sequences beside it and when a restarted worker recomputed its prefix; and
   where the CPU has no native bfloat16, torch falls back to a slow path.

   Three ways (bf16_linear's `way`), with two weight layouts, packed here (`bf16_pack`):
   - AMX tiles, where the CPU has them (Sapphire Rapids and later) and the kernel lets this process use them
     (`bf16_amx`). The pairs' layout: the weight in panels of 16 output columns, each [kp / 2][16][2] (the pairs of
     input columns that `tdpbf16ps` multiplies together), kp = k padded with zeros to a multiple of 32, n to whole
     pairs of panels; a tile of 16 input rows × 32 input columns against a panel's 16 × 32 adds into 16 × 16
     float32 sums, 32 columns at a time in order. An output's sums depend only on its row and column, whatever
     tile row or batch they are in.
   - AVX-512 BF16's `vdpbf16ps` (`bf16_dp`; Zen 4 and later, Cooper Lake and later), taken where AMX is not: the
     pairs' layout, one instruction adding a pair of products into each of 16 float32 sums, a tile of up to DP_ROWS
     input rows × two panels keeping its sums in registers. At one row, the bits of oneDNN's own bfloat16 matmul on
     such a CPU.
   - Elsewhere, fused multiply-adds in float32: the weight in panels of PANEL output columns, [k][PANEL], each
     row widened in registers; a tile of up to ROWS input rows × TILE_PANELS panels keeps its sums in registers
     (16 lanes at a time and two panels with AVX-512, 8 lanes and one with AVX2: the same bits).

   Layouts: x [m, k] bfloat16 with a row stride; w [n, k] bfloat16 contiguous (to pack); bias [n] bfloat16 or
   NULL; out [m, n] bfloat16 contiguous.

   float32 linears (`f32_linear`, `f32_pack`) take the fused multiply-adds' way and layout on float32 weights: where
   measured faster than MKL's float32 GEMM (`f32_linear_preferred`), which at a decode step's few rows runs at a
   third of its one-row speed per row. Same layouts, in float32. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "bf16.h"

#if defined(__AVX2__) || defined(__FMA__) /* fmadd's intrinsics */
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef __AVX512F__
#include "silu.h"
#endif

#define PANEL 16 /* output columns per panel: one vector of 16 or two of 8, or one AMX tile's columns */
#ifdef __AVX512F__
#define LANES 16
#define ROWS 12       /* input rows per tile: 24 accumulators, 2 weight vectors and a broadcast in 32 registers */
#define TILE_PANELS 2 /* panels per tile: each broadcast input serves two fused multiply-adds */
#else
#define LANES 8
#define ROWS 6 /* input rows per tile: 12 accumulators, 2 widened weight vectors and a broadcast in 16 registers */
#define TILE_PANELS 1
#endif
#define VECS (PANEL / LANES) /* vectors per panel row */
/* `REST(r)` for each count of rows below ROWS: a tile's rows are a constant in each case, so loops over them unroll */
#if ROWS == 12
#define REST_CASES REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#elif ROWS == 6
#define REST_CASES REST(1) REST(2) REST(3) REST(4) REST(5)
#else
#error "REST_CASES lists the counts below ROWS"
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
#define TILE_K 32 /* input columns per AMX tile row: 64 bytes of bfloat16 */
#define INLINE static inline __attribute__((always_inline))

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* How many values apart the kernels' copies of input rows of k values lie, `per_line` values to a 64-byte line: an
   odd number of lines, so that a tile's rows fall in different sets of L1 (rows 4 KiB apart, as 2,048 bfloat16
   inputs are, all fell in the same sets and took 1.6x the time). */
static int64_t copy_stride(int64_t k, int64_t per_line) { return (round_up(k, per_line) / per_line | 1) * per_line; }

/* x's m rows of k values (`size` bytes each, rows x_row values apart) into a copy at `*copy` (the caller frees it),
   copy_stride values apart, each row padded with zeros; the stride, or 0 when the copy cannot be allocated. */
static int64_t copy_rows(const void *x, int64_t x_row, int64_t m, int64_t k, size_t size, void **copy) {
    const int64_t stride = copy_stride(k, 64 / (int64_t)size);
    char *to = *copy = malloc((size_t)(m * stride) * size);
    if (!to) return 0;
    for (int64_t i = 0; i < m; i++) {
        memcpy(to + i * stride * size, (const char *)x + i * x_row * size, (size_t)k * size);
        memset(to + (i * stride + k) * size, 0, (size_t)(stride - k) * size);
    }
    return stride;
}

/* ---- fused multiply-adds in float32 ---- */

/* LANES bfloat16 widened to float32 */
INLINE vf widen(const uint16_t *p) {
#ifdef __AVX512F__
    return (vf)bf16_widen16(p);
#elif defined(__AVX2__) /* one vpmovzxwd from memory, where gcc's generic widening splits it in halves */
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

/* acc + x * w, one rounding a lane: spelled out, so that the bits of AVX2 and AVX-512 builds agree whatever the
   compiler's -ffp-contract (without FMA hardware the product rounds first, and the bits are that build's own). */
INLINE vf fmadd(float x, vf w, vf acc) {
#ifdef __AVX512F__
    return (vf)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps(_mm256_set1_ps(x), (__m256)w, (__m256)acc);
#else
    return acc + x * w;
#endif
}

/* LANES weights of a panel at `at`: float32 where f32, else bfloat16 widened. */
INLINE vf weights(const void *panel, int64_t at, int f32) {
    if (!f32) return widen((const uint16_t *)panel + at);
    vf w;
    memcpy(&w, (const float *)panel + at, sizeof w);
    return w;
}

/* Input rows [i0, i0 + rows) of x (float32, x_row apart) against `np` panels from `panel` (1 or TILE_PANELS),
   whose outputs are columns [n0, n0 + np × PANEL) of out; the panels, bias and out float32 where f32, else
   bfloat16. `next` (or NULL): the panels to prefetch into L2 meanwhile, so that a decode step's few rows do not
   wait on memory for each panel. */
INLINE void tile(const float *restrict x, int64_t x_row, int64_t k, const void *restrict panel, int64_t i0,
                 int64_t rows, int np, const void *restrict bias, void *restrict out, int64_t n, int64_t n0,
                 const char *next, int f32) {
    vf acc[ROWS][TILE_PANELS][VECS] = {{{{0}}}};
    const float *restrict xr = x + i0 * x_row;
    const int64_t line = f32 ? 1 : 2; /* input columns per 64-byte line of a panel */
    const int64_t bytes = k * PANEL * (f32 ? sizeof(float) : sizeof(uint16_t)); /* a panel's */
    for (int64_t d = 0; d < k; d++) {
        vf w[TILE_PANELS][VECS];
        for (int h = 0; h < np; h++)
            for (int v = 0; v < VECS; v++) w[h][v] = weights(panel, h * k * PANEL + d * PANEL + v * LANES, f32);
        if (next && d % line == 0)
            for (int h = 0; h < np; h++) __builtin_prefetch(next + h * bytes + d * 64 / line, 0, 2);
        for (int64_t i = 0; i < rows; i++)
            for (int h = 0; h < np; h++)
                for (int v = 0; v < VECS; v++) acc[i][h][v] = fmadd(xr[i * x_row + d], w[h][v], acc[i][h][v]);
    }
    for (int h = 0; h < np; h++) {
        const int64_t c0 = n0 + h * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
        for (int64_t i = 0; i < rows; i++) {
            float sums[PANEL];
            memcpy(sums, acc[i][h], sizeof acc[i][h]);
            const int64_t at = (i0 + i) * n + c0;
            for (int64_t c = 0; c < cols; c++) {
                if (f32) {
                    ((float *)out)[at + c] = bias ? sums[c] + ((const float *)bias)[c0 + c] : sums[c];
                } else {
                    const float b = bias ? from_bf16(((const uint16_t *)bias)[c0 + c]) : 0;
                    ((uint16_t *)out)[at + c] = to_bf16(bias ? sums[c] + b : sums[c]);
                }
            }
        }
    }
}

/* Every input row against panels [p, p + np): the panels stay in cache while the rows stream by; the first tile
   prefetches the next ones. */
INLINE void tile_rows(const float *x, int64_t x_row, const void *panels, const void *bias, void *out, int64_t m,
                      int64_t n, int64_t k, int64_t p, int np, int f32) {
    const int64_t bytes = k * PANEL * (f32 ? sizeof(float) : sizeof(uint16_t));
    const char *panel = (const char *)panels + p * bytes;
    const char *next = p + np < (n + PANEL - 1) / PANEL ? panel + np * bytes : 0; /* past the end: harmless */
    int64_t i = 0;
    for (; i + ROWS <= m; i += ROWS, next = 0)
        tile(x, x_row, k, panel, i, ROWS, np, bias, out, n, p * PANEL, next, f32);
#define REST(r) case r: tile(x, x_row, k, panel, i, r, np, bias, out, n, p * PANEL, next, f32); break;
    switch (m - i) { REST_CASES } /* the rest as a constant count, so that the compiler unrolls the loop over rows */
#undef REST
}

/* Panels [p, p + TILE_PANELS), or the last one alone, as constants: both counts unroll. */
INLINE void panel_rows(const float *x, int64_t x_row, const void *panels, const void *bias, void *out, int64_t m,
                       int64_t n, int64_t k, int64_t p, int f32) {
    if ((n + PANEL - 1) / PANEL - p >= TILE_PANELS)
        tile_rows(x, x_row, panels, bias, out, m, n, k, p, TILE_PANELS, f32);
    else
        tile_rows(x, x_row, panels, bias, out, m, n, k, p, 1, f32);
}

/* panel_rows compiled once per weight type: the type is a constant inside, the loop over panels shared */
typedef void panel_fn(const float *, int64_t, const void *, const void *, void *, int64_t, int64_t, int64_t, int64_t);
static void panel_rows_bf16(const float *x, int64_t x_row, const void *panels, const void *bias, void *out,
                            int64_t m, int64_t n, int64_t k, int64_t p) {
    panel_rows(x, x_row, panels, bias, out, m, n, k, p, 0);
}
static void panel_rows_f32(const float *x, int64_t x_row, const void *panels, const void *bias, void *out, int64_t m,
                           int64_t n, int64_t k, int64_t p) {
    panel_rows(x, x_row, panels, bias, out, m, n, k, p, 1);
}

static void fma_linear(panel_fn *rows_of, const float *x, int64_t x_row, const void *panels, const void *bias,
                       void *out, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t count = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t p = 0; p < count; p += TILE_PANELS) rows_of(x, x_row, panels, bias, out, m, n, k, p);
}

/* bfloat16 inputs, widened once (each is read by every panel) into a copy (copy_stride) */
static int fma_linear_bf16(const uint16_t *x, int64_t x_row, const uint16_t *panels, const uint16_t *bias,
                           uint16_t *out, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t stride = copy_stride(k, 16);
    float *xf = malloc((size_t)(m * stride) * sizeof *xf);
    if (!xf) return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t d = 0; d < k; d++) xf[i * stride + d] = from_bf16(x[i * x_row + d]);
    fma_linear(panel_rows_bf16, xf, stride, panels, bias, out, m, n, k, threads);
    free(xf);
    return 0;
}

/* ---- the pairs' layout: AMX tiles and AVX-512 BF16 dot products ---- */

#ifdef __AVX512F__
/* Where finished sums of the pairs' layout go: out [m, n], the bias per packed column (or NULL). Gated: the
   panels come in pairs, a gate's 16 columns then the same 16 of up (gpu_worker/packed_linear.py
   interleaves them), and out takes silu(gate) * up (kernels/silu.h) of each pair, out column = packed column / 2. */
typedef struct {
    const uint16_t *bias;
    uint16_t *out;
    int64_t m, n;
    int gated;
} bf16_out;

/* Panels of the packed weight: n's, padded to a multiple of 16, twice over when gated (gate's and up's). */
INLINE int64_t packed_panels(const bf16_out *o) { return round_up(o->n, PANEL) / PANEL * (o->gated ? 2 : 1); }

/* A row's 16 bfloat16 to out, the `cols` of them that exist. */
INLINE void store_row(uint16_t *dst, __m256i h, int64_t cols) {
    if (cols == PANEL) {
        _mm256_storeu_si256((void *)dst, h);
    } else {
        uint16_t lanes[PANEL];
        _mm256_storeu_si256((void *)lanes, h);
        memcpy(dst, lanes, (size_t)cols * sizeof *dst);
    }
}

/* `rows` rows of sums (16 columns, from row0 and col0) to out, rounded once with the bias, the columns that exist. */
INLINE void store_sums(const float (*sums)[PANEL], int64_t rows, int64_t row0, int64_t col0, const bf16_out *o) {
    const int64_t n = o->n, cols = n - col0 < PANEL ? n - col0 : PANEL;
    if (cols <= 0) return; /* the padding panel of an odd count, read in pairs */
    uint16_t bias[PANEL] = {0}; /* the columns that exist: bias has n */
    for (int64_t c = 0; o->bias && c < cols; c++) bias[c] = o->bias[col0 + c];
    const __m512 b = bf16_widen16(bias);
    for (int64_t i = 0; i < rows; i++) {
        __m512 s = _mm512_loadu_ps(sums[i]);
        if (o->bias) s = _mm512_add_ps(s, b);
        store_row(o->out + (row0 + i) * n + col0, bf16_narrow16(bf16_round16(s)), cols);
    }
}

/* `rows` rows of a gated pair's sums (gate's, then up's, the gate's at packed column col0) to out: each rounded
   with its bias as store_sums rounds it, then silu(gate) * up: the bits of the projection and kernels/cpu_act.c
   apart. */
INLINE void store_gated(const float (*gate)[PANEL], const float (*up)[PANEL], int64_t rows, int64_t row0,
                        int64_t col0, const bf16_out *o) {
    const int64_t n = o->n, at = col0 / 2, cols = n - at < PANEL ? n - at : PANEL;
    const __m512 bg = o->bias ? bf16_widen16(o->bias + col0) : _mm512_setzero_ps();
    const __m512 bu = o->bias ? bf16_widen16(o->bias + col0 + PANEL) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i++) {
        __m512 g = _mm512_loadu_ps(gate[i]), u = _mm512_loadu_ps(up[i]);
        if (o->bias) g = _mm512_add_ps(g, bg), u = _mm512_add_ps(u, bu);
        store_row(o->out + (row0 + i) * n + at, silu_mul16(bf16_round16(g), bf16_round16(u)), cols);
    }
}

#endif

/* ---- AVX-512 BF16 dot products ---- */

#ifdef __AVX512BF16__
#define DP_ROWS 14 /* input rows per tile: 28 accumulators, 2 weight vectors and a broadcast in 32 registers */
#define DP_REST_CASES \
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11) REST(12) REST(13)
_Static_assert(DP_ROWS == 14, "DP_REST_CASES lists the counts below DP_ROWS");
/* Input rows [i0, i0 + rows) of x (bfloat16, k padded to even with a zero) against panels p and p + 1 of the
   pairs' layout (each one's [kp / 2][16][2]; the layout pads n to whole pairs of panels), whose outputs are packed
   columns [col0, col0 + 32) (gated: a gate's 16 and the same 16 of up): vdpbf16ps adds a pair of products into
   each float32 sum, the pairs in order whatever the batch. Two panels, so that each broadcast input pair serves two
   dot products. `next` (or NULL): the next two panels, prefetched into L2 meanwhile. */
INLINE void dp_tile(const uint16_t *restrict x, int64_t x_row, int64_t pairs, int64_t kp,
                    const uint16_t *restrict panel, int64_t i0, int64_t rows, int64_t col0, const char *next,
                    const bf16_out *o) {
    __m512 acc[DP_ROWS][2];
    for (int64_t i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint16_t *restrict xr = x + i0 * x_row;
    const uint16_t *restrict other = panel + kp * PANEL;
    for (int64_t q = 0; q < pairs; q++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(other + q * 2 * PANEL);
        if (next) {
            __builtin_prefetch(next + q * 64, 0, 2);
            __builtin_prefetch(next + kp * PANEL * 2 + q * 64, 0, 2);
        }
        for (int64_t i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, xr + i * x_row + 2 * q, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
    float sums[2][DP_ROWS][PANEL] __attribute__((aligned(64)));
    for (int64_t i = 0; i < rows; i++) _mm512_store_ps(sums[0][i], acc[i][0]), _mm512_store_ps(sums[1][i], acc[i][1]);
    if (o->gated) {
        store_gated(sums[0], sums[1], rows, i0, col0, o);
    } else {
        store_sums(sums[0], rows, i0, col0, o);
        store_sums(sums[1], rows, i0, col0 + PANEL, o);
    }
}

/* Every input row against panels p and p + 1 (of `count` in all: `next` stays within them), as panel_rows does
   for the fused multiply-adds. */
static void dp_panel_rows(const uint16_t *x, int64_t x_row, int64_t k, const uint16_t *panels, int64_t p,
                          int64_t count, const bf16_out *o) {
    const int64_t kp = round_up(k, TILE_K), pairs = (k + 1) / 2, m = o->m;
    const uint16_t *panel = panels + p * kp * PANEL;
    const char *next = p + 2 < count ? (const char *)(panel + 2 * kp * PANEL) : 0;
    int64_t i = 0;
    for (; i + DP_ROWS <= m; i += DP_ROWS, next = 0)
        dp_tile(x, x_row, pairs, kp, panel, i, DP_ROWS, p * PANEL, next, o);
#define REST(r) case r: dp_tile(x, x_row, pairs, kp, panel, i, r, p * PANEL, next, o); break;
    switch (m - i) { DP_REST_CASES }
#undef REST
}

static int dp_linear(const uint16_t *x, int64_t x_row, const uint16_t *panels, const bf16_out *o, int64_t k,
                     int threads) {
    void *xs; /* the rows copied, each padded with zeros: an odd k's last pair gets its zero */
    const int64_t stride = copy_rows(x, x_row, o->m, k, sizeof *x, &xs);
    if (!stride) return -1;
    const int64_t count = packed_panels(o);
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t p = 0; p < count; p += 2) dp_panel_rows(xs, stride, k, panels, p, count, o);
    free(xs);
    return 0;
}
#endif

/* ---- AMX tiles ---- */

#ifdef HAVE_AMX

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the AMX state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM). */
static int amx_permitted(void) {
    static int permitted = -1; /* a race here computes the same answer twice */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18 /* XFEATURE_XTILEDATA */) == 0;
    return permitted;
}

/* A tile of sums (16 rows × 16 columns, from row0 and col0) to out: the rows that exist. */
INLINE void amx_store(const float sums[16][PANEL], int64_t row0, int64_t col0, const bf16_out *o) {
    store_sums(sums, o->m - row0 < 16 ? o->m - row0 : 16, row0, col0, o);
}

/* A gated pair of tiles (gate's sums, then up's, the gate's at packed column col0) to out: the rows that exist. */
INLINE void amx_store_gated(const float gate[16][PANEL], const float up[16][PANEL], int64_t row0, int64_t col0,
                            const bf16_out *o) {
    store_gated(gate, up, o->m - row0 < 16 ? o->m - row0 : 16, row0, col0, o);
}

#define AHEAD 8 /* chunks of a panel prefetched ahead of its loads: 8 KiB, enough to keep memory streaming */

INLINE void prefetch_chunk(const uint16_t *chunk) {
    for (int line = 0; line < 16; line++) __builtin_prefetch(chunk + line * 32, 0, 3);
}

#define SLICE 8 /* chunks per slice of the input columns: 4 row blocks' slice is 32 KiB, kept in L1 */
#define BLOCK_BYTES (768 * 1024) /* a block of panels, kept in L2 while every row group multiplies it */

/* A panel's partial sums: 4 tiles of 16 rows × 16 columns, parked between slices. */
typedef float amx_part[4][16][PANEL];

/* Tile t of a finished panel's sums (of a gated pair's, `done` its gate's and done + 1 its up's) to out. */
INLINE void amx_finish(const amx_part *done, int t, int64_t row0, int64_t col0, const bf16_out *o) {
    if (o->gated)
        amx_store_gated(done[0][t], done[1][t], row0 + 16 * t, col0, o);
    else
        amx_store(done[0][t], row0 + 16 * t, col0, o);
}

/* Chunks [d0, d1) of `blocks` row blocks (1 to 4) of the copy xs from a, against one panel b: tiles 0-3 the
   sums, taken from `part` (zero at the first slice) and put back, 6 the panel's chunk, 4, 5 and 7 the rows' (4
   again for a fourth block). Chunk d of a row block is its 16 rows × 32 columns, 1 KiB at a + 16 (block kp + 32
   d); of a panel, 16 pairs × 16 columns at b + 512 d, while chunk d at `ahead` is fetched into L2 for what comes
   next (into L1 it evicted the rows' slice: 1.05x the time at 2,048 rows; a prefetch past the weight's end is
   harmless). An earlier panel's (or gated pair's) finished sums (`done`, or NULL) are rounded to out a tile per
   chunk meanwhile, on the vector units while the tiles multiply. */
INLINE void amx_slice(const uint16_t *a, int64_t kp, const uint16_t *b, const uint16_t *ahead, int blocks,
                      int64_t d0, int64_t d1, amx_part *part, const amx_part *done, int64_t row0, int64_t done_col0,
                      const bf16_out *o) {
    const int64_t step = TILE_K * 16; /* elements per chunk of a row block or a panel */
    if (d0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else { /* float32 sums out and back in unchanged: the order over the chunks is the unsliced one */
        _tile_loadd(0, (*part)[0], PANEL * 4);
        _tile_loadd(1, (*part)[1], PANEL * 4);
        _tile_loadd(2, (*part)[2], PANEL * 4);
        _tile_loadd(3, (*part)[3], PANEL * 4);
    }
    for (int64_t d = d0; d < d1; d++) {
        for (int line = 0; line < 16; line++) __builtin_prefetch(ahead + d * step + line * 32, 0, 2); /* L2 */
        _tile_loadd(6, b + d * step, 64);
        _tile_loadd(4, a + d * step, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (blocks > 1) {
            _tile_loadd(5, a + kp * 16 + d * step, 64);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (blocks > 2) {
            _tile_loadd(7, a + 2 * kp * 16 + d * step, 64);
            _tile_dpbf16ps(2, 7, 6);
        }
        if (blocks > 3) {
            _tile_loadd(4, a + 3 * kp * 16 + d * step, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        if (done && d - d0 < blocks) amx_finish(done, (int)(d - d0), row0, done_col0, o);
    }
    for (int64_t t = d1 - d0; done && t < blocks; t++) amx_finish(done, (int)t, row0, done_col0, o);
    _tile_stored(0, (*part)[0], PANEL * 4);
    _tile_stored(1, (*part)[1], PANEL * 4);
    _tile_stored(2, (*part)[2], PANEL * 4);
    _tile_stored(3, (*part)[3], PANEL * 4);
}

/* Panels [p0, p1) (`part` holds a partial sum per panel) against every row block: row groups of 4 blocks in
   turn, each in slices of the input columns, the slice against every panel of the block. So the panels stream
   from L2 and the rows' slice from L1, where a row group against one panel over all columns read its rows from
   L2 (slower at a prefill's many rows). */
INLINE void amx_block(const uint16_t *xs, int64_t kp, int64_t blocks, const uint16_t *panels, int64_t p0,
                      int64_t p1, amx_part *part, const bf16_out *o) {
    const int64_t chunks = kp / TILE_K, step = TILE_K * 16;
    /* one row group (decode steps) reads each panel once: not sliced, the panels stream from memory one after
       the other, fetched AHEAD chunks ahead; sliced, the next panel's slice is the one fetched */
    const int64_t slice = blocks > 4 ? SLICE : chunks;
    for (int64_t r = 0; r < blocks; r += 4) {
        const int rows = blocks - r < 4 ? (int)(blocks - r) : 4;
        for (int64_t d0 = 0; d0 < chunks; d0 += slice) {
            const int64_t d1 = d0 + slice < chunks ? d0 + slice : chunks;
            for (int64_t p = p0; p < p1; p++) { /* at the last slice, each panel rounds the one (pair) before */
                const uint16_t *b = panels + p * kp * PANEL;
                const int64_t before = o->gated ? ((p - p0) % 2 ? 0 : 2) : 1;
                const amx_part *done = d1 == chunks && before && p - p0 >= before ? part + (p - before - p0) : NULL;
                amx_slice(xs + r * kp * 16, kp, b, slice == chunks ? b + AHEAD * step : b + kp * PANEL, rows, d0,
                          d1, part + (p - p0), done, r * 16, (p - before) * PANEL, o);
            }
        }
        const int64_t last = p1 - (o->gated ? 2 : 1);
        for (int t = 0; t < rows; t++) amx_finish(part + (last - p0), t, r * 16, last * PANEL, o);
    }
}

/* One row block (up to 16 rows: decode steps) against panels p and p + 1, two streams from memory at once, which
   a row block alone needs to keep memory busy: tiles 0-1 the sums, 4 the rows, 6-7 the panels. */
INLINE void amx_two_panels(const uint16_t *xs, int64_t kp, const uint16_t *panels, int64_t p, const bf16_out *o) {
    const int64_t step = TILE_K * 16;
    const uint16_t *b0 = panels + p * kp * PANEL, *b1 = b0 + kp * PANEL;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t d = 0; d < kp / TILE_K; d++) {
        prefetch_chunk(b0 + (d + AHEAD) * step);
        prefetch_chunk(b1 + (d + AHEAD) * step);
        _tile_loadd(4, xs + d * step, 64);
        _tile_loadd(6, b0 + d * step, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + d * step, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    float sums[2][16][PANEL] __attribute__((aligned(64)));
    _tile_stored(0, sums[0], PANEL * 4);
    _tile_stored(1, sums[1], PANEL * 4);
    if (o->gated) {
        amx_store_gated(sums[0], sums[1], 0, p * PANEL, o);
    } else {
        amx_store(sums[0], 0, p * PANEL, o);
        amx_store(sums[1], 0, (p + 1) * PANEL, o);
    }
}

static int amx_linear(const uint16_t *x, int64_t x_row, const uint16_t *panels, const bf16_out *o, int64_t k,
                      int threads) {
    /* the rows copied in tile order, zero-padded to whole row blocks and whole tile rows: every tile is one KiB
       in a row, every load in bounds, and the padding adds exact zeros */
    const int64_t m = o->m, kp = round_up(k, TILE_K), blocks = round_up(m, 16) / 16;
    const int64_t count = packed_panels(o);
    /* panels per block: at most BLOCK_BYTES, in a number of blocks the threads share evenly; whole gated pairs */
    const int64_t most = BLOCK_BYTES / (kp * PANEL * 2) > 2 ? BLOCK_BYTES / (kp * PANEL * 2) : 2;
    const int64_t shares = round_up((count + most - 1) / most, threads);
    const int64_t width = round_up((count + shares - 1) / shares, o->gated ? 2 : 1);
    uint16_t *xs = aligned_alloc(64, (size_t)(blocks * 16 * kp) * sizeof *xs);
    amx_part *parts = blocks > 1 ? aligned_alloc(64, (size_t)(threads * width) * sizeof *parts) : NULL;
    if (!xs || (blocks > 1 && !parts)) {
        free(xs);
        free(parts);
        return -1;
    }
    for (int64_t i = 0; i < blocks * 16; i++)
        for (int64_t d = 0; d < kp; d += TILE_K) {
            uint16_t *dst = xs + (i / 16) * kp * 16 + d * 16 + (i % 16) * TILE_K;
            const int64_t valid = i >= m ? 0 : k - d < TILE_K ? k - d : TILE_K;
            if (valid) memcpy(dst, x + i * x_row + d, (size_t)valid * sizeof *dst);
            memset(dst + valid, 0, (size_t)(TILE_K - valid) * sizeof *dst);
        }
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        tile_config config = {.palette = 1};
        for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
        _tile_loadconfig(&config);
        if (blocks == 1) {
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p += 2) amx_two_panels(xs, kp, panels, p, o);
        } else {
            amx_part *part = parts + (size_t)omp_get_thread_num() * width;
            #pragma omp for schedule(static)
            for (int64_t p0 = 0; p0 < count; p0 += width)
                amx_block(xs, kp, blocks, panels, p0, p0 + width < count ? p0 + width : count, part, o);
        }
        _tile_release();
    }
    free(parts);
    free(xs);
    return 0;
}
#endif

/* ---- the entry points ---- */

/* Whether this process may multiply with AMX tiles: the CPU has them, the build knows them, Linux grants them. */
int bf16_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Whether this build multiplies with AVX-512 BF16's vdpbf16ps (Zen 4 and later, Cooper Lake and later). */
int bf16_dp(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* How many values (bfloat16, or float32 for f32_pack) the packed [n, k] weight takes, in the pairs' layout (pairs:
   AMX tiles and vdpbf16ps) or the fused multiply-adds'. */
int64_t packed_size(int64_t n, int64_t k, int pairs) {
    return pairs ? round_up(n, 2 * PANEL) * round_up(k, TILE_K) : round_up(n, PANEL) * k;
}

/* Where w[row][d] lies in the packed weight: panel p = row / PANEL, column c = row % PANEL; in the pairs' layout at
   pair d / 2, half d % 2 of panel p's [kp / 2][PANEL][2], else at input column d of its [k][PANEL]. */
INLINE int64_t packed_at(int64_t row, int64_t d, int64_t k, int pairs) {
    const int64_t p = row / PANEL, c = row % PANEL;
    if (pairs) return p * round_up(k, TILE_K) * PANEL + (d / 2) * 2 * PANEL + c * 2 + d % 2;
    return (p * k + d) * PANEL + c;
}

/* w [n, k] of `size`-byte values into `packed` (packed_size values) in the pairs' layout or not, the padding (to
   whole panels, or in pairs: pairs of panels and tile rows) zero. */
INLINE void pack(const void *w, int64_t n, int64_t k, void *packed, int pairs, size_t size) {
    const int64_t rows = pairs ? round_up(n, 2 * PANEL) : round_up(n, PANEL), cols = pairs ? round_up(k, TILE_K) : k;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t d = 0; d < cols; d++) {
            char *to = (char *)packed + packed_at(row, d, k, pairs) * size;
            if (row < n && d < k) memcpy(to, (const char *)w + (row * k + d) * size, size);
            else memset(to, 0, size);
        }
}

/* out [count, k] = the rows `ids` of a weight packed in the pairs' layout or not (a tied model's token embedding,
   read from its lm_head). Returns 0, or -1 when an id is not in [0, n) (out then undefined). */
INLINE int unpack_rows(const void *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out,
                       int pairs, size_t size) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < count; i++)
        for (int64_t d = 0; d < k; d++)
            memcpy((char *)out + (i * k + d) * size, (const char *)packed + packed_at(ids[i], d, k, pairs) * size,
                   size);
    return 0;
}

/* bf16_linear's weight: bfloat16 w [n, k] packed in the pairs' layout (AMX tiles, vdpbf16ps) or the fused
   multiply-adds' */
void bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int pairs) {
    pack(w, n, k, packed, pairs, sizeof *w);
}

int bf16_unpack_rows(const uint16_t *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out,
                     int pairs) {
    return unpack_rows(packed, n, k, ids, count, out, pairs, sizeof *out);
}

/* f32_linear's weight: float32 w [n, k] packed for fused multiply-adds */
void f32_pack(const float *w, int64_t n, int64_t k, float *packed) { pack(w, n, k, packed, 0, sizeof *w); }

int f32_unpack_rows(const float *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    return unpack_rows(packed, n, k, ids, count, out, 0, sizeof *out);
}

enum { WAY_FMA, WAY_AMX, WAY_DP }; /* bf16_linear's ways (kernels/native.py: LINEAR_WAYS) */

/* out [m, n] = x w^T + bias, the weight packed by bf16_pack in the way's layout (the pairs' for WAY_AMX and
   WAY_DP); gated (those two ways): out [m, n] = silu(gate) * up of the merged gate|up projection, its weight
   [2 n16, k] and bias [2 n16] interleaved in pairs of 16 rows (gate's, then up's; n16 = n padded to a multiple of
   16, the padding zeros). Returns 0; -1 when a copy of the input cannot be allocated; -2 when a way is asked for
   that this process cannot take; -3 when gated in the fused multiply-adds' way. */
int bf16_linear(const uint16_t *x, int64_t x_row, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                int64_t m, int64_t n, int64_t k, int threads, int way, int gated) {
    if ((way == WAY_AMX && !bf16_amx()) || (way == WAY_DP && !bf16_dp()) || way < WAY_FMA || way > WAY_DP) return -2;
    if (gated && way == WAY_FMA) return -3;
    if (m <= 0 || n <= 0) return 0;
#if defined(HAVE_AMX) || defined(__AVX512BF16__)
    const bf16_out o = {.bias = bias, .out = out, .m = m, .n = n, .gated = gated};
#endif
#ifdef HAVE_AMX
    if (way == WAY_AMX) return amx_linear(x, x_row, packed, &o, k, threads);
#endif
#ifdef __AVX512BF16__
    if (way == WAY_DP) return dp_linear(x, x_row, packed, &o, k, threads);
#endif
    return fma_linear_bf16(x, x_row, packed, bias, out, m, n, k, threads);
}

/* Whether f32_linear was measured faster than torch's float32 linear (MKL) here, for the ~100M Llama's shapes and
   a whole decode step: with AVX2 and FMA, or AVX-512 (benchmarks/results/cpu-efficiency-log-2026-12.md). */
int f32_linear_preferred(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x w^T + bias in float32, x [m, k] with rows x_row apart, the weight packed by f32_pack, bias [n] or
   NULL: each output one chain of multiply-adds (fused, where the CPU has FMA) over its input columns in order,
   whatever the batch. Returns 0, or -1 when the copy of the input cannot be allocated. */
int f32_linear(const float *x, int64_t x_row, const float *packed, const float *bias, float *out, int64_t m,
               int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (m == 1) { /* one row: no tile rows to collide in L1 */
        fma_linear(panel_rows_f32, x, x_row, packed, bias, out, m, n, k, threads);
        return 0;
    }
    void *xs;
    const int64_t stride = copy_rows(x, x_row, m, k, sizeof *x, &xs);
    if (!stride) return -1;
    fma_linear(panel_rows_f32, xs, stride, packed, bias, out, m, n, k, threads);
    free(xs);
    return 0;
}
