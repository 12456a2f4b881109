"""Structured outputs (the ``structured_outputs`` logits processor, llguidance): every output
matches its JSON schema, regex, choice or grammar, sampled, with ``n > 1``, prefix caching and
speculative decoding, beside unconstrained requests that keep their tokens; a bad constraint
is an error naming the field. Over HTTP the ``openai`` SDK's ``parse`` gets parsed objects
from the embedded SmolLM2."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel, Field
from server_helpers import LiveServer

from modserve import LLM, SamplingParams
from modserve.core.sampling_params import StructuredOutputs

EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue sky"]
LARK = 'start: "v" DIGIT "." DIGIT\nDIGIT: /[0-9]/'
GBNF = 'root ::= "yes" | "no" | "maybe"'
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": (StructuredOutputs(regex=EMAIL), lambda t: re.fullmatch(EMAIL, t) is not None),
    "choice": (StructuredOutputs(choice=CHOICES), lambda t: t in CHOICES),
    "lark": (StructuredOutputs(grammar=LARK), lambda t: re.fullmatch(r"v[0-9]\.[0-9]", t) is not None),
    "gbnf": (StructuredOutputs(grammar=GBNF), lambda t: t in ("yes", "no", "maybe")),
    "json": (StructuredOutputs(json=SCHEMA), lambda t: _json_ok(t)),
}


def _json_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("S", "M", "L")


def _sampled(constraint: StructuredOutputs, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=1.0, seed=5, n=3, structured_outputs=constraint, **extra)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model={"path": tiny_llama[0], "max_model_len": 256}, kv_cache={"plugin": "paged", "num_blocks": 128})


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_always_match(llm, kind):
    constraint, ok = CONSTRAINTS[kind]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)], _sampled(constraint))
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 9
    assert all(ok(t) for t in texts), texts
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[9, 10], [5, 6, 7], [11, 12, 13], [5, 6, 8]]
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[::2]], free)]
    params = [free, _sampled(CONSTRAINTS["regex"][0]), free, _sampled(CONSTRAINTS["json"][0])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert all(re.fullmatch(EMAIL, c.text) for c in outs[1].outputs)
    assert all(_json_ok(c.text) for c in outs[3].outputs)


def test_prefix_hits_and_speculative_drafts_keep_the_constraint(tiny_llama):
    """A shared 48-token prefix comes from the cache; ngram drafts that break the regex are
    rejected (the prompt repeats text the regex forbids, so the proposer offers it)."""
    llm = LLM(model={"path": tiny_llama[0], "max_model_len": 256}, kv_cache={"plugin": "paged", "num_blocks": 128},
              speculative={"plugin": "ngram", "num_speculative_tokens": 3})
    shared = list(range(3, 51))
    before = llm.engine.scheduler.stats().prefix_hits
    for i in range(2):
        outs = llm.generate([{"prompt_token_ids": shared + [60 + i] * 6}], _sampled(CONSTRAINTS["regex"][0]))
        assert all(re.fullmatch(EMAIL, c.text) for c in outs[0].outputs)
    assert llm.engine.scheduler.stats().prefix_hits - before >= 48
    drafts = []

    class Count:
        from modserve.core.contract import hookimpl

        @hookimpl
        def on_step_finished(self, stats):
            drafts.append(stats.num_draft_tokens)

    llm.engine.c.registry.pm.register(Count())
    email_like = llm.tokenizer.encode("abc@defg.com abc@defg.com abc@de")
    outs = llm.generate([{"prompt_token_ids": email_like}], SamplingParams(
        max_tokens=24, temperature=0, structured_outputs=StructuredOutputs(regex=EMAIL)))
    assert re.fullmatch(EMAIL, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert sum(drafts) > 0  # drafts were proposed and verified under the mask


@pytest.mark.parametrize("constraint,field", [
    (dict(regex="[a-z"), "structured_outputs.regex"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_a_bad_constraint_names_the_field_and_leaves_the_engine_serving(llm, constraint, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs=StructuredOutputs(**constraint)))
    assert llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="structured_outputs: give exactly one of json, regex, choice, grammar, json_object; got regex, choice"):
        StructuredOutputs(regex="a", choice=["a"])


# ----------------------------------------------------------------------------- HTTP, SmolLM2


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=2000)  # unbounded, a 135M model may repeat digits to max_tokens


@pytest.fixture(scope="module")
def smol_server():
    with LiveServer(model={"path": "smollm2-135m-instruct", "name": "smollm2", "max_model_len": 1024},
                    kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 512}) as s:
        yield s


@pytest.mark.slow
def test_parse_returns_parsed_objects_in_a_mixed_batch(smol_server):
    client = smol_server.client()
    countries = ["France", "Spain", "Italy", "Germany", "Japan", "Peru", "Kenya", "Canada",
                 "Chile", "Egypt", "India", "Norway", "Poland", "Brazil", "Greece", "Mexico"]

    def ask(i):
        return [{"role": "user", "content": f"Give the capital of {countries[i]} as JSON."}]

    def parsed(i):
        r = client.chat.completions.parse(model="smollm2", messages=ask(i), response_format=Capital, max_tokens=160, temperature=0)
        return r.choices[0].message.parsed

    def free(i):
        return client.chat.completions.create(model="smollm2", messages=ask(i), max_tokens=24, seed=i).choices[0].message.content

    with ThreadPoolExecutor(32) as pool:
        objects = list(pool.map(parsed, range(16)))
        texts = list(pool.map(free, range(16)))
    assert all(isinstance(o, Capital) for o in objects), objects
    assert all(isinstance(t, str) and t for t in texts)


@pytest.mark.slow
def test_every_constraint_over_http(smol_server):
    url = f"{smol_server.url}/v1/chat/completions"
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 64, "temperature": 1.0}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}, _json_ok),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"regex": EMAIL}}, lambda t: re.fullmatch(EMAIL, t) is not None),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_grammar": GBNF}, lambda t: t in ("yes", "no", "maybe")),
    ]
    for extra, ok in cases:
        body = httpx.post(url, json={**ask, **extra, "n": 2}, timeout=120).json()
        texts = [c["message"]["content"] for c in body["choices"]]
        assert len(texts) == 2 and all(ok(t) for t in texts), (extra, texts)
    r = httpx.post(url, json={**ask, "structured_outputs": {"regex": "[a-z"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    r = httpx.post(url, json={**ask, "structured_outputs": {"regex": "a"}, "guided_choice": ["a"]})
    assert r.status_code == 400 and "one output constraint per request" in r.json()["error"]["message"]
    r = httpx.post(url, json={**ask, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 400 and "response_format.json_schema.schema: required" in r.json()["error"]["message"]
    described = {"name": "x", "schema": SCHEMA, "description": "a size"}
    r = httpx.post(url, json={**ask, "response_format": {"type": "json_schema", "json_schema": described}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("response_format.json_schema.description: not supported by this server")


def test_ignore_eos_runs_on_after_the_constraint_is_complete(llm):
    """The grammar ends; the mask then allows only EOS, and ignore_eos keeps sampling it."""
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured_outputs=StructuredOutputs(choice=["ab"]))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    eos = llm.engine.c.spec.eos_token_ids[0]
    assert out.token_ids[-1] == eos and llm.tokenizer.decode([t for t in out.token_ids if t != eos]) == "ab"
