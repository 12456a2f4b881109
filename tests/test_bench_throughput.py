"""``modserve bench throughput``: varied lengths from the random dataset, every request's own
output counted on both sides, one HF run per batch size across a sweep, argument errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from modserve import cli
from modserve.bench.compare import render
from modserve.bench.throughput import make_requests, medians
from tiny_models import build_model


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("throughput")
    build_model(str(path / "model"), "llama")
    config = path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(path / "model")}, "kv_cache": {"plugin": "paged", "num_blocks": 64}}))
    return str(config)


def test_sweep_counts_each_requests_own_tokens_and_runs_hf_once(tiny_config, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "throughput", "-c", tiny_config, "--num-prompts", "6", "--input-len", "20", "--output-len", "8",
            "--range-ratio", "0.5", "--max-num-seqs", "2,4", "--baseline", "hf", "--hf-batch-size", "3",
            "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "modserve (max_num_seqs 4) / hf (batch 3) = " in printed
    rows = json.loads(out.read_text())
    assert [(r["system"], r["max_num_seqs"]) for r in rows] == [("modserve", 2), ("hf", 3), ("modserve", 4)]
    args = SimpleNamespace(num_prompts=6, input_len=20, output_len=8, range_ratio=0.5, seed=0)
    requests = make_requests(args, 384)
    assert len({r.output_len for r in requests}) > 1 and len({r.prompt_len for r in requests}) > 1  # lengths vary
    want_out = sum(r.output_len for r in requests)
    want_total = want_out + sum(r.prompt_len for r in requests)
    for r in rows:
        assert (r["num_requests"], r["output_tokens"], r["total_tokens"]) == (6, want_out, want_total), r["system"]
        assert r["output_tok_s"] == pytest.approx(want_out / r["elapsed_s"])


def test_repeats_alternate_rounds_and_print_the_median_of_their_ratios(tiny_config, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "throughput", "-c", tiny_config, "--num-prompts", "4", "--input-len", "12", "--output-len", "4",
            "--max-num-seqs", "2,4", "--baseline", "hf", "--hf-batch-size", "2", "--repeats", "2", "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [(r["system"], r["max_num_seqs"], r["round"]) for r in rows] == [
        ("modserve", 2, 1), ("hf", 2, 1), ("modserve", 4, 1), ("modserve", 2, 2), ("hf", 2, 2), ("modserve", 4, 2)]
    assert "[round 2/2] hf" in printed and "median of 2 rounds:" in printed
    summary = printed.split("median of 2 rounds:")[1]
    for m in medians(rows):
        if m["system"] == "modserve":
            ratios = m["ratios"]["hf (batch 2)"]
            assert len(ratios) == 2 and f"rounds: {ratios[0]:.2f}, {ratios[1]:.2f}" in summary


def _row(system, size, tok_s, rnd):
    return {"system": system, "dtype": "bfloat16", "max_num_seqs": size, "num_requests": 8, "elapsed_s": 10.0,
            "output_tokens": int(tok_s * 10), "total_tokens": int(tok_s * 30), "output_tok_s": tok_s, "round": rnd}


def test_medians_pair_each_round_with_its_own_baseline():
    # the machine slows in round 2 and both sides with it: the ratio of medians (600 / 100 = 6x)
    # would mix rounds; the median of the rounds' own ratios is 5x
    rows = [_row("modserve", 16, 500.0, 1), _row("hf", 16, 100.0, 1), _row("modserve", 16, 700.0, 2),
            _row("hf", 16, 140.0, 2), _row("modserve", 16, 600.0, 3), _row("hf", 16, 100.0, 3)]
    ours, hf = medians(rows)
    assert (ours["rounds"], ours["output_tok_s"], ours["total_tok_s"]) == (3, 600.0, 1800.0)
    assert ours["ratios"] == {"hf (batch 16)": [5.0, 5.0, 6.0]} and hf["ratios"] == {}
    serve_run = {"max_concurrency": 1, "completed": 1, "failed": 0, "request_throughput": 1.0, "output_throughput": 1.0,
                 "mean_ttft_ms": 1.0, "median_tpot_ms": 1.0}
    text = render({"modserve": [serve_run]}, rows)
    assert "medians of 3 alternated rounds" in text
    assert "| modserve | bfloat16 | 16 | 8 | 600.0 | 1800.0 | / hf (batch 16) = 5.00x (5.00–6.00x) |" in text


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["--range-ratio", "1.0"], "--range-ratio: must be in [0, 1), got 1.0"),
    (["--hf-batch-size", "0"], "--hf-batch-size: must be >= 1, got 0"),
    (["--max-num-seqs", "4,x"], "--max-num-seqs: expected comma-separated integers, got '4,x'"),
    (["--dtype", "int8"], "--dtype: expected float32, bfloat16 or float16, got 'int8'"),
    (["--output-len", "0"], "--output-len: must be >= 1, got 0"),
])
def test_bad_arguments_exit_2_naming_the_flag(tiny_config, args, message, capsys):
    assert cli.main(["bench", "throughput", "-c", tiny_config, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("modserve bench: error: ") and message in err
