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
 * bfloat16 versions (for a model that computes in bf16, on CPUs with native bf16) take and give
 * bf16, compute each element in fp32 and round to bf16 (nearest even) wherever torch's bf16
 * operators round: after x * scale and after the weight's product in rms_norm, after silu and
 * after the product in silu_mul, after each product and sum of the rotary embedding (so that one
 * equals torch's to the bit, as the fp32 one does). Vectorized with AVX-512 BF16, whose
 * conversion flushes fp32 values below 2^-126 to zero where torch keeps a subnormal bf16; a
 * portable loop elsewhere.
 *
 * Built at first use by worker_svc/cpu/fused.py (through worker_svc.cpu.build) and called through
 * ctypes; the torch references there are what tests hold it to.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
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
 * times 2^n: a float 2^(n/2) times it, then n - n/2 added to the exponent bits (2^128 is not a
 * float, and an integer add cannot be reassociated by -fassociative-math). Below -87.3 x is clamped
 * (exp is ~0 there); above EXP_MAX, where expf overflows, the result is +inf, as expf's (so silu(g)
 * = g / (1 + inf) = -0.0 there, as in torch). */
#define EXP_MAX 88.72283935546875f /* the largest float whose expf is finite */
/* r = x - n ln2 (ln2 in two parts, so that n * ln2_hi is exact), p = exp(r) to r^7, with the
 * intrinsics of prefix V (_mm256 or _mm512) */
#define EXP_POLY(V, r, p, n, x)                                            \
    r = V##_fnmadd_ps(n, V##_set1_ps(0.693359375f), x);                    \
    r = V##_fnmadd_ps(n, V##_set1_ps(-2.12194440e-4f), r);                 \
    p = V##_set1_ps(1.0f / 5040.0f);                                       \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f / 720.0f));                    \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f / 120.0f));                    \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f / 24.0f));                     \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f / 6.0f));                      \
    p = V##_fmadd_ps(p, r, V##_set1_ps(0.5f));                             \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f));                             \
    p = V##_fmadd_ps(p, r, V##_set1_ps(1.0f))
static inline __m256 exp8(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MAX), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(EXP_MAX));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r, p;
    EXP_POLY(_mm256, r, p, n, x);
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(_mm256_mul_ps(p, lo)),
                                            _mm256_slli_epi32(_mm256_sub_epi32(ni, half), 23));
    return _mm256_blendv_ps(_mm256_castsi256_ps(scaled), _mm256_set1_ps(INFINITY), over);
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

/* ---- greedy sampling ---- */

#if HAVE_AVX2
/* Lane-wise, the larger of (a, ia) and (b, ib), the smaller index where equal. */
static inline void argmax_merge(__m256 *a, __m256i *ia, __m256 b, __m256i ib) {
    const __m256 take = _mm256_or_ps(_mm256_cmp_ps(b, *a, _CMP_GT_OQ),
                                     _mm256_and_ps(_mm256_cmp_ps(b, *a, _CMP_EQ_OQ),
                                                   _mm256_castsi256_ps(_mm256_cmpgt_epi32(*ia, ib))));
    *a = _mm256_blendv_ps(*a, b, take);
    *ia = _mm256_blendv_epi8(*ia, ib, _mm256_castps_si256(take));
}
#endif

/* The index of the largest of x[0..n) (n >= 1), the first of equal ones, or of the first NaN: as
 * torch.argmax, which treats NaN as the largest. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0, j = 0;
    float m = x[0];
#if HAVE_AVX2
    if (n >= 32) {
        /* four sets of 8 lanes, each the largest of its elements so far and its first index (four
         * chains, so compare-and-blend latency is hidden); NaNs only noted */
        __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8), m2 = _mm256_loadu_ps(x + 16);
        __m256 m3 = _mm256_loadu_ps(x + 24);
        __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(m0, m0, _CMP_UNORD_Q), _mm256_cmp_ps(m1, m1, _CMP_UNORD_Q)),
                                  _mm256_or_ps(_mm256_cmp_ps(m2, m2, _CMP_UNORD_Q), _mm256_cmp_ps(m3, m3, _CMP_UNORD_Q)));
        __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8)), i2 = _mm256_add_epi32(i0, _mm256_set1_epi32(16));
        __m256i i3 = _mm256_add_epi32(i0, _mm256_set1_epi32(24)), cur = i0;
        const __m256i step = _mm256_set1_epi32(32);
#define ARGMAX_SET(S)                                                                     \
        {                                                                                 \
            const __m256 v = _mm256_loadu_ps(x + j + 8 * S);                              \
            const __m256 greater = _mm256_cmp_ps(v, m##S, _CMP_GT_OQ);                    \
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                   \
            m##S = _mm256_blendv_ps(m##S, v, greater);                                    \
            i##S = _mm256_blendv_epi8(i##S, _mm256_add_epi32(cur, _mm256_set1_epi32(8 * S)), \
                                      _mm256_castps_si256(greater));                      \
        }
        for (j = 32; j + 32 <= n; j += 32) {
            cur = _mm256_add_epi32(cur, step);
            ARGMAX_SET(0) ARGMAX_SET(1) ARGMAX_SET(2) ARGMAX_SET(3)
        }
#undef ARGMAX_SET
        if (_mm256_movemask_ps(nan)) {
            j = 0; /* a NaN in the row: the scalar pass below finds the first one */
        } else {
            argmax_merge(&m0, &i0, m1, i1);
            argmax_merge(&m2, &i2, m3, i3);
            argmax_merge(&m0, &i0, m2, i2);
            float vals[8];
            int32_t idx[8];
            _mm256_storeu_ps(vals, m0);
            _mm256_storeu_si256((__m256i *)idx, i0);
            m = vals[0];
            best = idx[0];
            for (int l = 1; l < 8; l++)
                if (vals[l] > m || (vals[l] == m && idx[l] < best)) {
                    m = vals[l];
                    best = idx[l];
                }
        }
    }
#endif
    for (; j < n; j++) {
        if (isnan(x[j])) return j;
        if (x[j] > m) {
            m = x[j];
            best = j;
        }
    }
    return best;
}

/* x [rows, n] float32 (rows stride apart, n >= 1) -> out [rows]: each row's argmax_row. torch's
 * argmax keeps an index beside every comparison and runs ~14x slower than its plain max here. */
void argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {
    #pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}

#define SAMPLE_CHUNK 64 /* numerators summed per chunk: eight vectors of 8 */

/* e[0..64) = exp((x[64c + l] - m) * inv_t) for the chunk c of a row of n: 0 past n and for -inf */
static inline void sample_numerators(const float *x, int64_t n, int64_t c, float m, float inv_t, float *e) {
    int64_t l = 0;
#if HAVE_AVX2
    const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), neg_inf = _mm256_set1_ps(-INFINITY);
    for (; l + 8 <= SAMPLE_CHUNK && SAMPLE_CHUNK * c + l + 8 <= n; l += 8) {
        const __m256 v = _mm256_loadu_ps(x + SAMPLE_CHUNK * c + l);
        const __m256 ex = exp8(_mm256_mul_ps(_mm256_sub_ps(v, mv), tv));
        _mm256_storeu_ps(e + l, _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ), ex));
    }
#endif
    for (; l < SAMPLE_CHUNK; l++) {
        const int64_t j = SAMPLE_CHUNK * c + l;
        e[l] = j < n && x[j] > -INFINITY ? expf((x[j] - m) * inv_t) : 0.0f;
    }
}

/* The largest of x[0..n), or NaN where there is one. */
static float row_max(const float *x, int64_t n) {
    int64_t j = 0;
    float m = -INFINITY;
#if HAVE_AVX2
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; j < n; j++) {
        if (isnan(x[j])) return NAN;
        m = x[j] > m ? x[j] : m;
    }
    return m;
}

/* A draw from softmax(x[0..n) * inv_t) at u in [0, 1) (inv_t > 0: one over the temperature): the
 * first index whose cumulative probability exceeds u times the total, as the sampler's torch path
 * (softmax, cumsum, searchsorted). The
 * numerators exp(x - max) are added in chunks of 64 (`sums`, one per chunk): the total is the
 * chunks' sums added in order, and the walk adds the same sums in the same order to find the
 * chunk the draw falls in, then that chunk's numerators one by one (where rounding leaves the
 * draw past them, it takes the chunk's last token of nonzero probability). -inf (a masked token)
 * has probability 0. Returns -1 for a row with a NaN or no finite logit: the caller draws it. */
static int64_t sample_row(const float *x, int64_t n, float u, float inv_t, float *sums) {
    const float m = row_max(x, n);
    if (!isfinite(m)) return -1;
    const int64_t chunks = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    float e[SAMPLE_CHUNK], total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        sample_numerators(x, n, c, m, inv_t, e);
        float sum = 0.0f;
#if HAVE_AVX2
        __m256 acc = _mm256_loadu_ps(e);
        for (int l = 8; l < SAMPLE_CHUNK; l += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(e + l));
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++) sum += lanes[l];
#else
        for (int l = 0; l < SAMPLE_CHUNK; l++) sum += e[l];
#endif
        sums[c] = sum;
        total += sum;
    }
    float target = u * total;
    if (!(target < total)) target = nextafterf(total, 0.0f);
    float run = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        if (run + sums[c] > target) {
            sample_numerators(x, n, c, m, inv_t, e);
            int64_t last = -1;
            for (int l = 0; l < SAMPLE_CHUNK && SAMPLE_CHUNK * c + l < n; l++) {
                if (e[l] <= 0.0f) continue;
                last = SAMPLE_CHUNK * c + l;
                run += e[l];
                if (run > target) return last;
            }
            if (last >= 0) return last;
        }
        run += sums[c];
    }
    return -1; /* not reached: the sums add up to the total, which exceeds the target */
}

/* x [rows, n] float32 (rows stride apart; logits), inv_t [rows] (one over each row's temperature),
 * u [rows] in [0, 1) -> out [rows]: each row's sample_row (-1 for a row to draw elsewhere). */
void sample_f32(const float *x, int64_t stride, int64_t rows, int64_t n, const float *inv_t, const float *u,
                int64_t *out) {
    #pragma omp parallel if (rows * n >= MIN_PARALLEL_ELEMENTS)
    {
        /* no memory for the chunk sums: the rows are left at -1, for the caller */
        float *sums = malloc(sizeof(float) * (size_t)((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK + 1));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) out[r] = sums ? sample_row(x + r * stride, n, u[r], inv_t[r], sums) : -1;
        free(sums);
    }
}

/* ---- bfloat16 ---- */

static inline float bf16_to_f32(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)bits << 16;
    return v.f;
}

/* Round to nearest even, as torch's float -> bfloat16 (a NaN stays a NaN). */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1)) >> 16);
}

/* f rounded to bf16 and widened back */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if HAVE_AVX512BF16
static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

static inline void store16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, to_bf16(v)); }

/* exp8's computation on 16 floats, scaled by 2^n with vscalefps */
static inline __m512 exp16(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MAX), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(EXP_MAX));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r, p;
    EXP_POLY(_mm512, r, p, n, x);
    return _mm512_mask_blend_ps(over, _mm512_scalef_ps(p, n), _mm512_set1_ps(INFINITY));
}
#endif

/* x [rows, n] bf16 (rows x_stride apart), w [n] bf16 -> y [rows, n] bf16 (contiguous):
 * y = w * bf16(x * (1 / sqrt(mean(x^2) + eps))), the mean in fp32. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, float eps, uint16_t *y, int64_t rows,
                   int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = y + r * n;
        int64_t j = 0;
        float sum = 0.0f;
#if HAVE_AVX512BF16
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            const __m512 v = load16(xr + j);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
#endif
        for (; j < n; j++) sum += bf16_to_f32(xr[j]) * bf16_to_f32(xr[j]);
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        j = 0;
#if HAVE_AVX512BF16
        const __m512 s = _mm512_set1_ps(scale);
        for (; j + 16 <= n; j += 16)
            store16(yr + j, _mm512_mul_ps(load16(w + j), round16(_mm512_mul_ps(load16(xr + j), s))));
#endif
        for (; j < n; j++) yr[j] = f32_to_bf16(bf16_to_f32(w[j]) * round_bf16(bf16_to_f32(xr[j]) * scale));
    }
}

/* gate_up [rows, 2n] bf16 (rows stride apart; gate then up) -> y [rows, n] bf16 (contiguous) =
 * bf16(silu(gate)) * up. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *y, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * stride, *u = g + n;
        uint16_t *yr = y + r * n;
        int64_t j = 0;
#if HAVE_AVX512BF16
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= n; j += 16) {
            const __m512 gv = load16(g + j);
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            store16(yr + j, _mm512_mul_ps(round16(silu), load16(u + j)));
        }
#endif
        for (; j < n; j++) {
            const float gv = bf16_to_f32(g[j]);
            yr[j] = f32_to_bf16(round_bf16(gv / (1.0f + expf(-gv))) * bf16_to_f32(u[j]));
        }
    }
}

/* rotate_rows in bf16: each product and sum rounded to bf16, as torch's bf16 operators do. */
static void rotate_rows_bf16(uint16_t *x, int64_t x_stride, int64_t heads, int64_t half, const uint16_t *cos,
                             const uint16_t *sin, int64_t tokens) {
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x1 = x + t * x_stride + h * 2 * half, *x2 = x1 + half;
            int64_t j = 0;
#if HAVE_AVX512BF16
            for (; j + 16 <= half; j += 16) {
                const __m512 a = load16(x1 + j), b = load16(x2 + j), cv = load16(c + j), sv = load16(s + j);
                store16(x1 + j, _mm512_sub_ps(round16(_mm512_mul_ps(a, cv)), round16(_mm512_mul_ps(b, sv))));
                store16(x2 + j, _mm512_add_ps(round16(_mm512_mul_ps(b, cv)), round16(_mm512_mul_ps(a, sv))));
            }
#endif
            for (; j < half; j++) {
                const float a = bf16_to_f32(x1[j]), b = bf16_to_f32(x2[j]);
                const float cj = bf16_to_f32(c[j]), sj = bf16_to_f32(s[j]);
                x1[j] = f32_to_bf16(round_bf16(a * cj) - round_bf16(b * sj));
                x2[j] = f32_to_bf16(round_bf16(b * cj) + round_bf16(a * sj));
            }
        }
    }
}

/* rotary_f32 in bf16: q, k, cos and sin bf16. */
void rotary_bf16(uint16_t *q, int64_t q_stride, int64_t q_heads, uint16_t *k, int64_t k_stride, int64_t k_heads,
                 int64_t head_dim, const uint16_t *cos, const uint16_t *sin, int64_t tokens) {
    rotate_rows_bf16(q, q_stride, q_heads, head_dim / 2, cos, sin, tokens);
    rotate_rows_bf16(k, k_stride, k_heads, head_dim / 2, cos, sin, tokens);
}

/* 1 when built with AVX2/FMA, 0 for the portable build. */
int fused_simd(void) { return HAVE_AVX2; }

/* 1 when the bf16 kernels are built with AVX-512 BF16, 0 for their portable loops. */
int fused_bf16_simd(void) { return HAVE_AVX512BF16; }

/* The ABI version worker_svc/cpu/fused.py expects; bump it when a signature changes. */
int pagewire_cpu_fused_abi(void) { return 5; }
