// int8 codes with a scale, and optionally a zero, per group of inputs of each output: GGUF's Q8_0
// (groups of 32); the 4- to 6-bit formats (Q6_K in groups of 16, Q5_x, Q4_K in a mixed layer) as
// stored, codes below 128 with their minima as zeros, the K-quants' scales in their two levels
// (gguf_quantized.py); GPTQ's 8-bit groups. Held as group panels (GroupPanels below: a panel of
// 16 outputs, group after group, each group's codes in the panel kernels' pair order followed by
// its scales and zeros, in as few bytes as the file gave them), widened per call to the panels
// our products read: bfloat16 (cpu_avx512_linear.cpp) or float32 (cpu_avx2_linear.cpp), a
// thread's four panels at a time into a scratch of its own (avx512_bf16_panels.h's and
// float32_panels.h's widened_part); and, for few rows, multiplied directly group by group
// (group_int8_direct, group_f32_direct).
//
// Why: torch has no int8 product with group-wise scales, so Int8GroupLinear widened the whole
// weight in torch per call and ran F.linear on it: SmolLM2's 576 -> 1536 layer 171 us at one
// row against 14 us for its bfloat16 panels, and no decode call list could record it. Each
// weight is q d + z computed in float32 (q d exact: 8 by 11 bits, 19 for the K-quants' scales)
// and, for bfloat16, rounded once: the very weight Int8GroupLinear.weight_as gives. The scales
// lie inside each panel's stream, not in arrays of their own: a row then reads one sequential
// stream a panel instead of two or three, 1.25x faster at one row from memory (a Q6_K-like
// 2048 x 8192 layer on a Zen 5: 40-45 GB/s against 31-34).
#pragma once

#include <cstdint>
#include <cstring>

#include "prefetch.h"

namespace modserve {

// Where a layer's group panels keep what: panel p at data + p panel_bytes, its group g
// further on, holding the group's codes ([group / 2][16][2] int8: input pairs by outputs;
// `packed`: 6 bits each, packed_step below), then its 16 outputs' scales, then, where `zeros`,
// their 16 zeros; without zeros, symmetric codes kept as stored (q below 2^bits, w = d (q -
// center)) have the zero -center d computed from the scale (no bytes for it), and others none
// (`center` 0). The scales and zeros are `scale_bytes` each: 4, float32; 2, float16 (GGUF's
// Q8_0 and Q4/Q5_0/1 scales, as stored); 1, int8 multiples of float32 ones kept once per super
// block of `super_groups` groups (the K-quants' two levels: d sc, -dmin m, each product exact in
// float32), those 16 outer scales (and zeros) heading the block's first group.
struct GroupPanels {
    const int8_t* data;
    int K, group;
    bool zeros;
    float center;
    bool packed;
    int scale_bytes;
    int groups;                                               // K / group
    int super_shift, super_mask;                              // g >> shift: g's super block; g & mask: its place there
    int64_t code_bytes, group_bytes, head_bytes, super_bytes, panel_bytes;  // computed once: the loops ask group by group

    GroupPanels(const int8_t* data, int K, int group, bool zeros, float center, bool packed = false, int scale_bytes = 4,
                int super_groups = 0)
        : data(data), K(K), group(group), zeros(zeros), center(center), packed(packed), scale_bytes(scale_bytes), groups(K / group),
          super_shift(scale_bytes == 1 ? __builtin_ctz(super_groups) : 30), super_mask(scale_bytes == 1 ? super_groups - 1 : -1),
          code_bytes(static_cast<int64_t>(group) * (packed ? 12 : 16)), group_bytes(code_bytes + (zeros ? 32 : 16) * scale_bytes),
          head_bytes(scale_bytes == 1 ? (zeros ? 128 : 64) : 0),
          super_bytes(scale_bytes == 1 ? head_bytes + super_groups * group_bytes : groups * group_bytes),
          panel_bytes(scale_bytes == 1 ? groups / super_groups * super_bytes : groups * group_bytes) {}
    // Where group g's codes start in a panel, and where its bytes (with its super block's head, if first there) start.
    int64_t offset(int g) const { return (g >> super_shift) * super_bytes + head_bytes + (g & super_mask) * group_bytes; }
    int64_t span_start(int g) const { return offset(g) - ((g & super_mask) == 0 ? head_bytes : 0); }
    const int8_t* codes(int64_t p, int g) const { return data + p * panel_bytes + offset(g); }
    const int8_t* stored(int64_t p, int g, int which) const { return codes(p, g) + code_bytes + which * 16 * scale_bytes; }
    const float* outer(int64_t p, int g, int which) const {  // scale_bytes 1: the super block's float32 scales (or zeros)
        return reinterpret_cast<const float*>(data + p * panel_bytes + (g >> super_shift) * super_bytes) + 16 * which;
    }
    bool any_zero() const { return zeros || center != 0.f; }  // whether the inputs' group sums enter
    GroupPanels from(int64_t p) const {  // panel p as the first
        GroupPanels w = *this;
        w.data = data + p * panel_bytes;
        return w;
    }
};

// The most inputs a packed group may have: the paths that unpack a group into a buffer size it by this.
constexpr int kMaxPackedGroup = 32;

// The direct paths' loop (group_int8_direct, group_f32_direct): one thread's panels [p0, p1) for
// every row of a few-row call, in blocks of up to P panels and R rows, `block_for(rows, panels)`
// giving the block function of that size; each column of blocks' first asks for the next P
// panels ahead (a whole next column only).
template <int P, int R, typename X, typename Y, typename BlockFor>
void group_direct_blocks(const X* x, int64_t x_stride, int64_t M, GroupPanels w, const float* xsum, int64_t N, const float* bias,
                         Y* y, int64_t y_stride, int64_t p0, int64_t p1, BlockFor block_for) {
    const int groups = w.groups;
    for (int64_t p = p0; p < p1; p += P) {
        const int np = p1 - p < P ? static_cast<int>(p1 - p) : P;
        for (int64_t m = 0; m < M; m += R) {
            const int rows = M - m < R ? static_cast<int>(M - m) : R;
            const int8_t* ahead = m == 0 && p + 2 * P <= p1 ? w.codes(p + P, 0) : nullptr;
            block_for(rows, np)(x + m * x_stride, x_stride, w.from(p), xsum != nullptr ? xsum + m * groups : nullptr, bias, p * 16, N,
                                y + m * y_stride, y_stride, ahead);
        }
    }
}

// Asks for group g of the P panels at `ahead` (a group's codes, scales and zeros: a few lines
// a panel), while the same group of the P panels before them is multiplied.
template <int P>
inline void prefetch_group(const GroupPanels& w, const int8_t* ahead, int g) {
    const int64_t at = w.span_start(g), end = w.offset(g) + w.group_bytes;
    for (int p = 0; p < P; ++p)
        for (int64_t line = at; line < end; line += 64) prefetch_line(ahead + p * w.panel_bytes + line);
}

// Asks for the group after group g of panel p (or the next panel's first), for the widening
// loops: they read a group's scales, at its end, before its codes, an order that a hardware
// prefetcher follows less well than a plain stream (the widening 0.89x as fast without this).
inline void prefetch_next_group(const GroupPanels& w, int64_t p, int g) {
    const bool last = g + 1 == w.groups;  // then the next panel's first group
    const int8_t* panel = w.data + (last ? p + 1 : p) * w.panel_bytes;
    const int next = last ? 0 : g + 1;
    for (int64_t line = w.span_start(next); line < w.offset(next) + w.group_bytes; line += 64) prefetch_line(panel + line);
}

}  // namespace modserve

#if defined(__AVX2__)
#include <immintrin.h>

namespace modserve {

// Packed 6-bit codes (GGUF's 4- to 6-bit formats, q below 64): each quad of input pairs (4 x 32
// codes in the pairs' order) in 96 bytes: the low nibbles of pairs 0 and 1 (pair 1's in the high
// half of each byte), of pairs 2 and 3, then the four pairs' high two bits (pair s at bits 2s).
// 6 bits a code instead of 8, and a pair's 32 codes come back with five or six byte operations.
// Pair S of the quad at `quad`, as 32 codes:
template <int S>
inline __m256i packed_step(const int8_t* quad) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32 * (S / 2)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 64));
    const __m256i low = _mm256_and_si256(S % 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(0x0F));  // 16-bit shifts: the
    const __m256i high = S == 2 ? hi : S < 2 ? _mm256_slli_epi16(hi, 4 - 2 * S) : _mm256_srli_epi16(hi, 2);  // masks drop what
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));                             // crossed bytes
}

// A packed group's codes (`group` inputs: group / 8 quads) as bytes in the pairs' order at `out`.
inline void unpack_group(const int8_t* packed, int group, int8_t* out) {
    for (int q = 0; q < group / 8; ++q, packed += 96, out += 128) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed_step<0>(packed));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), packed_step<1>(packed));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64), packed_step<2>(packed));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 96), packed_step<3>(packed));
    }
}

// Group g of panel p's codes as bytes: where they lie, or, packed, unpacked into `buffer`
// (kMaxPackedGroup x 16 bytes).
inline const int8_t* group_codes(const GroupPanels& w, int64_t p, int g, int8_t* buffer) {
    if (!w.packed) return w.codes(p, g);
    unpack_group(w.codes(p, g), w.group, buffer);
    return buffer;
}

// Group g of panel p's 16 scales (`which` 0) or stored zeros (1) as float32, at `out`.
inline void group_values(const GroupPanels& w, int64_t p, int g, int which, float* out) {
    const int8_t* at = w.stored(p, g, which);
    if (w.scale_bytes == 4) {
        std::memcpy(out, at, 64);
    } else if (w.scale_bytes == 2) {
        _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));  // F16C: every AVX2 CPU's
        _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16))));
    } else {
        const float* outer = w.outer(p, g, which);
        for (int j = 0; j < 16; ++j) out[j] = outer[j] * static_cast<float>(at[j]);
    }
}

}  // namespace modserve
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>

#include "avx512.h"
#include "avx512_bf16_panels.h"

namespace modserve {

// Each group's inputs summed, [row][group] float32 (a zero z adds z times that sum): M x K
// bfloat16 inputs, the group a multiple of 16.
inline void group_input_sums(const uint16_t* x, int64_t x_stride, int64_t M, int K, int group, float* sums) {
    const int groups = K / group;
    for (int64_t r = 0; r < M; ++r)
        for (int g = 0; g < groups; ++g) {
            __m512 t = _mm512_setzero_ps();
            for (int k = g * group; k < (g + 1) * group; k += 16)
                t = _mm512_add_ps(t, load16(x + r * x_stride + k));
            sums[r * groups + g] = _mm512_reduce_add_ps(t);
        }
}

// Group g of panel p's 16 scales (`which` 0) or stored zeros (1) as float32 (group_values' in a register).
inline __m512 group_vector(const GroupPanels& w, int64_t p, int g, int which) {
    const int8_t* at = w.stored(p, g, which);
    if (w.scale_bytes == 4) return _mm512_loadu_ps(at);
    if (w.scale_bytes == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    const __m512 inner = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
    return _mm512_mul_ps(_mm512_loadu_ps(w.outer(p, g, which)), inner);
}

// Group g's zeros for panel p's 16 outputs: stored, or -center d.
inline __m512 group_zero(const GroupPanels& w, int64_t p, int g, __m512 d) {
    return w.zeros ? group_vector(w, p, g, 1) : _mm512_mul_ps(_mm512_set1_ps(-w.center), d);
}

// Unsigned codes below 128 (GGUF's 4- to 6-bit formats as stored: q, not q - 2^(bits-1)) as the
// bfloat16 values 128 + q, exactly, by a widening and an OR (0x4300 is bfloat16 128.0, its 7
// mantissa bits q): two instructions for a pair step's 32 codes, against five to convert signed
// int8 codes through float32 (bf16_panels::pair_weights). The group then takes the minimum m as
// its zero and adds (m - 128 d) times its inputs' sum: sum x (d q + m).
inline __m512bh magic_pair(__m256i codes) { return as_bh(_mm512_or_si512(_mm512_cvtepu8_epi16(codes), _mm512_set1_epi16(0x4300))); }
inline __m512bh magic_pair(const int8_t* codes) { return magic_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))); }

// How a group block reads its codes: as int8 through float32 (bf16_panels::pair_weights; codes
// below 128 read the same as unsigned), or, unsigned below 128, as 128 + q (magic_pair, their
// minima then the zeros); packed 6-bit codes (packed_step) are read as 128 + q too.
enum class Codes { kInt8, kMagic, kPacked };

// Rows [0, R) of x times panels [0, P) of `w` (`xsum` the rows' group_input_sums where the
// groups have zeros) without widening to memory, for the few-row calls where a widened scratch
// would be read too few times: each group's input pairs summed by VDPBF16PS over the codes
// widened in registers, then times the group's scales (plus its zeros times the inputs' sum)
// into sums kept in memory (R x P group sums fill the registers); then the bias, rounded once.
// The weights are q d + z unrounded (the widened path rounds each to bfloat16). `ahead`: the
// next P panels, asked for group by group. C: how the codes are read (Codes).
template <int R, int P, Codes C>
void group_int8_block(const uint16_t* x, int64_t x_stride, GroupPanels w, const float* xsum, const float* bias, int64_t n0, int64_t N,
                      uint16_t* y, int64_t y_stride, const int8_t* ahead) {
    constexpr bool kOffset = C != Codes::kInt8;  // the codes read as 128 + q
    const bool zeroed = w.any_zero() || kOffset;   // whether the inputs' sums enter
    const int groups = w.groups, pairs = w.group / 2;
    alignas(64) float acc[R][P][16] = {};
    for (int g = 0; g < groups; ++g) {
        if (ahead != nullptr) prefetch_group<P>(w, ahead, g);
        __m512 sums[R][P];
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_ps();
        const int8_t* codes[P];
        for (int p = 0; p < P; ++p) codes[p] = w.codes(p, g);
        const auto multiply = [&](int k, const __m512bh (&wv)[P]) {  // input pair k of the group times its P panels' weights
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, x + r * x_stride + g * w.group + 2 * k, sizeof pair);
                const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
                for (int p = 0; p < P; ++p) sums[r][p] = _mm512_dpbf16_ps(sums[r][p], xb, wv[p]);
            }
        };
        if constexpr (C == Codes::kPacked) {
            for (int q = 0; q < pairs / 4; ++q) {  // the quads of input pairs
                __m512bh wv[P];
                for (int p = 0; p < P; ++p) wv[p] = magic_pair(packed_step<0>(codes[p] + q * 96));
                multiply(4 * q, wv);
                for (int p = 0; p < P; ++p) wv[p] = magic_pair(packed_step<1>(codes[p] + q * 96));
                multiply(4 * q + 1, wv);
                for (int p = 0; p < P; ++p) wv[p] = magic_pair(packed_step<2>(codes[p] + q * 96));
                multiply(4 * q + 2, wv);
                for (int p = 0; p < P; ++p) wv[p] = magic_pair(packed_step<3>(codes[p] + q * 96));
                multiply(4 * q + 3, wv);
            }
        } else {
            for (int k = 0; k < pairs; ++k) {  // the group's input pairs
                __m512bh wv[P];
                for (int p = 0; p < P; ++p) wv[p] = kOffset ? magic_pair(codes[p] + k * 32) : bf16_panels::pair_weights(codes[p] + k * 32);
                multiply(k, wv);
            }
        }
        for (int p = 0; p < P; ++p) {
            const __m512 d = group_vector(w, p, g, 0);
            __m512 z = group_zero(w, p, g, d);
            if (kOffset) z = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, z);  // the sums are of x (128 + q)
            for (int r = 0; r < R; ++r) {
                __m512 a = _mm512_fmadd_ps(d, sums[r][p], _mm512_load_ps(acc[r][p]));
                if (zeroed) a = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), a);
                _mm512_store_ps(acc[r][p], a);
            }
        }
    }
    for (int p = 0; p < P; ++p) {
        const __mmask16 mask = cols_mask(N - n0 - 16 * p);
        const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * p) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r)
            _mm256_mask_storeu_epi16(y + r * y_stride + n0 + 16 * p, mask,
                                     reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc[r][p]), b))));
    }
}

using GroupBlock = void (*)(const uint16_t*, int64_t, GroupPanels, const float*, const float*, int64_t, int64_t, uint16_t*, int64_t,
                            const int8_t*);

template <int R, Codes C>
GroupBlock group_block_of_panels(int p) {
    return p == 1 ? group_int8_block<R, 1, C> : p == 2 ? group_int8_block<R, 2, C> : p == 3 ? group_int8_block<R, 3, C> : group_int8_block<R, 4, C>;
}

template <Codes C>
GroupBlock group_block_of(int rows, int panels) {
    return rows == 1 ? group_block_of_panels<1, C>(panels) : rows == 2 ? group_block_of_panels<2, C>(panels)
           : rows == 3 ? group_block_of_panels<3, C>(panels) : group_block_of_panels<4, C>(panels);
}

// One thread's panels [p0, p1) for every row (few rows), four panels and up to four rows a block;
// the first block of a column asks for the next four panels ahead (as the int8 panels do: a
// row's widening keeps the core busy between loads). C: how the codes are read (Codes), packed
// codes always as kPacked (the inputs' sums then enter: `xsum` given).
template <Codes C>
void group_int8_direct(const uint16_t* x, int64_t x_stride, int64_t M, GroupPanels w, const float* xsum, int64_t N, const float* bias,
                       uint16_t* y, int64_t y_stride, int64_t p0, int64_t p1) {
    const bool packed = w.packed;
    group_direct_blocks<4, 4>(x, x_stride, M, w, xsum, N, bias, y, y_stride, p0, p1, [packed](int rows, int np) {
        return packed ? group_block_of<Codes::kPacked>(rows, np) : group_block_of<C>(rows, np);
    });
}

// Panels [panel0, panel1) of `w` as bfloat16 panels ([K/2][16][2] each) at `out`, each weight
// q d + z rounded once.
inline void widen_group_int8_bf16(const GroupPanels& w, int64_t panel0, int64_t panel1, uint16_t* out) {
    const int64_t panel = static_cast<int64_t>(w.K / 32) * 512;  // elements of a widened panel
    const int group = w.group;
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // a pair step's lanes: outputs
    const __m512i second = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (int64_t p = panel0; p < panel1; ++p)
        for (int g = 0; g < w.groups; ++g) {
            prefetch_next_group(w, p, g);
            const __m512 d = group_vector(w, p, g, 0);
            const __m512 d_lo = _mm512_permutexvar_ps(first, d), d_hi = _mm512_permutexvar_ps(second, d);
            const __m512 z = group_zero(w, p, g, d);
            const __m512 z_lo = _mm512_permutexvar_ps(first, z), z_hi = _mm512_permutexvar_ps(second, z);
            alignas(64) int8_t unpacked[kMaxPackedGroup * 16];
            const __m128i* src = reinterpret_cast<const __m128i*>(group_codes(w, p, g, unpacked));
            uint16_t* dst = out + (p - panel0) * panel + static_cast<int64_t>(g) * group * 16;
            for (int i = 0; i < group * 16; i += 32, src += 2) {
                const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src))), d_lo, z_lo);
                const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1))), d_hi, z_hi);
                _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            }
        }
}

}  // namespace modserve

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "float32_panels.h"

namespace modserve {

// Rows [0, R) of float32 x times panels [0, P) of `w`, without widening to memory (the few-row
// calls, where a float32 scratch, written and read once, cost twice the weights' own reads): each
// group's pair steps summed by the float32 panel FMAs over codes widened in registers
// (float32_panels.h's pair_step), then times the group's scales, plus its zeros times the
// inputs' sum (`xsum`, [R][groups], where the groups have zeros), into sums in memory; then the
// bias. `ahead`: the next P panels, asked for group by group.
template <int R, int P>
void group_f32_block(const float* x, int64_t x_stride, GroupPanels w, const float* xsum, const float* bias, int64_t n0, int64_t N,
                     float* y, int64_t y_stride, const int8_t* ahead) {
    using float32_panels::Sums;
    const int groups = w.groups;
    alignas(64) float acc[R][P][16] = {};
    for (int g = 0; g < groups; ++g) {
        if (ahead != nullptr) prefetch_group<P>(w, ahead, g);
        Sums sums[R][P];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
            for (int q = 0; q < P; ++q) sums[r][q] = float32_panels::zero_sums();
        alignas(64) int8_t unpacked[P][kMaxPackedGroup * 16];  // packed codes: the group's, unpacked
        if (w.packed)
            for (int q = 0; q < P; ++q) unpack_group(w.codes(q, g), w.group, unpacked[q]);
        const int8_t* codes = w.packed ? unpacked[0] : w.codes(0, g);
        const int64_t panel = w.packed ? kMaxPackedGroup * 16 : w.panel_bytes;
        for (int k = 0; k < w.group / 2; ++k)  // the group's input pairs: its codes, `panel` apart, and its inputs
            float32_panels::pair_step<R, P, true>(x + g * w.group, x_stride, codes, panel, k, sums, sums);
        alignas(64) float scales[P][16], zeros[P][16];
        for (int q = 0; q < P; ++q) {
            group_values(w, q, g, 0, scales[q]);
            if (w.zeros) group_values(w, q, g, 1, zeros[q]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
            for (int q = 0; q < P; ++q) {
                alignas(64) float t[16];
                float32_panels::store_sums(t, sums[r][q]);
                const float* d = scales[q];
                if (w.zeros) {
                    const float* z = zeros[q];
                    const float xs = xsum[r * groups + g];
#pragma omp simd
                    for (int j = 0; j < 16; ++j) acc[r][q][j] += d[j] * t[j] + z[j] * xs;
                } else if (w.center != 0.f) {  // -center d times the inputs' sum
                    const float xs = xsum[r * groups + g] * -w.center;
#pragma omp simd
                    for (int j = 0; j < 16; ++j) acc[r][q][j] += d[j] * t[j] + d[j] * xs;
                } else {
#pragma omp simd
                    for (int j = 0; j < 16; ++j) acc[r][q][j] += d[j] * t[j];
                }
            }
    }
    for (int q = 0; q < P; ++q) {
        const int64_t cols = N - n0 - 16 * q < 16 ? N - n0 - 16 * q : 16;
        for (int r = 0; r < R; ++r)
            for (int64_t j = 0; j < cols; ++j) y[r * y_stride + n0 + 16 * q + j] = acc[r][q][j] + (bias != nullptr ? bias[n0 + 16 * q + j] : 0.f);
    }
}

#if defined(__AVX512F__)
constexpr int kGroupF32Rows = 4;  // rows per block: 8 zmm sums of two panels
#else
constexpr int kGroupF32Rows = 2;  // 8 of the 16 ymm registers
#endif

using GroupF32Block = void (*)(const float*, int64_t, GroupPanels, const float*, const float*, int64_t, int64_t, float*, int64_t,
                               const int8_t*);

template <int R>
GroupF32Block group_f32_block_of(int panels) { return panels == 1 ? group_f32_block<R, 1> : group_f32_block<R, 2>; }

// One thread's panels [p0, p1) for every row (few rows), two panels and kGroupF32Rows rows a block;
// a pair of panels' first block asks for the next pair ahead.
inline void group_f32_direct(const float* x, int64_t x_stride, int64_t M, GroupPanels w, const float* xsum, int64_t N, const float* bias,
                             float* y, int64_t y_stride, int64_t p0, int64_t p1) {
    group_direct_blocks<2, kGroupF32Rows>(x, x_stride, M, w, xsum, N, bias, y, y_stride, p0, p1, [](int rows, int np) {
        GroupF32Block run = group_f32_block_of<1>(np);
        if constexpr (kGroupF32Rows >= 2) run = rows == 2 ? group_f32_block_of<2>(np) : run;
        if constexpr (kGroupF32Rows >= 4) run = rows == 3 ? group_f32_block_of<3>(np) : rows == 4 ? group_f32_block_of<4>(np) : run;
        return run;
    });
}

// Each group's inputs summed, [row][group] float32, for float32 inputs (the bfloat16 ones:
// group_input_sums above): what a group's zero multiplies.
inline void group_input_sums(const float* x, int64_t x_stride, int64_t M, int K, int group, float* sums) {
    const int groups = K / group;
    for (int64_t r = 0; r < M; ++r)
        for (int g = 0; g < groups; ++g) {
            float t = 0.f;
            for (int k = g * group; k < (g + 1) * group; ++k) t += x[r * x_stride + k];
            sums[r * groups + g] = t;
        }
}

// Panels [panel0, panel1) of `w` as float32 panels ([K][16] each: float32_panels.h's) at `out`,
// each weight q d + z.
inline void widen_group_int8_f32(const GroupPanels& w, int64_t panel0, int64_t panel1, float* out) {
    const int group = w.group;
    for (int64_t p = panel0; p < panel1; ++p) {
        float* dst = out + (p - panel0) * static_cast<int64_t>(w.K) * 16;
        for (int g = 0; g < w.groups; ++g) {
            prefetch_next_group(w, p, g);
            alignas(32) float d[16], stored[16];
            group_values(w, p, g, 0, d);
            const float* z = nullptr;
            if (w.zeros) {
                group_values(w, p, g, 1, stored);
                z = stored;
            } else if (w.center != 0.f) {  // -center d: symmetric codes kept as stored
                for (int j = 0; j < 16; ++j) stored[j] = -w.center * d[j];
                z = stored;
            }
            alignas(64) int8_t unpacked[kMaxPackedGroup * 16];
            const int8_t* codes = group_codes(w, p, g, unpacked);
            float* group_out = dst + static_cast<int64_t>(g) * group * 16;
            // a pair of inputs of the panel's 16 outputs a step, their codes decoded as the panel
            // kernel's pair step decodes them (even_weights, odd_weights)
#if defined(__AVX512F__)  // one vector an input: half the 8-wide loop's instructions
            const __m512 dv = _mm512_loadu_ps(d), zv = z != nullptr ? _mm512_loadu_ps(z) : _mm512_setzero_ps();
            for (int k2 = 0; k2 < group / 2; ++k2) {
                const __m512 even = float32_panels::even_weights(codes, k2).v, odd = float32_panels::odd_weights(codes, k2).v;
                _mm512_storeu_ps(group_out + (2 * k2) * 16, _mm512_fmadd_ps(even, dv, zv));
                _mm512_storeu_ps(group_out + (2 * k2 + 1) * 16, _mm512_fmadd_ps(odd, dv, zv));
            }
#else
            for (int k2 = 0; k2 < group / 2; ++k2) {
                const float32_panels::Weights even = float32_panels::even_weights(codes, k2), odd = float32_panels::odd_weights(codes, k2);
                for (int h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
                    const __m256 dh = _mm256_loadu_ps(d + 8 * h);
                    const __m256 zh = z != nullptr ? _mm256_loadu_ps(z + 8 * h) : _mm256_setzero_ps();
                    _mm256_storeu_ps(group_out + (2 * k2) * 16 + 8 * h, _mm256_fmadd_ps(h ? even.hi : even.lo, dh, zh));
                    _mm256_storeu_ps(group_out + (2 * k2 + 1) * 16 + 8 * h, _mm256_fmadd_ps(h ? odd.hi : odd.lo, dh, zh));
                }
            }
#endif
        }
    }
}

}  // namespace modserve

#endif
