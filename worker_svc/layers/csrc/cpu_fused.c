/* Fused element-wise steps of a decoder layer on CPU, float32: RMSNorm, act(gate) * up with SiLU, and
 * the rotary embedding of queries and keys.
 *
 * At decode sizes (a few dozen rows) each of these is a handful of torch operators, each a pass
 * over memory and, past torch's grain size, an OpenMP parallel region whose barrier waits for a
 * thread that another process may have preempted. Here each is one pass, and rows are split over
 * threads only when there are enough of them to pay for it.
 *
 * Both compute what torch computes, in the same order per element:
 *   rms_norm: y = w * (x * (1 / sqrt(mean(x^2) + eps))) (the sum of squares in 8 lanes, then
 *             across them, where torch sums in its own order);
 *   silu_mul: y = g / (1 + exp(-g)) * u, with exp from a degree-7 polynomial on [-ln2/2, ln2/2]
 *             scaled by 2^n (within 2 ulp of expf).
 *
 * Built at first use by worker_svc/layers/cpu_fused.py (through kvcache.cbuild) and called through
 * ctypes; the torch references there are what tests hold it to.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define MIN_PARALLEL_ELEMENTS (1 << 16) /* below this, one thread: a barrier costs more than the work */

/* x [rows, n] (rows x_stride apart), w [n] -> y [rows, n] (contiguous). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float eps, float *y, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * n;
        int64_t j = 0;
        float sum = 0.0f;
#if HAVE_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            const __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++) sum += lanes[l];
#endif
        for (; j < n; j++) sum += xr[j] * xr[j];
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        j = 0;
#if HAVE_AVX2
        const __m256 s = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), s)));
#endif
        for (; j < n; j++) yr[j] = w[j] * (xr[j] * scale);
    }
}

#if HAVE_AVX2
/* exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2/2, exp(r) by its Taylor polynomial to r^7 (Horner),
 * times 2^n built in the exponent bits. Inputs are clamped to where the result is finite and
 * normal: below -87.3 exp is ~0 (then silu(g) = g / (1 + huge) -> -0.0 as in torch), above 88.3
 * the scaling by 2^n would overflow. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, with ln2 in two parts so that n * ln2_hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* gate_up [rows, 2n] (rows stride apart; gate then up) -> y [rows, n] (contiguous) = silu(gate) * up. */
void silu_mul_f32(const float *gate_up, int64_t stride, float *y, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + n;
        float *yr = y + r * n;
        int64_t j = 0;
#if HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; j + 8 <= n; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < n; j++) yr[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* Rotary embedding in place, HF's rotate_half convention: for each token t and head, with halves
 * x1, x2 of width half = head_dim / 2, x1' = x1 * cos - x2 * sin and x2' = x2 * cos + x1 * sin,
 * each product and sum rounded as torch rounds them (no FMA). x [tokens, heads, head_dim] with
 * heads contiguous in a row and rows x_stride apart; cos, sin [tokens, half] contiguous. */
static void rotate_rows(float *x, int64_t x_stride, int64_t heads, int64_t half, const float *cos,
                        const float *sin, int64_t tokens) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * x_stride + h * 2 * half, *x2 = x1 + half;
            int64_t j = 0;
#if HAVE_AVX2
            for (; j + 8 <= half; j += 8) {
                const __m256 a = _mm256_loadu_ps(x1 + j), b = _mm256_loadu_ps(x2 + j);
                const __m256 cv = _mm256_loadu_ps(c + j), sv = _mm256_loadu_ps(s + j);
                _mm256_storeu_ps(x1 + j, _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)));
                _mm256_storeu_ps(x2 + j, _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)));
            }
#endif
            for (; j < half; j++) {
                const float a = x1[j], b = x2[j];
                const float ac = a * c[j], bs = b * s[j], bc = b * c[j], as = a * s[j];
                x1[j] = ac - bs;
                x2[j] = bc + as;
            }
        }
    }
}

/* Queries and keys of one step, both in place. */
void rotary_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride, int64_t k_heads,
                int64_t head_dim, const float *cos, const float *sin, int64_t tokens) {
    rotate_rows(q, q_stride, q_heads, head_dim / 2, cos, sin, tokens);
    rotate_rows(k, k_stride, k_heads, head_dim / 2, cos, sin, tokens);
}

/* 1 when built with AVX2/FMA, 0 for the portable build. */
int fused_simd(void) { return HAVE_AVX2; }

/* The ABI version worker_svc/layers/cpu_fused.py expects; bump it when a signature changes. */
int pagewire_cpu_fused_abi(void) { return 2; }
