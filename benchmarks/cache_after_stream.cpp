// What a decode step's weight stream leaves of the host's working set in the caches.
// After a forward the engine's Python (scheduling, the next batch's tensors, sampling) runs
// on whatever the 270 MB stream of weights left in L1-L3: a 1-client step's torch calls then
// took about 9x their warm time (44 against 5 us for the same checks and torch.empty).
// Model: a random walk over a working set of N KB (one line a step, so each miss is a full
// latency), warm and right after 2 threads stream 270 MB with 13 FMAs a line, the stream asked
// for 4 KB ahead with prefetcht1 (as the panels ask) or prefetchnta (hinting that the lines
// need not stay). Prints the stream's GB/s and the walk's time, three rounds each.
//
//   g++ -O3 -march=native -fopenmp benchmarks/cache_after_stream.cpp -o /tmp/cache_after_stream
//   /tmp/cache_after_stream 512; /tmp/cache_after_stream 2048     # working set in KB
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// 2 threads over w's n bytes, 13 FMAs per line; Nta: prefetchnta instead of prefetcht1.
template <bool Nta>
static float stream(const char* w, size_t n) {
    float total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
        const char* q = w + n / 2 * omp_get_thread_num();
        __m512 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
        const __m512 x = _mm512_set1_ps(0.5f);
        for (size_t i = 0; i < n / 2; i += 64) {
            if (i % 512 == 0)
                for (int k = 0; k < 8; ++k) _mm_prefetch(q + i + 4096 + 64 * k, Nta ? _MM_HINT_NTA : _MM_HINT_T1);
            const __m512 v = _mm512_load_ps(reinterpret_cast<const float*>(q + i));
#pragma GCC unroll 16
            for (int c = 0; c < 13; ++c) a[c & 7] = _mm512_fmadd_ps(a[c & 7], x, v);
        }
        __m512 s = a[0];
        for (int j = 1; j < 8; ++j) s = _mm512_add_ps(s, a[j]);
        total += _mm512_reduce_add_ps(s);
    }
    return total;
}

int main(int argc, char** argv) {
    const size_t n = size_t{270} << 20, set = static_cast<size_t>(argc > 1 ? atoi(argv[1]) : 2048) * 1024, lines = set / 64;
    char* w = static_cast<char*>(aligned_alloc(64, n));
    for (size_t i = 0; i < n; i += 64) *reinterpret_cast<float*>(w + i) = 1e-3f;
    std::vector<size_t> order(lines);  // the walk: every line once, in random order
    for (size_t i = 0; i < lines; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(1));
    size_t* next = static_cast<size_t*>(aligned_alloc(64, set));
    for (size_t i = 0; i < lines; ++i) next[order[i] * 8] = order[(i + 1) % lines] * 8;
    size_t at = 0;
    const auto walk = [&] {
        const auto t = Clock::now();
        for (size_t i = 0; i < lines; ++i) at = next[at];
        return seconds_since(t);
    };
    for (int nta = 0; nta < 2; ++nta)
        for (int round = 0; round < 3; ++round) {
            walk();
            const double warm = walk();
            const auto t = Clock::now();
            const float sink = nta ? stream<true>(w, n) : stream<false>(w, n);
            const double gb_s = n / seconds_since(t) / 1e9, cold = walk();
            printf("%s: stream %.1f GB/s; a walk over %zu KB warm %.0f us, after the stream %.0f us [%zu %d]\n",
                   nta ? "prefetchnta" : "prefetcht1 ", gb_s, set / 1024, warm * 1e6, cold * 1e6, at % 2, static_cast<int>(sink) % 2);
        }
}
