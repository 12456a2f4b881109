"""Keep freed heap memory inside the process on the CPU (glibc's ``mallopt``).

Why: a decode step allocates and frees the same tens of MB every time (activations, the
LM head's logits: 12 MB at 64 requests for SmolLM2). glibc's defaults hand large freed
blocks back to the OS (mmap'd blocks, and a trimmed heap top), so the next step faults
the same memory in again page by page: about 6,000 page faults a step at 64 requests,
which took a SmolLM2 bfloat16 decode step from 66 to 79 ms. Raising the mmap threshold
to glibc's ceiling (32 MiB) and the trim threshold to 1 GiB keeps those blocks for reuse.

The cost: memory freed after a peak (a long prefill, a prompt-logprobs request) stays in
the process's RSS for the next peak instead of going back to the OS. ``device: {plugin: cpu,
reuse_freed_memory: false}`` keeps glibc's defaults. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("modserve.engine")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Apply the thresholds to this process; False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("device.reuse_freed_memory: glibc refused the malloc thresholds; keeping its defaults")
    return ok
