// The tile loop both AMX linear kernels run: bfloat16 (cpu_amx_linear.cpp, TDPBF16PS) and int8
// (cpu_amx_int8_linear.cpp, TDPBSSD). Both see the same bytes: a tile row of A is 64 bytes of
// one row's inputs (32 bfloat16 or 64 int8), B is packed as 1 KB tiles per 16 outputs, a panel
// of kb tiles per 16 outputs, and the sums are 16 x 16 four-byte tiles (float32 or int32).
// Included only where the compiler targets AMX-TILE and AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx.h"
#include "avx512.h"

namespace modserve {

constexpr int kRowChunk = 256;  // rows of A per sweep over the weights (kept in L2)

// Tiles 0-3: C for A0 x B0, A0 x B1, A1 x B0, A1 x B1; 4-5: A; 6-7: B. A0 and its C tiles have
// rows0 rows, A1 and its C tiles rows1.
inline void configure_block(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    configure_tiles(rows);
}

// C += A . B on tiles: int8 (TDPBSSD) or bfloat16 (TDPBF16PS). GCC's intrinsics are asm
// statements that spell the tile numbers out, so they take literals, not template arguments.
#if defined(__AMX_INT8__)
#define MODSERVE_TILE_DOT(C, A, B)         \
    do {                                   \
        if constexpr (Int8) {              \
            _tile_dpbssd(C, A, B);         \
        } else {                           \
            _tile_dpbf16ps(C, A, B);       \
        }                                  \
    } while (0)
#else
#define MODSERVE_TILE_DOT(C, A, B) _tile_dpbf16ps(C, A, B)
#endif

// Sums for up to 32 rows (a0 with rows0 rows, a0 + 16 rows with rows1) x 32 outputs (panels b0,
// b1) over kb tiles of inputs, stored as four 16 x 16 tiles in c. `between` runs after the
// products are issued and before the stores wait for them: the previous block's epilogue then
// overlaps this block's tile work.
template <bool Int8, bool TwoM, bool TwoN, typename Between>
inline void tile_block(const char* a0, int64_t a_stride, const char* b0, const char* b1, int kb, void* c, const Between& between) {
    const char* a1 = a0 + 16 * a_stride;
    _tile_zero(0);
    if (TwoN) _tile_zero(1);
    if (TwoM) _tile_zero(2);
    if (TwoM && TwoN) _tile_zero(3);
    for (int k = 0; k < kb; ++k) {
        _tile_loadd(4, a0 + k * 64, a_stride);
        _tile_loadd(6, b0 + k * 1024, 64);
        MODSERVE_TILE_DOT(0, 4, 6);
        if (TwoN) {
            _tile_loadd(7, b1 + k * 1024, 64);
            MODSERVE_TILE_DOT(1, 4, 7);
        }
        if (TwoM) {
            _tile_loadd(5, a1 + k * 64, a_stride);
            MODSERVE_TILE_DOT(2, 5, 6);
            if (TwoN) MODSERVE_TILE_DOT(3, 5, 7);
        }
    }
    between();
    char* cc = static_cast<char*>(c);
    _tile_stored(0, cc, 64);
    if (TwoN) _tile_stored(1, cc + 1024, 64);
    if (TwoM) _tile_stored(2, cc + 2048, 64);
    if (TwoM && TwoN) _tile_stored(3, cc + 3072, 64);
}

// One thread's products: pairs of 16-output panels [p0, p1) (pair_weights(p): the pair's first
// panel, the second follows it) for every row of A, kRowChunk rows at a time, so the thread
// streams its weights in memory order once per chunk. put(c, rows0, rows1, two_n, m, n0) takes
// a stored block (sums for rows m.. and outputs n0..: c for A0 x B0, c + 256 elements A0 x B1,
// c + 512 A1 x B0, c + 768 A1 x B1); each block's put runs while the next block's products do.
template <bool Int8, typename PairWeights, typename Put>
void sweep(const char* a, int64_t a_stride, int64_t M, const PairWeights& pair_weights, int64_t N, int kb, int64_t p0,
           int64_t p1, const Put& put) {
    const int64_t panel = static_cast<int64_t>(kb) * 1024;  // bytes of one 16-output panel
    alignas(64) int32_t c[2][4 * 256];
    int cur = 0, cfg0 = -1, cfg1 = -1;
    struct {
        const int32_t* c = nullptr;
        int rows0 = 0, rows1 = 0;
        bool two_n = false;
        int64_t m = 0, n0 = 0;
    } pending;
    const auto flush = [&] {
        if (pending.c != nullptr) put(pending.c, pending.rows0, pending.rows1, pending.two_n, pending.m, pending.n0);
    };
    for (int64_t m0 = 0; m0 < M && p0 < p1; m0 += kRowChunk) {
        const int64_t m1 = m0 + kRowChunk < M ? m0 + kRowChunk : M;
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t n0 = p * 32;
            const bool two_n = n0 + 16 < N;
            const char* b0 = pair_weights(p);
            for (int64_t mb = m0; mb < m1; mb += 32) {
                const int rows0 = m1 - mb >= 16 ? 16 : static_cast<int>(m1 - mb);
                const int rows1 = m1 - mb >= 32 ? 16 : m1 - mb > 16 ? static_cast<int>(m1 - mb - 16) : 0;
                if (rows0 != cfg0 || rows1 != cfg1) {  // clears the tiles: the previous block is stored
                    configure_block(rows0, rows1);
                    cfg0 = rows0;
                    cfg1 = rows1;
                }
                const char* ab = a + mb * a_stride;
                int32_t* cb = c[cur];
                if (rows1 > 0) {
                    two_n ? tile_block<Int8, true, true>(ab, a_stride, b0, b0 + panel, kb, cb, flush)
                          : tile_block<Int8, true, false>(ab, a_stride, b0, b0, kb, cb, flush);
                } else {
                    two_n ? tile_block<Int8, false, true>(ab, a_stride, b0, b0 + panel, kb, cb, flush)
                          : tile_block<Int8, false, false>(ab, a_stride, b0, b0, kb, cb, flush);
                }
                pending = {cb, rows0, rows1, two_n, mb, n0};
                cur ^= 1;
            }
        }
    }
    flush();
    if (p0 < p1) _tile_release();
}

}  // namespace modserve
