"""The request path: the engine validates a request once, merges ``n > 1`` into one output per
request and step, and every delta it emits is sent once (their concatenation is the text)."""

from __future__ import annotations

import httpx
from server_helpers import MODEL_NAME, LiveServer

from modserve import LLM, SamplingParams
from modserve.core.engine import Engine

SAMPLED = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)


def test_one_output_per_request_and_step_and_the_deltas_add_up(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64})
    engine = llm.engine
    engine.add_request([10, 20, 30], SAMPLED, request_id="a")
    engine.add_request([40, 50], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="b")
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    while engine.has_unfinished():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs)  # one output per request
        for out in outs:
            assert out.request_id in ("a", "b")
            for c in out.outputs:
                texts[out.request_id, c.index] = texts.get((out.request_id, c.index), "") + c.text_delta
                tokens[out.request_id, c.index] = tokens.get((out.request_id, c.index), []) + c.token_ids_delta
                assert c.text.endswith(c.text_delta)
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"a", "b"}
    assert {i for (rid, i) in texts if rid == "a"} == {0, 1, 2}
    again = llm.generate([{"prompt_token_ids": [10, 20, 30]}], SAMPLED)[0]  # Finals: every choice's last state
    assert [c.index for c in again.outputs] == [0, 1, 2]
    for c in again.outputs:
        assert (c.text, c.token_ids) == (texts["a", c.index], tokens["a", c.index])


def test_aborting_a_request_id_aborts_all_its_sequences(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64})
    engine = llm.engine
    engine.add_request([10, 20, 30], SAMPLED, request_id="a")
    for _ in range(3):
        engine.step()
    (out,) = engine.abort_request(["a"])
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_server_validates_each_prompt_once(monkeypatch):
    calls = []
    original = Engine.validate

    def counting(self, prompt_token_ids, params):
        calls.append(len(prompt_token_ids))
        return original(self, prompt_token_ids, params)

    monkeypatch.setattr(Engine, "validate", counting)
    with LiveServer() as s:
        body = {"model": MODEL_NAME, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2}
        r = httpx.post(f"{s.url}/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert sorted(calls) == [2, 3]  # once per prompt, not again on the engine thread


def test_a_token_then_a_failure_in_one_step_is_one_output(tiny_llama):
    """The proposer fails a request right after it got a token: one output, both in it."""
    from types import ModuleType

    from modserve.core.contract import hookimpl
    from modserve.core.plugin_manager import PluginRegistry
    from modserve.core.engine_factory import build_components
    from modserve.plugins.speculative.ngram import NgramProposer

    class Failing(NgramProposer):
        def propose(self, requests, k):
            raise RuntimeError("proposer fault")

    module = ModuleType("failing_proposer")
    module.MODSERVE_CONTRACT = "2.0"
    module.register_speculative_decoders = hookimpl(lambda: {"failing": Failing})
    registry = PluginRegistry()
    registry.register_module(module, source="tests")
    config = {"model": {"path": tiny_llama[0]}, "kv_cache": {"plugin": "paged", "num_blocks": 64},
              "speculative": {"plugin": "failing"}}
    engine = Engine(build_components(config, registry=registry))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), request_id="x")
    (out,) = engine.step()
    (c,) = out.outputs
    assert out.finished and c.finish_reason == "error" and len(c.token_ids_delta) == 1
    assert "speculative plugin 'failing' failed" in out.error
