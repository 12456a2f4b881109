"""A bounded soak: a real ``serve`` process (priority scheduler, ngram speculation, a KV cache
small enough to preempt) under a mix of streaming and whole requests, chat and text,
``n`` up to 3, long prompts, priorities, greedy and seeded sampling, and clients that hang
up mid-stream or while waiting.

At the end every request is accounted for by the client (completed, cancelled by its
client, or rejected with a reason) and by the server's access log; none failed or got
lost; greedy outputs of the same prompt never differed; the engine is idle with an empty
KV cache; and resident memory grew less than ``RSS_GROWTH_BOUND_MB`` after warm-up.

``MODSERVE_SOAK_SECONDS`` sets the duration (CI default 20 s; a few minutes for a real
soak, e.g. ``MODSERVE_SOAK_SECONDS=300``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
from reliability_helpers import metric, wait_idle
from server_helpers import server_process

SOAK_SECONDS = float(os.environ.get("MODSERVE_SOAK_SECONDS", "20"))
WORKERS = 6
RSS_GROWTH_BOUND_MB = 64  # after warm-up, whatever the duration: no per-request leak
SECTIONS = dict(
    scheduler={"plugin": "priority", "max_num_seqs": 8, "max_num_batched_tokens": 512},
    speculative={"plugin": "ngram", "num_speculative_tokens": 3},
    kv_cache={"num_blocks": 64},  # 1024 tokens for up to 8 sequences of up to 512: preemption happens
    server={"max_waiting_requests": 6},
)
GREEDY_PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Hello, world!"]
TEXT = "Once upon a time there was a small model that served tokens very fast. "


@dataclass
class Record:
    kind: str
    outcome: str | None = None  # completed | cancelled | rejected | failed
    detail: str = ""
    greedy_key: tuple | None = None
    texts: list[str] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def _body(rng: random.Random, chat: bool) -> tuple[dict, tuple | None]:
    """A random request; also its key if it is greedy and deterministic (same key, same text)."""
    body: dict = {"max_tokens": rng.randint(4, 40), "priority": rng.randint(-3, 3)}
    greedy = rng.random() < 0.5
    if greedy:
        body.update(temperature=0, max_tokens=rng.choice([8, 24]))  # few distinct keys: many repeats to compare
    else:
        body.update(temperature=0.9, seed=rng.randint(0, 1000))
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([" the", ".", "\n"])]
    if rng.random() < 0.2 and not chat:
        body["logprobs"] = 2
    if chat:
        text = rng.choice(GREEDY_PROMPTS) if greedy else TEXT * rng.randint(1, 20)
        body["messages"] = [{"role": "user", "content": text}]
    elif rng.random() < 0.25:  # a long prompt: 200-450 tokens
        body["prompt"] = [rng.randrange(20, 380) for _ in range(rng.randint(200, 450))]
        body["max_tokens"] = min(body["max_tokens"], 500 - len(body["prompt"]))
    else:
        body["prompt"] = rng.choice(GREEDY_PROMPTS) if greedy else TEXT * rng.randint(1, 8)
    key = None
    if greedy and "n" not in body:
        key = (json.dumps(body.get("prompt") or body["messages"]), body["max_tokens"], json.dumps(body.get("stop")))
    return body, key


def _one(http: httpx.Client, url: str, rng: random.Random, rec: Record) -> None:
    chat = rng.random() < 0.35
    body, rec.greedy_key = _body(rng, chat)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    n = body.get("n", 1) * (1 if chat or isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int) else len(body["prompt"]))
    mode = rng.choices(["whole", "stream", "drop_stream", "drop_wait"], [4, 4, 1, 1])[0]
    rec.kind = f"{'chat' if chat else 'text'}/{mode}"
    if mode in ("stream", "drop_stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
        drop_after = rng.randint(1, 4) if mode == "drop_stream" else None
        with http.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return _refused(r.status_code, r.read(), r.headers, rec)
            texts, finished, events = defaultdict(str), set(), 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events += 1
                if drop_after is not None and events >= drop_after:
                    rec.outcome = "cancelled"  # hang up mid-stream
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.outcome, rec.detail = "failed", f"error event {chunk['error']}"
                    return
                for c in chunk["choices"]:
                    texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if c.get("finish_reason"):
                        finished.add(c["index"])
            else:
                rec.outcome, rec.detail = "failed", "stream ended without [DONE]"
                return
        if len(finished) != n:
            rec.outcome, rec.detail = "failed", f"{len(finished)} of {n} choices finished"
            return
        rec.outcome, rec.texts = "completed", [texts[i] for i in sorted(texts)]
        return
    try:
        timeout = rng.uniform(0.02, 0.3) if mode == "drop_wait" else 120
        r = http.post(url + path, json=body, timeout=timeout)
    except httpx.TimeoutException:
        rec.outcome = "cancelled"  # gave up waiting and closed the connection
        return
    if r.status_code != 200:
        return _refused(r.status_code, r.content, r.headers, rec)
    choices = r.json()["choices"]
    if len(choices) != n or any(c["finish_reason"] not in ("stop", "length") for c in choices):
        rec.outcome, rec.detail = "failed", f"bad choices {choices}"
        return
    rec.outcome = "completed"
    rec.texts = [c.get("text") if "text" in c else c["message"]["content"] for c in choices]


def _refused(status: int, content: bytes, headers, rec: Record) -> None:
    err = json.loads(content)["error"]
    if status == 503 and err["code"] == "overloaded" and headers.get("retry-after"):
        rec.outcome, rec.detail = "rejected", err["code"]
    else:
        rec.outcome, rec.detail = "failed", f"{status} {err}"


def test_soak(tmp_path):
    proc, url = server_process(tmp_path, **SECTIONS)
    records: list[Record] = []
    lock = threading.Lock()
    warm = threading.Event()
    rss: dict[str, float] = {}
    t0 = time.monotonic()
    deadline = t0 + SOAK_SECONDS

    def worker(i: int) -> None:
        rng = random.Random(1000 + i)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                rec = Record("?")
                with lock:
                    records.append(rec)
                try:
                    _one(http, url, rng, rec)
                except Exception as e:  # transport errors and the like: a failure, never silently dropped
                    rec.outcome, rec.detail = "failed", f"{type(e).__name__}: {e}"
                if rec.outcome == "rejected":
                    time.sleep(0.2)

    def warmup_watch() -> None:
        while time.monotonic() < t0 + max(3.0, SOAK_SECONDS / 4):
            time.sleep(0.1)
        rss["warm"] = rss_mb(proc.pid)
        warm.set()

    try:
        rss["start"] = rss_mb(proc.pid)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
        threads.append(threading.Thread(target=warmup_watch))
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 180)
            assert not t.is_alive()
        m = wait_idle(url)  # running 0, waiting 0, kv_cache_usage_perc 0
        rss["end"] = rss_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # drains and exits cleanly after all that
    finally:
        proc.kill()
        proc.wait()

    outcomes = Counter(r.outcome for r in records)
    failed = [(r.kind, r.detail) for r in records if r.outcome == "failed"]
    lost = sum(1 for r in records if r.outcome is None)
    # the server's view: one access-log line per HTTP request
    access = [line for line in (tmp_path / "server.log").read_text().splitlines() if "modserve.access" in line
              and ("/v1/completions" in line or "/v1/chat/completions" in line)]
    statuses = Counter(int(re.search(r'" (\d{3}) id=', line).group(1)) for line in access)
    differing = defaultdict(set)
    for r in records:
        if r.outcome == "completed" and r.greedy_key is not None:
            differing[r.greedy_key].add(r.texts[0])
    unstable = {k: v for k, v in differing.items() if len(v) > 1}
    repeated = Counter(r.greedy_key for r in records if r.outcome == "completed" and r.greedy_key is not None)
    growth = rss["end"] - rss["warm"]
    print(f"\nsoak: {SOAK_SECONDS:.0f}s, {len(records)} requests: {outcomes['completed']} completed, "
          f"{outcomes['cancelled']} cancelled by clients, {outcomes['rejected']} rejected (503 overloaded), "
          f"{len(failed)} failed, {lost} lost; kinds {dict(Counter(r.kind for r in records))}; "
          f"server access log {len(access)} lines {dict(statuses)}; "
          f"aborts {metric(m, 'modserve:request_success_total', finished_reason='abort'):.0f}, "
          f"preemptions {metric(m, 'modserve:num_preemptions_total'):.0f}, "
          f"draft tokens {metric(m, 'modserve:spec_decode_num_draft_tokens_total'):.0f} "
          f"(accepted {metric(m, 'modserve:spec_decode_num_accepted_tokens_total'):.0f}); "
          f"RSS start {rss['start']:.0f} MB, after warm-up {rss['warm']:.0f} MB, end {rss['end']:.0f} MB "
          f"(growth {growth:+.1f} MB, bound {RSS_GROWTH_BOUND_MB} MB); {sum(c for c in repeated.values() if c > 1)} greedy completions over {sum(1 for c in repeated.values() if c > 1)} "
          f"repeated prompts compared")

    assert not failed, failed[:5]
    assert lost == 0
    assert outcomes["completed"] + outcomes["cancelled"] + outcomes["rejected"] == len(records)
    assert outcomes["completed"] > 0 and outcomes["cancelled"] > 0
    assert len(access) == len(records)  # every request reached the server and was logged once
    assert statuses[503] == outcomes["rejected"] == metric(m, "modserve:request_rejected_total", reason="overloaded")
    assert not any(s >= 500 and s != 503 for s in statuses)
    assert metric(m, "modserve:request_success_total", finished_reason="error") == 0
    assert not unstable, list(unstable.items())[:2]  # preemption, speculation, batching never changed a greedy text
    assert metric(m, "modserve:spec_decode_num_draft_tokens_total") > 0  # speculation was on
    assert growth < RSS_GROWTH_BOUND_MB
