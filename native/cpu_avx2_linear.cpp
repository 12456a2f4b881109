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
#include <vector>

#include "packed_call.h"
#include "panel_threads.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "float32_panels.h"
#include "group_int8_panels.h"
#include "int4_panels.h"

using modserve::float32_panels::thread_part;

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

// The packed panels above widened back to a plain float32 [ceil(N/16) * 16][Kp] matrix (Kp the
// padded K, a multiple of 32; row n output n in the panels' order), for the library's float32
// product on many rows (Avx2Linear.forward). A tile [16 pairs][16 outputs] of 32-bit pairs is
// transposed in registers, so that each output's 16 pairs are one vector, its 32 inputs in order
// (widen_tile). Read column by column with scalar shifts and masks, the widening had taken 22 ms
// of SmolLM2's qkv, o and down layers (30 each), 8% of their product at 512 rows.
void modserve_avx2_widen(const uint16_t* w, int64_t N, int Kp, float* out, int threads) {
    const int64_t panels = (N + 15) / 16;
    const int tiles = Kp / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        for (int t = 0; t < tiles; ++t) {
            const uint32_t* tile = reinterpret_cast<const uint32_t*>(w) + (p * tiles + t) * 256;
            float* first = out + p * 16 * static_cast<int64_t>(Kp) + t * 32;  // output p * 16's inputs t * 32 ..
            modserve::float32_panels::widen_tile(tile, first, Kp);
        }
    }
}

// The same product over int8 codes (device.quantization int8) packed in the same order
// ([ceil(N/16)][ceil(K/32) * 16][16][2] int8), widened in registers: y = (x @ q.T) * scale + bias,
// scale [ceil(N/16) * 16] float32 channel scales in the panels' order (gated: the pairs' order).
void modserve_avx2_linear_int8(const float* x, int64_t x_stride, int64_t M, const int8_t* q, int64_t N, int K,
                            const float* bias, float* y, int64_t y_stride, int threads, int gated, const float* scale) {
    const int64_t panel = static_cast<int64_t>((K + 31) / 32) * 512;  // codes of one packed panel
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        thread_part(x, x_stride, M, q, panel, N, K, bias, y, y_stride, gated != 0, p0, p1, scale);
    });
}

int modserve_avx2_linear_int8_available() { return 1; }

// int4 weights as torch's CPU int4 kernel holds them, with a float32 model's scales (int4_panels.h's
// Int4Scales: `pairs` torch's scales_and_zeros for `kind` 0, float16 (s, m) for 1, int8 (sc, mn)
// times `outer`'s float32 (d, -dmin) per `super_groups` groups for 2; N a multiple of 64, K and the
// group multiples of 32), bias float32 or null (torch's int4 kernel takes a slow path in float32):
// up to kInt4F32DirectRows rows each thread takes whole 64-output blocks and multiplies their
// nibbles directly (int4_f32_block); with more it widens its panels four at a time to float32 in
// a scratch of its own and runs the FMA blocks above on them.
void modserve_avx2_linear_int4(const float* x, int64_t x_stride, int64_t M, const uint8_t* q4, const void* pairs, int64_t N, int K,
                               int group, const float* bias, float* y, int64_t y_stride, int threads, int kind, const float* outer,
                               int super_groups) {
    const modserve::Int4Scales sc(pairs, N, K / group, kind, outer, super_groups);
    if (M <= modserve::kInt4F32DirectRows) {
        const int groups = K / group;
        std::vector<float> xsum(M * groups);  // [row][group]: each group's inputs summed
        modserve::group_input_sums(x, x_stride, M, K, group, xsum.data());
        const int64_t blocks = N / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; ++b)
            modserve::int4_f32_block(x, x_stride, M, xsum.data(), groups, q4 + b * 32 * static_cast<int64_t>(K), sc, b * 64, group,
                                     bias != nullptr ? bias + b * 64 : nullptr, y + b * 64, y_stride);
        return;
    }
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        const auto widen = [&](int64_t p, int np, float* out) { modserve::widen_int4_f32(q4, sc, K, group, p, p + np, out); };
        modserve::float32_panels::widened_part(x, x_stride, M, widen, K, bias, N, y, y_stride, p0, p1);
    });
}

int modserve_avx2_linear_int4_available() { return 1; }

// The same int4 weights widened to a plain float32 [N][K] matrix (row n output n, each weight
// q s + m as the panels hold it), for the library's float32 product on many rows
// (Int4WeightOnlyLinear, cpu_avx2_linear.int4_product): each thread widens a panel at a time
// into a [K][16] scratch of its own (in L2) and writes its 16 rows out of it, 16 x 16 blocks
// transposed in registers (rows_from_panel; element by element, the copy had taken longer than
// the widening).
void modserve_avx2_int4_widen_plain(const uint8_t* q4, const void* pairs, int64_t N, int K, int group, int kind,
                                    const float* outer, int super_groups, float* out, int threads) {
    const modserve::Int4Scales sc(pairs, N, K / group, kind, outer, super_groups);
    const int64_t panels = N / 16;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> panel(static_cast<size_t>(K) * 16);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            modserve::widen_int4_f32(q4, sc, K, group, p, p + 1, panel.data());
            modserve::float32_panels::rows_from_panel(panel.data(), K, out + p * 16 * static_cast<int64_t>(K), K);
        }
    }
}

// int8 codes with a scale, and a zero where `zeros` (else for symmetric codes the center), per group
// of inputs, held as group panels (group_int8_panels.h's GroupPanels, `packed`: the codes in 6 bits
// each; `scale_bytes` 4, 2 or 1: float32, float16 or int8 scales and zeros, the int8 ones
// multiples of float32 ones heading each super block of `super_groups` groups; GGUF Q8_0, Q6_K,
// Q5_x and mixed K-quant layers, GPTQ 8-bit; N a multiple of 16, K a multiple of 32, the group
// of 16), bias
// float32 or null: up to kGroupF32DirectRows rows each thread multiplies its panels' codes
// directly, group by group (group_f32_direct); with more it widens its panels four at a time into
// a float32 scratch of its own and runs the blocks above on them.
constexpr int64_t kGroupF32DirectRows = 4;

void modserve_avx2_linear_group_int8(const float* x, int64_t x_stride, int64_t M, const int8_t* panels, int64_t N, int K, int group,
                                     const float* bias, float* y, int64_t y_stride, int threads, int zeros, float center, int packed,
                                     int scale_bytes, int super_groups) {
    const modserve::GroupPanels w{panels, K, group, zeros != 0, center, packed != 0, scale_bytes, super_groups};
    const bool direct = M <= kGroupF32DirectRows;
    std::vector<float> xsum(w.any_zero() && direct ? M * w.groups : 0);  // what the zeros multiply
    if (!xsum.empty()) modserve::group_input_sums(x, x_stride, M, K, group, xsum.data());
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        if (direct) {
            modserve::group_f32_direct(x, x_stride, M, w, w.any_zero() ? xsum.data() : nullptr, N, bias, y, y_stride, p0, p1);
            return;
        }
        const auto widen = [&](int64_t p, int np, float* out) { modserve::widen_group_int8_f32(w, p, p + np, out); };
        modserve::float32_panels::widened_part(x, x_stride, M, widen, K, bias, N, y, y_stride, p0, p1);
    });
}

int modserve_avx2_linear_group_int8_available() { return 1; }

}  // extern "C"

MODSERVE_PACKED(modserve_avx2_linear) {
    using modserve::packed::ptr;
    modserve_avx2_linear(ptr<const float*>(a[0]), a[1], a[2], ptr<const uint16_t*>(a[3]), a[4], a[5],
                         ptr<const float*>(a[6]), ptr<float*>(a[7]), a[8], a[9], a[10]);
    return 0;
}

MODSERVE_PACKED(modserve_avx2_linear_int8) {
    using modserve::packed::ptr;
    modserve_avx2_linear_int8(ptr<const float*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), a[4], a[5], ptr<const float*>(a[6]),
                ptr<float*>(a[7]), a[8], a[9], a[10], ptr<const float*>(a[11]));
    return 0;
}

MODSERVE_PACKED(modserve_avx2_linear_int4) {
    using modserve::packed::ptr;
    modserve_avx2_linear_int4(ptr<const float*>(a[0]), a[1], a[2], ptr<const uint8_t*>(a[3]), ptr<const void*>(a[4]), a[5], a[6],
                              a[7], ptr<const float*>(a[8]), ptr<float*>(a[9]), a[10], a[11], a[12], ptr<const float*>(a[13]), a[14]);
    return 0;
}

MODSERVE_PACKED(modserve_avx2_linear_group_int8) {
    using modserve::packed::ptr;
    modserve_avx2_linear_group_int8(ptr<const float*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), a[4], a[5], a[6], ptr<const float*>(a[7]),
                     ptr<float*>(a[8]), a[9], a[10], a[11], modserve::packed::f32(a[12]), a[13], a[14], a[15]);
    return 0;
}

#else  // no AVX2 or FMA: the loader refuses the kernel

extern "C" int modserve_avx2_linear_available() { return 0; }
extern "C" int modserve_avx2_linear_int8_available() { return 0; }
extern "C" int modserve_avx2_linear_int4_available() { return 0; }
extern "C" int modserve_avx2_linear_group_int8_available() { return 0; }

#endif
