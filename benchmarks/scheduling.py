"""What paging, continuous batching, prefix caching and chunked prefill buy (issue 4's report).

Every figure is a ratio between two pipelines measured in this one run on the same
workload and model:

1. KV memory waste (reserved-but-unused slots / reserved slots, averaged over steps) and
   the largest concurrency reached in a fixed KV budget: ``paged`` vs ``contiguous``.
2. Output throughput: continuous batching (``fcfs``) vs ``static`` batches.
3. Time to first token for requests sharing a long system prompt, prefix caching on vs off.
4. p99 inter-token latency of running streams while a long prompt arrives, chunked
   prefill on vs off.

Usage: ``python benchmarks/scheduling.py [--model smollm2-135m-instruct] [--quick]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from modserve import LLM, SamplingParams
from modserve.core.contract import hookimpl


class Recorder:
    """Observer: per-step KV reservation and running count, per-request token times."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.waste: list[float] = []
        self.max_running = 0
        self.token_times: dict[str, list[float]] = {}
        engine.c.registry.pm.register(self)

    @hookimpl
    def on_step_finished(self, stats) -> None:
        kv, now = self.engine.kv, time.perf_counter()
        reserved = used = 0
        for req in self.engine.requests.values():
            reserved += len(kv.block_table(req)) * kv.block_size
            used += req.num_computed_tokens
        if reserved:
            self.waste.append(1 - used / reserved)
        self.max_running = max(self.max_running, stats.num_running)
        for req in self.engine.requests.values():
            times = self.token_times.setdefault(req.request_id, [])
            if len(times) < req.num_output_tokens:
                times.append(now)


def build(model: str, max_model_len: int = 2048, **overrides) -> tuple[LLM, Recorder]:
    llm = LLM({"model": {"path": model, "max_model_len": max_model_len, "dtype": "float32"}, **overrides})
    return llm, Recorder(llm.engine)


def drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t0


def tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    """Random ordinary token ids (the first few ids of most vocabularies are special)."""
    return [rng.randrange(min(100, vocab // 4), vocab) for _ in range(count)]


def varied_workload(n: int, rng: random.Random, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [tokens(rng, rng.randrange(32, 160), vocab) for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([8, 32, 64, 128, 256]), ignore_eos=True) for _ in range(n)]
    return prompts, params


def kv_waste_and_concurrency(model: str, n: int) -> None:
    print("\n## 1. KV waste and concurrency in a fixed budget (192 blocks x 16 tokens, max_model_len 512)")
    for backend in ("paged", "contiguous"):
        llm, rec = build(
            model,
            max_model_len=512,
            kv_cache={"plugin": backend, "num_blocks": 192, "block_size": 16},
            scheduler={"plugin": "fcfs", "max_num_seqs": 128},
        )
        prompts, params = varied_workload(n, random.Random(1), llm.engine.c.spec.vocab_size)
        elapsed = drive(llm, prompts, params)
        print(f"{backend:<11} waste {100 * statistics.mean(rec.waste):5.1f}%  max concurrency {rec.max_running:3d}  "
              f"({elapsed:.1f} s)")


def continuous_vs_static(model: str, n: int) -> None:
    print("\n## 2. Continuous (fcfs) vs static batching, max_num_seqs 16")
    results = {}
    for sched in ("fcfs", "static"):
        llm, _ = build(model, scheduler={"plugin": sched, "max_num_seqs": 16}, kv_cache={"plugin": "paged", "num_blocks": 2048})
        prompts, params = varied_workload(n, random.Random(2), llm.engine.c.spec.vocab_size)
        elapsed = drive(llm, prompts, params)
        results[sched] = sum(p.max_tokens for p in params) / elapsed
        print(f"{sched:<7} {results[sched]:7.1f} output tok/s")
    print(f"continuous / static = {results['fcfs'] / results['static']:.2f}x")


def prefix_caching_ttft(model: str, n: int) -> None:
    print("\n## 3. TTFT with a shared 1,000-token system prompt, prefix caching on vs off")
    results = {}
    for caching in (True, False):
        rng = random.Random(3)
        llm, rec = build(model, kv_cache={"plugin": "paged", "num_blocks": 1024, "prefix_caching": caching})
        vocab = llm.engine.c.spec.vocab_size
        system = tokens(rng, 1000, vocab)
        drive(llm, [system + [5, 6]], [SamplingParams(temperature=0, max_tokens=1)])  # warm the cache
        ttfts = []
        for i in range(n):
            t0 = time.perf_counter()
            drive(llm, [system + tokens(rng, 20, vocab)], [SamplingParams(temperature=0, max_tokens=1)])
            ttfts.append(time.perf_counter() - t0)
        results[caching] = statistics.median(ttfts)
        print(f"prefix_caching={caching!s:<5} median TTFT {1000 * results[caching]:7.1f} ms")
    print(f"TTFT off / on = {results[False] / results[True]:.1f}x")


def chunked_prefill_itl(model: str, streams: int) -> None:
    print(f"\n## 4. p99 inter-token latency of {streams} streams while a 1,500-token prompt arrives")
    results = {}
    for chunked in (True, False):
        rng = random.Random(4)
        llm, rec = build(
            model,
            scheduler={"plugin": "fcfs", "max_num_batched_tokens": 256 if chunked else 2048,
                       "enable_chunked_prefill": chunked},
            kv_cache={"plugin": "paged", "num_blocks": 1024},
        )
        engine = llm.engine
        vocab = engine.c.spec.vocab_size
        for i in range(streams):
            engine.add_request(tokens(rng, 32, vocab), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), request_id=f"s{i}")
        for _ in range(10):
            engine.step()
        engine.add_request(tokens(rng, 1500, vocab), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="long")
        while engine.has_unfinished():
            engine.step()
        gaps = [b - a for rid, ts in rec.token_times.items() if rid != "long" for a, b in zip(ts, ts[1:])]
        gaps.sort()
        results[chunked] = gaps[int(0.99 * (len(gaps) - 1))]
        print(f"chunked_prefill={chunked!s:<5} p99 ITL {1000 * results[chunked]:7.1f} ms  (median {1000 * statistics.median(gaps):.1f} ms)")
    print(f"p99 ITL unchunked / chunked = {results[False] / results[True]:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    args = ap.parse_args()
    scale = 1 if args.quick else 2
    kv_waste_and_concurrency(args.model, 48 * scale)
    continuous_vs_static(args.model, 32 * scale)
    prefix_caching_ttft(args.model, 4 * scale)
    chunked_prefill_itl(args.model, 8 * scale)


if __name__ == "__main__":
    main()
