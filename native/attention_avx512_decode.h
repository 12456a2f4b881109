// Decode rows with AVX-512: attend_avx512 (windows, soft-caps), the segment sweeps over float32,
// bfloat16 and int8 caches (attend_segments), and a bfloat16 model's rows by VDPBF16PS
// (attend_bf16dot), with what they ask for ahead (SegmentAhead).
#pragma once

#include "attention_rows.h"

namespace modserve::paged_attention {

#if defined(__AVX512F__)
// The 16 scores of a chunk, one a lane, from dot(t): key t's products as a vector of partial
// sums (lanes n.. are 0). A full chunk's keys come in pairs, each pair folded at once
// (transpose_sum16's first step), so few vectors stay live and the chunk runs in
// registers; the loop of runtime length n kept all 16 on the stack (the bf16 decode path
// 1.09x, 256 rows x 350 tokens from memory; 1.2x from L3).
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
// The next chunk's rows are asked for while this one computes, a few lines at each query head
// (ChunkAhead; an earlier trial measured nothing because GCC had dropped its _mm_prefetch calls).
// attend_bf16dot below serves a bfloat16 model's rows over a bfloat16 cache.
template <typename T, int D>
void attend_avx512(const QIO& io, int64_t token, const T* kc, const T* vc, const float* ks, const float* vs,
                   const int32_t* table, int32_t pos, int KVH, int G, int bs, float scale, int h0, int h1,
                   int window, float softcap, int from = 0, int to = -1, const Partial* part = nullptr) {
    using modserve::exp512_nonpositive;
    constexpr int NV = D / 16;  // vectors per row
    const int heads = h1 - h0;
    const int nh = heads * G;
    const int64_t row_stride = static_cast<int64_t>(KVH) * D;
    const RowWork<16> w(io, token, h0, heads, G, D, scale);
    float *qs = w.qs, *acc = w.acc, *m = w.m, *l = w.l;
    const int n_tokens = to < 0 ? pos + 1 : to;  // the end of this call's positions
    const int chunk = bs < 16 ? bs : 16;  // block sizes are powers of two: a chunk never crosses a block
    const int lo = window_start(pos, window);
    for (int start = std::max(lo / chunk * chunk, from); start < n_tokens; start += chunk) {
        const int n = n_tokens - start < chunk ? n_tokens - start : chunk;
        const ChunkRows<T> c = chunk_rows(kc, vc, ks, vs, table, start, bs, KVH, row_stride);
        ChunkAhead<> next(kc, vc, table, start + chunk, n_tokens, chunk, bs, row_stride, h0, heads, D, nh);
        const float* ksb = c.k_scale;
        const float* vsb = c.v_scale;
        // keys that exist (t < n) and are in the window (start + t >= lo)
        const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << (lo > start ? lo - start : 0)) - 1u));
        w.widen(c, n, h0, heads, D, row_stride);
        for (int h = h0; h < h1; ++h) {
            const float* kr;
            const float* vr;
            const int64_t stride = head_rows(c, w.kbuf, w.vbuf, h, h0, heads, D, row_stride, kr, vr);
            __m512 kscale = _mm512_set1_ps(1.f), vscale = _mm512_set1_ps(1.f);
            if (ksb) {
                alignas(64) float k16[16] = {}, v16[16] = {};
                for (int t = 0; t < n; ++t) k16[t] = ksb[t * KVH + h], v16[t] = vsb[t * KVH + h];
                kscale = _mm512_load_ps(k16), vscale = _mm512_load_ps(v16);
            }
            for (int g = 0; g < G; ++g) {
                const int i = (h - h0) * G + g;
                next.step();
                __m512 qv[NV];
                for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qs + i * D + 16 * j);
                __m512 scores = chunk_scores(n, [&](int t) {
                    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr + t * stride));
                    for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + t * stride + 16 * j), s);
                    return s;
                });
                scores = _mm512_mul_ps(scores, kscale);
                if (softcap > 0.f) scores = cap_lanes(scores, softcap);
                scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), scores);
                const float bmax = std::fmax(m[i], _mm512_reduce_max_ps(scores));
                const float correction = exp_nonpositive(m[i] - bmax);  // ~0 on the first chunk (m = -inf)
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(bmax))));
                l[i] = std::fma(l[i], correction, _mm512_reduce_add_ps(p));  // fused, as GCC had contracted it
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
// current one (their rows' lines for the item's heads), while this chunk and the next compute
// (the hardware prefetchers stop at each scattered block). Two ahead rather than one: over
// scattered blocks, 0.88x the time at 64 rows x 450 positions, 0.81x at 16 rows, 0.93x at one
// (the bfloat16-dot path). The scores sweep reads its K chunks, then the P.V sweep the
// segment's V chunks, then the next segment's K chunks.
//
// Two asks (asks<true>): the next chunk into L1 and the one after into L2 only
// (prefetch_line<true>), so each line twice; on a Zen 4 (AMD EPYC family 25) at 43 rows x 320
// positions, attend_bf16dot took 0.70x the time of asking for both into L1 (both into L2:
// 0.71x; only the one after next, into L2: 0.79x; into L1: 1.09x), attend_segments 0.64x
// (float32 cache) and 0.71x (bfloat16) the time of one ask, but 1.06x over an int8 cache. One
// ask (asks<false>): only the chunk after next, into L1, each line once, which on Cascade Lake
// took 0.87-0.95x the time of asking for both into L1 (float32, int8 and bfloat16 caches,
// blocks in order or scattered). attend_bf16dot always asks twice (AVX512_BF16 CPUs: Zen 4 / 5
// and the AMX Xeons); attend_segments asks twice on Zen cores (kZen) over float32 and bfloat16
// caches, else once.
//
// A chunk's asks are spread over the steps of the current chunk's sweep (Asks::step, walking
// AheadLines): a few lines at each query head, or, over a float32 cache on a Zen core, at each
// key (attend_segments' kAskByKey; other cores were not measured, and ask at each query head
// as their shares of rows did). In bursts of a ninth of a chunk (each query head's share), the
// asks over a float32 cache filled the miss buffers and stalled the loop at the prefetch
// instructions: a third of the samples in a profile (Zen 4, 64 rows x 300 positions, blocks
// scattered). Asked at each key, the same lines took 0.90x the time there, 0.77x with blocks
// in order, 0.95x at one row x 1,000 positions (2 threads, 30 layers' caches). Over bfloat16
// and int8 caches, whose loops spend longer per key on widening, asking at each key took
// 1.02-1.19x the time; they ask at each query head.
template <typename T>
struct SegmentAhead {
    struct Rows {
        const char* base;
        int rows;
    };
    const T* kc;
    const T* vc;
    const int32_t* table;
    int bs, chunk, n_tokens, lines_per_row;
    int64_t row_stride, first;  // elements between cache rows; the item's first element of a row

    SegmentAhead(const T* kc, const T* vc, const int32_t* table, int bs, int chunk, int n_tokens, int h0, int heads, int D,
                 int64_t row_stride)
        : kc(kc), vc(vc), table(table), bs(bs), chunk(chunk), n_tokens(n_tokens),
          lines_per_row(lines_of_heads<T>(heads, D)), row_stride(row_stride), first(static_cast<int64_t>(h0) * D) {}
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
    // One chunk's asks, given the chunk after the current one (next) and the one after that
    // (then), spread over `steps` steps of the current chunk's sweep: step() at each, rest()
    // after the chunk. Two asks or one (above).
    template <bool TwoAsks>
    struct Asks {
        AheadLines<false> l1;  // two asks: the next chunk; one ask: the chunk after next
        AheadLines<true> l2;   // two asks: the chunk after next, into L2 only
        int per;  // lines a step, of each
        void step() {
            l1.ask(per);
            if constexpr (TwoAsks) l2.ask(per);
        }
        void rest() {
            l1.ask(l1.count());
            if constexpr (TwoAsks) l2.ask(l2.count());
        }
    };
    template <bool TwoAsks>
    Asks<TwoAsks> asks(const Rows& next, const Rows& then, int steps) const {
        const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
        const Rows& into_l1 = TwoAsks ? next : then;
        const AheadLines<false> l1{into_l1.base, into_l1.rows, 0, lines_per_row, row_bytes};
        const AheadLines<true> l2{then.base, TwoAsks ? then.rows : 0, 0, lines_per_row, row_bytes};
        return {l1, l2, lines_a_step(std::max(l1.count(), l2.count()), steps)};
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

// A chunk's V rows of one head (`v`, rows `stride` apart) interleaved pairwise for VDPBF16PS:
// for key pair u (rows 2u and 2u + 1) and each 32-element vector j of the row, the two rows'
// elements in unpacklo / unpackhi order, 64 at out + (u * NB + j) * 64. Rows from n on read as
// zeros (their weights are 0). attend_bf16dot and the bfloat16 tile (attend_tile_bf16dot).
template <int D>
inline void interleave_pairs(const uint16_t* v, int64_t stride, int n, int pairs, uint16_t* out) {
    constexpr int NB = D / 32;
    for (int u = 0; u < pairs; ++u) {
        for (int j = 0; j < NB; ++j) {
            const __m512i a = 2 * u < n ? _mm512_loadu_si512(v + 2 * u * stride + 32 * j) : _mm512_setzero_si512();
            const __m512i b = 2 * u + 1 < n ? _mm512_loadu_si512(v + (2 * u + 1) * stride + 32 * j) : _mm512_setzero_si512();
            uint16_t* dst = out + (u * NB + j) * 64;
            _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi16(a, b));
        }
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
    const SegmentAhead<uint16_t> ahead(kc, vc, table, bs, chunk, n_tokens, h0, heads, D, row_stride);
    for (int seg = from; seg < n_tokens; seg += kSegment) {
        const int seg_n = std::min(kSegment, n_tokens - seg);
        for (int c = 0; c < seg_n; c += chunk) {  // (1) scores
            const int n = std::min(chunk, seg_n - c);
            const uint16_t* kb = ahead.rows_at(kc, seg + c);
            auto asks = ahead.template asks<true>(ahead.after_k(seg, seg_n, c, 1), ahead.after_k(seg, seg_n, c, 2), nh);
            for (int i = 0; i < nh; ++i) {
                asks.step();
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
            asks.rest();
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
            auto asks = ahead.template asks<true>(ahead.after_v(seg, seg_n, c, 1), ahead.after_v(seg, seg_n, c, 2), nh);
            for (int hh = 0; hh < heads; ++hh) {
                const int64_t col = static_cast<int64_t>(h0 + hh) * D;
                interleave_pairs<D>(vb + col, row_stride, n, pairs, vi);
                for (int g = 0; g < G; ++g) {
                    const int i = hh * G + g;
                    asks.step();
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
            asks.rest();
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
    const SegmentAhead<T> ahead(kc, vc, table, bs, chunk, n_tokens, h0, heads, D, row_stride);
    constexpr bool kTwoAsks = kZen && !std::is_same_v<T, int8_t>;  // SegmentAhead
    constexpr bool kAskByKey = kZen && std::is_same_v<T, float>;  // SegmentAhead::Asks
    for (int seg = from; seg < n_tokens; seg += kSegment) {
        const int seg_n = std::min(kSegment, n_tokens - seg);
        for (int c = 0; c < seg_n; c += chunk) {  // (1) scores
            const int n = std::min(chunk, seg_n - c);
            const ChunkRows<T> rows = chunk_rows(kc, vc, ks, vs, table, seg + c, bs, KVH, row_stride);
            auto asks = ahead.template asks<kTwoAsks>(ahead.after_k(seg, seg_n, c, 1), ahead.after_k(seg, seg_n, c, 2),
                                                      kAskByKey ? nh * n : nh);
            for (int i = 0; i < nh; ++i) {
                if constexpr (!kAskByKey) asks.step();
                const int h = h0 + i / G;
                int64_t kstride;
                const float* kh = head_rows16<T, D>(rows.k + static_cast<int64_t>(h) * D, row_stride, n, i % G == 0, kbuf, kstride);
                __m512 qv[NV];
                for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qs + i * D + 16 * j);
                __m512 scores = chunk_scores(n, [&](int t) {
                    if constexpr (kAskByKey) asks.step();
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
            asks.rest();
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
            auto asks = ahead.template asks<kTwoAsks>(ahead.after_v(seg, seg_n, c, 1), ahead.after_v(seg, seg_n, c, 2),
                                                      kAskByKey ? nh * (n / 2) : nh);
            for (int i = 0; i < nh; ++i) {
                if constexpr (!kAskByKey) asks.step();
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
                    if constexpr (kAskByKey) asks.step();
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
            asks.rest();
        }
    }
    if (!keep_part(part, nh, D, acc, m, l)) finish_heads(io, token, h0 * G, nh, D, acc, l);
}

#endif  // __AVX512F__

}  // namespace modserve::paged_attention
