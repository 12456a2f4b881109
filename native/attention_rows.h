// What every path of the CPU paged-attention kernel (cpu_paged_attention.cpp) shares: its
// limits, where a step's query rows come from and its outputs go (QIO), a split row's partial
// state, where a chunk of cache positions lies, and the asks for the next chunk's rows.
#pragma once

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
#include "prefetch.h"

namespace modserve::paged_attention {

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

// cap_score() on each float lane of a vector V (__m256, __m512): the vector paths' soft-cap.
template <typename V>
inline V cap_lanes(V s, float cap) {
    float x[sizeof(V) / sizeof(float)];
    std::memcpy(x, &s, sizeof s);
    for (float& v : x) v = cap_score(v, cap);
    std::memcpy(&s, x, sizeof s);
    return s;
}

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

// One part of a decode row split by positions (run() in cpu_paged_attention.cpp): its heads'
// accumulators (the bfloat16-dot path's interleaved order), running maxima and sums, merged
// with the row's other parts afterwards.
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

// A vector decode row's working memory (attend_avx512, attend_avx2: L keys a chunk, the build's
// vector width), its query heads started (start_heads), and the buffers a bfloat16 or int8
// chunk's K and V rows of the item's heads are widened into, once for all their query heads
// (a float32 cache's are read in place: head_rows).
template <int L>
struct RowWork {
    float* qs;    // [nh][D], pre-scaled
    float* acc;   // [nh][D]
    float* m;     // [nh] running max
    float* l;     // [nh] running sum of weights
    float* kbuf;  // [L][heads][D]: the item's K rows of a chunk, as float32
    float* vbuf;  // [L][heads][D]
    RowWork(const QIO& io, int64_t token, int h0, int heads, int G, int D, float scale) {
        static thread_local std::vector<float> work;
        const int nh = heads * G;
        work.resize(static_cast<size_t>(nh) * (2 * D + 2) + 2 * L * heads * D);
        qs = work.data(), acc = qs + nh * D, m = acc + nh * D, l = m + nh, kbuf = l + nh, vbuf = kbuf + L * heads * D;
        start_heads(io, token, h0 * G, nh, D, scale, qs, acc, m, l);
    }
    // A chunk's n rows of the item's heads as float32 into kbuf and vbuf, in one sweep (nothing
    // to do over a float32 cache).
    template <typename T>
    void widen(const ChunkRows<T>& c, int n, int h0, int heads, int D, int64_t row_stride) const {
        if constexpr (!std::is_same_v<T, float>) {
            for (int t = 0; t < n; ++t) {
                for (int j = 0; j < heads * D / L; ++j) {
                    widen_lanes(kbuf + (t * heads) * D + L * j, c.k + t * row_stride + h0 * D + L * j);
                    widen_lanes(vbuf + (t * heads) * D + L * j, c.v + t * row_stride + h0 * D + L * j);
                }
            }
        }
    }
    template <typename T>
    static void widen_lanes(float* to, const T* from) {
#if defined(__AVX512F__)
        if constexpr (L == 16) _mm512_storeu_ps(to, modserve::load16(from));
#endif
#if defined(__AVX2__)
        if constexpr (L == 8) _mm256_storeu_ps(to, modserve::load8(from));
#endif
    }
};

// An AMD Zen core: its decode loops ask for more ahead, into L2 (SegmentAhead, ChunkAhead).
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr bool kZen = true;  // GCC names the core for -march=native (GCC 12 calls a Zen 4 znver3)
#else
constexpr bool kZen = false;
#endif

// Rows ahead of a decode loop, asked for a few 64-byte lines at a time (ask): `rows` cache
// rows from `row`, `row_bytes` apart, each `per_row` lines (the item's heads). A cursor, so a
// chunk's asks spread over the steps of the loop's work on the current one, with no
// divisions: asked in one burst, a chunk's lines filled the miss buffers and stalled the loop
// at the prefetch instructions (SegmentAhead). IntoL2: prefetch_line<true>.
template <bool IntoL2>
struct AheadLines {
    const char* row = nullptr;
    int rows = 0, line = 0, per_row = 0;
    int64_t row_bytes = 0;
    int count() const { return rows * per_row; }
    // Asks for up to k lines; returns how many of the k were left (no rows left)
    int ask(int k) {
        for (; k > 0 && rows > 0; --k) {
            modserve::prefetch_line<IntoL2>(row + 64 * line);
            if (++line == per_row) line = 0, row += row_bytes, --rows;
        }
        return k;
    }
};

// 64-byte lines of a cache row's `heads` heads of D elements of T (a partial line counts)
template <typename T>
inline int lines_of_heads(int heads, int D) {
    return static_cast<int>((static_cast<int64_t>(heads) * D * static_cast<int64_t>(sizeof(T)) + 63) / 64);
}

// Lines to ask for at each of `steps` steps so that `lines` are asked for by the last
inline int lines_a_step(int lines, int steps) { return (lines + steps - 1) / std::max(steps, 1); }

// The chunk at `at` (its K rows, then its V rows, for the item's heads), asked for while the
// current chunk computes, over `steps` steps of its work (step(), one a query head): without
// it the compute and the memory stalls added up, and a burst of a whole chunk's lines at once
// measured nothing. One chunk ahead, 64 rows x 450 positions of a float32 cache (30 layers,
// Zen 5): the AVX2 path 1.7-1.8x faster (36-37 against 64-66 ms a step; 41-43 against 72-73
// with scattered blocks), the AVX-512 one 1.15-1.35x; two or three chunks ahead gained less.
// The AVX2 path on a Zen core asks for a float32 cache's chunk after next as well, into L2
// (ChunkAhead<true>): on a Zen 4 built for AVX2, 1.41-1.55x faster at 4-64 rows; over bfloat16
// and int8 caches (whose widening bounds the loop) 0.95-0.99x, so they do not. Asking at each
// key rather than each query head (as SegmentAhead does over a float32 cache on Zen cores)
// took 1.04-1.47x the time on the AVX2 path. The cursor replaced shares of whole rows (two
// divisions a query head): on a Zen 4, the AVX2 build over a float32 cache 0.86x the time at 64
// and 16 rows x 300 positions, blocks scattered; bfloat16 0.95-1.00x, int8 level.
template <bool IntoL2 = false>
struct ChunkAhead {
    AheadLines<IntoL2> k, v;
    int per = 0;  // lines a step
    template <typename T>
    ChunkAhead(const T* kc, const T* vc, const int32_t* table, int at, int n_tokens, int chunk, int bs,
               int64_t row_stride, int h0, int heads, int D, int steps) {
        if (at >= n_tokens) return;
        const int64_t first = slot_of(table, at, bs) * row_stride + static_cast<int64_t>(h0) * D;
        const int rows = std::min(chunk, n_tokens - at);
        const int per_row = lines_of_heads<T>(heads, D);
        const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
        k = {reinterpret_cast<const char*>(kc + first), rows, 0, per_row, row_bytes};
        v = {reinterpret_cast<const char*>(vc + first), rows, 0, per_row, row_bytes};
        per = lines_a_step(2 * rows * per_row, steps);
    }
    void step() { v.ask(k.ask(per)); }
};

}  // namespace modserve::paged_attention
