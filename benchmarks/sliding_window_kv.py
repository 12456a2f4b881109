"""What releasing blocks behind the sliding window saves (``kv_cache.free_outside_window``).

A tiny Mistral whose every layer has a window of 256 (the tests' random checkpoint builder,
2 layers), 8 requests of 2,000-2,200 prompt tokens and 64 new tokens each, 16-token blocks,
512-token steps (chunked prefill). Two runs per setting, with and without freeing:

* an ample pool (nothing is ever short): the peak number of KV blocks in use, and the most
  blocks one request held;
* a fixed small pool of 160 blocks (2,560 tokens, just over max_model_len 2,304): the most
  requests running at once, preemptions, and engine steps to finish the workload.

Block counts, concurrency, preemptions and steps are deterministic (greedy decoding, a fixed
schedule), so they can be reported from a shared machine; the script prints no timings. It
also checks that both settings produce the same tokens.

    python benchmarks/sliding_window_kv.py [--window 256] [--requests 8] [--small-pool 160]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_model  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402


def run(path: str, ps: list[list[int]], args, num_blocks: int, free: bool) -> dict:
    llm = LLM(model={"path": path, "max_model_len": args.max_model_len},
              kv_cache={"plugin": "paged", "block_size": args.block_size, "num_blocks": num_blocks,
                        "free_outside_window": free},
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": args.step_tokens, "max_num_seqs": len(ps)})
    engine, kv = llm.engine, llm.engine.kv
    stats = {"peak_blocks": 0, "peak_request_blocks": 0, "peak_running": 0, "steps": 0}
    allocate = kv.allocate

    def counting(request, n, hit=None):  # the peak is right after an allocation
        ok = allocate(request, n, hit)
        if ok:
            stats["peak_blocks"] = max(stats["peak_blocks"], kv.num_blocks - kv.num_free_blocks)
            live = sum(b != kv.null_block for b in kv.block_table(request))
            stats["peak_request_blocks"] = max(stats["peak_request_blocks"], live)
        return ok

    kv.allocate = counting
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(p, params, request_id=str(i))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        stats["steps"] += 1
        stats["peak_running"] = max(stats["peak_running"], len(engine.scheduler.running))
    stats["preemptions"] = engine.scheduler.stats().num_preemptions
    stats["tokens"] = [tokens[str(i)] for i in range(len(ps))]
    assert kv.num_free_blocks == kv.num_blocks
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=2000)
    ap.add_argument("--prompt-max", type=int, default=2200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2304)
    ap.add_argument("--small-pool", type=int, default=160)
    args = ap.parse_args()

    path = tempfile.mkdtemp(prefix="swkv-")
    hf = build_model(path, "mistral", sliding_window=args.window, max_position_embeddings=args.max_model_len)
    rng = random.Random(0)
    ps = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randrange(args.prompt_min, args.prompt_max + 1))]
          for _ in range(args.requests)]
    total = sum(len(p) + args.new_tokens for p in ps)
    ample = sum(-(-(len(p) + args.new_tokens) // args.block_size) for p in ps) + 8
    print(f"workload: {args.requests} requests, prompts {min(map(len, ps))}-{max(map(len, ps))} tokens, "
          f"{args.new_tokens} new tokens each ({total} tokens); window {args.window}, block {args.block_size}, "
          f"{args.step_tokens}-token steps")
    results = {}
    for pool, label in ((ample, f"ample pool ({ample} blocks)"), (args.small_pool, f"small pool ({args.small_pool} blocks)")):
        print(f"\n{label}")
        print(f"{'free_outside_window':<20} {'peak blocks':>12} {'peak/request':>13} {'max running':>12} {'preemptions':>12} {'steps':>6}")
        for free in (False, True):
            r = results[pool, free] = run(path, ps, args, pool, free)
            print(f"{str(free).lower():<20} {r['peak_blocks']:>12} {r['peak_request_blocks']:>13} {r['peak_running']:>12} "
                  f"{r['preemptions']:>12} {r['steps']:>6}")
    same = all(results[k]["tokens"] == results[ample, False]["tokens"] for k in results)
    print(f"\nidentical tokens in every run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
