"""Total output throughput of ``modserve serve --replicas N`` for N = 1 and N = 2.

Starts the real CLI server for each N (same pipeline: SmolLM2 by default), sends the same
set of distinct prompts from ``--concurrency`` concurrent clients (bounded), with
``ignore_eos`` so every request generates exactly ``--max-tokens`` tokens, and prints
output tokens per second for each N and the ratio.

    .venv/bin/python benchmarks/replicas.py                       # SmolLM2, 32 requests
    .venv/bin/python benchmarks/replicas.py --requests 16 --max-tokens 32   # quick

Each replica is a whole engine (its own weights and KV cache) on its own thread in one
process; on a machine with C cores all replicas share those C cores, so the ratio measures
how much two engines overlap on them, not what two machines or GPUs would give.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

from modserve.bench.launch import launch_server


def start_server(config: str, replicas: int, log_path: str) -> tuple[subprocess.Popen, str]:
    args = ["modserve.cli", "serve", "-c", config, "--port", "0", "--replicas", str(replicas)]
    proc, url, _ = launch_server(args, log_path, timeout=120)
    return proc, url


async def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[int, float, dict]:
    sem = asyncio.Semaphore(concurrency)
    per_replica: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, prompt: str) -> int:
        async with sem:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            replica = r.headers.get("x-modserve-replica", "0")
            per_replica[replica] = per_replica.get(replica, 0) + 1
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, "warm up")  # first-request costs (lazy init) outside the timing
        per_replica.clear()
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, p) for p in prompts))
        return sum(tokens), time.perf_counter() - t0, per_replica


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", help="pipeline YAML (default: embedded SmolLM2 with a 512-block paged cache)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="modserve-replicas-bench-")
    config = args.config
    if config is None:
        config = os.path.join(tmp, "pipeline.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({
                "model": {"path": "smollm2-135m-instruct", "max_model_len": 1024},
                "scheduler": {"plugin": "fcfs", "max_num_seqs": 32},
                "kv_cache": {"plugin": "paged", "num_blocks": 512},
                "server": {"log_requests": False},
            }, f)
    # distinct prompts (distinct leading blocks, so the router spreads them)
    prompts = [f"Request {i}: write a short story about a robot named R{i} who learns to paint." for i in range(args.requests)]
    print(f"cores: {os.cpu_count()}; requests {args.requests}, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens each")
    results = {}
    for n in args.replicas:
        proc, url = start_server(config, n, os.path.join(tmp, f"server-{n}.log"))
        try:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            tokens, wall, spread = asyncio.run(run_load(url, model, prompts, args.max_tokens, args.concurrency))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        results[n] = tokens / wall
        print(f"replicas={n}: {tokens} output tokens in {wall:.2f} s = {results[n]:.1f} tok/s  "
              f"(requests per replica: {dict(sorted(spread.items()))})", flush=True)
    if 1 in results:
        for n, tps in results.items():
            if n != 1:
                print(f"ratio replicas={n} / replicas=1: {tps / results[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
