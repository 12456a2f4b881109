// Paged attention for CPUs, read straight from the block cache (no gather copy).
//
// Built on first use by cpu_kernel_build.py (g++ -O3 -march=native -fopenmp, no torch
// headers, loaded with ctypes), so it needs nothing but a C++ compiler. It shares torch's
// libgomp, hence torch's OpenMP thread pool.
//
// One work item = one query token x one KV head: the token's G = H / KVH query heads read
// each K/V row of its sequence once (GQA without copying K/V). Softmax runs online, one
// cache block at a time: scores for the block, a new running max, rescale, accumulate.
// The token at position p attends to cache positions 0..p of its own sequence, so decode
// rows, speculative verify rows and chunks with cached context all use the same loop.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int kMaxGroup = 16;    // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 64;

inline float load(const float* p, int i) { return p[i]; }
inline float load(const uint16_t* p, int i) {  // bfloat16: the high half of a float32
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline float load(const int8_t* p, int i) { return static_cast<float>(p[i]); }

// FixedD > 0: head_dim known at compile time (fully unrolled, vectorized inner loops).
template <typename T, int FixedD>
void attend(const float* q, float* out, const T* kc, const T* vc, const float* ks, const float* vs,
            const int32_t* table, int32_t pos, int H, int KVH, int D_, int bs, float scale, int kvh) {
    const int D = FixedD > 0 ? FixedD : D_;
    const int G = H / KVH;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;       // one token's K (or V) in a block
    const int64_t block_stride = static_cast<int64_t>(bs) * row_stride;
    float qs[kMaxGroup][kMaxHeadDim];
    float acc[kMaxGroup][kMaxHeadDim];
    float m[kMaxGroup], l[kMaxGroup], s[kMaxGroup][kMaxBlock];
    for (int g = 0; g < G; ++g) {
        const float* qh = q + static_cast<int64_t>(kvh * G + g) * D;
        for (int d = 0; d < D; ++d) qs[g][d] = qh[d] * scale;
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    const int n_tokens = pos + 1;
    for (int start = 0; start < n_tokens; start += bs) {
        const int n = n_tokens - start < bs ? n_tokens - start : bs;
        const int64_t base = static_cast<int64_t>(table[start / bs]) * block_stride + static_cast<int64_t>(kvh) * D;
        const int64_t scale_base = static_cast<int64_t>(table[start / bs]) * bs * KVH + kvh;
        for (int t = 0; t < n; ++t) {
            const T* kr = kc + base + t * row_stride;
            const float kscale = ks ? ks[scale_base + t * KVH] : 1.f;
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; ++d) dot += qs[g][d] * load(kr, d);
                s[g][t] = dot * kscale;
            }
        }
        for (int g = 0; g < G; ++g) {
            float bmax = m[g];
            for (int t = 0; t < n; ++t) bmax = s[g][t] > bmax ? s[g][t] : bmax;
            const float correction = std::exp(m[g] - bmax);  // exp(-inf) = 0 on the first block
            l[g] *= correction;
            for (int d = 0; d < D; ++d) acc[g][d] *= correction;
            m[g] = bmax;
            for (int t = 0; t < n; ++t) {
                s[g][t] = std::exp(s[g][t] - bmax);
                l[g] += s[g][t];
            }
        }
        for (int t = 0; t < n; ++t) {
            const T* vr = vc + base + t * row_stride;
            const float vscale = vs ? vs[scale_base + t * KVH] : 1.f;
            for (int g = 0; g < G; ++g) {
                const float p = s[g][t] * vscale;
                for (int d = 0; d < D; ++d) acc[g][d] += p * load(vr, d);
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        float* oh = out + static_cast<int64_t>(kvh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int d = 0; d < D; ++d) oh[d] = acc[g][d] * inv;
    }
}

template <typename T, int FixedD>
void run(const float* q, float* out, const void* k_cache, const void* v_cache, const float* k_scale,
         const float* v_scale, const int32_t* block_tables, int table_width, const int64_t* rows,
         const int32_t* row_seq, const int32_t* row_pos, int n_rows, int H, int KVH, int D, int bs, float scale,
         int threads) {
    const T* kc = static_cast<const T*>(k_cache);
    const T* vc = static_cast<const T*>(v_cache);
    const int64_t token_stride = static_cast<int64_t>(H) * D;
    const int64_t items = static_cast<int64_t>(n_rows) * KVH;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; ++item) {
        const int i = static_cast<int>(item / KVH), kvh = static_cast<int>(item % KVH);
        attend<T, FixedD>(q + rows[i] * token_stride, out + rows[i] * token_stride, kc, vc, k_scale, v_scale,
                  block_tables + static_cast<int64_t>(row_seq[i]) * table_width, row_pos[i], H, KVH, D, bs, scale,
                  kvh);
    }
}

}  // namespace

template <typename T>
int dispatch_head_dim(const float* q, float* out, const void* k_cache, const void* v_cache, const float* k_scale,
                      const float* v_scale, const int32_t* block_tables, int table_width, const int64_t* rows,
                      const int32_t* row_seq, const int32_t* row_pos, int n_rows, int H, int KVH, int D, int bs,
                      float scale, int threads) {
    auto go = [&](auto fixed) {
        run<T, decltype(fixed)::value>(q, out, k_cache, v_cache, k_scale, v_scale, block_tables, table_width, rows,
                                       row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads);
    };
    if (D == 64) go(std::integral_constant<int, 64>{});
    else if (D == 128) go(std::integral_constant<int, 128>{});
    else go(std::integral_constant<int, 0>{});
    return 0;
}

extern "C" {

int modserve_limits(int* max_group, int* max_head_dim, int* max_block) {
    *max_group = kMaxGroup;
    *max_head_dim = kMaxHeadDim;
    *max_block = kMaxBlock;
    return 0;
}

// dtype: 0 float32, 1 bfloat16, 2 int8 (k_scale / v_scale required). q and out are float32
// [T, H, D]; only the token rows listed in `rows` are read and written.
int modserve_paged_attention(int dtype, const float* q, float* out, const void* k_cache, const void* v_cache,
                             const float* k_scale, const float* v_scale, const int32_t* block_tables,
                             int table_width, const int64_t* rows, const int32_t* row_seq, const int32_t* row_pos,
                             int n_rows, int H, int KVH, int D, int bs, float scale, int threads) {
    if (H % KVH || H / KVH > kMaxGroup || D > kMaxHeadDim || bs > kMaxBlock) return 1;
    switch (dtype) {
        case 0:
            return dispatch_head_dim<float>(q, out, k_cache, v_cache, nullptr, nullptr, block_tables, table_width,
                                            rows, row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads);
        case 1:
            return dispatch_head_dim<uint16_t>(q, out, k_cache, v_cache, nullptr, nullptr, block_tables, table_width,
                                               rows, row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads);
        case 2:
            if (!k_scale || !v_scale) return 2;
            return dispatch_head_dim<int8_t>(q, out, k_cache, v_cache, k_scale, v_scale, block_tables, table_width,
                                             rows, row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads);
    }
    return 3;
}
}
