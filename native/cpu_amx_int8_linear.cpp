// W8A8 on AMX-INT8 tiles: y = (s_x * q_x) @ (q_w * s_w).T + b for bfloat16 x, int8 weights
// with one scale per output channel, int8 activations with one scale per row, int32 sums.
//
// Why not oneDNN's int8 linear (cpu_quant.py's W8A8Linear), which also runs AMX-INT8: it takes
// one activation scale per call, so the rows are quantized by separate torch ops (absmax,
// multiply, round, cast: as long as the product itself) and the per-row scales applied to its
// output afterwards; each call also pays oneDNN's primitive lookup and the padding to fixed
// row counts. Here one call quantizes the rows (each row's absmax, x * (127 / absmax) rounded
// to nearest even, saturated: bit for bit what quantize_rows_int8 computes), runs the tile products and
// applies both scales and the bias while narrowing to bfloat16.
//
// Layout: W [N, K] int8 is packed as [N/16][K/64][16][16][4]: for each 16 outputs and 64
// inputs one 1 KB B tile, row r holding inputs 4r..4r+3 of each of the 16 outputs (the
// quadruples TDPBSSD multiplies). N is padded to 16 and K to 64 with zeros, as are the
// quantized rows' K. The tile loop is cpu_amx_linear.cpp's (amx_gemm.h): two A tiles, two B
// tiles, four C tiles.
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "packed_call.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_gemm.h"
#include "avx512.h"

namespace {

using modserve::cols_mask;

// Row m of x quantized into q (Kp bytes, zero past K) and its scale: absmax / 127.
void quantize_row(const uint16_t* x, int K, int Kp, int8_t* q, float* scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const __mmask16 m = cols_mask(K - k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(modserve::load16(x + k, m)));
    }
    float absmax = _mm512_reduce_max_ps(amax);
    absmax = absmax > FLT_MIN ? absmax : FLT_MIN;
    const __m512 inv = _mm512_set1_ps((1.f / absmax) * 127.f);  // torch's 127.0 / absmax: a reciprocal, then * 127
    for (int k = 0; k < K; k += 16) {
        const __mmask16 m = cols_mask(K - k);
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(modserve::load16(x + k, m), inv));
        _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(r));
    }
    if (Kp > K) std::memset(q + K, 0, Kp - K);
    *scale = absmax * (1.f / 127.f);
}

// A block's int32 sums and where they go: times the row's and the column's scale, plus the
// bias, rounded to bfloat16 (32 outputs a row, one store).
struct Stored {
    const int32_t* c;
    int rows0, rows1;
    bool two_n;
    int64_t m0, n0;

    void put(const float* row_scale, const float* col_scale, const float* bias, int64_t N, uint16_t* y, int64_t y_stride) const {
        const __mmask16 k0 = cols_mask(N - n0), k1 = two_n ? cols_mask(N - n0 - 16) : 0;
        const __m512 w0 = _mm512_maskz_loadu_ps(k0, col_scale + n0), w1 = _mm512_maskz_loadu_ps(k1, col_scale + n0 + 16);
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
        const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();
        const __mmask32 mask = static_cast<__mmask32>(k0) | (static_cast<__mmask32>(k1) << 16);
        for (int half = 0; half < 2; ++half) {
            const int rows = half ? rows1 : rows0;
            const int32_t* cc = c + half * 512;
            for (int r = 0; r < rows; ++r) {
                const int64_t m = m0 + half * 16 + r;
                const __m512 s = _mm512_set1_ps(row_scale[m]);
                const __m512 lo = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(cc + r * 16)), w0), s, b0);
                const __m512 hi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(cc + 256 + r * 16)), w1), s, b1);
                _mm512_mask_storeu_epi16(y + m * y_stride + n0, mask, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            }
        }
    }
};

// One thread's share of y: output panel pairs [p0, p1) for every quantized row
// (modserve::sweep), each block's sums finished by Stored::put.
void thread_part(const int8_t* q, int64_t q_stride, int64_t M, const float* row_scale, const int8_t* w, const float* col_scale,
                 int64_t N, int Kp, const float* bias, uint16_t* y, int64_t y_stride, int64_t p0, int64_t p1) {
    const int64_t pair = static_cast<int64_t>(Kp / 64) * 2048;  // bytes of two packed panels
    const auto weights = [&](int64_t p) { return reinterpret_cast<const char*>(w) + p * pair; };
    const auto put = [&](const int32_t* c, int rows0, int rows1, bool two_n, int64_t m, int64_t n0) {
        Stored{c, rows0, rows1, two_n, m, n0}.put(row_scale, col_scale, bias, N, y, y_stride);
    };
    modserve::sweep<true>(reinterpret_cast<const char*>(q), q_stride, M, weights, N, Kp / 64, p0, p1, put);
}

}  // namespace

extern "C" {

int modserve_amx_init() { return modserve::request_amx(); }

// y[m, n] = bf16(s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k] + bias[n]) for bfloat16 x [M, K]
// (row stride x_stride), W packed as above ([ceil(N/16)][Kp/64][16][16][4], Kp = K rounded up
// to 64), col_scale s_w [N] and bias [N] (or null) float32. scratch: M * Kp bytes for the
// quantized rows and M floats for their scales (q, then row_scale).
void modserve_amx_w8a8(const uint16_t* x, int64_t x_stride, int64_t M, int K, const int8_t* w, const float* col_scale,
                       int64_t N, const float* bias, int8_t* q, float* row_scale, uint16_t* y, int64_t y_stride, int threads) {
    const int Kp = (K + 63) / 64 * 64;
    const int64_t pairs = (N + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quantize_row(x + m * x_stride, K, Kp, q + m * Kp, row_scale + m);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        thread_part(q, Kp, M, row_scale, w, col_scale, N, Kp, bias, y, y_stride, pairs * t / nt, pairs * (t + 1) / nt);
    }
}
}

#else  // no AMX-INT8 in this build: W8A8 keeps oneDNN's product

extern "C" {
int modserve_amx_init() { return -2; }
void modserve_amx_w8a8(const uint16_t*, int64_t, int64_t, int, const int8_t*, const float*, int64_t, const float*, int8_t*,
                       float*, uint16_t*, int64_t, int) {}
}

#endif

// Call-list entry point (packed_call.h), for the real kernel and the stub alike.
MODSERVE_PACKED(modserve_amx_w8a8) {
    using modserve::packed::ptr;
    modserve_amx_w8a8(ptr<const uint16_t*>(a[0]), a[1], a[2], a[3], ptr<const int8_t*>(a[4]), ptr<const float*>(a[5]),
                      a[6], ptr<const float*>(a[7]), ptr<int8_t*>(a[8]), ptr<float*>(a[9]), ptr<uint16_t*>(a[10]), a[11],
                      a[12]);
    return 0;
}
