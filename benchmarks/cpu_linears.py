"""SmolLM2-135M's linear layers, one pass of all 30 layers (qkv, o, gate_up, down; each layer
its own weights, so they come from memory as in a real step), per kernel and row count.

Kernels: ``onednn`` (PackedLinear, bfloat16), ``onednn-fp32`` (PackedLinear, float32), ``avx2``
(Avx2Linear: float32 rows, the weights held in bfloat16), ``amx`` (AmxLinear, bfloat16),
``avx512bf16`` (Avx512Linear, bfloat16), ``int4`` (torch's
int4 kernel, groups of 32), ``int4-amx`` (the same int4 layers widened to bfloat16 tiles per
call, from AMX_INT4_FROM_ROWS rows on), ``int8`` (torch's int8 kernel, widened weights and
F.linear from 16 rows), ``int8-amx`` (int8 codes widened to bfloat16 tiles per call), ``w8a8``
(oneDNN's int8 product), ``w8a8-amx`` (the AMX-INT8 kernel), ``int8-panels`` (Int8PanelLinear: int8
codes on the AVX512_BF16 panels, bfloat16 rows) and ``int8-panels-fp32`` (the same on the float32
panels, float32 rows), ``int4-panels`` (the int4 layers in one native call on AVX512_BF16: their
nibbles multiplied directly below 8 rows, widened to bfloat16 panels from 8; ``int4-panels-fp32`` the
same on the float32 panels, float32 rows), ``q8_0-panels``, ``q6_k-panels``, ``q5_1-panels`` (random
codes held as those GGUF formats are, in one native call: directly for few rows, widened beyond). Prints ms per pass and each kernel's ratio to the
first one named, all measured in this run, and at one row how fast each kernel reads the bytes
it holds. ``--model llama-1b``: a Llama-3.2-1B-like model's 16 layers instead (dims multiples
of 256). Run it on a quiet machine; it prints the CPU.

``--baseline-source DIR/cpu_avx2_linear.cpp`` also builds another version of the ``avx2`` kernel
(say ``git archive REV native | tar -x -C /tmp/old``, then ``/tmp/old/native/cpu_avx2_linear.cpp``:
its headers are read from beside it) and times its passes and this tree's alternated in this
process, the order swapped every round, at each row count below ``LIBRARY_FROM_ROWS`` where
this CPU's layers leave the kernel for oneDNN's product (AMD's up to Zen 4 never do: the
layers are built as the platform builds them here): the way a change to the kernel is
measured on a machine whose speed drifts, as ``cpu_attention.py --baseline-source`` does.
``DIR/cpu_avx512_linear.cpp`` does the same for the ``avx512bf16`` kernel, at any row count.

``--against-library`` times the ``avx2`` and ``int4-panels-fp32`` passes (those in ``--kernels``)
on their panels at every row count and widened for oneDNN's product at every row count,
alternated: where this CPU's prefill chunks should leave the panels (``cpu.library_from_rows``).

    python benchmarks/cpu_linears.py --kernels amx,int4,int4-amx --rows 1,8,16,64,256,1024
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from modserve.bench.roofline import held_weight_bytes
from modserve.core.models.gguf_quantized import TwoLevelScales
from modserve.plugins.platforms.cpu import describe_cpu, library_from_rows
from modserve.plugins.platforms.cpu_amx_linear import AmxLinear
from modserve.plugins.platforms.cpu_avx2_linear import INT4_LIBRARY_FROM_ROWS, LIBRARY_FROM_ROWS, PANELS_ONLY, Avx2Linear
from modserve.plugins.platforms.cpu_avx2_linear import load_codes as avx2_linear_codes
from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear
from modserve.plugins.platforms.cpu_avx512_linear import load_codes as avx512_linear_codes
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear, group_int8_kernel
from modserve.plugins.platforms.cpu_linear import PackedLinear
from modserve.plugins.platforms.cpu_memory import keep_freed_memory
from modserve.plugins.platforms.cpu_panel_linear import load_kernel
from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, Int8GroupLinear, Int8WeightOnlyLinear, W8A8Linear

MODELS = {  # (out, in) of each layer, and the layers: SmolLM2-135M, and a Llama-3.2-1B-like model (dims multiples of 256)
    "smollm2": ({"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}, 30),
    "llama-1b": ({"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}, 16),
}
SHAPES, LAYERS = MODELS["smollm2"]
AVX2_LIBRARY_FROM_ROWS = library_from_rows(LIBRARY_FROM_ROWS)  # where this CPU's avx2 layers leave the kernel
LIBRARY_KERNELS = ("avx2", "int4-panels-fp32")  # --against-library: float32 panel layers that may widen for oneDNN's product
FLOAT32_KERNELS = ("onednn-fp32", "avx2", "int8-panels-fp32", "int4-panels-fp32")  # take float32 rows
BASELINE_KERNELS = {  # --baseline-source's file name: the kernel kind it builds, and that kernel's entry point
    "cpu_avx2_linear.cpp": ("avx2", "modserve_avx2_linear", "AVX2 and FMA"),
    "cpu_avx512_linear.cpp": ("avx512bf16", "modserve_avx512_linear", "AVX512_BF16"),
}
KINDS = ("onednn", "onednn-fp32", "avx2", "amx", "avx512bf16", "w8a8", "w8a8-amx", "int8", "int8-amx", "int8-panels",
         "int8-panels-fp32", "int4", "int4-amx", "int4-panels", "int4-panels-fp32", "q8_0-panels", "q6_k-panels", "q5_1-panels")
GROUP_CODES = {"q8_0-panels": (32, None), "q6_k-panels": (16, 64), "q5_1-panels": (32, 32)}  # group, unsigned codes below (or int8)


def gguf_like(kind: str, lin: nn.Linear, n: int, k: int) -> Int8GroupLinear:
    """Random codes held as the GGUF format ``kind`` names holds them: Q8_0 int8 codes with float16
    scales; Q6_K 6-bit codes around 32 with two-level scales (an int8 a group of 16, float16 per
    256 inputs, or per the largest power of two of groups dividing K below that); Q5_1 5-bit codes
    with float16 scales and minima."""
    group, below = GROUP_CODES[kind]
    groups = k // group
    half = lambda t: t.half().float()  # noqa: E731
    if below is None:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return Int8GroupLinear(lin, codes, half(torch.rand(n, groups) * 0.01), group, torch.float16)
    codes = torch.randint(0, below, (n, k), dtype=torch.int8)
    if kind == "q6_k-panels":
        per_block = math.gcd(groups, 256 // group)
        outer, inner = half(torch.rand(n, groups // per_block) * 1e-3), torch.randint(-128, 128, (n, groups), dtype=torch.int8)
        scale = outer.repeat_interleave(per_block, dim=1) * inner.float()
        return Int8GroupLinear(lin, codes, scale, group, torch.float32, None, True, 32, TwoLevelScales(outer, inner))
    return Int8GroupLinear(lin, codes, half(torch.rand(n, groups) * 0.01), group, torch.float32, half(torch.rand(n, groups) - 0.5), True)


def build(kind: str) -> dict[str, list[nn.Module]]:
    torch.manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        layers = []
        for _ in range(LAYERS):
            lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            if kind == "onednn":
                layers.append(PackedLinear(lin))
            elif kind == "onednn-fp32":
                layers.append(PackedLinear(lin.float()))
            elif kind == "avx2":
                layers.append(Avx2Linear(lin.float(), AVX2_LIBRARY_FROM_ROWS))  # as the platform builds it on this CPU
            elif kind == "amx":
                layers.append(AmxLinear(lin))
            elif kind == "avx512bf16":
                layers.append(Avx512Linear(lin))
            elif kind == "int8-panels":
                layers.append(Int8PanelLinear(lin, avx512_linear_codes(), torch.bfloat16))
            elif kind == "int8-panels-fp32":
                layers.append(Int8PanelLinear(lin.float(), avx2_linear_codes(), torch.float32))
            elif kind in GROUP_CODES:  # GGUF Q8_0-, Q6_K- or Q5_1-like codes (random) on the panel kernel
                module = gguf_like(kind, lin, n, k)
                module.use_panels(group_int8_kernel(torch.bfloat16, below_128=module.below_128), torch.bfloat16)
                layers.append(module)
            elif kind.startswith("w8a8"):
                layers.append(W8A8Linear(lin, amx=kind == "w8a8-amx"))
            elif kind.startswith("int8"):
                layers.append(Int8WeightOnlyLinear(lin, amx=kind == "int8-amx"))
            else:
                module = Int4WeightOnlyLinear(lin.float() if kind in FLOAT32_KERNELS else lin, 32)
                module.amx = kind == "int4-amx"
                module.panels = kind.startswith("int4-panels")
                module.library_from_rows = library_from_rows(INT4_LIBRARY_FROM_ROWS)
                layers.append(module)
        out[name] = layers
    return out


def one_pass(layers: dict[str, list[nn.Module]], xs: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for i in range(LAYERS):
        for name in SHAPES:
            layers[name][i](xs[name])
    return time.perf_counter() - t0


def against_baseline(built: dict[str, dict[str, list[nn.Module]]], source: str, rows_list: list[int], rounds: int) -> None:
    """The passes of the layers of --baseline-source's kernel kind with its build and this
    tree's, alternated (the order swapped every round): median times, the median of the rounds'
    ratios, and the largest difference between the two builds' outputs."""
    kind, symbol, instructions = BASELINE_KERNELS[Path(source).name]
    layers = built[kind]
    dtype = torch.float32 if kind in FLOAT32_KERNELS else torch.bfloat16
    modules = [m for group in layers.values() for m in group]
    builds = {"baseline": load_kernel(Path(source), f"the baseline {kind} linear kernel", symbol, instructions),
              "this tree": modules[0]._kernel}

    def run(name: str, xs: dict[str, torch.Tensor]) -> float:
        for m in modules:
            m._kernel = builds[name]
        return one_pass(layers, xs)

    print(f"against --baseline-source {source}, {rounds} alternated rounds:")
    try:
        for rows in rows_list:
            xs = {name: torch.randn(rows, k).to(dtype) for name, (_, k) in SHAPES.items()}
            times, outs = {name: [] for name in builds}, {}
            with torch.inference_mode():
                for name in builds:
                    run(name, xs)
                    outs[name] = torch.cat([layers[n][0](xs[n]).float().flatten() for n in SHAPES])
                for r in range(rounds):
                    for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                        times[name].append(run(name, xs))
            old, new = times["baseline"], times["this tree"]
            print(f"{rows:>6} rows: baseline {statistics.median(old) * 1e3:.2f} ms, "
                  f"this tree {statistics.median(new) * 1e3:.2f} ms "
                  f"(medians), median ratio {statistics.median(a / b for a, b in zip(old, new)):.3f}x, "
                  f"max |diff| {(outs['baseline'] - outs['this tree']).abs().max().item():.1e}")
    finally:
        for m in modules:
            m._kernel = builds["this tree"]


def against_library(built: dict[str, dict[str, list[nn.Module]]], kinds: list[str], rows_list: list[int], rounds: int) -> None:
    """Each float32 panel kind's passes on its panels and widened for oneDNN's product, at every
    row count, alternated (the order swapped every round): the measurement behind
    ``cpu.library_from_rows``, this CPU's choice of where prefill chunks leave the panels."""
    for kind in kinds:
        modules = [m for group in built[kind].values() for m in group]
        chosen = modules[0].library_from_rows

        def run(side: str, xs: dict[str, torch.Tensor]) -> float:
            for m in modules:
                m.library_from_rows = PANELS_ONLY if side == "panels" else 1
            return one_pass(built[kind], xs)

        where = "never" if chosen == PANELS_ONLY else f"from {chosen} rows"
        print(f"{kind} on its panels against widened for oneDNN's product, {rounds} alternated rounds (this CPU widens: {where}):")
        try:
            for rows in rows_list:
                xs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}
                times = {"panels": [], "library": []}
                with torch.inference_mode():
                    for side in times:
                        run(side, xs)
                    for r in range(rounds):
                        for side in (list(times) if r % 2 == 0 else list(times)[::-1]):
                            times[side].append(run(side, xs))
                panels, library = times["panels"], times["library"]
                print(f"{rows:>6} rows: panels {statistics.median(panels) * 1e3:.2f} ms, library {statistics.median(library) * 1e3:.2f} ms "
                      f"(medians), median ratio library/panels {statistics.median(b / a for a, b in zip(panels, library)):.3f}x")
        finally:
            for m in modules:
                m.library_from_rows = chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="amx,int4,int4-amx")
    ap.add_argument("--rows", default="1,8,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", default="smollm2", choices=MODELS, help="whose layer shapes")
    ap.add_argument("--baseline-source", help="also this version of native/cpu_avx2_linear.cpp or cpu_avx512_linear.cpp "
                    "(its headers beside it), that kernel's passes alternated with this tree's")
    ap.add_argument("--against-library", action="store_true", help="also time avx2's and int4-panels-fp32's passes "
                    "(those in --kernels) on their panels against widened for oneDNN's product, alternated; gate_up "
                    "is a plain layer here (the engine's, gated, stays on the panels)")
    ap.add_argument("--rounds", type=int, help="alternated rounds for --baseline-source and --against-library (default 15)")
    args = ap.parse_args()
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: expected whole numbers separated by commas, got {args.rows!r}")
    if args.baseline_source is None and not args.against_library and args.rounds is not None:
        ap.error("--rounds goes with --baseline-source or --against-library, neither of which is given")
    if args.against_library and not (library_kinds := [k for k in LIBRARY_KERNELS if k in args.kernels.split(",")]):
        ap.error(f"--against-library times {' and '.join(LIBRARY_KERNELS)}: add one of them to --kernels")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds: expected a whole number >= 1, got {args.rounds}")
    if args.baseline_source is not None:
        if not Path(args.baseline_source).is_file():
            ap.error(f"--baseline-source: no such file: {args.baseline_source}")
        if (name := Path(args.baseline_source).name) not in BASELINE_KERNELS:
            ap.error(f"--baseline-source: expected a copy of {' or '.join(BASELINE_KERNELS)}, got {name}")
        kind = BASELINE_KERNELS[name][0]
        if kind not in args.kernels.split(","):
            ap.error(f"--baseline-source times the {kind} kernel: add {kind} to --kernels")
        if kind == "avx2" and (too_many := [r for r in rows_list if r >= AVX2_LIBRARY_FROM_ROWS]):
            ap.error(f"--baseline-source: rows {', '.join(map(str, too_many))} run oneDNN's product on this CPU, not the kernel "
                     f"(from {AVX2_LIBRARY_FROM_ROWS} rows)")
    global SHAPES, LAYERS
    SHAPES, LAYERS = MODELS[args.model]
    kernels = args.kernels.split(",")
    if unknown := [k for k in kernels if k not in KINDS]:
        ap.error(f"--kernels: unknown {', '.join(unknown)}; expected some of {', '.join(KINDS)}")
    keep_freed_memory()  # as the cpu platform does by default (reuse_freed_memory)
    print(f"{describe_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    built = {k: build(k) for k in kernels}
    weights = sum(n * k for n, k in SHAPES.values()) * LAYERS
    held = {k: held_weight_bytes(nn.ModuleList(m for group in built[k].values() for m in group)) for k in kernels}
    print("held MB: " + ", ".join(f"{k} {held[k] / 1e6:.0f}" for k in kernels))
    print(f"{'rows':>6} " + " ".join(f"{k + ' ms':>12}" for k in kernels) + " " + " ".join(f"{k + '/' + kernels[0]:>16}" for k in kernels[1:]))
    for rows in rows_list:
        xs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}
        ms = {}
        with torch.inference_mode():
            for k in kernels:
                dtype = torch.float32 if k in FLOAT32_KERNELS else torch.bfloat16
                x = {name: v.to(dtype) for name, v in xs.items()}
                one_pass(built[k], x)
                ms[k] = 1000 * sorted(one_pass(built[k], x) for _ in range(args.repeats))[args.repeats // 2]
        ratios = " ".join(f"{ms[kernels[0]] / ms[k]:>15.2f}x" for k in kernels[1:])
        print(f"{rows:>6} " + " ".join(f"{ms[k]:>12.2f}" for k in kernels) + " " + ratios)
        if rows == 1:  # one row reads every weight once: how fast each kernel streams what it holds
            print("       one row, held bytes read at: " + ", ".join(f"{k} {held[k] / ms[k] / 1e6:.1f} GB/s" for k in kernels))
    print(f"weights per pass: {weights / 1e6:.1f} M ({2 * weights / 1e6:.0f} MB in bfloat16)")
    if args.baseline_source is not None:
        against_baseline(built, args.baseline_source, rows_list, args.rounds or 15)
    if args.against_library:
        against_library(built, library_kinds, rows_list, args.rounds or 15)


if __name__ == "__main__":
    main()
