"""Overload: more clients than capacity. Requests wait up to ``server.max_waiting_requests``,
the rest get 503 with ``Retry-After``; nothing is lost or duplicated; accepted requests
complete with the offline greedy output; KV pressure is met by preemption, not failures.

Phase 1 sends a burst of clients at once and counts accepted vs rejected. Phase 2 lets
the rejected ones retry after ``Retry-After`` until served, so every prompt ends up
completed exactly once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reliability_helpers import RegistryServer, SlowScheduler, error_of, metric, registry, wait_idle
from server_helpers import parse_metrics, pipeline

from modserve import LLM, SamplingParams

C = "/v1/completions"
CLIENTS = 32
MAX_NUM_SEQS, MAX_WAITING = 4, 6
MAX_TOKENS = 60
# 4 running requests of 40 + 60 tokens need 28 blocks of 16 at the end: 20 blocks force preemption
SECTIONS = dict(
    model={"max_model_len": 256},
    scheduler={"plugin": "slow", "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 256},
    kv_cache={"num_blocks": 20},
    server={"max_waiting_requests": MAX_WAITING},
)
PROMPTS = [[(7 * i + j) % 300 + 20 for j in range(40)] for i in range(CLIENTS)]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(pipeline(model=SECTIONS["model"]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


class KVSampler(threading.Thread):
    """Samples ``kv_cache_usage_perc`` from /metrics until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client() as http:
            while not self.stop.is_set():
                m = parse_metrics(http.get(self.url + "/metrics").text)
                self.samples.append((m["modserve:kv_cache_usage_perc"], m["modserve:num_requests_waiting"], time.monotonic()))
                time.sleep(0.01)


def test_overload(reference):
    reg = registry(schedulers={"slow": SlowScheduler})  # a fixed pace, so the burst overlaps on any machine
    with RegistryServer(reg, **SECTIONS) as s:
        kv = KVSampler(s.url)
        kv.start()
        barrier = threading.Barrier(CLIENTS)

        def client(i: int) -> list[tuple[int, str, str]]:
            """Every attempt of client i: (status, response id or error code, text)."""
            attempts = []
            with httpx.Client(timeout=120) as http:
                barrier.wait()
                while True:
                    r = http.post(s.url + C, json={**GREEDY, "prompt": PROMPTS[i]})
                    if r.status_code == 200:
                        body = r.json()
                        attempts.append((200, body["id"], body["choices"][0]["text"]))
                        return attempts
                    err = error_of(r)
                    attempts.append((r.status_code, err["code"], ""))
                    assert r.status_code == 503 and err["code"] == "overloaded", err
                    assert "max_waiting_requests" in err["message"]
                    time.sleep(float(r.headers["retry-after"]))  # as a well-behaved client does

        t0 = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(client, range(CLIENTS)))
        elapsed = time.monotonic() - t0
        kv.stop.set()
        kv.join()
        m = wait_idle(s.url)

    first = [r[0][0] for r in results]  # the burst: each client's first attempt
    accepted_first, rejected_first = first.count(200), first.count(503)
    attempts = [a for r in results for a in r]
    rejections = sum(1 for a in attempts if a[0] == 503)
    ids = [a[1] for a in attempts if a[0] == 200]
    usage = [u for u, _, _ in kv.samples]
    full = sum(1 for u in usage if u >= 1.0)
    streak, since = 0.0, None  # the longest stretch of time the cache stayed full
    for u, _, t in kv.samples:
        since = (since or t) if u >= 1.0 else None
        streak = max(streak, t - since) if since is not None else streak
    print(f"\noverload: {CLIENTS} clients, capacity {MAX_NUM_SEQS} running + {MAX_WAITING} waiting; burst: "
          f"{accepted_first} accepted, {rejected_first} rejected (503); with retries: {len(attempts)} attempts, "
          f"{rejections} rejections, {len(ids)} completed; preemptions {metric(m, 'modserve:num_preemptions_total'):.0f}; "
          f"kv usage max {max(usage):.2f}, at 100% in {full}/{len(usage)} samples (longest stretch {streak * 1000:.0f} ms); "
          f"max waiting seen {max(w for _, w, _ in kv.samples):.0f}; {elapsed:.1f}s")

    assert accepted_first + rejected_first == CLIENTS
    assert rejected_first > 0 and accepted_first >= MAX_WAITING  # the burst overflowed the bounded queue
    assert len(ids) == len(set(ids)) == CLIENTS  # every prompt completed exactly once: none lost, none duplicated
    assert [r[-1][2] for r in results] == reference  # accepted requests produce the offline greedy output
    # the server counted the same: completions, 503 rejections, and no request failed
    assert metric(m, "modserve:request_success_total", finished_reason="length") == CLIENTS
    assert metric(m, "modserve:request_rejected_total", reason="overloaded") == rejections
    assert metric(m, "modserve:request_success_total", finished_reason="error") == 0
    # waiting never exceeded its bound (preempted requests re-queue, so allow the running ones too)
    assert max(w for _, w, _ in kv.samples) <= MAX_WAITING + MAX_NUM_SEQS
    # KV pressure was met by preemption; the cache is only momentarily full
    assert metric(m, "modserve:num_preemptions_total") > 0
    assert max(usage) <= 1.0 and full <= 0.5 * len(usage) and streak < 2.0
