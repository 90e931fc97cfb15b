/* One core's arithmetic peak: twelve independent accumulator chains of each vector instruction
 * the CPU linears use, timed back to back. Feeds docs/benchmarks.md, section "The CPU linears".
 *
 *     gcc -O2 -march=native benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Prints GFLOP/s per core for 256-bit fp32 FMAs (AVX2), 512-bit ones (AVX-512F) and 512-bit bf16
 * dot products (AVX-512 BF16: 32 products and their sums, 64 FLOP, per instruction), as far as
 * the compiler and CPU have them. Twelve chains hide each instruction's latency; the empty asm
 * after every step keeps each accumulator in a register of its own, so the compiler can neither
 * merge the chains nor spill them to memory. On a CPU with AMX-BF16 it also times tdpbf16ps
 * (16 x 16 outputs of 32 products each, 16,384 FLOP) into four accumulator tiles from two A and
 * two B tiles, the blocking of the kernel's AMX path. Multiply by the cores for the machine's peak. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define STEPS 100000000L
#define TWELVE(X, ...) X(0, __VA_ARGS__) X(1, __VA_ARGS__) X(2, __VA_ARGS__) X(3, __VA_ARGS__) X(4, __VA_ARGS__) \
    X(5, __VA_ARGS__) X(6, __VA_ARGS__) X(7, __VA_ARGS__) X(8, __VA_ARGS__) X(9, __VA_ARGS__) X(10, __VA_ARGS__) \
    X(11, __VA_ARGS__)

static inline double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void report(const char *what, double flop_per_instruction, double elapsed, float checksum) {
    printf("%-34s %7.1f GFLOP/s per core  (checksum %g)\n", what, STEPS * 12.0 * flop_per_instruction / elapsed / 1e9,
           checksum);
}

/* Times STEPS rounds of twelve chains acc = OP(acc), accumulators of vector type VEC started at 0..11
 * by SET1, and reports FLOP per instruction; the "+v" asm pins each chain to a register of its own. */
#define INIT_CHAIN(i, VEC, SET1, OP) VEC a##i = SET1((float)i);
#define STEP_CHAIN(i, VEC, SET1, OP) a##i = OP(a##i); __asm__("" : "+v"(a##i));
#define SUM_CHAIN(i, ...) +a##i[0]
#define TIME_CHAINS(WHAT, VEC, SET1, OP, FLOP)                                  \
    do {                                                                        \
        TWELVE(INIT_CHAIN, VEC, SET1, OP)                                       \
        const double start = seconds();                                         \
        for (long n = 0; n < STEPS; n++) {                                      \
            TWELVE(STEP_CHAIN, VEC, SET1, OP)                                   \
        }                                                                       \
        report(WHAT, FLOP, seconds() - start, 0 TWELVE(SUM_CHAIN, _));          \
    } while (0)

int main(void) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 u8 = _mm256_set1_ps(1.0f), v8 = _mm256_set1_ps(1e-9f);
#define FMA_256(a) _mm256_fmadd_ps(u8, v8, a)
    TIME_CHAINS("fp32 FMA, 256-bit (AVX2)", __m256, _mm256_set1_ps, FMA_256, 16);
#else
    printf("fp32 FMA, 256-bit (AVX2): not built (no AVX2/FMA)\n");
#endif
#if defined(__AVX512F__)
    const __m512 u16 = _mm512_set1_ps(1.0f), v16 = _mm512_set1_ps(1e-9f);
#define FMA_512(a) _mm512_fmadd_ps(u16, v16, a)
    TIME_CHAINS("fp32 FMA, 512-bit (AVX-512F)", __m512, _mm512_set1_ps, FMA_512, 32);
#else
    printf("fp32 FMA, 512-bit (AVX-512F): not built (no AVX-512F)\n");
#endif
#if defined(__AVX512BF16__)
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80), tiny = (__m512bh)_mm512_set1_epi16(0x0080);
#define DOT_BF16(a) _mm512_dpbf16_ps(a, ones, tiny)
    TIME_CHAINS("bf16 dot product, 512-bit (BF16)", __m512, _mm512_set1_ps, DOT_BF16, 64);
#else
    printf("bf16 dot product, 512-bit (BF16): not built (no AVX-512 BF16)\n");
#endif
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    /* Linux hands out the tiles' state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        printf("AMX tdpbf16ps: Linux refused the tiles\n");
        return 0;
    }
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    static uint16_t operands[4][16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 4 * 16 * 32; i++) operands[i / 512][i % 512] = 0x0080; /* tiny bf16, no overflow */
    _tile_loadd(4, operands[0], 64);
    _tile_loadd(5, operands[1], 64);
    _tile_loadd(6, operands[2], 64);
    _tile_loadd(7, operands[3], 64);
    const long tile_steps = STEPS / 100;
    const double start = seconds();
    for (long n = 0; n < tile_steps; n++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const double elapsed = seconds() - start;
    float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    printf("%-34s %7.1f GFLOP/s per core  (checksum %g)\n", "AMX tdpbf16ps, 4 tiles",
           tile_steps * 4.0 * 16 * 16 * 32 * 2 / elapsed / 1e9, out[0]);
#else
    printf("AMX tdpbf16ps: not built (no AMX-BF16)\n");
#endif
    return 0;
}
