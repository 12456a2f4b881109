"""Platform ``cpu``: any x86/ARM CPU torch runs on, with packed linear layers.

What it adds over plain torch: linear weights packed once for the product kernel (for
bfloat16, panels read by AMX tiles where the CPU has AMX-BF16, :mod:`cpu_amx_linear`, or by
VDPBF16PS where it has AVX512_BF16, :mod:`cpu_avx512_linear`; for float32 on an AVX2 CPU, the
same bfloat16 panels multiplied in float32 where bfloat16 holds the weights exactly,
:mod:`cpu_avx2_linear`; else oneDNN's blocked layout, :mod:`cpu_linear`), the model's fused
C++ elementwise kernels, freed step memory kept in the process (:mod:`cpu_memory`), and the
compiled ``cpu`` paged-attention kernel as the default attention backend where the machine's
C++ compiler can build it.
"""

from __future__ import annotations

import functools
import logging
import os
import platform as host
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import nn

from modserve.core import native_calls
from modserve.core.config import ConfigError
from modserve.core.contract import DeviceInfo, NativeFunction, Platform, hookimpl
from modserve.core.contract.experts import ExpertMLP
from modserve.core.models.kept_weights import KeptLinear
from modserve.native.build import KernelUnavailable
from modserve.plugins.platforms import cpu_amx_linear as amx_linear
from modserve.plugins.platforms import cpu_avx2_linear as avx2_linear
from modserve.plugins.platforms import cpu_avx512_linear as avx512_linear
from modserve.plugins.platforms import cpu_experts, cpu_int8_experts
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear, group_int8_kernel
from modserve.plugins.platforms.cpu_linear import PackedLinear, can_pack
from modserve.plugins.platforms.cpu_memory import keep_freed_memory
from modserve.plugins.platforms.cpu_panel_linear import PanelLinear
from modserve.plugins.platforms.cpu_prequantized import CHECKPOINT_SCHEMES, checkpoint_linear
from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, Int8GroupLinear, QuantizedLinear, gguf_linear, quantize_linear
from modserve.plugins.platforms.cpu_split_linear import ColumnSplitLinear

MODSERVE_CONTRACT = "2.8"  # DeviceInfo.kernels; its AMX linears are GatedLinear; decode graphs as native call lists; experts
log = logging.getLogger("modserve.platform")

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "avx_ne_convert")
GRAPH_MAX_BATCH = 16  # graph_max_batch's default: lists of 17-64 requests ran 0.94-0.95x eager on a Zen 5


class CPUConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pack_weights: bool = True  # hold linear weights packed for the product kernel (faster matmuls); false: plain nn.Linear
    linear_kernel: Literal["auto", "amx", "avx512bf16", "avx2", "onednn"] = "auto"  # float weights' products: own AMX tiles (bfloat16, AMX-BF16 CPUs), own VDPBF16PS kernel (bfloat16, AVX512_BF16 CPUs), own AVX2/FMA kernel, AVX-512 wide where the CPU has it (float32 layers whose weights bfloat16 holds exactly, e.g. a bfloat16 checkpoint: held in bfloat16, half the bytes), oneDNN, or auto (bfloat16: amx, else avx512bf16; float32: avx2; where each runs); where amx runs, bfloat16 int8, w8a8 and int4 layers use tiles too
    fuse_ops: bool = True  # in float32 or bfloat16, run norms, SiLU·mul and RoPE as fused C++ kernels
    reuse_freed_memory: bool = True  # glibc: keep freed step memory in the process instead of faulting it in again every step
    quantization: Literal["none", "int8", "w8a8", "int4", "gguf", "gptq", "awq", "compressed-tensors"] = "none"  # linear weights (int8: mixtures of experts' experts too): int8 weight-only, int8 weights and activations (per token), int4 weight-only groups, a GGUF file's Q8_0/Q6_K/Q5_K/Q5_0/Q5_1/Q4_K/Q4_0/Q4_1 blocks kept as they are, or a pre-quantized HF checkpoint's weights kept (docs/quantization.md)
    int4_group_size: Literal[32, 64, 128, 256] | None = None  # quantization: int4 only (default 128): inputs per scale/zero group; a layer whose in_features it does not divide takes the largest smaller size that does
    quantize_lm_head: bool | None = None  # quantize the LM head too (a tied head gets its own quantized copy, with gguf the embedding's blocks; the embedding stays as loaded); default: only gguf's own head tensor, kept as its blocks (as llama.cpp and vLLM read it), a head tied to the embedding stays the shared float weight
    decode_graphs: bool = True  # replay decode steps of up to graph_max_batch requests as recorded kernel call lists (one C call a step; docs/cpu_decode_graphs.md); where the forward is not all recordable kernels, steps run eagerly and the log says why
    graph_max_batch: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None  # decode_graphs only (default 16): the largest decode batch replayed; each size from 1 is recorded at a server's start-up (offline: the first time it runs)

    def __post_init__(self) -> None:
        if self.graph_max_batch is not None and not self.decode_graphs:
            raise ValueError(f"graph_max_batch: applies to decode call lists, which decode_graphs: false turns off, got {self.graph_max_batch}")


class CPUPlatform(Platform):
    Config = CPUConfig

    def __init__(self, config: CPUConfig, ctx) -> None:
        super().__init__(config, ctx)
        if config.quantization in CHECKPOINT_SCHEMES and config.quantize_lm_head:
            raise ValueError(
                f"device.quantize_lm_head: a {config.quantization} checkpoint's head is kept as the checkpoint stores it; "
                "quantize_lm_head applies to int8, w8a8 and int4"
            )
        if config.quantization == "none" and config.quantize_lm_head:
            raise ValueError("device.quantize_lm_head: nothing is quantized (quantization: none); set a quantization scheme")
        if config.int4_group_size is not None and config.quantization != "int4":
            raise ValueError(
                f"device.int4_group_size: applies to quantization: int4, not {config.quantization} "
                "(gguf and pre-quantized checkpoints keep the file's groups)"
            )
        self.float_kernel = _float_kernel(config)  # what multiplies bfloat16 weights: amx, avx512bf16 or onednn
        self.float32_kernel = _float32_kernel(config)  # float32 layers that bfloat16 holds exactly: avx2 or onednn
        self.amx_linears = self.float_kernel == "amx"
        self.amx_int8 = self.amx_linears and _int8_tiles_build(config)  # W8A8 on AMX-INT8 tiles
        self.kept_layers = 0  # layers built from a pre-quantized checkpoint's codes
        self.kept_experts_note = False  # the log said once why experts keep torch's products
        self.experts_quantization_note = False  # ... and that a quantization scheme leaves experts in floats
        self.routers: set[str] = set()  # the mixtures of experts' routers (linear layers no scheme quantizes)
        self.unrecorded_linear: str | None = None  # a layer that multiplies through torch (no decode call lists)
        if config.reuse_freed_memory:  # before anything is loaded: the weights too come from the kept heap
            keep_freed_memory()

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def info(self) -> DeviceInfo:
        dtypes = ("float32", "bfloat16", "float16") if _packs(torch.bfloat16) else ("float32", "float16")
        bf16 = {"amx": "AMX tiles", "avx512bf16": "AVX512_BF16 panels", "onednn": "oneDNN packed"}[self.float_kernel]
        fp32 = "oneDNN packed"
        if self.float32_kernel == "avx2":
            library = library_from_rows(avx2_linear.LIBRARY_FROM_ROWS)
            chunks = "at every row count" if library == avx2_linear.PANELS_ONLY else f"from {library} rows widened for oneDNN"
            fp32 = f"float32 FMAs over bfloat16-held weights where exact (prefill chunks: {chunks}), else oneDNN packed"
        linears = f"{bf16} in bfloat16, {fp32} in float32" if bf16 != fp32 else fp32
        kernels = [f"linears: {linears if self.config.pack_weights else 'plain nn.Linear'}"]
        if self.config.quantization != "none":
            quantized = _quantized_kernels(self.config.quantization, self.amx_linears, self.amx_int8)
            panels = [str(d).removeprefix("torch.") for d in (torch.bfloat16, torch.float32) if self._panels_for(d)]
            if panels and self.config.quantization == "int8":
                quantized = f"panel kernels over int8 codes in {' and '.join(panels)}, else {quantized}"
            elif panels and self.config.quantization not in ("none", "w8a8"):
                quantized = (f"int4 and group-scaled int8 (Q8_0, Q6_K, Q5_x) layers: one native call on the panel kernels in {' and '.join(panels)} "
                             f"where their shapes fit; {quantized}")
            kernels.append(f"quantized linears ({self.config.quantization}): {quantized}")
        calls = ["AVX512_BF16 in bfloat16"] if self.float_kernel == "avx512bf16" else []
        calls += ["float32 FMAs over bfloat16-held experts where exact"] if self.float32_kernel == "avx2" else []
        experts = f"one call a layer ({', '.join(calls)}), else torch's grouped products" if calls else "torch's grouped products"
        if self.config.quantization == "int8":
            experts = "int8 codes, one call a layer where the kernel builds (AVX512_BF16 in bfloat16, AVX2 FMAs in float32), else widened in torch"
        kernels.append(f"mixtures of experts: {experts}")
        return DeviceInfo(describe_cpu(), _total_memory(), dtypes, tuple(kernels))

    def default_dtype(self) -> str:
        """``model.dtype: auto``: bfloat16 where the CPU computes it natively (AMX-BF16 or
        AVX512_BF16, and oneDNN packs it), else float32 (emulated bfloat16 ran about 3x slower
        than float32 on an AVX2-only EPYC)."""
        _, flags = cpu_model_and_flags()
        native = bool(flags & {"amx_bf16", "avx512_bf16"})
        return "bfloat16" if native and _packs(torch.bfloat16) else "float32"

    def default_attention(self, dtype: str) -> str:
        """The compiled ``cpu`` kernel where a C++ compiler can build it (float32/bfloat16), else ``torch``."""
        if dtype == "float16":
            return "torch"
        from modserve.plugins.attention import cpu_kernel_build

        try:
            cpu_kernel_build.load()
        except cpu_kernel_build.KernelUnavailable as e:
            log.warning("attention auto: %s; using the torch backend", e)
            return "torch"
        return "cpu"

    def _int4_library_from_rows(self) -> int:
        """float32 rows from which int4 layers on the panels take oneDNN's product: past every
        decode batch a call list records (one torch operator in a step would turn them all off)."""
        recorded = (self.config.graph_max_batch or GRAPH_MAX_BATCH) if self.config.decode_graphs else 0
        return max(library_from_rows(avx2_linear.INT4_LIBRARY_FROM_ROWS), recorded + 1)

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Every size from 1 to ``graph_max_batch``: on a CPU a padded row costs its full share
        of the products, so each batch size gets a call list of its own. none where a linear
        layer is torch's (oneDNN's float32 or quantized products), which a list cannot replay."""
        if not self.config.decode_graphs or self.unrecorded_linear is not None:
            return ()
        return tuple(range(1, (self.config.graph_max_batch or GRAPH_MAX_BATCH) + 1))

    def capture_graph(self, fn: Callable[..., Any], example_args: tuple) -> Callable[[], Any] | None:
        """The forward as a recorded call list (:mod:`modserve.core.native_calls`), or None,
        logging why, where it computes anything outside recordable kernels (e.g. oneDNN's
        float32 products, an int8 KV cache's torch quantization)."""
        try:
            return native_calls.capture(fn, example_args)
        except native_calls.NotReplayable as e:
            log.warning("device.decode_graphs: %s", e)
            return None

    def linear(self, name: str, layer: nn.Linear) -> nn.Module:
        module = self._linear(name, layer)
        if self.unrecorded_linear is None and name != "lm_head" and not _records(module):
            self.unrecorded_linear = name  # computes through torch: a decode forward cannot be a call list
            if self.config.decode_graphs:
                log.info("device.decode_graphs: off, linear %s multiplies through torch", name)
        return module

    def _linear(self, name: str, layer: nn.Linear) -> nn.Module:
        module = self._quantized(name, layer)
        if module is not layer:
            for piece in module.pieces if isinstance(module, ColumnSplitLinear) else [module]:  # each piece of a GGUF layer mixing kinds
                if isinstance(piece, Int4WeightOnlyLinear):
                    piece.amx = self.amx_linears  # many rows: widened to bfloat16 tiles on AMX
                    piece.use_panels(self._panels_for(piece.scales_and_zeros.dtype))  # ... or one native call on our panel kernels
                    piece.library_from_rows = self._int4_library_from_rows()
                if isinstance(piece, Int8GroupLinear) and self._panels_for(layer.dtype):  # kept: GGUF Q8_0 / Q6_K / Q5_x, GPTQ 8-bit
                    piece.use_panels(group_int8_kernel(layer.dtype, below_128=piece.below_128), layer.dtype)
            return module
        if not self.config.pack_weights:
            return layer
        if layer.weight.dtype == torch.bfloat16 and self.float_kernel != "onednn":
            return (amx_linear.AmxLinear if self.amx_linears else avx512_linear.Avx512Linear)(layer)
        if layer.weight.dtype == torch.float32 and self.float32_kernel == "avx2":
            if avx2_linear.exact_in_bfloat16(layer.weight):
                return avx2_linear.Avx2Linear(layer, library_from_rows(avx2_linear.LIBRARY_FROM_ROWS))
            if self.config.linear_kernel == "avx2":
                raise ValueError(
                    f"device.linear_kernel: avx2 holds float32 weights in bfloat16, but {name} has weights bfloat16 cannot "
                    "hold (a float32 checkpoint; rounding them would change the model); use auto or onednn"
                )
        asked = self.config.linear_kernel
        if asked in ("amx", "avx512bf16", "avx2") and layer.weight.dtype != (torch.float32 if asked == "avx2" else torch.bfloat16):
            want = "float32" if asked == "avx2" else "bfloat16"
            raise ValueError(f"device.linear_kernel: {asked} runs {want} weights, not {layer.weight.dtype}; use auto or onednn")
        if _packs(layer.weight.dtype):
            return PackedLinear(layer)
        return layer

    def _quantized(self, name: str, layer: nn.Linear) -> nn.Module:
        """The quantized module for ``layer`` under ``quantization``, or ``layer`` itself."""
        if self.config.quantization in CHECKPOINT_SCHEMES:
            kept = checkpoint_linear(self.config.quantization, name, layer, self.amx_linears, self.amx_int8, self._int8_panel_kernel)
            self.kept_layers += kept is not layer
            return kept
        if self.config.quantization == "none" or (name == "lm_head" and not self._quantizes_head(layer)):
            return layer
        if name in self.routers and self.config.quantization != "gguf":  # a GGUF file's router stays as stored
            return layer  # as vLLM and llama.cpp keep it: an expert's choice turns on small differences of its logits
        if self.config.quantization == "int8" and (kernel := self._int8_panel_kernel(layer.weight.dtype)) is not None:
            return Int8PanelLinear(layer, kernel, layer.weight.dtype)
        if self.config.quantization != "gguf":
            amx = self.amx_int8 if self.config.quantization == "w8a8" else self.amx_linears
            return quantize_linear(self.config.quantization, name, layer, self.config.int4_group_size or 128, amx)
        return gguf_linear(name, layer)  # the layer itself where the file stores it as floats

    def _quantizes_head(self, head: nn.Linear) -> bool:
        """``quantize_lm_head``, or by default whether the head is a GGUF file's own tensor under
        ``gguf``: its blocks kept replace the float weight, exactly; a head tied to the embedding
        would get a copy beside it (more memory, and slower than the float head from 16 rows)."""
        if self.config.quantize_lm_head is not None:
            return self.config.quantize_lm_head
        return self.config.quantization == "gguf" and isinstance(head, KeptLinear) and not head.tied

    def _panels_for(self, dtype: torch.dtype) -> bool:
        """Whether this dtype's float linears run on our panel kernels without AMX (bfloat16 on
        AVX512_BF16, float32 on AVX2): then quantized layers take those kernels' entries too."""
        return self.float_kernel == "avx512bf16" if dtype == torch.bfloat16 else dtype == torch.float32 and self.float32_kernel == "avx2"

    def _int8_panel_kernel(self, dtype: torch.dtype) -> NativeFunction | None:
        """The panel kernel's int8 entry where :meth:`_panels_for` (AMX CPUs widen int8 codes
        to tiles instead), else None."""
        if not self._panels_for(dtype):
            return None
        return avx512_linear.load_codes() if dtype == torch.bfloat16 else avx2_linear.load_codes()

    def experts(self, name: str, moe: ExpertMLP) -> ExpertMLP:
        """One native call per mixture of experts (:mod:`cpu_experts`) where the model's linears
        are our own panel kernels: bfloat16 on AVX512_BF16 panels, float32 over bfloat16-held
        experts on AVX2. Elsewhere the model's grouped products, and the log says why once (on
        AMX CPUs oneDNN's tiles multiply them faster at prefill than these panels would).
        ``quantization: int8``: int8 experts (:mod:`cpu_int8_experts`), on the kernel wherever it
        builds for the model's dtype, else in torch; the router stays in floats."""
        self.routers.add(f"{name}.gate")
        int8 = self.config.quantization == "int8"
        if self.config.quantization not in ("none", "int8") and not self.experts_quantization_note:
            log.warning(
                "device.quantization %s: mixtures of experts keep their experts and routers in %s (the scheme quantizes "
                "the other linear layers; of the schemes only int8 quantizes experts)", self.config.quantization,
                str(moe.w13.dtype).removeprefix("torch."),
            )  # fmt: skip
            self.experts_quantization_note = True
        why = cpu_experts.unsupported(moe, int8=True) if int8 else self._experts_unavailable(moe)
        if why is None:
            try:
                return cpu_experts.PanelExperts(moe, int8=int8)
            except KernelUnavailable as e:  # the instructions are there, the kernel did not build
                why = str(e)
        if not self.kept_experts_note:
            log.info("device: mixtures of experts run %s (%s)", "int8 codes widened in torch" if int8 else "torch's grouped products", why)
            self.kept_experts_note = True
        return cpu_int8_experts.Int8LoopedExperts(moe) if int8 else moe

    def _experts_unavailable(self, moe: ExpertMLP) -> str | None:
        if not self.config.pack_weights:
            return "pack_weights is false"
        if moe.w13.dtype == torch.bfloat16 and self.float_kernel != "avx512bf16":
            return f"the bfloat16 linears are {self.float_kernel}'s, not AVX512_BF16 panels"
        if moe.w13.dtype == torch.float32 and self.float32_kernel != "avx2":
            return "the float32 linears are oneDNN's"
        return cpu_experts.unsupported(moe)

    def prepare_model(self, model: nn.Module) -> None:
        if self.config.quantization in CHECKPOINT_SCHEMES and not self.kept_layers:
            raise ConfigError(
                f"device.quantization: {self.config.quantization} keeps a pre-quantized checkpoint's weights, but model.path "
                "has no quantized layer (no quantization_config); use none, int8, w8a8 or int4"
            )
        if self.config.fuse_ops:
            model.use_cpu_fused_ops()


def _records(module: nn.Module) -> bool:
    """Whether a linear layer computes through native calls only (a call list can replay it)."""
    return isinstance(module, PanelLinear) or (isinstance(module, QuantizedLinear) and module.records)


def _quantized_kernels(scheme: str, amx: bool, amx_int8: bool) -> str:
    """What runs a quantization scheme's products here (for ``bench roofline``'s Chose: line)."""
    int4 = "torch's int4 kernel" + (", AMX tiles from 8 bfloat16 rows" if amx else "")
    w8a8 = "AMX-INT8 tiles in bfloat16, oneDNN int8 in float32" if amx_int8 else "oneDNN int8"
    torch_int8 = "torch's int8 kernel below 16 rows, widened weights from 16"
    int8 = f"bfloat16 tiles (one row: float32 FMAs) in bfloat16, {torch_int8} in float32" if amx else torch_int8
    return {
        "int8": int8,
        "w8a8": w8a8,
        "int4": int4,
        "gguf": f"Q4_0/Q4_1/Q4_K: {int4}; Q8_0, Q6_K, Q5_x and mixed layers: int8 codes widened per call",
    }.get(scheme, f"int4 layers: {int4}; W8A8 layers: {w8a8}; int8 weight-only layers: {int8}")


def _int8_tiles_build(config: CPUConfig) -> bool:
    """Whether W8A8 layers can run on the AMX-INT8 kernel (built only where a scheme has W8A8
    layers); where it fails to build they keep oneDNN's int8 product, and a warning says why."""
    if config.quantization not in ("w8a8", "compressed-tensors"):
        return False
    from modserve.plugins.platforms import cpu_amx_int8

    why = amx_unavailable(cpu_amx_int8.load)
    if why is not None:
        log.warning("device.quantization %s: %s; W8A8 layers use oneDNN's int8 product", config.quantization, why)
    return why is None


def _float_kernel(config: CPUConfig) -> str:
    """What multiplies bfloat16 weights: ``amx`` (:mod:`cpu_amx_linear`) where the CPU has
    AMX-BF16 and the kernel builds, else ``avx512bf16`` (:mod:`cpu_avx512_linear`) where it has
    AVX512_BF16 and that kernel builds, else ``onednn``; a named kernel insists (and says why
    it cannot run)."""
    asked = config.linear_kernel
    if asked == "onednn" or not config.pack_weights:
        if asked != "onednn" and asked != "auto":
            raise ValueError(f"device.linear_kernel: {asked} packs the weights; it cannot go with pack_weights: false")
        return "onednn"
    kernels = (
        ("amx", {"amx_bf16"}, lambda: amx_unavailable(amx_linear.load)),
        ("avx512bf16", {"avx512_bf16"}, avx512_bf16_unavailable),
    )
    return _first_that_runs(asked, kernels, "trying the next kernel (amx, avx512bf16, onednn)")


def _float32_kernel(config: CPUConfig) -> str:
    """What multiplies float32 layers whose weights bfloat16 holds exactly: ``avx2``
    (:mod:`cpu_avx2_linear`, half the weight bytes, AVX-512 wide where the CPU has it) where
    asked for or, under ``auto``, wherever it runs (against oneDNN's float32 product on the
    same CPU: AVX2, 1.1-2.9x at 1-64 rows and within 4% at prefill sizes; AVX-512, 1.3-2.1x at
    1-64 rows, 0.99-1.05x at 256-1,024), else ``onednn``."""
    asked = config.linear_kernel
    if not config.pack_weights:
        return "onednn"
    return _first_that_runs(asked, (("avx2", {"avx2", "fma"}, avx2_unavailable),), "float32 layers use oneDNN")


def _first_that_runs(asked: str, kernels: tuple, otherwise: str) -> str:
    """The first of ``kernels`` ((name, the CPU flags it needs, why_unavailable)) that ``asked``
    (``auto`` or a name) admits and that runs here, else ``onednn``. A kernel named but unable
    to run is refused with why; under ``auto``, one whose CPU has the instructions but whose
    build failed is passed over with a warning ending in ``otherwise``."""
    for kernel, flags, unavailable in kernels:
        if asked not in ("auto", kernel):
            continue
        why = unavailable()
        if why is None:
            return kernel
        if asked == kernel:
            raise ValueError(f"device.linear_kernel: {kernel} cannot run here: {why}; use auto or onednn")
        if flags <= cpu_model_and_flags()[1]:  # a CPU with the instructions, a kernel that failed to build
            log.warning("device.linear_kernel auto: %s; %s", why, otherwise)
    return "onednn"


def avx2_unavailable() -> str | None:
    """None where this CPU has AVX2 and FMA and :mod:`cpu_avx2_linear` builds, else why not."""
    if "fma" not in cpu_model_and_flags()[1]:
        return f"this CPU ({cpu_model_and_flags()[0]}) has no FMA"
    return _unavailable("avx2", "AVX2", avx2_linear.load)


def avx512_bf16_unavailable() -> str | None:
    """None where this CPU has AVX512_BF16 and :mod:`cpu_avx512_linear` builds, else why not."""
    return _unavailable("avx512_bf16", "AVX512_BF16", avx512_linear.load)


def amx_unavailable(load: Callable[[], object]) -> str | None:
    """None where this CPU has AMX-BF16 and ``load`` (an AMX kernel's loader) builds the kernel,
    else why not: the one test behind the linear and the prefill-attention kernels' ``auto``."""
    return _unavailable("amx_bf16", "AMX-BF16", load)


def _unavailable(flag: str, instructions: str, load: Callable[[], object]) -> str | None:
    """None where this CPU has ``flag`` and ``load`` builds the kernel that needs it, else why not."""
    name, flags = cpu_model_and_flags()
    if flag not in flags:
        return f"this CPU ({name}) has no {instructions}"
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    return can_pack(torch.device("cpu"), dtype)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (none where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in fields.items()}


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; the processor name elsewhere)."""
    fields = _cpuinfo()
    if not fields:
        return host.processor() or "unknown CPU", frozenset()
    return fields.get("model name", host.processor()), frozenset(fields.get("flags", "").split())


def describe_cpu() -> str:
    """What a benchmark figure needs beside it: the model name, the family / model / stepping
    (one model name covers several generations: "AMD EPYC" is Zen 3, 4 and 5) and the ISA flags
    this project's kernels choose by, e.g. ``AMD EPYC (family 25, model 17, stepping 1; avx2,
    avx512f, avx512_bf16)``."""
    name, flags = cpu_model_and_flags()
    fields = _cpuinfo()
    ids = ", ".join(f"{key.removeprefix('cpu ')} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields)
    isa = ", ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2"
    return f"{name} ({ids}; {isa})" if ids else f"{name} ({isa})"


def library_from_rows(default: int) -> int:
    """Rows from which a float32 layer on the panels (bfloat16-held or int4) widens its weights
    for oneDNN's product instead: ``default`` (the layer kind's, measured on a Cascade Lake, whose
    two 512-bit FMA ports oneDNN's blocking uses better: 1.1-1.3x the panels at 512-1,024 rows),
    or :data:`~modserve.plugins.platforms.cpu_avx2_linear.PANELS_ONLY` on AMD cores up to family
    25 (Zen 1-4: FMAs 256 bits wide, 512-bit ones in two halves). On a Zen 4 the panels reach
    the same FMA peak without the widening: whole passes over SmolLM2's layers ran 1.08-1.26x
    the library's speed at 256-2,048 rows bfloat16-held, 1.05-1.47x as int4 (1.9x at 128;
    ``benchmarks/cpu_linears.py --against-library``). Zen 5 (family 26, full-width AVX-512)
    keeps ``default``: not measured."""
    fields = _cpuinfo()
    family = fields.get("cpu family", "")
    if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) <= 25:
        return avx2_linear.PANELS_ONLY
    return default


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


@hookimpl
def register_platforms():
    return {"cpu": CPUPlatform}
