"""``modserve bench serve``: metric definitions on synthetic timings, datasets, arrivals, the SSE
client on scripted streams, and end-to-end runs against a live tiny server and a dead port."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from modserve.bench import datasets as ds
from modserve.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_result,
    parse_goodput,
    parse_percentiles,
    percentile_key,
    tpot_of,
)
from modserve.bench.serve import Client, arrival_offsets, join_url, main, plan_runs, request_plan

# --------------------------------------------------------------------- metrics


def _ok(start, ttft, itl, out_tokens, prompt_len=10):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=out_tokens, expected_output_len=out_tokens,
                         ttft=ttft, itl=list(itl), latency=ttft + sum(itl), start_time=start)


@pytest.fixture
def three():
    """Two successful requests and one failure, with hand-computable metrics."""
    a = _ok(0.0, 0.100, [0.020, 0.030, 0.050], 4)    # E2E 0.2, TPOT (0.2-0.1)/3
    b = _ok(0.5, 0.300, [], 1, prompt_len=20)         # one token: no TPOT sample, TPOT 0 for goodput
    c = RequestResult(success=False, prompt_len=7, expected_output_len=9, error="HTTP 503: overloaded")
    return [a, b, c]


def test_metric_definitions(three):
    m = compute_metrics(three, duration=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5  # failed requests count nowhere
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)  # numpy linear interpolation
    assert m["mean_tpot_ms"] == pytest.approx(100 / 3)          # only the request with > 1 token
    assert m["p50_tpot_ms"] == pytest.approx(100 / 3)
    assert m["mean_itl_ms"] == pytest.approx((20 + 30 + 50) / 3)  # one sample per chunk, pooled
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["std_e2el_ms"] == pytest.approx(50.0)
    assert m["request_goodput"] is None
    assert m["errors"] == ["", "", "HTTP 503: overloaded"]
    assert m["ttfts"][2] is None and m["output_lens"] == [4, 1, 0]
    assert m["max_concurrent_requests"] == 1  # [0, 0.2) and [0.5, 0.8) do not overlap
    assert m["max_output_tokens_per_s"] == 5  # all five chunks fall in the first second


def test_tpot_is_e2e_minus_ttft_over_tokens_minus_one():
    r = _ok(0.0, 0.5, [0.1, 0.1, 0.3], out_tokens=7)  # usage says 7 tokens in 4 chunks
    assert tpot_of(r) == pytest.approx((1.0 - 0.5) / 6)
    assert tpot_of(_ok(0.0, 0.5, [], 1)) is None
    no_usage = _ok(0.0, 0.5, [0.1, 0.1], None)
    assert no_usage.output_len == 3  # chunk count when the server sends no usage
    m = compute_metrics([no_usage], 1.0)
    assert m["output_tokens_estimated"] == 1 and m["total_output_tokens"] == 3


def test_goodput(three):
    assert compute_metrics(three, 2.0, goodput={"ttft": 150})["request_goodput"] == pytest.approx(0.5)
    # a: TPOT 33.3 ms > 30 -> bad; b: one token, TPOT 0 -> good
    assert compute_metrics(three, 2.0, goodput={"tpot": 30})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(three, 2.0, goodput={"ttft": 1000, "tpot": 40, "e2el": 300})["request_goodput"] == 1.0
    assert compute_metrics(three, 2.0, goodput={"ttft": 150, "tpot": 30})["request_goodput"] == 0.0
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2el:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_percentiles():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert [percentile_key(p) for p in (50.0, 99, 99.9)] == ["p50", "p99", "p99.9"]
    with pytest.raises(ValueError):
        parse_percentiles("0,50")
    rs = [_ok(0.0, t / 1000, [], 1) for t in range(1, 101)]
    m = compute_metrics(rs, 1.0, percentiles=[90, 99.9])
    assert m["p90_ttft_ms"] == pytest.approx(np.percentile(np.arange(1, 101), 90))
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile(np.arange(1, 101), 99.9))
    assert "P99.9 TTFT (ms):" in format_result({**m, "max_concurrency": None}, [90, 99.9], ["ttft"])


def test_all_failed_gives_zeros_not_errors():
    m = compute_metrics([RequestResult(error="ConnectError")] * 3, 0.5, goodput={"ttft": 10})
    assert (m["completed"], m["failed"], m["request_throughput"], m["request_goodput"]) == (0, 3, 0.0, 0.0)
    assert m["mean_ttft_ms"] == 0.0 and m["max_concurrent_requests"] == 0


# --------------------------------------------------------------------- arrivals and sweeps


def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_offsets(5, math.inf, 1.0, rng) == [0.0] * 5
    poisson = arrival_offsets(200, 4.0, 1.0, np.random.default_rng(1))
    assert poisson[-1] == pytest.approx(200 / 4.0) and all(np.diff(poisson) >= 0)
    assert arrival_offsets(200, 4.0, 1.0, np.random.default_rng(1)) == poisson  # seeded
    uniform = arrival_offsets(4, 2.0, math.inf, rng)
    assert uniform == pytest.approx([0.5, 1.0, 1.5, 2.0])
    cv = lambda b: np.std(g := np.diff(arrival_offsets(2000, 10.0, b, np.random.default_rng(2)))) / np.mean(g)  # noqa: E731
    assert cv(0.25) > 1.5 > cv(1.0) > 0.7 > cv(4.0)  # gamma shape k: CV = 1/sqrt(k)


def test_sweep_plan():
    args = types.SimpleNamespace(max_concurrency="16,64", request_rate="inf", num_prompts="128,256", burstiness=1.0)
    assert plan_runs(args) == [
        {"max_concurrency": 16, "request_rate": math.inf, "num_prompts": 128},
        {"max_concurrency": 64, "request_rate": math.inf, "num_prompts": 256},
    ]
    with pytest.raises(ValueError, match="one of"):
        plan_runs(types.SimpleNamespace(max_concurrency="1,2", request_rate="1,2", num_prompts="8", burstiness=1.0))
    with pytest.raises(ValueError, match="--num-prompts"):
        plan_runs(types.SimpleNamespace(max_concurrency="1,2", request_rate="inf", num_prompts="8,9,10",
                                        burstiness=1.0))
    with pytest.raises(ValueError, match="--max-concurrency"):
        plan_runs(types.SimpleNamespace(max_concurrency="0", request_rate="inf", num_prompts="8", burstiness=1.0))
    assert join_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    assert join_url("http://h:1", "/v1/chat/completions") == "http://h:1/v1/chat/completions"


# --------------------------------------------------------------------- datasets


def test_request_plan_gives_each_run_its_own_random_requests():
    assert request_plan([16, 64], 2, True) == (82, slice(80, None), [slice(0, 16), slice(16, 80)])
    assert request_plan([16, 64], 0, True) == (80, slice(80, None), [slice(0, 16), slice(16, 80)])
    # datasets whose prompts repeat by design (shared prefixes, a file): every run from the start
    assert request_plan([16, 64], 2, False) == (64, slice(0, None), [slice(0, 16), slice(0, 64)])


def test_random_dataset():
    tokens = ds.TokenSpace.from_range(100, 200)
    reqs = ds.random_requests(300, 256, 128, 0.5, tokens, seed=3)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 128 and max(ins) <= 384 and min(outs) >= 64 and max(outs) <= 192
    assert max(ins) - min(ins) > 200  # the range is used
    assert all(len(r.prompt) == r.prompt_len and all(100 <= t < 200 for t in r.prompt) for r in reqs)
    again = ds.random_requests(300, 256, 128, 0.5, tokens, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    fixed = ds.random_requests(4, 10, 5, 0.0, tokens, prefix_len=3)
    assert [r.prompt_len for r in fixed] == [13] * 4 and [r.output_len for r in fixed] == [5] * 4
    assert len({tuple(r.prompt[:3]) for r in fixed}) == 1
    assert ds.length_bounds(1, 0.9) == (1, 2)  # never 0 tokens
    with pytest.raises(ValueError):
        ds.random_requests(1, 8, 8, 1.0, tokens)


def test_token_space_avoids_special_tokens(tiny_llama):
    tok = ds.load_tokenizer(tiny_llama[0])
    space = ds.TokenSpace.from_tokenizer(tok)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert special and not special & set(space.allowed.tolist())
    assert len(space.allowed) == tok.get_vocab_size() - len(special)
    with pytest.raises(ValueError, match="LO:HI"):
        ds.parse_token_range("5-10")


def test_prefix_repetition_dataset():
    tokens = ds.TokenSpace.from_range(1000, 5000)
    reqs = ds.prefix_repetition_requests(23, 8, 4, 5, 6, tokens, seed=1)
    assert len(reqs) == 20  # rounded down to 4 prompts per prefix
    assert all(r.prompt_len == 12 and r.output_len == 6 for r in reqs)
    prefixes = [tuple(r.prompt[:8]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4] * 5
    assert prefixes[:4] != [prefixes[0]] * 4 or prefixes[4:8] != [prefixes[4]] * 4  # shuffled
    with pytest.raises(ValueError, match="num-prompts"):
        ds.prefix_repetition_requests(3, 8, 4, 5, 6, tokens)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"just text"\n{"prompt": "hi", "output_len": 7}\n\n{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    reqs = ds.jsonl_requests(str(path), 5, default_output_len=11)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs[:3]] == [
        ("just text", None, 11), ("hi", None, 7), ([5, 6, 7], 3, 3)]
    assert reqs[3].prompt == "just text"  # cycled
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=":1:"):
        ds.jsonl_requests(str(path), 1, 11)


def test_sharegpt_dataset(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "r1"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "r2"},
                                      {"from": "human", "value": "q3"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert sorted(ds.sharegpt_pairs(str(path), seed=0)) == [("q1", "r1"), ("q2", "r2")]
    assert ds.sharegpt_accept(10, 20, None) == 20
    assert ds.sharegpt_accept(3, 20, None) is None and ds.sharegpt_accept(10, 3, None) is None
    assert ds.sharegpt_accept(10, 3, 50) == 50  # an explicit output length ignores the reply's
    assert ds.sharegpt_accept(1025, 10, None) is None and ds.sharegpt_accept(1000, 1049, None) is None


# --------------------------------------------------------------------- the SSE client on scripted streams


def _client(events, status=200, chat=False):
    """A Client whose transport replays ``events`` as (delay_s, sse line) pairs."""

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            for delay, data in events:
                await asyncio.sleep(delay)
                yield f"data: {data}\n\n".encode()

    def handler(request):
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue full", "code": "overloaded"}})
        return httpx.Response(200, stream=Stream(), headers={"content-type": "text/event-stream"})

    args = types.SimpleNamespace(base_url="http://x", endpoint="/v1/chat/completions" if chat else "/v1/completions",
                                 api_key="k", timeout=10.0)
    c = Client(args, None)
    c.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return c


def _send(client):
    async def go():
        try:
            return await client.send({}, ds.SampleRequest([1, 2], 2, 3))
        finally:
            await client.aclose()

    return asyncio.run(go())


def _chunk(text=None, delta=None, usage=None, finish=None):
    choice = {"index": 0, "finish_reason": finish}
    if delta is not None:
        choice["delta"] = delta
    else:
        choice["text"] = text
    return json.dumps({"choices": [choice], "usage": usage})


def test_sse_timings_chat_role_chunk_is_not_a_token():
    events = [(0.0, _chunk(delta={"role": "assistant", "content": ""})),  # sent before prefill
              (0.15, _chunk(delta={"content": "a"})), (0.05, _chunk(delta={"content": "b"})),
              (0.05, _chunk(delta={"content": "c"}, finish="length")),
              (0.0, json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})),
              (0.0, "[DONE]")]
    r = _send(_client(events, chat=True))
    assert r.success and r.output_tokens == 3 and r.prompt_len == 9
    assert 0.14 <= r.ttft < 0.4 and len(r.itl) == 2  # from the request, not from the role chunk
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))  # the usage chunk does not extend E2E
    assert tpot_of(r) == pytest.approx(sum(r.itl) / 2)


def test_sse_errors_are_failures():
    r = _send(_client([], status=503))
    assert not r.success and r.error == "HTTP 503: queue full"
    r = _send(_client([(0, _chunk("x")), (0, json.dumps({"error": {"message": "engine died"}})), (0, "[DONE]")]))
    assert not r.success and "engine died" in r.error
    r = _send(_client([(0, "[DONE]")]))
    assert not r.success and "without a chunk" in r.error
    r = _send(_client([(0, _chunk("")), (0.05, _chunk("x", finish="length")), (0, "[DONE]")]))
    assert r.success and r.output_tokens is None and r.itl == [] and r.ttft >= 0.04  # empty text: not a token yet


# --------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def live(tiny_llama):
    from server_helpers import LiveServer

    with LiveServer(model={"path": tiny_llama[0]}) as server:
        yield server


def test_end_to_end_random(live, tiny_llama, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["--base-url", live.url, "--num-prompts", "8", "--random-input-len", "24", "--random-output-len", "12",
               "--random-range-ratio", "0.5", "--tokenizer", tiny_llama[0], "--max-concurrency", "4",
               "--goodput", "ttft:60000", "--percentiles", "50,99", "--output", str(out), "--no-progress"])
    assert rc == 0
    m = json.loads(out.read_text())
    assert (m["completed"], m["failed"]) == (8, 0)
    assert m["model_id"] == "tiny-llama" and m["max_concurrency"] == 4 and m["ignore_eos"] is True
    assert m["output_lens"] == m["requested_output_lens"]  # ignore_eos: exactly what was asked
    assert m["total_output_tokens"] == sum(m["requested_output_lens"]) and m["output_tokens_estimated"] == 0
    assert all(6 <= n <= 18 for n in m["output_lens"]) and all(12 <= n <= 36 for n in m["input_lens"])
    assert m["total_input_tokens"] == sum(m["input_lens"])  # token-id prompts: usage agrees with the dataset
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"):
        assert m[key] > 0, key
    assert all(t > 0 for t in m["ttfts"]) and len(m["itls"]) == 8
    assert m["p99_e2el_ms"] >= m["p99_ttft_ms"] > 0


def test_end_to_end_chat_sweep_and_plots(live, tmp_path):
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rc = main(["--base-url", live.url + "/v1", "--endpoint", "/v1/chat/completions", "--num-prompts", "4",
               "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.5",
               "--random-token-range", "3:300", "--max-concurrency", "1,4", "--output", str(out), "--plot",
               str(plots), "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    assert all(r["completed"] == 4 and r["output_lens"] == r["requested_output_lens"] for r in runs)
    # each run sends prompts of its own (a prefix cache must not serve the second run the first's)
    assert runs[0]["requested_output_lens"] != runs[1]["requested_output_lens"]
    assert sorted(p.name for p in plots.iterdir()) == [
        "itl_distribution.png", "latency_tail.png", "throughput.png", "ttft_distribution.png"]


def test_end_to_end_text_prompts_and_shared_prefixes(live, tmp_path):
    lines = tmp_path / "p.jsonl"
    lines.write_text('"Hello, world!"\n{"prompt": "The quick brown fox", "output_len": 5}\n')
    out = tmp_path / "j.json"
    assert main(["--base-url", live.url, "--dataset-path", str(lines), "--jsonl-output-len", "3", "--ignore-eos",
                 "--num-prompts", "4", "--output", str(out), "--no-progress"]) == 0
    m = json.loads(out.read_text())
    assert m["dataset_name"] == "jsonl" and m["completed"] == 4 and m["output_lens"] == [3, 5, 3, 5]
    assert all(n > 0 for n in m["input_lens"])  # text prompts: lengths from usage.prompt_tokens
    assert main(["--base-url", live.url, "--dataset-name", "prefix_repetition", "--random-token-range", "3:300",
                 "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4",
                 "--num-prompts", "7", "--output", str(out), "--no-progress"]) == 0
    m = json.loads(out.read_text())
    assert m["num_prompts"] == 6 and m["completed"] == 6 and m["input_lens"] == [40] * 6
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}  # noqa: E731
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([conv("Once upon a time there was", "a small model that served tokens"),
                                    conv("hi", "too short a prompt"),
                                    conv("def add(a, b): return", "a + b, said the quick brown fox")]))
    assert main(["--base-url", live.url, "--dataset-path", str(sharegpt), "--num-prompts", "2", "--ignore-eos",
                 "--output", str(out), "--no-progress"]) == 0  # tokens counted by the server's /tokenize
    m = json.loads(out.read_text())
    assert m["dataset_name"] == "sharegpt" and m["completed"] == 2
    assert m["output_lens"] == m["requested_output_lens"] and min(m["requested_output_lens"]) >= 4


@pytest.fixture
def dead_url():
    """A port that is bound but not listening: connections are refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_refused_connections_count_as_failed(dead_url, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--base-url", dead_url, "--model", "m", "--num-prompts", "4", "--num-warmups", "0",
               "--output", str(out), "--no-progress"])
    assert rc == 1
    m = json.loads(out.read_text())
    assert (m["completed"], m["failed"]) == (0, 4)
    assert all(e.startswith("ConnectError") for e in m["errors"])
    assert "no successful request" in capsys.readouterr().err
    # without --model the client asks GET /v1/models first, and says the server is unreachable
    assert main(["--base-url", dead_url, "--num-prompts", "4"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    # with a warm-up (the default) nothing is timed against a dead server
    assert main(["--base-url", dead_url, "--model", "m", "--num-prompts", "4"]) == 2
    assert "warm-up request" in capsys.readouterr().err


def _bench_result(conc, tok_s, ttft):
    """A `bench serve` result with the fields the comparison report reads."""
    return {"max_concurrency": conc, "request_rate": "inf", "completed": 8, "failed": 0, "percentiles": [99.0],
            "request_throughput": tok_s / 100, "output_throughput": tok_s, "mean_ttft_ms": ttft,
            "p99_ttft_ms": ttft, "median_tpot_ms": 10.0, "p99_itl_ms": 20.0, "p99_e2el_ms": 900.0,
            "dataset_name": "random", "random_input_len": 256, "random_output_len": 128,
            "random_range_ratio": 0.5, "ignore_eos": True, "temperature": 0.0}


def test_comparison_report():
    from modserve.bench.compare import render

    run = _bench_result
    offline = [{"system": "modserve", "dtype": "bfloat16", "max_num_seqs": 16, "num_requests": 64, "elapsed_s": 10.0,
                "output_tokens": 5000, "total_tokens": 20000, "output_tok_s": 500.0},
               {"system": "modserve", "dtype": "bfloat16", "max_num_seqs": 64, "num_requests": 64, "elapsed_s": 5.0,
                "output_tokens": 5000, "total_tokens": 20000, "output_tok_s": 1000.0},
               {"system": "hf", "dtype": "bfloat16", "max_num_seqs": 16, "num_requests": 64, "elapsed_s": 50.0,
                "output_tokens": 5000, "total_tokens": 20000, "output_tok_s": 100.0}]
    text = render({"modserve": [run(16, 200, 500), run(64, 600, 800)], "vllm-cpu": [run(16, 160, 1000),
                                                                                   run(64, 300, 400)]},
                  offline, ["same machine"])
    assert "| 16 | vllm-cpu | 1.25x | 1.25x | 0.50x |" in text
    assert "| 64 | vllm-cpu | 2.00x | 2.00x | 2.00x |" in text
    assert "| modserve | bfloat16 | 16 | 64 | 500.0 | 2000.0 | / hf (batch 16) = 5.00x |" in text
    assert "| modserve | bfloat16 | 64 | 64 | 1000.0 | 4000.0 | / hf (batch 16) = 10.00x |" in text and "256 ± 50% tokens" in text and "- same machine" in text


def test_comparison_report_judges_the_cpu_goals_against_vllm_cpu_only():
    """Each goal at the concurrencies it holds at, on the median of the rounds' ratios: met at its
    bound, missed by how much past it; a peer other than vLLM-cpu gets no verdicts."""
    from modserve.bench.compare import render

    def run(conc, tok_s, ttft, tpot):
        return {**_bench_result(conc, tok_s, ttft), "median_tpot_ms": tpot}

    ours = [[run(1, 90, 240, 8.0), run(16, 250, 900, 60.0), run(64, 300, 1100, 200.0)],
            [run(1, 80, 260, 9.0), run(16, 240, 900, 60.0), run(64, 320, 1000, 200.0)]]
    vllm = [[run(1, 40, 300, 10.0), run(16, 200, 1000, 90.0), run(64, 250, 1000, 250.0)],
            [run(1, 40, 300, 10.0), run(16, 200, 1000, 90.0), run(64, 250, 1000, 250.0)]]
    llama = [[run(1, 10, 999, 99.0)], [run(1, 10, 999, 99.0)]]
    text = render({"modserve": ours, "vllm-cpu": vllm, "llama.cpp": llama})
    goals = text.split("## Against the CPU goals")[1].split("## Every round")[0]
    assert "| 1 | vllm-cpu | median TPOT at most 0.8x | 0.85x (0.80–0.90x) | **missed** by 6% |" in goals
    assert "| 1 | vllm-cpu | p99 TTFT no worse (at most 1.00x) | 0.83x (0.80–0.87x) | met |" in goals
    assert "| 16 | vllm-cpu | output tok/s at least 1.25x | 1.23x (1.20–1.25x) | **missed** by 2% |" in goals
    assert "| 64 | vllm-cpu | output tok/s at least 1.25x | 1.24x (1.20–1.28x) | **missed** by 1% |" in goals
    assert "| 64 | vllm-cpu | p99 TTFT no worse (at most 1.00x) | 1.05x (1.00–1.10x) | **missed** by 5% |" in goals
    # one row per goal that holds: no throughput goal at 1 client, no TPOT goal from 16, none for llama.cpp
    assert goals.count("| vllm-cpu |") == 6 and "llama.cpp" not in goals and "| 1 | vllm-cpu | output tok/s" not in goals
    # exactly at the bound is met
    assert "| 16 | vllm-cpu | 1.25x | 1.25x | 0.50x |" in render({"modserve": [_bench_result(16, 200, 500)],
                                                                 "vllm-cpu": [_bench_result(16, 160, 1000)]})
    at_bound = render({"modserve": [_bench_result(16, 200, 1000)], "vllm-cpu": [_bench_result(16, 160, 1000)]})
    assert "| 16 | vllm-cpu | output tok/s at least 1.25x | 1.25x | met |" in at_bound
    assert "| 16 | vllm-cpu | p99 TTFT no worse (at most 1.00x) | 1.00x | met |" in at_bound
    # no peer with goals (a rate sweep, or llama.cpp alone): no section
    assert "Against the CPU goals" not in render({"modserve": [run(1, 90, 240, 8.0)], "llama.cpp": [run(1, 10, 999, 99.0)]})


def test_comparison_of_alternated_rounds_pairs_each_round(tmp_path, capsys):
    """Rounds: each ratio is the median of the rounds' own ratios (a drifting machine moves both
    systems of a round together), not the ratio of the medians; a missing round file keeps the
    later rounds paired with their peers' rounds."""
    from modserve.bench.compare import main

    ours = [(300, 1000), (400, 900), (500, 800)]    # output tok/s, p99 TTFT ms, by round
    peer = [(200, 1000), (400, 1000), (1000, 400)]  # round ratios 1.5x, 1.0x, 0.5x: median 1.0x
    paths = {}
    for label, rounds in (("modserve", ours), ("vllm-cpu", peer)):
        paths[label] = []
        for i, (tok, ttft) in enumerate(rounds, 1):
            path = tmp_path / f"{label}.round{i}.json"
            path.write_text(json.dumps([_bench_result(16, tok, ttft)]))
            paths[label].append(str(path))
    out = tmp_path / "report"
    assert main(["--out", str(out), "--no-plots", "--system", "modserve=" + ",".join(paths["modserve"]),
                 "--system", "vllm-cpu=" + ",".join(paths["vllm-cpu"])]) == 0
    text = (out / "comparison.md").read_text()
    assert "medians of 3 alternated rounds" in text
    # medians 400 vs 400 tok/s; the rounds' own ratios 1.5, 1.0, 0.5 and TTFT 1.0, 0.9, 2.0
    assert "| 16 | modserve | 24 | 0 | 4.00 | 400.0 | 900.0 | 900.0 |" in text
    assert "| 16 | vllm-cpu | 1.00x (0.50–1.50x) | 1.00x (0.50–1.50x) | 1.00x (0.90–2.00x) |" in text
    assert "| 16 | modserve | 300.0, 400.0, 500.0 | 1000, 900, 800 |" in text

    # round 2 of the peer missing: rounds 1 and 3 still pair with each other's round 1 and 3
    Path(paths["vllm-cpu"][1]).unlink()
    assert main(["--out", str(out), "--no-plots", "--system", "modserve=" + ",".join(paths["modserve"]),
                 "--system", "vllm-cpu=" + ",".join(paths["vllm-cpu"])]) == 0
    assert "vllm-cpu: no result for round 2" in capsys.readouterr().err
    text = (out / "comparison.md").read_text()
    assert "| 16 | vllm-cpu | 1.00x (0.50–1.50x) |" in text  # median of 1.5 and 0.5, not 1.5 and 0.4
    assert "| 16 | vllm-cpu | 200.0, -, 1000.0 | 1000, -, 400 |" in text

    with pytest.raises(SystemExit):
        main(["--out", str(out), "--system", "modserve=a.json,"])
    assert "--system: expected LABEL=PATH[,PATH...], got 'modserve=a.json,'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "x2", "-1", "1.5"])
def test_compare_script_rejects_a_bad_online_repeats_before_any_work(value, tmp_path):
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.sh"
    env = {"PATH": "/usr/bin:/bin", "ONLINE_REPEATS": value, "OUT": str(tmp_path / "out"), "PEERS": ""}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == f"ONLINE_REPEATS: expected a whole number >= 1, got '{value}'"
    assert not (tmp_path / "out").exists()  # stopped before writing anything


@pytest.mark.parametrize("var", ["MODEL_PATH", "LLAMA_GGUF"])
def test_compare_script_rejects_a_missing_model_path_before_any_work(var, tmp_path):
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.sh"
    missing = str(tmp_path / "nowhere.gguf")
    env = {"PATH": "/usr/bin:/bin", var: missing, "OUT": str(tmp_path / "out"), "PEERS": ""}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == f"{var}: no such file or directory: {missing}"
    assert not (tmp_path / "out").exists()  # stopped before writing anything


def _random_llama(*args: str):
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "random_llama.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


def test_random_llama_writes_a_model_the_engine_serves(tiny_llama, tmp_path):
    """benchmarks/random_llama.py: the shape asked for (untied head, the tokenizer directory's
    vocabulary), loadable by modserve; a shape that cannot be is refused naming the flag."""
    import json

    from safetensors import safe_open

    from modserve import LLM, SamplingParams

    path, hf = tiny_llama
    out = tmp_path / "random"
    r = _random_llama(str(out), "--hidden", "64", "--intermediate", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                      "--tokenizer-dir", path)
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"], config["tie_word_embeddings"]) == (64, 2, 16, False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.self_attn.k_proj.weight").get_shape() == [32, 64]
        assert f.get_slice("lm_head.weight").get_shape() == [hf.config.vocab_size, 64]
    llm = LLM(model={"path": str(out), "max_model_len": 64}, kv_cache={"plugin": "paged", "num_blocks": 16})
    got = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 4
    bad = _random_llama(str(tmp_path / "bad"), "--hidden", "100", "--heads", "32", "--tokenizer-dir", path)
    assert bad.returncode == 2 and "--hidden 100 is not a multiple of --heads 32" in bad.stderr
    assert not (tmp_path / "bad").exists()
    missing = _random_llama(str(tmp_path / "bad"), "--tokenizer-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "--tokenizer-dir: no config.json in" in missing.stderr
