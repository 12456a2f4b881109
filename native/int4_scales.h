// int4 scales as a GGUF file gives them, for the int4 panel kernels (int4_panels.h; the layouts
// are cpu_int4_scales.py's).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

#include "prefetch.h"

namespace modserve {

// A layer's int4 scales: w = q s + m for each group of inputs of each output, in one of
// three layouts: kTorch, a float32 model's torch scales_and_zeros, [K/group][N][2] float32 (s, z)
// with z = m + 8 s (m = z - 8 s, rounded once; a bfloat16 model's, in bfloat16, the bfloat16
// kernels read as they are); kHalf, [N/64][K/group][2][64] float16, for each block of 64 outputs
// and group a row of their s then a row of their m, as GGUF's Q4_0 / Q4_1 blocks give them (Q4_0:
// m = -8 s); kTwoLevel, the K-quants' int8 sc and mn in the same rows, times `outer`'s float32 d
// and -dmin rows, [N/64][K/(group super_groups)][2][64]: s = d sc, m = -dmin mn, each exact. 1 bit
// a weight for kHalf and 0.75 for kTwoLevel at groups of 32, against kTorch's 2. A block's scales
// are one sequential stream, as the kernels walk them (torch's layout puts each group's N pairs
// apart: a page a group at K 8,192, which cost a one-row bfloat16 pass 10% with rows laid out
// that way), and a row keeps 8 or 16 outputs side by side: a load and a conversion each.
struct Int4Scales {
    enum Kind { kTorch = 0, kHalf = 1, kTwoLevel = 2 };
    const void* pairs;
    const float* outer;
    int kind, super_shift, groups;
    int64_t N;

    Int4Scales(const void* pairs, int64_t N, int groups, int kind = kTorch, const float* outer = nullptr, int super_groups = 1)
        : pairs(pairs), outer(outer), kind(kind), super_shift(__builtin_ctz(super_groups)), groups(groups), N(N) {}

    // kHalf, kTwoLevel: where output n's value of group g lies (`which` 0: s or sc, 1: m or mn), and its outer value.
    int64_t at(int g, int64_t n, int which) const { return (((n >> 6) * groups + g) * 2 + which) * 64 + (n & 63); }
    const float* outer_at(int g, int64_t n, int which) const {
        return outer + (((n >> 6) * (groups >> super_shift) + (g >> super_shift)) * 2 + which) * 64 + (n & 63);
    }

    // s and m of outputs n .. n + 7 in group g.
    void of8(int g, int64_t n, __m256& s, __m256& m) const {
        if (kind == kTorch) {
            const float* at = static_cast<const float*>(pairs) + (static_cast<int64_t>(g) * N + n) * 2;
            const __m256 a = _mm256_loadu_ps(at), b = _mm256_loadu_ps(at + 8);  // the pairs of outputs n .. n + 3, n + 4 .. n + 7
            s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
            const __m256 z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
            m = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);  // z - 8 s
        } else if (kind == kHalf) {
            const uint16_t* h = static_cast<const uint16_t*>(pairs);
            s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + at(g, n, 0))));
            m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + at(g, n, 1))));
        } else {
            const int8_t* c = static_cast<const int8_t*>(pairs);
            const auto widen = [](const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); };
            s = _mm256_mul_ps(_mm256_loadu_ps(outer_at(g, n, 0)), widen(c + at(g, n, 0)));
            m = _mm256_mul_ps(_mm256_loadu_ps(outer_at(g, n, 1)), widen(c + at(g, n, 1)));
        }
    }

#if defined(__AVX512F__)
    // s and m of outputs n .. n + 15 in group g.
    void of16(int g, int64_t n, __m512& s, __m512& m) const {
        if (kind == kTorch) {
            const float* at = static_cast<const float*>(pairs) + (static_cast<int64_t>(g) * N + n) * 2;
            const __m512 a = _mm512_loadu_ps(at), b = _mm512_loadu_ps(at + 16);
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            s = _mm512_permutex2var_ps(a, even, b);
            const __m512 z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
            m = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
        } else if (kind == kHalf) {
            const uint16_t* h = static_cast<const uint16_t*>(pairs);
            s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + at(g, n, 0))));
            m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + at(g, n, 1))));
        } else {
            const int8_t* c = static_cast<const int8_t*>(pairs);
            const auto widen = [](const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); };
            s = _mm512_mul_ps(_mm512_loadu_ps(outer_at(g, n, 0)), widen(c + at(g, n, 0)));
            m = _mm512_mul_ps(_mm512_loadu_ps(outer_at(g, n, 1)), widen(c + at(g, n, 1)));
        }
    }
#endif
};

// Asks for a 64-output block's scales two groups ahead of group g (and their outer values, at a
// super block's start): torch's pairs lie N pairs apart, where no hardware prefetch looks.
inline void prefetch_scales_ahead(const Int4Scales& sc, int g, int groups, int64_t n0) {
    if (g + 2 >= groups) return;
    const char* base = static_cast<const char*>(sc.pairs);
    if (sc.kind == Int4Scales::kTorch) {
        for (int line = 0; line < 8; ++line) prefetch_line(base + ((g + 2) * sc.N + n0) * 8 + line * 64);
        return;
    }
    const int bytes = sc.kind == Int4Scales::kHalf ? 2 : 1;  // a value's: the group's two rows, 128 values in a row
    for (int line = 0; line < 2 * bytes; ++line) prefetch_line(base + sc.at(g + 2, n0, 0) * bytes + line * 64);
    if (sc.kind == Int4Scales::kTwoLevel && ((g + 2) & ((1 << sc.super_shift) - 1)) == 0)
        for (int line = 0; line < 8; ++line) prefetch_line(sc.outer_at(g + 2, n0, 0) + line * 16);
}

}  // namespace modserve

#endif
