// A software prefetch every kernel can use, whatever vector width it was built for.
#pragma once

namespace modserve {

// Asks for the cache line at p ahead of its use. Inline asm, not _mm_prefetch: GCC 12
// dropped every _mm_prefetch from the attention kernel's loops without a word (so an
// earlier trial of software prefetch there measured nothing).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

// Asks for the cache line at p into L2 only (prefetcht1), for data wanted a little later than
// prefetch_line's: it takes no L1 miss buffer while it comes, and L1 is not filled early.
inline void prefetch_line_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace modserve
