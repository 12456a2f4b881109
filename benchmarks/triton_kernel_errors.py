"""Print the Triton attention kernels' error against the fp32 reference, per dtype.

Runs under the Triton interpreter on the CPU and reuses the scenarios and reference of
tests/test_triton_attention.py, so the figures are the ones the tests bound:

    TRITON_INTERPRET=1 python benchmarks/triton_kernel_errors.py
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
TEST_FILE = Path(__file__).resolve().parents[1] / "tests" / "test_triton_attention.py"

# (row label, activation dtype, int8 KV)
SETTINGS = [
    ("fp32", torch.float32, False),
    ("fp16", torch.float16, False),
    ("bf16", torch.bfloat16, False),
    ("fp32 act + int8 KV", torch.float32, True),
    ("fp16 act + int8 KV", torch.float16, True),
]
# (kernel label, context lens, query lens, config overrides)
KERNELS = [
    ("prefill", [0, 16, 37, 9], [48, 20, 7, 12], {}),
    ("decode", [0, 15, 70, 130], [1, 1, 1, 1], {}),
    ("decode split-K", [300, 7, 129], [1, 1, 1], {"decode_split_tokens": 32}),
]
SEEDS = range(2)


def load_test_module():
    spec = importlib.util.spec_from_file_location("test_triton_attention", TEST_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def worst_errors(t, dtype, int8, ctx, qlens, overrides) -> tuple[float, float]:
    """Worst (max abs, max abs / max |ref|) over a few seeds, both head sizes."""
    config = t.TritonAttention.Config(prefill_block_m=16, block_n=16, **overrides)
    worst = (0.0, 0.0)
    for seed in SEEDS:
        for head_dim, heads in ((64, 6), (128, 4)):
            case = t.make_case(ctx, qlens, heads=heads, kv_heads=2, head_dim=head_dim, dtype=dtype, int8=int8,
                               seed=seed)
            out, _ = t.run_attention(case, config)
            errs = t.errors(out, t.reference(case))
            worst = (max(worst[0], errs[0]), max(worst[1], errs[1]))
    return worst


def main() -> None:
    t = load_test_module()
    print("| activations / KV | kernel | max abs error | max rel error | test bound (rel) |")
    print("|---|---|---|---|---|")
    for label, dtype, int8 in SETTINGS:
        for kernel, ctx, qlens, overrides in KERNELS:
            abs_err, rel_err = worst_errors(t, dtype, int8, ctx, qlens, overrides)
            print(f"| {label} | {kernel} | {abs_err:.2e} | {rel_err:.2e} | {t.REL_TOL[dtype]:.1e} |")


if __name__ == "__main__":
    main()
