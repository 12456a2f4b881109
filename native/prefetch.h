// A software prefetch every kernel can use, whatever vector width it was built for.
#pragma once

namespace modserve {

// Asks for the cache line at p ahead of its use: into L1, or (IntoL2) into L2 only, for data
// wanted a little later, which then takes no L1 miss buffer while it comes. Inline asm, not
// _mm_prefetch: GCC 12 dropped every _mm_prefetch from the attention kernel's loops without a
// word (so an earlier trial of software prefetch there measured nothing).
template <bool IntoL2 = false>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    if constexpr (IntoL2)
        asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
    else
        asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p, 0, IntoL2 ? 2 : 3);
#endif
}

}  // namespace modserve
