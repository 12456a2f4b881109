// int4 weights as torch's CPU int4 kernel holds them, widened to the packed bfloat16 panels
// that the AMX tiles (cpu_amx_linear.cpp) and VDPBF16PS (cpu_avx512_linear.cpp) multiply: both
// widen a thread's share of a layer into a scratch of their own and run their bfloat16 products
// on it, for the many-row calls where torch's int4 kernel (a matrix-vector product per row) is slow.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

namespace modserve {

// int4 weights in torch's CPU packing (_convert_weight_to_int4pack_for_cpu: for each block of
// 64 outputs, [K][32] bytes, byte j holding output j in its low nibble and output j + 32 in its
// high one) with torch's scales_and_zeros ([K/group][N][2] bfloat16: w = (q - 8) s + z),
// widened into the packed bfloat16 panels (cpu_panel_linear.py's pack) for 16-output panels [panel0, panel1), panel0
// written at `out`: each weight computed in float32 as q s + (z - 8 s), rounded to nearest even.
inline void widen_int4_panels(const uint8_t* q4, const uint16_t* sz, int64_t N, int K, int group, int64_t panel0,
                              int64_t panel1, uint16_t* out) {
    const int kb = K / 32;
    const __m512i low_nibble = _mm512_set1_epi32(0xF), high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                                 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t p = panel0; p < panel1; ++p) {
        const int64_t n0 = p * 16;
        const uint8_t* block = q4 + (n0 / 64) * 64 * static_cast<int64_t>(K / 2);
        const int sub = static_cast<int>(n0 % 64) / 16, byte0 = (sub % 2) * 16;
        const bool high = sub >= 2;
        for (int kt = 0; kt < kb; ++kt) {
            const int g = kt * 32 / group;
            // 16 (scale, zero) bfloat16 pairs, one per output: a dword each
            const __m512i pairs = _mm512_loadu_si512(sz + (static_cast<int64_t>(g) * N + n0) * 2);
            const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
            const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z - 8 s
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

}  // namespace modserve

#endif
