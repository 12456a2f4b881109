"""What a perfect decode-attention kernel would buy: offline throughput with decode attention
as it is, at the memory's sequential rate, and free, in alternated rounds of one run.

`bench roofline` splits the forward's time into parts and divides output tokens by them, which
assumes the rest of a step would not change if a part got faster. This measures it instead.
The `cpu` backend's decode rows (requests with one query token in the step) are served three
ways; prefill chunks and every KV write stay real in all of them:

- ``real``: the kernel, as served.
- ``stream``: instead of attending, each layer reads the very number of K and V bytes the
  kernel would read, in one sequential sweep (`bench roofline` measures ~50-60 GB/s for that
  here). No kernel on these scattered blocks can read faster, so this is the best case for
  any decode-attention backend on this machine.
- ``free``: decode rows cost nothing (the output is the query, so values stay finite).

The generated tokens differ between modes (``ignore_eos`` keeps every request's length), so
only the speed is compared. Prefix caching is switched off: every round serves the same
prompts. Prints each round's output tok/s and each mode's median ratio to ``real``.

    python benchmarks/attention_headroom.py [-c benchmarks/pipelines/smollm2-bf16.yaml] \
        [--concurrency 64] [--num-prompts 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import msgspec
import torch

from modserve import LLM, SamplingParams
from modserve.bench import datasets, throughput
from modserve.core.config import load_pipeline
from modserve.plugins.attention import cpu_kernel_build as kernel
from modserve.plugins.attention.cpu_backend import CpuAttention

MODES = ("real", "stream", "free")


class DecodeRows:
    """Shadows ``prepare`` / ``forward`` on one CpuAttention instance; ``mode`` picks how the
    step's decode rows are served."""

    def __init__(self, backend: CpuAttention) -> None:
        self.backend, self.mode = backend, "real"
        self.kv_bytes_per_token = backend.spec.num_kv_heads * backend.spec.head_dim  # times the element size
        self.bytes_streamed = 0  # K and V bytes swept in ``stream`` mode, all layers
        self._prepare, self._forward = backend.prepare, backend.forward
        backend.prepare, backend.forward = self.prepare, self.forward

    def prepare(self, meta) -> None:
        self._prepare(meta)
        state = meta.backend_state
        state.decode = None
        k = state.step
        if self.mode == "real" or not k.rows.numel():
            return
        one_token = torch.tensor([n == 1 for n in meta.query_lens_cpu])[k.seq.long()]
        contexts = int((k.pos[one_token].long() + 1).sum())
        state.decode = (k.rows[one_token], contexts)
        rest = ~one_token
        state.step = kernel.step_rows(k.block_tables, k.rows[rest], k.seq[rest], k.pos[rest], k.slots)

    def forward(self, q, k, v, cache, meta):
        state = meta.backend_state
        out = self._forward(q, k, v, cache, meta)  # every KV write; the kernel for the other rows
        if state.decode is None:
            return out
        rows, contexts = state.decode
        if self.mode == "stream" and contexts:
            for c in (cache.k, cache.v):
                n = contexts * self.kv_bytes_per_token * c.element_size()
                c.view(-1).view(torch.uint8)[:n].view(torch.int32).max()  # int32 max: the fastest sweep torch has here
                self.bytes_streamed += n
        out[rows] = q[rows]
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default="benchmarks/pipelines/smollm2-bf16.yaml")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=64, help="max_num_seqs")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        datasets.check_at_least_one(args, ("concurrency", "num_prompts", "input_len", "output_len", "rounds"))
        datasets.check_range_ratio(args.range_ratio, "--range-ratio")
    except ValueError as e:
        p.error(str(e))
    args.modes = args.modes.split(",")
    if "real" not in args.modes or not set(args.modes) <= set(MODES):
        p.error(f"--modes: a comma-separated list of {', '.join(MODES)} that includes real, got {','.join(args.modes)}")
    return args


def build(args) -> tuple[LLM, DecodeRows]:
    raw = msgspec.to_builtins(load_pipeline(args.config))
    raw["model"]["dtype"] = args.dtype
    raw["scheduler"] = {"plugin": "fcfs", "max_num_seqs": args.concurrency, "max_num_batched_tokens": 2048}
    if raw["kv_cache"].get("plugin") == "paged":  # the one shipped KV backend with a prefix cache
        raw["kv_cache"]["prefix_caching"] = False
    llm = LLM(raw)
    backend = llm.engine.runner.attention
    if not isinstance(backend, CpuAttention):
        raise SystemExit(f"attention headroom needs the `cpu` attention backend, got {type(backend).__name__}")
    return llm, DecodeRows(backend)


def run(args) -> dict[str, list[float]]:
    llm, decode = build(args)
    requests = throughput.make_requests(args, llm.engine.c.spec.vocab_size)  # its lengths and seed flags
    prompts, params = [r.prompt for r in requests], throughput.greedy_params(requests)
    asked = sum(r.output_len for r in requests)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    tok_s: dict[str, list[float]] = {m: [] for m in args.modes}
    for rnd in range(args.rounds):
        for mode in args.modes if rnd % 2 == 0 else args.modes[::-1]:
            decode.mode = mode
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if tokens != asked:
                raise SystemExit(f"{mode}: {tokens} output tokens, expected {asked}")
            tok_s[mode].append(tokens / elapsed)
            print(f"round {rnd + 1} {mode:6s} {tokens / elapsed:8.1f} out tok/s ({elapsed:.1f} s)", flush=True)
    decode.mode = "real"
    return tok_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tok_s = run(args)
    print(f"\n{'mode':8s} {'median tok/s':>12s}  ratio to real (median of rounds, range)")
    for mode in args.modes:
        ratios = [x / r for x, r in zip(tok_s[mode], tok_s["real"])]
        print(f"{mode:8s} {statistics.median(tok_s[mode]):12.1f}  {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
