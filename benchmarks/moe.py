"""Mixture-of-experts models end to end: output tokens/s offline with the cpu platform's experts
kernel against the model's own torch products (grouped, or a loop over the experts).

    .venv/bin/python benchmarks/moe.py [--arch qwen3_moe | mixtral] [--dtype bfloat16 | float32]
        [--impls kernel,kernel-int8,kernel-eager,grouped,looped] [--rounds 3]

Builds a random checkpoint in a temporary directory, saved in bfloat16 (tests/tiny_models.py's
tokenizer; ``--dtype float32`` serves it in float32, the experts held in bfloat16 by the kernel):
``qwen3_moe``, 64 experts of width 512, top 8, hidden 1,024, 4 layers (each token reads 25 MB
of experts a layer, 100 MB a step: from memory, not L3); or ``mixtral``, 8 experts of width 1,024,
top 2, hidden 512, 4 layers. Generates offline (greedy, ``ignore_eos``) at 1 and 32 requests:
``kernel`` is the platform's default where it has the kernel (bfloat16 on AVX512_BF16, float32
on AVX2: one native call per layer, decode steps as call lists; ``kernel-eager``: without the
call lists; ``kernel-int8``: ``device.quantization: int8``, the experts and the other linears
(not the routers or the head) as int8 codes on the same kernels);
``grouped`` and ``looped`` are the model's ``SparseMoE`` kept by the platform (one
``grouped_mm`` per projection, or a Python loop over the experts), eager. Alternated in
rounds; prints each round's output tok/s, then the medians of the ratios to the first.
Print the CPU model and flags beside the figures; keep the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
from tiny_models import build_model  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.core.contract.experts import ExpertMLP  # noqa: E402
from modserve.plugins.models.moe import SparseMoE  # noqa: E402
from modserve.plugins.platforms import cpu  # noqa: E402

SHAPES = {
    "qwen3_moe": dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                      num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, mlp_only_layers=[]),
    "mixtral": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    num_local_experts=8, num_experts_per_tok=2),
}
IMPLS = ("kernel", "kernel-int8", "kernel-eager", "grouped", "looped")


def tokens_per_s(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 300 for j in range(32)]} for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3_moe", choices=sorted(SHAPES))
    p.add_argument("--impls", default="kernel,grouped", help=f"{', '.join(IMPLS)}; ratios are against the first")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    impls = args.impls.split(",")
    if unknown := [i for i in impls if i not in IMPLS]:
        p.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(IMPLS)}")
    print(f"CPU: {cpu.describe_cpu()}")
    path = os.path.join(tempfile.mkdtemp(prefix="modserve-moe-"), args.arch)
    build_model(path, args.arch, **SHAPES[args.arch]).to(torch.bfloat16).save_pretrained(path)  # as such checkpoints ship
    config = dict(model={"path": path, "dtype": args.dtype}, kv_cache={"plugin": "paged", "num_blocks": 512})
    engines = {}
    for impl in {"kernel", "kernel-int8", "kernel-eager"} & set(impls):
        quantization = "int8" if impl == "kernel-int8" else "none"
        engines[impl] = LLM(**config, device={"plugin": "cpu", "decode_graphs": impl != "kernel-eager", "quantization": quantization})
        kinds = {type(m).__name__ for m in engines[impl].engine.runner.model.modules() if isinstance(m, ExpertMLP)}
        print(f"{impl}: the platform's experts are {', '.join(sorted(kinds))}")
    if {"grouped", "looped"} & set(impls):
        keep = cpu.CPUPlatform.experts
        cpu.CPUPlatform.experts = lambda self, name, moe: moe  # the model's own SparseMoE
        try:
            engines["torch"] = LLM(**config)
        finally:
            cpu.CPUPlatform.experts = keep
    blocks = [m for m in engines["torch"].engine.runner.model.modules() if isinstance(m, SparseMoE)] if "torch" in engines else []

    def run(impl: str, batch: int) -> float:
        for m in blocks:
            m.grouped = impl == "grouped"
        return tokens_per_s(engines.get(impl, engines.get("torch")), batch, args.max_tokens)

    for impl in impls:
        run(impl, 4)  # warm up (and record the kernel engine's call lists)
    for batch in (1, 32):
        ratios = {impl: [] for impl in impls}
        for r in range(args.rounds):
            got = {impl: run(impl, batch) for impl in (impls if r % 2 == 0 else impls[::-1])}
            for impl in impls:
                ratios[impl].append(got[impl] / got[impls[0]])
            print(f"batch {batch:2d} round {r + 1}: " + ", ".join(f"{impl} {got[impl]:7.1f} out tok/s" for impl in impls))
        print(f"batch {batch:2d}: " + ", ".join(
            f"{impl} x{statistics.median(ratios[impl]):.3f} ({min(ratios[impl]):.3f}-{max(ratios[impl]):.3f})" for impl in impls[1:]
        ) + f" of {impls[0]}'s output tok/s")


if __name__ == "__main__":
    main()
