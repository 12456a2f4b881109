"""``modserve bench throughput``: varied lengths from the random dataset, every request's own
output counted on both sides, one HF run per batch size across a sweep, argument errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from modserve.core import cli
from modserve.core.bench.throughput import make_requests
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


@pytest.mark.parametrize("args, message", [
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
