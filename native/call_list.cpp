// Runs a recorded list of kernel calls (modserve.core.native_calls) in one ctypes call: a CPU
// decode step's ~300 kernels without the Python between them.
//
// The list is int64 words: for each call, the address of the kernel's packed entry point
// (packed_call.h), its number of slots, then the slots.
#include <cstdint>

extern "C" {

// 0 when every call returned 0; else (index of the first call that did not) + 1, and the
// calls after it are not run.
int64_t modserve_run_calls(const int64_t* words, int64_t calls) {
    using Packed = int (*)(const int64_t*);
    for (int64_t i = 0; i < calls; ++i) {
        const Packed fn = reinterpret_cast<Packed>(static_cast<intptr_t>(words[0]));
        if (fn(words + 2) != 0) return i + 1;
        words += 2 + words[1];
    }
    return 0;
}

}  // extern "C"
