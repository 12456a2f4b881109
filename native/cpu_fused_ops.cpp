// The Llama layer's elementwise work in one pass each, for float32 and bfloat16 on the CPU.
//
// Unfused, torch runs these as chains of ops that each read and write the whole
// activation: RMSNorm is pow, mean, add, rsqrt, mul, mul; SiLU-and-multiply is silu then
// mul; rotate-half RoPE is neg, cat, mul, mul, add; the residual add is one more. At
// prefill sizes that memory traffic was about a fifth of a step, and at decode sizes in
// bfloat16 the ~80 small ops per layer (casts included) cost more than their arithmetic.
// Built by native/build.py; rows are split across torch's OpenMP pool.
//
// bfloat16 rounds where torch's bfloat16 ops do (each op's result is a bfloat16 tensor),
// so the fused ops give HF's bfloat16 values, not a more precise float32 chain:
// norm: x -> bf16(x * rsqrt(mean(x^2) + eps)) -> bf16(w * that); silu: bf16(silu(g)) then
// bf16(that * u); rope: bf16(bf16(a * cos) + bf16(rot * sin)); residual: bf16(r + x).
// Gemma's norm (offset) rounds once, bf16((x * rsqrt(...)) * (1 + w)), as HF's does; its
// GeGLU takes tanh from exp_nonpositive (within ~1e-6 of torch's, not bit for bit).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "fast_exp.h"
#include "packed_call.h"

namespace {

using modserve::exp_nonpositive;
using modserve::silu;
using bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return modserve::bf16_to_float(x); }

// Round to the element type: nearest-even for bfloat16 (as torch's float -> bfloat16 cast).
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline bf16 narrow<bf16>(float x) { return modserve::float_to_bf16(x); }

// The value as its element type would hold it: identity for float32.
template <typename T>
inline float rounded(float x) { return widen(narrow<T>(x)); }

// One element of a norm's output before its last rounding to T: w * (x * inv), the inner
// product rounded to T as torch's op rounds it; with offset (Gemma), (x * inv) * (1 + w) in
// float32, to be rounded once.
template <typename T>
inline float plain_normed(T x, float inv, T w) { return widen(w) * rounded<T>(widen(x) * inv); }
template <typename T>
inline float offset_normed(T x, float inv, T w) { return widen(x) * inv * (1.f + widen(w)); }

// Row `src` (dim elements) RMS-normalised and scaled by w into o; accumulate: o += that, rounded
// as torch's add of the rounded norm (OLMo 2's post-norm residual add). The one norm of
// add_rms_norm and rms_norm_heads.
template <typename T>
void norm_row(const T* src, const T* w, T* o, int dim, float eps, bool offset, bool accumulate) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < dim; ++j) sum += widen(src[j]) * widen(src[j]);
    const float inv = 1.f / std::sqrt(sum / dim + eps);
    if (accumulate) {  // the norm through a buffer: in float32 one expression would contract into an FMA
        float normed[256];
        for (int j0 = 0; j0 < dim; j0 += 256) {
            const int n = dim - j0 < 256 ? dim - j0 : 256;
            for (int j = 0; j < n; ++j) {
                const T x = src[j0 + j], wj = w[j0 + j];
                normed[j] = rounded<T>(offset ? offset_normed<T>(x, inv, wj) : plain_normed<T>(x, inv, wj));
            }
            for (int j = 0; j < n; ++j) o[j0 + j] = narrow<T>(widen(o[j0 + j]) + normed[j]);
        }
    } else if (offset) {
        for (int j = 0; j < dim; ++j) o[j] = narrow<T>(offset_normed<T>(src[j], inv, w[j]));
    } else {
        for (int j = 0; j < dim; ++j) o[j] = narrow<T>(plain_normed<T>(src[j], inv, w[j]));
    }
}

// gelu(x) with the tanh approximation (torch's approximate="tanh"), tanh from exp(-2|y|) so
// that the loop vectorizes: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline float gelu_tanh(float x) {
    const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpositive(-2.f * std::fabs(y));
    const float t = (1.f - e) / (1.f + e);  // tanh(|y|)
    return 0.5f * x * (1.f + (y >= 0.f ? t : -t));
}

template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t out_stride, int rows, int dim,
                  float eps, bool offset, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const T* xr = x + r * x_stride;
        T* o = out + r * out_stride;
        const T* src = xr;
        if (residual != nullptr) {
            T* res = residual + static_cast<int64_t>(r) * dim;
            for (int i = 0; i < dim; ++i) res[i] = narrow<T>(widen(res[i]) + widen(xr[i]));
            src = res;
        }
        norm_row(src, w, o, dim, eps, offset, false);
    }
}

// Each of `heads` heads of each of `rows` rows of x (row r's head h at x + r x_stride + h dim)
// normalised over its own `dim` channels, into out [rows, heads * dim]: the q/k norms of Qwen3
// (per head) and OLMo 2 (heads 1: the whole projection), read in place from the fused qkv rows.
// `accumulate`: out += the normalised rows instead (see norm_row).
template <typename T>
void rms_norm_heads(const T* x, int64_t x_stride, int heads, const T* w, T* out, int rows, int dim, float eps,
                    bool accumulate, bool offset, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads >= 8)
    for (int i = 0; i < rows * heads; ++i) {
        const int r = i / heads, h = i % heads;
        norm_row(x + r * x_stride + static_cast<int64_t>(h) * dim, w, out + static_cast<int64_t>(i) * dim, dim, eps,
                 offset, accumulate);
    }
}

// x *= factor in place, rounded as torch's multiply by a Python float (float32 arithmetic).
template <typename T>
void scale(T* x, int64_t x_stride, float factor, int rows, int width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; ++r) {
        T* xr = x + r * x_stride;
#pragma omp simd
        for (int j = 0; j < width; ++j) xr[j] = narrow<T>(widen(xr[j]) * factor);
    }
}

// out[r, j] = act(gate[r, j]) * up[r, j] for gate_up rows [gate | up]: SwiGLU (silu) or GeGLU (gelu_tanh).
template <typename T, float (*Act)(float)>
void act_mul(const T* gate_up, T* out, int rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const T* g = gate_up + static_cast<int64_t>(r) * 2 * inter;
        const T* u = g + inter;
        T* o = out + static_cast<int64_t>(r) * inter;
#pragma omp simd
        for (int j = 0; j < inter; ++j) o[j] = narrow<T>(rounded<T>(Act(widen(g[j]))) * widen(u[j]));
    }
}

template <typename T>
void rope(T* x, int64_t x_stride, const T* cos, const T* sin, int rows, int heads, int D, int head_stride, int threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const T* c = cos + static_cast<int64_t>(r) * D;
        const T* s = sin + static_cast<int64_t>(r) * D;
        for (int h = 0; h < heads; ++h) {
            T* a = x + r * x_stride + static_cast<int64_t>(h) * head_stride;
            T* b = a + half;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a0 = widen(a[i]), b0 = widen(b[i]);
                a[i] = narrow<T>(rounded<T>(a0 * widen(c[i])) + rounded<T>(-b0 * widen(s[i])));
                b[i] = narrow<T>(rounded<T>(b0 * widen(c[i + half])) + rounded<T>(a0 * widen(s[i + half])));
            }
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, for every tensor argument.

// residual == nullptr: out = rms_norm(x) * w.
// Otherwise:          residual += x, then out = rms_norm(residual) * w (the pre-norm
// layer's "add the sublayer's output, normalise for the next sublayer").
// x, residual, out: [rows, dim] with row strides; w: [dim]. offset (Gemma): scale by 1 + w
// in float32 and round once, instead of rounding the normalised x and multiplying by w.
void modserve_add_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, const void* w, void* out,
                           int64_t out_stride, int rows, int dim, float eps, int offset, int threads) {
    if (dtype == 1) {
        add_rms_norm(static_cast<const bf16*>(x), x_stride, static_cast<bf16*>(residual), static_cast<const bf16*>(w),
                     static_cast<bf16*>(out), out_stride, rows, dim, eps, offset != 0, threads);
    } else {
        add_rms_norm(static_cast<const float*>(x), x_stride, static_cast<float*>(residual),
                     static_cast<const float*>(w), static_cast<float*>(out), out_stride, rows, dim, eps, offset != 0,
                     threads);
    }
}

// out [rows, heads * dim] = (accumulate: out +) each dim-wide head of x's rows (x_stride apart)
// RMS-normalised, times w [dim].
void modserve_rms_norm_heads(int dtype, const void* x, int64_t x_stride, int heads, const void* w, void* out, int rows,
                             int dim, float eps, int accumulate, int offset, int threads) {
    if (dtype == 1) {
        rms_norm_heads(static_cast<const bf16*>(x), x_stride, heads, static_cast<const bf16*>(w), static_cast<bf16*>(out),
                       rows, dim, eps, accumulate != 0, offset != 0, threads);
    } else {
        rms_norm_heads(static_cast<const float*>(x), x_stride, heads, static_cast<const float*>(w),
                       static_cast<float*>(out), rows, dim, eps, accumulate != 0, offset != 0, threads);
    }
}

// x [rows, width] (rows x_stride apart) *= factor: Granite's embedding and residual multipliers.
void modserve_scale(int dtype, void* x, int64_t x_stride, float factor, int rows, int width, int threads) {
    if (dtype == 1) {
        scale(static_cast<bf16*>(x), x_stride, factor, rows, width, threads);
    } else {
        scale(static_cast<float*>(x), x_stride, factor, rows, width, threads);
    }
}

// out[r, j] = gelu_tanh(gate_up[r, j]) * gate_up[r, inter + j] (GeGLU, Gemma).
void modserve_gelu_tanh_mul(int dtype, const void* gate_up, void* out, int rows, int inter, int threads) {
    if (dtype == 1) {
        act_mul<bf16, gelu_tanh>(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, inter, threads);
    } else {
        act_mul<float, gelu_tanh>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, threads);
    }
}

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]; gate_up: [rows, 2 * inter].
void modserve_silu_mul(int dtype, const void* gate_up, void* out, int rows, int inter, int threads) {
    if (dtype == 1) {
        act_mul<bf16, silu>(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, inter, threads);
    } else {
        act_mul<float, silu>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, threads);
    }
}

// Rotate-half RoPE, in place on the first D channels of the first `heads` heads of each row
// of x (the q and k heads at the front of a fused qkv row, head_stride apart: D below it
// rotates part of each head, Phi-4-mini): for i < D/2,
//   x[i]       <- x[i] * cos[i] - x[i + D/2] * sin[i]
//   x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// cos, sin: [rows, D], already gathered for each row's position.
void modserve_rope(int dtype, void* x, int64_t x_stride, const void* cos, const void* sin, int rows, int heads, int D,
                   int head_stride, int threads) {
    if (dtype == 1) {
        rope(static_cast<bf16*>(x), x_stride, static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), rows, heads,
             D, head_stride, threads);
    } else {
        rope(static_cast<float*>(x), x_stride, static_cast<const float*>(cos), static_cast<const float*>(sin), rows,
             heads, D, head_stride, threads);
    }
}

// LongRoPE's table row for each of a step's tokens (core/models/rope.py): a token whose
// request is longer than `original` (its own position + 1, or the request's length where
// request_lens is given: tokens query_start_loc[r] .. [r + 1] belong to request r) rotates
// with the long factors' row, its position; a shorter one with the short factors' row,
// position + max_positions.
void modserve_longrope_rows(const int64_t* positions, const int32_t* query_start_loc, const int32_t* request_lens,
                            int requests, int tokens, int64_t original, int64_t max_positions, int64_t* rows) {
    for (int r = 0; r < (request_lens ? requests : 1); ++r) {
        const int t0 = request_lens ? query_start_loc[r] : 0, t1 = request_lens ? query_start_loc[r + 1] : tokens;
        for (int t = t0; t < t1; ++t) {
            const int64_t length = request_lens && request_lens[r] > positions[t] + 1 ? request_lens[r] : positions[t] + 1;
            rows[t] = length > original ? positions[t] : positions[t] + max_positions;
        }
    }
}

// out[r] = table[idx[r]] for r < rows, each row `width` elements, widened or rounded from the
// table's dtype to out's (0 float32, 1 bfloat16; nearest-even, as torch's cast): the embedding
// lookup and the RoPE cos/sin rows of a step, without torch's index and cast ops. Returns 1,
// writing nothing, when an index is not a row of the table's `table_rows`.
int modserve_gather_rows(int table_dtype, const void* table, int64_t table_rows, const int64_t* idx, int rows, int width,
                         int out_dtype, void* out, int threads) {
    for (int r = 0; r < rows; ++r)
        if (idx[r] < 0 || idx[r] >= table_rows) return 1;
    const size_t in_size = table_dtype == 1 ? 2 : 4, out_size = out_dtype == 1 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; ++r) {
        const char* src = static_cast<const char*>(table) + idx[r] * width * in_size;
        char* dst = static_cast<char*>(out) + static_cast<int64_t>(r) * width * out_size;
        if (table_dtype == out_dtype) {
            std::memcpy(dst, src, width * in_size);
        } else if (out_dtype == 1) {
            for (int i = 0; i < width; ++i)
                reinterpret_cast<bf16*>(dst)[i] = modserve::float_to_bf16(reinterpret_cast<const float*>(src)[i]);
        } else {
            for (int i = 0; i < width; ++i)
                reinterpret_cast<float*>(dst)[i] = modserve::bf16_to_float(reinterpret_cast<const bf16*>(src)[i]);
        }
    }
    return 0;
}

}  // extern "C"

using modserve::packed::f32;
using modserve::packed::ptr;

MODSERVE_PACKED(modserve_add_rms_norm) {
    modserve_add_rms_norm(a[0], ptr<const void*>(a[1]), a[2], ptr<void*>(a[3]), ptr<const void*>(a[4]), ptr<void*>(a[5]),
                          a[6], a[7], a[8], f32(a[9]), a[10], a[11]);
    return 0;
}

MODSERVE_PACKED(modserve_rms_norm_heads) {
    modserve_rms_norm_heads(a[0], ptr<const void*>(a[1]), a[2], a[3], ptr<const void*>(a[4]), ptr<void*>(a[5]), a[6], a[7],
                            f32(a[8]), a[9], a[10], a[11]);
    return 0;
}

MODSERVE_PACKED(modserve_scale) {
    modserve_scale(a[0], ptr<void*>(a[1]), a[2], f32(a[3]), a[4], a[5], a[6]);
    return 0;
}

MODSERVE_PACKED(modserve_gelu_tanh_mul) {
    modserve_gelu_tanh_mul(a[0], ptr<const void*>(a[1]), ptr<void*>(a[2]), a[3], a[4], a[5]);
    return 0;
}

MODSERVE_PACKED(modserve_silu_mul) {
    modserve_silu_mul(a[0], ptr<const void*>(a[1]), ptr<void*>(a[2]), a[3], a[4], a[5]);
    return 0;
}

MODSERVE_PACKED(modserve_rope) {
    modserve_rope(a[0], ptr<void*>(a[1]), a[2], ptr<const void*>(a[3]), ptr<const void*>(a[4]), a[5], a[6], a[7], a[8],
                  a[9]);
    return 0;
}

MODSERVE_PACKED(modserve_longrope_rows) {
    modserve_longrope_rows(ptr<const int64_t*>(a[0]), ptr<const int32_t*>(a[1]), ptr<const int32_t*>(a[2]), a[3], a[4], a[5],
                           a[6], ptr<int64_t*>(a[7]));
    return 0;
}

MODSERVE_PACKED(modserve_gather_rows) {
    return modserve_gather_rows(a[0], ptr<const void*>(a[1]), a[2], ptr<const int64_t*>(a[3]), a[4], a[5], a[6],
                                ptr<void*>(a[7]), a[8]);
}
