"""``modserve bench serve``: an online benchmark client for any OpenAI-compatible server.

Streams requests (``stream_options.include_usage``) to ``--base-url`` over one asyncio + httpx
client, with arrivals at ``--request-rate`` (Poisson, or gamma with ``--burstiness``) and/or at
most ``--max-concurrency`` in flight, and reports the metrics of vLLM's ``vllm bench serve``
(see :mod:`modserve.bench.metrics` for the exact definitions). ``--max-concurrency 16,64``
or ``--request-rate 2,4,inf`` runs a sweep, one run after another against the same server.

Exit status: 0 when every run completed at least one request (failed requests are counted and
reported, not fatal); 1 when a run had no successful request; 2 for bad arguments or when the
server cannot be reached before the run (no ``--model`` and ``GET /v1/models`` fails, or every
warm-up request fails).

Also runnable as ``python -m modserve.bench.serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from modserve.bench import datasets as ds
from modserve.bench.metrics import (
    METRICS,
    RequestResult,
    compute_metrics,
    format_result,
    format_sweep,
    parse_goodput,
    parse_percentiles,
)

DATASETS = ("random", "prefix_repetition", "jsonl", "sharegpt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per request")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, help="default: random, or from --dataset-path's extension")
    g.add_argument("--dataset-path", help="a JSONL file of prompts or a ShareGPT JSON file")
    g.add_argument("--num-prompts", default="100", help="requests per run; a comma list pairs with a sweep")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", help="tokenizer.json (or a directory with one): allowed ids for random prompts, "
                   "token counts for text datasets")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0, help="random ids shared by every random prompt")
    g.add_argument("--random-token-range", help=f"LO:HI token ids for synthetic prompts "
                   f"(default: from --tokenizer, else {ds.DEFAULT_TOKEN_RANGE[0]}:{ds.DEFAULT_TOKEN_RANGE[1]})")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--jsonl-output-len", type=int, default=256, help="max_tokens for JSONL lines without their own")
    g.add_argument("--sharegpt-output-len", type=int, help="max_tokens for every ShareGPT request "
                   "(default: the length of the recorded reply)")

    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once); a comma list sweeps")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 is Poisson, "
                   "<1 burstier, >1 more uniform")
    g.add_argument("--max-concurrency", default=None, help="most requests in flight; a comma list sweeps (16,64)")
    g.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent first (max_tokens <= 16)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (default: on for random and prefix_repetition, off for files)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", help="JSON object merged into every request body")

    g = p.add_argument_group("report")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50")
    g.add_argument("--label", help="name of this system in the result and charts (default: the model)")
    g.add_argument("--output", help="write the result JSON (one run: an object; a sweep: a list)")
    g.add_argument("--plot", metavar="DIR", help="write PNG charts (needs matplotlib: pip install 'modserve[bench]')")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    return asyncio.run(_run(args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="modserve bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"modserve bench serve: error: {e}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------- options


def _sweep_values(text: str | None, flag: str, parse) -> list:
    if text is None:
        return [None]
    try:
        values = [parse(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected a number or a comma-separated list, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: empty")
    return values


def _positive_int(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError
    return v


def _positive_rate(x: str) -> float:
    v = float(x)
    if not v > 0:
        raise ValueError
    return v


def plan_runs(args) -> list[dict[str, Any]]:
    """The sweep: one dict per run with ``max_concurrency``, ``request_rate``, ``num_prompts``."""
    conc = _sweep_values(args.max_concurrency, "--max-concurrency", _positive_int)
    rates = _sweep_values(args.request_rate, "--request-rate", _positive_rate)
    nums = _sweep_values(args.num_prompts, "--num-prompts", _positive_int)
    if len(conc) > 1 and len(rates) > 1:
        raise ValueError("sweep one of --max-concurrency and --request-rate at a time")
    points = [{"max_concurrency": c, "request_rate": rates[0]} for c in conc] if len(conc) > 1 else [
        {"max_concurrency": conc[0], "request_rate": r} for r in rates
    ]
    if len(nums) not in (1, len(points)):
        raise ValueError(f"--num-prompts: give one value or {len(points)} (one per sweep point), got {len(nums)}")
    for i, pt in enumerate(points):
        pt["num_prompts"] = nums[0] if len(nums) == 1 else nums[i]
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness: must be > 0, got {args.burstiness}")
    return points


def dataset_name(args) -> str:
    if args.dataset_name:
        if args.dataset_name in ("jsonl", "sharegpt") and not args.dataset_path:
            raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
        return args.dataset_name
    if args.dataset_path:
        return "jsonl" if args.dataset_path.endswith(".jsonl") else "sharegpt"
    return "random"


def join_url(base: str, path: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + (path if path.startswith("/") else "/" + path)


def server_root(base: str) -> str:
    base = base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


# --------------------------------------------------------------------- arrivals


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times (s after the start) as vLLM draws them: gamma gaps of mean ``1/rate`` and shape
    ``burstiness`` (1: Poisson), rescaled so the last request goes out at ``n / rate``; all 0 for inf."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    cum = np.cumsum(gaps)
    if cum[-1] > 0:
        cum *= (n / rate) / cum[-1]
    return cum.tolist()


# --------------------------------------------------------------------- requests


class Client:
    """One ``httpx.AsyncClient`` for everything the benchmark sends."""

    def __init__(self, args, max_connections: int | None) -> None:
        import httpx

        self.httpx = httpx
        self.root = server_root(args.base_url)
        self.url = join_url(args.base_url, args.endpoint)
        self.chat = args.endpoint.rstrip("/").endswith("chat/completions")
        key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def first_model(self) -> tuple[str, int | None]:
        url = self.root + "/v1/models"
        try:
            r = await self.http.get(url, headers=self.headers)
        except self.httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach the server: GET {url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status_code}: {_error_text(r.text)}")
        try:
            card = r.json()["data"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RuntimeError(f"GET {url}: no model listed; pass --model") from None
        return card["id"], card.get("max_model_len")

    async def post_json(self, path: str, body: dict) -> dict | None:
        try:
            r = await self.http.post(self.root + path, json=body, headers=self.headers)
        except self.httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def payload(self, model: str, req: ds.SampleRequest, args, ignore_eos: bool, extra: dict) -> dict:
        body: dict[str, Any] = {"model": model}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        body.update(stream=True, stream_options={"include_usage": True}, temperature=args.temperature)
        if ignore_eos:
            body["ignore_eos"] = True
        body.update(extra)
        return body

    async def send(self, body: dict, req: ds.SampleRequest) -> RequestResult:
        """Stream one request; timings per :mod:`modserve.bench.metrics`."""
        r = RequestResult(prompt_len=req.prompt_len or 0, expected_output_len=req.output_len)
        st = time.perf_counter()
        r.start_time = st
        first_text = None  # time of the first chunk with output text
        first_choice = None  # time of the first chunk with a choice (fallback when no text ever comes)
        last = st
        try:
            async with self.http.stream("POST", self.url, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    r.error = f"HTTP {resp.status_code}: {_error_text(text)}"
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": keep-alive" comments, "event:" lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        r.error = f"error event: {_error_text(json.dumps(obj))}"
                        return r
                    if choices := obj.get("choices"):
                        c = choices[0]
                        if self.chat:
                            delta = c.get("delta") or {}
                            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                        else:
                            text = c.get("text")
                        if first_choice is None:
                            first_choice = now
                        if first_text is None:
                            if text:
                                first_text = now
                                r.ttft = now - st
                        else:
                            r.itl.append(now - last)
                        last = now
                    if usage := obj.get("usage"):
                        r.output_tokens = usage.get("completion_tokens")
                        if usage.get("prompt_tokens") is not None:
                            r.prompt_len = usage["prompt_tokens"]
        except Exception as e:  # noqa: BLE001 - any failure of one request is counted, not raised
            r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return r
        if first_text is None and first_choice is not None:
            r.ttft = first_choice - st  # a response without any text: time to its first choice
        if first_choice is None:
            r.error = "the stream ended without a chunk carrying a choice"
            return r
        r.latency = last - st
        r.success = True
        return r


def _error_text(body: str, limit: int = 300) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        text = str(msg) if msg else body
    except (ValueError, AttributeError):
        text = body
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "")


# --------------------------------------------------------------------- datasets


async def build_requests(args, client: Client, num: int, tokenizer, name: str) -> list[ds.SampleRequest]:
    if name in ("random", "prefix_repetition"):
        if args.random_token_range:
            tokens = ds.TokenSpace.from_range(*ds.parse_token_range(args.random_token_range))
        elif tokenizer is not None:
            tokens = ds.TokenSpace.from_tokenizer(tokenizer)
        else:
            tokens = ds.TokenSpace.from_range(*ds.DEFAULT_TOKEN_RANGE)
        if name == "random":
            reqs = ds.random_requests(num, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                      tokens, args.seed, args.random_prefix_len)
        else:
            reqs = ds.prefix_repetition_requests(
                num, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, tokens, args.seed)
    elif name == "jsonl":
        reqs = ds.jsonl_requests(args.dataset_path, num, args.jsonl_output_len)
    else:
        reqs = await _sharegpt(args, client, num, tokenizer)
    if client.chat:
        reqs = await _as_text(reqs, client, tokenizer)
    return reqs


async def _count_tokens(texts: list[str], client: Client, tokenizer, warned: list[bool]) -> list[int]:
    if tokenizer is not None:
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    out = []
    for text in texts:
        got = await client.post_json("/tokenize", {"prompt": text, "add_special_tokens": False})
        if got is not None and ("tokens" in got or "count" in got):
            out.append(len(got["tokens"]) if "tokens" in got else int(got["count"]))
        else:
            if not warned[0]:
                print("warning: no --tokenizer and the server has no /tokenize: "
                      "estimating tokens as characters / 4", file=sys.stderr)
                warned[0] = True
            out.append(max(1, len(text) // 4))
    return out


async def _sharegpt(args, client: Client, num: int, tokenizer) -> list[ds.SampleRequest]:
    pairs = ds.sharegpt_pairs(args.dataset_path, args.seed)
    accepted: list[ds.SampleRequest] = []
    warned = [False]
    batch = 64
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        plens = await _count_tokens([p for p, _ in chunk], client, tokenizer, warned)
        if args.sharegpt_output_len is None:
            rlens = await _count_tokens([c for _, c in chunk], client, tokenizer, warned)
        else:
            rlens = [args.sharegpt_output_len] * len(chunk)
        for (prompt, _), pl, rl in zip(chunk, plens, rlens):
            out = ds.sharegpt_accept(pl, rl, args.sharegpt_output_len)
            if out is not None:
                accepted.append(ds.SampleRequest(prompt, pl, out))
                if len(accepted) == num:
                    return accepted
    if not accepted:
        raise ValueError(f"{args.dataset_path}: no conversation passes the length filter")
    return [accepted[i % len(accepted)] for i in range(num)]


async def _as_text(reqs: list[ds.SampleRequest], client: Client, tokenizer) -> list[ds.SampleRequest]:
    """Chat needs text: token-id prompts are decoded with --tokenizer or the server's /detokenize."""
    out = []
    for r in reqs:
        if isinstance(r.prompt, str):
            out.append(r)
            continue
        if tokenizer is not None:
            text = tokenizer.decode(r.prompt)
        else:
            got = await client.post_json("/detokenize", {"tokens": r.prompt})
            if got is None or "prompt" not in got:
                raise RuntimeError("the chat endpoint needs text prompts: pass --tokenizer to decode the random "
                                   "token ids (the server has no usable /detokenize)")
            text = got["prompt"]
        out.append(ds.SampleRequest(text, None, r.output_len))  # the true length comes back in usage
    return out


# --------------------------------------------------------------------- running


class Progress:
    """A plain-text progress line on stderr (rewritten in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.step = max(1, total // 10)

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.success
        if self.enabled and (self.tty or self.done % self.step == 0 or self.done == self.total):
            elapsed = time.perf_counter() - self.t0
            bar = "#" * int(20 * self.done / self.total)
            line = (f"{self.label} [{bar:<20}] {self.done}/{self.total} done, {self.failed} failed, "
                    f"{elapsed:.1f}s")
            end = "" if self.tty and self.done < self.total else "\n"
            print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


async def benchmark(client: Client, bodies: list[dict], reqs: list[ds.SampleRequest], point: dict,
                    burstiness: float, seed: int, progress: Progress) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(reqs), point["request_rate"], burstiness, np.random.default_rng(seed))
    sem = asyncio.Semaphore(point["max_concurrency"]) if point["max_concurrency"] else None

    async def one(body: dict, req: ds.SampleRequest) -> RequestResult:
        if sem is None:
            res = await client.send(body, req)
        else:
            async with sem:
                res = await client.send(body, req)
        progress.update(res)
        return res

    start = time.perf_counter()
    tasks = []
    for body, req, offset in zip(bodies, reqs, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(body, req)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def _run(args) -> int:
    points = plan_runs(args)
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if bad := [m for m in selected if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    name = dataset_name(args)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body: expected a JSON object")
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else name in ("random", "prefix_repetition")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups: must be >= 0")
    if args.plot:
        from modserve.bench import plots

        plots.require_matplotlib()
    tokenizer = ds.load_tokenizer(args.tokenizer) if args.tokenizer else None
    concs = [p["max_concurrency"] for p in points]
    client = Client(args, None if None in concs else max(concs))
    try:
        if args.model:
            model, max_model_len = args.model, None
        else:
            model, max_model_len = await client.first_model()
        num, warm, slices = request_plan([p["num_prompts"] for p in points], args.num_warmups, name == "random")
        reqs = await build_requests(args, client, num, tokenizer, name)
        if max_model_len:
            too_long = sum(1 for r in reqs if r.prompt_len and r.prompt_len + r.output_len > max_model_len)
            if too_long:
                print(f"warning: {too_long} requests exceed the server's max_model_len {max_model_len}",
                      file=sys.stderr)
        bodies = [client.payload(model, r, args, ignore_eos, extra) for r in reqs]
        label = args.label or model
        print(f"modserve bench serve: {label} at {client.url}, dataset {name}, "
              f"{len(points)} run(s)", file=sys.stderr)
        await _warm_up(client, bodies[warm], reqs[warm], args.num_warmups)
        runs = []
        for point, run in zip(points, slices):
            run = slice(run.start, min(run.stop, len(reqs)))  # prefix_repetition rounds down
            n = point["num_prompts"] = run.stop - run.start
            tag = f"c={point['max_concurrency'] or '-'} rate={point['request_rate']:g}"
            progress = Progress(n, tag, not args.no_progress)
            results, duration = await benchmark(client, bodies[run], reqs[run], point, args.burstiness, args.seed,
                                                progress)
            m = compute_metrics(results, duration, percentiles, goodput)
            m = {**_run_info(args, point, model, label, name, ignore_eos, client, percentiles), **m}
            runs.append(m)
            print(format_result(m, percentiles, selected))
            if m["failed"]:
                first = next(e for e in m["errors"] if e)
                print(f"{m['failed']} of {n} requests failed; first error: {first}", file=sys.stderr)
    finally:
        await client.aclose()
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs[0] if len(runs) == 1 else runs, f, indent=1)
    if args.plot:
        from modserve.bench import plots

        for path in plots.plot_runs(runs, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if any(m["completed"] == 0 for m in runs):
        print("modserve bench serve: a run had no successful request", file=sys.stderr)
        return 1
    return 0


def request_plan(nums: list[int], warmups: int, distinct: bool) -> tuple[int, slice, list[slice]]:
    """How many requests to draw, which serve the warm-up, and which each run of a sweep sends.

    ``distinct`` (the random dataset): every run and the warm-up get requests of their own,
    so a server's prefix cache cannot answer one run's prompts from an earlier run's (with
    shared prompts, the second level of a 16,64 sweep found its first 64 prompts cached and
    its throughput and TTFT flattered). Otherwise (prefix_repetition shares its prefixes by
    design; file datasets repeat their prompts anyway) each run takes the first n."""
    if not distinct:
        return max(nums), slice(0, None), [slice(0, n) for n in nums]
    starts = [sum(nums[:i]) for i in range(len(nums))]
    total = sum(nums)
    return total + warmups, slice(total, None), [slice(a, a + n) for a, n in zip(starts, nums)]


async def _warm_up(client: Client, bodies: list[dict], reqs: list[ds.SampleRequest], n: int) -> None:
    if n == 0:
        return
    capped = []
    for i in range(n):
        body = dict(bodies[i % len(bodies)])
        key = "max_completion_tokens" if client.chat else "max_tokens"
        body[key] = min(body[key], 16)
        capped.append(client.send(body, reqs[i % len(reqs)]))
    results = await asyncio.gather(*capped)
    if not any(r.success for r in results):
        raise RuntimeError(f"warm-up request to {client.url} failed: {results[0].error} "
                           f"(--num-warmups 0 skips the warm-up)")


def _run_info(args, point, model, label, name, ignore_eos, client, percentiles) -> dict[str, Any]:
    rate = point["request_rate"]
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "client": "modserve bench serve",
        "label": label,
        "base_url": client.root,
        "endpoint": args.endpoint,
        "model_id": model,
        "dataset_name": name,
        "num_prompts": point["num_prompts"],
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": "inf" if math.isinf(args.burstiness) else args.burstiness,
        "max_concurrency": point["max_concurrency"],
        "ignore_eos": ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "percentiles": percentiles,
    }
    if name == "random":
        info.update(random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                    random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len)
    elif name == "prefix_repetition":
        info.update(prefix_len=args.prefix_repetition_prefix_len, suffix_len=args.prefix_repetition_suffix_len,
                    num_prefixes=args.prefix_repetition_num_prefixes,
                    output_len=args.prefix_repetition_output_len)
    else:
        info["dataset_path"] = args.dataset_path
    return info


if __name__ == "__main__":
    sys.exit(main())
