// Prefill chunks and verify rows with AVX-512: tiles of consecutive rows of one sequence,
// float32 (attend_tile_avx512) or a bfloat16 model's by VDPBF16PS (attend_tile_bf16dot).
#pragma once

#include "attention_avx512_decode.h"
#include "attention_tiles.h"

namespace modserve::paged_attention {

#if defined(__AVX512F__)
// The tiles' online softmax, first half, for 16 row-heads: `st` holds their scores by key (one
// vector per key of the chunk, a lane per row-head), masked here to the keys each row may see
// (key t exists, t < n, and its position start + t is at most the row's, `rpos`); `m_new` is
// the running max advanced over them (rows that see no key here keep theirs), `corr` the
// rescale of what was accumulated under the old max (~0 on the first chunk).
inline void tile_mask_and_max(__m512* st, const int32_t* rpos, const float* m, int start, int n, __mmask16* valid,
                              __m512& m_new, __m512& corr, int window = 0) {
    const __m512i pos = _mm512_loadu_si512(rpos);
    __m512 rowmax = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < 16; ++t) {
        valid[t] = t < n ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(start + t)) : 0;
        if (window > 0) valid[t] &= _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(start + t + window));  // in the window
        st[t] = _mm512_mask_blend_ps(valid[t], _mm512_set1_ps(-INFINITY), st[t]);
        rowmax = _mm512_max_ps(rowmax, st[t]);
    }
    const __m512 m_old = _mm512_load_ps(m);
    m_new = _mm512_max_ps(m_old, rowmax);
    corr = modserve::exp512_nonpositive(_mm512_sub_ps(m_old, m_new));
    if (window > 0) {  // a row that has seen no key yet (its window starts later): nothing to rescale, not NaN
        corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), corr, _mm512_set1_ps(1.f));
    }
}

// Causal attention for a tile: consecutive query rows of one sequence (about kTileRowHeads / G)
// (a prefill chunk, speculative verify rows) against KV head h. q is transposed once per tile
// (16 row-heads a vector); each 16-key chunk's scores then come by key (key_scores), the
// layout the online softmax wants, from K rows read in place in a float32 cache (widened
// once into kt otherwise, or where the chunk is short). The online softmax runs on 16
// row-heads at a time, each vector one key across the 16 (the causal mask is one compare of
// the row positions, the maxima, exps and sums are lane-wise: no scalar chains). P.V reads
// V rows in place too (widened once otherwise).
template <typename T, int D>
void attend_tile_avx512(const QIO& io, const int64_t* rows, int n_rows, int32_t first_pos, const T* kc, const T* vc, const float* ks, const float* vs,
                        const int32_t* table, int KVH, int G, int bs, float scale, int h, int window, float softcap) {
    using modserve::exp512_nonpositive;
    const TileWork<16> w(io, rows, n_rows, first_pos, G, h, D, scale);
    const int R = w.R, R_pad = w.R_pad, groups = R_pad / 16;
    float *qs = w.qs, *acc = w.acc, *sbuf = w.sbuf, *ptile = w.ptile, *m = w.m, *l = w.l, *corrs = w.corrs, *kt = w.kt, *vbuf = w.vbuf;
    const int32_t* rpos = w.rpos;
    static thread_local std::vector<float> q_work;  // qT: [groups][D][16], each group of 16 row-heads' q transposed
    q_work.resize(static_cast<size_t>(R_pad) * D + 16);
    float* qT = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(q_work.data()) + 63) & ~uintptr_t{63});
    tile_transpose<D>(groups, qs, qT, true);
    const int n_keys = first_pos + n_rows;  // the last row sees keys 0 .. first_pos + n_rows - 1
    const int chunk = bs < 16 ? bs : 16;
    for (int start = window_start(first_pos, window) / chunk * chunk; start < n_keys; start += chunk) {
        const int n = n_keys - start < chunk ? n_keys - start : chunk;
        const TileChunk<T, D> c(kc, vc, ks, vs, slot_of(table, start, bs), KVH, h, n, kt, vbuf);
        tile_scores<TileVec, D>(groups, qT, c.k, c.stride, sbuf);  // by key: up to 3 groups of 16 row-heads share each K broadcast
        for (int g0 = 0; g0 < R_pad; g0 += 16) {  // online softmax, 16 row-heads a vector
            __m512 st[16], m_new, corr;
            __mmask16 valid[16];
            for (int t = 0; t < 16; ++t) {
                st[t] = _mm512_load_ps(sbuf + (g0 + t) * 16);  // group g0 / 16's key t
                if (ks) st[t] = _mm512_mul_ps(st[t], _mm512_set1_ps(c.k_scale[t]));
                if (softcap > 0.f) st[t] = cap_scores16(st[t], softcap);
            }
            tile_mask_and_max(st, rpos + g0, m + g0, start, n, valid, m_new, corr, window);
            __m512 sum = _mm512_setzero_ps();
            float* pt = ptile + g0 * 16;
            for (int t = 0; t < 16; ++t) {
                const __m512 p = _mm512_maskz_mov_ps(valid[t], exp512_nonpositive(_mm512_sub_ps(st[t], m_new)));
                sum = _mm512_add_ps(sum, p);
                _mm512_store_ps(pt + t * 16, _mm512_mul_ps(p, _mm512_set1_ps(c.v_scale[t])));  // int8: V's scales folded in
            }
            _mm512_store_ps(m + g0, m_new);
            _mm512_store_ps(l + g0, _mm512_fmadd_ps(_mm512_load_ps(l + g0), corr, sum));
            _mm512_store_ps(corrs + g0, corr);
        }
        tile_pv<TileVec, D, TileVec::L>(groups, acc, ptile, corrs, c.v, c.stride);  // by key, as the scores
    }
    float* out = qs;  // acc by row-head ([R_pad][D]), where q was
    tile_transpose<D>(groups, acc, out, false);
    for (int rh = 0; rh < R; ++rh) {
        put_head(io, rows[rh / G], static_cast<int64_t>(h * G + rh % G) * D, out + rh * D, D, l[rh]);
    }
}

#if defined(__AVX512BF16__)
// attend_tile_avx512 for a bfloat16 model (q, out and cache in bfloat16), with vdpbf16ps and
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
            __mmask16 valid[16];
            for (int t = 0; t < 16; ++t) st[t] = _mm512_mul_ps(_mm512_load_ps(sbuf + (g0 + t) * 16), vscale);  // key t's scores
            tile_mask_and_max(st, rpos + g0, m + g0, start, n, valid, m_new, corr);
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
