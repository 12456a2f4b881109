// The float32 panel product over bfloat16-held weights (FMAs on weights widened by a shift or a
// mask) that the float32 linear kernel (cpu_avx2_linear.cpp, where its layout, loop and widths
// are explained) and the mixture-of-experts kernel (cpu_experts.cpp, one such product per
// expert) both run: a thread's share of panels for every row, in register blocks of rows. The
// panels hold bfloat16 weights, or int8 codes in the same order (W int8_t), widened to float32
// in registers, whose sums are then multiplied by their output channel's scale.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "avx2.h"
#include "avx512.h"
#include "fast_exp.h"
#include "prefetch.h"

namespace modserve::float32_panels {

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
// int8 codes: a pair step's 32 bytes as 16 int32 lanes, each holding its output's two codes
// (input 2k's in the low byte), sign-extended from 16 bits.
inline __m512i code_pairs(const int8_t* w, int k) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 32)));
}
inline Weights even_weights(const int8_t* w, int k) {
    return {_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(code_pairs(w, k), 24), 24))};
}
inline Weights odd_weights(const int8_t* w, int k) { return {_mm512_cvtepi32_ps(_mm512_srai_epi32(code_pairs(w, k), 8))}; }
// float32 weights (a panel widened from int4, [K][16]): input 2k's 16, then input 2k + 1's.
inline Weights even_weights(const float* w, int k) { return {_mm512_loadu_ps(w + k * 32)}; }
inline Weights odd_weights(const float* w, int k) { return {_mm512_loadu_ps(w + k * 32 + 16)}; }
inline void fma(Sums& s, const float* x, const Weights& w) { s.v = _mm512_fmadd_ps(_mm512_set1_ps(*x), w.v, s.v); }
// n codes as bfloat16 (n a multiple of 16): a code's float32 has 16 zero low bits, so its high half is exact.
inline void widen_codes(const int8_t* w, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
    }
}
inline void add_sums(Sums& s, const Sums& t) { s.v = _mm512_add_ps(s.v, t.v); }
inline void store_sums(float* out, const Sums& s) { _mm512_store_ps(out, s.v); }
// A packed tile ([16 pairs][16 outputs] of 32-bit pairs, input 2r in pair r's low half) as
// float32 rows: output j's 32 inputs at out + j * row. Transposed in registers, output j's 16
// pairs are one vector, its 32 bfloat16 inputs in order (modserve_avx2_widen).
inline void widen_tile(const uint32_t* tile, float* out, int64_t row) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(tile + 16 * i));
    modserve::transpose16x16(r);
    for (int j = 0; j < 16; ++j) {
        const __m512i pairs = _mm512_castps_si512(r[j]);
        _mm512_storeu_ps(out + j * row, modserve::widen_bf16(_mm512_castsi512_si256(pairs)));
        _mm512_storeu_ps(out + j * row + 16, modserve::widen_bf16(_mm512_extracti64x4_epi64(pairs, 1)));
    }
}
// A float32 panel ([K][16]: input k's 16 outputs a vector) as 16 rows of K inputs, output j's at
// out + j * row (K a multiple of 16): 16 x 16 blocks transposed in registers.
inline void rows_from_panel(const float* panel, int K, float* out, int64_t row) {
    for (int k0 = 0; k0 < K; k0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(panel + (k0 + i) * 16);
        modserve::transpose16x16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(out + j * row + k0, r[j]);
    }
}
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
// int8 codes: a pair step's outputs 0-7 (half 0) or 8-15 (half 1) as 8 int32 lanes, each
// holding its output's two codes (input 2k's in the low byte), sign-extended from 16 bits.
inline __m256i code_pairs(const int8_t* w, int k, int half) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 32) + half));
}
inline __m256 even_codes(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)); }
inline Weights even_weights(const int8_t* w, int k) {
    return {even_codes(code_pairs(w, k, 0)), even_codes(code_pairs(w, k, 1))};
}
inline Weights odd_weights(const int8_t* w, int k) {
    return {_mm256_cvtepi32_ps(_mm256_srai_epi32(code_pairs(w, k, 0), 8)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(code_pairs(w, k, 1), 8))};
}
// float32 weights (a panel widened from int4, [K][16]): input 2k's 16, then input 2k + 1's.
inline Weights even_weights(const float* w, int k) { return {_mm256_loadu_ps(w + k * 32), _mm256_loadu_ps(w + k * 32 + 8)}; }
inline Weights odd_weights(const float* w, int k) { return {_mm256_loadu_ps(w + k * 32 + 16), _mm256_loadu_ps(w + k * 32 + 24)}; }
// n codes as bfloat16 (n a multiple of 8): a code's float32 has 16 zero low bits, so its high half is exact.
inline void widen_codes(const int8_t* w, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i))));
        const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(f), 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
    }
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
// widen_tile as above, in 8 x 8 blocks of the tile: pairs 8 rb .. 8 rb + 7 of outputs 8 cb .. 8 cb + 7.
inline void widen_tile(const uint32_t* tile, float* out, int64_t row) {
    const auto widen8 = [](__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); };
    for (int rb = 0; rb < 2; ++rb) {
        for (int cb = 0; cb < 2; ++cb) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(tile + 16 * (8 * rb + i) + 8 * cb));
            modserve::transpose8x8(r);
            for (int j = 0; j < 8; ++j) {
                const __m256i pairs = _mm256_castps_si256(r[j]);
                float* dst = out + (8 * cb + j) * row + 16 * rb;
                _mm256_storeu_ps(dst, widen8(_mm256_castsi256_si128(pairs)));
                _mm256_storeu_ps(dst + 8, widen8(_mm256_extracti128_si256(pairs, 1)));
            }
        }
    }
}
// rows_from_panel as above (K a multiple of 8), in 8 x 8 blocks: inputs k0 .. k0 + 7 of outputs 8 cb .. 8 cb + 7.
inline void rows_from_panel(const float* panel, int K, float* out, int64_t row) {
    for (int k0 = 0; k0 < K; k0 += 8) {
        for (int cb = 0; cb < 2; ++cb) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(panel + (k0 + i) * 16 + 8 * cb);
            modserve::transpose8x8(r);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (8 * cb + j) * row + k0, r[j]);
        }
    }
}
constexpr int kRows = 5;   // rows per register block: 10 sums of the 16 ymm registers
constexpr int kTwoPanelsFrom = 0;  // never: 16 registers hold no second panel's sums
#endif
constexpr int kPanels = 4;       // 16-output panels per group (their weights stay in L2 for every block of rows)
constexpr int64_t kChunk = 96;   // rows per sweep over a thread's panels (with K 1,536, 576 KB of x)

// Input pair k (inputs 2k, 2k + 1; Odd false: 2k only) of P adjacent panels (`panel` elements
// apart) times rows [0, R) of x, added to `even` (input 2k) and `odd_sums` (input 2k + 1; the
// same array or one of its own). Each broadcast of x feeds the P panels.
template <int R, int P, bool Odd, int RO, typename W>
__attribute__((always_inline)) inline void pair_step(const float* x, int64_t x_stride, const W* w, int64_t panel,
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
// float32 sums (each times its channel's scale where `scale` is given, 16 a panel); then, plain (gate null), y[r][n0 + j] = sum + bias for the columns below N; or,
// the up half of a gated pair (P 1), y[r][n0 / 2 + j] = silu(gate[r][j]) * sum, gate holding the
// gate panel's sums (16 a row, from a plain call with y = gate, n0 = 0, N = 16); or a whole
// gated pair at once (P 2, gated_pair): y[r][n0 / 2 + j] = silu(first panel's) * second's.
template <typename W, int R, int P>
void block(const float* x, int64_t x_stride, const W* w, int64_t panel, int K, const float* bias, const float* scale,
           int64_t n0, int64_t N, float* y, int64_t y_stride, const float* gate, bool gated_pair, const char* ahead,
           int64_t ahead_lines) {
    // Even and odd inputs in sums of their own when few sums are live, so that more FMAs are in
    // flight than their latency holds back (Zen 4, one group in L2, three rows by one panel: AVX2
    // 85 -> 113, AVX-512 85 -> 115 GFLOP/s a core; the other blocks 100-117).
    constexpr bool Split = R <= 3 && P == 1;
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
    const int asking = per_pair ? static_cast<int>((ahead_lines + per_pair - 1) / per_pair) : 0;  // steps that ask for lines
    const auto step = [&](int k) __attribute__((always_inline)) {
        if constexpr (Split)
            pair_step<R, P, true>(x, x_stride, w, panel, k, acc, acc_odd);
        else
            pair_step<R, P, true>(x, x_stride, w, panel, k, acc, acc);
    };
    // Blocks of up to five rows (all of the AVX2 build's) ask into L2 only, as the AVX512_BF16
    // panels do: with AVX2 (benchmarks/emulate_avx2.sh on a Zen 4) 5-16 rows 1.12-1.21x faster
    // than into L1, 32 rows 1.04x; the AVX-512 build's 5 rows 1.09x, its 12-row blocks level or
    // slower (13 rows 0.97x), so they keep asking into L1.
    for (int k = 0; k < asking; ++k) {
        for (int64_t i = k * per_pair; i < (k + 1) * per_pair && i < ahead_lines; ++i) modserve::prefetch_line<(R <= 5)>(ahead + 64 * i);
        step(k);
    }
    for (int k = asking; k < pairs; ++k) step(k);  // no scalar work beside the FMAs where none asks (12-16% at 64-256 rows, Cascade Lake)
    if (K & 1) pair_step<R, P, false>(x, x_stride, w, panel, pairs, acc, acc);  // the last input alone
    alignas(64) float sums[P][16];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // unrolled, as every loop over acc: an indexed array would live in memory
        if constexpr (Split) add_sums(acc[r][0], acc_odd[r][0]);
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) store_sums(sums[q], acc[r][q]);
        if (scale != nullptr) {  // codes, or codes widened to bfloat16 (thread_part)
#pragma GCC unroll 2
            for (int q = 0; q < P; ++q) {
#pragma omp simd
                for (int j = 0; j < 16; ++j) sums[q][j] *= scale[16 * q + j];
            }
        }
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
                if (cols == 16 && bias == nullptr) {  // whole panels as vectors
#pragma omp simd
                    for (int j = 0; j < 16; ++j) out[c0 + j] = sums[q][j];
                } else if (cols == 16) {
#pragma omp simd
                    for (int j = 0; j < 16; ++j) out[c0 + j] = sums[q][j] + bias[c0 + j];
                } else {
                    for (int j = 0; j < cols; ++j) out[c0 + j] = sums[q][j] + (bias != nullptr ? bias[c0 + j] : 0.f);
                }
            }
        }
    }
}

template <typename W>
using Block = void (*)(const float*, int64_t, const W*, int64_t, int, const float*, const float*, int64_t, int64_t, float*,
                       int64_t, const float*, bool, const char*, int64_t);

// The instantiation for r rows (1..kRows) and P panels.
template <typename W, int P, int... Rs>
Block<W> rows_block_of(int r, std::integer_sequence<int, Rs...>) {
    Block<W> run = block<W, kRows, P>;
    ((r == Rs + 1 ? (run = block<W, Rs + 1, P>, 0) : 0), ...);
    return run;
}
template <typename W, int P>
Block<W> rows_block(int r) { return rows_block_of<W, P>(r, std::make_integer_sequence<int, kRows>{}); }

// The rows of the next block when `left` remain: kRows, but with AVX2 the last six as three and
// three, not five and one (a one-row block's sums wait on the FMAs' latency: 59 GFLOP/s a core,
// three rows 113, five 112-116; Zen 4, one group in L2). AVX2 only: the AVX-512 build's last 13
// rows as 7 + 6 (two-panel blocks, not 12 + 1) measured 0.96x at 13 rows, 0.99x at 25 and 37.
inline int block_rows(int64_t left) {
    if (kRows == 5 && left == 6) return 3;
    return left < kRows ? static_cast<int>(left) : kRows;
}

// Rows [c0, c1) times panels [g, g1), whose weights (bfloat16, codes or float32) are `group`, in
// blocks of up to kRows rows; each call asks for its panels' share of the block's part of the
// next_lines cache lines at next_w (the next group's weights), a block's part in proportion to
// its rows (as avx512_bf16_panels.h's: 13 rows, 12 + 1, 1.085x faster so than by halves on a
// Zen 4). `gate`: a gated pair's gate sums.
template <typename V>
void group_blocks(const float* x, int64_t x_stride, int64_t c0, int64_t c1, const V* group, int64_t panel, int K,
                  const float* bias, const float* scale, int64_t g, int64_t g1, int64_t N, float* y, int64_t y_stride, bool gated,
                  float* gate, const char* next_w, int64_t next_lines) {
    for (int64_t m = c0, rows; m < c1; m += rows) {
        rows = block_rows(c1 - m);
        const Block<V> run = rows_block<V, 1>(rows), run_two = rows_block<V, 2>(rows);
        const int64_t l0 = next_lines * (m - c0) / (c1 - c0), l1 = next_lines * (m + rows - c0) / (c1 - c0);
        const float* xm = x + m * x_stride;
        for (int64_t p = g; p < g1;) {  // each call asks for its panels' part of the block's lines
            const int64_t take = kTwoPanelsFrom > 0 && rows >= kTwoPanelsFrom && p + 1 < g1 ? 2 : 1;
            const int64_t a0 = l0 + (l1 - l0) * (p - g) / (g1 - g), a1 = l0 + (l1 - l0) * (p + take - g) / (g1 - g);
            const char* ahead = next_w + 64 * a0;
            const V* wp = group + (p - g) * panel;
            const float* s = scale != nullptr ? scale + 16 * p : nullptr;  // panel p's channel scales
            if (take == 2)  // gated: a (gate, up) pair, p even
                run_two(xm, x_stride, wp, panel, K, bias, s, p * 16, N, y + m * y_stride, y_stride, nullptr, gated, ahead, a1 - a0);
            else if (gated && (p & 1) == 0)
                run(xm, x_stride, wp, panel, K, nullptr, s, 0, 16, gate, 16, nullptr, false, ahead, a1 - a0);
            else
                run(xm, x_stride, wp, panel, K, bias, s, (gated ? p - 1 : p) * 16, N, y + m * y_stride, y_stride,
                    gated ? gate : nullptr, false, ahead, a1 - a0);  // gated: the pair's columns, from its gate panel's
            p += take;
        }
    }
}

// One thread's share: panels [p0, p1) (whole gated pairs) for every row, kChunk rows at a time;
// `scale` the channel scales of int8 codes (16 a panel, in the panels' order), else null. With
// more rows than two blocks, a group's codes are widened once to bfloat16 panels in this
// thread's scratch (in L2), which every block then reads, as avx512_bf16_panels.h does.
template <typename W>
void thread_part(const float* x, int64_t x_stride, int64_t M, const W* w, int64_t panel, int64_t N, int K,
                 const float* bias, float* y, int64_t y_stride, bool gated, int64_t p0, int64_t p1,
                 const float* scale = nullptr) {
    constexpr bool codes = std::is_same_v<W, int8_t>;
    static thread_local std::vector<uint16_t> widened;  // a group of codes as bfloat16 panels
    if (codes && M > 2 * kRows && widened.size() < static_cast<size_t>(kPanels * panel)) widened.resize(kPanels * panel);
    alignas(64) float gate[kRows * 16];  // a gated pair's gate sums, until its up panel's block
    for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
        const int64_t c1 = c0 + kChunk < M ? c0 + kChunk : M;
        for (int64_t g = p0; g < p1; g += kPanels) {
            const int64_t g1 = g + kPanels < p1 ? g + kPanels : p1;
            const int64_t after = p1 - g1 < kPanels ? p1 - g1 : kPanels;  // panels in the next group
            const int64_t next_lines = c1 - c0 > 1 ? after * panel * static_cast<int64_t>(sizeof(W)) / 64 : 0;  // one row streams as fast without
            const char* next_w = reinterpret_cast<const char*>(w + g1 * panel);
            if constexpr (codes) {
                if (c1 - c0 > 2 * kRows) {
                    widen_codes(w + g * panel, (g1 - g) * panel, widened.data());
                    group_blocks<uint16_t>(x, x_stride, c0, c1, widened.data(), panel, K, bias, scale, g, g1, N, y, y_stride, gated,
                                           gate, next_w, next_lines);
                    continue;
                }
            }
            group_blocks<W>(x, x_stride, c0, c1, w + g * panel, panel, K, bias, scale, g, g1, N, y, y_stride, gated, gate, next_w,
                            next_lines);
        }
    }
}

// One thread's share of a layer whose weights come widened to float32 panels ([K][16] each) a
// group at a time (int4_panels.h): widen(p, np, out) writes panels [p, p + np) at out, into this
// thread's scratch; every row's blocks then multiply that group (widened once per call).
template <typename Widen>
void widened_part(const float* x, int64_t x_stride, int64_t M, const Widen& widen, int K, const float* bias, int64_t N,
                  float* y, int64_t y_stride, int64_t p0, int64_t p1) {
    const int64_t panel = static_cast<int64_t>(K) * 16;  // floats of one widened panel
    static thread_local std::vector<float> widened;
    if (widened.size() < static_cast<size_t>(kPanels * panel)) widened.resize(kPanels * panel);
    alignas(64) float gate[kRows * 16];
    for (int64_t g = p0; g < p1; g += kPanels) {
        const int64_t g1 = g + kPanels < p1 ? g + kPanels : p1;
        widen(g, static_cast<int>(g1 - g), widened.data());
        for (int64_t c0 = 0; c0 < M; c0 += kChunk)
            group_blocks<float>(x, x_stride, c0, c0 + kChunk < M ? c0 + kChunk : M, widened.data(), panel, K, bias, nullptr, g, g1,
                                N, y, y_stride, false, gate, nullptr, 0);
    }
}

}  // namespace modserve::float32_panels

#endif
