// A kernel's second entry point for call lists (modserve.core.native_calls): the same function
// taking its arguments as one array of 64-bit slots, so one loop (call_list.cpp) can run a
// recorded decode step's kernels back to back, whatever each one's signature.
//
// Slots hold pointers and integers as themselves and floats as their float32 bits. Declare
// one with MODSERVE_PACKED(name) { ...; return 0; } beside the function it forwards to; a
// nonzero return (the kernel's own error code) stops the list.
#pragma once

#include <cstdint>
#include <cstring>

namespace modserve::packed {

template <typename T>
inline T ptr(int64_t slot) { return reinterpret_cast<T>(static_cast<intptr_t>(slot)); }

inline float f32(int64_t slot) {
    const uint32_t bits = static_cast<uint32_t>(slot);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

}  // namespace modserve::packed

#define MODSERVE_PACKED(name) extern "C" int name##_packed(const int64_t* a)
