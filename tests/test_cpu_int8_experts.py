"""int8 experts (``device.quantization: int8`` on a mixture of experts): the experts kernel over
int8 codes (``native/cpu_experts.cpp`` with ``avx512_bf16_panels.h`` / ``float32_panels.h``
widening them) and the torch path elsewhere (``plugins/platforms/cpu_int8_experts.py``).

What could go wrong, and is checked here: codes widened wrongly (sign, the even/odd inputs of a
pair), a channel's scale applied to another channel (the gated panels' order, a padded last
panel), the scales applied before rounding differently, the experts left in floats while the
scheme says int8, the router quantized, and a decode step with int8 experts that cannot replay."""

from __future__ import annotations

import logging

import pytest
import torch
from test_cpu_experts import (
    BUILDS, KERNEL_BUILDS, TAKES_KERNEL, engine, experts, needs_avx2, panel_linear, prompt_logprobs, tokens, torch_threads,
)
from tiny_models import build_model, prompts

from modserve import SamplingParams
from modserve.plugins.models.moe import SparseMoE
from modserve.plugins.platforms import cpu_experts
from modserve.plugins.platforms.cpu_experts import PanelExperts
from modserve.plugins.platforms.cpu_int8_experts import Int8LoopedExperts, quantize_experts
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear
from modserve.plugins.platforms.cpu_quant import Int8WeightOnlyLinear

INT8_LINEARS = (Int8PanelLinear, Int8WeightOnlyLinear)  # the int8 scheme's linears: on the panel kernels or in torch


def power_of_two_experts(hidden: int, num: int, top_k: int, width: int, dtype: torch.dtype, seed: int) -> SparseMoE:
    """Experts whose every output channel is int8 codes (absmax 127) times a power of two that
    differs from channel to channel: int8 quantization gives back those codes and scales
    exactly, and the kernel's (x . q) * s equals its bfloat16 product x . w bit for bit."""
    moe = experts(hidden, num, top_k, width, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for w in (moe.w13, moe.w2):
            q = torch.randint(-127, 128, w.shape, generator=g).float()
            q[..., seed % w.shape[2]] = 127
            shift = torch.arange(w.shape[1]) % 5 + 7
            w.copy_(q * torch.exp2(-shift.float())[None, :, None])
    return moe


def on_kernel(moe: SparseMoE, build: str, int8: bool) -> PanelExperts:
    out = PanelExperts(moe, BUILDS[build][1], int8=int8)
    out.gate = panel_linear(moe.gate, build)  # as the platform's linear swap leaves it
    return out


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(
    "hidden,num,top_k,width,count",
    [(64, 8, 1, 32, 5), (100, 16, 2, 48, 37), (96, 6, 3, 64, 300), (40, 3, 2, 16, 1)],
)
def test_int8_codes_give_the_bfloat16_weights_products_bit_for_bit(build, hidden, num, top_k, width, count, threads):
    """On power-of-two experts the codes carry every weight exactly, so the int8 kernel must give
    the bfloat16-weight kernel's output bit for bit: any slip in widening the codes, or a scale
    applied to another channel (scales differ by channel), changes it. Hidden 100 and 40 leave
    the down product's last panel part empty."""
    dtype = BUILDS[build][0]
    moe = power_of_two_experts(hidden, num, top_k, width, dtype, seed=hidden + count)
    x = tokens(count, hidden, dtype, seed=count)
    int8, floats = on_kernel(moe, build, int8=True), on_kernel(moe, build, int8=False)
    assert int8.w13.dtype == torch.int8 and int8.w13.nbytes * 2 == floats.w13.nbytes
    with torch_threads(threads):
        got = int8(x)
    assert torch.equal(got, floats(x))


def test_quantization_keeps_each_weight_within_half_a_step():
    """Per expert and output channel: codes in [-127, 127], the largest magnitude 127, and each
    weight within half a scale step of its code times the scale."""
    w = torch.randn(3, 24, 40) * torch.linspace(0.01, 2.0, 24)[None, :, None]
    codes, scale = quantize_experts(w)
    assert codes.dtype == torch.int8 and scale.shape == (3, 24)
    assert codes.abs().amax(dim=2).eq(127).all()
    assert ((codes.float() * scale[..., None] - w).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("top_k", [1, 4])
def test_the_kernel_and_the_torch_path_compute_the_same_int8_experts(build, top_k):
    """Random experts: the kernel against Int8LoopedExperts (codes widened in torch). In float32
    they agree to the float32 sums' order; in bfloat16 within a rounding step, most elements
    bit for bit (fewer with 4 experts a token: each of the 4 weighted outputs is rounded)."""
    dtype = BUILDS[build][0]
    moe = experts(96, 16, top_k, 64, dtype, seed=top_k)
    x = tokens(40, 96, dtype, seed=3)
    kernel = on_kernel(moe, build, int8=True)
    looped = Int8LoopedExperts(moe)
    looped.gate = kernel.gate
    got, want = kernel(x), looped(x)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
        assert (got == want).float().mean() > (0.95 if top_k == 1 else 0.75)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_int8_experts_stay_within_the_quantization_error_of_the_float_experts():
    """float32 experts (not bfloat16 values): the int8 experts differ from them (they are
    quantized), by at most 2% of the largest output, as the int8 scheme's linear layers."""
    moe = experts(128, 8, 2, 64, torch.float32, seed=7)
    with torch.no_grad():
        moe.w13.add_(torch.randn(moe.w13.shape) * 1e-3)  # off the bfloat16 grid
    x = tokens(64, 128, torch.float32, seed=4)
    want, got = moe(x), Int8LoopedExperts(moe)(x)
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.02


# ----------------------------------------------------------------------------- the platform


def expert_modules(llm) -> list[torch.nn.Module]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, (SparseMoE, PanelExperts))]


@pytest.mark.skipif(not TAKES_KERNEL, reason="bfloat16 experts take the kernel on AVX512_BF16 CPUs")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_int8_quantizes_the_experts_on_the_kernel_and_keeps_the_router(tmp_path, arch, caplog):
    """bfloat16, ``quantization: int8``: every mixture is a PanelExperts over int8 codes (half
    the bytes of its bfloat16 panels), its router a float layer, the attention quantized, the
    model capturable, no warning that experts stay in floats; the prompt logprobs move from the
    unquantized engine's by int8's error (the int8 linear scheme's bounds)."""
    build_model(str(tmp_path), arch)
    with caplog.at_level(logging.WARNING, logger="modserve.platform"):
        llm = engine(str(tmp_path), quantization="int8")
    model = llm.engine.runner.model
    moes = expert_modules(llm)
    assert moes and all(type(m) is PanelExperts and m.int8 and m.w13.dtype == torch.int8 and m.w2.dtype == torch.int8 for m in moes)
    assert not any(isinstance(m.gate, INT8_LINEARS) for m in moes)
    assert isinstance(model.layers[0].self_attn.qkv_proj, INT8_LINEARS) and model.capturable
    assert "keep their experts" not in caplog.text
    got, want = prompt_logprobs(llm), prompt_logprobs(engine(str(tmp_path)))
    assert 0 < (got - want).abs().max() <= 0.25 and (got - want).abs().mean() <= 0.05


@needs_avx2
def test_float32_int8_experts_replay_as_call_lists_with_the_eager_tokens(tmp_path):
    """A bfloat16 checkpoint served in float32 (its routers and head on the float32 panel
    kernel, which needs a bfloat16 grid; the int8 codes need none), ``quantization: int8``: the
    experts and the other linears on the float32 kernels over codes, and decode steps of 1-4
    requests replay as call lists with the eager engine's greedy tokens."""
    hf = build_model(str(tmp_path), "qwen3_moe")
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))
    ps = prompts(hf.config.vocab_size, count=5, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 24)]
    llm = engine(str(tmp_path), "float32", quantization="int8")
    model = llm.engine.runner.model
    assert all(type(m) is PanelExperts and m.int8 for m in expert_modules(llm)) and model.capturable
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8PanelLinear)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    graphs = llm.engine.runner.graphs
    assert graphs.unavailable is None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs.replays
    eager = engine(str(tmp_path), "float32", graphs=False, quantization="int8")
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], params)] == got


def test_without_the_kernel_int8_experts_run_in_torch_and_the_log_says_why(tmp_path, caplog, monkeypatch):
    """Where the kernel does not build, int8 still means int8 experts: Int8LoopedExperts, the log
    saying why once; its logprobs are the kernel's (where this CPU runs it) to bfloat16 rounding."""
    from modserve.native.build import KernelUnavailable

    build_model(str(tmp_path), "mixtral")
    kernel = engine(str(tmp_path), graphs=False, quantization="int8") if TAKES_KERNEL else None

    def broken(*args):
        raise KernelUnavailable("the mixture-of-experts kernel needs a C++ compiler (g++); none found on PATH or in $CXX")

    monkeypatch.setattr(cpu_experts, "load", broken)
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), graphs=False, quantization="int8")
    moes = expert_modules(llm)
    assert moes and all(type(m) is Int8LoopedExperts and m.q13.dtype == torch.int8 for m in moes)
    assert not llm.engine.runner.model.capturable
    assert caplog.text.count("device: mixtures of experts run int8 codes widened in torch (the mixture-of-experts kernel needs") == 1
    if kernel is not None:
        torch.testing.assert_close(prompt_logprobs(llm), prompt_logprobs(kernel), rtol=0, atol=0.05)
