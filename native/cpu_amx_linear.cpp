// y = x @ W.T (+ b) in bfloat16 on AMX tiles, with W packed once into the tiles' own layout.
//
// Why not oneDNN's packed product (cpu_linear.py), which runs the same AMX instructions: a
// call costs ~20 us before its first product (primitive lookup, descriptors), ~30 us with
// the padding copy the fixed shapes need. A decode step makes 121 such calls for SmolLM2,
// so at one client that fixed cost was a sixth of the step. And oneDNN keeps a primitive per
// row count, so the platform pads rows to one of 39 sizes (up to 63 padded rows a prefill
// chunk, 10-25% of its products). Here a call is a ctypes call and one OpenMP region; the
// rows need no padding (a tile takes 1-16 rows); nothing is cached per shape.
//
// Layout: W [N, K] is packed as [N/16][K/32][16][16][2]: for each 16 outputs and 32 inputs
// one 1 KB B tile, row r holding inputs 2r and 2r+1 of each of the 16 outputs (the pairs
// TDPBF16PS multiplies). N and K are padded with zeros to 16 and 32. A thread takes a
// contiguous range of output panels, so it streams its tiles in memory order; the rows of x
// (at most 256 at a time, so they stay in L2) go through two A tiles, two B tiles of
// weights, four C tiles of float32 sums. Each block of C tiles is stored, and while the next
// block's products run, the bias is added, the sums rounded to bfloat16 to nearest even (as
// torch narrows a float32 product) and each row's 32 outputs written to y in one store. At
// prefill sizes the epilogue costs about a third of the tile work when run after each block's
// products; overlapped, gate_up at 1,024 rows went from 2,282 to 2,545 GFLOP/s.
//
// x's K must be a multiple of 32 (the caller pads it: a tile row reads 32 inputs).
#include <cstdint>
#include <cstring>

#include "packed_call.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_gemm.h"
#include "avx512.h"
#include "int4_panels.h"

namespace {

using modserve::cols_mask;
using modserve::kRowChunk;

// A stored block's rows of y: outputs [n0, n0 + 16) from c, and [n0 + 16, n0 + 32) from c + 256
// when two_n, times the column scales (int8 weights' per-channel scales) and plus the bias;
// each row's 32 outputs narrowed to bfloat16 to nearest even by one VCVTNE2PS2BF16 (the same
// rounding as float_to_bf16 in bf16.h for all but denormal sums, which it flushes) and written
// in one store.
template <bool HasBias, bool HasScale>
inline void put_rows(const float* c, int rows, bool two_n, const float* bias, const float* scale, int64_t n0, int64_t N,
                     uint16_t* y, int64_t y_stride) {
    const __mmask16 m0 = cols_mask(N - n0), m1 = two_n ? cols_mask(N - n0 - 16) : 0;
    const __m512 b0 = HasBias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = HasBias && m1 ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();
    const __m512 s0 = HasScale ? _mm512_maskz_loadu_ps(m0, scale + n0) : _mm512_setzero_ps();
    const __m512 s1 = HasScale && m1 ? _mm512_maskz_loadu_ps(m1, scale + n0 + 16) : _mm512_setzero_ps();
    const __mmask32 mask = static_cast<__mmask32>(m0) | (static_cast<__mmask32>(m1) << 16);
    for (int r = 0; r < rows; ++r) {
        __m512 lo = _mm512_loadu_ps(c + r * 16), hi = _mm512_loadu_ps(c + 256 + r * 16);  // hi: unused lanes when !two_n
        if (HasScale) {
            lo = _mm512_mul_ps(lo, s0);
            hi = _mm512_mul_ps(hi, s1);
        }
        if (HasBias) {
            lo = _mm512_add_ps(lo, b0);
            hi = _mm512_add_ps(hi, b1);
        }
        _mm512_mask_storeu_epi16(y + r * y_stride + n0, mask, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}

// A gated block's rows: gate sums in c, up sums in c + 256 (the same 16 intermediate columns,
// from [col0, col0 + 16) of y), as modserve::silu_mul_bf16 rounds them.
inline void put_gated_rows(const float* c, int rows, int64_t col0, uint16_t* y, int64_t y_stride) {
    for (int r = 0; r < rows; ++r)
        modserve::store16(y + r * y_stride + col0, modserve::silu_mul_bf16(_mm512_loadu_ps(c + r * 16), _mm512_loadu_ps(c + 256 + r * 16)));
}

// A block's sums in c and where its rows of y go: the epilogue.
struct Stored {
    const float* c;
    int rows0, rows1;
    bool two_n;
    int64_t n0;
    uint16_t* y;  // row 0 of the block
    bool gated;   // a (gate, up) panel pair: 16 outputs at column n0 / 2

    void put(const float* bias, const float* scale, int64_t N, int64_t y_stride) const {
        if (gated) {
            put_gated_rows(c, rows0, n0 / 2, y, y_stride);
            if (rows1 > 0) put_gated_rows(c + 512, rows1, n0 / 2, y + 16 * y_stride, y_stride);
            return;
        }
        const auto put = scale != nullptr ? (bias != nullptr ? put_rows<true, true> : put_rows<false, true>)
                                          : (bias != nullptr ? put_rows<true, false> : put_rows<false, false>);
        put(c, rows0, two_n, bias, scale, n0, N, y, y_stride);
        if (rows1 > 0) put(c + 512, rows1, two_n, bias, scale, n0, N, y + 16 * y_stride, y_stride);
    }
};

// One thread's share of y: output panel pairs [p0, p1) for every row (modserve::sweep), each
// block's sums finished by Stored::put. `pair_weights(p)` gives pair p's two packed panels.
template <typename PairWeights>
void thread_part(const uint16_t* x, int64_t x_stride, int64_t M, const PairWeights& pair_weights, int64_t N, int K,
                 const float* bias, const float* scale, uint16_t* y, int64_t y_stride, bool gated, int64_t p0, int64_t p1) {
    const auto weights = [&](int64_t p) { return reinterpret_cast<const char*>(pair_weights(p)); };
    const auto put = [&](const int32_t* c, int rows0, int rows1, bool two_n, int64_t m, int64_t n0) {
        Stored{reinterpret_cast<const float*>(c), rows0, rows1, two_n, n0, y + m * y_stride, gated}.put(bias, scale, N, y_stride);
    };
    modserve::sweep<false>(reinterpret_cast<const char*>(x), x_stride * 2, M, weights, N, K / 32, p0, p1, put);
}

void amx_linear(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N, int K, const float* bias,
                uint16_t* y, int64_t y_stride, int threads, bool gated) {
    const int64_t pairs = (N + 31) / 32;  // threads take whole pairs of 16-output panels
    const int64_t pair = static_cast<int64_t>(K / 32) * 1024;  // elements of two packed panels
    const auto pair_weights = [w, pair](int64_t p) { return w + p * pair; };
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        thread_part(x, x_stride, M, pair_weights, N, K, bias, nullptr, y, y_stride, gated, pairs * t / nt, pairs * (t + 1) / nt);
    }
}

// int8 weights packed in the bfloat16 tiles' own order ([N/16][K/32][16][16][2] int8, see
// pack_tiles in cpu_amx_linear.py) widened to those tiles, exactly (every int8 is a bfloat16),
// for 16-output panels [panel0, panel1), panel0 written at `out`.
void widen_int8_panels(const int8_t* q8, int K, int64_t panel0, int64_t panel1, uint16_t* out) {
    const int64_t panel = static_cast<int64_t>(K / 32) * 512;  // elements (bytes of q8) of one panel
    const int8_t* src = q8 + panel0 * panel;
    for (int64_t i = 0; i < (panel1 - panel0) * panel; i += 32) {
        const __m512 lo = modserve::load16(src + i);
        const __m512 hi = modserve::load16(src + i + 16);
        _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}

// Widen each pair of panels (pair by pair into this thread's part of scratch when the rows fit
// one chunk, else all first) and run the tile products on them: the int4 and int8 entries.
template <typename Widen>
void widened_product(const uint16_t* x, int64_t x_stride, int64_t M, int64_t N, int K, const Widen& widen,
                     const float* bias, const float* scale, uint16_t* scratch, uint16_t* y, int64_t y_stride, int threads) {
    const int64_t pairs = (N + 31) / 32;
    const int64_t pair = static_cast<int64_t>(K / 32) * 1024;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
        uint16_t* mine = scratch + p0 * pair;
        if (M <= kRowChunk) {  // one pair at a time, at the start of this thread's part: read at once from L1/L2
            const auto widened = [&](int64_t p) {
                widen(2 * p, 2 * p + 2, mine);
                return static_cast<const uint16_t*>(mine);
            };
            thread_part(x, x_stride, M, widened, N, K, bias, scale, y, y_stride, false, p0, p1);
        } else {  // every chunk of rows reuses them
            widen(2 * p0, 2 * p1, mine);
            const auto widened = [scratch, pair](int64_t p) { return static_cast<const uint16_t*>(scratch + p * pair); };
            thread_part(x, x_stride, M, widened, N, K, bias, scale, y, y_stride, false, p0, p1);
        }
    }
}

// One row (a decode step of one request) times int8 codes in the tiles' order, without tiles:
// each tile row (16 outputs x inputs 2r, 2r + 1) widened to float32 in registers and
// multiplied into float32 sums per (output, input parity) by FMA (four chains) against the row's inputs 2r,
// 2r + 1 (xf: the row in float32, broadcast a pair at a time); the two parities are added at
// the end. The codes are read once and nothing is written but y. Outputs [16 * panel0,
// 16 * panel1). From two rows on the tiles win.
void int8_row(const float* xf, const int8_t* q8, const float* scale, const float* bias, int64_t N, int K, int64_t panel0,
              int64_t panel1, uint16_t* y) {
    const int kb = K / 32;
    // lanes 2i and 2i + 1 of a sum hold output i's even and odd inputs: add them, keep even lanes
    const __m512i even_lanes = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd_lanes = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t p = panel0; p < panel1; ++p) {
        __m512 lo_acc[4], hi_acc[4];
        for (int c = 0; c < 4; ++c) lo_acc[c] = hi_acc[c] = _mm512_setzero_ps();
        const int8_t* src = q8 + p * kb * 512;
        for (int k = 0; k < kb * 32; k += 2, src += 32) {  // one tile row: inputs k, k + 1 of 16 outputs
            const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(xf + k)));
            const __m512 lo = modserve::load16(src);
            const __m512 hi = modserve::load16(src + 16);
            const int c = (k >> 1) & 3;  // four chains each
            lo_acc[c] = _mm512_fmadd_ps(lo, xp, lo_acc[c]);
            hi_acc[c] = _mm512_fmadd_ps(hi, xp, hi_acc[c]);
        }
        const __m512 lo = _mm512_add_ps(_mm512_add_ps(lo_acc[0], lo_acc[1]), _mm512_add_ps(lo_acc[2], lo_acc[3]));
        const __m512 hi = _mm512_add_ps(_mm512_add_ps(hi_acc[0], hi_acc[1]), _mm512_add_ps(hi_acc[2], hi_acc[3]));
        const __m512 sums = _mm512_add_ps(_mm512_permutex2var_ps(lo, even_lanes, hi), _mm512_permutex2var_ps(lo, odd_lanes, hi));
        const int64_t n0 = p * 16;
        const __mmask16 mask = cols_mask(N - n0);
        const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        _mm256_mask_storeu_epi16(y + n0, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_fmadd_ps(sums, s, b))));
    }
}

}  // namespace

extern "C" {

// 0 when this process may use AMX tiles (Linux grants the XTILEDATA state on request), -1
// when refused, -2 in a build without AMX-BF16; call once before modserve_amx_linear.
int modserve_amx_init() { return modserve::request_amx(); }

// y[m, n] = bf16(sum_k x[m, k] * W[n, k] + bias[n]) for m < M, n < N, W packed as described
// above ([ceil(N/16)][K/32][16][16][2]); K a multiple of 32; bias float32 or null. gated: W's
// panels alternate gate and up columns (N / 32 pairs, no bias) and y[m, j] for j < N / 2 is
// bf16(bf16(silu(gate_j)) * up_j), the fused SiLU-mul of the rounded outputs.
void modserve_amx_linear(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N, int K,
                         const float* bias, uint16_t* y, int64_t y_stride, int threads, int gated) {
    amx_linear(x, x_stride, M, w, N, K, gated ? nullptr : bias, y, y_stride, threads, gated != 0);
}

// y = x @ W.T for int4 W in torch's CPU packing and scales_and_zeros (see widen_int4_panels;
// N a multiple of 64, K of 32, group of 32), widened to bfloat16 tiles by each thread for its
// own panels (widened_product). `scratch` holds N * K elements. No bias (the caller adds it).
void modserve_amx_linear_int4(const uint16_t* x, int64_t x_stride, int64_t M, const uint8_t* q4, const uint16_t* sz,
                              int64_t N, int K, int group, uint16_t* scratch, uint16_t* y, int64_t y_stride, int threads) {
    const auto widen = [=](int64_t panel0, int64_t panel1, uint16_t* out) { modserve::widen_int4_panels(q4, sz, N, K, group, panel0, panel1, out); };
    widened_product(x, x_stride, M, N, K, widen, nullptr, nullptr, scratch, y, y_stride, threads);
}

// y[m, n] = bf16(s[n] * sum_k x[m, k] q[n, k] + bias[n]) for int8 q packed in the tiles' order
// ([ceil(N/16)][K/32][16][16][2], K a multiple of 32), s and bias float32 (bias may be null):
// the int8 values widened exactly to bfloat16 tiles, the channel scales applied to the sums;
// one row by int8_row instead. `scratch` holds ceil(N/32) * 32 * K elements.
void modserve_amx_linear_int8(const uint16_t* x, int64_t x_stride, int64_t M, const int8_t* q8, const float* scale,
                              int64_t N, int K, const float* bias, uint16_t* scratch, uint16_t* y, int64_t y_stride,
                              int threads) {
    const int64_t panels = (N + 15) / 16;
    if (M == 1) {  // one row: widening into tiles would cost more than it saves
        float* xf = reinterpret_cast<float*>(scratch);  // the row in float32
        for (int k = 0; k < K; k += 16) _mm512_storeu_ps(xf + k, modserve::load16(x + k));
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int8_row(xf, q8, scale, bias, N, K, panels * t / nt, panels * (t + 1) / nt, y);
        }
        return;
    }
    const auto widen = [=](int64_t panel0, int64_t panel1, uint16_t* out) {
        widen_int8_panels(q8, K, panel0, panel1 < panels ? panel1 : panels, out);
    };
    widened_product(x, x_stride, M, N, K, widen, bias, scale, scratch, y, y_stride, threads);
}
}

#else  // no AMX-BF16 in this build: the platform keeps oneDNN's product

extern "C" {
int modserve_amx_init() { return -2; }
void modserve_amx_linear(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int, const float*, uint16_t*,
                         int64_t, int, int) {}
void modserve_amx_linear_int4(const uint16_t*, int64_t, int64_t, const uint8_t*, const uint16_t*, int64_t, int, int,
                              uint16_t*, uint16_t*, int64_t, int) {}
void modserve_amx_linear_int8(const uint16_t*, int64_t, int64_t, const int8_t*, const float*, int64_t, int, const float*,
                              uint16_t*, uint16_t*, int64_t, int) {}
}

#endif

// Call-list entry points (packed_call.h), for the real kernels and the stubs alike.
using modserve::packed::ptr;

MODSERVE_PACKED(modserve_amx_linear) {
    modserve_amx_linear(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const uint16_t*>(a[3]), a[4], a[5],
                        ptr<const float*>(a[6]), ptr<uint16_t*>(a[7]), a[8], a[9], a[10]);
    return 0;
}

MODSERVE_PACKED(modserve_amx_linear_int4) {
    modserve_amx_linear_int4(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const uint8_t*>(a[3]), ptr<const uint16_t*>(a[4]),
                             a[5], a[6], a[7], ptr<uint16_t*>(a[8]), ptr<uint16_t*>(a[9]), a[10], a[11]);
    return 0;
}

MODSERVE_PACKED(modserve_amx_linear_int8) {
    modserve_amx_linear_int8(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), ptr<const float*>(a[4]),
                             a[5], a[6], ptr<const float*>(a[7]), ptr<uint16_t*>(a[8]), ptr<uint16_t*>(a[9]), a[10], a[11]);
    return 0;
}
