/* bfloat16 linears on the CPU: out = x w^T + bias, each output one float32 sum over the input columns in one order
   whatever the batch, the bias added in float32 and the result rounded to bfloat16 once, as a bfloat16 matmul with
   float32 accumulation does. Built and loaded by kernels/native.py; gpu_worker/packed_linear.py calls it.

   Why not oneDNN's bfloat16 matmul: its sums take an order that depends on the number of rows, so a sequence's
   bfloat16 tokens changed with the sequences beside it and when a restarted worker recomputed its prefix; and
   where the CPU has no native bfloat16, torch falls back to a slow path.

   Two ways, chosen once per process (`bf16_amx`), with a weight layout each, packed here (`bf16_pack`):
   - AMX tiles, where the CPU has them (Sapphire Rapids and later) and the kernel lets this process use them.
     The weight in panels of 16 output columns, each [kp / 2][16][2] (the pairs of input columns that
     `tdpbf16ps` multiplies together), kp = k padded with zeros to a multiple of 32, n to whole pairs of panels;
     a tile of 16 input rows × 32 input columns against a panel's 16 × 32 adds into 16 × 16 float32 sums, 32
     columns at a time in order. An output's sums depend only on its row and column, whatever tile row or batch
     they are in.
   - Elsewhere, fused multiply-adds in float32: the weight in panels of PANEL output columns, [k][PANEL], each
     row widened in registers; a tile of up to ROWS input rows × PANEL outputs keeps its sums in registers.

   Layouts: x [m, k] bfloat16 with a row stride; w [n, k] bfloat16 contiguous (to pack); bias [n] bfloat16 or
   NULL; out [m, n] bfloat16 contiguous.

   float32 linears (`f32_linear`, `f32_pack`) take the fused multiply-adds' way and layout on float32 weights: where
   the build has AVX2 without AVX-512 they beat MKL's float32 GEMM, which at a decode step's few rows runs at a
   third of its one-row speed per row (`f32_linear_preferred`). Same layouts, in float32. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "silu.h"
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#define PANEL 16 /* output columns per panel: two vectors of 8, or one tile's columns */
#define ROWS 6   /* input rows per tile: 12 accumulators, 2 widened weight vectors and a broadcast in 16 registers */
#define TILE_K 32 /* input columns per AMX tile row: 64 bytes of bfloat16 */
#define INLINE static inline __attribute__((always_inline))

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* ---- fused multiply-adds in float32 ---- */

INLINE v8f widen8(const uint16_t *p) {
#ifdef __AVX2__ /* one vpmovzxwd from memory, where gcc's generic widening splits it in halves */
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
#endif
}

/* Eight weights of a panel at `at`: float32 where f32, else bfloat16 widened. */
INLINE v8f weights8(const void *panel, int64_t at, int f32) {
    if (!f32) return widen8((const uint16_t *)panel + at);
    v8f w;
    memcpy(&w, (const float *)panel + at, sizeof w);
    return w;
}

/* Input rows [i0, i0 + rows) of x (float32, x_row apart) against one panel, whose outputs are columns
   [n0, n0 + PANEL) of out; the panel, bias and out float32 where f32, else bfloat16. `next` (or NULL): the panel
   to prefetch into L2 meanwhile, so that a decode step's few rows do not wait on memory for each panel. */
INLINE void tile(const float *restrict x, int64_t x_row, int64_t k, const void *restrict panel, int64_t i0,
                 int64_t rows, const void *restrict bias, void *restrict out, int64_t n, int64_t n0,
                 const char *next, int f32) {
    v8f lo[ROWS] = {{0}}, hi[ROWS] = {{0}};
    const float *restrict xr = x + i0 * x_row;
    const int64_t line = f32 ? 1 : 2; /* input columns per 64-byte line of a panel */
    for (int64_t d = 0; d < k; d++) {
        const v8f a = weights8(panel, d * PANEL, f32), b = weights8(panel, d * PANEL + 8, f32);
        if (next && d % line == 0) __builtin_prefetch(next + d * 64 / line, 0, 2);
        for (int64_t i = 0; i < rows; i++) {
            const float s = xr[i * x_row + d];
            const v8f sv = {s, s, s, s, s, s, s, s};
            lo[i] += sv * a;
            hi[i] += sv * b;
        }
    }
    const int64_t cols = n - n0 < PANEL ? n - n0 : PANEL;
    for (int64_t i = 0; i < rows; i++) {
        float sums[PANEL];
        memcpy(sums, &lo[i], sizeof lo[i]);
        memcpy(sums + 8, &hi[i], sizeof hi[i]);
        const int64_t at = (i0 + i) * n + n0;
        for (int64_t c = 0; c < cols; c++) {
            if (f32) {
                ((float *)out)[at + c] = bias ? sums[c] + ((const float *)bias)[n0 + c] : sums[c];
            } else {
                const float b = bias ? from_bf16(((const uint16_t *)bias)[n0 + c]) : 0;
                ((uint16_t *)out)[at + c] = to_bf16(bias ? sums[c] + b : sums[c]);
            }
        }
    }
}

/* Every input row against panel p: the panel stays in cache while the rows stream by; the first tile prefetches
   the next panel. */
INLINE void panel_rows(const float *x, int64_t x_row, const void *panels, const void *bias, void *out, int64_t m,
                       int64_t n, int64_t k, int64_t p, int f32) {
    const int64_t bytes = k * PANEL * (f32 ? sizeof(float) : sizeof(uint16_t));
    const char *panel = (const char *)panels + p * bytes, *next = p + 1 < (n + PANEL - 1) / PANEL ? panel + bytes : 0;
    int64_t i = 0;
    for (; i + ROWS <= m; i += ROWS, next = 0) tile(x, x_row, k, panel, i, ROWS, bias, out, n, p * PANEL, next, f32);
    _Static_assert(ROWS == 6, "the cases below are the counts below ROWS");
    switch (m - i) { /* the rest as a constant count, so that the compiler unrolls the loop over rows */
    case 5: tile(x, x_row, k, panel, i, 5, bias, out, n, p * PANEL, next, f32); break;
    case 4: tile(x, x_row, k, panel, i, 4, bias, out, n, p * PANEL, next, f32); break;
    case 3: tile(x, x_row, k, panel, i, 3, bias, out, n, p * PANEL, next, f32); break;
    case 2: tile(x, x_row, k, panel, i, 2, bias, out, n, p * PANEL, next, f32); break;
    case 1: tile(x, x_row, k, panel, i, 1, bias, out, n, p * PANEL, next, f32); break;
    }
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
    for (int64_t p = 0; p < count; p++) rows_of(x, x_row, panels, bias, out, m, n, k, p);
}

/* bfloat16 inputs, widened once: each is read by every panel */
static int fma_linear_bf16(const uint16_t *x, int64_t x_row, const uint16_t *panels, const uint16_t *bias,
                           uint16_t *out, int64_t m, int64_t n, int64_t k, int threads) {
    float *xf = malloc((size_t)(m * k + 1) * sizeof *xf); /* + 1: never malloc(0), which may give NULL */
    if (!xf) return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t d = 0; d < k; d++) xf[i * k + d] = from_bf16(x[i * x_row + d]);
    fma_linear(panel_rows_bf16, xf, k, panels, bias, out, m, n, k, threads);
    free(xf);
    return 0;
}

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

/* Where finished sums go: out [m, n], the bias per packed column (or NULL). Gated: the panels come in pairs, a
   gate's 16 columns then the same 16 of up (gpu_worker/packed_linear.py interleaves them), and out takes
   silu(gate) * up (kernels/silu.h) of each pair, out column = packed column / 2. */
typedef struct {
    const uint16_t *bias;
    uint16_t *out;
    int64_t m, n;
    int gated;
} amx_out;

/* A row's 16 bfloat16 to out, the `cols` of them that exist. */
INLINE void amx_store_row(uint16_t *dst, __m256i h, int64_t cols) {
    if (cols == PANEL) {
        _mm256_storeu_si256((void *)dst, h);
    } else {
        uint16_t lanes[PANEL];
        _mm256_storeu_si256((void *)lanes, h);
        memcpy(dst, lanes, (size_t)cols * sizeof *dst);
    }
}

/* A tile of sums (16 rows × 16 columns, from row0 and col0) to out, with the bias, the rows and columns that exist. */
INLINE void amx_store(const float sums[16][PANEL], int64_t row0, int64_t col0, const amx_out *o) {
    const int64_t n = o->n, cols = n - col0 < PANEL ? n - col0 : PANEL, rows = o->m - row0 < 16 ? o->m - row0 : 16;
    if (cols <= 0) return; /* the padding panel of an odd count, read in pairs */
    uint16_t bias[PANEL] = {0}; /* the columns that exist: bias has n */
    for (int64_t c = 0; o->bias && c < cols; c++) bias[c] = o->bias[col0 + c];
    const __m512 b = bf16_widen16(bias);
    for (int64_t i = 0; i < rows; i++) {
        __m512 s = _mm512_loadu_ps(sums[i]);
        if (o->bias) s = _mm512_add_ps(s, b);
        amx_store_row(o->out + (row0 + i) * n + col0, bf16_narrow16(bf16_round16(s)), cols);
    }
}

/* A gated pair of tiles (gate's sums, then up's, the gate's at packed column col0) to out: each rounded with its
   bias as amx_store rounds it, then silu(gate) * up: the bits of the projection and kernels/cpu_act.c apart. */
INLINE void amx_store_gated(const float gate[16][PANEL], const float up[16][PANEL], int64_t row0, int64_t col0,
                            const amx_out *o) {
    const int64_t n = o->n, at = col0 / 2, cols = n - at < PANEL ? n - at : PANEL;
    const int64_t rows = o->m - row0 < 16 ? o->m - row0 : 16;
    const __m512 bg = o->bias ? bf16_widen16(o->bias + col0) : _mm512_setzero_ps();
    const __m512 bu = o->bias ? bf16_widen16(o->bias + col0 + PANEL) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i++) {
        __m512 g = _mm512_loadu_ps(gate[i]), u = _mm512_loadu_ps(up[i]);
        if (o->bias) g = _mm512_add_ps(g, bg), u = _mm512_add_ps(u, bu);
        amx_store_row(o->out + (row0 + i) * n + at, silu_mul16(bf16_round16(g), bf16_round16(u)), cols);
    }
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
INLINE void amx_finish(const amx_part *done, int t, int64_t row0, int64_t col0, const amx_out *o) {
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
                      const amx_out *o) {
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
   L2 (1.4× the time at 2,048 rows). */
INLINE void amx_block(const uint16_t *xs, int64_t kp, int64_t blocks, const uint16_t *panels, int64_t p0,
                      int64_t p1, amx_part *part, const amx_out *o) {
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
INLINE void amx_two_panels(const uint16_t *xs, int64_t kp, const uint16_t *panels, int64_t p, const amx_out *o) {
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

static int amx_linear(const uint16_t *x, int64_t x_row, const uint16_t *panels, const amx_out *o, int64_t k,
                      int threads) {
    /* the rows copied in tile order, zero-padded to whole row blocks and whole tile rows: every tile is one KiB
       in a row, every load in bounds, and the padding adds exact zeros */
    const int64_t m = o->m, kp = round_up(k, TILE_K), blocks = round_up(m, 16) / 16;
    const int64_t count = round_up(o->n, PANEL) / PANEL * (o->gated ? 2 : 1);
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

/* How many values (bfloat16, or float32 for f32_pack) the packed [n, k] weight takes, for AMX tiles (amx) or fused
   multiply-adds. */
int64_t packed_size(int64_t n, int64_t k, int amx) {
    return amx ? round_up(n, 2 * PANEL) * round_up(k, TILE_K) : round_up(n, PANEL) * k;
}

/* Where w[row][d] lies in the packed weight: panel p = row / PANEL, column c = row % PANEL; with AMX tiles at pair
   d / 2, half d % 2 of panel p's [kp / 2][PANEL][2], else at input column d of its [k][PANEL]. */
INLINE int64_t packed_at(int64_t row, int64_t d, int64_t k, int amx) {
    const int64_t p = row / PANEL, c = row % PANEL;
    if (amx) return p * round_up(k, TILE_K) * PANEL + (d / 2) * 2 * PANEL + c * 2 + d % 2;
    return (p * k + d) * PANEL + c;
}

/* w [n, k] of `size`-byte values into `packed` (packed_size values) in the layout of `amx`, the padding (to whole
   panels, or pairs of panels and tile rows with AMX) zero. */
INLINE void pack(const void *w, int64_t n, int64_t k, void *packed, int amx, size_t size) {
    const int64_t rows = amx ? round_up(n, 2 * PANEL) : round_up(n, PANEL), cols = amx ? round_up(k, TILE_K) : k;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t d = 0; d < cols; d++) {
            char *to = (char *)packed + packed_at(row, d, k, amx) * size;
            if (row < n && d < k) memcpy(to, (const char *)w + (row * k + d) * size, size);
            else memset(to, 0, size);
        }
}

/* out [count, k] = the rows `ids` of a weight packed in the layout of `amx` (a tied model's token embedding, read
   from its lm_head). Returns 0, or -1 when an id is not in [0, n) (out then undefined). */
INLINE int unpack_rows(const void *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out,
                       int amx, size_t size) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < count; i++)
        for (int64_t d = 0; d < k; d++)
            memcpy((char *)out + (i * k + d) * size, (const char *)packed + packed_at(ids[i], d, k, amx) * size, size);
    return 0;
}

/* bf16_linear's weight: bfloat16 w [n, k] packed for AMX tiles (amx) or fused multiply-adds */
void bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int amx) {
    pack(w, n, k, packed, amx, sizeof *w);
}

int bf16_unpack_rows(const uint16_t *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out,
                     int amx) {
    return unpack_rows(packed, n, k, ids, count, out, amx, sizeof *out);
}

/* f32_linear's weight: float32 w [n, k] packed for fused multiply-adds */
void f32_pack(const float *w, int64_t n, int64_t k, float *packed) { pack(w, n, k, packed, 0, sizeof *w); }

int f32_unpack_rows(const float *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    return unpack_rows(packed, n, k, ids, count, out, 0, sizeof *out);
}

/* out [m, n] = x w^T + bias; gated (AMX tiles only): out [m, n] = silu(gate) * up of the merged gate|up
   projection, its weight [2 n16, k] and bias [2 n16] interleaved in pairs of 16 rows (gate's, then up's; n16 = n
   padded to a multiple of 16, the padding zeros). Returns 0; -1 when the copy of the input cannot be allocated;
   -2 when AMX is asked for and not granted; -3 when gated without AMX. */
int bf16_linear(const uint16_t *x, int64_t x_row, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                int64_t m, int64_t n, int64_t k, int threads, int amx, int gated) {
    if (amx && !bf16_amx()) return -2;
    if (gated && !amx) return -3;
    if (m <= 0 || n <= 0) return 0;
#ifdef HAVE_AMX
    if (amx) {
        const amx_out o = {.bias = bias, .out = out, .m = m, .n = n, .gated = gated};
        return amx_linear(x, x_row, packed, &o, k, threads);
    }
#endif
    return fma_linear_bf16(x, x_row, packed, bias, out, m, n, k, threads);
}

/* Whether f32_linear was measured faster than torch's float32 linear (MKL) here: on AVX2 with FMA, for the ~100M
   Llama's shapes at 1 to 2,048 rows, and a whole decode step of the tiny model no slower (RESULTS.md). With
   AVX-512, MKL multiplies 16 lanes at a time, this kernel 8: not measured, MKL kept. */
int f32_linear_preferred(void) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x w^T + bias in float32, x [m, k] with rows x_row apart, the weight packed by f32_pack, bias [n] or
   NULL: each output one chain of multiply-adds (fused, where the CPU has FMA) over its input columns in order,
   whatever the batch. */
void f32_linear(const float *x, int64_t x_row, const float *packed, const float *bias, float *out, int64_t m,
                int64_t n, int64_t k, int threads) {
    if (m > 0 && n > 0) fma_linear(panel_rows_f32, x, x_row, packed, bias, out, m, n, k, threads);
}
