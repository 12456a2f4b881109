"""``compute_logits``: float32 logits of the LM head, widened for a half-precision model into a
buffer reused from step to step (a fresh one per step costs its page faults)."""

from __future__ import annotations

import torch

from modserve import LLM


def test_bfloat16_logits_are_exact_widenings_in_one_reused_buffer(tiny_llama):
    path, _ = tiny_llama
    model = LLM(model={"path": path, "dtype": "bfloat16"}, kv_cache={"plugin": "paged", "num_blocks": 32}).engine.runner.model
    g = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for rows in (3, 9, 5):  # grows, then a smaller step fits in what the larger one left
            hidden = torch.randn(rows, model.spec.hidden_size, generator=g).bfloat16()
            logits = model.compute_logits(hidden)
            assert logits.dtype == torch.float32 and logits.shape == (rows, model.spec.vocab_size)
            assert torch.equal(logits, model.lm_head.forward(hidden).float())
            results.append(logits)
    assert results[2].data_ptr() == results[1].data_ptr()  # the 5-row step reused the 9-row buffer
