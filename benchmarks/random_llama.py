"""A random-weight Llama HF directory, Llama-3.2-1B-shaped by default, with SmolLM2's tokenizer.

Why: SmolLM2-135M's 576-wide rows are not a multiple of 256, so llama-quantize falls back from
the K-quants for most of its tensors (its `Q4_K_M` is mostly Q5_0), and at 135 M weights a
decode step is not all weight reads. A model whose widths are multiples of 256 gets the mix a
real 1-8 B model's `Q4_K_M` has (Q4_K, with Q6_K v / down in half the layers and a Q6_K head)
and reads ~0.8 GB a step. Random weights (std 0.02, norms 1) serve for speed and memory, not
for text: benchmark it with `ignore_eos`.

    python benchmarks/random_llama.py /tmp/llama1b-hf          # then, for the GGUF files:
    MODEL_DIR=/tmp/llama1b-hf LLAMA_GGUF=/tmp/llama-cpp/llama1b-bf16.gguf QUANTS=Q4_K_M benchmarks/peers/llama_cpp_setup.sh
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_DIR = Path("/tmp/smollm2-135m-instruct-hf")  # benchmarks/convert_smollm2_to_hf.py's output
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR, help="whose tokenizer and vocabulary (an HF Llama directory)")
    args = ap.parse_args()
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if not (args.tokenizer_dir / "config.json").is_file():
        ap.error(f"--tokenizer-dir: no config.json in {args.tokenizer_dir} (python benchmarks/convert_smollm2_to_hf.py {args.tokenizer_dir})")
    config = json.loads((args.tokenizer_dir / "config.json").read_text())
    head_dim = args.hidden // args.heads
    config.update(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=head_dim,
                  tie_word_embeddings=False, _model_name_or_path="random llama")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (args.tokenizer_dir / name).is_file():
            shutil.copy(args.tokenizer_dir / name, args.out / name)

    g = torch.Generator().manual_seed(0)
    h, f, v, kv = args.hidden, args.intermediate, config["vocab_size"], args.kv_heads * head_dim

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(v, h), "lm_head.weight": weight(v, h), "model.norm.weight": ones(h)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
                  "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
        tensors.update({f"{p}{name}.weight": weight(*shape) for name, shape in shapes.items()})
        tensors.update({f"{p}input_layernorm.weight": ones(h), f"{p}post_attention_layernorm.weight": ones(h)})
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    weights = sum(t.numel() for t in tensors.values())
    print(f"{args.out}: {weights / 1e9:.2f} B weights, {2 * weights / 2**30:.2f} GiB in bfloat16")


if __name__ == "__main__":
    main()
