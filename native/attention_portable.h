// The CPU paged-attention kernel's portable loops (any CPU, any head size): one query token's
// KV heads, one cache block at a time, softmax online. The vector paths' reference.
#pragma once

#include "attention_rows.h"

namespace modserve::paged_attention {

// acc += sum over t < n of p[t] * v[t]: with D known the accumulator lives in registers
// for the whole block (not loaded and stored for every row), and the V rows of one head,
// read again for each query head of its group, come from L1.
template <typename T, int FixedD>
inline void accumulate_rows(float* acc, const float* p, const T* v, int64_t row_stride, int n, int D_) {
    if constexpr (FixedD > 0) {
        float a[FixedD];
        for (int d = 0; d < FixedD; ++d) a[d] = acc[d];
        for (int t = 0; t < n; ++t) {
            const T* vr = v + t * row_stride;
            const float pt = p[t];
#pragma omp simd
            for (int d = 0; d < FixedD; ++d) a[d] += pt * load(vr, d);
        }
        for (int d = 0; d < FixedD; ++d) acc[d] = a[d];
    } else {
        for (int t = 0; t < n; ++t) {
            const T* vr = v + t * row_stride;
            const float pt = p[t];
            for (int d = 0; d < D_; ++d) acc[d] += pt * load(vr, d);
        }
    }
}

// FixedD > 0: head_dim known at compile time (fully unrolled, vectorized inner loops).
// Serves KV heads [h0, h1) of one query token; each block's rows for those heads are read
// once, while they are in cache, for all of their query heads.
// Positions [from, to) only (default: all), from a multiple of bs; with `part`, the state goes there.
template <typename T, int FixedD>
void attend(const QIO& io, int64_t token, const T* kc, const T* vc, const float* ks, const float* vs,
            const int32_t* table, int32_t pos, int KVH, int G, int D_, int bs, float scale, int h0, int h1,
            int window, float softcap, int from = 0, int to = -1, const Partial* part = nullptr) {
    const int D = FixedD > 0 ? FixedD : D_;
    const int nh = (h1 - h0) * G;  // query heads served: h0 * G ..
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;  // one token's K (or V) in a block
    const int64_t block_stride = static_cast<int64_t>(bs) * row_stride;
    static thread_local std::vector<float> work;
    work.resize(static_cast<size_t>(nh) * (2 * D + bs + 2));
    float* qs = work.data();  // [nh][D], pre-scaled
    float* acc = qs + nh * D;  // [nh][D]
    float* s = acc + nh * D;  // [nh][bs] this block's scores, then weights
    float* m = s + nh * bs;  // [nh] running max
    float* l = m + nh;  // [nh] running sum of weights
    start_heads(io, token, h0 * G, nh, D, scale, qs, acc, m, l);
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int lo = window_start(pos, window);
    for (int start = std::max(lo / bs * bs, from); start < n_tokens; start += bs) {
        const int n = n_tokens - start < bs ? n_tokens - start : bs;
        const int t0 = lo > start ? lo - start : 0;  // keys before the window in this block
        const int64_t block = table[start / bs];
        const T* kb = kc + block * block_stride;
        const T* vb = vc + block * block_stride;
        const float* ksb = ks ? ks + block * bs * KVH : nullptr;
        const float* vsb = vs ? vs + block * bs * KVH : nullptr;
        for (int h = h0; h < h1; ++h) {
            for (int g = 0; g < G; ++g) {
                const float* qg = qs + ((h - h0) * G + g) * D;
                float* sg = s + ((h - h0) * G + g) * bs;
                for (int t = 0; t < n; ++t) {
                    const T* kr = kb + t * row_stride + h * D;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; ++d) dot += qg[d] * load(kr, d);
                    sg[t] = dot;
                }
                if (ksb) {
                    for (int u = 0; u < n; ++u) sg[u] *= ksb[u * KVH + h];
                }
                if (softcap > 0.f) {
                    for (int u = 0; u < n; ++u) sg[u] = cap_score(sg[u], softcap);
                }
                for (int u = 0; u < t0; ++u) sg[u] = -INFINITY;
            }
        }
        for (int i = 0; i < nh; ++i) {
            float* si = s + i * bs;
            float bmax = m[i];
            for (int t = t0; t < n; ++t) bmax = si[t] > bmax ? si[t] : bmax;
            const float correction = exp_nonpositive(m[i] - bmax);  // ~0 on the first block (m = -inf)
            l[i] *= correction;
            for (int d = 0; d < D; ++d) acc[i * D + d] *= correction;
            m[i] = bmax;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; ++t) {
                si[t] = exp_nonpositive(si[t] - bmax);
                sum += si[t];
            }
            for (int t = 0; t < t0; ++t) sum -= si[t], si[t] = 0.f;  // outside the window
            l[i] += sum;
        }
        for (int h = h0; h < h1; ++h) {
            if (vsb) {  // fold the int8 rows' scales into the weights
                for (int g = 0; g < G; ++g) {
                    float* si = s + ((h - h0) * G + g) * bs;
                    for (int t = 0; t < n; ++t) si[t] *= vsb[t * KVH + h];
                }
            }
            for (int g = 0; g < G; ++g) {
                const int i = (h - h0) * G + g;
                accumulate_rows<T, FixedD>(acc + i * D, s + i * bs, vb + h * D, row_stride, n, D);
            }
        }
    }
    if (!keep_part(part, nh, D, acc, m, l)) finish_heads(io, token, h0 * G, nh, D, acc, l);
}

}  // namespace modserve::paged_attention
