// Shared by the CPU kernels (native/build.py puts this directory on the include path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace modserve {

// exp(x) for x <= 0 without a libm call, so the loops over a block's scores vectorize:
// Cephes' expf polynomial after a reduction by ln 2 (relative error ~2e-7); flushed to a
// tiny positive number below -87, which multiplies an all-zero accumulator harmlessly.
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

// silu(x) = x * sigmoid(x), with exp only ever of a non-positive argument (the fused SiLU-mul
// and the AVX2 linear's gated epilogue compute it alike).
inline float silu(float x) {
    const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|)
    const float r = 1.f / (1.f + e);
    const float er = e * r;  // both computed before the select, so the loop vectorizes
    return x * (x >= 0.f ? r : er);
}

}  // namespace modserve
