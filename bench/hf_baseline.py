"""HF ``transformers`` on the same weights as a pipeline: the benchmark baseline and test oracle.

``transformers`` is a test/benchmark-only dependency; a clear error says how to get it.
"""

from __future__ import annotations

import os

import torch

from modserve.core.config import load_pipeline
from modserve.core.models.loader import locate


def load_hf_model(config, dtype: torch.dtype):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("--baseline hf needs transformers: pip install 'modserve[test]'") from None
    source = locate(load_pipeline(config).model.path)
    if source.kind == "hf":
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(source.path), gguf_file=os.path.basename(source.path), dtype=dtype
        )
    return model.eval()
