"""modserve on Ray Serve, measured on one machine: routing, replicas, autoscaling.

Starts a local single-node Ray cluster (``--cpus`` CPUs) and deploys the embedded SmolLM2
application several times, each on cold replicas:

1. **routing**: two replicas, a shared-prefix chat workload (``--groups`` system prompts of
   ``--prefix-words`` words, ``--per-group`` questions each, shuffled, ``--concurrency``
   clients), under the prefix-aware router and under Ray Serve's power-of-two router: prefix
   cache hit rate (cached / prompt tokens, from each response's usage), p50/p99 time to first
   token, output tokens/s;
2. **replicas**: distinct prompts (nothing shared) from 16 clients on one replica with all
   the CPUs vs two replicas with half each: output tokens/s;
3. **autoscaling**: ``min_replicas: 1, max_replicas: 2`` under a steady load: seconds until
   the second replica serves.

The replica-kill cost is measured by ``examples/deploy/ray/smoke.sh``. Both replicas share
this machine's cores: the replica figures say how two engines share them, not what two
machines would give. Raw results go to ``benchmarks/results/ray_serve.json``.

    .venv/bin/python benchmarks/ray_serve.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import time

import ray
from ray import serve

from modserve.bench.shared_prefix_load import run_load, summarize, workload
from modserve.plugins.platforms.cpu import cpu_model_and_flags
from modserve.ray_serve.app import build_application

MODEL = "smollm2-135m-instruct"
APP = "modserve-bench"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def deploy(port: int, ray_section: dict) -> str:
    app, _ = build_application({"model": {"max_model_len": 2048}, "server": {"port": port},
                                "ray": {"app_name": APP, **ray_section}})
    serve.run(app, name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def replicas_running() -> int:
    status = serve.status().applications[APP].deployments["engine"]
    return status.replica_states.get("RUNNING", 0)


def routing(port: int, args) -> dict:
    items = workload(args.groups, args.per_group, args.prefix_words, seed=3)
    out = {}
    for router in ("prefix", "power_of_two"):
        url = deploy(port, {"num_replicas": 2, "num_cpus_per_replica": args.cpus / 2, "router": router})
        outcomes, wall = asyncio.run(run_load(url, MODEL, items, args.concurrency, args.max_tokens))
        out[router] = summarize(outcomes, wall, args.max_tokens).as_dict()
        serve.delete(APP)
    return out


def replicas(port: int, args) -> dict:
    items = workload(32, 1, 40, seed=5)  # distinct prompts: the router's choice does not matter
    out = {}
    for n in (1, 2):
        url = deploy(port, {"num_replicas": n, "num_cpus_per_replica": args.cpus / n})
        asyncio.run(run_load(url, MODEL, items[:4], 4, 8))  # warm-up
        outcomes, wall = asyncio.run(run_load(url, MODEL, items, 16, 64))
        out[f"{n}_replica"] = summarize(outcomes, wall, 64).as_dict()
        serve.delete(APP)
    return out


def autoscaling(port: int, args) -> dict:
    url = deploy(port, {"num_cpus_per_replica": args.cpus / 2, "autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_active_per_replica": 4, "look_back_s": 2.0,
        "upscale_delay_s": 1.0, "downscale_delay_s": 600.0}})
    items = workload(48, 1, 40, seed=7)
    t0 = time.perf_counter()
    seen: list[tuple[float, int]] = []

    async def load_and_watch():
        task = asyncio.ensure_future(run_load(url, MODEL, items, 12, 48))
        while not task.done():
            seen.append((round(time.perf_counter() - t0, 1), replicas_running()))
            await asyncio.sleep(1.0)
        return await task

    outcomes, wall = asyncio.run(load_and_watch())
    up = next((t for t, n in seen if n >= 2), None)
    serve.delete(APP)
    return {"second_replica_running_after_s": up, "replicas_over_time": seen,
            "load": summarize(outcomes, wall, 48).as_dict()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip", nargs="*", default=[], choices=["routing", "replicas", "autoscaling"])
    args = p.parse_args()

    model, flags = cpu_model_and_flags()
    machine = {"cpu": model, "flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
               "cpus": args.cpus, "python": platform.python_version(), "ray": ray.__version__}
    print(f"machine: {machine['cpu']}, {args.cpus} CPUs for Ray; {' '.join(machine['flags'])}", flush=True)
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")  # Ray's default: 10 s
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = {"machine": machine}
    try:
        for name, fn in (("routing", routing), ("replicas", replicas), ("autoscaling", autoscaling)):
            if name not in args.skip:
                results[name] = fn(port, args)
                print(json.dumps({name: results[name]}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/ray_serve.json", "w") as f:
        json.dump(results, f, indent=1)
    r = results.get("routing")
    if r:
        for router, s in r.items():
            print(f"{router:>13}: prefix hit rate {s['prefix_hit_rate']:.1%}, TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms "
                  f"p99 {s['ttft_p99_s'] * 1000:.0f} ms, {s['output_tok_s']:.1f} out tok/s ({s['ok']}/{s['requests']} ok)")
    rep = results.get("replicas")
    if rep:
        one, two = rep["1_replica"]["output_tok_s"], rep["2_replica"]["output_tok_s"]
        print(f"replicas: 1 -> {one:.1f} out tok/s, 2 -> {two:.1f} out tok/s ({two / one:.2f}x, same {args.cpus} CPUs)")
    a = results.get("autoscaling")
    if a:
        print(f"autoscaling: second replica running after {a['second_replica_running_after_s']} s of load")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
