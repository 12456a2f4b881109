// y = x @ W.T (+ b) in bfloat16 with AVX512_BF16's VDPBF16PS, for CPUs that have it but no AMX
// (AMD Zen 4/5, Intel Cooper Lake), with W packed once as the AMX kernel packs it.
//
// Why not oneDNN's packed product (cpu_linear.py): on a Zen 5 (2 cores) it ran SmolLM2's 30
// layers at 8.7 ms for one row where the weights take 6.0 ms to read, and at 43-64 rows (a
// decode step at 64 clients) at 460-560 GFLOP/s where 256 rows and more reach 870-900: each
// call costs ~20 us before its first product, rows are padded to one of 39 shapes, and its
// small-row kernels leave the FMA units idle. Here a call is a ctypes call and one OpenMP
// region; any row count runs without padding.
//
// Layout: the AMX kernel's (cpu_amx_linear.py's pack): a 16-output panel is [K/2][16][2]
// bfloat16, so one 64-byte load holds inputs 2k and 2k + 1 of 16 outputs, the pairs VDPBF16PS
// multiplies against one broadcast pair of x's inputs. N and K are zero-padded to 16 and 32 in
// the packed copy; x is read only up to its K (an odd K's last input paired with a zero).
//
// Loop: a thread takes a contiguous range of panel pairs (so a gated layer's (gate, up) pair
// stays on one thread) and walks it four panels at a time, for 240 rows at a time (so those
// rows stay in L2); for each group of four panels (4 x K x 64 bytes, in L2 after the first
// rows) every block of up to six rows keeps its 6 x 4 sums in registers over the whole of K.
// With more than one row, each block asks for its share of the next group's weights while
// it computes: the first block reads a group from memory and the others from L2, and without
// that the memory idled while they ran (43 rows of SmolLM2's layers: 15.6 -> 11.4 ms; 2-4
// rows, a single block: 0.86-0.88x the time; one row streams as fast without it). Below
// 240 rows the weights are read from memory once per call; more rows read them once per 240
// (at 2,048 rows, 1.00x -> 1.05x oneDNN's time against one pass).
#include <cstdint>

#include "packed_call.h"
#include "panel_threads.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <vector>

#include "avx512_bf16_panels.h"
#include "group_int8_panels.h"
#include "int4_panels.h"

using modserve::bf16_panels::thread_part;

extern "C" {

// x [M, K] bfloat16 (rows x_stride elements apart), w packed [ceil(N/16)][ceil(K/32) * 16][16][2]
// bfloat16, bias [N] float32 or null, y [M, y_stride] bfloat16. Gated (a [gate; up] layer whose
// panels alternate gate, up; N / 2 a multiple of 16, no bias): y [M, N / 2] = silu(gate) * up.
void modserve_avx512_linear(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N, int K,
                            const float* bias, uint16_t* y, int64_t y_stride, int threads, int gated) {
    const int64_t panel = static_cast<int64_t>((K + 31) / 32) * 512;  // elements of one packed panel
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        thread_part(x, x_stride, M, w, panel, N, K, bias, y, y_stride, gated != 0, p0, p1);
    });
}

int modserve_avx512_linear_available() { return 1; }

// The same product over int8 codes (device.quantization int8) packed in the same order
// ([ceil(N/16)][ceil(K/32) * 16][16][2] int8), widened in registers: y = (x @ q.T) * scale + bias,
// scale [ceil(N/16) * 16] float32 channel scales in the panels' order (gated: the pairs' order).
void modserve_avx512_linear_int8(const uint16_t* x, int64_t x_stride, int64_t M, const int8_t* q, int64_t N, int K,
                            const float* bias, uint16_t* y, int64_t y_stride, int threads, int gated, const float* scale) {
    const int64_t panel = static_cast<int64_t>((K + 31) / 32) * 512;  // codes of one packed panel
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        thread_part(x, x_stride, M, q, panel, N, K, bias, y, y_stride, gated != 0, p0, p1, scale);
    });
}

int modserve_avx512_linear_int8_available() { return 1; }

// int4 weights as torch's CPU int4 kernel holds them (int4_panels.h; N a multiple of 64, K and the
// group multiples of 32), with torch's bfloat16 scales_and_zeros (`kind` 0, at `pairs`) or a GGUF
// layer's own scales (int4_scales.h's Int4Scales: `kind` 1 or 2, `outer`, `super_groups`), bias
// float32 or null. Below kInt4WidenFrom rows each thread takes whole 64-output blocks and
// multiplies their nibbles directly (int4_block_direct, up to four rows at a time); from there on
// it widens its panels four at a time into a bfloat16 scratch of its own and multiplies them as
// above, the widening paid once for all the rows.
constexpr int64_t kInt4WidenFrom = 8;

void modserve_avx512_linear_int4(const uint16_t* x, int64_t x_stride, int64_t M, const uint8_t* q4, const void* pairs,
                                 int64_t N, int K, int group, const float* bias, uint16_t* y, int64_t y_stride, int threads, int kind,
                                 const float* outer, int super_groups) {
    const uint16_t* sz = static_cast<const uint16_t*>(pairs);
    const modserve::Int4Scales file(pairs, N, K / group, kind, outer, super_groups);
    const modserve::Int4Scales* own = kind != 0 ? &file : nullptr;
    if (M < kInt4WidenFrom) {
        const int groups = K / group;
        const int64_t blocks = N / 64;
        std::vector<float> xsum(M * groups);  // [row][group]: each group's inputs summed, once for every thread
        modserve::group_input_sums(x, x_stride, M, K, group, xsum.data());
        const float* sums = xsum.data();
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t b = blocks * t / nt; b < blocks * (t + 1) / nt; ++b) {
                const uint8_t* block = q4 + b * 32 * static_cast<int64_t>(K);
                const uint16_t* s = sz + b * 64 * 2;
                const float* bb = bias != nullptr ? bias + b * 64 : nullptr;
                for (int64_t r = 0; r < M; r += 4) {
                    const auto run = M - r >= 4 ? modserve::int4_block_direct<4> : M - r == 3 ? modserve::int4_block_direct<3>
                                     : M - r == 2 ? modserve::int4_block_direct<2> : modserve::int4_block_direct<1>;
                    run(x + r * x_stride, x_stride, sums + r * groups, groups, block, s, N, K, group, bb, y + r * y_stride + b * 64,
                        y_stride, own, b * 64);
                }
            }
        }
        return;
    }
    const int64_t panel = static_cast<int64_t>(K / 32) * 512;  // elements of one widened panel
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        const auto widen = [&](int64_t p, int np, uint16_t* out) {
            if (own != nullptr)
                modserve::widen_int4_panels(q4, file, K, group, p, p + np, out);
            else
                modserve::widen_int4_panels(q4, sz, N, K, group, p, p + np, out);
        };
        modserve::bf16_panels::widened_part(x, x_stride, M, widen, panel, N, K, bias, y, y_stride, p0, p1);
    });
}

int modserve_avx512_linear_int4_available() { return 1; }

// int8 codes with a scale, and a zero where `zeros` (else for symmetric codes the center), per group
// of inputs, held as group panels (group_int8_panels.h's GroupPanels, `packed`: the codes in 6 bits
// each; `scale_bytes` 4, 2 or 1: float32, float16 or int8 scales and zeros, the int8 ones
// multiples of float32 ones heading each super block of `super_groups` groups; GGUF Q8_0, Q6_K,
// Q5_x and mixed K-quant layers, GPTQ 8-bit; N a multiple of 16, K a multiple of 32, the group
// of 16), bias
// float32 or null: up to kGroupDirectRows rows each thread multiplies its panels' codes directly,
// group by group; with more it widens its panels four at a time into a scratch of its own and
// runs the blocks above on them.
constexpr int64_t kGroupDirectRows = 8;

}  // extern "C"

// Both group entries: the codes multiplied directly, read as `few` up to kGroupDirectRows rows and
// as `many` up to `direct_rows`; beyond, widened to bfloat16 q d + z in a scratch, a thread's four
// panels at a time, and multiplied by the panel blocks above.
template <modserve::Codes few, modserve::Codes many>
void group_product(const uint16_t* x, int64_t x_stride, int64_t M, const modserve::GroupPanels& w, int64_t N, const float* bias,
                   uint16_t* y, int64_t y_stride, int threads, int64_t direct_rows) {
    const int64_t panel = static_cast<int64_t>(w.K / 32) * 512;  // elements of one widened panel
    const bool sums = (w.any_zero() || many == modserve::Codes::kMagic || w.packed) && M <= direct_rows;
    std::vector<float> xsum(sums ? M * w.groups : 0);  // what the zeros multiply
    if (!xsum.empty()) modserve::group_input_sums(x, x_stride, M, w.K, w.group, xsum.data());
    modserve::for_panel_ranges(N, threads, [&](int64_t p0, int64_t p1) {
        if (M <= direct_rows) {
            const auto direct = M <= kGroupDirectRows ? modserve::group_int8_direct<few> : modserve::group_int8_direct<many>;
            direct(x, x_stride, M, w, sums ? xsum.data() : nullptr, N, bias, y, y_stride, p0, p1);
            return;
        }
        const auto widen = [&](int64_t p, int np, uint16_t* out) { modserve::widen_group_int8_bf16(w, p, p + np, out); };
        modserve::bf16_panels::widened_part(x, x_stride, M, widen, panel, N, w.K, bias, y, y_stride, p0, p1);
    });
}

extern "C" {

void modserve_avx512_linear_group_int8(const uint16_t* x, int64_t x_stride, int64_t M, const int8_t* panels, int64_t N, int K, int group,
                                       const float* bias, uint16_t* y, int64_t y_stride, int threads, int zeros, float center, int packed,
                                       int scale_bytes, int super_groups) {
    using modserve::Codes;
    const modserve::GroupPanels w{panels, K, group, zeros != 0, center, packed != 0, scale_bytes, super_groups};
    group_product<Codes::kInt8, Codes::kInt8>(x, x_stride, M, w, N, bias, y, y_stride, threads, kGroupDirectRows);
}

// Unsigned codes below 128 (GGUF's 4- to 6-bit formats) with a scale and a minimum per group
// (or, symmetric formats, a center: w = d (q - center)):
// multiplied directly up to kMagicDirectRows rows, from 9 rows widened in registers to bfloat16
// 128 + q by an OR (one to eight: through float32 as int8, measured faster there: 1.19x
// bfloat16's speed at one row against 1.12-1.17x); beyond, widened to bfloat16 q d + m in a
// scratch as above. Measured on a Zen 5 (SmolLM2's layers, groups of 32 with minima): 0.77-0.89x
// bfloat16's speed at 16 rows directly against 0.65x widened; at 64, even.
constexpr int64_t kMagicDirectRows = 32;

void modserve_avx512_linear_group_u7(const uint16_t* x, int64_t x_stride, int64_t M, const int8_t* panels, int64_t N, int K, int group,
                                     const float* bias, uint16_t* y, int64_t y_stride, int threads, int minima, float center, int packed,
                                     int scale_bytes, int super_groups) {
    using modserve::Codes;
    const modserve::GroupPanels w{panels, K, group, minima != 0, center, packed != 0, scale_bytes, super_groups};
    group_product<Codes::kInt8, Codes::kMagic>(x, x_stride, M, w, N, bias, y, y_stride, threads, kMagicDirectRows);
}

int modserve_avx512_linear_group_u7_available() { return 1; }

int modserve_avx512_linear_group_int8_available() { return 1; }

}  // extern "C"

MODSERVE_PACKED(modserve_avx512_linear) {
    using modserve::packed::ptr;
    modserve_avx512_linear(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const uint16_t*>(a[3]), a[4], a[5],
                           ptr<const float*>(a[6]), ptr<uint16_t*>(a[7]), a[8], a[9], a[10]);
    return 0;
}

MODSERVE_PACKED(modserve_avx512_linear_int8) {
    using modserve::packed::ptr;
    modserve_avx512_linear_int8(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), a[4], a[5], ptr<const float*>(a[6]),
                ptr<uint16_t*>(a[7]), a[8], a[9], a[10], ptr<const float*>(a[11]));
    return 0;
}

MODSERVE_PACKED(modserve_avx512_linear_int4) {
    using modserve::packed::ptr;
    modserve_avx512_linear_int4(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const uint8_t*>(a[3]), ptr<const void*>(a[4]), a[5],
                                a[6], a[7], ptr<const float*>(a[8]), ptr<uint16_t*>(a[9]), a[10], a[11], a[12], ptr<const float*>(a[13]), a[14]);
    return 0;
}

MODSERVE_PACKED(modserve_avx512_linear_group_int8) {
    using modserve::packed::ptr;
    modserve_avx512_linear_group_int8(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), a[4], a[5], a[6], ptr<const float*>(a[7]),
                     ptr<uint16_t*>(a[8]), a[9], a[10], a[11], modserve::packed::f32(a[12]), a[13], a[14], a[15]);
    return 0;
}

MODSERVE_PACKED(modserve_avx512_linear_group_u7) {
    using modserve::packed::ptr;
    modserve_avx512_linear_group_u7(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const int8_t*>(a[3]), a[4], a[5], a[6], ptr<const float*>(a[7]),
                     ptr<uint16_t*>(a[8]), a[9], a[10], a[11], modserve::packed::f32(a[12]), a[13], a[14], a[15]);
    return 0;
}

#else  // no AVX512_BF16: the loader refuses the kernel

extern "C" int modserve_avx512_linear_available() { return 0; }
extern "C" int modserve_avx512_linear_int8_available() { return 0; }
extern "C" int modserve_avx512_linear_int4_available() { return 0; }
extern "C" int modserve_avx512_linear_group_int8_available() { return 0; }
extern "C" int modserve_avx512_linear_group_u7_available() { return 0; }

#endif
