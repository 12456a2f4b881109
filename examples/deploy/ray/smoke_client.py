"""The smoke test's client: a bounded load through the OpenAI API, one replica killed mid-run.

Run by ``smoke.sh`` against a deployed application (it joins the Ray cluster as a driver to
learn the engine replicas' process ids). Prints one JSON line and exits 0 when:
every request of the first load was answered or failed cleanly (none broken or hung), the
killed replica was replaced (a new process, back to the target count), and a second load
after that was answered in full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

import ray
from ray import serve

from modserve.bench.shared_prefix_load import run_load, summarize, wait_until, workload


def replica_pids(app: str, want: int, tries: int = 40) -> dict[str, int]:
    """Replica id -> pid of the engine replicas, asking until ``want`` distinct ones answered."""
    handle = serve.get_deployment_handle("engine", app_name=app)
    seen: dict[str, int] = {}
    for _ in range(tries):
        rid, pid = handle.whoami.remote().result(timeout_s=30)
        seen[rid] = pid
        if len(seen) >= want:
            break
    return seen


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--address", required=True, help="the Ray cluster (GCS address)")
    p.add_argument("--app", default="modserve")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kill-after", type=int, default=6, help="kill after this many streams saw a first token")
    p.add_argument("--recover-timeout", type=float, default=180.0)
    args = p.parse_args()

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    pids = replica_pids(args.app, args.replicas)
    if len(pids) < args.replicas:
        print(json.dumps({"ok": False, "why": f"only {len(pids)} engine replicas answered"}))
        return 1
    killed: dict[str, object] = {}
    first_tokens = 0

    def on_first_token(replica: str | None) -> None:  # kills the replica streaming the N-th answer
        nonlocal first_tokens
        first_tokens += 1
        if first_tokens == args.kill_after and replica in pids and not killed:
            os.kill(pids[replica], signal.SIGKILL)
            killed.update(replica=replica, pid=pids[replica], at=time.perf_counter())

    items = workload(groups=4, per_group=max(1, args.requests // 4), prefix_words=120, seed=1)[: args.requests]
    outcomes, wall = asyncio.run(run_load(args.url, args.model, items, args.concurrency, args.max_tokens,
                                          timeout_s=120, on_first_token=on_first_token, unstreamed_every=3))
    during = summarize(outcomes, wall, args.max_tokens)

    async def replaced() -> bool:
        try:
            now = await asyncio.to_thread(replica_pids, args.app, args.replicas, 8)
        except Exception:  # noqa: BLE001 - a replica still starting; ask again
            return False
        return len(now) >= args.replicas and killed.get("pid") not in now.values()

    recovered_s = asyncio.run(wait_until(replaced, args.recover_timeout, every_s=1.0)) if killed else None
    since_kill = time.perf_counter() - killed["at"] if killed else None
    after_out, after_wall = asyncio.run(run_load(args.url, args.model, items[:8], 4, 16, timeout_s=120))
    after = summarize(after_out, after_wall, 16)
    report = {
        "killed": {k: v for k, v in killed.items() if k != "at"},
        "during": during.as_dict(),
        "broken_details": [o.detail for o in outcomes if o.status == "broken"][:5],
        "recovered_in_s": None if recovered_s is None else round(since_kill, 1),
        "after": after.as_dict(),
    }
    ok = (bool(killed) and during.broken == 0 and during.ok + during.error == len(outcomes)
          and recovered_s is not None and after.ok == len(after_out))
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
