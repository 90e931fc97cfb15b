/* y = x W^T + b on CPU with W kept in a 4- or 8-bit block format (GGUF Q4_0, Q4_1, Q8_0), b
 * float32, x and y float32 (quant_linear: each weight dequantized to fp32 in registers and
 * multiplied by an fp32 FMA) or bfloat16 (quant_linear_bf16, on AVX-512 BF16: the fp32 weight
 * rounded to bf16 and multiplied by vdpbf16ps dot products or AMX tiles, or for calls of few rows
 * on AMX CPUs x split into int8 digits and multiplied exactly in integers, below); or x rounded to
 * int8 per block and multiplied in integers (quant_linear_i8, --int8-activations, further below).
 *
 * A block holds 32 consecutive weights of one output row with an fp16 scale d (and for Q4_1 an
 * fp16 offset m): Q4_0 w = (q - 8) d, q in 0..15; Q4_1 w = q d + m, q in 0..15; Q8_0 w = q d, q in
 * -128..127. The products q d are exact in fp32 (11-bit d times a 4- or 8-bit q), so fma(q, d, m)
 * rounds once, as d * q + m does: the weights are bit for bit those of the dequantized model
 * (gguf.quants.dequantize), and each output is summed in order along k (acc = fma(x[k], w[k],
 * acc) from k = 0) whatever the number of rows, so a row's result does not depend on its batch.
 *
 * Packed layout: the output columns are padded to a multiple of 32 and taken 32 at a time (a
 * group); group g is nb = k / 32 tiles in a row, tile b covering k in [32 b, 32 b + 32):
 *   d[32] fp16 (column j's scale), Q4_1 only: m[32] fp16, then the quants:
 *   Q4_0/Q4_1: 16 rows of 32 bytes, row t byte j = q[j][32b + 2t] | q[j][32b + 2t + 1] << 4;
 *   Q8_0:      32 rows of 32 int8, row i byte j = q[j][32b + i].
 * A tile is exactly as large as 32 GGUF blocks (576, 640, 1088 bytes), so the packed weight is the
 * file's size (plus at most 31 zero columns). One 32-byte row widens to the 32 columns of one k
 * (two for 4 bits: the low then the high nibbles) in 2 vectors of 16 (AVX-512) or 4 of 8 (AVX2).
 *
 * Rows: up to DIRECT_ROWS rows (decode, one stream) dequantize each tile in registers as they
 * multiply it; more rows dequantize a group SLICE_K values of k at a time into a per-thread fp32
 * buffer (8 KiB, in L1) and multiply blocks of rows by each slice, each block's weight vectors held
 * in registers (buffer_rows) and its rows' partial sums carried from slice to slice in memory (the
 * same weights, the same order of sums). Rows go in chunks of
 * ~256 KiB of x, so a chunk stays in L2 while the groups pass over it. OpenMP threads split the
 * groups statically.
 *
 * Built at first use by worker_svc/cpu/quantized.py (through worker_svc.cpu.build) and called
 * through ctypes; ``dequantize_ref`` there (torch) is what tests hold it to.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml's type ids */
#define GROUP 32                       /* output columns of a group */
#define QK 32                          /* weights of a block */
#define CHUNK_BYTES (256 << 10)        /* of x per row chunk */
#define SLICE_K 64                     /* k per dequantized slice of a group: 8 KiB of fp32, in L1 */

static inline int64_t tile_bytes(int type) { return type == Q4_0 ? 576 : type == Q4_1 ? 640 : 1088; }
static inline int64_t quants_offset(int type) { return type == Q4_1 ? 128 : 64; }

static inline float half_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        v.u = sign | ((exp + 112) << 23) | (mant << 13);
    } else { /* zero or subnormal: mant * 2^-24, exact in fp32 */
        v.f = (float)mant * 5.9604644775390625e-08f;
        v.u |= sign;
    }
    return v.f;
}

/* Weight (column j, k index kk within the tile) of one tile, as the kernels compute it. */
static inline float tile_weight(int type, const uint8_t *tile, int j, int kk) {
    const uint16_t *h = (const uint16_t *)tile;
    const float d = half_to_float(h[j]);
    const uint8_t *qs = tile + quants_offset(type);
    if (type == Q8_0) return (float)(int8_t)qs[kk * GROUP + j] * d;
    const uint8_t byte = qs[(kk / 2) * GROUP + j];
    const int q = kk & 1 ? byte >> 4 : byte & 15;
    if (type == Q4_0) return (float)(q - 8) * d;
    return __builtin_fmaf((float)q, d, half_to_float(h[GROUP + j]));
}

#if defined(__AVX512F__)
#define SIMD 512
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
#define VF_ZERO() _mm512_setzero_ps()
#define VF_SET1(v) _mm512_set1_ps(v)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VF_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VI_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_S8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_LOW(v) _mm512_and_si512(v, _mm512_set1_epi32(15))
#define VI_HIGH(v) _mm512_srli_epi32(v, 4)
#define VF_CVT(v) _mm512_cvtepi32_ps(v)
#define DIRECT_ROWS 8
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD 256
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
#define VF_ZERO() _mm256_setzero_ps()
#define VF_SET1(v) _mm256_set1_ps(v)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VF_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VI_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_S8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_LOW(v) _mm256_and_si256(v, _mm256_set1_epi32(15))
#define VI_HIGH(v) _mm256_srli_epi32(v, 4)
#define VF_CVT(v) _mm256_cvtepi32_ps(v)
#define DIRECT_ROWS 2
#else
#define SIMD 0
#define DIRECT_ROWS 4
#endif

#if SIMD
#define NV (GROUP / VL) /* vectors per group row */
#define MRB 6           /* the most rows of a block from the buffer (buffer_rows) */

/* Store acc rows (+ bias) into y's columns [col, col + cols). */
static inline void store_rows(const float *acc, int mr, float *y, int64_t y_stride, const float *bias, int64_t col,
                              int64_t cols) {
    for (int r = 0; r < mr; r++) {
        float *dst = y + r * y_stride + col;
        const float *a = acc + r * GROUP;
        if (bias)
            for (int64_t j = 0; j < cols; j++) dst[j] = a[j] + bias[col + j];
        else
            memcpy(dst, a, sizeof(float) * (size_t)cols);
    }
}

/* mr rows of x times one group (nb tiles), each tile dequantized in registers. TYPE and MR are
 * constants after inlining. */
static inline __attribute__((always_inline)) void group_direct(
    const int type, const float *x, int64_t x_stride, const uint8_t *tiles, int64_t nb, const int mr,
    float *y, int64_t y_stride, const float *bias, int64_t col, int64_t cols) {
    const int64_t tb = tile_bytes(type);
    vf acc[DIRECT_ROWS][NV];
#pragma GCC unroll 16
    for (int r = 0; r < DIRECT_ROWS; r++)
#pragma GCC unroll 16
        for (int v = 0; v < NV; v++) acc[r][v] = VF_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        const float *xb = x + b * QK;
        vf d[NV], m[NV];
#pragma GCC unroll 16
        for (int v = 0; v < NV; v++) {
            d[v] = VF_HALF(tile + 2 * v * VL);
            m[v] = type == Q4_1 ? VF_HALF(tile + 2 * GROUP + 2 * v * VL) : VF_MUL(d[v], VF_SET1(-8.0f));
        }
        if (type == Q8_0) {
            for (int i = 0; i < QK; i++) {
#pragma GCC unroll 16
                for (int v = 0; v < NV; v++) {
                    const vf w = VF_MUL(VF_CVT(VI_S8(qs + i * GROUP + v * VL)), d[v]);
#pragma GCC unroll 16
                    for (int r = 0; r < DIRECT_ROWS; r++)
                        if (r < mr) acc[r][v] = VF_FMA(VF_SET1(xb[r * x_stride + i]), w, acc[r][v]);
                }
            }
        } else {
            for (int t = 0; t < QK / 2; t++) {
#pragma GCC unroll 16
                for (int v = 0; v < NV; v++) {
                    const vi q = VI_U8(qs + t * GROUP + v * VL);
                    const vf w0 = VF_FMA(VF_CVT(VI_LOW(q)), d[v], m[v]);
                    const vf w1 = VF_FMA(VF_CVT(VI_HIGH(q)), d[v], m[v]);
#pragma GCC unroll 16
                    for (int r = 0; r < DIRECT_ROWS; r++)
                        if (r < mr) {
                            acc[r][v] = VF_FMA(VF_SET1(xb[r * x_stride + 2 * t]), w0, acc[r][v]);
                            acc[r][v] = VF_FMA(VF_SET1(xb[r * x_stride + 2 * t + 1]), w1, acc[r][v]);
                        }
                }
            }
        }
    }
    float out[DIRECT_ROWS * GROUP] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int r = 0; r < DIRECT_ROWS; r++)
#pragma GCC unroll 16
        for (int v = 0; v < NV; v++)
            if (r < mr) VF_STORE(out + r * GROUP + v * VL, acc[r][v]);
    store_rows(out, mr, y, y_stride, bias, col, cols);
}

/* One copy per type and row count. */
#define DIRECT_TYPE(NAME, TYPE)                                                                          \
    static void NAME(const float *x, int64_t xs, const uint8_t *tiles, int64_t nb, int mr, float *y,     \
                     int64_t ys, const float *bias, int64_t col, int64_t cols) {                         \
        switch (mr) {                                                                                    \
        case 1: group_direct(TYPE, x, xs, tiles, nb, 1, y, ys, bias, col, cols); break;                   \
        case 2: group_direct(TYPE, x, xs, tiles, nb, 2, y, ys, bias, col, cols); break;                   \
        case 3: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS < 3 ? DIRECT_ROWS : 3, y, ys, bias, col, \
                             cols); break;                                                                \
        case 4: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS < 4 ? DIRECT_ROWS : 4, y, ys, bias, col, \
                             cols); break;                                                                \
        case 5: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS < 5 ? DIRECT_ROWS : 5, y, ys, bias, col, \
                             cols); break;                                                                \
        case 6: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS < 6 ? DIRECT_ROWS : 6, y, ys, bias, col, \
                             cols); break;                                                                \
        case 7: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS < 7 ? DIRECT_ROWS : 7, y, ys, bias, col, \
                             cols); break;                                                                \
        default: group_direct(TYPE, x, xs, tiles, nb, DIRECT_ROWS, y, ys, bias, col, cols); break;        \
        }                                                                                                \
    }
DIRECT_TYPE(direct_q4_0, Q4_0)
DIRECT_TYPE(direct_q4_1, Q4_1)
DIRECT_TYPE(direct_q8_0, Q8_0)

/* One group (nb tiles) dequantized into buf [nb * 32][32] fp32. */
static inline __attribute__((always_inline)) void group_dequantize(const int type, const uint8_t *tiles, int64_t nb,
                                                                   float *buf) {
    const int64_t tb = tile_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        float *out = buf + b * QK * GROUP;
        for (int v = 0; v < NV; v++) {
            const vf d = VF_HALF(tile + 2 * v * VL);
            const vf m = type == Q4_1 ? VF_HALF(tile + 2 * GROUP + 2 * v * VL) : VF_MUL(d, VF_SET1(-8.0f));
            if (type == Q8_0) {
                for (int i = 0; i < QK; i++) VF_STORE(out + i * GROUP + v * VL, VF_MUL(VF_CVT(VI_S8(qs + i * GROUP + v * VL)), d));
            } else {
                for (int t = 0; t < QK / 2; t++) {
                    const vi q = VI_U8(qs + t * GROUP + v * VL);
                    VF_STORE(out + 2 * t * GROUP + v * VL, VF_FMA(VF_CVT(VI_LOW(q)), d, m));
                    VF_STORE(out + (2 * t + 1) * GROUP + v * VL, VF_FMA(VF_CVT(VI_HIGH(q)), d, m));
                }
            }
        }
    }
}

static void dequantize_group(int type, const uint8_t *tiles, int64_t nb, float *buf) {
    switch (type) {
    case Q4_0: group_dequantize(Q4_0, tiles, nb, buf); break;
    case Q4_1: group_dequantize(Q4_1, tiles, nb, buf); break;
    default: group_dequantize(Q8_0, tiles, nb, buf); break;
    }
}

/* mr rows of x times a dequantized slice of a group buf [k][32] (k here the slice's), its columns in
 * NV / bnv passes of bnv vectors, the sums starting from zero (first) or from partial [mr][32], and
 * left there for the next slice or, after the last, stored into y. The passes:
 * the block's mr x bnv accumulators (at most 12) and one k's bnv weight vectors fit the vector
 * registers together, so each weight vector is loaded once per k and pass whatever the compiler's
 * tuning (with all 4 AVX2 vectors and 3 rows there are 17 values for 16 registers, and gcc's znver
 * tuning then re-reads every weight vector for every row: 15-20% slower at 24-64 rows). Blocks of
 * 3 rows or fewer still take all 4 AVX2 vectors in one pass (PASS_ROWS below says why). */
static inline __attribute__((always_inline)) void buffer_rows(const float *x, int64_t x_stride, const float *buf,
                                                              int64_t k, const int mr, const int bnv, float *y,
                                                              int64_t y_stride, const float *bias, int64_t col,
                                                              int64_t cols, float *partial, int first, int last) {
    float out[MRB * GROUP] __attribute__((aligned(64)));
    float *sums = last ? out : partial;
    for (int p = 0; p < NV / bnv; p++) {
        vf acc[MRB][NV];
#pragma GCC unroll 16
        for (int r = 0; r < MRB; r++)
#pragma GCC unroll 16
            for (int v = 0; v < NV; v++)
                if (r < mr && v < bnv) acc[r][v] = first ? VF_ZERO() : VF_LOAD(partial + r * GROUP + p * bnv * VL + v * VL);
        const float *wp = buf + p * bnv * VL;
        for (int64_t kk = 0; kk < k; kk++) {
            vf w[NV];
#pragma GCC unroll 16
            for (int v = 0; v < NV; v++)
                if (v < bnv) w[v] = VF_LOAD(wp + kk * GROUP + v * VL);
#pragma GCC unroll 16
            for (int r = 0; r < MRB; r++)
                if (r < mr) {
                    const vf xb = VF_SET1(x[r * x_stride + kk]);
#pragma GCC unroll 16
                    for (int v = 0; v < NV; v++)
                        if (v < bnv) acc[r][v] = VF_FMA(xb, w[v], acc[r][v]);
                }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MRB; r++)
#pragma GCC unroll 16
            for (int v = 0; v < NV; v++)
                if (r < mr && v < bnv) VF_STORE(sums + r * GROUP + p * bnv * VL + v * VL, acc[r][v]);
    }
    if (last) store_rows(out, mr, y, y_stride, bias, col, cols);
}

/* Blocks of 5 or 6 rows go in passes of 2 vectors (on AVX-512 a whole group). On AVX2 fewer rows go
 * in one pass of all 4 vectors, at most WIDE_ROWS to a block: 12 accumulators hide the FMA latency
 * that 4 rows x 2 vectors would not. */
#define PASS_ROWS 6
#define WIDE_ROWS (12 / NV)

static void buffer_block(const float *x, int64_t xs, const float *buf, int64_t k, int mr, float *y, int64_t ys,
                         const float *bias, int64_t col, int64_t cols, float *partial, int first, int last) {
    switch (mr) {
#if NV > 2
    case 1: buffer_rows(x, xs, buf, k, 1, NV, y, ys, bias, col, cols, partial, first, last); break;
    case 2: buffer_rows(x, xs, buf, k, 2, NV, y, ys, bias, col, cols, partial, first, last); break;
    case 3: buffer_rows(x, xs, buf, k, 3, NV, y, ys, bias, col, cols, partial, first, last); break;
#else
    case 1: buffer_rows(x, xs, buf, k, 1, 2, y, ys, bias, col, cols, partial, first, last); break;
    case 2: buffer_rows(x, xs, buf, k, 2, 2, y, ys, bias, col, cols, partial, first, last); break;
    case 3: buffer_rows(x, xs, buf, k, 3, 2, y, ys, bias, col, cols, partial, first, last); break;
    case 4: buffer_rows(x, xs, buf, k, 4, 2, y, ys, bias, col, cols, partial, first, last); break;
#endif
    case 5: buffer_rows(x, xs, buf, k, 5, 2, y, ys, bias, col, cols, partial, first, last); break;
    default: buffer_rows(x, xs, buf, k, 6, 2, y, ys, bias, col, cols, partial, first, last); break;
    }
}

/* How many blocks `rows` rows go in: blocks of 5 or 6 where that many fill them, else of up to
 * WIDE_ROWS. */
static inline int64_t row_blocks(int64_t rows) {
    const int64_t six = (rows + PASS_ROWS - 1) / PASS_ROWS;
    if (WIDE_ROWS >= PASS_ROWS || rows / six >= 5) return six;
    return (rows + WIDE_ROWS - 1) / WIDE_ROWS;
}

static __thread float *thread_buf;
static __thread int64_t thread_buf_floats;

static float *group_buffer(int64_t floats) {
    if (thread_buf_floats < floats) {
        free(thread_buf);
        thread_buf = aligned_alloc(64, (size_t)floats * sizeof(float));
        thread_buf_floats = thread_buf ? floats : 0;
    }
    return thread_buf;
}
#endif /* SIMD */

/* ---- bf16 activations: y = x W^T + b with x and y bf16, b fp32, on AVX-512 BF16 dot products ----
 *
 * Each weight is dequantized to fp32 exactly as above (the same instructions), rounded to bf16 to
 * nearest even (vcvtne2ps2bf16; the weights are multiples of 2^-24, never fp32 denormals, so they
 * are bit for bit torch's cast of the dequantized fp32 weight to bf16), and multiplied with
 * vdpbf16ps, sums in fp32. A tile's pair t of k (2t, 2t + 1) is one 4-bit quant row (its low and
 * high nibbles) or two 8-bit rows; 16 columns of it become one vector of bf16 pairs, lane j =
 * W[j][2t] | W[j][2t + 1] << 16: the 32 bf16 of the two rounded fp32 vectors interleaved (one
 * vpermw). Each output sums the pairs of even index q in one accumulator and the odd ones in a
 * second, then adds the two, then the bias, rounded to bf16 once: worker_svc/cpu/csrc/linear.c's
 * vdpbf16ps kernel does the same, so on a CPU where the dense bf16 model runs that kernel a
 * quantized bf16 linear returns bit for bit what the dense one does with the same weights; and the
 * order does not depend on the number of rows, nor on whether the weights come from registers or
 * the buffer below.
 *
 * Rows: up to BF_DIRECT_ROWS rows dequantize each tile in registers; more rows dequantize a
 * group's whole k range once into a per-thread buffer of bf16 pairs ([k / 2][32] uint32: 64 k
 * bytes, 36 KiB at k = 576, in L1/L2) and multiply blocks of BF_MRB rows by it. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#define BF_DIRECT_ROWS 4 /* 4 accumulators per row: 2 column vectors x even/odd pairs */
#ifndef BF_MRB
#define BF_MRB 6 /* rows per block from the buffer: 24 accumulators */
#endif

/* vpermw indices: element 2j <- j (pair's first, from the low half), 2j + 1 <- 16 + j */
static inline __m512i pair_interleave(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                            19, 3, 18, 2, 17, 1, 16, 0);
}

/* Columns [16 v, 16 v + 16) of pair t of a tile (quants at qs) as bf16 pairs; d, m as in group_direct. */
static inline __attribute__((always_inline)) __m512i tile_pair(const int type, const uint8_t *qs, int t, int v,
                                                               __m512 d, __m512 m, __m512i interleave) {
    __m512 w0, w1;
    if (type == Q8_0) {
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(VI_S8(qs + 2 * t * GROUP + v * 16)), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(VI_S8(qs + (2 * t + 1) * GROUP + v * 16)), d);
    } else {
        const __m512i q = VI_U8(qs + t * GROUP + v * 16);
#if defined(__AMX_TILE__)
        /* Intel (AMX CPUs): the nibble's float by a permute of 0..15, which reads only the low 4
         * bits of each lane (no mask), on the shuffle port, where the conversion's port is the busy
         * one: a one-row pass 7% faster on two threads, the same bits */
        const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, values), d, m);
        w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values), d, m);
#else
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(VI_LOW(q)), d, m);
        w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(VI_HIGH(q)), d, m);
#endif
    }
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}

/* The scale (and offset) vectors of a tile's column vector v. */
static inline __attribute__((always_inline)) void tile_scales(const int type, const uint8_t *tile, int v, __m512 *d,
                                                              __m512 *m) {
    *d = VF_HALF(tile + 2 * v * 16);
    *m = type == Q4_1 ? VF_HALF(tile + 2 * GROUP + 2 * v * 16) : _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f));
}

/* acc[r] even + odd (+ bias) -> bf16 into y's columns [col, col + cols) of mr rows. */
static inline __attribute__((always_inline)) void store_bf16_rows(const __m512 *even, const __m512 *odd, int mr,
                                                                  uint16_t *y, int64_t y_stride, const float *bias,
                                                                  int64_t col, int64_t cols) {
    for (int v = 0; v < 2; v++) {
        const int64_t count = cols - 16 * v < 16 ? cols - 16 * v : 16;
        if (count <= 0) break;
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + col + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            __m512 sum = _mm512_add_ps(even[2 * r + v], odd[2 * r + v]);
            if (bias) sum = _mm512_add_ps(sum, add);
            _mm256_mask_storeu_epi16(y + r * y_stride + col + 16 * v, valid, (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* mr rows of x (bf16 pairs, rows x_stride pairs apart) times one group (nb tiles), each tile's
 * pairs made in registers. */
static inline __attribute__((always_inline)) void group_direct_bf16(
    const int type, const uint32_t *x, int64_t x_stride, const uint8_t *tiles, int64_t nb, const int mr,
    uint16_t *y, int64_t y_stride, const float *bias, int64_t col, int64_t cols) {
    const int64_t tb = tile_bytes(type);
    const __m512i interleave = pair_interleave();
    __m512 even[2 * BF_DIRECT_ROWS], odd[2 * BF_DIRECT_ROWS];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * BF_DIRECT_ROWS; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        const uint32_t *xb = x + b * (QK / 2);
        __m512 d0, m0, d1, m1;
        tile_scales(type, tile, 0, &d0, &m0);
        tile_scales(type, tile, 1, &d1, &m1);
#pragma GCC unroll 2
        for (int t = 0; t < QK / 2; t += 2) {
            const __m512bh e0 = (__m512bh)tile_pair(type, qs, t, 0, d0, m0, interleave);
            const __m512bh e1 = (__m512bh)tile_pair(type, qs, t, 1, d1, m1, interleave);
            const __m512bh o0 = (__m512bh)tile_pair(type, qs, t + 1, 0, d0, m0, interleave);
            const __m512bh o1 = (__m512bh)tile_pair(type, qs, t + 1, 1, d1, m1, interleave);
#pragma GCC unroll 16
            for (int r = 0; r < BF_DIRECT_ROWS; r++)
                if (r < mr) {
                    const __m512bh xe = (__m512bh)_mm512_set1_epi32((int)xb[r * x_stride + t]);
                    const __m512bh xo = (__m512bh)_mm512_set1_epi32((int)xb[r * x_stride + t + 1]);
                    even[2 * r] = _mm512_dpbf16_ps(even[2 * r], e0, xe);
                    even[2 * r + 1] = _mm512_dpbf16_ps(even[2 * r + 1], e1, xe);
                    odd[2 * r] = _mm512_dpbf16_ps(odd[2 * r], o0, xo);
                    odd[2 * r + 1] = _mm512_dpbf16_ps(odd[2 * r + 1], o1, xo);
                }
        }
    }
    store_bf16_rows(even, odd, mr, y, y_stride, bias, col, cols);
}

#define DIRECT_BF16_TYPE(NAME, TYPE)                                                                       \
    static void NAME(const uint32_t *x, int64_t xs, const uint8_t *tiles, int64_t nb, int mr, uint16_t *y,   \
                     int64_t ys, const float *bias, int64_t col, int64_t cols) {                           \
        switch (mr) {                                                                                      \
        case 1: group_direct_bf16(TYPE, x, xs, tiles, nb, 1, y, ys, bias, col, cols); break;                \
        case 2: group_direct_bf16(TYPE, x, xs, tiles, nb, 2, y, ys, bias, col, cols); break;                \
        case 3: group_direct_bf16(TYPE, x, xs, tiles, nb, 3, y, ys, bias, col, cols); break;                \
        default: group_direct_bf16(TYPE, x, xs, tiles, nb, BF_DIRECT_ROWS, y, ys, bias, col, cols); break;  \
        }                                                                                                  \
    }
DIRECT_BF16_TYPE(direct_bf16_q4_0, Q4_0)
DIRECT_BF16_TYPE(direct_bf16_q4_1, Q4_1)
DIRECT_BF16_TYPE(direct_bf16_q8_0, Q8_0)

/* One group (nb tiles) as bf16 pairs into buf [nb * 16][32]. */
static inline __attribute__((always_inline)) void group_pairs(const int type, const uint8_t *tiles, int64_t nb,
                                                              uint32_t *buf) {
    const int64_t tb = tile_bytes(type);
    const __m512i interleave = pair_interleave();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        uint32_t *out = buf + b * (QK / 2) * GROUP;
        __m512 d0, m0, d1, m1;
        tile_scales(type, tile, 0, &d0, &m0);
        tile_scales(type, tile, 1, &d1, &m1);
#pragma GCC unroll 4
        for (int t = 0; t < QK / 2; t++) {
            _mm512_store_si512(out + t * GROUP, tile_pair(type, qs, t, 0, d0, m0, interleave));
            _mm512_store_si512(out + t * GROUP + 16, tile_pair(type, qs, t, 1, d1, m1, interleave));
        }
    }
}

static void pairs_of_group(int type, const uint8_t *tiles, int64_t nb, uint32_t *buf) {
    switch (type) {
    case Q4_0: group_pairs(Q4_0, tiles, nb, buf); break;
    case Q4_1: group_pairs(Q4_1, tiles, nb, buf); break;
    default: group_pairs(Q8_0, tiles, nb, buf); break;
    }
}

/* mr rows of x (bf16 pairs) times a group's pairs buf [kp][32] (kp even). Touches two lines,
 * `step` bytes apart per two pairs from `prefetch` (the next group's tiles), unconditionally: a
 * branch here would put the accumulators in memory. */
static inline __attribute__((always_inline)) void pair_buffer_rows(const uint32_t *x, int64_t x_stride,
                                                                   const uint32_t *buf, int64_t kp, const int mr,
                                                                   uint16_t *y, int64_t y_stride, const float *bias,
                                                                   int64_t col, int64_t cols, const char *prefetch,
                                                                   int64_t step) {
    __m512 even[2 * BF_MRB], odd[2 * BF_MRB];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * BF_MRB; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < kp; q += 2) {
        _mm_prefetch(prefetch + (q / 2) * step, _MM_HINT_T0);
        _mm_prefetch(prefetch + (q / 2) * step + 64, _MM_HINT_T0);
        const __m512bh e0 = (__m512bh)_mm512_load_si512(buf + q * GROUP);
        const __m512bh e1 = (__m512bh)_mm512_load_si512(buf + q * GROUP + 16);
        const __m512bh o0 = (__m512bh)_mm512_load_si512(buf + (q + 1) * GROUP);
        const __m512bh o1 = (__m512bh)_mm512_load_si512(buf + (q + 1) * GROUP + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MRB; r++)
            if (r < mr) {
                const __m512bh xe = (__m512bh)_mm512_set1_epi32((int)x[r * x_stride + q]);
                const __m512bh xo = (__m512bh)_mm512_set1_epi32((int)x[r * x_stride + q + 1]);
                even[2 * r] = _mm512_dpbf16_ps(even[2 * r], e0, xe);
                even[2 * r + 1] = _mm512_dpbf16_ps(even[2 * r + 1], e1, xe);
                odd[2 * r] = _mm512_dpbf16_ps(odd[2 * r], o0, xo);
                odd[2 * r + 1] = _mm512_dpbf16_ps(odd[2 * r + 1], o1, xo);
            }
    }
    store_bf16_rows(even, odd, mr, y, y_stride, bias, col, cols);
}

static void pair_buffer_block(const uint32_t *x, int64_t xs, const uint32_t *buf, int64_t kp, int mr, uint16_t *y,
                              int64_t ys, const float *bias, int64_t col, int64_t cols, const char *pf, int64_t step) {
    switch (mr) {
    case 1: pair_buffer_rows(x, xs, buf, kp, 1, y, ys, bias, col, cols, pf, step); break;
    case 2: pair_buffer_rows(x, xs, buf, kp, 2, y, ys, bias, col, cols, pf, step); break;
    case 3: pair_buffer_rows(x, xs, buf, kp, 3, y, ys, bias, col, cols, pf, step); break;
    case 4: pair_buffer_rows(x, xs, buf, kp, 4, y, ys, bias, col, cols, pf, step); break;
    case 5: pair_buffer_rows(x, xs, buf, kp, 5, y, ys, bias, col, cols, pf, step); break;
    default: pair_buffer_rows(x, xs, buf, kp, BF_MRB, y, ys, bias, col, cols, pf, step); break;
    }
}

static __thread uint32_t *thread_pairs;
static __thread int64_t thread_pairs_words;

static uint32_t *pairs_buffer(int64_t words) {
    if (thread_pairs_words < words) {
        free(thread_pairs);
        thread_pairs = aligned_alloc(64, (size_t)words * sizeof(uint32_t));
        thread_pairs_words = thread_pairs ? words : 0;
    }
    return thread_pairs;
}

/* ---- bf16 activations on AMX tiles ----
 *
 * Where the CPU has AMX-BF16 and Linux grants the tiles' state, rows of x go through tdpbf16ps,
 * each group's pairs (as in the buffer above, [kp][32]: pair row t, column j) two B tiles side by
 * side per 16 pairs (columns 0..15 and 16..31, rows 128 bytes apart):
 * - up to 16 rows (decode): x read in place as one A tile configured for m rows, each 32-input
 *   tile of the group made into pairs (2 KiB, L1) just before the tiles multiply it;
 * - more rows: x copied into zero-padded rows of whole 16-row A tiles, a group's pairs made once
 *   into the buffer, the 8 tiles a 2 x 2 block: C 0..3 for 32 rows x the group's 32 columns, A 4
 *   and 5, B 6 and 7.
 * Each output starts from zero and takes the same B tiles in the same order on both, so its bits do
 * not depend on the other rows. A tile's sums differ from the dot products' (one accumulator per
 * output, its own way of adding a pair's two products), so where calls of few rows take the dot
 * products (on_tiles_from), a row's bits depend on its batch. */
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_QAMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define TILE_ROWS 16
#define TILE_PAIRS 16
static int qamx_state = -1; /* -1 not asked yet, 0 refused, 1 granted */

/* Every tile 64 bytes a row; the A (4, 5) and C (0..3) tiles `rows` rows (1..16), B (6, 7) 16. */
static void qamx_configure(int rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t >= 6 ? TILE_ROWS : (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* `rows` rows of a C tile's sums (16 apart) plus the bias, rounded to bf16, into y's columns
 * [col, col + count) (count <= 16; rows y_stride apart). */
static inline void qamx_store(const float *tile, int64_t rows, uint16_t *y, int64_t y_stride, const float *bias,
                              int64_t col, int64_t count) {
    const __mmask16 valid = (__mmask16)(count >= 16 ? 0xffffu : (1u << count) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 sum = _mm512_load_ps(tile + r * 16);
        if (bias) sum = _mm512_add_ps(sum, add);
        _mm256_mask_storeu_epi16(y + r * y_stride + col, valid, (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* 16 or 32 rows of xp (xp_stride bytes apart) times a group's pairs buf [kp][32] -> c [4][16][16]
 * (row half, column half). Prefetches `lines` lines from `prefetch` per 16 pairs. */
static void qamx_block(const char *xp, int64_t xp_stride, const uint32_t *buf, int64_t kp, int two_rows, float *c,
                       const char *prefetch, int64_t lines) {
    const char *x1 = xp + TILE_ROWS * xp_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < kp; q += TILE_PAIRS) {
        for (int64_t l = 0; l < lines; l++) _mm_prefetch(prefetch + l * 64, _MM_HINT_T0);
        prefetch += lines * 64;
        _tile_loadd(4, xp + q * 4, xp_stride);
        _tile_loadd(6, buf + q * GROUP, GROUP * 4);
        _tile_loadd(7, buf + q * GROUP + 16, GROUP * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two_rows) {
            _tile_loadd(5, x1 + q * 4, xp_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + TILE_ROWS * 16, 64);
    if (two_rows) {
        _tile_stored(2, c + 2 * TILE_ROWS * 16, 64);
        _tile_stored(3, c + 3 * TILE_ROWS * 16, 64);
    }
}

/* Up to 16 rows of x, read in place (rows xs_bytes apart; the tiles configured for m rows), times
 * one group: each of its tiles made into bf16 pairs (two B tiles, 2 KiB, in one of two buffers
 * taken in turn, in L1) just before the tiles multiply it, so no row is copied and no pair leaves
 * L1. The same B tiles in the same order as quant_bf16_on_tiles: the same bits. */
static inline __attribute__((always_inline)) void qamx_group_few(
    const int type, const char *x, int64_t xs_bytes, const uint8_t *tiles, int64_t nb, int64_t m, uint16_t *y,
    int64_t y_stride, const float *bias, int64_t col, int64_t cols, uint32_t *bufs, float *c) {
    const int64_t tb = tile_bytes(type);
    const __m512i interleave = pair_interleave();
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        uint32_t *buf = bufs + (b & 1) * (TILE_PAIRS * GROUP);
        __m512 d0, m0, d1, m1;
        tile_scales(type, tile, 0, &d0, &m0);
        tile_scales(type, tile, 1, &d1, &m1);
#pragma GCC unroll 4
        for (int t = 0; t < TILE_PAIRS; t++) {
            _mm512_store_si512(buf + t * GROUP, tile_pair(type, qs, t, 0, d0, m0, interleave));
            _mm512_store_si512(buf + t * GROUP + 16, tile_pair(type, qs, t, 1, d1, m1, interleave));
        }
        _tile_loadd(4, x + b * QK * 2, xs_bytes);
        _tile_loadd(6, buf, GROUP * 4);
        _tile_loadd(7, buf + 16, GROUP * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + TILE_ROWS * 16, 64);
    for (int side = 0; side < 2 && cols > 16 * side; side++)
        qamx_store(c + side * TILE_ROWS * 16, m, y, y_stride, bias, col + 16 * side, cols - 16 * side);
}

/* quant_linear_bf16 on the tiles for m <= 16 rows (x rows read in place). */
static void quant_bf16_few_on_tiles(int type, const uint16_t *x, int64_t x_stride, const uint8_t *packed,
                                    const float *bias, uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / QK, groups = (n + GROUP - 1) / GROUP, group_bytes = nb * tile_bytes(type);
    #pragma omp parallel
    {
        uint32_t bufs[2 * TILE_PAIRS * GROUP] __attribute__((aligned(64)));
        float c[2 * TILE_ROWS * 16] __attribute__((aligned(64)));
        qamx_configure((int)m);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
            const uint8_t *tiles = packed + g * group_bytes;
            const char *xb = (const char *)x;
            const int64_t xs = 2 * x_stride;
            switch (type) {
            case Q4_0: qamx_group_few(Q4_0, xb, xs, tiles, nb, m, y, y_stride, bias, col, cols, bufs, c); break;
            case Q4_1: qamx_group_few(Q4_1, xb, xs, tiles, nb, m, y, y_stride, bias, col, cols, bufs, c); break;
            default: qamx_group_few(Q8_0, xb, xs, tiles, nb, m, y, y_stride, bias, col, cols, bufs, c); break;
            }
        }
        _tile_release();
    }
}

/* quant_linear_bf16 on the tiles; 0 (nothing done) when there is no memory for x's copy. */
static int quant_bf16_on_tiles(int type, const uint16_t *x, int64_t x_stride, const uint8_t *packed,
                               const float *bias, uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / QK, kp = k / 2, groups = (n + GROUP - 1) / GROUP, group_bytes = nb * tile_bytes(type);
    const int64_t xp_stride = 2 * k, row_tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    char *xp = aligned_alloc(64, (size_t)(row_tiles * TILE_ROWS * xp_stride));
    if (!xp) return 0;
    for (int64_t r = 0; r < row_tiles * TILE_ROWS; r++) {
        if (r < m) memcpy(xp + r * xp_stride, x + r * x_stride, (size_t)xp_stride);
        else memset(xp + r * xp_stride, 0, (size_t)xp_stride);
    }
    /* rows in chunks of 32-row blocks within ~1 MiB of x, so a chunk stays in L2 across the groups */
    int64_t chunk_tiles = (1 << 20) / (TILE_ROWS * xp_stride) / 2 * 2;
    if (chunk_tiles < 2) chunk_tiles = 2;
    int ok = 1;
    #pragma omp parallel
    {
        float c[4 * TILE_ROWS * 16] __attribute__((aligned(64)));
        uint32_t *buf = pairs_buffer(kp * GROUP);
        if (!buf) {
            #pragma omp atomic write
            ok = 0;
        }
        #pragma omp barrier
        if (ok) {
            qamx_configure(TILE_ROWS);
            for (int64_t t0 = 0; t0 < row_tiles; t0 += chunk_tiles) {
                const int64_t t1 = t0 + chunk_tiles < row_tiles ? t0 + chunk_tiles : row_tiles;
                const int64_t blocks = (t1 - t0 + 1) / 2, steps = kp / TILE_PAIRS;
                /* the next group's tiles, spread over every 16 pairs of every row block */
                const int64_t lines = (group_bytes / 64 + blocks * steps) / (blocks * steps);
                #pragma omp for schedule(static) nowait
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
                    pairs_of_group(type, packed + g * group_bytes, nb, buf);
                    const char *next = (const char *)packed + (g + 1 < groups ? g + 1 : g) * group_bytes;
                    for (int64_t b = 0; b < blocks; b++) {
                        const int64_t r0 = (t0 + 2 * b) * TILE_ROWS;
                        const int two_rows = t0 + 2 * b + 1 < t1;
                        qamx_block(xp + r0 * xp_stride, xp_stride, buf, kp, two_rows, c,
                                   next + b * steps * lines * 64, lines);
                        for (int half = 0; half <= two_rows; half++) {
                            const int64_t first = r0 + half * TILE_ROWS;
                            const int64_t rows = m - first < TILE_ROWS ? m - first : TILE_ROWS;
                            for (int side = 0; side < 2 && cols > 16 * side; side++)
                                qamx_store(c + (2 * half + side) * TILE_ROWS * 16, rows, y + first * y_stride, y_stride,
                                           bias, col + 16 * side, cols - 16 * side);
                        }
                    }
                }
            }
            _tile_release();
        }
    }
    free(xp);
    return ok;
}
#else
#define HAVE_QAMX 0
#endif
#else
#define HAVE_BF16 0
#define HAVE_QAMX 0
#endif

/* ---- bf16 activations in exact integer products (calls of few rows where the tiles are granted) ----
 *
 * A row's bf16 x is written per block of 32 inputs as integers on a common power-of-two scale:
 * s = 2^(E - 147), E the largest biased exponent among the block's 32 values (at least 1), and
 * xi = round(x / s), |xi| < 2^21, exact for every value within 13 binades of the block's largest
 * (its 8 significant bits land on integers; a smaller value rounds to nearest even; zeros and bf16
 * subnormals are exact too; a block whose largest is below 2^-107 goes through the scalar path, one
 * with an infinity or NaN makes s NaN). xi is split into three int8 digits, xi = D2 2^14 + D1 2^7 +
 * D0 with D0, D1 in 0..127 and D2 in -128..127, and each digit multiplies the block's quants in
 * integers (vpdpbusd), so the three sums
 *   I_d = sum q D_d   (Q4: q in 0..15; Q8_0: q + 128 in 0..255, less 128 sum D_d)
 * are exact in int32 whatever their order, and so is I = I2 2^14 + I1 2^7 + I0, held as
 * hi 2^14 + lo (lo in 0..16383). An output then takes, block by block in order along k,
 *   f = fma(hi, 2^14, lo) (I rounded to fp32 once),  acc = fma(f s, d, acc),  Q4: acc = fma(m, sx, acc)
 * with f s exact (s a power of two, for E >= 21), sx = s sum xi rounded once, m the block's offset
 * (Q4_1: m, Q4_0: -8 d), then adds the bias and rounds to bf16. The weights are the dequantized
 * model's exactly (not rounded to bf16, as the tiles' are), each block's sum of products is exact
 * and rounded once, and the scale, the offset and the running sum add one fp32 rounding each, so
 * these outputs are the exact product rounded to bf16 but near a tie; but they are other bits than
 * the tiles', so a row's result depends on whether its call takes this path (calls of up to
 * exact_rows rows) or the tiles.
 *
 * Why: one row on the tiles is bound by making the bf16 pairs (about nine vector operations per 32
 * weights); here a block's quants become the products' bytes with a few: per 64 Q4 weights half a
 * vpermb, a vpmultishiftqb and a vpand, per 64 Q8_0 ones a vpermt2b and a vpxor. Each extra row
 * costs three vpdpbusd per 64 weights where the tiles cost nothing, so from a few rows the tiles
 * win (EXACT_ROWS below). */
#if HAVE_BF16 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define HAVE_IX 1
#define IX_ROWS 4  /* rows a pass: 3 digits x 2 halves x 4 rows = 24 int32 sums */
#define IX_AHEAD 8 /* tiles prefetched ahead (4 to 16 measured alike) */

/* Rows of x as digits: dig [3][rows][k] (digit, row, k), per block s, sx ([rows][nb]) and the
 * digits' sums dsum [rows][nb][3]. */
struct ix_rows {
    int8_t *dig;
    float *s, *sx;
    int32_t *dsum;
    int64_t k, nb, rows;
};

/* Row r's block b (32 bf16 at p) into xs, one value at a time (the reference, and the blocks the
 * vector path leaves: a largest exponent below 20 or a NaN or infinity, where s is NaN). */
static void ix_block_scalar(const uint16_t *p, int64_t r, int64_t b, const struct ix_rows *xs) {
    int emax = 1; /* zeros and subnormals (exponent 0) are multiples of 2^-133: exact on 2^-146 */
    for (int i = 0; i < QK; i++) {
        const int e = (p[i] >> 7) & 0xff;
        emax = e > emax ? e : emax;
    }
    const double up = __builtin_ldexp(1.0, 147 - emax);
    int64_t sum = 0;
    int32_t ds[3] = {0, 0, 0};
    for (int i = 0; i < QK; i++) {
        union { uint32_t u; float f; } v;
        v.u = (uint32_t)p[i] << 16;
        const int32_t xi = emax < 255 ? (int32_t)__builtin_nearbyint((double)v.f * up) : 0;
        const int32_t dg[3] = {xi & 127, (xi >> 7) & 127, xi >> 14};
        for (int d = 0; d < 3; d++) {
            xs->dig[(d * xs->rows + r) * xs->k + b * QK + i] = (int8_t)dg[d];
            ds[d] += dg[d];
        }
        sum += xi;
    }
    const double s = emax == 255 ? __builtin_nan("") : __builtin_ldexp(1.0, emax - 147);
    xs->s[r * xs->nb + b] = (float)s;
    xs->sx[r * xs->nb + b] = (float)((double)sum * s);
    for (int d = 0; d < 3; d++) xs->dsum[(r * xs->nb + b) * 3 + d] = ds[d];
}

/* Rows [0, m) of x into xs: a block's 32 values in one vector (x * 2^(147 - E) is exact in fp32
 * for E >= 20, and vcvtps2dq rounds to nearest even as nearbyint does). */
static void ix_quantize(const uint16_t *x, int64_t x_stride, int64_t m, const struct ix_rows *xs) {
    const int64_t k = xs->k, nb = xs->nb;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *p = x + r * x_stride + b * QK;
            const __m512i h = _mm512_loadu_si512(p);
            const int emax = (int)_mm512_reduce_max_epu32(_mm512_max_epu32(
                _mm512_and_si512(_mm512_srli_epi32(h, 7), _mm512_set1_epi32(0xff)),
                _mm512_and_si512(_mm512_srli_epi32(h, 23), _mm512_set1_epi32(0xff))));
            if (emax < 20 || emax == 255) {
                ix_block_scalar(p, r, b, xs);
                continue;
            }
            union { uint32_t u; float f; } up;
            up.u = (uint32_t)(147 - emax + 127) << 23;
            const __m512 scale = _mm512_set1_ps(up.f);
            /* the 16 even and 16 odd values of the block, then back in order of k */
            const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), scale));
            const __m512i hi = _mm512_cvtps_epi32(
                _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xffff0000u))), scale));
            const __m512i first = _mm512_unpacklo_epi32(lo, hi), second = _mm512_unpackhi_epi32(lo, hi);
            /* unpack works within 128-bit lanes: lanes (0, 1, 2, 3) of first/second hold k 0..3, 8..11,
             * 16..19, 24..27 / 4..7, ...; put them in order */
            const __m512i xi0 = _mm512_permutex2var_epi64(first, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second);
            const __m512i xi1 = _mm512_permutex2var_epi64(first, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), second);
            const __m512i seven = _mm512_set1_epi32(127);
            const __m512i d00 = _mm512_and_si512(xi0, seven), d01 = _mm512_and_si512(xi1, seven);
            const __m512i d10 = _mm512_and_si512(_mm512_srai_epi32(xi0, 7), seven);
            const __m512i d11 = _mm512_and_si512(_mm512_srai_epi32(xi1, 7), seven);
            const __m512i d20 = _mm512_srai_epi32(xi0, 14), d21 = _mm512_srai_epi32(xi1, 14);
            int8_t *out = xs->dig + r * k + b * QK;
            const int64_t plane = xs->rows * k;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(d00));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(d01));
            _mm_storeu_si128((__m128i *)(out + plane), _mm512_cvtepi32_epi8(d10));
            _mm_storeu_si128((__m128i *)(out + plane + 16), _mm512_cvtepi32_epi8(d11));
            _mm_storeu_si128((__m128i *)(out + 2 * plane), _mm512_cvtepi32_epi8(d20));
            _mm_storeu_si128((__m128i *)(out + 2 * plane + 16), _mm512_cvtepi32_epi8(d21));
            union { uint32_t u; float f; } s;
            s.u = (uint32_t)(emax - 147 + 127) << 23; /* 2^(emax - 147), normal for emax >= 21 */
            const float sv = emax >= 21 ? s.f : (float)__builtin_ldexp(1.0, emax - 147);
            const int64_t sum = (int64_t)_mm512_reduce_add_epi32(_mm512_add_epi32(xi0, xi1));
            xs->s[r * nb + b] = sv;
            xs->sx[r * nb + b] = (float)((double)sum * (double)sv);
            int32_t *ds = xs->dsum + (r * nb + b) * 3;
            ds[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(d00, d01));
            ds[1] = _mm512_reduce_add_epi32(_mm512_add_epi32(d10, d11));
            ds[2] = _mm512_reduce_add_epi32(_mm512_add_epi32(d20, d21));
        }
}

/* Rows [r0, r0 + mr) of xs times one group (nb tiles) -> y's columns [col, col + cols). */
static inline __attribute__((always_inline)) void ix_group(const int type, const struct ix_rows *xs, int64_t r0,
                                                           const uint8_t *tiles, int64_t nb, const int mr, uint16_t *y,
                                                           int64_t y_stride, const float *bias, int64_t col,
                                                           int64_t cols) {
    const int64_t tb = tile_bytes(type), k = xs->k, plane = xs->rows * k;
    /* Q4, quad u (k 4u..4u+3) = quant rows 2u, 2u + 1 (64 bytes, byte j of row t: column j's k 2t
     * low nibble, 2t + 1 high): vpermb gathers into qword Q the bytes of columns c, c + 1, c + 16,
     * c + 17 (c = 2Q) of row 2u, then of row 2u + 1; vpmultishiftqb takes, for the two columns of
     * half h, the four nibbles in the order of k into each column's 4 bytes (bit offsets 0, 4, 32,
     * 36 and 8, 12, 40, 44; half 1 16 further), vpand clears the bits above. Q8_0, quad u =
     * rows 4u..4u + 3 (128 bytes): vpermt2b takes column j's 4 bytes of half h, xor 128 makes them
     * unsigned. */
    const __m512i gather = _mm512_set_epi8(
        63, 62, 47, 46, 31, 30, 15, 14, 61, 60, 45, 44, 29, 28, 13, 12, 59, 58, 43, 42, 27, 26, 11, 10,
        57, 56, 41, 40, 25, 24, 9, 8, 55, 54, 39, 38, 23, 22, 7, 6, 53, 52, 37, 36, 21, 20, 5, 4,
        51, 50, 35, 34, 19, 18, 3, 2, 49, 48, 33, 32, 17, 16, 1, 0);
    const __m512i nibbles0 = _mm512_set1_epi64(0x2c280c0824200400LL);
    const __m512i nibbles1 = _mm512_set1_epi64(0x3c381c1834301410LL);
    const __m512i rows0 = _mm512_set_epi8(
        111, 79, 47, 15, 110, 78, 46, 14, 109, 77, 45, 13, 108, 76, 44, 12, 107, 75, 43, 11, 106, 74, 42, 10,
        105, 73, 41, 9, 104, 72, 40, 8, 103, 71, 39, 7, 102, 70, 38, 6, 101, 69, 37, 5, 100, 68, 36, 4,
        99, 67, 35, 3, 98, 66, 34, 2, 97, 65, 33, 1, 96, 64, 32, 0);
    const __m512i rows1 = _mm512_add_epi8(rows0, _mm512_set1_epi8(16));
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[IX_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < IX_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        /* the tile IX_AHEAD blocks on (past the group's end, the next group's, which this thread
         * takes next): the hardware's prefetch alone left a one-row pass at 0.74x these rates */
        for (int64_t l = 0; l < tb; l += 64) _mm_prefetch((const char *)tile + IX_AHEAD * tb + l, _MM_HINT_T0);
        __m512i I[IX_ROWS][3][2];
#pragma GCC unroll 8
        for (int r = 0; r < IX_ROWS; r++)
#pragma GCC unroll 3
            for (int d = 0; d < 3; d++) I[r][d][0] = I[r][d][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            __m512i w0, w1;
            if (type == Q8_0) {
                const __m512i z0 = _mm512_loadu_si512(qs + 128 * u), z1 = _mm512_loadu_si512(qs + 128 * u + 64);
                w0 = _mm512_xor_si512(_mm512_permutex2var_epi8(z0, rows0, z1), flip);
                w1 = _mm512_xor_si512(_mm512_permutex2var_epi8(z0, rows1, z1), flip);
            } else {
                const __m512i v = _mm512_permutexvar_epi8(gather, _mm512_loadu_si512(qs + 64 * u));
                w0 = _mm512_and_si512(_mm512_multishift_epi64_epi8(nibbles0, v), low);
                w1 = _mm512_and_si512(_mm512_multishift_epi64_epi8(nibbles1, v), low);
            }
#pragma GCC unroll 8
            for (int r = 0; r < IX_ROWS; r++)
                if (r < mr)
#pragma GCC unroll 3
                    for (int d = 0; d < 3; d++) {
                        int32_t quad;
                        memcpy(&quad, xs->dig + d * plane + (r0 + r) * k + b * QK + 4 * u, 4);
                        const __m512i xd = _mm512_set1_epi32(quad);
                        I[r][d][0] = _mm512_dpbusd_epi32(I[r][d][0], w0, xd);
                        I[r][d][1] = _mm512_dpbusd_epi32(I[r][d][1], w1, xd);
                    }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32 * h)));
            const __m512 mv = type == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 64 + 32 * h)))
                                           : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
#pragma GCC unroll 8
            for (int r = 0; r < IX_ROWS; r++)
                if (r < mr) {
                    const int64_t rb = (r0 + r) * xs->nb + b;
                    __m512i i0 = I[r][0][h], i1 = I[r][1][h], i2 = I[r][2][h];
                    if (type == Q8_0) {
                        i0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(128 * xs->dsum[rb * 3]));
                        i1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(128 * xs->dsum[rb * 3 + 1]));
                        i2 = _mm512_sub_epi32(i2, _mm512_set1_epi32(128 * xs->dsum[rb * 3 + 2]));
                    }
                    /* I2 2^14 + I1 2^7 + I0 = hi 2^14 + lo exactly, rounded to fp32 once */
                    const __m512i j = _mm512_add_epi32(_mm512_slli_epi32(i1, 7), i0);
                    const __m512i hi = _mm512_add_epi32(i2, _mm512_srai_epi32(j, 14));
                    const __m512i lo = _mm512_and_si512(j, _mm512_set1_epi32(16383));
                    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(16384.0f),
                                                     _mm512_cvtepi32_ps(lo));
                    acc[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(xs->s[rb])), dv, acc[r][h]);
                    if (type != Q8_0) acc[r][h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs->sx[rb]), acc[r][h]);
                }
        }
    }
    for (int h = 0; h < 2; h++) {
        const int64_t count = cols - 16 * h < 16 ? cols - 16 * h : 16;
        if (count <= 0) break;
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + col + 16 * h) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++)
            _mm256_mask_storeu_epi16(y + (r0 + r) * y_stride + col + 16 * h, valid,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][h], add)));
    }
}

#define IX_TYPE(NAME, TYPE)                                                                                      \
    static void NAME(const struct ix_rows *xs, int64_t r0, const uint8_t *tiles, int64_t nb, int mr, uint16_t *y, \
                     int64_t ys, const float *bias, int64_t col, int64_t cols) {                                 \
        switch (mr) {                                                                                            \
        case 1: ix_group(TYPE, xs, r0, tiles, nb, 1, y, ys, bias, col, cols); break;                             \
        case 2: ix_group(TYPE, xs, r0, tiles, nb, 2, y, ys, bias, col, cols); break;                             \
        case 3: ix_group(TYPE, xs, r0, tiles, nb, 3, y, ys, bias, col, cols); break;                             \
        default: ix_group(TYPE, xs, r0, tiles, nb, IX_ROWS, y, ys, bias, col, cols); break;                      \
        }                                                                                                        \
    }
IX_TYPE(ix_q4_0, Q4_0)
IX_TYPE(ix_q4_1, Q4_1)
IX_TYPE(ix_q8_0, Q8_0)

static __thread void *ix_scratch; /* the calling thread's digits and scales; its OpenMP team reads them */
static __thread int64_t ix_scratch_bytes;

/* quant_linear_bf16 in exact integer products; 0 (nothing done) when there is no memory for x's digits. */
static int quant_bf16_exact(int type, const uint16_t *x, int64_t x_stride, const uint8_t *packed, const float *bias,
                            uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / QK, groups = (n + GROUP - 1) / GROUP, group_bytes = nb * tile_bytes(type);
    const int64_t digit_bytes = (3 * m * k + 63) / 64 * 64, bytes = (digit_bytes + m * nb * (2 * 4 + 3 * 4) + 63) / 64 * 64;
    if (ix_scratch_bytes < bytes) {
        free(ix_scratch);
        ix_scratch = aligned_alloc(64, (size_t)bytes);
        ix_scratch_bytes = ix_scratch ? bytes : 0;
        if (!ix_scratch) return 0;
    }
    char *mem = ix_scratch;
    const struct ix_rows xs = {(int8_t *)mem, (float *)(mem + digit_bytes), (float *)(mem + digit_bytes) + m * nb,
                               (int32_t *)(mem + digit_bytes) + 2 * m * nb, k, nb, m};
    ix_quantize(x, x_stride, m, &xs);
    void (*fn)(const struct ix_rows *, int64_t, const uint8_t *, int64_t, int, uint16_t *, int64_t, const float *,
               int64_t, int64_t) = type == Q4_0 ? ix_q4_0 : type == Q4_1 ? ix_q4_1 : ix_q8_0;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
        for (int64_t r0 = 0; r0 < m; r0 += IX_ROWS) {
            const int mr = (int)(m - r0 < IX_ROWS ? m - r0 : IX_ROWS);
            fn(&xs, r0, packed + g * group_bytes, nb, mr, y, y_stride, bias, col, cols);
        }
    }
    return 1;
}
#else
#define HAVE_IX 0
#endif

/* Calls of at most this many rows take the exact integer products where the tiles are granted,
 * elsewhere none (benchmarks/cpu_quantized.py, a pass through SmolLM2's linears, Q4_1 with a Q8_0
 * head, Emerald Rapids, two threads, against the tiles' time: 1 row 0.49x, 2 rows 0.54x, 3 rows
 * 0.62x, 4 rows 0.76x, 8 rows 1.10x). quant_bf16_exact_rows changes it. */
#define EXACT_ROWS 4
static int64_t exact_rows = -1; /* -1: the default, resolved at first use */

int quant_bf16_amx(void);

/* Sets the rows up to which calls take the exact integer products (rows >= 0; 0: none; where this
 * build has no such path, always 0), restores the default (rows == -1), or only reads (other
 * negative rows); returns the rows in force. */
int64_t quant_bf16_exact_rows(int64_t rows) {
    if (rows >= 0) exact_rows = HAVE_IX ? rows : 0;
    if (rows == -1 || exact_rows < 0) exact_rows = HAVE_IX && quant_bf16_amx() ? EXACT_ROWS : 0;
    return exact_rows;
}

/* Rows from which quant_linear_bf16 multiplies on AMX tiles (where granted, past the calls of up
 * to exact_rows rows); fewer rows would go through the dot products. From one row by default: with
 * exact_rows 0 (--deterministic) a row's bits then never depend on its batch, and the tiles cost
 * about what the dot products do at one or two rows (benchmarks/cpu_quantized.py,
 * a pass through SmolLM2's linears on Emerald Rapids, two threads: 1 row 1.06x the dot products'
 * time, 2 rows 0.88x, 4 rows 0.72x, 32 rows 0.26x). quant_bf16_tiles_from changes it. */
#define TILES_FROM 1
static int64_t on_tiles_from = TILES_FROM;

/* 1 when quant_linear_bf16 may multiply on AMX tiles: built for a CPU with AMX-BF16 and Linux
 * grants the process the tiles' state (asked once; a kernel before 5.16 refuses). */
int quant_bf16_amx(void) {
#if HAVE_QAMX
    if (qamx_state < 0) qamx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                             18 /* XFEATURE_XTILEDATA */) == 0;
    return qamx_state;
#else
    return 0;
#endif
}

/* Sets the rows from which calls go on the tiles (rows >= 1), or restores the default (rows < 0);
 * returns the rows now in force (rows == 0: only that). */
int64_t quant_bf16_tiles_from(int64_t rows) {
    if (rows > 0) on_tiles_from = rows;
    else if (rows < 0) on_tiles_from = TILES_FROM;
    return on_tiles_from;
}

static inline float bf16_value(float f) { /* round to nearest even, as torch's cast (finite f) */
    union { float f; uint32_t u; } v;
    v.f = f;
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1)) & 0xffff0000u;
    return v.f;
}

/* x [m, k] bf16 (rows x_stride elements apart, x_stride even; k a multiple of 32), W [n, k] packed
 * in `type` as above, bias [n] fp32 or NULL -> y [m, n] bf16 (rows y_stride apart). Calls of up to
 * exact_rows rows in exact integer products (where the build has them and the rows are set: by
 * default where the tiles are granted); others on AMX tiles where granted (calls of on_tiles_from
 * rows or more; where no memory is left for x's copy or the pairs, the dot products instead), else
 * on AVX-512 BF16 dot products; without AVX-512 BF16, a portable loop with the same weights and
 * pairing (each pair's two products summed in fp32). */
void quant_linear_bf16(int type, const uint16_t *x, int64_t x_stride, const uint8_t *packed, const float *bias,
                       uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0) return;
    const int64_t nb = k / QK, groups = (n + GROUP - 1) / GROUP, group_bytes = nb * tile_bytes(type);
#if HAVE_BF16
    const uint32_t *xp = (const uint32_t *)x;
    const int64_t xs = x_stride / 2, ys = y_stride, kp = k / 2;
    void (*direct)(const uint32_t *, int64_t, const uint8_t *, int64_t, int, uint16_t *, int64_t, const float *,
                   int64_t, int64_t) = type == Q4_0 ? direct_bf16_q4_0 : type == Q4_1 ? direct_bf16_q4_1 : direct_bf16_q8_0;
#if HAVE_IX
    if (m <= quant_bf16_exact_rows(-2) && k > 0 && quant_bf16_exact(type, x, x_stride, packed, bias, y, y_stride, m,
                                                                     n, k))
        return;
#endif
#if HAVE_QAMX
    if (m >= on_tiles_from && k > 0 && quant_bf16_amx()) {
        if (m <= TILE_ROWS) {
            quant_bf16_few_on_tiles(type, x, x_stride, packed, bias, y, y_stride, m, n, k);
            return;
        }
        if (quant_bf16_on_tiles(type, x, x_stride, packed, bias, y, y_stride, m, n, k)) return;
    }
#endif
    if (m <= BF_DIRECT_ROWS) {
        #pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
            direct(xp, xs, packed + g * group_bytes, nb, (int)m, y, ys, bias, col, cols);
        }
        return;
    }
    int64_t max_rows = CHUNK_BYTES / (2 * (k > 0 ? k : 1)) / BF_MRB * BF_MRB;
    if (max_rows < BF_MRB) max_rows = BF_MRB;
    const int64_t num_chunks = (m + max_rows - 1) / max_rows;
    const int64_t chunk = num_chunks > 1 ? ((m + num_chunks - 1) / num_chunks + BF_MRB - 1) / BF_MRB * BF_MRB : m;
    #pragma omp parallel
    {
        uint32_t *buf = pairs_buffer(kp * GROUP);
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int64_t num_blocks = (m1 - m0 + BF_MRB - 1) / BF_MRB;
            /* the next group's tiles are prefetched across all the row blocks of this one, a
             * 1/num_blocks share each, so their stream from memory overlaps the dot products (the
             * weights come from memory: without it, 32 rows took 1.6x as long) */
            const int64_t step = (group_bytes + num_blocks * (kp / 2) - 1) / (num_blocks * (kp / 2));
            #pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
                if (!buf) { /* no memory for the buffer: pairs in registers, a few rows at a time */
                    for (int64_t r0 = m0; r0 < m1; r0 += BF_DIRECT_ROWS) {
                        const int mr = (int)(m1 - r0 < BF_DIRECT_ROWS ? m1 - r0 : BF_DIRECT_ROWS);
                        direct(xp + r0 * xs, xs, packed + g * group_bytes, nb, mr, y + r0 * ys, ys, bias, col, cols);
                    }
                    continue;
                }
                pairs_of_group(type, packed + g * group_bytes, nb, buf);
                const char *next = (const char *)packed + (g + 1 < groups ? g + 1 : g) * group_bytes;
                for (int64_t b = 0, r0 = m0; b < num_blocks; b++) {
                    const int mr = (int)((m1 - m0) / num_blocks + (b < (m1 - m0) % num_blocks));
                    pair_buffer_block(xp + r0 * xs, xs, buf, kp, mr, y + r0 * ys, ys, bias, col, cols,
                                      next + b * (kp / 2) * step, step);
                    r0 += mr;
                }
            }
        }
    }
#else
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < GROUP && g * GROUP + j < n; j++) {
            for (int64_t r = 0; r < m; r++) {
                float sums[2] = {0.0f, 0.0f};
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *tile = packed + (g * group_bytes + b * tile_bytes(type));
                    for (int kk = 0; kk < QK; kk += 2) {
                        union { uint32_t u; float f; } x0, x1;
                        x0.u = (uint32_t)x[r * x_stride + b * QK + kk] << 16;
                        x1.u = (uint32_t)x[r * x_stride + b * QK + kk + 1] << 16;
                        sums[(kk / 2) & 1] += x0.f * bf16_value(tile_weight(type, tile, j, kk)) +
                                              x1.f * bf16_value(tile_weight(type, tile, j, kk + 1));
                    }
                }
                float out = sums[0] + sums[1];
                if (bias) out += bias[g * GROUP + j];
                union { float f; uint32_t u; } o;
                o.f = out;
                y[r * y_stride + g * GROUP + j] = (uint16_t)((o.u + 0x7fffu + ((o.u >> 16) & 1)) >> 16);
            }
        }
    }
#endif
}

/* 1 when quant_linear_bf16 runs on AVX-512 BF16 dot products, 0 for its portable loop. */
int quant_bf16_simd(void) { return HAVE_BF16; }

/* The portable path: the same weights, each output summed in order along k. */
static void linear_portable(int type, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias,
                            float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / QK, tb = tile_bytes(type), groups = (n + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < GROUP && g * GROUP + j < n; j++) {
            for (int64_t r = 0; r < m; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *tile = packed + (g * nb + b) * tb;
                    for (int kk = 0; kk < QK; kk++)
                        acc = __builtin_fmaf(x[r * x_stride + b * QK + kk], tile_weight(type, tile, j, kk), acc);
                }
                y[r * y_stride + g * GROUP + j] = bias ? acc + bias[g * GROUP + j] : acc;
            }
        }
    }
}

/* x [m, k] fp32 (rows x_stride apart; k a multiple of 32), W [n, k] packed as above in `type`,
 * bias [n] fp32 or NULL -> y [m, n] fp32 (rows y_stride apart). */
void quant_linear(int type, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                  int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0) return;
#if SIMD
    const int64_t nb = k / QK, groups = (n + GROUP - 1) / GROUP, group_bytes = nb * tile_bytes(type);
    if (m <= DIRECT_ROWS) {
        void (*direct)(const float *, int64_t, const uint8_t *, int64_t, int, float *, int64_t, const float *, int64_t,
                       int64_t) = type == Q4_0 ? direct_q4_0 : type == Q4_1 ? direct_q4_1 : direct_q8_0;
        #pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
            direct(x, x_stride, packed + g * group_bytes, nb, (int)m, y, y_stride, bias, col, cols);
        }
        return;
    }
    int64_t max_rows = CHUNK_BYTES / (4 * (k > 0 ? k : 1)) / MRB * MRB;
    if (max_rows < MRB) max_rows = MRB;
    const int64_t num_chunks = (m + max_rows - 1) / max_rows;
    const int64_t chunk = num_chunks > 1 ? ((m + num_chunks - 1) / num_chunks + MRB - 1) / MRB * MRB : m;
    #pragma omp parallel
    {
        const int64_t ks = k < SLICE_K ? k : SLICE_K;
        float *buf = group_buffer((ks + chunk) * GROUP), *partial = buf ? buf + ks * GROUP : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int64_t num_blocks = row_blocks(m1 - m0);
            #pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
                if (!buf) { /* no memory for the buffer: dequantize in registers, a few rows at a time */
                    for (int64_t r0 = m0; r0 < m1; r0 += DIRECT_ROWS) {
                        const int mr = (int)(m1 - r0 < DIRECT_ROWS ? m1 - r0 : DIRECT_ROWS);
                        (type == Q4_0 ? direct_q4_0 : type == Q4_1 ? direct_q4_1 : direct_q8_0)(
                            x + r0 * x_stride, x_stride, packed + g * group_bytes, nb, mr, y + r0 * y_stride, y_stride,
                            bias, col, cols);
                    }
                    continue;
                }
                for (int64_t k0 = 0; k0 < k; k0 += ks) {
                    const int64_t kl = k - k0 < ks ? k - k0 : ks;
                    dequantize_group(type, packed + g * group_bytes + k0 / QK * tile_bytes(type), kl / QK, buf);
                    for (int64_t b = 0, r0 = m0; b < num_blocks; b++) {
                        /* near-equal blocks: the first (rows % blocks) get one row more */
                        const int mr = (int)((m1 - m0) / num_blocks + (b < (m1 - m0) % num_blocks));
                        buffer_block(x + r0 * x_stride + k0, x_stride, buf, kl, mr, y + r0 * y_stride, y_stride, bias,
                                     col, cols, partial + (r0 - m0) * GROUP, k0 == 0, k0 + kl >= k);
                        r0 += mr;
                    }
                }
            }
        }
    }
#else
    linear_portable(type, x, x_stride, packed, bias, y, y_stride, m, n, k);
#endif
}

/* ---- int8 activations (--int8-activations): x quantized per row and block, integer products ----
 *
 * Each row of x is quantized per block of 32 inputs as llama.cpp quantizes activations (its q8_0):
 * dx = max |x| / 127, xq = round(x / dx) in -127..127, and the block's sum sx = dx * sum(xq). An
 * output is then, block by block in order along k,
 *   acc = fma(I, d * dx, acc), then (Q4_0, Q4_1) acc = fma(m, sx, acc)
 * where I = sum q xq is exact in int32, q the block's quants (Q4: unsigned 0..15, Q8_0: signed), d
 * its scale and m its offset (Q4_1: m; Q4_0: -8 d, as w = (q - 8) d). This is not the dequantized
 * model's arithmetic (the activations lose bits), so it is a setting of its own; the portable loop,
 * the AVX2 and the AVX-512 VNNI paths compute the same bits (the integer sums are exact in any
 * order), and a row's result does not depend on its batch.
 *
 * Vectors: a group's tiles are unpacked I8_SLICE blocks at a time into a per-thread buffer in which
 * each 32-bit lane holds 4 consecutive k of one column (vpunpck of the low and high nibbles, or of
 * 4 Q8_0 rows), 8 columns a 256-bit vector: vector v of a quad holds columns {4v..4v+3,
 * 16+4v..16+4v+3} (i8_column), and the scales are laid out alike (a 512-bit vector is two of them
 * side by side). A row broadcasts its 4 int8 of a quad.
 *   AVX2: vpmaddubsw multiplies them with the unsigned quants, 32 products an instruction. The 4-bit
 *   products sum in int16 over a block (8 quads: at most 8 * 2 * 15 * 127 = 30,480), then vpmaddwd
 *   widens them to int32; Q8_0 takes vpsignb's trick (|q| times xq with q's sign; pairs at most
 *   2 * 128 * 127) and widens every quad.
 *   AVX-512 VNNI: vpdpbusd multiplies and sums into int32, 64 products an instruction; Q8_0's quants
 *   are stored as q + 128 (unsigned) and 128 sum(xq) is taken off each block's sum. */
#define I8_SLICE 4 /* blocks per unpacked slice of a group */

static inline int i8_column(int v, int l) { return (l < 4 ? 4 * v : 12 + 4 * v) + l; }

/* Rows of x quantized per block: q [rows][k], and per block dx, sx and the integer sum of q
 * ([rows][nb] each). */
struct i8_rows_of_x {
    int8_t *q;
    float *dx, *sx;
    int32_t *sum;
    int64_t k, nb;
};

/* Rows [r0, r1) of x (rows x_stride apart) into xs. */
static void quantize_rows_i8(const float *x, int64_t x_stride, int64_t r0, int64_t r1, const struct i8_rows_of_x *xs) {
    const int64_t k = xs->k, nb = xs->nb;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * x_stride + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                const float a = __builtin_fabsf(p[i]);
                amax = a > amax ? a : amax;
            }
            /* volatile: -freciprocal-math would let 1 / (amax / 127) become 127 / amax, another rounding */
            const volatile float d = amax * (1.0f / 127.0f);
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = xs->q + r * k + b * QK;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                float v = __builtin_nearbyintf(p[i] * id);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v; /* x / dx may round past 127; NaN: 0 below */
                const int qi = v == v ? (int)v : 0;
                q[i] = (int8_t)qi;
                sum += qi;
            }
            xs->dx[r * nb + b] = d;
            xs->sx[r * nb + b] = d * (float)sum;
            xs->sum[r * nb + b] = sum;
        }
}

/* Quant of column j at k index kk of one tile: Q4 unsigned 0..15, Q8_0 signed. */
static inline int tile_quant(int type, const uint8_t *tile, int j, int kk) {
    const uint8_t *qs = tile + quants_offset(type);
    if (type == Q8_0) return (int8_t)qs[kk * GROUP + j];
    const uint8_t byte = qs[(kk / 2) * GROUP + j];
    return kk & 1 ? byte >> 4 : byte & 15;
}

/* Column j's offset term coefficient of one tile: Q4_1 m, Q4_0 -8 d, Q8_0 none. */
static inline float tile_offset(int type, const uint8_t *tile, int j) {
    const uint16_t *h = (const uint16_t *)tile;
    return type == Q4_1 ? half_to_float(h[GROUP + j]) : type == Q4_0 ? -8.0f * half_to_float(h[j]) : 0.0f;
}

static void linear_i8_portable(int type, const float *bias, const uint8_t *packed, float *y, int64_t y_stride,
                               int64_t m, int64_t n, const struct i8_rows_of_x *xs) {
    const int64_t k = xs->k, nb = xs->nb, tb = tile_bytes(type), groups = (n + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int j = 0; j < GROUP && g * GROUP + j < n; j++)
            for (int64_t r = 0; r < m; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *tile = packed + (g * nb + b) * tb;
                    const int8_t *q = xs->q + r * k + b * QK;
                    int32_t sum = 0;
                    for (int kk = 0; kk < QK; kk++) sum += tile_quant(type, tile, j, kk) * q[kk];
                    const float s = half_to_float(((const uint16_t *)tile)[j]) * xs->dx[r * nb + b];
                    acc = __builtin_fmaf((float)sum, s, acc);
                    if (type != Q8_0) acc = __builtin_fmaf(tile_offset(type, tile, j), xs->sx[r * nb + b], acc);
                }
                y[r * y_stride + g * GROUP + j] = bias ? acc + bias[g * GROUP + j] : acc;
            }
}

#if SIMD && defined(__AVX2__)
#define HAVE_I8 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I8_VNNI 1
#define I8_ROWS 4 /* rows a pass: 8 int32 sums of 512 bits */
#define Q8_VECTORS 32 /* quant vectors of a Q8_0 block: q + 128 */
#else
#define I8_VNNI 0
#define I8_ROWS 2 /* rows a pass: 8 int16 sums of 256 bits, 4 weight vectors, 2 broadcasts */
#define Q8_VECTORS 64 /* |q|, then q for its sign */
#endif
#define I8_BLOCK_VECTORS(type) (((type) == Q8_0 ? Q8_VECTORS : 32) + 2 * GROUP / 8) /* quants, then scales */

/* One slice of a group's tiles (nbs blocks) -> buf: per block its quants (8 quads x 4 vectors, and
 * on AVX2 Q8_0's |q| and q: 8 x 8) and then its scales d[32] and offsets m[32] in lane order. */
static inline __attribute__((always_inline)) void i8_unpack(const int type, const uint8_t *tiles, int64_t nbs,
                                                            __m256i *buf) {
    const int64_t tb = tile_bytes(type);
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nbs; b++) {
        const uint8_t *tile = tiles + b * tb, *qs = tile + quants_offset(type);
        __m256i *out = buf + b * I8_BLOCK_VECTORS(type);
        for (int quad = 0; quad < 8; quad++) {
            __m256i r[4];
            if (type == Q8_0) {
                for (int i = 0; i < 4; i++) r[i] = _mm256_loadu_si256((const __m256i *)(qs + (4 * quad + i) * GROUP));
            } else {
                const __m256i t0 = _mm256_loadu_si256((const __m256i *)(qs + 2 * quad * GROUP));
                const __m256i t1 = _mm256_loadu_si256((const __m256i *)(qs + (2 * quad + 1) * GROUP));
                r[0] = _mm256_and_si256(t0, low);
                r[1] = _mm256_and_si256(_mm256_srli_epi16(t0, 4), low);
                r[2] = _mm256_and_si256(t1, low);
                r[3] = _mm256_and_si256(_mm256_srli_epi16(t1, 4), low);
            }
            const __m256i a = _mm256_unpacklo_epi8(r[0], r[1]), bb = _mm256_unpackhi_epi8(r[0], r[1]);
            const __m256i c = _mm256_unpacklo_epi8(r[2], r[3]), d = _mm256_unpackhi_epi8(r[2], r[3]);
            const __m256i w[4] = {_mm256_unpacklo_epi16(a, c), _mm256_unpackhi_epi16(a, c),
                                  _mm256_unpacklo_epi16(bb, d), _mm256_unpackhi_epi16(bb, d)};
            for (int v = 0; v < 4; v++) {
                if (type != Q8_0) {
                    _mm256_store_si256(out + quad * 4 + v, w[v]);
                } else if (I8_VNNI) {
                    _mm256_store_si256(out + quad * 4 + v, _mm256_xor_si256(w[v], _mm256_set1_epi8((char)0x80)));
                } else {
                    _mm256_store_si256(out + quad * 8 + v, _mm256_abs_epi8(w[v]));
                    _mm256_store_si256(out + quad * 8 + 4 + v, w[v]);
                }
            }
        }
        /* scales, then offsets: halves 0..7, 8..15, 16..23, 24..31 -> lanes {0..3, 16..19}, {4..7, 20..23}, ... */
        float *scales = (float *)(out + (type == Q8_0 ? Q8_VECTORS : 32));
        __m256 d[4], o[4];
        for (int i = 0; i < 4; i++) {
            d[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * i)));
            o[i] = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 2 * GROUP + 16 * i)))
                                : _mm256_mul_ps(d[i], _mm256_set1_ps(-8.0f));
        }
        for (int part = 0; part < (type == Q8_0 ? 1 : 2); part++) {
            const __m256 *s = part ? o : d;
            _mm256_store_ps(scales + part * GROUP + 0, _mm256_permute2f128_ps(s[0], s[2], 0x20));
            _mm256_store_ps(scales + part * GROUP + 8, _mm256_permute2f128_ps(s[0], s[2], 0x31));
            _mm256_store_ps(scales + part * GROUP + 16, _mm256_permute2f128_ps(s[1], s[3], 0x20));
            _mm256_store_ps(scales + part * GROUP + 24, _mm256_permute2f128_ps(s[1], s[3], 0x31));
        }
    }
}

#if I8_VNNI
/* Rows [r, r + R) times an unpacked slice of nbs blocks starting at block b0, the fp32 sums in sums
 * [R][32] (lane order), starting from zero (first) or from what they hold. */
static inline __attribute__((always_inline)) void i8_row_block(const int type, const int R, const __m256i *buf,
                                                               int64_t nbs, int64_t b0, const struct i8_rows_of_x *xs,
                                                               int64_t r, float *sums, int first) {
    for (int64_t b = 0; b < nbs; b++) {
        const __m256i *w = buf + b * I8_BLOCK_VECTORS(type);
        __m512i s[I8_ROWS][2];
        for (int i = 0; i < R; i++) s[i][0] = s[i][1] = _mm512_setzero_si512();
        for (int quad = 0; quad < 8; quad++) {
            __m512i xb[I8_ROWS];
            for (int i = 0; i < R; i++) {
                int32_t four;
                memcpy(&four, xs->q + (r + i) * xs->k + (b0 + b) * QK + 4 * quad, 4);
                xb[i] = _mm512_set1_epi32(four);
            }
            for (int h = 0; h < 2; h++) {
                const __m512i wv = _mm512_load_si512((const void *)(w + quad * 4 + 2 * h));
                for (int i = 0; i < R; i++) s[i][h] = _mm512_dpbusd_epi32(s[i][h], wv, xb[i]);
            }
        }
        const float *scales = (const float *)(w + (type == Q8_0 ? Q8_VECTORS : 32));
        for (int i = 0; i < R; i++) {
            const int64_t at = (r + i) * xs->nb + b0 + b;
            const __m512 bdx = _mm512_set1_ps(xs->dx[at]), bsx = _mm512_set1_ps(xs->sx[at]);
            for (int h = 0; h < 2; h++) {
                const __m512i i32 = type == Q8_0 ? _mm512_sub_epi32(s[i][h], _mm512_set1_epi32(128 * xs->sum[at]))
                                                 : s[i][h];
                const __m512 sc = _mm512_mul_ps(_mm512_load_ps(scales + 16 * h), bdx);
                float *sum = sums + i * GROUP + 16 * h;
                __m512 acc = first && b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(sum);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), sc, acc);
                if (type != Q8_0) acc = _mm512_fmadd_ps(_mm512_load_ps(scales + GROUP + 16 * h), bsx, acc);
                _mm512_store_ps(sum, acc);
            }
        }
    }
}
#else
/* As above with AVX2 integer products (R = 1 or 2: two rows share each weight vector's load). */
static inline __attribute__((always_inline)) void i8_row_block(const int type, const int R, const __m256i *buf,
                                                               int64_t nbs, int64_t b0, const struct i8_rows_of_x *xs,
                                                               int64_t r, float *sums, int first) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nbs; b++) {
        const __m256i *w = buf + b * I8_BLOCK_VECTORS(type);
        __m256i s[I8_ROWS][4];
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 4; v++) s[i][v] = _mm256_setzero_si256();
        for (int quad = 0; quad < 8; quad++) {
            __m256i xb[I8_ROWS];
            for (int i = 0; i < R; i++) {
                int32_t four;
                memcpy(&four, xs->q + (r + i) * xs->k + (b0 + b) * QK + 4 * quad, 4);
                xb[i] = _mm256_set1_epi32(four);
            }
            for (int v = 0; v < 4; v++) {
                if (type == Q8_0) {
                    const __m256i aw = _mm256_load_si256(w + quad * 8 + v), sw = _mm256_load_si256(w + quad * 8 + 4 + v);
                    for (int i = 0; i < R; i++)
                        s[i][v] = _mm256_add_epi32(
                            s[i][v], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb[i], sw)), ones));
                } else {
                    const __m256i wv = _mm256_load_si256(w + quad * 4 + v);
                    for (int i = 0; i < R; i++) s[i][v] = _mm256_add_epi16(s[i][v], _mm256_maddubs_epi16(wv, xb[i]));
                }
                /* keep the sums in registers quad by quad: integer adds may be reassociated, and gcc
                 * otherwise sums a block's products as a tree, spilling most of them */
                for (int i = 0; i < R; i++) __asm__("" : "+x"(s[i][v]));
            }
        }
        const float *scales = (const float *)(w + (type == Q8_0 ? Q8_VECTORS : 32));
        for (int i = 0; i < R; i++) {
            const int64_t at = (r + i) * xs->nb + b0 + b;
            const __m256 bdx = _mm256_set1_ps(xs->dx[at]), bsx = _mm256_set1_ps(xs->sx[at]);
            for (int v = 0; v < 4; v++) {
                const __m256i i32 = type == Q8_0 ? s[i][v] : _mm256_madd_epi16(s[i][v], ones);
                const __m256 sc = _mm256_mul_ps(_mm256_load_ps(scales + 8 * v), bdx);
                float *sum = sums + i * GROUP + 8 * v;
                __m256 acc = first && b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(sum);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), sc, acc);
                if (type != Q8_0) acc = _mm256_fmadd_ps(_mm256_load_ps(scales + GROUP + 8 * v), bsx, acc);
                _mm256_store_ps(sum, acc);
            }
        }
    }
}
#endif

/* Rows [r0, r1) times an unpacked slice (i8_row_block, I8_ROWS rows at a time); after the last
 * slice, their sums (partial, lane order) plus the bias into y's columns [col, col + cols). */
static inline __attribute__((always_inline)) void i8_rows(const int type, const __m256i *buf, int64_t nbs,
                                                          int64_t b0, const struct i8_rows_of_x *xs, int64_t r0,
                                                          int64_t r1, float *partial, int first, int last, float *y,
                                                          int64_t y_stride, const float *bias, int64_t col,
                                                          int64_t cols) {
    int64_t r = r0;
    for (; r + I8_ROWS <= r1; r += I8_ROWS)
        i8_row_block(type, I8_ROWS, buf, nbs, b0, xs, r, partial + (r - r0) * GROUP, first);
    for (; r < r1; r++) i8_row_block(type, 1, buf, nbs, b0, xs, r, partial + (r - r0) * GROUP, first);
    if (!last) return;
    for (r = r0; r < r1; r++) {
        const float *lanes = partial + (r - r0) * GROUP;
        float *dst = y + r * y_stride + col;
        for (int v = 0; v < 4; v++)
            for (int l = 0; l < 8; l++) {
                const int j = i8_column(v, l);
                if (j < cols) dst[j] = bias ? lanes[8 * v + l] + bias[col + j] : lanes[8 * v + l];
            }
    }
}

static void i8_group(int type, const uint8_t *tiles, const struct i8_rows_of_x *xs, int64_t r0, int64_t r1,
                     __m256i *buf, float *partial, float *y, int64_t y_stride, const float *bias, int64_t col,
                     int64_t cols) {
    const int64_t tb = tile_bytes(type), nb = xs->nb;
    for (int64_t b0 = 0; b0 < nb; b0 += I8_SLICE) {
        const int64_t nbs = nb - b0 < I8_SLICE ? nb - b0 : I8_SLICE;
        const int first = b0 == 0, last = b0 + nbs >= nb;
        switch (type) {
        case Q4_0:
            i8_unpack(Q4_0, tiles + b0 * tb, nbs, buf);
            i8_rows(Q4_0, buf, nbs, b0, xs, r0, r1, partial, first, last, y, y_stride, bias, col, cols);
            break;
        case Q4_1:
            i8_unpack(Q4_1, tiles + b0 * tb, nbs, buf);
            i8_rows(Q4_1, buf, nbs, b0, xs, r0, r1, partial, first, last, y, y_stride, bias, col, cols);
            break;
        default:
            i8_unpack(Q8_0, tiles + b0 * tb, nbs, buf);
            i8_rows(Q8_0, buf, nbs, b0, xs, r0, r1, partial, first, last, y, y_stride, bias, col, cols);
            break;
        }
    }
}

static __thread void *i8_thread_buf; /* each OpenMP thread's slice and sums */
static __thread int64_t i8_thread_bytes;

static void *i8_buffer(int64_t bytes) {
    if (i8_thread_bytes < bytes) {
        free(i8_thread_buf);
        i8_thread_buf = aligned_alloc(64, (size_t)bytes);
        i8_thread_bytes = i8_thread_buf ? bytes : 0;
    }
    return i8_thread_buf;
}
#else
#define HAVE_I8 0
#define I8_VNNI 0
#endif

/* 2 when quant_linear_i8 runs on AVX-512 VNNI dot products, 1 on AVX2 integer products, 0 for its
 * portable loop. */
int quant_i8_simd(void) { return HAVE_I8 + I8_VNNI; }

/* m rows of x, quantized into xs, times the packed weight. */
static void linear_i8_rows(int type, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias,
                           float *y, int64_t y_stride, int64_t m, int64_t n, const struct i8_rows_of_x *xs) {
    const int64_t k = xs->k, groups = (n + GROUP - 1) / GROUP;
#if HAVE_I8
    const int64_t group_bytes = xs->nb * tile_bytes(type);
    int64_t max_rows = CHUNK_BYTES / (k > 0 ? k : 1);
    if (max_rows < 8) max_rows = 8;
    const int64_t num_chunks = (m + max_rows - 1) / max_rows, chunk = (m + num_chunks - 1) / num_chunks;
    const int64_t slice_bytes = I8_SLICE * I8_BLOCK_VECTORS(type) * 32;
    int ok = 1;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_rows_i8(x, x_stride, r, r + 1, xs);
        __m256i *buf = i8_buffer(slice_bytes + chunk * GROUP * (int64_t)sizeof(float));
        if (!buf) {
            #pragma omp atomic write
            ok = 0;
        }
        #pragma omp barrier
        if (ok) {
            float *partial = (float *)((uint8_t *)buf + slice_bytes);
            for (int64_t m0 = 0; m0 < m; m0 += chunk) {
                const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
                #pragma omp for schedule(static) nowait
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t col = g * GROUP, cols = n - col < GROUP ? n - col : GROUP;
                    i8_group(type, packed + g * group_bytes, xs, m0, m1, buf, partial, y, y_stride, bias, col, cols);
                }
            }
        }
    }
    if (ok) return;
#else
    (void)k;
    quantize_rows_i8(x, x_stride, 0, m, xs);
#endif
    linear_i8_portable(type, bias, packed, y, y_stride, m, n, xs);
}

static __thread void *i8_scratch; /* the calling thread's: its OpenMP team reads it */
static __thread int64_t i8_scratch_bytes;

/* As quant_linear, with each row of x quantized to int8 per block of 32 inputs and multiplied in
 * integers (above). The quantized rows go into a scratch buffer of the calling thread's; where
 * that cannot grow, rows go one at a time through the stack. */
void quant_linear_i8(int type, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                     int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) { /* no inputs: the bias */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) y[r * y_stride + j] = bias ? bias[j] : 0.0f;
        return;
    }
    const int64_t nb = k / QK, need = (3 * m * nb * 4 + m * k + 63) / 64 * 64;
    if (i8_scratch_bytes < need) {
        free(i8_scratch);
        i8_scratch = aligned_alloc(64, (size_t)need);
        i8_scratch_bytes = i8_scratch ? need : 0;
    }
    if (i8_scratch) {
        float *scales = i8_scratch;
        const struct i8_rows_of_x xs = {(int8_t *)(scales + 3 * m * nb), scales, scales + m * nb,
                                        (int32_t *)(scales + 2 * m * nb), k, nb};
        linear_i8_rows(type, x, x_stride, packed, bias, y, y_stride, m, n, &xs);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        int8_t q[k];
        float dx[nb], sx[nb];
        int32_t sum[nb];
        const struct i8_rows_of_x xs = {q, dx, sx, sum, k, nb};
        linear_i8_rows(type, x + r * x_stride, x_stride, packed, bias, y + r * y_stride, y_stride, 1, n, &xs);
    }
}

/* GGUF blocks of W [n, k] (row-major, k / 32 blocks of block_bytes per row) -> the packed layout
 * above, with zero columns past n up to a multiple of 32. */
void quant_pack(int type, const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out) {
    const int64_t nb = k / QK, tb = tile_bytes(type), bb = tb / GROUP, groups = (n + GROUP - 1) / GROUP;
    const int64_t qoff = quants_offset(type);
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tile = out + (g * nb + b) * tb;
            memset(tile, 0, (size_t)tb);
            for (int j = 0; j < GROUP && g * GROUP + j < n; j++) {
                const uint8_t *block = blocks + ((g * GROUP + j) * nb + b) * bb;
                memcpy(tile + 2 * j, block, 2); /* d */
                if (type == Q8_0) {
                    for (int i = 0; i < QK; i++) tile[qoff + i * GROUP + j] = block[2 + i];
                    continue;
                }
                if (type == Q4_1) memcpy(tile + 2 * GROUP + 2 * j, block + 2, 2); /* m */
                const uint8_t *qs = block + (type == Q4_1 ? 4 : 2); /* byte i: weight i, weight i + 16 */
                for (int t = 0; t < QK / 2; t++) {
                    const int i0 = 2 * t, i1 = 2 * t + 1;
                    const int q0 = i0 < 16 ? qs[i0] & 15 : qs[i0 - 16] >> 4;
                    const int q1 = i1 < 16 ? qs[i1] & 15 : qs[i1 - 16] >> 4;
                    tile[qoff + t * GROUP + j] = (uint8_t)(q0 | q1 << 4);
                }
            }
        }
    }
}

/* Rows `ids` of W [n, k] (an embedding table in the packed layout), dequantized: out [count, k] fp32. */
void quant_rows(int type, const uint8_t *packed, const int64_t *ids, int64_t count, int64_t n, int64_t k, float *out) {
    const int64_t nb = k / QK, tb = tile_bytes(type);
    for (int64_t i = 0; i < count; i++) {
        const int64_t id = ids[i] < 0 || ids[i] >= n ? 0 : ids[i];
        const int64_t g = id / GROUP;
        const int j = (int)(id % GROUP);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *tile = packed + (g * nb + b) * tb;
            for (int kk = 0; kk < QK; kk++) out[i * k + b * QK + kk] = tile_weight(type, tile, j, kk);
        }
    }
}

/* 512 or 256: the vector width the kernel was built with; 0 for the portable loops. */
int quant_simd(void) { return SIMD; }

/* The ABI version worker_svc/cpu/quantized.py expects; bump it when a signature changes. */
int pagewire_cpu_quant_abi(void) { return 5; }
