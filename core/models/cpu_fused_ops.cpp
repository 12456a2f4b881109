// The Llama layer's elementwise work in one pass each, for float32 on the CPU.
//
// Unfused, torch runs these as chains of ops that each read and write the whole
// activation: RMSNorm is pow, mean, add, rsqrt, mul, mul; SiLU-and-multiply is silu then
// mul; rotate-half RoPE is neg, cat, mul, mul, add; the residual add is one more. At
// prefill sizes that memory traffic was about a fifth of a step. Built by
// core/native/build.py; rows are split across torch's OpenMP pool.
#include <cmath>
#include <cstdint>

#include "fast_exp.h"

namespace {

using modserve::exp_nonpositive;

// silu(x) = x * sigmoid(x), with exp only ever of a non-positive argument.
inline float silu(float x) {
    const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|)
    const float r = 1.f / (1.f + e);
    const float er = e * r;  // both computed before the select, so the loop vectorizes
    return x * (x >= 0.f ? r : er);
}

}  // namespace

extern "C" {

// residual == nullptr: out = rms_norm(x) * w.
// Otherwise:          residual += x, then out = rms_norm(residual) * w (the pre-norm
// layer's "add the sublayer's output, normalise for the next sublayer").
// x, residual, out: [rows, dim] with row strides; w: [dim].
void modserve_add_rms_norm(const float* x, int64_t x_stride, float* residual, const float* w, float* out,
                           int64_t out_stride, int rows, int dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * x_stride;
        float* o = out + r * out_stride;
        const float* src = xr;
        if (residual != nullptr) {
            float* res = residual + static_cast<int64_t>(r) * dim;
            for (int i = 0; i < dim; ++i) res[i] += xr[i];
            src = res;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < dim; ++i) sum += src[i] * src[i];
        const float inv = 1.f / std::sqrt(sum / dim + eps);
        for (int i = 0; i < dim; ++i) o[i] = w[i] * (src[i] * inv);
    }
}

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]; gate_up: [rows, 2 * inter].
void modserve_silu_mul(const float* gate_up, float* out, int rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + static_cast<int64_t>(r) * 2 * inter;
        const float* u = g + inter;
        float* o = out + static_cast<int64_t>(r) * inter;
#pragma omp simd
        for (int j = 0; j < inter; ++j) o[j] = silu(g[j]) * u[j];
    }
}

// Rotate-half RoPE, in place on the first `heads` heads of each row of x (the q and k
// heads at the front of a fused qkv row): for i < D/2,
//   x[i]       <- x[i] * cos[i] - x[i + D/2] * sin[i]
//   x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// cos, sin: [rows, D], already gathered for each row's position.
void modserve_rope(float* x, int64_t x_stride, const float* cos, const float* sin, int rows, int heads, int D,
                   int threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* c = cos + static_cast<int64_t>(r) * D;
        const float* s = sin + static_cast<int64_t>(r) * D;
        for (int h = 0; h < heads; ++h) {
            float* a = x + r * x_stride + static_cast<int64_t>(h) * D;
            float* b = a + half;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a0 = a[i], b0 = b[i];
                a[i] = a0 * c[i] - b0 * s[i];
                b[i] = b0 * c[i + half] + a0 * s[i + half];
            }
        }
    }
}

}  // extern "C"
