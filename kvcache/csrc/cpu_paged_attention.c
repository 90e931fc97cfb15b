/* Paged attention on CPU, read straight from the block table: no gather, no padding.
 *
 * One flattened step: T query tokens from S sequences (decodes and prefill chunks alike). A
 * sequence's queries are the last q_len positions of its context, causal inside the chunk. Keys
 * and values are read in place from the paged cache [2, num_blocks, block_size, Hkv, D] through
 * the sequence's block table, one block at a time, with an online softmax in fp32.
 *
 * Work item = (query token, kv head): the G = H / Hkv query heads that share a KV head are done
 * together, so every K/V row is loaded once per item. Items are spread over the OpenMP threads
 * (the same libgomp that torch loaded, by soname).
 *
 * Built at first use by kvcache/cpu_kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; the torch reference in kvcache/paged.py is what tests hold it to.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Returns 0 on success, a negative code when the metadata is inconsistent (checked before any
 * work, so nothing is written on error). */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, KVT, KV_LOAD)                                          \
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
    int failed = 0;                                                                                        \
    _Pragma("omp parallel")                                                                                \
    {                                                                                                      \
        /* per thread: q (fp32) [G, D], scores [G, block_size], acc [G, D], max [G], sum [G] */           \
        float *scratch = (float *)malloc(sizeof(float) * (group * (2 * head_dim + block_size + 2)));      \
        if (!scratch) {                                                                                    \
            _Pragma("omp atomic write") failed = 1;                                                        \
        }                                                                                                  \
        _Pragma("omp for schedule(dynamic, 4)")                                                            \
        for (int64_t item = 0; item < num_items; item++) {                                                 \
            if (!scratch) continue;                                                                        \
            const int64_t t = tokens[item / num_kv_heads], h = item % num_kv_heads, s = token_seq[t];             \
            const int64_t seq_len = seq_lens[s];                                                           \
            const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];                             \
            const int64_t pos = seq_len - q_len + (t - query_start_loc[s]); /* this query's position */    \
            const int32_t *table = block_tables + s * block_table_stride;                                  \
            float *q = scratch, *acc = q + group * head_dim, *sc = acc + group * head_dim;                 \
            float *mx = sc + group * block_size, *sum = mx + group;                                        \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const T *src = query + (t * num_heads + h * group + g) * head_dim;                         \
                for (int64_t d = 0; d < head_dim; d++) q[g * head_dim + d] = LOAD(src[d]) * scale;         \
                mx[g] = -INFINITY;                                                                         \
                sum[g] = 0.0f;                                                                             \
            }                                                                                              \
            memset(acc, 0, sizeof(float) * group * head_dim);                                              \
            for (int64_t start = 0; start <= pos; start += block_size) {                                   \
                const int64_t n = (pos + 1 - start) < block_size ? (pos + 1 - start) : block_size;         \
                const KVT *kb = kv + ((int64_t)table[start / block_size] * block_size) * row + h * head_dim; \
                const KVT *vb = kb + kv_half;                                                              \
                for (int64_t g = 0; g < group; g++) {                                                      \
                    const float *qg = q + g * head_dim;                                                    \
                    float m = mx[g];                                                                       \
                    for (int64_t j = 0; j < n; j++) {                                                      \
                        const KVT *k = kb + j * row;                                                       \
                        float dot = 0.0f;                                                                  \
                        _Pragma("omp simd reduction(+:dot)")                                               \
                        for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * KV_LOAD(k[d]);              \
                        sc[g * block_size + j] = dot;                                                      \
                        m = dot > m ? dot : m;                                                             \
                    }                                                                                      \
                    const float correction = exp_neg(mx[g] - m); /* 0 on the first block */             \
                    mx[g] = m;                                                                             \
                    float *ag = acc + g * head_dim, *pg = sc + g * block_size;                             \
                    float l = sum[g] * correction;                                                         \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < head_dim; d++) ag[d] *= correction;                            \
                    _Pragma("omp simd reduction(+:l)")                                                     \
                    for (int64_t j = 0; j < n; j++) {                                                      \
                        pg[j] = exp_neg(pg[j] - m);                                                        \
                        l += pg[j];                                                                        \
                    }                                                                                      \
                    for (int64_t j = 0; j < n; j++) {                                                      \
                        const float p = pg[j];                                                             \
                        const KVT *v = vb + j * row;                                                       \
                        _Pragma("omp simd")                                                                \
                        for (int64_t d = 0; d < head_dim; d++) ag[d] += p * KV_LOAD(v[d]);                 \
                    }                                                                                      \
                    sum[g] = l;                                                                            \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++) {                                                          \
                T *dst = out + (t * num_heads + h * group + g) * head_dim;                                 \
                const float inv = 1.0f / sum[g];                                                           \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[g * head_dim + d] * inv);        \
            }                                                                                              \
        }                                                                                                  \
        free(scratch);                                                                                     \
    }                                                                                                      \
    free(token_seq);                                                                                       \
    return failed ? -6 : 0;                                                                                \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_BF16(x) f32_to_bf16(x)

/* (query and output, cache) */
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, LOAD_F32, STORE_F32, float, LOAD_F32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16, uint16_t, LOAD_BF16)
/* fp32 activations over a bf16 cache: a bf16 model on a CPU without native bf16 (the worker's
 * layers/cpu_bf16_linear.py) */
DEFINE_PAGED_ATTENTION(paged_attention_f32_bf16kv, float, LOAD_F32, STORE_F32, uint16_t, LOAD_BF16)

/* The ABI version kvcache/cpu_kernels.py expects; bump it when a signature changes. */
int pagewire_cpu_kernels_abi(void) { return 3; }
