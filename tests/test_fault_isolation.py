"""A plugin that raises fails only the requests it touched; the engine keeps serving."""

from __future__ import annotations

import types

import pytest

from modserve import LLM, SamplingParams
from modserve.core.contract import hookimpl
from modserve.core.plugin_manager import PluginRegistry
from modserve.plugins.samplers.default import DefaultSampler
from modserve.plugins.schedulers.fcfs import FCFSScheduler
from modserve.plugins.speculative.ngram import NgramProposer

POISON = 13  # a prompt starting with this token makes the faulty plugins raise
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class FaultySampler(DefaultSampler):
    def sample(self, logits, batch):
        if batch.seeds.tolist().count(4242):
            raise RuntimeError("injected sampler fault")
        return super().sample(logits, batch)


class FaultyScheduler(FCFSScheduler):
    def _token_count(self, req, remaining, budget):
        if req.prompt_token_ids[0] == POISON:
            raise RuntimeError("injected scheduler fault")
        return super()._token_count(req, remaining, budget)


class FaultyProposer(NgramProposer):
    def propose(self, requests, k):
        if any(r.prompt_token_ids[0] == POISON for r in requests):
            raise RuntimeError("injected proposer fault")
        return super().propose(requests, k)


def _registry():
    module = types.ModuleType("faulty_plugins")
    module.MODSERVE_CONTRACT = "2.0"
    module.register_samplers = hookimpl(lambda: {"faulty": FaultySampler})
    module.register_schedulers = hookimpl(lambda: {"faulty": FaultyScheduler})
    module.register_speculative_decoders = hookimpl(lambda: {"faulty": FaultyProposer})
    reg = PluginRegistry()
    reg.register_module(module, source="tests")
    return reg


@pytest.mark.parametrize(
    "section,poison_params,expected",
    [
        ("sampler", {"seed": 4242}, "sampler plugin 'faulty' failed: RuntimeError: injected sampler fault"),
        ("scheduler", {}, "scheduler plugin 'faulty' failed: RuntimeError: injected scheduler fault"),
        ("speculative", {}, "speculative plugin 'faulty' failed: RuntimeError: injected proposer fault"),
    ],
)
def test_faulty_plugin_fails_only_its_requests(tiny_llama, section, poison_params, expected):
    overrides = {section: {"plugin": "faulty"}}
    from modserve.core.engine import Engine
    from modserve.core.engine_factory import build_components

    engine = Engine(build_components({"model": {"path": tiny_llama[0]}, "kv_cache": {"plugin": "paged", "num_blocks": 64}, **overrides}, registry=_registry()))
    good = [engine.add_request([20 + i, 21, 22], GREEDY, request_id=f"good{i}")[0] for i in range(3)]
    poison_ids = [POISON, 5, 6] if section != "sampler" else [30, 31, 32]
    engine.add_request(poison_ids, GREEDY.with_changes(**poison_params), request_id="poison")
    finished = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert finished["poison"].outputs[0].finish_reason == "error"
    assert finished["poison"].error == expected
    for g in good:  # batched calls were retried request by request: only the poison failed
        assert finished[g.request_id].outputs[0].finish_reason == "length"
        assert len(finished[g.request_id].outputs[0].token_ids) == 8
    # the engine still serves new requests afterwards
    engine.add_request([40, 41], GREEDY, request_id="after")
    while engine.has_unfinished():
        for out in engine.step():
            assert out.outputs[0].finish_reason in (None, "length")


def test_a_raising_observer_is_logged_and_others_still_run(tiny_llama, caplog):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64})
    seen = []

    class Broken:
        @hookimpl
        def on_step_finished(self, stats):
            raise RuntimeError("observer bug")

    class Counting:
        @hookimpl
        def on_step_finished(self, stats):
            seen.append(stats.step)

    llm.engine.c.registry.pm.register(Broken())
    llm.engine.c.registry.pm.register(Counting())
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert seen and "observer bug" in caplog.text
