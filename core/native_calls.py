"""Compiled kernels a CPU decode step can record once and replay in one call (contract 2.6).

Why: at one client, a bfloat16 decode step of SmolLM2 is ~300 native kernels of 5-40 us
each, and the Python between them (module calls, argument checks, ctypes conversions) cost
about 1 ms of a 9 ms step. A GPU removes the same overhead with CUDA graphs; on a CPU the
kernels are plain C functions, so a "graph" is the list of calls with their arguments.

How: a kernel made with :class:`NativeFunction` is called as through ctypes, and while
:func:`capture` runs a forward it also appends itself and its arguments (pointers, ints,
floats as bits) to a :class:`CallList`. ``native/call_list.cpp`` replays the list; each
kernel's ``<name>_packed`` twin (``native/packed_call.h``) unpacks its slots. A replay reads
whatever the captured tensors then hold, as a CUDA graph does.

What makes a forward replayable, checked by :func:`capture` rather than trusted:

- every computation is a recorded native call: a torch operator that computes (anything but
  allocations and views) is refused, since a replay would skip it;
- no native call goes around :class:`NativeFunction`: after recording, every tensor the
  forward allocated is filled with NaN and the list replayed once; its output must equal
  the eager run's bit for bit;
- the tensors the forward allocated stay alive with the list (their addresses are in it).
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
}  # fmt: skip
_recording: CallList | None = None  # the list capture() is filling, if any


class NotReplayable(RuntimeError):
    """The forward does something a call list cannot replay (the message says what)."""


class NativeFunction:
    """A kernel exported as ``name`` (called through ctypes with ``argtypes``) and
    ``name_packed`` (its call-list twin); calls are recorded while :func:`capture` runs."""

    def __init__(self, lib: ctypes.CDLL, name: str, argtypes: list, restype: Any = None) -> None:
        self.name = name
        self.fn = getattr(lib, name)
        self.fn.argtypes, self.fn.restype = argtypes, restype
        self.packed = ctypes.cast(getattr(lib, name + "_packed"), ctypes.c_void_p).value
        self.floats = frozenset(i for i, t in enumerate(argtypes) if t is ctypes.c_float)

    def __call__(self, *args: Any) -> Any:
        recording = _recording
        if recording is not None and recording.thread == threading.get_ident():  # not another engine's thread
            recording.add(self, args)
        return self.fn(*args)


class CallList:
    """Recorded kernel calls, replayed in order by :meth:`run` (one ctypes call)."""

    def __init__(self) -> None:
        self.words: list[int] = []
        self.names: list[str] = []
        self.thread = threading.get_ident()  # the thread recording it
        self._packed: torch.Tensor | None = None

    def add(self, fn: NativeFunction, args: tuple) -> None:
        slots = [_slot(a, i in fn.floats) for i, a in enumerate(args)]
        self.words += [fn.packed, len(slots), *slots]
        self.names.append(fn.name)
        self._packed = None

    def run(self) -> None:
        if self._packed is None:
            self._packed = torch.tensor(self.words, dtype=torch.int64)
        failed = _runner().modserve_run_calls(self._packed.data_ptr(), len(self.names))
        if failed:
            raise RuntimeError(f"replayed kernel {self.names[failed - 1]} (call {failed} of {len(self.names)}) failed")


def _slot(value: Any, is_float: bool) -> int:
    if is_float:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if value is None:
        return 0
    if isinstance(value, (bool, int)):
        return int(value)
    raise TypeError(f"a recorded kernel argument must be an int, a float or None, got {type(value).__name__}")


@cache
def _runner() -> ctypes.CDLL:
    from modserve.native.build import SOURCES, compile_and_load

    lib = compile_and_load(SOURCES / "call_list.cpp", "the call-list runner")
    lib.modserve_run_calls.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.modserve_run_calls.restype = ctypes.c_int64
    return lib


class _AllocationsOnly(TorchDispatchMode):
    """Lets torch allocate and take views; stops the forward at the first operator that would
    compute (before it runs: the capture's rows are padding, which e.g. an index_copy_ to
    slot -1 would not survive)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _ALLOCATIONS and not func.is_view:
            raise NotReplayable(f"torch operator {func} computes outside the recorded kernels")
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in _ALLOCATIONS:
            self.allocated.append(out)
        elif any(t.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr() for t in outs):
            # an operator that may alias (reshape under inference mode) but here copied
            raise NotReplayable(f"torch operator {func} copies outside the recorded kernels")
        self.kept += outs
        return out


def capture(fn: Callable[..., torch.Tensor], args: tuple) -> Callable[[], torch.Tensor]:
    """Run ``fn(*args)`` once, recording its kernels; return ``replay()``, which reruns them on
    whatever ``args``' tensors then hold and returns the same output tensor. Raises
    :class:`NotReplayable` where the forward is not only recorded kernels."""
    global _recording
    calls, mode = CallList(), _AllocationsOnly()
    if _recording is not None:
        raise NotReplayable("a capture is already running")
    _recording = calls
    try:
        with mode:
            out = fn(*args)
    finally:
        _recording = None
    if not isinstance(out, torch.Tensor) or not any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in mode.allocated):
        raise NotReplayable("the forward's output is not a tensor it allocated")
    expected = out.clone()
    for t in mode.allocated:
        if t.is_floating_point():
            t.fill_(math.nan)
    calls.run()
    if not torch.equal(out, expected):
        raise NotReplayable("a replay differs from the eager run: some kernel ran outside NativeFunction")
    kept = (args, mode.kept)  # the addresses in the list: inputs, outputs, intermediates

    def replay() -> torch.Tensor:
        calls.run()
        return out

    replay.kept = kept  # type: ignore[attr-defined]
    replay.calls = calls  # type: ignore[attr-defined]
    return replay
