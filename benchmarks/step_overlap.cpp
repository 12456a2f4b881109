// Can a decode step overlap its memory-bound attention with its linears?
// A model of one SmolLM2 decode step at 16 clients, 30 layers, each two phases on 2 threads:
//   linear:    a stream of W MB of weights, C float32 FMAs per 64-byte line (C 13: a bfloat16
//              panel line times 13 rows, VDPBF16PS's rate), the stream asked for 4 KB ahead;
//   attention: 14 rows x 20 scattered KV blocks of 6 KB (16 positions x 3 heads x 64, bfloat16),
//              K then V, each block asked for two blocks ahead, as attend_bf16dot does.
// Modes: 0, the phases as they are (both threads on each phase in turn); 1, the attention phase
// also asks for the linear's weights (its share of their lines at each block it reads); 2, the
// linear phase also asks for the attention's blocks (its share at each weight line); 3, two
// micro-batches of 7 rows (two-batch overlap): one thread streams all of a layer's weights for
// one (C / 2 FMAs a line) while the other reads the other's KV, then they swap, so the second
// stream of the layer's weights comes from L3. Prints each phase's time and GB/s (mode 3: each
// thread's busy time), and the step's. Mode 4: how fast one thread and two read 512 MB (what
// mode 3's lone streaming thread can get).
//
//   g++ -O3 -march=native -fopenmp -DC=13 benchmarks/step_overlap.cpp -o /tmp/step_overlap
//   for m in 0 1 2 3 4; do /tmp/step_overlap $m; done     # [mode] [weights MB, default 3.5]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#ifndef C
#define C 13
#endif

// A linear's stream: `lines` weight lines from p, Fmas FMAs each, the stream asked for 4 KB
// ahead; with `ask`, also asks for those lines (another phase's), spread over the stream.
template <int Fmas>
long stream_weights(const char* p, size_t lines, const std::vector<const char*>* ask = nullptr) {
    __m512 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
    const __m512 x = _mm512_set1_ps(0.5f);
    for (size_t i = 0; i < lines; ++i) {
        if (i % 8 == 0)
            for (int q = 0; q < 8; ++q) _mm_prefetch(p + 64 * (i + 64 + q), _MM_HINT_T1);
        if (ask != nullptr)
            for (size_t k = ask->size() * i / lines; k < ask->size() * (i + 1) / lines; ++k) _mm_prefetch((*ask)[k], _MM_HINT_T1);
        const __m512 w = _mm512_load_ps(reinterpret_cast<const float*>(p + 64 * i));
#pragma GCC unroll 32
        for (int c = 0; c < Fmas; ++c) a[c & 7] = _mm512_fmadd_ps(a[c & 7], x, w);
    }
    __m512 sum = a[0];
    for (int j = 1; j < 8; ++j) sum = _mm512_add_ps(sum, a[j]);
    return static_cast<long>(_mm512_reduce_add_ps(sum));
}

// GB/s of a plain read of 512 MB by 1 and by 2 threads, best of 7 each.
void read_bandwidth() {
    const size_t n = size_t{512} << 20;
    char* p = static_cast<char*>(aligned_alloc(64, n));
    for (size_t i = 0; i < n; i += 64) p[i] = static_cast<char>(i);
    for (int threads = 1; threads <= 2; ++threads) {
        double best = 1e9;
        long sink = 0;
        for (int round = 0; round < 7; ++round) {
            const auto t0 = std::chrono::steady_clock::now();
            long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
            {
                const char* q = p + n / threads * omp_get_thread_num();
                __m512i a = _mm512_setzero_si512(), b = a;
                for (size_t i = 0; i < n / threads; i += 128) {
                    _mm_prefetch(q + i + 1024, _MM_HINT_T1);
                    a = _mm512_add_epi32(a, _mm512_load_si512(q + i));
                    b = _mm512_add_epi32(b, _mm512_load_si512(q + i + 64));
                }
                total += _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
            }
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            sink += total;
        }
        printf("plain read by %d thread(s): %.1f GB/s [%ld]\n", threads, n / best / 1e9, sink % 2);
    }
    free(p);
}

int main(int argc, char** argv) {
    constexpr int S = 14, NB = 20, L = 30, kRounds = 21;
    constexpr size_t BLK = 16 * 3 * 64 * 2;  // bytes of one block's K (or V)
    const int mode = argc > 1 ? atoi(argv[1]) : 0;
    if (mode == 4) {
        read_bandwidth();
        return 0;
    }
    const size_t W = static_cast<size_t>((argc > 2 ? atof(argv[2]) : 3.5) * 1e6) / 4096 * 4096;
    std::vector<char*> K(L), V(L), Wt(L);
    for (int l = 0; l < L; ++l) {
        K[l] = static_cast<char*>(aligned_alloc(64, (S * NB + 64) * BLK));
        V[l] = static_cast<char*>(aligned_alloc(64, (S * NB + 64) * BLK));
        Wt[l] = static_cast<char*>(aligned_alloc(64, W));
        for (size_t i = 0; i < (S * NB + 64) * BLK; ++i) K[l][i] = i % 7, V[l][i] = i % 5;
        for (size_t i = 0; i < W / 4; ++i) reinterpret_cast<float*>(Wt[l])[i] = 1e-3f * (i % 3 + 1);
    }
    std::vector<int> perm(S * NB);  // the blocks' cache order: scattered
    for (int i = 0; i < S * NB; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
    const auto block = [&](int l, int s, int kv, int b) { return (kv ? V[l] : K[l]) + static_cast<size_t>(perm[s * NB + b]) * BLK; };
    std::vector<std::vector<const char*>> kv_lines(L * 2);  // each thread's attention lines per layer, in reading order
    for (int l = 0; l < L; ++l)
        for (int s = 0; s < S; ++s)
            for (int kv = 0; kv < 2; ++kv)
                for (int b = 0; b < NB; ++b)
                    for (size_t x = 0; x < BLK; x += 64) kv_lines[l * 2 + s % 2].push_back(block(l, s, kv, b) + x);
    const size_t w_lines = W / 64, visits = 2 * S * NB;
    // Row s's K then V blocks of layer l, each block asked for two ahead; in mode 1 also a share of
    // the next layer's weight lines at each block.
    const auto read_row = [&](int l, int s) {
        __m512i acc = _mm512_setzero_si512();
        for (int kv = 0; kv < 2; ++kv) {
            for (int b = 0; b < NB; ++b) {
                if (b + 2 < NB)
                    for (size_t x = 0; x < BLK; x += 64) _mm_prefetch(block(l, s, kv, b + 2) + x, _MM_HINT_T1);
                if (mode == 1) {
                    const size_t v = (2 * s + kv) * NB + b;
                    for (size_t x = w_lines * v / visits; x < w_lines * (v + 1) / visits; ++x)
                        _mm_prefetch(Wt[(l + 1) % L] + 64 * x, _MM_HINT_T1);
                }
                const char* q = block(l, s, kv, b);
                for (size_t i = 0; i < BLK; i += 64) acc = _mm512_add_epi32(acc, _mm512_load_si512(q + i));
            }
        }
        return static_cast<long>(_mm512_reduce_add_epi32(acc));
    };
    double best = 1e9, best_lin = 0, best_att = 0;
    long sink = 0;
    for (int round = 0; round < kRounds; ++round) {
        double lin = 0, att = 0;
        const auto t_step = std::chrono::steady_clock::now();
        for (int l = 0; l < L; ++l) {
            long total = 0;
            if (mode == 3) {  // micro-batch `half`'s linear on thread `half`, the other's attention on the other
                for (int half = 0; half < 2; ++half) {
#pragma omp parallel num_threads(2) reduction(+ : total)
                    {
                        const int t = omp_get_thread_num();
                        const auto t0 = std::chrono::steady_clock::now();
                        if (t == half)
                            total += stream_weights<(C + 1) / 2>(Wt[l], w_lines);
                        else
                            for (int s = 1 - half; s < S; s += 2) total += read_row(l, s);
                        const double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#pragma omp critical
                        (t == half ? lin : att) += busy;
                    }
                }
                sink += total;
                continue;
            }
            const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2) reduction(+ : total)
            {
                const int t = omp_get_thread_num();
                total += stream_weights<C>(Wt[l] + W / 2 * t, w_lines / 2, mode == 2 ? &kv_lines[l * 2 + t] : nullptr);
            }
            const auto t1 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 1) num_threads(2) reduction(+ : total)
            for (int s = 0; s < S; ++s) total += read_row(l, s);
            const auto t2 = std::chrono::steady_clock::now();
            lin += std::chrono::duration<double>(t1 - t0).count();
            att += std::chrono::duration<double>(t2 - t1).count();
            sink += total;
        }
        const double step = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
        if (step < best) best = step, best_lin = lin, best_att = att;
    }
    const double kv_bytes = 2.0 * L * S * NB * BLK, w_bytes = static_cast<double>(L) * W * (mode == 3 ? 2 : 1);
    printf("mode %d, C %d, weights %.1f MB a layer: step %.2f ms (%.1f GB/s of the step's bytes); linear %.2f ms (%.1f GB/s), "
           "attention %.2f ms (%.1f GB/s) [%ld]\n",
           mode, C, W / 1e6, best * 1e3, (kv_bytes + static_cast<double>(L) * W) / best / 1e9, best_lin * 1e3,
           w_bytes / best_lin / 1e9, best_att * 1e3, kv_bytes / best_att / 1e9, sink % 2);
}
