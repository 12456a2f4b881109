"""A bounded shared-prefix chat load over the OpenAI API, and what each request came to.

Groups of requests share a long system prompt (the prefix a router should keep together) and
differ in the user question. Every request streams (``stream_options.include_usage``) so the
client sees its time to first token, how many prompt tokens the server found cached, which
replica answered (``x-modserve-replica``) and whether it was retried (``x-modserve-retries``).

Each request ends as one of:
- ``ok``: a 200 stream that ended with ``[DONE]`` and no error event;
- ``error``: a clean failure: an OpenAI error JSON with a non-200 status, or an error event
  followed by ``[DONE]``;
- ``broken``: anything else (connection dropped, malformed stream, or no end within the
  request timeout), which a serving stack must never produce.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import httpx

_WORDS = (
    "river stone lantern orchard copper meadow harbor signal pattern winter garden ledger "
    "compass thunder marble violet engine canvas summit basket anchor feather silver"
).split()


@dataclass
class Outcome:
    status: str  # ok | error | broken
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str | None = None
    retries: int = 0
    group: int = 0
    detail: str = ""


@dataclass
class Summary:
    requests: int
    ok: int
    error: int
    broken: int
    retried: int
    prefix_hit_rate: float  # cached prompt tokens / prompt tokens, over ok requests
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    output_tok_s: float
    wall_s: float
    replicas: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def workload(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[tuple[int, list[dict]]]:
    """``groups * per_group`` chats, shuffled: ``(group, messages)``."""
    rng = random.Random(seed)
    items = []
    for g in range(groups):
        system = f"Assistant profile {g}. " + " ".join(rng.choice(_WORDS) for _ in range(prefix_words))
        for q in range(per_group):
            question = f"Question {q} for profile {g}: name a {rng.choice(_WORDS)} and a {rng.choice(_WORDS)}."
            items.append((g, [{"role": "system", "content": system}, {"role": "user", "content": question}]))
    rng.shuffle(items)
    return items


async def one_request(client: httpx.AsyncClient, url: str, model: str, group: int, messages: list[dict],
                      max_tokens: int, timeout_s: float, on_first_token: Callable[[str | None], None] | None = None,
                      stream: bool = True) -> Outcome:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update({"stream": True, "stream_options": {"include_usage": True}} if stream else {})
    t0 = time.perf_counter()
    out = Outcome("broken", group=group)

    def usage(u: dict) -> None:
        out.prompt_tokens = u["prompt_tokens"]
        out.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    async def read() -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            out.replica = r.headers.get("x-modserve-replica")
            out.retries = int(r.headers.get("x-modserve-retries", "0"))
            if r.status_code != 200 or not stream:
                data = json.loads(await r.aread())
                if r.status_code == 200 and "choices" in data:
                    usage(data["usage"])
                    out.status = "ok"
                else:
                    out.status, out.detail = ("error", data["error"]["message"]) if "error" in data else ("broken", str(data))
                return
            errored, done = None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    errored = chunk["error"]["message"]
                    continue
                if out.ttft_s is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    out.ttft_s = time.perf_counter() - t0
                    if on_first_token is not None:
                        on_first_token(out.replica)
                if chunk.get("usage"):
                    usage(chunk["usage"])
            if done:
                out.status, out.detail = ("error", errored) if errored else ("ok", "")
            else:
                out.detail = "the stream ended without [DONE]"

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        out.detail = f"no end within {timeout_s} s"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.detail = f"{type(e).__name__}: {e}"
    finally:
        out.latency_s = time.perf_counter() - t0
    return out


async def run_load(url: str, model: str, items: list[tuple[int, list[dict]]], concurrency: int, max_tokens: int,
                   timeout_s: float = 120.0, on_first_token: Callable[[str | None], None] | None = None,
                   unstreamed_every: int = 0) -> tuple[list[Outcome], float]:
    """Every item once, at most ``concurrency`` at a time; returns outcomes in item order and
    the wall time. With ``unstreamed_every = k``, every k-th request is not streamed (its
    answer comes whole at the end, so a replica lost meanwhile has sent nothing)."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(client, i, group, messages) -> Outcome:
        stream = not (unstreamed_every and i % unstreamed_every == unstreamed_every - 1)
        async with sem:
            return await one_request(client, url, model, group, messages, max_tokens, timeout_s, on_first_token, stream)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(bounded(client, i, g, m) for i, (g, m) in enumerate(items)))
        return list(outcomes), time.perf_counter() - t0


def summarize(outcomes: list[Outcome], wall_s: float, max_tokens: int) -> Summary:
    ok = [o for o in outcomes if o.status == "ok"]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    prompt = sum(o.prompt_tokens for o in ok)
    replicas: dict[str, int] = {}
    for o in ok:
        replicas[o.replica or "?"] = replicas.get(o.replica or "?", 0) + 1
    return Summary(
        requests=len(outcomes), ok=len(ok), error=sum(o.status == "error" for o in outcomes),
        broken=sum(o.status == "broken" for o in outcomes), retried=sum(o.retries > 0 for o in outcomes),
        prefix_hit_rate=(sum(o.cached_tokens for o in ok) / prompt) if prompt else 0.0,
        ttft_p50_s=statistics.median(ttfts) if ttfts else None,
        ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        output_tok_s=len(ok) * max_tokens / wall_s if wall_s else 0.0, wall_s=wall_s, replicas=replicas,
    )


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.5) -> float | None:
    """Seconds until ``check()`` held, or None if it never did within ``timeout_s``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if await check():
            return time.perf_counter() - t0
        await asyncio.sleep(every_s)
    return None
