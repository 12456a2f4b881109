"""Grouped experts vs a loop over experts: output tokens/s of a Mixtral-shaped tiny model.

    .venv/bin/python benchmarks/moe.py [--dtype bfloat16] [--rounds 3]

Builds a random Mixtral checkpoint (8 experts, top 2; hidden 512, expert width 1024, 4
layers; tests/tiny_models.py's tokenizer) in a temporary directory, then generates offline
(greedy, ``ignore_eos``) at 1 and 32 requests with ``SparseMoE.grouped`` on (one
``grouped_mm`` per projection for all experts) and off (a Python loop over the experts
with tokens), alternated in rounds; prints each round's ratio and the median. Print the
CPU model and flags beside the figures (``lscpu``); keep the machine otherwise idle.
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

from tiny_models import build_model  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.plugins.models.moe import SparseMoE  # noqa: E402


def tokens_per_s(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 300 for j in range(32)]} for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="modserve-moe-"), "mixtral")
    build_model(path, "mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)
    llm = LLM(model={"path": path, "dtype": args.dtype}, kv_cache={"plugin": "paged", "num_blocks": 512})
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]

    def run(grouped: bool, batch: int) -> float:
        for m in blocks:
            m.grouped = grouped
        return tokens_per_s(llm, batch, args.max_tokens)

    run(True, 4), run(False, 4)  # warm up both paths
    for batch in (1, 32):
        ratios = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {g: run(g, batch) for g in order}
            ratios.append(got[True] / got[False])
            print(f"batch {batch:2d} round {r + 1}: loop {got[False]:7.1f} out tok/s, grouped {got[True]:7.1f}, ratio {ratios[-1]:.3f}")
        print(f"batch {batch:2d}: median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
