// A bfloat16 model's prefill chunks and verify rows with AVX512_BF16: tiles of consecutive rows
// of one sequence by VDPBF16PS (attend_tile_bf16dot); float32 products take attend_tile
// (attention_tiles.h).
#pragma once

#include "attention_avx512_decode.h"
#include "attention_tiles.h"

namespace modserve::paged_attention {

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
// attend_tile for a bfloat16 model (q, out and cache in bfloat16), with vdpbf16ps and
// both products by key, as the float32 tile's (key_scores, key_pv over TileVecBf16): q.k over
// pairs of dimensions, q transposed once per tile (16 row-heads' pairs a vector) against each
// K pair broadcast from the cache row (exact for such q; the scale goes on the scores); P.V over
// pairs of keys, each row-head's weights rounded to bfloat16 pairs (as torch's flash SDPA feeds
// its second GEMM; l sums the rounded ones) against each dimension's pair of V values broadcast
// from the chunk's V rows interleaved pairwise (as in attend_bf16dot, whose accumulator order
// the tile keeps). Half the FMA work of the float32 tile. By row-head (a K vector and a
// broadcast of q, a weight broadcast and V vectors) each vdpbf16ps waited on a load of its own:
// 171-186 GFLOP/s on a Zen 4, 38-41 % of its bfloat16 peak.
template <int D>
void attend_tile_bf16dot(const QIO& io, const int64_t* rows, int n_rows, int32_t first_pos, const uint16_t* kc,
                         const uint16_t* vc, const int32_t* table, int KVH, int G, int bs, float scale, int h) {
    using modserve::exp512_nonpositive;
    using T = TileVecBf16;
    constexpr int NB = D / 32;  // 32-element bfloat16 vectors per row
    constexpr int NP = D / 2;  // dimension pairs (32-bit words) per row
    const int R = n_rows * G;  // row-heads, row-major: rh = i * G + g
    const int R_pad = (R + 15) / 16 * 16, groups = R_pad / 16;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    static thread_local std::vector<float> work;
    work.resize(static_cast<size_t>(R_pad) * (2 * D + NP + 16 + 8 + 4) + 16 * NP + 8 * D + 16);
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t{63});  // accT: [groups][D][16]
    float* qrows = acc + R_pad * D;  // [R_pad][NP] q as bf16 pairs, then the accumulators by row-head ([R_pad][D])
    uint32_t* qT = reinterpret_cast<uint32_t*>(qrows + R_pad * D);  // [groups][NP][16] q transposed
    float* sbuf = reinterpret_cast<float*>(qT + R_pad * NP);  // [groups][16 keys][16] this chunk's scores
    uint32_t* pp = reinterpret_cast<uint32_t*>(sbuf + R_pad * 16);  // [groups][8 key pairs][16] weights as bf16 pairs
    float* m = reinterpret_cast<float*>(pp + R_pad * 8);  // [R_pad] running max
    float* l = m + R_pad;  // [R_pad] running sum of the (rounded) weights
    float* corrs = l + R_pad;  // [R_pad] this chunk's rescale
    int32_t* rpos = reinterpret_cast<int32_t*>(corrs + R_pad);  // [R_pad] each row-head's position
    uint16_t* kbuf = reinterpret_cast<uint16_t*>(rpos + R_pad);  // [16][D] a short chunk's K rows, zeros past n
    uint32_t* vi = reinterpret_cast<uint32_t*>(kbuf + 16 * D);  // [8 key pairs][NB][lo 16 | hi 16 words]: V interleaved pairwise
    const uint16_t* qbase = static_cast<const uint16_t*>(io.q);
    for (int rh = 0; rh < R_pad; ++rh) {
        if (rh < R) {
            const uint16_t* qr = qbase + rows[rh / G] * io.q_stride + static_cast<int64_t>(h * G + rh % G) * D;
            std::memcpy(qrows + rh * NP, qr, D * sizeof(uint16_t));
        } else {
            std::memset(qrows + rh * NP, 0, D * sizeof(uint16_t));
        }
        m[rh] = -INFINITY;
        l[rh] = 0.f;
        rpos[rh] = rh < R ? first_pos + rh / G : -1;  // padding rows see nothing
    }
    tile_transpose<NP>(groups, qrows, reinterpret_cast<float*>(qT), true);  // the words' bits, moved as floats
    for (int i = 0; i < R_pad * D; ++i) acc[i] = 0.f;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int n_keys = first_pos + n_rows;
    const int chunk = bs < 16 ? bs : 16;
    for (int start = 0; start < n_keys; start += chunk) {
        const int n = n_keys - start < chunk ? n_keys - start : chunk;
        const int64_t offset = slot_of(table, start, bs) * row_stride + h * D;
        const uint16_t* kb = kc + offset;
        const uint16_t* vb = vc + offset;
        int64_t kstride = row_stride;
        if (n < 16) {  // the products read 16 K rows: a short chunk's, then zeros (their scores are masked)
            for (int t = 0; t < 16; ++t) {
                for (int j = 0; j < NB; ++j) {
                    _mm512_storeu_si512(kbuf + t * D + 32 * j, t < n ? _mm512_loadu_si512(kb + t * row_stride + 32 * j) : _mm512_setzero_si512());
                }
            }
            kb = kbuf, kstride = D;
        }
        interleave_pairs<D>(vb, row_stride, n, 8, reinterpret_cast<uint16_t*>(vi));  // all 8 key pairs (zeros past n)
        tile_scores<T, NP>(groups, qT, reinterpret_cast<const uint32_t*>(kb), kstride / 2, sbuf);
        for (int g0 = 0; g0 < R_pad; g0 += 16) {  // online softmax, 16 row-heads a vector
            __m512 st[16], m_new, corr;
            TileVec::M valid[16];
            for (int t = 0; t < 16; ++t) st[t] = _mm512_mul_ps(_mm512_load_ps(sbuf + (g0 + t) * 16), vscale);  // key t's scores
            tile_mask_and_max<TileVec>(st, rpos + g0, m + g0, start, n, valid, m_new, corr);
            __m512 sum = _mm512_setzero_ps();
            __m512i half[16];  // each key's weights for the 16 row-heads as bf16, widened to 32 bits
            for (int t = 0; t < 16; ++t) {
                const __m512 p = _mm512_maskz_mov_ps(valid[t], exp512_nonpositive(_mm512_sub_ps(st[t], m_new)));
                half[t] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(half[t], 16)));  // l sums the weights P.V uses
            }
            for (int u = 0; u < 8; ++u) {
                _mm512_store_si512(pp + (g0 / 16 * 8 + u) * 16, _mm512_or_si512(half[2 * u], _mm512_slli_epi32(half[2 * u + 1], 16)));
            }
            _mm512_store_ps(m + g0, m_new);
            _mm512_store_ps(l + g0, _mm512_fmadd_ps(_mm512_load_ps(l + g0), corr, sum));
            _mm512_store_ps(corrs + g0, corr);
        }
        tile_pv<T, D, 8>(groups, acc, pp, corrs, vi, D);  // by key pair: D words a pair (vi's order)
    }
    float* out = qrows;  // the accumulators by row-head, in vi's (put_interleaved's) order
    tile_transpose<D>(groups, acc, out, false);
    for (int rh = 0; rh < R; ++rh) {
        put_interleaved(io, rows[rh / G], static_cast<int64_t>(h * G + rh % G) * D, out + rh * D, D, l[rh]);
    }
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

}  // namespace modserve::paged_attention
