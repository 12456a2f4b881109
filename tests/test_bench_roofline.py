"""``modserve bench roofline``: the FLOP count against a hand computation, the engine part on a
tiny model (shares, MFU, per-step accounting equal to the analytic count), argument errors."""

from __future__ import annotations

import json

import pytest
import yaml

from modserve import LLM, cli
from modserve.bench.roofline import (
    held_weight_bytes,
    kv_bytes_per_context_token,
    layer_matmul_params,
    model_flops,
    read_model_spec,
    weight_bytes,
)
from modserve.core.models.loader import locate
from modserve.core.contract import ModelSpec
from tiny_models import build_model


def small_spec(**overrides) -> ModelSpec:
    fields = dict(
        model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False,
    )
    return ModelSpec(**{**fields, **overrides})


def test_model_flops_matches_a_hand_computation():
    spec = small_spec()
    # one layer's matmul weights: qkv 8 x (2 + 2*1) * 4 = 128, o 8*8 = 64, gate_up 8 x 32 = 256, down 16 x 8 = 128
    layer = 128 + 64 + 256 + 128
    # prompt 3, output 2: positions 0..3 computed (the last output token never goes back in)
    matmuls = 2 * layer * 2 * 4  # 2 FLOPs per weight, 2 layers, 4 tokens
    attention = 4 * 2 * 4 * 2 * (1 + 2 + 3 + 4)  # 4 * heads * head_dim * layers * sum of contexts
    lm_head = 2 * 8 * 10 * 2  # one row for the last prompt token, one for the decode step
    assert model_flops(spec, 3, 2) == matmuls + attention + lm_head == 10176
    # a single output token: only the prompt is computed, one sampled row
    assert model_flops(spec, 3, 1) == 2 * layer * 2 * 3 + 4 * 2 * 4 * 2 * 6 + 2 * 8 * 10
    with pytest.raises(ValueError):
        model_flops(spec, 0, 4)


def test_bytes_helpers():
    spec = small_spec()
    assert weight_bytes(spec, 4) == (576 * 2 + 8 * 10) * 4
    assert kv_bytes_per_context_token(spec, 2) == 2 * 2 * 1 * 4 * 2
    assert kv_bytes_per_context_token(spec, 4, int8=True) == 2 * 2 * 1 * (4 + 4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Only the Llama checkpoint (the session's ``tiny_models`` builds three)."""
    path = str(tmp_path_factory.mktemp("roofline-llama"))
    build_model(path, "llama")
    return path


def test_held_weight_bytes_are_the_weights_as_the_platform_keeps_them(tiny_dir):
    """The decode roofline's bytes a step: what the model holds (the tied head once, the
    embedding table not at all), not every weight in the model's dtype: int8 codes hold a
    quarter of float32's bytes (and a bfloat16 checkpoint on the AVX2 kernel half)."""
    spec = read_model_spec(locate(tiny_dir))
    norms, head = (2 * spec.num_layers + 1) * spec.hidden_size * 4, spec.vocab_size * spec.hidden_size * 4
    kv = {"plugin": "paged", "num_blocks": 64}
    plain = LLM(model={"path": tiny_dir, "dtype": "float32"}, device={"plugin": "cpu", "pack_weights": False}, kv_cache=kv)
    assert held_weight_bytes(plain.engine.runner.model) == weight_bytes(spec, 4) + norms
    int8 = LLM(model={"path": tiny_dir, "dtype": "float32"}, device={"plugin": "cpu", "quantization": "int8"}, kv_cache=kv)
    layers = weight_bytes(spec, 4) - head
    assert norms + head + layers / 4 <= held_weight_bytes(int8.engine.runner.model) < norms + head + layers / 2


@pytest.fixture
def tiny_config(tiny_dir, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": tiny_dir, "max_model_len": 256},
        "device": "cpu",
        "kv_cache": {"plugin": "paged", "num_blocks": 64},
    }))
    return str(path)


def test_engine_part_on_a_tiny_model(tiny_dir, tiny_config, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    argv = ["bench", "roofline", "-c", tiny_config, "--quick", "--dtypes", "bfloat16", "--concurrency", "4",
            "--num-prompts", "6", "--input-len", "20", "--output-len", "7", "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "MFU over model forward" in printed and "decode roofline" in printed
    result = json.loads(out.read_text())
    machine, e = result["machine"], result["engine"]
    assert set(machine["dtypes"]) == {"bfloat16", "float32"}  # the model's dtype is measured too
    assert e["dtype"] == "float32" and e["output_tokens"] == 6 * 7
    assert abs(sum(e["shares"].values()) - 1.0) < 1e-6
    assert all(0.0 <= s <= 1.0 for s in e["shares"].values())
    assert set(e["shares"]) == {"model", "schedule", "prepare", "sample", "output", "other"}
    assert e["model_flops"] > 0
    assert 0.0 < e["mfu_wall"] <= e["mfu_model"] <= 1.0
    assert e["overhead_share"] == pytest.approx(1.0 - e["shares"]["model"])
    # the per-step accounting (scheduled tokens, their contexts, sampled rows) equals the analytic count
    spec = read_model_spec(locate(tiny_dir))
    assert e["model_flops"] == 6 * model_flops(spec, 20, 7)
    assert e["executed_flops"] == pytest.approx(e["model_flops"], rel=1e-12)
    assert e["counts"]["scheduled_tokens"] == 6 * (20 + 7 - 1)
    assert e["counts"]["generation_tokens"] == 6 * 7
    d = e["decode"]
    assert d["steps"] > 0 and 1 <= d["mean_batch"] <= 4
    assert d["bytes"] > d["steps"] * weight_bytes(spec, 4)  # weights every step, plus the KV read
    assert d["arithmetic_intensity"] > 0 and d["achieved_gb_s"] > 0
    # the read bandwidth measured again after the run, and the decode steps' share of it
    assert d["read_gb_s_after"] > 0
    assert d["bandwidth_share_after"] == pytest.approx(d["achieved_gb_s"] / d["read_gb_s_after"])
    assert f"of the {d['read_gb_s_after']:.1f} GB/s measured after the run" in printed
    assert e["notes"] == []
    # the forward by part: every linear and attention call of every timed step was seen
    p, steps = e["forward_parts"], e["counts"]["steps"]
    assert p["calls"] == {"linears": steps * (4 * spec.num_layers + 1), "attention": steps * spec.num_layers}
    layers = 2 * layer_matmul_params(spec) * spec.num_layers * 6 * (20 + 7 - 1)
    assert p["linear_flops"] == layers + 2 * spec.hidden_size * spec.vocab_size * 6 * 7
    assert p["seconds"]["linears"] > 0 and p["seconds"]["attention"] > 0
    assert p["seconds"]["linears"] + p["seconds"]["attention"] <= e["times_s"]["model"]
    assert e["output_tok_s"] < p["ceiling_linears_attention_tok_s"] < p["ceiling_linears_tok_s"]
    assert p["ceiling_linears_tok_s"] == pytest.approx(6 * 7 / p["seconds"]["linears"])
    assert "ceiling: linears + attention" in printed and "attention backend" in printed
    # ... and by kind of step: every step is one kind, the decode-only ones are the decode roofline's steps
    kinds = p["by_step_kind"]
    assert set(kinds) == {"decode_only", "with_prompt"}
    assert kinds["decode_only"]["steps"] == d["steps"] and sum(k["steps"] for k in kinds.values()) == steps
    assert kinds["with_prompt"]["steps"] >= 2  # 6 prompts, at most 4 at a time
    for part in ("linears", "attention"):
        assert sum(k[f"{part}_s"] for k in kinds.values()) == pytest.approx(p["seconds"][part])
        assert all(k[f"{part}_s"] > 0 for k in kinds.values())
    assert sum(k["model_s"] for k in kinds.values()) == pytest.approx(e["times_s"]["model"])
    assert "decode-only steps (" in printed and "steps with prompt chunks or drafts (" in printed


def test_engine_part_with_ragged_lengths(tiny_dir, tiny_config, tmp_path, capsys):
    """``--range-ratio``: each request's own lengths, as bench serve's random dataset draws them;
    the analytic FLOPs add up request by request and still equal the per-step count."""
    import argparse

    from modserve.bench.throughput import make_requests

    out = tmp_path / "roofline.json"
    argv = ["bench", "roofline", "-c", tiny_config, "--quick", "--dtypes", "float32", "--concurrency", "4",
            "--num-prompts", "8", "--input-len", "20", "--output-len", "8", "--range-ratio", "0.5",
            "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "(20 in + 8 out ± 50%)" in capsys.readouterr().out
    e = json.loads(out.read_text())["engine"]
    spec = read_model_spec(locate(tiny_dir))
    drawn = make_requests(argparse.Namespace(num_prompts=8, input_len=20, output_len=8, range_ratio=0.5, seed=0),
                          spec.vocab_size)
    assert len({r.prompt_len for r in drawn}) > 1 and len({r.output_len for r in drawn}) > 1
    assert e["output_tokens"] == sum(r.output_len for r in drawn) and e["range_ratio"] == 0.5
    assert e["model_flops"] == sum(model_flops(spec, r.prompt_len, r.output_len) for r in drawn)
    assert e["executed_flops"] == pytest.approx(e["model_flops"], rel=1e-12)
    assert e["counts"]["scheduled_tokens"] == sum(r.prompt_len + r.output_len - 1 for r in drawn)
    assert e["notes"] == []


def test_skip_engine_measures_the_machine_only(tiny_config, tmp_path, capsys):
    out = tmp_path / "machine.json"
    argv = ["bench", "roofline", "-c", tiny_config, "--quick", "--skip-engine", "--dtypes", "float32,bfloat16",
            "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "Matmul GFLOP/s" in printed and "Memory bandwidth" in printed and "Engine:" not in printed
    platform = next(line for line in printed.splitlines() if line.startswith("Platform: cpu on "))
    assert "Chose: dtype " in printed and ", attention " in printed and ", linears: " in printed
    from modserve.plugins.platforms.cpu import cpu_model_and_flags

    name, flags = cpu_model_and_flags()
    assert name in platform and all(f in platform for f in ("avx2", "amx_bf16") if f in flags)
    result = json.loads(out.read_text())
    assert result["engine"] is None
    m = result["machine"]
    assert list(m["dtypes"]) == ["float32", "bfloat16"]
    for d in m["dtypes"].values():
        names = [s["name"] for s in d["shapes"]]
        assert names.count("lm_head") == 2 and names[-1] == "square"  # M = 1 and 8 in quick mode
        assert d["peak_flops_per_s"] == max(s["flops_per_s"] for s in d["shapes"]) > 0
        lm = next(s for s in d["shapes"] if s["name"] == "lm_head")
        assert (lm["n"], lm["k"]) == (384, 64)  # the tiny model's vocabulary x hidden
    assert m["bandwidth"]["read_gb_s"] > 0 and m["bandwidth"]["copy_gb_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["--dtypes", "float32,int4"], "--dtypes: expected float32, bfloat16 or float16, got 'int4'"),
    (["--num-prompts", "-1"], "--num-prompts: must be >= 1, got -1"),
    (["--input-len", "0"], "--input-len: must be >= 1, got 0"),
    (["--output-len", "0"], "--output-len: must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["--input-len", "250", "--output-len", "10"], "--input-len + --output-len: up to 260 tokens exceed max_model_len 256"),
    (["--input-len", "200", "--output-len", "10", "--range-ratio", "0.5"],
     "--input-len + --output-len: up to 315 tokens at --range-ratio 0.5 exceed max_model_len 256"),
    (["--range-ratio", "1"], "--range-ratio: must be in [0, 1), got 1.0"),
    (["--range-ratio", "-0.1"], "--range-ratio: must be in [0, 1), got -0.1"),
])
def test_bad_arguments_exit_2_naming_the_flag(tiny_config, args, message, capsys):
    assert cli.main(["bench", "roofline", "-c", tiny_config, "--quick", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("modserve bench: error: ") and message in err
    assert err.count("\n") == 1


def test_forward_parts_time_each_outermost_linear_once():
    """Quantized linears are linears too (all of a GGUF model's are), and a layer held as pieces
    (a GGUF layer mixing kinds) is one timed call, not one more for each piece."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from modserve.bench.forward_parts import ForwardParts
    from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, QuantizedLinear

    class Pieces(QuantizedLinear):
        def __init__(self, layer: nn.Linear) -> None:
            super().__init__(layer)
            self.pieces = nn.ModuleList([nn.Linear(64, 16) for _ in range(4)])

        def product(self, rows):
            return torch.cat([p(rows) for p in self.pieces], -1)

    model = nn.Sequential(Int4WeightOnlyLinear(nn.Linear(64, 64), 32), Pieces(nn.Linear(64, 64)), nn.Linear(64, 8))
    parts = ForwardParts()
    attention = SimpleNamespace(forward=lambda: None)
    detach = parts.attach(model, attention)
    with torch.inference_mode():
        model(torch.randn(3, 64))
    attention.forward()
    assert parts.calls == {"linears": 3, "attention": 1}
    detach()
    model(torch.randn(3, 64))
    assert parts.calls == {"linears": 3, "attention": 1}  # detached: nothing timed any more


@pytest.mark.parametrize("fields, flags, want", [
    ({"model name": "AMD EPYC", "cpu family": "25", "model": "17", "stepping": "1"},
     {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"},
     "AMD EPYC (family 25, model 17, stepping 1; avx2, avx512f, avx512_bf16)"),
    ({"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143", "stepping": "8"},
     {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8"},
     "Intel(R) Xeon(R) Processor (family 6, model 143, stepping 8; avx2, avx512f, avx512_bf16, avx512_fp16, amx_bf16, amx_int8)"),
    ({}, set(), "a CPU (no AVX2)"),
])
def test_the_cpu_is_described_by_generation_and_the_flags_kernels_choose_by(monkeypatch, fields, flags, want):
    """One model name covers several generations ("AMD EPYC": Zen 3, 4 and 5), so a figure's CPU is
    named with its family, model and stepping too; the platform's info (which `bench roofline`
    prints) and `benchmarks/compare.sh`'s machine note both say it this way."""
    from modserve.plugins.platforms import cpu

    monkeypatch.setattr(cpu, "_cpuinfo", lambda: fields)
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: (fields.get("model name", "a CPU"), frozenset(flags)))
    assert cpu.describe_cpu() == want
    assert cpu.CPUPlatform(cpu.CPUConfig(decode_graphs=False), None).info().name == want
