/* y = x W^T + b on CPU, x, y and b in float32, W in float32 or bfloat16, every product and sum an
 * fp32 FMA.
 *
 * Decode steps multiply a few dozen rows by weights far larger than the caches: each step streams
 * every weight from memory once. So the kernel is built around the weight stream: W is packed once
 * into panels of 16 output columns, contiguous in k, and each panel is multiplied by all the rows
 * while it is in L1/L2; the next panel is prefetched a share per row block while the current one is
 * multiplied, so the memory stream is spread over, and overlaps, all the arithmetic (prefetching it
 * in a burst during the first row block left the stream behind: 18% slower at 32 rows).
 *
 * bf16 weights (for CPUs without native bf16 arithmetic: AVX2 and plain AVX-512) are read at half
 * the bytes and widened in registers (a bf16 value is the top half of an fp32 one).
 *
 * Packed layouts, panels of 16 output columns (columns past N are zero):
 *   fp32: panel p holds, for each k, W[16p + j][k] for j = 0..15 (64 bytes);
 *   bf16: panel p holds, for each k, one 32-byte row of 8 uint32 lanes,
 *         lane j = W[16p + j][k] | W[16p + 8 + j][k] << 16. A shift left by 16 gives columns
 *         16p..16p+7 as fp32, a mask of the high half gives 16p+8..16p+15: one integer op per 8
 *         weights.
 *
 *   bf16 pairs (for CPUs with AVX-512 BF16 or AMX): panel p holds, for each pair of k (2q, 2q + 1),
 *         16 uint32 lanes, lane j = W[16p + j][2q] | W[16p + j][2q + 1] << 16 (k past K is zero),
 *         the operand of one vdpbf16ps: lane j gains x[2q] W[j][2q] + x[2q + 1] W[j][2q + 1], x a
 *         bf16 pair broadcast to every lane. x and y are bf16 then (the model computes in bf16),
 *         the sums fp32; its pass over SmolLM2's linears takes 0.8x oneDNN's bf16 time at 32 rows
 *         on AMD Zen 4.
 *         Each panel has a whole number of 16-pair steps (zero pairs after the last), so that 16
 *         consecutive pairs, 1 KiB, are an AMX B tile (below, "on AMX tiles").
 *
 * Micro-kernel: up to 6 rows x 16 columns of y in 12 accumulators, over the whole K: per k, one
 * panel row, six broadcasts of x and twelve FMAs. Rows are split into blocks of near-equal size
 * (32 rows: 6, 6, 5, 5, 5, 5; not 6 x 5 + 2, whose 2-row block waits on FMA latency). Rows are done
 * in equal chunks of at most ~256 KiB of x (so a chunk stays in L2 while every panel passes over
 * it); inside a chunk the OpenMP threads split the panels statically, so a thread keeps the same
 * panels for every chunk, and the panel after the current one is the one it prefetches.
 *
 * Built at first use by worker_svc/cpu/linear.py (through worker_svc.cpu.build) and called through
 * ctypes; ``linear_ref`` there (torch) is what tests hold it to.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif
/* AMX-BF16 tiles, the outputs rounded and written with AVX-512 (every AMX CPU has it) */
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
#endif

#define PANEL 16
#define MR 6
#define CHUNK_BYTES (256 << 10) /* of x per row chunk */

/* src [n, k] fp32 row-major -> dst [ceil(n / 16), k, 16]. */
void linear_pack_f32(const float *src, float *dst, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        float *panel = dst + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t col = p * PANEL + j;
                panel[kk * PANEL + j] = col < n ? src[col * k + kk] : 0.0f;
            }
    }
}

/* src [n, k] bf16 row-major -> dst [ceil(n / 16), k, 16] in the lane order above. */
void linear_pack_bf16(const uint16_t *src, uint16_t *dst, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        uint16_t *panel = dst + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t j = 0; j < PANEL / 2; j++) {
                const int64_t lo = p * PANEL + j, hi = lo + PANEL / 2;
                panel[kk * PANEL + 2 * j] = lo < n ? src[lo * k + kk] : 0;
                panel[kk * PANEL + 2 * j + 1] = hi < n ? src[hi * k + kk] : 0;
            }
        }
    }
}

#define PAIR_STEP 16 /* pairs per AMX tile step: an A tile row of 64 bytes, a B tile of 16 rows */

/* A panel's pairs: ceil(k / 2), rounded up to a whole number of PAIR_STEP. */
static inline int64_t panel_pairs(int64_t k) { return ((k + 1) / 2 + PAIR_STEP - 1) / PAIR_STEP * PAIR_STEP; }

/* src [n, k] bf16 row-major -> dst [ceil(n / 16), panel_pairs(k), 16] uint32 in the pair order above. */
void linear_pack_bf16_pairs(const uint16_t *src, uint32_t *dst, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL, kp = (k + 1) / 2, padded = panel_pairs(k);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        uint32_t *panel = dst + p * padded * PANEL;
        for (int64_t q = 0; q < padded; q++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t col = p * PANEL + j;
                uint32_t lo = 0, hi = 0;
                if (col < n && q < kp) {
                    lo = src[col * k + 2 * q];
                    hi = 2 * q + 1 < k ? src[col * k + 2 * q + 1] : 0;
                }
                panel[q * PANEL + j] = lo | hi << 16;
            }
    }
}

static inline float bf16_to_f32(uint32_t bits) {
    union { uint32_t u; float f; } v;
    v.u = bits << 16;
    return v.f;
}

/* Round to nearest even, as torch's float -> bfloat16 (a NaN stays a NaN). */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1)) >> 16);
}

static inline float weight_at(const void *panel, int wide, int64_t kk, int j) {
    if (wide) return ((const float *)panel)[kk * PANEL + j];
    const uint16_t *row = (const uint16_t *)panel + kk * PANEL;
    return bf16_to_f32(j < PANEL / 2 ? row[2 * j] : row[2 * (j - PANEL / 2) + 1]);
}

/* acc[r][0..15] = sum over k of x[r][k] * panel column, for rows r < mr (mr and wide constants
 * after inlining into the switch below). Prefetches `prefetch_step` bytes of the next panel per k,
 * starting at `prefetch`: unconditionally, since a branch in this loop makes gcc keep the
 * accumulators in memory. */
static inline __attribute__((always_inline)) void panel_product(
    const float *x, int64_t x_stride, const void *panel, int wide, int64_t k, int mr, float acc[MR][PANEL],
    const char *prefetch, int64_t prefetch_step) {
#if HAVE_AVX2
    /* named accumulators, not arrays: gcc keeps arrays of them in memory inside the loop */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch(prefetch + kk * prefetch_step, _MM_HINT_T0);
        /* columns 0..7 and 8..15 of the panel's row kk, as fp32 */
        __m256 w0, w1;
        if (wide) {
            w0 = _mm256_loadu_ps((const float *)panel + kk * PANEL);
            w1 = _mm256_loadu_ps((const float *)panel + kk * PANEL + 8);
        } else {
            const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * PANEL));
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        }
#define ROW_FMA(R)                                                               \
        if (mr > R) {                                                            \
            const __m256 xb = _mm256_broadcast_ss(x + R * x_stride + kk);        \
            c##R##0 = _mm256_fmadd_ps(xb, w0, c##R##0);                          \
            c##R##1 = _mm256_fmadd_ps(xb, w1, c##R##1);                          \
        }
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
#undef ROW_FMA
    }
#define ROW_STORE(R)                                                             \
    if (mr > R) {                                                                \
        _mm256_storeu_ps(acc[R], c##R##0);                                       \
        _mm256_storeu_ps(acc[R] + 8, c##R##1);                                   \
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
#undef ROW_STORE
#else
    (void)prefetch;
    (void)prefetch_step;
    for (int r = 0; r < mr; r++) memset(acc[r], 0, sizeof(float) * PANEL);
    for (int64_t kk = 0; kk < k; kk++) {
        float w[PANEL];
        for (int j = 0; j < PANEL; j++) w[j] = weight_at(panel, wide, kk, j);
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * x_stride + kk];
            for (int j = 0; j < PANEL; j++) acc[r][j] += xv * w[j];
        }
    }
#endif
}

/* acc[r][0..15] = sum over pairs q of x[r] pair q . panel pair q, x as uint32 bf16 pairs, rows
 * x_stride pairs apart: even and odd q in two accumulators per row, so each row has two chains
 * of vdpbf16ps in flight (12 in all, as the fp32 kernel). Prefetches `prefetch_step` bytes of
 * the next panel per pair. */
static inline __attribute__((always_inline)) void pair_panel_product(
    const uint32_t *x, int64_t x_stride, const uint32_t *panel, int64_t kp, int mr, float acc[MR][PANEL],
    const char *prefetch, int64_t prefetch_step) {
#if HAVE_AVX512BF16
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    int64_t q = 0;
    for (; q + 1 < kp; q += 2) {
        _mm_prefetch(prefetch + q * prefetch_step, _MM_HINT_T0);
        _mm_prefetch(prefetch + (q + 1) * prefetch_step, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (q + 1) * PANEL);
#define ROW_DOT(R)                                                                                         \
        if (mr > R) {                                                                                      \
            c##R##0 = _mm512_dpbf16_ps(c##R##0, w0, (__m512bh)_mm512_set1_epi32((int)x[R * x_stride + q]));     \
            c##R##1 = _mm512_dpbf16_ps(c##R##1, w1, (__m512bh)_mm512_set1_epi32((int)x[R * x_stride + q + 1])); \
        }
        ROW_DOT(0) ROW_DOT(1) ROW_DOT(2) ROW_DOT(3) ROW_DOT(4) ROW_DOT(5)
#undef ROW_DOT
    }
    if (q < kp) { /* an odd number of pairs: the last one into the even accumulators */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * PANEL);
#define ROW_LAST(R)                                                                                        \
        if (mr > R) c##R##0 = _mm512_dpbf16_ps(c##R##0, w0, (__m512bh)_mm512_set1_epi32((int)x[R * x_stride + q]));
        ROW_LAST(0) ROW_LAST(1) ROW_LAST(2) ROW_LAST(3) ROW_LAST(4) ROW_LAST(5)
#undef ROW_LAST
    }
#define ROW_STORE(R)                                                             \
    if (mr > R) _mm512_storeu_ps(acc[R], _mm512_add_ps(c##R##0, c##R##1));
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
#undef ROW_STORE
#else
    /* the portable path, same layout and pairing (each pair's two products summed in fp32) */
    (void)prefetch;
    (void)prefetch_step;
    float odd[MR][PANEL];
    for (int r = 0; r < mr; r++) {
        memset(acc[r], 0, sizeof(float) * PANEL);
        memset(odd[r], 0, sizeof(float) * PANEL);
    }
    for (int64_t q = 0; q < kp; q++) {
        for (int r = 0; r < mr; r++) {
            const uint32_t xv = x[r * x_stride + q];
            const float x0 = bf16_to_f32(xv & 0xffffu), x1 = bf16_to_f32(xv >> 16);
            float *dst = q & 1 ? odd[r] : acc[r];
            for (int j = 0; j < PANEL; j++) {
                const uint32_t wv = panel[q * PANEL + j];
                dst[j] += x0 * bf16_to_f32(wv & 0xffffu) + x1 * bf16_to_f32(wv >> 16);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < PANEL; j++) acc[r][j] += odd[r][j];
#endif
}

/* One specialized copy per row count and weight type. */
#define PANEL_ROWS(NAME, WIDE)                                                                            \
    static void NAME(const float *x, int64_t x_stride, const void *panel, int64_t k, int mr,                \
                     float acc[MR][PANEL], const char *prefetch, int64_t step) {                            \
        switch (mr) {                                                                                      \
        case 1: panel_product(x, x_stride, panel, WIDE, k, 1, acc, prefetch, step); break;                 \
        case 2: panel_product(x, x_stride, panel, WIDE, k, 2, acc, prefetch, step); break;                 \
        case 3: panel_product(x, x_stride, panel, WIDE, k, 3, acc, prefetch, step); break;                 \
        case 4: panel_product(x, x_stride, panel, WIDE, k, 4, acc, prefetch, step); break;                 \
        case 5: panel_product(x, x_stride, panel, WIDE, k, 5, acc, prefetch, step); break;                 \
        default: panel_product(x, x_stride, panel, WIDE, k, MR, acc, prefetch, step); break;               \
        }                                                                                                  \
    }
PANEL_ROWS(panel_rows_f32, 1)
PANEL_ROWS(panel_rows_bf16, 0)

static void panel_rows_pairs(const uint32_t *x, int64_t x_stride, const uint32_t *panel, int64_t kp, int mr,
                             float acc[MR][PANEL], const char *prefetch, int64_t step) {
    switch (mr) {
    case 1: pair_panel_product(x, x_stride, panel, kp, 1, acc, prefetch, step); break;
    case 2: pair_panel_product(x, x_stride, panel, kp, 2, acc, prefetch, step); break;
    case 3: pair_panel_product(x, x_stride, panel, kp, 3, acc, prefetch, step); break;
    case 4: pair_panel_product(x, x_stride, panel, kp, 4, acc, prefetch, step); break;
    case 5: pair_panel_product(x, x_stride, panel, kp, 5, acc, prefetch, step); break;
    default: pair_panel_product(x, x_stride, panel, kp, MR, acc, prefetch, step); break;
    }
}

enum layout { F32 = 0, BF16 = 1, BF16_PAIRS = 2 };

/* x [m, k] (rows x_stride elements apart; fp32, or bf16 for BF16_PAIRS), W packed in `layout`,
 * bias [n] fp32 or NULL -> y [m, n] (rows y_stride apart; fp32, or bf16 for BF16_PAIRS). */
static void linear(const void *x, int64_t x_stride, const void *packed, enum layout layout, const float *bias,
                   void *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int pairs = layout == BF16_PAIRS;
    /* the panel's rows: one per k, or per pair of k */
    const int64_t rows_k = pairs ? (k + 1) / 2 : k;
    const int64_t row_bytes = PANEL * (layout == BF16 ? 2 : 4);
    const int64_t panel_bytes = (pairs ? panel_pairs(k) : rows_k) * row_bytes;
    const int64_t x_row_bytes = (pairs ? 2 : 4) * (k > 0 ? k : 1);
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    int64_t max_rows = CHUNK_BYTES / x_row_bytes / MR * MR;
    if (max_rows < MR) max_rows = MR;
    const int64_t num_chunks = (m + max_rows - 1) / max_rows;
    const int64_t chunk = num_chunks > 1 ? ((m + num_chunks - 1) / num_chunks + MR - 1) / MR * MR : m;
    #pragma omp parallel
    {
        float acc[MR][PANEL] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int64_t num_blocks = (m1 - m0 + MR - 1) / MR;
            /* the next panel is prefetched across all the row blocks of this one, a 1/num_blocks
             * share each, so its stream from memory spreads over the whole time spent on this one */
            const int64_t step = (row_bytes + num_blocks - 1) / num_blocks;
            /* no barrier between chunks: they write disjoint rows */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < num_panels; p++) {
                const char *panel = (const char *)packed + p * panel_bytes;
                const char *next = p + 1 < num_panels ? panel + panel_bytes : panel;
                const int64_t col = p * PANEL, cols = n - col < PANEL ? n - col : PANEL;
                for (int64_t b = 0, r0 = m0; b < num_blocks; b++) {
                    /* near-equal blocks: the first (rows % blocks) get one row more */
                    const int mr = (int)((m1 - m0) / num_blocks + (b < (m1 - m0) % num_blocks));
                    const char *prefetch = next + b * rows_k * step;
                    if (pairs)
                        panel_rows_pairs((const uint32_t *)((const uint16_t *)x + r0 * x_stride), x_stride / 2,
                                         (const uint32_t *)panel, rows_k, mr, acc, prefetch, step);
                    else
                        (layout == F32 ? panel_rows_f32 : panel_rows_bf16)((const float *)x + r0 * x_stride, x_stride,
                                                                           panel, k, mr, acc, prefetch, step);
                    for (int r = 0; r < mr; r++) {
                        if (pairs) {
                            uint16_t *dst = (uint16_t *)y + (r0 + r) * y_stride + col;
                            for (int64_t j = 0; j < cols; j++)
                                dst[j] = f32_to_bf16(bias ? acc[r][j] + bias[col + j] : acc[r][j]);
                            continue;
                        }
                        float *dst = (float *)y + (r0 + r) * y_stride + col;
                        if (bias)
                            for (int64_t j = 0; j < cols; j++) dst[j] = acc[r][j] + bias[col + j];
                        else
                            memcpy(dst, acc[r], sizeof(float) * cols);
                    }
                    r0 += mr;
                }
            }
        }
    }
}

/* ---- The bf16-pair layout on AMX tiles ----
 *
 * 16 consecutive pairs of a panel (16 rows of 64 bytes) are an AMX B tile in the layout tdpbf16ps
 * expects, so the same packed weights serve both instruction sets. A tdpbf16ps multiplies an A
 * tile (16 rows of x, 16 pairs each) by a B tile into a C tile of 16 rows x 16 columns of fp32
 * sums. Up to 16 rows, the A and C tiles are configured for m rows and x is read in place (copied
 * with zeros past k where k is not a multiple of 32), two panels at a time
 * (linear_pairs_few_on_tiles). More rows: x is first copied into rows of panel_pairs(k) pairs
 * (zeros past k) and a multiple of 16 rows (zeros past m), and the 8 tiles hold a 2 x 2 block: C
 * 0..3 for 32 rows x 2 panels, A 4 and 5 for the two 16-row halves, B 6 and 7 for the two panels,
 * so each loaded tile feeds two products. The threads split the pairs of panels; rows go in
 * chunks of at most ~1 MiB of x, as in linear(). Where no memory is left for a copy, the call
 * falls back to the vector path (whose sums round otherwise). */
#if HAVE_AMX
#define TILE_ROWS 16
/* of x per row chunk: half the 2 MiB L2 of these cores (at 512 rows, 7% faster than 256 KiB) */
#define AMX_CHUNK_BYTES (1 << 20)
static int amx_state = -1; /* -1 not asked yet, 0 refused, 1 granted */

struct amx_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 64 bytes a row; the A (4, 5) and C (0..3) tiles `rows` rows (1..16), B (6, 7) 16. */
static void amx_configure(int rows) {
    struct amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t >= 6 ? TILE_ROWS : (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* C = 16 or 32 rows of xp (rows xp_stride bytes apart; the second 16 when `two_rows`) x one or
 * two panels (the second when `two_cols`), kp pairs; stored to c [4][16][16] as (row half, panel).
 * Prefetches `lines` cache lines of what follows the panels per 16 pairs, from `prefetch`. */
static void amx_block(const char *xp, int64_t xp_stride, const char *panel, int64_t panel_bytes, int64_t kp,
                      int two_rows, int two_cols, float *c, const char *prefetch, int64_t lines) {
    const char *x1 = xp + TILE_ROWS * xp_stride, *panel1 = panel + panel_bytes;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < kp; q += PAIR_STEP) {
        for (int64_t l = 0; l < lines; l++) _mm_prefetch(prefetch + l * 64, _MM_HINT_T0);
        prefetch += lines * 64;
        _tile_loadd(4, xp + q * 4, xp_stride);
        _tile_loadd(6, panel + q * 64, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) {
            _tile_loadd(7, panel1 + q * 64, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, x1 + q * 4, xp_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t tile = TILE_ROWS * PANEL;
    _tile_stored(0, c, 64);
    if (two_cols) _tile_stored(1, c + tile, 64);
    if (two_rows) _tile_stored(2, c + 2 * tile, 64);
    if (two_rows && two_cols) _tile_stored(3, c + 3 * tile, 64);
}

/* Up to 16 rows (A and C tiles configured for m rows, B tiles 16) of xp (rows xp_stride bytes apart,
 * panel_pairs(k) pairs each: x itself where k is a multiple of 32, else a zero-padded copy) times
 * every panel, two panels at a time, the next two prefetched as these multiply; y as in
 * linear_pairs_on_tiles. Each output takes the same B tiles in the same order from zero as there:
 * the same bits, whatever the rows. */
static void linear_pairs_few_on_tiles(const char *xp, int64_t xp_stride, const uint32_t *packed, const float *bias,
                                      uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t kp = panel_pairs(k), num_panels = (n + PANEL - 1) / PANEL, panel_bytes = kp * PANEL * 4;
    const int64_t steps = kp / PAIR_STEP, lines = (2 * panel_bytes / 64 + steps - 1) / steps;
    #pragma omp parallel
    {
        float c[2 * TILE_ROWS * PANEL] __attribute__((aligned(64)));
        amx_configure((int)m);
        #pragma omp for schedule(static)
        for (int64_t pp = 0; pp < (num_panels + 1) / 2; pp++) {
            const int64_t p = 2 * pp;
            const int two_cols = p + 1 < num_panels;
            const char *panel = (const char *)packed + p * panel_bytes;
            const char *prefetch = p + 2 < num_panels ? panel + 2 * panel_bytes : panel;
            amx_block(xp, xp_stride, panel, panel_bytes, kp, 0, two_cols, c, prefetch, lines);
            for (int side = 0; side <= two_cols; side++) {
                const int64_t col = (p + side) * PANEL, cols = n - col < PANEL ? n - col : PANEL;
                const __mmask16 valid = (__mmask16)((1u << cols) - 1);
                const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + col) : _mm512_setzero_ps();
                for (int64_t r = 0; r < m; r++) {
                    const __m512 sum = _mm512_load_ps(c + side * TILE_ROWS * PANEL + r * PANEL);
                    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sum, add));
                    _mm256_mask_storeu_epi16(y + r * y_stride + col, valid, (__m256i)out);
                }
            }
        }
        _tile_release();
    }
}

static void linear_pairs_on_tiles(const uint16_t *x, int64_t x_stride, const uint32_t *packed, const float *bias,
                                  uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    if (m <= TILE_ROWS) {
        if (k % (2 * PAIR_STEP) == 0) { /* whole tiles of pairs: x read in place */
            linear_pairs_few_on_tiles((const char *)x, 2 * x_stride, packed, bias, y, y_stride, m, n, k);
            return;
        }
        const int64_t xp_stride = panel_pairs(k) * 4;
        char *xp = aligned_alloc(64, (size_t)(m * xp_stride));
        if (xp) {
            for (int64_t r = 0; r < m; r++) {
                memcpy(xp + r * xp_stride, x + r * x_stride, (size_t)(2 * k));
                memset(xp + r * xp_stride + 2 * k, 0, (size_t)(xp_stride - 2 * k));
            }
            linear_pairs_few_on_tiles(xp, xp_stride, packed, bias, y, y_stride, m, n, k);
            free(xp);
            return;
        }
    }
    const int64_t kp = panel_pairs(k), num_panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_bytes = kp * PANEL * 4, xp_stride = kp * 4;
    const int64_t groups = (m + TILE_ROWS - 1) / TILE_ROWS; /* of 16 rows */
    char *xp = aligned_alloc(64, (size_t)(groups * TILE_ROWS * xp_stride)); /* a multiple of 64 bytes */
    if (!xp) { /* no memory for the copy: the vector path needs none */
        linear(x, x_stride, packed, BF16_PAIRS, bias, y, y_stride, m, n, k);
        return;
    }
    for (int64_t r = 0; r < groups * TILE_ROWS; r++) {
        char *row = xp + r * xp_stride;
        const int64_t bytes = r < m ? 2 * k : 0;
        if (bytes) memcpy(row, x + r * x_stride, (size_t)bytes);
        memset(row + bytes, 0, (size_t)(xp_stride - bytes));
    }
    int64_t chunk_groups = AMX_CHUNK_BYTES / (TILE_ROWS * xp_stride) / 2 * 2;
    if (chunk_groups < 2) chunk_groups = 2;
    const int64_t steps = kp / PAIR_STEP, panel_pairs_of_panels = (num_panels + 1) / 2;
    #pragma omp parallel
    {
        float c[4 * TILE_ROWS * PANEL] __attribute__((aligned(64)));
        amx_configure(TILE_ROWS);
        for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
            const int64_t g1 = g0 + chunk_groups < groups ? g0 + chunk_groups : groups;
            const int64_t blocks = (g1 - g0 + 1) / 2;
            /* the next two panels' lines, spread over every 16 pairs of every row block */
            const int64_t lines = (2 * kp + blocks * steps - 1) / (blocks * steps);
            #pragma omp for schedule(static) nowait
            for (int64_t pp = 0; pp < panel_pairs_of_panels; pp++) {
                const int64_t p = 2 * pp;
                const int two_cols = p + 1 < num_panels;
                const char *panel = (const char *)packed + p * panel_bytes;
                const char *next = p + 2 < num_panels ? panel + 2 * panel_bytes : panel;
                for (int64_t b = 0; b < blocks; b++) {
                    const int64_t g = g0 + 2 * b, r0 = g * TILE_ROWS;
                    const int two_rows = g + 1 < g1;
                    amx_block(xp + r0 * xp_stride, xp_stride, panel, panel_bytes, kp, two_rows, two_cols, c,
                              next + b * steps * lines * 64, lines);
                    for (int half = 0; half <= two_rows; half++)
                        for (int side = 0; side <= two_cols; side++) {
                            const int64_t col = (p + side) * PANEL, cols = n - col < PANEL ? n - col : PANEL;
                            const float *tile = c + (2 * half + side) * TILE_ROWS * PANEL;
                            const __mmask16 valid = (__mmask16)((1u << cols) - 1);
                            const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + col) : _mm512_setzero_ps();
                            for (int64_t r = 0; r < TILE_ROWS && r0 + half * TILE_ROWS + r < m; r++) {
                                /* vcvtneps2bf16 rounds to nearest even, as f32_to_bf16 */
                                const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tile + r * PANEL), add));
                                _mm256_mask_storeu_epi16(y + (r0 + half * TILE_ROWS + r) * y_stride + col, valid, (__m256i)out);
                            }
                        }
                }
            }
        }
        _tile_release();
    }
    free(xp);
}
#endif

void linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    linear(x, x_stride, packed, F32, bias, y, y_stride, m, n, k);
}

void linear_bf16(const float *x, int64_t x_stride, const uint16_t *packed, const float *bias, float *y,
                 int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    linear(x, x_stride, packed, BF16, bias, y, y_stride, m, n, k);
}

/* x [m, k] bf16 (k even, rows x_stride elements apart, x_stride even), W packed as bf16 pairs ->
 * y [m, n] bf16. */
void linear_bf16_pairs(const uint16_t *x, int64_t x_stride, const uint32_t *packed, const float *bias, uint16_t *y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    linear(x, x_stride, packed, BF16_PAIRS, bias, y, y_stride, m, n, k);
}

/* 1 when this process may multiply on AMX tiles: the kernel was built for a CPU with AMX-BF16 and
 * Linux grants the process the tiles' state (asked once; a kernel before 5.16 refuses). */
int linear_pairs_amx(void) {
#if HAVE_AMX
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                           18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_state;
#else
    return 0;
#endif
}

/* As linear_bf16_pairs, on AMX tiles where linear_pairs_amx() says so and x has at least
 * tiles_from rows (else the same as it). From one row by default: every call's outputs then take
 * the same tiles in the same order, so a row's bits never depend on its batch, where the dot
 * products round otherwise; and up to 16 rows read x in place, so the tiles cost about what the dot
 * products do (benchmarks/cpu_linear.py, a pass through SmolLM2's linears on Emerald Rapids, two
 * threads: 1 row 9.9 ms on both, 2 rows 10.4 against 11.3, 8 rows 10.9 against 16.3, 32 rows 14.1
 * against 54.6). linear_pairs_tiles_from changes it. */
#define TILES_FROM 1
static int64_t tiles_from = TILES_FROM;

/* Sets the rows from which calls go on the tiles (rows >= 1), or restores the default (rows < 0);
 * returns the rows now in force (rows == 0: only that). */
int64_t linear_pairs_tiles_from(int64_t rows) {
    if (rows > 0) tiles_from = rows;
    else if (rows < 0) tiles_from = TILES_FROM;
    return tiles_from;
}

void linear_bf16_pairs_amx(const uint16_t *x, int64_t x_stride, const uint32_t *packed, const float *bias,
                           uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
#if HAVE_AMX
    if (linear_pairs_amx() && k > 0 && m >= tiles_from) {
        linear_pairs_on_tiles(x, x_stride, packed, bias, y, y_stride, m, n, k);
        return;
    }
#endif
    linear(x, x_stride, packed, BF16_PAIRS, bias, y, y_stride, m, n, k);
}

/* 1 when built with the AVX2/FMA micro-kernel, 0 for the portable one. */
int linear_simd(void) { return HAVE_AVX2; }

/* 1 when the bf16-pair layout runs on AVX-512 BF16 dot products, 0 for its portable loop. */
int linear_pairs_simd(void) { return HAVE_AVX512BF16; }

/* The ABI version worker_svc/cpu/linear.py expects; bump it when a signature changes. */
int pagewire_cpu_linear_abi(void) { return 5; }
