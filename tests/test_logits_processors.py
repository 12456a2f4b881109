"""Logits processors: ``logit_bias`` removes (-100) or forces (+100) a token, ``bad_words`` never
appear, ``allowed_token_ids`` are the only tokens, in the engine and over HTTP with the ``openai``
client; a field no enabled processor claims is refused."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError
from server_helpers import MODEL_NAME, LiveServer

from modserve import LLM, SamplingParams

GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[10, 20, 30, 40, 50], [60, 70, 80], list(range(100, 120))]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model={"path": tiny_llama[0], "max_model_len": 128}, kv_cache={"plugin": "paged", "num_blocks": 64})


def _tokens(llm, prompts, **params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY, **params))
    return [o.outputs[0].token_ids for o in outs]


def test_minus_100_removes_a_token_and_plus_100_forces_one(llm):
    plain = _tokens(llm, PROMPTS)
    banned = plain[0][0]
    got = _tokens(llm, PROMPTS[:1], logit_bias={banned: -100.0})[0]
    assert banned not in got
    forced = _tokens(llm, PROMPTS[:1], logit_bias={7: 100.0})[0]
    assert forced == [7] * GREEDY["max_tokens"]


def test_biased_and_plain_requests_share_a_batch(llm):
    """Only the rows of the biased request change; its batch mates keep their tokens."""
    plain = _tokens(llm, PROMPTS)
    sp = [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logit_bias={11: 100.0}), SamplingParams(**GREEDY)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == plain[0] and got[2] == plain[2]
    assert got[1] == [11] * GREEDY["max_tokens"]


def test_bad_bias_names_the_field(llm):
    with pytest.raises(ValueError, match=r"logit_bias: token id 999999 is outside the vocabulary"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(logit_bias={999999: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias: bias 500.0 for token 3 is outside \[-100, 100\]"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(logit_bias={3: 500.0}))
    assert not llm.engine.requests


def test_a_pipeline_without_the_processor_refuses_the_field(tiny_llama):
    llm = LLM(model={"path": tiny_llama[0], "max_model_len": 128}, kv_cache={"plugin": "paged", "num_blocks": 64},
              logits_processors=[])
    with pytest.raises(ValueError, match=r"logit_bias: not supported by this pipeline"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(logit_bias={3: 1.0}))


def test_logit_bias_over_http():
    with LiveServer() as s:
        client = s.client()
        ask = dict(model=MODEL_NAME, prompt=[[10, 20, 30, 40]], max_tokens=4, temperature=0, logprobs=0)
        plain = client.completions.create(**ask)
        forced = client.completions.create(**ask, logit_bias={"7": 100})
        text = httpx.post(f"{s.url}/detokenize", json={"model": MODEL_NAME, "tokens": [7] * 4}).json()["prompt"]
        assert forced.choices[0].text == text != plain.choices[0].text
        with pytest.raises(BadRequestError, match="logit_bias: keys must be token ids, got 'abc'"):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, logit_bias={"abc": 1})
        with pytest.raises(BadRequestError, match="logit_bias: token id 99999999 is outside the vocabulary"):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logit_bias={"99999999": 1}
            )


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_appear(llm):
    plain = _tokens(llm, PROMPTS[:1])[0]
    tok = llm.tokenizer.tokenizer
    words = [tok.decode([plain[0]]), tok.decode(plain[1:3])]  # a one-token word and a longer one
    got = _tokens(llm, PROMPTS[:1], bad_words=words)[0]
    assert got != plain
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tok.encode(text, add_special_tokens=False).ids
            assert ids and not _contains(got, ids), (word, ids, got)


def test_allowed_token_ids_are_the_only_tokens(llm):
    allowed = [7, 11, 13]
    got = _tokens(llm, PROMPTS, allowed_token_ids=allowed)
    assert all(set(t) <= set(allowed) for t in got)
    with pytest.raises(ValueError, match=r"allowed_token_ids: token id 99999 is outside the vocabulary"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(allowed_token_ids=[99999]))


def test_token_filters_over_http():
    with LiveServer() as s:
        client = s.client()
        r = client.completions.create(model=MODEL_NAME, prompt=[[10, 20, 30]], max_tokens=6, temperature=0,
                                      extra_body={"allowed_token_ids": [7], "bad_words": ["zzz"]})
        text = httpx.post(f"{s.url}/detokenize", json={"model": MODEL_NAME, "tokens": [7] * 6}).json()["prompt"]
        assert r.choices[0].text == text


def test_filter_inputs_name_their_field(llm):
    with pytest.raises(ValueError, match=r"^allowed_token_ids: must list at least one token id$"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(allowed_token_ids=[]))
    with pytest.raises(ValueError, match=r"^bad_words: at most 512 words, got 513$"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(bad_words=[f"w{i}" for i in range(513)]))
    assert not llm.engine.requests


def test_two_processors_claiming_one_field_is_a_start_up_error(tiny_llama):
    with pytest.raises(ValueError, match=r"logits_processors: LogitBias and LogitBias both claim the request field 'logit_bias'; enable one"):
        LLM(model={"path": tiny_llama[0], "max_model_len": 128}, kv_cache={"plugin": "paged", "num_blocks": 64},
            logits_processors=[{"plugin": "logit_bias"}, {"plugin": "logit_bias"}])
