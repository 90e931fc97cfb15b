/* y = x W^T + b on CPU with W stored in bfloat16 and x, y, b in float32.
 *
 * For CPUs without native bf16 arithmetic (AVX2 and plain AVX-512): the weight is read at half
 * the bytes of fp32 and widened to fp32 in registers (a bf16 value is the top half of an fp32
 * one), and every product and sum is an fp32 FMA.
 *
 * Packed layout (bf16_linear_pack): panels of 16 output columns; panel p holds, for each k, one
 * 32-byte row of 8 uint32 lanes, lane j = W[16p + j][k] | W[16p + 8 + j][k] << 16. A shift left
 * by 16 gives columns 16p..16p+7 as fp32, a mask of the high half gives 16p+8..16p+15: one
 * integer op per 8 weights. Columns past N are zero.
 *
 * Micro-kernel: 6 rows x 16 columns of y in 12 accumulators, over the whole K: per k, one weight
 * load, two widenings, six broadcasts of x and twelve FMAs. Rows are done in equal chunks of at
 * most ~256 KiB of x (so a chunk stays in L2 while every panel passes over it); inside a chunk the
 * OpenMP threads split the panels statically, so a thread keeps the same panels for every chunk
 * and finds them in its cache again.
 *
 * Built at first use by worker_svc/layers/cpu_bf16_linear.py (through kvcache.cbuild) and called
 * through ctypes; ``bf16_linear_ref`` there (torch) is what tests hold it to.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define PANEL 16
#define MR 6
#define CHUNK_BYTES (256 << 10) /* of x per row chunk */

/* src [n, k] bf16 row-major -> dst [ceil(n / 16), k, 16] in the lane order above. */
void bf16_linear_pack(const uint16_t *src, uint16_t *dst, int64_t n, int64_t k) {
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

/* acc[r][0..15] = sum over k of x[r][k] * panel column, for rows r < mr (mr a constant after
 * inlining into the switch below). */
static inline __attribute__((always_inline)) void panel_product(
    const float *x, int64_t x_stride, const uint16_t *panel, int64_t k, int mr, float acc[MR][PANEL]) {
#if HAVE_AVX2
    __m256 a0[MR], a1[MR];
    for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(panel + kk * PANEL));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int r = 0; r < mr; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + kk);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(acc[r], a0[r]);
        _mm256_storeu_ps(acc[r] + 8, a1[r]);
    }
#else
    for (int r = 0; r < mr; r++) memset(acc[r], 0, sizeof(float) * PANEL);
    for (int64_t kk = 0; kk < k; kk++) {
        float w[PANEL];
        for (int j = 0; j < PANEL / 2; j++) {
            union { uint32_t u; float f; } lo, hi;
            lo.u = (uint32_t)panel[kk * PANEL + 2 * j] << 16;
            hi.u = (uint32_t)panel[kk * PANEL + 2 * j + 1] << 16;
            w[j] = lo.f;
            w[j + PANEL / 2] = hi.f;
        }
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * x_stride + kk];
            for (int j = 0; j < PANEL; j++) acc[r][j] += xv * w[j];
        }
    }
#endif
}

static void panel_rows(const float *x, int64_t x_stride, const uint16_t *panel, int64_t k, int mr,
                       float acc[MR][PANEL]) {
    switch (mr) { /* one specialized copy per row count */
    case 1: panel_product(x, x_stride, panel, k, 1, acc); break;
    case 2: panel_product(x, x_stride, panel, k, 2, acc); break;
    case 3: panel_product(x, x_stride, panel, k, 3, acc); break;
    case 4: panel_product(x, x_stride, panel, k, 4, acc); break;
    case 5: panel_product(x, x_stride, panel, k, 5, acc); break;
    default: panel_product(x, x_stride, panel, k, MR, acc); break;
    }
}

/* x [m, k] fp32 (rows x_stride apart), packed W for [n, k], bias [n] fp32 or NULL -> y [m, n] fp32
 * (rows y_stride apart). */
void bf16_linear(const float *x, int64_t x_stride, const uint16_t *packed, const float *bias, float *y,
                 int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    int64_t max_rows = CHUNK_BYTES / (4 * (k > 0 ? k : 1)) / MR * MR;
    if (max_rows < MR) max_rows = MR;
    const int64_t num_chunks = (m + max_rows - 1) / max_rows;
    const int64_t chunk = num_chunks > 1 ? ((m + num_chunks - 1) / num_chunks + MR - 1) / MR * MR : m;
    #pragma omp parallel
    {
        float acc[MR][PANEL] __attribute__((aligned(32)));
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            /* no barrier between chunks: they write disjoint rows */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < num_panels; p++) {
                const uint16_t *panel = packed + p * k * PANEL;
                const int64_t col = p * PANEL, cols = n - col < PANEL ? n - col : PANEL;
                for (int64_t r0 = m0; r0 < m1; r0 += MR) {
                    const int mr = (int)(m1 - r0 < MR ? m1 - r0 : MR);
                    panel_rows(x + r0 * x_stride, x_stride, panel, k, mr, acc);
                    for (int r = 0; r < mr; r++) {
                        float *dst = y + (r0 + r) * y_stride + col;
                        if (bias)
                            for (int64_t j = 0; j < cols; j++) dst[j] = acc[r][j] + bias[col + j];
                        else
                            memcpy(dst, acc[r], sizeof(float) * cols);
                    }
                }
            }
        }
    }
}

/* 1 when built with the AVX2/FMA micro-kernel, 0 for the portable one. */
int bf16_linear_simd(void) { return HAVE_AVX2; }

/* The ABI version worker_svc/layers/cpu_bf16_linear.py expects; bump it when a signature changes. */
int pagewire_bf16_linear_abi(void) { return 1; }
