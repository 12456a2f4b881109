"""Speculative decoding on SmolLM2 (issue 6's report): output tokens/s and mean accepted
tokens per verification, with and without each proposer, on an input-copying workload
and on open-ended chat, at concurrency 1 and 16. All ratios come from this one run.

Usage: ``python benchmarks/speculative.py [--max-tokens 96] [--quick]``
"""

from __future__ import annotations

import argparse
import time

from modserve import LLM, SamplingParams
from modserve.core.contract import hookimpl

CODE = '''def moving_average(values, window):
    """Return the moving average of values over the given window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
COPYING = [
    f"Rewrite this Python function with one change: rename `{name}` to `{new}`. Output only the code.\n\n{CODE}"
    for name, new in [("values", "xs"), ("window", "size"), ("result", "out"), ("total", "acc")]
]
CHAT = [
    "Tell me a short story about a lighthouse keeper.",
    "What are three tips for learning a new language?",
    "Explain why the sky is blue to a ten year old.",
    "Write a haiku about autumn and then explain it.",
]
PIPELINES = {
    "none": None,
    "ngram": {"plugin": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "draft(8 layers)": {"plugin": "draft_model", "num_speculative_tokens": 3, "draft": {"layers": 8}},
}


class Acceptance:
    def __init__(self) -> None:
        self.verified = self.accepted = 0

    @hookimpl
    def on_step_finished(self, stats) -> None:
        self.verified += len(stats.accepted_per_position)
        self.accepted += stats.num_accepted_tokens


def run(name: str, spec, prompts: list[str], concurrency: int, max_tokens: int, governed: bool) -> tuple[float, float]:
    if spec is not None and governed:
        spec = {**spec, "disable_above_batch_size": 8, "min_acceptance_rate": 0.3}
    llm = LLM({"model": {"path": "smollm2-135m-instruct", "max_model_len": 2048, "dtype": "float32"},
               "kv_cache": {"plugin": "paged", "num_blocks": 2048}, "speculative": spec})
    acc = Acceptance()
    llm.engine.c.registry.pm.register(acc)
    convs = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    acc.verified = acc.accepted = 0
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    mean_accepted = acc.accepted / acc.verified if acc.verified else 0.0
    return tokens / elapsed, mean_accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="concurrency 1 only")
    args = ap.parse_args()
    print("| workload | concurrency | proposer | out tok/s | vs none | mean accepted drafts / verify |")
    print("|---|---|---|---|---|---|")
    for workload, prompts in (("copying", COPYING), ("chat", CHAT)):
        for concurrency in (1,) if args.quick else (1, 16):
            base = None
            for name, spec in PIPELINES.items():
                for governed in (False, True) if spec is not None and concurrency > 1 else (False,):
                    tps, acc = run(name, spec, prompts, concurrency, args.max_tokens, governed)
                    base = base or tps
                    label = name + (" +governor" if governed else "")
                    print(f"| {workload} | {concurrency} | {label} | {tps:.1f} | {tps / base:.2f}x | {acc:.2f} |", flush=True)


if __name__ == "__main__":
    main()
