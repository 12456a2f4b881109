// AVX-512 helpers shared by the CPU kernels; empty where the compiler targets no AVX-512F
// (the kernels then keep their portable loops). Every helper works on 16 float32 lanes.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "prefetch.h"

namespace modserve {

// 16 bfloat16 values (the high halves of float32s) as float32.
inline __m512 widen_bf16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// 16 elements as float32: float32 as is, bfloat16 widened, int8 converted (scales are applied
// by the caller); with a mask, only the lanes it names are read (the others are 0).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// v's float32 bit patterns rounded to bfloat16 exactly as float_to_bf16 in bf16.h does (to
// nearest even, the same integer formula lane-wise): the result is each lane's high 16 bits.
inline __m512i bf16_rounded_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

// v rounded to bfloat16 and widened back to float32, lane-wise.
inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 float32 lanes narrowed to bfloat16 (bf16_rounded_bits).
inline __m256i narrow_bf16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16)); }

// Stores 16 float32 lanes to p: as they are, or narrowed to bfloat16; with a mask, only the
// lanes it names.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(v)); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, narrow_bf16(v)); }

// The first `left` of 16 lanes (an output panel's columns that exist).
inline __mmask16 cols_mask(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for x <= 0, lane-wise: the same reduction and polynomial as exp_nonpositive in
// fast_exp.h (relative error ~2e-7), with 2^n applied by scalef.
inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}

// silu(x) = x * sigmoid(x) as cpu_fused_ops.cpp computes it: exp only of -|x|, then 1 / (1 + e)
// for x >= 0, e / (1 + e) below.
inline __m512 silu16(__m512 x) {
    const __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
    const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_mul_ps(x, _mm512_mask_blend_ps(pos, _mm512_mul_ps(e, r), r));
}

// A gated linear's output from float32 gate and up sums of the same 16 columns: each rounded to
// bfloat16 as the product's output would be, then bf16(silu(gate)) * up, the fused SiLU-mul's
// rounding up to the final narrowing (store16).
inline __m512 silu_mul_bf16(__m512 gate, __m512 up) {
    return _mm512_mul_ps(round_bf16(silu16(round_bf16(gate))), round_bf16(up));
}

// transpose_sum16 after its first step, where a[i] holds v[2i] and v[2i + 1] folded as
// there (a caller producing the v's in pairs folds each pair at once: fewer live vectors).
inline __m512 transpose_sum16_from_pairs(const __m512* a) {
    __m512 b[4];
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of v[4i .. 4i+3]
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], kEven), _mm512_shuffle_f32x4(b[0], b[1], kOdd));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], kEven), _mm512_shuffle_f32x4(b[2], b[3], kOdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, kEven), _mm512_shuffle_f32x4(s01, s23, kOdd));
}

// The first step of transpose_sum16: v[2i] and v[2i + 1] as one vector of partial sums
// (per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]).
inline __m512 fold_pair(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
}

// Lane i of the result = the sum of the 16 lanes of v[i]: sixteen horizontal sums for the
// price of about three (pairwise unpacks, then 128-bit lane shuffles).
inline __m512 transpose_sum16(const __m512* v) {
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = fold_pair(v[2 * i], v[2 * i + 1]);
    return transpose_sum16_from_pairs(a);
}

// Transposes a 16 x 16 float32 block held as 16 row vectors, in place: r[i][j] <- r[j][i].
inline void transpose16x16(__m512* r) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: [x_{4L} y_{4L} x_{4L+1} y_{4L+1}], [.. +2, .. +3]
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + j], lane L: element 4L + j of rows 4i .. 4i + 3
        const __m512d a0 = _mm512_castps_pd(a[4 * i]), a1 = _mm512_castps_pd(a[4 * i + 1]);
        const __m512d a2 = _mm512_castps_pd(a[4 * i + 2]), a3 = _mm512_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes: column 4L + j from lane L of each
        const __m512 c0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
        const __m512 c2 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
        const __m512 c3 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_f32x4(c0, c2, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(c1, c3, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
    }
}

#if defined(__AVX512BF16__)
// 32 bfloat16 values as vdpbf16ps takes them. GCC 12 compiles a C cast of an __m512i to
// __m512bh as a store and a reload through the stack (a round trip per load in the
// kernels' inner loops); a memcpy compiles to the plain load or to nothing.
inline __m512bh as_bh(__m512i x) {
    __m512bh y;
    std::memcpy(&y, &x, sizeof y);
    return y;
}

inline __m512bh load_bh(const void* p) {
    __m512bh y;
    std::memcpy(&y, p, sizeof y);
    return y;
}
#endif  // __AVX512BF16__

}  // namespace modserve

#endif  // __AVX512F__
