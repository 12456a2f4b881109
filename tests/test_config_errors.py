"""Every config, CLI and input error names the field and the bad value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.engine_factory import resolve
from modserve.core.models.loader import ModelNotFoundError

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")

CONFIG_ERRORS = [
    ({"kv_cache": {"plugin": "paged", "blok_size": 16}}, "kv_cache.blok_size: unknown key"),
    ({"scheduler": {"plugin": "fcfs", "max_num_seqs": "many"}}, "scheduler.max_num_seqs: expected int, got 'many'"),
    ({"scheduler": {"plugin": "fcfs", "max_num_seqs": -3}}, "scheduler.max_num_seqs: expected int >= 1, got -3"),
    ({"kv_cache": {"plugin": "paged", "block_size": 12}}, "kv_cache.block_size: expected a power of two, got 12"),
    ({"kv_cache": {"plugin": "paged", "num_blocks": 4, "memory_gb": 1}}, "kv_cache: num_blocks and memory_gb are exclusive"),
    ({"kv_cache": {"plugin": "paged", "kv_dtype": "int4"}}, "kv_cache.kv_dtype: expected one of auto, int8, got 'int4'"),
    ({"scheduler": {"plugin": "fifo"}}, "scheduler.plugin: unknown scheduler 'fifo'; available: "),
    ({"attention": {"plugin": "flash"}}, "attention.plugin: unknown attention backend 'flash'; available: "),
    ({"scheduler": {"max_num_seqs": 4}}, "scheduler.plugin: required; available: "),
    ({"scheduler": "fcfs"}, "scheduler: expected object, got 'fcfs'"),
    ({"modle": {}}, "modle: unknown key"),
    ({"model": {"dtype": "float64"}}, "model.dtype: expected one of float32, bfloat16, float16, auto, got 'float64'"),
    ({"model": {"max_model_len": 1}}, "model.max_model_len: expected int >= 2, got 1"),
    ({"server": {"port": 70000}}, "server.port: expected int <= 65535, got 70000"),
    ({"server": {"api_keys": ["a", 3]}}, "server.api_keys.1: expected str, got 3"),
    ({"server": {"burst_window_ms": 300}}, "server.burst_window_ms: expected float <= 100.0, got 300"),
    ({"server": {"burst_window_ms": -1}}, "server.burst_window_ms: expected float >= 0.0, got -1"),
    ({"observers": [{"plugin": "metrics"}, {"plugin": "tracing", "exporter": "jaeger"}]}, "observers[1].exporter: expected one of console, otlp"),
    ({"observability": {"metrics": True}}, "observability: unknown key"),
    ({"device": "tpu"}, "device: unknown platform 'tpu'; available: cuda, cpu"),
    ({"logits_processors": [{"plugin": "nope"}]}, "logits_processors[0].plugin: unknown logits processor 'nope'"),
    ({"device": {"plugin": "cuda", "cuda_graph": False}}, "device.cuda_graph: unknown key"),
    ({"device": {"plugin": "cuda", "cuda_graphs": "yes"}}, "device.cuda_graphs: expected bool, got 'yes'"),
    ({"device": {"plugin": "cuda", "graph_max_batch": 0}}, "device.graph_max_batch: expected int >= 1, got 0"),
    ({"device": {"plugin": "cuda", "graph_max_batch": 2048}}, "device.graph_max_batch: expected int <= 1024, got 2048"),
    ({"device": {"plugin": "cuda", "piecewise_graphs": 1}}, "device.piecewise_graphs: expected bool, got 1"),
    ({"device": {"plugin": "cuda", "cuda_graphs": False, "graph_max_batch": 64}},
     "device.graph_max_batch: applies to CUDA graphs, which cuda_graphs: false turns off, got 64"),
    ({"device": {"plugin": "cuda", "cuda_graphs": False, "piecewise_graphs": True}},
     "device.piecewise_graphs: graph pieces are CUDA graphs, which cuda_graphs: false turns off"),
    ({"device": {"plugin": "cuda", "piece_max_tokens": 512}},
     "device.piece_max_tokens: applies to graph pieces; set piecewise_graphs: true, got 512"),
    ({"device": {"plugin": "cpu", "decode_graphs": False, "graph_max_batch": 8}},
     "device.graph_max_batch: applies to decode call lists, which decode_graphs: false turns off, got 8"),
    ({"device": {"plugin": "cuda", "piece_max_tokens": 8}}, "device.piece_max_tokens: expected int >= 16, got 8"),
    ({"device": {"plugin": "cuda", "piece_max_tokns": 512}}, "device.piece_max_tokns: unknown key"),
    ({"attention": {"plugin": "triton", "decode_fill_programs": 0}}, "attention.decode_fill_programs: expected int >= 1, got 0"),
    ({"device": {"plugin": "cpu", "decode_graphs": "on"}}, "device.decode_graphs: expected bool, got 'on'"),
    ({"device": {"plugin": "cpu", "graph_max_batch": 0}}, "device.graph_max_batch: expected int >= 1, got 0"),
    ({"device": {"plugin": "cpu", "graph_max_batch": 512}}, "device.graph_max_batch: expected int <= 256, got 512"),
]


@pytest.mark.parametrize("config,message", CONFIG_ERRORS, ids=[m.split(":")[0] for _, m in CONFIG_ERRORS])
def test_config_error_names_the_field(config, message):
    with pytest.raises(ConfigError) as e:
        resolve(config)
    assert message in str(e.value)
    if "available: " in message:  # built-ins listed (installed example plugins may add more)
        listed = str(e.value).split("available: ")[1].split(", ")
        builtins = [{"fcfs", "priority", "static"}, {"torch", "triton"}, {"cpu", "cuda"}, {"logit_bias"}]
        assert any(b <= set(listed) for b in builtins)


def test_missing_model_and_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model not found: '/nope' is not an HF directory"):
        resolve({"model": {"path": "/nope"}})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve({"model": {"path": str(tmp_path / "empty")}})
    with pytest.raises(ConfigError, match="pipeline file not found"):
        resolve(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        resolve(str(bad))
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        resolve(str(bad))


def test_engine_build_errors(tiny_llama, tmp_path):
    path = tiny_llama[0]
    with pytest.raises(ValueError, match="fewer than max_model_len 512"):
        LLM(model=path, kv_cache={"plugin": "paged", "num_blocks": 4})
    with pytest.raises(ValueError, match="model.max_model_len: 4096 exceeds the model's max_position_embeddings 512"):
        LLM({"model": {"path": path, "max_model_len": 4096}})
    cfg = (tmp_path / "config.json")
    cfg.write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        LLM(model=str(tmp_path))


def test_prompt_errors(tiny_llama):
    llm = LLM({"model": {"path": tiny_llama[0], "max_model_len": 64}, "kv_cache": {"plugin": "paged", "num_blocks": 16}})
    with pytest.raises(ValueError, match="prompt: 70 tokens leave no room to generate within max_model_len 64"):
        llm.generate({"prompt_token_ids": [5] * 70})
    with pytest.raises(ValueError, match=r"token id 99999 is outside the vocabulary \[0, "):
        llm.generate({"prompt_token_ids": [5, 99999]})
    with pytest.raises(ValueError, match="prompt: must contain at least one token"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="sampling_params: got 2 for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": "a"})
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 99999 is outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[99999]))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens: must be >= 1, got 0"),
        ({"temperature": 2.5}, "temperature: must be in [0, 2], got 2.5"),
        ({"top_p": 0.0}, "top_p: must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k: must be -1, 0 (disabled) or >= 1, got -2"),
        ({"min_p": 1.5}, "min_p: must be in [0, 1], got 1.5"),
        ({"n": 0}, "n: must be >= 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens: must be <= max_tokens (2), got 5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty: must be in (0, 2], got 0.0"),
        ({"presence_penalty": 3.0}, "presence_penalty: must be in [-2, 2], got 3.0"),
        ({"logprobs": -1}, "logprobs: must be >= 0, got -1"),
        ({"stop": ["", "x"]}, "stop: must not contain empty strings"),
        ({"seed": 2**63}, "seed: must fit in a signed 64-bit integer"),
        ({"seed": 2**63 - 2, "n": 3}, "seed: must fit in a signed 64-bit integer"),
    ],
)
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)
    if "available: " in message:  # built-ins listed (installed example plugins may add more)
        listed = str(e.value).split("available: ")[1].split(", ")
        builtins = [{"fcfs", "priority", "static"}, {"torch", "triton"}, {"cpu", "cuda"}, {"logit_bias"}]
        assert any(b <= set(listed) for b in builtins)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "modserve.cli", *args], capture_output=True, text=True, timeout=120, env=env)


def test_cli_parser_does_not_import_torch():
    """Every command's parser is built at start-up (bench serve's client, validate, docs among
    them), so a bench module that imports torch at module level costs each of them ~0.7 s."""
    code = "import sys; from modserve import cli; cli._parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_cli_validate_and_plugins(tmp_path):
    ok = _cli("validate", "-c", os.path.join(EXAMPLES, "pipeline.yaml"))
    assert ok.returncode == 0, ok.stderr
    assert "ok (model" in ok.stdout
    bad = tmp_path / "p.yaml"
    bad.write_text("kv_cache: {plugin: paged, block_size: 12}\n")
    r = _cli("validate", "-c", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == "modserve validate: error: kv_cache.block_size: expected a power of two, got 12"
    listing = _cli("plugins")
    assert listing.returncode == 0
    for name in ("fcfs", "paged", "torch", "triton", "default", "block_size: int >= 1 <= 1024 = 16"):
        assert name in listing.stdout
    import json

    data = json.loads(_cli("plugins", "--json").stdout)
    assert data["contract"] == "2.8"
    assert {"fcfs", "priority", "static"} <= {p["name"] for p in data["plugins"]["schedulers"]}


def test_cuda_without_a_gpu_is_a_config_error_for_validate_and_serve(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    path = tmp_path / "cuda.yaml"
    path.write_text("model: {path: smollm2-135m-instruct}\ndevice: cuda\nserver: {port: 0}\n")
    for args in (["validate", "-c", str(path)], ["serve", "-c", str(path)]):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "device: 'cuda' requested but torch sees no CUDA device" in r.stderr
