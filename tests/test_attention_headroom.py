"""``benchmarks/attention_headroom.py``: in ``real`` mode the engine is untouched (same tokens as
a plain engine); in ``stream`` and ``free`` the kernel never sees a decode row, and ``stream``
sweeps exactly the K/V bytes those rows would have read; bad arguments exit 2 naming the flag."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml

from modserve import LLM, SamplingParams
from modserve.plugins.attention import cpu_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_headroom as headroom  # noqa: E402

PROMPTS = [[5 + i for i in range(n)] for n in (3, 7, 12)]
OUTPUTS = [4, 6, 3]


@pytest.fixture
def tiny_config(tiny_llama, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": tiny_llama[0], "max_model_len": 128},
        "device": "cpu",
        "kv_cache": {"plugin": "paged", "block_size": 4, "num_blocks": 64, "prefix_caching": True},
        "attention": {"plugin": "cpu"},
    }))  # fmt: skip
    return str(path)


def _args(config, *extra):
    return headroom.parse_args(["-c", config, "--dtype", "float32", "--concurrency", "4", *extra])


def _plain(config):
    """The engine without the shadowing, scheduled as the script schedules."""
    return LLM(config, model={"dtype": "float32"}, scheduler={"plugin": "fcfs", "max_num_seqs": 4, "max_num_batched_tokens": 2048})


def _generate(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in OUTPUTS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _kernel_rows(monkeypatch):
    """How many rows each call of the compiled kernel attends for."""
    seen, real = [], cpu_backend.kernel.attend

    def spy(step, *rest, **kw):
        seen.append(step.rows.numel())
        return real(step, *rest, **kw)

    monkeypatch.setattr(cpu_backend.kernel, "attend", spy)
    return seen


def test_real_mode_is_the_plain_engine(tiny_config, monkeypatch):
    llm, decode = headroom.build(_args(tiny_config))
    assert llm.engine.kv.config.prefix_caching is False  # rounds repeat the prompts
    plain = _plain(tiny_config)
    seen = _kernel_rows(monkeypatch)
    assert _generate(llm) == _generate(plain)
    assert max(seen) >= 2 and decode.bytes_streamed == 0  # decode steps batch rows of several requests


@pytest.mark.parametrize("mode", ["stream", "free"])
def test_decode_rows_skip_the_kernel_and_stream_reads_their_bytes(tiny_config, monkeypatch, mode):
    llm, decode = headroom.build(_args(tiny_config))
    decode.mode = mode
    seen = _kernel_rows(monkeypatch)
    outs = _generate(llm)
    assert [len(t) for t in outs] == OUTPUTS
    spec = llm.engine.c.spec
    # the prompts' rows go to the kernel (one call a layer), their decode rows never do
    assert sum(seen) == spec.num_layers * sum(map(len, PROMPTS))
    # a decode step at position p reads p + 1 positions of K and of V in every layer
    contexts = sum(p + 1 for prompt, n in zip(PROMPTS, OUTPUTS) for p in range(len(prompt), len(prompt) + n - 1))
    per_position = spec.num_kv_heads * spec.head_dim * 4 * 2 * spec.num_layers  # float32, K and V
    assert decode.bytes_streamed == (contexts * per_position if mode == "stream" else 0)
    decode.mode = "real"
    assert _generate(llm) == _generate(_plain(tiny_config))


def test_main_prints_every_round_and_the_ratios(tiny_config, capsys):
    assert headroom.main(["-c", tiny_config, "--dtype", "float32", "--concurrency", "4", "--num-prompts", "3",
                          "--input-len", "8", "--output-len", "4", "--rounds", "2", "--modes", "real,free"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("round")] == [
        ["round", "1", "real"], ["round", "1", "free"], ["round", "2", "free"], ["round", "2", "real"]]
    assert out.splitlines()[-2].split()[0] == "real" and out.splitlines()[-2].split()[2] == "1.00x"


@pytest.mark.parametrize("argv, message", [
    (["--modes", "stream,free"], "--modes: a comma-separated list of real, stream, free that includes real"),
    (["--modes", "real,fast"], "--modes: a comma-separated list"),
    (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["--range-ratio", "1"], "--range-ratio: must be in [0, 1), got 1.0"),
])  # fmt: skip
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        headroom.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_other_backends_are_refused(tiny_config, tmp_path):
    raw = yaml.safe_load(Path(tiny_config).read_text())
    raw["attention"] = {"plugin": "torch"}
    path = tmp_path / "torch.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit, match="needs the `cpu` attention backend, got TorchAttention"):
        headroom.build(types.SimpleNamespace(**{**vars(_args(tiny_config)), "config": str(path)}))
