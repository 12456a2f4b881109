"""Whether another source of the `cpu` attention kernel gives bit-identical outputs on every path.

A refactor of the kernel (sharing code between its AVX-512 and AVX2 widths, say) should change
no output bit. ``benchmarks/cpu_attention.py --baseline-source`` times one decode shape and two
prefill shapes; this runs the baseline's build and this tree's over every path the kernel
dispatches to and compares their outputs exactly:

- the AVX-512 build and the AVX2 one (``-mno-avx512f``), where the CPU has them;
- float32, bfloat16 (float32 and bfloat16 q) and int8 caches;
- windows (0 and 37 positions) and soft-caps (0 and 30);
- head_dim 64 and 128; 1, 3 and 4 query heads a KV head; blocks of 8, 16 and 32 positions;
- one decode row (split by positions), two, nine (whole KV heads an item), and tiles of
  consecutive rows; 1 and 2 threads.

    git archive HEAD native | tar -x -C /tmp/old
    python benchmarks/cpu_attention_identity.py --baseline-source /tmp/old/native/cpu_paged_attention.cpp

Prints each case whose outputs differ, then how many were identical; exits 1 if any differ.
``--quick``: one head_dim, block size and thread count (a fifth of the cases).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from modserve.core.kv_quant import quantize_per_token_head
from modserve.native.build import compile_and_load
from modserve.plugins.attention import cpu_kernel_build as kernel
from modserve.plugins.platforms.cpu import cpu_model_and_flags

BUILDS = {"avx512": (), "avx2": ("-mno-avx512f",)}
CACHES = [  # (cache dtype, q dtype)
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.int8, torch.float32), (torch.int8, torch.bfloat16),
]  # fmt: skip
ROWS = {"one decode row": (1, 1), "two decode rows": (2, 1), "nine decode rows": (9, 1), "tiles": (2, 37)}  # (sequences, rows each)


def case_outputs(libs, cache_dtype, q_dtype, head_dim, group, kv_heads, block, window, softcap, rows, seed) -> list[torch.Tensor]:
    """Each build's output for one case: the same random cache, block tables and queries."""
    gen = torch.Generator().manual_seed(seed)
    sequences, per_sequence = ROWS[rows]
    context = 300
    blocks = -(-(context + per_sequence) // block)
    caches = []
    for _ in "kv":
        values = torch.rand(sequences * blocks + 3, block, kv_heads, head_dim, generator=gen) * 4 - 2
        caches.append(quantize_per_token_head(values) if cache_dtype == torch.int8 else (values.to(cache_dtype), None))
    tables = torch.randperm(sequences * blocks + 3, generator=gen)[: sequences * blocks].to(torch.int32).view(sequences, blocks)
    n = sequences * per_sequence
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen).to(q_dtype)
    seq = torch.arange(sequences, dtype=torch.int32).repeat_interleave(per_sequence)
    first = torch.randint(context // 2, context, (sequences,), generator=gen, dtype=torch.int32)
    pos = first.repeat_interleave(per_sequence) + torch.arange(per_sequence, dtype=torch.int32).repeat(sequences)
    outs = []
    for lib in libs:
        out = torch.full_like(q, 7.0)
        kernel.paged_attention(q, out, caches[0][0], caches[1][0], caches[0][1], caches[1][1], tables.contiguous(),
                               torch.arange(n), seq, pos, head_dim**-0.5, lib, window=window, softcap=softcap)
        outs.append(out)
    return outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-source", required=True, help="the other source's cpu_paged_attention.cpp (its headers beside it)")
    p.add_argument("--builds", default="avx512,avx2", help="comma-separated, of: " + ", ".join(BUILDS))
    p.add_argument("--quick", action="store_true", help="head_dim 64, blocks of 16, 2 threads only")
    args = p.parse_args(argv)
    if not Path(args.baseline_source).is_file():
        p.error(f"--baseline-source: no such file: {args.baseline_source}")
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    unknown = [b for b in builds if b not in BUILDS]
    if unknown or not builds:
        p.error(f"--builds: expected some of {', '.join(BUILDS)}, got {args.builds!r}")
    _, flags = cpu_model_and_flags()
    needs = {"avx512": "avx512f", "avx2": "avx2"}
    threads_before = torch.get_num_threads()
    same = total = 0
    try:
        for name in builds:
            if needs[name] not in flags:
                print(f"{name} build: skipped, this CPU has no {needs[name]}")
                continue
            libs = (compile_and_load(Path(args.baseline_source), "the baseline attention kernel", BUILDS[name]), kernel.load(BUILDS[name]))
            head_dims, blocks, threads = ([64], [16], [2]) if args.quick else ([64, 128], [8, 16, 32], [1, 2])
            for seed, ((cache, q), head_dim, (group, kv_heads), block, window, softcap, rows, n_threads) in enumerate(itertools.product(
                CACHES, head_dims, [(3, 3), (1, 2), (4, 2)], blocks, [0, 37], [0.0, 30.0], ROWS, threads,
            )):  # fmt: skip
                torch.set_num_threads(n_threads)
                old, new = case_outputs(libs, cache, q, head_dim, group, kv_heads, block, window, softcap, rows, seed)
                total += 1
                if torch.equal(old, new):
                    same += 1
                    continue
                diff = (old.float() - new.float()).abs().max().item()
                print(f"differs: {name} build, {cache} cache, {q} q, head_dim {head_dim}, {group} query heads a KV head, "
                      f"blocks of {block}, window {window}, softcap {softcap}, {rows}, {n_threads} threads: max |diff| {diff:.2e}")
    finally:
        torch.set_num_threads(threads_before)
    print(f"{same} of {total} cases bit-identical")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
