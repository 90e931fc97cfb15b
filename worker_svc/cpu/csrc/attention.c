/* Paged attention on CPU, read straight from the block table: no gather, no padding.
 *
 * One flattened step: T query tokens from S sequences (decodes and prefill chunks alike). A
 * sequence's queries are the last q_len positions of its context, causal inside the chunk. Keys
 * and values are read in place from the paged cache [2, num_blocks, block_size, Hkv, D] through
 * the sequence's block table, one block at a time, in two passes per query: every score (q . k,
 * fp32), one softmax over the row, then the values weighted by it. Two passes instead of an online
 * softmax: no rescaling of the accumulators per block, and the softmax runs over whole rows; the
 * price is a scratch row of max context length per head of a group per thread.
 *
 * Work item = (query token, kv head): the G = H / Hkv query heads that share a KV head are done
 * together, so every K/V row is loaded from memory once per item (and from L1 by the other heads).
 * Items are spread over the OpenMP threads (the same libgomp that torch loaded, by soname).
 *
 * On CPUs with AVX2 and a head_dim that is a multiple of 8, the inner loops are written with
 * intrinsics (eight keys' dot products at a time, value accumulators in registers, an eight-lane
 * exp); otherwise plain loops that the compiler vectorizes as it can. A bf16 query over a bf16
 * cache takes its scores from AVX-512 BF16 dot products where the CPU has them (block_scores_dot),
 * and its values pass widens each element once for 2 or 3 query heads (group_values_bf16).
 * On a 2-core AVX2 host, in
 * SmolLM2's decode steps (32 sequences of ~50 tokens, 9 query heads over 3 KV heads of 64), the
 * intrinsics took the kernel from ~400 to ~215 us per layer; what is left is mostly the context
 * arriving from memory (software prefetch of the next block did not change it).
 *
 * Built at first use by worker_svc/cpu/attention.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; the torch reference in kvcache/paged.py is what tests hold it to.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

/* e^x for x <= 0 (softmax arguments), vectorizable: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2,
 * a degree-6 polynomial (relative error ~2e-7, about fp32's own) and the exponent set by bit ops.
 * Below -87 the result would be subnormal; it is 0, as softmax wants. */
static inline float exp_neg(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(xc * log2e); /* nearest integer */
    const float r = (xc - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* A block's scores and values one element at a time: without AVX2, or when head_dim is not a
 * multiple of 8. */
#define LOAD_F32(x) (x)
#define SCALAR_SCORES(KVT, LOAD1)                                                                           \
    for (int64_t j = 0; j < n; j++) {                                                                       \
        const KVT *k = kb + j * row;                                                                        \
        float dot = 0.0f;                                                                                   \
        _Pragma("omp simd reduction(+:dot)")                                                                \
        for (int64_t d = 0; d < head_dim; d++) dot += q[d] * LOAD1(k[d]);                                  \
        sc[j] = dot;                                                                                        \
    }
#define SCALAR_VALUES(KVT, LOAD1)                                                                           \
    for (int64_t j = 0; j < n; j++) {                                                                       \
        const float pj = p[j];                                                                              \
        const KVT *v = vb + j * row;                                                                        \
        _Pragma("omp simd")                                                                                 \
        for (int64_t d = 0; d < head_dim; d++) acc[d] += pj * LOAD1(v[d]);                                  \
    }

#if HAVE_AVX2
/* The AVX2 path (head_dim a multiple of 8): a block's scores eight keys at a time, each key's dot
 * product in a register of its own over head_dim and the eight reduced together; its values into
 * eight accumulators held in registers across the block; the softmax eight lanes at a time. */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* lane i = the sum of a_i's lanes */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hsum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline float hmax1(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* exp_neg on eight lanes, the same steps */
static inline __m256 exp8_neg(__m256 x) {
    const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), _mm256_mul_ps(p, scale));
}

#define DEFINE_BLOCK(SUFFIX, KVT, LOAD1, LOAD8)                                                             \
/* sc[j] = q . k_j for the n key rows at kb, `row` elements apart */                                        \
static inline void block_scores_##SUFFIX(const float *q, const KVT *kb, int64_t row, int64_t n,             \
                                         int64_t head_dim, float *sc) {                                     \
    if (head_dim % 8) {                                                                                     \
        SCALAR_SCORES(KVT, LOAD1);                                                                          \
        return;                                                                                             \
    }                                                                                                       \
    int64_t j = 0;                                                                                          \
    for (; j + 8 <= n; j += 8) {                                                                            \
        const KVT *k = kb + j * row;                                                                        \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;     \
        for (int64_t d = 0; d < head_dim; d += 8) {                                                         \
            const __m256 qv = _mm256_loadu_ps(q + d);                                                       \
            a0 = _mm256_fmadd_ps(LOAD8(k + d), qv, a0);                                                     \
            a1 = _mm256_fmadd_ps(LOAD8(k + row + d), qv, a1);                                               \
            a2 = _mm256_fmadd_ps(LOAD8(k + 2 * row + d), qv, a2);                                           \
            a3 = _mm256_fmadd_ps(LOAD8(k + 3 * row + d), qv, a3);                                           \
            a4 = _mm256_fmadd_ps(LOAD8(k + 4 * row + d), qv, a4);                                           \
            a5 = _mm256_fmadd_ps(LOAD8(k + 5 * row + d), qv, a5);                                           \
            a6 = _mm256_fmadd_ps(LOAD8(k + 6 * row + d), qv, a6);                                           \
            a7 = _mm256_fmadd_ps(LOAD8(k + 7 * row + d), qv, a7);                                           \
        }                                                                                                   \
        _mm256_storeu_ps(sc + j, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));                                    \
    }                                                                                                       \
    for (; j < n; j++) {                                                                                    \
        const KVT *k = kb + j * row;                                                                        \
        __m256 a = _mm256_setzero_ps();                                                                     \
        for (int64_t d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(LOAD8(k + d), _mm256_loadu_ps(q + d), a); \
        sc[j] = hsum1(a);                                                                                   \
    }                                                                                                       \
}                                                                                                           \
/* acc += sum over j < n of p[j] v_j, for the n value rows at vb */                                         \
static inline void block_values_##SUFFIX(float *acc, const float *p, const KVT *vb, int64_t row, int64_t n, \
                                         int64_t head_dim) {                                                \
    if (head_dim % 8) {                                                                                     \
        SCALAR_VALUES(KVT, LOAD1);                                                                          \
        return;                                                                                             \
    }                                                                                                       \
    int64_t d = 0;                                                                                          \
    for (; d + 64 <= head_dim; d += 64) { /* eight chains, so FMA latency is hidden */                      \
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);                            \
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);                      \
        __m256 a4 = _mm256_loadu_ps(acc + d + 32), a5 = _mm256_loadu_ps(acc + d + 40);                      \
        __m256 a6 = _mm256_loadu_ps(acc + d + 48), a7 = _mm256_loadu_ps(acc + d + 56);                      \
        for (int64_t j = 0; j < n; j++) {                                                                   \
            const __m256 pj = _mm256_broadcast_ss(p + j);                                                   \
            const KVT *v = vb + j * row + d;                                                                \
            a0 = _mm256_fmadd_ps(pj, LOAD8(v), a0);                                                         \
            a1 = _mm256_fmadd_ps(pj, LOAD8(v + 8), a1);                                                     \
            a2 = _mm256_fmadd_ps(pj, LOAD8(v + 16), a2);                                                    \
            a3 = _mm256_fmadd_ps(pj, LOAD8(v + 24), a3);                                                    \
            a4 = _mm256_fmadd_ps(pj, LOAD8(v + 32), a4);                                                    \
            a5 = _mm256_fmadd_ps(pj, LOAD8(v + 40), a5);                                                    \
            a6 = _mm256_fmadd_ps(pj, LOAD8(v + 48), a6);                                                    \
            a7 = _mm256_fmadd_ps(pj, LOAD8(v + 56), a7);                                                    \
        }                                                                                                   \
        _mm256_storeu_ps(acc + d, a0);                                                                      \
        _mm256_storeu_ps(acc + d + 8, a1);                                                                  \
        _mm256_storeu_ps(acc + d + 16, a2);                                                                 \
        _mm256_storeu_ps(acc + d + 24, a3);                                                                 \
        _mm256_storeu_ps(acc + d + 32, a4);                                                                 \
        _mm256_storeu_ps(acc + d + 40, a5);                                                                 \
        _mm256_storeu_ps(acc + d + 48, a6);                                                                 \
        _mm256_storeu_ps(acc + d + 56, a7);                                                                 \
    }                                                                                                       \
    for (; d < head_dim; d += 8) {                                                                          \
        __m256 a = _mm256_loadu_ps(acc + d);                                                                \
        for (int64_t j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), LOAD8(vb + j * row + d), a); \
        _mm256_storeu_ps(acc + d, a);                                                                       \
    }                                                                                                       \
}
#else
#define DEFINE_BLOCK(SUFFIX, KVT, LOAD1, LOAD8)                                                             \
static inline void block_scores_##SUFFIX(const float *q, const KVT *kb, int64_t row, int64_t n,             \
                                         int64_t head_dim, float *sc) {                                     \
    SCALAR_SCORES(KVT, LOAD1);                                                                              \
}                                                                                                           \
static inline void block_values_##SUFFIX(float *acc, const float *p, const KVT *vb, int64_t row, int64_t n, \
                                         int64_t head_dim) {                                                \
    SCALAR_VALUES(KVT, LOAD1);                                                                              \
}
#endif
DEFINE_BLOCK(f32, float, LOAD_F32, load8_f32)
DEFINE_BLOCK(bf16, uint16_t, bf16_to_f32, load8_bf16)

/* Scores of a bf16 query over bf16 keys with AVX-512 BF16 dot products (head_dim a multiple of 32):
 * sc[j] = scale * (q . k_j), q the head's query as the model gave it. vdpbf16ps multiplies 32 bf16
 * pairs an instruction, each product exact in fp32, where the loop above widens every key element
 * to fp32 for each query head first (two vector operations per eight elements, then the FMA).
 * Without AVX-512 BF16 neither this nor group_values_bf16 is called; their stand-ins after #else
 * compute the same. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && HAVE_AVX2
#define HAVE_DPBF16 1
static inline __m256 fold16(__m512 a) { /* lanes i and i + 8 added */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline void block_scores_dot(const uint16_t *q, float scale, const uint16_t *kb, int64_t row, int64_t n,
                                    int64_t head_dim, float *sc) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const uint16_t *k = kb + j * row;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < head_dim; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(k + d), qv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(k + row + d), qv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(k + 2 * row + d), qv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(k + 3 * row + d), qv);
            a4 = _mm512_dpbf16_ps(a4, (__m512bh)_mm512_loadu_si512(k + 4 * row + d), qv);
            a5 = _mm512_dpbf16_ps(a5, (__m512bh)_mm512_loadu_si512(k + 5 * row + d), qv);
            a6 = _mm512_dpbf16_ps(a6, (__m512bh)_mm512_loadu_si512(k + 6 * row + d), qv);
            a7 = _mm512_dpbf16_ps(a7, (__m512bh)_mm512_loadu_si512(k + 7 * row + d), qv);
        }
        const __m256 s8 = hsum8(fold16(a0), fold16(a1), fold16(a2), fold16(a3), fold16(a4), fold16(a5), fold16(a6),
                                fold16(a7));
        _mm256_storeu_ps(sc + j, _mm256_mul_ps(s8, sv));
    }
    for (; j < n; j++) {
        const uint16_t *k = kb + j * row;
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + d), (__m512bh)_mm512_loadu_si512(q + d));
        sc[j] = _mm512_reduce_add_ps(a) * scale;
    }
}

/* acc_g += sum over j < n of p_g[j] v_j for the G = 2 or 3 query heads of a KV head (p_g at
 * p + g * p_stride), 64 columns at a time: each bf16 value element is widened once for all the
 * heads, the 3 x 8 accumulators held in AVX-512's 32 registers. The same FMAs in the same order as
 * block_values_bf16 per head, so the same bits. */
static inline __attribute__((always_inline)) void group_values_bf16(float *acc, int64_t acc_stride, const float *p,
                                                                    int64_t p_stride, const uint16_t *vb, int64_t row,
                                                                    int64_t n, int64_t head_dim, const int group) {
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        __m256 a[3][8];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 8; c++) a[g][c] = _mm256_loadu_ps(acc + g * acc_stride + d + 8 * c);
        for (int64_t j = 0; j < n; j++) {
            __m256 pj[3];
            for (int g = 0; g < group; g++) pj[g] = _mm256_broadcast_ss(p + g * p_stride + j);
            const uint16_t *v = vb + j * row + d;
            for (int c = 0; c < 8; c++) {
                const __m256 vc = load8_bf16(v + 8 * c);
                for (int g = 0; g < group; g++) a[g][c] = _mm256_fmadd_ps(pj[g], vc, a[g][c]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + g * acc_stride + d + 8 * c, a[g][c]);
    }
    if (d < head_dim)
        for (int g = 0; g < group; g++)
            block_values_bf16(acc + g * acc_stride + d, p + g * p_stride, vb + d, row, n, head_dim - d);
}
#else
#define HAVE_DPBF16 0
static inline void group_values_bf16(float *acc, int64_t acc_stride, const float *p, int64_t p_stride,
                                     const uint16_t *vb, int64_t row, int64_t n, int64_t head_dim, const int group) {
    for (int g = 0; g < group; g++) block_values_bf16(acc + g * acc_stride, p + g * p_stride, vb, row, n, head_dim);
}
static inline void block_scores_dot(const uint16_t *q, float scale, const uint16_t *kb, int64_t row, int64_t n,
                                    int64_t head_dim, float *sc) {
    for (int64_t j = 0; j < n; j++) {
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) dot += bf16_to_f32(q[d]) * bf16_to_f32(kb[j * row + d]);
        sc[j] = dot * scale;
    }
}
#endif

/* s[0..len) = softmax numerators exp(s - max); returns their sum */
static inline float softmax_row(float *s, int64_t len) {
    int64_t j = 0;
    float m = -INFINITY, l = 0.0f;
#if HAVE_AVX2
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= len; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    m = hmax1(m8);
#endif
    for (; j < len; j++) m = s[j] > m ? s[j] : m;
    j = 0;
#if HAVE_AVX2
    const __m256 mv = _mm256_set1_ps(m);
    __m256 l8 = _mm256_setzero_ps();
    for (; j + 8 <= len; j += 8) {
        const __m256 e = exp8_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        l8 = _mm256_add_ps(l8, e);
    }
    l = hsum1(l8);
#endif
    for (; j < len; j++) {
        s[j] = exp_neg(s[j] - m);
        l += s[j];
    }
    return l;
}

/* Returns 0 on success, a negative code when the metadata is inconsistent (checked before any
 * work, so nothing is written on error). BF16_BOTH: bf16 queries over a bf16 cache, which take
 * block_scores_dot and group_values_bf16 where the CPU has AVX-512 BF16. */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, KVT, BLOCK_SCORES, BLOCK_VALUES, BF16_BOTH)          \
int NAME(const T *query,            /* [num_tokens, H, D] */                                               \
         const KVT *kv,             /* [2, num_blocks, block_size, Hkv, D] */                              \
         T *out,                    /* [num_tokens, H, D] */                                               \
         const int32_t *query_start_loc, /* [S + 1] */                                                     \
         const int32_t *seq_lens,   /* [S] */                                                              \
         const int32_t *block_tables, int64_t block_table_stride, /* [S, stride] */                        \
         int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,  \
         int64_t num_blocks, int64_t block_size, float scale,                                              \
         int64_t max_query_len /* longer chunks are skipped: their rows of out are not written */) {       \
    if (num_heads % num_kv_heads) return -1;                                                               \
    if (query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens) return -2;                     \
    for (int64_t s = 0; s < num_seqs; s++) {                                                               \
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];                                       \
        if (q_len < 0 || q_len > seq_lens[s]) return -3;                                                   \
        int64_t nb = (seq_lens[s] + block_size - 1) / block_size;                                          \
        if (nb > block_table_stride) return -4;                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            int32_t id = block_tables[s * block_table_stride + b];                                         \
            if (id < 0 || id >= num_blocks) return -5;                                                     \
        }                                                                                                  \
    }                                                                                                      \
    const int64_t group = num_heads / num_kv_heads;                                                        \
    const int64_t kv_half = num_blocks * block_size * num_kv_heads * head_dim; /* K to V offset */         \
    const int64_t row = num_kv_heads * head_dim;                                                           \
    /* bf16 queries over a bf16 cache on AVX-512 BF16: dot-product scores from the query as given (the  \
     * scaled fp32 copy is not made), values widened once for the heads of a KV head */                  \
    const int dot_scores = BF16_BOTH && HAVE_DPBF16 && head_dim % 32 == 0;                                 \
    const int grouped_values = BF16_BOTH && HAVE_DPBF16 && (group == 2 || group == 3);                     \
    /* the query tokens this call computes, and their sequences */                                       \
    int64_t *token_seq = (int64_t *)malloc(sizeof(int64_t) * 2 * (num_tokens > 0 ? num_tokens : 1));      \
    if (!token_seq) return -6;                                                                             \
    int64_t *tokens = token_seq + (num_tokens > 0 ? num_tokens : 1), num_included = 0;                     \
    for (int64_t s = 0; s < num_seqs; s++)                                                                 \
        if (query_start_loc[s + 1] - query_start_loc[s] <= max_query_len)                                  \
            for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) {                       \
                token_seq[t] = s;                                                                          \
                tokens[num_included++] = t;                                                                \
            }                                                                                              \
    const int64_t num_items = num_included * num_kv_heads;                                                 \
    int64_t max_len = 1; /* the longest context a query of this call attends over */                      \
    for (int64_t i = 0; i < num_included; i++)                                                             \
        if (seq_lens[token_seq[tokens[i]]] > max_len) max_len = seq_lens[token_seq[tokens[i]]];           \
    int failed = 0;                                                                                        \
    _Pragma("omp parallel")                                                                                \
    {                                                                                                      \
        /* per thread: q (fp32, scaled) [G, D], acc [G, D], scores then probabilities [G, max_len] */     \
        float *scratch = (float *)malloc(sizeof(float) * group * (2 * head_dim + max_len));               \
        if (!scratch) {                                                                                    \
            _Pragma("omp atomic write") failed = 1;                                                        \
        }                                                                                                  \
        _Pragma("omp for schedule(dynamic, 4)")                                                            \
        for (int64_t item = 0; item < num_items; item++) {                                                 \
            if (!scratch) continue;                                                                        \
            const int64_t t = tokens[item / num_kv_heads], h = item % num_kv_heads, s = token_seq[t];     \
            const int64_t seq_len = seq_lens[s];                                                           \
            const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];                             \
            const int64_t len = seq_len - q_len + (t - query_start_loc[s]) + 1; /* keys it sees */        \
            const int32_t *table = block_tables + s * block_table_stride;                                  \
            float *q = scratch, *acc = q + group * head_dim, *sc = acc + group * head_dim;                 \
            for (int64_t g = 0; g < group && !dot_scores; g++) {                                           \
                const T *src = query + (t * num_heads + h * group + g) * head_dim;                         \
                for (int64_t d = 0; d < head_dim; d++) q[g * head_dim + d] = LOAD(src[d]) * scale;         \
            }                                                                                              \
            memset(acc, 0, sizeof(float) * group * head_dim);                                              \
            /* pass 1: every score, block by block (each key row loaded once for the G heads) */          \
            for (int64_t start = 0; start < len; start += block_size) {                                    \
                const int64_t n = len - start < block_size ? len - start : block_size;                     \
                const KVT *kb = kv + ((int64_t)table[start / block_size] * block_size) * row + h * head_dim; \
                if (dot_scores)                                                                            \
                    for (int64_t g = 0; g < group; g++)                                                    \
                        block_scores_dot((const uint16_t *)(query + (t * num_heads + h * group + g) * head_dim), \
                                         scale, (const uint16_t *)kb, row, n, head_dim, sc + g * max_len + start); \
                else                                                                                       \
                    for (int64_t g = 0; g < group; g++)                                                    \
                        BLOCK_SCORES(q + g * head_dim, kb, row, n, head_dim, sc + g * max_len + start);    \
            }                                                                                              \
            float inv[group];                                                                              \
            for (int64_t g = 0; g < group; g++) inv[g] = 1.0f / softmax_row(sc + g * max_len, len);       \
            /* pass 2: the values, weighted by the probabilities */                                       \
            for (int64_t start = 0; start < len; start += block_size) {                                    \
                const int64_t n = len - start < block_size ? len - start : block_size;                     \
                const KVT *vb = kv + kv_half + ((int64_t)table[start / block_size] * block_size) * row + h * head_dim; \
                if (grouped_values) {                                                                      \
                    if (group == 2)                                                                        \
                        group_values_bf16(acc, head_dim, sc + start, max_len, (const uint16_t *)vb, row, n, head_dim, 2); \
                    else                                                                                   \
                        group_values_bf16(acc, head_dim, sc + start, max_len, (const uint16_t *)vb, row, n, head_dim, 3); \
                } else                                                                                     \
                    for (int64_t g = 0; g < group; g++)                                                    \
                        BLOCK_VALUES(acc + g * head_dim, sc + g * max_len + start, vb, row, n, head_dim);  \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++) {                                                          \
                T *dst = out + (t * num_heads + h * group + g) * head_dim;                                 \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[g * head_dim + d] * inv[g]);     \
            }                                                                                              \
        }                                                                                                  \
        free(scratch);                                                                                     \
    }                                                                                                      \
    free(token_seq);                                                                                       \
    return failed ? -6 : 0;                                                                                \
}

#define STORE_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_BF16(x) f32_to_bf16(x)

/* (query and output, cache) */
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, LOAD_F32, STORE_F32, float, block_scores_f32, block_values_f32, 0)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16, uint16_t, block_scores_bf16,
                       block_values_bf16, 1)
/* fp32 activations over a bf16 cache: a bf16 model on a CPU without native bf16 (the worker's
 * cpu/bf16_linear.py) */
DEFINE_PAGED_ATTENTION(paged_attention_f32_bf16kv, float, LOAD_F32, STORE_F32, uint16_t, block_scores_bf16,
                       block_values_bf16, 0)

/* The append of a step's K and V rows into a layer's cache [2, num_slots, row_bytes] (kvcache.paged.write_kv's
 * scatter, for caches of the activations' dtype): token t's rows (key + t * key_stride, value + t * value_stride,
 * bytes) go to slot slots[t]. Returns -5, writing nothing, when a slot is outside the cache. */
int kv_write(char *kv, int64_t num_slots, int64_t row_bytes, const char *key, int64_t key_stride, const char *value,
             int64_t value_stride, const int64_t *slots, int64_t num_tokens) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -5;
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(kv + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(kv + (num_slots + slots[t]) * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}

/* The ABI version worker_svc/cpu/attention.py expects; bump it when a signature changes. */
int pagewire_cpu_kernels_abi(void) { return 3; }
