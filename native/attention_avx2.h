// Decode rows on a CPU with AVX2 and FMA but no AVX-512 (8 lanes); its tiles take attend_tile
// (attention_tiles.h) at that width.
#pragma once

#include "attention_tiles.h"

namespace modserve::paged_attention {

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// attend() for head_dim D (a multiple of 8) on a CPU with AVX2 and FMA but no AVX-512: the
// structure of attend_avx512 with 8 lanes, 8 cache rows (a chunk) at a time. A chunk's rows
// for the item's KV heads are widened to float32 once (read in place when the cache is
// float32); each query head takes its 8 scores as 8 partial vectors folded pairwise as they
// come (4 live), a vector exp, and P.V with 8 accumulator vectors (64 elements of the head) in
// registers at a time. q is read from L1 rather than held: 16 ymm registers do not hold a
// 128-wide q beside the sums.
template <typename T, int D>
void attend_avx2(const QIO& io, int64_t token, const T* kc, const T* vc, const float* ks, const float* vs,
                 const int32_t* table, int32_t pos, int KVH, int G, int bs, float scale, int h0, int h1, int window,
                 float softcap, int from = 0, int to = -1, const Partial* part = nullptr) {
    constexpr int NV = D / 8;             // vectors per row
    constexpr int W = NV < 8 ? NV : 8;    // accumulator vectors in registers at a time
    const int heads = h1 - h0;
    const int nh = heads * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    const RowWork<8> w(io, token, h0, heads, G, D, scale);
    float *qs = w.qs, *acc = w.acc, *m = w.m, *l = w.l;
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 8 ? bs : 8;  // block sizes are powers of two: a chunk never crosses a block
    constexpr bool kThenIntoL2 = kZen && std::is_same_v<T, float>;
    const int lo = window_start(pos, window);
    const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int start = std::max(lo / chunk * chunk, from); start < n_tokens; start += chunk) {
        const int n = n_tokens - start < chunk ? n_tokens - start : chunk;
        const ChunkRows<T> c = chunk_rows(kc, vc, ks, vs, table, start, bs, KVH, row_stride);
        ChunkAhead<> next(kc, vc, table, start + chunk, n_tokens, chunk, bs, row_stride, h0, heads, D, nh);
        // On Zen cores a float32 cache's chunk after next too, into L2 (kZen, SegmentAhead's two asks)
        ChunkAhead<true> then(kc, vc, table, kThenIntoL2 ? start + 2 * chunk : n_tokens, n_tokens, chunk, bs, row_stride, h0,
                              heads, D, nh);
        const float* ksb = c.k_scale;
        const float* vsb = c.v_scale;
        // keys that exist (t < n) and are in the window (start + t >= lo), as all-ones lanes
        const int first = lo > start ? lo - start : 0;
        const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane_ids),
                                                                   _mm256_cmpgt_epi32(lane_ids, _mm256_set1_epi32(first - 1))));
        w.widen(c, n, h0, heads, D, row_stride);
        for (int h = h0; h < h1; ++h) {
            const float* kr;
            const float* vr;
            const int64_t stride = head_rows(c, w.kbuf, w.vbuf, h, h0, heads, D, row_stride, kr, vr);
            __m256 kscale = _mm256_set1_ps(1.f), vscale = _mm256_set1_ps(1.f);
            if (ksb) {
                alignas(32) float k8[8] = {}, v8[8] = {};
                for (int t = 0; t < n; ++t) k8[t] = ksb[t * KVH + h], v8[t] = vsb[t * KVH + h];
                kscale = _mm256_load_ps(k8), vscale = _mm256_load_ps(v8);
            }
            for (int g = 0; g < G; ++g) {
                const int i = (h - h0) * G + g;
                next.step();
                if constexpr (kThenIntoL2) then.step();
                const float* qi = qs + i * D;
                constexpr int QR = NV <= 8 ? NV : 1;  // q vectors held in registers (head_dim 64: all)
                __m256 qv[QR];
                for (int j = 0; j < QR; ++j) qv[j] = _mm256_loadu_ps(qi + 8 * j);
                const auto qvec = [&](int j) { return NV <= 8 ? qv[j < QR ? j : 0] : _mm256_loadu_ps(qi + 8 * j); };
                const auto dot = [&](int t) {  // key t's products as 8 partial sums (0 past the chunk)
                    if (t >= n) return _mm256_setzero_ps();
                    __m256 s = _mm256_mul_ps(qvec(0), _mm256_loadu_ps(kr + t * stride));
                    for (int j = 1; j < NV; ++j) s = _mm256_fmadd_ps(qvec(j), _mm256_loadu_ps(kr + t * stride + 8 * j), s);
                    return s;
                };
                __m256 pairs[4];
                for (int u = 0; u < 4; ++u) pairs[u] = _mm256_hadd_ps(dot(2 * u), dot(2 * u + 1));
                __m256 scores = _mm256_mul_ps(modserve::transpose_sum8_from_pairs(pairs), kscale);
                if (softcap > 0.f) scores = cap_lanes(scores, softcap);
                scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid);
                const float bmax = std::fmax(m[i], modserve::hmax8(scores));
                const float correction = exp_nonpositive(m[i] - bmax);  // ~0 on the first chunk (m = -inf)
                const __m256 p = _mm256_and_ps(modserve::exp256_nonpositive(_mm256_sub_ps(scores, _mm256_set1_ps(bmax))), valid);
                l[i] = std::fma(l[i], correction, modserve::hsum8(p));  // fused, as GCC had contracted it
                m[i] = bmax;
                const __m256 pv = _mm256_mul_ps(p, vscale);  // int8: the V rows' scales folded in
                const __m256 corr = _mm256_set1_ps(correction);
                for (int j0 = 0; j0 < NV; j0 += W) {
                    __m256 a[W];
                    for (int j = 0; j < W; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + 8 * (j0 + j)), corr);
                    for (int t = 0; t < n; ++t) {
                        const __m256 pt = _mm256_permutevar8x32_ps(pv, _mm256_set1_epi32(t));  // lane t, in registers
                        for (int j = 0; j < W; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + t * stride + 8 * (j0 + j)), a[j]);
                    }
                    for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + i * D + 8 * (j0 + j), a[j]);
                }
            }
        }
    }
    if (!keep_part(part, nh, D, acc, m, l)) finish_heads(io, token, h0 * G, nh, D, acc, l);
}

#endif  // AVX2 without AVX-512

}  // namespace modserve::paged_attention
