"""Speculative decoding: exact greedy identity, exact distribution, exact block accounting."""

from __future__ import annotations

from types import SimpleNamespace

import random

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.contract import NoOptions, hookimpl
from modserve.core.plugin_manager import standalone_context
from modserve.core.request import Request
from modserve.core.sample_plan import SampleEntry
from modserve.core.token_selection import select_tokens
from modserve.plugins.samplers.default import DefaultSampler
from modserve.plugins.speculative.ngram import lookup

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROPOSERS = {
    "ngram": {"plugin": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "draft_model": {"plugin": "draft_model", "num_speculative_tokens": 3, "draft": {"layers": 1}},
}


class SpecLog:
    def __init__(self):
        self.drafted = self.accepted = 0

    @hookimpl
    def on_step_finished(self, stats):
        self.drafted += stats.num_draft_tokens
        self.accepted += stats.num_accepted_tokens


def repetitive_prompts(count=6, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 6))]
        out.append((motif * 8)[: rng.randrange(8, 40)])
    return out


def generate(path, ps, params, **overrides):
    llm = LLM({"model": {"path": path, "max_model_len": 256}, **overrides})
    log = SpecLog()
    llm.engine.c.registry.pm.register(log)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    return [o.outputs[0].token_ids for o in outs], llm, log


@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("pool", [256, 17])
def test_greedy_identical_with_and_without_speculation(tiny_llama, proposer, pool):
    ps = repetitive_prompts()
    kv = {"plugin": "paged", "num_blocks": pool}
    ref, _, _ = generate(tiny_llama[0], ps, GREEDY, kv_cache=kv)
    # a mixed batch: some requests opt out, one is sampled (its output is not compared)
    params = [GREEDY, GREEDY.with_changes(speculative=False)] * 3 + [SamplingParams(temperature=0.9, seed=3, max_tokens=24)]
    got, llm, log = generate(tiny_llama[0], ps + ps[:1], params, kv_cache=kv, speculative=PROPOSERS[proposer])
    assert got[:6] == ref
    assert log.drafted > 0 and 0 < log.accepted <= log.drafted
    if pool == 17:
        assert llm.engine.scheduler.num_preemptions > 0
    if proposer == "draft_model":
        draft_kv = llm.engine.proposer.kv
        assert draft_kv.num_free_blocks == draft_kv.num_blocks


def test_speculation_with_n_and_aborts_keeps_blocks_exact(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64}, speculative=PROPOSERS["draft_model"])
    engine = llm.engine
    ps = repetitive_prompts(4, seed=2)
    engine.add_request(ps[0], GREEDY.with_changes(n=2), request_id="pair")
    engine.add_request(ps[1], GREEDY, request_id="solo")
    engine.add_request(ps[2], SamplingParams(temperature=1.0, max_tokens=30, seed=4), request_id="sampled")
    for _ in range(6):
        engine.step()
    engine.abort_request(["solo", "pair#1"])
    while engine.has_unfinished():
        engine.step()
    assert engine.proposer.kv.num_free_blocks == engine.proposer.kv.num_blocks


def test_ngram_lookup():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 4) == [4, 5, 1, 2]
    assert lookup([1, 2, 3, 9, 1, 2, 3, 9, 7], 1, 3, 2) == []  # [9, 7], [7] never seen before
    assert lookup([5, 5, 5], 1, 3, 2) == [5]
    assert lookup([8], 1, 3, 2) == []


def _chi_square(counts, probs, n):
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs) if p > 0)


def test_rejection_sampling_preserves_the_target_distribution():
    """Drafts from a deliberately wrong proposer: the first and second tokens still follow the
    target's distributions exactly (chi-square, fixed seeds: deterministic, no flakiness)."""
    vocab, n = 6, 6000
    logits_rows = torch.tensor([[1.5, 0.2, -0.5, 0.9, -1.0, 0.0], [0.1, 1.2, 0.3, -0.7, 0.5, -2.0], [0.0] * 6])
    sampler = DefaultSampler(NoOptions(), standalone_context(model=SimpleNamespace(vocab_size=vocab)))
    entries = []
    for i in range(n):
        req = Request(str(i), [1], SamplingParams(temperature=1.0, seed=1000 + i))
        entries.append(SampleEntry(req, [3 * i, 3 * i + 1, 3 * i + 2], drafts=[4, 2]))  # unlikely drafts
    chosen = select_tokens(sampler, logits_rows.repeat(n, 1), entries, vocab)
    p1 = logits_rows[0].softmax(-1).tolist()
    p2 = logits_rows[1].softmax(-1).tolist()
    first = {}
    second = {}
    for ch in chosen:
        first[ch.tokens[0]] = first.get(ch.tokens[0], 0) + 1
        if ch.tokens[0] == 4:
            second[ch.tokens[1]] = second.get(ch.tokens[1], 0) + 1
    assert _chi_square(first, p1, n) < 20.5  # chi2 critical value, 5 dof, p = 0.001
    m = sum(second.values())
    assert m > 200
    assert _chi_square(second, p2, m) < 20.5
    accepted_first = sum(1 for ch in chosen if ch.num_accepted >= 1)
    assert accepted_first / n == pytest.approx(p1[4], abs=0.02)  # draft 4 accepted with probability p(4)


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    sampler = DefaultSampler(NoOptions(), standalone_context(model=SimpleNamespace(vocab_size=4)))
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    req = Request("g", [1], SamplingParams(temperature=0, seed=1))
    (ch,) = select_tokens(sampler, logits, [SampleEntry(req, [0, 1, 2], drafts=[1, 3])], 4)
    assert ch.tokens == [1, 2] and ch.num_accepted == 1
    (ch,) = select_tokens(sampler, logits, [SampleEntry(req, [0, 1, 2], drafts=[1, 2])], 4)
    assert ch.tokens == [1, 2, 0] and ch.num_accepted == 2


def test_draft_checkpoint_loaded_beside_the_target(tiny_llama):
    """``speculative.path``: a draft read from its own checkpoint (here the target's, so every
    draft matches) on the target's platform and dtype; outputs equal the target's alone."""
    ps = repetitive_prompts(4, seed=5)
    ref, _, _ = generate(tiny_llama[0], ps, GREEDY)
    draft = {"plugin": "draft_model", "num_speculative_tokens": 3, "path": tiny_llama[0]}
    got, llm, log = generate(tiny_llama[0], ps, GREEDY, speculative=draft)
    assert got == ref
    assert log.drafted > 0 and log.accepted == log.drafted
    assert llm.engine.proposer.runner.model is not llm.engine.c.runner.model
