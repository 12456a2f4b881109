"""What CPU weight quantization costs and buys on SmolLM2-135M: perplexity, speed and memory.

For the model in bfloat16 (the baseline) and under ``device: {plugin: cpu, quantization:
int8 | w8a8 | int4 | gguf}`` (activations in bfloat16; see docs/quantization.md), it prints:

1. Perplexity of ``benchmarks/data/perplexity.txt`` (about 3,700 SmolLM2 tokens of plain
   English) through modserve's own ``prompt_logprobs`` (``SamplingParams(prompt_logprobs=1,
   max_tokens=1)``), the text cut into windows of ``--window`` tokens (at most the model's
   ``max_model_len``; each window is scored on its own, from its second token), and the
   share of positions whose top-1 token equals bfloat16's.
2. Output tokens/s offline (``LLM.generate``, ``ignore_eos``, fixed prompt and output
   lengths) at 1 and 64 concurrent requests, the schemes alternating within each of
   ``--rounds`` rounds after an untimed warm-up; the median per scheme and the median of the
   per-round ratios to bfloat16 (the machine's speed drifts between rounds).
3. Memory: each scheme's engine built alone in a child process, its RSS after loading,
   after a warm-up generate, and after ``malloc_trim(0)`` (the ``cpu`` platform keeps freed
   heap memory in the process, so the float weights a quantized model dropped stay in RSS
   until trimmed), plus the bytes of the model's own tensors.

``int4`` uses ``--int4-group-size``, 128 by default, which SmolLM2's layers with 576 inputs
(all but ``down_proj``) take as 64; ``int4-g32`` uses groups of 32. The embedded checkpoint is a Q4_1 GGUF: its weights
already are 4-bit values with a scale and a minimum per block of 32, so ``int4-g32``
re-derives that very grid and loses almost nothing, while larger groups quantize the
already-quantized weights onto a coarser grid and lose much more than they would on a
float checkpoint. The "bf16" baseline is those Q4_1 weights dequantized to bfloat16.
``gguf`` keeps the file's Q4_1 blocks as they are (int4, groups of 32, no float copy at load):
the same grid as ``int4-g32``, its scales and zeros the file's own instead of re-derived. Its
head stays bfloat16 even with ``--quantize-lm-head``: SmolLM2's head is tied to the embedding,
so it has no GGUF tensor of its own to keep.

    python benchmarks/quantization.py            # the full figures: run it on a quiet machine
    python benchmarks/quantization.py --quick    # a short correctness run (small text, lengths, rounds)

It prints the CPU model and its ISA flags first: int8 speed depends on VNNI / AMX-INT8.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from modserve import LLM, SamplingParams
from modserve.plugins.platforms.cpu import cpu_model_and_flags

SMOLLM2 = "smollm2-135m-instruct"
TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
SCHEMES = {  # label -> (device.quantization, int4 group size: None for --int4-group-size)
    "bf16": ("none", None), "int8": ("int8", None), "w8a8": ("w8a8", None), "int4": ("int4", None), "int4-g32": ("int4", 32),
    "gguf": ("gguf", None),
}
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short correctness run, not figures")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, from {', '.join(SCHEMES)} (bf16 always runs)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--window", type=int, default=1024, help="perplexity window in tokens (<= max-model-len)")
    p.add_argument("--concurrency", default="1,64", help="comma-separated concurrent request counts")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--int4-group-size", type=int, default=128)
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the per-scheme child processes")
    p.add_argument("--output", help="write the results as JSON")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)  # internal: one scheme's memory, printed as JSON
    args = p.parse_args(argv)
    if args.quick:
        args.window, args.input_len, args.output_len, args.rounds = 256, 16, 8, 1
        args.concurrency = "1,8"
    args.schemes = ["bf16"] + [s for s in args.schemes.split(",") if s and s != "bf16"]
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown:
        p.error(f"--schemes: unknown {', '.join(unknown)}; expected {', '.join(SCHEMES)}")
    if args.window > args.max_model_len:
        p.error(f"--window {args.window} exceeds --max-model-len {args.max_model_len}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def device(args: argparse.Namespace, scheme: str) -> dict:
    """The scheme's cpu platform settings: the group size for int4 only, the head quantized
    where something is (gguf: a tied head has no blocks of its own)."""
    quantization, group = SCHEMES[scheme]
    dev = {"plugin": "cpu", "quantization": quantization, "quantize_lm_head": args.quantize_lm_head and scheme not in ("bf16", "gguf")}
    if quantization == "int4":
        dev["int4_group_size"] = group or args.int4_group_size
    return dev


def pipeline(args: argparse.Namespace, scheme: str) -> dict:
    concurrency = max(args.concurrency)
    kv_tokens = max(2 * args.max_model_len, concurrency * (args.input_len + args.output_len))  # windows queue if short
    return {
        "model": {"path": SMOLLM2, "dtype": "bfloat16", "max_model_len": args.max_model_len},
        "device": device(args, scheme),
        "scheduler": {"plugin": "fcfs", "max_num_seqs": concurrency, "max_num_batched_tokens": 2048},
        "kv_cache": {"plugin": "paged", "block_size": 16,
                     "num_blocks": kv_tokens // 16 + 2 * concurrency + 16},
    }


def cpu_header() -> str:
    name, flags = cpu_model_and_flags()
    have = [f for f in FLAGS if f in flags]
    return (f"CPU: {name}\nflags: {' '.join(have) or '(none of ' + ' '.join(FLAGS) + ')'}\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"oneDNN {'yes' if torch.backends.mkldnn.is_available() else 'no'}; python {platform.python_version()}")


# ----------------------------------------------------------------------------- perplexity


def perplexity(llm: LLM, token_ids: list[int], window: int) -> tuple[float, list[int], int]:
    """(perplexity, top-1 token per scored position, positions): each window of ``window``
    tokens scored from its second token by ``prompt_logprobs``, all windows in one batch."""
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    total, top1 = 0.0, []
    for w, out in zip(windows, outs):
        for tok, entry in zip(w[1:], out.prompt_logprobs[1:]):
            total += entry[tok].logprob
            top1.append(max(entry.values(), key=lambda lp: lp.logprob).token_id)
    return math.exp(-total / len(top1)), top1, len(top1)


# ----------------------------------------------------------------------------- throughput


def requests(n: int, input_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]} for _ in range(n)]


def output_tok_s(llm: LLM, prompts: list[dict], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == output_len * len(prompts), "ignore_eos: every request runs to its length"
    return tokens / elapsed


# ----------------------------------------------------------------------------- memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (a tied head is the embedding)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # an opaque oneDNN tensor
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def memory_child(args: argparse.Namespace, scheme: str) -> dict:
    llm = LLM(pipeline(args, scheme))
    loaded = _rss_mb()
    vocab = llm.engine.c.spec.vocab_size
    llm.generate(requests(max(args.concurrency), args.input_len, vocab), SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    warm = _rss_mb()
    trimmed = None
    try:
        ctypes.CDLL(None).malloc_trim(0)
        trimmed = _rss_mb()
    except (OSError, AttributeError):  # not glibc
        pass
    return {"scheme": scheme, "rss_loaded_mb": loaded, "rss_warm_mb": warm, "rss_trimmed_mb": trimmed,
            "model_mb": model_bytes(llm.engine.c.runner.model) / 2**20}


def memory_in_child(args: argparse.Namespace, scheme: str, argv: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--memory-child", scheme]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {scheme} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args, args.memory_child)))
        return {}
    print(cpu_header())
    print(f"model {SMOLLM2}, bfloat16; schemes {', '.join(args.schemes)}; lm_head "
          f"{'quantized' if args.quantize_lm_head else 'kept in the model dtype'}; int4 group {args.int4_group_size}"
          f"{' (quick run: not figures)' if args.quick else ''}", flush=True)
    results: dict = {"cpu": cpu_header(), "args": {k: v for k, v in vars(args).items() if k != "memory_child"}}

    llms = {}
    for scheme in args.schemes:
        start = time.perf_counter()
        llms[scheme] = LLM(pipeline(args, scheme))
        print(f"  built {scheme} in {time.perf_counter() - start:.1f} s", flush=True)

    # 1. perplexity
    token_ids = llms["bf16"].tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    if args.quick:
        token_ids = token_ids[:600]
    print(f"\nperplexity: {len(token_ids)} tokens of {TEXT.name}, windows of {args.window}")
    print(f"  {'scheme':<8} {'ppl':>9} {'vs bf16':>9} {'top-1 = bf16':>13}")
    ppl = {}
    for scheme in args.schemes:
        value, top1, n = perplexity(llms[scheme], token_ids, args.window)
        ppl[scheme] = (value, top1)
        agree = sum(a == b for a, b in zip(top1, ppl["bf16"][1])) / n
        print(f"  {scheme:<8} {value:9.4f} {100 * (value / ppl['bf16'][0] - 1):+8.2f}% {100 * agree:12.2f}%", flush=True)
    results["perplexity"] = {s: {"ppl": v, "positions": len(t)} for s, (v, t) in ppl.items()}

    # 2. throughput, schemes alternating within each round
    vocab = llms["bf16"].engine.c.spec.vocab_size
    work = {c: requests(c, args.input_len, vocab, seed=c) for c in args.concurrency}
    for scheme in args.schemes:  # untimed warm-up: oneDNN primitives, first-touch pages
        for c in args.concurrency:
            output_tok_s(llms[scheme], work[c], min(args.output_len, 8))
    runs: dict = {(s, c): [] for s in args.schemes for c in args.concurrency}
    for r in range(args.rounds):
        for c in args.concurrency:
            for scheme in args.schemes if r % 2 == 0 else args.schemes[::-1]:
                runs[scheme, c].append(output_tok_s(llms[scheme], work[c], args.output_len))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    print(f"\noutput tokens/s ({args.input_len}-token prompts, {args.output_len} output tokens, ignore_eos; "
          f"median of {args.rounds} round(s); ratio = median of per-round ratios to bf16)")
    print(f"  {'scheme':<8} " + " ".join(f"{f'c={c} tok/s':>12} {'x bf16':>7}" for c in args.concurrency))
    results["throughput"] = {}
    for scheme in args.schemes:
        cells = []
        for c in args.concurrency:
            mine, base = runs[scheme, c], runs["bf16", c]
            ratio = statistics.median(m / b for m, b in zip(mine, base))
            cells.append(f"{statistics.median(mine):12.1f} {ratio:7.3f}")
            results["throughput"][f"{scheme}@{c}"] = {"tok_s": mine, "ratio_to_bf16": ratio}
        print(f"  {scheme:<8} " + " ".join(cells), flush=True)
    del llms

    # 3. memory, one child process per scheme
    if not args.no_memory:
        print("\nmemory (each scheme alone in a child process; MB)")
        print(f"  {'scheme':<8} {'model':>8} {'RSS loaded':>11} {'after gen':>10} {'trimmed':>8} {'x bf16':>7}")
        mem = {s: memory_in_child(args, s, argv) for s in args.schemes}
        for s, m in mem.items():
            base = mem["bf16"]["rss_trimmed_mb"] or mem["bf16"]["rss_warm_mb"]
            mine = m["rss_trimmed_mb"] or m["rss_warm_mb"]
            trimmed = f"{m['rss_trimmed_mb']:8.0f}" if m["rss_trimmed_mb"] is not None else f"{'n/a':>8}"
            print(f"  {s:<8} {m['model_mb']:8.1f} {m['rss_loaded_mb']:11.0f} {m['rss_warm_mb']:10.0f} {trimmed} {mine / base:7.3f}")
        results["memory"] = mem
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
