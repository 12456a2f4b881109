// Paged attention for CPUs, read straight from the block cache (no gather copy).
//
// Built on first use by native/build.py (g++ -O3 -march=native -fopenmp, no torch
// headers, loaded with ctypes), so it needs nothing but a C++ compiler. It shares torch's
// libgomp, hence torch's OpenMP thread pool.
//
// One work item = one query token (or one token x one KV head when there are few tokens):
// each K/V row of its sequence is read once for all of its G = H / KVH query heads (GQA
// without copying K/V). Softmax runs online, one
// cache block at a time: scores for the block, a new running max, rescale, accumulate.
// The token at position p attends to cache positions 0..p of its own sequence, so decode
// rows, speculative verify rows and chunks with cached context all use the same loop.
// Those are the portable loops; with AVX-512 (head_dim 64 or 128) decode rows and tiles of
// consecutive rows take the paths further down (docs/cpu_attention.md), and with AVX2 and FMA
// but no AVX-512, decode rows take attend_avx2 and tiles attend_tile_avx2.
//
// Per layer (Gemma, Mistral): a sliding window `window` > 0 limits the token at position p to
// positions > p - window (the loops start at the window's first chunk and mask the rest), and
// `softcap` > 0 turns each scaled score s into softcap * tanh(s / softcap) before the mask and
// the softmax. The bfloat16-dot variants take neither: such layers use the float32 paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2.h"
#include "avx512.h"
#include "bf16.h"
#include "fast_exp.h"
#include "packed_call.h"
#include "prefetch.h"

namespace {

using modserve::exp_nonpositive;

constexpr int kMaxGroup = 64;  // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 256;
constexpr int kTileRowHeads = 48;  // a tile's rows x query heads of its KV head, about: three 16-lane groups, which
                                   // key_scores / key_pv share each broadcast over (16 rows at SmolLM2's 3 heads a KV head)

inline float load(const float* p, int i) { return p[i]; }
inline float load(const uint16_t* p, int i) { return modserve::bf16_to_float(p[i]); }
inline float load(const int8_t* p, int i) { return static_cast<float>(p[i]); }

// Logit soft-capping of a scaled score (Gemma 2): cap * tanh(s / cap).
inline float cap_score(float s, float cap) { return cap * std::tanh(s / cap); }

// The first position a query at `pos` sees: pos - window + 1 within a window, else 0.
inline int window_start(int32_t pos, int window) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

// Where a step's query rows come from and its outputs go: [tokens, H, D] in the model's
// dtype (float32 or bfloat16), any stride between tokens (q is a view into the qkv rows).
// Read and written once per row and head, outside the inner loops.
struct QIO {
    const void* q;
    void* out;
    int64_t q_stride, out_stride;  // elements between tokens
    bool bf16;
    float q_at(int64_t token, int64_t i) const {  // i = head * D + d
        return bf16 ? load(static_cast<const uint16_t*>(q) + token * q_stride, static_cast<int>(i))
                    : static_cast<const float*>(q)[token * q_stride + i];
    }
    void put(int64_t token, int64_t i, float v) const {
        if (bf16) {
            static_cast<uint16_t*>(out)[token * out_stride + i] = modserve::float_to_bf16(v);
        } else {
            static_cast<float*>(out)[token * out_stride + i] = v;
        }
    }
#if defined(__AVX2__)
    __m256 q8(int64_t token, int64_t i) const {  // q_at() for elements i .. i + 7
        return bf16 ? modserve::load8(static_cast<const uint16_t*>(q) + token * q_stride + i)
                    : modserve::load8(static_cast<const float*>(q) + token * q_stride + i);
    }
#endif
#if defined(__AVX512F__)
    __m512 q16(int64_t token, int64_t i) const {  // q_at() for elements i .. i + 15
        return bf16 ? modserve::load16(static_cast<const uint16_t*>(q) + token * q_stride + i)
                    : modserve::load16(static_cast<const float*>(q) + token * q_stride + i);
    }
    void put16(int64_t token, int64_t i, __m512 v) const {  // put() for elements i .. i + 15
        if (bf16) {
            modserve::store16(static_cast<uint16_t*>(out) + token * out_stride + i, v);
        } else {
            modserve::store16(static_cast<float*>(out) + token * out_stride + i, v);
        }
    }
#endif
};

// One part of a decode row split by positions (see run()): its heads' accumulators (the
// bfloat16-dot path's interleaved order), running maxima and sums, merged with the row's
// other parts afterwards.
struct Partial {
    float* acc;  // [nh][D]
    float* m;    // [nh]
    float* l;    // [nh]
};

// A decode row's query heads [first, first + nh): q scaled into qs, accumulators zeroed,
// running max -inf and running sum 0 (the online softmax's starting point).
inline void start_heads(const QIO& io, int64_t token, int first, int nh, int D, float scale, float* qs, float* acc,
                        float* m, float* l) {
    for (int i = 0; i < nh; ++i) {
        const int64_t qi = static_cast<int64_t>(first + i) * D;
        for (int d = 0; d < D; ++d) qs[i * D + d] = io.q_at(token, qi + d) * scale;
        for (int d = 0; d < D; ++d) acc[i * D + d] = 0.f;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
}

// One head's output, elements [first, first + D) of the row: its accumulator over its sum of
// weights. 16 lanes at a time where the build has AVX-512 and D is a multiple of 16 (the
// same products, narrowed to bfloat16 by the same formula).
inline void put_head(const QIO& io, int64_t token, int64_t first, const float* acc, int D, float l) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        const __m512 inv = _mm512_set1_ps(1.f / l);
        for (int j = 0; j < D / 16; ++j) io.put16(token, first + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), inv));
        return;
    }
#endif
    const float inv = 1.f / l;
    for (int d = 0; d < D; ++d) io.put(token, first + d, acc[d] * inv);
}

// ... and a decode row's outputs, query heads [first, first + nh).
inline void finish_heads(const QIO& io, int64_t token, int first, int nh, int D, const float* acc, const float* l) {
    for (int i = 0; i < nh; ++i) put_head(io, token, static_cast<int64_t>(first + i) * D, acc + i * D, D, l[i]);
}

// A part's end: its unnormalized state into `part` (true), or nothing to do (false: the
// caller writes the outputs).
inline bool keep_part(const Partial* part, int nh, int D, const float* acc, const float* m, const float* l) {
    if (part == nullptr) return false;
    std::memcpy(part->acc, acc, sizeof(float) * nh * D);
    std::memcpy(part->m, m, sizeof(float) * nh);
    std::memcpy(part->l, l, sizeof(float) * nh);
    return true;
}

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

// Where the chunk of cache positions from `start` (within one block) lies: its first K and V
// rows and their int8 scales (null for a float cache). The vector paths' chunk loops share it.
template <typename T>
struct ChunkRows {
    const T* k;
    const T* v;
    const float* k_scale;
    const float* v_scale;
};

// The cache row (slot: a row of the [blocks * bs] rows) holding position `start` of a sequence
// with block table `table`.
inline int64_t slot_of(const int32_t* table, int start, int bs) { return static_cast<int64_t>(table[start / bs]) * bs + start % bs; }

template <typename T>
inline ChunkRows<T> chunk_rows(const T* kc, const T* vc, const float* ks, const float* vs, const int32_t* table, int start,
                               int bs, int KVH, int64_t row_stride) {
    const int64_t slot = slot_of(table, start, bs);  // the chunk's first cache row
    return {kc + slot * row_stride, vc + slot * row_stride, ks ? ks + slot * KVH : nullptr, vs ? vs + slot * KVH : nullptr};
}

// KV head h's rows of a chunk as float32, and the distance between them: in place in a float32
// cache, else in the buffers the chunk was widened into ([rows][heads][D], heads from h0).
template <typename T>
inline int64_t head_rows(const ChunkRows<T>& c, const float* kbuf, const float* vbuf, int h, int h0, int heads, int D,
                         int64_t row_stride, const float*& kr, const float*& vr) {
    if constexpr (std::is_same_v<T, float>) {
        kr = c.k + h * D, vr = c.v + h * D;
        return row_stride;
    } else {
        kr = kbuf + (h - h0) * D, vr = vbuf + (h - h0) * D;
        return static_cast<int64_t>(heads) * D;
    }
}

// An AMD Zen core: its decode loops ask for more ahead, into L2 (SegmentAhead, ChunkAhead).
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr bool kZen = true;  // GCC names the core for -march=native (GCC 12 calls a Zen 4 znver3)
#else
constexpr bool kZen = false;
#endif

// The next chunk's K and V rows (the item's heads) asked for while this chunk computes, in
// `parts` shares of whole rows, one per query head: without it the compute and the memory
// stalls added up, and a burst of a whole chunk's lines at once measured nothing. One chunk
// ahead, 64 rows x 450 positions of a float32 cache (30 layers, Zen 5): the AVX2 path
// 1.7-1.8x faster (36-37 against 64-66 ms a step; 41-43 against 72-73 with scattered
// blocks), the AVX-512 one 1.15-1.35x; two or three chunks ahead gained less. The AVX2 path
// on a Zen core asks for a float32 cache's chunk after next as well, into L2 (fetch<true>):
// on a Zen 4 built for AVX2, 1.41-1.55x faster at 4-64 rows; over bfloat16 and int8 caches
// (whose widening bounds the loop) 0.95-0.99x, so they do not.
struct ChunkAhead {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t stride = 0;  // bytes between cache rows
    int lines = 0;       // 64-byte lines of a row's heads
    int rows = 0;        // K rows, then as many V rows
    template <typename T>
    ChunkAhead(const T* kc, const T* vc, const int32_t* table, int at, int n_tokens, int chunk, int bs,
               int64_t row_stride, int h0, int heads, int D) {
        if (at >= n_tokens) return;
        const int64_t first = slot_of(table, at, bs) * row_stride + static_cast<int64_t>(h0) * D;
        k = reinterpret_cast<const char*>(kc + first), v = reinterpret_cast<const char*>(vc + first);
        stride = row_stride * static_cast<int64_t>(sizeof(T));
        lines = static_cast<int>((static_cast<int64_t>(heads) * D * static_cast<int64_t>(sizeof(T)) + 63) / 64);
        rows = std::min(chunk, n_tokens - at);
    }
    // Share `part` of `parts`, in whole rows (a division per line cost more than the line).
    template <bool IntoL2 = false>
    void fetch(int part, int parts) const {
        for (int r = part * 2 * rows / parts; r < (part + 1) * 2 * rows / parts; ++r) {
            const char* row = r < rows ? k + r * stride : v + (r - rows) * stride;
            for (int x = 0; x < lines; ++x) modserve::prefetch_line<IntoL2>(row + 64 * x);
        }
    }
};

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
};
#if defined(__AVX512BF16__)
// The bfloat16 tile's vector (attend_tile_bf16dot): each element a 32-bit word of two
// bfloat16 (q's and K's dimension pairs, the weights' key pairs and V's values of one
// dimension at a key pair), each product a vdpbf16ps summing both halves into a float32 lane.
struct TileVecBf16 {
    using V = __m512;
    using Elem = uint32_t;
    static constexpr int L = 16, KT = 8, NG = 3;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_load_ps(p); }
    static V load(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_load_si512(p)); }
    static void store(float* p, V v) { _mm512_store_ps(p, v); }
    static V set1(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x))); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
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
#endif

#if defined(__AVX512F__)
// The 16 scores of a chunk, one a lane, from dot(t): key t's products as a vector of partial
// sums (lanes n.. are 0). A full chunk's keys come in pairs, each pair folded at once
// (transpose_sum16's first step), so few vectors stay live and the chunk runs in
// registers; the loop of runtime length n kept all 16 on the stack (the bf16 decode path
// 1.09x, 256 rows x 350 tokens from memory; 1.2x from L3).
// cap_score() on 16 scores.
inline __m512 cap_scores16(__m512 s, float cap) {
    alignas(64) float x[16];
    _mm512_store_ps(x, s);
    for (float& v : x) v = cap_score(v, cap);
    return _mm512_load_ps(x);
}

template <typename Dot>
inline __m512 chunk_scores(int n, const Dot& dot) {
    if (n == 16) {
        __m512 a[8];
        for (int i = 0; i < 8; ++i) a[i] = modserve::fold_pair(dot(2 * i), dot(2 * i + 1));
        return modserve::transpose_sum16_from_pairs(a);
    }
    __m512 part[16];
    for (int t = 0; t < 16; ++t) part[t] = t < n ? dot(t) : _mm512_setzero_ps();
    return modserve::transpose_sum16(part);
}

// attend() for head_dim D (a multiple of 16) with AVX-512, 16 cache rows (a chunk) at a
// time. A chunk's rows for the item's KV heads are widened to float32 once (read in place
// when the cache is float32); each query head then takes its 16 scores as 16 partial
// vectors and one transpose-sum (no horizontal sum per score), a vector exp, and P.V with
// its accumulators in registers. At SmolLM2's decode shape (64 rows x ~300 tokens, bf16,
// 30 layers' caches) it takes 25-27 ms a step where the portable loops take 39-42.
// The next chunk's rows are fetched in shares while this one computes (ChunkAhead; an
// earlier trial measured nothing because GCC had dropped its _mm_prefetch calls).
// attend_bf16dot below serves a bfloat16 model's rows over a bfloat16 cache.
template <typename T, int D>
void attend_avx512(const QIO& io, int64_t token, const T* kc, const T* vc, const float* ks, const float* vs,
                   const int32_t* table, int32_t pos, int KVH, int G, int bs, float scale, int h0, int h1,
                   int window, float softcap, int from = 0, int to = -1, const Partial* part = nullptr) {
    using modserve::exp512_nonpositive;
    using modserve::load16;
    constexpr int NV = D / 16;  // vectors per row
    const int nh = (h1 - h0) * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    const int heads = h1 - h0;
    static thread_local std::vector<float> work;
    work.resize(static_cast<size_t>(nh) * (2 * D + 2) + 2 * 16 * heads * D);
    float* qs = work.data();  // [nh][D], pre-scaled
    float* acc = qs + nh * D;  // [nh][D]
    float* m = acc + nh * D;  // [nh] running max
    float* l = m + nh;  // [nh] running sum of weights
    float* kbuf = l + nh;  // [16][heads][D]: the item's K rows of a 16-token chunk, as float32
    float* vbuf = kbuf + 16 * heads * D;  // [16][heads][D]
    start_heads(io, token, h0 * G, nh, D, scale, qs, acc, m, l);
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 16 ? bs : 16;  // block sizes are powers of two: a chunk never crosses a block
    const int lo = window_start(pos, window);
    for (int start = std::max(lo / chunk * chunk, from); start < n_tokens; start += chunk) {
        const int n = n_tokens - start < chunk ? n_tokens - start : chunk;
        const ChunkRows<T> c = chunk_rows(kc, vc, ks, vs, table, start, bs, KVH, row_stride);
        const ChunkAhead next(kc, vc, table, start + chunk, n_tokens, chunk, bs, row_stride, h0, heads, D);
        const float* ksb = c.k_scale;
        const float* vsb = c.v_scale;
        // keys that exist (t < n) and are in the window (start + t >= lo)
        const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << (lo > start ? lo - start : 0)) - 1u));
        if constexpr (!std::is_same_v<T, float>) {  // widen the item's heads of each row in one sweep
            for (int t = 0; t < n; ++t) {
                for (int j = 0; j < heads * NV; ++j) {
                    _mm512_storeu_ps(kbuf + (t * heads) * D + 16 * j, load16(c.k + t * row_stride + h0 * D + 16 * j));
                    _mm512_storeu_ps(vbuf + (t * heads) * D + 16 * j, load16(c.v + t * row_stride + h0 * D + 16 * j));
                }
            }
        }
        for (int h = h0; h < h1; ++h) {
            const float* kr;
            const float* vr;
            const int64_t stride = head_rows(c, kbuf, vbuf, h, h0, heads, D, row_stride, kr, vr);
            __m512 kscale = _mm512_set1_ps(1.f), vscale = _mm512_set1_ps(1.f);
            if (ksb) {
                alignas(64) float k16[16] = {}, v16[16] = {};
                for (int t = 0; t < n; ++t) k16[t] = ksb[t * KVH + h], v16[t] = vsb[t * KVH + h];
                kscale = _mm512_load_ps(k16), vscale = _mm512_load_ps(v16);
            }
            for (int g = 0; g < G; ++g) {
                const int i = (h - h0) * G + g;
                next.fetch(i, nh);
                __m512 qv[NV];
                for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qs + i * D + 16 * j);
                __m512 scores = chunk_scores(n, [&](int t) {
                    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr + t * stride));
                    for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + t * stride + 16 * j), s);
                    return s;
                });
                scores = _mm512_mul_ps(scores, kscale);
                if (softcap > 0.f) scores = cap_scores16(scores, softcap);
                scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), scores);
                const float bmax = std::fmax(m[i], _mm512_reduce_max_ps(scores));
                const float correction = exp_nonpositive(m[i] - bmax);  // ~0 on the first chunk (m = -inf)
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(bmax))));
                l[i] = l[i] * correction + _mm512_reduce_add_ps(p);
                m[i] = bmax;
                const __m512 pv = _mm512_mul_ps(p, vscale);  // int8: the V rows' scales folded in
                // lane t broadcast in registers (a scalar reload of a just-stored vector would
                // stall on store forwarding)
                const auto lane = [&](int t) { return _mm512_permutexvar_ps(_mm512_set1_epi32(t), pv); };
                // even and odd rows into separate accumulators: twice the independent FMA
                // chains, so the FMA latency is hidden even for D = 64 (4 vectors a row)
                __m512 a[NV], b[NV];
                const __m512 corr = _mm512_set1_ps(correction);
                for (int j = 0; j < NV; ++j) {
                    a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * j), corr);
                    b[j] = _mm512_setzero_ps();
                }
                int t = 0;
                for (; t + 1 < n; t += 2) {
                    const __m512 p0 = lane(t), p1 = lane(t + 1);
                    for (int j = 0; j < NV; ++j) {
                        a[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vr + t * stride + 16 * j), a[j]);
                        b[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vr + (t + 1) * stride + 16 * j), b[j]);
                    }
                }
                if (t < n) {
                    const __m512 p0 = lane(t);
                    for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vr + t * stride + 16 * j), a[j]);
                }
                for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + i * D + 16 * j, _mm512_add_ps(a[j], b[j]));
            }
        }
    }
    if (!keep_part(part, nh, D, acc, m, l)) finish_heads(io, token, h0 * G, nh, D, acc, l);
}

constexpr int kSegment = 256;  // positions a decode row's segment sweeps take at a time (attend_bf16dot, attend_segments)

// What a decode row's segment sweeps read next, asked for ahead: the two chunks after the
// current one (their rows' lines for the item's heads), in nh shares of whole rows, one share
// per step of the current sweep, so that the lines arrive while this chunk and the next
// compute (the hardware prefetchers stop at each scattered block). Two ahead rather than one:
// over scattered blocks, 0.88x the time at 64 rows x 450 positions, 0.81x at 16 rows, 0.93x
// at one (the bfloat16-dot path). Shares of whole rows: integer divisions per line cost more
// than the lines. The scores sweep reads its K chunks, then the P.V sweep the segment's V
// chunks, then the next segment's K chunks. Two asks (fetch_ahead<true>): both chunks every
// step, the next one into L1 and the one after into L2 only (prefetch_line<true>), so each line
// twice; on a Zen 4 (AMD EPYC family 25) at 43 rows x 320 positions, attend_bf16dot took 0.70x
// the time of asking for both into L1 (both into L2: 0.71x; only the one after next, into L2:
// 0.79x; into L1: 1.09x), attend_segments 0.64x (float32 cache) and 0.71x (bfloat16) the time
// of one ask, but 1.06x over an int8 cache. One ask (fetch_ahead<false>): only the chunk after
// next, into L1, each line once, which on Cascade Lake took 0.87-0.95x the time of asking for
// both into L1 (float32, int8 and bfloat16 caches, blocks in order or scattered).
// attend_bf16dot always asks twice (AVX512_BF16 CPUs: Zen 4 / 5 and the AMX Xeons);
// attend_segments asks twice on Zen cores (kZen) over float32 and bfloat16 caches, else once.
template <typename T>
struct SegmentAhead {
    struct Rows {
        const char* base;
        int rows;
    };
    const T* kc;
    const T* vc;
    const int32_t* table;
    int bs, chunk, n_tokens, nh, lines_per_row;
    int64_t row_stride, first;  // elements between cache rows; the item's first element of a row

    SegmentAhead(const T* kc, const T* vc, const int32_t* table, int bs, int chunk, int n_tokens, int nh, int h0, int heads,
                 int D, int64_t row_stride)
        : kc(kc), vc(vc), table(table), bs(bs), chunk(chunk), n_tokens(n_tokens), nh(nh),
          lines_per_row(static_cast<int>(heads * D * sizeof(T) / 64)), row_stride(row_stride), first(static_cast<int64_t>(h0) * D) {}
    const T* rows_at(const T* cache, int start) const { return cache + slot_of(table, start, bs) * row_stride; }
    Rows at(const T* cache, int start) const {
        if (start >= n_tokens) return {nullptr, 0};
        return {reinterpret_cast<const char*>(rows_at(cache, start) + first), std::min(chunk, n_tokens - start)};
    }
    // The chunk k chunks after chunk c of the segment at seg (seg_n positions), in the scores
    // sweep (after_k) or the P.V sweep (after_v).
    Rows after_k(int seg, int seg_n, int c, int k) const {
        const int a = c + k * chunk;
        return a < seg_n ? at(kc, seg + a) : at(vc, seg + a - seg_n);
    }
    Rows after_v(int seg, int seg_n, int c, int k) const {
        const int a = c + k * chunk;
        return a < seg_n ? at(vc, seg + a) : at(kc, seg + kSegment + a - seg_n);
    }
    template <bool IntoL2 = false>
    void fetch_share(const Rows& r, int share) const {
        for (int t = share * r.rows / nh; t < (share + 1) * r.rows / nh; ++t) {
            const char* row = r.base + t * row_stride * static_cast<int64_t>(sizeof(T));
            for (int x = 0; x < lines_per_row; ++x) modserve::prefetch_line<IntoL2>(row + 64 * x);
        }
    }
    // Share `share` of a step's asks, given the chunk after the current one (next) and the one
    // after that (then): two asks or one (above).
    template <bool TwoAsks>
    void fetch_ahead(const Rows& next, const Rows& then, int share) const {
        if constexpr (TwoAsks) {
            fetch_share(next, share);
            fetch_share<true>(then, share);
        } else {
            fetch_share(then, share);
        }
    }
};

// Sweep (2) of a segment, for one query head: the max of its scores si[0, seg_n); each 16
// lanes' weights exp(score - max) handed to keep(k, w) (lanes k .. k + 15), which stores them
// and returns what the sum adds; then the running max m and sum l advanced and the head's D
// accumulators rescaled (~0 on the first segment, where m is -inf).
template <typename Keep>
inline void segment_weights(const float* si, int seg_n, float& m, float& l, float* acc, int D, const Keep& keep) {
    const auto lanes_from = [&](int k) {  // the segment's positions among lanes k .. k + 15
        return static_cast<__mmask16>(seg_n - k >= 16 ? 0xFFFFu : (1u << (seg_n - k)) - 1u);
    };
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < seg_n; k += 16) vmax = _mm512_mask_max_ps(vmax, lanes_from(k), vmax, _mm512_loadu_ps(si + k));
    const float mx = std::fmax(m, _mm512_reduce_max_ps(vmax));
    const float correction = exp_nonpositive(m - mx);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < seg_n; k += 16) {
        const __m512 w = modserve::exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(si + k), vmx));
        sum = _mm512_add_ps(sum, keep(k, _mm512_maskz_mov_ps(lanes_from(k), w)));
    }
    l = l * correction + _mm512_reduce_add_ps(sum);
    m = mx;
    const __m512 corr = _mm512_set1_ps(correction);
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(acc + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), corr));
}

#if defined(__AVX512BF16__)
// One head's output from the bf16-dot paths' accumulators, over its sum of weights `l`:
// each 32-element half of the row is two vectors in unpacklo/unpackhi order (lane 4L + e
// of the first is element 8L + e, of the second 8L + 4 + e), put back in order here.
inline void put_interleaved(const QIO& io, int64_t token, int64_t first, const float* acc, int D, float l) {
    const __m512 inv = _mm512_set1_ps(1.f / l);
    const __m512i elements_0_15 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i elements_16_31 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < D / 32; ++j) {
        const __m512 lo = _mm512_loadu_ps(acc + 32 * j), hi = _mm512_loadu_ps(acc + 32 * j + 16);
        io.put16(token, first + 32 * j, _mm512_mul_ps(_mm512_permutex2var_ps(lo, elements_0_15, hi), inv));
        io.put16(token, first + 32 * j + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, elements_16_31, hi), inv));
    }
}

// attend_avx512 for a bfloat16 model (q, out and cache in bfloat16), in segments of up to
// kSegment positions, each in three sweeps: (1) the segment's scores, q.k straight from the
// cache rows with vdpbf16ps (bf16 products summed in float32: exact for such q; the scale
// goes on the scores); (2) the segment's max, weights and sum, vectorized over the
// segment, weights rounded to bfloat16 as torch's flash SDPA feeds its second GEMM (the
// sum adds the rounded ones); (3) P.V over pairs of rows, each chunk's V rows interleaved
// pairwise once for the head's G query heads. The online softmax rescales once a segment,
// not once per 16 keys: with no serial chain through the running max in the per-key work,
// the loop runs near the memory's rate (a 16-key online softmax ran at half of it). The
// accumulators hold each 32-element half of a row as two vectors of interleaved
// 4-element groups (unpacklo/unpackhi order), put back in order at the end. Block sizes
// of 2 and up (a pair of keys never crosses a block).

// Positions [from, to) only (default: all, 0 .. pos), from a multiple of 16; with `part`, the
// unnormalized state goes there instead of the output.
template <int D>
void attend_bf16dot(const QIO& io, int64_t token, const uint16_t* kc, const uint16_t* vc, const int32_t* table,
                    int32_t pos, int KVH, int G, int bs, float scale, int h0, int h1, int from = 0, int to = -1,
                    const Partial* part = nullptr) {
    constexpr int NB = D / 32;  // 32-element bfloat16 vectors per row
    constexpr int kRow = kSegment + 16;  // a head's scores / weights, padded for a chunk's full-vector store
    const int heads = h1 - h0;
    const int nh = heads * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    static thread_local std::vector<float> work;
    static thread_local std::vector<uint16_t> bwork;
    work.resize(static_cast<size_t>(nh) * (D + 2 + kRow));
    bwork.resize(static_cast<size_t>(nh) * (D + kRow) + 8 * NB * 64);
    float* acc = work.data();  // [nh][D], permuted within each 32-element half
    float* m = acc + nh * D;
    float* l = m + nh;
    float* s = l + nh;  // [nh][kRow] the segment's scores
    uint16_t* qb = bwork.data();  // [nh][D] this token's q
    uint16_t* p = qb + nh * D;  // [nh][kRow] the segment's weights
    uint16_t* vi = p + nh * kRow;  // [8 pairs][NB][lo 32 | hi 32]: a chunk's V rows of one head, interleaved pairwise
    const uint16_t* qrow = static_cast<const uint16_t*>(io.q) + token * io.q_stride;
    for (int i = 0; i < nh; ++i) {
        for (int d = 0; d < D; ++d) qb[i * D + d] = qrow[static_cast<int64_t>(h0 * G + i) * D + d];
        for (int d = 0; d < D; ++d) acc[i * D + d] = 0.f;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 16 ? bs : 16;
    const SegmentAhead<uint16_t> ahead(kc, vc, table, bs, chunk, n_tokens, nh, h0, heads, D, row_stride);
    for (int seg = from; seg < n_tokens; seg += kSegment) {
        const int seg_n = std::min(kSegment, n_tokens - seg);
        for (int c = 0; c < seg_n; c += chunk) {  // (1) scores
            const int n = std::min(chunk, seg_n - c);
            const uint16_t* kb = ahead.rows_at(kc, seg + c);
            const auto next = ahead.after_k(seg, seg_n, c, 1), then = ahead.after_k(seg, seg_n, c, 2);
            for (int i = 0; i < nh; ++i) {
                ahead.fetch_ahead<true>(next, then, i);
                const uint16_t* kh = kb + static_cast<int64_t>(h0 + i / G) * D;
                __m512bh qv[NB];
                for (int j = 0; j < NB; ++j) qv[j] = modserve::load_bh(qb + i * D + 32 * j);
                const __m512 scores = chunk_scores(n, [&](int t) {
                    __m512 dot = _mm512_setzero_ps();
                    for (int j = 0; j < NB; ++j) dot = _mm512_dpbf16_ps(dot, qv[j], modserve::load_bh(kh + t * row_stride + 32 * j));
                    return dot;
                });
                _mm512_storeu_ps(s + i * kRow + c, _mm512_mul_ps(scores, vscale));
            }
        }
        for (int i = 0; i < nh; ++i) {  // (2) max, weights, sum
            segment_weights(s + i * kRow, seg_n, m[i], l[i], acc + i * D, D, [&](int k, __m512 w) {
                const __m256bh wb = _mm512_cvtneps_pbh(w);  // the weights P.V uses; l sums the same
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i * kRow + k), (__m256i)wb);
                return _mm512_cvtpbh_ps(wb);
            });
        }
        for (int c = 0; c < seg_n; c += chunk) {  // (3) P.V
            const int n = std::min(chunk, seg_n - c);
            const int pairs = (n + 1) / 2;
            const uint16_t* vb = ahead.rows_at(vc, seg + c);
            const auto next = ahead.after_v(seg, seg_n, c, 1), then = ahead.after_v(seg, seg_n, c, 2);
            for (int hh = 0; hh < heads; ++hh) {
                const int64_t col = static_cast<int64_t>(h0 + hh) * D;
                for (int u = 0; u < pairs; ++u) {
                    for (int j = 0; j < NB; ++j) {
                        const __m512i a = _mm512_loadu_si512(vb + 2 * u * row_stride + col + 32 * j);
                        const __m512i b = 2 * u + 1 < n ? _mm512_loadu_si512(vb + (2 * u + 1) * row_stride + col + 32 * j)
                                                        : _mm512_setzero_si512();
                        uint16_t* dst = vi + (u * NB + j) * 64;
                        _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));
                        _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi16(a, b));
                    }
                }
                for (int g = 0; g < G; ++g) {
                    const int i = hh * G + g;
                    ahead.fetch_ahead<true>(next, then, i);
                    int32_t w2[8];  // the chunk's weights, a pair of keys per element
                    std::memcpy(w2, p + i * kRow + c, sizeof w2);
                    __m512 a[2 * NB];
                    for (int j = 0; j < 2 * NB; ++j) a[j] = _mm512_loadu_ps(acc + i * D + 16 * j);
                    for (int u = 0; u < pairs; ++u) {
                        const __m512bh w = modserve::as_bh(_mm512_set1_epi32(w2[u]));
                        const uint16_t* vu = vi + u * NB * 64;
                        for (int j = 0; j < 2 * NB; ++j) a[j] = _mm512_dpbf16_ps(a[j], w, modserve::load_bh(vu + 32 * j));
                    }
                    for (int j = 0; j < 2 * NB; ++j) _mm512_storeu_ps(acc + i * D + 16 * j, a[j]);
                }
            }
        }
    }
    if (keep_part(part, nh, D, acc, m, l)) return;
    for (int i = 0; i < nh; ++i) put_interleaved(io, token, static_cast<int64_t>(h0 * G + i) * D, acc + i * D, D, l[i]);
}

#endif  // __AVX512BF16__

// A chunk's n rows of one KV head (`src`, cache rows `stride` apart) as float32, and the
// distance between them: in place in a float32 cache; else widened into buf ([16][D]) when
// `widen` (the first of the head's G query heads), and read from there by the others.
template <typename T, int D>
inline const float* head_rows16(const T* src, int64_t stride, int n, bool widen, float* buf, int64_t& rows_apart) {
    if constexpr (std::is_same_v<T, float>) {
        rows_apart = stride;
        return src;
    } else {
        if (widen) {
            for (int t = 0; t < n; ++t) {
                for (int j = 0; j < D / 16; ++j) _mm512_store_ps(buf + t * D + 16 * j, modserve::load16(src + t * stride + 16 * j));
            }
        }
        rows_apart = D;
        return buf;
    }
}

// attend_avx512 for a layer without window or soft-cap (any cache: float32, bfloat16 with
// float32 products, int8 with its scales), in segments of up to kSegment positions and three
// sweeps as attend_bf16dot runs them, in float32 throughout: (1) the segment's scores (q
// pre-scaled, as attend_avx512's; an int8 key's scale on its score); (2) the segment's max,
// weights (in place of the scores) and sum, vectorized over the segment; (3) P.V, each weight
// (times an int8 value row's scale) broadcast, even and odd keys into separate accumulators.
// The running max and the rescale of the accumulators come once a segment, not once per 16
// keys as in attend_avx512, whose per-chunk chain (a reduction, a scalar exp, then the
// weights) each query head waits on. A bfloat16 or int8 chunk's rows of a KV head are widened
// to float32 once, for its G query heads (head_rows16): widened again for each query head, they
// had cost two ALU operations on ports 0 and 5 for every FMA beside them.
template <typename T, int D>
void attend_segments(const QIO& io, int64_t token, const T* kc, const T* vc, const float* ks, const float* vs,
                     const int32_t* table, int32_t pos, int KVH, int G, int bs, float scale, int h0, int h1, int from = 0,
                     int to = -1, const Partial* part = nullptr) {
    constexpr int NV = D / 16;  // vectors per row
    constexpr int kRow = kSegment + 16;  // a head's scores / weights, padded for a chunk's full-vector store
    const int heads = h1 - h0;
    const int nh = heads * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    static thread_local std::vector<float> work;
    work.resize(static_cast<size_t>(nh) * (2 * D + 2 + kRow));
    float* qs = work.data();  // [nh][D], pre-scaled
    float* acc = qs + nh * D;  // [nh][D]
    float* m = acc + nh * D;
    float* l = m + nh;
    float* s = l + nh;  // [nh][kRow] the segment's scores, then its weights
    alignas(64) float kbuf[16 * D], vbuf[16 * D];  // a chunk's K or V rows of one KV head, widened (not a float32 cache)
    start_heads(io, token, h0 * G, nh, D, scale, qs, acc, m, l);
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 16 ? bs : 16;
    const SegmentAhead<T> ahead(kc, vc, table, bs, chunk, n_tokens, nh, h0, heads, D, row_stride);
    constexpr bool kTwoAsks = kZen && !std::is_same_v<T, int8_t>;  // SegmentAhead
    for (int seg = from; seg < n_tokens; seg += kSegment) {
        const int seg_n = std::min(kSegment, n_tokens - seg);
        for (int c = 0; c < seg_n; c += chunk) {  // (1) scores
            const int n = std::min(chunk, seg_n - c);
            const ChunkRows<T> rows = chunk_rows(kc, vc, ks, vs, table, seg + c, bs, KVH, row_stride);
            const auto next = ahead.after_k(seg, seg_n, c, 1), then = ahead.after_k(seg, seg_n, c, 2);
            for (int i = 0; i < nh; ++i) {
                ahead.template fetch_ahead<kTwoAsks>(next, then, i);
                const int h = h0 + i / G;
                int64_t kstride;
                const float* kh = head_rows16<T, D>(rows.k + static_cast<int64_t>(h) * D, row_stride, n, i % G == 0, kbuf, kstride);
                __m512 qv[NV];
                for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qs + i * D + 16 * j);
                __m512 scores = chunk_scores(n, [&](int t) {
                    __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kh + t * kstride));
                    for (int j = 1; j < NV; ++j) dot = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kh + t * kstride + 16 * j), dot);
                    return dot;
                });
                if (ks != nullptr) {
                    alignas(64) float k16[16] = {};
                    for (int t = 0; t < n; ++t) k16[t] = rows.k_scale[t * KVH + h];
                    scores = _mm512_mul_ps(scores, _mm512_load_ps(k16));
                }
                _mm512_storeu_ps(s + i * kRow + c, scores);
            }
        }
        for (int i = 0; i < nh; ++i) {  // (2) max, weights (over the scores), sum
            float* si = s + i * kRow;
            segment_weights(si, seg_n, m[i], l[i], acc + i * D, D, [&](int k, __m512 w) {
                _mm512_storeu_ps(si + k, w);
                return w;
            });
        }
        for (int c = 0; c < seg_n; c += chunk) {  // (3) P.V
            const int n = std::min(chunk, seg_n - c);
            const ChunkRows<T> rows = chunk_rows(kc, vc, ks, vs, table, seg + c, bs, KVH, row_stride);
            const auto next = ahead.after_v(seg, seg_n, c, 1), then = ahead.after_v(seg, seg_n, c, 2);
            for (int i = 0; i < nh; ++i) {
                ahead.template fetch_ahead<kTwoAsks>(next, then, i);
                const int h = h0 + i / G;
                int64_t vstride;
                const float* vh = head_rows16<T, D>(rows.v + static_cast<int64_t>(h) * D, row_stride, n, i % G == 0, vbuf, vstride);
                float* p = s + i * kRow + c;
                if (vs != nullptr) {
                    for (int t = 0; t < n; ++t) p[t] *= rows.v_scale[t * KVH + h];
                }
                __m512 a[NV], b[NV];  // even and odd keys: twice the independent FMA chains
                for (int j = 0; j < NV; ++j) a[j] = _mm512_loadu_ps(acc + i * D + 16 * j), b[j] = _mm512_setzero_ps();
                int t = 0;
                for (; t + 1 < n; t += 2) {
                    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
                    for (int j = 0; j < NV; ++j) {
                        a[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vh + t * vstride + 16 * j), a[j]);
                        b[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vh + (t + 1) * vstride + 16 * j), b[j]);
                    }
                }
                if (t < n) {
                    const __m512 p0 = _mm512_set1_ps(p[t]);
                    for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vh + t * vstride + 16 * j), a[j]);
                }
                for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + i * D + 16 * j, _mm512_add_ps(a[j], b[j]));
            }
        }
    }
    if (!keep_part(part, nh, D, acc, m, l)) finish_heads(io, token, h0 * G, nh, D, acc, l);
}

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
        for (int u = 0; u < 8; ++u) {  // V rows interleaved pairwise (zeros past n: their weights are 0)
            for (int j = 0; j < NB; ++j) {
                const __m512i a = 2 * u < n ? _mm512_loadu_si512(vb + 2 * u * row_stride + 32 * j) : _mm512_setzero_si512();
                const __m512i b = 2 * u + 1 < n ? _mm512_loadu_si512(vb + (2 * u + 1) * row_stride + 32 * j) : _mm512_setzero_si512();
                _mm512_store_si512(vi + (u * NB + j) * 32, _mm512_unpacklo_epi16(a, b));
                _mm512_store_si512(vi + (u * NB + j) * 32 + 16, _mm512_unpackhi_epi16(a, b));
            }
        }
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

// A split decode row's output from its `n` parts (all H = nh heads): each part's sums
// rescaled to the largest running max, added, and normalized once (the online softmax's
// own step, across parts instead of segments). `interleaved`: the parts hold the
// bfloat16-dot path's accumulator order.
inline void merge_parts(const QIO& io, int64_t token, const Partial* parts, int n, int nh, int D, bool interleaved) {
    float acc[kMaxHeadDim];
    for (int i = 0; i < nh; ++i) {
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::fmax(mx, parts[p].m[i]);
        float l = 0.f;
        for (int d = 0; d < D; ++d) acc[d] = 0.f;
        for (int p = 0; p < n; ++p) {
            const float w = exp_nonpositive(parts[p].m[i] - mx);
            l += parts[p].l[i] * w;
            const float* a = parts[p].acc + static_cast<int64_t>(i) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[d] += a[d] * w;
        }
#if defined(__AVX512BF16__)
        if (interleaved) {
            put_interleaved(io, token, static_cast<int64_t>(i) * D, acc, D, l);
            continue;
        }
#endif
        (void)interleaved;
        put_head(io, token, static_cast<int64_t>(i) * D, acc, D, l);
    }
}

// Work items. A lone query row (decode): whole tokens (all KV heads, best cache reuse) when
// there are enough of them to keep every thread busy; else each row's positions are cut
// into about one part per thread, each part all KV heads, merged afterwards (split-K), or,
// for a row too short to cut, a layer with a window or soft-cap, or one thread, token x KV
// head. Split, a lone decode row keeps every thread reading whole K/V rows: by KV head,
// SmolLM2's three heads went two to one thread and one to the other, each reading a third
// of every row (one client, ~450 positions, Zen 5, bfloat16-dot path: 30 -> 17 us a layer;
// four parts on two threads: 17-18; one row over float32 caches from memory: 0.84x the time
// on the AVX-512 path, 0.78x on the portable loops an AVX2 machine runs).
// With the AVX-512 path, runs of consecutive positions of one sequence (prefill chunks,
// verify rows) become tiles of about kTileRowHeads / G rows, one item per tile x KV head, the most
// keys first (the items are dealt out dynamically).
struct Item {
    int first, count, h0, h1;  // rows[first .. first + count), KV heads [h0, h1)
    int from = 0, to = -1;     // a split row's positions [from, to) (to -1: all)
    int part = -1;             // ... and where its partial state goes
};

constexpr int kMinPart = 64;  // positions a split row's part gets at least

struct SplitRow {
    int row, parts, first_part;  // rows[row], cut into parts first_part .. first_part + parts - 1
};

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
    using modserve::load8;
    constexpr int NV = D / 8;             // vectors per row
    constexpr int W = NV < 8 ? NV : 8;    // accumulator vectors in registers at a time
    const int nh = (h1 - h0) * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    const int heads = h1 - h0;
    static thread_local std::vector<float> work;
    work.resize(static_cast<size_t>(nh) * (2 * D + 2) + 2 * 8 * heads * D);
    float* qs = work.data();  // [nh][D], pre-scaled
    float* acc = qs + nh * D;  // [nh][D]
    float* m = acc + nh * D;  // [nh] running max
    float* l = m + nh;  // [nh] running sum of weights
    float* kbuf = l + nh;  // [8][heads][D]: the item's K rows of an 8-token chunk, as float32
    float* vbuf = kbuf + 8 * heads * D;  // [8][heads][D]
    start_heads(io, token, h0 * G, nh, D, scale, qs, acc, m, l);
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 8 ? bs : 8;  // block sizes are powers of two: a chunk never crosses a block
    constexpr bool kThenIntoL2 = kZen && std::is_same_v<T, float>;
    const int lo = window_start(pos, window);
    const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int start = std::max(lo / chunk * chunk, from); start < n_tokens; start += chunk) {
        const int n = n_tokens - start < chunk ? n_tokens - start : chunk;
        const ChunkRows<T> c = chunk_rows(kc, vc, ks, vs, table, start, bs, KVH, row_stride);
        const ChunkAhead next(kc, vc, table, start + chunk, n_tokens, chunk, bs, row_stride, h0, heads, D);
        // On Zen cores a float32 cache's chunk after next too, into L2 (kZen, SegmentAhead's two asks)
        const ChunkAhead then(kc, vc, table, kThenIntoL2 ? start + 2 * chunk : n_tokens, n_tokens, chunk, bs, row_stride, h0, heads, D);
        const float* ksb = c.k_scale;
        const float* vsb = c.v_scale;
        // keys that exist (t < n) and are in the window (start + t >= lo), as all-ones lanes
        const int first = lo > start ? lo - start : 0;
        const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane_ids),
                                                                   _mm256_cmpgt_epi32(lane_ids, _mm256_set1_epi32(first - 1))));
        if constexpr (!std::is_same_v<T, float>) {  // widen the item's heads of each row in one sweep
            for (int t = 0; t < n; ++t) {
                for (int j = 0; j < heads * NV; ++j) {
                    _mm256_storeu_ps(kbuf + (t * heads) * D + 8 * j, load8(c.k + t * row_stride + h0 * D + 8 * j));
                    _mm256_storeu_ps(vbuf + (t * heads) * D + 8 * j, load8(c.v + t * row_stride + h0 * D + 8 * j));
                }
            }
        }
        for (int h = h0; h < h1; ++h) {
            const float* kr;
            const float* vr;
            const int64_t stride = head_rows(c, kbuf, vbuf, h, h0, heads, D, row_stride, kr, vr);
            __m256 kscale = _mm256_set1_ps(1.f), vscale = _mm256_set1_ps(1.f);
            if (ksb) {
                alignas(32) float k8[8] = {}, v8[8] = {};
                for (int t = 0; t < n; ++t) k8[t] = ksb[t * KVH + h], v8[t] = vsb[t * KVH + h];
                kscale = _mm256_load_ps(k8), vscale = _mm256_load_ps(v8);
            }
            for (int g = 0; g < G; ++g) {
                const int i = (h - h0) * G + g;
                next.fetch(i, nh);
                if constexpr (kThenIntoL2) then.fetch<true>(i, nh);
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
                if (softcap > 0.f) {
                    alignas(32) float x[8];
                    _mm256_store_ps(x, scores);
                    for (float& s : x) s = cap_score(s, softcap);
                    scores = _mm256_load_ps(x);
                }
                scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid);
                const float bmax = std::fmax(m[i], modserve::hmax8(scores));
                const float correction = exp_nonpositive(m[i] - bmax);  // ~0 on the first chunk (m = -inf)
                const __m256 p = _mm256_and_ps(modserve::exp256_nonpositive(_mm256_sub_ps(scores, _mm256_set1_ps(bmax))), valid);
                l[i] = l[i] * correction + modserve::hsum8(p);
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

// attend_tile_avx512 with 8 lanes, for CPUs with AVX2 and FMA but no AVX-512: the
// consecutive query rows of a tile (one sequence's) against KV head h, 8 keys (a chunk) at a
// time, both products by key (key_scores, key_pv: q transposed once per tile, 8 row-heads a
// vector; K and V rows in place in a float32 cache, widened once otherwise); the online
// softmax runs on 8 row-heads a vector, each vector one key across the 8 (the causal mask is
// one compare of the row positions, maxima, exps and sums lane-wise). Before it, chunks
// over 16 tokens went to SDPA's flash kernel on such CPUs.
template <typename T, int D>
void attend_tile_avx2(const QIO& io, const int64_t* rows, int n_rows, int32_t first_pos, const T* kc, const T* vc,
                      const float* ks, const float* vs, const int32_t* table, int KVH, int G, int bs, float scale, int h,
                      int window, float softcap) {
    const TileWork<8> w(io, rows, n_rows, first_pos, G, h, D, scale);
    const int R = w.R, R_pad = w.R_pad, groups = R_pad / 8;
    float *qs = w.qs, *acc = w.acc, *sbuf = w.sbuf, *ptile = w.ptile, *m = w.m, *l = w.l, *corrs = w.corrs, *kt = w.kt, *vbuf = w.vbuf;
    const int32_t* rpos = w.rpos;
    static thread_local std::vector<float> q_work;  // qT: [groups][D][8]
    q_work.resize(static_cast<size_t>(R_pad) * D + 8);
    float* qT = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(q_work.data()) + 31) & ~uintptr_t{31});
    tile_transpose<D>(groups, qs, qT, true);
    const int n_keys = first_pos + n_rows;  // the last row sees keys 0 .. first_pos + n_rows - 1
    const int chunk = bs < 8 ? bs : 8;
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    for (int start = window_start(first_pos, window) / chunk * chunk; start < n_keys; start += chunk) {
        const int n = n_keys - start < chunk ? n_keys - start : chunk;
        const TileChunk<T, D> c(kc, vc, ks, vs, slot_of(table, start, bs), KVH, h, n, kt, vbuf);
        tile_scores<TileVec, D>(groups, qT, c.k, c.stride, sbuf);  // by key: two groups of 8 row-heads share each K broadcast
        for (int g0 = 0; g0 < R_pad; g0 += 8) {  // online softmax, 8 row-heads a vector
            __m256 st[8], valid[8];
            for (int t = 0; t < 8; ++t) {  // st[t]: key t's scores across the 8 row-heads
                st[t] = _mm256_mul_ps(_mm256_load_ps(sbuf + (g0 + t) * 8), _mm256_set1_ps(c.k_scale[t]));
                if (softcap > 0.f) {
                    alignas(32) float x[8];
                    _mm256_store_ps(x, st[t]);
                    for (float& v : x) v = cap_score(v, softcap);
                    st[t] = _mm256_load_ps(x);
                }
            }
            const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rpos + g0));
            __m256 rowmax = neg_inf;
            for (int t = 0; t < 8; ++t) {
                // the row sees key start + t: pos >= start + t, and pos < start + t + window
                __m256i ok = _mm256_cmpgt_epi32(pos, _mm256_set1_epi32(start + t - 1));
                if (window > 0) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(_mm256_set1_epi32(start + t + window), pos));
                valid[t] = t < n ? _mm256_castsi256_ps(ok) : _mm256_setzero_ps();
                st[t] = _mm256_blendv_ps(neg_inf, st[t], valid[t]);
                rowmax = _mm256_max_ps(rowmax, st[t]);
            }
            const __m256 m_old = _mm256_load_ps(m + g0);
            const __m256 m_new = _mm256_max_ps(m_old, rowmax);
            // a row that has seen no key yet keeps m = -inf: its rescale is 1, not exp(NaN)
            const __m256 unseen = _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ);
            const __m256 corr = _mm256_blendv_ps(modserve::exp256_nonpositive(_mm256_sub_ps(m_old, m_new)),
                                                 _mm256_set1_ps(1.f), unseen);
            __m256 sum = _mm256_setzero_ps();
            float* pt = ptile + g0 * 8;
            for (int t = 0; t < 8; ++t) {
                const __m256 p = _mm256_and_ps(valid[t], modserve::exp256_nonpositive(_mm256_sub_ps(st[t], m_new)));
                sum = _mm256_add_ps(sum, p);
                _mm256_store_ps(pt + t * 8, _mm256_mul_ps(p, _mm256_set1_ps(c.v_scale[t])));  // int8: V's scales folded in
            }
            _mm256_store_ps(m + g0, m_new);
            _mm256_store_ps(l + g0, _mm256_fmadd_ps(_mm256_load_ps(l + g0), corr, sum));
            _mm256_store_ps(corrs + g0, corr);
        }
        tile_pv<TileVec, D, TileVec::L>(groups, acc, ptile, corrs, c.v, c.stride);  // by key, as the scores
    }
    float* out = qs;  // acc by row-head ([R_pad][D]), where q was
    tile_transpose<D>(groups, acc, out, false);
    for (int rh = 0; rh < R; ++rh) {
        put_head(io, rows[rh / G], static_cast<int64_t>(h * G + rh % G) * D, out + rh * D, D, l[rh]);
    }
}
#endif  // AVX2 without AVX-512

// Where a row split into `parts` parts cuts its n positions: multiples of `align` (16 and
// the block size: a 16-key chunk, and the portable loop's block, never crosses a part),
// `parts` + 1 bounds from 0 to n.
inline int part_bound(int n, int parts, int j, int align) { return j == parts ? n : (n * j / parts) / align * align; }

template <typename T, int FixedD>
void run(const QIO& io, const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
         const int32_t* block_tables, int table_width, const int64_t* rows, const int32_t* row_seq,
         const int32_t* row_pos, int n_rows, int H, int KVH, int D, int bs, float scale, int threads, int window,
         float softcap) {
    const T* kc = static_cast<const T*>(k_cache);
    const bool plain = window <= 0 && softcap <= 0.f;  // the bfloat16-dot variants serve plain layers only
    const T* vc = static_cast<const T*>(v_cache);
    bool tiled = false;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    tiled = FixedD > 0;
#endif
    std::vector<Item> tiles, singles;
    const int tile_rows = std::max(2, kTileRowHeads / (H / KVH));  // 16 at 3 query heads a KV head, 48 at 1, 12 at 4
    for (int i = 0; i < n_rows;) {
        int c = 1;
        while (tiled && i + c < n_rows && c < tile_rows && row_seq[i + c] == row_seq[i] && row_pos[i + c] == row_pos[i] + c) ++c;
        (c > 1 ? tiles : singles).push_back({i, c, 0, KVH});
        i += c;
    }
    std::sort(tiles.begin(), tiles.end(), [&](const Item& a, const Item& b) {
        return row_pos[a.first] + a.count > row_pos[b.first] + b.count;
    });
    std::vector<Item> items;
    for (const Item& t : tiles) {
        for (int h = 0; h < KVH; ++h) items.push_back({t.first, t.count, h, h + 1});
    }
    const int n_singles = static_cast<int>(singles.size());
    const int per_item = n_singles >= 2 * threads ? KVH : 1;  // KV heads per item
    bool dot16 = false;  // lone rows take the bfloat16-dot path (its accumulators interleaved)
#if defined(__AVX512BF16__)
    if constexpr (FixedD > 0 && std::is_same_v<T, uint16_t>) dot16 = io.bf16 && bs >= 2 && plain;
#endif
    const bool split = threads > 1 && per_item == 1 && plain;  // few lone rows: split by positions
    const int align = std::max(16, bs);
    std::vector<SplitRow> split_rows;
    int n_parts = 0;
    for (const Item& r : singles) {
        const int n = row_pos[r.first] + 1;
        const int parts = split ? std::min((threads + n_singles - 1) / n_singles, n / std::max(kMinPart, align)) : 1;
        if (parts >= 2) {
            split_rows.push_back({r.first, parts, n_parts});
            for (int j = 0; j < parts; ++j) {
                items.push_back({r.first, 1, 0, KVH, part_bound(n, parts, j, align), part_bound(n, parts, j + 1, align),
                                 n_parts++});
            }
            continue;
        }
        for (int h0 = 0; h0 < KVH; h0 += per_item) items.push_back({r.first, 1, h0, h0 + per_item});
    }
    // The parts' states: [n_parts][H][D + 2] (accumulators, then running max and sum per head).
    std::vector<float> part_state(static_cast<size_t>(n_parts) * H * (D + 2));
    const auto partial = [&](int k) {
        float* base = part_state.data() + static_cast<size_t>(k) * H * (D + 2);
        return Partial{base, base + H * D, base + H * D + H};
    };
    const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t k = 0; k < n_items; ++k) {
        const Item it = items[k];
        const int i = it.first;
        const int32_t* table = block_tables + static_cast<int64_t>(row_seq[i]) * table_width;
        const Partial part_of_row = it.part >= 0 ? partial(it.part) : Partial{};
        const Partial* part = it.part >= 0 ? &part_of_row : nullptr;
#if defined(__AVX512F__)
        if constexpr (FixedD > 0) {
            if (it.count > 1) {
#if defined(__AVX512BF16__)
                if constexpr (std::is_same_v<T, uint16_t>) {
                    if (io.bf16 && plain) {
                        attend_tile_bf16dot<FixedD>(io, rows + i, it.count, row_pos[i], kc, vc, table, KVH, H / KVH, bs,
                                                    scale, it.h0);
                        continue;
                    }
                }
#endif
                attend_tile_avx512<T, FixedD>(io, rows + i, it.count, row_pos[i], kc, vc, k_scale, v_scale, table, KVH,
                                              H / KVH, bs, scale, it.h0, window, softcap);
            } else {
#if defined(__AVX512BF16__)
                if constexpr (std::is_same_v<T, uint16_t>) {
                    if (dot16) {
                        attend_bf16dot<FixedD>(io, rows[i], kc, vc, table, row_pos[i], KVH, H / KVH, bs, scale, it.h0,
                                               it.h1, it.from, it.to, part);
                        continue;
                    }
                }
#endif
                if (plain) {
                    attend_segments<T, FixedD>(io, rows[i], kc, vc, k_scale, v_scale, table, row_pos[i], KVH, H / KVH, bs, scale,
                                               it.h0, it.h1, it.from, it.to, part);
                    continue;
                }
                attend_avx512<T, FixedD>(io, rows[i], kc, vc, k_scale, v_scale, table, row_pos[i], KVH, H / KVH, bs,
                                         scale, it.h0, it.h1, window, softcap, it.from, it.to, part);
            }
            continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        if constexpr (FixedD > 0) {
            if (it.count > 1) {
                attend_tile_avx2<T, FixedD>(io, rows + i, it.count, row_pos[i], kc, vc, k_scale, v_scale, table, KVH,
                                            H / KVH, bs, scale, it.h0, window, softcap);
            } else {
                attend_avx2<T, FixedD>(io, rows[i], kc, vc, k_scale, v_scale, table, row_pos[i], KVH, H / KVH, bs, scale,
                                       it.h0, it.h1, window, softcap, it.from, it.to, part);
            }
            continue;
        }
#endif
        attend<T, FixedD>(io, rows[i], kc, vc, k_scale, v_scale, table, row_pos[i], KVH, H / KVH, D, bs, scale,
                          it.h0, it.h1, window, softcap, it.from, it.to, part);
    }
    for (const SplitRow& r : split_rows) {
        std::vector<Partial> parts;
        for (int j = 0; j < r.parts; ++j) parts.push_back(partial(r.first_part + j));
        merge_parts(io, rows[r.row], parts.data(), r.parts, H, D, dot16);
    }
}

}  // namespace

// The step's new K/V rows into their cache slots (a slot is a row of the [blocks * bs] rows;
// -1 marks a padding row, whose K/V is not kept).
template <typename T>
void write_new_rows(void* k_cache, void* v_cache, const void* k_new, const void* v_new, int64_t k_stride,
                    int64_t v_stride, const int64_t* slots, int n_new, int64_t row_elems, int threads) {
    T* kc = static_cast<T*>(k_cache);
    T* vc = static_cast<T*>(v_cache);
    const T* kn = static_cast<const T*>(k_new);
    const T* vn = static_cast<const T*>(v_new);
#pragma omp parallel for num_threads(threads) schedule(static) if (n_new >= 64)
    for (int i = 0; i < n_new; ++i) {
        if (slots[i] < 0) continue;  // a padding row (slot -1): nothing to keep
        std::memcpy(kc + slots[i] * row_elems, kn + i * k_stride, row_elems * sizeof(T));
        std::memcpy(vc + slots[i] * row_elems, vn + i * v_stride, row_elems * sizeof(T));
    }
}

// The step's new K/V rows (float32 or bfloat16, T) into an int8 cache: per token and head, the
// scale max|x| / 127 (at least 1e-8 / 127) and the codes round(x / scale), clamped to +-127:
// core/kv_quant.py's quantize_per_token_head, bit for bit, so a decode step stays one kernel
// call (recordable) instead of torch's quantize and index_copy_.
template <typename T>
void write_new_rows_int8(void* k_cache, void* v_cache, float* k_scale, float* v_scale, const void* k_new,
                         const void* v_new, int64_t k_stride, int64_t v_stride, const int64_t* slots, int n_new, int KVH,
                         int D, int threads) {
    const auto quantize = [&](const T* x, int8_t* q, float* scale) {
        float amax = 0.f;
        for (int d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(load(x, d)));
        const float s = std::fmax(amax, 1e-8f) / 127.f;
        for (int d = 0; d < D; ++d) q[d] = static_cast<int8_t>(std::fmin(std::fmax(std::nearbyint(load(x, d) / s), -127.f), 127.f));
        *scale = s;
    };
#pragma omp parallel for num_threads(threads) schedule(static) if (n_new >= 64)
    for (int i = 0; i < n_new; ++i) {
        if (slots[i] < 0) continue;  // a padding row (slot -1): nothing to keep
        for (int h = 0; h < KVH; ++h) {
            const int64_t at = slots[i] * KVH + h;
            quantize(static_cast<const T*>(k_new) + i * k_stride + h * D, static_cast<int8_t*>(k_cache) + at * D, k_scale + at);
            quantize(static_cast<const T*>(v_new) + i * v_stride + h * D, static_cast<int8_t*>(v_cache) + at * D, v_scale + at);
        }
    }
}

template <typename T>
int dispatch_head_dim(const QIO& io, const void* k_cache, const void* v_cache, const float* k_scale,
                      const float* v_scale, const int32_t* block_tables, int table_width, const int64_t* rows,
                      const int32_t* row_seq, const int32_t* row_pos, int n_rows, int H, int KVH, int D, int bs,
                      float scale, int threads, int window, float softcap) {
    auto go = [&](auto fixed) {
        run<T, decltype(fixed)::value>(io, k_cache, v_cache, k_scale, v_scale, block_tables, table_width, rows, row_seq,
                                       row_pos, n_rows, H, KVH, D, bs, scale, threads, window, softcap);
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

// 1 where runs of query rows of head_dim D take the tiled AVX-512 path: then prefill chunks
// are faster here than in SDPA (the backend's max_query_len default follows this).
int modserve_tiled(int D) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return D == 64 || D == 128;
#else
    (void)D;
    return 0;
#endif
}

// dtype: the cache's, 0 float32, 1 bfloat16, 2 int8 (k_scale / v_scale required).
// q and out: [T, H, D] in float32 (io_bf16 0) or bfloat16 (1), heads contiguous, q_stride /
// out_stride elements between tokens; only the token rows listed in `rows` are read and
// written. A bfloat16 q over a bfloat16 cache lets decode rows use bfloat16 dot products
// (P.V then uses the weights rounded to bfloat16). k_new / v_new: n_new rows [KVH, D] in
// the cache's dtype (an int8 cache: in q's, quantized here), written to their `slots` before
// any row attends. window > 0:
// a row at position p sees positions > p - window only; softcap > 0: scores capped at
// softcap * tanh(s / softcap) (0 for either: plain causal attention).
int modserve_paged_attention(int dtype, int io_bf16, const void* q, int64_t q_stride, void* out, int64_t out_stride,
                             void* k_cache, void* v_cache, const float* k_scale, const float* v_scale,
                             const void* k_new, const void* v_new, int64_t k_new_stride, int64_t v_new_stride,
                             const int64_t* slots, int n_new, const int32_t* block_tables, int table_width,
                             const int64_t* rows, const int32_t* row_seq, const int32_t* row_pos, int n_rows, int H,
                             int KVH, int D, int bs, float scale, int threads, int window, float softcap) {
    if (H % KVH || H / KVH > kMaxGroup || D > kMaxHeadDim || bs > kMaxBlock) return 1;
    if (n_new > 0 && (!k_new || !v_new || !slots)) return 4;
    const QIO io{q, out, q_stride, out_stride, io_bf16 != 0};
    const int64_t row_elems = static_cast<int64_t>(KVH) * D;
    switch (dtype) {
        case 0:
            write_new_rows<float>(k_cache, v_cache, k_new, v_new, k_new_stride, v_new_stride, slots, n_new, row_elems,
                                  threads);
            return dispatch_head_dim<float>(io, k_cache, v_cache, nullptr, nullptr, block_tables, table_width, rows,
                                            row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads, window, softcap);
        case 1:
            write_new_rows<uint16_t>(k_cache, v_cache, k_new, v_new, k_new_stride, v_new_stride, slots, n_new,
                                     row_elems, threads);
            return dispatch_head_dim<uint16_t>(io, k_cache, v_cache, nullptr, nullptr, block_tables, table_width, rows,
                                               row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads, window, softcap);
        case 2:
            if (!k_scale || !v_scale) return 2;
            if (io_bf16) {
                write_new_rows_int8<uint16_t>(k_cache, v_cache, const_cast<float*>(k_scale), const_cast<float*>(v_scale),
                                              k_new, v_new, k_new_stride, v_new_stride, slots, n_new, KVH, D, threads);
            } else {
                write_new_rows_int8<float>(k_cache, v_cache, const_cast<float*>(k_scale), const_cast<float*>(v_scale), k_new,
                                           v_new, k_new_stride, v_new_stride, slots, n_new, KVH, D, threads);
            }
            return dispatch_head_dim<int8_t>(io, k_cache, v_cache, k_scale, v_scale, block_tables, table_width, rows,
                                             row_seq, row_pos, n_rows, H, KVH, D, bs, scale, threads, window, softcap);
    }
    return 3;
}
}

MODSERVE_PACKED(modserve_paged_attention) {
    using modserve::packed::f32;
    using modserve::packed::ptr;
    return modserve_paged_attention(
        a[0], a[1], ptr<const void*>(a[2]), a[3], ptr<void*>(a[4]), a[5], ptr<void*>(a[6]), ptr<void*>(a[7]),
        ptr<const float*>(a[8]), ptr<const float*>(a[9]), ptr<const void*>(a[10]), ptr<const void*>(a[11]), a[12], a[13],
        ptr<const int64_t*>(a[14]), a[15], ptr<const int32_t*>(a[16]), a[17], ptr<const int64_t*>(a[18]),
        ptr<const int32_t*>(a[19]), ptr<const int32_t*>(a[20]), a[21], a[22], a[23], a[24], a[25], f32(a[26]), a[27], a[28],
        f32(a[29]));
}
