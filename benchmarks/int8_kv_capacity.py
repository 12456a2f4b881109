"""What INT8 KV buys on SmolLM2: capacity at a fixed memory budget, and what it costs in quality.

For fp32, bf16 and int8 KV under one ``memory_gb`` budget it builds the ``paged`` backend
(SmolLM2's 30 layers x 3 KV heads x 64) and prints the blocks and tokens it holds and the
largest number of 512-token requests whose blocks the allocator hands out at once (the
KV-limited concurrency; the scheduler's ``max_num_seqs`` is a separate cap). Then it
teacher-forces a few hundred tokens of English through SmolLM2 with fp32 and with int8 KV
(``benchmarks/int8_quality.py``, the code ``tests/test_int8_kv.py`` bounds) and prints the
top-1 agreement and the perplexity rise.

    python benchmarks/int8_kv_capacity.py [--memory-gb 0.25] [--request-tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int8_quality  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.core.contract import KVSpec  # noqa: E402
from modserve.core.plugin_manager import default_registry, standalone_context  # noqa: E402
from modserve.core.request import Request  # noqa: E402
from modserve.plugins.kv_backends.paged import bytes_per_block  # noqa: E402

SETTINGS = [  # (label, activation / KV dtype, kv_dtype option)
    ("fp32", torch.float32, "auto"),
    ("bf16", torch.bfloat16, "auto"),
    ("int8", torch.float32, "int8"),
]


def max_concurrency(kv, request_tokens: int) -> int:
    """Admit ``request_tokens``-token requests (distinct prompts) until the allocator says no."""
    params = SamplingParams(max_tokens=1)
    admitted: list[Request] = []
    while True:
        base = len(admitted) * request_tokens
        req = Request(f"cap-{len(admitted)}", list(range(base, base + request_tokens)), params)
        if not kv.allocate(req, request_tokens):
            break
        admitted.append(req)
    for req in admitted:
        kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks
    return len(admitted)


def capacity_table(model_spec, memory_gb: float, request_tokens: int) -> list[dict]:
    rows = []
    for label, dtype, kv_dtype in SETTINGS:
        m = model_spec
        spec = KVSpec(m.num_layers, m.num_kv_heads, m.head_dim, dtype, torch.device("cpu"), 2048)
        options = {"plugin": "paged", "memory_gb": memory_gb, "kv_dtype": kv_dtype}
        cls, cfg = default_registry().resolve("kv_cache", options)
        kv = cls(cfg, standalone_context(kv_spec=spec))
        rows.append({
            "kv": label,
            "blocks": kv.num_blocks,
            "tokens": kv.num_blocks * kv.block_size,
            "bytes_per_token": bytes_per_block(cfg, spec) // kv.block_size,  # all layers, K and V, scales
            "concurrency": max_concurrency(kv, request_tokens),
        })
        del kv
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-gb", type=float, default=0.25)
    ap.add_argument("--request-tokens", type=int, default=512)
    args = ap.parse_args()

    t0 = time.perf_counter()
    fp32_llm = LLM(int8_quality.smollm2_config("auto"))
    m = fp32_llm.engine.c.spec
    print(f"SmolLM2-135M: {m.num_layers} layers, {m.num_kv_heads} KV heads x head size {m.head_dim}; "
          f"KV budget {args.memory_gb} GB, block size 16\n")
    rows = capacity_table(m, args.memory_gb, args.request_tokens)
    fp32 = rows[0]
    reqs = f"{args.request_tokens}-tok reqs"
    print(f"{'KV dtype':<9}{'blocks':>8}{'tokens':>9}{'bytes/token':>13}{reqs:>15}{'vs fp32':>9}")
    for r in rows:
        print(f"{r['kv']:<9}{r['blocks']:>8}{r['tokens']:>9}{r['bytes_per_token']:>13}{r['concurrency']:>15}"
              f"{r['concurrency'] / fp32['concurrency']:>8.2f}x")
    int8, bf16 = rows[2], rows[1]
    print(f"\nint8 vs fp32: {int8['blocks'] / fp32['blocks']:.3f}x blocks, "
          f"{int8['concurrency'] / fp32['concurrency']:.2f}x concurrency; "
          f"int8 vs bf16: {int8['blocks'] / bf16['blocks']:.3f}x blocks, "
          f"{int8['concurrency'] / bf16['concurrency']:.2f}x concurrency")

    int8_llm = LLM(int8_quality.smollm2_config("int8"))
    token_ids = fp32_llm.tokenizer.encode(int8_quality.TEXT)
    print(f"\nteacher-forced over {len(token_ids)} tokens of English, prefill chunks of {int8_quality.CHUNK_TOKENS}:")
    q = int8_quality.measure(fp32_llm, int8_llm)
    print(q.summary())
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
