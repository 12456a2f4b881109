"""A Llama checkpoint of a named shape with random bfloat16 weights, for peer comparisons of
models larger than SmolLM2 where none can be downloaded.

Speed does not depend on the weights' values, and both servers load the same directory, so
`MODEL_DIR=PATH benchmarks/compare.sh` compares them on that shape. The word-level tokenizer
(`gpu_throughput.build_tokenizer`) gives every id text, so the client's streamed chunks, and its
TTFT and TPOT, keep their meaning. Each shape has its vocabulary size (`qwen2.5-0.5b-layers`
SmolLM2's 49,152, so that only the layers differ from SmolLM2's); `--vocab` sets another.

    python benchmarks/random_checkpoint.py qwen2.5-0.5b-layers /tmp/q05
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput  # noqa: E402

SMOLLM2_VOCAB = gpu_throughput.SHAPES["smollm2"]["vocab_size"]
SHAPES = {
    **gpu_throughput.SHAPES,
    # Qwen2.5-0.5B's layers (hidden 896, 24 layers, 14 query and 2 KV heads of 64, MLP 4,864) as
    # a Llama, without the q/k/v biases: 358 M parameters in the layers, 3.4x SmolLM2's
    "qwen2.5-0.5b-layers": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, vocab_size=SMOLLM2_VOCAB, tie_word_embeddings=True,
                                rope_theta=1000000.0),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path", help="the directory to write (must not hold a checkpoint already)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the shape's)")
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.vocab is not None:
        if args.vocab < 3:
            p.error("--vocab: at least 3 (the tokenizer's <unk>, <|im_end|> and one word)")
        shape["vocab_size"] = args.vocab
    if os.path.exists(os.path.join(args.path, "config.json")):
        p.error(f"path: {args.path} already holds a checkpoint")
    os.makedirs(args.path, exist_ok=True)
    gpu_throughput.build_checkpoint(shape, args.path, "cpu")
    print(f"wrote a random {args.shape} checkpoint ({shape['vocab_size']} ids) to {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
