"""Mixtures of experts in one native call (the ``cpu`` platform's
:meth:`~modserve.core.contract.platform.Platform.experts`): a bfloat16 model's on AVX512_BF16
CPUs, a float32 model's whose experts bfloat16 holds exactly (a bfloat16 checkpoint served in
float32) on AVX2 and FMA.

Why: the model's :class:`~modserve.plugins.models.moe.SparseMoE` runs torch's grouped products,
which on a Zen 5 read one token's picked experts (Qwen3-30B-A3B's shapes) at a quarter of the
machine's read bandwidth (this kernel: 75%; docs/cpu_experts.md), and sizes its expert batches
on the host, so a decode step with experts could not replay as a call list. :class:`PanelExperts`
holds every expert as packed bfloat16 panels (:mod:`cpu_panel_linear`'s layout, the gate and up
panels paired) and ``native/cpu_experts.cpp`` routes, multiplies and sums in one call; the
router stays a linear layer of the platform's. With ``int8`` the panels hold int8 codes instead
(:mod:`cpu_int8_experts`' quantization), widened in registers: half the bytes a token reads.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from modserve.core.contract import NativeFunction
from modserve.core.contract.experts import ExpertMLP
from modserve.native.build import SOURCES
from modserve.plugins.platforms.cpu_avx2_linear import exact_in_bfloat16
from modserve.plugins.platforms.cpu_panel_linear import TILE_N, gated_pairs, load_kernel, pack, pack_tiles, tile_rows
from modserve.plugins.platforms.cpu_quant import quantize_per_channel_int8

SOURCE = SOURCES / "cpu_experts.cpp"
BUILDS = {  # the model's dtype: the kernel's symbol and the instructions it needs
    torch.bfloat16: ("modserve_experts", "AVX512_BF16"),
    torch.float32: ("modserve_experts_f32", "AVX2 and FMA"),
}


@functools.cache
def load(dtype: torch.dtype = torch.bfloat16, extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """The compiled kernel for a model of ``dtype`` (``extra_flags`` ``("-mno-avx512f",)``: the
    float32 build's AVX2 width on an AVX-512 CPU, as the tests do); raises ``KernelUnavailable``
    where it cannot be built, or where the compiler does not target its instructions on this CPU
    (``-march=native``)."""
    symbol, instructions = BUILDS[dtype]
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    args = [ptr, i64, i64, ptr, i64, i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32, ptr, i64, i32]
    return load_kernel(SOURCE, "the mixture-of-experts kernel", symbol, instructions, extra_flags, args, ctypes.c_int)


def unsupported(moe: ExpertMLP, int8: bool = False) -> str | None:
    """Why :class:`PanelExperts` cannot compute ``moe`` (None where it can); ``int8``: as codes
    (any float32 experts then: the codes are exact in bfloat16)."""
    dtype = moe.w13.dtype
    if dtype not in BUILDS:
        return f"experts in {str(dtype).removeprefix('torch.')} (the kernel multiplies bfloat16 or float32)"
    if moe.intermediate % TILE_N:
        return f"expert width {moe.intermediate} is not a multiple of {TILE_N} (the gated panels pair 16 columns)"
    if dtype == torch.float32 and not int8 and not all(exact_in_bfloat16(w[e]) for w in (moe.w13, moe.w2) for e in range(w.shape[0])):
        return "float32 experts that bfloat16 cannot hold (a float32 checkpoint; rounding them would change the model)"
    return None


class PanelExperts(ExpertMLP):
    """``moe``'s map (:class:`ExpertMLP`) with its experts packed as bfloat16 panels and computed by
    one kernel call after the router's product, in the model's dtype (bfloat16, or float32 over
    experts :func:`unsupported` found exact in bfloat16); capturable (no host waits). ``int8``:
    the panels hold each expert's int8 codes and the kernel applies their channel scales to its
    float32 sums (``(x @ q.T) * scale``, rounded once to the model's dtype)."""

    capturable = True

    def __init__(self, moe: ExpertMLP, extra_flags: tuple[str, ...] = (), int8: bool = False) -> None:
        super().__init__()
        self.dtype, self.int8 = moe.w13.dtype, int8
        self._kernel = load(self.dtype, extra_flags)
        self.gate = moe.gate
        self.num_experts, self.top_k, self.intermediate = moe.num_experts, moe.top_k, moe.intermediate
        self.norm_topk_prob = moe.norm_topk_prob
        self.hidden = moe.w13.shape[2]
        w13, scale13 = _pack_each(moe.w13, gated=True, int8=int8)
        w2, scale2 = _pack_each(moe.w2, gated=False, int8=int8)
        self.register_buffer("w13", w13, False)  # [E, 2I/16 panels (gate, up pairs), ...]
        self.register_buffer("w2", w2, False)  # [E, H/16 panels, ...]
        self.register_buffer("scale13", scale13, False)  # int8: [E, 2I] float32, in the panels' order; else None
        self.register_buffer("scale2", scale2, False)  # int8: [E, H rounded up to 16]; else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden:
            want = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"{type(self).__name__}: {want} rows of {self.hidden} features, got {x.dtype} {tuple(x.shape)}")
        rows = tile_rows(x)
        logits = self.gate(rows)
        out = torch.empty(rows.shape[0], self.hidden, dtype=self.dtype)
        failed = self._kernel(
            rows.data_ptr(), rows.stride(0), rows.shape[0], logits.data_ptr(), logits.stride(0), self.num_experts,
            self.top_k, self.norm_topk_prob, self.w13.data_ptr(), self.w2.data_ptr(), _address(self.scale13),
            _address(self.scale2), self.hidden, self.intermediate, out.data_ptr(), self.hidden, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise RuntimeError(f"the mixture-of-experts kernel failed ({failed})")
        return out

    def extra_repr(self) -> str:
        codes = ", int8" if self.int8 else ""
        return f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, intermediate={self.intermediate}{codes}"


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pack_each(weights: torch.Tensor, gated: bool, int8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each expert's ``[N, K]`` weights packed as panels (gated: as (gate, up) pairs), stacked, as
    bfloat16, or (``int8``) as codes with their channel scales (``[E, N rounded up to 16]``
    float32, in the panels' order); one expert at a time, so packing holds one expert's copy
    beside the stacked weights."""

    def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not int8:
            return pack(w), None
        codes, scale = quantize_per_channel_int8(w)
        return pack_tiles(codes), F.pad(scale, (0, -scale.shape[0] % TILE_N)).view(-1, TILE_N)

    first, first_scale = packed(weights[0])
    out = torch.empty((weights.shape[0], *first.shape), dtype=first.dtype)
    scales = None if first_scale is None else torch.empty((weights.shape[0], first_scale.numel()), dtype=torch.float32)
    for e in range(weights.shape[0]):
        w, scale = (first, first_scale) if e == 0 else packed(weights[e])
        out[e] = gated_pairs(w) if gated else w
        if scales is not None:
            scales[e] = (gated_pairs(scale) if gated else scale).reshape(-1)
    return out, scales
