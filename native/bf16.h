// bfloat16 <-> float32 for the CPU kernels (native/build.py puts this directory on the
// include path). bfloat16 is the high half of a float32; narrowing rounds to nearest even,
// as torch's float -> bfloat16 cast does.
#pragma once

#include <cstdint>
#include <cstring>

namespace modserve {

inline float bf16_to_float(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace modserve
