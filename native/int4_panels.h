// int4 weights as torch's CPU int4 kernel holds them, for our own products: widened to the packed
// bfloat16 panels that the AMX tiles (cpu_amx_linear.cpp) and VDPBF16PS (cpu_avx512_linear.cpp)
// multiply, a thread's share at a time into a scratch of its own, or (few rows) multiplied
// directly; and for float32 models, widened to float32 panels for the FMA loops
// (cpu_avx2_linear.cpp), where torch's int4 kernel takes a slow path (30-160x a bfloat16-held
// float32 layer's time on a Zen 5).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_scales.h"
#include "prefetch.h"

namespace modserve {

// int4 weights in torch's AVX-512 CPU packing, which cpu_int4_packing.py writes on every CPU (for each block of
// 64 outputs, [K][32] bytes, byte j holding output j in its low nibble and output j + 32 in its
// high one) with torch's scales_and_zeros ([K/group][N][2] bfloat16: w = (q - 8) s + z),
// widened into the packed bfloat16 panels (cpu_panel_linear.py's pack) for 16-output panels
// [panel0, panel1), panel0 written at `out`: each weight computed in float32 as q s + (z - 8 s),
// rounded to nearest even. `scales(g, n0, s, base)` gives group g's s and base for outputs n0 ..
// n0 + 15: from torch's pairs (widen_int4_panels below) or a GGUF layer's own scales.
template <typename Scales>
void widen_int4_panels_with(const uint8_t* q4, Scales scales, int K, int group, int64_t panel0, int64_t panel1, uint16_t* out) {
    const int kb = K / 32;
    const __m512i low_nibble = _mm512_set1_epi32(0xF);
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                                 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t p = panel0; p < panel1; ++p) {
        const int64_t n0 = p * 16;
        const uint8_t* block = q4 + (n0 / 64) * 64 * static_cast<int64_t>(K / 2);
        const int sub = static_cast<int>(n0 % 64) / 16, byte0 = (sub % 2) * 16;
        const bool high = sub >= 2;
        for (int kt = 0; kt < kb; ++kt) {
            __m512 s, base;  // each weight q s + base
            scales(kt * 32 / group, n0, s, base);
            uint16_t* tile = out + ((p - panel0) * kb + kt) * 512;
            for (int r = 0; r < 16; ++r) {
                const int k = kt * 32 + 2 * r;
                __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + k * 32 + byte0)));
                __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (k + 1) * 32 + byte0)));
                qa = high ? _mm512_srli_epi32(qa, 4) : _mm512_and_si512(qa, low_nibble);
                qb = high ? _mm512_srli_epi32(qb, 4) : _mm512_and_si512(qb, low_nibble);
                const __m512 wa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qa), s, base);
                const __m512 wb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qb), s, base);
                // [wa 0..15 | wb 0..15] as bfloat16, then interleaved: (wa_n, wb_n) per output n
                const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(wb, wa));
                _mm512_storeu_si512(tile + r * 32, _mm512_permutexvar_epi16(pair_order, both));
            }
        }
    }
}

inline void widen_int4_panels(const uint8_t* q4, const uint16_t* sz, int64_t N, int K, int group, int64_t panel0, int64_t panel1,
                              uint16_t* out) {
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    widen_int4_panels_with(q4, [=](int g, int64_t n0, __m512& s, __m512& base) {
        // 16 (scale, zero) bfloat16 pairs, one per output: a dword each
        const __m512i pairs = _mm512_loadu_si512(sz + (static_cast<int64_t>(g) * N + n0) * 2);
        s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        base = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half)));  // z - 8 s
    }, K, group, panel0, panel1, out);
}

// The same widening from a GGUF layer's own scales (Int4Scales' kHalf or kTwoLevel): q s + m.
inline void widen_int4_panels(const uint8_t* q4, const Int4Scales& sc, int K, int group, int64_t panel0, int64_t panel1, uint16_t* out) {
    widen_int4_panels_with(q4, [&](int g, int64_t n0, __m512& s, __m512& base) { sc.of16(g, n0, s, base); }, K, group, panel0, panel1, out);
}

// Rows [0, R) (R 1 to 4) of x times one 64-output block of torch's int4 packing (`block`:
// [K][32] bytes; `sz` its outputs' (scale, zero) pairs at group 0, groups N pairs apart), without
// widening to memory: for the few-row calls where a widened scratch would be read too few times.
// Each input pair's nibbles become bfloat16 (128 + q) by a mask and an OR (exact), so VDPBF16PS
// sums D = 128 X + sum x q over a group, X its inputs' sum (`xsum`, [R][groups] float32); the
// group then adds s D + (z - 136 s) X = sum x ((q - 8) s + z) to the float32 sums. The weights
// are never rounded (the widened path rounds each to bfloat16). y gets the sums plus the bias,
// rounded once to bfloat16.
//
// Two inputs' 32-byte rows, bytes interleaved (VPUNPCKL/HBW, within 128-bit lanes) and widened to
// words, give four vectors of (input k, input k + 1) pairs: low nibbles of the low halves for
// outputs 0-7 and 16-23, of the high halves for 8-15 and 24-31; high nibbles likewise for 32-63.
template <int R>
void int4_block_direct(const uint16_t* x, int64_t x_stride, const float* xsum, int groups, const uint8_t* block,
                       const uint16_t* sz, int64_t N, int K, int group, const float* bias, uint16_t* y, int64_t y_stride,
                       const Int4Scales* file = nullptr, int64_t n0 = 0) {
    const __m512i nibble = _mm512_set1_epi16(0xF), magic = _mm512_set1_epi16(0x4300);  // bfloat16 128.0
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    // The block's sums, updated once a group: in memory, so that the R x 4 group sums fit the registers.
    alignas(64) float acc[R][4][16] = {};
    for (int g = 0; g < groups; ++g) {
        __m512 sums[R][4];
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < 4; ++q) sums[r][q] = _mm512_setzero_ps();
        // The (scale, zero) pairs two groups ahead: N pairs apart, a line each where no hardware prefetch looks
        // (a Llama-1B-shaped pass at one row on a Zen 5: 2.10-2.21x bfloat16's speed before, 2.62-2.63x after).
        if (file != nullptr)
            prefetch_scales_ahead(*file, g, groups, n0);
        else if (g + 2 < groups)
            for (int line = 0; line < 4; ++line) prefetch_line(sz + static_cast<int64_t>(g + 2) * N * 2 + line * 32);
        for (int k = g * group; k < (g + 1) * group; k += 2) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + static_cast<int64_t>(k) * 32));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + static_cast<int64_t>(k + 1) * 32));
            const __m512i lo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(a, b));
            const __m512i hi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(a, b));
            const __m512bh w[4] = {
                reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(lo, nibble, magic, 0xEA)),  // (v & 0xF) | 128.0
                reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(hi, nibble, magic, 0xEA)),
                reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_srli_epi16(lo, 4), magic)),
                reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_srli_epi16(hi, 4), magic)),
            };
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, x + r * x_stride + k, sizeof pair);
                const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
                for (int q = 0; q < 4; ++q) sums[r][q] = _mm512_dpbf16_ps(sums[r][q], xb, w[q]);
            }
        }
        const uint16_t* sg = sz + static_cast<int64_t>(g) * N * 2;
        for (int half = 0; half < 2; ++half) {  // outputs 0-31 (vectors 0, 1), then 32-63 (2, 3)
            __m512i p0, p1;  // torch's pairs of outputs 32 half + 0-15, 16-31
            __m512 s0, m0, s1, m1;  // or a GGUF layer's own scales and minima
            if (file != nullptr) {
                file->of16(g, n0 + 32 * half, s0, m0);
                file->of16(g, n0 + 32 * half + 16, s1, m1);
            } else {
                p0 = _mm512_loadu_si512(sg + half * 64), p1 = _mm512_loadu_si512(sg + half * 64 + 32);
            }
            for (int v = 0; v < 2; ++v) {
                __m512 s, c;  // c = m - 128 s = z - 136 s
                if (file != nullptr) {  // the vector's outputs
                    s = _mm512_permutex2var_ps(s0, v == 0 ? first : second, s1);
                    c = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, _mm512_permutex2var_ps(m0, v == 0 ? first : second, m1));
                } else {
                    const __m512i pairs = _mm512_permutex2var_epi32(p0, v == 0 ? first : second, p1);
                    s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                    c = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half)));
                }
                const int q = 2 * half + v;
                for (int r = 0; r < R; ++r) {
                    const __m512 before = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[r * groups + g]), _mm512_load_ps(acc[r][q]));
                    _mm512_store_ps(acc[r][q], _mm512_fmadd_ps(s, sums[r][q], before));
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int half = 0; half < 2; ++half)
            for (int v = 0; v < 2; ++v) {  // outputs 32 half + 16 v ..: the two vectors' lanes back in order
                const int n = 32 * half + 16 * v;
                __m512 out = _mm512_permutex2var_ps(_mm512_load_ps(acc[r][2 * half]), v == 0 ? first : second,
                                                    _mm512_load_ps(acc[r][2 * half + 1]));
                if (bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + n));
                const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(out));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + n), rounded);
            }
}

}  // namespace modserve

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

#include "int4_scales.h"
#include "prefetch.h"

namespace modserve {

#if defined(__AVX512F__)
// The low 4 bits of each 32-bit lane of `v` (a nibble, whatever the bits above) as float32:
// VPERMPS over the table 0..15 reads only those bits of an index, so no mask and no conversion.
inline __m512 nibbles_as_floats(__m512i v) {
    return _mm512_permutexvar_ps(v, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif

// int4 weights in torch's CPU packing (as widen_int4_panels reads them) with a float32 model's
// scales (`sc`: Int4Scales), widened to float32 panels of 16 outputs, [K][16] each, for panels
// [panel0, panel1), panel0 written at `out`: each weight q s + m in float32 (one FMA). With
// AVX-512 a panel's input is one vector: its 16 nibbles by nibbles_as_floats, one FMA, one store;
// the 8-wide loop takes twice the instructions and a mask and a conversion more.
inline void widen_int4_f32(const uint8_t* q4, const Int4Scales& sc, int K, int group, int64_t panel0, int64_t panel1, float* out) {
    for (int64_t p = panel0; p < panel1; ++p) {
        const int64_t n0 = p * 16;
        const uint8_t* block = q4 + (n0 / 64) * 64 * static_cast<int64_t>(K / 2);
        const int sub = static_cast<int>(n0 % 64) / 16, byte0 = (sub % 2) * 16;
        const bool high = sub >= 2;
        float* panel = out + (p - panel0) * static_cast<int64_t>(K) * 16;
#if defined(__AVX512F__)
        const int shift = high ? 4 : 0;
        for (int g = 0; g < K / group; ++g) {
            __m512 s, base;
            sc.of16(g, n0, s, base);
            for (int k = g * group; k < (g + 1) * group; ++k) {
                const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + static_cast<int64_t>(k) * 32 + byte0));
                const __m512i q = _mm512_srli_epi32(_mm512_cvtepu8_epi32(bytes), shift);
                _mm512_storeu_ps(panel + k * 16, _mm512_fmadd_ps(nibbles_as_floats(q), s, base));
            }
        }
#else
        const __m256i low_nibble = _mm256_set1_epi32(0xF);
        for (int g = 0; g < K / group; ++g) {
            __m256 s[2], base[2];  // outputs 8 h .. 8 h + 7
            for (int h = 0; h < 2; ++h) sc.of8(g, n0 + 8 * h, s[h], base[h]);
            for (int k = g * group; k < (g + 1) * group; ++k)
                for (int h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
                    const uint8_t* src = block + static_cast<int64_t>(k) * 32 + byte0 + 8 * h;
                    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
                    const __m256i v = _mm256_cvtepu8_epi32(bytes);
                    const __m256i q = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, low_nibble);
                    _mm256_storeu_ps(panel + k * 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s[h], base[h]));
                }
        }
#endif
    }
}

// Rows [0, R) of float32 x times one 64-output block of torch's int4 packing (`block`: [K][32]
// bytes, byte j holding output j in its low nibble and output j + 32 in its high one; `sc` the
// layer's scales, `n0` the block's first output), without widening to memory: for the few-row
// calls, where the float32 scratch of widen_int4_f32, written and read once or twice, cost more
// than the product. Each input's 32 bytes become 64 float32 nibbles in registers once, summed
// against each row's input by FMAs per group (D = sum x q); the group then adds s D + m X, X its
// inputs' sum (`xsum`, [R][groups]): sum x (q s + m). y gets the sums plus the bias.
//
// With AVX-512, 16 outputs a vector (half the instructions of the 8-wide loop), and a nibble
// becomes float32 by nibbles_as_floats: 12 vector instructions an input instead of 14 (the
// loop is bound by them: on a Cascade Lake one row of SmolLM2's shapes in cache ran at about
// 7 cycles an input). The decoded nibbles serve all R rows, so from 2 rows an input costs 8
// instructions plus 4 FMAs a row (SmolLM2's gate_up from cache, 4 rows: 3.8 cycles a row and
// input against 8.5 one row at a time). The group sums stay in registers (4 R of them; R up to
// 6 leaves 8 for the nibbles, the table and the broadcast), the running sums in memory,
// updated once a group. Every loop over rows and vectors is unrolled: otherwise GCC kept each
// group sum in memory too, a store per FMA. Each line of codes asks for the line
// kInt4AheadBytes on: a thread's blocks are one stream, but its decoding keeps the core busy
// between loads, and the hardware prefetcher alone left one row at 0.85x (2,048 to 8,192 bytes
// ahead measured alike on the Cascade Lake; no effect from 8 rows, bound by the FMAs).
#if defined(__AVX512F__)
constexpr int64_t kInt4AheadBytes = 4096;

template <int R>
void int4_f32_block_rows(const float* x, int64_t x_stride, const float* xsum, int groups, const uint8_t* block, const Int4Scales& sc,
                         int64_t n0, int group, const float* bias, float* y, int64_t y_stride) {
    alignas(64) float acc[R][4][16] = {};  // outputs 16 i .. 16 i + 15: the low nibbles of bytes 0-15, 16-31, then the high ones
    for (int g = 0; g < groups; ++g) {
        __m512 sums[R][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) sums[r][i] = _mm512_setzero_ps();
        prefetch_scales_ahead(sc, g, groups, n0);
        for (int k2 = g * group; k2 < (g + 1) * group; k2 += 2) {  // two inputs (a 64-byte line) a step
            prefetch_line(block + static_cast<int64_t>(k2) * 32 + kInt4AheadBytes);
#pragma GCC unroll 2
            for (int k = k2; k < k2 + 2; ++k) {
                const uint8_t* row = block + static_cast<int64_t>(k) * 32;
                const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
                const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
                const __m512 w[4] = {nibbles_as_floats(v0), nibbles_as_floats(v1), nibbles_as_floats(_mm512_srli_epi32(v0, 4)),
                                     nibbles_as_floats(_mm512_srli_epi32(v1, 4))};
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const __m512 xb = _mm512_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; ++i) sums[r][i] = _mm512_fmadd_ps(xb, w[i], sums[r][i]);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            __m512 s, m;
            sc.of16(g, n0 + 16 * i, s, m);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512 before = _mm512_fmadd_ps(s, sums[r][i], _mm512_load_ps(acc[r][i]));
                _mm512_store_ps(acc[r][i], _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), before));
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) {
            const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + 16 * i) : _mm512_setzero_ps();
            _mm512_storeu_ps(y + r * y_stride + 16 * i, _mm512_add_ps(_mm512_load_ps(acc[r][i]), b));
        }
}

// The most rows the direct path takes (beyond, widened panels; measured in docs/cpu_linears.md),
// and the rows a register block takes at once (int4_f32_block_rows' R: 4 R sums of 32 registers).
constexpr int64_t kInt4F32DirectRows = 24;
constexpr int64_t kInt4F32BlockRows = 6;

// Rows [0, M) times one 64-output block: int4_f32_block_rows, kInt4F32BlockRows rows at a time.
inline void int4_f32_block(const float* x, int64_t x_stride, int64_t M, const float* xsum, int groups, const uint8_t* block,
                           const Int4Scales& sc, int64_t n0, int group, const float* bias, float* y, int64_t y_stride) {
    static_assert(kInt4F32BlockRows == 6, "the cases below");
    for (int64_t r = 0; r < M; r += kInt4F32BlockRows) {
        const float* xr = x + r * x_stride;
        const float* sr = xsum + r * groups;
        float* yr = y + r * y_stride;
        switch (M - r) {
            case 1: int4_f32_block_rows<1>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride); break;
            case 2: int4_f32_block_rows<2>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride); break;
            case 3: int4_f32_block_rows<3>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride); break;
            case 4: int4_f32_block_rows<4>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride); break;
            case 5: int4_f32_block_rows<5>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride); break;
            default: int4_f32_block_rows<6>(xr, x_stride, sr, groups, block, sc, n0, group, bias, yr, y_stride);
        }
    }
}
#else
// The 8-wide loop: one row at a time (its 8 sums of a row fill half the 16 registers).
inline void int4_f32_block_row(const float* x, const float* xsum, int groups, const uint8_t* block, const Int4Scales& sc, int64_t n0,
                               int group, const float* bias, float* y) {
    const __m256i low_nibble = _mm256_set1_epi32(0xF);
    alignas(32) float acc[64] = {};
    for (int g = 0; g < groups; ++g) {
        __m256 sums[8];  // outputs 8 i .. 8 i + 7 (i < 4: low nibbles), 32 + 8 (i - 4) .. (high nibbles)
        for (int i = 0; i < 8; ++i) sums[i] = _mm256_setzero_ps();
        prefetch_scales_ahead(sc, g, groups, n0);
        for (int k = g * group; k < (g + 1) * group; ++k) {
            const __m256 xb = _mm256_broadcast_ss(x + k);
            for (int i = 0; i < 4; ++i) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + static_cast<int64_t>(k) * 32 + 8 * i)));
                sums[i] = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_and_si256(v, low_nibble)), sums[i]);
                sums[4 + i] = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), sums[4 + i]);
            }
        }
        const __m256 xs = _mm256_set1_ps(xsum[g]);
        for (int i = 0; i < 8; ++i) {
            __m256 s, m;
            sc.of8(g, n0 + 8 * i, s, m);
            _mm256_store_ps(acc + 8 * i, _mm256_fmadd_ps(m, xs, _mm256_fmadd_ps(s, sums[i], _mm256_load_ps(acc + 8 * i))));
        }
    }
    for (int i = 0; i < 8; ++i) {
        const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + 8 * i) : _mm256_setzero_ps();
        _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(_mm256_load_ps(acc + 8 * i), b));
    }
}

// The 8-wide loop decodes the nibbles again for each row, so from 3 rows the widened panels win.
constexpr int64_t kInt4F32DirectRows = 2;

// Rows [0, M) times one 64-output block, a row at a time.
inline void int4_f32_block(const float* x, int64_t x_stride, int64_t M, const float* xsum, int groups, const uint8_t* block,
                           const Int4Scales& sc, int64_t n0, int group, const float* bias, float* y, int64_t y_stride) {
    for (int64_t r = 0; r < M; ++r) int4_f32_block_row(x + r * x_stride, xsum + r * groups, groups, block, sc, n0, group, bias, y + r * y_stride);
}
#endif

}  // namespace modserve

#endif
