"""Mixture-of-experts layers at Qwen3-30B-A3B's shape (hidden 2,048, 128 experts of width 768,
top 8), per implementation and token count: the cpu platform's one-call kernel
(``PanelExperts``: AVX512_BF16, or ``--dtype float32`` over bfloat16-held experts with AVX2 /
AVX-512 FMAs; ``kernel-int8``: the same over int8 codes, ``device.quantization: int8``) against
the model's own torch paths (``SparseMoE``: one ``grouped_mm`` per projection, or a loop over
the experts).

Each layer has its own weights (``--layers``, 2 by default: 2.4 GB of experts), so the picked
experts come from memory as in a real step, and every repeat routes new random tokens. Prints
ms per layer, the picked experts' bytes (as each implementation holds them) over that time (the rate a decode step is bound by)
and its share of the read bandwidth measured as ``bench roofline`` measures it,
and each implementation's time over the first one's, all measured in this run, alternated
round by round. Run it on a quiet machine; it prints the CPU.

    python benchmarks/cpu_experts.py --impls kernel,grouped --tokens 1,4,16,64,256
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from modserve.bench.roofline import _measure_bandwidth
from modserve.plugins.models.moe import SparseMoE
from modserve.plugins.platforms.cpu import describe_cpu
from modserve.plugins.platforms.cpu_avx2_linear import Avx2Linear
from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear
from modserve.plugins.platforms.cpu_experts import PanelExperts
from modserve.plugins.platforms.cpu_memory import keep_freed_memory

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
IMPLS = ("kernel", "kernel-int8", "grouped", "looped")
EXPERT_WEIGHTS = 3 * WIDTH * HIDDEN  # one expert's gate, up and down weights


def build(layers: int, dtype: torch.dtype, impls: list[str]) -> tuple[list[SparseMoE], dict[str, list[PanelExperts]]]:
    spec = SimpleNamespace(hidden_size=HIDDEN, moe=SimpleNamespace(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=WIDTH, norm_topk_prob=True))
    torch.manual_seed(0)
    models, kernels = [], {impl: [] for impl in impls if impl.startswith("kernel")}
    for _ in range(layers):
        moe = SparseMoE(spec).to(dtype)
        with torch.no_grad():
            for p in (moe.w13, moe.w2, moe.gate.weight):
                p.copy_(torch.randn(p.shape).mul_(0.02).to(torch.bfloat16))  # float32: a bfloat16 checkpoint's values
        router = (Avx512Linear if dtype == torch.bfloat16 else Avx2Linear)(moe.gate)  # as the platform's linear swap leaves it
        for impl, layers_of_impl in kernels.items():
            panels = PanelExperts(moe, int8=impl == "kernel-int8")
            panels.gate = router
            layers_of_impl.append(panels)
        models.append(moe)
    return models, kernels


def weight_bytes(impl: str, dtype: torch.dtype) -> int:
    """Bytes a weight takes as ``impl`` holds it: int8 codes, bfloat16 panels, or the model's dtype."""
    return 1 if impl == "kernel-int8" else 2 if impl == "kernel" else dtype.itemsize


def picked_experts(moe: SparseMoE, x: torch.Tensor) -> int:
    """How many distinct experts the tokens of x pick."""
    return int(moe.gate(x).float().topk(TOP_K, dim=-1).indices.unique().numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="kernel,grouped", help=f"{', '.join(IMPLS)}; ratios are against the first")
    ap.add_argument("--tokens", default="1,2,4,8,16,64,256,1024")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="float32: the experts of a bfloat16 checkpoint")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    impls = args.impls.split(",")
    if unknown := [i for i in impls if i not in IMPLS]:
        ap.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(IMPLS)}")
    keep_freed_memory()
    print(f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    dtype = getattr(torch, args.dtype)
    models, kernels = build(args.layers, dtype, impls)
    read = _measure_bandwidth(torch.device("cpu"), 1 << 30, 5)["read_gb_s"]  # as bench roofline measures it
    print(f"read bandwidth {read:.1f} GB/s (a float32 sum over 1 GiB, best of 5)")

    def layer_ms(impl: str, xs: list[torch.Tensor]) -> float:
        run = kernels.get(impl, models)
        for m in models:
            m.grouped = impl == "grouped"
        t0 = time.perf_counter()
        for x in xs:
            for layer in run:
                layer(x)
        return (time.perf_counter() - t0) * 1e3 / (len(xs) * len(run))

    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            xs = [torch.randn(tokens, HIDDEN, generator=g).to(dtype) for _ in range(args.repeats)]
            picked = statistics.mean(picked_experts(models[0], x) for x in xs) * EXPERT_WEIGHTS
            for impl in impls:
                layer_ms(impl, xs[:2])  # warm up
            times = {impl: [] for impl in impls}
            for r in range(args.rounds):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    times[impl].append(layer_ms(impl, xs))
            first = statistics.median(times[impls[0]])
            cells = []
            for impl in impls:
                ms = statistics.median(times[impl])
                rate = picked * weight_bytes(impl, dtype) / ms / 1e6
                cells.append(f"{impl} {ms:7.2f} ms ({rate:5.1f} GB/s, {rate / read:4.0%}; x{ms / first:.2f})")
            print(f"{tokens:5d} tokens, {picked / 1e6:6.0f} M picked expert weights: " + "; ".join(cells))


if __name__ == "__main__":
    main()
