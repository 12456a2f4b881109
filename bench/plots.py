"""PNG charts for ``modserve bench serve --plot DIR`` and the peer comparison (matplotlib, optional).

- ``ttft_distribution.png`` / ``itl_distribution.png``: histogram and CDF per run;
- for a sweep (several ``--max-concurrency`` or ``--request-rate`` values):
  ``throughput.png`` (output tok/s and req/s against concurrency or rate) and
  ``latency_tail.png`` (the highest ``--percentiles`` value of TTFT, TPOT, ITL and E2E against it);
- :func:`plot_compare` draws the same throughput and tail-latency curves with one line per
  system, and TTFT / ITL CDFs per concurrency.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from modserve.bench.metrics import percentile_key

INSTALL_HINT = "--plot needs matplotlib: pip install 'modserve[bench]' (or: pip install 'matplotlib>=3.8')"


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tail_key(run: dict[str, Any]) -> str:
    return percentile_key(max(run.get("percentiles") or [99.0]))


def sweep_axis(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """(result key, axis label) of what varies across the runs."""
    if len({r.get("max_concurrency") for r in runs}) > 1:
        return "max_concurrency", "max concurrency (requests in flight)"
    return "request_rate", "request rate (req/s)"


def _x(run: dict[str, Any], key: str) -> float:
    v = run.get(key)
    return math.inf if v in (None, "inf") else float(v)


def _run_name(run: dict[str, Any]) -> str:
    if run.get("max_concurrency") is not None:
        return f"concurrency {run['max_concurrency']}"
    rate = run.get("request_rate")
    return "all at once" if rate in (None, "inf") else f"{rate:g} req/s"


def _values_ms(run: dict[str, Any], metric: str) -> np.ndarray:
    if metric == "itl":
        vals = [g for gaps in run.get("itls", []) for g in gaps]
    else:
        vals = [v for v in run.get(metric + "s", []) if v is not None]
    return np.asarray(vals, dtype=float) * 1000.0


def _placer(runs, key: str):
    """Where each swept value goes on the x axis: itself, or for an infinite rate twice the largest finite one."""
    finite = [v for v in (_x(r, key) for r in runs) if math.isfinite(v)]
    inf_at = 2 * max(finite) if finite else 1.0
    return lambda v: v if math.isfinite(v) else inf_at


def _ticks(axes, runs, key: str) -> None:
    """Ticks at the swept values themselves, ``inf`` labelled as such."""
    place = _placer(runs, key)
    values = sorted({_x(r, key) for r in runs})
    for ax in axes:
        ax.set_xticks([place(v) for v in values], [f"{v:g}" for v in values])


def _cdf(ax, values: np.ndarray, label: str) -> None:
    if len(values):
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def _save(plt, fig, axes, path: str, from_zero: bool) -> str:
    """Grid and legend on each of ``axes`` (y from 0 where ``from_zero``), then ``fig`` to ``path``."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if from_zero:
            ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _distribution(plt, runs, metric: str, title: str, path: str, names=None) -> str:
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(runs):
        vals = _values_ms(run, metric)
        name = names[i] if names else _run_name(run)
        if len(vals):
            hist.hist(vals, bins=40, alpha=0.5, label=name)
        _cdf(cdf, vals, name)
    hist.set(xlabel=f"{title} (ms)", ylabel="count", title=f"{title} histogram")
    cdf.set(xlabel=f"{title} (ms)", ylabel="fraction of samples", title=f"{title} CDF", ylim=(0, 1.01))
    return _save(plt, fig, (hist, cdf), path, from_zero=False)


def plot_runs(runs: list[dict[str, Any]], out_dir: str) -> list[str]:
    """Charts for one ``bench serve`` invocation; returns the files written."""
    plt = require_matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    label = runs[0].get("label", "")
    written = [
        _distribution(plt, runs, "ttft", "TTFT", os.path.join(out_dir, "ttft_distribution.png")),
        _distribution(plt, runs, "itl", "ITL", os.path.join(out_dir, "itl_distribution.png")),
    ]
    if len(runs) > 1:
        written += plot_compare({label: runs}, out_dir, distributions=False)
    return written


def plot_compare(systems: dict[str, list[dict[str, Any]]], out_dir: str, distributions: bool = True) -> list[str]:
    """Throughput and tail latency against the swept value, one line per system."""
    plt = require_matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    any_runs = [r for runs in systems.values() for r in runs]
    key, axis = sweep_axis(any_runs)
    tail = _tail_key(any_runs[0])
    written = []
    place = _placer(any_runs, key)

    fig, (tok, req) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in systems.items():
        runs = sorted(runs, key=lambda r: _x(r, key))
        xs = [place(_x(r, key)) for r in runs]
        tok.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=name)
        req.plot(xs, [r["request_throughput"] for r in runs], marker="o", label=name)
    _ticks((tok, req), any_runs, key)
    tok.set(xlabel=axis, ylabel="output tokens/s", title="Output token throughput")
    req.set(xlabel=axis, ylabel="requests/s", title="Request throughput")
    written.append(_save(plt, fig, (tok, req), os.path.join(out_dir, "throughput.png"), from_zero=True))

    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        for name, runs in systems.items():
            runs = sorted(runs, key=lambda r: _x(r, key))
            ax.plot([place(_x(r, key)) for r in runs], [r.get(f"{tail}_{metric}_ms", float("nan")) for r in runs],
                    marker="o", label=name)
        ax.set(xlabel=axis, ylabel="ms", title=f"{tail.upper()} {metric.upper()}")
        _ticks((ax,), any_runs, key)
    written.append(_save(plt, fig, axes, os.path.join(out_dir, "latency_tail.png"), from_zero=True))

    if distributions:
        for x in sorted({_x(r, key) for r in any_runs}):
            picked, names = [], []
            for name, runs in systems.items():
                for r in runs:
                    if _x(r, key) == x:
                        picked.append(r)
                        names.append(name)
            tag = f"{'c' if key == 'max_concurrency' else 'rate'}{x:g}"
            for metric, title in (("ttft", "TTFT"), ("itl", "ITL")):
                path = os.path.join(out_dir, f"{metric}_{tag}.png")
                written.append(_distribution(plt, picked, metric, f"{title} at {_run_name(picked[0])}", path, names))
    return written
