// How the panel-linear kernels (cpu_avx512_linear.cpp, cpu_avx2_linear.cpp) split a layer over
// torch's OpenMP threads: each thread a contiguous range of its 16-output panels made of whole
// panel pairs, so that a gated layer's (gate, up) pair stays on one thread.
#pragma once

#include <omp.h>

#include <cstdint>

namespace modserve {

// Calls part(p0, p1) on each thread with its panels [p0, p1) of a layer of N outputs.
template <typename Part>
inline void for_panel_ranges(int64_t N, int threads, const Part& part) {
    const int64_t panels = (N + 15) / 16, pairs = (panels + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = 2 * (pairs * t / nt), p1 = 2 * (pairs * (t + 1) / nt);
        part(p0, p1 < panels ? p1 : panels);
    }
}

}  // namespace modserve
