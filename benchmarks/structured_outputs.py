"""What a JSON-schema constraint costs: output tokens/s with and without it, and compile time.

    .venv/bin/python benchmarks/structured_outputs.py [--dtype bfloat16] [--rounds 3]

Offline (``LLM.generate``) on the embedded SmolLM2, greedy, every request ``max_tokens`` long
(``ignore_eos``; the schema's string field has no length limit, so the constrained output never
ends before it): batches of 1 and 16 requests, with and without the constraint, alternated in
rounds; prints each round's ratio and the median. Then the cold and cached compile time of a
typical tool-call schema (what ``check`` does when a request is admitted). Print the CPU model
and flags beside the figures (``lscpu``); keep the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import statistics
import time

from modserve import LLM, SamplingParams
from modserve.core.sampling_params import StructuredOutputs
from modserve.server.tool_calls import ToolPlan

SCHEMA = {  # a long free-text field, so the constrained output runs to max_tokens like the free one
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {  # a typical function-calling schema
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include_hourly": {"type": "boolean"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def throughput(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> float:
    prompts = [[{"role": "user", "content": f"Question {i}: describe the weather in one long answer."}] for i in range(batch)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        structured_outputs=StructuredOutputs(json=SCHEMA) if constrained else None)
    t = time.perf_counter()
    outs = llm.chat(prompts, sp)
    elapsed = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def required_tools_schema() -> dict:
    """What ``tool_choice: required`` decodes under for two tools (the server's own plan)."""
    weather = {"name": "get_weather", "parameters": TOOL_SCHEMA["properties"]["arguments"]}
    time_ = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
    plan = ToolPlan("required", [{"type": "function", "function": f} for f in (weather, time_)])
    return plan.constraint().json


def compile_times(llm: LLM, schema: dict) -> tuple[float, float]:
    processor = llm.engine.processors["structured_outputs"]
    params = SamplingParams(structured_outputs=StructuredOutputs(json=schema))
    t = time.perf_counter()
    processor.check(params)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    processor.check(params)
    return cold, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    llm = LLM(model={"path": "smollm2-135m-instruct", "dtype": args.dtype, "max_model_len": 1024},
              kv_cache={"plugin": "paged", "num_blocks": 1024})
    compiled = {name: compile_times(llm, schema) for name, schema in
                (("tool-call schema", TOOL_SCHEMA), ("tool_choice required, two tools", required_tools_schema()))}
    throughput(llm, 2, 8, True)  # warm up both paths
    for batch in (1, 16):
        ratios = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {c: throughput(llm, batch, args.max_tokens, c) for c in order}
            ratios.append(got[True] / got[False])
            print(f"batch {batch:2d} round {r + 1}: free {got[False]:7.1f} out tok/s, JSON schema {got[True]:7.1f}, ratio {ratios[-1]:.3f}")
        print(f"batch {batch:2d}: median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    for name, (cold, cached) in compiled.items():
        print(f"{name} compile: cold {cold * 1000:.2f} ms, cached {cached * 1e6:.1f} us")


if __name__ == "__main__":
    main()
