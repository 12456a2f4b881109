"""Serving metrics, defined as vLLM's ``vllm bench serve`` (``benchmark_serving``) defines them.

Per request, measured on the client from the moment the request is sent (after any wait for a
``--max-concurrency`` seat):

- **TTFT**: time to the first streamed chunk that carries output text.
- **ITL**: the gap between each later chunk with a choice and the one before (one sample per
  chunk, so a chunk carrying several tokens is one long gap, as in vLLM).
- **E2E** (``e2el``): time to the last chunk with a choice; ``E2E = TTFT + sum(ITL)``.
- **TPOT**: ``(E2E - TTFT) / (output_tokens - 1)``, only for requests with more than one
  output token; ``output_tokens`` is the server's ``usage.completion_tokens``.

Over the run (``duration`` from the first dispatch to the last response): request throughput
``completed / duration``, output token throughput ``sum(output tokens) / duration``, total token
throughput ``(sum(prompt tokens) + sum(output tokens)) / duration``, and goodput
``good requests / duration`` where a request is good when each SLO given (``ttft``, ``tpot``,
``e2el`` in ms) is met; a request with one output token has TPOT 0 for goodput. Failed requests
count in ``failed`` and nowhere else. Percentiles are numpy's (linear interpolation); the mean,
median, std and every ``--percentiles`` value are reported for TTFT, TPOT, ITL and E2E.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, ``time.perf_counter`` based)."""

    success: bool = False
    prompt_len: int = 0                 # usage.prompt_tokens, else the dataset's count
    output_tokens: int | None = None    # usage.completion_tokens; None if the server sent no usage
    expected_output_len: int = 0        # the max_tokens asked for
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0                # E2E
    start_time: float = 0.0
    error: str = ""

    @property
    def output_len(self) -> int:
        """Output tokens; without usage, the number of chunks with output (approximate)."""
        if self.output_tokens is not None:
            return self.output_tokens
        return 1 + len(self.itl) if self.success else 0


def percentile_key(p: float) -> str:
    """``99`` -> ``p99``; ``99.9`` -> ``p99.9`` (vLLM's result-file keys)."""
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--percentiles: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"--percentiles: values must be in (0, 100], got {text!r}")
    return values


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {key}: expected milliseconds, got {value!r}") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {key}: must be > 0 ms, got {value}")
        out[key] = ms
    return out


def tpot_of(r: RequestResult) -> float | None:
    """``(E2E - TTFT) / (output tokens - 1)``; None with one output token or fewer."""
    n = r.output_len
    return (r.latency - r.ttft) / (n - 1) if n > 1 else None


def is_good(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.latency}
    return all(values[k] <= ms / 1000.0 for k, ms in slo_ms.items())


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values if values else [0.0]) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's metrics as a flat dict with vLLM's result-file keys, plus per-request lists."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    good = sum(is_good(r, goodput) for r in ok) if goodput else None
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": (good / duration if duration > 0 else 0.0) if goodput else None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "goodput_config": dict(goodput) if goodput else None,
        "output_tokens_estimated": sum(1 for r in ok if r.output_tokens is None),
    }
    out.update(_peaks(ok))
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats(name, values, list(percentiles)))
    out.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len for r in results],
        requested_output_lens=[r.expected_output_len for r in results],
        ttfts=[r.ttft if r.success else None for r in results],
        e2els=[r.latency if r.success else None for r in results],
        itls=[list(r.itl) for r in results],
        errors=[r.error for r in results],
    )
    return out


def _peaks(ok: list[RequestResult]) -> dict[str, float]:
    """Peak output chunks per one-second bucket and peak concurrent requests (vLLM's extras)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(end - t0)) + 1)
    events = []
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            buckets[min(int(t - t0), len(buckets) - 1)] += 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    events.sort()
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return {"max_output_tokens_per_s": float(buckets.max()), "max_concurrent_requests": peak}


# --------------------------------------------------------------------- text


def format_result(m: dict[str, Any], percentiles: list[float], selected: list[str]) -> str:
    """vLLM's end-of-run table."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:{fmt}}" if value is not None else f"{label:<40} -")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("max_concurrency") is not None:
        row("Maximum request concurrency:", m["max_concurrency"])
    if m.get("request_rate") not in (None, float("inf"), "inf"):
        row("Request rate (req/s):", m["request_rate"], ".2f")
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for name in selected:
        lines.append("{s:{c}^50}".format(s=METRICS[name], c="-"))
        short = name.upper() if name != "e2el" else "E2EL"
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key[1:]} {short} (ms):", m[f"{key}_{name}_ms"], ".2f")
    if m.get("output_tokens_estimated"):
        lines.append(f"note: {m['output_tokens_estimated']} responses had no usage; their output tokens are chunk counts")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """One line per run of a sweep."""
    p = percentile_key(max(runs[0].get("percentiles", [99.0])))
    head = (f"{'concurrency':>11} {'rate':>6} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} "
            f"{p + ' TTFT':>10} {'med TPOT':>9} {p + ' ITL':>9} {p + ' E2E':>9}  (ms)")
    lines = [head]
    for m in runs:
        conc = "-" if m.get("max_concurrency") is None else str(m["max_concurrency"])
        rate = m.get("request_rate")
        rate = "inf" if rate in (None, float("inf"), "inf") else f"{rate:g}"
        lines.append(
            f"{conc:>11} {rate:>6} {m['completed']:>5} {m['failed']:>4} {m['request_throughput']:>7.2f} "
            f"{m['output_throughput']:>9.1f} {m[f'{p}_ttft_ms']:>10.1f} {m['median_tpot_ms']:>9.1f} "
            f"{m[f'{p}_itl_ms']:>9.1f} {m[f'{p}_e2el_ms']:>9.1f}"
        )
    return "\n".join(lines)
