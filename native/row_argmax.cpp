// Each row's argmax as torch.argmax gives it (the first index of the maximum; a NaN counts
// as the maximum, so the first NaN's index), parallel over rows on torch's OpenMP pool.
//
// Why: torch's argmax over a [rows, vocab] float32 tensor runs row after row in scalar code
// on the CPU: ~1 ms for 64 rows of SmolLM2's 49,152 logits, ~4 ms for 256, 2-3% of a
// decode step spent on greedy sampling. Built by native/build.py.
#include <cmath>
#include <cstdint>

#include "avx512.h"

namespace {

int64_t first_nan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[i])) return i;
    }
    return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
    int64_t best = 0, i = 1;
    float best_value = x[0];
#if defined(__AVX512F__)
    if (n >= 32) {  // per lane, the first index of the lane's maximum (strict > keeps the first)
        __m512 vmax = _mm512_loadu_ps(x);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i cur = vidx;
        __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16));
            const __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        if (nan) return first_nan(x, n);
        best_value = _mm512_reduce_max_ps(vmax);  // then the first index among the lanes holding it
        best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best_value), _CMP_EQ_OQ), vidx);
    }
#endif
    if (std::isnan(best_value)) return best;
    for (; i < n; ++i) {
        if (std::isnan(x[i])) return i;
        if (x[i] > best_value) best_value = x[i], best = i;
    }
    return best;
}

}  // namespace

extern "C" {

// x: [rows, n] float32, contiguous, n >= 1 (and below 2^31); out: [rows] int64.
void modserve_row_argmax(const float* x, int64_t rows, int64_t n, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * n, n);
}

}  // extern "C"
