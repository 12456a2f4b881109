// y = x @ W.T (+ b) in float32 with AVX2 and FMA (or AVX-512), W held as bfloat16 panels: a
// float32 model whose weights are exact in bfloat16 (a bfloat16 checkpoint served in float32,
// the default on CPUs without native bfloat16 arithmetic) reads half the weight bytes of
// oneDNN's float32 product, for the same sums: widening bfloat16 to float32 is exact.
//
// Why: a decode step reads every weight once, so on such a CPU (an AVX2-only EPYC, or an AVX-512
// one without AVX512_BF16) its time is the weight bytes over the memory bandwidth; float32
// weights cost twice bfloat16's. The products need no bfloat16 arithmetic: a weight widens to
// float32 by a shift or a mask, and the sums are float32 FMAs.
//
// Layout: the panel layout of cpu_panel_linear.py (the AMX and AVX512_BF16 kernels' bytes): a
// 16-output panel is [K/2][16][2] bfloat16. One 32-byte load holds inputs 2k and 2k + 1 of 8
// outputs as 8 32-bit lanes; shifting each lane left by 16 gives input 2k's weights as float32,
// masking off its low half gives input 2k + 1's. N and K are zero-padded to 16 and 32 in the
// packed copy; x is read only up to its K.
//
// Loop (as cpu_avx512_linear.cpp's): a thread takes a contiguous range of panel pairs (a gated
// layer's (gate, up) pair stays on one thread) and walks it four panels at a time, kChunk rows at
// a time; every block of up to kRows rows keeps its sums for one panel in registers over the
// whole of K, and blocks after the first ask for their share of the next group's weights ahead.
// A gated pair runs its gate panel's block into a small buffer, then its up panel's block writes
// silu(gate) * up (three rows by both panels ran 0.7x as fast with AVX2: twice the widening per
// product). One or two rows keep separate sums for the even and odd inputs, so the FMAs' latency
// does not hold back the weight stream.
//
// Width: AVX2 (16 ymm registers) holds a row's 16 sums of a panel in two vectors, 5 rows a
// block. Where the compiler targets AVX-512F (32 zmm registers) the same loops hold them in one,
// 12 rows a block, and blocks of 4 rows or more take two adjacent panels at once, so that each
// broadcast of x feeds two FMAs (one panel at a time lost 14-27% to oneDNN's 512-bit float32
// product at 64-1,024 rows; two panels tie it); a gated pair is then one such block.
#include <cstdint>
#include <cstring>
#include <utility>

#include "packed_call.h"
#include "panel_threads.h"
#include "prefetch.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "fast_exp.h"

namespace {

// One panel's 16 sums for one row, and the pair step's arithmetic on them: two ymm vectors
// with AVX2, one zmm where the compiler targets AVX-512F (twice the products per FMA, and 32
// registers: more rows per block).
#if defined(__AVX512F__)
struct Sums {
    __m512 v;
};
struct Weights {  // one input of a panel's input pair, as float32
    __m512 v;
};
inline Sums zero_sums() { return {_mm512_setzero_ps()}; }
inline Weights even_weights(const uint16_t* w, int k) {  // input 2k's: the low halves shifted up
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + k * 32), 16))};
}
inline Weights odd_weights(const uint16_t* w, int k) {  // input 2k + 1's: the low halves masked off
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + k * 32), high))};
}
inline void fma(Sums& s, const float* x, const Weights& w) { s.v = _mm512_fmadd_ps(_mm512_set1_ps(*x), w.v, s.v); }
inline void add_sums(Sums& s, const Sums& t) { s.v = _mm512_add_ps(s.v, t.v); }
inline void store_sums(float* out, const Sums& s) { _mm512_store_ps(out, s.v); }
constexpr int kRows = 12;  // rows per register block: 24 sums (two panels) of the 32 zmm registers
constexpr int kTwoPanelsFrom = 4;  // blocks of this many rows and more take two panels at once (each x broadcast feeds both)
#else
struct Sums {
    __m256 lo, hi;  // outputs 0-7, 8-15
};
struct Weights {
    __m256 lo, hi;  // outputs 0-7, 8-15
};
inline Sums zero_sums() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Weights even_weights(const uint16_t* w, int k) {  // input 2k's: the low halves shifted up
    const __m256i* src = reinterpret_cast<const __m256i*>(w + k * 32);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(src), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(src + 1), 16))};
}
inline Weights odd_weights(const uint16_t* w, int k) {  // input 2k + 1's: the low halves masked off
    const __m256i* src = reinterpret_cast<const __m256i*>(w + k * 32);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    return {_mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(src), high)),
            _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(src + 1), high))};
}
inline void fma(Sums& s, const float* x, const Weights& w) {
    const __m256 xb = _mm256_broadcast_ss(x);
    s.lo = _mm256_fmadd_ps(xb, w.lo, s.lo);
    s.hi = _mm256_fmadd_ps(xb, w.hi, s.hi);
}
inline void add_sums(Sums& s, const Sums& t) {
    s.lo = _mm256_add_ps(s.lo, t.lo);
    s.hi = _mm256_add_ps(s.hi, t.hi);
}
inline void store_sums(float* out, const Sums& s) {
    _mm256_store_ps(out, s.lo);
    _mm256_store_ps(out + 8, s.hi);
}
constexpr int kRows = 5;   // rows per register block: 10 sums of the 16 ymm registers
constexpr int kTwoPanelsFrom = 0;  // never: 16 registers hold no second panel's sums
#endif
constexpr int kPanels = 4;       // 16-output panels per group (their weights stay in L2 for every block of rows)
constexpr int64_t kChunk = 96;   // rows per sweep over a thread's panels (with K 1,536, 576 KB of x)

// Input pair k (inputs 2k, 2k + 1; Odd false: 2k only) of P adjacent panels (`panel` elements
// apart) times rows [0, R) of x, added to `even` (input 2k) and `odd_sums` (input 2k + 1; the
// same array or one of its own). Each broadcast of x feeds the P panels.
template <int R, int P, bool Odd, int RO>
__attribute__((always_inline)) inline void pair_step(const float* x, int64_t x_stride, const uint16_t* w, int64_t panel,
                                                     int k, Sums (&even)[R][P], Sums (&odd_sums)[RO][P]) {
    Weights we[P];
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) we[q] = even_weights(w + q * panel, k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) fma(even[r][q], x + r * x_stride + 2 * k, we[q]);
    }
    if constexpr (Odd) {  // after the even sums, so that only one input's weights take registers at a time
        Weights wo[P];
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) wo[q] = odd_weights(w + q * panel, k);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
            for (int q = 0; q < P; ++q) fma(odd_sums[r][q], x + r * x_stride + 2 * k + 1, wo[q]);
        }
    }
}

// Rows [0, R) of x times P adjacent panels w (16 outputs each, from column n0), all of K, into
// float32 sums; then, plain (gate null), y[r][n0 + j] = sum + bias for the columns below N; or,
// the up half of a gated pair (P 1), y[r][n0 / 2 + j] = silu(gate[r][j]) * sum, gate holding the
// gate panel's sums (16 a row, from a plain call with y = gate, n0 = 0, N = 16); or a whole
// gated pair at once (P 2, gated_pair): y[r][n0 / 2 + j] = silu(first panel's) * second's.
template <int R, int P>
void block(const float* x, int64_t x_stride, const uint16_t* w, int64_t panel, int K, const float* bias, int64_t n0,
           int64_t N, float* y, int64_t y_stride, const float* gate, bool gated_pair, const char* ahead,
           int64_t ahead_lines) {
    constexpr bool Split = R <= 2 && P == 1;  // even and odd inputs in sums of their own when few sums are live
    Sums acc[R][P], acc_odd[Split ? R : 1][P];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) acc[r][q] = zero_sums();
    }
    if constexpr (Split) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc_odd[r][0] = zero_sums();
    }
    const int pairs = K / 2;
    const int64_t per_pair = pairs ? (ahead_lines + pairs - 1) / pairs : 0;  // lines to ask for per step
    for (int k = 0; k < pairs; ++k) {
        for (int64_t i = k * per_pair; i < (k + 1) * per_pair && i < ahead_lines; ++i) modserve::prefetch_line(ahead + 64 * i);
        if constexpr (Split)
            pair_step<R, P, true>(x, x_stride, w, panel, k, acc, acc_odd);
        else
            pair_step<R, P, true>(x, x_stride, w, panel, k, acc, acc);
    }
    if (K & 1) pair_step<R, P, false>(x, x_stride, w, panel, pairs, acc, acc);  // the last input alone
    alignas(64) float sums[P][16];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // unrolled, as every loop over acc: an indexed array would live in memory
        if constexpr (Split) add_sums(acc[r][0], acc_odd[r][0]);
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) store_sums(sums[q], acc[r][q]);
        float* out = y + r * y_stride;
        if (P == 2 && gated_pair) {
#pragma omp simd
            for (int j = 0; j < 16; ++j) out[n0 / 2 + j] = modserve::silu(sums[0][j]) * sums[P - 1][j];
        } else if (gate != nullptr) {
            const float* g = gate + 16 * r;
#pragma omp simd
            for (int j = 0; j < 16; ++j) out[n0 / 2 + j] = modserve::silu(g[j]) * sums[0][j];
        } else {
            for (int q = 0; q < P; ++q) {
                const int64_t c0 = n0 + 16 * q, cols = N - c0 < 16 ? N - c0 : 16;
                for (int j = 0; j < cols; ++j) out[c0 + j] = sums[q][j] + (bias != nullptr ? bias[c0 + j] : 0.f);
            }
        }
    }
}

using Block = void (*)(const float*, int64_t, const uint16_t*, int64_t, int, const float*, int64_t, int64_t, float*,
                       int64_t, const float*, bool, const char*, int64_t);

// The instantiation for r rows (1..kRows) and P panels.
template <int P, int... Rs>
Block rows_block_of(int r, std::integer_sequence<int, Rs...>) {
    Block run = block<kRows, P>;
    ((r == Rs + 1 ? (run = block<Rs + 1, P>, 0) : 0), ...);
    return run;
}
template <int P>
Block rows_block(int r) { return rows_block_of<P>(r, std::make_integer_sequence<int, kRows>{}); }

// One thread's share: panels [p0, p1) (whole gated pairs) for every row, kChunk rows at a time.
void thread_part(const float* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t panel, int64_t N, int K,
                 const float* bias, float* y, int64_t y_stride, bool gated, int64_t p0, int64_t p1) {
    alignas(64) float gate[kRows * 16];  // a gated pair's gate sums, until its up panel's block
    for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
        const int64_t c1 = c0 + kChunk < M ? c0 + kChunk : M;
        const int64_t blocks = (c1 - c0 + kRows - 1) / kRows;
        for (int64_t g = p0; g < p1; g += kPanels) {
            const int64_t g1 = g + kPanels < p1 ? g + kPanels : p1;
            const int64_t after = p1 - g1 < kPanels ? p1 - g1 : kPanels;  // panels in the next group
            const int64_t next_lines = c1 - c0 > 1 ? after * panel * 2 / 64 : 0;  // one row streams as fast without
            const char* next_w = reinterpret_cast<const char*>(w + g1 * panel);
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t m = c0 + b * kRows;
                const int rows = c1 - m < kRows ? static_cast<int>(c1 - m) : kRows;
                const Block run = rows_block<1>(rows), run_two = rows_block<2>(rows);
                const int64_t l0 = next_lines * b / blocks, l1 = next_lines * (b + 1) / blocks;
                const float* xm = x + m * x_stride;
                for (int64_t p = g; p < g1;) {  // each call asks for its panels' part of the block's lines
                    const int64_t take = kTwoPanelsFrom > 0 && rows >= kTwoPanelsFrom && p + 1 < g1 ? 2 : 1;
                    const int64_t a0 = l0 + (l1 - l0) * (p - g) / (g1 - g), a1 = l0 + (l1 - l0) * (p + take - g) / (g1 - g);
                    const char* ahead = next_w + 64 * a0;
                    if (take == 2)  // gated: a (gate, up) pair, p even
                        run_two(xm, x_stride, w + p * panel, panel, K, bias, p * 16, N, y + m * y_stride, y_stride,
                                nullptr, gated, ahead, a1 - a0);
                    else if (gated && (p & 1) == 0)
                        run(xm, x_stride, w + p * panel, panel, K, nullptr, 0, 16, gate, 16, nullptr, false, ahead, a1 - a0);
                    else
                        run(xm, x_stride, w + p * panel, panel, K, bias, (gated ? p - 1 : p) * 16, N, y + m * y_stride,
                            y_stride, gated ? gate : nullptr, false, ahead, a1 - a0);  // gated: the pair's columns, from its gate panel's
                    p += take;
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// x [M, K] float32 (rows x_stride elements apart), w packed [ceil(N/16)][ceil(K/32) * 16][16][2]
// bfloat16, bias [N] float32 or null, y [M, y_stride] float32. Gated (a [gate; up] layer whose
// panels alternate gate, up; N / 2 a multiple of 16, no bias): y [M, N / 2] = silu(gate) * up.
void modserve_avx2_linear(const float* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N, int K,
                          const float* bias, float* y, int64_t y_stride, int threads, int gated) {
    const int64_t panel = static_cast<int64_t>((K + 31) / 32) * 512;  // elements of one packed panel
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        thread_part(x, x_stride, M, w, panel, N, K, bias, y, y_stride, gated != 0, p0, p1);
    });
}

int modserve_avx2_linear_available() { return 1; }

}  // extern "C"

MODSERVE_PACKED(modserve_avx2_linear) {
    using modserve::packed::ptr;
    modserve_avx2_linear(ptr<const float*>(a[0]), a[1], a[2], ptr<const uint16_t*>(a[3]), a[4], a[5],
                         ptr<const float*>(a[6]), ptr<float*>(a[7]), a[8], a[9], a[10]);
    return 0;
}

#else  // no AVX2 or FMA: the loader refuses the kernel

extern "C" int modserve_avx2_linear_available() { return 0; }

#endif
