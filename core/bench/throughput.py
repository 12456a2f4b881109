"""``modserve bench throughput``: offline throughput, all requests submitted at once, ``ignore_eos``.

With ``--baseline hf`` the same requests run through HF ``transformers`` ``generate`` in
static batches of ``max_num_seqs`` in the same process, and the ratio is printed.
Sweeps: ``--max-num-seqs 1,8,32`` and ``--dtype float32,bfloat16`` run every combination.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from modserve.core.hookspecs import hookimpl


def add_arguments(p) -> None:
    p.add_argument("-c", "--config", help="pipeline YAML (default: embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", default="64", help="comma-separated sweep")
    p.add_argument("--dtype", default="float32", help="comma-separated sweep")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
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
    for flag in ("num_prompts", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    results: list[Result] = []
    for dtype in dtypes:
        for size in sizes:
            ours = run_modserve(args, dtype, size)
            results.append(ours)
            line = f"modserve  dtype={dtype:<8} max_num_seqs={size:<3} {ours.output_tok_s:8.1f} out tok/s"
            line += f"  ({ours.num_requests / ours.elapsed_s:.2f} req/s, {ours.total_tokens / ours.elapsed_s:.1f} tok/s total"
            line += f", model {100 * ours.model_share:.0f}% of wall)"
            print(line, flush=True)
            if args.baseline == "hf":
                hf = run_hf(args, dtype, size)
                results.append(hf)
                print(
                    f"hf        dtype={dtype:<8} batch={size:<10} {hf.output_tok_s:8.1f} out tok/s"
                    f"  -> modserve/hf = {ours.output_tok_s / hf.output_tok_s:.2f}x",
                    flush=True,
                )
    if args.output:
        with open(args.output, "w") as f:
            json.dump([{**asdict(r), "output_tok_s": r.output_tok_s} for r in results], f, indent=2)
    return 0


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_modserve(args, dtype: str, max_num_seqs: int) -> Result:
    from modserve import LLM, SamplingParams

    llm = LLM(
        args.config,
        model={"dtype": dtype},
        scheduler={"plugin": "fcfs", "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048},
    )
    model_time = _ModelTimer()
    llm.engine.c.registry.pm.register(model_time)
    prompts = make_prompts(args.num_prompts, args.input_len, llm.engine.c.spec.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
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
    """HF ``generate`` with static batches on the same weights and prompts."""
    import torch

    from modserve.core.bench.hf_baseline import load_hf_model

    model = load_hf_model(args.config, getattr(torch, dtype))
    prompts = make_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
    _hf_generate(model, prompts[:1], 4)  # warm-up
    t0 = time.perf_counter()
    out_tokens = 0
    for i in range(0, len(prompts), batch_size):
        out_tokens += _hf_generate(model, prompts[i : i + batch_size], args.output_len)
    elapsed = time.perf_counter() - t0
    return Result("hf", dtype, batch_size, len(prompts), elapsed, out_tokens, out_tokens + sum(map(len, prompts)))


def _hf_generate(model, prompts: list[list[int]], max_new: int) -> int:
    import torch

    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]
