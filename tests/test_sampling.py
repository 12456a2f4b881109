"""Sampler behaviour: seeds, filters, penalties, stops, logprobs, n > 1 (tiny Llama)."""

from __future__ import annotations

from types import SimpleNamespace

import collections

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.request import Request
from modserve.core.sampling_batch import SamplingBatch
from modserve.plugins.samplers.default import DefaultSampler
from modserve.core.contract import NoOptions
from modserve.core.plugin_manager import standalone_context


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 256})


PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15]}


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seed_reproducible_across_batch_compositions(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = texts(llm.generate(PROMPT, sp))[0]
    others = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(20, 30)]
    mixed = llm.generate(
        others[:5] + [PROMPT] + others[5:],
        [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * 5 + [sp] + [SamplingParams(temperature=0, max_tokens=7)] * 5,
    )
    assert texts(mixed)[5] == alone
    other_seed = texts(llm.generate(PROMPT, sp.with_changes(seed=99)))[0]
    assert other_seed != alone


def test_unseeded_sampling_varies(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = texts(llm.generate([PROMPT] * 6, sp))
    assert len({tuple(o) for o in outs}) > 1


def _sampler_rows(params_list, vocab=50):
    reqs = [Request(str(i), [1, 2, 3], p.with_changes(seed=p.seed or i)) for i, p in enumerate(params_list)]
    return reqs, SamplingBatch.build(reqs, [0] * len(reqs), vocab, "cpu")


def test_top_k_top_p_min_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    order = logits[0].argsort(descending=True).tolist()
    sampler = DefaultSampler(NoOptions(), standalone_context(model=SimpleNamespace(vocab_size=50)))
    probs = logits[0].softmax(-1)
    cases = {
        "top_k": (SamplingParams(temperature=1.0, top_k=3), set(order[:3])),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.5), None),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.2), {t for t in range(50) if probs[t] >= 0.2 * probs.max()}),
    }
    nucleus, mass = set(), 0.0
    for t in order:
        nucleus.add(t)
        mass += probs[t].item()
        if mass >= 0.5:
            break
    cases["top_p"] = (cases["top_p"][0], nucleus)
    for name, (sp, allowed) in cases.items():
        seen = set()
        for seed in range(300):
            _, batch = _sampler_rows([sp.with_changes(seed=seed + 1)])
            seen.add(sampler.sample(logits, batch).token_ids.item())
        assert seen <= allowed, name
        assert len(seen) == len(allowed) or len(allowed) > 5, name


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = DefaultSampler(NoOptions(), standalone_context(model=SimpleNamespace(vocab_size=4)))
    counts = collections.Counter()
    n = 4000
    _, batch = _sampler_rows([SamplingParams(temperature=1.0, seed=7)] * n, vocab=4)
    batch.counters = torch.arange(n)
    tokens = sampler.sample(logits.expand(n, 4).contiguous(), batch).token_ids.tolist()
    counts.update(tokens)
    expected = logits[0].softmax(-1).tolist()
    for t in range(4):
        assert counts[t] / n == pytest.approx(expected[t], abs=0.03)


def test_penalties_match_a_reference():
    vocab = 8
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0, -2.0]])
    sp = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    req = Request("r", [1, 2], sp.with_changes(seed=1))
    req.output_token_ids = [2, 6, 6]
    batch = SamplingBatch.build([req], [3], vocab, "cpu")
    got = DefaultSampler(NoOptions(), standalone_context(model=SimpleNamespace(vocab_size=vocab))).process(logits.clone(), batch)[0]
    ref = logits[0].clone()
    for t in {1, 2, 6}:  # prompt + output
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    for t, c in collections.Counter([2, 6, 6]).items():
        ref[t] -= 0.25 * c + 0.5
    assert torch.allclose(got, ref)


def test_stop_token_ids_min_tokens_max_tokens(llm):
    free = texts(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))[0]
    stop_tok = free[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free[: free.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens bans the stop token until reached, so generation continues past it
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) >= 6 and stop_tok not in out.token_ids[:6]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(llm, monkeypatch):
    free = texts(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))[0]
    eos = free[4]
    monkeypatch.setattr(llm.engine.c.spec, "eos_token_ids", [eos])
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == free[: free.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free and out.finish_reason == "length"


def test_logprobs_and_n(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == 6
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert tok in entry and len(entry) >= 3
            top = sorted(entry.values(), key=lambda lp: -lp.logprob)
            assert all(lp.logprob <= 0 for lp in top)
    again = llm.generate(PROMPT, SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_stop_strings_truncate_text(llm):
    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    assert len(full) > 4
    stop = full[2:4]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True, ignore_eos=True))[0]
    assert inc.outputs[0].text == full[: full.index(stop) + len(stop)]
