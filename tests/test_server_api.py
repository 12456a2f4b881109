"""The OpenAI-compatible API against a live server, driven by the official ``openai`` client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import json

import httpx
import pytest
from server_helpers import MODEL_NAME, LiveServer, pipeline

from modserve import LLM, SamplingParams

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm():
    """The offline API on the same checkpoint: the reference for greedy outputs."""
    return LLM(pipeline())


def test_models_health_tokenize(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "modserve"
    assert httpx.get(f"{server.url}/health").status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello, world!"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == server.engine.tokenizer.encode_chat(CHAT)


def test_completion_stream_equals_whole(client):
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    (choice,) = whole.choices
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.created > 0
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)


def test_chat_stream_equals_whole(client):
    kw = dict(model=MODEL_NAME, messages=CHAT, max_completion_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_include_usage(client):
    for create, kw in [
        (client.completions.create, dict(prompt="Once upon a time")),
        (client.chat.completions.create, dict(messages=CHAT)),
    ]:
        chunks = list(create(model=MODEL_NAME, max_tokens=10, temperature=0, stream=True,
                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **kw))
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 10
        assert last.usage.total_tokens == last.usage.prompt_tokens + 10
        assert all(c.usage is None for c in body)


def test_n2_and_seed(client):
    kw = dict(model=MODEL_NAME, prompt="Hello", max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # child i samples with seed + i
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, n=2, seed=7, stream=True)
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles |= {c.index} if c.delta.role == "assistant" else set()
    assert roles == {0, 1}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, n=2, seed=7)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


def test_stop_strings(client):
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and full.index(stop) > 0
    cut = client.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut.text


def test_logprobs(client, llm):
    lp = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # keyed by token text, so tokens decoding alike (partial UTF-8) share a key
        assert 1 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the top token
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content[:2])

    # lm-evaluation-harness loglikelihood: token-id batch, echo, logprobs, max_tokens=1
    prompts = [[5, 17, 33, 9, 40], [7, 8, 9]]
    res = client.completions.create(model=MODEL_NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert [c.index for c in res.choices] == [0, 1]
    for p, choice, out in zip(prompts, res.choices, ref):
        got = choice.logprobs
        assert len(got.tokens) == len(p) + 1 and got.token_logprobs[0] is None and got.top_logprobs[0] is None
        want = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])]
        assert got.token_logprobs[1 : len(p)] == pytest.approx(want, abs=1e-4)
        assert choice.text.startswith(llm.tokenizer.decode(p, skip_special_tokens=False))
    assert res.usage.prompt_tokens == sum(map(len, prompts)) and res.usage.completion_tokens == 2


def test_batch_of_text_prompts(client):
    res = client.completions.create(model=MODEL_NAME, prompt=["Hello", "Once upon"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.choices[0].text == res.choices[1].text and res.choices[2].text == res.choices[3].text


def test_16_concurrent_streams_equal_offline(server, llm):
    prompts = [f"Once upon a time {i} " * (1 + i % 3) for i in range(16)]
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))

    def stream(prompt: str) -> str:
        chunks = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts))
    assert got == [r.outputs[0].text for r in ref]


def test_access_log_has_no_prompt_text(client, caplog):
    caplog.set_level("INFO", logger="modserve.access")
    res = client.completions.create(model=MODEL_NAME, prompt="secret words here", max_tokens=3, temperature=0)
    for _ in range(100):  # the line is written just after the response is sent
        lines = [r.getMessage() for r in caplog.records if r.name == "modserve.access" and res.id in r.getMessage()]
        if lines:
            break
        time.sleep(0.02)
    (line,) = lines
    assert '"POST /v1/completions" 200' in line and "output_tokens=3" in line and "latency=" in line
    assert "secret" not in line


def test_echo_stream_equals_whole(client):
    kw = dict(model=MODEL_NAME, prompt="Hello there", echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    assert whole.text.startswith("Hello there") and whole.logprobs.token_logprobs[0] is None
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, field)] == getattr(whole.logprobs, field)
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


def test_model_card_and_tokenizer_info():
    with LiveServer() as s:
        client = s.client()
        assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
        missing = httpx.get(f"{s.url}/v1/models/other-model")
        assert missing.status_code == 404 and MODEL_NAME in missing.json()["error"]["message"]
        info = httpx.get(f"{s.url}/tokenizer_info").json()
        engine = s.app.state.server.engine
        assert info["eos_token_id"] == engine.tokenizer.eos_token_ids[0]
        assert info["chat_template"] == engine.tokenizer.chat_template and info["chat_template"]
        assert info["vocab_size"] == engine.vocab_size and info["model_max_length"] == engine.max_model_len


def test_prompt_logprobs_on_completions():
    with LiveServer() as s:
        body = {"model": MODEL_NAME, "prompt": [[10, 20, 30, 40]], "max_tokens": 2, "prompt_logprobs": 2}
        choice = httpx.post(f"{s.url}/v1/completions", json=body).json()["choices"][0]
        rows = choice["prompt_logprobs"]
        assert len(rows) == 4 and rows[0] is None
        for token, row in zip([20, 30, 40], rows[1:]):
            assert str(token) in row and 2 <= len(row) <= 3  # the top 2, and the prompt's own token
            assert all(v["logprob"] <= 0 for v in row.values())
        echo = {"model": MODEL_NAME, "prompt": [[10, 20, 30, 40]], "max_tokens": 2, "echo": True, "logprobs": 1}
        echoed = httpx.post(f"{s.url}/v1/completions", json=echo).json()["choices"][0]["logprobs"]["token_logprobs"]
        assert [round(r[str(t)]["logprob"], 4) for t, r in zip([20, 30, 40], rows[1:])] == [round(x, 4) for x in echoed[1:4]]
        too_many = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt_logprobs": 999})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_continuous_usage_stats():
    with LiveServer() as s:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        content = [e for e in events if e["choices"]]
        assert content and all(e["usage"] is not None for e in content)
        counts = [e["usage"]["completion_tokens"] for e in content]
        assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["usage"]["completion_tokens"] == 5
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=chat) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert all(e["usage"] is not None for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
        alone = httpx.post(f"{s.url}/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}})
        assert alone.status_code == 400 and "needs stream_options.include_usage" in alone.json()["error"]["message"]
