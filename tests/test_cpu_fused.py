"""The fused CPU ops (norm + residual add, SiLU·mul, RoPE) in float32 and bfloat16: equal to
the torch ops they replace, on by default, off on request or where they cannot run (the
engine-wide HF parity tests run with them on)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.engine_factory import resolve
from modserve.core.models import cpu_fused
from modserve.plugins.models.layers import MLP, Attention, RMSNorm
from modserve.core.models.rope import apply_rotary
from modserve.native.build import compiler

# only without a compiler: a compile error fails these tests instead of skipping them
pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler")


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_adds_in_place_then_normalises(rows):
    torch.manual_seed(0)
    residual, weight = torch.randn(rows, 96), torch.randn(96)
    add = torch.randn(rows, 200)[:, 50:146]  # a strided view, as a sublayer's output can be
    want_residual = residual + add
    got = cpu_fused.add_rms_norm(residual, add, weight, 1e-6)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(got, reference_norm(want_residual, weight, 1e-6), rtol=1e-5, atol=1e-5)
    before = residual.clone()
    torch.testing.assert_close(cpu_fused.add_rms_norm(residual, None, weight, 1e-6), reference_norm(before, weight, 1e-6))
    assert torch.equal(residual, before)  # no add: the stream is only read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads", [(1, 4), (7, 2), (300, 1)])
def test_rms_norm_heads_reads_each_head_in_place_from_the_qkv_rows(rows, heads, dtype):
    """Qwen3's per-head and OLMo 2's whole-projection q/k norms straight from a strided view of
    the fused qkv rows: bit for bit the fused norm of the contiguous copy (what ran before)."""
    torch.manual_seed(rows)
    qkv = torch.randn(rows, heads * 32 + 40).to(dtype)
    q, weight = qkv[:, 8 : 8 + heads * 32], torch.randn(32).to(dtype)  # rows qkv.stride(0) apart
    got = cpu_fused.rms_norm_heads(q, weight, 1e-6, heads)
    assert got.is_contiguous() and got.shape == q.shape
    want = cpu_fused.add_rms_norm(q.reshape(rows * heads, 32).contiguous(), None, weight, 1e-6).view(rows, -1)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), reference_norm(q.float().reshape(rows * heads, 32), weight.float(), 1e-6).view(rows, -1),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match=r"rms_norm_heads of 3 heads of 32 over rows of"):
        cpu_fused.rms_norm_heads(q, weight, 1e-6, 3)
    residual = torch.randn(rows, heads * 32).to(dtype)
    want_sum = residual + want  # OLMo 2's post-norm add: torch's add of the rounded norm
    assert cpu_fused.rms_norm_heads(q, weight, 1e-6, heads, add_to=residual) is residual
    assert torch.equal(residual, want_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_is_torchs_multiply_by_a_python_float(dtype):
    """Granite's multipliers: bit for bit ``mul_`` (float32 product, one rounding), on strided rows."""
    x = torch.randn(70, 300).to(dtype)[:, 20:276]
    for factor in (0.22, 12.0, 1 / 3):
        want = x.clone().mul_(factor)
        assert cpu_fused.scale_(x, factor) is x and torch.equal(x, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_scales_by_one_plus_weight_in_float32(dtype):
    """``unit_offset``: the add, the norm and the q/k norms of Gemma fused, against the torch
    path (``(x_normed * (1 + w)).to(dtype)``): equal in bfloat16 (or one step apart, from the
    mean's summation order), to float32 rounding in float32."""
    torch.manual_seed(2)
    residual, add, weight = torch.randn(33, 96).to(dtype), torch.randn(33, 96).to(dtype), torch.randn(96).to(dtype)
    norm = RMSNorm(96, 1e-6, unit_offset=True)
    norm.weight.data = weight.clone()
    want_res, want = residual.clone(), norm.forward(residual.clone().add_(add))
    want_res.add_(add)
    norm.fused = True
    got = norm.forward(residual, add)
    assert torch.equal(residual, want_res)
    tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    assert dtype == torch.float32 or (got == want).float().mean() > 0.97
    heads = cpu_fused.rms_norm_heads(add, weight[:32], 1e-6, 3, offset=True)
    norm32 = RMSNorm(32, 1e-6, unit_offset=True)
    norm32.weight.data = weight[:32].clone()
    torch.testing.assert_close(heads, norm32.forward(add.reshape(99, 32).clone()).view(33, 96), **tol)
    into = torch.randn(33, 96).to(dtype)
    want_sum = into + cpu_fused.rms_norm_heads(add, weight, 1e-6, 1, offset=True)  # a post-norm add of Gemma's norm
    assert torch.equal(cpu_fused.rms_norm_heads(add, weight, 1e-6, 1, add_to=into, offset=True), want_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_torch(dtype):
    """GeGLU (Gemma): gelu with the tanh approximation times up, over the whole range; its tanh
    comes from the kernels' exp, so float32 agrees to ~1e-6 and bfloat16 to one rounding."""
    gate_up = torch.cat([torch.linspace(-12, 12, 4000).view(4, 1000), torch.randn(4, 1000)], 1).to(dtype)  # [gate | up] rows
    g, u = gate_up.split(1000, -1)
    want = F.gelu(g, approximate="tanh") * u  # in the model's dtype, as the unfused MLP
    got = cpu_fused.gelu_tanh_mul(gate_up)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_silu_mul_matches_torch_over_the_whole_range():
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 40) * 6
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -1e-8, 0.0, 50.0, 200.0])  # exp's clamp and both branches
    want = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    got = cpu_fused.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_rotates_q_and_k_in_place_and_leaves_v():
    torch.manual_seed(0)
    t, heads, kv_heads, d = 19, 4, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = qkv.split((heads * d, kv_heads * d, kv_heads * d), -1)
    want_q = apply_rotary(q.reshape(t, heads, d), cos[:, None], sin[:, None])
    want_k = apply_rotary(k.reshape(t, kv_heads, d), cos[:, None], sin[:, None])
    want_v = v.clone()
    cpu_fused.rope_(qkv, cos, sin, heads + kv_heads, d)
    torch.testing.assert_close(q.reshape(t, heads, d), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.reshape(t, kv_heads, d), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_of_part_of_each_head_leaves_the_rest(dtype):
    """Phi-4-mini rotates the first rotary_dim channels of each head: the fused op equals the
    torch path (``layers._rotate``: rotate, concatenate the rest), bit for bit in bfloat16
    (float32: up to the fused multiply-adds), and leaves the other channels alone."""
    from modserve.plugins.models.layers import _rotate

    torch.manual_seed(1)
    t, heads, d, r = 9, 3, 32, 24
    x = torch.randn(t, heads * d + 16).to(dtype)
    angles = torch.rand(t, r // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want = _rotate(x[:, : heads * d].reshape(t, heads, d), cos[:, None], sin[:, None], r)
    tail = x[:, heads * d :].clone()
    cpu_fused.rope_(x, cos, sin, heads, d, r)
    got = x[:, : heads * d].reshape(t, heads, d)
    assert torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., r:], want[..., r:]) and torch.equal(x[:, heads * d :], tail)
    with pytest.raises(ValueError, match="rope of 24 channels of 20-wide heads, cos rows of 24"):
        cpu_fused.rope_(x, cos, sin, heads, 20, 24)


def test_longrope_rows_are_the_rotary_tables(tmp_path):
    """LongRoPE's rows as a kernel (recordable) equal RotaryTable's torch choice: by position
    alone, and by each token's request length (a request longer than the original length
    takes the long factors for every token, also the early ones)."""
    from types import SimpleNamespace

    from modserve.core.models.rope import RotaryTable

    scaling = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
               "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # fmt: skip
    table = RotaryTable(8, 64, 10000.0, scaling, "cpu")
    positions = torch.tensor([0, 5, 15, 16, 3, 4, 40, 2], dtype=torch.int64)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32),
                           request_lens=torch.tensor([16, 17, 30, 3], dtype=torch.int32))  # fmt: skip
    for m in (None, meta):
        want = table._longrope_rows(positions, m)
        assert torch.equal(cpu_fused.longrope_rows(positions, m, table.original, table.max_positions), want)
    assert cpu_fused.longrope_rows(positions, meta, 16, 64).tolist() == [64, 69, 79, 16, 3, 4, 40, 66]


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bfloat16 steps (same-sign values: their bit patterns' difference)."""
    assert got.dtype == want.dtype == torch.bfloat16
    return int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max())


def test_bfloat16_ops_round_where_torchs_bfloat16_ops_do():
    """Each fused op against HF's unfused bfloat16 chain on the same bfloat16 inputs: equal
    but for the odd last-bit difference (float32 summation order in the norm, FMAs)."""
    torch.manual_seed(0)
    bf = torch.bfloat16
    residual, add, weight = (torch.randn(37, 576) * 4).to(bf), torch.randn(37, 576).to(bf), torch.randn(576).to(bf)
    want_residual = residual + add
    hf_norm = weight * (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))(want_residual.float()).to(bf)
    got = cpu_fused.add_rms_norm(residual, add, weight, 1e-5)
    assert torch.equal(residual, want_residual)
    assert got.dtype == bf and bf16_ulps(got, hf_norm) <= 1 and (got != hf_norm).float().mean() < 0.01

    gate_up = (torch.randn(37, 2 * 96) * 4).to(bf)
    want = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    got = cpu_fused.silu_mul(gate_up)
    assert bf16_ulps(got, want) <= 1 and (got != want).float().mean() < 0.01

    t, heads, d = 37, 6, 64
    qkv = torch.randn(t, heads * d).to(bf)
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(bf), torch.cat([angles.sin()] * 2, -1).to(bf)
    want = apply_rotary(qkv.view(t, heads, d), cos[:, None], sin[:, None]).reshape(t, -1)
    cpu_fused.rope_(qkv, cos, sin, heads, d)
    assert torch.equal(qkv, want)


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU rows"):
        cpu_fused.silu_mul(torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"all one dtype"):
        cpu_fused.add_rms_norm(torch.randn(4, 8, dtype=torch.bfloat16), None, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual stream must be contiguous"):
        cpu_fused.add_rms_norm(torch.randn(8, 4).t(), None, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match=r"unit inner stride, got .*\(torch.float32, 'cpu', \(1, 4\)\)"):
        cpu_fused.rope_(torch.randn(8, 4).t(), torch.randn(4, 8), torch.randn(4, 8), 1, 8)
    with pytest.raises(ValueError, match=r"CPU rows .*'meta'"):
        cpu_fused.silu_mul(torch.empty(4, 8, device="meta"))


def fused_flags(llm: LLM) -> set[bool]:
    return {m.fused for m in llm.engine.c.runner.model.modules() if isinstance(m, (RMSNorm, Attention, MLP))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_fuses_unless_told_not_to_and_tokens_agree(tiny_models, dtype):
    prompts = [[3, 4, 5, 6], [9] * 40, list(range(5, 70))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for arch in ("llama", "qwen2"):  # tied + GQA; qkv bias
        path, _ = tiny_models[arch]
        tokens = {}
        for fuse in (True, False):
            llm = LLM(model={"path": path, "dtype": dtype}, device={"plugin": "cpu", "fuse_ops": fuse}, kv_cache={"plugin": "paged", "num_blocks": 64})
            assert fused_flags(llm) == {fuse}
            tokens[fuse] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert tokens[True] == tokens[False], arch


def test_not_fused_for_float16_or_without_a_compiler(tiny_llama, monkeypatch, tmp_path, caplog):
    path, _ = tiny_llama
    kv = {"plugin": "paged", "num_blocks": 64}
    assert fused_flags(LLM(model={"path": path, "dtype": "float16"}, kv_cache=kv, attention={"plugin": "torch"})) == {False}
    monkeypatch.setenv("MODSERVE_CACHE_DIR", str(tmp_path))  # no cached build to fall back on
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_fused.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="modserve.models"):
            llm = LLM(model={"path": path}, kv_cache=kv, attention={"plugin": "torch"})
        assert fused_flags(llm) == {False}
        assert "device.fuse_ops: compiling the fused cpu ops failed" in caplog.text
    finally:
        cpu_fused.load.cache_clear()


def test_a_non_boolean_setting_names_its_field(tiny_llama):
    with pytest.raises(ConfigError, match=r"device\.fuse_ops: expected bool, got 'yes'"):
        resolve({"model": {"path": tiny_llama[0]}, "device": {"plugin": "cpu", "fuse_ops": "yes"}})
