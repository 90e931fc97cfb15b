/* One core's arithmetic peak: twelve independent accumulator chains of each vector instruction
 * the CPU linears use, timed back to back. Feeds docs/benchmarks.md, section "The CPU linears".
 *
 *     gcc -O2 -march=native benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Prints GFLOP/s per core for 256-bit fp32 FMAs (AVX2), 512-bit ones (AVX-512F) and 512-bit bf16
 * dot products (AVX-512 BF16: 32 products and their sums, 64 FLOP, per instruction), as far as
 * the compiler and CPU have them. Twelve chains hide each instruction's latency; the empty asm
 * after every step keeps each accumulator in a register of its own, so the compiler can neither
 * merge the chains nor spill them to memory. Multiply by the cores for the machine's peak. */
#include <stdio.h>
#include <time.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define STEPS 100000000L
#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char *what, double flop_per_instruction, double elapsed, float checksum) {
    printf("%-34s %7.1f GFLOP/s per core  (checksum %g)\n", what, STEPS * 12.0 * flop_per_instruction / elapsed / 1e9,
           checksum);
}

int main(void) {
    double t;
#if defined(__AVX2__) && defined(__FMA__)
    {
        const __m256 u = _mm256_set1_ps(1.0f), v = _mm256_set1_ps(1e-9f);
#define INIT(i) __m256 a##i = _mm256_set1_ps((float)i);
        TWELVE(INIT)
#undef INIT
        t = seconds();
        for (long n = 0; n < STEPS; n++) {
#define STEP(i) a##i = _mm256_fmadd_ps(u, v, a##i); __asm__("" : "+x"(a##i));
            TWELVE(STEP)
#undef STEP
        }
        t = seconds() - t;
#define SUM(i) +a##i[0]
        report("fp32 FMA, 256-bit (AVX2)", 16, t, 0 TWELVE(SUM));
#undef SUM
    }
#else
    printf("fp32 FMA, 256-bit (AVX2): not built (no AVX2/FMA)\n");
#endif
#if defined(__AVX512F__)
    {
        const __m512 u = _mm512_set1_ps(1.0f), v = _mm512_set1_ps(1e-9f);
#define INIT(i) __m512 a##i = _mm512_set1_ps((float)i);
        TWELVE(INIT)
#undef INIT
        t = seconds();
        for (long n = 0; n < STEPS; n++) {
#define STEP(i) a##i = _mm512_fmadd_ps(u, v, a##i); __asm__("" : "+v"(a##i));
            TWELVE(STEP)
#undef STEP
        }
        t = seconds() - t;
#define SUM(i) +a##i[0]
        report("fp32 FMA, 512-bit (AVX-512F)", 32, t, 0 TWELVE(SUM));
#undef SUM
    }
#else
    printf("fp32 FMA, 512-bit (AVX-512F): not built (no AVX-512F)\n");
#endif
#if defined(__AVX512BF16__)
    {
        const __m512bh u = (__m512bh)_mm512_set1_epi16(0x3f80), v = (__m512bh)_mm512_set1_epi16(0x0080);
#define INIT(i) __m512 a##i = _mm512_set1_ps((float)i);
        TWELVE(INIT)
#undef INIT
        t = seconds();
        for (long n = 0; n < STEPS; n++) {
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, u, v); __asm__("" : "+v"(a##i));
            TWELVE(STEP)
#undef STEP
        }
        t = seconds() - t;
#define SUM(i) +a##i[0]
        report("bf16 dot product, 512-bit (BF16)", 64, t, 0 TWELVE(SUM));
#undef SUM
    }
#else
    printf("bf16 dot product, 512-bit (BF16): not built (no AVX-512 BF16)\n");
#endif
    return 0;
}
