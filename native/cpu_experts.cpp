// A mixture-of-experts MLP (Mixtral, Qwen3-MoE) in one call: routing, every picked expert's
// SiLU-gated MLP, and the weighted sum, from the router's logits. Two builds of one loop: a
// bfloat16 model's on AVX512_BF16 (modserve_experts, the products of avx512_bf16_panels.h),
// and a float32 model's whose experts bfloat16 holds exactly, on AVX2 and FMA (or AVX-512
// wide; modserve_experts_f32, the products of float32_panels.h). The experts are packed per
// expert as cpu_panel_linear packs a layer: bfloat16 weights, or int8 codes in the same order
// with a scale per output channel (device.quantization int8), widened in registers.
//
// Why: torch's grouped product (or a loop over experts) ran Qwen3-30B-A3B's expert shapes
// (hidden 2,048, 128 experts of width 768, top 8) at one token in 3.2-4.2 ms a layer on a Zen
// 5, reading the 75 MB of picked weights at a quarter of the machine's read bandwidth (this
// kernel: 1.25 ms, 75%; docs/cpu_experts.md); it sizes its expert batches on the host
// (counts.tolist()), so a decode step with experts could not replay as a call list.
//
// The steps, in one OpenMP region:
//   1. route: each token's softmax over the experts in float32, its top k (ties to the lower
//      expert), renormalized over those k if asked, the weights rounded to the model's dtype:
//      the model's own routing (HF's Mixtral and Qwen3-MoE);
//   2. each token's row copied once per picked expert into the expert's rows (experts in
//      order, tokens in order within one);
//   3. every picked expert's (gate, up) panel pairs, then its down panels, as one list of units
//      split over the threads by weight (an expert's rows plus the cost of streaming its panel);
//   4. each token's output: its experts' outputs in expert order, each times its weight, added
//      to a sum in the model's dtype: the rounding of the reference (out *= weight, then
//      index_add_ into zeros), so results equal it up to the products' float32 summation order.
#include <cstdint>
#include <cstring>

#include "packed_call.h"

#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "avx512_bf16_panels.h"  // each empty where the compiler does not target its instructions
#include "bf16.h"
#include "float32_panels.h"

namespace {

constexpr int64_t kStreamRows = 4;  // a panel's weight stream, in rows of products (the split's unit cost)

// The model's dtype: bfloat16 (held as uint16_t) or float32, and a float32 rounded to it.
inline float as_float(uint16_t v) { return modserve::bf16_to_float(v); }
inline float as_float(float v) { return v; }
template <typename T>
inline float rounded(float v) {
    if constexpr (std::is_same_v<T, uint16_t>) return modserve::bf16_to_float(modserve::float_to_bf16(v));
    return v;
}

// Token t's route: its top-k experts in ascending order and their weights, rounded to the
// model's dtype T (held as float32). `probs` and `taken` are E floats and flags of scratch.
template <typename T>
void route(const T* logits, int E, int k, bool renormalize, float* probs, uint8_t* taken, int32_t* ids, float* weights) {
    float top = -INFINITY;
    for (int e = 0; e < E; ++e) top = std::fmax(top, as_float(logits[e]));
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += probs[e] = std::exp(as_float(logits[e]) - top);
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
    for (int j = 0; j < k; ++j) weights[j] = rounded<T>(renormalize ? weights[j] / picked : weights[j]);
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

// A thread's share of one expert's products (avx512_bf16_panels.h's or float32_panels.h's
// thread_part): rows [0, M) of x times panels [p0, p1) of w (bfloat16, or int8 codes with their
// channel scales), into y.
template <typename T, typename W>
using Part = void (*)(const T*, int64_t, int64_t, const W*, int64_t, int64_t, int, const float*, T*, int64_t, bool,
                      int64_t, int64_t, const float*);

// Token tok's output: its experts' rows of ys (in `copy`, ascending experts) times their
// weights, summed in the model's dtype.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
void combine(const uint16_t* ys, const int64_t* copy, const float* weights, int k, int H, uint16_t* out);
#endif
void combine(const float* ys, const int64_t* copy, const float* weights, int k, int H, float* out);

// The whole call (see the top of the file) for the model's dtype T and its products over
// weights W (bfloat16, or int8 codes whose channel scales scale13 and scale2 hold: [E][2I] in
// the gated panels' order, [E][H rounded up to 16]).
template <typename T, typename W, Part<T, W> part>
int experts(const T* x, int64_t x_stride, int64_t T_, const T* logits, int64_t logits_stride, int E, int k, int renormalize,
            const W* w13, const W* w2, const float* scale13, const float* scale2, int H, int I, T* out, int64_t out_stride,
            int threads) {
    if (T_ <= 0) return 0;
    const int64_t panel13 = static_cast<int64_t>((H + 31) / 32) * 512, panel2 = static_cast<int64_t>((I + 31) / 32) * 512;
    const int64_t pairs = I / 16, down_panels = (H + 15) / 16;
    const int64_t expert13 = 2 * pairs * panel13, expert2 = down_panels * panel2;  // elements of one expert's panels
    std::vector<int32_t> ids(T_ * k);
    std::vector<float> weights(T_ * k);
    // Every element of these is written before it is read: left uninitialized, not zeroed (at
    // prefill sizes, tens of MB a call).
    const std::unique_ptr<T[]> rows(new T[T_ * k * H]), act(new T[T_ * k * I]), ys(new T[T_ * k * H]);
    Plan p;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> probs(E);
        std::vector<uint8_t> taken(E);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T_; ++t)
            route(logits + t * logits_stride, E, k, renormalize != 0, probs.data(), taken.data(), &ids[t * k], &weights[t * k]);
#pragma omp single
        p = plan(ids.data(), T_, E, k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < T_ * k; ++r) std::memcpy(&rows[r * H], x + p.token[r] * x_stride, sizeof(T) * H);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        share(t, nt, p, pairs, [&](int e, int64_t u0, int64_t u1) {
            const int64_t r0 = p.start[e];
            part(&rows[r0 * H], H, p.start[e + 1] - r0, w13 + e * expert13, panel13, 2 * I, H, nullptr, &act[r0 * I], I, true,
                 2 * u0, 2 * u1, scale13 != nullptr ? scale13 + e * 2 * I : nullptr);
        });
#pragma omp barrier
        share(t, nt, p, down_panels, [&](int e, int64_t u0, int64_t u1) {
            const int64_t r0 = p.start[e];
            part(&act[r0 * I], I, p.start[e + 1] - r0, w2 + e * expert2, panel2, H, I, nullptr, &ys[r0 * H], H, false, u0, u1,
                 scale2 != nullptr ? scale2 + e * down_panels * 16 : nullptr);
        });
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tok = 0; tok < T_; ++tok) combine(ys.get(), &p.copy[tok * k], &weights[tok * k], k, H, out + tok * out_stride);
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bfloat16: each product and each sum rounded to bfloat16, 16 columns at a time.
void combine(const uint16_t* ys, const int64_t* copy, const float* weights, int k, int H, uint16_t* out) {
    for (int c = 0; c < H; c += 16) {
        const __mmask16 m = modserve::cols_mask(H - c);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < k; ++j) {
            const __m512 y = modserve::load16(ys + copy[j] * H + c, m);
            sum = modserve::round_bf16(_mm512_add_ps(sum, modserve::round_bf16(_mm512_mul_ps(y, _mm512_set1_ps(weights[j])))));
        }
        modserve::store16(out + c, sum, m);
    }
}
#endif

// float32: each product rounded before its add (the reference's two operations; the empty asm
// keeps the compiler from fusing them into one FMA), 8 columns at a time.
void combine(const float* ys, const int64_t* copy, const float* weights, int k, int H, float* out) {
    int c = 0;
    for (; c + 8 <= H; c += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < k; ++j) {
            __m256 z = _mm256_mul_ps(_mm256_loadu_ps(ys + copy[j] * H + c), _mm256_set1_ps(weights[j]));
            __asm__("" : "+x"(z));
            sum = _mm256_add_ps(sum, z);
        }
        _mm256_storeu_ps(out + c, sum);
    }
    for (; c < H; ++c) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) {
            float z = ys[copy[j] * H + c] * weights[j];
            __asm__("" : "+x"(z));
            sum += z;
        }
        out[c] = sum;
    }
}

// The call for the model's dtype T and its panel products `Part` (a template over the weights'
// type): int8 codes where scale13 is given, bfloat16 weights where it is null.
template <typename T, template <typename W> class Part>
int dispatch(const T* x, int64_t x_stride, int64_t T_, const T* logits, int64_t logits_stride, int E, int k, int renormalize,
             const void* w13, const void* w2, const float* scale13, const float* scale2, int H, int I, T* out,
             int64_t out_stride, int threads) {
    if (scale13 != nullptr)
        return experts<T, int8_t, Part<int8_t>::run>(x, x_stride, T_, logits, logits_stride, E, k, renormalize,
                                                      static_cast<const int8_t*>(w13), static_cast<const int8_t*>(w2), scale13,
                                                      scale2, H, I, out, out_stride, threads);
    return experts<T, uint16_t, Part<uint16_t>::run>(x, x_stride, T_, logits, logits_stride, E, k, renormalize,
                                                      static_cast<const uint16_t*>(w13), static_cast<const uint16_t*>(w2),
                                                      nullptr, nullptr, H, I, out, out_stride, threads);
}

// A build's call-list entry point: the slots of dispatch's arguments, unpacked.
template <typename T, template <typename W> class Part>
int packed_experts(const int64_t* a) {
    using modserve::packed::ptr;
    return dispatch<T, Part>(ptr<const T*>(a[0]), a[1], a[2], ptr<const T*>(a[3]), a[4], a[5], a[6], a[7], ptr<const void*>(a[8]),
                             ptr<const void*>(a[9]), ptr<const float*>(a[10]), ptr<const float*>(a[11]), a[12], a[13], ptr<T*>(a[14]),
                             a[15], a[16]);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <typename W>
struct Bf16Part {  // a bfloat16 model's products over W
    static constexpr Part<uint16_t, W> run = modserve::bf16_panels::thread_part<W>;
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <typename W>
struct Float32Part {  // a float32 model's products over W
    static constexpr Part<float, W> run = modserve::float32_panels::thread_part<W>;
};
#endif

}  // namespace
#endif

// x [T, H] (rows x_stride apart) in the model's dtype; logits [T, E] (the router's, rows
// logits_stride apart) in the model's dtype; w13 [E] experts of packed (gate, up) panel pairs
// (N 2I, K H: the gated layout of cpu_panel_linear.gated_pairs), w2 [E] experts of packed panels
// (N H, K I), each bfloat16 (scale13, scale2 null) or int8 codes (scale13 [E][2I] and scale2
// [E][ceil(H/16) * 16] float32 channel scales in the panels' order); out [T, H] (rows out_stride
// apart). I a multiple of 16, 1 <= k <= E. Returns 0. modserve_experts: a bfloat16 model;
// modserve_experts_f32: float32.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
extern "C" int modserve_experts(const uint16_t* x, int64_t x_stride, int64_t T, const uint16_t* logits, int64_t logits_stride,
                                int E, int k, int renormalize, const void* w13, const void* w2, const float* scale13,
                                const float* scale2, int H, int I, uint16_t* out, int64_t out_stride, int threads) {
    return dispatch<uint16_t, Bf16Part>(x, x_stride, T, logits, logits_stride, E, k, renormalize, w13, w2, scale13, scale2, H, I,
                                        out, out_stride, threads);
}
extern "C" int modserve_experts_available() { return 1; }
MODSERVE_PACKED(modserve_experts) { return packed_experts<uint16_t, Bf16Part>(a); }
#else  // no AVX512_BF16: the loader refuses the bfloat16 build
extern "C" int modserve_experts_available() { return 0; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
extern "C" int modserve_experts_f32(const float* x, int64_t x_stride, int64_t T, const float* logits, int64_t logits_stride,
                                    int E, int k, int renormalize, const void* w13, const void* w2, const float* scale13,
                                    const float* scale2, int H, int I, float* out, int64_t out_stride, int threads) {
    return dispatch<float, Float32Part>(x, x_stride, T, logits, logits_stride, E, k, renormalize, w13, w2, scale13, scale2, H, I,
                                        out, out_stride, threads);
}
extern "C" int modserve_experts_f32_available() { return 1; }
MODSERVE_PACKED(modserve_experts_f32) { return packed_experts<float, Float32Part>(a); }
#else  // no AVX2 and FMA: the loader refuses the float32 build
extern "C" int modserve_experts_f32_available() { return 0; }
#endif
