"""The `cpu` attention kernel at SmolLM2's shape, against its baselines in the same run.

Decode: one step's attention over all layers, each layer with its own cache (so the KV
comes from memory, not from L3, as in the engine), the standard build and the AVX2 build
(``-mno-avx512f``) against the portable one (``-mno-avx512f -mno-avx2``). Prefill: causal chunks read from the paged cache, the
kernel against SDPA's flash kernel on the same inputs (an int8 cache: on its dequantized values). Prints times and ratios.

    python benchmarks/cpu_attention.py [--dtype bfloat16|float32|int8] [--batch 64] [--context 300] [--block-size 16]

``--dtype int8`` is a float32 model over an int8 cache with a scale per token and head (``kv_cache: {kv_dtype: int8}``).
``--baseline-source FILE`` also builds another version of the kernel's source (say ``git archive
REV native | tar -x -C /tmp/old``, then ``/tmp/old/native/cpu_paged_attention.cpp``: the headers
beside it are that revision's; a lone copy of the .cpp builds with this tree's) and times the
decode steps and the prefill tiles of both builds alternated in this process
(``--extra-flags=-mno-avx512f``: both as the AVX2 build), the way changes to the kernel are
measured on a machine whose speed drifts. Its decode steps take float32 q (the ``standard
build`` row's path) and, with ``--dtype bfloat16``, also bfloat16 q (the ``standard, bf16 q``
row's: the bfloat16-dot path on AVX512_BF16 CPUs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from modserve.core.kv_quant import quantize_per_token_head
from modserve.native.build import compile_and_load
from modserve.plugins.attention import cpu_kernel_build as kernel

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def timed(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def cache(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A K or V cache of these values in `dtype` (int8: codes and their scales per token and head)."""
    return quantize_per_token_head(values) if dtype == torch.int8 else (values.to(dtype), None)


def baseline_builds(args) -> dict:
    """--baseline-source's build and this tree's, with the same extra flags."""
    extra = tuple(args.extra_flags.split())
    return {"baseline": compile_and_load(Path(args.baseline_source), "the baseline attention kernel", extra),
            "this tree": kernel.load(extra)}


def alternated(args, builds: dict, run) -> tuple[list[float], list[float], float]:
    """run(lib) -> its output, timed for both builds in args.rounds alternated rounds (the order
    swapped every round): each build's times, and the largest difference between their outputs."""
    times, outs = {name: [] for name in builds}, {}
    for r in range(args.rounds):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            t0 = time.perf_counter()
            out = run(builds[name])
            times[name].append(time.perf_counter() - t0)
            outs[name] = out.float().clone()  # (a float32 output is the same tensor every round)
    return times["baseline"], times["this tree"], (outs["baseline"] - outs["this tree"]).abs().max().item()


def report_alternated(args, old: list[float], new: list[float], diff: float, what: str = "") -> None:
    ratios = [a / b for a, b in zip(old, new)]
    print(f"  {what}{args.rounds} alternated rounds{' ' + args.extra_flags if args.extra_flags else ''}: baseline "
          f"{statistics.median(old) * 1e3:.2f} ms, this tree {statistics.median(new) * 1e3:.2f} ms (medians), median ratio "
          f"{statistics.median(ratios):.2f}x, max |diff| {diff:.1e}")


def decode(args, dtype: torch.dtype) -> None:
    block = args.block_size
    blocks_per_seq = -(-args.context // block)
    caches = [
        tuple(cache(torch.empty(args.batch * blocks_per_seq + 64, block, KV_HEADS, HEAD_DIM).uniform_(-2, 2), dtype)
              for _ in "kv")
        for _ in range(args.layers)
    ]
    order = torch.randperm(args.batch * blocks_per_seq) if args.scattered else torch.arange(args.batch * blocks_per_seq)
    tables = order.to(torch.int32).view(args.batch, -1).contiguous()
    model_dtype = torch.float32 if dtype == torch.int8 else dtype
    q = torch.randn(args.batch, HEADS, HEAD_DIM).to(model_dtype).float()  # the values a model of this dtype gives
    rows = torch.arange(args.batch)
    seq = torch.arange(args.batch, dtype=torch.int32)
    pos = torch.full((args.batch,), args.context - 1, dtype=torch.int32)
    times, outs = {}, {}

    def step(lib, qi, out):  # one decode step: every layer's attention, into out
        for (k, ks), (v, vs) in caches:
            kernel.paged_attention(qi, out, k, v, ks, vs, tables, rows, seq, pos, HEAD_DIM**-0.5, lib)
        return out

    variants = [
        ("portable build", ("-mno-avx512f", "-mno-avx2"), torch.float32),
        ("AVX2 build", ("-mno-avx512f",), torch.float32),  # the AVX2 path, where the CPU has AVX2
        ("standard build", (), torch.float32),
    ]
    if dtype == torch.bfloat16:
        variants.append(("standard, bf16 q", (), torch.bfloat16))  # what the backend passes with a bf16 model
    for name, flags, io_dtype in variants:
        lib = kernel.load(flags)
        qi = q.to(io_dtype)
        out = torch.empty_like(qi)
        times[name] = timed(lambda lib=lib, qi=qi, out=out: step(lib, qi, out), args.repeats)
        outs[name] = out.float()
    kv_bytes = args.layers * args.batch * args.context * KV_HEADS * 2 * (HEAD_DIM * caches[0][0][0].element_size()
                                                                        + (4 if dtype == torch.int8 else 0))  # + int8 scales
    print(f"decode, {args.batch} rows x {args.context} tokens, {args.layers} layers, {dtype}:")
    base = times["portable build"]
    for name, t in times.items():
        err = (outs[name] - outs["portable build"]).abs().max().item()
        print(f"  {name:20s} {t * 1e3:7.1f} ms a step ({kv_bytes / t / 1e9:5.1f} GB/s of KV), {base / t:.2f}x the "
              f"portable build, max |diff| {err:.1e}")
    print(f"  (tiled AVX-512 path compiled: {kernel.tiled(HEAD_DIM)})")
    if args.baseline_source:
        builds = baseline_builds(args)
        for io_dtype in (torch.float32, torch.bfloat16) if dtype == torch.bfloat16 else (torch.float32,):
            qi = q.to(io_dtype)
            out = torch.empty_like(qi)
            report_alternated(args, *alternated(args, builds, lambda lib, qi=qi, out=out: step(lib, qi, out)),
                              what=f"{'float32' if io_dtype == torch.float32 else 'bf16'} q, ")


def prefill(args, dtype: torch.dtype, length: int, chunks: int) -> None:
    block = args.block_size
    nb = -(-length // block)
    k_cache, k_scale = cache(torch.randn(chunks * nb, block, KV_HEADS, HEAD_DIM), dtype)
    v_cache, v_scale = cache(torch.randn(chunks * nb, block, KV_HEADS, HEAD_DIM), dtype)
    model_dtype = torch.float32 if dtype == torch.int8 else dtype
    if dtype == torch.int8:  # what SDPA reads: the dequantized values, in the model's dtype
        k_values, v_values = k_cache.float() * k_scale[..., None], v_cache.float() * v_scale[..., None]
    else:
        k_values, v_values = k_cache, v_cache
    tables = torch.arange(chunks * nb, dtype=torch.int32).view(chunks, nb).contiguous()
    q = torch.randn(chunks * length, HEADS, HEAD_DIM).to(model_dtype)
    rows = torch.arange(chunks * length)
    seq = torch.arange(chunks, dtype=torch.int32).repeat_interleave(length)
    pos = torch.arange(length, dtype=torch.int32).repeat(chunks)
    scale = HEAD_DIM**-0.5

    def ours(lib=None):  # q and out in the model's dtype, as the backend passes them
        out = torch.empty_like(q)
        kernel.paged_attention(q, out, k_cache, v_cache, k_scale, v_scale, tables, rows, seq, pos, scale, lib)
        return out

    def sdpa():  # what the torch backend does for a chunk: gather its blocks, one causal call
        for i in range(chunks):
            ids = tables[i].long()
            k = k_values.index_select(0, ids).reshape(-1, KV_HEADS, HEAD_DIM)[:length]
            v = v_values.index_select(0, ids).reshape(-1, KV_HEADS, HEAD_DIM)[:length]
            F.scaled_dot_product_attention(
                q[i * length : (i + 1) * length].transpose(0, 1)[None], k.transpose(0, 1)[None],
                v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True,
            )  # fmt: skip

    flops = chunks * 2 * 2 * length * length / 2 * HEAD_DIM * HEADS  # QK and PV, causal half
    t_ours, t_sdpa = timed(ours, args.repeats), timed(sdpa, args.repeats)
    print(f"prefill, {chunks} chunks x {length} tokens, one layer, {dtype}: kernel {t_ours * 1e3:.2f} ms "
          f"({flops / t_ours / 1e9:.0f} GFLOP/s), SDPA {t_sdpa * 1e3:.2f} ms ({flops / t_sdpa / 1e9:.0f} GFLOP/s): "
          f"kernel {t_sdpa / t_ours:.2f}x faster")
    if args.baseline_source:
        report_alternated(args, *alternated(args, baseline_builds(args), ours))
    avx2 = kernel.load(("-mno-avx512f",)) if args.avx2_prefill else None
    if avx2 is not None and avx2.modserve_tiled(HEAD_DIM):
        t_avx2 = timed(lambda: ours(avx2), args.repeats)
        print(f"  AVX2 build's tiles {t_avx2 * 1e3:.2f} ms ({flops / t_avx2 / 1e9:.0f} GFLOP/s), {t_sdpa / t_avx2:.2f}x SDPA")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"],
                   help="the cache's dtype (and the model's; int8: a float32 model over an int8 cache)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16, help="tokens a cache block: a power of two up to 256 (the "
                   "kernel's kMaxBlock)")
    p.add_argument("--scattered", action="store_true", help="decode: each sequence's blocks in random cache order, as a "
                   "long-running engine leaves them (default: consecutive)")
    p.add_argument("--avx2-prefill", action="store_true", help="prefill: also the AVX2 build's tiles (an AVX-512 CPU "
                   "can run them; with SDPA capped to AVX2 too, ATEN_CPU_CAPABILITY=avx2, as on an AVX2-only CPU)")
    p.add_argument("--baseline-source", help="also this source of the kernel, alternated with this tree's build (decode "
                   "steps and prefill tiles)")
    p.add_argument("--extra-flags", help="compiler flags for both builds of --baseline-source, e.g. -mno-avx512f")
    p.add_argument("--rounds", type=int, help="alternated rounds for --baseline-source (default 15)")
    args = p.parse_args()
    if args.baseline_source is None and (args.extra_flags is not None or args.rounds is not None):
        p.error("--extra-flags and --rounds go with --baseline-source, which is not given")
    if args.baseline_source is not None and not Path(args.baseline_source).is_file():
        p.error(f"--baseline-source: no such file: {args.baseline_source}")
    if args.block_size < 1 or args.block_size > 256 or args.block_size & (args.block_size - 1):
        p.error(f"--block-size: expected a power of two from 1 to 256, got {args.block_size}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds: expected a whole number >= 1, got {args.rounds}")
    args.extra_flags, args.rounds = args.extra_flags or "", args.rounds or 15
    dtype = getattr(torch, args.dtype)
    print(f"torch threads: {torch.get_num_threads()}")
    decode(args, dtype)
    prefill(args, dtype, 256, 8)
    prefill(args, dtype, 1024, 2)


if __name__ == "__main__":
    main()
