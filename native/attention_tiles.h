// The prefill tiles (query rows x heads in the vector lanes): their working memory, products by
// key (each K and V element broadcast once against 16 (8) row-heads) and online softmax, over
// TileVec, the vector of the build's width (AVX-512: 16 lanes, AVX2: 8). attend_tile is the
// float32 tile of either width; the bfloat16 model's tile (attention_avx512_tiles.h) shares
// the rest.
#pragma once

#include "attention_rows.h"

namespace modserve::paged_attention {

// A tile's working memory for L lanes (16: AVX-512, 8: AVX2), aligned to 64 bytes, with q
// scaled, accumulators zeroed, running maxima -inf and sums 0, and each row-head's position
// (-1 for the padding up to a whole number of L row-heads, which sees nothing).
template <int L>
struct TileWork {
    int R, R_pad;  // row-heads (row-major: rh = i * G + g), padded to a multiple of L
    float* qs;     // [R_pad][D], pre-scaled
    float* acc;    // [R_pad][D]
    float* sbuf;   // [R_pad][L] a chunk's scores
    float* ptile;  // [R_pad / L][L keys][L row-heads] a chunk's weights
    float* m;      // [R_pad] running max
    float* l;      // [R_pad] running sum of weights
    float* corrs;  // [R_pad] a chunk's rescale of each row-head's accumulator
    int32_t* rpos; // [R_pad] each row-head's position
    float* kt;     // [L][D] a chunk's K rows, widened (where the tile does not read them in place)
    float* vbuf;   // [L][D] a chunk's V rows, the same
    TileWork(const QIO& io, const int64_t* rows, int n_rows, int32_t first_pos, int G, int h, int D, float scale) {
        static thread_local std::vector<float> work;
        R = n_rows * G;
        R_pad = (R + L - 1) / L * L;
        work.resize(static_cast<size_t>(R_pad) * (2 * D + 2 * L + 4) + 2 * L * D + 16);
        qs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t{63});
        acc = qs + R_pad * D;
        sbuf = acc + R_pad * D;
        ptile = sbuf + R_pad * L;
        m = ptile + R_pad * L;
        l = m + R_pad;
        corrs = l + R_pad;
        rpos = reinterpret_cast<int32_t*>(corrs + R_pad);
        kt = corrs + 2 * R_pad;
        vbuf = kt + L * D;
        for (int rh = 0; rh < R_pad; ++rh) {
            const int64_t qi = static_cast<int64_t>(h * G + rh % G) * D;
#if defined(__AVX512F__)
            if (D % 16 == 0) {  // 16 lanes at a time: element by element, this was a tenth of a prefill tile's time
                for (int d = 0; d < D; d += 16) {
                    _mm512_storeu_ps(qs + rh * D + d, rh < R ? _mm512_mul_ps(io.q16(rows[rh / G], qi + d), _mm512_set1_ps(scale))
                                                           : _mm512_setzero_ps());
                    _mm512_storeu_ps(acc + rh * D + d, _mm512_setzero_ps());
                }
            } else
#elif defined(__AVX2__)
            if (D % 8 == 0) {
                for (int d = 0; d < D; d += 8) {
                    _mm256_storeu_ps(qs + rh * D + d, rh < R ? _mm256_mul_ps(io.q8(rows[rh / G], qi + d), _mm256_set1_ps(scale))
                                                           : _mm256_setzero_ps());
                    _mm256_storeu_ps(acc + rh * D + d, _mm256_setzero_ps());
                }
            } else
#endif
            {
                for (int d = 0; d < D; ++d) qs[rh * D + d] = rh < R ? io.q_at(rows[rh / G], qi + d) * scale : 0.f;
                for (int d = 0; d < D; ++d) acc[rh * D + d] = 0.f;
            }
            m[rh] = -INFINITY;
            l[rh] = 0.f;
            rpos[rh] = rh < R ? first_pos + rh / G : -1;
        }
    }
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The float32 tiles' vector (attend_tile_avx512, attend_tile_avx2): L lanes, a lane per
// row-head in the products by key below, which take KT keys (or dimensions) a pass, so that
// their 3 KT (AVX-512: 24 of 32 registers) or 2 KT (AVX2: 8 of 16) sums stay in registers.
// Elem: what q, K, V and the weights hold per lane (a float; TileVecBf16: a pair of bfloat16).
#if defined(__AVX512F__)
struct TileVec {
    using V = __m512;
    using Elem = float;
    static constexpr int L = 16, KT = 8, NG = 3;  // NG: groups of L row-heads a broadcast feeds at most
    static void transpose(V* r) { modserve::transpose16x16(r); }  // L x L
    template <typename T>
    static V widen(const T* p) { return modserve::load16(p); }  // L cache elements as float32
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_load_ps(p); }
    static void store(float* p, V v) { _mm512_store_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    // the online softmax's (tile_mask_and_max, attend_tile): lane masks and row positions
    using M = __mmask16;
    using I = __m512i;
    static I positions(const int32_t* p) { return _mm512_loadu_si512(p); }
    static M at_least(I a, int x) { return _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(x)); }
    static M below(I a, int x) { return _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(x)); }
    static M both(M a, M b) { return a & b; }
    static M none() { return 0; }
    static M is_neg_inf(V a) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ); }
    static V where(M m, V yes, V no) { return _mm512_mask_blend_ps(m, no, yes); }
    static V keep(M m, V a) { return _mm512_maskz_mov_ps(m, a); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V exp_nonpositive(V a) { return modserve::exp512_nonpositive(a); }
};
#if defined(__AVX512BF16__)
// The bfloat16 tile's vector (attend_tile_bf16dot): each element a 32-bit word of two
// bfloat16 (q's and K's dimension pairs, the weights' key pairs and V's values of one
// dimension at a key pair), each product a vdpbf16ps summing both halves into a float32 lane.
// The float32 vector's lanes, sums, loads and stores of float32 (the accumulators, scores and
// rescales), with its own elements' load, broadcast and product.
struct TileVecBf16 : TileVec {
    using Elem = uint32_t;
    using TileVec::load;
    static V load(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_load_si512(p)); }
    static V set1(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x))); }
    static V fma(V a, V b, V c) {
        return _mm512_dpbf16_ps(c, modserve::as_bh(_mm512_castps_si512(a)), modserve::as_bh(_mm512_castps_si512(b)));
    }
};
#endif
#else
struct TileVec {
    using V = __m256;
    using Elem = float;
    static constexpr int L = 8, KT = 4, NG = 2;
    static void transpose(V* r) { modserve::transpose8x8(r); }
    template <typename T>
    static V widen(const T* p) { return modserve::load8(p); }
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_load_ps(p); }
    static void store(float* p, V v) { _mm256_store_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    using M = __m256;  // all-ones lanes
    using I = __m256i;
    static I positions(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static M at_least(I a, int x) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(x - 1))); }
    static M below(I a, int x) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(x), a)); }
    static M both(M a, M b) { return _mm256_and_ps(a, b); }
    static M none() { return _mm256_setzero_ps(); }
    static M is_neg_inf(V a) { return _mm256_cmp_ps(a, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ); }
    static V where(M m, V yes, V no) { return _mm256_blendv_ps(no, yes, m); }
    static V keep(M m, V a) { return _mm256_and_ps(m, a); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V exp_nonpositive(V a) { return modserve::exp256_nonpositive(a); }
};
#endif

// A tile's scores by key for NG groups of L row-heads: out[g][t] (a vector, a lane per
// row-head) = q . k_t, from q transposed (qT: each group's [N][L], groups N * L apart, N the
// elements of a row) and a chunk's L K rows (kstride apart), KT keys a pass. Each K element is
// broadcast once for the NG groups and each q vector feeds KT keys: at NG 3 with AVX-512 a d
// step is 11 loads for 24 FMAs. By row-head (a K vector and a broadcast of q per FMA) the loads
// held it back, and the scores then needed a transpose per L row-heads, K one per L dimensions.
template <typename T, int NG, int N>
inline void key_scores(const typename T::Elem* qT, const typename T::Elem* k, int64_t kstride, float* out) {
    for (int k0 = 0; k0 < T::L; k0 += T::KT) {
        const typename T::Elem* kh = k + k0 * kstride;
        typename T::V s[NG][T::KT];
#pragma GCC unroll 3
        for (int g = 0; g < NG; ++g) {
#pragma GCC unroll 8
            for (int t = 0; t < T::KT; ++t) s[g][t] = T::zero();
        }
        for (int d = 0; d < N; ++d) {
            typename T::V q[NG];
#pragma GCC unroll 3
            for (int g = 0; g < NG; ++g) q[g] = T::load(qT + (g * N + d) * T::L);
#pragma GCC unroll 8
            for (int t = 0; t < T::KT; ++t) {
                const typename T::V kv = T::set1(kh[t * kstride + d]);
#pragma GCC unroll 3
                for (int g = 0; g < NG; ++g) s[g][t] = T::fma(q[g], kv, s[g][t]);
            }
        }
#pragma GCC unroll 3
        for (int g = 0; g < NG; ++g) {
#pragma GCC unroll 8
            for (int t = 0; t < T::KT; ++t) T::store(out + (g * T::L + k0 + t) * T::L, s[g][t]);
        }
    }
}

// P.V for NG groups of L row-heads, by key as the scores: accT (each group's [D][L], a lane
// per row-head) = accT * corr + sum over a chunk's K weight rows (keys, or key pairs) of p_t *
// v_t, with p by key (each group's [K][L]) and the V rows vstride apart, KT dimensions a pass,
// so each V element is broadcast once for the NG groups. By row-head (V vectors and a
// broadcast weight) it was load-bound and ran at a quarter of the FMA rate. Keys a row may not
// see have weight 0 (and finite V rows).
template <typename T, int NG, int D, int K>
inline void key_pv(float* accT, const typename T::Elem* p, const float* corr, const typename T::Elem* v, int64_t vstride) {
    for (int d0 = 0; d0 < D; d0 += T::KT) {
        typename T::V a[NG][T::KT];
#pragma GCC unroll 3
        for (int g = 0; g < NG; ++g) {
#pragma GCC unroll 8
            for (int i = 0; i < T::KT; ++i) a[g][i] = T::mul(T::load(accT + (g * D + d0 + i) * T::L), T::load(corr + T::L * g));
        }
        for (int t = 0; t < K; ++t) {
            typename T::V pv[NG];
#pragma GCC unroll 3
            for (int g = 0; g < NG; ++g) pv[g] = T::load(p + (g * K + t) * T::L);
#pragma GCC unroll 8
            for (int i = 0; i < T::KT; ++i) {
                const typename T::V vb = T::set1(v[t * vstride + d0 + i]);
#pragma GCC unroll 3
                for (int g = 0; g < NG; ++g) a[g][i] = T::fma(pv[g], vb, a[g][i]);
            }
        }
#pragma GCC unroll 3
        for (int g = 0; g < NG; ++g) {
#pragma GCC unroll 8
            for (int i = 0; i < T::KT; ++i) T::store(accT + (g * D + d0 + i) * T::L, a[g][i]);
        }
    }
}

// A tile's chunk through both, for all its `groups` groups of L row-heads, up to T::NG groups
// a call: the scores into `sbuf` ([group][key][L]) ...
template <typename T, int N>
inline void tile_scores(int groups, const typename T::Elem* qT, const typename T::Elem* k, int64_t kstride, float* sbuf) {
    for (int g = 0; g < groups; g += T::NG) {
        const int ng = groups - g < T::NG ? groups - g : T::NG;
        if (ng == 3)
            key_scores<T, 3, N>(qT + g * N * T::L, k, kstride, sbuf + g * T::L * T::L);
        else if (ng == 2)
            key_scores<T, 2, N>(qT + g * N * T::L, k, kstride, sbuf + g * T::L * T::L);
        else
            key_scores<T, 1, N>(qT + g * N * T::L, k, kstride, sbuf + g * T::L * T::L);
    }
}

// ... and, once the softmax has made the weights `ptile` ([group][K][L]) and rescales `corrs`,
// P.V into accT.
template <typename T, int D, int K>
inline void tile_pv(int groups, float* accT, const typename T::Elem* ptile, const float* corrs, const typename T::Elem* v,
                    int64_t vstride) {
    for (int g = 0; g < groups; g += T::NG) {
        const int ng = groups - g < T::NG ? groups - g : T::NG;
        if (ng == 3)
            key_pv<T, 3, D, K>(accT + g * D * T::L, ptile + g * K * T::L, corrs + g * T::L, v, vstride);
        else if (ng == 2)
            key_pv<T, 2, D, K>(accT + g * D * T::L, ptile + g * K * T::L, corrs + g * T::L, v, vstride);
        else
            key_pv<T, 1, D, K>(accT + g * D * T::L, ptile + g * K * T::L, corrs + g * T::L, v, vstride);
    }
}

// `groups` groups of L rows of D floats ([groups * L][D]) to lanes ([groups][D][L], a lane a
// row: q for the products by key), or back (lanes false: the accumulators to rows).
template <int D>
inline void tile_transpose(int groups, const float* from, float* to, bool lanes) {
    using T = TileVec;
    for (int g = 0; g < groups; ++g) {
        for (int j = 0; j < D / T::L; ++j) {
            typename T::V blk[T::L];
            const int64_t row0 = static_cast<int64_t>(g) * T::L * D + j * T::L, lane0 = (static_cast<int64_t>(g) * D + j * T::L) * T::L;
            for (int i = 0; i < T::L; ++i) blk[i] = T::load(from + (lanes ? row0 + i * D : lane0 + i * T::L));
            T::transpose(blk);
            for (int i = 0; i < T::L; ++i) T::store(to + (lanes ? lane0 + i * T::L : row0 + i * D), blk[i]);
        }
    }
}

// One chunk of a tile's keys for KV head h (n cache rows from row srow), as the products by key
// read it: the K and V rows as float32, `stride` apart (in place in a float32 cache when the
// chunk has all L rows, else widened into kbuf and vbuf, [L][D], zeros past n: their scores
// are masked, their weights 0), and an int8 cache's scales (1 without, and past n).
template <typename C, int D>
struct TileChunk {
    const float* k;
    const float* v;
    int64_t stride;
    alignas(64) float k_scale[TileVec::L], v_scale[TileVec::L];
    TileChunk(const C* kc, const C* vc, const float* ks, const float* vs, int64_t srow, int KVH, int h, int n, float* kbuf,
              float* vbuf) {
        using T = TileVec;
        const int64_t row_stride = static_cast<int64_t>(KVH) * D;
        const C* kb = kc + srow * row_stride + h * D;
        const C* vb = vc + srow * row_stride + h * D;
        for (int t = 0; t < T::L; ++t) k_scale[t] = v_scale[t] = 1.f;
        if (ks) {
            for (int t = 0; t < n; ++t) k_scale[t] = ks[(srow + t) * KVH + h], v_scale[t] = vs[(srow + t) * KVH + h];
        }
        if (std::is_same_v<C, float> && n == T::L) {  // in place: L rows exist in the block
            k = reinterpret_cast<const float*>(kb), v = reinterpret_cast<const float*>(vb), stride = row_stride;
            return;
        }
        for (int t = 0; t < T::L; ++t) {
            for (int j = 0; j < D / T::L; ++j) {
                T::store(kbuf + t * D + T::L * j, t < n ? T::widen(kb + t * row_stride + T::L * j) : T::zero());
                T::store(vbuf + t * D + T::L * j, t < n ? T::widen(vb + t * row_stride + T::L * j) : T::zero());
            }
        }
        k = kbuf, v = vbuf, stride = D;
    }
};

// The tiles' online softmax, first half, for L row-heads: `st` holds their scores by key (one
// vector per key of the chunk, a lane per row-head), masked here to the keys each row may see
// (key t exists, t < n, its position start + t is at most the row's, `rpos`, and within the
// window); `m_new` is the running max advanced over them (rows that see no key here keep
// theirs), `corr` the rescale of what was accumulated under the old max (~0 on the first
// chunk; 1 for a row that has seen no key yet, whose max is still -inf, not exp(NaN)).
template <typename TV>
inline void tile_mask_and_max(typename TV::V* st, const int32_t* rpos, const float* m, int start, int n,
                              typename TV::M* valid, typename TV::V& m_new, typename TV::V& corr, int window = 0) {
    using V = typename TV::V;
    const typename TV::I pos = TV::positions(rpos);
    const V neg_inf = TV::set1(-INFINITY);
    V rowmax = neg_inf;
    for (int t = 0; t < TV::L; ++t) {
        valid[t] = t < n ? TV::at_least(pos, start + t) : TV::none();
        if (window > 0) valid[t] = TV::both(valid[t], TV::below(pos, start + t + window));  // in the window
        st[t] = TV::where(valid[t], st[t], neg_inf);
        rowmax = TV::max(rowmax, st[t]);
    }
    const V m_old = TV::load(m);
    m_new = TV::max(m_old, rowmax);
    corr = TV::where(TV::is_neg_inf(m_new), TV::set1(1.f), TV::exp_nonpositive(TV::sub(m_old, m_new)));
}

// Causal attention for a tile: consecutive query rows of one sequence (about kTileRowHeads / G)
// (a prefill chunk, speculative verify rows) against KV head h, with AVX-512 (L = 16 lanes) or
// AVX2 and FMA (L = 8). q is transposed once per tile (L row-heads a vector); each L-key
// chunk's scores then come by key (key_scores), the layout the online softmax wants, from K
// rows read in place in a float32 cache (widened once into kt otherwise, or where the chunk is
// short). The online softmax runs on L row-heads at a time, each vector one key across the L
// (the causal mask is one compare of the row positions, the maxima, exps and sums are
// lane-wise: no scalar chains). P.V reads V rows in place too (widened once otherwise). Before
// the AVX2 width, chunks over 16 tokens went to SDPA's flash kernel on AVX2-only CPUs.
template <typename T, int D>
void attend_tile(const QIO& io, const int64_t* rows, int n_rows, int32_t first_pos, const T* kc, const T* vc, const float* ks,
                 const float* vs, const int32_t* table, int KVH, int G, int bs, float scale, int h, int window, float softcap) {
    using TV = TileVec;
    using V = TV::V;
    constexpr int L = TV::L;
    const TileWork<L> w(io, rows, n_rows, first_pos, G, h, D, scale);
    const int R = w.R, R_pad = w.R_pad, groups = R_pad / L;
    float *qs = w.qs, *acc = w.acc, *sbuf = w.sbuf, *ptile = w.ptile, *m = w.m, *l = w.l, *corrs = w.corrs, *kt = w.kt, *vbuf = w.vbuf;
    const int32_t* rpos = w.rpos;
    static thread_local std::vector<float> q_work;  // qT: [groups][D][L], each group of L row-heads' q transposed
    q_work.resize(static_cast<size_t>(R_pad) * D + 16);
    float* qT = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(q_work.data()) + 63) & ~uintptr_t{63});
    tile_transpose<D>(groups, qs, qT, true);
    const int n_keys = first_pos + n_rows;  // the last row sees keys 0 .. first_pos + n_rows - 1
    const int chunk = bs < L ? bs : L;
    for (int start = window_start(first_pos, window) / chunk * chunk; start < n_keys; start += chunk) {
        const int n = n_keys - start < chunk ? n_keys - start : chunk;
        const TileChunk<T, D> c(kc, vc, ks, vs, slot_of(table, start, bs), KVH, h, n, kt, vbuf);
        tile_scores<TV, D>(groups, qT, c.k, c.stride, sbuf);  // by key: up to NG groups of L row-heads share each K broadcast
        for (int g0 = 0; g0 < R_pad; g0 += L) {  // online softmax, L row-heads a vector
            V st[L], m_new, corr;
            typename TV::M valid[L];
            for (int t = 0; t < L; ++t) {
                st[t] = TV::load(sbuf + (g0 + t) * L);  // group g0 / L's key t
                st[t] = TV::mul(st[t], TV::set1(c.k_scale[t]));  // 1 without an int8 cache
                if (softcap > 0.f) st[t] = cap_lanes(st[t], softcap);
            }
            tile_mask_and_max<TV>(st, rpos + g0, m + g0, start, n, valid, m_new, corr, window);
            V sum = TV::zero();
            float* pt = ptile + g0 * L;
            for (int t = 0; t < L; ++t) {
                const V p = TV::keep(valid[t], TV::exp_nonpositive(TV::sub(st[t], m_new)));
                sum = TV::add(sum, p);
                TV::store(pt + t * L, TV::mul(p, TV::set1(c.v_scale[t])));  // int8: V's scales folded in
            }
            TV::store(m + g0, m_new);
            TV::store(l + g0, TV::fma(TV::load(l + g0), corr, sum));
            TV::store(corrs + g0, corr);
        }
        tile_pv<TV, D, L>(groups, acc, ptile, corrs, c.v, c.stride);  // by key, as the scores
    }
    float* out = qs;  // acc by row-head ([R_pad][D]), where q was
    tile_transpose<D>(groups, acc, out, false);
    for (int rh = 0; rh < R; ++rh) {
        put_head(io, rows[rh / G], static_cast<int64_t>(h * G + rh % G) * D, out + rh * D, D, l[rh]);
    }
}
#endif

}  // namespace modserve::paged_attention
