// A mixture-of-experts MLP (Mixtral, Qwen3-MoE) in one call, on AVX512_BF16: routing, every
// picked expert's SiLU-gated MLP, and the weighted sum, from the router's bfloat16 logits.
//
// Why: torch's grouped product (or a loop over experts) ran Qwen3-30B-A3B's expert shapes
// (hidden 2,048, 128 experts of width 768, top 8) at one token in 3.2-4.2 ms a layer on a Zen
// 5, reading the 75 MB of picked weights at a quarter of the machine's read bandwidth (this
// kernel: 1.25 ms, 75%; docs/cpu_experts.md); it sizes its expert batches on the host
// (counts.tolist()), so a decode step with experts could not replay as a call list. Here the experts' products are the AVX512_BF16 panel kernel's
// (avx512_bf16_panels.h), the weights packed per expert as cpu_avx512_linear packs a layer's.
//
// The steps, in one OpenMP region:
//   1. route: each token's softmax over the experts in float32, its top k (ties to the lower
//      expert), renormalized over those k if asked, the weights rounded to bfloat16: the
//      model's own routing (HF's Mixtral and Qwen3-MoE);
//   2. each token's row copied once per picked expert into the expert's rows (experts in
//      order, tokens in order within one);
//   3. every picked expert's (gate, up) panel pairs, then its down panels, as one list of units
//      split over the threads by weight (an expert's rows plus the cost of streaming its panel);
//   4. each token's output: its experts' outputs in expert order, each times its bfloat16
//      weight, added to a bfloat16 sum: the rounding of the reference (out *= weight, then
//      index_add_ into bfloat16 zeros), so results equal it up to the products' float32
//      summation order.
#include <cstdint>
#include <cstring>

#include "packed_call.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <omp.h>

#include <cmath>
#include <vector>

#include "avx512_bf16_panels.h"
#include "bf16.h"

namespace {

constexpr int64_t kStreamRows = 4;  // a panel's weight stream, in rows of products (the split's unit cost)

// Token t's route: its top-k experts in ascending order and their bfloat16 weights (as float32).
// `probs` and `taken` are E floats and flags of scratch.
void route(const uint16_t* logits, int E, int k, bool renormalize, float* probs, uint8_t* taken, int32_t* ids, float* weights) {
    float top = -INFINITY;
    for (int e = 0; e < E; ++e) top = std::fmax(top, modserve::bf16_to_float(logits[e]));
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += probs[e] = std::exp(modserve::bf16_to_float(logits[e]) - top);
    for (int e = 0; e < E; ++e) {
        probs[e] /= sum;
        taken[e] = 0;
    }
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {  // the j-th largest; an equal probability goes to the lower expert
        int best = -1;
        for (int e = 0; e < E; ++e)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        ids[j] = best;
        weights[j] = probs[best];
        picked += probs[best];
        taken[best] = 1;
    }
    for (int j = 0; j < k; ++j) {
        const float w = renormalize ? weights[j] / picked : weights[j];
        weights[j] = modserve::bf16_to_float(modserve::float_to_bf16(w));
    }
    for (int j = 1; j < k; ++j)  // ascending experts: the order the outputs are summed in
        for (int i = j; i > 0 && ids[i] < ids[i - 1]; --i) {
            std::swap(ids[i], ids[i - 1]);
            std::swap(weights[i], weights[i - 1]);
        }
}

// Which experts have rows, where their rows start, and each copy's token.
struct Plan {
    std::vector<int32_t> active;  // experts with at least one row, ascending
    std::vector<int64_t> start;   // [E + 1]: expert e's rows are [start[e], start[e + 1])
    std::vector<int64_t> copy;    // [T * k]: token t's j-th expert's row, in the experts' rows
    std::vector<int64_t> token;   // [T * k]: each row's token
};

Plan plan(const int32_t* ids, int64_t T, int E, int k) {
    Plan p;
    p.start.assign(E + 1, 0);
    p.copy.resize(T * k);
    p.token.resize(T * k);
    for (int64_t i = 0; i < T * k; ++i) ++p.start[ids[i] + 1];
    for (int e = 0; e < E; ++e) {
        if (p.start[e + 1]) p.active.push_back(e);
        p.start[e + 1] += p.start[e];
    }
    std::vector<int64_t> next(p.start.begin(), p.start.end() - 1);
    for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
            const int64_t row = next[ids[t * k + j]]++;
            p.copy[t * k + j] = row;
            p.token[row] = t;
        }
    return p;
}

// Thread t of nt: run(e, u0, u1) for its units of the active experts, `units` per expert, each
// weighing its expert's rows plus kStreamRows; the threads' shares are equal in weight.
template <typename Run>
void share(int t, int nt, const Plan& p, int64_t units, const Run& run) {
    int64_t total = 0;
    for (const int e : p.active) total += (p.start[e + 1] - p.start[e] + kStreamRows) * units;
    // The first unit at or after weight `at`, as (active index, unit).
    auto unit_at = [&](int64_t at) {
        int64_t before = 0;
        for (size_t i = 0; i < p.active.size(); ++i) {
            const int e = p.active[i];
            const int64_t cost = p.start[e + 1] - p.start[e] + kStreamRows;
            if (at < before + cost * units) return static_cast<int64_t>(i) * units + (at - before + cost - 1) / cost;
            before += cost * units;
        }
        return static_cast<int64_t>(p.active.size()) * units;
    };
    const int64_t g0 = unit_at(total * t / nt), g1 = t + 1 == nt ? static_cast<int64_t>(p.active.size()) * units : unit_at(total * (t + 1) / nt);
    for (int64_t g = g0; g < g1;) {
        const int64_t i = g / units, u0 = g % units, u1 = g1 - i * units < units ? g1 - i * units : units;
        run(p.active[i], u0, u1);
        g = i * units + u1;
    }
}

// 16 columns (the first `left` of them) of a bfloat16 row as float32, and back.
inline __m512 load_cols(const uint16_t* p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store_cols(uint16_t* p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(modserve::bf16_rounded_bits(v), 16)));
}

}  // namespace

extern "C" {

// x [T, H] bfloat16 (rows x_stride apart); logits [T, E] bfloat16 (the router's, rows
// logits_stride apart); w13 [E] experts of packed (gate, up) panel pairs (N 2I, K H: the gated
// layout of cpu_panel_linear.enable_silu_mul), w2 [E] experts of packed panels (N H, K I); out
// [T, H] bfloat16 (rows out_stride apart). I a multiple of 16, 1 <= k <= E. Returns 0.
int modserve_experts(const uint16_t* x, int64_t x_stride, int64_t T, const uint16_t* logits, int64_t logits_stride,
                         int E, int k, int renormalize, const uint16_t* w13, const uint16_t* w2, int H, int I,
                         uint16_t* out, int64_t out_stride, int threads) {
    if (T <= 0) return 0;
    const int64_t panel13 = static_cast<int64_t>((H + 31) / 32) * 512, panel2 = static_cast<int64_t>((I + 31) / 32) * 512;
    const int64_t pairs = I / 16, down_panels = (H + 15) / 16;
    const int64_t expert13 = 2 * pairs * panel13, expert2 = down_panels * panel2;  // elements of one expert's panels
    std::vector<int32_t> ids(T * k);
    std::vector<float> weights(T * k);
    std::vector<uint16_t> rows(T * k * H), act(T * k * I), ys(T * k * H);
    Plan p;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> probs(E);
        std::vector<uint8_t> taken(E);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
            route(logits + t * logits_stride, E, k, renormalize != 0, probs.data(), taken.data(), &ids[t * k], &weights[t * k]);
#pragma omp single
        p = plan(ids.data(), T, E, k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < T * k; ++r) std::memcpy(&rows[r * H], x + p.token[r] * x_stride, sizeof(uint16_t) * H);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        share(t, nt, p, pairs, [&](int e, int64_t u0, int64_t u1) {
            const int64_t r0 = p.start[e];
            modserve::bf16_panels::thread_part(&rows[r0 * H], H, p.start[e + 1] - r0, w13 + e * expert13, panel13, 2 * I, H,
                                               nullptr, &act[r0 * I], I, true, 2 * u0, 2 * u1);
        });
#pragma omp barrier
        share(t, nt, p, down_panels, [&](int e, int64_t u0, int64_t u1) {
            const int64_t r0 = p.start[e];
            modserve::bf16_panels::thread_part(&act[r0 * I], I, p.start[e + 1] - r0, w2 + e * expert2, panel2, H, I, nullptr,
                                               &ys[r0 * H], H, false, u0, u1);
        });
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tok = 0; tok < T; ++tok)
            for (int c = 0; c < H; c += 16) {
                const __mmask16 m = modserve::cols_mask(H - c);
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < k; ++j) {
                    const __m512 y = load_cols(&ys[p.copy[tok * k + j] * H + c], m);
                    sum = modserve::round_bf16(_mm512_add_ps(sum, modserve::round_bf16(_mm512_mul_ps(y, _mm512_set1_ps(weights[tok * k + j])))));
                }
                store_cols(out + tok * out_stride + c, m, sum);
            }
    }
    return 0;
}

int modserve_experts_available() { return 1; }

}  // extern "C"

MODSERVE_PACKED(modserve_experts) {
    using modserve::packed::ptr;
    return modserve_experts(ptr<const uint16_t*>(a[0]), a[1], a[2], ptr<const uint16_t*>(a[3]), a[4], a[5], a[6], a[7],
                                ptr<const uint16_t*>(a[8]), ptr<const uint16_t*>(a[9]), a[10], a[11], ptr<uint16_t*>(a[12]),
                                a[13], a[14]);
}

#else  // no AVX512_BF16: the loader refuses the kernel

extern "C" int modserve_experts_available() { return 0; }

#endif
