"""The embedded default model, SmolLM2-135M-Instruct GGUF, against transformers on the same file."""

from __future__ import annotations

import torch

from modserve import SamplingParams


def test_chat_greedy_matches_transformers(smollm2_llm, smollm2_hf):
    messages = [{"role": "user", "content": "Name three primary colors."}]
    ids = smollm2_llm.tokenizer.encode_chat(messages)
    assert ids[:3] == [1, 9690, 198]  # <|im_start|>system\n from the GGUF's chat template
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ref = smollm2_hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
            min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2,
        )[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].text == smollm2_llm.tokenizer.decode(ref)
    assert "red" in out.outputs[0].text.lower()


def test_stops_at_im_end(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in smollm2_llm.engine.c.spec.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text
