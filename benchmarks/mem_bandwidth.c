/* The memory's read bandwidth, one thread and two: a 512 MiB buffer (far past any cache) read once
 * per pass with 512-bit (or 256-bit) loads, best of five passes. What a one-row decode step, which
 * reads every weight once, could reach at most. Feeds docs/benchmarks.md, section 7.
 *
 *     gcc -O2 -march=native -fopenmp benchmarks/mem_bandwidth.c -o /tmp/mem_bandwidth && /tmp/mem_bandwidth
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BYTES ((size_t)512 << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* XOR of every 64-byte line of a[begin, end): the loads cannot be skipped. */
static uint64_t read_range(const char *a, size_t begin, size_t end) {
#if defined(__AVX512F__)
    __m512i s = _mm512_setzero_si512();
    for (size_t i = begin; i < end; i += 64) s = _mm512_xor_si512(s, _mm512_load_si512((const void *)(a + i)));
    return (uint64_t)_mm512_reduce_or_epi64(s);
#elif defined(__AVX2__)
    __m256i s = _mm256_setzero_si256();
    for (size_t i = begin; i < end; i += 32) s = _mm256_xor_si256(s, _mm256_load_si256((const __m256i *)(a + i)));
    return (uint64_t)_mm256_extract_epi64(s, 0) | (uint64_t)_mm256_extract_epi64(s, 1);
#else
    uint64_t s = 0;
    for (size_t i = begin; i < end; i += 8) {
        uint64_t v;
        memcpy(&v, a + i, 8);
        s ^= v;
    }
    return s;
#endif
}

int main(void) {
    char *a = aligned_alloc(64, BYTES);
    if (!a) {
        fprintf(stderr, "no memory for %zu MiB\n", BYTES >> 20);
        return 1;
    }
    memset(a, 1, BYTES);
    const int most = omp_get_num_procs() < 2 ? omp_get_num_procs() : 2;
    uint64_t sink = 0;
    for (int threads = 1; threads <= most; threads++) {
        double best = 1e30;
        for (int pass = 0; pass < 5; pass++) {
            const double t0 = now();
            #pragma omp parallel num_threads(threads) reduction(^ : sink)
            {
                const int t = omp_get_thread_num(), n = omp_get_num_threads();
                const size_t share = BYTES / (size_t)n / 64 * 64;
                sink ^= read_range(a, (size_t)t * share, t == n - 1 ? BYTES : (size_t)(t + 1) * share);
            }
            const double elapsed = now() - t0;
            if (elapsed < best) best = elapsed;
        }
        printf("%d thread%s: %.1f GB/s\n", threads, threads > 1 ? "s" : "", (double)BYTES / best / 1e9);
    }
    free(a);
    return sink == 42; /* keeps the reads; never 42 in practice */
}
