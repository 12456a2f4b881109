"""Greedy token choice: each row's argmax, threaded, as ``torch.argmax`` defines it.

Why: on the CPU ``torch.argmax`` over ``[rows, vocab]`` float32 logits runs row after
row in scalar code (~1 ms for 64 rows of a 49k vocabulary, ~4 ms for 256: 2-3% of a decode
step). ``row_argmax.cpp`` does the rows in parallel with AVX-512 where the CPU has it and
returns the same indices (first index of the maximum; a NaN wins, the first one). Anything
it does not take (another device or dtype, a strided tensor, no C++ compiler) goes to
``torch.argmax``.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import torch

from modserve.native.build import SOURCES, KernelUnavailable, compile_and_load

SOURCE = SOURCES / "row_argmax.cpp"
log = logging.getLogger("modserve.sampling")


@lru_cache(maxsize=None)
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel (``extra_flags``: a variant build, e.g. ``("-mno-avx512f",)``), or None
    without a working compiler (said once)."""
    try:
        lib = compile_and_load(SOURCE, "the row argmax kernel", extra_flags)
    except KernelUnavailable as e:
        log.warning("greedy sampling: %s; using torch.argmax", e)
        return None
    lib.modserve_row_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.modserve_row_argmax.restype = None
    return lib


def row_argmax(logits: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[rows, vocab]`` logits, int64 ``[rows]``."""
    if (
        logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
        or not logits.is_contiguous() or logits.shape[0] == 0 or not 0 < logits.shape[1] < 2**31
    ):  # fmt: skip
        return logits.argmax(dim=-1)
    lib = lib or load()
    if lib is None:
        return logits.argmax(dim=-1)
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.modserve_row_argmax(logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out
