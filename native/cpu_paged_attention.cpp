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
// consecutive rows take the AVX-512 paths (docs/cpu_attention.md), and with AVX2 and FMA
// but no AVX-512, decode rows take attend_avx2 and tiles attend_tile at 8 lanes.
//
// Per layer (Gemma, Mistral): a sliding window `window` > 0 limits the token at position p to
// positions > p - window (the loops start at the window's first chunk and mask the rest), and
// `softcap` > 0 turns each scaled score s into softcap * tanh(s / softcap) before the mask and
// the softmax. The bfloat16-dot variants take neither: such layers use the float32 paths.
//
// The paths, one header each: attention_rows.h (what they share), attention_portable.h,
// attention_avx512_decode.h, attention_tiles.h (the float32 tiles, either width),
// attention_avx512_tiles.h (the bfloat16 tile), attention_avx2.h. This file deals a step's rows out to them (run)
// and holds the entry points.

#include "attention_avx2.h"
#include "attention_avx512_tiles.h"
#include "attention_portable.h"
#include "packed_call.h"

namespace {

using namespace modserve::paged_attention;
using modserve::exp_nonpositive;

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
    // lone rows too, the most positions first (the items are dealt out dynamically: a long row
    // dealt last kept one thread busy after the others were done)
    std::stable_sort(singles.begin(), singles.end(), [&](const Item& a, const Item& b) { return row_pos[a.first] > row_pos[b.first]; });
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
                attend_tile<T, FixedD>(io, rows + i, it.count, row_pos[i], kc, vc, k_scale, v_scale, table, KVH, H / KVH, bs,
                                       scale, it.h0, window, softcap);
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
                attend_tile<T, FixedD>(io, rows + i, it.count, row_pos[i], kc, vc, k_scale, v_scale, table, KVH, H / KVH, bs,
                                       scale, it.h0, window, softcap);
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
