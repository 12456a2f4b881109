// The AVX512_BF16 panel product (VDPBF16PS over packed bfloat16 panels) that the linear kernel
// (cpu_avx512_linear.cpp, where its layout and loop are explained) and the mixture-of-experts
// kernel (cpu_experts.cpp, one such product per expert) both run: a thread's share of panels for
// every row, in register blocks of up to six rows by four panels. The panels hold bfloat16
// weights, or int8 codes in the same order (W int8_t) widened exactly to bfloat16 in registers,
// whose sums are then multiplied by their output channel's scale: half the bytes to stream.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512.h"

namespace modserve::bf16_panels {

// A panel's input pair (16 outputs x 2 inputs) as VDPBF16PS takes it: bfloat16 weights as they
// are, int8 codes widened (every int8 is a bfloat16).
inline __m512bh pair_weights(const uint16_t* w) { return modserve::load_bh(w); }
inline __m512bh pair_weights(const int8_t* w) {
    const __m128i* src = reinterpret_cast<const __m128i*>(w);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
template <typename W>
constexpr bool kCodes = std::is_same_v<W, int8_t>;  // int8 codes, with a scale per output channel

constexpr int kRows = 6;          // rows per register block
constexpr int kPanels = 4;        // 16-output panels per register block (two gated pairs)
constexpr int64_t kChunk = 240;   // rows per sweep over a thread's panels (40 blocks; with K 1,536, 720 KB of x in L2)

// Rows [0, R) of x times panels [0, P) of w (each panel `panel` elements after the last), all of
// K, into R x P float32 sums (each times its channel's scale where `scale` is given, 16 a panel);
// then each sum gets the bias and goes to y as bfloat16, or, gated, each (gate, up) pair of
// panels goes to y as bf16(bf16(silu(gate)) * up).
template <typename W, int R, int P, bool Gated>
void block(const uint16_t* x, int64_t x_stride, const W* w, int64_t panel, int K, const float* bias, const float* scale,
           int64_t n0, int64_t N, uint16_t* y, int64_t y_stride, const char* ahead, int64_t ahead_lines) {
    __m512 acc[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    const int pairs = K / 2;
    const int64_t per_pair = pairs ? (ahead_lines + pairs - 1) / pairs : 0;  // lines to ask for per step
    for (int k = 0; k < pairs; ++k) {
        for (int64_t i = k * per_pair; i < (k + 1) * per_pair && i < ahead_lines; ++i) modserve::prefetch_line<true>(ahead + 64 * i);
        __m512bh wv[P];
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
            wv[p] = pair_weights(w + p * panel + k * 32);
            // Held in a register: GCC 12 otherwise loaded them again for every row of some blocks
            // (Zen 4, one group in L2: three rows by four panels 121-183 -> 233 GFLOP/s a core,
            // gated two and three rows 178 and 174 -> 211 and 218).
            asm("" : "+v"(wv[p]));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * x_stride + 2 * k, sizeof pair);
            const __m512bh xb = modserve::as_bh(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
            for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb, wv[p]);
        }
    }
    if (K & 1) {  // the last input, paired with a zero (the packed weights are zero there too)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = modserve::as_bh(_mm512_set1_epi32(x[r * x_stride + K - 1]));
#pragma GCC unroll 8
            for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb, pair_weights(w + p * panel + pairs * 32));
        }
    }
    if (scale != nullptr) {  // codes, or codes widened to bfloat16 (thread_part)
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
            const __m512 s = _mm512_maskz_loadu_ps(modserve::cols_mask(N - n0 - 16 * p), scale + 16 * p);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r][p] = _mm512_mul_ps(acc[r][p], s);
        }
    }
    if constexpr (Gated) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int p = 0; p + 1 < P; p += 2)
                modserve::store16(y + r * y_stride + n0 / 2 + p * 8, modserve::silu_mul_bf16(acc[r][p], acc[r][p + 1]));
    } else {
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
            const __mmask16 mask = modserve::cols_mask(N - n0 - 16 * p);
            const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * p) : _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m256i v = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][p], b)));
                _mm256_mask_storeu_epi16(y + r * y_stride + n0 + 16 * p, mask, v);
            }
        }
    }
}

template <typename W>
using Block = void (*)(const uint16_t*, int64_t, const W*, int64_t, int, const float*, const float*, int64_t, int64_t,
                       uint16_t*, int64_t, const char*, int64_t);

template <typename W, int R, bool Gated>
constexpr Block<W> by_panels(int p) {
    return p == 1 ? block<W, R, 1, Gated> : p == 2 ? block<W, R, 2, Gated> : p == 3 ? block<W, R, 3, Gated> : block<W, R, 4, Gated>;
}

// The instantiation for R rows (1..kRows) and P panels (1..kPanels).
template <typename W, bool Gated>
Block<W> pick(int r, int p) {
    switch (r) {
        case 1: return by_panels<W, 1, Gated>(p);
        case 2: return by_panels<W, 2, Gated>(p);
        case 3: return by_panels<W, 3, Gated>(p);
        case 4: return by_panels<W, 4, Gated>(p);
        case 5: return by_panels<W, 5, Gated>(p);
        default: return by_panels<W, 6, Gated>(p);
    }
}

// n codes widened to bfloat16, 32 at a time (n a multiple of 32, as panels are).
inline void widen_codes(const int8_t* w, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 32) _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(pair_weights(w + i)));
}

// The rows of the next block when `left` remain: six, but the last seven as four and three, not
// six and one, whose four sums each wait on the last VDPBF16PS (Zen 4, one group in L2: a one-row
// block 114 GFLOP/s a core, three to six rows 213-234; SmolLM2's layers, 7 and 13 rows 1.13x and
// 1.08x faster from L3).
inline int block_rows(int64_t left) { return left == kRows + 1 ? 4 : left < kRows ? static_cast<int>(left) : kRows; }

// Rows [c0, c1) times the np panels from panel p, whose weights (codes or bfloat16) are `group`,
// in blocks of up to kRows rows; each block asks for its share of the next_lines cache lines at
// next_w (the next group's weights) into L2 only: asked for into L1 as well, they took L1's miss
// buffers from the block's own loads (Zen 4, 2-16 rows: 0.79-0.90x the time into L2 only). A
// block's share is in proportion to its rows: with a third each, the one-row block 13 rows then
// made (6 + 6 + 1) had a third of the lines to ask for in a tenth of the time (Zen 4, SmolLM2's
// layers: 13 and 14 rows 1.07-1.10x faster by rows, 7-64 rows otherwise within the noise).
template <typename V>
void group_blocks(const uint16_t* x, int64_t x_stride, int64_t c0, int64_t c1, const V* group, int64_t panel, int K,
                  const float* bias, const float* scale, int64_t p, int np, int64_t N, uint16_t* y, int64_t y_stride,
                  bool gated, const char* next_w, int64_t next_lines) {
    const int64_t rows = c1 - c0;
    for (int64_t m = c0, nr; m < c1; m += nr) {
        nr = block_rows(c1 - m);
        const int64_t l0 = next_lines * (m - c0) / rows, l1 = next_lines * (m + nr - c0) / rows;
        const Block<V> run = gated ? pick<V, true>(nr, np) : pick<V, false>(nr, np);
        run(x + m * x_stride, x_stride, group, panel, K, bias, scale, p * 16, N, y + m * y_stride, y_stride, next_w + 64 * l0,
            l1 - l0);
    }
}

// One thread's share: panels [p0, p1) (whole gated pairs) for every row, kChunk rows at a time;
// `scale` the channel scales of int8 codes (16 a panel, in the panels' order), else null. With
// more rows than two blocks, a group's codes are widened once into this thread's scratch (in L2)
// and every block multiplies bfloat16 panels, instead of each block widening them again
// (SmolLM2's layers, Zen 5: 64 rows 0.78x -> 0.95x bfloat16's speed, 256 rows 0.78x -> 0.99x;
// up to 12 rows the blocks widening their own ran faster).
template <typename W>
void thread_part(const uint16_t* x, int64_t x_stride, int64_t M, const W* w, int64_t panel, int64_t N, int K,
                 const float* bias, uint16_t* y, int64_t y_stride, bool gated, int64_t p0, int64_t p1,
                 const float* scale = nullptr) {
    static thread_local std::vector<uint16_t> widened;  // a group of codes as bfloat16 panels
    if (kCodes<W> && M > 2 * kRows && widened.size() < static_cast<size_t>(kPanels * panel)) widened.resize(kPanels * panel);
    for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
        const int64_t c1 = c0 + kChunk < M ? c0 + kChunk : M;
        // Asking for the next group ahead: bfloat16 streams one row as fast without; codes, whose
        // widening keeps the core busy between loads, ran one row 1.8-1.9x bfloat16's speed with it
        // against 0.87x without (SmolLM2's layers, Zen 5).
        const bool ahead = c1 - c0 > 1 || kCodes<W>;
        for (int64_t p = p0; p < p1; p += kPanels) {
            const int np = p1 - p < kPanels ? static_cast<int>(p1 - p) : kPanels;
            const int64_t after = p1 - p - np < kPanels ? p1 - p - np : kPanels;  // panels in the next group
            const int64_t next_lines = ahead ? after * panel * static_cast<int64_t>(sizeof(W)) / 64 : 0;
            const char* next_w = reinterpret_cast<const char*>(w + (p + np) * panel);
            const float* s = scale != nullptr ? scale + 16 * p : nullptr;
            if constexpr (kCodes<W>) {
                if (c1 - c0 > 2 * kRows) {
                    widen_codes(w + p * panel, np * panel, widened.data());
                    group_blocks<uint16_t>(x, x_stride, c0, c1, widened.data(), panel, K, bias, s, p, np, N, y, y_stride, gated,
                                           next_w, next_lines);
                    continue;
                }
            }
            group_blocks<W>(x, x_stride, c0, c1, w + p * panel, panel, K, bias, s, p, np, N, y, y_stride, gated, next_w,
                            next_lines);
        }
    }
}

// One thread's share of a layer whose weights come widened to bfloat16 panels a group at a time
// (int4_panels.h): widen(p, np, out) writes panels [p, p + np) at out, into this thread's scratch;
// every row's blocks then multiply that group (so it is widened once per call, whatever M).
template <typename Widen>
void widened_part(const uint16_t* x, int64_t x_stride, int64_t M, const Widen& widen, int64_t panel, int64_t N, int K,
                  const float* bias, uint16_t* y, int64_t y_stride, int64_t p0, int64_t p1) {
    static thread_local std::vector<uint16_t> widened;
    if (widened.size() < static_cast<size_t>(kPanels * panel)) widened.resize(kPanels * panel);
    for (int64_t p = p0; p < p1; p += kPanels) {
        const int np = p1 - p < kPanels ? static_cast<int>(p1 - p) : kPanels;
        widen(p, np, widened.data());
        for (int64_t c0 = 0; c0 < M; c0 += kChunk)
            group_blocks<uint16_t>(x, x_stride, c0, c0 + kChunk < M ? c0 + kChunk : M, widened.data(), panel, K, bias, nullptr,
                                   p, np, N, y, y_stride, false, nullptr, 0);
    }
}

}  // namespace modserve::bf16_panels

#endif
