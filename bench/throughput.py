"""``modserve bench throughput``: offline throughput, all requests submitted at once, ``ignore_eos``.

Requests come from ``bench serve``'s ``random`` dataset: prompt and output lengths drawn
uniformly within ``--range-ratio`` of ``--input-len`` / ``--output-len`` (0: all equal).
With ``--baseline hf`` the same requests run through HF ``transformers`` ``generate`` in
static batches of ``max_num_seqs`` in the same process, as vLLM's ``bench throughput
--backend hf`` runs them: each batch left-padded to its longest prompt and generating its
longest output, only each request's own output tokens counted. The ratio is printed.
Sweeps: ``--max-num-seqs 1,8,32`` and ``--dtype float32,bfloat16`` run every combination.
``--repeats N`` runs the whole sweep N times, modserve and the baseline alternating, and
prints each configuration's median and the median of its rounds' ratios: on a machine whose
speed drifts by 10% between runs, one pair of runs is one sample of that drift.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from modserve.bench import datasets as ds
from modserve.core.contract import hookimpl


def add_arguments(p) -> None:
    p.add_argument("-c", "--config", help="pipeline YAML (default: embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by this fraction, in [0, 1)")
    p.add_argument("--max-num-seqs", default="64", help="comma-separated sweep")
    p.add_argument("--dtype", default="float32", help="comma-separated sweep")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--hf-batch-size", type=int, help="HF's static batch size (default: each --max-num-seqs)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the whole sweep, modserve and the baseline alternating; 2+ also prints medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write results as JSON")
    p.set_defaults(func=run)


@dataclass
class Result:
    system: str
    dtype: str
    max_num_seqs: int
    num_requests: int
    elapsed_s: float
    output_tokens: int
    total_tokens: int
    model_share: float | None = None  # share of wall time inside the model forward
    round: int = 1  # which round of --repeats

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag}: values must be >= 1, got {text!r}")
    return values


def run(args) -> int:
    sizes = _positive_ints(args.max_num_seqs, "--max-num-seqs")
    dtypes = args.dtype.split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: expected float32, bfloat16 or float16, got {d!r}")
    ds.check_at_least_one(args, ("num_prompts", "input_len", "output_len"))
    ds.check_range_ratio(args.range_ratio, "--range-ratio")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size: must be >= 1, got {args.hf_batch_size}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    results: list[Result] = []
    for rnd in range(1, args.repeats + 1):
        results += _run_round(args, dtypes, sizes, rnd)
    rows = [{**asdict(r), "output_tok_s": r.output_tok_s} for r in results]
    if args.repeats > 1:
        print(f"median of {args.repeats} rounds:")
        for m in medians(rows):
            line = f"  {m['system']:<9} dtype={m['dtype']:<8} {m['max_num_seqs']:<4} {m['output_tok_s']:8.1f} out tok/s"
            for peer, ratios in m["ratios"].items():
                line += f"  / {peer} = {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
            print(line)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _run_round(args, dtypes: list[str], sizes: list[int], rnd: int) -> list[Result]:
    """One pass over the sweep: modserve at each size, the baseline once per (dtype, batch)."""
    tag = f"[round {rnd}/{args.repeats}] " if args.repeats > 1 else ""
    results: list[Result] = []
    hf_runs: dict[tuple[str, int], Result] = {}
    for dtype in dtypes:
        for size in sizes:
            ours = run_modserve(args, dtype, size)
            ours.round = rnd
            results.append(ours)
            line = f"{tag}modserve  dtype={dtype:<8} max_num_seqs={size:<3} {ours.output_tok_s:8.1f} out tok/s"
            line += f"  ({ours.num_requests / ours.elapsed_s:.2f} req/s, {ours.total_tokens / ours.elapsed_s:.1f} tok/s total"
            line += f", model {100 * ours.model_share:.0f}% of wall)"
            print(line, flush=True)
            if args.baseline == "hf":
                batch = args.hf_batch_size or size
                if (dtype, batch) not in hf_runs:
                    hf_runs[dtype, batch] = run_hf(args, dtype, batch)
                    hf_runs[dtype, batch].round = rnd
                    results.append(hf_runs[dtype, batch])
                hf = hf_runs[dtype, batch]
                print(
                    f"{tag}hf        dtype={dtype:<8} batch={batch:<10} {hf.output_tok_s:8.1f} out tok/s"
                    f"  -> modserve (max_num_seqs {size}) / hf (batch {batch}) = {ours.output_tok_s / hf.output_tok_s:.2f}x",
                    flush=True,
                )
    return results


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (system, dtype, max_num_seqs) of ``--output`` rows (any number of rounds):
    median output and total tok/s, and for modserve its ratio to each baseline of the same
    dtype in every round both ran (``ratios``: ``"hf (batch 16)"`` -> one ratio a round)."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["dtype"], r["max_num_seqs"]), []).append(r)
    out = []
    for (system, dtype, size), runs in groups.items():
        ratios: dict[str, list[float]] = {}
        if system == "modserve":
            for (peer, peer_dtype, batch), peer_runs in groups.items():
                if peer == "modserve" or peer_dtype != dtype:
                    continue
                by_round = {p.get("round", 1): p["output_tok_s"] for p in peer_runs}
                pairs = [r["output_tok_s"] / by_round[r.get("round", 1)] for r in runs if r.get("round", 1) in by_round]
                if pairs:
                    ratios[f"{peer} (batch {batch})"] = pairs
        out.append({
            "system": system, "dtype": dtype, "max_num_seqs": size, "num_requests": runs[0]["num_requests"],
            "rounds": len(runs), "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
            "total_tok_s": statistics.median(r["total_tokens"] / r["elapsed_s"] for r in runs), "ratios": ratios,
        })
    return out


def _token_space(vocab: int) -> ds.TokenSpace:
    return ds.TokenSpace.from_range(min(100, vocab - 1), vocab)  # clear of the low (special) ids


def make_requests(args, vocab: int) -> list[ds.SampleRequest]:
    """The run's requests: token-id prompts from ids 100.. of the model's vocabulary."""
    return ds.random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, _token_space(vocab), args.seed)


def greedy_params(requests: list[ds.SampleRequest]):
    """Each request's sampling: greedy, ``ignore_eos``, its own output length (as bench serve sends)."""
    from modserve import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` random token-id prompts of exactly ``length`` tokens (``bench roofline``)."""
    return [r.prompt for r in ds.random_requests(num, length, 1, 0.0, _token_space(vocab), seed)]


def run_modserve(args, dtype: str, max_num_seqs: int) -> Result:
    from modserve import LLM, SamplingParams

    llm = LLM(
        args.config,
        model={"dtype": dtype},
        scheduler={"plugin": "fcfs", "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048},
    )
    model_time = _ModelTimer()
    llm.engine.c.registry.pm.register(model_time)
    requests = make_requests(args, llm.engine.c.spec.vocab_size)
    prompts = [r.prompt for r in requests]
    params = greedy_params(requests)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    model_time.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result(
        "modserve", dtype, max_num_seqs, len(prompts), elapsed, out_tokens,
        out_tokens + sum(map(len, prompts)), model_time.total / elapsed,
    )


class _ModelTimer:
    """An observer plugin adding up time inside the model forward."""

    def __init__(self) -> None:
        self.total = 0.0

    def reset(self) -> None:
        self.total = 0.0

    @hookimpl
    def on_step_finished(self, stats) -> None:
        self.total += stats.model_time_s


def run_hf(args, dtype: str, batch_size: int) -> Result:
    """HF ``generate`` with static batches on the same weights and requests."""
    import torch

    from modserve.bench.hf_baseline import load_hf_model

    model = load_hf_model(args.config, getattr(torch, dtype))
    requests = make_requests(args, model.config.vocab_size)
    _hf_generate(model, requests[:1], 4)  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_generate(model, requests[i : i + batch_size])
    elapsed = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in requests)  # each request's own tokens, as vLLM counts them
    return Result("hf", dtype, batch_size, len(requests), elapsed, out_tokens, out_tokens + sum(r.prompt_len for r in requests))


def _hf_generate(model, batch: list[ds.SampleRequest], max_new: int | None = None, device: str = "cpu") -> None:
    """One static batch: prompts left-padded to the longest, every row generating the
    batch's longest output (``max_new`` overrides it)."""
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len :] = torch.tensor(r.prompt, device=device)
        mask[row, width - r.prompt_len :] = 1
    new = max_new or max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
