"""Fuzzing the API: hostile bodies never produce a 5xx, every error is OpenAI's error JSON,
and the server is healthy with an empty KV cache afterwards.

Two fuzzers run against one live server:

* ``test_hostile_bodies``: hypothesis builds bodies from valid requests and mutates them
  at the byte level: wrong types, huge numbers, deep nesting, invalid UTF-8, lone
  surrogates, empty and giant strings, unknown fields, duplicate keys, truncated or
  non-object bodies. A fixed corpus covering every category on every endpoint runs first.
* ``test_schemathesis``: schemathesis generates positive and negative cases from the
  server's own ``GET /openapi.json`` and checks status codes, content types and response
  bodies against that schema.

Bounded for CI; ``MODSERVE_FUZZ_EXAMPLES`` / ``MODSERVE_SCHEMATHESIS_EXAMPLES`` raise the
counts. Each test prints its case count and outcomes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer

FUZZ_EXAMPLES = int(os.environ.get("MODSERVE_FUZZ_EXAMPLES", "200"))
SCHEMATHESIS_EXAMPLES = int(os.environ.get("MODSERVE_SCHEMATHESIS_EXAMPLES", "100"))
BODY_LIMIT = 64 * 1024
MAX_MODEL_LEN = 96
VOCAB = 384  # tests/tiny_models.py
ERROR_STATUSES = {400, 404, 413}  # what a client can provoke here (no auth, one client at a time)
HYPOTHESIS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.fixture(scope="module")
def server():
    limits = {"max_body_bytes": BODY_LIMIT, "max_n": 4, "max_stop_strings": 4, "max_top_logprobs": 5, "max_messages": 16}
    with LiveServer(model={"max_model_len": MAX_MODEL_LEN}, server=limits) as s:
        yield s


# ----------------------------------------------------------------- bodies as bytes


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as is (may be invalid on purpose)."""

    data: bytes


def encode(value) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Obj):
        return b"{" + b",".join(encode(k) + b":" + encode(v) for k, v in value.items) + b"}"
    return json.dumps(value, ensure_ascii=False).encode()


@dataclass
class Obj:
    """A JSON object as (key, value) pairs, so keys can repeat and be raw bytes."""

    items: list


# ----------------------------------------------------------------- hostile values

HUGE_NUMBERS = [
    Raw(str(2**63).encode()), Raw(str(-(2**63) - 1).encode()), Raw(str(2**64).encode()), Raw(b"1" + b"0" * 400),
    Raw(b"-" + b"9" * 5000), Raw(b"1e400"), Raw(b"-1e400"), Raw(b"1e-400"), 1e308, -1e308, 5e-324, 2**53 + 1,
    Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-0"), Raw(b"0.0000000000000000000001"),
]
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                b"\xc0\xaf", b"\xf4\x90\x80\x80"]
BAD_ESCAPES = [b'"\\ud800"', b'"\\udfff x"', b'"\\ud800\\u0041"', b'"\\x41"', b'"\\u12"', b'"a\x00b"', b'"tab\there"', b'"\\']


def deep(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw(b"[" * depth + b"]" * depth)
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth)


wrong_type = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.lists(st.integers(-5, 500), max_size=4), st.just({}), st.just([]),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.lists(st.lists(st.integers(-1, 500), max_size=3), max_size=3),
)
huge_number = st.sampled_from(HUGE_NUMBERS)
deep_nesting = st.builds(deep, st.one_of(st.integers(2, 64), st.integers(500, 20000)), st.sampled_from(["list", "dict"]))
invalid_utf8 = st.builds(lambda pre, bad, post: Raw(b'"' + pre.encode() + bad + post.encode() + b'"'),
                         st.text(max_size=5), st.sampled_from(INVALID_UTF8), st.text(max_size=5))
bad_escape = st.sampled_from([Raw(b) for b in BAD_ESCAPES])
empty = st.sampled_from(["", [], {}, [""], [[]], None])
giant_string = st.builds(lambda n, ch: ch * n, st.sampled_from([1000, 20_000, 60_000, 70_000, 300_000]),
                         st.sampled_from(["x", "é", "😀", "Hello ", "\u0000", "<|im_end|>"]))
giant_list = st.builds(lambda n, v: [v] * n, st.sampled_from([200, 5000, 40_000]), st.sampled_from([1, "a", [1, 2]]))

HOSTILE = {
    "wrong_type": wrong_type,
    "huge_number": huge_number,
    "deep_nesting": deep_nesting,
    "invalid_utf8": invalid_utf8,
    "bad_escape": bad_escape,
    "empty": empty,
    "giant_string": giant_string,
    "giant_list": giant_list,
}

# ----------------------------------------------------------------- valid requests to start from

small_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2), "priority": st.integers(-10, 10), "user": small_text, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.integers(1, 3),
    "stop": st.one_of(small_text, st.lists(small_text, max_size=3)), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "cache_salt": small_text,
    "model": st.just("tiny-llama"),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.one_of(small_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}), max_size=2))}
)
FIELDS = {
    "/v1/completions": {
        "required": {"prompt": st.one_of(small_text, st.lists(small_text, min_size=1, max_size=2), token_ids, st.lists(token_ids, min_size=1, max_size=2))},
        "optional": {**sampling, "max_tokens": st.integers(1, 8), "logprobs": st.integers(0, 5), "echo": st.booleans()},
    },
    "/v1/chat/completions": {
        "required": {"messages": st.lists(message, min_size=1, max_size=3)},
        "optional": {**sampling, "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8),
                     "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.booleans()},
    },
    "/tokenize": {
        "required": {"prompt": small_text},
        "optional": {"add_special_tokens": st.booleans(), "model": st.just("tiny-llama")},
    },
    "/detokenize": {"required": {"tokens": token_ids}, "optional": {"model": st.just("tiny-llama")}},
}


@st.composite
def valid_body(draw, path: str) -> Obj:
    spec = FIELDS[path]
    items = [(k, draw(s)) for k, s in spec["required"].items()]
    names = draw(st.lists(st.sampled_from(sorted(spec["optional"])), unique=True, max_size=6))
    items += [(k, draw(spec["optional"][k])) for k in names]
    if path == "/v1/chat/completions" and "max_tokens" not in names and "max_completion_tokens" not in names:
        items.append(("max_tokens", draw(st.integers(1, 8))))  # keep valid chat requests short
    return Obj(items)


MUTATIONS = ["set_field", "unknown_field", "duplicate_key", "drop_required", "raw_key", "whole_body"]


@st.composite
def hostile_case(draw) -> tuple[str, bytes, list[str]]:
    """(path, body bytes, labels of what was done to it)."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = draw(valid_body(path))
    labels = []
    for _ in range(draw(st.integers(0, 3))):
        mutation = draw(st.sampled_from(MUTATIONS))
        kind = draw(st.sampled_from(sorted(HOSTILE)))
        value = draw(HOSTILE[kind])
        spec = FIELDS[path]
        known = sorted({**spec["required"], **spec["optional"]})
        if mutation == "set_field":
            key = draw(st.sampled_from(known))
            body.items = [(k, v) for k, v in body.items if k != key] + [(key, value)]
        elif mutation == "unknown_field":
            key = draw(st.one_of(st.text(max_size=10), st.sampled_from(["__proto__", "constructor", "logit_bias", "best_of", "tools"])))
            body.items.append((key, value))
        elif mutation == "duplicate_key":
            key = draw(st.sampled_from(known))
            body.items.append((key, value))  # the same key twice: the last one wins
        elif mutation == "drop_required":
            body.items = [(k, v) for k, v in body.items if k not in spec["required"]]
        elif mutation == "raw_key":
            body.items.append((Raw(b'"' + draw(st.sampled_from(INVALID_UTF8)) + b'"'), value))
        elif mutation == "whole_body":
            return path, draw(st.one_of(
                st.builds(encode, HOSTILE[kind]),
                st.sampled_from([b"", b"{", b"}", b"null", b"[]", b'"x"', b"123", b"{}", b'{"prompt": "x",', b"\xff\xfe{}",
                                 b'{"prompt": "x"} trailing', b"{'prompt': 'x'}", b"\x00" * 16]),
                st.binary(max_size=64),
            )), labels + [f"whole_body:{kind}"]
        labels.append(f"{mutation}:{kind}")
    return path, encode(body), labels or ["valid"]


# a fixed corpus: every hostile category in every field position kind, on every endpoint
def corpus() -> list[tuple[str, bytes, str]]:
    cases = []
    samples = {
        "wrong_type": ["5", True, [1], {"a": 1}, None, 1.5],
        "huge_number": HUGE_NUMBERS,
        "deep_nesting": [deep(10_000, "list"), deep(10_000, "dict"), deep(100, "list")],
        "invalid_utf8": [Raw(b'"' + b + b'"') for b in INVALID_UTF8],
        "bad_escape": [Raw(b) for b in BAD_ESCAPES],
        "empty": ["", [], {}, [[]]],
        "giant_string": ["x" * 60_000, "😀" * 15_000, "x" * 70_000],
    }
    base = {
        "/v1/completions": [("prompt", "Hello"), ("max_tokens", 4)],
        "/v1/chat/completions": [("messages", [{"role": "user", "content": "hi"}]), ("max_tokens", 4)],
        "/tokenize": [("prompt", "Hello")],
        "/detokenize": [("tokens", [1, 2, 3])],
    }
    refused = {"/v1/completions": "best_of", "/v1/chat/completions": "audio"}  # fields a 400 names unless harmless: decoded apart
    for path, items in base.items():
        for kind, values in samples.items():
            for v in values:
                for key in [items[0][0], "n", "unknown_field", *([refused[path]] if path in refused else [])]:
                    cases.append((path, encode(Obj([(k, x) for k, x in items if k != key] + [(key, v)])), f"{kind}@{key}"))
        dup = Obj(items + [(items[0][0], 5)])
        cases.append((path, encode(dup), "duplicate_key"))
        cases.append((path, encode(Obj(items + [(Raw(b'"\xff"'), 1)])), "invalid_utf8_key"))
    return cases


# ----------------------------------------------------------------- checks


def check_response(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        assert r.status_code in ERROR_STATUSES, f"{what}: {r.status_code} {r.text[:300]}"
        assert r.headers["content-type"] == "application/json", what
        body = r.json()
        assert set(body) == {"error"}, what
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), what
        assert err["param"] is None or isinstance(err["param"], str), what
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: stream did not end with [DONE]"
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, f"{what}: error event {chunk}"
        return
    body = r.json()
    if "choices" in body:
        u = body["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], what


def check_idle(server: LiveServer) -> dict[str, float]:
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.metrics()
    for _ in range(100):  # the step that frees the last request's blocks refreshes the gauges
        if m["modserve:kv_cache_usage_perc"] == 0 and m["modserve:num_requests_running"] == 0:
            break
        m = server.metrics()
    assert m["modserve:kv_cache_usage_perc"] == 0
    assert m["modserve:num_requests_running"] == 0 and m["modserve:num_requests_waiting"] == 0
    assert server.engine.num_active == 0
    return m


def send(http: httpx.Client, url: str, path: str, body: bytes) -> httpx.Response:
    return http.post(url + path, content=body, headers={"Content-Type": "application/json"})


# ----------------------------------------------------------------- tests


def test_openapi_schema_is_generated_from_the_structs(server):
    import msgspec

    from modserve.server import protocol

    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    ops = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/health", "get"),
            ("/metrics", "get"), ("/tokenize", "post"), ("/detokenize", "post"), ("/openapi.json", "get")} <= ops
    _, components = msgspec.json.schema_components(
        [protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.Completion, protocol.ErrorResponse],
        ref_template="#/components/schemas/{name}",
    )
    for name, schema in components.items():  # exactly what msgspec derives from the structs
        assert doc["components"]["schemas"][name] == schema, name
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert {"200", "400", "413", "500", "503"} <= set(completions["responses"])
    assert "cache_salt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    usage = doc["components"]["schemas"]["Usage"]["properties"]
    assert "prompt_tokens_details" in usage


def test_hostile_bodies(server):
    outcomes: Counter = Counter()
    categories: Counter = Counter()  # hostile value kinds (and duplicate keys / valid bodies)
    mutations: Counter = Counter()  # where hypothesis put them
    with httpx.Client(timeout=60) as http:
        fixed = corpus()
        for path, body, label in fixed:
            r = send(http, server.url, path, body)
            check_response(r, f"corpus {label} {path}")
            outcomes[r.status_code] += 1
            categories[label.split("@")[0]] += 1

        @settings(max_examples=FUZZ_EXAMPLES, **HYPOTHESIS)
        @given(case=hostile_case())
        def fuzz(case):
            path, body, labels = case
            r = send(http, server.url, path, body)
            check_response(r, f"{labels} {path} {body[:300]!r}")
            outcomes[r.status_code] += 1
            for label in labels:
                mutation, _, kind = label.partition(":")
                mutations[mutation] += 1
                categories["duplicate_key" if mutation == "duplicate_key" else kind or mutation] += 1

        fuzz()
    m = check_idle(server)
    total = sum(outcomes.values())
    print(f"\nfuzz: {total} cases ({len(fixed)} corpus + {total - len(fixed)} hypothesis), "
          f"status counts {dict(sorted(outcomes.items()))}, categories {dict(categories.most_common())}, "
          f"hypothesis mutations {dict(mutations.most_common())}, "
          f"kv_cache_usage_perc {m['modserve:kv_cache_usage_perc']}")
    assert outcomes[200] > 0 and outcomes[400] > 0 and outcomes[413] > 0  # the fuzzer reached every layer


def test_schemathesis(server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import checks
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    strategies = [op.as_strategy(generation_mode=mode) for op in operations for mode in GenerationMode]
    conformance = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                   checks.response_schema_conformance]
    outcomes: Counter = Counter()

    @settings(max_examples=SCHEMATHESIS_EXAMPLES, **HYPOTHESIS)
    @given(case=st.one_of(strategies))
    def run(case):
        r = case.call(base_url=server.url, timeout=60)
        outcomes[(case.operation.method.upper(), case.operation.path, r.status_code)] += 1
        case.validate_response(r, checks=conformance)
        assert r.status_code < 500
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    run()
    m = check_idle(server)
    print(f"\nschemathesis: {sum(outcomes.values())} cases over {len(operations)} operations, "
          f"outcomes {dict(sorted(outcomes.items()))}, kv_cache_usage_perc {m['modserve:kv_cache_usage_perc']}")
